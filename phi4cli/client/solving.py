"""Running ``phi4 solve``: one question, K self-consistency samples, or a file of problems, and
showing the results the way the output calls for (terminal, pipe, ``--json``, ``--answer-only``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from phi4cli.backends.backend import Backend
from phi4cli.backends.outcome import Outcome, exit_status
from phi4cli.client._solve_options import SolveOptions as SolveOptions  # generated from the command
from phi4cli.client.environment import Environment
from phi4cli.client.progress import FileProgress, LoadLine, ProgressNotice, StderrStatus
from phi4cli.client.render import (
    PlainPresenter,
    TerminalPresenter,
    counted,
    loop_cut,
    no_answer_reason,
    no_vote_reason,
    unfinished,
)
from phi4cli.core._settings import Ask
from phi4cli.core.errors import ExitStatus, Phi4Error, UsageError
from phi4cli.core.options import sample_seed
from phi4cli.core.protocol import PRIORITY_BULK, Event, SolveParams
from phi4cli.text.confidence import WARMUP
from phi4cli.text.reasoning import AnswerComparer, majority_vote, vote_settled
from phi4cli.text.sanitize import clean_text, json_safe

if TYPE_CHECKING:
    from phi4cli.backends.dispatch import EventSink, Feed
    from phi4cli.backends.flight import Flight, FlightHook
    from phi4cli.client.keys import AnswerKeys
    from phi4cli.client.problems import (  # imported where --file reads, not before
        Opened,
        ProblemFeed,
    )
    from phi4cli.text.checker import Checker
    from phi4cli.text.checking import Check


class SolveJob(NamedTuple):
    """What answers (the daemon or a remote server) and what every request of this command
    shares."""

    backend: Backend
    env: Environment
    request: SolveParams  # what each request shares: its ask, model, confidence, keep_alive

    def announce(self, message: str) -> None:
        self.env.notice(message)

    def print(self, text: str = "") -> None:
        """One line of model text on stdout: cleaned of control sequences unless the user
        asked for it raw (``--raw-output``, not at a terminal)."""
        shown = text if self.env.raw_stdout else clean_text(text)
        print(shown, file=self.env.stdout, flush=True)

    def print_json(self, record: dict[str, Any], indent: int | None = None) -> None:
        """One JSON text on stdout (:func:`json_text`)."""
        print(json_text(record, indent), file=self.env.stdout, flush=True)

    instruction: str | None = None  # added after each question
    vote: str = "count"  # how samples vote: count | confidence (options' "vote")
    stop_unsure: bool = False  # DeepConf online with --samples (options' "stop_unsure")
    check: str = "auto"  # answers checked against their problem: auto | off | strict
    checker: Checker | None = None  # the check's worker (None: check off)

    def prepare_check(self, question: str) -> None:
        """A request for ``question`` has gone out (call it on its first event, not before the
        request is sent: it compiles the checker's patterns): have its check ready by the time
        it answers."""
        if self.checker is not None and not self.checker.prepared:
            self.checker.prepare(question)

    def check_outcome(self, outcome: Outcome) -> None:
        """Check ``outcome``'s answer against its question (``outcome.check``), if asked to and
        it has one; a failed request is not checked."""
        if self.checker is not None and outcome.error is None and outcome.answer is not None:
            outcome.check = self.checker.check(outcome.question, outcome.answer)

    def check_status(self, outcomes: Sequence[Outcome], status: int) -> int:
        """The exit status once the checks are in: with ``check strict``, 1 for a refuted
        answer."""
        if self.check == "strict" and any(o.refuted for o in outcomes):
            return max(status, ExitStatus.ERROR)
        return status

    def vote_weights(self, outcomes: Sequence[Outcome]) -> list[float] | None:
        """Each answer's weight in a confidence vote (its lowest group confidence); None: a
        vote by count, as asked, because an answer has no confidence (said once), or because
        no answer carries any weight (none was stated): confidence has nothing to weigh."""
        if self.vote != "confidence":
            return None
        weights: list[float] = []
        for outcome in outcomes:
            weight = outcome.stats.lowest_group_confidence if outcome.stats else None
            if weight is None and outcome.answer is not None:
                self.env.notice_once(
                    "an answer has no confidence (its server sent no "
                    "logprobs): the vote counts samples"
                )
                return None
            weights.append(weight or 0.0)  # (an answer of None does not vote)
        if not any(w > 0 for w, o in zip(weights, outcomes, strict=True) if o.answer is not None):
            return None
        return weights

    @property
    def seed(self) -> int | None:
        return self.request.ask.seed

    def params(
        self,
        question: str,
        priority: int | None = None,
        sample_group: int | None = None,
        seed: int | None = None,
    ) -> SolveParams:
        """The request for ``question`` (the instruction after it): at ``priority``, one of
        ``sample_group``'s samples, or with its own ``seed`` (sample k's of a seeded run)."""
        prompt = f"{question}\n\n{self.instruction}" if self.instruction else question
        request = self.request._replace(prompt=prompt, sample_group=sample_group)
        if priority is not None:
            request = request._replace(priority=priority)
        if seed is not None:
            request = request._replace(ask=request.ask._replace(seed=seed))
        return request

    def run(
        self,
        requests: Sequence[SolveParams | Event],
        on_event: EventSink,
        restart: bool = False,
        feed: Feed | None = None,
        on_flight: FlightHook | None = None,
    ) -> None:
        """Send ``requests``; ``restart``: the caller folds each request's events and takes a
        ``restart`` event (a request sent again elsewhere after its engine failed mid-answer);
        ``feed``: more requests are coming; ``on_flight``: given the flight, to cancel with
        (see :meth:`Backend.run`)."""
        self.backend.run(requests, on_event, restart=restart, feed=feed, on_flight=on_flight)


def json_text(record: Any, indent: int | None = None) -> str:
    """One JSON text of a command's output (``--json``, ``--jsonl``, a results file): exact,
    strict (a number that is not finite is null: NaN and Infinity are not JSON, and strict
    parsers refuse them), and with nothing in it a terminal would act on."""
    text = json.dumps(_finite(record), ensure_ascii=False, indent=indent, allow_nan=False)
    return json_safe(text)


def _finite(value: Any) -> Any:
    """``value`` with each float that is not finite made None, in its lists and dicts too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


