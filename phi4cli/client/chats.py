"""Conversations of ``phi4 chat``: the transcript, and saving/loading it as JSON (atomically)."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from phi4cli.core.atomicfile import UnwritableError, read_user_file, write_atomic
from phi4cli.core.errors import Phi4Error, UsageError
from phi4cli.core.options import SETTABLE

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FORMAT_VERSION = 1
SETTINGS = SETTABLE  # a chat's own (/set)
MAX_SESSION = 200  # characters of a session id, as the daemon takes them


@dataclass
class Turn:
    question: str
    answer: str  # the solution as the model wrote it (thinking not included)
    reasoning: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False  # stopped with Ctrl-C: the partial answer is kept


@dataclass
class Conversation:
    name: str
    model: str
    system: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    dropped: int = 0  # oldest turns no longer in the model's context
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def history(self) -> list[dict[str, str]]:
        """The complete turns the model still sees, as chat messages (no more than the daemon
        takes in one request: the newest of them)."""
        from phi4cli.core.protocol import MAX_HISTORY_MESSAGES

        messages: list[dict[str, str]] = []
        start = max(self.dropped, len(self.turns) - MAX_HISTORY_MESSAGES // 2)
        for turn in self.turns[start:]:
            messages.append({"role": "user", "content": turn.question})
            messages.append({"role": "assistant", "content": turn.answer})
        return messages

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: object) -> Conversation:
        """Read a saved conversation; raise ValueError naming what is wrong with it."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        _check(
            data,
            {"name": str, "model": str},
            {
                "system": (str, type(None)),
                "settings": dict,
                "turns": list,
                "dropped": int,
                "session": str,
                "created": (int, float),
                "updated": (int, float),
                "format": int,
            },
        )
        turns = []
        for index, turn in enumerate(data.get("turns", [])):
            if not isinstance(turn, dict):
                raise ValueError(f"turn {index + 1} is not a JSON object")
            _check(
                turn,
                {"question": str, "answer": str},
                {"reasoning": str, "stats": dict, "interrupted": bool},
                f"turn {index + 1}: ",
            )
            turns.append(Turn(**turn))
        _check_values(data, len(turns))
        fields = {k: v for k, v in data.items() if k not in ("format", "turns", "settings")}
        return cls(turns=turns, settings=_check_settings(data.get("settings", {})), **fields)


def _check_values(data: dict[str, Any], turns: int) -> None:
    """Raise ValueError for a value of the right type that phi4 still cannot use."""
    bad = _bad_text(data)
    if bad is not None:
        raise ValueError(f"{bad} is not valid text (a lone surrogate)")
    if "name" in data and not _NAME.match(data["name"]):
        raise ValueError(f"'name' {data['name']!r} is not a conversation name")
    if not 0 <= data.get("dropped", 0) <= turns:
        raise ValueError(f"'dropped' is {data['dropped']}, not from 0 to the {turns} turns")
    session = data.get("session", "-")
    if not 0 < len(session) <= MAX_SESSION:
        raise ValueError(f"'session' must be 1 to {MAX_SESSION} characters")
    for key in ("created", "updated"):
        if key in data and not math.isfinite(data[key]):
            raise ValueError(f"'{key}' is not a time ({data[key]})")


def _check_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The saved settings, each parsed as /set would parse it; raise ValueError naming one
    that is unknown or out of range (they are sent with every turn)."""
    from phi4cli.core.config import parse_setting

    checked = {}
    for key, value in settings.items():
        if key not in SETTINGS:
            raise ValueError(f"unknown setting '{key}' (a chat has {', '.join(SETTINGS)})")
        try:
            checked[key] = parse_setting(key, value, f"setting {key}")
        except Phi4Error as exc:
            raise ValueError(str(exc)) from None
    return checked


def _bad_text(value: object) -> str | None:
    """Where in a saved chat a string holds a lone surrogate (``"\\ud800"`` in the JSON), which
    cannot be sent on as UTF-8, as a person reads the file (``turn 3: 'answer'``); None when
    nowhere."""
    from phi4cli.core.inputs import find_unencodable

    found = find_unencodable(value)
    if found is None:
        return None
    path, is_key = found
    where = ""
    for step in path:
        if isinstance(step, int):  # a list's, counted from 1
            where = f"turn {step + 1}" if where == "'turns'" else f"{where} item {step + 1}"
        else:
            where = f"{where}: '{step}'" if where else f"'{step}'"
    if is_key:
        return f"a key in {where or 'the file'}"
    return where or "a value"


def _check(
    data: dict[str, Any], required: dict[str, Any], optional: dict[str, Any], where: str = ""
) -> None:
    """Raise ValueError for a missing, unknown or mistyped field."""
    for key in required:
        if key not in data:
            raise ValueError(f"{where}no '{key}'")
    for key, value in data.items():
        expected = required.get(key, optional.get(key))
        if expected is None:
            raise ValueError(f"{where}unknown field '{key}'")
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ValueError(f"{where}'{key}' has the wrong type ({type(value).__name__})")


def default_name() -> str:
    return time.strftime("chat-%Y%m%d-%H%M%S")


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise UsageError(
            f"bad conversation name {name!r}: use letters, digits, '.', '_' or '-' (up to 64)"
        )
    return name


class ChatStore:
    """Saved conversations, one JSON file each in the data dir's ``chats/``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, name: str) -> Path:
        return self.directory / f"{check_name(name)}.json"

    def save(self, conversation: Conversation) -> Path:
        """Write the conversation atomically; raise Phi4Error (disk full, ...) saying so."""
        conversation.updated = time.time()
        path = self.path(conversation.name)
        try:
            data = json.dumps(conversation.to_json(), ensure_ascii=False, indent=1).encode()
            write_atomic(path, data, what="conversation")
        except OSError as exc:
            raise UnwritableError(path, "conversation", exc, verb="save") from None
        return path

    def load(self, name: str) -> Conversation:
        path = self.path(name)
        try:
            data = json.loads(read_user_file(path, "conversation").decode("utf-8"))
            return Conversation.from_json(data)
        except FileNotFoundError:
            raise Phi4Error(f"no saved conversation {name!r}; `/list` shows them") from None
        except (ValueError, TypeError, KeyError) as exc:  # UnicodeDecodeError is a ValueError
            raise Phi4Error(
                f"{path} is not a phi4 conversation ({exc}); move it away or delete it"
            ) from None
        except OSError as exc:
            raise Phi4Error(f"cannot read {path}: {exc.strerror}") from None

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def names(self) -> list[str]:
        """Saved conversation names, most recently updated first."""
        if not self.directory.is_dir():
            return []
        files = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        return [p.stem for p in files if _NAME.match(p.stem)]

    def latest(self) -> Conversation:
        names = self.names()
        if not names:
            raise Phi4Error(
                "there is no saved conversation to continue; start one with `phi4 chat`"
            )
        return self.load(names[0])
