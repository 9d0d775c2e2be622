"""``parsim search --measure K``: screen analytically, then time the distinct block shapes of the top-K and the
Pareto plans on this device, re-rank them with the measured blocks and say what moved (torch-free: the timing is a
function the caller passes, ``parsim.profiler.blocks`` from the CLI).

**Stand-ins.** Where one block at a plan's full local shape costs more than ``budget_flops`` forward (a llama3-8b
block at 4096 tokens is ~2 TFLOP forward: minutes per repetition on one CPU core), a smaller block stands in for it
and is measured instead: widths (d_model, d_ff, expert and shared d_ff, with the head counts while the kv heads divide;
head_dim kept) halved, then the sequence. The stand-in keeps
what the curves miss in proportion: the full block's time is its composed time (``costmodel.blocktime``) times the
stand-in's measured-over-composed ratio, forward and backward separately,

    t_full = t_composed(full) * t_measured(stand-in) / t_composed(stand-in).

It is exact where the missing time (elementwise kernels, dispatch, autograd) scales with the composed time, and
carries the small shape's efficiency where it does not (a GEMM 8x narrower runs at a lower fraction of peak): a
stand-in ranks plans by how they run here, it does not measure the full shape. On a GPU the budget is unlimited by
default and every shape is measured as it is. Stand-in results live only in the re-ranking; the profile keeps the
real measurements (full or stand-in shapes), so a second run measures nothing again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .blockshape import BlockShape, HeadShape, plan_block_shapes, plan_head_shape, plan_measured_shapes
from .costmodel import predict
from .costmodel.blocktime import composed_block_times, composed_head_times
from .hardware import HardwareProfile
from .plan import Plan
from .spec import ModelSpec

MIN_STAND_IN_D_MODEL = 64  # assumed: narrower blocks are all launch overhead on any device
MIN_STAND_IN_SEQ = 128  # assumed: as above, along the sequence
MIN_STAND_IN_VOCAB = 1024  # assumed: as above, along the vocabulary rows of the output projection


def block_forward_flops(shape: BlockShape) -> float:
    """Forward FLOPs of one block of ``shape``: projections, causal attention, the MLP or the routed + shared
    experts and the router (2 FLOPs per multiply-add; derived)."""
    tokens = shape.micro_batch * shape.seq_len
    q_dim, kv_dim = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    proj = 2 * tokens * shape.d_model * (2 * q_dim + 2 * kv_dim)
    sdpa = 2 * shape.micro_batch * shape.n_heads * shape.seq_len ** 2 * shape.head_dim  # QK^T + PV, causal half
    mats = 3 if shape.mlp == "swiglu" else 2
    if shape.moe:
        # (routed experts are SwiGLU whatever the model's MLP: ``ModelSpec.routed_expert_matrices``)
        routed = tokens // shape.moe_token_div  # (EP with whole experts under TP: the rank's share of the tokens)
        mlp = 2 * routed * shape.d_model * (3 * shape.top_k * shape.d_ff_expert + shape.n_experts)
        mlp += 2 * tokens * shape.d_model * mats * shape.d_ff_shared
    else:
        mlp = 2 * tokens * shape.d_model * mats * shape.d_ff
    return float(proj + sdpa + mlp)


def head_forward_flops(shape: HeadShape) -> float:
    """Forward FLOPs of the ends: the output projection's GEMM, tokens x d_model x local vocabulary rows (the
    embedding, the norm and the loss are memory traffic) [derived]."""
    return 2.0 * shape.micro_batch * shape.seq_len * shape.d_model * shape.vocab


@dataclass(frozen=True)
class StandIn:
    """The block (or ends) measured for ``full``: ``full`` itself (every divisor 1) or a smaller one (module
    docstring): d_model and the d_ffs divided by ``width_div``, the head counts by ``heads_div`` (<= width_div),
    the sequence by ``seq_div``; for the ends (``HeadShape``) d_model by ``width_div``, the vocabulary rows by
    ``heads_div``, the sequence by ``seq_div``."""

    full: BlockShape | HeadShape
    measured: BlockShape | HeadShape
    width_div: int = 1
    heads_div: int = 1
    seq_div: int = 1

    def __post_init__(self):
        heads_bound = isinstance(self.full, BlockShape) and self.heads_div > self.width_div
        if min(self.width_div, self.heads_div, self.seq_div) < 1 or heads_bound:
            raise ValueError(f"bad divisors {self.width_div}, {self.heads_div}, {self.seq_div}")

    @property
    def exact(self) -> bool:
        return self.width_div == 1 and self.heads_div == 1 and self.seq_div == 1

    def describe(self) -> str:
        """``measured``, or the stand-in's divisors: ``w/8 h/4 s/2`` (widths, heads or vocabulary, sequence)."""
        if self.exact:
            return "measured"
        h = "v" if isinstance(self.full, HeadShape) else "h"
        parts = [f"{n}/{d}" for n, d in (("w", self.width_div), (h, self.heads_div), ("s", self.seq_div)) if d > 1]
        return " ".join(parts)


