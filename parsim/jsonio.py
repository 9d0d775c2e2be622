"""JSON files: atomic writes (nothing already written is lost) and reads that fail with one clean line."""

from __future__ import annotations

import json
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path

import numpy as np

from .errors import ParsimError

# an input file larger than this is refused before it is read (the largest real input, a search's CSV read back by
# a user or a validate folder's rows, is a few hundred MB at most)
MAX_INPUT_BYTES = 1 << 30
# JSON nested deeper than this is refused (parsim's own files nest 6 levels; Python's parser recurses per level)
MAX_JSON_DEPTH = 64


def exists(path: str | Path) -> bool:
    """Whether ``path`` names something, False for a name the file system refuses (too long, a NUL byte)."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def input_file(path: str | Path, what: str, max_bytes: int = MAX_INPUT_BYTES) -> Path:
    """``path`` as an input file, checked before it is opened: it exists, is a regular file (a FIFO or a device
    would block or never end), is readable and at most ``max_bytes``; else ParsimError("<what> <path>: ...")."""
    p = Path(path)
    try:
        st = p.stat()
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ParsimError(f"{what} {short_path(p)}: {reason}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, a device or a socket)"
        raise ParsimError(f"{what} {short_path(p)}: {kind}")
    if st.st_size > max_bytes:
        raise ParsimError(f"{what} {short_path(p)}: {st.st_size:,} bytes, more than the {max_bytes:,} an input may "
                          "have")
    if not os.access(p, os.R_OK):
        raise ParsimError(f"{what} {short_path(p)}: not readable")
    return p


def read_text(path: str | Path, what: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The text of an input file (``input_file``'s checks; UTF-8)."""
    p = input_file(path, what, max_bytes)
    try:
        return p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ParsimError(f"{what} {short_path(p)}: {e}") from None


def loads(text: str, what: str):
    """Parse JSON text; too deep a nesting, an integer of more digits than Python converts, or a syntax error
    raises ParsimError("<what>: <reason>")."""
    depth = _max_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ParsimError(f"{what}: JSON nested {depth} levels deep, more than {MAX_JSON_DEPTH}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ParsimError(f"{what}: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer past sys.get_int_max_str_digits()
        raise ParsimError(f"{what}: {str(e).splitlines()[0]}") from None


def read_json(path: str | Path, what: str):
    """Parse a JSON input file (``read_text``, ``loads``); any problem raises ParsimError("<what> <path>: ...")."""
    p = Path(path)
    return loads(read_text(p, what), f"{what} {short_path(p)}")


def _max_depth(text: str) -> int:
    """The deepest nesting of brackets outside strings (a bound on the JSON's depth: enough to refuse a bomb)."""
    import re

    plain = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text) if '"' in text else text
    code = np.frombuffer(plain.encode("utf-8", "replace"), dtype=np.uint8)
    step = np.isin(code, (ord("["), ord("{"))).astype(np.int64) - np.isin(code, (ord("]"), ord("}")))
    return int(np.cumsum(step).max(initial=0))


def short_path(p: Path) -> str:
    """A path as an error line shows it: a name too long to print is cut."""
    s = str(p)
    return s if len(s) <= 120 else s[:60] + "..." + s[-40:]


def check_output_path(path: str | Path, make_parents: bool = False) -> Path:
    """The regular file that writing ``path`` will create or replace (symbolic links followed). Refused with
    ParsimError: an empty path, a target that exists and is not a regular file (a device such as /dev/null, a
    folder, a FIFO: renaming over it would destroy it), a missing parent folder (unless ``make_parents``), a
    folder that cannot be written. Call it before long work, so that bad output paths fail at once."""
    if not str(path):
        raise ParsimError("empty output path")
    if str(path).endswith(os.sep):
        raise ParsimError(f"{short_path(Path(str(path)))} names a folder, not a file")
    try:
        p = Path(os.path.realpath(path))
        p.exists()
    except (OSError, ValueError) as e:
        raise ParsimError(f"cannot write {short_path(Path(str(path)))}: {getattr(e, 'strerror', None) or e}") from None
    if p.exists() and not p.is_file():
        raise ParsimError(f"{path} exists and is not a regular file: refusing to replace it")
    if not p.parent.is_dir():
        if p.parent.exists() or not make_parents:
            raise ParsimError(f"cannot write {path}: folder {p.parent} does not exist")
        p.parent.mkdir(parents=True)
    if not os.access(p.parent, os.W_OK):
        raise ParsimError(f"cannot write {path}: folder {p.parent} is not writable")
    try:  # (the folder may still refuse a new file: a pseudo file system, a full disk, a read-only mount)
        fd, probe = _registered_temp(p.parent, p.name[:40])
        os.close(fd)
        _remove(probe)
    except OSError as e:
        raise ParsimError(f"cannot write {path}: {e.strerror or e}") from None
    return p


