"""One stream's decode step, taken apart: what phi4's engine adds to llama.cpp's decode, and what
cells other sequences hold in a shared KV cache cost it. In-process, one model, interleaved.

    python bench/one_stream.py --model PATH [--tokens 64] [--rounds 3] [--stale 4x500]

- **The engine's own work.** ``LlamaEngine`` (the daemon's engine, no socket) answers one greedy
  question of ``--tokens`` tokens; each step is timed whole and its ``llama_decode`` alone. The
  difference is what phi4 does per token in Python (sampling, the text splitter, the thinking
  policy, the speculation gate), reported as its median in milliseconds and as a share of the step.
- **Cells of other sequences.** A bare llama.cpp context laid out as the daemon's shared one
  (unified KV, a sequence per slot) decodes one sequence's tokens, first alone, then with
  ``--stale`` (sequences x tokens) of other sequences' cells in the cache, as idle slots keep
  them: the median decode milliseconds of each, and their ratio.

Threads: all physical cores, as the daemon decodes on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phi4cli.core._settings import Ask  # noqa: E402
from phi4cli.core.config import Settings  # noqa: E402
from phi4cli.core.machine import physical_cores  # noqa: E402
from phi4cli.core.protocol import parse_solve_params  # noqa: E402
from phi4cli.daemon.jobs import Job  # noqa: E402
from phi4cli.daemon.llama.batch import LlamaEngine  # noqa: E402

QUESTION = "What is 17*23? Think step by step."


def engine_overhead(model: Path, tokens: int, rounds: int, threads: int) -> dict[str, float]:
    """Median step and median (step - decode), in ms, over the steps that drew one token."""
    engine = LlamaEngine(Settings(n_ctx=8192, ramdisk="off", threads=threads))
    engine.load(model)
    engine.warm()
    loaded = engine._loaded()[0]  # (a bench may look inside)
    decode = loaded.decode
    timed: list[tuple[int, float]] = []

    def timed_decode(entries: Any) -> int:
        started = time.perf_counter()
        code = decode(entries)
        timed.append((len(entries), time.perf_counter() - started))
        return code

    loaded.decode = timed_decode  # type: ignore[method-assign]
    steps, overheads = [], []
    for round_ in range(rounds):
        params = parse_solve_params(
            {"prompt": f"(round {round_}) {QUESTION}", "temperature": 0, "max_tokens": tokens},
            Ask.of(Settings()),
        )
        job = Job(request_id=round_, params=params, emit=lambda event: None)
        assert engine.admit(job) is None
        timed.clear()
        step_s: list[float] = []
        while True:
            started = time.perf_counter()
            done = engine.step()
            step_s.append(time.perf_counter() - started)
            if done:
                break
        for whole, (count, decoding) in zip(step_s, timed, strict=False):
            if count == 1:
                steps.append(whole * 1000)
                overheads.append((whole - decoding) * 1000)
    engine.close()
    return {"step_ms": statistics.median(steps), "overhead_ms": statistics.median(overheads)}


def stale_cells(
    model: Path, tokens: int, rounds: int, threads: int, sequences: int, length: int
) -> dict[str, float]:
    """Median decode ms of one sequence alone and beside ``sequences`` x ``length`` stale cells."""
    import llama_cpp
    from llama_cpp import _internals as internals

    llama_cpp.llama_backend_init()
    weights = internals.LlamaModel(
        path_model=str(model), params=llama_cpp.llama_model_default_params(), verbose=False
    )
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 8192, 512, 512
    params.n_seq_max, params.kv_unified = sequences + 1, True
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO  # as the daemon's f16 plan
    context = internals.LlamaContext(model=weights, params=params, verbose=False)
    batch = internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=1)
    memory = llama_cpp.llama_get_memory(context.ctx)
    prompt = 150

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        raw = batch.batch
        for i, (seq, token, position, logits) in enumerate(entries):
            raw.token[i], raw.pos[i], raw.n_seq_id[i] = token, position, 1
            raw.seq_id[i][0], raw.logits[i] = seq, logits
        raw.n_tokens = len(entries)
        if llama_cpp.llama_decode(context.ctx, raw) != 0:
            raise RuntimeError("llama_decode failed")

    def feed(seq: int, count: int, first: int) -> None:
        for offset in range(0, count, 512):
            size = min(512, count - offset)
            decode(
                [(seq, first + (offset + i) % 5000, offset + i, i == size - 1) for i in range(size)]
            )

    def one_stream() -> float:
        llama_cpp.llama_memory_seq_rm(memory, 0, -1, -1)
        feed(0, prompt, 1000)
        times = []
        for i in range(tokens):
            started = time.perf_counter()
            decode([(0, 2000 + i, prompt + i, True)])
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000

    alone, beside = [], []
    for _ in range(rounds):
        for seq in range(1, sequences + 1):
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
        alone.append(one_stream())
        for seq in range(1, sequences + 1):
            feed(seq, length, 3000 + seq)
        beside.append(one_stream())
    return {"alone_ms": statistics.median(alone), "beside_ms": statistics.median(beside)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stale", default="4x500", help="other sequences x their tokens")
    args = parser.parse_args()
    threads = physical_cores()
    sequences, length = (int(part) for part in args.stale.split("x"))
    engine = engine_overhead(args.model, args.tokens, args.rounds, threads)
    share = engine["overhead_ms"] / engine["step_ms"]
    print(
        f"engine step {engine['step_ms']:.1f} ms, of which phi4's own work "
        f"{engine['overhead_ms']:.2f} ms ({share:.1%}), median of {args.rounds} answers"
    )
    stale = stale_cells(args.model, args.tokens, args.rounds, threads, sequences, length)
    print(
        f"decode alone {stale['alone_ms']:.1f} ms, beside {sequences * length:,} cells of "
        f"{sequences} other sequences {stale['beside_ms']:.1f} ms "
        f"({stale['beside_ms'] / stale['alone_ms']:.3f}x), median of {args.rounds} rounds"
    )


if __name__ == "__main__":
    main()
