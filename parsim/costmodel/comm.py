"""Collective bytes per (op, mesh axis) and their times, per rank and training step.

Bytes follow parsim's convention: the input tensors one rank hands to the collective, summed over a step.

* FSDP2 (per unit = transformer block, embedding, final norm + output; torchtitan wrapping): forward all-gather of
  the bf16 shard (``params/fsdp * param_bytes``), a backward re-gather when the unit was resharded after forward,
  one reduce-scatter of the unsharded gradient in ``reduce_dtype`` per pass, and for HSDP an all-reduce of the
  sharded gradient over ``dp_replicate``. torchtitan keeps the output unit unsharded after forward unless
  reshard_after_forward is ``always``. With PP, FSDP gathers once for the forwards and once for the backwards of
  a pass (measured with torch.distributed.pipelining) and reduces at the last microbatch, unless it reshards
  after every forward (then per microbatch).
* TP with sequence parallel, per layer and microbatch: forward 2 all-gathers (T*d/tp) before the column-parallel
  linears and 2 reduce-scatters (T*d) after the row-parallel ones; backward the mirror image; without SP, 2
  all-reduces (T*d) each way (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022). Recompute repeats the
  forward collectives that AC does not save (selective-op saves reduce-scatter outputs). Under SP the norm
  weights' gradients (d elements each) are all-reduced over tp in every backward (DTensor Partial -> Replicate).
* CP (torch context parallel, all-gather rotation): forward all-gathers K and V, backward all-gathers them again
  and reduce-scatters their gradients.
* EP (dp2ep): per MoE layer, dispatch and combine all-to-all of the routed tokens (T_routed x d), twice more in
  backward.
* PP: one send of the stage output (T x d / sp) per microbatch forward and one of its gradient backward.
* gradient clipping: a 4-byte all-reduce of the norm over each axis that shards gradients.
"""

from __future__ import annotations

import numpy as np

from .layers import ac_counts as _ac_counts

TWO = 2.0  # bf16 activations


