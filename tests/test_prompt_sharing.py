"""A prompt read once (issue 51, item 3): the samples of one question (`--samples K`, `eval -k`,
serve's ``n``), sent together, each sit in a slot of their own; one reads the question and the
others take its cells (shared in the unified KV cache) instead of reading it beside it. A
prompt whose cells were reclaimed is kept in RAM and put back when it is asked again. Through
the real daemon, on SmolLM2 and on the tiny model behind `phi4 serve`; the RAM cache's bounds
on their own."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from phi4cli.daemon.llama.prompt_cache import PromptCache
from tests.conftest import run_phi4
from tests.test_http_api import JSON, fetch, start_server

pytestmark = pytest.mark.daemon


def _samples(model: Path, *extra: str) -> list[dict[str, Any]]:
    done = run_phi4(
        "solve",
        "What is 19 times 29?",
        "-m",
        str(model),
        "--samples",
        "4",
        "--all",
        "-n",
        "12",
        "--json",
        *extra,
        timeout=300,
    )
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
    alone = run_phi4(
        "solve",
        "What is 19 times 29?",
        "-m",
        str(smollm2_model),
        "-n",
        "4",
        "--deterministic",
        "--json",
        timeout=300,
    )
    assert json.loads(alone.stdout)["stats"]["cached_tokens"] < prompt - 1


def _tokens(url: str) -> dict[str, float]:
    """The daemon's token counters, from serve's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = fetch(f"{url}/metrics")
    assert status == 200, text
    return {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "phi4_tokens"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_serves_n_choices_read_their_prompt_once_and_greedy_ones_agree(tiny_model: Path):
    proc, url = start_server(tiny_model)
    try:
        body = {
            "messages": [{"role": "user", "content": "Tell me about the number seven."}],
            "n": 4,
            "max_tokens": 24,
            "temperature": 0,
        }
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
        status, text = fetch(
            f"{url}/v1/chat/completions", json.dumps({**body, "n": 1}).encode(), JSON
        )
        assert json.loads(text)["choices"][0]["message"]["content"] == contents[0]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def _solve(model: Path, question: str) -> dict[str, Any]:
    done = run_phi4("solve", question, "-m", str(model), "-n", "4", "--json", timeout=300)
    assert done.returncode in (0, 1), done.stderr
    stats: dict[str, Any] = json.loads(done.stdout)["stats"]
    return stats


def test_a_prompt_whose_cells_were_taken_is_put_back_from_ram(
    smollm2_model: Path, phi4_home: Path, monkeypatch: pytest.MonkeyPatch
):
    # One slot: the second question takes the first's cells, and the first, asked again, finds
    # its prompt in RAM instead of reading it again; `cache clear` empties the cache.
    monkeypatch.setenv("PHI4_PARALLEL", "1")
    first, second = "What is 17 times 29, exactly, in base ten?", "Name three primes above fifty."
    read = _solve(smollm2_model, first)
    assert read["restored_tokens"] == 0 and read["prompt_eval_tokens"] > 16
    _solve(smollm2_model, second)
    again = _solve(smollm2_model, first)
    assert again["restored_tokens"] == again["prompt_tokens"] - 1, again
    assert again["prompt_eval_tokens"] == 1
    shown = run_phi4("status")
    assert "put back 1 time (" in shown.stdout, shown.stdout
    status = json.loads(run_phi4("status", "--json").stdout)
    kept = status["memory"]["prompt_cache"]
    assert kept["prompts"] == 2 and 0 < kept["bytes"] <= kept["max_bytes"], kept
    cleared = run_phi4("cache", "clear")
    assert cleared.returncode == 0, cleared.stderr
    assert "emptied the daemon's prompt cache: 2 prompts" in cleared.stdout, cleared.stdout
    status = json.loads(run_phi4("status", "--json").stdout)
    assert status["memory"]["prompt_cache"]["prompts"] == 0


def test_the_ram_cache_keeps_the_most_recent_prompts_within_its_bytes():
    cache = PromptCache(max_bytes=100)
    cache.put([1, 2, 3], b"a" * 40)
    cache.put([4, 5, 6], b"b" * 40)
    assert cache.best([1, 2, 3, 9], beyond=0) is not None  # (and now the most recent)
    cache.put([7, 8], b"c" * 40)  # 120 bytes: the least recently used goes
    assert cache.best([4, 5, 6], beyond=0) is None
    found = cache.best([1, 2, 3, 9], beyond=0)
    assert found is not None and found[1] == 3
    assert cache.best([1, 2, 3, 9], beyond=3) is None, "no better than the slot holds"
    cache.put([1, 2, 3, 4, 5], b"d" * 40)  # serves [1, 2, 3] too: that one goes
    assert cache.usage()["prompts"] == 2 and cache.usage()["bytes"] == 80
    cache.put([9] * 10, b"e" * 101)  # larger than the whole bound: not kept
    assert cache.usage()["prompts"] == 2
    assert cache.clear() == {"prompts": 2, "bytes": 80}
    assert cache.usage()["bytes"] == 0


def test_common_prefix_agrees_with_a_token_by_token_count():
    from hypothesis import given
    from hypothesis import strategies as st

    from phi4cli.daemon.llama.prompt_cache import common_prefix

    def counted(a: list[int], b: list[int]) -> int:
        count = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            count += 1
        return count

    tokens = st.lists(st.integers(0, 3), max_size=40)

    @given(tokens, tokens)
    def agree(a: list[int], b: list[int]) -> None:
        assert common_prefix(a, b) == counted(a, b)
        assert common_prefix(tuple(a), b) == counted(a, b)
        assert common_prefix(a, a + b) == len(a)

    agree()
