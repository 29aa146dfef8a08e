"""Writing files so that a reader sees the old content or the new, never a torn mix, and reaching
the files phi4 writes and reads as this user's along a path no other user can change: nobody
else's file, link, FIFO or directory is used.

Every path is walked from ``/`` one component at a time, each directory opened with
``O_NOFOLLOW`` and checked on the open descriptor (``fstat``), and the file is then opened,
created or renamed relative to the last one (``openat``): what was checked is what is used, so
a directory swapped for a link after the check changes nothing. A directory is trusted when no
other user can rename or replace what is in it: it is yours or root's, and writable by no one
else, unless it is sticky (``/tmp``), where only an entry's owner may move it. A link on the
way is followed only when it is yours or root's. Root is trusted throughout: it can change any
file anyway, and a root-owned directory above your own (``/``, ``/home``) is the normal case.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from typing import TYPE_CHECKING, BinaryIO

from phi4cli.core.errors import Phi4Error

if TYPE_CHECKING:
    from pathlib import Path


class RefusedFileError(Phi4Error):
    """A file phi4 will not read or write: another user's, or reached through a directory or
    link another user could change (exit 1)."""


class UnwritableError(Phi4Error):
    """A file phi4 writes could not be written: the disk is full or read-only, or the directory
    is not yours to write in (exit 1). What the file held before is as it was.

    Data until the door that shows it: the file, what it is for, the error; :meth:`instead`
    adds the command's own way out (another file, a setting)."""

    def __init__(
        self,
        path: Path | str,
        what: str,
        error: OSError,
        verb: str = "write",
        instead: str | None = None,
        detail: str = "",
    ) -> None:
        self.path, self.what, self.error, self.verb = path, what, error, verb
        self.detail = detail
        super().__init__(
            f"cannot {verb} the {what} {path}: {write_problem(error, path, instead)}{detail}"
        )

    def instead(self, instead: str) -> UnwritableError:
        """The same error, saying ``instead`` as the way out beside freeing space."""
        return UnwritableError(self.path, self.what, self.error, self.verb, instead, self.detail)


# What a failed write says about the disk or the directory rather than the file's content.
DISK_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)


def write_problem(exc: OSError, path: Path | str, instead: str | None = None) -> str:
    """Why writing ``path`` failed with ``exc``, and what to do, as the end of a ``phi4:``
    line: ``no space left on /mnt: free some space there, or INSTEAD``, ``/mnt is mounted
    read-only: INSTEAD``."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        mount = mount_point(path)
        if exc.errno == errno.EDQUOT:
            problem = f"your disk quota on {mount} is used up: free some space there"
        elif _no_inodes(mount):
            problem = f"no inodes left on {mount} (too many files): remove some there"
        else:
            problem = f"no space left on {mount}: free some space there"
        return problem + (f", or {instead}" if instead else "")
    if exc.errno == errno.EROFS:
        problem = f"{mount_point(path)} is mounted read-only"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        problem = f"permission denied: you may not write {path} (or in its directory)"
    elif exc.errno == errno.EFBIG:
        problem = f"the file would be larger than {mount_point(path)} allows"
    else:
        problem = exc.strerror or str(exc)
    return problem + (f": {instead}" if instead else "")


def _no_inodes(mount: str) -> bool:
    """Whether the filesystem at ``mount`` is out of inodes (files), not of space."""
    try:
        disk = os.statvfs(mount)
    except OSError:
        return False
    return disk.f_files > 0 and disk.f_favail == 0 and disk.f_bavail > 0


def mount_point(path: Path | str) -> str:
    """The directory where the filesystem that holds ``path`` (or would hold it: its nearest
    existing directory) is mounted."""
    here = os.path.abspath(path)
    while not os.path.lexists(here) and here != "/":
        here = os.path.dirname(here)
    while here != "/" and not os.path.ismount(here):
        here = os.path.dirname(here)
    return here


def write_atomic(path: Path, data: bytes, mode: int = 0o600, what: str = "file") -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and an atomic rename.

    Raise RefusedFileError when a directory on the way is another user's, or writable by
    others (see the module's docstring); OSError when the disk is full, say."""
    directory, name = _reach(path, what, "write", create=True, follow_last=False)
    try:
        fd, tmp = _create_temp(directory, name)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fchmod(fd, mode)
                os.fsync(fd)
            os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=directory)
            raise
    finally:
        os.close(directory)


