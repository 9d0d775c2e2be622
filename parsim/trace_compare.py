"""A traced job beside its prediction (`parsim read-trace`): per component, with ``predict``'s names.

The traced side is ``traceread``'s attribution, averaged over the profiled steps of each rank (means, so that the
components still sum to the mean step); the rank shown is the one with the longest mean step (the one the others
wait for). The predicted side is ``predict``'s ``time_breakdown_s`` of the same plan, and its compute split by
kind (``predicted_kinds``). ``idle`` has no term of its own in the model: it is set beside the predicted pipeline
bubble and the framework overheads (the time the model charges for nothing running).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from .traceread import PHASES, RankTrace

# predicted breakdown entries shown against the traced ``idle``: the model's time with no kernel of a phase
IDLE_LIKE = ("pp_bubble",)
# a kind-split probe slows one efficiency by this factor; the time that grows is that kind's (linear in 1/eff)
PROBE = 0.5


def mean_components(r: RankTrace) -> tuple[float, dict, dict, dict]:
    """(mean step s, mean component s, mean kind s, mean hidden comm s) over one rank's profiled steps."""
    n = len(r.steps)
    comp: dict = defaultdict(float)
    kinds: dict = defaultdict(float)
    hidden: dict = defaultdict(float)
    for s in r.steps:
        for k, v in s.components_s.items():
            comp[k] += v / n
        for k, v in s.kinds_s.items():
            kinds[k] += v / n
        for k, v in s.hidden_comm_s.items():
            hidden[k] += v / n
    return sum(s.step_s for s in r.steps) / n, dict(comp), dict(kinds), dict(hidden)


def collectives_table(r: RankTrace) -> list[dict]:
    """One row per (op, axis) of one rank: calls per step, group size, input bytes per step, time and exposed time
    per step."""
    n = len(r.steps)
    rows: dict = {}
    for s in r.steps:
        for c in s.collectives:
            key = (c.op, c.axis or "unknown")
            row = rows.setdefault(key, {"op": c.op, "axis": c.axis or "unknown", "calls": 0.0, "group_size": 0,
                                        "input_bytes": 0.0, "bytes_known": True, "dtype": set(), "time_s": 0.0,
                                        "exposed_s": 0.0})
            row["calls"] += 1 / n
            row["group_size"] = max(row["group_size"], c.group_size)
            if c.input_bytes is None:
                row["bytes_known"] = False
            else:
                row["input_bytes"] += c.input_bytes / n
            row["dtype"].add(c.dtype)
            row["time_s"] += c.duration_s / n
            row["exposed_s"] += c.exposed_s / n
    out = []
    for row in sorted(rows.values(), key=lambda x: -x["time_s"]):
        row["dtype"] = ",".join(sorted(d for d in row["dtype"] if d))
        row["input_bytes"] = row["input_bytes"] if row.pop("bytes_known") else None
        out.append(row)
    return out


def summary(traces: list[RankTrace]) -> dict:
    """What the traces hold without a plan: per rank, the mean step and its components; the slowest rank's kinds,
    collectives and largest kernels."""
    per_rank: list[dict] = []
    for r in traces:
        step, comp, kinds, hidden = mean_components(r)
        per_rank.append({"rank": r.rank, "path": r.path, "device": r.device, "steps": len(r.steps),
                         "step_s": step, "step_s_each": [s.step_s for s in r.steps],
                         "components_s": comp, "kinds_s": kinds, "hidden_comm_s": hidden})
    slow = max(range(len(traces)), key=lambda i: float(per_rank[i]["step_s"]))
    r = traces[slow]
    return {"notes": _notes(r),"world_size": r.world_size, "ranks_read": len(traces), "device": r.device,
            "slowest_rank": r.rank, "ranks": per_rank, "collectives": collectives_table(r),
            "top_kernels": [{"name": n, "seconds": s, "calls": c} for n, s, c in r.top_kernels],
            "median_step_s": statistics.median(float(p["step_s"]) for p in per_rank)}


def _notes(r: RankTrace) -> list[str]:
    """What the trace does not say: collectives without a size, a group or an axis."""
    colls = [c for s in r.steps for c in s.collectives]
    out = []
    for what, bad in (("their bytes", [c for c in colls if c.input_bytes is None]),
                      ("their group size", [c for c in colls if not c.group_size]),
                      ("their axis (give the plan)", [c for c in colls if c.axis is None])):
        if bad:
            ops = ", ".join(sorted({c.op for c in bad}))
            out.append(f"{len(bad)} of {len(colls)} collectives ({ops}) carry no metadata for {what}")
    return out


