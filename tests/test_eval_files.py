"""`phi4 eval`'s results file: nobody else's link, FIFO or records are used, and a rerun resumes
only the records its own model and settings made."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_phi4
from tests.scripted_server import Head, Step, scripted_server, separated

PROBLEMS = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": "4"}]
NOBODY = 65534


def _write_problems(path: Path, rows: list[dict[str, str]] = PROBLEMS) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _eval(problems: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_phi4("eval", str(problems), "-m", str(model), "-n", "8", "--json", *extra)


def _correct(line: int, row: dict[str, str]) -> str:
    """A forged record: the reference answer, judged correct."""
    return (
        json.dumps(
            {
                "line": line,
                "problem": row["problem"],
                "reference": row["answer"],
                "answer": row["answer"],
                "status": "correct",
                "correct": True,
                "k": 1,
                "reasoning_tokens": 0,
                "completion_tokens": 1,
                "seconds": 0.1,
            }
        )
        + "\n"
    )


def _as_nobody(*command: str) -> None:
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command],
        check=True,
        timeout=30,
    )


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may write to, sticky, as /tmp is (and reachable by nobody)."""
    directory = Path(tempfile.mkdtemp(prefix="p4-shared-", dir="/tmp"))
    directory.chmod(0o1777)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.daemon
def test_a_fresh_results_file_is_private_and_says_what_made_it(tiny_model: Path, tmp_path: Path):
    problems = _write_problems(tmp_path / "quiz.jsonl")
    result = _eval(problems, tiny_model, "-t", "0")
    assert result.returncode == 0, result.stderr
    results = tmp_path / "quiz.jsonl.results.jsonl"
    assert stat.S_IMODE(results.stat().st_mode) == 0o600, "before: 644, as the umask made it"
    records = _records(results)
    assert [r["line"] for r in records] == [1, 2]
    for record in records:  # what was written can be looked into, and a cut answer says so
        assert isinstance(record["solution"], str) and record["solution"], record
        if record["answer"] is None and record["finish_reason"] == "length":
            assert record["status"] == "truncated", record  # (was: no_answer)
    run = records[0]["run"]
    assert run["model"] == str(tiny_model) and run["backend"] is None
    assert run["model_file"]["size"] == tiny_model.stat().st_size
    assert len(run["model_file"]["head_sha256"]) == 64
    assert (run["temperature"], run["max_tokens"], run["samples"]) == (0.0, 8, 1)
    assert "boxed" in run["instruction"]
    again = _eval(problems, tiny_model, "-t", "0")
    assert again.returncode == 0, again.stderr
    assert "resuming: 2 of 2 problems are already in" in again.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second user")
@pytest.mark.parametrize("plant", ["symlink", "fifo", "their file", "our file they can write"])
@pytest.mark.daemon
def test_a_results_file_planted_by_another_user_is_refused(
    plant: str, tiny_model: Path, shared_dir: Path, tmp_path: Path
):
    # Before: eval appended through the link into the victim's own file, hung on the FIFO, and
    # reported "accuracy": 1.0 from forged records ("resuming: 2 of 2").
    problems = _write_problems(shared_dir / "quiz.jsonl")
    results = shared_dir / "quiz.jsonl.results.jsonl"
    victim = tmp_path / "precious.txt"
    victim.write_text("my own notes\n")
    forged = "".join(_correct(n, row) for n, row in enumerate(PROBLEMS, 1))
    if plant == "symlink":
        _as_nobody("ln", "-s", str(victim), str(results))
    elif plant == "fifo":
        _as_nobody("mkfifo", "-m", "666", str(results))
    elif plant == "their file":
        _as_nobody("sh", "-c", 'umask 022; printf %s "$1" > "$2"', "sh", forged, str(results))
    else:
        results.touch()
        results.chmod(0o666)
        _as_nobody("sh", "-c", 'printf %s "$1" >> "$2"', "sh", forged, str(results))
    before = os.lstat(results)
    result = _eval(problems, tiny_model)  # a FIFO that blocked would time this out
    assert result.returncode == 1, result.stderr
    assert result.stdout == "" and "accuracy" not in result.stdout
    assert "resuming" not in result.stderr
    expected = {
        "symlink": "is a symbolic link",
        "fifo": "is not a regular file",
        "their file": "belongs to uid 65534",
        "our file they can write": "is writable by other users (mode 666)",
    }[plant]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"results file {results} {expected}" in lines[0], result.stderr
    assert victim.read_text() == "my own notes\n", "written through the link"
    after = os.lstat(results)
    assert (after.st_ino, after.st_size, after.st_uid) == (
        before.st_ino,
        before.st_size,
        before.st_uid,
    )
    # --restart puts a new file of ours in its place (in a sticky directory, only root may
    # replace another user's file; anyone else is told they cannot).
    fresh = _eval(problems, tiny_model, "--restart")
    assert fresh.returncode == 0, fresh.stderr
    info = os.lstat(results)
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert victim.read_text() == "my own notes\n"
    assert json.loads(fresh.stdout)["problems"] == 2


