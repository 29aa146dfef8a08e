"""The wire protocol between client and daemon: newline-delimited JSON, versioned, typed.

Lightweight on purpose: no sockets, no engine, nothing beyond the standard library, so the client
path, the daemon and the HTTP server all import it for free. Everything both ends must agree on
lives here: the ops, the event kinds, the error codes, the statistics of an answer, the request
schemas (validated here and nowhere else) and the line framing.

A request is one line ``{"v": 1, "id": ..., "op": ..., "params": {...}}``. The daemon answers with
event lines carrying the same id: ``accepted``, ``progress``, ``reasoning``, ``token``,
``retract``, ``stats``, and then exactly one terminal ``done`` or ``error``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final, NamedTuple

from phi4cli.core._settings import Ask
from phi4cli.core.errors import ErrorCode as ErrorCode  # the wire's error codes
from phi4cli.core.errors import Fault, Phi4Error, cli_words, error_for
from phi4cli.core.option_values import MAX_COUNT

PROTOCOL_VERSION: Final = 1
# A request line longer than this is refused: questions are short, and an unbounded line would let
# one client make the daemon buffer arbitrary amounts of memory.
MAX_LINE_BYTES: Final = 1 << 20
MAX_PROMPT_CHARS: Final = 256_000
# Brackets nested deeper than this are refused before the line is parsed: no request needs more
# than a few levels, and a deep one would take the JSON decoder (recursive) past Python's limit.
MAX_NESTING: Final = 32
# A chat request's history holds at most this many messages (the daemon drops turns that do not
# fit its context anyway): it bounds what one request costs the engine's thread to prepare.
MAX_HISTORY_MESSAGES: Final = 2_000
# A chat session id becomes part of the daemon's bookkeeping and (hashed) of a file name: plain
# words only. Clients send a uuid's hex.
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

JSON = dict[str, "Any"]


class Op(StrEnum):
    SOLVE = "solve"
    CHAT = "chat"
    LOAD = "load"
    STATUS = "status"
    STOP = "stop"
    CANCEL = "cancel"
    # Change a running or queued request: its confidence_floor, or answer_now (close the
    # thinking so the model answers from what it has).
    ADJUST = "adjust"
    PING = "ping"
    # Forget the prompts the engine keeps in RAM (``phi4 cache clear``): ``done`` with
    # ``{"prompt_cache": {"prompts": N, "bytes": B}}``, what it held.
    CLEAR = "clear"


class EventKind(StrEnum):
    ACCEPTED = "accepted"  # queued: ``ahead`` (requests before it), ``state`` of the daemon
    PROGRESS = "progress"  # ``stage``: loading (a model) or waiting (for memory)
    REASONING = "reasoning"  # a piece of the model's thinking
    TOKEN = "token"  # a piece of the answer
    RETRACT = "retract"  # all answer text so far was thinking after all
    STATS = "stats"  # the request's Stats, just before its terminal event
    # Client side only (never on the wire): the request was sent again, to a fresh daemon or
    # another replica, after its engine failed mid-answer; what it produced so far is void.
    RESTART = "restart"
    DONE = "done"
    ERROR = "error"

    @property
    def terminal(self) -> bool:
        return self in (EventKind.DONE, EventKind.ERROR)


class ProtocolViolation(Exception):
    """A request that cannot be served; carries the error code and the request id if known,
    and for a field at fault its wire name (``param``) and what is wrong with it (``detail``),
    so that a door that names the field its own way (serve: ``max_completion_tokens``) words it
    from these, not from ``message``."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        request_id: Any = None,
        param: str | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.param = param
        self.detail = detail

    @classmethod
    def field(cls, param: str, detail: str, request_id: Any = None) -> ProtocolViolation:
        """A bad request: field ``param`` ``detail`` (say, "must be true or false")."""
        return cls(ErrorCode.BAD_REQUEST, f"'{param}' {detail}", request_id, param, detail)


# --- statistics ---------------------------------------------------------------------------------


# The records here are NamedTuples, not dataclasses: importing dataclasses (it imports inspect)
# would cost every `phi4 solve` more than the daemon takes to answer a short question.


