"""Shell completion offers values: setting names, a setting's fixed values, model aliases and
``.gguf`` files, through the real ``phi4`` command as each shell's script calls it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PHI4, run_phi4


def bash_complete(line: str, cwd: Path | None = None) -> list[str]:
    """What ``phi4`` answers bash for the command line ``line`` (the cursor at its end)."""
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    env = {"_PHI4_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(cword)}
    result = subprocess.run([PHI4], cwd=cwd, env={**os.environ, **env}, capture_output=True,
                            text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_config_set_completes_the_setting_names():
    keys = bash_complete("phi4 config set ")
    assert {"model", "kv_layout", "kv_cache_type", "temperature", "instruction"} <= set(keys)
    assert bash_complete("phi4 config set kv_l") == ["kv_layout"]


@pytest.mark.parametrize(
    ("key", "values"),
    [("kv_layout", ["auto", "shared", "streams"]), ("kv_cache_type", ["f16", "q8_0", "q4_0"]),
     ("ramdisk", ["auto", "on", "off"]), ("mlock", ["true", "false"]), ("temperature", [])],
)  # fmt: skip
def test_config_set_completes_a_fixed_set_of_values(key: str, values: list[str]):
    assert bash_complete(f"phi4 config set {key} ") == values


def test_the_values_offered_are_the_values_config_set_takes():
    from phi4cli.completion import setting_values

    for key in ("kv_layout", "kv_cache_type", "ramdisk", "mlock"):
        for value in setting_values(key, ""):
            assert run_phi4("config", "set", key, value).returncode == 0, (key, value)


def test_model_options_complete_aliases_and_gguf_files(tmp_path: Path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("not a model")
    offered = bash_complete("phi4 solve -m ", cwd=tmp_path)
    assert {"phi4-mini-reasoning", "smollm2-135m", "models/"} <= set(offered)
    assert "notes.txt" not in offered
    assert bash_complete("phi4 chat --model models/", cwd=tmp_path) == ["models/mine.gguf"]
    assert bash_complete("phi4 solve -m smo", cwd=tmp_path) == ["smollm2-135m"]
    assert bash_complete("phi4 pull ", cwd=tmp_path) == ["phi4-mini-reasoning", "smollm2-135m"]
