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
from .plan_schema import options_on
from .spec import ModelSpec

# parsim preset -> (torchtitan model module, flavor, torchtitan 0.3.0 recipe in <module>.config_registry)
TORCHTITAN_MODELS = {
    "llama3-8b": ("llama3", "8B", "llama3_8b"), "llama3-70b": ("llama3", "70B", "llama3_70b"),
    "llama3-405b": ("llama3", "405B", "llama3_405b"), "deepseek-v3": ("deepseek_v3", "671B", "deepseek_v3_671b"),
    "qwen3-30b-a3b": ("qwen3", "30B-A3B", "qwen3_30b_a3b"),
}
# torchtitan's own wrapper order (models/llama3/infra/parallelize.py): PP first, then TP, AC, per-block compile, FSDP
TORCHTITAN_ORDER = DEFAULT_ORDER


def torchtitan_model(spec: ModelSpec) -> tuple[str, str, str] | None:
    """(module, flavor, recipe) of the torchtitan registry model with exactly these dimensions, or None. A model
    given as an HF folder matches when every dimension equals a preset's (its name aside); a near miss (a 16-layer
    d=2048 llama is not 8B) has no torchtitan model."""
    import dataclasses

    from .spec import PRESETS

    for name, entry in TORCHTITAN_MODELS.items():
        p = PRESETS[name]  # by dimensions: the flavour's own RoPE and epsilon are torchtitan's
        if dataclasses.replace(spec, name=name, rope_theta=p.rope_theta, norm_eps=p.norm_eps,
                               rope_scaling=p.rope_scaling) == p:
            return entry
    return None


