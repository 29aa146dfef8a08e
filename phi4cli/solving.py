"""Running ``phi4 solve``: one question, K self-consistency samples, or a file of problems, and
showing the results the way the output calls for (terminal, pipe, ``--json``, ``--answer-only``).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence

from phi4cli.backends import Backend
from phi4cli.confidence import WARMUP
from phi4cli.environment import Environment
from phi4cli.errors import ExitStatus, UsageError
from phi4cli.exits import Announce
from phi4cli.options import sample_seed
from phi4cli.outcome import Outcome, exit_status
from phi4cli.protocol import ErrorCode, Event, EventKind
from phi4cli.reasoning import AnswerComparer, majority_vote, vote_settled
from phi4cli.records import Record
from phi4cli.render import (
    PlainPresenter,
    TerminalPresenter,
    human_seconds,
    no_answer_reason,
    no_vote_reason,
)
from phi4cli.sanitize import clean_text, json_safe

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from phi4cli.dispatch import EventSink, Feed, Flight, FlightHook


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
                self.env.notice_once("an answer has no confidence (its server sent no "
                                     "logprobs): the vote counts samples")  # fmt: skip
                return None
            weights.append(weight or 0.0)  # (an answer of None does not vote)
        if not any(w > 0 for w, o in zip(weights, outcomes, strict=True) if o.answer is not None):
            return None
        return weights

    def params(self, question: str, **extra: Any) -> dict[str, Any]:
        prompt = f"{question}\n\n{self.instruction}" if self.instruction else question
        return {**self.base, "prompt": prompt, **extra}

    def run(
        self,
        requests: Sequence[dict[str, Any] | Event],
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


class OutputMode(Record):
    show_reasoning: bool = False
    answer_only: bool = False
    as_json: bool = False
    verbose: bool = False


class _StderrStatus:
    """A spinner line on stderr while waiting, for a person at a terminal.

    Started on the first event, not before: the request is on its way to the daemon before rich
    is imported. Not in a pipeline (stdout redirected): plain text only there.
    """

    def __init__(self, env: Environment, message: str) -> None:
        self._wanted = env.terminal and bool(env.stderr_isatty)
        self._env, self._message = env, message  # text, or a renderable
        self._status: Any = None

    @property
    def message(self) -> Any:
        return self._message

    def update(self, message: Any) -> None:
        """Show ``message``: text, or anything rich renders (a ``LoadLine``)."""
        self._message = message
        if self._status is not None:
            self._status.update(message)

    def see(self, _event: Event) -> None:
        if self._wanted and self._status is None:
            from rich.console import Console

            console = Console(file=self._env.stderr, force_terminal=True)
            self._status = console.status(self._message, spinner="dots")
            self._status.start()
            self._env.print_above_live = _printer(console)

    def stop(self) -> None:
        if self._status is not None:
            self._env.print_above_live = None
            self._status.stop()
            self._status = None


def _printer(console: Any) -> Callable[[str], None]:
    """Print a line through ``console``: above its live display, while one is shown."""

    def print_line(text: str) -> None:
        console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)

    return print_line


def _print_json(job: SolveJob, record: dict[str, Any]) -> None:
    job.print_json(record, indent=2)


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
                    self.env.stdout,
                    self.env.stderr,
                    mode.show_reasoning,
                    mode.verbose,
                    raw=self.env.raw_stdout,
                )
            )
        return self.presenter


def solve_one(job: SolveJob, question: str, mode: OutputMode) -> int:
    """Stream one question's answer; return the exit status."""
    outcome = Outcome(index=0, question=question)
    quiet = mode.as_json or mode.answer_only
    presenter = _LazyPresenter(job.env, mode)
    spinner = _StderrStatus(job.env, "solving…")
    loading = ProgressNotice(job.announce, LoadLine(job.env, spinner if quiet else None))

    def on_event(_index: int, event: Event) -> None:
        loading.see(event)
        outcome.apply(event)
        if quiet:
            spinner.see(event)
        else:
            presenter.get().on_event(event)

    try:
        job.run([job.params(question)], on_event)
    except KeyboardInterrupt:
        # What streamed stays on the screen (a live region would be erased), with a line
        # saying it stopped there; the exit status is 130 all the same.
        loading.stop()
        spinner.stop()
        if presenter.presenter is not None:
            presenter.presenter.show_partial(outcome)
        job.announce("stopped (Ctrl-C): the answer above is unfinished" if outcome.solution.strip()
                     else "stopped (Ctrl-C) before the answer began")  # fmt: skip
        raise
    finally:
        loading.stop()
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
    # A loop stopped is said in every mode (at a terminal with an answer shown, too).
    plain_terminal = not (mode.as_json or mode.answer_only) and job.env.terminal
    if (not plain_terminal and (outcome.thinking_unfinished or outcome.looped
                                or (mode.answer_only and outcome.answer is None))) \
            or (plain_terminal and outcome.looped and outcome.answer is not None):  # fmt: skip
        job.announce(no_answer_reason(outcome))
    return exit_status([outcome], answer_required=mode.answer_only)


