"""Peak memory of one rank as a timeline of the allocations a training step makes, itemized.

The step is replayed at the granularity of FSDP2 units, blocks and microbatches, with the buffers torch keeps alive
and frees in the order its code does (torch 2.13's ``torch.distributed.fsdp._fully_shard`` and pipelining; every
rule below was checked against the executor's full-scale traces, ``bench/differential.py``):

* forward, per unit (embedding, each block, a MoE block's routed experts (EP), [final norm, output]): the
  all-gather writes a flat padded buffer of the unit (``fsdp_gather_buffers``, S x shard x param bytes); the
  copy-out then allocates the unit's unsharded parameters (``fsdp_unsharded_params``, padded per tensor) and, in
  forward, frees the *previous* unit's flat buffer (FSDP2 keeps it to overlap the copy-out with the next
  all-gather; the root's post-forward frees the last one). ``reshard_after_forward`` frees a unit's parameters
  after its forward (the [norm, output] unit keeps them unless "always").
* the loss on the last stage (``logits_and_loss``): its peak, and what each microbatch still in flight keeps for
  its backward (the log-softmax output, the final norm's input and output).
* backward, per unit in reverse order: pre-backward gathers a resharded unit (its flat buffer freed right after
  the copy-out in backward) and prefetches the next unit's flat buffer; the unit's backward frees its activations
  (after recomputing them under AC: ``recompute_transient``) and produces its unsharded gradients in param dtype;
  post-backward reshards the unit, releases the previous unit's reduce-scatter input, allocates this unit's
  (padded, reduce dtype) while its gradients are still alive, then its reduce-scatter output (the shard, reduce
  dtype), frees the unsharded gradients and keeps the shard as the gradient (fp32; with gradient accumulation
  added into the existing one). The embedding's post-backward runs in the root's final callback, its dense
  gradient still alive. These buffers are ``fsdp_grad_buffers``.
* pipeline parallel (the trace replays torch's schedule): the first ``W`` microbatches' forwards (the schedule's
  in-flight bound), each keeping its activations and its stage output (the loss's saved tensors on the last
  stage); the first backward of a pass reshards every unit and gathers each again, and keeps it unsharded; a
  microbatch's backward other than the last converts its unsharded gradients into reduce-dtype accumulators
  (FSDP2's ``unsharded_accumulated_grad``, "gradients") or adds into them; the last one reduces them as above
  (the accumulators alive beside the reduce-scatter input).
* without FSDP (no data parallelism) torch.autocast runs the matmuls in param dtype and caches each linear weight's
  cast copy from its first use to the end of the autocast region (after the last backward:
  ``autocast_weight_cache``); gradients are the fp32 parameters' own.
* the optimizer step: every sharded gradient and one fp32 temporary per parameter (foreach AdamW).

Blocks of one kind in a row change the running total by the same amount each, so within such a run the extremes
of every moment are at its first, second or last block: only those are replayed, the change of one block added
for the rest (``_run``). Microbatches likewise: the first backward of a pass, one later one, the last one. A
moment is recorded under the phase the trace attributes it to (``executor.trace``): forward, loss and the output
projection's backward "end of forward"; the [norm, output] unit's post-backward and the blocks "backward of the last
layer" (the pass's first microbatch) or "backward of a later microbatch"; the embedding's backward "end of
backward"; clipping and the optimizer "optimizer step". Each phase keeps its largest moment, itemized
(MEMORY_KEYS), which sums to the phase's total.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from ..vocab import MemoryPhase
from .work import tally

MEMORY_KEYS = ("parameters", "gradients", "optimizer_states", "buffers", "pipeline_buffers", "inputs", "cp_buffers",
               "fsdp_unsharded_params", "fsdp_gather_buffers", "fsdp_grad_buffers", "autocast_weight_cache",
               "autocast_weight_grads", "activations", "recompute_transient", "logits_and_loss",
               "optimizer_temporaries")
PHASES = tuple(MemoryPhase)
FWD, BWD1, BWD2, BWD_END, OPT = PHASES
_DEBUG = bool(__import__("os").environ.get("PARSIM_MEM_DEBUG"))
# how a microbatch's backward treats its unsharded gradients
REDUCE, ACC_FIRST, ACC_LATER = "reduce", "acc_first", "acc_later"
# (PP) the stage's reduce after its last backward: the accumulators reduced, nothing new added
FINAL = "final"


_KEY = {k: i for i, k in enumerate(MEMORY_KEYS)}
_PHASE: dict[str, int] = {p: i for i, p in enumerate(PHASES)}


class _Totals:
    """The running totals by key (``Timeline.cur``): reads are copies, writes replace a key's row."""

    def __init__(self, arr: np.ndarray):
        self._arr = arr

    def __getitem__(self, key: str) -> np.ndarray:
        return self._arr[_KEY[key]].copy()

    def __setitem__(self, key: str, value) -> None:
        self._arr[_KEY[key]] = value

    def items(self):
        return ((k, self._arr[i].copy()) for k, i in _KEY.items())


class Timeline:
    """Running itemized totals of a batch of plans and, per phase, the largest moment seen (itemized). Moments
    are recorded only for the plans ``mask`` selects (``only``). Stored stacked: totals (keys x plans), per phase
    the largest total (plans) and its items (keys x plans)."""

    def __init__(self, n: int):
        self.n = n
        self.arr = np.zeros((len(MEMORY_KEYS), n))
        self.cur = _Totals(self.arr)
        self.best = np.full((len(PHASES), n), -np.inf)
        self.items = np.zeros((len(PHASES), len(MEMORY_KEYS), n))
        self.mask = np.ones(n, bool)

    def add(self, key: str, x, mask=None) -> None:
        if mask is not None:
            if not (mask.any() if isinstance(mask, np.ndarray) else mask):
                return
            x = np.where(mask, x, 0.0)
        elif isinstance(x, (int, float)) and x == 0:
            return
        self.arr[_KEY[key]] += x  # (x: a scalar or one value per plan)

    def mark(self, phase: str, mask=None) -> None:
        total = self.arr.sum(axis=0)
        if _DEBUG:  # PARSIM_MEM_DEBUG=1: every moment of plan 0, MiB
            import inspect

            where = inspect.stack()[1].function
            print(f"MEM {phase[:22]:22s} {where:22s} total {total[0] / 2**20:10.3f} " + " ".join(
                f"{k[:12]}={v[0] / 2**20:.3f}" for k, v in self.cur.items() if v[0]))
        better = (total > self.best[_PHASE[phase]]) & self.mask
        self._keep(_PHASE[phase], better if mask is None else better & mask, total, None)

    def apply_series(self, phase: str, series: dict) -> None:
        """S moments in a row (rounds of: add, a moment, add) from their summary (``series_summary``): the
        rounds' largest moment above the running totals (``top``), the changes of every key at that moment (``at``,
        keys x plans) and after the last (``end``, keys x plans, or None: no change)."""
        top = self.arr.sum(axis=0) + series["top"]
        if _DEBUG:  # PARSIM_MEM_DEBUG=1: the series' largest moment of plan 0, MiB
            at0 = self.arr[:, 0] + series["at"][:, 0]
            print(f"MEM {phase[:22]:22s} {'series':22s} total {top[0] / 2**20:10.3f} " + " ".join(
                f"{k[:12]}={at0[i] / 2**20:.3f}" for k, i in _KEY.items() if at0[i]))
        self._keep(_PHASE[phase], (top > self.best[_PHASE[phase]]) & self.mask, top, series["at"])
        if series["end"] is not None:
            self.arr += series["end"]

    def _keep(self, p: int, better: np.ndarray, total: np.ndarray, at) -> None:
        """Phase ``p``'s largest moment becomes ``total`` where ``better``, itemized as the running totals plus
        ``at`` (keys x plans; None: the totals themselves). Where few plans gain, only their columns are written."""
        cols = np.flatnonzero(better)
        if not len(cols):
            return
        if 4 * len(cols) < self.n:
            self.best[p, cols] = total[cols]
            self.items[p][:, cols] = self.arr[:, cols] if at is None else self.arr[:, cols] + at[:, cols]
        else:
            self.best[p] = np.where(better, total, self.best[p])
            self.items[p] = np.where(better, self.arr if at is None else self.arr + at, self.items[p])

    def take(self, idx: np.ndarray) -> Timeline:
        """A timeline of the plans ``idx`` alone, from where this one is (its moments and mask too)."""
        out = Timeline(len(idx))
        out.arr[...], out.best[...], out.items[...] = self.arr[:, idx], self.best[:, idx], self.items[:, :, idx]
        out.mask[...] = self.mask[idx]
        return out

    def put(self, idx: np.ndarray, part: Timeline) -> None:
        """The plans ``idx`` become where ``part`` (a ``take`` of them) is."""
        self.arr[:, idx], self.best[:, idx], self.items[:, :, idx] = part.arr, part.best, part.items

    def snapshot(self) -> np.ndarray:
        return self.arr.copy()

    def advance(self, before: np.ndarray, times: float) -> None:
        """Repeat ``times`` more the change since ``before`` (blocks of a run between its second and last)."""
        if times > 0:
            self.arr += times * (self.arr - before)

    @contextlib.contextmanager
    def only(self, mask):
        """Replay something that happens only for the plans ``mask`` selects: moments recorded for them only and
        the running totals of the others left as they were."""
        mask = np.broadcast_to(np.asarray(mask, bool), (self.n,))
        before, saved = self.snapshot(), self.mask
        self.mask = saved & mask
        try:
            yield
        finally:
            self.mask = saved
            self.arr[...] = np.where(mask, self.arr, before)

    def phases(self) -> dict:
        """phase -> itemized largest moment (zeros for a phase never reached)."""
        return {p: {k: np.where(np.isfinite(self.best[j]), self.items[j, i], 0.0) for k, i in _KEY.items()}
                for j, p in enumerate(PHASES)}


@dataclass
class Unit:
    """One FSDP unit's sizes on a rank, bytes (arrays over the plans): parameters gathered (padded, param dtype),
    its unsharded gradients (param dtype; fp32 without FSDP), its reduce-scatter input (padded, reduce dtype) and
    output (shard, reduce dtype), its sharded fp32 gradient, its unsharded gradient accumulator (reduce dtype, PP).
    ``gathered`` doubles as the flat all-gather buffer."""

    gathered: np.ndarray | float
    grads: np.ndarray | float
    rs_in: np.ndarray | float
    rs_out: np.ndarray | float
    shard4: np.ndarray | float
    acc: np.ndarray | float = 0.0
    # the unit's last parameter's unsharded gradient (param dtype) / accumulator (reduce dtype): alive until the
    # reduce is done (``layers.last_param_elems``)
    last_grad: np.ndarray | float = 0.0
    last_acc: np.ndarray | float = 0.0
    # the unit's last parameter's unsharded gradient (param dtype), over any shard group
    tail_grad: np.ndarray | float = 0.0
    # parameters FSDP shards on a dim other than 0 (routed experts, ``layers.experts_off_dim0``): the copy-out's
    # temporaries (param dtype, over a shard group of 2+), and whether the last parameter is one (its gradient's
    # dim-0 copy then sits beside the original at the reduce)
    copy_temp: np.ndarray | float = 0.0
    last_off_dim0: np.ndarray | bool = False
    grouped: np.ndarray | bool = False  # a shard group of 2+ ranks: its gathers all-gather into a flat buffer

    @functools.cached_property
    def single_group(self) -> np.ndarray:
        """Where the unit's reduce has a shard group of one rank: output as large as its (non-empty) input."""
        rs_in = np.asarray(self.rs_in, dtype=float)
        return (rs_in > 0) & np.isclose(self.rs_out, rs_in)


