"""Remote backends: `phi4 solve --backend URL --file F` sequential (before) and concurrent (after).

    python bench/remote.py [--problems 16] [--latency 4] [--rounds 1] [--concurrency N]

A scripted OpenAI-compatible server of its own (no model) answers each POST
/v1/chat/completions with an SSE stream that takes ``--latency`` seconds (reasoning_content
pieces, then ``So $\\boxed{2i}$.``, finish_reason stop, a usage chunk, ``data: [DONE]``), and
records the most requests it was serving at once. Problem i of the file is "What is i+i?"; each
run must exit 0 and print N lines, line i being 2i, or the bench fails. The variants, each timed
as the whole `phi4` command, interleaved in every round (median over ``--rounds``):

- one problem, one server (``phi4 solve --backend URL "What is 1+1?"``);
- N problems, one server, ``--backend-concurrency 1``: the old sequential behaviour (before);
- N problems, one server, the default concurrency (after);
- N problems at ``--concurrency`` (default N/4) each on one server, then on two (two
  ``--backend``): one server needs several rounds of requests, two about half as many;
- N problems and one, ``--latency 0``, default concurrency: (t_N - t_1)/(N - 1) is the client's
  own cost per request.

Writes bench/results/remote-scripted.json and .md, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PHI4 = str(Path(sys.executable).with_name("phi4"))
MODEL = "phi4-mini-reasoning"
THINKING = ["Adding ", "the two ", "numbers."]
QUESTION = re.compile(r"What is (\d+)\+(\d+)\?")


def data(payload: Any) -> bytes:
    return (
        "data: " + (payload if isinstance(payload, str) else json.dumps(payload)) + "\n\n"
    ).encode()


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return data(
        {
            "id": "b1",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


class Server:
    """A threading server answering every chat completion after ``latency`` seconds."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.served = 0
        state = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/") not in ("/health", "/v1/models"):
                    self.send_error(404)
                    return
                listing = {"status": "ok", "object": "list", "data": [{"id": MODEL}]}
                body = json.dumps(listing).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self.send_error(404)
                    return
                with state.lock:
                    state.active += 1
                    state.peak = max(state.peak, state.active)
                try:
                    state.answer(self, request)
                finally:
                    with state.lock:
                        state.active -= 1
                        state.served += 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.request_queue_size = 128
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def answer(self, handler: BaseHTTPRequestHandler, request: dict[str, Any]) -> None:
        question = str(request["messages"][-1]["content"])
        found = QUESTION.search(question)
        answer = str(int(found[1]) + int(found[2])) if found else "0"
        handler.close_connection = True
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Connection", "close")
        handler.end_headers()
        pieces = [chunk({"role": "assistant", "content": ""})]
        pieces += [chunk({"reasoning_content": piece}) for piece in THINKING]
        pieces += [chunk({"content": f"So $\\boxed{{{answer}}}$."}), chunk({}, "stop")]
        pause = self.latency / (len(THINKING) + 1)  # the latency spread over the pieces
        usage = {
            "prompt_tokens": 20,
            "completion_tokens": len(THINKING) + 1,
            "total_tokens": 21 + len(THINKING),
            "completion_tokens_details": {"reasoning_tokens": len(THINKING)},
        }
        tail = [
            data({"id": "b1", "object": "chat.completion.chunk", "choices": [], "usage": usage}),
            data("[DONE]"),
        ]
        try:
            for index, piece in enumerate(pieces):
                if 0 < index <= len(THINKING) + 1 and pause:
                    time.sleep(pause)
                handler.wfile.write(piece)
                handler.wfile.flush()
            handler.wfile.write(b"".join(tail))
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return

    def reset(self) -> None:
        with self.lock:
            self.peak = 0
            self.served = 0


@contextmanager
def servers(count: int, latency: float) -> Iterator[list[Server]]:
    started = [Server(latency) for _ in range(count)]
    for server in started:
        server.thread.start()
    try:
        yield started
    finally:
        for server in started:
            server.httpd.shutdown()
            server.httpd.server_close()