def votes(outcomes: Sequence[Outcome]) -> list[str | None]:
    """Each sample's vote: its answer, none for one that failed (what it wrote before it failed
    is not an answer, though it may hold a \\boxed{})."""
    return [o.answer if o.error is None else None for o in outcomes]


class EarlyStop:
    """One question's K samples, stopped once their vote is settled
    (:func:`reasoning.vote_settled`, the Beta rule of Adaptive-Consistency): which have ended,
    the answers of those that vote, and which were cancelled. ``cancel(k)`` stops sample k;
    None: all K are taken (``--all``). `solve -k` keeps one, `eval -k` one per problem.

    ``adjust(k, params)`` (``--stop-unsure``, DeepConf online): once the first WARMUP samples
    have ended, the floor their confidences set (``confidence.floor_from``) goes to each
    sample not ended; one that falls below it ends ``unsure`` and does not vote."""

    def __init__(self, samples: int, compare: AnswerComparer,
                 cancel: Callable[[int], None] | None,
                 adjust: Callable[[int, dict[str, Any]], None] | None = None) -> None:  # fmt: skip
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
            # A failed sample's partial trace says nothing: it is counted, with no answer.
            self.answers.append(outcome.answer if outcome.error is None else None)
            if outcome.error is None:  # (a failed one's partial trace says nothing)
                self._warm(outcome)
        left = self.samples - len(self.ended)
        if self.cancel is None or not left:
            return
        if vote_settled(majority_vote(self.answers, equal=self.compare), left):
            rest = [i for i in range(self.samples) if i not in self.ended]
            self.stopped.update(rest)
            for i in rest:
                self.cancel(i)

    def _warm(self, outcome: Outcome) -> None:
        """Count a finished sample's confidence towards the floor, and set it once there are
        WARMUP of them."""
        from phi4cli.confidence import WARMUP, floor_from

        confidence = outcome.stats.lowest_group_confidence if outcome.stats else None
        if self.adjust is None or self.floor is not None or confidence is None:
            return
        self.warmup.append(confidence)
        if len(self.warmup) < min(WARMUP, self.samples):
            return
        self.floor = floor_from(self.warmup)
        for i in range(self.samples):
            if i not in self.ended:
                self.adjust(i, {"confidence_floor": self.floor})