class OutputMode(NamedTuple):
    show_reasoning: bool = False
    answer_only: bool = False
    as_json: bool = False
    verbose: bool = False


def _print_json(job: SolveJob, record: dict[str, Any]) -> None:
    job.print_json(record, indent=2)


def _answer_line(job: SolveJob, answer: str) -> str:
    if job.env.terminal:
        from phi4cli.text.latex import math_to_unicode

        return math_to_unicode(answer)
    return answer


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
        raise failure
    job.check_outcome(outcome)
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
    # A loop stopped is said in every mode (at a terminal with an answer shown, too).
    # An answer cut off at --max-tokens is said in a pipe too, as at a terminal (--json has
    # its finish_reason).
    plain_terminal = not (mode.as_json or mode.answer_only) and job.env.terminal
    cut_off = (
        outcome.answer is None
        and outcome.stats is not None
        and outcome.stats.finish_reason == "length"
        and not mode.as_json
    )
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


def say_check(notice: Callable[[str], None], check: Check | None, where: str = "") -> None:
    """A checked answer's verdict on stderr, for output without an ``Answer:`` line to show it
    beside (a pipe, ``--answer-only``, a file of problems' line ``where``): one line, for a
    verdict reached."""
    said = _verdict_line(check)
    if said is not None:
        notice(f"{where}{said}")


def _verdict_line(check: Check | None) -> str | None:
    from phi4cli.client.render import check_line

    return None if check is None else check_line(check)


def _keep_partial(
    presenter: PlainPresenter | TerminalPresenter | None, outcome: Outcome, error: Phi4Error
) -> None:
    """An error ended the answer: what streamed of it stays on the screen, as after Ctrl-C
    (a live region would be erased), and ``error``'s line, said last, says it is unfinished."""
    if presenter is not None:
        presenter.show_partial(outcome)
        error.args = (unfinished(outcome, str(error)),)


