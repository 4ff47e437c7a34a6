"""Use the mypyc-compiled modules only while they match their sources.

``setup.py`` owns the list of modules it compiles (``COMPILED``) and records each
source's SHA-256 in :data:`RECORD` once the whole build is there. :func:`guard` runs when
``serving`` or ``controller`` is first imported: it finds the compiled modules by their
extension files beside their sources, and makes Python import the ``.py`` sources of all
of them when any recorded source has changed, the record is missing or does not match
what is built, or ``SLOTUNE_PURE_PYTHON=1``. The compiled modules share one native
library, so it is all or none. :func:`status` says which is in use.

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
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

RECORD = "serving/_native.json"  # {"sources": {path: sha256}} of the compiled build
PURE_ENV = "SLOTUNE_PURE_PYTHON"  # "1": use the sources (at build time: compile nothing)
PACKAGES = ("serving", "controller")  # where compiled modules may sit
ROOT = Path(__file__).resolve().parent.parent

_status: dict[str, object] | None = None


def module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".")


def source_hashes(paths: Iterable[str], root: Path = ROOT) -> dict[str, str]:
    """SHA-256 of each source, by its path relative to ``root``."""
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in paths}


def built(root: Path = ROOT) -> list[str]:
    """Source paths (relative to ``root``) that have an extension module beside them."""
    out = set()
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for pkg in PACKAGES:
            for ext in (root / pkg).rglob("*" + suffix):
                src = ext.with_name(ext.name[: -len(suffix)] + ".py")
                if src.exists():
                    out.add(src.relative_to(root).as_posix())
    return sorted(out)


def decide(root: Path = ROOT, environ: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """(use the compiled modules?, why) for the package at ``root``."""
    have = built(root)
    if not have:
        return False, "not compiled (pure-Python build)"
    if environ.get(PURE_ENV) == "1":
        return False, f"{PURE_ENV}=1"
    try:
        recorded = json.loads((root / RECORD).read_text())["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        return False, f"no build record {RECORD}"
    missing = sorted(set(recorded) - set(have))
    if missing:
        return False, f"incomplete build (no extension for {', '.join(missing)})"
    unrecorded = sorted(set(have) - set(recorded))
    if unrecorded:
        return False, f"extensions the build record does not list ({', '.join(unrecorded)})"
    stale = [p for p, h in source_hashes(recorded, root).items() if recorded[p] != h]
    if stale:
        return False, f"sources changed since the build ({', '.join(stale)}): run `make venv`"
    return True, "compiled (mypyc)"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports the named modules from their ``.py`` files, ahead of any extension."""

    def __init__(self, root: Path, paths: Iterable[str]) -> None:
        self.paths = {module_name(p): root / p for p in paths}

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        src = self.paths.get(fullname)
        if src is None:
            return None
        return importlib.util.spec_from_file_location(fullname, src)


def guard() -> dict[str, object]:
    """Decide once per process whether the compiled modules may be imported; if not, make
    the sources imported instead (with a warning when a build exists but is not used)."""
    global _status
    if _status is None:
        use, why = decide()
        if not use:  # (runs when serving is imported: before any module it swaps)
            have = built(ROOT)
            sys.meta_path.insert(0, _SourceFinder(ROOT, have))
            if have and os.environ.get(PURE_ENV) != "1":
                logger.warning(
                    "simulator: using the Python sources, not the compiled build: %s", why
                )
        _status = {"compiled": use, "why": why}
    return dict(_status)


def status() -> dict[str, object]:
    """``{"compiled": bool, "why": str}``: whether the compiled modules are in use."""
    return guard()
