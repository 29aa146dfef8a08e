"""Running ``phi4 solve``: one question, K self-consistency samples (``voting.py``), or a file of
problems, and showing the results the way the output calls for (terminal, pipe, ``--json``,
``--answer-only``); the job every request shares is ``solve_job.py``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from phi4cli.backends.outcome import Outcome, exit_status
from phi4cli.client._solve_options import SolveOptions as SolveOptions  # generated from the command
from phi4cli.client.environment import Environment
from phi4cli.client.presenters import (
    PlainPresenter,
    TerminalPresenter,
    loop_cut,
    no_answer_reason,
    unfinished,
)
from phi4cli.client.progress import FileProgress, LoadLine, ProgressNotice, StderrStatus
from phi4cli.client.render import counted
from phi4cli.client.solve_job import (
    OutputMode,
    SolveJob,
    answer_line,
    check_suffix,
    json_text,
    make_job,
    print_json_indented,
    say_check,
)
from phi4cli.client.voting import solve_samples
from phi4cli.core.errors import ExitStatus, Phi4Error, UsageError
from phi4cli.core.protocol import PRIORITY_BULK, Event

if TYPE_CHECKING:
    from phi4cli.backends.flight import Flight
    from phi4cli.client.keys import AnswerKeys
    from phi4cli.client.problems import (  # imported where --file reads, not before
        Opened,
        ProblemFeed,
    )


class _LazyPresenter:
    """The presenter for the output, made on the first event (rich is imported only then, after
    the request has gone out)."""

    def __init__(self, env: Environment, mode: OutputMode, key_hint: str | None = None) -> None:
        self.env, self.mode, self.key_hint = env, mode, key_hint
        self.presenter: PlainPresenter | TerminalPresenter | None = None

    def get(self) -> PlainPresenter | TerminalPresenter:
        if self.presenter is None:
            mode = self.mode
            self.presenter = (
                TerminalPresenter(mode.show_reasoning, mode.verbose, self.env)
                if self.env.terminal
                else PlainPresenter(
                    self.env.stdout,
                    self.env.stderr,
                    mode.show_reasoning,
                    mode.verbose,
                    raw=self.env.raw_stdout,
                )
            )
            if isinstance(self.presenter, TerminalPresenter):
                self.presenter.key_hint = self.key_hint
        return self.presenter

    def answering_now(self) -> None:
        """The answer was asked for now: the live line says so."""
        presenter = self.get()
        if isinstance(presenter, TerminalPresenter):
            presenter.answering_now()


def solve_one(job: SolveJob, question: str, mode: OutputMode) -> int:
    """Stream one question's answer; return the exit status."""
    outcome = Outcome(index=0, question=question)
    quiet = mode.as_json or mode.answer_only
    # At a terminal, Enter while the model thinks asks for the answer now (keys.AnswerNow).
    keys = _answer_keys(job.env) if job.env.terminal and not quiet else None
    hint = None
    if keys is not None:
        from phi4cli.client.keys import ANSWER_NOW_HINT

        hint = ANSWER_NOW_HINT
    presenter = _LazyPresenter(job.env, mode, hint)
    spinner = StderrStatus(job.env, "solving…")
    loading = ProgressNotice(job.announce, LoadLine(job.env, spinner if quiet else None))
    flights: list[Flight] = []
    hurry = None
    if keys is not None:
        from phi4cli.client.keys import AnswerNow

        hurry = AnswerNow(keys, lambda: flights[0].answer_now(0), presenter.answering_now)

    def on_event(_index: int, event: Event) -> None:
        job.prepare_check(question)  # (once: on the first event, the request sent)
        loading.see(event)
        outcome.apply(event)
        if quiet:
            spinner.see(event)
        else:
            presenter.get().on_event(event)
        if hurry is not None:
            hurry.see(event)

    if keys is not None:
        keys.begin()  # (no echo of what is typed; Ctrl-C stays a SIGINT)
    try:
        job.run([job.params(question)], on_event, on_flight=flights.append)
    except KeyboardInterrupt:
        # What streamed stays on the screen (a live region would be erased), with a line
        # saying it stopped there; the exit status is 130 all the same.
        loading.stop()
        spinner.stop()
        if presenter.presenter is not None:
            presenter.presenter.show_partial(outcome)
        job.announce(
            "stopped (Ctrl-C): the answer above is unfinished"
            if outcome.solution.strip()
            else "stopped (Ctrl-C) before the answer began"
        )
        raise
    except Phi4Error as error:  # mid-answer: a daemon that froze, or sent garbage
        loading.stop()
        spinner.stop()
        _keep_partial(presenter.presenter, outcome, error)
        raise
    finally:
        loading.stop()
        spinner.stop()
        if isinstance(presenter.presenter, TerminalPresenter):
            presenter.presenter.stop()
        if keys is not None:
            keys.end()  # the terminal as it was
    if outcome.error is not None:  # the daemon stopped or crashed, a server hung up, ...
        failure = outcome.exception()
        _keep_partial(presenter.presenter, outcome, failure)
        job.remember(outcome)  # (with its error: what it wrote before it failed is kept too)
        raise failure
    job.check_outcome(outcome)
    if mode.as_json:
        print_json_indented(job, outcome.to_json())
    elif mode.answer_only:
        answer = outcome.answer
        job.print(answer_line(job, answer) if answer is not None else "")
    else:
        presenter.get().finish(outcome)
    job.remember(outcome)  # (once shown: the answer never waits for its record)
    # Say it on stderr whenever no answer came because the thinking ran out (in a pipeline
    # stdout may be empty), and --answer-only always says why it printed an empty line. At a
    # terminal the presenter has said it in the output already.
    # A loop stopped is said in every mode (at a terminal with an answer shown, too).
    # An answer cut off at --max-tokens is said in a pipe too, as at a terminal (--json has
    # its finish_reason).
    plain_terminal = not (mode.as_json or mode.answer_only) and job.env.terminal
    cut_off = outcome.cut_off and not mode.as_json
    if (
        not plain_terminal
        and (
            outcome.thinking_unfinished
            or outcome.looped
            or cut_off
            or (mode.answer_only and outcome.answer is None)
        )
    ) or (plain_terminal and outcome.looped and outcome.answer is not None):
        job.announce(no_answer_reason(outcome))
    elif (cut := loop_cut(outcome)) is not None:  # (in every mode: only --json's stats said it)
        job.announce(cut)
    if not plain_terminal and not mode.as_json:
        say_check(job.announce, outcome.check)
    return job.check_status([outcome], exit_status([outcome], answer_required=mode.answer_only))


