import json

import numpy as np
import pytest
from typer.testing import CliRunner

from parsim.cli.main import app
from parsim.costmodel import predict
from parsim.emit import to_torchtitan_toml
from parsim.errors import ParsimError
from parsim.hardware import load_profile
from parsim.search import SearchSpace, search
from parsim.spec import PRESETS

H100 = load_profile("h100-sxm-spec")
L8 = PRESETS["llama3-8b"]
runner = CliRunner()


def _small(**kw):
    kw.setdefault("global_batch_size", 32)
    kw.setdefault("seq_len", 4096)
    return SearchSpace(**kw)


def test_best_plan_fits_and_matches_predict():
    res = search(L8, H100, 16, _small())
    assert res.considered > 0 and res.fitting >= res.evaluated > 0
    # every plan of the space is accounted for once: dominated, not fitting, losing on its time bound, evaluated
    assert res.pruned_memory + res.pruned_bound + res.evaluated + res.pruned_dominated == res.considered
    for plan, step, mem, *_ in res.top:
        assert mem <= res.usable_memory_bytes
        pred = predict(L8, plan, H100)  # the scalar path agrees with the vectorized search
        assert pred.fits and pred.step_time_s == pytest.approx(step)
        assert pred.reserved_memory_bytes == pytest.approx(mem)  # search keeps what must fit: reserved memory
    steps = [t[1] for t in res.top]
    assert steps == sorted(steps)


def test_pins_are_honoured():
    res = search(L8, H100, 16, _small(tp=(2,), pp=(1,), ac=("full",), compile=(False,)))
    assert res.top
    for plan, *_ in res.top:
        assert plan.tp == 2 and plan.pp == 1 and plan.ac == "full" and not plan.compile
    res = search(L8, H100, 16, _small(max_tp=2, cp=(1,)))
    assert all(p.tp <= 2 and p.cp == 1 for p, *_ in res.top)


def test_deterministic():
    a = search(L8, H100, 16, _small())
    b = search(L8, H100, 16, _small())
    assert [(p.plan_id, t) for p, t, *_ in a.top] == [(p.plan_id, t) for p, t, *_ in b.top]
    assert [p.plan_id for p, *_ in a.pareto] == [p.plan_id for p, *_ in b.pareto]


def test_pareto_front_is_monotone():
    res = search(L8, H100, 16, _small())
    times = [t for _, t, _ in res.pareto]
    mems = [m for _, _, m in res.pareto]
    assert times == sorted(times) and mems == sorted(mems, reverse=True)
    assert res.pareto[0][1] == pytest.approx(res.top[0][1])


def test_nothing_fits_explains_shortfall():
    res = search(PRESETS["llama3-405b"], H100, 8, SearchSpace(global_batch_size=8, seq_len=8192))
    assert not res.top and res.closest is not None
    plan, mem = res.closest
    assert mem > res.usable_memory_bytes
    r = runner.invoke(app, ["search", "--model", "llama3-405b", "--gpus", "8", "--global-batch-size", "8",
                            "--seq-len", "8192"])
    assert r.exit_code == 0 and "nothing fits" in r.stdout and "GiB more than" in r.stdout


def test_moe_search_uses_expert_parallel():
    res = search(PRESETS["mixtral-8x7b"], H100, 16, SearchSpace(global_batch_size=16, seq_len=4096,
                                                                ac=("full",), compile=(False,)))
    assert res.top
    assert any(p.ep > 1 for p, *_ in res.pareto + [(t[0],) for t in res.top])


