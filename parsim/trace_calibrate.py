"""`parsim calibrate --trace DIR`: fit a profile's named global factors to the components of traced steps.

A traced step says more than its total: how long the GEMMs, the attention, the memory-bound ops, the host gaps and
each axis's exposed collectives took (``traceread``). The predicted seconds of each depend on one factor of
``calibrate.PARAMETERS`` each, in a known way:

- GEMM, attention and memory-bound seconds are work / (efficiency x peak): proportional to 1 / ``gemm_eff_max``,
  1 / ``attention_eff_max``, 1 / ``memory_efficiency`` [derived];
- the per-layer overhead seconds (``predicted_kinds``' "overhead": a measured block minus the model of it) are
  what the block's measurement holds beyond the modelled GEMM, attention and memory-bound time. Once those are
  fitted to their traced seconds, the overhead is what is left of the traced compute and idle time after them, the
  framework overheads and the bubble the model predicts: ``layer_overhead`` = that remainder / the predicted
  overhead (proportional to the factor) [derived], at least the lower bound;
- FSDP's own ops (copy-in / copy-out, chunk-cat: ``traceread``'s kind "framework") stand beside the model's
  measured framework overheads (``framework_*``), not in the memory-bound term [derived];
- the traced memory-bound ops hold what the model keeps outside its memory-bound term (``predicted_kinds``'
  "other": the output layer and loss where the profile measured them): the memory factor is fitted to the traced
  memory-bound seconds less those [derived];
- a class of axis's exposed collective seconds: proportional to its ``comm_scale_*`` while the collectives are
  exposed, which on a CPU (gloo) step they nearly all are (``traceread``: the main thread waits) [derived; where
  overlap hides part, the fixed-point below corrects the ratio with the prediction's own exposure].

So each factor is the ratio of predicted to traced seconds of its component, summed over the traced plans
(``f = sum predicted / sum traced`` for time ~ 1/f; the inverse for time ~ f), clipped to the factor's bounds; the
collective factors are re-estimated once on the prediction with the compute factors applied (two rounds of the
fixed point). No per-plan or per-row factor: one value per named parameter for every plan the profile predicts.

Interval: a trace moves the prediction, not the interval's width below the base profile's. The traced plans' own
families (``plan.interval_group``) get the larger of the base profile's half-width for that family and what the
trace shows of its own plan (``log(p90 / median)`` of the traced steps, the |log(predicted / traced step)| left
after the fit); every other family the larger of the base's pooled half-width and those. Sized from the traced
plan alone, the interval had been too narrow for the other plans of its family: measured here, one traced plan of
`tiny` on 2 gloo ranks (dp_shard2, global batch 8) gave the dense family x/÷1.06, which covered 8 of the 11 plans
of `validate --model tiny` (72.7%; tp2, AC modes, PP differ from the traced plan in what they run).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from datetime import datetime, timezone

from .calibrate import PARAMETERS, apply, factor_ceiling
from .errors import ParsimError
from .hardware import HardwareProfile
from .plan import Plan, interval_group
from .spec import ModelSpec

# what `calibrate --trace` shows per plan, traced beside predicted (with each comm_<axis>)
SHOWN_COMPONENTS = ("gemm", "attention", "memory", "framework", "overhead", "idle")
# kind of compute -> the factor its seconds are inversely proportional to
KIND_FACTORS = {"gemm": "gemm_eff_max", "attention": "attention_eff_max", "memory": "memory_efficiency"}
AXIS_CLASS = {"tp": "comm_scale_tp", "pp": "comm_scale_pp", "ep": "comm_scale_ep", "dp_shard": "comm_scale_dp",
              "dp_replicate": "comm_scale_dp", "dp_shard+cp": "comm_scale_dp", "efsdp": "comm_scale_dp",
              "edp": "comm_scale_dp", "cp": "comm_scale_tp"}
# [assumed] a traced component measures its factor directly (not through a step total that every factor moves), so
# the fit may go well beyond the row fits' bounds (calibrate.PARAMETERS, e.g. a CPU's memory-bound ops at a few
# percent of its stream bandwidth), but not without limit: a factor of 100 either way is a misread trace
TRACE_BOUNDS = (0.01, 100.0)
MIN_SECONDS = 1e-4  # [assumed] a component below 0.1 ms a step (traced or predicted) does not set its factor


@dataclasses.dataclass(frozen=True)
class TracedPlan:
    """One plan and the traces of its ranks (``traceread.RankTrace``)."""

    spec: ModelSpec
    plan: Plan
    traces: tuple
    unprofiled_step_s: float | None = None  # the same plan's step timed without the profiler (run --profile-trace)

    def __post_init__(self):
        if not self.traces:
            raise ValueError("a traced plan needs at least one rank's trace")
        if self.unprofiled_step_s is not None and not self.unprofiled_step_s > 0:
            raise ValueError(f"unprofiled_step_s must be > 0, got {self.unprofiled_step_s}")


def _traced(tp: TracedPlan) -> tuple[dict, list[float]]:
    """Mean over ranks and steps of each kind and component (seconds a step) and every step's time, with the
    profiler's own cost taken out where the plan's unprofiled step is known (``_without_observer``)."""
    from .trace_compare import mean_components

    acc: dict = {}
    steps = []
    for r in tp.traces:
        _, comp, kinds, _ = mean_components(r)
        for k, v in list(comp.items()) + [(k.split(".", 1)[1], v) for k, v in kinds.items()
                                          if not k.startswith("optimizer.")]:
            acc[k] = acc.get(k, 0.0) + v / len(tp.traces)
        steps += [s.step_s for s in r.steps]
    acc = {k: v for k, v in acc.items() if k not in ("compute_forward", "compute_backward", "recompute")}
    if tp.unprofiled_step_s is not None:
        acc, steps = _without_observer(acc, steps, tp.unprofiled_step_s)
    acc["compute"] = sum(acc.get(k, 0.0) for k in list(KIND_FACTORS) + ["framework"])
    return acc, steps


def _without_observer(acc: dict, steps: list[float], unprofiled_s: float) -> tuple[dict, list[float]]:
    """Take the profiler's cost out of a traced step: the traced mean step less the unprofiled one, removed from
    the components made of many small ops and of waiting (memory-bound and FSDP ops, idle, exposed collectives,
    the optimizer) in proportion to their traced seconds; GEMM and attention keep theirs [assumed: the profiler's cost
    is per recorded op (its hooks at each op's entry and exit, and its threads competing for the cores), which
    lands in the self time of the ops around the hooked ones and in the gaps, and in the waits of the ranks that
    wait for a slowed peer; a GEMM or attention kernel runs as fast profiled. Measured here: GEMM seconds traced
    within 20% of the model's, the memory-bound ops and the exposed collectives 4-50x]."""
    mean = sum(steps) / len(steps)
    extra = mean - unprofiled_s
    soft = [k for k in acc if k in ("memory", "framework", "idle", "optimizer") or k.startswith("comm_")]
    pool = sum(acc[k] for k in soft)
    if extra <= 0 or pool <= 0:
        return acc, steps
    keep = max(1.0 - extra / pool, 0.0)
    out = dict(acc, **{k: acc[k] * keep for k in soft})
    return out, [s * unprofiled_s / mean for s in steps]


def _predicted(tp: TracedPlan, hw: HardwareProfile) -> dict:
    from .costmodel import predict
    from .trace_compare import IDLE_LIKE, predicted_kinds

    pred = predict(tp.spec, tp.plan, hw)
    tb = pred.time_breakdown_s
    out = {k: float(v) for k, v in tb.items() if k.startswith("comm_")}
    kinds = predicted_kinds(tp.spec, tp.plan, hw, tb)
    for kind in list(KIND_FACTORS) + ["overhead", "other"]:
        out[kind] = sum(v for k, v in kinds.items() if k.endswith("." + kind))
    out["bubble"] = sum(float(tb.get(k, 0.0)) for k in IDLE_LIKE)
    out["framework"] = sum(float(v) for k, v in tb.items() if k.startswith("framework_"))
    out["step"] = float(pred.step_time_s)
    return out


def _ratio(pred: float, traced: float, inverse: bool) -> float | None:
    if pred < MIN_SECONDS or traced < MIN_SECONDS:
        return None
    return pred / traced if inverse else traced / pred


def _clip(name: str, f: float, hw: HardwareProfile) -> float:
    """``f`` within ``TRACE_BOUNDS`` (and an efficiency at most 1)."""
    lo, hi = TRACE_BOUNDS[0], min(TRACE_BOUNDS[1], factor_ceiling(name, hw))
    return float(min(max(f, lo), hi))


def fit_traced(plans: list[TracedPlan], hw: HardwareProfile) -> dict:
    """Factors from the traced plans' components; returns factors, the per-component traced and predicted seconds
    (before and after) and each plan's step before and after."""
    if not plans:
        raise ParsimError("calibrate --trace needs at least one traced plan")
    traced = [_traced(tp) for tp in plans]
    before = [_predicted(tp, hw) for tp in plans]
    factors: dict = {}
    for kind, name in KIND_FACTORS.items():
        pairs = [(b.get(kind, 0.0), t.get(kind, 0.0) - (b["other"] if kind == "memory" else 0.0))
                 for b, (t, _) in zip(before, traced, strict=True)]
        f = _pooled(pairs, True)
        if f is not None:
            factors[name] = _clip(name, f, hw)
    kinds_fitted = [_predicted(tp, apply(hw, factors)) for tp in plans]
    rest = [(b["overhead"], t["compute"] + t.get("idle", 0.0)
             - sum(c[k] for k in ("gemm", "attention", "memory", "other", "framework", "bubble")))
            for b, c, (t, _) in zip(before, kinds_fitted, traced, strict=True)]
    if sum(p for p, _ in rest) >= MIN_SECONDS:
        factors["layer_overhead"] = _clip("layer_overhead", max(sum(t for _, t in rest), 0.0)
                                          / sum(p for p, _ in rest), hw)
    for _round in range(2):  # collectives: on the prediction with the other factors applied
        cur = [_predicted(tp, apply(hw, factors)) for tp in plans]
        by_class: dict = {}
        for c, (t, _) in zip(cur, traced, strict=True):
            for k, v in c.items():
                if k.startswith("comm_") and k != "comm_interference" and k[5:] in AXIS_CLASS:
                    by_class.setdefault(AXIS_CLASS[k[5:]], []).append((v, t.get(k, 0.0)))
        for name, pairs in by_class.items():
            f = _pooled(pairs, False)
            if f is not None:
                factors[name] = _clip(name, factors.get(name, 1.0) * f, hw)
    after = [_predicted(tp, apply(hw, factors)) for tp in plans]
    return {"factors": factors, "traced": [t for t, _ in traced], "steps": [s for _, s in traced],
            "before": before, "after": after}


def _pooled(pairs: list[tuple[float, float]], inverse: bool) -> float | None:
    """sum predicted / sum traced over the plans where both are measurable (``_ratio``), or its inverse."""
    pairs = [(p, t) for p, t in pairs if _ratio(p, t, inverse) is not None]
    if not pairs:
        return None
    p, t = sum(x for x, _ in pairs), sum(y for _, y in pairs)
    return p / t if inverse else t / p


def halfwidths(plans: list[TracedPlan], fit: dict, hw: HardwareProfile) -> tuple[dict, float]:
    """({interval group of a traced plan: q}, pooled q for every other family); see the module docstring."""
    near: dict = {}
    for tp, steps, after in zip(plans, fit["steps"], fit["after"], strict=True):
        med = statistics.median(steps)
        p90 = sorted(steps)[min(len(steps) - 1, math.ceil(0.9 * len(steps)) - 1)]
        q = max(math.log(p90 / med), abs(math.log(after["step"] / statistics.fmean(steps))))
        g = interval_group(tp.plan)
        near[g] = max(near.get(g, 0.0), q, hw.interval_log_halfwidth_for(g))
    far = max(hw.interval_log_halfwidth, max(near.values()))
    return near, far


def trace_calibrated_profile(hw: HardwareProfile, plans: list[TracedPlan], fit: dict, sources: list[str],
                             name: str | None = None) -> HardwareProfile:
    """``hw`` with the fitted factors applied, the intervals of ``halfwidths`` and the provenance of the traces."""
    near, far = halfwidths(plans, fit, hw)
    new = apply(hw, fit["factors"])
    cal = {"interval_log_halfwidth": far, "alpha": 0.1, "interval_log_halfwidth_by_group": near,
           "factors": fit["factors"], "parameters": {n: PARAMETERS[n][0] for n in fit["factors"]},
           "data": sources, "n_rows": 0, "n_traced_plans": len(plans),
           "traced_plans": [f"{tp.spec.name} {tp.plan.describe()}" for tp in plans],
           "method": "traced components (parsim.trace_calibrate)",
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    prov = dict(hw.provenance, calibrated_from=hw.provenance.get("calibrated_from", hw.name))
    return dataclasses.replace(new, name=name or f"{hw.name}-trace-cal", calibration=cal, provenance=prov)
