"""phi4's speed against baselines measured in the same run, on this machine.

    python bench/speed.py [--model smollm2-135m|PATH] [--tokens 64]

1. warm `phi4 solve` time to first token vs a fresh process per question (load + answer);
2. warm `phi4 solve` total time vs in-process llama-cpp-python doing the same generation;
3. decode tokens/s vs in-process llama-cpp-python (same threads), with the memory-bandwidth bound;
5. 1, 2, 4 and 8 concurrent solves: aggregate tokens/s vs one;
6. daemon restart to first token, with the staged model and restored prompt state vs without;
7. client RSS of `phi4 solve` and daemon RSS vs model file size.
(4, chat turn 10 vs turn 1, is bench/chat_turns.py.)

Writes bench/results/speed-<model>.json and .md, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTION = "What is 12*13? Explain in two sentences."
PHI4 = [sys.executable, "-m", "phi4cli"]

FRESH_PROCESS = r"""
import sys, time
import llama_cpp
model, question, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = llama_cpp.Llama(model, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                      verbose=False)
stream = llm.create_chat_completion([{"role": "user", "content": question}], max_tokens=1,
                                    temperature=0, stream=True)
for chunk in stream:
    if chunk["choices"][0]["delta"].get("content"):
        sys.stdout.write("x"); sys.stdout.flush()
        break
"""


def first_byte_s(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run a command; return (seconds to its first stdout byte, seconds to its exit)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.monotonic() - started
    proc.stdout.read()
    proc.wait()
    return first, time.monotonic() - started


def in_process(model: Path, threads: int, tokens: int) -> dict[str, float]:
    import llama_cpp

    llm = llama_cpp.Llama(
        str(model), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    runs = []
    for _ in range(3):
        started = time.monotonic()
        first = None
        count = 0
        stream: Any = llm.create_chat_completion(  # (typed as an answer or a stream of chunks)
            [{"role": "user", "content": QUESTION}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if chunk["choices"][0]["delta"].get("content"):
                count += 1
                first = first or time.monotonic()
        end = time.monotonic()
        assert first is not None
        runs.append({"total_s": end - started, "decode_tps": (count - 1) / (end - first)})
        llm.reset()  # each run evaluates its prompt, as a fresh question to phi4 does not
    llm.close()
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def concurrent(home: Path, k: int, tokens: int) -> float:
    """Aggregate completion tokens/s of k solves sent at once over one connection."""
    from phi4cli.backends.daemon_link import DaemonConnection

    with DaemonConnection.open(home / "run" / "daemon.sock") as connection:
        started = time.monotonic()
        ids = {
            connection.send(
                "solve",
                {"prompt": f"{QUESTION} (variant {i})", "temperature": 0, "max_tokens": tokens},
            )
            for i in range(k)
        }
        produced = 0
        while ids:
            event = connection.next_event()
            if event.kind == "stats":
                produced += event.stats.completion_tokens
            if event.terminal:
                ids.discard(event.id)
        return produced / (time.monotonic() - started)


def read_bandwidth_gbs(threads: int) -> float:
    """Memory read bandwidth, GB/s, on ``threads`` threads (numpy's sum reads without the GIL):
    a decode step reads the weights, it does not copy them. (The copy this replaced counted a
    copy's bytes once though it reads and writes each, on one thread: 12.3 GB/s where two
    threads read 16.3 in the same run, and a bound of 5.5 tok/s where 12 were measured.)"""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    source = np.ones((512 << 20) // 8, dtype=np.uint64)
    parts = np.array_split(source, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            started = time.monotonic()
            list(pool.map(np.sum, parts))
            best = max(best, source.nbytes / (time.monotonic() - started) / 1e9)
    return best


def weight_bytes_per_token(model: Path) -> int:
    """Bytes of weights a decode step reads: every tensor, but for the token embeddings only
    one row, unless the output layer is tied to them (then all of it, for the logits)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(model).tensors}
    embedding = sizes.get("token_embd.weight", 0)
    return sum(sizes.values()) - (embedding if "output.weight" in sizes else 0)


