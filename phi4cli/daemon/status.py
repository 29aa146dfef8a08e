"""What the daemon says of itself: the status file's record (enough for a client to find and
judge it), `status`'s live view, and the counters `/metrics` shows."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phi4cli import __version__
from phi4cli.core import protocol
from phi4cli.core.atomicfile import RefusedFileError, write_atomic
from phi4cli.core.config import FOREVER, Settings
from phi4cli.core.paths import Paths
from phi4cli.core.protocol import Stats
from phi4cli.daemon.connections import Connection
from phi4cli.daemon.scheduler import RequestScheduler

log = logging.getLogger("phi4.daemon")


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class RequestMetrics:
    """Counters for `/metrics`: tokens, cache use, request latency, errors by code."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    latency_sum: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    errors: Counter[str] = field(default_factory=Counter)

    def record(self, stats: Stats) -> None:
        self.requests += 1
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.completion_tokens += stats.completion_tokens
        latency = stats.total_s or 0.0
        self.latency_sum += latency
        for index, bound in enumerate(LATENCY_BUCKETS):
            if latency <= bound:
                self.latency_buckets[index] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_sum_s": round(self.latency_sum, 6),
            "latency_buckets": dict(
                zip(map(str, LATENCY_BUCKETS), self.latency_buckets, strict=True)
            ),
            "errors": dict(self.errors),
        }


class StatusReport:
    """The daemon's status, from its state (a part of
    :class:`~phi4cli.daemon.server.DaemonServer`)."""

    paths: Paths
    settings: Settings
    state: str
    model_path: Path | None
    error: str | None
    started_at: float
    requests_served: int
    metrics: RequestMetrics
    last_activity: float
    keep_alive: float
    scheduler: RequestScheduler
    _connections: set[Connection]
    _stopping: bool

    def status_record(self) -> dict[str, Any]:
        """The status file's content: enough for a client to find and judge this daemon."""
        return {
            "pid": os.getpid(),
            "socket": str(self.paths.socket),
            "protocol": protocol.PROTOCOL_VERSION,
            "version": __version__,
            "state": self.state,
            "model": str(self.model_path) if self.model_path else None,
            "started_at": self.started_at,
            "log": str(self.paths.log_file),
            "error": self.error,
        }

    def live_status(self) -> dict[str, Any]:
        idle_s = None if self.scheduler.busy else time.monotonic() - self.last_activity
        left = None
        if idle_s is not None and self.keep_alive != FOREVER:
            left = max(0.0, self.keep_alive - idle_s)
        return {
            **self.status_record(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "rss_bytes": rss_bytes(),
            "requests_served": self.requests_served,
            "requests_active": sum(len(c.jobs) for c in self._connections),
            "queued": self.scheduler.queued,
            "idle_s": None if idle_s is None else round(idle_s, 3),
            "keep_alive_s": self.keep_alive,
            "keep_alive_left_s": None if left is None else round(left, 3),
            "n_ctx": self.scheduler.memory.get("n_ctx", self.settings.n_ctx),
            "memory": self.scheduler.memory,
            "waiting": self.scheduler.waiting_for_room(),
            "load": self.scheduler.last_load,
            "metrics": self.metrics.snapshot(),
        }

    def _write_status(self) -> None:
        if self._stopping and self.state != "stopping":
            return
        try:
            write_atomic(self.paths.status_file, json.dumps(self.status_record()).encode())
        except OSError as exc:
            # A full disk must not take the daemon down: clients find it by its socket.
            log.warning("cannot write %s: %s", self.paths.status_file, exc.strerror)
        except RefusedFileError as exc:  # a directory above PHI4_HOME that others can change
            log.warning("%s", exc)
