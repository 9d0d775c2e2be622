"""Step time, memory and communication of a batch of plans; ``predict`` for one plan. This module combines what
its siblings compute: ``compute`` (a layer's and a rank's compute, the optimizer), ``comm`` (the collective ledger),
``overlap`` (what of it the step waits for, framework overheads), ``pipeline`` (the bubble), ``phases`` (memory
moments, with ``memory``'s op-level timeline), ``reserved`` (the caching allocator).

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
  Where ranks share cores (CPU, ``compute_scale`` > 1) the schedule's step is simulated action by action with the
  cores shared by the ranks that have work (``pipeline.shared_makespan``).
* optimizer: AdamW reads param, grad, exp_avg, exp_avg_sq (fp32) and writes three of them: 28 B/param, plus the
  gradient-norm read of 4 B/param, at HBM speed.
* measured corrections of the profile: ``compute_scale`` (ranks sharing cores) multiplies compute (a pipeline rank
  heavier than the mean stage less: ``pipeline.shared_cores``); the per-layer
  overheads of ``block_overheads`` (one real block timed by the profiler minus the model's time for it: dispatch,
  autograd and small-kernel costs) is added per layer and microbatch (selective AC recomputes half of it).

Memory (sums exactly to ``peak_memory_bytes``): the largest of five moments of the step, each itemized:
end of forward (activations of the in-flight microbatches, logits and loss), backward of the last layer (FSDP
unsharded params of two blocks and one block's gradient buffers, the recompute transient), with PP the backward
of a later microbatch (beside the gradients the first one accumulated), end of backward (the
embedding's dense full-vocabulary gradient on the first stage) and the optimizer step (one fp32 temporary per
parameter of the larger param group, foreach AdamW). All hold the sharded fp32 params and AdamW states. The moments
come from a replay of the step (``memory.simulate``; interleaved schedules replay torch's own action list,
``memory.simulate_actions``).

What the framework's kernels keep is a plan option, not a factor: ``fused_loss`` (a fused cross-entropy: the
logits and one gradient of their size, 2 x param_dtype bytes per logit, against torch's 12 B/logit on an fp32 copy)
and ``te_layers`` (Megatron-Core's Transformer Engine layers: sequence-parallel norm outputs kept as local shards,
in float8 when float8 is on, and all-gathered again in the backward; fused SwiGLU / RoPE keeping their inputs only;
a vocab-parallel embedding whose gradient is its shard; see ``layers.saved_tensors``); so is the attention kernel
(``attention_kernel``: FlashAttention-2 class, or the Triton FlashAttention kernel at a public benchmark's ratio,
``compute._attention_item``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..codec import GROUPS, PlanBatch, canonical_axes, canonical_key, encode, validate_plan
from ..hardware import HardwareProfile
from ..ordering import ac_wraps_compile_recompute_factor
from ..plan import Plan, interval_group
from ..results import Prediction
from ..spec import ModelSpec
from ..vocab import Axis, Overlap
from . import comm as C
from .compute import RankCompute, block_overheads, layer_costs, optimizer_time_s, rank_compute
from .distinct import on_distinct_rows
from .layers import (
    FIRST,
    LAST,
    Shapes,
    ac_counts,
    core_attn_counts,
    fsdp_shard,
    layer_tensors,
    rank_ckpt,
    rank_layers,
)
from .memory import MEMORY_KEYS, PHASES
from .overlap import async_tp_exposed_fraction, framework_overheads, fsdp_exposed, interference, set_exposed
from .phases import (
    RankPeak,
    optimizer_temporaries,
    rank_memory,
    rank_params,
    rank_peak,
    rank_reserved_bound,
    static_bytes,
)
from .pipeline import shared_cores
from .reserved import RESERVED_KEYS

TIME_KEYS = ("compute_forward", "compute_backward", "recompute", "pp_bubble", "optimizer")


def evaluate(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, detail: bool = False,
             memory_only: bool = False, time_bound: bool = False, above_bytes: float = math.inf,
             time_only: bool = False) -> dict:
    """Evaluate every plan of ``b``. Returns arrays: step_time_s, peak_memory_bytes, fits, tokens_per_s_per_gpu,
    mfu, peak_rank (0 = first stage, 1 = last), and with ``detail`` the breakdowns, comm bytes and times, and the
    two ranks' ledgers. ``memory_only``: only peak_memory_bytes, without the collectives and step time (what
    search's memory screen needs; the same numbers as the full evaluation). ``above_bytes`` (with
    ``memory_only``): a plan whose parameters, optimizer states and gradients alone (``static_bytes``, a lower
    bound of its peak) exceed it is not replayed on the timeline, its peak given as at least that bound (it does
    not fit either way). ``time_bound``: only ``step_time_lower_bound_s`` (``_time_lower_bound``), without the
    collectives and memory. ``time_only``: the step time (the same as the full evaluation's; step time does
    not depend on memory) with tokens/s, MFU and the dominant cost, without replaying memory (what calibration's
    fits and the search's full evaluations need: the search has every plan's memory from its screen)."""
    if time_bound:
        return {"step_time_lower_bound_s": step_time_lower_bound(spec, b, hw)}
    sh = Shapes(spec, b)
    kinds = block_kinds(spec)
    costs = kind_costs(spec, b, hw, kinds, block_overheads(hw), times=not memory_only)
    per_rank: list = []
    rvs = rank_views(spec, b, kinds)
    cs = [rank_compute(spec, b, sh, hw, rv, costs) for rv in rvs]
    work = _stage_work(spec, b, cs, rvs)
    mean_mb = _mean_stage_compute(work, b)
    for rank, rv, c in zip((FIRST, LAST), rvs, cs, strict=True):
        if time_only:
            per_rank.append(_evaluate_rank(spec, b, sh, hw, rank, rv, c, mean_mb, work, with_memory=False))
        elif memory_only:
            phases, _ = rank_memory(spec, b, sh, rank, rv, c, above_bytes)
            pk = rank_peak(b, sh, hw, rv, c, phases)
            static = static_bytes(b, rv)
            per_rank.append([np.where(static > above_bytes, np.maximum(v, static), v)
                             for v in (pk.memory_bytes, pk.reserved_bytes)])
        else:
            per_rank.append(_evaluate_rank(spec, b, sh, hw, rank, rv, c, mean_mb, work))
    if time_only:
        return _combine_time(spec, b, hw, per_rank)
    if memory_only:  # per rank: (allocated peak, reserved) with the static bound
        return {"peak_memory_bytes": np.maximum(per_rank[0][0], per_rank[1][0]),
                "reserved_memory_bytes": np.maximum(per_rank[0][1], per_rank[1][1])}
    return _combine(spec, b, hw, per_rank, detail)




def memory_lower_bound(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, any_reshard: bool = False) -> np.ndarray:
    """A lower bound of every plan's reserved memory, without the timeline [derived]: the larger of the two ranks'
    ``phases.rank_reserved_bound``: the allocated peak's bound (reserved memory is at least the allocated peak,
    ``reserved.reserved_breakdown``: every pool is mapped in whole pages of what it holds), with the
    reduce-scatter stream's pool beside it where the peak is known to come before the optimizer step under PP.
    Shrunk by one part in 1e9: it sums the same terms in another order than the timeline. ``any_reshard``: a bound
    for the plans' every reshard-after-forward choice."""
    sh = Shapes(spec, b)
    kinds = block_kinds(spec)
    costs = kind_costs(spec, b, hw, kinds, block_overheads(hw), times=False)
    out = np.zeros(len(b))
    for rank, rv in zip((FIRST, LAST), rank_views(spec, b, kinds), strict=True):
        c = rank_compute(spec, b, sh, hw, rv, costs)
        out = np.maximum(out, rank_reserved_bound(spec, b, sh, rank, rv, c, hw.comm_overlap, any_reshard))
    return out * (1.0 - 1e-9)