def read_user_file(path: Path, what: str) -> bytes:
    """Return what is in ``path``, a file phi4 keeps for this user (its config, a chat, the
    input history), as ssh reads its config.

    Raise FileNotFoundError when there is none; RefusedFileError, one line saying why and what
    to do, when it is not a regular file, belongs to another user (root excepted), or is
    writable by another user, or a directory or link on the way is another user's or writable
    by others. A link of yours (a config kept with your dotfiles) is followed."""
    directory, name = _reach(path, what, "read", create=False, follow_last=True)
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory
        )
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _refused(path, what, exc, "read") from None
    finally:
        os.close(directory)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        problem = "is not a regular file" if not stat.S_ISREG(info.st_mode) else changeable(info)
        if problem is not None:
            raise RefusedFileError(
                f"the {what} {path} {problem}; phi4 will not read it: {_remedy(problem)}"
            )
        return handle.read()


# Where phi4 writes next to a path the user gave (`phi4 eval`'s results file beside its input,
# or `-o PATH`), the directory may be shared (/tmp): another user may have put a link there
# first, to have phi4 write into a file of yours, a FIFO that would hang it, or a file of forged
# records for it to believe. O_NOFOLLOW refuses the link, O_NONBLOCK keeps a FIFO's open from
# blocking until fstat has said what the file is, and O_EXCL makes a fresh file ours alone.
_USER_FILE_FLAGS = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_user_file(path: Path, what: str) -> BinaryIO:
    """Return ``path`` open to read and to append to, created 0600 if it does not exist.

    Raise RefusedFileError, with one line naming ``what`` the file is for and what to do, when
    it is a symbolic link, not a regular file, another user's, a hard link (another user may
    link a file of yours into /tmp), or writable by group or others (anyone else could have
    written into it), when a directory on the way is another user's or writable by others, or
    when it cannot be opened at all; UnwritableError when that is because the disk is full or
    read-only, or the directory not yours to write in. Nothing is read through a link and
    opening never blocks.
    """
    directory, name = _reach(path, what, "create", create=True, follow_last=False)
    try:
        fd = _open_or_create(directory, name, path, what)
    finally:
        os.close(directory)
    try:
        problem = not_ours(os.fstat(fd))
        if problem is not None:
            remedy = "chmod go-w it" if "writable" in problem else "remove it"
            raise RefusedFileError(
                f"the {what} {path} {problem}; phi4 will not use it: {remedy}, or name another file"
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "r+b")
    except BaseException:
        os.close(fd)
        raise


def _open_or_create(directory: int, name: str, path: Path, what: str) -> int:
    for _attempt in range(3):
        try:
            return os.open(name, _USER_FILE_FLAGS, dir_fd=directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _refused(path, what, exc) from None
        try:
            return os.open(name, _USER_FILE_FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=directory)
        except FileExistsError:
            continue  # made between the two opens (a dangling link, maybe): look at it again
        except OSError as exc:
            raise _refused(path, what, exc, "create") from None
    raise RefusedFileError(f"cannot open the {what} {path}: it keeps changing; use another")


def replace_user_file(path: Path, what: str, data: bytes) -> BinaryIO:
    """Put a new 0600 file holding ``data`` at ``path`` in place of whatever is there (a link is
    replaced, never written through), atomically, and return it open to append to. Raise
    RefusedFileError when it cannot (another user's file in a sticky directory such as /tmp,
    or a directory on the way that another user could change), UnwritableError when the disk
    is full or read-only or the directory not yours to write in: then nothing has changed."""
    directory, name = _reach(path, what, "create", create=True, follow_last=False)
    try:
        try:
            fd, tmp = _create_temp(directory, name)
        except OSError as exc:
            raise _refused(path, what, exc, "create") from None
        handle = os.fdopen(fd, "r+b")
        try:
            handle.write(data)
            handle.flush()
            os.fsync(fd)
            os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException as exc:
            with contextlib.suppress(OSError):  # (its flush fails again on a full disk)
                handle.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=directory)
            if isinstance(exc, OSError):
                raise _refused(path, what, exc, "replace") from None
            raise
        return handle
    finally:
        os.close(directory)


