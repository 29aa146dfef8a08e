"""The history: every answer phi4 gives here (a solve, a sample of one, a chat turn, an eval
problem) kept in a SQLite database in the user's data directory, written as each answer
finishes, for `phi4 history` to list, search, show and delete.

- **Private.** The file is 0600 in a 0700 directory of its own (``data/history/``): questions
  and answers are the user's.
- **Several clients at once.** The database is in WAL mode and a writer waits a few seconds for
  another; a record that still cannot be written is skipped, said in one line, and this process
  keeps no more (so a busy or full disk costs one wait, not one at every answer).
- **Bounded.** The newest ``MAX_ENTRIES`` records are kept; older ones go as new ones come. Ids
  are never reused.
- **A damaged database never blocks a solve.** A file that is not a database or is malformed
  (not one that is busy, read-only or on a full disk) is moved aside
  (``history.db.damaged-TIME``), said in one line, and a new one is started.
- **Off** with ``--no-history`` or the setting ``history = false`` (``PHI4_HISTORY=0``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from phi4cli.backends.outcome import Outcome
    from phi4cli.client.environment import Environment

FILE_NAME = "history.db"
MAX_ENTRIES = 10_000
PRUNE_EVERY = 100  # records written between two prunes
BUSY_S = 5.0  # how long a write waits for another client's
KINDS = ("solve", "sample", "chat", "eval")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    question TEXT NOT NULL,
    thinking TEXT NOT NULL DEFAULT '',
    solution TEXT NOT NULL DEFAULT '',
    answer TEXT,
    verdict TEXT,
    model TEXT,
    session TEXT,
    settings TEXT NOT NULL DEFAULT '{}',
    stats TEXT NOT NULL DEFAULT '{}',
    error TEXT
);
CREATE INDEX IF NOT EXISTS entries_at ON entries (at);
"""
# Full-text search over question, solution and answer, kept in step by triggers (where this
# SQLite has FTS5; without it a search reads the rows with LIKE).
_FTS = """
CREATE VIRTUAL TABLE IF NOT EXISTS entries_fts USING fts5(
    question, solution, answer, content='entries', content_rowid='id'
);
CREATE TRIGGER IF NOT EXISTS entries_added AFTER INSERT ON entries BEGIN
    INSERT INTO entries_fts (rowid, question, solution, answer)
    VALUES (new.id, new.question, new.solution, coalesce(new.answer, ''));
END;
CREATE TRIGGER IF NOT EXISTS entries_removed AFTER DELETE ON entries BEGIN
    INSERT INTO entries_fts (entries_fts, rowid, question, solution, answer)
    VALUES ('delete', old.id, old.question, old.solution, coalesce(old.answer, ''));
END;
"""
_COLUMNS = (
    "id, at, kind, question, thinking, solution, answer, verdict, model, session, settings, "
    "stats, error"
)


class Entry(NamedTuple):
    """One answer as the history keeps it."""

    id: int
    at: float  # when it finished (seconds since the epoch)
    kind: str  # solve, sample, chat or eval
    question: str
    thinking: str
    solution: str
    answer: str | None
    verdict: str | None  # the answer check's, where there was one
    model: str | None
    session: str | None  # a chat's name, an eval's problems file
    settings: dict[str, Any]  # what it was asked with (the request's ask)
    stats: dict[str, Any]
    error: str | None  # how it failed, if it did

    def to_json(self) -> dict[str, Any]:
        return self._asdict()


class HistoryError(Exception):
    """The history could not be read or changed (for `phi4 history`: one line)."""


