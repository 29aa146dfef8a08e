"""What each token of a running request writes (batch.py's engine calls it once a step per
answering slot): the token drawn, its confidence and logprobs where asked for, its text split
into thinking and answer and sent on, and what the thinking policy makes of it — the end of
thinking closed by the daemon (a budget, a loop, the answer asked for now), taken back for
"Wait" (--min-think), or the request stopped (a loop)."""

from __future__ import annotations

import logging
from typing import Any

from phi4cli.daemon.llama.model import LoadedModel
from phi4cli.daemon.llama.prompts import Prompts
from phi4cli.daemon.llama.slots import Run, Slot
from phi4cli.text.confidence import LogitsConfidence, TokenLogprobs
from phi4cli.text.reasoning import ANSWER, THINK_CLOSE
from phi4cli.text.thinking import Act

log = logging.getLogger("phi4.engine")


class RunWriter:
    """The writing of every run of one loaded model; its buffers are the vocabulary's size."""

    def __init__(self, model: LoadedModel, prompts: Prompts) -> None:
        self.model, self.prompts = model, prompts
        self.confidence: LogitsConfidence | None = None
        self.logprobs: TokenLogprobs | None = None

    def flush(self, run: Run) -> None:
        """The run ends: pass on what its decoder and splitter still hold, and any logprobs of
        tokens whose text was not sent (whitespace at the answer's end)."""
        self._forward(run, run.decoder.decode(b"", final=True))
        for kind, piece in run.splitter.finish():
            self._emit(run, kind, piece)
        if run.logprobs:
            run.job.emit_token(ANSWER, "", run.logprobs)

    def advance(self, slot: Slot, logits_index: int, now: float) -> str | None:
        """Sample the slot's next token and pass its text on, as the run's thinking policy
        says; return why the run ends now ("stop": the model's end; "unsure": DeepConf's
        floor), else None (a later end, such as a length, is left in ``run.finish_reason``)."""
        model, prompts = self.model, self.prompts
        run = slot.run
        assert run is not None
        if run.trace is not None:
            if self.confidence is None:
                self.confidence = LogitsConfidence(model.model.n_vocab())
            run.trace.add(self.confidence(model.logits(logits_index)))
            if run.trace.below(run.job.confidence_floor):
                # DeepConf online: its least sure stretch is worse than the question's first
                # samples allow; it will not vote, so it stops here.
                log.info("confidence fell below the floor at %d tokens: stopped", run.generated)
                return "unsure"
        token = run.sampler.sample(model.context, logits_index)
        if model.is_eog(token):
            return "stop"
        if run.job.params.logprobs is not None and not run.splitter.in_reasoning:  # an answer's
            run.logprobs.append(self._logprob_entry(logits_index, token, run.job.params.logprobs))
        if run.first_token_s is None:
            run.first_token_s = now - run.started
        text = run.decoder.decode(prompts.piece(token))
        policy = run.policy
        closing = run.splitter.closing_at(text) is not None
        # The tokens before this one that the end of thinking began in: counted as thinking,
        # not for the policy, and taken back with it for a Wait.
        tag = self._tag_tokens(run, text) if closing else 0
        if not (
            closing
            and policy.closing(run.reasoning_tokens - tag) is Act.WAIT
            and self._keep_thinking(slot, text, tag)  # the end taken back, "Wait" written
        ):
            run.generated += 1
            run.reasoning_tokens += run.splitter.in_reasoning
            self._forward(run, text)
            slot.pending.append(token)
            run.recent.append(len(text))
            # (Where the text leaves it: a token that closes the thinking is answer after it.)
            self._act(slot, policy.text(text, run.splitter.in_reasoning, run.generated))
        if run.finish_reason is None:
            if run.job.answer_now:  # (an adjust: the user asks for the answer now)
                policy.answer_now()
            self._act(slot, policy.counted(run.reasoning_tokens, run.splitter.in_reasoning))
        if run.generated >= run.budget or len(slot.tokens) + len(slot.pending) >= run.max_len:
            run.finish_reason = run.finish_reason or "length"  # once the pending are evaluated
        return None

    def _close_thinking(self, slot: Slot) -> bool:
        """Insert the end of thinking into the slot's sequence (a think budget, a loop, the
        answer asked for now), if it fits; say whether it did."""
        model = self.model
        run = slot.run
        assert run is not None
        closing = f"\n{THINK_CLOSE}\n\n"
        tokens = model.tokenize(closing, add_bos=False)
        if len(slot.tokens) + len(slot.pending) + len(tokens) >= run.max_len:
            return False
        slot.pending.extend(tokens)
        self._forward(run, closing)
        run.recent.clear()  # (the daemon's tokens: never taken back)
        return True

    def _act(self, slot: Slot, act: Act) -> None:
        """Do what the thinking policy decided: close the thinking so the model answers (a
        think budget, a loop, the answer asked for now), or stop the request once its pending
        tokens are in (a loop)."""
        run = slot.run
        assert run is not None
        if act is Act.ANSWER:
            act = run.policy.closed(self._close_thinking(slot))
            if run.policy.answered_early and act is Act.GO_ON and run.policy.loop is None:
                log.info(
                    "the answer was asked for now at %d tokens: ended the thinking", run.generated
                )
            elif run.policy.loop == "answered" and act is Act.GO_ON:
                log.info("the thinking looped at %d tokens: ended it", run.generated)
        if act is Act.STOP:
            run.finish_reason = "loop"
            log.info("the output looped at %d tokens: stopped", run.generated)

    def _keep_thinking(self, slot: Slot, text: str, dropped: int) -> bool:
        """The model ends its thinking before min_think tokens (s1's budget forcing): take the
        end of thinking back out of the sequence and write "Wait" in its place.

        The tag may have begun in the ``dropped`` tokens before this one, in the KV already
        (their text held back by the splitter): those tokens go, the text of theirs before the
        tag is written again, and this token is not kept. Return False, changing nothing, where
        "Wait" would not fit in the request's reservation: the thinking ends then."""
        model, prompts = self.model, self.prompts
        run = slot.run
        assert run is not None
        held = run.splitter.held
        at = run.splitter.closing_at(text)
        assert at is not None
        kept = len(slot.tokens) - dropped
        taken_back = b"".join(prompts.piece(t) for t in slot.tokens[kept:])
        whole = taken_back.decode("utf-8", errors="replace") + text
        before = whole[: max(0, len(whole) - (len(held) + len(text) - at))]  # up to the tag
        shown = (held + text)[:at]  # what of the held text and this token's was not the tag
        written = run.splitter.reasoning + shown
        joiner = "" if not written or written[-1].isspace() else " "
        wait = model.tokenize(before + joiner + "Wait", add_bos=False)
        if kept + len(wait) >= run.max_len:
            return False
        if dropped:
            model.seq_rm(slot.seq, kept)
            del slot.tokens[kept:]
        run.splitter.drop_held()
        self._forward(run, shown + joiner + "Wait")
        slot.pending.extend(wait)
        run.recent.clear()  # (these are the daemon's tokens: never taken back)
        run.generated += len(wait) - dropped
        run.reasoning_tokens += len(wait) - dropped
        run.policy.waited()
        log.info("the thinking ended at %d tokens, before --min-think: Wait", run.generated)
        return True

    @staticmethod
    def _tag_tokens(run: Run, text: str) -> int:
        """How many of the tokens before this one (``text``) the end of thinking it completes
        began in: the last few of ``run.recent``."""
        at = run.splitter.closing_at(text)
        back = max(0, len(run.splitter.held) - (at or 0))  # the tag's characters before text
        count, recent = 0, list(run.recent)
        while back > 0 and recent:
            back -= recent.pop()
            count += 1
        return count

    def _forward(self, run: Run, text: str) -> None:
        for kind, piece in run.splitter.feed(text):
            self._emit(run, kind, piece)

    @staticmethod
    def _emit(run: Run, kind: str, piece: str) -> None:
        sent = None
        if kind == ANSWER and run.logprobs:
            sent, run.logprobs = run.logprobs, []
        run.job.emit_token(kind, piece, sent)

    def _logprob_entry(self, logits_index: int, token: int, top: int) -> dict[str, Any]:
        """A sampled token as OpenAI's ``logprobs.content[]`` shows it: its text, bytes and
        log-probability, and its step's ``top`` likeliest tokens' (``top_logprobs``)."""
        model, prompts = self.model, self.prompts
        if self.logprobs is None:
            self.logprobs = TokenLogprobs(model.model.n_vocab())
        chosen, likeliest = self.logprobs(model.logits(logits_index), token, top)

        def shown(token_id: int, logprob: float) -> dict[str, Any]:
            piece = prompts.piece(token_id)
            return {
                "token": piece.decode("utf-8", "replace"),
                "logprob": logprob,
                "bytes": list(piece),
            }

        return {**shown(token, chosen), "top_logprobs": [shown(t, lp) for t, lp in likeliest]}
