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
* measured corrections of the profile: ``compute_scale`` (ranks sharing cores) multiplies compute;
  ``layer_overhead_{fwd,bwd}_s`` (one real block timed by the profiler minus the model's time for it: dispatch,
  autograd and small-kernel costs) is added per layer and microbatch (selective AC recomputes half of it).

Memory (sums exactly to ``peak_memory_bytes``): the largest of four moments of the step, each itemized:
end of forward (activations of the in-flight microbatches, logits and loss), backward of the last layer (FSDP
unsharded params of two blocks and one block's gradient buffers, the recompute transient), end of backward (the
embedding's dense full-vocabulary gradient on the first stage) and the optimizer step (one fp32 temporary per
parameter, foreach AdamW). All hold the sharded fp32 params and AdamW states.
"""

from __future__ import annotations

import numpy as np

from ..hardware import HardwareProfile
from ..plan import Plan
from ..results import Prediction
from ..spec import ModelSpec
from .batch import PlanBatch
from .layers import (FIRST, LAST, Shapes, ac_counts, activation_bytes, attention_flops, gemms, layer_params_local,
                     rank_layers, saved_tensors)
from . import comm as C

TIME_KEYS = ("compute_forward", "compute_backward", "recompute", "pp_bubble", "optimizer")
MEMORY_KEYS = ("parameters", "gradients", "optimizer_states", "fsdp_unsharded_params", "fsdp_grad_buffers",
               "activations", "recompute_transient", "logits_and_loss", "optimizer_temporaries")
ADAMW_BYTES_PER_PARAM = 28.0 + 4.0
PHASES = ("end of forward", "backward of the last layer", "end of backward", "optimizer step")
SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED = 0, 1, 2


def _layer_costs(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, moe: bool) -> dict:
    """Per layer and microbatch: forward/backward/recompute seconds and activation bytes."""
    peak = hw.peak("bfloat16")
    fp8_peak = hw.peak_flops.get("float8")
    mem_bw = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency
    compute_scale = float(hw.corrections.get("compute_scale", 1.0))
    gemm_t = np.zeros_like(sh.T)
    sac_gemm_t = np.zeros_like(sh.T)  # mm's selective AC recomputes (even-numbered)
    mm_count = 0
    for _name, flops, kernel_flops, io_elems, kind in gemms(spec, sh, moe):
        t_bf16 = (flops / kernel_flops) * hw.gemm_efficiency.time_s(kernel_flops, peak)
        if fp8_peak and hw.float8_gemm_efficiency is not None:
            t_fp8 = (flops / kernel_flops) * hw.float8_gemm_efficiency.time_s(kernel_flops, fp8_peak)
            t_fp8 = t_fp8 + 3.0 * io_elems / mem_bw  # read bf16 (2 B) and write fp8 (1 B) of input and weight
            t = np.where(b.float8, t_fp8, t_bf16)
        else:
            t = t_bf16
        gemm_t = gemm_t + t
        if kind == "mm":
            mm_count += 1
            if mm_count % 2 == 0:
                sac_gemm_t = sac_gemm_t + t
    attn_t = hw.attention_efficiency.time_s(attention_flops(spec, sh), peak)
    act = activation_bytes(spec, sh, moe)
    # memory-bound kernels: every non-GEMM tensor the layer saves is written once and read about twice
    mem_bytes = 3.0 * (act["none"] - _gemm_output_bytes(spec, sh, moe))
    mem_t = np.maximum(mem_bytes, 0.0) / mem_bw * np.where(b.compile, hw.compile_memory_bound_factor, 1.0)
    # fixed per-layer costs the FLOP/byte terms miss, measured by the profiler on one real block (0 if absent)
    ovf = float(hw.corrections.get("layer_overhead_fwd_s", 0.0))
    ovb = float(hw.corrections.get("layer_overhead_bwd_s", 0.0))
    fwd = (gemm_t + attn_t + mem_t + ovf) * compute_scale
    bwd = (2.0 * gemm_t + 2.5 * attn_t + 2.0 * mem_t + ovb) * compute_scale
    sac = (sac_gemm_t + mem_t + 0.5 * ovf) * compute_scale
    return {"fwd": fwd, "bwd": bwd, "rec_full": fwd, "rec_sac": sac, "act": act}


def _gemm_output_bytes(spec, sh, moe):
    """Bytes of the saved tensors that GEMMs write (excluded from the memory-bound estimate)."""
    out = np.zeros_like(sh.T)
    for name, nbytes, kind in saved_tensors(spec, sh, moe):
        if kind in ("mm", "gmm", "sdpa") and not (name.endswith("wo.out") or name.endswith("w2.out")):
            out = out + nbytes
    return out


def _inflight(b: PlanBatch, rank: int) -> np.ndarray:
    """Microbatches whose activations are alive at the peak, in units of one microbatch through all of the rank's
    layers. 1F1B: pp - r (warm-up forwards + 1); GPipe: all; interleaved (torch ScheduleInterleaved1F1B):
    ``min(n_micro * v, (v - 1) * pp + 2 * (pp - 1 - r)) + 1`` chunk-microbatches of 1/v of the rank's layers."""
    pp, v, m = b.pp, b.v, b.n_micro
    r = np.zeros_like(pp) if rank == FIRST else pp - 1
    one_f_one_b = np.minimum(m, pp - r)
    inter = np.minimum(np.minimum(m * v, (v - 1) * pp + 2 * (pp - 1 - r)) + 1, m * v) / v
    out = np.where(b.sched == SCHED_GPIPE, m, np.where(b.sched == SCHED_INTERLEAVED, inter, one_f_one_b))
    return np.where(pp == 1, 1.0, out).astype(float)


