"""A prompt that comes while an answer streams (a rider): what each pays, phi4 and llama-server.

    python bench/rider.py --model PATH [--server PATH/TO/llama-server] [--prompt-tokens 500]
                          [--rounds 3]

In each of ``--rounds`` passes, for phi4's daemon (``--parallel 2``: its plan may make more
slots) and (with ``--server``) llama-server (``-np 2``) on the same model and threads. phi4 reads
its system prompt and instruction before each question (cached), llama-server the question
alone:

- **alone**: a question opening with ``--prompt-tokens`` tokens of problem text, on an idle
  engine: seconds to its first token;
- **behind a stream**: a short question answered greedily first; once it has streamed 8 tokens the
  same kind of long question is sent (new text each time, so no prefix is cached): the rider's
  seconds to its first token, and the stream's tokens/s while the rider's prompt is read against
  its tokens/s before the rider came.

phi4 reads a prompt that comes while an answer streams in chunks of 64 tokens beside it
(``PREFILL_CHUNK``, ``daemon/llama/batch.py``), so that the stream a user watches does not stall;
llama-server puts up to its batch of 2,048 prompt tokens into each step beside the stream.
Writes bench/results/rider-<model>.json and .md, and prints the Markdown table.
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
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench.batching import llama_server_running, questions  # noqa: E402
from bench.speed import PHI4, QUESTION  # noqa: E402

STREAM_TOKENS = 160  # the stream's answer: long enough to outlast the rider's prompt
RIDER_TOKENS = 4
BEFORE = 8  # the stream's tokens before the rider is sent

# What one engine does for the bench: ask(prompt, tokens, on_token) streams one greedy answer,
# calling on_token(time) for each piece of text, and returns when it is done.
Ask = Callable[[str, int, Callable[[float], None]], None]


@contextmanager
def phi4_engine(model: Path, threads: int) -> Iterator[Ask]:
    from phi4cli.backends.daemon_link import DaemonConnection
    from phi4cli.core.protocol import EventKind

    home = Path(tempfile.mkdtemp(prefix="p4rider-", dir="/tmp"))
    env = {**os.environ, "PHI4_HOME": str(home)}
    subprocess.run(
        [
            *PHI4,
            "daemon",
            "start",
            "-m",
            str(model),
            "--threads",
            str(threads),
            "--n-ctx",
            "4096",
            "--parallel",
            "2",
        ],
        env=env,
        check=True,
        capture_output=True,
    )

    def ask(prompt: str, tokens: int, on_token: Callable[[float], None]) -> None:
        with DaemonConnection.open(home / "run" / "daemon.sock") as connection:
            connection.send("solve", {"prompt": prompt, "temperature": 0, "max_tokens": tokens})
            while True:
                event = connection.next_event(timeout=3600)
                if event.kind in (EventKind.REASONING, EventKind.TOKEN):
                    on_token(time.monotonic())
                if event.terminal:
                    return

    try:
        yield ask
    finally:
        subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)


@contextmanager
def server_engine(server: Path, model: Path, threads: int) -> Iterator[Ask]:
    args = ["-t", str(threads), "-tb", str(threads), "-np", "2", "-c", "4096"]
    with llama_server_running(server, model, args) as port:

        def ask(prompt: str, tokens: int, on_token: Callable[[float], None]) -> None:
            body = json.dumps(
                {
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": tokens,
                    "temperature": 0,
                    "stream": True,
                    "cache_prompt": False,
                }
            ).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=3600) as response:
                for line in response:
                    if line.startswith(b"data: {"):
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        delta = choices[0].get("delta") or {}
                        if delta.get("content") or delta.get("reasoning_content"):
                            on_token(time.monotonic())

        yield ask


def alone(ask: Ask, prompt: str) -> float:
    """Seconds to the first token of ``prompt`` on an idle engine."""
    first: list[float] = []
    started = time.monotonic()
    ask(prompt, RIDER_TOKENS, first.append)
    return first[0] - started


def behind(ask: Ask, stream_prompt: str, prompt: str) -> dict[str, float]:
    """The rider's seconds to its first token, sent once the stream has streamed BEFORE
    tokens; and the stream's tokens/s before the rider came and while its prompt was read."""
    stream: list[float] = []
    ready = threading.Event()

    def on_stream(at: float) -> None:
        stream.append(at)
        if len(stream) >= BEFORE:
            ready.set()

    runner = threading.Thread(target=ask, args=(stream_prompt, STREAM_TOKENS, on_stream))
    runner.start()
    ready.wait(600)
    rider: list[float] = []
    sent = time.monotonic()
    ask(prompt, RIDER_TOKENS, rider.append)
    runner.join()
    before = [t for t in stream if t <= sent]
    during = [t for t in stream if sent < t <= rider[0]]
    rate_before = (len(before) - 1) / (before[-1] - before[0]) if len(before) > 1 else 0.0
    rate_during = len(during) / (rider[0] - sent)
    if stream[-1] <= rider[0]:  # the stream ended first: it did not outlast the prompt
        rate_during = float("nan")
    return {
        "ttft_s": rider[0] - sent,
        "stream_before_tps": rate_before,
        "stream_during_tps": rate_during,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--server", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    from phi4cli.core.machine import physical_cores

    threads = physical_cores()
    engines: dict[str, Callable[[], AbstractContextManager[Ask]]] = {
        "phi4": lambda: phi4_engine(args.model, threads)
    }
    if args.server is not None:
        server = args.server
        engines["llama-server"] = lambda: server_engine(server, args.model, threads)
    # Every prompt is new text (a round and a use of its own), so no engine reuses a prefix.
    texts = iter(questions(args.model, 4 * args.rounds * len(engines), args.prompt_tokens))
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for done in range(args.rounds):
        for name, start in engines.items():
            with start() as ask:
                ask(f"{QUESTION} (warm-up)", 4, lambda _at: None)
                measured = {
                    "alone_ttft_s": alone(ask, next(texts)),
                    **behind(ask, f"{QUESTION} (round {done})", next(texts)),
                }
            for key, value in measured.items():
                runs[name].setdefault(key, []).append(value)
            print(
                f"pass {done + 1}, {name}: alone {measured['alone_ttft_s']:.2f} s, behind a "
                f"stream {measured['ttft_s']:.2f} s; the stream "
                f"{measured['stream_before_tps']:.2f} tok/s before, "
                f"{measured['stream_during_tps']:.2f} while the prompt was read",
                flush=True,
            )
    # (A pass whose stream ended before the rider's first token has no rate "while": left out.)
    median = {
        name: {
            key: statistics.median([v for v in values if v == v] or [float("nan")])
            for key, values in keys.items()
        }
        for name, keys in runs.items()
    }
    results: dict[str, Any] = {
        "model": str(args.model),
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} threads",
        "runs": runs,
        "median": median,
    }
    lines = [
        f"A {args.prompt_tokens}-token prompt alone and behind a streaming answer on "
        f"{args.model.name} ({results['machine']}, median of {args.rounds} interleaved passes)",
        "",
        "| engine | first token, alone | first token, behind a stream | the stream before | "
        "the stream while the prompt is read |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {name} | {m['alone_ttft_s']:.2f} s | {m['ttft_s']:.2f} s | "
            f"{m['stream_before_tps']:.2f} tok/s | {m['stream_during_tps']:.2f} tok/s |"
            for name, m in median.items()
        ),
    ]
    report.write(args.out, f"rider-{args.model.stem}", results, "\n".join(lines))


if __name__ == "__main__":
    main()
