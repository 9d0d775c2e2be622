"""What parsim hands over, loaded by each framework's own config machinery (issue: configs the frameworks accept).

A matrix of plans (FSDP, HSDP, TP+SP, PP 1F1B / GPipe / interleaved with uneven layers, CP, EP dp2ep and DDP-style,
ETP, float8 tensorwise / rowwise, async TP, every AC mode, compile) over the presets is emitted in each format and
handed to the framework's own code in a child process (``tests/frameworks/*_check.py``):

* torchtitan 0.3.0 (Python configs): a venv beside this interpreter's torch gets ``torchtitan==0.3.0`` with its own
  dependencies (the data stack included: the emitted config starts from torchtitan's recipe, whose dataloader and
  loss import it), triton and torchao; the check runs ``ConfigManager --module/--config`` and the Trainer's checks
  before the GPU (mesh on a fake process group, model on meta with the float8 converter, loss, batch, PP split).
* torchtitan 0.2.2 (the last TOML release): the same, through ``--job.config_file`` and 0.2.2's Trainer checks.
* Megatron-LM: its training arguments are not in the ``megatron-core`` wheel nor on any package registry; the test
  runs Megatron-LM's ``parse_args`` + ``validate_args`` from a checkout named by ``PARSIM_MEGATRON_LM`` (the
  folder holding ``megatron/``) and skips without one.

The venvs are built once per session (about 30 s each from the package registry); without the registry the tests
skip with the reason.
"""

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from parsim.costmodel.layers import stage_bounds
from parsim.emit import TORCHTITAN_MODELS, to_megatron_args, to_torchtitan_python, to_torchtitan_toml
from parsim.plan import Plan, parse_ac
from parsim.spec import PRESETS, from_hf_config

CHECKS = Path(__file__).resolve().parent / "frameworks"
MATRIX = {
    "fsdp-8b-full-compile": ("llama3-8b", dict(dp_shard=64, ac="full", compile=True)),
    "hsdp-8b-layer2-never": ("llama3-8b", dict(dp_replicate=4, dp_shard=8, ac="layer:2",
                                               fsdp_reshard_after_forward="never")),
    "tp-sp-70b-asynctp-f8tensorwise-sac": ("llama3-70b", dict(dp_shard=16, tp=8, compile=True, async_tp=True,
                                                              float8=True, ac="selective-op")),
    "pp-1f1b-70b": ("llama3-70b", dict(pp=8, dp_shard=4, tp=8, local_batch_size=8, micro_batch_size=1, ac="full")),
    "pp-gpipe-8b": ("llama3-8b", dict(pp=4, dp_shard=2, local_batch_size=4, micro_batch_size=1,
                                      pp_schedule="GPipe")),
    "pp-interleaved-uneven-405b-f8rowwise": ("llama3-405b", dict(
        pp=8, dp_shard=8, tp=8, local_batch_size=16, micro_batch_size=1, pp_schedule="Interleaved1F1B",
        pp_stages_per_rank=2, ac="full", compile=True, float8=True, float8_recipe="rowwise",
        fsdp_reshard_after_forward="always")),
    "pp-interleaved-70b-4ranks": ("llama3-70b", dict(pp=4, dp_shard=8, tp=8, local_batch_size=16,
                                                     micro_batch_size=1, pp_schedule="Interleaved1F1B",
                                                     pp_stages_per_rank=4, ac="selective-op", compile=True)),
    "cp-8b": ("llama3-8b", dict(dp_shard=8, cp=4, seq_len=32768, ac="full")),
    "ep-dp2ep-qwen3": ("qwen3-30b-a3b", dict(dp_shard=16, ep=8, ac="full", compile=True)),
    "ep-ddp-style-qwen3": ("qwen3-30b-a3b", dict(dp_replicate=8, dp_shard=2, ep=4, ep_from="dp_replicate")),
    "etp-qwen3": ("qwen3-30b-a3b", dict(dp_shard=8, tp=2, ep=4, etp=2)),
    # Megatron-Core MoE parallel folding: EP 8 over dp_replicate 4 x tp 2 (more EP ranks than data-parallel ones)
    "ep-folded-qwen3-distopt": ("qwen3-30b-a3b", dict(dp_replicate=4, dp_shard=1, tp=2, ep=8, ep_from="folded",
                                                      distributed_optimizer=True, ac="full")),
    "ep-folded-etp-cp-qwen3": ("qwen3-30b-a3b", dict(dp_replicate=2, dp_shard=1, cp=2, tp=2, ep=4, etp=2,
                                                     ep_from="folded")),
    "ep-pp-interleaved-deepseek": ("deepseek-v3", dict(pp=8, dp_shard=32, ep=32, local_batch_size=8,
                                                       micro_batch_size=1, pp_schedule="Interleaved1F1B",
                                                       pp_stages_per_rank=2, ac="selective-op")),
    "f8-rowwise-gw-hp-8b": ("llama3-8b", dict(dp_shard=8, float8=True, float8_recipe="rowwise_with_gw_hp",
                                              compile=True)),
    # 126 layers over 4 stages: Megatron needs the split spelled out (--pipeline-model-parallel-layout)
    "pp-uneven-1f1b-405b": ("llama3-405b", dict(pp=4, dp_shard=2, tp=8, local_batch_size=8, micro_batch_size=1,
                                                ac="full")),
    # DDP x TP (Megatron asks CUDA_DEVICE_MAX_CONNECTIONS=1) with async TP but no SP (no Megatron TP overlap)
    "ddp-tp-asynctp-nosp-8b": ("llama3-8b", dict(dp_replicate=2, dp_shard=1, tp=4, async_tp=True, compile=True,
                                                 sequence_parallel=False)),
    "ddp-distopt-8b-ga": ("llama3-8b", dict(dp_replicate=8, local_batch_size=2, global_batch_size=64,
                                            distributed_optimizer=True)),
}