@pytest.mark.daemon
def test_a_rerun_with_another_model_does_not_resume_and_the_flags_do_what_they_say(
    tiny_model: Path, tiny_reasoning_model: Path, tmp_path: Path
):
    # Before: a rerun with -m tiny-reasoning.gguf printed "resuming: 2 of 2" and the tiny
    # model's table.
    problems = _write_problems(tmp_path / "quiz.jsonl")
    results = tmp_path / "quiz.jsonl.results.jsonl"
    assert _eval(problems, tiny_model).returncode == 0
    made_by_tiny = results.read_bytes()
    other = _eval(problems, tiny_reasoning_model)
    assert other.returncode == 1
    assert "resuming" not in other.stderr
    assert (
        f"the results file {results} holds 2 results of another run (model tiny-phi3.gguf, "
        "not tiny-reasoning.gguf): --restart starts it over"
    ) in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert results.read_bytes() == made_by_tiny, "refused, and nothing changed"

    restarted = _eval(problems, tiny_reasoning_model, "--restart")
    assert restarted.returncode == 0, restarted.stderr
    assert "resuming" not in restarted.stderr
    records = _records(results)
    assert [r["line"] for r in records] == [1, 2], "the tiny model's records are gone"
    assert {r["run"]["model"] for r in records} == {str(tiny_reasoning_model)}

    forced = _eval(problems, tiny_model, "--force-resume")
    assert forced.returncode == 0, forced.stderr
    assert "resuming: 2 of 2 problems are already in" in forced.stderr
    adopted = _records(results)
    assert {r["run"]["model"] for r in adopted} == {str(tiny_model)}
    assert {r["adopted_from"]["model"] for r in adopted} == {str(tiny_reasoning_model)}
    plain = _eval(problems, tiny_model)  # counted as the tiny model's from now on
    assert plain.returncode == 0, plain.stderr
    assert "resuming: 2 of 2" in plain.stderr
    both = run_phi4("eval", str(problems), "-m", str(tiny_model), "--restart", "--force-resume")
    assert both.returncode == 2 and "contradict" in both.stderr


@pytest.mark.daemon
def test_records_that_do_not_say_what_made_them_are_not_resumed(tiny_model: Path, tmp_path: Path):
    # As an older phi4 wrote them, or as a forger would: all "correct".
    problems = _write_problems(tmp_path / "quiz.jsonl")
    results = tmp_path / "out.jsonl"
    results.write_text("".join(_correct(n, row) for n, row in enumerate(PROBLEMS, 1)))
    refused = _eval(problems, tiny_model, "-o", str(results))
    assert refused.returncode == 1
    assert "holds 2 results that do not say which model and settings made them" in refused.stderr
    fresh = _eval(problems, tiny_model, "-o", str(results), "--restart")
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["accuracy"] == 0.0, "the tiny model gets nothing right"


def _boxed_one(_body: dict[str, Any]) -> list[str | Step]:
    return separated("reasoning_content", ["Think."], ["$\\boxed{1}$"])


