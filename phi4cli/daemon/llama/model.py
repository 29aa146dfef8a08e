"""A GGUF loaded into llama.cpp: staging, the memory plan, offload, the one context, tokens,
and sequence states saved to disk and restored.

Everything here is a thin, typed layer over llama.cpp's C API; what to do with it (prompts,
slots, batching) lives in :mod:`.prompts` and :mod:`.batch`.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals as llama_internals

from phi4cli.core.config import Settings
from phi4cli.core.machine import physical_cores, read_meminfo
from phi4cli.daemon import statefile
from phi4cli.daemon.jobs import ModelLoadError
from phi4cli.daemon.memory import (
    Device,
    Machine,
    MemoryPlan,
    MemoryRequest,
    ModelShape,
    PlanRefused,
    plan_memory,
    start_cells,
)
from phi4cli.daemon.ramdisk import Staging, stage
from phi4cli.text.reasoning import model_thinks

log = logging.getLogger("phi4.engine")

# llama.cpp's log goes through this filter, not straight to stderr (the daemon log): a start
# writes about 700 lines of INFO and DEBUG detail that bury what matters. Warnings and errors
# are kept, as records of the "phi4.llama" logger, and of the INFO lines those that say where
# the weights and the caches went (layers offloaded, each device's buffers): the record of what
# llama.cpp did with the memory plan.
_LLAMA_LEVELS = {2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}  # ggml.h: 1 debug, 2 info
_GGML_CONT = 5  # continues the previous message
_KEPT_INFO = re.compile(r"offloaded \d+/\d+ layers to GPU|\bbuffer size =")
llama_log = logging.getLogger("phi4.llama")


class _LogFilter(threading.local):
    """Per thread: the whole context is made on a thread of its own (``GrowingContext``) while
    the loop thread decodes, and a message and its continuations come from one thread."""

    def __init__(self) -> None:
        self.level: int | None = None
        self.pending = ""

    def __call__(self, level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
        if level != _GGML_CONT:
            self.flush()
            self.level = _LLAMA_LEVELS.get(level)
        if self.level is None:
            return
        self.pending += text.decode("utf-8", errors="replace")
        if self.pending.endswith("\n"):
            self.flush()

    def flush(self) -> None:
        text = self.pending.strip()
        self.pending = ""
        if self.level is None or not text:
            return
        if self.level == logging.INFO:
            if not _KEPT_INFO.search(text):
                return
            text = " ".join(text.split())  # llama.cpp aligns its columns with runs of spaces
        llama_log.log(self.level, "%s", text)


_log_filter = _LogFilter()
_log_callback = llama_cpp.llama_log_callback(_log_filter)  # kept: llama.cpp holds a pointer
llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))

DECODE_OK, DECODE_NO_KV_SPACE = 0, 1
_GGML_TYPES = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}
_FLASH_ATTN = {
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
}
# ggml_backend_dev_type: CPU, GPU, IGPU (integrated, host memory), ACCEL, META
_GPU_DEVICE_TYPES = (1, 2)

# (sequence, token, position, wants logits)
BatchEntry = tuple[int, int, int, bool]


def gpu_devices() -> tuple[Device, ...]:
    """Return the GPUs this llama.cpp build sees, with their free memory (ggml's device API,
    through the ggml library that llama-cpp-python ships); none on a CPU-only build."""
    if not llama_cpp.llama_supports_gpu_offload():
        return ()
    try:
        from llama_cpp._ggml import libggml as ggml

        ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
        ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
        ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_dev_type.restype = ctypes.c_int
        ggml.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_dev_description.restype = ctypes.c_char_p
        ggml.ggml_backend_dev_memory.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        devices = []
        for index in range(ggml.ggml_backend_dev_count()):
            handle = ggml.ggml_backend_dev_get(index)
            if ggml.ggml_backend_dev_type(handle) not in _GPU_DEVICE_TYPES:
                continue
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            ggml.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
            name = (ggml.ggml_backend_dev_description(handle) or b"GPU").decode(errors="replace")
            devices.append(Device(name=name, free_bytes=free.value, total_bytes=total.value))
        return tuple(devices)
    except (AttributeError, OSError) as exc:  # an older or unusual build: plan for the CPU
        log.warning("cannot list GPU devices: %s", exc)
        return ()


def machine_now(staging: Staging) -> Machine:
    available, total = read_meminfo()
    return Machine(
        ram_available=available,
        ram_total=total,
        model_in_ram=staging.staged,
        devices=gpu_devices(),
        gpu_offload=bool(llama_cpp.llama_supports_gpu_offload()),
    )


def model_shape(model: Any, path: Path) -> ModelShape:
    """The memory plan's view of a loaded model (llama.cpp's hyperparameters, no file parsing).

    Weights per layer are estimated from the model's size less its token embeddings.
    """
    raw = model.model
    metadata = model.metadata()
    arch = metadata.get("general.architecture", "")
    n_layer = max(1, llama_cpp.llama_model_n_layer(raw))
    n_embd = llama_cpp.llama_model_n_embd(raw)
    n_head = max(1, llama_cpp.llama_model_n_head(raw))
    size, params = int(model.size()), max(1, int(model.n_params()))
    embedding_bytes = int(model.n_vocab() * n_embd * size / params)

    def dim(key: str) -> int:
        value = metadata.get(f"{arch}.attention.{key}")
        return int(value) if value and value.isdigit() else n_embd // n_head

    name = metadata.get("general.name", "")
    return ModelShape(
        n_layer=n_layer,
        n_head_kv=llama_cpp.llama_model_n_head_kv(raw),
        head_dim_k=dim("key_length"),
        head_dim_v=dim("value_length"),
        n_ctx_train=int(model.n_ctx_train()),
        file_bytes=size,
        layer_bytes=max(0, size - embedding_bytes) // n_layer,
        name=name,
        thinks=model_thinks(name, path.name),
    )


class GrowingContext:
    """The plan's whole context, made on a thread of its own while a smaller one answers (see
    ``memory.START_CELLS``). On Linux the thread runs at the lowest priority (nice 19, that
    thread only): the daemon's decoding threads go first, so the first answers are hardly
    slowed by it, and while the engine waits for it (``LoadedModel.grow``: the small context is
    full) it has the daemon's share of the CPUs. (Linux's SCHED_IDLE would take only CPUs that
    no process wants, and starve beside busy ones; an unprivileged thread cannot be raised
    again once the engine waits.)"""

    def __init__(self, start_cells: int, make: Callable[[], Any]) -> None:
        self.start_cells = start_cells
        self.context: Any = None  # llama_internals.LlamaContext, once made
        self.error: BaseException | None = None
        self.seconds = 0.0  # how long it took, once made
        self._make = make
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="phi4-context", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if sys.platform == "linux":  # (a thread's own priority: elsewhere it is the process's)
            with contextlib.suppress(OSError):  # refused by a policy: the normal priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self.context = self._make()
        except BaseException as exc:  # a failure is reported by LoadedModel.grow, on the loop
            self.error = exc
        self.seconds = self.elapsed()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def wait(self) -> None:
        self._thread.join()


@dataclass(eq=False)
class LoadedModel:
    """The model, its one context and a batch of ``n_batch`` tokens. The context's KV cache has
    ``plan.n_ctx`` cells: with the shared layout one unified cache over ``plan.slots + 1``
    sequences (the last holds the system prompt), with the streams layout a stream of
    ``n_ctx / slots`` cells for each of ``plan.slots`` sequences. Just after a start the
    context may hold fewer cells while the whole one is made (``growing``, :meth:`grow`)."""

    path: Path
    model: Any  # llama_internals.LlamaModel
    context: Any  # llama_internals.LlamaContext
    batch: Any  # llama_internals.LlamaBatch
    plan: MemoryPlan
    n_batch: int
    thinks: bool  # a model that reasons before answering, maybe without <think>
    info: dict[str, Any]  # what loading did, for `phi4 warm` and `phi4 status`
    threads: int = 1  # the context's threads (set_threads); a grown context gets the same
    growing: GrowingContext | None = None  # the whole context, being made
    shrunk: bool = False  # the whole context could not be made: the plan is the small one's

    def __post_init__(self) -> None:
        self.vocab = self.model.vocab
        self._piece_buffer = ctypes.create_string_buffer(64)
        self.state_identity = self._state_identity()

    @property
    def n_ctx(self) -> int:
        return self.plan.n_ctx

    @property
    def cells_now(self) -> int:
        """The cells of the context answering now: ``n_ctx``, or fewer while ``growing``."""
        return self.growing.start_cells if self.growing is not None else self.plan.n_ctx

    def grow(self, wait: bool) -> None:
        """Answer from the whole context if it is made (with ``wait``, once it is): every
        sequence's cells move over in one piece (llama.cpp's whole-context state, which keeps
        cells shared between sequences shared, their positions as they were), the small context
        is let go. If the whole context could not be made or take the state, the small one
        stays and the plan shrinks to it (requests are then admitted against what it holds)."""
        growing = self.growing
        if growing is None or not (wait or growing.done()):
            return
        started = time.monotonic()
        growing.wait()
        waited = time.monotonic() - started
        whole = growing.context
        problem: BaseException | str | None = growing.error
        if whole is not None:
            try:
                moved = self._move_into(whole)
            except Exception as exc:  # (a MemoryError for the state's buffer): as a refusal
                problem = exc
            else:
                problem = None if moved else "llama.cpp refused the state"
        self.growing = None
        if whole is not None and problem is None:
            small, self.context = self.context, whole
            small.close()
            llama_cpp.llama_set_n_threads(whole.ctx, self.threads, self.threads)
            log.info(
                "the whole context of %d cells is ready (made in %.2f s beside the first "
                "answers; waited %.2f s for it)",
                self.plan.n_ctx,
                growing.seconds,
                waited,
            )
            return
        if whole is not None:
            whole.close()
        cells = growing.start_cells
        log.warning(
            "could not make the whole context of %d cells (%s); answering from one of %d",
            self.plan.n_ctx,
            problem,
            cells,
        )
        small = replace(
            self.plan,
            n_ctx=cells,
            notes=(
                *self.plan.notes,
                f"context kept at {cells} cells: the whole one could not be made",
            ),
        )
        self.plan = replace(small, request_tokens=min(small.request_tokens, small.request_capacity))
        self.info["memory"] = self.plan.as_dict()  # (what status shows of the plan)
        self.shrunk = True

    def _move_into(self, whole: Any) -> bool:
        """Copy the whole state of the context answering now into ``whole``; True if llama.cpp
        wrote all of it and ``whole`` took all of it."""
        size = llama_cpp.llama_state_get_size(self.context.ctx)
        if size <= 0:
            return False
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_get_data(self.context.ctx, buffer, size)
        if written != size:
            return False
        return bool(llama_cpp.llama_state_set_data(whole.ctx, buffer, written) == written)

    def _room_for(self, seq: int, cells: int) -> None:
        """Before writing ``cells`` into ``seq`` outside the step loop: wait for the whole
        context if the small one might not hold them (shared: counting each sequence's cells,
        the ones it shares with others too, so never too few; streams: ``seq``'s stream)."""
        if self.growing is None:
            return
        memory = self.context.memory
        if self.plan.kv_layout == "streams":
            held = llama_cpp.llama_memory_seq_pos_max(memory, seq) + 1
            room = self.growing.start_cells // self.plan.slots
        else:
            sequences = range(self.plan.slots + 1)
            held = sum(llama_cpp.llama_memory_seq_pos_max(memory, s) + 1 for s in sequences)
            room = self.growing.start_cells
        if held + cells > room:
            self.grow(wait=True)

    def metadata(self) -> dict[str, str]:
        return dict(self.model.metadata())

    def token_text(self, token: int) -> str:
        return str(self.model.token_get_text(token))

    def eos(self) -> int:
        return int(self.model.token_eos())

    def bos(self) -> int:
        return int(self.model.token_bos())

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        """The tokens of ``text``; with ``special``, special-token text (``<|end|>``) becomes
        the special token. Without, the cost is linear in the text: llama.cpp's search for
        special tokens grows with the square of how many the text holds."""
        data = text.encode()
        capacity = len(data) + 16
        while True:
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), buffer, capacity, add_bos, special
            )
            if count >= 0:
                return list(buffer[:count])
            capacity = -count

    def piece(self, token: int) -> bytes:
        """Return the bytes of one token (special tokens render as nothing)."""
        buffer = self._piece_buffer
        size = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, False)
        if size < 0:  # the piece is longer than the buffer: llama.cpp returns -needed
            self._piece_buffer = buffer = ctypes.create_string_buffer(-size)
            size = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, False)
        return buffer.raw[:size]

    # --- the KV cache -------------------------------------------------------------------------

    def seq_rm(self, seq: int, start: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.context.memory, seq, start, -1)

    def seq_state(self, seq: int) -> Any:
        """The KV state of ``seq``, serialised into a ctypes buffer (to copy it into another
        sequence, or to save it)."""
        size = llama_cpp.llama_state_seq_get_size(self.context.ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.context.ctx, buffer, size, seq)
        return (ctypes.c_uint8 * written).from_buffer(buffer) if written < size else buffer

    def set_seq_state(self, seq: int, state: Any) -> bool:
        """Load a state from :meth:`seq_state` (any writable buffer) into ``seq``, emptied first;
        False if llama.cpp could not (``seq`` is then left empty)."""
        self.seq_rm(seq, 0)
        view = memoryview(state).cast("B")
        self._room_for(seq, view.nbytes // max(1, self.plan.kv_bytes_per_token) + 1)
        buffer = (ctypes.c_uint8 * view.nbytes).from_buffer(view)
        if llama_cpp.llama_state_seq_set_data(self.context.ctx, buffer, view.nbytes, seq) == (
            view.nbytes
        ):
            return True
        self.seq_rm(seq, 0)
        return False

    def seq_cp(self, source: int, target: int, count: int, start: int = 0) -> None:
        """Share the cells of ``source`` at positions ``start`` to ``count`` with ``target`` (no
        copy: the cells of a unified cache belong to both)."""
        llama_cpp.llama_memory_seq_cp(self.context.memory, source, target, start, count)

    def logits(self, index: int) -> Any:
        """The logits of the last decode's batch entry ``index``: a numpy view of llama.cpp's
        buffer, valid until the next decode."""
        import numpy as np

        pointer = llama_cpp.llama_get_logits_ith(self.context.ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(self.model.n_vocab(),))

    def decode(self, entries: Sequence[BatchEntry]) -> int:
        """Decode one batch; return llama_decode's code (DECODE_OK, DECODE_NO_KV_SPACE, ...)."""
        batch = self.batch.batch
        for index, (seq, token, position, logits) in enumerate(entries):
            batch.token[index] = token
            batch.pos[index] = position
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = seq
            batch.logits[index] = logits
        batch.n_tokens = len(entries)
        return int(llama_cpp.llama_decode(self.context.ctx, batch))

    def set_threads(self, threads: int) -> None:
        """Decode (and read prompts) on ``threads`` threads from the next decode on."""
        self.threads = threads
        llama_cpp.llama_set_n_threads(self.context.ctx, threads, threads)

    def evaluate(self, seq: int, tokens: list[int], start: int) -> None:
        """Decode ``tokens`` into ``seq`` from position ``start`` in batch-sized chunks (outside
        the step loop: the system prompt, a restored conversation). Raise RuntimeError."""
        self._room_for(seq, len(tokens))
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset : offset + self.n_batch]
            code = self.decode(
                [(seq, token, start + offset + i, False) for i, token in enumerate(chunk)]
            )
            if code != DECODE_OK:
                raise RuntimeError(f"llama_decode returned {code}")

    def _state_identity(self) -> dict[str, str | int | bool]:
        """What a saved sequence state depends on, written into its header and compared on
        restore (see :mod:`phi4cli.daemon.statefile`): the llama.cpp build, the model file (its
        size, mtime and a hash of its first MiB: the GGUF header and metadata), and the
        context's shape and KV layout (llama.cpp restores a state only into as many streams,
        of the same cell type and V layout, as it was saved from). Taken once, at load: the
        states of this daemon are of the model it loaded, whatever happens to the file since."""
        library = Path(str(getattr(llama_cpp.llama_cpp._lib, "_name", "") or ""))
        try:
            lib_stat = library.stat()
            build = f"{library.name}:{lib_stat.st_size}:{lib_stat.st_mtime_ns}"
        except OSError:
            build = "unknown"
        try:
            model_stat = self.path.stat()
            with open(self.path, "rb") as handle:
                head = hashlib.sha256(handle.read(1 << 20)).hexdigest()
            model_bytes, model_mtime = model_stat.st_size, model_stat.st_mtime_ns
        except OSError:  # gone since it was loaded: a later daemon cannot match these states
            head, model_bytes, model_mtime = "unreadable", -1, -1
        plan = self.plan
        return {
            "llama_cpp_python": llama_cpp.__version__,
            "llama_build": build,
            "model_path": str(self.path),
            "model_bytes": model_bytes,
            "model_mtime_ns": model_mtime,
            "model_head_sha256": head,
            "n_ctx": plan.n_ctx,
            "slots": plan.slots,
            "kv_layout": plan.kv_layout,
            "kv_cache_type": plan.kv_cache_type,
            "flash_attn": plan.flash_attn,
            "gpu_layers": plan.gpu_layers,
        }

    def save_seq(self, seq: int, tokens: list[int], path: Path) -> int | None:
        """Write the KV of ``seq`` (holding ``tokens``) to ``path`` as a phi4 state file,
        atomically; return its size, or None if it could not be written (it is only a cache)."""
        try:
            return statefile.write_state(path, self.state_identity, tokens, self.seq_state(seq))
        except (OSError, statefile.StateFileError) as exc:  # a full disk, a foreign directory
            log.warning("cannot save a sequence state to %s: %s", path, exc)
            return None

    def restore_seq(self, seq: int, tokens: list[int], path: Path, max_bytes: int) -> bool:
        """Load into ``seq`` the state saved at ``path`` by :meth:`save_seq`; True only if the
        file is whole, unaltered, made for this model and context, holds exactly ``tokens`` and
        llama.cpp took all of it. Else ``seq`` is left empty and a damaged or foreign file is
        removed, with one log line saying why: the caller re-reads the tokens instead."""
        self.seq_rm(seq, 0)
        try:
            payload = statefile.read_state(path, self.state_identity, tokens, max_bytes)
        except FileNotFoundError:
            return False
        except statefile.StateDirError as exc:  # nothing in it is ours to trust or to remove
            log.warning("not using saved state %s: %s", path, exc)
            return False
        except statefile.StateFileError as exc:
            log.warning("removed unusable saved state %s: %s; re-reading its tokens", path, exc)
            statefile.remove_state(path)
            return False
        if self.set_seq_state(seq, payload):
            return True
        log.warning("removed saved state %s: llama.cpp refused it; re-reading its tokens", path)
        statefile.remove_state(path)
        return False

    def close(self) -> None:
        if self.growing is not None:  # (the thread uses the model: it must finish first)
            self.growing.wait()
            if self.growing.context is not None:
                self.growing.context.close()
            self.growing = None
        for resource in (self.batch, self.context, self.model):
            resource.close()


