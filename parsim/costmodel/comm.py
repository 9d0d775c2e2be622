"""Collective bytes per (op, mesh axis) and their times, per rank and training step.

Bytes follow parsim's convention: the input tensors one rank hands to the collective, summed over a step.

* FSDP2 (per unit = transformer block, embedding, final norm + output; torchtitan wrapping): forward all-gather of
  the bf16 shard (``params/fsdp * param_bytes``), a backward re-gather when the unit was resharded after forward,
  one reduce-scatter of the unsharded gradient in ``reduce_dtype`` per pass (per step with ``grad_sync`` once,
  as Megatron-Core's DDP reduces), and for HSDP an all-reduce of the sharded gradient over ``dp_replicate``.
  torchtitan keeps the output unit unsharded after forward unless reshard_after_forward is ``always``. With PP,
  FSDP gathers once for the forwards and once for the backwards of a pass (measured with
  torch.distributed.pipelining) and reduces at the last microbatch, unless it reshards after every forward (then
  per microbatch).
* TP with sequence parallel, per layer and microbatch: forward 2 all-gathers (T*d/tp) before the column-parallel
  linears and 2 reduce-scatters (T*d) after the row-parallel ones; backward the mirror image; without SP, 2
  all-reduces (T*d) each way (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022). Recompute repeats the
  forward collectives that AC does not save (selective-op saves reduce-scatter outputs). Under SP the norm
  weights' gradients (d elements each) are all-reduced over tp in every backward (DTensor Partial -> Replicate).
* CP (torch context parallel, all-gather rotation, ``torch.distributed.tensor.experimental._context_parallel``):
  per layer and microbatch the forward all-gathers [K, V] once (and full AC's recompute again), the backward
  all-gathers them again and passes the fp32 partial sums of [dK, dV] round the ring in cp permutes (issued as
  all-to-alls); traced with the executor's CP on CPU.
* EP (dp2ep): per MoE layer, dispatch and combine all-to-all of the routed tokens (T_routed x d), twice more in
  backward.
* PP: one send of the stage output (T x d / sp) per microbatch forward and one of its gradient backward.
* gradient clipping: a 4-byte all-reduce of the norm over each axis that shards gradients.

The result is a ledger: one ``Record`` per kind of call (FSDP all-gather of a dense block unit, of the embedding
unit, TP all-gather of norm outputs before the column-parallel linears, EP dispatch, PP send, ...) with its bytes
per call, calls per step, group size, ranks of the group per node, phase and overlap class. ``comm_bytes`` is a
group-by of the ledger over ``"<op>/<axis>"``; a record's raw time is
``profile.collective_time_s(op, bytes_per_call, group, ranks_per_node) * calls``. FSDP is costed per unit (one
call per block, embedding, root and output unit, as FSDP2 issues them), so latency is paid once per unit and the
fitted small/large-message segment is chosen by the unit's size. How much of the raw time is exposed is decided
by the step model from the overlap class: ``exposed`` (TP, CP, EP: no async TP; the gradient-norm all-reduces),
``pp`` (send/recv between stages), ``fsdp_gather`` / ``fsdp_reduce`` (prefetched one unit ahead / overlapped with
the next unit's backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..vocab import Axis, FsdpUnit, Op, Overlap, Phase
from .layers import ac_counts as _ac_counts
from .layers import core_attn_counts as _core_attn_counts
from .layers import param_tensor_counts

FSDP_OVERLAPS = (Overlap.FSDP_GATHER, Overlap.FSDP_REDUCE)


@dataclass
class Record:
    """One kind of collective call on one rank; arrays over the plan batch (0 calls where it does not apply)."""

    what: str  # a display label (`predict --explain`): nothing keys on it
    op: Op
    axis: Axis
    bytes_per_call: np.ndarray
    calls: np.ndarray  # per training step
    group: np.ndarray
    ranks_per_node: np.ndarray
    phase: Phase
    overlap: Overlap
    time_s: np.ndarray  # raw seconds per step: collective_time_s(bytes_per_call) * calls
    exposed_s: np.ndarray | None = None  # set by the step model: the part of time_s the step waits for
    bytes_scale: float = 1.0  # the call is timed as ``op`` of this many times its bytes (``Ledger.add``)
    unit: FsdpUnit | None = None  # the FSDP unit an FSDP / HSDP record is of; None for any other record

    @property
    def key(self) -> str:
        return f"{self.op}/{self.axis}"


# mesh axis -> class of collectives that behave alike (message sizes, place in the step): tensor parallel (small,
# on the critical path), data parallel (bulk FSDP / DDP gradient and parameter traffic), pipeline p2p, expert
# all-to-all, context-parallel ring
AXIS_CLASS: dict[str, str] = {Axis.TP: "tp", Axis.DP_SHARD: "dp", Axis.DP_REPLICATE: "dp", Axis.DP_SHARD_CP: "dp",
                              Axis.EFSDP: "dp", Axis.EDP: "dp", Axis.FSDP: "dp", Axis.PP: "pp", Axis.EP: "ep",
                              Axis.CP: "cp"}


def axis_class_scale(hw, axis: str, op: str) -> float:
    """``corrections.comm_scale_<class>`` of the axis's class times ``corrections.comm_scale_op_<op>`` (fitted by
    `parsim calibrate`; 1 without them): the achieved collective time of that class and op in a training step
    relative to the profile's fitted curves of isolated collectives."""
    c = hw.corrections
    return float(c.get(f"comm_scale_{AXIS_CLASS.get(axis, axis)}", 1.0)) * float(c.get(f"comm_scale_op_{op}", 1.0))