@pytest.mark.daemon
def test_other_settings_or_another_engine_do_not_resume(tmp_path: Path):
    problems = _write_problems(tmp_path / "set.jsonl", [{"problem": "p1", "answer": "1"}])
    results = tmp_path / "out.jsonl"
    with scripted_server(_boxed_one) as server, scripted_server(_boxed_one) as elsewhere:
        base = ["eval", str(problems), "-m", "m", "-o", str(results), "--json"]
        assert run_phi4(*base, "--backend", server.url).returncode == 0
        cases = {
            ("-n", "99"): "max_tokens none, not 99",
            ("-t", "0.1"): "temperature 0.8, not 0.1",
            ("--seed", "7"): "seed random, not 7",
            ("-k", "2"): "samples 1, not 2",
            ("--no-instruction",): "another instruction",
            ("-m", "other"): "model m, not other",
        }
        for extra, said in cases.items():
            refused = run_phi4(*base, "--backend", server.url, *extra)
            assert refused.returncode == 1, (extra, refused.stderr)
            assert f"of another run ({said})" in refused.stderr, (extra, refused.stderr)
        moved = run_phi4(*base, "--backend", elsewhere.url)
        assert moved.returncode == 1
        assert f'backend "{server.url}", not "{elsewhere.url}"' in moved.stderr, moved.stderr
        assert len(server.bodies) == 1 and not elsewhere.bodies, "nothing was asked again"
        again = run_phi4(*base, "--backend", server.url)
        assert again.returncode == 0 and "resuming: 1 of 1" in again.stderr


def test_open_user_file_refuses_what_it_cannot_trust_and_never_blocks(tmp_path: Path):
    from phi4cli.core.atomicfile import RefusedFileError, open_user_file

    os.mkfifo(tmp_path / "fifo")  # ours, but a FIFO: opening it must not wait for a writer
    (tmp_path / "dir").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # O_EXCL must not create "nowhere"
    (tmp_path / "shared").write_text("")
    (tmp_path / "shared").chmod(0o664)
    (tmp_path / "plain").write_text("")
    cases = {
        "fifo": "is not a regular file",
        "dir": "Is a directory",
        "dangling": "is a symbolic link",
        "shared": "is writable by other users (mode 664); phi4 will not use it: chmod go-w it",
        "plain/below": "plain: it is not a directory",
    }
    for name, said in cases.items():
        with pytest.raises(RefusedFileError) as refused:
            open_user_file(tmp_path / name, "results file")
        assert said in str(refused.value), (name, str(refused.value))
        assert "\n" not in str(refused.value)
    assert not (tmp_path / "nowhere").exists()
    with open_user_file(tmp_path / "new" / "out.jsonl", "results file") as handle:
        assert handle.read() == b""
        handle.write(b"one\n")
    with open_user_file(tmp_path / "new" / "out.jsonl", "results file") as handle:
        assert handle.read() == b"one\n"
        handle.write(b"two\n")  # appended, whatever was read
    assert (tmp_path / "new" / "out.jsonl").read_bytes() == b"one\ntwo\n"
    assert stat.S_IMODE((tmp_path / "new" / "out.jsonl").stat().st_mode) == 0o600


