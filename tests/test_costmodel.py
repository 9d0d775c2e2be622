import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parsim.costmodel import predict
from parsim.hardware import load_profile
from parsim.plan import Plan
from parsim.spec import PRESETS

H100 = load_profile("h100-sxm-spec")
L8, L70 = PRESETS["llama3-8b"], PRESETS["llama3-70b"]


def _p(spec=L8, **kw):
    kw.setdefault("seq_len", 4096)
    return predict(spec, Plan(**kw), H100)


PLANS = [
    (L8, dict(dp_shard=16, ac="selective-op")),
    (L70, dict(dp_shard=8, tp=8, local_batch_size=4, ac="full")),
    (L70, dict(pp=4, dp_shard=4, tp=4, local_batch_size=8, micro_batch_size=1, ac="layer:2")),
    (L70, dict(pp=4, dp_shard=2, tp=8, local_batch_size=8, micro_batch_size=1, pp_schedule="Interleaved1F1B",
               pp_stages_per_rank=2, compile=True)),
    (L8, dict(dp_replicate=2, dp_shard=4, cp=2, tp=2, float8=True)),
    (PRESETS["mixtral-8x7b"], dict(dp_shard=8, ep=8, ac="full")),
    (PRESETS["deepseek-v3"], dict(pp=8, dp_shard=8, ep=8, local_batch_size=16, micro_batch_size=1, ac="full")),
    (PRESETS["gpt3-175b"], dict(pp=8, dp_shard=8, tp=8, local_batch_size=8, micro_batch_size=1, pp_schedule="GPipe")),
    (L70, dict(pp=8, dp_replicate=2, tp=4, local_batch_size=8, micro_batch_size=1, float8=True,
               float8_recipe="rowwise_with_gw_hp", async_tp=True, distributed_optimizer=True)),
]


@pytest.mark.parametrize("spec,kw", PLANS)
def test_breakdowns_sum_to_totals(spec, kw):
    pred = _p(spec, **kw)
    assert math.isclose(sum(pred.memory_breakdown_bytes.values()), pred.peak_memory_bytes, rel_tol=1e-9)
    assert math.isclose(sum(pred.time_breakdown_s.values()), pred.step_time_s, rel_tol=1e-9)
    assert all(v >= 0 for v in pred.memory_breakdown_bytes.values())
    assert all(v >= 0 for v in pred.time_breakdown_s.values())
    assert pred.step_time_s > 0 and 0 < pred.mfu < 1


def test_pipeline_on_shared_cores_is_bounded_by_the_mean_stage():
    """Ranks sharing cores (compute_scale s > 1): a pipeline rank's compute and bubble take the larger of the cores'
    bound (the mean stage's stretched compute) and its critical path at full speed; with s = 1 the plain bubble,
    (pp - 1) microbatch-times of the other stages."""
    from types import SimpleNamespace

    from parsim.costmodel.pipeline import shared_cores

    b = SimpleNamespace(pp=np.array([4]), pp_stages_per_rank=np.array([1]))
    one = SimpleNamespace(corrections={})
    f, bub = shared_cores(b, one, 4.0, 1.0, 0.2, 0.2, 0.2)
    assert f[0] == 1.0 and bub[0] == pytest.approx(3 * 0.2)  # equal stages: (pp - 1) microbatch-times
    # a last stage of 0.2 beside three of 0.2 / 3 (mean 0.1): the fill and drain run through the other three
    f, bub = shared_cores(b, one, 4.0, 1.0, 0.2, 0.2, 0.1)
    assert f[0] == 1.0 and bub[0] == pytest.approx(3 * (4 * 0.1 - 0.2) / 3)
    two = SimpleNamespace(corrections={"compute_scale": 2.0})
    # own stretched 4 x 0.2 = 0.8; cores 4 x 0.1 = 0.4; critical path 4 x 0.1 + 3 x 0.2 / 3 / 2 = 0.5: x 0.625
    f, bub = shared_cores(b, two, 4.0, 1.0, 0.2, 0.2, 0.1)
    assert f[0] == pytest.approx(0.625) and bub[0] == 0.0
    # a rank lighter than the mean waits for the cores: no factor, the difference is bubble
    f, bub = shared_cores(b, two, 4.0, 1.0, 0.1, 0.1, 0.2)
    assert f[0] == 1.0 and bub[0] == pytest.approx(4 * 0.2 - 4 * 0.1)
    # without a mean, the bound before stop 55: own stretched compute
    f, bub = shared_cores(b, two, 4.0, 1.0, 0.2, 0.2)
    assert f[0] == 1.0 and bub[0] == 0.0
    # a whole prediction on the 4-rank CPU profile (s = 2): breakdown sums, nothing negative
    p = predict(PRESETS["tiny"], Plan(pp=4, seq_len=256, local_batch_size=4, micro_batch_size=1,
                                      param_dtype="float32"), load_profile("cpu-gloo-4"))
    assert math.isclose(sum(p.time_breakdown_s.values()), p.step_time_s, rel_tol=1e-9)
    assert all(v >= 0 for v in p.time_breakdown_s.values())


