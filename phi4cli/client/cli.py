"""The ``phi4`` command line: parse options, call the client, print; ``exits.run_reporting``
turns what a command raised into its exit status. Imports nothing heavy at module level (no
llama_cpp, numpy, hub).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from phi4cli import __version__
from phi4cli.client.cli_options import (
    ANSWER_OPTIONS,
    CHAT_OPTIONS,
    KeepAliveOption,
    ModelOption,
    NoInstructionOption,
    OptionGroup,
    RawOutputOption,
    ShowReasoningOption,
    complete_alias,
    complete_chat,
    complete_setting_key,
    complete_setting_value,
    with_daemon_options,
    with_options,
)
from phi4cli.client.environment import Environment
from phi4cli.client.exits import say  # the one `phi4:` line on stderr, cleaned

# The options commands share, each made from its row of the settings table (cli_options.py).
from phi4cli.core import protocol
from phi4cli.core.config import Settings, format_duration, load_settings, variable
from phi4cli.core.errors import ConfigError, ExitStatus, Phi4Error, UsageError
from phi4cli.core.paths import Paths, get_paths
from phi4cli.text.sanitize import clean_text

# Typer >= 0.26 vendors its own click: reach its exception classes through a public name.
_click_exceptions = sys.modules[typer.BadParameter.__module__]

app = typer.Typer(
    name="phi4",
    help="A local math solver: Phi-4-mini-reasoning, resident in a background daemon.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts say [default ...] and [env ...] literally
    context_settings={"help_option_names": ["-h", "--help"]},
)
daemon_app = typer.Typer(
    help="Start, stop, inspect or run the background daemon.", no_args_is_help=True
)
app.add_typer(daemon_app, name="daemon")


def _settings(paths: Paths, **overrides: object) -> Settings:
    return load_settings(paths.config_file, overrides)


def _version_callback(value: bool) -> None:
    if value:
        _print(f"phi4 {__version__} (protocol {protocol.PROTOCOL_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version_callback,
            is_eager=True,
            help="Show the version and exit.",
        ),
    ] = False,
) -> None:
    """A local math solver: Phi-4-mini-reasoning, resident in a background daemon."""


@app.command()
@with_options(ANSWER_OPTIONS)
def solve(
    answer: OptionGroup,
    prompt: Annotated[
        list[str] | None,
        typer.Argument(
            help="The problem to solve: one quoted argument, or words joined with single "
            "spaces; '-' (or piped stdin) reads it from stdin.",
            show_default=False,
        ),
    ] = None,
    model: ModelOption = None,
    show_reasoning: ShowReasoningOption = False,
    answer_only: Annotated[
        bool, typer.Option("--answer-only", "-a", help="Print just the final answer, one line.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object (question, answer, solution, reasoning, stats, ...).",
        ),
    ] = False,
    file: Annotated[
        str | None,
        typer.Option(
            "--file",
            "-f",
            help="Solve every line of FILE ('-' for stdin), in order.",
            show_default=False,
            metavar="FILE",
        ),
    ] = None,
    each_line: Annotated[
        bool, typer.Option("--each-line", help="With '-': each line of stdin is a problem.")
    ] = False,
    jsonl: Annotated[
        bool, typer.Option("--jsonl", help="With --file: one JSON object per problem per line.")
    ] = False,
    samples: Annotated[
        int,
        typer.Option(
            "--samples",
            "-k",
            min=1,
            max=64,
            help="Self-consistency: solve K times, majority-vote the answers.",
        ),
    ] = 1,
    all_samples: Annotated[
        bool,
        typer.Option(
            "--all",
            help="With --samples: solve all K times, even once the vote is settled (it stops "
            "when the leading answer leads with 93%: 3 of 3 agreeing).",
        ),
    ] = False,
    no_instruction: NoInstructionOption = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print timing and cache statistics to stderr.")
    ] = False,
    raw_output: RawOutputOption = False,
) -> int:
    """Solve a problem (or a file of them), streaming the model's answer."""
    from phi4cli.client.solving import SolveOptions, run_solve
    from phi4cli.core.inputs import join_words

    options = SolveOptions(
        prompt=join_words(prompt),
        model=model,
        show_reasoning=show_reasoning,
        answer_only=answer_only,
        as_json=as_json,
        file=file,
        each_line=each_line,
        jsonl=jsonl,
        samples=samples,
        all_samples=all_samples,
        no_instruction=no_instruction,
        verbose=verbose,
        raw_output=raw_output,
        **answer,
    )
    return run_solve(options, _env())


