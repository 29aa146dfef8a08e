"""The committed completion scripts and man page match the app; both work."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from shlex import split as shlex_split

import pytest

from phi4cli.docs import expected_files
from tests.conftest import run_phi4


def test_completions_and_man_page_are_up_to_date():
    stale = [
        str(path)
        for path, text in expected_files().items()
        if not path.is_file() or path.read_text() != text
    ]
    assert not stale, f"regenerate with `python -m phi4cli.docs`: {stale}"


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_page_renders_without_warnings():
    page = next(p for p in expected_files() if p.name == "phi4.1")
    checked = subprocess.run(
        ["groff", "-man", "-ww", "-z", str(page)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr
    rendered = subprocess.run(
        ["groff", "-man", "-Tutf8", str(page)], capture_output=True, text=True, check=True
    ).stdout
    rendered = re.sub(".\x08", "", rendered)  # drop the overstrike that makes text bold
    for section in (
        "NAME",
        "SYNOPSIS",
        "DESCRIPTION",
        "COMMANDS",
        "OPTIONS",
        "ENVIRONMENT",
        "FILES",
        "EXIT STATUS",
        "EXAMPLES",
    ):
        assert section in rendered
    assert "phi4 solve [OPTIONS] [PROMPT]" in rendered
    assert "--think-budget" in rendered


@pytest.mark.parametrize(
    ("words", "cword", "expected"),
    [
        ("phi4 so", "1", "solve"),
        ("phi4 daemon st", "2", "start"),
        ("phi4 solve --answ", "2", "--answer-only"),
    ],
)
@pytest.mark.daemon
def test_bash_completion_answers(words: str, cword: str, expected: str):
    result = run_phi4(
        env={"_PHI4_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}
    )
    assert expected in result.stdout.split()


@pytest.mark.daemon
def test_help_offers_completion_install():
    assert "--install-completion" in run_phi4("--help").stdout


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_page_examples_can_be_typed_as_shown_and_every_variable_is_listed():
    page = next(p for p in expected_files() if p.name == "phi4.1")
    rendered = subprocess.run(
        ["groff", "-man", "-Tutf8", str(page)], capture_output=True, text=True, check=True
    ).stdout
    rendered = re.sub(".\x08", "", rendered)
    assert 'phi4 solve "Solve 3x^2+4x+5=1"' in rendered, "the quotes survive roff"
    environment = rendered[rendered.index("ENVIRONMENT") : rendered.index("\nFILES")]
    # Every PHI4_ variable the code names (a setting's, or read directly) has an entry.
    from phi4cli.docs import ROOT

    named = set()
    for source in (ROOT / "phi4cli").rglob("*.py"):
        named |= set(re.findall(r"\bPHI4_[A-Z][A-Z_]*[A-Z]\b", source.read_text()))
    named -= {"PHI4_COMPLETE"}  # Typer's completion protocol (_PHI4_COMPLETE), not a setting
    missing = sorted(name for name in named if name not in environment)
    assert not missing, missing
    for name in (
        "PHI4_KV_CACHE_TYPE",
        "PHI4_KV_LAYOUT",
        "PHI4_GPU_LAYERS",
        "PHI4_INSTRUCTION",
        "PHI4_MLOCK",
        "PHI4_BACKEND_TIMEOUT",
    ):
        assert name in environment


def test_the_man_pages_exit_status_is_the_readmes_table_for_every_code():
    from phi4cli.core.errors import ExitStatus
    from phi4cli.docs import exit_meanings

    rows = dict(exit_meanings())
    assert set(rows) == {str(int(status)) for status in ExitStatus}
    assert "the thinking ran out of tokens" in rows["1"] and "empty question" in rows["2"]
    assert "`" not in "".join(rows.values())


# --- The README and the manual in docs/: what they say is checked against the code ---------

DOC_ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((DOC_ROOT / "docs").glob("*.md"))
PAGES = [DOC_ROOT / "README.md", DOC_ROOT / "CONTRIBUTING.md", *DOCS]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _relative(page: Path) -> str:
    return str(page.relative_to(DOC_ROOT))


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_the_readme_is_a_front_door_of_at_most_400_lines():
    readme = (DOC_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    # .ci/run reads the install and test commands from these markers.
    for marker in (
        "<!-- ci:install -->\n```sh\npython3 -m venv .venv",
        "<!-- ci:test -->\n```sh\n.venv/bin/python -m pytest -n 2\n```",
    ):
        assert marker in readme


def test_every_page_of_the_manual_is_linked_from_the_readme_and_the_index():
    readme = (DOC_ROOT / "README.md").read_text()
    index = (DOC_ROOT / "docs" / "README.md").read_text()
    for page in DOCS:
        if page.name != "README.md":
            assert f"(docs/{page.name}" in readme, page.name
            assert f"({page.name}" in index, page.name


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if file.endswith("/"):
                linked = linked / "README.md"
            if not linked.exists():
                broken.append(f"{_relative(page)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{_relative(page)}: {target} (no such heading)")
    assert not broken, broken


def _command_lines(page: Path) -> list[str]:
    """The phi4 command lines a page shows: in sh and console blocks, and in inline code."""
    text = page.read_text()
    lines = []
    for lang, body in FENCE.findall(text):
        for line in body.splitlines():
            if lang == "console":
                if line.startswith("$ "):
                    lines.append(line[2:])
            elif lang in ("sh", "bash", ""):
                lines.append(line)
    lines += re.findall(r"`([^`\n]*\bphi4 [^`\n]*)`", FENCE.sub("", text))
    commands = []
    for line in lines:
        for part in re.split(r"\|\||&&|[|;]|\$\(", line.split(" # ")[0]):
            words = part.strip().split()
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words.pop(0)  # VAR=value before the command
            if words and words[0].endswith("phi4") and words[0] in ("phi4", ".venv/bin/phi4"):
                commands.append(" ".join(words[1:]))
    return commands


def test_every_phi4_command_shown_in_the_docs_names_a_real_command_and_real_options():
    import shlex

    from phi4cli.client._completion_table import TABLE

    wrong = []
    checked = 0
    for page in PAGES:
        for command in _command_lines(page):
            try:
                words = shlex.split(command)
            except ValueError:
                words = command.split()
            path = ""
            while words and f"{path} {words[0]}".strip() in TABLE:
                path = f"{path} {words.pop(0)}".strip()
            options = TABLE[path]["options"]
            checked += 1
            skip = False
            for word in words:
                if skip:
                    skip = False
                    continue
                if word == "--":
                    break
                name = word.split("=", 1)[0].strip("[]")
                if not re.fullmatch(r"--?[a-zA-Z][-a-zA-Z0-9]*", name):
                    continue  # an argument, a value, a placeholder, a negative number
                if name not in options:
                    wrong.append(
                        f"{_relative(page)}: phi4 {command}: {name} is no option of 'phi4 {path}'"
                    )
                    continue
                skip = options[name][1] and "=" not in word
    assert not wrong, wrong
    assert checked > 100  # the check found the examples


def test_every_phi4_variable_named_in_the_docs_exists():
    from phi4cli.core.config import VARIABLES
    from phi4cli.core.options import SETTINGS, env_name

    named_in_code = {env_name(s.key) for s in SETTINGS} | {n for v in VARIABLES for n in v.names}
    for folder in ("phi4cli", "tests", "bench"):
        for source in (DOC_ROOT / folder).rglob("*"):
            if source.suffix in (".py", ".sh"):
                named_in_code |= set(re.findall(r"PHI4_[A-Z][A-Z0-9_]*", source.read_text()))

    def known(name: str) -> bool:
        if name.endswith("_"):  # a prefix (PHI4_HTTP_*) names a family
            return any(other.startswith(name) for other in named_in_code)
        return name in named_in_code

    unknown = {
        f"{_relative(page)}: {name}"
        for page in PAGES
        for name in re.findall(r"PHI4_[A-Z][A-Z0-9_]*", page.read_text())
        if not known(name)
    }
    assert not unknown, sorted(unknown)


def test_every_setting_is_in_the_configuration_table_with_its_variable():
    from phi4cli.core.options import SETTINGS, env_name

    text = (DOC_ROOT / "docs" / "configuration.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \| `(PHI4_\w+)` \|", text, re.M)}
    assert rows == {s.key: env_name(s.key) for s in SETTINGS}


def test_every_toml_example_is_a_config_phi4_accepts(tmp_path: Path):
    from phi4cli.core.config import load_settings

    examples = [
        (page, body)
        for page in PAGES
        for lang, body in FENCE.findall(page.read_text())
        if lang == "toml"
    ]
    assert examples
    for number, (_page, body) in enumerate(examples):
        config = tmp_path / f"config-{number}.toml"
        config.write_text(body)
        config.chmod(0o600)
        load_settings(config, environ={})  # raises, naming the key, when the docs are wrong


def test_the_chat_page_lists_every_slash_command_and_what_set_takes():
    from phi4cli.client.chat_commands import COMMANDS
    from phi4cli.core.options import SETTABLE

    text = (DOC_ROOT / "docs" / "chat.md").read_text()
    for command in COMMANDS:
        for name in (command.name, *command.aliases):
            assert f"`{name}" in text, name
    assert f"`/set {'|'.join(SETTABLE)} VALUE`" in text


def test_the_module_map_names_every_module():
    text = (DOC_ROOT / "docs" / "architecture.md").read_text()
    package = DOC_ROOT / "phi4cli"
    missing = []
    for module in sorted(package.rglob("*.py")):
        name = str(module.relative_to(package))
        short = str(module.relative_to(module.parent.parent)) if "daemon" in name else name
        if module.name.startswith("_") or name.startswith("daemon/__"):
            continue
        if f"`{name}`" not in text and f"`{short}`" not in text and f"`{module.name}`" not in text:
            missing.append(name)
    assert not missing, f"add them to docs/architecture.md's module map: {missing}"


def test_each_benchmark_is_dated_names_its_machine_and_the_command_that_reproduces_it():
    text = (DOC_ROOT / "docs" / "benchmarks.md").read_text()
    sections = re.split(r"^## ", FENCE.sub("```", text), flags=re.M)[1:]
    assert len(sections) >= 8
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"\b2\d{3}-\d\d-\d\d\b", section), f"{title}: no date"
        assert re.search(r"\b\d+-core\b|\bH\d00\b|GPU\b", section), f"{title}: no machine"
        assert re.search(r"`(python |bash )?bench/\w+\.(py|sh)", section), f"{title}: no command"


LAB_NOTEBOOK = (
    "the next one's",
    "the one after",
    "this session",
    "the next session",
    "a later session",
    "previous session",
    "in every session",
)


def test_nothing_reads_like_a_lab_notebook():
    found = [
        f"{_relative(page)}: {phrase!r}"
        for page in PAGES
        for phrase in LAB_NOTEBOOK
        if phrase in page.read_text().lower()
    ]
    assert not found, found


@pytest.mark.smollm2
@pytest.mark.daemon
def test_the_readmes_solve_screen_is_what_phi4_prints(smollm2_model: Path):
    readme = (DOC_ROOT / "README.md").read_text()
    screen = readme[readme.index("$ phi4 solve -m smollm2-135m") :].split("```")[0]
    command, *shown = screen.splitlines()
    question = shlex_split(command)[-1]
    solved = run_phi4("solve", "-m", "smollm2-135m", "-t", "0", "--json", question)
    assert solved.returncode == 0, solved.stderr
    record = json.loads(solved.stdout)
    # The answer line, and beside it the check's verdict (docs/checking.md) where one was reached.
    said = (
        f"  \u2713 verified: {record['check']['detail']}"
        if record.get("check", {}).get("verdict") == "verified"
        else ""
    )
    assert shown[-1] == f"Answer: {record['answer']}{said}"
    assert "So, the final answer is 4." in shown and "final answer is 4" in record["solution"]
