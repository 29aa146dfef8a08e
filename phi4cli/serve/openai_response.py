"""The answer of ``phi4 serve`` in OpenAI's shape: each choice's daemon events folded (its text
up to a stop string, its logprobs, how it ended), whole or as server-sent chunks, the choices
interleaved; the usage counted as OpenAI counts ``n`` choices."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import anyio.to_thread

from phi4cli.backends.backend import RequestStream
from phi4cli.backends.outcome import Outcome
from phi4cli.core.errors import Phi4Error
from phi4cli.core.protocol import (
    ErrorCode,
    Event,
    EventKind,
    Stats,
)
from phi4cli.serve.openai_request import ApiError, without_paths
from phi4cli.text.check_verdicts import Check
from phi4cli.text.checker import Checker
from phi4cli.text.reasoning import GrowingText, extract_final_answer


def _finish_reason(outcome: Outcome) -> str:
    return "length" if outcome.stats is not None and outcome.stats.length_limited else "stop"


async def next_event(stream: RequestStream) -> Event | None:
    """The stream's next event, read in a worker thread; None after the terminal one."""

    def read() -> Event | None:
        return next(stream, None)

    return await anyio.to_thread.run_sync(read)


class StopStrings:
    """Where an answer ends: at the first of its stop strings, fed piece by piece. Text that
    could be the start of one is held back until the pieces after it say whether it is, so a
    stop string split across tokens is found as one written whole."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return the text that may be passed on now, and whether a stop string was reached
        (then that text is all of the answer before it)."""
        text = self.held + text
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.held = ""
            return text[: min(found)], True
        keep = 0  # the longest end of the text that begins a stop string
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:size]):
                    keep = size
                    break
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The text held back, at the answer's end (no stop string came of it)."""
        held, self.held = self.held, ""
        return held


# A delta for the client, and the logprobs entries of the tokens it carries (None: no logprobs
# asked for, or none with it).
Delta = tuple[dict[str, Any], list[dict[str, Any]] | None]


class Choice:
    """One choice of a completion: its daemon request's events folded, its answer up to the
    first stop string, how it ended and, when asked for, its answer tokens' logprobs."""

    def __init__(
        self,
        index: int,
        stream: RequestStream,
        stops: tuple[str, ...],
        logprobs: bool = False,
        streamed: bool = False,
    ) -> None:
        self.index, self.stream = index, stream
        self.outcome = Outcome(index=index, question="")
        self.stops = StopStrings(stops)
        self._content = GrowingText()  # the answer as sent: up to a stop string
        self._reasoning = GrowingText()
        # A stream's chunks carry their logprobs and keep none: a whole answer's are kept for
        # its one body (each entry with 20 alternatives is some 10 KB of objects: n = 16
        # streams of thousands of tokens held gigabytes until they ended).
        self.streamed = streamed
        self.stopped = False  # a stop string was reached, and the request cancelled there
        # The text is known to be the answer once the thinking is known to be closed before it:
        # a reasoning event came first, or a retract (a </think> never opened). Until then it may
        # be thinking still, and a stop string found in it only ends what is sent: the request
        # runs on, and a later </think> makes all of it thinking (the stop was in the thinking).
        self.answering = False
        self.held_stop = False  # a stop string found in text that may still be thinking
        # The answer's tokens' logprobs, as sent (None: not asked for), those not sent yet, and
        # how much of the content the sent ones' text covers.
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self._unsent: list[dict[str, Any]] = []
        self._covered = 0
        self.check: Check | None = None  # its answer checked against the question (phi4_check)

    @property
    def content(self) -> str:
        return str(self._content)

    @property
    def reasoning(self) -> str:
        return str(self._reasoning)

    def apply(self, event: Event) -> list[Delta]:
        """Fold one event; return the deltas it makes for the client."""
        had_text = self.outcome.has_solution  # (not joined at every event: see GrowingText)
        before = self.outcome.solution if event.kind == EventKind.RETRACT else ""
        self.outcome.apply(event)
        if self.stopped:
            if event.terminal:  # the cancel's end (or any end): the answer ended at its stop
                self.outcome.error = None
            return []
        if self.held_stop and event.kind == EventKind.DONE:
            # It ended with no </think>: the text was the answer, and it ended at its stop.
            self.stopped = True
            return []
        if self.held_stop and event.kind == EventKind.TOKEN:
            return []  # past a stop string: sent only if a </think> makes it all thinking
        if self.logprobs is not None and event.kind == EventKind.TOKEN:
            self._unsent += event.get("logprobs") or []
        deltas: list[Delta] = []
        if event.kind == EventKind.TOKEN and event.text:
            text, found = self.stops.feed(event.text)
            self.stopped, self.held_stop = found and self.answering, found and not self.answering
            if text:
                self._content.add(text)
                deltas.append(({"content": text}, self._send()))
            if self.stopped:
                self.stream.cancel()  # the events go on to its end, with its stats
        elif event.kind == EventKind.REASONING and event.text:
            self.answering = self.answering or not had_text
            self._reasoning.add(event.text)
            deltas.append(({"reasoning_content": event.text}, None))
        elif event.kind == EventKind.RETRACT:
            self.answering = True
            if before:
                # Text sent as answer was thinking after all (a model that closed a <think> it
                # never opened): send it again as reasoning, so that is complete; a stop string
                # found in it was in the thinking, and is looked for again in the answer.
                self.stops.flush()
                self.held_stop = False
                self._content = GrowingText()
                self._reasoning.add(before)
                if self.logprobs is not None:  # they were the thinking's tokens
                    self.logprobs, self._unsent, self._covered = [], [], 0
                deltas.append(({"reasoning_content": before}, None))
        elif event.kind == EventKind.DONE:
            rest = self.stops.flush()
            self._content.add(rest)
            if rest or self._unsent:
                deltas.append(({"content": rest}, self._send()))
        return deltas

    def _send(self) -> list[dict[str, Any]] | None:
        """The logprobs entries to send with the content sent so far: all those waiting, or
        after a stop string only those whose text begins before it."""
        if self.logprobs is None or not self._unsent:
            return None
        sent: list[dict[str, Any]] = []
        for entry in self._unsent:
            if (self.stopped or self.held_stop) and self._covered >= len(self._content):
                break
            sent.append(entry)
            self._covered += len(entry.get("token", ""))
        self._unsent = []
        if not self.streamed:
            self.logprobs += sent
        return sent or None

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else _finish_reason(self.outcome)

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        return message


