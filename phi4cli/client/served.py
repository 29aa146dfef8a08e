"""A ``phi4 solve`` run inside the daemon for the thin client (``phi4cli.thin``, ``op: run``).

The daemon hands ``serve`` the request's params and a ``CommandIO`` (its side of the
connection). ``serve`` runs the very code the full client runs — ``entry.parse_solve``,
``solving.run_solve``, ``exits.report`` — with an ``Environment`` whose streams go back over the
connection and whose daemon link is the daemon itself (``CommandIO.link``: no socket, no spawn).
What the command writes and its exit status are the same as the full client's, or it is
declined before anything runs and the full client runs it:

- another phi4 (version or install) than the daemon's, or an environment unlike the daemon's in
  any variable a command reads (``rendezvous.read_by_a_command``): settings, paths and colour are
  worked out from the daemon's own ``os.environ``, so they must be the same;
- anything but ``solve QUESTION [options]``: a question on stdin, ``--file``/``--each-line``
  (they read the client's files and stdin), ``--backend`` (remote engines stay in the client),
  what the fast parser hands to Typer (``--help``, a typo);
- a working directory unlike the daemon's where the model or ``PHI4_HOME`` is a relative path
  (the daemon's threads share its working directory);
- a socket the daemon does not serve (the thin client found another runtime directory).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TextIO, cast

from phi4cli import __version__
from phi4cli.core.rendezvous import environment, install_id

if TYPE_CHECKING:
    from phi4cli.client._solve_options import SolveOptions
    from phi4cli.engines.daemon_link import Channel


class CommandIO(Protocol):
    """The daemon's side of a ``run`` request."""

    def accept(self) -> None:
        """The command runs: from here on the client waits for its exit status."""

    def write(self, stream: str, text: str) -> None:
        """Text the command writes to ``stream`` (out or err); BrokenPipeError once the client
        has gone."""

    def check(self) -> None:
        """Raise KeyboardInterrupt for a Ctrl-C at the client not yet answered."""

    def channel(self) -> Channel:
        """A way to this daemon for the command's requests (``ChannelConnection`` wraps it)."""
        ...


class RemoteStream(io.TextIOBase):
    """A command's stdout or stderr, sent to the client at each flush (and at the end)."""

    encoding = "utf-8"
    errors = "strict"

    def __init__(self, command: CommandIO, name: str, tty: bool) -> None:
        super().__init__()
        self._command, self._name, self._tty = command, name, tty
        self._held: list[str] = []

    def write(self, text: str) -> int:
        self._held.append(text)
        return len(text)

    def flush(self) -> None:
        if self._held:
            text, self._held = "".join(self._held), []
            self._command.write(self._name, text)

    def isatty(self) -> bool:
        return self._tty

    def writable(self) -> bool:
        return True


NEEDS_STDIN = "the question is on stdin"
# Variables naming directories, read against the working directory when relative (platformdirs
# takes a relative XDG_*_HOME as it is; tempfile makes a relative TMPDIR absolute against the
# directory it is first asked in).
RELATIVE_TO_CWD = (
    "PHI4_HOME",
    "HOME",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_CACHE_HOME",
    "XDG_RUNTIME_DIR",
    "TMPDIR",
)