def _shrunk(shape: BlockShape, w: int, h: int, r: int) -> BlockShape:
    return dataclasses.replace(shape, d_model=shape.d_model // w, n_heads=shape.n_heads // h,
                               n_kv_heads=shape.n_kv_heads // h, d_ff=shape.d_ff // w,
                               d_ff_expert=shape.d_ff_expert // w, d_ff_shared=shape.d_ff_shared // w,
                               seq_len=shape.seq_len // r)


def _widths_divide(shape: BlockShape, w: int) -> bool:
    dims = (shape.d_model, shape.d_ff, shape.d_ff_expert, shape.d_ff_shared)
    return all(x % w == 0 for x in dims) and shape.d_model // w >= MIN_STAND_IN_D_MODEL


def stand_in(shape: BlockShape, budget_flops: float) -> StandIn:
    """The block to measure for ``shape``: itself within ``budget_flops`` forward; else halve the widths with the
    head counts while the kv heads divide, then the widths alone (down to d_model 64), then the sequence (down to
    128 tokens), until within the budget or at the floor (then the smallest it got to)."""
    w = h = r = 1
    while block_forward_flops(_shrunk(shape, w, h, r)) > budget_flops:
        if _widths_divide(shape, 2 * w) and shape.n_kv_heads % (2 * h) == 0 and shape.n_heads % (2 * h) == 0:
            w, h = 2 * w, 2 * h
        elif _widths_divide(shape, 2 * w):
            w *= 2
        elif shape.seq_len % (2 * r) == 0 and shape.seq_len // (2 * r) >= MIN_STAND_IN_SEQ:
            r *= 2
        else:
            break
    return StandIn(shape, _shrunk(shape, w, h, r), w, h, r)


def head_stand_in(shape: HeadShape, budget_flops: float) -> StandIn:
    """The ends to measure for ``shape``: themselves within ``budget_flops`` forward; else halve the vocabulary
    rows (down to 1024), then d_model (down to 64), then the sequence (down to 128 tokens), until within the budget
    or at the floor."""
    w = v = r = 1

    def shrunk(w: int, v: int, r: int) -> HeadShape:
        return dataclasses.replace(shape, d_model=shape.d_model // w, vocab=shape.vocab // v,
                                   seq_len=shape.seq_len // r)

    while head_forward_flops(shrunk(w, v, r)) > budget_flops:
        if shape.vocab // (2 * v) >= MIN_STAND_IN_VOCAB:
            v *= 2
        elif shape.d_model % (2 * w) == 0 and shape.d_model // (2 * w) >= MIN_STAND_IN_D_MODEL:
            w *= 2
        elif shape.seq_len % (2 * r) == 0 and shape.seq_len // (2 * r) >= MIN_STAND_IN_SEQ:
            r *= 2
        else:
            break
    return StandIn(shape, shrunk(w, v, r), w, v, r)


def stand_ins_of(spec: ModelSpec, plans: list[Plan], budget_flops: float) -> dict[str, StandIn]:
    """{full shape key: StandIn} over the blocks and ends of ``plans`` (shapes a measurement cannot stand for are
    left out)."""
    out: dict[str, StandIn] = {}
    for plan in plans:
        for shape in plan_measured_shapes(spec, plan):
            if shape is not None and shape.key not in out:
                out[shape.key] = (head_stand_in(shape, budget_flops) if isinstance(shape, HeadShape)
                                  else stand_in(shape, budget_flops))
    return out


def with_stand_ins(hw: HardwareProfile, stand_ins: dict[str, StandIn]) -> HardwareProfile:
    """The profile whose ``measured_blocks`` hold, for every full shape, its own measurement or the stand-in
    estimate (module docstring); shapes whose block was not measured (float8 off a GPU) are left out."""
    blocks = dict(hw.measured_blocks)
    for key, s in stand_ins.items():
        m = hw.measured_blocks.get(s.measured.key)
        if m is None or s.exact:
            continue
        full, small = _composed(s.full, hw), _composed(s.measured, hw)
        blocks[key] = {**{f"{k}_s": m[f"{k}_s"] * full[k] / small[k] for k in full},
                       "stand_in_key": s.measured.key, "width_div": s.width_div, "heads_div": s.heads_div,
                       "seq_div": s.seq_div,
                       "device": m.get("device"), "torch": m.get("torch"), "measured_at": m.get("measured_at")}
    return dataclasses.replace(hw, measured_blocks=blocks)


def _composed(shape: BlockShape | HeadShape, hw: HardwareProfile) -> dict[str, float]:
    """Composed seconds of ``shape`` by the measured entry's parts (a block: fwd, bwd; the ends: emb_fwd, ...)."""
    if isinstance(shape, HeadShape):
        return composed_head_times(shape, hw)
    f, b = composed_block_times(shape, hw)
    return {"fwd": f, "bwd": b}


def candidates(res, k: int) -> list[tuple[Plan, float]]:
    """The top ``k`` plans of a search result and its Pareto plans, once each: [(plan, predicted step s)]."""
    seen: dict[str, tuple[Plan, float]] = {}
    for plan, step, *_ in list(res.top[:k]) + list(res.pareto):
        seen.setdefault(plan.plan_id, (plan, float(step)))
    return list(seen.values())


def rerank(spec: ModelSpec, hw_measured: HardwareProfile, plans: list[tuple[Plan, float]],
           stand_ins: dict[str, StandIn]) -> list[dict]:
    """One row per plan: its rank and step time on the curves (``hw_measured`` without any measured block, also
    those a profile was given with: a second ``--measure`` would otherwise show the same times in both columns)
    and with the measured blocks and ends, and which were measured how. Only plans whose every block and whose
    ends were measured (or stood in for) are re-ranked: a plan left on the curves (a shape a measurement cannot
    stand for: CP, MLA, learned positions, ...) would win or lose against measured ones by what the curves miss,
    not by how it runs; such plans follow, with ``measured_rank`` None."""
    rows: list[dict[str, Any]] = []
    hw_curves = dataclasses.replace(hw_measured, measured_blocks={})
    for plan, _ in plans:
        before, after = predict(spec, plan, hw_curves), predict(spec, plan, hw_measured)
        how = sorted({stand_ins[s.key].describe() if s is not None and s.key in hw_measured.measured_blocks
                      else "curves" for s in plan_block_shapes(spec, plan).values()})
        head = plan_head_shape(spec, plan)
        ends = (stand_ins[head.key].describe() if head is not None and head.key in hw_measured.measured_blocks
                else "curves")
        rows.append({"plan_id": plan.plan_id, "describe": plan.describe(), "ac": plan.ac, "plan": plan.to_dict(),
                     "curves_step_s": before.step_time_s, "measured_step_s": after.step_time_s,
                     "peak_memory_bytes": after.peak_memory_bytes, "blocks": ", ".join(how), "ends": ends})
    for i, row in enumerate(sorted(rows, key=lambda r: (r["curves_step_s"], r["plan_id"]))):
        row["curves_rank"] = i + 1
    measured = [r for r in rows if "curves" not in r["blocks"] and r["ends"] != "curves"]
    ranked = sorted(measured, key=lambda r: (r["measured_step_s"], r["plan_id"]))
    for i, row in enumerate(ranked):
        row["measured_rank"] = i + 1
    rest = sorted((r for r in rows if r not in measured), key=lambda r: r["curves_rank"])
    for row in rest:
        row["measured_rank"] = None
    return ranked + rest


def measure_and_rerank(spec: ModelSpec, hw: HardwareProfile, res, k: int, budget_flops: float,
                       measure_missing) -> dict:
    """The whole ``--measure K`` step: candidates of the search result ``res``, their stand-ins, the blocks the
    profile lacks measured by ``measure_missing(hw, shapes) -> (profile, {key: wall s})`` (which keeps them in the
    profile), the re-ranking. Returns {"rows", "profile" (with the stand-in estimates), "shapes", "stand_ins",
    "measured_now", "measurement_wall_s", "not_measurable"}."""
    plans = candidates(res, k)
    sins = stand_ins_of(spec, [p for p, _ in plans], budget_flops)
    hw_blocks, walls = measure_missing(hw, list(dict.fromkeys(s.measured for s in sins.values())))
    hw_measured = with_stand_ins(hw_blocks, sins)
    rows = rerank(spec, hw_measured, plans, sins)
    unmeasurable = sum(s is None for p, _ in plans for s in plan_measured_shapes(spec, p))
    return {"rows": rows, "profile": hw_measured, "shapes": len(sins),
            "stand_ins": sum(not s.exact for s in sins.values()), "measured_now": len(walls),
            "measurement_wall_s": sum(walls.values()), "not_measurable": unmeasurable}
