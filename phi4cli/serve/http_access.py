"""Who may use ``phi4 serve --http``: the Host and Origin checks, and the peer's uid on loopback.

A keyless server on loopback is reachable by every local user and, through the user's own
browser, by every web page: a page can send "simple" cross-site POSTs to 127.0.0.1, and a page
whose name is made to resolve to 127.0.0.1 (DNS rebinding) can even read the answers. So each
request must name this server in ``Host``, come from no foreign ``Origin``, and, without a key,
come from a socket owned by the server's own uid (read from ``/proc/net/tcp``, as ``ss -e`` does).

:class:`AccessGuard` is pure ASGI, in front of everything (unknown paths and OPTIONS included).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio.to_thread

from phi4cli.core.errors import UsageError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
PeerUid = Callable[[tuple[str, int], tuple[str, int]], "int | None"]

PROC_NET = Path("/proc/self/net")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``text`` names, without its scope id, an IPv4-mapped IPv6 one as IPv4; None
    for a name, or for something that is neither (``127.0.0.1%evil.example``: a scope id is
    only for an IPv6 address, ``fe80::1%eth0``)."""
    literal, percent, scope = text.partition("%")
    try:
        address = ipaddress.ip_address(literal)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if percent and (address.ipv4_mapped is not None or not _SCOPE_ID.fullmatch(scope)):
            return None
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
    elif percent:
        return None
    return address


# An interface's name or number (RFC 6874's zone id, as Linux names interfaces).
_SCOPE_ID = re.compile(r"[A-Za-z0-9._~-]{1,64}")