def _answer_keys(env: Environment) -> AnswerKeys | None:
    """The keyboard while the answer streams, where stdin is a terminal in our foreground."""
    if not env.stdin_isatty:
        return None
    from phi4cli.client.keys import terminal_keys

    return terminal_keys(env.stdin)


def _keep_partial(
    presenter: PlainPresenter | TerminalPresenter | None, outcome: Outcome, error: Phi4Error
) -> None:
    """An error ended the answer: what streamed of it stays on the screen, as after Ctrl-C
    (a live region would be erased), and ``error``'s line, said last, says it is unfinished."""
    if presenter is not None:
        presenter.show_partial(outcome)
        error.args = (unfinished(outcome, str(error)),)


ECHO_CHARS = 2000  # of a question, echoed above its solution; a longer one is shortened


def echoed(question: str) -> str:
    """A question as the human output echoes it: whole, or its start and how long it is (a
    megabyte line refused as too long is not worth a megabyte of screen)."""
    if len(question) <= ECHO_CHARS:
        return question
    return f"{question[: ECHO_CHARS // 2]}… ({len(question):,} characters)"


def solve_file(job: SolveJob, opened: Opened, mode: OutputMode, jsonl: bool) -> int:
    """Answer every problem of an input (:func:`open_problems`) as it is read, at most a
    window at once, printed in input order; exit 1 if any failed.

    With ``--answer-only`` output line N belongs to input line N: a blank input line gets an
    empty output line. ``--jsonl`` records skip blank lines and carry their ``line`` number.
    """
    from phi4cli.client.problems import ProblemFeed, raw_lines

    source = opened.stream if opened.known is not None else raw_lines(opened.stream)
    feed = ProblemFeed(source, opened.where, lambda q: job.params(q, PRIORITY_BULK))
    try:
        return _solve_feed(job, feed, opened.known, mode, jsonl)
    finally:
        # Not while the reader is still in a read of a pipe: closing waits for it (a FIFO
        # whose writer is slow), and the process is ending anyway.
        if opened.owned and feed.ended:
            opened.stream.close()


