"""The job of a command that solves (``phi4 solve``, ``phi4 eval``): what answers, the Environment
and what every request shares (``SolveJob``, made by ``make_job``), the requests of a run made as
they are sent, and what each way of solving prints alike: JSON text, the answer line, an answer
check's verdict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from phi4cli.backends.backend import Backend
from phi4cli.backends.outcome import Outcome
from phi4cli.client.environment import Environment
from phi4cli.core._settings import Ask
from phi4cli.core.errors import ExitStatus
from phi4cli.core.protocol import Event, SolveParams
from phi4cli.text.sanitize import clean_text, json_safe

if TYPE_CHECKING:
    from phi4cli.backends.dispatch import EventSink, Feed
    from phi4cli.backends.flight import FlightHook
    from phi4cli.client.history import History
    from phi4cli.text.check_verdicts import Check
    from phi4cli.text.checker import Checker


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
    history: History | None = None  # where each answer is kept (None: history off)

    def remember(self, outcome: Outcome, kind: str = "solve", session: str | None = None) -> None:
        """Keep ``outcome`` in the history (a ``kind`` of answer: solve, sample, eval), if it
        is kept; a record that cannot be written is said in one line and skipped."""
        if self.history is not None:
            settings = self.request.ask._asdict()
            self.history.add(kind, outcome, settings, self.request.model, session)

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


def print_json_indented(job: SolveJob, record: dict[str, Any]) -> None:
    """``record`` on stdout as one JSON text, indented (``--json``)."""
    job.print_json(record, indent=2)


def answer_line(job: SolveJob, answer: str) -> str:
    """``answer`` as ``--answer-only`` prints it: at a terminal, its LaTeX shown as Unicode."""
    if job.env.terminal:
        from phi4cli.text.latex import math_to_unicode

        return math_to_unicode(answer)
    return answer


def say_check(notice: Callable[[str], None], check: Check | None, where: str = "") -> None:
    """A checked answer's verdict on stderr, for output without an ``Answer:`` line to show it
    beside (a pipe, ``--answer-only``, a file of problems' line ``where``): one line, for a
    verdict reached."""
    said = _verdict_line(check)
    if said is not None:
        notice(f"{where}{said}")


def _verdict_line(check: Check | None) -> str | None:
    from phi4cli.client.presenters import check_line

    return None if check is None else check_line(check)


def check_suffix(outcome: Outcome) -> str:
    """A verdict reached, beside a plain ``Answer:`` line: ``  (✓ verified: 12·13 = 156)``."""
    said = _verdict_line(outcome.check)
    return f"  ({said})" if said is not None else ""


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
        history=_history(env) if settings.history else None,
    )


def _history(env: Environment) -> History:
    from phi4cli.client.history import open_history  # (sqlite3 only where answers are kept)

    return open_history(env)