class History:
    """The history database. ``add`` says a failure in one line (``notice``) and goes on, and
    never raises; the readers and ``delete`` raise HistoryError."""

    def __init__(self, path: Path, notice: Callable[[str], None]) -> None:
        self.path = path
        self._notice = notice
        self._connection: sqlite3.Connection | None = None
        self._fts = False
        self._written = 0
        self._failed = False  # a record could not be written (said once)

    # --- opening ----------------------------------------------------------------------------

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def _connect(self) -> sqlite3.Connection:
        if self._connection is not None:
            return self._connection
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(OSError):
            os.chmod(self.path.parent, 0o700)  # (its own directory: nothing else is in it)
        try:
            connection = self._open()
        except sqlite3.DatabaseError as exc:
            if not _damaged(exc):  # busy, a full disk, read-only: nothing wrong with the file
                raise
            self._move_aside(exc)
            connection = self._open()
        self._connection = connection
        return connection

    def _move_aside(self, exc: sqlite3.DatabaseError) -> None:
        """The file is damaged: move it (and its WAL) aside, say so; raise ``exc`` when it
        cannot be moved."""
        self.close()
        aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
        try:
            self.path.rename(aside)
        except OSError:
            raise exc from None
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(OSError):
                Path(f"{self.path}{suffix}").rename(f"{aside}{suffix}")
        self._notice(
            f"the history database {self.path} could not be read ({exc}); "
            f"it was moved to {aside.name} and a new one started"
        )

    def _open(self) -> sqlite3.Connection:
        fresh = not self.path.exists()
        if fresh:  # created private, before SQLite opens it
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        connection = sqlite3.connect(self.path, timeout=BUSY_S, isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode = WAL")
            # (Synced at checkpoints: an answer's record is not worth an fsync each.)
            connection.execute("PRAGMA synchronous = NORMAL")
            connection.executescript(_SCHEMA)
            try:
                had_index = connection.execute(
                    "SELECT 1 FROM sqlite_master WHERE name = 'entries_fts'"
                ).fetchone()
                connection.executescript(_FTS)
                if not had_index:  # (rows written where SQLite had no FTS5 are indexed now)
                    connection.execute("INSERT INTO entries_fts (entries_fts) VALUES ('rebuild')")
                self._fts = True
            except sqlite3.OperationalError as exc:
                if "fts5" not in str(exc):
                    raise
                self._fts = False
            connection.execute("SELECT count(*) FROM entries").fetchone()
        except BaseException:
            connection.close()
            raise
        with contextlib.suppress(OSError):
            os.chmod(self.path, 0o600)
        return connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    # --- writing ----------------------------------------------------------------------------

    def add(
        self,
        kind: str,
        outcome: Outcome,
        settings: dict[str, Any],
        model: str | None = None,
        session: str | None = None,
    ) -> int | None:
        """Keep ``outcome`` (its question, thinking, solution, answer, check, stats); return its
        id, or None where it could not be written (said in one line, once: after a failure
        this process keeps no more)."""
        if self._failed:
            return None
        stats = outcome.stats_dict
        row = (
            time.time(),
            kind,
            _text(outcome.question),
            _text(outcome.reasoning),
            _text(outcome.solution),
            _text(outcome.answer),
            outcome.check.verdict if outcome.check is not None else None,
            (outcome.stats.model if outcome.stats is not None else None) or model,
            session,
            json.dumps(settings, default=str),
            json.dumps(stats, default=str),
            _text(outcome.error.said) if outcome.error is not None else None,
        )
        try:
            return self._insert(row)
        except sqlite3.DatabaseError as exc:
            if _damaged(exc):
                try:  # damaged past its first pages: found only now
                    self._move_aside(exc)
                    return self._insert(row)
                except (sqlite3.Error, OSError, ValueError) as again:
                    exc = again  # type: ignore[assignment]
            self._could_not(exc)
        except (sqlite3.Error, OSError, ValueError) as exc:
            self._could_not(exc)
        return None

    def _could_not(self, exc: Exception) -> None:
        self._failed = True
        self._notice(f"answers are not kept in the history now ({_reason(exc)})")

    def _insert(self, row: tuple[Any, ...]) -> int | None:
        connection = self._connect()
        cursor = connection.execute(
            "INSERT INTO entries (at, kind, question, thinking, solution, answer, verdict, "
            "model, session, settings, stats, error) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            row,
        )
        entry_id = cursor.lastrowid
        if entry_id is not None and entry_id % PRUNE_EVERY == 0:
            self.prune()
        return entry_id

    def prune(self, keep: int = MAX_ENTRIES) -> int:
        """Delete the records older than the newest ``keep`` ids; return how many went."""
        connection = self._connect()
        cursor = connection.execute(
            "DELETE FROM entries WHERE id <= (SELECT max(id) FROM entries) - ?", (keep,)
        )
        return max(0, cursor.rowcount)

    def delete(self, ids: Iterable[int]) -> int:
        """Delete these records; return how many there were."""
        gone = 0
        with self._using("change") as connection:
            for entry_id in ids:
                cursor = connection.execute("DELETE FROM entries WHERE id = ?", (entry_id,))
                gone += max(0, cursor.rowcount)
        return gone

    def clear(self) -> int:
        """Delete every record; return how many there were."""
        with self._using("change") as connection:
            gone = max(0, connection.execute("DELETE FROM entries").rowcount)
        with contextlib.suppress(sqlite3.Error):  # (only the file's size: the rows are gone)
            self._connect().execute("VACUUM")
        return gone

    @contextlib.contextmanager
    def _using(self, doing: str) -> Iterator[sqlite3.Connection]:
        """The connection, for `phi4 history`: a failure is a HistoryError saying ``doing``."""
        try:
            yield self._connect()
        except (sqlite3.Error, OSError) as exc:
            raise HistoryError(f"cannot {doing} the history {self.path}: {_reason(exc)}") from None

    # --- reading ----------------------------------------------------------------------------

    def recent(self, limit: int, kind: str | None = None) -> list[Entry]:
        """The newest ``limit`` records (of ``kind``), newest first."""
        where, args = ("WHERE kind = ?", [kind]) if kind else ("", [])
        with self._using("read") as connection:
            rows = connection.execute(
                f"SELECT {_COLUMNS} FROM entries {where} ORDER BY id DESC LIMIT ?", (*args, limit)
            ).fetchall()
        return [_entry(row) for row in rows]

    def search(self, text: str, limit: int, kind: str | None = None) -> list[Entry]:
        """The newest ``limit`` records whose question, solution or answer hold every word of
        ``text`` (full-text, where this SQLite has FTS5; else as substrings), newest first."""
        words = text.split()
        if not words:
            return self.recent(limit, kind)
        extra, args = (" AND kind = ?", [kind]) if kind else ("", [])
        with self._using("search") as connection:
            return [_entry(row) for row in self._matching(connection, words, extra, args, limit)]

    def _matching(
        self,
        connection: sqlite3.Connection,
        words: list[str],
        extra: str,
        args: list[str],
        limit: int,
    ) -> list[tuple[Any, ...]]:
        if self._fts:
            # Each word a quoted phrase: what is typed is searched for, never read as a query.
            query = " ".join('"' + word.replace('"', '""') + '"' for word in words)
            return connection.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE id IN "
                f"(SELECT rowid FROM entries_fts WHERE entries_fts MATCH ?){extra} "
                "ORDER BY id DESC LIMIT ?",
                (query, *args, limit),
            ).fetchall()
        like = " AND ".join(
            "(question LIKE ? ESCAPE '\\' OR solution LIKE ? ESCAPE '\\' "
            "OR coalesce(answer, '') LIKE ? ESCAPE '\\')"
            for _ in words
        )
        patterns = [p for word in words for p in [_like(word)] * 3]
        return connection.execute(
            f"SELECT {_COLUMNS} FROM entries WHERE {like}{extra} ORDER BY id DESC LIMIT ?",
            (*patterns, *args, limit),
        ).fetchall()

    def get(self, entry_id: int) -> Entry | None:
        with self._using("read") as connection:
            query = f"SELECT {_COLUMNS} FROM entries WHERE id = ?"
            row = connection.execute(query, (entry_id,)).fetchone()
        return None if row is None else _entry(row)

    def count(self) -> int:
        with self._using("read") as connection:
            return int(connection.execute("SELECT count(*) FROM entries").fetchone()[0])


def history_path(data_dir: Path) -> Path:
    return data_dir / "history" / FILE_NAME


def open_history(env: Environment) -> History:
    """The user's history (opened on its first use), its failures said on ``env``."""
    return History(history_path(env.paths.data_dir), env.notice)


def _entry(row: tuple[Any, ...]) -> Entry:
    values = list(row)
    for index in (10, 11):  # settings, stats
        try:
            values[index] = json.loads(values[index] or "{}")
        except ValueError:
            values[index] = {}
    return Entry(*values)


def _like(word: str) -> str:
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether the file itself is bad (not a database, or a malformed one), as opposed to a
    database that is busy, on a full disk or read-only: only a bad file is moved aside."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
    return not isinstance(exc, sqlite3.OperationalError)


def _text(value: str | None) -> str | None:
    """``value`` as SQLite can store it: a lone surrogate (from a file's escaped JSON) as U+FFFD."""
    from phi4cli.core.inputs import replace_bad

    return None if value is None else replace_bad(value)[0]


def _reason(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc)
