"""Thinking that loops is caught (--loop answer|stop|off), and thinking that ends too soon is
made to go on (--min-think: an early </think> becomes "Wait"), in the daemon and through a
remote server."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from phi4cli.text.loops import LoopDetector
from phi4cli.text.reasoning import ThinkSplitter
from tests.conftest import run_phi4
from tests.scripted_server import Head, Step, chunk, data, scripted_server, separated
from tests.tinymodel import write_script_model
from tests.traces import looping_trace, normal_trace

THINKING, ANSWER = " Two plus two makes four.", " The answer is 4"


def _flagged(text: str, rng: random.Random) -> int | None:
    detector = LoopDetector()
    at = 0
    while at < len(text):
        size = rng.randint(1, 12)  # pieces as a stream cuts them, through words
        detector.feed(text[at : at + size])
        at += size
    detector.finish()
    return detector.looped_at


def test_long_traces_in_the_corpus_style_are_not_flagged():
    # Steps, formulas of the notation corpus, stock phrases ("Wait, let me check that
    # again.") and steps restated word for word: bench/loops.py runs 1,000 such traces.
    rng = random.Random(7)
    for _ in range(40):
        text = normal_trace(rng, rng.randint(2000, 8000))
        assert _flagged(text, rng) is None, text[:300]


def test_the_splitter_says_where_an_end_of_thinking_begins_and_can_forget_it():
    splitter = ThinkSplitter(starts_in_reasoning=True)
    assert splitter.feed("so four </thi") == [("reasoning", "so four ")]
    assert splitter.held == "</thi"
    assert splitter.closing_at("nk>\nok") == 0
    assert splitter.closing_at("s") is None
    splitter.drop_held()
    assert splitter.feed("Wait") == [("reasoning", "Wait")]
    assert splitter.reasoning == "so four Wait"


# --- the daemon, on scripted tiny models ---------------------------------------------------------


@pytest.fixture(scope="module")
def script_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny models that follow a script greedily: one thinks THINKING, closes its thinking and
    says ANSWER; the other says THINKING again and again, until something ends its thinking."""
    folder = tmp_path_factory.mktemp("scripts")
    return {
        "short": write_script_model(folder / "short.gguf", THINKING, ANSWER),
        "loops": write_script_model(folder / "loops.gguf", THINKING, ANSWER, loops=True),
    }


def _solve(model: Path, *args: str) -> tuple[Any, dict[str, Any]]:
    done = run_phi4(
        "solve", "What is 2+2?", "-m", str(model), "-t", "0", "--json", *args, timeout=120
    )
    record = json.loads(done.stdout)
    return done, record


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_thinking_that_ends_too_soon_is_made_to_go_on(script_models: dict[str, Path]):
    done, record = _solve(script_models["short"], "-n", "200")
    stats = record["stats"]
    assert done.returncode in (0, 1), done.stderr
    assert (record["reasoning"].strip(), record["solution"].strip()) == (
        THINKING.strip(),
        ANSWER.strip(),
    )
    assert stats["waits"] == 0 and stats["reasoning_tokens"] < 30
    done, record = _solve(script_models["short"], "-n", "200", "--min-think", "30")
    stats = record["stats"]
    # Each early </think> (several tokens, the first ones in the KV already) was taken back and
    # "Wait" written instead; the model went on thinking, then answered as before.
    assert stats["reasoning_tokens"] >= 30 and stats["waits"] >= 2, stats
    assert record["reasoning"].count("Wait") == stats["waits"]
    assert record["reasoning"].strip().startswith(f"{THINKING.strip()} Wait{THINKING}")
    assert "</" not in record["reasoning"] and "think>" not in record["reasoning"]
    assert record["solution"].strip() == ANSWER.strip()
    assert stats["finish_reason"] == "stop"


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_a_looping_thought_is_caught_before_max_tokens_and_answered(
    script_models: dict[str, Path], tiny_reasoning_model: Path
):
    _, record = _solve(script_models["loops"], "-n", "3000")
    stats = record["stats"]
    assert (stats["loop"], stats["finish_reason"]) == ("answered", "stop"), stats
    assert stats["loop_at"] < 400 and stats["completion_tokens"] < 400
    assert record["solution"].strip() == ANSWER.strip()
    verbose = run_phi4(
        "solve",
        "What is 2+2?",
        "-m",
        str(script_models["loops"]),
        "-t",
        "0",
        "-n",
        "3000",
        "--verbose",
        timeout=120,
    )
    assert f"looped at {stats['loop_at']:,}: ended, the model answered" in verbose.stderr
    # --loop stop: stopped there, and said so; off: it runs to --max-tokens.
    stopped, record = _solve(script_models["loops"], "-n", "3000", "--loop", "stop")
    assert (record["stats"]["loop"], record["stats"]["finish_reason"]) == ("stopped", "loop")
    assert record["stats"]["completion_tokens"] == stats["loop_at"]
    assert stopped.returncode == 1
    assert "the output repeated itself and was stopped" in stopped.stderr
    _, record = _solve(script_models["loops"], "-n", "600", "--loop", "off")
    assert (record["stats"]["loop"], record["stats"]["completion_tokens"]) == (None, 600)
    # The random tiny model pushed into repeating itself (a repeat penalty below 1).
    _, record = _solve(tiny_reasoning_model, "-n", "3000", "--repeat-penalty", "0.5")
    assert record["stats"]["loop"] in ("answered", "stopped")
    assert record["stats"]["loop_at"] < 3000 and record["stats"]["completion_tokens"] < 3000


