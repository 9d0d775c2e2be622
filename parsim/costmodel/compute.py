"""Compute of one layer and one rank per microbatch: the items of a layer's forward (GEMMs at the profile's
efficiency curves, attention, memory-bound kernels, overheads), the layer's forward / backward / recompute seconds
and activation bytes (``LayerCosts``), blocks and model ends measured at the plan's shape where the profile has
them, a rank's compute over its layers and ends (``RankCompute``), the optimizer step. See ``step``'s docstring
for the time model."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from ..blockshape import block_shape, head_shape
from ..codec import DTYPES, PlanBatch, encode
from ..hardware import HardwareProfile
from ..ordering import ac_wraps_compile_recompute_factor
from ..plan import Plan
from ..plan_schema import ATTENTION_KERNELS, Float8Recipe
from ..spec import ModelSpec
from . import comm as C
from .layers import (
    Shapes,
    ac_counts,
    activation_bytes,
    activation_bytes_split,
    attention_flops,
    attn_recomputed_bytes,
    core_attn_counts,
    gemms,
    grouped_mm_kept,
    local_experts,
    saved_tensors,
)
from .rows import unique_rows

# [derived] AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (fp32: 7 x 4 B),
# plus the gradient-norm read (4 B)
ADAMW_BYTES_PER_PARAM = 28.0 + 4.0
# [derived] a GEMM's backward is two GEMMs of its size (input gradient and weight gradient)
GEMM_BWD_PER_FWD = 2.0
# [assumed] memory-bound kernels: every non-GEMM tensor a layer saves is written once and read about twice; their
# backward moves about twice as much
MEMORY_TRAFFIC_PER_SAVED_BYTE = 3.0
MEMORY_BWD_PER_FWD = 2.0
# [public benchmark] float8 rowwise GEMMs run at 90-100% of tensorwise speed on most shapes, with a tail down to 50%
# (pytorch/pytorch#147971): the low end of the common range
ROWWISE_KERNEL_SPEED = 0.9
# [public benchmark] FlashAttention-2 runs 1.3-2.5x faster than the Triton FlashAttention kernel, forward +
# backward on A100 (Dao 2023, arXiv:2307.08691, sec. 4.1); the geometric middle of that range [assumed]. The
# spec-sheet attention curves are FlashAttention-2's
TRITON_ATTENTION_SLOWDOWN = 1.8
ATTENTION_KERNEL_CODES = {name: i for i, name in enumerate(ATTENTION_KERNELS)}
# [derived] the loss's fp32 traffic per logit: read bf16 logits, write / read the fp32 copy and log-softmax (16 B)
LOSS_BYTES_PER_LOGIT = 16.0


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """One layer per microbatch (arrays over the plan batch): seconds forward, backward (without recompute),
    recomputed under full AC, under selective AC and under core-attn (``rec_attn``); activation bytes kept per AC
    mode ("none", "sac", "full", "attn") and split by sub-block (``act_split``: mode -> (attention, FFN)); the
    GEMMs' forward seconds."""

    fwd: Any
    bwd: Any
    rec_full: Any
    rec_sac: Any
    act: dict
    gemm_fwd: Any
    act_split: dict
    rec_attn: Any = 0.0


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
    recomputed_by_sac: Any  # the fraction selective AC recomputes (a bool, or per plan for grouped GEMMs)


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
    odd = 0  # parity of the aten.mm's so far: selective AC keeps the odd ones (``layers.kept_by_ac_mode``)
    wgrad_hp = np.zeros_like(sh.T)  # rowwise_with_gw_hp: extra backward seconds of weight gradients in bf16
    for name, flops, kernel_flops, io_elems, kind in gemms(spec, sh, moe):
        t = (flops / kernel_flops) * hw.gemm_efficiency.time_s(kernel_flops, peak)
        eff = hw.gemm_efficiency(kernel_flops)
        if fp8_peak and hw.float8_gemm_efficiency is not None:
            t_fp8 = (flops / kernel_flops) * hw.float8_gemm_efficiency.time_s(kernel_flops, fp8_peak)
            t_fp8 = t_fp8 / np.where(b.float8_recipe == Float8Recipe.TENSORWISE, 1.0, ROWWISE_KERNEL_SPEED)
            # [derived] cast: read bf16 (2 B), write fp8 (1 B) per element, the fused casts of torch.compile and
            # Transformer Engine (the amax pass taken as hidden); rowwise recipes quantize each operand along both
            # axes (the backward GEMMs scale along the other dimension), tensorwise reuses one scale.
            # [measured, one H200, bench/reports/gpu-acceptance-h200/2026-11-28: llama3-8b blocks at four local
            # shapes, torchao's
            # recipe as executor.float8 runs it] float8 - bf16 per block compiled -0.81..-2.12 ms against
            # -0.35..-2.29 composed (5 B, the amax pass unhidden: -0.27..-1.95, no closer, and the published rows
            # 17.2% -> 19.3% uncalibrated); eager torchao casts (each op a kernel, ~33 B per element) +8.7..+12.7 ms,
            # which this count does not model (composed -0.49..-2.29): no published row runs them (torchtitan
            # compiles; Megatron, NeMo and llm-foundry's fp8 run TE's fused casts), a measured block carries them
            casts = np.where(b.float8_recipe == Float8Recipe.TENSORWISE, 1.0, 2.0)
            t_fp8 = t_fp8 + casts * 3.0 * io_elems / mem_bw
            gw_hp = b.float8 & (b.float8_recipe == Float8Recipe.ROWWISE_WITH_GW_HP)
            wgrad_hp = wgrad_hp + np.where(gw_hp, np.maximum(t - t_fp8, 0.0), 0.0)
            t = np.where(b.float8, t_fp8, t)
            eff = np.where(b.float8, hw.float8_gemm_efficiency(kernel_flops), eff)
        # SAC recomputes the even mm's, every addmm (biased linears, ``layers.linear_kind``) and a grouped GEMM's
        # even per-expert mm's (the fraction it does not keep)
        if kind == "mm":
            odd = 1 - odd
            rec: object = odd == 0
        elif kind == "gmm":
            kept, odd = grouped_mm_kept(local_experts(spec, sh), odd)
            rec = 1.0 - kept
        else:
            rec = kind == "addmm"
        items.append(ComputeItem(name, "gemm", flops, eff, t, rec))
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
    fused kernel: the spec-sheet FlashAttention curve's efficiency times the profile's ``fused_attention_speedup``
    (capped at 1). A calibrated profile's attention factor (``corrections.flash_attention_factor``, fitted by
    ``parsim calibrate`` on runs of FlashAttention kernels) is divided out there: it measures how far those runs
    fell short of FlashAttention's own benchmark, and cuDNN's kernel has a public figure of its own (the
    FlashAttention-3 paper's cuDNN measurements) that the factor was not fitted on [derived; issue 24: the factor,
    0.55, slowed Megatron-Bridge's TE rows by 15% of their step time]. Where the speedup is 1 (A100: TE runs
    FlashAttention there) the kernel is the same and the factor stays. Plans on the Triton FlashAttention kernel
    (``attention_kernel`` triton: llm-foundry's MPT runs) take FlashAttention-2's time x TRITON_ATTENTION_SLOWDOWN
    (the FlashAttention-2 paper's comparison of the two kernels) x the calibrated profile's
    ``corrections.triton_attention_factor`` (fitted by ``parsim calibrate`` within the paper's range)."""
    a_flops = attention_flops(spec, sh)
    if hw.attention_keys_efficiency is None:
        eff, t = hw.attention_efficiency(a_flops), hw.attention_efficiency.time_s(a_flops, peak)
    else:
        eff = hw.attention_keys_efficiency(sh.seq / b.cp)
        t = a_flops / (eff * peak)
    speedup = hw.fused_attention_speedup
    if speedup > 1.0:
        speedup = speedup / float(hw.corrections.get("flash_attention_factor", 1.0))
    boost = np.where(b.te_layers, np.minimum(speedup, 1.0 / np.maximum(eff, 1e-12)), 1.0)
    # the Triton FlashAttention kernel (``attention_kernel`` triton) at FlashAttention-2's speed / 1.8
    boost = boost / np.where(b.attention_kernel == ATTENTION_KERNEL_CODES["triton"], triton_slowdown(hw), 1.0)
    return ComputeItem("attention (causal)", "attention", a_flops, eff * boost, t / boost, False)


def triton_slowdown(hw: HardwareProfile) -> float:
    """The Triton FlashAttention kernel's time over FlashAttention-2's on ``hw``: TRITON_ATTENTION_SLOWDOWN x the
    calibrated profile's ``corrections.triton_attention_factor`` (1 where the profile has none)."""
    return TRITON_ATTENTION_SLOWDOWN * float(hw.corrections.get("triton_attention_factor", 1.0))


def compute_peak(hw: HardwareProfile, b: PlanBatch) -> np.ndarray:
    """Peak FLOP/s of each plan's compute dtype: FSDP mixed precision (and autocast) run GEMMs and attention in
    ``param_dtype`` — bf16 at its tensor-core peak, fp32 plans at the profile's float32 peak (a CPU without bf16
    instructions: 98.8 GFLOP/s fp32 vs 2.3 GFLOP/s bf16 measured on this machine). MFU stays relative to the
    bf16 peak, as published figures are."""
    return dtype_peak_flops(hw, b.param_bytes)


def dtype_peak_flops(hw: HardwareProfile, param_bytes) -> np.ndarray:
    """``compute_peak`` of a plan whose param_dtype takes ``param_bytes`` bytes (array or scalar)."""
    bf16 = hw.peak("bfloat16")
    fp32 = float(hw.peak_flops.get("float32", bf16))
    return np.where(np.asarray(param_bytes) >= 4, fp32, bf16).astype(float)


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
    if not block or host_issue_times(hw) is not None:  # an asynchronous device: nothing added (host_issue_times)
        return 0.0, 0.0
    from ..spec import load_model

    spec = load_model(block["model"])
    dtype = block["dtype"] if block["dtype"] in ("float32", "bfloat16") else "bfloat16"
    plan = Plan(seq_len=block["seq_len"], local_batch_size=max(1, block["tokens"] // block["seq_len"]),
                param_dtype=dtype)
    b = encode([plan], hw.gpus_per_node)
    cost = layer_costs(spec, b, Shapes(spec, b), hw, spec.is_moe_layer(0), overheads=(0.0, 0.0), compute_scale=1.0)
    fwd = max(0.0, block["time_fwd_s"] - float(cost.fwd[0]))
    bwd = max(0.0, (block["time_fwd_bwd_s"] - block["time_fwd_s"]) - float(cost.bwd[0]))
    return fwd, bwd


def host_issue_times(hw: HardwareProfile) -> tuple[float, float] | None:
    """(forward, backward) seconds the host takes to issue one layer's kernels on an asynchronous device (a GPU),
    from the profile's block sample (``host_fwd_s``, ``host_fwd_bwd_s``: ``profiler.compute.block_sample``, a
    block on few tokens timed in a chain, where the device waits on the host); None on a profile without them (a
    CPU, where the host runs the kernels itself, or a spec sheet).

    Derivation: the host issues kernels into the device's queue and returns; the device runs them in order. Over a
    step of many layers the host runs ahead wherever the device is the slower side, so a layer costs the larger
    of its kernels' time and its issue time, not their sum: ``max(kernels, host)`` per layer and microbatch,
    forward and backward apart. [measured, one H100 VM, llama3-8b block, bench/gpu_dispatch.py: per call in a
    chain of 8, forward + backward 4.9 / 4.7 / 5.3 ms on 256 / 512 / 1024 tokens (host-bound: the kernels take
    ~2-3.6 ms) and 6.2 / 11.7 / 22.5 ms on 2048 / 4096 / 8192 tokens, where the host needs ~5 ms: nothing of it
    shows; a 2- vs 6-layer executor step on the same GPU adds 20.0 ms per layer for 19.97 ms of kernels
    (bench/reports/gpu-acceptance/2026-11-28).] The sum the CPU's overhead uses would add ~1.6 ms per layer
    forward to every GPU plan, however large its kernels."""
    block = hw.samples.get("block") if isinstance(hw.samples, dict) else None
    if not block or "host_fwd_s" not in block:
        return None
    fwd = float(block["host_fwd_s"])
    return fwd, max(0.0, float(block["host_fwd_bwd_s"]) - fwd)


def layer_costs(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, moe: bool,
                 overheads: tuple[float, float] = (0.0, 0.0), compute_scale: float | None = None,
                 times: bool = True) -> LayerCosts:
    """Per layer and microbatch: forward/backward/recompute seconds and activation bytes. Backward: GEMMs 2x
    forward (dgrad + wgrad), attention 2.5x (FlashAttention-2), memory-bound 2x, the measured backward overhead;
    selective AC recomputes the even mm's, the memory-bound kernels and half the forward overhead; core-attn the
    attention kernel's forward alone (Megatron's selective recompute: its checkpoint holds the core attention,
    ``softmax(QK^T) V``, a fused kernel under FlashAttention / TE, and nothing of the projections, norms or MLP
    around it [derived: Megatron-Core ``TransformerBlock`` / ``Attention._checkpointed_attention_forward``,
    Korthikanti et al. 2022, arXiv:2205.05198 sec. 5]). Without ``times`` (memory only) the seconds are zeros."""
    if not times:
        z = np.zeros_like(sh.T)
        return LayerCosts(z, z, z, z, activation_bytes(spec, sh, moe), z, activation_bytes_split(spec, sh, moe))
    if compute_scale is None:
        compute_scale = float(hw.corrections.get("compute_scale", 1.0))
    items = layer_compute_items(spec, b, sh, hw, moe, overheads[0])
    by_kind = {k: sum((it.seconds for it in items if it.kind == k), np.zeros_like(sh.T))
               for k in ("gemm", "attention", "memory", "overhead", "wgrad_hp")}
    sac_t = sum((it.seconds * np.asarray(it.recomputed_by_sac, dtype=float) for it in items if it.kind == "gemm"),
                np.zeros_like(sh.T))
    ovb = overheads[1]
    fwd = (by_kind["gemm"] + by_kind["attention"] + by_kind["memory"] + by_kind["overhead"]) * compute_scale
    bwd = (GEMM_BWD_PER_FWD * by_kind["gemm"] + by_kind["wgrad_hp"] + hw.attention_bwd_per_fwd * by_kind["attention"]
           + MEMORY_BWD_PER_FWD * by_kind["memory"] + ovb) * compute_scale
    sac = (sac_t + by_kind["memory"] + 0.5 * by_kind["overhead"]) * compute_scale
    attn = by_kind["attention"] * compute_scale
    host = host_issue_times(hw)
    if host is not None:  # an asynchronous device: the host's issue time hides under the kernels (max, not sum)
        fwd = np.maximum(fwd, host[0] * compute_scale)
        bwd = np.maximum(bwd, host[1] * compute_scale)
        sac = np.maximum(sac, 0.5 * host[0] * compute_scale)
    measured = measured_block_times(spec, b, hw, moe)
    if measured is not None:  # a block measured at the row's local shape replaces the composed curves
        m_fwd, m_bwd, have = measured
        sac = np.where(have, sac * m_fwd * compute_scale / np.maximum(fwd, 1e-30), sac)  # same selective share
        attn = np.where(have, attn * m_fwd * compute_scale / np.maximum(fwd, 1e-30), attn)
        fwd = np.where(have, m_fwd * compute_scale, fwd)
        bwd = np.where(have, m_bwd * compute_scale, bwd)
    return LayerCosts(fwd=fwd, bwd=bwd, rec_full=fwd, rec_sac=sac, act=activation_bytes(spec, sh, moe),
                      gemm_fwd=by_kind["gemm"] * compute_scale, act_split=activation_bytes_split(spec, sh, moe),
                      rec_attn=attn)


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
    uniq, inv = unique_rows(cols)
    inv = inv.reshape(-1)
    fwd, bwd, have = np.zeros(len(cols)), np.zeros(len(cols)), np.zeros(len(cols), dtype=bool)
    for i, (tp, ep, etp, mb, seq, cp, pbytes, comp, f8) in enumerate(uniq.tolist()):
        shape = block_shape(spec, moe, tp=tp, ep=ep, etp=etp, micro_batch=mb, seq_len=seq, cp=cp,
                            dtype="float32" if pbytes >= 4 else "bfloat16", compile=bool(comp), float8=bool(f8))
        m = hw.measured_blocks.get(shape.key) if shape is not None else None
        if m:
            sel = inv == i
            fwd[sel], bwd[sel], have[sel] = m["fwd_s"], m["bwd_s"], True
    # (blocks are measured with torch's SDPA: a plan on another attention kernel keeps the curves)
    return fwd, bwd, have & (b.attention_kernel == ATTENTION_KERNEL_CODES["flash"])


def measured_head_times(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile) -> dict | None:
    """Per microbatch and plan, from the profile's measured ends (``blockshape.HeadShape``): the token embedding's
    forward / backward (``emb_fwd`` / ``emb_bwd``), the final norm + output projection + loss's (``out_fwd`` /
    ``out_bwd``), and ``have`` (measured?). None when the profile has no measured heads."""
    if not any(k.startswith("head|") for k in hw.measured_blocks):
        return None
    cols = np.stack([b.tp, b.micro_batch_size, b.seq_len, b.cp, b.param_dtype, b.fused_loss], axis=1).astype(np.int64)
    uniq, inv = unique_rows(cols)
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
        if kind in ("mm", "addmm", "gmm", "sdpa") and not (name.endswith("wo.out") or name.endswith("w2.out")):
            out = out + nbytes
    return out


def rank_compute(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, rv: C.RankView,
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
        n_attn = core_attn_counts(b, rv.n_of[k])
        rec = rec + n_full * c.rec_full + n_sac * c.rec_sac + n_attn * c.rec_attn
        act = act + n_full * c.act["full"] + n_sac * c.act["sac"] + n_attn * c.act["attn"] + n_none * c.act["none"]
        # (core-attn: the attention's output and logsumexp made again at its backward)
        tr = np.select([n_full > 0, n_sac > 0, n_attn > 0],
                       [c.act["none"] - c.act["full"], c.act["none"] - c.act["sac"], attn_recomputed_bytes(spec, sh)],
                       0.0)
        transient = np.maximum(transient, tr)
    # AC wrapping a compiled block recomputes more (measured by `parsim orders`, see parsim/ordering.py)
    rec = rec * np.where(b.ac_wraps_compile & b.compile, ac_wraps_compile_recompute_factor(), 1.0)
    logits = sh.T * np.ceil(spec.vocab_size / sh.t)  # TP coordinate 0 holds ceil(V / tp) vocabulary rows
    out_fwd, out_bwd = curve_output_times(hw, logits, spec.d_model, sh.act_b, b.fused_loss, compute_peak(hw, b))
    emb_fwd, emb_bwd = 0.0, 0.0
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


def curve_output_times(hw: HardwareProfile, logits, d_model, act_b, fused_loss, peak_flops) -> tuple:
    """(forward s, backward s) of the final output projection and the loss on the curves: the GEMM of ``logits``
    (tokens x local vocabulary rows) x ``d_model`` at the GEMM efficiency (backward ``GEMM_BWD_PER_FWD`` times),
    and the loss's memory traffic: ``LOSS_BYTES_PER_LOGIT`` per logit each way, or a fused cross-entropy that reads
    the logits once in the forward and reads them / writes their gradient in the backward, all in param_dtype
    (``act_b`` bytes) [derived]."""
    out_gemm = hw.gemm_efficiency.time_s(2.0 * logits * d_model, peak_flops)
    hbm = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency
    loss_fwd = np.where(fused_loss, act_b, LOSS_BYTES_PER_LOGIT) * logits / hbm
    loss_bwd = np.where(fused_loss, 2.0 * act_b, LOSS_BYTES_PER_LOGIT) * logits / hbm
    return out_gemm + loss_fwd, GEMM_BWD_PER_FWD * out_gemm + loss_bwd


def optimizer_time_s(hw: HardwareProfile, p_opt, n_tensors) -> np.ndarray:
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