def not_ours(info: os.stat_result) -> str | None:
    """Why the file ``info`` describes is not one phi4 may trust as this user's, or None: the
    strict test for a file phi4 made itself (0600) in a place others may share."""
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


def changeable(info: os.stat_result) -> str | None:
    """Why another user could change the file or directory ``info`` describes, or None: it
    belongs to someone but you and root, or is writable by others (a sticky directory excepted:
    there only an entry's owner may rename or remove it), or by a group with anyone but you in
    it (a group of your own, as umask 002 systems give each user, is fine; as Debian's ssh)."""
    if info.st_uid not in (os.getuid(), 0):
        return f"belongs to uid {info.st_uid}, not you"
    if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
        return None
    mode = info.st_mode & 0o7777
    if mode & 0o002:
        return f"is writable by other users (mode {mode:o})"
    if mode & 0o020 and not _group_of_yours_alone(info.st_gid):
        return f"is writable by group {_group_name(info.st_gid)}, not only by you (mode {mode:o})"
    return None


_GROUPS_OF_ONE: dict[int, bool] = {}


def _group_of_yours_alone(gid: int) -> bool:
    """Whether group ``gid`` has you as a member and nobody else (primary or supplementary)."""
    if gid not in _GROUPS_OF_ONE:
        import grp
        import pwd

        uid = os.getuid()
        try:
            group, me = grp.getgrgid(gid), pwd.getpwuid(uid)
        except KeyError:  # a group or user no database names: its members cannot be told
            _GROUPS_OF_ONE[gid] = False
            return False
        primary = {entry.pw_uid for entry in pwd.getpwall() if entry.pw_gid == gid}
        others = primary - {uid} or set(group.gr_mem) - {me.pw_name}
        _GROUPS_OF_ONE[gid] = not others and (uid in primary or me.pw_name in group.gr_mem)
    return _GROUPS_OF_ONE[gid]


def _group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