def _canonical(name: str) -> str | None:
    """A Host name as compared: an address in its canonical form, a DNS name as it is; None
    for something that is neither."""
    address = _ip(name)
    if address is not None:
        return str(address)
    if re.fullmatch(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*", name):
        return name
    return None


def split_host(header: str) -> tuple[str, int | None] | None:
    """A ``Host`` value as (lower-case name without a final dot, port or None); None if it is
    malformed. ``[::1]:8080`` is ("::1", 8080)."""
    header = header.strip()
    if header.startswith("["):
        name, bracket, rest = header[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, colon, port_text_ = header.partition(":")
        port_text = port_text_ if colon else None
        if ":" in port_text_:
            return None  # an IPv6 literal must be in brackets
    port = None if port_text is None else port_number(port_text)
    if port_text is not None and port is None:
        return None
    name = name.lower().removesuffix(".")
    if not name:
        return None
    return name, port


def port_number(text: str) -> int | None:
    """``text`` as a TCP port (0 to 65535); None for anything else, checked before int() reads
    it (``²`` is a digit to isdigit(), and 5,000 digits would be int()'s ValueError)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 5) or int(text) > 65535:
        return None
    return int(text)


def _decode_proc_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``0100007F:1F90`` (as /proc/net/tcp prints it: each 32-bit word in host byte order) as
    (address, port)."""
    address_hex, port_hex = text.split(":")
    words = [int(address_hex[i : i + 8], 16) for i in range(0, len(address_hex), 8)]
    raw = b"".join(struct.pack("=I", word) for word in words)
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(port_hex, 16)


def peer_uid_from_proc(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid owning the local socket at the other end of a loopback TCP connection (its local
    address is ``client``, its peer ``server``); None when /proc cannot tell (not Linux, the
    socket already gone)."""
    want = (_ip(client[0]), client[1]), (_ip(server[0]), server[1])
    for name in ("tcp", "tcp6"):
        try:
            lines = (PROC_NET / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            try:
                ends = _decode_proc_address(fields[1]), _decode_proc_address(fields[2])
            except ValueError:
                continue
            # Inode 0: a socket no process holds any more (TIME_WAIT, orphaned); its uid says
            # nothing (it reads 0, root's).
            if ends == want and fields[9] != "0":
                return int(fields[7])
    return None


# Connections one peer may hold open at once. A peer is a local user on loopback (its uid, read
# from /proc as the uid check reads it) and an address elsewhere. Without a key another uid is
# only told why it is refused: a few connections are enough for that. The owner is bound only by
# the server's own limit.
PEER_CONNECTIONS = 64
FOREIGN_CONNECTIONS = 4


class PeerGate:
    """Each peer's open connections, counted as they are accepted: a new one past its peer's
    cap is closed there, before it sends a byte or holds a slot, so another user's (or
    address's) slow connections cannot fill the server while its owner waits. ``owner_only``:
    the server answers only its owner (no --api-key, no --any-local-user)."""

    def __init__(
        self, owner_only: bool, peer_uid: PeerUid = peer_uid_from_proc, owner_uid: int | None = None
    ) -> None:
        self.owner_only, self.peer_uid = owner_only, peer_uid
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        self.open: dict[tuple[str, object], int] = {}
        self.refused = 0

    def admit(
        self, client: tuple[str, int] | None, server: tuple[str, int | None] | None
    ) -> tuple[str, object] | None:
        """The peer a new connection counts against, or None to close it now."""
        peer = self._peer(client, server)
        if peer == ("uid", self.owner_uid):
            cap = None
        elif peer[0] == "uid" and self.owner_only:
            cap = FOREIGN_CONNECTIONS
        else:
            cap = PEER_CONNECTIONS
        held = self.open.get(peer, 0)
        if cap is not None and held >= cap:
            self.refused += 1
            return None
        self.open[peer] = held + 1
        return peer

    def release(self, peer: tuple[str, object]) -> None:
        held = self.open.get(peer, 0) - 1
        if held > 0:
            self.open[peer] = held
        else:
            self.open.pop(peer, None)

    def _peer(
        self, client: tuple[str, int] | None, server: tuple[str, int | None] | None
    ) -> tuple[str, object]:
        if client is None or server is None or server[1] is None:
            return ("address", None)
        address = _ip(client[0])
        if address is not None and address.is_loopback:
            return ("uid", self.peer_uid((client[0], client[1]), (server[0], server[1])))
        return ("address", str(address) if address is not None else client[0])


def check_allowances(hosts: Iterable[str], origins: Iterable[str]) -> None:
    """Raise UsageError for an ``--allow-host`` that is not a host name or address, or an
    ``--allow-origin`` that is not ``scheme://host[:port]`` (it would never match)."""
    for host in hosts:
        if host != "*" and _canonical(host.strip().lower().strip("[]").removesuffix(".")) is None:
            raise UsageError(
                f"bad --allow-host {host!r}: give a host name or address, e.g. my-box.lan"
            )
    for origin in origins:
        try:
            parts = urlsplit(origin.strip())
            parts.port  # noqa: B018 (raises ValueError for a bad port)
        except ValueError:
            parts = None
        if origin != "*" and (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
        ):
            raise UsageError(
                f"bad --allow-origin {origin!r}: give scheme://host[:port], e.g. "
                "http://localhost:3000"
            )


@dataclass(frozen=True)
class AccessPolicy:
    """What a server answers: the Host names, the Origins, and (without a key) which uid.

    ``bound`` is the address the server listens on (as given and as bound); ``owner_uid`` None
    answers every local user (a key, or ``--any-local-user``).
    """

    bound: tuple[str, ...]
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()
    owner_uid: int | None = None
    peer_uid: PeerUid = field(default=peer_uid_from_proc)

    @classmethod
    def create(
        cls,
        bound: Iterable[str],
        allow_hosts: Iterable[str] = (),
        allow_origins: Iterable[str] = (),
        owner_only: bool = True,
        peer_uid: PeerUid = peer_uid_from_proc,
    ) -> AccessPolicy:
        hosts = frozenset(
            _canonical(h.strip().lower().strip("[]").removesuffix(".")) or h for h in allow_hosts
        )
        origins = frozenset(o.strip().lower().rstrip("/") for o in allow_origins)
        return cls(tuple(bound), hosts, origins, os.getuid() if owner_only else None, peer_uid)

    def names(self) -> list[str]:
        """The Host names answered, for messages."""
        names: list[str] = []
        for host in self.bound:
            address = _ip(host)
            if address is not None and address.is_unspecified:
                names += ["any address", "localhost", socket.gethostname()]
            else:
                names.append(str(address) if address is not None else host.lower())
                if address is not None and address.is_loopback:
                    names.append("localhost")
        names += sorted(self.allowed_hosts)
        return list(dict.fromkeys(names))

    def host_allowed(self, name: str) -> bool:
        if "*" in self.allowed_hosts or _canonical(name) in self.allowed_hosts:
            return True
        address = _ip(name)
        for host in self.bound:
            bound = _ip(host)
            if bound is None:
                if name == host.lower().removesuffix("."):
                    return True
            elif bound.is_unspecified:
                # On every address: any address literal is this machine's (a rebinding page
                # has a name, never a literal), and so are its own names.
                if address is not None or name in ("localhost", socket.gethostname().lower()):
                    return True
            elif address == bound or (bound.is_loopback and name == "localhost"):
                return True
        return False

    def origin_allowed(self, origin: str, host: tuple[str, int | None]) -> bool:
        """An Origin is this server's own (the page came from the Host the request names) or
        one allowed with ``--allow-origin``."""
        origin = origin.strip().lower()
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        try:
            parts = urlsplit(origin)
            port = parts.port
        except ValueError:
            return False
        if parts.scheme != "http" or parts.hostname is None:
            return False
        own = _ip(host[0]) or host[0]
        theirs = _ip(parts.hostname) or parts.hostname
        return own == theirs and (port or 80) == (host[1] or 80)


def _refusal(status: int, message: str, kind: str) -> tuple[dict[str, Any], bytes]:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    return start, body


class AccessGuard:
    """ASGI middleware: refuse (403, one-line JSON error) a request whose Host is not this
    server's, whose Origin is foreign, or, with ``owner_uid`` set, whose peer is another user
    or cannot be told; answer CORS only for allowed origins."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = await self.check(scope, headers)
        if refusal is not None:
            start, body = _refusal(403, refusal, "permission_error")
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS":  # a preflight from an allowed origin
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": [
                        *cors,
                        (b"access-control-allow-methods", b"GET, POST"),
                        (b"access-control-allow-headers", b"authorization, content-type"),
                        (b"access-control-max-age", b"600"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def check(self, scope: Scope, headers: dict[str, str]) -> str | None:
        """Why the request is refused, or None."""
        policy = self.policy
        host = split_host(headers.get("host", ""))
        if host is None:
            return "the request needs a Host header naming this server"
        if not policy.host_allowed(host[0]):
            return (
                f"Host {host[0]!r} is not this server (it answers to "
                f"{', '.join(policy.names())}); to allow that name, use --allow-host"
            )
        origin = headers.get("origin")
        if origin is not None and not policy.origin_allowed(origin, host):
            return (
                f"cross-origin requests from {origin!r} are refused; to allow that origin, "
                "use --allow-origin"
            )
        if policy.owner_uid is None:
            return None
        client, server = scope.get("client"), scope.get("server")
        uid = None
        if client is not None and server is not None:
            uid = await anyio.to_thread.run_sync(
                policy.peer_uid, (client[0], client[1]), (server[0], server[1])
            )
        if uid == policy.owner_uid:
            return None
        who = f"uid {uid}" if uid is not None else "a peer whose uid cannot be told"
        platform = "" if sys.platform.startswith("linux") else f" on {sys.platform}"
        return (
            f"without --api-key this server answers only its owner (uid {policy.owner_uid}), "
            f"not {who}{platform}: ask its owner to run it with --api-key (or --any-local-user)"
        )
