"""The simulator's hot modules, compiled to C by mypyc when the package is built.

The simulator spends its time in the scheduler's book-keeping and its own event loop:
Python-level work per step and per request, with no single hot spot. ``setup.py`` compiles
the modules in :data:`COMPILED` from these same sources with mypyc (pyproject's build
requirements bring it), so the engine and the simulator run the same scheduler code either
way and get the same results bit for bit (tests/serving/test_native.py). Anything that
stops the build (no C compiler, a type error mypyc refuses) leaves the pure-Python
package, with a warning at build time.

A compiled module is used only while it matches its source: the build records each
source's SHA-256 (:data:`RECORD`, next to the built files) and :func:`guard`, called when
``serving`` or ``controller`` is first imported, makes Python import the ``.py`` sources
of all of them when any source has changed since, or when ``SLOTUNE_PURE_PYTHON=1``. (The
compiled modules share one native library, so it is all or none.) ``make venv`` rebuilds
after an edit; :func:`status` says which is in use.

This module is plain Python, never compiled; ``setup.py`` reads it by path.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

# Source paths relative to the project root; the module names follow from them.
COMPILED = (
    "serving/seq_state.py",
    "serving/sched_state.py",
    "serving/scheduler.py",
    "serving/sim.py",
    "controller/sim_decode_run.py",
)
RECORD = "serving/_native.json"  # {"sources": {path: sha256}} of the compiled build
PURE_ENV = "SLOTUNE_PURE_PYTHON"  # "1": use the sources (at build time: compile nothing)
ROOT = Path(__file__).resolve().parent.parent

_status: dict[str, object] | None = None


def module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".")


def source_hashes(root: Path = ROOT) -> dict[str, str]:
    """SHA-256 of each compiled module's source, by its path relative to ``root``."""
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in COMPILED}


def _built(root: Path) -> list[str]:
    """The compiled modules that have an extension file next to their source."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    out = []
    for p in COMPILED:
        src = root / p
        stem = src.name[: -len(".py")]
        if any((src.parent / (stem + s)).exists() for s in suffixes):
            out.append(p)
    return out


def decide(root: Path = ROOT, environ: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """(use the compiled modules?, why) for the package at ``root``."""
    built = _built(root)
    if not built:
        return False, "not compiled (pure-Python build)"
    if environ.get(PURE_ENV) == "1":
        return False, f"{PURE_ENV}=1"
    if len(built) != len(COMPILED):
        missing = sorted(set(COMPILED) - set(built))
        return False, f"incomplete build (no extension for {', '.join(missing)})"
    record = root / RECORD
    try:
        recorded = json.loads(record.read_text())["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        return False, f"no build record {RECORD}"
    stale = [p for p, h in source_hashes(root).items() if recorded.get(p) != h]
    if stale:
        return False, f"sources changed since the build ({', '.join(stale)}): run `make venv`"
    return True, "compiled (mypyc)"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports the named modules from their ``.py`` files, ahead of any extension."""

    def __init__(self, root: Path) -> None:
        self.paths = {module_name(p): root / p for p in COMPILED}

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        src = self.paths.get(fullname)
        if src is None:
            return None
        return importlib.util.spec_from_file_location(fullname, src)


def guard() -> dict[str, object]:
    """Decide once per process whether the compiled modules may be imported; if not, make
    the sources imported instead (with a warning when a build exists but is stale)."""
    global _status
    if _status is None:
        use, why = decide()
        if not use:  # (runs when serving is imported: before any module it swaps)
            sys.meta_path.insert(0, _SourceFinder(ROOT))
            if _built(ROOT) and os.environ.get(PURE_ENV) != "1":
                logger.warning(
                    "simulator: using the Python sources, not the compiled build: %s", why
                )
        _status = {"compiled": use, "why": why}
    return dict(_status)


def status() -> dict[str, object]:
    """``{"compiled": bool, "why": str}``: whether the compiled modules are in use."""
    return guard()
