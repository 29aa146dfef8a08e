"""The results file of `phi4 eval`: a JSONL record a problem, appended whole (or not at all) as
each is judged. What made a record is written in it (the run: model file, engine, instruction,
sampling), and a rerun resumes only this run's records of problems that have not changed:
another model's verdicts must never be reported as this one's (``--restart`` and
``--force-resume`` say what to do with them). The file sits next to a user-given path, perhaps
in /tmp, so it is opened by ``atomicfile.open_user_file``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from phi4cli.client.eval_problems import Item, Problems
from phi4cli.client.solve_job import SolveJob, json_text
from phi4cli.core.atomicfile import RefusedFileError, open_user_file, replace_user_file
from phi4cli.core.options import REQUEST_KEYS, SETTING
from phi4cli.text.confidence import WARMUP

STATUSES = ("correct", "wrong", "no_answer", "truncated", "error")


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
    JSON); the same value read back (:func:`solve_job.json_text`)."""
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
    append_lines(results, b"\n")
    return 0


def append_lines(results: BinaryIO, data: bytes) -> None:
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


def _counted(record: dict[str, Any]) -> dict[str, Any]:
    """What :class:`grading.Tally` counts of a record: the rest is in the results file."""
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