class _Untrusted(Exception):
    """A directory or link on the way that another user could change."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(where, problem)
        self.where, self.problem = where, problem


# O_PATH: a directory is reached with search permission alone, as a path lookup needs.
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # as the kernel allows in one lookup
_MAX_SWAPS = 3  # a directory changed for a link between its stat and its open


def _reach(path: Path, what: str, verb: str, *, create: bool, follow_last: bool) -> tuple[int, str]:
    """Return a descriptor of the directory that holds ``path``'s last component (the caller
    closes it) and that component's name, each directory on the way opened with O_NOFOLLOW
    from the one before and checked (:func:`changeable`); a link on the way is followed when
    it is yours or root's, the last component too when ``follow_last``. Missing directories
    are made (mode 777 less the umask) when ``create``.

    Raise RefusedFileError naming the directory or link another user could change, or what is
    not a directory; other OSErrors, for ``verb`` "create" (a user-given path), as
    UnwritableError (a full or read-only disk) or RefusedFileError, else as they are
    (FileNotFoundError when not ``create``; a full disk)."""
    try:
        return _walk(os.fspath(path), create, follow_last)
    except _Untrusted as untrusted:
        where, problem = untrusted.where, untrusted.problem
        remedy = (
            f"chmod go-w {where}, or use a directory of yours"
            if "writable" in problem
            else "use a directory of yours"
        )
        raise RefusedFileError(
            f"{where} {problem}, so another user could change what the {what} {path} is; phi4 "
            f"will not {verb} it there: {remedy}"
        ) from None
    except NotADirectoryError as exc:
        if not create:
            raise
        raise RefusedFileError(
            f"cannot {verb} the {what} {path}: {exc.filename}: it is not a directory"
        ) from None
    except OSError as exc:
        if verb != "create":
            raise
        if exc.errno in DISK_ERRNOS:
            raise UnwritableError(path, what, exc, verb) from None
        raise RefusedFileError(
            f"cannot {verb} the {what} {path}: {exc.filename}: {exc.strerror}"
        ) from None


def _walk(text: str, create: bool, follow_last: bool) -> tuple[int, str]:
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    stack = [(os.open("/", _DIR_FLAGS), "/")]  # the directories reached, each as it is named
    try:
        found = _descend(stack, _parts(text), create, follow_last)
    except BaseException:
        for fd, _shown in stack:
            os.close(fd)
        raise
    for fd, _shown in stack:
        if fd != found[0]:
            os.close(fd)
    return found


def _descend(
    stack: list[tuple[int, str]], pending: list[str], create: bool, follow_last: bool
) -> tuple[int, str]:
    problem = changeable(os.fstat(stack[0][0]))
    if problem is not None:
        raise _Untrusted("/", problem)
    links = swaps = 0
    while pending:
        name = pending.pop(0)
        if name == "..":
            if len(stack) > 1:
                os.close(stack.pop()[0])
            continue
        directory, shown = stack[-1]
        here = os.path.join(shown, name)
        last = not pending
        if last and not follow_last:
            return directory, name
        try:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            if last:
                return directory, name
            if not create:
                raise
            with contextlib.suppress(FileExistsError):  # made meanwhile: looked at below
                os.mkdir(name, 0o777, dir_fd=directory)
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (os.getuid(), 0):
                raise _Untrusted(here, f"is a symbolic link of uid {info.st_uid}'s")
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), here)
            target = os.readlink(name, dir_fd=directory)
            if target.startswith("/"):
                while len(stack) > 1:
                    os.close(stack.pop()[0])
            pending[:0] = _parts(target)
            continue
        if last:
            return directory, name
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), here)
        try:
            stack.append((os.open(name, _DIR_FLAGS, dir_fd=directory), here))
        except OSError as exc:  # swapped for a link or a file since the stat: look again
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or swaps >= _MAX_SWAPS:
                raise
            swaps += 1
            pending.insert(0, name)
            continue
        problem = changeable(os.fstat(stack[-1][0]))
        if problem is not None:
            raise _Untrusted(here, problem)
    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), stack[-1][1])


def _parts(text: str) -> list[str]:
    return [part for part in text.split("/") if part not in ("", ".")]


def _create_temp(directory: int, name: str) -> tuple[int, str]:
    """A new 0600 file beside ``name`` in ``directory``, open to read and write, and its name."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _attempt in range(100):
        tmp = f".{name}.{os.urandom(6).hex()}.tmp"
        try:
            return os.open(tmp, flags, 0o600, dir_fd=directory), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", name)


def _remedy(problem: str) -> str:
    if "writable" in problem:
        return "chmod go-w it"
    if "belongs to" in problem:
        return "remove it if you did not put it there, or chown it to yourself"
    return "remove it"


def _refused(path: Path, what: str, exc: OSError, verb: str = "open") -> Phi4Error:
    """The error for ``exc`` on opening (or creating, replacing: to write) ``path``: an
    UnwritableError where the disk or the directory is the reason, else a RefusedFileError."""
    if exc.errno == errno.ELOOP:
        through = "read" if verb == "read" else "write"
        return RefusedFileError(
            f"the {what} {path} is a symbolic link; phi4 will not {through} through it: remove it"
        )
    if verb != "read" and exc.errno in DISK_ERRNOS:
        return UnwritableError(path, what, exc, verb)
    return RefusedFileError(f"cannot {verb} the {what} {path}: {exc.strerror}")
