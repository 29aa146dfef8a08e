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

from phi4cli.core.protocol import Stats
from phi4cli.daemon.llama.speculation import (
    DRAFT_MAX,
    ON_DRAFT,
    DecodeCost,
    Drafter,
    Gate,
    NgramIndex,
    replay,
    right_count,
)
from tests.conftest import run_phi4

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
    assert right_count([1, 2, 3], [1, 2, 4]) == 2


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
    assert cost.estimate(5) == 2.0 and cost.measured(5) == 1


def _gate(mode: str, seconds: dict[int, float], judged: list[tuple[int, int]]) -> Gate:
    gate = Gate(mode)
    for tokens, took in seconds.items():
        gate.decoded(tokens, took)
    for drafted, right in judged:
        gate.judge("own", drafted, right)
    return gate


def test_the_gate_drafts_where_verifying_is_cheap_and_not_where_it_costs_a_step_a_token():
    # Drafts of 8 whose tokens are each right half the time, after a right one (as the
    # real-trace replay's): 16 steps keep none, 8 one, 4 two...
    good_drafts = [(8, 0)] * 16 + [(8, 1)] * 8 + [(8, 2)] * 4 + [(8, 3)] * 2 + [(8, 8)] * 2
    # A GPU: eight more tokens of one sequence cost about one.
    gpu = _gate("auto", {1: 0.010, 9: 0.011, 17: 0.013}, good_drafts)
    assert gpu.length(1) > 0
    # A 2-core CPU (here): a token more costs most of a step (1.7x for 2, 5.9x for 8).
    cpu = _gate("auto", {1: 0.080, 2: 0.136, 5: 0.230, 9: 0.490}, good_drafts)
    assert cpu.length(1) == 0
    # Where every draft is right, even that pays.
    assert _gate("auto", {1: 0.080, 2: 0.136, 5: 0.230, 9: 0.490}, [(8, 8)] * 8).length(1) > 0
    # Drafts that are seldom right do not pay even where verifying is cheap.
    poor = _gate("auto", {1: 0.010, 9: 0.012}, [(8, 0)] * 40)
    assert poor.length(1) == 0
    # Nothing measured yet: no draft.
    assert Gate("auto").length(1) == 0
    assert _gate("on", {}, []).length(3) == ON_DRAFT
    assert _gate("off", {1: 0.01, 9: 0.01}, good_drafts).length(1) == 0
    described = gpu.describe()
    assert described["mode"] == "auto"
    assert described["acceptance"]["own"] == pytest.approx(38 / 256, abs=0.001)
    assert described["decode_cost"][9] == 1.1


# --- through the real daemon --------------------------------------------------------------------

QUESTION = "Count from one to thirty in words, one number per line."


def _solve(model: Path, mode: str, *extra: str) -> tuple[str, dict[str, Any]]:
    done = run_phi4("solve", QUESTION, "-m", str(model), "-n", "160", "--json", *extra,
                    env={"PHI4_SPECULATE": mode}, timeout=300)  # fmt: skip
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
