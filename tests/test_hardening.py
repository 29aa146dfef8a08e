"""Hostile use, as a new user or a script would try it: bad values, a full disk, damaged files.
Each is one clear line on stderr and a documented exit status, and nothing already saved is lost.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from phi4cli.backends.daemon import DaemonBackend
from phi4cli.client.chats import ChatStore, Conversation
from phi4cli.client.environment import Environment
from phi4cli.client.repl import ChatRepl
from phi4cli.core.config import Settings
from phi4cli.core.paths import get_paths
from tests.conftest import holding_daemon_lock, run_phi4


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "internal error" not in lines[0] and "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["solve", "x", "-n", "0"], "0 is not in the range x>=1"),
        (["solve", "x", "--n-ctx", "16"], "at least 64"),
        (["solve", "x", "--threads", "100000"], "4 per CPU of this machine"),
        (["serve", "--http", "127.0.0.1:99999"], "a port up to 65535"),
        (["solve", "x", "--backend", "http://[::1"], "expected the http(s) URL"),
    ],
    ids=["max-tokens-0", "n-ctx-16", "threads-100000", "port-99999", "malformed-backend-url"],
)
@pytest.mark.daemon
def test_bad_values_are_refused_before_anything_runs(args: list[str], phrase: str):
    # Before: -n 0 meant unlimited; --n-ctx 16 aborted the daemon; --threads 100000 crashed it;
    # port 99999 was "internal error: OverflowError".
    result = run_phi4(*args)
    assert result.returncode == 2, result.stderr
    assert phrase in result.stderr
    assert run_phi4("status").returncode == 3, "no daemon was started"


@pytest.mark.daemon
def test_a_binary_config_file_is_named(phi4_home: Path):
    config = phi4_home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_bytes(b"\x00\xff\xfe binary \x89PNG")
    line = one_error_line(run_phi4("config", "show").stderr)
    assert line == f"phi4: error: {config} is not a text file (TOML); fix or remove it"


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, filled up."""
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with contextlib.suppress(OSError), (mount / "filler").open("wb") as handle:
            while True:
                handle.write(b"\0" * 4096)
                handle.flush()
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.daemon
def test_config_set_on_a_full_disk_changes_nothing(full_disk: Path):
    home = full_disk / "home"
    config = home / "config" / "config.toml"
    with contextlib.suppress(OSError):
        config.parent.mkdir(parents=True)
    if not config.parent.is_dir():
        pytest.skip("not even a directory fits")
    result = run_phi4("config", "set", "temperature", "0.2", env={"PHI4_HOME": str(home)})
    assert result.returncode == 1
    assert one_error_line(result.stderr).startswith(
        f"phi4: error: cannot write the config file {config}: no space left on {full_disk}"
    )


@pytest.mark.daemon
def test_a_chat_that_cannot_autosave_goes_on_and_saves_later(tiny_model: Path, full_disk: Path):
    # Before: a failed autosave (disk full) ended the REPL, and the new turns were lost.
    paths = get_paths()
    out, err = io.StringIO(), io.StringIO()
    env = Environment(io.StringIO(), out, err, paths=paths)
    config = Settings(model=str(tiny_model), temperature=0.0, max_tokens=4)
    store = ChatStore(full_disk / "chats")
    conversation = Conversation(name="kept", model=str(tiny_model))
    repl = ChatRepl(
        env,
        DaemonBackend(paths, config, tiny_model, env.notice),
        config,
        str(tiny_model),
        conversation,
        store,
    )
    repl.ask("What is 2+2?")
    assert "cannot save the conversation" in err.getvalue()
    assert "kept in memory" in err.getvalue()
    assert len(repl.conversation.turns) == 1
    (full_disk / "filler").unlink()  # room again
    repl.ask("And 3+3?")
    assert [t.question for t in store.load("kept").turns] == ["What is 2+2?", "And 3+3?"]


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        ("[1, 2]", "not a JSON object"),
        ('{"name": "x", "model": "m", "turns": "many"}', "'turns' has the wrong type (str)"),
        (
            '{"name": "x", "model": "m", "turns": [{"question": 1, "answer": ""}]}',
            "turn 1: 'question' has the wrong type (int)",
        ),
        ("\x00\xff", "is not a phi4 conversation"),
    ],
    ids=["json-list", "turns-not-a-list", "question-not-a-string", "binary"],
)
@pytest.mark.daemon
def test_a_damaged_saved_chat_is_named_and_explained(content: str, phrase: str):
    chats = get_paths().data_dir / "chats"
    chats.mkdir(parents=True)
    (chats / "damaged.json").write_text(content, encoding="latin-1")
    result = run_phi4("chat", "--resume", "damaged", input="")
    assert result.returncode == 1
    line = one_error_line(result.stderr)
    assert str(chats / "damaged.json") in line and phrase in line, line