@pytest.mark.daemon
def test_loop_and_min_think_are_checked():
    bad = run_phi4("solve", "What is 2+2?", "--loop", "maybe", "--backend", "http://127.0.0.1:9")
    assert bad.returncode == 2 and "--loop" in bad.stderr and "answer" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


# --- a remote server ---------------------------------------------------------------------------


def _looping_server(body: dict[str, Any]) -> list[str | Step]:
    """Thinks in a loop; asked again with the thinking closed, it answers."""
    if body["messages"][-1]["role"] == "assistant":
        return [chunk({"content": " So $\\boxed{4}$."}), chunk({}, "stop"), data("[DONE]")]
    text, _ = looping_trace(random.Random(3), 300, 40, 4000)
    return separated(
        "reasoning_content", [w + " " for w in text.split()], ["Never said."], with_usage=False
    )


def _served(script: Any, *args: str) -> tuple[Any, list[dict[str, Any]]]:
    """``phi4 solve ARGS`` through a scripted server running ``script``: the finished command,
    and the request bodies the server was sent."""
    with scripted_server(script) as server:
        done = run_phi4("solve", *args, "--backend", server.url, "-m", "m", timeout=100)
        return done, list(server.bodies)


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_a_servers_looping_thought_is_closed_and_the_answer_asked_for():
    done, bodies = _served(_looping_server, "What is 2+2?", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["answer"] == "4"
    assert record["stats"]["loop"] == "answered" and record["stats"]["loop_at"] < 1000
    assert len(bodies) == 2 and bodies[1]["continue_final_message"] is True
    assert bodies[1]["messages"][-1]["content"].endswith("</think>\n\n")
    stopped, bodies = _served(_looping_server, "What is 2+2?", "--json", "--loop", "stop")
    assert len(bodies) == 1
    record = json.loads(stopped.stdout)
    assert (record["stats"]["loop"], record["stats"]["finish_reason"]) == ("stopped", "loop")
    assert stopped.returncode == 1 and record["answer"] is None


def _hasty_server(body: dict[str, Any]) -> list[str | Step]:
    """Closes its thinking after three words; asked to go on after "Wait", thinks more."""
    last = body["messages"][-1]
    if last["role"] == "assistant":
        assert last["content"].startswith("<think>\n") and last["content"].endswith(" Wait")
        more = [f" step{i}" for i in range(12)]
        return separated("reasoning_content", more, [" So $\\boxed{5}$."])
    return separated("reasoning_content", ["Quick", " guess", " done."], [" $\\boxed{9}$"])


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_a_server_that_ends_its_thinking_too_soon_is_asked_to_go_on():
    done, bodies = _served(_hasty_server, "What is 2+3?", "--json", "--min-think", "10")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    # The first answer (9) was never taken: the thinking went on, and its answer is the one.
    assert record["answer"] == "5" and "9" not in record["solution"]
    assert record["reasoning"].startswith("Quick guess done. Wait step0")
    assert record["stats"]["waits"] == 1 and len(bodies) == 2
    assert bodies[1]["continue_final_message"] is True
    plain, bodies = _served(_hasty_server, "What is 2+3?", "--answer-only")
    assert len(bodies) == 1
    assert plain.stdout == "9\n"


@pytest.mark.timeout(120)
def test_after_wait_the_cache_holds_exactly_the_text_shown(script_models: dict[str, Path]):
    # In process, on the real llama.cpp context: the tag's tokens taken back are gone from
    # the KV cache, and what it holds after the prompt is what was shown, tag included.
    import llama_cpp

    from phi4cli.core._settings import Ask, Settings
    from phi4cli.core.protocol import Event, EventKind, SolveParams
    from phi4cli.daemon.jobs import Job
    from phi4cli.daemon.llama.batch import LlamaEngine

    engine = LlamaEngine(Settings(n_ctx=1024, threads=1, ramdisk="off"))
    engine.load(script_models["short"])
    engine.warm()
    events: list[Event] = []
    params = SolveParams("What is 2+2?", Ask(temperature=0.0, max_tokens=100, min_think=30))
    assert engine.admit(Job(1, params, events.append)) is None
    finished: list[Any] = []
    while not finished:
        finished = engine.step()
    [(_, stats)] = finished
    assert stats.waits >= 2 and stats.finish_reason == "stop"
    slot = next(s for s in engine._slots if s.seq == stats.extra["slot"])
    assert engine._prompts is not None and engine._model is not None
    written = b"".join(engine._prompts.piece(t) for t in slot.tokens[stats.prompt_tokens :])
    reasoning = "".join(e.text for e in events if e.kind == EventKind.REASONING)
    answer = "".join(e.text for e in events if e.kind == EventKind.TOKEN)
    assert written.decode() == f"{reasoning}</think>{answer}"
    assert stats.completion_tokens == len(slot.tokens) - stats.prompt_tokens
    memory = engine._model.context.memory
    assert llama_cpp.llama_memory_seq_pos_max(memory, slot.seq) == len(slot.tokens) - 1
    engine.close()


@pytest.mark.daemon
def test_min_think_leaves_an_answer_without_thinking_alone():
    # A server that does not think: nothing to go on from, so one request and its answer.
    def plain(body: dict[str, Any]) -> list[str | Step]:
        return separated("reasoning_content", [], [" $\\boxed{9}$"])

    done, bodies = _served(plain, "What is 2+3?", "--answer-only", "--min-think", "50")
    assert len(bodies) == 1
    assert done.returncode == 0 and done.stdout == "9\n", done.stderr


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_with_min_think_the_answer_after_a_caught_loop_is_kept_and_counted():
    done, bodies = _served(_looping_server, "What is 2+2?", "--json", "--min-think", "20000")
    assert len(bodies) == 2
    record = json.loads(done.stdout)
    assert record["answer"] == "4" and record["stats"]["loop"] == "answered"
    done, _ = _served(_hasty_server, "What is 2+3?", "--json", "--min-think", "10")
    stats = json.loads(done.stdout)["stats"]
    # Three thinking pieces, the Wait, twelve more, then the answer's one: the stream counted.
    assert (stats["reasoning_tokens"], stats["answer_tokens"]) == (16, 1), stats


def test_the_daemons_threads_spin_a_while_unless_the_user_says_otherwise():
    from phi4cli.daemon.threads import choose_wait_policy

    env: dict[str, str] = {}
    assert choose_wait_policy(env) == "GOMP_SPINCOUNT=100000"
    assert env == {"GOMP_SPINCOUNT": "100000"}
    mine = {"GOMP_SPINCOUNT": "300000"}
    assert choose_wait_policy(mine) == "GOMP_SPINCOUNT=300000 (yours)"
    assert mine == {"GOMP_SPINCOUNT": "300000"}  # left as the user set it
    assert choose_wait_policy({"OMP_WAIT_POLICY": "active"}) == "OMP_WAIT_POLICY=active (yours)"


def _answer_looping_server(body: dict[str, Any]) -> list[str | Step]:
    """No thinking: the answer itself says the same sentence again and again."""
    sentence = "The answer is clearly large and I keep saying so because it is big ."
    words = (sentence + " ") * 100
    return [
        *(chunk({"content": w + " "}) for w in words.split()),
        chunk({}, "stop"),
        data("[DONE]"),
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [[], ["--json"], ["-a"], ["--verbose"]])
@pytest.mark.daemon
def test_a_loop_in_the_answer_exits_1_and_says_so_in_every_mode(mode: list[str]):
    done, _ = _served(_answer_looping_server, "What is big?", *mode)
    assert done.returncode == 1, done.stderr
    # No thinking here: the hint is not the thinking's (--loop answer), which cannot help.
    assert (
        done.stderr.count(
            "the answer repeated itself and was stopped (ask again, or with --samples)"
        )
        == 1
    ), done.stderr
    assert "--loop answer" not in done.stderr
    if mode == ["--json"]:
        record = json.loads(done.stdout)
        assert (record["stats"]["loop"], record["stats"]["finish_reason"]) == ("stopped", "loop")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [["--jsonl"], [], ["-a"]])