def solve_samples(job: SolveJob, question: str, samples: int, mode: OutputMode,
                  every: bool = False) -> int:  # fmt: skip
    """Solve the same question up to ``samples`` times and majority-vote the answers. Unless
    ``every``, sampling stops once the vote is settled (:func:`reasoning.vote_settled`, the
    Beta rule of Adaptive-Consistency): the samples not finished then are cancelled, their
    memory freed at once, and the vote is over those that finished."""
    outcomes = [Outcome(index=i, question=question) for i in range(samples)]
    seed = job.seed
    # One group: a remote engine that takes ``n`` is asked for them in one request.
    requests = [
        job.params(question, seed=None if seed is None else sample_seed(seed, i),
                   sample_group=0)
        for i in range(samples)
    ]  # fmt: skip
    flight: list[Flight] = []
    compare = AnswerComparer()
    stop = EarlyStop(samples, compare, None if every else lambda k: flight[0].cancel(k),
                     (lambda k, params: flight[0].adjust(k, params))
                     if job.stop_unsure and samples > WARMUP else None)  # fmt: skip
    spinner = _StderrStatus(job.env, f"sampling… 0/{samples} done")
    loading = ProgressNotice(job.announce, LoadLine(job.env, spinner))

    def on_event(index: int, event: Event) -> None:
        loading.see(event)
        spinner.see(event)
        outcomes[index].apply(event)
        if outcomes[index].done:
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
        job.announce(f"{len(failed)} of {len(used)} samples failed and are not counted: "
                     f"{failed[0].exception()}")  # fmt: skip
    weights = job.vote_weights(used)
    vote = majority_vote(votes(used), equal=compare, weights=weights)
    notice = compare.notice()
    if notice:
        job.announce(notice)
    # "4/4 samples agree, stopped after 4 of 8": the early stop said where the vote is.
    agree = f"{vote.agreement} samples agree" + (f", stopped after {len(used)} of {samples}"
                                                 if stop.stopped else "")  # fmt: skip
    if stop.unsure:
        agree += f", {len(stop.unsure)} stopped as unsure"
    if weights is not None:  # (None where no confidence weighed: a vote by count)
        agree += ", weighted by confidence"
    # No sample stated an answer: nothing was voted for, and the command has failed (exit 1)
    # in every output mode, with one line saying why and what to do.
    missing = no_vote_reason(used) if vote.answer is None else None
    status = ExitStatus.OK if missing is None else ExitStatus.ERROR
    # Shown: a sample that gave the winning answer in the form reported, else any that agreed.
    agreeing = [used[i] for i in vote.members]
    winner = next((o for o in agreeing if o.answer == vote.answer),
                  agreeing[0] if agreeing else good[0])  # fmt: skip
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
                {"answer": None if o.index in stop.stopped else o.answer,
                 "seed": o.stats.seed if o.stats else None,
                 "error": None if o.index in stop.stopped else o.to_json().get("error"),
                 "cancelled": o.index in stop.stopped, "unsure": o.index in stop.unsure,
                 "stats": o.stats_dict}
                for o in outcomes
            ],
        )  # fmt: skip
        if job.stop_unsure and samples > WARMUP:
            record["confidence_floor"] = stop.floor
        _print_json(job, record)
    elif mode.answer_only:
        job.print(_answer_line(job, vote.answer) if vote.answer is not None else "")
        if missing is None:
            job.announce(agree + (" (tie)" if vote.tie else ""))
    elif job.env.terminal:
        presenter = TerminalPresenter(mode.show_reasoning, mode.verbose, job.env)
        presenter.print_outcome(winner, agreement=agree, answer=vote.answer, reason=missing)
        return status  # (the presenter has said why there is no answer)
    else:
        job.print(winner.solution.strip())
        shown = vote.answer if vote.answer is not None else "(none)"
        job.print(f"Answer: {shown} ({agree})")
    if missing is not None:
        job.announce(missing)
    return status


AHEAD = 4096  # problems read ahead of the last one printed, at most (more than any window)
NO_PROBLEMS = "no problems: the input has no non-blank lines"
ECHO_CHARS = 2000  # of a question, echoed above its solution; a longer one is shortened


def echoed(question: str) -> str:
    """A question as the human output echoes it: whole, or its start and how long it is (a
    megabyte line refused as too long is not worth a megabyte of screen)."""
    if len(question) <= ECHO_CHARS:
        return question
    return f"{question[: ECHO_CHARS // 2]}… ({len(question):,} characters)"