def _solve_feed(
    job: SolveJob, feed: ProblemFeed, known: int | None, mode: OutputMode, jsonl: bool
) -> int:
    pending: dict[int, Outcome] = {}  # problems begun and not printed yet
    flagged: list[Printed] = []  # of those printed, what the exit status looks at
    count = 0  # problems begun
    next_to_print = 0
    printed_line = 0  # the input line the output has reached (--answer-only)
    failed = 0
    refuted = 0  # answers their check found wrong
    progress = FileProgress(known, job.env, budget=job.request.ask.max_tokens)
    loading = ProgressNotice(progress.notice)  # above the bar while it is shown

    def emit(index: int) -> None:
        nonlocal failed, printed_line, refuted
        outcome = pending.pop(index)
        job.check_outcome(outcome)
        job.remember(outcome)
        refuted += outcome.refuted
        # Only what the exit status needs is kept, and only of the problems it looks at: a run
        # of a million holds its problems in flight and a window of text read ahead.
        if (
            outcome.error is not None
            or outcome.thinking_unfinished
            or outcome.answer is None
            or outcome.looped
        ):
            flagged.append(
                Printed(outcome.error, outcome.thinking_unfinished, outcome.answer, outcome.looped)
            )
        line = feed.numbers[index]
        feed.printed(index)
        failed += outcome.error is not None
        cut = loop_cut(outcome)
        if cut is not None:
            progress.notice(f"line {line}: {cut}")
        if jsonl:
            progress.out(json_text({"line": line, **outcome.to_json()}))
            if outcome.looped:
                progress.notice(f"line {line}: {no_answer_reason(outcome)}")
            elif outcome.refuted:
                say_check(progress.notice, outcome.check, f"line {line}: ")
        elif mode.answer_only:
            for _blank in range(printed_line + 1, line):
                progress.out("")
            printed_line = line
            progress.out(outcome.answer or "")
            if outcome.error is not None:
                progress.notice(f"line {line}: {outcome.error_message}")
            elif outcome.answer is None or outcome.looped:
                progress.notice(f"line {line}: {no_answer_reason(outcome)}")
            elif outcome.refuted:
                say_check(progress.notice, outcome.check, f"line {line}: ")
        else:
            progress.out(f"[{index + 1}] {echoed(outcome.question)}")
            if outcome.error is not None:
                progress.out(f"error: {outcome.error_message}\n")
            else:
                progress.out(outcome.solution.strip())
                shown = outcome.answer if outcome.answer is not None else "(none)"
                progress.out(f"Answer: {shown}{check_suffix(outcome)}\n")
                if outcome.looped:
                    progress.notice(f"line {line}: {no_answer_reason(outcome)}")

    def on_event(index: int, event: Event) -> None:
        nonlocal next_to_print, count
        while count <= index:  # the first event of a problem (and of any before it)
            pending[count] = Outcome(index=count, question=feed.question(count))
            count += 1
        loading.see(event)
        progress.see(index, event)
        outcome = pending.get(index)
        assert outcome is not None, "no event after the terminal one"
        outcome.apply(event)
        if not outcome.done:
            return
        progress.advance(index)
        while next_to_print < count and pending[next_to_print].done:
            emit(next_to_print)
            next_to_print += 1

    try:
        with progress:
            progress.reading(feed)
            job.run(feed, on_event, restart=True, feed=feed)
    except KeyboardInterrupt:
        # Said once the bar is gone; the exit status is 130 all the same.
        done = (
            f"{next_to_print} of {counted(known, 'problem')}"
            if known is not None
            else counted(next_to_print, "problem")
        )
        job.announce(f"stopped (Ctrl-C) after {done}; the rest were not answered")
        raise
    if feed.failure is not None:
        raise UsageError(feed.failure)
    if not count:
        from phi4cli.client.problems import NO_PROBLEMS

        raise UsageError(NO_PROBLEMS)
    if mode.answer_only and not jsonl:
        for _blank in range(printed_line + 1, feed.total + 1):
            job.print("")  # trailing blank input lines keep their places too
    if failed:
        job.announce(f"{failed} of {count} problems failed")
    if refuted:
        job.announce(f"{refuted} of {count} answers failed their check")
    status = exit_status(flagged, answer_required=mode.answer_only)
    return max(status, ExitStatus.ERROR) if refuted and job.check == "strict" else status


