"""Measured blocks: the local shape of a plan's blocks, the cost model using a block measured at that shape, the
profile keeping them, and the profiler measuring one."""

import dataclasses
import json

import numpy as np
import pytest

from parsim.blockshape import block_shape, plan_block_shapes
from parsim.codec import encode
from parsim.costmodel import predict
from parsim.costmodel.compute import measured_block_times
from parsim.costmodel.explain import explain
from parsim.errors import ParsimError
from parsim.hardware import HardwareProfile, load_profile
from parsim.plan import Plan
from parsim.spec import PRESETS, load_model


def test_local_shapes_follow_tp_ep_etp_and_refuse_what_one_block_cannot_stand_for():
    spec = PRESETS["llama3-8b"]
    s = plan_block_shapes(spec, Plan(dp_shard=4, tp=4, seq_len=4096, local_batch_size=2, compile=True))["dense"]
    assert (s.n_heads, s.n_kv_heads, s.d_ff, s.micro_batch, s.seq_len, s.compile) == (8, 2, 3584, 2, 4096, True)
    assert plan_block_shapes(spec, Plan(dp_shard=4, cp=2, seq_len=4096))["dense"] is None  # ring attention
    mix = PRESETS["mixtral-8x7b"]
    m = plan_block_shapes(mix, Plan(dp_shard=8, ep=4, seq_len=4096))["moe"]
    assert (m.n_experts, m.top_k, m.d_ff_expert) == (2, 2, 14336)
    # whole experts under TP: each TP rank routes 1/tp of the tokens (the executor's MoE._tp_forward); the keys of
    # blocks without the split are the keys measured before the field existed
    w = block_shape(mix, True, tp=2, ep=2, etp=1, micro_batch=1, seq_len=4096, cp=1, dtype="bfloat16",
                    compile=False, float8=False)
    assert (w.moe_token_div, w.n_experts, w.n_heads, w.d_ff_expert) == (2, 4, 16, 14336)
    assert "moe_token_div=2" in w.key and "moe_token_div" not in m.key
    assert block_shape(mix, True, tp=2, ep=2, etp=1, micro_batch=1, seq_len=4095, cp=1, dtype="bfloat16",
                       compile=False, float8=False) is None  # tokens the split would leave uneven
    assert block_shape(mix, True, tp=2, ep=1, etp=2, micro_batch=1, seq_len=4096, cp=1, dtype="bfloat16",
                       compile=False, float8=False).moe_token_div == 1  # TP-sharded experts see every token
    assert plan_block_shapes(PRESETS["deepseek-v3"], Plan(dp_shard=64, seq_len=4096))["dense"] is None  # MLA
    keys = {dataclasses.replace(s, **kw).key for kw in ({}, {"compile": False}, {"dtype": "float32"},
                                                         {"micro_batch": 1})}
    assert len(keys) == 4


def _with_block(hw: HardwareProfile, shape, fwd_s, bwd_s) -> HardwareProfile:
    return dataclasses.replace(hw, measured_blocks={shape.key: {"fwd_s": fwd_s, "bwd_s": bwd_s, "device": "test"}})


def test_the_cost_model_uses_a_measured_block_for_the_plans_of_its_shape_only():
    spec = load_model("tiny")
    hw = load_profile("cpu-gloo-2")
    p1 = Plan(dp_shard=2, seq_len=256, local_batch_size=2, param_dtype="float32")
    p2 = Plan(dp_shard=2, seq_len=256, local_batch_size=4, param_dtype="float32")  # another micro batch: shape
    shape = plan_block_shapes(spec, p1)["dense"]
    hw_b = _with_block(hw, shape, 0.5, 1.25)
    b = encode([p1, p2], hw.gpus_per_node)
    fwd, bwd, have = measured_block_times(spec, b, hw_b, moe=False)
    assert have.tolist() == [True, False] and fwd[0] == 0.5 and bwd[0] == 1.25
    assert measured_block_times(spec, b, hw, moe=False) is None
    before, after = predict(spec, p1, hw), predict(spec, p1, hw_b)
    scale = float(hw.corrections.get("compute_scale", 1.0))
    # forward + backward of every layer and microbatch are now 1.75 s x compute_scale, far above the curves
    layers_mb = spec.n_layers * p1.n_microbatches * p1.grad_accum_steps
    assert before.step_time_s < layers_mb * 1.75 * scale <= after.step_time_s
    assert predict(spec, p2, hw_b).step_time_s == predict(spec, p2, hw).step_time_s
    d = explain(spec, p1, hw_b)["layers"]["dense"]["block"]
    assert d["source"] == "measured block" and d["fwd_s"] == 0.5 and d["shape_key"] == shape.key
    assert explain(spec, p1, hw)["layers"]["dense"]["block"]["source"] == "curves"