def votes(outcomes: Sequence[Outcome]) -> list[str | None]:
    """Each sample's vote: its answer, none for one that failed (what it wrote before it failed
    is not an answer, though it may hold a \\boxed{}).

    Checked answers weigh first: where any answer was verified, only verified answers vote;
    else a refuted answer does not vote, while another answer does (one refuted is wrong, one
    unchecked may be right)."""
    answers = [o.answer if o.error is None else None for o in outcomes]
    if any(o.verified and a is not None for o, a in zip(outcomes, answers, strict=True)):
        return [a if o.verified else None for o, a in zip(outcomes, answers, strict=True)]
    kept = [None if o.refuted else a for o, a in zip(outcomes, answers, strict=True)]
    return kept if any(a is not None for a in kept) else answers


def checked_agreement(outcomes: Sequence[Outcome], answers: Sequence[str | None]) -> str:
    """What the checks did to a vote, for its agreement line: ``, 2 refuted set aside``, or
    nothing (a verified winner says so in its check, beside the answer)."""
    dropped = sum(
        o.refuted and o.answer is not None and a is None
        for o, a in zip(outcomes, answers, strict=True)
    )
    if dropped:
        return f", {dropped} refuted set aside"
    return ""


class EarlyStop:
    """One question's K samples, stopped once their vote is settled
    (:func:`reasoning.vote_settled`, the Beta rule of Adaptive-Consistency): which have ended,
    the answers of those that vote, and which were cancelled. ``cancel(k)`` stops sample k;
    None: all K are taken (``--all``). `solve -k` keeps one, `eval -k` one per problem.

    ``adjust(k, floor)`` (``--stop-unsure``, DeepConf online): once the first WARMUP samples
    have ended, the floor their confidences set (``confidence.floor_from``) goes to each
    sample not ended; one that falls below it ends ``unsure`` and does not vote."""

    def __init__(
        self,
        samples: int,
        compare: AnswerComparer,
        cancel: Callable[[int], None] | None,
        adjust: Callable[[int, float], None] | None = None,
    ) -> None:
        self.samples, self.compare, self.cancel, self.adjust = samples, compare, cancel, adjust
        self.ended: set[int] = set()
        self.answers: list[str | None] = []  # of the samples that vote, as they ended
        self.stopped: set[int] = set()  # cancelled because the vote was settled
        self.unsure: set[int] = set()  # stopped below the floor (--stop-unsure)
        self.warmup: list[float] = []  # the first samples' lowest group confidences
        self.floor: float | None = None

    def end(self, k: int, outcome: Outcome) -> None:
        """Sample ``k`` has its terminal event: it votes, unless it was cancelled or stopped as
        unsure; a vote settled by it cancels the samples that have not ended."""
        self.ended.add(k)
        if k in self.stopped:
            if outcome.error is None:
                self.stopped.discard(k)  # it had finished before its cancel reached it: it votes
                if outcome.unsure:
                    self.unsure.add(k)
            return
        if outcome.unsure:
            self.unsure.add(k)
        else:
            # A failed sample's partial trace says nothing: it is counted, with no answer; a
            # refuted answer does not vote.
            refuted = outcome.refuted
            self.answers.append(outcome.answer if outcome.error is None and not refuted else None)
            if outcome.error is None:  # (a failed one's partial trace says nothing)
                self._warm(outcome)
        left = self.samples - len(self.ended)
        if self.cancel is None or not left:
            return
        if outcome.verified or vote_settled(majority_vote(self.answers, equal=self.compare), left):
            rest = [i for i in range(self.samples) if i not in self.ended]
            self.stopped.update(rest)
            for i in rest:
                self.cancel(i)

    def _warm(self, outcome: Outcome) -> None:
        """Count a finished sample's confidence towards the floor, and set it once there are
        WARMUP of them."""
        from phi4cli.text.confidence import WARMUP, floor_from

        confidence = outcome.stats.lowest_group_confidence if outcome.stats else None
        if self.adjust is None or self.floor is not None or confidence is None:
            return
        self.warmup.append(confidence)
        if len(self.warmup) < min(WARMUP, self.samples):
            return
        self.floor = floor = floor_from(self.warmup)
        for i in range(self.samples):
            if i not in self.ended and floor is not None:
                self.adjust(i, floor)