def _buildable_ep(plan: Plan, etp: int) -> int:
    """The EP torchtitan's ParallelDims accepts with expert TP ``etp`` (its own _validate), else 1."""
    if etp == 1:
        ok = plan.ep % (plan.cp * plan.tp) == 0 and (plan.dp_shard * plan.cp * plan.tp) % plan.ep == 0
    else:
        ok = plan.ep % plan.cp == 0 and (plan.dp_shard * plan.cp) % plan.ep == 0
    return plan.ep if ok else 1


def _plans() -> dict:
    return {k: (PRESETS[m], Plan(**{"seq_len": 8192, **kw})) for k, (m, kw) in MATRIX.items()}


PLANS = _plans()


def _framework_venv(base: Path, pkgs: list[str]) -> Path:
    """A venv that sees this interpreter's packages (torch among them, pinned) with ``pkgs`` installed on top
    (tests/emit_differential.py makes it); skips where the package registry cannot give them."""
    try:
        return _emit_differential().framework_venv(base, pkgs)
    except RuntimeError as e:
        pytest.skip(str(e))


def _emit_differential():
    import emit_differential  # (tests/emit_differential.py; bench/emit_differential.py is its command line)

    return emit_differential


def _run_checks(py: Path, script: str, files: dict[str, tuple[Path, int]], env=None) -> dict[str, dict]:
    args = [str(a) for path, world in files.values() for a in (path, world)]
    r = subprocess.run([str(py), str(CHECKS / script), *args], capture_output=True, text=True, timeout=900,
                       env=env)
    results = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            results[Path(d.pop("path")).stem] = d
    assert len(results) == len(files), r.stderr[-3000:]
    return results


def _module_name(name: str) -> str:
    return "parsim_plan_" + name.replace("-", "_")


def _checked(results: dict, name: str):
    """(spec, plan, what the framework's check reported) for a matrix plan whose check ran without error."""
    d = results[_module_name(name)]
    assert "error" not in d, d.get("error")
    return (*PLANS[name], d)


def _emit_matrix(out: Path, emit, suffix: str) -> dict[str, tuple[Path, int]]:
    """Every plan of the matrix written by ``emit`` into ``out``: {stem: (file, world size)}."""
    files = {}
    for name, (spec, plan) in PLANS.items():
        path = out / f"{_module_name(name)}{suffix}"
        path.write_text(emit(plan, spec))
        files[path.stem] = (path, plan.world_size)
    return files


