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

from .costmodel.batch import PlanBatch, group_rpn
from .costmodel.step import evaluate
from .errors import ParsimError, check_number
from .hardware import HardwareProfile
from .ordering import is_legal, searched_orders, violations
from .plan import AC_MODES, AXES, MAX_BATCH, MAX_GPUS, MAX_SEQ_LEN, PP_SCHEDULES, Plan
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
    sequence_parallel: bool | None = None  # None: on when tp > 1
    device_orders: bool = True  # False: only the default order (pp, dp_replicate, dp_shard, cp, tp)
    mesh_order: tuple | None = None  # one device order, pinned
    wrapper_orders: tuple | None = None  # wrapper orders, pinned (default: the legal ones searched_orders gives)
    headroom: float = 0.0  # fraction of usable memory kept free
    max_plans: int = MAX_PLANS  # 0: no limit

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
                v = [r for r in violations(order) if r.kind == "fundamental"][0]
                raise ParsimError(f"wrapper order {','.join(order)} puts {v.then} before {v.first}, which cannot "
                                  f"run: {v.reason}")
        if not (self.ac and self.compile and self.pp_schedules and self.reshard):
            raise ParsimError("a search dimension was pinned to nothing")


@dataclass
class SearchResult:
    considered: int = 0
    evaluated: int = 0
    fitting: int = 0
    pruned_structural: dict = field(default_factory=dict)  # reason -> degree combinations (or batch splits)
    pruned_memory: int = 0
    top: list = field(default_factory=list)  # [(Plan, step_time_s, peak_memory_bytes, tokens/s/GPU, mfu, dominant)]
    pareto: list = field(default_factory=list)  # [(Plan, step_time_s, peak_memory_bytes)] time asc, memory desc
    closest: tuple | None = None  # (Plan, peak_memory_bytes) when nothing fits
    usable_memory_bytes: float = 0.0
    wall_s: float = 0.0


def _count(d: dict, reason: str, n: int = 1):
    d[reason] = d.get(reason, 0) + n


def _allowed(values, pin, cap):
    out = [v for v in values if (pin is None or v in pin) and (cap is None or v <= cap)]
    return out


