"""Where a prediction comes from: the collective ledger of the rank whose step time is reported (each call's time
with the correction factor it carries), the compute of one layer (each GEMM with its FLOPs and the efficiency used,
attention, memory-bound kernels, overheads), the tensors one layer saves under each AC mode, and every factor the
model applied (``factors``: the profile's corrections, curves and counts, each with where it comes from), so that any
printed number can be traced from the output alone. Used by ``parsim predict --explain``."""

from __future__ import annotations

import numpy as np

from ..blockshape import plan_block_shapes, plan_head_shape
from ..codec import canonical_axes, canonical_key
from ..hardware import EfficiencyCurve, HardwareProfile, arch_factor_names
from ..plan import Plan
from ..results import Prediction
from ..spec import ModelSpec
from .comm import AXIS_CLASS, axis_class_scale
from .compute import ADAMW_BYTES_PER_PARAM, block_overheads, host_issue_times, layer_compute_items, triton_slowdown
from .layers import FIRST, LAST, Shapes, inflight, kept_by_ac_mode, local_experts, saved_tensors
from .step import evaluate_one, prediction_from, stage_rank


def _block_source(shape, hw: HardwareProfile) -> dict:
    """Which compute the layer's times come from: a block measured at the plan's local shape, or the curves."""
    if shape is None:
        return {"source": "curves", "why": "this shape is not measurable as one block (parsim.blockshape: CP, "
                "MLA, EP with whole experts under TP, ...)", "shape_key": None}
    m = hw.measured_blocks.get(shape.key)
    if m is None:
        return {"source": "curves", "why": "the profile has no block measured at this shape", "shape_key": shape.key}
    return {"source": "measured block", "shape_key": shape.key, "fwd_s": m["fwd_s"], "bwd_s": m["bwd_s"],
            "device": m.get("device"), "torch": m.get("torch"), "measured_at": m.get("measured_at")}


def _head_source(shape, hw: HardwareProfile) -> dict:
    """Which compute the model's ends (embedding; final norm, output projection and loss) come from."""
    m = hw.measured_blocks.get(shape.key) if shape is not None else None
    if m is None:
        why = ("CP plans and learned positions keep the curves" if shape is None else
               "the profile has no measurement of the ends at this shape")
        return {"source": "curves (output GEMM + loss traffic; the embedding uncharged)", "why": why,
                "shape_key": shape.key if shape is not None else None}
    return {"source": "measured ends", "shape_key": shape.key,
            **{k: m[k] for k in ("emb_fwd_s", "emb_bwd_s", "out_fwd_s", "out_bwd_s")},
            "device": m.get("device"), "torch": m.get("torch"), "measured_at": m.get("measured_at")}


def explain(spec: ModelSpec, plan: Plan, hw: HardwareProfile) -> dict:
    """A JSON-ready account of one plan's prediction (SI units, per rank and step unless a name says otherwise)."""
    return predict_and_explain(spec, plan, hw)[1]


def predict_and_explain(spec: ModelSpec, plan: Plan, hw: HardwareProfile) -> tuple[Prediction, dict]:
    """``predict`` and ``explain`` of one plan from one evaluation (``predict --explain``)."""
    b, r = evaluate_one(spec, plan, hw)
    return prediction_from(spec, plan, hw, r), _explain(spec, plan, hw, b, r)