@pytest.mark.daemon
def test_chat_exits_1_when_a_message_got_no_answer(tiny_model: Path):
    # Before: `phi4 chat` exited 0 although every message failed.
    too_long = "word " * 400
    result = run_phi4(
        "chat", "-m", str(tiny_model), "--n-ctx", "128", "-n", "4", input=f"{too_long}\n"
    )
    assert result.returncode == 1, result.stderr
    assert "error:" in result.stderr
    fine = run_phi4("chat", "-m", str(tiny_model), "-n", "2", input="hello\n")
    assert fine.returncode == 0, fine.stderr


@pytest.mark.daemon
def test_status_json_of_a_damaged_status_file_is_not_trusted(phi4_home: Path):
    run = phi4_home / "run"
    run.mkdir(mode=0o700)
    (run / "daemon.json").write_text(json.dumps({"pid": os.getpid(), "socket": "x"}))
    result = run_phi4("stop")
    assert result.returncode == 0, result.stderr
    assert "no daemon was running" in result.stdout


def _ask(phi4_home: Path, params: dict[str, object]) -> dict[str, object]:
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(str(phi4_home / "run" / "daemon.sock"))
        sock.sendall(
            json.dumps({"v": 1, "id": 1, "op": "solve", "params": params}).encode() + b"\n"
        )
        reader = sock.makefile("rb")
        while True:
            event: dict[str, object] = json.loads(reader.readline())
            if event["event"] in ("done", "error"):
                return event


@pytest.mark.daemon
def test_a_bad_model_in_one_request_leaves_the_loaded_one_serving(
    tiny_model: Path, phi4_home: Path, tmp_path: Path
):
    # Before: one request naming a bad model file unloaded the working model for everyone
    # (state "failed", /health 503) until someone asked for a good one again.
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_model.read_bytes()[: tiny_model.stat().st_size // 2])
    for bad, phrase in (
        (tmp_path / "missing.gguf", "does not exist"),
        (truncated, "truncated or corrupt"),
    ):
        event = _ask(phi4_home, {"prompt": "hi", "model": str(bad), "max_tokens": 2})
        assert event["event"] == "error" and event["code"] == "model_error"
        assert phrase in str(event["message"])
        status = json.loads(run_phi4("status", "--json").stdout)
        assert (status["state"], status["model"]) == ("ready", str(tiny_model))
    served = _ask(phi4_home, {"prompt": "hi", "max_tokens": 2})
    assert served["event"] == "done"


def test_a_file_is_read_whole_ahead_of_llama_cpp_only_to_keep_a_model_serving(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Before: every load read the whole GGUF with the gguf package first, 4.4 s of a 7.7 s
    # daemon start on the shaped Phi-4-mini (its tokenizer's 200,000 entries one at a time).
    # With no model loaded there is nothing to protect: llama.cpp refuses a truncated file
    # itself (tests/test_models_config.py::test_truncated_model_reaches_the_client_...).
    from phi4cli.core import models
    from phi4cli.daemon.llama.batch import LlamaEngine

    read: list[Path] = []
    whole = models.validate_gguf
    monkeypatch.setattr(models, "validate_gguf", lambda path: (read.append(path), whole(path))[1])
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_model.read_bytes())
    engine = LlamaEngine(Settings(n_ctx=512, threads=1, ramdisk="off", parallel=1))
    try:
        engine.load(tiny_model)
        assert read == []
        engine.load(other)  # a model serves: the new file is read whole before it is let go
        assert read == [other]
        engine.load(tiny_model)  # loaded once, so known whole
        engine.load(other)
        assert read == [other]
        before = other.stat()
        other.write_bytes(other.read_bytes()[:-1] + b"\0")  # rewritten in place since, with
        os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))  # its mtime set back
        engine.load(tiny_model)
        engine.load(other)
        assert read == [other, other]
    finally:
        engine.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second user")
