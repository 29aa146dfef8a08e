"""The memory plan: a pure function of model shape, machine and settings, on many machines."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from phi4cli.core.errors import api_words, cli_words
from phi4cli.core.machine import read_meminfo
from phi4cli.daemon.memory import (
    CTX_ALIGN,
    MAX_SLOTS,
    MIN_CTX,
    Device,
    Machine,
    MemoryPlan,
    MemoryRequest,
    ModelShape,
    PlanRefused,
    plan_memory,
)
from tests.conftest import run_phi4

GiB = 1 << 30

# Phi-4-mini-reasoning Q4_K_M: phi3, 32 layers, 8 KV heads of 128, 128K trained context.
PHI4_MINI = ModelShape(
    n_layer=32,
    n_head_kv=8,
    head_dim_k=128,
    head_dim_v=128,
    n_ctx_train=131072,
    file_bytes=2_491_874_688,
    layer_bytes=62_000_000,
    name="Phi 4 Mini Reasoning",
    thinks=True,
)
SMOLLM2 = ModelShape(
    n_layer=30,
    n_head_kv=3,
    head_dim_k=64,
    head_dim_v=64,
    n_ctx_train=8192,
    file_bytes=98_362_432,
    layer_bytes=2_216_448,
)


def machine(total_gib: float, available_gib: float, **kw: object) -> Machine:
    return Machine(ram_available=int(available_gib * GiB), ram_total=int(total_gib * GiB), **kw)  # type: ignore[arg-type]


def test_kv_bytes_per_token_follow_the_model_and_the_cache_type():
    assert PHI4_MINI.kv_bytes_per_token("f16") == 128 * 1024  # 2 x 32 x 8 x 128 x 2 B
    assert PHI4_MINI.kv_bytes_per_token("q8_0") == 128 * 1024 * 34 // 64
    assert PHI4_MINI.kv_bytes_per_token("q4_0") == 128 * 1024 * 18 // 64
    assert SMOLLM2.kv_bytes_per_token("f16") == 2 * 30 * 3 * 64 * 2


def test_this_24_gb_machine_serves_four_requests_of_eight_thousand_tokens():
    plan = plan_memory(PHI4_MINI, machine(23.4, 22.0), MemoryRequest())
    assert plan.n_ctx == 4 * 8192 and plan.n_ctx_source == "auto"
    assert plan.request_tokens == 8192 and plan.parallel == 4
    assert plan.request_tokens * 4 <= plan.n_ctx  # 4 x 8,000-token requests, all reserved
    assert plan.kv_bytes == 4 * GiB and plan.gpu_layers == 0 and not plan.notes
    # A reasoning model's requests each get a KV stream of their own (attention over its own
    # cells only, however deep the others are).
    assert plan.kv_layout == "streams" and plan.slots == 4 and plan.request_capacity == 8192


def test_the_shared_layout_packs_short_requests_in_beyond_the_four():
    plan = plan_memory(PHI4_MINI, machine(23.4, 22.0), MemoryRequest(kv_layout="shared"))
    assert plan.kv_layout == "shared" and plan.n_ctx == 4 * 8192 and plan.parallel == 4
    assert plan.slots == MAX_SLOTS and plan.request_capacity == plan.n_ctx


def test_auto_shares_one_cache_when_streams_would_not_help():
    # A model that does not think answers briefly: many short requests pack into one cache.
    assert plan_memory(SMOLLM2, machine(23.4, 22.0), MemoryRequest()).kv_layout == "shared"
    # A context that holds one long request: one stream would answer one request at a time,
    # while a shared cache lets smaller ones run together.
    small = plan_memory(PHI4_MINI, machine(23.4, 22.0), MemoryRequest(n_ctx=4096))
    assert small.kv_layout == "shared" and small.slots > 1


def test_streams_split_the_context_evenly_and_each_holds_a_request():
    plan = plan_memory(
        PHI4_MINI, machine(23.4, 22.0), MemoryRequest(n_ctx=40000, kv_layout="streams")
    )
    assert plan.slots == plan.parallel == 4
    assert plan.n_ctx == plan.slots * plan.request_capacity  # llama.cpp splits it evenly
    assert plan.request_capacity % CTX_ALIGN == 0 and plan.request_capacity >= 8192
    assert plan.request_tokens == 8192
    # Asked for on a small context: --parallel streams, each an even share.
    asked = MemoryRequest(n_ctx=4096, kv_layout="streams")
    small = plan_memory(PHI4_MINI, machine(23.4, 22.0), asked)
    assert small.slots == small.parallel == 4 and small.request_capacity == 1024
    assert small.request_tokens == 1024
    # Too small for --parallel streams of the smallest size: fewer, and a note says so.
    tiny = plan_memory(
        PHI4_MINI, machine(23.4, 22.0), MemoryRequest(n_ctx=600, kv_layout="streams")
    )
    assert tiny.slots == 2 and tiny.request_capacity == CTX_ALIGN
    assert any("2 streams of 256 tokens, fewer than --parallel 4" in n for n in tiny.notes)
    with pytest.raises(ValueError, match="unknown KV layout"):
        plan_memory(PHI4_MINI, machine(23.4, 22.0), MemoryRequest(kv_layout="diagonal"))


def test_a_16_gb_machine_still_gets_the_full_plan():
    plan = plan_memory(PHI4_MINI, machine(15.5, 11.0), MemoryRequest())
    assert plan.n_ctx == 32768 and plan.parallel == 4 and not plan.notes


def test_a_small_machine_gets_a_smaller_context_and_is_told_why():
    plan = plan_memory(PHI4_MINI, machine(7.7, 5.0), MemoryRequest())
    room = 5.0 * GiB - 1 * GiB - PHI4_MINI.file_bytes
    assert MIN_CTX <= plan.n_ctx <= room / (128 * 1024)
    assert plan.n_ctx % CTX_ALIGN == 0
    assert plan.parallel == plan.n_ctx // 8192 >= 1
    assert any("q8_0 holds twice as many" in note for note in plan.notes)


def test_q8_0_holds_about_twice_the_context_in_the_same_memory():
    small = machine(7.7, 5.0)
    f16 = plan_memory(PHI4_MINI, small, MemoryRequest())
    q8 = plan_memory(PHI4_MINI, small, MemoryRequest(kv_cache_type="q8_0"))
    assert 1.8 < q8.n_ctx / f16.n_ctx < 2.0
    assert q8.flash_attn == "on", "a quantized V cache needs flash attention"
    assert f16.flash_attn == "auto"
    assert abs(q8.kv_bytes - f16.kv_bytes) < 0.1 * f16.kv_bytes


def test_a_machine_short_of_memory_still_runs_at_the_minimum():
    plan = plan_memory(PHI4_MINI, machine(3.8, 2.0), MemoryRequest())
    assert plan.n_ctx == MIN_CTX and plan.request_tokens == MIN_CTX and plan.parallel == 1
    assert plan.notes


def test_a_staged_model_is_not_counted_twice():
    staged = plan_memory(PHI4_MINI, machine(7.7, 5.0, model_in_ram=True), MemoryRequest())
    mapped = plan_memory(PHI4_MINI, machine(7.7, 5.0), MemoryRequest())
    assert staged.n_ctx > mapped.n_ctx


def test_an_explicit_context_is_honoured():
    plan = plan_memory(PHI4_MINI, machine(23.4, 22.0), MemoryRequest(n_ctx=4096))
    assert plan.n_ctx == 4096 and plan.n_ctx_source == "setting"
    assert plan.request_tokens == 4096 and plan.parallel == 1
    # Before: a 16 GiB KV cache with 5 GiB free got only a note, and llama.cpp allocated it
    # (on a machine without a memory limit, the OOM killer picks a victim).
    with pytest.raises(PlanRefused, match=r"n_ctx 131,072 needs 16\.0 GiB of f16 KV cache") as exc:
        plan_memory(PHI4_MINI, machine(7.7, 5.0), MemoryRequest(n_ctx=131072))
    # What was asked and what fits travel as data; each door words them (the log both names).
    fault = exc.value.fault
    assert (fault.param, fault.needed) == ("n_ctx", 131072) and 0 < fault.limit < 131072
    # (Each value as it is typed: a comma in 12,288 would not read back as a number.)
    assert f"n_ctx = {fault.limit} (--n-ctx {fault.limit}) fits" in str(exc.value)
    assert "overcommit (--overcommit)" in str(exc.value)
    assert f"--n-ctx {fault.limit} fits" in cli_words(fault) and "--overcommit" in cli_words(fault)
    said, param = api_words(fault)
    assert param is None and "--" not in said and f"n_ctx = {fault.limit} fits" in said
    huge = plan_memory(PHI4_MINI, machine(7.7, 5.0), MemoryRequest(n_ctx=131072, overcommit=True))
    assert huge.n_ctx == 131072 and any("may swap" in note for note in huge.notes)


def test_a_plain_model_plans_shorter_requests_within_its_trained_context():
    plan = plan_memory(SMOLLM2, machine(23.4, 22.0), MemoryRequest())
    assert plan.request_tokens == 4096 and plan.n_ctx == 4 * 4096
    tiny_train = plan_memory(
        ModelShape(2, 2, 16, 16, n_ctx_train=1024, file_bytes=1 << 20, layer_bytes=1 << 18),
        machine(23.4, 22.0),
        MemoryRequest(parallel=2),
    )
    assert tiny_train.request_tokens == 1024 and tiny_train.n_ctx == 2048


def test_parallel_sizes_the_context():
    plan = plan_memory(PHI4_MINI, machine(23.4, 22.0), MemoryRequest(parallel=8))
    assert plan.n_ctx == 8 * 8192 and plan.parallel == 8 and plan.kv_bytes == 8 * GiB


@pytest.mark.parametrize("total_gib", [2, 4, 6, 8, 12, 16, 24, 32, 64, 128, 512])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_over_many_machines_the_plan_fits_or_says_so(total_gib, kv_type):
    available = total_gib * 0.8
    plan = plan_memory(
        PHI4_MINI, machine(total_gib, available), MemoryRequest(kv_cache_type=kv_type)
    )
    room = available * GiB - max(GiB, 0.1 * total_gib * GiB) - PHI4_MINI.file_bytes
    assert plan.n_ctx >= MIN_CTX and plan.n_ctx % CTX_ALIGN == 0
    assert plan.n_ctx <= 4 * 8192, "never more than parallel requests of the default budget"
    assert plan.kv_bytes <= room or (plan.n_ctx == MIN_CTX and plan.notes)
    assert plan.request_tokens <= plan.n_ctx
    assert 1 <= plan.parallel <= 4 and plan.parallel * plan.request_tokens <= plan.n_ctx
    assert plan.parallel <= plan.slots <= MAX_SLOTS
    assert plan.gpu_layers == 0 and plan.device is None
    if plan.n_ctx < 4 * 8192:
        assert plan.notes, "a smaller plan than the default says why"


def test_more_memory_never_plans_less():
    sizes = [
        plan_memory(PHI4_MINI, machine(t, t * 0.8), MemoryRequest()).n_ctx for t in range(2, 40)
    ]
    assert sizes == sorted(sizes)


def test_a_cpu_only_build_offloads_nothing_and_says_nothing():
    plan = plan_memory(PHI4_MINI, machine(23.4, 22.0), MemoryRequest(gpu_layers="auto"))
    assert plan.gpu_layers == 0 and plan.device is None and not plan.notes


def test_asking_for_layers_on_a_cpu_only_build_says_it_cannot():
    plan = plan_memory(PHI4_MINI, machine(23.4, 22.0), MemoryRequest(gpu_layers="all"))
    assert plan.gpu_layers == 0
    assert plan.notes == ("this llama.cpp build cannot offload to a GPU",)


def gpu_machine(free_gib: float) -> Machine:
    device = Device("NVIDIA Test", int(free_gib * GiB), int(max(free_gib, 8) * GiB))
    return machine(23.4, 22.0, devices=(device,), gpu_offload=True)


def test_auto_offloads_every_layer_when_the_device_holds_model_and_cache():
    plan = plan_memory(PHI4_MINI, gpu_machine(24.0), MemoryRequest())
    assert plan.gpu_layers == -1 and plan.device == "NVIDIA Test"
    assert plan.flash_attn == "auto", "on a GPU, llama.cpp's own choice"
    assert plan.n_ctx == 32768 and not plan.notes


def test_auto_offloads_as_many_layers_as_fit_after_the_kv_plan():
    plan = plan_memory(PHI4_MINI, gpu_machine(4.0), MemoryRequest())
    per_layer = PHI4_MINI.layer_bytes + 32768 * PHI4_MINI.kv_bytes_per_token("f16") / 32
    blocks = int((4.0 * GiB - 512 * (1 << 20) - PHI4_MINI.other_bytes) // per_layer)
    assert plan.n_ctx == 32768 and 0 < blocks < 32
    # Counted as llama.cpp's n_gpu_layers counts: the output layer first, then the blocks.
    assert plan.gpu_layers == blocks + 1
    assert any(
        f"{blocks + 1} of 33 layers fit" in note and f"the output layer and {blocks} of 32" in note
        for note in plan.notes
    )


def _host_bytes(plan: MemoryPlan, shape: ModelShape) -> float:
    """What a plan leaves on the host: the weights of the blocks it keeps there (and the rest
    of the file), with their share of the KV cache."""
    layers = shape.n_layer + 1 if plan.gpu_layers < 0 else plan.gpu_layers
    host_blocks = shape.n_layer - max(0, layers - 1)
    kv = shape.kv_bytes_per_token(plan.kv_cache_type) * plan.n_ctx * host_blocks / shape.n_layer
    return shape.other_bytes + host_blocks * shape.layer_bytes + kv


def test_a_model_split_between_device_and_host_leaves_the_host_room_for_its_part():
    # Before: with part of the model on the device, the context was sized as if the device held
    # every weight and the host only the KV cache. On a 6 GiB machine (4.5 free) beside a GPU
    # with 1.5 GiB free it planned 24,576 tokens with 4 of 33 layers on the device: the 29 blocks
    # left on the CPU and their share of the cache needed 4.9 GiB of the 3.5 GiB free. Now
    # 13,056 tokens, 5 layers on the device, 3.48 GiB on the host.
    small = replace(gpu_machine(1.5), ram_total=6 * GiB, ram_available=int(4.5 * GiB))
    plan = plan_memory(PHI4_MINI, small, MemoryRequest())
    assert 0 < plan.gpu_layers < 33
    assert _host_bytes(plan, PHI4_MINI) <= 3.5 * GiB
    assert plan.n_ctx >= MIN_CTX and plan.n_ctx % CTX_ALIGN == 0
    assert any(
        "left on the CPU and their share of the KV cache fit the free RAM" in note
        for note in plan.notes
    )
    assert not any(note.startswith("free memory holds") for note in plan.notes)


@pytest.mark.parametrize("device_gib", [0.8, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
@pytest.mark.parametrize("total_gib", [4, 6, 8, 12, 16])
def test_over_many_machines_a_split_model_fits_the_host_or_says_so(device_gib, total_gib):
    available = total_gib * 0.75
    host = replace(
        gpu_machine(device_gib), ram_total=int(total_gib * GiB), ram_available=int(available * GiB)
    )
    plan = plan_memory(PHI4_MINI, host, MemoryRequest())
    ram_free = available * GiB - max(GiB, 0.1 * total_gib * GiB)
    if plan.gpu_layers >= 0:  # part on each, or all on the CPU (-1: all on the device)
        assert _host_bytes(plan, PHI4_MINI) <= ram_free or (
            plan.n_ctx == MIN_CTX and any("need more RAM than is free" in n for n in plan.notes)
        )
    assert plan.request_tokens <= plan.n_ctx


@pytest.mark.parametrize("device_gib", [0.8, 1.5, 2.0, 3.3])
def test_beside_a_device_more_ram_never_plans_a_smaller_context(device_gib):
    # Before (a first version of the split plan): a 3.3 GiB GPU beside 1.55 GiB of free RAM
    # planned 4,352 tokens, beside 1.6 GiB 2,048, beside 1.7 GiB 4,608.
    sizes = [
        plan_memory(
            PHI4_MINI,
            replace(gpu_machine(device_gib), ram_total=16 * GiB, ram_available=int(gib / 20 * GiB)),
            MemoryRequest(),
        ).n_ctx
        for gib in range(20, 300)
    ]
    assert sizes == sorted(sizes)


def test_a_split_plan_never_grows_a_context_smaller_than_the_floor():
    # A model trained on 512 tokens, one request: 512 tokens planned, below MIN_CTX. When the
    # host's part does not fit, the plan says so and keeps the 512 (it once rose to MIN_CTX).
    short = replace(PHI4_MINI, n_ctx_train=512)
    cramped = replace(gpu_machine(0.9), ram_total=4 * GiB, ram_available=int(1.1 * GiB))
    plan = plan_memory(short, cramped, MemoryRequest(parallel=1))
    assert plan.n_ctx <= 512
    assert any("need more RAM than is free" in note for note in plan.notes)


def test_a_tiny_device_gets_no_layers():
    plan = plan_memory(PHI4_MINI, gpu_machine(0.4), MemoryRequest())
    assert plan.gpu_layers == 0 and plan.device is None
    assert any("no layer fits in NVIDIA Test's free memory" in note for note in plan.notes)
    with pytest.raises(PlanRefused) as refused:
        plan_memory(PHI4_MINI, gpu_machine(0.4), MemoryRequest(gpu_layers=4))
    assert refused.value.fault[:3] == ("gpu_layers", 4, 0)
    assert "no layer fits beside this context: use --gpu-layers 0" in cli_words(refused.value.fault)


def test_all_layers_size_the_context_to_the_device():
    plan = plan_memory(PHI4_MINI, gpu_machine(5.0), MemoryRequest(gpu_layers="all"))
    room = 5.0 * GiB - 512 * (1 << 20) - PHI4_MINI.file_bytes
    assert plan.gpu_layers == -1
    assert plan.n_ctx <= room / (128 * 1024) and plan.n_ctx < 32768 and plan.notes


def test_layers_asked_for_that_do_not_fit_the_device_are_refused_with_the_numbers():
    # Before: a note that they "may not fit", then llama.cpp failing part-way through the load
    # (or, where a driver lends host memory, thrashing). Now the plan refuses with what fits.
    with pytest.raises(PlanRefused) as exc:
        plan_memory(PHI4_MINI, gpu_machine(2.0), MemoryRequest(gpu_layers="all"))
    message = cli_words(exc.value.fault)
    assert "33 of 33 layers with a " in message
    assert "GiB on NVIDIA Test, which has 1.5 GiB free" in message
    fits = plan_memory(PHI4_MINI, gpu_machine(2.0), MemoryRequest()).gpu_layers
    assert exc.value.fault[:3] == ("gpu_layers", 33, fits)
    assert 0 < fits < 32 and f"--gpu-layers {fits} fits" in message and "--overcommit" in message
    # The advice holds: that many layers load; one more is refused; --overcommit loads anyway.
    taken = plan_memory(PHI4_MINI, gpu_machine(2.0), MemoryRequest(gpu_layers=fits))
    assert taken.gpu_layers == fits
    with pytest.raises(ValueError, match=f"{fits + 1} of 33 layers with a "):
        plan_memory(PHI4_MINI, gpu_machine(2.0), MemoryRequest(gpu_layers=fits + 1))
    forced = plan_memory(
        PHI4_MINI, gpu_machine(2.0), MemoryRequest(gpu_layers="all", overcommit=True)
    )
    assert forced.gpu_layers == -1 and any("loaded anyway (overcommit)" in n for n in forced.notes)


def test_a_number_of_layers_is_taken_as_given():
    plan = plan_memory(PHI4_MINI, gpu_machine(24.0), MemoryRequest(gpu_layers=10))
    assert plan.gpu_layers == 10
    with pytest.raises(ValueError):
        plan_memory(PHI4_MINI, gpu_machine(24.0), MemoryRequest(gpu_layers=-3))
    with pytest.raises(ValueError):
        plan_memory(PHI4_MINI, gpu_machine(24.0), MemoryRequest(kv_cache_type="q2"))


def test_meminfo_is_read_in_bytes():
    text = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n"
    assert read_meminfo(text) == (20000000 * 1024, 24000000 * 1024)
    available, total = read_meminfo()
    assert 0 < available <= total


def test_a_quantized_cache_needs_heads_that_fill_its_blocks():
    tiny = ModelShape(2, 2, 16, 16, n_ctx_train=131072, file_bytes=1 << 20, layer_bytes=1 << 18)
    plan = plan_memory(tiny, machine(23.4, 22.0), MemoryRequest(kv_cache_type="q8_0"))
    assert plan.kv_cache_type == "f16" and plan.flash_attn == "auto"
    assert plan.notes == (
        "a q8_0 KV cache needs a head size divisible by 32 (this model's is 16); using f16",
    )


def test_ggml_device_listing_and_the_offload_load_path_run_on_this_build(tiny_model, monkeypatch):
    # This CPU-only build lists no GPU; pretending it could offload runs the real device query
    # (ggml's backend device API through ctypes) and the probe-then-reload path of a GPU build.
    import llama_cpp

    from phi4cli.core.config import Settings
    from phi4cli.daemon.llama import model as llama_model

    assert llama_model.gpu_devices() == ()
    loads: list[tuple[int, bool]] = []
    real_load = llama_model._load_weights

    def counting(path, source, mlock, gpu_layers, repack=True):  # type: ignore[no-untyped-def]
        loads.append((gpu_layers, repack))
        return real_load(path, source, mlock, gpu_layers, repack)

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(llama_model, "_load_weights", counting)
    devices = llama_model.gpu_devices()
    assert all(device.total_bytes > 0 for device in devices)  # the CPU is never listed
    loaded = llama_model.load_model(tiny_model, Settings(ramdisk="off", n_ctx=512))
    try:
        assert loads == [(0, False), (0, True)], "probed without repacking, then loaded"
        assert loaded.plan.gpu_layers == 0 and loaded.plan.device is None
        assert loaded.plan.notes == (), "auto with no device: no noise"
    finally:
        loaded.close()


@pytest.mark.daemon
def test_an_explicit_context_over_the_free_memory_is_refused_with_the_numbers(tiny_model: Path):
    # Before: `--n-ctx 1000000` for SmolLM2 (21.5 GiB of KV, 8 GiB free) got a "may swap"
    # note and went to llama.cpp. A context no machine here holds is refused before llama.cpp
    # allocates anything, and the daemon says so where status shows it.
    started = run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "2000000000")
    assert started.returncode == 5, started.stderr
    line = started.stderr.strip().splitlines()[-1]
    assert f"cannot plan memory for {tiny_model.name}: n_ctx 2,000,000,000 needs" in line
    assert "GiB is free beside the model" in line
    assert "fits," in line and "--overcommit" in line
    assert "failed" in run_phi4("status").stdout
    assert run_phi4("stop").returncode == 0
    fine = run_phi4("solve", "hi", "-m", str(tiny_model), "-n", "2", "--n-ctx", "1024")
    assert fine.returncode == 0, fine.stderr
    # The advice can be taken where --n-ctx is given: solve, chat and eval start a daemon too.
    for command in ("solve", "chat", "eval", "daemon", "warm"):
        shown = run_phi4(command, *(["start"] if command == "daemon" else []), "--help").stdout
        assert "--overcommit" in shown, command
