"""Starting the daemon detached, reading its status file, and cleaning up after a dead one.

Liveness is decided by the daemon's lock file, not by pids: the running daemon holds an exclusive
``flock`` on ``daemon.lock`` for its whole life, and the kernel drops it when the process dies, even
by SIGKILL, so a lock that can be taken means whatever socket or status file is left is stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from phi4cli.core.config import Settings
from phi4cli.core.paths import Paths

if TYPE_CHECKING:
    import subprocess


class DaemonStatus(NamedTuple):
    """What the daemon's status file says (pid, socket, protocol, model, state)."""

    pid: int
    socket: str
    protocol: int
    state: str
    model: str | None
    started_at: float
    raw: dict[str, Any]


def read_status(paths: Paths) -> DaemonStatus | None:
    """Return the status file's content, or None when it is absent or unreadable."""
    try:
        raw = json.loads(paths.status_file.read_text())
        return DaemonStatus(
            pid=int(raw["pid"]),
            socket=str(raw["socket"]),
            protocol=int(raw["protocol"]),
            state=str(raw["state"]),
            model=raw.get("model"),
            started_at=float(raw.get("started_at", 0.0)),
            raw=raw,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def daemon_alive(paths: Paths) -> bool:
    """Return True while some process holds the daemon lock."""
    try:
        fd = os.open(paths.daemon_lock, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def lock_holder(paths: Paths) -> int | None:
    """The pid the daemon holding the lock wrote into it as it took it (None if none can be
    read). Only a hint: a pid read from a file is checked before it is signalled."""
    try:
        fd = os.open(paths.daemon_lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        text = os.read(fd, 32)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        pid = int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return pid if pid > 0 else None


def remove_stale_files(paths: Paths) -> bool:
    """Remove the socket and status file of a dead daemon; return True if anything was removed.

    Does nothing while a daemon holds the lock.
    """
    if daemon_alive(paths):
        return False
    removed = False
    for path in (paths.socket, paths.status_file):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed = True
    return removed


@contextlib.contextmanager
def spawn_lock(paths: Paths, timeout: float | None = None) -> Iterator[bool]:
    """Hold the spawn lock: one client at a time decides whether to start a daemon. With
    ``timeout``, go on without it after that long (yield False)."""
    paths.ensure_runtime_dir()
    fd = os.open(paths.spawn_lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if timeout is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield True
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                yield False
                return
            yield True
            return
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def daemon_command(settings: Settings, model_path: Path | None) -> list[str]:
    """How the daemon is started: ``phi4 daemon run`` given, as one argument, every setting it
    keeps for its life (``options.DAEMON_START``) as this client has them, so that the daemon
    has them so too whatever its own environment says."""
    import json

    from phi4cli.core.options import DAEMON_START

    # -P: not the working directory first on sys.path, so the daemon runs the same phi4 as the
    # client even when started inside a source checkout (it would be "another install").
    given = {key: getattr(settings, key) for key in DAEMON_START}
    command = [
        sys.executable,
        "-P",
        "-m",
        "phi4cli",
        "daemon",
        "run",
        "--settings",
        json.dumps(given, separators=(",", ":")),
    ]
    if model_path is not None:
        command += ["--model", str(model_path)]
    return command


LOG_MAX_BYTES = 5 << 20
LOG_KEEP = 3


def rotate_log(log_file: Path) -> None:
    """Keep the daemon log under LOG_MAX_BYTES: daemon.log -> .1 -> .2 -> .3 (dropped)."""
    try:
        if log_file.stat().st_size < LOG_MAX_BYTES:
            return
    except FileNotFoundError:
        return
    for index in range(LOG_KEEP - 1, 0, -1):
        older = log_file.with_name(f"{log_file.name}.{index}")
        if older.exists():
            older.replace(log_file.with_name(f"{log_file.name}.{index + 1}"))
    log_file.replace(log_file.with_name(f"{log_file.name}.1"))


def spawn_daemon(
    paths: Paths, settings: Settings, model_path: Path | None
) -> subprocess.Popen[bytes]:
    """Start ``phi4 daemon run`` in its own session, its output appended to the daemon log."""
    import subprocess

    try:
        paths.state_dir.mkdir(parents=True, exist_ok=True)
        rotate_log(paths.log_file)
        log = open(paths.log_file, "ab")  # noqa: SIM115 - handed to the child, closed below
    except OSError as exc:
        from phi4cli.core.atomicfile import write_problem
        from phi4cli.core.errors import DaemonUnavailableError

        raise DaemonUnavailableError(
            f"cannot start the daemon: cannot write its log {paths.log_file}: "
            f"{write_problem(exc, paths.log_file, 'set PHI4_HOME elsewhere')}"
        ) from None
    with log:
        return subprocess.Popen(
            daemon_command(settings, model_path),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in the client's terminal must not reach the daemon
            close_fds=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def last_log_line(paths: Paths) -> str:
    """Return the last non-empty line of the daemon log ('' if none), for start-up failures."""
    try:
        with open(paths.log_file, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = [line for line in handle.read().decode(errors="replace").splitlines() if line]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def process_running(pid: int) -> bool:
    """Return True while ``pid`` exists and is not a zombie (an exited, unreaped child)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