def test_simulated_schedule_is_the_textbook_step_without_sharing():
    """``shared_makespan`` with no sharing (scale 1) and equal stages: (m + (pp - 1) / v) x the stage's microbatch
    time (Narayanan et al. 2021, sec. 2.2) for GPipe, 1F1B and interleaved 1F1B."""
    from parsim.costmodel.pipeline import SCHED_1F1B, SCHED_GPIPE, SCHED_INTERLEAVED, shared_makespan

    for sched in (SCHED_GPIPE, SCHED_1F1B):
        assert shared_makespan(sched, 4, 1, 8, [(1.0, 2.0)] * 4, 1.0) == pytest.approx((8 + 3) * 3.0)
    assert shared_makespan(SCHED_INTERLEAVED, 4, 2, 8, [(0.5, 1.0)] * 4, 1.0) == pytest.approx((8 + 3 / 2) * 3.0)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from([0, 1, 2]), st.integers(2, 5), st.integers(1, 3), st.integers(1, 3),
       st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 2.0)), min_size=5, max_size=5),
       st.floats(1.0, 3.0))
def test_simulated_schedule_on_shared_cores_is_between_its_bounds(sched, pp, v, rounds, work, scale):
    """With ranks sharing cores (scale s: every rank busy runs s times slower) the simulated step is at least the
    cores' bound (every rank's work at the throughput of pp ranks all busy, pp / s) and the schedule without
    sharing (the critical path), and at most the schedule with every action stretched by s."""
    from parsim.costmodel.pipeline import SCHED_INTERLEAVED, shared_makespan

    v = v + 1 if sched == SCHED_INTERLEAVED else 1  # interleaving: 2 to 4 stages a rank
    m = pp * rounds
    w = work[:pp]
    span = shared_makespan(sched, pp, v, m, w, scale)
    free = shared_makespan(sched, pp, v, m, w, 1.0)
    cores = m * v * sum(f + b for f, b in w) * scale / pp
    assert span >= cores * (1 - 1e-9) and span >= free * (1 - 1e-9)
    assert span <= shared_makespan(sched, pp, v, m, [(f * scale, b * scale) for f, b in w], 1.0) * (1 + 1e-9)


def test_pipeline_step_on_shared_cores_is_the_simulated_schedule():
    """On the 4-rank CPU profile (s about 2) a pipeline's compute and bubble are the simulated schedule's step, at
    least ``shared_cores``' larger bound (tiny pp 4, 4 microbatches: the fill and drain leave a core idle)."""
    from parsim.costmodel import step

    spec, hw = PRESETS["tiny"], load_profile("cpu-gloo-4")
    plan = Plan(pp=4, seq_len=256, local_batch_size=4, micro_batch_size=1, param_dtype="float32")
    sim = predict(spec, plan, hw).time_breakdown_s
    orig = step.shared_cores
    try:  # the bounds alone: shared_cores without the ranks' work
        step.shared_cores = lambda *a: orig(*a[:7])
        bound = predict(spec, plan, hw).time_breakdown_s
    finally:
        step.shared_cores = orig
    keys = ("compute_forward", "compute_backward", "recompute", "pp_bubble")
    assert sum(sim[k] for k in keys) > 1.02 * sum(bound[k] for k in keys)
    assert all(sim[k] == pytest.approx(bound[k]) for k in sim if k not in keys)


