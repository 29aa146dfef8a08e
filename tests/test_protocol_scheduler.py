"""Unit tests: wire protocol, request validation, the scheduler (with a fake engine), peer check."""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from phi4cli.core import protocol
from phi4cli.core._settings import Ask
from phi4cli.core.errors import Fault
from phi4cli.core.paths import peer_uid
from phi4cli.core.protocol import (
    PRIORITY_BULK,
    PRIORITY_INTERACTIVE,
    PRIORITY_SOLVE,
    SolveParams,
    parse_solve_params,
)
from phi4cli.daemon import scheduler as scheduler_module
from phi4cli.daemon.connections import peer_allowed
from phi4cli.daemon.jobs import ContextOverflowError, Job, ModelLoadError, Wait
from phi4cli.daemon.scheduler import JobQueue, QueueFullError, RequestScheduler
from tests.conftest import run_phi4


def test_encode_is_one_line_even_with_newlines_in_text():
    line = protocol.encode({"event": "token", "text": "a\nb ✓"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.decode(line) == {"event": "token", "text": "a\nb ✓"}


def test_parse_request_accepts_a_valid_request():
    request = protocol.parse_request(
        b'{"v": 1, "id": "a", "op": "solve", "params": {"prompt": "x"}}'
    )
    assert request == protocol.Request(id="a", op="solve", params={"prompt": "x"})


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"{", protocol.ErrorCode.BAD_REQUEST),
        (b"\xff\xfe", protocol.ErrorCode.BAD_REQUEST),
        (b'{"v": 2, "id": 1, "op": "ping"}', protocol.ErrorCode.UNSUPPORTED_VERSION),
        (b'{"id": 1, "op": "ping"}', protocol.ErrorCode.UNSUPPORTED_VERSION),
        (b'{"v": 1, "id": [1], "op": "ping"}', protocol.ErrorCode.BAD_REQUEST),
        (b'{"v": 1, "id": 1, "op": "ping", "params": []}', protocol.ErrorCode.BAD_REQUEST),
    ],
)
def test_parse_request_rejects_with_a_code(line: bytes, code: str):
    with pytest.raises(protocol.ProtocolViolation) as caught:
        protocol.parse_request(line)
    assert caught.value.code == code


def test_error_events_say_whether_to_retry():
    assert protocol.Event.error(protocol.ErrorCode.BUSY, "full", 1).to_wire()["retryable"] is True
    assert (
        protocol.Event.error(protocol.ErrorCode.BAD_REQUEST, "no", 1).to_wire()["retryable"]
        is False
    )


def test_solve_params_defaults_and_validation():
    defaults = Ask(temperature=0.8, top_p=0.95, seed=7)
    params = parse_solve_params({"prompt": "2+2", "priority": "bulk"}, defaults)
    sampling = params.ask.sampling  # the sampler's settings, in one record
    assert (sampling.temperature, sampling.top_p, sampling.seed, params.priority) == (
        0.8,
        0.95,
        7,
        PRIORITY_BULK,
    )
    assert parse_solve_params({"prompt": "x", "seed": None}, defaults).ask.seed is None
    for bad in (
        {"prompt": "x", "top_p": 2},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "seed": "7"},
        {"prompt": "x", "keep_alive": "soon"},
        {"prompt": "x", "priority": "urgent"},
        {"prompt": "x" * (protocol.MAX_PROMPT_CHARS + 1)},
        {"prompt": "x", "share": ""},
        {"prompt": "x", "share": 7},
        {"prompt": "x", "share": "s" * (protocol.MAX_SHARE_CHARS + 1)},
    ):
        with pytest.raises(protocol.ProtocolViolation):
            parse_solve_params(bad, defaults)
    shared = params._replace(share="http 127.0.0.1:5000")
    assert parse_solve_params(protocol.to_wire("solve", shared), defaults).share == shared.share


