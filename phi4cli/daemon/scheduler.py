"""Requests waiting for the engine: a bounded priority queue (with aging), cancellation, and the
worker thread that hands jobs to the engine (requests arrive validated by ``protocol``).

The server submits :class:`Job` objects and gets events back through each job's ``emit``
callback; how many decode at once is the batching engine's business (``llama/batch.py``), so the
server never needs to know.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phi4cli.core.errors import Fault
from phi4cli.core.protocol import ErrorCode, Event, EventKind
from phi4cli.daemon.jobs import ContextOverflowError, Engine, Job, ModelLoadError

log = logging.getLogger("phi4.daemon")


_CANCEL_MESSAGES = {
    # (A client that showed part of the answer says that it is unfinished.)
    ErrorCode.SHUTTING_DOWN: "the daemon is shutting down",
    # Only the engine's last resort when llama.cpp finds no room although reservations fit.
    ErrorCode.CONTEXT_OVERFLOW: "the daemon's KV cache ran out of room unexpectedly; try again",
}


AGING_S = 10.0
# While the engine has work of its own (Engine.tend), the worker comes back this often.
TEND_S = 0.25


class JobQueue:
    """Waiting jobs: first those of the owners with the fewest requests running (``peek``'s
    ``running``), so that one client's many requests, or one request's many choices, do not
    hold every slot while another client waits; among those, most urgent first, in arrival
    order within a priority — except that a job waiting longer than AGING_S goes next whatever
    its priority, so no request starves.

    Counts each owner's jobs (an owner is a client: its connection, or the share it names),
    and knows the one job the worker has in hand (the last ``peek``): any other can leave the
    queue at once (``discard``), from any thread.
    """

    def __init__(self) -> None:
        self._jobs: list[Job] = []
        self._owned: Counter[object] = Counter()
        self._in_hand: Job | None = None
        self._stopping = False
        self._changed = threading.Condition()

    def put(self, job: Job) -> None:
        with self._changed:
            self._jobs.append(job)
            self._owned[job.owner] += 1
            self._changed.notify()

    def owned(self, owner: object) -> int:
        """How many of ``owner``'s jobs wait here."""
        with self._changed:
            return self._owned[owner]

    def stop(self) -> None:
        """Make ``peek`` return None from now on: the worker is to shut down."""
        with self._changed:
            self._stopping = True
            self._changed.notify()

    def peek(
        self,
        block: bool,
        timeout: float | None = None,
        running: Callable[[object], int] = lambda owner: 0,
    ) -> Job | None:
        """Return the job to offer the engine next, leaving it queued (it may have to wait), or
        None once stopped: one of the owners with the fewest requests ``running``. Raise
        queue.Empty if there is none and not ``block``, or none came within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not self._jobs and not self._stopping:
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    raise queue.Empty
                self._changed.wait(left)
            if self._stopping:
                return None
            counts = {owner: running(owner) for owner in self._owned}
            least = min(counts.values())
            jobs = [job for job in self._jobs if counts[job.owner] == least]
            oldest = jobs[0]  # (the list keeps arrival order)
            if time.monotonic() - oldest.submitted_at > AGING_S:
                self._in_hand = oldest
            else:
                self._in_hand = min(jobs, key=lambda j: (j.params.priority, j.seq))
            return self._in_hand

    def remove(self, job: Job) -> None:
        """The worker is done with ``job`` and it leaves the queue (if still there)."""
        with self._changed:
            self._in_hand = None
            self._drop(job)

    def keep(self, job: Job) -> None:
        """The worker is done with ``job`` for now; it keeps its place."""
        with self._changed:
            self._in_hand = None

    def snapshot(self) -> list[Job]:
        """The jobs waiting now, the one in hand included."""
        with self._changed:
            return list(self._jobs)

    def discard(self, job: Job) -> bool:
        """Take ``job`` out unless the worker has it in hand; return whether it was taken out."""
        with self._changed:
            return job is not self._in_hand and self._drop(job)

    def _drop(self, job: Job) -> bool:
        try:
            self._jobs.remove(job)
        except ValueError:
            return False
        self._owned[job.owner] -= 1
        if not self._owned[job.owner]:
            del self._owned[job.owner]
        return True

    def take_all(self) -> list[Job]:
        with self._changed:
            jobs, self._jobs = self._jobs, []
            self._owned.clear()
            return jobs

    def qsize(self) -> int:
        return len(self._jobs)


class QueueFullError(Exception):
    """No room for the job: the message says whose (the whole queue's, or its connection's)."""


# What became of a job offered to the engine (RequestScheduler._take).
_ADMITTED, _SETTLED, _HELD, _WAITING = object(), object(), object(), object()


class RequestScheduler:
    """Feeds jobs to the engine from one worker thread: most urgent first, FIFO within a level."""

    def __init__(
        self,
        engine: Engine,
        default_model: Path | None,
        max_queue: int,
        on_state: Callable[[str, Path, str | None], None],
    ) -> None:
        self._engine = engine
        self._default_model = default_model
        self._max_queue = max_queue
        # One owner (connection) may fill at most half the queue, so one client's flood leaves
        # room for everyone else's requests.
        self.max_per_owner = max(1, max_queue // 2)
        # Past a full queue, room for this many more requests of clients with none waiting or
        # running: a flood that fills the queue does not turn away the next one-question client.
        self.reserve = max(2, max_queue // 8)
        self._running: Counter[object] = Counter()  # each owner's jobs in the engine
        self._count_lock = threading.Lock()  # _outstanding changes in both threads
        self._on_state = on_state
        self._queue = JobQueue()
        self._admitted: set[Job] = set()  # in the engine now
        self._outstanding = 0  # submitted and not yet finished by the worker
        self._thread = threading.Thread(target=self._run, name="phi4-engine", daemon=True)
        self.last_load: dict[str, Any] = {}
        self.last_error: str | None = None
        self.last_fault: Fault | None = None  # the last load's refusal, as data
        self.waiting: Job | None = None  # the next job, if it is waiting for room
        # The engine's KV cache use, as of the last step (read by `status` from another thread).
        self.memory: dict[str, Any] = {}

    beats = 0  # times the worker went round its loop (read by the server's heartbeat)
    # When the step running now began (None between steps): on a slow device (lavapipe, a busy
    # CPU) a step reading a prompt is one llama_decode call that can take minutes.
    stepping_since: float | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._outstanding > 0

    def waiting_for_room(self) -> dict[str, Any] | None:
        """The request at the head of the queue, if it waits for room in the KV cache (what
        ``phi4 status`` says of it)."""
        job = self.waiting
        wait = job.waiting if job is not None else None
        if wait is None:
            return None
        return {"reason": wait.reason, "needed": wait.needed, "free": wait.free}

    def submit(self, job: Job) -> int:
        """Queue a job; return how many jobs are ahead of it. Raise QueueFullError when full.

        Called from the event loop's thread only.
        """
        queued = self._queue.qsize()
        ahead = queued + len(self._admitted)
        owned = self._queue.owned(job.owner)
        idle = not owned and not self.running(job.owner)
        if queued >= self._max_queue and not (idle and queued < self._max_queue + self.reserve):
            raise QueueFullError("the daemon's queue is full; try again in a moment")
        if job.owner is not None and owned >= self.max_per_owner:
            raise QueueFullError(
                f"this client already has {self.max_per_owner} requests waiting (half the "
                "daemon's queue; each choice of a request counts); send more as their answers "
                "come"
            )
        with self._count_lock:
            self._outstanding += 1
        self._queue.put(job)
        return ahead

    def cancel(self, job: Job) -> None:
        """Stop a job: a running one within a decode step, a queued one at once (it leaves the
        queue now, whatever the worker is doing). Called from the event loop's thread."""
        job.cancel()
        if self._queue.discard(job):
            self._settle(job, ErrorCode.CANCELLED, "cancelled before it started")
        elif job not in self._admitted:
            # In the worker's hand: answered now, and the worker drops it when it sees it done.
            job.fail(ErrorCode.CANCELLED, "cancelled before it started")

    def running(self, owner: object) -> int:
        """How many of ``owner``'s requests the engine has now."""
        with self._count_lock:
            return self._running[owner]

    def _admit(self, job: Job) -> None:
        with self._count_lock:
            self._admitted.add(job)
            self._running[job.owner] += 1

    def _release(self, job: Job) -> None:
        with self._count_lock:
            if job in self._admitted:
                self._admitted.discard(job)
                self._running[job.owner] -= 1
                if not self._running[job.owner]:
                    del self._running[job.owner]

    def _finished_one(self) -> None:
        with self._count_lock:
            self._outstanding -= 1

    def stop(self, timeout: float) -> bool:
        """Cancel the running job, let queued ones fail fast, and wait for the worker to finish.

        Return False if the worker is still busy (in a load that cannot be interrupted).
        """
        for job in list(self._admitted):
            job.cancel(ErrorCode.SHUTTING_DOWN)
        self._queue.stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        if self._default_model is not None:
            self._load(self._default_model)
        # Needs another model, or is deterministic: waits until the engine is idle.
        held: Job | None = None
        while True:
            self.beats += 1  # the worker goes round: the server's heartbeats say it lives
            tending = self._engine.tend()
            self.memory = self._engine.memory()
            if held is None and not self._exclusive():
                try:
                    job = self._queue.peek(
                        block=self._engine.active == 0,
                        timeout=TEND_S if tending else None,
                        running=self.running,
                    )
                except queue.Empty:
                    pass
                else:
                    if job is None:
                        self._shut_down()
                        return
                    outcome = self._take(job)
                    if outcome is _WAITING:
                        self._queue.keep(job)
                    else:
                        self._queue.remove(job)
                        self.waiting = None
                        if outcome is _HELD:
                            held = job
                        else:
                            continue  # admitted or answered: offer the next one at once
            if held is not None and self._engine.active == 0:
                job, held = held, None
                self._take(job, switch_model=True)
            if self._engine.active:
                self._step()

    def _take(self, job: Job, switch_model: bool = False) -> object:
        """Offer a job to the engine (loading its model first if need be); return _ADMITTED,
        _SETTLED (it has had its answer), _HELD (it needs another model: it waits until the
        engine is idle; so does a deterministic one while others run) or _WAITING (no room yet:
        it stays queued, in its place)."""
        try:
            if job.finished:  # cancelled while queued: it has had its answer
                self._finished_one()
                return _SETTLED
            if job.cancelled.is_set():
                self._settle(job, job.cancel_code, "cancelled before it started")
                return _SETTLED
            asked = job.params.model
            model = Path(asked) if asked else self._engine.model_path or self._default_model
            if model is None:
                self._settle(job, ErrorCode.MODEL_ERROR, "no model given and none loaded")
                return _SETTLED
            load_s = 0.0
            if model != self._engine.model_path:
                if self._engine.active and not switch_model:
                    return _HELD
                if not self._load(model):  # (it tells the waiting requests, this one too)
                    self._settle(
                        job,
                        ErrorCode.MODEL_ERROR,
                        self.last_error or f"cannot load {model}",
                        self.last_fault,
                    )
                    return _SETTLED
                load_s = float(self.last_load.get("load_s", 0.0))
            if job.params.load_only:
                job.done(result={**self.last_load, "already_loaded": load_s == 0.0})
                self._finished_one()
                return _SETTLED
            if job.params.ask.deterministic and self._engine.active:
                # Decoded alone: the running ones finish first (never cut short), and nothing
                # else is admitted meanwhile, so it is not overtaken for ever.
                return _HELD
            job.load_s += load_s
            wait = self._engine.admit(job)
            if wait is not None:
                if not self._engine.active:
                    # Nothing running will free room: the engine misjudged what fits.
                    raise ContextOverflowError(
                        Fault("max_tokens", wait.needed, available=wait.free)
                    )
                if wait.reason == "memory" and job.waiting != wait:
                    # A slot wait is ordinary queueing (`accepted` said how many are ahead);
                    # waiting for memory is news worth a line.
                    job.emit(
                        Event(
                            EventKind.PROGRESS,
                            job.request_id,
                            data={
                                "stage": "waiting",
                                "reason": wait.reason,
                                "needed": wait.needed,
                                "free": wait.free,
                            },
                        )
                    )
                job.waiting = wait
                self.waiting = job
                return _WAITING
            job.admitted_at = time.monotonic()
            self._admit(job)
        except ContextOverflowError as exc:
            self._settle(job, ErrorCode.CONTEXT_OVERFLOW, str(exc), exc.fault)
            return _SETTLED
        except Exception:
            log.exception("request %r failed", job.request_id)
            self._settle(
                job, ErrorCode.INTERNAL, "internal error in the daemon:\n" + traceback.format_exc()
            )
            return _SETTLED
        return _ADMITTED

    def _exclusive(self) -> bool:
        """A deterministic request is decoding: it has the engine to itself until it ends
        (its batches must hold its tokens alone for its arithmetic to be a fresh daemon's)."""
        return any(job.params.ask.deterministic for job in self._admitted)

    def _settle(self, job: Job, code: ErrorCode, message: str, fault: Fault | None = None) -> None:
        job.fail(code, message, fault)
        self._finished_one()

    def _step(self) -> None:
        self.stepping_since = time.monotonic()
        try:
            finished = self._engine.step()
        except Exception:
            # The batch failed as a whole: every request in it fails, the daemon goes on.
            log.exception("decoding failed")
            detail = "internal error in the daemon:\n" + traceback.format_exc()
            for job in list(self._admitted):
                self._release(job)
                self._settle(job, ErrorCode.MODEL_ERROR, detail)
            self._engine.reset()
            return
        finally:
            self.stepping_since = None
        for job, stats in finished:
            self._release(job)
            self._finished_one()
            queue_s = round(job.admitted_at - job.submitted_at, 4)
            stats = stats._replace(load_s=job.load_s, extra={**stats.extra, "queue_s": queue_s})
            # Stats go out for a cancelled request too: a chat keeps its partial answer, and
            # how much context it used.
            job.emit(Event.of_stats(stats, job.request_id))
            if job.cancelled.is_set():
                job.fail(
                    job.cancel_code,
                    job.cancel_message or _CANCEL_MESSAGES.get(job.cancel_code, "cancelled"),
                    job.cancel_fault,
                )
            else:
                job.done(finish_reason=stats.finish_reason)

    def _shut_down(self) -> None:
        """Stop: running requests end within a step, queued ones fail at once."""
        for job in list(self._admitted):
            job.cancel(ErrorCode.SHUTTING_DOWN)
        while self._engine.active:
            self._step()
        self.drain()

    def drain(self) -> None:
        """Fail every queued request as shutting down: at the worker's end, or from the loop
        when the daemon leaves without the worker (inside llama.cpp: a load)."""
        for job in self._queue.take_all():
            if job is not None:
                self._finished_one()
                job.fail(
                    ErrorCode.SHUTTING_DOWN, "the daemon is shutting down; run the command again"
                )

    def _loading(self, stage: str, path: Path) -> None:
        """The daemon is loading, warming or has loaded (ready) ``path``: say so in its
        status, and to every request waiting, as a ``progress`` event (a client's load line
        follows these; it need not read the status file)."""
        self._on_state(stage, path, None)
        for job in self._queue.snapshot():
            job.emit(
                Event(EventKind.PROGRESS, job.request_id, data={"stage": stage, "model": str(path)})
            )

    def _load(self, path: Path, fall_back: bool = True) -> bool:
        """Load (and warm) ``path``; on failure keep serving the model loaded before, if any
        (the failed request gets ``last_error``)."""
        previous = self._engine.model_path
        self._loading("loading", path)
        try:
            self.last_load = self._engine.load(path)
            self._loading("warming", path)
            self.last_load.update(self._engine.warm())
        except Exception as exc:
            # Whatever broke, the worker must live on to answer the next request.
            if not isinstance(exc, ModelLoadError):
                log.exception("loading %s failed", path)
            error = (
                str(exc)
                if isinstance(exc, ModelLoadError)
                else (f"loading {path} failed: {type(exc).__name__}: {exc}")
            )
            fault = exc.fault if isinstance(exc, ModelLoadError) else None
            if self._engine.model_path == previous and previous is not None:
                # Refused before unloading: the old model serves on.
                self.last_error, self.last_fault = error, fault
                self._on_state("ready", previous, None)
                return False
            self._engine.close()
            if fall_back and previous is not None and previous != path:
                log.warning("%s; loading %s again", error, previous)
                if self._load(previous, fall_back=False):
                    self.last_error, self.last_fault = error, fault  # (this load's, not that)
                    return False
            self.last_error, self.last_fault = error, fault
            self._on_state("failed", path, self.last_error)
            return False
        self.last_error, self.last_fault = None, None
        self._loading("ready", path)
        return True
