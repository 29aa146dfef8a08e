"""Nothing a model, a remote engine or a saved file writes is obeyed by the terminal (escape
sequences, control characters, bidi overrides are cleaned on every way out), and the terminal
view shows the model's math as written: a `*` in a product is multiplication, not emphasis."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pexpect
import pytest
from rich.console import Console
from rich.markdown import Markdown
from rich.text import Text

from phi4cli.backends.outcome import Outcome
from phi4cli.client.chats import ChatStore, Conversation
from phi4cli.client.presenters import TerminalPresenter, markdown_source
from phi4cli.client.render import format_eval, format_warm
from phi4cli.core.paths import get_paths
from phi4cli.core.protocol import Event, EventKind
from phi4cli.text.sanitize import REPLACEMENT, TextCleaner, clean_text, json_safe
from tests.conftest import PHI4, run_phi4
from tests.pty_screen import chat_in_pty, in_pty
from tests.pty_screen import plain as screen_text
from tests.scripted_server import Step, chunk, data, scripted_server, separated

CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4K\x07"  # OSC 52: set the clipboard to "rm -rf ~\n"
TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J"
C1_CSI = "\x9b"
RLO = "\u202e"  # right-to-left override
HOSTILE = CLIPBOARD + TITLE + CLEAR + C1_CSI + RLO

# Nothing of these may reach a terminal from foreign text: ESC-introduced OSC/DCS strings, the
# screen clear, BEL, C1, bidi controls, and the payloads the sequences carried.
FORBIDDEN = ["\x1b]", "\x1bP", CLEAR, "\x07", C1_CSI, "\x9d", RLO, "cm0gLXJmIH4K", "pwned"]


def assert_clean(text: str, where: str) -> None:
    found = [shown for shown in FORBIDDEN if shown in text]
    assert not found, f"{where} carries {found}: {text!r}"


def assert_no_control_characters(text: str, where: str) -> None:
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", text), (
        f"{where}: {text!r}"
    )


def assert_no_escape_at_all(text: str, where: str) -> None:
    assert_clean(text, where)
    assert_no_control_characters(text, where)


# --- the cleaner itself --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("ok " + CLIPBOARD + " after", "ok \ufffd after"),
        (TITLE + "t", "\ufffdt"),
        (CLEAR + "x", "\ufffdx"),
        ("a" + C1_CSI + "1Jb", "a\ufffdb"),  # C1 CSI and its parameters and final byte
        ("a" + RLO + "b\u2066c\u2069", "a\ufffdb\ufffdc\ufffd"),
        ("line\r\nnext\rover", "line\nnext\ufffdover"),  # CRLF is a line end; a lone CR is not
        ("x\x1b]0;unterminated\nnext line", "x\ufffd\nnext line"),  # a string ends at the line
        ("x\x1b]0;t\x1b\\y", "x\ufffdy"),  # ST ends an OSC
        ("\x1bP1$r\x1b\\z", "\ufffdz"),  # DCS
        ("\x1bc reset", "\ufffd reset"),  # two-character escape (RIS)
        ("\x1b(Bq", "\ufffdq"),  # nF escape
        ("bell\x07 bs\x08 del\x7f nel\x85", "bell\ufffd bs\ufffd del\ufffd nel\ufffd"),
        ("tab\tand newline\n, x² = π·r", "tab\tand newline\n, x² = π·r"),
        ("\x1b\x1b[31mred", "\ufffd\ufffdred"),
    ],
)
def test_clean_text_replaces_each_control_sequence_with_one_mark(raw: str, clean: str):
    assert clean_text(raw) == clean
    assert REPLACEMENT == "\ufffd"


def test_a_sequence_split_across_chunks_is_still_caught():
    text = "First 12*13 = 156." + HOSTILE + "\r\nthen" + CLIPBOARD + "\rend\r"
    whole = clean_text(text)
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1, 7):
            cleaner = TextCleaner()
            pieces = [text[:cut], text[cut:second], text[second:]]
            streamed = "".join(cleaner.feed(piece) for piece in pieces) + cleaner.flush()
            assert streamed == whole, (cut, second)
    assert_no_escape_at_all(whole, "cleaned text")


def test_cleaning_a_pathological_text_is_linear_in_its_size():
    # Unterminated sequences of every kind, 300,000 characters: done in one pass (a
    # backtracking pattern would not finish), and nothing of them survives.
    for unit in ("\x1b[", "\x1b]", "a\x1b", "\x9b1;", "\r", "\x1b]0;x\x1b"):
        cleaned = clean_text(unit * (300_000 // len(unit)))
        assert "\x1b" not in cleaned and "\r" not in cleaned


def test_json_output_escapes_what_a_terminal_would_act_on_and_keeps_the_value():
    value = {"solution": "a" + HOSTILE + "\x7f\x85b", "answer": "\u2066x\u2069"}
    text = json_safe(json.dumps(value, ensure_ascii=False))
    assert json.loads(text) == value
    assert_no_control_characters(text, "JSON")


# --- the solution as Markdown: math as written ---------------------------------------------------


def shown_on_a_terminal(solution: str, width: int = 100) -> str:
    """What a terminal shows for the solution rendered as phi4 renders it (styles dropped)."""
    console = Console(file=io.StringIO(), force_terminal=True, width=width, color_system="standard")
    console.print(Markdown(markdown_source(solution)))
    return Text.from_ansi(console.file.getvalue()).plain  # type: ignore[attr-defined]


# Real Phi-4-mini-style solutions: products written with `*`, **bold** steps, `_` subscripts,
# lists, inline LaTeX.
PRODUCTS = """To find the result, we multiply step by step.

