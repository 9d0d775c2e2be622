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
from dataclasses import dataclass, field
from itertools import permutations
from typing import Any

import numpy as np

from .codec import DTYPES, PlanBatch, batch_of, decode, group_rpn, invalid_reasons
from .costmodel.step import evaluate
from .errors import ParsimError, check_number
from .hardware import HardwareProfile
from .ordering import effective_rules, is_legal, searched_orders, violations
from .plan import (
    AC_MODES,
    AXES,
    DEFAULT_ORDER,
    EP_FROM,
    FLOAT8_RECIPES,
    MAX_BATCH,
    MAX_GPUS,
    MAX_SEQ_LEN,
    PP_SCHEDULES,
    RAF_MODES,
    Plan,
)
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
# larger spaces are refused with their count (~2 min at the ~400k plans/s measured here): pin, or raise --max-plans
MAX_PLANS = 50_000_000


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
    sequence_parallel: bool | None = None  # None: on when tp > 1
    device_orders: bool = True  # False: only the default order (pp, dp_replicate, dp_shard, cp, tp)
    mesh_order: tuple | None = None  # one device order, pinned
    wrapper_orders: tuple | None = None  # wrapper orders, pinned (default: the legal ones searched_orders gives)
    headroom: float = 0.0  # fraction of usable memory kept free
    # pinned options the executor cannot run here (not enumerated: set for every plan when the user asks)
    float8_recipe: str = "tensorwise"
    async_tp: bool = False
    distributed_optimizer: bool = False
    max_plans: int = MAX_PLANS  # 0: no limit
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
        if not (self.ac and self.compile and self.pp_schedules and self.reshard and self.ep_from):
            raise ParsimError("a search dimension was pinned to nothing")


@dataclass
class SearchResult:
    considered: int = 0
    evaluated: int = 0
    fitting: int = 0
    pruned_structural: dict = field(default_factory=dict)  # reason -> degree combinations (or batch splits)
    pruned_memory: int = 0
    screened: int = 0  # (degrees x batch split x memory class) rows whose memory was computed before evaluation
    pruned_dominated: int = 0  # plans skipped as no faster and no smaller than a kept plan
    stopped_at: float | None = None  # fraction of the space searched when --max-seconds stopped the search
    top: list = field(default_factory=list)  # [(Plan, step_time_s, peak_memory_bytes, tokens/s/GPU, mfu, dominant)]
    pareto: list = field(default_factory=list)  # [(Plan, step_time_s, peak_memory_bytes)] time asc, memory desc
    closest: tuple | None = None  # (Plan, peak_memory_bytes) when nothing fits
    usable_memory_bytes: float = 0.0
    wall_s: float = 0.0


def _allowed(values, pin, cap):
    out = [v for v in values if (pin is None or v in pin) and (cap is None or v <= cap)]
    return out


def _degree_combos(spec: ModelSpec, n_gpus: int, sp: SearchSpace) -> list[tuple]:
    """(pp, dp_replicate, dp_shard, cp, tp, ep, etp, ep_ddp) of the space (pins and caps); the rules prune later."""
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
    """(ep, etp, ep_ddp): none for a dense model; dp2ep borrows ep x etp from dp_shard x cp x tp (etp 1 or tp),
    DDP-style EP borrows ep from dp_replicate."""
    opts = [(1, 1, 0)]
    if spec.moe is not None and "dp_shard" in sp.ep_from:
        opts += [(ep, etp, 0) for ep in divisors(dps * cp * tp) if ep > 1 for etp in sorted({1, tp})]
    if spec.moe is not None and "dp_replicate" in sp.ep_from:
        opts += [(ep, 1, 1) for ep in divisors(dpr) if ep > 1]
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
    combos = np.array(_degree_combos(spec, n_gpus, sp), dtype=np.int64).reshape(-1, 8)
    splits: dict[tuple, list] = {}
    rows: list[tuple] = []
    for i, deg in enumerate(combos.tolist()):
        key = (deg[0] > 1, deg[1] * deg[2])
        if key not in splits:
            splits[key] = _batch_splits(deg[0], deg[1] * deg[2], sp)
        rows += [(i, *s) for s in splits[key]]
    r = np.array(rows, dtype=np.int64).reshape(-1, 5)
    c = combos[r[:, 0]]
    cols = {**{a: c[:, k] for k, a in enumerate(AXES + ("ep", "etp", "ep_ddp"))},
            "seq_len": sp.seq_len, "global_batch_size": sp.global_batch_size, "local_batch_size": r[:, 1],
            "micro_batch_size": r[:, 2], "sched": r[:, 3], "v": r[:, 4], "sp": sp.sequence_parallel, "raf_mode": 0,
            "ac": 0, "ac_every": 1, "compile": False, "float8": False, "param_dtype": DTYPES.index("bfloat16"),
            "reduce_dtype": DTYPES.index("float32"), "mesh_idx": 0, "wrapper_idx": 0}
    return combos, r, batch_of(cols, (AXES,), (DEFAULT_ORDER,), None)


