"""What the thin client (``phi4cli.thin``) and the daemon agree on, worked out with ``os`` alone:
where the daemon's socket lives (``paths`` builds its ``Paths`` from this too), which install
of phi4 is which, and which environment variables a command reads. The thin client imports this
before anything else, so nothing here may import more than ``os`` and ``sys``."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

APP_NAME = "phi4"
SOCKET_NAME = "daemon.sock"
# What a command reads from the environment besides its PHI4_* variables: the daemon runs the
# thin client's command only when all of these are as in its own environment. Only those: a
# login's own (XDG_SESSION_ID, TERM, which differ between two terminals of one user) would keep
# a daemon started in one from running the commands of another. Not TERM, COLUMNS, LINES or the
# locale either: only a terminal's view reads them (the daemon runs no command whose stdout is a
# terminal), and the thin client writes what it is sent in its own encoding.
ENVIRONMENT = frozenset({
    "HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME",
    "XDG_RUNTIME_DIR", "TMPDIR", "TEMP", "TMP", "NO_COLOR", "FORCE_COLOR", "PYTHONIOENCODING",
    "PYTHONUTF8",
})  # fmt: skip
# Read only by commands the daemon does not run (`phi4 config edit`, `phi4 pull`): a daemon
# started by systemd, without them, still runs a solve for a shell that has them.
NOT_READ_BY_A_SOLVE = frozenset({
    "VISUAL", "EDITOR", "HF_ENDPOINT", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy",
    "https_proxy", "no_proxy",
})  # fmt: skip


def read_by_a_command(name: str) -> bool:
    """Whether a variable can change what a command does (see ``ENVIRONMENT``)."""
    return name.startswith("PHI4_") or name in ENVIRONMENT


def environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` a command reads."""
    return {name: value for name, value in environ.items() if read_by_a_command(name)}


def install_id() -> str:
    """Where this phi4 lives (the ``phi4cli`` package's directory): two installs of one version
    are still two daemons' worth. The client, the thin client and the daemon all ask."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def home_root(value: str) -> str:
    """``PHI4_HOME`` as a directory: ``~`` expanded, made absolute as ``Path.absolute`` does
    (against the working directory, ``..`` kept)."""
    path = os.path.expanduser(value)
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def runtime_dir(environ: Mapping[str, str], tempdir: Callable[[], str | None]) -> str | None:
    """The runtime directory (the socket's) for ``environ``: ``$PHI4_HOME/run``, else
    ``$XDG_RUNTIME_DIR/phi4`` where that is a writable directory, else ``phi4-<uid>`` in
    ``tempdir()`` (containers, cron jobs and ssh sessions without a session manager). None
    where it cannot be said here: macOS's comes from platformdirs, and ``tempdir()`` may say
    None."""
    home = environ.get("PHI4_HOME")
    if home:
        return os.path.join(home_root(home), "run")
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return os.path.join(xdg, APP_NAME)
    if sys.platform == "darwin":
        return None
    temp = tempdir()
    return None if temp is None else os.path.join(temp, f"{APP_NAME}-{os.getuid()}")


def foreign_socket(path: str, uid: int) -> str:
    """What is said of a socket another user's process serves (a runtime dir of ours, with a
    socket planted in it): no question is sent to it."""
    return (f"the socket {path} is served by another user's process (uid {uid}); phi4 will not "
            f"talk to it: remove {os.path.dirname(path)}, or set XDG_RUNTIME_DIR")  # fmt: skip
