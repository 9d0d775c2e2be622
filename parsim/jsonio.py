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


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write text to a temporary file beside ``path`` and rename it over ``path`` (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_json(path: str | Path, data) -> Path:
    """Write JSON atomically: readers see the old file or the new one, never half of one. Serializing happens
    before anything is written, so data that cannot be serialized leaves the old file untouched."""
    return atomic_write_text(path, json.dumps(data, indent=1, sort_keys=False, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
