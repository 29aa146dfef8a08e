"""One typed request: ``SolveParams`` with its ``Ask`` (generated from the settings table's
request rows). The client fills it, ``protocol.to_wire`` makes its wire form, and
``protocol.parse_params`` (the daemon's and the remote engine's one reader) gives it back
whole; every request row is checked on the wire as its row says, and its default is stated
once, in the table."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phi4cli.core import options
from phi4cli.core._settings import Ask, Settings
from phi4cli.core.options import CHOICES
from phi4cli.core.protocol import (
    MAX_TOP_LOGPROBS,
    PRIORITIES,
    PRIORITY_INTERACTIVE,
    Op,
    ProtocolViolation,
    SolveParams,
    parse_params,
    to_wire,
)

TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)


def _value(key: str) -> st.SearchStrategy[Any]:
    """What the request row ``key`` allows on the wire, as its row says."""
    row = options.SETTING[key]
    if row.wire is not None:
        low, high = row.wire
        if isinstance(low, int) and isinstance(high, int):
            values: st.SearchStrategy[Any] = st.integers(low, high)
        else:
            values = st.floats(low, high, allow_nan=False)
    elif row.type == "bool":
        values = st.booleans()
    elif key in CHOICES:
        values = st.sampled_from(CHOICES[key])
    else:
        values = TEXT.filter(str.strip)
    return st.one_of(st.none(), values) if row.type.endswith("| None") else values


ASKS = st.builds(Ask, **{key: _value(key) for key in Ask._fields})


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, SolveParams]:
    op = draw(st.sampled_from([Op.SOLVE, Op.CHAT]))
    turns = draw(st.lists(st.tuples(TEXT, TEXT), max_size=3))
    floor = draw(st.one_of(st.none(), st.floats(-50, 50, allow_nan=False)))
    params = SolveParams(
        prompt=draw(TEXT.filter(str.strip)),
        ask=draw(ASKS),
        model=draw(st.one_of(st.none(), st.just("/models/m.gguf"))),
        keep_alive=draw(st.one_of(st.none(), st.sampled_from([0.0, 90.0, -1.0]))),
        priority=PRIORITY_INTERACTIVE
        if op == Op.CHAT
        else draw(st.sampled_from(sorted(PRIORITIES.values()))),
        session="s1" if op == Op.CHAT else None,
        history=tuple(
            message
            for question, answer in turns
            if op == Op.CHAT
            for message in (
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            )
        ),
        confidence=draw(st.booleans()) or floor is not None,
        confidence_floor=floor,
        logprobs=draw(st.one_of(st.none(), st.integers(0, MAX_TOP_LOGPROBS))),
        sample_group=draw(st.one_of(st.none(), st.integers(0, 10))),
    )
    return op, params


@settings(max_examples=300, deadline=None)
@given(requests(), ASKS)
def test_the_wire_form_reads_back_as_the_request_whatever_the_daemon_defaults(
    sent: tuple[str, SolveParams], defaults: Ask
) -> None:
    op, params = sent
    # All of its ask travels: the client's settings are what count, not the daemon's. The
    # client's own hint (its samples' group, for a remote server's n) stays off the wire.
    assert "sample_group" not in to_wire(op, params)
    assert parse_params(op, to_wire(op, params), defaults) == params._replace(sample_group=None)


def test_a_load_reads_back_as_a_load():
    load = SolveParams(
        "", model="/models/m.gguf", keep_alive=60.0, load_only=True, priority=PRIORITY_INTERACTIVE
    )
    assert to_wire(Op.LOAD, load) == {"model": "/models/m.gguf", "keep_alive": 60.0}
    assert parse_params(Op.LOAD, to_wire(Op.LOAD, load), Ask()) == load


def test_what_a_request_does_not_say_is_the_daemons_setting():
    daemon = Ask.of(Settings(temperature=0.2, think_budget=500, loop="stop", max_tokens=99))
    params = parse_params(Op.SOLVE, {"prompt": "2+2", "top_p": 0.5}, daemon)
    assert params.ask == daemon._replace(top_p=0.5)
    # A null takes the daemon's where the row cannot be None, and is None where it can.
    nulls = parse_params(
        Op.SOLVE, {"prompt": "2+2", "temperature": None, "seed": None, "think_budget": None}, daemon
    )
    assert (nulls.ask.temperature, nulls.ask.seed, nulls.ask.think_budget) == (0.2, None, None)


@pytest.mark.parametrize("key", Ask._fields)
def test_every_request_row_is_checked_on_the_wire_naming_it(key: str):
    for bad in ({"a": 1}, [1], "2" if options.SETTING[key].type != "str | None" else 2):
        with pytest.raises(ProtocolViolation, match=f"'{key}'"):
            parse_params(Op.SOLVE, {"prompt": "2+2", key: bad}, Ask())


def test_every_default_is_stated_once_in_the_table():
    # Ask's defaults are the table's (generated), Settings' the same, and the protocol's
    # record holds none of the ask's fields beside it.
    for key in Ask._fields:
        assert Ask._field_defaults[key] == options.SETTING[key].default, key
    assert Ask.of(Settings()) == Ask()
    assert not set(SolveParams._fields) & set(Ask._fields)


def test_the_sampler_is_the_asks_sampling_rows():
    ask = Ask(temperature=0.3, top_p=0.5, seed=9, max_tokens=10)
    assert ask.sampling._asdict() == {key: getattr(ask, key) for key in options.SAMPLING_KEYS}
