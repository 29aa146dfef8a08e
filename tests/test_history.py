"""The history (phi4cli.client.history, `phi4 history`): every answer kept as it finishes — a
solve, the samples of one, a chat turn, an eval problem — listed, searched, shown, deleted;
private, bounded, safe beside several writers, and a damaged database never blocks a solve."""

from __future__ import annotations

import json
import multiprocessing
import stat
from pathlib import Path

import pytest

from phi4cli.backends.outcome import Outcome
from phi4cli.client.history import History, history_path
from phi4cli.core.errors import ErrorCode
from phi4cli.core.protocol import Event, EventKind, Stats
from tests.conftest import run_phi4


def _outcome(question: str, solution: str, thinking: str = "", error: str = "") -> Outcome:
    outcome = Outcome(index=0, question=question)
    if thinking:
        outcome.apply(Event(EventKind.REASONING, text=thinking))
    outcome.apply(Event(EventKind.TOKEN, text=solution))
    outcome.apply(Event.of_stats(Stats(completion_tokens=7, finish_reason="stop", model="m.gguf")))
    outcome.apply(Event.error(ErrorCode.INTERNAL, error) if error else Event(EventKind.DONE))
    return outcome


def _store(tmp_path: Path, said: list[str] | None = None) -> History:
    notes = said if said is not None else []
    return History(history_path(tmp_path / "data"), notes.append)


def test_an_answer_is_kept_whole_and_read_back(tmp_path: Path):
    store = _store(tmp_path)
    kept = store.add("solve", _outcome("What is 6*7?", "6*7 = \\boxed{42}", "six sevens"), {"t": 0})
    assert kept is not None
    entry = store.get(kept)
    assert entry is not None
    assert (entry.kind, entry.question, entry.answer) == ("solve", "What is 6*7?", "42")
    assert entry.thinking == "six sevens" and entry.solution == "6*7 = \\boxed{42}"
    assert entry.model == "m.gguf" and entry.settings == {"t": 0}
    assert entry.stats["completion_tokens"] == 7 and entry.error is None
    failed = store.get(store.add("solve", _outcome("q", "half", error="it broke"), {}) or 0)
    assert failed is not None and failed.error == "it broke"


def test_the_newest_come_first_and_a_search_finds_every_word(tmp_path: Path):
    store = _store(tmp_path)
    store.add("solve", _outcome("the area of a circle of radius 2", "\\boxed{4\\pi}"), {})
    store.add("chat", _outcome("a prime above 20", "\\boxed{23}"), {}, session="primes")
    store.add("eval", _outcome("the area of a square of side 3", "\\boxed{9}"), {})
    assert [e.kind for e in store.recent(10)] == ["eval", "chat", "solve"]
    assert [e.kind for e in store.recent(10, "chat")] == ["chat"]
    assert [e.answer for e in store.search("area", 10)] == ["9", "4\\pi"]
    assert [e.answer for e in store.search("area circle", 10)] == ["4\\pi"]
    assert [e.answer for e in store.search("23", 10)] == ["23"]  # the answer is searched too
    # What is typed is searched for, never read as a query (quotes, operators, a lone star).
    for text in ('"', "area OR", "*", "NEAR(", "a-b"):
        assert isinstance(store.search(text, 10), list)
    assert store.search("nowhere", 10) == []


def test_delete_one_then_all(tmp_path: Path):
    store = _store(tmp_path)
    ids = [store.add("solve", _outcome(f"q{i}", f"\\boxed{{{i}}}"), {}) for i in range(3)]
    assert store.delete([ids[0], 999]) == 1
    assert [e.id for e in store.recent(10)] == [ids[2], ids[1]]
    assert store.search("q0", 10) == []  # gone from the search too
    assert store.clear() == 2 and store.count() == 0


def test_it_is_private_and_bounded_and_never_reuses_an_id(tmp_path: Path):
    (tmp_path / "data").mkdir(mode=0o755)  # (the data directory, shared with models and chats)
    store = _store(tmp_path)
    for i in range(12):
        store.add("solve", _outcome(f"q{i}", "x"), {})
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700  # a directory of its own
    assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o755  # left as it was
    assert store.prune(keep=5) == 7
    assert [e.question for e in store.recent(10)] == [f"q{i}" for i in range(11, 6, -1)]
    newest = store.recent(1)[0].id
    store.delete([newest])
    assert store.add("solve", _outcome("after", "x"), {}) == newest + 1


def test_text_sqlite_cannot_store_is_kept_readable(tmp_path: Path):
    # A lone surrogate (a JSONL problem's escaped "\ud800") cannot be encoded as UTF-8: before,
    # it raised out of the record and ended an eval run with an internal error.
    store = _store(tmp_path)
    kept = store.add("eval", _outcome("half \ud800 a pair", "x"), {})
    assert kept is not None and store.get(kept).question == "half \ufffd a pair"  # type: ignore[union-attr]


