"""Running ``phi4 solve``: one question, K self-consistency samples, or a file of problems, and
showing the results the way the output calls for (terminal, pipe, ``--json``, ``--answer-only``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from phi4cli.backends import Backend
from phi4cli.environment import Environment
from phi4cli.errors import ExitStatus, UsageError
from phi4cli.outcome import Outcome, exit_status
from phi4cli.protocol import Event, EventKind
from phi4cli.reasoning import majority_vote
from phi4cli.records import Record
from phi4cli.render import PlainPresenter, TerminalPresenter, no_answer_reason

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

Announce = Callable[[str], None]


class SolveJob(Record):
    """What answers (the daemon or a remote server) and what every request of this command
    shares."""

    backend: Backend
    env: Environment
    base: dict[str, Any]
    seed: int | None = None

    def announce(self, message: str) -> None:
        self.env.notice(message)

    def print(self, text: str = "") -> None:
        print(text, file=self.env.stdout, flush=True)

    instruction: str | None = None  # added after each question

    def params(self, question: str, **extra: Any) -> dict[str, Any]:
        prompt = f"{question}\n\n{self.instruction}" if self.instruction else question
        return {**self.base, "prompt": prompt, **extra}

    def run(self, requests: list[dict[str, Any]], on_event: Callable[[int, Event], None]) -> None:
        self.backend.run(requests, on_event)


class OutputMode(Record):
    show_reasoning: bool = False
    answer_only: bool = False
    as_json: bool = False
    verbose: bool = False


class _StderrStatus:
    """A spinner line on stderr while waiting, for a person at a terminal.

    Started on the first event, not before: the request is on its way to the daemon before rich
    is imported. Not in a pipeline (stdout redirected, or NO_COLOR): plain text only there.
    """

    def __init__(self, env: Environment, message: str) -> None:
        self._wanted = env.terminal and bool(env.stderr_isatty)
        self._env, self._message = env, message
        self._status: Any = None

    def update(self, message: str) -> None:
        self._message = message
        if self._status is not None:
            self._status.update(message)

    def see(self, _event: Event) -> None:
        if self._wanted and self._status is None:
            from rich.console import Console

            console = Console(file=self._env.stderr, force_terminal=True)
            self._status = console.status(self._message, spinner="dots")
            self._status.start()

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def _print_json(job: SolveJob, record: dict[str, Any]) -> None:
    job.print(json.dumps(record, ensure_ascii=False, indent=2))


def _answer_line(job: SolveJob, answer: str) -> str:
    if job.env.terminal:
        from phi4cli.latex import math_to_unicode

        return math_to_unicode(answer)
    return answer


class _LazyPresenter:
    """The presenter for the output, made on the first event (rich is imported only then, after
    the request has gone out)."""

    def __init__(self, env: Environment, mode: OutputMode) -> None:
        self.env, self.mode = env, mode
        self.presenter: PlainPresenter | TerminalPresenter | None = None

    def get(self) -> PlainPresenter | TerminalPresenter:
        if self.presenter is None:
            mode = self.mode
            self.presenter = (
                TerminalPresenter(mode.show_reasoning, mode.verbose, self.env)
                if self.env.terminal
                else PlainPresenter(
                    self.env.stdout, self.env.stderr, mode.show_reasoning, mode.verbose
                )
            )
        return self.presenter


def solve_one(job: SolveJob, question: str, mode: OutputMode) -> int:
    """Stream one question's answer; return the exit status."""
    outcome = Outcome(index=0, question=question)
    quiet = mode.as_json or mode.answer_only
    presenter = _LazyPresenter(job.env, mode)
    spinner = _StderrStatus(job.env, "solving…")
    loading = ProgressNotice(job.announce)

    def on_event(_index: int, event: Event) -> None:
        loading.see(event)
        outcome.apply(event)
        if quiet:
            spinner.see(event)
        else:
            presenter.get().on_event(event)

    try:
        job.run([job.params(question)], on_event)
    finally:
        spinner.stop()
        if isinstance(presenter.presenter, TerminalPresenter):
            presenter.presenter.stop()
    if outcome.error is not None:
        if presenter.presenter is not None:
            presenter.presenter.abort()
        raise outcome.exception()
    if mode.as_json:
        _print_json(job, outcome.to_json())
    elif mode.answer_only:
        answer = outcome.answer
        job.print(_answer_line(job, answer) if answer is not None else "")
    else:
        presenter.get().finish(outcome)
    # Say it on stderr whenever no answer came because the thinking ran out (in a pipeline
    # stdout may be empty), and --answer-only always says why it printed an empty line. At a
    # terminal the presenter has said it in the output already.
    plain_terminal = not (mode.as_json or mode.answer_only) and job.env.terminal
    if not plain_terminal and (outcome.thinking_unfinished
                               or (mode.answer_only and outcome.answer is None)):  # fmt: skip
        job.announce(no_answer_reason(outcome))
    return exit_status([outcome], answer_required=mode.answer_only)


