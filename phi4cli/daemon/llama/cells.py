"""Who holds which cells of the one llama context: the slots (each a sequence of a shared
cache, or a stream of its own), the system prompt (prefilled once, its state saved to disk and
restored by the next daemon), and chat sessions swapped out to disk when their slot's cells are
taken. The engine (``batch.py``) asks it for room and for a slot; it never decodes a request's
tokens itself (the system prompt's prefill aside)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import llama_cpp

from phi4cli.daemon.jobs import SolveParams
from phi4cli.daemon.llama.model import LoadedModel
from phi4cli.daemon.llama.prompt_cache import MIN_TOKENS, PromptCache, common_prefix
from phi4cli.daemon.llama.prompts import Prompts
from phi4cli.daemon.llama.slots import Slot
from phi4cli.daemon.sessions import SwappedSession, SwapStore
from phi4cli.daemon.statefile import remove_state

log = logging.getLogger("phi4.engine")

# A chat session whose cells are reclaimed is saved to disk if it holds at least this many tokens
# of its own (fewer are as quick to re-read).
SWAP_MIN_TOKENS = 64
# With a stream per slot, a new request takes the lowest idle slot (keeping the running ones
# consecutive) unless another idle slot holds at least this many more tokens of its prompt.
STREAM_REUSE_MIN = 256
# Prompts whose cells were reclaimed, kept in RAM (prompt_cache.py): at most this many bytes.
PROMPT_CACHE_BYTES = 1 << 30


# Prompt tokens another request's cache must hold beyond a reading one's to be shared with it
# rather than read (KVCells.share_prompts).
SHARE_MIN = 16


class KVCells:
    """The context's cells for one loaded model (see the module docstring)."""

    def __init__(
        self, model: LoadedModel, prompts: Prompts, swap: SwapStore, state_dir: Path | None
    ) -> None:
        self.model, self.prompts, self.swap, self.state_dir = model, prompts, swap, state_dir
        self.slots = [Slot(seq=i) for i in range(model.plan.slots)]
        self.streams = model.plan.kv_layout == "streams"  # one stream per slot
        # Streams: no sequence of its own for the system prompt (it would take a whole stream);
        # it is read into the first slot and copied from there.
        self.system_seq = 0 if self.streams else model.plan.slots
        self.system_tokens: list[int] = []
        self.system_state: Any = None  # the system prompt's KV (a buffer), once warm
        self.kept = PromptCache(PROMPT_CACHE_BYTES)  # prompts whose cells were reclaimed

    @property
    def active(self) -> int:
        return sum(slot.run is not None for slot in self.slots)

    def usage(self) -> dict[str, Any]:
        """The cells now: reserved by running requests, held by idle slots, free."""
        reserved = self.committed()
        idle = sum(s.own_cells for s in self.slots if s.run is None)
        if self.streams:  # the free streams' cells
            free = self.capacity() * (len(self.slots) - self.active)
        else:
            free = self.capacity() - reserved
        growing = self.model.growing  # the whole context, while it is made
        since = {"context_growing_s": round(growing.elapsed(), 1)} if growing is not None else {}
        return {
            "n_ctx": self.model.n_ctx,
            "context_cells": self.model.cells_now,  # fewer while the whole context is made
            **since,
            "system_tokens": len(self.system_tokens),
            "reserved_tokens": reserved,
            "idle_cached_tokens": idle,
            "free_tokens": free,
            "kv_layout": self.model.plan.kv_layout,
            "running": self.active,
            "slots": len(self.slots),
            "swapped_sessions": len(self.swap),
            "prompt_cache": self.kept.usage(),
        }

    def close(self) -> None:
        for slot in self.slots:
            if slot.run is not None:
                slot.run.sampler.close()

    def warm(self) -> dict[str, Any]:
        """Make the first question cheap: one warm-up decode, then the default system prompt's
        KV in the reserved sequence — restored from the state an earlier daemon saved, or
        computed and saved."""
        model, prompts = self.model, self.prompts
        started = time.monotonic()
        prefix = prompts.system_prefix(None)
        model.evaluate(self.system_seq, prefix[:1], 0)  # allocates llama.cpp's compute buffers
        model.seq_rm(self.system_seq, 0)
        warmup_s = time.monotonic() - started
        started = time.monotonic()
        state_file = self._state_file(prefix)
        restored = state_file is not None and model.restore_seq(
            self.system_seq, prefix, state_file, self._state_bound(len(prefix))
        )
        if not restored:
            model.seq_rm(self.system_seq, 0)
            model.evaluate(self.system_seq, prefix, 0)
            if state_file is not None:
                # One daemon per home: a temp file here is a killed daemon's, never finished.
                for leftover in state_file.parent.glob(".system-*.tmp"):
                    remove_state(leftover)
                model.save_seq(self.system_seq, prefix, state_file)
        self.system_tokens = prefix
        # Streams: fresh slots get a copy of it. Both layouts: a deterministic request puts it
        # back into an emptied cache (_clean_start).
        self.system_state = model.seq_state(self.system_seq)
        if self.streams:
            # The first slot holds it, as its own cells.
            self.slots[0].tokens = list(prefix)
            self.slots[0].last_used = time.monotonic()
        return {
            "warmup_s": round(warmup_s, 4),
            "prefill_s": round(time.monotonic() - started, 4),
            "prefill": "restored" if restored else "computed",
            "system_tokens": len(prefix),
        }

    def _state_bound(self, tokens: int) -> int:
        """The most bytes a saved state of ``tokens`` tokens may take: their KV, and a generous
        allowance for the header and llama.cpp's per-layer framing."""
        model = self.model
        return tokens * (model.plan.kv_bytes_per_token + 4) + (4 << 20)

    def _state_file(self, prefix: list[int]) -> Path | None:
        """Where the prefilled state of ``prefix`` is kept, keyed by everything it depends on."""
        if self.state_dir is None:
            return None
        path = self.model.path
        stat = path.stat()
        key = hashlib.sha256(
            json.dumps(
                [
                    str(path),
                    stat.st_size,
                    stat.st_mtime_ns,
                    prefix,
                    llama_cpp.__version__,
                    self.model.plan.kv_cache_type,
                    # llama.cpp loads a state only into as many streams as it was saved from
                    [self.model.plan.slots] if self.streams else [],
                ],
            ).encode()
        ).hexdigest()[:24]
        return self.state_dir / f"system-{key}.state"

    def capacity(self) -> int:
        """KV cells that one request may reserve. Shared: all but the system prompt's (a request
        reserves its whole prompt and budget, though a fresh one shares the system prompt's
        cells: a few cells' slack that keeps the count exact whichever slot it lands in).
        Streams: a stream's."""
        model = self.model
        if self.streams:
            return model.plan.request_capacity
        return model.n_ctx - len(self.system_tokens)

    def holds(self, cells: int, adding: dict[int, int]) -> bool:
        """Whether a context of ``cells`` cells in all holds the tokens the cache holds now and
        ``adding`` (tokens for some sequences): shared, the system prompt's cells once and each
        slot's own; streams, each slot's tokens and its additions in its stream."""
        if self.streams:
            stream = cells // len(self.slots)
            return all(len(s.tokens) + adding.get(s.seq, 0) <= stream for s in self.slots)
        held = len(self.system_tokens) + sum(slot.own_cells for slot in self.slots)
        return held + sum(adding.values()) <= cells

    def committed(self) -> int:
        return sum(slot.run.reserved for slot in self.slots if slot.run is not None)

    def free(self) -> int:
        """Cells a new request may reserve now: beside the running requests' reservations
        (shared), or a stream's, once a slot is free (streams)."""
        if self.streams:
            return self.capacity()
        return self.capacity() - self.committed()

    def restorable(self, params: SolveParams, tokens: list[int]) -> SwappedSession | None:
        """The saved state of this chat session, if restoring it beats what the idle slots
        hold; else None."""
        if params.session is None:
            return None
        swapped = self.swap.get(params.session)
        if swapped is None:
            return None
        held = max(
            (common_prefix(s.tokens, tokens) for s in self.slots if s.run is None), default=0
        )
        usable = common_prefix(swapped.tokens, tokens)  # a /retry continues from an earlier turn
        return swapped if usable >= held + SWAP_MIN_TOKENS else None

    def drop(self, slot: Slot, keep: int) -> None:
        """Remove a slot's cells from position ``keep`` on; a chat session's tokens that would be
        lost are saved to disk first, for its next turn to restore."""
        model, prompts = self.model, self.prompts
        if keep >= len(slot.tokens):
            return
        session = prompts.sessions.get(slot.session) if slot.session else None
        path = self.swap.path_for(slot.session) if slot.session else None
        if (
            session is not None
            and path is not None
            and session.tokens == slot.tokens
            and len(slot.tokens) - keep >= SWAP_MIN_TOKENS
        ):
            started = time.monotonic()
            size = model.save_seq(slot.seq, slot.tokens, path)
            if size is not None:
                self.swap.add(session.id, slot.tokens, size)
                log.info(
                    "swapped session %s out (%d tokens, %.3f s)",
                    session.id,
                    len(slot.tokens),
                    time.monotonic() - started,
                )
        elif session is None:
            self._keep_prompt(slot, keep)
        slot.session = None
        model.seq_rm(slot.seq, keep)
        del slot.tokens[keep:]
        slot.shared = min(slot.shared, keep)

    def _keep_prompt(self, slot: Slot, keep: int) -> None:
        """Before an idle slot's cells from ``keep`` on go: the prompt of the request it
        answered, if they hold MIN_TOKENS of it and more than the system prompt, is kept in RAM
        (its answer's cells are let go first: a prompt asked again needs only its own)."""
        length, slot.prompt_len = slot.prompt_len, 0
        if (
            slot.run is not None
            or length - max(keep, len(self.system_tokens)) < MIN_TOKENS
            or length > len(slot.tokens)
            or not self.kept.max_bytes
        ):
            return
        if len(slot.tokens) > length:
            self.model.seq_rm(slot.seq, length)
            del slot.tokens[length:]
        self.kept.put(slot.tokens, bytes(self.model.seq_state(slot.seq)))

    def restore_prompt(self, slot: Slot, tokens: list[int], needed: int) -> tuple[int, float]:
        """Put back into ``slot`` the kept prompt sharing the longest prefix with ``tokens``,
        where it holds MIN_TOKENS more of them than the slot does and fits the reservation of
        ``needed`` cells; return the prompt's tokens it holds and the seconds it took (0, 0.0
        for none). The slot is chosen (``choose_slot``) and idle."""
        held = common_prefix(slot.tokens, tokens)
        found = self.kept.best(tokens, held + MIN_TOKENS - 1)
        if found is None or len(found[0].tokens) > needed:
            return 0, 0.0
        entry, shared = found
        started = time.monotonic()
        self.drop(slot, 0)
        self.reclaim(needed, slot)
        if not self.model.set_seq_state(slot.seq, bytearray(entry.state)):
            return 0, 0.0  # (the slot is empty: the prompt is read whole)
        slot.tokens, slot.shared = list(entry.tokens), 0
        restored = min(shared, len(tokens) - 1)
        self.kept.counted(restored - held)
        return restored, time.monotonic() - started

    def choose_slot(self, tokens: list[int]) -> Slot:
        """Pick the idle slot sharing the longest prefix with ``tokens`` (least recently used on
        ties); give a slot that shares less than the system prompt the system prompt's KV.

        With a stream per slot, the lowest idle slot instead, unless another holds at least
        STREAM_REUSE_MIN more of the prompt (a conversation): llama.cpp decodes a batch in one
        pass over the weights only for consecutive sequences, so a gap among the running slots
        costs a whole extra pass every step (a 1-token step of 0 and 2 takes as long as two)."""
        model = self.model
        idle = [slot for slot in self.slots if slot.run is None]
        best = max(idle, key=lambda s: (common_prefix(s.tokens, tokens), -s.last_used))
        shared = common_prefix(best.tokens, tokens)
        if self.streams:
            lowest = min(idle, key=lambda s: s.seq)
            if shared - common_prefix(lowest.tokens, tokens) < STREAM_REUSE_MIN:
                best, shared = lowest, common_prefix(lowest.tokens, tokens)
        system = self.system_tokens
        if system and shared < len(system) and tokens[: len(system)] == system:
            if not self.streams:
                best = min(idle, key=lambda s: s.last_used)
                self.drop(best, 0)
                model.seq_cp(self.system_seq, best.seq, len(system))
                best.shared = len(system)
                best.tokens = list(system)
                return best
            self.drop(best, 0)
            if self.system_state is not None and model.set_seq_state(best.seq, self.system_state):
                best.tokens = list(system)
            # else empty: the system prompt is read with the question
        return best

    def clean_start(self, tokens: list[int]) -> Slot:
        """The first slot, its cache as on a fresh daemon, for a deterministic request (nothing
        else running): llama.cpp's arithmetic depends on the cells around a sequence, not only
        on its tokens.

        Shared layout: every idle slot's cells go (a chat session's are saved to disk first, as
        always) and the system prompt's state is put back into the emptied cache, so it lies at
        cells 0..S-1 and the question is read into the cells after it, the used span (n_kv) and
        the mask the same as after ``warm``. Streams: the first slot's own stream gets the same
        treatment; the other streams do not take part in its arithmetic and keep their cells.
        The prompt is then read from there in the step loop's n_batch chunks, alone, on the
        threads a fresh daemon starts with (the system prompt too, if it is read again here:
        the engine holds its threads first)."""
        model = self.model
        slot = self.slots[0]
        system = self.system_tokens
        starts_with_system = bool(system) and tokens[: len(system)] == system
        if self.streams:
            self.drop(slot, 0)
            if (
                starts_with_system
                and self.system_state is not None
                and model.set_seq_state(slot.seq, self.system_state)
            ):
                slot.tokens = list(system)
            return slot
        for other in self.slots:
            self.drop(other, 0)
        # Emptying the cache moves llama.cpp's search for free cells back to cell 0; failing a
        # restore, the system prompt is computed again there, as ``warm`` did.
        if system and not (
            self.system_state is not None
            and model.set_seq_state(self.system_seq, self.system_state)
        ):
            model.evaluate(self.system_seq, system, 0)
        if starts_with_system:
            model.seq_cp(self.system_seq, slot.seq, len(system))
            slot.shared = len(system)
            slot.tokens = list(system)
        return slot

    def reclaim(self, needed: int, chosen: Slot | None) -> None:
        """Free idle slots' cached cells, least recently used first, until the running
        requests' reservations and ``needed`` fit beside what stays cached (shared layout; a
        stream holds only its own slot's cells)."""
        if self.streams:
            return
        room = self.capacity() - self.committed() - needed
        idle = sorted(
            (s for s in self.slots if s.run is None and s is not chosen and s.own_cells > 0),
            key=lambda s: s.last_used,
        )
        cached = sum(s.own_cells for s in idle)
        for slot in idle:
            if cached <= room:
                break
            cached -= slot.own_cells
            self.drop(slot, 0)

    def reset(self) -> None:
        """Drop every request and every slot's cache (after a failed step); keep the model."""
        model = self.model
        for slot in self.slots:
            if slot.run is not None:
                slot.run.sampler.close()
            slot.run, slot.pending, slot.tokens, slot.shared = None, [], [], 0
            slot.session, slot.prompt_len = None, 0
            model.seq_rm(slot.seq, 0)

    def share_prompts(self, reading: list[Slot], model: LoadedModel) -> set[Slot]:
        """Prompts read once: a reading request whose prompt another slot's cache holds further
        (the same question, K samples of it, serve's ``n`` choices) takes those cells from it —
        shared, not copied, in the unified cache — instead of reading them; one that another
        request admitted before it is still reading further waits for it, rather than read the
        same tokens beside it. Return the slots that wait this step. (Not with a stream per
        slot, whose cells cannot be shared; not for a deterministic request, which reads its
        prompt afresh.)"""
        if self.streams or not reading:
            return set()
        waiting: set[Slot] = set()
        readers = sorted(reading, key=lambda s: s.run.started if s.run is not None else 0.0)
        for index, slot in enumerate(readers):
            run = slot.run
            assert run is not None
            if run.job.params.ask.deterministic:
                continue
            limit = len(run.prompt) - 1  # (its last token is read: sampling needs its logits)
            have = len(slot.tokens)
            source, held = None, have
            for other in self.slots:
                if other is slot or (
                    other.run is not None and other.run.job.params.ask.deterministic
                ):
                    continue
                shared = min(common_prefix(other.tokens, run.prompt), limit)
                if shared > held:
                    source, held = other, shared
            if source is not None and held >= have + SHARE_MIN:
                model.seq_cp(source.seq, slot.seq, held, start=have)
                slot.tokens.extend(run.prompt[have:held])
                del slot.pending[: held - have]
                run.cached += held - have
                have = held
            for other in readers[:index]:
                assert other.run is not None
                ahead = min(common_prefix(other.run.prompt, run.prompt), limit)
                if other.pending and ahead >= have + SHARE_MIN and len(other.tokens) < ahead:
                    waiting.add(slot)
                    break
        return waiting
