"""Stop strings match the answer only, on every model (issue 50): a model whose name does not say
it reasons may still close a ``</think>`` it never opened, and a stop string written in that
thinking must neither end the request nor leave the thinking as the answer. Through `phi4
serve` on the daemon (a scripted tiny model) and through a remote engine (a scripted server)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from phi4cli.core._settings import Ask
from phi4cli.core.protocol import Op, SolveParams
from phi4cli.serve.openai_response import Choice
from tests.scripted_server import chunk, data, scripted_server
from tests.test_http_api import serving_apart
from tests.tinymodel import write_text_script_model

# The thinking says the stop string, then the answer says it again.
THINKING = "First a stop here, then more thinking about it."
ANSWER = " So the stop is 7."


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`phi4 serve` on a model not named as a reasoning model that writes THINKING, a
    ``</think>`` it never opened, and ANSWER."""
    folder = tmp_path_factory.mktemp("models")
    model = write_text_script_model(
        folder / "plain-script.gguf", THINKING, ANSWER, name="plain-script"
    )
    with serving_apart(model) as url:
        yield url


@pytest.mark.daemon
@pytest.mark.timeout(300)
def test_a_stop_string_in_thinking_never_opened_does_not_cut_it_through_serve(plain_server: str):
    # Before: the stop matched in the thinking: the request ended there, the thinking came back
    # as content ("First a "), finish_reason "stop", no reasoning_content.
    client = openai.OpenAI(
        base_url=f"{plain_server}/v1", api_key="unused", max_retries=0, timeout=120
    )
    asked: dict[str, Any] = {
        "model": "plain-script",
        "temperature": 0,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "What is 3+4?"}],
    }
    plain = client.chat.completions.create(**asked)
    said = plain.choices[0].message
    assert said.model_extra is not None
    assert said.model_extra["reasoning_content"].strip() == THINKING
    assert (said.content or "").strip() == ANSWER.strip()
    whole = client.chat.completions.create(stop="stop", **asked)
    message = whole.choices[0].message
    assert message.model_extra is not None
    assert message.model_extra["reasoning_content"].strip() == THINKING
    assert (message.content or "").strip() == "So the"  # the stop still ends the answer
    assert whole.choices[0].finish_reason == "stop"
    # Streamed: the text sent as content before the </think> is sent again as reasoning, and
    # nothing past the stop string in it was sent as content.
    content, reasoning, finish = "", "", None
    for part in client.chat.completions.create(stop="stop", stream=True, **asked):
        for choice in part.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            finish = choice.finish_reason or finish
    assert content.startswith("First a ") and "here" not in content
    assert content.removeprefix("First a ").strip() == "So the"
    assert reasoning.strip() == THINKING
    assert finish == "stop"


def _inline(pieces: list[str]) -> Any:
    def script(_body: dict[str, Any]) -> list[str]:
        lines = [chunk({"role": "assistant", "content": ""})]
        lines += [chunk({"content": piece}) for piece in pieces]
        return [*lines, chunk({}, "stop"), data("[DONE]")]

    return script


def _folded(pieces: list[str], stops: tuple[str, ...]) -> tuple[Choice, str, str]:
    """A choice of `phi4 serve` folded from a remote engine's stream of a server that writes
    ``pieces`` inline, for a model named "plain"; with the content and reasoning it sent."""
    from phi4cli.backends.remote_backend import RemoteBackend

    with scripted_server(_inline(pieces)) as server:
        backend = RemoteBackend(server.url, "plain", None, 30.0)
        params = SolveParams("What is 3+4?", Ask(temperature=0.0, max_tokens=200), "plain")
        stream = backend.stream(Op.SOLVE, params)
        choice = Choice(0, stream, stops)
        content = reasoning = ""
        try:
            for event in stream:
                for delta, _logprobs in choice.apply(event):
                    content += delta.get("content") or ""
                    reasoning += delta.get("reasoning_content") or ""
        finally:
            stream.close()
            backend.close()
    assert choice.outcome.error is None, choice.outcome.error
    return choice, content, reasoning


@pytest.mark.timeout(60)
def test_a_stop_string_in_thinking_never_opened_does_not_cut_it_through_a_remote_engine():
    # Before: content "First a ", finish_reason "stop", no reasoning.
    pieces = ["First a st", "op here, then more", " thinking. </think>", " So the st", "op is 7."]
    choice, content, reasoning = _folded(pieces, ("stop",))
    assert choice.reasoning.strip() == "First a stop here, then more thinking." == reasoning.strip()
    assert choice.message()["content"].strip() == "So the"
    assert choice.finish_reason == "stop"
    assert content == "First a " + choice.content  # what was sent before it was thinking
    # With no </think> after it, the text was the answer, and it ends at its stop.
    choice, content, reasoning = _folded(["First a st", "op here, then more."], ("stop",))
    assert (choice.content, content, reasoning) == ("First a ", "First a ", "")
    assert choice.finish_reason == "stop" and "reasoning_content" not in choice.message()
