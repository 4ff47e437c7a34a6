"""File and folder flags, checked before any work: every error names the flag and the path.

One rule for every command. An output *file* (``roofline --csv``, ``calibrate --out``)
must go into a folder that exists: a missing folder is more likely a typo than a wish,
so it is an error naming the folder, never created silently. An output *folder*
(``tune --out``, ``export --out``) is created with its parents, as ``mkdir -p`` does:
the command fills it, so naming it is asking for it. Inputs must be readable files; an
Optuna journal must also parse (:func:`study_storage`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from controller.errors import BadInput


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def file_error(flag: str, path: str | Path, e: OSError, doing: str = "write") -> BadInput:
    """The one-line error for an ``OSError`` met reading or writing a flag's file."""
    name = e.filename if e.filename is not None else path
    return BadInput(f"{flag} {path}: cannot {doing} {name} ({_why(e)})")


def input_file(flag: str, path: str | Path) -> Path:
    """A file the command reads: it must exist, be a file, and be readable."""
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"{flag} {p}: is a folder; give a file")
    if not p.exists():
        raise BadInput(f"{flag} {p}: no such file")
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        raise file_error(flag, p, e, "read") from None
    return p


def output_file(flag: str, path: str | Path) -> Path:
    """A file the command writes: its folder must exist and the file be writable there.
    Probed without changing anything (a file made by the probe is removed)."""
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"{flag} {p}: is a folder; give a file name")
    parent = p.parent
    if not parent.exists():
        raise BadInput(f"{flag} {p}: folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise BadInput(f"{flag} {p}: {parent} is not a folder")
    existed = p.exists()
    try:
        with p.open("ab" if existed else "xb"):
            pass
    except OSError as e:
        raise file_error(flag, p, e) from None
    if not existed:
        p.unlink(missing_ok=True)
    return p


def output_dir(flag: str, path: str | Path) -> Path:
    """A folder the command fills: created with its parents; it must be writable."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise BadInput(f"{flag} {p}: exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except FileExistsError as e:  # a parent is a file
        raise BadInput(f"{flag} {p}: {e.filename or p} exists and is not a folder") from None
    except OSError as e:
        raise file_error(flag, p, e) from None
    return p


def study_storage(flag: str, storage: str, *, must_exist: bool) -> str:
    """An Optuna storage: a URL, or a journal file that is readable, writable (unless it
    only has to be read) and parses. Opened here once so that a bad one fails before any
    work, with its name, and not mid-run with a parser's message."""
    from search.tuner import open_storage

    is_url = "://" in storage
    if not is_url:
        p = Path(storage)
        if p.is_dir():
            hint = p / "study.journal"
            more = f"; did you mean {hint}?" if hint.is_file() else ""
            raise BadInput(f"{flag} {p}: is a folder; give the journal file{more}")
        if must_exist:
            input_file(flag, p)
        else:
            output_file(flag, p)
    try:
        import optuna

        optuna.get_all_study_names(open_storage(storage))
    except OSError as e:
        raise file_error(flag, storage, e, "open") from None
    except Exception as e:  # any failure to parse or to connect is the storage's
        what = "an Optuna storage URL that opens" if is_url else "an Optuna journal file"
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise BadInput(f"{flag} {storage}: not {what} ({detail})") from None
    return storage


def checkpoint_dir(flag: str, path: str | Path) -> str:
    """A local Hugging Face checkpoint folder (config.json and *.safetensors), as an
    absolute path: the replica that loads it is a Ray worker process, whose working
    directory need not be this command's."""
    p = Path(path)
    what = "a local Hugging Face checkpoint folder (config.json and *.safetensors)"
    if not p.is_dir():
        raise BadInput(
            f"{flag} {p}: {'no such folder' if not p.exists() else 'not a folder'}; give {what}"
        )
    if not (p / "config.json").is_file():
        raise BadInput(f"{flag} {p}: no config.json in it; give {what}")
    if not any(p.glob("*.safetensors")):
        raise BadInput(f"{flag} {p}: no *.safetensors in it; give {what}")
    return str(p.resolve())