def solve_samples(job: SolveJob, question: str, samples: int, mode: OutputMode) -> int:
    """Solve the same question ``samples`` times and majority-vote the answers."""
    outcomes = [Outcome(index=i, question=question) for i in range(samples)]
    seed = job.seed
    requests = [
        job.params(question, seed=None if seed is None else seed + i) for i in range(samples)
    ]
    loading = ProgressNotice(job.announce)
    finished = 0
    spinner = _StderrStatus(job.env, f"sampling… 0/{samples} done")

    def on_event(index: int, event: Event) -> None:
        nonlocal finished
        loading.see(event)
        spinner.see(event)
        outcomes[index].apply(event)
        if outcomes[index].done:
            finished += 1
            spinner.update(f"sampling… {finished}/{samples} done")

    try:
        job.run(requests, on_event)
    finally:
        spinner.stop()
    good = [o for o in outcomes if o.error is None]
    if not good:
        raise outcomes[0].exception()
    vote = majority_vote([o.answer for o in outcomes])
    # Shown: a sample that gave the winning answer in the form reported, else any that agreed.
    agreeing = [outcomes[i] for i in vote.members]
    winner = next((o for o in agreeing if o.answer == vote.answer),
                  agreeing[0] if agreeing else good[0])  # fmt: skip
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
        _print_json(job, record)
        return ExitStatus.OK
    if mode.answer_only:
        job.print(_answer_line(job, vote.answer) if vote.answer is not None else "")
        job.announce(f"{vote.agreement} samples agree" + (" (tie)" if vote.tie else ""))
        return ExitStatus.OK if vote.answer is not None else ExitStatus.ERROR
    if job.env.terminal:
        presenter = TerminalPresenter(mode.show_reasoning, mode.verbose, job.env)
        presenter.print_outcome(winner, agreement=vote.agreement, answer=vote.answer)
    else:
        job.print(winner.solution.strip())
        shown = vote.answer if vote.answer is not None else "(none)"
        job.print(f"Answer: {shown} ({vote.agreement} samples agree)")
    return ExitStatus.OK


class Problems(Record):
    """The non-blank lines of the input, with their line numbers, and how many lines it had."""

    lines: list[tuple[int, str]]
    total: int


def read_problems(source: str, env: Environment) -> Problems:
    """Return (line number, problem) for each non-blank line of a file, or of stdin for ``-``."""
    if source == "-":
        text = env.stdin.read()
    else:
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    rows = text.splitlines()
    return Problems(
        [(n, line.strip()) for n, line in enumerate(rows, 1) if line.strip()], len(rows)
    )


def solve_file(
    job: SolveJob, problems: list[tuple[int, str]], mode: OutputMode, jsonl: bool,
    total_lines: int | None = None,
) -> int:  # fmt: skip
    """Answer every problem, all submitted at once, printed in input order; exit 1 if any failed.

    With ``--answer-only`` output line N belongs to input line N: a blank input line gets an
    empty output line. ``--jsonl`` records skip blank lines and carry their ``line`` number.
    """
    outcomes = [Outcome(index=i, question=q) for i, (_line, q) in enumerate(problems)]
    requests = [job.params(q, priority="bulk") for _line, q in problems]
    next_to_print = 0
    printed_line = 0  # the input line the output has reached (--answer-only)
    failed = 0
    progress = FileProgress(len(problems), job.env)
    loading = ProgressNotice(job.announce)

    def emit(index: int) -> None:
        nonlocal failed, printed_line
        outcome = outcomes[index]
        line = problems[index][0]
        failed += outcome.error is not None
        if jsonl:
            job.print(json.dumps({"line": line, **outcome.to_json()}, ensure_ascii=False))
        elif mode.answer_only:
            for _blank in range(printed_line + 1, line):
                job.print("")
            printed_line = line
            job.print(outcome.answer or "")
            if outcome.error is not None:
                job.announce(f"line {line}: {outcome.error_message}")
            elif outcome.answer is None:
                job.announce(f"line {line}: {no_answer_reason(outcome)}")
        else:
            job.print(f"[{index + 1}] {outcome.question}")
            if outcome.error is not None:
                job.print(f"error: {outcome.error_message}\n")
            else:
                job.print(outcome.solution.strip())
                job.print(f"Answer: {outcome.answer if outcome.answer is not None else '(none)'}\n")

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
    if mode.answer_only and not jsonl:
        for _blank in range(printed_line + 1, (total_lines or 0) + 1):
            job.print("")  # trailing blank input lines keep their places too
    if failed:
        job.announce(f"{failed} of {len(problems)} problems failed")
    return exit_status(outcomes, answer_required=mode.answer_only)


