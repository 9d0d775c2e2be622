"""JSON files: atomic writes (nothing already written is lost) and reads that fail with one clean line."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from .errors import ParsimError


def read_json(path: str | Path, what: str):
    """Parse a JSON file; a missing or corrupt file raises ParsimError("<what> <path>: <reason>")."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParsimError(f"{what} {p}: {e}") from None


def check_output_path(path: str | Path, make_parents: bool = False) -> Path:
    """The regular file that writing ``path`` will create or replace (symbolic links followed). Refused with
    ParsimError: an empty path, a target that exists and is not a regular file (a device such as /dev/null, a
    folder, a FIFO: renaming over it would destroy it), a missing parent folder (unless ``make_parents``), a
    folder that cannot be written. Call it before long work, so that bad output paths fail at once."""
    if not str(path):
        raise ParsimError("empty output path")
    p = Path(os.path.realpath(path))
    if p.exists() and not p.is_file():
        raise ParsimError(f"{path} exists and is not a regular file: refusing to replace it")
    if not p.parent.is_dir():
        if p.parent.exists() or not make_parents:
            raise ParsimError(f"cannot write {path}: folder {p.parent} does not exist")
        p.parent.mkdir(parents=True)
    if not os.access(p.parent, os.W_OK):
        raise ParsimError(f"cannot write {path}: folder {p.parent} is not writable")
    return p


def _new_file_mode(target: Path) -> int:
    """The mode the file would have had if written in place: the old file's, else 0o666 less the umask."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


class AtomicFile:
    """A text file written beside its target and renamed over it on ``commit()``: readers see the old file or the
    new one, never half of one; the mode is the old file's or the umask's; ``discard()`` (or leaving the block on
    an exception) removes the temporary file and leaves the target untouched."""

    def __init__(self, path: str | Path, make_parents: bool = False):
        self.target = check_output_path(path, make_parents)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", dir=self.target.parent)
        self.f = os.fdopen(fd, "w")

    def commit(self) -> Path:
        self.f.close()
        os.chmod(self.tmp, _new_file_mode(self.target))
        os.replace(self.tmp, self.target)
        return self.target

    def discard(self) -> None:
        self.f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.discard()
        elif not self.f.closed:
            self.commit()


def atomic_write_text(path: str | Path, text: str, make_parents: bool = False) -> Path:
    """Write text to a temporary file beside ``path`` and rename it over ``path`` (atomic; see AtomicFile)."""
    with AtomicFile(path, make_parents) as af:
        af.f.write(text)
    return af.target


def atomic_write_json(path: str | Path, data) -> Path:
    """Write JSON atomically: readers see the old file or the new one, never half of one. Serializing happens
    before anything is written, so data that cannot be serialized leaves the old file untouched."""
    text = json.dumps(data, indent=1, sort_keys=False, default=_json_default, allow_nan=False)
    return atomic_write_text(path, text + "\n")


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
