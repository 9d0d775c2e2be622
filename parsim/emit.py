"""A plan as the configuration of the framework that runs it (torch-free text generation).

* ``to_torchtitan_python``: torchtitan 0.3.0 (the latest release on PyPI, Sep 2026), which configures runs in
  Python (``Trainer.Config``, torchtitan PR #2386). The file defines one function per config object —
  ``parsim_parallelism``, ``parsim_training``, ``parsim_compile``, ``parsim_activation_checkpoint``,
  ``parsim_model_spec`` — and ``parsim_plan`` assembling them into ``Trainer.Config``, to be chosen with
  ``--module <file> --config parsim_plan``. Imports sit inside the functions: building the parallelism, training,
  compile and AC objects needs only torchtitan's config classes; the model spec (float8 converter) and the trainer
  import torchtitan's GPU kernels and data stack.
* ``to_torchtitan_toml``: the last TOML schema, torchtitan v0.2.x (``[model] name/flavor/converters``,
  ``[quantize.linear.float8]``, ``[parallelism] enable_async_tensor_parallel`` ...).

What the target cannot express (a device order other than torchtitan's, a wrapper order other than its own, DDP-
style EP, float8 tensorwise in 0.3.0, AC of every n-th layer in 0.3.0, an interleaved split that does not divide
the layers) is written at the top of the file, plainly, with what was emitted instead.
"""

from __future__ import annotations

from .plan import AXES, DEFAULT_ORDER, Plan, parse_ac
from .spec import ModelSpec

# parsim preset -> (torchtitan module, flavor) in torchtitan 0.3.0's model registries
TORCHTITAN_MODELS = {
    "llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"), "llama3-405b": ("llama3", "405B"),
    "deepseek-v3": ("deepseek_v3", "671B"), "qwen3-30b-a3b": ("qwen3", "30B-A3B"),
}
# torchtitan's own wrapper order (models/llama3/infra/parallelize.py): PP first, then TP, AC, per-block compile, FSDP
TORCHTITAN_ORDER = DEFAULT_ORDER


def _gaps(plan: Plan, spec: ModelSpec, version: str) -> list[str]:
    """What torchtitan ``version`` ("0.3.0" or "0.2") cannot express of this plan, one line each."""
    out = []
    if tuple(plan.mesh_order) != AXES:
        used = [a for a in plan.mesh_order if getattr(plan, a) > 1]
        out.append(f"device order {','.join(used)} (outermost first): torchtitan builds its mesh as "
                   "pp, dp_replicate, dp_shard, cp, tp and has no option for another order; parsim predicted this "
                   "plan in the order above, torchtitan will run it in its own")
    if tuple(plan.wrapper_order) != TORCHTITAN_ORDER:
        out.append(f"wrapper order {'>'.join(plan.wrapper_order)}: torchtitan applies PP > TP > AC > compile > "
                   "FSDP and has no option for another order")
    if plan.ep > 1 and plan.ep_from == "dp_replicate":
        out.append("EP borrowed from dp_replicate (DDP-style, Megatron): torchtitan borrows EP from "
                   "dp_shard x cp x tp; expert_parallel_degree is emitted, its ranks will come from there")
    if plan.etp > 1 and version == "0.3.0":
        out.append(f"expert tensor parallel {plan.etp}: removed in torchtitan (PR #3167); experts run without TP")
    if plan.float8 and plan.float8_recipe == "tensorwise" and version == "0.3.0":
        out.append("float8 tensorwise: removed in torchtitan 0.3.0 (PR #3127); the rowwise recipe is emitted, "
                   "which runs rowwise GEMMs at 90-100% of tensorwise speed on most shapes")
    mode, every = parse_ac(plan.ac)
    if mode == "layer" and version == "0.3.0":
        out.append(f"AC of one layer in {every} (layer:{every}): torchtitan 0.3.0 has FullAC, SelectiveAC (per op) and "
                   "MemoryBudgetAC only; FullAC is emitted (more recompute, less memory than planned)")
    if plan.pp > 1 and plan.pp_stages_per_rank > 1 and spec.n_layers % (plan.pp * plan.pp_stages_per_rank):
        out.append(f"{plan.pp * plan.pp_stages_per_rank} pipeline stages do not divide {spec.n_layers} layers: "
                   "pipeline_parallel_layers_per_stage is left to torchtitan's default split")
    if plan.async_tp and not plan.compile:
        out.append("async TP without compile: torchtitan's async TP needs torch.compile; enable compile")
    if plan.distributed_optimizer:
        out.append("distributed optimizer (ZeRO-1 over dp_replicate): not a torchtitan option; use FSDP "
                   "(data_parallel_shard_degree) to shard the optimizer state")
    if plan.te_layers:
        out.append("TE layers (Megatron-Core's Transformer Engine spec): not a torchtitan option; torchtitan runs "
                   "its own layers (more activation memory under SP: see --emit-megatron)")
    if plan.fused_loss:
        out.append("fused cross-entropy: torchtitan has no loss option; with compile it compiles the loss "
                   "(compile.components model, loss), which fuses it")
    if spec.name not in TORCHTITAN_MODELS:
        out.append(f"model {spec.name}: no torchtitan flavor known to parsim; set model_spec yourself")
    return out