@pytest.mark.daemon
def test_a_results_path_that_cannot_be_a_file_is_one_line_and_exit_1(
    tiny_model: Path, tmp_path: Path
):
    problems = _write_problems(tmp_path / "quiz.jsonl")
    (tmp_path / "plain").write_text("")
    result = _eval(problems, tiny_model, "-o", str(tmp_path / "plain" / "out.jsonl"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"phi4: error: cannot create the results file {tmp_path}/plain/out.jsonl: "
        f"{tmp_path}/plain: it is not a directory"
    ]


@pytest.mark.daemon
def test_a_hard_link_to_a_file_of_yours_is_not_appended_to(tiny_model: Path, shared_dir: Path):
    # Where fs.protected_hardlinks is 0, any user can link a file of yours (~/.bashrc) into
    # /tmp under the results file's name: a regular file of yours, mode 644, but not eval's.
    problems = _write_problems(shared_dir / "quiz.jsonl")
    victim = shared_dir / "notes.txt"
    victim.write_text("my own notes\n")
    os.link(victim, shared_dir / "quiz.jsonl.results.jsonl")
    result = _eval(problems, tiny_model)
    assert result.returncode == 1
    assert "has 1 other name(s) (hard links); phi4 will not use it" in result.stderr
    assert victim.read_text() == "my own notes\n"


def test_a_backend_url_is_recorded_without_its_password():
    import io

    from phi4cli.backends.remote_backend import RemoteBackend
    from phi4cli.client.environment import Environment
    from phi4cli.client.eval_results import run_identity
    from phi4cli.client.solve_job import SolveJob
    from phi4cli.core._settings import Ask
    from phi4cli.core.protocol import SolveParams

    backend = RemoteBackend("http://me:s3cret@127.0.0.1:8080/v1", "m", "sk-key", 5.0)
    env = Environment(io.StringIO(), io.StringIO(), io.StringIO())
    request = SolveParams("", Ask(temperature=0.0), model="m")
    job = SolveJob(backend, env, request, instruction="Box it.")
    run = run_identity(job, 2)
    assert run["backend"] == "http://127.0.0.1:8080/v1"
    assert "s3cret" not in json.dumps(run) and "sk-key" not in json.dumps(run)
    assert (run["model"], run["model_file"], run["instruction"], run["samples"]) == (
        "m",
        None,
        "Box it.",
        2,
    )


def test_a_rewritten_results_file_escapes_what_the_appended_lines_escape():
    # Before: --force-resume's rewrite wrote json.dumps(...).encode(): a lone surrogate from a
    # problem's JSON was an "internal error", and a C1 character went into the file raw.
    from phi4cli.client.eval_results import _lines

    written = _lines([{"reference": "\ud800", "answer": "\x9b31m"}])
    assert b"\\ud800" in written and b"\\u009b" in written and b"\xc2\x9b" not in written
    assert json.loads(written) == {"reference": "\ud800", "answer": "\x9b31m"}


# --- the input, read as the run goes ----------------------------------------------------------


def test_eval_holds_only_the_problems_being_solved_and_skips_those_already_done(tmp_path: Path):
    from phi4cli.client.eval_problems import Pending, Problems

    rows = [{"problem": f"p{i}", "answer": str(i)} for i in range(1, 1001)]
    path = _write_problems(tmp_path / "set.jsonl", rows)
    problems = Problems(path, "problem", "answer")
    assert problems.check() == 1000
    todo = Pending(problems, {2, 3}, 998)
    assert len(todo) == 998
    assert [todo[0].line, todo[1].line, todo[2].line] == [1, 4, 5], "lines 2 and 3 are done"
    assert todo[1].problem == "p4" and todo.held == 3, "read up to what was asked for"
    for index in range(3):
        todo.release(index)
    assert todo.held == 0, "a judged problem is let go"
    for index in range(3, 998):
        assert todo[index].line == index + 3
        todo.release(index)
        assert todo.held == 0
    with pytest.raises(IndexError):
        todo[998]
    todo.close()


def test_an_input_that_shrinks_while_eval_reads_it_stops_with_one_line(tmp_path: Path):
    from phi4cli.client.eval_problems import Pending, Problems
    from phi4cli.core.errors import UsageError

    path = _write_problems(tmp_path / "set.jsonl")
    problems = Problems(path, "problem", "answer")
    todo = Pending(problems, set(), problems.check())
    _write_problems(path, PROBLEMS[:1])
    assert todo[0].line == 1
    with pytest.raises(UsageError, match=r"set\.jsonl changed while eval read it"):
        todo[1]


@pytest.mark.daemon
def test_eval_numbers_lines_as_before_and_names_a_line_that_is_not_utf8(tmp_path: Path):
    from phi4cli.client.eval_problems import Problems
    from phi4cli.core.errors import UsageError

    # Lines are numbered as str.splitlines numbers them: "\r" and a blank line count.
    path = tmp_path / "set.jsonl"
    path.write_bytes(
        b'{"problem": "a", "answer": "1"}\r\n\n{"problem": "b", "answer": "2"}\r'
        b'{"problem": "c", "answer": "3"}'
    )
    assert [(i.line, i.problem) for i in Problems(path, "problem", "answer")] == [
        (1, "a"),
        (3, "b"),
        (4, "c"),
    ]
    csv_file = tmp_path / "set.csv"
    csv_file.write_text('problem,answer\n"two\nlines",1\nnext,2\n')
    assert [(i.line, i.problem) for i in Problems(csv_file, "problem", "answer")] == [
        (3, "two\nlines"),
        (4, "next"),
    ]
    # A CSV is read as read_text() and csv.DictReader over it read it: line ends translated.
    import csv
    import io

    for text in (
        b"problem,answer\r1+1,2\r",
        b'problem,answer\r\n"a\r\nb",3\r\n',
        b'problem,answer\n"a\rb",2\n3+3,6\n',
    ):
        csv_file.write_bytes(text)
        reader = csv.DictReader(io.StringIO(csv_file.read_text()))
        before = [(reader.line_num, row["problem"]) for row in reader]
        assert [(i.line, i.problem) for i in Problems(csv_file, "problem", "answer")] == before
    csv_file.write_bytes(b'problem,answer\n"' + b"x" * 200_000 + b'",1\n')  # over its limit
    with pytest.raises(UsageError, match=r"set\.csv:\d+: not CSV"):
        list(Problems(csv_file, "problem", "answer"))
    path.write_bytes(b'{"problem": "a", "answer": "1"}\n{"problem": "\xff", "answer": "2"}\n')
    result = run_phi4("eval", str(path), "--backend", "http://127.0.0.1:9/v1", "-m", "m")
    assert result.returncode == 2
    assert result.stderr.strip().endswith("set.jsonl:2: not UTF-8 text"), result.stderr


def test_a_problem_changed_and_changed_back_resumes_its_record():
    from phi4cli.client.eval_problems import Item
    from phi4cli.client.eval_results import RUN_KEYS, read_earlier

    run = {**dict.fromkeys(RUN_KEYS), "samples": 1, "model": "m"}

    def record(problem: str, status: str) -> str:
        fields = {"problem": problem, "reference": "1", "status": status, "k": 1}
        return json.dumps(
            {"line": 1, **fields, "reasoning_tokens": 0, "completion_tokens": 1, "run": run}
        )

    lines = [record("A", "correct"), record("B", "wrong"), "{cut sho"]
    for problem, status in (("A", "correct"), ("B", "wrong"), ("C", None)):
        earlier = read_earlier(lines, [Item(1, problem, "1")], run)
        assert earlier.done.get(1, {}).get("status") == status
        assert earlier.foreign == 0 and earlier.adoptable == {}
    other = read_earlier(lines, [Item(1, "A", "1")], {**run, "model": "n"})
    assert other.foreign == 2 and other.done == {} and other.adoptable == {}, "not kept unasked"
    forced = read_earlier(lines, [Item(1, "A", "1")], {**run, "model": "n"}, keep=True)
    assert forced.adoptable[1]["problem"] == "A", "the whole record, to rewrite the file from"
    assert "problem" not in read_earlier(lines, [Item(1, "A", "1")], run).done[1], "as counted"


@pytest.mark.daemon
def test_eval_of_problems_added_to_a_finished_file_solves_only_the_new_ones(tmp_path: Path):
    def script(body: dict[str, Any]) -> list[str | Step]:
        number = body["messages"][-1]["content"].split("\n\n")[0].removeprefix("p")
        return separated("reasoning_content", ["Think."], [f"$\\boxed{{{number}}}$"])

    rows = [{"problem": f"p{i}", "answer": str(i if i % 3 else -i)} for i in range(1, 121)]
    path = _write_problems(tmp_path / "set.jsonl", rows[:60])
    with scripted_server(script) as server:
        args = ["eval", str(path), "--backend", server.url, "-m", "m", "--json"]
        first = run_phi4(*args)
        assert first.returncode == 0, first.stderr
        assert (json.loads(first.stdout)["problems"], json.loads(first.stdout)["correct"]) == (
            60,
            40,
        )
        _write_problems(path, rows)
        second = run_phi4(*args)
        assert second.returncode == 0, second.stderr
        assert "resuming: 60 of 120 problems are already in" in second.stderr
        asked = sorted(
            int(body["messages"][-1]["content"].split("\n\n")[0][1:]) for body in server.bodies
        )
    assert asked == list(range(1, 121)), "each problem asked once: the first 60 in the first run"
    result = json.loads(second.stdout)
    assert (result["problems"], result["correct"], result["wrong"]) == (120, 80, 40)
    records = _records(Path(result["results"]))
    assert sorted(r["line"] for r in records) == list(range(1, 121))
    assert all(r["problem"] == f"p{r['line']}" for r in records)


@pytest.mark.daemon
def test_eval_of_an_input_read_once_and_of_a_csv_ends_cleanly(tmp_path: Path):
    # A pipe (<(zcat ...), /dev/stdin) cannot be read twice: it is read whole and held, as
    # before. And a CSV's reader is closed in order: no "Exception ignored" at the end.
    def script(body: dict[str, Any]) -> list[str | Step]:
        number = body["messages"][-1]["content"].split("\n\n")[0].removeprefix("p")
        return separated("reasoning_content", ["Think."], [f"$\\boxed{{{number}}}$"])

    rows = "".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(5))
    table = tmp_path / "set.csv"
    table.write_text("problem,answer\r\n" + "".join(f"p{i},{i}\r\n" for i in range(5)))
    with scripted_server(script) as server:
        common = ("--backend", server.url, "-m", "m", "--json")
        piped = run_phi4(
            "eval", "/dev/stdin", "-o", str(tmp_path / "piped.jsonl"), *common, input=rows
        )
        from_csv = run_phi4("eval", str(table), *common)
    for result in (piped, from_csv):
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["correct"] == 5
        assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr


def _numbered(body: dict[str, Any]) -> list[str | Step]:
    number = body["messages"][-1]["content"].split("\n\n")[0].removeprefix("p")
    return separated("reasoning_content", ["Think."], [f"$\\boxed{{{number}}}$"])


@pytest.mark.daemon
def test_results_are_never_written_into_the_problems_file(tmp_path: Path):
    # Before: `-o` naming the input appended each record to the problems, and the next run
    # refused the file ("no 'answer'").
    path = _write_problems(tmp_path / "set.jsonl", [{"problem": "p1", "answer": "1"}])
    before = path.read_bytes()
    with scripted_server(_numbered) as server:
        refused = run_phi4(
            "eval",
            str(path),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(tmp_path / "." / "set.jsonl"),
        )
        assert not server.bodies, "nothing was asked"
    assert refused.returncode == 2
    assert "is the problems file itself; give the results another file" in refused.stderr
    assert path.read_bytes() == before


@pytest.mark.daemon
def test_a_last_record_cut_short_is_cut_off_and_its_problem_solved_again(tmp_path: Path):
    # A run stopped while it wrote a record (a crash, a full disk): the rerun appended the next
    # record onto the broken line, which then held two records and parsed as neither.
    rows = [{"problem": f"p{i}", "answer": str(i)} for i in range(1, 5)]
    path = _write_problems(tmp_path / "set.jsonl", rows)
    results = tmp_path / "out.jsonl"
    with scripted_server(_numbered) as server:
        args = ["eval", str(path), "--backend", server.url, "-m", "m", "-o", str(results), "--json"]
        assert run_phi4(*args).returncode == 0
        whole = results.read_bytes()
        last = whole.rstrip(b"\n").rsplit(b"\n", 1)[1]
        results.write_bytes(whole[: len(whole) - 1 - len(last) // 2])  # half the last record
        again = run_phi4(*args)
        assert again.returncode == 0, again.stderr
        assert "resuming: 3 of 4 problems" in again.stderr
        cut = len(last) - len(last) // 2
        assert f"ended in a record cut short ({cut:,} bytes" in again.stderr, again.stderr
        records = _records(results)  # every line whole JSON
        assert sorted(r["line"] for r in records) == [1, 2, 3, 4]
        assert json.loads(again.stdout)["correct"] == 4
        # A whole last record without its newline is kept, and the next one starts a line.
        results.write_bytes(results.read_bytes().rstrip(b"\n"))
        path.write_text(path.read_text() + json.dumps({"problem": "p5", "answer": "5"}) + "\n")
        third = run_phi4(*args)
        assert third.returncode == 0 and "cut short" not in third.stderr, third.stderr
        assert sorted(r["line"] for r in _records(results)) == [1, 2, 3, 4, 5]


def _failing_second(body: dict[str, Any]) -> list[str | Step | Head]:
    if body["messages"][-1]["content"].startswith("p2"):
        return [
            Head(400, {"Content-Type": "application/json"}),
            '{"error": {"message": "the question is too long"}}',
        ]
    return list(_numbered(body))


@pytest.mark.daemon
def test_a_failed_problem_is_said_on_stderr_and_a_record_says_how_the_answer_ended(
    tmp_path: Path,
):
    path = _write_problems(
        tmp_path / "set.jsonl", [{"problem": f"p{i}", "answer": str(i)} for i in (1, 2)]
    )
    with scripted_server(_failing_second) as server:
        result = run_phi4("eval", str(path), "--backend", server.url, "-m", "m", "--json")
    assert result.returncode == 1
    assert "line 2: " in result.stderr and "the question is too long" in result.stderr
    records = {r["line"]: r for r in _records(Path(json.loads(result.stdout)["results"]))}
    assert records[1]["finish_reason"] == "stop" and records[2]["status"] == "error"


@pytest.mark.daemon
def test_a_csv_from_a_spreadsheet_and_a_missing_column_name_what_the_file_has(tmp_path: Path):
    with_bom = tmp_path / "excel.csv"
    with_bom.write_bytes(b"\xef\xbb\xbfproblem,answer\r\np1,1\r\n")
    jsonl_bom = tmp_path / "bom.jsonl"
    jsonl_bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"problem": "p1", "answer": "1"}).encode())
    semicolons = tmp_path / "semi.csv"
    semicolons.write_text("problem;answer\np1;1\n")
    empty = _write_problems(tmp_path / "empty.jsonl", [{"problem": "p1", "answer": ""}])
    with scripted_server(_numbered) as server:
        common = ("--backend", server.url, "-m", "m", "--json")
        for path in (with_bom, jsonl_bom):
            read = run_phi4("eval", str(path), *common)
            assert read.returncode == 0 and json.loads(read.stdout)["correct"] == 1, read.stderr
        semi = run_phi4("eval", str(semicolons), *common)
        assert semi.returncode == 2
        assert (
            "no 'problem' (--problem-field names it; the columns are 'problem;answer')"
            in semi.stderr
        ), semi.stderr
        blank = run_phi4("eval", str(empty), *common)
        assert blank.returncode == 2 and f"{empty}:1: 'answer' is empty" in blank.stderr


@pytest.mark.daemon
def test_an_eval_that_reaches_no_engine_leaves_no_empty_results_file(tmp_path: Path):
    path = _write_problems(tmp_path / "set.jsonl")
    results = tmp_path / "out.jsonl"
    unreachable = ("--backend", "http://127.0.0.1:9/v1", "-m", "m", "-o", str(results))
    failed = run_phi4("eval", str(path), *unreachable)
    assert failed.returncode == 3 and not results.exists(), "made, and then left empty"
    results.write_text("")  # one that was there is the user's: left as it was
    assert run_phi4("eval", str(path), *unreachable).returncode == 3 and results.exists()
