"""What the engine keeps of each request and each slot (batch.py): a request's tokens and budget
worked out once, a request running in a slot and how far it has got, a slot's sequence."""

from __future__ import annotations

import codecs
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from phi4cli.core.protocol import Stats
from phi4cli.daemon.jobs import Job
from phi4cli.daemon.llama.prompts import ChatPlan
from phi4cli.daemon.llama.speculation import Drafter
from phi4cli.text.confidence import TraceConfidence
from phi4cli.text.reasoning import THINK_CLOSE, ThinkSplitter
from phi4cli.text.thinking import ThinkingPolicy


@dataclass(frozen=True)
class Prepared:
    """A request's tokens and budget, worked out once (a waiting request is offered again)."""

    loaded: int  # which load of a model these tokens are for (a waiting job may outlive it)
    tokens: list[int]
    budget: int  # tokens it may generate
    extra: int  # cells beyond prompt and budget (for closing the thinking)
    chat: ChatPlan | None


@dataclass(eq=False)
class Run:
    """One request in a slot: its prompt, sampler, and how far it has got."""

    job: Job
    prompt: list[int]
    cached: int
    chat: ChatPlan | None
    seed: int
    sampler: Any
    budget: int
    max_len: int  # the longest its sequence may grow: the end of its reservation
    reserved: int  # KV cells held for it: its own tokens, now and to come
    splitter: ThinkSplitter
    policy: ThinkingPolicy  # --think-budget, --min-think, --loop: what to do while it thinks
    trace: TraceConfidence | None  # its token confidences, when the request asks for them
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    started: float = field(default_factory=time.monotonic)
    prompt_s: float | None = None
    first_token_s: float | None = None
    decode_started: float = 0.0
    # An answer was streaming when this request was admitted: its prompt is never read ahead of
    # the streams (in whole batches while they wait), whichever streams run later.
    behind_stream: bool = False
    generated: int = 0
    reasoning_tokens: int = 0
    # Characters of the text of each of the last tokens in the sequence, for taking back the
    # tokens of an early end of thinking (min_think).
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=len(THINK_CLOSE) + 1))
    restored: int = 0  # prompt tokens taken from a swapped-out session's saved state
    restore_s: float = 0.0
    finish_reason: str | None = None  # set: finished once its pending tokens are evaluated
    # OpenAI's logprobs of the answer's tokens not yet sent (a request that asks for them):
    # each goes out on the token event that carries its text, or the next one.
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # Its drafts (speculation.py), unless the daemon's speculate is off or it is deterministic.
    drafter: Drafter | None = None

    def stats(self, reason: str, chat: dict[str, Any], seq: int, model: str) -> Stats:
        """What it cost, as it ended (``reason``): its stats, with a chat turn's (``chat``), its
        slot's sequence and the model file."""
        now = time.monotonic()
        prefilled = self.prompt_s is not None
        # What Stats names goes in its fields, the rest (restores, the slot) in its extra.
        return Stats.from_mapping(
            {
                **chat,
                "prompt_tokens": len(self.prompt),
                "cached_tokens": self.cached,
                "prompt_eval_tokens": len(self.prompt) - self.cached,
                "prompt_eval_s": round(self.prompt_s or (now - self.started), 4),
                "completion_tokens": self.generated,
                "reasoning_tokens": self.reasoning_tokens,
                "answer_tokens": self.generated - self.reasoning_tokens,
                **self.policy.stats(),
                **(self.trace.stats() if self.trace is not None else {}),
                "thinking_unfinished": self.splitter.unfinished,
                "decode_s": round(now - self.decode_started, 4) if prefilled else 0.0,
                "draft_tokens": self.drafter.drafted if self.drafter is not None else 0,
                "draft_accepted": self.drafter.accepted if self.drafter is not None else 0,
                "first_token_s": None
                if self.first_token_s is None
                else round(self.first_token_s, 4),
                "total_s": round(now - self.started, 4),
                "finish_reason": reason,
                "max_tokens": self.budget,
                "restored_tokens": self.restored,
                "restore_s": round(self.restore_s, 4),
                "reserved_tokens": self.reserved,
                "seed": self.seed,
                "slot": seq,
                "model": model,
            }
        )


@dataclass(eq=False)
class Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # what the KV holds for this sequence
    pending: list[int] = field(default_factory=list)  # tokens to evaluate next
    shared: int = 0  # leading cells shared with the system prompt's sequence (not its own)
    run: Run | None = None
    last_used: float = 0.0
    session: str | None = None  # the chat session whose tokens it holds, after a chat turn
    # After a solve: how many of its tokens are the prompt (kept in RAM when its cells go).
    prompt_len: int = 0

    @property
    def own_cells(self) -> int:
        return len(self.tokens) - self.shared
