"""The ``phi4`` script's first stop: a warm ``phi4 solve`` run by the daemon itself.

A ``phi4 solve`` piped to another program spends most of its time starting Python and importing
what the client needs: ``re`` and ``enum`` (json, socket, pathlib and the client's own modules
pull them in) cost more than the daemon takes to answer a short question. The daemon has all of
it imported already. So, like Mercurial's ``chg`` in front of its command server, this module
sends the command line to the running daemon (``op: run``), which runs the same ``phi4 solve``
code in a thread of its own, against itself, and sends back what the command writes and its exit
status; this module writes those out and exits with that status. It imports only ``os``,
``sys``, ``_socket``, ``_json`` and ``_signal`` (C modules and what every interpreter has loaded
at start-up). A question on stdin is read here when the daemon asks for it, and sent.

Anything else goes to the full client (``phi4cli.entry``), unchanged: another command, stdout
at a terminal (the live view needs rich in this process), no daemon answering, or a daemon that
declines, before it has run anything: ``--file``, ``--samples``, an environment or install
unlike its own (``core.rendezvous``, ``client.served``). A daemon from before this op answers
``bad_request`` and is declined the same way.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, ClassVar, NoReturn

PROTOCOL_VERSION = 1  # protocol.PROTOCOL_VERSION (a test checks they agree)
MAX_LINE_BYTES = 1 << 20  # protocol.MAX_LINE_BYTES
INTERRUPTED = 130  # ExitStatus.INTERRUPTED
UNAVAILABLE = 3  # ExitStatus.DAEMON_UNAVAILABLE
# A daemon says at once whether it runs a command; one that does not within this is frozen or
# swamped, and the full client (which says which) takes over.
ACCEPT_TIMEOUT = 5.0
# Once it runs, the daemon sends a heartbeat at least every 20 s while the command runs
# (server.HEARTBEAT_S); silence this long is a frozen daemon (the full client's
# daemon_link.STREAM_IDLE_TIMEOUT).
IDLE_TIMEOUT = 90.0


# --- the wire, without json (which imports re) ---------------------------------------------------


def encode(value: Any) -> str:
    """JSON for what a ``run`` request holds: dicts with string keys, lists, strings, ints,
    bools and None."""
    from _json import encode_basestring_ascii as string

    if isinstance(value, str):
        return string(value)
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, dict):
        return "{" + ",".join(f"{string(key)}:{encode(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(encode(item) for item in value) + "]"
    raise TypeError(f"cannot send {type(value).__name__}")


class _Decoding:
    """What ``_json.make_scanner`` reads off its context: json.loads's defaults."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # -Infinity, Infinity, NaN
    memo: ClassVar[dict[str, str]] = {}


def decoder() -> Any:
    """``decode(line) -> object`` for one wire line (bytes, newline included)."""
    from _json import make_scanner

    context: Any = _Decoding()  # what the C scanner reads, not a JSONDecoder
    scan = make_scanner(context)

    def decode(line: bytes) -> Any:
        text = line.decode("utf-8", "replace").strip()
        value, end = scan(text, 0)
        if end != len(text):
            raise ValueError("extra data after an event")
        return value

    return decode


# --- where the daemon is ----------------------------------------------------------------------


def _tempdir() -> str | None:
    """``tempfile.gettempdir()`` where it is sure to say /tmp; None (the full client) else."""
    if any(os.environ.get(name) for name in ("TMPDIR", "TEMP", "TMP")):
        return None
    return "/tmp" if os.access("/tmp", os.W_OK | os.X_OK) else None


def socket_path() -> str | None:
    """The daemon's socket, where its directory is one of ours (as the full client checks
    before it trusts it); None where the full client should decide."""
    import stat

    from phi4cli.core.rendezvous import SOCKET_NAME, runtime_dir

    directory = runtime_dir(os.environ, _tempdir)
    if directory is None:
        return None
    try:
        info = os.lstat(directory)
    except OSError:
        return None
    if info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o077:
        return None
    return os.path.join(directory, SOCKET_NAME)


# --- the command ------------------------------------------------------------------------------