def test_a_staging_dir_of_another_user_is_not_used(tiny_model: Path, tmp_path: Path):
    # Before: another user who made /dev/shm/phi4-<uid> first could plant a GGUF under the
    # predictable staged name, and the victim's daemon loaded it.
    from phi4cli.daemon.ramdisk import stage, staged_name

    planted = tmp_path / "shm-planted"
    planted.mkdir(mode=0o755)
    fake = planted / staged_name(tiny_model)
    fake.write_bytes(tiny_model.read_bytes())  # same size: it would be taken for our copy
    os.chown(planted, 65534, 65534)
    os.chown(fake, 65534, 65534)
    staging = stage(tiny_model, "on", planted)
    assert staging.path == tiny_model and not staging.staged
    assert staging.note is not None and "belongs to uid 65534" in staging.note
    # Ours, but another user's file planted in it under the staged name: not loaded either.
    os.chown(planted, 0, 0)
    planted.chmod(0o700)
    staging = stage(tiny_model, "on", planted)
    assert staging.staged and staging.copied, "our own copy, not the planted one"
    assert planted.joinpath(staged_name(tiny_model)).stat().st_uid == 0


@pytest.mark.daemon
def test_cache_clear_does_not_follow_a_planted_link(tmp_path: Path):
    # Before: a link at the staging dir's path to the models dir made `phi4 cache clear` delete
    # the models.
    models = tmp_path / "models"
    models.mkdir()
    (models / "precious.gguf").write_bytes(b"GGUF")
    link = tmp_path / "shm-link"
    link.symlink_to(models)
    result = run_phi4("cache", "clear", env={"PHI4_RAMDISK": str(link)})
    assert result.returncode == 0
    assert (models / "precious.gguf").exists()
    assert f"staged copies left alone: {link} is not a directory (a link?)" in result.stderr


@pytest.mark.daemon
def test_the_daemon_log_keeps_llama_cpp_warnings_not_its_chatter(
    tiny_model: Path, phi4_home: Path, caplog: pytest.LogCaptureFixture
):
    # Before: about 700 lines of llama.cpp INFO and DEBUG detail per start.
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    assert run_phi4("stop").returncode == 0
    log = (phi4_home / "state" / "daemon.log").read_text()
    assert len(log.splitlines()) < 30, log
    assert "graph_reserve" not in log and "llama_context: n_ctx" not in log
    # Of llama.cpp's INFO, only where the memory went: each buffer's size, layers offloaded.
    parts = ("llama_context:", "load_tensors:", "llama_kv_cache:")
    kept = [line for line in log.splitlines() if any(part in line for part in parts)]
    assert kept and all("buffer size =" in line for line in kept), log
    # What is kept: warnings and errors (ggml levels 3 and 4), continuation pieces included.
    from phi4cli.daemon.llama.model import _LogFilter

    log_filter = _LogFilter()
    with caplog.at_level("DEBUG", logger="phi4.llama"):
        for level, text in (
            (2, b"info line\n"),
            (3, b"warn: "),
            (5, b"continued\n"),
            (1, b"debug\n"),
            (4, b"error line\n"),
            (2, b"load_tensors: offloaded 6/33 layers to GPU\n"),
            (2, b"llama_kv_cache:    Vulkan0 KV buffer size = "),
            (5, b"768.00 MiB\n"),
        ):
            log_filter(level, text, None)  # type: ignore[arg-type]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "warn: continued"),
        ("ERROR", "error line"),
        ("INFO", "load_tensors: offloaded 6/33 layers to GPU"),
        ("INFO", "llama_kv_cache: Vulkan0 KV buffer size = 768.00 MiB"),
    ]


@pytest.mark.daemon
def test_a_first_solve_on_a_full_disk_starts_one_daemon_and_answers(
    tiny_model: Path, full_disk: Path
):
    # Before: the daemon died writing its status file; the client started three in turn and
    # ended with "connection reset by peer".
    env = {"PHI4_HOME": str(full_disk / "home")}
    with contextlib.suppress(OSError):
        (full_disk / "home").mkdir()
    result = run_phi4("solve", "hi", "-m", str(tiny_model), "-n", "2", env=env)
    try:
        assert result.returncode == 0, result.stderr
        assert result.stderr.count("starting the phi4 daemon") == 1
        assert result.stdout.strip()
    finally:
        assert run_phi4("stop", env=env).returncode == 0


