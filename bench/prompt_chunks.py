"""What a decode token costs beside a prompt's chunk, in llama.cpp itself (in process).

    python bench/prompt_chunks.py --model PATH [--chunks 62 64 128] [--riders 0 1 3]
                                  [--depth 1000] [--prompt 576]

One sequence per rider holds --depth tokens; another sequence's --prompt tokens are then read in
chunks of C tokens, each step also decoding one token for each of R riders (the answers already
streaming), in one shared cache and with a stream per sequence. The time per step against R = 0
is what the riders cost; phi4's engine reads prompts that came together without riders for this
reason (docs/benchmarks.md, "Long prompts read together"). Flash attention as llama.cpp's
default (auto).

Writes bench/results/prompt-chunks-<model>.json and .md, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(
    model: Any, chunk: int, riders: int, depth: int, prompt: int, streams: bool, threads: int
) -> float:
    """Seconds per step of reading `prompt` tokens in `chunk`s beside `riders` decode tokens."""
    import llama_cpp
    from llama_cpp import _internals as internals

    params = llama_cpp.llama_context_default_params()
    params.n_ctx = (riders + 1) * (depth + prompt + 64) + 256
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = threads
    params.n_seq_max = riders + 1
    params.kv_unified = not streams
    context = internals.LlamaContext(model=model, params=params, verbose=False)
    batch = internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.reset()
        raw = batch.batch
        for i, (seq, token, pos, logits) in enumerate(entries):
            raw.token[i], raw.pos[i], raw.n_seq_id[i] = token, pos, 1
            raw.seq_id[i][0], raw.logits[i] = seq, logits
        raw.n_tokens = len(entries)
        if llama_cpp.llama_decode(context.ctx, raw) != 0:
            raise RuntimeError("llama_decode failed")

    tokens = [(i * 7919) % 400 + 10 for i in range(max(depth, prompt))]
    # The riders' own prompts, read in full batches first (sequences 1..R).
    for seq in range(1, riders + 1):
        for start in range(0, depth, 512):
            piece = tokens[start : min(start + 512, depth)]
            decode([(seq, t, start + i, start + i == depth - 1) for i, t in enumerate(piece)])
    started, steps = time.monotonic(), 0
    for start in range(0, prompt, chunk):
        entries = [(seq, 11 + steps % 300, depth + steps, True) for seq in range(1, riders + 1)]
        entries += [(0, t, start + i, False) for i, t in enumerate(tokens[start : start + chunk])]
        decode(entries)
        steps += 1
    seconds = (time.monotonic() - started) / steps
    batch.close()
    context.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--chunks", type=int, nargs="*", default=[62, 64, 128])
    parser.add_argument("--riders", type=int, nargs="*", default=[0, 1, 3])
    parser.add_argument("--depth", type=int, default=1000)
    parser.add_argument("--prompt", type=int, default=576)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    import llama_cpp
    from llama_cpp import _internals as internals

    from phi4cli.core.machine import physical_cores

    threads = physical_cores()
    model_params = llama_cpp.llama_model_default_params()
    model = internals.LlamaModel(path_model=str(args.model), params=model_params, verbose=False)
    rows: list[dict[str, Any]] = []
    for streams in (False, True):
        for chunk in args.chunks:
            for riders in args.riders:
                if chunk + riders > 512:
                    continue
                seconds = measure(model, chunk, riders, args.depth, args.prompt, streams, threads)
                rows.append(
                    {
                        "layout": "streams" if streams else "shared",
                        "chunk": chunk,
                        "riders": riders,
                        "step_s": round(seconds, 3),
                        "prompt_tps": round(chunk / seconds, 1),
                    }
                )
    model.close()
    alone = {(r["layout"], r["chunk"]): r["step_s"] for r in rows if r["riders"] == 0}
    lines = [
        f"A prompt's chunk beside decode tokens {args.depth} deep on {args.model.name} "
        f"({platform.machine()}, {os.cpu_count()} CPUs, {threads} threads)",
        "",
        "| layout | chunk | decode tokens beside it | seconds a step | prompt tok/s | "
        "step / alone |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        base = alone.get((r["layout"], r["chunk"]))
        ratio = f"**{r['step_s'] / base:.2f}x**" if base else "-"
        lines.append(
            f"| {r['layout']} | {r['chunk']} | {r['riders']} | {r['step_s']:.3f} | "
            f"{r['prompt_tps']:.1f} | {ratio} |"
        )
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"prompt-chunks-{args.model.stem}"
    results = {"model": str(args.model), "depth": args.depth, "prompt": args.prompt, "rows": rows}
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