def why_declined(params: Mapping[str, Any], socket: str) -> str | SolveOptions:
    """Why the daemon (serving at ``socket``) will not run this command; else its options."""
    from phi4cli.client.solve_line import parse_solve

    argv, env, cwd = params.get("argv"), params.get("env"), params.get("cwd")
    if not (isinstance(argv, list) and all(isinstance(arg, str) for arg in argv)
            and isinstance(env, dict) and isinstance(cwd, str)
            and isinstance(params.get("socket"), str)):  # fmt: skip
        return "not a command line"
    if params.get("version") != __version__ or params.get("install") != install_id():
        return "another phi4"
    own = environment(os.environ)
    if env != own:
        differ = sorted(name for name in {*env, *own} if env.get(name) != own.get(name))
        return f"another environment ({', '.join(map(repr, differ))})"  # (names, not values)
    try:
        if not os.path.samefile(params["socket"], socket):
            return "another daemon's socket"
    except OSError:
        return "another daemon's socket"
    parsed = parse_solve(argv[1:]) if argv[:1] == ["solve"] else None
    if parsed is None:
        return "not a command the daemon runs"
    from phi4cli.client._solve_options import SolveOptions

    options = SolveOptions(**parsed)
    if options.file is not None or options.each_line:
        return "reads the client's files"
    if options.samples > 1:
        # Votes compare answers with sympy (math-verify): work for the client's own process,
        # not for threads beside the engine's.
        return "samples"
    stdin = params.get("stdin")
    if stdin is not None and not (isinstance(stdin, str) and _bytes_as_text(stdin)):
        return "not a command line"
    same_directory = _same_directory(cwd)
    for name in RELATIVE_TO_CWD:
        value = env.get(name)
        if value and not os.path.isabs(os.path.expanduser(value)) and not same_directory:
            return f"a relative {name}"
    try:
        from phi4cli.core.config import load_settings
        from phi4cli.core.models import ALIASES
        from phi4cli.core.paths import get_paths

        settings = load_settings(get_paths().config_file, {"model": options.model,
                                                           **options.answer})  # fmt: skip
    except Exception:
        return "settings the full client reports on"
    if settings.backend:
        return "a remote backend"
    model = settings.model
    if model not in ALIASES and not os.path.isabs(os.path.expanduser(model)) \
            and not same_directory:  # fmt: skip
        return "a model named relative to the working directory"
    reads_stdin = options.prompt == "-" or (options.prompt is None and not params.get("stdin_tty"))
    if reads_stdin and stdin is None:
        from phi4cli.client.solving import check_options
        from phi4cli.core.errors import UsageError

        try:
            check_options(options)  # options that do not go together: said before stdin is read
        except UsageError:
            return options
        return NEEDS_STDIN  # the client reads it and asks again
    return options


def _bytes_as_text(text: str) -> bool:
    """Whether ``text`` is bytes sent as latin-1 text (stdin's, by the thin client)."""
    return text.isascii() or max(map(ord, text)) < 256


def _same_directory(cwd: str) -> bool:
    try:
        return os.path.samefile(cwd, os.getcwd())
    except OSError:
        return False


def serve(params: Mapping[str, Any], command: CommandIO, socket: str,
          decline: Callable[[str, bool], None]) -> int | None:  # fmt: skip
    """Run the command ``params`` describe; its exit status, or None when it was declined
    (``decline`` was told why, and whether the client should ask again with its stdin; nothing
    ran)."""
    options = why_declined(params, socket)
    if isinstance(options, str):
        decline(options, options == NEEDS_STDIN)
        return None
    from phi4cli.client.environment import Environment
    from phi4cli.client.exits import report
    from phi4cli.client.solving import run_solve
    from phi4cli.core.errors import ExitStatus
    from phi4cli.engines.daemon_link import ChannelConnection

    command.accept()
    out = RemoteStream(command, "out", False)
    err = RemoteStream(command, "err", bool(params.get("stderr_tty")))
    # The question on stdin, as the client read it (bytes, sent as latin-1 text): read_all
    # checks its bytes as the full client's does.
    data = str(params.get("stdin") or "").encode("latin-1")
    stdin = io.TextIOWrapper(io.BytesIO(data), "utf-8")
    env = Environment(stdin, cast(TextIO, out), cast(TextIO, err),
                      stdin_isatty=bool(params.get("stdin_tty")), stdout_isatty=False,
                      stderr_isatty=err.isatty(),
                      link=lambda: ChannelConnection(command.channel()))  # fmt: skip

    def run() -> int:
        status = run_solve(options, env)
        command.check()  # a Ctrl-C while it printed its last: as the full client, exit 130
        return status

    try:
        status = report(run, env.stdout, env.stderr)
    except BrokenPipeError:  # the client went while its error was being said: no one to tell
        return ExitStatus.OK
    for stream in (out, err):
        with contextlib.suppress(BrokenPipeError):
            stream.flush()
    return status
