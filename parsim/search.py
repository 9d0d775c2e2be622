"""Exhaustive plan search: enumerate -> prune (structure, memory) -> rank by predicted step time.

The space for a model, a GPU count, a global batch and a sequence length is every factorization of the GPUs into
pp x dp_replicate x dp_shard x cp x tp (x ep/etp for MoE, dp2ep), every distinct device order (permutations of the
non-trivial axes, deduplicated by the ranks-per-node of every communication group: orders that put the same groups
inside nodes cost the same), every split of the global batch into local batch x gradient accumulation, micro
batches and PP schedules (GPipe, 1F1B, Interleaved1F1B with stages per rank), AC modes, compile, float8 (when the
GPU has it), FSDP reshard-after-forward, and the wrapper orders the ordering rules allow.

It is searched completely: structural "base rows" (degrees x device order x batch split) are built once, crossed
with the option table by index arithmetic, and evaluated by the vectorized cost model in chunks; only the top-k,
the Pareto front and the counters are kept.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from itertools import permutations
from typing import Any, NamedTuple

import numpy as np

from .codec import COMBO_RULES, SPLIT_RULES, PlanBatch, batch_of, decode, encode_field, first_broken, group_rpn
from .costmodel.step import evaluate, memory_lower_bound, optimizer_step_lower_bound, step_time_lower_bound
from .costmodel.work import counted, tally
from .errors import ParsimError, check_number
from .hardware import HardwareProfile
from .ordering import effective_rules, is_legal, searched_orders, violations
from .plan import (
    AC_MODES,
    AXES,
    DEFAULT_ORDER,
    EP_FROM,
    MAX_BATCH,
    MAX_GPUS,
    MAX_SEQ_LEN,
    PP_SCHEDULES,
    RAF_MODES,
    Plan,
    interval_factor,
)
from .plan_schema import FIELDS, PINNED, EpFrom, RafMode
from .spec import ModelSpec

AC_CHOICES = ("none", "selective-op", "full", "layer:2")
SCHED_NAMES = {v: k for k, v in PP_SCHEDULES.items()}


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def divisors(n: int) -> list[int]:
    """Divisors of n in ascending order (O(sqrt n))."""
    return list(_divisors(n))


RESHARD_CHOICES = ("default", "flip", "always", "never")  # flip: the non-default reshard_after_forward
# an exhaustive search (--csv, prune off) of a larger space is refused with its count (~2 min at the ~400k plans/s
# measured here): pin, or raise --max-plans; the pruned search has no default limit (deepseek-v3 on 2,048 GPUs,
# 577 M plans: 27 s here)
MAX_PLANS = 50_000_000


# [measured] the fraction of usable memory `parsim search` keeps free by default: the caching allocator reserved
# 2.1-6.1% more than parsim predicted in the five single-H100 runs of 2026-11-26 (llama3-8b, 2 layers, no AC / full
# / selective-op / layer:2 / compile; tests/data/gpu-acceptance-runs-2026-11-26.json): fragmentation beyond the
# modelled segments. A plan predicted at (1 - 0.06) of usable memory reserves at most ~0.997 of it at the largest
# excess seen. (The profile's memory_reserved_bytes, held back already, is the CUDA context, NCCL buffers and
# cuBLAS workspaces.)
CLI_HEADROOM = 0.06


@dataclass(frozen=True)
class SearchSpace:
    """Restrictions of the plan space. A tuple pins a dimension to those values; None leaves it free."""

    global_batch_size: int
    seq_len: int
    pp: tuple | None = None
    dp_replicate: tuple | None = None
    dp_shard: tuple | None = None
    cp: tuple | None = None
    tp: tuple | None = None
    ep: tuple | None = None
    etp: tuple | None = None
    max_tp: int | None = None
    max_pp: int | None = None
    max_cp: int | None = None
    local_batch_size: tuple | None = None
    micro_batch_size: tuple | None = None
    max_local_batch_size: int = 64
    pp_schedules: tuple = ("GPipe", "1F1B", "Interleaved1F1B")
    stages_per_rank: tuple = (2, 4)  # of Interleaved1F1B
    ac: tuple = AC_CHOICES
    compile: tuple = (False, True)
    float8: tuple | None = None  # None: (False, True) when the GPU has float8, else (False,)
    reshard: tuple = ("default", "flip")  # of RESHARD_CHOICES
    ep_from: tuple = EP_FROM  # where EP ranks are borrowed from: dp2ep (dp_shard) and/or DDP-style (dp_replicate)
    device_orders: bool = True  # False: only the default order (pp, dp_replicate, dp_shard, cp, tp)
    mesh_order: tuple | None = None  # one device order, pinned
    wrapper_orders: tuple | None = None  # wrapper orders, pinned (default: the legal ones searched_orders gives)
    headroom: float = 0.0  # fraction of usable memory kept free (the command line's default: CLI_HEADROOM)
    # (name, value) of the options search never enumerates (``plan_schema.PINNED``: sequence parallel, the float8
    # recipe, the cost-model-only options): set for every plan when the user gives them, else their default
    pins: tuple = ()
    max_plans: int | None = None  # 0: no limit; None: MAX_PLANS for an exhaustive search, none when pruned
    # skip what provably cannot be in the top list or on the Pareto front: options dominated by a kept one (AC
    # wrapping compile: the same memory, the recompute twice) and plans whose memory class does not fit
    prune: bool = True
    max_seconds: float | None = None  # stop after this long with the best of what was searched (None: no limit)

    def __post_init__(self):
        from .plan import parse_ac

        check_number("global batch", self.global_batch_size, 1, MAX_BATCH, integer=True)
        check_number("seq_len", self.seq_len, 1, MAX_SEQ_LEN, integer=True)
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp", "local_batch_size",
                     "micro_batch_size"):
            pins = getattr(self, name)
            if pins is not None:
                high = MAX_BATCH if name in ("local_batch_size", "micro_batch_size") else MAX_GPUS
                for v in pins:
                    check_number(f"pinned {name}", v, 1, high, integer=True)
        for name in ("max_tp", "max_pp", "max_cp"):
            if getattr(self, name) is not None:
                check_number("--" + name.replace("_", "-"), getattr(self, name), 1, MAX_GPUS, integer=True)
        check_number("max local batch", self.max_local_batch_size, 1, MAX_BATCH, integer=True)
        if self.max_plans is not None:
            check_number("max plans", self.max_plans, 0, 2**62, integer=True)
        if self.max_seconds is not None:
            check_number("--max-seconds", self.max_seconds, 0.0, 1e7, low_open=True)
        if not (isinstance(self.headroom, (int, float)) and math.isfinite(self.headroom)
                and 0.0 <= self.headroom < 1.0):
            raise ParsimError(f"headroom must be in [0, 1), got {self.headroom}")
        for a in self.ac:
            parse_ac(a)
        for s in self.pp_schedules:
            if s not in PP_SCHEDULES:
                raise ParsimError(f"unknown PP schedule {s!r}")
        for v in self.stages_per_rank:
            check_number("stages per rank", v, 1, 64, integer=True)
        for r in self.reshard:
            if r not in RESHARD_CHOICES:
                raise ParsimError(f"unknown reshard choice {r!r} (known: {', '.join(RESHARD_CHOICES)})")
        if self.mesh_order is not None and sorted(self.mesh_order) != sorted(AXES):
            raise ParsimError(f"mesh order {self.mesh_order} must be a permutation of {','.join(AXES)}")
        for order in self.wrapper_orders or ():
            if not is_legal(order):
                v = [r for r in violations(order, effective_rules()) if r.forbids][0]
                raise ParsimError(f"wrapper order {','.join(order)} puts {v.then} before {v.first}, which cannot "
                                  f"run: {v.reason}")
        if any(e not in EP_FROM for e in self.ep_from):
            raise ParsimError(f"ep_from must be among {', '.join(EP_FROM)}, got {self.ep_from}")
        pinnable = {f.name: f for f in PINNED}
        for name, value in self.pins:
            if name not in pinnable:
                raise ParsimError(f"{name} is not an option search pins (pinned: {', '.join(pinnable)})")
            pinnable[name].check(value)
        if not (self.ac and self.compile and self.pp_schedules and self.reshard and self.ep_from):
            raise ParsimError("a search dimension was pinned to nothing")


class RankedPlan(NamedTuple):
    """One plan of ``SearchResult.top`` (a tuple: ``plan, step, *_ = row`` still unpacks)."""

    plan: Any  # Plan
    step_time_s: float
    reserved_memory_bytes: float  # what must fit
    tokens_per_s_per_gpu: float
    mfu: float
    dominant: str  # the largest time component


class FrontPlan(NamedTuple):
    """One plan of ``SearchResult.pareto``: step time against reserved memory."""

    plan: Any  # Plan
    step_time_s: float
    reserved_memory_bytes: float


@dataclass
class SearchResult:
    considered: int = 0
    evaluated: int = 0
    fitting: int = 0
    pruned_structural: dict = field(default_factory=dict)  # reason -> degree combinations (or batch splits)
    pruned_memory: int = 0
    screened: int = 0  # (degrees x batch split x memory class) rows whose memory was computed before evaluation
    pruned_dominated: int = 0  # plans skipped as no faster and no smaller than a kept plan
    pruned_bound: int = 0  # fitting plans skipped: their step-time lower bound loses (not listed, not on the front)
    stopped_at: float | None = None  # fraction of the space searched when --max-seconds stopped the search
    # memory here is what must fit: the caching allocator's reserved memory (``reserved_memory_bytes``)
    top: list = field(default_factory=list)  # [RankedPlan], fastest first
    pareto: list = field(default_factory=list)  # [FrontPlan] time ascending, memory descending
    closest: tuple | None = None  # (Plan, reserved_memory_bytes) when nothing fits
    usable_memory_bytes: float = 0.0
    wall_s: float = 0.0
    # the work done (``work_of``): bounds computed, memory timelines replayed, plans evaluated in full
    work: dict = field(default_factory=dict)


def _allowed(values, pin, cap):
    out = [v for v in values if (pin is None or v in pin) and (cap is None or v <= cap)]
    return out


def _degree_combos(spec: ModelSpec, n_gpus: int, sp: SearchSpace) -> list[tuple]:
    """(pp, dp_replicate, dp_shard, cp, tp, ep, etp, ep_from) of the space (pins and caps; ep_from: the index in
    plan_schema.EP_FROM)
    the rules prune later."""
    out = []
    for pp in _allowed(divisors(n_gpus), sp.pp, sp.max_pp):
        for tp in _allowed(divisors(n_gpus // pp), sp.tp, sp.max_tp):
            for cp in _allowed(divisors(n_gpus // (pp * tp)), sp.cp, sp.max_cp):
                rest = n_gpus // (pp * tp * cp)
                for dpr in _allowed(divisors(rest), sp.dp_replicate, None):
                    dps = rest // dpr
                    if sp.dp_shard is not None and dps not in sp.dp_shard:
                        continue
                    out += [(pp, dpr, dps, cp, tp, *e) for e in _ep_options(spec, dpr, dps, cp, tp, sp)]
    return out


def _ep_options(spec, dpr, dps, cp, tp, sp: SearchSpace) -> list[tuple]:
    """(ep, etp, ep_from): none for a dense model; dp2ep borrows ep x etp from dp_shard x cp x tp (etp 1 or tp),
    DDP-style EP borrows ep from dp_replicate, folded EP (Megatron, dp_shard 1) lays ep x etp over
    dp_replicate x cp x tp (with tp = cp = 1 that is DDP-style EP's layout: left out when both are searched)."""
    opts = [(1, 1, 0)]
    if spec.moe is not None and "dp_shard" in sp.ep_from:
        opts += [(ep, etp, 0) for ep in divisors(dps * cp * tp) if ep > 1 for etp in sorted({1, tp})]
    if spec.moe is not None and "dp_replicate" in sp.ep_from:
        opts += [(ep, 1, 1) for ep in divisors(dpr) if ep > 1]
    same_as_ddp = cp * tp == 1 and "dp_replicate" in sp.ep_from
    if spec.moe is not None and "folded" in sp.ep_from and dps == 1 and not same_as_ddp:
        opts += [(ep, etp, EpFrom.FOLDED.value) for etp in sorted({1, tp}) for ep in divisors(dpr * cp * tp // etp)
                 if ep > 1]
    return [o for o in opts if (sp.ep is None or o[0] in sp.ep) and (sp.etp is None or o[1] in sp.etp)]


def _batch_splits(pp: int, dp: int, sp: SearchSpace) -> list[tuple]:
    """(local batch, micro batch, schedule code, stages per rank) of one (pp, dp); a global batch dp does not
    divide gives one row for the rules to refuse."""
    sched_pp1 = PP_SCHEDULES[sp.pp_schedules[0]] if len(sp.pp_schedules) == 1 else PP_SCHEDULES["1F1B"]
    if sp.global_batch_size % dp:
        return [(1, 1, sched_pp1, 1)]
    out = []
    for lbs in divisors(sp.global_batch_size // dp):
        if lbs > sp.max_local_batch_size or (sp.local_batch_size and lbs not in sp.local_batch_size):
            continue
        if pp == 1:
            # plans without PP carry the pinned schedule's name; they cannot honour a pinned v >= 2
            pp1_ok = not (sp.pp_schedules == ("Interleaved1F1B",) and 1 not in sp.stages_per_rank)
            if pp1_ok and not (sp.micro_batch_size and lbs not in sp.micro_batch_size):
                out.append((lbs, lbs, sched_pp1, 1))
            continue
        for mbs in divisors(lbs):
            if sp.micro_batch_size and mbs not in sp.micro_batch_size:
                continue
            for s in sp.pp_schedules:
                vs = sp.stages_per_rank if s == "Interleaved1F1B" else (1,)
                out += [(lbs, mbs, PP_SCHEDULES[s], v) for v in vs]
    return out


def candidates(spec: ModelSpec, n_gpus: int, sp: SearchSpace) -> tuple[np.ndarray, np.ndarray, PlanBatch]:
    """Every (degrees, batch split) of the space before pruning: combos array, per-row (combo index, local batch,
    micro batch, schedule, v) array, and the batch of those rows with default options for the rules."""
    combos = _combos(spec, n_gpus, sp)
    ((rows, b),) = list(candidate_chunks(combos, sp, max_rows=0))
    return combos, rows, b


def _combos(spec: ModelSpec, n_gpus: int, sp: SearchSpace) -> np.ndarray:
    return np.array(_degree_combos(spec, n_gpus, sp), dtype=np.int64).reshape(-1, 8)


def candidate_chunks(combos: np.ndarray, sp: SearchSpace, max_rows: int = 1 << 20, split_pruned: Counter | None = None,
                     v_legal: np.ndarray | None = None, batches: bool = True):
    """``candidates``' (rows, batch) in pieces of whole combinations, about ``max_rows`` rows each (0: one piece),
    so that a huge space is checked piece by piece rather than built whole (29 M rows at 2^20 GPUs).
    ``split_pruned``: the rows that break a batch-split rule (``codec.SPLIT_RULES``, which read only the batch
    split, pp and dp and come first in ``RULES``) are left out, counted there by rule, instead of built.
    ``v_legal`` (combinations x ``_stage_counts(sp)``): a combination's rows with stages per rank v only where
    true (the rest are not built). ``batches`` False: the rows alone (the batch None)."""
    key_of, tables = _split_tables(combos, sp, split_pruned)
    if v_legal is not None:  # (one table per (pp, dp) key and set of stage counts a combination may have)
        vset = v_legal.astype(np.int64) @ (1 << np.arange(v_legal.shape[1], dtype=np.int64))
        keys, key_of = np.unique(np.stack([key_of, vset], axis=1), axis=0, return_inverse=True)
        key_of = np.ravel(key_of)
        vs = np.array(_stage_counts(sp), dtype=np.int64)
        tables = [tables[k][(code >> np.searchsorted(vs, tables[k][:, 3])) & 1 == 1] for k, code in keys.tolist()]
    sizes = np.array([len(t) for t in tables], dtype=np.int64)
    first = np.cumsum(sizes) - sizes
    counts = sizes[key_of]
    every = np.concatenate(tables) if tables else np.empty((0, 4), dtype=np.int64)
    ends = np.cumsum(counts)
    bounds = [0, len(combos)] if not max_rows else sorted(
        {0, len(combos), *np.searchsorted(ends, np.arange(max_rows, int(ends[-1]) if len(ends) else 0, max_rows),
                                          side="right").tolist()})
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        r = np.empty((int(counts[lo:hi].sum()), 5), dtype=np.int64)
        r[:, 0] = np.repeat(np.arange(lo, hi, dtype=np.int64), counts[lo:hi])
        r[:, 1:] = every[_ranges(first[key_of[lo:hi]], counts[lo:hi])]
        if not batches:
            yield r, None
            continue
        c = combos[r[:, 0]]
        degs = {a: c[:, k] for k, a in enumerate(COMBO_COLUMNS)}
        cols = {**degs, "seq_len": sp.seq_len, "global_batch_size": sp.global_batch_size,
                "local_batch_size": r[:, 1], "micro_batch_size": r[:, 2], "pp_schedule": r[:, 3],
                "pp_stages_per_rank": r[:, 4], **pinned_columns(sp, degs)}
        yield r, batch_of(cols, (AXES,), (DEFAULT_ORDER,), None)


def _split_tables(combos: np.ndarray, sp: SearchSpace, split_pruned: Counter | None = None) -> tuple:
    """(per combination its key, per key its table of batch splits): a combination's batch splits depend on its
    (pp, dp) only. ``split_pruned``: the splits that break a batch-split rule are left out of the tables, counted
    there by rule once per combination of the key."""
    keys, key_of = np.unique(np.stack([combos[:, 0], combos[:, 1] * combos[:, 2]], axis=1), axis=0,
                             return_inverse=True)
    key_of = np.ravel(key_of)
    tables = [np.array(_batch_splits(int(pp), int(dp), sp), dtype=np.int64).reshape(-1, 4) for pp, dp in keys.tolist()]
    if split_pruned is not None:
        per_key = np.bincount(key_of, minlength=len(keys))
        tables = [_split_legal(t, int(pp), int(dp), sp, int(n), split_pruned)
                  for t, (pp, dp), n in zip(tables, keys.tolist(), per_key.tolist(), strict=True)]
    return key_of, tables


def _stage_counts(sp: SearchSpace) -> list[int]:
    """The stages per rank a row of the space can have (``_batch_splits``)."""
    return sorted({1, *(sp.stages_per_rank if "Interleaved1F1B" in sp.pp_schedules else ())})


def _combo_legal(spec: ModelSpec, combos: np.ndarray, sp: SearchSpace, pruned: Counter) -> np.ndarray:
    """(combinations x ``_stage_counts``) where a row of that combination and stage count breaks no rule, its rows
    that break one counted in ``pruned`` by the first, as ``codec.first_broken`` over every candidate row counts
    them [derived]: a row that breaks a batch-split rule (``codec.SPLIT_RULES``, first in ``RULES``) breaks it
    first whatever else it breaks; the other rules (``codec.COMBO_RULES``) read only the degrees, the stages per
    rank, the sequence, the pinned options and the model, so they are checked once per (combination, stage
    count) and each row of it shares the verdict (``tests/test_search.py`` checks it against every row)."""
    vs = _stage_counts(sp)
    degs = {a: combos[:, k] for k, a in enumerate(COMBO_COLUMNS)}
    first = np.empty((len(combos), len(vs)), dtype=np.int64)
    for j, v in enumerate(vs):
        cols = {**degs, "seq_len": sp.seq_len, "global_batch_size": sp.global_batch_size, "local_batch_size": 1,
                "micro_batch_size": 1, "pp_stages_per_rank": v, **pinned_columns(sp, degs)}
        first[:, j] = first_broken(batch_of(cols, (AXES,), (DEFAULT_ORDER,), None), spec, COMBO_RULES)
    # rows per combination and stage count: its (pp, dp) table's rows of that count that break no split rule
    # (those that do are counted by ``candidate_chunks``)
    key_of, tables = _split_tables(combos, sp, Counter())
    rows_v = np.array([np.bincount(np.searchsorted(vs, t[:, 3]), minlength=len(vs)) for t in tables],
                      dtype=np.int64).reshape(len(tables), len(vs))
    counts = rows_v[key_of]
    for i, n in enumerate(np.bincount(first.ravel(), weights=counts.ravel(), minlength=len(COMBO_RULES) + 1)
                          [:len(COMBO_RULES)].tolist()):
        if n:
            pruned[COMBO_RULES[i].key] += int(n)
    return first == len(COMBO_RULES)


def _split_legal(table: np.ndarray, pp: int, dp: int, sp: SearchSpace, combos: int, pruned: Counter) -> np.ndarray:
    """The batch splits of ``table`` (one (pp, dp) key's) that break no batch-split rule; those that do are counted
    in ``pruned`` by the first they break, once per combination of the key (``combos``)."""
    if not len(table):
        return table
    cols = {"pp": pp, "dp_replicate": dp, "seq_len": sp.seq_len, "global_batch_size": sp.global_batch_size,
            "local_batch_size": table[:, 0], "micro_batch_size": table[:, 1], "pp_schedule": table[:, 2],
            "pp_stages_per_rank": table[:, 3]}
    broken = first_broken(batch_of(cols, (AXES,), (DEFAULT_ORDER,), None), None, SPLIT_RULES)
    _count_broken(pruned, broken, SPLIT_RULES, combos)
    return table[broken == len(SPLIT_RULES)]


def _count_broken(pruned: Counter, broken: np.ndarray, rules: tuple, times: int = 1) -> None:
    """Add to ``pruned`` (rule key -> rows) ``times`` each row of ``broken`` (``codec.first_broken``)."""
    for i, n in enumerate(np.bincount(broken, minlength=len(rules) + 1)[:len(rules)].tolist()):
        if n:
            pruned[rules[i].key] += n * times


# the columns of ``_degree_combos``' tuples (ep_from: the index in plan_schema.EP_FROM)
COMBO_COLUMNS = AXES + ("ep", "etp", "ep_from")


def pinned_columns(sp: SearchSpace, deg: dict) -> dict:
    """The batch columns of the options ``sp`` pins (the others take their defaults in ``batch_of``); a pin with an
    ``only_with`` axis applies where that axis is > 1 (async TP needs TP, the distributed optimizer dp_replicate)."""
    out = {}
    for name, value in sp.pins:
        f = FIELDS[name]
        ((col, v),) = encode_field(f, value).items()
        if f.only_with:
            v = np.where(deg[f.only_with] > 1, v, encode_field(f, f.default)[col])
        out[col] = v
    return out


RULE_CHUNK = 1 << 20  # candidate rows built and checked by the structural rules at a time (--max-seconds between)


def _base_rows(spec, n_gpus: int, sp: SearchSpace, gpn: int, pruned: dict, deadline=(0.0, math.inf)) -> dict:
    """The legal (degrees, batch split) rows and the distinct device orders of each, as arrays (``n`` base rows:
    every row in each of its orders, numbered row after row); what the rules prune is counted in ``pruned``. The
    rules run a chunk of candidate rows at a time; past ``deadline`` (start, end) the search is refused in one line
    (a space of 2^20 GPUs holds tens of millions of candidate rows: seconds of rules)."""
    combos = _combos(spec, n_gpus, sp)
    kept: list[np.ndarray] = []
    broken: Counter[str] = Counter()
    done = 0
    v_legal = _combo_legal(spec, combos, sp, broken)
    for piece, _ in candidate_chunks(combos, sp, RULE_CHUNK, broken, v_legal, batches=False):
        if done:  # (past the first piece: a small space is checked whole, and the search's own deadline applies)
            _check_building(deadline, done, sp)
        kept.append(piece)
        done += len(piece)
    for k, n in broken.items():
        pruned[str(k)] = int(n)
    rows = np.concatenate(kept) if kept else np.empty((0, 5), dtype=np.int64)
    if not len(rows):
        return {}
    # distinct device orders per combination: signature = ranks per node of every group
    if sp.mesh_order is not None:
        perms = [tuple(sp.mesh_order)]
    else:
        perms = list(permutations(AXES)) if sp.device_orders else [AXES]
    used = np.unique(rows[:, 0])
    deg = {a: combos[used, k] for k, a in enumerate(AXES)}  # the combos' columns: COMBO_COLUMNS
    sig = np.stack([_signature(deg, combos[used, 5], combos[used, 6], combos[used, 7], o, gpn) for o in perms], axis=1)
    first = _first_distinct(sig)  # (used combos x perms): the first order of each distinct signature
    counts = first.sum(axis=1)
    cperm = np.nonzero(first)[1].astype(np.int64)  # the kept orders, combination after combination
    cstart = np.cumsum(counts) - counts
    u = np.searchsorted(used, rows[:, 0])
    reps = counts[u]
    # one entry per (degrees, batch split) row; ``_batch_at`` finds the row and order of a base row (the arrays
    # are never expanded to every device order: 13 M base rows for deepseek-v3 on 2,048 GPUs)
    out: dict[str, Any] = {"combo": rows[:, 0], "lbs": rows[:, 1], "mbs": rows[:, 2], "sched": rows[:, 3],
                           "v": rows[:, 4], "row_count": reps, "row_start": np.cumsum(reps) - reps,
                           "perm_start": cstart[u], "cperm": cperm, "n": int(reps.sum())}
    out["combos"] = combos
    out["perms"] = perms
    return out


def _check_building(deadline: tuple, done: int, sp: SearchSpace) -> None:
    import time

    t0, end = deadline
    if time.perf_counter() > end:
        raise ParsimError(f"--max-seconds {sp.max_seconds:g} ran out after {time.perf_counter() - t0:.1f} s while "
                          f"checking the space's degree and batch-split rows ({done:,} checked), before any plan was "
                          "evaluated: raise it, or pin degrees to make the space smaller")


def _first_distinct(sig: np.ndarray) -> np.ndarray:
    """(rows x perms) mask of the first perm of every distinct signature ``sig[row, perm, :]`` in its row."""
    n, p, g = sig.shape
    base = int(sig.max(initial=0)) + 1
    key = np.zeros((n, p), dtype=np.int64)
    for j in range(g):  # mixed radix: group sizes per node are small integers
        key = key * base + sig[:, :, j]
    order = np.argsort(key, axis=1, kind="stable")
    ks = np.take_along_axis(key, order, axis=1)
    new = np.ones((n, p), dtype=bool)
    new[:, 1:] = ks[:, 1:] != ks[:, :-1]
    first = np.zeros((n, p), dtype=bool)
    np.put_along_axis(first, order, new, axis=1)
    return first


def _signature(deg: dict, ep, etp, ep_from, order: tuple, gpn: int) -> np.ndarray:
    """Ranks per node of every communication group of these degrees in this device order."""
    cols = {**deg, "ep": ep, "etp": etp, "ep_from": ep_from, "global_batch_size": 1, "micro_batch_size": 1}
    r = group_rpn(batch_of(cols, (order,), (DEFAULT_ORDER,), None), order, gpn)
    return np.stack([r[k] for k in sorted(r)], axis=1)


def _options(sp: SearchSpace, hw: HardwareProfile) -> tuple[np.ndarray, list]:
    """Option table rows: (ac code, ac_every, compile, float8, reshard choice index, ac wraps compile, wrapper
    order index), and the wrapper orders the last column indexes."""
    from .plan import parse_ac

    f8 = sp.float8 if sp.float8 is not None else ((False, True) if "float8" in hw.peak_flops else (False,))
    if any(f8) and "float8" not in hw.peak_flops:
        raise ParsimError(f"float8 needs a GPU with float8 tensor cores; profile {hw.name} has none")
    rows, orders = [], []
    for ac in sp.ac:
        mode, every = parse_ac(ac)
        for comp in sp.compile:
            for fp8 in f8:
                for flip in sp.reshard:
                    for order in sp.wrapper_orders or searched_orders(mode != "none", comp):
                        if order not in orders:
                            orders.append(order)
                        wraps = order.index("ac") > order.index("compile")
                        rows.append((AC_MODES[mode], every, comp, fp8, RESHARD_CHOICES.index(flip), wraps,
                                     orders.index(order)))
    return np.array(rows, dtype=np.int64), orders


def _raf_mode(choice: np.ndarray, pp: np.ndarray) -> np.ndarray:
    """RESHARD_CHOICES index -> RAF_MODES index; flip is the non-default: never without PP, always with it."""
    named = np.array([RAF_MODES.index(c) if c in RAF_MODES else 0 for c in RESHARD_CHOICES])[choice]
    return np.where(choice == RESHARD_CHOICES.index("flip"),
                    np.where(pp == 1, RafMode.NEVER, RafMode.ALWAYS), named)


def _chunk_batch(base: dict, opts: np.ndarray, lo: int, hi: int, sp: SearchSpace, gpn: int | None) -> PlanBatch:
    """Plans ``lo..hi`` of the space (base row x option row) as a batch."""
    return _batch_at(base, opts, np.arange(lo, hi, dtype=np.int64), sp, gpn)


def _batch_at(base: dict, opts: np.ndarray, idx: np.ndarray, sp: SearchSpace, gpn: int | None) -> PlanBatch:
    """The plans of global indices ``idx`` (base row x option row) as a batch."""
    bi, oi = idx // len(opts), idx % len(opts)
    ri = np.searchsorted(base["row_start"], bi, side="right") - 1  # (degrees, batch split) row of each base row
    perm = base["cperm"][base["perm_start"][ri] + bi - base["row_start"][ri]]
    c = base["combos"][base["combo"][ri]]
    o = opts[oi]
    deg = {a: c[:, k] for k, a in enumerate(COMBO_COLUMNS)}
    cols = {**deg, "seq_len": sp.seq_len, "global_batch_size": sp.global_batch_size,
            "local_batch_size": base["lbs"][ri], "micro_batch_size": base["mbs"][ri],
            "pp_schedule": base["sched"][ri], "pp_stages_per_rank": base["v"][ri],
            "fsdp_reshard_after_forward": _raf_mode(o[:, 4], c[:, 0]), "ac": o[:, 0], "ac_every": o[:, 1],
            "compile": o[:, 2], "float8": o[:, 3], "mesh_idx": perm, "wrapper_idx": o[:, 6], **pinned_columns(sp, deg)}
    return batch_of(cols, tuple(base["perms"]), tuple(base["orders"]), gpn)


def _undominated(opts: np.ndarray) -> tuple[np.ndarray, int]:
    """Option rows without those dominated by a kept row [derived from the cost model]:

    * AC wrapping compile (compile applied before AC) has the memory of the default order and recomputes twice
      (``ac_wraps_compile``): never faster, never smaller than its twin with the same AC, compile, float8, reshard;
    * compile off has the memory of compile on and its memory-bound kernels take 1 / ``compile_memory_bound_factor``
      (>= 1, checked by the profile) times as long, nothing else: never faster than its compiled twin.

    Returns the kept rows and how many were dropped (none without a twin, e.g. when the user pins --no-compile or
    one wrapper order). Columns: ac, ac_every, compile, float8, reshard, ac wraps compile, wrapper order."""
    rows = [tuple(o) for o in opts.tolist()]
    plain = {r[:5] for r in rows if not r[5]}
    compiled = {(r[0], r[1], r[3], r[4], r[5], r[6]) for r in rows if r[2]}
    keep = np.array([not ((r[5] and r[:5] in plain) or (not r[2] and (r[0], r[1], r[3], r[4], r[5], r[6])
                                                            in compiled)) for r in rows], dtype=bool)
    return opts[keep], int((~keep).sum())


def _option_classes(opts: np.ndarray, columns: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(class of every option row, one representative row per class): options equal in ``columns`` share a class."""
    keys = [tuple(o[c] for c in columns) for o in opts.tolist()]
    uniq = list(dict.fromkeys(keys))
    return (np.array([uniq.index(k) for k in keys], dtype=np.int64),
            np.array([keys.index(k) for k in uniq], dtype=np.int64))


def _memory_classes(opts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Option classes of equal peak memory: it depends on the options only through AC mode, AC period and
    reshard-after-forward (compile, float8 and the wrapper order change time, not what is held) —
    ``tests/test_search.py`` checks it and the pruned search against the exhaustive one."""
    return _option_classes(opts, (0, 1, 4))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``starts[i] + 0 .. counts[i] - 1`` for every i, concatenated."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts, counts) + np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(offsets, counts)


def plan_of(base: dict, opts: np.ndarray, gi: int, sp: SearchSpace) -> Plan:
    """The Plan of global index ``gi``."""
    return decode(_chunk_batch(base, opts, gi, gi + 1, sp, None), 0)


def _pareto(times: np.ndarray, mems: np.ndarray, ids: np.ndarray):
    """Indices (into the arrays) of the time/memory Pareto front, by time ascending: a plan is kept when it needs
    less memory than every faster plan."""
    order = np.lexsort((ids, mems, times))
    m = mems[order]
    before = np.concatenate([[np.inf], np.minimum.accumulate(m)[:-1]])
    return order[m < before]


class _Found:
    """The best ``top_k`` plans and the time/memory Pareto front of the plans evaluated so far (global ids)."""

    KEYS = ("step_time_s", "reserved_memory_bytes", "tokens_per_s_per_gpu", "mfu", "dominant")

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.top: dict[str, np.ndarray] = {}
        self.front: tuple[np.ndarray, np.ndarray, np.ndarray] = (np.empty(0), np.empty(0), np.empty(0, np.int64))

    def add(self, gid: np.ndarray, r: dict, fits: np.ndarray) -> None:
        f = np.nonzero(fits)[0]
        if not len(f):
            return
        step, mem = r["step_time_s"], r["reserved_memory_bytes"]
        new = {"gid": gid[f], **{k: np.asarray(r[k])[f] for k in self.KEYS}}
        both = {k: np.concatenate([self.top[k], v]) for k, v in new.items()} if self.top else new
        keep = np.lexsort((both["gid"], both["step_time_s"]))[:self.top_k]
        self.top = {k: v[keep] for k, v in both.items()}
        t, m, i = (np.concatenate([self.front[0], step[f]]), np.concatenate([self.front[1], mem[f]]),
                   np.concatenate([self.front[2], gid[f]]))
        pf = _pareto(t, m, i)
        self.front = (t[pf], m[pf], i[pf])

    def threshold(self) -> float:
        """The k-th best step time (infinite until k plans were found): a plan slower than it is not listed."""
        n = len(self.top.get("gid", ()))
        return float(self.top["step_time_s"][-1]) if n >= self.top_k else math.inf

    def dominated(self, t_lower: np.ndarray, mem: np.ndarray) -> np.ndarray:
        """Plans of time >= ``t_lower`` and memory ``mem`` that cannot be on the Pareto front: a found plan is
        strictly faster than the bound and needs no more memory."""
        ft, fm = self.front[0], self.front[1]
        if not len(ft):
            return np.zeros(len(t_lower), dtype=bool)
        order = np.argsort(ft, kind="stable")
        ft, pm = ft[order], np.minimum.accumulate(fm[order])
        k = np.searchsorted(ft, t_lower, side="left")  # found plans strictly faster than the bound
        return (k > 0) & (pm[np.maximum(k - 1, 0)] <= mem)


def search(spec: ModelSpec, hw: HardwareProfile, n_gpus: int, sp: SearchSpace, top_k: int = 10,
           chunk: int = 200_000, progress=None, csv_writer=None) -> SearchResult:
    """Search the whole space; ``progress(done, total)`` is called after each chunk; ``csv_writer(plans_fn,
    arrays)`` receives every evaluated chunk when given (every plan is then evaluated: no pruning)."""
    import time

    t0 = time.perf_counter()
    check_number("--gpus", n_gpus, 1, MAX_GPUS, integer=True)
    if progress:  # (a bar with its clock from the start: a large space spends seconds building its rows)
        progress(0, 1000)
    res = SearchResult(usable_memory_bytes=hw.usable_memory_bytes * (1.0 - sp.headroom))
    deadline = t0 + sp.max_seconds if sp.max_seconds else math.inf
    base = _base_rows(spec, n_gpus, sp, hw.gpus_per_node, res.pruned_structural, (t0, deadline))
    opts, base["orders"] = _options(sp, hw)
    nb = base.get("n", 0)
    res.considered = nb * len(opts)
    prune = sp.prune and csv_writer is None  # a CSV of every plan needs every plan evaluated
    if prune:
        opts, dropped = _undominated(opts)
        res.pruned_dominated = nb * dropped
    if nb * len(opts) == 0:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(res.pruned_structural.items()))
        raise ParsimError(f"no plan of {spec.name} on {n_gpus} GPUs satisfies the pins and the model's structure"
                          + (f" ({why})" if why else ""))
    cap = sp.max_plans if sp.max_plans is not None else (0 if prune else MAX_PLANS)
    if cap and res.considered > cap:
        raise ParsimError(f"the space holds {res.considered:,} plans, more than --max-plans {cap:,}"
                          + ("" if sp.max_plans is not None else " for a search that evaluates every plan (--csv)")
                          + ": pin degrees, AC or batch sizes, or raise --max-plans (0 = no limit)")
    found = _Found(top_k)
    run = _search_bounded if prune else _search_all
    with counted() as work:
        closest = run(spec, hw, base, opts, sp, res, found, chunk, (t0, deadline), progress, csv_writer)
    res.work = work_of(res, work)
    if res.stopped_at is not None and not found.top:
        raise ParsimError(f"--max-seconds {sp.max_seconds:g} ran out after {time.perf_counter() - t0:.1f} s, "
                          f"{100 * res.stopped_at:.0f}% into the {res.considered:,} plans, before any plan that fits "
                          "was found: raise it, or pin degrees to make the space smaller")
    if found.top:
        res.top = [RankedPlan(plan_of(base, opts, int(g), sp), float(t), float(m), float(tps), float(mfu), str(dom))
                   for g, t, m, tps, mfu, dom in zip(found.top["gid"], *(found.top[k] for k in _Found.KEYS),
                                                     strict=True)]
        res.pareto = [FrontPlan(plan_of(base, opts, int(g), sp), float(t), float(m))
                      for t, m, g in zip(*found.front, strict=True)]
    elif closest[1] >= 0:
        res.closest = (plan_of(base, opts, closest[1], sp), closest[0])
    res.wall_s = time.perf_counter() - t0
    return res


def work_of(res: SearchResult, counts) -> dict:
    """What a search did, as counts that do not depend on the machine: (row, memory class) pairs bounded and
    replayed, step-time bounds, plans evaluated in full, and the cost model's own (``costmodel.work``: memory
    timelines and pipeline schedules replayed, plans and distinct rows of the per-row costs)."""
    return {"plans_evaluated": res.evaluated, "memory_pairs_replayed": res.screened, **dict(sorted(counts.items()))}


def _search_all(spec, hw, base, opts, sp, res, found, chunk, times, progress, csv_writer) -> tuple:
    """Evaluate every plan of the space (``--csv``, or pruning off); returns the closest plan (memory, id)."""
    import time

    total, closest, limit = base["n"] * len(opts), (np.inf, -1), res.usable_memory_bytes
    for lo in range(0, total, chunk):
        if time.perf_counter() > times[1]:
            res.stopped_at = lo / total
            break
        gid = np.arange(lo, min(total, lo + chunk), dtype=np.int64)
        b = _batch_at(base, opts, gid, sp, hw.gpus_per_node)
        r = evaluate(spec, b, hw)
        fits = r["reserved_memory_bytes"] <= limit
        res.evaluated += len(gid)
        res.fitting += int(fits.sum())
        if csv_writer is not None:
            csv_writer(b, r, fits)
        if not fits.all():
            j = int(np.argmin(r["reserved_memory_bytes"]))
            closest = min(closest, (float(r["reserved_memory_bytes"][j]), int(gid[j])))
        found.add(gid, r, fits)
        if progress:
            progress(lo + len(gid), total)
    res.pruned_memory = res.evaluated - res.fitting if res.stopped_at is not None else total - res.fitting
    return closest


def _search_bounded(spec, hw, base, opts, sp, res, found, chunk, times, progress, _csv) -> tuple:
    """The default search, exact for the best ``top_k`` plans and the Pareto front [derived]. Every skip below
    is sound whenever it is made (the k-th best time found only falls and the front only improves), so the order
    only changes how much is skipped:

    1. per (degrees x batch split) row, a lower bound of the memory of all its options and of the step time of
       all its options and device orders (``_row_bounds``); rows whose memory bound exceeds the usable memory do
       not fit;
    2. rows in ascending time bound, in doubling windows: a row is skipped when its time bound exceeds the k-th
       best time found (none of its plans can be listed) and a found plan strictly faster than the bound needs no
       more memory than the row's memory bound (none of its plans is on the Pareto front);
    3. a row not skipped is expanded into its (row, option) pairs (``_Pairs``), each with a memory bound of its
       (row, memory class) and a time bound of its (row, time class), and decided as a row is, in ascending time
       bound; the exact memory of a (row, memory class) is replayed (``_Memory``: the device order and the
       options outside the class do not change it) only for pairs the bounds do not decide; pairs that fit and
       are not skipped on their exact memory have every device order evaluated in full.

    Replays are batched: seed rows first (the fastest, and the fastest of every range of memory bounds, so that
    slow plans of little memory are skipped against a front from the start), then per window every pair the
    window will decide that the plans found so far do not skip (a superset of what those pairs need), in one
    batch. Skipped plans are counted in ``pruned_bound`` (their memory may be unknown), plans that do not fit
    in ``pruned_memory``."""
    job = _Bounded(spec, hw, base, opts, sp, res, found, chunk, times[1], progress)
    if res.stopped_at is None:
        job.run()
    res.fitting = job.mem.fitting_plans()
    res.screened = job.mem.n_exact
    if found.top or res.stopped_at is not None:
        return (np.inf, -1)
    closest = _closest(job.mem)
    res.screened = job.mem.n_exact
    return closest


def _closest(mem: _Memory) -> tuple[float, int]:
    """(memory, global id) of the plan that needs the least memory, when nothing fits [derived]: every (row, memory
    class) pair bounded, then replayed in ascending bound, in doubling batches, until no bound is below the least
    memory replayed."""
    nc = len(mem.rep)
    mem.bound_rows(mem.lower.rows_without())
    lower = mem.lower.dense()
    order = np.argsort(lower.ravel(), kind="stable")
    lo, step = 0, 256
    while lo < len(order):
        values = mem.values.dense()
        best = np.nanmin(values) if not np.isnan(values).all() else np.inf
        if lower.flat[order[lo]] >= best:
            break
        part = order[lo:lo + step]
        mem.exact(part // nc, part % nc)
        lo, step = lo + len(part), 2 * step
    values = mem.values.dense()
    j = int(np.nanargmin(values))
    return float(values.flat[j]), int(mem.base["row_start"][j // nc] * len(mem.opts) + mem.rep[j % nc])


class _Bounded:
    """The state of one bounded search (``_search_bounded``): the rows in ascending time bound, their bounds, the
    memory of their (row, memory class) pairs (``_Memory``) and which rows were decided."""

    SEED_FAST = 64  # seed rows of the smallest time bounds
    SEED_BUCKETS, SEED_PER_BUCKET = 32, 2  # and the fastest of every range of memory bounds (log-spaced)
    FIRST_WINDOW, GROWTH = 16384, 4  # rows of the first window after the seed, and how each next one grows

    def __init__(self, spec, hw, base, opts, sp, res, found, chunk, deadline, progress):
        self.spec, self.hw, self.base, self.opts, self.sp, self.res, self.found = spec, hw, base, opts, sp, res, found
        self.chunk, self.deadline, self.progress = chunk, deadline, progress
        self.counts, self.no = base["row_count"], len(opts)
        self.usable = res.usable_memory_bytes
        tick = (lambda f: progress(int(200 * f), 1000)) if progress else None  # (the bounds: a fifth of it)
        self.row_mem, self.row_time, bounded = _row_bounds(spec, hw, base, opts, sp, chunk, deadline, tick,
                                                           self.usable)
        if bounded < len(self.row_mem):  # (the time limit came first: the rows bounded are the part searched)
            res.stopped_at = 0.0
        cand = self.row_mem <= self.usable
        res.pruned_memory = int(self.counts[~cand].sum()) * self.no
        self.rows = np.flatnonzero(cand)[np.argsort(self.row_time[cand], kind="stable")]
        self.row_done = np.zeros(len(cand), bool)
        self.mem = _Memory(spec, hw, base, opts, sp, chunk, self.usable)

    def run(self) -> None:
        import time

        pool = _Pairs(self)
        pool.extend(self._seed())
        if not pool.decide_until(-math.inf if not len(self.rows) else math.inf, seed=True):
            self.res.stopped_at = 0.0
            return
        lo, size, n = 0, self.FIRST_WINDOW, len(self.rows)
        while lo < n:
            if time.perf_counter() > self.deadline:
                self.res.stopped_at = lo / n
                return
            win, start = self.rows[lo:lo + size], lo
            lo, size = lo + len(win), self.GROWTH * size
            win = win[~self.row_done[win]]
            skip = (self.row_time[win] > self.found.threshold()) & self.found.dominated(self.row_time[win],
                                                                                      self.row_mem[win])
            self.res.pruned_bound += int(self.counts[win[skip]].sum()) * self.no
            self.row_done[win[skip]] = True
            pool.extend(win[~skip])
            # every pair whose bound is below the next rows' is next in ascending order
            if not pool.decide_until(self.row_time[self.rows[lo]] if lo < n else math.inf):
                self.res.stopped_at = start / n
                return
            if self.progress:
                self.progress(200 + int(800 * lo / n), 1000)

    def _seed(self) -> np.ndarray:
        """The rows expanded first: the fastest by time bound, and the fastest few of every range of memory
        bounds."""
        rows = self.rows
        lo_mem = np.maximum(self.row_mem[rows], 1.0)
        edges = np.geomspace(float(lo_mem.min(initial=1.0)), max(self.usable, 2.0), self.SEED_BUCKETS + 1)
        bucket = np.searchsorted(edges, lo_mem, side="right")
        ranked = np.argsort(bucket, kind="stable")  # by bucket, then time bound
        b_sorted = bucket[ranked]
        first_of = np.searchsorted(b_sorted, b_sorted, side="left")
        pick = ranked[np.arange(len(ranked)) - first_of < self.SEED_PER_BUCKET]
        return np.unique(np.concatenate([rows[:self.SEED_FAST], rows[pick]]))


class _Pairs:
    """The undecided (row, option) pairs of the rows a bounded search expanded, with their memory and time bounds,
    in ascending time bound."""

    def __init__(self, job: _Bounded):
        self.job = job
        e = np.empty(0, np.int64)
        self.pr, self.po, self.pc, self.lb, self.order = e, e, e, np.empty(0), e
        self.done = np.empty(0, bool)
        self.limit = math.inf  # the time bound up to which the current ``decide_until`` decides

    def extend(self, rows: np.ndarray) -> None:
        """Add every pair of ``rows`` that may fit (the others count as not fitting)."""
        job = self.job
        rows = rows[~job.row_done[rows]] if len(rows) else rows
        if not len(rows):
            return
        job.row_done[rows] = True
        mem, no = job.mem, job.no
        mem.bound_rows(rows)
        pr, po = np.repeat(rows, no), np.tile(np.arange(no, dtype=np.int64), len(rows))
        pc = mem.cls[po]
        fits = mem.lower.get(pr, pc) <= job.usable
        job.res.pruned_memory += int(job.counts[pr[~fits]].sum())
        pr, po, pc = pr[fits], po[fits], pc[fits]
        lb = _pair_bounds(job.spec, job.hw, job.base, job.opts, job.sp, pr, po, job.chunk, job.deadline)
        keep = ~self.done  # (decided pairs leave the pool)
        self.pr, self.po, self.pc = (np.concatenate([x[keep], y]) for x, y in ((self.pr, pr), (self.po, po),
                                                                              (self.pc, pc)))
        self.lb = np.concatenate([self.lb[keep], lb])
        self.done = np.zeros(len(self.lb), bool)
        self.order = np.argsort(self.lb, kind="stable")

    def decide_until(self, limit: float, seed: bool = False) -> bool:
        """Decide, in ascending time bound and in growing steps, the undecided pairs whose bound is at most
        ``limit`` (every pair with ``seed``); False when the time limit came."""
        job = self.job
        self.limit = math.inf if seed else limit
        order = self.order[~self.done[self.order]]
        if not seed:
            order = order[self.lb[order] <= limit]
        lo, step = 0, 256
        most = max(1, job.chunk // max(1, int(job.counts.mean())))
        while lo < len(order):
            sel = order[lo:lo + step]
            if not self._decide(sel[~self.done[sel]]):
                return False
            lo, step = lo + len(sel), min(2 * step, most)
        return True

    def _skippable(self, sel: np.ndarray, mem: np.ndarray) -> np.ndarray:
        found = self.job.found
        return (self.lb[sel] > found.threshold()) & found.dominated(self.lb[sel], mem)

    def _decide(self, sel: np.ndarray) -> bool:
        """Decide the pairs ``sel``; False when the time limit came during the replays."""
        job, pr, pc = self.job, self.pr, self.pc
        res, counts = job.res, job.counts
        skip = self._skippable(sel, job.mem.known(pr[sel], pc[sel]))
        res.pruned_bound += int(counts[pr[sel[skip]]].sum())
        self.done[sel[skip]] = True
        sel = sel[~skip]
        if np.isnan(job.mem.values.get(pr[sel], pc[sel])).any():
            self._prefetch(sel)
        exact = job.mem.values.get(pr[sel], pc[sel])
        if np.isnan(exact).any():
            return False
        self.done[sel] = True
        fits = exact <= job.usable
        res.pruned_memory += int(counts[pr[sel[~fits]]].sum())
        sel, exact = sel[fits], exact[fits]
        skip = self._skippable(sel, exact)
        res.pruned_bound += int(counts[pr[sel[skip]]].sum())
        self._evaluate(sel[~skip], exact[~skip])
        return True

    def _prefetch(self, sel: np.ndarray) -> None:
        """Replay the pairs ``sel`` need and, while plans are found to skip against, the other undecided pairs of
        the pool that this ``decide_until`` will decide (time bound at most its limit) and that the plans found so
        far do not skip (a superset of what those need: later checks skip more): one batch per window, each
        replaying every memory structure it holds once (a batch costs about as much for a few hundred pairs as for
        a few thousand of the same structures)."""
        job, pr, pc = self.job, self.pr, self.pc
        need = [sel]
        if np.isfinite(job.found.threshold()):
            rest = self.order[~self.done[self.order]]
            rest = rest[(self.lb[rest] <= self.limit) & np.isnan(job.mem.values.get(pr[rest], pc[rest]))]
            need.append(rest[~self._skippable(rest, job.mem.lower.get(pr[rest], pc[rest]))])
        both = np.concatenate(need)
        job.mem.exact(pr[both], pc[both], job.deadline)

    def _evaluate(self, keep: np.ndarray, kept_mem: np.ndarray) -> None:
        """Every device order of the pairs ``keep`` in full (step times; the memory is the replay's: it depends on
        neither the device order nor the options outside the memory class)."""
        if not len(keep):
            return
        job = self.job
        reps = job.counts[self.pr[keep]]
        gid = _ranges(job.base["row_start"][self.pr[keep]], reps) * job.no + np.repeat(self.po[keep], reps)
        r = evaluate(job.spec, _batch_at(job.base, job.opts, gid, job.sp, job.hw.gpus_per_node), job.hw,
                     time_only=True)
        r["reserved_memory_bytes"] = np.repeat(kept_mem, reps)
        job.res.evaluated += len(gid)
        job.found.add(gid, r, np.ones(len(gid), bool))


def _row_bounds(spec, hw, base, opts, sp, chunk, deadline: float = math.inf, tick=None, usable: float = math.inf
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """(memory, step time) lower bounds of every (degrees x batch split) row over all its options and device
    orders, computed at the row's first order [derived]: the memory bound at the option of least activations (AC
    "full" where searched, else the least of every AC searched), the terms reshard-after-forward changes left out
    (``memory_lower_bound(any_reshard=True)``); the time bound the least over the options without AC where there
    are any (recompute is never negative and adds to compute, its bubble and nothing else), else over every time
    class. The time bound is computed only for rows whose memory bound is at most ``usable`` (the others cannot
    fit: +inf). Returns them and how many rows were bounded by ``deadline`` (the first ones; the others NaN)."""
    import time

    acs = sorted({(int(o[0]), int(o[1])) for o in opts.tolist()})
    full = [a for a in acs if a[0] == AC_MODES["full"]]
    mem_reps = [int(np.flatnonzero((opts[:, 0] == a) & (opts[:, 1] == e))[0]) for a, e in (full[:1] or acs)]
    _, trep = _time_classes(opts)
    none = [int(t) for t in trep if opts[t, 0] == AC_MODES["none"]]
    time_reps = none or [int(t) for t in trep]
    starts = base["row_start"]
    mem, tb = np.full(len(starts), np.inf), np.full(len(starts), np.inf)
    static = _static_bounds(spec, base, opts, sp, mem_reps[0])
    timed = 0
    for lo in range(0, len(starts), chunk):
        if time.perf_counter() > deadline:
            mem[lo:], tb[lo:] = np.nan, np.nan
            return mem, tb, lo
        if tick:
            tick(lo / len(starts))
        gid0 = starts[lo:lo + chunk] * len(opts)
        part, low = mem[lo:lo + len(gid0)], static[lo:lo + len(gid0)]  # (views: ``part`` filled in place)
        part[low > usable] = low[low > usable]  # (cannot fit whatever their batch split)
        rest = np.flatnonzero(low <= usable)
        for o in mem_reps:
            if len(rest):
                b = _batch_at(base, opts, gid0[rest] + o, sp, None)
                part[rest] = np.minimum(part[rest], memory_lower_bound(spec, b, hw, True))
        fit = np.flatnonzero(part <= usable)
        timed += len(fit)
        for o in time_reps:
            if len(fit):
                b = _batch_at(base, opts, gid0[fit] + o, sp, None)
                tb[lo + fit] = np.minimum(tb[lo + fit], step_time_lower_bound(spec, b, hw))
    tally(row_bounds=int((static <= usable).sum()) * len(mem_reps) + timed * len(time_reps))
    return mem, tb * (1.0 - 1e-9), len(starts)


def _static_bounds(spec, base, opts, sp, o: int) -> np.ndarray:
    """``optimizer_step_lower_bound`` of every row, computed once per (degrees, stages per rank) at its first row
    and option ``o`` (it reads neither the batch split nor the options)."""
    key = base["combo"] * (int(base["v"].max(initial=1)) + 1) + base["v"]
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    b = _batch_at(base, opts, base["row_start"][first] * len(opts) + o, sp, None)
    tally(static_bounds=len(first))
    return optimizer_step_lower_bound(spec, b)[np.ravel(inv)]


class _Memory:
    """Reserved memory of the search's (row, memory class) pairs: a lower bound (``memory_lower_bound``, no
    timeline) of the pairs of the rows ``bound_rows`` was given, and the exact value (``evaluate(memory_only=True)``:
    the step's timeline replayed) of the pairs the search asks for, replayed once and kept (NaN: not yet)."""

    def __init__(self, spec, hw, base, opts, sp, chunk, usable):
        self.spec, self.hw, self.base, self.opts, self.sp, self.chunk = spec, hw, base, opts, sp, chunk
        self.cls, self.rep = _memory_classes(opts)
        self.usable = usable
        nr = len(base["row_start"])
        self.lower, self.values = _PairTable(nr, len(self.rep)), _PairTable(nr, len(self.rep))
        self.n_exact = 0

    def bound_rows(self, rows: np.ndarray) -> None:
        """The memory bound of every (row, memory class) pair of ``rows`` (at the row's first device order and the
        class's representative option: it depends on neither)."""
        nc, starts, no = len(self.rep), self.base["row_start"], len(self.opts)
        idx = (rows[:, None] * nc + np.arange(nc)).ravel()
        for lo in range(0, len(idx), self.chunk):
            part = idx[lo:lo + self.chunk]
            gid = starts[part // nc] * no + self.rep[part % nc]
            self.lower.set(part // nc, part % nc, memory_lower_bound(
                self.spec, _batch_at(self.base, self.opts, gid, self.sp, None), self.hw))
        tally(memory_bounds=len(idx))

    def known(self, rows: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """The exact memory where replayed, else the pair's lower bound."""
        v = self.values.get(rows, classes)
        return np.where(np.isnan(v), self.lower.get(rows, classes), v)

    def exact(self, rows: np.ndarray, classes: np.ndarray, deadline: float = math.inf) -> np.ndarray:
        """The exact memory of these pairs, replaying those not replayed yet (NaN: not reached by ``deadline``)."""
        import time

        nc = len(self.rep)
        flat = rows * nc + classes
        todo = np.unique(flat[np.isnan(self.values.get(rows, classes))])
        starts, no = self.base["row_start"], len(self.opts)
        for lo in range(0, len(todo), self.chunk):
            if time.perf_counter() > deadline:
                break
            idx = todo[lo:lo + self.chunk]
            gidx = starts[idx // nc] * no + self.rep[idx % nc]
            b = _batch_at(self.base, self.opts, gidx, self.sp, None)
            self.values.set(idx // nc, idx % nc, evaluate(self.spec, b, self.hw, memory_only=True)[
                "reserved_memory_bytes"])
            self.n_exact += len(idx)
            tally(memory_replay_batches=1)
        return self.values.get(rows, classes)

    def fitting_plans(self) -> int:
        """Plans whose exact memory is known to fit (every device order of a replayed pair's options)."""
        per_class = np.bincount(self.cls, minlength=len(self.rep))  # options per memory class
        fits = np.nan_to_num(self.values.data, nan=np.inf) <= self.usable
        return int((fits * per_class[None, :]).sum(axis=1) @ self.base["row_count"][self.values.rows])


class _PairTable:
    """A value per (row, memory class) pair (NaN: not known), stored for the rows given one (a search bounds few of
    its rows: a dense table of every row's would be most of its memory and time)."""

    def __init__(self, n_rows: int, n_classes: int):
        self.slot = np.full(n_rows, -1, dtype=np.int64)  # row -> its row of ``data``
        self.data = np.full((0, n_classes), np.nan)
        self.rows = np.empty(0, dtype=np.int64)  # data's rows, in slot order

    def get(self, rows: np.ndarray, classes: np.ndarray) -> np.ndarray:
        s = self.slot[rows]
        if not len(self.data):
            return np.full(len(s), np.nan)
        return np.where(s >= 0, self.data[np.maximum(s, 0), classes], np.nan)

    def set(self, rows: np.ndarray, classes: np.ndarray, values: np.ndarray) -> None:
        new = np.unique(rows[self.slot[rows] < 0])
        if len(new):
            self.slot[new] = len(self.rows) + np.arange(len(new))
            self.rows = np.concatenate([self.rows, new])
            self.data = np.concatenate([self.data, np.full((len(new), self.data.shape[1]), np.nan)])
        self.data[self.slot[rows], classes] = values

    def rows_without(self) -> np.ndarray:
        return np.flatnonzero(self.slot < 0)

    def dense(self) -> np.ndarray:
        out = np.full((len(self.slot), self.data.shape[1]), np.nan)
        out[self.rows] = self.data
        return out


def _time_classes(opts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Option classes of equal step-time bound: it depends on the options only through AC, AC period, compile,
    float8 and the wrapper order (reshard-after-forward changes memory and collectives, which the bound leaves
    out) — ``tests/test_search.py`` checks it."""
    return _option_classes(opts, (0, 1, 2, 3, 5, 6))


def _pair_bounds(spec, hw, base, opts, sp, pr, po, chunk, deadline, tick=None) -> np.ndarray:
    """Step-time lower bound of every (row, option) pair over its device orders, computed once per (row, time
    class) at the row's first order (the bound depends on neither); pairs not reached by ``deadline`` get +inf
    (skipped unless needed)."""
    import time

    tcls, trep = _time_classes(opts)
    key = pr * len(trep) + tcls[po]
    uniq, inv = np.unique(key, return_inverse=True)
    lb = np.full(len(uniq), np.inf)
    starts, no = base["row_start"], len(opts)
    for lo in range(0, len(uniq), chunk):
        if time.perf_counter() > deadline:
            break
        u = uniq[lo:lo + chunk]
        gid = starts[u // len(trep)] * no + trep[u % len(trep)]
        lb[lo:lo + len(gid)] = step_time_lower_bound(spec, _batch_at(base, opts, gid, sp, None), hw)
        tally(time_bounds=len(gid))
        if tick:
            tick((lo + len(gid)) / len(uniq))
    return lb[inv] * (1.0 - 1e-9)  # rounding: the bound sums the same terms in another order


def result_to_dict(res: SearchResult, spec: ModelSpec, hw: HardwareProfile, n_gpus: int, sp: SearchSpace,
                   top: int) -> dict:
    from .machine import mfu_value

    def row(plan, step, mem, *rest):
        q = interval_factor(hw, plan)
        d = {"plan_id": plan.plan_id, "describe": plan.describe(), "step_time_s": step,
             "interval_s": [step / q, step * q], "reserved_memory_bytes": mem, "plan": plan.to_dict()}
        if rest:
            d.update(tokens_per_s_per_gpu=rest[0], mfu=mfu_value(rest[1], hw), dominant_cost=rest[2])
        return d

    out = {"model": spec.name, "profile": hw.name, "n_gpus": n_gpus, "global_batch_size": sp.global_batch_size,
           "seq_len": sp.seq_len, "considered": res.considered, "evaluated": res.evaluated, "fitting": res.fitting,
           "pruned_structural": res.pruned_structural, "pruned_memory": res.pruned_memory,
           "pruned_dominated": res.pruned_dominated, "pruned_bound": res.pruned_bound, "screened": res.screened,
           "stopped_at": res.stopped_at, "usable_memory_bytes": res.usable_memory_bytes, "wall_s": res.wall_s,
           "work": res.work,
           "top": [row(*t) for t in res.top[:top]], "pareto": [row(*p) for p in res.pareto]}
    if res.closest:
        plan, mem = res.closest
        out["closest"] = {"plan": plan.to_dict(), "reserved_memory_bytes": mem,
                          "shortfall_bytes": mem - res.usable_memory_bytes}
    return out

