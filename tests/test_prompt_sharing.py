"""A prompt read once (issue 51, item 3): the samples of one question (`--samples K`, `eval -k`,
serve's ``n``), sent together, each sit in a slot of their own; one reads the question and the
others take its cells (shared in the unified KV cache) instead of reading it beside it. Through
the real daemon, on SmolLM2 and on the tiny model behind `phi4 serve`."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_phi4
from tests.test_http_api import JSON, fetch, start_server

pytestmark = pytest.mark.daemon


def _samples(model: Path, *extra: str) -> list[dict[str, Any]]:
    done = run_phi4("solve", "What is 19 times 29?", "-m", str(model), "--samples", "4",
                    "--all", "-n", "12", "--json", *extra, timeout=300)  # fmt: skip
    assert done.returncode in (0, 1), done.stderr  # (SmolLM2 may state no boxed answer)
    return [sample["stats"] for sample in json.loads(done.stdout)["samples"]]


def test_the_samples_of_a_question_read_it_once(smollm2_model: Path, phi4_home: Path):
    stats = _samples(smollm2_model)
    prompt = stats[0]["prompt_tokens"]
    read = sorted(s["prompt_eval_tokens"] for s in stats)
    # One sample reads the question (after the system prompt's cached cells); the three others
    # read only the last token, whose logits each needs for its own first draw.
    assert read[:3] == [1, 1, 1] and read[3] > 1, stats
    assert all(s["cached_tokens"] + s["prompt_eval_tokens"] == prompt for s in stats)
    # Asked again, every sample finds the question in the slots' cells.
    again = _samples(smollm2_model)
    assert [s["prompt_eval_tokens"] for s in again] == [1, 1, 1, 1], again
    # A deterministic request reads its own prompt afresh, as before.
    alone = run_phi4("solve", "What is 19 times 29?", "-m", str(smollm2_model), "-n", "4",
                     "--deterministic", "--json", timeout=300)  # fmt: skip
    assert json.loads(alone.stdout)["stats"]["cached_tokens"] < prompt - 1


def _tokens(url: str) -> dict[str, float]:
    """The daemon's token counters, from serve's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = fetch(f"{url}/metrics")
    assert status == 200, text
    return {sample.labels["kind"]: sample.value
            for family in text_string_to_metric_families(text) if family.name == "phi4_tokens"
            for sample in family.samples if sample.name.endswith("_total")}  # fmt: skip


def test_serves_n_choices_read_their_prompt_once_and_greedy_ones_agree(tiny_model: Path):
    proc, url = start_server(tiny_model)
    try:
        body = {"messages": [{"role": "user", "content": "Tell me about the number seven."}],
                "n": 4, "max_tokens": 24, "temperature": 0}  # fmt: skip
        before = _tokens(url)
        status, text = fetch(f"{url}/v1/chat/completions", json.dumps(body).encode(), JSON)
        assert status == 200, text
        reply = json.loads(text)
        contents = [choice["message"]["content"] for choice in reply["choices"]]
        assert len(set(contents)) == 1, contents  # the shared cells are the same cells
        after = _tokens(url)
        prompt = reply["usage"]["prompt_tokens"]  # (counted once for the n choices, as OpenAI)
        assert after["prompt"] - before["prompt"] == 4 * prompt
        # Three of the four choices read only their prompt's last token (whose logits each
        # needs); the daemon's counters add up every choice's cached tokens.
        assert after["cached"] - before["cached"] >= 3 * (prompt - 1), (before, after, prompt)
        status, text = fetch(f"{url}/v1/chat/completions",
                             json.dumps({**body, "n": 1}).encode(), JSON)  # fmt: skip
        assert json.loads(text)["choices"][0]["message"]["content"] == contents[0]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