@pytest.fixture(scope="session")
def torchtitan_030(tmp_path_factory):
    pytest.importorskip("torch")
    py = _framework_venv(tmp_path_factory.getbasetemp() / "venv-torchtitan-0.3.0",
                         ["torchtitan==0.3.0", "triton", "torchao"])
    out = tmp_path_factory.mktemp("emitted-030")
    files = _emit_matrix(out, to_torchtitan_python, ".py")
    # a model from an HF folder: the dimensions of llama3-8b are its 8B flavour; a 16-layer d=2048 one and a
    # Mistral-7B are built from their dimensions (llama3 modules, flavour "parsim"); a Qwen2 (q/k/v biases) is not
    for (tag, c), plan in zip(HF_030.items(), (Plan(dp_shard=8, seq_len=8192), Plan(dp_shard=8, seq_len=8192),
                                               Plan(dp_shard=4, tp=2, seq_len=4096, float8=True, compile=True,
                                                    float8_recipe="rowwise"), Plan(dp_shard=8, seq_len=4096)),
                              strict=True):
        path = out / f"parsim_plan_{tag}.py"
        path.write_text(to_torchtitan_python(plan, from_hf_config(c, name=tag)))
        files[path.stem] = (path, plan.world_size)
    return _run_checks(py, "torchtitan_030_check.py", files)


_LLAMA_CFG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256}
HF_030 = {"hf_8b": _LLAMA_CFG, "hf_1b": dict(_LLAMA_CFG, hidden_size=2048, num_hidden_layers=16),
          "hf_mistral": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                         "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                         "vocab_size": 32000, "rope_theta": 10000.0, "rms_norm_eps": 1e-05},
          "hf_qwen2": {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824,
                       "num_attention_heads": 40, "num_hidden_layers": 48, "num_key_value_heads": 8,
                       "vocab_size": 152064, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06}}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_torchtitan_030_builds_and_checks_the_emitted_config(name, torchtitan_030):
    spec, plan, d = _checked(torchtitan_030, name)
    tt_ep = _buildable_ep(plan, 1)  # 0.3.0: experts without TP
    assert d["degrees"] == [plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp, plan.cp, tt_ep]
    assert d["training"] == [plan.local_batch_size, plan.global_batch_size, plan.seq_len, plan.param_dtype,
                             plan.reduce_dtype]
    assert d["grad_accum"] == plan.grad_accum_steps
    assert d["compile"] == [plan.compile, plan.async_tp and plan.compile]
    mode, _ = parse_ac(plan.ac)
    assert d["ac"] == {"none": None, "selective-op": "SelectiveAC.Config"}.get(mode, "FullAC.Config")
    assert d["reshard"] == plan.fsdp_reshard_after_forward and d["sequence_parallel"] == plan.sequence_parallel
    module, flavor, _ = TORCHTITAN_MODELS[spec.name]
    assert d["model"] == [module, flavor] and d["n_params"] == spec.n_params  # torchtitan's model, parsim's count
    # a complete Trainer config: torchtitan's recipe supplies the loss and the dataloader
    assert d["loss"] != "BaseLoss.Config" and d["dataloader"] != "BaseDataLoader.Config"
    assert "FlexAttention" in d["attention"]
    if plan.float8:
        assert {"w1", "w2", "w3", "wo"} <= set(d["float8_linears"]) and "lm_head" not in d["float8_linears"]
    else:
        assert d["float8_linears"] == []
    if plan.pp > 1:
        b = stage_bounds(spec.n_layers, plan.pp * plan.pp_stages_per_rank)
        assert d["stage_layers"] == [b[i + 1] - b[i] for i in range(len(b) - 1)]  # parsim's split, as costed
        assert [d["schedule"], d["microbatch"], d["microbatches"]] == [plan.pp_schedule, plan.micro_batch_size,
                                                                       plan.n_microbatches]


@pytest.mark.slow
def test_torchtitan_030_hf_models_map_by_dimensions_build_from_them_or_refuse(torchtitan_030):
    assert torchtitan_030["parsim_plan_hf_8b"]["model"] == ["llama3", "8B"]
    for tag in ("hf_1b", "hf_mistral"):  # outside the registry: torchtitan's llama3 modules at these dimensions
        d = torchtitan_030[f"parsim_plan_{tag}"]
        assert "error" not in d, d.get("error")
        assert d["model"] == ["llama3", "parsim"] and d["n_params"] == from_hf_config(HF_030[tag]).n_params
    assert torchtitan_030["parsim_plan_hf_mistral"]["float8_linears"]  # the converters run on the built model
    err = torchtitan_030["parsim_plan_hf_qwen2"]["error"]
    assert err.startswith("NotImplementedError") and "linear biases keep torchtitan's llama3 modules" in err


