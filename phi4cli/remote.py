"""Remote engines: `--backend URL` sends `phi4 solve` and `phi4 chat` to any OpenAI-compatible
server (llama.cpp's llama-server, vLLM, Ollama, llama-cpp-python's server, another `phi4 serve`)
instead of the local daemon, producing the same events, so output, reasoning handling and exit
codes match.

Built on httpx2 (the maintained httpx line that huggingface_hub and openai already bring in) and its
server-sent-events reader, so nothing here parses HTTP or SSE by hand. Servers differ in how they
send thinking, and each stream is read as it comes:

- in its own field, ``reasoning_content`` (llama-server, vLLM) or ``reasoning`` (newer vLLM,
  Ollama): then ``content`` is the answer;
- inline in ``content`` between ``<think>`` and ``</think>`` (or, for a reasoning model that omits
  the opening tag, up to ``</think>``).

``--think-budget`` is enforced here, because these servers have no such option: at the budget the
stream is closed and the server is asked again with the thinking so far closed by ``</think>`` as
the start of the assistant's reply, so the model goes on with its answer.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx

from phi4cli.errors import DaemonUnavailableError
from phi4cli.protocol import ErrorCode, Event, EventKind, Stats
from phi4cli.reasoning import THINK_CLOSE, THINK_OPEN, ThinkSplitter, model_thinks

CONNECT_TIMEOUT_S = 10.0
_CODE_FOR_STATUS = {400: ErrorCode.BAD_REQUEST, 404: ErrorCode.BAD_REQUEST,
                    413: ErrorCode.BAD_REQUEST, 429: ErrorCode.BUSY,
                    503: ErrorCode.SHUTTING_DOWN, 504: ErrorCode.TIMEOUT}  # fmt: skip


def backend_key() -> str | None:
    """The API key for the remote backend, from PHI4_BACKEND_KEY."""
    return os.environ.get("PHI4_BACKEND_KEY")


def messages_for(params: dict[str, Any]) -> list[dict[str, str]]:
    system = params.get("system")
    messages = [{"role": "system", "content": system}] if system else []
    messages += list(params.get("history") or [])
    question = params.get("message", params.get("prompt"))
    messages.append({"role": "user", "content": str(question)})
    return messages


class _Failure(Exception):
    """The stream ended in an error: the terminal event to report."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Reader:
    """Turns one server's deltas into reasoning and answer pieces, whichever way it sends them."""

    def __init__(self, thinks: bool) -> None:
        self.separate: bool | None = None  # None until the stream shows which way it goes
        self.inline = ThinkSplitter(starts_in_reasoning=thinks)
        self.after_thinking = ThinkSplitter(starts_in_reasoning=False)
        self.reasoning_pieces = 0
        self.answer_pieces = 0

    @property
    def splitter(self) -> ThinkSplitter:
        return self.after_thinking if self.separate else self.inline

    @property
    def in_reasoning(self) -> bool:
        if self.separate:
            return not self.answer_pieces
        return self.inline.in_reasoning

    def feed(self, delta: dict[str, Any]) -> list[tuple[EventKind, str]]:
        pieces: list[tuple[EventKind, str]] = []
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            if self.separate is None:
                self.separate = True
            pieces.append((EventKind.REASONING, reasoning))
        content = delta.get("content")
        if isinstance(content, str) and content:
            if self.separate is None:
                self.separate = False
            pieces += _kinds(self.splitter.feed(content))
        for kind, _text in pieces:
            if kind == EventKind.REASONING:
                self.reasoning_pieces += 1
            elif kind == EventKind.TOKEN:
                self.answer_pieces += 1
        return pieces

    def finish(self) -> list[tuple[EventKind, str]]:
        return _kinds(self.splitter.finish())

    @property
    def unfinished(self) -> bool:
        if self.separate:
            return not self.answer_pieces
        return self.inline.unfinished


def _kinds(pieces: list[tuple[str, str]]) -> list[tuple[EventKind, str]]:
    names = {"answer": EventKind.TOKEN, "reasoning": EventKind.REASONING,
             "retract": EventKind.RETRACT}  # fmt: skip
    return [(names[kind], text) for kind, text in pieces]