def max_rss_kib(command: list[str], env: dict[str, str]) -> int:
    out = subprocess.run(
        ["/usr/bin/time", "-f", "%M", *command],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        check=True,
    )
    return int(out.stderr.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    from phi4cli.core.machine import physical_cores
    from phi4cli.core.models import resolve_model
    from phi4cli.core.paths import get_paths

    model = resolve_model(args.model, get_paths())
    threads = physical_cores()
    home = Path(tempfile.mkdtemp(prefix="p4s-", dir="/tmp"))
    env = {**os.environ, "PHI4_HOME": str(home)}
    solve = [*PHI4, "solve", QUESTION, "-m", str(model), "-t", "0", "-n", str(args.tokens)]
    results: dict[str, Any] = {
        "model": str(model),
        "tokens": args.tokens,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} threads",
    }

    # 6 (cold, without): nothing staged, no saved state.
    subprocess.run([*PHI4, "cache", "clear"], env=env, capture_output=True, check=True)
    cold_env = {**env, "PHI4_RAMDISK_MODE": "off"}
    results["restart_first_token_s_plain"] = first_byte_s(solve, cold_env)[0]
    subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=True)
    subprocess.run(
        [*PHI4, "warm", "-m", str(model), "--ramdisk"], env=env, capture_output=True, check=True
    )  # stages the model and saves the prompt state
    subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=True)
    staged_env = {**env, "PHI4_RAMDISK_MODE": "on"}
    results["restart_first_token_s_staged_restored"] = first_byte_s(solve, staged_env)[0]

    # 1, 2: the daemon is warm now.
    first_byte_s(solve, env)
    warm = [first_byte_s(solve, env) for _ in range(5)]
    results["phi4_first_token_s"] = statistics.median(w[0] for w in warm)
    results["phi4_total_s"] = statistics.median(w[1] for w in warm)
    fresh = [
        first_byte_s(
            [sys.executable, "-c", FRESH_PROCESS, str(model), QUESTION, str(threads)], env
        )[0]
        for _ in range(3)
    ]
    results["fresh_process_first_token_s"] = statistics.median(fresh)
    rates = []
    for _ in range(3):  # the median of three, as for the in-process baseline
        stats = json.loads(
            subprocess.run(
                [*solve, "--json"], env=env, capture_output=True, text=True, check=True
            ).stdout
        )["stats"]
        rates.append((stats["completion_tokens"] - 1) / max(stats["decode_s"], 1e-9))
    results["phi4_decode_tps"] = statistics.median(rates)
    base = in_process(model, threads, args.tokens)
    results["in_process_total_s"] = base["total_s"]
    results["in_process_decode_tps"] = base["decode_tps"]

    # 5
    results["aggregate_tps"] = {k: concurrent(home, k, args.tokens) for k in (1, 2, 4, 8)}

    # 7
    status = json.loads(
        subprocess.run(
            [*PHI4, "status", "--json"], env=env, capture_output=True, text=True, check=True
        ).stdout
    )
    results["daemon_rss_bytes"] = status["rss_bytes"]
    results["client_rss_bytes"] = max_rss_kib(solve, env) * 1024
    results["model_bytes"] = model.stat().st_size
    results["read_bandwidth_gbs"] = read_bandwidth_gbs(os.cpu_count() or 1)
    results["weight_bytes_per_token"] = weight_bytes_per_token(model)
    results["bandwidth_bound_tps"] = (
        results["read_bandwidth_gbs"] * 1e9 / results["weight_bytes_per_token"]
    )
    subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)
    subprocess.run([*PHI4, "cache", "clear"], env=env, capture_output=True, check=False)

    r = results
    agg = r["aggregate_tps"]
    rows = [
        (
            "1. time to first token, warm phi4 solve (client start included)",
            f"{r['phi4_first_token_s'] * 1000:.0f} ms",
            f"fresh process {r['fresh_process_first_token_s'] * 1000:.0f} ms",
            f"**{r['fresh_process_first_token_s'] / r['phi4_first_token_s']:.1f}x** faster",
        ),
        (
            "2. total time, warm phi4 solve",
            f"{r['phi4_total_s'] * 1000:.0f} ms",
            f"in-process {r['in_process_total_s'] * 1000:.0f} ms",
            f"overhead **{(r['phi4_total_s'] / r['in_process_total_s'] - 1) * 100:+.0f}%**",
        ),
        (
            "3. decode rate",
            f"{r['phi4_decode_tps']:.1f} tok/s",
            f"in-process {r['in_process_decode_tps']:.1f} tok/s",
            f"**{r['phi4_decode_tps'] / r['in_process_decode_tps']:.2f}x** "
            f"(bandwidth bound {r['bandwidth_bound_tps']:.0f} tok/s)",
        ),
        *[
            (
                f"5. {k} concurrent solves, aggregate",
                f"{agg[k]:.1f} tok/s",
                "1 solve",
                f"**{agg[k] / agg[1]:.2f}x**",
            )
            for k in (2, 4, 8)
        ],
        (
            "6. daemon restart to first token",
            f"{r['restart_first_token_s_staged_restored'] * 1000:.0f} ms staged + restored",
            f"{r['restart_first_token_s_plain'] * 1000:.0f} ms plain",
            "",
        ),
        (
            "7. memory",
            f"client {r['client_rss_bytes'] / 2**20:.0f} MiB",
            f"daemon {r['daemon_rss_bytes'] / 2**20:.0f} MiB",
            f"model file {r['model_bytes'] / 2**20:.0f} MiB",
        ),
    ]
    lines = [
        f"Speed on {model.name} ({r['machine']}, {args.tokens}-token greedy answers)",
        "",
        "| measure | phi4 | baseline | ratio |",
        "| --- | --- | --- | --- |",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
    ]
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"speed-{model.stem}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