def test_a_damaged_database_is_moved_aside_and_a_new_one_started(tmp_path: Path):
    path = history_path(tmp_path / "data")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not a SQLite database" * 100)
    said: list[str] = []
    store = History(path, said.append)
    assert store.add("solve", _outcome("q", "\\boxed{1}"), {}) is not None
    assert len(said) == 1 and "could not be read" in said[0] and "moved to" in said[0]
    aside = [p for p in path.parent.iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not")
    assert [e.answer for e in store.recent(5)] == ["1"]


def test_a_busy_database_is_waited_for_said_once_and_never_moved_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import sqlite3

    from phi4cli.client import history

    said: list[str] = []
    store = _store(tmp_path, said)
    assert store.add("solve", _outcome("kept", "x"), {}) is not None
    store.close()
    monkeypatch.setattr(history, "BUSY_S", 0.1)
    holder = sqlite3.connect(store.path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another client in the middle of a write
    try:
        busy = _store(tmp_path, said)
        assert busy.add("solve", _outcome("a", "x"), {}) is None
        assert busy.add("solve", _outcome("b", "x"), {}) is None
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert len(said) == 1 and "not kept in the history now" in said[0], said
    assert not [p for p in store.path.parent.iterdir() if ".damaged-" in p.name]
    assert [e.question for e in _store(tmp_path).recent(5)] == ["kept"]


def _write_many(path: str, writer: int, count: int) -> None:
    store = History(Path(path), print)
    for i in range(count):
        assert store.add("solve", _outcome(f"writer{writer} question {i}", "x"), {}) is not None


def test_several_writers_at_once_lose_nothing(tmp_path: Path):
    path = history_path(tmp_path / "data")
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_many, args=(str(path), w, 40)) for w in range(4)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(60)
        assert process.exitcode == 0
    store = _store(tmp_path)
    assert store.count() == 160
    assert len(store.search("writer3", 200)) == 40


# --- the commands, with the daemon --------------------------------------------------------------


def _listed(*args: str) -> list[dict[str, object]]:
    listed = run_phi4("history", *args, "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)  # type: ignore[no-any-return]


@pytest.mark.daemon
def test_solve_chat_and_eval_answers_are_kept_and_found(
    tiny_model: Path, tmp_path: Path, phi4_home: Path
):
    # Nothing kept yet: the list says so, and makes no database to say it.
    assert _listed() == [] and not history_path(phi4_home / "data").exists()
    solved = run_phi4("solve", "What is 2+2?", "-m", str(tiny_model), "-n", "6")
    assert solved.returncode in (0, 1), solved.stderr
    skipped = run_phi4("solve", "Not kept", "-m", str(tiny_model), "-n", "4", "--no-history")
    assert skipped.returncode in (0, 1), skipped.stderr
    chat = run_phi4("chat", "-m", str(tiny_model), "-n", "4", input="a chat question\n")
    assert chat.returncode in (0, 1), chat.stderr
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"problem": "an eval problem", "answer": "1"}) + "\n")
    graded = run_phi4("eval", str(problems), "-m", str(tiny_model), "-n", "4")
    assert graded.returncode in (0, 1), graded.stderr
    entries = _listed()
    assert [(e["kind"], e["question"]) for e in entries] == [
        ("eval", "an eval problem"),
        ("chat", "a chat question"),
        ("solve", "What is 2+2?"),
    ]
    assert all(e["model"] and e["stats"]["completion_tokens"] for e in entries)
    assert [e["kind"] for e in _listed("search", "chat")] == ["chat"]
    # A kept solve goes on as a chat: its question and solution are the chat's first turn.
    first = entries[-1]["id"]
    went_on = run_phi4(
        "chat", "--from-history", str(first), "-m", str(tiny_model), "-n", "3", input="and more?\n"
    )
    assert went_on.returncode in (0, 1), went_on.stderr
    saved = [json.loads(p.read_text()) for p in (phi4_home / "data" / "chats").glob("*.json")]
    assert [t["question"] for t in max(saved, key=lambda c: len(c["turns"]))["turns"]] == [
        "What is 2+2?",
        "and more?",
    ]
    assert _listed("--kind", "chat", "-n", "1")[0]["question"] == "and more?"
    gone = run_phi4("chat", "--from-history", "9999", "-m", str(tiny_model), input="")
    assert gone.returncode == 2 and "no answer 9999 in the history" in gone.stderr
    # Shown whole; deleted; an id that is not there is one line and exit 2.
    shown = run_phi4("history", "show", str(first))
    assert shown.returncode == 0 and "Question:\nWhat is 2+2?" in shown.stdout
    assert run_phi4("history", "delete", str(first)).returncode == 0
    missing = run_phi4("history", "show", str(first))
    assert missing.returncode == 2 and f"no answer {first} in the history" in missing.stderr
    assert [e["kind"] for e in _listed()] == ["chat", "eval", "chat"]
    assert run_phi4("history", "delete").returncode == 2  # neither ids nor --all
    assert run_phi4("history", "delete", "--all").returncode == 0 and _listed() == []


@pytest.mark.daemon
def test_a_damaged_history_never_blocks_a_solve(tiny_model: Path, phi4_home: Path):
    path = history_path(phi4_home / "data")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x00garbage" * 64)
    solved = run_phi4("solve", "What is 2+2?", "-m", str(tiny_model), "-n", "4")
    assert solved.returncode in (0, 1), solved.stderr
    assert solved.stderr.count("history database") == 1, solved.stderr
    assert [e["question"] for e in _listed()] == ["What is 2+2?"]