def solve_samples(
    job: SolveJob, question: str, samples: int, mode: OutputMode, every: bool = False
) -> int:
    """Solve the same question up to ``samples`` times and majority-vote the answers. Unless
    ``every``, sampling stops once the vote is settled (:func:`reasoning.vote_settled`, the
    Beta rule of Adaptive-Consistency): the samples not finished then are cancelled, their
    memory freed at once, and the vote is over those that finished."""
    outcomes = [Outcome(index=i, question=question) for i in range(samples)]
    seed = job.seed
    # One group: a remote server that takes ``n`` is asked for them in one request.
    requests = [
        job.params(question, seed=None if seed is None else sample_seed(seed, i), sample_group=0)
        for i in range(samples)
    ]
    flight: list[Flight] = []
    compare = AnswerComparer()
    stop = EarlyStop(
        samples,
        compare,
        None if every else lambda k: flight[0].cancel(k),
        (lambda k, floor: flight[0].adjust(k, floor))
        if job.stop_unsure and samples > WARMUP
        else None,
    )
    spinner = StderrStatus(job.env, f"sampling… 0/{samples} done")
    loading = ProgressNotice(job.announce, LoadLine(job.env, spinner))

    def on_event(index: int, event: Event) -> None:
        job.prepare_check(question)  # (once: on the first event, the requests sent)
        loading.see(event)
        spinner.see(event)
        outcomes[index].apply(event)
        if outcomes[index].done:
            if index not in stop.stopped:
                job.check_outcome(outcomes[index])
            stop.end(index, outcomes[index])
            spinner.update(f"sampling… {len(stop.answers)}/{samples} done")

    try:
        job.run(requests, on_event, restart=True, on_flight=flight.append)
    finally:
        loading.stop()
        spinner.stop()
    used = [o for o in outcomes if o.index not in stop.stopped]
    good = [o for o in used if o.error is None]
    if not good:
        raise used[0].exception()
    failed = [o for o in used if o.error is not None]
    if failed:
        # The vote is over the samples that answered; say what the others met, once.
        job.announce(
            f"{len(failed)} of {len(used)} samples failed and are not counted: "
            f"{failed[0].exception()}"
        )
    weights = job.vote_weights(used)
    voted = votes(used)
    vote = majority_vote(voted, equal=compare, weights=weights)
    notice = compare.notice()
    if notice:
        job.announce(notice)
    # "4/4 samples agree, stopped after 4 of 8": the early stop said where the vote is.
    agree = f"{vote.agreement} samples agree" + (
        f", stopped after {len(used)} of {samples}" if stop.stopped else ""
    )
    if stop.unsure:
        agree += f", {len(stop.unsure)} stopped as unsure"
    if weights is not None:  # (None where no confidence weighed: a vote by count)
        agree += ", weighted by confidence"
    agree += checked_agreement(used, voted)
    # No sample stated an answer: nothing was voted for, and the command has failed (exit 1)
    # in every output mode, with one line saying why and what to do.
    missing = no_vote_reason(used) if vote.answer is None else None
    status = ExitStatus.OK if missing is None else ExitStatus.ERROR
    # Shown: a sample that gave the winning answer in the form reported, else any that agreed.
    agreeing = [used[i] for i in vote.members]
    winner = next(
        (o for o in agreeing if o.answer == vote.answer), agreeing[0] if agreeing else good[0]
    )
    if mode.as_json:
        record = winner.to_json()
        record.update(
            answer=vote.answer,
            agreement=vote.agreement,
            tie=vote.tie,
            samples_asked=samples,
            samples_used=len(used),
            vote="confidence" if weights is not None else "count",
            # A cancelled sample was cut off mid-way: what it had written states no answer.
            samples=[
                {
                    "answer": None if o.index in stop.stopped else o.answer,
                    "seed": o.stats.seed if o.stats else None,
                    "error": None if o.index in stop.stopped else o.to_json().get("error"),
                    "cancelled": o.index in stop.stopped,
                    "unsure": o.index in stop.unsure,
                    "check": None if o.check is None else o.check.to_json(),
                    "stats": o.stats_dict,
                }
                for o in outcomes
            ],
        )
        if job.stop_unsure and samples > WARMUP:
            record["confidence_floor"] = stop.floor
        _print_json(job, record)
    elif mode.answer_only:
        job.print(_answer_line(job, vote.answer) if vote.answer is not None else "")
        if missing is None:
            job.announce(agree + (" (tie)" if vote.tie else ""))
            say_check(job.announce, winner.check)
    elif job.env.terminal:
        presenter = TerminalPresenter(mode.show_reasoning, mode.verbose, job.env)
        presenter.print_outcome(winner, agreement=agree, answer=vote.answer, reason=missing)
        return job.check_status([winner], status)  # (the presenter has said why there is none)
    else:
        job.print(winner.solution.strip())
        shown = vote.answer if vote.answer is not None else "(none)"
        job.print(f"Answer: {shown} ({agree}){_check_suffix(winner)}")
    if missing is not None:
        job.announce(missing)
    return job.check_status([winner] if missing is None else [], status)


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
                progress.out(f"Answer: {shown}{_check_suffix(outcome)}\n")
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


