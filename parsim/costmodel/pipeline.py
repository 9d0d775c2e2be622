"""The pipeline schedule's terms: schedule codes, the bubble, and the schedule simulated on shared cores."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..codec import PlanBatch
from ..hardware import HardwareProfile


class Action(NamedTuple):
    """One action of a pipeline rank's schedule: "F" | "B" (a forward or backward of ``microbatch``) or "UNSHARD" |
    "RESHARD" | "REDUCE_GRAD" (``microbatch`` -1) of ``stage`` (chunk x pp + rank)."""

    kind: str
    stage: int
    microbatch: int


class LeftOut(NamedTuple):
    """In a compressed action list (``interleaved_actions(compress=True)``): ``backwards`` backwards of ``stage``
    left out (a number, or one per plan where lists of several microbatch counts are merged)."""

    kind: str  # "LEFT_OUT_B"
    stage: int
    backwards: object

SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED = 0, 1, 2


def shared_cores(b: PlanBatch, hw: HardwareProfile, M, ga, compute_mb, t_mb, mean_compute_mb=None, work=None):
    """(factor on this rank's compute, pipeline bubble) [derived]. The bubble: ``ga (pp - 1) / v`` microbatch-times
    (Narayanan et al. 2021, sec. 2.2) where ranks do not share cores. ``compute_mb`` is the rank's compute per
    microbatch already stretched by ``compute_scale`` s; ``mean_compute_mb`` the same mean over the pipeline's
    stages (every rank sharing the cores runs one of them; None: this rank's).

    Two lower bounds of the time a pipeline rank's compute and bubble take; the larger is the estimate where the
    ranks' work is not given (search's step-time lower bound), the schedule's simulated step where it is (below):
    * the cores: together they run every rank's work, the stretched mean per rank, ``M x mean_compute_mb``;
    * the critical path: this rank's work at full speed plus its bubble at full speed (the cores idle ranks free).
    Taking this rank's own stretched compute (s x W) as the first bound, as if every rank did the most loaded
    stage's work, over-predicts: the last stage's output and loss made every pipeline on 4 ranks sharing 2 cores
    slow that way (tiny pp 4: +8.7%, tiny-moe pp 4: +23.6%). Where the bounds fall below the stretched compute of
    a rank heavier than the mean, its compute is scaled down (factor < 1, no bubble); else the factor is 1 and the
    rest is bubble. With s = 1 (no sharing) the factor is 1 and the bubble the plain one.

    The bubble's microbatch-time is the *other* stages' (their mean, from ``mean_compute_mb``), not this rank's
    [derived]. With stage times t_i = f_i + b_i per microbatch and m microbatches, GPipe's last stage starts its
    first forward after the stages before it ran theirs (sum of f_i) and the first stage ends its last backward
    after the later stages ran theirs: the step is m t_k + sum over i != k of t_i for the slowest stage k (1F1B
    reorders the same work; interleaving divides the fill by v). (pp - 1) t_k, the textbook form for equal stages,
    over-counts where the last stage carries the output projection and loss: tiny-moe pp 2 GPipe on 2 ranks ran
    1.065 / 1.068 s in two rounds against 1.362 predicted with the last stage's microbatch time (the bubble 0.447 s
    of 0.893 s compute; AVX2 EPYC).

    With ``work`` (the ranks' forward and backward per microbatch, ``step._stage_work``), pipelines whose ranks
    share cores (s > 1) take the schedule's simulated step instead of the larger bound (``shared_makespan``, at
    least both) [derived]. Re-scored on twelve stored fresh-machine folders (62 pipeline rows),
    pp 4 on 4 ranks: mean |error| 18.3% -> 12.7%, bias -17.1% -> -6.0% (six rows); every pipeline row 12.0% ->
    11.3%, bias -2.8% -> -1.9% (``bench/reports/pipeline-shared-cores/2026-11-29``)."""
    s = float(hw.corrections.get("compute_scale", 1.0))
    others_mb = compute_mb
    if mean_compute_mb is not None:  # the other stages' mean: pp x mean - own, over pp - 1 (own where pp is 1)
        others_mb = np.where(b.pp > 1, (b.pp * mean_compute_mb - compute_mb) / np.maximum(b.pp - 1, 1), compute_mb)
        others_mb = np.maximum(others_mb, 0.0)
    full_speed_mb = t_mb - compute_mb + others_mb / s  # exposed comm per microbatch is not stretched by s
    bubble1 = ga * (b.pp - 1) / b.pp_stages_per_rank * full_speed_mb
    own = M * compute_mb
    cores = own if (mean_compute_mb is None or s <= 1.0) else M * mean_compute_mb
    total = np.maximum(cores, M * compute_mb / s + bubble1)
    if work is not None and s > 1.0:
        total = _simulated(b, ga, work, s, total)
    factor = np.where((total < own) & (own > 0), total / np.where(own > 0, own, 1.0), 1.0)
    return factor, np.maximum(0.0, total - own)


def _simulated(b: PlanBatch, ga, work: tuple, s: float, total: np.ndarray) -> np.ndarray:
    """``total`` with the pipelines' rows replaced by ``shared_makespan``'s step per gradient-accumulation pass
    times the passes. ``work``: (forward, backward) per microbatch of the first rank, of the last, and of the
    middle layers, stretched by ``s``; the middle ranks share the middle layers evenly, and a rank's ``v`` stages
    its work evenly.

    The simulated schedule holds the compute alone: the step's comm terms add this rank's exposed collectives
    (TP / CP / EP per microbatch), and the fill's and drain's waits on the other ranks' collectives are left out
    (the bubble of ``shared_cores``' critical-path bound counts them). Counted as waits that free the cores, they
    made pp 2 x tp 2 plans on 4 ranks over-predicted: +8.8% on average over the 10 such rows of the stored 4-rank
    folders against -0.7% without them, the other pipelines' rows within 0.3 points either way."""
    out = np.array(total, dtype=float)
    n = len(b)
    f0, b0, f1, b1, fm, bm = (np.broadcast_to(np.asarray(x, dtype=float), (n,)) for fb in work for x in fb)
    gas = np.broadcast_to(np.asarray(ga, dtype=float), (n,))
    for i in np.flatnonzero(b.pp > 1):
        pp, v, m = int(b.pp[i]), int(b.pp_stages_per_rank[i]), int(b.n_micro[i])
        mid = [(fm[i] / max(pp - 2, 1), bm[i] / max(pp - 2, 1))] * (pp - 2)
        ranks = [(f0[i], b0[i]), *mid, (f1[i], b1[i])]
        out[i] = gas[i] * shared_makespan(int(b.pp_schedule[i]), pp, v, m, [(f / s / v, w / s / v) for f, w in ranks],
                                          s)
    return out


def interleaved_actions(pp: int, v: int, m: int, rank: int, compress: bool = False) -> list:
    """The actions torch's ``ScheduleInterleaved1F1B`` runs on pipeline rank ``rank`` with FSDP stages, in order:
    ("F" | "B", stage, microbatch), ("UNSHARD" | "RESHARD" | "REDUCE_GRAD", stage, -1); stage = chunk x pp + rank.

    [derived from torch 2.13 ``torch.distributed.pipelining.schedules``: ``_get_warmup_ops`` (the last rank warms
    up ``(v - 1) x microbatches_per_round`` forwards, two more per rank before it, at most ``v m``), then a forward
    and a backward each step, then the remaining backwards; forwards take chunks in rounds of
    ``microbatches_per_round = m // max(1, m // pp)``, backwards the reverse chunk order; ``_add_unshard_reshard``
    keeps at most 3 stages unsharded, unsharding each the first time one of the next 3 distinct stages to compute
    needs it and resharding those no longer among them; ``_add_reduce_grad`` reduces a stage after its m-th
    backward. ``tests/test_executor.py::test_interleaved_action_list_is_torchs_own`` checks this against the
    schedule class itself.]

    ``compress``: the steady 1F1B steps repeat with a period of ``v x microbatches_per_round`` steps (each stage
    one round of forwards and of backwards: the same stages in the same order, so the same UNSHARD / RESHARD, and
    every stage's in-flight count back where it was): the same memory moments each period once every stage has
    run its first backward (in the first period), and the same state at each period's start from the second on.
    The whole periods after the second are left out (a memory replay of 128 microbatches on 8 ranks runs 2 of the
    15) [derived]. What a backward leaves alive to the step's end (``memory._sent_held``) is not periodic: a
    ``LeftOut`` per stage (its backwards left out) stands before the second period, which then replays the last
    whole period (the same in-flight state, and what every backward before it left)."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = v * m
    nxt_f: dict[int, int] = {}
    nxt_b: dict[int, int] = {}

    def take(counter: dict, stage: int) -> int:
        counter[stage] = counter.get(stage, 0) + 1
        return counter[stage] - 1

    compute: list[Action] = []
    step_of: list[int] = []  # the schedule step each compute action belongs to
    steady = total - warmup
    for op in range(warmup + steady + warmup):
        if op < warmup + steady:  # warm-up, then 1F1B: a forward ...
            s = ((op // per_round) % v) * pp + rank
            compute.append(Action("F", s, take(nxt_f, s)))
            step_of.append(op)
        if op >= warmup:  # ... and from the 1F1B steps on a backward
            s = (v - 1 - ((op - warmup) // per_round) % v) * pp + rank
            compute.append(Action("B", s, take(nxt_b, s)))
            step_of.append(op)
    actions, steps = _with_fsdp_actions(compute, step_of, m)
    period = v * per_round
    repeats = steady // period - 2  # whole periods after the second
    if not compress or repeats <= 0:
        return actions
    lo, hi = warmup + 2 * period, warmup + (2 + repeats) * period
    kept = [(a, op) for a, op in zip(actions, steps, strict=True) if not lo <= op < hi]
    left: dict[int, int] = {}  # the backwards left out, by stage
    for a, op in zip(actions, steps, strict=True):
        if lo <= op < hi and a[0] == "B":
            left[a[1]] = left.get(a[1], 0) + 1
    # (at the second period's start: its moments are those of the last whole period, whose state differs from the
    # second's only by what the left-out backwards left alive)
    cut = next(i for i, (_a, op) in enumerate(kept) if op >= lo - period)
    return ([a for a, _op in kept[:cut]] + [LeftOut("LEFT_OUT_B", s, n) for s, n in sorted(left.items())]
            + [a for a, _op in kept[cut:]])


def _with_fsdp_actions(compute: list[Action], step_of: list[int], m: int, max_active: int = 3
                       ) -> tuple[list[Action], list[int]]:
    """``compute`` with torch's UNSHARD / RESHARD (``_add_unshard_reshard``) and REDUCE_GRAD (``_add_reduce_grad``)
    actions added (see ``interleaved_actions``), and the schedule step of each (an FSDP action: the step of the
    compute action it comes with)."""
    out: list[tuple[Action, int]] = []
    active: list[int] = []
    for i, act in enumerate(compute):
        upcoming: list[int] = []
        for _k, s, _mb in compute[i:]:
            if s not in upcoming:
                upcoming.append(s)
                if len(upcoming) == max_active:
                    break
        for s in [s for s in active if s not in upcoming]:
            active.remove(s)
            out.append((Action("RESHARD", s, -1), step_of[i]))
        for s in [s for s in upcoming if s not in active]:
            active.append(s)
            out.append((Action("UNSHARD", s, -1), step_of[i]))
        out.append((act, step_of[i]))
    end = step_of[-1] + 1 if step_of else 0
    out += [(Action("RESHARD", s, -1), end) for s in active]
    done: dict[int, int] = {}
    final: list[Action] = []
    steps: list[int] = []
    for act, op in out:
        final.append(act)
        steps.append(op)
        if act.kind == "B":
            done[act.stage] = done.get(act.stage, 0) + 1
            if done[act.stage] == m:
                final.append(Action("REDUCE_GRAD", act.stage, -1))
                steps.append(op)
    return final, steps


def schedule_order(schedule: int, pp: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """("F" | "B", stage, microbatch) in the order torch's schedule runs them on pipeline rank ``rank`` [derived
    from torch 2.13 ``torch.distributed.pipelining.schedules``, as ``executor.trace.torch_schedule_order`` reads
    them from the classes themselves]: GPipe every forward, then every backward; 1F1B ``min(m, pp - rank)`` warm-up
    forwards, then a backward and a forward while forwards remain, then the backwards; interleaved 1F1B
    ``interleaved_actions``' compute actions. Stage = chunk x pp + rank."""
    if schedule == SCHED_INTERLEAVED:
        return [a for a in interleaved_actions(pp, v, m, rank) if a[0] in ("F", "B")]
    if schedule == SCHED_GPIPE:
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    w = min(m, pp - rank)
    seq = [("F", rank, i) for i in range(w)]
    for i in range(m):
        seq.append(("B", rank, i))
        if w + i < m:
            seq.append(("F", rank, w + i))
    return seq


