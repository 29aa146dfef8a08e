"""Every file location phi4 uses, from platformdirs; ``PHI4_HOME`` relocates them all."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import sys
from pathlib import Path
from typing import NamedTuple

APP_NAME = "phi4"
SOCKET_NAME = "daemon.sock"
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL on Linux.
MAX_SOCKET_PATH = 107


class Paths(NamedTuple):
    config_dir: Path
    data_dir: Path
    state_dir: Path
    cache_dir: Path
    runtime_dir: Path

    @property
    def config_file(self) -> Path:
        return self.config_dir / "config.toml"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def socket(self) -> Path:
        return self.runtime_dir / SOCKET_NAME

    @property
    def status_file(self) -> Path:
        return self.runtime_dir / "daemon.json"

    @property
    def daemon_lock(self) -> Path:
        """Held by the running daemon for its whole life: at most one daemon per runtime dir."""
        return self.runtime_dir / "daemon.lock"

    @property
    def spawn_lock(self) -> Path:
        """Held by a client while it starts a daemon, so two clients start only one."""
        return self.runtime_dir / "spawn.lock"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "daemon.log"

    def ensure_runtime_dir(self) -> Path:
        """Create the runtime dir private to this user (0700) and return it.

        Raise DaemonUnavailableError if it belongs to someone else (a directory planted in /tmp).
        """
        try:
            self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:  # a full disk, no inodes left, a read-only /tmp
            from phi4cli.core.atomicfile import write_problem
            from phi4cli.core.errors import DaemonUnavailableError

            why = write_problem(exc, self.runtime_dir, "set XDG_RUNTIME_DIR (or PHI4_HOME)")
            raise DaemonUnavailableError(f"cannot create {self.runtime_dir}: {why}") from None
        return self.check_runtime_dir()

    def check_runtime_dir(self) -> Path:
        """Before a client trusts anything in the runtime dir (a socket, a pid): raise
        DaemonUnavailableError unless it is a real directory of this user's (another user may
        have created ``/tmp/phi4-<uid>`` first, with a socket of theirs in it). Take back group
        and other access from a directory that is ours. A missing directory passes."""
        from phi4cli.core.errors import DaemonUnavailableError

        try:
            info = self.runtime_dir.lstat()  # lstat: a planted symlink must not pass for ours
        except FileNotFoundError:
            return self.runtime_dir
        except OSError as exc:  # a file where a directory above it should be (PHI4_HOME=a file)
            raise DaemonUnavailableError(
                f"cannot use {self.runtime_dir}: {exc.strerror}; check PHI4_HOME or XDG_RUNTIME_DIR"
            ) from None
        if info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode):
            owner = f"owned by uid {info.st_uid}" if info.st_uid != os.getuid() else "a link"
            raise DaemonUnavailableError(
                f"{self.runtime_dir} is not a directory of yours ({owner}); phi4 will not use "
                "it: remove it, or set XDG_RUNTIME_DIR"
            )
        if info.st_mode & 0o077:
            os.chmod(self.runtime_dir, 0o700)
        return self.runtime_dir


def not_private(directory: Path) -> str | None:
    """Why ``directory`` is not a private directory of this user's, or None: it must be a real
    directory (not a link), owned by this user, with no access for group or others. For what
    phi4 keeps in shared places: ``/dev/shm`` (another user who made ``phi4-<uid>`` first could
    plant a model there, or a link to your models that `phi4 cache clear` would then empty) and
    the runtime dir's remembered paths (another user's could redirect the config file)."""
    try:
        info = directory.lstat()
    except OSError as exc:
        return f"cannot use {directory}: {exc.strerror}"
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory (a link?); remove it"
    if info.st_uid != os.getuid():
        return f"{directory} belongs to uid {info.st_uid}, not you; remove it"
    if info.st_mode & 0o077:
        return f"{directory} is open to other users (mode {info.st_mode & 0o777:o}); chmod 700 it"
    return None


def peer_uid(sock: socket.socket) -> int | None:
    """Return the uid of the process at the other end of a Unix socket (None if unknowable)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def is_our_daemon(pid: int) -> bool:
    """Whether process ``pid`` is a phi4 daemon of this user's, by its /proc entry: a pid read
    from a file is never signalled on trust (the file may be stale, or planted)."""
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().split(b"\0")
    except OSError:
        return False
    named = any(b"phi4" in arg for arg in argv[:4])  # python -m phi4cli, or the phi4 script
    return owner == os.getuid() and named and b"daemon" in argv and b"run" in argv