def test_mean_stage_counts_the_middle_ranks_own_layers():
    """The pipeline's mean stage is every rank's compute over pp: the first and the last rank's and the layers the
    ranks between them hold, at their own kind's cost. tiny-moe's first layer is dense, the other three MoE: under
    pp 4 the two middle ranks run a MoE layer each, not the first rank's dense one."""
    from parsim.codec import encode
    from parsim.costmodel.compute import block_overheads, layer_costs, rank_compute
    from parsim.costmodel.layers import FIRST, LAST, Shapes, rank_layers
    from parsim.costmodel.step import _mean_stage_compute, _rank_view, _stage_work, layer_params

    spec, hw = PRESETS["tiny-moe"], load_profile("cpu-gloo-4")
    plans = [Plan(pp=pp, seq_len=256, local_batch_size=4, micro_batch_size=1, param_dtype="float32", ac=ac)
             for pp in (1, 2, 4) for ac in ("none", "full")]
    b = encode(plans, hw.gpus_per_node)
    sh = Shapes(spec, b)
    costs = {k: layer_costs(spec, b, sh, hw, k, block_overheads(hw)) for k in (False, True)}
    plocal, pshard = layer_params(spec, b, [False, True])
    layers = rank_layers(spec, b.pp, b.pp_stages_per_rank)
    rvs = [_rank_view(spec, b, r, layers, [False, True], plocal, pshard) for r in (FIRST, LAST)]
    cs = [rank_compute(spec, b, sh, hw, rv, costs) for rv in rvs]
    first, last = (c.fwd + c.bwd + c.rec for c in cs)
    moe = costs[True].fwd + costs[True].bwd + np.where(b.ac == b.ac[1], costs[True].rec_full, 0.0)
    mean = _mean_stage_compute(_stage_work(spec, b, cs, rvs), b)
    assert mean[:2] == pytest.approx(first[:2])  # without PP: the one rank
    assert mean[2:4] == pytest.approx((first[2:4] + last[2:4]) / 2)
    assert mean[4:] == pytest.approx((first[4:] + last[4:] + 2 * moe[4:]) / 4)
    assert np.all(moe[4:] > first[4:])  # here a MoE layer costs more than the dense one with the embedding


def test_memory_falls_as_dp_shard_tp_pp_grow():
    mems = [_p(dp_shard=d).peak_memory_bytes for d in (8, 16, 32)]
    assert mems[0] > mems[1] > mems[2]
    mems = [_p(dp_shard=8, tp=t).peak_memory_bytes for t in (1, 2, 4)]
    assert mems[0] > mems[1] > mems[2]
    mems = [_p(L70, dp_shard=8, tp=8, pp=p, local_batch_size=8, micro_batch_size=8 if p == 1 else 1).peak_memory_bytes
            for p in (1, 2, 4)]
    assert mems[0] > mems[1] > mems[2]


def test_memory_rises_with_micro_batch():
    mems = [_p(dp_shard=16, local_batch_size=b).peak_memory_bytes for b in (1, 2, 4)]
    assert mems[0] < mems[1] < mems[2]
    mems = [_p(L70, pp=4, dp_shard=2, tp=8, local_batch_size=8, micro_batch_size=m).peak_memory_bytes for m in (1, 2)]
    assert mems[0] < mems[1]


def test_ac_ordering_of_activations_and_recompute():
    act = {ac: _p(dp_shard=16, ac=ac).memory_breakdown_bytes["activations"] for ac in ("none", "selective-op", "full")}
    assert act["full"] < act["selective-op"] < act["none"]
    rec = {ac: _p(dp_shard=16, ac=ac).time_breakdown_s["recompute"] for ac in ("none", "selective-op", "full")}
    assert rec["none"] == 0 < rec["selective-op"] < rec["full"]
    # every second layer checkpointed lands in between
    half = _p(dp_shard=16, ac="layer:2").memory_breakdown_bytes["activations"]
    assert act["full"] < half < act["none"]


