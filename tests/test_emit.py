"""Emitted torchtitan configs, checked against torchtitan's own config classes.

torchtitan 0.3.0 (Python configs): installed with ``pip install --no-deps`` plus what its config classes import
(tyro, spmd_types, docstring-parser, typeguard); the emitted module's parallelism, training, compile and AC
functions build torchtitan's own objects in a subprocess. The model spec (float8 converter: triton, torchao, an
SM89 GPU) and ``Trainer.Config`` (the data stack: datasets, tokenizers, tensorboard, ~1 GB) are not built here.

torchtitan 0.2.2 (the last TOML schema): its ``config/job_config.py`` (dataclasses only; the package's
``__init__`` pulls tokenizers and triton) is loaded from the wheel with a stand-in for torchtitan's logger, and the
emitted TOML is turned into its ``JobConfig`` section by section: an unknown key or section fails.
"""

import dataclasses
import json
import subprocess
import sys
import tomllib
import types
import typing
import zipfile

import pytest

from parsim.emit import to_torchtitan_python, to_torchtitan_toml
from parsim.plan import Plan
from parsim.spec import PRESETS

PLANS = {
    "70b-fsdp-cp-float8": (PRESETS["llama3-70b"], Plan(dp_shard=128, cp=2, seq_len=8192, global_batch_size=512,
                                                       ac="selective-op", compile=True, float8=True)),
    "405b-pp-interleaved": (PRESETS["llama3-405b"], Plan(pp=8, dp_shard=8, tp=8, seq_len=8192, local_batch_size=16,
                                                         micro_batch_size=1, pp_schedule="Interleaved1F1B",
                                                         pp_stages_per_rank=2, ac="full", compile=True,
                                                         async_tp=True, fsdp_reshard_after_forward="always")),
    "8b-hsdp-layer-ac-order": (PRESETS["llama3-8b"], Plan(dp_replicate=2, dp_shard=4, seq_len=4096, ac="layer:2",
                                                          mesh_order=("pp", "cp", "tp", "dp_shard", "dp_replicate"))),
}


def _pip(target, *pkgs):
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *pkgs],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot install {pkgs} from the package registry: {r.stderr.strip()[-300:]}")


def test_emitted_python_says_what_torchtitan_cannot_express():
    spec, plan = PLANS["8b-hsdp-layer-ac-order"]
    py = to_torchtitan_python(plan, spec)
    compile(py, "emitted.py", "exec")
    assert "device order dp_shard,dp_replicate" in py and "AC of one layer in 2" in py
    assert "FullAC.Config()" in py
    spec, plan = PLANS["70b-fsdp-cp-float8"]
    py = to_torchtitan_python(plan, spec)
    assert "float8 tensorwise: removed in torchtitan 0.3.0" in py and "recipe_name='rowwise'" in py
    assert "model_registry('70B'" in py


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_torchtitan_030_builds_its_config_objects_from_the_emitted_module(name, tmp_path_factory):
    target = tmp_path_factory.getbasetemp() / "torchtitan-0.3.0"
    if not (target / "torchtitan").is_dir():
        _pip(target, "torchtitan==0.3.0", "tyro", "spmd_types==0.2.3", "docstring-parser", "typeguard")
    spec, plan = PLANS[name]
    mod = tmp_path_factory.mktemp("emitted") / f"plan_{name.replace('-', '_')}.py"
    mod.write_text(to_torchtitan_python(plan, spec))
    code = f"""
import importlib.util, json, sys
s = importlib.util.spec_from_file_location("emitted", {str(mod)!r}); m = importlib.util.module_from_spec(s)
s.loader.exec_module(m)
p, t, c, a = m.parsim_parallelism(), m.parsim_training(), m.parsim_compile(), m.parsim_activation_checkpoint()
import torchtitan.config as tc
assert isinstance(p, tc.ParallelismConfig) and isinstance(t, tc.TrainingConfig) and isinstance(c, tc.CompileConfig)
print(json.dumps({{"p": vars(p) if hasattr(p, "__dict__") else {{}}, "ac": None if a is None else type(a).__qualname__,
                  "t": [t.local_batch_size, t.global_batch_size, t.seq_len], "c": [c.enable,
                  c.enable_async_tensor_parallel],
                  "deg": [p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree,
                          p.pipeline_parallel_degree, p.context_parallel_degree, p.expert_parallel_degree],
                  "pp": [p.pipeline_parallel_schedule, p.pipeline_parallel_microbatch_size,
                         p.pipeline_parallel_layers_per_stage, p.fsdp_reshard_after_forward]}}))
"""
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["deg"] == [plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp, plan.cp, plan.ep]
    assert d["t"] == [plan.local_batch_size, plan.global_batch_size, plan.seq_len]
    assert d["c"] == [plan.compile, plan.async_tp and plan.compile]
    stages = plan.pp * plan.pp_stages_per_rank
    layers = spec.n_layers // stages if plan.pp_stages_per_rank > 1 and spec.n_layers % stages == 0 else None
    assert d["pp"] == [plan.pp_schedule, plan.micro_batch_size, layers, plan.fsdp_reshard_after_forward]
    expected_ac = {"none": None, "full": "FullAC.Config", "selective-op": "SelectiveAC.Config"}.get(plan.ac,
                                                                                                  "FullAC.Config")
    assert d["ac"] == expected_ac


