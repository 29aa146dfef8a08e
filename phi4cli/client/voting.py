"""One question's K self-consistency samples (``phi4 solve -k``): each sample's vote, the early
stop that ends the sampling once the vote is settled (``phi4 eval -k`` keeps one per problem), and
solving the samples and showing their vote the way the output calls for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from phi4cli.backends.outcome import Outcome
from phi4cli.client.presenters import TerminalPresenter, no_vote_reason
from phi4cli.client.progress import LoadLine, ProgressNotice, StderrStatus
from phi4cli.client.solve_job import (
    OutputMode,
    SolveJob,
    answer_line,
    check_suffix,
    print_json_indented,
    say_check,
)
from phi4cli.core.errors import ExitStatus
from phi4cli.core.options import sample_seed
from phi4cli.core.protocol import Event
from phi4cli.text.confidence import WARMUP
from phi4cli.text.reasoning import AnswerComparer, majority_vote, vote_settled

if TYPE_CHECKING:
    from phi4cli.backends.flight import Flight


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
                job.remember(outcomes[index], "sample")
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
        print_json_indented(job, record)
    elif mode.answer_only:
        job.print(answer_line(job, vote.answer) if vote.answer is not None else "")
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
        job.print(f"Answer: {shown} ({agree}){check_suffix(winner)}")
    if missing is not None:
        job.announce(missing)
    return job.check_status([winner] if missing is None else [], status)
