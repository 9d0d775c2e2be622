"""Where a prediction comes from: the collective ledger of the rank whose step time is reported, the compute of
one layer (each GEMM with its FLOPs and the efficiency used, attention, memory-bound kernels, overheads) and the
tensors one layer saves under each AC mode. Used by ``parsim predict --explain`` and ``search --explain``."""

from __future__ import annotations

from ..blockshape import plan_block_shapes, plan_head_shape
from ..codec import canonical_axes, canonical_key, encode
from ..hardware import HardwareProfile
from ..plan import Plan
from ..spec import ModelSpec
from .layers import FIRST, LAST, Shapes, kept_by_ac_mode, saved_tensors
from .step import block_overheads, evaluate, layer_compute_items, stage_rank


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
    plan.validate_for(spec)
    b = encode([plan], hw.gpus_per_node)
    r = evaluate(spec, b, hw, detail=True)
    rank = int(r["time_rank"][0])
    # keys named as the executor names the collectives (``codec.canonical_axes``), as in ``predict``
    names = canonical_axes(plan, stage_rank(plan, rank))
    ledger = [{"what": rec.what, "key": canonical_key(rec.key, names), "calls": float(rec.calls[0]),
               "bytes_per_call": float(rec.bytes_per_call[0]), "group_size": int(rec.group[0]),
               "ranks_per_node": int(min(rec.ranks_per_node[0], rec.group[0])), "phase": rec.phase,
               "overlap": rec.overlap, "raw_s": float(rec.time_s[0]), "exposed_s": float(rec.exposed_s[0])}
              for rec in r["ledgers"][rank].records if rec.calls[0] > 0]
    sh = Shapes(spec, b)
    kinds = [k for k in (False, True) if (spec.n_moe_layers if k else spec.n_dense_layers) > 0]
    shapes = plan_block_shapes(spec, plan)
    layers = {}
    for moe in kinds:
        items = layer_compute_items(spec, b, sh, hw, moe, block_overheads(hw)[0])
        saved = saved_tensors(spec, sh, moe)
        keep = kept_by_ac_mode(saved)
        layers["moe" if moe else "dense"] = {
            "tokens_per_microbatch": float(sh.T[0]),
            "compute_forward": [{"name": n, "kind": k, "work": float(w[0]), "efficiency": float(e[0]),
                                 "seconds": float(t[0]), "recomputed_by_selective_ac": bool(sac)}
                                for n, k, w, e, t, sac in items],
            "compute_scale": float(hw.corrections.get("compute_scale", 1.0)),
            "block": _block_source(shapes.get("moe" if moe else "dense"), hw),
            "saved_tensors": [{"name": n, "bytes": float(nb[0]) if hasattr(nb, "__len__") else float(nb),
                               "kind": k, **{f"kept_{m}": kk[m] for m in ("none", "full", "sac")}}
                              for (n, nb, k), kk in zip(saved, keep, strict=True)],
        }
    return {"rank": f"pp stage {plan.pp - 1 if rank == LAST else 0}" if rank in (FIRST, LAST) else str(rank),
            "ledger": ledger, "layers": layers, "ends": _head_source(plan_head_shape(spec, plan), hw)}
