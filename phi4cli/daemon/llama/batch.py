"""Slots, admission by reservation, and one batch per step (continuous batching).

One llama context holds several sequences (slots). With the shared layout they draw on one
unified KV cache of ``n_ctx`` cells: a request is admitted only when the cells it may ever need —
its prompt plus its generation budget — fit beside what the running requests have reserved, so a
running request never runs out of room and is never cut short for another's sake; one that does
not fit yet waits in the queue. With the streams layout each slot has a stream of its own (the
memory plan sized them): a request that fits a stream is admitted to any free slot. Idle slots
keep their tokens (a chat's next turn, a repeated question reuse them) until their cells are
needed.

Each step gives every answering slot its next token and shares the rest of the batch among the
prompts being read, in chunks, so a long prompt never stalls the streams already running. Prompts
that came before any of those streams began (sent together) are read in whole batches instead,
while the streams wait: that reads them fastest. A fresh slot starts from the system prompt's KV,
shared from a reserved sequence rather than recomputed.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

from llama_cpp import _internals as llama_internals

from phi4cli.core._settings import Sampling
from phi4cli.core.config import Settings
from phi4cli.core.errors import Fault, log_words
from phi4cli.core.machine import physical_cores
from phi4cli.core.protocol import ErrorCode, Stats
from phi4cli.daemon.jobs import ContextOverflowError, Job, ModelLoadError, SolveParams, Wait
from phi4cli.daemon.llama.cells import KVCells
from phi4cli.daemon.llama.drafting import Speculator
from phi4cli.daemon.llama.model import DECODE_NO_KV_SPACE, DECODE_OK, LoadedModel, load_model
from phi4cli.daemon.llama.prompt_cache import common_prefix
from phi4cli.daemon.llama.prompts import ChatPlan, Prompts
from phi4cli.daemon.llama.slots import Prepared, Run, Slot
from phi4cli.daemon.llama.speculation import Drafter
from phi4cli.daemon.llama.writing import RunWriter
from phi4cli.daemon.sessions import SwapStore
from phi4cli.daemon.threads import ThreadGovernor
from phi4cli.text.confidence import TraceConfidence
from phi4cli.text.reasoning import ThinkSplitter
from phi4cli.text.thinking import ThinkingPolicy

log = logging.getLogger("phi4.engine")

# The model card samples with transformers' defaults besides temperature/top_p, i.e. top_k=50.
TOP_K = 50
REPEAT_LAST_N = 64  # tokens the repeat penalty looks back over (llama-server's default)
# Prompt tokens read per step while other requests are answering.
PREFILL_CHUNK = 64
# Room kept for the tokens that close the thinking when a think budget is reached; they are the
# daemon's, not the model's, so they do not count against max_tokens.
THINK_CLOSE_ROOM = 16
# Chat sessions swapped out to disk (cells.SWAP_MIN_TOKENS) take at most this many bytes.
SWAP_MAX_BYTES = 4 << 30


class LlamaEngine:
    """Several requests at once over one model and one context (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        state_dir: Path | None = None,
        swap_dir: Path | None = None,
        n_batch: int = 512,
    ) -> None:
        self.settings = settings
        self.n_batch = n_batch
        self.state_dir = state_dir  # where prefilled system-prompt states are kept
        self._swap = SwapStore(swap_dir, SWAP_MAX_BYTES)  # chat sessions saved when evicted
        self._model: LoadedModel | None = None
        self._prompts: Prompts | None = None
        self._cells: KVCells | None = None  # who holds which cells of the loaded model's context
        self._loads = 0  # models loaded so far: tells a job's tokens from another model's
        self._writer: RunWriter | None = None  # what each token of a run writes (writing.py)
        self._governor: ThreadGovernor | None = None  # threads from the cores others leave free
        self._whole: set[tuple[int, ...]] = set()  # files loaded whole (_file_identity)
        # Exact self-speculation: whether and how far to draft, and answers lately finished
        # to draft from (speculation.py).
        self._spec = Speculator(settings.speculate)

    @property
    def model_path(self) -> Path | None:
        return self._model.path if self._model is not None else None

    @property
    def active(self) -> int:
        return self._cells.active if self._cells is not None else 0

    @property
    def _slots(self) -> list[Slot]:
        return self._cells.slots if self._cells is not None else []

    def memory(self) -> dict[str, Any]:
        """The KV cache now: cells reserved by running requests, held by idle slots, free."""
        if self._model is None or self._cells is None:
            return {}
        return {
            **self._cells.usage(),
            "plan": self._model.info["memory"],
            "speculation": self._spec.gate.describe(),
            **(self._governor.describe() if self._governor is not None else {}),
        }

    def tend(self) -> bool:
        """Move to the whole context once it is made (``LoadedModel.grow``), when idle too."""
        model = self._model
        if model is None or model.growing is None:
            return False
        model.grow(wait=False)
        return model.growing is not None

    # --- loading ------------------------------------------------------------------------------

    def load(self, path: Path) -> dict[str, Any]:
        """Load the GGUF at ``path`` (unloading any other); return what loading did.

        Raise ModelLoadError with a message for the user when llama.cpp cannot load it. A file
        that is missing, not a GGUF or truncated is refused before the loaded model is let go:
        one client's bad path must not take the model away from everyone. With no model loaded
        there is nothing to keep serving: the whole file is not read ahead of llama.cpp, which
        refuses a truncated one itself (the gguf package's parse of a real model's tokenizer
        takes seconds, the most of a start; the failure's message is the same, from
        ``_diagnose_load_failure``). A file this daemon has loaded is not read again while it
        is unchanged (the same file, size and times, before and after that load).
        """
        identity = _file_identity(path)
        check_model_file(path, whole=self._model is not None and identity not in self._whole)
        self.close()
        model = load_model(path, self.settings, self.n_batch)
        if identity is not None and _file_identity(path) == identity:
            self._whole.add(identity)
        try:
            self._prompts = Prompts(model)
        except BaseException:
            model.close()
            raise
        self._model = model  # last: until here a failure leaves no half-loaded model behind
        self._writer = RunWriter(model, self._prompts)
        self._loads += 1
        self._swap.clear()  # another model's (or an earlier daemon's) states are of no use
        self._spec.reset(self.settings.speculate)
        self._cells = KVCells(model, self._prompts, self._swap, self.state_dir)
        self._governor = ThreadGovernor(
            model.info["threads"], adapt=self.settings.threads is None, cores=physical_cores()
        )
        return dict(model.info)

    def close(self) -> None:
        if self._model is not None:
            if self._cells is not None:
                self._cells.close()
            self._model.close()
        self._model = None
        self._prompts = None
        self._writer = None
        self._governor = None
        self._cells = None

    def _loaded(self) -> tuple[LoadedModel, Prompts]:
        assert self._model is not None and self._prompts is not None, "no model loaded"
        return self._model, self._prompts

    def _loaded_cells(self) -> KVCells:
        assert self._cells is not None, "no model loaded"
        return self._cells

    def warm(self) -> dict[str, Any]:
        """Make the first question cheap (``KVCells.warm``: the system prompt prefilled)."""
        return self._loaded_cells().warm()

    def reset(self) -> None:
        """Drop every request and every slot's cache (after a failed step); keep the model."""
        self._loaded_cells().reset()

    def clear_prompts(self) -> dict[str, int]:
        """Forget the prompts kept in RAM (``phi4 cache clear``); say how many, and their bytes.
        (Called from the event loop's thread: the cache has a lock of its own.)"""
        cells = self._cells
        return cells.kept.clear() if cells is not None else {"prompts": 0, "bytes": 0}

    # --- the system prompt, prefilled once --------------------------------------------------------

    # --- admitting requests -------------------------------------------------------------------

    def admit(self, job: Job) -> Wait | None:
        """Put a request into a free slot if its reservation fits; else say why it waits.

        Raise ContextOverflowError when it could never fit, even alone.
        """
        model, prompts = self._loaded()
        cells = self._loaded_cells()
        if job.prepared is None or job.prepared.loaded != self._loads:
            job.prepared = prepare(job.params, model, prompts, cells, self._loads)
        prepared: Prepared = job.prepared
        tokens = prepared.tokens
        needed = len(tokens) + prepared.budget + prepared.extra
        deterministic = job.params.ask.deterministic
        # A deterministic request reads its whole prompt afresh: a saved state is not used.
        swapped = None if deterministic else cells.restorable(job.params, tokens)
        if swapped is not None and len(swapped.tokens) > needed:
            swapped = None  # restored whole, it would overrun the reservation, even briefly
        free = cells.free()
        if needed > free:
            return Wait("memory", needed, free)
        if all(slot.run is not None for slot in self._slots) or (deterministic and self.active):
            return Wait("slot", needed, free)  # (the scheduler runs a deterministic one alone)
        restored, restore_s = 0, 0.0
        if swapped is not None:
            slot = min((s for s in self._slots if s.run is None), key=lambda s: s.last_used)
            cells.drop(slot, 0)
            cells.reclaim(needed, slot)
            started = time.monotonic()
            if model.restore_seq(slot.seq, swapped.tokens, swapped.path, swapped.size):
                slot.tokens = list(swapped.tokens)
                restored = min(common_prefix(swapped.tokens, tokens), len(tokens) - 1)
                restore_s = time.monotonic() - started
            assert job.params.session is not None
            self._swap.discard(job.params.session)
        if deterministic:
            self._follow_the_cores(model, hold=True)
            slot = cells.clean_start(tokens)
        elif not restored:
            slot = cells.choose_slot(tokens)
            # A prompt asked before, whose cells were reclaimed since, kept in RAM.
            restored, restore_s = cells.restore_prompt(slot, tokens, needed)
        # At least one prompt token is always evaluated: sampling needs fresh logits.
        keep = min(common_prefix(slot.tokens, tokens), len(tokens) - 1)
        cells.drop(slot, keep)
        slot.prompt_len = 0
        slot.tokens = tokens[:keep]
        slot.shared = min(slot.shared, keep)
        slot.pending = tokens[keep:]
        cells.reclaim(needed, slot)
        streaming = any(s.run is not None and s.run.prompt_s is not None for s in self._slots)
        drafting = not deterministic and self._spec.gate.watching
        slot.run = _new_run(
            job,
            prepared,
            keep,
            model,
            restored=(restored, restore_s),
            behind_stream=streaming,
            drafter=self._spec.drafter(tokens, self._slots) if drafting else None,
        )
        return None

    # --- the step loop ------------------------------------------------------------------------

    def step(self) -> list[tuple[Job, Stats]]:
        """Decode one batch for all active slots; return the requests that finished, with their
        stats. A request whose job was cancelled finishes here, within one step."""
        model, _ = self._loaded()
        finished = [
            self._finish(slot, "cancelled")
            for slot in self._slots
            if slot.run is not None and slot.run.job.cancelled.is_set()
        ]
        chunks: list[tuple[Slot, list[int], bool]] = []  # slot, tokens to feed, prompt done
        answering = [s for s in self._slots if s.run is not None and s.run.prompt_s is not None]
        reading = [s for s in self._slots if s.run is not None and s.run.prompt_s is None]
        waiting = self._loaded_cells().share_prompts(reading, model)
        reading = [s for s in reading if s not in waiting]
        ahead = _ahead_of_streams(reading)
        if ahead:
            # Prompts that came while no answer was streaming (requests sent together, a
            # stream whose own prompt was read first): read in whole batches, in the order they
            # came, while the streams that began since wait. Prompts alone are read fastest: on
            # the CPU ggml's attention works in tiles of 64 rows, and a decode token in a
            # chunk's tile makes the whole tile attend to all its cells (1,000 deep: a quarter
            # more for a 64-token chunk of the shaped Phi-4-mini).
            answering, reading, prompt_room = [], ahead, self.n_batch
        else:
            # A prompt that came while an answer was streaming is read in small chunks beside
            # it, so that no stream a user is watching stalls for long. A burst that came so
            # (requests a little apart) gets a chunk's room for each of its prompts, first come
            # first: read together, in as few steps as one prompt alone would take, rather than
            # one chunk a step among them all (the streams then wait longer a step while it is
            # read, at most a whole batch).
            reading = sorted(reading, key=lambda s: s.run.started if s.run is not None else 0.0)
            prompt_room = PREFILL_CHUNK * len(reading) if answering else self.n_batch
        used = 0
        for slot in answering + reading:
            room = self.n_batch - used
            if slot.run is not None and slot.run.prompt_s is None:
                room = min(room, prompt_room)
                prompt_room -= min(room, len(slot.pending))
            if room <= 0:
                continue
            chunk = slot.pending[:room]
            if chunk:
                chunks.append((slot, chunk, len(chunk) == len(slot.pending)))
                used += len(chunk)
        spec = self._spec
        drafts = spec.drafts(chunks, self.n_batch - used) if spec.gate.watching else {}
        # In sequence order: with a stream per slot, llama.cpp splits a batch into runs of
        # consecutive sequences, one pass over the weights each.
        chunks.sort(key=lambda item: item[0].seq)
        entries: list[tuple[int, int, int, bool]] = []
        fed: list[tuple[Slot, int, int]] = []  # slot, tokens fed, batch index of the last
        for slot, chunk, done in chunks:
            start = len(slot.tokens)
            draft = drafts[slot][0] if slot in drafts else []
            for i, token in enumerate(chunk):
                entries.append((slot.seq, token, start + i, done and i == len(chunk) - 1))
            for i, token in enumerate(draft):  # (each drafted token's logits are sampled)
                entries.append((slot.seq, token, start + len(chunk) + i, True))
            fed.append((slot, len(chunk), len(entries) - 1 - len(draft) if done else -1))
        if not entries:
            return finished
        if model.growing is not None:  # the whole context once made, or now if these need it
            adding = {
                slot.seq: count + len(drafts[slot][0] if slot in drafts else ())
                for slot, count, _ in fed
            }
            model.grow(wait=not self._loaded_cells().holds(model.cells_now, adding))
        if model.shrunk:  # it could not be made: nothing is decoded that the small one cannot hold
            model.shrunk = False
            return finished + self._shrink()
        # A deterministic request decodes alone, on the threads a fresh daemon starts with.
        # (After any wait above: the governor times this step from here.)
        hold = any(slot.run.job.params.ask.deterministic for slot, _, _ in chunks if slot.run)
        self._follow_the_cores(model, hold)
        started = time.perf_counter()
        code = model.decode(entries)
        if code == DECODE_NO_KV_SPACE and model.growing is not None:
            model.grow(wait=True)
            started = time.perf_counter()
            code = model.decode(entries)
        if self._governor is not None:  # (a step of answers alone is one it may measure)
            answers_only = not drafts and all(
                slot.run is not None and slot.run.prompt_s is not None for slot, _, _ in chunks
            )
            self._governor.decoded(time.monotonic(), len(chunks), answers_only)
        if code == DECODE_NO_KV_SPACE:
            return finished + self._out_of_kv()
        if code != DECODE_OK:
            raise RuntimeError(f"llama_decode returned {code}")
        for slot, count, logits_index in fed:
            slot.tokens.extend(slot.pending[:count])
            del slot.pending[:count]
            if logits_index >= 0:
                if slot in drafts:
                    outcome = spec.verify(
                        slot, logits_index, *drafts[slot], model=model, advance=self._advance
                    )
                else:
                    outcome = self._advance(slot, logits_index)
                if outcome is not None:
                    finished.append(outcome)
        if spec.gate.watching:  # (the step's cost: its decode, and each position's draw)
            spec.gate.decoded(len(entries), time.perf_counter() - started)
        return finished

    def _follow_the_cores(self, model: LoadedModel, hold: bool) -> None:
        """Before a decode: the thread count the governor asks for (the configured one with
        ``hold``)."""
        threads = self._governor.check(time.monotonic(), hold) if self._governor else None
        if threads is not None:
            model.set_threads(threads)

    def _shrink(self) -> list[tuple[Job, Stats]]:
        """The plan shrank to the small context (``LoadedModel.grow``): idle slots' cells go
        first, then the requests admitted against the whole context that the small one cannot
        hold stop, the newest first, saying so; queued ones are prepared again against it."""
        model, _ = self._loaded()
        cells = self._loaded_cells()
        capacity = cells.capacity()
        self._loads += 1  # (a queued request's budget was worked out for the whole context)
        if cells.streams:
            for slot in self._slots:
                if slot.run is None and len(slot.tokens) > capacity:
                    cells.drop(slot, 0)
        else:
            cells.reclaim(0, None)
        finished = []
        running = [s for s in self._slots if s.run is not None]
        for slot in sorted(running, key=lambda s: s.run.started if s.run else 0.0, reverse=True):
            assert slot.run is not None
            if (
                (slot.run.reserved <= capacity)
                if cells.streams
                else (cells.committed() <= capacity)
            ):
                continue
            fault = Fault(
                "max_tokens",
                slot.run.reserved,
                capacity,
                n_ctx=model.n_ctx,
                prompt=len(slot.run.prompt),
                shrunk=True,
            )
            slot.run.job.cancel(ErrorCode.CONTEXT_OVERFLOW, log_words(fault), fault)
            finished.append(self._finish(slot, "context"))
        return finished

    def _out_of_kv(self) -> list[tuple[Job, Stats]]:
        """llama.cpp found no room although every reservation fits (this should not happen):
        free idle slots' cells; failing that, stop the request admitted last, which has the
        least work to lose, rather than fail them all."""
        log.error("the KV cache is full although reservations fit: %s", self.memory())
        freed = False
        for slot in self._slots:
            # (A stream holds only its own slot's cells: freeing others' would not help.)
            if slot.run is None and slot.tokens and not self._loaded_cells().streams:
                self._loaded_cells().drop(slot, 0)
                freed = True
        if freed:
            return []
        running = [s for s in self._slots if s.run is not None]
        victim = max(running, key=lambda s: s.run.started if s.run else 0.0)
        assert victim.run is not None
        victim.run.job.cancel(ErrorCode.CONTEXT_OVERFLOW)
        return [self._finish(victim, "context")]

    def _advance(self, slot: Slot, logits_index: int) -> tuple[Job, Stats] | None:
        """Sample the slot's next token and pass its text on; return the finished request."""
        run = slot.run
        assert run is not None
        now = time.monotonic()
        if run.prompt_s is None:
            run.prompt_s = now - run.started
            run.decode_started = now
        if run.finish_reason is not None:  # the last token is in the KV now: done
            return self._finish(slot, run.finish_reason)
        assert self._writer is not None
        ended = self._writer.advance(slot, logits_index, now)
        return self._finish(slot, ended) if ended is not None else None

    def _finish(self, slot: Slot, reason: str) -> tuple[Job, Stats]:
        model, prompts = self._loaded()
        run = slot.run
        assert run is not None
        assert self._writer is not None
        self._writer.flush(run)
        run.sampler.close()
        if run.drafter is not None:
            self._spec.keep(run.drafter, slot.tokens, run.generated)
        slot.pending = []
        slot.run = None
        slot.last_used = time.monotonic()
        prefilled = run.prompt_s is not None
        slot.session = run.job.params.session if run.chat is not None and prefilled else None
        slot.prompt_len = len(run.prompt) if run.chat is None and prefilled else 0
        chat = (
            prompts.remember_turn(run.job.params, run.chat, list(slot.tokens), run.splitter.answer)
            if run.chat is not None and prefilled
            else {}
        )
        return run.job, run.stats(reason, chat, slot.seq, str(model.path))


