"""The ``phi4`` commands that look after the daemon and what it keeps: ``logs``, ``status``,
``stop``, ``warm``, ``models``, ``pull`` and the ``daemon`` and ``cache`` groups. ``cli.py``
registers them on the app, each in its place in ``phi4 -h``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from phi4cli.client.cli_env import command_settings, print_out, run_env
from phi4cli.client.cli_options import ModelOption, OptionGroup, complete_alias, with_daemon_options
from phi4cli.client.exits import say
from phi4cli.core.config import Settings, format_duration
from phi4cli.core.errors import ExitStatus, Phi4Error, UsageError
from phi4cli.core.paths import Paths, get_paths

daemon_app = typer.Typer(
    help="Start, stop, inspect or run the background daemon.", no_args_is_help=True
)


def logs(
    lines: Annotated[int, typer.Option("--lines", "-n", min=0, help="How many lines.")] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines (Ctrl-C stops).")
    ] = False,
) -> None:
    """Show the daemon log (rotated by size in the state dir)."""
    from phi4cli.client.logfile import show_log

    path = get_paths().log_file
    if not path.exists():
        raise Phi4Error(f"no daemon log yet ({path}); the daemon writes it once it starts")
    show_log(path, lines, follow, run_env().stdout)


@daemon_app.command("install-service")
def daemon_install_service(
    model: ModelOption = None,
    keep_alive: Annotated[
        str, typer.Option("--keep-alive", help="keep_alive of the service's daemon.")
    ] = "-1",
) -> None:
    """Write a systemd user unit that runs the daemon at login, and say how to enable it."""
    from phi4cli.client.service import unit_text
    from phi4cli.core.atomicfile import UnwritableError, write_atomic
    from phi4cli.core.config import variable
    from phi4cli.core.models import resolve_model

    paths = get_paths()
    settings = command_settings(paths, model=model, keep_alive=keep_alive)
    model_path = resolve_model(settings.model, paths)
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    unit = config_home / "systemd" / "user" / "phi4.service"
    text = unit_text(model_path, keep_alive, variable("PHI4_HOME"))
    try:
        write_atomic(unit, text.encode(), mode=0o644, what="systemd unit")
    except OSError as exc:
        raise UnwritableError(unit, "systemd unit", exc) from None
    print_out(f"wrote {unit}")
    print_out(
        "enable it with: systemctl --user daemon-reload && systemctl --user enable --now phi4"
    )


def _status_of(paths: Paths) -> dict[str, Any]:
    from phi4cli.backends.daemon_link import daemon_status

    return daemon_status(paths)


def _print_status(status: dict[str, Any], as_json: bool) -> None:
    from phi4cli.client.render import format_status

    print_out(json.dumps(status, indent=2) if as_json else format_status(status))


JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def status(
    as_json: JsonOption = False,
    backend: Annotated[
        list[str] | None,
        typer.Option(
            "--backend",
            metavar="URL",
            show_default=False,
            help="Probe these OpenAI-compatible servers instead (give it once per "
            "replica): up or down, how long each took to answer and, from its /metrics, "
            "requests in flight, waiting and answered, and tokens/s.",
        ),
    ] = None,
) -> None:
    """Show the daemon's state, model, pid, uptime, memory, requests and idle time left."""
    if backend:
        _print_backend_status(backend, as_json)
        return
    from phi4cli.core.errors import DaemonUnavailableError

    try:
        found = _status_of(get_paths())
    except DaemonUnavailableError as error:
        if as_json:  # a script reading stdout gets an answer too (the exit status is still 3)
            print_out(
                json.dumps(
                    {"running": False, "state": "not running", "reason": str(error)}, indent=2
                )
            )
        raise
    _print_status(found, as_json)


def _print_backend_status(urls: list[str], as_json: bool) -> None:
    """`phi4 status --backend A --backend B`: each replica probed (``/health``, else
    ``/v1/models``); exit 3 when none is up."""
    from phi4cli.backends.remote import backend_key
    from phi4cli.backends.remote_backend import RemoteBackend
    from phi4cli.core.config import parse_setting

    paths = get_paths()
    settings = command_settings(paths)
    parsed = list(parse_setting("backend", urls, "--backend") or ())
    if not parsed:  # `--backend ""`: a URL was meant (an IndexError before)
        raise UsageError("--backend needs the URL of an OpenAI-compatible server")
    remote = RemoteBackend(parsed, settings.model, backend_key(), settings.backend_timeout)
    status = remote.status()
    if as_json:
        print_out(json.dumps(status, indent=2))
    else:
        from phi4cli.client.render import format_replicas

        print_out(format_replicas(status["replicas"]))
    if status["state"] != "remote":
        raise typer.Exit(ExitStatus.DAEMON_UNAVAILABLE)


def stop() -> None:
    """Stop the daemon (same as `phi4 daemon stop`)."""
    daemon_stop()


@daemon_app.command("status")
def daemon_status(as_json: JsonOption = False) -> None:
    """Show the daemon's state (same as `phi4 status`)."""
    status(as_json)