**Step 1:** First 12*13 = 156, then 156*2 = 312.

**Step 2:** Check: 312 = 2*3*4*13, since 2*3*4 = 24 and 24*13 = 312.

So the answer is $\\boxed{312}$."""

VIETA = """Let the roots be x_1 and x_2. By Vieta's formulas:

- x_1 + x_2 = 5
- x_1*x_2 = 6

Therefore (x_1 + x_2)*(x_1 + x_2) = 25 and x_1^2 + x_2^2 = 25 - 2*6 = 13.

**Final Answer:** The product is **6**."""

LISTS = """1. For any a and b, a * b = b * a, so 3 * 8 = 24 as well.
2. In Python notation 2**3 = 8, and 4**2 = 16.
3. If x<y and y>z, then $a_1 = 2$ and the snake_case_name stays.
4. Inline code keeps its own text: `n*m` and `a_b`.

*Note:* the total is 2*(3+4) = 14."""


@pytest.mark.parametrize(
    ("solution", "kept", "gone"),
    [
        (
            PRODUCTS,
            [
                "First 12*13 = 156, then 156*2 = 312.",
                "312 = 2*3*4*13",
                "since 2*3*4 = 24 and 24*13 = 312.",
                "Step 1:",
                "So the answer is 312.",
            ],
            ["**", "1213", "1562"],
        ),
        (
            VIETA,
            [
                "Let the roots be x_1 and x_2.",
                "• x_1 + x_2 = 5",
                "• x_1*x_2 = 6",
                "(x_1 + x_2)*(x_1 + x_2) = 25",
                "25 - 2*6 = 13",
                "Final Answer:",
                "The product is 6.",
            ],
            ["**"],
        ),
        (
            LISTS,
            [
                "a * b = b * a, so 3 * 8 = 24",
                "2**3 = 8, and 4**2 = 16.",
                "If x<y and y>z, then a₁ = 2 and the snake_case_name stays.",
                "n*m and a_b",
                "Note: the total is 2*(3+4) = 14.",
            ],
            ["\\*", "\\<"],
        ),
    ],
    ids=["products", "subscripts-and-bullets", "spaced-products-powers-html-code"],
)
def test_the_terminal_keeps_every_operand_and_operator_of_the_math(
    solution: str, kept: list[str], gone: list[str]
):
    # Before: Markdown read `*` in 12*13 as emphasis: "First 1213 = 156, then 1562 = 312.",
    # and x<y and y>z as an HTML tag: "If xz".
    shown = " ".join(shown_on_a_terminal(solution).split())
    for piece in kept:
        assert piece in shown, f"{piece!r} not in {shown!r}"
    for piece in gone:
        assert piece not in shown, f"{piece!r} in {shown!r}"


def test_bold_and_emphasis_still_render_as_styles():
    console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system="standard")
    console.print(Markdown(markdown_source("**Step 1:** compute *carefully*: 6*7 = 42.")))
    output = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b[1mStep 1:" in output  # bold
    assert "\x1b[3mcarefully" in output  # italic
    assert "6*7 = 42." in Text.from_ansi(output).plain


def _presenter(show_reasoning: bool) -> tuple[TerminalPresenter, io.StringIO, io.StringIO]:
    """A terminal presenter writing to two in-memory terminals: (presenter, stdout, stderr)."""
    presenter = TerminalPresenter(show_reasoning=show_reasoning, verbose=False)
    out, err = io.StringIO(), io.StringIO()
    presenter.out = Console(file=out, force_terminal=True, width=100, highlight=False)
    presenter.err = Console(file=err, force_terminal=True, width=100, highlight=False)
    return presenter, out, err


def test_a_link_shows_where_it_goes_and_writes_no_hyperlink_sequence():
    presenter, out, _err = _presenter(show_reasoning=False)
    outcome = Outcome(index=0, question="q")
    event = Event(EventKind.TOKEN, text="See [the proof](https://evil.example/x): $\\boxed{2}$")
    outcome.apply(event)
    presenter.finish(outcome)
    assert "\x1b]8;" not in out.getvalue()  # OSC 8: link text hiding its address
    assert "the proof (https://evil.example/x)" in Text.from_ansi(out.getvalue()).plain


# --- the terminal presenter, in-process -------------------------------------------------------


def test_the_terminal_presenter_cleans_thinking_solution_and_answer():
    presenter, out, err = _presenter(show_reasoning=True)
    outcome = Outcome(index=0, question="q")
    events = [
        Event(EventKind.REASONING, text="Let me think." + CLIPBOARD[:6]),
        Event(EventKind.REASONING, text=CLIPBOARD[6:] + TITLE + " ok"),
        Event(EventKind.TOKEN, text="First 12*13 = 156." + HOSTILE),
        Event(EventKind.TOKEN, text=" So $\\boxed{156" + TITLE + "}$."),
    ]
    for event in events:
        outcome.apply(event)
        presenter.on_event(event)
    presenter.finish(outcome)
    assert_clean(out.getvalue(), "stdout")
    assert_clean(err.getvalue(), "stderr")
    screen = Text.from_ansi(out.getvalue()).plain
    assert "First 12*13 = 156." in screen and "Answer:" in screen
    assert "Let me think." in Text.from_ansi(err.getvalue()).plain
    assert re.search(r"Thought for \d+\.\d s", err.getvalue()), "a trace of the thinking stays"


def test_thinking_that_never_reached_an_answer_leaves_its_trace_once():
    presenter, out, err = _presenter(show_reasoning=False)
    outcome = Outcome(index=0, question="q")
    for event in [Event(EventKind.REASONING, text="Hm" + TITLE), Event(EventKind.REASONING)]:
        outcome.apply(event)
        presenter.on_event(event)
    presenter.finish(outcome)
    assert len(re.findall(r"Thought for \d+\.\d s", err.getvalue())) == 1
    assert "no final answer" in out.getvalue()
    assert_clean(out.getvalue() + err.getvalue(), "the terminal")


# --- end to end through a hostile OpenAI-compatible backend -------------------------------------

THINKING = ["Let me see: 12*13", CLIPBOARD[:9], CLIPBOARD[9:] + " is 156.", TITLE]
ANSWER = [
    "First 12*13 = 156.",
    CLIPBOARD[:12],
    CLIPBOARD[12:] + " then ",
    CLEAR + C1_CSI,
    RLO + "so $\\boxed{156",
    TITLE + "}$.",
]


@pytest.fixture
def hostile() -> Iterator[str]:
    with scripted_server(lambda _body: separated("reasoning_content", THINKING, ANSWER)) as server:
        yield server.url


def _solve(url: str, *extra: str, env: dict[str, str] | None = None) -> Any:
    return run_phi4(
        "solve", "What is 12*13?", "--backend", url, "-m", "phi4-mini-reasoning", *extra, env=env
    )


@pytest.mark.daemon
def test_a_hostile_backend_reaches_no_pipe_raw(hostile: str):
    # Before: OSC 52, title changes and a screen clear went to stdout and stderr as sent.
    plain = _solve(hostile, "-r")
    assert plain.returncode == 0, plain.stderr
    assert_no_escape_at_all(plain.stdout, "solve -r stdout")
    assert_no_escape_at_all(plain.stderr, "solve -r stderr")
    assert plain.stdout.startswith("First 12*13 = 156.\ufffd then \ufffd\ufffd")
    assert "Let me see: 12*13\ufffd is 156." in plain.stderr
    assert "Thought for" not in plain.stdout + plain.stderr, "a pipe gets the solution only"

    only = _solve(hostile, "-a")
    assert only.returncode == 0, only.stderr
    assert only.stdout == "156\ufffd\n"

    record = json.loads(_solve(hostile, "--json").stdout)  # exact, and escaped as JSON does
    assert record["solution"] == "".join(ANSWER)
    assert record["reasoning"] == "".join(THINKING)
    raw_json = _solve(hostile, "--json").stdout
    assert_no_control_characters(raw_json.replace("\n", ""), "--json")


@pytest.mark.daemon
def test_samples_and_a_file_of_problems_reach_a_pipe_clean(hostile: str, tmp_path: Path):
    voted = _solve(hostile, "-k", "2")
    assert voted.returncode == 0, voted.stderr
    assert_no_escape_at_all(voted.stdout + voted.stderr, "--samples")
    assert "Answer: 156\ufffd (2/2 samples agree)" in voted.stdout
    problems = tmp_path / "problems.txt"
    problems.write_text("What is 12*13?\nAnd 13*12?\n")
    for extra in ([], ["-a"]):
        result = run_phi4("solve", "-f", str(problems), "--backend", hostile, "-m", "phi4", *extra)
        assert result.returncode == 0, result.stderr
        assert_no_escape_at_all(result.stdout + result.stderr, f"--file {extra}")
        assert "156\ufffd" in result.stdout


@pytest.mark.daemon
def test_eval_records_on_stdout_are_exact_json_with_nothing_raw(tmp_path: Path):
    quiz = tmp_path / "quiz.jsonl"
    quiz.write_text(json.dumps({"problem": "What is 12*13?", "answer": "156"}) + "\n")
    answer = ["So $\\boxed{156" + C1_CSI + RLO + "}$."]
    with scripted_server(lambda _body: separated("reasoning", ["Hm."], answer)) as server:
        result = run_phi4("eval", str(quiz), "--jsonl", "--backend", server.url, "-m", "phi4")
    assert result.returncode == 0, result.stderr
    # Before: JSON written with ensure_ascii=False carried C1 and bidi controls raw.
    assert_no_control_characters(result.stdout.replace("\n", ""), "eval --jsonl")
    assert_no_escape_at_all(result.stderr, "eval's stderr")
    assert json.loads(result.stdout.splitlines()[0])["answer"] == "156" + C1_CSI + RLO


@pytest.mark.daemon
def test_raw_output_writes_the_model_text_unchanged_to_a_pipe_only(hostile: str):
    raw = _solve(hostile, "--raw-output", "-r")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout == "".join(ANSWER) + "\n"
    assert_no_escape_at_all(raw.stderr, "stderr, raw or not")


@pytest.mark.daemon
def test_piped_chat_and_a_saved_system_prompt_reach_the_terminal_clean(hostile: str):
    store = ChatStore(get_paths().data_dir / "chats")
    store.save(Conversation(name="evil", model="phi4-mini-reasoning", system="be" + CLIPBOARD))
    result = run_phi4(
        "chat", "--backend", hostile, "--resume", "evil", input="/show\n/system\nWhat is 12*13?\n"
    )
    assert result.returncode == 0, result.stderr
    assert_no_escape_at_all(result.stdout, "chat stdout")
    assert_no_escape_at_all(result.stderr, "chat stderr")
    # Before: /show and /system printed the saved OSC 52 raw.
    assert "be\ufffd" in result.stdout.split("system")[1]
    assert "system prompt: be\ufffd" in result.stdout
    assert "First 12*13 = 156.\ufffd then" in result.stdout


@contextmanager
def refusing_server(status: int, message: str) -> Iterator[str]:
    """A server that answers every request with ``status`` and an OpenAI-style error body."""
    payload = json.dumps({"error": {"message": message, "code": status}}).encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.daemon
def test_a_backends_long_error_message_reaches_stderr_clean():
    # Before: a 20 KB error body with OSC 52 in it set the clipboard from stderr.
    message = ("model overloaded " + HOSTILE) * 600  # about 20 KB
    with refusing_server(500, message) as url:
        result = _solve(url)
    assert result.returncode == 5, result.stderr
    assert "the backend answered 500: model overloaded \ufffd" in result.stderr
    assert_no_escape_at_all(result.stderr, "stderr")

    in_stream = [
        chunk({"content": "The answer"}),
        data({"error": {"message": message}}),
        Step(drop=True),
    ]
    with scripted_server(lambda _body: in_stream) as server:
        result = _solve(server.url)
    assert result.returncode == 5, result.stderr
    assert "mid-answer: model overloaded \ufffd" in result.stderr
    assert_no_escape_at_all(result.stdout, "stdout")
    assert_no_escape_at_all(result.stderr, "stderr")


@pytest.mark.daemon
def test_the_daemon_log_is_shown_clean():
    log = get_paths().log_file
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("request from a client" + HOSTILE + "\nnext line\n")
    result = run_phi4("logs")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "request from a client\ufffd\ufffd\ufffd\ufffd\ufffd\nnext line\n"


@pytest.mark.daemon
def test_settings_show_a_system_prompt_clean():
    result = run_phi4("config", "show", env={"PHI4_SYSTEM": "be brief" + CLIPBOARD})
    assert result.returncode == 0, result.stderr
    assert "be brief\ufffd" in result.stdout
    assert_no_escape_at_all(result.stdout, "config show")


def test_tables_are_cleaned():
    summary = {
        "problems": 2,
        "correct": 1,
        "wrong": 1,
        "no_answer": 0,
        "truncated": 0,
        "error": 0,
        "mean_reasoning_tokens": 3.0,
    }
    table = format_eval(summary, 1.0, "quiz" + TITLE + ".results.jsonl")
    assert "quiz\ufffd.results.jsonl" in table
    warm = format_warm({"model": "m" + CLIPBOARD, "load_s": 0.1})
    assert_no_escape_at_all(table + warm, "tables")


# --- in a real pseudo-terminal --------------------------------------------------------------


@pytest.mark.daemon
def test_at_a_terminal_only_phi4s_own_styling_reaches_the_screen(hostile: str):
    args = ["solve", "What is 12*13?", "--backend", hostile, "-m", "phi4-mini-reasoning"]
    screen = in_pty(PHI4, args)
    assert_clean(screen, "the terminal")
    assert "\x1b[" in screen  # phi4's own styling is there, and only it (checked above)
    plain = screen_text(screen)
    assert "First 12*13 = 156." in plain and "Answer:" in plain
    assert re.search(r"Thought for \d+\.\d s", plain), "a trace of how long it thought"

    shown = in_pty(PHI4, [*args, "-r"])
    assert_clean(shown, "the terminal, thinking shown")
    assert "Let me see: 12*13" in screen_text(shown)

    answer = in_pty(PHI4, [*args, "-a"])
    assert_clean(answer, "the terminal, --answer-only")
    assert "156" in answer

    # stdout piped, stderr (the thinking) still the terminal
    piped = in_pty("bash", ["-c", " ".join([PHI4, *map(_quote, args), "-r", "| cat"])])
    assert_clean(piped, "solve -r | cat")
    assert "Let me see: 12*13" in piped and "First 12*13 = 156." in piped


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


@pytest.mark.daemon
def test_no_color_keeps_the_answer_line_and_the_thinking_trace(hostile: str):
    # Before: NO_COLOR=1 at a terminal also dropped the Answer line and the thinking line;
    # no-color.org asks only that colour go.
    args = ["solve", "What is 12*13?", "--backend", hostile, "-m", "phi4-mini-reasoning"]
    screen = in_pty(PHI4, args, env={"NO_COLOR": "1"})
    plain = screen_text(screen)
    assert "Answer:" in plain and "156" in plain.split("Answer:")[1]
    assert re.search(r"Thought for \d+\.\d s", plain)
    colours = re.findall(r"\x1b\[[0-9;]*(?:3[0-9]|4[0-9]|9[0-7])m", screen)
    assert not colours, f"colour with NO_COLOR: {colours}"
    assert_clean(screen, "the terminal with NO_COLOR")


@pytest.mark.daemon
def test_chat_at_a_terminal_shows_answers_and_a_saved_system_prompt_clean(hostile: str):
    store = ChatStore(get_paths().data_dir / "chats")
    store.save(Conversation(name="evil", model="phi4-mini-reasoning", system="be" + CLIPBOARD))
    screen = chat_in_pty(
        PHI4,
        ["chat", "--backend", hostile, "--resume", "evil"],
        [("/show", "oldest turn(s)"), ("What is 12*13?", "Answer:")],
    )
    assert_clean(screen, "the chat's terminal")
    assert "be\ufffd" in screen_text(screen)
    assert re.search(r"Thought for \d+\.\d s", screen_text(screen))


def _fourteen_lines_then_wait(_body: dict[str, Any]) -> list[str | Step]:
    lines: list[str | Step] = []
    for i in range(1, 15):  # (a pause before each: the live view is redrawn for each line)
        lines += [Step(sleep=0.15), chunk({"content": f"Line {i} of the answer.\n\n"})]
    return [*lines, Step(sleep=60.0), chunk({}, "stop"), data("[DONE]")]


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_ctrl_c_while_solve_streams_leaves_what_streamed_and_says_it_stopped():
    # Before: the live region was taken down, erasing the 14 lines; only the exit 130 was left.
    with scripted_server(_fourteen_lines_then_wait) as server:
        child = pexpect.spawn(
            PHI4,
            ["solve", "Count", "--backend", server.url, "-m", "m"],
            encoding="utf-8",
            dimensions=(40, 100),
            timeout=60,
        )
        child.logfile_read = transcript = io.StringIO()
        child.expect_exact("Line 14 of the answer.")
        time.sleep(0.3)
        child.sendintr()
        child.expect_exact("stopped (Ctrl-C): the answer above is unfinished")
        child.expect(pexpect.EOF)
        child.close()
    screen = transcript.getvalue()
    assert child.exitstatus == 130, screen
    # Written again after the live region was erased (its last erase-line sequence).
    kept = screen[screen.rindex("\x1b[2K") :]
    assert "Line 1 of the answer." in kept and "Line 14 of the answer." in kept, kept
