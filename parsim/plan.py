"""Plan: how one training job is parallelized. Degrees per mesh axis in device order, batch, PP schedule, AC, compile,
FSDP options, dtypes and the wrapper order. Validation messages show the arithmetic.

Batch vocabulary (torchtitan's): ``local_batch_size`` sequences per data-parallel rank per forward/backward pass;
``global_batch_size`` sequences per optimizer step (= local * dp * gradient-accumulation steps);
``micro_batch_size`` sequences per pipeline microbatch (local = micro * n_microbatches).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .errors import ParsimError
from .plan_schema import (  # noqa: F401  (re-exported: the vocabulary plans are written in)
    AC_MODE_NAMES,
    AXES,
    DEFAULT_ORDER,
    DTYPES,
    EP_FROM,
    FLOAT8_RECIPES,
    LATE_DEFAULTS,
    MAX_BATCH,
    MAX_GPUS,
    MAX_SEQ_LEN,
    MAX_STAGES_PER_RANK,
    PLAN_FIELDS,
    PP_SCHEDULE_NAMES,
    RAF_MODES,
    WRAPPERS,
    check_fields,
    parse_ac,
)

# name -> code used by the vectorized cost model (the index in the schema's choices)
PP_SCHEDULES = {name: i for i, name in enumerate(PP_SCHEDULE_NAMES)}
AC_MODES = {name: i for i, name in enumerate(AC_MODE_NAMES)}


class _PlanValue:
    """What a Plan is beyond its fields (``plan_schema.PLAN_FIELDS``): the field checks and resolved defaults,
    derived quantities, identity and serialization."""

    if TYPE_CHECKING:  # the fields come from the schema (``_schema_fields``)
        def __init__(self, **fields: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...

    def __post_init__(self):
        s = object.__setattr__
        check_fields(self.__dict__)
        s(self, "mesh_order", tuple(self.mesh_order))
        s(self, "wrapper_order", tuple(self.wrapper_order))
        world = self.world_size
        if world > MAX_GPUS:
            raise ParsimError(f"the degrees multiply to {world} GPUs, more than the {MAX_GPUS} parsim plans for")
        if self.global_batch_size == 0:
            s(self, "global_batch_size", self.local_batch_size * self.dp)
        if self.micro_batch_size == 0:
            s(self, "micro_batch_size", self.local_batch_size)
        if self.global_batch_size > MAX_BATCH:
            raise ParsimError(f"global batch {self.global_batch_size} is more than {MAX_BATCH} sequences")
        if self.sequence_parallel is None or self.tp == 1:
            s(self, "sequence_parallel", self.tp > 1 and self.sequence_parallel is not False)

    # ---- derived ------------------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp_applied(self) -> bool:
        """Whether the executor wraps the model in FSDP2 (with its mixed precision): some data or context
        parallelism to shard over (dp_replicate x dp_shard x cp > 1); without it the plan runs under autocast."""
        return self.dp_replicate * self.dp_shard * self.cp > 1

    @property
    def n_microbatches(self) -> int:
        return self.local_batch_size // self.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.local_batch_size * self.dp)

    @property
    def efsdp(self) -> int:
        """FSDP degree of the routed experts."""
        if self.ep_from == "dp_shard":
            return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)
        if self.ep_from == "folded" and self.ep > 1:
            return 1  # Megatron DDP: experts replicated over their expert-data-parallel group, not sharded
        return self.dp_shard * self.cp

    @property
    def reshard_after_forward(self) -> bool:
        if self.fsdp_reshard_after_forward == "default":
            return self.pp == 1
        return self.fsdp_reshard_after_forward == "always"

    @property
    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def describe(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in self.mesh_order if getattr(self, a) > 1]
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f"/etp{self.etp}" if self.etp > 1 else "")
                         + {"dp_replicate": "(ddp)", "folded": "(folded)"}.get(self.ep_from, ""))
        return "x".join(parts) or "single"

    # ---- identity and serialization -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)  # type: ignore[call-overload]
        d["mesh_order"] = list(self.mesh_order)
        d["wrapper_order"] = list(self.wrapper_order)
        return d

    @property
    def plan_id(self) -> str:
        """Stable hash of the canonical JSON form (defaults resolved), 12 hex digits."""
        d = {k: v for k, v in self.to_dict().items() if k not in LATE_DEFAULTS or v != LATE_DEFAULTS[k]}
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        if not isinstance(d, dict):
            raise ParsimError("a plan must be a JSON object")
        d = dict(d)
        d.pop("plan_id", None)
        unknown = sorted(set(d) - {f.name for f in PLAN_FIELDS})
        if unknown:
            raise ParsimError(f"unknown plan keys: {unknown}")
        try:
            return Plan(**d)
        except TypeError as e:
            raise ParsimError(f"bad plan: {e}") from None


def _schema_fields(cls):
    """``cls`` as a frozen dataclass whose fields are the schema's rows, in their order, with their defaults."""
    cls.__annotations__ = {f.name: Any for f in PLAN_FIELDS}
    for f in PLAN_FIELDS:
        setattr(cls, f.name, f.default)
    return dataclass(frozen=True)(cls)