def test_cli_search_json_and_emitted_files(tmp_path):
    plan_f, tt_f = tmp_path / "plan.json", tmp_path / "job.py"
    r = runner.invoke(app, ["search", "--model", "llama3-8b", "--gpus", "16", "--global-batch-size", "32",
                            "--seq-len", "4096", "--top", "3", "--json", "--emit-plan", str(plan_f),
                            "--emit-torchtitan", str(tt_f), "--explain", "1"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert len(d["top"]) == 3 and d["evaluated"] > 0 and d["pareto"] and d["explain"]["versus"]
    factors = {f["name"]: f for f in d["explain"]["factors"]}  # what plan #1's prediction applied, as predict's
    assert "compute_scale" in factors and any(k.startswith("collective time scale") for k in factors)
    emitted = json.loads(plan_f.read_text())
    plan = emitted["plan"]
    assert emitted["model"] == "llama3-8b" and emitted["plan_id"] == d["top"][0]["plan_id"]
    assert plan["dp_shard"] * plan["tp"] * plan["pp"] * plan["cp"] * plan["dp_replicate"] == 16
    py = tt_f.read_text()
    compile(py, str(tt_f), "exec")  # a Python module
    assert "data_parallel_shard_degree=" in py and "def parsim_plan():" in py and "parsim predicted: step" in py
    r2 = runner.invoke(app, ["predict", "--plan", str(plan_f), "--json"])
    assert r2.exit_code == 0 and json.loads(r2.stdout)["plan_id"] == d["top"][0]["plan_id"]


def test_cli_csv_has_every_evaluated_plan(tmp_path):
    out = tmp_path / "all.csv"
    r = runner.invoke(app, ["search", "--model", "tiny", "--gpus", "4", "--global-batch-size", "8", "--seq-len",
                            "1024", "--csv", str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    lines = out.read_text().strip().splitlines()
    assert len(lines) - 1 == d["evaluated"]


def test_cli_parquet_holds_the_same_table_as_the_csv(tmp_path):
    import pandas as pd

    pytest.importorskip("pyarrow")
    args = ["search", "--model", "tiny-moe", "--gpus", "4", "--global-batch-size", "8", "--seq-len", "256"]
    assert runner.invoke(app, [*args, "--csv", str(tmp_path / "all.csv")]).exit_code == 0
    r = runner.invoke(app, [*args, "--csv", str(tmp_path / "all.parquet"), "--json"])
    assert r.exit_code == 0, r.output
    a, b = pd.read_csv(tmp_path / "all.csv"), pd.read_parquet(tmp_path / "all.parquet")
    assert len(b) == json.loads(r.stdout)["evaluated"] == len(a) and list(a.columns) == list(b.columns)
    assert b["fits"].dtype == bool and b["mesh_order"].iloc[0].count(",") == 4  # names as users write them
    pd.testing.assert_frame_equal(a.drop(columns="fits"), b.drop(columns="fits"), check_dtype=False)
    assert (a["fits"] == b["fits"].astype(int)).all()
    assert not list(tmp_path.glob(".all.parquet.*"))  # no temporary file left


def test_torchtitan_toml_keys():
    from parsim.plan import Plan

    toml = to_torchtitan_toml(Plan(pp=2, dp_shard=4, tp=2, local_batch_size=4, micro_batch_size=1,
                                   ac="layer:2", compile=True, seq_len=4096), L8)
    for key in ("local_batch_size = 4", "pipeline_parallel_degree = 2", "tensor_parallel_degree = 2",
                'mode = "selective"', 'selective_ac_option = "2"', "enable = true"):
        assert key in toml


@pytest.mark.slow
def test_cli_search_execute_runs_the_top_plan(tmp_path):
    pytest.importorskip("torch")
    from conftest import as_measured_here

    out = tmp_path / "exec.json"
    # as if measured here by the current profiler: --execute would profile this machine first
    prof = as_measured_here(json.loads(open("profiles/cpu-gloo-2.json").read()))
    (tmp_path / "here.json").write_text(json.dumps(prof))
    r = runner.invoke(app, ["search", "--model", "tiny", "--gpus", "2", "--global-batch-size", "4", "--seq-len", "128",
                            "--profile", str(tmp_path / "here.json"), "--top", "2", "--execute", "1", "--execute-out",
                            str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    (e,) = d["executed"]
    assert e["prediction"]["plan_id"] == d["top"][0]["plan_id"] == e["measurement"]["plan_id"]
    assert e["plan"].split()[0] in ("dpr2", "fsdp2", "pp2", "tp2", "cp2")  # degrees, not the plan id
    assert e["measurement"]["status"] == "ok" and e["measurement"]["median_step_time_s"] > 0
    assert json.loads(out.read_text())[0]["measurement"]["status"] == "ok"


def _cli_search(*args):
    r = runner.invoke(app, ["search", *args, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    return [row["plan"] for row in d["top"] + d["pareto"]], d


def test_every_search_flag_pins_its_dimension():
    """Flags search used to ignore: each one restricts the space (and the pinned plans predict the same)."""
    plans, _ = _cli_search("--model", "tiny", "--gpus", "8", "--mesh-order", "tp,dp_shard", "--pp-schedule", "GPipe")
    assert all(p["mesh_order"] == ["pp", "dp_replicate", "cp", "tp", "dp_shard"] for p in plans)
    assert all(p["pp"] == p["cp"] == p["dp_replicate"] == 1 and p["pp_schedule"] == "GPipe" for p in plans)
    plans, _ = _cli_search("--model", "tiny", "--gpus", "8", "--tp", "2", "--no-sequence-parallel", "--ac", "full",
                           "--compile", "--order", "pp,tp,compile,ac,fsdp", "--fsdp-reshard-after-forward", "never")
    assert all(p["tp"] == 2 and p["sequence_parallel"] is False and p["ac"] == "full" and p["compile"] for p in plans)
    assert all(p["wrapper_order"] == ["pp", "tp", "compile", "ac", "fsdp"] for p in plans)
    assert all(p["fsdp_reshard_after_forward"] == "never" for p in plans)
    plans, _ = _cli_search("--model", "tiny-moe", "--gpus", "8", "--tp", "2", "--ep", "2", "--etp", "2")
    assert plans and all(p["ep"] == 2 and p["etp"] == 2 for p in plans)
    plans, _ = _cli_search("--model", "tiny", "--gpus", "8", "--pp", "2", "--pp-stages-per-rank", "2",
                           "--local-batch-size", "4", "--no-float8", "--profile", "h100-sxm-spec")
    assert all(p["pp_schedule"] == "Interleaved1F1B" and p["pp_stages_per_rank"] == 2 and not p["float8"]
               for p in plans)
    from parsim.plan import Plan

    for p in plans[:3]:  # the search's number is predict's number for the same plan
        plan = Plan.from_dict(p)
        assert predict(PRESETS["tiny"], plan, H100).step_time_s > 0


def test_search_gpus_default_to_the_product_of_the_degrees():
    plans, d = _cli_search("--model", "tiny", "--tp", "2", "--pp", "2", "--dp-shard", "4", "--top", "1")
    assert d["n_gpus"] == 16 and plans[0]["tp"] == 2 and plans[0]["pp"] == 2 and plans[0]["dp_shard"] == 4


def test_contradictory_pins_and_huge_spaces_are_refused():
    for args, fragment in ((["--gpus", "8", "--tp", "3"], "no plan of tiny on 8 GPUs satisfies the pins"),
                           (["--gpus", "8", "--ac", "full", "--ac-modes", "none"], "not both"),
                           (["--gpus", "8", "--no-pp", "--pp", "2"], "--no-pp contradicts"),
                           (["--gpus", "8", "--order", "pp,fsdp,tp,ac,compile"], "cannot run"),
                           (["--gpus", "8", "--max-plans", "100"], "more than --max-plans 100"),
                           (["--tp", "2"], "give --gpus")):
        r = runner.invoke(app, ["search", "--model", "tiny", *args])
        assert r.exit_code == 2 and fragment in r.stderr, (args, r.output)


@pytest.mark.parametrize("model,gpus,gbs,seq", [("tiny", 8, 12, 36), ("tiny-moe", 12, 8, 36)])
def test_search_prunes_exactly_the_plans_plan_refuses_for_the_same_reason(model, gpus, gbs, seq):
    """Every (degrees, batch split) of a small space, before pruning: the rule search prunes a row for is the rule
    ``Plan`` refuses it for (RuleError.rule), and a row search keeps is a Plan that validates."""
    from collections import Counter

    from parsim.codec import RuleError, invalid_reasons, plan_kwargs, validate_plan
    from parsim.plan import Plan
    from parsim.search import candidates

    spec = PRESETS[model]
    sp = SearchSpace(global_batch_size=gbs, seq_len=seq, stages_per_rank=(1, 2, 3), max_local_batch_size=8)
    _, _, b = candidates(spec, gpus, sp)
    reasons = invalid_reasons(b, spec)
    seen: Counter = Counter()
    for i in range(len(b)):
        try:
            validate_plan(Plan(**plan_kwargs(b, i)), spec, gpus)
            got = ""
        except RuleError as e:
            got = e.rule
        assert got == reasons[i], (plan_kwargs(b, i), got, reasons[i])
        seen[got] += 1
    # the space exercises most rules, and keeps some plans
    assert seen[""] > 0 and len(seen) >= (8 if spec.moe else 7), seen
    res = search(spec, load_profile("cpu-gloo-4"), gpus, sp)
    assert res.pruned_structural == {k: n for k, n in seen.items() if k}


def test_codec_round_trips_plans():
    """encode -> decode gives back the same plan (same plan_id) for plans that use every field."""
    from parsim.codec import decode, encode
    from parsim.plan import Plan

    plans = [Plan(), Plan(pp=2, dp_shard=2, tp=2, local_batch_size=4, micro_batch_size=1, global_batch_size=16,
                      pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, ac="layer:2", compile=True,
                      fsdp_reshard_after_forward="always", param_dtype="float32", wrapper_order=("pp", "tp", "compile",
                                                                                                 "ac", "fsdp"),
                      mesh_order=("tp", "cp", "dp_shard", "dp_replicate", "pp")),
             Plan(dp_replicate=4, dp_shard=2, ep=4, ep_from="dp_replicate", sequence_parallel=False, ac="selective-op",
                  fsdp_reshard_after_forward="never", float8=True, reduce_dtype="bfloat16"),
             Plan(dp_shard=4, tp=2, ep=4, etp=2, ac="full", seq_len=512)]
    b = encode(plans, 8)
    assert [decode(b, i).plan_id for i in range(len(plans))] == [p.plan_id for p in plans]
    res = search(PRESETS["tiny-moe"], load_profile("cpu-gloo-4"), 8, SearchSpace(global_batch_size=8, seq_len=256))
    for plan, *_ in res.top:  # decoded from the search's own columns
        assert decode(encode([plan], 4), 0) == plan


def test_ddp_style_expert_parallel_is_searched():
    """EP borrowed from dp_replicate (Megatron's DDP + EP) is part of the MoE space, and can be pinned away."""
    spec = PRESETS["tiny-moe"]
    hw = load_profile("cpu-gloo-4")
    res = search(spec, hw, 8, SearchSpace(global_batch_size=8, seq_len=256, dp_replicate=(4,), ep=(4,),
                                         ep_from=("dp_replicate",)))
    assert res.top and all(p.ep_from == "dp_replicate" and p.ep == 4 for p, *_ in res.top)
    only_tt = search(spec, hw, 8, SearchSpace(global_batch_size=8, seq_len=256, ep_from=("dp_shard",)))
    both = search(spec, hw, 8, SearchSpace(global_batch_size=8, seq_len=256))
    assert both.considered > only_tt.considered


@pytest.mark.parametrize("model,gpus,kw,profile", [
    ("llama3-8b", 16, dict(global_batch_size=64, seq_len=4096), "h100-sxm-spec-cal"),
    pytest.param("llama3-70b", 32, dict(global_batch_size=64, seq_len=8192), "h100-sxm-spec-cal",
                 marks=pytest.mark.long),  # 27 s since interleaved memory is replayed (llama3-8b keeps PP in CI)
    ("tiny-moe", 8, dict(global_batch_size=16, seq_len=512), "h100-sxm-spec-cal"),
    ("llama3-70b", 8, dict(global_batch_size=8, seq_len=8192), "h100-sxm-spec-cal"),  # nothing fits
    pytest.param("mixtral-8x7b", 32, dict(global_batch_size=64, seq_len=4096), "a100-sxm-80gb-spec",
                 marks=pytest.mark.long),  # an MoE space of its own size: 1 min (tiny-moe covers MoE in CI)
    # measured collective fits (no monotone topology): the bound must hold all the same
    ("tiny-moe", 8, dict(global_batch_size=16, seq_len=256), "cpu-gloo-4"),
    ("tiny", 4, dict(global_batch_size=8, seq_len=256), "cpu-gloo-4-cal"),
    # gradients reduced once per step: unsharded accumulators at the step's start, fewer reduces
    ("tiny-moe", 8, dict(global_batch_size=32, seq_len=512, pins=(("grad_sync", "once"),)), "h100-sxm-spec-cal"),
])
def test_pruned_search_returns_the_exhaustive_best_plan_and_pareto_front(model, gpus, kw, profile):
    import dataclasses

    spec, hw = PRESETS[model], load_profile(profile)
    sp = SearchSpace(**kw)
    full = search(spec, hw, gpus, dataclasses.replace(sp, prune=False), top_k=5)
    fast = search(spec, hw, gpus, sp, top_k=5)
    assert full.considered == fast.considered and fast.evaluated + fast.screened < full.evaluated
    # the best plan and the Pareto front are the exhaustive ones; lower ranks may differ by dominated twins (a plan
    # without compile ranked just below its compiled twin is no longer listed)
    assert [(p.plan_id, t, m) for p, t, m, *_ in fast.top[:1]] == [(p.plan_id, t, m) for p, t, m, *_ in full.top[:1]]
    assert [(p.plan_id, t, m) for p, t, m in fast.pareto] == [(p.plan_id, t, m) for p, t, m in full.pareto]
    if not full.top:  # nothing fits: the closest plan needs the same memory (ties may be another plan)
        assert fast.closest is not None and full.closest is not None
        assert fast.closest[1] == pytest.approx(full.closest[1])
    # the counts account for every plan of the space; what the pruned search knows to fit, the exhaustive one does
    assert fast.evaluated + fast.pruned_bound + fast.pruned_memory + fast.pruned_dominated == fast.considered
    assert fast.evaluated <= fast.fitting <= full.fitting
    assert fast.pruned_memory <= full.considered - full.fitting


@pytest.mark.parametrize("model,gpus,kw,profile", [
    ("mixtral-8x7b", 64, dict(global_batch_size=128, seq_len=4096, pp=(1, 4)), "h100-sxm-spec-cal"),
    ("llama3-8b", 32, dict(global_batch_size=64, seq_len=8192), "h100-sxm-spec-cal"),
    ("tiny-moe", 8, dict(global_batch_size=16, seq_len=256), "cpu-gloo-4"),
])
def test_what_the_pruned_search_relies_on(model, gpus, kw, profile):
    """The facts ``_search_bounded`` uses, on every plan of sampled (row, option) pairs in every device order:
    peak memory depends on neither the device order nor the options outside the memory class (AC, AC period,
    reshard); the step-time bound depends on neither the device order nor reshard, and never exceeds the step; the
    memory bound never exceeds the reserved memory."""
    from parsim.costmodel import evaluate
    from parsim.costmodel.step import memory_lower_bound
    from parsim.search import _base_rows, _batch_at, _memory_classes, _options, _time_classes

    spec, hw = PRESETS[model], load_profile(profile)
    sp = SearchSpace(**kw)
    base = _base_rows(spec, gpus, sp, hw.gpus_per_node, {})
    opts, base["orders"] = _options(sp, hw)
    no = len(opts)
    rng = np.random.default_rng(0)
    rows = rng.choice(len(base["row_start"]), size=min(300, len(base["row_start"])), replace=False)
    gid = np.concatenate([(base["row_start"][r] + np.arange(base["row_count"][r]))[:, None] * no + np.arange(no)
                          for r in rows]).ravel()
    b = _batch_at(base, opts, gid, sp, hw.gpus_per_node)
    full = evaluate(spec, b, hw)
    fast = evaluate(spec, _batch_at(base, opts, gid, sp, None), hw, time_bound=True)
    mem_only = evaluate(spec, _batch_at(base, opts, gid, sp, None), hw, memory_only=True)
    for k in ("peak_memory_bytes", "reserved_memory_bytes"):
        assert np.array_equal(mem_only[k], full[k])
    # the memory bound the search decides on before any replay is one, and not a trivial one
    mem_lb = memory_lower_bound(spec, _batch_at(base, opts, gid, sp, None), hw)
    assert np.all(mem_lb <= full["reserved_memory_bytes"]) and np.median(mem_lb / full["reserved_memory_bytes"]) > 0.5
    lb = fast["step_time_lower_bound_s"]
    assert np.all(lb <= full["step_time_s"] * (1 + 1e-9)) and np.all(lb > 0)
    assert (lb < full["step_time_s"] * 0.999).any()  # not the step itself: collectives are left out
    row = np.searchsorted(base["row_start"], gid // no, side="right") - 1
    mcls, _ = _memory_classes(opts)
    tcls, _ = _time_classes(opts)
    for key, values in ((row * 100 + mcls[gid % no], full["peak_memory_bytes"]),
                        (row * 100 + mcls[gid % no], full["reserved_memory_bytes"]), (row * 100 + tcls[gid % no], lb)):
        _, inv = np.unique(key, return_inverse=True)
        lo, hi = np.full(inv.max() + 1, np.inf), np.full(inv.max() + 1, -np.inf)
        np.minimum.at(lo, inv, values)
        np.maximum.at(hi, inv, values)
        assert np.allclose(lo, hi, rtol=1e-12, atol=0)


def test_max_seconds_bounds_the_checking_of_a_huge_space(monkeypatch):
    """The rows are built and checked a piece at a time; past --max-seconds the search is refused in one line (a
    2^20-GPU space took 28 s here before --max-seconds 3 could act)."""
    import parsim.search as S

    monkeypatch.setattr(S, "RULE_CHUNK", 1000)
    spec, hw = PRESETS["llama3-70b"], load_profile("h100-sxm-spec-cal")
    with pytest.raises(Exception, match="max-seconds .* while checking the space's degree and batch-split rows "
                                        r"\([\d,]+ checked\)"):
        search(spec, hw, 256, SearchSpace(global_batch_size=512, seq_len=8192, max_seconds=1e-6))
    small = search(spec, hw, 256, SearchSpace(global_batch_size=512, seq_len=8192))  # pieces: the same rows
    monkeypatch.setattr(S, "RULE_CHUNK", 1 << 20)
    whole = search(spec, hw, 256, SearchSpace(global_batch_size=512, seq_len=8192))
    assert small.considered == whole.considered and small.pruned_structural == whole.pruned_structural
    assert [r.plan.plan_id for r in small.top] == [r.plan.plan_id for r in whole.top]


def test_max_seconds_stops_and_says_so():
    spec, hw = PRESETS["llama3-70b"], load_profile("h100-sxm-spec-cal")
    # out of time before any plan that fits was found: one line that says so, not an empty result
    with pytest.raises(Exception, match="max-seconds .* before any plan that fits was found"):
        search(spec, hw, 256, SearchSpace(global_batch_size=512, seq_len=8192, max_seconds=1e-6))
    # out of time later (how much later depends on the machine): the best of the part searched and how much that
    # was, or the same one line
    try:
        res = search(spec, hw, 256, SearchSpace(global_batch_size=512, seq_len=8192, max_seconds=0.8))
    except ParsimError as e:
        assert "before any plan that fits was found" in str(e)
    else:
        assert res.top and (res.stopped_at is None or 0.0 <= res.stopped_at < 1.0)
    whole = search(PRESETS["tiny"], hw, 8, SearchSpace(global_batch_size=16, seq_len=512, max_seconds=600.0))
    assert whole.stopped_at is None and whole.top
    with pytest.raises(Exception, match="max-seconds"):
        SearchSpace(global_batch_size=8, seq_len=512, max_seconds=0.0)


def test_search_reports_progress_to_the_end():
    spec, hw = PRESETS["mixtral-8x7b"], load_profile("h100-sxm-spec-cal")
    for prune in (True, False):
        seen: list = []
        # (no interleaved schedules: their memory replay would make this check of the progress calls 2x slower)
        search(spec, hw, 16, SearchSpace(global_batch_size=32, seq_len=4096, prune=prune,
                                         pp_schedules=("GPipe", "1F1B")),
               progress=lambda done, total, seen=seen: seen.append(done / total))
        assert seen and seen == sorted(seen) and seen[-1] == 1.0, prune


def _space_structure(spec, hw, gpus, sp):
    """(row x memory-class pairs of the space, the distinct (pp, stages per rank) of its rows)."""
    from parsim.search import _base_rows, _memory_classes, _options, _undominated

    base = _base_rows(spec, gpus, sp, hw.gpus_per_node, {})
    opts, _ = _options(sp, hw)
    _, rep = _memory_classes(_undominated(opts)[0])
    pp = base["combos"][base["combo"], 0]
    return len(base["row_start"]) * len(rep), len({(int(p), int(v)) for p, v in zip(pp, base["v"], strict=True)})


@pytest.mark.parametrize("model,gpus,gbs,seq", [("llama3-8b", 64, 256, 8192), ("mixtral-8x7b", 32, 128, 4096)])
def test_search_work_is_bounded_by_what_the_space_needs(model, gpus, gbs, seq):
    """A guard on work, not on time (it holds on any machine): the search replays the memory timeline of a few per
    cent of its (row, memory class) pairs, in a few batches, each batch one replay per rank, memory structure and
    distinct pipeline schedule (a compressed interleaved schedule is the same list for every microbatch count past
    a few rounds); the per-row costs are computed once per distinct row; a few per cent of the plans are evaluated
    in full. Replaying every row again (the memory screen of every pair), or every microbatch count's schedule
    apart, fails here."""
    spec, hw = PRESETS[model], load_profile("h100-sxm-spec-cal")
    sp = SearchSpace(global_batch_size=gbs, seq_len=seq)
    res = search(spec, hw, gpus, sp)
    w = res.work
    pairs, structures = _space_structure(spec, hw, gpus, sp)
    assert w["memory_pairs_replayed"] == res.screened <= 0.1 * pairs
    assert w["memory_pairs_replayed"] <= w["memory_bounds"]
    assert 1 <= w["memory_replay_batches"] <= 8
    # per batch and rank: one timeline per (pp, v) and AC period structure (two for layer:N), at most 6 schedule
    # shapes per interleaved one
    assert w["timeline_replays"] + w["schedule_replays"] <= w["memory_replay_batches"] * 2 * 2 * structures * 6
    assert w["distinct_rows"] <= 0.2 * w["distinct_plans"]
    assert res.evaluated == w["plans_evaluated"] <= 0.05 * res.considered
    assert res.top and res.pareto


def test_one_memory_replay_per_schedule_and_rank_not_per_microbatch_count():
    """Interleaved plans that differ only in their microbatch count past a few rounds share one replay of the
    compressed schedule (``phases._merged_schedules``): 16 microbatch counts of one pipeline (pp 4, 2 stages per
    rank) replay at most 5 schedules per rank, not 16, and each plan's memory is what it is alone."""
    from parsim.codec import encode
    from parsim.costmodel import evaluate
    from parsim.costmodel.work import counted
    from parsim.plan import Plan

    spec, hw = PRESETS["llama3-8b"], load_profile("h100-sxm-spec-cal")
    plans = [Plan(pp=4, dp_shard=2, micro_batch_size=1, local_batch_size=4 * k, global_batch_size=8 * k,
                  pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, seq_len=2048) for k in range(1, 17)]
    with counted() as work:
        batch = evaluate(spec, encode(plans, None), hw, memory_only=True)["reserved_memory_bytes"]
    assert work["schedule_replays"] <= 2 * 5 and work["timeline_plans"] == 2 * len(plans)
    alone = [evaluate(spec, encode([p], None), hw, memory_only=True)["reserved_memory_bytes"][0] for p in plans]
    assert list(batch) == alone


@pytest.mark.parametrize("model,gpus,kw,profile", [
    ("qwen3-30b-a3b", 64, dict(global_batch_size=256, seq_len=4096), "h100-sxm-spec-cal"),
    ("llama3-70b", 64, dict(global_batch_size=128, seq_len=8192), "h100-sxm-spec-cal"),
    ("tiny-moe", 8, dict(global_batch_size=64, seq_len=256), "cpu-gloo-4"),
])
def test_interleaved_memory_bound_is_below_every_replayed_moment(model, gpus, kw, profile):
    """The memory bound of interleaved plans (``phases._interleaved_bounds``: the warm-up, the steady forwards'
    and the backwards' ends, ``_steady_moments``) is below the replayed reserved memory of every plan, for the
    bound of the plan's own reshard choice and for the bound of every choice; and the row screen's bound from the
    parameters alone (``optimizer_step_lower_bound``) is below that."""
    from parsim.costmodel import evaluate
    from parsim.costmodel.step import memory_lower_bound, optimizer_step_lower_bound
    from parsim.search import _base_rows, _batch_at, _options

    spec, hw = PRESETS[model], load_profile(profile)
    sp = SearchSpace(pp_schedules=("Interleaved1F1B",), stages_per_rank=(2, 3, 4), **kw)
    base = _base_rows(spec, gpus, sp, hw.gpus_per_node, {})
    opts, base["orders"] = _options(sp, hw)
    rows = np.random.default_rng(0).choice(len(base["row_start"]), size=min(400, len(base["row_start"])),
                                           replace=False)
    gid = ((base["row_start"][rows] * len(opts))[:, None] + np.arange(len(opts))).ravel()
    b = _batch_at(base, opts, gid, sp, None)
    assert (b.pp_stages_per_rank > 1).all() and (b.n_micro > b.pp).any()
    exact = evaluate(spec, b, hw, memory_only=True)["reserved_memory_bytes"]
    own, every = memory_lower_bound(spec, b, hw), memory_lower_bound(spec, b, hw, any_reshard=True)
    static = optimizer_step_lower_bound(spec, b)
    assert np.all(static <= every) and np.all(every <= own) and np.all(own <= exact)


def test_the_batch_split_rules_read_only_the_batch_split_pp_and_dp():
    """``codec.SPLIT_RULES`` come first in ``RULES`` and give the same answer whatever the degrees other than pp and
    dp (search checks them once per (pp, dp) key of its batch-split tables)."""
    from parsim.codec import RULES, SPLIT_RULES, encode, first_broken
    from parsim.plan import Plan

    assert RULES[:len(SPLIT_RULES)] == SPLIT_RULES
    rng = np.random.default_rng(1)
    for _ in range(200):
        pp, lbs = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 4, 8, 12]))
        mbs = int(rng.choice([m for m in (1, 2, 3, 4, 8) if m <= lbs]))
        kw = dict(pp=pp, local_batch_size=lbs, micro_batch_size=mbs if pp > 1 else lbs, seq_len=1024,
                  global_batch_size=lbs * 4 * int(rng.choice([1, 2])) + int(rng.choice([0, 0, 1])),
                  pp_schedule=str(rng.choice(["GPipe", "1F1B", "Interleaved1F1B"])),
                  pp_stages_per_rank=int(rng.choice([1, 2])))
        got = {int(first_broken(encode([Plan(**kw, **deg)], None), None, SPLIT_RULES)[0])
               for deg in (dict(dp_shard=4), dict(dp_replicate=4), dict(dp_replicate=2, dp_shard=2, tp=2, cp=2))}
        assert len(got) == 1, kw


@pytest.mark.parametrize("name,gpus,kw", [("deepseek-v3", 256, {}), ("qwen3-30b-a3b", 64, {"seq_len": 2048}),
                                          ("llama3-8b", 48, {"pp_schedules": ("Interleaved1F1B", "GPipe"),
                                                             "stages_per_rank": (1, 2, 3)}),
                                          ("tiny-moe", 24, {"global_batch_size": 96})])
def test_legal_rows_checked_per_combination_are_those_every_row_check_keeps(name, gpus, kw):
    """``search._base_rows`` checks the rules other than the batch split's once per (degrees, stages per rank): its
    rows and its pruned counts by rule are those of ``codec.first_broken`` over every candidate row."""
    from collections import Counter

    from parsim.codec import RULES, first_broken
    from parsim.search import RULE_CHUNK, _base_rows, _combos, _count_broken, candidate_chunks

    spec = PRESETS[name]
    sp = SearchSpace(**{"global_batch_size": 256, "seq_len": 4096, **kw})
    pruned: dict = {}
    base = _base_rows(spec, gpus, sp, 8, pruned)
    kept, broken = [], Counter()
    for piece, b in candidate_chunks(_combos(spec, gpus, sp), sp, RULE_CHUNK, broken):
        first = first_broken(b, spec)
        _count_broken(broken, first, RULES)
        kept.append(piece[first == len(RULES)])
    rows = np.concatenate(kept)
    assert len(rows) > 100 and len(broken) >= 3
    assert np.array_equal(np.stack([base[k] for k in ("combo", "lbs", "mbs", "sched", "v")], axis=1), rows)
    assert pruned == {str(k): n for k, n in broken.items()}


@pytest.mark.parametrize("model,gpus,kw", [("qwen3-30b-a3b", 64, dict(global_batch_size=256, seq_len=4096)),
                                           ("deepseek-v3", 256, dict(global_batch_size=1024, seq_len=4096)),
                                           ("mixtral-8x7b", 32, dict(global_batch_size=128, seq_len=8192))])
def test_gradient_reduction_moment_bounds_the_replayed_peak(model, gpus, kw):
    """``phases._unit_reduce_bound`` (a unit's unsharded gradients beside its reduce-scatter input, from below) is
    below every rank's replayed allocated peak and present (FSDP) in most plans, and the memory bound with it stays
    below the reserved memory."""
    from parsim.costmodel import evaluate
    from parsim.costmodel.phases import _unit_reduce_bound
    from parsim.costmodel.step import block_kinds, memory_lower_bound, rank_views
    from parsim.search import _base_rows, _batch_at, _options

    spec, hw = PRESETS[model], load_profile("h100-sxm-spec-cal")
    sp = SearchSpace(**kw)
    base = _base_rows(spec, gpus, sp, hw.gpus_per_node, {})
    opts, base["orders"] = _options(sp, hw)
    rows = np.random.default_rng(1).choice(len(base["row_start"]), size=min(300, len(base["row_start"])),
                                           replace=False)
    gid = ((base["row_start"][rows] * len(opts))[:, None] + np.arange(0, len(opts), 3)).ravel()
    b = _batch_at(base, opts, gid, sp, None)
    mem = evaluate(spec, b, hw, memory_only=True)
    peak = mem["peak_memory_bytes"]
    term = np.maximum.reduce([_unit_reduce_bound(b, rv) for rv in rank_views(spec, b, block_kinds(spec))])
    bound = memory_lower_bound(spec, b, hw)  # (of reserved memory, which can exceed the allocated peak)
    assert np.all(term < peak) and np.all(bound <= mem["reserved_memory_bytes"])
    assert (term > 0).mean() > 0.5


def test_time_bound_per_microbatch_reads_nothing_of_how_often_gradients_are_reduced():
    """A guard on work: the per-microbatch part of the exposed-collective time bound is computed once per distinct
    (local shapes, degrees of TP / CP / EP, AC) row; only its per-step part (``_exposed_step_comm_bound``) reads how
    often gradients are reduced, which varies with the local batch and the data-parallel degrees (reading it
    there multiplied the distinct rows of DeepSeek-V3 on 2,048 GPUs by 4.4)."""
    from parsim.costmodel import distinct
    from parsim.costmodel.step import _exposed_comm_bound, _exposed_step_comm_bound, step_time_lower_bound
    from parsim.search import _base_rows, _batch_at, _options

    spec, hw = PRESETS["qwen3-30b-a3b"], load_profile("h100-sxm-spec-cal")
    sp = SearchSpace(global_batch_size=256, seq_len=4096)
    base = _base_rows(spec, 64, sp, hw.gpus_per_node, {})
    opts, base["orders"] = _options(sp, hw)
    b = _batch_at(base, opts, base["row_start"] * len(opts), sp, None)
    step_time_lower_bound(spec, b, hw)
    per_pass = {"reduce_passes", "sync_once", "grad_accum", "local_batch_size", "dp_replicate", "dp_shard", "fsdp"}
    assert not distinct._KEYS[_exposed_comm_bound] & per_pass
    assert distinct._KEYS[_exposed_step_comm_bound] & per_pass


@pytest.mark.parametrize("model,gpus,kw,profile", [
    ("deepseek-v3", 256, dict(global_batch_size=1024, seq_len=4096), "h100-sxm-spec-cal"),
    ("llama3-70b", 64, dict(global_batch_size=128, seq_len=8192), "h100-sxm-spec-cal"),
    ("qwen3-30b-a3b", 64, dict(global_batch_size=256, seq_len=4096), "cpu-gloo-2-cal"),
])
def test_backward_and_reserved_moments_bound_the_replay(model, gpus, kw, profile, monkeypatch):
    """The memory bound's backward moments (``phases._embedding_grad_bound``: a vocab-sharded embedding's dense
    gradient; ``_first_backward_bound``: the first block's recompute) and its reserved part (``rank_reserved_bound``:
    the reduce-scatter pool beside a pipeline's peak known to precede the optimizer step) stay below the replay:
    the moments below each rank's allocated peak, the optimizer moment's upper bound above the replayed optimizer
    moment, the bound below the reserved memory; and each term binds somewhere (it is not a zero)."""
    from parsim.costmodel import evaluate
    from parsim.costmodel import phases as P
    from parsim.costmodel.memory import MEMORY_KEYS, PHASES
    from parsim.costmodel.step import (
        FIRST,
        LAST,
        Shapes,
        block_kinds,
        block_overheads,
        kind_costs,
        memory_lower_bound,
        rank_compute,
        rank_views,
    )
    from parsim.search import _base_rows, _batch_at, _memory_classes, _options

    spec, hw = PRESETS[model], load_profile(profile)
    sp = SearchSpace(**kw)
    base = _base_rows(spec, gpus, sp, hw.gpus_per_node, {})
    opts, base["orders"] = _options(sp, hw)
    rows = np.random.default_rng(2).choice(len(base["row_start"]), size=min(300, len(base["row_start"])),
                                           replace=False)
    gid = ((base["row_start"][rows] * len(opts))[:, None] + _memory_classes(opts)[1][None, :]).ravel()
    b = _batch_at(base, opts, gid, sp, None)
    sh, kinds = Shapes(spec, b), block_kinds(spec)
    costs = kind_costs(spec, b, hw, kinds, block_overheads(hw), times=False)
    grew = np.zeros(len(b), bool)
    for rank, rv in zip((FIRST, LAST), rank_views(spec, b, kinds), strict=True):
        c = rank_compute(spec, b, sh, hw, rv, costs)
        phases, _ = P.rank_memory(spec, b, sh, rank, rv, c)
        totals = np.array([sum(phases[p][k] for k in MEMORY_KEYS) for p in PHASES])
        at_opt, other = P._rank_moment_bounds(spec, b, sh, rank, rv, c)
        assert np.all(other <= totals.max(axis=0) * (1 + 1e-9)) and np.all(at_opt <= totals[-1] * (1 + 1e-9))
        assert np.all(P._optimizer_moment_upper(spec, b, rv, at_opt) >= totals[-1] * (1 - 1e-9))
        grew |= P.rank_reserved_bound(spec, b, sh, rank, rv, c, hw.comm_overlap) > np.maximum(at_opt, other)
    exact = evaluate(spec, b, hw, memory_only=True)["reserved_memory_bytes"]
    bound = memory_lower_bound(spec, b, hw)
    assert np.all(bound <= exact)
    assert grew.any() == hw.comm_overlap  # (a CPU profile has no caching allocator: reserved is the peak)
    for name in ("_embedding_grad_bound", "_first_backward_bound"):  # each moment raises the bound of some plans
        with monkeypatch.context() as mp:
            mp.setattr(P, name, lambda *a, **k: np.zeros(len(b)))
            assert (memory_lower_bound(spec, b, hw) < bound).any(), name
