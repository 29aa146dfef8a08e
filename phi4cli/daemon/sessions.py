"""Chat sessions kept by the daemon: the exact tokens of each conversation, turn by turn.

A follow-up question is appended to the tokens the model actually saw and produced, rather than
re-rendering and re-tokenizing the whole transcript, so the KV cache prefix always matches and
only the new message (and the template's glue around it) is evaluated.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

MAX_SESSIONS = 32

Message = dict[str, str]


@dataclass
class ChatSession:
    id: str
    model: Path
    system: str | None
    messages: list[Message] = field(default_factory=list)  # complete turns: user, assistant, ...
    tokens: list[int] = field(default_factory=list)  # what the KV holds for ``messages``
    turn_ends: dict[int, int] = field(default_factory=dict)  # turn index -> token count after it
    dropped_turns: int = 0

    def continues(self, model: Path, system: str | None, history: list[Message]) -> int | None:
        """Return how many tokens of this session a request with ``history`` can build on.

        None when it cannot: another model or system prompt, a history that is not this
        session's, or a turn whose end is not known (after a rebuild).
        """
        if model != self.model or system != self.system or not history:
            return None
        turns = len(history) // 2
        if self.messages[: len(history)] != history:
            return None
        return self.turn_ends.get(turns - 1)


class SessionStore:
    """The most recently used sessions, at most ``capacity`` of them."""

    def __init__(self, capacity: int = MAX_SESSIONS) -> None:
        self.capacity = capacity
        self._sessions: OrderedDict[str, ChatSession] = OrderedDict()

    def get(self, session_id: str) -> ChatSession | None:
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions.move_to_end(session_id)
        return session

    def put(self, session: ChatSession) -> None:
        self._sessions[session.id] = session
        self._sessions.move_to_end(session.id)
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)

    def clear(self) -> None:
        self._sessions.clear()

    def __len__(self) -> int:
        return len(self._sessions)