def test_fsdp_comm_bytes_are_exact_param_counts():
    # FSDP 16, no PP, reshard after forward: each step all-gathers every bf16 shard twice (forward, backward) except
    # the output unit (kept after forward, torchtitan), and reduce-scatters every fp32 unsharded gradient once
    pred = _p(dp_shard=16)
    n, out = L8.n_params, L8.output_params()
    assert pred.comm_bytes["all_gather/dp_shard"] == pytest.approx((2 * (n - out) + out) / 16 * 2)
    assert pred.comm_bytes["reduce_scatter/dp_shard"] == pytest.approx(n * 4)
    assert "all_gather/tp" not in pred.comm_bytes


def test_tp_sp_comm_bytes_per_layer():
    # TP 8 with SP, no AC, one microbatch of 4 x 4096 tokens: per layer 4 all-gathers of T*d/tp and 4 reduce-
    # scatters of T*d (bf16), plus one of each for the embedding and for the output layer
    pred = _p(L70, dp_shard=8, tp=8, local_batch_size=4)
    T, d = 4 * 4096, 8192
    assert pred.comm_bytes["all_gather/tp"] == pytest.approx((4 * 80 + 2) * T * d / 8 * 2)
    assert pred.comm_bytes["reduce_scatter/tp"] == pytest.approx((4 * 80 + 2) * T * d * 2)


def test_device_order_moves_cost_across_nodes():
    # TP innermost (inside a node) is cheaper than TP across nodes
    fast = _p(L70, dp_shard=8, tp=8, local_batch_size=2)
    slow = _p(L70, dp_shard=8, tp=8, local_batch_size=2, mesh_order=("pp", "dp_replicate", "cp", "tp", "dp_shard"))
    assert slow.time_breakdown_s["comm_tp"] > 3 * fast.time_breakdown_s["comm_tp"]
    assert slow.step_time_s > fast.step_time_s


def test_pipeline_bubble_shrinks_with_microbatches_and_interleaving():
    b = {m: _p(L70, pp=4, dp_shard=2, tp=8, local_batch_size=m, micro_batch_size=1) for m in (4, 16)}
    frac = {m: p.time_breakdown_s["pp_bubble"] / p.step_time_s for m, p in b.items()}
    assert frac[16] < frac[4]
    inter = _p(L70, pp=4, dp_shard=2, tp=8, local_batch_size=4, micro_batch_size=1, pp_schedule="Interleaved1F1B",
               pp_stages_per_rank=2)
    assert inter.time_breakdown_s["pp_bubble"] < b[4].time_breakdown_s["pp_bubble"]


def test_large_model_does_not_fit_on_few_gpus():
    assert not _p(L70, dp_shard=8).fits
    assert not _p(L70, dp_shard=64).fits  # 80 layers of activations without AC: ~100 GiB
    assert _p(L70, dp_shard=64, ac="full").fits


def test_ep_all_to_all_and_expert_sharding():
    mix = PRESETS["mixtral-8x7b"]
    with_ep = _p(mix, dp_shard=8, ep=8)
    assert with_ep.comm_bytes["all_to_all/ep"] > 0
    assert "all_gather/efsdp" not in with_ep.comm_bytes  # efsdp = 8 / 8 = 1: experts are not FSDP-sharded
    no_ep = _p(mix, dp_shard=8)
    assert "all_to_all/ep" not in no_ep.comm_bytes


LEDGER_PLANS = PLANS + [
    (L8, dict(dp_replicate=2, dp_shard=8, seq_len=4096)),
    (PRESETS["mixtral-8x7b"], dict(dp_replicate=4, dp_shard=2, ep=4, ep_from="dp_replicate")),
    (L70, dict(pp=4, tp=8, local_batch_size=8, micro_batch_size=1, fsdp_reshard_after_forward="always")),
]


