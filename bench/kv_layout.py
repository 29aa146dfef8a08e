"""What a shared KV cache costs in decode speed, against one stream per sequence, by depth.

    python bench/kv_layout.py --model PATH [--sequences 4 8] [--depths 100 1000 3000]
                              [--reps 6] [--threads N]

phi4's ``kv_layout = shared`` keeps every sequence in one KV cache of n_ctx cells (llama.cpp's
``kv_unified``): a long request can take the cells that short ones leave, and many short ones
pack in. llama.cpp then computes each token's attention over the whole used span of that cache,
the other sequences' cells masked out. ``kv_layout = streams``, like llama-server's default,
gives each slot a stream of its own, of n_ctx / slots cells. This bench measures the difference
directly in llama.cpp (in-process llama-cpp-python, flash attention as phi4 sets it): S sequences
each holding D tokens, then steps that decode one token for each, in the two layouts. In each,
sequence 0 is read and copied into the others through llama.cpp's sequence state, so each holds
cells of its own.

Writes bench/results/kv_layout-<model>.json and .md, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import llama_cpp  # noqa: E402
from llama_cpp import _internals as llama_internals  # noqa: E402

CHUNK = 512


def make_context(model: Any, n_ctx: int, sequences: int, unified: bool, threads: int) -> Any:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = params.n_ubatch = CHUNK
    params.n_seq_max = sequences
    params.kv_unified = unified
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO  # as phi4's plan leaves it
    return llama_internals.LlamaContext(model=model, params=params, verbose=False)


def decode(context: Any, batch: Any, entries: list[tuple[int, int, int, bool]]) -> None:
    raw = batch.batch
    for index, (seq, token, position, logits) in enumerate(entries):
        raw.token[index], raw.pos[index], raw.n_seq_id[index] = token, position, 1
        raw.seq_id[index][0], raw.logits[index] = seq, logits
    raw.n_tokens = len(entries)
    code = llama_cpp.llama_decode(context.ctx, raw)
    if code != 0:
        raise SystemExit(f"llama_decode returned {code}")


def step_ms(
    model: Any, tokens: list[int], sequences: int, unified: bool, threads: int, reps: int
) -> float:
    """Median ms of a step decoding one token for each of ``sequences``, each holding
    ``tokens``."""
    depth = len(tokens)
    per_stream = -(-(depth + 64) // 256) * 256  # llama.cpp pads n_ctx to 256
    context = make_context(model, per_stream * sequences, sequences, unified, threads)
    batch = llama_internals.LlamaBatch(n_tokens=CHUNK, embd=0, n_seq_max=1)
    for offset in range(0, depth, CHUNK):  # sequence 0, read once
        chunk = tokens[offset : offset + CHUNK]
        decode(context, batch, [(0, t, offset + i, False) for i, t in enumerate(chunk)])
    # The others get copies of its state: cells of their own (no sharing), as real requests.
    size = llama_cpp.llama_state_seq_get_size(context.ctx, 0)
    state = (ctypes.c_uint8 * size)()
    llama_cpp.llama_state_seq_get_data(context.ctx, state, size, 0)
    for seq in range(1, sequences):
        if not llama_cpp.llama_state_seq_set_data(context.ctx, state, size, seq):
            raise SystemExit("llama.cpp could not copy a sequence state")
    memory = llama_cpp.llama_get_memory(context.ctx)
    times = []
    for _ in range(reps + 1):  # the first allocates compute buffers: not counted
        started = time.perf_counter()
        decode(context, batch, [(seq, 100, depth, True) for seq in range(sequences)])
        times.append(time.perf_counter() - started)
        for seq in range(sequences):
            llama_cpp.llama_memory_seq_rm(memory, seq, depth, -1)
    context.close()
    return statistics.median(times[1:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sequences", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--depths", type=int, nargs="*", default=[100, 1000, 3000])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=0, help="default: physical cores")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    from phi4cli.core.machine import physical_cores

    threads = args.threads or physical_cores()
    llama_cpp.llama_backend_init()
    model = llama_internals.LlamaModel(
        path_model=str(args.model), params=llama_cpp.llama_model_default_params(), verbose=False
    )
    vocab = llama_cpp.llama_n_vocab(llama_cpp.llama_model_get_vocab(model.model))
    tokens = [(7 * i + 11) % (vocab - 100) + 50 for i in range(max(args.depths))]
    rows: list[dict[str, Any]] = []
    for depth in args.depths:
        for sequences in args.sequences:
            shared = step_ms(model, tokens[:depth], sequences, True, threads, args.reps)
            streams = step_ms(model, tokens[:depth], sequences, False, threads, args.reps)
            rows.append(
                {"depth": depth, "sequences": sequences, "shared_ms": shared, "streams_ms": streams}
            )
            print(
                f"depth {depth} x {sequences}: shared {shared:.1f} ms, streams {streams:.1f} ms",
                flush=True,
            )
    model.close()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} threads"
    lines = [
        f"KV layout on {args.model.name} ({machine}; one step decodes a token for each "
        f"sequence; median of {args.reps})",
        "",
        "| depth | sequences | one shared cache (kv_layout shared) | a stream each "
        "(streams, as llama-server) | shared / streams |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['depth']:,} | {row['sequences']} | {row['shared_ms']:.0f} ms | "
            f"{row['streams_ms']:.0f} ms | **{row['shared_ms'] / row['streams_ms']:.2f}x"
            "** |"
        )
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"kv_layout-{args.model.stem}"
    (args.out / f"{name}.json").write_text(
        json.dumps(
            {"model": str(args.model), "machine": machine, "reps": args.reps, "rows": rows},
            indent=2,
        )
        + "\n"
    )
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
