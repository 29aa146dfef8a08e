"""A full or read-only disk, or a directory that is not yours to write in, in every command that
writes: one line on stderr saying what to do, exit 1, nothing half-written left and nothing lost.
Tested on small tmpfs filesystems (mounting one needs root: those tests are skipped elsewhere),
on /dev/full, and with the failing write made in-process."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PHI4, run_phi4
from tests.scripted_server import Step, scripted_server, separated

NOBODY = 65534


def _numbered(body: dict[str, Any]) -> list[str | Step]:
    number = body["messages"][-1]["content"].split("\n\n")[0].removeprefix("p")
    return separated("reasoning_content", ["Think."], [f"$\\boxed{{{number}}}$"])


def _problems(path: Path, count: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(1, count + 1)
        )
    )
    return path


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("phi4: error: "), stderr
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr
    return lines[0]


def _fill(directory: Path) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    with contextlib.suppress(OSError):
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)


Mount = Callable[..., Path]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """Mount small tmpfs filesystems (``size``; ``full``: filled up; ``read_only``), each
    unmounted after the test. Skipped where no tmpfs can be mounted (not root)."""
    mounts: list[Path] = []

    def mount(
        name: str = "disk", size: str = "64k", full: bool = False, read_only: bool = False
    ) -> Path:
        where = tmp_path / name
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=755", "tmpfs", str(where)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounts.append(where)
        if full:
            _fill(where)
        if read_only:
            remount(where, "ro")
        return where

    try:
        yield mount
    finally:
        for where in reversed(mounts):
            subprocess.run(["umount", "-l", str(where)], check=False)


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def _records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    assert not text or text.endswith("\n"), "the last record is whole"
    return [json.loads(line) for line in text.splitlines()]


# --- eval's results file --------------------------------------------------------------------


@pytest.mark.daemon
def test_eval_on_a_full_disk_stops_with_one_line_keeps_whole_records_and_resumes(
    tmpfs: Mount, tmp_path: Path
):
    # Before: "phi4: internal error: OSError: [Errno 28] No space left on device", and the
    # results file ended in half a record.
    disk = tmpfs(size="16k")
    problems = _problems(tmp_path / "set.jsonl", 60)
    results = disk / "out.jsonl"
    with scripted_server(_numbered) as server:
        args = [
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(results),
            "--json",
        ]
        stopped = run_phi4(*args)
        assert stopped.returncode == 1
        line = one_error_line(stopped.stderr)
        assert line.startswith(
            f"phi4: error: cannot write the results file {results}: no "
            f"space left on {disk}: free some space there, or name another "
            "results file with -o; stopped at line "
        )
        kept = _records(results)  # every line whole JSON
        assert 0 < len(kept) < 60
        assert f"(the {len(kept)} judged before it are whole lines in the file" in line
        remount(disk, "size=1m")  # room again
        resumed = run_phi4(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {len(kept)} of 60 problems are already in" in resumed.stderr
    assert sorted(r["line"] for r in _records(results)) == list(range(1, 61))
    assert json.loads(resumed.stdout)["correct"] == 60


@pytest.mark.daemon
def test_eval_whose_first_record_does_not_fit_leaves_no_results_file(tmpfs: Mount, tmp_path: Path):
    # Before: an empty results file was left behind.
    disk = tmpfs(full=True)
    results = disk / "out.jsonl"
    with scripted_server(_numbered) as server:
        failed = run_phi4(
            "eval",
            str(_problems(tmp_path / "set.jsonl", 2)),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(results),
        )
    assert failed.returncode == 1
    assert f"no space left on {disk}: free some space there" in one_error_line(failed.stderr)
    assert not results.exists()


@pytest.mark.daemon
def test_eval_on_a_read_only_disk_is_one_line_and_changes_nothing(tmpfs: Mount, tmp_path: Path):
    disk = tmpfs()
    results = disk / "out.jsonl"
    problems = _problems(tmp_path / "set.jsonl", 3)
    with scripted_server(_numbered) as server:
        common = ["eval", str(problems), "--backend", server.url, "-m", "m", "-o"]
        assert run_phi4(*common, str(results)).returncode == 0
        _problems(problems, 4)  # one more to solve: the file is appended to
        before = results.read_bytes()
        remount(disk, "ro")
        for extra in ((), ("--restart",)):
            refused = run_phi4(*common, str(results), *extra)
            assert refused.returncode == 1
            line = one_error_line(refused.stderr)
            assert (
                f"the results file {results}: {disk} is mounted read-only: name another "
                "results file with -o" in line
            )
            assert results.read_bytes() == before
        fresh = run_phi4(*common, str(disk / "new.jsonl"))
        assert fresh.returncode == 1 and "mounted read-only" in one_error_line(fresh.stderr)
        assert sorted(os.listdir(disk)) == ["out.jsonl"], "no temp file, no empty file"


@pytest.fixture
def locked_dir() -> Iterator[Path]:
    """A directory its user may read but not write in (0500): nobody's, when the suite runs as
    root (root may write anywhere), which the test then runs phi4 as."""
    parent = Path(tempfile.mkdtemp(prefix="p4-locked-", dir="/tmp"))
    parent.chmod(0o755)
    locked = parent / "locked"
    locked.mkdir(mode=0o500)
    if os.getuid() == 0:
        os.chown(locked, NOBODY, NOBODY)
    try:
        yield locked
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _as_the_locked_dirs_owner(*args: str) -> subprocess.CompletedProcess[str]:
    if os.getuid() != 0:
        return run_phi4(*args)
    home = Path(tempfile.mkdtemp(prefix="p4-nobody-", dir="/tmp"))
    os.chown(home, NOBODY, NOBODY)
    try:
        return subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", PHI4, *args],
            capture_output=True,
            text=True,
            env={**os.environ, "PHI4_HOME": str(home)},
            timeout=300,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    finally:
        run_phi4("stop", env={"PHI4_HOME": str(home)})
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.daemon
def test_eval_into_a_directory_you_may_not_write_in_is_one_line(locked_dir: Path):
    problems = _problems(locked_dir.parent / "set.jsonl", 1)
    problems.chmod(0o644)
    results = locked_dir / "out.jsonl"
    with scripted_server(_numbered) as server:
        refused = _as_the_locked_dirs_owner(
            "eval", str(problems), "--backend", server.url, "-m", "m", "-o", str(results)
        )
        assert not server.bodies, "refused before anything was asked"
    assert refused.returncode == 1
    assert one_error_line(refused.stderr) == (
        f"phi4: error: cannot create the results file {results}: permission denied: you may "
        f"not write {results} (or in its directory): name another results file with -o"
    )
    assert not os.listdir(locked_dir)


def test_a_record_cut_short_by_a_full_disk_is_cut_off_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # The in-process check of what the tmpfs test shows: a write that stops part-way leaves
    # the file as it was before the record, whatever the disk.
    from phi4cli.client import eval_results

    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"line": 1}\n')
    written: list[int] = []

    def half_then_full(fd: int, data: Any) -> int:
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(len(data) // 2)
        return real_write(fd, bytes(data[: len(data) // 2]))

    real_write = os.write
    with path.open("r+b") as results:
        monkeypatch.setattr(eval_results.os, "write", half_then_full)
        with pytest.raises(OSError):
            eval_results.append_lines(results, b'{"line": 2, "answer": "a long record"}\n')
    assert written and path.read_bytes() == b'{"line": 1}\n'


def test_a_replaced_results_file_that_does_not_fit_is_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from phi4cli.core import atomicfile

    path = tmp_path / "out.jsonl"
    path.write_bytes(b"old\n")

    def no_space(_fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomicfile.os, "fsync", no_space)
    with pytest.raises(atomicfile.UnwritableError, match="free some space there"):
        atomicfile.replace_user_file(path, "results file", b"new\n")
    assert path.read_bytes() == b"old\n" and os.listdir(tmp_path) == ["out.jsonl"]


# --- the config, chats, staging, the cache --------------------------------------------------


@pytest.mark.parametrize("disk_state", ["full", "read-only"])
@pytest.mark.daemon
def test_config_set_unset_and_edit_on_a_full_or_read_only_disk_change_nothing(
    tmpfs: Mount, disk_state: str
):
    # Before: `config edit` on a full disk was "internal error: OSError".
    disk = tmpfs()
    home = {"PHI4_HOME": str(disk / "home")}
    for key, value in (("temperature", "0.3"), ("top_p", "0.9")):
        assert run_phi4("config", "set", key, value, env=home).returncode == 0
    config = disk / "home" / "config" / "config.toml"
    before = config.read_bytes()
    if disk_state == "full":
        _fill(disk)
        why = f"no space left on {disk}: free some space there"
    else:
        remount(disk, "ro")
        why = f"{disk} is mounted read-only"
    for args in (("set", "temperature", "0.5"), ("unset", "temperature"), ("edit",)):
        result = run_phi4("config", *args, env={**home, "EDITOR": "true", "VISUAL": "true"})
        assert result.returncode == 1, (args, result.stderr)
        line = one_error_line(result.stderr)
        assert line.startswith("phi4: error: cannot write the config file") and why in line
        assert line.endswith(f"; {config} is unchanged"), line
        assert config.read_bytes() == before
    assert sorted(os.listdir(config.parent)) == ["config.toml"], "no draft, no temp file"


@pytest.mark.daemon
def test_a_piped_chat_on_a_full_disk_answers_and_says_what_was_not_saved(tmpfs: Mount):
    disk = tmpfs(full=True)
    home = disk / "home"
    with contextlib.suppress(OSError):
        home.mkdir()
    with scripted_server(_numbered) as server:
        chat = run_phi4(
            "chat",
            "--backend",
            server.url,
            "-m",
            "m",
            input="p7\np8\n",
            env={"PHI4_HOME": str(home)},
        )
    assert chat.returncode == 1, chat.stderr
    assert "7" in chat.stdout and "8" in chat.stdout, "every answer shown"
    lines = chat.stderr.splitlines()
    # The history cannot keep the answers either: said once, not at every answer.
    kept = [line for line in lines if "history" in line]
    assert len(kept) == 1 and "not kept in the history" in kept[0], chat.stderr
    assert "moved to" not in chat.stderr, "a full disk is not a damaged database"
    lines = [line for line in lines if line not in kept]
    assert len(lines) == 2 and "Traceback" not in chat.stderr, chat.stderr  # said once, then
    assert "cannot save the conversation" in lines[0] and "no space left on" in lines[0]
    assert lines[1].startswith("phi4: error: cannot save the conversation")
    assert lines[1].endswith("what it holds since it was last saved is in the answers above only")


def test_a_chat_that_can_save_again_by_its_end_says_nothing_more(tmp_path: Path):
    from phi4cli.client.chats import ChatStore, Conversation
    from phi4cli.client.environment import Environment
    from phi4cli.client.repl import ChatRepl
    from phi4cli.core.atomicfile import UnwritableError
    from phi4cli.core.config import Settings

    class FullUntilFreed(ChatStore):
        full = True

        def save(self, conversation: Conversation) -> Path:
            if self.full:
                raise UnwritableError(
                    self.path(conversation.name),
                    "conversation",
                    OSError(errno.ENOSPC, "full"),
                    verb="save",
                )
            return super().save(conversation)

    class NoEngine:
        def connect(self) -> None:
            pass

        def close(self) -> None:
            pass

    err = io.StringIO()
    store = FullUntilFreed(tmp_path / "chats")
    repl = ChatRepl(
        Environment(io.StringIO(), io.StringIO(), err),
        NoEngine(),  # type: ignore[arg-type]
        Settings(),
        "m",
        Conversation(name="c", model="m"),
        store,
    )
    repl._autosave()
    repl._autosave()
    assert err.getvalue().count("cannot save the conversation") == 1, "said once"
    store.full = False
    assert repl.run(lambda _prompt: None) == 0  # type: ignore[arg-type]
    assert err.getvalue().count("cannot save") == 1 and store.load("c").name == "c"


@pytest.mark.daemon
def test_cache_clear_on_a_read_only_staging_dir_is_one_line(tmpfs: Mount):
    disk = tmpfs()
    staging = disk / "stage"
    staging.mkdir(mode=0o700)
    (staging / "model-3-1.gguf").write_bytes(b"abc")
    remount(disk, "ro")
    cleared = run_phi4("cache", "clear", env={"PHI4_RAMDISK": str(staging)})
    assert cleared.returncode == 1
    assert one_error_line(cleared.stderr) == (
        f"phi4: error: cannot remove the staged model copy {staging / 'model-3-1.gguf'}: "
        f"{disk} is mounted read-only (removed 0 staged model copies, 0 saved prompt states "
        "and 0 swapped-out chat sessions)"
    )


def test_a_model_is_loaded_from_its_file_when_staging_cannot_write(tmpfs: Mount, tiny_model: Path):
    # Before: the temp file's creation on a read-only staging dir raised, and the model failed
    # to load; an old copy that could not be removed did too.
    from phi4cli.daemon.ramdisk import stage

    disk = tmpfs(size="1g")
    staging = disk / "stage"
    staging.mkdir(mode=0o700)
    (staging / f"{tiny_model.stem}-1-2.gguf").write_bytes(b"an older copy")
    remount(disk, "ro")
    staged = stage(tiny_model, "on", staging)
    assert staged.path == tiny_model and not staged.staged
    assert staged.note is not None and f"{disk} is mounted read-only" in staged.note


# --- stdout ---------------------------------------------------------------------------------


def _phi4_to(target: Path, *args: str) -> subprocess.CompletedProcess[str]:
    with target.open("w") as out:
        return subprocess.run(
            [PHI4, *args],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
            check=False,
        )


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.daemon
def test_output_to_dev_full_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffered: bool
):
    # Before: "phi4: internal error: OSError: [Errno 28] No space left on device".
    if buffered:
        monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    else:
        monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    problems = _problems(tmp_path / "set.jsonl", 2)
    with scripted_server(_numbered) as server:
        backend = ("--backend", server.url, "-m", "m")
        for args in (
            ("solve", "p1", *backend),
            ("solve", "--file", str(problems), "--jsonl", *backend),
            ("config", "show"),
        ):
            result = _phi4_to(Path("/dev/full"), *args)
            assert result.returncode == 1, args
            assert one_error_line(result.stderr) == (
                "phi4: error: cannot write the output to "
                "/dev/full: No space left on device: send "
                "it elsewhere"
            )


@pytest.mark.daemon
def test_output_to_a_file_on_a_full_disk_is_one_line(tmpfs: Mount, tiny_model: Path):
    disk = tmpfs(full=True)
    out = disk / "answer.txt"
    with contextlib.suppress(OSError):
        out.touch()
    if not out.exists():
        pytest.skip("not even an empty file fits")
    # With a daemon running, and with a --backend.
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    try:
        with scripted_server(_numbered) as server:
            for engine in (
                ("-m", str(tiny_model), "-n", "400"),
                ("--backend", server.url, "-m", "m"),
            ):
                result = _phi4_to(out, "solve", "p4", *engine)
                assert result.returncode == 1
                assert one_error_line(result.stderr) == (
                    f"phi4: error: cannot write the output to {out}: no space left on {disk}: "
                    "free some space there, or send it elsewhere"
                )
    finally:
        run_phi4("stop")


def test_an_error_that_is_not_stdouts_is_not_taken_for_it():
    from phi4cli.client.exits import output_problem

    with open(os.devnull, "w") as fine:
        assert output_problem(OSError(errno.ENOSPC, "full"), fine) is None
    full = open("/dev/full", "w")  # noqa: SIM115 - its close fails: what is left cannot go
    try:
        full.write("x")
        assert output_problem(OSError(errno.ENOSPC, "full", "/some/file"), full) is None
        assert output_problem(OSError(errno.ENOSPC, "full"), full) is not None
    finally:
        with contextlib.suppress(OSError):
            full.close()
