"""Step time, memory and communication of a batch of plans; ``predict`` for one plan.

Everything is computed per rank for two ranks, pipeline stage 0 (FIRST: embedding, most in-flight microbatches)
and the last stage (LAST: output layer and loss), which are the same rank without PP. The reported step time is
the larger of the two ranks' (the pipeline runs at the pace of its slowest stage) and the reported memory the
larger of their peaks; ``comm_bytes`` are rank 0's.

Time model (sums exactly to ``step_time_s``):

* compute: GEMMs at ``peak / eff(flops of the kernel)`` (roofline with the profile's fitted efficiency), attention
  forward at the attention curve, its backward 2.5x forward (FlashAttention-2 backward does 5 matmuls to the
  forward's 2, Dao 2023, arXiv:2307.08691), GEMM backward 2x forward (dgrad + wgrad), memory-bound kernels at
  the profile's fraction of HBM bandwidth (x ``compile_memory_bound_factor`` under torch.compile).
* recompute: full AC re-runs the layer forward; selective-op re-runs the mm's it does not save and the
  memory-bound kernels; AC wrapping compile (compile applied before AC) counts it twice (seed 000).
* TP, CP, EP collectives and PP send/recv are exposed (no async TP); FSDP all-gather overlaps with the previous
  layer's forward compute and reduce-scatter (+ HSDP all-reduce) with the next layer's backward compute; the
  first gather and last reduce of a round are exposed (FSDP2 implicit prefetching, one layer ahead).
* pipeline bubble per pass: ``(pp - 1) / v`` microbatch-times of the stage (Narayanan et al. 2021,
  arXiv:2104.04473, sec. 2.2: bubble fraction (p-1)/m for 1F1B/GPipe, divided by v for interleaving).
* optimizer: AdamW reads param, grad, exp_avg, exp_avg_sq (fp32) and writes three of them: 28 B/param, plus the
  gradient-norm read of 4 B/param, at HBM speed.
* measured corrections of the profile: ``compute_scale`` (ranks sharing cores) multiplies compute; the per-layer
  overheads of ``block_overheads`` (one real block timed by the profiler minus the model's time for it: dispatch,
  autograd and small-kernel costs) is added per layer and microbatch (selective AC recomputes half of it).

Memory (sums exactly to ``peak_memory_bytes``): the largest of five moments of the step, each itemized:
end of forward (activations of the in-flight microbatches, logits and loss), backward of the last layer (FSDP
unsharded params of two blocks and one block's gradient buffers, the recompute transient), with PP the backward
of a later microbatch (beside the gradients the first one accumulated), end of backward (the
embedding's dense full-vocabulary gradient on the first stage) and the optimizer step (one fp32 temporary per
parameter, foreach AdamW). All hold the sharded fp32 params and AdamW states.

What the framework's kernels keep is a plan option, not a factor: ``fused_loss`` (a fused cross-entropy: the
logits and one gradient of their size, 2 x param_dtype bytes per logit, against torch's 12 B/logit on an fp32 copy)
and ``te_layers`` (Megatron-Core's Transformer Engine layers: sequence-parallel norm outputs kept as local shards,
in float8 when float8 is on, and all-gathered again in the backward; fused SwiGLU / RoPE keeping their inputs only;
a vocab-parallel embedding whose gradient is its shard; see ``layers.saved_tensors``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from ..blockshape import block_shape, head_shape
from ..codec import DTYPES, PlanBatch, canonical_axes, canonical_key, encode, validate_plan
from ..hardware import HardwareProfile
from ..ordering import ac_wraps_compile_recompute_factor
from ..plan import AC_MODES, Plan, interval_group
from ..results import Prediction
from ..spec import ModelSpec
from . import comm as C
from .layers import (
    FIRST,
    LAST,
    Shapes,
    ac_counts,
    activation_bytes,
    activation_bytes_split,
    attention_flops,
    backward_steps,
    fsdp_shard,
    gemms,
    inflight,
    kept_by_ac_mode,
    last_param_elems,
    layer_tensors,
    rank_ckpt,
    rank_layers,
    saved_tensors,
    stage_bounds,
)
from .memory import MEMORY_KEYS, PHASES, Block, RankMemory, Unit, simulate
from .reserved import RESERVED_KEYS, reserved_breakdown

TIME_KEYS = ("compute_forward", "compute_backward", "recompute", "pp_bubble", "optimizer")
# [derived] AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (fp32: 7 x 4 B),
# plus the gradient-norm read (4 B)
ADAMW_BYTES_PER_PARAM = 28.0 + 4.0
# [public benchmark] FlashAttention-2 backward runs 5 matmuls to the forward's 2 (Dao 2023, arXiv:2307.08691)
ATTENTION_BWD_PER_FWD = 2.5
# [derived] a GEMM's backward is two GEMMs of its size (input gradient and weight gradient)
GEMM_BWD_PER_FWD = 2.0
# [assumed] memory-bound kernels: every non-GEMM tensor a layer saves is written once and read about twice; their
# backward moves about twice as much
MEMORY_TRAFFIC_PER_SAVED_BYTE = 3.0
MEMORY_BWD_PER_FWD = 2.0
# [public benchmark] float8 rowwise GEMMs run at 90-100% of tensorwise speed on most shapes, with a tail down to 50%
# (pytorch/pytorch#147971): the low end of the common range
ROWWISE_KERNEL_SPEED = 0.9
# [derived] the loss's fp32 traffic per logit: read bf16 logits, write / read the fp32 copy and log-softmax (16 B)
LOSS_BYTES_PER_LOGIT = 16.0
SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """One layer per microbatch (arrays over the plan batch): seconds forward, backward (without recompute),
    recomputed under full AC and under selective AC; activation bytes kept per AC mode ("none", "sac", "full") and
    split by sub-block (``act_split``: mode -> (attention, FFN)); the GEMMs' forward seconds."""

    fwd: Any
    bwd: Any
    rec_full: Any
    rec_sac: Any
    act: dict
    gemm_fwd: Any
    act_split: dict


@dataclasses.dataclass(frozen=True)
class RankCompute:
    """One rank per microbatch (arrays over the plan batch): seconds forward, backward and recomputed over its
    layers and ends; activation bytes kept; the largest recompute transient; its logits (elements); its GEMM
    seconds forward + backward; the per-kind ``LayerCosts`` it was summed from."""

    fwd: Any
    bwd: Any
    rec: Any
    act: Any
    transient: Any
    logits: Any
    gemm: Any
    costs: dict


class ComputeItem(NamedTuple):
    """One item of a layer's forward compute per microbatch (arrays over the plan batch)."""

    name: str
    kind: str  # gemm | attention | memory | overhead | wgrad_hp
    work: Any  # FLOPs (gemm, attention) or bytes (memory)
    efficiency: Any  # fraction of peak (or of bandwidth) reached
    seconds: Any
    recomputed_by_sac: bool  # selective AC recomputes it


def layer_compute_items(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, moe: bool,
                        overhead_fwd_s: float = 0.0) -> list[ComputeItem]:
    """Forward seconds of one layer and microbatch, itemized (``ComputeItem``). kind gemm (work in FLOPs,
    efficiency of one kernel of that size; float8 adds the casts), attention (FLOPs), memory (bytes of the
    memory-bound kernels), overhead (the profile's measured per-layer remainder). ``compute_scale`` (ranks sharing
    cores) is applied by the caller."""
    peak = compute_peak(hw, b)
    fp8_peak = hw.peak_flops.get("float8")
    mem_bw = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency
    items: list[ComputeItem] = []
    mm_count = 0
    wgrad_hp = np.zeros_like(sh.T)  # rowwise_with_gw_hp: extra backward seconds of weight gradients in bf16
    for name, flops, kernel_flops, io_elems, kind in gemms(spec, sh, moe):
        t = (flops / kernel_flops) * hw.gemm_efficiency.time_s(kernel_flops, peak)
        eff = hw.gemm_efficiency(kernel_flops)
        if fp8_peak and hw.float8_gemm_efficiency is not None:
            t_fp8 = (flops / kernel_flops) * hw.float8_gemm_efficiency.time_s(kernel_flops, fp8_peak)
            t_fp8 = t_fp8 / np.where(b.f8_recipe == 0, 1.0, ROWWISE_KERNEL_SPEED)
            # [derived] cast: read bf16 (2 B), write fp8 (1 B) per element; rowwise recipes quantize each operand
            # along both axes (the backward GEMMs scale along the other dimension), tensorwise reuses one scale
            casts = np.where(b.f8_recipe == 0, 1.0, 2.0)
            t_fp8 = t_fp8 + casts * 3.0 * io_elems / mem_bw
            wgrad_hp = wgrad_hp + np.where(b.float8 & (b.f8_recipe == 2), np.maximum(t - t_fp8, 0.0), 0.0)
            t = np.where(b.float8, t_fp8, t)
            eff = np.where(b.float8, hw.float8_gemm_efficiency(kernel_flops), eff)
        mm_count += kind == "mm"
        items.append(ComputeItem(name, "gemm", flops, eff, t, kind == "mm" and mm_count % 2 == 0))  # SAC: even mm's
    items.append(_attention_item(spec, b, sh, hw, peak))
    act = activation_bytes(spec, sh, moe)
    # memory-bound kernels: every non-GEMM tensor the layer saves is written once and read about twice
    mem_bytes = np.maximum(MEMORY_TRAFFIC_PER_SAVED_BYTE * (act["none"] - _gemm_output_bytes(spec, sh, moe)), 0.0)
    items.append(ComputeItem("memory-bound kernels (norms, RoPE, activations, residuals)", "memory", mem_bytes,
                             np.full_like(sh.T, hw.memory_efficiency),
                             mem_bytes / mem_bw * np.where(b.compile, hw.compile_memory_bound_factor, 1.0), True))
    # fixed per-layer costs the FLOP/byte terms miss (block_overheads: measured block - model; 0 without one)
    items.append(ComputeItem("per-layer overhead (measured block - model)", "overhead", np.zeros_like(sh.T),
                             np.ones_like(sh.T), np.full_like(sh.T, overhead_fwd_s), False))
    # backward only: the weight-gradient GEMMs that rowwise_with_gw_hp runs in bf16 instead of float8
    items.append(ComputeItem("weight gradients in bf16 (float8 rowwise_with_gw_hp; backward only)", "wgrad_hp",
                             np.zeros_like(sh.T), np.ones_like(sh.T), wgrad_hp, False))
    return items


