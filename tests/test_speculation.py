"""Exact self-speculation (issue 51, item 4): drafts read from text the daemon holds, verified in
the step's batch with the request's own sampler, kept only while each is the token drawn; a gate
that drafts only where its own measurements say it pays. The drafter, the cost table and the
gate on their own; then the real daemon on SmolLM2: the same greedy text with drafting on as
off, the drafts counted in --json stats, status and /metrics, none for a deterministic
request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phi4cli.core._settings import Ask, Settings
from phi4cli.core.protocol import SolveParams, Stats
from phi4cli.daemon.jobs import Job
from phi4cli.daemon.llama.batch import LlamaEngine
from phi4cli.daemon.llama.prompt_cache import common_prefix
from phi4cli.daemon.llama.speculation import (
    DRAFT_MAX,
    ON_DRAFT,
    OWN_MIN,
    Acceptance,
    DecodeCost,
    Drafter,
    Gate,
    NgramIndex,
    replay,
)
from tests.conftest import run_phi4
from tests.test_prompt_scheduling import PROBLEM
from tests.test_thinking_control import ANSWER, THINKING
from tests.tinymodel import write_script_model

# --- the drafter --------------------------------------------------------------------------------


def test_an_index_finds_the_latest_occurrence_of_the_longest_ending():
    index = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 5])
    # "2 3" last occurred before the final 5 (position 11); "1 2 3" only at the start.
    assert index.find([8, 2, 3]) == (11, 2)
    assert index.find([1, 2, 3]) == (3, 3)
    # The sequence's own end is not an occurrence: "3 5" is found where a token followed it.
    assert index.find([3, 5]) == (8, 2)
    assert index.find([42]) is None


def test_a_drafter_copies_its_own_text_then_its_siblings():
    own = NgramIndex([10, 11, 12, 13, 14, 15])
    drafter = Drafter(own)
    assert drafter.draft([10, 11], 3) == ([12, 13, 14], "own")
    assert drafter.draft([14], 3) == ([15], "own")  # (as far as the text goes)
    assert drafter.draft([99], 3) == ([], "")
    # A sibling (the same question, sampled again) knows what follows 99.
    drafter.siblings.append(NgramIndex([5, 99, 6, 7]))
    assert drafter.draft([99], 2) == ([6, 7], "siblings")
    # A longer ending found in the pool wins over a shorter one of its own.
    drafter.pool = [NgramIndex([20, 12, 13, 30, 31])]
    assert drafter.draft([20, 12, 13], 2) == ([30, 31], "pool")
    assert drafter.draft([0, 12, 13], 2) == ([14, 15], "own")


def test_a_drafter_follows_a_sequence_that_was_taken_back():
    drafter = Drafter()
    drafter.follow([1, 2, 3, 4])
    drafter.follow([1, 2])  # (a Wait took tokens back, or a draft was rejected)
    drafter.follow([1, 2, 7, 8])
    assert drafter.own.tokens == [1, 2, 7, 8]


def test_a_shadow_draft_is_judged_once_the_tokens_tell():
    drafter = Drafter(shadow=[5, 6, 7], shadow_at=2, shadow_source="own")
    assert drafter.shadow_judged([1, 2, 5, 6]) is None  # right so far: not yet known
    assert drafter.shadow_judged([1, 2, 5, 6, 9]) == ("own", 3, 2)
    assert drafter.shadow == []
    drafter = Drafter(shadow=[5], shadow_at=4, shadow_source="pool")
    assert drafter.shadow_judged([1, 2]) is None and drafter.shadow == []  # taken back
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2  # (how many of a draft were right)


def test_a_replay_of_text_that_repeats_takes_fewer_steps_than_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 20
    emitted, steps, drafted, accepted = replay(tokens, 8, DRAFT_MAX)
    assert emitted == len(tokens) - 8
    assert steps < emitted / 4 and accepted == emitted - steps and drafted >= accepted
    # Without drafts, a step a token.
    assert replay(tokens, 8, 0)[:2] == (emitted, emitted)


# --- the gate -----------------------------------------------------------------------------------


def test_decode_costs_are_interpolated_between_sizes_measured():
    cost = DecodeCost()
    assert cost.estimate(4) is None
    cost.add(1, 1.0)
    cost.add(9, 5.0)
    assert cost.estimate(5) == pytest.approx(3.0)
    assert cost.estimate(18) == pytest.approx(10.0)  # past the largest: no cheaper per token
    cost.add(5, 2.0)  # measured: the line gives way
    assert cost.estimate(5) == 2.0 and cost.sizes == [1, 5, 9]


def _gate(mode: str, seconds: dict[int, float], judged: list[tuple[int, int]]) -> Gate:
    gate = Gate(mode)
    for tokens, took in seconds.items():
        gate.decoded(tokens, took)
    for drafted, right in judged:
        gate.judge(Drafter(), "own", drafted, right)  # (the daemon's record)
    return gate


# Drafts of 8 whose tokens are each right half the time, after a right one (as the real-trace
# replay's): 16 steps keep none, 8 one, 4 two...
FAIR = [(8, 0)] * 16 + [(8, 1)] * 8 + [(8, 2)] * 4 + [(8, 3)] * 2 + [(8, 8)] * 2
GPU = {1: 0.010, 2: 0.010, 9: 0.011, 17: 0.013}  # eight more tokens cost about one
CPU = {1: 0.080, 2: 0.136, 5: 0.230, 9: 0.490}  # a token more, most of a step (here)


def test_the_gate_drafts_where_verifying_is_cheap_and_not_where_it_costs_a_step_a_token():
    one = [Drafter()]
    assert _gate("auto", GPU, FAIR).lengths(one) != [0]
    assert _gate("auto", CPU, FAIR).lengths(one) == [0]
    # Where every draft is right, even a CPU's cost is worth it.
    assert _gate("auto", CPU, [(8, 8)] * 8).lengths(one) != [0]
    # Drafts that are seldom right do not pay even where verifying is cheap.
    assert _gate("auto", GPU, [(8, 0)] * 40).lengths(one) == [0]
    assert Gate("auto").lengths(one) == [0]  # nothing measured yet: no draft
    assert _gate("on", {}, []).lengths([Drafter(), None]) == [ON_DRAFT, 0]
    assert _gate("off", GPU, FAIR).lengths(one) == [0]
    described = _gate("auto", GPU, FAIR).describe()
    assert described["mode"] == "auto"
    assert described["acceptance"]["own"] == pytest.approx(38 / 256, abs=0.001)
    assert described["decode_cost"][9] == 1.1


def test_each_request_drafts_by_its_own_record_once_it_has_one():
    gate = _gate("auto", CPU, FAIR)  # the daemon's drafts: not worth it here
    looping, fresh = Drafter(), Drafter()
    for _ in range(OWN_MIN):
        gate.judge(looping, "own", 8, 8)  # an answer that repeats itself: every draft right
    # The looping answer drafts (its record); the fresh one goes by the daemon's, and does not.
    lengths = gate.lengths([fresh, looping, None])
    assert lengths[0] == 0 and lengths[1] > 0 and lengths[2] == 0
    assert gate.describe()["draft_lengths"] == lengths
    # Two that loop share the batch's cost: the second is weighed beside the first's draft,
    # which here leaves no draft worth its cost; where verifying is cheap, both draft.
    other = Drafter()
    for _ in range(OWN_MIN):
        gate.judge(other, "own", 8, 8)
    first, second = gate.lengths([looping, other])
    assert first > 0 and second < first
    cheap = _gate("auto", GPU, FAIR)
    assert all(cheap.lengths([looping, other]))


def test_a_draft_verified_whole_is_judged_with_its_unverified_rest():
    drafter = Drafter(shadow=[7, 8], shadow_at=5, shadow_prior=(2, 2), shadow_source="own")
    assert drafter.shadow_judged([0, 1, 2, 3, 4, 7, 9]) == ("own", 4, 3)
    assert drafter.shadow_prior == (0, 0)


def test_a_shadow_draft_is_judged_by_the_tokens_not_yet_in_the_kv_and_cut_when_replaced():
    # Drafted from position 4, whose token is still pending (drawn, not yet decoded).
    drafter = Drafter(shadow=[7, 8, 9], shadow_at=4, shadow_source="own")
    assert drafter.shadow_judged([0, 1, 2, 3], [7]) is None  # right so far
    assert drafter.shadow_judged([0, 1, 2, 3, 7], [5]) == ("own", 3, 1)
    # A draft still open when a real one replaces it counts as far as it is known.
    drafter = Drafter(shadow=[7, 8, 9], shadow_at=4, shadow_prior=(4, 4), shadow_source="pool")
    assert drafter.shadow_judged([0, 1, 2, 3, 7], [8], cut=True) == ("pool", 6, 6)
    assert drafter.shadow == []


def test_acceptance_counts_a_window_of_drafts():
    record = Acceptance(3)
    for drafted, right in [(8, 8), (4, 1), (0, 0), (8, 2)]:  # (the first falls out)
        record.add(drafted, right)
    assert record.expected(2) == (pytest.approx(4 / 3), pytest.approx(3 / 3))
    assert record.expected(8) == (pytest.approx(12 / 3), pytest.approx(3 / 3))
    assert record.totals() == (12, 3)


# --- the engine, in process -----------------------------------------------------------------------


def _answers(model: Path, mode: str) -> list[tuple[str, Stats]]:
    """Two requests at once, sampled with seeds, on a model that thinks in a loop."""
    engine = LlamaEngine(Settings(n_ctx=4096, threads=1, ramdisk="off", parallel=2, speculate=mode))
    engine.load(model)
    try:
        texts: dict[int, list[str]] = {1: [], 2: []}
        jobs = []
        for index in (1, 2):
            ask = Ask(temperature=0.7, seed=index, max_tokens=160, loop="off")

            def keep(event: Any, index: int = index) -> None:
                texts[index].append(event.text)

            job = Job(index, SolveParams(PROBLEM.format(i=index, m=7), ask), keep)
            assert engine.admit(job) is None
            jobs.append(job)
        finished: dict[int, Stats] = {}
        while len(finished) < 2:
            for job, stats in engine.step():
                finished[job.request_id] = stats
        described = engine.memory()["speculation"]
        assert described["mode"] == mode
        return [("".join(texts[i]), finished[i]) for i in (1, 2)]
    finally:
        engine.close()


def test_a_looping_answer_drafts_and_draws_the_same_text(tmp_path: Path):
    model = write_script_model(tmp_path / "loops.gguf", THINKING, ANSWER, loops=True)
    plain = _answers(model, "off")
    drafted = _answers(model, "on")
    assert [text for text, _ in drafted] == [text for text, _ in plain]
    assert all(len(text) > 100 for text, _ in plain)
    assert all(stats.draft_accepted > 0 for _, stats in drafted), drafted
    assert all(
        s.completion_tokens == p.completion_tokens
        for (_, s), (_, p) in zip(drafted, plain, strict=True)
    )
    assert all(stats.draft_tokens == 0 for _, stats in plain)


# --- through the real daemon --------------------------------------------------------------------

QUESTION = "Count from one to thirty in words, one number per line."


def _solve(model: Path, mode: str, *extra: str) -> tuple[str, dict[str, Any]]:
    done = run_phi4(
        "solve",
        QUESTION,
        "-m",
        str(model),
        "-n",
        "160",
        "--json",
        *extra,
        env={"PHI4_SPECULATE": mode},
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr  # (SmolLM2 may state no boxed answer)
    reply = json.loads(done.stdout)
    return reply["answer"], reply["stats"]


@pytest.mark.daemon
def test_greedy_text_is_the_same_drafted_as_not(smollm2_model: Path, phi4_home: Path):
    plain, off = _solve(smollm2_model, "off", "-t", "0")
    assert off["draft_tokens"] == 0
    assert run_phi4("stop").returncode == 0
    drafted, on = _solve(smollm2_model, "on", "-t", "0")
    assert on["draft_tokens"] > 0 and 0 < on["draft_accepted"] <= on["draft_tokens"], on
    assert drafted == plain
    assert on["completion_tokens"] == off["completion_tokens"]
    # Status says what the drafts did; a deterministic request drafts nothing.
    status = run_phi4("status", "--json")
    speculating = json.loads(status.stdout)["memory"]["speculation"]
    assert speculating["mode"] == "on" and speculating["draft_accepted"] >= on["draft_accepted"]
    shown = run_phi4("status")
    assert "speculation" in shown.stdout and "drafted tokens kept" in shown.stdout
    _, alone = _solve(smollm2_model, "on", "-t", "0", "--deterministic")
    assert alone["draft_tokens"] == 0
    # The drafts' counts come back in a solve's own stats, as fields.
    assert Stats.from_mapping(on).draft_accepted == on["draft_accepted"]


@pytest.mark.daemon
def test_seeded_samples_draw_the_same_text_drafted_as_not(smollm2_model: Path, phi4_home: Path):
    plain, _ = _solve(smollm2_model, "off", "-t", "0.8", "--seed", "7")
    assert run_phi4("stop").returncode == 0
    drafted, on = _solve(smollm2_model, "on", "-t", "0.8", "--seed", "7")
    assert on["draft_tokens"] > 0
    assert drafted == plain
