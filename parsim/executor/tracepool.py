"""Many traces, fast: a pool of trace servers (``python -m parsim.executor.trace --serve``), each tracing plan after
plan in one interpreter (torch imported and DTensor's caches warm once: ~1 s a small plan instead of 3-4 s in a
fresh process). A plan whose trace fails is traced again in a fresh process before the failure is believed
(state a server keeps from an earlier fake world must never pass for a bug of the plan); a server that exceeds
the timeout is killed and replaced. Torch-free on this side: the servers import torch.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator

from ..plan import Plan
from ..results import Measurement
from ..spec import ModelSpec


class _Server:
    def __init__(self):
        from ..procs import die_with_parent

        self.proc = subprocess.Popen([sys.executable, "-m", "parsim.executor.trace", "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                     preexec_fn=die_with_parent, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        self.jobs = 0

    def trace(self, spec: ModelSpec, plan: Plan, rank: int, timeout_s: float) -> Measurement | None:
        """One trace; None when the server died or ran past ``timeout_s`` (it is then killed)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"spec": spec.to_dict(), "plan": plan.to_dict(), "rank": rank}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout_s)
        sel.close()
        line = self.proc.stdout.readline() if ready else ""
        self.jobs += 1
        if not line:
            self.close()
            return None
        return Measurement.from_dict(json.loads(line))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class TracePool:
    """``map(jobs)`` traces ``(key, spec, plan, rank)`` jobs on ``workers`` servers and yields ``(key,
    Measurement)`` as they finish (not in order)."""

    def __init__(self, workers: int = 2, timeout_s: float = 900.0, recycle_after: int = 300):
        self.workers, self.timeout_s, self.recycle_after = max(1, workers), timeout_s, recycle_after

    def map(self, jobs: Iterable[tuple]) -> Iterator[tuple]:
        todo: queue.Queue = queue.Queue()
        n = 0
        for job in jobs:
            todo.put(job)
            n += 1
        done: queue.Queue = queue.Queue()
        threads = [threading.Thread(target=self._work, args=(todo, done), daemon=True)
                   for _ in range(min(self.workers, n))]
        for t in threads:
            t.start()
        for _ in range(n):
            yield done.get()
        for t in threads:
            t.join()

    def _work(self, todo: queue.Queue, done: queue.Queue) -> None:
        server: _Server | None = None
        try:
            while True:
                try:
                    key, spec, plan, rank = todo.get_nowait()
                except queue.Empty:
                    return
                if server is None or server.proc.poll() is not None or server.jobs >= self.recycle_after:
                    if server is not None:
                        server.close()
                    server = _Server()
                done.put((key, self._one(server, spec, plan, rank)))
        finally:
            if server is not None:
                server.close()

    def _one(self, server: _Server, spec: ModelSpec, plan: Plan, rank: int) -> Measurement:
        return _believed(server, spec, plan, rank, self.timeout_s)


def _believed(server: _Server, spec: ModelSpec, plan: Plan, rank: int, timeout_s: float) -> Measurement:
    """``server``'s trace of the plan; an error (or a dead server) is believed only when a fresh process sees it
    too (then that process's measurement, marked ``fresh_process``)."""
    t0 = time.monotonic()
    m = server.trace(spec, plan, rank, timeout_s)
    if m is not None and m.status == "ok":
        return m
    fresh_server = _Server()
    try:
        fresh = fresh_server.trace(spec, plan, rank, max(60.0, timeout_s - (time.monotonic() - t0)))
    finally:
        fresh_server.close()
    if fresh is None:
        return Measurement(plan_id=plan.plan_id, kind="trace", status="timeout",
                           error=f"the trace process died or ran past {timeout_s:.0f} s")
    prov = dict(fresh.provenance)
    prov["fresh_process"] = True
    return Measurement(**{**fresh.to_dict(), "provenance": prov})


class Tracer:
    """One trace server kept from call to call, for callers that trace plan after plan one at a time (the test
    suite: ~1 s a small plan instead of 3-4 s in a fresh process each). Errors are believed as in ``TracePool``;
    the server is replaced after ``recycle_after`` traces and closed at interpreter exit."""

    def __init__(self, timeout_s: float = 1800.0, recycle_after: int = 100):
        self.timeout_s, self.recycle_after = timeout_s, recycle_after
        self._server: _Server | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def trace(self, spec: ModelSpec, plan: Plan, rank: int = 0) -> Measurement:
        with self._lock:
            s = self._server
            if s is None or s.proc.poll() is not None or s.jobs >= self.recycle_after:
                if s is not None:
                    s.close()
                s = self._server = _Server()
            return _believed(s, spec, plan, rank, self.timeout_s)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
