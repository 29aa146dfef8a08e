"""OpenAI's chat-completions request as ``phi4 serve`` reads it: every field of the reference
honoured, refused with a 400 naming it, or ignored where it asks for nothing (docs/openai.md);
the messages turned into a daemon ``chat`` request, its values checked as the daemon checks
them; ``n`` choices, stop strings and logprobs read here."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from starlette.responses import JSONResponse

from phi4cli.core._settings import Ask
from phi4cli.core.config import Settings
from phi4cli.core.errors import api_words, http_status_for
from phi4cli.core.options import SETTINGS, sample_seed
from phi4cli.core.protocol import (
    MAX_TOP_LOGPROBS,
    Event,
    ProtocolViolation,
    SolveParams,
    parse_chat_params,
)


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; ``code`` is the status unless OpenAI names one
    (``model_not_found``), ``param`` the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.code, self.param = code, param

    @classmethod
    def of(cls, error: Event) -> ApiError:
        """A request's error event in OpenAI's shape: worded from its fault where it has one
        (the field at fault as OpenAI names it, in ``param``)."""
        status = http_status_for(error.code)
        message, param = error.message, None
        fault = error.fault
        if fault is not None:
            message, param = api_words(fault)
        return cls(
            status,
            message,
            "invalid_request_error" if status < 500 else "server_error",
            param=param,
        )

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.kind,
            "code": self.code or self.status,
        }
        if self.param is not None:
            error["param"] = self.param
        return {"error": error}

    def response(self) -> JSONResponse:
        # Busy (a full queue, the daemon overwhelmed): when to ask again, as OpenAI's clients
        # and phi4's own --backend client read it.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def unencodable_field(body: Any) -> str | None:
    """The first field of a parsed JSON body holding text that is not UTF-8-encodable (a lone
    surrogate such as ``"\\ud800"``, which JSON allows), named ``messages[0].content``; None if
    every string is text."""
    from phi4cli.core.inputs import find_unencodable

    found = find_unencodable(body)
    if found is None:
        return None
    path, is_key = found
    named = ""
    for step in path:
        if isinstance(step, int):
            named = f"{named}[{step}]"
        else:
            named = f"{named}.{step}" if named else step
    return f"a key of {named or 'the body'}" if is_key else named or "the body"


def check_model(body: dict[str, Any], model_name: str, served: frozenset[str]) -> None:
    """Accept a request's ``model`` that names the loaded model (its name, file name, an alias
    of its file, ``default``) or is absent; raise ApiError 404 ``model_not_found`` otherwise,
    rather than answer with another model than the one asked for."""
    requested = body.get("model")
    if requested is None or requested == "":
        return
    if not isinstance(requested, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if requested.lower() not in served:
        # (the name as asked, cut short: a client's megabyte of name is not sent back whole)
        shown = requested if len(requested) <= MAX_NAME_SHOWN else requested[:MAX_NAME_SHOWN] + "…"
        raise ApiError(
            404,
            f"the model {shown!r} is not served here: this server serves {model_name!r} "
            "(ask for that name, or 'default')",
            code="model_not_found",
            param="model",
        )


MAX_NAME_SHOWN = 100  # characters of a model name not served that its 404 quotes


_PATH = re.compile(r"(?<![\w/])/(?:[\w.@+~-]+/)+[\w.@+~-]*")


def without_paths(message: str) -> str:
    """A client's copy of an error of the daemon's connection: the paths of this machine (its
    socket, its runtime directory) are the server's business, not the client's."""
    return _PATH.sub("(a path of the server's)", message)


RETRY_AFTER_S = 2  # a busy answer's Retry-After: about one answer's first tokens


# The most choices (``n``) one request may ask for: each is its own daemon request, and this
# many leaves most of the daemon's queue (64 by default) to other clients.
MAX_CHOICES = 16


MAX_STOPS = 4  # as OpenAI


MAX_STOP_CHARS = 1_000  # each stop string's (the text held back is checked against each)


_NO_TOOLS = "this server calls no tools (no function calling)"


# Fields of OpenAI's chat-completions reference that serve does not honour: each is taken at the
# value that asks for nothing (null, or the value shown accepted here) and refused with a 400
# naming it otherwise, so that no client gets other behaviour than it asked for without a word.
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda value: value == [], _NO_TOOLS),
    "tool_choice": (lambda value: value == "none", _NO_TOOLS),
    "functions": (lambda value: value == [], _NO_TOOLS),
    "function_call": (lambda value: value == "none", _NO_TOOLS),
    "response_format": (
        lambda value: isinstance(value, dict) and value.get("type") == "text",
        "only {'type': 'text'}: JSON mode and JSON schemas are not supported",
    ),
    "logit_bias": (lambda value: value == {}, "the sampler takes no logit biases"),
    "audio": (lambda value: False, "this server answers with text only"),
    "modalities": (lambda value: value == ["text"], "this server answers with text only"),
    "prediction": (lambda value: False, "predicted outputs are not supported"),
    "web_search_options": (lambda value: False, "this server does not search the web"),
    "reasoning_effort": (
        lambda value: False,
        "the model's thinking has no effort levels here ('max_tokens' bounds it)",
    ),
    "verbosity": (lambda value: False, "the model's answer length cannot be chosen"),
}


def check_fields(body: dict[str, Any]) -> None:
    """Raise ApiError 400 naming the first field of OpenAI's reference that asks for what
    serve does not do (see ``_REFUSED``). Fields outside the reference are not read at all."""
    for name, (accepted, why) in _REFUSED.items():
        value = body.get(name)
        if value is not None and not accepted(value):
            raise ApiError(400, f"'{name}' is not supported: {why}", param=name)


def _message_text(message: Any, index: int) -> str:
    """A message's content: a string, or a list of text parts (joined); raise ApiError naming
    the part that is not text (an image, audio, a file)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for at, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise ApiError(
                    400,
                    f"'messages[{index}].content[{at}]' is not supported: only text parts "
                    "({'type': 'text', 'text': ...}); this model reads text only",
                    param=f"messages[{index}].content[{at}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, "each message needs a string 'content'", param=f"messages[{index}]")


def _whole(body: dict[str, Any], name: str, low: int, high: int, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a whole number from {low} to {high}", param=name)
    return value


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    """The request's ``stop``: none, a string, or a list of up to MAX_STOPS non-empty strings."""
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise ApiError(
            400,
            f"'stop' must be a string or a list of up to {MAX_STOPS} strings, each of 1 to "
            f"{MAX_STOP_CHARS:,} characters",
            param="stop",
        )
    return tuple(dict.fromkeys(stops))


class ChatRequest(NamedTuple):
    """An OpenAI chat request as serve answers it: one daemon request per choice."""

    params: tuple[SolveParams, ...]  # each choice's daemon request
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def read_chat_request(body: dict[str, Any], model: str, settings: Settings) -> ChatRequest:
    """Check an OpenAI chat request and make its daemon requests (ApiError if it cannot):
    ``n`` of them, each its own session and, when a seed is given, seed + i."""
    check_fields(body)
    params = chat_params(body, model, settings)
    choices = _whole(body, "n", 1, MAX_CHOICES, 1)
    stops = _stop_strings(body)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(
            400,
            "'stream_options' must be an object, given only with 'stream': true",
            param="stream_options",
        )
    include_usage = (options or {}).get("include_usage")
    include_usage = False if include_usage is None else include_usage  # (null: not given)
    if not isinstance(include_usage, bool):
        raise ApiError(
            400,
            "'stream_options.include_usage' must be true or false",
            param="stream_options.include_usage",
        )
    seed = params.ask.seed
    each = tuple(
        params._replace(
            session=uuid.uuid4().hex if i else params.session,
            ask=params.ask._replace(seed=None if seed is None else sample_seed(seed, i)),
        )
        for i in range(choices)
    )
    return ChatRequest(each, stops, stream, include_usage)


def _logprobs(body: dict[str, Any]) -> int | None:
    """How many likeliest tokens each answer token's ``logprobs`` entry lists, from OpenAI's
    ``logprobs`` and ``top_logprobs``; None when the request asks for no log-probabilities."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise ApiError(400, "'logprobs' must be true or false", param="logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise ApiError(
            400,
            f"'top_logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS}",
            param="top_logprobs",
        )
    if top and not asked:  # as OpenAI: top_logprobs goes with logprobs true
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if asked else None


def chat_params(body: dict[str, Any], model: str, settings: Settings) -> SolveParams:
    """Turn an OpenAI chat request into a daemon ``chat`` request (ApiError if it cannot).

    The OpenAI shape (roles, system messages) is checked here; the values themselves by the
    protocol's own schema, the same check the daemon makes.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    system_parts: list[str] = []
    turns: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        content = _message_text(message, index)
        role = message.get("role")
        if role in ("system", "developer"):
            system_parts.append(content)
        elif role in ("user", "assistant"):
            turns.append({"role": role, "content": content})
        else:
            tools = ": this server calls no tools" if role in ("tool", "function") else ""
            raise ApiError(
                400, f"unsupported message role {role!r}{tools}", param=f"messages[{index}].role"
            )
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    # Read here, not by the daemon: a 1 for true, or n = 2 answered with one choice, would be
    # taken without a word.
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    logprobs = _logprobs(body)
    params: dict[str, Any] = {
        # Each request is its own session: the daemon finds the shared prefix in its slots.
        "session": uuid.uuid4().hex,
        "message": turns[-1]["content"],
        "history": turns[:-1],
        "system": "\n\n".join(system_parts) or None,
        "model": model,
    }
    # Each setting by its names on the OpenAI wire (``deterministic`` is phi4's own), checked
    # below as the daemon checks it; a refusal names the field as the request spelled it.
    field_of = {"history": "messages", "message": "messages"}
    for row in SETTINGS:
        given = [name for name in row.openai if body.get(name) is not None]
        if given:
            params[row.key] = body[given[0]]
            field_of[row.key] = given[0]
    if body.get("max_completion_tokens") is not None:  # OpenAI's newer name for max_tokens
        params["max_tokens"] = body["max_completion_tokens"]
        field_of["max_tokens"] = "max_completion_tokens"
    if logprobs is not None:
        params["logprobs"] = logprobs
    try:
        return parse_chat_params(params, Ask.of(settings))
    except ProtocolViolation as exc:
        if exc.param is None:
            raise ApiError(400, exc.message) from None
        field = field_of.get(exc.param, exc.param)
        raise ApiError(400, f"'{field}' {exc.detail}", param=field) from None