@dataclass
class Block:
    """One block: its FSDP unit, the routed experts' own unit (EP) or None, per microbatch the bytes it keeps for
    the backward (its FFN / MoE part freed first in backward), and the recompute transient of its backward."""

    unit: Unit
    experts: Unit | None
    act: np.ndarray
    transient: np.ndarray
    act_ffn: np.ndarray | float = 0.0
    # the block's backward at op level (layers.backward_steps): steps, the bytes of every tensor it saves (no AC),
    # bytes of one weight-gradient element (param dtype under FSDP, fp32 without)
    steps: list = field(default_factory=list)
    saved: dict = field(default_factory=dict)
    grad_elem_bytes: np.ndarray | float = 0.0
    # the attention part of the recompute transient (what the recompute has made when it reaches the experts)
    transient_attn: np.ndarray | float = 0.0
    # the block's largest moment in forward, above the stream before it: a checkpointed MoE block's working set
    # (``layers.moe_forward_working_bytes``), a dense block without AC its saved tensors and its last op's output
    # reduction under TP (``phases._tp_output_transient``); 0 elsewhere
    fwd_working: np.ndarray | float = 0.0
    # a recomputed MoE block (AC): without shared experts its backward starts with the combine's sum, whose backward
    # saves nothing and makes the routed pairs' gradient (nk x d); the next op (the scatter's) unpacks a saved
    # tensor, which runs the recompute with that gradient alive (with shared experts, their backward runs it first,
    # before that gradient), and the recompute's combine holds its weighted copy and scatter target (2 nk x d;
    # with EP its combine all-to-all is larger: routed and received tokens, experts' output and its regrouped copy,
    # 4 nk x d) before the shared experts (computed after the routed ones) are recomputed: bytes above the whole
    # recompute set at that moment (``phases._recompute_combine``; 0 without recompute)
    # [derived: torch.utils.checkpoint's non-reentrant recompute on the first unpack; trace: tp2 x dp_shard2, full
    # AC, top-4 of 8 experts, 1024 tokens of d 512: at the recompute's scatter target the pairs' gradient, the
    # routed tokens, the experts' output, the weighted copy and the target, (4096, 512) each, alive (-8.1% before)]
    recompute_combine: np.ndarray | float = 0.0
    # a recomputed dense block: bytes alive at its recompute's end beside the recomputed tensors — the output
    # gradient its first backward op made (that op reads no saved tensor, so it runs before the first unpack
    # starts the recompute: SP's gathered gradient, autocast's bf16 copy, ``layers.backward_steps``) and the
    # MLP's held input (``layers.ffn_input_held_bytes``); 0 without recompute and for MoE blocks
    recompute_held: np.ndarray | float = 0.0
    # a recomputed MoE block (full AC): bytes above its saved tensors at the recompute's last expert GEMM
    # (``layers.recompute_experts_extra_bytes``)
    recompute_experts: np.ndarray | float = 0.0
    # the routed experts' weights are TP DTensors (tp > 1 without EP): the experts' forward unwraps each
    # (``to_local``) before its first GEMM, so each weight's gradient reaches AccumulateGrad through that node,
    # whose sequence number is below every GEMM's: the autograd engine (highest sequence number first) runs the
    # three only when the experts' backward is done, and a later backward that adds into existing gradients
    # (``_added_in_place``: without FSDP, or FSDP without sync before a pipeline's last microbatch) holds all three
    # new gradients until then [derived: executor.model.GroupedExperts.forward, torch.autograd's ready queue;
    # traces: mixtral 1 layer, tp8, bf16, two accumulation steps: three (8, 4096, 1792) fp32 gradients alive at the
    # second backward's peak, -1.2% before; the same with ep 8 holds none (the model exact without the hold);
    # mixtral 4 layers pp2 x dp_shard3 x tp8, bf16 reduce, GPipe: three (8, 4096, 1792) bf16 new gradients beside
    # the accumulated unsharded ones, -2.5% before]
    experts_held: np.ndarray | bool = False
    _plan: list | None = None  # ``_step_plan``'s cache
    series_cache: dict = field(default_factory=dict)  # id(mode) -> (mode, {run index: summary}): ``_steps_series``
    variants: dict = field(default_factory=dict)  # ``summing_out_of_place``'s cache

    def step_plan(self, n: int) -> list:
        """The steps as runs of stacked arrays between the routed experts' events (``_steps_series``), built once."""
        if self._plan is None:
            self._plan = _step_plan(self, n)
        return self._plan

    def summing_out_of_place(self, on: np.ndarray) -> "Block":
        """This block where (``on``, per plan) its first sum into the residual gradient (the FFN norm's input
        gradient added to the gradient that reached the block) makes a new tensor: autograd adds in place only into
        a buffer nothing else holds, and a pipeline stage's received gradient is held by the schedule until the
        microbatch's backward returns, so the stage's first block sums beside it [derived: autograd's input-buffer
        accumulation; trace: pp2 first stage, tp2 SP, the (128, 1536) sum beside the received gradient through the
        block's attention backward, -0.64% before]. Built once per mask."""
        on = np.asarray(on, dtype=bool)
        if not on.any():
            return self
        key = on.tobytes()
        if key not in self.variants:
            steps = [dict(st, alloc=st["alloc"] + np.where(on, st["residual_sum"], 0.0)) if "residual_sum" in st
                     else st for st in self.steps]
            self.variants[key] = dataclasses.replace(self, steps=steps, _plan=None, series_cache={}, variants={})
        return self.variants[key]


@dataclass
class RankMemory:
    """Everything the timeline of one rank needs (arrays over the plans of one run structure)."""

    n: int
    parameters: np.ndarray
    optimizer_states: np.ndarray
    buffers: np.ndarray
    all_grads4: np.ndarray  # every sharded gradient, fp32 (without FSDP: the plain gradients)
    # context parallel: what torch's context_parallel() keeps while it is entered (forward and backward):
    # ``phases._cp_buffers``
    cp_buffers: np.ndarray
    # the step's token ids and labels (int64, the local batch each) from the forward to the end of the backward
    # without PP (``phases._step_inputs``)
    inputs: np.ndarray
    fsdp: np.ndarray  # bool: FSDP wraps the model
    raf: np.ndarray  # bool: blocks and embedding resharded after forward
    raf_out: np.ndarray  # bool: [norm, output] resharded after forward
    acc: np.ndarray  # bool: gradients of earlier passes exist (gradient accumulation)
    has_emb: np.ndarray
    has_out: np.ndarray
    emb: Unit
    emb_dense_grad: np.ndarray  # the embedding backward's dense gradient
    emb_sharded: np.ndarray  # bool: the embedding weight is vocab-sharded (TP): its gradient is a clone of its rows
    out: Unit
    loss: np.ndarray  # the loss's peak on the last stage (logits, the loss's transients and what it keeps)
    blocks: list  # (Block, count) runs in forward order
    opt_temporaries: np.ndarray
    flat_held: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))  # S > 1 (flat kept across units)
    hsdp: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))  # HSDP (all-reduce over dp_replicate)
    reduce_bytes: np.ndarray = field(default_factory=lambda: np.full(1, 4.0))
    flow: np.ndarray = field(default_factory=lambda: np.zeros(1))  # the residual stream's gradient in backward
    # SP: the embedding's backward reads its output gradient all-gathered over tp (the (T, d) tensor), the local
    # shard freed once gathered: the gathered size less the shard's
    emb_grad_gathered: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # the output projection's input gradient (T x d, gathered under SP), made after its weight gradient
    out_input_grad: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # under TP, the projection's input gradient reduced (``phases._out_grad_reduction``)
    out_grad_reduce: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # the last stage: what the final norm keeps (its input, and its output the projection reads: gathered under
    # SP), alive until the projection's and the norm's backward (0 on other stages)
    final_norm_saved: np.ndarray = field(default_factory=lambda: np.zeros(1))
    logits_grad: np.ndarray = field(default_factory=lambda: np.zeros(1))  # the logits' gradient (last stage)
    # pipeline parallel: a stage of a pipeline, microbatches per pass, the schedule's in-flight bound and the
    # microbatches in flight at a later backward, what an in-flight microbatch keeps beside its blocks' activations
    # (its stage output, or on the last stage the loss's saved tensors)
    pp: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))
    m: np.ndarray = field(default_factory=lambda: np.ones(1))
    w: np.ndarray = field(default_factory=lambda: np.ones(1))
    w_later: np.ndarray = field(default_factory=lambda: np.ones(1))
    mb_extra: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # the last stage of a pipeline: the logits torch's stage keeps (fwd_cache) until the microbatch's backward returns
    stage_logits: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # torch's pipeline stages: the rank's receive buffers, kept across steps (``pipeline_buffers``), and of one
    # microbatch the received input and the received output gradient that are such a buffer (``recv_in``: a stage
    # after the first; ``recv_grad``: a stage before the last; 0 elsewhere): counted there, not as activations
    recv_buffers: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # bool: torch's pipelining runs the schedule (not Megatron's, under TE layers: ``phases._torch_pp``)
    torch_pp: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))
    recv_in: np.ndarray = field(default_factory=lambda: np.zeros(1))
    recv_grad: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # single-stage schedules: the input gradients the schedule's sends still hold at a later microbatch's backward
    # and at the last one's (``sends_held``)
    sent_later: np.ndarray = field(default_factory=lambda: np.zeros(1))
    sent_last: np.ndarray = field(default_factory=lambda: np.zeros(1))
    autocast_cache: np.ndarray = field(default_factory=lambda: np.zeros(1))
    held_until_end: list = field(default_factory=list)  # HSDP all-reduce buffers alive until the end of backward
    # grad_sync once with gradient accumulation: the earlier passes left unsharded accumulators (reduce dtype) where
    # ``acc`` plans hold sharded fp32 gradients; each unit's reduce in the last pass takes its accumulator over
    once: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))
    # autocast without FSDP: the cast weights' gradients of a backward other than the step's first are deferred
    # (``_deferred_casts``): param bytes per element, the output projection's fp32 gradient bytes, the fp32
    # gradient bytes of the stage's last cast weight (the first one converted where there is no output projection)
    param_bytes: np.ndarray = field(default_factory=lambda: np.full(1, 2.0))
    out_weight4: np.ndarray = field(default_factory=lambda: np.zeros(1))
    last_cast4: np.ndarray = field(default_factory=lambda: np.zeros(1))

    def grads_kept_as_made(self) -> np.ndarray:
        """Where FSDP2 accumulates without sync in the gradients' own dtype (reduce dtype = param dtype: FSDP2
        clamps its reduce dtype to None) rather than in an upcast accumulator."""
        return self.reduce_bytes == self.param_bytes

    def in_reduce_dtype(self, grad_bytes) -> np.ndarray:
        """``grad_bytes`` of param-dtype gradients, as reduce-dtype bytes (the accumulator a copy makes)."""
        return np.asarray(grad_bytes, dtype=float) / self.param_bytes * self.reduce_bytes

    def deferred(self, mode) -> np.ndarray:
        """Where a backward's cast-weight gradients are deferred: autocast on and not the step's first backward."""
        return (self.autocast_cache > 0) & ~_first(self, mode)

    def act_mb(self) -> np.ndarray:
        """What one microbatch in flight keeps: its blocks' activations and ``mb_extra``, less its received input
        where that is a receive buffer (``recv_in``: the stage's first block saved it)."""
        return (sum((np.asarray(b.act, dtype=float) * c for b, c in self.blocks), np.zeros(self.n)) + self.mb_extra
                - self.recv_in)