def _base_rows(spec, n_gpus: int, sp: SearchSpace, gpn: int, pruned: dict) -> dict:
    """The legal (degrees, batch split) rows crossed with their distinct device orders, as arrays; what the rules
    prune is counted by reason in ``pruned``."""
    combos, rows, b = candidates(spec, n_gpus, sp)
    reasons = invalid_reasons(b, spec)
    for k, n in zip(*np.unique(reasons[reasons != ""].astype(str), return_counts=True), strict=True):
        pruned[str(k)] = int(n)
    rows = rows[reasons == ""]
    if not len(rows):
        return {}
    # distinct device orders per combination: signature = ranks per node of every group
    if sp.mesh_order is not None:
        perms = [tuple(sp.mesh_order)]
    else:
        perms = list(permutations(AXES)) if sp.device_orders else [AXES]
    used = np.unique(rows[:, 0])
    deg = {a: combos[used, k] for k, a in enumerate(AXES)}
    sig = np.stack([_signature(deg, combos[used, 5], combos[used, 6], combos[used, 7], o, gpn) for o in perms], axis=1)
    perm_ids = {int(u): sorted(np.unique(sig[j], axis=0, return_index=True)[1].tolist()) for j, u in enumerate(used)}
    reps = np.array([len(perm_ids[int(ci)]) for ci in rows[:, 0]], dtype=np.int64)
    out: dict[str, Any] = {"combo": np.repeat(rows[:, 0], reps), "lbs": np.repeat(rows[:, 1], reps),
                           "mbs": np.repeat(rows[:, 2], reps), "sched": np.repeat(rows[:, 3], reps),
                           "v": np.repeat(rows[:, 4], reps)}
    out["perm"] = np.array([p for ci in rows[:, 0] for p in perm_ids[int(ci)]], dtype=np.int64)
    out["combos"] = combos
    out["perms"] = perms
    return out


def _signature(deg: dict, ep, etp, ep_ddp, order: tuple, gpn: int) -> np.ndarray:
    """Ranks per node of every communication group of these degrees in this device order."""
    cols = {**deg, "ep": ep, "etp": etp, "ep_ddp": ep_ddp, "seq_len": 1, "global_batch_size": 1,
            "local_batch_size": 1, "micro_batch_size": 1, "sched": 0, "v": 1, "sp": False, "raf_mode": 0, "ac": 0,
            "ac_every": 1, "compile": False, "float8": False, "param_dtype": 0, "reduce_dtype": 0, "mesh_idx": 0,
            "wrapper_idx": 0}
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
                    np.where(pp == 1, RAF_MODES.index("never"), RAF_MODES.index("always")), named)


def _chunk_batch(base: dict, opts: np.ndarray, lo: int, hi: int, sp: SearchSpace, gpn: int | None) -> PlanBatch:
    """Plans ``lo..hi`` of the space (base row x option row) as a batch."""
    return _batch_at(base, opts, np.arange(lo, hi, dtype=np.int64), sp, gpn)


def _batch_at(base: dict, opts: np.ndarray, idx: np.ndarray, sp: SearchSpace, gpn: int | None) -> PlanBatch:
    """The plans of global indices ``idx`` (base row x option row) as a batch."""
    bi, oi = idx // len(opts), idx % len(opts)
    c = base["combos"][base["combo"][bi]]
    o = opts[oi]
    cols = {**{a: c[:, k] for k, a in enumerate(AXES + ("ep", "etp", "ep_ddp"))},
            "seq_len": sp.seq_len, "global_batch_size": sp.global_batch_size, "local_batch_size": base["lbs"][bi],
            "micro_batch_size": base["mbs"][bi], "sched": base["sched"][bi], "v": base["v"][bi],
            "sp": sp.sequence_parallel, "raf_mode": _raf_mode(o[:, 4], c[:, 0]), "ac": o[:, 0], "ac_every": o[:, 1],
            "compile": o[:, 2], "float8": o[:, 3], "param_dtype": DTYPES.index("bfloat16"),
            "reduce_dtype": DTYPES.index("float32"), "mesh_idx": base["perm"][bi], "wrapper_idx": o[:, 6],
            "f8_recipe": FLOAT8_RECIPES.index(sp.float8_recipe), "async_tp": sp.async_tp & (c[:, 4] > 1),
            "dist_opt": sp.distributed_optimizer & (c[:, 1] > 1)}
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


