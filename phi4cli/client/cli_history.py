"""`phi4 history`: the answers phi4 gave here, from the history database (``history.py``) —
the newest listed, searched by their words, one shown whole, some or all deleted."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from phi4cli.client.cli_daemon import JsonOption
from phi4cli.client.cli_env import print_out, run_env
from phi4cli.core.errors import Phi4Error, UsageError
from phi4cli.text.sanitize import clean_text

if TYPE_CHECKING:
    from phi4cli.client.chats import Turn
    from phi4cli.client.history import Entry, History

history_app = typer.Typer(
    help="The answers phi4 gave here (solve, chat, eval): list, search, show, delete.",
    invoke_without_command=True,
)

LimitOption = Annotated[
    int, typer.Option("--limit", "-n", min=1, help="Show at most this many [default 20].")
]
KindOption = Annotated[
    str | None,
    typer.Option("--kind", metavar="solve|sample|chat|eval", help="Only answers of this kind."),
]


def _history() -> History:
    from phi4cli.client.history import open_history

    return open_history(run_env())


@contextlib.contextmanager
def _said() -> Iterator[None]:
    """A history that cannot be read or changed (busy, unreadable, on a full disk): one line,
    exit 1."""
    from phi4cli.client.history import HistoryError

    try:
        yield
    except HistoryError as exc:
        raise Phi4Error(str(exc)) from None


def _checked_kind(kind: str | None) -> str | None:
    from phi4cli.client.history import KINDS

    if kind is not None and kind not in KINDS:
        raise UsageError(f"--kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind


def _line(entry: Entry) -> str:
    """One answer in a list: its id, when, its kind, the question's start and the answer."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.at))
    question = " ".join(entry.question.split())
    if len(question) > 60:
        question = question[:59] + "…"
    answer = entry.answer if entry.answer is not None else ("error" if entry.error else "no answer")
    verdict = f" ({entry.verdict})" if entry.verdict else ""
    return clean_text(f"{entry.id:>5}  {when}  {entry.kind:<6}  {question}  → {answer}{verdict}")


def _print_entries(entries: list[Entry], as_json: bool, empty: str) -> None:
    if as_json:
        from phi4cli.client.solve_job import json_text

        print_out(json_text([e.to_json() for e in entries]))
    elif not entries:
        run_env().notice(empty)
    else:
        for entry in entries:
            print_out(_line(entry))


@history_app.callback()
def history(
    ctx: typer.Context,
    limit: LimitOption = 20,
    kind: KindOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the newest answers, newest first (`phi4 history search WORDS`, `show ID`, `delete
    ID`). Kept as each answer finishes unless --no-history or `history = false`."""
    if ctx.invoked_subcommand is not None:
        return
    store, kind = _history(), _checked_kind(kind)
    with _said():
        found = store.recent(limit, kind) if store.exists else []
    _print_entries(found, as_json, "no answers kept yet")


@history_app.command("search")
def history_search(
    words: Annotated[
        list[str], typer.Argument(help="Words the answer's question, solution or answer holds.")
    ],
    limit: LimitOption = 20,
    kind: KindOption = None,
    as_json: JsonOption = False,
) -> None:
    """The newest answers whose question, solution or answer hold every one of WORDS."""
    text, store, kind = " ".join(words), _history(), _checked_kind(kind)
    with _said():
        found = store.search(text, limit, kind) if store.exists else []
    _print_entries(found, as_json, f"no answer kept holds {text!r}")


@history_app.command("show")
def history_show(
    entry_id: Annotated[int, typer.Argument(metavar="ID", help="The answer's id (from the list).")],
    as_json: JsonOption = False,
) -> None:
    """One answer whole: its question, thinking, solution, answer, check, model and stats."""
    store = _history()
    with _said():
        entry = store.get(entry_id) if store.exists else None
    if entry is None:
        raise UsageError(f"no answer {entry_id} in the history (`phi4 history` lists them)")
    if as_json:
        from phi4cli.client.solve_job import json_text

        print_out(json_text(entry.to_json(), indent=2))
        return
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.at))
    lines = [f"{entry.kind} {entry.id} · {when} · {entry.model or 'unknown model'}"]
    if entry.session:
        lines.append(f"session: {entry.session}")
    lines += ["", "Question:", entry.question]
    if entry.thinking.strip():
        lines += ["", "Thinking:", entry.thinking.strip()]
    lines += ["", "Solution:", entry.solution.strip() or "(none)"]
    lines += ["", f"Answer: {entry.answer if entry.answer is not None else 'none stated'}"]
    if entry.verdict:
        lines.append(f"Check: {entry.verdict}")
    if entry.error:
        lines.append(f"Error: {entry.error}")
    tokens = entry.stats.get("completion_tokens")
    if tokens is not None:
        lines.append(f"Tokens: {tokens} ({entry.stats.get('finish_reason', '?')})")
    print_out(clean_text("\n".join(lines)))


def answer_as_turn(entry_id: int) -> Turn:
    """Answer ``entry_id`` of the history as a chat's first turn (`phi4 chat --from-history`)."""
    from phi4cli.client.chats import Turn

    store = _history()
    with _said():
        entry = store.get(entry_id) if store.exists else None
    if entry is None:
        raise UsageError(f"no answer {entry_id} in the history (`phi4 history` lists them)")
    return Turn(entry.question, entry.solution, entry.thinking, dict(entry.stats))


@history_app.command("delete")
def history_delete(
    ids: Annotated[
        list[int] | None, typer.Argument(metavar="[ID]...", help="The answers' ids.")
    ] = None,
    everything: Annotated[bool, typer.Option("--all", help="Delete every answer kept.")] = False,
) -> None:
    """Delete answers from the history, by id, or all of them with --all."""
    if everything == bool(ids):
        raise UsageError("give the ids of the answers to delete, or --all (not both)")
    store, gone = _history(), 0
    if store.exists:
        with _said():
            gone = store.clear() if everything else store.delete(ids or [])
    run_env().notice(f"deleted {gone} answer{'' if gone == 1 else 's'}")
