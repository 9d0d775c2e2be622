"""`parsim run`: launch the worker under torchrun, enforce a timeout, and turn what it wrote into a Measurement.

A hung run is ended at ``timeout_s`` — torchrun and every worker it started, found by the tag ``procs.ProcessTree``
gives them — and recorded as ``timeout``; Ctrl-C or SIGTERM ends the tree the same way before the interrupt goes
on; a crash is recorded as ``error`` with the tail of its output. The Measurement JSON is written atomically.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone

from ..jsonio import atomic_write_json
from ..plan import Plan
from ..procs import check_timeout, run_tree
from ..results import Measurement
from ..traceread import PLAN_FILE

PROGRESS_PREFIX = "parsim-step "  # the worker's line per step on rank 0 (worker._progress)


def run_plan(model: str, plan: Plan, nproc_per_node: int, *, steps: int = 5, warmup: int = 2,
             timeout_s: float = 600.0, out: str | None = None, torchrun_args: list[str] | None = None,
             device: str | None = None, optimizer: str = "adamw",
             progress: Callable[[str], None] | None = None, profile_trace: str | None = None) -> Measurement:
    """Run ``plan`` for real. ``torchrun_args`` pass through (``--nnodes``, ``--rdzv-endpoint`` ...);
    ``progress(line)`` receives rank 0's line per step (after ``PROGRESS_PREFIX``) as each step ends;
    ``profile_trace``: a folder where each rank writes its torch.profiler trace of the timed steps
    (``worker.StepTracer``)."""
    check_timeout(timeout_s)  # before anything is written or started
    torchrun_args = list(torchrun_args or [])
    with tempfile.TemporaryDirectory(prefix="parsim-run-") as tmp:
        plan_f, res_f = os.path.join(tmp, "plan.json"), os.path.join(tmp, "result.json")
        with open(plan_f, "w") as f:
            json.dump(plan.to_dict(), f)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
        if not any(a.startswith("--nnodes") or a.startswith("--rdzv") for a in torchrun_args):
            cmd += ["--standalone"]
        cmd += torchrun_args + ["-m", "parsim.executor.worker", "--model", model, "--plan", plan_f, "--out", res_f,
                                "--steps", str(steps), "--warmup", str(warmup), "--optimizer", optimizer]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        # the allocator setting torchtitan's launch script uses and parsim's reserved-memory model assumes
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if device == "cpu":
            env["PARSIM_DEVICE"] = "cpu"
        if profile_trace:
            env["PARSIM_PROFILE_TRACE"] = os.path.abspath(profile_trace)
        t0 = time.perf_counter()
        echo = _StepLines(progress) if progress else None
        code, log = run_tree(cmd, env, timeout_s, echo=echo)  # nothing of the run survives this call, however it ends
        status = "timeout" if code is None else None
        wall = time.perf_counter() - t0
        prov = {"command": " ".join(cmd), "nproc_per_node": nproc_per_node, "wall_s": wall,
                **({"profile_trace": os.path.abspath(profile_trace)} if profile_trace else {}),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model,
                "plan": plan.to_dict()}
        if status == "timeout":
            m = Measurement(plan_id=plan.plan_id, kind="run", status="timeout",
                            error=f"killed after {timeout_s:g} s; last output: {_tail(log) or '(none)'}",
                            provenance=prov)
        elif not os.path.exists(res_f):
            m = Measurement(plan_id=plan.plan_id, kind="run", status="error",
                            error=f"torchrun exited {code} without a result: {_cause(log)}{_tail(log)}",
                            provenance=prov)
        else:
            with open(res_f) as f:
                m = _merge(plan, json.load(f), prov)
    if profile_trace and os.path.isdir(profile_trace):  # what ran, beside the traces (calibrate --trace reads it)
        atomic_write_json(os.path.join(profile_trace, PLAN_FILE), {
            "model": model, "plan": plan.to_dict(), "unprofiled_median_step_s": m.median_step_time_s,
            "profiled_median_step_s": m.provenance.get("profiled_median_step_s"), "measurement": m.to_dict()})
    if out:
        atomic_write_json(out, m.to_dict())
    return m


class _StepLines:
    """Fed the run's output as it comes (in pieces that may split lines); hands on each whole line that starts with
    the worker's progress prefix, without it."""

    def __init__(self, sink: Callable[[str], None]):
        self.sink, self.partial = sink, ""

    def __call__(self, text: str) -> None:
        *lines, self.partial = (self.partial + text).split("\n")
        for ln in lines:
            if ln.startswith(PROGRESS_PREFIX):
                self.sink(ln[len(PROGRESS_PREFIX):].strip())