def _words(what: str, op, axis, phase, overlap, unit) -> tuple:
    """(op, [(axis, mask)] or axis, phase, overlap, unit) as the vocabulary's members (``parsim.vocab``); a word
    that is none of them is refused with the record's label, so that a misspelt one cannot silently drop a
    collective from every group-by that names the right one."""
    def one(kind, enum, word):
        try:
            return enum(word)
        except ValueError:
            raise ValueError(f"ledger record {what!r}: {kind} {word!r} is not one of the known words") from None

    axes = [(one("axis", Axis, a), m) for a, m in axis] if isinstance(axis, list) else one("axis", Axis, axis)
    return (one("op", Op, op), axes, one("phase", Phase, phase), one("overlap", Overlap, overlap),
            None if unit is None else one("unit", FsdpUnit, unit))


class Ledger:
    """The records of one rank, and group-bys over them."""

    def __init__(self, hw, n: int):
        self.hw, self.n = hw, n
        self.records: list[Record] = []

    def add(self, what: str, *, op: Op, axis: Axis | list, bytes_per_call, calls, group, rpn, phase: Phase,
            overlap: Overlap, mask=True, time_bytes_scale=1.0, unit: FsdpUnit | None = None) -> None:
        """Record a kind of call (``what``: its label; every other argument by name). ``axis`` may be a list of
        (axis, mask) to split one kind of call between axes by plan (FSDP over dp_shard, or dp_shard+cp when
        cp > 1): its time is computed once. ``time_bytes_scale``: the call is timed as ``op`` of that many times
        its bytes (a permute issued as an all-to-all sends all of its buffer, where the all-to-all curve's call of
        the same size sends (g-1)/g). ``unit``: the FSDP unit of an FSDP or HSDP record, which what reads it keys
        on (not the display label ``what``)."""
        op, axis, phase, overlap, unit = _words(what, op, axis, phase, overlap, unit)
        n = self.n
        group = np.broadcast_to(np.asarray(group), (n,))
        rpn = np.broadcast_to(rpn, (n,))
        on = (group > 1) & np.broadcast_to(mask, (n,)) & (np.broadcast_to(calls, (n,)) > 0)
        split = axis if isinstance(axis, list) else [(axis, np.ones(n, bool))]
        if not on.any():  # nothing to cost in this batch (the common case for many kinds): no collective model call
            z = np.zeros(n)
            for name, _ in split:
                self.records.append(Record(what, op, name, z, z, group, rpn, phase, overlap, z, unit=unit))
            return
        per_call = np.where(on, np.broadcast_to(bytes_per_call, (n,)), 0.0)
        calls = np.where(on, np.broadcast_to(calls, (n,)), 0.0)
        t = (self.hw.collective_time_s(op, per_call * time_bytes_scale, group, rpn) * calls
             * axis_class_scale(self.hw, split[0][0], op))
        for name, m in split:
            self.records.append(Record(what, op, name, np.where(m, per_call, 0.0), np.where(m, calls, 0.0), group,
                                       rpn, phase, overlap, np.where(m, t, 0.0), None, time_bytes_scale, unit)
                                if len(split) > 1 else
                                Record(what, op, name, per_call, calls, group, rpn, phase, overlap, t, None,
                                       time_bytes_scale, unit))

    def time_with(self, r: Record, rpn) -> np.ndarray:
        """What record ``r`` (of one axis) takes where its group has ``rpn`` ranks per node: its time as ``add``
        computes it, at another ranks-per-node count."""
        return (self.hw.collective_time_s(r.op, r.bytes_per_call * r.bytes_scale, r.group, rpn) * r.calls
                * axis_class_scale(self.hw, r.axis, r.op))

    def bytes_by_key(self) -> dict:
        out: dict = {}
        for r in self.records:
            out[r.key] = out.get(r.key, np.zeros(self.n)) + r.bytes_per_call * r.calls
        return out

    def time_by_key(self, overlaps=None) -> dict:
        out: dict = {}
        for r in self.records:
            if overlaps is None or r.overlap in overlaps:
                out[r.key] = out.get(r.key, np.zeros(self.n)) + r.time_s
        return out

    def exposed_by_key(self) -> dict:
        out: dict = {}
        for r in self.records:
            out[r.key] = out.get(r.key, np.zeros(self.n)) + r.exposed_s
        return out

    def exposed_by_axis(self) -> dict:
        """Exposed seconds per axis (set by the step model), skipping kinds with no calls: the search's path."""
        out: dict = {}
        for r in self.records:
            if r.exposed_s is not None and r.calls.any():
                out[r.axis] = out.get(r.axis, 0.0) + r.exposed_s
        return out

    def total_s(self, overlaps) -> np.ndarray:
        return sum((r.time_s for r in self.records if r.overlap in overlaps), np.zeros(self.n))


