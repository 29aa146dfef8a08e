"""Text that a terminal would show reordered or not at all: no bidi override or isolate reaches a
terminal from a model, a backend or a file, not even one that Markdown decodes from an entity
(``&#x202e;``), and invisible characters (zero-width spaces and joiners, LRM, tag characters)
are shown there as ``<U+200B>``; a pipe and ``--json`` keep them as sent."""

from __future__ import annotations

import io
import json
import re
import sys
import unicodedata
from collections.abc import Iterator

import pytest
from rich.console import Console
from rich.text import Text

from phi4cli.backends.outcome import Outcome
from phi4cli.client.environment import Environment
from phi4cli.client.presenters import TerminalPresenter, _markdown
from phi4cli.core.protocol import Event, EventKind
from phi4cli.text import sanitize
from tests.conftest import PHI4, run_phi4
from tests.pty_screen import chat_in_pty, in_pty, plain
from tests.scripted_server import scripted_server, separated

RLO, LRI, ZWSP, WJ, TAG_A = "\u202e", "\u2066", "\u200b", "\u2060", "\U000e0041"
BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")

# Entity-encoded and raw, in the thinking and in the answer, split across deltas.
THINKING = ["Let me see &#x202e;evil", f" and{ZWSP} hidden{LRI} text", " &#8238;x."]
ANSWER = [
    "First 12*13 = 156 &#x202e;txet&#x2066;.",
    f" Zero{ZWSP}width{WJ} and raw{RLO}RLO,",
    f" a tag{TAG_A} &zwj;&#x200F;&#X202E;, so $\\boxed{{156{ZWSP}}}$.",
]


def hidden(text: str) -> list[str]:
    """The characters of ``text`` that a terminal shows reordered or not at all."""
    return [
        f"U+{ord(char):04X}"
        for char in text
        if BIDI.match(char) or unicodedata.category(char) in ("Cf", "Zl", "Zp")
    ]


def assert_shown_as_is(screen: str, where: str) -> None:
    found = hidden(screen)
    assert not found, f"{where} carries {found}: {screen!r}"


# --- the pieces ---------------------------------------------------------------------------------


def test_every_format_character_is_shown_at_a_terminal():
    # Each character of Unicode's categories Cf, Zl and Zp (this interpreter's Unicode): a bidi
    # control becomes U+FFFD, every other one its code point, as less shows it.
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        if unicodedata.category(char) not in ("Cf", "Zl", "Zp"):
            continue
        shown = sanitize.terminal_text(f"a{char}b")
        expected = "\ufffd" if BIDI.match(char) else f"<U+{code:04X}>"
        assert shown == f"a{expected}b", f"U+{code:04X}"
    # What attaches to a visible character stays: an emoji's variation selector, accents.
    kept = "⚠\ufe0f é x² = π·r, 12\u00d713"
    assert sanitize.terminal_text(kept) == kept


@pytest.mark.parametrize(
    ("written", "shown"),
    [
        ("&#x202e;", "&#x202e;"),
        ("&#8238;", "&#8238;"),
        ("&#x2066;", "&#x2066;"),
        ("&#X202E;", "&#X202E;"),
        ("&#0008238;", "&#0008238;"),  # seven digits, the most CommonMark decodes
        ("&#00008238;", "&#00008238;"),  # eight: not decoded
        ("&rlm;", "&rlm;"),
        ("&zwj;", "&zwj;"),
        ("&ZeroWidthSpace;", "&ZeroWidthSpace;"),
        ("&#xe0041;", "&#xe0041;"),
        ("&#13;", "&#13;"),  # a carriage return, which would draw over the line
        ("\\&#x202e;", "&#x202e;"),  # escaped already: shown as written, once
        ("\\\\&#x202e;", "\\&#x202e;"),  # an escaped backslash, then the entity
        ("&amp; &pi; &#x3c0;", "& π π"),  # entities of visible characters: decoded
    ],
)
def test_markdown_decodes_no_entity_into_hidden_text(written: str, shown: str):
    # Before: rich's Markdown decoded &#x202e; into a real U+202E after the text was cleaned.
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    console.print(_markdown(f"Before {written} after, `{written}` as code."))
    screen = Text.from_ansi(console.file.getvalue()).plain  # type: ignore[attr-defined]
    assert_shown_as_is(screen, "the rendered Markdown")
    assert f"Before {shown} after, {written} as code." in screen


def test_json_escapes_invisible_characters_and_keeps_the_value():
    value = {"solution": f"a{ZWSP}b{TAG_A}c\u00ad\ufeff", "answer": f"156{WJ}"}
    text = sanitize.json_safe(json.dumps(value, ensure_ascii=False))
    assert json.loads(text) == value
    assert_shown_as_is(text, "JSON")
    assert "\\u200b" in text and "\\udb40\\udc41" in text  # U+E0041 as JSON writes it


def test_a_terminal_environment_guards_whatever_is_written_to_it():
    out, err = io.StringIO(), io.StringIO()
    env = Environment(io.StringIO(), out, err, stdout_isatty=True, stderr_isatty=False)
    print(f"seen{ZWSP} and {RLO}", file=env.stdout)
    print(f"piped{ZWSP}", file=env.stderr)
    assert out.getvalue() == "seen<U+200B> and \ufffd\n"
    assert err.getvalue() == f"piped{ZWSP}\n", "a pipe keeps the text as sent"


