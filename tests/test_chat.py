"""`phi4 chat`: the REPL in-process with prompt-toolkit's pipe input, in a real pseudo-terminal,
and the daemon's per-conversation token cache — all against a real daemon and real llama.cpp."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from phi4cli.backends.daemon import DaemonBackend
from phi4cli.client.chats import ChatStore, Conversation, Turn
from phi4cli.client.environment import Environment
from phi4cli.client.repl import AtomicFileHistory, ChatRepl, prompt_reader, read_message
from phi4cli.core.config import Settings
from phi4cli.core.paths import get_paths
from phi4cli.daemon.sessions import ChatSession, SessionStore
from tests.conftest import PHI4, run_phi4


def make_repl(model: Path, **settings: object) -> tuple[ChatRepl, io.StringIO, io.StringIO]:
    paths = get_paths()
    out, err = io.StringIO(), io.StringIO()
    env = Environment(io.StringIO(), out, err, paths=paths)
    config = Settings(model=str(model), **settings)  # type: ignore[arg-type]
    backend = DaemonBackend(paths, config, model, env.notice)
    conversation = Conversation(name="chat-test", model=str(model))
    store = ChatStore(paths.data_dir / "chats")
    return ChatRepl(env, backend, config, str(model), conversation, store), out, err


def run_script(repl: ChatRepl, lines: list[str]) -> int:
    """Type the lines into the REPL through prompt-toolkit, as a user would."""
    with create_pipe_input() as pipe:
        pipe.send_text("".join(f"{line}\r" for line in lines))
        reader = prompt_reader(get_paths().state_dir / "chat_history", pipe, DummyOutput())
        return repl.run(reader)


@pytest.fixture
def chats() -> Iterator[ChatStore]:
    yield ChatStore(get_paths().data_dir / "chats")


@pytest.mark.daemon
def test_transcript_of_a_conversation_and_its_saved_copy(tiny_model: Path, chats: ChatStore):
    get_paths().state_dir.mkdir(parents=True, exist_ok=True)
    repl, out, err = make_repl(tiny_model, temperature=0.0, max_tokens=8)
    script = ["What is 12*13?", "And times two?", "/show", "/save first", "/exit"]
    assert run_script(repl, script) == 0
    saved = chats.load("first")
    first, second = saved.turns
    assert (first.question, second.question) == ("What is 12*13?", "And times two?")
    stats = second.stats
    path = chats.path("first")
    expected = (
        f"{first.answer}\n\n{second.answer}\n"  # a blank line between answers
        f"conversation chat-test (2 turns)\n"
        f"model        {tiny_model}\n"
        f"system       (the model default)\n"
        f"settings     temperature=0.0, top_p=0.95, max_tokens=8, think_budget=None, seed=None, "
        "loop=answer, check=auto\n"
        f"context      {stats['context_used']} of {stats['n_ctx']} tokens used\n"
        f"cached       {stats['cached_tokens']} tokens of the last prompt came from cache\n"
        f"dropped      0 oldest turn(s) no longer in the model's context\n"
    )
    assert out.getvalue() == expected
    # What a command did is said on stderr when stdout is not a terminal: stdout holds the
    # answers and what was asked for (/show).
    assert f"saved as first ({path})\n" in err.getvalue()
    assert not chats.path("chat-test").exists(), "the autosave moved to the new name"
    # The history file has what was typed, for Up/Down and Ctrl-R next time.
    history = AtomicFileHistory(get_paths().state_dir / "chat_history")
    assert list(history.load_history_strings()) == list(reversed(script))


@pytest.mark.daemon
def test_second_turn_evaluates_only_the_new_message(tiny_model: Path, chats: ChatStore):
    repl, _out, _err = make_repl(tiny_model, temperature=0.0, max_tokens=6)
    for question in ("What is 12*13?", "And times two?", "Now divide by four."):
        repl.ask(question)
    turns = repl.conversation.turns
    for before, after in itertools.pairwise(turns):
        # Everything the model saw and wrote before is reused from the KV cache.
        assert after.stats["cached_tokens"] == before.stats["context_used"]
        assert after.stats["prompt_eval_tokens"] <= 20  # the new message and template glue
        assert after.stats["rebuilt"] is False
    assert [t.stats["turn"] for t in turns] == [0, 1, 2]


@pytest.mark.daemon
def test_retry_resamples_the_last_answer_from_cache(tiny_model: Path):
    repl, _out, err = make_repl(tiny_model, temperature=0.9, max_tokens=6, seed=1)
    repl.ask("First question")
    repl.ask("Second question")
    before = repl.conversation.turns[-1]
    repl.command("/set seed 2")
    repl.command("/retry")
    after = repl.conversation.turns[-1]
    assert len(repl.conversation.turns) == 2
    assert after.question == before.question
    assert after.stats["seed"] == 2 and after.stats["rebuilt"] is False
    assert after.stats["prompt_eval_tokens"] <= 20
    assert "seed = 2" in err.getvalue()  # (what a command did: stderr, stdout being piped)


@pytest.mark.daemon
def test_context_limit_drops_oldest_turns_and_says_so(tiny_model: Path):
    assert run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "256").returncode == 0
    repl, out, err = make_repl(tiny_model, temperature=0.0, max_tokens=40, n_ctx=256)
    long = "Please consider this rather long question about numbers " * 3
    for i in range(6):
        repl.ask(f"{i}: {long}")
    dropped = repl.conversation.dropped
    assert dropped > 0
    assert "oldest turn(s) were dropped" in err.getvalue()
    assert len(repl.conversation.turns) == 6, "the transcript keeps every turn"
    repl.command("/show")
    assert f"dropped      {dropped} oldest turn(s)" in out.getvalue()
    # A message that cannot fit even alone is refused, and the chat goes on.
    repl.ask("word " * 400)
    assert "shorten it" in err.getvalue()
    assert len(repl.conversation.turns) == 6


@pytest.mark.daemon
def test_reset_then_show_says_the_new_conversation_uses_no_context(tiny_model: Path):
    # Before: /show after /reset still said the old conversation's "N of 512 tokens used".
    assert run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "512").returncode == 0
    repl, out, err = make_repl(tiny_model, temperature=0.0, max_tokens=8, n_ctx=512)
    repl.ask("What is 12*13?")
    repl.command("/show")
    assert re.search(r"context +\d+ of 512 tokens used", out.getvalue())
    shown = len(out.getvalue())
    repl.command("/reset")
    assert "new conversation" in err.getvalue()
    repl.command("/stats")
    repl.command("/show")
    after = out.getvalue()[shown:]
    assert "no answer yet" in after
    assert re.search(r"context +512 tokens, unused", after), after
    assert "cached       0 tokens" in after


@pytest.mark.daemon
def test_daemon_killed_mid_chat_is_restarted_and_the_conversation_restored(tiny_model: Path):
    repl, _out, err = make_repl(tiny_model, temperature=0.0, max_tokens=6)
    repl.ask("What is 12*13?")
    status = json.loads(run_phi4("status", "--json").stdout)
    os.kill(status["pid"], signal.SIGKILL)
    repl.ask("And times two?")
    assert "restarting it and restoring the conversation" in err.getvalue()
    second = repl.conversation.turns[-1]
    assert second.question == "And times two?" and second.answer
    assert second.stats["rebuilt"] is True  # the transcript was evaluated once, afresh
    assert json.loads(run_phi4("status", "--json").stdout)["pid"] != status["pid"]
    repl.ask("And plus one?")
    assert repl.conversation.turns[-1].stats["rebuilt"] is False


@pytest.mark.daemon
def test_chat_from_a_pipe(tiny_model: Path, chats: ChatStore):
    result = run_phi4(
        "chat",
        "-m",
        str(tiny_model),
        "-t",
        "0",
        "-n",
        "5",
        input='What is 2+2?\n"""\nA question\non two lines\n"""\n/save piped\n/bye\n',
    )
    assert result.returncode == 0, result.stderr
    saved = chats.load("piped")
    assert [t.question for t in saved.turns] == ["What is 2+2?", "A question\non two lines"]
    assert result.stdout.startswith(saved.turns[0].answer)


@pytest.mark.daemon
def test_continue_and_resume_reopen_saved_conversations(tiny_model: Path, chats: ChatStore):
    first = run_phi4("chat", "-m", str(tiny_model), "-n", "3", input="hello\n/save older\n")
    second = run_phi4("chat", "-m", str(tiny_model), "-n", "3", input="hi\nthere\n/save newer\n")
    assert first.returncode == second.returncode == 0
    resumed = run_phi4("chat", "--resume", "older", input="/exit\n")
    # With stdout piped it holds answers only: what the chat did is on stderr.
    assert "resumed older: 1 turn\n" in resumed.stderr and resumed.stdout == ""
    continued = run_phi4("chat", "--continue", input="/exit\n")
    assert "resumed newer: 2 turns" in continued.stderr
    missing = run_phi4("chat", "--resume", "nope", input="")
    assert missing.returncode == 1 and "no saved conversation 'nope'" in missing.stderr


def test_slash_command_errors_keep_the_repl_going(tiny_model: Path):
    repl, out, err = make_repl(tiny_model)
    for line in (
        "/set temperature hot",
        "/set colour 3",
        "/frobnicate",
        "/reasoning maybe",
        "/load ../etc/passwd",
        "/retry",
        "/stats",
    ):
        assert repl.command(line) is True
    text = err.getvalue()
    assert "invalid temperature 'hot'" in text
    assert "usage: /set" in text
    assert "unknown command /frobnicate" in text
    assert "bad conversation name" in text
    assert "nothing to retry" in text
    assert "no answer yet" in out.getvalue()
    assert repl.command("/bye") is False
    # Ollama's word and a slip of the keys (issue 53): /clear is /reset, /sav names /save.
    assert repl.command("/clear") is True and "new conversation" in err.getvalue()
    assert repl.command("/sav") is True
    assert "unknown command /sav; did you mean /save? /help lists them" in err.getvalue()
    frobnicate = next(line for line in err.getvalue().splitlines() if "/frobnicate" in line)
    assert "did you mean" not in frobnicate  # (nothing close: no guess)


def test_help_completion_and_dispatch_come_from_one_table(tiny_model: Path):
    # Before: /bye and /quit were known to dispatch and (one of them) to completion only.
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document

    from phi4cli.client.chat_commands import COMMANDS
    from phi4cli.client.repl import SlashCompleter

    repl, out, _err = make_repl(tiny_model)
    assert repl.command("/help") is True
    shown = out.getvalue()
    assert all(command.name in shown for command in COMMANDS)

    def completes(text: str) -> list[str]:
        found = SlashCompleter().get_completions(Document(text), CompleteEvent())
        return [c.text for c in found]

    assert completes("/q") == ["/quit"] and completes("/b") == ["/bye"]
    assert sorted(completes("/")) == sorted(
        name for command in COMMANDS for name in (command.name, *command.aliases)
    )
    for leave in ("/exit", "/bye", "/quit"):
        assert make_repl(tiny_model)[0].command(leave) is False


@pytest.mark.daemon
def test_pty_ctrl_c_during_answer_then_save_exit_and_resume(tiny_model: Path):
    child = pexpect.spawn(
        PHI4,
        ["chat", "-m", str(tiny_model), "-n", "50000", "--n-ctx", "100000", "--verbose"],
        encoding="utf-8",
        dimensions=(24, 100),
        timeout=60,
    )
    child.expect_exact("phi4>")
    child.sendline("Count forever")
    time.sleep(1.5)  # let the answer stream for a while
    child.sendintr()
    child.expect_exact("the partial answer is kept")
    child.expect_exact("phi4>")
    child.sendline("/set max_tokens 4")
    child.expect_exact("max_tokens = 4")
    child.sendline("Say hi")
    child.expect_exact("prompt tokens")  # --verbose: the answer is complete
    child.expect_exact("phi4>")
    child.sendline("/save ptychat")
    child.expect_exact("saved as ptychat")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    resumed = pexpect.spawn(PHI4, ["chat", "--resume", "ptychat"], encoding="utf-8", timeout=60)
    resumed.expect_exact("resumed ptychat: 2 turns")
    resumed.expect_exact("phi4>")
    resumed.sendcontrol("d")
    resumed.expect(pexpect.EOF)
    resumed.close()
    assert resumed.exitstatus == 0
    saved = ChatStore(get_paths().data_dir / "chats").load("ptychat")
    assert saved.turns[0].interrupted and saved.turns[0].answer
    assert not saved.turns[1].interrupted


def test_read_message_joins_triple_quoted_blocks():
    def reader(lines: list[str]):  # type: ignore[no-untyped-def]
        feed = iter(lines)
        return lambda _prompt: next(feed, None)

    assert read_message(reader(['"""', "a", "b", '"""'])) == "a\nb"
    assert read_message(reader(['"""a', 'b"""'])) == "a\nb"
    assert read_message(reader(['"""one line"""'])) == "one line"
    assert read_message(reader(["plain"])) == "plain"
    assert read_message(reader([])) is None


def test_chat_store_round_trip_and_atomic_writes(tmp_path: Path):
    store = ChatStore(tmp_path)
    conversation = Conversation(name="c1", model="m", turns=[Turn("q", "a", stats={"x": 1})])
    path = store.save(conversation)
    assert store.load("c1") == conversation
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temp files left behind"
    assert store.names() == ["c1"]
    conversation.dropped = 1
    assert conversation.history() == []


def test_session_continues_only_its_own_history():
    session = ChatSession(
        id="s",
        model=Path("m"),
        system=None,
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        tokens=[1, 2, 3, 4],
        turn_ends={0: 4},
    )
    history = list(session.messages)
    assert session.continues(Path("m"), None, history) == 4
    assert session.continues(Path("other"), None, history) is None
    assert session.continues(Path("m"), "new system", history) is None
    assert (
        session.continues(Path("m"), None, [history[0], {"role": "assistant", "content": "b"}])
        is None
    )
    store = SessionStore(capacity=2)
    for name in "abc":
        store.put(ChatSession(id=name, model=Path("m"), system=None))
    assert store.get("a") is None and store.get("c") is not None and len(store) == 2


@pytest.mark.daemon
def test_bad_chat_requests_are_rejected(tiny_model: Path, phi4_home: Path):
    import socket

    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    bad = [
        {"message": "hi"},
        {"session": "s", "message": "  "},
        {"session": "s", "message": "hi", "history": [{"role": "assistant", "content": "x"}]},
        {"session": "s", "message": "hi", "history": [{"role": "user", "content": "x"}]},
    ]
    for params in bad:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(phi4_home / "run" / "daemon.sock"))
            sock.sendall(
                json.dumps({"v": 1, "id": 1, "op": "chat", "params": params}).encode() + b"\n"
            )
            event = json.loads(sock.makefile("rb").readline())
        assert event["event"] == "error" and event["code"] == "bad_request", (params, event)


@pytest.mark.daemon
def test_chat_never_leaves_a_daemon_of_its_own_after_stop(tiny_model: Path):
    proc = subprocess.run(
        [PHI4, "chat", "-m", str(tiny_model), "-n", "2"],
        input="hi\n",
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert run_phi4("stop").returncode == 0
    assert run_phi4("status").returncode == 3


def test_tab_completes_slash_commands_and_set_keys():
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document

    from phi4cli.client.repl import SlashCompleter

    def complete(text: str) -> list[str]:
        found = SlashCompleter().get_completions(Document(text), CompleteEvent())
        return [text[: len(text) + c.start_position] + c.text for c in found]

    assert complete("/sh") == ["/show"]
    assert complete("/s") == ["/system", "/set", "/show", "/save", "/stats"]
    assert complete("/set t") == [
        "/set temperature",
        "/set top_p",
        "/set think_budget",
        "/set top_k",
    ]
    assert complete("what is /sh") == []


@pytest.mark.daemon
def test_a_daemon_killed_mid_answer_costs_one_message_not_the_chat(tiny_model: Path):
    # Before: the chat ended with exit 3 when the daemon died while answering.
    repl, _out, err = make_repl(tiny_model, temperature=0.0, max_tokens=3000)
    repl.settings = repl.settings._replace(max_tokens=4)
    repl.ask("What is 12*13?")
    repl.settings = repl.settings._replace(max_tokens=3000)
    pid = json.loads(run_phi4("status", "--json").stdout)["pid"]
    opened = repl.backend.stream

    def killed_after_a_few_tokens(op: Any, params: Any) -> Any:
        stream = opened(op, params)
        for event in stream:
            if event.kind == "token":
                os.kill(pid, signal.SIGKILL)  # mid-answer, for sure
                break
        return stream

    repl.backend.stream = killed_after_a_few_tokens  # type: ignore[method-assign]
    repl.ask("Count to a thousand.")
    repl.backend.stream = opened  # type: ignore[method-assign]
    assert "this question is not kept" in err.getvalue()
    assert [t.question for t in repl.conversation.turns] == ["What is 12*13?"]
    repl.settings = repl.settings._replace(max_tokens=4)
    repl.ask("And now?")
    assert repl.conversation.turns[-1].question == "And now?"
    assert repl.failed == 1


def _chat_in_a_pty(model: Path, *args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        PHI4,
        ["chat", "-m", str(model), *args],
        encoding="utf-8",
        dimensions=(24, 100),
        timeout=120,
    )
    child.logfile_read = io.StringIO()
    child.expect_exact("phi4>")
    return child


STOPPED = ["stopped before the answer began", "the partial answer is kept"]


@pytest.mark.daemon
def test_pty_ctrl_c_right_after_enter_cancels_the_answer(tiny_model: Path):
    # Before: a Ctrl-C typed just after Enter was ignored (the answer streamed on) and arrived
    # at the next prompt as "press Ctrl-C again to leave".
    child = _chat_in_a_pty(tiny_model, "-n", "50000", "--n-ctx", "100000", "--verbose")
    child.send("Count forever\r")
    child.sendintr()  # at once: no waiting for any output
    child.expect_exact(STOPPED)
    child.expect_exact("phi4>")
    child.sendline("/set max_tokens 4")
    child.expect_exact("max_tokens = 4")
    child.expect_exact("phi4>")
    child.sendline("Say hi")
    child.expect_exact("prompt tokens")  # --verbose: the answer is complete
    child.expect_exact("phi4>")  # (keys typed before this prompt would be dropped)
    child.sendline("/show")
    child.expect_exact("max_tokens=4")
    child.expect_exact("phi4>")  # Ctrl-D before the prompt is up would be read as no key
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    transcript = child.logfile_read.getvalue()
    assert "press Ctrl-C again" not in transcript
    saved = ChatStore(get_paths().data_dir / "chats").load(
        ChatStore(get_paths().data_dir / "chats").names()[0]
    )
    assert [t.question for t in saved.turns][-1] == "Say hi"


@pytest.mark.daemon
def test_pty_keys_typed_during_an_answer_are_not_echoed(tiny_model: Path):
    child = _chat_in_a_pty(tiny_model, "-n", "50000", "--n-ctx", "100000")
    child.send("Count forever\r")
    child.send("zqxjk")  # typed ahead, as the answer begins
    child.expect(r"\S", timeout=120)  # the answer (or its status line) is on screen
    child.send("vwvwq")  # typed while it streams
    child.sendintr()
    child.expect_exact(STOPPED)
    child.expect_exact("phi4>")
    child.sendline("/show")  # neither typed word reaches the next prompt's line either
    child.expect_exact("max_tokens=50000")
    child.expect_exact("phi4>")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    transcript = child.logfile_read.getvalue()
    assert "zqxjk" not in transcript and "vwvwq" not in transcript
    assert child.exitstatus == 0


@pytest.mark.daemon
def test_a_ctrl_c_while_the_answer_is_drawn_stops_it_cleanly(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
):
    # Before: a Ctrl-C that landed inside rich starting its live display left it half started,
    # and stopping it failed: "internal error: IndexError: pop from empty list".
    from rich.console import Console

    repl, _out, err = make_repl(tiny_model, temperature=0.0, max_tokens=3000)
    repl.env.stdout_isatty = repl.env.colour = True  # the terminal view, with its live display
    set_live = Console.set_live

    def interrupted_while_starting(console: Console, live: Any) -> bool:
        os.kill(os.getpid(), signal.SIGINT)  # delivered here, in the middle of Live.start
        return set_live(console, live)

    monkeypatch.setattr(Console, "set_live", interrupted_while_starting)
    repl.interrupts.install()
    try:
        repl.ask("Count forever")
    finally:
        repl.interrupts.uninstall()
    assert "the partial answer is kept" in err.getvalue()
    assert repl.conversation.turns[-1].interrupted
    assert repl.failed == 0


@pytest.mark.daemon
def test_chat_replies_without_a_boxed_answer_are_not_nagged(tiny_model: Path):
    # Before: at a terminal every casual reply ended in "no final answer stated".
    child = _chat_in_a_pty(tiny_model, "-n", "3", "--verbose")
    child.sendline("Say hi")
    child.expect_exact("prompt tokens")  # --verbose: the answer is complete
    child.expect_exact("phi4>")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    saved = ChatStore(get_paths().data_dir / "chats")
    assert saved.load(saved.names()[0]).turns[0].answer.strip()
    assert "final answer" not in child.logfile_read.getvalue()


@pytest.mark.daemon
def test_chat_says_when_thinking_ran_out_naming_the_chat_setting(tiny_reasoning_model: Path):
    result = run_phi4("chat", "-m", str(tiny_reasoning_model), "-n", "4", input="Think hard\n")
    assert result.returncode == 1, "the message got no answer (README: exit 1, as solve)"
    assert "the thinking did not finish" in result.stderr
    assert "/set max_tokens N" in result.stderr and "--max-tokens" not in result.stderr


@pytest.mark.daemon
def test_chat_error_hints_name_set_not_command_line_options(tiny_model: Path):
    # The daemon's context-overflow message says "lower --max-tokens"; in a chat it is /set.
    result = run_phi4(
        "chat", "-m", str(tiny_model), "--n-ctx", "128", "-n", "5000", input="hi\n/exit\n"
    )
    assert result.returncode == 1
    assert "lower max_tokens" in result.stderr and "/set max_tokens N" in result.stderr
    assert "--max-tokens" not in result.stderr


@pytest.mark.daemon
def test_chat_has_no_options_of_votes_it_would_ignore():
    # Before: `chat --vote confidence --stop-unsure` was taken and did nothing (their help says
    # "With --samples", which chat has not).
    for option in (["--vote", "count"], ["--stop-unsure"]):
        refused = run_phi4("chat", *option, input="")
        assert refused.returncode == 2 and f"no such option: {option[0]}" in refused.stderr
