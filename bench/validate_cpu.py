"""Tier 2 (measured, small scale, real): run every plan of a small space on this machine's CPUs with gloo and
put the prediction from this machine's measured profile beside the measurement.

    python bench/validate_cpu.py [--ranks 4|2] [--profile cpu-gloo-4] [--steps 5]

Plans (tiny, global batch 8, seq 256): 4 ranks: FSDP4, FSDP2xTP2, PP2xFSDP2, PP2xTP2, TP4, AC full, AC selective,
compile, tiny-moe EP2; 2 ranks (one rank per core on this machine): FSDP2, TP2, PP2 (2 and 4 microbatches),
DDP-style HSDP2, AC full, AC selective, compile, tiny-moe EP2. Runs are interleaved, each the median of --steps
steps after 2 warm-up steps. Reports
step-time and peak-memory errors, the rank correlation of step times, and the regret of the model's top pick.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scipy.stats import spearmanr  # noqa: E402

from parsim.costmodel import predict  # noqa: E402
from parsim.executor.launch import run_plan  # noqa: E402
from parsim.hardware import load_profile  # noqa: E402
from parsim.plan import Plan  # noqa: E402
from parsim.spec import PRESETS  # noqa: E402

S, G = 256, 8
PLANS_2 = [
    ("tiny", dict(dp_shard=2, local_batch_size=4)),
    ("tiny", dict(tp=2, local_batch_size=8)),
    ("tiny", dict(pp=2, local_batch_size=8, micro_batch_size=2)),
    ("tiny", dict(pp=2, local_batch_size=8, micro_batch_size=4)),
    ("tiny", dict(dp_replicate=2, local_batch_size=4)),
    ("tiny", dict(dp_shard=2, local_batch_size=4, ac="full")),
    ("tiny", dict(dp_shard=2, local_batch_size=4, ac="selective-op")),
    ("tiny", dict(dp_shard=2, local_batch_size=4, compile=True)),
    ("tiny-moe", dict(dp_shard=2, ep=2, local_batch_size=4)),
]
PLANS = [
    ("tiny", dict(dp_shard=4, local_batch_size=2)),
    ("tiny", dict(dp_shard=2, tp=2, local_batch_size=4)),
    ("tiny", dict(pp=2, dp_shard=2, local_batch_size=4, micro_batch_size=2)),
    ("tiny", dict(pp=2, tp=2, local_batch_size=8, micro_batch_size=2)),
    ("tiny", dict(tp=4, local_batch_size=8)),
    ("tiny", dict(dp_shard=4, local_batch_size=2, ac="full")),
    ("tiny", dict(dp_shard=4, local_batch_size=2, ac="selective-op")),
    ("tiny", dict(dp_shard=4, local_batch_size=2, compile=True)),
    ("tiny-moe", dict(dp_shard=4, ep=2, local_batch_size=2)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="default: cpu-gloo-<ranks>")
    ap.add_argument("--ranks", type=int, default=4, choices=(2, 4))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hw = load_profile(args.profile or f"cpu-gloo-{args.ranks}")
    plans = PLANS if args.ranks == 4 else PLANS_2
    rows = []
    print(f"{'plan':<34} {'status':<6} {'meas ms':>8} {'pred ms':>8} {'err':>6} {'meas MiB':>9} {'pred MiB':>9} "
          f"{'err':>6}  collective bytes (meas / pred)")
    for model, kw in plans:
        plan = Plan(seq_len=S, **kw)
        assert plan.global_batch_size == G
        m = run_plan(model, plan, plan.world_size, steps=args.steps, warmup=2, timeout_s=900, device="cpu")
        p = predict(PRESETS[model], plan, hw)
        name = f"{model} {plan.describe()}" + (f" ac={plan.ac}" if plan.ac != "none" else "") + \
            (" compile" if plan.compile else "")
        if m.status != "ok":
            print(f"{name:<34} {m.status:<6} {m.error[:80]}")
            continue
        ms, mm = m.median_step_time_s, m.peak_memory_bytes
        comm = "; ".join(f"{k} {m.comm_bytes.get(k, 0) / 2**20:.2f}/{p.comm_bytes.get(k, 0) / 2**20:.2f} MiB"
                         for k in sorted(set(m.comm_bytes) | set(p.comm_bytes)) if max(m.comm_bytes.get(k, 0),
                                                                                       p.comm_bytes.get(k, 0)) > 64)
        print(f"{name:<34} {'ok':<6} {ms * 1e3:>8.1f} {p.step_time_s * 1e3:>8.1f} "
              f"{100 * (p.step_time_s - ms) / ms:>+5.0f}% {mm / 2**20:>9.2f} {p.peak_memory_bytes / 2**20:>9.2f} "
              f"{100 * (p.peak_memory_bytes - mm) / mm:>+5.1f}%  {comm}", flush=True)
        rows.append({"plan": name, "plan_id": plan.plan_id, "measured_step_s": ms, "predicted_step_s": p.step_time_s,
                     "step_spread_s": [min(m.step_times_s), max(m.step_times_s)], "measured_peak_bytes": mm,
                     "predicted_peak_bytes": p.peak_memory_bytes, "measured_comm": m.comm_bytes,
                     "predicted_comm": p.comm_bytes})
    if len(rows) >= 3:
        ms = [r["measured_step_s"] for r in rows]
        ps = [r["predicted_step_s"] for r in rows]
        errs = [abs(p - m) / m for p, m in zip(ps, ms, strict=True)]
        rho = spearmanr(ms, ps).statistic
        pick = min(range(len(rows)), key=lambda i: ps[i])
        regret = ms[pick] / min(ms) - 1
        merr = [abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"] for r in rows]
        print(f"\nstep time: mean |error| {100 * sum(errs) / len(errs):.0f}%, max {100 * max(errs):.0f}%, "
              f"Spearman rho {rho:.2f}; model's pick {rows[pick]['plan']} is {100 * regret:.0f}% slower than the "
              f"fastest measured ({rows[ms.index(min(ms))]['plan']})")
        print(f"peak memory: mean |error| {100 * sum(merr) / len(merr):.1f}%, max {100 * max(merr):.1f}%")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
