"""Writing files so that a reader sees the old content or the new, never a torn mix, and
opening files beside user-given paths so that nobody else's file, link or FIFO is used."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path

from phi4cli.errors import Phi4Error

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import BinaryIO


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# Where phi4 writes next to a path the user gave (`phi4 eval`'s results file beside its input,
# or `-o PATH`), the directory may be shared (/tmp): another user may have put a link there
# first, to have phi4 write into a file of yours, a FIFO that would hang it, or a file of forged
# records for it to believe. O_NOFOLLOW refuses the link, O_NONBLOCK keeps a FIFO's open from
# blocking until fstat has said what the file is, and O_EXCL makes a fresh file ours alone.
_USER_FILE_FLAGS = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RefusedFileError(Phi4Error):
    """A file beside a user-given path that phi4 will not read or write (exit 1)."""


def open_user_file(path: Path, what: str) -> BinaryIO:
    """Return ``path`` open to read and to append to, created 0600 if it does not exist.

    Raise RefusedFileError, with one line naming ``what`` the file is for and what to do, when
    it is a symbolic link, not a regular file, another user's, a hard link (another user may
    link a file of yours into /tmp), or writable by group or others (anyone else could have
    written into it), or cannot be opened at all. Nothing is read through a link and opening
    never blocks.
    """
    _make_parent(path, what)
    fd = -1
    for _attempt in range(3):
        try:
            fd = os.open(path, _USER_FILE_FLAGS)
            break
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise RefusedFileError(_refusal(path, what, exc)) from None
        try:
            fd = os.open(path, _USER_FILE_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
            break
        except FileExistsError:
            continue  # made between the two opens (a dangling link, maybe): look at it again
        except OSError as exc:
            raise RefusedFileError(_refusal(path, what, exc)) from None
    if fd < 0:
        raise RefusedFileError(f"cannot open the {what} {path}: it keeps changing; use another")
    try:
        problem = not_ours(os.fstat(fd))
        if problem is not None:
            remedy = "chmod go-w it" if "writable" in problem else "remove it"
            raise RefusedFileError(f"the {what} {path} {problem}; phi4 will not use it: "
                                   f"{remedy}, or name another file")  # fmt: skip
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "r+b")
    except BaseException:
        os.close(fd)
        raise


def replace_user_file(path: Path, what: str, data: bytes) -> BinaryIO:
    """Put a new 0600 file holding ``data`` at ``path`` in place of whatever is there (a link is
    replaced, never written through), atomically, and return it open to append to. Raise
    RefusedFileError when it cannot (another user's file in a sticky directory such as /tmp)."""
    _make_parent(path, what)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise RefusedFileError(_refusal(path, what, exc, "create")) from None
    handle = os.fdopen(fd, "r+b")
    try:
        handle.write(data)
        handle.flush()
        os.fsync(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        handle.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise RefusedFileError(_refusal(path, what, exc, "replace")) from None
        raise
    return handle


def not_ours(info: os.stat_result) -> str | None:
    """Why the file ``info`` describes is not one phi4 may trust as this user's, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.getuid():
        return f"belongs to uid {info.st_uid}, not you"
    if info.st_nlink != 1:  # another name for it, made by anyone: ~/.bashrc, say
        return f"has {info.st_nlink - 1} other name(s) (hard links)"
    if info.st_mode & 0o022:
        return f"is writable by other users (mode {info.st_mode & 0o777:o})"
    return None


def _make_parent(path: Path, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = "it is not a directory" if isinstance(exc, FileExistsError) else exc.strerror
        raise RefusedFileError(
            f"cannot create the {what} {path}: {path.parent}: {reason}"
        ) from None


def _refusal(path: Path, what: str, exc: OSError, verb: str = "open") -> str:
    if exc.errno == errno.ELOOP:
        return f"the {what} {path} is a symbolic link; phi4 will not write through it: remove it"
    return f"cannot {verb} the {what} {path}: {exc.strerror}"