def _attention_item(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, peak) -> ComputeItem:
    """The causal attention core of one layer. With ``attention_keys_efficiency`` (spec-sheet GPU profiles) the
    efficiency follows the keys one kernel attends to: FlashAttention's published throughput grows with sequence
    length at a fixed token count (FA2 forward+backward on H100, hd 128, causal: 163 TFLOP/s at 512 keys, 294 at
    4k, 328 at 16k), which a FLOP-indexed curve cannot express (a 64k-token batch of 512-token sequences has the
    FLOPs of a 4k-token batch of 4k-token sequences). Under CP, torchtitan's ring attention runs ``cp`` kernels of
    ``seq / cp`` keys each. Plans on Transformer Engine layers (``te_layers``) run TE's attention, on Hopper cuDNN's
    fused kernel: the curve's efficiency times the profile's ``fused_attention_speedup`` (capped at 1)."""
    a_flops = attention_flops(spec, sh)
    if hw.attention_keys_efficiency is None:
        eff, t = hw.attention_efficiency(a_flops), hw.attention_efficiency.time_s(a_flops, peak)
    else:
        eff = hw.attention_keys_efficiency(sh.seq / b.cp)
        t = a_flops / (eff * peak)
    boost = np.where(b.te, np.minimum(hw.fused_attention_speedup, 1.0 / np.maximum(eff, 1e-12)), 1.0)
    return ComputeItem("attention (causal)", "attention", a_flops, eff * boost, t / boost, False)


def compute_peak(hw: HardwareProfile, b: PlanBatch) -> np.ndarray:
    """Peak FLOP/s of each plan's compute dtype: FSDP mixed precision (and autocast) run GEMMs and attention in
    ``param_dtype`` — bf16 at its tensor-core peak, fp32 plans at the profile's float32 peak (a CPU without bf16
    instructions: 98.8 GFLOP/s fp32 vs 2.3 GFLOP/s bf16 measured on this machine). MFU stays relative to the
    bf16 peak, as published figures are."""
    bf16 = hw.peak("bfloat16")
    fp32 = float(hw.peak_flops.get("float32", bf16))
    return np.where(b.param_bytes >= 4, fp32, bf16).astype(float)


