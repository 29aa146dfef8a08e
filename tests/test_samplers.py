"""min_p and repeat_penalty, end to end: the proof that a setting is declared once, in
``options.SETTINGS``, and reaches every place a user sets or sends it (flag, config, variable,
chat /set, the daemon's sampler, a remote server's body, phi4 serve's HTTP API, the docs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phi4cli.core.config import Settings
from tests.conftest import run_phi4
from tests.scripted_server import Step, scripted_server, separated
from tests.test_chat import make_repl, run_script

QUESTION = "Explain step by step how to compute 17*23."


def answer(model: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """The whole text of one deterministic answer (the same whatever ran before)."""
    result = run_phi4(
        "solve", QUESTION, "-m", str(model), "-n", "24", "--deterministic", "--json", *args, env=env
    )
    assert result.returncode in (0, 1), result.stderr
    record = json.loads(result.stdout)
    assert record["stats"]["completion_tokens"] > 0, record
    return f"{record['reasoning']!r} {record['solution']!r}"


@pytest.mark.daemon
def test_each_sampler_changes_the_daemons_answer_however_it_is_set(tiny_model: Path):
    greedy = answer(tiny_model, "-t", "0")
    assert answer(tiny_model, "-t", "0") == greedy, "a greedy answer repeats"
    penalized = answer(tiny_model, "-t", "0", "--repeat-penalty", "1.9")
    assert penalized != greedy, "the penalty reaches the sampler, greedy or not"
    assert answer(tiny_model, "-t", "0", env={"PHI4_REPEAT_PENALTY": "1.9"}) == penalized
    # OpenAI's two penalties, through llama.cpp's penalties sampler (issue 37).
    present = answer(tiny_model, "-t", "0", "--presence-penalty", "2")
    frequent = answer(tiny_model, "-t", "0", "--frequency-penalty", "2")
    assert present != greedy and frequent != greedy, "each reaches the sampler"
    assert answer(tiny_model, "-t", "0", "--presence-penalty", "0") == greedy, "0 is off"
    seeded = answer(tiny_model, "-t", "1", "--seed", "3")
    narrowed = answer(tiny_model, "-t", "1", "--seed", "3", "--min-p", "0.99")
    assert narrowed != seeded, "min_p reaches the sampler"
    assert run_phi4("config", "set", "min_p", "0.99").returncode == 0
    assert answer(tiny_model, "-t", "1", "--seed", "3") == narrowed, "from the config file"
    assert answer(tiny_model, "-t", "1", "--seed", "3", "--min-p", "0") == seeded, "a flag wins"
    # top_k (issue 38's added request row): the one likeliest token is greedy, at any
    # temperature; set by flag, variable or config as any row.
    assert answer(tiny_model, "-t", "1.5", "--seed", "3", "--min-p", "0", "--top-k", "1") == greedy
    hot = answer(tiny_model, "-t", "1.5", "--seed", "3", "--min-p", "0")
    assert hot != greedy, "without it the hot answer is not the greedy one"
    assert (
        answer(tiny_model, "-t", "1.5", "--seed", "3", "--min-p", "0", env={"PHI4_TOP_K": "1"})
        == greedy
    )


@pytest.mark.daemon
def test_a_chat_sets_a_sampler_shows_it_and_sends_it(tiny_model: Path):
    from phi4cli.core.paths import get_paths

    get_paths().state_dir.mkdir(parents=True, exist_ok=True)
    plain, out, _err = make_repl(tiny_model, temperature=0.0, max_tokens=16)
    assert run_script(plain, ["Count to ten.", "/show", "/exit"]) == 0
    shown = out.getvalue()
    assert "repeat_penalty" not in shown and "min_p" not in shown, "off: not said"
    penalized, out, err = make_repl(tiny_model, temperature=0.0, max_tokens=16)
    script = ["/set repeat_penalty 1.9", "/set min_p 2", "Count to ten.", "/show", "/exit"]
    assert run_script(penalized, script) == 0
    # What /set did is said on stderr (stdout is not a terminal here); /show's on stdout.
    assert "repeat_penalty = 1.9" in err.getvalue() and "repeat_penalty=1.9" in out.getvalue()
    assert penalized.conversation.settings == {"repeat_penalty": 1.9}, "min_p 2 is refused"
    assert penalized.conversation.turns[0].answer != plain.conversation.turns[0].answer


@pytest.mark.daemon
def test_a_remote_server_is_sent_the_samplers_under_its_names_only_when_on(tmp_path: Path):
    def script(_body: dict[str, Any]) -> list[str | Step]:
        return separated("reasoning_content", ["Think."], ["$\\boxed{4}$"])

    with scripted_server(script) as server:
        base = ("solve", "2+2?", "--backend", server.url, "-m", "m", "--answer-only")
        assert run_phi4(*base).returncode == 0
        on = run_phi4(
            *base,
            "--min-p",
            "0.05",
            "--repeat-penalty",
            "1.1",
            "--deterministic",
            "--presence-penalty",
            "0.5",
            "--frequency-penalty",
            "-0.25",
            "--top-k",
            "40",
        )
        assert on.returncode == 0, on.stderr
        plain, sent = server.bodies
    # phi4's own deterministic is not sent: a strict server (OpenAI's) refuses what it lacks.
    assert "deterministic" not in sent
    assert not {
        "min_p",
        "repeat_penalty",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
    } & set(plain), plain
    assert sent["top_k"] == 40, "a top_k given is sent; unset, the server keeps its own"
    assert (sent["min_p"], sent["repeat_penalty"], sent["repetition_penalty"]) == (0.05, 1.1, 1.1)
    assert (sent["presence_penalty"], sent["frequency_penalty"]) == (0.5, -0.25)
    assert (sent["temperature"], sent["top_p"]) == (plain["temperature"], plain["top_p"])


def test_phi4_serve_reads_the_samplers_by_their_openai_names_and_checks_them():
    from phi4cli.serve.openai_request import ApiError, chat_params

    body = {
        "messages": [{"role": "user", "content": "2+2?"}],
        "min_p": 0.1,
        "repetition_penalty": 1.2,
    }
    params = chat_params(body, "m", Settings()).ask
    assert (params.min_p, params.repeat_penalty) == (0.1, 1.2)
    assert chat_params({**body, "repeat_penalty": 1.3}, "m", Settings()).ask.repeat_penalty == 1.3
    with pytest.raises(ApiError, match=r"'min_p' must be a number from 0\.0 to 1\.0"):
        chat_params({**body, "min_p": 2}, "m", Settings())
    assert chat_params(body, "m", Settings()).ask.top_k is None, "unset: the daemon's 50"
    assert chat_params({**body, "top_k": 5}, "m", Settings()).ask.top_k == 5
    # -1 is llama-server's and vLLM's "all tokens", as 0 is; a client of theirs may send it.
    assert chat_params({**body, "top_k": -1}, "m", Settings()).ask.top_k == -1
    for bad in (1.5, -2):
        with pytest.raises(ApiError, match=r"'top_k' must be a whole number from -1"):
            chat_params({**body, "top_k": bad}, "m", Settings())
    penalized = chat_params(
        {**body, "presence_penalty": 1.5, "frequency_penalty": -2}, "m", Settings()
    ).ask
    assert (penalized.presence_penalty, penalized.frequency_penalty) == (1.5, -2)
    with pytest.raises(ApiError, match=r"'frequency_penalty' must be a number from -2\.0 to 2"):
        chat_params({**body, "frequency_penalty": 2.5}, "m", Settings())
    # Each refusal names the field as the request spelled it, in the message and in `param`
    # (a found-by-trial gap: a huge max_tokens or a boolean seed came back without `param`).
    for sent, field in (
        ({"max_tokens": float("inf")}, "max_tokens"),
        ({"seed": True}, "seed"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"repetition_penalty": 5}, "repetition_penalty"),
    ):
        with pytest.raises(ApiError) as caught:
            chat_params({**body, "repeat_penalty": None, **sent}, "m", Settings())
        assert caught.value.param == field and caught.value.message.startswith(f"'{field}' must")


def test_the_daemon_checks_the_samplers_and_takes_its_defaults():
    from phi4cli.core._settings import Ask
    from phi4cli.core.protocol import ProtocolViolation, parse_solve_params

    defaults = Ask.of(Settings(min_p=0.05, repeat_penalty=1.1))
    sampling = parse_solve_params({"prompt": "x"}, defaults).ask.sampling
    assert (sampling.min_p, sampling.repeat_penalty) == (0.05, 1.1)
    sent = parse_solve_params({"prompt": "x", "min_p": 0, "repeat_penalty": 1}, defaults)
    assert (sent.ask.min_p, sent.ask.repeat_penalty) == (0.0, 1.0)
    # A penalty of 0 would divide logits by 0 (llama.cpp wants it above 0): 0.5 at least.
    for bad in (
        {"min_p": -0.1},
        {"min_p": "0.1"},
        {"repeat_penalty": 3},
        {"repeat_penalty": True},
        {"repeat_penalty": 0},
        {"repeat_penalty": 0.4},
    ):
        with pytest.raises(ProtocolViolation, match=f"'{next(iter(bad))}'"):
            parse_solve_params({"prompt": "x", **bad}, defaults)


@pytest.mark.daemon
def test_the_samplers_are_in_the_config_the_help_the_man_page_and_the_completions():
    from phi4cli.client.completion import setting_keys
    from phi4cli.core.config import load_settings
    from phi4cli.docs import man_page

    settings = load_settings(Path("/nonexistent"), {}, {"PHI4_MIN_P": "0.2"})
    assert (settings.min_p, settings.repeat_penalty) == (0.2, 1.0)
    bad = run_phi4("solve", "2+2?", "--min-p", "5")
    assert bad.returncode == 2, bad.stderr
    assert "invalid min_p 5.0: expected a number from 0 to 1 (0: off)" in bad.stderr
    helped = run_phi4("chat", "--help").stdout
    assert "--min-p" in helped and "--repeat-penalty" in helped
    page = man_page()
    assert "PHI4_MIN_P" in page and "\\-\\-repeat\\-penalty" in page
    assert set(setting_keys("")) >= {"min_p", "repeat_penalty"}


def test_every_setting_is_declared_once_and_each_derived_list_says_so():
    from phi4cli.client.cli_options import SHARED_OPTIONS
    from phi4cli.core import _settings, options
    from phi4cli.docs import environment

    keys = [row.key for row in options.SETTINGS]
    assert len(keys) == len(set(keys))
    assert list(_settings.Settings._fields) == keys
    assert list(_settings.Sampling._fields) == list(options.SAMPLING_KEYS)
    assert set(SHARED_OPTIONS) == {row.key for row in options.SETTINGS if row.flags}
    assert {name for name, _help in environment()} >= {options.env_name(k) for k in keys}
    assert options.SETTABLE[:5] == ("temperature", "top_p", "max_tokens", "think_budget", "seed")
    assert set(options.SAMPLING_KEYS) <= set(options.REQUEST_KEYS)
    assert "    min_p: float = 0.0\n" in options.generated_records()


def test_a_setting_at_none_is_shown_by_its_rows_word():
    from phi4cli.client.render import format_setting

    assert format_setting("top_k", None) == "default"
    assert format_setting("seed", None) == "random"
    assert format_setting("n_ctx", None) == "auto"
    assert format_setting("max_tokens", None) == "none"
