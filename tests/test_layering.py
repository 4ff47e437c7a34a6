"""The house's layout is a contract, checked on every run.

Each module belongs to one part (a sub-package such as ``serving.scheduler``, or the
modules at a package's top). Parts are ranked; a module may use its own part and parts
ranked below it, never a part ranked at or above it (parts of one rank are independent).
An import counts wherever it is written (inside a function too), and so does a module
named in a string (an ``import_path``, a file path). Beyond the order: every imported
name is defined by the module it is imported from (no re-exports), no module defines a
module-level ``__getattr__``, and no two modules import each other, directly or round a
longer loop.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("metrics", "serving", "search", "controller")

# part -> rank. A module's part is the longest entry that prefixes its dotted name.
RANKS = {
    "metrics": 0,
    "serving.native": 0,  # the compiled-build guard: imports nothing of slotune
    "search.roofline": 1,  # pure: the catalogs, the roofline, the operating point
    "serving.kernels": 2,
    "serving.model": 3,
    "serving.scheduler": 3,
    "serving.engine": 4,
    "serving.sim": 4,
    "serving.app": 5,
    "serving": 6,  # the package's face
    "search.calibrate": 7,  # torch: times serving's own model on this device
    "search": 7,  # the tuner: space, guide, objective, evidence, stop rule
    "controller.sim": 8,
    "controller.backends": 8,  # how knobs reach a deployment (actuators)
    "controller.load": 8,
    "controller.report": 8,
    "controller": 9,  # the loops, targets, windows
    "controller.cli": 10,
    "controller.__main__": 11,  # `python -m controller`
}
PATH_RX = re.compile(r"\b((?:" + "|".join(PACKAGES) + r")(?:/\w+)+)\.py\b")
DOTTED_RX = re.compile(r"^((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)(?::\w+)?$")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def part_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANKS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} belongs to no part of RANKS")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _existing(dotted: str) -> str | None:
    """The longest prefix of ``dotted`` that is a module of the project."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def references(path: Path) -> Iterator[tuple[str, str, int]]:
    """(module referred to, how, line) for each import and module-naming string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, "import", node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, "import", node.lineno
            for a in node.names:
                if f"{node.module}.{a.name}" in MODULES:
                    yield f"{node.module}.{a.name}", "import", node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docs:
                continue
            m = DOTTED_RX.match(node.value)
            if m:
                yield m.group(1), "string", node.lineno
            for p in PATH_RX.findall(node.value):
                yield p.replace("/", "."), "string", node.lineno


def edges() -> Iterator[tuple[str, str, str]]:
    """(importer, imported project module, where) over the whole house."""
    for name, path in MODULES.items():
        for ref, how, line in references(path):
            if ref.split(".")[0] not in PACKAGES:
                continue
            target = _existing(ref)
            where = f"{path.relative_to(ROOT)}:{line} ({how} {ref})"
            if target is None:
                yield name, ref, where  # reported by the test below
            elif target != name:
                yield name, target, where


def test_every_module_has_a_part_and_every_part_a_module() -> None:
    parts = {part_of(m) for m in MODULES}
    assert parts == set(RANKS), f"parts with no module: {set(RANKS) - parts}"


def test_every_named_module_exists() -> None:
    missing = [where for _, ref, where in edges() if ref not in MODULES and not _existing(ref)]
    assert not missing, "names no module of the project: " + "; ".join(missing)


@pytest.mark.parametrize("package", PACKAGES)
def test_parts_import_only_parts_ranked_below(package: str) -> None:
    bad = []
    for src, dst, where in edges():
        if src.split(".")[0] != package or dst not in MODULES:
            continue
        a, b = part_of(src), part_of(dst)
        if a != b and RANKS[b] >= RANKS[a]:
            bad.append(f"{where}: {a} (rank {RANKS[a]}) uses {b} (rank {RANKS[b]})")
    assert not bad, "layering violated: " + "; ".join(bad)


def test_no_import_circle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst, _ in edges():
        if dst in MODULES and not MODULES[src].name == "__init__.py":
            graph[src].add(dst)
    # Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names.update(x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name))
        elif isinstance(n, (ast.If, ast.Try, ast.With)):
            todo.extend(n.body)
            todo.extend(getattr(n, "orelse", []))
            todo.extend(getattr(n, "finalbody", []))
            for h in getattr(n, "handlers", []):
                todo.extend(h.body)
    return names


def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    """No re-exports: a name comes from where it is defined, so it has one import path."""
    defined = {m: _defined(ast.parse(p.read_text())) for m, p in MODULES.items()}
    users = [*MODULES.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
    bad = []
    for path in users:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module not in MODULES:
                continue
            for a in node.names:
                if a.name in defined[node.module] or f"{node.module}.{a.name}" in MODULES:
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}")
    assert not bad, "imported from a module that does not define it: " + "; ".join(bad)


def test_no_module_level_getattr() -> None:
    bad = [m for m, p in MODULES.items() if "__getattr__" in _defined(ast.parse(p.read_text()))]
    assert not bad, f"module-level __getattr__ (a shim) in {bad}"


def test_the_checks_see_imports_strings_and_paths(tmp_path: Path) -> None:
    f = ROOT / "tests" / "_layering_probe.py"
    try:
        f.write_text(
            '"""Docstring naming serving/sim/simulator.py is not an import."""\n'
            "def f():\n"
            "    import controller.cli.main\n"
            '    return "serving.app.server:app", "see controller/sim/decode_run.py"\n'
        )
        refs = {(r, how) for r, how, _ in references(f)}
    finally:
        f.unlink()
    assert ("controller.cli.main", "import") in refs
    assert ("serving.app.server", "string") in refs
    assert ("controller.sim.decode_run", "string") in refs
    assert not any(r == "serving.sim.simulator" for r, _ in refs)
    assert part_of("serving.scheduler.scheduler") == "serving.scheduler"
    assert part_of("search.tuner") == "search"
