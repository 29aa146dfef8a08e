"""`phi4 eval`: solve a file of problems with known answers and say how many the model got right.

Each problem's answer is judged against its reference with math-verify (``reasoning.same_answer``),
so ``0.5`` is right for ``\\frac{1}{2}``. Results go to a JSONL file as each problem finishes; a
second run over the same file skips what is already there, so an interrupted evaluation resumes,
but only records that say they were made by the same run (model file, engine, instruction,
sampling): another model's verdicts must never be reported as this one's. The results file sits
next to a user-given path, perhaps in /tmp, so it is opened by ``atomicfile.open_user_file``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import time
from collections.abc import Container, Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from phi4cli.backends.outcome import Outcome
from phi4cli.client.progress import FileProgress, ProgressNotice
from phi4cli.client.solving import EarlyStop, Requests, SolveJob, json_text, votes
from phi4cli.core.atomicfile import (
    RefusedFileError,
    UnwritableError,
    open_user_file,
    replace_user_file,
)
from phi4cli.core.errors import UsageError
from phi4cli.core.options import REQUEST_KEYS, SETTING, sample_seed
from phi4cli.core.protocol import PRIORITY_BULK, Event, SolveParams
from phi4cli.text.confidence import WARMUP
from phi4cli.text.reasoning import AnswerComparer, majority_vote

if TYPE_CHECKING:
    from phi4cli.backends.flight import Flight

STATUSES = ("correct", "wrong", "no_answer", "truncated", "error")


class Item(NamedTuple):
    line: int  # in the input file (a CSV's header is line 1)
    problem: str
    reference: str


class Problems:
    """The problems and reference answers of a JSONL or CSV file, read from the file each time
    they are gone through: a file of 100,000 problems is never held at once. Lines are numbered
    as ``str.splitlines`` numbers them (a CSV's header is line 1), which the records of a
    results file say. An input that can be read only once (``<(zcat p.jsonl.gz)``, a FIFO) is
    read whole by :meth:`check` and held, as every input was before."""

    def __init__(self, path: Path, problem_field: str, answer_field: str) -> None:
        self.path, self.problem_field, self.answer_field = path, problem_field, answer_field
        self._held: list[Item] | None = None

    def check(self) -> int:
        """How many problems the file holds, read through once before anything is solved;
        UsageError naming the line of anything that is not one."""
        import stat

        try:
            once = not stat.S_ISREG(self.path.stat().st_mode)
        except OSError:
            once = False  # reading it says why it cannot be read
        if once:
            self._held = list(self._read())
        count = len(self._held) if self._held is not None else sum(1 for _ in self._read())
        if not count:
            raise UsageError(f"{self.path} holds no problems")
        return count

    def __iter__(self) -> Iterator[Item]:
        return iter(self._held) if self._held is not None else self._read()

    def _read(self) -> Iterator[Item]:
        path, problem_field, answer_field = self.path, self.problem_field, self.answer_field
        is_csv = path.suffix.lower() == ".csv"
        try:
            # A CSV's line ends are translated ("\r\n", "\r": "\n"), as read_text() did.
            # utf-8-sig: a spreadsheet's "CSV UTF-8" starts with a byte order mark, which
            # would be read as part of the first column's name.
            with (
                path.open(encoding="utf-8-sig", newline=None) if is_csv else path.open("rb")
            ) as handle:
                rows = _csv_rows(path, handle) if is_csv else _json_lines(path, handle)
                try:
                    for line, row in rows:
                        if not isinstance(row, dict):
                            raise UsageError(
                                f"{path}:{line}: expected an object with "
                                f"{problem_field!r} and {answer_field!r}"
                            )
                        problem, reference = row.get(problem_field), row.get(answer_field)
                        if not isinstance(problem, str) or not problem.strip():
                            raise UsageError(
                                f"{path}:{line}: "
                                + _missing(row, problem_field, "--problem-field", is_csv)
                            )
                        if reference is None or not str(reference).strip():
                            raise UsageError(
                                f"{path}:{line}: "
                                + _missing(row, answer_field, "--answer-field", is_csv)
                            )
                        yield Item(line, problem.strip(), str(reference).strip())
                finally:
                    rows.close()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def _missing(row: dict[str, Any], field: str, option: str, is_csv: bool) -> str:
    """Why ``row`` has no usable ``field``: empty, or not there (and what is)."""
    if field in row and row[field] is not None:
        return f"{field!r} is empty"
    if field in row:  # (a CSV row shorter than its header; JSON's null)
        return f"{field!r} is missing from this row" if is_csv else f"{field!r} is null"
    found = ", ".join(repr(str(name)) for name in row if name is not None) or "none"
    return (
        f"no {field!r} ({option} names it; {'the columns are' if is_csv else 'its fields are'}"
        f" {found})"
    )


def _csv_rows(path: Path, text: Any) -> Generator[tuple[int, Any]]:
    reader = csv.DictReader(text)
    try:
        for row in reader:
            yield reader.line_num, row
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {path}: not UTF-8 text") from None
    except csv.Error as exc:
        raise UsageError(f"{path}:{reader.line_num}: not CSV ({exc})") from None


def _json_lines(path: Path, handle: Any) -> Generator[tuple[int, Any]]:
    line = 0
    for raw in handle:
        try:
            piece = raw.decode("utf-8-sig" if line == 0 else "utf-8")  # (a byte order mark)
        except UnicodeDecodeError:
            raise UsageError(f"{path}:{line + 1}: not UTF-8 text") from None
        for text in piece.splitlines() or [""]:
            line += 1
            if text.strip():
                try:
                    yield line, json.loads(text)
                except json.JSONDecodeError as exc:
                    raise UsageError(f"{path}:{line}: not JSON ({exc.msg})") from None


class Pending:
    """The problems a run still has to solve (those not in the results file yet), read from the
    input as the run asks for them and let go once judged: what is held is the problems being
    solved, not the file."""

    def __init__(self, problems: Problems, done: Container[int], count: int) -> None:
        self._path = problems.path
        self._rest = (item for item in problems if item.line not in done)
        self._held: dict[int, Item] = {}
        self._read = 0
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> Item:
        if not 0 <= index < self._count:
            raise IndexError(index)
        while self._read <= index:
            item = next(self._rest, None)
            if item is None:
                raise UsageError(
                    f"{self._path} changed while eval read it (it holds fewer "
                    "problems now): run the same command to resume"
                )
            self._held[self._read] = item
            self._read += 1
        return self._held[index]

    @property
    def held(self) -> int:
        """How many problems are held: read, and not judged yet."""
        return len(self._held)

    def release(self, index: int) -> None:
        """Problem ``index`` is judged: it is not asked for again."""
        self._held.pop(index, None)

    def close(self) -> None:
        self._rest.close()


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
    elif all(o.thinking_unfinished or o.error is not None for o in outcomes):
        status = "truncated"
    else:
        status = "no_answer"
    stats = [o.stats for o in outcomes if o.stats is not None]
    record: dict[str, Any] = {
        "line": item.line,
        "problem": item.problem,
        "reference": item.reference,
        "answer": answer,
        "status": status,
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


RESULTS_FILE = "results file"  # what the refusals call it
# What a results record says about the run that made it; a rerun resumes only records whose
# run is this one's, so another model's verdicts are never reported as this model's.
# Each request setting but the decoding recipe (deterministic), from the table of settings; one
# at its "off" value (min_p 0) is left out, so that records made before it existed still match.
RUN_KEYS = (
    "model",
    "model_file",
    "backend",
    "system",
    "instruction",
    *(key for key in REQUEST_KEYS if key not in ("system", "deterministic")),
    "samples",
    "adaptive",
    "vote",
    "stop_unsure",
)
# Enough of a GGUF to cover its header and metadata: a file replaced in place under the same
# size and mtime still differs here.
_HEAD_BYTES = 1 << 20


class MismatchPolicy(NamedTuple):
    """What a rerun does with records of another run: refuse (the default), ``restart`` (replace
    the file with an empty one) or ``force`` (count them as this run's)."""

    restart: bool = False
    force: bool = False


def run_identity(job: SolveJob, samples: int, adaptive: bool = False) -> dict[str, Any]:
    """What decides a run's answers: the model (its path or name, and for a local file its size,
    mtime and a hash of its first MiB), the remote server's URL, the system prompt, the
    instruction and the sampling settings. As JSON would read it back, to compare with records."""
    from phi4cli.backends.remote_backend import RemoteBackend

    model = job.request.model
    backend = (
        # Replicas of one model, in any order: the same run.
        " ".join(sorted(_without_secrets(e.url) for e in job.backend.servers))
        if isinstance(job.backend, RemoteBackend)
        else None
    )
    asked = job.request.ask._asdict()
    identity: dict[str, Any] = {key: asked[key] for key in RUN_KEYS if key in asked}
    model_file = None if backend or model is None else model_file_identity(Path(model))
    identity.update(
        model=model,
        backend=backend,
        instruction=job.instruction,
        samples=samples,
        model_file=model_file,
        adaptive=adaptive or None,
        vote=job.vote if samples > 1 else "count",
        stop_unsure=job.stop_unsure and samples > WARMUP,
    )

    # A setting at its "off" and a run that is not adaptive say nothing: records made before
    # either existed (all K samples, no min_p) still match.
    def says(key: str) -> bool:
        if key == "adaptive":
            return adaptive
        return key not in SETTING or not SETTING[key].is_off(identity.get(key))

    said = {key: identity.get(key) for key in RUN_KEYS if says(key)}
    return dict(json.loads(json.dumps(said)))


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


class EarlierResults(NamedTuple):
    """What a results file holds, against the problems and the run of now."""

    done: dict[int, dict[str, Any]]  # this run's records of these problems, by line
    adoptable: dict[int, dict[str, Any]]  # other runs' records of these problems (kept only
    # when asked for: they are adopted only with --force-resume)
    foreign: int  # records of another run (or of no stated run)
    unlabelled: int  # of those, records that do not say what made them (an older phi4)
    differences: tuple[str, ...]  # how the first foreign record's run differs, in words


def read_earlier(
    lines: Iterable[str], problems: Iterable[Item], run: dict[str, Any], keep: bool = False
) -> EarlierResults:
    """Sort the records of ``lines`` (a results file) into this run's for these problems, their
    reference answers and number of samples, and other runs'; a problem whose text or reference
    changed, an error, or a damaged record is solved again. This run's records are kept as the
    summary counts them, unless ``keep`` (the file is to be rewritten from them), and other
    runs' only then.

    The results file is read first, each record held with a digest of its problem and
    reference; the problems are then gone through once to see which of them still match."""
    # line -> digest of problem and reference -> the last such record (one, but for a problem
    # whose text was changed and then changed back)
    ours: dict[int, dict[bytes, dict[str, Any]]] = {}
    theirs: dict[int, dict[bytes, dict[str, Any]]] = {}
    foreign = unlabelled = 0
    differences: tuple[str, ...] = ()
    for raw in lines:
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a line cut short by an interruption: that problem is solved again
        if not isinstance(record, dict) or not isinstance(record.get("line"), int):
            continue
        mine = record.get("run")
        if mine != run:
            foreign += 1
            if isinstance(mine, dict):
                differences = differences or describe_differences(mine, run)
            else:
                unlabelled += 1
        problem, reference = record.get("problem"), record.get("reference")
        complete = (
            record.get("status") in STATUSES
            and record.get("k") == run["samples"]
            and all(
                isinstance(record.get(key), int)
                for key in ("reasoning_tokens", "completion_tokens")
            )
        )
        if not (complete and isinstance(problem, str) and isinstance(reference, str)):
            continue
        if record["status"] == "error":  # errors are tried again
            continue
        if mine == run or keep:
            into = ours if mine == run else theirs
            kept = record if keep else _counted(record)
            into.setdefault(record["line"], {})[_digest(problem, reference)] = kept
    done: dict[int, dict[str, Any]] = {}
    adoptable: dict[int, dict[str, Any]] = {}
    if ours or theirs:
        for item in problems:
            if item.line in ours or item.line in theirs:
                digest = _digest(item.problem, item.reference)
                for found, matched in ((ours, done), (theirs, adoptable)):
                    record = found.get(item.line, {}).get(digest)
                    if record is not None:
                        matched[item.line] = record
    return EarlierResults(done, adoptable, foreign, unlabelled, differences)


def _digest(problem: str, reference: str) -> bytes:
    import hashlib

    both = json.dumps([problem, reference], ensure_ascii=False).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(both, digest_size=16).digest()


def describe_differences(theirs: dict[str, Any], run: dict[str, Any]) -> tuple[str, ...]:
    """How the run ``theirs`` differs from ``run``, one phrase a setting: "model a.gguf, not
    b.gguf", "max_tokens 16, not 17", "another instruction"."""
    said = []
    for key in RUN_KEYS:
        old, new = theirs.get(key), run.get(key)
        if old == new:
            continue
        if key == "model":
            said.append(f"model {_model_name(old)}, not {_model_name(new)}")
        elif key == "model_file":
            if theirs.get("model") == run["model"]:  # another model's file differs, of course
                said.append("the model file changed since")
        elif key in ("system", "instruction"):
            said.append(f"another {key}")
        elif key == "adaptive":
            if theirs.get("samples") == run.get("samples"):  # else the samples say it
                said.append(
                    "samples stopped once settled, not all K"
                    if old
                    else "all K samples, not stopped once settled (--all)"
                )
        else:
            said.append(f"{key} {_short(key, old)}, not {_short(key, new)}")
    return tuple(said) or ("other settings",)


def _model_name(model: Any) -> str:
    return Path(model).name if isinstance(model, str) else _short("model", model)


def _short(key: str, value: Any) -> str:
    if value is None and key in SETTING:
        return SETTING[key].none  # (top_k default, not null)
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def _mismatch_message(output: Path, earlier: EarlierResults) -> str:
    many = earlier.foreign != 1
    count = f"{earlier.foreign} result{'s' if many else ''}"
    if earlier.unlabelled == earlier.foreign:
        what = (
            f"{count} that {'do' if many else 'does'} not say which model and settings made "
            f"{'them' if many else 'it'} (an older phi4?)"
        )
    else:
        what = f"{count} of another run ({'; '.join(earlier.differences)})"
    return (
        f"the results file {output} holds {what}: --restart starts it over, --force-resume "
        "counts them as this run's, or -o names another file"
    )


def result_line(record: dict[str, Any]) -> str:
    """One results-file line: strict JSON (no NaN or Infinity), escaped where a terminal would
    act on a character (`cat` of the file) or UTF-8 has none (a lone surrogate from a problem's
    JSON); the same value read back (:func:`solving.json_text`)."""
    return json_text(record)


def _lines(records: list[dict[str, Any]]) -> bytes:
    return "".join(result_line(r) + "\n" for r in records).encode()


def open_results(
    output: Path, problems: Problems, run: dict[str, Any], policy: MismatchPolicy
) -> tuple[BinaryIO, dict[int, dict[str, Any]], int]:
    """The results file open to append to, this run's records already in it, by line (as
    much of each as the summary counts), and how many bytes of a last record cut short were
    cut off it.

    Raise RefusedFileError (one line, exit 1) when the file is a link, a FIFO or anything but
    a regular file of this user's, or holds records of another model or other settings and
    ``policy`` does not say what to do with them."""
    if policy.restart:
        return replace_user_file(output, RESULTS_FILE, b""), {}, 0
    results = open_user_file(output, RESULTS_FILE)
    try:
        earlier = read_earlier(_text_lines(results, output), problems, run, keep=policy.force)
        if not earlier.foreign:
            return results, earlier.done, _end_on_a_line(results)
        if not policy.force:
            raise RefusedFileError(_mismatch_message(output, earlier))
    except BaseException:
        results.close()
        raise
    results.close()
    # Forced: the other runs' records become this run's, so that the next rerun resumes them
    # too, each saying which run it came from; the rest (stale records, other problems) goes.
    done = {
        line: {**record, "run": run, "adopted_from": record.get("run")}
        for line, record in earlier.adoptable.items()
    }
    done.update(earlier.done)
    kept = [done[item.line] for item in problems if item.line in done]
    return (
        replace_user_file(output, RESULTS_FILE, _lines(kept)),
        {line: _counted(record) for line, record in done.items()},
        0,
    )


def _end_on_a_line(results: BinaryIO) -> int:
    """Make the results file end with a whole line before records are appended to it: a last
    record cut short (a crash while it was written) is cut off, its problem solved again; a
    whole one without its newline gets it. Return how many bytes were cut off."""
    end = results.seek(0, os.SEEK_END)
    if end == 0:
        return 0
    results.seek(end - 1)
    if results.read(1) == b"\n":
        return 0
    start = max(0, end - (1 << 20))
    while True:  # the start of the last line
        results.seek(start)
        chunk = results.read(end - start)
        newline = chunk.rfind(b"\n")
        if newline >= 0 or start == 0:
            last_start = start + newline + 1 if newline >= 0 else 0
            break
        start = max(0, start - (1 << 20))
    results.seek(last_start)
    try:
        json.loads(results.read(end - last_start))
    except ValueError:  # (UnicodeDecodeError too)
        results.truncate(last_start)
        results.seek(last_start)
        return end - last_start
    results.seek(end)
    _append(results, b"\n")
    return 0


def _append(results: BinaryIO, data: bytes) -> None:
    """Append ``data`` (whole lines) to ``results``, or nothing of it: a write cut short (a full
    disk) is cut off again, so that the file holds whole records only. Raise OSError."""
    results.flush()  # (nothing buffered: each write goes through here)
    fd = results.fileno()
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        left = memoryview(data)
        while left:
            left = left[os.write(fd, left) :]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def _text_lines(results: BinaryIO, output: Path) -> Iterator[str]:
    for raw in results:
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RefusedFileError(
                f"the results file {output} is not UTF-8 text (not phi4's?): "
                "move it away, or --restart replaces it"
            ) from None


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
            _append(results, line.encode() + b"\n")
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
    problem and what the file keeps (whole records only: see :func:`_append`)."""
    kept = sum(tally.counts.values())
    return UnwritableError(
        output,
        RESULTS_FILE,
        exc,
        instead=ANOTHER_FILE,
        detail=f"; stopped at line {line}'s record (the {kept:,} judged before it are whole "
        "lines in the file, and the same command resumes from them)",
    )


def _counted(record: dict[str, Any]) -> dict[str, Any]:
    """What :class:`Tally` counts of a record: the rest is in the results file."""
    return {
        key: record[key]
        for key in (
            "line",
            "status",
            "reasoning_tokens",
            "pass_at_k",
            "k",
            "samples_used",
            "samples_unsure",
            "completion_tokens",
            "check",
        )
        if key in record
    }


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
