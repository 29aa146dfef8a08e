"""`phi4 eval`: solve a file of problems with known answers and say how many the model got right.

Each problem's answer is judged against its reference with math-verify (``reasoning.same_answer``),
so ``0.5`` is right for ``\\frac{1}{2}``. Results go to a JSONL file as each problem finishes; a
second run over the same file skips what is already there, so an interrupted evaluation resumes,
but only records that say they were made by the same run (model file, engine, instruction,
sampling): another model's verdicts must never be reported as this one's. The problems are read
by ``eval_problems``, the results file written and read back by ``eval_results``.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phi4cli.backends.outcome import Outcome
from phi4cli.client.eval_problems import Item, Pending, Problems
from phi4cli.client.eval_results import (
    RESULTS_FILE,
    STATUSES,
    MismatchPolicy,
    append_lines,
    open_results,
    result_line,
    run_identity,
)
from phi4cli.client.progress import FileProgress, ProgressNotice
from phi4cli.client.solve_job import Requests, SolveJob
from phi4cli.client.voting import EarlyStop, votes
from phi4cli.core.atomicfile import UnwritableError
from phi4cli.core.options import sample_seed
from phi4cli.core.protocol import PRIORITY_BULK, Event, SolveParams
from phi4cli.text.confidence import WARMUP
from phi4cli.text.reasoning import AnswerComparer, majority_vote

if TYPE_CHECKING:
    from phi4cli.backends.flight import Flight


def judge(
    item: Item,
    outcomes: list[Outcome],
    same_answer: AnswerComparer | None = None,
    weights: list[float] | None = None,
) -> dict[str, Any]:
    """One problem's record: the (voted) answer, its status, and for samples pass@k. Answers are
    compared by ``same_answer``, which counts those too costly to compare but as text;
    ``weights``: a confidence vote (``SolveJob.vote_weights``)."""
    same_answer = same_answer or AnswerComparer()
    vote = majority_vote(votes(outcomes), equal=same_answer, weights=weights)
    answer = vote.answer
    if all(o.error is not None for o in outcomes):
        status = "error"
    elif answer is not None:
        status = "correct" if same_answer(answer, item.reference) else "wrong"
    elif all(o.error is not None or o.thinking_unfinished or o.cut_off for o in outcomes):
        status = "truncated"  # (every sample ran out of tokens: --max-tokens, not the model)
    else:
        status = "no_answer"
    stats = [o.stats for o in outcomes if o.stats is not None]
    # The solution the answer came from (the vote's first member), else the first sample's: a
    # "no answer" or "truncated" can be looked into. (The thinking is in `phi4 history`.)
    shown = outcomes[vote.members[0]] if answer is not None and vote.members else outcomes[0]
    record: dict[str, Any] = {
        "line": item.line,
        "problem": item.problem,
        "reference": item.reference,
        "answer": answer,
        "status": status,
        "solution": shown.solution if shown.error is None else None,
        "correct": status == "correct",
        "k": len(outcomes),
        "reasoning_tokens": sum(s.reasoning_tokens for s in stats),
        "completion_tokens": sum(s.completion_tokens for s in stats),
        "seconds": round(max((s.total_s or 0.0 for s in stats), default=0.0), 3),
    }
    if len(outcomes) == 1 and stats:  # (a vote's samples each say theirs in sample_details)
        record["finish_reason"] = stats[0].finish_reason  # "length": cut off at --max-tokens
    confidences = [o.stats.lowest_group_confidence if o.stats else None for o in outcomes]
    if any(c is not None for c in confidences):  # each answer's (phi4cli.text.confidence)
        record["confidence"] = confidences if len(outcomes) > 1 else confidences[0]
    checked = next((outcomes[i].check for i in vote.members if outcomes[i].check is not None), None)
    if checked is not None and answer is not None:  # the voted answer's, as checked
        record["check"] = checked.to_json()
    if len(outcomes) > 1:
        record["agreement"] = vote.agreement
        # Each sample's own answer (not the vote's view, which sets refuted ones aside).
        said = [o.answer if o.error is None else None for o in outcomes]
        record["samples"] = said
        record["pass_at_k"] = any(a is not None and same_answer(a, item.reference) for a in said)
    errors = [o.error_message for o in outcomes if o.error is not None]
    if errors:
        record["errors"] = errors
    return record


def sample_details(outcome: Outcome, ended_s: float, cancelled: bool) -> dict[str, Any]:
    """What ``eval -k`` keeps of one sample, for replaying votes offline (bench/votes.py): its
    answer, tokens, when it ended (seconds into the run) and took, its lowest group confidence,
    whether a loop was caught in it, whether it was cancelled (a settled vote) or else failed,
    and its answer's check verdict."""
    stats = outcome.stats
    return {
        "answer": None if cancelled or outcome.error is not None else outcome.answer,
        "completion_tokens": stats.completion_tokens if stats else 0,
        "reasoning_tokens": stats.reasoning_tokens if stats else 0,
        "ended_s": round(ended_s, 3),
        "seconds": round(stats.total_s or 0.0, 3) if stats else None,
        "confidence": stats.lowest_group_confidence if stats else None,
        "loop": stats.loop if stats else None,
        "finish_reason": stats.finish_reason if stats else None,
        "cancelled": cancelled,
        "error": outcome.error is not None and not cancelled,  # (the cancel's end is no failure)
        "check": None if cancelled or outcome.check is None else outcome.check.verdict,
    }


