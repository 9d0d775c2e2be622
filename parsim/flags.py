"""The plan flags of the command line, checked once for every command (predict, search, run, trace).

The plan flags are the plan schema's fields (``plan_schema.PLAN_FIELDS``: their names, ranges, choices and defaults
come from there). A flag the user did not give arrives as ``None``; ``DEFAULTS`` fills it in for the commands that
need one plan, and ``search_space`` turns every given flag into a pin of its space. Every value is checked here
before anything is enumerated, launched or written: out-of-range integers, unknown names, absurd sizes give one
ParsimError line. Torch-free.
"""

from __future__ import annotations

from typing import Any

from .codec import DP2EP_RULES, RuleError, validate_plan
from .errors import ParsimError, check_number
from .plan import AXES, MAX_GPUS, Plan, plan_from_flags
from .plan_schema import PINNED, PLAN_FIELDS, WRAPPERS, parse_ac

# the flags that say what to load (not what the plan is), then one flag per plan field (plan_schema)
LOAD_DEFAULTS = {"model": "llama3-8b", "gpus": None, "plan_file": None, "profile": "h100-sxm-spec-cal"}
FLAG_FIELDS = {("order" if f.name == "wrapper_order" else f.name): f for f in PLAN_FIELDS}
DEFAULTS = {**LOAD_DEFAULTS, **{k: f.cli_default for k, f in FLAG_FIELDS.items()}}
DEGREES = tuple(k for k, f in FLAG_FIELDS.items() if f.kind == "int" and f.high == MAX_GPUS)
# flag name -> (low, high) for the integer flags (a flag's 0 is "derived": left out, not given as 0)
INT_RANGES = {"gpus": (1, MAX_GPUS), **{k: (max(f.low, 1), f.high) for k, f in FLAG_FIELDS.items() if f.kind == "int"}}
CLI_NAMES = {k: "--" + k.replace("_", "-") for k in LOAD_DEFAULTS} | {"plan_file": "--plan"} | {
    k: f.cli_flag for k, f in FLAG_FIELDS.items()}
# flags that only say what to load, not what the plan is
NOT_PLAN = ("model", "profile", "plan_file", "gpus", "model_given", "profile_given")


def check_int(name: str, value, low: int, high: int) -> int:
    """``value`` as an int in [low, high], or one ParsimError line naming the flag."""
    check_number(name, value, low, high, integer=True)
    return value