def _explain(spec: ModelSpec, plan: Plan, hw: HardwareProfile, b, r: dict) -> dict:
    rank = int(r["time_rank"][0])
    # keys named as the executor names the collectives (``codec.canonical_axes``), as in ``predict``
    names = canonical_axes(plan, stage_rank(plan, rank))
    comm_scale = float(hw.corrections.get("comm_scale", 1.0))  # on every collective (hardware.collective_time_s)
    ledger = [{"what": rec.what, "key": canonical_key(rec.key, names), "calls": float(rec.calls[0]),
               "bytes_per_call": float(rec.bytes_per_call[0]), "group_size": int(rec.group[0]),
               "ranks_per_node": int(min(rec.ranks_per_node[0], rec.group[0])), "phase": rec.phase,
               "overlap": rec.overlap, "scale": axis_class_scale(hw, rec.axis, rec.op) * comm_scale,
               "axis_class": AXIS_CLASS.get(rec.axis, rec.axis), "raw_s": float(rec.time_s[0]),
               "exposed_s": float(rec.exposed_s[0])}
              for rec in r["ledgers"][rank].records if rec.calls[0] > 0]
    sh = Shapes(spec, b)
    kinds = [k for k in (False, True) if (spec.n_moe_layers if k else spec.n_dense_layers) > 0]
    shapes = plan_block_shapes(spec, plan)
    layers = {}
    for moe in kinds:
        items = layer_compute_items(spec, b, sh, hw, moe, block_overheads(hw)[0])
        saved = saved_tensors(spec, sh, moe)
        keep = kept_by_ac_mode(saved, local_experts(spec, sh) if moe else None)
        layers["moe" if moe else "dense"] = {
            "tokens_per_microbatch": float(sh.T[0]),
            "compute_forward": [{"name": n, "kind": k, "work": float(w[0]), "efficiency": float(e[0]),
                                 "seconds": float(t[0]), "recomputed_by_selective_ac": _first(sac)}
                                for n, k, w, e, t, sac in items],
            "compute_scale": float(hw.corrections.get("compute_scale", 1.0)),
            "block": _block_source(shapes.get("moe" if moe else "dense"), hw),
            "saved_tensors": [{"name": n, "bytes": float(nb[0]) if hasattr(nb, "__len__") else float(nb),
                               "kind": k, **{f"kept_{m}": _first(kk[m]) for m in ("none", "full", "sac")}}
                              for (n, nb, k), kk in zip(saved, keep, strict=True)],
        }
    return {"rank": f"pp stage {plan.pp - 1 if rank == LAST else 0}" if rank in (FIRST, LAST) else str(rank),
            "ledger": ledger, "layers": layers, "ends": _head_source(plan_head_shape(spec, plan), hw),
            "factors": factors(plan, hw, b, r, ledger)}


# profile quantities a measured (``parsim profile``) profile carries at their defaults [see profiler/run.py]
NOT_MEASURED = ("compile_memory_bound_factor", "fused_attention_speedup")


def _source(hw: HardwareProfile, key: str, calibrated: str | None = None) -> str:
    """Where a profile quantity comes from: ``parsim calibrate``'s factor on it, a measurement, or the profile's
    own value (spec sheet: its ``assumptions`` name each one's source), or the model's default (absent)."""
    fitted = hw.calibration.get("factors", {}) if isinstance(hw.calibration, dict) else {}
    if calibrated is not None and calibrated in fitted:
        cal = hw.calibration
        factor, where = float(fitted[calibrated]), ""
        for mine in arch_factor_names(calibrated, hw.device_name):  # the architecture's own ratio, if fitted
            if mine in fitted:
                factor *= float(fitted[mine])
                where += f", {mine} x{float(fitted[mine]):.3g} included"
        return (f"fitted by parsim calibrate (x{factor:.3g} on the profile's value{where}; "
                f"{cal.get('n_rows', '?')} rows, {str(cal.get('date', ''))[:10]})")
    if key == "default":
        return "default: not in the profile"
    if hw.source != "measured":
        return f"the profile's {key} (a spec-sheet profile: its assumptions name each value's source)"
    if key in NOT_MEASURED:
        return f"the profile's {key}, assumed: the profiler does not measure it"
    return f"measured by parsim profile ({key})"


def _row(name: str, value, applies: str, source: str) -> dict:
    return {"name": name, "value": value, "applies_to": applies, "source": source}


def _corr(hw: HardwareProfile, key: str, default: float) -> tuple[float, str]:
    """A correction's value and the key it was read from (``default`` when the profile has none)."""
    return (float(hw.corrections[key]), f"corrections.{key}") if key in hw.corrections else (default, "default")


