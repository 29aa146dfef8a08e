"""Remote servers as a flight's replicas: each request in flight on one is a thread reading its
stream (the samples of a question given to it in one round share one request, ``n``), what
comes goes to the flight's inbox; a server that went away is probed until it is back; and
``phi4 status --backend``'s look at each server."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx2 as httpx

from phi4cli.backends.dispatch import Closing, Delivery, Failure, Probe, Replica, Slow
from phi4cli.backends.remote import Attempt, RemoteServer, ReplicaFault
from phi4cli.backends.remote_shared import MAX_SHARED, SharedMember, SharedRequest, shared_params
from phi4cli.backends.remote_wire import reason
from phi4cli.core.protocol import JSON, ErrorCode, Event, SolveParams

# A replica that went away mid-run is probed this long after (seconds, one after another)
# before it is given up on for the run: about 15 s in all, time for a server to restart.
PROBE_DELAYS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)

MAX_METRICS_BYTES = 4 * 1024 * 1024  # a /metrics page (vLLM's is some hundreds of KiB)
MAX_LISTED_MODELS = 16  # of a /v1/models list, the ids `phi4 status --backend` shows

# What phi4 shows of a server's load (``phi4 status --backend``), and the metric each kind of
# server publishes it as at /metrics: (sample name, labels it must have); the first found counts.
# llama-server publishes its metrics with --metrics, SGLang with --enable-metrics; vLLM and
# phi4 serve always; Ollama and LiteLLM publish none of these.
LOAD_METRICS: dict[str, tuple[tuple[str, dict[str, str]], ...]] = {
    "in_flight": (
        ("phi4_requests_active", {}),
        ("llamacpp:requests_processing", {}),
        ("vllm:num_requests_running", {}),
        ("sglang:num_running_reqs", {}),
    ),
    "waiting": (
        ("phi4_queue_depth", {}),
        ("llamacpp:requests_deferred", {}),
        ("vllm:num_requests_waiting", {}),
        ("sglang:num_queue_reqs", {}),
    ),
    "answered": (
        ("phi4_requests_total", {}),
        ("vllm:request_success_total", {}),
        ("sglang:num_requests_total", {}),
    ),
    "tokens": (
        ("phi4_tokens_total", {"kind": "completion"}),
        ("llamacpp:tokens_predicted_total", {}),
        ("vllm:generation_tokens_total", {}),
        ("sglang:generation_tokens_total", {}),
    ),
}
LOAD_WINDOW_S = 1.0  # tokens/s: the server's count of generated tokens over this long


class ReplicaInbox:
    """Where the threads of a flight's remote requests leave what their servers sent."""

    def __init__(self) -> None:
        import queue

        self._queue: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._empty = queue.Empty

    def put(self, delivery: Delivery) -> None:
        self._queue.put(delivery)

    def get(self, timeout: float | None) -> Delivery | None:
        try:
            return self._queue.get(timeout=timeout)
        except self._empty:
            return None