class Stats(NamedTuple):
    """What one answer cost: tokens by kind, timings, how it ended. The daemon measures all of it;
    a remote server fills what it reports (``measured`` says which were counted here)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_eval_tokens: int = 0
    prompt_eval_s: float = 0.0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    answer_tokens: int = 0
    budget_reached: bool = False
    # A loop caught in the output (phi4cli.text.loops): "answered" (the thinking was ended there and
    # the model answered) or "stopped"; loop_at: the tokens generated by then.
    loop: str | None = None
    loop_at: int | None = None
    waits: int = 0  # early ends of thinking replaced by "Wait" (--min-think)
    # The thinking was closed because the answer was asked for now (``adjust``'s answer_now:
    # the user's key); the model answered from what it had.
    answered_early: bool = False
    # The answer's confidence from its token probabilities (phi4cli.text.confidence), when asked for
    # and known: the mean over its tokens, and the lowest over a window of them.
    confidence: float | None = None
    lowest_group_confidence: float | None = None
    thinking_unfinished: bool = False
    decode_s: float = 0.0
    # Exact self-speculation (the daemon's speculate setting): tokens drafted and verified, and
    # of them those kept (each also counted in completion_tokens).
    draft_tokens: int = 0
    draft_accepted: int = 0
    first_token_s: float | None = None
    total_s: float | None = None
    load_s: float = 0.0
    finish_reason: str | None = None
    seed: int | None = None
    model: str | None = None
    # Chat turns: how much of the context the conversation fills, and turns dropped to fit.
    context_used: int | None = None
    n_ctx: int | None = None
    dropped_turns: int = 0
    extra: Mapping[str, Any] = {}  # anything else the engine reported (never mutated)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Stats:
        known = set(cls._fields) - {"extra"}
        extra = {k: v for k, v in data.items() if k not in known and k not in ("v", "id", "event")}
        return cls(**{k: v for k, v in data.items() if k in known}, extra=extra)

    def to_dict(self) -> JSON:
        record = self._asdict()
        extra = record.pop("extra")  # popped first: the dict must not carry it twice
        return {**record, **extra}

    @property
    def length_limited(self) -> bool:
        """The answer stopped at a token limit (or the context's end), not by itself."""
        return self.finish_reason in ("length", "context")


# --- events -------------------------------------------------------------------------------------


class Event(NamedTuple):
    """One event of a request's stream, as the client side sees it."""

    kind: EventKind
    id: Any = None
    text: str = ""
    data: Mapping[str, Any] = {}  # the kind's other fields (never mutated)

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> Event:
        """Read a decoded event line; raise ProtocolViolation for one that is not an event."""
        try:
            kind = EventKind(str(message.get("event")))
        except ValueError:
            raise ProtocolViolation(
                ErrorCode.BAD_REQUEST, f"unknown event {message.get('event')!r}"
            ) from None
        data = {k: v for k, v in message.items() if k not in ("v", "id", "event", "text")}
        return cls(kind, message.get("id"), str(message.get("text") or ""), data)

    @classmethod
    def error(
        cls, code: ErrorCode, message: str, request_id: Any = None, fault: Fault | None = None
    ) -> Event:
        data: dict[str, Any] = {"code": code, "message": message, "retryable": code.retryable}
        if fault is not None:
            data["fault"] = fault.to_wire()
        return cls(EventKind.ERROR, request_id, data=data)

    @classmethod
    def of_stats(cls, stats: Stats, request_id: Any = None) -> Event:
        return cls(EventKind.STATS, request_id, data=stats.to_dict())

    def to_wire(self) -> JSON:
        text = {"text": self.text} if self.text or self.kind in _TEXT_KINDS else {}
        return {"v": PROTOCOL_VERSION, "id": self.id, "event": self.kind.value, **text, **self.data}

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def terminal(self) -> bool:
        return self.kind.terminal

    @property
    def code(self) -> ErrorCode:
        """An error event's code."""
        return ErrorCode.of(self.data.get("code"))

    @property
    def message(self) -> str:
        """An error event's message."""
        return str(self.data.get("message") or self.data.get("code") or "")

    @property
    def fault(self) -> Fault | None:
        """An error event's facts (the field at fault, the numbers), where it gives them."""
        return Fault.from_wire(self.data.get("fault"))

    @property
    def said(self) -> str:
        """An error event as the command line words it: from its fault, else its message."""
        fault = self.fault
        return self.message if fault is None else cli_words(fault)

    def exception(self) -> Phi4Error:
        """An error event as the exception the CLI reports (worded from its fault)."""
        return error_for(self.code, self.message, self.fault)

    @property
    def stats(self) -> Stats:
        """A stats event's Stats."""
        return Stats.from_mapping(self.data)

    @property
    def result(self) -> JSON:
        """A done event's result (status, load timings, ...)."""
        result = self.data.get("result")
        return dict(result) if isinstance(result, Mapping) else {}


_TEXT_KINDS = frozenset({EventKind.TOKEN, EventKind.REASONING})


# --- requests -----------------------------------------------------------------------------------


class Request(NamedTuple):
    id: Any
    op: str
    params: JSON
    v: int = PROTOCOL_VERSION


PRIORITY_INTERACTIVE: Final = 0
PRIORITY_SOLVE: Final = 1
PRIORITY_BULK: Final = 2
PRIORITIES: Final = {
    "interactive": PRIORITY_INTERACTIVE,
    "solve": PRIORITY_SOLVE,
    "bulk": PRIORITY_BULK,
}


class SolveParams(NamedTuple):
    """A solve, chat or load request, typed: what the client fills, the daemon and a remote
    server read. Its wire form (a dict) is made by :func:`to_wire` and read back, checked, by
    :func:`parse_params`, and by nothing else."""

    prompt: str  # the question (a chat's message); "" for a load
    ask: Ask = Ask()  # what it asks of the engine: the settings table's request rows
    model: str | None = None  # a path to a .gguf (the daemon's), or a server's model name
    # How long the daemon stays after this request (a duration's seconds; -1: forever); None:
    # as it is. It sets the daemon's life, not the answer, so it is not one of the ask's.
    keep_alive: float | None = None
    priority: int = PRIORITY_SOLVE
    # Chat turns: the session id and the complete turns before this message.
    session: str | None = None
    history: tuple[dict[str, str], ...] = ()
    load_only: bool = False  # `phi4 warm`: load (and warm) the model, generate nothing
    # Work out the answer's confidence from its token probabilities (phi4cli.text.confidence): asked
    # for by what shows or votes with it, since it costs a pass over the vocabulary per token.
    confidence: bool = False
    # DeepConf online (``--stop-unsure``): stop once the last GROUP tokens' confidence falls
    # below this (finish_reason "unsure"); None: never. Implies ``confidence``.
    confidence_floor: float | None = None
    # OpenAI's logprobs of the answer's tokens (phi4 serve): None, none; N, each token's
    # log-probability and its step's N likeliest (0 to MAX_TOP_LOGPROBS), on its token event.
    logprobs: int | None = None
    # The client's own: the samples of one question share a group, so that a remote server
    # may be asked them in one request (``n``). Never on the daemon's wire.
    sample_group: int | None = None
    # Whose share of the daemon's queue and slots it counts against: ``phi4 serve`` names the
    # HTTP client, so that a request's ``n`` choices (each a daemon request of its own) count as
    # one client's. None: its connection's.
    share: str | None = None


MAX_SHARE_CHARS: Final = 200
MAX_TOP_LOGPROBS: Final = 20  # as OpenAI's top_logprobs


def confidence_floor(params: Mapping[str, Any]) -> float | None:
    """A request's (or an ``adjust``'s) ``confidence_floor``: a finite number, or None."""
    value = params.get("confidence_floor")
    if value is None:
        return None
    # Compared, not converted, first: JSON's 1 followed by 400 zeros is an int no float holds.
    largest = sys.float_info.max
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not -largest <= value <= largest
    ):
        raise ProtocolViolation.field("confidence_floor", "must be a number, or null")
    return float(value)


