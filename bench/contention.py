"""Decoding on a busy machine: phi4's daemon and llama-server, quiet and beside busy processes.

    python bench/contention.py --model PATH [--server PATH/TO/llama-server] [--busy 2]
                               [--tokens 48] [--rounds 2]

Users' machines are not quiet: a browser, an editor, a build run beside the daemon. Each
variant decodes ``--tokens`` greedy tokens of one question, ``--rounds`` times after a warm-up,
first on a quiet machine and then with ``--busy`` processes spinning on the CPUs (each a Python
``while True``), and reports the median decode rate (tokens after the first, over the decode
time: what the stats of phi4 and the timings of llama-server both report). The variants:

- phi4 as it starts by default (the wait policy it chooses, ``daemon/threads.py``);
- phi4 with ``GOMP_SPINCOUNT=300000``: OpenMP's own default, threads spinning at every barrier
  before they sleep (phi4 before it chose);
- phi4 with ``GOMP_SPINCOUNT=10000``: a short spin, then sleep;
- phi4 with 1 thread;
- llama-server (same threads) by default, and with ``--poll 0``.

All in one run, a daemon or server at a time, so the machine's state hits each alike. Writes
bench/results/contention-<model>.json and .md, and prints the Markdown table.
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
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.batching import free_port, wait_healthy  # noqa: E402
from bench.speed import PHI4, QUESTION  # noqa: E402

SPIN = "while True: pass"


@contextmanager
def busy(count: int) -> Iterator[None]:
    """``count`` processes spinning on the CPUs while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        time.sleep(1.0)  # let them take their share of the CPUs
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def phi4_rates(model: Path, threads: int, env: dict[str, str], tokens: int,
               rounds: int) -> list[float]:  # fmt: skip
    """Decode rates of ``rounds`` greedy solves through a daemon started with ``env``."""
    home = Path(tempfile.mkdtemp(prefix="p4c-", dir="/tmp"))
    env = {**env, "PHI4_HOME": str(home)}
    subprocess.run([*PHI4, "daemon", "start", "-m", str(model), "--threads", str(threads),
                    "--n-ctx", "4096"], env=env, check=True, capture_output=True)  # fmt: skip
    solve = [*PHI4, "solve", QUESTION, "-m", str(model), "-t", "0", "--json", "--no-instruction"]
    try:
        subprocess.run([*solve, "-n", "4"], env=env, check=True, capture_output=True)  # warm-up
        rates = []
        for _ in range(rounds):
            done = subprocess.run([*solve, "-n", str(tokens)], env=env, check=True,
                                  capture_output=True, text=True)  # fmt: skip
            stats = json.loads(done.stdout)["stats"]
            rates.append((stats["completion_tokens"] - 1) / max(stats["decode_s"], 1e-9))
        return rates
    finally:
        subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)


def server_rates(server: Path, model: Path, threads: int, extra: list[str], tokens: int,
                 rounds: int) -> list[float]:  # fmt: skip
    """Decode rates of ``rounds`` greedy chat completions to a llama-server started with
    ``extra`` (its own timings: predicted_per_second)."""
    port = free_port()
    proc = subprocess.Popen(
        [str(server), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", "1",
         "-c", "4096", "--host", "127.0.0.1", "--port", str(port), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_healthy(port)

        def ask(n: int) -> float:
            body = json.dumps({"messages": [{"role": "user", "content": QUESTION}],
                               "max_tokens": n, "temperature": 0,
                               "cache_prompt": False}).encode()  # fmt: skip
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                headers={"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=900) as reply:
                return float(json.loads(reply.read())["timings"]["predicted_per_second"])

        ask(4)
        return [ask(tokens) for _ in range(rounds)]
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--server", type=Path)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside it")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    from phi4cli.daemon.memory import physical_cores

    threads = physical_cores()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    variants: dict[str, Any] = {
        "phi4 (its default)": lambda: phi4_rates(args.model, threads, base, args.tokens,
                                                 args.rounds),
        "phi4, OpenMP's default spinning": lambda: phi4_rates(
            args.model, threads, {**base, "GOMP_SPINCOUNT": "300000"}, args.tokens, args.rounds),
        "phi4, spinning 10,000 turns": lambda: phi4_rates(
            args.model, threads, {**base, "GOMP_SPINCOUNT": "10000"}, args.tokens, args.rounds),
        "phi4, 1 thread": lambda: phi4_rates(args.model, 1, base, args.tokens, args.rounds),
    }  # fmt: skip
    if args.server is not None:
        server = args.server
        variants["llama-server"] = lambda: server_rates(
            server, args.model, threads, [], args.tokens, args.rounds
        )
        variants["llama-server --poll 0"] = lambda: server_rates(
            server, args.model, threads, ["--poll", "0"], args.tokens, args.rounds
        )
    results: dict[str, Any] = {
        "model": str(args.model), "tokens": args.tokens, "rounds": args.rounds,
        "busy": args.busy, "threads": threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "quiet": {}, "busy_rates": {},
    }  # fmt: skip
    for name, run in variants.items():
        results["quiet"][name] = run()
        print(f"{name}, quiet: {results['quiet'][name]}", flush=True)
    with busy(args.busy):
        for name, run in variants.items():
            results["busy_rates"][name] = run()
            print(f"{name}, {args.busy} busy: {results['busy_rates'][name]}", flush=True)
    rows = []
    for name in variants:
        quiet = statistics.median(results["quiet"][name])
        loaded = statistics.median(results["busy_rates"][name])
        rows.append(f"| {name} | {quiet:.2f} tok/s | {loaded:.2f} tok/s | {loaded / quiet:.2f}x |")
    lines = [f"Decoding beside {args.busy} busy processes on {args.model.name} "
             f"({results['machine']}, {threads} threads unless said, {args.tokens}-token greedy "
             f"answers, median of {args.rounds})", "",
             f"| variant | quiet | {args.busy} busy processes | busy / quiet |",
             "| --- | --- | --- | --- |", *rows]  # fmt: skip
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"contention-{args.model.stem}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
