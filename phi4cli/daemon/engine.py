"""The inference engine: the ONLY module that imports llama_cpp.

One llama context holds several sequences (slots) in a unified KV cache. Requests are admitted into
slots and decoded together, one batch per step (continuous batching): each step gives every slot
that is answering its next token and shares the rest of the batch among prompts being read, in
chunks, so a long prompt never stalls the streams already running. A fresh slot starts from the
system prompt's KV, shared from a reserved sequence rather than recomputed; a slot keeps its tokens
after a request, so a follow-up chat turn or a repeated question reuses them.
"""

from __future__ import annotations

import codecs
import ctypes
import hashlib
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals as llama_internals
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from phi4cli import protocol
from phi4cli.daemon.ramdisk import stage
from phi4cli.daemon.scheduler import ContextOverflowError, Job, ModelLoadError, SolveParams
from phi4cli.daemon.sessions import ChatSession, Message, SessionStore
from phi4cli.reasoning import THINK_CLOSE, THINK_OPEN, ThinkSplitter, model_thinks

log = logging.getLogger("phi4.engine")

# The model card samples with transformers' defaults besides temperature/top_p, i.e. top_k=50.
TOP_K = 50
# Used when a GGUF carries no chat template (rare): Phi-4-mini's own format.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
DECODE_OK, DECODE_NO_KV_SPACE = 0, 1
# Prompt tokens read per step while other requests are answering.
PREFILL_CHUNK = 64


