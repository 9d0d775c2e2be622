"""What of the collectives the step waits for: FSDP's prefetch and reduce overlap, async TP, comm/compute
interference, and the measured framework overheads (FSDP units, DTensor TP blocks)."""

from __future__ import annotations

import numpy as np

from ..codec import PlanBatch
from ..hardware import HardwareProfile
from ..spec import ModelSpec
from ..vocab import Axis, FsdpUnit, Op, Overlap, Phase
from . import comm as C


def async_tp_exposed_fraction(b: PlanBatch, hw: HardwareProfile, tp_s, gemm_s) -> np.ndarray:
    """Fraction of the TP collectives' time left exposed. Async TP (torchtitan's micro-pipelined TP, Megatron's
    tp_comm_overlap) splits each SP all-gather / reduce-scatter into chunks that run while the matmul consuming or
    producing them works on the previous chunk, so a microbatch's TP time hides behind its GEMM time: exposed =
    max(0, TP - GEMM) [derived]. What hides still slows the GEMMs (``interference``). Without async TP, or where
    collectives block the rank (gloo), everything is exposed."""
    if not hw.comm_overlap:
        return np.ones(len(b))
    hidden = np.maximum(np.asarray(tp_s, dtype=float) - gemm_s, 0.0)
    frac = np.where(tp_s > 0, hidden / np.where(tp_s > 0, tp_s, 1.0), 1.0)
    return np.where(b.async_tp, frac, 1.0)


def framework_overheads(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, ledger, n_layers, M,
                        n_moe_layers=0) -> dict:
    """What FSDP2 and DTensor TP spend beside their collectives and the blocks' compute, from the profile's
    measured quantities (``profiler.frameworks``: a wrapped block stack minus its unwrapped twin issuing the same
    collectives, on a CPU profile's ranks or 2 GPUs; ``fit.fit_framework_overheads``) [measured]:

    * ``framework_fsdp`` = sum over the FSDP units of their collective calls (each unshard and each gradient
      reduction) x (``fsdp_call_fixed_s`` + ``fsdp_call_s_per_byte`` x the unit's unsharded gradient bytes): hooks,
      copy-in / copy-out of the all-gather buffer, chunk-cat and sharded accumulation. Per call, not per reduction:
      over eight probe sets (four sessions, 2 and 4 gloo ranks, AVX-512 and AVX2 EPYCs) the probe with reshard after
      forward (3 calls per unit: two unshards, one reduce-scatter) spent 1.45x (median; 0.98-2.71) what the one
      without (2 calls) did. Reductions are the reduce-scatters (FSDP, expert FSDP) and, where the shard group is 1
      (replicate only), the all-reduces of the whole unit; the unshards are ``comm.fsdp_gathers_per_pass`` per
      reduction, replicate only too (FSDP2's world-size-1 unshard still fills the unsharded parameters; inside a
      tiny step on 2 ranks dp_replicate 2 spent 0.15-0.32 s beside its collectives where dp_shard 2 spent 0.15-0.28,
      bench/step_collectives.py, bench/reports/fsdp-overhead/2026-11-29); units holding a MoE block's routed experts
      (the MoE block's where ep = 1, the routed experts' own where ep > 1) take the MoE probe's quantities
      (``fsdp_moe_call_*``) where the profile has them, the dense blocks' otherwise;
    * ``framework_tp`` = layers x microbatches x (``tp_block_fixed_s`` + ``tp_block_s_per_byte`` x one gathered
      activation, micro batch x sequence / cp x d_model x param bytes) where tp > 1: DTensor dispatch and
      redistribution per block, forward + backward (AC's recompute not included); MoE layers take the MoE
      block's quantities (``tp_moe_block_*``, measured on MoE blocks under TP: the gather into a replicated
      DTensor, the partial-sum output, the DTensor router, experts and shared-expert linears) where the profile
      has them, the dense block's otherwise;
    * ``framework_ep`` = MoE layers x microbatches x (``ep_block_fixed_s`` + ``ep_block_s_per_byte`` x the rank's
      routed rows, micro batch x sequence / cp (/ tp where whole experts sit under TP: the rank routes its share)
      x top_k x d_model x param bytes) where ep > 1: the routing counts read on the host, the permutations around
      the all-to-alls and their autograd, forward + backward.
    * ``framework_pp`` = stage actions x (``pp_action_fixed_s`` + ``pp_action_s_per_byte`` x the activation a
      stage sends, micro batch x sequence / cp (/ tp under sequence parallelism) x d_model x param bytes) where
      pp > 1, with 2 actions (forward, backward) per microbatch and local stage: torch's schedule and
      ``PipelineStage`` beside the compute and the transfers. On a 2-core AVX2 EPYC it is within the probe's noise
      of nothing: GPipe over 2 and 4 gloo ranks, one 128 / 256 / 512-wide block per stage, 8 microbatches of 64
      tokens, ran -3.2 to +2.4 ms an action against its plain send / recv twin over seven probe sets (15
      repetitions each), fitted to 0 [measured].

    CPU work, so ranks sharing cores stretch it like compute: by ``compute_scale`` / ``framework_probe_compute_scale``
    [derived], the plan's core sharing over the one the probe ran under (CPU profiles run it on their
    own ranks, so the quantities carry the sharing already: the ratio is 1 but for validate's per-round drift of
    ``compute_scale``; a probe on 2 ranks, 1). Profiles without the quantities (spec sheets, profiles measured
    before) add nothing and keep their breakdown keys."""
    c, out = hw.corrections, {}
    scale = float(c.get("compute_scale", 1.0)) / float(c.get("framework_probe_compute_scale", 1.0))
    if "fsdp_call_fixed_s" in c:
        out["framework_fsdp"] = _fsdp_calls_s(b, c, ledger) * scale
    if "tp_block_fixed_s" in c:
        out["framework_tp"] = _tp_blocks_s(spec, b, c, n_layers, n_moe_layers, M) * scale
    if "ep_block_fixed_s" in c and spec.moe is not None:
        out["framework_ep"] = _ep_blocks_s(spec, b, c, n_moe_layers, M) * scale
    if "pp_action_fixed_s" in c:
        out["framework_pp"] = _pp_actions_s(spec, b, c, M) * scale
    return out


