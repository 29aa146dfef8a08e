"""The ``phi4`` command line: parse options, call the client, print; ``exits.run_reporting``
turns what a command raised into its exit status. Imports nothing heavy at module level (no
llama_cpp, numpy, hub). The commands that look after the daemon and what it keeps are in
``cli_daemon.py``, registered here; what every command shares (its Environment) in ``cli_env.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from phi4cli import __version__
from phi4cli.client.cli_daemon import (
    JsonOption,
    cache_app,
    daemon_app,
    logs,
    models,
    pull,
    status,
    stop,
    warm,
)
from phi4cli.client.cli_env import command_settings, print_out, run_env, use_environment
from phi4cli.client.cli_history import answer_as_turn, history_app
from phi4cli.client.cli_options import (
    ANSWER_OPTIONS,
    CHAT_OPTIONS,
    KeepAliveOption,
    ModelOption,
    NoInstructionOption,
    OptionGroup,
    RawOutputOption,
    ShowReasoningOption,
    complete_chat,
    complete_setting_key,
    complete_setting_value,
    with_options,
)
from phi4cli.client.environment import Environment
from phi4cli.client.exits import say  # the one `phi4:` line on stderr, cleaned

# The options commands share, each made from its row of the settings table (cli_options.py).
from phi4cli.core import protocol
from phi4cli.core.config import variable
from phi4cli.core.errors import ConfigError, ExitStatus, UsageError
from phi4cli.core.paths import get_paths
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
app.add_typer(daemon_app, name="daemon")


def _version_callback(value: bool) -> None:
    if value:
        print_out(f"phi4 {__version__} (protocol {protocol.PROTOCOL_VERSION})")
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
    return run_solve(options, run_env())


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
    from phi4cli.client.eval_problems import Problems
    from phi4cli.client.eval_results import MismatchPolicy
    from phi4cli.client.grading import run_eval
    from phi4cli.client.render import format_eval
    from phi4cli.client.solve_job import json_text, make_job

    if restart and force_resume:
        raise UsageError("--restart and --force-resume contradict each other; give one")
    if all_samples and samples == 1:
        raise UsageError("--all goes with --samples K: solve each K times, even once they agree")
    env = run_env()
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
        print_out(json_text(summary, indent=2), file=env.stdout)
    else:
        print_out(format_eval(result, seconds, results), file=env.stderr if jsonl else env.stdout)
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
    from_history: Annotated[
        int | None,
        typer.Option(
            "--from-history",
            metavar="ID",
            help="Go on from answer ID of `phi4 history`: its question and solution open the chat.",
            show_default=False,
        ),
    ] = None,
    show_reasoning: ShowReasoningOption = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print statistics after each answer.")
    ] = False,
    raw_output: RawOutputOption = False,
) -> int:
    """Chat: a streaming REPL whose conversation stays cached in the daemon."""
    from phi4cli.backends.backend import make_backend
    from phi4cli.client.chats import ChatStore, Conversation, default_name
    from phi4cli.client.history import open_history
    from phi4cli.client.render import counted
    from phi4cli.client.repl import ChatRepl, line_reader, prompt_reader
    from phi4cli.client.solve_job import check_sent_text
    from phi4cli.core.models import resolve_model

    if sum((bool(resume), continue_last, from_history is not None)) > 1:
        raise UsageError("give one of --resume NAME, --continue and --from-history ID")
    paths = get_paths()
    settings = command_settings(paths, model=model, **answer)
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
        if from_history is not None:
            conversation.turns.append(answer_as_turn(from_history))
    conversation.model = str(model_path)
    env = run_env()
    env.raw_output = raw_output
    backend_ = make_backend(paths, settings, model_path, env.notice)
    repl = ChatRepl(
        env,
        backend_,
        settings,
        str(model_path),
        conversation,
        store,
        show_reasoning,
        verbose,
        history=open_history(env) if settings.history else None,
    )
    interactive = bool(env.stdin_isatty)
    if interactive:
        print_out(
            clean_text(f"phi4 chat · {model_path.name} · /help for commands, Ctrl-D to leave")
        )
    if conversation.turns:  # (with stdout piped, on stderr: stdout holds the answers)
        turns = counted(len(conversation.turns), "turn")
        print_out(
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
    settings = command_settings(paths, model=model, keep_alive=keep_alive)
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
        print_out(
            json.dumps(
                {k: {"value": v, "source": src} for k, (v, src) in sources.items()}, indent=2
            )
        )
        return
    from phi4cli.client.render import format_settings

    print_out(format_settings(sources))


@config_app.command("path")
def config_path() -> None:
    """Print the config file's path."""
    print_out(get_paths().config_file)


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
    print_out(clean_text(said))


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
    print_out(
        f"{key} removed from {path}; {now}" if removed else f"{key} is not set in {path}; {now}"
    )


@config_app.command("edit")
def config_edit() -> None:
    """Open the config file in $VISUAL or $EDITOR, then check what was written: the file is
    replaced only by a valid edit (at a terminal, a bad one can be edited again)."""
    from phi4cli.client.config_writing import edit_config

    path = get_paths().config_file
    edit_config(path, os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi", say)
    print_out(f"{path}: ok")


# The commands that look after the daemon and what it keeps (cli_daemon.py), each in its place in
# `phi4 -h` (the daemon group is added above, before config).
app.command()(logs)
app.command()(status)
app.command()(stop)
app.command()(warm)
app.add_typer(cache_app, name="cache")
app.add_typer(history_app, name="history")
app.command()(models)
app.command()(pull)


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
    from phi4cli.client.exits import quiet_stdout, reader_gone, run_reporting

    use_environment(env)
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
            stdout = run_env().stdout
            if exc.code == 1 and reader_gone(stdout):
                quiet_stdout(stdout)
                return ExitStatus.OK
            raise
        return code if isinstance(code, int) else None

    run_reporting(run)
