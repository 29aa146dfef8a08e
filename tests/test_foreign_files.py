"""Files phi4 writes and reads as this user's (results, config, chats, input history) are reached
along a path no other user can change, and are refused, in one line, when another user owns
them or can write them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from phi4cli.client.chats import ChatStore, Conversation
from phi4cli.client.repl import AtomicFileHistory
from phi4cli.core.atomicfile import RefusedFileError, open_user_file, write_atomic
from phi4cli.core.paths import get_paths
from tests.conftest import run_phi4
from tests.scripted_server import Step, scripted_server, separated
from tests.test_eval_files import NOBODY, _as_nobody, shared_dir  # noqa: F401 (a fixture)

as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second user")

# As nobody: swap ``box`` (a directory) and ``alt`` (a link to the victim's directory) with
# renameat2(RENAME_EXCHANGE) as fast as it can, so that ``box`` always exists, as either.
_SWAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
os.mkdir("box")
os.symlink(sys.argv[2], "alt")
print("ready", flush=True)
while True:
    if libc.renameat2(-100, b"box", -100, b"alt", 2) != 0:
        sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
    time.sleep(0.0005)
"""


def _boxed_one(_body: dict[str, Any]) -> list[str | Step]:
    return separated("reasoning_content", ["Think."], ["$\\boxed{1}$"])


@pytest.fixture
def swapping(shared_dir: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:  # noqa: F811
    """``shared_dir/box``, a directory of nobody's that is swapped for a link to the victim's
    own directory and back all the time, and that victim directory."""
    victim = tmp_path / "victim"
    victim.mkdir()
    racer = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-c",
            _SWAPPER,
            str(shared_dir),
            str(victim),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert racer.stdout is not None and racer.stdout.readline() == "ready\n"
        yield shared_dir / "box", victim
        assert racer.poll() is None, "the swapper stopped"
    finally:
        racer.kill()
        racer.wait()


@as_root
@pytest.mark.daemon
def test_a_results_directory_another_user_swaps_for_a_link_gets_no_results_file_outside(
    swapping: tuple[Path, Path], tmp_path: Path
):
    # Before: the last component was opened with O_NOFOLLOW, but the directory above it was
    # followed as the kernel found it: about half of the results files landed in `victim`.
    box, victim = swapping
    problems = tmp_path / "quiz.jsonl"
    problems.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    with scripted_server(_boxed_one) as server:
        command = ["eval", str(problems), "--backend", server.url, "-m", "m", "--json", "-o"]
        results = [run_phi4(*command, str(box / f"out-{run}.jsonl")) for run in range(20)]
        asked = len(server.bodies)
    landed = sorted(path.name for path in victim.iterdir())
    assert landed == [], f"{len(landed)} of 20 results files landed in the victim's directory"
    assert asked == 0, "nothing is solved for a results file that cannot be written"
    for run, result in enumerate(results):
        assert result.returncode == 1, (run, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        said = (
            f"phi4: error: {box} belongs to uid {NOBODY}, not you",
            f"phi4: error: {box} is a symbolic link of uid {NOBODY}'s",
        )
        assert lines[0].startswith(said), lines[0]
        assert f"could change what the results file {box}/out-{run}.jsonl is" in lines[0]
        assert lines[0].endswith("phi4 will not create it there: use a directory of yours")


@as_root
@pytest.mark.parametrize("planted", ["their file in a directory of yours", "their directory"])
@pytest.mark.daemon
def test_a_config_of_another_user_is_refused_and_its_backend_never_asked(
    planted: str, phi4_home: Path
):
    # Before: the config was read without a word and the question went to its backend.
    phi4_home.chmod(0o755)  # nobody may look in, not write
    config_dir = phi4_home / "config"
    config = config_dir / "config.toml"
    with scripted_server(_boxed_one) as server:
        text = f'backend = "{server.url}"\nmodel = "m"\n'
        if planted == "their directory":
            config_dir.mkdir(mode=0o755)
            os.chown(config_dir, NOBODY, NOBODY)
            said = f"{config_dir} belongs to uid {NOBODY}, not you, so another user could change"
        else:
            config_dir.mkdir()
            config_dir.chmod(0o1777)  # sticky, yours: anyone may add a file, none may move yours
            said = (
                f"the config file {config} belongs to uid {NOBODY}, not you; phi4 will not read "
                "it: remove it if you did not put it there, or chown it to yourself"
            )
        _as_nobody("sh", "-c", 'umask 022; printf %s "$1" > "$2"', "sh", text, str(config))
        result = run_phi4("solve", "What is my password?")
        assert server.bodies == [], "the question went to the planted config's backend"
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr


def _others_can_write(path: Path, how: str) -> str:
    """Make ``path`` writable by others ``how``; return what the refusal says of it."""
    if how == "world":
        path.chmod(0o666)
        return "is writable by other users (mode 666)"
    if os.getuid() != 0:
        pytest.skip("needs root to give a file to a group of other users")
    os.chown(path, 0, NOBODY)  # nogroup: nobody's own group, and not yours
    path.chmod(0o660)
    return "is writable by group nogroup, not only by you (mode 660)"


@pytest.mark.parametrize("how", ["world", "group"])
@pytest.mark.daemon
def test_a_config_others_can_write_is_refused_in_one_line(how: str):
    # Before: a config.toml of mode 666 (or group-writable by others) was read without a word.
    config = get_paths().config_file
    config.parent.mkdir(parents=True)
    config.write_text('temperature = 0.5\nbackend = "http://127.0.0.1:9/v1"\n')
    said = _others_can_write(config, how)
    result = run_phi4("config", "show")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"phi4: error: the config file {config} {said}; phi4 will not read it: chmod go-w it"
    ]
    config.chmod(0o644)
    os.chown(config, os.getuid(), os.getgid())
    fixed = run_phi4("config", "show")
    assert fixed.returncode == 0 and "0.5" in fixed.stdout, fixed.stderr


@pytest.mark.parametrize("how", ["world", "group"])
@pytest.mark.daemon
def test_a_chat_or_input_history_others_can_write_is_refused_in_one_line(
    how: str, tiny_model: Path
):
    # Before: a saved chat or the input history that anyone could have written was loaded: its
    # turns sent to the model as the user's own, its entries offered as what the user typed.
    paths = get_paths()
    store = ChatStore(paths.data_dir / "chats")
    chat = store.save(Conversation(name="mine", model=str(tiny_model)))
    history_file = paths.state_dir / "chat_history"
    write_atomic(history_file, b"\n# phi4\n+What is 1+1?\n")
    assert list(AtomicFileHistory(history_file).load_history_strings()) == ["What is 1+1?"]
    for path, open_it in (
        (chat, lambda: store.load("mine")),
        (history_file, lambda: AtomicFileHistory(history_file)),
    ):
        said = _others_can_write(path, how)
        with pytest.raises(RefusedFileError) as refused:
            open_it()
        message = str(refused.value)
        assert f" {path} {said}; phi4 will not read it: chmod go-w it" in message
        assert "\n" not in message
    result = run_phi4("chat", "--resume", "mine", "-m", str(tiny_model), input="/exit\n")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"phi4: error: the conversation {chat} {_said(how)}; phi4 will not read it: chmod go-w it"
    ]