@pytest.mark.parametrize("spec,kw", LEDGER_PLANS, ids=[f"{s.name}-{i}" for i, (s, _) in enumerate(LEDGER_PLANS)])
def test_ledger_is_the_source_of_bytes_and_exposed_times(spec, kw):
    """comm_bytes is a group-by of the ledger; every comm_bytes key has a raw and an exposed time; exposed never
    exceeds raw; the comm_<axis> entries of the time breakdown are the exposed times summed per axis."""
    from parsim.costmodel.explain import explain

    kw.setdefault("seq_len", 4096)
    plan = Plan(**kw)
    p = predict(spec, plan, H100)
    assert set(p.comm_bytes) <= set(p.comm_time_s) == set(p.exposed_comm_time_s)
    for k, raw in p.comm_time_s.items():
        assert 0.0 <= p.exposed_comm_time_s[k] <= raw * (1 + 1e-9) + 1e-15
    per_axis: dict = {}
    for k, e in p.exposed_comm_time_s.items():
        per_axis["comm_" + k.split("/", 1)[1]] = per_axis.get("comm_" + k.split("/", 1)[1], 0.0) + e
    for axis, e in per_axis.items():
        assert p.time_breakdown_s.get(axis, 0.0) == pytest.approx(e, rel=1e-9, abs=1e-12)
    d = explain(spec, plan, H100)
    if d["rank"] == "pp stage 0":  # comm_bytes are rank 0's
        grouped: dict = {}
        for r in d["ledger"]:
            grouped[r["key"]] = grouped.get(r["key"], 0.0) + r["bytes_per_call"] * r["calls"]
        assert {k: v for k, v in grouped.items() if v > 0} == pytest.approx(p.comm_bytes, rel=1e-12)


def test_fsdp_is_costed_per_unit():
    """One call per FSDP unit: latency paid per unit. tiny (4 blocks) FSDP4 on the measured 4-rank profile:
    forward + backward gather of 4 blocks and the embedding, one gather of the [final norm, output] unit (kept
    unsharded after forward, as torchtitan wraps it; the root holds no parameters)."""
    from parsim.costmodel.explain import explain

    cpu = load_profile("cpu-gloo-4")
    plan = Plan(dp_shard=4, seq_len=256, local_batch_size=2)
    rows = [r for r in explain(PRESETS["tiny"], plan, cpu)["ledger"] if r["key"] == "all_gather/dp_shard"]
    assert sum(r["calls"] for r in rows) == 2 * 4 + 2 + 1
    block = next(r for r in rows if r["what"].endswith("dense block"))
    assert block["raw_s"] == pytest.approx(8 * cpu.collective_time_s("all_gather", block["bytes_per_call"], 4, 4))
    lumped = cpu.collective_time_s("all_gather", sum(r["bytes_per_call"] * r["calls"] for r in rows) / 2, 4, 4) * 2
    assert sum(r["raw_s"] for r in rows) > lumped  # the old model: one call per round carrying every unit


def test_predict_explain_cli_shows_ledger_compute_and_saved_tensors():
    from typer.testing import CliRunner

    from parsim.cli.main import app

    r = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpus", "16", "--tp", "2", "--explain",
                                 "--json"])
    assert r.exit_code == 0, r.output
    import json

    d = json.loads(r.stdout)["explain"]
    assert any(x["what"].startswith("FSDP all-gather") for x in d["ledger"])
    assert any(x["what"].startswith("TP all-gather") for x in d["ledger"])
    items = d["layers"]["dense"]["compute_forward"]
    assert [x["name"] for x in items if x["kind"] == "gemm"] == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    assert all(0 < x["efficiency"] <= 1 for x in items)
    saved = d["layers"]["dense"]["saved_tensors"]
    assert sum(x["bytes"] for x in saved if x["kept_full"]) < sum(x["bytes"] for x in saved if x["kept_sac"]) \
        < sum(x["bytes"] for x in saved if x["kept_none"])
    r = CliRunner().invoke(app, ["predict", "--model", "tiny", "--gpus", "4", "--explain"])
    assert r.exit_code == 0 and "collective ledger" in r.stdout and "saves per microbatch" in r.stdout


