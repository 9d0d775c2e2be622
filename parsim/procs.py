"""Child process trees that always end: `parsim run` and `parsim profile` launch torchrun, whose workers live in
sessions of their own (torch elastic starts them with ``start_new_session=True``), so killing torchrun's process
group leaves them running, holding pipes and ports. A ``ProcessTree`` therefore

* tags every process it starts: an environment variable ``PARSIM_TREE=<random id>`` is inherited by torchrun, its
  workers and whatever they start (compile workers), and on Linux ``/proc/<pid>/environ`` finds them all, even
  after they were re-parented to init;
* writes their output to a file, not a pipe, so an orphan can never block the reader;
* ends them in order: SIGTERM to torchrun (it forwards the signal to its workers and waits for them), then, after
  a grace period, SIGKILL to every tagged process, repeated until none is left, and reaps torchrun;
* asks Linux to SIGKILL torchrun when the parsim process dies (``PR_SET_PDEATHSIG``); workers do the same towards
  torchrun (``die_with_parent`` at their start), so even a parsim killed with SIGKILL takes its tree with it.

Torch-free; used by the executor and the profiler.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

TAG_VAR = "PARSIM_TREE"
_PR_SET_PDEATHSIG = 1
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week; larger values overflow the OS wait primitives


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a no-op elsewhere). If the parent is already gone (the
    call raced its death), exit now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:
        os._exit(1)
    # a process of a tree (tagged) whose parent is not of it was re-parented (to init or to a subreaper, whose pid is
    # not 1): its parent died before the call
    tag = os.environ.get(TAG_VAR)
    if tag and not _carries(os.getppid(), f"{TAG_VAR}={tag}".encode()):
        os._exit(1)


def _carries(pid: int, needle: bytes) -> bool:
    """Whether process ``pid``'s environment holds ``needle`` (``NAME=value``); True where it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return True


def tagged_pids(tag: str, var: str = TAG_VAR) -> set[int]:
    """Processes whose environment carries ``var=tag`` (Linux /proc; empty elsewhere)."""
    needle = f"{var}={tag}".encode()
    out: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    me = os.getpid()
    for e in entries:
        if not e.isdigit() or int(e) == me:
            continue
        try:
            with open(f"/proc/{e}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and not _is_zombie(int(e)):
            out.add(int(e))
    return out


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] in (b"Z", b"X")
    except OSError:
        return True


class ProcessTree:
    """One command and every process it starts; see the module docstring. Use as a context manager: leaving the
    block (normally, on timeout, on Ctrl-C or any exception) ends whatever is still running."""

    def __init__(self, cmd: list[str], env: dict | None = None, cwd: str | None = None):
        self.tag = uuid.uuid4().hex
        env = dict(os.environ if env is None else env)
        env[TAG_VAR] = self.tag
        fd, self.log_path = tempfile.mkstemp(prefix="parsim-tree-", suffix=".log")
        self._log = os.fdopen(fd, "w+b")
        main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True,
                                     preexec_fn=die_with_parent if main else None)

    def __enter__(self) -> "ProcessTree":
        return self

    def __exit__(self, *exc) -> None:
        self.end()
        self._log.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def wait(self, timeout_s: float) -> int | None:
        """The command's exit code, or None when it is still running after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def output(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def alive(self) -> set[int]:
        """Tagged processes still running (the command itself included while it runs)."""
        pids = tagged_pids(self.tag)
        if self.proc.poll() is None:
            pids.add(self.proc.pid)
        return pids

    def end(self, grace_s: float = 5.0) -> None:
        """SIGTERM the command (torchrun ends its workers on it), wait up to ``grace_s``, then SIGKILL every
        tagged process until none is left; reap the command."""
        if self.proc.poll() is None:
            _signal(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self.alive():
                time.sleep(0.05)
        for _ in range(50):
            left = self.alive()
            if not left:
                break
            for pid in left:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.05)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent; the kernel reaps it
            pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def check_timeout(timeout_s) -> None:
    from .errors import ParsimError

    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ParsimError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {timeout_s!r}")


def run_tree(cmd: list[str], env: dict, timeout_s: float, echo=None) -> tuple[int | None, str]:
    """Run ``cmd`` and everything it starts to completion or to ``timeout_s``: (exit code, or None on timeout;
    its output up to then — not its reaction to being ended). Timeout, Ctrl-C, SIGTERM or any error end the whole
    tree before this returns or raises. ``echo(text)`` receives the output as it comes, if given."""
    check_timeout(timeout_s)
    with TermAsInterrupt(), ProcessTree(cmd, env=env) as tree:
        try:
            code, shown, deadline = None, 0, time.monotonic() + timeout_s
            while code is None and time.monotonic() < deadline:
                code = tree.wait(min(0.5, max(0.0, deadline - time.monotonic())) if echo else
                                 max(0.0, deadline - time.monotonic()))
                if echo:
                    text = tree.output()
                    echo(text[shown:])
                    shown = len(text)
            output = tree.output()
        finally:
            tree.end()
    return code, output


class TermAsInterrupt:
    """Inside the block, SIGTERM to this process raises KeyboardInterrupt (so ``finally`` blocks end child trees);
    the previous handler is restored on exit. A no-op outside the main thread."""

    def __enter__(self):
        self._prev = None
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)
