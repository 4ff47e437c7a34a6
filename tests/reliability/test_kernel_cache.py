"""Issue 17 item 11: the compiled-kernel cache loads only what this user built.

A library planted under the expected name (no or a wrong recorded checksum, a symlink,
another user's file) is never handed to ``ctypes``: its constructor would write a marker
file, and no test may see that marker. A cache directory others can write is refused
(torch path); the normal path still builds, records and reuses.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import serving.kernels.cpu_kernels as ck
from serving.kernels import build_cache

CC = ck._compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *p = getenv("SLOTUNE_TEST_MARKER");
    FILE *f = p ? fopen(p, "w") : NULL;
    if (f) fclose(f);
}
"""


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    m = tmp_path / "planted-code-ran"
    monkeypatch.setenv("SLOTUNE_TEST_MARKER", str(m))
    return m


@pytest.fixture
def planted_so(tmp_path: Path) -> Path:
    """A shared library whose load (its constructor) leaves the marker file."""
    assert CC is not None
    src, so = tmp_path / "planted.c", tmp_path / "planted.so"
    src.write_text(PLANTED_C)
    subprocess.run([CC, "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    return so


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real build for the module; the tests' rebuilds copy it (a compile is seconds)."""
    return ck.build(tmp_path_factory.mktemp("compiled") / "kernels")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: Path) -> Iterator[Path]:
    d = tmp_path / "kernels"

    def compile_by_copy(cc: str, target: Path) -> None:
        tmp = target.with_name("copy.tmp")
        shutil.copyfile(compiled, tmp)
        build_cache.install(tmp, target)

    monkeypatch.setattr(ck, "_compile", compile_by_copy)
    monkeypatch.setenv("SLOTUNE_KERNEL_CACHE", str(d))
    monkeypatch.delenv(ck.ENV_SWITCH, raising=False)
    # A fresh memo of load() for the test; the original (and the kernels it already loaded,
    # which other test modules hold) comes back untouched at teardown.
    monkeypatch.setattr(ck, "load", functools.lru_cache(maxsize=1)(ck.load.__wrapped__))
    yield d


def target_in(directory: Path) -> Path:
    assert CC is not None
    return directory / f"slotune_cpu_kernels-{ck._key(CC)}.so"


def sha_of(p: Path) -> str:
    import hashlib

    return hashlib.sha256(p.read_bytes()).hexdigest()


@needs_cc
def test_normal_build_is_private_recorded_and_reused(
    compiled: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert stat.S_IMODE(compiled.parent.stat().st_mode) == 0o700  # the real compile's
    assert build_cache.checksum_path(compiled).read_text().strip() == sha_of(compiled)
    path = ck.build()
    assert path == target_in(cache)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    recorded = build_cache.checksum_path(path).read_text().strip()
    assert recorded == sha_of(path)
    monkeypatch.setattr(ck, "_compile", lambda *a: pytest.fail("rebuilt a verified library"))
    assert ck.build() == path
    assert ck.load() is not None  # and it loads


@needs_cc
@pytest.mark.parametrize("checksum", ["none", "stale"])
def test_planted_library_with_the_right_name_is_not_loaded(
    checksum: str, cache: Path, planted_so: Path, marker: Path
) -> None:
    good = ck.build()
    good_sha = sha_of(good)
    rec = build_cache.checksum_path(good)
    shutil.copyfile(planted_so, good)  # the expected name, someone else's code
    if checksum == "none":
        rec.unlink()
    else:
        rec.write_text("0" * 64 + "\n")
    kernels = ck.load()
    assert not marker.exists(), "the planted library was loaded"
    assert kernels is not None  # rebuilt in place, verified, loaded
    assert sha_of(good) == good_sha == rec.read_text().strip()


@needs_cc
def test_planted_symlink_is_not_followed(cache: Path, planted_so: Path, marker: Path) -> None:
    good = ck.build()
    good.unlink()
    good.symlink_to(planted_so)
    build_cache.checksum_path(good).write_text(sha_of(planted_so) + "\n")
    assert ck.load() is not None
    assert not marker.exists()
    assert not good.is_symlink() and sha_of(good) != sha_of(planted_so)


@needs_cc
@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777])
def test_cache_dir_others_can_write_is_refused(
    mode: int,
    cache: Path,
    planted_so: Path,
    marker: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache.mkdir(mode=0o700)
    target = target_in(cache)
    shutil.copyfile(planted_so, target)
    build_cache.checksum_path(target).write_text(sha_of(planted_so) + "\n")  # a "valid" pair
    os.chmod(cache, mode)
    with caplog.at_level(logging.WARNING, logger="serving.kernels.cpu_kernels"):
        assert ck.load() is None  # the torch path
    assert not marker.exists()
    assert "writable by group or others" in caplog.text and str(cache) in caplog.text
    with pytest.raises(build_cache.UnsafeCache):
        ck.build()


@needs_cc
def test_cache_dir_of_another_user_is_refused(
    cache: Path, marker: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache.mkdir(mode=0o700)
    if os.geteuid() == 0:  # root can hand the directory to someone else for real
        os.chown(cache, 54321, -1)
    else:  # otherwise this process plays another user
        monkeypatch.setattr(build_cache, "_uid", lambda: os.geteuid() + 1)
    with caplog.at_level(logging.WARNING, logger="serving.kernels.cpu_kernels"):
        assert ck.load() is None
    assert "owned by uid" in caplog.text
    assert not list(cache.glob("*.so"))


@needs_cc
def test_library_of_another_user_is_rebuilt_not_loaded(
    cache: Path, marker: Path, planted_so: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = ck.build()
    shutil.copyfile(planted_so, good)
    build_cache.checksum_path(good).write_text(sha_of(planted_so) + "\n")
    if os.geteuid() == 0:
        os.chown(good, 54321, -1)
    else:  # the file looks foreign, the directory (checked by its own uid) stays ours
        real = build_cache._check_owned

        def foreign_files(path: Path, st: os.stat_result, what: str) -> None:
            if what == "library":
                st = os.stat_result((st.st_mode, *st[1:4], os.geteuid() + 1, *st[5:]))
            real(path, st, what)

        monkeypatch.setattr(build_cache, "_check_owned", foreign_files)
    assert build_cache.open_verified(good) is None
    assert ck.load() is not None
    assert not marker.exists()
    assert good.stat().st_uid == os.geteuid()


@needs_cc
def test_library_writable_by_others_is_rebuilt(cache: Path, planted_so: Path, marker: Path) -> None:
    good = ck.build()
    shutil.copyfile(planted_so, good)
    build_cache.checksum_path(good).write_text(sha_of(planted_so) + "\n")
    os.chmod(good, 0o666)
    assert ck.load() is not None
    assert not marker.exists()
    assert not good.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_cache_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("")
    with pytest.raises(build_cache.UnsafeCache, match="not a directory"):
        build_cache.private_dir(f)
