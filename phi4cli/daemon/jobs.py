"""What the daemon's parts share: a request's parameters, the Job that carries it from the server
through the scheduler into the engine, and the Engine interface the scheduler drives.

Server, scheduler and engine all import from here, and from nothing of each other's.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from phi4cli.core.errors import Fault, log_words
from phi4cli.core.protocol import PRIORITIES, ErrorCode, Event, EventKind, SolveParams, Stats

__all__ = ["PRIORITIES", "SolveParams"]  # re-exported for the engine and the tests

Emit = Callable[[Event], None]  # a request's events, as records: the server writes them


class ModelLoadError(Exception):
    """The engine could not load a model; the message says why, for the user, and a memory
    plan it refused says it as data too (``fault``)."""

    def __init__(self, message: str, fault: Fault | None = None) -> None:
        super().__init__(message)
        self.fault = fault


class ContextOverflowError(Exception):
    """The request can never fit in the context window, even alone: ``fault`` says what does
    not fit (worded for the daemon log here; each client words it its own way)."""

    def __init__(self, fault: Fault) -> None:
        super().__init__(log_words(fault))
        self.fault = fault


@dataclass(frozen=True)
class Wait:
    """The engine cannot take a request yet: it keeps its place in the queue until a running
    request finishes. ``reason`` is "memory" (its reservation does not fit in the free KV cells)
    or "slot" (every sequence is busy)."""

    reason: str
    needed: int = 0  # KV cells the request reserves
    free: int = 0  # KV cells not reserved by running requests


class Engine(Protocol):
    """What the scheduler needs from an inference engine (see ``llama.batch.LlamaEngine``).

    The engine decodes the requests it has admitted together, one ``step()`` at a time; it
    admits a request only when the KV cache has room for all it may generate (its reservation),
    so a running request is never cut short for another's sake. The scheduler decides which
    request to offer next and when.
    """

    @property
    def model_path(self) -> Path | None: ...

    @property
    def active(self) -> int:
        """Requests in the engine now."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """Load ``path`` (replacing any model); return timings. Raise ModelLoadError."""
        ...

    def warm(self) -> dict[str, Any]:
        """Prepare the loaded model for its first request (system prompt prefill); timings."""
        ...

    def admit(self, job: Job) -> Wait | None:
        """Take a request in (return None), or say why it must wait (return a Wait).

        Raise ContextOverflowError when it could never fit, even alone.
        """
        ...

    def step(self) -> list[tuple[Job, Stats]]:
        """Decode one batch; stream text through each job's ``emit_token``; return the jobs that
        finished (cancelled ones included), each with its stats."""
        ...

    def memory(self) -> dict[str, Any]:
        """The KV cache now (n_ctx, reserved, free, ...) and the memory plan; {} if unloaded."""
        ...

    def clear_prompts(self) -> dict[str, int]:
        """Forget the prompts kept in RAM; return how many there were (``prompts``) and their
        ``bytes``. Called from the event loop's thread."""
        ...

    def tend(self) -> bool:
        """Work of the engine's own between steps (a context made in the background moving
        in); True while there is more of it: the worker then comes back within ``TEND_S``
        even with no request to offer."""
        ...

    def reset(self) -> None:
        """Drop every request in the engine (after a failed step), keeping the model."""
        ...

    def close(self) -> None: ...


_job_seq = itertools.count()
_TOKEN_EVENTS = {"reasoning": EventKind.REASONING, "retract": EventKind.RETRACT}


@dataclass(eq=False)
class Job:
    request_id: Any
    params: SolveParams
    emit: Emit
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_code: ErrorCode = ErrorCode.CANCELLED
    cancel_message: str | None = None
    cancel_fault: Fault | None = None
    seq: int = field(default_factory=lambda: next(_job_seq))
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0
    load_s: float = 0.0
    waiting: Wait | None = None  # why the engine has not taken it yet (the last answer)
    prepared: Any = None  # the engine's work on it before admission (its tokens), kept
    # The client it counts as (its connection, or the share it names): the queue's fairness unit.
    owner: object = None
    # Stop once the confidence falls below this (the request's, or an ``adjust``'s since).
    confidence_floor: float | None = None
    # An ``adjust`` asked for the answer now: the engine's thread, at its next token, has the
    # thinking policy close the thinking (a request answering already is not changed).
    answer_now: bool = False

    finished: bool = False  # its one terminal event has gone out
    # The event loop (a cancel) and the engine's thread may both end a job at once.
    _finishing: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.confidence_floor is None:
            self.confidence_floor = self.params.confidence_floor

    def cancel(
        self,
        code: ErrorCode = ErrorCode.CANCELLED,
        message: str | None = None,
        fault: Fault | None = None,
    ) -> None:
        self.cancel_code = code
        self.cancel_message = message  # what the client is told, if not the code's usual words
        self.cancel_fault = fault  # its facts, for each client to word them
        self.cancelled.set()

    def emit_token(self, kind: str, text: str, logprobs: list[Any] | None = None) -> None:
        event = _TOKEN_EVENTS.get(kind, EventKind.TOKEN)
        data = {"logprobs": logprobs} if logprobs else {}
        self.emit(Event(event, self.request_id, text, data))

    def finish(self, event: Event) -> None:
        """Send the request's terminal event: exactly once, whoever gets there first."""
        with self._finishing:
            if self.finished:
                return
            self.finished = True
        self.emit(event)

    def fail(self, code: ErrorCode, message: str, fault: Fault | None = None) -> None:
        self.finish(Event.error(code, message, self.request_id, fault))

    def done(self, **fields: Any) -> None:
        self.finish(Event(EventKind.DONE, self.request_id, data=fields))