def block_overheads(hw: HardwareProfile) -> tuple[float, float]:
    """(forward, backward) seconds per layer and microbatch that the FLOP/byte terms miss (dispatch, autograd,
    small kernels): the profile's raw block sample — one real block of ``samples.block.model`` timed forward and
    forward + backward by the profiler, one process, ``compute_scale`` 1 — minus this model's time for the same
    block, floored at 0. Derived at predict time, so a profile holds only measurements and never goes stale when a
    formula changes. Profiles that carry ``corrections.layer_overhead_*`` (written before) use those as they are."""
    c = hw.corrections
    if "layer_overhead_fwd_s" in c:
        return float(c["layer_overhead_fwd_s"]), float(c.get("layer_overhead_bwd_s", 0.0))
    block = hw.samples.get("block") if isinstance(hw.samples, dict) else None
    if not block:
        return 0.0, 0.0
    from ..spec import load_model

    spec = load_model(block["model"])
    dtype = block["dtype"] if block["dtype"] in ("float32", "bfloat16") else "bfloat16"
    plan = Plan(seq_len=block["seq_len"], local_batch_size=max(1, block["tokens"] // block["seq_len"]),
                param_dtype=dtype)
    b = encode([plan], hw.gpus_per_node)
    cost = _layer_costs(spec, b, Shapes(spec, b), hw, spec.is_moe_layer(0), overheads=(0.0, 0.0), compute_scale=1.0)
    fwd = max(0.0, block["time_fwd_s"] - float(cost.fwd[0]))
    bwd = max(0.0, (block["time_fwd_bwd_s"] - block["time_fwd_s"]) - float(cost.bwd[0]))
    return fwd, bwd


def _layer_costs(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, moe: bool,
                 overheads: tuple[float, float] = (0.0, 0.0), compute_scale: float | None = None,
                 times: bool = True) -> LayerCosts:
    """Per layer and microbatch: forward/backward/recompute seconds and activation bytes. Backward: GEMMs 2x
    forward (dgrad + wgrad), attention 2.5x (FlashAttention-2), memory-bound 2x, the measured backward overhead;
    selective AC recomputes the even mm's, the memory-bound kernels and half the forward overhead. Without
    ``times`` (memory only) the seconds are zeros."""
    if not times:
        z = np.zeros_like(sh.T)
        return LayerCosts(z, z, z, z, activation_bytes(spec, sh, moe), z, activation_bytes_split(spec, sh, moe))
    if compute_scale is None:
        compute_scale = float(hw.corrections.get("compute_scale", 1.0))
    items = layer_compute_items(spec, b, sh, hw, moe, overheads[0])
    by_kind = {k: sum((it.seconds for it in items if it.kind == k), np.zeros_like(sh.T))
               for k in ("gemm", "attention", "memory", "overhead", "wgrad_hp")}
    sac_t = sum((it.seconds for it in items if it.recomputed_by_sac and it.kind == "gemm"), np.zeros_like(sh.T))
    ovb = overheads[1]
    fwd = (by_kind["gemm"] + by_kind["attention"] + by_kind["memory"] + by_kind["overhead"]) * compute_scale
    bwd = (GEMM_BWD_PER_FWD * by_kind["gemm"] + by_kind["wgrad_hp"] + ATTENTION_BWD_PER_FWD * by_kind["attention"]
           + MEMORY_BWD_PER_FWD * by_kind["memory"] + ovb) * compute_scale
    sac = (sac_t + by_kind["memory"] + 0.5 * by_kind["overhead"]) * compute_scale
    measured = measured_block_times(spec, b, hw, moe)
    if measured is not None:  # a block measured at the row's local shape replaces the composed curves
        m_fwd, m_bwd, have = measured
        sac = np.where(have, sac * m_fwd * compute_scale / np.maximum(fwd, 1e-30), sac)  # same selective share
        fwd = np.where(have, m_fwd * compute_scale, fwd)
        bwd = np.where(have, m_bwd * compute_scale, bwd)
    return LayerCosts(fwd=fwd, bwd=bwd, rec_full=fwd, rec_sac=sac, act=activation_bytes(spec, sh, moe),
                      gemm_fwd=by_kind["gemm"] * compute_scale, act_split=activation_bytes_split(spec, sh, moe))


def measured_block_times(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, moe: bool
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(forward s, backward s, measured?) of one layer and microbatch per plan, from the profile's blocks measured
    at the plan's local shape (``parsim.blockshape``; the backward without recompute: AC's recompute is the
    forward, or its selective share). None when the profile has none. Plans are grouped by the fields a shape
    depends on, so a batch of a million plans looks up a handful of shapes."""
    if not hw.measured_blocks:
        return None
    cols = np.stack([b.tp, b.ep, b.etp_eff, b.micro_batch_size, b.seq_len, b.cp, b.param_bytes,
                     b.compile, b.float8], axis=1).astype(np.int64)
    uniq, inv = np.unique(cols, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    fwd, bwd, have = np.zeros(len(cols)), np.zeros(len(cols)), np.zeros(len(cols), dtype=bool)
    for i, (tp, ep, etp, mb, seq, cp, pbytes, comp, f8) in enumerate(uniq.tolist()):
        shape = block_shape(spec, moe, tp=tp, ep=ep, etp=etp, micro_batch=mb, seq_len=seq, cp=cp,
                            dtype="float32" if pbytes >= 4 else "bfloat16", compile=bool(comp), float8=bool(f8))
        m = hw.measured_blocks.get(shape.key) if shape is not None else None
        if m:
            sel = inv == i
            fwd[sel], bwd[sel], have[sel] = m["fwd_s"], m["bwd_s"], True
    return fwd, bwd, have


def measured_head_times(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile) -> dict | None:
    """Per microbatch and plan, from the profile's measured ends (``blockshape.HeadShape``): the token embedding's
    forward / backward (``emb_fwd`` / ``emb_bwd``), the final norm + output projection + loss's (``out_fwd`` /
    ``out_bwd``), and ``have`` (measured?). None when the profile has no measured heads."""
    if not any(k.startswith("head|") for k in hw.measured_blocks):
        return None
    cols = np.stack([b.tp, b.micro_batch_size, b.seq_len, b.cp, b.param_dtype, b.fused_loss], axis=1).astype(np.int64)
    uniq, inv = np.unique(cols, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    out = {k: np.zeros(len(cols)) for k in ("emb_fwd", "emb_bwd", "out_fwd", "out_bwd")}
    out["have"] = np.zeros(len(cols), dtype=bool)
    for i, (tp, mb, seq, cp, dt, fused) in enumerate(uniq.tolist()):
        shape = head_shape(spec, tp=tp, micro_batch=mb, seq_len=seq, cp=cp, dtype=DTYPES[dt], fused_loss=bool(fused))
        m = hw.measured_blocks.get(shape.key) if shape is not None else None
        if m:
            sel = inv == i
            for k in ("emb_fwd", "emb_bwd", "out_fwd", "out_bwd"):
                out[k][sel] = m[k + "_s"]
            out["have"][sel] = True
    return out


def _gemm_output_bytes(spec, sh, moe):
    """Bytes of the saved tensors that GEMMs write (excluded from the memory-bound estimate)."""
    out = np.zeros_like(sh.T)
    for name, nbytes, kind in saved_tensors(spec, sh, moe):
        if kind in ("mm", "gmm", "sdpa") and not (name.endswith("wo.out") or name.endswith("w2.out")):
            out = out + nbytes
    return out


def evaluate(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, detail: bool = False,
             memory_only: bool = False, time_bound: bool = False, above_bytes: float = math.inf) -> dict:
    """Evaluate every plan of ``b``. Returns arrays: step_time_s, peak_memory_bytes, fits, tokens_per_s_per_gpu,
    mfu, peak_rank (0 = first stage, 1 = last), and with ``detail`` the breakdowns, comm bytes and times, and the
    two ranks' ledgers. ``memory_only``: only peak_memory_bytes, without the collectives and step time (what
    search's memory screen needs; the same numbers as the full evaluation). ``above_bytes`` (with
    ``memory_only``): a plan whose parameters, optimizer states and gradients alone (``_static_bytes``, a lower
    bound of its peak) exceed it is not replayed on the timeline, its peak given as at least that bound (it does
    not fit either way). ``time_bound``: only ``step_time_lower_bound_s`` (``_time_lower_bound``), without the
    collectives and memory."""
    sh = Shapes(spec, b)
    layers = rank_layers(spec, b.pp, b.v)
    kinds = [k for k in (False, True) if (spec.n_moe_layers if k else spec.n_dense_layers) > 0]
    overheads = block_overheads(hw)
    costs = {k: _layer_costs(spec, b, sh, hw, k, overheads, times=not memory_only) for k in kinds}
    plocal, pshard = layer_params(spec, b, kinds)
    per_rank: list = []
    for rank in (FIRST, LAST):
        rv = _rank_view(spec, b, rank, layers, kinds, plocal, pshard)
        if time_bound:
            c = _rank_compute(spec, b, sh, hw, rv, costs)
            per_rank.append(_time_lower_bound(b, hw, c, _rank_params(b, rv)[1], rv.n_tensors))
        elif memory_only:
            c = _rank_compute(spec, b, sh, hw, rv, costs)
            phases, _ = _rank_memory(spec, b, sh, rank, rv, c, above_bytes)
            pk = _rank_peak(b, sh, hw, rv, c, phases)
            static = _static_bytes(b, rv)
            per_rank.append({k: np.where(static > above_bytes, np.maximum(pk[k], static), pk[k])
                             for k in ("mem", "reserved")})
        else:
            per_rank.append(_evaluate_rank(spec, b, sh, hw, rank, rv, costs))
    if time_bound:
        return {"step_time_lower_bound_s": np.maximum(per_rank[0], per_rank[1])}
    if memory_only:
        return {"peak_memory_bytes": np.maximum(per_rank[0]["mem"], per_rank[1]["mem"]),
                "reserved_memory_bytes": np.maximum(per_rank[0]["reserved"], per_rank[1]["reserved"])}
    return _combine(spec, b, hw, per_rank, detail)


def _rank_params(b: PlanBatch, rv: C.RankView) -> tuple:
    """(parameters a rank holds after FSDP sharding, those whose optimizer step it runs: 1/dp_replicate of them
    under the distributed optimizer)."""
    p_shard = rv.edge_shard + sum(rv.n_of[k] * (rv.pshard[k][0] + rv.pshard[k][1]) for k in rv.kinds)
    return p_shard, p_shard / np.where(b.zero1, b.dp_replicate, 1)


def _static_bytes(b: PlanBatch, rv: C.RankView) -> np.ndarray:
    """A lower bound of a rank's peak [derived]: at the optimizer step it holds its fp32 parameters and two Adam
    states (12 B per parameter it steps) and every fp32 gradient of its shard (4 B per parameter it holds)."""
    p_shard, p_opt = _rank_params(b, rv)
    return p_opt * 12.0 + p_shard * 4.0


def _rank_memory(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute,
                 above_bytes: float = math.inf) -> tuple:
    """(the memory moments of one rank, the parameters whose optimizer step it runs). Parameters held before
    FSDP sharding (non-expert, expert), per rank after it, and 1/dp_replicate of those under the distributed
    optimizer. Plans whose ``_static_bytes`` exceed ``above_bytes`` keep the coarse moments (``evaluate``)."""
    ne_local = rv.emb_local + rv.out_local + sum(rv.n_of[k] * rv.plocal[k][0] for k in rv.kinds)
    ex_local = sum(rv.n_of[k] * rv.plocal[k][1] for k in rv.kinds)
    p_shard, p_opt = _rank_params(b, rv)
    # what FSDP2's all-gathers hold unsharded: each unit's padded shards times the shard group
    gathered = {"blocks": sum(rv.n_of[k] * (b.fsdp * rv.pshard[k][0] + b.efsdp * rv.pshard[k][1]) for k in rv.kinds),
                "emb": b.fsdp * rv.emb_shard, "out": b.fsdp * (rv.norm_shard + rv.outw_shard)}
    timed = (b.v == 1) & (_static_bytes(b, rv) <= above_bytes)
    if timed.all():  # the step's timeline (costmodel/memory.py)
        return _timeline_phases(spec, b, sh, rank, rv, c, p_shard, p_opt, timed), p_opt
    # interleaved plans (and those the search screen bounds) keep the coarse moments for now
    phases = _memory_phases(spec, b, sh, rank, rv, c, ne_local, ex_local, p_shard, p_opt, gathered)
    if timed.any():
        tl = _timeline_phases(spec, b, sh, rank, rv, c, p_shard, p_opt, timed)
        z = np.zeros(len(b))
        phases = {ph: {k: np.where(timed, tl[ph][k], phases[ph].get(k, z)) for k in MEMORY_KEYS} for ph in PHASES}
    return phases, p_opt


def _timeline_phases(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute, p_shard,
                     p_opt, rows: np.ndarray) -> dict:
    """The phases of ``rows`` from the step's timeline (``memory.simulate``), grouped by the structure of the
    rank's blocks (their kinds, and which ``layer:N`` AC checkpoints)."""
    n = len(b)
    out = {ph: {k: np.zeros(n) for k in MEMORY_KEYS} for ph in PHASES}
    layer_mode = b.ac == AC_MODES["layer"]
    every = np.where(layer_mode, np.maximum(b.ac_every, 1), 0)
    before = np.array([o.index("ac") < o.index("pp") for o in b.wrapper_orders] or [False])[b.wrapper_idx]
    keys = np.stack([b.pp, b.v, every, before & layer_mode], axis=1)
    uniq, inv = np.unique(keys[rows], axis=0, return_inverse=True)
    rows_idx = np.nonzero(rows)[0]
    # memory does not depend on the device order, compile, async TP, or float8 outside TE layers (its recipe not
    # at all): one simulation per plan that differs in anything else
    same = np.stack([np.asarray(getattr(b, f.name), dtype=float) for f in dataclasses.fields(b)
                     if f.name not in _NOT_MEMORY and isinstance(getattr(b, f.name), np.ndarray)]
                    + [np.asarray(b.float8 & b.te, dtype=float)], axis=1)
    steps = {moe: (backward_steps(spec, b, sh, moe), saved_tensors(spec, sh, moe)) for moe in rv.kinds}
    for g, (pp, v, k, bp) in enumerate(uniq):
        idx = rows_idx[np.ravel(inv) == g]
        _, first, back = np.unique(same[idx], axis=0, return_index=True, return_inverse=True)
        runs = _block_runs(spec, int(pp), int(v), rank, int(k), bool(bp))
        q = _rank_memory_inputs(spec, b, sh, rank, rv, c, p_shard, p_opt, idx[first], runs, steps)
        res = simulate(q)
        for ph in PHASES:
            for name in MEMORY_KEYS:
                out[ph][name][idx] = res[ph][name][np.ravel(back)]
    return out


_NOT_MEMORY = ("mesh_idx", "compile", "async_tp", "float8", "f8_recipe")


def _block_runs(spec: ModelSpec, pp: int, v: int, rank: int, every: int, before_pp: bool
                ) -> list[tuple[bool, bool, int]]:
    """The rank's blocks in forward order as runs (MoE?, checkpointed by ``layer:every``?, count); ``every`` 0: no
    ``layer:N`` AC (torchtitan's count: from 1 over this process's blocks, or over the model's when AC comes before
    the PP split, ``layers._rank_ckpt``)."""
    n_stages = pp * v
    bounds = stage_bounds(spec.n_layers, n_stages)
    r = 0 if rank == FIRST else pp - 1
    blocks = [i for st in range(r, n_stages, pp) for i in range(bounds[st], bounds[st + 1])]
    runs: list[list] = []
    for j, i in enumerate(blocks):
        item = (spec.is_moe_layer(i), every > 0 and ((i if before_pp else j) + 1) % every == 0)
        if runs and tuple(runs[-1][:2]) == item:
            runs[-1][2] += 1
        else:
            runs.append([*item, 1])
    return [tuple(r) for r in runs]


def _memory_unit(shard, local, s, last, pb, gb, rb) -> Unit:
    """An FSDP unit's sizes for ``memory.simulate``: gathered params, unsharded grads, the reduce-scatter's
    input, its output, the fp32 sharded grad, and the last gradient ``foreach_reduce`` keeps (``linger``: only over a
    shard group of 2+, the loop runs only there)."""
    linger = np.where(s > 1, last, 0.0)
    return Unit(s * shard * pb, local * gb, s * shard * rb, shard * rb, shard * 4.0, local * rb,
                linger * gb, linger * rb)


