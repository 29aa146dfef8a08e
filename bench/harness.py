"""What the timing benches share: starting phi4's daemon the way a peer's server is started.

A fresh daemon answers at once from a small context while it makes the whole one on a thread
beside the first answers (``phi4cli/daemon/llama/model.py``, ``GrowingContext``). Making it clears
the whole KV cache, gigabytes, which on a 2-core machine takes 16-33 s and slows the answers
decoded meanwhile. llama-server answers its health check only once its whole context is made, and
in-process llama-cpp-python makes its context before it returns; so a bench that compares decode
or batching speeds waits for phi4's whole context too, or its first rounds pay for the making.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.speed import PHI4


def start_daemon(model: Path | str, env: Mapping[str, str], args: Sequence[str] = ()) -> None:
    """``phi4 daemon start -m MODEL ARGS`` under ``env``, returning once the whole context is
    made (its status has no ``context_growing_s`` any more)."""
    subprocess.run(
        [*PHI4, "daemon", "start", "-m", str(model), *args],
        env=dict(env),
        capture_output=True,
        check=True,
    )
    wait_whole_context(env)


def wait_whole_context(env: Mapping[str, str], timeout: float = 600.0) -> float:
    """Wait until the daemon of ``env``'s ``PHI4_HOME`` answers from its whole context; return
    the seconds waited. (Asked over its socket from this process: a ``phi4 status`` process
    every half second would take a core from the making it waits for.)"""
    from phi4cli.backends.daemon_link import DaemonConnection
    from phi4cli.core.protocol import Op

    socket_path = Path(env["PHI4_HOME"]) / "run" / "daemon.sock"
    started = time.monotonic()
    while True:
        with DaemonConnection.open(socket_path) as connection:
            memory = connection.call(Op.STATUS).result.get("memory") or {}
        if "context_growing_s" not in memory:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"the daemon's whole context was not made in {timeout:.0f} s")
        time.sleep(0.5)