def evaluate(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, detail: bool = False) -> dict:
    """Evaluate every plan of ``b``. Returns arrays: step_time_s, peak_memory_bytes, fits, tokens_per_s_per_gpu,
    mfu, peak_rank (0 = first stage, 1 = last), and with ``detail`` the breakdown and comm dicts of arrays."""
    sh = Shapes(spec, b)
    n = len(b)
    layers = rank_layers(spec, b.pp, b.v)
    kinds = [k for k in (False, True) if (spec.n_moe_layers if k else spec.n_dense_layers) > 0]
    costs = {k: _layer_costs(spec, b, sh, hw, k) for k in kinds}
    plocal = {k: layer_params_local(spec, b, k) for k in kinds}
    ga = b.grad_accum.astype(float)
    m_pass = b.n_micro.astype(float)
    M = ga * m_pass  # microbatches per step per rank
    t = b.tp.astype(float)
    pb, rb = b.param_bytes.astype(float), b.reduce_bytes.astype(float)
    fsdp, efsdp = b.fsdp.astype(float), b.efsdp.astype(float)
    mem_bw = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency
    peak = hw.peak("bfloat16")
    V, d = spec.vocab_size, spec.d_model

    per_rank = []
    for rank in (FIRST, LAST):
        has_emb = np.ones(n, bool) if rank == FIRST else b.pp == 1
        has_out = b.pp == 1 if rank == FIRST else np.ones(n, bool)
        n_of = {False: layers["dense"][rank].astype(float), True: layers["moe"][rank].astype(float)}
        n_layers = sum(n_of[k] for k in kinds)
        # ---- parameters held by the rank (before FSDP sharding) ------------------------------------------------
        emb_local = np.where(has_emb, V * d / t + spec.max_position_embeddings * d, 0.0)
        # a tied output projection needs its own copy of the embedding on the last stage when pp > 1
        own_out = (b.pp > 1) | (not spec.tie_embeddings)
        out_local = np.where(has_out, np.where(own_out, V * d / t, 0.0) + d, 0.0)
        ne_local = emb_local + out_local + sum(n_of[k] * plocal[k][0] for k in kinds)
        ex_local = sum(n_of[k] * plocal[k][1] for k in kinds)
        p_shard = ne_local / fsdp + ex_local / efsdp
        # ---- compute per microbatch ---------------------------------------------------------------------------
        fwd = sum(n_of[k] * costs[k]["fwd"] for k in kinds)
        bwd = sum(n_of[k] * costs[k]["bwd"] for k in kinds)
        rec = np.zeros(n)
        act = np.zeros(n)
        transient = np.zeros(n)
        for k in kinds:
            c = costs[k]
            n_full, n_sac, n_none = ac_counts(b, n_of[k])
            rec = rec + n_full * c["rec_full"] + n_sac * c["rec_sac"]
            act = act + n_full * c["act"]["full"] + n_sac * c["act"]["sac"] + n_none * c["act"]["none"]
            tr = np.where(n_full > 0, c["act"]["none"] - c["act"]["full"],
                          np.where(n_sac > 0, c["act"]["none"] - c["act"]["sac"], 0.0))
            transient = np.maximum(transient, tr)
        rec = rec * np.where(b.ac_wraps_compile & b.compile, 2.0, 1.0)
        # output layer and loss on the last stage: GEMM T x d x V/tp, fp32 cross-entropy traffic (16 B/logit)
        logits = sh.T * V / t
        out_gemm = hw.gemm_efficiency.time_s(2.0 * logits * d, peak)
        loss_mem = 16.0 * logits / mem_bw
        fwd = fwd + np.where(has_out, out_gemm + loss_mem, 0.0)
        bwd = bwd + np.where(has_out, 2.0 * out_gemm + loss_mem, 0.0)
        # ---- communication ------------------------------------------------------------------------------------
        cm = C.rank_comm(spec, b, sh, hw, n_of, kinds, plocal, has_emb, has_out, emb_local, out_local)
        per_mb_exposed = cm["per_microbatch_exposed_s"]  # TP, CP, EP by axis (fwd + bwd + recompute)
        t_mb = fwd + bwd + rec + sum(per_mb_exposed.values())
        # FSDP / HSDP exposure per pass, from per-layer averages on this rank
        lay = np.maximum(n_layers, 1.0)
        f_l, b_l = (fwd / lay), (bwd + rec) / lay
        ag_l, red_l = cm["fsdp_ag_layer_s"], cm["fsdp_reduce_layer_s"]
        fwd_rounds = np.where((b.pp > 1) & b.raf, m_pass, 1.0)
        bwd_gather = np.where(b.raf | (b.pp > 1), 1.0, 0.0)
        exp_fwd = fwd_rounds * (ag_l + n_layers * np.maximum(0.0, ag_l - f_l))
        exp_bwd = n_layers * np.maximum(0.0, bwd_gather * ag_l + red_l - b_l) + red_l \
            + (fwd_rounds - 1.0) * bwd_gather * n_layers * np.maximum(0.0, ag_l - b_l)
        fsdp_exposed = ga * (exp_fwd + exp_bwd)
        if not hw.comm_overlap:  # gloo on CPU: every collective blocks its rank, nothing hides behind compute
            fsdp_exposed = cm["fsdp_total_s"]
        # ---- time breakdown ------------------------------------------------------------------------------------
        bubble = ga * (b.pp - 1) / b.v * t_mb
        opt = p_shard * ADAMW_BYTES_PER_PARAM / (hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency)
        tb = {"compute_forward": M * fwd, "compute_backward": M * bwd, "recompute": M * rec,
              "pp_bubble": bubble, "optimizer": opt}
        for axis, tt in per_mb_exposed.items():
            tb[f"comm_{axis}"] = tb.get(f"comm_{axis}", 0.0) + M * tt
        tb["comm_pp"] = cm["pp_exposed_s"] * M
        share = cm["fsdp_share"]  # axis -> fraction of the FSDP/HSDP comm time
        for axis, frac in share.items():
            tb[f"comm_{axis}"] = tb.get(f"comm_{axis}", 0.0) + fsdp_exposed * frac
        step = sum(tb.values())
        # ---- memory: the largest of four moments of the step ----------------------------------------------------
        inflight = _inflight(b, rank)
        base = {"parameters": p_shard * 4.0, "optimizer_states": p_shard * 8.0}
        # gradients alive at the forward-side peaks: with gradient accumulation (no PP) the sharded grads of the
        # earlier passes; with PP, once the schedule reaches its steady state (more microbatches than in flight,
        # 1F1B / interleaved) the unsharded grads accumulated in reduce_dtype — the embedding's at full vocabulary
        # size — sit beside a full set of in-flight activations; before that (or with GPipe) nothing has
        # accumulated yet
        accumulated = (ne_local + ex_local - emb_local) * rb + np.where(has_emb, V * d * rb, 0.0)
        steady = (b.pp > 1) & (b.sched != SCHED_GPIPE) & (m_pass > inflight)
        grads_prev = np.where((b.pp == 1) & (ga > 1), p_shard * 4.0, np.where(steady, accumulated, 0.0))
        sharded = (fsdp > 1) | (efsdp > 1)
        layer_w = (ne_local + ex_local - emb_local - out_local) / lay  # one block's weights on this rank
        keep_all = (ne_local + ex_local) * pb  # reshard_after_forward off: the whole stage stays unsharded
        unsh_fwd = np.where(sharded, np.where(b.raf, out_local * pb, keep_all), 0.0)
        unsh_bwd = np.where(sharded, np.where(b.raf, (out_local + 2.0 * layer_w) * pb, keep_all), 0.0)
        grad_buf = layer_w * (pb + rb)  # one block's unsharded grads and the reduce-scatter input
        acts = inflight * act
        # the loss: bf16 logits + fp32 copy + fp32 log-softmax = 10 B/logit at the end of forward under loss
        # parallel (its peak); plain cross-entropy (tp = 1) peaks in its backward with the log-softmax output,
        # the nll gradient and the log-softmax gradient alive (fp32 each): 12 B/logit (both read off the live
        # storages at the peak of executor traces). Plus the final norm's input and gathered output.
        per_logit = np.where(b.tp > 1, 10.0, 12.0)
        logits_bytes = np.where(has_out, logits * per_logit + sh.T * d * 2.0 + sh.T * d / sh.sp_div * 2.0, 0.0)
        z = np.zeros(n)
        phases = {
            "end of forward": dict(base, gradients=grads_prev, fsdp_unsharded_params=unsh_fwd, activations=acts,
                                   logits_and_loss=logits_bytes),
            "backward of the last layer": dict(base, gradients=grads_prev, fsdp_unsharded_params=unsh_bwd,
                                               fsdp_grad_buffers=grad_buf, activations=acts,
                                               recompute_transient=transient),
            # the embedding's backward (first stage) materializes a dense gradient of the full vocabulary, also
            # under TP (seen in traces with torch 2.13's RowwiseParallel embedding); without PP FSDP then
            # reduce-scatters it (input in reduce_dtype), with PP it accumulates it unsharded in reduce_dtype at full
            # vocabulary size, beside the other blocks' accumulated grads, while the other in-flight microbatches
            # keep their activations
            "end of backward": dict(base,
                                    gradients=np.where(b.pp > 1, accumulated - np.where(has_emb, V * d * rb, 0.0),
                                                       np.maximum(grads_prev, p_shard * 4.0)),
                                    fsdp_unsharded_params=np.where(sharded & b.raf, emb_local * pb, unsh_bwd),
                                    fsdp_grad_buffers=np.where(has_emb, V * d * pb + np.where(b.pp > 1, V * d * rb,
                                                                                              emb_local * rb), z),
                                    activations=np.maximum(inflight - 1.0, 0.0) * act),
            "optimizer step": dict(base, gradients=p_shard * 4.0, optimizer_temporaries=p_shard * 4.0),
        }
        totals = {k: sum(v.values()) for k, v in phases.items()}
        names = list(phases)
        which = np.argmax(np.stack([totals[k] for k in names]), axis=0)
        mb = {k: np.choose(which, [np.broadcast_to(phases[p].get(k, z), (n,)) for p in names]) for k in MEMORY_KEYS}
        peak_rank_mem = np.choose(which, [np.broadcast_to(totals[p], (n,)) for p in names])
        per_rank.append({"step": step, "tb": tb, "mem": peak_rank_mem, "mb": mb, "comm": cm["bytes"],
                         "phase": which})

    first, last = per_rank
    time_rank = np.where(last["step"] > first["step"], LAST, FIRST)
    mem_rank = np.where(last["mem"] > first["mem"], LAST, FIRST)
    step = np.where(time_rank == LAST, last["step"], first["step"])
    peak_mem = np.where(mem_rank == LAST, last["mem"], first["mem"])
    tokens = b.global_batch_size * b.seq_len
    tps = tokens / step / b.world
    mfu = _model_flops_per_token(spec, b) * tps / peak
    out = {"step_time_s": step, "peak_memory_bytes": peak_mem, "fits": peak_mem <= hw.usable_memory_bytes,
           "tokens_per_s_per_gpu": tps, "mfu": mfu, "peak_rank": mem_rank, "time_rank": time_rank}
    if detail:
        keys = sorted(set(first["tb"]) | set(last["tb"]))
        out["time_breakdown_s"] = {k: np.where(time_rank == LAST, _g(last["tb"], k, n), _g(first["tb"], k, n))
                                   for k in keys}
        out["memory_breakdown_bytes"] = {k: np.where(mem_rank == LAST, last["mb"][k], first["mb"][k])
                                         for k in MEMORY_KEYS}
        out["comm_bytes"] = first["comm"]
        out["peak_phase"] = np.where(mem_rank == LAST, last["phase"], first["phase"])
    else:
        # the dominant cost, cheaply: compare the breakdown entries of the time-critical rank
        keys = sorted(set(first["tb"]) | set(last["tb"]))
        stack = np.stack([np.where(time_rank == LAST, _g(last["tb"], k, n), _g(first["tb"], k, n)) for k in keys])
        out["dominant"] = np.array(keys)[np.argmax(stack, axis=0)]
    return out