def _memory_block(spec: ModelSpec, b: PlanBatch, rv: C.RankView, costs: dict, idx: np.ndarray, moe: bool,
                  ckpt: bool, steps_of: dict, sizes: tuple) -> Block:
    """One block kind (dense or MoE; checkpointed by ``layer:N`` or not) of the plans ``idx``: its FSDP units,
    the activations each AC mode keeps, the transient of its recompute, its backward steps and saved tensors."""
    pb, gb, rb, S, Se, ep1 = sizes
    ne_s, ex_s = (np.asarray(x)[idx] for x in rv.pshard[moe])
    ne_l, ex_l = (np.asarray(x)[idx] for x in rv.plocal[moe])
    a = {m: (np.asarray(v[0])[idx], np.asarray(v[1])[idx]) for m, v in costs[moe].act_split.items()}
    full = (b.ac[idx] == AC_MODES["full"]) | ((b.ac[idx] == AC_MODES["layer"]) & ckpt)
    sac = b.ac[idx] == AC_MODES["selective-op"]
    act_attn, act_ffn = (np.where(full, a["full"][k], np.where(sac, a["sac"][k], a["none"][k])) for k in (0, 1))
    transient = a["none"][0] + a["none"][1] - act_attn - act_ffn
    last_blk, last_ex = (x[idx] for x in last_param_elems(spec, b, moe))
    blk_unit = _memory_unit(ne_s + np.where(ep1, ex_s, 0.0), ne_l + np.where(ep1, ex_l, 0.0), S, last_blk, pb, gb,
                            rb)
    experts = (_memory_unit(np.where(ep1, 0.0, ex_s), np.where(ep1, 0.0, ex_l), Se, last_ex, pb, gb, rb)
               if moe else None)

    def sel(x):
        return np.broadcast_to(np.asarray(x, dtype=float), (len(b),))[idx]

    all_steps, items = steps_of[moe]
    steps = [{"alloc": sel(st["alloc"]), "free": sel(st["free"]), "saved": st["saved"], "cast": st["cast"],
              "pgrad": (sel(st["pgrad"][0]), sel(st["pgrad"][1]))} for st in all_steps]
    keep = kept_by_ac_mode(items)
    saved = {name: np.asarray(nb)[idx] * 1.0 for (name, nb, _), kk in zip(items, keep, strict=True) if kk["none"]}
    return Block(blk_unit, experts, act_attn + act_ffn, transient, act_ffn, steps, saved, gb)


def _rank_memory_inputs(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute, p_shard,
                        p_opt, idx: np.ndarray, runs: list, steps_of: dict) -> RankMemory:
    """The sizes ``memory.simulate`` replays, for the plans ``idx`` (bytes). ``steps_of``: per block kind, its
    backward steps and saved tensors over the whole batch (``layers.backward_steps``, ``layers.saved_tensors``)."""
    pb, rb = b.param_bytes[idx].astype(float), b.reduce_bytes[idx].astype(float)
    fsdp_on = (b.dp_replicate * b.dp_shard * b.cp > 1)[idx]
    gb = np.where(fsdp_on, pb, 4.0)  # unsharded gradients: param dtype under FSDP, the fp32 parameters' without
    S, Se = b.fsdp[idx].astype(float), b.efsdp[idx].astype(float)
    sizes = (pb, gb, rb, S, Se, (b.ep == 1)[idx])

    def unit(shard, local, s, last) -> Unit:
        return _memory_unit(shard, local, s, last, pb, gb, rb)

    has_emb, has_out = rv.has_emb[idx], rv.has_out[idx]
    blocks = []
    built: dict = {}  # (MoE?, checkpointed?) -> Block: runs of the same kind share one (and its replay caches)
    for moe, ckpt, count in runs:
        if (moe, ckpt) not in built:
            built[moe, ckpt] = _memory_block(spec, b, rv, c.costs, idx, moe, ckpt, steps_of, sizes)
        blocks.append((built[moe, ckpt], count))
    emb_local = np.asarray(rv.emb_local)[idx]
    V, d = spec.vocab_size, float(spec.d_model)
    # the embedding backward's dense gradient over the whole vocabulary (torch's embedding backward, also under
    # RowwiseParallel), its vocab shard under TE layers (Megatron's VocabParallelEmbedding)
    emb_dense = np.where(has_emb, np.where(b.te[idx], emb_local, V * d) * gb, 0.0)
    rope = float(spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim)
    buffers = b.seq_len[idx].astype(float) * rope * 4.0 * np.where(b.pp[idx] > 1, b.v[idx], 1)  # RoPE cos / sin
    # what a microbatch in flight keeps beside its blocks' activations: its stage output (the residual stream,
    # sent on and kept by the schedule until its backward), or on the last stage the loss's saved tensors (the
    # fp32 log-softmax output, 4 B per logit; the fused loss: the logits) and the final norm's input and output
    stage_out = (np.asarray(sh.T) * spec.d_model / np.asarray(sh.sp_div) * np.asarray(sh.res_b))[idx]
    act_b = np.asarray(sh.act_b)[idx]
    per_logit_saved = np.where(b.fused_loss[idx], act_b, 4.0)
    loss_saved = (np.asarray(c.logits)[idx] * per_logit_saved
                  + np.asarray(sh.T)[idx] * spec.d_model * act_b * (1.0 + 1.0 / np.asarray(sh.sp_div)[idx]))
    m = b.n_micro[idx].astype(float)
    w = np.asarray(inflight(b, rank))[idx] * np.where(b.pp[idx] > 1, 1.0, 0.0) + np.where(b.pp[idx] > 1, 0.0, 1.0)
    m = np.where(b.pp[idx] > 1, m, 1.0)
    # without FSDP a vocab-sharded (TP) embedding's gradient is a view of the dense whole-vocabulary gradient its
    # backward made: that storage stays (with FSDP, FSDP2 copies the rank's rows out)
    all_grads4 = np.asarray(p_shard)[idx] * 4.0 + np.where(~fsdp_on & has_emb & (b.tp[idx] > 1) & ~b.te[idx],
                                                           (V * d - emb_local) * 4.0, 0.0)
    return RankMemory(
        n=len(idx), parameters=np.asarray(p_opt)[idx] * 4.0, optimizer_states=np.asarray(p_opt)[idx] * 8.0,
        buffers=buffers, all_grads4=all_grads4, fsdp=fsdp_on, raf=b.raf[idx],
        raf_out=b.raf_always[idx], acc=(b.grad_accum > 1)[idx], has_emb=has_emb, has_out=has_out,
        emb=unit(np.asarray(rv.emb_shard)[idx], emb_local, S, emb_local), emb_dense_grad=emb_dense,
        emb_sharded=(b.tp > 1)[idx] & ~b.te[idx],
        out=unit(np.asarray(rv.norm_shard + rv.outw_shard)[idx], np.asarray(rv.out_local)[idx], S,
                 np.asarray(rv.out_local - rv.norm_local)[idx] * np.ones(len(idx))),
        loss=np.asarray(_loss_bytes(spec, b, sh, rv, c))[idx] * np.ones(len(idx)),
        blocks=blocks, opt_temporaries=np.asarray(p_opt)[idx] * 4.0, flat_held=S > 1,
        hsdp=(b.dp_replicate > 1)[idx], reduce_bytes=rb, flow=stage_out,
        pp=(b.pp > 1)[idx], m=m, w=w, w_later=np.where(m > w, w, np.maximum(w - 1.0, 1.0)),
        mb_extra=np.where(has_out, loss_saved, np.where((b.pp > 1)[idx], stage_out, 0.0)),
        autocast_cache=_autocast_cache(spec, b, rv, idx, fsdp_on),
        param_bytes=pb, out_weight4=np.asarray(rv.out_local - rv.norm_local)[idx] * 4.0 * np.ones(len(idx)),
        last_cast4=_last_cast_elems(spec, b, runs[-1][0] if runs else False)[idx] * 4.0)


def _last_cast_elems(spec: ModelSpec, b: PlanBatch, moe: bool) -> np.ndarray:
    """Elements of the last linear weight a block uses in forward (the last weight autocast casts on a stage
    without the output projection): the MLP's w2; a MoE layer's shared experts' w2, else its router."""
    by_name = {name: rows * per_row for name, rows, per_row, _ in layer_tensors(spec, b, moe)}
    if not moe:
        return by_name["w2"] * np.ones(len(b))
    assert spec.moe is not None
    return (by_name["shared.w2"] if spec.moe.n_shared_experts else by_name["router"]) * np.ones(len(b))


def _autocast_cache(spec: ModelSpec, b: PlanBatch, rv: C.RankView, idx: np.ndarray, fsdp_on) -> np.ndarray:
    """Without FSDP a bf16 / fp16 plan runs under torch.autocast (as torchtitan does), which caches the cast copy
    of every linear weight (and bias) it multiplies — attention and MLP linears, the router, the shared experts, the
    output projection; not norms, the embedding or the stacked experts (views, not leaves) — from its first use to
    the end of the region [derived from torch's autocast weight cache; trace]."""
    pb = b.param_bytes[idx].astype(float)
    on = ~fsdp_on & (pb < 4.0)
    total = np.zeros(len(idx))
    for k in rv.kinds:
        lin = sum((rows * per_row for name, rows, per_row, expert in layer_tensors(spec, b, k)
                   if not expert and "norm" not in name), np.zeros(len(b)))
        total = total + (rv.n_of[k] * lin)[idx]
    outw = np.asarray(rv.out_local - rv.norm_local)[idx] * np.ones(len(idx))
    return np.where(on, (total + outw) * pb, 0.0)


