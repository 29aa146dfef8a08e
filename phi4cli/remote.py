"""Remote engines: `--backend URL` sends `phi4 solve` and `phi4 chat` to any OpenAI-compatible
server (vLLM, llama-server, Ollama, llama-cpp-python's server, another `phi4 serve`) instead of
the local daemon, producing the same events, so output, reasoning handling and exit codes match.

Standard library only: urllib and server-sent events.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Generator
from typing import Any

from phi4cli import protocol
from phi4cli.errors import DaemonUnavailableError
from phi4cli.reasoning import ThinkSplitter, model_thinks

TIMEOUT_S = 600.0
_CODE_FOR_STATUS = {400: protocol.BAD_REQUEST, 404: protocol.BAD_REQUEST,
                    413: protocol.BAD_REQUEST, 429: protocol.BUSY,
                    503: protocol.SHUTTING_DOWN}  # fmt: skip


def backend_key() -> str | None:
    """The API key for the remote backend, from PHI4_BACKEND_KEY."""
    return os.environ.get("PHI4_BACKEND_KEY")


def _messages(params: dict[str, Any]) -> list[dict[str, str]]:
    system = params.get("system")
    messages = [{"role": "system", "content": system}] if system else []
    messages += list(params.get("history") or [])
    question = params.get("message", params.get("prompt"))
    messages.append({"role": "user", "content": str(question)})
    return messages


def stream(
    url: str, api_key: str | None, model: str, params: dict[str, Any]
) -> Generator[dict[str, Any], None, None]:
    """Yield daemon-style events (``token``, ``reasoning``, ``retract``, ``stats``, then ``done``
    or ``error``) for one solve or chat request answered by the server at ``url``.

    Raise DaemonUnavailableError when the server cannot be reached at all.
    """
    body: dict[str, Any] = {"model": model, "messages": _messages(params), "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    for key in ("temperature", "top_p", "seed", "max_tokens"):
        if params.get(key) is not None:
            body[key] = params[key]
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        url.rstrip("/") + "/chat/completions" if url.rstrip("/").endswith("/v1")
        else url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps(body).encode(), headers=headers, method="POST",
    )  # fmt: skip
    started = time.monotonic()
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            detail = detail.strip()[:300] or error.reason
        code = _CODE_FOR_STATUS.get(error.code, protocol.MODEL_ERROR)
        yield protocol.error_event(None, code, f"the backend answered {error.code}: {detail}")
        return
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise DaemonUnavailableError(f"cannot reach the backend {url}: {reason}") from None
    splitter = ThinkSplitter(starts_in_reasoning=model_thinks(model))
    first_token_s: float | None = None
    usage: dict[str, Any] = {}
    finish: str | None = None
    pieces = 0
    with response:
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                delta = choice.get("delta") or {}
                for kind, text in _delta_pieces(delta, splitter):
                    if first_token_s is None:
                        first_token_s = time.monotonic() - started
                    pieces += 1
                    yield protocol.event(None, kind, text=text)
    for kind, text in _map(splitter.finish()):
        yield protocol.event(None, kind, text=text)
    total = time.monotonic() - started
    # Servers that send no usage while streaming (llama-cpp-python's): one delta is one token.
    completion = int(usage.get("completion_tokens") or pieces)
    yield protocol.event(
        None, "stats", prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        prompt_eval_tokens=0, prompt_eval_s=first_token_s or total, completion_tokens=completion,
        reasoning_tokens=0, answer_tokens=completion, budget_reached=False,
        thinking_unfinished=splitter.unfinished, decode_s=total - (first_token_s or total),
        first_token_s=first_token_s, total_s=round(total, 4),
        finish_reason="length" if finish == "length" else "stop", seed=params.get("seed"),
        model=f"{model} at {url}",
    )  # fmt: skip
    yield protocol.event(None, "done", finish_reason=finish)


def _delta_pieces(delta: dict[str, Any], splitter: ThinkSplitter) -> list[tuple[str, str]]:
    pieces: list[tuple[str, str]] = []
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if reasoning:
        pieces.append(("reasoning", str(reasoning)))
    content = delta.get("content")
    if content:
        pieces += _map(splitter.feed(str(content)))
    return pieces


def _map(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    names = {"answer": "token", "reasoning": "reasoning", "retract": "retract"}
    return [(names[kind], text) for kind, text in pieces]