def test_a_profile_keeps_its_measured_blocks_and_refuses_bad_ones():
    hw = load_profile("cpu-gloo-2")
    shape = plan_block_shapes(load_model("tiny"), Plan(dp_shard=2, seq_len=256))["dense"]
    hw_b = _with_block(hw, shape, 0.01, 0.02)
    again = HardwareProfile.from_dict(json.loads(json.dumps(hw_b.to_dict())))
    assert again.measured_blocks == hw_b.measured_blocks
    bad = dict(hw_b.to_dict(), measured_blocks={shape.key: {"fwd_s": -1.0, "bwd_s": 0.02}})
    with pytest.raises(ParsimError, match="measured_blocks"):
        HardwareProfile.from_dict(bad)


def test_the_profiler_measures_a_block_and_keeps_what_it_measured(tmp_path):
    pytest.importorskip("torch")
    from parsim.profiler.blocks import add_measured_blocks, measure_block

    spec = load_model("tiny")
    shapes = [plan_block_shapes(spec, Plan(dp_shard=2, seq_len=64, local_batch_size=mb,
                                           param_dtype="float32"))["dense"] for mb in (1, 2)]
    m = measure_block(shapes[0], reps=2, warmup=1)
    assert m["fwd_s"] > 0 and m["bwd_s"] > 0 and m["reps"] == 2 and m["torch"]
    assert m["chain"] == 1  # a CPU runs the kernels itself: one call per timing (a GPU: STEADY_CHAIN)
    hw = load_profile("cpu-gloo-2")
    out = tmp_path / "p.json"
    hw2, walls = add_measured_blocks(hw, shapes, out, reps=2)
    assert set(walls) == {s.key for s in shapes} and set(hw2.measured_blocks) == set(walls)
    stored = HardwareProfile.from_dict(json.loads(out.read_text()))
    hw3, walls3 = add_measured_blocks(stored, shapes, out, reps=2)  # resumable: nothing left to measure
    assert walls3 == {} and hw3.measured_blocks == hw2.measured_blocks
    assert np.isfinite([v["fwd_s"] for v in hw3.measured_blocks.values()]).all()


