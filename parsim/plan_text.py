"""Plans in a few characters: the words of search's tables (degrees in device order, options as letters, batch,
AC, schedule), shared by the command line's tables and the rows a search job writes. Torch-free."""

from __future__ import annotations


def order_str(plan) -> str:
    """The device order of the axes > 1, outermost first (``pp>dp_shard>tp``)."""
    axes = [a for a in plan.mesh_order if getattr(plan, a) > 1]
    return ">".join(axes) or "-"


SHORT_AXES = {"pp": "pp", "dp_replicate": "dpr", "dp_shard": "fsdp", "cp": "cp", "tp": "tp"}
SHORT_AC = {"none": "-", "full": "full", "selective-op": "sel", "core-attn": "attn"}
SHORT_DOMINANT = {"compute_backward": "bwd", "compute_forward": "fwd", "recompute": "recomp", "pp_bubble": "bubble",
                  "optimizer": "optim", "comm_interference": "interf"}
WRAPPER_LETTERS = {"pp": "P", "tp": "T", "ac": "A", "compile": "C", "fsdp": "F"}
WRAPPER_NAMES = {"pp": "pipeline", "tp": "tensor parallel", "ac": "activation checkpointing", "compile": "compile",
                 "fsdp": "FSDP"}


def short_degrees(plan) -> str:
    """Degrees in device order (outermost first; axes of degree 1 left out, as they place no rank), short names:
    ``pp4 dpr2 fsdp8 tp4 ep8`` (``ep8d``: EP borrowed from dp_replicate, ``ep8f``: folded over
    dp_replicate x cp x tp)."""
    parts = [f"{SHORT_AXES[a]}{getattr(plan, a)}" for a in plan.mesh_order if getattr(plan, a) > 1]
    if plan.ep > 1:
        parts.append(f"ep{plan.ep}" + (f"/{plan.etp}" if plan.etp > 1 else "")
                     + {"dp_replicate": "d", "folded": "f"}.get(plan.ep_from, ""))
    return " ".join(parts) or "1 GPU"


def short_options(plan) -> str:
    """compile (C), float8 (F8, rowwise r / gw_hp g), reshard never/always (R-/R+), the schema's options that are on
    (their ``letters``: async TP aTP, distributed optimizer ZeRO1, TE layers TE, fused loss FL), a wrapper order
    other than PP>TP>AC>compile>FSDP (its letters)."""
    from parsim.plan import DEFAULT_ORDER
    from parsim.plan_schema import options_on

    out = []
    if plan.compile:
        out.append("C")
    if plan.float8:
        out.append("F8" + {"tensorwise": "", "rowwise": "r", "rowwise_with_gw_hp": "g"}[plan.float8_recipe])
    if plan.fsdp_reshard_after_forward != "default":
        out.append("R-" if plan.fsdp_reshard_after_forward == "never" else "R+")
    out += options_on(plan, "letters")
    if tuple(plan.wrapper_order) != DEFAULT_ORDER:
        out.append("".join(WRAPPER_LETTERS[w] for w in plan.wrapper_order))
    return " ".join(out) or "-"


def short_batch(plan) -> str:
    """local/micro batch, and the gradient-accumulation steps when more than one (``4/1 ga2``)."""
    ga = plan.grad_accum_steps
    return f"{plan.local_batch_size}/{plan.micro_batch_size}" + (f" ga{ga}" if ga > 1 else "")


def short_ac(ac: str) -> str:
    return SHORT_AC.get(ac, ac.replace("layer:", "L"))


def sched_str(plan) -> str:
    if plan.pp == 1:
        return "-"
    name = "I1F1B" if plan.pp_schedule == "Interleaved1F1B" else plan.pp_schedule
    return name + (f"/v{plan.pp_stages_per_rank}" if plan.pp_stages_per_rank > 1 else "")


def legend() -> str:
    """Every abbreviation of search's short tables, spelled out, built from the tables above and the plan schema's
    letters (so a new abbreviation is explained where it is defined)."""
    from parsim.plan import DEFAULT_ORDER
    from parsim.plan_schema import PLAN_FIELDS

    axes = ", ".join(f"{s} {a}" for a, s in SHORT_AXES.items() if s != a)
    same = ", ".join(a for a, s in SHORT_AXES.items() if s == a)
    ac = ", ".join(f"{s} {a}" for a, s in SHORT_AC.items() if s != a) + ", LN every N-th layer (layer:N)"
    letters = ", ".join(f"{f.letters} {f.label or f.name}" for f in PLAN_FIELDS if f.letters)
    wrappers = ", ".join(f"{w} {WRAPPER_NAMES[name]}" for name, w in WRAPPER_LETTERS.items())
    bound = ", ".join(f"{s} {k.replace('_', ' ')}" for k, s in SHORT_DOMINANT.items())
    default = "".join(WRAPPER_LETTERS[w] for w in DEFAULT_ORDER)
    return (f"degrees (device order, outermost first): {same} as named, {axes}, epN expert parallel (/M expert TP; "
            f"d: borrowed from dp_replicate, f: folded over dp_replicate x cp x tp). sched: I1F1B Interleaved1F1B, "
            f"/vN stages per rank. batch: local/micro, gaN gradient accumulation steps. AC: {ac}. options: C compile, "
            f"F8 float8 tensorwise (F8r rowwise, F8g rowwise with high-precision grad weights), R- / R+ reshard "
            f"after forward never / always, {letters}; a wrapper order other than {default} in its letters "
            f"({wrappers}). bound: the largest step-time component ({bound}; a mesh axis: its collectives)")