def optimizer_step_lower_bound(spec: ModelSpec, b: PlanBatch) -> np.ndarray:
    """A lower bound of every plan's reserved memory from its parameters alone [derived]: at the optimizer step each
    rank holds its fp32 parameters and Adam states (12 B per parameter it steps), its sharded fp32 gradients (4 B per
    parameter it holds) and the foreach step's temporaries (``phases.optimizer_temporaries``): the optimizer moment
    of ``phases._rank_moment_bounds`` without the pipeline's receive buffers. It reads the degrees, the stages per
    rank and the pinned options, not the batch split nor AC, compile, float8 or reshard (search computes it once
    per (degrees, stages per rank))."""
    out = np.zeros(len(b))
    for rv in rank_views(spec, b, block_kinds(spec)):
        p_shard, p_opt = rank_params(b, rv)
        out = np.maximum(out, p_opt * 12.0 + p_shard * 4.0 + optimizer_temporaries(b, rv))
    return out * (1.0 - 1e-9)


def block_kinds(spec: ModelSpec) -> list[bool]:
    """The model's block kinds (False dense, True MoE) that it has layers of."""
    return [k for k in (False, True) if (spec.n_moe_layers if k else spec.n_dense_layers) > 0]


def rank_views(spec: ModelSpec, b: PlanBatch, kinds: list) -> list[C.RankView]:
    """The ``RankView`` of the first and of the last pipeline rank, computed once per distinct plan they can tell
    apart (``distinct.on_distinct_rows``)."""
    return on_distinct_rows(_rank_views_of_rows, b, spec, tuple(kinds))


