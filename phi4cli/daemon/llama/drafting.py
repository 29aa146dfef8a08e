"""Exact self-speculation in the engine's steps: the gate (whether and how far to draft) and the
pool of recent answers (``speculation.py`` holds their parts), a new request's drafter linked
with its siblings', each step's drafts, and their verification with the request's own sampler."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from phi4cli.daemon.llama.model import LoadedModel
from phi4cli.daemon.llama.slots import Slot
from phi4cli.daemon.llama.speculation import (
    DRAFT_MAX,
    NGRAM_MAX,
    POOL_RUNS,
    POOL_TOKENS,
    Drafter,
    Gate,
    NgramIndex,
)


class Speculator:
    """An engine's drafting: its ``gate`` and the ``pool`` of answers lately finished to draft
    from (a new model starts both afresh: ``reset``)."""

    def __init__(self, mode: str) -> None:
        self.gate = Gate(mode)
        self.pool: deque[NgramIndex] = deque(maxlen=POOL_RUNS)

    def reset(self, mode: str) -> None:
        """A model loaded: its costs and answers were another's."""
        self.gate = Gate(mode)
        self.pool.clear()

    def keep(self, drafter: Drafter, tokens: list[int], generated: int) -> None:
        """A request finished: its answer (not too long) joins the pool to draft later ones from."""
        if generated and len(tokens) <= POOL_TOKENS:
            drafter.follow(tokens)
            self.pool.append(drafter.own)

    def drafter(self, prompt: list[int], slots: list[Slot]) -> Drafter:
        """A new request's drafting, linked with its siblings' (running requests with the same
        prompt: K samples of one question) and the pool of recent answers."""
        drafter = Drafter(pool=self.pool)
        for slot in slots:
            other = slot.run.drafter if slot.run is not None else None
            if other is not None and slot.run is not None and slot.run.prompt == prompt:
                drafter.siblings.append(other.own)
                other.siblings.append(drafter.own)
        return drafter

    def drafts(
        self, chunks: list[tuple[Slot, list[int], bool]], room: int
    ) -> dict[Slot, tuple[list[int], str]]:
        """Each answering request's draft this step, verified in this batch (with where it came
        from), as long as the gate says (none where drafting does not pay); for one that drafts
        none, a shadow draft, judged by the tokens it then emits."""
        gate = self.gate
        answering = [
            slot for slot, _, _ in chunks if slot.run is not None and slot.run.prompt_s is not None
        ]
        drafters: list[Drafter | None] = []
        for slot in answering:
            run = slot.run
            assert run is not None
            drafter = run.drafter
            if drafter is not None:  # (every step: tokens taken back show here)
                drafter.follow(slot.tokens)
                judged = drafter.shadow_judged(drafter.own.tokens, slot.pending)
                if judged is not None:
                    gate.judge(drafter, *judged)
            if drafter is None or run.finish_reason is not None or len(slot.pending) != 1:
                drafters.append(None)
                continue
            drafters.append(drafter)
        drafts: dict[Slot, tuple[list[int], str]] = {}
        for slot, drafter, length in zip(answering, drafters, gate.lengths(drafters), strict=True):
            run = slot.run
            if drafter is None or run is None:
                continue
            context = [*slot.tokens[-NGRAM_MAX:], *slot.pending]
            # Within the request's reservation and budget, and the batch.
            limit = min(
                length, room, run.max_len - len(slot.tokens) - 2, run.budget - run.generated - 1
            )
            if limit > 0:
                whole, source = drafter.draft(context, DRAFT_MAX)
                if whole:
                    cut = drafter.shadow_judged(drafter.own.tokens, slot.pending, cut=True)
                    if cut is not None:  # (a shadow still open: judged as far as known)
                        gate.judge(drafter, *cut)
                    drafts[slot] = (whole[:limit], source)
                    room -= len(drafts[slot][0])
                    # The rest is judged in the shadow if all of this is kept (verify).
                    drafter.shadow, drafter.shadow_source = whole[limit:], source
                    continue
            if not drafter.shadow:
                drafter.shadow, drafter.shadow_source = drafter.draft(context, DRAFT_MAX)
                drafter.shadow_at, drafter.shadow_prior = len(slot.tokens) + 1, (0, 0)
                if not drafter.shadow:
                    gate.judge(drafter, "", 0, 0)  # (a step with nothing to draft counts too)
        return drafts

    def verify(
        self,
        slot: Slot,
        index: int,
        draft: list[int],
        source: str,
        model: LoadedModel,
        advance: Callable[[Slot, int], Any],
    ) -> Any:
        """Sample the slot's next token at ``index`` and each drafted one's after it with the
        request's own sampler, in order, keeping the drafted tokens only while each is the token
        drawn (each emitted token is drawn as it would be without a draft); remove the cells of
        the rest. (``advance`` draws one token, as the engine does without a draft.) Return the
        finished request, if it finished."""
        run = slot.run
        assert run is not None and run.drafter is not None
        drafter = run.drafter
        drafter.drafted += len(draft)
        kept = 0
        outcome = None
        for i in range(len(draft) + 1):
            length, generated = len(slot.tokens), run.generated
            outcome = advance(slot, index + i)
            if outcome is not None or i == len(draft):
                break
            if (
                run.finish_reason is not None
                or slot.pending != [draft[i]]
                or len(slot.tokens) != length
                or run.generated != generated + 1
            ):
                # A token not the draft's, the daemon's own after it, or tokens taken back
                # (a Wait): its cells are no longer the draft's.
                break
            slot.tokens.append(slot.pending.pop())  # its cell holds it already
            kept += 1
            drafter.accepted += 1
        model.seq_rm(slot.seq, len(slot.tokens))
        self.gate.verified(len(draft), kept)
        rest = drafter.shadow
        if kept == len(draft) and rest and outcome is None:
            # All kept: the draft's unverified rest is judged by the tokens that follow (the
            # first of them is the token drawn after the draft, pending now).
            drafter.shadow_at, drafter.shadow_prior = len(slot.tokens), (len(draft), kept)
        else:
            drafter.shadow = []
            self.gate.judge(drafter, source, len(draft) + len(rest), kept)
        return outcome