def simulate(q: RankMemory) -> dict:
    """The phases of one step (the last pass of gradient accumulation: the earlier passes' gradients present),
    itemized."""
    tally(timeline_replays=1, timeline_plans=q.n)
    tl = _step_start(q)
    act = q.act_mb()
    multi = q.m >= 2
    # warm-up forwards: the first gathers every unit (a pipeline keeps them: reshard_after_forward is off by
    # default under PP), the W-th is replayed in full (with "always" it gathers again), those between add their
    # activations
    _forward(tl, q, act_before=np.zeros(q.n))
    if np.any(q.w >= 2):  # (here and below: a replay for no plan changes nothing and is skipped)
        with tl.only(q.w >= 2):
            tl.add("activations", act * np.maximum(q.w - 2, 0.0))
            _forward(tl, q, act_before=act * np.maximum(q.w - 1, 0.0), gathered=~q.raf)
    # the pass's first backward (the only one without PP: it reduces; under PP every backward accumulates)
    _backward(tl, q, np.where(q.pp, ACC_FIRST, REDUCE), BWD1, regather=q.raf)
    tl.add("activations", q.sent_later, multi)  # (its input's gradient, held by the schedule's sends)
    # a later microbatch (not the last). When forwards remain (m > W) one ran since, bringing the in-flight count
    # back to W (and, resharding after forward, gathering and resharding every unit again); else it is the drain
    steady = q.m > q.w
    if np.any(q.m >= 3):
        with tl.only(q.m >= 3):
            tl.add("activations", act * (q.w_later - 1.0 - np.maximum(q.w - 1.0, 0.0)))
            if np.any(steady & (q.m >= 3)):
                with tl.only(steady):
                    _forward(tl, q, act_before=act * (q.w_later - 1.0), gathered=~q.raf, after_backward=q.pp)
            tl.add("activations", act, ~steady)
            _backward(tl, q, ACC_LATER, BWD2, regather=q.raf & steady)
    # the last microbatch (one in flight); a forward precedes it when the schedule keeps one microbatch in flight
    if np.any(multi):
        with tl.only(multi):
            one = q.pp & (q.w <= 1)
            if np.any(one & multi & q.raf):  # (its units resharded after it: the backward gathers them again)
                with tl.only(one & q.raf):
                    tl.cur["activations"] = np.asarray(q.sent_later, dtype=float) * np.ones(q.n)
                    _forward(tl, q, act_before=np.zeros(q.n), gathered=~q.raf, after_backward=q.pp)
            tl.cur["activations"] = act + q.sent_last
            _backward(tl, q, ACC_LATER, BWD2, regather=q.raf & (q.w <= 1))
            tl.add("activations", -q.sent_last)
    if np.any(q.pp):
        with tl.only(q.pp):
            # (a stage after the first: the last microbatch's received input and its gradient are alive at the
            # reduce: ``_reduce_held``)
            kept = np.where(q.has_emb, 0.0, _reduce_held(q))
            tl.add("activations", kept)
            _reduce_after(tl, q)
            tl.add("activations", -kept)
    _optimizer_step(tl, q)
    return tl.phases()


def _reduce_held(q: RankMemory) -> np.ndarray:
    """What a stage after the first still holds at its reduce after the last backward (1F1B, GPipe): the last
    microbatch's received input (torch's receive buffer) and its gradient, which the schedule's send ops of that
    backward still reference (``bwd_sends`` / ``ops``, locals of ``_step_microbatches`` alive through
    ``perform_reduce_grad``) [derived: torch 2.13 pipelining/schedules.py; trace: tiny 2 layers, pp2 x dp_shard 2,
    GPipe with one microbatch, the last stage's (2, 64, 256) bf16 input and gradient beside the reduce-scatter
    input, -0.75% before]."""
    return 2.0 * np.asarray(q.flow, dtype=float) - q.recv_in


def sends_held(gpipe, m, flow) -> tuple:
    """(at a later microbatch's backward, at the last one's) the input gradients of earlier microbatches that a
    single-stage schedule's sends still hold on a stage after the first (``flow`` one; 0 on the first stage).

    Derivation [torch 2.13 pipelining/schedules.py]: a send op (``P2POp``) and its work hold the tensor sent; a
    work until it is waited for. ``Schedule1F1B`` waits for each send at once but keeps the backward's send ops in
    ``bwd_sends`` until the next backward's replace them: one earlier gradient at every later backward (and the
    forward between). ``ScheduleGPipe`` keeps its backward sends' works in ``bwd_sends_to_wait`` until every
    backward has run: at the last microbatch's backward the ``m - 1`` earlier gradients (at the second, one). What
    is held after the last backward is ``_reduce_held``'s. Measured: ``bench/real_vs_trace.py``, tiny pp2 1F1B, the
    last stage's real run +0.35% over the trace before the trace held it, +0.06% after."""
    one = np.asarray(flow, dtype=float)
    return one, np.where(gpipe, np.maximum(np.asarray(m, dtype=float) - 1.0, 1.0), 1.0) * one


def pipeline_recv_buffers(m, flow, chunks_in, chunks_grad) -> np.ndarray:
    """The receive buffers torch's pipeline stages keep on a rank: per microbatch of a pass one (T, d) tensor (the
    stage boundary's local shape and dtype, ``flow``) for the input of each of its stages after the first
    (``chunks_in`` of them) and one for the output gradient of each before the last (``chunks_grad``).

    Derivation [torch 2.13 pipelining/stage.py]: ``_prepare_forward_infra`` / ``_prepare_backward_infra`` run when
    the schedule first steps and make ``args_recv_info[mb]`` (``_create_act_recv_info``) and ``grad_recv_info[mb]``
    (``_create_grad_recv_info``), each buffer ``_make_tensor_from_meta`` of the boundary tensor, for every
    microbatch; every later step receives into the same buffers, and the stage computes with the buffer itself
    (``_retrieve_recv_activations`` returns it with ``requires_grad_``; ``_retrieve_recv_grads`` passes it to
    ``autograd.backward``). So all of them exist at every moment of a step after the first, whichever microbatches
    are in flight. Measured: ``bench/real_vs_trace.py``, tiny pp2 1F1B in fp32, the first stage's real run was
    2.1% over the trace (7 of its 8 gradient buffers at the peak, none in the trace) and 0.33% after the trace
    kept them too (as allocated memory a GPU counts all of them; the CPU tracker now seeds them as a baseline).
    Megatron-Core's schedules (TE-layer plans) receive into new tensors per microbatch: none."""
    return np.asarray(m, dtype=float) * np.asarray(flow, dtype=float) * (np.asarray(chunks_in, dtype=float)
                                                                        + np.asarray(chunks_grad, dtype=float))


def _step_start(q: RankMemory) -> Timeline:
    """A step's timeline at its start: parameters, optimizer states, buffers, CP's buffers, the earlier passes'
    gradients (gradient accumulation) and autocast's cast weights (no FSDP: the compute-dtype copies of the linear
    weights, cached from their first use until the autocast region ends after the last backward)."""
    tl = Timeline(q.n)
    tl.add("parameters", q.parameters)
    tl.add("optimizer_states", q.optimizer_states)
    tl.add("buffers", q.buffers)
    tl.add("pipeline_buffers", q.recv_buffers)
    tl.add("inputs", q.inputs)
    tl.add("cp_buffers", q.cp_buffers)
    tl.add("gradients", q.all_grads4, q.acc)
    tl.add("gradients", _accumulators(q), q.once)
    tl.add("autocast_weight_cache", q.autocast_cache)
    return tl


def _accumulators(q: RankMemory) -> np.ndarray:
    """Bytes of every FSDP unit's unsharded reduce-dtype accumulator on the rank (``grad_sync`` once: what the
    passes before the last leave, FSDP2's ``to_accumulated_grad_if_needed`` after each no-sync backward)."""
    total = np.where(q.has_emb, np.asarray(_emb_acc(q), dtype=float), 0.0)
    total = total + np.where(q.has_out, np.asarray(q.out.acc, dtype=float), 0.0)
    for blk, count in q.blocks:
        total = total + np.asarray(blk.unit.acc, dtype=float) * count
        if blk.experts is not None:
            total = total + np.asarray(blk.experts.acc, dtype=float) * count
    return total


def _optimizer_step(tl: Timeline, q: RankMemory) -> None:
    """Clipping and the optimizer: every gradient, the foreach temporaries."""
    # clipping and the optimizer: every gradient, the foreach temporaries
    for k in ("inputs", "cp_buffers", "fsdp_unsharded_params", "fsdp_gather_buffers", "fsdp_grad_buffers",
              "autocast_weight_cache", "activations", "recompute_transient", "logits_and_loss"):
        tl.cur[k] = np.zeros(q.n)
    tl.cur["gradients"] = np.asarray(q.all_grads4, dtype=float) * np.ones(q.n)
    # without FSDP a vocab-sharded (TP) embedding's gradient is the whole vocabulary's (Replicate) beside its
    # Shard(0) parameter: each AdamW foreach op that reads it redistributes it, cloning the rank's rows, and
    # ``addcmul_(exp_avg_sq, grad, grad)`` holds two such clones at once (fp32 rows; the foreach temporaries are
    # made by other ops, so the larger of the two is the moment) [trace: pp2 x tp4, two (V/4, d) fp32 clones at
    # the optimizer's peak, 26 MiB above the foreach temporaries]
    dense_emb = ~q.fsdp & q.emb_sharded & q.has_emb
    tl.add("optimizer_temporaries", np.maximum(q.opt_temporaries, np.where(dense_emb, 2.0 * np.asarray(
        q.emb.grads, dtype=float), 0.0)))
    tl.mark(OPT)