def _compute_factors(plan: Plan, hw: HardwareProfile) -> list[dict]:
    """The compute side: core sharing, per-layer overheads, the efficiency curves' ceilings, memory-bound kernels."""
    cs, cs_key = _corr(hw, "compute_scale", 1.0)
    ov_f, ov_b = block_overheads(hw)
    if "layer_overhead_fwd_s" in hw.corrections:
        ov_src = _source(hw, "corrections.layer_overhead_*_s", "layer_overhead")
    elif isinstance(hw.samples, dict) and hw.samples.get("block"):
        ov_src = ("derived at predict time: the profile's measured block sample (samples.block) minus the model's "
                  "time for that block, floored at 0")
    else:
        ov_src = "default: the profile has no block sample (0)"
    rows = [
        _row("compute_scale", cs, "every compute term (layers, the model's ends, the optimizer step, framework "
             "overheads) is multiplied by it; a pipeline's schedule is simulated with the cores shared by the ranks "
             "that have work (pipeline.shared_makespan)",
             _source(hw, cs_key)),
        _row("layer overhead forward / backward (s per layer and microbatch)", [ov_f, ov_b],
             "added to each layer's curve time (the 'overhead' item of the layer table)", ov_src)]
    host = host_issue_times(hw)
    if host is not None:
        rows.append(_row("host issue time forward / backward (s per layer and microbatch)", list(host),
                         "an asynchronous device: each layer costs max(its kernels, this), not their sum",
                         "the profile's block sample (samples.block.host_fwd_s / host_fwd_bwd_s), measured"))
    curves: list[tuple[str, EfficiencyCurve | None, str, str]] = [
        ("gemm_efficiency", hw.gemm_efficiency, "gemm_eff_max", "every GEMM: time = (FLOPs + x_half) / "
               "(eff_max x peak)"),
              ("attention_keys_efficiency" if hw.attention_keys_efficiency is not None else "attention_efficiency",
               hw.attention_keys_efficiency or hw.attention_efficiency, "attention_eff_max", "attention kernels")]
    if plan.float8:
        curves.append(("float8_gemm_efficiency", hw.float8_gemm_efficiency, "float8_eff_max", "float8 GEMMs"))
    for name, curve, cal, what in curves:
        if curve is not None:
            rows.append(_row(f"{name} (eff_max, x_half)", [curve.eff_max, curve.x_half], what,
                             _source(hw, name, cal)))
    rows.append(_row("memory_efficiency x bandwidth (B/s)",
                     [hw.memory_efficiency, hw.memory_bandwidth_bytes_per_s],
                     "memory-bound kernels (norms, RoPE, activations, residuals, the unfused loss): bytes / "
                     "(bandwidth x efficiency)", _source(hw, "memory_efficiency", "memory_efficiency")))
    if plan.compile:
        rows.append(_row("compile_memory_bound_factor", hw.compile_memory_bound_factor,
                         "memory-bound time under torch.compile (x)",
                         _source(hw, "compile_memory_bound_factor", "compile_memory_factor")))
    if plan.attention_kernel == "triton":
        rows.append(_row("Triton FlashAttention slowdown", triton_slowdown(hw),
                         "attention time on the Triton FlashAttention kernel over FlashAttention-2's (x)",
                         _source(hw, "default", "triton_attention") if "triton_attention_factor" in hw.corrections
                         else "TRITON_ATTENTION_SLOWDOWN (the FlashAttention-2 paper's 1.3-2.5x, its middle)"))
    if plan.te_layers:
        rows.append(_row("fused_attention_speedup", hw.fused_attention_speedup,
                         "attention under Transformer Engine layers (efficiency x, capped at 1; over the spec-sheet "
                         "FlashAttention curve where the speedup is > 1: the calibrated attention factor is not "
                         "applied to cuDNN's kernel)",
                         _source(hw, "fused_attention_speedup")))
    return rows


def _comm_factors(hw: HardwareProfile, r: dict, ledger: list[dict]) -> list[dict]:
    """The communication side: each (op, axis)'s scale on the fitted collective curves, overlap, interference."""
    rows = []
    for key in sorted({row["key"] for row in ledger}):
        first = next(row for row in ledger if row["key"] == key)
        op, cls = key.split("/", 1)[0], first["axis_class"]
        c_cls, k_cls = _corr(hw, f"comm_scale_{cls}", 1.0)
        c_op, k_op = _corr(hw, f"comm_scale_op_{op}", 1.0)
        rows.append(_row(f"collective time scale {key}", first["scale"],
                         f"raw time of every {key} call = the profile's fitted curve x comm_scale_{cls} "
                         f"({c_cls:.3g}) x comm_scale_op_{op} ({c_op:.3g})",
                         _source(hw, k_cls if k_cls != "default" else k_op,
                                 "comm_scale_all_reduce" if op == "all_reduce" and k_cls == "default"
                                 else f"comm_scale_{cls}")))
    if "comm_scale" in hw.corrections:
        rows.append(_row("comm_scale (every collective)", float(hw.corrections["comm_scale"]),
                         "the time of every collective call (included in the scales above)",
                         _source(hw, "corrections.comm_scale")))
    k, k_key = _corr(hw, "comm_interference", 0.0)
    hidden = sum(row["raw_s"] - row["exposed_s"] for row in ledger)
    rows.append(_row("comm_overlap", hw.comm_overlap, "collectives run beside compute (exposed < raw)" if
                     hw.comm_overlap else "collectives block the rank (gloo on CPU): exposed = raw",
                     _source(hw, "comm_overlap")))
    rows.append(_row("comm_interference", k, f"x hidden collective time {hidden * 1e3:.3f} ms = "
                     f"{float(r['time_breakdown_s'].get('comm_interference', [0.0])[0]) * 1e3:.3f} ms "
                     "(comm_interference in the step time)", _source(hw, k_key, "comm_interference")))
    return rows


