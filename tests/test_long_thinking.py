"""Reasoning-length answers under concurrency: admission by reservation, waiting for memory, and
nothing started ever thrown away. Real daemon, real llama.cpp, the tiny reasoning model (it never
stops before its token limit, so each answer is as long as its budget: long thinking, cheaply)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import both_kv_layouts, run_phi4

# Each test runs phi4 as a process (the command, its daemon or a server).
pytestmark = pytest.mark.daemon


def _status() -> dict[str, Any]:
    result = run_phi4("status", "--json", timeout=30)
    return json.loads(result.stdout) if result.returncode == 0 else {}


def test_eight_long_thinkers_through_a_small_context_all_finish(
    tiny_reasoning_model: Path, tmp_path: Path
):
    # The run in small: 8 problems x 1,000 tokens through 2,560 tokens of context hold
    # two at a time. Before reservations, most came back as context_overflow.
    started = run_phi4("daemon", "start", "-m", str(tiny_reasoning_model), "--n-ctx", "2560")
    assert started.returncode == 0, started.stderr
    problems = tmp_path / "eight.txt"
    problems.write_text("".join(f"What is {n} times 12?\n" for n in range(1, 9)))
    seen: list[dict[str, Any]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            status = _status()
            if status:
                seen.append(status)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_phi4(
            "solve",
            "-m",
            str(tiny_reasoning_model),
            "-t",
            "0.8",
            "-n",
            "1000",
            "--file",
            str(problems),
            "--jsonl",
            timeout=600,
        )
    finally:
        done.set()
        watcher.join()
    # The tiny model thinks until its token limit: every record is complete, none answered,
    # and the exit status says the thinking ran out (1).
    assert result.returncode == 1, result.stderr
    assert "error" not in result.stdout
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == list(range(1, 9))
    for record in records:
        assert record.get("error") is None, record
        assert record["stats"]["completion_tokens"] == 1000
        assert record["stats"]["finish_reason"] == "length"
    reserved = records[0]["stats"]["reserved_tokens"]
    assert 2 * reserved <= 2560 < 3 * reserved, "two fit at once, a third must wait"
    memory = [s["memory"] for s in seen if s.get("memory")]
    assert memory, "status was polled while the problems ran"
    assert max(m["running"] for m in memory) == 2
    assert all(m["reserved_tokens"] + m["system_tokens"] <= m["n_ctx"] for m in memory)
    assert any(s.get("waiting") and s["waiting"]["reason"] == "memory" for s in seen)
    assert "waiting for memory" in result.stderr


def test_a_request_that_can_never_fit_is_refused_at_once_with_the_numbers(
    tiny_reasoning_model: Path,
):
    started = run_phi4("daemon", "start", "-m", str(tiny_reasoning_model), "--n-ctx", "512")
    assert started.returncode == 0, started.stderr
    refused = run_phi4("solve", "-m", str(tiny_reasoning_model), "-n", "1000", "What is 2+2?")
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "1,000 of --max-tokens" in lines[0] and "holds 512" in lines[0]
    assert "--n-ctx" in lines[0]
    fits = run_phi4("solve", "-m", str(tiny_reasoning_model), "-n", "100", "What is 2+2?")
    assert "thinking did not finish" in fits.stderr, "the daemon stays up for the next request"


def test_default_budget_fills_the_per_request_plan(tiny_reasoning_model: Path):
    # No --max-tokens: a request may use the plan's per-request tokens (prompt included).
    started = run_phi4("daemon", "start", "-m", str(tiny_reasoning_model), "--n-ctx", "1024")
    assert started.returncode == 0, started.stderr
    result = run_phi4("solve", "-m", str(tiny_reasoning_model), "--json", "What is 2+2?")
    assert result.returncode == 1, result.stderr  # it thought to the end of its budget
    stats = json.loads(result.stdout)["stats"]
    memory = _status()["memory"]
    # All the context but the system prompt's cells, which every request shares.
    assert stats["prompt_tokens"] + stats["completion_tokens"] == 1024 - memory["system_tokens"]
    assert stats["finish_reason"] == "length"
    assert memory["plan"]["request_tokens"] == 1024 and memory["plan"]["n_ctx_source"] == "setting"


def test_warm_and_status_show_the_memory_plan(smollm2_model: Path):
    warm = run_phi4("warm", "-m", str(smollm2_model), "--kv-cache-type", "q8_0")
    assert warm.returncode == 0, warm.stderr
    # SmolLM2: 30 layers x 3 KV heads x (64 + 64) values a token, 34 bytes per 32 at q8_0.
    assert "KV cache        16,384 tokens x 12.0 KiB (q8_0) = 191.2 MiB\n" in warm.stdout
    assert "per request     4,096 tokens" in warm.stdout
    assert "at once         4 such requests; up to 16 shorter ones" in warm.stdout
    assert "offload         none (CPU)" in warm.stdout
    status = run_phi4("status")
    assert "kv now      0 reserved by 0 running" in status.stdout
    assert "KV cache    16,384 tokens x 12.0 KiB (q8_0)" in status.stdout
    assert "threads     1 (fixed: --threads or a single core)" in status.stdout  # PHI4_THREADS=1
    plan = _status()["memory"]["plan"]
    assert plan["kv_cache_type"] == "q8_0" and plan["flash_attn"] == "on"
    solved = run_phi4("solve", "-m", str(smollm2_model), "-t", "0", "--json", "What is 2+2?")
    assert solved.returncode == 0, solved.stderr
    assert "4" in json.loads(solved.stdout)["solution"]


def test_a_quantized_cache_falls_back_to_f16_where_the_heads_do_not_allow_it(
    tiny_reasoning_model: Path,
):
    warm = run_phi4("warm", "-m", str(tiny_reasoning_model), "--kv-cache-type", "q4_0")
    assert warm.returncode == 0, warm.stderr
    assert "KV cache        32,768 tokens x 256 B (f16) = 8.0 MiB" in warm.stdout
    assert "per request     8,192 tokens" in warm.stdout, "a reasoning model: room to think"
    assert (
        "note            a q4_0 KV cache needs a head size divisible by 32 (this model's is 16)"
        in warm.stdout
    )


def test_many_short_problems_pack_in_beyond_parallel(tiny_model: Path, tmp_path: Path):
    # --parallel 2 sizes the plan for two long requests, but 8,192 cells make 8 slots, and
    # requests of 40 tokens reserve little: more than two decode together.
    started = run_phi4(
        "daemon", "start", "-m", str(tiny_model), "--n-ctx", "8192", "--parallel", "2"
    )
    assert started.returncode == 0, started.stderr
    problems = tmp_path / "short.txt"
    problems.write_text("".join(f"What is {n}+{n}?\n" for n in range(12)))
    result = run_phi4(
        "solve", "-m", str(tiny_model), "-t", "0", "-n", "40", "--file", str(problems), "--jsonl"
    )
    assert result.returncode == 0, result.stderr
    slots = {json.loads(line)["stats"]["slot"] for line in result.stdout.splitlines()}
    assert len(slots) > 2, f"more than --parallel 2 decoded together: slots {slots}"
    assert _status()["memory"]["plan"]["slots"] == 8


def _turn(
    connection: Any, session: str, message: str, history: list[dict[str, str]], max_tokens: int
) -> tuple[str, dict[str, Any]]:
    """One chat turn over the protocol: return (answer text, stats)."""
    request = {
        "session": session,
        "message": message,
        "history": history,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    events = list(connection.request("chat", request))
    assert events[-1].kind == "done", events[-1]
    text = "".join(e.text for e in events if e.kind == "token")  # the answer, kept
    return text, next(e.stats.to_dict() for e in events if e.kind == "stats")


@both_kv_layouts
def test_an_evicted_chat_is_restored_from_disk_not_re_read(
    tiny_model: Path, phi4_home: Path, layout: tuple[str, ...]
):
    from phi4cli.backends.daemon_link import DaemonConnection

    started = run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "1024", *layout)
    assert started.returncode == 0, started.stderr
    sessions = phi4_home / "cache" / "sessions"
    with DaemonConnection.open(phi4_home / "run" / "daemon.sock") as connection:
        first, first_stats = _turn(connection, "c", "Count to ten.", [], 200)
        history = [
            {"role": "user", "content": "Count to ten."},
            {"role": "assistant", "content": first},
        ]
        # Turn 2 from the conversation's cells, as the reference.
        second, second_stats = _turn(connection, "c", "And back?", history, 40)
        assert second_stats["restored_tokens"] == 0
        assert second_stats["cached_tokens"] == first_stats["context_used"]
        # A long solve needs nearly every cell: the idle chat's are reclaimed, and the chat is
        # saved to disk on the way out.
        solve = list(
            connection.request("solve", {"prompt": "Go on.", "temperature": 0, "max_tokens": 900})
        )
        assert solve[-1].kind == "done", solve[-1]
        assert len(list(sessions.glob("session-*.state"))) == 1
        assert connection.call("status").result["memory"]["swapped_sessions"] == 1
        # Turn 2 again (a /retry): restored from the saved state, which holds the message too;
        # nothing is re-read but the last token (sampling needs fresh logits).
        again, stats = _turn(connection, "c", "And back?", history, 40)
        assert stats["restored_tokens"] == stats["cached_tokens"] == stats["prompt_tokens"] - 1
        assert stats["cached_tokens"] > second_stats["cached_tokens"]
        assert again == second, "the restored cache continues exactly as the original did"
    assert not list(sessions.glob("session-*.state")), "a restored state is removed"
    assert run_phi4("stop").returncode == 0


def test_cache_clear_removes_swapped_chats(phi4_home: Path):
    sessions = phi4_home / "cache" / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "session-0123.state").write_bytes(b"kv")
    cleared = run_phi4("cache", "clear")
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.endswith(" and 1 swapped-out chat session\n"), cleared.stdout
    assert not sessions.exists()


def test_streams_give_each_long_thinker_a_stream_of_its_own(
    tiny_reasoning_model: Path, tmp_path: Path
):
    # --kv-layout streams: 4,096 cells make 4 streams of 1,024, one per request, as
    # llama-server's slots (attention over a request's own cells only).
    started = run_phi4(
        "daemon",
        "start",
        "-m",
        str(tiny_reasoning_model),
        "--n-ctx",
        "4096",
        "--kv-layout",
        "streams",
    )
    assert started.returncode == 0, started.stderr
    plan = _status()["memory"]["plan"]
    assert plan["kv_layout"] == "streams" and plan["slots"] == 4 and plan["n_ctx"] == 4096
    problems = tmp_path / "six.txt"
    problems.write_text("".join(f"What is {n} times 7?\n" for n in range(1, 7)))
    result = run_phi4(
        "solve",
        "-m",
        str(tiny_reasoning_model),
        "-t",
        "0.8",
        "-n",
        "600",
        "--file",
        str(problems),
        "--jsonl",
        timeout=600,
    )
    assert result.returncode == 1, result.stderr  # the thinking ran out, as the model does
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == list(range(1, 7))
    memory = _status()["memory"]
    for record in records:
        assert record.get("error") is None, record
        assert record["stats"]["completion_tokens"] == 600
        # A fresh stream starts from a copy of the system prompt's KV, not from scratch.
        assert record["stats"]["cached_tokens"] >= memory["system_tokens"] > 0
    assert len({r["stats"]["slot"] for r in records}) == 4, "four streams decoded together"
    # A request larger than a stream is refused at once, with the numbers.
    refused = run_phi4("solve", "-m", str(tiny_reasoning_model), "-n", "2000", "What is 2+2?")
    assert refused.returncode == 1
    assert "stream of the daemon's context holds 1,024" in refused.stderr
    # The same greedy question gives the same answer in a shared cache.
    question = ["solve", "-m", str(tiny_reasoning_model), "-t", "0", "-n", "40", "--json", "2+3?"]
    in_stream = json.loads(run_phi4(*question).stdout)["solution"]
    assert run_phi4("stop").returncode == 0
    assert (
        run_phi4(
            "daemon",
            "start",
            "-m",
            str(tiny_reasoning_model),
            "--n-ctx",
            "4096",
            "--kv-layout",
            "shared",
        ).returncode
        == 0
    )
    assert _status()["memory"]["plan"]["kv_layout"] == "shared"
    assert json.loads(run_phi4(*question).stdout)["solution"] == in_stream


def test_a_chat_longer_than_its_stream_drops_its_oldest_turns(tiny_model: Path, phi4_home: Path):
    # Two streams of 512: a conversation fills its stream, not the whole context, and goes on
    # without its oldest turns rather than failing.
    from phi4cli.backends.daemon_link import DaemonConnection

    started = run_phi4(
        "daemon",
        "start",
        "-m",
        str(tiny_model),
        "--n-ctx",
        "1024",
        "--kv-layout",
        "streams",
        "--parallel",
        "2",
    )
    assert started.returncode == 0, started.stderr
    history: list[dict[str, str]] = []
    with DaemonConnection.open(phi4_home / "run" / "daemon.sock") as connection:
        for turn in range(4):
            question = f"Turn {turn}: " + "count the primes below one hundred, " * 8
            answer, stats = _turn(connection, "long", question, history, 60)
            history += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
            assert stats["n_ctx"] == 512 and stats["context_used"] <= 512
    assert stats["dropped_turns"] > 0, "the oldest turns made room"


def test_streams_keep_the_running_slots_consecutive(tiny_reasoning_model: Path, tmp_path: Path):
    # llama.cpp decodes consecutive sequences in one pass over the weights: running slots 0 and 2
    # cost two passes a step. A new request takes the lowest idle slot, not the one sharing a
    # few more tokens of its prompt.
    started = run_phi4(
        "daemon",
        "start",
        "-m",
        str(tiny_reasoning_model),
        "--n-ctx",
        "4096",
        "--kv-layout",
        "streams",
    )
    assert started.returncode == 0, started.stderr

    def slots(*questions: str) -> list[int]:
        listing = tmp_path / "problems.txt"
        listing.write_text("".join(f"{q}\n" for q in questions))
        result = run_phi4(
            "solve",
            "-m",
            str(tiny_reasoning_model),
            "-t",
            "0",
            "-n",
            "400",
            "--file",
            str(listing),
            "--jsonl",
        )
        return sorted(json.loads(line)["stats"]["slot"] for line in result.stdout.splitlines())

    assert slots("What is 1 times 7?", "What is 2 times 7?", "What is 3 times 7?") == [0, 1, 2]
    # Slot 2 holds the most of these prompts, but 0 and 1 keep the running ones together.
    assert slots("What is 3 times 7? Twice.", "What is 3 times 7? Thrice.") == [0, 1]
