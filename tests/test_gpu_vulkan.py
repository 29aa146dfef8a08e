"""Offload on a real ggml GPU device: llama.cpp's Vulkan backend on Mesa's software driver
(lavapipe, "llvmpipe"), which ggml lists as a GPU with 2 GiB of its own memory.

Skipped without that build: ``bench/gpu_lavapipe.sh build`` makes it (about 30 minutes on 2
cores), ``bench/gpu_lavapipe.sh test`` runs these. The daemons here load llama_cpp from the
Vulkan build (``PHI4_VK_SITE`` ahead on PYTHONPATH); the CPU answers they are compared with come
from the venv's own CPU build.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_phi4

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("PHI4_VK_SITE") or ROOT / ".vk" / "site")
SHAPED = os.environ.get("PHI4_SHAPED_MODEL")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (SITE / "llama_cpp" / "lib" / "libggml-vulkan.so").is_file(),
        reason=f"no Vulkan build of llama.cpp in {SITE} (bench/gpu_lavapipe.sh build)",
    ),
]
MiB = 1 << 20


def on_device() -> dict[str, str]:
    """The environment that loads the Vulkan build, with lavapipe's CPU-type device counted."""
    path = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": f"{SITE}{os.pathsep + path if path else ''}",
        "GGML_VK_VISIBLE_DEVICES": "0",
        # The CPU's share of a partial offload, and lavapipe's own threads, on both cores.
        "PHI4_THREADS": str(min(2, os.cpu_count() or 1)),
    }


def shaped_model() -> Path:
    if not SHAPED or not Path(SHAPED).is_file():
        pytest.skip("PHI4_SHAPED_MODEL names no shaped Phi-4-mini model (bench/shaped_model.py)")
    return Path(SHAPED)


def status(env: dict[str, str]) -> dict[str, Any]:
    result = run_phi4("status", "--json", env=env)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def llama_lines(home: Path) -> list[str]:
    """What llama.cpp said about where the weights and caches went, from the daemon log."""
    log = (home / "state" / "daemon.log").read_text()
    return [line for line in log.splitlines() if "buffer size =" in line or "offloaded" in line]


def buffer_mib(lines: list[str], device: str, kind: str) -> float:
    sizes = [
        float(m.group(1))
        for line in lines
        if (m := re.search(rf"\b{device} {kind} buffer size = +([\d.]+) MiB", line))
    ]
    assert sizes, (device, kind, lines)
    return sum(sizes)


def test_ggml_lists_lavapipe_as_a_gpu_with_its_memory():
    probe = (
        "import json, llama_cpp; from phi4cli.daemon.llama.model import gpu_devices; "
        "print(json.dumps([llama_cpp.__file__, bool(llama_cpp.llama_supports_gpu_offload()), "
        "[[d.name, d.free_bytes, d.total_bytes] for d in gpu_devices()]]))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **on_device()},
    )
    where, offload, devices = json.loads(shown.stdout.splitlines()[-1])
    assert where.startswith(str(SITE)) and offload
    [(name, free, total)] = devices
    print(f"\n{name}: {total / MiB:,.0f} MiB, {free / MiB:,.0f} MiB free")
    assert "llvmpipe" in name and 0 < free <= total and total >= 1024 * MiB, devices
    # The venv's CPU build, for contrast: no device, no offload.
    cpu = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(cpu.stdout.splitlines()[-1])[1:] == [False, []]