@app.command("eval")
@with_options(ANSWER_OPTIONS)
def eval_(
    answer: OptionGroup,
    file: Annotated[
        Path,
        typer.Argument(
            help="Problems with reference answers: JSONL (one object a line) or CSV.",
            show_default=False,
        ),
    ],
    model: ModelOption = None,
    problem_field: Annotated[
        str, typer.Option("--problem-field", help="Field (or CSV column) of the problem.")
    ] = "problem",
    answer_field: Annotated[
        str, typer.Option("--answer-field", help="Field (or CSV column) of the reference answer.")
    ] = "answer",
    samples: Annotated[
        int,
        typer.Option(
            "--samples",
            "-k",
            min=1,
            max=64,
            help="Solve each K times: majority-vote accuracy and pass@K.",
        ),
    ] = 1,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            show_default=False,
            help="Results file (JSONL; a rerun resumes from it) [default: FILE's name "
            "+ .results.jsonl, next to it].",
        ),
    ] = None,
    jsonl: Annotated[
        bool, typer.Option("--jsonl", help="Print each problem's record on stdout as it is judged.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as one JSON object.")
    ] = False,
    restart: Annotated[
        bool,
        typer.Option(
            "--restart",
            help="Start the results file over (replaced atomically), solving every problem.",
        ),
    ] = False,
    force_resume: Annotated[
        bool,
        typer.Option(
            "--force-resume",
            help="Resume from results made by another model or other settings too, as if "
            "this run had made them.",
        ),
    ] = False,
    all_samples: Annotated[
        bool,
        typer.Option(
            "--all",
            help="With --samples: solve each problem K times, even once its vote is settled.",
        ),
    ] = False,
    no_instruction: NoInstructionOption = False,
) -> int:
    """Solve problems with known answers and report accuracy (math-verify judges each answer)."""
    from phi4cli.client.grading import MismatchPolicy, Problems, run_eval
    from phi4cli.client.render import format_eval
    from phi4cli.client.solving import json_text, make_job

    if restart and force_resume:
        raise UsageError("--restart and --force-resume contradict each other; give one")
    if all_samples and samples == 1:
        raise UsageError("--all goes with --samples K: solve each K times, even once they agree")
    env = _env()
    problems = Problems(file, problem_field, answer_field)
    count = problems.check()  # before anything starts: a bad line is exit 2
    results = output or file.with_name(file.name + ".results.jsonl")
    with contextlib.suppress(OSError):  # (a results file not there yet: it is made)
        if os.path.samefile(file, results):
            # Else each record was appended to the problems, and the next run refused them.
            raise UsageError(
                f"-o {results} is the problems file itself; give the results another file"
            )
    # With samples, each one's confidence is recorded (sample_details), as solve --json shows
    # it: what replaying --vote confidence or --stop-unsure offline needs (bench/votes.py).
    job = make_job(env, model, dict(answer), no_instruction, confidence=samples > 1)
    policy = MismatchPolicy(restart=restart, force=force_resume)
    try:
        tally, seconds = run_eval(
            job, problems, count, samples, results, jsonl, policy, every=all_samples
        )
    except KeyboardInterrupt:
        say(f"interrupted: what was finished is in {results}; run the same command to resume")
        raise
    result = tally.summary(samples, adaptive=samples > 1 and not all_samples)
    replicas = getattr(job.backend, "last_summary", None)
    if replicas and len(replicas) > 1:
        result["replicas"] = replicas  # how many each answered (also said on stderr)
    if as_json:
        summary = {**result, "seconds": round(seconds, 3), "results": str(results)}
        _print(json_text(summary, indent=2), file=env.stdout)
    else:
        _print(format_eval(result, seconds, results), file=env.stderr if jsonl else env.stdout)
    return ExitStatus.ERROR if result["error"] else ExitStatus.OK


