"""Batching: phi4's daemon against llama.cpp's own llama-server, side by side in one run.

    python bench/batching.py --model PATH --server PATH/TO/llama-server [--tokens 64]
                             [--concurrent 1 4 8] [--rounds 2] [--prompt-tokens N]
                             [--spread MS] [--phi4-arg ARG] [--server-arg ARG]

Both serve the same GGUF with the same threads and stream every token to their clients; each round
sends k greedy questions at once (k = 1, 4, 8) and measures the aggregate completion tokens/s (all
tokens over the wall time from the first send to the last answer's end) and each request's time to
its first token, phi4 and llama-server interleaved so that the machine's drift hits both alike (each
goes first in every other round). ``--prompt-tokens N`` gives every question a different N-token
problem text to read first (counted with the model's own tokenizer): long prompts read together, as
pasted problems and follow-ups bring. ``--spread MS`` sends a round's requests evenly over MS
milliseconds instead of at once (each on a connection of its own): a burst that arrives a little
apart, so that the first is streaming while the others' prompts are read. llama-server runs with as
many slots as the largest k, each with room for its prompt and answer, and phi4 with ``--parallel``
that many (its default plans for 4 long requests); ``--phi4-arg`` and ``--server-arg`` pass more to
either (``--server-arg=-kvu``: llama-server with one KV cache shared by its slots, as phi4's
``kv_layout = shared``). Build llama-server from the llama.cpp sources vendored in the
llama-cpp-python sdist (cmake target llama-server); without --server this bench has no baseline
and says so.

Writes bench/results/batching-<model>[-p<N>][-s<MS>].json and .md, and prints the Markdown table.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import start_daemon  # noqa: E402
from bench.speed import PHI4, QUESTION  # noqa: E402

# Problem text for long prompts: numbered sentences, so that no two questions share a prefix.
SENTENCE = (
    "Step {n} of problem {i}: the sequence a_{n} = {a} * a_{m} + {b} is taken modulo "
    "{c}, and the partial sums are compared with the bound {d}. "
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def questions(model: Path, k: int, prompt_tokens: int) -> list[str]:
    """k different questions; with prompt_tokens, each opens with that many tokens of problem
    text (by the model's tokenizer), different from the first sentence on."""
    if prompt_tokens <= 0:
        return [f"{QUESTION} (variant {i})" for i in range(k)]
    import llama_cpp

    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    texts = []
    for i in range(k):
        text, n = "", 0
        while len(vocab.tokenize(text.encode(), add_bos=False)) < prompt_tokens:
            n += 1
            text += SENTENCE.format(
                n=n,
                i=i,
                m=n - 1,
                a=3 + (i * 7 + n) % 11,
                b=(i + 5 * n) % 13,
                c=97 + i,
                d=1000 * n + i,
            )
        tokens = vocab.tokenize(text.encode(), add_bos=False)[:prompt_tokens]
        head = vocab.detokenize(tokens).decode("utf-8", errors="ignore")
        texts.append(f"{head}\n{QUESTION} (variant {i})")
    vocab.close()
    return texts


def summary(started: float, produced: list[int], first: list[float | None]) -> dict[str, Any]:
    """A round's aggregate tokens/s and each request's seconds to its first token."""
    wall = time.monotonic() - started
    ttft = sorted(round(t - started, 3) for t in first if t is not None)
    return {
        "tps": sum(produced) / wall,
        "wall_s": round(wall, 3),
        "ttft_s": ttft,
        "answered": len(ttft),
        "tokens": sum(produced),
    }


def spread_out(ask: Callable[[int], None], k: int, spread: float) -> float:
    """Call ``ask(i)`` for each of k requests, each on a thread of its own, evenly over
    ``spread`` seconds (all at once for 0); return when the first was sent, once all are
    answered."""
    started = time.monotonic()

    def at(i: int) -> None:
        time.sleep(max(0.0, started + (spread * i / (k - 1) if k > 1 else 0.0) - time.monotonic()))
        ask(i)

    threads = [threading.Thread(target=at, args=(i,)) for i in range(k)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return started


def phi4_round(home: Path, prompts: list[str], tokens: int, spread: float = 0.0) -> dict[str, Any]:
    """len(prompts) greedy solves sent at once over one connection, or, with ``spread``, each
    on its own, evenly over that many seconds."""
    from phi4cli.backends.daemon_link import DaemonConnection
    from phi4cli.core.protocol import Event, EventKind

    k = len(prompts)
    produced: list[int] = [0] * k
    first: list[float | None] = [None] * k
    socket_path = home / "run" / "daemon.sock"

    def record(i: int, event: Event) -> None:
        if event.kind in (EventKind.REASONING, EventKind.TOKEN, EventKind.STATS):
            first[i] = first[i] or time.monotonic()
        if event.kind == EventKind.STATS:
            produced[i] = event.stats.completion_tokens

    def params(i: int) -> dict[str, Any]:
        return {"prompt": prompts[i], "temperature": 0, "max_tokens": tokens}

    if spread:

        def ask(i: int) -> None:
            with DaemonConnection.open(socket_path) as connection:
                for event in connection.request("solve", params(i), timeout=3600):
                    record(i, event)

        return summary(spread_out(ask, k, spread), produced, first)
    with DaemonConnection.open(socket_path) as connection:
        started = time.monotonic()
        index = {connection.send("solve", params(i)): i for i in range(k)}
        waiting = set(index)
        while waiting:
            event = connection.next_event(timeout=3600)
            record(index[event.id], event)
            if event.terminal:
                waiting.discard(event.id)
    return summary(started, produced, first)


def server_round(port: int, prompts: list[str], tokens: int, spread: float = 0.0) -> dict[str, Any]:
    """The same chat completions sent to llama-server at once, or evenly over ``spread``."""
    k = len(prompts)
    produced: list[int] = [0] * k
    first: list[float | None] = [None] * k

    def ask(i: int) -> None:
        # Streamed, as phi4 streams every token to its client: both pay for sending them.
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": prompts[i]}],
                "max_tokens": tokens,
                "temperature": 0,
                "cache_prompt": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=3600) as response:
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content") or chunk.get("usage"):
                    first[i] = first[i] or time.monotonic()
                if chunk.get("usage"):
                    produced[i] = chunk["usage"]["completion_tokens"]

    return summary(spread_out(ask, k, spread), produced, first)


@contextmanager
def llama_server_running(server: Path, model: Path, args: list[str]) -> Iterator[int]:
    """llama-server on ``model`` with ``args``, in a session of its own (as a server started
    from another terminal is), on a free local port; yields the port once it is healthy."""
    port = free_port()
    proc = subprocess.Popen(
        [str(server), "-m", str(model), *args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_healthy(port)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


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
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="give each question a different problem text of this many tokens "
        "to read first (default: the short question alone)",
    )
    parser.add_argument(
        "--phi4-arg",
        action="append",
        default=[],
        help="pass this to `phi4 daemon start` too (e.g. --phi4-arg=--kv-layout=--phi4-arg=shared)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="pass this to llama-server too (e.g. --server-arg=-kvu for one KV "
        "cache shared by all slots, as phi4 has)",
    )
    parser.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="send a round's requests evenly over this many milliseconds, not "
        "at once (a burst that arrives a little apart)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    spread = args.spread / 1000

    from phi4cli.core.machine import physical_cores

    threads = physical_cores()
    home = Path(tempfile.mkdtemp(prefix="p4b-", dir="/tmp"))
    env = {**os.environ, "PHI4_HOME": str(home)}
    slots = max(args.concurrent)
    # Each llama-server slot has n_ctx / slots cells: room for its prompt and its answer.
    per_slot = 1024 + args.prompt_tokens + args.tokens
    # As many requests at once as llama-server has slots (phi4's default plans for 4 long ones).
    # phi4 on its own threads (as many as the cores others leave free: all on a quiet machine),
    # llama-server on the physical cores.
    # (Once its whole context is made, as llama-server's health check below waits for its own.)
    start_daemon(args.model, env, ["--parallel", str(slots), *args.phi4_arg])
    status = subprocess.run(
        [*PHI4, "status", "--json"], env=env, capture_output=True, text=True, check=True
    )
    plan = json.loads(status.stdout)["memory"]["plan"]
    server: subprocess.Popen[bytes] | None = None
    port = free_port()
    if args.server is not None:
        server = subprocess.Popen(
            [
                str(args.server),
                "-m",
                str(args.model),
                "-t",
                str(threads),
                "-tb",
                str(threads),
                "-np",
                str(slots),
                "-c",
                str(slots * per_slot),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *args.server_arg,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_healthy(port)
    results: dict[str, Any] = {
        "model": str(args.model),
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "server": str(args.server),
        "server_args": args.server_arg,
        "phi4_args": args.phi4_arg,
        "phi4_plan": plan,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} threads",
        "phi4": {},
        "llama_server": {},
        "rounds": {},
    }
    try:
        warm = questions(args.model, 1, 0)
        phi4_round(home, warm, 8)  # warm both: first requests allocate buffers
        if server is not None:
            server_round(port, warm, 8)
        for k in args.concurrent:
            base = questions(args.model, k, args.prompt_tokens)
            ours: list[dict[str, Any]] = []
            theirs: list[dict[str, Any]] = []
            for round_ in range(args.rounds):
                # Each goes first in every other round, so that neither gains from the order.
                # (A round's prompts are new to both: each round numbers its questions anew.)
                prompts = [f"(round {round_}) {prompt}" for prompt in base]
                if server is not None and round_ % 2:
                    theirs.append(server_round(port, prompts, args.tokens, spread))
                ours.append(phi4_round(home, prompts, args.tokens, spread))
                if server is not None and not round_ % 2:
                    theirs.append(server_round(port, prompts, args.tokens, spread))
            results["rounds"][k] = {"phi4": ours, "llama_server": theirs}
            results["phi4"][k] = medians(ours)
            if theirs:
                results["llama_server"][k] = medians(theirs)
    finally:
        subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)
        if server is not None:
            server.terminate()
            server.wait(30)
    rows = []
    for k in args.concurrent:
        mine, peer = results["phi4"][k], results["llama_server"].get(k)
        row = f"| {k} | {mine['tps']:.2f} tok/s | {mine['slowest_ttft_s']:.2f} s | "
        if peer:
            row += (
                f"{peer['tps']:.2f} tok/s | {peer['slowest_ttft_s']:.2f} s | "
                f"**{mine['tps'] / peer['tps']:.2f}x** |"
            )
        else:
            row += "- | - | - |"
        rows.append(row)
    extra = f"; phi4 kv_layout {plan['kv_layout']}, {plan['slots']} slots"
    extra += (
        f"; llama-server {' '.join(args.server_arg)}" if args.server and args.server_arg else ""
    )
    prompt = f"{args.prompt_tokens}-token prompts, " if args.prompt_tokens else ""
    prompt += f"sent over {args.spread:g} ms, " if args.spread else ""
    lines = [
        f"Batching on {args.model.name} ({results['machine']}, {prompt}{args.tokens}-token "
        f"greedy answers, median of {args.rounds} interleaved rounds{extra})",
        "",
        "| concurrent | phi4 aggregate | phi4 slowest first token | llama-server aggregate "
        "| llama-server slowest first token | phi4 / llama-server |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"batching-{args.model.stem}" + (f"-p{args.prompt_tokens}" if args.prompt_tokens else "")
    name += f"-s{args.spread:g}" if args.spread else ""
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round's aggregate and slowest first token (each its own median), and the
    median of each request's first-token time by rank."""
    ranks = zip(*(r["ttft_s"] for r in rounds), strict=False)
    return {
        "tps": statistics.median(r["tps"] for r in rounds),
        "slowest_ttft_s": statistics.median(max(r["ttft_s"], default=0.0) for r in rounds),
        "ttft_s": [statistics.median(rank) for rank in ranks],
    }


if __name__ == "__main__":
    main()