class FakeEngine:
    """Streams two tokens per request, one a step, in ``parallel`` slots; can be held at a gate
    (inside a step) so that a queue builds up."""

    def __init__(self, parallel: int = 1, capacity: int | None = None) -> None:
        self.parallel = parallel
        # With a capacity, a prompt "name:N" reserves N cells of it while it runs.
        self.capacity = capacity
        self.reserved: dict[Job, int] = {}
        self.loaded: list[Path] = []
        self.served: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.release = threading.Event()  # a "hold..." request runs until this is set
        self.started = threading.Event()
        self._model: Path | None = None
        self._runs: list[tuple[Job, list[str]]] = []

    @property
    def model_path(self) -> Path | None:
        return self._model

    @property
    def active(self) -> int:
        return len(self._runs)

    def tend(self) -> bool:
        return False

    def memory(self) -> dict[str, Any]:
        return {"running": len(self._runs)}

    def load(self, path: Path) -> dict[str, Any]:
        if path.name == "broken.gguf":  # refused before the loaded model is let go
            raise ModelLoadError(f"{path} is truncated")
        if path.name == "unsupported.gguf":  # fails once the old model is gone
            self._model = None
            raise ModelLoadError(f"llama.cpp could not load {path}")
        if path.name == "too-big.gguf":  # its memory plan refused, once the old model is gone
            self._model = None
            fault = Fault("n_ctx", 1 << 30, 4096, facts="it needs 64 GiB", model=path.name)
            raise ModelLoadError(f"cannot plan memory for {path}: it needs 64 GiB", fault)
        self.loaded.append(path)
        self._model = path
        return {"load_s": 0.0}

    def warm(self) -> dict[str, Any]:
        return {"prefill_s": 0.0}

    def admit(self, job: Job) -> Wait | None:
        if job.params.prompt == "too long":
            raise ContextOverflowError(Fault("prompt", 9, 8, prompt=9))
        need = int(job.params.prompt.rsplit(":", 1)[1]) if self.capacity else 0
        free = (self.capacity or 0) - sum(self.reserved.values())
        if self.capacity is not None and need > self.capacity:
            raise ContextOverflowError(Fault("max_tokens", need, self.capacity, prompt=1))
        if self.capacity is not None and need > free:
            return Wait("memory", need, free)
        if len(self._runs) >= self.parallel:
            return Wait("slot")
        self.reserved[job] = need
        self.served.append(job.params.prompt)
        self._runs.append((job, ["a", "b"]))
        return None

    def step(self) -> list[tuple[Job, protocol.Stats]]:
        self.started.set()
        self.gate.wait(10)
        finished = []
        for run in list(self._runs):
            job, left = run
            if job.params.prompt == "explode":
                raise RuntimeError("boom")
            if job.params.prompt.startswith("hold") and not self.release.is_set():
                time.sleep(0.001)
                continue
            if left and not job.cancelled.is_set():
                job.emit_token("answer", left.pop(0))
            if not left or job.cancelled.is_set():
                self._runs.remove(run)
                self.reserved.pop(job, None)
                finished.append((job, protocol.Stats(finish_reason="stop")))
        return finished

    def reset(self) -> None:
        self._runs.clear()

    def close(self) -> None:
        self._model = None


