"""`parsim orders`: execute every order of the enabled wrappers on the installed torch and record what happens.

Each case is a small plan on 2-4 gloo ranks (tiny / tiny-moe, float32) with some wrappers enabled; every
permutation of the enabled wrappers is run through the executor (``run_plan``: torchrun, the real FSDP2 / DTensor
TP / checkpoint_wrapper / torch.compile / pipelining code), disabled wrappers kept at their default places (where
a disabled wrapper sits does not change the plan). Per order: ran / failed (the error's first line) / ran but
differs from the default order (losses beyond tolerance, peak memory, step time). EP is applied before every
wrapper by the executor (``apply_plan``), so it is not permuted.

The cost of a legal but costly order, AC wrapping compile (``ac`` after ``compile``), is measured against the
same plan without AC: with t_none, t_inside, t_outside the step times without AC, with AC inside compile (default)
and AC wrapping compile, the recompute costs R_in = t_inside - t_none and R_out = t_outside - t_none, and the
factor the cost model applies to recompute when AC wraps compile is R_out / R_in.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics

import torch

from ..jsonio import atomic_write_json
from ..plan import DEFAULT_ORDER, Plan
from .launch import run_plan

LOSS_TOL = 2e-5  # [measured] the parity tests' tolerance: summation-order differences stay below 1e-6

CASES = {
    # name: (model, plan kwargs, the wrappers permuted)
    # TP blocks compile except under a compiled full checkpoint (codec's "compile over full AC under TP"), so the
    # orders of TP and compile are observed with selective-op AC
    "tp-ac-fsdp": ("tiny", dict(dp_shard=2, tp=2, local_batch_size=4, ac="full"), ("tp", "ac", "fsdp")),
    "tp-compile-fsdp": ("tiny", dict(dp_shard=2, tp=2, local_batch_size=4, ac="selective-op", compile=True),
                        ("tp", "compile", "fsdp")),
    "ac-compile-fsdp": ("tiny", dict(dp_shard=2, local_batch_size=4, ac="full", compile=True),
                        ("ac", "compile", "fsdp")),
    "pp-ac-fsdp": ("tiny", dict(pp=2, dp_shard=2, local_batch_size=4, micro_batch_size=2, ac="full"),
                   ("pp", "ac", "fsdp")),
    "pp-tp": ("tiny", dict(pp=2, tp=2, local_batch_size=8, micro_batch_size=2), ("pp", "tp")),
    "moe-ep-tp-ac-fsdp": ("tiny-moe", dict(dp_shard=2, tp=2, ep=2, local_batch_size=4, ac="full"),
                          ("tp", "ac", "fsdp")),
}


def orders_of(varying: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every permutation of ``varying``, the other wrappers at their default places; the default order first."""
    out = []
    for perm in itertools.permutations(varying):
        it = iter(perm)
        out.append(tuple(next(it) if w in varying else w for w in DEFAULT_ORDER))
    out.sort(key=lambda o: o != DEFAULT_ORDER)
    return out


def _row(order, m, ref) -> dict:
    row = {"order": list(order), "status": m.status, "error": m.error.splitlines()[0][:300] if m.error else "",
           "losses": list(m.losses), "peak_memory_bytes": m.peak_memory_bytes,
           "median_step_time_s": m.median_step_time_s}
    if m.status == "ok" and ref is not None and ref.status == "ok":
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(m.losses, ref.losses, strict=True))
        row["memory_ratio"] = m.peak_memory_bytes / ref.peak_memory_bytes if ref.peak_memory_bytes else None
        row["step_time_ratio"] = m.median_step_time_s / ref.median_step_time_s
        row["outcome"] = "differs" if row["max_loss_diff"] > LOSS_TOL else "ran"
    else:
        row["outcome"] = "ran" if m.status == "ok" else "failed"
    return row


def run_case(name: str, steps: int, timeout_s: float, progress=None) -> dict:
    model, kw, varying = CASES[name]
    base = Plan(seq_len=64, param_dtype="float32", **kw)
    rows, ref = [], None
    for order in orders_of(varying):
        plan = dataclasses.replace(base, wrapper_order=order)
        m = run_plan(model, plan, plan.world_size, steps=steps, warmup=2, timeout_s=timeout_s, device="cpu",
                     optimizer="sgd")
        if order == DEFAULT_ORDER:
            ref = m
        rows.append(_row(order, m, ref))
        if progress:
            progress(name, rows[-1])
    return {"model": model, "plan": base.to_dict(), "permuted": list(varying), "rows": rows}


def ac_compile_cost(steps: int, timeout_s: float, repeats: int, progress=None) -> dict:
    """Step times without AC, AC inside compile, AC wrapping compile (interleaved, ``repeats`` rounds, medians)
    and the recompute factor R_out / R_in (module docstring), None when R_in is not larger than the baseline's spread
    over the rounds (a ratio of differences inside the noise is not a measurement: at 64 tokens it came out 1.20 when
    nothing compiled and 3.86 when it did, R_in 6 ms against a 45 ms spread). 512 tokens: recompute a visible share
    of a step."""
    base = Plan(seq_len=512, param_dtype="float32", dp_shard=2, local_batch_size=4, compile=True)
    variants = {"no_ac": base, "ac_inside_compile": dataclasses.replace(base, ac="full"),
                "ac_wraps_compile": dataclasses.replace(base, ac="full",
                                                        wrapper_order=("pp", "tp", "compile", "ac", "fsdp"))}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, plan in variants.items():
            m = run_plan("tiny", plan, plan.world_size, steps=steps, warmup=2, timeout_s=timeout_s, device="cpu",
                         optimizer="sgd")
            if m.status == "ok":
                times[k].append(m.median_step_time_s)
            if progress:
                progress("ac-compile-cost", {"order": [k], "status": m.status, "error": m.error,
                                             "median_step_time_s": m.median_step_time_s, "outcome": m.status})
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    factor, spread = None, (max(times["no_ac"]) - min(times["no_ac"])) if times["no_ac"] else None
    if all(med.values()) and med["ac_inside_compile"] - med["no_ac"] > spread:
        factor = (med["ac_wraps_compile"] - med["no_ac"]) / (med["ac_inside_compile"] - med["no_ac"])
    return {"plan": base.to_dict(), "model": "tiny", "step_times_s": times, "median_step_time_s": med,
            "no_ac_spread_s": spread, "recompute_factor": factor}


def run_orders(cases: list[str], out: str, steps: int = 3, timeout_s: float = 600.0, cost_repeats: int = 3,
               progress=None) -> dict:
    """Run the cases, measure the AC-wraps-compile cost, merge into ``out`` under this torch version."""
    data = {"torch": torch.__version__.split("+")[0], "device": "cpu", "backend": "gloo", "steps": steps,
            "cases": {name: run_case(name, steps, timeout_s, progress) for name in cases}}
    if cost_repeats > 0:
        data["ac_wraps_compile"] = ac_compile_cost(steps, timeout_s, cost_repeats, progress)
    store = {}
    if os.path.exists(out):
        with open(out) as f:
            store = json.load(f)
    # merged case by case: a run of some cases keeps the others and a cost measured before (a run of one case once
    # replaced this torch version's whole matrix)
    prev = store.setdefault("by_torch_version", {}).get(data["torch"], {})
    store["by_torch_version"][data["torch"]] = {**prev, **data, "cases": {**prev.get("cases", {}), **data["cases"]}}
    atomic_write_json(out, store)
    return data
