"""One plan codec and one set of rules.

``PlanBatch`` holds many plans as a struct of numpy arrays (one column per Plan field, names and device/wrapper
orders as indices into tuples the batch carries), so that the cost model evaluates a million plans at once.
``encode`` (Plans -> batch), ``batch_of`` (columns -> batch, what search builds) and ``decode`` (row -> Plan) are the
only places a Plan is turned into columns or back; resolved defaults (sequence parallel on when tp > 1, reshard
after forward off with PP, dtype bytes, whether AC wraps compile) are derived here, once.

``RULES`` are the structural rules a plan must satisfy, vectorized: ``invalid_reasons(b, spec)`` gives each row the
key of the first rule it breaks (``""`` when none). ``Plan`` validation raises ``RuleError`` with that key and a
message that shows the arithmetic; search prunes with the same function and counts the same keys (tested: the plans
search prunes are exactly the plans ``Plan`` refuses, for the same reason).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ParsimError
from .plan import AC_MODES, AXES, PP_SCHEDULES, ranks_per_node, world_size_message
from .plan_schema import DTYPES, PLAN_FIELDS, EpFrom, GradSync, PlanField, RafMode, parse_ac
from .units import DTYPE_BYTES

if TYPE_CHECKING:
    from .plan import Plan
    from .spec import ModelSpec

SCHED_NAMES = {v: k for k, v in PP_SCHEDULES.items()}
AC_NAMES = {v: k for k, v in AC_MODES.items()}
GROUPS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "fsdp", "ep", "efsdp", "edp")
# how a collective is named when several axes' groups hold the same ranks (e.g. the expert-FSDP group equal to the
# dp_shard group when EP takes exactly cp x tp): the first of these whose rank set it is; an all-to-all is EP's
# whenever EP is among them. The executor's counter and the model's ``canonical_axes`` apply it alike.
AXIS_PRIORITY = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp_shard+cp", "efsdp", "edp", "ep")


def _columns() -> tuple[tuple[str, bool], ...]:
    """(column, is bool) of every schema field: ints and bools as they are, a choice as the index of its value in
    the field's choices, sequence parallel resolved, AC as its mode code and period (``ac``, ``ac_every``), the
    device and wrapper orders as indices into the orders the batch carries (``mesh_idx``, ``wrapper_idx``)."""
    out: list[tuple[str, bool]] = []
    for f in PLAN_FIELDS:
        out += [("ac", False), ("ac_every", False)] if f.kind == "ac" else [
            (f.column, f.kind in ("bool", "optional_bool"))]
    return tuple(out)


COLUMNS = _columns()
_BOOL_COLS = frozenset(c for c, is_bool in COLUMNS if is_bool)
COLUMN_NAMES = tuple(c for c, _ in COLUMNS)


def _batch_columns(cls):
    """``cls`` as a dataclass with one array per ``COLUMNS`` entry, then the orders and ranks per node."""
    shared = {k: cls.__annotations__[k] for k in _SHARED}
    cls.__annotations__ = {**{c: np.ndarray for c in COLUMN_NAMES}, **shared}
    return dataclass(cls)


_SHARED = ("mesh_orders", "wrapper_orders", "rpn")


@_batch_columns
class PlanBatch:
    """Many plans as one numpy array per ``COLUMNS`` entry (named after the schema's fields)."""

    if TYPE_CHECKING:  # the columns come from the schema (``_batch_columns``)
        def __init__(self, **columns: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...

    mesh_orders: tuple = (AXES,)
    wrapper_orders: tuple = ()
    rpn: dict | None = None  # group name -> ranks of that group per node (None: no node size given)

    def __len__(self) -> int:
        return len(self.pp)

    def take(self, idx) -> PlanBatch:
        kw = {c: getattr(self, c)[idx] for c in COLUMN_NAMES}
        rpn = None if self.rpn is None else {k: v[idx] for k, v in self.rpn.items()}
        return PlanBatch(mesh_orders=self.mesh_orders, wrapper_orders=self.wrapper_orders, rpn=rpn, **kw)

    # ---- resolved and derived columns (computed on first use; the columns are not changed after construction) ----
    @cached_property
    def raf(self):
        """reshard_after_forward in effect: default = on without PP, off with PP (torchtitan)."""
        mode = self.fsdp_reshard_after_forward
        return np.where(mode == RafMode.DEFAULT, self.pp == 1, mode == RafMode.ALWAYS)

    @cached_property
    def raf_always(self):
        """'always' reshards the output layer too (torchtitan's default keeps the last unit gathered)."""
        return self.fsdp_reshard_after_forward == RafMode.ALWAYS

    @cached_property
    def ep_ddp(self):
        """EP borrowed from dp_replicate (Megatron DDP + EP) instead of dp_shard x cp x tp (torchtitan dp2ep)."""
        return self.ep_from == EpFrom.DP_REPLICATE

    @cached_property
    def ep_folded(self):
        """Megatron-Core MoE parallel folding: the expert mesh (edp, ep, etp) laid over the dense mesh's
        dp_replicate x cp x tp ranks of a pipeline stage (etp innermost), so EP may outnumber the data-parallel
        ranks; dp_shard is 1 (Megatron DDP, optionally with its distributed optimizer)."""
        return self.ep_from == EpFrom.FOLDED

    @cached_property
    def ep_megatron(self):
        """Megatron-style EP (DDP-style or folded): routed experts are not FSDP-sharded; their gradients are reduced
        over the expert-data-parallel group ``edp`` (reduce-scattered under the distributed optimizer)."""
        return (self.ep > 1) & (self.ep_ddp | self.ep_folded)

    @cached_property
    def edp(self):
        """Expert-data-parallel degree of Megatron-style EP: ranks of a stage holding the same experts, the
        stage's dp_replicate x cp x tp ranks over ep x etp (DDP-style: dp_replicate over ep, cp and tp outside)."""
        ep = np.maximum(self.ep, 1)
        folded = self.dp_replicate * self.cp * self.tp // (ep * np.maximum(self.etp, 1))
        return np.maximum(1, np.where(self.ep_folded, folded, self.dp_replicate // ep))

    @cached_property
    def ac_wraps_compile(self):
        """AC applied after compile (AC(compile(block))): the recompute is counted twice."""
        wraps = np.array([o.index("ac") > o.index("compile") for o in self.wrapper_orders] or [False])
        return wraps[self.wrapper_idx]

    @cached_property
    def param_bytes(self):
        return _DTYPE_BYTES[self.param_dtype]

    @cached_property
    def reduce_bytes(self):
        return _DTYPE_BYTES[self.reduce_dtype]

    @cached_property
    def zero1(self):
        """The distributed optimizer in effect: asked for and with dp_replicate ranks to shard the state over."""
        return self.distributed_optimizer & (self.dp_replicate > 1)

    @cached_property
    def dp(self):
        return self.dp_replicate * self.dp_shard

    @cached_property
    def n_micro(self):
        return self.local_batch_size // self.micro_batch_size

    @cached_property
    def grad_accum(self):
        return self.global_batch_size // (self.local_batch_size * self.dp)

    @cached_property
    def reduce_passes(self):
        """Passes of a step after which data-parallel gradients are reduced: every one, or the last alone
        (``grad_sync`` once)."""
        return np.where(self.grad_sync == GradSync.ONCE, 1, self.grad_accum)

    @cached_property
    def sync_once(self):
        """Gradients accumulated unsharded over the passes of a step and reduced in the last (grad_sync once with
        gradient accumulation and data-parallel ranks to reduce over)."""
        return (self.reduce_passes < self.grad_accum) & self.fsdp_applied

    @cached_property
    def fsdp(self):
        """Degree of the FSDP group of non-expert parameters (torchtitan shards over dp_shard x cp)."""
        return self.dp_shard * self.cp

    @cached_property
    def etp_eff(self):
        """Expert tensor-parallel degree in effect: without EP, torchtitan TP-shards the experts like any MLP."""
        return np.where(self.ep == 1, self.tp, self.etp)

    @cached_property
    def efsdp(self):
        """FSDP degree of the routed experts: with their block when ep == 1, else what dp2ep leaves."""
        tt = self.dp_shard * self.cp * self.tp // (self.ep * self.etp)
        return np.where((self.ep > 1) & self.ep_folded, 1,
                        np.where((self.ep == 1) | self.ep_ddp, self.dp_shard * self.cp, tt))

    @cached_property
    def world(self):
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @cached_property
    def fsdp_applied(self):
        """Per plan, whether FSDP2 wraps the model (``Plan.fsdp_applied``)."""
        return self.dp_replicate * self.dp_shard * self.cp > 1


_DTYPE_BYTES = np.array([DTYPE_BYTES[d] for d in DTYPES], dtype=np.int64)


def encode_field(f: PlanField, value) -> dict:
    """One field's batch columns (orders excepted: their index depends on the batch)."""
    if f.kind == "choice":
        return {f.column: f.choices.index(value)}
    if f.kind == "ac":
        mode, every = parse_ac(value)
        return {"ac": AC_MODES[mode], "ac_every": every}
    return {f.column: value}


# columns a caller may leave out: the encoded default of their field (not the batch sizes whose default 0 is
# resolved per plan, nor the orders: their index is the batch's)
_DEFAULT_COLS = {c: v for f in PLAN_FIELDS if f.kind != "order" and not (f.kind == "int" and f.default == 0)
                 for c, v in encode_field(f, f.default).items()} | {"mesh_idx": 0, "wrapper_idx": 0}


def batch_of(cols: dict, mesh_orders: tuple, wrapper_orders: tuple, gpus_per_node: int | None) -> PlanBatch:
    """A batch from its columns (arrays or scalars broadcast to the batch length; a column left out takes its
        field's default, the batch sizes excepted); ``sequence_parallel`` None is the default (on when tp > 1). Ranks
    per node of every group are computed per device order when the node size is given."""
    sizes = [np.size(v) for v in cols.values() if v is not None and np.ndim(v) > 0]
    n = max(sizes) if sizes else 1
    kw: dict[str, Any] = {}
    for name in COLUMN_NAMES:
        v = cols[name] if name in cols or name not in _DEFAULT_COLS else _DEFAULT_COLS[name]
        if name == "sequence_parallel" and v is None:
            v = np.asarray(cols.get("tp", 1)) > 1
        kw[name] = np.broadcast_to(np.asarray(v, dtype=bool if name in _BOOL_COLS else np.int64), (n,))
    kw["sequence_parallel"] = kw["sequence_parallel"] & (kw["tp"] > 1)
    b = PlanBatch(mesh_orders=tuple(mesh_orders), wrapper_orders=tuple(wrapper_orders), **kw)
    if gpus_per_node is not None:
        b.rpn = _rpn(b, gpus_per_node)
    return b


def _rpn(b: PlanBatch, gpus_per_node: int) -> dict:
    out = {k: np.ones(len(b), dtype=np.int64) for k in GROUPS}
    for m in np.unique(b.mesh_idx):
        idx = np.nonzero(b.mesh_idx == m)[0]
        for k, v in group_rpn(b.take(idx), b.mesh_orders[int(m)], gpus_per_node).items():
            out[k][idx] = v
    return out


def _fields(p: Plan) -> dict:
    """The batch columns of one plan (orders as index 0 of single-entry tuples)."""
    out: dict = {"mesh_idx": 0, "wrapper_idx": 0}
    for f in PLAN_FIELDS:
        if f.kind != "order":
            out.update(encode_field(f, getattr(p, f.name)))
    out["sequence_parallel"] = bool(p.sequence_parallel) and p.tp > 1
    return out


def encode(plans: list[Plan], gpus_per_node: int | None) -> PlanBatch:
    """Plans -> batch (one row per plan, in order)."""
    meshes = list(dict.fromkeys(p.mesh_order for p in plans))
    wrappers = list(dict.fromkeys(p.wrapper_order for p in plans))
    rows = [_fields(p) for p in plans]
    cols = {k: [r[k] for r in rows] for k in COLUMN_NAMES}
    cols["mesh_idx"] = [meshes.index(p.mesh_order) for p in plans]
    cols["wrapper_idx"] = [wrappers.index(p.wrapper_order) for p in plans]
    return batch_of(cols, tuple(meshes), tuple(wrappers), gpus_per_node)


def _row(p: Plan) -> PlanBatch:
    """One plan as a batch of numpy scalars (what ``encode`` gives for one plan, without its array overhead: a
    Plan checks its rules on construction)."""
    kw: dict[str, Any] = {k: (np.bool_ if k in _BOOL_COLS else np.int64)(v) for k, v in _fields(p).items()}
    return PlanBatch(mesh_orders=(p.mesh_order,), wrapper_orders=(p.wrapper_order,), **kw)


def plan_kwargs(b: PlanBatch, i: int) -> dict:
    """The Plan fields of row ``i`` (unvalidated: ``Plan(**plan_kwargs(b, i))`` checks them)."""
    out = {}
    for f in PLAN_FIELDS:
        v = getattr(b, f.column)[i].item()
        if f.kind == "choice":
            v = f.choices[v]
        elif f.kind == "ac":
            v = AC_NAMES[v] if AC_NAMES[v] != "layer" else f"layer:{b.ac_every[i].item()}"
        elif f.kind == "order":
            v = (b.mesh_orders if f.name == "mesh_order" else b.wrapper_orders)[v]
        out[f.name] = v
    return out


def names(b: PlanBatch) -> dict[str, np.ndarray]:
    """The named Plan fields of every row as string arrays (what a CSV or a table shows), vectorized."""
    ac = np.array([AC_NAMES.get(k, "") for k in range(max(AC_NAMES) + 1)], dtype=object)[b.ac]
    ac = np.where(ac == "layer", "layer:" + b.ac_every.astype(str).astype(object), ac)
    out = {f.name: np.array(f.choices)[getattr(b, f.column)] for f in PLAN_FIELDS if f.kind == "choice"}
    return {**out, "ac": ac.astype(str),
            "mesh_order": np.array([",".join(o) for o in b.mesh_orders])[b.mesh_idx],
            "wrapper_order": np.array([",".join(o) for o in b.wrapper_orders] or [""])[b.wrapper_idx]}


def decode(b: PlanBatch, i: int) -> Plan:
    from .plan import Plan

    return Plan(**plan_kwargs(b, i))


def group_rpn(b: PlanBatch, order: tuple[str, ...], gpus_per_node: int) -> dict:
    """Ranks per node of every communication group, for plans that share one device order.

    EP groups (torchtitan dp2ep) take the innermost ``ep`` ranks of the flattened dp_shard x cp (x tp when etp = 1)
    block, and the expert-FSDP group the rest; DDP-style EP takes the innermost ranks of dp_replicate."""
    deg = {a: getattr(b, a) for a in AXES}
    out = {a: ranks_per_node(deg, order, gpus_per_node, (a,)) for a in AXES}
    out["fsdp"] = ranks_per_node(deg, order, gpus_per_node, ("dp_shard", "cp"))
    block = np.where(b.etp == 1, ranks_per_node(deg, order, gpus_per_node, ("dp_shard", "cp", "tp")), out["fsdp"])
    ep_tt = np.minimum(b.ep, block)
    efsdp_tt = np.maximum(1, block // np.maximum(b.ep, 1))
    # folded (Megatron): the stage's dp_replicate x cp x tp ranks as one block, etp innermost, then ep, then edp
    fold = ranks_per_node(deg, order, gpus_per_node, ("dp_replicate", "cp", "tp"))
    etp = np.maximum(b.etp, 1)
    ep_fold = np.minimum(b.ep, np.maximum(1, fold // etp))
    edp_fold = np.minimum(b.edp, np.maximum(1, fold // (etp * np.maximum(b.ep, 1))))
    out["ep"] = np.where(b.ep_folded, ep_fold, np.where(b.ep_ddp, np.minimum(b.ep, out["dp_replicate"]), ep_tt))
    out["efsdp"] = np.where(b.ep_folded, 1, np.where(b.ep_ddp, out["fsdp"], efsdp_tt))
    out["edp"] = np.where(b.ep_folded, edp_fold, np.maximum(1, out["dp_replicate"] // np.maximum(b.ep, 1)))
    return out


# ---- rules ------------------------------------------------------------------------------------------------------


# the rule DDP-style EP is the way around (flags pick it when the user did not choose where EP comes from)
DP2EP_RULE = "dp_shard x cp x tp not divisible by ep x etp"
# torchtitan's dp2ep borrows *all* of cp (and of tp when etp = 1) for EP and the rest from dp_shard
# (ParallelDims: "EP would borrow all cp and tp and some dp_shard degree"); the executor builds its EP mesh the same way
DP2EP_BORROW_RULE = "ep not a multiple of cp x tp (etp 1) / cp (etp tp)"
DP2EP_RULES = (DP2EP_RULE, DP2EP_BORROW_RULE)
# Megatron-Core MoE parallel folding: the expert mesh (edp, ep, etp) over dp_replicate x cp x tp, without FSDP
FOLDED_RULE = "dp_replicate x cp x tp not divisible by ep x etp (folded EP)"
FOLDED_DP_SHARD_RULE = "folded EP with dp_shard > 1"


class RuleError(ParsimError):
    """A plan that breaks a structural rule; ``rule`` is the key search counts its pruned plans under."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


@dataclass(frozen=True)
class Rule:
    key: str  # short reason, the same in search's pruning counters and in Plan's refusal
    needs_spec: bool
    broken: Callable  # (PlanBatch, ModelSpec | None) -> bool array
    message: Callable  # (Plan, ModelSpec | None) -> one line with the arithmetic


def _uses_ep(b):
    return (b.ep > 1) | (b.etp > 1)


def _kv(spec):
    return spec.n_heads if spec.mla else spec.n_kv_heads


def _tp_msg(p, s):
    what, n = next((w, n) for w, n in (("n_heads", s.n_heads), ("n_kv_heads", _kv(s)), ("d_ff", s.d_ff)) if n % p.tp)
    return f"{s.name}: {what} {n} is not divisible by tp {p.tp} ({n} % {p.tp} = {n % p.tp})"


RULES: tuple[Rule, ...] = (
    Rule("global batch not a multiple of local batch x dp", False,
         lambda b, s: b.global_batch_size % (b.local_batch_size * b.dp) != 0,
         lambda p, s: f"global batch {p.global_batch_size} is not a multiple of local batch x dp = "
                      f"{p.local_batch_size} x {p.dp} = {p.local_batch_size * p.dp} "
                      f"({p.global_batch_size} % {p.local_batch_size * p.dp} = "
                      f"{p.global_batch_size % (p.local_batch_size * p.dp)})"),
    Rule("local batch not a multiple of micro batch", False,
         lambda b, s: b.local_batch_size % b.micro_batch_size != 0,
         lambda p, s: f"local batch {p.local_batch_size} is not a multiple of micro batch {p.micro_batch_size}"),
    Rule("micro batch != local batch without PP", False,
         lambda b, s: (b.pp == 1) & (b.micro_batch_size != b.local_batch_size),
         lambda p, s: f"micro batch {p.micro_batch_size} != local batch {p.local_batch_size} without PP; use global "
                      "batch for gradient accumulation"),
    # torch's pipeline schedules reduce the stage's gradients at the end of every step() (perform_reduce_grad): a
    # pass cannot leave them unreduced for the next [torch 2.13 pipelining/schedules.py]
    Rule("gradients reduced once across pipeline passes", False,
         lambda b, s: (b.reduce_passes < b.grad_accum) & (b.pp > 1),
         lambda p, s: f"grad_sync once with PP and {p.grad_accum_steps} gradient-accumulation passes: torch's "
                      "pipeline schedules reduce after every pass; put the microbatches in one pass (local batch "
                      f"{p.global_batch_size // p.dp} = global batch / dp)"),
    Rule("Interleaved1F1B with one stage per rank", False,
         lambda b, s: (b.pp_schedule == PP_SCHEDULES["Interleaved1F1B"]) & (b.pp > 1) & (b.pp_stages_per_rank < 2),
         lambda p, s: "Interleaved1F1B needs pp_stages_per_rank >= 2"),
    Rule("several stages per rank without an interleaved schedule", False,
         lambda b, s: (b.pp_schedule != PP_SCHEDULES["Interleaved1F1B"]) & (b.pp_stages_per_rank != 1),
         lambda p, s: f"{p.pp_schedule} runs one stage per rank, got pp_stages_per_rank={p.pp_stages_per_rank}"),
    Rule("several stages per rank without PP", False,
         lambda b, s: (b.pp == 1) & (b.pp_stages_per_rank != 1),
         lambda p, s: f"pp_stages_per_rank={p.pp_stages_per_rank} needs pp > 1"),
    Rule("fewer microbatches than stages", False,
         lambda b, s: (b.pp > 1) & (b.pp_schedule != PP_SCHEDULES["GPipe"]) & (b.n_micro < b.pp),
         lambda p, s: f"{p.pp_schedule} needs at least pp={p.pp} microbatches, got local batch / micro batch = "
                      f"{p.local_batch_size} / {p.micro_batch_size} = {p.n_microbatches}"),
    # torch's ScheduleInterleaved1F1B runs max(1, m // pp) rounds of equal size and raises otherwise
    # (Megatron's interleaved schedule also wants m a multiple of pp)
    Rule("Interleaved1F1B microbatches not in equal rounds", False,
         lambda b, s: (b.pp > 1) & (b.pp_schedule == PP_SCHEDULES["Interleaved1F1B"])
         & (b.n_micro % np.maximum(1, b.n_micro // np.maximum(b.pp, 1)) != 0),
         lambda p, s: f"Interleaved1F1B runs {max(1, p.n_microbatches // p.pp)} rounds of microbatches: "
                      f"{p.n_microbatches} microbatches are not a multiple of that (torch raises)"),
    Rule("seq_len not divisible by 2 x cp", False,
         lambda b, s: (b.cp > 1) & (b.seq_len % (2 * b.cp) != 0),
         lambda p, s: f"seq_len {p.seq_len} is not divisible by 2 x cp = {2 * p.cp} (CP load balancing)"),
    Rule("seq_len / cp not divisible by tp (sequence parallel)", False,
         lambda b, s: b.sequence_parallel & ((b.seq_len // b.cp) % b.tp != 0),
         lambda p, s: f"sequence parallel needs seq_len / cp = {p.seq_len // p.cp} divisible by tp = {p.tp}"),
    Rule("etp neither 1 nor tp", False,
         lambda b, s: _uses_ep(b) & (b.etp != 1) & (b.etp != b.tp),
         lambda p, s: f"etp must be 1 or tp={p.tp}, got {p.etp}"),
    Rule(DP2EP_RULE, False,
         lambda b, s: _uses_ep(b) & ~b.ep_megatron & ((b.dp_shard * b.cp * b.tp) % (b.ep * b.etp) != 0),
         lambda p, s: f"dp2ep needs dp_shard x cp x tp = {p.dp_shard} x {p.cp} x {p.tp} = "
                      f"{p.dp_shard * p.cp * p.tp} divisible by ep x etp = {p.ep} x {p.etp} = {p.ep * p.etp}"),
    Rule(DP2EP_BORROW_RULE, False,
         lambda b, s: (b.ep > 1) & ~b.ep_megatron & (b.ep % (b.cp * np.where(b.etp == 1, b.tp, 1)) != 0),
         lambda p, s: f"dp2ep borrows all of cp{' x tp' if p.etp == 1 else ''} for EP: ep {p.ep} is not a multiple "
                      f"of {p.cp * (p.tp if p.etp == 1 else 1)}"),
    Rule("dp_replicate not divisible by ep (DDP-style EP)", False,
         lambda b, s: _uses_ep(b) & b.ep_ddp & (b.dp_replicate % b.ep != 0),
         lambda p, s: f"DDP-style EP needs dp_replicate {p.dp_replicate} divisible by ep {p.ep} (ep_from folded "
                      "lays EP over dp_replicate x cp x tp)"),
    Rule(FOLDED_DP_SHARD_RULE, False, lambda b, s: _uses_ep(b) & b.ep_folded & (b.dp_shard != 1),
         lambda p, s: f"folded EP is Megatron's (DDP, no FSDP): dp_shard must be 1, got {p.dp_shard}"),
    Rule(FOLDED_RULE, False,
         lambda b, s: _uses_ep(b) & b.ep_folded & ((b.dp_replicate * b.cp * b.tp) % (b.ep * b.etp) != 0),
         lambda p, s: f"folded EP needs dp_replicate x cp x tp = {p.dp_replicate} x {p.cp} x {p.tp} = "
                      f"{p.dp_replicate * p.cp * p.tp} divisible by ep x etp = {p.ep} x {p.etp} = {p.ep * p.etp}"),
    Rule("tp does not divide heads / kv heads / d_ff", True,
         lambda b, s: (s.n_heads % b.tp != 0) | (_kv(s) % b.tp != 0) | (s.d_ff % b.tp != 0), _tp_msg),
    Rule("more pipeline stages than layers", True,
         lambda b, s: b.pp * b.pp_stages_per_rank > s.n_layers,
         lambda p, s: f"{s.name}: {s.n_layers} layers cannot fill pp x stages per rank = {p.pp} x "
                      f"{p.pp_stages_per_rank} = {p.pp * p.pp_stages_per_rank} stages"),
    Rule("expert parallelism on a dense model", True,
         lambda b, s: _uses_ep(b) & (s.moe is None),
         lambda p, s: f"{s.name} is dense: ep/etp > 1 needs a MoE model"),
    Rule("experts do not divide over ep", True,
         lambda b, s: _uses_ep(b) & (s.moe is not None) & ((s.moe.n_experts if s.moe else 1) % b.ep != 0),
         lambda p, s: f"{s.name}: {s.moe.n_experts} experts do not divide over ep {p.ep} "
                      f"({s.moe.n_experts} % {p.ep} = {s.moe.n_experts % p.ep})"),
    # the experts' TP degree is etp with EP and tp without (torchtitan TP-shards whole experts then, as any MLP):
    # DTensor shards an indivisible width unevenly and the grouped matmuls' shapes no longer agree (trace: d_ff_expert
    # 128 over tp 3 with ep 1)
    Rule("expert width not divisible by etp", True,
         lambda b, s: (s.moe is not None) & ((s.moe.d_ff_expert if s.moe else 1) % b.etp_eff != 0),
         lambda p, s: f"{s.name}: expert width {s.moe.d_ff_expert} not divisible by the experts' TP degree "
                      f"{p.etp if p.ep > 1 else p.tp} ({'etp' if p.ep > 1 else 'tp, without EP'})"),
)


# the rules that read only the batch split (global, local and micro batch, schedule, stages per rank), pp and dp:
# the first of RULES, so that a row's first broken rule is one of them whenever it breaks one (search checks them
# once per (pp, dp) key of its batch-split tables, ``search.candidate_chunks``)
SPLIT_RULES = RULES[:9]
# the others read only the degrees, the stages per rank, the sequence length, the options a search pins and the
# model: search checks them once per (degree combination, stages per rank) (``search._combo_legal``)
COMBO_RULES = RULES[len(SPLIT_RULES):]


def invalid_reasons(b: PlanBatch, spec: ModelSpec | None = None, rules: tuple[Rule, ...] = RULES) -> np.ndarray:
    """Key of the first of ``rules`` each row breaks, ``""`` where none (rules needing a model are skipped without
    one)."""
    if np.ndim(b.pp) == 0:  # one plan as scalars (``_row``): plain truth values, no array overhead
        active = [r for r in rules if spec is not None or not r.needs_spec]
        return np.array([next((r.key for r in active if r.broken(b, spec)), "")], dtype=object)
    keys = np.array([r.key for r in rules] + [""], dtype=object)
    return keys[first_broken(b, spec, rules)]


def first_broken(b: PlanBatch, spec: ModelSpec | None = None, rules: tuple[Rule, ...] = RULES) -> np.ndarray:
    """Per row the index in ``rules`` of the first rule it breaks, ``len(rules)`` where none (rules needing a model
    are skipped without one)."""
    out = np.full(len(b), len(rules), dtype=np.int64)
    open_ = np.ones(len(b), dtype=bool)
    for i, rule in enumerate(rules):
        if rule.needs_spec and spec is None:
            continue
        hit = open_ & np.broadcast_to(np.asarray(rule.broken(b, spec), dtype=bool), (len(b),))
        out[hit] = i
        open_ &= ~hit
    return out


def validate_plan(plan: Plan, spec: ModelSpec | None = None, n_gpus: int | None = None) -> None:
    """The one check of a plan's structure, at the boundary (a plan built from flags or read from a file, a run, a
    prediction): its world size against ``n_gpus`` and every rule of ``RULES`` (the model's when ``spec`` is
    given): one ParsimError (``RuleError``) line for the first one broken. ``Plan`` itself checks only its fields'
    types and ranges: a plain value, as search's rows and the rules' own tests build it."""
    if n_gpus is not None and plan.world_size != n_gpus:
        raise ParsimError(world_size_message(plan, n_gpus))
    check_rules(plan, spec)


def check_rules(plan: Plan, spec: ModelSpec | None = None) -> None:
    """Raise RuleError for the first rule ``plan`` breaks (the model's rules only when ``spec`` is given)."""
    key = invalid_reasons(_row(plan), spec)[0]
    if key:
        raise RuleError(key, next(r for r in RULES if r.key == key).message(plan, spec))


# ---- what the executor runs -------------------------------------------------------------------------------------
# Plans the cost model ranks but the executor (`parsim run` / `parsim trace`) cannot run, one rule per class, with
# the reason. The executor refuses them with these messages before touching a process group
# (``parsim.executor.parallelize.check_executable``), search marks them (``executable`` column, ``--executable``
# keeps only the others) and the differential tester counts them as refusals, not failures.
def _cost_model_only(f: PlanField) -> Rule:
    """The executor rule of a schema option it does not run (``executor_refusal``): refused when not at its
    default."""
    default = encode_field(f, f.default)[f.column]
    return Rule(f"{f.name}: cost model only", False, lambda b, s: getattr(b, f.column) != default,
                lambda p, s: f.executor_refusal)


EXECUTOR_RULES: tuple[Rule, ...] = (
    *(_cost_model_only(f) for f in PLAN_FIELDS if f.executor_refusal),
    Rule("fused loss under TP", False, lambda b, s: b.fused_loss & (b.tp > 1),
         lambda p, s: "the executor's fused cross-entropy runs on whole-vocabulary logits (tp 1); with TP the cost "
                      "model alone covers it (a vocab-parallel fused loss)"),
    Rule("distributed optimizer", False, lambda b, s: b.zero1,
         lambda p, s: "distributed_optimizer (Megatron's ZeRO-1 over dp_replicate) is a cost-model option: the "
                      "executor has no distributed optimizer"),
    Rule("DDP-style EP", False, lambda b, s: b.ep_megatron,
         lambda p, s: f"the executor runs dp2ep (EP borrowed from dp_shard x cp x tp); Megatron-style EP (ep_from "
                      f"{p.ep_from}) is a cost-model option"),
    Rule("expert tensor parallel with EP", False, lambda b, s: (b.ep > 1) & (b.etp > 1),
         lambda p, s: "the executor runs EP with etp = 1 (torchtitan's composition); expert tensor parallel with EP "
                      "(etp = tp) is a cost-model option"),
    Rule("async TP", False, lambda b, s: b.async_tp & (b.tp > 1),
         lambda p, s: "async TP (micro-pipelined TP over symmetric memory) needs CUDA: a cost-model option here"),
    Rule("float8", False, lambda b, s: b.float8,
         lambda p, s: "float8 training (torchao's float8 linears) needs CUDA's scaled matmul: the executor runs it "
                      "on CUDA without TP and with the tensorwise recipe (executor.float8); a cost-model option "
                      "here"),
    Rule("compile over full AC under TP", False,
         lambda b, s: b.compile & (b.tp > 1) & ~b.ac_wraps_compile
         & ((b.ac == AC_MODES["full"]) | (b.ac == AC_MODES["layer"])),
         lambda p, s: "torch 2.13 does not compile a checkpointed TP block: AOTAutograd saves the TP DeviceMesh with "
                      "the block's tensors and fails (\"expected all tensors_saved_with_vc_check to be Tensors\"); "
                      "selective-op AC, AC wrapping compile (wrapper order ..., compile, ac, ...) and no AC run; a "
                      "cost-model option here"),
    Rule("core-attn under CP", False, lambda b, s: (b.ac == AC_MODES["core-attn"]) & (b.cp > 1),
         lambda p, s: "core-attn AC under CP would recompute torch's ring attention, whose recompute's memory no "
                      "trace has checked: a cost-model option here"),
    Rule("MLA under TP or CP", True, lambda b, s: ((b.tp > 1) | (b.cp > 1)) & (s.mla is not None),
         lambda p, s: f"{s.name}: the executor runs multi-head latent attention without TP and CP only (TP would "
                      "keep the latent down-projections replicated, whose partial gradients no trace has checked; "
                      "its fused attention op is not torch's ring attention): a cost-model option here"),
    Rule("learned positions", True, lambda b, s: np.full(np.shape(b.pp), s.max_position_embeddings > 0),
         lambda p, s: f"{s.name}: the executor has no learned position embeddings"),
    Rule("tied embeddings", True, lambda b, s: np.full(np.shape(b.pp), s.tie_embeddings),
         lambda p, s: f"{s.name}: the executor does not tie the output projection to the embedding"),
)


def executor_refusals(b: PlanBatch, spec: ModelSpec | None = None) -> np.ndarray:
    """Key of the first executor rule each row breaks, ``""`` where the executor runs it."""
    n = 1 if np.ndim(b.pp) == 0 else len(b)
    out = np.full(n, "", dtype=object)
    open_ = np.ones(n, dtype=bool)
    for rule in EXECUTOR_RULES:
        if rule.needs_spec and spec is None:
            continue
        hit = open_ & np.broadcast_to(np.asarray(rule.broken(b, spec), dtype=bool), (n,))
        out[hit] = rule.key
        open_ &= ~hit
    return out


def executor_refusal(plan: Plan, spec: ModelSpec | None = None) -> str:
    """``"<rule>: <reason>"`` when the executor cannot run ``plan``, else ``""``."""
    key = executor_refusals(_row(plan), spec)[0]
    if not key:
        return ""
    return f"{key}: {next(r for r in EXECUTOR_RULES if r.key == key).message(plan, spec)}"


def _rank_sets(p: Plan, rank: int) -> dict[str, frozenset]:
    """The ranks of ``rank``'s group on every axis and derived group of ``p`` (ranks row-major over the device
    order; EP groups as ``parallelize.Meshes`` builds them)."""
    shape = tuple(getattr(p, a) for a in p.mesh_order)
    grid = np.arange(p.world_size).reshape(shape).transpose([p.mesh_order.index(a) for a in AXES])
    coord = [int(c[0]) for c in np.nonzero(grid == rank)]

    def vary(axes_: tuple[str, ...], g=grid) -> frozenset:
        idx = tuple(slice(None) if a in axes_ else coord[i] for i, a in enumerate(AXES))
        return frozenset(int(x) for x in np.asarray(g[idx]).ravel())

    out = {a: vary((a,)) for a in AXES}
    out["dp_shard+cp"] = vary(("dp_shard", "cp"))
    if p.ep > 1 and p.ep_from == "dp_shard":
        block = grid.reshape(p.pp, p.dp_replicate, -1)[coord[0], coord[1]]  # (dp_shard x cp x tp) of this rank
        pos = int(np.nonzero(block == rank)[0][0])
        two = block.reshape(-1, p.ep)  # (efsdp, ep) as Meshes builds it
        out["ep"] = frozenset(int(x) for x in two[pos // p.ep])
        out["efsdp"] = frozenset(int(x) for x in two[:, pos % p.ep])
    elif p.ep > 1 and p.ep_from == "folded":  # Megatron: (edp, ep, etp) over the stage's dp_replicate x cp x tp
        block = grid[coord[0], :, coord[2]].reshape(-1)  # dp_replicate x cp x tp of this rank, tp fastest
        three = block.reshape(-1, p.ep, p.etp)
        e, j, k = (int(x[0]) for x in np.nonzero(three == rank))
        out["ep"] = frozenset(int(x) for x in three[e, :, k])
        out["edp"] = frozenset(int(x) for x in three[:, j, k])
    elif p.ep > 1:  # DDP-style: EP the innermost ep ranks of dp_replicate, expert data parallel the rest
        dpr = vary(("dp_replicate",))
        ordered = sorted(dpr)
        i = ordered.index(rank)
        out["ep"] = frozenset(ordered[i // p.ep * p.ep:(i // p.ep + 1) * p.ep])
        out["edp"] = frozenset(ordered[i % p.ep::p.ep])
    return out


def canonical_axes(p: Plan, rank: int = 0) -> dict[str, str]:
    """Logical axis -> the name its collectives carry (``AXIS_PRIORITY``): the first axis whose group on ``rank``
    holds the same ranks. For the ``comm_bytes`` keys of a prediction, matching the executor's counter."""
    sets = _rank_sets(p, rank)
    out = {}
    for a, ranks in sets.items():
        out[a] = next(b for b in AXIS_PRIORITY if sets.get(b) == ranks)
    return out


def canonical_key(key: str, names: dict[str, str]) -> str:
    """``"<op>/<axis>"`` with its axis renamed by ``canonical_axes``; an all-to-all is ``ep``'s wherever its group
    holds EP's ranks (the counter's rule: CP's ring permutes over a cp group that is also the EP group)."""
    op, axis = key.split("/", 1)
    if op == "all_to_all" and (axis == "ep" or ("ep" in names and names.get(axis, axis) == names["ep"])):
        return f"{op}/ep"
    return f"{op}/{names.get(axis, axis)}"


def rank_sets_named(p: Plan, rank: int = 0) -> dict[frozenset, str]:
    """The ranks of each of ``rank``'s groups -> the axis name its collectives carry (``AXIS_PRIORITY``): what a
    traced collective's process-group ranks are matched against. Groups of one rank are left out."""
    sets = _rank_sets(p, rank)
    out: dict[frozenset, str] = {}
    for a in AXIS_PRIORITY:
        if a in sets and len(sets[a]) > 1:
            out.setdefault(sets[a], a)
    return out
