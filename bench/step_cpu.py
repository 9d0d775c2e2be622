"""Where a step's wall time goes when ranks outnumber cores: per rank and timed step, the process CPU time of the
step and the wall and CPU time inside its blocking collectives. The plan runs under torchrun on the executor's own
worker; a timed step is the interval between the two ``dist.barrier`` calls around it (the worker's ``sync``), the
same interval the executor's step time is. Utilization is the ranks' CPU seconds over cores x the slowest rank's
wall seconds: near 1 the step is bound by the cores' throughput (the ranks' CPU work / cores), well below it by
waits nothing fills.

    python bench/step_cpu.py --model tiny-moe --nproc-per-node 4 --degrees '{"dp_shard": 4}' --steps 6

Process CPU time counts every thread of the rank (gloo's included) in user and kernel mode. A diagnostic, not a
profile quantity (figures: bench/reports/core-sharing/2026-11-29/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_collectives import TIMED  # noqa: E402  (bench/ is not a package)


def _patch(calls: list, barriers: list) -> None:
    """Wrap the blocking forms of the collectives in ``TIMED`` ((start wall s, wall s, process CPU s) per call) and
    ``dist.barrier`` ((wall s, process CPU s) at each return)."""
    import torch.distributed as dist

    def wrap(name, fn):
        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.process_time()
            work = fn(*a, **k)
            if not k.get("async_op"):
                calls.append((t0, time.perf_counter() - t0, time.process_time() - c0))
            return work
        return timed

    def barrier(*a, **k):
        out = real_barrier(*a, **k)
        barriers.append((time.perf_counter(), time.process_time()))
        return out

    for name in TIMED:
        setattr(dist, name, wrap(name, getattr(dist, name)))
    real_barrier = dist.barrier
    dist.barrier = barrier


def _worker(argv: list[str]) -> int:
    """Under torchrun: the executor's worker with its collectives and barriers timed; every rank writes its own."""
    from parsim.executor import worker

    calls: list = []
    barriers: list = []
    _patch(calls, barriers)
    rc = worker.main(argv)
    with open(os.environ["PARSIM_CPU_OUT"] + os.environ["RANK"], "w") as f:
        json.dump({"calls": calls, "barriers": barriers}, f)
    return rc


def _run(model: str, nproc: int, plan_f: str, tmp: str, steps: int) -> tuple[list[dict], list[float]]:
    res_f, rec_f = os.path.join(tmp, "result.json"), os.path.join(tmp, "cpu.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PARSIM_DEVICE="cpu", PARSIM_NO_COUNT="1", PARSIM_CPU_OUT=rec_f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--worker", "--model", model, "--plan", plan_f, "--out", res_f, "--steps", str(steps), "--warmup", "2"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"run failed: {r.stderr[-1500:]}")
    ranks = []
    for i in range(nproc):
        with open(rec_f + str(i)) as f:
            ranks.append(json.load(f))
    with open(res_f) as f:
        res = json.load(f)["ranks"]
    bad = [r for r in res if r and r["status"] != "ok"]
    if bad:
        raise SystemExit(f"rank {bad[0]['rank']}: {bad[0]['error']}")
    return ranks, res[0]["step_times_s"]


def per_step(rank: dict, steps: int) -> list[dict]:
    """One rank's timed steps: the last ``steps`` pairs of barrier returns bracket them (the worker's ``sync``
    before and after each step); per step its wall and CPU s, and the wall and CPU s of the collectives in it."""
    b = rank["barriers"][-2 * steps:]
    out = []
    for (w0, c0), (w1, c1) in zip(b[0::2], b[1::2], strict=True):
        inside = [c for c in rank["calls"] if w0 <= c[0] < w1]
        out.append({"wall_s": w1 - w0, "cpu_s": c1 - c0, "collective_wall_s": sum(c[1] for c in inside),
                    "collective_cpu_s": sum(c[2] for c in inside)})
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--nproc-per-node", type=int, default=4)
    ap.add_argument("--degrees", default='{"dp_shard": 4}', help="Plan degrees as JSON")
    ap.add_argument("--local-batch", type=int, default=1, help="local batch (validate's pp 4: 4)")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args(argv)
    from parsim.plan import Plan

    plan = Plan(seq_len=256, local_batch_size=a.local_batch, global_batch_size=8, micro_batch_size=1,
                param_dtype="float32", reduce_dtype="float32", **json.loads(a.degrees))
    with tempfile.TemporaryDirectory(prefix="parsim-cpu-") as tmp:
        plan_f = os.path.join(tmp, "plan.json")
        with open(plan_f, "w") as f:
            json.dump(plan.to_dict(), f)
        ranks, times = _run(a.model, a.nproc_per_node, plan_f, tmp, a.steps)
    steps = [per_step(r, a.steps) for r in ranks]

    def med(key):
        return [round(statistics.median(s[key] for s in rank), 3) for rank in steps]

    cores = os.cpu_count() or 1
    util = [sum(r[k]["cpu_s"] for r in steps) / (cores * max(r[k]["wall_s"] for r in steps)) for k in range(a.steps)]
    print(f"{a.degrees}: step median {statistics.median(times):.3f} s; per rank, medians over steps: wall "
          f"{med('wall_s')} s, CPU {med('cpu_s')} s, in collectives wall {med('collective_wall_s')} s, CPU "
          f"{med('collective_cpu_s')} s; utilization (median over steps) {statistics.median(util):.2f} of "
          f"{os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
