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
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path

from phi4cli._settings import Sampling
from phi4cli.errors import ErrorCode as ErrorCode  # the wire's error codes
from phi4cli.records import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final, Protocol
else:
    Protocol = object  # RequestDefaults is for the type checker; a plain class at run time

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
    PING = "ping"


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
    """A request that cannot be served; carries the error code and the request id if known."""

    def __init__(self, code: ErrorCode, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# --- statistics ---------------------------------------------------------------------------------


# The records here are NamedTuples, not dataclasses: importing dataclasses (it imports inspect)
# would cost every `phi4 solve` more than the daemon takes to answer a short question.


class Stats(Record):
    """What one answer cost: tokens by kind, timings, how it ended. The daemon measures all of it;
    a remote engine fills what its server reports (``measured`` says which were counted here)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_eval_tokens: int = 0
    prompt_eval_s: float = 0.0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    answer_tokens: int = 0
    budget_reached: bool = False
    thinking_unfinished: bool = False
    decode_s: float = 0.0
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


class Event(Record):
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
    def error(cls, code: ErrorCode, message: str, request_id: Any = None) -> Event:
        return cls(EventKind.ERROR, request_id, data={"code": code, "message": message,
                                                      "retryable": code.retryable})  # fmt: skip

    @classmethod
    def of_stats(cls, stats: Stats, request_id: Any = None) -> Event:
        return cls(EventKind.STATS, request_id, data=stats.to_dict())

    def to_wire(self) -> JSON:
        text = {"text": self.text} if self.text or self.kind in _TEXT_KINDS else {}
        return {"v": PROTOCOL_VERSION, "id": self.id, "event": self.kind.value, **text,
                **self.data}  # fmt: skip

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


class Request(Record):
    id: Any
    op: str
    params: JSON
    v: int = PROTOCOL_VERSION


PRIORITY_INTERACTIVE: Final = 0
PRIORITY_SOLVE: Final = 1
PRIORITY_BULK: Final = 2
PRIORITIES: Final = {"interactive": PRIORITY_INTERACTIVE, "solve": PRIORITY_SOLVE,
                     "bulk": PRIORITY_BULK}  # fmt: skip


class SolveParams(Record):
    """A solve, chat or load request's parameters, validated (see ``parse_params``)."""

    prompt: str
    system: str | None
    model: Path | None
    sampling: Sampling  # the sampler's settings (options.SAMPLING_KEYS)
    max_tokens: int | None
    think_budget: int | None
    keep_alive: float | None
    priority: int
    # Chat turns: the session id and the complete turns before this message.
    session: str | None = None
    history: tuple[dict[str, str], ...] = ()
    load_only: bool = False  # `phi4 warm`: load (and warm) the model, generate nothing
    # Evaluated alone by a fixed recipe, so a greedy or seeded answer is the same whatever the
    # daemon did before (see the engine's ``admit`` and the scheduler's exclusive runs).
    deterministic: bool = False


def _number(params: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST, f"'{key}' must be a number from {low} to {high}"
        )
    return float(value)


def _optional_int(params: Mapping[str, Any], key: str, low: int) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, f"'{key}' must be an integer >= {low}")
    return value


class RequestDefaults(Protocol):
    """What a request does not say takes from the daemon's settings (``config.Settings`` is
    one): the protocol reads these, and the sampler's settings (``options.SAMPLING_KEYS``),
    and nothing else of them."""

    @property
    def system(self) -> str | None: ...
    @property
    def deterministic(self) -> bool: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def think_budget(self) -> int | None: ...
    @property
    def keep_alive(self) -> float: ...