@dataclass
class RankView:
    """What one rank holds and runs, the inputs of its ledger."""

    n_of: dict  # kind (False dense, True MoE) -> layers of that kind on the rank
    kinds: list
    plocal: dict  # kind -> (non-expert, expert) parameters of one layer before FSDP sharding
    has_emb: np.ndarray
    has_out: np.ndarray
    emb_local: np.ndarray
    out_local: np.ndarray  # output projection + final norm
    # FSDP2 shards (padded per tensor): kind -> (non-expert, expert) of one layer; the embedding, the final norm
    # and the output projection
    pshard: dict = field(default_factory=dict)
    emb_shard: np.ndarray | float = 0.0
    norm_local: np.ndarray | float = 0.0
    norm_shard: np.ndarray | float = 0.0
    outw_shard: np.ndarray | float = 0.0
    n_ckpt: dict = field(default_factory=dict)  # kind -> layers of that kind ``layer:N`` AC checkpoints on the rank
    n_tensors: np.ndarray | float = 0.0  # parameter tensors the rank holds (its optimizer's foreach lists)

    @property
    def n_layers(self):
        return sum(self.n_of[k] for k in self.kinds)

    @property
    def edge_shard(self):
        return self.emb_shard + self.norm_shard + self.outw_shard


@dataclass(frozen=True)
class RankComm:
    """One rank's collectives for one step: its ledger and the totals the step model needs (arrays over the
    batch)."""

    ledger: Ledger
    per_microbatch_exposed_s: dict  # "tp" / "cp" / "ep" -> exposed seconds per microbatch (fwd + bwd + recompute)
    fsdp_gather_total_s: np.ndarray  # FSDP / HSDP all-gathers of the step, unoverlapped
    fsdp_reduce_total_s: np.ndarray  # their reduce-scatters / all-reduces


def rank_comm(spec, b, sh, hw, rv: RankView) -> RankComm:
    """The ledger of one rank for one step and its totals (``RankComm``)."""
    led = Ledger(hw, len(b))
    M = (b.grad_accum * b.n_micro).astype(float)
    ac = {k: _ac_counts(b, rv.n_of[k], rv.n_ckpt[k]) for k in rv.kinds}
    n_full = sum(ac[k][0] for k in rv.kinds)
    n_sac = sum(ac[k][1] for k in rv.kinds)
    per_microbatch_exposed_records(led, spec, b, sh, rv, M, n_full, n_sac, ac)
    v = b.pp_stages_per_rank.astype(float)
    sends = np.where(b.pp > 1, (2.0 * v - 1.0), 0.0)  # first: v fwd + (v-1) bwd; last: (v-1) fwd + v bwd
    led.add("PP send of a stage output / its gradient (fp32 under autocast)", op=Op.SEND, axis=Axis.PP,
            bytes_per_call=sh.T * spec.d_model / sh.sp_div * sh.res_b, calls=M * sends, group=np.where(b.pp > 1, 2, 1),
            rpn=np.minimum(b.rpn["pp"], 2), phase=Phase.FORWARD_BACKWARD, overlap=Overlap.PP)
    _fsdp_records(led, spec, b, rv)
    _grad_norm_records(led, spec, b, rv)
    per_mb = {a: sum((r.time_s for r in led.records if r.overlap == Overlap.EXPOSED and r.axis == a
                      and r.phase != Phase.STEP), np.zeros(len(b))) / np.maximum(M, 1)
              for a in (Axis.TP, Axis.CP, Axis.EP)}
    return RankComm(ledger=led, per_microbatch_exposed_s=per_mb,
                    fsdp_gather_total_s=led.total_s((Overlap.FSDP_GATHER,)),
                    fsdp_reduce_total_s=led.total_s((Overlap.FSDP_REDUCE,)))


def per_microbatch_exposed_records(led: Ledger, spec, b, sh, rv: RankView, M, n_full, n_sac, ac,
                                   per_step: bool = True) -> None:
    """The TP, CP and EP records of ``M`` microbatches (exposed: on the critical path of each); ``per_step`` False
    leaves out the only ones whose calls do not scale with ``M`` (``tp_partial_grad_records``)."""
    _tp_records(led, spec, b, sh, rv, M, n_full, n_sac, per_step)
    _cp_ep_records(led, spec, b, sh, rv, M, n_full, n_sac, ac)