def _isatty(fd: int) -> bool | None:
    """Whether ``fd`` is a terminal; None when it is closed (``>&-``)."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return os.isatty(fd)


class Declined(Exception):
    """The daemon will not run this command, or none answered, and nothing was written: the
    full client runs it."""


class NeedsStdin(Declined):
    """The daemon runs this command only with its question, which is on stdin (``-``, or none
    given and stdin no terminal): read it and ask again."""


# A command's stdin, once read here for the daemon: the full client gets it if it runs the
# command after all (``main``).
_stdin: list[bytes] = []


def run_in_daemon(argv: list[str]) -> int:
    """Have the daemon run ``phi4 argv``; return its exit status. Raise Declined when nothing
    was written."""
    import _socket

    ttys = [_isatty(fd) for fd in (0, 1, 2)]
    if None in ttys or ttys[1] or sys.stdout is None or sys.stderr is None:
        raise Declined
    path = socket_path()
    if path is None:
        raise Declined
    from phi4cli import __version__
    from phi4cli.core.rendezvous import environment, install_id

    try:
        cwd = os.getcwd()
    except OSError:  # removed under us: the full client says so
        raise Declined from None
    params = {"argv": argv, "env": environment(os.environ), "cwd": cwd, "socket": path,
              "version": __version__, "install": install_id(), "stdin_tty": ttys[0],
              "stderr_tty": ttys[2]}  # fmt: skip
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:  # (closed on the way out: a daemon that accepts the command late then drops it)
        try:
            sock.settimeout(ACCEPT_TIMEOUT)  # a connect too: a frozen daemon's backlog fills
            sock.connect(path)
            uid = _peer_uid(sock)
            if uid is not None and uid != os.getuid():
                from phi4cli.core.rendezvous import foreign_socket

                _write(sys.stderr, f"phi4: error: {foreign_socket(path, uid)}\n")
                return UNAVAILABLE
            _ask(sock, 1, params)
        except OSError:
            raise Declined from None
        try:
            return _follow(sock, 1)
        except NeedsStdin:
            pass
        _stdin.append(sys.stdin.buffer.read())
        # Its bytes as they are, one character each (JSON escapes those past ASCII).
        params["stdin"] = _stdin[0].decode("latin-1")
        try:
            _ask(sock, 3, params)
        except (OSError, ValueError):
            raise Declined from None
        return _follow(sock, 3)
    finally:
        sock.close()


def _ask(sock: Any, request_id: int, params: dict[str, Any]) -> None:
    """Send a ``run`` request; ValueError for one longer than the daemon reads
    (``protocol.MAX_LINE_BYTES``: a question of hundreds of kilobytes on stdin)."""
    line = f'{{"v":{PROTOCOL_VERSION},"id":{request_id},"op":"run","params":{encode(params)}}}\n'
    if len(line) > MAX_LINE_BYTES:
        raise ValueError("too long for one request")
    sock.sendall(line.encode("ascii"))  # (encode() escapes all but ASCII)


def _peer_uid(sock: Any) -> int | None:
    """The uid of the process at the other end (None where the system cannot say)."""
    import _socket

    option = getattr(_socket, "SO_PEERCRED", None)
    if option is None:
        return None
    credentials = sock.getsockopt(_socket.SOL_SOCKET, option, 12)  # pid, uid, gid: 3 ints
    return int.from_bytes(credentials[4:8], sys.byteorder)


class _Command:
    """Where a command run by the daemon has got to, as its events say."""

    def __init__(self) -> None:
        self.accepted = False  # the daemon runs it: a Ctrl-C is the command's to answer
        # An answer was written: the full client can no longer take over (after notices on
        # stderr alone it can, saying them again).
        self.written = False
        self.line_open = False  # stdout's last text did not end its line
        self.interrupted = False
        self.last: Any = None  # the stream written last (flushed before the other is written)

    def gone(self, why: str) -> int:
        """The daemon went away, or said something unreadable: before an answer was written the
        full client runs the command (starting a daemon if need be); after, it is lost."""
        if not self.written:
            raise Declined
        self.flush()
        if self.line_open:  # the answer's line ends, as the full client's, then the error
            _write(sys.stdout, "\n")
            sys.stdout.flush()
        _write(sys.stderr, f"phi4: error: {why}\n")
        return UNAVAILABLE

    def flush(self) -> None:
        if self.last is not None:
            self.last.flush()
            self.last = None

    def see(self, event: Any) -> int | None:
        """Act on one event; its exit status once the command has ended."""
        kind = event.get("event")
        if kind == "output":
            out = event.get("stream") == "out"
            self.written = self.written or out
            stream = sys.stdout if out else sys.stderr
            if self.last is not None and self.last is not stream:
                self.last.flush()
            text = str(event.get("text", ""))
            _write(stream, text)
            if out and text:
                self.line_open = not text.endswith("\n")
            self.last = stream
        elif kind == "accepted":
            self.accepted = True
        elif kind == "done":
            status = (event.get("result") or {}).get("status")
            if not isinstance(status, int) or isinstance(status, bool):  # declined
                if self.written:
                    return self.gone("the daemon gave no exit status; run the command again")
                if (event.get("result") or {}).get("stdin"):
                    raise NeedsStdin
                raise Declined
            return status
        elif kind == "error":
            return self.gone(
                f"the daemon could not run the command: {event.get('message')}; run it again"
            )
        return None


def _follow(sock: Any, request_id: int) -> int:
    """Write out what the command writes, up to its exit status. A Ctrl-C is passed on (the
    command stops as at a terminal, saying so); a second one leaves at once."""
    decode = decoder()
    command = _Command()
    _listen_for_interrupts(sock, command, request_id)
    pending = b""
    patient = False  # waiting as long as a running command may be silent
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if not command.accepted:
                raise Declined from None
            return command.gone(f"the daemon sent nothing for {IDLE_TIMEOUT:g} s: it is not "
                                "answering (frozen, or stopped with SIGSTOP?); `phi4 stop` "
                                "ends it")  # fmt: skip
        except OSError:
            chunk = b""
        if not chunk:
            return command.gone("the daemon went away mid-answer; the answer above is "
                                "unfinished (run the command again)")  # fmt: skip
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            try:
                event = decode(line)
            except (ValueError, StopIteration):
                return command.gone("the daemon sent garbage; run the command again")
            if isinstance(event, dict) and event.get("id") in (request_id, None):
                status = command.see(event)
                if status is not None:
                    command.flush()
                    return status
        if command.accepted and not patient:
            sock.settimeout(IDLE_TIMEOUT)
            patient = True
        command.flush()


def _listen_for_interrupts(sock: Any, command: _Command, request_id: int) -> None:
    """Pass a Ctrl-C to ``command`` (as ``cancel`` of its request): wherever it lands, a read or
    a write, and however many requests the command took (its stdin asked for)."""
    import _signal  # type: ignore[import-not-found]  # signal itself imports enum

    def on_interrupt(signum: int, frame: Any) -> None:
        # Only a command that runs can be told; a second Ctrl-C leaves at once.
        if command.interrupted or not command.accepted:
            raise KeyboardInterrupt
        command.interrupted = True
        cancel = f'{{"v":1,"id":2,"op":"cancel","params":{{"target":{request_id}}}}}\n'
        try:
            sock.sendall(cancel.encode())
        except OSError:
            raise KeyboardInterrupt from None

    on_interrupt.thin = True  # type: ignore[attr-defined]
    handler = _signal.getsignal(_signal.SIGINT)
    if handler is _signal.default_int_handler or getattr(handler, "thin", False):
        _signal.signal(_signal.SIGINT, on_interrupt)  # (not where it is ignored: `cmd &`)


def _stop_listening() -> None:
    import _signal

    if getattr(_signal.getsignal(_signal.SIGINT), "thin", False):
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


def _write(stream: Any, text: str) -> None:
    stream.write(text)


def _quit(status: int) -> NoReturn:
    """Flush and leave without the interpreter's teardown (``exits.exit_now``)."""
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105 - contextlib is one import more
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def main() -> NoReturn:
    argv = sys.argv[1:]
    if argv[:1] == ["solve"] and "_PHI4_COMPLETE" not in os.environ:
        try:
            status = run_in_daemon(argv)
        except Declined:
            _stop_listening()  # Ctrl-C is the full client's again
            if _stdin:  # read for the daemon: the full client reads it from here
                import io

                sys.stdin = io.TextIOWrapper(io.BytesIO(_stdin[0]), sys.stdin.encoding,
                                             sys.stdin.errors)  # fmt: skip
        except BrokenPipeError:
            # The reader went away (`| head -1`): leaving closes the connection, which stops
            # the command. Point stdout at /dev/null so the last flush is quiet.
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            _quit(0)
        except KeyboardInterrupt:
            _write(sys.stderr, "\n")
            _quit(INTERRUPTED)
        except OSError as exc:  # writing out what the daemon sent (a full disk)
            from phi4cli.client.exits import notice_line, output_problem, quiet_stdout

            problem = output_problem(exc, sys.stdout)
            if problem is not None:
                _write(sys.stderr, notice_line(f"error: {problem}") + "\n")
                quiet_stdout(sys.stdout)
            else:
                _write(sys.stderr, f"phi4: internal error: {type(exc).__name__}: {exc} "
                                   "(PHI4_DEBUG=1 shows the traceback)\n")  # fmt: skip
            _quit(1)
        else:
            _quit(status)
    from phi4cli.entry import main as full_client

    full_client()