def _layers_per_stage(plan: Plan, spec: ModelSpec) -> int | None:
    stages = plan.pp * plan.pp_stages_per_rank
    if plan.pp > 1 and plan.pp_stages_per_rank > 1 and spec.n_layers % stages == 0:
        return spec.n_layers // stages
    return None


def _header(plan: Plan, spec: ModelSpec, n_gpus: int, prediction: str, gaps: list[str], comment: str) -> list[str]:
    lines = [f"parsim plan {plan.plan_id} for {spec.name} on {n_gpus} GPUs: {plan.describe()}, AC {plan.ac}, "
             f"compile {plan.compile}, float8 {plan.float8_recipe if plan.float8 else False}"]
    if prediction:
        lines.append(f"parsim predicted: {prediction}")
    if gaps:
        lines.append("What torchtitan cannot express of this plan:")
        lines += [f"- {g}" for g in gaps]
    else:
        lines.append("torchtitan expresses every field of this plan.")
    return [f"{comment}{ln}" if ln else comment.rstrip() for ln in lines]


def to_torchtitan_python(plan: Plan, spec: ModelSpec, prediction: str = "") -> str:
    """The plan as a torchtitan 0.3.0 config module (see the module docstring)."""
    gaps = _gaps(plan, spec, "0.3.0")
    mode, _ = parse_ac(plan.ac)
    ac = {"none": "None", "full": "FullAC.Config()", "layer": "FullAC.Config()",
          "selective-op": "SelectiveAC.Config()"}[mode]
    par = [f"data_parallel_replicate_degree={plan.dp_replicate}", f"data_parallel_shard_degree={plan.dp_shard}",
           f"fsdp_reshard_after_forward={plan.fsdp_reshard_after_forward!r}",
           f"tensor_parallel_degree={plan.tp}", f"enable_sequence_parallel={bool(plan.sequence_parallel)}",
           f"pipeline_parallel_degree={plan.pp}", f"pipeline_parallel_schedule={plan.pp_schedule!r}",
           f"pipeline_parallel_microbatch_size={plan.micro_batch_size}",
           f"context_parallel_degree={plan.cp}", f"expert_parallel_degree={plan.ep}"]
    lps = _layers_per_stage(plan, spec)
    if lps is not None:
        par.append(f"pipeline_parallel_layers_per_stage={lps}")
    module, flavor = TORCHTITAN_MODELS.get(spec.name, (None, None))
    recipe = "rowwise" if plan.float8_recipe == "tensorwise" else plan.float8_recipe
    if module is None:
        model_body = [f"    raise NotImplementedError({('no torchtitan flavor for ' + spec.name)!r})"]
    else:
        conv = (f"[Float8LinearConverter.Config(recipe_name={recipe!r}, model_compile_enabled={plan.compile})]"
                if plan.float8 else "None")
        model_body = [f"    from torchtitan.models.{module} import model_registry",
                      *(["    from torchtitan.components.quantization import Float8LinearConverter"]
                        if plan.float8 else []),
                      "",
                      f"    return model_registry({flavor!r}, converters={conv})"]
    doc = ['"""torchtitan 0.3.0 config written by parsim.', "",
           *_header(plan, spec, plan.world_size, prediction, gaps, ""), "",
           "Run: put this file on PYTHONPATH and start torchtitan with", "    torchrun --nproc_per_node "
           "<GPUs per node> -m torchtitan.train --module <this file's module name> --config parsim_plan",
           '"""', ""]
    body = [
        "", "def parsim_parallelism():",
        "    from torchtitan.config import ParallelismConfig", "",
        "    return ParallelismConfig(", *[f"        {p}," for p in par], "    )", "", "",
        "def parsim_training():",
        "    from torchtitan.config import TrainingConfig", "",
        f"    return TrainingConfig(local_batch_size={plan.local_batch_size}, "
        f"global_batch_size={plan.global_batch_size}, seq_len={plan.seq_len},",
        f"                          mixed_precision_param={plan.param_dtype!r}, "
        f"mixed_precision_reduce={plan.reduce_dtype!r})", "", "",
        "def parsim_compile():",
        "    from torchtitan.config import CompileConfig", "",
        f"    return CompileConfig(enable={plan.compile}, components=['model', 'loss'], "
        f"enable_async_tensor_parallel={bool(plan.async_tp and plan.compile)})", "", "",
        "def parsim_activation_checkpoint():",
        "    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: F401", "",
        f"    return {ac}", "", "",
        "def parsim_model_spec():", *model_body, "", "",
        "def parsim_plan():",
        "    from torchtitan.trainer import Trainer", "",
        "    return Trainer.Config(model_spec=parsim_model_spec(), training=parsim_training(),",
        "                          parallelism=parsim_parallelism(), compile=parsim_compile(),",
        "                          activation_checkpoint=parsim_activation_checkpoint())", "",
    ]
    return "\n".join(doc + body)


