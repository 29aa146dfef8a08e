"""Deterministic mode: a greedy or seeded answer is the same whatever the daemon did before.

llama.cpp's arithmetic depends on a sequence's neighbours (the batch's shape, how the prompt was
split into chunks, the KV cells around it), so without the mode a ``-t 0`` answer can change
after a ``--file``, a ``-k 3`` or beside a concurrent solve. These tests run the real daemon.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from phi4cli.core import protocol
from phi4cli.core._settings import Ask
from phi4cli.core.config import Settings
from phi4cli.core.protocol import parse_solve_params
from phi4cli.daemon.jobs import Job, Wait
from tests.conftest import PHI4, run_phi4
from tests.test_protocol_scheduler import Collector, FakeEngine, make_scheduler

# Long enough that the answer runs to the token limit (differences show late, if at all).
QUESTION = "Explain step by step how to compute 17*23, then check the result."
GREEDY = ("-t", "0")
SEEDED = ("-t", "0.8", "--seed", "7")


def answer(model: Path, *args: str) -> str:
    """The whole text of one deterministic answer (thinking and solution)."""
    result = run_phi4(
        "solve",
        QUESTION,
        "-m",
        str(model),
        "-n",
        "32",
        "--deterministic",
        "--json",
        *args,
        timeout=600,
    )
    assert result.returncode in (0, 1), result.stderr
    record = json.loads(result.stdout)
    assert record["stats"]["completion_tokens"] > 0, record
    return f"{record['reasoning']!r} {record['solution']!r}"


def running(home: Path) -> int:
    result = run_phi4("status", "--json")
    assert result.returncode == 0, result.stderr
    return int(json.loads(result.stdout).get("memory", {}).get("running", 0))


# Some twenty short SmolLM2 requests on a busy machine: far past the suite's default limit.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kv_layout", ["shared", "streams"])
@pytest.mark.daemon
def test_deterministic_answers_repeat_whatever_ran_before(
    smollm2_model: Path, phi4_home: Path, tmp_path: Path, kv_layout: str
):
    started = run_phi4(
        "daemon", "start", "-m", str(smollm2_model), "--kv-layout", kv_layout, timeout=600
    )
    assert started.returncode == 0, started.stderr
    fresh = {
        name: answer(smollm2_model, *args)
        for name, args in (("greedy", GREEDY), ("seeded", SEEDED))
    }

    def same_as_fresh(after: str, *names: str) -> None:
        for name in names or ("greedy",):
            args = GREEDY if name == "greedy" else SEEDED
            assert answer(smollm2_model, *args) == fresh[name], f"{name} answer after {after}"

    problems = tmp_path / "problems.txt"
    problems.write_text("What is 3+5?\nWhat is 7*8?\nWhat is 10-4?\nName a prime above 20.\n")
    model = ("-m", str(smollm2_model))
    done = run_phi4("solve", *model, "-t", "0", "-n", "24", "-f", str(problems), timeout=600)
    assert done.returncode in (0, 1), done.stderr
    same_as_fresh("a --file")
    done = run_phi4("solve", QUESTION, *model, "-t", "0.8", "-k", "3", "-n", "24", timeout=600)
    assert done.returncode in (0, 1), done.stderr
    same_as_fresh("-k 3")
    done = run_phi4("chat", *model, "-n", "24", input="Tell me about the number 7.\n", timeout=600)
    assert done.returncode == 0, done.stderr
    same_as_fresh("a chat turn", "greedy", "seeded")  # seeded: after all three

    # Beside a long request that is running: the deterministic one waits for it, then runs alone.
    other = subprocess.Popen(
        [PHI4, "solve", "Write a long story about numbers.", *model, "-t", "0", "-n", "200"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while running(phi4_home) == 0:
            assert other.poll() is None, "the concurrent solve ended before it was seen running"
            assert time.monotonic() < deadline, "the concurrent solve never started"
        assert answer(smollm2_model, *GREEDY) == fresh["greedy"], "beside a concurrent solve"
        assert other.wait(600) == 0, other.stderr.read() if other.stderr else ""
    finally:
        other.kill()
        other.wait()


def test_deterministic_is_a_request_parameter_with_the_setting_as_default():
    assert parse_solve_params({"prompt": "x"}, Ask.of(Settings())).ask.deterministic is False
    on = Ask.of(Settings(deterministic=True))
    assert parse_solve_params({"prompt": "x"}, on).ask.deterministic is True
    sent = parse_solve_params({"prompt": "x", "deterministic": False}, on)
    assert sent.ask.deterministic is False
    with pytest.raises(protocol.ProtocolViolation, match="deterministic"):
        parse_solve_params({"prompt": "x", "deterministic": "yes"}, Ask())


class CountingEngine(FakeEngine):
    """Records how many requests were running when each was admitted."""

    def __init__(self) -> None:
        super().__init__(parallel=4)
        self.running_at_admission: dict[str, int] = {}

    def admit(self, job: Job) -> Wait | None:
        running = self.active
        wait = super().admit(job)
        if wait is None:
            self.running_at_admission[job.params.prompt] = running
        return wait


def test_a_deterministic_request_waits_for_running_ones_and_holds_later_ones_back():
    engine = CountingEngine()
    scheduler, _ = make_scheduler(engine)
    out = Collector()
    scheduler.submit(out.job(0, "hold-running"))
    assert engine.started.wait(30)
    det = out.job(1, "det")
    det.params = det.params._replace(ask=det.params.ask._replace(deterministic=True))
    scheduler.submit(det)
    scheduler.submit(out.job(2, "later"))
    # Let the worker go round its loop a good many times: neither may be admitted meanwhile.
    beats = scheduler.beats
    deadline = time.monotonic() + 60
    while scheduler.beats < beats + 50:
        assert time.monotonic() < deadline, "the worker stopped going round"
        threading.Event().wait(0.001)
    assert engine.served == ["hold-running"], "nothing overtakes the deterministic request"
    assert not out.terminal(0), "the running request is never cancelled for it"
    engine.release.set()
    out.wait(0, 1, 2, timeout=60)
    assert engine.served == ["hold-running", "det", "later"]
    assert engine.running_at_admission["det"] == 0, "it runs alone"
    assert engine.running_at_admission["later"] == 0, "nothing joins it while it decodes"
    assert [e["event"] for e in out.terminal(0)] == ["done"]
    scheduler.stop(10)


def test_the_http_api_passes_deterministic_on_and_checks_it():
    from phi4cli.serve.openai_request import ApiError, chat_params

    body = {"messages": [{"role": "user", "content": "2+2?"}], "deterministic": True}
    assert chat_params(body, "m", Settings()).ask.deterministic is True
    # A null takes the server's setting.
    unsaid = {**body, "deterministic": None}
    assert chat_params(unsaid, "m", Settings()).ask.deterministic is False
    assert chat_params(unsaid, "m", Settings(deterministic=True)).ask.deterministic is True
    with pytest.raises(ApiError, match="deterministic"):
        chat_params({**body, "deterministic": 1}, "m", Settings())


@pytest.mark.daemon
def test_a_deterministic_chat_repeats_its_answers_turn_by_turn(tiny_model: Path):
    """A chat turn reads the whole conversation afresh, so the same conversation gets the same
    answers again after the daemon has cached (and answered beside) other things."""
    conversation = "What is 2+2?\nAnd plus one?\n/bye\n"
    args = ("chat", "-m", str(tiny_model), "-t", "0", "-n", "6", "--deterministic")
    first = run_phi4(*args, input=conversation)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip(), "it answered"
    busy = run_phi4("solve", "Something else entirely", "-m", str(tiny_model), "-k", "3", "-n", "8")
    assert busy.returncode in (0, 1), busy.stderr
    again = run_phi4(*args, input=conversation)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
