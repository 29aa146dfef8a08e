"""A start answers from a small context while the plan's whole one is made in the background
(``memory.start_cells``, ``model.GrowingContext``, ``LoadedModel.grow``): on the real llama.cpp
context (the engine in process, stepped by hand, the tiny model), what it answers is what a
daemon that made the whole context at once answers, whether the move comes mid-answer, when the
small context is full, or while idle; a whole context that cannot be made leaves the small one
serving. The plan's part (when to start small) is a pure function, tested over machines."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from phi4cli.client.render import format_status, format_warm
from phi4cli.core._settings import Ask, Settings
from phi4cli.core.protocol import ErrorCode, EventKind, SolveParams
from phi4cli.daemon import memory
from phi4cli.daemon.jobs import ContextOverflowError, Job
from phi4cli.daemon.llama import model as model_module
from phi4cli.daemon.llama.batch import LlamaEngine
from phi4cli.daemon.memory import (
    START_CELLS,
    GiB,
    Machine,
    MemoryRequest,
    MiB,
    ModelShape,
    plan_memory,
    start_cells,
)

# A request's room in the small context here: the shared cache's cells, or each stream's (at
# least n_batch with the shared layout: llama.cpp takes no batch over its n_ctx).
SMALL = 512
WHOLE = 4096
# 68 tokens of the tiny model's as a question (16 of them the system prompt's): two, and their
# answers, fit the small context; two of LONG (418 tokens each) do not.
PROBLEM = "Problem {i}: a sequence mod {m} is summed and compared with a bound. "
LONG = PROBLEM * 8


class Gate:
    """Holds the making of the whole context until opened (or makes it fail)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        def small(plan: Any, shape: Any, machine: Any) -> int:
            return SMALL * (plan.slots if plan.kv_layout == "streams" else 1)

        self.opened = threading.Event()
        real = model_module._make_context

        def make(model: Any, plan: Any, n_ctx: int, n_batch: int, threads: int) -> Any:
            if n_ctx == plan.n_ctx:
                assert self.opened.wait(60), "the test never opened the gate"
                if fail:
                    raise ValueError("out of memory (the test's)")
            return real(model, plan, n_ctx, n_batch, threads)

        monkeypatch.setattr(model_module, "_make_context", make)
        monkeypatch.setattr(model_module, "start_cells", small)


@pytest.fixture(params=["shared", "streams"])
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_engine(tiny_model: Path, layout: str) -> LlamaEngine:
    engine = LlamaEngine(
        Settings(n_ctx=WHOLE, threads=1, ramdisk="off", parallel=2, kv_layout=layout)
    )
    engine.load(tiny_model)
    engine.warm()
    assert engine._model is not None and engine._model.plan.kv_layout == layout
    return engine


@pytest.fixture
def whole(tiny_model: Path, layout: str) -> Iterator[LlamaEngine]:
    """An engine that made its whole context at once (the tiny model's cache is too small for
    the plan to start small)."""
    engine = make_engine(tiny_model, layout)
    assert engine._model is not None and engine._model.growing is None
    yield engine
    engine.close()


@pytest.fixture
def start_small(
    tiny_model: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[LlamaEngine, Gate]]]:
    """Start engines that answer from a small context until their gate is opened."""
    made: list[tuple[LlamaEngine, Gate]] = []

    def start(fail: bool = False) -> tuple[LlamaEngine, Gate]:
        gate = Gate(monkeypatch, fail)
        made.append((make_engine(tiny_model, layout), gate))
        return made[-1]

    yield start
    for engine, gate in made:
        gate.opened.set()
        engine.close()


def admit(
    engine: LlamaEngine, index: int, tokens: int = 48, problem: str = PROBLEM
) -> tuple[Job, list[str]]:
    said: list[str] = []

    def emit(event: Any) -> None:
        if event.kind in (EventKind.TOKEN, EventKind.REASONING):
            said.append(event.text)

    params = SolveParams(
        problem.format(i=index, m=97 + index), Ask(temperature=0.0, max_tokens=tokens, loop="off")
    )
    job = Job(index, params, emit)
    assert engine.admit(job) is None
    return job, said


def run(engine: LlamaEngine, between: Callable[[int], None] = lambda step: None) -> int:
    """Step until no request is left; ``between`` is called before each step. Return steps."""
    steps = 0
    while engine.active:
        between(steps)
        engine.step()
        steps += 1
    return steps


def answers(
    engine: LlamaEngine,
    count: int,
    problem: str = PROBLEM,
    between: Callable[[int], None] = lambda step: None,
    tokens: int = 48,
) -> list[str]:
    said = [admit(engine, i, tokens, problem)[1] for i in range(count)]
    run(engine, between)
    return ["".join(words) for words in said]