def _rank_views_of_rows(b: PlanBatch, spec: ModelSpec, kinds: tuple) -> list[C.RankView]:
    layers = rank_layers(spec, b.pp, b.pp_stages_per_rank)
    plocal, pshard = layer_params(spec, b, list(kinds))
    return [_rank_view(spec, b, rank, layers, list(kinds), plocal, pshard) for rank in (FIRST, LAST)]


def kind_costs(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, kinds: list, overheads: tuple,
               times: bool = True) -> dict:
    """``compute.layer_costs`` of every block kind, computed once per distinct plan the costs can tell apart
    (``distinct.on_distinct_rows``: a search batch holds few distinct local shapes)."""
    return {k: on_distinct_rows(_kind_costs_of_rows, b, spec, hw, k, overheads, times) for k in kinds}


def _kind_costs_of_rows(b: PlanBatch, spec: ModelSpec, hw: HardwareProfile, moe: bool, overheads: tuple,
                        times: bool):
    return layer_costs(spec, b, Shapes(spec, b), hw, moe, overheads, times=times)


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


def _stage_work(spec: ModelSpec, b: PlanBatch, cs: list[RankCompute], rvs: list) -> tuple:
    """(forward, backward + recompute) per microbatch of the first rank, of the last, and of the layers neither
    holds (which the ranks between them run), each at its own kind's cost (forward, backward, and the recompute its
    AC mode gives; under ``layer:N`` the middle layers are checkpointed in the share the two ranks' are)."""
    middle_f, middle_b = np.zeros(len(b)), np.zeros(len(b))
    for k in rvs[0].kinds:
        held = rvs[0].n_of[k] + rvs[1].n_of[k]
        rest = np.maximum(float(spec.n_moe_layers if k else spec.n_dense_layers) - held, 0.0)
        ckpt_share = (rvs[0].n_ckpt[k] + rvs[1].n_ckpt[k]) / np.maximum(held, 1.0)
        n_full, n_sac, _ = ac_counts(b, rest, rest * ckpt_share)
        c = cs[0].costs[k]
        rec = (n_full * c.rec_full + n_sac * c.rec_sac + core_attn_counts(b, rest) * c.rec_attn) * np.where(
            b.ac_wraps_compile & b.compile, ac_wraps_compile_recompute_factor(), 1.0)
        middle_f, middle_b = middle_f + rest * c.fwd, middle_b + rest * c.bwd + rec
    return (cs[0].fwd, cs[0].bwd + cs[0].rec), (cs[1].fwd, cs[1].bwd + cs[1].rec), (middle_f, middle_b)


def _mean_stage_compute(work: tuple, b: PlanBatch) -> np.ndarray:
    """Compute per microbatch of the pipeline's mean stage: every rank's work over pp [derived], from
    ``_stage_work``; without PP the one rank's. Counting the middle ranks as the first would be right only where
    the first rank's layers are like the rest: tiny-moe's first layer is dense and the others MoE (DeepSeek-V3:
    three dense layers first), and on tiny-moe pp 4 that mean was 8% short of the stages' (measured 4-rank
    blocks: 32.2 against 35.0 ms a microbatch at single-core speed)."""
    first, last, middle = (sum(fb) for fb in work)
    return np.where(b.pp > 1, (first + last + middle) / b.pp.astype(float), first)  # pp 2: no middle layers


