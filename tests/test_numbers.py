"""Every number phi4 reads from outside (a request on the daemon's socket, an OpenAI request, a
config file, a variable, an option, the daemon's ``--settings``) is range-checked before it is
converted: a 400-digit integer, inf, NaN, a negative keep_alive other than -1 or an empty API
key is one line (or a bad_request, or a 400) naming the field, never ``internal`` and never
taken as something else. And the ``Host`` check takes a scope id only on an IPv6 address.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from phi4cli.core import protocol
from phi4cli.core._settings import Ask
from phi4cli.core.config import FOREVER, load_settings, parse_duration, parse_setting
from phi4cli.core.errors import ConfigError
from phi4cli.core.options import SETTINGS
from phi4cli.core.paths import get_paths
from phi4cli.serve.http_access import AccessPolicy, split_host
from tests.conftest import exchange, run_phi4
from tests.test_http_api import JSON, chat_body, fetch, refusal, serving

HUGE = "1" + "0" * 400  # valid JSON and TOML: an int no float holds
# What a hostile config, variable, flag or --settings may hold where a number belongs.
HOSTILE = [
    int(HUGE),
    -int(HUGE),
    HUGE,
    "1" * 5000,
    math.inf,
    -math.inf,
    math.nan,
    "inf",
    "nan",
    "1e400",
    "-1e400",
]


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "internal error" not in lines[0] and "Traceback" not in stderr
    return lines[0]


# --- the parsers ---------------------------------------------------------------------------------


NOT_DURATIONS = [
    -7,
    "-7",
    -0.5,
    "-2m",
    "-1.5",
    math.inf,
    math.nan,
    int(HUGE),
    HUGE,
    "1" * 5000,
    "1e400",
    True,
    1.7e308 * 10,
]


@pytest.mark.parametrize("value", NOT_DURATIONS)
def test_a_duration_is_refused_unless_it_is_finite_and_not_negative_or_minus_one(value: object):
    # Before: any negative was forever, inf and NaN were kept, a 400-digit int OverflowError.
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize("value", [-1, -1.0, "-1", "-1m", " -1 "])
def test_minus_one_is_forever(value: object):
    assert parse_duration(value) == FOREVER
    assert parse_duration("99999999999999999999h") == 99999999999999999999 * 3600.0


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.key for s in SETTINGS])
def test_every_setting_refuses_hostile_numbers_with_a_line_naming_it(setting: Any):
    # Before: keep_alive 1e400-as-int raised OverflowError ("internal error"), n_ctx and the
    # token counts took any number of digits, and a seed above 2**32 was cut to its low bits.
    numeric = any(kind in setting.type for kind in ("int", "float"))
    for value in HOSTILE:
        try:
            parse_setting(setting.key, value, "somewhere")
        except ConfigError as exc:
            assert str(exc).startswith(f"somewhere: invalid {setting.key} "), exc
            assert len(str(exc)) < 400, "a long value is shown by its start"
        else:
            assert not numeric, f"{setting.key} took {str(value)[:20]!r}"


@pytest.mark.parametrize(
    ("key", "good", "bad"),
    [
        ("seed", 4294967294, 4294967295),
        ("max_tokens", 2**31 - 1, 2**31),
        ("think_budget", 0, -1),
        ("n_ctx", 64, 2**31),
        ("gpu_layers", 0, -1),
    ],
)
def test_whole_numbers_have_bounds_at_both_ends(key: str, good: int, bad: int):
    assert parse_setting(key, str(good), "x") == good
    with pytest.raises(ConfigError, match=f"invalid {key}"):
        parse_setting(key, str(bad), "x")


# --- the daemon's protocol -----------------------------------------------------------------------


def _raw(request_id: str, op: str, params: str) -> bytes:
    """A request line with ``params`` as JSON text (a 400-digit integer stays one)."""
    return f'{{"v":1,"id":"{request_id}","op":"{op}","params":{params}}}\n'.encode()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (f'{{"prompt":"x","confidence_floor":{HUGE}}}', "'confidence_floor'"),
        (f'{{"prompt":"x","confidence_floor":-{HUGE}}}', "'confidence_floor'"),
        ('{"prompt":"x","confidence_floor":Infinity}', "'confidence_floor'"),
        (f'{{"prompt":"x","keep_alive":{HUGE}}}', "'keep_alive'"),
        ('{"prompt":"x","keep_alive":-7}', "'keep_alive'"),
        ('{"prompt":"x","keep_alive":"-7m"}', "'keep_alive'"),
        ('{"prompt":"x","keep_alive":NaN}', "'keep_alive'"),
        ('{"prompt":"x","keep_alive":1e400}', "'keep_alive'"),
        (f'{{"prompt":"x","seed":{HUGE}}}', "'seed'"),
        ('{"prompt":"x","seed":4294967295}', "'seed'"),
        (f'{{"prompt":"x","max_tokens":{HUGE}}}', "'max_tokens'"),
        (f'{{"prompt":"x","think_budget":{HUGE}}}', "'think_budget'"),
        (f'{{"prompt":"x","min_think":{HUGE}}}', "'min_think'"),
        ('{"prompt":"x","temperature":1e400}', "'temperature'"),
        ('{"prompt":"x","top_p":NaN}', "'top_p'"),
        (f'{{"prompt":"x","temperature":{HUGE}}}', "'temperature'"),
    ],
)
def test_a_request_with_a_number_out_of_range_is_a_bad_request_naming_it(params: str, field: str):
    request = protocol.parse_request(_raw("r", "solve", params))
    with pytest.raises(protocol.ProtocolViolation) as caught:
        protocol.parse_params(request.op, request.params, Ask())
    assert caught.value.code == protocol.ErrorCode.BAD_REQUEST
    assert caught.value.message.startswith(field), caught.value.message


@pytest.mark.parametrize("request_id", ["NaN", "Infinity", "1e400"])
def test_an_id_that_is_no_finite_number_is_refused(request_id: str):
    with pytest.raises(protocol.ProtocolViolation, match="needs an 'id'"):
        protocol.parse_request(f'{{"v":1,"id":{request_id},"op":"ping"}}'.encode())


@pytest.mark.daemon
def test_the_daemon_answers_hostile_numbers_with_bad_requests_and_goes_on(tiny_model: Path):
    # Before: confidence_floor = 1 and 400 zeros, in a request or an adjust, was an `internal`
    # error (OverflowError); keep_alive -7 made the daemon resident forever; a seed of 2**32
    # was cut to 0 by ctypes.
    started = run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "2048")
    assert started.returncode == 0, started.stderr
    sock = get_paths().socket
    running = '{"prompt":"Count to fifty.","temperature":0,"max_tokens":40,"confidence":true}'
    events = exchange(
        sock,
        [
            _raw("running", "solve", running),
            _raw("adjust", "adjust", f'{{"target":"running","confidence_floor":{HUGE}}}'),
            _raw("floor", "solve", f'{{"prompt":"x","max_tokens":1,"confidence_floor":{HUGE}}}'),
            _raw("keep", "solve", '{"prompt":"x","max_tokens":1,"keep_alive":-7}'),
            _raw("seed", "solve", '{"prompt":"x","max_tokens":1,"seed":4294967296}'),
            _raw("tokens", "solve", f'{{"prompt":"x","max_tokens":{HUGE}}}'),
        ],
    )
    ends = {e["id"]: e for e in events if e["event"] in ("done", "error")}
    for request_id, field in (
        ("adjust", "'confidence_floor'"),
        ("floor", "'confidence_floor'"),
        ("keep", "'keep_alive'"),
        ("seed", "'seed'"),
        ("tokens", "'max_tokens'"),
    ):
        end = ends[request_id]
        assert (end["event"], end["code"]) == ("error", "bad_request"), end
        assert end["message"].startswith(field), end
    assert ends["running"]["event"] == "done", ends["running"]
    status = json.loads(run_phi4("status", "--json").stdout)
    assert status["state"] == "ready" and status["keep_alive_s"] > 0, "not made resident forever"
    answered = run_phi4("solve", "What is 1+1?", "-m", str(tiny_model), "-n", "4", "-t", "0")
    assert answered.returncode == 0, answered.stderr


# --- the command line: options, variables, config.toml, --settings -------------------------------


@pytest.mark.daemon
def test_a_five_thousand_digit_number_in_the_daemons_settings_is_one_line_naming_it(
    tiny_model: Path,
):
    # Before: "phi4: internal error: ValueError" (json's int() digit limit), exit 3.
    for blob, key in (
        (f'{{"n_ctx": 1{"0" * 5000}}}', "n_ctx"),
        ('{"keep_alive": -7}', "keep_alive"),
        ('{"threads": NaN}', "threads"),
    ):
        result = run_phi4("daemon", "run", "-m", str(tiny_model), "--settings", blob, timeout=60)
        assert result.returncode == 2, result.stderr
        assert one_error_line(result.stderr).startswith(f"phi4: error: --settings: invalid {key} ")
    assert run_phi4("status").returncode == 3, "no daemon was started"


@pytest.mark.parametrize("source", ["option", "variable", "config", "config set"])
@pytest.mark.daemon
def test_a_negative_keep_alive_other_than_minus_one_is_refused_wherever_it_comes_from(
    source: str, tiny_model: Path, phi4_home: Path
):
    # Before: -7 was taken as forever: the daemon stayed resident for good.
    config = phi4_home / "config" / "config.toml"
    args = ["solve", "What is 1+1?", "-m", str(tiny_model), "-n", "2"]
    env: dict[str, str] = {}
    if source == "option":
        args += ["--keep-alive", "-7"]
    elif source == "variable":
        env["PHI4_KEEP_ALIVE"] = "-7"
    elif source == "config":
        config.parent.mkdir(parents=True)
        config.write_text("keep_alive = -7\n")
    else:
        args = ["config", "set", "--", "keep_alive", "-7"]
    result = run_phi4(*args, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert "invalid keep_alive" in line and "-1 (forever; no other negative)" in line, line
    assert run_phi4("status").returncode == 3, "no daemon was started"


@pytest.mark.daemon
def test_a_config_file_with_huge_or_infinite_numbers_is_one_line_naming_the_key(phi4_home: Path):
    # Before: a 5,000-digit int was "internal error: ValueError" (tomllib's int()); inf was
    # taken as a keep_alive.
    config = phi4_home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    cases = [
        (f"n_ctx = 1{'0' * 5000}\n", "n_ctx"),
        ("keep_alive = inf\n", "keep_alive"),
        (f"max_queue = {HUGE}\n", "max_queue"),
        ("top_p = nan\n", "top_p"),
    ]
    for text, key in cases:
        config.write_text(text)
        result = run_phi4("config", "show")
        assert result.returncode == 2, result.stderr
        assert f"{config}: invalid {key}" in one_error_line(result.stderr)


def test_load_settings_refuses_hostile_numbers_from_every_source(tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text("")
    with pytest.raises(ConfigError, match="PHI4_SEED: invalid seed"):
        load_settings(config, {}, {"PHI4_SEED": str(2**32)})
    with pytest.raises(ConfigError, match="--max-tokens: invalid max_tokens"):
        load_settings(config, {"max_tokens": int(HUGE)}, {})


@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({}, ["--api-key", ""]),
        ({}, ["--api-key", "  "]),
        ({}, ["--api-key", "key\x1b"]),
        ({"PHI4_API_KEY": ""}, []),
    ],
    ids=["empty", "spaces", "control", "empty-variable"],
)
@pytest.mark.daemon
def test_serve_refuses_an_api_key_no_client_can_send(
    env: dict[str, str], args: list[str], tiny_model: Path
):
    # Before: `--api-key ''` started a server that answered everyone, its owner included, 401.
    result = run_phi4(
        "serve", "--http", "127.0.0.1:0", "-m", str(tiny_model), *args, env=env, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "--api-key (or PHI4_API_KEY) is empty" in one_error_line(result.stderr)


@pytest.mark.parametrize(
    ("env", "args", "phrase"),
    [
        ({"PHI4_HTTP_HEADER_TIMEOUT": "nan"}, [], "PHI4_HTTP_HEADER_TIMEOUT: invalid 'nan'"),
        ({"PHI4_HTTP_BODY_TIMEOUT": "-5"}, [], "PHI4_HTTP_BODY_TIMEOUT: invalid '-5'"),
        ({"PHI4_HTTP_HEADER_TIMEOUT": "soon"}, [], "PHI4_HTTP_HEADER_TIMEOUT: invalid 'soon'"),
        ({}, ["--http", "127.0.0.1:" + "9" * 5000], "bad address"),
        ({}, ["--http", "127.0.0.1:\u00b2"], "bad address"),
    ],
    ids=[
        "header-timeout-nan",
        "body-timeout-negative",
        "header-timeout-word",
        "port-5000-digits",
        "port-superscript",
    ],
)
@pytest.mark.daemon
def test_serve_refuses_bad_timeouts_and_ports_with_one_line(
    env: dict[str, str], args: list[str], phrase: str, tiny_model: Path
):
    # Before: a NaN timeout started a server that never timed a client out; "soon" and a
    # 5,000-digit port were "internal error: ValueError".
    args = args or ["--http", "127.0.0.1:0"]
    result = run_phi4("serve", *args, "-m", str(tiny_model), env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    assert phrase in one_error_line(result.stderr)


@pytest.mark.daemon
def test_logs_takes_any_number_of_lines():
    # Before: `phi4 logs -n 10**30` was "internal error: OverflowError" (a deque's maxlen).
    log = get_paths().log_file
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("one\ntwo\n")
    result = run_phi4("logs", "-n", "1" + "0" * 30)
    assert (result.returncode, result.stdout) == (0, "one\ntwo\n"), result.stderr


# --- phi4 serve --http: request bodies and the Host check ---------------------------------------


@pytest.mark.daemon
def test_openai_requests_with_numbers_out_of_range_are_400s_naming_the_field(tiny_model: Path):
    # Before: seed 2**32 and n 2 were answered as if they were something else, stream 1 was
    # taken as true, and a Host naming 127.0.0.1 with a scope id, or a 5,000-digit port, got in
    # (the port as a 500).
    raw = {
        f'"max_tokens":{HUGE}': "'max_tokens'",
        '"max_completion_tokens":1e400': "'max_completion_tokens'",  # as the request names it
        '"temperature":1e400': "'temperature'",
        '"temperature":NaN': "'temperature'",
        '"top_p":Infinity': "'top_p'",
        f'"top_p":{HUGE}': "'top_p'",
        '"seed":4294967296': "'seed'",
        '"seed":true': "'seed'",
        '"max_tokens":true': "'max_tokens'",
        '"n":17': "'n'",  # (up to 16 choices: docs/openai.md)
        '"n":0': "'n'",
        '"n":true': "'n'",
        '"stream":1': "'stream'",
    }
    with serving(tiny_model) as url:
        for field, named in raw.items():
            body = f'{{{field},"messages":[{{"role":"user","content":"hi"}}]}}'.encode()
            status, message = refusal(fetch(f"{url}/v1/chat/completions", body, JSON))
            assert status == 400 and message.startswith(named), (field, message)
        port = url.rsplit(":", 1)[1]
        for host in (
            "127.0.0.1%evil.example",
            f"127.0.0.1%evil.example:{port}",
            "127.0.0.1%25lo",
            "[::ffff:127.0.0.1%lo]",
            f"127.0.0.1:{'9' * 5000}",
            "127.0.0.1:65536",
        ):
            status, _message = refusal(fetch(f"{url}/v1/models", headers={"Host": host}))
            assert status == 403, host
        ok = fetch(
            f"{url}/v1/chat/completions", chat_body(n=1, seed=4294967294, stream=False), JSON
        )
        assert ok[0] == 200, ok


@pytest.mark.parametrize(
    ("bound", "host", "allowed"),
    [
        ("127.0.0.1", "127.0.0.1%evil.example", False),
        ("0.0.0.0", "127.0.0.1%lo", False),
        ("0.0.0.0", "10.0.0.1%eth0", False),
        ("::", "::ffff:127.0.0.1%lo", False),
        ("::1", "::1%", False),
        ("::1", "::1%lo", True),
        ("fe80::1", "fe80::1%eth0", True),
        ("fe80::1", "fe80::1%25eth0.100", True),
        ("127.0.0.1", "127.0.0.1", True),
    ],
)
def test_a_scope_id_is_taken_only_on_an_ipv6_address(bound: str, host: str, allowed: bool):
    # Before: "127.0.0.1%evil.example" was read as 127.0.0.1 and answered.
    policy = AccessPolicy.create((bound,), owner_only=False)
    assert policy.host_allowed(host) is allowed


def test_a_host_port_is_checked_before_it_is_converted():
    assert split_host("localhost:" + "1" * 5000) is None
    assert split_host("localhost:65536") is None
    assert split_host("localhost:\u00b2") is None
    assert split_host("[fe80::1%eth0]:8080") == ("fe80::1%eth0", 8080)


@pytest.mark.daemon
def test_samples_seeded_at_the_top_seed_wrap_to_seeds_the_daemon_takes(tiny_model: Path):
    # Sample k is seeded seed + k: past the top seed it must wrap, not be refused.
    result = run_phi4(
        "solve",
        "What is 1+1?",
        "-m",
        str(tiny_model),
        "-n",
        "2",
        "-k",
        "3",
        "--all",
        "--seed",
        "4294967294",
        "--json",
    )
    samples = json.loads(result.stdout)["samples"]
    assert [s["seed"] for s in samples] == [4294967294, 0, 1], result.stderr
    assert [s["error"] for s in samples] == [None, None, None]
