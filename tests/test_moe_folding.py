"""Megatron-Core MoE parallel folding (``ep_from="folded"``): the expert mesh (edp, ep, etp) laid over a stage's
dp_replicate x cp x tp ranks, expert TP innermost (Megatron's expert RankGenerator, order tp-ep-dp-pp), so EP may
outnumber the data-parallel ranks. Rules, rank groups, memory, collectives, search, emit and published rows."""

import pytest

from parsim import validate as V
from parsim.codec import RuleError, _rank_sets, executor_refusal, validate_plan
from parsim.costmodel import predict
from parsim.costmodel.explain import explain
from parsim.costmodel.step import rank_details
from parsim.emit import to_megatron_args, to_torchtitan_python
from parsim.hardware import load_profile
from parsim.plan import Plan
from parsim.search import SearchSpace, search
from parsim.spec import PRESETS

H100 = load_profile("h100-sxm-spec")
QWEN = PRESETS["qwen3-30b-a3b"]  # 48 MoE layers, 128 experts of d_ff 768, d_model 2048


def _plan(**kw) -> Plan:
    return Plan(**{"dp_shard": 1, "seq_len": 4096, "ep_from": "folded", **kw})


def test_ep_larger_than_the_data_parallel_size_is_valid_folded_and_refused_ddp_style():
    validate_plan(_plan(dp_replicate=4, tp=2, ep=8), QWEN, 8)
    with pytest.raises(RuleError, match="dp_replicate 4 divisible by ep 8"):
        validate_plan(_plan(dp_replicate=4, tp=2, ep=8, ep_from="dp_replicate"), QWEN, 8)
    with pytest.raises(RuleError, match="divisible by ep x etp = 8 x 2"):
        validate_plan(_plan(dp_replicate=4, tp=2, ep=8, etp=2), QWEN, 8)
    with pytest.raises(RuleError, match="dp_shard must be 1"):
        validate_plan(_plan(dp_replicate=2, dp_shard=2, tp=2, ep=8), QWEN, 8)
    assert "cost-model option" in executor_refusal(_plan(dp_replicate=4, tp=2, ep=8), QWEN)


def test_rank_groups_follow_megatrons_expert_rank_generator():
    """Ranks 0..7 as dp_replicate x cp x tp (tp fastest). Megatron's expert groups: etp innermost, then ep, then
    edp. EP 8 over dp 4 x tp 2: one EP group of all 8, no expert data parallel. EP 2 x ETP 2 over dp 2 x cp 2 x
    tp 2: EP groups {0, 2}, {1, 3}, {4, 6}, {5, 7}; expert DP pairs {0, 4}."""
    s = _rank_sets(_plan(dp_replicate=4, tp=2, ep=8), 0)
    assert s["ep"] == frozenset(range(8)) and s["edp"] == frozenset({0}) and s["tp"] == frozenset({0, 1})
    s = _rank_sets(_plan(dp_replicate=2, cp=2, tp=2, ep=2, etp=2), 5)
    assert s["ep"] == frozenset({5, 7}) and s["edp"] == frozenset({1, 5})
    # with tp = cp = 1 folding is DDP-style EP's layout
    a = _rank_sets(_plan(dp_replicate=8, ep=4), 6)
    b = _rank_sets(_plan(dp_replicate=8, ep=4, ep_from="dp_replicate"), 6)
    assert (a["ep"], a["edp"]) == (b["ep"], b["edp"]) == (frozenset({4, 5, 6, 7}), frozenset({2, 6}))


def test_folded_equals_ddp_style_where_the_layouts_coincide():
    for kw in (dict(dp_replicate=8, ep=4), dict(dp_replicate=8, ep=4, distributed_optimizer=True)):
        a, b = predict(QWEN, _plan(**kw), H100), predict(QWEN, _plan(**kw, ep_from="dp_replicate"), H100)
        assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
        assert a.peak_memory_bytes == pytest.approx(b.peak_memory_bytes, rel=1e-12)
        assert a.comm_bytes == pytest.approx(b.comm_bytes, rel=1e-12)


def test_experts_per_rank_shrink_with_ep_beyond_the_data_parallel_size():
    """Same dense layout (dp_replicate 4 x tp 2): EP 8 folded holds 16 of 128 experts per rank at full width (etp
    1), DDP-style EP 4 holds 32; the parameters differ by exactly 16 experts' w1, w2, w3 in each of 48 layers."""
    def held(plan):  # parameters on the rank: the fp32 master copy (no distributed optimizer) / 4 B
        return rank_details(QWEN, plan, H100)[0]["memory_breakdown_bytes"]["parameters"] / 4.0

    diff = held(_plan(dp_replicate=4, tp=2, ep=4, ep_from="dp_replicate")) - held(_plan(dp_replicate=4, tp=2, ep=8))
    assert diff == 48 * 16 * 3 * 2048 * 768