def load_model(path: Path, settings: Settings, n_batch: int = 512) -> LoadedModel:
    """Stage ``path``, plan memory for it, load it and create its context.

    Raise ModelLoadError with a sentence for the user when the file or llama.cpp fails.
    """
    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist")
    staging = stage(path, settings.ramdisk)
    started = time.monotonic()
    # Loaded on the CPU first to learn its shape (mmap: the weights are read lazily). Where a GPU
    # may take layers, that first load skips repacking the weights for the CPU (seconds on a
    # large model) and the model is loaded again as the plan says.
    may_offload = bool(llama_cpp.llama_supports_gpu_offload()) and settings.gpu_layers != 0
    model = _load_weights(path, staging.path, settings.mlock, 0, repack=not may_offload)
    shape = model_shape(model, path)
    machine = machine_now(staging)
    try:
        plan = plan_memory(
            shape,
            machine,
            MemoryRequest(
                n_ctx=settings.n_ctx,
                parallel=settings.parallel,
                kv_cache_type=settings.kv_cache_type,
                kv_layout=settings.kv_layout,
                overcommit=settings.overcommit,
                gpu_layers=settings.gpu_layers,
            ),
        )
    except PlanRefused as exc:
        model.close()
        fault = exc.fault._replace(model=path.name)
        raise ModelLoadError(f"cannot plan memory for {path}: {exc}", fault) from None
    except ValueError as exc:
        model.close()
        raise ModelLoadError(f"cannot plan memory for {path}: {exc}") from None
    if may_offload:
        model.close()
        model = _load_weights(path, staging.path, settings.mlock, plan.gpu_layers)
    threads = settings.threads or physical_cores()
    first = start_cells(plan, shape, machine)
    if first is not None and first < n_batch:  # (llama.cpp takes no batch over its n_ctx)
        first = None
    try:
        context = _make_context(model, plan, first or plan.n_ctx, n_batch, threads)
        batch = llama_internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1)
    except BaseException as exc:
        model.close()
        if isinstance(exc, ValueError):
            raise ModelLoadError(
                f"llama.cpp could not create a context of {first or plan.n_ctx} tokens "
                f"({plan.kv_cache_type} KV cache) for {path}: {exc}"
            ) from None
        raise
    growing = None
    if first is not None:
        growing = GrowingContext(
            first, lambda: _make_context(model, plan, plan.n_ctx, n_batch, threads)
        )
    load_s = time.monotonic() - started
    log.info(
        "loaded %s from %s in %.2f s (threads %d, n_ctx %d, %d slots, %s KV %s, gpu layers %d)",
        path,
        staging.path,
        load_s,
        threads,
        plan.n_ctx,
        plan.slots,
        plan.kv_cache_type,
        plan.kv_layout,
        plan.gpu_layers,
    )
    if first is not None:
        log.info(
            "answering from a context of %d cells while the whole one of %d is made",
            first,
            plan.n_ctx,
        )
    info = {
        "model": str(path),
        "loaded_from": str(staging.path),
        "staged": staging.staged,
        "stage_copied": staging.copied,
        "stage_s": round(staging.seconds, 4),
        "stage_note": staging.note,
        "load_s": round(load_s, 4),
        "n_ctx": plan.n_ctx,
        "start_cells": first,
        "threads": threads,
        "parallel": plan.parallel,
        "mlock": settings.mlock,
        "memory": plan.as_dict(),
    }
    return LoadedModel(
        path=path,
        model=model,
        context=context,
        batch=batch,
        plan=plan,
        n_batch=n_batch,
        thinks=shape.thinks,
        info=info,
        threads=threads,
        growing=growing,
    )


