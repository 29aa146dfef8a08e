"""Prompts kept in RAM after their cells are reclaimed (issue 51, item 3).

Idle slots keep the tokens of the requests they answered, so a question asked again finds its
prompt in the KV cache — until those cells are needed for another request. Then the prompt's
state (its KV, serialised by llama.cpp) is kept here instead, bounded in bytes, the least
recently used going first; a request whose prompt one of these holds further than any idle slot
has it put back into its slot rather than read again (an eval run again, the same problem asked
from two shells, a question asked again after many others). Chat sessions are not kept here:
their evicted state goes to disk (``sessions.SwapStore``), for their next turn.

The engine's thread saves and restores; ``clear`` (``phi4 cache clear``) and ``usage``
(``status``, ``/metrics``) come from the daemon's event loop, so every method holds a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

# A prompt is kept only when it holds this many tokens beyond what every fresh slot starts with
# (the system prompt): fewer are read again in a moment.
MIN_TOKENS = 16


@dataclass(frozen=True)
class CachedPrompt:
    tokens: tuple[int, ...]
    state: bytes  # llama.cpp's state of a sequence holding exactly ``tokens``


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start. (Compared a slice at a time, a
    bisection of slices, each compared in C: the engine asks this of every slot at each step
    that reads a prompt, and of every kept prompt at each admission.)"""
    if type(a) is not type(b):
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


class PromptCache:
    """Saved prompt states, at most ``max_bytes`` of them (0: none are kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], CachedPrompt] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0  # prompts put back into a slot
        self.hit_tokens = 0  # their tokens, not read again

    def put(self, tokens: list[int], state: bytes) -> None:
        """Keep ``state``, the KV of a sequence holding ``tokens``; drop the least recently used
        past the bound. One too big for the bound alone is not kept."""
        if not 0 < len(state) <= self.max_bytes:
            return
        key = tuple(tokens)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old.state)
            # A prompt that is the start of this one is of no more use: this one serves it too.
            for other in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                self._bytes -= len(self._entries.pop(other).state)
            self._entries[key] = CachedPrompt(key, state)
            self._bytes += len(state)
            while self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.state)

    def best(self, tokens: list[int], beyond: int) -> tuple[CachedPrompt, int] | None:
        """The kept prompt sharing the longest prefix with ``tokens``, and that length, if it is
        longer than ``beyond`` (what the slot at hand holds already); marked recently used."""
        with self._lock:
            found: tuple[CachedPrompt, int] | None = None
            for entry in self._entries.values():
                shared = common_prefix(entry.tokens, tokens)
                if shared > (found[1] if found else beyond):
                    found = (entry, shared)
            if found is not None:
                self._entries.move_to_end(found[0].tokens)
            return found

    def counted(self, tokens: int) -> None:
        """A kept prompt was put back, and ``tokens`` of it spared a reading."""
        with self._lock:
            self.hits += 1
            self.hit_tokens += tokens

    def clear(self) -> dict[str, int]:
        """Forget every kept prompt; return how many there were and their bytes."""
        with self._lock:
            cleared = {"prompts": len(self._entries), "bytes": self._bytes}
            self._entries.clear()
            self._bytes = 0
            return cleared

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {
                "prompts": len(self._entries),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "hits": self.hits,
                "hit_tokens": self.hit_tokens,
            }
