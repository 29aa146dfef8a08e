"""Saved KV states (swapped-out chats, the system prompt's): a damaged, foreign or planted file is
refused before llama.cpp reads a byte of it, removed with one log line, and the work it would
have saved is recomputed — the daemon stays up and every answer is what it would have been."""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from phi4cli.daemon import statefile
from phi4cli.daemon.statefile import StateDirError, StateFileError
from tests.conftest import both_kv_layouts, run_phi4

IDENTITY = {
    "model_path": "/m/a.gguf",
    "model_bytes": 1234,
    "n_ctx": 1024,
    "kv_layout": "shared",
    "slots": 4,
    "flash_attn": "auto",
}
TOKENS = [1, 32010, 450, 29871, 7]
PAYLOAD = bytes(range(256)) * 40


def _file(
    identity: dict[str, Any] = IDENTITY, tokens: list[int] = TOKENS, payload: bytes = PAYLOAD
) -> bytes:
    return statefile.encode_header(identity, tokens, payload) + payload


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x10]) + data[index + 1 :]


def _header_end(data: bytes) -> int:
    """Where a state file's header ends (its CRC follows)."""
    return 16 + int.from_bytes(data[12:16], "little")


def _rewrite_header(data: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    """The same file, of the same size, with its header changed and its header CRC made right
    again: only the deeper checks can tell."""
    end = _header_end(data)
    header = json.loads(data[16:end])
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (end - 16 - len(raw))  # JSON may end in blanks
    return (
        data[:12]
        + len(raw).to_bytes(4, "little")
        + raw
        + zlib.crc32(raw).to_bytes(4, "little")
        + data[end + 4 :]
    )


def _other_model(header: dict[str, Any]) -> None:
    header["identity"]["model_bytes"] += 1


def _other_layout(header: dict[str, Any]) -> None:
    identity = header["identity"]
    identity["slots"] += 1
    identity["kv_layout"] = "shared" if identity["kv_layout"] == "streams" else "streams"


def _longer_payload(header: dict[str, Any]) -> None:
    header["payload_bytes"] += 1


# name, damage done to a good state file, what the refusal says
DAMAGES: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("empty", lambda d: b"", "too short"),
    ("half", lambda d: d[: len(d) // 2], "bytes where its header says"),
    ("header_only", lambda d: d[: _header_end(d) + 4], "bytes where its header says"),
    ("one_byte_short", lambda d: d[:-1], "bytes where its header says"),
    ("one_byte_more", lambda d: d + b"\0", "bytes"),
    ("cut_in_header", lambda d: d[:20], "truncated in its header"),
    ("flipped_magic", lambda d: _flip(d, 2), "wrong magic"),
    ("flipped_header", lambda d: _flip(d, 30), "header checksum"),
    ("flipped_token", lambda d: _flip(d, _header_end(d) + 6), "tokens checksum"),
    ("flipped_payload", lambda d: _flip(d, len(d) - 100), "payload checksum"),
    ("wrong_payload_length", lambda d: _rewrite_header(d, _longer_payload), "header says"),
    ("other_model", lambda d: _rewrite_header(d, _other_model), "made for another model_bytes"),
    ("other_layout", lambda d: _rewrite_header(d, _other_layout), "made for another kv_layout"),
]


def test_a_state_file_round_trips_its_payload_exactly():
    payload = statefile.decode(_file(), IDENTITY, TOKENS)
    assert bytes(payload) == PAYLOAD


@pytest.mark.parametrize(
    ("damage", "reason"), [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES]
)
def test_every_damage_to_a_state_file_is_refused_with_its_reason(
    damage: Callable[[bytes], bytes], reason: str
):
    # (one_byte_more: the reader refuses it by size first; decode by the header's length)
    with pytest.raises(StateFileError, match=reason):
        statefile.decode(damage(_file()), IDENTITY, TOKENS)


def test_a_state_file_of_other_tokens_or_another_version_is_refused():
    with pytest.raises(StateFileError, match="holds 5 tokens, not the 4"):
        statefile.decode(_file(), IDENTITY, TOKENS[:4])
    with pytest.raises(StateFileError, match="other tokens"):
        statefile.decode(_file(), IDENTITY, [*TOKENS[:4], 8])
    with pytest.raises(StateFileError, match="made for another n_ctx"):
        statefile.decode(_file(), {**IDENTITY, "n_ctx": 2048}, TOKENS)
    with pytest.raises(StateFileError, match="made for another llama_build"):
        statefile.decode(_file(), {**IDENTITY, "llama_build": "libllama.so:1:2"}, TOKENS)
    newer = bytearray(_file())
    newer[8:12] = (statefile.FORMAT_VERSION + 1).to_bytes(4, "little")
    with pytest.raises(StateFileError, match="format version"):
        statefile.decode(bytes(newer), IDENTITY, TOKENS)
    huge = bytearray(_file())
    huge[12:16] = (1 << 31).to_bytes(4, "little")
    with pytest.raises(StateFileError, match="header length"):
        statefile.decode(bytes(huge), IDENTITY, TOKENS)
    not_json = _rewrite_header(_file(), lambda h: None)
    end = _header_end(not_json)
    raw = b"[" + not_json[17:end]
    with pytest.raises(StateFileError, match="not JSON"):
        statefile.decode(
            not_json[:16] + raw + zlib.crc32(raw).to_bytes(4, "little") + not_json[end + 4 :],
            IDENTITY,
            TOKENS,
        )
    for field, bad in (("payload_bytes", -1), ("n_tokens", "5"), ("payload_crc32", True)):
        forged = _rewrite_header(_file(), lambda h, f=field, b=bad: h.__setitem__(f, b))
        with pytest.raises(StateFileError, match=f"{field} is not a count"):
            statefile.decode(forged, IDENTITY, TOKENS)


def test_state_files_are_written_private_and_read_only_when_regular_and_ours(tmp_path: Path):
    directory = tmp_path / "sessions"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    path = directory / "session-a.state"
    size = statefile.write_state(path, IDENTITY, TOKENS, PAYLOAD)
    assert size == path.stat().st_size == len(_file())
    assert path.stat().st_mode & 0o777 == 0o600
    assert directory.stat().st_mode & 0o777 == 0o700, "group and other access is taken back"
    assert not [p for p in directory.iterdir() if p != path], "no temp file is left"
    assert bytes(statefile.read_state(path, IDENTITY, TOKENS, size)) == PAYLOAD
    with pytest.raises(StateFileError, match="over the"):
        statefile.read_state(path, IDENTITY, TOKENS, size - 1)

    link = directory / "session-link.state"
    link.symlink_to(path)
    fifo = directory / "session-fifo.state"
    os.mkfifo(fifo)
    folder = directory / "session-dir.state"
    folder.mkdir()
    with pytest.raises(StateFileError, match="cannot open"):
        statefile.read_state(link, IDENTITY, TOKENS, size)  # even to a good file: not followed
    for planted in (fifo, folder):  # a FIFO with no writer: refused at once, not waited on
        with pytest.raises(StateFileError, match="not a regular file"):
            statefile.read_state(planted, IDENTITY, TOKENS, size)
    with pytest.raises(FileNotFoundError):
        statefile.read_state(directory / "none.state", IDENTITY, TOKENS, size)
    for planted in (link, fifo, folder):
        statefile.remove_state(planted)
        assert not os.path.lexists(planted)
    assert path.exists(), "removing a link leaves its target"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked_dir = tmp_path / "linked"
    linked_dir.symlink_to(elsewhere)
    with pytest.raises(StateDirError, match="not a directory"):
        statefile.write_state(linked_dir / "session-b.state", IDENTITY, TOKENS, PAYLOAD)
    assert not list(elsewhere.iterdir()), "nothing is written through a linked directory"
    os.replace(path, elsewhere / path.name)
    with pytest.raises(StateDirError, match="not a directory"):  # nor read through one
        statefile.read_state(linked_dir / path.name, IDENTITY, TOKENS, size)


# --- the real daemon ------------------------------------------------------------------------


def _turn(
    connection: Any, message: str, history: list[dict[str, str]], max_tokens: int
) -> tuple[str, dict[str, Any]]:
    """One turn of chat "c" over the protocol: return (answer text, stats)."""
    request = {
        "session": "c",
        "message": message,
        "history": history,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    events = list(connection.request("chat", request))
    assert events[-1].kind == "done", events[-1]
    text = "".join(e.text for e in events if e.kind == "token")
    return text, next(e.stats.to_dict() for e in events if e.kind == "stats")


def _solve(connection: Any, max_tokens: int) -> dict[str, Any]:
    """A greedy solve to its last token: return its stats (an error or a cut fails the test)."""
    events = list(
        connection.request(
            "solve", {"prompt": "What is 2+2?", "temperature": 0, "max_tokens": max_tokens}
        )
    )
    assert events[-1].kind == "done", events[-1]
    return next(e.stats.to_dict() for e in events if e.kind == "stats")


def _evict_chat(socket_path: Path) -> None:
    """Admit a solve that needs nearly every cell, so the idle chat is swapped out to disk,
    and hang up once it answers (which cancels it)."""
    from phi4cli.backends.daemon_link import DaemonConnection

    with DaemonConnection.open(socket_path) as connection:
        for event in connection.request(
            "solve", {"prompt": "Go on.", "temperature": 0, "max_tokens": 900}
        ):
            if event.kind == "token" or event.terminal:
                break


def _plant_fifo(path: Path, good: bytes) -> None:
    path.unlink()
    os.mkfifo(path)


def _plant_symlink(path: Path, good: bytes) -> None:
    target = path.with_name("elsewhere.bin")
    target.write_bytes(good)  # a good state, behind a link: still refused
    path.unlink()
    path.symlink_to(target)


def _plant_directory(path: Path, good: bytes) -> None:
    path.unlink()
    path.mkdir()


CHAT_DAMAGES: list[tuple[str, Callable[[Path, bytes], None], str]] = [
    *(
        (name, lambda p, d, f=damage: p.write_bytes(f(d)), reason)
        for name, damage, reason in DAMAGES
    ),
    ("fifo", _plant_fifo, "not a regular file"),
    ("symlink", _plant_symlink, "cannot open"),
    ("directory", _plant_directory, "not a regular file"),
]


@both_kv_layouts
@pytest.mark.daemon
def test_a_damaged_swapped_chat_is_re_read_and_the_daemon_answers_everyone(
    tiny_model: Path, phi4_home: Path, layout: tuple[str, ...]
):
    from phi4cli.backends.daemon_link import DaemonConnection

    started = run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "1024", *layout)
    assert started.returncode == 0, started.stderr
    socket_path = phi4_home / "run" / "daemon.sock"
    log = phi4_home / "state" / "daemon.log"
    with DaemonConnection.open(socket_path) as chat, DaemonConnection.open(socket_path) as other:
        pid = chat.call("status").result["pid"]
        first, _ = _turn(chat, "Count to ten.", [], 200)
        history = [
            {"role": "user", "content": "Count to ten."},
            {"role": "assistant", "content": first},
        ]
        second, _ = _turn(chat, "And back?", history, 40)  # from the conversation's cells

        # A good file restores (the checks pass what phi4 wrote), and answers the same.
        _evict_chat(socket_path)
        (state,) = (phi4_home / "cache" / "sessions").glob("session-*.state")
        assert state.stat().st_mode & 0o777 == 0o600
        again, stats = _turn(chat, "And back?", history, 40)
        assert stats["restored_tokens"] > 0 and again == second

        lines: list[str] = []
        for name, damage, reason in CHAT_DAMAGES:
            _evict_chat(socket_path)
            assert state.is_file(), f"{name}: the chat was swapped out"
            damage(state, state.read_bytes())
            answers: list[dict[str, Any]] = []
            concurrent = threading.Thread(target=lambda out=answers: out.append(_solve(other, 60)))
            concurrent.start()
            again, stats = _turn(chat, "And back?", history, 40)
            concurrent.join(timeout=300)
            assert stats["restored_tokens"] == 0, f"{name}: the conversation is re-read"
            assert again == second, f"{name}: the answer is as if nothing was swapped"
            # Whole: answered to its last token. (Not compared token for token: a greedy answer
            # decoded beside another prompt's prefill may differ in its last digits, and so
            # in its words, damaged file or not.)
            assert [(a["finish_reason"], a["completion_tokens"]) for a in answers] == [
                ("length", 60)
            ], f"{name}: the other client's answer is intact"
            logged = log.read_text().splitlines()
            lines = [line for line in logged if "removed unusable saved state" in line]
            assert reason in lines[-1], (name, lines[-1:])
            # (With one stream, the other client's solve may swap the chat out again: a new file.)
            swapped_again = any(
                "swapped session c out" in line for line in logged[logged.index(lines[-1]) :]
            )
            assert swapped_again or not os.path.lexists(state), f"{name}: the bad file is removed"
        assert chat.call("status").result["pid"] == pid, "the daemon never went down"
    assert len(lines) == len(CHAT_DAMAGES), "one log line for each bad file"
    assert run_phi4("stop").returncode == 0


@pytest.mark.daemon
def test_a_damaged_saved_system_prompt_state_is_recomputed_at_the_next_start(
    tiny_model: Path, tiny_reasoning_model: Path, phi4_home: Path
):
    states = phi4_home / "cache" / "states"
    log = phi4_home / "state" / "daemon.log"

    def warm(model: Path, *options: str) -> dict[str, Any]:
        warmed = run_phi4("warm", "-m", str(model), "--n-ctx", "1024", "--json", *options)
        assert warmed.returncode == 0, warmed.stderr
        return dict(json.loads(warmed.stdout))

    def solve() -> str:
        solved = run_phi4("solve", "What is 12*13?", "-m", str(tiny_model), "-t", "0", "-n", "30")
        assert solved.returncode == 0, solved.stderr
        return solved.stdout

    def stop() -> None:
        assert run_phi4("stop").returncode == 0

    # Real states of another model, and of this model in the other KV layout.
    foreign = {}
    streams = ("--kv-layout", "streams")
    for name, model, options in (
        ("other_model", tiny_reasoning_model, ()),
        ("other_layout", tiny_model, streams),
    ):
        assert warm(model, *options)["prefill"] == "computed"
        stop()
        (made,) = states.glob("system-*.state")
        foreign[name] = made.read_bytes()
        made.unlink()
    assert warm(tiny_model)["prefill"] == "computed"
    reference = solve()
    stop()
    (state,) = states.glob("system-*.state")
    good = state.read_bytes()
    damages: list[tuple[str, bytes, str]] = [
        ("half", good[: len(good) // 2], "bytes where its header says"),
        ("one_byte_short", good[:-1], "bytes where its header says"),
        ("flipped_magic", _flip(good, 2), "wrong magic"),
        ("flipped_payload", _flip(good, len(good) - 100), "payload checksum"),
        ("other_model", foreign["other_model"], "made for another"),
        ("other_layout", foreign["other_layout"], "made for another kv_layout"),
        ("empty", b"", "too short"),
    ]
    for name, damaged, reason in damages:
        state.write_bytes(damaged)
        assert warm(tiny_model)["prefill"] == "computed", f"{name}: recomputed at start"
        assert solve() == reference, f"{name}: the answer is as if the state were good"
        stop()
        lines = [
            line
            for line in log.read_text().splitlines()
            if f"removed unusable saved state {state}" in line
        ]
        assert reason in lines[-1], (name, lines[-1:])
        assert state.read_bytes() != damaged, f"{name}: a good state is saved in its place"
    assert len(lines) == len(damages)
    assert warm(tiny_model)["prefill"] == "restored", "the state saved last is good"
    assert solve() == reference


@pytest.mark.daemon
def test_whatever_is_planted_among_swapped_chats_a_daemon_starts_and_clears_it(
    tiny_model: Path, phi4_home: Path
):
    sessions = phi4_home / "cache" / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "session-full.state").mkdir()
    (sessions / "session-full.state" / "x").write_bytes(b"x")
    os.mkfifo(sessions / "session-fifo.state")
    (sessions / "session-link.state").symlink_to(tiny_model)
    (sessions / ".session-left.state.tmp").write_bytes(b"half a state")
    states = phi4_home / "cache" / "states"
    states.mkdir(parents=True)
    (states / ".system-left.state.tmp").write_bytes(b"half a state")
    solved = run_phi4("solve", "What is 2+2?", "-m", str(tiny_model), "-t", "0", "-n", "8")
    assert solved.returncode == 0, solved.stderr
    assert [p.name for p in sessions.iterdir()] == ["session-full.state"], "a full dir stays"
    assert tiny_model.is_file(), "a link is removed, not its target"
    assert [p.name for p in states.iterdir()] == [next(states.glob("system-*.state")).name], (
        "a killed daemon's temp file is removed; the computed state is saved"
    )


@pytest.mark.daemon
def test_a_real_models_damaged_chat_state_is_re_read(smollm2_model: Path, phi4_home: Path):
    # SmolLM2's states are megabytes of real KV: half of one, or one flipped bit in it, used to
    # abort the daemon or to continue the chat from garbage cells.
    from phi4cli.backends.daemon_link import DaemonConnection

    started = run_phi4("daemon", "start", "-m", str(smollm2_model), "--n-ctx", "1024")
    assert started.returncode == 0, started.stderr
    socket_path = phi4_home / "run" / "daemon.sock"
    sessions = phi4_home / "cache" / "sessions"
    with DaemonConnection.open(socket_path) as chat:
        pid = chat.call("status").result["pid"]
        first, _ = _turn(chat, "Write a long story about a cat.", [], 100)
        history = [
            {"role": "user", "content": "Write a long story about a cat."},
            {"role": "assistant", "content": first},
        ]
        second, _ = _turn(chat, "Go on.", history, 20)
        for name, damage in (
            ("half", lambda d: d[: len(d) // 2]),
            ("flipped_payload", lambda d: _flip(d, len(d) // 2)),
        ):
            _evict_chat(socket_path)
            (state,) = sessions.glob("session-*.state")
            assert state.stat().st_size > 1 << 20, "a real state: megabytes"
            state.write_bytes(damage(state.read_bytes()))
            again, stats = _turn(chat, "Go on.", history, 20)
            assert stats["restored_tokens"] == 0, name
            assert again == second, f"{name}: the answer is as if nothing was swapped"
        assert chat.call("status").result["pid"] == pid, "the daemon never went down"
    assert run_phi4("stop").returncode == 0