def llama_buildable(spec: ModelSpec) -> str:
    """'' when torchtitan 0.3.0's llama3 modules build this model from its dimensions (a dense SwiGLU, RMSNorm, GQA
    decoder without biases or qk-norm, heads of d_model / n_heads, untied output, RoPE without or with llama3
    scaling); otherwise what stands in the way."""
    scaling = dict(spec.rope_scaling)
    why = [w for cond, w in (
        (spec.moe is not None, "mixture of experts"), (spec.mla is not None, "multi-latent attention"),
        (spec.mlp != "swiglu", f"{spec.mlp} MLP"), (spec.norm != "rmsnorm", spec.norm),
        (spec.bias or bool(spec.linear_biases), "linear biases"), (spec.qk_norm, "qk-norm"),
        (spec.max_position_embeddings > 0, "learned positions"), (spec.tie_embeddings, "tied embeddings"),
        (spec.head_dim != spec.d_model // spec.n_heads, f"head_dim {spec.head_dim} != d_model / n_heads"),
        (scaling.get("rope_type", scaling.get("type", "llama3")) != "llama3", "rope scaling other than llama3"),
    ) if cond]
    return ", ".join(why)


def torchtitan_gaps(plan: Plan, spec: ModelSpec, version: str) -> list[str]:
    """What torchtitan ``version`` ("0.3.0" or "0.2") cannot express of this plan and of its model, one line each."""
    return torchtitan_plan_gaps(plan, spec, version) + torchtitan_model_gaps(spec, version)


def torchtitan_model_gaps(spec: ModelSpec, version: str = "0.3.0") -> list[str]:
    """What torchtitan cannot build of the model whatever the plan (0.3.0 builds a dense llama-family model outside
    its registry from the dimensions: not a gap)."""
    if torchtitan_model(spec) is not None or version == "0.3.0" and not llama_buildable(spec):
        return []
    why = llama_buildable(spec)
    return [f"model {spec.name}: its dimensions match no torchtitan registry flavour (llama3 8B/70B/405B, "
            "qwen3 30B-A3B, deepseek_v3 671B)" + (f" and its {why} keep torchtitan's llama3 modules from building "
                                                  "it" if why else "") +
            "; torchtitan builds models from its registries, so the config refuses to build until you add a "
            "flavour with these dimensions and name it there"]


def torchtitan_plan_gaps(plan: Plan, spec: ModelSpec, version: str) -> list[str]:
    """What torchtitan ``version`` runs otherwise of this plan (its mesh, wrappers, EP, float8, AC, dtype)."""
    out = []
    if tuple(plan.mesh_order) != AXES:
        used = [a for a in plan.mesh_order if getattr(plan, a) > 1]
        out.append(f"device order {','.join(used)} (outermost first): torchtitan builds its mesh as "
                   "pp, dp_replicate, dp_shard, cp, tp and has no option for another order; parsim predicted this "
                   "plan in the order above, torchtitan will run it in its own")
    if tuple(plan.wrapper_order) != TORCHTITAN_ORDER:
        out.append(f"wrapper order {'>'.join(plan.wrapper_order)}: torchtitan applies PP > TP > AC > compile > "
                   "FSDP and has no option for another order")
    if plan.ep > 1 and plan.ep_from in ("dp_replicate", "folded"):
        borrowed = plan.dp_shard * plan.cp * plan.tp
        where = ("borrowed from dp_replicate (DDP-style" if plan.ep_from == "dp_replicate" else
                 "folded over dp_replicate x cp x tp (MoE parallel folding")
        out.append(f"EP {where}, Megatron): torchtitan borrows EP from "
                   f"dp_shard x cp x tp ({borrowed}); " + (
                       f"expert_parallel_degree={plan.ep} is emitted, its ranks will come from there"
                       if _torchtitan_ep(plan, version) == plan.ep else
                       f"it cannot build EP {plan.ep} from there, so expert_parallel_degree=1 is emitted (experts "
                       "replicated, sharded by FSDP: more expert memory, no all-to-all)"))
    if plan.ep > 1 and plan.ep_from == "dp_shard" and _torchtitan_ep(plan, version) != plan.ep:
        out.append(f"EP {plan.ep} with expert TP {_torchtitan_etp(plan, version)}: torchtitan {version} cannot borrow "
                   "it from dp_shard x cp x tp, so expert_parallel_degree=1 is emitted")
    if plan.etp > 1 and version == "0.3.0":
        out.append(f"expert tensor parallel {plan.etp}: removed in torchtitan (PR #3167); experts run without TP")
    if plan.etp not in (1, plan.tp) and version == "0.2":
        out.append(f"expert tensor parallel {plan.etp} with tp {plan.tp}: torchtitan 0.2 takes ETP = TP or 1; "
                   "expert_tensor_parallel_degree=1 is emitted")
    if plan.float8 and plan.float8_recipe == "tensorwise" and version == "0.3.0":
        out.append("float8 tensorwise: removed in torchtitan 0.3.0 (PR #3127); the rowwise recipe is emitted, "
                   "which runs rowwise GEMMs at 90-100% of tensorwise speed on most shapes")
    mode, every = parse_ac(plan.ac)
    if mode == "core-attn":
        out.append("core-attn AC (the attention core alone recomputed, Megatron's selective recompute): torchtitan's "
                   "selective AC is per op; " + ("SelectiveAC" if version == "0.3.0" else "selective per-op AC")
                   + " is emitted (more recompute, less memory than planned)")
    if mode == "layer" and version == "0.3.0":
        out.append(f"AC of one layer in {every} (layer:{every}): torchtitan 0.3.0 has FullAC, SelectiveAC (per op) and "
                   "MemoryBudgetAC only; FullAC is emitted (more recompute, less memory than planned)")
    model = torchtitan_model(spec)
    if version == "0.2" and plan.cp > 1 and model is not None and model[0] == "deepseek_v3":
        # torchtitan 0.2.2 models/deepseek_v3: every flavour sets attn_type="flex", and DeepSeekV3ModelArgs.
        # update_from_config raises NotImplementedError for CP with any attention but SDPA; the TOML cannot change it
        out.append("CP with DeepSeek-V3 on torchtitan 0.2.x: its flavours run FlexAttention, which its CP refuses "
                   "(NotImplementedError), so this config will not start; torchtitan 0.3.0 (--torchtitan-format "
                   "python) runs it")
    if plan.async_tp and not plan.compile:
        out.append("async TP without compile: torchtitan's async TP needs torch.compile; enable compile")
    if plan.param_dtype != "float32" and plan.dp_shard == 1 and plan.cp == 1 and (plan.tp > 1 or plan.pp > 1):
        # torchtitan.distributed.utils.maybe_enable_amp: fully_shard applies mixed precision when dp_shard > 1 or
        # cp > 1; otherwise autocast, except under TP or PP, where it logs a warning and trains in float32
        out.append(f"{plan.param_dtype} with {'TP' if plan.tp > 1 else 'PP'} and neither FSDP (dp_shard 1) nor CP: "
                   "torchtitan applies mixed precision through fully_shard, or autocast without TP and PP; here it "
                   "disables it and trains in float32 (its maybe_enable_amp), while parsim predicted "
                   f"{plan.param_dtype} compute: add dp_shard > 1, or expect float32 speed and memory")
    return out + options_on(plan, "torchtitan_gap")


def _torchtitan_etp(plan: Plan, version: str) -> int:
    """The expert TP degree torchtitan ``version`` is given: 0.3.0 has none (experts without TP), 0.2 takes TP or 1."""
    return 1 if version == "0.3.0" else plan.etp if plan.etp == plan.tp else 1


def _torchtitan_ep(plan: Plan, version: str) -> int:
    """The EP degree torchtitan can build (else 1): it borrows all of cp (and of tp when etp = 1) and some dp_shard,
    so ``ep % (cp x tp) == 0 and (dp_shard x cp x tp) % ep == 0`` with etp 1, ``ep % cp == 0 and (dp_shard x cp) %
    ep == 0`` with etp = tp (torchtitan.distributed.parallel_dims ``_validate``, 0.2.x and 0.3.0)."""
    etp = _torchtitan_etp(plan, version)
    borrowed = plan.cp * (plan.tp if etp == 1 else 1)
    ok = plan.ep % borrowed == 0 and (plan.dp_shard * plan.cp * plan.tp) % (plan.ep * etp) == 0
    return plan.ep if ok else 1


def _stage_fqns(plan: Plan, spec: ModelSpec, output: str) -> list[list[str]] | None:
    """The modules of every pipeline stage as parsim costs them (``layers.stage_bounds``: even stages, the first
    ones one layer longer; embedding on the first stage, final norm and output projection on the last), for
    torchtitan's ``module_fqns_per_model_part``. torchtitan's own split counts the embedding and the output as
    one layer each (first/last_stage_less_layers), which leaves e.g. 17 stages for 80 layers at 4 ranks x 4."""
    if plan.pp == 1:
        return None
    from .costmodel.layers import stage_bounds

    b = stage_bounds(spec.n_layers, plan.pp * plan.pp_stages_per_rank)
    parts = [[f"layers.{i}" for i in range(b[s], b[s + 1])] for s in range(len(b) - 1)]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", output]
    return parts


def _header(plan: Plan, spec: ModelSpec, n_gpus: int, prediction: str, gaps: list[str], comment: str,
            target: str = "torchtitan") -> list[str]:
    lines = [f"parsim plan {plan.plan_id} for {spec.name} on {n_gpus} GPUs: {plan.describe()}, AC {plan.ac}, "
             f"compile {plan.compile}, float8 {plan.float8_recipe if plan.float8 else False}"]
    if prediction:
        lines.append(f"parsim predicted: {prediction}")
    if gaps:
        lines.append(f"What {target} cannot express of this plan:")
        lines += [f"- {g}" for g in gaps]
    else:
        lines.append(f"{target} expresses every field of this plan.")
    return [f"{comment}{ln}" if ln else comment.rstrip() for ln in lines]


def _ac_030(plan: Plan) -> str:
    mode, _ = parse_ac(plan.ac)
    return {"none": "None", "full": "FullAC.Config()", "layer": "FullAC.Config()",
            "selective-op": "SelectiveAC.Config()", "core-attn": "SelectiveAC.Config()"}[mode]


def _parallelism_030(plan: Plan, spec: ModelSpec) -> list[str]:
    par = [f"data_parallel_replicate_degree={plan.dp_replicate}", f"data_parallel_shard_degree={plan.dp_shard}",
           f"fsdp_reshard_after_forward={plan.fsdp_reshard_after_forward!r}",
           f"tensor_parallel_degree={plan.tp}", f"enable_sequence_parallel={bool(plan.sequence_parallel)}",
           f"pipeline_parallel_degree={plan.pp}", f"pipeline_parallel_schedule={plan.pp_schedule!r}",
           f"pipeline_parallel_microbatch_size={plan.micro_batch_size}",
           f"context_parallel_degree={plan.cp}", f"expert_parallel_degree={_torchtitan_ep(plan, '0.3.0')}"]
    fqns = _stage_fqns(plan, spec, "lm_head")
    if fqns is not None:  # one stage per line
        par.append("module_fqns_per_model_part=[\n" + "".join(f"            {part!r},\n" for part in fqns)
                   + "        ]")
    return par


def _model_spec_030(plan: Plan, spec: ModelSpec) -> list[str]:
    model = torchtitan_model(spec)
    recipe = "rowwise" if plan.float8_recipe == "tensorwise" else plan.float8_recipe
    # torchtitan's recipes keep the output projection (and a MoE router) in bf16
    keep = ["lm_head", "router.gate"] if spec.moe else ["lm_head"]
    conv = (f"[Float8LinearConverter.Config(recipe_name={recipe!r}, filter_fqns={keep!r}, "
            f"model_compile_enabled={plan.compile})]" if plan.float8 else "None")
    f8 = ["    from torchtitan.components.quantization import Float8LinearConverter"] if plan.float8 else []
    if model is None:
        return _llama_spec_030(plan, spec, f8, conv) if not llama_buildable(spec) else [
            "    raise NotImplementedError(NOT_EXPRESSED[-1])"]
    module, flavor, _ = model
    return [f"    from torchtitan.models.{module} import model_registry", *f8, "",
            f"    return model_registry({flavor!r}, attn_backend='flex', converters={conv})"]


def _llama_spec_030(plan: Plan, spec: ModelSpec, f8: list[str], conv: str) -> list[str]:
    """A model outside torchtitan's registry, built from its dimensions with torchtitan 0.3.0's llama3 modules as
    its registry flavours are (``torchtitan.models.llama3``: the layer builder, the inits, the model spec's
    parallelize / pipelining functions and state-dict adapter), flavour "parsim"; RoPE base, llama3 scaling and the
    norm epsilon from the spec."""
    scaling = dict(spec.rope_scaling)
    rope = (f"theta={spec.rope_theta or 10000.0!r}, scaling='llama', scaling_factor={float(scaling['factor'])!r}, "
            f"low_freq_factor={float(scaling.get('low_freq_factor', 1.0))!r}, "
            f"high_freq_factor={float(scaling.get('high_freq_factor', 4.0))!r}, original_max_position_embeddings="
            f"{int(scaling.get('original_max_position_embeddings', 8192))}" if scaling else
            f"theta={spec.rope_theta or 10000.0!r}, scaling='none'")
    eps = spec.norm_eps or 1e-5
    return [
        "    from torchtitan.distributed.pipeline_parallel import pipeline_llm",
        "    from torchtitan.models import llama3 as L",
        "    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm",
        "    from torchtitan.protocols.model_spec import ModelSpec", *f8, "",
        f"    dim, vocab, eps = {spec.d_model}, {spec.vocab_size}, {eps!r}",
        f"    layers = L._build_llama3_layers(fuse_qkv=True, n_layers={spec.n_layers}, dim=dim, "
        f"n_heads={spec.n_heads}, n_kv_heads={spec.n_kv_heads},",
        f"                                    hidden_dim={spec.d_ff}, attn_backend='flex', rope=ComplexRoPE.Config(",
        f"                                        dim={spec.head_dim}, max_seq_len={plan.seq_len}, {rope}))",
        "    layers = [dataclasses.replace(b, attention_norm=dataclasses.replace(b.attention_norm, eps=eps),",
        "                                  ffn_norm=dataclasses.replace(b.ffn_norm, eps=eps)) for b in layers]",
        "    config = L.Llama3Model.Config(",
        "        dim=dim, vocab_size=vocab, layers=layers,",
        "        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,",
        "                                        param_init=L._EMBEDDING_INIT),",
        "        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=L._NORM_INIT),",
        "        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)))",
        *([f"    for c in {conv}:", "        config = c.build().convert(config)"] if f8 else []),
        "    return ModelSpec(name='llama3', flavor='parsim', model=config, parallelize_fn=L.parallelize_llama,",
        "                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None,",
        "                     state_dict_adapter=L.Llama3StateDictAdapter)"]


def to_torchtitan_python(plan: Plan, spec: ModelSpec, prediction: str = "") -> str:
    """The plan as a torchtitan 0.3.0 config module: torchtitan's own recipe for the model (``llama3_70b()`` ...:
    loss, dataloader, optimizer, checkpointing) with what the plan decides replaced (see the module docstring)."""
    gaps = torchtitan_gaps(plan, spec, "0.3.0")
    model = torchtitan_model(spec) or (("llama3", "parsim", "llama3_8b") if not llama_buildable(spec) else None)
    recipe = f"(\"torchtitan.models.{model[0]}.config_registry\", \"{model[2]}\")" if model else "None"
    no_graphs = plan.pp > 1 or plan.ep > 1
    notes = ["attention: torchtitan 0.3.0 language models take FlexAttention with block-causal masks (SDPA is "
             "refused); attn_backend='flex' is written out, parsim costs it as causal attention"]
    if no_graphs:
        notes.append("training.disable_cuda_graphs=True: torchtitan 0.3.0 captures no CUDA graphs with "
                     "pipeline or expert parallelism (its own check)")
    doc = ['"""torchtitan 0.3.0 config written by parsim.', "",
           *_header(plan, spec, plan.world_size, prediction, gaps, ""), "", *[f"Note: {n}" for n in notes], "",
           "Run: put this file on PYTHONPATH and start torchtitan with", "    torchrun --nproc_per_node "
           "<GPUs per node> -m torchtitan.train --module <this file's module name> --config parsim_plan",
           '"""', "", "import dataclasses", "import sys", "",
           "# torchtitan's recipe for the model (module, function); parsim replaces what the plan decides",
           f"RECIPE = {recipe}", "NOT_EXPRESSED = [", *[f"    {g!r}," for g in gaps], "]", ""]
    train_extra = ", disable_cuda_graphs=True" if no_graphs else ""
    body = [
        "", "def _recipe():",
        "    import importlib", "",
        "    if RECIPE is None:", "        raise NotImplementedError(NOT_EXPRESSED[-1])",
        "    return getattr(importlib.import_module(RECIPE[0]), RECIPE[1])()", "", "",
        "def parsim_parallelism():",
        "    from torchtitan.config import ParallelismConfig", "",
        "    return ParallelismConfig(", *[f"        {p}," for p in _parallelism_030(plan, spec)], "    )", "", "",
        "def parsim_training(base=None):",
        "    from torchtitan.config import TrainingConfig", "",
        "    return dataclasses.replace(base if base is not None else TrainingConfig(),",
        f"                               local_batch_size={plan.local_batch_size}, "
        f"global_batch_size={plan.global_batch_size}, seq_len={plan.seq_len},",
        f"                               mixed_precision_param={plan.param_dtype!r}, "
        f"mixed_precision_reduce={plan.reduce_dtype!r}{train_extra})", "", "",
        "def parsim_compile():",
        "    from torchtitan.config import CompileConfig", "",
        f"    return CompileConfig(enable={plan.compile}, components=['model', 'loss'], "
        f"enable_async_tensor_parallel={bool(plan.async_tp and plan.compile)})", "", "",
        "def parsim_activation_checkpoint():",
        "    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: F401", "",
        f"    return {_ac_030(plan)}", "", "",
        "def parsim_model_spec():", *_model_spec_030(plan, spec), "", "",
        "def parsim_plan():",
        "    for line in NOT_EXPRESSED:",
        "        print(f\"parsim: torchtitan cannot express: {line}\", file=sys.stderr)",
        "    base = _recipe()",
        "    return dataclasses.replace(base, model_spec=parsim_model_spec(), training=parsim_training(base.training),",
        "                               parallelism=parsim_parallelism(), compile=parsim_compile(),",
        "                               activation_checkpoint=parsim_activation_checkpoint())", "",
    ]
    return "\n".join(doc + body)


def to_torchtitan_toml(plan: Plan, spec: ModelSpec, prediction: str = "") -> str:
    """The plan as a torchtitan v0.2.x job config (the last TOML schema, ``torchtitan/config/job_config.py``)."""
    gaps = torchtitan_gaps(plan, spec, "0.2")
    mode, every = parse_ac(plan.ac)
    ac_mode = {"none": "none", "full": "full", "selective-op": "selective", "layer": "selective",
               "core-attn": "selective"}[mode]
    ac_opt = "op" if mode in ("selective-op", "core-attn") else str(every)

    def b(v):
        return "true" if v else "false"

    module, flavor, _ = torchtitan_model(spec) or ("llama3", "set-me", "")
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
    fqns = _stage_fqns(plan, spec, "output")
    if fqns is not None:
        lines.append("module_fqns_per_model_part = [" + ", ".join(
            "[" + ", ".join(f'"{m}"' for m in part) + "]" for part in fqns) + "]")
    lines += [f"context_parallel_degree = {plan.cp}", f"expert_parallel_degree = {_torchtitan_ep(plan, '0.2')}",
              f"expert_tensor_parallel_degree = {_torchtitan_etp(plan, '0.2')}", "",
              "[activation_checkpoint]", f'mode = "{ac_mode}"', f'selective_ac_option = "{ac_opt}"', "",
              "[compile]", f"enable = {b(plan.compile)}", 'components = ["model", "loss"]', ""]
    if plan.float8:
        # 0.2.2 asserts on a recipe_name together with the float8 all-gather: tensorwise is the recipe-less config
        tw = plan.float8_recipe == "tensorwise"
        fsdp_f8 = tw and plan.dp_shard * plan.cp > 1
        lines += ["[quantize.linear.float8]", *([] if tw else [f'recipe_name = "{plan.float8_recipe}"']),
                  f"enable_fsdp_float8_all_gather = {b(fsdp_f8)}",
                  f"precompute_float8_dynamic_scale_for_fsdp = {b(fsdp_f8)}",
                  'filter_fqns = ["output"]', ""]
    return "\n".join(lines)


def megatron_gaps(plan: Plan, spec: ModelSpec) -> list[str]:
    """What Megatron-LM cannot express of this plan and its model (or expresses differently), one line each."""
    gaps = _megatron_positions(spec, plan)[1]
    if not spec.norm_eps:
        gaps.append("norm epsilon: not known for this model (give its config.json); Megatron's default 1e-5 applies")
    if spec.linear_biases and not {"wq", "wk", "wv"} <= set(spec.linear_biases) or \
            set(spec.linear_biases) - {"wq", "wk", "wv"}:
        gaps.append(f"biases on {', '.join(spec.linear_biases)}: Megatron has biases on every linear "
                    "(--disable-bias-linear off) or on q, k, v only (--add-qkv-bias)")
    mode, every = parse_ac(plan.ac)
    if plan.dp_shard > 1:
        gaps.append(f"FSDP over {plan.dp_shard} ranks: emitted as Megatron-FSDP (--use-megatron-fsdp, "
                    "optim_grads_params = ZeRO-3, which validates with PP and EP; torch FSDP2 does not)"
                    + ("; reshard-after-forward never has no Megatron-FSDP flag (it reshards after forward)"
                       if plan.fsdp_reshard_after_forward == "never" else ""))
    if tuple(plan.mesh_order) != AXES:
        gaps.append("device order: Megatron orders its groups tp-cp-ep-dp-pp (--use-tp-pp-dp-mapping changes "
                    "it); parsim's order is not emitted")
    if tuple(plan.wrapper_order) != TORCHTITAN_ORDER:
        gaps.append("wrapper order: no Megatron equivalent")
    if plan.compile:
        gaps.append("torch.compile: Megatron uses fused kernels (TE, apex) instead; no flag emitted")
    if mode == "selective-op":
        gaps.append("per-op selective AC: emitted as Megatron's --recompute-granularity selective (core attention "
                    "only), which saves less and recomputes less than torchtitan's per-op policy (--ac core-attn "
                    "plans what Megatron runs)")
    if mode == "layer":
        gaps.append(f"AC of one layer in {every}: emitted as --recompute-method block with the same number of "
                    "recomputed layers per stage; Megatron recomputes the first ones of each stage, not every "
                    f"{every}-th")
    if plan.ep > 1 and plan.ep_from == "dp_shard" and plan.tp > 1:
        gaps.append("EP borrowed from dp_shard x cp x tp (dp2ep): Megatron's EP comes from the data-parallel ranks "
                    "(and --expert-tensor-parallel-size); the EP degree is emitted")
    if plan.ep > 1 and plan.ep_from == "dp_replicate" and plan.cp * plan.tp // plan.etp > 1:
        gaps.append("EP inside dp_replicate (DDP-style): Megatron lays the expert mesh over tp x cp x dp, expert TP "
                    "innermost, so its EP groups take tp and cp ranks first (ep_from folded predicts that layout)")
    if plan.pp > 1 and plan.pp_schedule == "GPipe":
        gaps.append("GPipe schedule: Megatron runs 1F1B (the same bubble, less activation memory)")
    if plan.async_tp and plan.tp > 1 and not plan.sequence_parallel:
        gaps.append("TP communication overlap without sequence parallel: Megatron overlaps TP communication only "
                    "with SP (validate_args); --tp-comm-overlap is not emitted")
    if (plan.float8 or plan.async_tp and plan.tp > 1) and not plan.te_layers:
        gaps.append("float8 and TP communication overlap need Transformer Engine layers: --transformer-impl "
                    "transformer_engine is emitted, while parsim predicted its own layers (predict with --te-layers "
                    "for Megatron's activation memory)")
    if plan.float8 and plan.float8_recipe != "tensorwise":
        gaps.append(f"float8 {plan.float8_recipe}: Megatron/TE has tensorwise (delayed / current scaling), "
                    "blockwise and mxfp8, not torchao's rowwise: blockwise emitted")
    if plan.grad_sync == "every-pass" and plan.grad_accum_steps > 1 and plan.dp > 1:
        gaps.append(f"gradients reduced after each of {plan.grad_accum_steps} passes: Megatron reduces once per step "
                    "(no_sync for every microbatch but the last); predict with --grad-sync once for what it runs")
    return gaps + options_on(plan, "megatron_gap")


# Every ModelSpec field, and how the Megatron arguments carry it (a flag, or the gap said when it cannot):
# tests/test_emit_model.py holds every field of ModelSpec, MoESpec and MLASpec to this table.
MEGATRON_FIELDS = {
    "name": "(a comment)", "n_layers": "--num-layers", "d_model": "--hidden-size",
    "n_heads": "--num-attention-heads", "n_kv_heads": "--group-query-attention --num-query-groups",
    "d_ff": "--ffn-hidden-size", "vocab_size": "--vocab-size (the tokenizer's, padded by Megatron: said)",
    "head_dim": "--kv-channels", "tie_embeddings": "--untie-embeddings-and-output-weights",
    "mlp": "--swiglu (GeLU: Megatron's default)", "norm": "--normalization", "bias": "--disable-bias-linear",
    "linear_biases": "--add-qkv-bias (other patterns: a gap)", "qk_norm": "--qk-layernorm",
    "max_position_embeddings": "--position-embedding-type learned_absolute --max-position-embeddings",
    "moe": "--num-experts --moe-router-topk --moe-ffn-hidden-size --moe-shared-expert-intermediate-size "
           "--moe-layer-freq", "mla": "--multi-latent-attention --kv-lora-rank --q-lora-rank --qk-head-dim "
                                  "--qk-pos-emb-head-dim --v-head-dim",
    "rope_theta": "--rotary-base (unknown: a gap)", "norm_eps": "--norm-epsilon (unknown: a gap)",
    "rope_scaling": "--use-rope-scaling --rope-scaling-factor (llama3); --rope-type yarn --rotary-scaling-factor "
                    "--mscale --mscale-all-dim (MLA); other kinds and non-default numbers: a gap",
}
# Megatron's fixed numbers for the two rope scalings it has (rotary_pos_embedding._apply_scaling: low 1, high 4,
# original 8192; MLATransformerConfig: original_max_position_embeddings 4096, beta_fast 32, beta_slow 1)
MEGATRON_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MEGATRON_MLA_YARN = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _megatron_positions(spec: ModelSpec, plan: Plan) -> tuple[list[str], list[str]]:
    """(flags, gaps) of the position embedding: learned, or RoPE with its base and scaling."""
    if spec.max_position_embeddings:
        return ["--position-embedding-type learned_absolute",
                f"--max-position-embeddings {spec.max_position_embeddings}"], []
    args = ["--position-embedding-type rope", f"--max-position-embeddings {plan.seq_len}"]
    gaps = []
    if spec.rope_theta:
        args.append(f"--rotary-base {spec.rope_theta:.0f}")
    else:
        gaps.append("RoPE base: not known for this model (give its config.json); Megatron's default 10000 applies")
    scaling = dict(spec.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type", ""))
    fixed = MEGATRON_LLAMA3_SCALING if kind == "llama3" else MEGATRON_MLA_YARN if kind == "yarn" and spec.mla else {}
    if kind == "llama3":
        args += ["--use-rope-scaling", f"--rope-scaling-factor {float(scaling.get('factor', 8.0)):g}"]
    elif kind == "yarn" and spec.mla:
        args += ["--rope-type yarn", f"--rotary-scaling-factor {float(scaling.get('factor', 1.0)):g}",
                 f"--mscale {float(scaling.get('mscale', 1.0)):g}",
                 f"--mscale-all-dim {float(scaling.get('mscale_all_dim', 0.0)):g}"]
    elif kind:
        gaps.append(f"rope_scaling {kind}: Megatron's GPT arguments have llama3 scaling and YaRN for MLA only; "
                    "positions are emitted unscaled, so long-context behaviour differs from the checkpoint")
    off = {k: scaling[k] for k, v in fixed.items() if k in scaling and float(scaling[k]) != v}
    if off:
        gaps.append(f"rope_scaling {kind} with {off}: Megatron fixes {fixed} for it; the emitted positions differ")
    return args, gaps


def _megatron_model_args(spec: ModelSpec, plan: Plan) -> list[str]:
    """The model's size flags, from its spec (Megatron-LM's GPT arguments; ``MEGATRON_FIELDS``)."""
    args = [f"--num-layers {spec.n_layers}", f"--hidden-size {spec.d_model}",
            f"--num-attention-heads {spec.n_heads}", f"--ffn-hidden-size {spec.d_ff}",
            f"--seq-length {plan.seq_len}", *_megatron_positions(spec, plan)[0]]
    if spec.norm_eps:
        args.append(f"--norm-epsilon {spec.norm_eps:g}")
    if not spec.mla:
        args.append(f"--kv-channels {spec.head_dim}")
        if spec.n_kv_heads != spec.n_heads:
            args += ["--group-query-attention", f"--num-query-groups {spec.n_kv_heads}"]
    else:
        m = spec.mla
        args += ["--multi-latent-attention", f"--kv-lora-rank {m.kv_lora_rank}",
                 f"--qk-head-dim {m.qk_nope_head_dim}", f"--qk-pos-emb-head-dim {m.qk_rope_head_dim}",
                 f"--v-head-dim {m.v_head_dim}", *([f"--q-lora-rank {m.q_lora_rank}"] if m.q_lora_rank else [])]
    # parsim's model (and torchtitan's) has no dropout; Megatron's default 0.1 would add dropout masks
    args += ["--attention-dropout 0", "--hidden-dropout 0"]
    args.append("--normalization " + ("RMSNorm" if spec.norm == "rmsnorm" else "LayerNorm"))
    if spec.mlp == "swiglu":
        args.append("--swiglu")
    if not spec.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not spec.bias:
        args.append("--disable-bias-linear")
        if {"wq", "wk", "wv"} <= set(spec.linear_biases):
            args.append("--add-qkv-bias")
    if spec.qk_norm:
        args.append("--qk-layernorm")
    if spec.moe:
        m = spec.moe
        pattern = [0 if not spec.is_moe_layer(i) else 1 for i in range(spec.n_layers)]
        args += [f"--num-experts {m.n_experts}", f"--moe-router-topk {m.top_k}",
                 f"--moe-ffn-hidden-size {m.d_ff_expert}", "--moe-grouped-gemm"]
        if m.n_shared_experts:
            args.append(f"--moe-shared-expert-intermediate-size {m.n_shared_experts * m.d_ff_expert}")
        if any(p == 0 for p in pattern):
            args.append("--moe-layer-freq " + str(pattern).replace(" ", ""))
    return args


def _megatron_parallel_args(plan: Plan, spec: ModelSpec) -> list[str]:
    mode, every = parse_ac(plan.ac)
    args = [f"--tensor-model-parallel-size {plan.tp}", f"--pipeline-model-parallel-size {plan.pp}",
            f"--context-parallel-size {plan.cp}", f"--micro-batch-size {plan.micro_batch_size}",
            f"--global-batch-size {plan.global_batch_size}", "--bf16"]
    if plan.tp > 1 and plan.sequence_parallel:
        args.append("--sequence-parallel")
    if plan.async_tp and plan.tp > 1 and plan.sequence_parallel:
        args.append("--tp-comm-overlap")
    layout = _megatron_layout(plan, spec)
    if layout:
        args.append(f"--pipeline-model-parallel-layout '{layout}'")
    elif plan.pp > 1 and plan.pp_schedule == "Interleaved1F1B" and plan.pp_stages_per_rank > 1:
        args.append(f"--num-virtual-stages-per-pipeline-rank {plan.pp_stages_per_rank}")
    if plan.ep > 1:
        args.append(f"--expert-model-parallel-size {plan.ep}")
    if plan.etp > 1 or plan.ep > 1 and plan.tp > 1:
        # Megatron's expert TP defaults to the dense TP (arguments.py: "if args.expert_tensor_parallel_size is
        # None: ... = args.tensor_model_parallel_size"): etp 1 under TP must be said
        args.append(f"--expert-tensor-parallel-size {plan.etp}")
    if mode == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif mode == "layer":
        per_stage = spec.n_layers // (plan.pp * plan.pp_stages_per_rank)
        args += ["--recompute-granularity full", "--recompute-method block",
                 f"--recompute-num-layers {max(1, per_stage // every)}"]
    elif mode == "selective-op":
        args.append("--recompute-granularity selective")
    elif mode == "core-attn":
        args += ["--recompute-granularity selective", "--recompute-modules core_attn"]
    if plan.dp_shard > 1:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params",
                 "--no-gradient-accumulation-fusion", "--ckpt-format fsdp_dtensor"]
        if plan.dp_replicate > 1:
            args.append(f"--num-distributed-optimizer-instances {plan.dp_replicate}")
    elif plan.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if plan.float8:
        recipe = {"tensorwise": "tensorwise", "rowwise": "blockwise", "rowwise_with_gw_hp": "blockwise"}
        args += ["--fp8-format hybrid", f"--fp8-recipe {recipe[plan.float8_recipe]}"]
    te = plan.te_layers or plan.float8 or (plan.async_tp and plan.tp > 1)
    args.append("--transformer-impl " + ("transformer_engine" if te else "local"))
    if plan.fused_loss:
        args.append("--cross-entropy-loss-fusion")
    if plan.reduce_dtype == "float32":
        args.append("--accumulate-allreduce-grads-in-fp32")
    return args


def _megatron_layout(plan: Plan, spec: ModelSpec) -> str:
    """parsim's stage split as Megatron's ``--pipeline-model-parallel-layout`` where the layers do not divide evenly
    over the stages ('' where they do: Megatron's default split is then the same). One ``|``-separated entry per
    (virtual) stage in model order, Megatron placing stage s on pipeline rank s mod pp as torch's schedules do;
    ``E`` the embedding, ``t`` a decoder layer, ``L`` the loss (megatron/core/transformer/
    pipeline_parallel_layer_layout.py). Without it Megatron refuses an uneven split ("Number of layers should be
    divisible by the pipeline-model-parallel size")."""
    from .costmodel.layers import stage_bounds

    stages = plan.pp * plan.pp_stages_per_rank
    if plan.pp == 1 or spec.n_layers % stages == 0:
        return ""
    b = stage_bounds(spec.n_layers, stages)
    parts = [f"t*{b[i + 1] - b[i]}" if b[i + 1] > b[i] else "" for i in range(stages)]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return "|".join(parts)


def _megatron_env(plan: Plan) -> list[str]:
    """Environment lines Megatron's ``validate_args`` asks for: with TP or CP and without FSDP it asserts
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` on Hopper and earlier (one hardware queue keeps the TP/CP communication kernels
    in issue order); with Megatron-FSDP it must not be 1 (megatron/training/arguments.py)."""
    if (plan.tp > 1 or plan.cp > 1) and plan.dp_shard == 1:
        return ["export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron asks it with TP or CP (Hopper and earlier)"]
    return []


def to_megatron_args(plan: Plan, spec: ModelSpec, prediction: str = "") -> str:
    """The plan as Megatron-LM ``pretrain_gpt.py`` arguments (a shell snippet): the model's size flags from its
    spec and the parallel, batch, recompute and precision flags from the plan, over Megatron's defaults.

    Megatron's data parallelism is DDP (optionally with its distributed optimizer): parsim's dp_replicate. FSDP
    (dp_shard > 1) maps to Megatron-FSDP (``--use-megatron-fsdp``, ZeRO-3 ``optim_grads_params``; HSDP's replicas
    as ``--num-distributed-optimizer-instances``), the mapping Megatron's ``validate_args`` accepts with PP and EP;
    what has no Megatron flag is written at the top. Megatron words: micro batch = sequences per forward/backward
    pass, global batch = sequences per optimizer step (gradient accumulation and pipeline microbatches are both
    implied by global / (micro x dp))."""
    gaps = megatron_gaps(plan, spec)
    args = _megatron_model_args(spec, plan) + _megatron_parallel_args(plan, spec) + MEGATRON_TRAINING
    head = _header(plan, spec, plan.world_size, prediction, [], "# ")
    head[-1] = ("# Megatron-LM arguments (pretrain_gpt.py); data and tokenizer flags (--data-path, --tokenizer-type "
                f"...) are yours to add: the model's vocabulary is {spec.vocab_size:,} tokens (Megatron pads the "
                "tokenizer's to a multiple of 128 x tp). The training schedule is Megatron's Llama 3 8B example's "
                "(examples/llama/train_llama3_8b_h100_fp8.sh); set --train-iters to your run's length.")
    nodes = -(-plan.world_size // 8)
    launch = [f"# launch, from a Megatron-LM checkout, on each of {nodes} nodes of 8 GPUs:",
              f"#   torchrun --nproc_per_node 8 --nnodes {nodes} --node_rank $NODE_RANK --master_addr $MASTER_ADDR "
              '--master_port 6000 pretrain_gpt.py "${MEGATRON_ARGS[@]}" --data-path ... --tokenizer-type ...']
    lines = [*head, *(["# What Megatron cannot express of this plan:"] + [f"# - {g}" for g in gaps] if gaps else []),
             *launch, *_megatron_env(plan), "MEGATRON_ARGS=(", *[f"  {a}" for a in args], ")"]
    return "\n".join(lines) + "\n"


# [public benchmark] Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh: AdamW (0.9, 0.95), weight decay 0.1,
# clip 1.0, lr 1.5e-4 cosine to 1e-5; the length (iterations, warmup) is a placeholder the header names
MEGATRON_TRAINING = ["--optimizer adam", "--adam-beta1 0.9", "--adam-beta2 0.95", "--weight-decay 0.1",
                     "--clip-grad 1.0", "--lr 1.5e-4", "--min-lr 1e-5", "--lr-decay-style cosine",
                     "--lr-warmup-iters 100", "--train-iters 1000"]