def _tp_records(led: Ledger, spec, b, sh, rv: RankView, M, n_full, n_sac, per_step: bool = True) -> None:
    """TP + SP per microbatch. Activations are in param_dtype (``act_b``) under FSDP mixed precision; under
    autocast (no data parallelism) the residual stream is fp32: the forward all-gathers of norm outputs (and their
    recomputes), the embedding's backward all-gather and the reduce-scatters of their gradients move fp32
    (``res_b``); the forward reduce-scatters of matmul outputs and the backward all-gathers of their gradients move
    param_dtype (matched byte for byte on CPU runs)."""
    T, t, d = sh.T, sh.t, float(spec.d_model)
    L = rv.n_layers
    edge = np.where(rv.has_emb, 1.0, 0.0) + np.where(rv.has_out, 1.0, 0.0)
    g, r, tp_on, sp = b.tp, b.rpn["tp"], b.tp > 1, b.sequence_parallel
    # MoE layers combine their routed outputs in the dtype of the block's input (``MoE._routed`` weights them by
    # the router's scores cast to it): the residual stream's, fp32 under autocast, while attention's output
    # projection reduces in param_dtype [derived: executor; trace, below]
    L_moe = rv.n_of[True]  # (zeros on a dense model)
    ag_res = 2.0 * L + 2.0 * (n_full + n_sac) + edge  # norm outputs (fwd + recompute), embedding/output edges
    ag_mm = 2.0 * L  # backward: gradients of the row-parallel outputs
    rs_res = 2.0 * L + edge  # backward: gradients of the gathered norm outputs; edges
    # forward: row-parallel outputs. Full AC recomputes only the first: non-reentrant checkpoint stops once every
    # tensor the backward needs exists, and the block's last op (w2's reduce-scatter, consumed by the residual add
    # alone) is never needed (trace: 81 instead of 97 reduce-scatters per microbatch for 16 fully checkpointed
    # llama3-8b layers at tp 4)
    rs_mm = 2.0 * L + n_full - L_moe
    # TE layers all-gather the norm output in float8 when float8 is on and gather it again in the backward (the
    # local shard is what they keep, see layers.saved_tensors) [derived]
    ag_res = ag_res + np.where(sh.te, 2.0 * L, 0.0)
    led.add("TP all-gather of norm outputs before the column-parallel linears (incl. recompute)", op=Op.ALL_GATHER,
            axis=Axis.TP, bytes_per_call=T * d / t * np.where(sh.te, sh.f8b, sh.res_b), calls=M * ag_res, group=g,
            rpn=r, phase=Phase.FORWARD_BACKWARD, overlap=Overlap.EXPOSED, mask=tp_on & sp)
    led.add("TP all-gather of row-parallel output gradients", op=Op.ALL_GATHER, axis=Axis.TP,
            bytes_per_call=T * d / t * sh.act_b, calls=M * (ag_mm - L_moe), group=g, rpn=r, phase=Phase.BACKWARD,
            overlap=Overlap.EXPOSED, mask=tp_on & sp)
    led.add("TP all-gather of MoE output gradients", op=Op.ALL_GATHER, axis=Axis.TP,
            bytes_per_call=T * d / t * sh.res_b, calls=M * L_moe, group=g, rpn=r, phase=Phase.BACKWARD,
            overlap=Overlap.EXPOSED, mask=tp_on & sp & (L_moe > 0))
    led.add("TP reduce-scatter of row-parallel outputs (incl. full-AC recompute)", op=Op.REDUCE_SCATTER, axis=Axis.TP,
            bytes_per_call=T * d * sh.act_b, calls=M * rs_mm, group=g, rpn=r, phase=Phase.FORWARD,
            overlap=Overlap.EXPOSED, mask=tp_on & sp)
    led.add("TP reduce-scatter of MoE outputs", op=Op.REDUCE_SCATTER, axis=Axis.TP, bytes_per_call=T * d * sh.res_b,
            calls=M * L_moe, group=g, rpn=r, phase=Phase.FORWARD, overlap=Overlap.EXPOSED,
            mask=tp_on & sp & (L_moe > 0))
    led.add("TP reduce-scatter of norm-output gradients", op=Op.REDUCE_SCATTER, axis=Axis.TP,
            bytes_per_call=T * d * sh.res_b, calls=M * rs_res, group=g, rpn=r, phase=Phase.BACKWARD,
            overlap=Overlap.EXPOSED, mask=tp_on & sp)
    _tp_all_reduce_records(led, spec, b, sh, rv, M, n_full, n_sac)
    if per_step:
        tp_partial_grad_records(led, spec, b, rv)