def to_torchtitan_toml(plan: Plan, spec: ModelSpec, prediction: str = "") -> str:
    """The plan as a torchtitan v0.2.x job config (the last TOML schema, ``torchtitan/config/job_config.py``)."""
    gaps = _gaps(plan, spec, "0.2")
    mode, every = parse_ac(plan.ac)
    ac_mode = {"none": "none", "full": "full", "selective-op": "selective", "layer": "selective"}[mode]
    ac_opt = "op" if mode == "selective-op" else str(every)

    def b(v):
        return "true" if v else "false"

    module, flavor = TORCHTITAN_MODELS.get(spec.name, ("llama3", "set-me"))
    lines = [*_header(plan, spec, plan.world_size, prediction, gaps, "# "), "",
             "[model]", f'name = "{module}"', f'flavor = "{flavor}"',
             f"converters = [{chr(34) + 'quantize.linear.float8' + chr(34) if plan.float8 else ''}]", "",
             "[training]", f"local_batch_size = {plan.local_batch_size}",
             f"global_batch_size = {plan.global_batch_size}", f"seq_len = {plan.seq_len}",
             f'mixed_precision_param = "{plan.param_dtype}"', f'mixed_precision_reduce = "{plan.reduce_dtype}"', "",
             "[parallelism]", f"data_parallel_replicate_degree = {plan.dp_replicate}",
             f"data_parallel_shard_degree = {plan.dp_shard}",
             f'fsdp_reshard_after_forward = "{plan.fsdp_reshard_after_forward}"',
             f"tensor_parallel_degree = {plan.tp}", f"disable_loss_parallel = {b(False)}",
             f"enable_async_tensor_parallel = {b(plan.async_tp and plan.compile)}",
             f"pipeline_parallel_degree = {plan.pp}", f'pipeline_parallel_schedule = "{plan.pp_schedule}"',
             f"pipeline_parallel_microbatch_size = {plan.micro_batch_size}"]
    lps = _layers_per_stage(plan, spec)
    if lps is not None:
        lines.append(f"pipeline_parallel_layers_per_stage = {lps}")
    lines += [f"context_parallel_degree = {plan.cp}", f"expert_parallel_degree = {plan.ep}",
              f"expert_tensor_parallel_degree = {plan.etp}", "",
              "[activation_checkpoint]", f'mode = "{ac_mode}"', f'selective_ac_option = "{ac_opt}"', "",
              "[compile]", f"enable = {b(plan.compile)}", 'components = ["model", "loss"]', ""]
    if plan.float8:
        tw = plan.float8_recipe == "tensorwise"
        lines += ["[quantize.linear.float8]", f'recipe_name = "{plan.float8_recipe}"',
                  f"enable_fsdp_float8_all_gather = {b(tw and plan.dp_shard * plan.cp > 1)}",
                  f"precompute_float8_dynamic_scale_for_fsdp = {b(tw and plan.dp_shard * plan.cp > 1)}",
                  'filter_fqns = ["output"]', ""]
    return "\n".join(lines)