def _loss_bytes(spec: ModelSpec, b: PlanBatch, sh: Shapes, rv: C.RankView, c: RankCompute):
    """The loss's peak on the last stage, bytes: bf16 logits + fp32 copy + fp32 log-softmax = 10 B/logit at the
    end of forward under loss parallel (its peak); plain cross-entropy (tp = 1) peaks in its backward with the
    log-softmax output, the nll gradient and the log-softmax gradient alive (fp32 each): 12 B/logit (both read
    off the live storages at the peak of executor traces). Plus the final norm's input and gathered output. An fp32
    plan has no separate fp32 copy of its logits: 8 B/logit under loss parallel [derived from the bf16 case]. A
    fused cross-entropy keeps the logits and writes one gradient of their size (param_dtype each) [derived;
    full-scale trace of the executor's fused loss: test_trace_of_the_loss_matches_the_model]."""
    d = spec.d_model
    per_logit = np.where(b.fused_loss, 2.0 * sh.act_b,
                         np.where(b.tp > 1, sh.act_b + np.where(sh.act_b < 4, 4.0, 0.0) + 4.0, 12.0))  # [measured]
    return np.where(rv.has_out, c.logits * per_logit + sh.T * d * sh.act_b * (1.0 + 1.0 / sh.sp_div), 0.0)


def layer_params(spec: ModelSpec, b: PlanBatch, kinds: list) -> tuple[dict, dict]:
    """Per layer kind: (non-expert, routed-expert) parameters a rank holds after TP / EP, and its FSDP2 shards of
    them (padded per tensor, ``layers.fsdp_shard``; routed experts over efsdp)."""
    plocal, pshard = {}, {}
    for k in kinds:
        ne = ex = ne_s = ex_s = np.zeros(len(b))
        for _name, rows, per_row, expert in layer_tensors(spec, b, k):
            if expert:
                ex, ex_s = ex + rows * per_row, ex_s + fsdp_shard(rows, per_row, b.efsdp)
            else:
                ne, ne_s = ne + rows * per_row, ne_s + fsdp_shard(rows, per_row, b.fsdp)
        plocal[k], pshard[k] = (ne, ex), (ne_s, ex_s)
    return plocal, pshard


def _rank_view(spec: ModelSpec, b: PlanBatch, rank: int, layers: dict, kinds: list, plocal: dict,
               pshard: dict) -> C.RankView:
    """What one rank holds: its layers of each kind, and the embedding, final norm and output parameters (after
    TP, and their FSDP shards). Under TP the vocabulary is sharded like ``torch.chunk``: the rank the model
    describes (TP coordinate 0) holds ``ceil(V / tp)`` rows."""
    n = len(b)
    t = b.tp.astype(float)
    V, d = spec.vocab_size, float(spec.d_model)
    S = b.fsdp
    has_emb = np.ones(n, bool) if rank == FIRST else b.pp == 1
    has_out = b.pp == 1 if rank == FIRST else np.ones(n, bool)
    n_of = {False: layers["dense"][rank].astype(float), True: layers["moe"][rank].astype(float)}
    v_rows = np.ceil(V / t)
    P = float(spec.max_position_embeddings)
    emb_local = np.where(has_emb, v_rows * d + P * d, 0.0)
    emb_shard = np.where(has_emb, fsdp_shard(v_rows, d, S) + (fsdp_shard(P, d, S) if P else 0.0), 0.0)
    norms = 2.0 if spec.norm == "layernorm" else 1.0
    norm_local = np.where(has_out, norms * d, 0.0)
    norm_shard = np.where(has_out, norms * fsdp_shard(d, 1.0, S), 0.0)
    # a tied output projection needs its own copy of the embedding on the last stage when pp > 1
    own_out = (b.pp > 1) | (not spec.tie_embeddings)
    outw_local = np.where(has_out & own_out, v_rows * d, 0.0)
    outw_shard = np.where(has_out & own_out, fsdp_shard(v_rows, d, S), 0.0)
    ckpt = rank_ckpt(spec, b)
    n_ckpt = {k: ckpt[k][rank].astype(float) for k in (False, True)}
    n_tensors = (sum(n_of[k] * len(layer_tensors(spec, b, k)) for k in kinds)
                 + np.where(has_emb, 1.0 + (P > 0), 0.0) + np.where(has_out, norms + own_out, 0.0))
    return C.RankView(n_of, kinds, plocal, has_emb, has_out, emb_local, outw_local + norm_local, pshard=pshard,
                      emb_shard=emb_shard, norm_local=norm_local, norm_shard=norm_shard, outw_shard=outw_shard,
                      n_ckpt=n_ckpt, n_tensors=n_tensors)


def _rank_compute(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, rv: C.RankView,
                  costs: dict) -> RankCompute:
    """Per microbatch on one rank: forward, backward, recompute seconds; activation bytes kept per microbatch;
    the largest recompute transient; the output layer and loss on the last stage (GEMM T x d x V/tp, fp32
    cross-entropy traffic of 16 B/logit), or, where the profile measured the model's ends at the plan's shape
    (``measured_head_times``), their measured times and the embedding's on the first stage."""
    n = len(b)
    fwd = sum(rv.n_of[k] * costs[k].fwd for k in rv.kinds)
    bwd = sum(rv.n_of[k] * costs[k].bwd for k in rv.kinds)
    gemm = sum(rv.n_of[k] * costs[k].gemm_fwd for k in rv.kinds) * (1.0 + GEMM_BWD_PER_FWD)
    rec, act, transient = np.zeros(n), np.zeros(n), np.zeros(n)
    for k in rv.kinds:
        c = costs[k]
        n_full, n_sac, n_none = ac_counts(b, rv.n_of[k], rv.n_ckpt[k])
        rec = rec + n_full * c.rec_full + n_sac * c.rec_sac
        act = act + n_full * c.act["full"] + n_sac * c.act["sac"] + n_none * c.act["none"]
        tr = np.where(n_full > 0, c.act["none"] - c.act["full"], np.where(n_sac > 0, c.act["none"] - c.act["sac"], 0.0))
        transient = np.maximum(transient, tr)
    # AC wrapping a compiled block recomputes more (measured by `parsim orders`, see parsim/ordering.py)
    rec = rec * np.where(b.ac_wraps_compile & b.compile, ac_wraps_compile_recompute_factor(), 1.0)
    logits = sh.T * np.ceil(spec.vocab_size / sh.t)  # TP coordinate 0 holds ceil(V / tp) vocabulary rows
    out_gemm = hw.gemm_efficiency.time_s(2.0 * logits * spec.d_model, compute_peak(hw, b))
    # a fused cross-entropy reads the logits once in the forward and reads them / writes their gradient in the
    # backward, all in param_dtype [derived]
    hbm = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency
    loss_fwd = np.where(b.fused_loss, sh.act_b, LOSS_BYTES_PER_LOGIT) * logits / hbm
    loss_bwd = np.where(b.fused_loss, 2.0 * sh.act_b, LOSS_BYTES_PER_LOGIT) * logits / hbm
    out_fwd, out_bwd, emb_fwd, emb_bwd = out_gemm + loss_fwd, GEMM_BWD_PER_FWD * out_gemm + loss_bwd, 0.0, 0.0
    head = measured_head_times(spec, b, hw)
    if head is not None:  # the ends measured at the plan's shape replace the curves and add the embedding's
        cs = float(hw.corrections.get("compute_scale", 1.0))
        out_fwd = np.where(head["have"], head["out_fwd"] * cs, out_fwd)
        out_bwd = np.where(head["have"], head["out_bwd"] * cs, out_bwd)
        emb_fwd, emb_bwd = head["emb_fwd"] * cs, head["emb_bwd"] * cs
    fwd = fwd + np.where(rv.has_out, out_fwd, 0.0) + np.where(rv.has_emb, emb_fwd, 0.0)
    bwd = bwd + np.where(rv.has_out, out_bwd, 0.0) + np.where(rv.has_emb, emb_bwd, 0.0)
    return RankCompute(fwd=fwd, bwd=bwd, rec=rec, act=act, transient=transient, logits=logits, gemm=gemm,
                       costs=costs)


def _bubble(b: PlanBatch, hw: HardwareProfile, M, ga, compute_mb, t_mb):
    """Pipeline bubble of one rank: ``ga (pp - 1) / v`` microbatch-times (Narayanan et al. 2021, sec. 2.2).

    Ranks sharing cores (``compute_scale`` s = ranks per core > 1, measured by the profiler): a rank idle in the
    bubble gives its core to the ranks that share it, so the work is limited by the cores, not stretched on the
    critical path. With W = M x compute per microbatch at full speed, the step's compute takes
    ``max(s W, W + bubble at full speed)`` [derived]: the bubble adds time only beyond what the shared cores need
    anyway. With s = 1 this is the plain bubble."""
    s = float(hw.corrections.get("compute_scale", 1.0))
    full_speed_mb = t_mb - compute_mb + compute_mb / s  # exposed comm per microbatch is not stretched by s
    bubble1 = ga * (b.pp - 1) / b.v * full_speed_mb
    return np.maximum(0.0, M * compute_mb / s + bubble1 - M * compute_mb)


