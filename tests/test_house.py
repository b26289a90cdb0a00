"""The floors of the house (docs/design.md, "The map"): every import runs downward.

Read from the source with ``ast`` (imports inside functions and ``TYPE_CHECKING`` blocks
count too): a module may import a lower floor or its own stage folder, never a higher floor
or another folder of its own floor; no import cycle; no import of autockpt inside a function
outside the CLI; nothing imports the package root from inside it; ``solvers/`` imports
neither torch nor autockpt.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = [  # lowest first; a group is a module or a stage folder
    ["autockpt._version", "autockpt.errors"],
    ["autockpt.base", "autockpt.plan"],
    ["autockpt.capture", "autockpt.measure", "autockpt.distributed"],
    ["autockpt.costs", "autockpt.rewrite"],
    ["autockpt.planning"],
    ["autockpt.api"],
    ["autockpt.fit"],
    ["autockpt.report", "autockpt.demo", "autockpt"],
    ["autockpt.cli"],
]
SHIMS = {"autockpt.zoo", "autockpt.zoo_hf"}  # re-exports of autockpt_zoo for old specs


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(the most specific module each import statement names, whether inside a function)."""
    tree = ast.parse(path.read_text())
    in_function = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found.append((next((n for n in names if n in known), names[-1]), id(node) in in_function))
    return found


def floor_of(module: str) -> tuple[int, str]:
    groups = [
        (floor, group)
        for floor, names in enumerate(FLOORS)
        for group in names
        if module == group or module.startswith(group + ".")
    ]
    assert groups, f"{module} is on no floor: add it to FLOORS and to docs/design.md's map"
    return max(groups, key=lambda g: len(g[1]))


LIBRARY = {m: p for m, p in modules("autockpt").items() if m not in SHIMS}
EDGES = [
    (source, target, in_function)
    for source, path in LIBRARY.items()
    for target, in_function in imports(path, set(LIBRARY))
    if target.split(".")[0] in ("autockpt", "autockpt_zoo", "benchmarks") and target != source
]


@pytest.mark.parametrize(("source", "target", "in_function"), EDGES, ids=str)
def test_imports_run_downward(source: str, target: str, in_function: bool) -> None:
    assert target in LIBRARY, f"{source} imports {target}: not library code (zoo, benchmarks?)"
    if source == "autockpt.cli" or source.startswith("autockpt.cli."):
        return  # the top floor, which imports lazily so that `autockpt --help` starts fast
    assert not in_function, f"{source} imports {target} inside a function: a hidden arrow"
    assert target != "autockpt", f"{source} imports the package root from inside it"
    (floor, group), (target_floor, target_group) = floor_of(source), floor_of(target)
    assert target_floor < floor or target_group == group, (
        f"{source} (floor {floor}, {group}) imports {target} (floor {target_floor}, "
        f"{target_group}): imports run downward only"
    )


def test_no_import_cycle() -> None:
    assert list(nx.simple_cycles(nx.DiGraph((s, t) for s, t, _ in EDGES))) == []


def test_solvers_import_neither_torch_nor_autockpt() -> None:
    for module, path in modules("solvers").items():
        for target, _ in imports(path, set()):
            assert target.split(".")[0] not in ("torch", "autockpt", "autockpt_zoo"), module


@pytest.mark.parametrize("module", sorted(LIBRARY))
def test_every_module_imports_alone(module: str) -> None:
    importlib.import_module(module)