def _new_run(
    job: Job,
    prepared: Prepared,
    cached: int,
    model: LoadedModel,
    restored: tuple[int, float],
    behind_stream: bool,
    drafter: Drafter | None,
) -> Run:
    """A request admitted into a slot: its sampler (its seed drawn if it gave none), its
    thinking's splitter and policy, its confidence trace if asked for; ``cached`` of its prompt
    tokens in the slot already, ``restored`` (tokens, seconds) from a saved state."""
    params, tokens = job.params, prepared.tokens
    sampling = params.ask.sampling
    seed = sampling.seed if sampling.seed is not None else random.getrandbits(31)
    return Run(
        job=job,
        prompt=tokens,
        cached=cached,
        chat=prepared.chat,
        seed=seed,
        sampler=_make_sampler(sampling, seed, model.model.n_vocab()),
        budget=prepared.budget,
        max_len=len(tokens) + prepared.budget + prepared.extra,
        reserved=len(tokens) + prepared.budget + prepared.extra,
        splitter=ThinkSplitter(starts_in_reasoning=model.thinks),
        policy=ThinkingPolicy.asked(params.ask),
        trace=TraceConfidence() if params.confidence else None,
        restored=restored[0],
        restore_s=restored[1],
        behind_stream=behind_stream,
        drafter=drafter,
    )