def answer_now(params: Mapping[str, Any]) -> bool:
    """An ``adjust``'s ``answer_now``: true, false or absent (false)."""
    value = params.get("answer_now", False)
    if not isinstance(value, bool):
        raise ProtocolViolation.field("answer_now", "must be true or false")
    return value


def _number(params: Mapping[str, Any], key: str, low: float, high: float) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ProtocolViolation.field(key, f"must be a number from {low} to {high}")
    return float(value)


def _optional_int(
    params: Mapping[str, Any], key: str, low: int, high: int = MAX_COUNT
) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolViolation.field(key, f"must be a whole number from {low} to {high}")
    return value


def parse_ask(params: Mapping[str, Any], defaults: Ask) -> Ask:
    """What a request asks (its ``Ask``): each of the settings table's request rows it gives,
    checked as the row says (``options.Setting.wire``), and ``defaults`` (the daemon's
    settings, ``Ask.of``) for the rest and for a null where the row's type has no None.

    Raise ProtocolViolation(bad_request) naming the offending field.
    """
    from phi4cli.core.options import CHOICES, SETTING

    given: dict[str, Any] = {}
    for key in Ask._fields:
        row, value = SETTING[key], params.get(key)
        if value is None:
            if key in params and row.type.endswith("| None"):
                given[key] = None
        elif row.wire is not None:
            low, high = row.wire
            if isinstance(low, int) and isinstance(high, int):
                given[key] = _optional_int(params, key, low, high)
            else:
                given[key] = _number(params, key, low, high)
        elif row.type == "bool":
            if not isinstance(value, bool):
                raise ProtocolViolation.field(key, "must be true or false")
            given[key] = value
        elif key in CHOICES:
            if value not in CHOICES[key]:
                raise ProtocolViolation.field(key, f"must be one of {', '.join(CHOICES[key])}")
            given[key] = value
        else:  # text
            if not isinstance(value, str):
                raise ProtocolViolation.field(key, "must be a string or null")
            given[key] = value or None
    return defaults._replace(**given)