def test_profile_measure_shapes_of_a_plan_file_adds_them_to_the_profile(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    import parsim.profiler.blocks as blocks
    from parsim.cli.main import app

    monkeypatch.setattr(blocks, "measure_block", lambda shape, device=None, reps=5: {
        "fwd_s": 0.003, "bwd_s": 0.006, "wall_s": 0.1, "device": "fake"})
    monkeypatch.setattr(blocks, "measure_head", lambda shape, device=None, reps=5: {
        "emb_fwd_s": 1e-4, "emb_bwd_s": 2e-4, "out_fwd_s": 0.003, "out_bwd_s": 0.006, "wall_s": 0.1, "device": "fake"})
    plan = Plan(dp_shard=2, tp=2, seq_len=256, local_batch_size=2, param_dtype="float32")
    (tmp_path / "plans.json").write_text(json.dumps([{"model": "tiny", "plan": plan.to_dict()},
                                                     {"model": "tiny", "plan": dataclasses.replace(
                                                         plan, compile=True).to_dict()}]))
    prof = tmp_path / "mine.json"
    prof.write_text(json.dumps(load_profile("cpu-gloo-2").to_dict()))
    r = CliRunner().invoke(app, ["profile", "--out", str(prof), "--measure-shapes-of", str(tmp_path / "plans.json"),
                                 "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["shapes"] == res["measured_now"] == 3  # a block with and without compile; the ends (not compiled)
    hw = load_profile(str(prof))
    assert predict(load_model("tiny"), plan, hw).step_time_s != predict(load_model("tiny"), plan,
                                                                        load_profile("cpu-gloo-2")).step_time_s
    r = CliRunner().invoke(app, ["profile", "--out", "x"])
    assert r.exit_code == 2 and "--nproc-per-node is required" in r.output


def test_the_models_ends_have_a_shape_and_the_cost_model_uses_them_measured():
    """The embedding (first stage) and the norm + output + loss (last stage) at the plan's local shape: measured
    times replace the output GEMM and loss traffic of the curves and add the embedding's; plans of another shape
    keep the curves; the breakdown still sums to the step."""
    from parsim.blockshape import plan_head_shape, plan_measured_shapes

    spec = load_model("tiny")
    hw = load_profile("cpu-gloo-2")
    p1 = Plan(dp_shard=2, seq_len=256, local_batch_size=2, param_dtype="float32")
    h = plan_head_shape(spec, p1)
    assert (h.vocab, h.micro_batch, h.seq_len, h.fused_loss) == (spec.vocab_size, 2, 256, False)
    assert plan_head_shape(spec, dataclasses.replace(p1, tp=2, dp_shard=1)).vocab == -(-spec.vocab_size // 2)
    assert plan_head_shape(spec, Plan(dp_shard=2, cp=2, seq_len=256)) is None
    assert plan_measured_shapes(spec, p1)[-1] == h and h.key.startswith("head|")
    scale = float(hw.corrections.get("compute_scale", 1.0))
    ends = {"emb_fwd_s": 1e-3, "emb_bwd_s": 2e-3, "out_fwd_s": 3e-3, "out_bwd_s": 4e-3, "device": "test"}
    a = predict(spec, p1, dataclasses.replace(hw, measured_blocks={h.key: ends}))
    b = predict(spec, p1, dataclasses.replace(hw, measured_blocks={h.key: {k: (2 * v if k.endswith("_s") else v)
                                                                          for k, v in ends.items()}}))
    mb = p1.n_microbatches * p1.grad_accum_steps
    assert b.time_breakdown_s["compute_forward"] - a.time_breakdown_s["compute_forward"] == pytest.approx(
        mb * (1e-3 + 3e-3) * scale)
    assert b.time_breakdown_s["compute_backward"] - a.time_breakdown_s["compute_backward"] == pytest.approx(
        mb * (2e-3 + 4e-3) * scale)
    for p in (a, b):
        assert sum(p.time_breakdown_s.values()) == pytest.approx(p.step_time_s)
    other = Plan(dp_shard=2, seq_len=256, local_batch_size=4, param_dtype="float32")  # another micro batch
    assert predict(spec, other, dataclasses.replace(hw, measured_blocks={h.key: ends})).step_time_s == \
        predict(spec, other, hw).step_time_s
    e = explain(spec, p1, dataclasses.replace(hw, measured_blocks={h.key: ends}))["ends"]
    assert e["source"] == "measured ends" and e["out_fwd_s"] == 3e-3
    assert explain(spec, p1, hw)["ends"]["source"].startswith("curves")
    with pytest.raises(ParsimError, match="measured_blocks"):
        HardwareProfile.from_dict(dict(hw.to_dict(), measured_blocks={h.key: {"fwd_s": 1.0, "bwd_s": 1.0}}))


def test_the_profiler_measures_the_models_ends():
    pytest.importorskip("torch")
    from parsim.blockshape import plan_head_shape
    from parsim.profiler.blocks import measure_head

    spec = load_model("tiny")
    for fused in (False, True):
        h = plan_head_shape(spec, Plan(dp_shard=2, seq_len=64, local_batch_size=2, param_dtype="float32",
                                       fused_loss=fused))
        m = measure_head(h, reps=2, warmup=1)
        assert all(m[k] > 0 for k in ("emb_fwd_s", "emb_bwd_s", "out_fwd_s", "out_bwd_s")) and m["torch"]


def _layer_seconds(hw: HardwareProfile, tokens: int) -> tuple[float, float]:
    from parsim.costmodel.compute import block_overheads, layer_costs
    from parsim.costmodel.layers import Shapes

    spec = load_model("llama3-8b")
    b = encode([Plan(seq_len=min(tokens, 2048), local_batch_size=max(1, tokens // 2048), param_dtype="bfloat16")],
               hw.gpus_per_node)
    c = layer_costs(spec, b, Shapes(spec, b), hw, False, overheads=block_overheads(hw))  # as step.py calls it
    return float(c.fwd[0]), float(c.bwd[0])


def test_an_asynchronous_device_hides_the_hosts_issue_time_under_the_kernels():
    """A GPU profile's block sample with the host's issue time: a layer costs max(kernels, host), forward and
    backward apart — the host time where the kernels are shorter, the kernels alone where they are longer (not
    their sum, as a CPU's measured overhead adds)."""
    from parsim.costmodel.compute import block_overheads, host_issue_times

    gpu = dataclasses.replace(load_profile("h100-measured"), measured_blocks={})
    host_f, host_b = host_issue_times(gpu)
    assert host_f > 0 and host_b > 0 and block_overheads(gpu) == (0.0, 0.0)
    block = {k: v for k, v in gpu.samples["block"].items() if not k.startswith("host_")}
    kernels = dataclasses.replace(gpu, samples={**gpu.samples, "block": {**block, "time_fwd_s": 0.0,
                                                                         "time_fwd_bwd_s": 0.0}})
    assert host_issue_times(kernels) is None and block_overheads(kernels) == (0.0, 0.0)
    small_k, large_k = _layer_seconds(kernels, 256), _layer_seconds(kernels, 16384)
    assert small_k[0] < host_f and small_k[1] < host_b and large_k[0] > host_f and large_k[1] > host_b
    assert _layer_seconds(gpu, 256) == pytest.approx((host_f, host_b))
    assert _layer_seconds(gpu, 16384) == pytest.approx(large_k)
    # the same sample read as a CPU's (no host times): its wall time minus the model's is added at every size
    additive = dataclasses.replace(gpu, samples={**gpu.samples, "block": block})
    ov_f, ov_b = block_overheads(additive)
    assert ov_f > 0
    assert _layer_seconds(additive, 16384)[0] == pytest.approx(large_k[0] + ov_f)


def test_float8_linears_run_torchaos_tensorwise_products_and_skip_what_torchtitan_skips():
    """``executor.float8`` (what a float8 block is measured with): the forward and both backward products equal
    the products of the float8 values (e4m3 input and weight, e5m2 output gradient, one scale each); the output
    projection, a router and a linear whose widths are not multiples of 16 stay bf16."""
    torch = pytest.importorskip("torch")
    from parsim.executor.float8 import E4M3, E5M2, _cast, convert_to_float8
    from parsim.executor.model import Block

    def dequant(t, dtype):
        q, inv_scale = _cast(t, dtype)
        return q.float() * inv_scale

    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 64, bias=False)
    (name,) = convert_to_float8(torch.nn.ModuleDict({"w1": lin}))
    assert name == "w1" and type(lin).__name__ == "Float8Linear"
    x = torch.randn(32, 48, requires_grad=True)
    y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = lin.weight.detach()
    xq, wq, gq = dequant(x.detach(), E4M3), dequant(w, E4M3), dequant(dy, E5M2)
    torch.testing.assert_close(y, xq @ wq.t())
    torch.testing.assert_close(x.grad, gq @ wq)
    torch.testing.assert_close(lin.weight.grad, gq.t() @ xq)
    assert 0.01 < float((x.grad - dy @ w).norm() / (dy @ w).norm()) < 0.2  # e5m2 gradients: ~6% off bf16

    blk = Block(load_model("tiny-moe"), 1)
    swapped = convert_to_float8(blk)
    assert "attention.wq" in swapped and not any("router" in n for n in swapped)
    odd = torch.nn.ModuleDict({"output": torch.nn.Linear(64, 64), "w2": torch.nn.Linear(64, 40)})
    assert convert_to_float8(odd) == []


def test_a_float8_block_measured_before_its_linears_were_converted_is_measured_again():
    """A float8 block without the recipe it ran (``float8_recipe``) was a bf16 block under a float8 key (the
    profiler converted nothing before ``executor.float8``): not current, so ``add_measured_blocks`` measures it
    again on a GPU; bf16 blocks are current as they are. No committed profile holds such a block."""
    pytest.importorskip("torch")
    from pathlib import Path

    from parsim.profiler.blocks import FLOAT8_RECIPE, is_current

    shape = plan_block_shapes(PRESETS["llama3-8b"], Plan(dp_shard=8, seq_len=4096, float8=True,
                                                         compile=True))["dense"]
    assert not is_current({"fwd_s": 1e-3, "bwd_s": 2e-3}, shape)
    assert is_current({"fwd_s": 1e-3, "bwd_s": 2e-3, "float8_recipe": FLOAT8_RECIPE}, shape)
    assert is_current({"fwd_s": 1e-3, "bwd_s": 2e-3}, dataclasses.replace(shape, float8=False))
    for path in sorted((Path(__file__).resolve().parent.parent / "profiles").glob("*.json")):
        blocks = json.loads(path.read_text()).get("measured_blocks") or {}
        stale = [k for k, v in blocks.items() if "float8=1" in k and v.get("float8_recipe") != FLOAT8_RECIPE]
        assert not stale, (path.name, stale)


def test_the_executor_runs_float8_on_cuda_without_tp_only():
    """float8 plans are refused on CPU (no float8 GEMMs to measure), under TP (the float8 linears take plain
    weights, not TP's DTensors) and with the rowwise recipes; on CUDA without TP the executor converts the blocks'
    linears (``executor.float8``), as the GPU acceptance's float8 runs do."""
    pytest.importorskip("torch")
    from parsim.executor.parallelize import check_executable

    plan = Plan(dp_shard=2, float8=True, compile=True)
    with pytest.raises(ParsimError, match="scaled matmul"):
        check_executable(plan)
    check_executable(plan, device_type="cuda")
    for other in (dataclasses.replace(plan, dp_shard=1, tp=2), dataclasses.replace(plan, float8_recipe="rowwise")):
        with pytest.raises(ParsimError, match="scaled matmul"):
            check_executable(other, device_type="cuda")


def test_the_profiler_measures_a_moe_block_on_its_ranks_share_of_the_tokens():
    """EP with whole experts under TP: the routed experts run on T / tp tokens, attention on all T; the block's
    forward FLOPs (the stand-in budget's measure) count the router and routed experts on the share only."""
    pytest.importorskip("torch")
    from parsim.profiler.blocks import measure_block
    from parsim.remeasure import block_forward_flops

    spec = load_model("tiny-moe")
    plan = Plan(dp_shard=1, tp=2, ep=2, etp=1, seq_len=64, local_batch_size=2, param_dtype="float32")
    shape = plan_block_shapes(spec, plan)["moe"]
    assert shape is not None and shape.moe_token_div == 2
    whole = dataclasses.replace(shape, moe_token_div=1)
    tokens = shape.micro_batch * shape.seq_len
    routed_flops = 2 * tokens * shape.d_model * (3 * shape.top_k * shape.d_ff_expert + shape.n_experts)
    assert block_forward_flops(whole) - block_forward_flops(shape) == pytest.approx(routed_flops / 2)
    m = measure_block(shape, reps=2, warmup=1)
    assert m["fwd_s"] > 0 and m["bwd_s"] > 0
    with pytest.raises(ValueError, match="moe_token_div"):
        dataclasses.replace(plan_block_shapes(load_model("tiny"), Plan(seq_len=64))["dense"], moe_token_div=2)