def _optimizer_time_s(hw: HardwareProfile, p_opt, n_tensors) -> np.ndarray:
    """The optimizer step (gradient clipping and AdamW) over the rank's ``p_opt`` parameters in ``n_tensors``
    tensors. A profile that measured the executor's step (``profiler.compute.optimizer_samples``, fitted by
    ``fit.fit_optimizer_step``: ``optimizer_fixed_s``, ``optimizer_s_per_param``, ``optimizer_s_per_tensor``
    [measured]) gets ``fixed + p x per_param + tensors x per_tensor``, times ``compute_scale`` as every
    single-process measurement (ranks sharing cores). Otherwise (spec sheets) memory-bound:
    ADAMW_BYTES_PER_PARAM of traffic per parameter at the elementwise bandwidth [derived]. Measured on this
    2-core EPYC, one thread: 1.9 ns per parameter for AdamW alone where 32 B at the fitted 58 GB/s say 0.55."""
    c = hw.corrections
    if "optimizer_s_per_param" in c:
        t = (float(c["optimizer_fixed_s"]) + p_opt * float(c["optimizer_s_per_param"])
             + n_tensors * float(c.get("optimizer_s_per_tensor", 0.0)))
        return t * float(c.get("compute_scale", 1.0))
    return p_opt * ADAMW_BYTES_PER_PARAM / (hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency)


def _time_lower_bound(b: PlanBatch, hw: HardwareProfile, c: RankCompute, p_opt, n_tensors) -> np.ndarray:
    """A lower bound of one rank's step time over every device order [derived]: ``_evaluate_rank``'s step is
    compute (forward, backward, recompute: the same in every device order) + bubble + optimizer + exposed
    collectives (>= 0) + interference (``comm_interference`` x hidden time >= 0 when the factor is >= 0). The
    bubble grows with the microbatch time, which is compute + exposed per-microbatch collectives, so the bubble of
    the compute alone bounds it from below. Collectives are the only term that depends on the device order; search
    skips the orders of a (plan, options) row whose bound already loses (``parsim.search``). A profile with a
    negative interference factor gets no bound (-inf)."""
    if float(hw.corrections.get("comm_interference", 0.0)) < 0.0:
        return np.full(len(b), -np.inf)
    ga = b.grad_accum.astype(float)
    M = ga * b.n_micro
    compute_mb = c.fwd + c.bwd + c.rec
    opt = _optimizer_time_s(hw, p_opt, n_tensors)
    return M * compute_mb + opt + _bubble(b, hw, M, ga, compute_mb, compute_mb)


def _evaluate_rank(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, rank: int, rv: C.RankView,
                   costs: dict) -> dict:
    """Step time (itemized) and peak memory (itemized, the largest of five moments) of one rank."""
    c = _rank_compute(spec, b, sh, hw, rv, costs)
    phases, p_opt = _rank_memory(spec, b, sh, rank, rv, c)
    ga = b.grad_accum.astype(float)
    M = ga * b.n_micro  # microbatches per step per rank
    cm = C.rank_comm(spec, b, sh, hw, rv)
    per_mb_exposed = dict(cm["per_microbatch_exposed_s"])  # TP, CP, EP by axis (fwd + bwd + recompute)
    tp_ratio = _async_tp_exposed_fraction(b, hw, per_mb_exposed["tp"], c.gemm)
    per_mb_exposed["tp"] = per_mb_exposed["tp"] * tp_ratio
    t_mb = c.fwd + c.bwd + c.rec + sum(per_mb_exposed.values())
    fsdp_exposed = _fsdp_exposed(b, hw, cm, c.fwd, c.bwd + c.rec, rv.n_layers)
    _set_exposed(cm["ledger"], fsdp_exposed, cm["fsdp_ag_total_s"] + cm["fsdp_red_total_s"], tp_ratio)
    opt = _optimizer_time_s(hw, p_opt, rv.n_tensors)
    tb = {"compute_forward": M * c.fwd, "compute_backward": M * c.bwd, "recompute": M * c.rec,
          "pp_bubble": _bubble(b, hw, M, ga, c.fwd + c.bwd + c.rec, t_mb), "optimizer": opt}
    for axis, tt in cm["ledger"].exposed_by_axis().items():  # comm_<axis>: exposed seconds of its collectives
        tb["comm_" + axis] = tt
    tb["comm_interference"] = _interference(hw, cm["ledger"])
    tb.update(_framework_overheads(spec, b, hw, cm["ledger"], rv.n_layers, M))
    return {"step": sum(tb.values()), "tb": tb, "ledger": cm["ledger"], **_rank_peak(b, sh, hw, rv, c, phases)}


def _rank_peak(b: PlanBatch, sh: Shapes, hw: HardwareProfile, rv: C.RankView, c: RankCompute, phases: dict) -> dict:
    """A rank's allocated peak (the largest phase: ``mem``, its breakdown ``mb``, ``phase`` its index, every
    phase's total ``phase_totals``) and what CUDA's caching allocator reserves at it (``reserved``, itemized
    ``rb``: costmodel/reserved.py; a gloo (CPU) profile has no caching allocator)."""
    n, z = len(b), np.zeros(len(b))
    totals = {k: sum(v.values()) for k, v in phases.items()}
    names = list(phases)
    which = np.argmax(np.stack([totals[k] for k in names]), axis=0)
    mb = {k: np.choose(which, [np.broadcast_to(phases[p].get(k, z), (n,)) for p in names]) for k in MEMORY_KEYS}
    mem = np.choose(which, [np.broadcast_to(totals[p], (n,)) for p in names])
    rsv = reserved_breakdown(b, rv, np.asarray(c.logits, dtype=float), np.asarray(sh.act_b, dtype=float),
                             _rank_params(b, rv)[0], mem, mb, which, allocator=hw.comm_overlap)
    return {"mem": mem, "mb": mb, "phase": which, "phase_totals": totals, "reserved": sum(rsv.values()), "rb": rsv}


def _async_tp_exposed_fraction(b: PlanBatch, hw: HardwareProfile, tp_s, gemm_s) -> np.ndarray:
    """Fraction of the TP collectives' time left exposed. Async TP (torchtitan's micro-pipelined TP, Megatron's
    tp_comm_overlap) splits each SP all-gather / reduce-scatter into chunks that run while the matmul consuming or
    producing them works on the previous chunk, so a microbatch's TP time hides behind its GEMM time: exposed =
    max(0, TP - GEMM) [derived]. What hides still slows the GEMMs (``_interference``). Without async TP, or where
    collectives block the rank (gloo), everything is exposed."""
    if not hw.comm_overlap:
        return np.ones(len(b))
    hidden = np.maximum(np.asarray(tp_s, dtype=float) - gemm_s, 0.0)
    frac = np.where(tp_s > 0, hidden / np.where(tp_s > 0, tp_s, 1.0), 1.0)
    return np.where(b.async_tp, frac, 1.0)


def _framework_overheads(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, ledger, n_layers, M) -> dict:
    """What FSDP2 and DTensor TP spend beside their collectives and the blocks' compute, from the profile's
    measured quantities (``profiler.frameworks``: a wrapped block stack minus its unwrapped twin issuing the same
    collectives, on 2 ranks; ``fit.fit_framework_overheads``) [measured]:

    * ``framework_fsdp`` = sum over the FSDP gradient reductions of calls x (``fsdp_unit_fixed_s`` +
      ``fsdp_unit_s_per_byte`` x the unit's unsharded gradient bytes): hooks, copy-in / copy-out, chunk-cat and
      sharded accumulation, one unshard / reduce cycle per reduction. Reductions are the reduce-scatters (FSDP,
      expert FSDP) and, where the shard group is 1 (replicate only), the all-reduces of the whole unit;
    * ``framework_tp`` = layers x microbatches x (``tp_block_fixed_s`` + ``tp_block_s_per_byte`` x one gathered
      activation, micro batch x sequence / cp x d_model x param bytes) where tp > 1: DTensor dispatch and
      redistribution per block, forward + backward (AC's recompute not included).

    CPU work, so ranks sharing cores stretch it like compute (``compute_scale``). Profiles without the quantities
    (spec sheets, profiles measured before) add nothing and keep their breakdown keys."""
    c, out = hw.corrections, {}
    scale = float(c.get("compute_scale", 1.0))
    if "fsdp_unit_fixed_s" in c:
        t = np.zeros(len(b))
        for r in ledger.records:
            if r.overlap != "fsdp_reduce":
                continue
            # FSDP's reduce-scatter over its shard group (dp_shard, dp_shard+cp, efsdp; not the distributed
            # optimizer's over dp_replicate), or HSDP's all-reduce over dp_replicate (DDP-EP's over edp is not FSDP)
            whole_unit = r.op == "reduce_scatter" and r.axis != "dp_replicate"
            replicate_only = r.op == "all_reduce" and r.axis == "dp_replicate"
            if not (whole_unit or replicate_only):
                continue
            on = np.ones(len(b), bool) if whole_unit else (b.fsdp == 1)
            per_call = float(c["fsdp_unit_fixed_s"]) + float(c["fsdp_unit_s_per_byte"]) * r.bytes_per_call
            t = t + np.where(on & (r.calls > 0), r.calls * per_call, 0.0)
        out["framework_fsdp"] = t * scale
    if "tp_block_fixed_s" in c:
        act = b.micro_batch_size * b.seq_len / np.maximum(b.cp, 1) * float(spec.d_model) * b.param_bytes
        per_block = float(c["tp_block_fixed_s"]) + float(c["tp_block_s_per_byte"]) * act
        out["framework_tp"] = np.where(b.tp > 1, n_layers * M * per_block, 0.0) * scale
    return out


def _interference(hw: HardwareProfile, ledger) -> np.ndarray:
    """Compute slowed by the collectives that run beside it: ``comm_interference`` x the hidden collective time
    (raw - exposed). NCCL kernels occupy SMs and HBM bandwidth while a GEMM runs: overlapped compute slows by 18.9%
    of its time on average and 40% at most on A100/H100 (arXiv 2507.03114); per second of hidden collective the
    loss is of the same order. Profiles carry it as ``corrections.comm_interference`` (spec-sheet: the public
    average, then fitted by `parsim calibrate`); 0 where collectives block the rank (gloo on CPU)."""
    k = float(hw.corrections.get("comm_interference", 0.0))
    hidden = sum((r.time_s - r.exposed_s for r in ledger.records), np.zeros(ledger.n))
    return k * np.maximum(hidden, 0.0)