def step_time_lower_bound(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile) -> np.ndarray:
    """A lower bound of every plan's step time over every device order (the larger of its two ranks'
    ``_time_lower_bound``); the microbatch's compute is computed once per distinct plan it can tell apart."""
    kinds = block_kinds(spec)
    compute_mb, mean_mb = on_distinct_rows(_microbatch_compute, b, spec, hw, tuple(kinds))
    counts = _rpn_counts(b, max(1, int(hw.gpus_per_node)))
    comm_mb = on_distinct_rows(_exposed_comm_bound, b, spec, hw, tuple(kinds), counts)
    comm_step = on_distinct_rows(_exposed_step_comm_bound, b, spec, hw, tuple(kinds), counts)
    M = (b.grad_accum * b.n_micro).astype(float)
    out = np.full(len(b), -np.inf)
    for rv, c_mb, e_mb, e_step in zip(rank_views(spec, b, kinds), compute_mb, comm_mb, comm_step, strict=True):
        t = _time_lower_bound(b, hw, c_mb, rank_params(b, rv)[1], rv.n_tensors, mean_mb)
        out = np.maximum(out, t + M * e_mb + e_step)
    return out


def _exposed_comm_bound(b: PlanBatch, spec: ModelSpec, hw: HardwareProfile, kinds: tuple,
                        counts: np.ndarray) -> list:
    """Per rank, the seconds per microbatch whose ``M x`` plus ``_exposed_step_comm_bound``'s seconds per step
    bounds the exposed seconds of the step's TP, CP and EP collectives from below over every device order
    [derived]: those records are exposed as they are (TP's by async TP's fraction, >= 0: left out where async TP
    is on, ``overlap.set_exposed``); a record's time is its calls (a multiple of the microbatches, or per step:
    ``comm.tp_partial_grad_records``, left out here) times one call's, so the ledger of one microbatch gives the
    part per microbatch; and a group's ranks per node is one of 1 .. gpus per node in any device order
    (``counts``, of the whole batch: ``_rpn_counts``), so each record is at least its least time over those
    (``Ledger.time_with``; each on its own: one plan's groups sit differently)."""
    sh = Shapes(spec, b)
    n = len(b)
    object.__setattr__(b, "rpn", {g: np.ones(n, dtype=np.int64) for g in GROUPS})
    out = []
    for rv in _layer_views(spec, b, list(kinds)):
        ac = {k: ac_counts(b, rv.n_of[k], rv.n_ckpt[k]) for k in kinds}
        n_full, n_sac = sum(ac[k][0] for k in kinds), sum(ac[k][1] for k in kinds)
        out.append(sum(_exposed_records(spec, b, sh, hw, rv, 1.0, n_full, n_sac, ac, counts), np.zeros(n)))
    return out


def _exposed_step_comm_bound(b: PlanBatch, spec: ModelSpec, hw: HardwareProfile, kinds: tuple,
                             counts: np.ndarray) -> list:
    """Per rank, the seconds per step of ``_exposed_comm_bound``'s records: the TP all-reduces of partial weight
    gradients (``comm.tp_partial_grad_records``), each at its least time over ``counts``. Computed apart from the
    part per microbatch because they alone read how often gradients are reduced (the batch split and the data
    parallel degrees), which the part per microbatch does not."""
    n = len(b)
    object.__setattr__(b, "rpn", {g: np.ones(n, dtype=np.int64) for g in GROUPS})
    out = []
    for rv in _layer_views(spec, b, list(kinds)):
        led = C.Ledger(hw, n)
        C.tp_partial_grad_records(led, spec, b, rv)
        out.append(sum(_least_exposed(led, b, counts), np.zeros(n)))
    return out


def _exposed_records(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, rv: C.RankView, m: float,
                     n_full, n_sac, ac, counts: np.ndarray) -> list:
    """Each exposed TP / CP / EP record of ``m`` microbatches but those per step, at its least time over the
    ranks-per-node ``counts`` (TP's 0 under async TP)."""
    led = C.Ledger(hw, len(b))
    C.per_microbatch_exposed_records(led, spec, b, sh, rv, np.full(len(b), m), n_full, n_sac, ac, per_step=False)
    return _least_exposed(led, b, counts)


