"""`phi4 eval`: solve a file of problems with known answers and say how many the model got right.

Each problem's answer is judged against its reference with math-verify (``reasoning.same_answer``),
so ``0.5`` is right for ``\\frac{1}{2}``. Results go to a JSONL file as each problem finishes; a
second run over the same file skips what is already there, so an interrupted evaluation resumes.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

from phi4cli.errors import UsageError
from phi4cli.outcome import Outcome
from phi4cli.protocol import Event
from phi4cli.reasoning import majority_vote, same_answer
from phi4cli.records import Record
from phi4cli.solving import FileProgress, ProgressNotice, SolveJob

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

STATUSES = ("correct", "wrong", "no_answer", "truncated", "error")


class Item(Record):
    line: int  # in the input file (a CSV's header is line 1)
    problem: str
    reference: str


def read_items(path: Path, problem_field: str, answer_field: str) -> list[Item]:
    """The problems and reference answers of a JSONL or CSV file; UsageError naming the line
    of anything that is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"cannot read {path}: {reason}") from None
    rows: Iterator[tuple[int, Any]]
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        rows = ((reader.line_num, row) for row in reader)
    else:
        rows = _json_lines(path, text)
    items = []
    for line, row in rows:
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{line}: expected an object with {problem_field!r} and "
                             f"{answer_field!r}")  # fmt: skip
        problem, reference = row.get(problem_field), row.get(answer_field)
        if not isinstance(problem, str) or not problem.strip():
            raise UsageError(f"{path}:{line}: no {problem_field!r} (--problem-field names it)")
        if reference is None or not str(reference).strip():
            raise UsageError(f"{path}:{line}: no {answer_field!r} (--answer-field names it)")
        items.append(Item(line, problem.strip(), str(reference).strip()))
    if not items:
        raise UsageError(f"{path} holds no problems")
    return items


def _json_lines(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    for line, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            try:
                yield line, json.loads(raw)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{line}: not JSON ({exc.msg})") from None


def judge(item: Item, outcomes: list[Outcome]) -> dict[str, Any]:
    """One problem's record: the (voted) answer, its status, and for samples pass@k."""
    vote = majority_vote([o.answer for o in outcomes])
    answer = vote.answer
    if all(o.error is not None for o in outcomes):
        status = "error"
    elif answer is not None:
        status = "correct" if same_answer(answer, item.reference) else "wrong"
    elif all(o.thinking_unfinished or o.error is not None for o in outcomes):
        status = "truncated"
    else:
        status = "no_answer"
    stats = [o.stats for o in outcomes if o.stats is not None]
    record: dict[str, Any] = {
        "line": item.line, "problem": item.problem, "reference": item.reference,
        "answer": answer, "status": status, "correct": status == "correct", "k": len(outcomes),
        "reasoning_tokens": sum(s.reasoning_tokens for s in stats),
        "completion_tokens": sum(s.completion_tokens for s in stats),
        "seconds": round(max((s.total_s or 0.0 for s in stats), default=0.0), 3),
    }  # fmt: skip
    if len(outcomes) > 1:
        record["agreement"] = vote.agreement
        record["samples"] = [o.answer for o in outcomes]
        record["pass_at_k"] = any(
            o.answer is not None and same_answer(o.answer, item.reference) for o in outcomes
        )
    errors = [o.error_message for o in outcomes if o.error is not None]
    if errors:
        record["errors"] = errors
    return record


def load_done(output: Path, items: list[Item], samples: int) -> dict[int, dict[str, Any]]:
    """The records of an earlier run into ``output`` that match these problems, their reference
    answers and the number of samples, by line; anything else is solved again."""
    wanted = {item.line: (item.problem, item.reference) for item in items}
    done: dict[int, dict[str, Any]] = {}
    try:
        lines = output.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return done
    except (OSError, UnicodeDecodeError):
        raise UsageError(f"cannot read the results file {output}; move it away") from None
    for raw in lines:
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a line cut short by an interruption: that problem is solved again
        if not isinstance(record, dict) or not isinstance(record.get("line"), int):
            continue
        same = wanted.get(record["line"]) == (record.get("problem"), record.get("reference"))
        complete = (record.get("status") in STATUSES and record.get("k") == samples
                    and all(isinstance(record.get(key), int)
                            for key in ("reasoning_tokens", "completion_tokens")))  # fmt: skip
        if same and complete and record["status"] != "error":  # errors are tried again
            done[record["line"]] = record
    return done


def run_eval(job: SolveJob, items: list[Item], samples: int, output: Path,
             jsonl: bool) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    """Solve the problems not in ``output`` yet, appending each record as it is judged; return
    every record (earlier ones included) and the seconds this run took."""
    done = load_done(output, items, samples)
    todo = [item for item in items if item.line not in done]
    if done:
        job.announce(f"resuming: {len(done)} of {len(items)} problems are already in {output}")
    started = time.monotonic()
    outcomes = {(i, k): Outcome(index=i, question=item.problem)
                for i, item in enumerate(todo) for k in range(samples)}  # fmt: skip
    keys = list(outcomes)
    seed = job.seed
    requests = [job.params(todo[i].problem, priority="bulk",
                           **({} if seed is None else {"seed": seed + k}))
                for i, k in keys]  # fmt: skip
    remaining = [samples] * len(todo)
    # A problem's budget is that of its K samples together.
    budget = job.base.get("max_tokens")
    progress = FileProgress(len(todo), job.env, budget=budget * samples if budget else None)
    loading = ProgressNotice(progress.notice)  # above the bar while it is shown
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        results = output.open("a", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write the results file {output}: {exc.strerror}") from None

    def on_event(index: int, event: Event) -> None:
        i, k = keys[index]
        loading.see(event)
        progress.see(i, event)
        outcome = outcomes[(i, k)]
        outcome.apply(event)
        if not (event.terminal and outcome.done):
            return
        remaining[i] -= 1
        if remaining[i]:
            return
        record = judge(todo[i], [outcomes[(i, s)] for s in range(samples)])
        done[todo[i].line] = record
        line = json.dumps(record, ensure_ascii=False)
        results.write(line + "\n")
        results.flush()  # an interruption keeps every problem finished so far
        if jsonl:
            progress.out(line)
        progress.advance(i)

    with results, progress:
        if requests:
            job.run(requests, on_event)
    records = [done[item.line] for item in items if item.line in done]
    return records, time.monotonic() - started


def summary(records: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """Counts by status, accuracy, pass@k, mean thinking tokens."""
    total = len(records)
    counts = {status: sum(r["status"] == status for r in records) for status in STATUSES}
    result: dict[str, Any] = {
        "problems": total,
        **counts,
        "accuracy": counts["correct"] / total if total else 0.0,
        "mean_reasoning_tokens": (sum(r["reasoning_tokens"] for r in records) / total / samples
                                  if total else 0.0),
    }  # fmt: skip
    if samples > 1:
        passed = sum(bool(r.get("pass_at_k")) for r in records)
        result["samples"] = samples
        result["pass_at_k"] = passed / total if total else 0.0
        result["pass_at_k_count"] = passed
    return result