def _check_suffix(outcome: Outcome) -> str:
    """A verdict reached, beside a plain ``Answer:`` line: ``  (✓ verified: 12·13 = 156)``."""
    said = _verdict_line(outcome.check)
    return f"  ({said})" if said is not None else ""


class Printed(NamedTuple):
    """What ``solve_file`` keeps of a printed problem that the exit status looks at (one that
    failed or has no answer): what the exit status asks of it."""

    error: Event | None
    thinking_unfinished: bool
    answer: str | None
    looped: bool


class Requests(Sequence[SolveParams]):
    """A run's requests, each made when it is sent (a 10,000-line file holds its questions, not
    10,000 requests)."""

    def __init__(self, make: Callable[[int], SolveParams], length: int) -> None:
        self._make, self._length = make, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._make(i) for i in range(*index.indices(self._length))]
        if not -self._length <= index < self._length:
            raise IndexError(index)
        return self._make(index % self._length)


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


def check_sent_text(settings: Any) -> None:
    """Refuse, before any daemon starts, settings text that cannot be sent as UTF-8 (bytes that
    were not UTF-8 in an argument or a PHI4_* variable)."""
    from phi4cli.core.inputs import check_text

    for value, where in (
        (settings.system, "the system prompt (-s/--system or PHI4_SYSTEM)"),
        (settings.instruction, "the instruction (PHI4_INSTRUCTION or the config)"),
        (settings.model, "the model (-m/--model or PHI4_MODEL)"),
        *((url, "the backend URL (--backend or PHI4_BACKEND)") for url in settings.backend or ()),
    ):
        if isinstance(value, str):
            check_text(value, where)


def make_job(
    env: Environment,
    model: str | None,
    answer_options: dict[str, Any],
    no_instruction: bool,
    confidence: bool = False,
) -> SolveJob:
    """Settings, model and backend for a command that solves (solve, eval): what each request
    it sends shares; ``confidence``: each answer's confidence is worked out (for what shows
    it), at a pass over the vocabulary per token."""
    from phi4cli.backends.backend import make_backend
    from phi4cli.core.config import load_settings, set_in_environment
    from phi4cli.core.models import resolve_model

    paths = env.paths
    settings = load_settings(paths.config_file, {"model": model, **answer_options})
    check_sent_text(settings)
    model_path = None if settings.backend else resolve_model(settings.model, paths)
    keep_alive = answer_options.get("keep_alive") is not None or set_in_environment("keep_alive")
    request = SolveParams(
        prompt="",
        ask=Ask.of(settings),
        model=str(model_path or settings.model),
        keep_alive=settings.keep_alive if keep_alive else None,
        confidence=confidence or settings.vote == "confidence" or settings.stop_unsure,
    )
    backend = make_backend(paths, settings, model_path or settings.model, env.notice)
    instruction = None if no_instruction else settings.instruction
    checker = None
    if settings.check != "off":
        from phi4cli.text.checker import Checker

        checker = Checker()
    return SolveJob(
        backend,
        env,
        request,
        instruction=instruction,
        vote=settings.vote,
        stop_unsure=settings.stop_unsure,
        check=settings.check,
        checker=checker,
    )


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