class Printed(NamedTuple):
    """What ``solve_file`` keeps of a printed problem that the exit status looks at (one that
    failed or has no answer): what the exit status asks of it."""

    error: Event | None
    thinking_unfinished: bool
    answer: str | None
    looped: bool


def read_prompt(prompt: str | None, env: Environment) -> str:
    """The question: the argument, or stdin for ``-`` or when no argument is given.

    Stdin is read only then: in ``while read q; do phi4 solve "$q"; done < file`` it is the
    loop's, and ``sleep 100 | phi4 solve "q"`` must not wait for its end.
    """
    from phi4cli.core.inputs import check_text, read_all

    if prompt is not None and prompt != "-":
        text = check_text(prompt, "the question (argument)")
    elif prompt == "-" or not env.stdin_isatty:
        text = read_all(env.stdin).strip("\n")
    else:
        raise UsageError(
            'no question given: phi4 solve "What is 12*13?" or echo ... | phi4 solve -'
        )
    if not text.strip():
        raise UsageError("the question is empty")
    return text


def check_options(o: SolveOptions) -> None:
    """Refuse options that do not go together (UsageError), before anything is read."""
    if (o.file is not None or o.each_line) and o.samples > 1:
        raise UsageError("--samples works on one question, not with --file or --each-line")
    if o.all_samples and o.samples == 1:
        raise UsageError("--all goes with --samples K: solve K times, even once they agree")
    if o.jsonl and o.file is None and not o.each_line:
        raise UsageError("--jsonl goes with --file or --each-line; use --json for one question")
    if o.each_line and o.file is None and o.prompt not in (None, "-"):
        raise UsageError("--each-line reads problems from stdin: phi4 solve - --each-line")
    if o.file is not None and o.prompt is not None:
        # Else the question would be dropped without a word.
        raise UsageError(f"give a question or --file, not both: {o.prompt!r} and {o.file}")


def run_solve(o: SolveOptions, env: Environment | None = None) -> int:
    """`phi4 solve`: one question, K samples, or a file of problems; return the exit status."""
    env = env or Environment()
    env.raw_output = env.raw_output or o.raw_output
    check_options(o)
    reads_file = o.file is not None or o.each_line
    # Checked before anything starts: a file that is not there or not UTF-8 is refused first.
    if reads_file:
        from phi4cli.client.problems import open_problems
    opened = open_problems(o.file or "-", env) if reads_file else None
    question = read_prompt(o.prompt, env) if opened is None else ""
    try:
        job = make_job(env, o.model, o.answer, o.no_instruction, o.as_json or o.verbose)
    except BaseException:
        if opened is not None and opened.owned:
            opened.stream.close()  # nothing has read it yet
        raise
    mode = OutputMode(o.show_reasoning, o.answer_only, o.as_json, o.verbose)
    try:
        if opened is not None:
            return solve_file(job, opened, mode, o.jsonl)
        if o.samples > 1:
            return solve_samples(job, question, o.samples, mode, every=o.all_samples)
        return solve_one(job, question, mode)
    except BrokenPipeError:
        # The reader went away (`| head -1`): leaving here closes the connection, which stops
        # the generation. Point stdout at /dev/null so the exit-time flush is quiet.
        env.stdout_gone()
        return ExitStatus.OK
    finally:
        if job.checker is not None:
            job.checker.close()