def _tp_all_reduce_records(led: Ledger, spec, b, sh, rv: RankView, M, n_full, n_sac) -> None:
    """TP without sequence parallel per microbatch (all-reduces of the row-parallel outputs, of the MoE outputs,
    the column-parallel input gradients and the edges) and loss parallel's all-reduces on the last stage."""
    T, d, L = sh.T, float(spec.d_model), rv.n_layers
    L_moe = rv.n_of[True]  # (zeros on a dense model)
    edge = np.where(rv.has_emb, 1.0, 0.0) + np.where(rv.has_out, 1.0, 0.0)
    g, r, tp_on, sp = b.tp, b.rpn["tp"], b.tp > 1, b.sequence_parallel
    # recompute: early stop skips the MLP's all-reduce (consumed by the residual add alone) under full AC and
    # selective-op AC alike (which does not save all-reduce outputs): one per recomputed layer (trace: tiny,
    # tiny-moe, llama3-405b at tp 2 without SP). The row-parallel outputs are reduced in param_dtype; the
    # gradients of the column-parallel inputs and the edges (the embedding's output in the forward, the output
    # projection's input gradient in the backward) in the residual stream's dtype, fp32 under autocast (trace:
    # a 4-layer model at tp 2 without data parallelism, full AC, 3 microbatches: 36 bf16 and 30 fp32 (T, d)
    # all-reduces; the model had all 66 in bf16, 31% under) [derived]
    led.add("TP all-reduce of row-parallel outputs (no sequence parallel; incl. recompute)", op=Op.ALL_REDUCE,
            axis=Axis.TP, bytes_per_call=T * d * sh.act_b, calls=M * (2.0 * L - L_moe + n_full + n_sac), group=g, rpn=r,
            phase=Phase.FORWARD, overlap=Overlap.EXPOSED, mask=tp_on & ~sp)
    led.add("TP all-reduce of MoE outputs, column-parallel input gradients and the edges (no sequence parallel)",
            op=Op.ALL_REDUCE, axis=Axis.TP, bytes_per_call=T * d * sh.res_b, calls=M * (2.0 * L + L_moe + edge),
            group=g, rpn=r, phase=Phase.FORWARD_BACKWARD, overlap=Overlap.EXPOSED, mask=tp_on & ~sp)
    # loss parallel on the last stage: torch's log_softmax / nll_loss handlers for vocab-sharded logits all-reduce
    # the row max, the sum of exponentials and the target logit, one fp32 value per token each, in the forward
    # [derived from torch.distributed.tensor.parallel.loss; trace]
    led.add("loss parallel: all-reduces of the row max, the sum of exponentials and the target logit", op=Op.ALL_REDUCE,
            axis=Axis.TP, bytes_per_call=T * 4.0, calls=M * 3.0 * np.where(rv.has_out, 1.0, 0.0), group=g, rpn=r,
            phase=Phase.FORWARD, overlap=Overlap.EXPOSED, mask=tp_on)


def tp_partial_grad_records(led: Ledger, spec, b, rv: RankView) -> None:
    """Weights replicated over tp whose gradients are partial sums: under SP the norms (LayerNorm: weight and bias)
    see only their sequence shard, Qwen3's q/k norms only the rank's heads, the router only the rank's share of the
    tokens (EP with TP) or of the expert outputs (executor: MoE._tp_forward), with or without SP. With FSDP the
    gradient is all-reduced over tp when FSDP reduces it, once per pass, or once per step with ``grad_sync`` once
    (param dtype; reduce dtype under PP or grad_sync once, where it accumulates first). Without FSDP (no data
    parallelism) nothing reduces it, and DTensor all-reduces the partial gradient whenever an op needs it whole:
    the gradient-norm ``foreach_norm``, then AdamW's ``lerp`` of exp_avg and ``addcmul`` of exp_avg_sq (the
    gradient twice): 4 times a step, fp32 (the parameters stay fp32 under autocast) [derived; trace]."""
    d, L = float(spec.d_model), rv.n_layers
    g, r, tp_on = b.tp, b.rpn["tp"], b.tp > 1
    fsdp_on = b.fsdp_applied
    dtype_b = np.where(fsdp_on, np.where((b.pp > 1) | b.sync_once, b.reduce_bytes, b.param_bytes), 4.0).astype(float)
    per = np.where(fsdp_on, b.reduce_passes.astype(float), 4.0)
    norm_tensors = 2.0 if spec.norm == "layernorm" else 1.0
    led.add("TP all-reduce of sequence-parallel norm-weight gradients", op=Op.ALL_REDUCE, axis=Axis.TP,
            bytes_per_call=d * dtype_b, calls=per * norm_tensors * (2.0 * L + np.where(rv.has_out, 1.0, 0.0)), group=g,
            rpn=r, phase=Phase.BACKWARD, overlap=Overlap.EXPOSED, mask=tp_on & b.sequence_parallel)
    if spec.qk_norm:
        led.add("TP all-reduce of q/k-norm weight gradients", op=Op.ALL_REDUCE, axis=Axis.TP,
                bytes_per_call=spec.head_dim * dtype_b, calls=per * 2.0 * L, group=g, rpn=r, phase=Phase.BACKWARD,
                overlap=Overlap.EXPOSED, mask=tp_on)
    if True in rv.kinds and spec.moe is not None:
        led.add("TP all-reduce of router-weight gradients", op=Op.ALL_REDUCE, axis=Axis.TP,
                bytes_per_call=d * spec.moe.n_experts * dtype_b, calls=per * rv.n_of[True], group=g, rpn=r,
                phase=Phase.BACKWARD, overlap=Overlap.EXPOSED, mask=tp_on)


