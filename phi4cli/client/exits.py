"""How the ``phi4`` process ends: the one printer of ``phi4:`` lines on stderr, the documented exit
status for whatever a command raised (``run_reporting``, as httpie's ``main`` around its
``program``), and the fast exit that skips the interpreter's teardown. Below ``entry`` and
``cli``, which both end here."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import NoReturn, TextIO

from phi4cli.backends.dispatch import Announce as Announce  # what says a line to the user


def notice_line(message: str) -> str:
    """A ``phi4:`` line as it is shown: cleaned, since an error's text may carry a model's or a
    remote server's words."""
    from phi4cli.text.sanitize import clean_text

    return f"phi4: {clean_text(message)}"


def say(message: str, file: TextIO | None = None) -> None:
    """One ``phi4:`` line on stderr (or ``file``): the one printer of such lines (an
    ``Environment`` prints its notices through it too)."""
    print(notice_line(message), file=file or sys.stderr, flush=True)


def reader_gone(stream: TextIO | None) -> bool:
    """Whether the reader at the other end of ``stream`` (a pipe or a socket) has gone away, as
    with ``| head -1`` or ``| true``: writes to it fail with EPIPE. False for a stream with no
    file under it, a file or a terminal."""
    import select

    try:
        fd = stream.fileno() if stream is not None else -1
        if fd < 0:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return False


def quiet_stdout(stream: TextIO) -> None:
    """Point ``stream``'s file at /dev/null, so that what is left in its buffer, and the flush at
    exit, go nowhere instead of raising BrokenPipeError again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def exit_now(status: int) -> NoReturn:
    """Exit without the interpreter's teardown: flush what was written, then leave.

    Tearing down the modules a solve imported takes longer than the daemon takes to answer a
    short question (about 5 ms here), and a finished `phi4 solve` has nothing left to clean up:
    its files are closed and it starts no threads that outlive the answer. Only for the ``phi4``
    program itself, never in-process callers (tests, ``python -m`` embedding)."""
    for stream in (sys.stdout, sys.stderr):
        # A reader that went away, or a closed stream (None when it was closed at start-up, as
        # by `2>&-`): nothing more can be said.
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(status)


def run_reporting(run: Callable[[], int | None], fast_exit: bool = False) -> NoReturn:
    """Run a command and exit with the documented status for whatever happened (with
    ``fast_exit``, skipping the interpreter's teardown: see ``exit_now``)."""
    status = report(run, sys.stdout, sys.stderr, reraise=_debug)
    if fast_exit:
        exit_now(status)
    sys.exit(status)


def report(
    run: Callable[[], int | None],
    stdout: TextIO | None,
    stderr: TextIO,
    reraise: Callable[[], bool] = lambda: False,
) -> int:
    """Run a command; return the documented exit status for whatever happened, having said
    on ``stderr`` what went wrong (a traceback too with ``PHI4_DEBUG``). An unexpected error is
    raised instead where ``reraise()`` says so (the ``phi4`` process: Python prints it)."""
    from phi4cli.core.errors import ExitStatus, Phi4Error

    try:
        try:
            code = run()
            if stdout is not None:  # None: closed when the command started (`>&-`)
                stdout.flush()
        except BrokenPipeError:
            if not reader_gone(stdout):
                raise  # (another pipe's: an error like any other)
            # The reader of stdout went away (`| head -1`): what it wanted it has. Exit 0, as
            # the README says, and quietly.
            assert stdout is not None
            quiet_stdout(stdout)
            return ExitStatus.OK
        return code if isinstance(code, int) else ExitStatus.OK
    except KeyboardInterrupt:
        print(file=stderr)
        return ExitStatus.INTERRUPTED
    except Phi4Error as exc:
        if _debug():
            import traceback

            traceback.print_exc(file=stderr)
        say(f"error: {exc}", file=stderr)
        return exc.exit_status
    except Exception as exc:
        problem = output_problem(exc, stdout)
        if problem is not None:  # (stdout on a full disk: an error like any other, said as one)
            if _debug():
                import traceback

                traceback.print_exc(file=stderr)
            say(f"error: {problem}", file=stderr)
            assert stdout is not None
            quiet_stdout(stdout)
            return ExitStatus.ERROR
        if reraise():
            raise
        if _debug():
            import traceback

            traceback.print_exc(file=stderr)
        say(
            f"internal error: {type(exc).__name__}: {exc} (PHI4_DEBUG=1 shows the traceback)",
            file=stderr,
        )
        return ExitStatus.ERROR


def output_problem(exc: BaseException, stdout: TextIO | None) -> str | None:
    """What to say when ``exc`` is stdout's write failing for want of space or permission
    (``phi4 solve ... > out.txt`` on a full disk, ``> /dev/full``), else None."""
    from phi4cli.core.atomicfile import DISK_ERRNOS, write_problem

    if (
        not isinstance(exc, OSError)
        or exc.errno not in DISK_ERRNOS
        or exc.filename is not None
        or stdout is None
        or not _refuses(stdout, exc.errno)
    ):
        return None
    import stat

    try:
        fd = stdout.fileno()
        where = os.readlink(f"/proc/self/fd/{fd}")
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except (OSError, ValueError):
        where, regular = "standard output", False
    instead = "send it elsewhere"
    why = write_problem(exc, where, instead) if regular else f"{exc.strerror}: {instead}"
    return f"cannot write the output to {where}: {why}"


def _refuses(stdout: TextIO, code: int) -> bool:
    """Whether writing to ``stdout`` fails with error ``code``: flushing it fails again so
    (what could not be written is still in its buffer), or, unbuffered (PYTHONUNBUFFERED),
    its file is on a full or read-only filesystem, or is /dev/full."""
    import errno

    try:
        stdout.flush()
    except OSError as again:
        return again.errno == code
    except ValueError:  # closed
        return False
    try:
        fd = stdout.fileno()
        info = os.fstat(fd)
        if info.st_rdev and info.st_rdev == os.makedev(1, 7):  # /dev/full
            return code == errno.ENOSPC
        disk = os.fstatvfs(fd)
    except (OSError, ValueError):
        return False
    if code == errno.EROFS:
        return bool(disk.f_flag & os.ST_RDONLY)
    return code == errno.ENOSPC and disk.f_bavail == 0


def _debug() -> bool:
    from phi4cli.core.config import variable

    return bool(variable("PHI4_DEBUG"))
