"""The plan schema: one row per plan field, and everything else derived from it.

A row says what a field is (name, kind, default, choices, range), how a user gives it (CLI flag, help, the flag's
default), how the vectorized cost model holds it (its ``PlanBatch`` column), how search treats it (enumerated, or
pinned for every plan when the user gives it), whether it is part of the plan id at its default, and how tables,
reports, the executor and the emitters name an option they show or cannot run. ``Plan`` (plan.py), ``PlanBatch``
and its encode/decode/names (codec.py), the command line's plan flags (cli/main.py) and their defaults and checks
(flags.py), search's pins (search.py), the report's option words, the search table's option letters, the executor's
refusal of cost-model-only options and the emitters' gap lines are built from these rows: adding a plan option is a
row here, its cost term and its test.

Torch-free and numpy-free (imported by everything).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from .errors import ParsimError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
WRAPPERS = ("pp", "tp", "ac", "compile", "fsdp")
DEFAULT_ORDER = WRAPPERS
PP_SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B")
# core-attn: Megatron-Core's selective recompute (--recompute-granularity selective, --recompute-modules core_attn):
# only the attention core (softmax(QK^T) V on the rotated q, k, v) is recomputed
AC_MODE_NAMES = ("none", "full", "selective-op", "layer", "core-attn")
RAF_MODES = ("default", "always", "never")
EP_FROM = ("dp_shard", "dp_replicate", "folded")
# torchao float8 training recipes (torchtitan's Float8LinearConverter recipe_name; tensorwise is the original one)
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DTYPES = ("float32", "bfloat16", "float16")
# the attention kernel a run uses: flash (FlashAttention-2 class: torch SDPA's flash / cuDNN backends, flash-attn 2,
# what torchtitan and parsim's executor run) | triton (the Triton FlashAttention kernel: llm-foundry's MPT
# ``attn_impl: triton``)
ATTENTION_KERNELS = ("flash", "triton")
# when data-parallel gradients are reduced under gradient accumulation (global batch > local batch x dp):
# every-pass (torchtitan: FSDP2 reduce-scatters, HSDP all-reduces after every pass's backward) | once (in the
# last pass only: Megatron-Core's DDP, FSDP2's set_requires_gradient_sync(False) for the passes before)
GRAD_SYNCS = ("every-pass", "once")


# a choice column's codes (its index in the tuple above: what a PlanBatch holds), by name: comparisons read
# ``b.float8_recipe == Float8Recipe.ROWWISE`` instead of a bare integer, and a choice inserted into a tuple moves
# its codes with it (a renamed or removed one fails at import)
class RafMode(IntEnum):
    DEFAULT = RAF_MODES.index("default")
    ALWAYS = RAF_MODES.index("always")
    NEVER = RAF_MODES.index("never")


class EpFrom(IntEnum):
    DP_SHARD = EP_FROM.index("dp_shard")
    DP_REPLICATE = EP_FROM.index("dp_replicate")
    FOLDED = EP_FROM.index("folded")


class Float8Recipe(IntEnum):
    TENSORWISE = FLOAT8_RECIPES.index("tensorwise")
    ROWWISE = FLOAT8_RECIPES.index("rowwise")
    ROWWISE_WITH_GW_HP = FLOAT8_RECIPES.index("rowwise_with_gw_hp")


class AttentionKernel(IntEnum):
    FLASH = ATTENTION_KERNELS.index("flash")
    TRITON = ATTENTION_KERNELS.index("triton")


class GradSync(IntEnum):
    EVERY_PASS = GRAD_SYNCS.index("every-pass")
    ONCE = GRAD_SYNCS.index("once")


# absurd sizes, refused before anything is enumerated (and int64 / float arithmetic stays far from overflow)
MAX_GPUS = 2**20  # 1,048,576: beyond every cluster built so far
MAX_SEQ_LEN = 2**24  # 16,777,216 tokens
MAX_BATCH = 2**24  # sequences per optimizer step
MAX_STAGES_PER_RANK = 64

KINDS = ("int", "bool", "choice", "optional_bool", "ac", "order")
SEARCH_ROLES = ("enumerated", "pinned", "given")
_UNSET: Any = object()


@dataclass(frozen=True)
class PlanField:
    """One plan field. ``kind``: int (``low..high``), bool, choice (one of ``choices``; its batch column holds the
    index), optional_bool (None resolves to a default the Plan derives), ac (``parse_ac``: two columns, mode code
    and period), order (a permutation of ``choices``; the batch holds an index into the orders it carries)."""

    name: str
    kind: str
    default: Any
    help: str = ""
    choices: tuple = ()
    low: int = 1
    high: int = 0
    # command line: the flag ("" -> --name-with-dashes), what it means when left out (the Plan default unless
    # given; None: derived from other flags, see flags.plan_from_given) and the help's [default]
    flag: str = ""
    flag_default: Any = _UNSET
    shown_default: str = ""
    # search: "enumerated" over its values, "pinned" for every plan when the user gives it (else the default),
    # or "given" (the problem: every plan has it); ``only_with``: a pin applies to the plans whose axis of this name
    # is > 1 (the others keep the default)
    search: str = "pinned"
    only_with: str = ""
    # fields added after plan ids were first recorded: left out of the id while at their default, so that the ids
    # of earlier plans (and the measurements keyed by them) stay valid
    late: bool = False
    # an option (bool) as tables and reports show it when on: report words, search-table letters
    label: str = ""
    letters: str = ""
    # an option the executor does not run (refused with this reason when on) / torchtitan or Megatron-LM cannot
    # express (the emitter's gap line when on)
    executor_refusal: str = ""
    torchtitan_gap: str = ""
    megatron_gap: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"plan field {self.name}: unknown kind {self.kind!r}")
        if self.kind == "choice" and self.default not in self.choices:
            raise ValueError(f"plan field {self.name}: default {self.default!r} not among {self.choices}")
        if self.search not in SEARCH_ROLES:
            raise ValueError(f"plan field {self.name}: unknown search role {self.search!r}")

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def cli_default(self) -> Any:
        """What the command line takes when the flag is left out."""
        if self.flag_default is not _UNSET:
            return self.flag_default
        return ",".join(self.default) if self.kind == "order" else self.default

    @property
    def column(self) -> str:
        """The PlanBatch column (orders: an index into the batch's tuple of orders)."""
        return {"mesh_order": "mesh_idx", "wrapper_order": "wrapper_idx"}.get(self.name, self.name)

    def check(self, value: Any) -> None:
        """One ParsimError line naming the field when ``value`` is not one it can hold."""
        if self.kind == "int":
            low = self.low
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= self.high:
                what = "a positive integer" if low else "an integer >= 0"
                raise ParsimError(f"{self.name} must be {what} <= {self.high}, got {value!r}")
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise ParsimError(f"{self.name} must be true or false, got {value!r}")
        elif self.kind == "optional_bool":
            if value is not None and not isinstance(value, bool):
                raise ParsimError(f"{self.name} must be true, false or null, got {value!r}")
        elif self.kind in ("choice", "ac"):
            if not isinstance(value, str):
                raise ParsimError(f"{self.name} must be a string, got {value!r}")
            if self.kind == "ac":
                parse_ac(value)
            elif value not in self.choices:
                raise ParsimError(f"{self.name} must be one of {', '.join(self.choices)}, got {value!r}")
        elif not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise ParsimError(f"{self.name} must be a list of names, got {value!r}")
        elif sorted(value) != sorted(self.choices):
            raise ParsimError(f"{self.name} {','.join(value)} must be a permutation of {','.join(self.choices)}")


def parse_ac(ac: str) -> tuple[str, int]:
    """'none' | 'full' | 'selective-op' | 'layer:N' (every N-th layer fully checkpointed) | 'core-attn' (the
    attention core only, Megatron's selective recompute) -> (mode, N)."""
    if ac in ("none", "full", "selective-op", "core-attn"):
        return ac, 1
    if ac.startswith("layer:"):
        try:
            n = int(ac.split(":", 1)[1])
        except ValueError:
            n = 0
        if n >= 1:
            return "layer", n
    raise ParsimError(f"bad AC mode {ac!r}: expected none, full, selective-op, core-attn or layer:N with N >= 1")


def _degree(name: str, help_: str = "", shown: str = "[1]", **kw) -> PlanField:
    return PlanField(name, "int", 1, help=help_, high=MAX_GPUS, shown_default=shown, search="enumerated", **kw)


def _batch(name: str, default: int, low: int, help_: str = "", shown: str = "", **kw) -> PlanField:
    return PlanField(name, "int", default, help=help_, low=low, high=MAX_BATCH, shown_default=shown, **kw)


PLAN_FIELDS: tuple[PlanField, ...] = (
    _degree("pp"),
    _degree("dp_replicate"),
    _degree("dp_shard", "-1 = the GPUs the other degrees leave", "[-1]", flag_default=-1),
    _degree("cp"),
    _degree("tp"),
    _degree("ep"),
    _degree("etp"),
    PlanField("ep_from", "choice", "dp_shard", choices=EP_FROM, search="enumerated", shown_default="[dp_shard]",
              help="where EP ranks come from: dp_shard (torchtitan dp2ep: dp_shard x cp x tp == efsdp x ep x etp) | "
                   "dp_replicate (Megatron-style DDP + EP inside the data-parallel ranks) | folded (Megatron-Core MoE "
                   "parallel folding: ep x etp over dp_replicate x cp x tp, dp_shard 1)"),
    PlanField("mesh_order", "order", AXES, choices=AXES, search="enumerated",
              help="device order, outermost first; may list only the axes > 1",
              shown_default=f"[{','.join(AXES)}]"),
    PlanField("seq_len", "int", 4096, high=MAX_SEQ_LEN, shown_default="[4096]", search="given"),
    _batch("local_batch_size", 1, 1, shown="[1]", search="enumerated"),
    _batch("global_batch_size", 0, 0, shown="[local batch x dp]", flag_default=None, search="given",
           help_="sequences per optimizer step (left out: local batch x dp, no gradient accumulation)"),
    _batch("micro_batch_size", 0, 0, shown="[local batch]", flag_default=None, search="enumerated",
           help_="sequences per pipeline microbatch (left out: the local batch, one microbatch)"),
    PlanField("pp_schedule", "choice", "1F1B", choices=PP_SCHEDULE_NAMES, search="enumerated",
              help=" | ".join(PP_SCHEDULE_NAMES), shown_default="[1F1B]"),
    PlanField("pp_stages_per_rank", "int", 1, high=MAX_STAGES_PER_RANK, flag_default=None, search="enumerated",
              shown_default="[1, or 2 for Interleaved1F1B]"),
    PlanField("sequence_parallel", "optional_bool", None, shown_default="[on when tp > 1]"),
    PlanField("fsdp_reshard_after_forward", "choice", "default", choices=RAF_MODES, search="enumerated",
              help="default (on without PP, off with PP: torchtitan) | always | never", shown_default="[default]"),
    PlanField("ac", "ac", "none", help="none | full | selective-op | layer:N | core-attn (the attention core only: "
              "Megatron's --recompute-granularity selective)", shown_default="[none]",
              search="enumerated"),
    PlanField("compile", "bool", False, shown_default="[no]", search="enumerated"),
    PlanField("float8", "bool", False, shown_default="[no]", search="enumerated"),
    PlanField("param_dtype", "choice", "bfloat16", choices=DTYPES, shown_default="[bfloat16]",
              help="FSDP mixed precision's compute dtype; `parsim run` on a CPU defaults to float32 where this "
                   "machine's bf16 GEMMs are slow (no AVX-512 BF16 or AMX): " + " | ".join(DTYPES)),
    PlanField("reduce_dtype", "choice", "float32", choices=DTYPES, shown_default="[float32]",
              help="the dtype gradients are reduced in: " + " | ".join(DTYPES)),
    PlanField("wrapper_order", "order", DEFAULT_ORDER, choices=WRAPPERS, flag="--order", search="enumerated",
              help="wrapper order", shown_default=f"[{','.join(DEFAULT_ORDER)}]"),
    PlanField("float8_recipe", "choice", "tensorwise", choices=FLOAT8_RECIPES, late=True,
              help=" | ".join(FLOAT8_RECIPES), shown_default="[tensorwise]"),
    PlanField("async_tp", "bool", False, late=True, only_with="tp", label="async TP", letters="aTP",
              help="TP collectives decomposed and overlapped with the matmuls they feed (torchtitan "
                   "enable_async_tensor_parallel, Megatron tp_comm_overlap; cost model only)", shown_default="[no]"),
    PlanField("distributed_optimizer", "bool", False, late=True, only_with="dp_replicate",
              label="distributed optimizer", letters="ZeRO1", shown_default="[no]",
              help="Megatron's distributed optimizer (ZeRO-1): fp32 master weights and AdamW states sharded over "
                   "dp_replicate, gradients reduce-scattered (cost model only)",
              torchtitan_gap="distributed optimizer (ZeRO-1 over dp_replicate): not a torchtitan option; use FSDP "
                             "(data_parallel_shard_degree) to shard the optimizer state"),
    PlanField("te_layers", "bool", False, late=True, label="TE layers", letters="TE", shown_default="[no]",
              help="Megatron-Core Transformer Engine layers: SP inputs kept local and re-gathered in the backward, "
                   "float8 inputs saved, fused SwiGLU/RoPE, vocab-parallel embedding (cost model only)",
              executor_refusal="te_layers (Megatron-Core's Transformer Engine layers) is a cost-model option: "
                               "Transformer Engine runs on CUDA only, the executor has no such layers",
              torchtitan_gap="TE layers (Megatron-Core's Transformer Engine spec): not a torchtitan option; "
                             "torchtitan runs its own layers (more activation memory under SP: see --emit-megatron)"),
    PlanField("attention_kernel", "choice", "flash", choices=ATTENTION_KERNELS, late=True, label="Triton attention",
              letters="TrA", shown_default="[flash]",
              help="the attention kernel: flash (FlashAttention-2 class: torch SDPA, flash-attn 2) | triton (the "
                   "Triton FlashAttention kernel, llm-foundry's attn_impl triton; cost model only)",
              executor_refusal="attention_kernel triton is a cost-model option: the executor runs torch's SDPA",
              torchtitan_gap="Triton attention: torchtitan runs torch's SDPA (FlashAttention-2 / cuDNN kernels)",
              megatron_gap="Triton attention: Megatron-Core runs Transformer Engine's attention (cuDNN / "
                           "FlashAttention)"),
    PlanField("grad_sync", "choice", "every-pass", choices=GRAD_SYNCS, late=True, label="gradients reduced once",
              letters="GS1", shown_default="[every-pass]",
              help="under gradient accumulation: every-pass (gradients reduced after every pass, torchtitan) | once "
                   "(accumulated unsharded and reduced in the last pass only: Megatron-Core's DDP; FSDP2's "
                   "set_requires_gradient_sync(False) before)",
              torchtitan_gap="gradients reduced once per step: torchtitan's train step reduces after every "
                             "gradient-accumulation microbatch (no option to skip the sync)"),
    PlanField("fused_loss", "bool", False, late=True, label="fused loss", letters="FL", shown_default="[no]",
              help="fused cross-entropy (flash-attn xentropy, Megatron cross_entropy_loss_fusion): no fp32 copy of "
                   "the logits, one logits-sized gradient",
              torchtitan_gap="fused cross-entropy: torchtitan has no loss option; with compile it compiles the loss "
                             "(compile.components model, loss), which fuses it"),
)
FIELDS: dict[str, PlanField] = {f.name: f for f in PLAN_FIELDS}
LATE_DEFAULTS = {f.name: f.default for f in PLAN_FIELDS if f.late}
PINNED = tuple(f for f in PLAN_FIELDS if f.search == "pinned")  # search pins them, never enumerates


def options_on(plan, attr: str) -> list[str]:
    """The ``attr`` text (label, letters, executor_refusal, torchtitan_gap, ...) of every row that has one and that
    ``plan`` sets off its default, in row order."""
    return [getattr(f, attr) for f in PLAN_FIELDS if getattr(f, attr) and getattr(plan, f.name) != f.default]


def check_fields(values: dict) -> None:
    """Every field's type and range (a plan file can hold anything): one ParsimError line for the first bad one."""
    for f in PLAN_FIELDS:
        f.check(values[f.name])
