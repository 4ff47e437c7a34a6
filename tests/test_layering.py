"""The layering of shared/DESIGN.md is a contract: checked on every run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("metrics", "serving", "search", "controller")
FORBIDDEN = {
    "metrics": {"serving", "search", "controller"},
    "serving": {"search", "controller"},
    "search": {"controller"},
    "controller": set(),
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_forbidden_sets_cover_every_package() -> None:
    assert set(FORBIDDEN) == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_respects_layering(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"package {package} has no modules"
    bad = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in files
        for name in sorted(imported_top_levels(f) & FORBIDDEN[package])
    ]
    assert not bad, "layering violated: " + "; ".join(bad)


def test_checker_detects_a_violation(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import controller.cli.main\nfrom search.roofline.curve import x\n")
    assert {"controller", "search"} <= imported_top_levels(f)
