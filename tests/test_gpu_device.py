"""bench/gpu_device.sh, the prepared GPU run, as far as a CPU machine can take it: what `pack`
puts in the carried folder, the wheels it takes, and the bench stage run for real on the CPU
against the installed llama.cpp (a build's output, as `build` leaves it), results bundled as the
device returns them. (`build` itself compiles llama.cpp: minutes, not run here.)"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from tests.conftest import _stop_processes_in
from tests.tinymodel import write_tiny_phi3

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_device.sh"


def run_script(
    *args: str, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def work() -> Iterator[Path]:
    # Short: the daemon's socket lives under it.
    path = Path(tempfile.mkdtemp(prefix="p4g-", dir="/tmp"))
    yield path
    _stop_processes_in(path / "home")
    shutil.rmtree(path, ignore_errors=True)


def fake_sdist(tmp_path: Path) -> Path:
    """An sdist laid out as llama-cpp-python's: sources to keep, models and docs to drop."""
    files = {
        "llama_cpp/__init__.py": "__version__ = '0.3.36'\n",
        "llama_cpp/lib/libllama.so": "a library built for another machine",
        "vendor/llama.cpp/CMakeLists.txt": "project(llama.cpp)\n",
        "vendor/llama.cpp/ggml/src/ggml.c": "int ggml;\n",
        "vendor/llama.cpp/src/llama.cpp": "int llama;\n",
        "vendor/llama.cpp/tools/server/server.cpp": "int server;\n",
        "vendor/llama.cpp/models/ggml-vocab-big.gguf": "x" * 4096,
        "vendor/llama.cpp/docs/build.md": "# build\n",
        "vendor/llama.cpp/tests/test-tokenizer.cpp": "int test;\n",
        "vendor/llama.cpp/examples/simple/simple.cpp": "int simple;\n",
    }
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sdist


def test_pack_carries_the_sources_a_build_needs_and_not_the_models_docs_or_tests(
    tmp_path: Path,
) -> None:
    carry = tmp_path / "carry"
    result = run_script(
        "pack",
        "--sdist",
        str(fake_sdist(tmp_path)),
        "--no-wheels",
        env={"PHI4_GPU_CARRY": str(carry)},
    )
    assert result.returncode == 0, result.stderr
    assert "the device takes at most 64 MiB" in result.stderr
    with tarfile.open(carry / "llama.cpp.tar.gz") as tar:
        names = set(tar.getnames())
    assert {
        "llama.cpp/CMakeLists.txt",
        "llama.cpp/ggml/src/ggml.c",
        "llama.cpp/src/llama.cpp",
        "llama.cpp/tools/server/server.cpp",
    } <= names
    for dropped in ("models", "docs", "tests", "examples"):
        assert not any(name.startswith(f"llama.cpp/{dropped}") for name in names), dropped
    # The Python package travels without the libraries built elsewhere: build supplies its own.
    assert (carry / "llama_cpp" / "__init__.py").is_file()
    assert not (carry / "llama_cpp" / "lib").exists()
    assert not (carry / "wheels").exists()