@pytest.mark.smollm2
def test_smollm2_goes_wholly_on_the_device_and_answers_as_the_cpu_does(
    smollm2_model: Path, phi4_home: Path, tmp_path: Path
):
    env = on_device()
    warm = run_phi4("warm", "-m", str(smollm2_model), env=env)
    assert warm.returncode == 0, warm.stderr
    assert re.search(r"offload\s+all layers on llvmpipe", warm.stdout), warm.stdout
    plan = status(env)["memory"]["plan"]
    assert plan["gpu_layers"] == -1 and "llvmpipe" in plan["device"]
    shown = run_phi4("status", env=env).stdout
    assert re.search(r"offload\s+all layers on llvmpipe", shown), shown
    # llama.cpp itself: every layer (30 and the output layer) on Vulkan0, its KV cache too.
    lines = llama_lines(phi4_home)
    assert any("offloaded 31/31 layers to GPU" in line for line in lines), lines
    assert buffer_mib(lines, "Vulkan0", "KV") > 0
    # Greedy answers, on the device and on the venv's CPU build (a daemon of its own). The two
    # backends round differently, so greedy streams part where the top two tokens are close
    # ("What is 2+2?" parts after 12 tokens); these two questions' 24 tokens never come close.
    cpu_env = {"PHI4_HOME": str(tmp_path / "cpu")}
    try:
        for question in ("What is 10 divided by 2?", "What is the capital of France?"):
            asked = ("solve", "-m", str(smollm2_model), "-t", "0", "-n", "24", "--json", question)
            gpu, cpu = run_phi4(*asked, env=env), run_phi4(*asked, env=cpu_env)
            assert gpu.returncode == 0 and cpu.returncode == 0, (gpu.stderr, cpu.stderr)
            on_gpu, on_cpu = json.loads(gpu.stdout), json.loads(cpu.stdout)
            assert on_gpu["solution"].strip() and on_gpu["solution"] == on_cpu["solution"]
            assert on_gpu["stats"]["completion_tokens"] == on_cpu["stats"]["completion_tokens"]
        assert status(cpu_env)["memory"]["plan"]["gpu_layers"] == 0
    finally:
        run_phi4("stop", env=cpu_env)


def test_the_shaped_model_is_split_between_the_device_and_the_cpu_as_planned(phi4_home: Path):
    model = shaped_model()
    env = on_device()
    warm = run_phi4("warm", "-m", str(model), env=env)
    assert warm.returncode == 0, warm.stderr
    plan = status(env)["memory"]["plan"]
    layers = plan["gpu_layers"]
    if layers < 0:
        pytest.skip(f"this lavapipe's {plan['device_free'] / MiB:,.0f} MiB hold the whole model")
    # 2.4 GB of weights and a 2 GiB cache on a 2 GiB device: the output layer and a few blocks,
    # each with its share of the cache (counted as llama.cpp counts: the output layer first).
    assert 1 < layers < 33, plan
    assert re.search(rf"offload\s+{layers} layers on llvmpipe", warm.stdout), warm.stdout
    assert any(f"{layers} of 33 layers fit in llvmpipe" in note for note in plan["notes"]), plan
    lines = llama_lines(phi4_home)
    print("\n" + warm.stdout + "\n".join(lines))
    assert any(f"offloaded {layers}/33 layers to GPU" in line for line in lines), lines
    # The cache went where its blocks went: (layers - 1)/32 of it on the device, the rest on the
    # CPU. (Planned as 32 blocks before: one block's cache short of what the device was given.)
    per_block = plan["kv_bytes"] / 32 / MiB
    assert buffer_mib(lines, "Vulkan0", "KV") == pytest.approx((layers - 1) * per_block, rel=0.01)
    assert buffer_mib(lines, "CPU", "KV") == pytest.approx((33 - layers) * per_block, rel=0.01)
    answered = run_phi4("solve", "-m", str(model), "-t", "0", "-n", "4", "--json", "1+1?", env=env)
    assert answered.returncode == 0, answered.stderr
    stats = json.loads(answered.stdout)["stats"]
    print(f"\nshaped model, {layers} layers on llvmpipe:", json.dumps(stats))
    assert stats["completion_tokens"] == 4


def test_layers_that_do_not_fit_the_device_are_refused_with_the_numbers():
    model = shaped_model()
    env = on_device()
    started = run_phi4("daemon", "start", "-m", str(model), "--gpu-layers", "all", env=env)
    if started.returncode == 0:
        run_phi4("stop", env=env)
        pytest.skip("this lavapipe's memory holds the whole model (a newer Mesa than 22.3)")
    assert started.returncode == 5, started.stderr
    line = started.stderr.strip().splitlines()[-1]
    print("\n" + line)
    assert "33 of 33 layers with a " in line and "GiB on llvmpipe" in line, line
    fits = int(re.search(r"--gpu-layers (\d+) fits", line).group(1))  # type: ignore[union-attr]
    assert 1 < fits < 33 and "--overcommit" in line
    assert run_phi4("stop", env=env).returncode == 0
    # The advice, taken, loads.
    taken = run_phi4("daemon", "start", "-m", str(model), "--gpu-layers", str(fits), env=env)
    assert taken.returncode == 0, taken.stderr
    assert status(env)["memory"]["plan"]["gpu_layers"] == fits