@pytest.mark.daemon
def test_no_inodes_left_is_one_line_and_exit_3(tiny_model: Path, tmp_path: Path):
    # Before: "internal error: OSError: [Errno 28] No space left on device: '.../run'".
    mount = tmp_path / "noinodes"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=8", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mount / "home").mkdir()
        with contextlib.suppress(OSError):
            for number in range(100):
                (mount / f"f{number}").touch()
        result = run_phi4(
            "solve", "hi", "-m", str(tiny_model), "-n", "2", env={"PHI4_HOME": str(mount / "home")}
        )
        assert result.returncode == 3
        line = one_error_line(result.stderr)
        assert f"no inodes left on {mount} (too many files)" in line, line
        assert str(mount / "home") in line
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.daemon
def test_a_request_too_long_for_the_daemon_is_refused_once_not_retried(tiny_model: Path):
    # Before: the daemon hung up on a line over 1 MiB, and the client took that for a daemon
    # that stopped: it restarted it and sent again, forever.
    huge = "word " * 240_000  # 1.2 MB
    solved = run_phi4("solve", "-", "-m", str(tiny_model), "-n", "2", input=huge)
    assert solved.returncode == 1
    line = one_error_line(
        solved.stderr.replace(
            "phi4: starting the phi4 daemon (first call; later calls reuse it)...\n", ""
        )
    )
    assert "the daemon takes at most 1,048,576" in line
    paths = get_paths()
    out, err = io.StringIO(), io.StringIO()
    env = Environment(io.StringIO(), out, err, paths=paths)
    config = Settings(model=str(tiny_model), temperature=0.0, max_tokens=2)
    repl = ChatRepl(
        env,
        DaemonBackend(paths, config, tiny_model, env.notice),
        config,
        str(tiny_model),
        Conversation(name="long", model=str(tiny_model)),
        ChatStore(paths.data_dir / "chats"),
    )
    repl.ask(huge)
    assert "the daemon takes at most" in err.getvalue() and "restarting" not in err.getvalue()
    repl.ask("hi")  # the chat goes on
    assert [t.question for t in repl.conversation.turns] == ["hi"] and repl.failed == 1


@pytest.mark.daemon
def test_stop_with_the_lock_held_and_no_status_file_says_so(phi4_home: Path):
    with holding_daemon_lock(phi4_home / "run"):
        result = run_phi4("stop")
        assert result.returncode == 3
        assert "does not answer, and its pid is unknown" in one_error_line(result.stderr)


@pytest.mark.daemon
def test_a_daemon_that_has_not_listened_yet_is_stopped_by_the_pid_in_its_lock(
    phi4_home: Path, tiny_model: Path
):
    # Between taking its lock and listening (imports, or wedged there) a daemon has no status
    # file: `phi4 stop` said it "does not answer, and its pid is unknown" and sent the user to
    # pgrep, and `phi4 status` said no daemon ran. Its pid is in the lock now. The stand-in
    # holds the lock as a daemon does, writes its pid as a daemon does, and never listens.
    import sys

    run_dir = phi4_home / "run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    starting = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[4], "
            "os.O_RDWR | os.O_CREAT, 0o600); fcntl.flock(fd, fcntl.LOCK_EX); "
            "os.write(fd, b'%d\\n' % os.getpid()); print('locked', flush=True); time.sleep(60)",
            "phi4",
            "daemon",
            "run",
            str(run_dir / "daemon.lock"),
        ],  # (a daemon's command line)
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starting.stdout is not None and starting.stdout.readline().strip() == "locked"
        status = run_phi4("status")
        assert status.returncode == 3
        assert f"the daemon (pid {starting.pid}) is starting or stopping" in one_error_line(
            status.stderr
        )
        stopped = run_phi4("stop")
        assert (stopped.returncode, stopped.stdout.strip()) == (
            0,
            f"daemon stopped (pid {starting.pid})",
        ), stopped.stderr
        assert starting.wait(10) == -15, "it was sent SIGTERM"
    finally:
        starting.kill()
        starting.wait()
    # And a real daemon writes its own pid there, as its status file says.
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    try:
        pid = json.loads((run_dir / "daemon.json").read_text())["pid"]
        assert (run_dir / "daemon.lock").read_text() == f"{pid}\n"
    finally:
        run_phi4("stop")


def test_an_unwritable_input_history_does_not_end_the_chat(tmp_path: Path, capsys):
    from phi4cli.client.repl import AtomicFileHistory

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    history = AtomicFileHistory(str(blocker / "chat_history"))
    history.store_string("first")
    history.store_string("second")
    err = capsys.readouterr().err
    assert err.count("cannot save the input history") == 1 and "the chat goes on" in err


@pytest.mark.parametrize("closed", [">&-", "2>&-", ">&- 2>&-"])
@pytest.mark.daemon
def test_a_solve_with_a_closed_stream_answers_and_exits_0(tiny_model: Path, closed: str):
    # Python sees a stream closed at start-up as None: writing the answer, or flushing stderr
    # on the way out, ended in "internal error: AttributeError" and exit 1.
    from tests.conftest import PHI4

    command = f"{PHI4} solve 'What is 2+2?' -m {tiny_model} -n 4 {closed}"
    result = subprocess.run(
        command,
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stderr