def _checked(choice: Choice) -> dict[str, Any]:
    """A choice's extension field ``phi4_check`` (its answer checked against the question),
    where it was checked: on the choice of a whole answer, on a stream's last chunk of it."""
    return {} if choice.check is None else {"phi4_check": choice.check.to_json()}


def _logprobs_of(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A choice's (or a chunk's) ``logprobs`` object, as OpenAI writes it."""
    return None if entries is None else {"content": entries, "refusal": None}


def _usage(choices: list[Choice]) -> dict[str, Any]:
    """The completion's usage, counted as OpenAI and vLLM count ``n`` choices: the prompt once,
    the completions' tokens summed; cached: the prompt's tokens every choice found cached."""
    stats: list[Stats] = [c.outcome.stats for c in choices if c.outcome.stats is not None]
    prompt = stats[0].prompt_tokens if stats else 0
    completion = sum(s.completion_tokens for s in stats)
    cached = min((s.cached_tokens for s in stats), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def close_when_read(future: asyncio.Future[Any], stream: RequestStream) -> None:
    """Close ``stream`` once the read in flight on it returns (never while a thread reads it)."""

    def close(done: asyncio.Future[Any]) -> None:
        if not done.cancelled():
            done.exception()  # (retrieved: a daemon gone as the client hung up is no news)
        stream.close()

    future.add_done_callback(close)


async def _events(
    choices: list[Choice],
    first: list[list[Event]],
    pending: dict[int, asyncio.Future[list[Event]]] | None = None,
) -> AsyncGenerator[tuple[Choice, Event]]:
    """Each choice's events as they come, interleaved, beginning with those already read (and
    those of the reads ``pending``, by choice, each a list up to a first event that is not
    progress); the caller folds each before asking for the next. A choice whose daemon went
    away, or whose events ended early, ends with an error event. Leaving early cancels the
    requests still running and closes their streams as their reads in flight return."""
    reads: dict[asyncio.Future[Any], Choice] = {}

    def read(choice: Choice) -> None:
        reads[asyncio.ensure_future(next_event(choice.stream))] = choice

    try:
        for choice, events in zip(choices, first, strict=True):
            for event in events:
                yield choice, event
        for choice in choices:
            in_flight = (pending or {}).pop(choice.index, None)
            if in_flight is not None:
                reads[in_flight] = choice
            elif not choice.outcome.done:
                read(choice)
        while reads:
            finished, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(finished, key=lambda f: reads[f].index):
                choice = reads.pop(future)
                try:
                    result = future.result()
                except Phi4Error as exc:
                    result = Event.error(
                        ErrorCode.INTERNAL,
                        f"the daemon went away mid-answer: {without_paths(str(exc))}",
                    )
                got: list[Event | None] = list(result) if isinstance(result, list) else [result]
                for read_event in got or [None]:
                    if read_event is None:
                        read_event = Event.error(
                            ErrorCode.INTERNAL, "the daemon's answer ended early"
                        )
                    yield choice, read_event
                if not choice.outcome.done:
                    read(choice)
    finally:
        for index, future in (pending or {}).items():  # (left before they were taken over)
            reads[future] = choices[index]
        for future, choice in reads.items():
            choice.stream.cancel()
            close_when_read(future, choice.stream)
        for choice in choices:
            if choice not in reads.values():
                choice.stream.close()


class Completion:
    """One chat completion's answer, whole or as chunks: its choices interleaved."""

    def __init__(
        self,
        model_name: str,
        choices: list[Choice],
        include_usage: bool,
        checker: Checker | None = None,
        question: str = "",
    ) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model_name = model_name
        self.choices = choices
        self.include_usage = include_usage
        self.checker, self.question = checker, question

    async def check(self, choice: Choice) -> None:
        """Check the final answer of ``choice`` as sent (up to a stop string) against the
        question, in a worker thread: its ``phi4_check`` (none with ``check off``)."""
        answer = extract_final_answer(choice.content)
        if self.checker is None or answer is None or choice.outcome.error is not None:
            return
        choice.check = await anyio.to_thread.run_sync(self.checker.check, self.question, answer)

    async def check_all(self) -> None:
        for choice in self.choices:
            await self.check(choice)

    async def fold(self, first: list[list[Event]]) -> Choice | None:
        """Read every choice to its end; return the first that failed (None if none did)."""
        async with contextlib.aclosing(_events(self.choices, first)) as events:
            async for choice, event in events:
                choice.apply(event)
                if choice.outcome.error is not None:
                    return choice
        return None

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "message": c.message(),
                    "logprobs": _logprobs_of(c.logprobs),
                    "finish_reason": c.finish_reason,
                    **_checked(c),
                }
                for c in self.choices
            ],
            "usage": _usage(self.choices),
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if self.include_usage:  # as OpenAI: null on every chunk but the last
            chunk["usage"] = usage
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def _delta(
        self,
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        return self._chunk(
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": _logprobs_of(logprobs),
                    "finish_reason": finish,
                    **(extra or {}),
                }
            ]
        )

    async def sse(
        self,
        first: list[list[Event]],
        pending: dict[int, asyncio.Future[list[Event]]] | None = None,
    ) -> AsyncIterator[bytes]:
        """The answer as server-sent events, each choice's chunks carrying its ``index``. An
        error after the stream began (the daemon stopped or died, the request was cancelled)
        is sent as an ``error`` object, and the stream ends without ``[DONE]``, as OpenAI's own
        API does; hanging up cancels the requests."""
        for choice in self.choices:
            yield self._delta(choice.index, {"role": "assistant", "content": ""})
        failed: Choice | None = None
        async with contextlib.aclosing(_events(self.choices, first, pending)) as events:
            async for choice, event in events:
                for delta, logprobs in choice.apply(event):
                    yield self._delta(choice.index, delta, logprobs=logprobs)
                if choice.outcome.error is not None:
                    failed = choice
                    break
                if event.terminal:
                    await self.check(choice)
                    yield self._delta(
                        choice.index, {}, choice.finish_reason, extra=_checked(choice)
                    )
        if failed is not None:
            assert failed.outcome.error is not None
            error = ApiError.of(failed.outcome.error)
            yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
            return
        if self.include_usage:
            yield self._chunk([], _usage(self.choices))
        yield b"data: [DONE]\n\n"
