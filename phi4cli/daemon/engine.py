"""The inference engine: the ONLY module that imports llama_cpp.

One ``llama_cpp.Llama`` holds the model and one context. Each request's prompt is rendered with the
GGUF's own chat template and compared with the tokens already in the KV cache: the common prefix
(system prompt, earlier turns) is kept and only the new tokens are evaluated.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
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

from phi4cli.daemon.scheduler import ContextOverflowError, ModelLoadError, SolveParams, TokenSink
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

    def __init__(self, n_ctx: int, threads: int | None = None, n_batch: int = 512) -> None:
        self.n_ctx = n_ctx
        self.threads = threads or physical_cores()
        self.n_batch = n_batch
        self._llm: llama_cpp.Llama | None = None
        self._formatter: Jinja2ChatFormatter | None = None
        self._vocab: Any = None
        self._model_path: Path | None = None
        self._piece_buffer = ctypes.create_string_buffer(64)
        self._thinks = False  # the loaded model reasons before answering, maybe without <think>
        self._tag_tokens: dict[int, bytes] = {}

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
        started = time.monotonic()
        if not path.is_file():
            raise ModelLoadError(f"model file {path} does not exist")
        try:
            llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=self.n_ctx,
                n_batch=self.n_batch,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                verbose=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(_diagnose_load_failure(path, exc)) from None
        load_s = time.monotonic() - started
        template = llm.metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATE
        model = llm._model
        self._formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(llm.token_eos()),
            bos_token=model.token_get_text(llm.token_bos()),
        )
        self._vocab = llama_cpp.llama_model_get_vocab(model.model)
        self._llm = llm
        self._model_path = path
        self._thinks = model_thinks(str(llm.metadata.get("general.name", "")), path.name)
        self._tag_tokens = {}
        for tag in (THINK_OPEN, THINK_CLOSE):
            ids = llm.tokenize(tag.encode(), add_bos=False, special=True)
            if len(ids) == 1:  # a special token: rendered explicitly, as pieces hide specials
                self._tag_tokens[ids[0]] = tag.encode()
        log.info("loaded %s in %.2f s (threads %d)", path, load_s, self.threads)
        return {"model": str(path), "load_s": round(load_s, 4), "n_ctx": self.n_ctx,
                "threads": self.threads}  # fmt: skip

    def warm(self) -> dict[str, Any]:
        """Evaluate the default system prompt now, so the first question finds it cached."""
        assert self._llm is not None
        started = time.monotonic()
        self._llm.n_tokens = 0
        self._llm.eval(self._system_prefix(None))
        return {"prefill_s": round(time.monotonic() - started, 4),
                "system_tokens": int(self._llm.n_tokens)}  # fmt: skip

    def close(self) -> None:
        if self._llm is not None:
            with contextlib.suppress(Exception):
                self._llm.close()
        self._llm = None
        self._formatter = None
        self._vocab = None
        self._model_path = None

    def _render(self, system: str | None, prompt: str | None) -> str:
        assert self._formatter is not None
        messages: list[dict[str, str]] = []
        if system:
            messages.append({"role": "system", "content": system})
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
        return self._formatter(messages=messages).prompt  # type: ignore[arg-type]

    def _tokenize(self, text: str) -> list[int]:
        assert self._llm is not None
        return list(self._llm.tokenize(text.encode(), add_bos=True, special=True))

    def _system_prefix(self, system: str | None) -> list[int]:
        """Tokens every conversation with this system prompt starts with (cached at load)."""
        marker = "\x00"
        text = self._render(system, marker)
        return self._tokenize(text[: text.index(marker)])

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
        tokens = self._tokenize(self._render(params.system, params.prompt))
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"the question is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                "shorten it or raise n_ctx"
            )
        cached = self._prefill(tokens, cancelled)
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
        if params.think_budget == 0 and self._thinks:
            budget_reached = self._close_thinking(forward)
        while generated < limit and not cancelled.is_set():
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
            if (
                params.think_budget is not None
                and not budget_reached
                and splitter.in_reasoning
                and reasoning_tokens >= params.think_budget
            ):
                budget_reached = self._close_thinking(forward)
        if cancelled.is_set():
            finish_reason = "cancelled"
        forward(decoder.decode(b"", final=True))
        for kind, piece in splitter.finish():
            emit(kind, piece)
        decode_s = time.monotonic() - decode_started
        sampler.close()
        return {
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

    def _close_thinking(self, forward: TokenSinkText) -> bool:
        """Insert the end of thinking into the sequence (think budget); return True if it fit."""
        llm = self._llm
        assert llm is not None
        closing = f"\n{THINK_CLOSE}\n\n"
        tokens = list(llm.tokenize(closing.encode(), add_bos=False, special=True))
        if llm.n_tokens + len(tokens) >= self.n_ctx:
            return False
        llm.eval(tokens)
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
