"""Staging the GGUF onto a RAM-backed filesystem (tmpfs), so loading never waits on a disk.

A staged copy is named by the model's name, size and mtime, so a changed model is staged anew
and an unchanged one is reused across daemon restarts. The copy is written to a temp file and
renamed, so a reader never sees half a model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from phi4cli.core.atomicfile import write_problem
from phi4cli.core.config import variable
from phi4cli.core.paths import not_private

log = logging.getLogger("phi4.ramdisk")

# Keep this much RAM free beyond the copy itself: the daemon needs memory of its own.
HEADROOM_BYTES = 512 << 20
_RAM_FILESYSTEMS = {"tmpfs", "ramfs"}


@dataclass(frozen=True)
class Staging:
    """Where the model is loaded from, and what staging did."""

    path: Path  # the file to load
    staged: bool  # True: a copy in RAM
    copied: bool  # True: copied now (False: an earlier copy was reused)
    seconds: float
    note: str | None = None  # why staging was skipped, for the log and `phi4 warm`


def ramdisk_dir() -> Path | None:
    """Return the staging directory: ``$PHI4_RAMDISK``, else ``/dev/shm/phi4-<uid>`` on Linux
    (one per user: a shared one would be 0700 to whoever made it first)."""
    configured = variable("PHI4_RAMDISK")
    if configured:
        return Path(configured)
    if sys.platform.startswith("linux") and Path("/dev/shm").is_dir():
        return Path(f"/dev/shm/phi4-{os.getuid()}")
    return None


def filesystem_type(path: Path) -> str | None:
    """Return the type of the filesystem holding ``path`` (from /proc/mounts), if known."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, best_type = mount, fields[2]
    return best_type


def _own_file(path: Path) -> bool:
    """A regular file of this user's (a staged copy we made), not a link planted in its place."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()


def staged_name(model: Path) -> str:
    stat = model.stat()
    return f"{model.stem}-{stat.st_size}-{stat.st_mtime_ns}.gguf"


def stage(model: Path, mode: str, directory: Path | None = None) -> Staging:
    """Return the path to load ``model`` from: a staged copy in RAM where possible.

    ``mode`` is ``off`` (never), ``on`` (whatever filesystem the directory is on) or ``auto``
    (only onto tmpfs). Falls back to the original file, with a note, when there is no such
    directory or not enough free space; never raises for those.
    """
    started = time.monotonic()

    def unstaged(note: str | None) -> Staging:
        if note:
            log.warning("not staging %s in RAM: %s", model.name, note)
        return Staging(model, False, False, time.monotonic() - started, note)

    if mode == "off":
        return unstaged(None)
    directory = directory or ramdisk_dir()
    if directory is None:
        return unstaged("no RAM filesystem on this system (set PHI4_RAMDISK)")
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        return unstaged(f"cannot create {directory}: {exc.strerror}")
    problem = not_private(directory)
    if problem is not None:
        return unstaged(problem)
    if mode == "auto" and filesystem_type(directory) not in _RAM_FILESYSTEMS:
        return unstaged(f"{directory} is not on tmpfs")
    target = directory / staged_name(model)
    size = model.stat().st_size
    if _own_file(target) and target.stat().st_size == size:
        return Staging(target, True, False, time.monotonic() - started)
    # Older copies of this model, but not one another daemon has loaded: a second install
    # (another PHI4_HOME) with a file of the same name would pull the first one's copy from
    # under it, leaving tmpfs held by a file nobody can see.
    remove_staged(directory, keep=None, stem=model.stem, in_use=mapped_by(directory))
    free = shutil.disk_usage(directory).free
    if free < size + HEADROOM_BYTES:
        return unstaged(
            f"{directory} has {free >> 20} MiB free; the model needs {size >> 20} MiB and "
            f"{HEADROOM_BYTES >> 20} MiB to spare"
        )
    try:
        fd, tmp = tempfile.mkstemp(
            dir=directory, prefix=f".{target.name}.{os.getpid()}.", suffix=".part"
        )
    except OSError as exc:  # a read-only or full filesystem
        return unstaged(f"cannot write in {directory}: {write_problem(exc, directory)}")
    try:
        with os.fdopen(fd, "wb") as out, model.open("rb") as source:
            shutil.copyfileobj(source, out, length=16 << 20)
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return unstaged(f"copying to {directory} failed: {write_problem(exc, directory)}")
    return Staging(target, True, True, time.monotonic() - started)


def mapped_by(directory: Path) -> dict[Path, int]:
    """Return the files under ``directory`` that a process of this user's has mapped (a daemon
    of any phi4 install, whatever its PHI4_HOME, loads its model from the staged copy), each
    with one such pid."""
    inside = str(directory.resolve()).rstrip("/") + "/"
    users: dict[Path, int] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.stat().st_uid != os.getuid():
                continue
            maps = (proc / "maps").read_text(errors="replace")
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(inside):
                users.setdefault(Path(fields[5].removesuffix(" (deleted)")), int(proc.name))
    return users


def remove_staged(
    directory: Path | None = None,
    keep: Path | None = None,
    stem: str | None = None,
    in_use: dict[Path, int] | None = None,
    failed: list[tuple[Path, OSError]] | None = None,
) -> int:
    """Delete staged copies (of the model named ``stem``, or all); return how many. Those in
    ``in_use`` are kept; those that cannot be deleted (a read-only filesystem) are left, and
    put in ``failed`` with why.

    Only in a private directory of this user's, and only regular files of theirs: never through
    a link (to, say, the models directory).
    """
    directory = directory or ramdisk_dir()
    if directory is None or not directory.is_dir():
        return 0
    problem = not_private(directory)
    if problem is not None:
        log.warning("not clearing staged models: %s", problem)
        return 0
    removed = 0
    for path in directory.glob("*.gguf"):
        if path == keep or (stem is not None and path.name.rsplit("-", 2)[0] != stem):
            continue
        if not _own_file(path) or (in_use and path.resolve() in in_use):
            continue
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            if failed is None:
                log.warning("cannot remove the staged copy %s: %s", path, exc.strerror)
            else:
                failed.append((path, exc))
    for leftover in directory.glob(".*.part"):
        if _copy_under_way(leftover):  # another daemon's, being written now
            continue
        with contextlib.suppress(OSError):
            leftover.unlink()
    return removed


_PART = re.compile(r"\.(?P<target>.+\.gguf)\.(?P<pid>\d+)\.[^.]+\.part")


def _copy_under_way(part: Path) -> bool:
    """Whether a partial copy (``.NAME.gguf.PID.XXXX.part``) is still being written: its writer
    is alive. One without a pid (an older phi4's) counts as under way for an hour."""
    found = _PART.fullmatch(part.name)
    if found is None:
        with contextlib.suppress(OSError):
            return time.time() - part.stat().st_mtime < 3600
        return False
    try:
        os.kill(int(found["pid"]), 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