def _job_config_module(wheel_dir):
    """torchtitan 0.2.2's config/job_config.py, loaded alone (its logger replaced by the stdlib's)."""
    import logging

    wheel = next(wheel_dir.glob("torchtitan-0.2.2-*.whl"))
    src = zipfile.ZipFile(wheel).read("torchtitan/config/job_config.py").decode()
    stub = types.ModuleType("torchtitan.tools.logging")
    stub.logger = logging.getLogger("torchtitan")  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("torchtitan", "torchtitan.tools", "torchtitan.tools.logging")}
    sys.modules.update({"torchtitan": types.ModuleType("torchtitan"), "torchtitan.tools": types.ModuleType("t"),
                        "torchtitan.tools.logging": stub})
    try:
        mod = types.ModuleType("torchtitan_022_job_config")
        exec(compile(src, "job_config.py", "exec"), mod.__dict__)  # noqa: S102 - torchtitan's own source
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


def _build(cls, values: dict, where: str):
    """A dataclass from a TOML table, nested tables included; unknown keys fail with their name."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    assert not unknown, f"[{where}] keys torchtitan 0.2.2 does not have: {unknown}"
    kw = {k: _build(hints[k], v, f"{where}.{k}") if isinstance(v, dict) else v for k, v in values.items()}
    return cls(**kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_torchtitan_022_job_config_accepts_the_emitted_toml(name, tmp_path_factory):
    wheels = tmp_path_factory.getbasetemp() / "wheels-0.2.2"
    if not any(wheels.glob("torchtitan-0.2.2-*.whl")):
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                            "torchtitan==0.2.2"], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot download torchtitan 0.2.2: {r.stderr.strip()[-300:]}")
    jc = _job_config_module(wheels)
    spec, plan = PLANS[name]
    doc = tomllib.loads(to_torchtitan_toml(plan, spec))
    cfg = _build(jc.JobConfig, doc, "")
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", {"llama3-70b": "70B", "llama3-405b": "405B",
                                                             "llama3-8b": "8B"}[spec.name])
    p = cfg.parallelism
    assert [p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree,
            p.pipeline_parallel_degree, p.context_parallel_degree] == [plan.dp_replicate, plan.dp_shard, plan.tp,
                                                                       plan.pp, plan.cp]
    assert p.enable_async_tensor_parallel == (plan.async_tp and plan.compile)
    assert cfg.training.global_batch_size == plan.global_batch_size and cfg.compile.enable == plan.compile
    if plan.float8:
        assert cfg.model.converters == ["quantize.linear.float8"]
        assert cfg.quantize.linear.float8.recipe_name == plan.float8_recipe
    stages = plan.pp * plan.pp_stages_per_rank
    if plan.pp_stages_per_rank > 1 and spec.n_layers % stages == 0:
        assert p.pipeline_parallel_layers_per_stage == spec.n_layers // stages


def test_megatron_arguments_of_a_megatron_style_plan_and_what_they_cannot_say():
    from parsim.emit import to_megatron_args

    plan = Plan(pp=8, dp_replicate=2, tp=4, seq_len=8192, local_batch_size=64, micro_batch_size=1,
                global_batch_size=128, pp_schedule="Interleaved1F1B", pp_stages_per_rank=5, float8=True,
                distributed_optimizer=True, async_tp=True)
    out = to_megatron_args(plan, PRESETS["llama3-70b"])
    for a in ("--tensor-model-parallel-size 4", "--pipeline-model-parallel-size 8", "--micro-batch-size 1",
              "--global-batch-size 128", "--num-virtual-stages-per-pipeline-rank 5", "--use-distributed-optimizer",
              "--sequence-parallel", "--tp-comm-overlap", "--fp8-format hybrid"):
        assert f"\n  {a}\n" in out
    assert "cannot express" not in out  # everything of this plan is a Megatron flag
    fsdp = to_megatron_args(Plan(dp_shard=8, seq_len=4096, ac="selective-op", compile=True), PRESETS["llama3-8b"])
    assert "--use-torch-fsdp2" in fsdp and "torch.compile: Megatron uses fused kernels" in fsdp
    assert "per-op selective AC" in fsdp
