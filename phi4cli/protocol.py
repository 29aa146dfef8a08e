"""The wire protocol between client and daemon: newline-delimited JSON, versioned.

Lightweight on purpose: no sockets, no engine, nothing beyond the standard library, so both the
client path and the daemon import it for free.

A request is one line ``{"v": 1, "id": ..., "op": ..., "params": {...}}``. The daemon answers with
event lines carrying the same id: ``accepted``, ``progress``, ``token``, ``stats``, and then exactly
one terminal ``done`` or ``error``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

PROTOCOL_VERSION: Final = 1
# A request line longer than this is refused: questions are short, and an unbounded line would let
# one client make the daemon buffer arbitrary amounts of memory.
MAX_LINE_BYTES: Final = 1 << 20
MAX_PROMPT_CHARS: Final = 256_000

OPS: Final = frozenset({"solve", "chat", "load", "status", "stop", "cancel", "ping"})
TERMINAL_EVENTS: Final = frozenset({"done", "error"})

# Error codes: (code, retryable)
BAD_REQUEST: Final = "bad_request"
UNSUPPORTED_VERSION: Final = "unsupported_version"
BUSY: Final = "busy"
CONTEXT_OVERFLOW: Final = "context_overflow"
MODEL_ERROR: Final = "model_error"
CANCELLED: Final = "cancelled"
SHUTTING_DOWN: Final = "shutting_down"
FORBIDDEN: Final = "forbidden"
INTERNAL: Final = "internal"
RETRYABLE_CODES: Final = frozenset({BUSY, SHUTTING_DOWN})

JSON = dict[str, Any]


class ProtocolViolation(Exception):
    """A request that cannot be served; carries the error code and the request id if known."""

    def __init__(self, code: str, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    id: Any
    op: str
    params: JSON = field(default_factory=dict)
    v: int = PROTOCOL_VERSION


def encode(message: JSON) -> bytes:
    """Return one wire line (UTF-8 JSON, no embedded newlines, trailing newline)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def encode_request(request: Request) -> bytes:
    return encode({"v": request.v, "id": request.id, "op": request.op, "params": request.params})


def decode(line: bytes) -> JSON:
    """Parse one wire line into a JSON object; raise ProtocolViolation(bad_request) otherwise."""
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolViolation(BAD_REQUEST, f"malformed JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolViolation(BAD_REQUEST, "a message must be a JSON object")
    return message


def parse_request(line: bytes) -> Request:
    """Validate one request line; raise ProtocolViolation with the matching code when invalid."""
    message = decode(line)
    request_id = message.get("id")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolViolation(
            UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported (daemon speaks {PROTOCOL_VERSION})",
            request_id,
        )
    if request_id is None or isinstance(request_id, (dict, list, bool)):
        raise ProtocolViolation(BAD_REQUEST, "a request needs an 'id' (string or number)")
    op = message.get("op")
    if op not in OPS:
        raise ProtocolViolation(
            BAD_REQUEST, f"unknown op {op!r}; expected one of {', '.join(sorted(OPS))}", request_id
        )
    params = message.get("params", {})
    if not isinstance(params, dict):
        raise ProtocolViolation(BAD_REQUEST, "'params' must be a JSON object", request_id)
    return Request(id=request_id, op=op, params=params)


def event(request_id: Any, kind: str, **fields: Any) -> JSON:
    return {"v": PROTOCOL_VERSION, "id": request_id, "event": kind, **fields}


def error_event(request_id: Any, code: str, message: str) -> JSON:
    return event(request_id, "error", code=code, message=message, retryable=code in RETRYABLE_CODES)
