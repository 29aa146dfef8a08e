"""The memory plan: how many tokens the KV cache holds, what one request may reserve of it, how
many requests can decode together, how the cache is laid out, and how many layers go to a GPU.

:func:`plan_memory` is a pure function of the model's shape, the machine's free memory and the
user's settings, so it is unit-tested over many machine sizes; the engine gathers its inputs
(the model's shape from llama.cpp, :func:`phi4cli.core.machine.read_meminfo`, ggml's devices).

The KV cache costs ``2 (K and V) x layers x KV heads x head size x bytes per element`` per token:
for Phi-4-mini (32 layers, 8 KV heads of 128) that is 128 KiB at f16, so 8,192 tokens take 1 GiB.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from phi4cli.core.errors import Fault, log_words

GiB = 1 << 30
MiB = 1 << 20

# Bytes per element of each KV cache type (ggml's block sizes: q8_0 stores 32 values in 34 bytes,
# q4_0 in 18).
KV_TYPE_BYTES: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
QUANT_BLOCK = 32  # a quantized cache stores each head in blocks of this many values

# What one request may use (prompt + generation) unless it asks for more: Phi-4-mini-reasoning
# thinks for 3,000-6,000 tokens on a hard problem, so a reasoning model gets room for that and its
# answer; other models answer in far fewer.
REASONING_REQUEST_TOKENS = 8192
PLAIN_REQUEST_TOKENS = 4096
# The smallest context worth running; below this the plan says memory is short but goes on.
MIN_CTX = 2048
CTX_ALIGN = 256  # llama.cpp pads the KV cache to this many cells anyway
# The most requests decoded together, whatever the memory: each needs a sequence and a sampler,
# and past this a CPU gains nothing from a wider batch.
MAX_SLOTS = 16
# A request with a small budget (a short problem) reserves at least this much, which bounds how
# many fit: n_ctx // this, up to MAX_SLOTS.
MIN_RESERVATION = 1024
# How the KV cache is laid out. "shared": one cache that every request draws on (llama.cpp's unified
# cache), so a long request can take the cells short ones leave and many short ones pack in; but
# llama.cpp computes each token's attention over the whole used span, the other requests' cells
# masked out, so a step slows with the depth of everything running (on a CPU, 1.35x slower for 4
# requests at a depth of 3,000, 1.47x for 8: bench/kv_layout.py). "streams": a stream of its own
# per request (as llama-server's slots), n_ctx / slots cells each, attention over its own cells.
KV_LAYOUTS = ("auto", "shared", "streams")
# Memory left to the rest of the machine (and llama.cpp's compute buffers) when planning.
RAM_HEADROOM_FRACTION = 0.10
RAM_HEADROOM_MIN = 1 * GiB
DEVICE_HEADROOM = 512 * MiB
# llama.cpp writes every byte of the KV cache when it makes a context (it clears the cache), and
# a page the process never touched before costs the kernel (and a VM's host) work on first
# write: at the default plan of a reasoning model, 4 GiB, that was 4.4 of a 5.8 s start on a
# 2-core VM. A start makes a context in which a request may hold START_CELLS first, answers
# from it, and makes the whole one on a background thread (:func:`start_cells`). Not worth it
# under GROW_MIN_BYTES (a cache that small clears in a blink); the small context's compute
# buffer touches about START_SPARE.
START_CELLS = 2048
GROW_MIN_BYTES = 128 * MiB
START_SPARE = 256 * MiB


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know about a model (from its GGUF header)."""

    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    file_bytes: int
    layer_bytes: int  # weights of one repeating layer (the average)
    name: str = ""  # general.name
    thinks: bool = False  # a reasoning model: requests need room for long thinking

    @property
    def other_bytes(self) -> int:
        """Weights outside the repeating layers (embeddings, output)."""
        return max(0, self.file_bytes - self.layer_bytes * self.n_layer)

    def kv_bytes_per_token(self, kv_type: str) -> int:
        elements = self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v)
        return int(elements * KV_TYPE_BYTES[kv_type] + 0.5)