def _cp_ep_records(led: Ledger, spec, b, sh, rv: RankView, M, n_full, n_sac, ac) -> None:
    L = rv.n_layers
    kv = sh.T * (spec.kv_dim + spec.v_dim) / sh.t * sh.act_b
    cp_on, g, r = b.cp > 1, b.cp, b.rpn["cp"]
    # selective-op AC saves the ring attention's output (its policy sees the SDPA op above DTensor's CP handler),
    # so only full AC's recompute gathers K and V again, and core-attn's, whose checkpoint is the attention call
    n_core = sum((_core_attn_counts(b, rv.n_of[k]) for k in rv.kinds), np.zeros(len(b)))
    led.add("CP all-gather of K and V (forward, full-AC / core-attn recompute, backward)", op=Op.ALL_GATHER,
            axis=Axis.CP, bytes_per_call=kv, calls=M * (2.0 * L + n_full + n_core), group=g, rpn=r,
            phase=Phase.FORWARD_BACKWARD, overlap=Overlap.EXPOSED, mask=cp_on)
    # the backward passes the fp32 partial sums of dK and dV round the ring: one permute (an all-to-all with all
    # of the buffer going to the next rank) per ring step, cp per layer
    kv_f32 = sh.T * (spec.kv_dim + spec.v_dim) / sh.t * 4.0
    led.add("CP ring pass of the fp32 K and V gradients (one permute per ring step)", op=Op.ALL_TO_ALL, axis=Axis.CP,
            bytes_per_call=kv_f32, calls=M * L * g, group=g, rpn=r, phase=Phase.BACKWARD, overlap=Overlap.EXPOSED,
            mask=cp_on, time_bytes_scale=g / np.maximum(g - 1, 1))
    if True in rv.kinds:
        n_moe = rv.n_of[True]
        full_moe = ac[True][0]
        # the dispatch moves the block's input (the residual stream's dtype, fp32 under autocast), the combine the
        # experts' outputs (param_dtype); their backwards the same pair: per call the mean of the two [derived:
        # executor MoE._routed; trace: tp8 x ep8 without data parallelism, 1.5x the param_dtype bytes]
        led.add("EP all-to-all dispatch and combine of routed tokens (fwd, bwd, full-AC recompute)", op=Op.ALL_TO_ALL,
                axis=Axis.EP, bytes_per_call=sh.Tr * spec.d_model * (sh.act_b + sh.res_b) / 2.0,
                calls=M * (4.0 * n_moe + 2.0 * full_moe), group=b.ep, rpn=b.rpn["ep"], phase=Phase.FORWARD_BACKWARD,
                overlap=Overlap.EXPOSED, mask=b.ep > 1)




def fsdp_gathers_per_pass(b, output_unit: bool = False) -> np.ndarray:
    """All-gathers of one FSDP unit per pass (microbatch group of a step): without PP the forward's, and the
    backward's when resharded after forward. With PP torch's schedules run every backward without resharding and
    reshard at the stage's reduce after the last: one all-gather per unit and pass (reshard-after-forward is off
    under PP by default); resharding after forward, every forward that follows a forward (each resharded its unit)
    gathers, and every backward that follows a forward: in the F/B sequences of GPipe and 1F1B that is m + 1 (m
    forwards, the first backward after each run of forwards) [derived from torch 2.13 pipelining/stage.py
    backward_maybe_with_nosync and perform_reduce_grad; trace]. The [final norm, output] unit follows
    ``raf_always`` (torchtitan does not reshard the last unit after forward by default)."""
    raf = b.raf_always if output_unit else b.raf
    m = b.n_micro.astype(float)
    return np.where(b.pp > 1, np.where(raf, m + 1.0, 1.0), 1.0 + raf)


def _fsdp_units(spec, b, rv: RankView) -> list[tuple]:
    """(name, elements of the rank's shard of one unit (padded per tensor), units on the rank, all-gathers per unit
    and pass, FSDP group): a unit per block (non-expert part, and the experts with it when ep == 1), the
    embedding, the final norm with the output projection (torchtitan's [norm, output] unit; the root holds no
    parameters); routed experts (ep > 1) form their own unit per MoE block over efsdp."""
    gathers, out_gathers = fsdp_gathers_per_pass(b), fsdp_gathers_per_pass(b, output_unit=True)
    ep1 = b.ep == 1
    units = []
    for k in rv.kinds:
        name = FsdpUnit.MOE_BLOCK if k else FsdpUnit.DENSE_BLOCK
        ne_s, ex_s = rv.pshard[k]
        units.append((name, ne_s + np.where(ep1, ex_s, 0.0), rv.n_of[k], gathers, Axis.FSDP))
        if k:
            units.append((FsdpUnit.EXPERTS, ex_s, np.where(ep1, 0.0, rv.n_of[k]), gathers, Axis.EFSDP))
    units += [(FsdpUnit.EMBEDDING, rv.emb_shard, 1.0, gathers, Axis.FSDP),
              (FsdpUnit.OUTPUT, rv.norm_shard + rv.outw_shard, 1.0, out_gathers, Axis.FSDP)]
    return units