def _tp_blocks_s(spec: ModelSpec, b: PlanBatch, c: dict, n_layers, n_moe_layers, M) -> np.ndarray:
    """``framework_overheads``' ``framework_tp`` before the core-sharing scale."""
    act = b.micro_batch_size * b.seq_len / np.maximum(b.cp, 1) * float(spec.d_model) * b.param_bytes
    per_block = float(c["tp_block_fixed_s"]) + float(c["tp_block_s_per_byte"]) * act
    per_moe = per_block
    if "tp_moe_block_fixed_s" in c:
        per_moe = float(c["tp_moe_block_fixed_s"]) + float(c["tp_moe_block_s_per_byte"]) * act
    blocks = (n_layers - n_moe_layers) * per_block + n_moe_layers * per_moe
    return np.where(b.tp > 1, M * blocks, 0.0)


def _ep_blocks_s(spec: ModelSpec, b: PlanBatch, c: dict, n_moe_layers, M) -> np.ndarray:
    """``framework_overheads``' ``framework_ep`` before the core-sharing scale."""
    assert spec.moe is not None
    share = np.where((b.tp > 1) & (b.etp_eff == 1), b.tp, 1)
    rows = b.micro_batch_size * b.seq_len / np.maximum(b.cp, 1) / share * spec.moe.top_k
    per_block = float(c["ep_block_fixed_s"]) + float(c["ep_block_s_per_byte"]) * rows * spec.d_model * \
        b.param_bytes
    return np.where(b.ep > 1, n_moe_layers * M * per_block, 0.0)


def _pp_actions_s(spec: ModelSpec, b: PlanBatch, c: dict, M) -> np.ndarray:
    """``framework_overheads``' ``framework_pp`` before the core-sharing scale."""
    sent = b.micro_batch_size * b.seq_len / np.maximum(b.cp, 1) / np.where(b.sequence_parallel, b.tp, 1) * \
        float(spec.d_model) * b.param_bytes
    per_action = float(c["pp_action_fixed_s"]) + float(c["pp_action_s_per_byte"]) * sent
    return np.where(b.pp > 1, 2.0 * M * b.pp_stages_per_rank * per_action, 0.0)


def interference(hw: HardwareProfile, ledger) -> np.ndarray:
    """Compute slowed by the collectives that run beside it: ``comm_interference`` x the hidden collective time
    (raw - exposed). NCCL kernels occupy SMs and HBM bandwidth while a GEMM runs: overlapped compute slows by 18.9%
    of its time on average and 40% at most on A100/H100 (arXiv 2507.03114); per second of hidden collective the
    loss is of the same order. Profiles carry it as ``corrections.comm_interference`` (spec-sheet: the public
    average, then fitted by `parsim calibrate`); 0 where collectives block the rank (gloo on CPU)."""
    k = float(hw.corrections.get("comm_interference", 0.0))
    hidden = sum((r.time_s - r.exposed_s for r in ledger.records), np.zeros(ledger.n))
    return k * np.maximum(hidden, 0.0)


