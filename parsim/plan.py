"""Plan: how one training job is parallelized. Degrees per mesh axis in device order, batch, PP schedule, AC, compile,
FSDP options, dtypes and the wrapper order. Validation messages show the arithmetic.

Batch vocabulary (torchtitan's): ``local_batch_size`` sequences per data-parallel rank per forward/backward pass;
``global_batch_size`` sequences per optimizer step (= local * dp * gradient-accumulation steps);
``micro_batch_size`` sequences per pipeline microbatch (local = micro * n_microbatches).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from .errors import ParsimError
from .units import DTYPE_BYTES

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
WRAPPERS = ("pp", "tp", "ac", "compile", "fsdp")
DEFAULT_ORDER = WRAPPERS
# name -> (code used by the vectorized cost model, single-stage schedule?)
PP_SCHEDULES = {"GPipe": 0, "1F1B": 1, "Interleaved1F1B": 2}
AC_MODES = {"none": 0, "full": 1, "selective-op": 2, "layer": 3}
RAF_MODES = ("default", "always", "never")
EP_FROM = ("dp_shard", "dp_replicate")
# torchao float8 training recipes (torchtitan's Float8LinearConverter recipe_name; tensorwise is the original one)
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# fields added after plan ids were first recorded: left out of the id while at their default, so that the ids of
# earlier plans (and the measurements keyed by them) stay valid
LATE_DEFAULTS = {"float8_recipe": "tensorwise", "async_tp": False, "distributed_optimizer": False,
                  "te_layers": False, "fused_loss": False}
# absurd sizes, refused before anything is enumerated (and int64 / float arithmetic stays far from overflow)
MAX_GPUS = 2**20  # 1,048,576: beyond every cluster built so far
MAX_SEQ_LEN = 2**24  # 16,777,216 tokens
MAX_BATCH = 2**24  # sequences per optimizer step
MAX_STAGES_PER_RANK = 64


def parse_ac(ac: str) -> tuple[str, int]:
    """'none' | 'full' | 'selective-op' | 'layer:N' (every N-th layer fully checkpointed) -> (mode, N)."""
    if ac in ("none", "full", "selective-op"):
        return ac, 1
    if ac.startswith("layer:"):
        try:
            n = int(ac.split(":", 1)[1])
        except ValueError:
            n = 0
        if n >= 1:
            return "layer", n
    raise ParsimError(f"bad AC mode {ac!r}: expected none, full, selective-op or layer:N with N >= 1")


@dataclass(frozen=True)
class Plan:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1
    ep_from: str = "dp_shard"  # dp_shard: torchtitan dp2ep (dp_shard*cp*tp == efsdp*ep*etp); dp_replicate: DDP + EP
    mesh_order: tuple[str, ...] = AXES  # device order, outermost first
    seq_len: int = 2048
    local_batch_size: int = 1
    global_batch_size: int = 0  # 0 -> local_batch_size * dp (no gradient accumulation)
    micro_batch_size: int = 0  # 0 -> local_batch_size (one microbatch)
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    sequence_parallel: bool | None = None  # None -> tp > 1
    fsdp_reshard_after_forward: str = "default"  # default: True without PP, False with PP (torchtitan)
    ac: str = "none"
    compile: bool = False
    float8: bool = False
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    wrapper_order: tuple[str, ...] = DEFAULT_ORDER
    # float8 scaling recipe (used when float8 is on)
    float8_recipe: str = "tensorwise"
    # TP collectives decomposed and overlapped with the matmuls they feed (torchtitan enable_async_tensor_parallel,
    # Megatron tp_comm_overlap)
    async_tp: bool = False
    # Megatron's distributed optimizer (ZeRO-1): fp32 master weights and AdamW states sharded over dp_replicate,
    # gradients reduce-scattered and updated parameters all-gathered instead of one all-reduce
    distributed_optimizer: bool = False
    # Megatron-Core's Transformer Engine layers (its default layer spec): LayerNorm+Linear fused modules that keep
    # their sequence-parallel input local and all-gather it again in the backward, float8 linears that keep float8
    # inputs, a fused SwiGLU / GeLU that keeps only the fc1 output, fused RoPE, a vocab-parallel embedding
    # (cost model only: Transformer Engine runs on CUDA)
    te_layers: bool = False
    # a fused cross-entropy (flash-attn's xentropy, Megatron's cross_entropy_loss_fusion, llm-foundry's default
    # loss): fp32 math inside the kernel, no fp32 copy of the logits, the gradient one logits-sized tensor
    fused_loss: bool = False

    def __post_init__(self):
        s = object.__setattr__
        self._check_types()
        s(self, "mesh_order", tuple(self.mesh_order))
        s(self, "wrapper_order", tuple(self.wrapper_order))
        if sorted(self.mesh_order) != sorted(AXES):
            raise ParsimError(f"mesh order {','.join(self.mesh_order)} must be a permutation of {','.join(AXES)}")
        if sorted(self.wrapper_order) != sorted(WRAPPERS):
            raise ParsimError(
                f"wrapper order {','.join(self.wrapper_order)} must be a permutation of {','.join(WRAPPERS)}"
            )
        if self.ep_from not in EP_FROM:
            raise ParsimError(f"ep_from must be one of {EP_FROM}, got {self.ep_from!r}")
        if self.global_batch_size == 0:
            s(self, "global_batch_size", self.local_batch_size * self.dp)
        if self.micro_batch_size == 0:
            s(self, "micro_batch_size", self.local_batch_size)
        if self.global_batch_size > MAX_BATCH:
            raise ParsimError(f"global batch {self.global_batch_size} is more than {MAX_BATCH} sequences")
        if self.sequence_parallel is None:
            s(self, "sequence_parallel", self.tp > 1)
        if self.pp_schedule not in PP_SCHEDULES:
            raise ParsimError(f"unknown PP schedule {self.pp_schedule!r} (known: {', '.join(PP_SCHEDULES)})")
        if self.fsdp_reshard_after_forward not in RAF_MODES:
            raise ParsimError(f"fsdp_reshard_after_forward must be one of {RAF_MODES}")
        parse_ac(self.ac)
        if self.float8_recipe not in FLOAT8_RECIPES:
            raise ParsimError(f"float8_recipe must be one of {', '.join(FLOAT8_RECIPES)}, got {self.float8_recipe!r}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_BYTES or getattr(self, name) == "float8":
                raise ParsimError(f"{name} must be float32, bfloat16 or float16, got {getattr(self, name)!r}")
        if self.sequence_parallel and self.tp == 1:
            s(self, "sequence_parallel", False)

    def _check_types(self) -> None:
        """Types and sizes of every field (a plan file can hold anything): one line naming field and value."""
        limits = {**{a: MAX_GPUS for a in AXES + ("ep", "etp")}, "seq_len": MAX_SEQ_LEN,
                  "local_batch_size": MAX_BATCH, "global_batch_size": MAX_BATCH, "micro_batch_size": MAX_BATCH,
                  "pp_stages_per_rank": MAX_STAGES_PER_RANK}
        for a, high in limits.items():
            v = getattr(self, a)
            low = 0 if a in ("global_batch_size", "micro_batch_size") else 1
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
                what = "a positive integer" if low else "an integer >= 0"
                raise ParsimError(f"{a} must be {what} <= {high}, got {v!r}")
        world = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if world > MAX_GPUS:
            raise ParsimError(f"the degrees multiply to {world} GPUs, more than the {MAX_GPUS} parsim plans for")
        for a in ("compile", "float8", *(k for k, v in LATE_DEFAULTS.items() if isinstance(v, bool))):
            if not isinstance(getattr(self, a), bool):
                raise ParsimError(f"{a} must be true or false, got {getattr(self, a)!r}")
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise ParsimError(f"sequence_parallel must be true, false or null, got {self.sequence_parallel!r}")
        for a in ("ep_from", "pp_schedule", "fsdp_reshard_after_forward", "ac", "param_dtype", "reduce_dtype",
                  "float8_recipe"):
            if not isinstance(getattr(self, a), str):
                raise ParsimError(f"{a} must be a string, got {getattr(self, a)!r}")
        for a in ("mesh_order", "wrapper_order"):
            v = getattr(self, a)
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
                raise ParsimError(f"{a} must be a list of names, got {v!r}")

    # ---- derived ------------------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

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
                         + ("(ddp)" if self.ep_from == "dp_replicate" else ""))
        return "x".join(parts) or "single"

    # ---- identity and serialization -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
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
        known = {f.name for f in fields(Plan)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ParsimError(f"unknown plan keys: {unknown}")
        try:
            return Plan(**d)
        except TypeError as e:
            raise ParsimError(f"bad plan: {e}") from None


INTERVAL_GROUPS = ("ep", "cp", "pp-deep", "pp", "float8", "dense")


def interval_group(plan: "Plan") -> str:
    """The plan family an interval is sized for (Mondrian conformal, ``parsim.calibrate``): the first feature in
    ``INTERVAL_GROUPS`` order that the plan has — expert parallel (all-to-all and routing the model takes as
    balanced), context parallel (ring attention), a pipeline of 4 stages or more (bubble, p2p and per-stage
    overheads, many of them), any pipeline, float8 (its GEMM efficiency and casts), else a dense plan. These are
    the classes whose errors differ (issue 24: published rows' error grows with PP depth and EP); the groups are
    plan features, never sources or models."""
    if plan.ep > 1:
        return "ep"
    if plan.cp > 1:
        return "cp"
    if plan.pp >= 4:
        return "pp-deep"
    if plan.pp > 1:
        return "pp"
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

