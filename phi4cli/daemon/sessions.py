"""Chat sessions kept by the daemon: the exact tokens of each conversation, turn by turn.

A follow-up question is appended to the tokens the model actually saw and produced, rather than
re-rendering and re-tokenizing the whole transcript, so the KV cache prefix always matches and
only the new message (and the template's glue around it) is evaluated. A session whose cells had
to be reclaimed waits on disk (:class:`SwapStore`) for its next turn.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from phi4cli.daemon.statefile import remove_state

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


@dataclass(frozen=True)
class SwappedSession:
    path: Path  # the sequence state saved (see phi4cli.daemon.statefile)
    tokens: list[int]  # what it holds
    size: int  # its size as written: a restore reads no more


class SwapStore:
    """Chat sessions whose KV cells were reclaimed, kept on disk so that the conversation's next
    turn restores them instead of re-reading it. Bounded: past ``max_bytes`` the least recently
    swapped go first. Files of an earlier daemon are removed when it starts (its sessions are
    gone with it)."""

    def __init__(self, directory: Path | None, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._swapped: OrderedDict[str, SwappedSession] = OrderedDict()

    def path_for(self, session_id: str) -> Path | None:
        if self.directory is None:
            return None
        digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        return self.directory / f"session-{digest}.state"

    def add(self, session_id: str, tokens: list[int], size: int) -> None:
        """Record that ``path_for(session_id)`` now holds ``tokens`` in ``size`` bytes; drop the
        oldest over the bound."""
        path = self.path_for(session_id)
        if path is None:
            return
        self.discard(session_id, remove=False)
        self._swapped[session_id] = SwappedSession(path, list(tokens), size)
        while sum(s.size for s in self._swapped.values()) > self.max_bytes and self._swapped:
            oldest = next(iter(self._swapped))
            self.discard(oldest)

    def get(self, session_id: str) -> SwappedSession | None:
        return self._swapped.get(session_id)

    def discard(self, session_id: str, remove: bool = True) -> None:
        swapped = self._swapped.pop(session_id, None)
        if swapped is not None and remove:
            remove_state(swapped.path)

    def clear(self) -> None:
        """Forget every swapped session and remove the directory's state files (and any temp
        file a killed daemon left), whatever they are: nothing there is trusted."""
        self._swapped.clear()
        if self.directory is not None and self.directory.is_dir():
            for pattern in ("session-*.state", ".session-*.tmp"):
                for path in self.directory.glob(pattern):
                    remove_state(path)

    def __len__(self) -> int:
        return len(self._swapped)
