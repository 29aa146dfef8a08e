"""Running ``phi4 solve``: one question, K self-consistency samples, or a file of problems, and
showing the results the way the output calls for (terminal, pipe, ``--json``, ``--answer-only``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phi4cli.backends import Backend
from phi4cli.errors import ExitStatus
from phi4cli.outcome import Outcome, exit_status
from phi4cli.protocol import Event, EventKind
from phi4cli.reasoning import majority_vote, normalize_answer
from phi4cli.render import PlainPresenter, TerminalPresenter, no_answer_reason, stdout_is_terminal

Announce = Callable[[str], None]


@dataclass(frozen=True)
class SolveJob:
    """What answers (the daemon or a remote server) and what every request of this command
    shares."""

    backend: Backend
    announce: Announce
    base: dict[str, Any]
    seed: int | None = None

    def params(self, question: str, **extra: Any) -> dict[str, Any]:
        return {**self.base, "prompt": question, **extra}

    def run(self, requests: list[dict[str, Any]], on_event: Callable[[int, Event], None]) -> None:
        self.backend.run(requests, on_event)


@dataclass(frozen=True)
class OutputMode:
    show_reasoning: bool = False
    answer_only: bool = False
    as_json: bool = False
    verbose: bool = False


@contextlib.contextmanager
def _stderr_status(message: str) -> Iterator[Callable[[str], None]]:
    """A spinner line on stderr while waiting, for a person at a terminal; yields an updater.

    Not in a pipeline (stdout redirected, or NO_COLOR): there the output is plain text only.
    """
    if not (stdout_is_terminal() and sys.stderr.isatty()):
        yield lambda _text: None
        return
    from rich.console import Console

    with Console(stderr=True).status(message, spinner="dots") as status:
        yield status.update


def _print_json(record: dict[str, Any]) -> None:
    print(json.dumps(record, ensure_ascii=False, indent=2))


def _answer_line(answer: str) -> str:
    if stdout_is_terminal():
        from phi4cli.latex import math_to_unicode

        return math_to_unicode(answer)
    return answer


def solve_one(job: SolveJob, question: str, mode: OutputMode) -> int:
    """Stream one question's answer; return the exit status."""
    outcome = Outcome(index=0, question=question)
    quiet = mode.as_json or mode.answer_only
    presenter: PlainPresenter | TerminalPresenter | None = None
    if not quiet:
        presenter = (
            TerminalPresenter(mode.show_reasoning, mode.verbose)
            if stdout_is_terminal()
            else PlainPresenter(sys.stdout, sys.stderr, mode.show_reasoning, mode.verbose)
        )
    loading = _ProgressNotice(job.announce)

    def on_event(_index: int, event: Event) -> None:
        loading.see(event)
        outcome.apply(event)
        if presenter is not None:
            presenter.on_event(event)

    try:
        if quiet:
            with _stderr_status("solving…"):
                job.run([job.params(question)], on_event)
        else:
            job.run([job.params(question)], on_event)
    finally:
        if isinstance(presenter, TerminalPresenter):
            presenter.stop()
    if outcome.error is not None:
        if presenter is not None:
            presenter.abort()
        raise outcome.exception()
    if mode.as_json:
        _print_json(outcome.to_json())
    elif mode.answer_only:
        answer = outcome.answer
        print(_answer_line(answer) if answer is not None else "")
        if answer is None:
            job.announce(no_answer_reason(outcome))
    else:
        assert presenter is not None
        presenter.finish(outcome)
    return exit_status([outcome], answer_required=mode.answer_only)


