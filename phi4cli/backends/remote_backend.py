"""Remote OpenAI-compatible servers as a backend: one or more replicas of one model, no
daemon involved."""

from __future__ import annotations

from collections.abc import Sequence

from phi4cli.backends.dispatch import (
    Announce,
    EventSink,
    Feed,
    Replica,
)
from phi4cli.backends.flight import Flight, FlightHook, FlightStream
from phi4cli.core.protocol import JSON, Event, Op, SolveParams


class RemoteBackend:
    """One or more OpenAI-compatible servers (replicas of one model); no daemon involved."""

    def __init__(
        self,
        urls: list[str] | str,
        model: str,
        api_key: str | None,
        timeout: float,
        deadline: float = 3600.0,
        announce: Announce | None = None,
        concurrency: int = 16,
    ) -> None:
        from phi4cli.backends.remote import RemoteServer

        urls = [urls] if isinstance(urls, str) else urls
        self.servers = [
            RemoteServer(url, model, api_key, timeout, deadline, announce, connections=concurrency)
            for url in urls
        ]
        self.server = self.servers[0]
        self.concurrency = concurrency
        self.announce = announce
        shown = (
            " and ".join(e.url for e in self.servers)
            if len(urls) <= 3
            else f"{self.server.url} and {len(urls) - 1} more"
        )
        self.name = f"the backend {shown}"
        self.last_summary: list[JSON] = []

    def _flight(
        self,
        op: Op,
        requests: Sequence[SolveParams | Event],
        restart: bool,
        feed: Feed | None = None,
    ) -> Flight:
        from phi4cli.backends.replicas import RemoteReplica, ReplicaInbox

        inbox = ReplicaInbox()
        replicas: list[Replica] = [
            RemoteReplica(server, self.concurrency, inbox) for server in self.servers
        ]
        return Flight(requests, replicas, inbox, op=op, restart=restart, feed=feed)

    def stream(self, op: Op, params: SolveParams) -> FlightStream:
        return FlightStream(self._flight(op, [params], restart=False))

    def run(
        self,
        requests: Sequence[SolveParams | Event],
        on_event: EventSink,
        restart: bool = False,
        feed: Feed | None = None,
        on_flight: FlightHook | None = None,
    ) -> None:
        flight = self._flight(Op.SOLVE, requests, restart, feed)
        if on_flight is not None:
            on_flight(flight)
        try:
            flight.run(on_event)
        finally:
            self.last_summary = flight.summary()
        if len(self.servers) > 1 and self.announce is not None and len(requests) > 1:
            self.announce("replicas: " + "; ".join(_replica_line(r) for r in self.last_summary))

    def connect(self) -> None:
        pass  # nothing to start: the first request finds out whether the server answers

    def status(self) -> JSON:
        from phi4cli.backends.replicas import probe_all

        replicas = probe_all(self.servers)
        up = sum(1 for r in replicas if r["state"] == "up")
        # What the servers serve (a llama-server answers any model name with its one model),
        # where every replica that lists its models lists the same one; else the name asked.
        served = {tuple(r["models"]) for r in replicas if r.get("models")}
        only = next(iter(served)) if len(served) == 1 else ()
        model = only[0] if len(only) == 1 else self.server.model
        return {
            "state": "remote" if up else "down",
            "backend": self.server.url,
            "model": model,
            "model_asked": self.server.model,
            "replicas": replicas,
        }

    def close(self) -> None:
        for server in self.servers:
            server.close()


def _replica_line(part: JSON) -> str:
    rate = f", {part['tokens_per_s']:g} tokens/s" if part["tokens_per_s"] else ""
    line = f"{part['replica']} answered {part['answered']}{rate}"
    if part["failed"]:
        line += f", {part['failed']} failed"
    return line + (f" ({part['state']})" if part["state"] != "up" else "")