def simulate_actions(q: RankMemory, chunks: list, schedules: list, pp: int) -> dict:
    """The phases of one step of a rank that runs several pipeline stages (interleaved schedules), replaying
    torch's own action list (``pipeline.interleaved_actions``): ``chunks[c]`` is the rank's ``c``-th stage's
    share (stage ``c pp + rank``: its blocks, and the embedding or the [norm, output] unit where it has them;
    every size that is the rank's whole, static or the optimizer's, stays in ``q``). Each stage is an FSDP root
    of its own:

    * F: its forward (``_forward``); its units gather unless unsharded (by an UNSHARD or a backward), and with
      reshard-after-forward are resharded after it.
    * B: its backward without sync or reshard (``_backward``): the stage's first of the pass makes its gradient
      accumulators (ACC_FIRST), later ones add into them; the phase is the rank's first backward's or a later one's
      (``executor.trace`` attributes the rank's first backward of all stages to "backward of the last layer").
    * UNSHARD: every FSDP module of the stage unshards (an all-gather into a flat buffer, the copy-out, the buffer
      freed, unit by unit: ``FSDPModule.unshard`` outside forward); RESHARD frees whatever of the stage is unsharded.
    * REDUCE_GRAD: the stage's reduce after its last backward (``_reduce_after``).

    The moments are the phases a trace attributes them to: F "end of forward", UNSHARD / RESHARD the phase of the
    action before. Consecutive forwards (or backwards) of one stage change the running totals by the same amount
    each once the first has run (its units' state settled, its accumulators made): as blocks in ``_run``, only the
    first, second, one before the last and last are replayed, the change of one added for the others.
    ``schedules``: (the plans it is for, the action list) pairs (the list depends on the microbatch count), each
    replayed for its plans only, a forward's or backward's record shared (``_replayed``)."""
    tally(schedule_replays=len(schedules), timeline_plans=q.n, schedule_actions=sum(len(a) for _, a in schedules))
    whole = _step_start(q)
    v = len(chunks)
    memo: dict = {}
    for plans, actions in schedules:
        idx = np.flatnonzero(plans)
        if not len(idx):
            continue
        tl = whole.take(idx)
        # unsharded: per stage where its units are unsharded (over the whole batch: the records' keys);
        # held: the stage's unsharded parameter bytes (the schedule's plans)
        st = {"unsharded": [np.zeros(q.n, bool) for _ in range(v)], "held": [np.zeros(len(idx)) for _ in range(v)],
              "backwards": [0] * v, "phase": FWD, "memo": memo, "idx": idx, "sliced": {}}
        i = 0
        while i < len(actions):
            kind, stage = actions[i][:2]
            k = 1
            while (kind in ("F", "B") and i + k < len(actions) and actions[i + k][0] == kind
                   and actions[i + k][1] == stage):
                k += 1
            if kind == "LEFT_OUT_B":  # (``pipeline.LeftOut``: that many backwards of the stage left out)
                tl.add("activations", _of(_sent_held(chunks[stage // pp]) * actions[i].backwards, idx))
            else:
                _stage_action_run(tl, chunks[stage // pp], stage // pp, kind, k, st)
            i += k
        whole.put(idx, tl)
    _optimizer_step(whole, q)
    return whole.phases()


def _of(x, idx: np.ndarray):
    """``x`` (a scalar or one value per plan of the batch) for the plans ``idx``."""
    return x[idx] if np.ndim(x) else x


def _stage_action_run(tl: Timeline, qc: RankMemory, c: int, kind: str, k: int, st: dict) -> None:
    """``k`` consecutive actions ``kind`` of stage ``c`` (``simulate_actions``), as blocks in ``_run``; the stage's
    state advances with the running totals (its unsharded bytes by the last action's change, its backward count)."""
    def repeated(times: float) -> None:
        st["held"][c] = st["held"][c] + times * st["held_change"]
        if kind == "B":
            st["backwards"][c] += int(times)

    _run(tl, k, lambda _last: _stage_action(tl, qc, c, kind, st), repeated)


def _stage_action(tl: Timeline, qc: RankMemory, c: int, kind: str, st: dict) -> None:
    """One action of stage ``c`` (``simulate_actions``), with the stage's state in ``st``."""
    unsharded, held, backwards = st["unsharded"], st["held"], st["backwards"]
    before = tl.cur["fsdp_unsharded_params"].copy()
    if kind == "F":
        st["phase"] = FWD
        _replayed(tl, st, (kind, id(qc), unsharded[c].tobytes()),
                  lambda t, _p: _forward(t, qc, act_before=None, after_backward=unsharded[c]))
        unsharded[c] = qc.fsdp & ~qc.raf
    elif kind == "B":
        st["phase"] = phase = BWD1 if sum(backwards) == 0 else BWD2
        mode = ACC_FIRST if backwards[c] == 0 else ACC_LATER
        regather = ~unsharded[c]
        _replayed(tl, st, (kind, id(qc), mode, regather.tobytes()),
                  lambda t, p: _backward(t, qc, mode, p, regather=regather), phase)
        tl.add("activations", _of(_sent_held(qc), st["idx"]))
        backwards[c] += 1
        unsharded[c] = qc.fsdp.copy()
        if np.any(qc.has_emb):
            st["phase"] = BWD_END
    elif kind == "UNSHARD":
        on = ~unsharded[c]
        _replayed(tl, st, (kind, id(qc), on.tobytes()), lambda t, p: _unshard_stage(t, qc, on, p), st["phase"])
        unsharded[c] = qc.fsdp.copy()
    elif kind == "RESHARD":
        tl.add("fsdp_unsharded_params", -held[c])
        unsharded[c] = np.zeros(qc.n, bool)
    else:  # REDUCE_GRAD
        st["phase"] = BWD_END
        _replayed(tl, st, (kind, id(qc)), lambda t, _p: _reduce_after(t, qc))
        unsharded[c] = np.zeros(qc.n, bool)
    st["held_change"] = tl.cur["fsdp_unsharded_params"] - before
    held[c] = held[c] + st["held_change"]


def _sent_held(q: RankMemory) -> np.ndarray:
    """What a microbatch's backward leaves alive on a stage of torch's runtime schedule (interleaved) until the
    step ends: what the microbatch sent, its stage output (a stage before the last) and its input's gradient (a
    stage after the first). The runtime schedule keeps every send's work in ``send_ops`` and waits for them only
    after its last action, and a work holds the tensor it sends (gloo's send work keeps it; NCCL stashes an async
    op's tensors in its work until ``wait()``) [derived: torch 2.13 pipelining/schedules.py
    ``_PipelineScheduleRuntime._step_microbatches``; bench/real_vs_trace.py: tiny pp2 x v2, the real run's rank 0
    held 16 more (T, d) tensors than the trace at its peak, +4.2% / +5.2% by rank, +0.04% / +0.05% once the trace
    held them too]. Megatron's schedule (TE layers) waits for its sends: nothing held there."""
    return np.where(q.torch_pp, np.where(q.has_out, 0.0, q.flow) + np.where(q.has_emb, 0.0, q.flow), 0.0)


def _replayed(tl: Timeline, st: dict, key: tuple, action, phase: str = BWD1) -> None:
    """``action(timeline, phase)`` applied to ``tl``: recorded once per ``key`` on a timeline starting from zero
    (its largest moment per phase above its start, itemized, and its change), then applied as that record. A
    forward or backward changes the running totals by amounts that do not depend on them (every step adds or
    frees sizes; the deferred cast gradients it clears at its end are its own), so one record serves every action
    with the same key (``simulate_actions``: the stage's contents, kind, gradient mode and unit state; a stage's
    unshard and its reduce likewise). ``phase`` only names the moments the action attributes to the phase it is
    given (the backward's and the unshard's; no branch depends on it): the record is made under BWD1 and its
    BWD1 moments applied under ``phase``. Each recorded moment is applied relative to the start (two under one
    phase are two moments), the change after the last."""
    memo, sliced, idx = st["memo"], st["sliced"], st["idx"]
    rec = sliced.get(key)
    if rec is None:
        whole = memo.get(key)
        if whole is None:
            sub = Timeline(len(st["unsharded"][0]))
            action(sub, BWD1)
            whole = memo[key] = ([(ph, sub.best[j], sub.items[j]) for j, ph in enumerate(PHASES)
                                  if np.isfinite(sub.best[j]).any()], sub.arr)  # (reached ones)
        rec = sliced[key] = ([(ph, {"top": top[idx], "at": at[:, idx], "end": None}) for ph, top, at in whole[0]],
                             whole[1][:, idx])
    moments, end = rec
    for ph, series in moments:
        tl.apply_series(phase if ph == BWD1 else ph, series)
    tl.arr += end


def _unshard_stage(tl: Timeline, q: RankMemory, on, phase: str) -> None:
    """Every FSDP unit of a stage unshards (``on``) in module order: per unit the all-gather's flat buffer, the
    copy-out into its parameters (a moment), the buffer freed (``_gather`` outside forward). Within a run of equal
    blocks each moment is the previous one plus one unit's parameters: only the run's last is replayed."""
    _gather(tl, q, q.emb, on & q.has_emb, phase, False, [])
    for blk, count in q.blocks:
        units = [blk.unit] + ([blk.experts] if blk.experts is not None else [])
        for u in units:
            tl.add("fsdp_unsharded_params", np.asarray(u.gathered, dtype=float) * (count - 1), q.fsdp & on)
        for u in units:
            _gather(tl, q, u, on if u is blk.unit else on & _own_unit(u), phase, False, [])
    _gather(tl, q, q.out, on & q.has_out, phase, False, [])


def _gather(tl: Timeline, q: RankMemory, u: Unit, on, phase: str, forward: bool, held: list) -> None:
    """Pre-forward / pre-backward all-gather of a resharded unit (``on``): its flat buffer, the copy-out into its
    parameters (a moment, with the previous unit's flat buffer still held in forward: FSDP2 drops that one only
    after this copy-out — trace of llama3-8b 3 layers with reshard-never, allocation by allocation: the next unit's
    flat and parameters are made before the last flat goes), then in forward the previous unit's flat buffer is
    freed and this one's held, in backward this one's is freed."""
    fs = q.fsdp & on
    buf = fs & _copy_in(q)
    tl.add("fsdp_gather_buffers", u.gathered, buf)
    tl.add("fsdp_unsharded_params", u.gathered, fs)
    _copy_out_moment(tl, u, fs, phase)
    if forward:
        # (only where this unit gathers: elsewhere the previous flat buffer stays held — a MoE block's experts
        # with ep 1 belong to the block's unit and gather nothing of their own)
        prev_b, prev_m = held[0] if held else (0.0, np.zeros(q.n, bool))
        tl.add("fsdp_gather_buffers", -np.asarray(prev_b, dtype=float), prev_m & fs)
        held.clear()
        held.append((np.where(fs, np.where(q.flat_held, u.gathered, 0.0), prev_b), fs | prev_m))
        tl.add("fsdp_gather_buffers", -np.asarray(u.gathered, dtype=float), buf & ~q.flat_held)
    else:
        tl.add("fsdp_gather_buffers", -np.asarray(u.gathered, dtype=float), buf)


def _copy_out_moment(tl: Timeline, u: Unit, on, phase: str) -> None:
    """The copy-out's moment: the unit's parameters allocated beside its flat buffer, and the temporaries of its
    parameters sharded on a dim other than 0 (``Unit.copy_temp``), freed when the copy-out returns."""
    tl.add("fsdp_gather_buffers", u.copy_temp, on)
    tl.mark(phase, on)
    tl.add("fsdp_gather_buffers", -np.asarray(u.copy_temp, dtype=float), on)


def _copy_in(q: RankMemory) -> np.ndarray:
    """Where a unit's gather makes a buffer beside its unsharded parameters: a shard group of 2+ ranks (the flat
    all-gather buffer), or of one rank in a param dtype below fp32. With one rank FSDP2 all-gathers nothing: the
    unsharded parameters are filled from ``all_gather_inputs`` when the unit runs (``wait_for_unshard``), which is
    a cast copy of the shard in a lower param dtype and the shard itself in fp32; nor is anything prefetched then
    (``unshard`` only records that it ran) [derived: torch 2.13 _fsdp_param_group.unshard / wait_for_unshard]."""
    return q.flat_held | (q.param_bytes < 4.0)


def _forward(tl: Timeline, q: RankMemory, act_before, gathered=None, forward_units=True, after_backward=None) -> None:
    """One microbatch's forward with ``act_before`` already in flight. ``gathered``: where the units are still
    unsharded from an earlier forward (they gather again only where resharded after it); ``after_backward``:
    where a backward without reshard (pipelining's) left every unit unsharded: no gather, and with
    reshard-after-forward each unit (the [norm, output] one too) is resharded after its forward all the same
    (FSDP2's pre-forward unshard of an unsharded group is a no-op, its post-forward reshard is not). The loss's
    peak at the end (last stage), else the microbatch's stage output kept. ``forward_units`` False: only the end
    of the forward (a later microbatch with every unit unsharded: the same moments as the first's, less the
    gathers)."""
    held: list = []
    after = np.zeros(q.n, bool) if after_backward is None else np.asarray(after_backward, bool)
    need = (np.ones(q.n, bool) if gathered is None else ~np.asarray(gathered, bool)) & ~after
    present = need | after  # where a unit resharding after its forward frees something
    if forward_units:
        _gather(tl, q, q.emb, q.has_emb & need, FWD, True, held)
        tl.add("fsdp_unsharded_params", -np.asarray(q.emb.gathered, dtype=float),
               q.fsdp & q.has_emb & q.raf & present)
        # the residual stream between blocks (the embedding's output or the stage's input, then each block's
        # output): alive at every later gather and not yet a block's saved input [trace: a (T, d) fp32 tensor
        # beside the blocks' saved ones at the output unit's gather]
        # (a received input that is a receive buffer is counted there: ``recv_in``)
        tl.add("activations", q.flow - q.recv_in)
        for blk, count in q.blocks:
            def body(last: bool, blk=blk):
                _gather(tl, q, blk.unit, need, FWD, True, held)
                if blk.experts is not None:
                    _gather(tl, q, blk.experts, need & _own_unit(blk.experts), FWD, True, held)
                    tl.add("fsdp_unsharded_params", -np.asarray(blk.experts.gathered, dtype=float),
                           q.fsdp & q.raf & present)
                if np.any(blk.fwd_working):  # (the block's input is already counted: the stream before it)
                    tl.add("activations", blk.fwd_working)
                    tl.mark(FWD)
                    tl.add("activations", -np.asarray(blk.fwd_working, dtype=float))
                tl.add("activations", blk.act)
                tl.add("fsdp_unsharded_params", -np.asarray(blk.unit.gathered, dtype=float),
                       q.fsdp & q.raf & present)

            _run(tl, count, body)
        _gather(tl, q, q.out, q.has_out & (need | q.raf_out) & ~after, FWD, True, held)
        # ("always": the [norm, output] unit reshards after its forward, before the loss)
        tl.add("fsdp_unsharded_params", -np.asarray(q.out.gathered, dtype=float), q.fsdp & q.has_out & q.raf_out)
        if held:  # the root's post-forward frees the last flat buffer
            tl.add("fsdp_gather_buffers", -held[0][0], held[0][1])
        # the microbatch keeps its stage output (or its loss's saved tensors, below the peak)
        tl.add("activations", q.mb_extra - q.flow)
    tl.add("logits_and_loss", q.loss - q.mb_extra, q.has_out)
    tl.mark(FWD)
    tl.add("logits_and_loss", -(q.loss - q.mb_extra), q.has_out)
    tl.mark(FWD)


def _run(tl: Timeline, count: int, body, repeated=None) -> None:
    """``count`` blocks of one kind in a row: the first, the second (a typical one: the same kind before it), the
    change it made repeated for the blocks up to the one before the last, that one replayed (the running totals
    grown over all before it; its successor is a block of the same size), and the last (its successor differs).
    ``body(last)`` replays one block and records its moments."""
    if count <= 0:
        return
    body(count == 1)
    if count == 1:
        return
    if count > 2:
        before = tl.snapshot()
        body(False)
        if count > 3:
            tl.advance(before, count - 4)
            if repeated is not None:  # (state kept beside the running totals advances with them)
                repeated(count - 4)
            body(False)
    body(True)


def _post_backward(tl: Timeline, q: RankMemory, u: Unit, on, phase: str, rs_prev: list, grads_alive: bool,
                   mode) -> None:
    """What a unit does with its unsharded gradients after its backward (``mode`` per plan):

    * REDUCE (no PP) / FINAL (PP: the stage's reduce after its last backward): reshard, release the previous
      reduce-scatter input, reduce: the input (padded, reduce dtype) allocated with the gradients alive (a moment;
      FINAL: the accumulators, every microbatch's gradients already added into them), the output (the shard,
      reduce dtype) and, when the reduce dtype is not fp32, its fp32 copy (a moment); the unsharded gradients go
      (for the [norm, output] unit and the embedding only after the output: the autograd engine still holds them
      when their post-backward runs from it); the shard becomes the fp32 gradient, added into the existing one
      with gradient accumulation. HSDP all-reduces the output first and keeps that reduce-dtype buffer until the
      end of backward (FSDPParamGroup._all_reduce_state, released in finalize_backward; pytorch#140044): a buffer
      of its own unless it is the fp32 gradient itself.
    * ACC_FIRST (PP, the pass's first backward): no sync, the unit stays gathered: where the reduce dtype is not
      the gradients' (param dtype), they are copied into a reduce-dtype accumulator parameter by parameter
      (``to_accumulated_grad_if_needed`` in a loop: each copy made, then its source dropped), so the largest
      moment is the last parameter's copy: every accumulator and the last parameter's gradient (registration
      order ends with the MLP's weights, a large one) [trace: three fp32 copies, each followed by its bf16
      source's release]; where it is, FSDP2 keeps them as they are on the unsharded parameters
      (``FSDPParam.init_dtype_attrs`` clamps the reduce dtype to None, ``to_accumulated_grad_if_needed`` then
      returns): no copy, no moment with both.
    * ACC_LATER: added into the accumulator in place, then freed."""
    fs = q.fsdp & on
    red = (mode == REDUCE) | (mode == FINAL)
    accr = mode == FINAL
    _accumulate(tl, q, u, fs, phase, mode)
    r = fs & red
    tl.add("fsdp_unsharded_params", -np.asarray(u.gathered, dtype=float), r)
    # the previous unit's reduce-scatter input goes when this unit's reduce starts (where this unit reduces: a
    # unit a plan does not have leaves it alive)
    prev = rs_prev.pop() if rs_prev else (0.0, np.zeros(q.n, bool))
    tl.add("fsdp_grad_buffers", -np.asarray(prev[0], dtype=float), prev[1] & r)
    # the reduce takes the accumulators over (FSDP2 drops its own reference: a buffer now)
    tl.add("gradients", -np.asarray(u.acc, dtype=float), r & accr)
    tl.add("fsdp_grad_buffers", u.acc, r & accr)
    # grad_sync once: the reduce input is made from the unit's accumulator, which goes with it
    tl.add("gradients", -np.asarray(u.acc, dtype=float), r & ~accr & q.once)
    tl.add("fsdp_grad_buffers", u.rs_in, r)
    # (a last parameter sharded on dim 1: its dim-0 copy in the list, the original in the loop variable)
    dup = np.where(u.last_off_dim0, np.where(accr, u.last_acc, u.last_grad), 0.0)
    tl.add("fsdp_grad_buffers", dup, r)
    tl.mark(phase, r)
    tl.add("fsdp_grad_buffers", -dup, r)
    # after the copy-in the gradients go, but for the last one (``foreach_reduce``'s loop variable)
    tl.add("fsdp_grad_buffers", -(np.asarray(u.grads, dtype=float) - u.last_grad), r & ~accr & (not grads_alive))
    tl.add("fsdp_grad_buffers", -(np.asarray(u.acc, dtype=float) - u.last_acc), r & accr)
    _reduce_output(tl, q, u, r, accr, grads_alive, phase)
    rs_prev.append((np.where(r, u.rs_in, prev[0]), r | (prev[1] & ~r)))


def _reduce_output(tl: Timeline, q: RankMemory, u: Unit, r, accr, grads_alive: bool, phase: str) -> None:
    """The reduce's output (``_post_backward``, reducing plans ``r``): made beside the input, its fp32 copy where the
    reduce dtype is not fp32, the unit's unsharded gradients (or accumulators, ``accr``) gone, the output freed
    into the unit's fp32 gradient or, under HSDP with earlier sharded gradients or a narrower reduce dtype, held
    until the end of backward."""
    fp32 = q.reduce_bytes == 4.0
    # a shard group of one rank (HSDP replicating, or experts whose EP takes every dp_shard x cp rank) has no
    # reduce-scatter: the unsharded gradients are all gone before the output is made (no reference of the
    # autograd engine's outlives the copy-in there), and FSDP2 copies the input into the output divided by the
    # gradient divide factor, which torchtitan (and the executor) set to 1.0 (force-sum reductions):
    # ``reduce_output.copy_(input / factor)`` makes one more input-sized buffer for that moment [derived: torch
    # 2.13 _fsdp_collectives.foreach_reduce; trace, allocation by allocation: the output's allocation is the
    # gradients' release, then the "out-of-place aten.div" the differential's replicate-only gap named]
    # (the same at pipelining's reduce: the accumulators are all gone after the copy-in, a shard group of one
    # keeping no last one, then the output and the division's buffer [trace: chunk_cat, the accumulators'
    # releases, empty, div, copy_])
    single = r & u.single_group
    tl.add("fsdp_grad_buffers", -np.asarray(u.grads if grads_alive else u.last_grad, dtype=float), single & ~accr)
    tl.add("fsdp_grad_buffers", u.rs_out, r)
    tl.add("fsdp_grad_buffers", u.rs_in, single)
    tl.mark(phase, single)
    tl.add("fsdp_grad_buffers", -np.asarray(u.rs_in, dtype=float), single)
    tl.add("fsdp_grad_buffers", u.shard4, r & ~fp32)  # the fp32 copy of a reduce-dtype output
    tl.mark(phase, r)
    tl.add("fsdp_grad_buffers", -np.asarray(u.grads, dtype=float), r & grads_alive & ~single)
    tl.add("fsdp_grad_buffers", -np.asarray(u.last_grad, dtype=float), r & ~accr & (not grads_alive) & ~single)
    tl.add("fsdp_grad_buffers", -np.asarray(u.last_acc, dtype=float), r & accr)
    held = r & q.hsdp & (~fp32 | q.acc)
    q.held_until_end.append(np.where(held, u.rs_out, 0.0))
    tl.add("fsdp_grad_buffers", -np.asarray(u.rs_out, dtype=float), r & ~held)  # freed, or now the gradient
    tl.add("fsdp_grad_buffers", -np.asarray(u.shard4, dtype=float), r & ~fp32)
    tl.add("gradients", u.shard4, r & ~q.acc)


def _accumulate(tl: Timeline, q: RankMemory, u: Unit, fs, phase: str, mode) -> None:
    """The no-sync post-backward (``_post_backward``'s ACC_FIRST / ACC_LATER): the accumulators made from the first
    microbatch's gradients (with an upcast, parameter by parameter: at the moment the last copy is being made it
    is not yet FSDP's accumulator; without one the gradients are the accumulators already, ``_kept_as_made``), a
    later microbatch's gradients added in and freed."""
    upcast = fs & (mode == ACC_FIRST) & ~q.grads_kept_as_made()
    grads = np.asarray(u.grads, dtype=float)
    tail_acc = q.in_reduce_dtype(u.tail_grad)
    tl.add("fsdp_grad_buffers", -(grads - u.tail_grad) + tail_acc, upcast)
    tl.add("gradients", u.acc - tail_acc, upcast)
    tl.mark(phase, upcast)
    tl.add("fsdp_grad_buffers", -tail_acc, upcast)
    tl.add("gradients", tail_acc, upcast)
    tl.add("fsdp_grad_buffers", -np.where(upcast, u.tail_grad, grads), fs & (upcast | (mode == ACC_LATER)))


def _emb_acc(q: RankMemory):
    """The embedding's accumulator without gradient sync: the whole vocabulary's under TP (``_backward``)."""
    return np.where(q.emb_sharded & q.fsdp, q.in_reduce_dtype(q.emb_dense_grad), q.emb.acc)


def _reduce_after(tl: Timeline, q: RankMemory) -> None:
    """Under PP torch's schedules run every backward without gradient sync or reshard and reduce once after the
    stage's last (``perform_reduce_grad``): each FSDP unit in FSDP's state order (the embedding, the blocks in
    forward order, the [norm, output] unit) reshards and reduce-scatters its accumulators (``_post_backward``,
    FINAL); the final callback then drops the last reduce-scatter input and the HSDP buffers [torch 2.13
    pipelining/stage.py; trace]."""
    rs_prev: list = []
    # the vocab-sharded (TP) embedding's accumulator is the whole vocabulary's gradient (Replicate): FSDP2 reads
    # it through a redistribute to the parameter's placement (``FSDPParam._get_grad_inner_tensor``) before the
    # reshard, cloning the rank's rows with the whole one and the unsharded parameters alive, then drops the
    # whole one: the rows are the accumulator it reduces [torch 2.13 _fsdp_param.py / _fsdp_param_group.py
    # post_backward; trace: split + clone at the reduce, then the (vocab, d) release]
    tp_emb = q.has_emb & q.fsdp & q.emb_sharded
    tl.add("fsdp_grad_buffers", q.emb.acc, tp_emb)  # (the clone: FSDP's local until the reduce takes it)
    tl.mark(BWD_END, tp_emb)
    tl.add("gradients", -np.asarray(_emb_acc(q), dtype=float) + q.emb.acc, tp_emb)
    tl.add("fsdp_grad_buffers", -np.asarray(q.emb.acc, dtype=float), tp_emb)
    # (the embedding is its unit's only parameter: its accumulator is the one ``foreach_reduce``'s copy-in loop
    # keeps, which runs only over a shard group of 2+ (``_memory_unit``'s linger) [trace: dp_replicate 4 x pp 2,
    # fp32: the reduce of a (50257, 512) embedding holds its input, output and the divide's buffer, not a fourth])
    q_emb = dataclasses.replace(q.emb, last_acc=np.where(q.flat_held, q.emb.acc, 0.0))
    _post_backward(tl, q, q_emb, q.has_emb, BWD_END, rs_prev, False, FINAL)
    for blk, count in q.blocks:
        def body(_last, blk=blk):
            if blk.experts is not None:
                _post_backward(tl, q, blk.unit, True, BWD_END, rs_prev, False, FINAL)
                _post_backward(tl, q, blk.experts, True, BWD_END, rs_prev, False, FINAL)
            else:
                _post_backward(tl, q, blk.unit, True, BWD_END, rs_prev, False, FINAL)
        _run(tl, count, body)
    _post_backward(tl, q, q.out, q.has_out, BWD_END, rs_prev, False, FINAL)
    _final_callback(tl, q, rs_prev)


def _backward(tl: Timeline, q: RankMemory, mode, phase: str, regather) -> None:
    """One microbatch's backward. ``regather``: where its units were resharded after forward and gather again.
    Plain gradients (no FSDP) are the parameters' own, fp32."""
    rs_prev: list = []
    # the last stage starts with the loss's backward: its peak (``q.loss``, the loss's backward peak, also
    # recorded at the end of the forward) on top of what this backward starts with: a later microbatch's
    # has the gradients accumulated so far and its own in-flight set [trace: the fused loss's chunk moment of
    # each microbatch, 4.4 MiB above the model's output-projection moment, the gradients grown each time];
    # others start with the gradient their successor sends
    tl.add("logits_and_loss", q.loss - q.mb_extra, q.has_out)
    tl.mark(FWD, q.has_out)
    tl.add("logits_and_loss", -(q.loss - q.mb_extra), q.has_out)
    # (the last stage: the residual gradient comes with the final norm's backward, after the output projection's;
    # until then the final norm's saved input and output are alive [trace: llama3-70b shapes, pp2 last stage, both
    # (768, 8192) beside the projection's gradients])
    tl.add("activations", np.where(q.has_out, q.final_norm_saved, q.flow - q.recv_grad))
    # a stage before the last: the schedule holds the stage's output and the gradient it received for it until
    # the microbatch's backward returns (``stage_backward`` is given both); the residual gradient the blocks pass
    # on is a new tensor beside the received one from the first sum on [trace: pp2 first stage, the (T, d) output
    # and its received gradient alive at the embedding's backward, -3.6% without]
    mid = q.pp & ~q.has_out
    held = np.where(mid, np.asarray(q.mb_extra, dtype=float), np.asarray(q.stage_logits, dtype=float))
    recv = np.where(mid, q.flow, 0.0) - q.recv_grad  # (the received gradient, unless a receive buffer)
    tl.add("activations", held - np.asarray(q.mb_extra, dtype=float))
    _output_backward(tl, q, mode, phase, regather, rs_prev)
    _blocks_backward(tl, q, mode, phase, regather, rs_prev, mid)
    # (the stage's first block released its saved input: where that is a receive buffer it stays, counted there)
    tl.add("activations", q.recv_in)
    held = held + (recv if q.blocks else -q.recv_grad)
    kept = _input_held(q, mode)
    _embedding_backward(tl, q, held, mode, phase, regather, rs_prev, kept)
    _final_callback(tl, q, rs_prev)
    # (the received input: its block's saved copy was released above; a receive buffer is counted there)
    tl.add("activations", q.flow - q.recv_in, kept)
    _deferred_casts(tl, q, mode, phase)
    tl.add("activations", -(2.0 * q.flow - q.recv_in + held), kept)


def _output_backward(tl: Timeline, q: RankMemory, mode, phase: str, regather, rs_prev: list) -> None:
    """The [norm, output] unit's part of a microbatch's backward (``_backward``; the last stage): its gather where
    resharded and the next unit's prefetch, the output projection's weight and input gradients, its
    post-backward."""
    first_blk = q.blocks[-1][0] if q.blocks else None
    nxt = first_blk.unit.gathered if first_blk is not None else np.where(q.has_emb, q.emb.gathered, 0.0)
    out_gather = q.has_out & (regather & (q.raf_out | q.pp))
    _gather(tl, q, q.out, out_gather, phase, False, [])
    tl.add("fsdp_gather_buffers", nxt, q.fsdp & regather & q.flat_held)  # the prefetch (none with one rank)
    _fsdp_grads_made(tl, q, q.out.grads, q.has_out, mode)
    out_def = np.where(q.deferred(mode), q.out_weight4, 0.0)
    _plain_grads(tl, q, q.out.grads, q.has_out, mode, out_def)
    # the output projection's backward: its weight gradient is made with the logits' gradient still alive (freed
    # once the projection's input gradient is made too); the trace counts this moment in "end of forward" (the
    # final norm's backward hook has not run). It sets the peak where a rank has few tokens and a large vocabulary
    # (the weight gradient, vocab x d, outgrows the loss's per-token tensors: short sequences, CP) [derived; trace].
    # linear's backward makes the weight's gradient first, then the input's (T x d, gathered under SP) beside it
    # and the logits' gradient: that moment [torch: the weight's mm before the input's; trace: llama3-70b shapes,
    # pp2 last stage, a (768, 8192) fp32 input gradient beside the (32064, 8192) weight gradient, -0.96% before]
    tl.add("logits_and_loss", q.logits_grad + q.out_input_grad, q.has_out)
    tl.mark(FWD, q.has_out)
    tl.add("logits_and_loss", -(q.logits_grad + q.out_input_grad), q.has_out)
    # (under TP its input gradient is then reduced, the logits' gradient gone: ``phases._out_grad_reduction``)
    tl.add("logits_and_loss", q.out_grad_reduce, q.has_out)
    tl.mark(FWD, q.has_out)
    tl.add("logits_and_loss", -np.asarray(q.out_grad_reduce, dtype=float), q.has_out)
    tl.add("activations", np.where(q.has_out, q.flow - q.final_norm_saved, 0.0))
    _post_backward(tl, q, q.out, q.has_out, phase, rs_prev, True, mode)
    _plain_grads_done(tl, q, q.out.grads - out_def, q.has_out, mode)


def _blocks_backward(tl: Timeline, q: RankMemory, mode, phase: str, regather, rs_prev: list, mid) -> None:
    """The stage's blocks in backward order (``_backward``), run by run (``_run``); the stage's first block in
    backward sums beside the received gradient (``mid``: a stage before the last)."""
    runs = list(reversed(q.blocks))
    first = [True]
    for r, (blk, count) in enumerate(runs):
        after = runs[r + 1][0].unit.gathered if r + 1 < len(runs) else np.where(q.has_emb, q.emb.gathered, 0.0)

        def body(last, blk=blk, after=after):
            b = blk.summing_out_of_place(mid) if first[0] else blk
            first[0] = False
            _block_backward(tl, q, b, after if last else blk.unit.gathered, rs_prev, mode, phase, regather)
        _run(tl, count, body)


def _input_held(q: RankMemory, mode) -> np.ndarray:
    """Where a stage's received input and its gradient are still alive at the deferred casts' moments
    (``_deferred_casts``): a pipeline stage after the first (its input comes from the previous stage). The
    schedule gives the stage's backward its input values and reads their gradients after ``autograd.backward``
    returns (torch.distributed.pipelining's ``stage_backward``), so both are held until that call returns; the
    deferred casts are the last nodes the engine runs inside it. Elsewhere nothing comes after the residual
    gradient's release but FSDP's post-backward, which frees [derived: torch's stage_backward and the engine's
    ready-queue order; trace: tiny 3 layers, pp3, autocast, 4 microbatches, the last stage's (1, 128, 256) fp32
    input and its gradient beside the output projection's fp32 cast, -0.92% without, 0.000% with; every other
    last stage with deferred casts in the three differential CSVs moved to within 1e-6 too]."""
    return q.pp & ~q.has_emb & q.deferred(mode) & ~q.fsdp


def _embedding_backward(tl: Timeline, q: RankMemory, held, mode, phase: str, regather, rs_prev: list,
                        kept) -> None:
    """The end of a microbatch's backward on its stage: on the first stage the embedding's backward and
    post-backward; everywhere what the microbatch still ``held`` (a stage's output and received gradient) and the
    residual gradient are released, but where ``kept`` (``_input_held``: after the deferred casts)."""
    # the embedding (first stage): its gradient reaches it; torch's embedding backward makes a dense gradient of
    # the whole vocabulary, and under TP (vocab-sharded weight) the rank's rows of it are cloned into the
    # parameter's gradient before the dense one goes; the final callback's reduce
    _gather_in_backward(tl, q, q.emb, q.has_emb & regather, phase, q.flat_held)
    # (SP: the output gradient all-gathered for it, the embedding's backward input [trace: pp2 x tp8 first stage,
    # the (T, d) all_gather output beside embedding_dense_backward's output, -1.7% without])
    tl.add("activations", q.emb_grad_gathered, q.has_emb)
    # (the residual stream's gradient is the embedding backward's input: alive at its moment [trace: the block
    # output gradient beside embedding_dense_backward's output]; a later stage sends it on)
    tl.add("activations", -(q.flow + held), ~q.has_emb & ~kept)
    # (without FSDP the parameter's gradient is a view of the dense one: that whole storage is the gradient.
    # Without gradient sync (PP) FSDP2 accumulates the gradient as autograd made it: under TP the local tensor of
    # the vocab-sharded weight's gradient is the dense whole-vocabulary one, and its reduce-dtype accumulator
    # (``to_accumulated_grad_if_needed``) is as large [trace: a (vocab, d) fp32 copy])
    acc_mode = (mode == ACC_FIRST) | (mode == ACC_LATER)
    rows = q.emb_sharded & q.fsdp & ~acc_mode
    dense_kept = np.where(rows, q.emb_dense_grad, 0.0)
    emb_grad = np.where(rows, q.emb.grads, q.emb_dense_grad)
    tl.add("fsdp_grad_buffers", dense_kept, q.has_emb)
    # (where the rows are cloned out, that happens in FSDP's post-backward, the embedding backward's input
    # gradient gone: the backward's own moment first)
    clone = q.has_emb & rows
    tl.mark(BWD_END, clone)
    tl.add("activations", -(q.flow + q.emb_grad_gathered), clone)
    _fsdp_grads_made(tl, q, emb_grad, q.has_emb, mode)
    _plain_grads(tl, q, emb_grad, q.has_emb, mode)
    tl.mark(BWD_END, q.has_emb)
    tl.add("activations", -(q.flow + q.emb_grad_gathered), q.has_emb & ~clone)
    tl.add("fsdp_grad_buffers", -dense_kept, q.has_emb)
    q_emb = dataclasses.replace(q.emb, grads=emb_grad, acc=_emb_acc(q), last_acc=_emb_acc(q), tail_grad=emb_grad)
    _post_backward(tl, q, q_emb, q.has_emb, BWD_END, rs_prev, True, mode)
    # (what the microbatch held goes when the stage's backward call returns: after the root unit's post-backward,
    # which autograd runs inside that call [trace: pp2 x dp_shard 6, reduce fp32, the stage output and received
    # gradient beside the embedding gradient's fp32 accumulator, -1.0% without])
    tl.add("activations", -held, q.has_emb)
    _plain_grads_done(tl, q, emb_grad, q.has_emb, mode)


def _final_callback(tl: Timeline, q: RankMemory, rs_prev: list) -> None:
    """FSDP2's final callback: it waits for and drops the last reduce-scatter input; finalize_backward releases the
    HSDP all-reduce buffers."""
    if rs_prev:
        tl.add("fsdp_grad_buffers", -rs_prev[0][0], rs_prev[0][1])
    for x in q.held_until_end:
        tl.add("fsdp_grad_buffers", -x)
    q.held_until_end.clear()


def _first(q: RankMemory, mode) -> np.ndarray:
    """The step's first backward (no earlier pass of gradient accumulation, the pass's first microbatch)."""
    return ~q.acc & ((mode == REDUCE) | (mode == ACC_FIRST))


def _plain_grads(tl: Timeline, q: RankMemory, grads, on, mode, deferred=0.0) -> None:
    """Without FSDP a parameter's gradient is its own ``.grad`` (fp32): made by the step's first backward and
    kept; a later one's new gradient is a buffer until added in — but for ``deferred`` (fp32 bytes of cast-weight
    gradients, ``_deferred_casts``), held in param dtype until the end of the backward."""
    nf = ~q.fsdp & on
    if not np.any(nf):
        return
    first = _first(q, mode)
    tl.add("gradients", grads, nf & first)
    tl.add("fsdp_grad_buffers", grads - deferred, nf & ~first)
    tl.add("autocast_weight_grads", deferred * q.param_bytes / 4.0, nf & ~first)


def _plain_grads_done(tl: Timeline, q: RankMemory, grads, on, mode) -> None:
    """A later backward's new (not deferred) gradients ``grads`` added into the parameters' and freed."""
    nf = ~q.fsdp & on
    tl.add("fsdp_grad_buffers", -np.asarray(grads, dtype=float), nf & ~_first(q, mode))


def _deferred_casts(tl: Timeline, q: RankMemory, mode, phase: str) -> None:
    """Autocast without FSDP caches each linear weight's cast copy from its first use in the step; the cast's
    autograd node belongs to the first forward's graph, so its sequence number is below every node of a later
    microbatch's or pass's graph, and the engine (which runs the ready node of highest sequence number first)
    runs it only when nothing else is left: the cast weights' gradients (param dtype) wait until the end of that
    backward (after the embedding's), then are converted to fp32 and added one by one, the last cast first (the
    output projection on the last stage) [derived from torch.autograd's engine ordering and autocast's weight
    cache; trace]. Each conversion is a moment with every gradient not yet added: the first, and on the last
    stage the second (the output projection's gone, the last block's last weight converted: larger where that
    weight's fp32 copy outgrows the output's held and fp32 bytes together — a trace of a 1-layer d384 model:
    +0.8 MiB over the first); later ones only shrink. Then the held gradients go."""
    d = q.deferred(mode) & ~q.fsdp
    first = np.where(q.has_out, q.out_weight4, q.last_cast4)
    tl.add("autocast_weight_grads", first, d)
    tl.mark(BWD_END, d & q.has_emb)
    tl.mark(phase, d & ~q.has_emb)
    second = d & q.has_out & (q.last_cast4 > 0)
    tl.add("autocast_weight_grads", q.last_cast4 - q.out_weight4 * (1.0 + q.param_bytes / 4.0), second)
    tl.mark(BWD_END, second & q.has_emb)
    tl.mark(phase, second & ~q.has_emb)
    tl.cur["autocast_weight_grads"] = np.where(d, 0.0, tl.cur["autocast_weight_grads"])


def _gather_in_backward(tl: Timeline, q: RankMemory, u: Unit, on, phase: str, prefetched=None) -> None:
    """A unit prefetched by the previous unit's pre-backward (resharded): the copy-out moment, then its flat
    buffer freed; a unit still unsharded needs nothing. ``prefetched`` (default: everywhere): where the previous
    unit's pre-backward prefetched it (dense units: a shard group of 2+ ranks, ``q.flat_held``)."""
    fs = q.fsdp & on
    pref = np.ones(q.n, bool) if prefetched is None else prefetched
    cast = fs & ~pref & _copy_in(q)  # a shard group of one: the copy-in made now, not prefetched (``_copy_in``)
    tl.add("fsdp_gather_buffers", u.gathered, cast)
    tl.add("fsdp_unsharded_params", u.gathered, fs)
    _copy_out_moment(tl, u, fs, phase)
    tl.add("fsdp_gather_buffers", -np.asarray(u.gathered, dtype=float), (fs & pref) | cast)


def _block_backward(tl: Timeline, q: RankMemory, blk: Block, nxt, rs_prev: list, mode, phase: str,
                    regather) -> None:
    """One block's backward: copy-out of its prefetched parameters and the next unit's prefetch (a MoE block with EP
    prefetches its experts, whose pre-backward prefetches the next unit), the recompute (every tensor of the block
    saved again), then op by op (``layers.backward_steps``): activation gradients made, weight gradients made (a
    moment each), saved tensors and consumed gradients freed; with EP the experts' own copy-out before their
    first op and their reduce after their last; the post-backward."""
    _gather_in_backward(tl, q, blk.unit, regather, phase, q.flat_held)
    ex = blk.experts
    # the next unit's prefetch: the experts' own unit (EP) or the next block's / the embedding's
    dense_next = np.where(q.flat_held, nxt, 0.0)  # no prefetch buffer with a shard group of one (``_copy_in``)
    tl.add("fsdp_gather_buffers", np.where(_own_unit(ex), ex.gathered, dense_next) if ex is not None else dense_next,
           q.fsdp & regather)
    # a recomputed block reruns its forward, and routed experts resharded after forward (their own unit, EP) are
    # unsharded by their pre-forward there, after the attention's recompute: their copy-out's moment holds that
    # part of the transient, not the whole block's [trace: full AC, ep 2 over 8 ranks, reshard always: the peak
    # at the experts' copy-out temporaries with about the attention's recomputed tensors alive]
    early = np.zeros(q.n, bool)
    kept_flat: np.ndarray | float = 0.0
    tl.add("recompute_transient", blk.recompute_held)  # (0 where nothing is recomputed)
    if ex is not None:
        early = regather & _own_unit(ex) & (np.asarray(blk.transient, dtype=float) > 0)
        tl.add("recompute_transient", blk.transient_attn, early)
        _gather_in_backward(tl, q, ex, early, phase)
        tl.add("recompute_transient", -np.asarray(blk.transient_attn, dtype=float), early)
        # (that gather is a forward's: FSDP2 keeps a forward all-gather's flat buffer after the copy-out, in
        # ``comm_ctx.all_gather_state``, until the next unshard frees it — the experts' pre-backward prefetch of
        # the next unit, after the recompute [derived: torch 2.13 FSDPParamGroup.wait_for_unshard (training state
        # FORWARD, a shard group of 2+) and unshard; trace: mixtral shapes, 1 layer, dp_shard 6 x ep 2, full AC,
        # fp32, the experts' 4.2 GB flat buffer alive at the recompute's expert GEMM, -0.91% -> -0.15%; kept
        # through the experts' backward too it would be +24%])
        kept_flat = np.where(early & q.fsdp & np.asarray(ex.grouped, dtype=bool), ex.gathered, 0.0)
        tl.add("fsdp_gather_buffers", kept_flat)
    tl.add("recompute_transient", blk.transient + blk.recompute_experts)
    tl.mark(phase)
    tl.add("recompute_transient", -np.asarray(blk.recompute_experts, dtype=float))
    tl.add("fsdp_gather_buffers", -np.asarray(kept_flat, dtype=float))
    if np.any(blk.recompute_combine):  # (a MoE block's recompute reaches its combine: ``Block.recompute_combine``)
        tl.add("recompute_transient", blk.recompute_combine)
        tl.mark(phase)
        tl.add("recompute_transient", -np.asarray(blk.recompute_combine, dtype=float))
    tl.add("recompute_transient", -np.asarray(blk.recompute_held, dtype=float))
    tl.add("recompute_transient", -blk.transient)
    tl.add("activations", blk.transient)
    none_total = np.asarray(blk.act, dtype=float) + blk.transient
    totals = [np.asarray(blk.unit.grads, dtype=float), np.asarray(ex.grads if ex is not None else 0.0, dtype=float)]
    defer = q.deferred(mode)
    made, deferred, freed, added = _steps_series(tl, q, blk, nxt, mode, phase, regather, rs_prev, totals, defer,
                                                 ex_regather=regather & ~early)
    tl.add("activations", -(none_total - freed))  # what the steps do not name (e.g. MLA's latent tensors)
    rest = totals[0] - made[0]  # (what the steps do not name: MLA's projections, cast linears)
    _grads_made(tl, q, rest, mode, np.where(defer, rest, 0.0))
    deferred = deferred + np.where(defer, rest, 0.0)
    tl.mark(phase)
    _post_backward(tl, q, _less_grads(blk.unit, added[0]), True, phase, rs_prev, False, mode)
    _plain_grads_done(tl, q, blk.unit.grads - deferred - added[0], True, mode)


def _less_grads(u: Unit, added) -> Unit:
    """``u`` whose post-backward finds ``added`` fewer gradient bytes in its buffers (``_added_in_place``: there
    only where no reduce runs, so nothing else of the unit changes)."""
    return u if not np.any(added) else dataclasses.replace(u, grads=np.asarray(u.grads, dtype=float) - added)


def _own_unit(ex: Unit) -> np.ndarray:
    """Plans whose routed experts are an FSDP unit of their own (EP; with ep 1 they belong to the block's)."""
    return np.asarray(ex.gathered, dtype=float) > 0


def _step_plan(blk: Block, n: int) -> list:
    """``blk.steps`` as a list of ("gather",) / ("post",) events (the routed experts' copy-out before their first
    op, their post-backward after their last) and ("run", arrays) of the steps between, stacked (S, n): alloc,
    frees (consumed gradients and saved tensors), the saved tensors alone, gradient bytes per unit, cast flags."""
    ex = blk.experts
    out: list = []
    seg: list = []

    def stack(f):
        return np.stack([np.broadcast_to(np.asarray(f(st), dtype=float), (n,)) for st in seg])

    def flush():
        if seg:
            saved = stack(lambda st: sum(np.asarray(blk.saved.get(k, 0.0), dtype=float) for k in st["saved"]))
            out.append(("run", {"alloc": stack(lambda st: st["alloc"]), "free": stack(lambda st: st["free"]) + saved,
                                "saved": saved.sum(axis=0),
                                "p": [stack(lambda st, i=i: np.asarray(st["pgrad"][i], dtype=float)
                                            * blk.grad_elem_bytes) for i in ((0, 1) if ex is not None else (0,))],
                                # (autocast caches no routed expert: their steps' gradients are never deferred)
                                "cast": np.array([st.get("cast", True) and not np.any(st["pgrad"][1])
                                                  for st in seg])[:, None]}))
            seg.clear()

    started = False
    for st in blk.steps:
        if ex is not None and not started and {"experts.w2.input", "experts.gelu.out"} & set(st["saved"]):
            flush()
            started = True
            out.append(("gather",))
        seg.append(st)
        if ex is not None and "experts.input(permuted)" in st["saved"]:
            flush()
            out.append(("post",))
    flush()
    return out


def series_summary(n: int, pre: dict, post: dict) -> dict:
    """What ``Timeline.apply_series`` needs of S rounds (add ``pre[j]``, a moment, add ``post[j]``), relative to
    the running totals before them: the moment with the largest total per plan (the first of equals), the change
    of every moved key at that moment and after the last round. Which moment is largest does not depend on the
    totals before (they add to every moment alike), so one summary serves every replay."""
    moved = [k for k in MEMORY_KEYS if np.ndim(pre.get(k, 0.0)) == 2 or np.ndim(post.get(k, 0.0)) == 2]
    at, end = {}, {}
    for k in moved:
        p, q = pre.get(k, 0.0), post.get(k, 0.0)
        both = np.cumsum(p + q, axis=0)
        at[k] = both - q
        end[k] = both[-1]
    total = np.add.reduce(list(at.values()))
    j = np.argmax(total, axis=0)
    cols = np.arange(n)
    at_top, change = np.zeros((len(MEMORY_KEYS), n)), np.zeros((len(MEMORY_KEYS), n))
    for k, v in at.items():
        at_top[_KEY[k]] = v[j, cols]
        change[_KEY[k]] = end[k]
    return {"top": total[j, cols], "at": at_top, "end": change}


def _steps_series(tl: Timeline, q: RankMemory, blk: Block, nxt, mode, phase: str, regather, rs_prev: list,
                  totals: list, defer, ex_regather=None) -> tuple:
    """The op steps of a block's backward (``_block_backward``), each: its allocations and weight gradients made
    (``_grads_made``), a moment, its frees. Replayed as runs of steps (``Timeline.apply_series``) split where the
    routed experts' copy-out (before their first op) and post-backward (after their last) happen.
    Returns (gradient bytes made [unit, experts], the deferred part, activation bytes freed, the gradient bytes
    already added into the parameters' and freed [unit, experts]: a later backward's without FSDP)."""
    ex = blk.experts
    made = [np.zeros(q.n), np.zeros(q.n)]
    added = [np.zeros(q.n), np.zeros(q.n)]
    deferred, freed = np.zeros(q.n), np.zeros(q.n)
    held0 = np.zeros(q.n)  # routed experts' gradients of the block unit (ep 1) held until the experts' "post"
    first = _first(q, mode)
    inplace = _added_in_place(q, mode)
    kept = _kept_as_made(q, mode)
    cache = blk.series_cache.get(id(mode))
    if cache is None or cache[0] is not mode:  # (the summaries depend on the block and the microbatch's mode)
        cache = (mode, {})
        blk.series_cache[id(mode)] = cache
    done: dict = cache[1]
    for n_item, item in enumerate(blk.step_plan(q.n)):
        if item[0] == "gather":
            assert ex is not None
            _gather_in_backward(tl, q, ex, regather if ex_regather is None else ex_regather, phase)
            tl.add("fsdp_gather_buffers", np.where(_own_unit(ex), nxt, 0.0), q.fsdp & regather & q.flat_held)
            continue
        if item[0] == "post":
            assert ex is not None
            _grads_made(tl, q, totals[1] - made[1], mode)
            made[1] = totals[1]
            _post_backward(tl, q, _less_grads(ex, added[1]), _own_unit(ex), phase, rs_prev, False, mode)
            _plain_grads_done(tl, q, ex.grads - added[1], True, mode)
            # with ep 1 the held experts' gradients (the block unit's) are added here too, not at the block's end
            tl.add("fsdp_grad_buffers", -held0)
            added[0] = added[0] + held0
            held0 = np.zeros(q.n)
            continue
        r = item[1]
        if n_item not in done:
            summary, made_, d_sum, a_sum, h_sum = _run_summary(q, ex, r, made, totals, defer, first, inplace, kept,
                                                               blk.experts_held)
            done[n_item] = (summary, tuple(made_), d_sum, a_sum, h_sum)
        summary, made_, d_sum, a_sum, h_sum = done[n_item]
        held0 = held0 + h_sum
        made = list(made_)
        added = [added[0] + a_sum[0], added[1] + a_sum[1]]
        deferred = deferred + d_sum
        freed = freed + r["saved"]
        tl.apply_series(phase, summary)
    return made, deferred, freed, added


def _added_in_place(q: RankMemory, mode) -> np.ndarray:
    """Where a backward's new weight gradients are added into existing ones as the autograd engine makes them
    (``AccumulateGrad``: in place, the new one dropped at once), not held until a post-backward: a later
    backward without FSDP (the parameters' ``.grad``), and a later microbatch of FSDP without sync whose reduce
    dtype is the param dtype (FSDP2 keeps the accumulation on the unsharded parameters' ``.grad``; with an upcast
    it moves it to ``unsharded_accumulated_grad`` and the new gradients wait for the post-backward's add)."""
    later_nosync = (mode == ACC_LATER) & q.grads_kept_as_made()
    return (~q.fsdp & ~_first(q, mode)) | (q.fsdp & later_nosync)


def _kept_as_made(q: RankMemory, mode) -> np.ndarray:
    """Where FSDP's unsharded gradients are the parameters' ``.grad`` from the moment they are made and stay so:
    a pass's first backward without sync whose reduce dtype is the param dtype (no accumulator copy,
    ``_post_backward``): labelled gradients, not buffers (what the trace reads off the unsharded parameters)."""
    return q.fsdp & (mode == ACC_FIRST) & q.grads_kept_as_made()


def _fsdp_grads_made(tl: Timeline, q: RankMemory, x, on, mode) -> None:
    """FSDP's unsharded gradients ``x`` made (``on``): gradients where they are kept as made, else buffers."""
    kept = _kept_as_made(q, mode)
    tl.add("gradients", x, on & q.fsdp & kept)
    tl.add("fsdp_grad_buffers", x, on & q.fsdp & ~kept)


def _run_summary(q: RankMemory, ex, r: dict, made: list, totals: list, defer, first, inplace, kept,
                 experts_held=False) -> tuple:
    """One run of op steps (``r``) summarized for ``Timeline.apply_series``: its activations made and freed, the
    weight gradients it makes (capped at the unit's totals) into FSDP's buffers, the plain gradients (the first
    microbatch without FSDP) or autocast's deferred cast-weight gradients. A later backward's new gradient
    without FSDP lives one step: the autograd engine's AccumulateGrad adds it into the parameter's ``.grad`` in
    place as soon as it is made and drops it (no unit holds it until a post-backward) [derived: torch's
    AccumulateGrad with grad mode off; trace: TP x PP, a backward's peak 15 MiB (the layer's gradients) below
    the model's] — but the routed experts' where their weights are TP DTensors (``Block.experts_held``): those are
    held until the experts' backward ends (``_steps_series``'s "post"), also with FSDP wherever new gradients are
    added in place (``_added_in_place``). Returns (summary, the gradient bytes
    made after it [unit, experts], the deferred part, the gradient bytes added and freed [unit, experts], the
    block unit's gradient bytes held instead: with ep 1)."""
    made = list(made)
    nf = ~q.fsdp
    d_sum = 0.0
    h_sum: np.ndarray | float = 0.0
    a_sum = [np.zeros(q.n), np.zeros(q.n)]
    gbuf: np.ndarray | float = 0.0
    gfree: np.ndarray | float = 0.0
    grads: np.ndarray | float = 0.0
    acw: np.ndarray | float = 0.0
    ps = r["p"]
    hold = [np.zeros_like(ps[0]), np.zeros_like(ps[0])]  # the routed experts' new gradients held (per stream)
    if ex is not None and len(ps) == 2:  # (with ep 1 the routed experts' gradients are the block unit's)
        own = _own_unit(ex)
        held = np.where(inplace & np.asarray(experts_held, dtype=bool), ps[1], 0.0)
        hold = [np.where(own, 0.0, held), np.where(own, held, 0.0)]
        ps = [ps[0] + np.where(own, 0.0, ps[1]), np.where(own, ps[1], 0.0)]
    for i, p in enumerate(ps):
        cum = np.minimum(made[i] + np.cumsum(p, axis=0), np.maximum(totals[i], made[i]))
        x = np.diff(cum, axis=0, prepend=made[i][None, :])
        made[i] = cum[-1]
        d = np.where(defer & r["cast"], x, 0.0) if i == 0 else np.zeros_like(x)  # (routed experts: no cache)
        if i == 0:
            d_sum = d.sum(axis=0)  # type: ignore[assignment]
        new = np.where(nf, x - d, x)  # what AccumulateGrad adds (without FSDP the deferred casts wait)
        withheld = np.where(inplace, np.minimum(hold[i], new), 0.0)
        added = np.where(inplace, new, 0.0) - withheld
        if i == 0:
            h_sum = withheld.sum(axis=0)
        gbuf = gbuf + np.where(q.fsdp & ~kept, x, 0.0) + np.where(nf & ~first, x - d, 0.0)
        grads = grads + np.where(kept, x, 0.0)
        gfree = gfree - added
        a_sum[i] = added.sum(axis=0)
        grads = grads + np.where(nf & first, x, 0.0)
        acw = acw + np.where(nf & ~first, d * q.param_bytes / 4.0, 0.0)
    # a gradient that becomes a parameter's .grad (kept as made, or a first backward's without FSDP) is the
    # matmul's output at its own moment and .grad only after it (AccumulateGrad runs next): counted with the
    # step's allocations there, moved to the gradients after [derived; the trace labels it so]
    summary = series_summary(q.n, {"activations": r["alloc"] + grads, "fsdp_grad_buffers": gbuf,
                                   "autocast_weight_grads": acw},
                             {"activations": -r["free"] - grads, "fsdp_grad_buffers": gfree, "gradients": grads})
    return summary, made, d_sum, a_sum, h_sum


def _grads_made(tl: Timeline, q: RankMemory, x, mode, deferred=0.0) -> None:
    """Weight gradients produced by the backward: FSDP's unsharded gradients (a buffer until its post-backward),
    or without FSDP the parameters' own (``_plain_grads``; ``deferred``: the part held in param dtype)."""
    _fsdp_grads_made(tl, q, x, True, mode)
    _plain_grads(tl, q, x, True, mode, deferred)