class ProblemFeed(Sequence["dict[str, Any] | Event"]):  # a string: typing is not imported to run
    """The non-blank lines of a file or of stdin, each a problem, read as the run goes: a pipe's
    first problems are answered while its later lines are still being written, and a file of a
    million lines is never held at once (at most :data:`AHEAD` problems ahead of the output).

    It is the run's list of requests, growing as lines come (``len`` is what has come so far,
    ``ended`` once the input has), and the flight's :class:`~phi4cli.dispatch.Feed`. Lines are
    numbered as ``str.splitlines`` numbers them. A line of a pipe that is not UTF-8 is that
    problem's error (the lines before it were already on their way); a file's, and a file's
    on stdin, are refused before anything is sent (:func:`open_problems`).
    """

    def __init__(self, source: Any, where: str, make: Callable[[str], dict[str, Any]]) -> None:
        import threading

        self.where, self._make = where, make
        self.numbers: list[int] = []  # the input line of each problem
        self._texts: list[str | Event | None] = []  # None once printed
        self.total = 0  # lines read, blank ones too
        self.ended = False
        self.failure: str | None = None  # why the input could not be read to its end
        self._printed = 0
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(source,), daemon=True,
                                        name="phi4-input")  # fmt: skip
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
    from phi4cli.inputs import HOW_TO_FIX, check_text

    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            message = (f"{where} line {number} is not valid UTF-8 (byte 0x{raw[exc.start]:02x}): "
                       f"{HOW_TO_FIX}")  # fmt: skip
            return [Event.error(ErrorCode.BAD_REQUEST, message)]
    else:
        try:
            text = check_text(raw, f"{where} line {number}")
        except UsageError as exc:
            return [Event.error(ErrorCode.BAD_REQUEST, str(exc))]
    return list(text.splitlines() or [""])


def _raw_lines(stream: Any) -> Any:
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


class Opened(Record):
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


def solve_file(job: SolveJob, opened: Opened, mode: OutputMode, jsonl: bool) -> int:
    """Answer every problem of an input (:func:`open_problems`) as it is read, at most a
    window at once, printed in input order; exit 1 if any failed.

    With ``--answer-only`` output line N belongs to input line N: a blank input line gets an
    empty output line. ``--jsonl`` records skip blank lines and carry their ``line`` number.
    """
    source = opened.stream if opened.known is not None else _raw_lines(opened.stream)
    feed = ProblemFeed(source, opened.where, lambda q: job.params(q, priority="bulk"))
    try:
        return _solve_feed(job, feed, opened.known, mode, jsonl)
    finally:
        # Not while the reader is still in a read of a pipe: closing waits for it (a FIFO
        # whose writer is slow), and the process is ending anyway.
        if opened.owned and feed.ended:
            opened.stream.close()


