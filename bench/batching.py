"""Batching: phi4's daemon against llama.cpp's own llama-server, side by side in one run.

    python bench/batching.py --model PATH --server PATH/TO/llama-server [--tokens 64]
                             [--concurrent 1 4 8] [--rounds 2] [--phi4-arg ARG] [--server-arg ARG]

Both serve the same GGUF with the same threads and stream every token to their clients; each
round sends k greedy questions at once (k = 1, 4, 8) and measures the aggregate completion
tokens/s, phi4 and llama-server interleaved so that the machine's drift hits both alike (each
goes first in every other round). llama-server runs with as many slots as the largest k, each
with room for its answer, and phi4 with ``--parallel`` that many (its default plans for 4 long
requests); ``--phi4-arg`` and ``--server-arg`` pass more to either (``--server-arg=-kvu``:
llama-server with one KV cache shared by its slots, as phi4's ``kv_layout = shared``). Build
llama-server from the llama.cpp sources vendored in the llama-cpp-python sdist (cmake target
llama-server); without --server this bench has no baseline and says so.

Writes bench/results/batching-<model>.json and .md, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.speed import QUESTION  # noqa: E402
from bench.speed import concurrent as phi4_round  # noqa: E402  (k solves at once: tokens/s)

PHI4 = [sys.executable, "-m", "phi4cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_round(port: int, k: int, tokens: int) -> float:
    """Aggregate completion tokens/s of k chat completions sent at once to llama-server."""
    produced = [0] * k

    def ask(index: int) -> None:
        # Streamed, as phi4 streams every token to its client: both pay for sending them.
        body = json.dumps({
            "messages": [{"role": "user", "content": f"{QUESTION} (variant {index})"}],
            "max_tokens": tokens, "temperature": 0, "cache_prompt": True, "stream": True,
            "stream_options": {"include_usage": True},
        }).encode()  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        produced[index] = usage["completion_tokens"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(k)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(produced) / (time.monotonic() - started)


def wait_healthy(port: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("llama-server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--server", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, nargs="*", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--phi4-arg", action="append", default=[],
                        help="pass this to `phi4 daemon start` too (e.g. --phi4-arg=--kv-layout="
                             "--phi4-arg=shared)")  # fmt: skip
    parser.add_argument("--server-arg", action="append", default=[],
                        help="pass this to llama-server too (e.g. --server-arg=-kvu for one KV "
                             "cache shared by all slots, as phi4 has)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    from phi4cli.daemon.memory import physical_cores

    threads = physical_cores()
    home = Path(tempfile.mkdtemp(prefix="p4b-", dir="/tmp"))
    env = {**os.environ, "PHI4_HOME": str(home)}
    slots = max(args.concurrent)
    # As many requests at once as llama-server has slots (phi4's default plans for 4 long ones).
    subprocess.run([*PHI4, "daemon", "start", "-m", str(args.model), "--threads", str(threads),
                    "--parallel", str(slots), *args.phi4_arg],
                   env=env, check=True, capture_output=True)  # fmt: skip
    status = subprocess.run([*PHI4, "status", "--json"], env=env, capture_output=True, text=True,
                            check=True)  # fmt: skip
    plan = json.loads(status.stdout)["memory"]["plan"]
    server: subprocess.Popen[bytes] | None = None
    port = free_port()
    if args.server is not None:
        server = subprocess.Popen(
            [str(args.server), "-m", str(args.model), "-t", str(threads), "-tb", str(threads),
             "-np", str(slots), "-c", str(slots * 1024), "--host", "127.0.0.1",
             "--port", str(port), *args.server_arg],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_healthy(port)
    results: dict[str, Any] = {
        "model": str(args.model), "tokens": args.tokens, "server": str(args.server),
        "server_args": args.server_arg, "phi4_args": args.phi4_arg, "phi4_plan": plan,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} threads",
        "phi4": {}, "llama_server": {}, "rounds": {},
    }  # fmt: skip
    try:
        phi4_round(home, 1, 8)  # warm both: first requests allocate buffers
        if server is not None:
            server_round(port, 1, 8)
        for k in args.concurrent:
            phi4_rates, server_rates = [], []
            for round_ in range(args.rounds):
                # Each goes first in every other round, so that neither gains from the order.
                if server is not None and round_ % 2:
                    server_rates.append(server_round(port, k, args.tokens))
                phi4_rates.append(phi4_round(home, k, args.tokens))
                if server is not None and not round_ % 2:
                    server_rates.append(server_round(port, k, args.tokens))
            results["rounds"][k] = {"phi4": phi4_rates, "llama_server": server_rates}
            results["phi4"][k] = statistics.median(phi4_rates)
            if server_rates:
                results["llama_server"][k] = statistics.median(server_rates)
    finally:
        subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)
        if server is not None:
            server.terminate()
            server.wait(30)
    rows = []
    for k in args.concurrent:
        ours, theirs = results["phi4"][k], results["llama_server"].get(k)
        rows.append(
            f"| {k} | {ours:.2f} tok/s | "
            + (f"{theirs:.2f} tok/s | **{ours / theirs:.2f}x** |" if theirs else "- | - |")
        )
    extra = f"; phi4 kv_layout {plan['kv_layout']}, {plan['slots']} slots"
    extra += f"; llama-server {' '.join(args.server_arg)}" if args.server_arg else ""
    lines = [f"Batching on {args.model.name} ({results['machine']}, {args.tokens}-token greedy "
             f"answers, median of {args.rounds} interleaved rounds{extra})", "",
             "| concurrent | phi4 aggregate | llama-server aggregate | phi4 / llama-server |",
             "| --- | --- | --- | --- |", *rows]  # fmt: skip
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"batching-{args.model.stem}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