class RemoteReplica(Replica):
    """One OpenAI-compatible server in a flight: each request in flight on it is a thread
    reading its stream (httpx is blocking; a few dozen threads cost little next to a model's
    answer), and what comes goes to the flight's inbox."""

    def __init__(self, server: RemoteServer, window: int, inbox: ReplicaInbox) -> None:
        super().__init__(window)
        self.server, self.inbox = server, inbox
        self.name = server.url
        self.attempts: dict[int, Attempt] = {}
        # Samples of one question sent in this round, by their group: asked together at flush.
        self._grouped: dict[int, list[tuple[int, SolveParams, Attempt]]] = {}

    def send(self, serial: int, op: str, params: SolveParams) -> None:
        def busy(wait: float) -> None:
            self.inbox.put((self, serial, Slow(wait)))

        attempt = Attempt(on_busy=busy)
        attempt.floor = params.confidence_floor  # (an adjust later replaces it)
        self.attempts[serial] = attempt
        group = params.sample_group
        if group is not None and self.server.takes_n is not False:
            # One of several samples of a question: sent with the others given to this server
            # in the same round, as one request with n (see flush).
            self._grouped.setdefault(group, []).append((serial, params, attempt))
            return
        self._start(serial, params, attempt, None)

    def flush(self) -> None:
        grouped, self._grouped = self._grouped, {}
        # At most MAX_SHARED choices a request (phi4 serve's and OpenAI's limit of n is 16).
        parts = [
            members[at : at + MAX_SHARED]
            for members in grouped.values()
            for at in range(0, len(members), MAX_SHARED)
        ]
        for members in parts:
            shared = (
                shared_params([params for _serial, params, _attempt in members])
                if len(members) > 1
                else None
            )
            if shared is None:
                for serial, params, attempt in members:
                    self._start(serial, params, attempt, None)
                continue
            request = SharedRequest(self.server, shared, len(members))
            for index, (serial, params, attempt) in enumerate(members):
                self._start(serial, params, attempt, request.member(index))
            request.start()

    def _start(
        self, serial: int, params: SolveParams, attempt: Attempt, member: SharedMember | None
    ) -> None:
        threading.Thread(
            target=self._read,
            args=(serial, params, attempt, member),
            daemon=True,
            name="phi4-remote",
        ).start()

    def _read(
        self, serial: int, params: SolveParams, attempt: Attempt, member: SharedMember | None
    ) -> None:
        try:
            for event in self.server.stream(params, attempt, member):
                if attempt.cancelled:
                    return
                self.inbox.put((self, serial, event))
        except ReplicaFault as fault:
            if attempt.cancelled:
                return  # the hang-up was ours: it says nothing of the server
            self.inbox.put(
                (
                    self,
                    serial,
                    Failure(
                        fault.code,
                        fault.message,
                        down=fault.down,
                        elsewhere=fault.elsewhere,
                        stats=fault.stats,
                    ),
                )
            )
        except Exception as error:  # a bug here must not leave the request without an end
            self.inbox.put(
                (
                    self,
                    serial,
                    Failure(
                        ErrorCode.INTERNAL,
                        f"reading the backend {self.server.url} failed: {error!r}",
                    ),
                )
            )
        finally:
            self.attempts.pop(serial, None)
            if member is not None:
                member.leave()  # (its stream left its choice already, unless it never read it)

    def adjust(self, serial: int, floor: float) -> None:
        attempt = self.attempts.get(serial)
        if attempt is not None:
            attempt.floor = floor  # read by its stream's thread

    def answer_now(self, serial: int) -> None:
        attempt = self.attempts.get(serial)
        if attempt is not None:
            attempt.answer_now = True  # read by its stream's thread at its next chunk

    def cancel(self, serial: int) -> Event | None:
        attempt = self.attempts.pop(serial, None)
        if attempt is not None:
            attempt.cancel()
        # Hanging up is the only way to stop an OpenAI-compatible server, and it sends no end.
        return Event.error(ErrorCode.CANCELLED, "cancelled")

    def may_recover(self, failure: Failure) -> bool:
        # A server that never answered in this run and cannot be reached is not waited for:
        # a wrong URL fails at once. While others of its requests are still in flight, one
        # connection that failed says too little.
        return self.worked or failure.code != ErrorCode.UNREACHABLE or bool(self.in_flight)

    def recover(self, flight: Closing) -> None:
        failure = self.last_failure
        if failure is not None and not self.may_recover(failure):
            self.inbox.put((self, None, Probe(False, failure)))
            return

        def probe() -> None:
            reason = None
            for delay in PROBE_DELAYS_S:
                time.sleep(delay)
                if flight.closed:
                    return
                reason = probe_server(self.server)
                if reason is None:
                    self.inbox.put((self, None, Probe(True)))
                    return
            gone = Failure(
                ErrorCode.UNREACHABLE, f"the backend {self.server.url} went away: {reason}"
            )
            self.inbox.put((self, None, Probe(False, failure or gone)))

        threading.Thread(target=probe, daemon=True, name="phi4-probe").start()

    def close(self, idle: bool) -> None:
        for attempt in list(self.attempts.values()):
            attempt.cancel()