def _solve_feed(job: SolveJob, feed: ProblemFeed, known: int | None, mode: OutputMode,
                jsonl: bool) -> int:  # fmt: skip
    pending: dict[int, Outcome] = {}  # problems begun and not printed yet
    flagged: list[Printed] = []  # of those printed, what the exit status looks at
    count = 0  # problems begun
    next_to_print = 0
    printed_line = 0  # the input line the output has reached (--answer-only)
    failed = 0
    progress = FileProgress(known, job.env, budget=job.base.get("max_tokens"))
    loading = ProgressNotice(progress.notice)  # above the bar while it is shown

    def emit(index: int) -> None:
        nonlocal failed, printed_line
        outcome = pending.pop(index)
        # Only what the exit status needs is kept, and only of the problems it looks at: a run
        # of a million holds its problems in flight and a window of text read ahead.
        if outcome.error is not None or outcome.thinking_unfinished or outcome.answer is None \
                or outcome.looped:  # fmt: skip
            flagged.append(Printed(outcome.error, outcome.thinking_unfinished, outcome.answer,
                                   outcome.looped))  # fmt: skip
        line = feed.numbers[index]
        feed.printed(index)
        failed += outcome.error is not None
        if jsonl:
            progress.out(json_text({"line": line, **outcome.to_json()}))
            if outcome.looped:
                progress.notice(f"line {line}: {no_answer_reason(outcome)}")
        elif mode.answer_only:
            for _blank in range(printed_line + 1, line):
                progress.out("")
            printed_line = line
            progress.out(outcome.answer or "")
            if outcome.error is not None:
                progress.notice(f"line {line}: {outcome.error_message}")
            elif outcome.answer is None or outcome.looped:
                progress.notice(f"line {line}: {no_answer_reason(outcome)}")
        else:
            progress.out(f"[{index + 1}] {echoed(outcome.question)}")
            if outcome.error is not None:
                progress.out(f"error: {outcome.error_message}\n")
            else:
                progress.out(outcome.solution.strip())
                shown = outcome.answer if outcome.answer is not None else "(none)"
                progress.out(f"Answer: {shown}\n")
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

    with progress:
        progress.reading(feed)
        job.run(feed, on_event, restart=True, feed=feed)
    if feed.failure is not None:
        raise UsageError(feed.failure)
    if not count:
        raise UsageError(NO_PROBLEMS)
    if mode.answer_only and not jsonl:
        for _blank in range(printed_line + 1, feed.total + 1):
            job.print("")  # trailing blank input lines keep their places too
    if failed:
        job.announce(f"{failed} of {count} problems failed")
    return exit_status(flagged, answer_required=mode.answer_only)


class Printed(Record):
    """What ``solve_file`` keeps of a printed problem that the exit status looks at (one that
    failed or has no answer): what the exit status asks of it."""

    error: Event | None
    thinking_unfinished: bool
    answer: str | None
    looped: bool


class Requests(Sequence["dict[str, Any]"]):  # a string: typing is not imported to run
    """A run's requests, each made when it is sent (a 10,000-line file holds its questions, not
    10,000 request dicts)."""

    def __init__(self, make: Callable[[int], dict[str, Any]], length: int) -> None:
        self._make, self._length = make, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._make(i) for i in range(*index.indices(self._length))]
        if not -self._length <= index < self._length:
            raise IndexError(index)
        return self._make(index % self._length)


