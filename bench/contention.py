"""Decoding on a busy machine: phi4's daemon and llama-server, quiet and beside busy processes.

    python bench/contention.py --model PATH [--server PATH/TO/llama-server] [--busy 2]
                               [--tokens 64] [--rounds 3]

Users' machines are not quiet: a browser, an editor, a build run beside the daemon. In each of
``--rounds`` passes every variant is started in turn and, after a warm-up, decodes ``--tokens``
greedy tokens of one question on a quiet machine and then again with ``--busy`` processes
spinning on the CPUs (each a Python ``while True``). Reported: the median decode rate (tokens
after the first, over the decode time: what the stats of phi4 and the timings of llama-server
both report) and the median of each pass's busy / quiet. The variants:

- phi4 as it starts by default (``daemon/threads.py``: a spin of 100,000 turns, then sleep, and
  as many threads as other processes leave cores free, re-checked every second while decoding);
- phi4 on a fixed 2 threads (``--threads``, which keeps the count as the user set it): with the
  passive wait policy, with OpenMP's default spinning (``GOMP_SPINCOUNT=300000``) and with its
  own spin;
- phi4 with 1 thread;
- with ``--spin N`` (repeatable), phi4 with ``GOMP_SPINCOUNT=N`` on threads from the free cores
  and on all; ``--only TEXT`` (repeatable) runs the variants whose names hold it;
- llama-server (same threads) by default, and with ``--poll 0``.

Each busy process, the daemon and llama-server run in a session of their own, as a browser, a
daemon and a server started from a terminal do on a desktop. Where the kernel groups processes
by session for the scheduler (``/proc/sys/kernel/sched_autogroup_enabled``, on by default on
many distributions), that decides who gets the CPUs: a server started in the bench's own session
would share one group with the busy processes and get two of every three turns on the CPUs
where, in a group of its own, it gets half.

One daemon or server at a time, passes interleaved, so the machine's drift hits each alike. Writes
bench/results/contention-<model>.json and .md (a run with other than ``--busy 2``, with
``--duty``, ``--spin`` or ``--only`` adds ``-busyN``, ``-dutyP``, ``-chosen`` to the name), and
prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.batching import llama_server_running  # noqa: E402
from bench.speed import PHI4, QUESTION  # noqa: E402

SPIN = "while True: pass"
# Busy a share of each 100 ms and asleep the rest: a browser, an editor (a lighter load).
SOME = (
    "import time\nwhile True:\n    until = time.monotonic() + {duty} * 0.1\n"
    "    while time.monotonic() < until: pass\n    time.sleep((1 - {duty}) * 0.1)\n"
)
Ask = Callable[[int], float]


@contextmanager
def busy(count: int, duty: float = 1.0) -> Iterator[None]:
    """``count`` processes spinning on the CPUs while the block runs (each ``duty`` of the
    time)."""
    code = SPIN if duty >= 1.0 else SOME.format(duty=duty)
    procs = [
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(count)
    ]
    try:
        time.sleep(1.0)  # let them take their share of the CPUs
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextmanager
def phi4_running(model: Path, args: list[str], env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A daemon of its own (a fresh PHI4_HOME) on ``model`` with ``args``, a 4,096-token
    context and ``env``; yields its environment, for the commands that talk to it."""
    home = Path(tempfile.mkdtemp(prefix="p4c-", dir="/tmp"))
    env = {**env, "PHI4_HOME": str(home)}
    subprocess.run(
        [*PHI4, "daemon", "start", "-m", str(model), *args, "--n-ctx", "4096"],
        env=env,
        check=True,
        capture_output=True,
    )
    try:
        yield env
    finally:
        subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)