@dataclass(frozen=True)
class Device:
    """A GPU (or other accelerator with its own memory) that llama.cpp can offload to."""

    name: str
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Machine:
    """Free memory as the daemon sees it before loading."""

    ram_available: int
    ram_total: int
    # The model's pages are already out of ram_available (staged on tmpfs): don't count them twice.
    model_in_ram: bool = False
    devices: tuple[Device, ...] = ()
    gpu_offload: bool = False  # this llama.cpp build can offload (CUDA, Metal, Vulkan, ...)


@dataclass(frozen=True)
class MemoryRequest:
    """The user's settings that shape the plan (None / "auto": let the plan decide)."""

    n_ctx: int | None = None
    parallel: int = 4
    kv_cache_type: str = "f16"
    gpu_layers: str | int = "auto"  # "auto" | "all" | a number of layers
    kv_layout: str = "auto"  # "auto" | "shared" | "streams" (see KV_LAYOUTS)
    overcommit: bool = False  # load an explicit n_ctx or gpu_layers over the free memory


@dataclass(frozen=True)
class MemoryPlan:
    n_ctx: int  # KV cells in all
    request_tokens: int  # what a request reserves (prompt + generation) unless it asks otherwise
    parallel: int  # requests of request_tokens that fit at once
    slots: int  # the most requests decoding together (shared: short ones pack in)
    kv_cache_type: str
    # "on": llama.cpp needs it for a quantized V cache; else "auto" (llama.cpp's choice, on for
    # a CPU). Off would decode an f16 cache ~15% faster at depth on a CPU, but then a greedy
    # answer would depend on what else shares its batch; with it on, it does not.
    flash_attn: str
    kv_bytes_per_token: int
    kv_bytes: int
    gpu_layers: int  # as llama.cpp counts: the output layer, then blocks; -1: all, 0: none
    device: str | None
    ram_available: int
    device_free: int | None
    n_ctx_source: str  # "auto" | "setting"
    notes: tuple[str, ...] = field(default_factory=tuple)
    kv_layout: str = "shared"  # "shared" | "streams": one stream of n_ctx / slots cells per slot

    @property
    def request_capacity(self) -> int:
        """The most one request may hold: its stream, or the whole shared cache."""
        return self.n_ctx // self.slots if self.kv_layout == "streams" else self.n_ctx

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "notes": list(self.notes),
            "request_capacity": self.request_capacity,
        }


def ram_headroom(machine: Machine) -> int:
    """Memory the plan leaves to the rest of the machine and llama.cpp's compute buffers."""
    return max(RAM_HEADROOM_MIN, int(machine.ram_total * RAM_HEADROOM_FRACTION))


def start_cells(plan: MemoryPlan, shape: ModelShape, machine: Machine) -> int | None:
    """The cells of a smaller context to answer from while the plan's whole context is made in
    the background, or None to make the whole one at once: START_CELLS, shared by the requests
    (shared layout), or a stream of START_CELLS each (the same streams, smaller; not START_CELLS
    split among them: with 512 a stream, three answers thinking at once filled theirs 400-odd
    tokens in and stopped 10 s for the whole context, made beside them in 85 s).
    Only for a cache held on the host (a GPU's memory is too scarce to hold two), when the
    whole cache is large and ``machine`` has room for both caches beside the weights and the
    plan's headroom (never on a plan that took all the free memory, or one over it)."""
    if plan.gpu_layers != 0:
        return None
    cells = START_CELLS * (plan.slots if plan.kv_layout == "streams" else 1)
    if plan.n_ctx < 2 * cells or plan.kv_bytes < GROW_MIN_BYTES:
        return None
    weights = 0 if machine.model_in_ram else shape.file_bytes
    spare = machine.ram_available - ram_headroom(machine) - weights - plan.kv_bytes
    # Beside the whole cache: the small one, and its state on its way to the whole one.
    if spare < 2 * cells * plan.kv_bytes_per_token + START_SPARE:
        return None
    return cells


def default_request_tokens(shape: ModelShape) -> int:
    target = REASONING_REQUEST_TOKENS if shape.thinks else PLAIN_REQUEST_TOKENS
    return min(target, shape.n_ctx_train)


