"""The inference engine: the ONLY module that imports llama_cpp.

One ``llama_cpp.Llama`` holds the model and one context. Each request's prompt is rendered with the
GGUF's own chat template and compared with the tokens already in the KV cache: the common prefix
(system prompt, earlier turns) is kept and only the new tokens are evaluated.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals as llama_internals
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from phi4cli.daemon.ramdisk import stage
from phi4cli.daemon.scheduler import ContextOverflowError, ModelLoadError, SolveParams, TokenSink
from phi4cli.daemon.sessions import ChatSession, Message, SessionStore
from phi4cli.reasoning import THINK_CLOSE, THINK_OPEN, ThinkSplitter, model_thinks

TokenSinkText = Callable[[str], None]

log = logging.getLogger("phi4.engine")

# The model card samples with transformers' defaults besides temperature/top_p, i.e. top_k=50.
TOP_K = 50
# Used when a GGUF carries no chat template (rare): Phi-4-mini's own format.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


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


class LlamaEngine:
    """One model, one context, one request at a time (the scheduler serialises calls)."""

    def __init__(
        self,
        n_ctx: int,
        threads: int | None = None,
        n_batch: int = 512,
        ramdisk: str = "off",
        mlock: bool = False,
        state_dir: Path | None = None,
    ) -> None:
        self.n_ctx = n_ctx
        self.threads = threads or physical_cores()
        self.n_batch = n_batch
        self.ramdisk = ramdisk
        self.mlock = mlock
        self.state_dir = state_dir  # where prefilled system-prompt states are kept
        self._llm: llama_cpp.Llama | None = None
        self._formatter: Jinja2ChatFormatter | None = None
        self._vocab: Any = None
        self._model_path: Path | None = None
        self._piece_buffer = ctypes.create_string_buffer(64)
        self._thinks = False  # the loaded model reasons before answering, maybe without <think>
        self._tag_tokens: dict[int, bytes] = {}
        self._glue: tuple[str, str] | None = None
        self._sessions = SessionStore()

    @property
    def model_path(self) -> Path | None:
        return self._model_path

    @property
    def cached_tokens(self) -> int:
        return int(self._llm.n_tokens) if self._llm is not None else 0

    def load(self, path: Path) -> dict[str, Any]:
        """Load the GGUF at ``path`` (unloading any other); return timings.

        Raise ModelLoadError with a message for the user when llama.cpp cannot load it.
        """
        self.close()
        if not path.is_file():
            raise ModelLoadError(f"model file {path} does not exist")
        staging = stage(path, self.ramdisk)
        started = time.monotonic()
        try:
            llm = llama_cpp.Llama(
                model_path=str(staging.path),
                n_ctx=self.n_ctx,
                n_batch=self.n_batch,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                use_mlock=self.mlock,
                verbose=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(_diagnose_load_failure(path, exc)) from None
        try:
            self._prepare(llm, path)
        except BaseException:
            self.close()
            llm.close()
            raise
        load_s = time.monotonic() - started
        log.info("loaded %s from %s in %.2f s (threads %d)", path, staging.path, load_s,
                 self.threads)  # fmt: skip
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
            "mlock": self.mlock,
        }

    def _prepare(self, llm: llama_cpp.Llama, path: Path) -> None:
        """Set up what depends on the loaded model: template, vocab, think tags, turn glue."""
        template = llm.metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATE
        model = llm._model
        self._formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(llm.token_eos()),
            bos_token=model.token_get_text(llm.token_bos()),
        )
        self._vocab = llama_cpp.llama_model_get_vocab(model.model)
        self._thinks = model_thinks(str(llm.metadata.get("general.name", "")), path.name)
        self._glue = self._turn_glue()
        self._sessions.clear()
        self._tag_tokens = {}
        for tag in (THINK_OPEN, THINK_CLOSE):
            ids = llm.tokenize(tag.encode(), add_bos=False, special=True)
            if len(ids) == 1:  # a special token: rendered explicitly, as pieces hide specials
                self._tag_tokens[ids[0]] = tag.encode()
        # Last: until here a failure leaves no half-loaded model behind.
        self._llm = llm
        self._model_path = path

    def warm(self) -> dict[str, Any]:
        """Make the first question cheap: one warm-up decode, then the default system prompt's
        KV — restored from the state saved by an earlier daemon, or computed and saved."""
        llm = self._llm
        assert llm is not None
        started = time.monotonic()
        prefix = self._system_prefix(None)
        llm.n_tokens = 0
        llm.eval(prefix[:1])  # the first decode allocates llama.cpp's compute buffers
        warmup_s = time.monotonic() - started
        started = time.monotonic()
        state_file = self._state_file(prefix)
        restored = state_file is not None and self._restore_prefix(state_file, prefix)
        if not restored:
            llm.n_tokens = 0
            llm.eval(prefix)
            if state_file is not None:
                self._save_prefix(state_file, prefix)
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
        llm = self._llm
        assert llm is not None
        if not state_file.is_file():
            return False
        tokens = (llama_cpp.llama_token * len(prefix))()
        count = ctypes.c_size_t(0)
        llm.n_tokens = 0
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        size = llama_cpp.llama_state_seq_load_file(
            llm._ctx.ctx, str(state_file).encode(), 0, tokens, len(prefix), ctypes.byref(count)
        )
        if not size or list(tokens[: count.value]) != prefix:
            log.warning("ignoring unusable prompt state %s", state_file)
            llm._ctx.kv_cache_seq_rm(-1, 0, -1)
            return False
        llm.input_ids[: len(prefix)] = prefix
        llm.n_tokens = len(prefix)
        return True

    def _save_prefix(self, state_file: Path, prefix: list[int]) -> None:
        llm = self._llm
        assert llm is not None
        state_file.parent.mkdir(parents=True, exist_ok=True)
        partial = state_file.with_name(f".{state_file.name}.{os.getpid()}.part")
        tokens = (llama_cpp.llama_token * len(prefix))(*prefix)
        if llama_cpp.llama_state_seq_save_file(
            llm._ctx.ctx, str(partial).encode(), 0, tokens, len(prefix)
        ):
            os.replace(partial, state_file)  # a restarting daemon never reads half a state
        else:
            partial.unlink(missing_ok=True)

    def close(self) -> None:
        if self._llm is not None:
            with contextlib.suppress(Exception):
                self._llm.close()
        self._llm = None
        self._formatter = None
        self._vocab = None
        self._model_path = None

    def _render(self, system: str | None, turns: list[Message]) -> str:
        """Render a conversation with the model's own chat template, ready for the answer."""
        assert self._formatter is not None
        messages = [{"role": "system", "content": system}] if system else []
        return self._formatter(messages=messages + turns).prompt  # type: ignore[arg-type]

    def _tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        assert self._llm is not None
        return list(self._llm.tokenize(text.encode(), add_bos=add_bos, special=True))

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

    def generate(
        self, params: SolveParams, emit: TokenSink, cancelled: threading.Event
    ) -> dict[str, Any]:
        """Evaluate the prompt's new tokens and stream the output; return the request's stats.

        Output goes to ``emit`` as ``("reasoning", text)`` or ``("answer", text)``. With a think
        budget, ``</think>`` is inserted once that many reasoning tokens are out.
        """
        llm = self._llm
        assert llm is not None
        request_started = time.monotonic()
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
        cached = self._prefill(tokens, cancelled)
        prefilled = llm.n_tokens == len(tokens)  # False: cancelled while reading the prompt
        sequence = list(tokens)  # what the KV holds, as the turn goes on
        prompt_s = time.monotonic() - request_started

        seed = params.seed if params.seed is not None else random.getrandbits(31)
        sampler = _make_sampler(params, seed)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        splitter = ThinkSplitter(starts_in_reasoning=self._thinks)

        def forward(text: str) -> None:
            for kind, piece in splitter.feed(text):
                emit(kind, piece)

        limit = min(params.max_tokens or self.n_ctx, self.n_ctx - len(tokens))
        generated = reasoning_tokens = 0
        budget_reached = False
        finish_reason = "length"
        decode_started = time.monotonic()
        first_token_s: float | None = None
        if params.think_budget == 0 and self._thinks and prefilled:
            budget_reached = self._close_thinking(forward, sequence)
        while (
            prefilled
            and generated < limit
            and llm.n_tokens < self.n_ctx  # think-budget tokens take room too
            and not cancelled.is_set()
        ):
            token = sampler.sample(llm._ctx, -1)
            if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                finish_reason = "stop"
                break
            generated += 1
            reasoning_tokens += splitter.in_reasoning
            if first_token_s is None:
                first_token_s = time.monotonic() - request_started
            forward(decoder.decode(self._piece(token)))
            llm.eval([token])
            sequence.append(token)
            if (
                params.think_budget is not None
                and not budget_reached
                and splitter.in_reasoning
                and reasoning_tokens >= params.think_budget
            ):
                budget_reached = self._close_thinking(forward, sequence)
        if cancelled.is_set():
            finish_reason = "cancelled"
        forward(decoder.decode(b"", final=True))
        for kind, piece in splitter.finish():
            emit(kind, piece)
        decode_s = time.monotonic() - decode_started
        sampler.close()
        chat = (
            self._remember_turn(params, plan, sequence, splitter.answer)
            if plan is not None and prefilled
            else {}
        )
        return {
            **chat,
            "prompt_tokens": len(tokens),
            "cached_tokens": cached,
            "prompt_eval_tokens": len(tokens) - cached,
            "prompt_eval_s": round(prompt_s, 4),
            "completion_tokens": generated,
            "reasoning_tokens": reasoning_tokens,
            "answer_tokens": generated - reasoning_tokens,
            "budget_reached": budget_reached,
            "thinking_unfinished": splitter.unfinished,
            "decode_s": round(decode_s, 4),
            "first_token_s": None if first_token_s is None else round(first_token_s, 4),
            "total_s": round(time.monotonic() - request_started, 4),
            "finish_reason": finish_reason,
            "seed": seed,
            "model": str(self._model_path),
        }

    def _prefill(self, tokens: list[int], cancelled: threading.Event) -> int:
        """Reuse the KV of the prefix the cache shares, evaluate the rest; return cached count."""
        llm = self._llm
        assert llm is not None
        cached = 0
        for have, want in zip(llm.input_ids[: llm.n_tokens], tokens, strict=False):
            if have != want:
                break
            cached += 1
        # At least one prompt token is always evaluated: sampling needs fresh logits.
        cached = min(cached, len(tokens) - 1)
        llm.n_tokens = cached
        for start in range(cached, len(tokens), self.n_batch):
            if cancelled.is_set():
                break
            llm.eval(tokens[start : start + self.n_batch])
        return cached

    def _close_thinking(self, forward: TokenSinkText, sequence: list[int]) -> bool:
        """Insert the end of thinking into the sequence (think budget); return True if it fit."""
        llm = self._llm
        assert llm is not None
        closing = f"\n{THINK_CLOSE}\n\n"
        tokens = list(llm.tokenize(closing.encode(), add_bos=False, special=True))
        if llm.n_tokens + len(tokens) >= self.n_ctx:
            return False
        llm.eval(tokens)
        sequence.extend(tokens)
        forward(closing)
        return True


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
