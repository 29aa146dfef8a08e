"""How the engine shares its steps between prompts being read and answers streaming, on the real
llama.cpp context (the engine in process, stepped by hand): prompts sent together are read in
whole batches while the first answer waits; a prompt that comes while an answer streams is read
in small chunks beside it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from phi4cli.core._settings import Ask, Settings
from phi4cli.core.protocol import SolveParams
from phi4cli.daemon.jobs import Job
from phi4cli.daemon.llama.batch import PREFILL_CHUNK, LlamaEngine
from phi4cli.daemon.llama.slots import Slot
from tests.test_thinking_control import ANSWER, THINKING
from tests.tinymodel import write_script_model

# Words outside the script's vocabulary: read byte by byte, several hundred tokens.
PROBLEM = "Problem {i}: a sequence mod {m} is summed and compared with a bound. " * 12


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[LlamaEngine]:
    # Thinks without end (greedy), so no answer ends while the test watches.
    model = write_script_model(tmp_path / "loops.gguf", THINKING, ANSWER, loops=True)
    engine = LlamaEngine(Settings(n_ctx=8192, threads=1, ramdisk="off", parallel=4))
    engine.load(model)
    engine.warm()
    yield engine
    engine.close()


def admit(engine: LlamaEngine, index: int) -> Slot:
    params = SolveParams(
        PROBLEM.format(i=index, m=97 + index), Ask(temperature=0.0, max_tokens=400, loop="off")
    )
    job = Job(index, params, lambda event: None)
    assert engine.admit(job) is None
    return next(s for s in engine._slots if s.run is not None and s.run.job is job)


def state(slot: Slot) -> tuple[int, int]:
    """(prompt tokens still to read, tokens generated)."""
    assert slot.run is not None
    return len(slot.pending) if slot.run.prompt_s is None else 0, slot.run.generated


def test_prompts_sent_together_are_read_in_whole_batches_while_the_first_answer_waits(
    engine: LlamaEngine,
) -> None:
    first, second = admit(engine, 1), admit(engine, 2)
    assert len(second.pending) > engine.n_batch // 2  # long enough to need several chunks
    steps = []
    while state(second)[0]:
        engine.step()
        steps.append((state(first), state(second)))
    answering = [i for i, (one, _) in enumerate(steps) if one[0] == 0]
    assert answering, steps
    # From the step that read the end of the first prompt on, the second got all the room
    # left in each batch (not a small chunk), and the first answer waited for it.
    start = answering[0]
    for (one, two), (after_one, after_two) in zip(steps[start:], steps[start + 1 :], strict=False):
        assert after_two[0] == max(0, two[0] - engine.n_batch), steps
        assert after_one == one, steps
    # Then both answer, a token each per step.
    engine.step()
    assert state(first)[1] == steps[-1][0][1] + 1 and state(second)[1] == 2


def test_a_prompt_that_comes_while_an_answer_streams_is_read_in_small_chunks_beside_it(
    engine: LlamaEngine,
) -> None:
    first = admit(engine, 1)
    while state(first)[1] < 3:
        engine.step()
    second = admit(engine, 2)
    assert len(second.pending) > 3 * PREFILL_CHUNK
    while state(second)[0]:
        before_one, before_two = state(first), state(second)
        engine.step()
        # The stream a user is watching goes on, a token a step at least; the prompt a chunk.
        assert state(first)[1] >= before_one[1] + 1  # (more, where a draft was kept)
        assert state(second)[0] == max(0, before_two[0] - PREFILL_CHUNK)


def test_a_prompt_that_came_before_the_streaming_answer_began_is_ahead_of_it(
    engine: LlamaEngine,
) -> None:
    # Three sent together: the third still reading when the first two answer is read whole.
    slots = [admit(engine, i) for i in (1, 2, 3)]
    while state(slots[1])[0]:
        engine.step()
    if state(slots[2])[0]:
        before = [state(s) for s in slots]
        engine.step()
        assert state(slots[2])[0] == max(0, before[2][0] - engine.n_batch)
        assert [state(s) for s in slots[:2]] == before[:2]
    # A fourth that comes now, with answers streaming, is behind them.
    late = admit(engine, 4)
    while state(slots[2])[0]:
        engine.step()
    before = [state(s) for s in [*slots, late]]
    engine.step()
    assert [state(s)[1] for s in slots] == [b[1] + 1 for b in before[:3]]
    assert state(late)[0] == max(0, before[3][0] - PREFILL_CHUNK)


def test_a_prompt_that_came_behind_a_stream_stays_behind_when_that_stream_ends(
    engine: LlamaEngine,
) -> None:
    # Review finding: A streams; B, then C, come behind it (read in chunks). B begins answering
    # after C came, then A ends: C's admission is now before every stream's first token, and C
    # was read whole while B, whose answer the user is watching, froze.
    first = admit(engine, 1)
    while state(first)[1] < 2:
        engine.step()
    second, third = admit(engine, 2), admit(engine, 3)
    while state(second)[0]:
        engine.step()
    assert state(third)[0], "the third prompt must still be reading"
    first.run.job.cancelled.set()  # type: ignore[union-attr]
    engine.step()
    while state(third)[0]:
        before_two, before_three = state(second), state(third)
        engine.step()
        assert state(second)[1] >= before_two[1] + 1  # (more, where a draft was kept)
        assert state(third)[0] == max(0, before_three[0] - PREFILL_CHUNK)


def test_a_burst_that_comes_while_an_answer_streams_is_read_a_chunk_for_each_prompt(
    engine: LlamaEngine,
) -> None:
    # Two prompts that came a little after the first (its answer streaming): a chunk's room for
    # each, the first come first, so the burst is read in the steps one prompt would take.
    first = admit(engine, 1)
    while state(first)[1] < 3:
        engine.step()
    second, third = admit(engine, 2), admit(engine, 3)
    assert len(second.pending) > 2 * PREFILL_CHUNK
    before = [state(s) for s in (first, second, third)]
    engine.step()
    assert state(first)[1] == before[0][1] + 1, "the stream goes on, a token a step"
    assert state(second)[0] == before[1][0] - 2 * PREFILL_CHUNK, "the first come takes the room"
    assert state(third)[0] == before[2][0]
    while state(second)[0]:
        engine.step()
    assert state(third)[0] < before[2][0], "then the next"