def _memory_classes(opts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(class of every option, one representative option per class): peak memory depends on the options only
    through AC mode, AC period and reshard-after-forward (compile, float8 and the wrapper order change time, not
    what is held) — ``tests/test_search.py`` checks the pruned search against the exhaustive one."""
    keys = [(o[0], o[1], o[4]) for o in opts.tolist()]
    uniq = list(dict.fromkeys(keys))
    cls = np.array([uniq.index(k) for k in keys], dtype=np.int64)
    rep = np.array([keys.index(k) for k in uniq], dtype=np.int64)
    return cls, rep


def _screen(spec, hw, base: dict, opts: np.ndarray, sp: SearchSpace, gpn: int, limit: float, chunk: int,
            deadline: float = math.inf):
    """Peak memory of every (base row, memory class): a (rows x classes) array, from one representative option
    per class (rows not screened by ``deadline`` (perf_counter) are left at infinity: not searched)."""
    import time

    cls, rep = _memory_classes(opts)
    nb, nc = len(base["combo"]), len(rep)
    mem = np.full(nb * nc, np.inf)
    for lo in range(0, nb * nc, chunk):
        if time.perf_counter() > deadline:
            break
        idx = np.arange(lo, min(nb * nc, lo + chunk), dtype=np.int64)
        gidx = (idx // nc) * len(opts) + rep[idx % nc]
        mem[lo:lo + len(idx)] = evaluate(spec, _batch_at(base, opts, gidx, sp, gpn), hw,
                                         memory_only=True)["peak_memory_bytes"]
    return mem.reshape(nb, nc), cls, rep


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


def search(spec: ModelSpec, hw: HardwareProfile, n_gpus: int, sp: SearchSpace, top_k: int = 10,
           chunk: int = 200_000, progress=None, csv_writer=None) -> SearchResult:
    """Search the whole space; ``progress(done, total)`` is called after each chunk; ``csv_writer(plans_fn,
    arrays)`` receives every evaluated chunk when given."""
    import time

    t0 = time.perf_counter()
    check_number("--gpus", n_gpus, 1, MAX_GPUS, integer=True)
    gpn = hw.gpus_per_node
    res = SearchResult(usable_memory_bytes=hw.usable_memory_bytes * (1.0 - sp.headroom))
    base = _base_rows(spec, n_gpus, sp, gpn, res.pruned_structural)
    opts, base["orders"] = _options(sp, hw)
    nb = len(base.get("combo", ()))
    res.considered = nb * len(opts)
    prune = sp.prune and csv_writer is None  # a CSV of every plan needs every plan evaluated
    if prune:
        opts, dropped = _undominated(opts)
        res.pruned_dominated = nb * dropped
    total = nb * len(opts)
    if total == 0:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(res.pruned_structural.items()))
        raise ParsimError(f"no plan of {spec.name} on {n_gpus} GPUs satisfies the pins and the model's structure"
                          + (f" ({why})" if why else ""))
    if sp.max_plans and res.considered > sp.max_plans:
        raise ParsimError(f"the space holds {res.considered:,} plans, more than --max-plans {sp.max_plans:,}: pin "
                          "degrees, AC or batch sizes, or raise --max-plans (0 = no limit)")
    cand_t: list[np.ndarray] = []
    cand_m: list[np.ndarray] = []
    cand_i: list[np.ndarray] = []
    cand_tps: list[np.ndarray] = []
    cand_mfu: list[np.ndarray] = []
    cand_dom: list[np.ndarray] = []
    par_t: list[np.ndarray] = []
    par_m: list[np.ndarray] = []
    par_i: list[np.ndarray] = []
    closest = (np.inf, -1)
    limit = res.usable_memory_bytes
    deadline = t0 + sp.max_seconds if sp.max_seconds else math.inf
    if prune:  # memory of every (row, memory class) first: only plans that fit are evaluated in full
        # with a time limit, screening may take 40% of it, full evaluation the rest
        screen_deadline = t0 + 0.4 * sp.max_seconds if sp.max_seconds else math.inf
        mem_cls, cls, rep = _screen(spec, hw, base, opts, sp, gpn, limit, chunk, screen_deadline)
        res.screened = int(np.isfinite(mem_cls).sum())
        fit_cls = mem_cls <= limit
        if np.isinf(mem_cls).any() and res.stopped_at is None:
            res.stopped_at = float(np.isfinite(mem_cls).mean())  # screening ran out of time
        if not fit_cls.any() and np.isfinite(mem_cls).any():
            j = int(np.argmin(mem_cls))
            closest = (float(mem_cls.flat[j]), int((j // mem_cls.shape[1]) * len(opts) + rep[j % mem_cls.shape[1]]))
    for lo in range(0, total, chunk):
        if time.perf_counter() > deadline:
            res.stopped_at = (res.stopped_at if res.stopped_at is not None else 1.0) * lo / total
            break
        hi = min(total, lo + chunk)
        gid = np.arange(lo, hi, dtype=np.int64)
        if prune:
            gid = gid[fit_cls[gid // len(opts), cls[gid % len(opts)]]]
            if not len(gid):
                if progress:
                    progress(hi, total)
                continue
        b = _batch_at(base, opts, gid, sp, gpn)
        r = evaluate(spec, b, hw)
        mem, step = r["peak_memory_bytes"], r["step_time_s"]
        fits = mem <= limit
        res.evaluated += len(gid)
        res.fitting += int(fits.sum())
        if csv_writer is not None:
            csv_writer(b, r, fits)
        if not fits.all():
            j = int(np.argmin(mem))
            if mem[j] < closest[0]:
                closest = (float(mem[j]), int(gid[j]))
        if fits.any():
            f = np.nonzero(fits)[0]
            k = min(top_k, len(f))
            sel = f[np.lexsort((gid[f], step[f]))[:k]]
            for acc, arr in ((cand_t, step), (cand_m, mem), (cand_i, gid), (cand_tps, r["tokens_per_s_per_gpu"]),
                             (cand_mfu, r["mfu"]), (cand_dom, r["dominant"])):
                acc.append(arr[sel])
            pf = f[_pareto(step[f], mem[f], gid[f])]
            for acc, arr in ((par_t, step), (par_m, mem), (par_i, gid)):
                acc.append(arr[pf])
        if progress:
            progress(hi, total)
    res.pruned_memory = total - res.fitting if res.stopped_at is None else res.evaluated - res.fitting
    if cand_t:
        t, m, i = np.concatenate(cand_t), np.concatenate(cand_m), np.concatenate(cand_i)
        tps, mfu, dom = np.concatenate(cand_tps), np.concatenate(cand_mfu), np.concatenate(cand_dom)
        order = np.lexsort((i, t))[:top_k]
        res.top = [(plan_of(base, opts, int(i[j]), sp), float(t[j]), float(m[j]), float(tps[j]), float(mfu[j]),
                    str(dom[j])) for j in order]
        t, m, i = np.concatenate(par_t), np.concatenate(par_m), np.concatenate(par_i)
        keep = _pareto(t, m, i)
        res.pareto = [(plan_of(base, opts, int(i[j]), sp), float(t[j]), float(m[j])) for j in keep]
    elif closest[1] >= 0:
        res.closest = (plan_of(base, opts, closest[1], sp), closest[0])
    res.wall_s = time.perf_counter() - t0
    return res


def result_to_dict(res: SearchResult, spec: ModelSpec, hw: HardwareProfile, n_gpus: int, sp: SearchSpace,
                   top: int) -> dict:
    q = math.exp(hw.interval_log_halfwidth)

    def row(plan, step, mem, *rest):
        d = {"plan_id": plan.plan_id, "describe": plan.describe(), "step_time_s": step,
             "interval_s": [step / q, step * q], "peak_memory_bytes": mem, "plan": plan.to_dict()}
        if rest:
            d.update(tokens_per_s_per_gpu=rest[0], mfu=rest[1], dominant_cost=rest[2])
        return d

    out = {"model": spec.name, "profile": hw.name, "n_gpus": n_gpus, "global_batch_size": sp.global_batch_size,
           "seq_len": sp.seq_len, "considered": res.considered, "evaluated": res.evaluated, "fitting": res.fitting,
           "pruned_structural": res.pruned_structural, "pruned_memory": res.pruned_memory,
           "pruned_dominated": res.pruned_dominated, "screened": res.screened, "stopped_at": res.stopped_at,
           "usable_memory_bytes": res.usable_memory_bytes, "wall_s": res.wall_s,
           "top": [row(*t) for t in res.top[:top]], "pareto": [row(*p) for p in res.pareto]}
    if res.closest:
        plan, mem = res.closest
        out["closest"] = {"plan": plan.to_dict(), "peak_memory_bytes": mem,
                          "shortfall_bytes": mem - res.usable_memory_bytes}
    return out