@pytest.mark.daemon
def test_a_loop_in_an_answer_of_a_file_exits_1_and_names_its_line(mode: list[str], tmp_path: Path):
    problems = tmp_path / "problems.txt"
    problems.write_text("What is big?\n")
    done, _ = _served(_answer_looping_server, "--file", str(problems), *mode)
    assert done.returncode == 1, done.stderr
    assert "line 1: " in done.stderr and "repeated itself and was stopped" in done.stderr


def _looping_then_unsure_server(body: dict[str, Any]) -> list[str | Step]:
    """Thinks in a loop; asked again with the thinking closed, it states no answer."""
    if body["messages"][-1]["role"] == "assistant":
        return [chunk({"content": " I am not sure."}), chunk({}, "stop"), data("[DONE]")]
    return _looping_server(body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [[], ["--json"]])
@pytest.mark.daemon
def test_a_cut_loop_whose_answer_states_none_exits_1_and_says_so(mode: list[str]):
    done, bodies = _served(_looping_then_unsure_server, "What is 2+2?", *mode)
    assert len(bodies) == 2  # the answer was asked for
    assert done.returncode == 1, done.stderr
    assert "the thinking repeated itself and was ended there" in done.stderr


def _boxed_answer_looping_server(body: dict[str, Any]) -> list[str | Step]:
    """No thinking: the answer states 4, then says so again and again."""
    words = "So the answer is $\\boxed{4}$ and I am sure of it, let me say it again. " * 80
    return [
        *(chunk({"content": w + " "}) for w in words.split()),
        chunk({}, "stop"),
        data("[DONE]"),
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [[], ["--json"], ["-a"]])
@pytest.mark.daemon
def test_a_looping_answer_that_stated_one_exits_1_and_says_it_may_be_cut_short(mode: list[str]):
    done, _ = _served(_boxed_answer_looping_server, "What is 2+2?", *mode)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("repeated itself and was stopped: its answer may be cut short") == 1
    if mode == ["-a"]:
        assert done.stdout.strip() == "4"