def _g(d, k, n):
    v = d.get(k, 0.0)
    return np.broadcast_to(np.asarray(v, dtype=float), (n,))


def _model_flops_per_token(spec: ModelSpec, b: PlanBatch) -> np.ndarray:
    """PaLM/torchtitan MFU FLOPs per token (spec.flops_per_token) for each plan's sequence length."""
    base = spec.flops_per_token(0)
    per_seq = spec.flops_per_token(1) - base
    return base + per_seq * b.seq_len


def predict(spec: ModelSpec, plan: Plan, hw: HardwareProfile) -> Prediction:
    """Predict one plan (the same vectorized code on a batch of one)."""
    plan.validate_for(spec)
    hw = hw.with_nodes(plan.world_size)
    b = PlanBatch.from_plans([plan], hw.gpus_per_node)
    r = evaluate(spec, b, hw, detail=True)
    tb = {k: float(v[0]) for k, v in r["time_breakdown_s"].items() if k in TIME_KEYS or float(v[0]) > 0}
    mb = {k: float(v[0]) for k, v in r["memory_breakdown_bytes"].items()}
    comm = {k: float(v[0]) for k, v in r["comm_bytes"].items() if float(v[0]) > 0}
    pp_last = plan.pp - 1
    return Prediction(
        plan_id=plan.plan_id, model=spec.name, profile=hw.name, n_gpus=plan.world_size,
        fits=bool(r["fits"][0]), peak_memory_bytes=float(r["peak_memory_bytes"][0]),
        memory_capacity_bytes=float(hw.usable_memory_bytes),
        peak_rank=f"pp stage {pp_last if r['peak_rank'][0] == LAST else 0}",
        peak_phase=PHASES[int(r["peak_phase"][0])],
        memory_breakdown_bytes=mb, step_time_s=float(r["step_time_s"][0]), time_breakdown_s=tb, comm_bytes=comm,
        tokens_per_s_per_gpu=float(r["tokens_per_s_per_gpu"][0]), mfu=float(r["mfu"][0]), plan=plan.to_dict(),
    )