class FileProgress:
    """A progress bar on stderr for `--file` and `eval`, only when stderr is a terminal.

    From the start it shows n/N done, how many problems are being solved, and the time taken;
    once one is done, the rate and the time left. With a token ``budget`` (``--max-tokens``) the
    bar also moves as the model writes: a problem counts for the share of its budget it has
    used (at most 0.95 until it is done). While it is shown, lines for the terminal (``notice``,
    and ``out`` when stdout is a terminal too) are printed above the bar through rich's live
    console, never onto the bar's line.
    """

    def __init__(self, total: int | None, env: Environment, label: str = "solving",
                 budget: int | None = None) -> None:  # fmt: skip
        self.total = total  # None: not known yet (a pipe); :meth:`reading` follows the input
        self._feed: ProblemFeed | None = None
        self.env = env
        self.label = label
        self.budget = budget
        self._progress: Any = None
        self._task: Any = None
        self._started: set[int] = set()  # running: the model has written for them
        self._done = 0
        self._pieces: dict[int, int] = {}  # pieces of text written, per running problem
        self._loading = False

    def __enter__(self) -> FileProgress:
        if self.env.stderr_isatty:
            from rich import progress as bar
            from rich.console import Console

            console = Console(file=self.env.stderr, force_terminal=True)
            self._progress = bar.Progress(
                bar.TextColumn("{task.description}"),
                bar.BarColumn(),
                bar.TextColumn("{task.fields[done]}/{task.fields[of]}"),  # done, not partial
                bar.TextColumn("{task.fields[activity]}"),
                bar.TimeElapsedColumn(),
                _RateColumn(),
                console=console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=self.total or 1, activity="",
                                                 done=0, of=self._of(),
                                                 known=self.total is not None)  # fmt: skip
            self._progress.refresh()  # 0/N at once, not at the first tick
            self.env.print_above_live = self._print_above
        return self

    def reading(self, feed: ProblemFeed) -> None:
        """The problems come from ``feed`` (a pipe, its length unknown until it ends): N in
        n/N is what has come so far, with a ``+`` until the input ends."""
        self._feed = feed

    def _of(self) -> str:
        if self.total is not None:
            return str(self.total)
        if self._feed is None:
            return "?"
        return f"{len(self._feed)}" + ("" if self._feed.ended else "+")

    def see(self, index: int, event: Event) -> None:
        """Follow one request's event: it has started once the model writes for it."""
        if self._progress is None:
            return
        kind = event.kind
        loading = (kind == EventKind.ACCEPTED and event.get("state") in ("loading", "warming")) or (
            kind == EventKind.PROGRESS and event.get("stage") == "loading"
        )
        if kind == EventKind.RESTART:  # sent again: its pieces so far do not count
            self._pieces.pop(index, None)
            return
        if loading:
            self._loading = True
        elif kind in (EventKind.REASONING, EventKind.TOKEN):
            self._pieces[index] = self._pieces.get(index, 0) + 1
            if index in self._started:
                if self.budget:
                    self._show_completed()
                return
            self._started.add(index)
            self._loading = False
        else:
            return
        self._show_activity()

    def advance(self, index: int) -> None:
        """Problem ``index`` is done."""
        if self._progress is not None:
            self._done += 1
            self._started.discard(index)
            self._pieces.pop(index, None)
            self._show_completed()
            self._show_activity()

    def _show_completed(self) -> None:
        partial = 0.0
        if self.budget:
            partial = sum(min(n / self.budget, 0.95) for n in self._pieces.values())
        done = self._done
        if self.total is None and self._feed is not None:
            known = self._feed.ended
            self._progress.update(self._task, total=max(len(self._feed), 1), of=self._of(),
                                  known=known)  # fmt: skip
        self._progress.update(self._task, completed=done + partial, done=done)

    def _show_activity(self) -> None:
        running = len(self._started)
        activity = "loading the model" if self._loading else f"{running} running" if running else ""
        self._progress.update(self._task, activity=activity)

    def notice(self, message: str) -> None:
        """One ``phi4:`` line on stderr: above the bar while it is shown (as is every
        ``env.notice`` then, the backend's included)."""
        self.env.notice(message)

    def out(self, text: str) -> None:
        """A line of output on stdout; above the bar when stdout is the bar's terminal too.
        Cleaned of control sequences as ``SolveJob.print`` does (unless ``--raw-output``)."""
        text = text if self.env.raw_stdout else clean_text(text)
        if self._progress is not None and self.env.stdout_isatty:
            self._print_above(text)
        else:
            print(text, file=self.env.stdout, flush=True)

    def _print_above(self, text: str) -> None:
        _printer(self._progress.console)(text)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self.env.print_above_live = None
            self._progress.stop()
            self._progress = None