def _blocks(gpu_layers: int) -> int:
    """The repeating layers (blocks) that llama.cpp's n_gpu_layers puts on the device: the
    output layer is the first of them."""
    return max(0, gpu_layers - 1)


def _align_down(tokens: int) -> int:
    return max(CTX_ALIGN, tokens // CTX_ALIGN * CTX_ALIGN)


class PlanRefused(ValueError):
    """A plan that would not fit (and ``overcommit`` was not asked): its ``fault`` says what was
    asked and what fits; the message is the daemon log's words for it."""

    def __init__(self, fault: Fault) -> None:
        super().__init__(log_words(fault))
        self.fault = fault


def plan_memory(shape: ModelShape, machine: Machine, request: MemoryRequest) -> MemoryPlan:
    """Return the plan for ``shape`` on ``machine`` under ``request``.

    Context: an explicit ``n_ctx`` is honoured; ``auto`` aims at ``parallel`` requests of the
    model's default budget, at most what free memory holds after the weights and a headroom, and
    never below MIN_CTX. Layers: ``auto`` puts on the device as many layers as fit, with their
    share of that KV cache, in its free memory; ``all`` puts them all there; 0 on a build or a
    machine without a device.

    Raise ValueError for a KV type or a layer count that makes no sense.
    """
    if request.kv_cache_type not in KV_TYPE_BYTES:
        raise ValueError(f"unknown KV cache type {request.kv_cache_type!r}")
    if request.kv_layout not in KV_LAYOUTS:
        raise ValueError(f"unknown KV layout {request.kv_layout!r}")
    notes: list[str] = []
    kv_type = request.kv_cache_type
    if kv_type != "f16" and (shape.head_dim_k % QUANT_BLOCK or shape.head_dim_v % QUANT_BLOCK):
        notes.append(
            f"a {kv_type} KV cache needs a head size divisible by {QUANT_BLOCK} (this model's is "
            f"{shape.head_dim_k}); using f16"
        )
        kv_type = "f16"
    per_token = shape.kv_bytes_per_token(kv_type)
    per_layer_token = per_token / max(1, shape.n_layer)
    wanted_request = default_request_tokens(shape)
    parallel = max(1, request.parallel)

    device = max(machine.devices, key=lambda d: d.free_bytes) if machine.devices else None
    offload_possible = machine.gpu_offload and device is not None
    device_room = max(0, device.free_bytes - DEVICE_HEADROOM) if device is not None else 0
    layers_setting = request.gpu_layers
    # Layers are counted as llama.cpp's n_gpu_layers (llama-server's -ngl) counts them: the
    # output layer is one of them and goes first, so N puts the output layer and the last N - 1
    # blocks on the device, and n_layer + 1 is all of them.
    all_layers = shape.n_layer + 1
    if layers_setting == "all":
        wanted_layers = all_layers
    elif layers_setting == "auto":
        wanted_layers = all_layers if offload_possible else 0
    else:
        wanted_layers = int(layers_setting)
        if wanted_layers < 0:
            raise ValueError(f"gpu_layers must be auto, all or a number >= 0, not {wanted_layers}")
        wanted_layers = min(wanted_layers, all_layers)
    if wanted_layers and not offload_possible:
        notes.append(
            "this llama.cpp build cannot offload to a GPU"
            if not machine.gpu_offload
            else "no GPU device found"
        )
        wanted_layers = 0

    headroom = ram_headroom(machine)
    ram_free = machine.ram_available - headroom  # before any weights
    ram_room = ram_free
    if not machine.model_in_ram:
        # Weights that stay on the host must be resident too (mmap'd pages count as available).
        host_blocks = shape.n_layer - _blocks(wanted_layers)
        ram_room -= shape.other_bytes + host_blocks * shape.layer_bytes

    # --- the context -------------------------------------------------------------------------
    if request.n_ctx is not None:
        n_ctx = request.n_ctx
        source = "setting"
    else:
        source = "auto"
        n_ctx = parallel * wanted_request
        # The KV cache goes where its layers go: the offloaded share to the device.
        if wanted_layers == all_layers and layers_setting != "auto":
            room_tokens = int((device_room - shape.file_bytes) / per_token)
        elif wanted_layers:
            room_tokens = int((ram_room + max(0, device_room - shape.file_bytes)) / per_token)
        else:
            room_tokens = int(ram_room / per_token)
        if room_tokens < n_ctx:
            n_ctx = max(MIN_CTX, _align_down(room_tokens))
            notes.append(
                f"free memory holds {max(0, room_tokens):,} tokens of {kv_type} KV"
                f" cache, fewer than {parallel} requests of {wanted_request:,}"
                + ("; kv_cache_type = q8_0 holds twice as many" if kv_type == "f16" else "")
            )
        n_ctx = min(n_ctx, parallel * shape.n_ctx_train)
    request_tokens = min(wanted_request, n_ctx)

    # --- layers on the device ------------------------------------------------------------------
    def fitting(n_ctx: int) -> int:
        """The layers the device holds beside their share of an n_ctx-token KV cache: each
        block with its share; the output layer (and, to be safe, the input embedding that stays
        on the CPU) counted in other_bytes."""
        per_layer = shape.layer_bytes + per_layer_token * n_ctx
        blocks_fit = int((device_room - shape.other_bytes) // per_layer) if per_layer else 0
        return 0 if blocks_fit < 0 else min(all_layers, blocks_fit + 1)

    def host_tokens(layers: int) -> int:
        """The KV tokens the host's RAM holds beside the weights of the layers left on it,
        with those layers' share of each token."""
        host_blocks = shape.n_layer - _blocks(layers)
        weights = 0 if machine.model_in_ram else shape.other_bytes + host_blocks * shape.layer_bytes
        share = per_layer_token * host_blocks
        return int((ram_free - weights) / share) if share else 1 << 62

    gpu_layers = 0
    if wanted_layers:
        where = device.name if device else "the device"
        if layers_setting == "auto":
            gpu_layers = fitting(n_ctx)
            # Not all on the device: the context was sized as if the device held every weight
            # and the host the whole KV cache. The blocks left on the host need their weights
            # and their share of the cache in its RAM, and a smaller context lets the device
            # take more blocks. The host's room shrinks as the context grows, so the contexts
            # that fit are the ones up to some size: found by halving, in CTX_ALIGN steps.
            if source == "auto" and gpu_layers < all_layers:

                def host_fits(tokens: int) -> bool:
                    return host_tokens(fitting(tokens)) >= tokens

                if not host_fits(n_ctx):
                    if n_ctx > MIN_CTX:  # (never below MIN_CTX, nor above what was planned)
                        low, high = MIN_CTX // CTX_ALIGN, n_ctx // CTX_ALIGN  # high: no fit
                        while high - low > 1:
                            middle = (low + high) // 2
                            low, high = (
                                (middle, high) if host_fits(middle * CTX_ALIGN) else (low, middle)
                            )
                        n_ctx = low * CTX_ALIGN
                    gpu_layers = fitting(n_ctx)
                    request_tokens = min(request_tokens, n_ctx)
                    # (Instead of the count above, which left the host's weights out.)
                    notes = [note for note in notes if not note.startswith("free memory holds")]
                    left = shape.n_layer - _blocks(gpu_layers)
                    if not host_fits(n_ctx):
                        notes.append(
                            f"the {left} blocks left on the CPU and their share of even a "
                            f"{n_ctx:,}-token KV cache need more RAM than is free"
                        )
                    elif gpu_layers < all_layers:
                        notes.append(
                            f"the {left} blocks left on the CPU and their share of the KV cache "
                            f"fit the free RAM with {n_ctx:,} tokens of context"
                        )
                    else:
                        notes.append(
                            f"with {n_ctx:,} tokens of context every layer and its KV cache "
                            f"fit in {where}'s free memory"
                        )
            if not gpu_layers:
                notes.append(
                    f"no layer fits in {where}'s free memory beside a {n_ctx:,}-token "
                    "KV cache: all on the CPU"
                )
            elif gpu_layers < all_layers:
                notes.append(
                    f"{gpu_layers} of {all_layers} layers fit in {where}'s free memory with a "
                    f"{n_ctx:,}-token KV cache (the output layer and {_blocks(gpu_layers)} of "
                    f"{shape.n_layer} blocks)"
                )
        else:
            gpu_layers = wanted_layers
            if fitting(n_ctx) < wanted_layers:
                per_layer = shape.layer_bytes + per_layer_token * n_ctx
                need = shape.other_bytes + _blocks(wanted_layers) * per_layer
                needed = (
                    f"{wanted_layers} of {all_layers} layers with a {n_ctx:,}-token {kv_type} KV "
                    f"cache need {need / GiB:.1f} GiB on {where}, which has "
                    f"{max(0, device_room) / GiB:.1f} GiB free (and "
                    f"{DEVICE_HEADROOM / GiB:.1f} GiB kept for its own buffers)"
                )
                if not request.overcommit:
                    # llama.cpp would fail its allocation part-way through the load, or (where
                    # the driver lends host memory) thrash. The advice is auto's own count,
                    # which a number of layers given with the same context gets as planned.
                    try:
                        auto = plan_memory(shape, machine, replace(request, gpu_layers="auto"))
                        fits = all_layers if auto.gpu_layers < 0 else auto.gpu_layers
                    except ValueError:  # this context does not fit the RAM either
                        fits = 0
                    raise PlanRefused(Fault("gpu_layers", wanted_layers, fits, facts=needed))
                notes.append(f"{needed}; loaded anyway (overcommit)")
        if gpu_layers == all_layers:
            gpu_layers = -1  # llama.cpp's "all"

    if source == "setting" and gpu_layers == 0 and per_token * n_ctx > ram_room:
        needed = (
            f"n_ctx {n_ctx:,} needs {per_token * n_ctx / GiB:.1f} GiB of {kv_type} KV "
            f"cache, but {max(0, ram_room) / GiB:.1f} GiB is free beside the model "
            f"(and {headroom / GiB:.1f} GiB kept for the rest of the machine)"
        )
        if not request.overcommit:
            # On a machine without a memory limit the OOM killer would pick a victim: maybe
            # not this daemon.
            fits = max(0, _align_down(int(max(0, ram_room) / per_token)))
            raise PlanRefused(Fault("n_ctx", n_ctx, fits, facts=needed))
        notes.append(f"{needed}; loaded anyway (overcommit): the machine may swap")
    slots = max(parallel, min(MAX_SLOTS, n_ctx // MIN_RESERVATION))
    parallel_fit = max(1, n_ctx // request_tokens)
    at_once = min(parallel, parallel_fit) if source == "setting" else parallel_fit
    layout = request.kv_layout
    if layout == "auto":
        # A reasoning model's requests each reserve a long budget, so packing short ones buys
        # little, and their depth is what slows a shared cache: a stream each, when the context
        # holds two or more of them (one stream would answer one request at a time).
        layout = "streams" if shape.thinks and at_once >= 2 else "shared"
    if layout == "streams":
        # Chosen here: as many streams as requests of the default budget fit. Asked for: the
        # --parallel requests, each with an even share (a small context makes small streams).
        slots = at_once if request.kv_layout == "auto" else min(parallel, n_ctx // CTX_ALIGN)
        slots = max(1, slots)
        stream = _align_down(n_ctx // slots)
        if slots < parallel and request.kv_layout == "streams":
            notes.append(
                f"n_ctx {n_ctx:,} makes {slots} stream{'s' if slots != 1 else ''} of "
                f"{stream:,} tokens, fewer than --parallel {parallel}"
            )
        n_ctx = stream * slots  # llama.cpp splits n_ctx evenly between the streams
        request_tokens = min(request_tokens, stream)
        at_once = slots
    return MemoryPlan(
        n_ctx=n_ctx,
        request_tokens=request_tokens,
        parallel=at_once,
        slots=slots,
        kv_cache_type=kv_type,
        flash_attn="on" if kv_type != "f16" else "auto",
        kv_bytes_per_token=per_token,
        kv_bytes=per_token * n_ctx,
        gpu_layers=gpu_layers,
        device=device.name if device is not None and gpu_layers else None,
        ram_available=machine.ram_available,
        device_free=device.free_bytes if device is not None else None,
        n_ctx_source=source,
        notes=tuple(notes),
        kv_layout=layout,
    )
