"""`phi4 serve --http` and the fields of OpenAI's chat-completions request: n, stop,
stream_options.include_usage honoured; tools, logprobs and the rest refused with a 400 naming
the field (docs/openai.md). The client is the official `openai` SDK, the server a real
`phi4 serve` on the tiny model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from phi4cli.serve.openai_response import StopStrings
from tests.conftest import run_phi4
from tests.test_http_api import get, serving_apart

# Each test runs phi4 as a process (the command, its daemon or a server).
pytestmark = pytest.mark.daemon

QUESTION = [{"role": "user", "content": "What is 12*13?"}]


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[str]:
    with serving_apart(tiny_model) as url:
        yield url


def client_of(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def metric(server: str, name: str, **labels: str) -> float:
    _status, text = get(f"{server}/metrics")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    raise AssertionError(f"no {name} in /metrics")


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    """(text by choice index, finish_reason by index, the usage chunk's usage) of a stream."""
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(model="tiny-phi3", stream=True, **fields):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in finished, "one finish_reason per choice"
                finished[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            assert not chunk.choices, "usage comes in a chunk of its own, with no choices"
            usage = chunk.usage
    return texts, finished, usage


def test_n_gives_that_many_choices_each_with_its_own_seed(server: str):
    # Before: n = 2 was a 400 ("'n' must be 1").
    client = client_of(server)
    asked = metric(server, "phi4_http_chat_choices_total")
    whole = client.chat.completions.create(
        model="tiny-phi3", messages=QUESTION, temperature=0, max_tokens=6, n=2
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.message.content for c in whole.choices)
    assert whole.usage is not None and whole.usage.completion_tokens == 12  # summed
    assert metric(server, "phi4_http_chat_choices_total") == asked + 2
    texts, finished, _usage = streamed(client, messages=QUESTION, temperature=0, max_tokens=6, n=2)
    assert texts == {0: whole.choices[0].message.content, 1: whole.choices[1].message.content}
    assert finished == {0: "length", 1: "length"}
    # Choice i is seeded seed + i: the second of seed 7 is the first of seed 8.
    sampled = {
        "messages": QUESTION,
        "temperature": 1.0,
        "max_tokens": 8,
        "extra_body": {"deterministic": True},
    }
    pair = client.chat.completions.create(model="tiny-phi3", n=2, seed=7, **sampled)
    alone = client.chat.completions.create(model="tiny-phi3", seed=8, **sampled)
    assert pair.choices[1].message.content == alone.choices[0].message.content


def test_stop_ends_the_answer_before_the_stop_string_also_across_tokens(server: str):
    # Before: the stop strings were ignored: the text ran past them to finish_reason "length".
    client = client_of(server)
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny-phi3",
            messages=QUESTION,
            temperature=0,
            max_tokens=24,
            stream=True,
        )
        if c.choices
    ]
    pieces = [p for p in pieces if p]
    full = "".join(pieces)
    # A stop string made of the end of one token and the start of the next.
    at = next(i for i in range(2, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) >= 1)
    stop = pieces[at - 1][-2:] + pieces[at][:1]
    before = full[: full.find(stop)]
    assert len(before) < len(full) - len(stop)
    whole = client.chat.completions.create(
        model="tiny-phi3",
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stop=["never written", stop],
    )
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (before, "stop")
    texts, finished, _usage = streamed(
        client, messages=QUESTION, temperature=0, max_tokens=24, stop=stop, n=2
    )
    assert texts == {0: before, 1: before}
    assert finished == {0: "stop", 1: "stop"}


