"""`search --framework`: rank only the plans the target framework can run as planned (torch-free).

Each framework's space is the search space less what its emitter's gap table (``parsim.emit``: ``torchtitan_gaps``,
``megatron_gaps``) says it runs otherwise; the dimensions are cut before the search (so the bounds and the ranking
see only expressible plans), and the ranked plans are checked against the gap table after it (a combination the
cuts do not catch is dropped, never ranked). What each cut stands for, with the gap it avoids:

* torchtitan (0.3.0) and torchtitan-0.2: the mesh in torchtitan's order (pp, dp_replicate, dp_shard, cp, tp) and
  its wrapper order (PP > TP > AC > compile > FSDP): neither has an option; EP borrowed from dp_shard x cp x tp
  (dp2ep) only. 0.3.0 also: float8 rowwise only (tensorwise removed, PR #3127), no layer:N AC (FullAC,
  SelectiveAC, MemoryBudgetAC only), no expert TP (PR #3167).
* megatron: its group order and the default wrapper order; no torch.compile (fused TE / apex kernels instead);
  AC none or full (its selective recompute is core attention only, not per-op SAC; block recompute takes the
  first layers of a stage, not every N-th); 1F1B or interleaved 1F1B (no GPipe); reshard after forward as
  Megatron-FSDP does; EP laid out as Megatron's expert mesh (folded); float8 tensorwise (TE's current scaling);
  gradients reduced once per step (``grad_sync`` once: no_sync for every microbatch but the last).
* torchtitan: gradients reduced after every gradient-accumulation pass (``grad_sync`` every-pass).
"""

from __future__ import annotations

import dataclasses

from .errors import ParsimError

FRAMEWORKS = ("torchtitan", "torchtitan-0.2", "megatron")
TORCHTITAN_VERSION = {"torchtitan": "0.3.0", "torchtitan-0.2": "0.2"}
# gap lines of the Megatron table that say how a plan is written, not that Megatron runs something else
MEGATRON_NOTES = ("FSDP over", "float8 and TP communication overlap need Transformer Engine layers")


def restrict_space(sp, framework: str | None):
    """``sp`` cut to what ``framework`` can run; a pin the user gave that it cannot run is one ParsimError."""
    if framework is None:
        return sp
    check_framework(framework)
    from .plan import DEFAULT_ORDER, parse_ac
    from .plan_schema import AXES

    cut: dict = {"device_orders": False, "mesh_order": _only(sp.mesh_order, AXES, "the device order", framework),
                 "wrapper_orders": (_only_order(sp.wrapper_orders, DEFAULT_ORDER, framework),)}
    pins = dict(sp.pins)
    if framework == "megatron":
        cut |= {"compile": _keep(sp.compile, (False,), "--compile", framework),
                "ac": _keep(_megatron_ac(sp.ac), ("none", "full", "core-attn"), "--ac", framework),
                "pp_schedules": _keep(sp.pp_schedules, tuple(s for s in sp.pp_schedules if s != "GPipe"),
                                      "--pp-schedule", framework),
                "reshard": _keep(sp.reshard, ("default",), "--reshard", framework),
                "ep_from": _keep(sp.ep_from, ("folded",), "--ep-from", framework)}
        pins["float8_recipe"] = _pin(pins, "float8_recipe", "tensorwise", framework)
        pins["grad_sync"] = _pin(pins, "grad_sync", "once", framework)
    else:
        pins["grad_sync"] = _pin(pins, "grad_sync", "every-pass", framework)
        cut["ep_from"] = _keep(sp.ep_from, ("dp_shard",), "--ep-from", framework)
        if framework == "torchtitan":
            cut |= {"ac": _keep(sp.ac, tuple(a for a in sp.ac if parse_ac(a)[0] not in ("layer", "core-attn")),
                                "--ac", framework),
                    "etp": _keep(sp.etp or (1,), (1,), "--etp", framework)}
            pins["float8_recipe"] = _pin(pins, "float8_recipe", "rowwise", framework)
    return dataclasses.replace(sp, pins=tuple(sorted(pins.items())), **cut)


def _megatron_ac(given: tuple) -> tuple:
    """The AC modes of a space for Megatron: its selective recompute is core-attn, which the default space's
    selective-op stands for there (an --ac the user gave is kept as given)."""
    from .search import AC_CHOICES

    if tuple(given) != tuple(AC_CHOICES):
        return tuple(given)
    return tuple("core-attn" if a == "selective-op" else a for a in given)


def check_framework(framework: str | None) -> None:
    if framework is not None and framework not in FRAMEWORKS:
        raise ParsimError(f"--framework takes {' | '.join(FRAMEWORKS)}, got {framework!r}")


def _keep(given: tuple, allowed: tuple, flag: str, framework: str) -> tuple:
    kept = tuple(v for v in given if v in allowed)
    if not kept:
        raise ParsimError(f"{flag} {','.join(map(str, given))}: {framework} cannot run it as planned "
                          f"(it can: {', '.join(map(str, allowed)) or 'nothing of it'})")
    return kept


def _only(given, allowed: tuple, what: str, framework: str) -> tuple:
    if given is not None and tuple(given) != tuple(allowed):
        raise ParsimError(f"{what} {','.join(given)}: {framework} builds {','.join(allowed)} and has no option for "
                          "another")
    return tuple(allowed)


def _only_order(given, default: tuple, framework: str) -> tuple:
    if given and tuple(default) not in [tuple(g) for g in given]:
        raise ParsimError(f"wrapper order {'>'.join(given[0])}: {framework} applies {'>'.join(default)} and has no "
                          "option for another")
    return tuple(default)


def _pin(pins: dict, name: str, value, framework: str):
    if name in pins and pins[name] != value:
        raise ParsimError(f"--{name.replace('_', '-')} {pins[name]}: {framework} runs {value}")
    return value


def runs_otherwise(plan, spec, framework: str) -> list[str]:
    """The gap-table lines that say ``framework`` would run something other than ``plan`` (empty: it runs it); what
    it cannot build of the model whatever the plan (``model_gaps``) is not the plan's."""
    from .emit import megatron_gaps, torchtitan_plan_gaps

    if framework == "megatron":
        return [g for g in megatron_gaps(plan, spec) if not g.startswith(MEGATRON_NOTES) or "has no" in g]
    return torchtitan_plan_gaps(plan, spec, TORCHTITAN_VERSION[framework])


def model_gaps(spec, framework: str) -> list[str]:
    from .emit import torchtitan_model_gaps

    return [] if framework == "megatron" else torchtitan_model_gaps(spec, TORCHTITAN_VERSION[framework])