def parse_solve_params(params: Mapping[str, Any], defaults: Ask) -> SolveParams:
    """Validate a solve request's params; what it does not ask takes ``defaults`` (the
    daemon's settings, ``Ask.of``).

    Raise ProtocolViolation(bad_request) naming the offending field.
    """
    from phi4cli.core.durations import parse_duration

    _check_text(params)
    prompt = params.get("prompt")
    if not isinstance(prompt, str):
        raise ProtocolViolation.field("prompt", "(the question) must be a string")
    if not prompt.strip():
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "empty question: give a problem to solve")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST,
            f"question is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}",
        )
    model = params.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ProtocolViolation.field("model", "must be a path to a .gguf file")
    keep_alive = params.get("keep_alive")
    try:
        keep_alive_s = None if keep_alive is None else parse_duration(keep_alive)
    except ValueError:
        raise ProtocolViolation.field(
            "keep_alive",
            "must be a duration like 30m or 0, or -1 (forever)",
        ) from None
    priority = params.get("priority", "solve")
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise ProtocolViolation.field("priority", f"must be one of {', '.join(PRIORITIES)}")
    confidence = params.get("confidence", False)
    if not isinstance(confidence, bool):
        raise ProtocolViolation.field("confidence", "must be true or false")
    floor = confidence_floor(params)
    logprobs = params.get("logprobs")
    if logprobs is not None and (
        isinstance(logprobs, bool)
        or not isinstance(logprobs, int)
        or not 0 <= logprobs <= MAX_TOP_LOGPROBS
    ):
        raise ProtocolViolation.field(
            "logprobs",
            f"must be a number of likeliest tokens from 0 to {MAX_TOP_LOGPROBS}, or null",
        )
    return SolveParams(
        prompt=prompt,
        ask=parse_ask(params, defaults),
        model=model or None,
        keep_alive=keep_alive_s,
        priority=PRIORITIES[priority],
        confidence=confidence or floor is not None,
        confidence_floor=floor,
        logprobs=logprobs,
        share=_share(params),
    )


def _share(params: Mapping[str, Any]) -> str | None:
    value = params.get("share")
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_SHARE_CHARS):
        raise ProtocolViolation.field(
            "share",
            f"must be a name of 1 to {MAX_SHARE_CHARS} characters, or null",
        )
    return value


_PRIORITY_NAMES: Final = {number: name for name, number in PRIORITIES.items()}


def to_wire(op: str, params: SolveParams) -> JSON:
    """The wire form of a solve, chat or load request: what :func:`parse_params` reads back
    as ``params``. All of its ask is sent: the client's settings, not the daemon's."""
    wire: JSON
    if op == Op.LOAD:
        wire = {"model": params.model}
    else:
        wire = {**params.ask._asdict(), "priority": _PRIORITY_NAMES[params.priority]}
        if op == Op.CHAT:
            wire.update(session=params.session, message=params.prompt, history=list(params.history))
        else:
            wire["prompt"] = params.prompt
        if params.model is not None:
            wire["model"] = params.model
        if params.confidence:
            wire["confidence"] = True
        for key in ("confidence_floor", "logprobs", "share"):
            if getattr(params, key) is not None:
                wire[key] = getattr(params, key)
    if params.keep_alive is not None:
        wire["keep_alive"] = params.keep_alive
    return wire