def test_logprobs_give_each_answer_tokens_log_probability_and_the_likeliest(server: str):
    # Before: a 400 ("not returned yet"); and phi4 with phi4 serve as its backend warned on
    # every --json run that the backend gives no logprobs.
    client = client_of(server)
    whole = client.chat.completions.create(
        model="tiny-phi3",
        messages=QUESTION,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 8 == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(e.token for e in entries) == choice.message.content
    for entry in entries:
        assert bytes(entry.bytes or []).decode() == entry.token
        assert len(entry.top_logprobs) == 2
        first, second = entry.top_logprobs
        # Greedy: the token drawn is the likeliest, with the same log-probability.
        assert (first.token, first.logprob) == (entry.token, entry.logprob)
        assert 0 >= first.logprob >= second.logprob > -9999
    # Streamed: the same entries, each on the chunk that carries its text.
    chunks = [
        c.choices[0]
        for c in client.chat.completions.create(
            model="tiny-phi3",
            messages=QUESTION,
            temperature=0,
            max_tokens=8,
            stream=True,
            logprobs=True,
        )
        if c.choices
    ]
    streamed_entries = [
        e for c in chunks if c.logprobs and c.logprobs.content for e in c.logprobs.content
    ]
    assert [(e.token, e.top_logprobs) for e in streamed_entries] == [(e.token, []) for e in entries]
    for chunk in chunks:
        if chunk.logprobs and chunk.logprobs.content:
            assert chunk.delta.content == "".join(e.token for e in chunk.logprobs.content)
    # Cut at a stop string: the entries of the tokens after it are not sent.
    stop = entries[3].token[-2:]
    stopped = client.chat.completions.create(
        model="tiny-phi3", messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, stop=stop
    )
    kept = stopped.choices[0].logprobs.content  # type: ignore[union-attr]
    assert stopped.choices[0].finish_reason == "stop" and kept is not None
    assert 0 < len(kept) < len(entries)
    assert "".join(e.token for e in kept).startswith(stopped.choices[0].message.content or "")


def test_phi4_with_phi4_serve_as_its_backend_gets_the_answers_confidence(server: str):
    # Before: "the backend ... gives no logprobs (... 'logprobs' is not supported ...)" on
    # every --json run, and no confidence (found by a fresh-clone trial of the docs).
    done = run_phi4(
        "solve",
        "What is 12*13?",
        "--backend",
        f"{server}/v1",
        "-m",
        "tiny-phi3",
        "--json",
        "-t",
        "0",
        "-n",
        "8",
    )
    assert "logprobs" not in done.stderr, done.stderr
    record = json.loads(done.stdout)
    assert record["stats"]["completion_tokens"] == 8
    assert record["stats"]["confidence"] > 0


def test_include_usage_sends_a_last_chunk_with_the_usage(server: str):
    # Before: no usage chunk came (so phi4 with phi4 serve as its backend recorded 0 prompt
    # tokens).
    texts, finished, usage = streamed(
        client_of(server),
        messages=QUESTION,
        temperature=0,
        max_tokens=5,
        n=2,
        stream_options={"include_usage": True},
    )
    assert finished == {0: "length", 1: "length"} and all(texts.values())
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    _texts, _finished, none = streamed(client_of(server), messages=QUESTION, max_tokens=2)
    assert none is None


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        (
            "tools",
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "add", "parameters": {"type": "object"}},
                    }
                ]
            },
        ),
        ("tool_choice", {"tool_choice": "required"}),
        ("logprobs", {"logprobs": 1}),
        ("top_logprobs", {"top_logprobs": 2}),  # without logprobs: true, as OpenAI
        ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
        ("response_format", {"response_format": {"type": "json_object"}}),
        ("presence_penalty", {"presence_penalty": 2.5}),  # beyond OpenAI's -2 to 2
        ("logit_bias", {"logit_bias": {"12": 5}}),
        ("modalities", {"modalities": ["text", "audio"]}),
        ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
        ("reasoning_effort", {"reasoning_effort": "low"}),
        ("n", {"n": 17}),
        ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
        ("stream_options", {"stream_options": {"include_usage": True}}),  # without stream
        (
            "messages[0].content[1]",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AA=="},
                            },
                        ],
                    }
                ]
            },
        ),
    ],
)
def test_what_serve_does_not_do_is_a_400_naming_the_field(
    server: str, field: str, fields: dict[str, Any]
):
    # Before: each was ignored without a word (n 17 was refused, as any n but 1).
    body: dict[str, Any] = {"messages": QUESTION, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client_of(server).chat.completions.create(model="tiny-phi3", **body)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == field, error
    assert error["message"].startswith(f"'{field}'"), error


def test_presence_and_frequency_penalties_are_honoured(server: str):
    # Before: a 400 (the sampler had no such penalties); now llama.cpp's penalties sampler.
    client = client_of(server)
    plain = client.chat.completions.create(
        model="tiny-phi3", messages=QUESTION, temperature=0, max_tokens=24, seed=1
    )
    penalized = client.chat.completions.create(
        model="tiny-phi3",
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        seed=1,
        presence_penalty=2,
        frequency_penalty=2,
    )
    assert penalized.choices[0].message.content != plain.choices[0].message.content


def test_fields_that_ask_for_nothing_are_taken(server: str):
    reply = client_of(server).chat.completions.create(
        model="tiny-phi3",
        max_tokens=2,
        tools=[],
        tool_choice="none",
        logprobs=False,
        response_format={"type": "text"},
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        modalities=["text"],
        user="someone",
        store=False,
        metadata={"run": "1"},
        service_tier="auto",
        parallel_tool_calls=False,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is "},
                    {"type": "text", "text": "12*13?"},
                ],
            }
        ],
        extra_body={"not_openai_at_all": 1},
    )
    assert reply.choices[0].finish_reason == "length"


