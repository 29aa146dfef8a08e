"""The problems of `phi4 eval` and their reference answers, read from a JSONL or CSV file:
each line checked (a line that is none is named), the file read again each time it is gone
through rather than held, and the problems a run still has to solve (``Pending``).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Container, Generator, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from phi4cli.core.errors import UsageError


class Item(NamedTuple):
    line: int  # in the input file (a CSV's header is line 1)
    problem: str
    reference: str


class Problems:
    """The problems and reference answers of a JSONL or CSV file, read from the file each time
    they are gone through: a file of 100,000 problems is never held at once. Lines are numbered
    as ``str.splitlines`` numbers them (a CSV's header is line 1), which the records of a
    results file say. An input that can be read only once (``<(zcat p.jsonl.gz)``, a FIFO) is
    read whole by :meth:`check` and held, as every input was before."""

    def __init__(self, path: Path, problem_field: str, answer_field: str) -> None:
        self.path, self.problem_field, self.answer_field = path, problem_field, answer_field
        self._held: list[Item] | None = None

    def check(self) -> int:
        """How many problems the file holds, read through once before anything is solved;
        UsageError naming the line of anything that is not one."""
        import stat

        try:
            once = not stat.S_ISREG(self.path.stat().st_mode)
        except OSError:
            once = False  # reading it says why it cannot be read
        if once:
            self._held = list(self._read())
        count = len(self._held) if self._held is not None else sum(1 for _ in self._read())
        if not count:
            raise UsageError(f"{self.path} holds no problems")
        return count

    def __iter__(self) -> Iterator[Item]:
        return iter(self._held) if self._held is not None else self._read()

    def _read(self) -> Iterator[Item]:
        path, problem_field, answer_field = self.path, self.problem_field, self.answer_field
        is_csv = path.suffix.lower() == ".csv"
        try:
            # A CSV's line ends are translated ("\r\n", "\r": "\n"), as read_text() did.
            # utf-8-sig: a spreadsheet's "CSV UTF-8" starts with a byte order mark, which
            # would be read as part of the first column's name.
            with (
                path.open(encoding="utf-8-sig", newline=None) if is_csv else path.open("rb")
            ) as handle:
                rows = _csv_rows(path, handle) if is_csv else _json_lines(path, handle)
                try:
                    for line, row in rows:
                        if not isinstance(row, dict):
                            raise UsageError(
                                f"{path}:{line}: expected an object with "
                                f"{problem_field!r} and {answer_field!r}"
                            )
                        problem, reference = row.get(problem_field), row.get(answer_field)
                        if not isinstance(problem, str) or not problem.strip():
                            raise UsageError(
                                f"{path}:{line}: "
                                + _missing(row, problem_field, "--problem-field", is_csv)
                            )
                        if reference is None or not str(reference).strip():
                            raise UsageError(
                                f"{path}:{line}: "
                                + _missing(row, answer_field, "--answer-field", is_csv)
                            )
                        yield Item(line, problem.strip(), str(reference).strip())
                finally:
                    rows.close()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def _missing(row: dict[str, Any], field: str, option: str, is_csv: bool) -> str:
    """Why ``row`` has no usable ``field``: empty, or not there (and what is)."""
    if field in row and row[field] is not None:
        return f"{field!r} is empty"
    if field in row:  # (a CSV row shorter than its header; JSON's null)
        return f"{field!r} is missing from this row" if is_csv else f"{field!r} is null"
    found = ", ".join(repr(str(name)) for name in row if name is not None) or "none"
    return (
        f"no {field!r} ({option} names it; {'the columns are' if is_csv else 'its fields are'}"
        f" {found})"
    )


def _csv_rows(path: Path, text: Any) -> Generator[tuple[int, Any]]:
    reader = csv.DictReader(text)
    try:
        for row in reader:
            yield reader.line_num, row
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {path}: not UTF-8 text") from None
    except csv.Error as exc:
        raise UsageError(f"{path}:{reader.line_num}: not CSV ({exc})") from None


def _json_lines(path: Path, handle: Any) -> Generator[tuple[int, Any]]:
    line = 0
    for raw in handle:
        try:
            piece = raw.decode("utf-8-sig" if line == 0 else "utf-8")  # (a byte order mark)
        except UnicodeDecodeError:
            raise UsageError(f"{path}:{line + 1}: not UTF-8 text") from None
        for text in piece.splitlines() or [""]:
            line += 1
            if text.strip():
                try:
                    yield line, json.loads(text)
                except json.JSONDecodeError as exc:
                    raise UsageError(f"{path}:{line}: not JSON ({exc.msg})") from None


class Pending:
    """The problems a run still has to solve (those not in the results file yet), read from the
    input as the run asks for them and let go once judged: what is held is the problems being
    solved, not the file."""

    def __init__(self, problems: Problems, done: Container[int], count: int) -> None:
        self._path = problems.path
        self._rest = (item for item in problems if item.line not in done)
        self._held: dict[int, Item] = {}
        self._read = 0
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> Item:
        if not 0 <= index < self._count:
            raise IndexError(index)
        while self._read <= index:
            item = next(self._rest, None)
            if item is None:
                raise UsageError(
                    f"{self._path} changed while eval read it (it holds fewer "
                    "problems now): run the same command to resume"
                )
            self._held[self._read] = item
            self._read += 1
        return self._held[index]

    @property
    def held(self) -> int:
        """How many problems are held: read, and not judged yet."""
        return len(self._held)

    def release(self, index: int) -> None:
        """Problem ``index`` is judged: it is not asked for again."""
        self._held.pop(index, None)

    def close(self) -> None:
        self._rest.close()