class RemoteEngine:
    """One OpenAI-compatible server, with the model name it serves."""

    def __init__(
        self, url: str, model: str, api_key: str | None = None, timeout: float = 300.0
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.thinks = model_thinks(model)

    @property
    def endpoint(self) -> str:
        base = self.url if self.url.endswith("/v1") else self.url + "/v1"
        return base + "/chat/completions"

    def _body(self, params: dict[str, Any], messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}}  # fmt: skip
        for key in ("temperature", "top_p", "seed", "max_tokens"):
            if params.get(key) is not None:
                body[key] = params[key]
        return body

    def stream(self, params: dict[str, Any]) -> Iterator[Event]:
        """Yield the events of one solve or chat request: ``reasoning``, ``token``, ``retract``,
        ``stats``, then ``done`` or ``error``. Closing the iterator closes the HTTP response,
        which stops the server's generation.

        Raise DaemonUnavailableError when the server cannot be reached at all.
        """
        started = time.monotonic()
        reader = _Reader(self.thinks)
        state = _StreamState(started)
        budget = params.get("think_budget")
        messages = messages_for(params)
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = httpx.Timeout(self.timeout, connect=CONNECT_TIMEOUT_S)
        with httpx.Client(timeout=timeout, headers=headers) as client:
            try:
                if budget == 0 and self.thinks:
                    # No thinking at all: start the answer straight away.
                    state.budget_reached = True
                else:
                    body = self._body(params, messages)
                    for kind, text in self._events(client, body, reader, state, budget):
                        yield Event(kind, text=text)
                    for kind, text in reader.finish():
                        yield Event(kind, text=text)
                if state.budget_reached:
                    yield from self._answer_after_budget(client, params, messages, reader, state)
            except _Failure as failure:
                yield Event.of_stats(state.stats(self, reader, params))
                yield Event.error(failure.code, failure.message)
                return
        yield Event.of_stats(state.stats(self, reader, params))
        yield Event(EventKind.DONE, data={"finish_reason": state.finish})

    def _answer_after_budget(
        self,
        client: httpx.Client,
        params: dict[str, Any],
        messages: list[dict[str, str]],
        reader: _Reader,
        state: _StreamState,
    ) -> Iterator[Event]:
        """Ask for the answer with the thinking closed: the reply so far, ended by </think>, is
        sent as the start of the assistant's message for the server to continue."""
        thinking = state.reasoning_text
        prefix = f"{THINK_OPEN}\n{thinking.strip()}\n{THINK_CLOSE}\n\n"
        body = self._body(params, [*messages, {"role": "assistant", "content": prefix}])
        # vLLM continues a final assistant message only when asked; llama-server always does.
        body.update(continue_final_message=True, add_generation_prompt=False)
        if params.get("max_tokens") is not None:
            body["max_tokens"] = max(1, int(params["max_tokens"]) - state.completion_pieces)
        answer = _Reader(thinks=False)
        answer.separate = False
        for kind, text in self._events(client, body, answer, state, None):
            if kind == EventKind.REASONING:
                continue  # a server that thinks again: the budget is spent, keep only the answer
            yield Event(kind, text=text)
        for kind, text in answer.finish():
            if kind != EventKind.REASONING:
                yield Event(kind, text=text)
        reader.answer_pieces += answer.answer_pieces

    def _events(
        self,
        client: httpx.Client,
        body: dict[str, Any],
        reader: _Reader,
        state: _StreamState,
        budget: int | None,
    ) -> Iterator[tuple[EventKind, str]]:
        try:
            with client.stream("POST", self.endpoint, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _http_failure(response)
                source = httpx.EventSource(response)
                finished = False
                for sse in source:
                    if sse.data.strip() == "[DONE]":
                        finished = True
                        break
                    chunk = _chunk(sse.data)
                    state.usage(chunk)
                    for choice in chunk.get("choices") or []:
                        if not isinstance(choice, dict):
                            continue
                        if choice.get("finish_reason"):
                            state.finish = str(choice["finish_reason"])
                            finished = True
                        delta = choice.get("delta") or {}
                        for kind, text in reader.feed(delta if isinstance(delta, dict) else {}):
                            state.seen(kind, text)
                            yield kind, text
                        if (
                            budget is not None
                            and reader.in_reasoning
                            and reader.reasoning_pieces >= budget
                        ):
                            state.budget_reached = True
                            return  # leaving the with-block closes the response
                if not finished:
                    raise _Failure(
                        ErrorCode.BACKEND_ERROR,
                        "the backend closed the stream before the answer was complete",
                    )
        except httpx.ConnectError as error:
            raise DaemonUnavailableError(
                f"cannot reach the backend {self.url}: {_reason(error)}"
            ) from None
        except httpx.TimeoutException:
            raise _Failure(
                ErrorCode.TIMEOUT,
                f"the backend {self.url} sent nothing for {self.timeout:g} s "
                "(PHI4_BACKEND_TIMEOUT sets how long to wait)",
            ) from None
        except httpx.SSEError as error:
            raise _Failure(
                ErrorCode.BACKEND_ERROR, f"the backend's reply is not a stream: {error}"
            ) from None
        except httpx.TransportError as error:
            raise _Failure(
                ErrorCode.BACKEND_ERROR, f"the connection to the backend broke: {_reason(error)}"
            ) from None
        except (httpx.RequestError, httpx.InvalidURL) as error:  # a body it cannot decode, ...
            raise _Failure(
                ErrorCode.BACKEND_ERROR, f"the backend's reply cannot be read: {_reason(error)}"
            ) from None


def _reason(error: Exception) -> str:
    cause = error.__cause__ or error.__context__
    text = str(error) or (str(cause) if cause else type(error).__name__)
    return text.removeprefix("[Errno 111] ")


def _chunk(data: str) -> dict[str, Any]:
    """One streamed chunk; a malformed one, or one that carries an error, ends the stream."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        shown = data if len(data) <= 80 else data[:77] + "..."
        raise _Failure(ErrorCode.BACKEND_ERROR,
                       f"the backend sent a malformed event: {shown!r}") from None  # fmt: skip
    if not isinstance(chunk, dict):
        raise _Failure(ErrorCode.BACKEND_ERROR, "the backend sent an event that is not an object")
    error = chunk.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else str(error)
        status = error.get("code") if isinstance(error, dict) else None
        code = _CODE_FOR_STATUS.get(status if isinstance(status, int) else 0,
                                    ErrorCode.BACKEND_ERROR)  # fmt: skip
        raise _Failure(code, f"the backend reported an error mid-answer: {message}")
    return chunk


def _http_failure(response: httpx.Response) -> _Failure:
    detail = response.text
    try:
        detail = json.loads(detail)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        detail = detail.strip()[:300] or response.reason_phrase
    code = _CODE_FOR_STATUS.get(response.status_code, ErrorCode.BACKEND_ERROR)
    return _Failure(code, f"the backend answered {response.status_code}: {detail}")


class _StreamState:
    """What one request's streams have produced, for its Stats."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first_token_s: float | None = None
        self.finish: str | None = None
        self.budget_reached = False
        self.completion_pieces = 0
        self.reasoning_parts: list[str] = []
        self.answer_parts: list[str] = []
        self.reported: dict[str, Any] = {}
        self.timings: dict[str, Any] = {}

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning_parts)

    def seen(self, kind: EventKind, text: str) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.started
        if kind == EventKind.RETRACT:  # the answer so far was thinking after all
            self.reasoning_parts += self.answer_parts
            self.answer_parts = []
            return
        self.completion_pieces += 1
        (self.reasoning_parts if kind == EventKind.REASONING else self.answer_parts).append(text)

    def usage(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.reported = usage
        timings = chunk.get("timings")  # llama-server's own
        if isinstance(timings, dict):
            self.timings = timings

    def stats(self, engine: RemoteEngine, reader: _Reader, params: dict[str, Any]) -> Stats:
        total = time.monotonic() - self.started
        usage, timings = self.reported, self.timings
        details = usage.get("completion_tokens_details") or {}
        completion = int(usage.get("completion_tokens") or self.completion_pieces)
        reasoning = int(details.get("reasoning_tokens") or reader.reasoning_pieces)
        if self.budget_reached:
            # Two requests, and the first was cut off before its usage came: count the stream.
            completion, reasoning = self.completion_pieces, reader.reasoning_pieces
        first = self.first_token_s
        prompt_eval_s = timings.get("prompt_ms", (first or total) * 1000.0) / 1000.0
        decode_s = timings.get("predicted_ms", (total - (first or total)) * 1000.0) / 1000.0
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        prompt = int(usage.get("prompt_tokens") or 0)
        return Stats(
            prompt_tokens=prompt,
            cached_tokens=int(cached if cached is not None else timings.get("cache_n") or 0),
            prompt_eval_tokens=int(timings.get("prompt_n") or prompt),
            prompt_eval_s=round(prompt_eval_s, 4),
            completion_tokens=completion,
            reasoning_tokens=min(reasoning, completion),
            answer_tokens=max(0, completion - reasoning),
            budget_reached=self.budget_reached,
            thinking_unfinished=reader.unfinished and not self.budget_reached,
            decode_s=round(decode_s, 4),
            first_token_s=None if first is None else round(first, 4),
            total_s=round(total, 4),
            finish_reason="length" if self.finish == "length" else "stop",
            seed=params.get("seed"),
            model=f"{engine.model} at {engine.url}",
            extra={"usage_reported": bool(usage)},
        )