def test_the_terminal_presenter_shows_hidden_text_in_solution_and_answer():
    out, err = io.StringIO(), io.StringIO()
    env = Environment(io.StringIO(), out, err, stdout_isatty=True, stderr_isatty=True)
    presenter = TerminalPresenter(show_reasoning=True, verbose=False, env=env)
    outcome = Outcome(index=0, question="q")
    for kind, pieces in ((EventKind.REASONING, THINKING), (EventKind.TOKEN, ANSWER)):
        for piece in pieces:
            event = Event(kind, text=piece)
            outcome.apply(event)
            presenter.on_event(event)
    presenter.finish(outcome)
    assert_shown_as_is(out.getvalue() + err.getvalue(), "the terminal")
    screen = " ".join(Text.from_ansi(out.getvalue()).plain.split())
    assert "First 12*13 = 156 &#x202e;txet&#x2066;." in screen
    assert "Zero<U+200B>width<U+2060> and raw\ufffdRLO" in screen
    assert "Answer: 156<U+200B>" in screen
    assert "Let me see &#x202e;evil and<U+200B> hidden\ufffd text" in err.getvalue()


# --- end to end, through an OpenAI-compatible backend ----------------------------------------


@pytest.fixture
def backend() -> Iterator[str]:
    with scripted_server(lambda _body: separated("reasoning_content", THINKING, ANSWER)) as server:
        yield server.url


def _plain(screen: str) -> str:
    """The screen's text, its runs of white space (lines wrapped at the terminal) one space."""
    return " ".join(plain(screen).split())


def _in_pty(*args: str, env: dict[str, str] | None = None) -> str:
    """``phi4 args`` run with stdout and stderr a terminal 200 columns wide: what it showed."""
    return in_pty(PHI4, list(args), env, width=200)


@pytest.mark.daemon
def test_solve_at_a_terminal_shows_no_hidden_or_reordered_text(backend: str):
    args = ["solve", "What is 12*13?", "--backend", backend, "-m", "phi4-mini-reasoning"]
    # Before: the entities reached the screen as real U+202E and U+2066, zero-width ones raw.
    screen = _in_pty(*args)
    assert_shown_as_is(screen, "solve")
    plain = _plain(screen)
    assert "First 12*13 = 156 &#x202e;txet&#x2066;." in plain
    assert "Zero<U+200B>width<U+2060> and raw\ufffdRLO" in plain
    assert "a tag<U+E0041> &zwj;&#x200F;&#X202E;" in plain
    assert "Answer: 156<U+200B>" in plain

    shown = _in_pty(*args, "-r")
    assert_shown_as_is(shown, "solve -r")
    assert "Let me see &#x202e;evil and<U+200B> hidden\ufffd text &#8238;x." in _plain(shown)

    answer = _in_pty(*args, "-a")
    assert_shown_as_is(answer, "solve -a")
    assert "156<U+200B>" in answer


@pytest.mark.daemon
def test_other_output_at_a_terminal_is_guarded_too(backend: str, tmp_path):
    # A file of problems (its answers and progress), and a setting shown by `config show`.
    problems = tmp_path / "problems.txt"
    problems.write_text("What is 12*13?\nAnd 13*12?\n")
    screen = _in_pty("solve", "-f", str(problems), "-a", "--backend", backend, "-m", "phi4")
    assert_shown_as_is(screen, "solve -f")
    assert "156<U+200B>" in screen

    config = _in_pty("config", "show", env={"PHI4_SYSTEM": f"be{ZWSP} brief{RLO}"})
    assert_shown_as_is(config, "config show")
    assert "be<U+200B> brief\ufffd" in config


@pytest.mark.daemon
def test_chat_at_a_terminal_shows_no_hidden_or_reordered_text(backend: str):
    screen = chat_in_pty(
        PHI4, ["chat", "--backend", backend, "-r"], [("What is 12*13?", "Answer:")], width=200
    )
    assert_shown_as_is(screen, "the chat's terminal")
    plain = _plain(screen)
    assert "First 12*13 = 156 &#x202e;txet&#x2066;." in plain
    assert "Zero<U+200B>width<U+2060>" in plain
    assert "Let me see &#x202e;evil and<U+200B>" in plain


@pytest.mark.daemon
def test_pipes_and_json_keep_the_text_as_sent(backend: str):
    args = ["solve", "What is 12*13?", "--backend", backend, "-m", "phi4-mini-reasoning"]
    piped = run_phi4(*args, "-r")
    assert piped.returncode == 0, piped.stderr
    # As sent, but for the bidi controls (U+FFFD in every mode): the entities are text here.
    assert piped.stdout == BIDI.sub("\ufffd", "".join(ANSWER)) + "\n"
    assert BIDI.sub("\ufffd", "".join(THINKING)) in piped.stderr

    assert run_phi4(*args, "-a").stdout == f"156{ZWSP}\n"
    assert run_phi4(*args, "--raw-output").stdout == "".join(ANSWER) + "\n"

    text = run_phi4(*args, "--json").stdout
    record = json.loads(text)
    assert record["solution"] == "".join(ANSWER) and record["answer"] == f"156{ZWSP}"
    assert record["reasoning"] == "".join(THINKING)
    assert_shown_as_is(text, "--json")  # escaped as \u200b: the same value, seen