def prepare(
    params: SolveParams, model: LoadedModel, prompts: Prompts, cells: KVCells, loads: int
) -> Prepared:
    """Work out a request's tokens and generation budget (``loads``: the engine's models
    loaded so far, which the result is good for).

    The budget is ``max_tokens`` if given, else what fills the plan's per-request tokens
    (at least a quarter of them, for a long conversation). Raise ContextOverflowError when
    the request could never fit in the context, even alone.
    """
    capacity = cells.capacity()
    # Shared layout: the plan's requests share what the system prompt leaves, so that as many
    # as it says fit at once (4 x 4,096 of 16,384 cells did not fit beside its 24).
    share = capacity if cells.streams else capacity // max(1, model.plan.parallel)
    default = min(model.plan.request_tokens, share)
    chat: ChatPlan | None = None
    max_tokens = params.ask.max_tokens
    if params.session is not None:
        # Trimmed to what admit() checks, so a chat that must drop turns drops enough.
        tokens, chat = prompts.chat_turn(params, max_tokens or default // 4, capacity)
    else:
        tokens = prompts.question(params)
    room = capacity - len(tokens)
    # What does not fit, as data: each door words it (the CLI its flags, serve OpenAI's).
    fault = Fault(
        "prompt",
        len(tokens),
        capacity,
        prompt=len(tokens),
        n_ctx=model.n_ctx,
        streams=len(cells.slots) if cells.streams else 0,
        system=0 if cells.streams else len(cells.system_tokens),
    )
    if room < 1:  # the prompt alone: no --max-tokens would make it fit
        raise ContextOverflowError(fault)
    if max_tokens is not None:
        if max_tokens > room:
            raise ContextOverflowError(
                fault._replace(param="max_tokens", needed=len(tokens) + max_tokens)
            )
        budget = max_tokens
    else:
        budget = min(room, max(default - len(tokens), default // 4))
    if budget < 1:
        raise ContextOverflowError(fault)
    extra = min(THINK_CLOSE_ROOM, room - budget) if params.ask.think_budget is not None else 0
    return Prepared(loads, tokens, budget, extra, chat)


def check_model_file(path: Path, whole: bool = True) -> None:
    """Raise ModelLoadError unless ``path`` is a GGUF file; with ``whole``, a complete one
    (header and tensor data)."""
    from phi4cli.core.errors import InvalidModelError
    from phi4cli.core.models import check_gguf_magic, validate_gguf

    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist")
    try:
        validate_gguf(path) if whole else check_gguf_magic(path)
    except InvalidModelError as exc:
        raise ModelLoadError(str(exc)) from None


def _file_identity(path: Path) -> tuple[int, int, int, int, int] | None:
    """What tells one state of a file from another: device, inode, size, mtime and ctime (which,
    unlike mtime, no one can set back after rewriting the file in place)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _ahead_of_streams(reading: list[Slot]) -> list[Slot]:
    """The reading slots whose requests came while no answer was streaming, first admitted
    first: every answer streaming now began after them. (One admitted behind a stream stays
    behind, whichever streams run later.)"""
    ahead = [s for s in reading if s.run is not None and not s.run.behind_stream]
    return sorted(ahead, key=lambda s: s.run.started if s.run is not None else 0.0)


def _make_sampler(sampling: Sampling, seed: int, n_vocab: int) -> Any:
    """llama.cpp's chain, in llama-server's order: the penalties (greedy or not, as there),
    then top-k, top-p, min-p and the temperature before the draw."""
    sampler = llama_internals.LlamaSampler()
    if sampling.repeat_penalty != 1.0 or sampling.frequency_penalty or sampling.presence_penalty:
        sampler.add_penalties(
            n_vocab,
            REPEAT_LAST_N,
            sampling.repeat_penalty,
            sampling.frequency_penalty,
            sampling.presence_penalty,
        )
    if sampling.temperature <= 0.0:
        sampler.add_greedy()
    else:
        sampler.add_top_k(TOP_K if sampling.top_k is None else sampling.top_k)
        sampler.add_top_p(sampling.top_p, 1)
        if sampling.min_p > 0.0:
            sampler.add_min_p(sampling.min_p, 1)
        sampler.add_temp(sampling.temperature)
        sampler.add_dist(seed)
    return sampler
