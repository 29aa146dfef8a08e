"""Problems as they come in: a file, stdin, or the lines of a pipe, read as the run goes (a
window ahead of what is printed), each line checked as text before it is sent."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from phi4cli.client.environment import Environment
from phi4cli.core.errors import UsageError
from phi4cli.core.protocol import ErrorCode, Event, SolveParams

AHEAD = 4096  # problems read ahead of the last one printed, at most (more than any window)


NO_PROBLEMS = "no problems: the input has no non-blank lines"


class ProblemFeed(Sequence["SolveParams | Event"]):  # a string: typing is not imported to run
    """The non-blank lines of a file or of stdin, each a problem, read as the run goes: a pipe's
    first problems are answered while its later lines are still being written, and a file of a
    million lines is never held at once (at most :data:`AHEAD` problems ahead of the output).

    It is the run's list of requests, growing as lines come (``len`` is what has come so far,
    ``ended`` once the input has), and the flight's :class:`~phi4cli.backends.dispatch.Feed`. Lines
    are numbered as ``str.splitlines`` numbers them. A line of a pipe that is not UTF-8 is that
    problem's error (the lines before it were already on their way); a file's, and a file's on
    stdin, are refused before anything is sent (:func:`open_problems`).
    """

    def __init__(self, source: Any, where: str, make: Callable[[str], SolveParams]) -> None:
        import threading

        self.where, self._make = where, make
        self.numbers: list[int] = []  # the input line of each problem
        self._texts: list[str | Event | None] = []  # None once printed
        self.total = 0  # lines read, blank ones too
        self.ended = False
        self.failure: str | None = None  # why the input could not be read to its end
        self._printed = 0
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._read, args=(source,), daemon=True, name="phi4-input"
        )
        self._thread.start()

    def _read(self, source: Any) -> None:
        try:
            for number, text in _numbered(source, self.where):
                self.total = number
                if isinstance(text, str) and not text.strip():
                    continue
                with self._changed:
                    while len(self.numbers) - self._printed >= AHEAD:
                        self._changed.wait()
                    # The text first: the flight reads len() (the numbers), then the text.
                    self._texts.append(text.strip() if isinstance(text, str) else text)
                    self.numbers.append(self.total)
                    self._changed.notify_all()
        except OSError as exc:
            self.failure = f"cannot read {self.where}: {exc.strerror or exc}"
        except Exception as exc:  # whatever stops the reading, the run must not pass for whole
            self.failure = f"cannot read {self.where} to its end: {type(exc).__name__}: {exc}"
        finally:
            with self._changed:
                self.ended = True
                self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        with self._changed:
            if not self.ended:
                self._changed.wait(timeout)

    def __len__(self) -> int:
        return len(self.numbers)

    def question(self, index: int) -> str:
        text = self._texts[index]
        return text if isinstance(text, str) else ""

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        text = self._texts[index]
        assert text is not None, "a problem is not asked again once it is printed"
        return text if isinstance(text, Event) else self._make(text)

    def printed(self, index: int) -> None:
        """Problem ``index`` is printed: its text is let go, and the reader may go on."""
        with self._changed:
            self._texts[index] = None
            self._printed += 1
            self._changed.notify_all()


def _numbered(source: Any, where: str) -> Iterator[tuple[int, str | Event]]:
    """(line number, line or its error event) for each line of ``source``, an iterable of
    ``\\n``-ended pieces, as ``str.splitlines`` numbers them."""
    number = 0
    for raw in source:
        for text in _lines_of(raw, where, number + 1):
            number += 1
            yield number, text


def _lines_of(raw: bytes | str, where: str, number: int) -> list[str | Event]:
    """The lines of one ``\\n``-ended piece of input: more than one where it holds another line
    break that ``str.splitlines`` knows (``\\r``, form feed, ...), an error event for one that is
    not UTF-8."""
    from phi4cli.core.inputs import HOW_TO_FIX, check_text

    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            message = (
                f"{where} line {number} is not valid UTF-8 (byte 0x{raw[exc.start]:02x}): "
                f"{HOW_TO_FIX}"
            )
            return [Event.error(ErrorCode.BAD_REQUEST, message)]
    else:
        try:
            text = check_text(raw, f"{where} line {number}")
        except UsageError as exc:
            return [Event.error(ErrorCode.BAD_REQUEST, str(exc))]
    return list(text.splitlines() or [""])


def raw_lines(stream: Any) -> Any:
    """The ``\\n``-ended pieces of a pipe, read from its file descriptor rather than through
    Python's buffered reader (nothing has read from it yet): a reader thread blocked there holds
    that reader's lock, which a close or the interpreter's exit would wait on (or abort on). A
    stream without one (a test's StringIO) is read as it is."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream

    def pieces() -> Any:
        rest = b""
        while chunk := os.read(fd, 65536):
            *lines, rest = (rest + chunk).split(b"\n")
            yield from (line + b"\n" for line in lines)
        if rest:
            yield rest

    return pieces()


class Opened(NamedTuple):
    """The input of ``--file``: lines to read, what to call it in messages, how many problems
    it holds if that is known before the run, and whether it is ours to close."""

    stream: Any
    where: str
    known: int | None
    owned: bool


def open_problems(source: str, env: Environment) -> Opened:
    """The input of ``--file`` to read lines from, what to call it, and how many problems it
    holds when that is known before the run (a regular file: checked to its end first, so one
    that is not UTF-8 is refused, exit 2, before any daemon is started; a pipe: None)."""
    import stat

    owned = source != "-"
    if not owned:
        stream, where = getattr(env.stdin, "buffer", env.stdin), "stdin"
    else:
        where = source
        try:
            stream = open(source, "rb")  # noqa: SIM115 (closed when the run ends)
        except OSError as exc:
            raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    try:
        regular = stat.S_ISREG(os.fstat(stream.fileno()).st_mode) and stream.seekable()
    except (AttributeError, OSError, ValueError):
        regular = False  # a test's StringIO, say
    if not regular:
        return Opened(stream, where, None, owned)
    try:
        start = stream.tell()
        problems = 0
        for _number, text in _numbered(stream, where):
            if isinstance(text, Event):
                raise UsageError(text.message)
            problems += bool(text.strip())
        if not problems:
            raise UsageError(NO_PROBLEMS)
        stream.seek(start)
    except BaseException:
        if owned:
            stream.close()
        raise
    return Opened(stream, where, problems, owned)