def probe_all(servers: list[RemoteServer]) -> list[JSON]:
    """Each server's state now (``phi4 status --backend``): up or down, how long the probe
    took and, where the server publishes metrics, its requests in flight, waiting and answered
    and the tokens a second it generates (over :data:`LOAD_WINDOW_S`); all probed at once."""
    results: list[JSON] = [{} for _ in servers]

    def probe(i: int) -> None:
        started = time.monotonic()
        reason = probe_server(servers[i])
        results[i] = {
            "replica": servers[i].url,
            "state": "up" if reason is None else "down",
            "reason": reason,
            "probe_s": round(time.monotonic() - started, 3),
        }
        if reason is not None:
            return
        results[i]["models"] = served_models(servers[i])
        first = load_of(servers[i])
        results[i].update({key: first.get(key) for key in LOAD_METRICS})
        if "tokens" in first:
            time.sleep(LOAD_WINDOW_S)
            later = load_of(servers[i])
            if "tokens" in later:
                rate = max(0.0, later["tokens"] - first["tokens"]) / LOAD_WINDOW_S
                results[i]["tokens_per_s"] = round(rate, 1)
        results[i].setdefault("tokens_per_s", None)

    threads = [threading.Thread(target=probe, args=(i,), daemon=True) for i in range(len(servers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def probe_server(server: RemoteServer, timeout: float = 5.0) -> str | None:
    """Whether the server is there and ready: None when it is, else why not. ``/health``
    (llama-server, vLLM, SGLang, phi4 serve) answering 200 says ready and 503 not yet;
    a server without that route is asked for ``/v1/models`` (Ollama, LiteLLM); one that
    answers HTTP but has neither route counts as there."""
    try:
        with server.side_client(timeout) as client:
            for url in (server.root + "/health", server.v1 + "/models"):
                status = client.get(url).status_code
                if status < 300:
                    return None
                if status >= 500 and status != 501:  # 503: loading, or overloaded
                    return f"it answered {status} to {url}"
            return None
    except (httpx.HTTPError, httpx.InvalidURL, OSError) as error:
        return f"cannot reach it: {reason(error)}"


def _small_page(server: RemoteServer, url: str, timeout: float) -> bytes | None:
    """The body of a 200 answer to GET ``url``, read as it comes and only so much (at most
    MAX_METRICS_BYTES: a side look must not become a large download); None otherwise."""
    body = bytearray()
    try:
        with server.side_client(timeout) as client, client.stream("GET", url) as response:
            if response.status_code != 200:
                return None
            for piece in response.iter_bytes():
                body += piece
                if len(body) > MAX_METRICS_BYTES:
                    return None
    except (httpx.HTTPError, httpx.InvalidURL, OSError):
        return None
    return bytes(body)


def served_models(server: RemoteServer, timeout: float = 5.0) -> list[str] | None:
    """The model ids the server lists at ``/v1/models`` (what it serves, whatever name a
    request carries), or None when it lists none that can be read."""
    body = _small_page(server, server.v1 + "/models", timeout)
    try:
        listed = json.loads(body) if body is not None else None
    except ValueError:
        return None
    entries = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(entries, list):
        return None
    from phi4cli.text.sanitize import clean_text

    ids = [
        clean_text(entry["id"])
        for entry in entries
        if isinstance(entry, dict) and isinstance(entry.get("id"), str)
    ]
    return ids[:MAX_LISTED_MODELS] or None


def load_of(server: RemoteServer, timeout: float = 5.0) -> dict[str, float]:
    """What the server says of its own load at ``/metrics`` (Prometheus text): requests in
    flight and waiting, requests answered and tokens generated since it started, where it
    publishes them (:data:`LOAD_METRICS`); empty when it has no such page."""
    from prometheus_client.parser import text_string_to_metric_families

    body = _small_page(server, server.root + "/metrics", timeout)
    if body is None:
        return {}
    text = body.decode("utf-8", "replace")
    found: dict[str, float] = {}
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError):
        return {}  # not Prometheus text after all
    for key, names in LOAD_METRICS.items():
        for name, labels in names:
            values = [
                s.value
                for s in samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
            ]
            if values and all(math.isfinite(v) and v >= 0 for v in values):
                found[key] = sum(values)
                break
    return found