def test_the_answers_are_those_of_the_whole_context_when_it_moves_in_mid_answer(
    whole: LlamaEngine, start_small: Callable[..., tuple[LlamaEngine, Gate]], layout: str
) -> None:
    expected = answers(whole, 2)
    engine, gate = start_small()
    loaded = engine._model
    assert loaded is not None and loaded.growing is not None
    small = SMALL * (2 if layout == "streams" else 1)
    assert loaded.cells_now == small and loaded.n_ctx == WHOLE
    assert engine.memory()["context_cells"] == small

    def open_at_step_3(step: int) -> None:
        if step == 3:
            assert loaded.growing is not None, "moved before the gate opened"
            gate.opened.set()
            loaded.growing.wait()

    said = answers(engine, 2, between=open_at_step_3)
    assert loaded.growing is None and loaded.cells_now == WHOLE
    assert engine.memory()["context_cells"] == WHOLE
    assert said == expected
    assert all(text for text in said)


def test_a_step_the_small_context_cannot_hold_waits_for_the_whole_one(
    whole: LlamaEngine, start_small: Callable[..., tuple[LlamaEngine, Gate]]
) -> None:
    # (A stream takes a LONG prompt and the system prompt's: its answer overflows it.)
    expected = answers(whole, 2, LONG, tokens=150)
    engine, gate = start_small()
    loaded = engine._model
    assert loaded is not None
    # Two prompts read together overflow the small context: the step waits for the whole
    # one, which this timer lets be made only after a while.
    threading.Timer(0.5, gate.opened.set).start()
    started = time.monotonic()
    said = answers(engine, 2, LONG, tokens=150)
    assert time.monotonic() - started >= 0.5
    assert loaded.growing is None and loaded.cells_now == WHOLE
    assert said == expected


def test_an_idle_engine_moves_in_when_tended(
    start_small: Callable[..., tuple[LlamaEngine, Gate]],
) -> None:
    engine, gate = start_small()
    loaded = engine._model
    assert loaded is not None and loaded.growing is not None
    assert engine.tend() is True  # still being made: the worker is to come back
    assert engine.memory()["context_growing_s"] >= 0
    gate.opened.set()
    loaded.growing.wait()
    assert engine.tend() is False
    assert loaded.growing is None and loaded.cells_now == WHOLE
    assert engine.tend() is False  # nothing more to do
    assert "context_growing_s" not in engine.memory()


def test_closing_while_the_whole_context_is_made_waits_for_it(
    start_small: Callable[..., tuple[LlamaEngine, Gate]],
) -> None:
    engine, gate = start_small()
    loaded = engine._model
    assert loaded is not None and loaded.growing is not None
    growing = loaded.growing
    threading.Timer(0.3, gate.opened.set).start()
    engine.close()  # (the thread uses the model: closing it first would crash llama.cpp)
    assert growing.done() and growing.context is not None