@_schema_fields
class Plan(_PlanValue):
    """How one training job is parallelized: a plain value with one field per ``plan_schema.PLAN_FIELDS`` row (its
    types and ranges checked, its defaults resolved); the structural rules are checked at the boundary
    (``codec.validate_plan``)."""


INTERVAL_GROUPS = ("ep", "cp", "pp-deep", "pp", "compile", "float8", "dense")


def interval_factor(hw, plan: "Plan") -> float:
    """The 90% interval factor (x/÷) of ``plan``'s step time on profile ``hw``: its plan family's
    (``interval_group``), as ``predict`` sizes it."""
    import math

    return math.exp(hw.interval_log_halfwidth_for(interval_group(plan)))


def interval_group(plan: "Plan") -> str:
    """The plan family an interval is sized for (Mondrian conformal, ``parsim.calibrate``): the first feature in
    ``INTERVAL_GROUPS`` order that the plan has — expert parallel (all-to-all and routing the model takes as
    balanced), context parallel (ring attention), a pipeline of 4 stages or more (bubble, p2p and per-stage
    overheads, many of them), any pipeline, torch.compile (what Inductor fuses enters the model as one factor on
    the memory-bound time, ``compile_memory_bound_factor``, while the kernels it generates and the graph breaks it
    meets differ from graph to graph: compiled plans' errors are the widest of the dense plans, out of fold
    -21%..+35% on the published rows), float8 (its GEMM efficiency and casts), else a dense plan. These are the
    classes whose errors differ (issue 24: published rows' error grows with PP depth and EP); the groups are plan
    features, never sources or models."""
    if plan.ep > 1:
        return "ep"
    if plan.cp > 1:
        return "cp"
    if plan.pp >= 4:
        return "pp-deep"
    if plan.pp > 1:
        return "pp"
    if plan.compile:
        return "compile"
    return "float8" if plan.float8 else "dense"


def plan_from_flags(
    n_gpus: int,
    *,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    **kw,
) -> Plan:
    """Plan from torchtitan-style flags; ``dp_shard=-1`` takes the GPUs the other degrees leave."""
    if dp_shard == -1:
        rest = dp_replicate * tp * pp * cp
        if rest < 1 or n_gpus % rest:
            raise ParsimError(
                f"dp_shard=-1: {n_gpus} GPUs are not divisible by dp_replicate x tp x pp x cp = "
                f"{dp_replicate} x {tp} x {pp} x {cp} = {rest}"
            )
        dp_shard = n_gpus // rest
    kw = _megatron_batch_words(pp, dp_replicate * dp_shard, kw)
    plan = Plan(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, **kw)
    if plan.world_size != n_gpus:
        raise ParsimError(world_size_message(plan, n_gpus))
    return plan


def _megatron_batch_words(pp: int, dp: int, kw: dict) -> dict:
    """Without PP, a micro batch smaller than the local batch is gradient accumulation, as Megatron and NeMo users
    write it: ``local 8, micro 4`` runs passes of 4 sequences per rank and steps the optimizer every 8 (parsim's
    own words: local batch 4, global batch 8 x dp). With PP the micro batch splits the local batch into pipeline
    microbatches in one step (torchtitan's meaning), unchanged."""
    lbs, mbs = kw.get("local_batch_size", 1), kw.get("micro_batch_size", 0)
    if pp > 1 or not mbs or mbs >= lbs:
        return kw
    if lbs % mbs:
        raise ParsimError(f"local batch {lbs} is not a multiple of micro batch {mbs} (gradient accumulation "
                          "without PP runs local / micro passes)")
    gbs = kw.get("global_batch_size") or lbs * dp
    if gbs % (lbs * dp):
        raise ParsimError(f"global batch {gbs} is not a multiple of local batch x dp = {lbs} x {dp} = {lbs * dp} "
                          f"(a local batch of {lbs} in micro batches of {mbs} without PP is gradient accumulation)")
    return {**kw, "local_batch_size": mbs, "micro_batch_size": mbs, "global_batch_size": gbs}


def world_size_message(plan: Plan, n_gpus: int) -> str:
    prod = " x ".join(f"{a}={getattr(plan, a)}" for a in AXES)
    return f"degrees multiply to {prod} = {plan.world_size}, not the {n_gpus} GPUs asked for"


def ranks_per_node(degrees: dict, order: tuple[str, ...], gpus_per_node: int, group: tuple[str, ...]):
    """Ranks of one ``group`` (one or more axes, flattened) that share a node; degrees may be ints or numpy arrays
    (the cost model evaluates many plans at once with the same formula).

    Ranks are laid out row-major over ``order`` (innermost axis fastest); a node holds ``gpus_per_node`` consecutive
    ranks. With power-of-two degrees the node is a sub-box of the grid, so the count is the product over the
    group's axes of how many coordinates of each fit: ``clamp(gpus_per_node // stride(axis), 1, degree)``."""
    import numpy as np

    stride = np.ones_like(degrees[order[0]])
    strides = {}
    for a in reversed(order):
        strides[a] = stride
        stride = stride * degrees[a]
    out = np.ones_like(stride)
    for a in group:
        out = out * np.minimum(degrees[a], np.maximum(1, gpus_per_node // strides[a]))
    return out