def test_explain_factors_rebuild_the_printed_numbers():
    """--explain names every factor it applies, so the printed numbers follow from the output alone: each ledger
    row's raw time is calls x the profile's collective curve x the row's scale (the calibrated comm_scale of its
    axis class and op), the interference term is its factor x the hidden collective time, and the factors say
    where each value comes from (calibrate's fit, a measurement, the profile, the plan)."""
    from parsim.costmodel.explain import explain

    cal = load_profile("h100-sxm-spec-cal")
    plan = Plan(dp_shard=16, tp=2, pp=2, seq_len=4096, local_batch_size=4, micro_batch_size=1)
    d = explain(PRESETS["llama3-8b"], plan, cal)
    p = predict(PRESETS["llama3-8b"], plan, cal)
    for r in d["ledger"]:
        curve = cal.collective_time_s(r["key"].split("/")[0], r["bytes_per_call"], r["group_size"],
                                      r["ranks_per_node"])
        assert r["raw_s"] == pytest.approx(r["calls"] * float(curve) * r["scale"], rel=1e-9)
    tp_rows = [r for r in d["ledger"] if r["key"] == "reduce_scatter/tp"]
    assert tp_rows and tp_rows[0]["scale"] == pytest.approx(cal.corrections["comm_scale_tp"])
    f = {x["name"]: x for x in d["factors"]}
    hidden = sum(r["raw_s"] - r["exposed_s"] for r in d["ledger"])
    assert f["comm_interference"]["value"] * hidden == pytest.approx(p.time_breakdown_s["comm_interference"])
    assert f["collective time scale reduce_scatter/tp"]["source"].startswith("fitted by parsim calibrate")
    assert f["pipeline bubble (microbatch times)"]["value"] == 1.0
    assert f["microbatches in flight at the peak (first stage, last stage)"]["value"] == [2.0, 1.0]
    cpu = {x["name"]: x for x in explain(PRESETS["tiny"], Plan(tp=2, seq_len=256), load_profile("cpu-gloo-4"))[
        "factors"]}
    assert cpu["compute_scale"]["value"] == 2.0 and cpu["compute_scale"]["source"].startswith("measured")
    assert cpu["comm_overlap"]["value"] is False
    # on an A100 the GEMM factor printed is the one applied: the common factor x Ampere's own ratio; a Triton
    # attention plan shows the kernel's slowdown with its fitted factor
    a100 = load_profile("a100-sxm-80gb-spec-cal")
    fac = a100.calibration["factors"]
    af = {x["name"]: x for x in explain(PRESETS["llama3-8b"], Plan(dp_shard=8, seq_len=4096,
                                                                   attention_kernel="triton"), a100)["factors"]}
    applied = fac["gemm_eff_max"] * fac["gemm_eff_max_ampere"]
    assert f"x{applied:.3g} on the profile's value, gemm_eff_max_ampere" in af["gemm_efficiency (eff_max, x_half)"][
        "source"]
    assert af["gemm_efficiency (eff_max, x_half)"]["value"][0] == pytest.approx(
        load_profile("a100-sxm-80gb-spec").gemm_efficiency.eff_max * applied)
    tri = af["Triton FlashAttention slowdown"]
    assert tri["value"] == pytest.approx(1.8 * fac["triton_attention"])
    assert tri["source"].startswith("fitted by parsim calibrate")