def _degree_combos(spec: ModelSpec, n_gpus: int, sp: SearchSpace, pruned: dict) -> list[tuple]:
    """(pp, dp_replicate, dp_shard, cp, tp, ep, etp) combinations that pass the structural checks."""
    divs = divisors(n_gpus)
    out = []
    heads, kv = spec.n_heads, (spec.n_heads if spec.mla else spec.n_kv_heads)
    for pp in _allowed(divs, sp.pp, sp.max_pp):
        for tp in _allowed(divs, sp.tp, sp.max_tp):
            if (n_gpus // pp) % tp:
                continue
            for cp in _allowed(divs, sp.cp, sp.max_cp):
                rest = n_gpus // pp
                if rest % (tp * cp):
                    continue
                rest //= tp * cp
                for dpr in _allowed(divisors(rest), sp.dp_replicate, None):
                    dps = rest // dpr
                    if sp.dp_shard is not None and dps not in sp.dp_shard:
                        continue
                    if heads % tp or kv % tp or spec.d_ff % tp:
                        _count(pruned, "tp does not divide heads / kv heads / d_ff")
                        continue
                    if spec.n_layers < pp:
                        _count(pruned, "more pipeline stages than layers")
                        continue
                    if cp > 1 and sp.seq_len % (2 * cp):
                        _count(pruned, "seq_len not divisible by 2 x cp")
                        continue
                    if tp > 1 and sp.sequence_parallel is not False and (sp.seq_len // cp) % tp:
                        _count(pruned, "seq_len / cp not divisible by tp (sequence parallel)")
                        continue
                    if sp.global_batch_size % (dpr * dps):
                        _count(pruned, "global batch not divisible by dp")
                        continue
                    for ep, etp in _ep_options(spec, dps, cp, tp, sp):
                        out.append((pp, dpr, dps, cp, tp, ep, etp))
    return out


def _ep_options(spec, dps, cp, tp, sp):
    if spec.moe is None:
        return [(1, 1)] if (sp.ep is None or 1 in sp.ep) and (sp.etp is None or 1 in sp.etp) else []
    base = dps * cp * tp
    opts = []
    for ep in _allowed(divisors(base), sp.ep, None):
        if spec.moe.n_experts % ep:
            continue
        for etp in sorted({1, tp}) if ep > 1 else [1]:
            if sp.etp is not None and etp not in sp.etp:
                continue
            if base % (ep * etp) == 0 and spec.moe.d_ff_expert % etp == 0:
                opts.append((ep, etp))
    return opts


def _base_rows(spec, combos, sp: SearchSpace, gpn: int, pruned: dict) -> dict:
    """Degrees x distinct device orders x batch splits, as arrays."""
    if not combos:
        return {}
    c = np.array(combos, dtype=np.int64)
    deg = {a: c[:, i] for i, a in enumerate(AXES)}
    ep, etp = c[:, 5], c[:, 6]
    # distinct device orders per combination: signature = ranks per node of every group
    if sp.mesh_order is not None:
        perms = [tuple(sp.mesh_order)]
    else:
        perms = list(permutations(AXES)) if sp.device_orders else [AXES]
    shell = _shell_batch(deg, ep, etp)
    sigs = []
    for order in perms:
        r = group_rpn(shell, order, gpn)
        sigs.append(np.stack([r[k] for k in sorted(r)], axis=1))
    sig = np.stack(sigs, axis=1)  # (combos, perms, groups)
    rows: dict[str, list] = {k: [] for k in ("combo", "perm", "lbs", "mbs", "sched", "v")}
    L = spec.n_layers
    # plans without PP carry the pinned schedule's name when one is pinned; they cannot honour a pinned v >= 2
    sched_pp1 = PP_SCHEDULES[sp.pp_schedules[0]] if len(sp.pp_schedules) == 1 else PP_SCHEDULES["1F1B"]
    pp1_ok = not (sp.pp_schedules == ("Interleaved1F1B",) and 1 not in sp.stages_per_rank)
    for i in range(len(c)):
        _, first = np.unique(sig[i], axis=0, return_index=True)
        perm_ids = sorted(first.tolist())
        pp, dp = int(c[i, 0]), int(c[i, 1] * c[i, 2])
        per_dp = sp.global_batch_size // dp
        batch = []
        for lbs in divisors(per_dp):
            if lbs > sp.max_local_batch_size or (sp.local_batch_size and lbs not in sp.local_batch_size):
                continue
            if pp == 1:
                if (sp.micro_batch_size and lbs not in sp.micro_batch_size) or not pp1_ok:
                    continue
                batch.append((lbs, lbs, sched_pp1, 1))
                continue
            for mbs in divisors(lbs):
                if sp.micro_batch_size and mbs not in sp.micro_batch_size:
                    continue
                m = lbs // mbs
                for s in sp.pp_schedules:
                    if s != "GPipe" and m < pp:
                        _count(pruned, f"{s}: fewer microbatches than stages")
                        continue
                    for v in (sp.stages_per_rank if s == "Interleaved1F1B" else (1,)):
                        if pp * v > L:
                            _count(pruned, "more pipeline stages than layers")
                            continue
                        batch.append((lbs, mbs, PP_SCHEDULES[s], v))
        for p in perm_ids:
            for lbs, mbs, s, v in batch:
                rows["combo"].append(i)
                rows["perm"].append(p)
                rows["lbs"].append(lbs)
                rows["mbs"].append(mbs)
                rows["sched"].append(s)
                rows["v"].append(v)
    out: dict[str, Any] = {k: np.array(v, dtype=np.int64) for k, v in rows.items()}
    out["combos"] = c
    out["perms"] = perms
    return out


def _shell_batch(deg, ep, etp) -> PlanBatch:
    """A PlanBatch with just the degrees set (enough for group_rpn)."""
    n = len(ep)
    z = np.zeros(n, dtype=np.int64)
    f = np.zeros(n, dtype=bool)
    return PlanBatch(pp=deg["pp"], dp_replicate=deg["dp_replicate"], dp_shard=deg["dp_shard"], cp=deg["cp"],
                     tp=deg["tp"], ep=ep, etp=etp, ep_ddp=f, seq_len=z, local_batch_size=z, micro_batch_size=z,
                     global_batch_size=z, sched=z, v=z, sp=f, raf=f, raf_always=f, ac=z, ac_every=z, compile=f,
                     float8=f, ac_wraps_compile=f, param_bytes=z, reduce_bytes=z, rpn={})


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


def _reshard(choice: np.ndarray, pp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(reshard_after_forward, reshard the output layer too) of RESHARD_CHOICES indices; default = no PP."""
    dflt = pp == 1
    raf = np.select([choice == 0, choice == 1, choice == 2], [dflt, ~dflt, np.ones_like(dflt)], np.zeros_like(dflt))
    return raf, (choice == 2) | ((choice == 1) & ~dflt)


def _reshard_name(choice: int, pp: int) -> str:
    name = RESHARD_CHOICES[choice]
    return ("never" if pp == 1 else "always") if name == "flip" else name


def _chunk_batch(base: dict, opts: np.ndarray, lo: int, hi: int, sp: SearchSpace, gpn: int) -> tuple:
    idx = np.arange(lo, hi, dtype=np.int64)
    n_opt = len(opts)
    bi, oi = idx // n_opt, idx % n_opt
    c = base["combos"][base["combo"][bi]]
    o = opts[oi]
    pp = c[:, 0]
    lbs = base["lbs"][bi]
    raf, raf_always = _reshard(o[:, 4], pp)
    n = len(idx)
    seq_par = (c[:, 4] > 1) & (sp.sequence_parallel is not False)
    b = PlanBatch(
        pp=pp, dp_replicate=c[:, 1], dp_shard=c[:, 2], cp=c[:, 3], tp=c[:, 4], ep=c[:, 5], etp=c[:, 6],
        ep_ddp=np.zeros(n, bool), seq_len=np.full(n, sp.seq_len), local_batch_size=lbs,
        micro_batch_size=base["mbs"][bi], global_batch_size=np.full(n, sp.global_batch_size),
        sched=base["sched"][bi], v=base["v"][bi], sp=seq_par, raf=raf, raf_always=raf_always,
        ac=o[:, 0], ac_every=o[:, 1], compile=o[:, 2].astype(bool), float8=o[:, 3].astype(bool),
        ac_wraps_compile=o[:, 5].astype(bool), param_bytes=np.full(n, 2), reduce_bytes=np.full(n, 4), rpn={},
    )
    # ranks per node: per device order present in the chunk
    perm = base["perm"][bi]
    rpn: dict | None = None
    for p in np.unique(perm):
        m = perm == p
        r = group_rpn(b.take(np.nonzero(m)[0]), base["perms"][p], gpn)
        if rpn is None:
            rpn = {k: np.ones(n, dtype=np.int64) for k in r}
        for k, v in r.items():
            rpn[k][m] = v
    b.rpn = rpn or {}
    return b, bi, oi


def plan_of(base: dict, opts: np.ndarray, gi: int, sp: SearchSpace) -> Plan:
    """Rebuild the Plan of global index ``gi``."""
    n_opt = len(opts)
    bi, oi = gi // n_opt, gi % n_opt
    c = base["combos"][base["combo"][bi]]
    o = opts[oi]
    pp = int(c[0])
    ac_code, every = int(o[0]), int(o[1])
    ac = {v: k for k, v in AC_MODES.items()}[ac_code]
    ac = f"layer:{every}" if ac == "layer" else ac
    return Plan(pp=pp, dp_replicate=int(c[1]), dp_shard=int(c[2]), cp=int(c[3]), tp=int(c[4]), ep=int(c[5]),
                etp=int(c[6]), mesh_order=tuple(base["perms"][base["perm"][bi]]), seq_len=sp.seq_len,
                local_batch_size=int(base["lbs"][bi]), global_batch_size=sp.global_batch_size,
                micro_batch_size=int(base["mbs"][bi]), pp_schedule=SCHED_NAMES[int(base["sched"][bi])],
                pp_stages_per_rank=int(base["v"][bi]), fsdp_reshard_after_forward=_reshard_name(int(o[4]), pp), ac=ac,
                compile=bool(o[2]), float8=bool(o[3]), wrapper_order=base["orders"][int(o[6])],
                sequence_parallel=sp.sequence_parallel)


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
    combos = _degree_combos(spec, n_gpus, sp, res.pruned_structural)
    base = _base_rows(spec, combos, sp, gpn, res.pruned_structural)
    opts, base["orders"] = _options(sp, hw)
    total = len(base.get("combo", ())) * len(opts)
    res.considered = total
    if total == 0:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(res.pruned_structural.items()))
        raise ParsimError(f"no plan of {spec.name} on {n_gpus} GPUs satisfies the pins and the model's structure"
                          + (f" ({why})" if why else ""))
    if sp.max_plans and total > sp.max_plans:
        raise ParsimError(f"the space holds {total:,} plans, more than --max-plans {sp.max_plans:,}: pin degrees, "
                          "AC or batch sizes, or raise --max-plans (0 = no limit)")
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
    for lo in range(0, total, chunk):
        hi = min(total, lo + chunk)
        b, _, _ = _chunk_batch(base, opts, lo, hi, sp, gpn)
        r = evaluate(spec, b, hw)
        gid = np.arange(lo, hi, dtype=np.int64)
        mem, step = r["peak_memory_bytes"], r["step_time_s"]
        fits = mem <= limit
        res.evaluated += hi - lo
        res.fitting += int(fits.sum())
        if csv_writer is not None:
            csv_writer(base, opts, gid, r, fits)
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
    res.pruned_memory = res.evaluated - res.fitting
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
    def row(plan, step, mem, *rest):
        d = {"plan_id": plan.plan_id, "describe": plan.describe(), "step_time_s": step, "peak_memory_bytes": mem,
             "plan": plan.to_dict()}
        if rest:
            d.update(tokens_per_s_per_gpu=rest[0], mfu=rest[1], dominant_cost=rest[2])
        return d

    out = {"model": spec.name, "profile": hw.name, "n_gpus": n_gpus, "global_batch_size": sp.global_batch_size,
           "seq_len": sp.seq_len, "considered": res.considered, "evaluated": res.evaluated, "fitting": res.fitting,
           "pruned_structural": res.pruned_structural, "pruned_memory": res.pruned_memory,
           "usable_memory_bytes": res.usable_memory_bytes, "wall_s": res.wall_s,
           "top": [row(*t) for t in res.top[:top]], "pareto": [row(*p) for p in res.pareto]}
    if res.closest:
        plan, mem = res.closest
        out["closest"] = {"plan": plan.to_dict(), "peak_memory_bytes": mem,
                          "shortfall_bytes": mem - res.usable_memory_bytes}
    return out


def to_torchtitan_toml(plan: Plan, spec: ModelSpec) -> str:
    """The plan as a torchtitan job config (TOML-era keys, shared/HARDWARE_FACTS.md)."""
    from .plan import parse_ac

    mode, every = parse_ac(plan.ac)
    ac_mode = {"none": "none", "full": "full", "selective-op": "selective", "layer": "selective"}[mode]
    ac_opt = "op" if mode == "selective-op" else str(every)
    bf = lambda v: "true" if v else "false"  # noqa: E731
    raf = {"default": "default", "always": "always", "never": "never"}[plan.fsdp_reshard_after_forward]
    lines = [
        f"# parsim plan {plan.plan_id} for {spec.name}: {plan.describe()}",
        f"# device order (outermost first): {','.join(plan.mesh_order)}"
        + ("" if plan.mesh_order == AXES else "  (torchtitan builds pp,dp_replicate,dp_shard,cp,tp: set it yourself)"),
        "[training]",
        f"local_batch_size = {plan.local_batch_size}",
        f"global_batch_size = {plan.global_batch_size}",
        f"seq_len = {plan.seq_len}",
        f'mixed_precision_param = "{plan.param_dtype}"',
        f'mixed_precision_reduce = "{plan.reduce_dtype}"',
        "",
        "[parallelism]",
        f"data_parallel_replicate_degree = {plan.dp_replicate}",
        f"data_parallel_shard_degree = {plan.dp_shard}",
        f'fsdp_reshard_after_forward = "{raf}"',
        f"tensor_parallel_degree = {plan.tp}",
        "enable_async_tensor_parallel = false",
        f"pipeline_parallel_degree = {plan.pp}",
        f'pipeline_parallel_schedule = "{plan.pp_schedule}"',
        f"pipeline_parallel_microbatch_size = {plan.micro_batch_size}",
        f"context_parallel_degree = {plan.cp}",
        f"expert_parallel_degree = {plan.ep}",
        f"expert_tensor_parallel_degree = {plan.etp}",
        "",
        "[activation_checkpoint]",
        f'mode = "{ac_mode}"',
        f'selective_ac_option = "{ac_opt}"',
        "",
        "[compile]",
        f"enable = {bf(plan.compile)}",
        "",
    ]
    if plan.float8:
        lines += ["[model]", 'converters = ["float8"]', "", "[float8]", "enable_fsdp_float8_all_gather = false", ""]
    return "\n".join(lines)

