"""Prompts for the loaded model: its chat template, the tokens of a question or a chat turn, and
the chat sessions whose exact tokens a follow-up is appended to.

A follow-up question is appended to the tokens the model actually saw and produced (with the
template's glue between turns), never re-rendered, so the KV cache prefix always matches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from phi4cli.core.errors import Fault
from phi4cli.daemon.jobs import ContextOverflowError, SolveParams
from phi4cli.daemon.llama.model import LoadedModel
from phi4cli.daemon.sessions import ChatSession, Message, SessionStore
from phi4cli.text.reasoning import THINK_CLOSE, THINK_OPEN

# Used when a GGUF carries no chat template (rare): Phi-4-mini's own format.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


# Renders a trim may take past the first, however the per-turn estimates err: a request's
# preparation stays a few renders of its history, never one per turn.
_CORRECTIONS = 3
# Where a message's text goes in a rendered conversation: its index between two private-use
# characters (see Prompts.tokens).
_MARK = re.compile("\ue000(\\d+)\ue001")


@dataclass
class ChatPlan:
    """How a chat turn's tokens were made (for the stats, and to store the session after)."""

    history: list[Message]
    dropped_turns: int
    rebuilt: bool
    continued: ChatSession | None


class Prompts:
    """Turns requests into tokens for one loaded model."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        template = model.metadata().get("tokenizer.chat_template") or FALLBACK_TEMPLATE
        self._formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_text(model.eos()),
            bos_token=model.token_text(model.bos()),
        )
        self.sessions = SessionStore()
        self.glue = self._turn_glue()
        self.turn_glue = self._glue_tokens()  # tokens a turn costs beyond its two texts
        self._tag_tokens: dict[int, bytes] = {}
        for tag in (THINK_OPEN, THINK_CLOSE):
            ids = model.tokenize(tag, add_bos=False)
            if len(ids) == 1:  # a special token: rendered explicitly, as pieces hide specials
                self._tag_tokens[ids[0]] = tag.encode()

    def piece(self, token: int) -> bytes:
        """Return the bytes of one generated token; think tags render even if special."""
        return self._tag_tokens.get(token) or self.model.piece(token)

    def render(self, system: str | None, turns: list[Message]) -> str:
        """Render a conversation with the model's own chat template, ready for the answer."""
        messages = [{"role": "system", "content": system}] if system else []
        return self._formatter(messages=messages + turns).prompt  # type: ignore[arg-type]

    def tokens(self, system: str | None, turns: list[Message]) -> list[int]:
        """Return the tokens of a rendered conversation: the template's own text with its
        special tokens (``<|user|>``, ``<|end|>``), every message's text as plain text.

        So a question, a system prompt or an earlier answer that holds ``<|end|><|assistant|>``
        cannot end its turn or open another, and tokenising it costs time linear in its length
        (llama.cpp's search for special tokens grows with the square of how many a text holds).
        A template that changes a message's text (trims it, say) is tokenised whole, as before.
        """
        pieces = self._pieces(system, turns)
        if pieces is None:
            return self.model.tokenize(self.render(system, turns))
        return self._tokenize_pieces(pieces)

    def _pieces(self, system: str | None, turns: list[Message]) -> list[tuple[str, bool]] | None:
        """The rendered conversation as (text, is the template's) pieces, in order; None when
        the template does not place each message's text as it is."""
        contents = ([system] if system else []) + [turn["content"] for turn in turns]
        first = 1 if system else 0
        marked = [{**turn, "content": f"\ue000{first + i}\ue001"} for i, turn in enumerate(turns)]
        split = _MARK.split(self.render("\ue0000\ue001" if system else None, marked))
        if split[1::2] != [str(i) for i in range(len(contents))]:
            return None  # a message's text left out, repeated or moved
        pieces = [(contents[int(s)], False) if i % 2 else (s, True) for i, s in enumerate(split)]
        if "".join(text for text, _ in pieces) != self.render(system, turns):
            return None
        return pieces

    def _tokenize_pieces(self, pieces: list[tuple[str, bool]], add_bos: bool = True) -> list[int]:
        tokens: list[int] = []
        for text, template in pieces:
            if text:
                tokens += self.model.tokenize(
                    text, add_bos=add_bos and not tokens, special=template
                )
        return tokens if tokens or not add_bos else self.model.tokenize("")

    def question(self, params: SolveParams) -> list[int]:
        """Return the tokens of a one-shot question."""
        return self.tokens(params.ask.system, [{"role": "user", "content": params.prompt}])

    def system_prefix(self, system: str | None) -> list[int]:
        """Tokens every conversation with this system prompt starts with: those before the
        first question's text, a prefix of ``tokens`` of every such conversation."""
        question = [{"role": "user", "content": "?"}]
        pieces = self._pieces(system, question)
        if pieces is None:
            marker = "\x00"
            text = self.render(system, [{"role": "user", "content": marker}])
            return self.model.tokenize(text[: text.index(marker)])
        return self._tokenize_pieces(pieces[:-2])  # less the question and what follows it

    def _turn_glue(self) -> tuple[str, str] | None:
        """Return the template text between an answer and the next question, and between a
        question and its answer; None if this template is not a plain concatenation of turns.
        """
        marks = ("\x01", "\x02", "\x03")
        text = self.render(
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

    def chat_turn(
        self, params: SolveParams, reserve: int, capacity: int | None = None
    ) -> tuple[list[int], ChatPlan]:
        """Return the tokens for a chat turn and how they were made.

        A known session is continued from the tokens it already has; otherwise (new session,
        daemon restarted, another system prompt) the transcript is rendered once. Turns that do
        not fit in ``capacity`` (the cells a request may reserve; by default the plan's
        request capacity), with ``reserve`` tokens of room for the answer, are dropped oldest
        first, in one pass (see ``_fit``). Raise ContextOverflowError when the message alone
        does not fit.
        """
        assert params.session is not None
        # A stream's share, or the whole shared cache (less the system prompt's cells)
        n_ctx = capacity or self.model.plan.request_capacity
        room = n_ctx - reserve
        history = list(params.history)
        session = self.sessions.get(params.session)
        # A deterministic turn is rendered from the transcript, as a fresh daemon would: the
        # session's tokens hold what this daemon happened to generate (its thinking too).
        base = (
            session.continues(self.model.path, params.ask.system, history)
            if session and not params.ask.deterministic
            else None
        )
        tokens: list[int] | None = None
        dropped, rebuilt = 0, False
        if base is not None and self.glue is not None and session is not None:
            after_answer, after_question = self.glue
            tokens = [
                *session.tokens[:base],
                *self.model.tokenize(after_answer, add_bos=False),
                *self.model.tokenize(params.prompt, add_bos=False, special=False),
                *self.model.tokenize(after_question, add_bos=False),
            ]
        if tokens is None or (len(tokens) > room and history):
            dropped, tokens = self._fit(params, history, room)
            history = history[2 * dropped :]
            rebuilt = bool(history)
            if dropped or base is not None:
                session = None  # what is left was rendered afresh: its turn ends are not known
        if len(tokens) >= n_ctx:
            plan = self.model.plan
            streams = plan.slots if plan.kv_layout == "streams" else 0
            # (Shared: the cells one request may hold, the system prompt's left out.)
            fault = Fault(
                "prompt", len(tokens), n_ctx, prompt=len(tokens), n_ctx=plan.n_ctx, streams=streams
            )
            raise ContextOverflowError(fault)
        return tokens, ChatPlan(history, dropped, rebuilt, session)

    def _rendered(self, params: SolveParams, history: list[Message]) -> list[int]:
        question = {"role": "user", "content": params.prompt}
        return self.tokens(params.ask.system, [*history, question])

    def _fit(self, params: SolveParams, history: list[Message], room: int) -> tuple[int, list[int]]:
        """Render the question after as many of the newest turns as fit in ``room`` tokens (all
        of them if they do); return (the oldest turns dropped, the tokens).

        In proportion to the room, not to the history, and never a render per dropped turn:
        the newest turns are counted (their texts tokenised once, plus the template's glue)
        while they fit, older ones are never read, and what is kept is rendered once to check.
        A turn's count can be off by a token or two at the seams, so a check that does not fit
        drops as many more as its own excess needs, and one that fits with little to spare
        tries one turn more.
        """
        turns = len(history) // 2
        costs: dict[int, int] = {}

        def cost(turn: int) -> int:
            # Counted as plain text: linear whatever the text holds, and never fewer tokens
            # than the render will make of it, so what is kept holds no more special tokens
            # than the room (llama.cpp's search for them is quadratic in their number).
            if turn not in costs:
                texts = history[2 * turn : 2 * turn + 2]
                costs[turn] = self.turn_glue + sum(
                    len(self.model.tokenize(m["content"], add_bos=False, special=False))
                    for m in texts
                )
            return costs[turn]

        total, dropped = len(self._rendered(params, [])), turns
        while dropped > 0 and total + cost(dropped - 1) <= room:
            dropped -= 1
            total += cost(dropped)
        tokens = self._rendered(params, history[2 * dropped :])
        for _ in range(_CORRECTIONS):
            if len(tokens) <= room or dropped == turns:
                break
            excess, start = len(tokens) - room, dropped
            while dropped < turns and (excess > 0 or dropped == start):
                excess -= cost(dropped)
                dropped += 1
            tokens = self._rendered(params, history[2 * dropped :])
        if len(tokens) > room and dropped < turns:
            dropped, tokens = turns, self._rendered(params, [])  # the estimates are no guide
        if dropped > 0 and len(tokens) <= room and len(tokens) + cost(dropped - 1) <= room + 2:
            more = self._rendered(params, history[2 * (dropped - 1) :])
            if len(more) <= room:
                return dropped - 1, more
        return dropped, tokens

    def _glue_tokens(self) -> int:
        """Tokens the template adds around one turn's two texts (an empty turn's)."""
        empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        with_turn = self.model.tokenize(self.render(None, [*empty, *empty]), add_bos=False)
        without = self.model.tokenize(self.render(None, empty), add_bos=False)
        return max(0, len(with_turn) - len(without))

    def remember_turn(
        self, params: SolveParams, plan: ChatPlan, tokens: list[int], answer: str
    ) -> dict[str, object]:
        """Store the session after a turn; return the chat facts for the turn's stats."""
        assert params.session is not None
        history = plan.history
        previous = plan.continued
        turn = len(history) // 2
        turn_ends = {t: n for t, n in previous.turn_ends.items() if t < turn} if previous else {}
        turn_ends[turn] = len(tokens)
        old = self.sessions.get(params.session)
        self.sessions.put(
            ChatSession(
                id=params.session,
                model=Path(self.model.path),
                system=params.ask.system,
                messages=[
                    *history,
                    {"role": "user", "content": params.prompt},
                    {"role": "assistant", "content": answer},
                ],
                tokens=tokens,
                turn_ends=turn_ends,
                dropped_turns=(old.dropped_turns if old else 0) + plan.dropped_turns,
            )
        )
        return {
            "session": params.session,
            "turn": turn,
            "dropped_turns": plan.dropped_turns,
            "rebuilt": plan.rebuilt,
            "context_used": len(tokens),
            "n_ctx": self.model.plan.request_capacity,  # what this chat may fill
        }
