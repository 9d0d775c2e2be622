"""`search --framework`: only plans the framework runs as planned are ranked, the emitted file's prediction is the
ranked one, and a pin the framework cannot run is refused in one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app
from parsim.errors import ParsimError
from parsim.frameworks import FRAMEWORKS, restrict_space, runs_otherwise
from parsim.hardware import load_profile
from parsim.search import SearchSpace, search
from parsim.spec import PRESETS

CASES = [("llama3-8b", 64, 256), ("qwen3-30b-a3b", 64, 256), ("tiny-moe", 16, 64), ("deepseek-v3", 256, 1024)]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("model,gpus,gbs", CASES)
def test_every_ranked_plan_runs_as_planned(framework, model, gpus, gbs):
    spec, hw = PRESETS[model], load_profile("h100-sxm-spec-cal")
    sp = restrict_space(SearchSpace(global_batch_size=gbs, seq_len=4096), framework)
    res = search(spec, hw, gpus, sp, top_k=10)
    assert res.top, "the framework's space has plans that fit"
    ranked = [r.plan for r in res.top] + [p for p, *_ in res.pareto]
    # the cuts alone keep most of what is ranked runnable; what is left over the post-filter drops (search_job)
    runnable = [p for p in ranked if not runs_otherwise(p, spec, framework)]
    assert len(runnable) >= len(ranked) // 2, [runs_otherwise(p, spec, framework) for p in ranked][:3]
    from parsim.search_job import _keep_runnable

    _keep_runnable(res, spec, framework, lambda line: None)
    assert res.top and all(not runs_otherwise(r.plan, spec, framework) for r in res.top)
    for p in ranked:
        assert tuple(p.mesh_order) == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        if framework == "torchtitan" and p.float8:
            assert p.float8_recipe == "rowwise"
        if framework == "megatron":
            assert not p.compile and p.ac in ("none", "full", "core-attn") and p.pp_schedule != "GPipe" or p.pp == 1


def test_the_cli_ranks_and_emits_the_same_prediction(tmp_path):
    out = tmp_path / "tt.py"
    r = CliRunner().invoke(app, ["search", "--model", "llama3-8b", "--gpus", "64", "--framework", "torchtitan",
                                 "--emit-torchtitan", str(out), "--json"])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "as emitted" not in text  # the ranked plan is what torchtitan 0.3.0 runs
    assert "cannot express" not in r.stderr


@pytest.mark.parametrize("pin,framework,says", [
    (["--float8-recipe", "tensorwise"], "torchtitan", "torchtitan runs rowwise"),
    (["--compile"], "megatron", "megatron cannot run it"),
    (["--mesh-order", "tp,cp,dp_shard,dp_replicate,pp"], "torchtitan", "has no option for another"),
    (["--ac", "layer:2"], "torchtitan", "cannot run it as planned"),
])
def test_a_pin_the_framework_cannot_run_is_refused(pin, framework, says):
    r = CliRunner().invoke(app, ["search", "--model", "llama3-8b", "--gpus", "8", "--framework", framework, *pin])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output


def test_an_unknown_framework_is_refused():
    with pytest.raises(ParsimError, match="--framework takes torchtitan"):
        restrict_space(SearchSpace(global_batch_size=8, seq_len=128), "jax")
    r = CliRunner().invoke(app, ["predict", "--model", "tiny", "--gpus", "2", "--framework", "jax"])
    assert r.exit_code == 2


def test_predict_says_what_the_framework_would_run_otherwise():
    r = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpus", "8", "--dp-shard", "8", "--float8",
                                 "--framework", "torchtitan"])
    assert r.exit_code == 0 and "torchtitan would run this plan otherwise: float8 tensorwise" in r.output