def run_variant(
    backends: list[Server], problems: int, concurrency: int | None, file: Path, env: dict[str, str]
) -> dict[str, Any]:
    """Time one `phi4 solve` and check its answers; the servers' peaks and counts with it."""
    for server in backends:
        server.reset()
    command = [PHI4, "solve"]
    for server in backends:
        command += ["--backend", server.url]
    if concurrency is not None:
        command += ["--backend-concurrency", str(concurrency)]
    command += ["-m", MODEL, "--answer-only"]
    command += ["--file", str(file)] if problems > 1 else ["What is 1+1?"]
    started = time.monotonic()
    result = subprocess.run(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    wall = time.monotonic() - started
    expected = [str(2 * i) for i in range(1, problems + 1)]
    if result.returncode != 0 or result.stdout.splitlines() != expected:
        raise SystemExit(
            f"phi4 failed: {' '.join(command)}\nexit status {result.returncode}\n"
            f"expected stdout {expected}\nstdout: {result.stdout!r}\nstderr: {result.stderr}"
        )
    served = [server.served for server in backends]
    if sum(served) != problems:
        raise SystemExit(f"{' '.join(command)}: the servers answered {served}, not {problems}")
    return {"wall_s": wall, "peaks": [server.peak for server in backends], "served": served}


def peak_rss(
    server: Server, problems: int, home: Path, env: dict[str, str], kind: str = "file"
) -> dict[str, Any]:
    """The most memory one `phi4 solve --file` (or, with ``kind`` "eval", one `phi4 eval`) of
    ``problems`` lines held (its maximum resident set, from a fresh parent's RUSAGE_CHILDREN,
    so no earlier run counts), answers checked."""
    out = home / f"rss-{kind}-{problems}.out"
    if kind == "eval":
        file = home / f"rss-{problems}.jsonl"
        file.write_text(
            "".join(
                json.dumps({"problem": f"What is {i}+{i}?", "answer": 2 * i}) + "\n"
                for i in range(1, problems + 1)
            )
        )
        command = [
            PHI4,
            "eval",
            str(file),
            "--backend",
            server.url,
            "-m",
            MODEL,
            "--json",
            "--restart",
            "-o",
            str(home / f"rss-{problems}.results.jsonl"),
        ]
    else:
        file = home / f"rss-{problems}.txt"
        file.write_text("".join(f"What is {i}+{i}?\n" for i in range(1, problems + 1)))
        command = [
            PHI4,
            "solve",
            "--backend",
            server.url,
            "-m",
            MODEL,
            "--answer-only",
            "--file",
            str(file),
        ]
    probe = (
        "import resource, subprocess, sys\n"
        "with open(sys.argv[1], 'w') as out:\n"
        "    code = subprocess.run(sys.argv[2:], stdout=out, stdin=subprocess.DEVNULL)"
        ".returncode\n"
        "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", probe, str(out), *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    wall = time.monotonic() - started
    code, rss_kib = (int(word) for word in result.stdout.split())
    if kind == "eval":
        right = code == 0 and json.loads(out.read_text())["correct"] == problems
    else:
        right = code == 0 and out.read_text().splitlines() == [
            str(2 * i) for i in range(1, problems + 1)
        ]
    if not right:
        raise SystemExit(f"phi4 {kind} failed on {problems} problems: exit {code}\n{result.stderr}")
    return {
        "kind": kind,
        "problems": problems,
        "max_rss_mib": round(rss_kib / 1024, 1),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=16, help="N, problems in the file")
    parser.add_argument("--latency", type=float, default=4.0, help="seconds per answer")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--concurrency", type=int, help="--backend-concurrency for the replica rows (default N/4)"
    )
    parser.add_argument(
        "--rss",
        type=int,
        nargs="*",
        default=[1000, 10000],
        help="also measure phi4's peak memory on files this long (none: skip)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    n = args.problems
    if n < 2:
        parser.error("--problems must be at least 2")
    per_replica = args.concurrency or max(1, n // 4)
    home = Path(tempfile.mkdtemp(prefix="p4r-", dir="/tmp"))
    env = {name: value for name, value in os.environ.items() if not name.startswith("PHI4_")}
    env["PHI4_HOME"] = str(home)
    file = home / "problems.txt"
    file.write_text("".join(f"What is {i}+{i}?\n" for i in range(1, n + 1)))
    # name: (servers, problems, --backend-concurrency, latency)
    variants: dict[str, tuple[int, int, int | None, float]] = {
        "1 problem, 1 server": (1, 1, None, args.latency),
        f"{n} problems, 1 server, concurrency 1 (before)": (1, n, 1, args.latency),
        f"{n} problems, 1 server, default concurrency (after)": (1, n, None, args.latency),
        f"{n} problems, 1 server, concurrency {per_replica}": (1, n, per_replica, args.latency),
        f"{n} problems, 2 servers, concurrency {per_replica} each": (
            2,
            n,
            per_replica,
            args.latency,
        ),
        "1 problem, 1 server, latency 0": (1, 1, None, 0.0),
        f"{n} problems, 1 server, default concurrency, latency 0": (1, n, None, 0.0),
    }
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    try:
        with servers(2, args.latency) as (first, second), servers(1, 0.0) as (instant,):
            for round_ in range(args.rounds):
                names = list(variants)
                if round_ % 2:  # every other round in the other order, so drift hits all alike
                    names.reverse()
                for name in names:
                    count, problems, concurrency, latency = variants[name]
                    backends = [instant] if latency == 0 else [first, second][:count]
                    sample = run_variant(backends, problems, concurrency, file, env)
                    samples[name].append(sample)
                    print(
                        f"round {round_ + 1}: {name}: {sample['wall_s']:.2f} s, "
                        f"peak {sample['peaks']}",
                        file=sys.stderr,
                    )
            memory = [
                peak_rss(instant, size, home, env, kind)
                for kind in ("file", "eval")
                for size in args.rss
            ]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    wall = {name: statistics.median(s["wall_s"] for s in rows) for name, rows in samples.items()}
    one = wall["1 problem, 1 server"]
    zero_one = wall["1 problem, 1 server, latency 0"]
    zero_n = wall[f"{n} problems, 1 server, default concurrency, latency 0"]
    overhead_ms = (zero_n - zero_one) / (n - 1) * 1000
    # Each row against one problem at its own latency.
    ratio = {name: wall[name] / (one if variants[name][3] else zero_one) for name in wall}
    rows = []
    for name, runs in samples.items():
        peaks = " + ".join(
            str(max(s["peaks"][i] for s in runs)) for i in range(len(runs[0]["peaks"]))
        )
        rows.append(f"| {name} | {wall[name]:.2f} | {ratio[name]:.2f}x | {peaks} |")
    lines = [
        f"# `phi4 solve --backend` against a scripted server ({n} problems, "
        f"{args.latency:g} s per answer)",
        "",
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"median of {args.rounds} interleaved round(s); each ratio is to one problem on one "
        f"server at the same latency",
        "",
        "| variant | wall seconds | ratio to one problem | peak concurrent at the server(s) |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
        f"Client cost per request (latency 0, default concurrency): ({zero_n:.3f} s - "
        f"{zero_one:.3f} s) / {n - 1} = {overhead_ms:.1f} ms",
    ]
    if memory:
        lines += [
            "",
            "Memory of one run (latency 0, default concurrency):",
            "",
            "| command | problems | peak RSS (MiB) | wall seconds |",
            "| --- | --- | --- | --- |",
            *(
                f"| {'phi4 eval' if m['kind'] == 'eval' else 'phi4 solve --file'} "
                f"| {m['problems']:,} | {m['max_rss_mib']:.1f} | {m['wall_s']:.1f} |"
                for m in memory
            ),
        ]
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "remote-scripted.md").write_text(table)
    results = {
        "problems": n,
        "latency_s": args.latency,
        "rounds": args.rounds,
        "replica_concurrency": per_replica,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "median_wall_s": wall,
        "ratio_to_one_problem": ratio,
        "client_overhead_ms_per_request": overhead_ms,
        "samples": samples,
        "memory": memory,
    }
    (args.out / "remote-scripted.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table)


if __name__ == "__main__":
    main()