def _make_context(model: Any, plan: MemoryPlan, n_ctx: int, n_batch: int, threads: int) -> Any:
    """A llama context of ``n_ctx`` cells laid out as ``plan`` says; raise ValueError."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    streams = plan.kv_layout == "streams"
    # Shared: every sequence draws on the same n_ctx cells, and one more holds the system
    # prompt for fresh slots to share. Streams: a stream per slot; the system prompt is
    # copied into a fresh slot from its saved state instead.
    params.n_seq_max = plan.slots if streams else plan.slots + 1
    params.kv_unified = not streams
    params.n_threads = threads
    params.n_threads_batch = threads
    params.type_k = params.type_v = _GGML_TYPES[plan.kv_cache_type]
    params.flash_attn_type = _FLASH_ATTN[plan.flash_attn]
    return llama_internals.LlamaContext(model=model, params=params, verbose=False)


def _load_weights(
    path: Path, source: Path, mlock: bool, gpu_layers: int, repack: bool = True
) -> Any:
    """Load the GGUF at ``source`` (staged copy of ``path``); raise ModelLoadError."""
    params = llama_cpp.llama_model_default_params()
    params.use_mlock = mlock
    params.n_gpu_layers = gpu_layers
    params.use_extra_bufts = repack
    try:
        # verbose=True only keeps llama-cpp-python from pointing stderr at /dev/null during the
        # load: llama.cpp's log goes through _LogFilter either way, and with stderr (the daemon
        # log) closed off, what it kept of the load (warnings, where the layers went) was lost.
        return llama_internals.LlamaModel(path_model=str(source), params=params, verbose=True)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(_diagnose_load_failure(path, exc)) from None


def _diagnose_load_failure(path: Path, exc: Exception) -> str:
    """Turn llama.cpp's terse load failure into a sentence that says what is wrong."""
    from phi4cli.core.errors import InvalidModelError
    from phi4cli.core.models import validate_gguf

    try:
        validate_gguf(path)
    except InvalidModelError as invalid:
        return str(invalid)
    return (
        f"llama.cpp could not load {path} ({exc}); is it a model architecture llama.cpp supports?"
    )