def _check_text(params: Mapping[str, Any]) -> None:
    """Refuse params holding text UTF-8 cannot encode, naming the field (for callers that
    validate params without a wire line, as `phi4 serve` does)."""
    bad = unencodable(dict(params))
    if bad is not None:
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, _not_unicode(bad))


def _not_unicode(where: str) -> str:
    return (
        f"{where} is not valid Unicode text (it holds a lone surrogate such as \\ud800); "
        "send UTF-8 text"
    )


def check_history(history: object) -> tuple[dict[str, str], ...]:
    """Validate a conversation's complete turns (user, assistant, user, ...); return them."""
    valid = isinstance(history, list) and len(history) % 2 == 0
    if valid:
        assert isinstance(history, list)
        for index, message in enumerate(history):
            expected = "user" if index % 2 == 0 else "assistant"
            valid = valid and (
                isinstance(message, dict)
                and message.get("role") == expected
                and isinstance(message.get("content"), str)
            )
    if not valid:
        raise ProtocolViolation.field(
            "history",
            "must be complete turns: user, assistant, user, assistant, ...",
        )
    assert isinstance(history, list)
    return tuple({"role": m["role"], "content": m["content"]} for m in history)


def parse_chat_params(params: Mapping[str, Any], defaults: Ask) -> SolveParams:
    """Validate a chat request: ``session``, ``message`` and ``history`` (complete turns).

    Raise ProtocolViolation(bad_request) naming the offending field.
    """
    _check_text(params)
    session = params.get("session")
    if not isinstance(session, str) or not SESSION_ID.fullmatch(session):
        raise ProtocolViolation.field(
            "session",
            "must be 1 to 128 letters, digits and . _ : - (starting with a letter or digit)",
        )
    history = params.get("history", [])
    if isinstance(history, list) and len(history) > MAX_HISTORY_MESSAGES:
        raise ProtocolViolation.field(
            "history",
            f"holds {len(history):,} messages; the limit is {MAX_HISTORY_MESSAGES:,} "
            "(send the most recent turns only)",
        )
    turns = check_history(history)
    solve = parse_solve_params(
        {**params, "prompt": params.get("message"), "priority": "interactive"}, defaults
    )
    return solve._replace(session=session, history=turns)


def parse_load_params(params: Mapping[str, Any], defaults: Ask) -> SolveParams:
    """Validate a load request (``model``); raise ProtocolViolation(bad_request)."""
    model = params.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolViolation.field("model", "must be a path to a .gguf file")
    request = {"prompt": "-", "model": model, "priority": "interactive"}
    if "keep_alive" in params:
        request["keep_alive"] = params["keep_alive"]
    return parse_solve_params(request, defaults)._replace(prompt="", load_only=True)


def parse_params(op: str, params: Mapping[str, Any], defaults: Ask) -> SolveParams:
    """Validate the wire form of a solve, chat or load request (``to_wire`` makes it) into
    its typed record; what it does not ask takes ``defaults`` (the daemon's, ``Ask.of``)."""
    parse = {Op.SOLVE: parse_solve_params, Op.CHAT: parse_chat_params, Op.LOAD: parse_load_params}[
        Op(op)
    ]
    return parse(params, defaults)


# --- framing ------------------------------------------------------------------------------------


class LineTooLong(Exception):
    """A line exceeded MAX_LINE_BYTES: the stream cannot be resynchronised."""