def test_pack_refuses_an_archive_that_is_not_the_sdist(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.tar.gz"
    with tarfile.open(bogus, "w:gz") as tar:
        tar.addfile(tarfile.TarInfo("llama_cpp_python-0.3.36/README.md"), io.BytesIO())
    carry = tmp_path / "carry"
    result = run_script(
        "pack", "--sdist", str(bogus), "--no-wheels", env={"PHI4_GPU_CARRY": str(carry)}
    )
    assert result.returncode == 1
    assert "holds no vendor/llama.cpp" in result.stderr
    assert not carry.exists()


def test_the_wheels_are_phi4s_requirements_at_the_versions_installed_here() -> None:
    result = run_script("wheels", env={"PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    specs = dict(spec.split("==") for spec in result.stdout.split())
    for name in (
        "typer",
        "gguf",
        "prompt-toolkit",
        "platformdirs",
        "pylatexenc",
        "httpx2",
        "httpcore2",
        "starlette",
        "uvicorn",
        "math-verify",
    ):
        assert specs[name] == importlib.metadata.version(name), name
    # Built for the device or already there: not carried.
    for name in ("llama-cpp-python", "numpy", "pyyaml", "sympy", "phi4cli"):
        assert name not in specs, name
    # Only what phi4 needs at run time: not its test tools.
    assert "pytest" not in specs and "ruff" not in specs


def built_site(work: Path) -> None:
    """What `build` leaves: the llama_cpp package with its libraries under $WORK/site."""
    shutil.copytree(Path(llama_cpp.__file__).parent, work / "site" / "llama_cpp")
    assert (work / "site" / "llama_cpp" / "lib" / "libllama.so").exists()


@pytest.mark.daemon
def test_bench_runs_every_step_on_the_cpu_and_returns_the_tables(work: Path) -> None:
    built_site(work)
    # Heads of 64 (q8_0 KV needs a multiple of 32), small enough to decode in milliseconds.
    model = write_tiny_phi3(work / "tiny.gguf", embed=128, heads=2, kv_heads=2)
    out = work / "out"
    result = run_script(
        "bench",
        "--quick",
        "--model",
        str(model),
        env={
            "PHI4_GPU_WORK": str(work),
            "PHI4_GPU_CARRY": str(work / "carry"),
            "OUT": str(out),
            "PYTHON": sys.executable,
        },
    )
    assert result.returncode == 0, result.stderr
    # At most 8 files come back from the device: the two bundles.
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.md"]
    summary = (out / "summary.md").read_text()
    steps = summary.split("## steps")[1]
    for name in ("smoke", "batching_f16", "batching_q8_0", "speed", "memory"):
        assert f"- {name}: done" in steps, steps
    assert "Batching on tiny.gguf" in summary and "Speed on tiny.gguf" in summary
    assert "Decode rate by depth on tiny.gguf" in summary
    with tarfile.open(out / "results.tar.gz") as tar:
        names = set(tar.getnames())
        smoke = tar.extractfile("./smoke.json")
        assert smoke is not None
        answer = json.loads(smoke.read())
        q8 = tar.extractfile("./batching_q8_0/batching-tiny.json")
        assert q8 is not None
        batching = json.loads(q8.read())
    assert "./status.json" in names and "./llama_cpp.txt" in names
    assert answer["stats"]["completion_tokens"] > 0
    # The q8_0 run asked the daemon for a q8_0 cache, and measured both concurrencies.
    assert batching["phi4_plan"]["kv_cache_type"] == "q8_0"
    assert set(batching["phi4"]) == {"1", "4"}
    assert all(batching["phi4"][k]["tps"] > 0 for k in ("1", "4"))


@pytest.mark.daemon
def test_bench_skips_what_the_budget_leaves_no_time_for(work: Path) -> None:
    built_site(work)
    model = write_tiny_phi3(work / "tiny.gguf")
    out = work / "out"
    result = run_script(
        "bench",
        "--quick",
        "--budget",
        "0",
        "--model",
        str(model),
        env={
            "PHI4_GPU_WORK": str(work),
            "PHI4_GPU_CARRY": str(work / "carry"),
            "OUT": str(out),
            "PYTHON": sys.executable,
        },
    )
    assert result.returncode == 0, result.stderr
    steps = (out / "summary.md").read_text().split("## steps")[1]
    assert steps.count(": skipped") == 5, steps
    assert "skipped smoke" in result.stderr


@pytest.mark.daemon
def test_bench_without_a_build_says_to_build_first(work: Path) -> None:
    result = run_script("bench", env={"PHI4_GPU_WORK": str(work), "OUT": str(work / "out")})
    assert result.returncode == 1
    assert "no build in" in result.stderr and "run build first" in result.stderr