def to_megatron_args(plan: Plan, spec: ModelSpec, prediction: str = "") -> str:
    """The plan as Megatron-LM ``pretrain_gpt.py`` arguments (a shell snippet), where Megatron can express it.

    Megatron's data parallelism is DDP (optionally with its distributed optimizer): parsim's dp_replicate. FSDP
    (dp_shard > 1) maps to Megatron's ``--use-torch-fsdp2`` only roughly (no HSDP mesh, no reshard choice), and CP
    is Megatron's ring attention; what has no Megatron flag is written at the top. Megatron words: micro batch =
    sequences per forward/backward pass, global batch = sequences per optimizer step (gradient accumulation and
    pipeline microbatches are both implied by global / (micro x dp))."""
    gaps = []
    if plan.dp_shard > 1:
        gaps.append(f"FSDP over {plan.dp_shard} ranks: emitted as --use-torch-fsdp2 (Megatron's FSDP2 wrapper); "
                    "parsim's reshard and HSDP choices have no Megatron flag")
    if tuple(plan.mesh_order) != AXES:
        gaps.append("device order: Megatron orders its groups tp-cp-ep-dp-pp (--use-tp-pp-dp-mapping changes "
                    "it); parsim's order is not emitted")
    if tuple(plan.wrapper_order) != TORCHTITAN_ORDER:
        gaps.append("wrapper order: no Megatron equivalent")
    if plan.compile:
        gaps.append("torch.compile: Megatron uses fused kernels (TE, apex) instead; no flag emitted")
    mode, every = parse_ac(plan.ac)
    if mode == "selective-op":
        gaps.append("per-op selective AC: emitted as Megatron's --recompute-granularity selective (core attention "
                    "only), which saves more than torchtitan's per-op policy")
    if plan.ep > 1 and plan.ep_from == "dp_shard" and plan.tp > 1:
        gaps.append("EP borrowed from dp_shard x cp x tp (dp2ep): Megatron's EP comes from the data-parallel ranks "
                    "(and --expert-tensor-parallel-size); the EP degree is emitted")
    mb = plan.micro_batch_size
    args = [f"--tensor-model-parallel-size {plan.tp}", f"--pipeline-model-parallel-size {plan.pp}",
            f"--context-parallel-size {plan.cp}", f"--micro-batch-size {mb}",
            f"--global-batch-size {plan.global_batch_size}", f"--seq-length {plan.seq_len}", "--bf16"]
    if plan.tp > 1 and plan.sequence_parallel:
        args.append("--sequence-parallel")
    if plan.async_tp and plan.tp > 1:
        args.append("--tp-comm-overlap")
    if plan.pp > 1 and plan.pp_schedule == "Interleaved1F1B" and plan.pp_stages_per_rank > 1:
        args.append(f"--num-virtual-stages-per-pipeline-rank {plan.pp_stages_per_rank}")
    elif plan.pp > 1 and plan.pp_schedule == "GPipe":
        gaps.append("GPipe schedule: Megatron runs 1F1B (the same bubble, less activation memory)")
    if plan.ep > 1:
        args.append(f"--expert-model-parallel-size {plan.ep}")
    if plan.etp > 1:
        args.append(f"--expert-tensor-parallel-size {plan.etp}")
    if mode in ("full", "layer"):
        n = 1 if mode == "full" else every
        args += ["--recompute-granularity full", "--recompute-method uniform", f"--recompute-num-layers {n}"]
        if mode == "layer":
            gaps.append(f"AC of one layer in {every}: emitted as uniform full recompute of blocks of {every} layers "
                        "(Megatron checkpoints a block's input and recomputes the block)")
    elif mode == "selective-op":
        args.append("--recompute-granularity selective")
    if plan.distributed_optimizer or plan.dp_replicate > 1:
        args.append("--use-distributed-optimizer" if plan.distributed_optimizer else "# DDP without optimizer sharding")
    if plan.dp_shard > 1:
        args.append("--use-torch-fsdp2")
    if plan.float8:
        recipe = {"tensorwise": "tensorwise", "rowwise": "blockwise", "rowwise_with_gw_hp": "blockwise"}
        args += ["--fp8-format hybrid", f"--fp8-recipe {recipe[plan.float8_recipe]}"]
        if plan.float8_recipe != "tensorwise":
            gaps.append(f"float8 {plan.float8_recipe}: Megatron/TE has tensorwise (delayed / current scaling), "
                        "blockwise and mxfp8, not torchao's rowwise: blockwise emitted")
    args.append("--transformer-impl " + ("transformer_engine" if plan.te_layers else "local"))
    if plan.fused_loss:
        args.append("--cross-entropy-loss-fusion")
    if plan.reduce_dtype == "float32":
        args.append("--accumulate-allreduce-grads-in-fp32")
    head = _header(plan, spec, plan.world_size, prediction, [], "# ")
    head[-1] = "# Megatron-LM arguments (pretrain_gpt.py); model size flags (--num-layers ...) are yours to add."
    lines = [*head, *(["# What Megatron cannot express of this plan:"] + [f"# - {g}" for g in gaps] if gaps else []),
             "MEGATRON_PARALLEL_ARGS=(", *[f"  {a}" for a in args if not a.startswith("#")], ")"]
    return "\n".join(lines) + "\n"