def test_explain_prints_bracketed_names():
    """Names with brackets ("[final norm, output] unit") are printed as written, not eaten as rich markup."""
    from typer.testing import CliRunner

    from parsim.cli.main import app

    r = CliRunner().invoke(app, ["predict", "--model", "tiny", "--gpus", "4", "--explain"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "[final norm, output] unit" in r.stdout and "factors applied to this prediction" in r.stdout


def test_memory_only_evaluation_equals_the_full_one():
    from parsim.codec import encode
    from parsim.costmodel.step import evaluate

    for spec, kw in PLANS:
        b = encode([Plan(**{"seq_len": 4096, **kw})], H100.gpus_per_node)
        full, mem = evaluate(spec, b, H100), evaluate(spec, b, H100, memory_only=True)
        assert mem["peak_memory_bytes"][0] == full["peak_memory_bytes"][0]


def test_a_batch_is_evaluated_as_each_plan_alone():
    """The memory replay groups a batch's plans (by pipeline shape and AC structure, then by the fields memory
    depends on), shares records between stages and phases, and the search screens in batches: every plan's
    prediction must be what it is evaluated alone. Seeded draws over pipeline schedules (interleaved included), AC
    modes, reshard modes, microbatch counts, gradient accumulation, EP and TP on a dense and a MoE model."""
    import dataclasses
    import random

    import numpy as np

    from parsim.codec import encode, validate_plan
    from parsim.costmodel.step import evaluate

    rng = random.Random(0)
    for name in ("llama3-8b", "mixtral-8x7b"):
        spec = dataclasses.replace(PRESETS[name], n_layers=8)
        plans: list[Plan] = []
        while len(plans) < 30:
            pp = rng.choice([1, 2, 4])
            sched = rng.choice(["1F1B", "GPipe", "Interleaved1F1B"]) if pp > 1 else "1F1B"
            kw = dict(pp=pp, pp_schedule=sched, pp_stages_per_rank=rng.choice([2, 4]) if sched == "Interleaved1F1B"
                      else 1, dp_shard=rng.choice([1, 2, 4]), tp=rng.choice([1, 2]), seq_len=1024,
                      local_batch_size=rng.choice([2, 4, 8]), micro_batch_size=rng.choice([1, 2]),
                      global_batch_size=None, ac=rng.choice(["none", "full", "selective-op", "layer:2"]),
                      fsdp_reshard_after_forward=rng.choice(["default", "always", "never"]))
            if spec.moe is not None:
                kw["ep"] = rng.choice([1, 2])
            kw["global_batch_size"] = kw["local_batch_size"] * kw["dp_shard"] * rng.choice([1, 2])
            try:
                plan = Plan(**kw)
                validate_plan(plan, spec)
            except Exception:  # noqa: BLE001 - a draw the rules refuse is simply redrawn
                continue
            plans.append(plan)
        batch = evaluate(spec, encode(plans, 8), H100)
        for i, plan in enumerate(plans):
            alone = evaluate(spec, encode([plan], 8), H100)
            for key in ("peak_memory_bytes", "reserved_memory_bytes", "step_time_s"):
                assert batch[key][i] == pytest.approx(alone[key][0], rel=1e-9), (plan.describe(), key)
        screen = evaluate(spec, encode(plans, None), H100, memory_only=True)
        assert np.allclose(screen["reserved_memory_bytes"], batch["reserved_memory_bytes"], rtol=1e-9)
        timed = evaluate(spec, encode(plans, 8), H100, time_only=True)
        assert np.allclose(timed["step_time_s"], batch["step_time_s"], rtol=1e-12)
        assert list(timed["dominant"]) == list(batch["dominant"])


def test_row_ids_are_equal_exactly_where_rows_are():
    """``rows.row_ids`` partitions rows as ``np.unique(axis=0)`` does, also when the mixed-radix code must be
    re-ranked (many columns of many distinct values)."""
    import numpy as np

    from parsim.costmodel.rows import row_ids, unique_rows

    rng = np.random.default_rng(0)
    for cols, values in ((3, 4), (40, 1000)):
        a = rng.integers(0, values, (5000, cols)).astype(float)
        a[::7] = a[3]  # some repeated rows
        ids = row_ids(a)
        _, ref = np.unique(a, axis=0, return_inverse=True)
        pairs = set(zip(ids.tolist(), np.ravel(ref).tolist(), strict=True))
        assert len(pairs) == len(set(ids.tolist())) == len(set(np.ravel(ref).tolist()))
        uniq, inv = unique_rows(a)
        assert np.array_equal(uniq[inv], a)


def test_the_attention_backward_takes_the_profiles_measured_ratio():
    """A measured profile fits its attention curve on forward times and keeps the backward's measured ratio
    (``attention_bwd_per_fwd``: ~3 on the H100 / H200, ~2.9 in the CPU profiles); the backward's attention time is
    the forward's times that ratio, nothing else moves. Spec sheets keep 2.5 (FA2's FLOP ratio: their curves are
    forward + backward throughput)."""
    import dataclasses

    from parsim.codec import encode
    from parsim.costmodel.compute import block_overheads, layer_compute_items, layer_costs
    from parsim.costmodel.layers import Shapes

    assert load_profile("h100-sxm-spec").attention_bwd_per_fwd == 2.5
    for name in ("h100-measured", "h200-measured", "cpu-gloo-2"):
        assert 2.7 < load_profile(name).attention_bwd_per_fwd < 3.1, name
    spec, hw = PRESETS["llama3-8b"], load_profile("h100-sxm-spec")
    b = encode([Plan(dp_shard=8, seq_len=8192)], hw.gpus_per_node)
    sh = Shapes(spec, b)
    attn = sum(it.seconds for it in layer_compute_items(spec, b, sh, hw, False) if it.kind == "attention")
    costs = {r: layer_costs(spec, b, sh, dataclasses.replace(hw, attention_bwd_per_fwd=r), False,
                            overheads=block_overheads(hw), compute_scale=1.0) for r in (2.5, 3.0)}
    assert float(costs[3.0].bwd[0] - costs[2.5].bwd[0]) == pytest.approx(0.5 * float(attn[0]), rel=1e-9)
    assert float(costs[3.0].fwd[0]) == float(costs[2.5].fwd[0])


def test_ledger_refuses_words_it_does_not_know():
    """A misspelt op, phase, overlap, axis or FSDP unit in a ledger record is an error, not a collective that every
    group-by naming the right word silently misses; a record's words are the vocabulary's members (``parsim.vocab``,
    equal to their plain words), and everything but its label is passed by name."""
    import numpy as np

    from parsim.costmodel.comm import Ledger
    from parsim.hardware import load_profile
    from parsim.vocab import Axis, FsdpUnit, Op, Overlap, Phase

    led = Ledger(load_profile("h100-sxm-spec"), 1)
    size = dict(bytes_per_call=1e6, calls=1, group=np.array([2]), rpn=8)
    led.add("ok", op="all_gather", axis="tp", phase="forward", overlap="exposed", **size)
    rec = led.records[-1]
    assert (rec.op, rec.axis, rec.phase, rec.overlap) == (Op.ALL_GATHER, Axis.TP, Phase.FORWARD, Overlap.EXPOSED)
    assert isinstance(rec.op, Op) and rec.key == "all_gather/tp" and rec.unit is None
    with pytest.raises(TypeError):  # (keyword-only: a shifted position cannot pass for another field)
        led.add("positional", "all_gather", "tp", 1e6, 1, np.array([2]), 8, "forward", "exposed")  # type: ignore[misc]
    for bad in (("allgather", "tp", "forward", "exposed"), ("all_gather", "tp", "fwd", "exposed"),
                ("all_gather", "tp", "forward", "hidden"), ("all_gather", "tensor", "forward", "exposed"),
                ("all_gather", [("dp_shard", True), ("dpshard", False)], "forward", "fsdp_gather")):
        op, axis, phase, overlap = bad
        with pytest.raises(ValueError, match="not one of the known words"):
            led.add("bad", op=op, axis=axis, phase=phase, overlap=overlap, **size)
    # an FSDP record names its unit from the vocabulary (what reads it keys on the unit, not on the label)
    led.add("FSDP all-gather: dense block", op=Op.ALL_GATHER, axis=Axis.DP_SHARD, phase=Phase.FORWARD_BACKWARD,
            overlap=Overlap.FSDP_GATHER, unit=FsdpUnit.DENSE_BLOCK, **size)
    assert led.records[-1].unit == "dense block" == FsdpUnit.DENSE_BLOCK
    with pytest.raises(ValueError, match="unit 'dense blocks' is not one of the known words"):
        led.add("FSDP all-gather: x", op="all_gather", axis="dp_shard", phase="forward+backward",
                overlap="fsdp_gather", unit="dense blocks", **size)
