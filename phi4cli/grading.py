"""`phi4 eval`: solve a file of problems with known answers and say how many the model got right.

Each problem's answer is judged against its reference with math-verify (``reasoning.same_answer``),
so ``0.5`` is right for ``\\frac{1}{2}``. Results go to a JSONL file as each problem finishes; a
second run over the same file skips what is already there, so an interrupted evaluation resumes,
but only records that say they were made by the same run (model file, engine, instruction,
sampling): another model's verdicts must never be reported as this one's. The results file sits
next to a user-given path, perhaps in /tmp, so it is opened by ``atomicfile.open_user_file``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from phi4cli.atomicfile import RefusedFileError, open_user_file, replace_user_file
from phi4cli.errors import UsageError
from phi4cli.outcome import Outcome
from phi4cli.protocol import Event
from phi4cli.reasoning import AnswerComparer, majority_vote
from phi4cli.records import Record
from phi4cli.sanitize import json_safe
from phi4cli.solving import FileProgress, ProgressNotice, Requests, SolveJob

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, BinaryIO

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


def judge(item: Item, outcomes: list[Outcome],
          same_answer: AnswerComparer | None = None) -> dict[str, Any]:  # fmt: skip
    """One problem's record: the (voted) answer, its status, and for samples pass@k. Answers are
    compared by ``same_answer``, which counts those too costly to compare but as text."""
    same_answer = same_answer or AnswerComparer()
    vote = majority_vote([o.answer for o in outcomes], equal=same_answer)
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


RESULTS_FILE = "results file"  # what the refusals call it
# What a results record says about the run that made it; a rerun resumes only records whose
# run is this one's, so another model's verdicts are never reported as this model's.
RUN_KEYS = ("model", "model_file", "backend", "system", "instruction", "temperature", "top_p",
            "seed", "max_tokens", "think_budget", "samples")  # fmt: skip
# Enough of a GGUF to cover its header and metadata: a file replaced in place under the same
# size and mtime still differs here.
_HEAD_BYTES = 1 << 20


class MismatchPolicy(Record):
    """What a rerun does with records of another run: refuse (the default), ``restart`` (replace
    the file with an empty one) or ``force`` (count them as this run's)."""

    restart: bool = False
    force: bool = False


def run_identity(job: SolveJob, samples: int) -> dict[str, Any]:
    """What decides a run's answers: the model (its path or name, and for a local file its size,
    mtime and a hash of its first MiB), the remote engine's URL, the system prompt, the
    instruction and the sampling settings. As JSON would read it back, to compare with records."""
    from phi4cli.backends import RemoteBackend

    base = job.base
    backend = (
        # Replicas of one model, in any order: the same run.
        " ".join(sorted(_without_secrets(e.url) for e in job.backend.engines))
        if isinstance(job.backend, RemoteBackend) else None
    )  # fmt: skip
    identity: dict[str, Any] = {key: base.get(key) for key in RUN_KEYS if key in base}
    model_file = None if backend else model_file_identity(Path(base["model"]))
    identity.update(backend=backend, instruction=job.instruction, samples=samples,
                    model_file=model_file)  # fmt: skip
    return dict(json.loads(json.dumps({key: identity.get(key) for key in RUN_KEYS})))


def _without_secrets(url: str) -> str:
    """``url`` without a user name or password: a results file is shared more than a key is."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def model_file_identity(path: Path) -> dict[str, Any] | None:
    """Size, mtime and a hash of the head of the GGUF at ``path`` (None if it cannot be read)."""
    import hashlib

    try:
        with path.open("rb") as handle:
            info = os.fstat(handle.fileno())
            head = hashlib.sha256(handle.read(_HEAD_BYTES)).hexdigest()
    except OSError:
        return None
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "head_sha256": head}


class EarlierResults(Record):
    """What a results file holds, against the problems and the run of now."""

    done: dict[int, dict[str, Any]]  # this run's records of these problems, by line
    adoptable: dict[int, dict[str, Any]]  # other runs' records of these problems, by line
    foreign: int  # records of another run (or of no stated run)
    unlabelled: int  # of those, records that do not say what made them (an older phi4)
    differences: tuple[str, ...]  # how the first foreign record's run differs, in words


def read_earlier(text: str, items: list[Item], run: dict[str, Any]) -> EarlierResults:
    """Sort the records of ``text`` (a results file) into this run's for these problems, their
    reference answers and number of samples, and other runs'; a problem whose text or reference
    changed, an error, or a damaged record is solved again."""
    wanted = {item.line: (item.problem, item.reference) for item in items}
    done: dict[int, dict[str, Any]] = {}
    adoptable: dict[int, dict[str, Any]] = {}
    foreign = unlabelled = 0
    differences: tuple[str, ...] = ()
    for raw in text.splitlines():
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a line cut short by an interruption: that problem is solved again
        if not isinstance(record, dict) or not isinstance(record.get("line"), int):
            continue
        theirs = record.get("run")
        ours = theirs == run
        if not ours:
            foreign += 1
            if isinstance(theirs, dict):
                differences = differences or describe_differences(theirs, run)
            else:
                unlabelled += 1
        same = wanted.get(record["line"]) == (record.get("problem"), record.get("reference"))
        complete = (record.get("status") in STATUSES and record.get("k") == run["samples"]
                    and all(isinstance(record.get(key), int)
                            for key in ("reasoning_tokens", "completion_tokens")))  # fmt: skip
        if same and complete and record["status"] != "error":  # errors are tried again
            (done if ours else adoptable)[record["line"]] = record
    return EarlierResults(done, adoptable, foreign, unlabelled, differences)


def describe_differences(theirs: dict[str, Any], run: dict[str, Any]) -> tuple[str, ...]:
    """How the run ``theirs`` differs from ``run``, one phrase a setting: "model a.gguf, not
    b.gguf", "max_tokens 16, not 17", "another instruction"."""
    said = []
    for key in RUN_KEYS:
        old, new = theirs.get(key), run[key]
        if old == new:
            continue
        if key == "model":
            said.append(f"model {_model_name(old)}, not {_model_name(new)}")
        elif key == "model_file":
            if theirs.get("model") == run["model"]:  # another model's file differs, of course
                said.append("the model file changed since")
        elif key in ("system", "instruction"):
            said.append(f"another {key}")
        else:
            said.append(f"{key} {_short(old)}, not {_short(new)}")
    return tuple(said) or ("other settings",)


def _model_name(model: Any) -> str:
    return Path(model).name if isinstance(model, str) else _short(model)


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def _mismatch_message(output: Path, earlier: EarlierResults) -> str:
    many = earlier.foreign != 1
    count = f"{earlier.foreign} result{'s' if many else ''}"
    if earlier.unlabelled == earlier.foreign:
        what = (f"{count} that {'do' if many else 'does'} not say which model and settings made "
                f"{'them' if many else 'it'} (an older phi4?)")  # fmt: skip
    else:
        what = f"{count} of another run ({'; '.join(earlier.differences)})"
    return (f"the results file {output} holds {what}: --restart starts it over, --force-resume "
            "counts them as this run's, or -o names another file")  # fmt: skip


def result_line(record: dict[str, Any]) -> str:
    """One results-file line: JSON escaped where a terminal would act on a character (`cat` of
    the file) or UTF-8 has none (a lone surrogate from a problem's JSON); the same value read
    back."""
    return json_safe(json.dumps(record, ensure_ascii=False))


def _lines(records: list[dict[str, Any]]) -> bytes:
    return "".join(result_line(r) + "\n" for r in records).encode()


def open_results(output: Path, items: list[Item], run: dict[str, Any],
                 policy: MismatchPolicy) -> tuple[BinaryIO, dict[int, dict[str, Any]]]:  # fmt: skip
    """The results file open to append to, and this run's records already in it, by line.

    Raise RefusedFileError (one line, exit 1) when the file is a link, a FIFO or anything but
    a regular file of this user's, or holds records of another model or other settings and
    ``policy`` does not say what to do with them."""
    if policy.restart:
        return replace_user_file(output, RESULTS_FILE, b""), {}
    results = open_user_file(output, RESULTS_FILE)
    try:
        try:
            text = results.read().decode("utf-8")
        except UnicodeDecodeError:
            raise RefusedFileError(f"the results file {output} is not UTF-8 text (not phi4's?): "
                                   "move it away, or --restart replaces it") from None  # fmt: skip
        earlier = read_earlier(text, items, run)
        if not earlier.foreign:
            return results, earlier.done
        if not policy.force:
            raise RefusedFileError(_mismatch_message(output, earlier))
    except BaseException:
        results.close()
        raise
    results.close()
    # Forced: the other runs' records become this run's, so that the next rerun resumes them
    # too, each saying which run it came from; the rest (stale records, other problems) goes.
    done = {line: {**record, "run": run, "adopted_from": record.get("run")}
            for line, record in earlier.adoptable.items()}  # fmt: skip
    done.update(earlier.done)
    kept = [done[item.line] for item in items if item.line in done]
    return replace_user_file(output, RESULTS_FILE, _lines(kept)), done


def run_eval(
    job: SolveJob,
    items: list[Item],
    samples: int,
    output: Path,
    jsonl: bool,
    policy: MismatchPolicy | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Solve the problems not in ``output`` yet, appending each record as it is judged; return
    every record (earlier ones of this run included), as much of it as :func:`summary` counts,
    and the seconds this run took."""
    run = run_identity(job, samples)
    results, earlier = open_results(output, items, run, policy or MismatchPolicy())
    done = {line: _counted(record) for line, record in earlier.items()}
    del earlier  # the whole records: the results file has them
    todo = [item for item in items if item.line not in done]
    if done:
        job.announce(f"resuming: {len(done)} of {len(items)} problems are already in {output}")
    started = time.monotonic()
    # Only the problems being answered have outcomes (each with its whole solution text), and
    # requests are made as they are sent: a run of 10,000 holds its records, not their answers.
    outcomes: dict[tuple[int, int], Outcome] = {}
    seed = job.seed

    def request(index: int) -> dict[str, Any]:
        i, k = divmod(index, samples)  # request index: problem i's sample k
        return job.params(todo[i].problem, priority="bulk",
                          **({} if seed is None else {"seed": seed + k}))  # fmt: skip

    requests = Requests(request, len(todo) * samples)
    remaining = [samples] * len(todo)
    # A problem's budget is that of its K samples together.
    budget = job.base.get("max_tokens")
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
        remaining[i] -= 1
        if remaining[i]:
            return
        judged = [outcomes.pop((i, s)) for s in range(samples)]
        record = {**judge(todo[i], judged, compare), "run": run}
        done[todo[i].line] = _counted(record)
        line = result_line(record)
        results.write(line.encode() + b"\n")
        results.flush()  # an interruption keeps every problem finished so far
        if jsonl:
            progress.out(line)
        progress.advance(i)

    with results, progress:
        if requests:
            job.run(requests, on_event, restart=True)
    notice = compare.notice()
    if notice:
        job.announce(notice)
    records = [done[item.line] for item in items if item.line in done]
    return records, time.monotonic() - started


def _counted(record: dict[str, Any]) -> dict[str, Any]:
    """What :func:`summary` counts of a record: the rest is in the results file."""
    return {key: record[key] for key in ("line", "status", "reasoning_tokens", "pass_at_k")
            if key in record}  # fmt: skip


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
