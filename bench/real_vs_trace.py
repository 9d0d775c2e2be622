"""The executor's real run (torch's own PipelineStage and schedules, gloo on CPU, PeakTracker at the
second step) against ``parsim trace``'s replay of the same schedule (fake process group), per rank.

The trace replays torch's action order with its own tensors (``executor.trace._fake_pipeline_pass``, with receive
buffers kept per microbatch as torch's stages keep them), which is what ``bench/differential.py`` checks the cost
model against; this script checks that replay against torch itself. Both sides are tensor-level peaks of live
storages, each seeded with what exists when the step starts (parameters, optimizer state, and the stages' receive
buffers: the real run reads torch's own, ``measure.recv_buffers``). The real run's tracker sits above tensor
subclasses: under TP it sees what DTensor's dispatch returns, not what its handlers allocate inside (loss
parallel's temporaries), so TP plans differ either way and are no check of the trace there; routed experts differ
because the real router is data-dependent and the trace routes statically.

    python bench/real_vs_trace.py            # every plan below; --plans A,B for some
    python bench/real_vs_trace.py --json
"""

from __future__ import annotations

import argparse
import json
import sys

from parsim.plan import Plan
from parsim.spec import PRESETS

PLANS = {
    "dp_shard2": dict(dp_shard=2, seq_len=128, local_batch_size=4),
    "tp2": dict(tp=2, seq_len=128, local_batch_size=4),
    "tp2 no SP": dict(tp=2, seq_len=128, local_batch_size=4, sequence_parallel=False),
    "dp_shard2 x tp2 full AC": dict(dp_shard=2, tp=2, seq_len=128, local_batch_size=4, ac="full"),
    "dp_shard2 selective AC": dict(dp_shard=2, seq_len=128, local_batch_size=4, ac="selective-op"),
    "dp_replicate2 x dp_shard2": dict(dp_replicate=2, dp_shard=2, seq_len=128, local_batch_size=4),
    "cp2": dict(cp=2, seq_len=128, local_batch_size=4),
    "dp_shard2 fused loss": dict(dp_shard=2, seq_len=128, local_batch_size=4, fused_loss=True),
    "dp_shard2 grad accum": dict(dp_shard=2, seq_len=128, local_batch_size=2, global_batch_size=8),
    "1F1B": dict(pp=2, seq_len=128, local_batch_size=8, micro_batch_size=1, pp_schedule="1F1B"),
    "GPipe": dict(pp=2, seq_len=128, local_batch_size=8, micro_batch_size=1, pp_schedule="GPipe"),
    "1F1B x dp_shard2": dict(pp=2, dp_shard=2, seq_len=128, local_batch_size=8, micro_batch_size=1,
                             pp_schedule="1F1B"),
    "Interleaved1F1B": dict(pp=2, pp_stages_per_rank=2, seq_len=128, local_batch_size=8, micro_batch_size=1,
                            pp_schedule="Interleaved1F1B"),
}


MOE_PLANS = {
    "moe dp_shard2 x ep2": dict(dp_shard=2, ep=2, seq_len=128, local_batch_size=4),
    "moe tp2": dict(tp=2, seq_len=128, local_batch_size=4),
}


def compare(name: str, kw: dict, model: str = "tiny") -> list[dict]:
    from parsim.executor.launch import run_plan
    from parsim.executor.trace import trace_in_subprocess

    # fp32: this machine's fast dtype, and the dtype the real run's CPU kernels and the trace agree on
    plan = Plan(param_dtype="float32", reduce_dtype="float32", **kw)
    real = run_plan(model, plan, plan.world_size, steps=2, warmup=1, device="cpu", timeout_s=600)
    if real.status != "ok":
        return [{"plan": name, "rank": None, "error": real.error[:300]}]
    per_rank = real.provenance["peak_memory_bytes_per_rank"]
    out = []
    for rank in sorted(per_rank, key=int):
        t = trace_in_subprocess(PRESETS[model], plan, int(rank))
        r = float(per_rank[rank])
        out.append({"plan": name, "rank": int(rank), "real_peak_bytes": r, "trace_peak_bytes": t.peak_memory_bytes,
                    "real_over_trace": r / t.peak_memory_bytes - 1.0 if t.peak_memory_bytes else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    names = [*PLANS, *MOE_PLANS]
    ap.add_argument("--plans", default=",".join(names), help="comma-separated names of " + ", ".join(names))
    a = ap.parse_args(argv)
    rows = [r for n in a.plans.split(",") for r in
            (compare(n, MOE_PLANS[n], "tiny-moe") if n in MOE_PLANS else compare(n, PLANS[n]))]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        if r.get("error"):
            print(f"{r['plan']:18s} error: {r['error']}")
            continue
        print(f"{r['plan']:18s} rank {r['rank']}  real {r['real_peak_bytes'] / 2**20:8.2f} MiB  trace "
              f"{r['trace_peak_bytes'] / 2**20:8.2f} MiB  real/trace {r['real_over_trace']:+.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