class FileProgress:
    """A progress bar on stderr for `--file`, only when stderr is a terminal."""

    def __init__(self, total: int, env: Environment) -> None:
        self.total = total
        self.env = env
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> FileProgress:
        if self.env.stderr_isatty:
            from rich.console import Console
            from rich.progress import Progress

            console = Console(file=self.env.stderr, force_terminal=True)
            self._progress = Progress(console=console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("solving", total=self.total)
        return self

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


class ProgressNotice:
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
        elif kind == EventKind.PROGRESS and event.get("stage") == "loading":
            self._once("loading", f"loading {event.get('model', 'the model')}...")
        elif kind == EventKind.ACCEPTED and event.get("state") in ("loading", "warming"):
            self._once("loading", "waiting for the daemon to load the model...")


class SolveOptions(Record):
    """`phi4 solve`'s options, as Typer (or the fast path, from the same table) parsed them."""

    prompt: str | None = None
    model: str | None = None
    show_reasoning: bool = False
    answer_only: bool = False
    as_json: bool = False
    file: str | None = None
    each_line: bool = False
    jsonl: bool = False
    samples: int = 1
    think_budget: int | None = None
    system: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    deterministic: bool | None = None
    keep_alive: str | None = None
    n_ctx: str | None = None
    threads: int | None = None
    backend: str | None = None
    no_instruction: bool = False
    verbose: bool = False


def read_prompt(prompt: str | None, env: Environment) -> str:
    """The question: the argument, or stdin for ``-`` or when no argument is given.

    Stdin is read only then: in ``while read q; do phi4 solve "$q"; done < file`` it is the
    loop's, and ``sleep 100 | phi4 solve "q"`` must not wait for its end.
    """
    if prompt is not None and prompt != "-":
        text = prompt
    elif prompt == "-" or not env.stdin_isatty:
        text = env.stdin.read().strip("\n")
    else:
        raise UsageError(
            'no question given: phi4 solve "What is 12*13?" or echo ... | phi4 solve -'
        )
    if not text.strip():
        raise UsageError("the question is empty")
    return text


def make_job(
    env: Environment, model: str | None, answer_options: dict[str, Any], no_instruction: bool
) -> SolveJob:
    """Settings, model and backend for a command that solves (solve, eval): what each request
    it sends shares."""
    from phi4cli.backends import make_backend
    from phi4cli.config import load_settings
    from phi4cli.models import resolve_model

    paths = env.paths
    settings = load_settings(paths.config_file, {"model": model, **answer_options})
    model_path = None if settings.backend else resolve_model(settings.model, paths)
    base: dict[str, Any] = {
        "model": str(model_path or settings.model),
        "system": settings.system,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "seed": settings.seed,
        "max_tokens": settings.max_tokens,
        "think_budget": settings.think_budget,
        "deterministic": settings.deterministic,
    }
    if answer_options.get("keep_alive") is not None or "PHI4_KEEP_ALIVE" in os.environ:
        base["keep_alive"] = settings.keep_alive
    backend = make_backend(paths, settings, model_path or settings.model, env.notice)
    instruction = None if no_instruction else settings.instruction
    return SolveJob(backend, env, base, seed=settings.seed, instruction=instruction)


def run_solve(o: SolveOptions, env: Environment | None = None) -> int:
    """`phi4 solve`: one question, K samples, or a file of problems; return the exit status."""
    env = env or Environment()
    if (o.file is not None or o.each_line) and o.samples > 1:
        raise UsageError("--samples works on one question, not with --file or --each-line")
    if o.jsonl and o.file is None and not o.each_line:
        raise UsageError("--jsonl goes with --file or --each-line; use --json for one question")
    if o.each_line and o.file is None and o.prompt not in (None, "-"):
        raise UsageError("--each-line reads problems from stdin: phi4 solve - --each-line")
    reads_file = o.file is not None or o.each_line
    problems = read_problems(o.file or "-", env) if reads_file else None
    question = read_prompt(o.prompt, env) if problems is None else ""
    from phi4cli.config import ANSWER_KEYS

    answer_options = {key: getattr(o, key) for key in ANSWER_KEYS}
    job = make_job(env, o.model, answer_options, o.no_instruction)
    mode = OutputMode(o.show_reasoning, o.answer_only, o.as_json, o.verbose)
    try:
        if problems is not None:
            if not problems.lines:
                raise UsageError("no problems: the input has no non-blank lines")
            return solve_file(job, problems.lines, mode, o.jsonl, problems.total)
        if o.samples > 1:
            return solve_samples(job, question, o.samples, mode)
        return solve_one(job, question, mode)
    except BrokenPipeError:
        # The reader went away (`| head -1`): leaving here closes the connection, which stops
        # the generation. Point stdout at /dev/null so the exit-time flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), env.stdout.fileno())
        return ExitStatus.OK