def check_socket_path(path: Path) -> None:
    """Raise DaemonUnavailableError when ``path`` is too long to bind or connect to."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        from phi4cli.core.errors import DaemonUnavailableError

        raise DaemonUnavailableError(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter PHI4_HOME"
        )


def install_id() -> str:
    """Where this phi4 lives (the ``phi4cli`` package's directory): two installs of one version
    are still two daemons' worth. The client and the daemon both ask."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def home_root(value: str) -> str:
    """``PHI4_HOME`` as a directory: ``~`` expanded, made absolute as ``Path.absolute`` does
    (against the working directory, ``..`` kept)."""
    path = os.path.expanduser(value)
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _default_runtime_dir() -> Path:
    """The socket's directory without ``PHI4_HOME``: ``$XDG_RUNTIME_DIR/phi4`` where that is a
    writable directory, platformdirs' on macOS, else ``phi4-<uid>`` in the temporary directory
    (containers, cron jobs and ssh sessions without a session manager)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / APP_NAME
    if sys.platform == "darwin":
        from platformdirs import user_runtime_dir

        return Path(user_runtime_dir(APP_NAME))
    import tempfile

    return Path(tempfile.gettempdir()) / f"{APP_NAME}-{os.getuid()}"


# What platformdirs' answers depend on; with these unchanged, its answers are reused from a small
# file in the (private, checked) runtime dir: importing platformdirs costs a warm `phi4 solve`
# about 6 ms, more than the daemon takes to answer a short question.
_DIR_INPUTS = ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME")
_DIR_FIELDS = ("config_dir", "data_dir", "state_dir", "cache_dir")


def get_paths() -> Paths:
    """Return the paths for this process: ``$PHI4_HOME/{config,data,state,cache,run}`` if set,
    else platformdirs' (remembered in the runtime dir for as long as the environment they come
    from is the same)."""
    from phi4cli.core.config import variable

    home = variable("PHI4_HOME")
    if home:
        root = Path(home_root(home))
        return Paths(
            config_dir=root / "config",
            data_dir=root / "data",
            state_dir=root / "state",
            cache_dir=root / "cache",
            runtime_dir=root / "run",
        )
    runtime = _default_runtime_dir()
    inputs = [sys.platform, *(os.environ.get(name) for name in _DIR_INPUTS)]
    dirs = _remembered_dirs(runtime, inputs)
    if dirs is None:
        import platformdirs

        dirs = [
            Path(platformdirs.user_config_dir(APP_NAME)),
            Path(platformdirs.user_data_dir(APP_NAME)),
            Path(platformdirs.user_state_dir(APP_NAME)),
            Path(platformdirs.user_cache_dir(APP_NAME)),
        ]
        _remember_dirs(runtime, inputs, dirs)
    config, data, state, cache = dirs
    return Paths(config, data, state, cache, runtime)


def _remembered_dirs(runtime: Path, inputs: list[str | None]) -> list[Path] | None:
    # Only from a directory of this user's: another user's could redirect the config file.
    if not_private(runtime) is not None:
        return None
    import json

    try:
        with open(runtime / "dirs.json", "rb") as handle:
            saved = json.load(handle)
        if saved["inputs"] != inputs:
            return None
        return [Path(saved[field]) for field in _DIR_FIELDS]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember_dirs(runtime: Path, inputs: list[str | None], dirs: list[Path]) -> None:
    if not_private(runtime) is not None:
        return  # made by the daemon; until then platformdirs answers each time
    import json

    from phi4cli.core.atomicfile import RefusedFileError, write_atomic

    record = {"inputs": inputs, **{f: str(d) for f, d in zip(_DIR_FIELDS, dirs, strict=True)}}
    with contextlib.suppress(OSError, RefusedFileError):
        write_atomic(runtime / "dirs.json", json.dumps(record).encode())