# what a worker killed by a signal said before it died (C++ terminate, a fatal Python error): torchrun's summary,
# which ends the log, names only the signal
_CAUSE_MARKS = ("terminate called", "what():", "Fatal Python error", "Segmentation fault", "Aborted")


def _cause(log: str, n: int = 3) -> str:
    """The first ``n`` lines of ``log`` that say why a process aborted, as a prefix of the error ('' if none)."""
    found = [ln.strip() for ln in (log or "").splitlines() if any(m in ln for m in _CAUSE_MARKS)][:n]
    return "".join(f"[{ln[:300]}] " for ln in found)


def _tail(log: str, n: int = 1500) -> str:
    lines = [ln for ln in (log or "").splitlines() if not ln.startswith("W1") and "OMP_NUM_THREADS" not in ln]
    return "\n".join(lines)[-n:]


def _merge(plan: Plan, res: dict, prov: dict) -> Measurement:
    ranks = [r for r in res["ranks"] if r is not None]
    prov.update({k: res[k] for k in ("device", "torch", "backend", "world_size", "host")})
    bad = [r for r in ranks if r["status"] != "ok"]
    if bad:
        r = bad[0]
        prov["traceback"] = r.get("traceback", "")
        return Measurement(plan_id=plan.plan_id, kind="run", status=r["status"],
                           error=f"rank {r['rank']}: {r['error']}", provenance=prov)
    r0 = min(ranks, key=lambda r: r["rank"])
    # a step takes as long as its slowest rank (steps are barrier-aligned, so ranks agree to within noise)
    times = [max(r["step_times_s"][i] for r in ranks) for i in range(len(r0["step_times_s"]))]
    peaks = [(r["peak_memory_bytes"], r["rank"]) for r in ranks if r["peak_memory_bytes"] is not None]
    peak, peak_rank = max(peaks) if peaks else (None, None)
    bd = next((r["memory_breakdown_bytes"] for r in ranks if r["rank"] == peak_rank), {})
    med = statistics.median(times) if times else None
    prov.update(memory_source=r0.get("memory_source", ""), peak_memory_rank=peak_rank,
                peak_memory_bytes_per_rank={r["rank"]: r["peak_memory_bytes"] for r in ranks},
                comm_counts=r0.get("comm_counts", {}),
                compiled_graphs=r0.get("compiled_graphs"),
                step_time_p90_s=sorted(times)[max(0, int(round(0.9 * len(times))) - 1)] if times else None)
    n_prof = len(r0.get("profiled_step_times_s") or [])
    prof = [max(r["profiled_step_times_s"][i] for r in ranks) for i in range(n_prof)]
    if prof:  # --profile-trace: the profiled steps, timed apart from the measurement
        prov.update(profiled_step_times_s=prof, profiled_median_step_s=statistics.median(prof))
    tps = plan.global_batch_size * plan.seq_len / med / plan.world_size if med else None
    reserved = [r["memory_breakdown_bytes"]["reserved_peak"] for r in ranks
                if "reserved_peak" in (r.get("memory_breakdown_bytes") or {})]
    return Measurement(plan_id=plan.plan_id, kind="run", status="ok", step_times_s=times, median_step_time_s=med,
                       peak_memory_bytes=peak, memory_breakdown_bytes=bd, comm_bytes=r0["comm_bytes"],
                       losses=r0["losses"], tokens_per_s_per_gpu=tps, provenance=prov,
                       reserved_peak_memory_bytes=max(reserved) if reserved else None)