def shared_makespan(schedule: int, pp: int, v: int, m: int, work_s: list, scale: float) -> float:
    """Seconds from a pipeline step's first action to its last where the ranks share cores [derived]: an event
    simulation of the schedule's actions (``schedule_order``) under processor sharing. ``work_s[r]`` = (forward,
    backward) CPU seconds of one microbatch on one of rank r's stages at full speed (backward with its recompute).
    A forward needs the previous stage's forward of its microbatch done, a
    backward the next stage's backward. The ``world / pp`` pipelines run alike, all ranks of the world share the
    cores, and ``scale`` (``compute_scale``) is the slowdown with every rank busy; with k of a pipeline's pp ranks
    runnable each runs at ``1 / max(1, k x scale / pp)`` of full speed: fewer ranks than cores run at full speed.

    Why: ``shared_cores``' two lower bounds (the cores, the critical path) take their larger; the step is at
    least both. Where the fill and the drain leave cores idle while other ranks wait (4 ranks on 2 cores, pp 4,
    4 microbatches: rank 0 alone in its first forward and its last backward) both bounds are short of it: tiny
    pp 4 ran 0.75 s against 0.57 predicted with the cores' bound, its ranks using 85% of the 2 cores."""
    order = [schedule_order(schedule, pp, v, m, r) for r in range(pp)]
    last_stage = pp * v - 1
    done: set = set()
    pos, left = [0] * pp, [-1.0] * pp  # left: work left in the rank's current action (-1: not started)
    t, total = 0.0, sum(len(o) for o in order)
    while len(done) < total:
        running = []
        for r in range(pp):
            if pos[r] == len(order[r]):
                continue
            kind, stage, mb = order[r][pos[r]]
            if left[r] < 0:  # not started: its input (forward) or output gradient (backward) must be there
                dep = ("F", stage - 1, mb) if kind == "F" else ("B", stage + 1, mb)
                if (kind == "F" and stage > 0 or kind == "B" and stage < last_stage) and dep not in done:
                    continue
                left[r] = work_s[r][0 if kind == "F" else 1]
            running.append(r)
        if not running:
            raise ValueError("pipeline schedule deadlocked")  # torch's orders do not
        rate = 1.0 / max(1.0, len(running) * scale / pp)
        dt = min(left[r] for r in running) / rate
        t += dt
        for r in running:
            left[r] -= dt * rate
            if left[r] <= 1e-12 * (1.0 + t):
                done.add(order[r][pos[r]])
                pos[r], left[r] = pos[r] + 1, -1.0
    return t