class Collector:
    def __init__(self) -> None:
        self.events: dict[Any, list[dict[str, Any]]] = {}
        self.done = threading.Condition()

    def job(self, request_id: Any, prompt: str, priority: int = PRIORITY_SOLVE, **kw: Any) -> Job:
        self.events[request_id] = []

        def emit(event: protocol.Event) -> None:
            with self.done:
                self.events[request_id].append(event.to_wire())  # as the server writes it
                self.done.notify_all()

        params = SolveParams(
            prompt, Ask(temperature=0.0, top_p=1.0), model=kw.get("model"), priority=priority
        )
        return Job(request_id=request_id, params=params, emit=emit)

    def terminal(self, request_id: Any) -> list[dict[str, Any]]:
        return [e for e in self.events[request_id] if protocol.EventKind(e["event"]).terminal]

    def wait(self, *ids: Any, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        with self.done:
            while not all(self.terminal(i) for i in ids):
                assert self.done.wait(deadline - time.monotonic()), self.events


def make_scheduler(
    engine: FakeEngine, max_queue: int = 8, default: Path = Path("/m/model.gguf")
) -> tuple[RequestScheduler, list[str]]:
    states: list[str] = []
    scheduler = RequestScheduler(
        engine, default, max_queue, lambda state, _m, _e: states.append(state)
    )
    scheduler.start()
    return scheduler, states


def busy_scheduler(
    first: str, max_queue: int = 8
) -> tuple[FakeEngine, RequestScheduler, Collector]:
    """A scheduler whose engine is held inside job 0 (prompt ``first``), so a queue builds up."""
    engine = FakeEngine()
    engine.gate.clear()
    scheduler, _ = make_scheduler(engine, max_queue)
    out = Collector()
    scheduler.submit(out.job(0, first))
    assert engine.started.wait(5)
    return engine, scheduler, out


def test_jobs_run_by_priority_then_arrival():
    engine, scheduler, out = busy_scheduler("first")
    scheduler.submit(out.job(1, "bulk-1", PRIORITY_BULK))
    scheduler.submit(out.job(2, "solve", PRIORITY_SOLVE))
    scheduler.submit(out.job(3, "bulk-2", PRIORITY_BULK))
    scheduler.submit(out.job(4, "chat", PRIORITY_INTERACTIVE))
    engine.gate.set()
    out.wait(0, 1, 2, 3, 4)
    assert engine.served == ["first", "chat", "solve", "bulk-1", "bulk-2"]
    for request_id in range(5):
        events = [e["event"] for e in out.events[request_id]]
        assert events == ["token", "token", "stats", "done"], events
    scheduler.stop(5)


def test_a_job_waiting_for_memory_keeps_its_place_and_nothing_running_is_cut():
    engine = FakeEngine(parallel=4, capacity=10)
    scheduler, _ = make_scheduler(engine)
    out = Collector()
    scheduler.submit(out.job(0, "hold-long-1:6"))
    assert engine.started.wait(5)
    scheduler.submit(out.job(1, "long-2:6"))  # 6 + 6 > 10: waits for long-1
    scheduler.submit(out.job(2, "short:3", PRIORITY_BULK))  # would fit, but comes later
    deadline = time.monotonic() + 5
    while not out.events[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out.events[1] == [
        {
            "v": 1,
            "id": 1,
            "event": "progress",
            "stage": "waiting",
            "reason": "memory",
            "needed": 6,
            "free": 4,
        }
    ]
    assert scheduler.waiting is not None and scheduler.waiting.request_id == 1
    time.sleep(0.1)
    assert engine.served == ["hold-long-1:6"], "the later, smaller job did not overtake"
    assert not out.terminal(0), "the running job goes on"
    engine.release.set()
    out.wait(0, 1, 2)
    assert engine.served == ["hold-long-1:6", "long-2:6", "short:3"]
    for request_id in (0, 1, 2):
        assert out.terminal(request_id)[0]["event"] == "done"
    assert sum(e["event"] == "progress" for e in out.events[1]) == 1, "said once"
    assert scheduler.waiting is None
    scheduler.stop(5)


def test_a_job_that_could_never_fit_is_refused_without_waiting():
    engine = FakeEngine(parallel=4, capacity=10)
    scheduler, _ = make_scheduler(engine)
    out = Collector()
    scheduler.submit(out.job(0, "huge:11"))
    out.wait(0)
    refused = out.terminal(0)[0]
    assert refused["code"] == protocol.ErrorCode.CONTEXT_OVERFLOW
    # The facts, as data, beside the daemon log's words for them.
    assert refused["fault"] == {
        "param": "max_tokens",
        "needed": 11,
        "limit": 10,
        "prompt": 1,
        "n_ctx": 0,
        "streams": 0,
        "system": 0,
        "shrunk": False,
    }
    assert "needs 11 tokens of context" in refused["message"]
    scheduler.stop(5)


def test_full_queue_raises_and_cancelled_queued_job_never_reaches_engine():
    engine, scheduler, out = busy_scheduler("running", max_queue=1)
    waiting = out.job(1, "waiting")
    scheduler.submit(waiting)
    with pytest.raises(QueueFullError):
        scheduler.submit(out.job(2, "one too many"))
    waiting.cancel()
    engine.gate.set()
    out.wait(0, 1)
    assert engine.served == ["running"]
    assert out.terminal(1)[0]["code"] == protocol.ErrorCode.CANCELLED
    scheduler.stop(5)


def test_engine_crash_becomes_an_error_with_traceback_and_worker_survives():
    engine = FakeEngine()
    scheduler, _ = make_scheduler(engine)
    out = Collector()
    scheduler.submit(out.job(0, "explode"))
    scheduler.submit(out.job(1, "fine"))
    scheduler.submit(out.job(2, "too long"))
    out.wait(0, 1, 2)
    crash = out.terminal(0)
    assert len(crash) == 1 and crash[0]["code"] == protocol.ErrorCode.MODEL_ERROR
    assert "RuntimeError: boom" in crash[0]["message"]
    assert out.terminal(2)[0]["code"] == protocol.ErrorCode.CONTEXT_OVERFLOW
    assert out.terminal(1)[0]["event"] == "done"
    scheduler.stop(5)


def test_a_failed_load_is_a_model_error_and_the_loaded_model_serves_on():
    engine = FakeEngine()
    scheduler, states = make_scheduler(engine)
    out = Collector()
    scheduler.submit(out.job(0, "x", model=Path("/m/broken.gguf")))
    out.wait(0)
    assert out.terminal(0)[0]["code"] == protocol.ErrorCode.MODEL_ERROR
    assert "truncated" in out.terminal(0)[0]["message"]
    assert states[3:] == ["loading", "ready"]
    # A failure after the old model was let go: it is loaded again.
    scheduler.submit(out.job(1, "y", model=Path("/m/unsupported.gguf")))
    out.wait(1)
    assert "could not load" in out.terminal(1)[0]["message"]
    assert states[5:] == ["loading", "loading", "warming", "ready"]
    assert engine.model_path == engine.loaded[-1] != Path("/m/unsupported.gguf")
    scheduler.submit(out.job(2, "z"))
    out.wait(2)
    assert out.terminal(2)[0]["event"] == "done"
    # A refused memory plan keeps its fault while the old model is loaded again (its own load,
    # which succeeds, cleared it before), so the command line words it with its flags.
    scheduler.submit(out.job(3, "w", model=Path("/m/too-big.gguf")))
    out.wait(3)
    refused = protocol.Event.from_wire(out.terminal(3)[0])
    assert refused.fault is not None and refused.fault.param == "n_ctx"
    assert "--n-ctx 4096 fits" in str(refused.exception())
    assert engine.model_path != Path("/m/too-big.gguf")
    scheduler.stop(5)


def test_a_failed_first_load_leaves_the_state_failed():
    engine = FakeEngine()
    scheduler, states = make_scheduler(engine, default=Path("/m/broken.gguf"))
    out = Collector()
    scheduler.submit(out.job(0, "x"))
    out.wait(0)
    assert out.terminal(0)[0]["code"] == protocol.ErrorCode.MODEL_ERROR
    assert states == ["loading", "failed", "loading", "failed"]  # at start, then for the job
    scheduler.stop(5)


def test_stop_fails_queued_jobs_as_shutting_down():
    engine, scheduler, out = busy_scheduler("running")
    scheduler.submit(out.job(1, "queued"))
    threading.Timer(0.2, engine.gate.set).start()
    scheduler.stop(5)
    out.wait(0, 1)
    assert out.terminal(0)[0]["code"] == protocol.ErrorCode.SHUTTING_DOWN
    assert out.terminal(1)[0]["code"] == protocol.ErrorCode.SHUTTING_DOWN


def test_peer_check_compares_the_connecting_uid():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        assert peer_uid(left) == os.getuid()
        assert peer_allowed(left, os.getuid())
        assert not peer_allowed(left, os.getuid() + 1)


def test_status_json_shape_is_stable():
    # The status file is read by clients of other versions; keep its keys.
    from phi4cli.backends.spawn import DaemonStatus, read_status
    from phi4cli.core.paths import get_paths

    paths = get_paths()
    paths.ensure_runtime_dir()
    paths.status_file.write_text(
        json.dumps(
            {
                "pid": 1,
                "socket": "s",
                "protocol": 1,
                "state": "ready",
                "model": None,
                "started_at": 0,
            }
        )
    )
    status = read_status(paths)
    assert isinstance(status, DaemonStatus) and status.state == "ready"
    paths.status_file.write_text("{torn")
    assert read_status(paths) is None


def test_tiny_model_has_phi4_special_tokens_as_single_tokens(tiny_model: Path):
    import llama_cpp

    from tests.tinymodel import SPECIAL_TOKENS

    llm = llama_cpp.Llama(str(tiny_model), n_ctx=256, verbose=False)
    try:
        for special in SPECIAL_TOKENS:
            assert len(llm.tokenize(special.encode(), add_bos=False, special=True)) == 1, special
        assert llm.metadata["general.architecture"] == "phi3"
        assert llm.metadata["tokenizer.ggml.pre"] == "gpt-4o"
        assert "<|assistant|>" in llm.metadata["tokenizer.chat_template"]
    finally:
        llm.close()


def test_runtime_dir_of_another_user_is_refused(tmp_path: Path):
    from phi4cli.core.errors import DaemonUnavailableError
    from phi4cli.core.paths import Paths

    if os.getuid() != 0:
        pytest.skip("needs root to create a directory owned by another user")
    planted = tmp_path / "run"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    paths = Paths(tmp_path, tmp_path, tmp_path, tmp_path, planted)
    with pytest.raises(DaemonUnavailableError, match="not a directory of yours"):
        paths.ensure_runtime_dir()
    # A symlink to a directory we own is refused too: it could point anywhere.
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(DaemonUnavailableError, match="not a directory of yours"):
        Paths(tmp_path, tmp_path, tmp_path, tmp_path, link).ensure_runtime_dir()


@pytest.mark.daemon
def test_a_phi4_home_that_is_a_file_is_one_line_and_exit_3(tmp_path: Path):
    # Before: `phi4 status` ended in "internal error: NotADirectoryError".
    home = tmp_path / "home"
    home.write_text("not a directory")
    result = run_phi4("status", env={"PHI4_HOME": str(home)})
    assert result.returncode == 3, result.stderr
    assert (
        result.stderr == f"phi4: error: cannot use {home}/run: Not a directory; check "
        "PHI4_HOME or XDG_RUNTIME_DIR\n"
    )


def test_default_runtime_dir_prefers_xdg_and_falls_back_to_tmp(monkeypatch, tmp_path: Path):
    from phi4cli.core.paths import get_paths

    monkeypatch.delenv("PHI4_HOME")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert get_paths().runtime_dir == tmp_path / "phi4"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert get_paths().runtime_dir.name == f"phi4-{os.getuid()}"


def test_cancelling_a_queued_job_answers_it_at_once():
    engine, scheduler, out = busy_scheduler("running")
    waiting = out.job(1, "waiting")
    scheduler.submit(waiting)
    scheduler.cancel(waiting)
    out.wait(1, timeout=2)  # while job 0 still holds the engine
    assert out.terminal(1)[0]["code"] == protocol.ErrorCode.CANCELLED
    engine.gate.set()
    out.wait(0)
    assert engine.served == ["running"]
    assert len(out.terminal(1)) == 1, "exactly one terminal event"
    scheduler.stop(5)
    assert not scheduler.busy


class WarmFailsEngine(FakeEngine):
    def warm(self) -> dict[str, Any]:
        raise RuntimeError("llama_decode failed")


def test_a_warm_up_failure_leaves_the_worker_serving():
    engine = WarmFailsEngine()
    scheduler, states = make_scheduler(engine)
    out = Collector()
    scheduler.submit(out.job(0, "x"))
    out.wait(0)
    failure = out.terminal(0)[0]
    assert failure["code"] == protocol.ErrorCode.MODEL_ERROR
    assert "RuntimeError: llama_decode failed" in failure["message"]
    assert states[:3] == ["loading", "warming", "failed"]
    assert engine.model_path is None, "the half-loaded model was closed"
    scheduler.stop(5)


class TendingEngine(FakeEngine):
    """Has work of its own between steps (as a context made in the background) for a while."""

    def __init__(self, rounds: int) -> None:
        super().__init__()
        self.rounds = rounds
        self.tended = 0

    def tend(self) -> bool:
        self.tended += 1
        return self.tended < self.rounds


def test_an_idle_worker_comes_back_to_an_engine_that_tends_and_then_sleeps():
    engine = TendingEngine(rounds=4)
    scheduler, _ = make_scheduler(engine)
    deadline = time.monotonic() + 10
    while engine.tended < 4:  # no request came: the worker came back on its own
        assert time.monotonic() < deadline, f"tended {engine.tended} times"
        time.sleep(0.05)
    time.sleep(4 * scheduler_module.TEND_S)
    assert engine.tended == 4, "the worker went on polling an engine with nothing to tend"
    out = Collector()
    scheduler.submit(out.job(0, "x"))
    out.wait(0)  # and it still serves
    assert out.terminal(0)[0]["event"] == "done"
    scheduler.stop(5)


def test_a_peek_with_a_timeout_gives_up_when_no_job_comes():
    jobs = JobQueue()
    started = time.monotonic()
    with pytest.raises(queue.Empty):
        jobs.peek(block=True, timeout=0.2)
    assert time.monotonic() - started >= 0.2
    jobs.stop()


def test_a_long_waiting_job_is_taken_before_newer_urgent_ones(monkeypatch):
    from phi4cli.daemon import scheduler as scheduler_module

    jobs = JobQueue()
    out = Collector()
    bulk = out.job(0, "bulk", PRIORITY_BULK)
    chat = out.job(1, "chat", PRIORITY_INTERACTIVE)
    jobs.put(bulk)
    jobs.put(chat)
    assert jobs.peek(block=False) is chat  # fresh: priority decides
    assert jobs.peek(block=False) is chat, "peeking leaves the job in its place"
    monkeypatch.setattr(scheduler_module, "AGING_S", 0.0)
    assert jobs.peek(block=False) is bulk  # waited too long: taken first
    jobs.remove(bulk)
    assert jobs.peek(block=False) is chat
    jobs.stop()
    assert jobs.peek(block=True) is None


def test_a_silent_daemon_is_reported_frozen_not_waited_for_forever():
    from phi4cli.backends.daemon_link import DaemonConnection
    from phi4cli.core.errors import DaemonFrozenError

    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with right:
        connection = DaemonConnection(left)
        right.sendall(b'{"v":1,"id":1,"event":"accepted"}\n')  # then nothing
        assert connection.next_event(timeout=0.5).kind == "accepted"
        started = time.monotonic()
        with pytest.raises(DaemonFrozenError, match=r"sent nothing for 0\.5 s"):
            connection.next_event(timeout=0.5)
        assert time.monotonic() - started < 5
        connection.close()


def test_heartbeats_go_out_only_while_the_engine_goes_round():
    from types import SimpleNamespace

    from phi4cli.daemon.connections import Connection
    from phi4cli.daemon.server import DaemonServer

    class Writer:
        def __init__(self) -> None:
            self.data = b""

        def write(self, data: bytes) -> None:
            self.data += data

    writer = Writer()
    connection = Connection(writer)  # type: ignore[arg-type]
    connection.jobs["r1"] = object()  # type: ignore[assignment]
    scheduler = SimpleNamespace(beats=5, stepping_since=None)
    server: Any = SimpleNamespace(
        scheduler=scheduler, _last_beats=-1, state="ready", _connections={connection}
    )
    DaemonServer._heartbeat(server)
    beat = json.loads(writer.data)
    assert (beat["id"], beat["event"], beat["stage"]) == ("r1", "progress", "alive")
    scheduler.beats += 1
    DaemonServer._heartbeat(server)
    writer.data = b""
    DaemonServer._heartbeat(server)  # the engine did not go round: a wedged engine is silent
    assert writer.data == b""
    # One long step, not a hang: a slow device's 512-token prompt batch is one llama_decode.
    scheduler.stepping_since = time.monotonic() - 100
    DaemonServer._heartbeat(server)
    assert json.loads(writer.data)["stage"] == "alive"
    writer.data = b""
    scheduler.stepping_since = time.monotonic() - 1000  # past STEP_ALIVE_S: taken for a hang
    DaemonServer._heartbeat(server)
    assert writer.data == b""
    scheduler.stepping_since = None
    server.state = "loading"  # one long call, not a hang
    DaemonServer._heartbeat(server)
    assert json.loads(writer.data)["stage"] == "alive"


def test_platformdirs_answers_are_remembered_per_environment(monkeypatch, tmp_path: Path):
    import subprocess
    import sys

    from phi4cli.core.paths import get_paths

    runtime = tmp_path / "xdg-run"
    runtime.mkdir()
    monkeypatch.delenv("PHI4_HOME")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "conf-a"))
    first = get_paths()
    assert first.config_dir == tmp_path / "conf-a" / "phi4"
    assert not (runtime / "phi4" / "dirs.json").exists(), "no runtime dir yet: nothing written"
    first.ensure_runtime_dir()
    assert get_paths() == first and (runtime / "phi4" / "dirs.json").exists()
    probe = (
        "import sys; from phi4cli.core.paths import get_paths; p = get_paths(); "
        "print(p.config_dir, 'platformdirs' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [str(tmp_path / "conf-a" / "phi4"), "False"], "remembered, not imported"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "conf-b"))
    assert get_paths().config_dir == tmp_path / "conf-b" / "phi4", "another environment"
    # Only a private runtime dir is believed: another user's could redirect the config file.
    import os

    from phi4cli.core.paths import _DIR_INPUTS

    inputs = [sys.platform, *(os.environ.get(name) for name in _DIR_INPUTS)]
    (runtime / "phi4" / "dirs.json").write_text(
        json.dumps(
            {
                "inputs": inputs,
                "config_dir": "/evil",
                "data_dir": "/evil",
                "state_dir": "/evil",
                "cache_dir": "/evil",
            }
        )
    )
    assert get_paths().config_dir == Path("/evil"), "a matching record is used"
    (runtime / "phi4").chmod(0o755)
    assert get_paths().config_dir == tmp_path / "conf-b" / "phi4", "but not from an open dir"


def test_requests_waiting_for_a_model_hear_each_stage_of_its_load():
    # The client's load line follows these events (it read the daemon's status file before).
    engine = FakeEngine()
    scheduler, states = make_scheduler(engine)
    out = Collector()
    scheduler.submit(out.job(0, "warm-up"))
    out.wait(0)
    engine.gate.clear()  # the next request is held inside its first step, after the load
    engine.started.clear()
    scheduler.submit(out.job(1, "other", model=Path("/m/other.gguf")))
    assert engine.started.wait(5)
    scheduler.submit(out.job(2, "after"))  # comes once the switch is done: hears nothing of it
    engine.gate.set()
    out.wait(1, 2)
    stages = [(e["stage"], e["model"]) for e in out.events[1] if e["event"] == "progress"]
    assert stages == [
        ("loading", "/m/other.gguf"),
        ("warming", "/m/other.gguf"),
        ("ready", "/m/other.gguf"),
    ]
    assert not [e for e in out.events[2] if e["event"] == "progress"]
    assert states[-3:] == ["loading", "warming", "ready"]
    scheduler.stop(5)


class _UninterruptibleLoad(FakeEngine):
    """A load that returns only once ``finish`` is set, as llama.cpp's cannot be interrupted."""

    def __init__(self) -> None:
        super().__init__()
        self.loading = threading.Event()
        self.finish = threading.Event()

    def load(self, path: Path) -> dict[str, Any]:
        self.loading.set()
        self.finish.wait(60)
        return super().load(path)


def test_a_stop_during_a_load_leaves_without_waiting_for_the_load(
    phi4_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    # `phi4 stop` (or SIGTERM) while the model loads: the load holds nothing to save, so the
    # daemon tells its clients, removes its socket and leaves, without the load (a stop waited up
    # to 10 s for it before, and went through the "did not stop in time" warning).
    import asyncio
    import logging

    from phi4cli.core.config import Settings
    from phi4cli.core.paths import get_paths
    from phi4cli.daemon import server as server_module

    class Exited(Exception):
        pass

    exits: list[int] = []

    def leave(code: int) -> None:  # (the daemon's os._exit, which would end the test run)
        exits.append(code)
        raise Exited

    monkeypatch.setattr(server_module.os, "_exit", leave)
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # (pytest's handlers stay open)
    paths = get_paths()
    paths.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    engine = _UninterruptibleLoad()
    server = server_module.DaemonServer(paths, Settings(), engine, Path("/m/slow.gguf"))
    replies: list[dict[str, Any]] = []
    queued: list[dict[str, Any]] = []

    def client() -> None:
        assert engine.loading.wait(10)
        with socket.socket(socket.AF_UNIX) as waiting, socket.socket(socket.AF_UNIX) as stopper:
            waiting.connect(str(paths.socket))  # a question waiting for the model
            waiting.sendall(b'{"v": 1, "id": 7, "op": "solve", "params": {"prompt": "q"}}\n')
            time.sleep(0.2)
            stopper.connect(str(paths.socket))
            stopper.sendall(b'{"v": 1, "id": 1, "op": "stop"}\n')
            replies.append(json.loads(stopper.makefile().readline()))
            for line in waiting.makefile():
                queued.append(json.loads(line))

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    caplog.set_level(logging.INFO, logger="phi4.daemon")
    try:
        with pytest.raises(Exited):
            asyncio.run(server.serve())
        thread.join(10)
        assert exits == [0], "it left without tearing the model down"
        assert engine.loaded == [], "while the load was still running"
        assert replies and replies[0]["event"] == "done"
        assert [e["code"] for e in queued if e["event"] == "error"] == ["shutting_down"], queued
        assert not paths.socket.exists() and not paths.status_file.exists()
        assert "stopped during the model's loading" in caplog.text
        assert "did not stop in time" not in caplog.text
    finally:
        server.scheduler._on_state = lambda *args: None  # (the loop is gone: the load ends quietly)
        engine.finish.set()
        server.scheduler._thread.join(10)


def test_the_client_with_fewest_requests_running_goes_next_whatever_came_first(monkeypatch):
    # One client's many requests (one serve request's 16 choices) queued before another
    # client's one: the other goes next, not after all of them, aged or not.
    from phi4cli.daemon import scheduler as scheduler_module

    jobs = JobQueue()
    out = Collector()
    many = [out.job(i, f"a{i}") for i in range(3)]
    one = out.job(9, "b")
    for job in many:
        job.owner = "A"
        jobs.put(job)
    one.owner = "B"
    jobs.put(one)
    running = {"A": 2, "B": 0}
    assert jobs.peek(block=False, running=running.__getitem__) is one
    monkeypatch.setattr(scheduler_module, "AGING_S", 0.0)
    assert jobs.peek(block=False, running=running.__getitem__) is one
    running["B"] = 2
    assert jobs.peek(block=False, running=running.__getitem__) is many[0], "a tie: oldest"
    jobs.stop()


def test_a_slot_that_frees_goes_to_the_client_with_none_running():
    engine = FakeEngine(parallel=3)
    engine.gate.clear()
    scheduler, _ = make_scheduler(engine, max_queue=16)
    out = Collector()
    jobs = [out.job(0, "hold-a0"), *(out.job(i, f"a{i}") for i in range(1, 5))]
    for job in jobs:
        job.owner = "A"
    scheduler.submit(jobs[0])
    assert engine.started.wait(5)  # a0 runs; the worker is inside a step
    for job in jobs[1:]:
        scheduler.submit(job)
    other = out.job(9, "b")
    other.owner = "B"
    scheduler.submit(other)
    engine.gate.set()
    out.wait(1, 2, 3, 4, 9)
    assert engine.served[:3] == ["hold-a0", "b", "a1"], engine.served
    engine.release.set()
    out.wait(0)
    scheduler.stop(5)


def test_a_full_queue_still_takes_a_client_with_nothing_waiting_up_to_its_reserve():
    engine, scheduler, out = busy_scheduler("running", max_queue=4)
    assert scheduler.max_per_owner == 2 and scheduler.reserve == 2
    submitted = 0

    def submit(owner: str) -> None:
        nonlocal submitted
        submitted += 1
        job = out.job(submitted, f"{owner}{submitted}")
        job.owner = owner
        scheduler.submit(job)

    for owner in "AABB":
        submit(owner)
    with pytest.raises(QueueFullError, match="queue is full"):
        submit("A")
    submit("C")  # the queue is full, but C has nothing waiting or running
    with pytest.raises(QueueFullError, match="queue is full"):
        submit("C")  # now it has
    submit("D")
    with pytest.raises(QueueFullError, match="queue is full"):
        submit("E")  # the reserve is used up
    engine.gate.set()
    out.wait(0, 1, 2, 3, 4, 6, 8)
    scheduler.stop(5)