def run_eval(
    job: SolveJob,
    problems: Problems,
    count: int,
    samples: int,
    output: Path,
    jsonl: bool,
    policy: MismatchPolicy | None = None,
    every: bool = False,
) -> tuple[Tally, float]:
    """Solve the ``count`` problems not in ``output`` yet, appending each record as it is
    judged; return the count of every record (earlier ones of this run included) and the
    seconds this run took. A problem's samples stop once its vote is settled, as `solve -k`'s
    do (:func:`reasoning.vote_settled`), unless ``every``."""
    adaptive = samples > 1 and not every
    run = run_identity(job, samples, adaptive)
    new = not os.path.lexists(output)
    try:
        results, earlier, cut = open_results(output, problems, run, policy or MismatchPolicy())
    except UnwritableError as exc:
        raise exc.instead(ANOTHER_FILE) from None
    except OSError as exc:  # (ending a last line: a full disk)
        raise UnwritableError(output, RESULTS_FILE, exc, instead=ANOTHER_FILE) from None
    if cut:
        job.announce(
            f"{output} ended in a record cut short ({cut:,} bytes, a run stopped while "
            "writing it): cut off, its problem is solved again"
        )
    tally = Tally()
    for record in earlier.values():
        tally.add(record)
    done = set(earlier)
    del earlier
    if done:
        job.announce(f"resuming: {len(done)} of {count} problems are already in {output}")
    # Problems are read from the input as they are sent and let go once judged; only those
    # being answered have outcomes (each with its whole solution text): a run of 10,000 holds
    # its count, not its problems or their answers.
    todo = Pending(problems, done, count - len(done))
    started = time.monotonic()
    outcomes: dict[tuple[int, int], Outcome] = {}
    ended_s: dict[tuple[int, int], float] = {}  # when each sample's terminal event came
    seed = job.seed

    def request(index: int) -> SolveParams:
        i, k = divmod(index, samples)  # request index: problem i's sample k
        # A problem's samples are one group: a remote server that takes ``n`` is asked for
        # them in one request.
        return job.params(
            todo[i].problem,
            PRIORITY_BULK,
            i if samples > 1 else None,
            None if seed is None else sample_seed(seed, k),
        )

    requests = Requests(request, len(todo) * samples)
    stops: dict[int, EarlyStop] = {}  # by problem being answered
    flight: list[Flight] = []
    # A problem's budget is that of its K samples together.
    budget = job.request.ask.max_tokens
    progress = FileProgress(len(todo), job.env, budget=budget * samples if budget else None)
    loading = ProgressNotice(progress.notice)  # above the bar while it is shown
    compare = AnswerComparer()  # one count for the run: one notice, not one per problem

    def on_event(index: int, event: Event) -> None:
        i, k = divmod(index, samples)  # request index: problem i's sample k
        loading.see(event)
        progress.see(i, event)
        outcome = outcomes.get((i, k))
        if outcome is None:
            outcome = outcomes[(i, k)] = Outcome(index=i, question=todo[i].problem)
        outcome.apply(event)
        if not (event.terminal and outcome.done):
            return
        if samples > 1:
            ended_s[(i, k)] = time.monotonic() - started
        stop = stops.get(i)
        if stop is None or k not in stop.stopped:
            job.check_outcome(outcome)
            job.remember(outcome, "eval", session=problems.path.name)
        if stop is None:
            first = i * samples  # its samples' request indices follow
            stop = stops[i] = EarlyStop(
                samples,
                compare,
                (lambda s: flight[0].cancel(first + s)) if adaptive else None,
                (lambda s, floor: flight[0].adjust(first + s, floor))
                if job.stop_unsure and samples > WARMUP
                else None,
            )
        stop.end(k, outcome)
        if len(stop.ended) < samples:
            return
        del stops[i]
        judged = [outcomes.pop((i, s)) for s in range(samples)]
        used = [o for s, o in enumerate(judged) if s not in stop.stopped]
        record = {**judge(todo[i], used, compare, job.vote_weights(used)), "k": samples, "run": run}
        if samples > 1:
            record["samples_used"] = len(used)
            if job.stop_unsure and samples > WARMUP:
                record["samples_unsure"] = len(stop.unsure)
            record["sample_details"] = [
                sample_details(o, ended_s.pop((i, s)), s in stop.stopped)
                for s, o in enumerate(judged)
            ]
        if record["status"] == "error":  # (said as `solve -f` says it; the record keeps it)
            progress.notice(f"line {todo[i].line}: {record['errors'][-1]}")
        line = result_line(record)
        try:  # written as it is judged: an interruption keeps every problem finished so far
            append_lines(results, line.encode() + b"\n")
        except OSError as exc:
            raise _unwritable(output, exc, todo[i].line, tally) from None
        todo.release(i)
        tally.add(record)
        if jsonl:
            progress.out(line)
        progress.advance(i)

    try:
        with results, progress:
            if requests:
                job.run(requests, on_event, restart=True, on_flight=flight.append)
    except Exception:
        if new and not sum(tally.counts.values()):  # (an engine never reached: no empty file)
            with contextlib.suppress(OSError):
                output.unlink()
        raise
    finally:
        todo.close()
    notice = compare.notice()
    if notice:
        job.announce(notice)
    return tally, time.monotonic() - started