def _unsharded_params(b: PlanBatch, gathered: dict, sharded, local, layer_g, pb) -> tuple:
    """FSDP's unsharded parameters at the forward-side and backward-side moments (bytes): with
    reshard_after_forward off (or the distributed optimizer's whole model) the whole stage stays unsharded
    (``keep_all``); resharding, the [norm, output] unit at the end of forward, plus two blocks (the one in its
    backward and the prefetched next) in the backward."""
    out_g = gathered["out"]
    keep_all = np.where(sharded, gathered["blocks"] + gathered["emb"] + out_g, local) * pb
    dist = b.zero1
    unsh_fwd = np.where(dist, keep_all, np.where(sharded, np.where(b.raf, out_g * pb, keep_all), 0.0))
    unsh_bwd = np.where(dist, keep_all, np.where(sharded, np.where(b.raf, (out_g + 2.0 * layer_g) * pb,
                                                                   keep_all), 0.0))
    return keep_all, unsh_fwd, unsh_bwd


def _gradients_alive(b: PlanBatch, rv: C.RankView, local, p_shard, n_inflight, rb, vocab_elems) -> tuple:
    """(the embedding's gradient elements, the stage's accumulated gradient bytes, the gradient bytes alive at the
    forward-side peaks); ``local``: the stage's parameter elements, ``vocab_elems``: V x d."""
    emb_local, has_emb = rv.emb_local, rv.has_emb
    ga, m_pass = b.grad_accum.astype(float), b.n_micro.astype(float)
    # gradients alive at the forward-side peaks: with gradient accumulation (no PP) the sharded grads of the
    # earlier passes; with PP, once the schedule reaches its steady state (more microbatches than in flight,
    # 1F1B / interleaved, or any schedule with ga > 1) the unsharded grads accumulated in reduce_dtype — the
    # embedding's at full vocabulary size — sit beside a full set of in-flight activations; before that (GPipe
    # in its one pass) nothing has accumulated
    # the embedding's gradient: dense over the full vocabulary (torch's embedding backward, also under
    # RowwiseParallel), or its vocab shard under TE layers (Megatron's VocabParallelEmbedding) [derived]
    emb_full = np.where(b.te, emb_local, vocab_elems)
    accumulated = (local - emb_local) * rb + np.where(has_emb, emb_full * rb, 0.0)
    # with gradient accumulation (ga > 1) the grads of the earlier passes are there in every schedule (traces of
    # pp2 GPipe with ga 4 in fp32: the stage's full gradients beside the activations) [measured]
    steady = (b.pp > 1) & (((b.sched != SCHED_GPIPE) & (m_pass > n_inflight)) | (ga > 1))
    grads_prev = np.where((b.pp == 1) & (ga > 1), p_shard * 4.0, np.where(steady, accumulated, 0.0))
    return emb_full, accumulated, grads_prev


def _memory_phases(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute, ne_local,
                   ex_local, p_shard, p_opt, gathered: dict) -> dict:
    """The moments of the step, each itemized by MEMORY_KEYS (see the module docstring). The distributed
    optimizer (Megatron, ZeRO-1) keeps the fp32 master weights and AdamW states of ``p_opt`` parameters (its
    1/dp_replicate share), the whole model in param_dtype and the whole gradient (main grads) in reduce_dtype."""
    V, d = spec.vocab_size, spec.d_model
    pb, rb = b.param_bytes.astype(float), b.reduce_bytes.astype(float)
    ga, m_pass = b.grad_accum.astype(float), b.n_micro.astype(float)
    emb_local, out_local, has_emb = rv.emb_local, rv.out_local, rv.has_emb
    n_inflight = inflight(b, rank)
    dist = b.zero1
    base = {"parameters": p_opt * 4.0, "optimizer_states": p_opt * 8.0}
    emb_full, accumulated, grads_prev = _gradients_alive(b, rv, ne_local + ex_local, p_shard, n_inflight, rb,
                                                         V * d)
    # FSDP2 wraps the model whenever a data-parallel axis exists (HSDP with a shard group of 1 included) and then
    # keeps unsharded copies of the parameters it gathers, also when the shard group is 1 (seen in traces of
    # pp2 x dp_replicate2 in fp32: 8 MiB of unsharded parameters on stage 0) [measured]
    sharded = (b.fsdp > 1) | (b.efsdp > 1) | (b.dp_replicate > 1)
    n_lay = np.maximum(rv.n_layers, 1.0)
    layer_w = (ne_local + ex_local - emb_local - out_local) / n_lay  # one block's weights
    layer_g = gathered["blocks"] / n_lay  # one block's gathered (padded) weights
    keep_all, unsh_fwd, unsh_bwd = _unsharded_params(b, gathered, sharded, ne_local + ex_local, layer_g, pb)
    acts = n_inflight * c.act
    m_all = ga * m_pass
    later = (b.pp > 1) & (m_all > 1)
    logits_bytes = _loss_bytes(spec, b, sh, rv, c)
    # the embedding's backward (first stage) materializes a dense gradient of the full vocabulary, also under TP
    # (seen in traces with torch 2.13's RowwiseParallel embedding); without PP FSDP then reduce-scatters it (input
    # in reduce_dtype), with PP it accumulates it unsharded in reduce_dtype at full vocabulary size, beside the
    # other blocks' accumulated grads, while the other in-flight microbatches keep their activations
    emb_grad = np.where(has_emb, emb_full * pb + np.where(b.pp > 1, emb_full * rb, gathered["emb"] * rb), 0.0)
    return {
        "end of forward": dict(base, gradients=grads_prev, fsdp_unsharded_params=unsh_fwd, activations=acts,
                               logits_and_loss=logits_bytes),
        "backward of the last layer": dict(base, gradients=grads_prev, fsdp_unsharded_params=unsh_bwd,
                                           fsdp_grad_buffers=layer_w * pb + layer_g * rb, activations=acts,
                                           recompute_transient=c.transient),
        # PP: a later microbatch's backward starts beside the gradients the first one accumulated (fp32, the
        # embedding's at full vocabulary), the activations of the microbatches still in flight (the schedule's
        # window, or all that remain when every forward ran first) and its last layer's new gradients in
        # param_dtype, added into the accumulated ones in place (mixtral-8x7b PP4 x TP2 x EP2 trace: the MoE
        # block's expert gradients, 1.3 GiB, set the peak there) [derived, trace]
        "backward of a later microbatch": dict(base, gradients=np.where(later, accumulated, 0.0),
                                               fsdp_unsharded_params=np.where(later, unsh_bwd, 0.0),
                                               fsdp_grad_buffers=np.where(later, layer_w * pb, 0.0),
                                               activations=np.where(later, np.minimum(n_inflight, m_all - 1.0), 0.0)
                                               * c.act),
        "end of backward": dict(base, gradients=np.where(b.pp > 1, accumulated - np.where(has_emb, emb_full * rb, 0.0),
                                                         np.maximum(grads_prev, p_shard * 4.0)),
                                fsdp_unsharded_params=np.where(sharded & b.raf, emb_local * pb, unsh_bwd),
                                fsdp_grad_buffers=emb_grad, activations=np.maximum(n_inflight - 1.0, 0.0) * c.act),
        "optimizer step": dict(base, gradients=p_shard * 4.0, optimizer_temporaries=p_opt * 4.0,
                               fsdp_unsharded_params=np.where(dist, keep_all, 0.0)),
    }


def _combine(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, per_rank: list, detail: bool) -> dict:
    """The plan's step time is its slowest rank's, its memory the larger peak; comm_bytes are rank 0's."""
    n = len(b)
    first, last = per_rank
    time_rank = np.where(last["step"] > first["step"], LAST, FIRST)
    mem_rank = np.where(last["mem"] > first["mem"], LAST, FIRST)
    step = np.where(time_rank == LAST, last["step"], first["step"])
    peak_mem = np.where(mem_rank == LAST, last["mem"], first["mem"])
    # what must fit is what the allocator reserves (its rank can differ from the allocated peak's)
    rsv_rank = np.where(last["reserved"] > first["reserved"], LAST, FIRST)
    reserved = np.where(rsv_rank == LAST, last["reserved"], first["reserved"])
    tps = b.global_batch_size * b.seq_len / step / b.world
    mfu = _model_flops_per_token(spec, b) * tps / hw.peak("bfloat16")
    out = {"step_time_s": step, "peak_memory_bytes": peak_mem, "fits": reserved <= hw.usable_memory_bytes,
           "reserved_memory_bytes": reserved, "tokens_per_s_per_gpu": tps, "mfu": mfu, "peak_rank": mem_rank,
           "time_rank": time_rank}

    def pick(src: str, rank_sel) -> dict:
        keys = sorted(set(first[src]) | set(last[src]))
        return {k: np.where(rank_sel == LAST, _g(last[src], k, n), _g(first[src], k, n)) for k in keys}

    if not detail:  # the dominant cost, cheaply: the largest breakdown entry of the time-critical rank
        tb = pick("tb", time_rank)
        out["dominant"] = np.array(list(tb))[np.argmax(np.stack(list(tb.values())), axis=0)]
        return out
    out["time_breakdown_s"] = pick("tb", time_rank)
    out["memory_breakdown_bytes"] = {k: np.where(mem_rank == LAST, last["mb"][k], first["mb"][k])
                                     for k in MEMORY_KEYS}
    out["reserved_breakdown_bytes"] = {k: np.where(rsv_rank == LAST, last["rb"][k], first["rb"][k])
                                       for k in RESERVED_KEYS}
    out["comm_bytes"] = first["ledger"].bytes_by_key()
    out["peak_phase"] = np.where(mem_rank == LAST, last["phase"], first["phase"])
    for r in per_rank:
        r["comm_time"], r["exposed"] = r["ledger"].time_by_key(), r["ledger"].exposed_by_key()
    out["comm_time_s"] = pick("comm_time", time_rank)
    out["exposed_comm_time_s"] = pick("exposed", time_rank)
    out["ledgers"] = (first["ledger"], last["ledger"])
    out["ranks"] = per_rank
    return out