def fsdp_exposed(b: PlanBatch, hw: HardwareProfile, cm, fwd, bwd, n_layers) -> np.ndarray:
    """Exposed FSDP/HSDP seconds per step on one rank. FSDP2 prefetches one unit ahead: a unit's all-gather hides
    behind the previous unit's forward (and, when resharded, the next unit's backward); reduce-scatters (and HSDP
    all-reduces) hide behind the next unit's backward; the first gather and the last reduce of a round are exposed.
    A pass that does not reduce (``grad_sync`` once: all but the last) exposes only its gathers.
    Per-unit times are the ledger's totals spread over the rank's layers + 1 (embedding / output) units; gloo on
    CPU blocks the rank, so there everything is exposed."""
    ag_total, red_total = cm.fsdp_gather_total_s, cm.fsdp_reduce_total_s  # comm.RankComm
    if not hw.comm_overlap:
        return ag_total + red_total
    ga, m_pass = b.grad_accum.astype(float), b.n_micro.astype(float)
    # gathers per unit and pass (comm._fsdp_units): forwards (every microbatch's when resharded under PP), and
    # one backward re-gather when resharded after forward
    fwd_rounds = np.where((b.pp > 1) & b.raf, m_pass, 1.0)
    bwd_gather = np.where(b.raf, 1.0, 0.0)
    lay = np.maximum(n_layers, 1.0)
    rp = b.reduce_passes.astype(float)  # passes that reduce (all, or the last alone with grad_sync once)
    ag_l = ag_total / np.maximum(ga * (fwd_rounds + bwd_gather), 1) / (lay + 1.0)
    red_l = red_total / np.maximum(rp, 1) / (lay + 1.0)
    f_l, b_l = fwd / lay, bwd / lay
    exp_fwd = fwd_rounds * (ag_l + n_layers * np.maximum(0.0, ag_l - f_l))
    exp_bwd = n_layers * np.maximum(0.0, bwd_gather * ag_l + red_l - b_l) + red_l
    exp_bwd_unreduced = n_layers * np.maximum(0.0, bwd_gather * ag_l - b_l)
    # (where every pass reduces, the sum in the order it had before grad_sync: predictions stay bit-identical)
    return np.where(rp == ga, ga * (exp_fwd + exp_bwd), ga * exp_fwd + rp * exp_bwd + (ga - rp) * exp_bwd_unreduced)


def set_exposed(ledger, fsdp_exposed, fsdp_total, tp_ratio) -> None:
    """Exposed seconds of every record: CP/EP/PP records are exposed as they are, TP's per-microbatch records by
    ``tp_ratio`` (async TP); the FSDP family shares ``fsdp_exposed`` in proportion to its records' raw times."""
    safe = np.where(fsdp_total > 0, fsdp_total, 1.0)
    for r in ledger.records:
        if r.overlap in C.FSDP_OVERLAPS:
            r.exposed_s = fsdp_exposed * r.time_s / safe
        elif r.axis == Axis.TP and r.phase != Phase.STEP:
            r.exposed_s = r.time_s * tp_ratio
        else:
            r.exposed_s = r.time_s


def _fsdp_calls_s(b: PlanBatch, c: dict, ledger) -> np.ndarray:
    """FSDP2's per-call overhead summed over the units' reductions and the unshards that go with each."""
    t = np.zeros(len(b))
    for r in ledger.records:
        if r.overlap != Overlap.FSDP_REDUCE:
            continue
        # FSDP's reduce-scatter over its shard group (dp_shard, dp_shard+cp, efsdp; not the distributed
        # optimizer's over dp_replicate or edp), or HSDP's all-reduce over dp_replicate (Megatron EP's over edp
        # is not FSDP)
        whole_unit = r.op == Op.REDUCE_SCATTER and r.axis not in (Axis.DP_REPLICATE, Axis.EDP)
        replicate_only = r.op == Op.ALL_REDUCE and r.axis == Axis.DP_REPLICATE
        if not (whole_unit or replicate_only):
            continue
        on = np.ones(len(b), bool) if whole_unit else (b.fsdp == 1)
        gathers = C.fsdp_gathers_per_pass(b, output_unit=r.unit == FsdpUnit.OUTPUT)
        per_call = float(c["fsdp_call_fixed_s"]) + float(c["fsdp_call_s_per_byte"]) * r.bytes_per_call
        if "fsdp_moe_call_fixed_s" in c:
            experts = ((r.unit == FsdpUnit.MOE_BLOCK) & (b.ep == 1)) | (r.unit == FsdpUnit.EXPERTS)
            per_moe = float(c["fsdp_moe_call_fixed_s"]) + float(c["fsdp_moe_call_s_per_byte"]) * r.bytes_per_call
            per_call = np.where(experts, per_moe, per_call)
        # the unit's unshards: ``gathers`` per pass, in every pass, also those that do not reduce
        rp = b.reduce_passes
        unshards = np.where(rp == b.grad_accum, gathers, gathers * b.grad_accum / np.maximum(rp, 1))
        t = t + np.where(on & (r.calls > 0), r.calls * (1.0 + unshards) * per_call, 0.0)
    return t