def rank_comm(spec, b, sh, hw, n_of, kinds, plocal, has_emb, has_out, emb_local, out_local) -> dict:
    """Bytes per "<op>/<axis>" for one step on one rank, and the times the step model needs: exposed TP/CP/EP
    seconds per microbatch, PP send seconds per microbatch, and per-layer FSDP gather / reduce seconds."""
    n = len(b)
    T, t, sd = sh.T, sh.t, sh.sp_div
    d = float(spec.d_model)
    M = (b.grad_accum * b.n_micro).astype(float)
    ga = b.grad_accum.astype(float)
    m_pass = b.n_micro.astype(float)
    pb, rb = b.param_bytes.astype(float), b.reduce_bytes.astype(float)
    rpn = b.rpn
    tp_on, cp_on, ep_on = b.tp > 1, b.cp > 1, b.ep > 1
    full_layers = {}
    sac_layers = {}
    for k in kinds:
        full_layers[k], sac_layers[k], _ = _ac_counts(b, n_of[k])
    n_layers = sum(n_of[k] for k in kinds)
    n_full = sum(full_layers[k] for k in kinds)
    n_sac = sum(sac_layers[k] for k in kinds)

    bytes_ = {}
    times = {}

    def add(op, axis, per_call_bytes, calls, group, group_rpn, mask=True):
        """Record ``calls`` collectives of ``per_call_bytes`` each; returns the time of all of them."""
        on = (group > 1) & mask & (calls > 0)
        nb = np.where(on, per_call_bytes * calls, 0.0)
        key = f"{op}/{axis}"
        bytes_[key] = bytes_.get(key, np.zeros(n)) + nb
        tt = hw.collective_time_s(op, np.where(on, per_call_bytes, 0.0), group, group_rpn) * np.where(on, calls, 0.0)
        times[key] = times.get(key, np.zeros(n)) + tt
        return tt

    # ---- TP / SP (per microbatch) -------------------------------------------------------------------------------
    per_mb = {"tp": np.zeros(n), "cp": np.zeros(n), "ep": np.zeros(n)}
    g_tp, r_tp = b.tp, rpn["tp"]
    sp = b.sp
    ag_calls = 4.0 * n_layers + 2.0 * (n_full + n_sac)
    rs_calls = 4.0 * n_layers + 2.0 * n_full
    ar_calls = 4.0 * n_layers + 2.0 * (n_full + n_sac)
    ag_calls = ag_calls + np.where(has_emb, 1.0, 0.0) + np.where(has_out, 1.0, 0.0)
    rs_calls = rs_calls + np.where(has_emb, 1.0, 0.0) + np.where(has_out, 1.0, 0.0)
    ar_calls = ar_calls + np.where(has_emb, 1.0, 0.0) + np.where(has_out, 1.0, 0.0)
    # activations are bf16 under FSDP mixed precision. Under autocast (no data parallelism) the residual stream
    # is fp32: the forward all-gathers of norm outputs (and their recomputes), the embedding's backward all-gather
    # and the reduce-scatters of their gradients move fp32; the forward reduce-scatters of matmul outputs and the
    # backward all-gathers of their (bf16) gradients move bf16 (matched byte for byte on CPU runs)
    res = sh.res_b
    edge = np.where(has_emb, 1.0, 0.0) + np.where(has_out, 1.0, 0.0)
    ag_res_calls = 2.0 * n_layers + 2.0 * (n_full + n_sac) + edge
    rs_res_calls = 2.0 * n_layers + edge
    ag_b = (ag_res_calls * res + (ag_calls - ag_res_calls) * TWO) / np.maximum(ag_calls, 1)
    rs_b = (rs_res_calls * res + (rs_calls - rs_res_calls) * TWO) / np.maximum(rs_calls, 1)
    per_mb["tp"] += add("all_gather", "tp", T * d / t * ag_b, M * ag_calls, g_tp, r_tp, tp_on & sp) / np.maximum(M, 1)
    per_mb["tp"] += add("reduce_scatter", "tp", T * d * rs_b, M * rs_calls, g_tp, r_tp, tp_on & sp) / np.maximum(M, 1)
    per_mb["tp"] += add("all_reduce", "tp", T * d * TWO, M * ar_calls, g_tp, r_tp, tp_on & ~sp) / np.maximum(M, 1)
    # SP: the norm weights are replicated over tp but see only their sequence shard: their gradients (param dtype)
    # are all-reduced over tp when FSDP syncs gradients, once per pass (traced) — two norms per layer and the
    # final norm on the last stage
    norm_calls = 2.0 * n_layers + np.where(has_out, 1.0, 0.0)
    norm_bytes = d * np.where(b.pp > 1, rb, pb)  # with PP they were accumulated in reduce_dtype first
    per_mb["tp"] += add("all_reduce", "tp", norm_bytes, ga * norm_calls, g_tp, r_tp, tp_on & sp) / np.maximum(M, 1)

    # ---- CP ------------------------------------------------------------------------------------------------------
    kv = T * (spec.kv_dim + spec.v_dim) / t * TWO
    cp_ag = 2.0 * n_layers + n_full + n_sac
    per_mb["cp"] += add("all_gather", "cp", kv, M * cp_ag, b.cp, rpn["cp"], cp_on) / np.maximum(M, 1)
    per_mb["cp"] += add("reduce_scatter", "cp", kv * b.cp, M * n_layers, b.cp, rpn["cp"], cp_on) / np.maximum(M, 1)

    # ---- EP ------------------------------------------------------------------------------------------------------
    if True in kinds:
        a2a_calls = 4.0 * n_of[True] + 2.0 * full_layers[True]
        per_mb["ep"] += add("all_to_all", "ep", sh.Tr * d * TWO, M * a2a_calls, b.ep, rpn["ep"], ep_on) \
            / np.maximum(M, 1)

    # ---- PP ------------------------------------------------------------------------------------------------------
    v = b.v.astype(float)
    sends = np.where(b.pp > 1, (2.0 * v - 1.0), 0.0)  # first: v fwd + (v-1) bwd; last: (v-1) fwd + v bwd
    pp_rpn = np.minimum(rpn["pp"], 2)
    t_pp = add("send", "pp", T * d / sd * sh.res_b, M * sends, np.where(b.pp > 1, 2, 1), pp_rpn)  # fp32 under autocast
    pp_exposed = t_pp / np.maximum(M, 1)

    # ---- FSDP / HSDP (per pass) ----------------------------------------------------------------------------------
    fsdp, efsdp = b.fsdp, b.efsdp
    fsdp_axis_cp = b.cp > 1
    ep_any = b.ep > 1
    ne_layers = sum(n_of[k] * plocal[k][0] for k in kinds)
    ex_layers = sum(n_of[k] * plocal[k][1] for k in kinds)
    fwd_rounds = np.where((b.pp > 1) & b.raf, m_pass, 1.0)
    # with PP and no reshard-after-forward, torch's schedules still re-gather once for the backward phase
    # (measured: 2 gathers per unit and pass for 2 and for 4 microbatches)
    gathers = fwd_rounds * (1.0 + (b.raf | (b.pp > 1)))
    out_gathers = fwd_rounds * (1.0 + b.raf_always)
    f = fsdp.astype(float)
    ef = efsdp.astype(float)
    # the final norm sits in the root FSDP unit (gathered like a block); the output projection is its own unit
    norm_local = np.where(has_out, float(spec.d_model * (2 if spec.norm == "layernorm" else 1)), 0.0)
    ag_ne_bytes = ga * (gathers * (ne_layers + emb_local + norm_local) + out_gathers * (out_local - norm_local)) / f * pb
    rs_ne_bytes = ga * (ne_layers + emb_local + out_local) * rb
    lay = np.maximum(n_layers, 1.0)
    fsdp_times = {}
    for axis, mask in (("dp_shard", ~fsdp_axis_cp), ("dp_shard+cp", fsdp_axis_cp)):
        # expert parameters shard with their block when ep == 1, over the expert-FSDP group otherwise
        ex_here = np.where(ep_any, 0.0, ex_layers)
        ag_b = ag_ne_bytes + ga * gathers * ex_here / f * pb
        rs_b = rs_ne_bytes + ga * ex_here * rb
        ag_t = add("all_gather", axis, ag_b / np.maximum(ga * gathers, 1), ga * gathers, fsdp, rpn["fsdp"], mask)
        rs_t = add("reduce_scatter", axis, rs_b / np.maximum(ga, 1), ga, fsdp, rpn["fsdp"], mask)
        fsdp_times[axis] = (ag_t, rs_t)
    ex_ag = add("all_gather", "efsdp", ex_layers / ef * pb, ga * gathers, efsdp, rpn["efsdp"], ep_any)
    ex_rs = add("reduce_scatter", "efsdp", ex_layers * rb, ga, efsdp, rpn["efsdp"], ep_any)
    hsdp = add("all_reduce", "dp_replicate", (ne_layers + emb_local + out_local) / f * rb
               + np.where(b.ep_ddp, 0.0, ex_layers / ef * rb), ga, b.dp_replicate, rpn["dp_replicate"])
    edp = b.dp_replicate // np.maximum(b.ep, 1)
    edp_t = add("all_reduce", "edp", ex_layers / ef * rb, ga, edp, rpn["edp"], b.ep_ddp)
    # gradient-norm all-reduces (4 bytes, once per step)
    one = np.ones(n)
    for axis, g, r, mask in (("dp_shard", fsdp, rpn["fsdp"], ~fsdp_axis_cp), ("dp_shard+cp", fsdp, rpn["fsdp"], fsdp_axis_cp),
                             ("tp", b.tp, rpn["tp"], True), ("pp", b.pp, rpn["pp"], True),
                             ("ep", b.ep, rpn["ep"], True)):  # experts' norm summed over EP ranks
        add("all_reduce", axis, 4.0 * one, one, g, r, mask)

    ag_total = sum(v[0] for v in fsdp_times.values()) + ex_ag
    red_total = sum(v[1] for v in fsdp_times.values()) + ex_rs + hsdp + edp_t
    per_gather = ga * gathers
    ag_layer = ag_total / np.maximum(per_gather, 1) / (lay + 1.0)  # units: layers + embedding/output
    red_layer = red_total / np.maximum(ga, 1) / (lay + 1.0)
    total = ag_total + red_total
    safe = np.where(total > 0, total, 1.0)
    share = {}
    for axis in ("dp_shard", "dp_shard+cp"):
        share[axis] = np.where(total > 0, (fsdp_times[axis][0] + fsdp_times[axis][1]) / safe, 0.0)
    share["efsdp"] = np.where(total > 0, (ex_ag + ex_rs) / safe, 0.0)
    share["dp_replicate"] = np.where(total > 0, hsdp / safe, 0.0)
    share["edp"] = np.where(total > 0, edp_t / safe, 0.0)
    return {
        "bytes": bytes_,
        "per_microbatch_exposed_s": per_mb,
        "pp_exposed_s": pp_exposed,
        "fsdp_ag_layer_s": ag_layer,
        "fsdp_reduce_layer_s": red_layer,
        "fsdp_share": share,
        "fsdp_total_s": total,
    }