def _least_exposed(led: C.Ledger, b: PlanBatch, counts: np.ndarray) -> list:
    """Each exposed TP / CP / EP record of ``led`` at its least time over the ranks-per-node ``counts`` (TP's 0
    under async TP)."""
    out = []
    for rec in led.records:
        if rec.overlap != Overlap.EXPOSED or rec.axis not in (Axis.TP, Axis.CP, Axis.EP):
            continue
        if not rec.calls.any():  # (no call in this batch: nothing to time)
            out.append(np.zeros(len(b)))
            continue
        least = led.time_with(rec, counts[:, None]).min(axis=0)  # (every count at once: counts x plans)
        out.append(np.where((rec.axis == Axis.TP) & b.async_tp, 0.0, least))
    return out


def _rpn_counts(b: PlanBatch, gpn: int) -> np.ndarray:
    """The ranks per node a TP, CP or EP group can have in some device order: 1 .. ``gpn``; where ``gpn`` and every
    degree are powers of two, only powers of two (``plan.ranks_per_node`` clamps ``gpn`` // a product of degrees
    to a degree, and ``codec.group_rpn`` takes minima and quotients of such counts)."""
    degrees = np.concatenate([np.asarray(getattr(b, a)).ravel() for a in ("pp", "dp_replicate", "dp_shard", "cp",
                                                                        "tp", "ep", "etp")])
    if gpn & (gpn - 1) == 0 and not np.any(degrees & (degrees - 1)):
        return 2 ** np.arange(gpn.bit_length(), dtype=np.int64)
    return np.arange(1, gpn + 1, dtype=np.int64)


def _microbatch_compute(b: PlanBatch, spec: ModelSpec, hw: HardwareProfile, kinds: tuple) -> tuple:
    """(per rank: forward + backward + recompute seconds of one microbatch, the pipeline's mean stage's), from the
    ranks' layers alone (``_layer_views``: no parameter shards, so the data-parallel degrees are not read)."""
    sh = Shapes(spec, b)
    costs = kind_costs(spec, b, hw, list(kinds), block_overheads(hw))
    views = _layer_views(spec, b, list(kinds))
    cs = [rank_compute(spec, b, sh, hw, rv, costs) for rv in views]
    mean_mb = _mean_stage_compute(_stage_work(spec, b, cs, views), b)
    return [c.fwd + c.bwd + c.rec for c in cs], mean_mb


def _layer_views(spec: ModelSpec, b: PlanBatch, kinds: list) -> list[C.RankView]:
    """The first and last pipeline ranks' layers, checkpointed layers and ends: the part of ``RankView`` that
    ``rank_compute`` and ``_stage_work`` read."""
    layers = rank_layers(spec, b.pp, b.pp_stages_per_rank)
    ckpt = rank_ckpt(spec, b)
    out = []
    for rank in (FIRST, LAST):
        has_emb = np.ones(len(b), bool) if rank == FIRST else b.pp == 1
        has_out = b.pp == 1 if rank == FIRST else np.ones(len(b), bool)
        n_of = {False: layers["dense"][rank].astype(float), True: layers["moe"][rank].astype(float)}
        z = np.zeros(len(b))
        out.append(C.RankView(n_of, kinds, {}, has_emb, has_out, z, z,
                              n_ckpt={k: ckpt[k][rank].astype(float) for k in (False, True)}))
    return out


def _time_lower_bound(b: PlanBatch, hw: HardwareProfile, compute_mb, p_opt, n_tensors,
                      mean_mb=None) -> np.ndarray:
    """A lower bound of one rank's step time over every device order [derived]: ``_evaluate_rank``'s step is
    compute (forward, backward, recompute: the same in every device order) + bubble + optimizer + exposed
    collectives (>= 0) + interference (``comm_interference`` x hidden time >= 0 when the factor is >= 0). The
    bubble grows with the microbatch time, which is compute + exposed per-microbatch collectives, so the bubble of
    the compute alone bounds it from below. Collectives are the only term that depends on the device order; search
    skips the orders of a (plan, options) row whose bound already loses (``parsim.search``). A profile with a
    negative interference factor gets no bound (-inf). ``compute_mb``: the rank's forward, backward and recompute
    seconds of one microbatch."""
    if float(hw.corrections.get("comm_interference", 0.0)) < 0.0:
        return np.full(len(b), -np.inf)
    ga = b.grad_accum.astype(float)
    M = ga * b.n_micro
    opt = optimizer_time_s(hw, p_opt, n_tensors)
    factor, bub = shared_cores(b, hw, M, ga, compute_mb, compute_mb, mean_mb)
    return M * compute_mb * factor + opt + bub


