"""Memory of one rank: the step's moments (end of forward, backward of the last layer, a later microbatch's
backward, end of backward, optimizer step), each itemized, or the op-level timeline (``memory.simulate``) where
the plan is on it; the peak and its moment. See ``step``'s docstring for the memory model."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..codec import COLUMN_NAMES, PlanBatch
from ..hardware import HardwareProfile
from ..plan import AC_MODES
from ..spec import ModelSpec
from . import comm as C
from .compute import RankCompute
from .layers import (
    FIRST,
    Shapes,
    backward_steps,
    experts_off_dim0,
    ffn_input_held_bytes,
    grad_elem_bytes,
    inflight,
    kept_by_ac_mode,
    last_param_elems,
    layer_tensors,
    local_experts,
    moe_forward_working_bytes,
    recompute_experts_extra_bytes,
    saved_tensors,
    stage_bounds,
)
from .memory import (
    BWD1,
    BWD2,
    BWD_END,
    FWD,
    MEMORY_KEYS,
    OPT,
    PHASES,
    Block,
    RankMemory,
    Unit,
    pipeline_recv_buffers,
    sends_held,
    simulate,
    simulate_actions,
)
from .pipeline import SCHED_GPIPE, LeftOut, interleaved_actions
from .reserved import fsdp_streams, reduce_scatter_pool, reserved_breakdown
from .rows import row_ids, unique_rows


def static_bytes(b: PlanBatch, rv: C.RankView) -> np.ndarray:
    """A lower bound of a rank's peak [derived]: at the optimizer step it holds its fp32 parameters and two Adam
    states (12 B per parameter it steps) and every fp32 gradient of its shard (4 B per parameter it holds)."""
    p_shard, p_opt = rank_params(b, rv)
    return p_opt * 12.0 + p_shard * 4.0


def rank_memory(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute,
                 above_bytes: float = math.inf) -> tuple:
    """(the memory moments of one rank, the parameters whose optimizer step it runs). Parameters held before
    FSDP sharding (non-expert, expert), per rank after it, and 1/dp_replicate of those under the distributed
    optimizer. Plans whose ``static_bytes`` exceed ``above_bytes`` keep the coarse moments (``evaluate``)."""
    ne_local = rv.emb_local + rv.out_local + sum(rv.n_of[k] * rv.plocal[k][0] for k in rv.kinds)
    ex_local = sum(rv.n_of[k] * rv.plocal[k][1] for k in rv.kinds)
    p_shard, p_opt = rank_params(b, rv)
    # what FSDP2's all-gathers hold unsharded: each unit's padded shards times the shard group
    gathered = {"blocks": sum(rv.n_of[k] * (b.fsdp * rv.pshard[k][0] + b.efsdp * rv.pshard[k][1]) for k in rv.kinds),
                "emb": b.fsdp * rv.emb_shard, "out": b.fsdp * (rv.norm_shard + rv.outw_shard)}
    timed = static_bytes(b, rv) <= above_bytes
    if timed.all():  # the step's timeline (costmodel/memory.py)
        return _timeline_phases(spec, b, sh, rank, rv, c, p_shard, p_opt, timed), p_opt
    # plans the search screen bounds keep the coarse moments
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
    keys = np.stack([b.pp, b.pp_stages_per_rank, every, before & layer_mode], axis=1)
    uniq, inv = unique_rows(keys[rows])
    rows_idx = np.nonzero(rows)[0]
    # memory does not depend on the device order, compile, async TP, or float8 outside TE layers (its recipe not
    # at all): one simulation per plan that differs in anything else
    same = row_ids(np.stack([np.asarray(getattr(b, c), dtype=float) for c in COLUMN_NAMES if c not in _NOT_MEMORY]
                            + [np.asarray(b.float8 & b.te_layers, dtype=float)], axis=1))
    steps = Whole({moe: (backward_steps(spec, b, sh, moe), saved_tensors(spec, sh, moe)) for moe in rv.kinds})
    steps.moe_fwd = moe_forward_working_bytes(spec, sh, b)
    steps.tp_out = _tp_output_transient(b, sh, spec.d_model)
    steps.ffn_held = ffn_input_held_bytes(spec, sh)
    steps.pair_bytes = sh.Tr * spec.d_model * sh.act_b if spec.moe is not None else 0.0
    steps.experts_extra = {sac: recompute_experts_extra_bytes(spec, sh, b, sac) for sac in (False, True)}
    steps.e_local = local_experts(spec, sh) if spec.moe is not None else 1.0
    for g, (pp, v, k, bp) in enumerate(uniq):
        idx = rows_idx[np.ravel(inv) == g]
        _, first, back = np.unique(same[idx], return_index=True, return_inverse=True)
        runs = _block_runs(spec, int(pp), int(v), rank, int(k), bool(bp))
        built: dict = {}
        q = _rank_memory_inputs(spec, b, sh, rank, rv, c, p_shard, p_opt, idx[first], runs, steps, built)
        if v == 1:
            res = simulate(q)
        else:
            res = _interleaved(spec, b, rank, idx[first], q, built, (int(pp), int(v), int(k), bool(bp)), steps)
        for ph in PHASES:
            for name in MEMORY_KEYS:
                out[ph][name][idx] = res[ph][name][np.ravel(back)]
    return out


_NOT_MEMORY = ("mesh_idx", "compile", "async_tp", "float8", "float8_recipe")


class Whole(dict):
    """Per block kind its backward steps and saved tensors over the whole batch (``layers.backward_steps``,
    ``layers.saved_tensors``), and whole-batch sizes computed once for all the groups of one ``rank_memory``
    (``once``: the groups index them)."""

    def __init__(self, *args):
        super().__init__(*args)
        self._memo: dict = {}
        self.moe_fwd: np.ndarray | float = 0.0  # ``layers.moe_forward_working_bytes``
        self.tp_out: np.ndarray | float = 0.0  # ``_tp_output_transient``
        self.ffn_held: np.ndarray | float = 0.0  # ``layers.ffn_input_held_bytes``
        self.pair_bytes: np.ndarray | float = 0.0  # one routed (token, expert) pair tensor, nk x d
        self.experts_extra: dict = {}  # AC selective? -> ``layers.recompute_experts_extra_bytes``
        self.e_local: np.ndarray | float = 1.0  # ``layers.local_experts``

    def once(self, fn, *args):
        key = (fn, *(a if isinstance(a, (bool, int, str)) else id(a) for a in args))
        if key not in self._memo:
            self._memo[key] = fn(*args)
        return self._memo[key]


def _interleaved(spec: ModelSpec, b: PlanBatch, rank: int, idx: np.ndarray, q: RankMemory, built: dict,
                 key: tuple, whole: Whole) -> dict:
    """``memory.simulate_actions`` for the plans ``idx`` of a rank running ``v`` stages: one ``RankMemory`` per
    stage (its blocks; the embedding on the first rank's first stage, the [norm, output] unit and the loss on the
    last rank's last stage) and torch's action list (``pipeline.interleaved_actions``) for each microbatch count."""
    pp, v, every, before_pp = key
    r = 0 if rank == FIRST else pp - 1
    chunks, made = [], {}  # (stages with the same contents share one RankMemory: their records are shared)
    for j, runs in enumerate(_stage_runs(spec, pp, v, rank, every, before_pp)):
        stage = j * pp + r
        key = (tuple(runs), stage == 0, stage == pp * v - 1)
        if key not in made:
            made[key] = _stage_memory(spec, b, q, idx, runs, built, *key[1:], whole)
        chunks.append(made[key])
    return simulate_actions(q, chunks, _merged_schedules(pp, v, r, b.n_micro[idx]), pp)


@lru_cache(maxsize=4096)
def _compressed_actions(pp: int, v: int, m: int, r: int) -> tuple:
    """``pipeline.interleaved_actions(compress=True)`` of pipeline rank ``r``, made once per schedule."""
    return tuple(interleaved_actions(pp, v, m, r, compress=True))


def _merged_schedules(pp: int, v: int, r: int, micro: np.ndarray) -> list:
    """(plans, action list) pairs for ``memory.simulate_actions``: one replay per distinct list, where lists that
    differ only in how many backwards their compression left out (``LEFT_OUT_B``'s count: every microbatch count
    past a few periods) are one list whose counts are per plan [derived: the actions and their order are the same,
    and a left-out count only scales what those backwards leave alive]."""
    by_shape: dict = {}
    for m in np.unique(micro).tolist():
        actions = _compressed_actions(pp, v, int(m), r)
        by_shape.setdefault(tuple(a[:2] for a in actions), []).append((m, actions))
    out = []
    for lists in by_shape.values():
        plans = np.isin(micro, [m for m, _ in lists])
        merged = list(lists[0][1])
        for i, action in enumerate(merged):
            if isinstance(action, LeftOut):
                counts = np.zeros(len(micro))
                for m, actions in lists:
                    counts[micro == m] = actions[i].backwards
                merged[i] = action._replace(backwards=counts)
        out.append((plans, merged))
    return out


def _stage_memory(spec: ModelSpec, b: PlanBatch, q: RankMemory, idx: np.ndarray, runs: list, built: dict,
                  has_emb: bool, has_out: bool, whole: Whole) -> RankMemory:
    """One stage's share of a rank's ``RankMemory`` (``memory.simulate_actions``): its blocks (the rank's
    ``Block`` of each kind), the embedding's and the output's sizes only where the stage has them, its stage output
    (or the loss's saved tensors on the last stage) kept per microbatch, the last cast weight of its last block."""
    n = len(idx)
    emb, out = np.full(n, has_emb), np.full(n, has_out)
    recv = np.where(q.torch_pp, q.flow, 0.0)  # (its receive buffers: ``memory.pipeline_recv_buffers``)
    return dataclasses.replace(
        q, blocks=[(built[moe, ckpt], count) for moe, ckpt, count in runs], has_emb=emb & q.has_emb,
        has_out=out & q.has_out, emb_dense_grad=np.where(emb, q.emb_dense_grad, 0.0),
        loss=np.where(out, q.loss, 0.0), logits_grad=np.where(out, q.logits_grad, 0.0),
        mb_extra=np.where(out, q.mb_extra, q.flow), held_until_end=[],
        recv_in=np.where(emb & q.has_emb, 0.0, recv), recv_grad=np.where(out & q.has_out, 0.0, recv),
        last_cast4=whole.once(_last_cast_elems, spec, b, runs[-1][0] if runs else False)[idx] * 4.0)


def _torch_pp(b: PlanBatch) -> np.ndarray:
    """Plans whose pipeline runs torch's own stages and schedules (Megatron-Core's under TE layers)."""
    return (b.pp > 1) & ~b.te_layers


def _block_runs(spec: ModelSpec, pp: int, v: int, rank: int, every: int, before_pp: bool
                ) -> list[tuple[bool, bool, int]]:
    """The rank's blocks in forward order as runs (MoE?, checkpointed by ``layer:every``?, count); ``every`` 0: no
    ``layer:N`` AC (torchtitan's count: from 1 over this process's blocks, or over the model's when AC comes before
    the PP split, ``layers._rank_ckpt``)."""
    return [run for runs in _stage_runs(spec, pp, v, rank, every, before_pp) for run in runs]


def _stage_runs(spec: ModelSpec, pp: int, v: int, rank: int, every: int, before_pp: bool) -> list[list[tuple]]:
    """``_block_runs`` of each of the rank's stages (runs do not cross stages)."""
    n_stages = pp * v
    bounds = stage_bounds(spec.n_layers, n_stages)
    r = 0 if rank == FIRST else pp - 1
    out, j = [], 0
    for st in range(r, n_stages, pp):
        runs: list[list] = []
        for i in range(bounds[st], bounds[st + 1]):
            item = (spec.is_moe_layer(i), every > 0 and ((i if before_pp else j) + 1) % every == 0)
            j += 1
            if runs and tuple(runs[-1][:2]) == item:
                runs[-1][2] += 1
            else:
                runs.append([*item, 1])
        out.append([tuple(x) for x in runs])
    return out


def _memory_unit(shard, local, s, last, pb, gb, rb) -> Unit:
    """An FSDP unit's sizes for ``memory.simulate``: gathered params, unsharded grads, the reduce-scatter's
    input, its output, the fp32 sharded grad, the last gradient ``foreach_reduce`` keeps (``linger``: only over a
    shard group of 2+, the loop runs only there) and the last parameter's gradient (any shard group)."""
    linger = np.where(s > 1, last, 0.0)
    return Unit(s * shard * pb, local * gb, s * shard * rb, shard * rb, shard * 4.0, local * rb,
                linger * gb, linger * rb, last * gb, grouped=np.asarray(s) > 1)


def _of_batch(x, n_batch: int, idx: np.ndarray) -> np.ndarray:
    """``x`` (a scalar or one value per plan of a batch of ``n_batch``) for the plans ``idx``."""
    return np.broadcast_to(np.asarray(x, dtype=float), (n_batch,))[idx]


def _memory_block(spec: ModelSpec, b: PlanBatch, rv: C.RankView, costs: dict, idx: np.ndarray, moe: bool,
                  ckpt: bool, steps_of: Whole, sizes: tuple) -> Block:
    """One block kind (dense or MoE; checkpointed by ``layer:N`` or not) of the plans ``idx``: its FSDP units,
    the activations each AC mode keeps, the transient of its recompute, its backward steps and saved tensors."""
    pb, gb, rb, S, Se, ep1 = sizes
    ne_s, ex_s = (np.asarray(x)[idx] for x in rv.pshard[moe])
    ne_l, ex_l = (np.asarray(x)[idx] for x in rv.plocal[moe])
    a = {m: (np.asarray(v[0])[idx], np.asarray(v[1])[idx]) for m, v in costs[moe].act_split.items()}
    full = (b.ac[idx] == AC_MODES["full"]) | ((b.ac[idx] == AC_MODES["layer"]) & ckpt)
    sac = b.ac[idx] == AC_MODES["selective-op"]
    core = b.ac[idx] == AC_MODES["core-attn"]  # (recomputed at the attention's backward step, not at the start)
    act_attn, act_ffn = (np.where(full, a["full"][k], np.where(sac, a["sac"][k], np.where(core, a["attn"][k],
                                                                                         a["none"][k])))
                         for k in (0, 1))
    all_steps, items = steps_of[moe]
    keep = kept_by_ac_mode(items, steps_of.e_local if moe else None)
    transient = np.where(core, 0.0, a["none"][0] + a["none"][1] - act_attn - act_ffn
                         + np.where(sac, sac_uncollected(items, keep, idx, len(b)), 0.0))
    last_blk, last_ex = (x[idx] for x in steps_of.once(last_param_elems, spec, b, moe))
    blk_unit = _memory_unit(ne_s + np.where(ep1, ex_s, 0.0), ne_l + np.where(ep1, ex_l, 0.0), S, last_blk, pb, gb,
                            rb)
    experts = None
    if moe:
        off0, last_off0 = (x[idx] for x in steps_of.once(experts_off_dim0, spec, b))
        experts = dataclasses.replace(
            _memory_unit(np.where(ep1, 0.0, ex_s), np.where(ep1, 0.0, ex_l), Se, last_ex, pb, gb, rb),
            copy_temp=np.where(~ep1 & (Se > 1), off0 * pb, 0.0), last_off_dim0=~ep1 & last_off0)

    def sel(x):
        return _of_batch(x, len(b), idx)

    steps = [{"alloc": sel(st["alloc"]), "free": sel(st["free"]), "saved": st["saved"], "cast": st["cast"],
              "pgrad": (sel(st["pgrad"][0]), sel(st["pgrad"][1])),
              **({"residual_sum": sel(st["residual_sum"])} if "residual_sum" in st else {})} for st in all_steps]
    # (what each step frees of the tensors the block keeps: under core-attn what the attention saved inside is
    # not there to free)
    saved = {name: np.asarray(nb)[idx] * np.where(core & ~np.asarray(kk["attn"], bool), 0.0, 1.0)
             for (name, nb, _), kk in zip(items, keep, strict=True) if kk["none"]}
    later = _shared_later(items, keep, idx, len(b), full, sac) if moe else 0.0
    combine = _recompute_combine(later, idx, len(b), transient, steps_of.pair_bytes, b.ep[idx] > 1) if moe else 0.0
    return Block(blk_unit, experts, act_attn + act_ffn, transient, act_ffn, steps, saved, gb,
                 transient_attn=np.where(core, 0.0, a["none"][0] - act_attn),
                 fwd_working=(np.where(full, np.asarray(steps_of.moe_fwd)[idx], 0.0) if moe
                              else np.where(full | sac, 0.0,
                                            act_attn + act_ffn + np.asarray(steps_of.tp_out)[idx])),
                 recompute_combine=combine,
                 recompute_held=np.where(transient > 0, _of_batch(steps_of.ffn_held, len(b), idx)
                                         + (_moe_grad_held(spec, steps, steps_of.pair_bytes, idx, len(b)) if moe
                                            else steps[0]["alloc"]), 0.0),
                 recompute_experts=(_recompute_experts(steps_of, items, keep, idx, len(b), full, sac) - later
                                    if moe else 0.0),
                 experts_held=((b.tp[idx] > 1) & (b.ep[idx] == 1)) if moe else False)


def _moe_grad_held(spec: ModelSpec, steps: list, pair_bytes, idx: np.ndarray, n_batch: int):
    """The gradient a recomputed MoE block holds through its recompute, made by the backward ops that read no
    saved tensor and so run before the first unpack starts it: with shared experts the block's output gradient
    as their w2 reads it (``layers.backward_steps``' first step: SP's all-gather, autocast's bf16 copy; their
    backward runs first and triggers the recompute), without them the routed pairs' gradient (the combine's sum
    backward, which frees that one) [trace: dp_shard 2 x ep 2 x tp 2 SP, full AC: the (2, 256, 256) gathered
    gradient alive through the recompute with a shared expert, the (256, 2, 256) pairs' gradient without]."""
    assert spec.moe is not None
    return steps[0]["alloc"] if spec.moe.n_shared_experts else _of_batch(pair_bytes, n_batch, idx)


def sac_uncollected(items: list, keep: list, idx: np.ndarray, n_batch: int) -> np.ndarray:
    """Bytes selective AC caches for a layer that its backward never takes back: the outputs it saved of the ops
    after the last one that saves a tensor for backward (a dense block: w2's output where its mm is odd-numbered,
    and the MLP's reduce-scatter output under SP). They stay alive, beside the recompute's tensors, until the
    layer's backward ends. [derived: torch.utils.checkpoint's non-reentrant recompute stops (early stop) as soon as
    it has packed as many tensors as the forward did, and autograd packs an op's inputs before running it, so the
    recompute stops at w2's mm, before the selective-AC cache hands out w2's output or the reduce-scatter's; what
    the cache still holds lives as long as the checkpoint's frame, the layer's graph. Traces (2-4 layers of d 384,
    d_ff 1000, 384 tokens, selective-op, at the SwiGLU backward): FSDP 8 and TP 2 without SP, w2's (384, 384)
    output alive (-0.75% before), not where a bias on wo makes w2's mm even; TP 2 with SP, w2's output and the
    MLP's (2, 96, 384) reduce-scatter output alive, the latter alone where w2's mm is even]"""
    last = max((i for i, kk in enumerate(keep) if np.any(kk["none"])), default=-1)
    out = np.zeros(len(idx))
    for (_name, nbytes, _kind), kk in zip(items[last + 1:], keep[last + 1:], strict=True):
        out = out + _of_batch(nbytes, n_batch, idx) * _of_batch(kk["sac"], n_batch, idx)
    return out


def _recompute_combine(later, idx: np.ndarray, n_batch: int, transient, pair_bytes, ep_on) -> np.ndarray:
    """``memory.Block.recompute_combine`` of the plans ``idx`` (of a batch of ``n_batch``): 2 nk x d above the
    recompute set (the weighted copy, the scatter target); with EP 4 nk x d, at the recompute's combine
    all-to-all (the routed and received tokens, the experts' output and its regrouped copy beside the
    all-to-all's output, which the set counts) [trace: ep 2 of 2 experts, top-2, full AC, 2048 tokens of d 512:
    -8.9% without]; less the shared experts' tensors, which come after the combine (``later``: not yet made)
    [trace: the pairs' gradient made after the recompute there]; 0 where the block recomputes nothing. (Without
    shared experts the pairs' gradient is alive too, since before the recompute: ``_moe_grad_held``.)"""
    pairs = np.where(ep_on, 4.0, 2.0)
    return np.where(transient > 0, pairs * _of_batch(pair_bytes, n_batch, idx) - later, 0.0)


def _recompute_experts(steps_of: Whole, items: list, keep: list, idx: np.ndarray, n_batch: int, full, sac):
    """``memory.Block.recompute_experts`` before the shared experts' part: ``layers.recompute_experts_extra_bytes``
    of the block's AC mode, and under selective AC w2's per-expert outputs the cache still holds (their share)."""
    w2_kept = next(kk["sac"] for (name, _, _), kk in zip(items, keep, strict=True) if name == "experts.w2.out")
    cached = _of_batch(w2_kept, n_batch, idx) * _of_batch(steps_of.pair_bytes, n_batch, idx)
    return np.where(full, _of_batch(steps_of.experts_extra[False], n_batch, idx),
                    np.where(sac, _of_batch(steps_of.experts_extra[True], n_batch, idx) + cached, 0.0))


def _shared_later(items: list, keep: list, idx: np.ndarray, n_batch: int, full, sac) -> np.ndarray:
    """The shared experts' saved tensors a recompute makes after the routed experts and their combine (the shared
    experts run last in the forward): bytes of the recompute set not yet made at those moments."""
    later = np.zeros(len(idx))
    for (name, nbytes, _), kk in zip(items, keep, strict=True):
        if name.startswith("shared.") and kk["none"]:
            x = _of_batch(nbytes, n_batch, idx)
            later = later + np.where(full, x, np.where(sac, x * (1.0 - _of_batch(kk["sac"], n_batch, idx)), 0.0))
    return later


def _rank_memory_inputs(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute, p_shard,
                        p_opt, idx: np.ndarray, runs: list, steps_of: Whole, built: dict | None = None
                        ) -> RankMemory:
    """The sizes ``memory.simulate`` replays, for the plans ``idx`` (bytes). ``steps_of``: per block kind, its
    backward steps and saved tensors over the whole batch (``layers.backward_steps``, ``layers.saved_tensors``).
    ``runs``: the blocks replayed; ``built`` (filled): (MoE?, checkpointed?) -> its ``Block``."""
    pb, rb = b.param_bytes[idx].astype(float), b.reduce_bytes[idx].astype(float)
    fsdp_on = b.fsdp_applied[idx]
    gb = grad_elem_bytes(b)[idx]  # unsharded gradients: param dtype under FSDP, the fp32 parameters' without
    S, Se = b.fsdp[idx].astype(float), b.efsdp[idx].astype(float)
    sizes = (pb, gb, rb, S, Se, (b.ep == 1)[idx])

    has_emb, has_out = rv.has_emb[idx], rv.has_out[idx]
    blocks = []
    built = {} if built is None else built  # runs of the same kind share one Block (and its replay caches)
    for moe, ckpt, count in runs:
        if (moe, ckpt) not in built:
            built[moe, ckpt] = _memory_block(spec, b, rv, c.costs, idx, moe, ckpt, steps_of, sizes)
        blocks.append((built[moe, ckpt], count))
    rope = _rope_dim(spec)
    buffers = _rope_buffers(spec, b)[idx]
    # what a microbatch in flight keeps beside its blocks' activations: its stage output (the residual stream,
    # sent on and kept by the schedule until its backward), or on the last stage the loss's saved tensors (the
    # fp32 log-softmax output, 4 B per logit; the fused loss: the logits) and the final norm's input and output
    stage_out = _stage_output_bytes(spec, sh)[idx]
    act_b = np.asarray(sh.act_b)[idx]
    final_norm_saved = _final_norm_saved_bytes(spec, sh)[idx]
    loss_saved = _loss_saved_bytes(spec, b, sh, c)[idx]
    pipe = _pipeline_sizes(b, c, rank, idx, steps_of, stage_out, act_b, has_emb, has_out)
    inflight_logits = np.where(b.fused_loss[idx], 0.0, pipe["stage_logits"])
    return RankMemory(
        n=len(idx), parameters=np.asarray(p_opt)[idx] * 4.0, optimizer_states=np.asarray(p_opt)[idx] * 8.0,
        buffers=buffers, cp_buffers=_cp_buffers(b, idx, rope, has_emb, has_out), inputs=_step_inputs(b, idx),
        fsdp=fsdp_on, raf=b.raf[idx],
        raf_out=b.raf_always[idx], acc=((b.grad_accum > 1) & ~b.sync_once)[idx], once=b.sync_once[idx],
        has_emb=has_emb, has_out=has_out, **_end_units(spec, b, rv, idx, p_shard, sizes),
        loss=np.asarray(steps_of.once(_loss_bytes, spec, b, sh, rv, c))[idx] * np.ones(len(idx)) + inflight_logits,
        blocks=blocks, opt_temporaries=np.asarray(steps_of.once(optimizer_temporaries, b, rv))[idx], flat_held=S > 1,
        hsdp=(b.dp_replicate > 1)[idx], reduce_bytes=rb, flow=stage_out,
        emb_grad_gathered=np.where(has_emb, stage_out * (np.asarray(sh.sp_div)[idx] - 1.0), 0.0),
        out_input_grad=np.where(has_out, (np.asarray(sh.T) * spec.d_model * np.asarray(sh.act_b))[idx], 0.0),
        out_grad_reduce=np.where(has_out, _out_grad_reduction(b, sh, spec.d_model)[idx], 0.0),
        final_norm_saved=np.where(has_out, final_norm_saved, 0.0),
        logits_grad=np.where(has_out, np.asarray(c.logits, dtype=float)[idx] * np.asarray(sh.act_b)[idx], 0.0),
        pp=(b.pp > 1)[idx],
        mb_extra=np.where(has_out, loss_saved + inflight_logits, np.where((b.pp > 1)[idx], stage_out, 0.0)),
        **pipe,
        autocast_cache=_autocast_cache(b, idx, fsdp_on, steps_of.once(_linear_weight_elems, spec, b, rv), rv),
        param_bytes=pb, out_weight4=np.asarray(rv.out_local - rv.norm_local)[idx] * 4.0 * np.ones(len(idx)),
        last_cast4=steps_of.once(_last_cast_elems, spec, b, runs[-1][0] if runs else False)[idx] * 4.0)


def _end_units(spec: ModelSpec, b: PlanBatch, rv: C.RankView, idx: np.ndarray, p_shard, sizes: tuple) -> dict:
    """The embedding's and the [norm, output] unit's sizes for ``_rank_memory_inputs`` (the plans ``idx``), and
    every fp32 gradient of the rank (``all_grads4``)."""
    pb, gb, rb, S = sizes[:4]
    has_emb, te = rv.has_emb[idx], b.te_layers[idx]
    emb_local = np.asarray(rv.emb_local)[idx]
    V, d = spec.vocab_size, float(spec.d_model)
    all_grads4 = np.asarray(p_shard)[idx] * 4.0 + _of_batch(_plain_embedding_grad_extra(spec, b, rv), len(b), idx)
    return dict(
        all_grads4=all_grads4, emb=_memory_unit(np.asarray(rv.emb_shard)[idx], emb_local, S, emb_local, pb, gb, rb),
        # the embedding backward's dense gradient over the whole vocabulary (torch's embedding backward, also
        # under RowwiseParallel), its vocab shard under TE layers (Megatron's VocabParallelEmbedding)
        emb_dense_grad=np.where(has_emb, np.where(te, emb_local, V * d) * gb, 0.0), emb_sharded=(b.tp > 1)[idx] & ~te,
        out=_memory_unit(np.asarray(rv.norm_shard + rv.outw_shard)[idx], np.asarray(rv.out_local)[idx], S,
                         np.asarray(rv.out_local - rv.norm_local)[idx] * np.ones(len(idx)), pb, gb, rb))


def _pipeline_sizes(b: PlanBatch, c: RankCompute, rank: int, idx: np.ndarray, steps_of: Whole, stage_out,
                    act_b, has_emb, has_out) -> dict:
    """The pipeline's share of ``RankMemory`` for the plans ``idx`` (bytes, counts): microbatches per pass and in
    flight, the last stage's logits torch's stage keeps, its receive buffers and what its schedule's sends hold."""
    # torch's pipeline stage keeps each microbatch's output in its fwd_cache until that microbatch's backward
    # returns: on the last stage the logits (the projection's output dtype), beside what the loss saved of them
    # while the microbatch is in flight and through its whole backward after the loss's (a fused loss saves the
    # logits themselves: nothing more in flight, but they outlive its backward) [derived: torch 2.13
    # pipelining/stage.py forward_one_chunk / backward_one_chunk; bench/real_vs_trace.py: tiny pp2 1F1B, the last
    # stage's real run 1 MiB (one (128, 2048) fp32 logits) over the trace before the trace kept them too].
    # Megatron-Core's own schedule (TE-layer plans) computes the loss inside the last stage's forward step and keeps
    # the loss, not the logits.
    stage_logits = np.where(has_out & (b.pp[idx] > 1) & ~b.te_layers[idx], np.asarray(c.logits)[idx] * act_b, 0.0)
    m = b.n_micro[idx].astype(float)
    w = np.where(b.pp[idx] > 1, np.asarray(steps_of.once(inflight, b, rank))[idx], 1.0)
    m = np.where(b.pp[idx] > 1, m, 1.0)
    # torch's pipeline stages' receive buffers: the rank's v stages less the first (inputs) and less the last
    # (output gradients); v = 1 the first or the last stage
    torch_pp = _torch_pp(b)[idx]
    recv = np.where(torch_pp, stage_out, 0.0)
    v = b.pp_stages_per_rank[idx].astype(float)
    sent_later, sent_last = sends_held(b.pp_schedule[idx] == SCHED_GPIPE, m, np.where(has_emb, 0.0, recv))
    return dict(m=m, w=w, w_later=np.where(m > w, w, np.maximum(w - 1.0, 1.0)), stage_logits=stage_logits,
                recv_buffers=pipeline_recv_buffers(m, recv, v - has_emb, v - has_out), torch_pp=torch_pp,
                recv_in=np.where(has_emb, 0.0, recv), recv_grad=np.where(has_out, 0.0, recv),
                sent_later=sent_later, sent_last=sent_last)


def _stage_output_bytes(spec: ModelSpec, sh: Shapes) -> np.ndarray:
    """A stage's output per microbatch, the residual stream it sends on (the local shard under SP), bytes."""
    return np.asarray(sh.T) * spec.d_model / np.asarray(sh.sp_div) * np.asarray(sh.res_b)


def _final_norm_saved_bytes(spec: ModelSpec, sh: Shapes) -> np.ndarray:
    """What the final norm keeps per microbatch: its input (the residual stream, fp32 under autocast) and its
    output as the projection reads it (gathered under SP), bytes."""
    return np.asarray(sh.T) * spec.d_model * (np.asarray(sh.act_b) + np.asarray(sh.res_b) / np.asarray(sh.sp_div))


def _loss_saved_bytes(spec: ModelSpec, b: PlanBatch, sh: Shapes, c: RankCompute) -> np.ndarray:
    """What the last stage keeps per microbatch in flight for the loss's backward: the fp32 log-softmax output (4 B
    per logit; the fused loss: the logits) and the final norm's saved tensors, bytes."""
    per_logit_saved = np.where(b.fused_loss, np.asarray(sh.act_b), 4.0)
    return np.asarray(c.logits) * per_logit_saved + _final_norm_saved_bytes(spec, sh)


def _tp_reduction_bytes(b: PlanBatch, sh: Shapes, d: int, elem_bytes) -> np.ndarray:
    """A (T x d) partial sum reduced over TP, bytes of ``elem_bytes`` elements alive at the reduction: the sum and,
    with SP, its copy regrouped along the sequence (torch's functional reduce-scatter concatenates the chunks of a
    non-zero scatter dimension) and the reduce-scatter's output (T / tp x d); without SP the all-reduce's output
    (T x d); 0 without TP [derived; traces below]."""
    g = np.asarray(sh.T) * d * np.asarray(elem_bytes)
    sd = np.asarray(sh.sp_div)
    return np.where(b.tp > 1, np.where(sd > 1, 2.0 * g + g / sd, 2.0 * g), 0.0)


def _out_grad_reduction(b: PlanBatch, sh: Shapes, d: int) -> np.ndarray:
    """Bytes alive above the stage's tensors while the output projection's input gradient is reduced under TP, its
    weight gradient made and the logits' gradient freed: the reduction (``_tp_reduction_bytes``) of the gradient in
    the dtype of the final norm's output (fp32 under autocast, which casts the bf16 gradient back), less the
    projection's saved input, released with its backward (counted in ``final_norm_saved`` until the norm's
    backward) [derived: the all-gather's backward; trace: tp 6 SP without FSDP (autocast), micro batch 4, d 576: the
    (4, 384, 576) fp32 gradient, the (24, 64, 576) cat and the (4, 64, 576) reduce-scatter output at the peak, -4.7%
    before]."""
    saved_input = np.asarray(sh.T) * d * np.asarray(sh.act_b)
    return np.where(b.tp > 1, _tp_reduction_bytes(b, sh, d, sh.res_b) - saved_input, 0.0)


def _tp_output_transient(b: PlanBatch, sh: Shapes, d: int) -> np.ndarray:
    """A dense block that keeps its tensors (no AC), at its last op in forward, above the block's saved tensors and
    the stream before it (``Block.fwd_working`` is both): under TP the reduction of w2's partial output
    (``_tp_reduction_bytes``) and, with SP, the FFN norm's local output (T / tp x d: the all-gather's input, alive
    while the MLP that was called with it runs) — less the block's output (the stream after it, ``flow``), which
    does not exist yet. FSDP still holds the block's unsharded parameters there: on a model of few wide layers that
    moment is the peak [derived; trace: 1 layer of d 1000, HSDP x tp4 SP, fp32: the (256, 1000) mm output, the (4,
    64, 1000) cat, the (1, 64, 1000) reduce-scatter output and norm output beside the unsharded block at w2's
    reduce-scatter, -3.3% before]."""
    local = np.asarray(sh.T) * d / np.asarray(sh.sp_div)
    norm_out = np.where(np.asarray(sh.sp_div) > 1, local * np.asarray(sh.act_b), 0.0)
    flow = local * np.asarray(sh.res_b)
    return np.where(b.tp > 1, _tp_reduction_bytes(b, sh, d, sh.act_b) + norm_out - flow, 0.0)


def _step_inputs(b: PlanBatch, idx: np.ndarray) -> np.ndarray:
    """Bytes of the step's token ids and labels without PP: two int64 tensors of the local batch (a pass of it
    under gradient accumulation), alive from the forward to the end of the backward, as torchtitan's train step
    and the executor's worker hold them (with PP the stages take microbatch-size tensors, not modelled: one
    microbatch's ids, 8 B/token) [derived; trace: cp4 x tp4, two (1, 2048) int64 tensors beside the loss, 32 KiB
    of a -0.53% miss]."""
    return np.where(b.pp[idx] == 1, 2.0 * 8.0 * b.local_batch_size[idx] * b.seq_len[idx], 0.0)


def _cp_buffers(b: PlanBatch, idx: np.ndarray, rope: float, has_emb, has_out) -> np.ndarray:
    """Bytes torch's ``context_parallel()`` holds while entered (the executor enters it around each microbatch's
    forward and backward, as torchtitan does, with buffers [tokens, labels, every stage's RoPE table]): a clone of
    every buffer it must restore (the RoPE tables, fp32, full sequence), the list of load-balanced shards it made
    (tokens and labels int64 and every table, a 1/cp share each) and the clone of the last shard (the last table's)
    that its loop variable keeps [derived from torch.distributed.tensor.experimental.context_parallel; trace: 0.87
    MB of a 29.9 MB peak on a 6-layer tiny model at cp 4 x tp 4, all of it these]."""
    cp = b.cp[idx].astype(float)
    seq = b.seq_len[idx].astype(float)
    stages = np.where(b.pp[idx] > 1, b.pp_stages_per_rank[idx], 1).astype(float)
    table = seq * rope * 4.0
    tokens = b.micro_batch_size[idx] * seq / cp * 8.0 * (np.asarray(has_emb, float) + np.asarray(has_out, float))
    return np.where(cp > 1, stages * table + (stages + 1.0) * table / cp + tokens, 0.0)


def _last_cast_elems(spec: ModelSpec, b: PlanBatch, moe: bool) -> np.ndarray:
    """Elements of the last linear weight a block uses in forward (the last weight autocast casts on a stage
    without the output projection): the MLP's w2; a MoE layer's shared experts' w2, else its router."""
    by_name = {name: rows * per_row for name, rows, per_row, _ in layer_tensors(spec, b, moe)}
    if not moe:
        return by_name["w2"] * np.ones(len(b))
    assert spec.moe is not None
    return (by_name["shared.w2"] if spec.moe.n_shared_experts else by_name["router"]) * np.ones(len(b))


def _linear_weight_elems(spec: ModelSpec, b: PlanBatch, rv: C.RankView) -> np.ndarray:
    """Elements of the linear weights (and biases) of the rank's blocks, routed experts and norms left out
    (``_autocast_cache``), over the whole batch."""
    total = np.zeros(len(b))
    for k in rv.kinds:
        lin = sum((rows * per_row for name, rows, per_row, expert in layer_tensors(spec, b, k)
                   if not expert and "norm" not in name), np.zeros(len(b)))
        total = total + rv.n_of[k] * lin
    return total


def _autocast_cache(b: PlanBatch, idx: np.ndarray, fsdp_on, linear_elems, rv: C.RankView) -> np.ndarray:
    """Without FSDP a bf16 / fp16 plan runs under torch.autocast (as torchtitan does), which caches the cast copy
    of every linear weight (and bias) it multiplies — attention and MLP linears, the router, the shared experts, the
    output projection; not norms, the embedding or the stacked experts (views, not leaves) — from its first use to
    the end of the region [derived from torch's autocast weight cache; trace]."""
    pb = b.param_bytes[idx].astype(float)
    on = ~fsdp_on & (pb < 4.0)
    total = np.asarray(linear_elems)[idx]
    outw = np.asarray(rv.out_local - rv.norm_local)[idx] * np.ones(len(idx))
    return np.where(on, (total + outw) * pb, 0.0)


def _loss_bytes(spec: ModelSpec, b: PlanBatch, sh: Shapes, rv: C.RankView, c: RankCompute):
    """The loss's peak on the last stage, bytes. Plain cross-entropy (tp = 1) peaks in its backward with the
    log-softmax output, the nll gradient and the log-softmax gradient alive (fp32 each): 12 B/logit (read off the
    live storages at the peak of executor traces). Loss parallel (tp > 1, torch's ``loss_parallel`` handlers on the
    local vocabulary shard, ``torch/distributed/tensor/parallel/loss.py``) peaks in its combined nll + log-softmax
    backward: the saved fp32 log-softmax output, ``grad_input = zeros_like(x)``, ``exp(x)`` and their sum, 4 B each,
    16 B/logit in any param dtype (its forward holds at most 14: bf16 logits, their fp32 copy, the shifted logits
    and their exp) [derived from the handlers' code; traced since the trace counts what DTensor's handlers
    allocate (qwen3-30b-a3b TP 2: four fp32 tensors of the local logits at the peak)]. Plus the final norm's input
    (the residual stream: fp32 under autocast) and gathered output. A fused cross-entropy keeps the logits and
    writes one gradient of their size (param_dtype each) [derived; full-scale trace of the executor's fused loss:
    test_trace_of_the_loss_matches_the_model]."""
    d = spec.d_model
    per_logit = np.where(b.fused_loss, 2.0 * sh.act_b, np.where(b.tp > 1, 16.0, 12.0))
    # loss parallel's backward also holds per-token index tensors: the safe target (int64), the mask of targets
    # outside the rank's vocabulary shard (bool), the shard-local target (int64), the -1 update (fp32), the row
    # arange (int64) and the ignore-index mask's select (fp32): 33 B/token [derived: loss.py's
    # ``_nll_loss_and_log_softmax_backward``; trace: cp2 x tp4, the six (384,) / (384, 1) tensors, 12.4 KiB]
    per_token = np.where(~b.fused_loss & (b.tp > 1), LOSS_PARALLEL_INDEX_BYTES_PER_TOKEN, 0.0)
    fused_chunks = np.where(b.fused_loss, _fused_loss_chunks(spec.vocab_size, np.asarray(c.logits, float)), 0.0)
    return np.where(rv.has_out, c.logits * per_logit + fused_chunks + sh.T * per_token
                    + sh.T * d * (sh.act_b + sh.res_b / sh.sp_div), 0.0)


# [derived] loss parallel's per-token index tensors in its backward (``_loss_bytes``): 8 + 1 + 8 + 4 + 8 + 4 B
LOSS_PARALLEL_INDEX_BYTES_PER_TOKEN = 33.0


# [assumed, the executor's] logits the chunked fused cross-entropy processes at a time (executor/loss.py's
# CHUNK_ELEMENTS; tests/test_fused_loss.py checks they are equal)
FUSED_LOSS_CHUNK_ELEMENTS = 2**18


def _fused_loss_chunks(vocab: int, logits: np.ndarray) -> np.ndarray:
    """The fp32 temporaries of the fused cross-entropy's backward beside its logits and their gradient: a chunk of
    ``max(1, CHUNK // vocab)`` rows (at most every row) is cast to fp32 and the row's log-sum-exp subtracted while
    the previous chunk's probabilities are still bound (3 chunks; 2 when one chunk holds every row). A one-kernel
    GPU fused loss has none, so this describes the executor (a rand model of 2 layers, d_model 48 and a 65536
    vocabulary: 3 MiB of a 58.6 MB peak, read off the live storages of its trace) [derived from executor/loss.py]."""
    chunk = np.minimum(max(1, FUSED_LOSS_CHUNK_ELEMENTS // vocab) * vocab, logits)
    return np.where(logits > chunk, 3.0, 2.0) * chunk * 4.0


@dataclass(frozen=True)
class RankPeak:
    """A rank's allocated peak (the largest of its memory phases) and what CUDA's caching allocator reserves at it
    (costmodel/reserved.py; a gloo (CPU) profile has no caching allocator). Arrays over the batch."""

    memory_bytes: np.ndarray  # the peak: the largest phase's total
    breakdown_bytes: dict  # MEMORY_KEYS -> bytes held at the peak
    phase: np.ndarray  # index into PHASES of the peak's phase
    phase_totals_bytes: dict  # phase -> its total
    reserved_bytes: np.ndarray
    reserved_breakdown_bytes: dict  # RESERVED_KEYS -> bytes


def rank_peak(b: PlanBatch, sh: Shapes, hw: HardwareProfile, rv: C.RankView, c: RankCompute,
              phases: dict) -> RankPeak:
    """A rank's ``RankPeak`` from its memory phases."""
    n, z = len(b), np.zeros(len(b))
    totals = {k: sum(v.values()) for k, v in phases.items()}
    names = list(phases)
    which = np.argmax(np.stack([totals[k] for k in names]), axis=0)
    mb = {k: np.choose(which, [np.broadcast_to(phases[p].get(k, z), (n,)) for p in names]) for k in MEMORY_KEYS}
    mem = np.choose(which, [np.broadcast_to(totals[p], (n,)) for p in names])
    rsv = reserved_breakdown(b, rv, np.asarray(c.logits, dtype=float), np.asarray(sh.act_b, dtype=float),
                             rank_params(b, rv)[0], mem, mb, which, allocator=hw.comm_overlap)
    return RankPeak(memory_bytes=mem, breakdown_bytes=mb, phase=which, phase_totals_bytes=totals,
                    reserved_bytes=sum(rsv.values()), reserved_breakdown_bytes=rsv)


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
    emb_full = np.where(b.te_layers, emb_local, vocab_elems)
    accumulated = (local - emb_local) * rb + np.where(has_emb, emb_full * rb, 0.0)
    # with gradient accumulation (ga > 1) the grads of the earlier passes are there in every schedule (traces of
    # pp2 GPipe with ga 4 in fp32: the stage's full gradients beside the activations) [measured]
    steady = (b.pp > 1) & (((b.pp_schedule != SCHED_GPIPE) & (m_pass > n_inflight)) | (ga > 1))
    # (grad_sync once: the earlier passes' unsharded accumulators instead of sharded fp32 gradients)
    grads_prev = np.where((b.pp == 1) & (ga > 1), np.where(b.sync_once, accumulated, p_shard * 4.0),
                          np.where(steady, accumulated, 0.0))
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
        FWD: dict(base, gradients=grads_prev, fsdp_unsharded_params=unsh_fwd, activations=acts,
                               logits_and_loss=logits_bytes),
        BWD1: dict(base, gradients=grads_prev, fsdp_unsharded_params=unsh_bwd,
                                           fsdp_grad_buffers=layer_w * pb + layer_g * rb, activations=acts,
                                           recompute_transient=c.transient),
        # PP: a later microbatch's backward starts beside the gradients the first one accumulated (fp32, the
        # embedding's at full vocabulary), the activations of the microbatches still in flight (the schedule's
        # window, or all that remain when every forward ran first) and its last layer's new gradients in
        # param_dtype, added into the accumulated ones in place (mixtral-8x7b PP4 x TP2 x EP2 trace: the MoE
        # block's expert gradients, 1.3 GiB, set the peak there) [derived, trace]
        BWD2: dict(base, gradients=np.where(later, accumulated, 0.0),
                                               fsdp_unsharded_params=np.where(later, unsh_bwd, 0.0),
                                               fsdp_grad_buffers=np.where(later, layer_w * pb, 0.0),
                                               activations=np.where(later, np.minimum(n_inflight, m_all - 1.0), 0.0)
                                               * c.act),
        BWD_END: dict(base, gradients=np.where(b.pp > 1, accumulated - np.where(has_emb, emb_full * rb, 0.0),
                                                         np.maximum(grads_prev, p_shard * 4.0)),
                                fsdp_unsharded_params=np.where(sharded & b.raf, emb_local * pb, unsh_bwd),
                                fsdp_grad_buffers=emb_grad, activations=np.maximum(n_inflight - 1.0, 0.0) * c.act),
        OPT: dict(base, gradients=p_shard * 4.0, optimizer_temporaries=optimizer_temporaries(b, rv),
                               fsdp_unsharded_params=np.where(dist, keep_all, 0.0)),
    }


def rank_params(b: PlanBatch, rv: C.RankView) -> tuple:
    """(parameters a rank holds after FSDP sharding, those whose optimizer step it runs). Under the distributed
    optimizer the dense parameters' state is sharded over dp_replicate, and so are the routed experts' under
    torchtitan-style EP; under Megatron-style EP the experts' over their expert-data-parallel group ``edp`` (with
    ep = dp_replicate there is no second holder of an expert and its state is not sharded) [framework source:
    Megatron-Core's distributed optimizer shards each gradient buffer over that buffer's data-parallel group]."""
    dense, expert, (dense_opt, expert_opt) = _param_split(b, rv)
    return dense + expert, dense_opt + expert_opt


def _param_split(b: PlanBatch, rv: C.RankView) -> tuple:
    """(dense parameters a rank holds, routed-expert ones, (those of each whose optimizer step it runs))."""
    dense = rv.edge_shard + sum(rv.n_of[k] * rv.pshard[k][0] for k in rv.kinds)
    expert = sum((rv.n_of[k] * rv.pshard[k][1] for k in rv.kinds), np.zeros(len(b)))
    dense_div = np.where(b.zero1, b.dp_replicate, 1)
    expert_div = np.where(b.ep_megatron, np.where(b.distributed_optimizer.astype(bool), b.edp, 1), dense_div)
    return dense, expert, (dense / dense_div, expert / expert_div)


def optimizer_temporaries(b: PlanBatch, rv: C.RankView) -> np.ndarray:
    """Bytes of the foreach AdamW step's temporaries: one fp32 tensor per parameter of a param group
    (``_foreach_sqrt`` of the second moments), freed before the next group. The executor makes one group per
    device mesh (``executor.worker.make_optimizer``): routed experts under EP live on their own mesh, so the
    step peaks with the larger of the two groups, not both [derived from torch.optim.AdamW's per-group
    ``_multi_tensor_adamw``; trace: qwen3-30b-a3b 4 layers, dp_shard 4 x ep 2: 2304 MiB of ``_foreach_sqrt``
    outputs at the peak, the experts' alone, not the 2970 MiB of every parameter]."""
    _, _, (dense_opt, expert_opt) = _param_split(b, rv)
    return np.where(b.ep > 1, np.maximum(dense_opt, expert_opt), dense_opt + expert_opt) * 4.0


def _rank_moment_bounds(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView,
                        c: RankCompute, any_reshard: bool = False) -> tuple:
    """(the optimizer step's moment, the largest other moment), each from below: their larger is a lower bound of
    the rank's allocated peak without replaying the timeline [derived]. Every key of the timeline holds bytes and
    none is ever negative, so leaving keys out bounds a moment from below; every moment holds the fp32 parameters
    and Adam states (12 B per parameter the rank steps), the pipeline's receive buffers
    (``memory.pipeline_recv_buffers``) and, with gradient accumulation, the earlier passes' sharded fp32 gradients
    (at least 4 B per parameter it holds). The moments:

    * the optimizer step (``memory._optimizer_step``): every sharded gradient and the foreach temporaries;
    * the end of the forwards before the first backward: W microbatches in flight (``layers.inflight``; 1 without
      PP), each keeping its blocks' activations (``RankCompute.act``) and at least its stage output over its
      received input; on the last stage the loss's peak (``_loss_bytes``) above the stage output. Interleaved
      schedules: the warm-up forwards torch runs before its first backward (``_interleaved_bounds``);
    * a 1F1B forward after the first backward (m > W, m >= 3: ``memory.simulate``'s steady state): W in flight
      again beside the gradient accumulators the first backward made (every unsharded parameter of the stage in
      reduce dtype, under FSDP) and, without reshard-after-forward, every unit's gathered parameters;
    * the reduce after a pipeline's last backward (``memory._reduce_after``, under FSDP): the accumulators, when
      every stage of the rank has run a backward by then (one stage per rank, or an interleaved schedule of two
      rounds or more); a unit's gradient reduction (``_unit_reduce_bound``);
    * a vocab-sharded embedding's backward (``_embedding_grad_bound``) and the recompute of the first block a
      backward reaches (``_first_backward_bound``).

    ``any_reshard``: a bound for every reshard-after-forward choice (the unsharded parameters that only some keep
    after a forward left out). Search decides with it (``rank_reserved_bound``) which rows can fit and which pairs
    a found plan dominates before any replay; tests hold it below the replayed peak on whole search spaces."""
    p_shard, p_opt = rank_params(b, rv)
    pb, rb = b.param_bytes.astype(float), b.reduce_bytes.astype(float)
    pp, v1, m = b.pp > 1, b.pp_stages_per_rank == 1, b.n_micro.astype(float)
    stage_out = _stage_output_bytes(spec, sh)
    recv = np.where(pp & ~b.te_layers, stage_out, 0.0)
    v = b.pp_stages_per_rank.astype(float)
    static = p_opt * 12.0 + pipeline_recv_buffers(np.where(pp, m, 1.0), recv, v - rv.has_emb, v - rv.has_out)
    at_opt = static + p_shard * 4.0 + optimizer_temporaries(b, rv)
    held = static + np.where((b.grad_accum > 1) & ~b.sync_once, p_shard * 4.0, 0.0)
    w = np.where(pp, inflight(b, rank), 1.0)
    # beyond its blocks' activations a microbatch in flight keeps at least, on the last stage, the loss's saved
    # tensors over its received input, on the first stage of a pipeline its output; the loss's peak is above both
    per_mb = c.act + np.where(rv.has_out, _loss_saved_bytes(spec, b, sh, c) - stage_out,
                              np.where(pp & rv.has_emb, stage_out, 0.0))
    loss = np.where(rv.has_out, _loss_bytes(spec, b, sh, rv, c) - _loss_saved_bytes(spec, b, sh, c), 0.0)
    fsdp, kept = b.fsdp_applied, ~b.raf
    gathered = (sum(rv.n_of[k] * (b.fsdp * rv.pshard[k][0] + b.efsdp * rv.pshard[k][1]) for k in rv.kinds)
                + b.fsdp * (rv.emb_shard + rv.norm_shard + rv.outw_shard)) * pb
    out_unit = np.where(rv.has_out & ~b.raf_always, b.fsdp * (rv.norm_shard + rv.outw_shard) * pb, 0.0)
    # (every unit, or without reshard-after-forward's "always" the [norm, output] one, unsharded after the forward)
    unsharded = np.where(fsdp & ~any_reshard, np.where(kept, gathered, out_unit), 0.0)
    local = rv.emb_local + rv.out_local + sum(rv.n_of[k] * (rv.plocal[k][0] + rv.plocal[k][1]) for k in rv.kinds)
    fsdp_pp = fsdp & pp
    edges = (np.where(rv.has_emb, stage_out, 0.0), np.where(rv.has_out, _loss_saved_bytes(spec, b, sh, c) - stage_out,
                                                            0.0))
    units = _StageUnits(rv, b, np.where(fsdp_pp, rb, 0.0), np.where(fsdp_pp, pb, 0.0), kept & ~any_reshard)
    warm = np.where(v1, w * per_mb + loss + unsharded,
                    _interleaved_bounds(spec, b, rank, c.costs, pp & ~v1, edges, loss, units,
                                        np.where(_torch_pp(b), stage_out, 0.0)))
    steady = _steady_bound(b, rv, m, w, per_mb, loss, local * rb, gathered, np.where(kept & ~any_reshard, gathered,
                                                                                   0.0))
    reduce = _reduce_bound(b, rv, m, local * rb, gathered, pb)
    return at_opt, held + np.maximum.reduce([warm, steady, reduce, _unit_reduce_bound(b, rv),
                                             _backward_moments(spec, b, sh, rank, rv, c, w, gathered, local,
                                                               stage_out)])


def _backward_moments(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute, w,
                      gathered, local, stage_out) -> np.ndarray:
    """The larger of ``_embedding_grad_bound`` and ``_first_backward_bound`` for ``_rank_moment_bounds`` (``w``
    microbatches in flight at the first backward, ``gathered`` the rank's gathered parameters, ``local`` its local
    parameters, ``stage_out`` a stage output's bytes): a microbatch in flight at a backward keeps its blocks'
    activations and the stage output a first stage keeps, less the received input (a receive buffer)."""
    pp, v1 = b.pp > 1, b.pp_stages_per_rank == 1
    per_mb = c.act + np.where(pp & rv.has_emb & ~rv.has_out, stage_out, 0.0) - np.where(
        _torch_pp(b) & ~rv.has_emb, stage_out, 0.0)
    acc = np.where(b.fsdp_applied, local * b.reduce_bytes,
                   np.where((b.grad_accum > 1) & ~b.sync_once, 0.0, local * 4.0))
    blocks = _first_backward_bound(spec, b, sh, rank, rv, c, w * per_mb, per_mb + acc)
    emb = _embedding_grad_bound(spec, b, rv, b.n_micro.astype(float),
                                np.where(v1, gathered, b.fsdp * rv.emb_shard * b.param_bytes),
                                np.where(v1, (w - 1.0) * per_mb, 0.0))
    return np.maximum(emb, blocks)


def rank_reserved_bound(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute,
                        allocator: bool, any_reshard: bool = False) -> np.ndarray:
    """A lower bound of the rank's reserved memory (``rank_peak``) without replaying the timeline [derived]: the
    allocated peak's bound (``_rank_moment_bounds``), and more where the peak is known not to be the optimizer
    step's. Reserved memory at the peak is at least the default stream's part (the peak less what the FSDP
    streams hold of it) plus each stream's pool (``reserved.reserved_breakdown``: pages of at least what they
    hold). Under PP before the optimizer step the reduce-scatter stream's pool (every sharded fp32 gradient,
    ``reserved.reduce_scatter_pool``) holds nothing of the allocated peak (the stage's gradients are its unsharded
    accumulators then, on the default stream), so there reserved is at least the peak plus that whole pool. The
    peak is not the optimizer step's where a bound of another moment exceeds the optimizer moment's upper bound
    (``_optimizer_moment_upper``: ties go to the earlier phase). A CPU (gloo) profile has no caching allocator:
    reserved is the allocated peak."""
    at_opt, other = _rank_moment_bounds(spec, b, sh, rank, rv, c, any_reshard)
    alloc = np.maximum(at_opt, other)
    if not allocator:
        return alloc
    wrapped = fsdp_streams(b)
    pool, _ = reduce_scatter_pool(b, rv, wrapped, rank_params(b, rv)[0], b.reduce_bytes.astype(float))
    known_before_opt = (b.pp > 1) & wrapped & (other > _optimizer_moment_upper(spec, b, rv, at_opt))
    return np.where(known_before_opt, other + pool, alloc)


def _optimizer_moment_upper(spec: ModelSpec, b: PlanBatch, rv: C.RankView, at_opt) -> np.ndarray:
    """The optimizer step's moment (``memory._optimizer_step``) from above, given ``at_opt`` (its bound from below
    in ``_rank_moment_bounds``: parameters and Adam states, receive buffers, the sharded gradients, the foreach
    temporaries) [derived]: the step clears every key but those, the RoPE buffers and the gradients, which are
    every fp32 gradient of the rank (without FSDP a vocab-sharded embedding's is the whole vocabulary's), and its
    temporaries are at least two clones of such an embedding gradient's rows."""
    dense_emb = ~b.fsdp_applied & rv.has_emb & (b.tp > 1) & ~b.te_layers
    emb_local = np.asarray(rv.emb_local, dtype=float)
    clones = np.where(dense_emb, np.maximum(2.0 * emb_local * 4.0 - optimizer_temporaries(b, rv), 0.0), 0.0)
    return at_opt + _rope_buffers(spec, b) + _plain_embedding_grad_extra(spec, b, rv) + clones


def _rope_dim(spec: ModelSpec) -> float:
    """The dimension RoPE rotates per head (MLA: its rotary part)."""
    return float(spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim)


def _rope_buffers(spec: ModelSpec, b: PlanBatch) -> np.ndarray:
    """Bytes of the RoPE cos / sin buffers on a rank (fp32, one table per stage it runs)."""
    return b.seq_len.astype(float) * _rope_dim(spec) * 4.0 * np.where(b.pp > 1, b.pp_stages_per_rank, 1)


def _plain_embedding_grad_extra(spec: ModelSpec, b: PlanBatch, rv: C.RankView) -> np.ndarray:
    """Without FSDP a vocab-sharded (TP, not TE) embedding's gradient is a view of the dense whole-vocabulary
    gradient its backward made, and that storage stays: its fp32 bytes beyond the rank's rows (with FSDP, FSDP2
    copies the rows out)."""
    on = ~b.fsdp_applied & rv.has_emb & (b.tp > 1) & ~b.te_layers
    return np.where(on, (spec.vocab_size * float(spec.d_model) - np.asarray(rv.emb_local)) * 4.0, 0.0)


def _embedding_grad_bound(spec: ModelSpec, b: PlanBatch, rv: C.RankView, m, gathered, others) -> np.ndarray:
    """``_rank_moment_bounds``' moments at the embedding's backward of a vocab-sharded (TP, not TE) embedding, from
    below [derived: ``memory._embedding_backward``]. torch's embedding backward makes a dense gradient of the whole
    vocabulary (V x d; param dtype under FSDP, fp32 without):

    * FSDP without PP (REDUCE): the rank's rows are cloned out of it (``V / tp x d``) before it goes, the
      embedding's gathered parameters beside both;
    * FSDP under PP (no sync): FSDP2 keeps the dense gradient itself as the accumulation. In the pass's first
      backward an upcast copies it into a reduce-dtype accumulator as large (where the reduce dtype is not the
      param dtype), the W - 1 other microbatches in flight beside it (``others``); a later microbatch's dense
      gradient (m >= 2) is made beside the accumulator the earlier ones filled. With one stage per rank every
      block of the stage has run its backward of that microbatch before the embedding's: their accumulators
      (reduce dtype, the stage's local parameters) are alive, and every unit of the stage is gathered (a pipeline's
      backward does not reshard; ``gathered``: the embedding's alone with several stages per rank, whose other
      stages' reduces may have run);
    * without FSDP the parameter's ``.grad`` is a view of the first backward's dense gradient, which stays: a later
      backward's (m >= 2 under PP, or an earlier pass of gradient accumulation) makes a new one beside it, and the
      blocks' fp32 gradients of the step's first backward are kept (one stage per rank: every block's by then;
      with more, by the last microbatch every stage has run a backward)."""
    on = rv.has_emb & (b.tp > 1) & ~b.te_layers
    fsdp, pp, v1 = b.fsdp_applied, b.pp > 1, b.pp_stages_per_rank == 1
    pb, rb = b.param_bytes.astype(float), b.reduce_bytes.astype(float)
    dense = float(spec.vocab_size) * spec.d_model
    blocks = sum(rv.n_of[k] * (rv.plocal[k][0] + rv.plocal[k][1]) for k in rv.kinds)
    stage = gathered + np.where(v1, blocks * rb, 0.0)
    first = dense * pb + np.where(rb != pb, dense * rb, 0.0) + others
    piped = stage + np.maximum(first, np.where(m >= 2, dense * (pb + rb), 0.0))
    sharded = np.where(pp, piped, b.fsdp * rv.emb_shard * pb + dense * pb + np.asarray(rv.emb_local) * pb)
    acc = (b.grad_accum > 1) & ~b.sync_once
    earlier = np.where(acc, (dense - np.asarray(rv.emb_local, dtype=float)) * 4.0,
                       np.where(pp & (m >= 2), dense * 4.0, 0.0))
    plain = dense * 4.0 + earlier + np.where(~acc & (v1 | (m >= 2)), blocks * 4.0, 0.0)
    return np.where(on, np.where(fsdp, sharded, plain), 0.0)


def _first_backward_bound(spec: ModelSpec, b: PlanBatch, sh: Shapes, rank: int, rv: C.RankView, c: RankCompute,
                          in_flight, later) -> np.ndarray:
    """``_rank_moment_bounds``' moments at the recompute of the first block a backward reaches (one stage per rank:
    the stage's last block), from below [derived: ``memory._block_backward``, its first moment]: the block's FSDP
    unit is gathered (a backward needs its parameters, whatever the reshard choice) and the block has rerun its
    forward: its tensors beyond what its AC mode kept are alive again (its activations without AC less those kept;
    0 under ``layer:N``, where the block may be one it does not checkpoint, and under core-attn, which recomputes
    inside the attention's backward) with the MLP input the recompute holds (``layers.ffn_input_held_bytes``).
    Beside them, in the rank's first backward every microbatch in flight keeps its blocks' activations
    (``in_flight``: W of them); in a later microbatch's backward under PP (m >= 2) that microbatch's and what the
    first backward left: the stage's gradient accumulators, or without FSDP its fp32 gradients (``later``)."""
    held = np.asarray(ffn_input_held_bytes(spec, sh), dtype=float)
    ep1 = b.ep == 1
    moment = {}
    for moe, cost in c.costs.items():
        kept = _block_activations(b, cost, False)
        trans = np.where(b.ac == AC_MODES["core-attn"], 0.0, np.asarray(cost.act["none"], dtype=float) - kept)
        ne_s, ex_s = rv.pshard[moe]
        unit = np.where(b.fsdp_applied, b.fsdp * (ne_s + np.where(ep1, ex_s, 0.0)) * b.param_bytes, 0.0)
        moment[moe] = trans + np.where(trans > 0, held, 0.0) + unit
    last = np.zeros(len(b))
    for p in np.unique(b.pp).tolist():
        layer = stage_bounds(spec.n_layers, p)[1] - 1 if rank == FIRST and p > 1 else spec.n_layers - 1
        sel = b.pp == p
        last[sel] = np.broadcast_to(moment[spec.is_moe_layer(layer)], (len(b),))[sel]
    later_on = (b.pp > 1) & (b.n_micro >= 2)
    return np.where(b.pp_stages_per_rank == 1, last + np.maximum(in_flight, np.where(later_on, later, 0.0)), 0.0)


def _unit_reduce_bound(b: PlanBatch, rv: C.RankView) -> np.ndarray:
    """``_rank_moment_bounds``' moment at a block's or its routed experts' gradient reduction under FSDP, from
    below [derived: ``memory._post_backward``, which every FSDP unit of the step's last pass runs in REDUCE mode
    (no PP) or FINAL (PP, the stage's reduce after its last backward)]: at the moment its reduce-scatter input is
    made (padded shard x shard group, reduce dtype) the unit's own unsharded gradients are still alive (param
    dtype; under PP its reduce-dtype accumulators, which the reduce took over), whatever the AC mode and the
    reshard choice. The largest such unit of the rank's block kinds (the routed experts are a unit of their own
    with ep > 1, part of their block's with ep 1); the embedding's and the output's are left out."""
    rb = b.reduce_bytes.astype(float)
    g = np.where(b.pp > 1, rb, grad_elem_bytes(b))
    ep1 = b.ep == 1
    out = np.zeros(len(b))
    for k in rv.kinds:
        (ne_l, ex_l), (ne_s, ex_s) = rv.plocal[k], rv.pshard[k]
        blk = (ne_l + np.where(ep1, ex_l, 0.0)) * g + b.fsdp * (ne_s + np.where(ep1, ex_s, 0.0)) * rb
        experts = np.where(ep1, 0.0, ex_l * g + b.efsdp * ex_s * rb)
        out = np.maximum(out, np.where(np.asarray(rv.n_of[k]) > 0, np.maximum(blk, experts), 0.0))
    return np.where(b.fsdp_applied, out, 0.0)


def _steady_bound(b: PlanBatch, rv: C.RankView, m, w, per_mb, loss, acc, gathered, kept_gathered) -> np.ndarray:
    """``_rank_moment_bounds``' moment after the first backward of one stage per rank under FSDP: a 1F1B forward
    with W in flight beside the accumulators (``acc``) and the units kept gathered; GPipe's second backward."""
    fsdp_pp, v1 = b.fsdp_applied & (b.pp > 1), b.pp_stages_per_rank == 1
    gpipe = b.pp_schedule == SCHED_GPIPE
    steady = np.where(fsdp_pp & v1 & (m >= 3) & (m > w) & ~gpipe, w * per_mb + loss + acc + kept_gathered, 0.0)
    # GPipe: the second backward starts with m - 1 in flight (at least m - 2 whole ones at its first moment on a
    # stage without the loss, whose peak opens the last stage's), every unit kept gathered by the first
    return np.maximum(steady, np.where(fsdp_pp & v1 & (m >= 2) & gpipe, (m - 1.0 - ~rv.has_out) * per_mb
                                       + loss + acc + gathered, 0.0))


def _reduce_bound(b: PlanBatch, rv: C.RankView, m, acc, gathered, pb) -> np.ndarray:
    """``rank_memory_bound``'s reduce after a pipeline's last backward under FSDP (``acc``: the rank's
    accumulators)."""
    fsdp_pp, v1, v = b.fsdp_applied & (b.pp > 1), b.pp_stages_per_rank == 1, b.pp_stages_per_rank.astype(float)
    # the reduce of a stage of the rank holds at least that stage's accumulators: with v stages, at least 1 / v of
    # the rank's (the largest stage holds at least the mean); every stage's where each ran a backward by the first
    # reduce (one stage per rank, or an interleaved schedule of two rounds or more)
    per_round = m // np.maximum(1, m // b.pp)
    reduce = np.where(fsdp_pp, acc / np.where(v1 | (m >= 2 * per_round), 1.0, v), 0.0)
    # (one stage per rank: every unit is still gathered at the first unit's reduce, but that unit, resharded
    # first: at most the embedding's or the largest block's parameters)
    first_unit = np.maximum.reduce([np.where(rv.has_emb, b.fsdp * rv.emb_shard, 0.0)]
                                   + [(b.fsdp * rv.pshard[k][0] + b.efsdp * rv.pshard[k][1]) * (rv.n_of[k] > 0)
                                      for k in rv.kinds]) * pb
    return reduce + np.where(fsdp_pp & v1, np.maximum(gathered - first_unit, 0.0), 0.0)


class _StageUnits:
    """Per block kind and for the embedding and the [norm, output] unit of a rank: the gradient accumulators'
    bytes (local parameters x ``acc_b``, the reduce dtype's bytes where a pipeline's stages accumulate under FSDP,
    else 0) and the gathered parameters' bytes (x ``gather_b``, the param dtype's bytes where a pipeline's stages
    are FSDP units, else 0), and the plans whose units stay gathered after a forward (``kept``: no
    reshard-after-forward), for ``_interleaved_bounds``."""

    def __init__(self, rv: C.RankView, b: PlanBatch, acc_b, gather_b, kept):
        self.acc = {k: (rv.plocal[k][0] + rv.plocal[k][1]) * acc_b for k in rv.kinds}
        self.gathered = {k: (b.fsdp * rv.pshard[k][0] + b.efsdp * rv.pshard[k][1]) * gather_b for k in rv.kinds}
        self.emb = (rv.emb_local * acc_b, b.fsdp * rv.emb_shard * gather_b)
        self.out = (rv.out_local * acc_b, b.fsdp * (rv.norm_shard + rv.outw_shard) * gather_b)
        self.kept = kept

    def stage(self, runs: list, first: bool, last: bool, sel: np.ndarray) -> tuple:
        """(accumulators, parameters gathered after a forward, parameters gathered) of one stage of the plans
        ``sel``: its blocks and ends."""
        acc = sum((count * np.asarray(self.acc[moe])[sel] for moe, _, count in runs), np.zeros(len(sel)))
        gat = sum((count * np.asarray(self.gathered[moe])[sel] for moe, _, count in runs), np.zeros(len(sel)))
        for on, (a, g) in ((first, self.emb), (last, self.out)):
            if on:
                acc, gat = acc + np.asarray(a)[sel], gat + np.asarray(g)[sel]
        return acc, np.where(np.asarray(self.kept)[sel], gat, 0.0), gat


def _interleaved_bounds(spec: ModelSpec, b: PlanBatch, rank: int, costs: dict, rows: np.ndarray, per_mb_edge,
                        loss, units: _StageUnits, flow) -> np.ndarray:
    """Moments of an interleaved schedule's step (``memory.simulate_actions``) from below, for the plans ``rows`` (0
    elsewhere), above what every moment holds [derived from ``pipeline.interleaved_actions``]. torch's
    ``ScheduleInterleaved1F1B`` runs ``n = min((v - 1) r + 2 (pp - 1 - rank), v m)`` forwards before its first
    backward, in rounds of ``r = m // max(1, m // pp)`` microbatches per stage, each keeping its stage's blocks'
    activations and, on the pipeline's first stage, its output (``per_mb_edge``: what the first and the last stage
    keep beyond their blocks); then each step a forward and a backward, backwards taking the stages in reverse
    rounds. So the first steady forward ends with n + 1 in flight before any backward (with the ``loss`` peak where
    it is the last stage's), and the last steady forward with n + 1 in flight (at least n + 1 of the least
    stage's) beside the gradient accumulators of every stage that has run a backward and its own stage's gathered
    parameters where reshard-after-forward keeps them (``units``); later forwards and the ends of backwards are
    bounded by ``_steady_moments``."""
    out = np.zeros(len(b))
    if not rows.any():
        return out
    every = np.where(b.ac == AC_MODES["layer"], np.maximum(b.ac_every, 1), 0)
    before = np.array([o.index("ac") < o.index("pp") for o in b.wrapper_orders] or [False])[b.wrapper_idx]
    keys = np.stack([b.pp, b.pp_stages_per_rank, b.n_micro, every, before & (every > 0)], axis=1)
    idx = np.flatnonzero(rows)
    uniq, inv = unique_rows(keys[idx])
    act = {(moe, ckpt): _block_activations(b, costs[moe], ckpt) for moe in costs for ckpt in (False, True)}
    first, last = per_mb_edge
    for g, (pp, v, m, k, bp) in enumerate(uniq.tolist()):
        sel = idx[inv == g]
        per_round = m // max(1, m // pp)
        r = 0 if rank == FIRST else pp - 1
        n_fwd = min((v - 1) * per_round + 2 * (pp - 1 - r), v * m)
        stage_act, stage_units = [], []
        for j, runs in enumerate(_stage_runs(spec, pp, v, rank, k, bool(bp))):
            stage = j * pp + r
            a = sum((count * act[moe, ckpt][sel] for moe, ckpt, count in runs), np.zeros(len(sel)))
            stage_act.append(a + (first[sel] if stage == 0 else 0.0) + (last[sel] if stage == pp * v - 1 else 0.0))
            stage_units.append(units.stage(runs, stage == 0, stage == pp * v - 1, sel))
        # what a backward of each chunk sends and the schedule holds to the step's end (``memory._sent_held``): the
        # stage output and the input gradient of every stage but the pipeline's first and last
        sent = [float(j * pp + r != 0) + float(j * pp + r != pp * v - 1) for j in range(v)]
        fwd_stages = [(i // per_round) % v for i in range(n_fwd)]
        best = sum((fwd_stages.count(j) * a for j, a in enumerate(stage_act)), np.zeros(len(sel)))
        steady = v * m - n_fwd
        if steady > 0:
            j = (n_fwd // per_round) % v
            best = best + stage_act[j] + (loss[sel] if j * pp + r == pp * v - 1 else 0.0)
            back_chunks = [v - 1 - (i // per_round) % v for i in range(steady - 1)]  # the backwards by then
            j_last = ((n_fwd + steady - 1) // per_round) % v
            sends = sum(sent[j] for j in back_chunks)
            late = ((n_fwd + 1) * np.minimum.reduce(stage_act) + stage_units[j_last][1] + sends * flow[sel]
                    + sum((stage_units[s][0] for s in set(back_chunks)), np.zeros(len(sel))))
            best = np.maximum(best, late)
        ends = (j * pp + r == pp * v - 1 for j in range(v))
        best = np.maximum(best, _steady_moments(v, m, n_fwd, per_round, stage_act, stage_units, sent, flow[sel],
                                                [loss[sel] if e else 0.0 for e in ends]))
        out[sel] = best
    return out


def _steady_moments(v: int, m: int, n_fwd: int, per_round: int, stage_act: list, stage_units: list, sent: list,
                    flow, loss: list) -> np.ndarray:
    """The ends of some forwards and backwards of an interleaved schedule after its warm-up
    (``memory.simulate_actions``) from below [derived from ``pipeline.interleaved_actions``]. Backward ``i``
    (0-based) runs chunk ``v - 1 - (i // per_round) % v`` after ``min(n_fwd + i + 1, v m)`` forwards, forward
    ``j`` chunk ``(j // per_round) % v``; every chunk that has run a backward holds its gradient accumulators
    (``stage_units[c][0]``) until its reduce after its ``m``-th backward; what every backward sent stays alive to
    the step's end (``memory._sent_held``: ``sent[c]`` stage-sized tensors of ``flow`` bytes). So

    * after the ``K``-th backward ``min(n_fwd + K, v m) - K`` microbatches are in flight (each at least the least
      stage's activations), beside the accumulators of the chunks that ran a backward (one past its ``m``-th
      counts as reduced, except the chunk just run: its reduce comes after this moment) and the chunk just run's
      every FSDP unit gathered (a backward runs without reshard: ``stage_units[c][2]``);
    * after the steady forward that follows the ``K``-th backward (``K < v m - n_fwd``) ``n_fwd + 1`` are in
      flight, beside the accumulators of the chunks not yet reduced, the forward's chunk's units where
      reshard-after-forward keeps them (``stage_units[c][1]``) and, on the pipeline's last stage, the loss's peak
      (``loss[c]``).

    The moments taken: each round's first and last of the first two passes over the chunks, the last steady step
    and the next, the last before the first reduce, and the last."""
    total, cycle = v * m, v * per_round
    steady = total - n_fwd
    first_reduce = (m // per_round - 1) * cycle + per_round
    ks = {j * per_round + d for j in range(2 * v + 1) for d in (0, 1)} | {steady, steady + 1, first_reduce, total}
    least = np.minimum.reduce(stage_act)
    out = np.zeros(len(least))
    for k in sorted(x for x in ks if 0 <= x <= total):
        q, rem = divmod(k, cycle)
        counts = [q * per_round + min(max(rem - (v - 1 - c) * per_round, 0), per_round) for c in range(v)]
        sends = sum(n * x for n, x in zip(counts, sent, strict=True)) * flow
        if k < steady:  # the forward after the k-th backward
            f = ((n_fwd + k) // per_round) % v
            acc = sum((stage_units[c][0] for c in range(v) if 1 <= counts[c] < m), np.zeros(len(least)))
            out = np.maximum(out, (n_fwd + 1) * least + acc + stage_units[f][1] + loss[f] + sends)
        if k >= 1:
            last = v - 1 - ((k - 1) // per_round) % v
            acc = sum((stage_units[c][0] for c in range(v) if counts[c] >= 1 and (counts[c] < m or c == last)),
                      np.zeros(len(least)))
            out = np.maximum(out, (min(n_fwd + k, total) - k) * least + acc + stage_units[last][2] + sends)
    return out


def _block_activations(b: PlanBatch, cost, ckpt: bool) -> np.ndarray:
    """Bytes one block keeps per microbatch under the plans' AC modes (``ckpt``: a block ``layer:N`` checkpoints)."""
    mode = np.where((b.ac == AC_MODES["full"]) | ((b.ac == AC_MODES["layer"]) & ckpt), 0,
                    np.where(b.ac == AC_MODES["selective-op"], 1, np.where(b.ac == AC_MODES["core-attn"], 3, 2)))
    return np.choose(mode, [np.broadcast_to(np.asarray(cost.act[m], dtype=float), (len(b),))
                            for m in ("full", "sac", "none", "attn")])