def parse_solve_params(params: Mapping[str, Any], defaults: RequestDefaults) -> SolveParams:
    """Validate a solve request's params against the daemon's defaults.

    Raise ProtocolViolation(bad_request) naming the offending field.
    """
    from phi4cli.durations import parse_duration

    _check_text(params)
    prompt = params.get("prompt")
    if not isinstance(prompt, str):
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "'prompt' (the question) must be a string")
    if not prompt.strip():
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "empty question: give a problem to solve")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST,
            f"question is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}",
        )
    system = params.get("system", defaults.system)
    if system is not None and not isinstance(system, str):
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "'system' must be a string or null")
    model = params.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "'model' must be a path to a .gguf file")
    keep_alive = params.get("keep_alive")
    try:
        keep_alive_s = None if keep_alive is None else parse_duration(keep_alive)
    except ValueError:
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST, "'keep_alive' must be a duration like 30m, 0 or -1"
        ) from None
    priority = params.get("priority", "solve")
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST, f"'priority' must be one of {', '.join(PRIORITIES)}"
        )
    deterministic = params.get("deterministic", defaults.deterministic)
    if not isinstance(deterministic, bool):
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "'deterministic' must be true or false")
    return SolveParams(
        prompt=prompt,
        system=system or None,
        model=Path(model) if model else None,
        sampling=parse_sampling(params, defaults),
        max_tokens=_optional_int(params, "max_tokens", 1) or defaults.max_tokens,
        think_budget=(
            _optional_int(params, "think_budget", 0)
            if "think_budget" in params
            else defaults.think_budget
        ),
        keep_alive=keep_alive_s,
        priority=PRIORITIES[priority],
        deterministic=deterministic,
    )


def parse_sampling(params: Mapping[str, Any], defaults: RequestDefaults) -> Sampling:
    """The sampler's settings of a request, each checked as its row of ``options.SETTINGS``
    says (a number within bounds, or a whole number from a least one; null for an optional
    one), and the daemon's own where the request does not say."""
    from phi4cli.options import SETTING

    values: dict[str, Any] = {}
    for key in Sampling._fields:
        low, high = SETTING[key].wire or (None, None)
        if key not in params:
            values[key] = getattr(defaults, key)
        elif high is None:
            values[key] = _optional_int(params, key, int(low or 0))
        else:
            values[key] = _number(params, key, getattr(defaults, key), float(low or 0), high)
    return Sampling(**values)


def _check_text(params: Mapping[str, Any]) -> None:
    """Refuse params holding text UTF-8 cannot encode, naming the field (for callers that
    validate params without a wire line, as `phi4 serve` does)."""
    bad = unencodable(dict(params))
    if bad is not None:
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, _not_unicode(bad))


def _not_unicode(where: str) -> str:
    return f"{where} is not valid Unicode text (it holds a lone surrogate such as \\ud800); " \
        "send UTF-8 text"  # fmt: skip


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
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST,
            "'history' must be complete turns: user, assistant, user, assistant, ...",
        )
    assert isinstance(history, list)
    return tuple({"role": m["role"], "content": m["content"]} for m in history)


def parse_chat_params(params: Mapping[str, Any], defaults: RequestDefaults) -> SolveParams:
    """Validate a chat request: ``session``, ``message`` and ``history`` (complete turns).

    Raise ProtocolViolation(bad_request) naming the offending field.
    """
    _check_text(params)
    session = params.get("session")
    if not isinstance(session, str) or not SESSION_ID.fullmatch(session):
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST,
            "'session' must be 1 to 128 letters, digits and . _ : - (starting with a letter or "
            "digit)",
        )
    history = params.get("history", [])
    if isinstance(history, list) and len(history) > MAX_HISTORY_MESSAGES:
        raise ProtocolViolation(
            ErrorCode.BAD_REQUEST,
            f"'history' holds {len(history):,} messages; the limit is {MAX_HISTORY_MESSAGES:,} "
            "(send the most recent turns only)",
        )
    turns = check_history(history)
    solve = parse_solve_params(
        {**params, "prompt": params.get("message"), "priority": "interactive"}, defaults
    )
    return solve._replace(session=session, history=turns)


def parse_load_params(params: Mapping[str, Any], defaults: RequestDefaults) -> SolveParams:
    """Validate a load request (``model``); raise ProtocolViolation(bad_request)."""
    model = params.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "'model' must be a path to a .gguf file")
    request = {"prompt": "-", "model": model, "priority": "interactive"}
    if "keep_alive" in params:
        request["keep_alive"] = params["keep_alive"]
    return parse_solve_params(request, defaults)._replace(prompt="", load_only=True)


def parse_params(op: str, params: Mapping[str, Any], defaults: RequestDefaults) -> SolveParams:
    """Validate the params of a solve, chat or load request."""
    parse = {Op.SOLVE: parse_solve_params, Op.CHAT: parse_chat_params,
             Op.LOAD: parse_load_params}[Op(op)]  # fmt: skip
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
    from phi4cli.inputs import find_unencodable

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
    if request_id is None or isinstance(request_id, (dict, list, bool)):
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
        raise ProtocolViolation(ErrorCode.BAD_REQUEST, "'params' must be a JSON object", request_id)
    return Request(id=request_id, op=op, params=params)