class LineFramer:
    """Split a byte stream into lines, for the blocking client and the asyncio server alike.

    Keeps a partial line across reads (a Ctrl-C between two reads loses nothing) and refuses a
    line longer than ``limit`` instead of buffering it.
    """

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return the complete lines (each with its newline)."""
        self._buffer += data
        lines: list[bytes] = []
        start = 0
        while (end := self._buffer.find(b"\n", start)) >= 0:
            lines.append(bytes(self._buffer[start : end + 1]))
            start = end + 1
        del self._buffer[:start]
        if len(self._buffer) > self._limit or any(len(line) > self._limit for line in lines):
            raise LineTooLong(f"a line longer than {self._limit} bytes")
        return lines

    @property
    def pending(self) -> bytes:
        """The incomplete line received so far."""
        return bytes(self._buffer)


def encode(message: JSON) -> bytes:
    """Return one wire line (UTF-8 JSON, no embedded newlines, trailing newline).

    Never raises for text that UTF-8 cannot hold (a lone surrogate): such characters go out as
    U+FFFD, so an event that echoes a bad string still reaches its client.
    """
    text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode() + b"\n"
    except UnicodeEncodeError:
        # Only lone surrogates fail here; UTF-16 with surrogatepass keeps them as code units
        # that its decoder then replaces.
        clean = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return clean.encode() + b"\n"


def encode_request(request: Request) -> bytes:
    return encode({"v": request.v, "id": request.id, "op": request.op, "params": request.params})


# A JSON string (escapes included), to be skipped when counting brackets.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def nesting_depth(line: bytes) -> int:
    """How deep the line's brackets nest, strings aside (counted up to one past MAX_NESTING): a
    linear scan, no parsing. Brackets of a malformed line (an unclosed string) count as they
    come; the parser refuses it anyway."""
    if line.count(b"[") + line.count(b"{") <= MAX_NESTING:
        return 0  # too few brackets to matter: the common case costs two counts
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_JSON_STRING.sub(b"", line)):
        if bracket[0] in b"[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_NESTING:
                break  # too deep already: the rest cannot make it acceptable
        else:
            depth -= 1
    return deepest


def decode(line: bytes) -> JSON:
    """Parse one wire line into a JSON object; raise ProtocolViolation(bad_request) otherwise
    (nesting deeper than MAX_NESTING is refused before parsing)."""
    if nesting_depth(line) > MAX_NESTING:
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST,
            f"JSON nested deeper than {MAX_NESTING} levels; flatten the request",
        )
    try:
        message = json.loads(line)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of 5,000 digits
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, f"malformed JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "a message must be a JSON object")
    return message


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_]{1,32}")


def unencodable(value: object) -> str | None:
    """Where in ``value`` (a decoded JSON value) a string holds what UTF-8 cannot encode (a lone
    surrogate, as JSON's ``\\ud800`` makes one), said for a message: ``'params.prompt'``,
    ``'params.history[3].content'``, ``a key in 'params'``; None if nowhere."""
    from phi4cli.core.inputs import find_unencodable

    found = find_unencodable(value)
    if found is None:
        return None
    path, is_key = found
    inside = ""
    for step in path:  # a key that is no plain name is not repeated back: it is shown as ?
        if isinstance(step, int):
            inside = f"{inside or '?'}[{step}]"
        else:
            name = step if _PLAIN_KEY.fullmatch(step) else "?"
            inside = f"{inside}.{name}" if inside else name
    if is_key:
        return f"a key in '{inside}'" if inside else "a key of the request"
    return f"'{inside}'" if inside else "the value"


def parse_request(line: bytes) -> Request:
    """Validate one request line; raise ProtocolViolation with the matching code when invalid.

    Text that is not valid Unicode anywhere in the request is refused (bad_request naming the
    field) before anything else reads it; the answer carries the request's id unless the id
    itself is the bad text.
    """
    message = decode(line)
    request_id = message.get("id")
    bad = unencodable(message)
    if bad is not None:
        usable = unencodable(request_id) is None and isinstance(request_id, (str, int))
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST,
            _not_unicode(bad),
            request_id if usable and not isinstance(request_id, bool) else None,
        )
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolViolation(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported (daemon speaks {PROTOCOL_VERSION})",
            request_id,
        )
    if (
        request_id is None
        or isinstance(request_id, (dict, list, bool))
        or (isinstance(request_id, float) and not math.isfinite(request_id))  # NaN, 1e400
    ):
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "a request needs an 'id' (string or number)")
    op = message.get("op")
    if op not in set(Op):
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST,
            f"unknown op {op!r}; expected one of {', '.join(sorted(Op))}",
            request_id,
        )
    params = message.get("params", {})
    if not isinstance(params, dict):
        raise ProtocolViolation.field("params", "must be a JSON object", request_id)
    return Request(id=request_id, op=op, params=params)
