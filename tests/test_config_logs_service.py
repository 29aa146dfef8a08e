"""`phi4 config`, `phi4 logs` (and log rotation), `phi4 daemon install-service`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from phi4cli.backends.spawn import LOG_MAX_BYTES, rotate_log
from tests.conftest import PHI4, run_phi4


@pytest.mark.daemon
def test_config_set_show_path_and_validation(phi4_home: Path):
    path = Path(run_phi4("config", "path").stdout.strip())
    assert path == phi4_home / "config" / "config.toml"
    assert run_phi4("config", "set", "temperature", "0.3").returncode == 0
    assert "keep_alive = 10m" in run_phi4("config", "set", "keep_alive", "10m").stdout
    assert path.read_text() == 'temperature = 0.3\nkeep_alive = "10m"\n'
    bad_value = run_phi4("config", "set", "top_p", "7")
    assert bad_value.returncode == 2
    assert "invalid top_p '7': expected a number from 0 to 1" in bad_value.stderr
    bad_key = run_phi4("config", "set", "colour", "red")
    assert bad_key.returncode == 2 and "unknown key 'colour'" in bad_key.stderr
    shown = json.loads(run_phi4("config", "show", "--json", env={"PHI4_SEED": "7"}).stdout)
    assert shown["temperature"] == {"value": 0.3, "source": str(path)}
    assert shown["seed"] == {"value": 7, "source": "PHI4_SEED"}
    assert shown["n_ctx"]["source"] == "default"
    table = run_phi4("config", "show").stdout
    assert re.search(r"^n_ctx +auto +default$", table, re.M), "unset n_ctx reads as auto"
    assert re.search(r"^max_tokens +none +default$", table, re.M)
    assert run_phi4("config", "set", "temperature", "none").returncode == 2, "not optional"
    assert run_phi4("config", "set", "seed", "5").returncode == 0
    cleared = run_phi4("config", "set", "seed", "random")
    assert cleared.returncode == 0 and cleared.stdout.startswith("seed = random ("), cleared.stdout
    assert run_phi4("config", "set", "threads", "auto").stdout.startswith("threads = auto (")
    assert run_phi4("config", "set", "mlock", "yes").stdout.startswith("mlock = true (")
    assert "seed" not in path.read_text()


@pytest.mark.daemon
def test_config_set_keeps_the_files_comments_and_order(phi4_home: Path, tmp_path: Path):
    # Before: `config set` wrote the file afresh, sorted, its comments gone.
    path = Path(run_phi4("config", "path").stdout.strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# my settings\ntemperature = 0.6   # a little less random\n\n"
        '# the daemon\nkeep_alive = "1h"\n'
    )
    assert run_phi4("config", "set", "temperature", "0.3").returncode == 0
    assert run_phi4("config", "set", "seed", "5").returncode == 0
    assert path.read_text() == (
        "# my settings\ntemperature = 0.3   # a little less random\n\n"
        '# the daemon\nkeep_alive = "1h"\nseed = 5\n'
    )
    assert run_phi4("config", "set", "seed", "random").returncode == 0
    kept = (
        "# my settings\ntemperature = 0.3   # a little less random\n\n# the daemon\n"
        'keep_alive = "1h"\n'
    )
    assert path.read_text() == kept
    # A value over several lines is not one line to change: the file is written afresh.
    path.write_text('# replicas\nbackends = [\n  "http://a:1/v1",\n  "http://b:2/v1",\n]\n')
    assert run_phi4("config", "set", "backend", "http://c:3/v1").returncode == 0
    assert path.read_text() == 'backend = "http://c:3/v1"\n'
    # Replicas: the URLs as parsed (once), written as a list.
    assert run_phi4("config", "set", "backend", "http://c:3/v1, http://d:4/v1").returncode == 0
    assert path.read_text() == 'backend = ["http://c:3/v1", "http://d:4/v1"]\n'


@pytest.mark.daemon
def test_config_unset_removes_one_key_and_says_what_it_is_now(phi4_home: Path):
    # Before: no way back to a default but editing the file (`set KEY none` only clears an
    # optional key; `set temperature default` is refused).
    path = Path(run_phi4("config", "path").stdout.strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# mine\ntemperature = 0.3  # calmer\ntop_p = 0.9\n")
    removed = run_phi4("config", "unset", "temperature")
    assert (removed.returncode, removed.stdout) == (
        0,
        f"temperature removed from {path}; temperature = 0.8 (default)\n",
    )
    assert path.read_text() == "# mine\ntop_p = 0.9\n", "the rest of the file as it was"
    again = run_phi4("config", "unset", "temperature")
    assert (again.returncode, again.stdout) == (
        0,
        f"temperature is not set in {path}; temperature = 0.8 (default)\n",
    )
    from_env = run_phi4("config", "unset", "top_p", env={"PHI4_TOP_P": "0.5"})
    assert from_env.stdout.endswith("; top_p = 0.5 (PHI4_TOP_P)\n"), from_env.stdout
    unknown = run_phi4("config", "unset", "colour")
    assert unknown.returncode == 2 and "unknown key 'colour'" in unknown.stderr
    assert path.read_text() == "# mine\n"
    # `backends`, the plural the docs' example file uses, is the same key for set and unset.
    assert run_phi4("config", "set", "backends", "http://a:1/v1 http://b:2/v1").returncode == 0
    assert run_phi4("config", "unset", "backends").stdout.startswith("backend removed from")
    assert path.read_text() == "# mine\n"
    # A value the environment overrides is written, and said not to be the one in effect.
    overridden = run_phi4("config", "set", "temperature", "0.2", env={"PHI4_TEMPERATURE": "0.5"})
    assert overridden.stdout == (
        f"temperature = 0.2 ({path}); PHI4_TEMPERATURE=0.5 overrides it here\n"
    )


@pytest.mark.daemon
def test_config_set_model_checks_the_file_but_not_an_alias(tmp_path: Path):
    # Before: any path was written, and every later command failed on it.
    missing = run_phi4("config", "set", "model", str(tmp_path / "nowhere.gguf"))
    assert missing.returncode == 2, "a bad value, as any other setting's"
    assert f"invalid model: model file {tmp_path / 'nowhere.gguf'} does not exist" in missing.stderr
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    assert "is not a GGUF model file" in run_phi4("config", "set", "model", str(not_gguf)).stderr
    alias = run_phi4("config", "set", "model", "phi4-mini-reasoning")  # pulled later, say
    assert alias.returncode == 0, alias.stderr


@pytest.mark.daemon
def test_config_edit_checks_what_the_editor_wrote(phi4_home: Path):
    good = run_phi4("config", "edit", env={"EDITOR": 'sh -c \'echo "n_ctx = 4096" >> "$0"\''})
    assert good.returncode == 0 and good.stdout.strip().endswith(": ok")
    bad = run_phi4("config", "edit", env={"EDITOR": 'sh -c \'echo "threads = -4" >> "$0"\''})
    assert bad.returncode == 2 and "invalid threads -4" in bad.stderr
    assert "is unchanged" in bad.stderr
    # The bad edit never became the config: it holds the good edit alone, and commands still run.
    path = Path(run_phi4("config", "path").stdout.strip())
    assert "threads" not in path.read_text() and "n_ctx = 4096" in path.read_text()
    assert run_phi4("config", "show").returncode == 0
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no draft left behind"


@pytest.mark.daemon
def test_logs_shows_and_follows_the_daemon_log(tiny_model: Path, phi4_home: Path):
    assert run_phi4("logs").returncode == 1
    assert run_phi4("solve", "hi", "-m", str(tiny_model), "-n", "1").returncode == 0
    shown = run_phi4("logs", "-n", "2")
    assert shown.returncode == 0 and len(shown.stdout.splitlines()) == 2
    # Waits on what the follower printed, not on sleeps: on a busy machine it may take seconds
    # to start, and a line written before it opened the log would never be seen.
    follower = subprocess.Popen([PHI4, "logs", "-f", "-n", "1"], stdout=subprocess.PIPE, text=True)
    assert follower.stdout is not None
    try:
        assert follower.stdout.readline(), "it printed the last line: it is following now"
        assert run_phi4("stop").returncode == 0
        deadline = time.monotonic() + 600
        while "shutting down" not in follower.stdout.readline():
            assert time.monotonic() < deadline, "the stop never reached the followed log"
    finally:
        follower.terminate()
        follower.communicate(timeout=60)


def test_log_rotation_keeps_three(tmp_path: Path):
    log = tmp_path / "daemon.log"
    for generation in range(5):
        log.write_bytes(str(generation).encode() * LOG_MAX_BYTES)
        rotate_log(log)
    assert not log.exists()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["daemon.log.1", "daemon.log.2", "daemon.log.3"]
    assert (tmp_path / "daemon.log.1").read_bytes()[:1] == b"4"
    small = tmp_path / "small.log"
    small.write_text("x")
    rotate_log(small)
    assert small.exists()


@pytest.mark.daemon
def test_install_service_writes_a_user_unit(tiny_model: Path, tmp_path: Path, phi4_home: Path):
    result = run_phi4(
        "daemon", "install-service", "-m", str(tiny_model), env={"XDG_CONFIG_HOME": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    unit = (tmp_path / "systemd" / "user" / "phi4.service").read_text()
    assert "-m phi4cli daemon run --model " + str(tiny_model) + " --keep-alive -1" in unit
    assert f"Environment=PHI4_HOME={phi4_home}" in unit
    assert "WantedBy=default.target" in unit
    assert "systemctl --user enable --now phi4" in result.stdout
    # The unit names the model it runs (it said Phi-4-mini-reasoning whatever the model).
    assert f"Description=phi4 daemon: {tiny_model.name} kept resident" in unit


@pytest.mark.daemon
def test_the_unit_keeps_a_model_path_with_spaces_and_percent_signs_whole(
    tiny_model: Path, tmp_path: Path
):
    odd = tmp_path / "my models" / "100% tiny.gguf"
    odd.parent.mkdir()
    odd.symlink_to(tiny_model)
    result = run_phi4(
        "daemon", "install-service", "-m", str(odd), env={"XDG_CONFIG_HOME": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    unit = (tmp_path / "systemd" / "user" / "phi4.service").read_text()
    escaped = str(odd).replace("%", "%%")
    assert f'--model "{escaped}" --keep-alive -1' in unit
    assert "Description=phi4 daemon: 100%% tiny.gguf kept resident" in unit


@pytest.mark.daemon
@pytest.mark.parametrize(
    "args",
    [
        ["config", "path"],
        ["config", "show", "--json"],
        ["models"],
        ["--help"],
        ["solve", "--help"],
        ["logs", "-n", "200"],
    ],
    ids=" ".join,
)
def test_every_command_exits_0_when_the_reader_of_stdout_went_away(
    args: list[str], phi4_home: Path
):
    # README: exit 0 "also when the reader of stdout went away, as with `| head -1`". Click
    # turned the BrokenPipeError of any command but the fast solve into exit 1, silently.
    log = phi4_home / "state" / "daemon.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"2026-12-06 00:00:00,000 INFO [1] line {i}\n" for i in range(200)))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write: `| true`
    try:
        result = subprocess.run(
            [PHI4, *args],
            stdout=write,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.daemon
def test_a_mistyped_command_gets_its_suggestion_as_a_clause_and_help_names_a_variable_once():
    mistyped = run_phi4("bogus")
    assert (mistyped.returncode, mistyped.stderr) == (
        2,
        "phi4: error: no such command 'bogus' (did you mean 'logs'?); `phi4 -h` lists the "
        "commands\n",
    )
    help_text = " ".join(run_phi4("serve", "--help").stdout.split())
    assert help_text.count("PHI4_API_KEY") == 1, "Typer's [env var: ...] beside the help's own"
