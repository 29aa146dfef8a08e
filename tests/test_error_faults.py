"""Errors as data: the daemon sends a refusal's facts (the field at fault, the numbers) beside
its words, and each door words them its own way (issue 52, item 3). No door reads another's
prose: serve's ``param`` comes from the fault, so rewording the command line's message cannot
change what an OpenAI client is told."""

from __future__ import annotations

import json

import pytest

from phi4cli.backends.outcome import Outcome
from phi4cli.client.repl import chat_words
from phi4cli.core import errors
from phi4cli.core.errors import ErrorCode, Fault, RequestError, error_for
from phi4cli.core.protocol import Event
from phi4cli.serve.openai_request import ApiError

TOO_MANY = Fault("max_tokens", 5_100, 4_096, prompt=100, n_ctx=16_384, streams=4)
TOO_LONG = Fault("prompt", 20_000, 16_300, prompt=20_000, n_ctx=16_384, system=84)


def over_the_wire(event: Event) -> Event:
    """The event as a client reads it off the socket."""
    return Event.from_wire(json.loads(json.dumps(event.to_wire())))


def test_a_fault_travels_with_its_error_event_and_back():
    sent = Event.error(ErrorCode.CONTEXT_OVERFLOW, errors.log_words(TOO_MANY), 7, TOO_MANY)
    read = over_the_wire(sent)
    assert read.fault == TOO_MANY and read.code == ErrorCode.CONTEXT_OVERFLOW
    # An older daemon's error, or one with a malformed fault, has none: its message is used.
    assert over_the_wire(Event.error(ErrorCode.BUSY, "busy")).fault is None
    malformed = {"param": "max_tokens", "needed": "many"}
    odd = Event.from_wire(
        {
            "v": 1,
            "id": 1,
            "event": "error",
            "code": "context_overflow",
            "message": "m",
            "fault": malformed,
        }
    )
    assert odd.fault is None and str(odd.exception()) == "m"


def test_the_command_line_words_a_fault_with_its_flags_and_what_to_run():
    refused = over_the_wire(Event.error(ErrorCode.CONTEXT_OVERFLOW, "whatever", 1, TOO_MANY))
    error = refused.exception()
    assert isinstance(error, RequestError) and error.fault == TOO_MANY
    assert str(error) == (
        "this request needs 5,100 tokens of context (100 of prompt + 5,000 of --max-tokens) but "
        "a request's stream of the daemon's context holds 4,096 (--n-ctx 16,384 over 4 "
        "streams); lower --max-tokens, or restart the daemon with a larger one (phi4 stop; "
        "phi4 daemon start --n-ctx N)"
    )
    assert str(error_for(ErrorCode.CONTEXT_OVERFLOW, "x", TOO_LONG)) == (
        "the question is 20,000 tokens but the daemon's context holds 16,384 (84 of them the "
        "system prompt's); shorten it, or restart the daemon with a larger context (phi4 stop; "
        "phi4 daemon start --n-ctx N)"
    )
    nothing_running = Fault("max_tokens", 900, available=600)
    assert "only 600 are free with nothing running; lower --max-tokens" in str(
        error_for(ErrorCode.CONTEXT_OVERFLOW, "x", nothing_running)
    )


def test_a_chat_names_the_setting_as_set_names_it():
    said = chat_words(error_for(ErrorCode.CONTEXT_OVERFLOW, "x", TOO_MANY))
    assert "5,000 of max_tokens" in said and said.endswith("(in this chat: /set max_tokens N)")
    assert "--max-tokens" not in said
    assert "/set" not in chat_words(error_for(ErrorCode.CONTEXT_OVERFLOW, "x", TOO_LONG))


def test_the_daemon_log_names_both():
    said = errors.log_words(TOO_MANY)
    assert "of max_tokens (--max-tokens)" in said and "lower max_tokens (--max-tokens)" in said