def predicted_kinds(spec, plan, hw, base: dict | None = None) -> dict:
    """The predicted compute phases split by kind: ``"<phase>.<kind>"`` -> s for gemm, attention, memory,
    ``overhead`` (the per-layer host overhead: measured block minus the model) and ``other`` (what none of these
    holds: the output layer and loss where the profile measured them, fixed terms). Derivation: a phase's compute
    time is linear in 1/efficiency of each kind (GEMM seconds = FLOPs / (eff x peak); memory-bound = bytes / (eff x
    bandwidth)) and in the overhead factor, so the seconds that appear when one kind's efficiency is scaled by
    ``PROBE`` (0.5: never against the cap at 1) are that kind's seconds x (1/PROBE - 1), and those that appear when
    the overhead is doubled are the overhead's. Four more evaluations of the plan (``base``: the plan's
    ``time_breakdown_s`` on ``hw`` where the caller has it)."""
    from .calibrate import apply
    from .costmodel import predict

    base = predict(spec, plan, hw).time_breakdown_s if base is None else base
    probes = {"gemm": ("gemm_eff_max", PROBE), "attention": ("attention_eff_max", PROBE),
              "memory": ("memory_efficiency", PROBE), "overhead": ("layer_overhead", 2.0)}
    out = {}
    left = {p: float(base.get(p, 0.0)) for p in PHASES if p != "optimizer"}
    for kind, (factor, f) in probes.items():
        slow = predict(spec, plan, apply(hw, {factor: f})).time_breakdown_s
        gain = (1 / f - 1) if f < 1 else (f - 1)
        for p in left:
            out[f"{p}.{kind}"] = max(float(slow.get(p, 0.0)) - float(base.get(p, 0.0)), 0.0) / gain
    for p in left:
        out[f"{p}.other"] = max(left[p] - sum(out[f"{p}.{k}"] for k in probes), 0.0)
    return out


def compare(traces: list[RankTrace], spec, plan, hw) -> dict:
    """The summary with the prediction beside: rows of (component, traced s, predicted s), the kinds likewise, MFU
    traced and predicted (same FLOPs: the predicted MFU x predicted step / traced step) and the components that
    explain most of the difference."""
    from .costmodel import predict
    from .machine import mfu_value

    out = summary(traces)
    rank = next(p for p in out["ranks"] if p["rank"] == out["slowest_rank"])
    pred = predict(spec, plan, hw)
    tb = {k: float(v) for k, v in pred.time_breakdown_s.items()}
    rows = []
    traced = rank["components_s"]
    names = [p for p in PHASES] + sorted(k for k in set(traced) | set(tb) if k.startswith("comm_")) + ["idle"]
    for name in names:
        if name == "idle":
            p = sum(tb.get(k, 0.0) for k in tb if k in IDLE_LIKE or not (k in PHASES or k.startswith("comm_")))
        else:
            p = tb.get(name, 0.0)
        t = traced.get(name, 0.0)
        if p or t:
            rows.append({"component": name, "traced_s": t, "predicted_s": p, "diff_s": t - p})
    kinds_pred = predicted_kinds(spec, plan, hw, pred.time_breakdown_s)
    kind_rows = []
    for k in sorted(set(kinds_pred) | set(rank["kinds_s"])):
        t, p = rank["kinds_s"].get(k, 0.0), kinds_pred.get(k, 0.0)
        if t or p:
            kind_rows.append({"component": k, "traced_s": t, "predicted_s": p, "diff_s": t - p})
    step_t, step_p = rank["step_s"], float(pred.step_time_s)
    mfu_p = mfu_value(pred.mfu, hw)
    gap = step_t - step_p
    big = sorted(kind_rows + [r for r in rows if not r["component"].startswith(PHASES)],
                 key=lambda r: -abs(r["diff_s"]))[:3]
    out.update(plan_id=plan.plan_id, plan=plan.describe(), model=spec.name, profile=hw.name,
               step_traced_s=step_t, step_predicted_s=step_p, step_error=step_p / step_t - 1 if step_t else None,
               mfu_predicted=mfu_p, mfu_traced=None if mfu_p is None else mfu_p * step_p / step_t,
               rows=rows, kind_rows=kind_rows,
               explains=[dict(r, share_of_gap=(r["diff_s"] / gap if gap else None)) for r in big])
    return out