@pytest.fixture(scope="session")
def torchtitan_022(tmp_path_factory):
    pytest.importorskip("torch")
    py = _framework_venv(tmp_path_factory.getbasetemp() / "venv-torchtitan-0.2.2",
                         ["torchtitan==0.2.2", "triton", "torchao"])
    files = _emit_matrix(tmp_path_factory.mktemp("emitted-022"), to_torchtitan_toml, ".toml")
    return _run_checks(py, "torchtitan_022_check.py", files)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_torchtitan_022_builds_and_checks_the_emitted_toml(name, torchtitan_022):
    spec, plan, d = _checked(torchtitan_022, name)
    tt_ep = _buildable_ep(plan, plan.etp if plan.etp == plan.tp else 1)
    assert d["degrees"] == [plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp, plan.cp, tt_ep,
                            plan.etp if plan.etp == plan.tp else 1]
    assert d["training"] == [plan.local_batch_size, plan.global_batch_size, plan.seq_len, plan.param_dtype,
                             plan.reduce_dtype]
    assert d["compile"] == [plan.compile, plan.async_tp and plan.compile]
    mode, every = parse_ac(plan.ac)
    assert d["ac"] == {"none": ["none", "1"], "full": ["full", "1"], "selective-op": ["selective", "op"],
                       "layer": ["selective", str(every)]}[mode]
    module, flavor, _ = TORCHTITAN_MODELS[spec.name]
    assert d["model"] == [module, flavor] and d["n_params"] == spec.n_params
    if plan.float8:
        tw = plan.float8_recipe == "tensorwise"
        assert d["float8"] == [None if tw else plan.float8_recipe, tw and plan.dp_shard > 1]
        assert {"w1", "w2", "w3", "wo"} <= set(d["float8_linears"]) and "output" not in d["float8_linears"]
    if plan.pp > 1:
        b = stage_bounds(spec.n_layers, plan.pp * plan.pp_stages_per_rank)
        assert d["stage_layers"] == [b[i + 1] - b[i] for i in range(len(b) - 1)]
        assert [d["schedule"], d["microbatch"]] == [plan.pp_schedule, plan.micro_batch_size]


def test_emitted_toml_is_valid_toml_with_the_stage_split():
    spec, plan = PLANS["pp-interleaved-uneven-405b-f8rowwise"]
    doc = tomllib.loads(to_torchtitan_toml(plan, spec))
    parts = doc["parallelism"]["module_fqns_per_model_part"]
    assert len(parts) == 16 and parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert "pipeline_parallel_layers_per_stage" not in doc["parallelism"]


