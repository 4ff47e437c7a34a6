"""A private, verified cache of compiled libraries (serving/kernels/cpu_kernels.py's).

A library is only loaded from a directory this user owns that no one else can write
(created 0700), and only when the file itself is ours, not writable by others and has
the SHA-256 recorded beside it (``NAME.sha256``) when it was built. A planted or damaged
library is therefore never handed to ``ctypes``: the caller rebuilds it, or keeps its
torch path when the directory itself is unsafe (:class:`UnsafeCache`).

What is verified is what is loaded: :func:`open_verified` hashes an open descriptor,
and the caller loads that descriptor (``/proc/self/fd/N``), not the name again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

CHECKSUM_SUFFIX = ".sha256"
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafeCache(RuntimeError):
    """The cache directory, or a file in it, could be changed by another user."""


def _uid() -> int:
    """This process's effective uid (a seam for tests that cannot chown)."""
    return os.geteuid()


def _check_owned(path: Path, st: os.stat_result, what: str) -> None:
    if st.st_uid != _uid():
        raise UnsafeCache(f"{what} {path} is owned by uid {st.st_uid}, not this user ({_uid()})")
    if st.st_mode & _OTHERS_WRITE:
        raise UnsafeCache(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        )


def private_dir(directory: Path) -> Path:
    """``directory``, created with mode 0700 when missing; :class:`UnsafeCache` when it is
    not a directory of this user's that only this user can write."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise UnsafeCache(f"kernel cache {directory} is not a directory") from None
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCache(f"kernel cache {directory} is not a directory")
    _check_owned(directory, st, "kernel cache")
    return directory


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` (processes building at once wait for the first)."""
    import fcntl

    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def checksum_path(target: Path) -> Path:
    return target.with_name(target.name + CHECKSUM_SUFFIX)


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    os.lseek(fd, 0, os.SEEK_SET)
    return h.hexdigest()


def _open_owned(path: Path, what: str) -> int:
    """A read-only descriptor of a regular file of ours that others cannot write."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCache(f"{what} {path} is not a regular file")
        _check_owned(path, st, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_verified(target: Path) -> int | None:
    """An open descriptor of ``target`` when it is safe to load: ours, not writable by
    others, matching its recorded checksum. None (with a warning when a file was there
    but failed a check) otherwise: the caller builds it again."""
    if not target.exists() and not target.is_symlink():
        return None
    try:
        fd = _open_owned(target, "library")
    except (OSError, UnsafeCache) as e:
        logger.warning("kernel cache: not loading %s (%s): building it again", target, e)
        return None
    try:
        rec_fd = _open_owned(checksum_path(target), "checksum")
        try:
            recorded = os.read(rec_fd, 256).decode("ascii", "replace").strip()
        finally:
            os.close(rec_fd)
        actual = _sha256_fd(fd)
        if actual != recorded:
            raise UnsafeCache(f"its SHA-256 {actual[:16]}... is not the recorded one")
    except (OSError, UnsafeCache) as e:
        os.close(fd)
        logger.warning("kernel cache: not loading %s (%s): building it again", target, e)
        return None
    return fd


def install(built: Path, target: Path) -> None:
    """Record ``built``'s checksum beside ``target``, then move it there (both renames
    are atomic; under :func:`locked` no reader sees one without the other)."""
    fd = os.open(built, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        digest = _sha256_fd(fd)
    finally:
        os.close(fd)
    rec_fd, rec_tmp = tempfile.mkstemp(suffix=CHECKSUM_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(rec_fd, "w", encoding="ascii") as f:
            f.write(digest + "\n")
        os.replace(rec_tmp, checksum_path(target))
    finally:
        if os.path.exists(rec_tmp):
            os.unlink(rec_tmp)
    os.chmod(built, 0o700)
    os.replace(built, target)
