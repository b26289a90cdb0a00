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
    if source == "autockpt.cli":
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