def _fsdp_records(led: Ledger, spec, b, rv: RankView) -> None:
    """FSDP2 / HSDP per unit: all-gather of the param_dtype shard, reduce-scatter of the (padded) unsharded gradient
    in reduce_dtype once per pass (once per step with ``grad_sync`` once: the passes before the last accumulate
    unsharded, FSDP2's ``set_requires_gradient_sync(False)``, Megatron-Core DDP's ``no_sync`` for every microbatch
    but the last), HSDP all-reduce of the sharded gradient over dp_replicate (experts: over edp with DDP-style EP).
    The all-gathers stay once per pass: without sync FSDP2 still reshards after backward. With PP and
    reshard-after-forward FSDP gathers per microbatch."""
    ga, rp = b.grad_accum.astype(float), b.reduce_passes.astype(float)
    pb, rb = b.param_bytes.astype(float), b.reduce_bytes.astype(float)
    f, ef = b.fsdp.astype(float), b.efsdp.astype(float)
    cp_axis = b.cp > 1
    for name, shard, units, gathers, grp in _fsdp_units(spec, b, rv):
        on = shard > 0
        if grp == Axis.FSDP:
            axis = [(Axis.DP_SHARD, ~cp_axis), (Axis.DP_SHARD_CP, cp_axis)] if cp_axis.any() else Axis.DP_SHARD
            size, rpn, mult = b.fsdp, b.rpn["fsdp"], f
        else:
            axis, size, rpn, mult = Axis.EFSDP, b.efsdp, b.rpn["efsdp"], ef
        led.add(f"FSDP all-gather: {name}", op=Op.ALL_GATHER, axis=axis, bytes_per_call=shard * pb,
                calls=ga * gathers * units, group=size, rpn=rpn, phase=Phase.FORWARD_BACKWARD,
                overlap=Overlap.FSDP_GATHER, mask=on, unit=name)
        led.add(f"FSDP reduce-scatter of gradients: {name}", op=Op.REDUCE_SCATTER, axis=axis,
                bytes_per_call=shard * mult * rb, calls=rp * units, group=size, rpn=rpn, phase=Phase.BACKWARD,
                overlap=Overlap.FSDP_REDUCE, mask=on, unit=name)
        expert = grp == Axis.EFSDP
        dense_dp = on & (~b.ep_megatron if expert else True)
        dist = b.zero1
        led.add(f"HSDP all-reduce of sharded gradients: {name}", op=Op.ALL_REDUCE, axis=Axis.DP_REPLICATE,
                bytes_per_call=shard * rb, calls=rp * units, group=b.dp_replicate, rpn=b.rpn["dp_replicate"],
                phase=Phase.BACKWARD, overlap=Overlap.FSDP_REDUCE, mask=dense_dp & ~dist, unit=name)
        # distributed optimizer: the all-reduce becomes a reduce-scatter of the gradients and, after the step, an
        # all-gather of the updated param_dtype shards (overlapped with the next forward, Megatron's
        # overlap_param_gather): the same bus bytes in bf16/fp32 halves
        led.add(f"distributed-optimizer reduce-scatter of gradients: {name}", op=Op.REDUCE_SCATTER,
                axis=Axis.DP_REPLICATE, bytes_per_call=shard * rb, calls=rp * units, group=b.dp_replicate,
                rpn=b.rpn["dp_replicate"], phase=Phase.BACKWARD, overlap=Overlap.FSDP_REDUCE, mask=dense_dp & dist,
                unit=name)
        led.add(f"distributed-optimizer all-gather of updated parameters: {name}", op=Op.ALL_GATHER,
                axis=Axis.DP_REPLICATE, bytes_per_call=shard / np.maximum(b.dp_replicate, 1) * pb, calls=units,
                group=b.dp_replicate, rpn=b.rpn["dp_replicate"], phase=Phase.FORWARD, overlap=Overlap.FSDP_GATHER,
                mask=dense_dp & dist, unit=name)
        if expert:
            _megatron_expert_records(led, b, name, shard, units, rp, pb, rb, on)


def _megatron_expert_records(led: Ledger, b, name: FsdpUnit, shard, units, rp, pb, rb, on) -> None:
    """Megatron-style EP (DDP-style or folded): the routed experts' gradients are reduced over their
    expert-data-parallel group (``edp``, the ranks holding the same experts), not over the dense data-parallel
    ranks; under the distributed optimizer the expert optimizer state is sharded over that group, so the reduce is a
    reduce-scatter and the updated expert parameters are all-gathered after the step (Megatron-Core's
    ``expert_data_parallel_group`` buffers of ``DistributedDataParallel``; ``_ParamAndGradBuffer`` per group)
    [framework source]. ``shard``: the unit's (unsharded: efsdp 1) expert elements on the rank."""
    meg = on & b.ep_megatron
    dist = meg & b.distributed_optimizer.astype(bool) & (b.edp > 1)
    led.add(f"expert-data-parallel all-reduce of gradients: {name}", op=Op.ALL_REDUCE, axis=Axis.EDP,
            bytes_per_call=shard * rb, calls=rp * units, group=b.edp, rpn=b.rpn["edp"], phase=Phase.BACKWARD,
            overlap=Overlap.FSDP_REDUCE, mask=meg & ~dist, unit=name)
    led.add(f"distributed-optimizer reduce-scatter of expert gradients: {name}", op=Op.REDUCE_SCATTER, axis=Axis.EDP,
            bytes_per_call=shard * rb, calls=rp * units, group=b.edp, rpn=b.rpn["edp"], phase=Phase.BACKWARD,
            overlap=Overlap.FSDP_REDUCE, mask=dist, unit=name)
    led.add(f"distributed-optimizer all-gather of updated expert parameters: {name}", op=Op.ALL_GATHER, axis=Axis.EDP,
            bytes_per_call=shard / b.edp * pb, calls=units, group=b.edp, rpn=b.rpn["edp"], phase=Phase.FORWARD,
            overlap=Overlap.FSDP_GATHER, mask=dist, unit=name)


