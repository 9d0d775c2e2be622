"""``search --measure K``: stand-in blocks (parsim.remeasure), the re-ranking, and the CLI end to end on tiny."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from parsim.blockshape import HeadShape, plan_block_shapes, plan_head_shape, plan_measured_shapes
from parsim.cli.main import app
from parsim.costmodel import predict
from parsim.costmodel.blocktime import composed_block_times, composed_head_times
from parsim.hardware import load_profile
from parsim.plan import Plan
from parsim.remeasure import (
    block_forward_flops,
    candidates,
    head_forward_flops,
    head_stand_in,
    measure_and_rerank,
    stand_in,
    with_stand_ins,
)
from parsim.search import SearchResult
from parsim.spec import load_model

runner = CliRunner()


def _shape(model="llama3-8b", **kw):
    plan = Plan(**{"seq_len": 4096, "local_batch_size": 1, "micro_batch_size": 1, **kw})
    return plan_block_shapes(load_model(model), plan)


def test_a_shape_within_the_budget_is_measured_as_it_is():
    shape = _shape(tp=8)["dense"]
    s = stand_in(shape, budget_flops=block_forward_flops(shape))
    assert s.exact and s.measured == shape and s.describe() == "measured"


def test_stand_ins_shrink_widths_with_heads_then_widths_then_sequence_to_the_budget():
    full = _shape()["dense"]  # 32 heads, 8 kv heads, d 4096, d_ff 14336
    s = stand_in(full, budget_flops=2e9)
    m = s.measured
    assert block_forward_flops(m) <= 2e9 < block_forward_flops(full)
    assert (s.width_div, s.heads_div) == (full.d_model // m.d_model, full.n_kv_heads // m.n_kv_heads)
    assert m.n_heads * s.heads_div == full.n_heads and m.d_ff * s.width_div == full.d_ff
    assert m.head_dim == full.head_dim and m.micro_batch == full.micro_batch and m.dtype == full.dtype
    assert s.heads_div == 8  # kv heads exhausted: 1 left
    tp8 = stand_in(_shape(tp=8)["dense"], budget_flops=2e9)  # 1 kv head per rank: no head division at all
    assert tp8.heads_div == 1 and tp8.width_div > 1 and tp8.measured.n_heads == 4
    tight = stand_in(full, budget_flops=1.0)  # at the floors: d_model 64, 128 tokens
    assert tight.measured.d_model == 64 and tight.measured.seq_len == 128 and tight.seq_div == 32
    moe = stand_in(_shape("tiny-moe", seq_len=256)["moe"], budget_flops=1e6)
    assert moe.measured.d_ff_expert * moe.width_div == moe.full.d_ff_expert
    assert moe.measured.n_experts == moe.full.n_experts


def test_a_stand_in_scales_the_full_shapes_composed_time_by_its_measured_ratio():
    hw = load_profile("cpu-gloo-2")
    full = _shape()["dense"]
    s = stand_in(full, budget_flops=2e9)
    small_f, small_b = composed_block_times(s.measured, hw)
    full_f, full_b = composed_block_times(full, hw)
    measured = {s.measured.key: {"fwd_s": 3.0 * small_f, "bwd_s": 0.5 * small_b}}
    hw2 = with_stand_ins(dataclasses.replace(hw, measured_blocks=measured), {full.key: s})
    got = hw2.measured_blocks[full.key]
    assert got["fwd_s"] == pytest.approx(3.0 * full_f) and got["bwd_s"] == pytest.approx(0.5 * full_b)
    assert got["stand_in_key"] == s.measured.key and got["width_div"] == s.width_div
    # a stand-in that measures what the curves say changes no prediction (the one-layer model composes within 1e-5)
    same = {s.measured.key: {"fwd_s": small_f, "bwd_s": small_b}}
    hw3 = with_stand_ins(dataclasses.replace(hw, measured_blocks=same), {full.key: s})
    plan = Plan(dp_shard=8, seq_len=4096, local_batch_size=1, micro_batch_size=1)
    spec = load_model("llama3-8b")
    assert predict(spec, plan, hw3).step_time_s == pytest.approx(predict(spec, plan, hw).step_time_s, rel=1e-4)


def test_rerank_orders_by_measured_time_and_keeps_both_ranks():
    spec, hw = load_model("tiny"), load_profile("cpu-gloo-2")
    a = Plan(dp_shard=2, seq_len=256, local_batch_size=2, micro_batch_size=2)
    b = Plan(tp=2, seq_len=256, local_batch_size=4, micro_batch_size=4)
    res = SearchResult()
    res.top = [(a, predict(spec, a, hw).step_time_s, 0, 0, 0, 0), (b, predict(spec, b, hw).step_time_s, 0, 0, 0, 0)]
    res.pareto = [(a, 0.0, 0.0)]
    assert [p.plan_id for p, _ in candidates(res, 2)] == [a.plan_id, b.plan_id]  # the Pareto plan once

    def slow_dense_of_a(hw_, shapes):  # a's block 10x its curves, b's as the curves say: b must move up
        blocks = {}
        for s in shapes:
            if isinstance(s, HeadShape):  # the ends as the curves say (the embedding as its traffic)
                blocks[s.key] = {f"{k}_s": v for k, v in composed_head_times(s, hw_).items()}
                continue
            f, bw = composed_block_times(s, hw_)
            k = 10.0 if s == plan_block_shapes(spec, a)["dense"] else 1.0
            blocks[s.key] = {"fwd_s": k * f, "bwd_s": k * bw}
        return dataclasses.replace(hw_, measured_blocks=blocks), {s.key: 0.1 for s in shapes}

    out = measure_and_rerank(spec, hw, res, 2, budget_flops=float("inf"), measure_missing=slow_dense_of_a)
    rows = out["rows"]
    assert [r["plan_id"] for r in rows] == [b.plan_id, a.plan_id]
    assert {r["plan_id"]: (r["curves_rank"], r["measured_rank"]) for r in rows}[a.plan_id][1] == 2
    assert all(r["blocks"] == r["ends"] == "measured" for r in rows)
    assert out["measured_now"] == 4 and out["stand_ins"] == 0  # two blocks, two ends (tp 1 and tp 2 vocab rows)


@pytest.mark.slow
def test_cli_search_measure_times_blocks_and_reranks(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from conftest import as_measured_here

    monkeypatch.setenv("PARSIM_PROFILES_DIR", str(tmp_path / "profiles"))
    # as if measured here by the current profiler (else --measure would profile this machine first)
    prof = as_measured_here(json.loads(open("profiles/cpu-gloo-2.json").read()))
    (tmp_path / "here.json").write_text(json.dumps(prof))
    args = ["search", "--model", "tiny", "--gpus", "4", "--global-batch-size", "8", "--seq-len", "128", "--no-cp",
            "--profile", str(tmp_path / "here.json"), "--top", "3", "--measure", "3", "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)["measured"]
    assert m["measured_now"] == m["shapes"] > 0 and m["device"] == "cpu"
    ranks = [r_["measured_rank"] for r_ in m["rows"] if r_["measured_rank"]]
    assert ranks == list(range(1, len(m["rows"]) + 1))  # --no-cp on tiny: every block measurable
    assert all(r_["measured_step_s"] > 0 and r_["ends"] == "measured" for r_ in m["rows"])
    again = json.loads(runner.invoke(app, args).stdout)["measured"]  # the cache: nothing measured twice
    assert again["measured_now"] == 0 and [x["plan_id"] for x in again["rows"]] == [x["plan_id"] for x in m["rows"]]


def test_measure_refuses_a_profile_of_another_device():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU an H100 profile may describe this device")
    r = runner.invoke(app, ["search", "--model", "tiny", "--gpus", "2", "--profile", "h100-sxm-spec", "--measure",
                            "2"])
    assert r.exit_code == 2 and "describes" in r.output


def test_validate_component_differences_sum_to_the_two_predictions():
    """``validate --measure-blocks`` reports per component curves beside measured blocks: a plan's differences sum
    to the difference of its two predicted steps, and 'unexplained' is what the measured step leaves."""
    from parsim import validate as V

    spec, hw = load_model("tiny"), load_profile("cpu-gloo-2")
    plan = Plan(dp_shard=2, seq_len=256, local_batch_size=2, micro_batch_size=2)
    shape = plan_block_shapes(spec, plan)["dense"]
    f, b = composed_block_times(shape, hw)
    hw_b = dataclasses.replace(hw, measured_blocks={shape.key: {"fwd_s": 2 * f, "bwd_s": 2 * b}})
    kw = dict(tier="measured", source="cpu-gloo-2", table="validate", confidence="high")
    rc, rb = V._predicted(spec, plan, hw, **kw), V._predicted(spec, plan, hw_b, **kw)
    rc["measured_step_s"] = rb["measured_step_s"] = 1.5 * rb["predicted_step_s"]
    diffs = V.component_differences([rc], [rb])
    parts = [d for d in diffs if d["component"] != "unexplained"]
    assert sum(d["blocks_minus_curves_s"] for d in parts) == pytest.approx(rb["predicted_step_s"]
                                                                           - rc["predicted_step_s"])
    assert sum(d["blocks_s"] for d in parts) == pytest.approx(rb["predicted_step_s"])
    (left,) = [d for d in diffs if d["component"] == "unexplained"]
    assert left["blocks_s"] == pytest.approx(0.5 * rb["predicted_step_s"])
    assert any(d["blocks_minus_curves_s"] > 0 for d in parts)  # the slower measured block shows in a component


def test_the_ends_stand_in_shrinks_vocabulary_then_width_then_sequence_and_scales_by_the_ratio():
    spec, hw = load_model("llama3-8b"), load_profile("cpu-gloo-2")
    full = plan_head_shape(spec, Plan(seq_len=4096, local_batch_size=1, micro_batch_size=1))
    assert head_stand_in(full, head_forward_flops(full)).exact
    s = head_stand_in(full, budget_flops=2e10)
    m = s.measured
    assert head_forward_flops(m) <= 2e10 < head_forward_flops(full)
    assert (m.vocab, m.d_model, m.seq_len) == (full.vocab // 64, full.d_model // 4, full.seq_len)  # vocab first
    assert s.describe() == "w/4 v/64"
    small, big = composed_head_times(m, hw), composed_head_times(full, hw)
    measured = {m.key: {"emb_fwd_s": 2.0 * small["emb_fwd"], "emb_bwd_s": small["emb_bwd"],
                        "out_fwd_s": 3.0 * small["out_fwd"], "out_bwd_s": small["out_bwd"]}}
    got = with_stand_ins(dataclasses.replace(hw, measured_blocks=measured), {full.key: s}).measured_blocks[full.key]
    assert got["emb_fwd_s"] == pytest.approx(2.0 * big["emb_fwd"]) and got["out_fwd_s"] == pytest.approx(
        3.0 * big["out_fwd"])
    assert got["out_bwd_s"] == pytest.approx(big["out_bwd"]) and got["stand_in_key"] == m.key


def test_the_curves_column_ignores_blocks_the_given_profile_already_had():
    """A profile given with blocks measured before (a second --measure, the GPU acceptance profile): its "curves"
    times are the curves', not the measured blocks' again (both columns were equal on the H100 profile)."""
    spec, hw = load_model("tiny"), load_profile("cpu-gloo-2")
    a = Plan(dp_shard=2, seq_len=256, local_batch_size=2, micro_batch_size=2)
    res = SearchResult()
    res.top = [(a, predict(spec, a, hw).step_time_s, 0, 0, 0, 0)]
    res.pareto = []

    def doubled(hw_, shapes):  # every block and end twice the curves
        blocks = {}
        for s in shapes:
            t = composed_head_times(s, hw_) if isinstance(s, HeadShape) else \
                dict(zip(("fwd", "bwd"), composed_block_times(s, hw_), strict=True))
            blocks[s.key] = {f"{k}_s": 2.0 * v for k, v in t.items()}
        return dataclasses.replace(hw_, measured_blocks=blocks), {s.key: 0.1 for s in shapes}

    first = measure_and_rerank(spec, hw, res, 1, float("inf"), doubled)["rows"][0]
    shapes = [s for s in plan_measured_shapes(spec, a) if s is not None]
    pre = dataclasses.replace(hw, measured_blocks=doubled(hw, shapes)[0].measured_blocks)
    again = measure_and_rerank(spec, pre, res, 1, float("inf"), lambda h, s: (h, {}))["rows"][0]
    assert first["measured_step_s"] > 1.2 * first["curves_step_s"]
    assert again["curves_step_s"] == pytest.approx(first["curves_step_s"])
    assert again["measured_step_s"] == pytest.approx(first["measured_step_s"])


def test_measure_top_on_a_gpu_records_no_budget_as_null(monkeypatch, tmp_path):
    """On CUDA the block budget is unlimited: the record says None, since JSON has no infinity (the first H100 run's
    `search --measure --json` failed on it)."""
    torch = pytest.importorskip("torch")
    import parsim.remeasure as rm
    from parsim.search_job import measure_top

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PARSIM_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(rm, "measure_and_rerank", lambda spec, hw, res, k, budget, fn: {"rows": [], "budget": budget})
    spec, hw = load_model("tiny"), load_profile("cpu-gloo-2")
    out = measure_top(spec, hw, SearchResult(), 1, None)
    assert out["budget"] == float("inf") and out["budget_flops"] is None and out["device"] == "cuda"
    json.dumps({k: v for k, v in out.items() if k != "budget"}, allow_nan=False)