def _said(how: str) -> str:
    if how == "world":
        return "is writable by other users (mode 666)"
    return "is writable by group nogroup, not only by you (mode 660)"


def test_directories_others_can_change_are_refused_and_yours_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A directory of yours that anyone may write to, not sticky: anyone could swap what is in
    # it. Sticky (as /tmp), only a name's owner may move it: a fresh file of yours is safe there.
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    (tmp_path / "sticky").mkdir()
    (tmp_path / "sticky").chmod(0o1777)
    with pytest.raises(RefusedFileError) as refused:
        open_user_file(tmp_path / "open" / "deeper" / "out.jsonl", "results file")
    assert str(refused.value) == (
        f"{tmp_path}/open is writable by other users (mode 777), so another user could change "
        f"what the results file {tmp_path}/open/deeper/out.jsonl is; phi4 will not create it "
        f"there: chmod go-w {tmp_path}/open, or use a directory of yours"
    )
    assert not (tmp_path / "open" / "deeper").exists()
    with pytest.raises(RefusedFileError, match="open is writable by other users"):
        write_atomic(tmp_path / "open" / "chat.json", b"{}")
    with open_user_file(tmp_path / "sticky" / "out.jsonl", "results file") as handle:
        handle.write(b"ok\n")
    from phi4cli.core.atomicfile import read_user_file

    # A link of yours on the way is followed (a config kept with your dotfiles), and the walk
    # goes where the kernel's would: "..", relative links, a relative path.
    (tmp_path / "dotfiles" / "phi4").mkdir(parents=True)
    (tmp_path / "dotfiles" / "phi4" / "config.toml").write_text("seed = 1\n")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").symlink_to("../dotfiles/phi4/../phi4/config.toml")
    assert read_user_file(tmp_path / "home" / "config.toml", "config file") == b"seed = 1\n"
    monkeypatch.chdir(tmp_path / "home")
    assert read_user_file(Path("../home/./config.toml"), "config file") == b"seed = 1\n"
    with pytest.raises(FileNotFoundError):
        read_user_file(tmp_path / "home" / "none.toml", "config file")