@app.command()
@with_options(CHAT_OPTIONS)
def chat(
    answer: OptionGroup,
    model: ModelOption = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="Reopen the saved conversation NAME.",
            metavar="NAME",
            show_default=False,
            autocompletion=complete_chat,
        ),
    ] = None,
    continue_last: Annotated[
        bool, typer.Option("--continue", "-c", help="Reopen the most recent conversation.")
    ] = False,
    show_reasoning: ShowReasoningOption = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print statistics after each answer.")
    ] = False,
    raw_output: RawOutputOption = False,
) -> int:
    """Chat: a streaming REPL whose conversation stays cached in the daemon."""
    from phi4cli.backends.backend import make_backend
    from phi4cli.client.chats import ChatStore, Conversation, default_name
    from phi4cli.client.render import counted
    from phi4cli.client.repl import ChatRepl, line_reader, prompt_reader
    from phi4cli.client.solving import check_sent_text
    from phi4cli.core.models import resolve_model

    if resume and continue_last:
        raise UsageError("give --resume NAME or --continue, not both")
    paths = get_paths()
    settings = _settings(paths, model=model, **answer)
    check_sent_text(settings)
    store = ChatStore(paths.data_dir / "chats")

    def model_for(spec: str) -> Path:
        # With a remote backend the model is a name for that server, not a file here.
        return Path(spec) if settings.backend else resolve_model(spec, paths)

    if resume or continue_last:
        conversation = store.load(resume) if resume else store.latest()
        model_path = model_for(model or conversation.model)
        if answer["system"] is not None:
            conversation.system = answer["system"]
    else:
        model_path = model_for(settings.model)
        conversation = Conversation(
            name=default_name(), model=str(model_path), system=settings.system
        )
    conversation.model = str(model_path)
    env = _env()
    env.raw_output = raw_output
    backend_ = make_backend(paths, settings, model_path, env.notice)
    repl = ChatRepl(
        env, backend_, settings, str(model_path), conversation, store, show_reasoning, verbose
    )
    interactive = bool(env.stdin_isatty)
    if interactive:
        _print(clean_text(f"phi4 chat · {model_path.name} · /help for commands, Ctrl-D to leave"))
    if conversation.turns:  # (with stdout piped, on stderr: stdout holds the answers)
        turns = counted(len(conversation.turns), "turn")
        _print(
            clean_text(f"resumed {conversation.name}: {turns}"),
            file=None if env.stdout_isatty else env.stderr,
        )
    if interactive:
        paths.state_dir.mkdir(parents=True, exist_ok=True)
        reader = prompt_reader(paths.state_dir / "chat_history")
        repl.keys = reader.answer_keys()
        return repl.run(reader)
    return repl.run(line_reader(env.stdin, notice=env.notice))