def parse_mesh_order(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``--mesh-order`` -> (complete device order, axes the user left out). The user may list only the axes that
    matter (those > 1); the others go outermost in the default order (an axis of degree 1 does not move a rank)."""
    names = tuple(s.strip() for s in str(text).split(","))
    bad = [n for n in names if n not in AXES]
    if bad or len(set(names)) != len(names) or not names:
        raise ParsimError(f"--mesh-order {text!r}: expected distinct axes from {','.join(AXES)}")
    missing = tuple(a for a in AXES if a not in names)
    return missing + names, missing


def parse_wrapper_order(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in str(text).split(","))
    if sorted(names) != sorted(WRAPPERS):
        raise ParsimError(f"--order {text!r}: expected a permutation of {','.join(WRAPPERS)}")
    return names


def check_flags(given: dict) -> None:
    """Check every flag the user gave (value not None); raise one ParsimError line for the first bad one."""
    for k, v in given.items():
        if v is None:
            continue
        if k in INT_RANGES:
            low, high = INT_RANGES[k]
            if k == "dp_shard" and v == -1:
                continue
            check_int(CLI_NAMES[k], v, low, high)
    for k, f in FLAG_FIELDS.items():
        if given.get(k) is None or f.kind not in ("choice", "ac"):
            continue
        if f.kind == "ac":
            parse_ac(given[k])
        elif given[k] not in f.choices:
            raise ParsimError(f"{CLI_NAMES[k]} {given[k]!r}: expected one of {', '.join(f.choices)}")
    if given.get("mesh_order") is not None:
        parse_mesh_order(given["mesh_order"])
    if given.get("order") is not None:
        parse_wrapper_order(given["order"])
    for name in ("model", "profile", "plan_file"):
        if given.get(name) is not None and not str(given[name]).strip():
            raise ParsimError(f"{CLI_NAMES[name]} is empty")


def given_plan_flags(given: dict) -> list[str]:
    """CLI names of the plan flags the user gave (not model/profile/plan/gpus)."""
    return [CLI_NAMES[k] for k, v in given.items() if v is not None and k not in NOT_PLAN]


def gpus_of(given: dict) -> int:
    """--gpus, else the product of the degrees when --dp-shard was given explicitly, else refused."""
    if given.get("gpus") is not None:
        return given["gpus"]
    if given.get("dp_shard") in (None, -1):
        raise ParsimError("give --gpus (or every degree, --dp-shard included, and parsim multiplies them)")
    n = 1
    for a in AXES:
        n *= given.get(a) or 1
    if n > MAX_GPUS:
        raise ParsimError(f"the degrees multiply to {n} GPUs, more than the {MAX_GPUS} parsim plans for")
    return n


def plan_from_given(given: dict) -> Plan:
    """One Plan from the flags the user gave (defaults for the rest); ``--plan FILE`` is handled by the caller."""
    check_flags(given)
    f: dict[str, Any] = {k: (given.get(k) if given.get(k) is not None else d) for k, d in DEFAULTS.items()}
    gpus = gpus_of(given)
    sched = f["pp_schedule"]
    mesh_order, left_out = parse_mesh_order(f["mesh_order"])
    kw = {k: f[k] for k in FLAG_FIELDS if k not in ("mesh_order", "order")}
    kw |= dict(micro_batch_size=f["micro_batch_size"] or 0, global_batch_size=f["global_batch_size"] or 0,
               pp_stages_per_rank=f["pp_stages_per_rank"] or (2 if sched == "Interleaved1F1B" and f["pp"] > 1 else 1),
               mesh_order=mesh_order, wrapper_order=parse_wrapper_order(f["order"]))

    def build(kw: dict) -> Plan:
        plan = plan_from_flags(gpus, **kw)
        validate_plan(plan)  # the structural rules, once, here at the boundary
        return plan

    try:
        plan = build(kw)
    except RuleError as e:
        # dp2ep cannot take EP from dp_shard x cp x tp: DDP-style EP (from dp_replicate), else folded EP (over
        # dp_replicate x cp x tp) is picked when the user left --ep-from out and the plan is valid with it;
        # otherwise the dp2ep refusal stands
        if given.get("ep_from") is not None or e.rule not in DP2EP_RULES:
            raise
        for ep_from in ("dp_replicate", "folded"):
            try:
                plan = build({**kw, "ep_from": ep_from})
                break
            except ParsimError:
                continue
        else:
            raise e from None
    check_left_out_axes(plan.degrees, left_out)
    return plan


def check_left_out_axes(degrees: dict, left_out: tuple[str, ...]) -> None:
    big = [f"{a}={degrees[a]}" for a in left_out if degrees[a] > 1]
    if big:
        raise ParsimError(f"--mesh-order leaves out {', '.join(big)}: list every axis of degree > 1")


def search_space(given: dict, *, no_pp: bool = False, no_cp: bool = False, max_tp: int | None = None,
                 max_pp: int | None = None, ac_modes: str | None = None, default_mesh_order: bool = False,
                 headroom: float = 0.0, max_plans: int | None = None, max_seconds: float | None = None):
    """The SearchSpace of `parsim search` (``max_seconds``: stop after this long with the best plans so far): every
    plan flag the user gave pins its dimension (a degree, a batch size, the schedule, AC, compile, float8, SP,
    reshard, the device order, the wrapper order); none is ignored. Contradictory pins give one ParsimError line."""
    from .search import SearchSpace

    check_flags(given)
    if given.get("plan_file"):
        raise ParsimError("--plan is for predict, run and trace; search takes pins (--tp 8, --ac full, ...)")
    gpus = gpus_of(given)
    kw: dict = {"global_batch_size": given.get("global_batch_size") or gpus,
                "seq_len": given.get("seq_len") or DEFAULTS["seq_len"], "max_tp": max_tp, "max_pp": max_pp,
                "device_orders": not default_mesh_order, "headroom": headroom,
                "max_plans": max_plans, **({"max_seconds": max_seconds} if max_seconds is not None else {})}
    for a in DEGREES:
        if given.get(a) is not None and not (a == "dp_shard" and given[a] == -1):
            kw[a] = (given[a],)
    for a, off in (("pp", no_pp), ("cp", no_cp)):
        if off:
            if kw.get(a, (1,)) != (1,):
                raise ParsimError(f"--no-{a} contradicts --{a} {kw[a][0]}")
            kw[a] = (1,)
    for a in ("local_batch_size", "micro_batch_size"):
        if given.get(a) is not None:
            kw[a] = (given[a],)
    _pin_schedule(given, kw)
    if given.get("ac") is not None and ac_modes:
        raise ParsimError("give --ac (one mode) or --ac-modes (several), not both")
    if ac_modes is not None:
        kw["ac"] = tuple(a.strip() for a in ac_modes.split(","))
        for a in kw["ac"]:
            parse_ac(a)
    elif given.get("ac") is not None:
        kw["ac"] = (given["ac"],)
    for a in ("compile", "float8"):
        if given.get(a) is not None:
            kw[a] = (given[a],)
    if given.get("ep_from") is not None:
        kw["ep_from"] = (given["ep_from"],)
    kw["pins"] = tuple((f.name, given[f.name]) for f in PINNED if given.get(f.name) is not None)
    if given.get("fsdp_reshard_after_forward") is not None:
        kw["reshard"] = (given["fsdp_reshard_after_forward"],)
    if given.get("mesh_order") is not None:
        _pin_mesh_order(given["mesh_order"], kw)
    if given.get("order") is not None:
        kw["wrapper_orders"] = (parse_wrapper_order(given["order"]),)
    return gpus, SearchSpace(**kw)


def _pin_schedule(given: dict, kw: dict) -> None:
    """--pp-schedule pins the schedule; --pp-stages-per-rank 1 excludes Interleaved1F1B, >= 2 requires it."""
    sched, v = given.get("pp_schedule"), given.get("pp_stages_per_rank")
    if sched is not None:
        kw["pp_schedules"] = (sched,)
    if v is None:
        return
    if v == 1:
        if sched == "Interleaved1F1B":
            raise ParsimError("Interleaved1F1B needs --pp-stages-per-rank >= 2")
        kw.setdefault("pp_schedules", ("GPipe", "1F1B"))
    else:
        if sched not in (None, "Interleaved1F1B"):
            raise ParsimError(f"{sched} runs one stage per rank: --pp-stages-per-rank {v} needs Interleaved1F1B")
        kw["pp_schedules"] = ("Interleaved1F1B",)
        kw["stages_per_rank"] = (v,)


def _pin_mesh_order(text: str, kw: dict) -> None:
    """One device order; axes it leaves out are pinned to degree 1."""
    order, left_out = parse_mesh_order(text)
    for a in left_out:
        if kw.get(a, (1,)) != (1,):
            raise ParsimError(f"--mesh-order leaves out {a}, pinned to {kw[a][0]}: list every axis of degree > 1")
        kw[a] = (1,)
    kw["mesh_order"] = order
    kw["device_orders"] = False
