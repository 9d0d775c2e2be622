"""The collectives of a real training step against the profile's curves: does a collective inside a step take what
the profiler measured it to take alone? The plan runs under torchrun on the executor's own worker, with
torch.distributed's blocking collectives timed call by call on rank 0 (wall time from the call to its return: the
rank's wait, skew between ranks included); each (op, bytes, group) is then set beside the profile's curve for it
(``HardwareProfile.collective_time_s``, the cost model's input), per call and summed over the run:

    python bench/step_collectives.py --model tiny --nproc-per-node 2 --degrees '{"dp_shard": 2}' \\
        --profile bench/reports/local-tier-first-avx2/2026-11-29/profiles/fresh-2.json

Bytes follow the cost model's ledger: an all-gather's input (the shard), a reduce-scatter's and an all-reduce's
whole buffer. Calls under 1 kB (loss logging, the gradient norm) are left out. A diagnostic, not a profile quantity
(figures: bench/reports/fsdp-overhead/2026-11-29).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

# torch.distributed entry points FSDP2, DTensor and the executor call (torch 2.13 FSDP2: *_single)
TIMED = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
         "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}
MIN_BYTES = 1024


def _patch(records: list) -> None:
    """Wrap the blocking forms of the collectives in ``TIMED`` (async calls pass through untimed)."""
    import torch.distributed as dist

    def wrap(name, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            work = fn(*a, **k)
            if k.get("async_op"):
                return work
            dt = time.perf_counter() - t0
            sizes = [x.numel() * x.element_size() for x in list(a[:2]) + list(k.values()) if hasattr(x, "numel")]
            if sizes:
                group = k.get("group")
                records.append((TIMED[name], min(sizes) if name.startswith("all_gather") else max(sizes),
                                group.size() if group is not None else dist.get_world_size(), dt))
            return work
        return timed

    for name in TIMED:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _worker(argv: list[str]) -> int:
    """Under torchrun: the executor's worker with the collectives timed; rank 0 writes what it timed."""
    from parsim.executor import worker

    records: list = []
    _patch(records)
    rc = worker.main(argv)
    if os.environ.get("RANK") == "0":
        with open(os.environ["PARSIM_COLLECTIVES_OUT"], "w") as f:
            json.dump(records, f)
    return rc


def run(model: str, nproc: int, degrees: dict, steps: int, warmup: int, tmp: str) -> tuple[list, list[float], int]:
    """(timed calls, step times, steps run) of one run of the plan."""
    from parsim.plan import Plan

    plan = Plan(seq_len=256, local_batch_size=1, global_batch_size=8, micro_batch_size=1, param_dtype="float32",
                reduce_dtype="float32", **degrees)
    plan_f, res_f, rec_f = (os.path.join(tmp, n) for n in ("plan.json", "result.json", "calls.json"))
    with open(plan_f, "w") as f:
        json.dump(plan.to_dict(), f)
    env = dict(os.environ, OMP_NUM_THREADS="1", PARSIM_DEVICE="cpu", PARSIM_NO_COUNT="1",
               PARSIM_COLLECTIVES_OUT=rec_f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--worker", "--model", model, "--plan", plan_f, "--out", res_f, "--steps", str(steps), "--warmup",
           str(warmup)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"run failed: {r.stderr[-1500:]}")
    with open(res_f) as f:
        times = json.load(f)["ranks"][0]["step_times_s"]
    with open(rec_f) as f:
        return json.load(f), times, steps + warmup


def compare(records: list, hw) -> tuple[list[dict], float, float]:
    """Per (op, bytes, group): calls, measured and curve seconds per call; the sums over the run."""
    import numpy as np

    agg: dict = collections.defaultdict(list)
    for op, nbytes, group, dt in records:
        if nbytes >= MIN_BYTES:
            agg[op, nbytes, group].append(dt)
    rows, meas, curve = [], 0.0, 0.0
    for (op, nbytes, group), ts in sorted(agg.items()):
        c = float(hw.collective_time_s(op, np.array([float(nbytes)]), np.array([group]), np.array([group]))[0])
        rows.append({"op": op, "bytes": nbytes, "group": group, "calls": len(ts),
                     "measured_median_s": float(np.median(ts)), "curve_s": c})
        meas, curve = meas + sum(ts), curve + c * len(ts)
    return rows, meas, curve


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--degrees", default='{"dp_shard": 2}', help="Plan degrees as JSON")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    from parsim.hardware import load_profile

    hw = load_profile(a.profile)
    with tempfile.TemporaryDirectory(prefix="parsim-coll-") as tmp:
        records, times, n_steps = run(a.model, a.nproc_per_node, json.loads(a.degrees), a.steps, a.warmup, tmp)
    rows, meas, curve = compare(records, hw)
    for r in rows:
        print(f"{r['op']:15s} {r['bytes']:>10d} B  group {r['group']}  {r['calls']:4d} calls  measured "
              f"{r['measured_median_s'] * 1e3:7.2f} ms  curve {r['curve_s'] * 1e3:7.2f} ms")
    print(f"steps {[round(t, 3) for t in times]}; collectives per step: measured {meas / n_steps:.3f} s, curves "
          f"{curve / n_steps:.3f} s (ratio {meas / max(curve, 1e-12):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