def _grad_norm_records(led: Ledger, spec, b, rv: RankView) -> None:
    """Gradient clipping, once per step (executor: worker.clip_and_step, torchtitan's clip_grad_norm_ with and
    without EP): ``get_total_norm`` over a group's DTensor gradients takes one norm per tensor, stacks them (a
    partial value on every mesh dimension some tensor is sharded over) and DTensor all-reduces the stacked vector,
    4 B per tensor, over each such dimension of more than one rank [derived; trace]. Groups: the dense gradients
    (mesh FSDP x TP; the routed experts join them without EP), the routed experts with EP (mesh expert-FSDP; their
    squared norm then all-reduced over EP, 4 B), and the total over PP (4 B)."""
    one = np.ones(len(b))
    fsdp_on = b.fsdp_applied
    cp_axis = b.cp > 1
    fsdp_axis = [(Axis.DP_SHARD, ~cp_axis), (Axis.DP_SHARD_CP, cp_axis)] if cp_axis.any() else Axis.DP_SHARD
    dense_t, expert_t = np.zeros(len(b)), np.zeros(len(b))
    for k in rv.kinds:
        n_d, n_e = param_tensor_counts(spec, k)
        dense_t = dense_t + rv.n_of[k] * n_d
        expert_t = expert_t + rv.n_of[k] * n_e
    edge = spec.embedding_params() > 0  # the embedding (learned positions: a second tensor)
    dense_t = dense_t + np.where(rv.has_emb, 1.0 + (spec.max_position_embeddings > 0) * edge, 0.0)
    own_out = (b.pp > 1) | (not spec.tie_embeddings)
    dense_t = dense_t + np.where(rv.has_out, (2.0 if spec.norm == "layernorm" else 1.0) + own_out, 0.0)
    ep_on = b.ep > 1
    dense = dense_t + np.where(ep_on, 0.0, expert_t)
    led.add("gradient-norm all-reduce: one fp32 norm per dense gradient tensor", op=Op.ALL_REDUCE, axis=fsdp_axis,
            bytes_per_call=4.0 * dense, calls=one, group=b.fsdp, rpn=b.rpn["fsdp"], phase=Phase.STEP,
            overlap=Overlap.EXPOSED, mask=fsdp_on)
    # without SP the block and final norms are not DTensors over tp (only SP's plan makes them replicated ones):
    # their norms are stacked in a group of their own, reduced over FSDP only
    per_norm = 2.0 if spec.norm == "layernorm" else 1.0
    plain = sum((rv.n_of[k] * 2.0 * per_norm for k in rv.kinds), np.zeros(len(b))) + np.where(rv.has_out, per_norm, 0.0)
    led.add("gradient-norm all-reduce: one fp32 norm per dense gradient tensor", op=Op.ALL_REDUCE, axis=Axis.TP,
            bytes_per_call=4.0 * (dense - np.where(b.sequence_parallel, 0.0, plain)), calls=one, group=b.tp,
            rpn=b.rpn["tp"], phase=Phase.STEP, overlap=Overlap.EXPOSED)
    has_experts = ep_on & (expert_t > 0)
    led.add("gradient-norm all-reduce: one fp32 norm per routed-expert gradient tensor", op=Op.ALL_REDUCE,
            axis=Axis.EFSDP, bytes_per_call=4.0 * expert_t, calls=one, group=b.efsdp, rpn=b.rpn["efsdp"],
            phase=Phase.STEP, overlap=Overlap.EXPOSED, mask=has_experts & fsdp_on)
    led.add("gradient-norm all-reduce of the experts' squared norm over EP", op=Op.ALL_REDUCE, axis=Axis.EP,
            bytes_per_call=4.0 * one, calls=one, group=b.ep, rpn=b.rpn["ep"], phase=Phase.STEP, overlap=Overlap.EXPOSED,
            mask=has_experts)
    led.add("gradient-norm all-reduce over the pipeline stages", op=Op.ALL_REDUCE, axis=Axis.PP,
            bytes_per_call=4.0 * one, calls=one, group=b.pp, rpn=b.rpn["pp"], phase=Phase.STEP, overlap=Overlap.EXPOSED)