@dataclass(frozen=True)
class RankStep:
    """One rank's step: its time (itemized, summing to ``step_s``), its collectives' ledger and its memory peak
    (arrays over the batch)."""

    step_s: np.ndarray
    time_breakdown_s: dict  # component -> seconds
    ledger: C.Ledger
    peak: RankPeak | None


def _evaluate_rank(spec: ModelSpec, b: PlanBatch, sh: Shapes, hw: HardwareProfile, rank: int, rv: C.RankView,
                   c: RankCompute, mean_mb, work=None, with_memory: bool = True) -> RankStep:
    """Step time (itemized) and peak memory (itemized, the largest of five moments; None without
    ``with_memory``) of one rank, from its compute ``c``, the pipeline's mean stage compute ``mean_mb`` and its
    ranks' work (``_stage_work``)."""
    phases, p_opt = rank_memory(spec, b, sh, rank, rv, c) if with_memory else (None, rank_params(b, rv)[1])
    ga = b.grad_accum.astype(float)
    M = ga * b.n_micro  # microbatches per step per rank
    cm = C.rank_comm(spec, b, sh, hw, rv)
    per_mb_exposed = dict(cm.per_microbatch_exposed_s)  # TP, CP, EP by axis (fwd + bwd + recompute)
    tp_ratio = async_tp_exposed_fraction(b, hw, per_mb_exposed["tp"], c.gemm)
    per_mb_exposed["tp"] = per_mb_exposed["tp"] * tp_ratio
    t_mb = c.fwd + c.bwd + c.rec + sum(per_mb_exposed.values())
    fsdp_exposed_s = fsdp_exposed(b, hw, cm, c.fwd, c.bwd + c.rec, rv.n_layers)
    set_exposed(cm.ledger, fsdp_exposed_s, cm.fsdp_gather_total_s + cm.fsdp_reduce_total_s, tp_ratio)
    opt = optimizer_time_s(hw, p_opt, rv.n_tensors)
    # ranks sharing cores: a pipeline rank heavier than the mean stage is stretched less (pipeline.shared_cores)
    share, bub = shared_cores(b, hw, M, ga, c.fwd + c.bwd + c.rec, t_mb, mean_mb, work)
    tb = {"compute_forward": M * c.fwd * share, "compute_backward": M * c.bwd * share, "recompute": M * c.rec * share,
          "pp_bubble": bub, "optimizer": opt}
    for axis, tt in cm.ledger.exposed_by_axis().items():  # comm_<axis>: exposed seconds of its collectives
        tb["comm_" + axis] = tt
    tb["comm_interference"] = interference(hw, cm.ledger)
    tb.update(framework_overheads(spec, b, hw, cm.ledger, rv.n_layers, M, rv.n_of.get(True, 0)))
    return RankStep(step_s=sum(tb.values()), time_breakdown_s=tb, ledger=cm.ledger,
                    peak=rank_peak(b, sh, hw, rv, c, phases) if phases is not None else None)


