"""Builds the package; the metadata is in pyproject.toml.

With mypyc at hand (pyproject's build requirements bring it), the simulator's hot modules
(``COMPILED``) are compiled to C from the same sources, and their hashes recorded so a
stale build is never used (serving/native.py). Anything that stops that build leaves the
pure-Python package, with a warning. ``SLOTUNE_PURE_PYTHON=1`` compiles nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _native():
    spec = importlib.util.spec_from_file_location("_slotune_native", HERE / "serving/native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


native = _native()

# The simulator's hot modules: the scheduler's book-keeping and the simulator's event
# loop, Python-level work per step and per request with no single hot spot. The Makefile's
# NATIVE_SRC lists the same files, so an edit rebuilds.
COMPILED = (
    "serving/scheduler/seq.py",
    "serving/scheduler/state.py",
    "serving/scheduler/scheduler.py",
    "serving/sim/simulator.py",
    "controller/sim/decode_run.py",
)


def _pure(msg: str | None) -> list:
    """No compiled modules: say why (if not asked for), and drop the record of an earlier
    build in the source tree, so its leftover extensions are not used (serving/native.py)."""
    if msg:
        print(f"slotune build: {msg}; the simulator runs as pure Python", file=sys.stderr)
    (HERE / native.RECORD).unlink(missing_ok=True)
    return []


def _extensions() -> list:
    if os.environ.get(native.PURE_ENV) == "1":
        return _pure(None)
    try:
        from mypyc.build import mypycify
    except ImportError:
        return _pure("mypyc is not installed")
    try:
        return mypycify(
            # Other modules and libraries are read for their types only; the installed
            # libraries (torch, numpy) are left out, as Any: reading them costs minutes.
            [*COMPILED, "--ignore-missing-imports", "--follow-imports=silent"]
            + ["--no-site-packages"],
            opt_level="3",
            group_name="slotune_native",
        )
    except (Exception, SystemExit) as e:  # mypy exits on a type error
        return _pure(f"mypyc refused the sources ({e!r})")


class BuildNative(build_ext):
    """build_ext that falls back to pure Python and records what it compiled."""

    def run(self) -> None:
        if not self.extensions:
            return
        # The record goes where serving/ is built (the source tree when editable), written
        # only once the whole build is there.
        record = Path(self.get_ext_fullpath("serving.native")).parent / Path(native.RECORD).name
        record.unlink(missing_ok=True)
        try:
            super().run()
        except Exception as e:  # no compiler, a failed compile or link
            for ext in self.extensions:  # leave no part of a build behind
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            _pure(f"compiling failed ({e!r})")
            return
        record.write_text(
            json.dumps({"sources": native.source_hashes(COMPILED, HERE)}, indent=1) + "\n"
        )


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildNative})