def test_expert_gradients_reduce_over_the_expert_data_parallel_group():
    """dp_replicate 8 x tp 2, EP 4 (etp 1): expert data parallel 16 / 4 = 4 ranks (a stride of 4 over the 16
    ranks: 2 per 8-GPU node). Without the distributed optimizer one all-reduce of the expert gradients per MoE layer
    over those 4; with it a reduce-scatter and an all-gather of the updated shards, and each rank steps 1/4 of its
    experts and 1/8 of the dense parameters."""
    rows = [r for r in explain(QWEN, _plan(dp_replicate=8, tp=2, ep=4), H100)["ledger"] if r["key"].endswith("/edp")]
    ar = [r for r in rows if r["calls"] > 0]
    assert [(r["key"], r["calls"], r["group_size"], r["ranks_per_node"]) for r in ar] == [
        ("all_reduce/edp", 48.0, 4, 2)]
    dist = _plan(dp_replicate=8, tp=2, ep=4, distributed_optimizer=True)
    keys = {r["key"] for r in explain(QWEN, dist, H100)["ledger"] if r["key"].endswith("/edp") and r["calls"] > 0}
    assert keys == {"reduce_scatter/edp", "all_gather/edp"}
    full = rank_details(QWEN, _plan(dp_replicate=8, tp=2, ep=4), H100)[0]["memory_breakdown_bytes"]
    sharded = rank_details(QWEN, dist, H100)[0]["memory_breakdown_bytes"]
    experts = 48 * 32 * 3 * 2048 * 768  # 32 local experts, whole (etp 1)
    dense = full["parameters"] / 4.0 - experts
    assert sharded["optimizer_states"] / 8.0 == pytest.approx(dense / 8 + experts / 4, rel=1e-9)


def test_ep_equal_to_the_data_parallel_size_leaves_expert_state_unsharded():
    """DDP-style EP 8 over dp_replicate 8: no two ranks hold the same expert, so Megatron's distributed optimizer
    has nothing to shard the expert state over (it used to be divided by dp_replicate like the dense state)."""
    plain = rank_details(QWEN, _plan(dp_replicate=8, ep=8, ep_from="dp_replicate"), H100)[0]
    dist = rank_details(QWEN, _plan(dp_replicate=8, ep=8, ep_from="dp_replicate", distributed_optimizer=True),
                        H100)[0]
    experts = 48 * 16 * 3 * 2048 * 768
    dense = plain["memory_breakdown_bytes"]["parameters"] / 4.0 - experts
    assert dist["memory_breakdown_bytes"]["optimizer_states"] / 8.0 == pytest.approx(dense / 8 + experts, rel=1e-9)


def test_search_finds_folded_plans_with_more_ep_than_data_parallel_ranks():
    res = search(QWEN, H100, 16, SearchSpace(global_batch_size=64, seq_len=4096, ep_from=("folded",), tp=(2, 4),
                                             pp=(1,)))
    folded = [p for p, *_ in res.top + res.pareto if p.ep_from == "folded"]
    assert folded and all(p.dp_shard == 1 for p in folded)
    assert any(p.ep > p.dp_replicate for p in folded)
    for p, step, *_ in res.top[:3]:
        assert predict(QWEN, p, H100).step_time_s == pytest.approx(step)


def test_emitters_say_folding():
    plan = _plan(dp_replicate=4, tp=2, ep=8, distributed_optimizer=True)
    meg = to_megatron_args(plan, QWEN)
    assert "--expert-model-parallel-size 8" in meg and "--expert-tensor-parallel-size 1" in meg
    assert "--use-distributed-optimizer" in meg and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in meg
    tt = to_torchtitan_python(plan, QWEN)
    assert "folded over dp_replicate x cp x tp" in tt and "expert_parallel_degree=1" in tt


def test_published_megatron_rows_with_ep_beyond_dp_are_folded():
    row = {"id": "r", "source": "megatron-bridge", "table": "t", "model": "qwen3-30b-a3b", "gpus": 16,
           "dp_replicate": 4, "dp_shard": 1, "tp": 4, "ep": 16, "ac": "full", "local_batch_size": 1,
           "micro_batch_size": 1, "global_batch_size": 64, "seq_len": 4096}
    _, plan = V.published_plan(row)
    assert plan.ep_from == "folded" and plan.ep == 16
    _, plan = V.published_plan({**row, "dp_replicate": 16, "tp": 1})
    assert plan.ep_from == "dp_replicate"