def _fsdp_exposed(b: PlanBatch, hw: HardwareProfile, cm: dict, fwd, bwd, n_layers) -> np.ndarray:
    """Exposed FSDP/HSDP seconds per step on one rank. FSDP2 prefetches one unit ahead: a unit's all-gather hides
    behind the previous unit's forward (and, when resharded, the next unit's backward); reduce-scatters (and HSDP
    all-reduces) hide behind the next unit's backward; the first gather and the last reduce of a round are exposed.
    Per-unit times are the ledger's totals spread over the rank's layers + 1 (embedding / output) units; gloo on
    CPU blocks the rank, so there everything is exposed."""
    ag_total, red_total = cm["fsdp_ag_total_s"], cm["fsdp_red_total_s"]
    if not hw.comm_overlap:
        return ag_total + red_total
    ga, m_pass = b.grad_accum.astype(float), b.n_micro.astype(float)
    # gathers per unit and pass (comm._fsdp_units): forwards (every microbatch's when resharded under PP), and
    # one backward re-gather when resharded after forward
    fwd_rounds = np.where((b.pp > 1) & b.raf, m_pass, 1.0)
    bwd_gather = np.where(b.raf, 1.0, 0.0)
    lay = np.maximum(n_layers, 1.0)
    ag_l = ag_total / np.maximum(ga * (fwd_rounds + bwd_gather), 1) / (lay + 1.0)
    red_l = red_total / np.maximum(ga, 1) / (lay + 1.0)
    f_l, b_l = fwd / lay, bwd / lay
    exp_fwd = fwd_rounds * (ag_l + n_layers * np.maximum(0.0, ag_l - f_l))
    exp_bwd = n_layers * np.maximum(0.0, bwd_gather * ag_l + red_l - b_l) + red_l
    return ga * (exp_fwd + exp_bwd)


def _set_exposed(ledger, fsdp_exposed, fsdp_total, tp_ratio) -> None:
    """Exposed seconds of every record: CP/EP/PP records are exposed as they are, TP's per-microbatch records by
    ``tp_ratio`` (async TP); the FSDP family shares ``fsdp_exposed`` in proportion to its records' raw times."""
    safe = np.where(fsdp_total > 0, fsdp_total, 1.0)
    for r in ledger.records:
        if r.overlap in C.FSDP_OVERLAPS:
            r.exposed_s = fsdp_exposed * r.time_s / safe
        elif r.axis == "tp" and r.phase != "step":
            r.exposed_s = r.time_s * tp_ratio
        else:
            r.exposed_s = r.time_s


def _g(d, k, n):
    v = d.get(k, 0.0)
    return np.broadcast_to(np.asarray(v, dtype=float), (n,))


def _model_flops_per_token(spec: ModelSpec, b: PlanBatch) -> np.ndarray:
    """PaLM/torchtitan MFU FLOPs per token (spec.flops_per_token) for each plan's sequence length."""
    base = spec.flops_per_token(0)
    per_seq = spec.flops_per_token(1) - base
    return base + per_seq * b.seq_len


def rank_details(spec: ModelSpec, plan: Plan, hw: HardwareProfile) -> dict[int, dict]:
    """What the model says of each of its two ranks (FIRST: pipeline stage 0, LAST: the last stage; the same rank
    without PP): peak memory, its phase, the breakdown at the peak, the total of every phase, collective bytes
    per "<op>/<axis>". For comparing with a trace of one rank (``bench/differential.py``)."""
    validate_plan(plan, spec)
    b = encode([plan], hw.gpus_per_node)
    r = evaluate(spec, b, hw, detail=True)
    out = {}
    for which, rk in zip((FIRST, LAST), r["ranks"], strict=True):
        names = canonical_axes(plan, stage_rank(plan, which))
        out[which] = {
            "peak_memory_bytes": float(rk["mem"][0]), "peak_phase": PHASES[int(rk["phase"][0])],
            "memory_breakdown_bytes": {k: float(v[0]) for k, v in rk["mb"].items()},
            "reserved_memory_bytes": float(rk["reserved"][0]),
            "reserved_breakdown_bytes": {k: float(v[0]) for k, v in rk["rb"].items()},
            "phase_totals_bytes": {k: float(np.broadcast_to(v, (1,))[0]) for k, v in rk["phase_totals"].items()},
            "comm_bytes": _named({k: float(v[0]) for k, v in rk["ledger"].bytes_by_key().items()}, names),
        }
    return out


def stage_rank(plan: Plan, which: int) -> int:
    """The rank the model's FIRST / LAST view describes: pipeline coordinate 0 / pp - 1, every other coordinate 0
    (ranks row-major over the device order)."""
    if which == FIRST or plan.pp == 1:
        return 0
    stride = 1
    for a in reversed(plan.mesh_order):
        if a == "pp":
            return (plan.pp - 1) * stride
        stride *= getattr(plan, a)
    return 0


def _axis_times_renamed(tb: dict, exposed: dict) -> dict:
    """The breakdown's ``comm_<axis>`` entries (exposed time per axis) regrouped under the canonical axis names of
    ``exposed``: the same total, named as the collectives are (two axes over the same ranks become one entry)."""
    out = {k: v for k, v in tb.items() if not k.startswith("comm_") or k == "comm_interference"}
    for k, e in exposed.items():
        if not e:
            continue
        name = "comm_" + k.split("/", 1)[1]
        out[name] = out.get(name, 0.0) + e
    return out


def _named(by_key: dict, names: dict) -> dict:
    """Sum "<op>/<axis>" values under the axes' canonical names (``codec.canonical_axes``), dropping zeros."""
    out: dict = {}
    for k, v in by_key.items():
        if v:
            c = canonical_key(k, names)
            out[c] = out.get(c, 0.0) + v
    return out


def predict(spec: ModelSpec, plan: Plan, hw: HardwareProfile) -> Prediction:
    """Predict one plan (the same vectorized code on a batch of one)."""
    return prediction_from(spec, plan, hw, evaluate_one(spec, plan, hw)[1])


def evaluate_one(spec: ModelSpec, plan: Plan, hw: HardwareProfile) -> tuple[PlanBatch, dict]:
    """One plan, validated, encoded and evaluated with its ledgers (``detail``): (its batch, ``evaluate``'s dict);
    ``predict`` and ``explain`` read the same evaluation."""
    validate_plan(plan, spec)
    b = encode([plan], hw.gpus_per_node)
    return b, evaluate(spec, b, hw, detail=True)


def prediction_from(spec: ModelSpec, plan: Plan, hw: HardwareProfile, r: dict) -> Prediction:
    """The Prediction of one plan from its evaluation (``evaluate_one``)."""
    tb = {k: float(v[0]) for k, v in r["time_breakdown_s"].items() if k in TIME_KEYS or float(v[0]) > 0}
    mb = {k: float(v[0]) for k, v in r["memory_breakdown_bytes"].items()}
    # collectives named as the executor's counter names them (``codec.canonical_axes``): bytes are rank 0's, times
    # the time-critical rank's
    comm = _named({k: float(v[0]) for k, v in r["comm_bytes"].items()}, canonical_axes(plan, 0))
    t_names = canonical_axes(plan, stage_rank(plan, int(r["time_rank"][0])))
    comm_t = _named({k: float(v[0]) for k, v in r["comm_time_s"].items()}, t_names)
    exposed = _named({k: float(v[0]) for k, v in r["exposed_comm_time_s"].items()}, t_names)
    keys = sorted(set(comm) | set(comm_t))
    comm_t = {k: comm_t.get(k, 0.0) for k in keys}
    exposed = {k: exposed.get(k, 0.0) for k in keys}
    tb = _axis_times_renamed(tb, exposed)
    pp_last = plan.pp - 1
    step, tps = float(r["step_time_s"][0]), float(r["tokens_per_s_per_gpu"][0])
    q = hw.interval_log_halfwidth_for(interval_group(plan))
    return Prediction(
        plan_id=plan.plan_id, model=spec.name, profile=hw.name, n_gpus=plan.world_size,
        fits=bool(r["fits"][0]), peak_memory_bytes=float(r["peak_memory_bytes"][0]),
        memory_capacity_bytes=float(hw.usable_memory_bytes),
        peak_rank=f"pp stage {pp_last if r['peak_rank'][0] == LAST else 0}",
        peak_phase=PHASES[int(r["peak_phase"][0])],
        memory_breakdown_bytes=mb, step_time_s=float(r["step_time_s"][0]), time_breakdown_s=tb, comm_bytes=comm,
        tokens_per_s_per_gpu=float(r["tokens_per_s_per_gpu"][0]), mfu=float(r["mfu"][0]), plan=plan.to_dict(),
        comm_time_s=comm_t, exposed_comm_time_s=exposed,
        reserved_memory_bytes=float(r["reserved_memory_bytes"][0]),
        reserved_breakdown_bytes={k: float(v[0]) for k, v in r["reserved_breakdown_bytes"].items()},
        interval_s=(step * math.exp(-q), step * math.exp(q)),
        interval_tokens_per_s_per_gpu=(tps * math.exp(-q), tps * math.exp(q)),
    )