@daemon_app.command("stop")
def daemon_stop() -> None:
    """Stop the daemon, also in the middle of a generation."""
    from phi4cli.backends.daemon_link import stop_daemon

    pid = stop_daemon(get_paths(), announce=say)
    print_out("no daemon was running" if pid is None else f"daemon stopped (pid {pid})")


def _daemon_setup(daemon: OptionGroup, **overrides: object) -> tuple[Paths, Settings, Path]:
    """Paths, settings and the resolved model for a command that starts or runs the daemon."""
    from phi4cli.core.models import resolve_model

    paths = get_paths()
    values: dict[str, object] = {k: v for k, v in daemon.items() if k != "ramdisk"}
    if daemon["ramdisk"] is not None:
        values["ramdisk"] = "on" if daemon["ramdisk"] else "off"
    settings = command_settings(paths, **values, **overrides)
    return paths, settings, resolve_model(settings.model, paths)


@daemon_app.command("start")
@with_daemon_options
def daemon_start(daemon: OptionGroup) -> None:
    """Start the daemon in the background and wait until its model is loaded."""
    from phi4cli.backends.daemon_link import daemon_status

    paths, settings, model_path = _daemon_setup(daemon)
    set_keep_alive = daemon["keep_alive"] is not None
    from phi4cli.backends.backend import load_model

    load = load_model(paths, settings, model_path, set_keep_alive, say)[0]
    current = daemon_status(paths)
    keep = format_duration(float(current.get("keep_alive_s", settings.keep_alive)))
    print_out(
        f"daemon ready (pid {current['pid']}, model {current.get('model')}, "
        f"load {load.get('load_s', 0):.2f} s, keep_alive {keep})"
    )


@daemon_app.command("run")
@with_daemon_options
def daemon_run(
    daemon: OptionGroup,
    given: Annotated[
        str | None, typer.Option("--settings", hidden=True, show_default=False)
    ] = None,
) -> None:
    """Run the daemon in the foreground (for debugging and service managers)."""
    from phi4cli.daemon.server import run_daemon

    paths, settings, model_path = _daemon_setup(daemon)
    if given is not None:  # a client started it: its settings, as that client has them
        from phi4cli.client.config_writing import started_with

        settings = started_with(given, settings)
    run_daemon(paths, settings, model_path)


@with_daemon_options
def warm(
    daemon: OptionGroup,
    no_wait: Annotated[
        bool, typer.Option("--no-wait", help="Return once the daemon is starting.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the timings as JSON.")] = False,
) -> None:
    """Start the daemon if needed, stage and load the model, prewarm it, and report timings."""
    from phi4cli.backends.backend import load_model
    from phi4cli.backends.daemon_link import connect_checked
    from phi4cli.client.render import format_warm

    paths, settings, model_path = _daemon_setup(daemon)
    if no_wait:
        from phi4cli.backends.daemon_link import daemon_status

        connect_checked(paths, settings, model_path, say).close()
        if daemon_status(paths).get("state") == "ready":  # (it said "loading" when it was not)
            print_out(f"the daemon is ready: {model_path.name} is loaded")
        else:
            print_out(f"the daemon is loading {model_path.name}; `phi4 status` shows its progress")
        return
    started = time.monotonic()
    timings, spawned = load_model(
        paths, settings, model_path, daemon["keep_alive"] is not None, say
    )
    timings["wall_s"] = round(time.monotonic() - started, 4)
    # A daemon this command started loaded the model as it started: that load was ours.
    timings["already_loaded"] = bool(timings.get("already_loaded")) and not spawned
    print_out(json.dumps(timings, indent=2) if as_json else format_warm(timings))


cache_app = typer.Typer(help="Staged model copies and saved prompt states.", no_args_is_help=True)


@cache_app.command("clear")
def cache_clear() -> None:
    """Remove staged model copies (RAM), saved system-prompt states and swapped-out chats, and
    empty the running daemon's prompt cache."""
    from phi4cli.backends.daemon_link import clear_daemon_prompts
    from phi4cli.client.caches import clear_caches

    paths = get_paths()
    staged, states, sessions = clear_caches(paths, say)
    from phi4cli.client.render import counted, human_bytes

    copies = counted(staged, "staged model copy", "staged model copies")
    saved = counted(states, "saved prompt state")
    chats = counted(sessions, "swapped-out chat session")
    print_out(f"removed {copies}, {saved} and {chats}")
    kept = clear_daemon_prompts(paths)
    if kept is not None:
        print_out(
            f"emptied the daemon's prompt cache: {counted(kept['prompts'], 'prompt')}, "
            f"{human_bytes(kept['bytes'])}"
        )


def models() -> None:
    """List model aliases and what is on disk."""
    from phi4cli.client.render import format_models
    from phi4cli.core.models import list_models

    print_out(format_models(list_models(get_paths())))


def pull(
    name: Annotated[
        str, typer.Argument(help="Model alias to download.", autocompletion=complete_alias)
    ] = "phi4-mini-reasoning",
) -> None:
    """Download a model (resumable, verified as GGUF) into the models directory."""
    from phi4cli.core.models import pull_model

    path = pull_model(name, get_paths())
    print_out(f"{name}: {path}")