def check_outputs(outputs: dict, inputs=()) -> dict:
    """Every output path of one command, checked together before any work (``outputs``: flag -> path or None;
    ``inputs``: paths the command reads): each is a file name (not a folder: no trailing slash, no name longer
    than the file system takes) that ``check_output_path`` accepts, no two outputs are the same file, and none is
    an input. Returns flag -> the resolved target; one ParsimError line for the first problem."""
    seen: dict = {}
    ins = {os.path.realpath(p): p for p in inputs if p is not None and exists(p)}
    for flag, path in outputs.items():
        if path is None:
            continue
        text = str(path)
        if text.endswith(os.sep) or (exists(text) and Path(text).is_dir()):
            raise ParsimError(f"{flag} {text[:120]}: names a folder, not a file")
        name = os.path.basename(text)
        if len(name.encode()) > _name_max(os.path.dirname(text) or "."):
            raise ParsimError(f"{flag} {short_path(Path(text))}: file name of {len(name.encode())} bytes, longer "
                              "than the file system allows")
        target = check_output_path(text)
        if str(target) in seen:
            raise ParsimError(f"{seen[str(target)]} and {flag} both write {path}: give each its own file")
        if str(target) in ins:
            raise ParsimError(f"{flag} {path} would overwrite the input {ins[str(target)]}")
        seen[str(target)] = flag
    return {flag: Path(os.path.realpath(p)) for flag, p in outputs.items() if p is not None}


def _name_max(folder: str) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return 255


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
        fd, self.tmp = _registered_temp(self.target.parent, self.target.name)
        self.f = os.fdopen(fd, "w")

    def commit(self) -> Path:
        """Rename the written file over the target; if that is refused (a read-only or immutable target), the
        temporary file is removed and one ParsimError line says why."""
        self.f.close()
        try:
            os.chmod(self.tmp, _new_file_mode(self.target))
            os.replace(self.tmp, self.target)
        except OSError as e:
            self.discard()
            raise ParsimError(f"cannot write {self.target}: {e.strerror or e}") from None
        _UNFINISHED.discard(self.tmp)
        return self.target

    def discard(self) -> None:
        self.f.close()
        _remove(self.tmp)

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.discard()
        elif not self.f.closed:
            self.commit()


# temporary files of AtomicFiles neither committed nor discarded: what an interrupt leaves behind
_UNFINISHED: set[str] = set()


class _signals_held:
    """Ctrl-C and SIGTERM held (delivered on leaving the block) while a temporary file is created and registered,
    so no handler runs between the two; a no-op off the main thread or where signals cannot be masked."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.held = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
        if self.held:
            signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)

    def __exit__(self, *exc):
        if self.held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)


def _registered_temp(folder: Path, name: str) -> tuple[int, str]:
    """A new temporary file ``.NAME.XXXX`` in ``folder`` (fd, path), registered in _UNFINISHED before a Ctrl-C or
    SIGTERM handler can run (``discard_unfinished`` removes it if the command ends before its owner does)."""
    with _signals_held():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
        _UNFINISHED.add(tmp)
    return fd, tmp


def _remove(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    _UNFINISHED.discard(tmp)


def discard_unfinished() -> None:
    """Remove every temporary file an interrupted command left: the interrupt can land between a file's creation
    and the ``try`` that would discard it (the CLI calls this when a command ends on Ctrl-C or SIGTERM)."""
    for tmp in list(_UNFINISHED):
        _remove(tmp)


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