@pytest.mark.parametrize(("fault", "param"), [(TOO_MANY, "max_tokens"), (TOO_LONG, "messages")])
def test_serve_names_the_param_from_the_fault_whatever_the_command_line_says(
    monkeypatch: pytest.MonkeyPatch, fault: Fault, param: str
):
    # The command line's and the log's words change (here: to nothing like the old ones); what
    # serve answers does not, as it never read them.
    monkeypatch.setattr(errors, "cli_words", lambda fault, max_tokens="": "it did not fit")
    monkeypatch.setattr(errors, "log_words", lambda fault: "it did not fit")
    refused = over_the_wire(Event.error(ErrorCode.CONTEXT_OVERFLOW, "it did not fit", 1, fault))
    answer = ApiError.of(refused)
    body = answer.body()["error"]
    assert answer.status == 400 and body["param"] == param
    assert body["type"] == "invalid_request_error"
    if param == "max_tokens":
        assert body["message"] == (
            "this request needs 5,100 tokens of context (100 of messages + 5,000 of max_tokens) "
            "but the model's context holds 4,096 for one request; lower max_tokens"
        )
    else:
        assert body["message"].startswith("the messages are 20,000 tokens")
    # Without a fault (an older daemon) the message is passed on and no param is guessed.
    plain = ApiError.of(Event.error(ErrorCode.CONTEXT_OVERFLOW, "lower --max-tokens"))
    assert plain.param is None and plain.message == "lower --max-tokens"


@pytest.mark.parametrize(
    ("sent", "param"),
    [({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": -1}, "max_tokens")],
)
def test_serve_names_a_bad_field_from_the_refusals_data_not_its_words(
    monkeypatch: pytest.MonkeyPatch, sent: dict[str, object], param: str
):
    # The daemon's words for a bad field change to ones that do not begin with its name; serve
    # still names the field as the request spelled it, from the refusal's param and detail.
    from phi4cli.core import protocol
    from phi4cli.core.config import Settings
    from phi4cli.serve.openai_request import chat_params

    def reworded(cls: type[protocol.ProtocolViolation], name: str, detail: str, request_id=None):
        return cls(ErrorCode.BAD_REQUEST, f"bad value: {detail}", request_id, name, detail)

    monkeypatch.setattr(protocol.ProtocolViolation, "field", classmethod(reworded))
    body = {"model": "m", "messages": [{"role": "user", "content": "1+1?"}], **sent}
    with pytest.raises(ApiError) as caught:
        chat_params(body, "m", Settings())
    assert caught.value.param == param
    assert caught.value.message.startswith(f"'{param}' must be a whole number from 1 to")


def test_a_file_of_problems_and_its_records_say_a_fault_the_command_lines_way():
    # `solve --file` lines, --jsonl and eval records print the error of each problem: the
    # command line's words, not the daemon log's.
    outcome = Outcome(index=0, question="q")
    outcome.apply(over_the_wire(Event.error(ErrorCode.CONTEXT_OVERFLOW, "log words", 0, TOO_MANY)))
    assert outcome.error_message == errors.cli_words(TOO_MANY)
    assert outcome.to_json()["error"]["message"] == errors.cli_words(TOO_MANY)


def test_a_context_the_daemon_could_not_make_is_said_by_each_door():
    shrunk = Fault("max_tokens", 3_000, 2_048, prompt=100, n_ctx=2_048, shrunk=True)
    said = str(error_for(ErrorCode.CONTEXT_OVERFLOW, "x", shrunk))
    assert said.startswith("the daemon could not make its whole context (its log says why)")
    assert "lower --max-tokens, or restart the daemon (phi4 stop)" in said
    message, param = errors.api_words(shrunk)
    assert param == "max_tokens" and "lower max_tokens" in message and "--" not in message
    assert over_the_wire(Event.error(ErrorCode.CONTEXT_OVERFLOW, "x", 1, shrunk)).fault == shrunk
