"""One thinking policy (phi4cli.text.thinking) for both engines: a decision table for the policy
itself, and the same scripts through the daemon (scripted tiny models) and through a remote engine
(a scripted server that writes what those models write), with the same decisions and stats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phi4cli.text.loops import COPIES
from phi4cli.text.thinking import MAX_WAITS, Act, ThinkingPolicy
from tests.conftest import run_phi4
from tests.scripted_server import Step, chunk, data, scripted_server
from tests.tinymodel import write_script_model

THINKING, ANSWER = " Two plus two makes four.", " The answer is 4"

# (what happens, what the policy says): "text" (a piece, in the thinking?, tokens so far),
# "loop" (LOOP written again and again, in the thinking?, until the policy acts: within
# COPIES + 2 times), "count" (thinking tokens, in the thinking?), "closed" (the end of thinking
# fitted?), "closing" (the model ends its thinking after so many tokens), "waited".
Step_ = tuple[str, tuple[Any, ...], Act | None]
LOOP = " So the area is twelve, let me check the sides again."  # 11 words, 12 tokens
CAUGHT = "caught"  # in the stats: the tokens written when the last "loop" step was acted on


TABLE: list[tuple[str, tuple[int | None, int, str], list[Step_], dict[str, Any]]] = [
    (
        "a budget closes the thinking once",
        (10, 0, "answer"),
        [
            ("count", (9, True), Act.GO_ON),
            ("count", (10, True), Act.ANSWER),
            ("closed", (True,), Act.GO_ON),
            ("count", (11, True), Act.GO_ON),
        ],
        {"budget_reached": True, "loop": None, "loop_at": None, "waits": 0},
    ),
    (
        "a budget with no room to close lets the thinking run",
        (10, 0, "answer"),
        [("count", (10, True), Act.ANSWER), ("closed", (False,), Act.GO_ON)],
        {"budget_reached": False, "loop": None, "loop_at": None, "waits": 0},
    ),
    (
        "an early end of thinking becomes Wait, at most MAX_WAITS times",
        (None, 100, "answer"),
        [
            *[
                x
                for _ in range(MAX_WAITS)
                for x in (("closing", (5,), Act.WAIT), ("waited", (), None))
            ],
            ("closing", (50,), Act.GO_ON),
        ],
        {"budget_reached": False, "loop": None, "loop_at": None, "waits": MAX_WAITS},
    ),
    (
        "no Wait for an answer with no thinking, nor past --min-think",
        (None, 100, "answer"),
        [("closing", (0,), Act.GO_ON), ("closing", (100,), Act.GO_ON)],
        {"budget_reached": False, "loop": None, "loop_at": None, "waits": 0},
    ),
    (
        "no Wait after phi4 closed the thinking for a budget",
        (10, 100, "answer"),
        [
            ("count", (10, True), Act.ANSWER),
            ("closed", (True,), Act.GO_ON),
            ("closing", (10,), Act.GO_ON),
        ],
        {"budget_reached": True, "loop": None, "loop_at": None, "waits": 0},
    ),
    (
        "a loop in the thinking is answered, a loop in the answer stopped",
        (None, 0, "answer"),
        [
            ("loop", (True,), Act.ANSWER),
            ("closed", (True,), Act.GO_ON),
            ("loop", (False,), Act.STOP),
            ("text", (LOOP, False, 999), Act.GO_ON),
        ],
        {"budget_reached": False, "loop": "stopped", "loop_at": CAUGHT, "waits": 0},
    ),
    (
        "--loop stop stops a loop in the thinking",
        (None, 0, "stop"),
        [("loop", (True,), Act.STOP)],
        {"budget_reached": False, "loop": "stopped", "loop_at": CAUGHT, "waits": 0},
    ),
    (
        "a loop that cannot be closed is stopped",
        (None, 0, "answer"),
        [("loop", (True,), Act.ANSWER), ("closed", (False,), Act.STOP)],
        {"budget_reached": False, "loop": "stopped", "loop_at": CAUGHT, "waits": 0},
    ),
    (
        "no Wait after phi4 closed a looping thinking",
        (None, 100, "answer"),
        [
            ("loop", (True,), Act.ANSWER),
            ("closed", (True,), Act.GO_ON),
            ("closing", (10,), Act.GO_ON),
        ],
        {"budget_reached": False, "loop": "answered", "loop_at": CAUGHT, "waits": 0},
    ),
    (
        "--loop off lets it run",
        (None, 0, "off"),
        [("text", (LOOP, True, 12 * i), Act.GO_ON) for i in range(1, 200)],
        {"budget_reached": False, "loop": None, "loop_at": None, "waits": 0},
    ),
    (
        "no budget after a loop was answered",
        (20, 0, "answer"),
        [
            ("loop", (True,), Act.ANSWER),
            ("closed", (True,), Act.GO_ON),
            ("count", (30, True), Act.GO_ON),
        ],
        {"budget_reached": False, "loop": "answered", "loop_at": CAUGHT, "waits": 0},
    ),
]


@pytest.mark.parametrize(("name", "args", "steps", "stats"), TABLE, ids=[t[0] for t in TABLE])
def test_the_policy_decides_by_the_table(
    name: str, args: tuple[int | None, int, str], steps: list[Step_], stats: dict[str, Any]
):
    policy = ThinkingPolicy(*args)
    tokens, caught = 0, None
    for kind, values, expected in steps:
        if kind == "loop":
            for _ in range(COPIES + 2):
                tokens += 12
                act = policy.text(LOOP, values[0], tokens)
                if act is not Act.GO_ON:
                    break
            assert act is expected, (name, tokens, act)
            caught = tokens
            continue
        act = {
            "text": policy.text,
            "count": policy.counted,
            "closed": policy.closed,
            "closing": policy.closing,
            "waited": policy.waited,
        }[kind](*values)
        if expected is not None:
            assert act is expected, (name, kind, values, act)
    expected = {"answered_early": False, **stats}  # (answer now: tests/test_answer_now.py)
    assert policy.stats() == {k: caught if v == CAUGHT else v for k, v in expected.items()}, name


# --- the same scripts through both engines ----------------------------------------------------


@pytest.fixture(scope="module")
def script_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("policy-scripts")
    return {
        "short": write_script_model(folder / "short.gguf", THINKING, ANSWER),
        "loops": write_script_model(folder / "loops.gguf", THINKING, ANSWER, loops=True),
    }


def _pieces(model: Path, text: str) -> list[str]:
    """``text`` cut where the script model's tokens are cut: a server's pieces, one a token."""
    import llama_cpp

    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    tokens = vocab.tokenize(text.encode(), add_bos=False, special=True)
    pieces = [vocab.detokenize([token]).decode() for token in tokens]
    vocab.close()
    assert "".join(pieces) == text
    return pieces


def _server_like(model: Path, loops: bool):
    """A server that writes what the script model writes, a token a piece: THINKING (again and
    again, with ``loops``, up to max_tokens), then ANSWER; asked to go on from "Wait", it
    thinks again; from a closed thinking, it answers."""
    pieces = _pieces(model, THINKING)
    answer = [chunk({"content": piece}) for piece in _pieces(model, ANSWER)]

    def script(body: dict[str, Any]) -> list[str | Step]:
        limit = int(body.get("max_tokens") or body.get("max_completion_tokens") or 10**6)
        last = body["messages"][-1]
        end = [chunk({}, "stop"), data("[DONE]")]
        if last["role"] == "assistant" and last["content"].endswith("</think>\n\n"):
            return [*answer, *end]
        thinking = pieces * (limit // len(pieces) + 1) if loops else pieces
        if len(thinking) >= limit:
            lines = [chunk({"reasoning_content": p}) for p in thinking[:limit]]
            return [*lines, chunk({}, "length"), data("[DONE]")]
        lines = [chunk({"reasoning_content": p}) for p in thinking]
        return [*lines, *answer[: max(0, limit - len(thinking))], *end]

    return script


SCENARIOS = [
    ("loops", ["-n", "3000"]),
    ("loops", ["-n", "3000", "--loop", "stop"]),
    ("loops", ["-n", "200", "--loop", "off"]),
    ("loops", ["-n", "3000", "--think-budget", "12"]),
    ("short", ["-n", "200", "--min-think", "12"]),
    ("short", ["-n", "200"]),
]
# (Not the thinking's token count: the daemon counts the tokens of the model's own end of
# thinking as thinking, a server leaves them out.)
COMPARED = ("loop", "loop_at", "waits", "budget_reached", "finish_reason")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("model", "args"), SCENARIOS, ids=[" ".join(s[1]) for s in SCENARIOS])
@pytest.mark.daemon
def test_the_daemon_and_a_remote_engine_decide_alike(
    script_models: dict[str, Path], model: str, args: list[str]
):
    local = run_phi4(
        "solve",
        "What is 2+2?",
        "-m",
        str(script_models[model]),
        "-t",
        "0",
        "--json",
        *args,
        timeout=120,
    )
    with scripted_server(_server_like(script_models[model], model == "loops")) as server:
        remote = run_phi4(
            "solve",
            "What is 2+2?",
            "--backend",
            server.url,
            "-m",
            "m",
            "--json",
            *args,
            timeout=120,
        )
    daemon, served = json.loads(local.stdout), json.loads(remote.stdout)
    assert local.returncode == remote.returncode, (local.stderr, remote.stderr)
    assert daemon["answer"] == served["answer"]
    assert daemon["solution"].strip() == served["solution"].strip()
    mine = {key: daemon["stats"][key] for key in COMPARED}
    theirs = {key: served["stats"][key] for key in COMPARED}
    assert mine == theirs


LOOPING = "Let me check the sum again. The sum of the digits is seven, so nothing changes here. "


def _looping_server(body: dict[str, Any]) -> list[str | Step]:
    """Thinks LOOPING again and again; asked to go on from a closed thinking, answers 7."""
    end = [chunk({}, "stop"), data("[DONE]")]
    last = body["messages"][-1]
    if last["role"] == "assistant" and last["content"].endswith("</think>\n\n"):
        return [chunk({"content": "So $\\boxed{7}$."}), *end]
    words = [w + " " for w in LOOPING.split()] * 60
    return [*(chunk({"reasoning_content": w}) for w in words), chunk({}, "length"), data("[DONE]")]


@pytest.mark.timeout(600)
@pytest.mark.daemon
def test_a_loop_the_rule_cut_is_said_on_stderr_though_an_answer_came(tmp_path: Path):
    # Only --json's stats said it: a pipe and --answer-only printed the answer from half the
    # thinking without a word. Through the daemon and a remote engine alike.
    from tests.tinymodel import write_text_script_model

    head = "Think first. "
    model = write_text_script_model(
        tmp_path / "loop.gguf", head + LOOPING, " So $\\boxed{7}$.", loop_from=len(head)
    )
    with scripted_server(_looping_server) as server:
        for engine in (["-m", str(model), "-t", "0"], ["--backend", server.url, "-m", "m"]):
            for mode in ([], ["-a"]):
                done = run_phi4("solve", "What is 3+4?", "-n", "3000", *engine, *mode)
                assert done.returncode == 0, done.stderr
                assert done.stdout.strip().endswith(("7", "$\\boxed{7}$."))
                said = [line for line in done.stderr.splitlines() if "repeated itself" in line]
                assert len(said) == 1 and "was ended after" in said[0], done.stderr