def test_a_whole_context_that_cannot_be_made_leaves_the_small_one_serving(
    whole: LlamaEngine,
    start_small: Callable[..., tuple[LlamaEngine, Gate]],
    layout: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    expected = answers(whole, 1)
    engine, gate = start_small(fail=True)
    loaded = engine._model
    assert loaded is not None and loaded.growing is not None
    gate.opened.set()
    with caplog.at_level(logging.WARNING, logger="phi4.engine"):
        loaded.growing.wait()
        engine.tend()
    assert "could not make the whole context of 4096 cells" in caplog.text
    assert loaded.growing is None
    small = SMALL * (2 if layout == "streams" else 1)
    assert loaded.n_ctx == loaded.cells_now == small
    assert engine.memory()["n_ctx"] == small
    assert answers(engine, 1) == expected  # one fits the small context
    # One that needs more than it holds is refused as it would be by a small daemon.
    params = SolveParams(LONG.format(i=0, m=97), Ask(temperature=0.0, max_tokens=SMALL))
    with pytest.raises(ContextOverflowError):
        engine.admit(Job(9, params, lambda event: None))


def test_requests_the_small_context_cannot_hold_end_when_the_whole_one_cannot_be_made(
    start_small: Callable[..., tuple[LlamaEngine, Gate]],
) -> None:
    engine, gate = start_small(fail=True)
    # Admitted against the whole context: each reserves more than the small one holds.
    jobs = [admit(engine, i, 150, LONG)[0] for i in range(2)]
    gate.opened.set()
    finished = []
    for _ in range(400):  # until a step would overflow the small context (it waits, in vain)
        finished += engine.step()
        if not engine.active:
            break
    assert sorted(job.request_id for job, _ in finished) == [0, 1]
    assert all(job.cancel_code == ErrorCode.CONTEXT_OVERFLOW for job in jobs)
    # Said as data: each door words it (serve names max_tokens in its 400).
    faults = [job.cancel_fault for job in jobs if job.cancel_fault is not None]
    assert faults and all(f.shrunk and f.param == "max_tokens" for f in faults)
    assert all(f.needed > f.limit for f in faults)
    assert all("could not make its whole context" in (job.cancel_message or "") for job in jobs)
    assert engine.active == 0
    assert answers(engine, 1)[0], "the small context still answers what it holds"


# --- the plan's part -----------------------------------------------------------------------

PHI4_MINI = ModelShape(
    n_layer=32,
    n_head_kv=8,
    head_dim_k=128,
    head_dim_v=128,
    n_ctx_train=131072,
    file_bytes=int(2.3 * GiB),
    layer_bytes=int(2.3 * GiB) // 36,
    thinks=True,
)


def plan(machine: Machine, **request: Any) -> memory.MemoryPlan:
    return plan_memory(PHI4_MINI, machine, MemoryRequest(**request))


def test_a_large_cache_on_a_roomy_machine_starts_small() -> None:
    roomy = Machine(ram_available=24 * GiB, ram_total=32 * GiB)
    # A reasoning model's default: a stream each for 4 requests of 8,192 tokens (4 GiB).
    whole = plan(roomy)
    assert whole.kv_layout == "streams" and whole.kv_bytes == 4 * GiB and whole.slots == 4
    assert start_cells(whole, PHI4_MINI, roomy) == 4 * START_CELLS  # a stream of 2,048 each
    many = plan(roomy, n_ctx=65536, parallel=16, kv_layout="streams")
    assert many.slots == 16 and start_cells(many, PHI4_MINI, roomy) == 16 * START_CELLS
    fewer = plan(roomy, n_ctx=49152, parallel=16, kv_layout="streams")
    assert fewer.slots == 16  # the small one would be over half of it: made at once
    assert start_cells(fewer, PHI4_MINI, roomy) is None
    shared = plan(roomy, kv_layout="shared")
    assert start_cells(shared, PHI4_MINI, roomy) == START_CELLS


def test_the_whole_context_is_made_at_once_where_starting_small_does_not_pay_or_fit() -> None:
    roomy = Machine(ram_available=24 * GiB, ram_total=32 * GiB)
    # A cache that clears in a blink (SmolLM2-135M's, 22.5 KiB a token).
    smol = ModelShape(
        n_layer=30,
        n_head_kv=3,
        head_dim_k=64,
        head_dim_v=64,
        n_ctx_train=8192,
        file_bytes=100 * MiB,
        layer_bytes=3 * MiB,
    )
    small = plan_memory(smol, roomy, MemoryRequest(n_ctx=4096))
    assert small.kv_bytes < memory.GROW_MIN_BYTES
    assert start_cells(small, smol, roomy) is None
    near = plan(roomy, n_ctx=2 * START_CELLS - 256, kv_layout="shared")
    assert near.kv_bytes >= memory.GROW_MIN_BYTES
    assert start_cells(near, PHI4_MINI, roomy) is None  # (as large as the small one, nearly)
    # A plan that took all the free memory: no room for a second cache beside it.
    tight = Machine(ram_available=6 * GiB, ram_total=8 * GiB)
    assert start_cells(plan(tight), PHI4_MINI, tight) is None
    # Layers on a GPU: its memory would hold both caches' share.
    gpu = plan(roomy)
    assert start_cells(dataclasses.replace(gpu, gpu_layers=5), PHI4_MINI, roomy) is None


def test_starting_small_needs_room_for_both_caches_beside_the_weights() -> None:
    total = 32 * GiB
    headroom = memory.ram_headroom(Machine(ram_available=0, ram_total=total))
    whole = plan(Machine(ram_available=24 * GiB, ram_total=total))
    need = (
        PHI4_MINI.file_bytes
        + whole.kv_bytes
        + headroom
        + 2 * 4 * START_CELLS * whole.kv_bytes_per_token
        + memory.START_SPARE
    )
    just = Machine(ram_available=need, ram_total=total)
    short = Machine(ram_available=need - MiB, ram_total=total)
    assert start_cells(whole, PHI4_MINI, just) == 4 * START_CELLS
    assert start_cells(whole, PHI4_MINI, short) is None
    # Weights staged in RAM are out of what is available already.
    staged = Machine(ram_available=need - PHI4_MINI.file_bytes, ram_total=total, model_in_ram=True)
    assert start_cells(whole, PHI4_MINI, staged) == 4 * START_CELLS


def test_status_says_while_the_context_grows() -> None:
    memory: dict[str, Any] = {
        "n_ctx": 16384,
        "context_cells": 2048,
        "context_growing_s": 12.0,
        "reserved_tokens": 0,
        "running": 0,
        "free_tokens": 16368,
        "idle_cached_tokens": 0,
    }
    status = {"state": "ready", "n_ctx": 16384, "memory": memory}
    shown = format_status(status)
    assert "answering from 2,048 of its 16,384 cells while the whole context is made" in shown
    assert "(for 12.0 s;" in shown
    del memory["context_growing_s"]
    memory["context_cells"] = 16384
    assert "kv growing" not in format_status(status)


def test_warm_says_the_cache_is_made_in_the_background() -> None:
    timings = {"model": "m.gguf", "load_s": 1.0, "start_cells": 2048}
    assert "answers from 2,048 cells while the whole KV cache is made" in format_warm(timings)
    assert "background" not in format_warm({**timings, "start_cells": None})