def solve_samples(job: SolveJob, question: str, samples: int, mode: OutputMode) -> int:
    """Solve the same question ``samples`` times and majority-vote the answers."""
    outcomes = [Outcome(index=i, question=question) for i in range(samples)]
    seed = job.seed
    requests = [
        job.params(question, seed=None if seed is None else seed + i) for i in range(samples)
    ]
    loading = _ProgressNotice(job.announce)
    finished = 0
    with _stderr_status(f"sampling… 0/{samples} done") as update:

        def on_event(index: int, event: Event) -> None:
            nonlocal finished
            loading.see(event)
            outcomes[index].apply(event)
            if outcomes[index].done:
                finished += 1
                update(f"sampling… {finished}/{samples} done")

        job.run(requests, on_event)
    good = [o for o in outcomes if o.error is None]
    if not good:
        raise outcomes[0].exception()
    vote = majority_vote([o.answer for o in outcomes])
    winner = next(
        (o for o in good if vote.answer is not None and o.answer is not None
         and normalize_answer(o.answer) == normalize_answer(vote.answer)),
        good[0],
    )  # fmt: skip
    if mode.as_json:
        record = winner.to_json()
        record.update(
            answer=vote.answer,
            agreement=vote.agreement,
            tie=vote.tie,
            samples=[
                {"answer": o.answer, "seed": o.stats.seed if o.stats else None,
                 "error": o.to_json().get("error"), "stats": o.stats_dict}
                for o in outcomes
            ],
        )  # fmt: skip
        _print_json(record)
        return ExitStatus.OK
    if mode.answer_only:
        print(_answer_line(vote.answer) if vote.answer is not None else "")
        job.announce(f"{vote.agreement} samples agree" + (" (tie)" if vote.tie else ""))
        return ExitStatus.OK if vote.answer is not None else ExitStatus.ERROR
    if stdout_is_terminal():
        presenter = TerminalPresenter(mode.show_reasoning, mode.verbose)
        presenter.print_outcome(winner, agreement=vote.agreement, answer=vote.answer)
    else:
        print(winner.solution.strip())
        shown = vote.answer if vote.answer is not None else "(none)"
        print(f"Answer: {shown} ({vote.agreement} samples agree)")
    return ExitStatus.OK


def read_problems(source: str) -> list[tuple[int, str]]:
    """Return (line number, problem) for each non-blank line of a file, or of stdin for ``-``."""
    if source == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            from phi4cli.errors import UsageError

            raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def solve_file(
    job: SolveJob, problems: list[tuple[int, str]], mode: OutputMode, jsonl: bool
) -> int:
    """Answer every problem, all submitted at once, printed in input order; exit 1 if any failed."""
    outcomes = [Outcome(index=i, question=q) for i, (_line, q) in enumerate(problems)]
    requests = [job.params(q, priority="bulk") for _line, q in problems]
    next_to_print = 0
    failed = 0
    progress = _FileProgress(len(problems))
    loading = _ProgressNotice(job.announce)

    def emit(index: int) -> None:
        nonlocal failed
        outcome = outcomes[index]
        line = problems[index][0]
        failed += outcome.error is not None
        if jsonl:
            print(json.dumps({"line": line, **outcome.to_json()}, ensure_ascii=False), flush=True)
        elif mode.answer_only:
            print(outcome.answer or "", flush=True)
            if outcome.error is not None:
                job.announce(f"line {line}: {outcome.error_message}")
            elif outcome.answer is None:
                job.announce(f"line {line}: {no_answer_reason(outcome)}")
        else:
            print(f"[{index + 1}] {outcome.question}")
            if outcome.error is not None:
                print(f"error: {outcome.error_message}\n", flush=True)
            else:
                print(outcome.solution.strip())
                print(f"Answer: {outcome.answer if outcome.answer is not None else '(none)'}\n",
                      flush=True)  # fmt: skip

    def on_event(index: int, event: Event) -> None:
        nonlocal next_to_print
        loading.see(event)
        outcomes[index].apply(event)
        if not outcomes[index].done:
            return
        progress.advance()
        while next_to_print < len(outcomes) and outcomes[next_to_print].done:
            emit(next_to_print)
            next_to_print += 1

    with progress:
        job.run(requests, on_event)
    if failed:
        job.announce(f"{failed} of {len(problems)} problems failed")
    return exit_status(outcomes, answer_required=mode.answer_only)


class _FileProgress:
    """A progress bar on stderr for `--file`, only when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _FileProgress:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress

            self._progress = Progress(console=Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("solving", total=self.total)
        return self

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


class _ProgressNotice:
    """Say once on stderr when requests wait for a model to load, and once when they wait for
    room in the daemon's memory."""

    def __init__(self, announce: Announce) -> None:
        self._announce = announce
        self._said: set[str] = set()

    def _once(self, topic: str, message: str) -> None:
        if topic not in self._said:
            self._said.add(topic)
            self._announce(message)

    def see(self, event: Event) -> None:
        kind = event.kind
        if kind == EventKind.PROGRESS and event.get("stage") == "waiting":
            self._once(
                "memory",
                f"waiting for memory: a request reserves {event.get('needed', 0):,} tokens of "
                f"context and {event.get('free', 0):,} are free until a running one finishes",
            )
        elif kind == EventKind.PROGRESS:
            self._once("loading", f"loading {event.get('model', 'the model')}...")
        elif kind == EventKind.ACCEPTED and event.get("state") in ("loading", "warming"):
            self._once("loading", "waiting for the daemon to load the model...")