def solve_stats(env: dict[str, str], model: Path, question: str, tokens: int) -> dict[str, Any]:
    """The stats of a greedy ``phi4 solve --json`` of ``tokens`` tokens (no instruction)."""
    done = subprocess.run(
        [
            *PHI4,
            "solve",
            question,
            "-m",
            str(model),
            "-t",
            "0",
            "--json",
            "--no-instruction",
            "-n",
            str(tokens),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    # (Exit 1 is fine: a reasoning model's thinking cut short has no final answer.)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"phi4 solve failed ({done.returncode}): {done.stderr.strip()}")
    return dict(json.loads(done.stdout)["stats"])


@contextmanager
def phi4_daemon(model: Path, threads: int | None, env: dict[str, str]) -> Iterator[Ask]:
    """A daemon started with ``env`` (and ``--threads``, unless None: its own choice); yields
    the decode rate of a greedy solve of so many tokens."""
    fixed = [] if threads is None else ["--threads", str(threads)]
    with phi4_running(model, fixed, env) as running:

        def ask(tokens: int) -> float:
            stats = solve_stats(running, model, QUESTION, tokens)
            return float((stats["completion_tokens"] - 1) / max(stats["decode_s"], 1e-9))

        yield ask


@contextmanager
def llama_server(server: Path, model: Path, threads: int, extra: list[str]) -> Iterator[Ask]:
    """A llama-server started with ``extra``; yields the decode rate of a greedy chat
    completion (its own timings: predicted_per_second)."""
    args = ["-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "4096", *extra]
    with llama_server_running(server, model, args) as port:

        def ask(tokens: int) -> float:
            body = json.dumps(
                {
                    "messages": [{"role": "user", "content": QUESTION}],
                    "max_tokens": tokens,
                    "temperature": 0,
                    "cache_prompt": False,
                }
            ).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=900) as reply:
                return float(json.loads(reply.read())["timings"]["predicted_per_second"])

        yield ask


def autogroup() -> str:
    """Whether the kernel groups processes by session when it shares the CPUs."""
    try:
        on = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return "no session groups"
    return "session groups" if on else "no session groups"


def main() -> None:
    # A bench stopped with SIGTERM still kills its busy processes (each in a session of its
    # own, so nothing else would): the finally blocks run on the way out.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--server", type=Path)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside it")
    parser.add_argument(
        "--duty", type=float, default=1.0, help="the share of the time each busy process spins"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--spin",
        type=int,
        action="append",
        default=[],
        help="also phi4 with GOMP_SPINCOUNT=N, on threads from the free cores "
        "and on all (repeatable)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only the variants whose name contains this (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    from phi4cli.core.machine import physical_cores
    from phi4cli.daemon.threads import SPIN_COUNT

    threads = physical_cores()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    base = {k: v for k, v in base.items() if k != "PHI4_THREADS"}
    n, tokens = threads, args.tokens
    variants: dict[str, Callable[[], AbstractContextManager[Ask]]] = {
        f"phi4 (its default: a spin of {int(SPIN_COUNT):,} turns, threads from the free cores)": lambda: (  # noqa: E501
            phi4_daemon(args.model, None, base)
        ),
        f"phi4, passive wait, {n} threads": lambda: phi4_daemon(
            args.model, n, {**base, "OMP_WAIT_POLICY": "PASSIVE"}
        ),
        f"phi4, OpenMP's default spinning, {n} threads": lambda: phi4_daemon(
            args.model, n, {**base, "GOMP_SPINCOUNT": "300000"}
        ),
        f"phi4, its spin, {n} threads": lambda: phi4_daemon(args.model, n, base),
        "phi4, 1 thread": lambda: phi4_daemon(args.model, 1, base),
    }

    def spinning(
        threads: int | None, env: dict[str, str]
    ) -> Callable[[], AbstractContextManager[Ask]]:
        return lambda: phi4_daemon(args.model, threads, env)

    for spin in args.spin:
        spun = {**base, "GOMP_SPINCOUNT": str(spin)}
        variants[f"phi4, GOMP_SPINCOUNT={spin}, threads from the free cores"] = spinning(None, spun)
        variants[f"phi4, GOMP_SPINCOUNT={spin}, {n} threads"] = spinning(n, spun)
    if args.server is not None:
        server = args.server
        variants["llama-server"] = lambda: llama_server(server, args.model, n, [])
        variants["llama-server --poll 0"] = lambda: llama_server(
            server, args.model, n, ["--poll", "0"]
        )
    if not 0 < args.duty <= 1:
        parser.error("--duty is a share of the time: more than 0, at most 1")
    if args.only:
        variants = {k: v for k, v in variants.items() if any(o in k for o in args.only)}
        if not variants:
            parser.error(f"no variant's name holds any of {args.only}")
    results: dict[str, Any] = {
        "model": str(args.model),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "busy": args.busy,
        "duty": args.duty,
        "threads": threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {autogroup()}",
        "quiet": {},
        "busy_rates": {},
    }
    # Interleaved: each pass starts each variant in turn and times one answer on the quiet
    # machine and one beside the busy processes, so that the machine's drift (these are
    # shared machines) falls on all alike, and each pair is a minute apart at most.
    for done in range(args.rounds):
        for name, start in variants.items():
            with start() as ask:
                ask(4)  # warm-up
                quiet = ask(tokens)
                with busy(args.busy, args.duty):
                    loaded = ask(tokens)
            results["quiet"].setdefault(name, []).append(quiet)
            results["busy_rates"].setdefault(name, []).append(loaded)
            print(
                f"pass {done + 1}, {name}: quiet {quiet:.2f}, {args.busy} busy {loaded:.2f} tok/s",
                flush=True,
            )
    rows = []
    for name in variants:
        quiet = statistics.median(results["quiet"][name])
        loaded = statistics.median(results["busy_rates"][name])
        ratio = statistics.median(
            b / q for q, b in zip(results["quiet"][name], results["busy_rates"][name], strict=True)
        )
        rows.append(f"| {name} | {quiet:.2f} tok/s | {loaded:.2f} tok/s | {ratio:.2f}x |")
    load = f"{args.busy} busy processes" + (
        f" ({args.duty:.0%} of the time)" if args.duty < 1 else ""
    )
    lines = [
        f"Decoding beside {load} on {args.model.name} "
        f"({results['machine']}, {threads} threads unless said, {args.tokens}-token greedy "
        f"answers, median of {args.rounds} interleaved passes)",
        "",
        f"| variant | quiet | {load} | busy / quiet |",
        "| --- | --- | --- | --- |",
        *rows,
    ]
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    # A run of other loads or of chosen variants does not overwrite the default run's table.
    name = f"contention-{args.model.stem}"
    if args.busy != 2 or args.duty < 1:
        name += f"-busy{args.busy}" + (f"-duty{round(args.duty * 100)}" if args.duty < 1 else "")
    if args.only or args.spin:
        name += "-chosen"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