def _combine(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, per_rank: list, detail: bool) -> dict:
    """The plan's step time is its slowest rank's, its memory the larger peak; comm_bytes are rank 0's."""
    first, last = per_rank
    out = _combine_time(spec, b, hw, per_rank)
    mem_rank = np.where(last.peak.memory_bytes > first.peak.memory_bytes, LAST, FIRST)
    peak_mem = np.where(mem_rank == LAST, last.peak.memory_bytes, first.peak.memory_bytes)
    # what must fit is what the allocator reserves (its rank can differ from the allocated peak's)
    rsv_rank = np.where(last.peak.reserved_bytes > first.peak.reserved_bytes, LAST, FIRST)
    reserved = np.where(rsv_rank == LAST, last.peak.reserved_bytes, first.peak.reserved_bytes)
    out.update({"peak_memory_bytes": peak_mem, "fits": reserved <= hw.usable_memory_bytes,
                "reserved_memory_bytes": reserved, "peak_rank": mem_rank})
    tb = out.pop("time_breakdown_s")
    if not detail:
        return out
    out["time_breakdown_s"] = tb
    time_rank = out["time_rank"]
    out["memory_breakdown_bytes"] = {k: np.where(mem_rank == LAST, last.peak.breakdown_bytes[k],
                                                 first.peak.breakdown_bytes[k]) for k in MEMORY_KEYS}
    out["reserved_breakdown_bytes"] = {k: np.where(rsv_rank == LAST, last.peak.reserved_breakdown_bytes[k],
                                                   first.peak.reserved_breakdown_bytes[k]) for k in RESERVED_KEYS}
    out["comm_bytes"] = first.ledger.bytes_by_key()
    out["peak_phase"] = np.where(mem_rank == LAST, last.peak.phase, first.peak.phase)
    out["comm_time_s"] = _pick(first.ledger.time_by_key(), last.ledger.time_by_key(), time_rank, len(b))
    out["exposed_comm_time_s"] = _pick(first.ledger.exposed_by_key(), last.ledger.exposed_by_key(), time_rank, len(b))
    out["ledgers"] = (first.ledger, last.ledger)
    out["ranks"] = per_rank
    return out


def _combine_time(spec: ModelSpec, b: PlanBatch, hw: HardwareProfile, per_rank: list) -> dict:
    """The step time (the slowest rank's, itemized), tokens/s per GPU, MFU and the dominant cost (the largest
    breakdown entry of the time-critical rank); the ranks' memory is not needed."""
    first, last = per_rank
    time_rank = np.where(last.step_s > first.step_s, LAST, FIRST)
    step = np.where(time_rank == LAST, last.step_s, first.step_s)
    tps = b.global_batch_size * b.seq_len / step / b.world
    tb = _pick(first.time_breakdown_s, last.time_breakdown_s, time_rank, len(b))
    return {"step_time_s": step, "tokens_per_s_per_gpu": tps,
            "mfu": _model_flops_per_token(spec, b) * tps / hw.peak("bfloat16"), "time_rank": time_rank,
            "time_breakdown_s": tb,
            "dominant": np.array(list(tb))[np.argmax(np.stack(list(tb.values())), axis=0)]}


def _pick(of_first: dict, of_last: dict, rank_sel, n: int) -> dict:
    """Per key the first rank's or the last rank's value, as ``rank_sel`` says."""
    keys = sorted(set(of_first) | set(of_last))
    return {k: np.where(rank_sel == LAST, _g(of_last, k, n), _g(of_first, k, n)) for k in keys}


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
        pk = rk.peak
        out[which] = {
            "peak_memory_bytes": float(pk.memory_bytes[0]), "peak_phase": PHASES[int(pk.phase[0])],
            "memory_breakdown_bytes": {k: float(v[0]) for k, v in pk.breakdown_bytes.items()},
            "reserved_memory_bytes": float(pk.reserved_bytes[0]),
            "reserved_breakdown_bytes": {k: float(v[0]) for k, v in pk.reserved_breakdown_bytes.items()},
            "phase_totals_bytes": {k: float(np.broadcast_to(v, (1,))[0]) for k, v in pk.phase_totals_bytes.items()},
            "comm_bytes": _stage_comm_bytes(rk.ledger, plan, which),
        }
    return out


def _stage_comm_bytes(ledger, plan: Plan, which: int) -> dict:
    """The bytes per "<op>/<axis>" of one plan's FIRST / LAST rank ledger, under that rank's canonical axis names."""
    return _named({k: float(v[0]) for k, v in ledger.bytes_by_key().items()},
                  canonical_axes(plan, stage_rank(plan, which)))


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
    comm_last = {} if plan.pp == 1 else _stage_comm_bytes(r["ranks"][LAST].ledger, plan, LAST)
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
        comm_bytes_last_stage=comm_last,
        interval_s=(step * math.exp(-q), step * math.exp(q)),
        interval_tokens_per_s_per_gpu=(tps * math.exp(-q), tps * math.exp(q)),
    )