def test_a_client_hanging_up_cancels_every_choice(server: str):
    client = client_of(server)
    generated = metric(server, "phi4_tokens_total", kind="completion")
    stream = client.chat.completions.create(
        model="tiny-phi3", messages=QUESTION, temperature=0, max_tokens=3000, n=2, stream=True
    )
    for number, _chunk in enumerate(stream):
        if number == 6:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while metric(server, "phi4_requests_active") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "phi4_requests_active") == 0
    # Both were cut short: neither wrote its 3,000 tokens.
    assert metric(server, "phi4_tokens_total", kind="completion") - generated < 3000


@pytest.mark.parametrize(
    ("stops", "pieces", "passed", "stopped"),
    [
        (("END",), ["ab", "cE", "N", "Dxyz"], "abc", True),
        (("END",), ["ab", "cE", "N", "!"], "abcEN!", False),  # a start that was not one
        (("xyz", "c"), ["abxy", "zc"], "ab", True),  # the first written of several
        (("aab",), ["a", "a", "a", "b"], "a", True),  # held text re-checked as it grows
    ],
)
def test_stop_strings_are_found_across_pieces_and_nothing_after_is_passed(
    stops: tuple[str, ...], pieces: list[str], passed: str, stopped: bool
):
    matcher = StopStrings(stops)
    out, found = "", False
    for piece in pieces:
        text, found = matcher.feed(piece)
        out += text
        if found:
            break
    if not found:
        out += matcher.flush()
    assert (out, found) == (passed, stopped)


class _Tokens:
    """A request's events as the daemon sends them: ``count`` tokens, each with the logprobs
    of 20 alternatives, then its stats and end."""

    def __init__(self, count: int) -> None:
        from phi4cli.core.protocol import Event, EventKind

        alternatives = [
            {"token": f" t{i}", "logprob": -1.0 - i, "bytes": [32, 116, 48 + i % 10]}
            for i in range(20)
        ]
        self.events = iter(
            [
                Event(
                    EventKind.TOKEN,
                    text=" word",
                    data={
                        "logprobs": [
                            {
                                "token": " word",
                                "logprob": -0.5,
                                "bytes": list(b" word"),
                                "top_logprobs": [dict(a) for a in alternatives],
                            }
                        ]
                    },
                )
                for _ in range(count)
            ]
            + [Event(EventKind.DONE)]
        )

    def __iter__(self) -> _Tokens:
        return self

    def __next__(self) -> Any:
        return next(self.events)

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_stream_keeps_no_logprobs_it_has_sent():
    # Before: a streamed choice kept every entry it sent until its end, some 10 KB a token with
    # 20 alternatives: one n=16 stream of 2,000 tokens grew the server by 240 MB.
    import tracemalloc

    from phi4cli.serve.openai_response import Choice

    tokens = 3_000
    tracemalloc.start()
    try:
        streams = [_Tokens(tokens) for _ in range(2)]
        before = tracemalloc.get_traced_memory()[0]
        choice = Choice(0, streams[0], (), logprobs=True, streamed=True)  # type: ignore[arg-type]
        sent = sum(
            len(logprobs or []) for event in streams[0] for _delta, logprobs in choice.apply(event)
        )
        held = tracemalloc.get_traced_memory()[0] - before
        whole = Choice(0, streams[1], (), logprobs=True)  # type: ignore[arg-type]
        for event in streams[1]:
            whole.apply(event)
    finally:
        tracemalloc.stop()
    assert sent == tokens and choice.logprobs == []
    assert held < 2 << 20, f"{held / 2**20:.1f} MiB held after the stream sent its entries"
    assert whole.logprobs is not None and len(whole.logprobs) == tokens  # its one body needs them


def test_a_model_by_no_name_or_a_huge_one_is_a_short_404(server: str):
    # Before: /v1/models/ (and /v1/models/%0a) answered the served model, as if named; a name
    # of 70,000 characters came back whole in the 404's message.
    for path in ("/v1/models/", "/v1/models/%0a"):
        status, body = get(f"{server}{path}")
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found", body
    status, body = get(f"{server}/v1/models/{'a' * 70_000}")
    assert status == 404 and len(body) < 1_000, len(body)
    with pytest.raises(openai.NotFoundError) as refused:
        client_of(server).chat.completions.create(model="x" * 100_000, messages=QUESTION)
    assert len(str(refused.value)) < 1_000


def test_include_usage_null_is_not_given(server: str):
    # Before: a 400, where every other field's null is taken as not given.
    _texts, finished, usage = streamed(
        client_of(server), messages=QUESTION, max_tokens=2, stream_options={"include_usage": None}
    )
    assert finished == {0: "length"} and usage is None