def physical_cores() -> int:
    """Return the number of physical cores this process may run on (hyperthreads count once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    cores: set[tuple[str, str]] = set()
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (
                    (topology / "physical_package_id").read_text().strip(),
                    (topology / "core_id").read_text().strip(),
                )
            )
        except OSError:
            return max(1, len(allowed))
    return max(1, len(cores) or (os.cpu_count() or 1))


@dataclass(eq=False)
class _Run:
    """One request in a slot: its prompt, sampler, and how far it has got."""

    job: Job
    prompt: list[int]
    cached: int
    plan: dict[str, Any] | None
    seed: int
    sampler: Any
    limit: int
    splitter: ThinkSplitter
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    started: float = field(default_factory=time.monotonic)
    prompt_s: float | None = None
    first_token_s: float | None = None
    decode_started: float = 0.0
    generated: int = 0
    reasoning_tokens: int = 0
    budget_reached: bool = False
    finish_reason: str | None = None  # set: finished once its pending tokens are evaluated


@dataclass(eq=False)
class _Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # what the KV holds for this sequence
    pending: list[int] = field(default_factory=list)  # tokens to evaluate next
    run: _Run | None = None
    last_used: float = 0.0


class LlamaEngine:
    """Several requests at once over one model and one context (see the module docstring)."""

    def __init__(
        self,
        n_ctx: int,
        threads: int | None = None,
        n_batch: int = 512,
        parallel: int = 4,
        ramdisk: str = "off",
        mlock: bool = False,
        state_dir: Path | None = None,
    ) -> None:
        self.n_ctx = n_ctx
        self.threads = threads or physical_cores()
        self.n_batch = n_batch
        self.parallel = parallel
        self.ramdisk = ramdisk
        self.mlock = mlock
        self.state_dir = state_dir  # where prefilled system-prompt states are kept
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._formatter: Jinja2ChatFormatter | None = None
        self._model_path: Path | None = None
        self._piece_buffer = ctypes.create_string_buffer(64)
        self._thinks = False  # the loaded model reasons before answering, maybe without <think>
        self._tag_tokens: dict[int, bytes] = {}
        self._glue: tuple[str, str] | None = None
        self._sessions = SessionStore()
        self._slots: list[_Slot] = []
        self._system_seq = parallel  # the reserved sequence holding the system prompt's KV
        self._system_tokens: list[int] = []

    @property
    def model_path(self) -> Path | None:
        return self._model_path

    @property
    def active(self) -> int:
        return sum(slot.run is not None for slot in self._slots)

    def free_slots(self) -> int:
        return sum(slot.run is None for slot in self._slots)

    # --- loading ------------------------------------------------------------------------------

    def load(self, path: Path) -> dict[str, Any]:
        """Load the GGUF at ``path`` (unloading any other); return timings.

        Raise ModelLoadError with a message for the user when llama.cpp cannot load it.
        """
        self.close()
        if not path.is_file():
            raise ModelLoadError(f"model file {path} does not exist")
        staging = stage(path, self.ramdisk)
        started = time.monotonic()
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_mlock = self.mlock
        try:
            model = llama_internals.LlamaModel(
                path_model=str(staging.path), params=model_params, verbose=False
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(_diagnose_load_failure(path, exc)) from None
        try:
            context_params = llama_cpp.llama_context_default_params()
            context_params.n_ctx = self.n_ctx
            context_params.n_batch = self.n_batch
            context_params.n_ubatch = self.n_batch
            context_params.n_seq_max = self.parallel + 1
            context_params.kv_unified = True  # slots share the cells of one n_ctx-sized cache
            context_params.n_threads = self.threads
            context_params.n_threads_batch = self.threads
            context = llama_internals.LlamaContext(
                model=model, params=context_params, verbose=False
            )
            batch = llama_internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1)
            self._prepare(model, path)
        except BaseException as exc:
            self.close()
            model.close()
            if isinstance(exc, ValueError):
                raise ModelLoadError(
                    f"llama.cpp could not create a context for {path}: {exc}"
                ) from None
            raise
        self._model, self._ctx, self._batch = model, context, batch
        self._model_path = path  # last: until here a failure leaves no half-loaded model behind
        self._slots = [_Slot(seq=i) for i in range(self.parallel)]
        load_s = time.monotonic() - started
        log.info("loaded %s from %s in %.2f s (threads %d, %d slots)", path, staging.path,
                 load_s, self.threads, self.parallel)  # fmt: skip
        return {
            "model": str(path),
            "loaded_from": str(staging.path),
            "staged": staging.staged,
            "stage_copied": staging.copied,
            "stage_s": round(staging.seconds, 4),
            "stage_note": staging.note,
            "load_s": round(load_s, 4),
            "n_ctx": self.n_ctx,
            "threads": self.threads,
            "parallel": self.parallel,
            "mlock": self.mlock,
        }

    def _prepare(self, model: Any, path: Path) -> None:
        """Set up what depends on the loaded model: template, think tags, turn glue."""
        metadata = model.metadata()
        template = metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATE
        self._formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(model.token_eos()),
            bos_token=model.token_get_text(model.token_bos()),
        )
        self._vocab = model.vocab
        self._thinks = model_thinks(str(metadata.get("general.name", "")), path.name)
        self._glue = self._turn_glue()
        self._sessions.clear()
        self._tag_tokens = {}
        for tag in (THINK_OPEN, THINK_CLOSE):
            ids = self._tokenize(tag, add_bos=False)
            if len(ids) == 1:  # a special token: rendered explicitly, as pieces hide specials
                self._tag_tokens[ids[0]] = tag.encode()

    def close(self) -> None:
        for resource in (self._batch, self._ctx, self._model):
            if resource is not None:
                resource.close()
        self._model = self._ctx = self._batch = None
        self._formatter = None
        self._model_path = None
        self._slots = []
        self._system_tokens = []

    # --- the system prompt, prefilled once --------------------------------------------------------

    def warm(self) -> dict[str, Any]:
        """Make the first question cheap: one warm-up decode, then the default system prompt's
        KV in the reserved sequence — restored from the state an earlier daemon saved, or
        computed and saved."""
        started = time.monotonic()
        prefix = self._system_prefix(None)
        self._evaluate(self._system_seq, prefix[:1], 0)  # allocates llama.cpp's compute buffers
        self._seq_rm(self._system_seq, 0)
        warmup_s = time.monotonic() - started
        started = time.monotonic()
        state_file = self._state_file(prefix)
        restored = state_file is not None and self._restore_prefix(state_file, prefix)
        if not restored:
            self._seq_rm(self._system_seq, 0)
            self._evaluate(self._system_seq, prefix, 0)
            if state_file is not None:
                self._save_prefix(state_file, prefix)
        self._system_tokens = prefix
        return {
            "warmup_s": round(warmup_s, 4),
            "prefill_s": round(time.monotonic() - started, 4),
            "prefill": "restored" if restored else "computed",
            "system_tokens": len(prefix),
        }

    def _state_file(self, prefix: list[int]) -> Path | None:
        """Where the prefilled state of ``prefix`` is kept, keyed by everything it depends on."""
        if self.state_dir is None or self._model_path is None:
            return None
        stat = self._model_path.stat()
        key = hashlib.sha256(
            json.dumps(
                [str(self._model_path), stat.st_size, stat.st_mtime_ns, prefix,
                 llama_cpp.__version__],
            ).encode()
        ).hexdigest()[:24]  # fmt: skip
        return self.state_dir / f"system-{key}.state"

    def _restore_prefix(self, state_file: Path, prefix: list[int]) -> bool:
        if not state_file.is_file():
            return False
        tokens = (llama_cpp.llama_token * len(prefix))()
        count = ctypes.c_size_t(0)
        self._seq_rm(self._system_seq, 0)
        size = llama_cpp.llama_state_seq_load_file(
            self._ctx.ctx, str(state_file).encode(), self._system_seq, tokens, len(prefix),
            ctypes.byref(count),
        )  # fmt: skip
        if not size or list(tokens[: count.value]) != prefix:
            log.warning("ignoring unusable prompt state %s", state_file)
            self._seq_rm(self._system_seq, 0)
            return False
        return True

    def _save_prefix(self, state_file: Path, prefix: list[int]) -> None:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        partial = state_file.with_name(f".{state_file.name}.{os.getpid()}.part")
        tokens = (llama_cpp.llama_token * len(prefix))(*prefix)
        if llama_cpp.llama_state_seq_save_file(
            self._ctx.ctx, str(partial).encode(), self._system_seq, tokens, len(prefix)
        ):
            os.replace(partial, state_file)  # a restarting daemon never reads half a state
        else:
            partial.unlink(missing_ok=True)

    # --- prompts ------------------------------------------------------------------------------

    def _render(self, system: str | None, turns: list[Message]) -> str:
        """Render a conversation with the model's own chat template, ready for the answer."""
        assert self._formatter is not None
        messages = [{"role": "system", "content": system}] if system else []
        return self._formatter(messages=messages + turns).prompt  # type: ignore[arg-type]

    def _tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        data = text.encode()
        capacity = len(data) + 16
        while True:
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(
                self._vocab, data, len(data), buffer, capacity, add_bos, True
            )
            if count >= 0:
                return list(buffer[:count])
            capacity = -count

    def _system_prefix(self, system: str | None) -> list[int]:
        """Tokens every conversation with this system prompt starts with (cached at load)."""
        marker = "\x00"
        text = self._render(system, [{"role": "user", "content": marker}])
        return self._tokenize(text[: text.index(marker)])

    def _turn_glue(self) -> tuple[str, str] | None:
        """Return the template text between an answer and the next question, and between a
        question and its answer; None if this template is not a plain concatenation of turns.
        """
        marks = ("\x01", "\x02", "\x03")
        text = self._render(
            None,
            [
                {"role": "user", "content": marks[0]},
                {"role": "assistant", "content": marks[1]},
                {"role": "user", "content": marks[2]},
            ],
        )
        positions = [text.find(mark) for mark in marks]
        if -1 in positions or positions != sorted(positions) or text.count(marks[1]) != 1:
            return None
        between_user_and_answer = text[positions[0] + 1 : positions[1]]
        after_answer = text[positions[1] + 1 : positions[2]]
        after_question = text[positions[2] + 1 :]
        if between_user_and_answer != after_question:
            return None
        return after_answer, after_question

    def _chat_tokens(self, params: SolveParams) -> tuple[list[int], dict[str, Any]]:
        """Return the tokens for a chat turn and facts about how they were made.

        A known session is continued from the tokens it already has; otherwise (new session,
        daemon restarted, another system prompt) the transcript is rendered once. Turns that do
        not fit, with room for the answer, are dropped oldest first.
        """
        assert params.session is not None and self._model_path is not None
        history = list(params.history)
        question = {"role": "user", "content": params.prompt}
        reserve = min(params.max_tokens or self.n_ctx // 4, self.n_ctx // 2)
        session = self._sessions.get(params.session)
        dropped = 0
        while True:
            base = session.continues(self._model_path, params.system, history) if session else None
            if base is not None and self._glue is not None and session is not None:
                after_answer, after_question = self._glue
                glue = after_answer + params.prompt + after_question
                tokens = session.tokens[:base] + self._tokenize(glue, add_bos=False)
                rebuilt = False
            else:
                tokens = self._tokenize(self._render(params.system, [*history, question]))
                rebuilt = bool(history)
            if len(tokens) + reserve <= self.n_ctx or not history:
                break
            history = history[2:]
            dropped += 1
            session = None  # what is left is rendered afresh
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"the message is {len(tokens)} tokens with the system prompt but the context "
                f"holds {self.n_ctx}; shorten it or raise n_ctx"
            )
        return tokens, {"history": history, "dropped_turns": dropped, "rebuilt": rebuilt,
                        "continued": session}  # fmt: skip

    def _remember_turn(
        self, params: SolveParams, plan: dict[str, Any], tokens: list[int], answer: str
    ) -> dict[str, Any]:
        """Store the session after a turn; return the chat facts for the turn's stats."""
        assert params.session is not None and self._model_path is not None
        history: list[Message] = plan["history"]
        previous: ChatSession | None = plan["continued"]
        turn = len(history) // 2
        turn_ends = {t: n for t, n in previous.turn_ends.items() if t < turn} if previous else {}
        turn_ends[turn] = len(tokens)
        old = self._sessions.get(params.session)
        session = ChatSession(
            id=params.session,
            model=self._model_path,
            system=params.system,
            messages=[*history, {"role": "user", "content": params.prompt},
                      {"role": "assistant", "content": answer}],
            tokens=tokens,
            turn_ends=turn_ends,
            dropped_turns=(old.dropped_turns if old else 0) + plan["dropped_turns"],
        )  # fmt: skip
        self._sessions.put(session)
        return {
            "session": params.session,
            "turn": turn,
            "dropped_turns": plan["dropped_turns"],
            "rebuilt": plan["rebuilt"],
            "context_used": len(tokens),
            "n_ctx": self.n_ctx,
        }

    def _piece(self, token: int) -> bytes:
        """Return the bytes of one token (special tokens render as nothing, but think tags)."""
        if token in self._tag_tokens:
            return self._tag_tokens[token]
        buffer = self._piece_buffer
        size = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        if size < 0:  # the piece is longer than the buffer: llama.cpp returns -needed
            self._piece_buffer = buffer = ctypes.create_string_buffer(-size)
            size = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        return buffer.raw[:size]

    # --- KV cache -----------------------------------------------------------------------------

    def _seq_rm(self, seq: int, start: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._ctx.memory, seq, start, -1)

    def _evaluate(self, seq: int, tokens: list[int], start: int) -> None:
        """Decode ``tokens`` into sequence ``seq`` from position ``start``, in batch-sized chunks
        (outside the step loop: for the system prompt)."""
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset : offset + self.n_batch]
            self._fill_batch(
                [(seq, token, start + offset + i, False) for i, token in enumerate(chunk)]
            )
            code = llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
            if code != DECODE_OK:
                raise RuntimeError(f"llama_decode returned {code}")

    def _fill_batch(self, entries: list[tuple[int, int, int, bool]]) -> None:
        batch = self._batch.batch
        for index, (seq, token, position, logits) in enumerate(entries):
            batch.token[index] = token
            batch.pos[index] = position
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = seq
            batch.logits[index] = logits
        batch.n_tokens = len(entries)

    # --- admitting requests -------------------------------------------------------------------

    def admit(self, job: Job) -> None:
        """Put a request into a free slot, reusing the KV it shares with what a slot holds.

        Raise ContextOverflowError when the prompt does not fit.
        """
        params = job.params
        plan: dict[str, Any] | None = None
        if params.session is not None:
            tokens, plan = self._chat_tokens(params)
        else:
            tokens = self._tokenize(
                self._render(params.system, [{"role": "user", "content": params.prompt}])
            )
            if len(tokens) >= self.n_ctx:
                raise ContextOverflowError(
                    f"the question is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                    "shorten it or raise n_ctx"
                )
        slot, shared = self._choose_slot(tokens)
        # At least one prompt token is always evaluated: sampling needs fresh logits.
        keep = min(shared, len(tokens) - 1)
        self._seq_rm(slot.seq, keep)
        slot.tokens = tokens[:keep]
        slot.pending = tokens[keep:]
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        slot.run = _Run(
            job=job,
            prompt=tokens,
            cached=keep,
            plan=plan,
            seed=seed,
            sampler=_make_sampler(params, seed),
            limit=min(params.max_tokens or self.n_ctx, self.n_ctx - len(tokens)),
            splitter=ThinkSplitter(starts_in_reasoning=self._thinks),
        )

    def _choose_slot(self, tokens: list[int]) -> tuple[_Slot, int]:
        """Pick the idle slot sharing the longest prefix with ``tokens`` (least recently used on
        ties); give a slot that shares less than the system prompt the system prompt's KV."""
        idle = [slot for slot in self._slots if slot.run is None]
        assert idle, "admit() needs a free slot"
        best = max(idle, key=lambda s: (_common_prefix(s.tokens, tokens), -s.last_used))
        shared = _common_prefix(best.tokens, tokens)
        system = self._system_tokens
        if system and shared < len(system) and tokens[: len(system)] == system:
            best = min(idle, key=lambda s: s.last_used)
            self._seq_rm(best.seq, 0)
            llama_cpp.llama_memory_seq_cp(
                self._ctx.memory, self._system_seq, best.seq, 0, len(system)
            )
            best.tokens = list(system)
            shared = len(system)
        return best, shared

    def reset(self) -> None:
        """Drop every request and every slot's cache (after a failed step); keep the model."""
        for slot in self._slots:
            if slot.run is not None:
                slot.run.sampler.close()
            slot.run, slot.pending, slot.tokens = None, [], []
            self._seq_rm(slot.seq, 0)

    # --- the step loop ------------------------------------------------------------------------

    def step(self) -> list[tuple[Job, dict[str, Any]]]:
        """Decode one batch for all active slots; return the requests that finished, with their
        stats. A request whose job was cancelled finishes here, within one step."""
        finished = [self._finish(slot, "cancelled") for slot in self._slots
                    if slot.run is not None and slot.run.job.cancelled.is_set()]  # fmt: skip
        entries: list[tuple[int, int, int, bool]] = []
        fed: list[tuple[_Slot, int, int]] = []  # slot, tokens fed, batch index of the last
        answering = [s for s in self._slots if s.run is not None and s.run.prompt_s is not None]
        reading = [s for s in self._slots if s.run is not None and s.run.prompt_s is None]
        # While answers stream, prompts are read in small chunks, so no stream stalls for long.
        prompt_room = PREFILL_CHUNK if answering else self.n_batch
        for slot in answering + reading:
            room = self.n_batch - len(entries)
            if slot.run is not None and slot.run.prompt_s is None:
                room = min(room, prompt_room)
                prompt_room -= min(room, len(slot.pending))
            if room <= 0:
                continue
            chunk = slot.pending[:room]
            if not chunk:
                continue
            done = len(chunk) == len(slot.pending)
            start = len(slot.tokens)
            for i, token in enumerate(chunk):
                entries.append((slot.seq, token, start + i, done and i == len(chunk) - 1))
            fed.append((slot, len(chunk), len(entries) - 1 if done else -1))
        if not entries:
            return finished
        self._fill_batch(entries)
        code = llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
        if code == DECODE_NO_KV_SPACE:
            return finished + self._out_of_kv()
        if code != DECODE_OK:
            raise RuntimeError(f"llama_decode returned {code}")
        for slot, count, logits_index in fed:
            slot.tokens.extend(slot.pending[:count])
            del slot.pending[:count]
            if logits_index >= 0:
                outcome = self._advance(slot, logits_index)
                if outcome is not None:
                    finished.append(outcome)
        return finished

    def _out_of_kv(self) -> list[tuple[Job, dict[str, Any]]]:
        """The shared KV cache is full: free idle slots' cells, and if that is not enough, stop
        the longest request (its context is the largest) so the others go on."""
        freed = False
        for slot in self._slots:
            if slot.run is None and slot.tokens:
                self._seq_rm(slot.seq, 0)
                slot.tokens = []
                freed = True
        if freed:
            return []
        victim = max((s for s in self._slots if s.run is not None), key=lambda s: len(s.tokens))
        assert victim.run is not None
        victim.run.job.cancel(protocol.CONTEXT_OVERFLOW)
        return [self._finish(victim, "context")]

    def _advance(self, slot: _Slot, logits_index: int) -> tuple[Job, dict[str, Any]] | None:
        """Sample the slot's next token and pass its text on; return the finished request."""
        run = slot.run
        assert run is not None
        now = time.monotonic()
        if run.prompt_s is None:
            run.prompt_s = now - run.started
            run.decode_started = now
        if run.finish_reason is not None:  # the last token is in the KV now: done
            return self._finish(slot, run.finish_reason)
        token = run.sampler.sample(self._ctx, logits_index)
        if llama_cpp.llama_vocab_is_eog(self._vocab, token):
            return self._finish(slot, "stop")
        run.generated += 1
        run.reasoning_tokens += run.splitter.in_reasoning
        if run.first_token_s is None:
            run.first_token_s = now - run.started
        self._forward(run, run.decoder.decode(self._piece(token)))
        slot.pending.append(token)
        params = run.job.params
        if (
            params.think_budget is not None
            and not run.budget_reached
            and run.splitter.in_reasoning
            and run.reasoning_tokens >= params.think_budget
        ):
            self._close_thinking(slot)
        if run.generated >= run.limit or len(slot.tokens) + len(slot.pending) >= self.n_ctx:
            run.finish_reason = "length"  # finish once the pending tokens are evaluated
        return None

    def _close_thinking(self, slot: _Slot) -> None:
        """Insert the end of thinking into the slot's sequence (think budget), if it fits."""
        run = slot.run
        assert run is not None
        closing = f"\n{THINK_CLOSE}\n\n"
        tokens = self._tokenize(closing, add_bos=False)
        if len(slot.tokens) + len(slot.pending) + len(tokens) < self.n_ctx:
            slot.pending.extend(tokens)
            self._forward(run, closing)
            run.budget_reached = True

    def _forward(self, run: _Run, text: str) -> None:
        for kind, piece in run.splitter.feed(text):
            run.job.emit_token(kind, piece)

    def _finish(self, slot: _Slot, reason: str) -> tuple[Job, dict[str, Any]]:
        run = slot.run
        assert run is not None
        self._forward(run, run.decoder.decode(b"", final=True))
        for kind, piece in run.splitter.finish():
            run.job.emit_token(kind, piece)
        run.sampler.close()
        slot.pending = []
        slot.run = None
        slot.last_used = time.monotonic()
        prefilled = run.prompt_s is not None
        chat = (
            self._remember_turn(run.job.params, run.plan, list(slot.tokens), run.splitter.answer)
            if run.plan is not None and prefilled
            else {}
        )
        now = time.monotonic()
        return run.job, {
            **chat,
            "prompt_tokens": len(run.prompt),
            "cached_tokens": run.cached,
            "prompt_eval_tokens": len(run.prompt) - run.cached,
            "prompt_eval_s": round(run.prompt_s or (now - run.started), 4),
            "completion_tokens": run.generated,
            "reasoning_tokens": run.reasoning_tokens,
            "answer_tokens": run.generated - run.reasoning_tokens,
            "budget_reached": run.budget_reached,
            "thinking_unfinished": run.splitter.unfinished,
            "decode_s": round(now - run.decode_started, 4) if prefilled else 0.0,
            "first_token_s": None if run.first_token_s is None else round(run.first_token_s, 4),
            "total_s": round(now - run.started, 4),
            "finish_reason": reason,
            "seed": run.seed,
            "slot": slot.seq,
            "model": str(self._model_path),
        }


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def _make_sampler(params: SolveParams, seed: int) -> Any:
    sampler = llama_internals.LlamaSampler()
    if params.temperature <= 0.0:
        sampler.add_greedy()
    else:
        sampler.add_top_k(TOP_K)
        sampler.add_top_p(params.top_p, 1)
        sampler.add_temp(params.temperature)
        sampler.add_dist(seed)
    return sampler


def _diagnose_load_failure(path: Path, exc: Exception) -> str:
    """Turn llama.cpp's terse load failure into a sentence that says what is wrong."""
    from phi4cli.errors import InvalidModelError
    from phi4cli.models import validate_gguf

    try:
        validate_gguf(path)
    except InvalidModelError as invalid:
        return str(invalid)
    return (
        f"llama.cpp could not load {path} ({exc}); is it a model architecture llama.cpp supports?"
    )