def test_the_package_loads_torch_only_when_a_name_is_used() -> None:
    """`autockpt --help` answers without torch, and the command line sets torch's
    environment before torch loads; every public name still resolves, and
    ``autockpt.measure`` stays the function once its submodule has loaded."""
    import subprocess
    import sys

    code = """
import contextlib, io, os, sys
os.environ.pop("OMP_WAIT_POLICY", None)
import autockpt, autockpt.cli
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    autockpt.cli.main(["--help"])
assert "usage" in out.getvalue(), out.getvalue()
assert "torch" not in sys.modules, "autockpt --help loaded torch"
assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # set by the CLI, before torch loads
import autockpt.api  # loads autockpt.measure (the submodule) among others
assert "torch" in sys.modules and callable(autockpt.measure)
assert autockpt.measure is sys.modules["autockpt.measure"].measure
for name in autockpt.__all__:
    assert getattr(autockpt, name) is not None, name
assert autockpt.api.Planner and set(autockpt.__all__) <= set(dir(autockpt))
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


# -- small rooms (docs/design.md, "Small rooms") ------------------------------------------

MAX_MODULE_LINES = 900
"""No library module over this many lines: a room read at once."""
MAX_FUNCTION_LINES = 80
"""A function over this many lines (``def`` to its end, docstring included) says why at its
top: a sentence beginning "Why this is long:" in its docstring."""
PLANNER_MAX_LINES = 250
"""The facade's size (docs/design.md, "The front door and its routes"): its docstring, the
names it reads through from the route, construction (checks, the request, the choice of
route) and the four questions users ask it. More means a route's logic has come back."""
ROUTES = "autockpt.planning.routes"


@pytest.mark.parametrize("module", sorted(LIBRARY))
def test_no_library_module_is_over_the_size_of_a_room(module: str) -> None:
    lines = len(LIBRARY[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module}: {lines} lines; split it by subject"


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            said = "Why this is long:" in (ast.get_docstring(node) or "")
            if length > MAX_FUNCTION_LINES and not said:
                found.append(f"{node.name} ({length} lines, line {node.lineno})")
    return found


@pytest.mark.parametrize("module", sorted(LIBRARY))
def test_a_long_function_says_why_at_its_top(module: str) -> None:
    assert _long_functions(LIBRARY[module]) == []


def test_the_planner_is_a_thin_facade() -> None:
    tree = ast.parse((ROOT / "autockpt" / "api.py").read_text())
    (planner,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Planner"]
    lines = planner.end_lineno - planner.lineno + 1
    assert lines <= PLANNER_MAX_LINES, f"Planner is {lines} lines: move a route's logic out"
    names = {n.name for n in planner.body if isinstance(n, ast.FunctionDef)}
    assert "__getattr__" not in names, "the facade forwards nothing implicitly"


def test_the_routes_import_nothing_from_each_other() -> None:
    """A route composed over another holds it as a value it is given (NOTE [routes:
    protocol]); the protocol (``routes.base``) and the choice (the package) are shared."""
    shared = {ROUTES, f"{ROUTES}.base"}
    routes = {m for m in LIBRARY if m.startswith(ROUTES + ".") and m not in shared}
    assert {f"{ROUTES}.captured", f"{ROUTES}.compiled", f"{ROUTES}.units"} <= routes
    crossing = [(s, t) for s, t, _ in EDGES if s in routes and t in routes]
    assert crossing == []


def _map_entries() -> dict[str, str]:
    """docs/design.md's map as {file or folder path: its floor column ("" when none)}: each
    line names one file or folder, indented two spaces per level."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## The map", 1)[1].split("```", 2)[1]
    entries, stack = {}, []
    for line in block.splitlines():
        stripped = line.lstrip(" ")
        name = stripped.split(" ", 1)[0]
        if not name.endswith((".py", "/")):
            continue  # a description carried over to the next line
        depth = (len(line) - len(stripped)) // 2
        stack = [*stack[:depth], name.rstrip("/")]
        rest = stripped[len(name) :].split()
        entries["/".join(stack)] = rest[0] if rest and (rest[0].isdigit() or rest[0] == "-") else ""
    return entries


def test_the_map_lists_every_file_of_the_library_on_its_floor() -> None:
    entries = _map_entries()
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "autockpt").rglob("*.py")}
    assert sorted(files - set(entries)) == [], "add each file to docs/design.md's map"
    assert sorted(f for f in entries if f.endswith(".py") and f not in files) == []
    for path, floor in entries.items():
        module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if floor.isdigit() and module in LIBRARY:
            assert int(floor) == floor_of(module)[0], f"{path}: the map says floor {floor}"
