"""A daemon's first answer after a reboot and after a restart, against a plain start, in one run.

    python bench/restart.py --model PATH [--rounds 3] [--tokens 1] [--checkout DIR]

A reboot is simulated for the model file: its pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``, so the next read comes from the disk) and its staged copy in RAM is
removed (tmpfs does not survive a reboot); the saved system-prompt states stay (they are on
disk). In each of ``--rounds`` passes, in this order:

1. **plain start after a reboot**: nothing staged, no saved states, the file not in memory;
   ``phi4 solve`` (ramdisk off) until its first byte: what a first question costs with none of
   phi4's help.
2. **``phi4 warm`` after a reboot**: the file dropped and unstaged again, the states kept;
   ``phi4 warm`` (which stages the model and starts the daemon), then ``phi4 solve`` until its
   first byte: what a user who runs ``phi4 warm`` at login waits for at the first question.
3. **daemon restart**: ``phi4 stop``, then ``phi4 solve`` until its first byte, with the staged
   copy and the saved states that 2 left.

Each ``phi4 solve`` starts the daemon itself, as a user's first question does. It asks for
``--tokens`` (1): the command ends at the first token, so its first byte is the first token's
time for any model (a model that thinks first writes nothing to stdout before its thinking ends:
with more tokens its first byte would be the command's end). Also read from
the daemon's log for 1 and 3: how long llama.cpp's load took. Writes
bench/results/restart-<model>.json and .md, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench.speed import PHI4, QUESTION, first_byte_s  # noqa: E402


def drop_from_page_cache(path: Path) -> None:
    """Drop the file's cached pages, as a reboot would (pages mapped by a process stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def unstage(model: Path) -> None:
    """Remove the model's staged copy in RAM (no daemon may have it loaded)."""
    from phi4cli.daemon.ramdisk import ramdisk_dir, staged_name

    directory = ramdisk_dir()
    if directory is not None:
        (directory / staged_name(model)).unlink(missing_ok=True)


def load_s(home: Path) -> float:
    """The last load's seconds, from the daemon's log."""
    log = (home / "state" / "daemon.log").read_text()
    found = re.findall(r"loaded .* in ([\d.]+) s \(threads", log)
    return float(found[-1]) if found else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--tokens",
        type=int,
        default=1,
        help="tokens to ask for (-n): with 1 the command ends at its first "
        "token, so its first byte is the first token's time whether the "
        "model answers at once or thinks first (then nothing reaches "
        "stdout before the end)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument(
        "--checkout",
        type=Path,
        help="run phi4 from this checkout instead (a git worktree of another "
        "commit, for a before/after comparison)",
    )
    args = parser.parse_args()
    model = args.model.absolute()  # (not resolved: a link's name can say the model reasons)
    home = Path(tempfile.mkdtemp(prefix="p4r-", dir="/tmp"))
    env = {**os.environ, "PHI4_HOME": str(home)}
    if args.checkout is not None:
        env["PYTHONPATH"] = str(args.checkout.resolve())
    solve = [*PHI4, "solve", QUESTION, "-m", str(model), "-t", "0", "-n", str(args.tokens)]

    def stop() -> None:
        subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=True)

    runs: dict[str, list[float]] = {}

    def keep(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    try:
        for done in range(args.rounds):
            stop()
            unstage(model)
            shutil.rmtree(home / "cache" / "states", ignore_errors=True)
            drop_from_page_cache(model)
            plain = first_byte_s(solve, {**env, "PHI4_RAMDISK_MODE": "off"})[0]
            keep("plain", plain)
            keep("plain_load", load_s(home))

            stop()
            unstage(model)
            drop_from_page_cache(model)
            started = time.monotonic()
            subprocess.run(
                [*PHI4, "warm", "-m", str(model), "--ramdisk"],
                env=env,
                capture_output=True,
                check=True,
            )
            keep("warm", time.monotonic() - started)
            keep("after_warm", first_byte_s(solve, env)[0])

            stop()
            restart = first_byte_s(solve, {**env, "PHI4_RAMDISK_MODE": "on"})[0]
            keep("restart", restart)
            keep("restart_load", load_s(home))
            print(
                f"pass {done + 1}: plain start {plain:.2f} s, warm {runs['warm'][-1]:.2f} s "
                f"then {runs['after_warm'][-1]:.2f} s, restart {restart:.2f} s "
                f"(loads {runs['plain_load'][-1]:.2f} / {runs['restart_load'][-1]:.2f} s)",
                flush=True,
            )
    finally:
        subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)

    median = {name: statistics.median(values) for name, values in runs.items()}
    ratio = statistics.median(p / r for p, r in zip(runs["plain"], runs["restart"], strict=True))
    results: dict[str, Any] = {
        "model": str(model),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "runs": runs,
        "median": median,
        "plain_over_restart": ratio,
    }
    rows = [
        (
            "1. plain start after a reboot (first byte of `phi4 solve`)",
            median["plain"],
            f"llama.cpp's load {median['plain_load']:.2f} s",
        ),
        ("2. `phi4 warm` after a reboot", median["warm"], "stages the model, starts the daemon"),
        ("2. then `phi4 solve`, first byte", median["after_warm"], ""),
        (
            "3. daemon restart, staged and restored (first byte of `phi4 solve`)",
            median["restart"],
            f"llama.cpp's load {median['restart_load']:.2f} s; **{ratio:.1f}x** faster than 1",
        ),
    ]
    lines = [
        f"First answer after a reboot and a restart on {model.name} ({results['machine']}, "
        f"median of {args.rounds} passes)",
        "",
        "| what | seconds | |",
        "| --- | --- | --- |",
        *(f"| {what} | {seconds:.2f} s | {note} |" for what, seconds, note in rows),
    ]
    results["checkout"] = str(args.checkout) if args.checkout else "this one"
    report.write(args.out, f"restart-{model.stem}", results, "\n".join(lines))


if __name__ == "__main__":
    main()
