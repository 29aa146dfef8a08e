"""The house has no circles: no import cycle among phi4cli's modules, counting imports inside
functions (most of phi4's are, for start-up time) and under ``TYPE_CHECKING``, and none when
each subpackage (``daemon``) is taken as one room; the benches take no private names from the
tests. Read from the source with ``ast``, so nothing is imported to check it."""

from __future__ import annotations

import ast
import functools
import itertools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "phi4cli"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@functools.cache
def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of ``path``'s syntax tree (parsed once for all the tests here)."""
    return tuple(ast.walk(ast.parse(path.read_text(encoding="utf-8"))))


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(module of the package it imports, line) for every import statement in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in nodes(path):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from phi4cli import protocol` imports the module phi4cli.core.protocol.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target, node.lineno


def graph(group: bool) -> dict[str, dict[str, str]]:
    """Importer -> imported -> where (file:line); with ``group``, a subpackage is one node."""
    known = modules()
    # The package's own subpackages (``daemon``, with ``daemon.llama`` inside it).
    rooms = {m for m, p in known.items() if p.name == "__init__.py" and m.count(".") == 1}

    def node(module: str) -> str:
        if group:
            for room in rooms:
                if module == room or module.startswith(room + "."):
                    return room
        return module

    edges: dict[str, dict[str, str]] = {}
    for module, path in known.items():
        for target, line in imports(module, path, known):
            source, sink = node(module), node(target)
            if source != sink:
                edges.setdefault(source, {}).setdefault(sink, f"{path.relative_to(ROOT)}:{line}")
    return edges


def cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    """One import cycle, as the path around it with where each import is; None if none."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, {})):
            if state.get(target) == 1:
                loop = [*path[path.index(target) :], target]
                return [f"{a} -> {b} ({edges[a][b]})" for a, b in itertools.pairwise(loop)]
            if target not in state:
                found = walk(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            found = walk(start)
            if found:
                return found
    return None


def test_no_import_cycle_among_the_modules():
    assert cycle(graph(group=False)) is None


def test_no_import_cycle_between_the_rooms():
    # Each subpackage (client, serve, backends, daemon, text, core) as one room.
    assert cycle(graph(group=True)) is None


# The layers, lowest first (docs/architecture.md's module map): a room imports its own and those
# below it; the rooms on one level (the daemon and the backends) import nothing of each other.
LAYERS = (
    ("phi4cli.core",),
    ("phi4cli.text",),
    ("phi4cli.daemon", "phi4cli.backends"),
    ("phi4cli.serve",),
    ("phi4cli.client",),
    ("phi4cli.entry", "phi4cli.docs", "phi4cli.__main__"),
)


def test_no_room_imports_one_above_it():
    known = modules()
    level = {room: depth for depth, rooms in enumerate(LAYERS) for room in rooms}

    def room_of(module: str) -> str | None:
        return next((r for r in level if module == r or module.startswith(r + ".")), None)

    # Every module is in a room, but the package itself (its __version__, read by all).
    assert [m for m in known if room_of(m) is None] == ["phi4cli"]
    upward, crossings = [], set()
    for module, path in known.items():
        source = room_of(module)
        for target, line in imports(module, path, known):
            sink = room_of(target)
            if source and sink and sink != source:
                crossings.add((source, sink))
                if level[sink] > level[source]:
                    upward.append(f"{path.relative_to(ROOT)}:{line}: {module} -> {target}")
    assert upward == []
    # The daemon and the backends, side by side, import nothing of each other (a client starts a
    # daemon with backends.spawn, and runs one with `phi4 daemon run` from the client room).
    assert not {("phi4cli.daemon", "phi4cli.backends"), ("phi4cli.backends", "phi4cli.daemon")} & (
        crossings
    )
    # It sees the imports it judges: the client stands on every room below it.
    assert {
        ("phi4cli.client", room)
        for room in ("phi4cli.core", "phi4cli.text", "phi4cli.backends", "phi4cli.serve")
    } <= crossings


def test_the_checker_finds_a_cycle():
    edges = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:2"}, "c": {"a": "c.py:3"}}
    assert cycle(edges) == ["a -> b (a.py:1)", "b -> c (b.py:2)", "c -> a (c.py:3)"]
    assert cycle({"a": {"b": "a.py:1"}, "b": {}}) is None


def test_the_benches_take_no_private_names_from_the_tests():
    taken = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in nodes(path):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests"):
                taken += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert taken == []


def test_the_protocol_stands_on_leaves_only():
    # It does not import config: its parsers take the daemon's defaults as an Ask.
    known = modules()
    protocol = "phi4cli.core.protocol"
    taken = {target for target, _line in imports(protocol, known[protocol], known)}
    leaves = ("errors", "durations", "inputs", "options", "option_values", "_settings")
    assert taken <= {f"phi4cli.core.{leaf}" for leaf in leaves}
    # The table of settings it checks requests by stands on leaves too.
    for table in ("phi4cli.core.options", "phi4cli.core.option_values", "phi4cli.core._settings"):
        under = {target for target, _line in imports(table, known[table], known)}
        assert under <= {
            "phi4cli.core.durations",
            "phi4cli.core.option_values",
            "phi4cli.core.options",
        }, table


def test_only_config_reads_phi4_variables():
    # os.environ.get("PHI4_X"), os.environ["PHI4_X"], "PHI4_X" in os.environ: config.py's alone
    # (the rest ask config.variable, whose table the docs list).
    def phi4_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and str(node.value).startswith("PHI4_")

    def environ(node: ast.AST) -> bool:
        return "environ" in ast.dump(node)

    readers = []
    for module, path in modules().items():
        if module == "phi4cli.core.config":
            continue
        for node in nodes(path):
            read = (
                (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and environ(node.func.value)
                    and node.args
                    and phi4_name(node.args[0])
                )
                or (
                    isinstance(node, ast.Subscript)
                    and environ(node.value)
                    and phi4_name(node.slice)
                )
                or (
                    isinstance(node, ast.Compare)
                    and phi4_name(node.left)
                    and any(environ(c) for c in node.comparators)
                )
            )
            if read:
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")  # type: ignore[attr-defined]
    assert readers == []


def test_only_the_protocol_reads_a_request_as_a_dict():
    # A request is a typed SolveParams (its ask generated from the settings table) everywhere
    # but on the wire: protocol.to_wire makes the dict, protocol.parse_params reads it back,
    # and serve's openai_request turns an OpenAI body into one. Anywhere else, a request key
    # read out of a dict (params.get("think_budget"), request["seed"]) is a second shape.
    from phi4cli.core._settings import Ask
    from phi4cli.core.protocol import SolveParams

    keys = set(Ask._fields) | set(SolveParams._fields) | {"message"}
    holders = {"params", "request", "base", "wire", "sent"}
    allowed = {"phi4cli.core.protocol", "phi4cli.serve.openai_request"}

    def read(node: ast.AST) -> str | None:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in holders
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            return str(node.args[0].value)
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in holders
            and isinstance(node.slice, ast.Constant)
        ):
            return str(node.slice.value)
        return None

    readers = []
    for module, path in modules().items():
        if module in allowed:
            continue
        for node in nodes(path):
            key = read(node)
            if key in keys:
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}: {key}")  # type: ignore[attr-defined]
    assert readers == []
    # The checker sees one.
    probe = ast.parse('budget = params.get("think_budget")')
    assert any(read(node) == "think_budget" for node in ast.walk(probe))