@app.command()
def serve(
    http: Annotated[
        str,
        typer.Option(
            "--http",
            metavar="HOST:PORT",
            help="Address for the OpenAI-compatible API (loopback unless --api-key).",
        ),
    ],
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="PHI4_API_KEY",
            show_envvar=False,  # (the help says it, as the other options' do)
            show_default=False,
            help="Require 'Authorization: Bearer KEY' [env PHI4_API_KEY].",
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            metavar="NAME",
            show_default=False,
            help="Also answer requests whose Host is NAME (repeatable; '*' for any).",
        ),
    ] = None,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-origin",
            metavar="ORIGIN",
            show_default=False,
            help="Answer browser requests from ORIGIN, e.g. http://localhost:3000, with CORS "
            "(repeatable; '*' for any).",
        ),
    ] = None,
    any_local_user: Annotated[
        bool,
        typer.Option(
            "--any-local-user",
            help="Without --api-key, answer every local user, not only you.",
        ),
    ] = False,
    model: ModelOption = None,
    keep_alive: KeepAliveOption = None,
) -> None:
    """Expose the daemon as an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models,
    /health, /metrics)."""
    from phi4cli.backends.daemon import DaemonBackend
    from phi4cli.core.models import ALIASES, alias_path, resolve_model
    from phi4cli.serve.http_access import check_allowances
    from phi4cli.serve.http_api import check_address
    from phi4cli.serve.http_api import serve as serve_http

    if api_key is None and variable("PHI4_API_KEY") == "":
        api_key = ""  # set but empty (click reads that as unset): refused, not served keyless
    check_address(http, api_key)  # before anything else is looked at
    check_allowances(allow_host or (), allow_origin or ())
    paths = get_paths()
    settings = _settings(paths, model=model, keep_alive=keep_alive)
    model_path = resolve_model(settings.model, paths)
    name = settings.model if settings.model in ALIASES else model_path.stem
    aliases = [alias.name for alias in ALIASES.values() if alias_path(alias, paths) == model_path]
    backend_ = DaemonBackend(paths, settings, model_path, say)
    try:
        serve_http(
            backend_,
            settings,
            model_path,
            name,
            http,
            api_key,
            say,
            allow_host or (),
            allow_origin or (),
            any_local_user,
            aliases,
        )
    except KeyboardInterrupt:
        return