@pytest.fixture(scope="session")
def megatron(tmp_path_factory):
    root = os.environ.get("PARSIM_MEGATRON_LM")
    if not root or not (Path(root) / "megatron" / "training" / "arguments.py").exists():
        pytest.skip("Megatron-LM's training arguments are not on any package registry: set PARSIM_MEGATRON_LM to "
                    "a Megatron-LM checkout (the folder holding megatron/) to run these")
    pytest.importorskip("torch")
    py = _framework_venv(tmp_path_factory.getbasetemp() / "venv-torchtitan-0.3.0",
                         ["torchtitan==0.3.0", "triton", "torchao"])  # torch, einops, typing_extensions
    files = _emit_matrix(tmp_path_factory.mktemp("emitted-megatron"), to_megatron_args, ".sh")
    env = {**os.environ, "PYTHONPATH": root}
    return _run_checks(py, "megatron_check.py", files, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_megatron_parser_and_validate_args_accept_the_emitted_arguments(name, megatron):
    spec, plan, d = _checked(megatron, name)
    assert [d["tensor_model_parallel_size"], d["pipeline_model_parallel_size"], d["context_parallel_size"],
            d["data_parallel_size"], d["expert_model_parallel_size"]] == [plan.tp, plan.pp, plan.cp, plan.dp,
                                                                          plan.ep]
    assert [d["micro_batch_size"], d["global_batch_size"], d["seq_length"]] == [plan.micro_batch_size,
                                                                               plan.global_batch_size, plan.seq_len]
    vp = plan.pp_stages_per_rank if plan.pp > 1 and plan.pp_schedule == "Interleaved1F1B" else None
    assert d["virtual_pipeline_model_parallel_size"] == vp
    stages = plan.pp * plan.pp_stages_per_rank
    if plan.pp > 1 and spec.n_layers % stages:  # an uneven split: parsim's, as Megatron's layout
        b = stage_bounds(spec.n_layers, stages)
        assert d["layout_stage_layers"] == [b[i + 1] - b[i] for i in range(stages)]
    assert d["sequence_parallel"] == (plan.tp > 1 and plan.sequence_parallel)
    assert d["use_megatron_fsdp"] == (plan.dp_shard > 1) and not d["use_torch_fsdp2"]
    if plan.dp_shard > 1:
        assert d["num_distributed_optimizer_instances"] == plan.dp_replicate
    assert d["use_distributed_optimizer"] == (plan.dp_shard > 1 or plan.distributed_optimizer)
    mode, every = parse_ac(plan.ac)
    granularity = {"none": None, "selective-op": "selective"}.get(mode, "full")
    assert d["recompute_granularity"] == granularity
    if mode == "layer":  # as many recomputed layers per stage as parsim's every-n-th policy
        per_stage = spec.n_layers // (plan.pp * plan.pp_stages_per_rank)
        assert [d["recompute_method"], d["recompute_num_layers"]] == ["block", per_stage // every]
    elif mode == "full":
        assert [d["recompute_method"], d["recompute_num_layers"]] == ["uniform", 1]
    te = plan.float8 or (plan.async_tp and plan.tp > 1)
    assert d["transformer_impl"] == ("transformer_engine" if te else "local")
    assert (d["fp8"] is not None) == plan.float8
    assert d["tp_comm_overlap"] == (plan.async_tp and plan.tp > 1 and plan.sequence_parallel)
    assert [d["num_layers"], d["hidden_size"], d["num_attention_heads"]] == [spec.n_layers, spec.d_model,
                                                                           spec.n_heads]
    if spec.moe:
        assert [d["num_experts"], d["moe_router_topk"], d["moe_ffn_hidden_size"]] == [
            spec.moe.n_experts, spec.moe.top_k, spec.moe.d_ff_expert]
    if plan.ep > 1:  # Megatron's expert TP defaults to the dense TP: the emitted one must be parsim's
        assert d["expert_tensor_parallel_size"] == plan.etp
    # the model as its checkpoint has it: RoPE base, norm epsilon, YaRN for MLA; and a training schedule
    assert [d["rotary_base"], d["layernorm_epsilon"]] == [int(spec.rope_theta), spec.norm_eps]
    scaling = dict(spec.rope_scaling)
    if scaling.get("rope_type") == "yarn":
        assert [d["rope_type"], d["rotary_scaling_factor"], d["mscale"], d["mscale_all_dim"]] == [
            "yarn", scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]]
    assert d["optimizer"] == "adam" and d["lr"] > 0 and d["train_iters"] > 0 and d["lr_decay_style"] == "cosine"


def test_megatron_arguments_name_what_they_cannot_say():
    plan = Plan(pp=8, dp_replicate=2, tp=4, seq_len=8192, local_batch_size=64, micro_batch_size=1,
                global_batch_size=128, pp_schedule="Interleaved1F1B", pp_stages_per_rank=5, float8=True,
                distributed_optimizer=True, async_tp=True, te_layers=True)
    out = to_megatron_args(plan, PRESETS["llama3-70b"])
    for a in ("--tensor-model-parallel-size 4", "--pipeline-model-parallel-size 8", "--micro-batch-size 1",
              "--global-batch-size 128", "--num-virtual-stages-per-pipeline-rank 5", "--use-distributed-optimizer",
              "--sequence-parallel", "--tp-comm-overlap", "--fp8-format hybrid", "--num-layers 80",
              "--transformer-impl transformer_engine"):
        assert f"\n  {a}\n" in out
    assert "cannot express" not in out  # everything of this plan is a Megatron flag
    fsdp = to_megatron_args(Plan(dp_shard=8, seq_len=4096, ac="selective-op", compile=True, float8=True),
                            PRESETS["llama3-8b"])
    assert "--use-megatron-fsdp" in fsdp and "torch.compile: Megatron uses fused kernels" in fsdp
    assert "per-op selective AC" in fsdp and "need Transformer Engine layers" in fsdp


def test_emitted_python_says_what_torchtitan_cannot_express():
    spec = PRESETS["llama3-8b"]
    plan = Plan(dp_replicate=2, dp_shard=4, seq_len=4096, ac="layer:2",
                mesh_order=("pp", "cp", "tp", "dp_shard", "dp_replicate"))
    py = to_torchtitan_python(plan, spec)
    compile(py, "emitted.py", "exec")
    assert "device order dp_shard,dp_replicate" in py and "AC of one layer in 2" in py and "FullAC.Config()" in py
    assert 'RECIPE = ("torchtitan.models.llama3.config_registry", "llama3_8b")' in py
    spec, plan = PLANS["tp-sp-70b-asynctp-f8tensorwise-sac"]
    py = to_torchtitan_python(plan, spec)
    assert "float8 tensorwise: removed in torchtitan 0.3.0" in py and "recipe_name='rowwise'" in py
    assert "filter_fqns=['lm_head']" in py and "attn_backend='flex'" in py


def test_torchtitan_trains_tp_or_pp_without_fsdp_in_float32():
    """torchtitan's maybe_enable_amp: mixed precision through fully_shard (dp_shard > 1 or cp > 1), else autocast,
    except with TP or PP, where it warns and trains in float32: the emitted config says so."""
    from parsim.emit import torchtitan_gaps

    spec = PRESETS["llama3-8b"]
    said = lambda **kw: any("trains in float32" in g for g in torchtitan_gaps(Plan(seq_len=4096, **kw), spec,  # noqa: E731
                                                                               "0.3.0"))
    assert said(tp=8) and said(pp=2, tp=4) and said(dp_replicate=2, tp=4)
    assert not said(dp_shard=2, tp=4) and not said(cp=2, tp=4) and not said(dp_replicate=8)
    assert not said(tp=8, param_dtype="float32")


def _drawn(n: int, seed: int):
    """(model name, plan) pairs of tests/emit_differential.py's draw (plans no test names)."""
    mod = _emit_differential()
    return mod, mod.draw_plans(n, seed)


@pytest.mark.slow  # (0.2.2's draw under -m long for CI's time; its fixed matrix stays in CI)
@pytest.mark.parametrize("version", ["0.3.0", pytest.param("0.2.2", marks=pytest.mark.long)])
def test_drawn_plans_pass_torchtitans_own_checks(version, tmp_path, tmp_path_factory, torchtitan_030,
                                                 torchtitan_022):
    """40 drawn plans (every torchtitan preset, 8-512 GPUs, every schedule, EP source and option) emitted and run
    through torchtitan's own checks: each is accepted with the plan's degrees, or with the substitution (EP 1) or
    the refusal its gap lines announce. The full draw is bench/emit_differential.py (Megatron too)."""
    mod, drawn = _drawn(40, 2026)
    emit, suffix, script, _ = mod.FRAMEWORKS[f"torchtitan-{version}"]
    files, texts = [], []
    for i, (name, plan) in enumerate(drawn):
        path = tmp_path / f"parsim_plan_drawn_{i:03d}{suffix}"
        texts.append(emit(plan, PRESETS[name]))
        path.write_text(texts[-1])
        files.append((path, plan.world_size))
    # the venv the fixtures made (they ran the fixed matrix in it)
    venv_py = tmp_path_factory.getbasetemp() / f"venv-torchtitan-{version}" / "bin" / "python"
    results = mod.run_checks(venv_py, script, files)
    failures = {drawn[i][1].describe(): mod.compare(f"torchtitan-{version}", drawn[i][1], results[p.stem], texts[i])
                for i, (p, _) in enumerate(files)}
    assert {k: v for k, v in failures.items() if v} == {}