ANOTHER_FILE = "name another results file with -o"


def _unwritable(output: Path, exc: OSError, line: int, tally: Tally) -> UnwritableError:
    """A record that could not be written: the run stops there, and the line says which
    problem and what the file keeps (whole records only: see :func:`eval_results.append_lines`)."""
    kept = sum(tally.counts.values())
    return UnwritableError(
        output,
        RESULTS_FILE,
        exc,
        instead=ANOTHER_FILE,
        detail=f"; stopped at line {line}'s record (the {kept:,} judged before it are whole "
        "lines in the file, and the same command resumes from them)",
    )


class Tally:
    """The counts of the summary, record by record: a run of 10,000 problems holds numbers,
    not records."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(STATUSES, 0)
        self.reasoning_tokens = 0
        self.completion_tokens = 0  # the tokens the model wrote, thinking included
        self.samples_used = 0  # samples that finished and voted (fewer once a vote settled)
        self.samples_unsure = 0  # samples stopped below the confidence floor (--stop-unsure)
        self.passed = 0  # problems with a right sample (pass@k)
        # One answer per problem: the sums and counts of the confidence of right and of wrong
        # answers, to see whether confidence tells them apart (--vote confidence).
        self.confidence = {"correct": [0.0, 0], "wrong": [0.0, 0]}
        # Answers checked against their problem, by verdict; and verdicts the references
        # contradict (verified but judged wrong, refuted but judged right): they must be 0.
        self.checks = {"verified": 0, "refuted": 0, "unchecked": 0}
        self.wrong_verdicts = 0

    def add(self, record: dict[str, Any]) -> None:
        self.counts[record["status"]] += 1
        check = record.get("check")
        verdict = check.get("verdict") if isinstance(check, dict) else None
        if verdict in self.checks:
            self.checks[verdict] += 1
            self.wrong_verdicts += (verdict, record["status"]) in (
                ("verified", "wrong"),
                ("refuted", "correct"),
            )
        self.reasoning_tokens += record["reasoning_tokens"]
        self.completion_tokens += record.get("completion_tokens", 0)
        self.samples_used += record.get("samples_used", record.get("k", 1))
        self.samples_unsure += record.get("samples_unsure", 0)
        self.passed += bool(record.get("pass_at_k"))
        confidence = record.get("confidence")
        if isinstance(confidence, (int, float)) and record["status"] in self.confidence:
            tally = self.confidence[record["status"]]
            tally[0] += confidence
            tally[1] += 1

    def summary(self, samples: int, adaptive: bool = False) -> dict[str, Any]:
        """Counts by status, accuracy, pass@k, mean thinking tokens."""
        total = sum(self.counts.values())
        result: dict[str, Any] = {
            "problems": total,
            **self.counts,
            "accuracy": self.counts["correct"] / total if total else 0.0,
            # A solution's: over the samples that finished (fewer than K once a vote settled).
            "mean_reasoning_tokens": self.reasoning_tokens / self.samples_used
            if self.samples_used
            else 0.0,
        }
        result["completion_tokens"] = self.completion_tokens
        if any(self.checks.values()):
            result["checks"] = {**self.checks, "wrong_verdicts": self.wrong_verdicts}
        if samples == 1 and any(count for _, count in self.confidence.values()):
            result["mean_confidence"] = {
                status: round(total / count, 4) if count else None
                for status, (total, count) in self.confidence.items()
            }
        if samples > 1:
            result["samples"] = samples
            result["pass_at_k"] = self.passed / total if total else 0.0
            result["pass_at_k_count"] = self.passed
            result["mean_samples_used"] = self.samples_used / total if total else 0.0
            result["adaptive"] = adaptive  # each problem's samples stopped once it was settled
            if self.samples_unsure:
                result["samples_unsure"] = self.samples_unsure
        return result