def _schedule_factors(plan: Plan, hw: HardwareProfile, b) -> list[dict]:
    """Counts: microbatches per step, those in flight at each stage's peak, the bubble; the optimizer's terms."""
    ga, m_pass = int(b.grad_accum[0]), int(b.n_micro[0])
    rows = [_row("microbatches per step per rank", ga * m_pass, "compute, per-microbatch collectives and "
                 f"activations (gradient accumulation {ga} x {m_pass} per pass)", "derived from the plan")]
    if plan.pp > 1:
        first, last = float(inflight(b, FIRST)[0]), float(inflight(b, LAST)[0])
        rows.append(_row("microbatches in flight at the peak (first stage, last stage)", [first, last],
                         "activations alive at the memory peak, in microbatches through all of the stage's layers",
                         f"derived from the {plan.pp_schedule} schedule (layers.inflight)"))
        rows.append(_row("pipeline bubble (microbatch times)", ga * (plan.pp - 1) / plan.pp_stages_per_rank,
                         "pp_bubble = ga x (pp - 1) / v x the other stages' mean microbatch time "
                         "(pipeline.shared_cores); where ranks share cores (compute_scale > 1) the schedule's "
                         "simulated step less this rank's compute (pipeline.shared_makespan)",
                         "derived (Narayanan et al. 2021)"))
    c = hw.corrections
    if "optimizer_s_per_param" in c:
        rows.append(_row("optimizer step: fixed s, s per parameter, s per tensor",
                         [float(c["optimizer_fixed_s"]), float(c["optimizer_s_per_param"]),
                          float(c.get("optimizer_s_per_tensor", 0.0))], "the optimizer step (x compute_scale)",
                         _source(hw, "corrections.optimizer_*")))
    else:
        rows.append(_row("optimizer step: bytes per parameter at the memory-bound bandwidth", ADAMW_BYTES_PER_PARAM,
                         "the optimizer step (AdamW traffic / (bandwidth x memory_efficiency))", "derived"))
    for key, what in (("fsdp_call", "framework_fsdp: per FSDP unit and collective call (unshard, reduction)"),
                      ("fsdp_moe_call", "framework_fsdp: per call of a unit holding a MoE block's routed experts"),
                      ("tp_block", "framework_tp: per TP block and microbatch"),
                      ("tp_moe_block", "framework_tp: per MoE block under TP and microbatch"),
                      ("ep_block", "framework_ep: per MoE block and microbatch under EP"),
                      ("pp_action", "framework_pp: per pipeline stage action (one microbatch's forward or backward)")):
        if f"{key}_fixed_s" in c:
            rows.append(_row(f"{key}: fixed s, s per byte", [float(c[f"{key}_fixed_s"]),
                             float(c[f"{key}_s_per_byte"])], what + " (x compute_scale)",
                             _source(hw, f"corrections.{key}_*")))
    return rows


def factors(plan: Plan, hw: HardwareProfile, b, r: dict, ledger: list[dict]) -> list[dict]:
    """Every factor the model applied to this plan's prediction (``b``, ``r``: its batch and evaluation), with what
    it multiplies and where it comes from."""
    return _compute_factors(plan, hw) + _comm_factors(hw, r, ledger) + _schedule_factors(plan, hw, b)


def _first(x):
    """A flag or a fraction (grouped GEMMs under selective AC) of the one plan explained, as JSON has it: a bool
    where it is one, else the fraction."""
    v = np.asarray(x).ravel()[0] if np.ndim(x) else x
    return bool(v) if isinstance(v, (bool, np.bool_)) or float(v) in (0.0, 1.0) else float(v)