config_app = typer.Typer(help="Show, locate, set or edit the settings.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(as_json: JsonOption = False) -> None:
    """Show every setting's value and where it comes from (default, config file, env)."""
    from phi4cli.core.config import setting_sources

    sources = setting_sources(get_paths().config_file)
    if as_json:
        _print(
            json.dumps(
                {k: {"value": v, "source": src} for k, (v, src) in sources.items()}, indent=2
            )
        )
        return
    from phi4cli.client.render import format_settings

    _print(format_settings(sources))


@config_app.command("path")
def config_path() -> None:
    """Print the config file's path."""
    _print(get_paths().config_file)


@config_app.command("set")
def config_set(
    key: Annotated[
        str,
        typer.Argument(help="Setting name, e.g. temperature.", autocompletion=complete_setting_key),
    ],
    value: Annotated[
        str,
        typer.Argument(
            help="New value; 'none' clears an optional one.",
            autocompletion=complete_setting_value,
        ),
    ],
) -> None:
    """Set one setting in the config file, after checking the value."""
    from phi4cli.client.config_writing import set_config_value, setting_key

    paths = get_paths()
    path = paths.config_file
    from phi4cli.client.render import format_setting

    if key == "model":
        from phi4cli.core.config import parse_setting
        from phi4cli.core.errors import InvalidModelError, ModelNotFoundError
        from phi4cli.core.models import ALIASES, resolve_model

        named = parse_setting(key, value, f"config key {key}")
        if named not in ALIASES:  # (an alias may be pulled later)
            try:
                resolve_model(named, paths)  # a file that is not there, or not a GGUF
            except (ModelNotFoundError, InvalidModelError) as error:
                raise ConfigError(f"invalid model: {error}") from None  # a bad value: exit 2
    parsed = set_config_value(path, key, value)
    key = setting_key(key)
    said = f"{key} = {format_setting(key, parsed)} ({path})"
    from phi4cli.core.config import setting_sources
    from phi4cli.core.options import env_name

    now, source = setting_sources(path)[key]
    if source == env_name(key):  # the file's value is not the one in effect here
        said += f"; {source}={format_setting(key, now)} overrides it here"
    _print(clean_text(said))


@config_app.command("unset")
def config_unset(
    key: Annotated[
        str,
        typer.Argument(help="Setting name, e.g. temperature.", autocompletion=complete_setting_key),
    ],
) -> None:
    """Remove one setting from the config file: it takes its default again (or the value of its
    environment variable, where that is set)."""
    from phi4cli.client.config_writing import setting_key, unset_config_value
    from phi4cli.client.render import format_setting
    from phi4cli.core.config import setting_sources

    path = get_paths().config_file
    removed = unset_config_value(path, key)
    key = setting_key(key)
    value, source = setting_sources(path)[key]
    now = clean_text(f"{key} = {format_setting(key, value)} ({source})")
    _print(f"{key} removed from {path}; {now}" if removed else f"{key} is not set in {path}; {now}")


@config_app.command("edit")
def config_edit() -> None:
    """Open the config file in $VISUAL or $EDITOR, then check what was written: the file is
    replaced only by a valid edit (at a terminal, a bad one can be edited again)."""
    from phi4cli.client.config_writing import edit_config

    path = get_paths().config_file
    edit_config(path, os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi", say)
    _print(f"{path}: ok")


@app.command()
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
    show_log(path, lines, follow, _env().stdout)


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
    settings = _settings(paths, model=model, keep_alive=keep_alive)
    model_path = resolve_model(settings.model, paths)
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    unit = config_home / "systemd" / "user" / "phi4.service"
    text = unit_text(model_path, keep_alive, variable("PHI4_HOME"))
    try:
        write_atomic(unit, text.encode(), mode=0o644, what="systemd unit")
    except OSError as exc:
        raise UnwritableError(unit, "systemd unit", exc) from None
    _print(f"wrote {unit}")
    _print("enable it with: systemctl --user daemon-reload && systemctl --user enable --now phi4")


def _status_of(paths: Paths) -> dict[str, Any]:
    from phi4cli.backends.daemon_link import daemon_status

    return daemon_status(paths)


def _print_status(status: dict[str, Any], as_json: bool) -> None:
    from phi4cli.client.render import format_status

    _print(json.dumps(status, indent=2) if as_json else format_status(status))


JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command()
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
            _print(
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
    settings = _settings(paths)
    parsed = list(parse_setting("backend", urls, "--backend") or ())
    if not parsed:  # `--backend ""`: a URL was meant (an IndexError before)
        raise UsageError("--backend needs the URL of an OpenAI-compatible server")
    remote = RemoteBackend(parsed, settings.model, backend_key(), settings.backend_timeout)
    status = remote.status()
    if as_json:
        _print(json.dumps(status, indent=2))
    else:
        from phi4cli.client.render import format_replicas

        _print(format_replicas(status["replicas"]))
    if status["state"] != "remote":
        raise typer.Exit(ExitStatus.DAEMON_UNAVAILABLE)


@app.command()
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
    _print("no daemon was running" if pid is None else f"daemon stopped (pid {pid})")


def _daemon_setup(daemon: OptionGroup, **overrides: object) -> tuple[Paths, Settings, Path]:
    """Paths, settings and the resolved model for a command that starts or runs the daemon."""
    from phi4cli.core.models import resolve_model

    paths = get_paths()
    values: dict[str, object] = {k: v for k, v in daemon.items() if k != "ramdisk"}
    if daemon["ramdisk"] is not None:
        values["ramdisk"] = "on" if daemon["ramdisk"] else "off"
    settings = _settings(paths, **values, **overrides)
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
    _print(
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


@app.command()
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
            _print(f"the daemon is ready: {model_path.name} is loaded")
        else:
            _print(f"the daemon is loading {model_path.name}; `phi4 status` shows its progress")
        return
    started = time.monotonic()
    timings, spawned = load_model(
        paths, settings, model_path, daemon["keep_alive"] is not None, say
    )
    timings["wall_s"] = round(time.monotonic() - started, 4)
    # A daemon this command started loaded the model as it started: that load was ours.
    timings["already_loaded"] = bool(timings.get("already_loaded")) and not spawned
    _print(json.dumps(timings, indent=2) if as_json else format_warm(timings))


cache_app = typer.Typer(help="Staged model copies and saved prompt states.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


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
    _print(f"removed {copies}, {saved} and {chats}")
    kept = clear_daemon_prompts(paths)
    if kept is not None:
        _print(
            f"emptied the daemon's prompt cache: {counted(kept['prompts'], 'prompt')}, "
            f"{human_bytes(kept['bytes'])}"
        )


@app.command()
def models() -> None:
    """List model aliases and what is on disk."""
    from phi4cli.client.render import format_models
    from phi4cli.core.models import list_models

    _print(format_models(list_models(get_paths())))


@app.command()
def pull(
    name: Annotated[
        str, typer.Argument(help="Model alias to download.", autocompletion=complete_alias)
    ] = "phi4-mini-reasoning",
) -> None:
    """Download a model (resumable, verified as GGUF) into the models directory."""
    from phi4cli.core.models import pull_model

    path = pull_model(name, get_paths())
    _print(f"{name}: {path}")


_environment: Environment | None = None  # the one main was given: see _env


def _print(*values: object, file: Any = None, **options: Any) -> None:
    """print, to this run's Environment's stdout unless told otherwise: a command's output
    goes through the streams ``main`` was given, never around them."""
    print(*values, file=file if file is not None else _env().stdout, **options)


def _env() -> Environment:
    """The Environment of this run: the one ``main`` was given (``entry.main`` makes it), or,
    for a command run some other way (a test's CliRunner), one made now, once."""
    global _environment
    if _environment is None:
        _environment = Environment()
    return _environment


def usage_line(exc: Any) -> str:
    """A usage error of Click's as phi4's other errors read: one line, what went wrong and where
    to look ("error: no such option: --bogus; `phi4 solve -h` lists the options"), rather than
    Click's usage, hint and error on four lines."""
    message = clean_text(exc.format_message()).replace("\n", " ").strip()
    # Click's suggestion as a clause: "no such command 'bogus' (did you mean 'logs'?)".
    message = re.sub(r"\.\s+Did you mean (.+\?)$", r" (did you mean \1)", message)
    message = message[:1].lower() + message[1:]
    path = exc.ctx.command_path if exc.ctx is not None else "phi4"
    lists = "the commands" if "command" in message else "the options"
    return f"error: {message.rstrip('.')}; `{path} -h` lists {lists}"


def main(argv: list[str] | None = None, env: Environment | None = None) -> NoReturn:
    """Run the Typer app in ``env`` and exit with the documented exit code for whatever
    happened.

    ``phi4cli.entry.main`` (the ``phi4`` script) comes here for everything but the fast solve.
    """
    global _environment
    from phi4cli.client.exits import quiet_stdout, reader_gone, run_reporting

    _environment = env
    command = typer.main.get_command(app)

    def run() -> int | None:
        try:
            code = command.main(args=argv, prog_name="phi4", standalone_mode=False)
        except _click_exceptions.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # (Click 8.2+: `phi4`, `phi4 cache`)
                # A command group without its command: its help, laid out as written, not the
                # one-line error (which squashed the whole help onto one line).
                print(clean_text(exc.format_message()), file=sys.stderr, flush=True)
            else:
                say(usage_line(exc))
            return ExitStatus.USAGE
        except _click_exceptions.ClickException as exc:
            exc.show()
            return int(exc.exit_code)
        except typer.Abort:
            raise KeyboardInterrupt from None
        except SystemExit as exc:
            # Click (and Typer) meet a BrokenPipeError from any command with sys.exit(1), even
            # outside standalone mode: the reader of stdout went away, which the README counts
            # as success (`phi4 logs | head -1`).
            stdout = _env().stdout
            if exc.code == 1 and reader_gone(stdout):
                quiet_stdout(stdout)
                return ExitStatus.OK
            raise
        return code if isinstance(code, int) else None

    run_reporting(run)