def _RateColumn() -> Any:
    """A rich column: problems a minute (or a second) and the time left, once one is done
    (from the problems done, not the bar's share of budgets, which only guesses)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            elapsed, done = task.elapsed or 0.0, task.fields.get("done", 0)
            if not done or elapsed <= 0:
                return Text("")
            rate = done / elapsed
            shown = f"{rate:.1f}/s" if rate >= 1 else f"{rate * 60:.1f}/min"
            known = task.fields.get("known", True)  # how many in all: not yet from a pipe
            left = (task.total - done) / rate if task.total and known else 0.0
            return Text(f"{shown}, {human_seconds(left)} left" if left > 0 else shown)

    return RateColumn()


class ProgressNotice:
    """Say once on stderr when requests wait for a model to load, and once when they wait for
    room in the daemon's memory. With a ``LoadLine`` that is wanted (a terminal), the wait for
    a load is that live line instead of a notice."""

    def __init__(self, announce: Announce, load_line: LoadLine | None = None) -> None:
        self._announce = announce
        self._said: set[str] = set()
        self._load_line = load_line if load_line is not None and load_line.wanted else None

    def _once(self, topic: str, message: str) -> None:
        if topic not in self._said:
            self._said.add(topic)
            self._announce(message)

    def _loading(self, model: str | None, message: str) -> None:
        if self._load_line is not None:
            self._load_line.start(model)
        else:
            self._once("loading", message)

    def see(self, event: Event) -> None:
        kind = event.kind
        if kind == EventKind.PROGRESS and event.get("stage") == "waiting":
            self._once(
                "memory",
                f"waiting for memory: a request reserves {event.get('needed', 0):,} tokens of "
                f"context and {event.get('free', 0):,} are free until a running one finishes",
            )
        elif kind == EventKind.PROGRESS and event.get("stage") == "loading":
            self._loading(event.get("model"), f"loading {event.get('model', 'the model')}...")
        elif kind == EventKind.ACCEPTED and event.get("state") in ("loading", "warming"):
            self._loading(None, "waiting for the daemon to load the model...")
        elif kind in (EventKind.REASONING, EventKind.TOKEN, EventKind.RETRACT) or kind.terminal:
            self.stop()

    def stop(self) -> None:
        if self._load_line is not None:
            self._load_line.stop()


class LoadLine:
    """At a terminal, while the daemon loads the model a request waits for: one live line with
    what the daemon is doing (loading, then warming up: its status file says) and the seconds
    since the command began, gone once the model writes. Shown in the command's spinner when
    it has one (a terminal holds one live line at a time), else in a line of its own."""

    def __init__(self, env: Environment, spinner: _StderrStatus | None = None) -> None:
        self.wanted = env.terminal and bool(env.stderr_isatty)
        self._env, self._spinner = env, spinner
        self._began = time.monotonic()
        self._model = "the model"
        self._path: str | None = None  # the model being loaded, once a `progress` event says
        self._state, self._read_at = "loading", 0.0
        self._live: Any = None
        self._restore: Any = None
        self._shown = False

    def start(self, model: str | None) -> None:
        if model:
            self._path, self._model, self._state = model, os.path.basename(model), "loading"
        if self._shown:
            return
        self._shown = True
        if self._spinner is not None:
            self._restore = self._spinner.message
            self._spinner.update(self)
            return
        from rich.console import Console
        from rich.live import Live
        from rich.spinner import Spinner

        console = Console(file=self._env.stderr, force_terminal=True)
        self._live = Live(Spinner("dots", text=self), console=console, transient=True,
                          refresh_per_second=4)  # fmt: skip
        self._live.start(refresh=True)
        self._env.print_above_live = _printer(console)

    def stop(self) -> None:
        if not self._shown:
            return
        self._shown = False
        if self._live is not None:
            self._env.print_above_live = None
            self._live.stop()
            self._live = None
        elif self._spinner is not None:
            self._spinner.update(self._restore)

    def __rich__(self) -> Any:
        from rich.text import Text

        now = time.monotonic()
        if now - self._read_at > 0.5:
            from phi4cli.daemon.spawn import read_status

            status = read_status(self._env.paths)
            # What the file says of another model (the one loaded before) is not this wait's.
            if status is not None and self._path in (None, status.model):
                self._state = status.state
                if status.model and self._path is None:
                    self._model = os.path.basename(status.model)
            self._read_at = now
        model = self._model
        doing = {"starting": "starting the daemon", "loading": f"loading {model}",
                 "warming": f"warming up {model}",
                 "ready": f"{model} is loaded, reading the question"}.get(
            self._state, f"waiting for {model}")  # fmt: skip
        return Text(f"{doing}… {now - self._began:.0f} s")


class SolveOptions:
    """`phi4 solve`'s options, as Typer (or the fast path, from the same table) parsed them: its
    own, and the answer options every command that solves takes (``options.ANSWER_KEYS``, by
    setting name; None: not given), in ``answer``."""

    def __init__(self, prompt: str | None = None, model: str | None = None,
                 show_reasoning: bool = False, answer_only: bool = False,
                 as_json: bool = False, file: str | None = None, each_line: bool = False,
                 jsonl: bool = False, samples: int = 1, all_samples: bool = False,
                 no_instruction: bool = False, verbose: bool = False, raw_output: bool = False,
                 **answer: Any) -> None:  # fmt: skip
        from phi4cli.options import ANSWER_KEYS

        unknown = sorted(set(answer) - set(ANSWER_KEYS))
        if unknown:
            raise TypeError(f"SolveOptions() got an unknown option {unknown[0]!r}")
        self.prompt, self.model, self.samples, self.all_samples = prompt, model, samples, \
            all_samples  # fmt: skip
        self.show_reasoning, self.answer_only, self.as_json = show_reasoning, answer_only, as_json
        self.file, self.each_line, self.jsonl = file, each_line, jsonl
        self.no_instruction, self.verbose, self.raw_output = no_instruction, verbose, raw_output
        self.answer = {key: answer.get(key) for key in ANSWER_KEYS}


def read_prompt(prompt: str | None, env: Environment) -> str:
    """The question: the argument, or stdin for ``-`` or when no argument is given.

    Stdin is read only then: in ``while read q; do phi4 solve "$q"; done < file`` it is the
    loop's, and ``sleep 100 | phi4 solve "q"`` must not wait for its end.
    """
    from phi4cli.inputs import check_text, read_all

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
    from phi4cli.inputs import check_text

    for value, where in (
        (settings.system, "the system prompt (-s/--system or PHI4_SYSTEM)"),
        (settings.instruction, "the instruction (PHI4_INSTRUCTION or the config)"),
        (settings.model, "the model (-m/--model or PHI4_MODEL)"),
        (settings.backend, "the backend URL (--backend or PHI4_BACKEND)"),
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
    from phi4cli.backends import make_backend
    from phi4cli.config import load_settings, set_in_environment
    from phi4cli.models import resolve_model

    paths = env.paths
    settings = load_settings(paths.config_file, {"model": model, **answer_options})
    check_sent_text(settings)
    model_path = None if settings.backend else resolve_model(settings.model, paths)
    from phi4cli.options import REQUEST_KEYS

    base: dict[str, Any] = {"model": str(model_path or settings.model),
                            **{key: getattr(settings, key) for key in REQUEST_KEYS}}  # fmt: skip
    if confidence or settings.vote == "confidence" or settings.stop_unsure:
        base["confidence"] = True
    if answer_options.get("keep_alive") is not None or set_in_environment("keep_alive"):
        base["keep_alive"] = settings.keep_alive
    backend = make_backend(paths, settings, model_path or settings.model, env.notice)
    instruction = None if no_instruction else settings.instruction
    return SolveJob(backend, env, base, seed=settings.seed, instruction=instruction,
                    vote=settings.vote, stop_unsure=settings.stop_unsure)  # fmt: skip


def run_solve(o: SolveOptions, env: Environment | None = None) -> int:
    """`phi4 solve`: one question, K samples, or a file of problems; return the exit status."""
    env = env or Environment()
    env.raw_output = env.raw_output or o.raw_output
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
    reads_file = o.file is not None or o.each_line
    # Checked before anything starts: a file that is not there or not UTF-8 is refused first.
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
        os.dup2(os.open(os.devnull, os.O_WRONLY), env.stdout.fileno())
        return ExitStatus.OK