def _never_continuing_server(body: dict[str, Any]) -> list[str | Step]:
    """Thinks in a loop; a server that does not continue an assistant's message: asked to go on
    from the closed thinking, it starts a new message and thinks again (to its limit, never
    answering); asked afresh by a user's turn for the final answer, it answers."""
    last = body["messages"][-1]
    if last["role"] == "user" and last["content"].startswith("Stop thinking now."):
        return [chunk({"content": " So $\\boxed{4}$."}), chunk({}, "stop"), data("[DONE]")]
    if last["role"] == "assistant":
        again = [f" hmm{i}" for i in range(400)]
        return separated("reasoning_content", again, [], with_usage=False)
    return _looping_server(body)


def _refusing_to_continue_server(body: dict[str, Any]) -> list[str | Step | Head]:
    """Thinks in a loop; as phi4 serve, it refuses a request whose last message is not the
    user's (a 400); asked afresh by a user's turn for the final answer, it answers."""
    last = body["messages"][-1]
    if last["role"] == "assistant":
        return [
            Head(400),
            json.dumps({"error": {"message": "the last message must be the user's"}}),
        ]
    if last["content"].startswith("Stop thinking now."):
        return [chunk({"content": " So $\\boxed{4}$."}), chunk({}, "stop"), data("[DONE]")]
    return _looping_server(body)


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_a_server_that_refuses_to_continue_is_asked_afresh_for_the_answer():
    # Found trying `--backend <phi4 serve>` with a think budget: "the backend answered 400: the
    # last message must be the user's", exit 1, though the thinking was enough to answer.
    done, bodies = _served(_refusing_to_continue_server, "What is 2+2?", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert (record["answer"], record["stats"]["loop"]) == ("4", "answered")
    assert [b["messages"][-1]["role"] for b in bodies] == ["user", "assistant", "user"]
    assert bodies[2]["messages"][-1]["content"].startswith("Stop thinking now.")


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_a_server_that_does_not_continue_is_asked_afresh_for_the_answer():
    # Before: the second request thought again and never answered: exit 1, "no final answer",
    # where the thinking (cut as a loop) was enough to answer.
    done, bodies = _served(_never_continuing_server, "What is 2+2?", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert (record["answer"], record["stats"]["loop"]) == ("4", "answered")
    assert len(bodies) == 3
    assert bodies[1]["messages"][-1]["content"].endswith("</think>\n\n")
    fresh = bodies[2]["messages"]
    assert fresh[-2]["role"] == "assistant" and fresh[-2]["content"].endswith("</think>")
    assert fresh[-1]["role"] == "user" and fresh[-1]["content"].startswith("Stop thinking now.")
    assert not bodies[2].get("continue_final_message")
    assert "hmm" not in record["reasoning"] + record["solution"]
