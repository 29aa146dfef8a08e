"""How fast a warm `phi4 solve` starts: the client's own cost, against the floor it cannot beat.

    python bench/client_start.py [--model PATH] [--runs 30] [--llama-server PATH] [--phi4 CMD]

Two installs are timed, each with its own floor, because the floor differs between them:

- **installed**: phi4 as ``pip install phi4cli`` leaves it, in a venv made for the run (the
  package linked into its site-packages, the dependencies reached through a ``.pth``, and the
  ``phi4`` script pip writes for the ``[project.scripts]`` entry point). This is what users run.
- **this environment**: the ``phi4`` of the environment running the bench (an editable checkout
  here: its import hook makes every interpreter start import pathlib and re, so ``python -c
  pass`` is slower and phi4's own imports look cheaper).

For a one-token answer from a warm daemon, medians over ``--runs`` of:

- ``python -c pass``: starting that install's interpreter (with its site-packages);
- the daemon's own time: the same request sent from this process over a new connection after a
  pause (as each `phi4 solve` meets the daemon), so no process start and no imports — what the
  daemon itself takes, socket round trips included;
- ``phi4 solve "..." -n 1`` piped: the whole command, as a shell loop runs it;
- ``phi4 solve`` at a terminal is not timed (it needs a pty); it sends its request before it
  imports rich, so the daemon starts work as early as in the piped case;
- with ``--llama-server``: ``curl`` asking llama.cpp's llama-server (same model) for one token.

``--phi4 CMD`` times that command (another checkout's, say) instead of the two installs.

The goal (issue 10): ``phi4 solve`` within 1.5x of ``python -c pass`` + the daemon's own time.
Writes bench/results/client_start-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTION = "What is 2+2?"
PHI4 = str(Path(sys.executable).with_name("phi4"))


def timed(command: list[str], env: dict[str, str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            check=True,
        )
        times.append(time.perf_counter() - started)
    return times


def daemon_own(socket_path: Path, model: Path, runs: int) -> list[float]:
    """The request on the wire, by hand (so any phi4 version's daemon can be timed)."""
    params = {"prompt": QUESTION, "model": str(model), "max_tokens": 1, "temperature": 0}
    line = json.dumps({"v": 1, "id": 1, "op": "solve", "params": params}).encode() + b"\n"
    times = []
    for _ in range(runs):
        # As a `phi4 solve` meets it: a new connection, after a pause (a process start).
        time.sleep(0.05)
        started = time.perf_counter()
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(socket_path))
            sock.sendall(line)
            reader = sock.makefile("rb")
            while (event := json.loads(reader.readline()))["event"] not in ("done", "error"):
                pass
        assert event["event"] == "done", event
        times.append(time.perf_counter() - started)
    return times


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def curl_llama_server(binary: str, model: Path, runs: int) -> list[float]:
    port = free_port()
    server = subprocess.Popen(
        [binary, "-m", str(model), "--port", str(port), "-c", "2048", "--log-disable"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while (
            subprocess.run(
                ["curl", "-sf", f"{url}/health"], stdout=subprocess.DEVNULL, check=False
            ).returncode
            != 0
        ):
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("llama-server did not start")
            time.sleep(0.2)
        body = json.dumps(
            {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1, "temperature": 0}
        )
        command = [
            "curl",
            "-s",
            f"{url}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ]
        timed(command, dict(os.environ), 3)  # warm its cache like ours
        return timed(command, dict(os.environ), runs)
    finally:
        server.terminate()
        server.wait(timeout=30)


def installed(root: Path) -> tuple[str, list[str]]:
    """A venv with phi4 as a regular (not editable) install; return its python and phi4."""
    import site
    import sysconfig

    venv = root / "installed"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "phi4cli").symlink_to(ROOT / "phi4cli")
    # The dependencies, from this environment: a .pth adds the directory to sys.path, and the
    # .pth files inside it (this checkout's editable hook) are not run.
    ours = [p for p in site.getsitepackages() if p != sysconfig.get_path("stdlib")]
    (Path(purelib) / "deps.pth").write_text("\n".join(ours) + "\n")
    # The `phi4` script pip writes for pyproject's [project.scripts] entry point.
    script = venv / "bin" / "phi4"
    script.write_text(
        f"#!{python}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
        "from phi4cli.entry import main\nif __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        "    sys.exit(main())\n"
    )
    script.chmod(0o755)
    return str(python), [str(script)]


def measure(
    python: str, phi4: list[str], model: Path, env: dict[str, str], home: Path, runs: int
) -> dict[str, list[float]]:
    subprocess.run(
        [*phi4, "daemon", "start", "-m", str(model)], env=env, check=True, stdout=subprocess.DEVNULL
    )
    try:
        solve = [*phi4, "solve", QUESTION, "-m", str(model), "-n", "1", "-t", "0"]
        timed(solve, env, 3)  # the daemon's prompt cache and the page cache, as a user has them
        return {
            "python -c pass": timed([python, "-c", "pass"], env, runs),
            "daemon's own time": daemon_own(home / "run" / "phi4" / "daemon.sock", model, runs),
            "phi4 solve (piped)": timed(solve, env, runs),
        }
    finally:
        subprocess.run([*phi4, "stop"], env=env, check=False, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .gguf (default: the tiny test model)")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server binary")
    parser.add_argument("--phi4", help="time this phi4 command instead (another checkout's, say)")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="phi4-bench-"))
    # A private home through the XDG variables, not PHI4_HOME: the paths are found as for a user,
    # through platformdirs, which is part of what a solve costs.
    xdg = {
        f"XDG_{kind}_HOME": str(home / kind.lower())
        for kind in ("CONFIG", "DATA", "STATE", "CACHE")
    }
    xdg["XDG_RUNTIME_DIR"] = str(home / "run")
    (home / "run").mkdir(mode=0o700)
    env = {**os.environ, **xdg}
    env.pop("PHI4_HOME", None)
    # As installed for a user: compiled modules cached (pip compiles them at install; an
    # editable checkout writes them on first run unless this is set, as on CI machines).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.model:
        model = Path(args.model).resolve()
    else:
        from tests.tinymodel import write_tiny_phi3

        model = write_tiny_phi3(home / "tiny-phi3.gguf")
    if args.phi4:
        setups = {"given": (sys.executable, args.phi4.split())}
    else:
        setups = {"installed": installed(home), "this environment": (sys.executable, [PHI4])}
    try:
        results = {
            name: measure(python, phi4, model, env, home, args.runs)
            for name, (python, phi4) in setups.items()
        }
        curl = curl_llama_server(args.llama_server, model, args.runs) if args.llama_server else None
    finally:
        shutil.rmtree(home, ignore_errors=True)
    lines = [
        f"# Client start, one-token answer, warm daemon ({model.name})",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"median of {args.runs} runs each",
        "",
        "| install | what | median | |",
        "|---|---|---|---|",
    ]
    summary: dict[str, dict[str, object]] = {}
    for name, rows in results.items():
        medians = {what: statistics.median(times) for what, times in rows.items()}
        floor = medians["python -c pass"] + medians["daemon's own time"]
        ratio = medians["phi4 solve (piped)"] / floor
        summary[name] = {"medians_s": medians, "floor_s": floor, "ratio": ratio, "samples_s": rows}
        for what, value in medians.items():
            note = ""
            if what == "phi4 solve (piped)":
                note = (
                    f"{ratio:.2f}x the floor (python -c pass + daemon's own time, "
                    f"{floor * 1000:.1f} ms)"
                )
            lines.append(f"| {name} | {what} | {value * 1000:.1f} ms | {note} |")
    if curl is not None:
        lines.append(
            f"| llama-server | curl, one token | {statistics.median(curl) * 1000:.1f} ms | |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    out = ROOT / "bench" / "results" / f"client_start-{model.stem}"
    out.with_suffix(".md").write_text(report)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "model": model.name,
                "runs": args.runs,
                "installs": summary,
                "curl_llama_server_s": curl,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
