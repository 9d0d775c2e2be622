"""The GPU-scale options of the cost model (#11): distributed optimizer, async TP, float8 recipes, attention by
keys, compute/communication interference, hardware variants and what the published tier reads from a row."""

import dataclasses
import math

import numpy as np
import pytest

from parsim import validate as V
from parsim.codec import encode
from parsim.costmodel import predict
from parsim.hardware import load_profile
from parsim.plan import Plan
from parsim.spec import PRESETS

H100 = load_profile("h100-sxm-spec")
L8, L70 = PRESETS["llama3-8b"], PRESETS["llama3-70b"]


def _ddp(**kw):
    return Plan(dp_replicate=8, tp=2, seq_len=4096, local_batch_size=1, **kw)


def test_plan_ids_of_earlier_plans_do_not_change():
    # options added later are left out of the id at their default: measurements keyed by earlier ids stay valid
    assert Plan(seq_len=2048).plan_id == "0980d2b4b049"  # the default plan when seq_len defaulted to 2048
    assert Plan(async_tp=True, tp=2).plan_id != Plan(tp=2).plan_id


def test_distributed_optimizer_shards_optimizer_state_and_swaps_all_reduce_for_rs_ag():
    base, dist = predict(L8, _ddp(), H100), predict(L8, _ddp(distributed_optimizer=True), H100)
    mb, md = base.memory_breakdown_bytes, dist.memory_breakdown_bytes
    assert md["optimizer_states"] == pytest.approx(mb["optimizer_states"] / 8, rel=1e-9)
    assert dist.peak_memory_bytes < base.peak_memory_bytes
    assert "all_reduce/dp_replicate" in base.comm_bytes and "all_reduce/dp_replicate" not in dist.comm_bytes
    # reduce-scatter input = the all-reduce's input; the all-gather moves the param_dtype shard (bf16: half of fp32)
    assert dist.comm_bytes["reduce_scatter/dp_replicate"] == pytest.approx(base.comm_bytes["all_reduce/dp_replicate"])
    assert dist.comm_bytes["all_gather/dp_replicate"] == pytest.approx(
        base.comm_bytes["all_reduce/dp_replicate"] / 8 / 2, rel=1e-6)
    assert dist.time_breakdown_s["optimizer"] == pytest.approx(base.time_breakdown_s["optimizer"] / 8, rel=1e-9)


def test_async_tp_hides_tp_collectives_behind_gemms_and_pays_interference():
    plan = dict(dp_shard=8, tp=8, seq_len=8192, local_batch_size=2, ac="selective-op", compile=True)
    van, asy = predict(L8, Plan(**plan), H100), predict(L8, Plan(**plan, async_tp=True), H100)
    assert asy.time_breakdown_s["comm_tp"] < 0.5 * van.time_breakdown_s["comm_tp"]
    assert asy.comm_bytes == van.comm_bytes  # the same collectives, only their exposure changes
    assert asy.time_breakdown_s["comm_interference"] > van.time_breakdown_s.get("comm_interference", 0.0)
    assert asy.step_time_s < van.step_time_s
    no_k = dataclasses.replace(H100, corrections={})
    assert "comm_interference" not in predict(L8, Plan(**plan, async_tp=True), no_k).time_breakdown_s


def test_float8_recipes_order_rowwise_slower_and_bf16_weight_gradients_slower_still():
    kw = dict(dp_shard=8, seq_len=8192, local_batch_size=2, float8=True)
    t = {r: predict(L70, Plan(**kw, float8_recipe=r, dp_replicate=1), H100).step_time_s
         for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    bf16 = predict(L70, Plan(**{**kw, "float8": False}), H100).step_time_s
    assert t["tensorwise"] < t["rowwise"] < t["rowwise_with_gw_hp"] < bf16


def test_attention_efficiency_follows_keys_per_kernel():
    hw = H100.attention_keys_efficiency
    assert hw is not None and hw(512) < hw(4096) < hw(65536) <= hw.eff_max
    # FA2 fwd+bwd causal hd128 on H100 (public figures): 163 TFLOP/s at 512 keys, 294 at 4k, 328 at 16k
    for keys, tflops in ((512, 163), (4096, 294), (16384, 328)):
        assert hw(keys) * 989 == pytest.approx(tflops, rel=0.05)


NOTES = {
    "asynctp; seq_len inferred": True, "float8 + asynctp": True, "vanilla TP (async TP off)": False,
    "no float8, no async TP": False, "float8 tensorwise; async TP": True, "bfloat16": False,
}


@pytest.mark.parametrize("note,expected", NOTES.items())
def test_published_notes_say_async_tp(note, expected):
    assert V.note_options({"notes": note}, {"tp": 8, "dp_replicate": 1, "dp_shard": 8})["async_tp"] is expected


def test_megatron_rows_overlap_tp_communication_unless_said_otherwise():
    """Megatron-Bridge / NeMo performance recipes run tp_comm_overlap (userbuffers) where TP > 1."""
    deg = {"tp": 4, "dp_replicate": 2, "dp_shard": 1}
    row = {"source": "megatron-bridge", "table": "x", "notes": "FP8"}
    assert V.note_options(row, deg)["async_tp"]
    assert not V.note_options(row, {**deg, "tp": 1})["async_tp"]
    assert not V.note_options({**row, "notes": "FP8; TP comm overlap off"}, deg)["async_tp"]
    assert not V.note_options({**row, "source": "torchtitan"}, deg)["async_tp"]


def test_published_notes_say_recipe_and_distributed_optimizer():
    deg = {"tp": 1, "dp_replicate": 8, "dp_shard": 1}
    assert V.note_options({"notes": "float8 rowwise"}, deg)["float8_recipe"] == "rowwise"
    assert V.note_options({"notes": "recipe rowwise_with_gw_hp"}, deg)["float8_recipe"] == "rowwise_with_gw_hp"
    assert V.note_options({"notes": "FP8"}, deg)["float8_recipe"] == "tensorwise"
    assert V.note_options({"notes": "Megatron distributed-optimizer state sharding"}, deg)["distributed_optimizer"]
    assert V.note_options({"notes": "optimizer-state sharding not stated"}, deg)["distributed_optimizer"]
    assert not V.note_options({"notes": "optimizer-state sharding"}, {**deg, "dp_shard": 8})["distributed_optimizer"]


def test_hardware_variant_profile_from_the_hardware_column():
    row = {"profile": "h100-sxm-spec", "hardware": "H100 96GB HBM2e (2.4 TB/s), 500 W power limit (Grand Teton)"}
    assert V.profile_of(row) == "h100-hbm2e-500w-spec"
    assert V.profile_of({"profile": "h100-sxm-spec", "hardware": "DGX H100: H100 SXM 80GB (700 W)"}) == "h100-sxm-spec"
    var = load_profile("h100-hbm2e-500w-spec")
    assert var.peak("bfloat16") == H100.peak("bfloat16")  # MFU stays against the SXM peak, as the sources state it
    assert var.gemm_efficiency.eff_max == pytest.approx(H100.gemm_efficiency.eff_max * 585 / 794.5)
    assert var.memory_bandwidth_bytes_per_s == pytest.approx(2.4e12)
    assert math.isclose(var.memory_bytes, 96 * 2**30)


def test_megatron_batch_words_mean_gradient_accumulation_without_pp():
    from parsim.flags import plan_from_given

    p = plan_from_given({"model": "llama3-8b", "gpus": 8, "local_batch_size": 8, "micro_batch_size": 2})
    assert (p.local_batch_size, p.micro_batch_size, p.global_batch_size, p.grad_accum_steps) == (2, 2, 64, 4)
    # with PP the micro batch splits the local batch into pipeline microbatches, one optimizer step
    q = plan_from_given({"model": "llama3-8b", "gpus": 8, "pp": 2, "local_batch_size": 8, "micro_batch_size": 2})
    assert (q.local_batch_size, q.micro_batch_size, q.n_microbatches, q.grad_accum_steps) == (8, 2, 4, 1)
    with pytest.raises(Exception, match="not a multiple of micro batch 3"):
        plan_from_given({"model": "llama3-8b", "gpus": 8, "local_batch_size": 8, "micro_batch_size": 3})


def test_ddp_style_ep_is_picked_when_only_it_is_valid():
    from parsim.flags import plan_from_given

    p = plan_from_given({"model": "qwen3-30b-a3b", "gpus": 64, "dp_replicate": 16, "tp": 4, "ep": 8})
    assert p.ep_from == "dp_replicate" and p.dp_shard == 1
    q = plan_from_given({"model": "qwen3-30b-a3b", "gpus": 64, "dp_shard": 16, "tp": 4, "ep": 8})
    assert q.ep_from == "dp_shard"


def test_te_layers_keep_what_megatron_core_keeps():
    """Megatron-Core's TE layers, float8, SP, no AC, per layer and microbatch (derived in layers.saved_tensors):
    norm inputs (bf16) and 1/rms (fp32) of the local shard, the norm outputs' local float8 shards, q/k/v,
    attention output (bf16) and its float8 copy, logsumexp, fc1's two halves (bf16) and fc2's float8 input."""
    from parsim.codec import encode
    from parsim.costmodel.layers import Shapes, activation_bytes

    spec = PRESETS["llama3-70b"]
    plan = Plan(pp=2, dp_replicate=2, tp=4, seq_len=8192, local_batch_size=2, micro_batch_size=1, float8=True,
                te_layers=True)
    b = encode([plan], 8)
    got = float(activation_bytes(spec, Shapes(spec, b), False)["none"][0])
    T, t, d, ff, h = 8192.0, 4.0, spec.d_model, spec.d_ff, spec.n_heads
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    attn = T * d / t * 2 + T / t * 4 + T * d / t * 1 + T * (q + 2 * kv) / t * 2 + T * q / t * (2 + 1) + T * h / t * 4
    mlp = T * d / t * 2 + T / t * 4 + T * d / t * 1 + T * ff / t * (2 + 2 + 1)
    assert got == pytest.approx(attn + mlp, rel=1e-12)
    torch_layers = float(activation_bytes(spec, Shapes(spec, encode([dataclasses.replace(plan, te_layers=False)],
                                                                     8)), False)["none"][0])
    assert got < 0.6 * torch_layers


def test_published_rows_carry_their_framework():
    megatron = {"te_layers": True, "grad_sync": "once"}
    assert V.framework_options({"source": "megatron-bridge", "table": "x"}) == megatron
    assert V.framework_options({"source": "nemo-24.07", "table": "x"}) == megatron
    assert V.framework_options({"source": "llm-foundry", "table": "x"}) == {"fused_loss": True,
                                                                        "attention_kernel": "triton"}
    assert V.framework_options({"source": "torchtitan", "table": "x"}) == {}
    spec, plan = V.published_plan({"id": "r", "source": "megatron-bridge", "model": "llama3-8b", "gpus": 8,
                                   "dp_replicate": 2, "dp_shard": 1, "tp": 4, "ac": "none", "local_batch_size": 4,
                                   "micro_batch_size": 1, "global_batch_size": 8, "seq_len": 4096, "float8": 1})
    assert plan.te_layers and not plan.fused_loss


def test_triton_attention_kernel_runs_at_flashattention2s_time_times_the_published_ratio():
    # llm-foundry's tables ran the Triton FlashAttention kernel (attn_impl triton); FA2 is 1.3-2.5x faster than it
    # (arXiv 2307.08691): the attention item's time x TRITON_ATTENTION_SLOWDOWN, nothing else changes
    from parsim.costmodel.compute import TRITON_ATTENTION_SLOWDOWN, layer_compute_items
    from parsim.costmodel.layers import Shapes

    spec = PRESETS["llama3-8b"]
    hw = load_profile("a100-sxm-80gb-spec")
    plans = [Plan(dp_shard=8, seq_len=8192), Plan(dp_shard=8, seq_len=8192, attention_kernel="triton")]
    b = encode(plans, 8)
    items = {i.name: i for i in layer_compute_items(spec, b, Shapes(spec, b), hw, False)}
    att = items["attention (causal)"].seconds
    assert att[1] == pytest.approx(att[0] * TRITON_ATTENTION_SLOWDOWN)
    assert all(np.allclose(i.seconds[0], i.seconds[1]) for n, i in items.items() if n != "attention (causal)")
    slow, fast = (predict(spec, p, hw).step_time_s for p in plans[::-1])
    assert slow > fast
    # a calibrated profile's triton factor scales that kernel's time only (the FA2 plan keeps its time)
    from parsim.calibrate import PARAMETERS, apply

    cal = apply(hw, {"triton_attention": 0.8})
    att_cal = {i.name: i for i in layer_compute_items(spec, b, Shapes(spec, b), cal, False)}[
        "attention (causal)"].seconds
    assert att_cal[0] == pytest.approx(att[0])
    assert att_cal[1] == pytest.approx(att[0] * TRITON_ATTENTION_SLOWDOWN * 0.8)
    lo, hi = PARAMETERS["triton_attention"][1:]
    assert lo * TRITON_ATTENTION_SLOWDOWN == pytest.approx(1.3) and hi * TRITON_ATTENTION_SLOWDOWN == pytest.approx(2.5)


def test_interleaved_rows_without_a_virtual_stage_count_are_predicted_with_the_frameworks_default():
    """A published row that names Interleaved1F1B but not its stages per rank: torchtitan's default (2), or for
    Megatron-family sources about 2 layers per virtual stage; a warning line says what was assumed."""
    from parsim.errors import ParsimWarning

    row = {"id": "r", "model": "llama3-70b", "gpus": 64, "dp_replicate": 1, "dp_shard": 8, "tp": 1, "pp": 8,
           "ac": "full", "local_batch_size": 8, "micro_batch_size": 1, "global_batch_size": 64, "seq_len": 8192,
           "pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": float("nan")}
    with pytest.warns(ParsimWarning, match="assumed 2 stages per rank .*torchtitan"):
        _, plan = V.published_plan({**row, "source": "torchtitan", "table": "t"})
    assert plan.pp_stages_per_rank == 2
    with pytest.warns(ParsimWarning, match="assumed 5 stages per rank .*Megatron"):  # 80 layers / (2 x pp 8)
        _, plan = V.published_plan({**row, "source": "megatron-bridge", "table": "t", "dp_shard": 1,
                                    "dp_replicate": 8})
    assert plan.pp_stages_per_rank == 5
    assert predict(PRESETS["llama3-70b"], plan, load_profile("h100-sxm-spec")).step_time_s > 0


def test_transformer_engine_attention_runs_cudnn_speed_on_hopper_only():
    """TE layers on Hopper run cuDNN's fused attention, 1.6x FlashAttention-2 at the same shape (profile field
    fused_attention_speedup, FA3 paper figures); the GEMMs are unchanged (TE's fused memory-bound kernels are
    another matter); A100 keeps FA2."""
    from parsim.codec import encode
    from parsim.costmodel.compute import block_overheads, layer_compute_items
    from parsim.costmodel.layers import Shapes

    plan = Plan(dp_replicate=2, tp=4, seq_len=8192, local_batch_size=1, float8=True)
    for name, speedup in (("h100-sxm-spec", 1.6), ("a100-sxm-80gb-spec", 1.0)):
        hw = load_profile(name)
        assert hw.fused_attention_speedup == speedup
        items = {}
        for te in (False, True):
            p = dataclasses.replace(plan, te_layers=te, float8=plan.float8 and "float8" in hw.peak_flops)
            b = encode([p], 8)
            items[te] = {n: (float(e[0]), float(t[0]))
                         for n, _k, _w, e, t, _s in layer_compute_items(L70, b, Shapes(L70, b), hw, False,
                                                                        block_overheads(hw)[0])}
        eff_fa2, t_fa2 = items[False].pop("attention (causal)")
        eff_te, t_te = items[True].pop("attention (causal)")
        assert eff_te == pytest.approx(eff_fa2 * speedup, rel=1e-12)
        assert t_te == pytest.approx(t_fa2 / speedup, rel=1e-12)
        gemms = [n for n in items[False] if n.startswith("w")]
        assert len(gemms) >= 7 and all(items[True][n] == items[False][n] for n in gemms)
    # a profile whose curve times the speedup would pass 1 is capped at 1
    fast = dataclasses.replace(H100, fused_attention_speedup=10.0)
    b = encode([dataclasses.replace(plan, te_layers=True)], 8)
    att = [x for x in layer_compute_items(L70, b, Shapes(L70, b), fast, False, block_overheads(fast)[0])
           if x[0] == "attention (causal)"][0]
    assert float(att[3][0]) == pytest.approx(1.0)


def test_the_calibrated_attention_factor_leaves_cudnn_attention_alone():
    """``parsim calibrate``'s attention factor is fitted on FlashAttention runs: it scales the FlashAttention curves
    (torch's SDPA plans, and TE plans on A100 where TE runs FlashAttention), while TE's cuDNN attention on Hopper
    keeps its own figure, the spec-sheet curve times ``fused_attention_speedup``."""
    from parsim import calibrate as C
    from parsim.codec import encode
    from parsim.costmodel.compute import layer_compute_items
    from parsim.costmodel.layers import Shapes

    plan = Plan(dp_replicate=2, tp=4, seq_len=8192, local_batch_size=1)

    def attention_s(hw, te):
        b = encode([dataclasses.replace(plan, te_layers=te)], 8)
        return [float(x[4][0]) for x in layer_compute_items(L70, b, Shapes(L70, b), hw, False)
                if x[0] == "attention (causal)"][0]

    for name, cudnn in (("h100-sxm-spec", True), ("a100-sxm-80gb-spec", False)):
        raw = load_profile(name)
        cal = C.apply(raw, {"attention_eff_max": 0.5})
        assert cal.corrections["flash_attention_factor"] == pytest.approx(0.5)
        assert attention_s(cal, False) == pytest.approx(2.0 * attention_s(raw, False), rel=1e-9)
        assert attention_s(cal, True) == pytest.approx(attention_s(raw, True) * (1.0 if cudnn else 2.0), rel=1e-9)
    twice = C.apply(C.apply(H100, {"attention_eff_max": 0.5}), {"attention_eff_max": 0.8})  # factors compose
    assert twice.corrections["flash_attention_factor"] == pytest.approx(0.4)
    assert attention_s(twice, True) == pytest.approx(attention_s(H100, True), rel=1e-9)


def test_megatron_interleaved_schedule_holds_no_torch_send_works():
    """torch's runtime schedule keeps every send's work to the step's end (``memory._sent_held``); Megatron's
    interleaved schedule (TE layers) waits for its sends. Megatron-Bridge's llama3-70b recipe (pp8 x v5, tp4,
    dp2, 64 microbatches of 8192 tokens, float8, no AC), which ran on 80 GB H100s, fits; with torch's held sends
    counted it was predicted at 85 GiB reserved (stop 49 -> 50: 12 published Megatron runs predicted OOM)."""
    plan = Plan(pp=8, pp_stages_per_rank=5, pp_schedule="Interleaved1F1B", dp_replicate=2, tp=4, seq_len=8192,
                local_batch_size=64, global_batch_size=128, micro_batch_size=1, float8=True, async_tp=True,
                distributed_optimizer=True, te_layers=True)
    p = predict(PRESETS["llama3-70b"], plan, H100)
    assert p.fits and p.reserved_memory_bytes < 72 * 2**30


def test_published_runs_predicted_to_fit_still_fit():
    """Every published run that ran and that the stored predictions (``tests/data/published-rows.json``: the rows
    ``parsim validate --published bench/published/dev.csv`` writes) predicted to fit is still predicted to fit: a
    model change that flips one to out-of-memory must say so by regenerating that file (a change once flipped 12
    Megatron runs unnoticed)."""
    import json
    from pathlib import Path

    from parsim.spec import ModelSpec

    rows = json.loads((Path(__file__).resolve().parent / "data" / "published-rows.json").read_text())
    ran = [r for r in rows if r["status"] == "ok" and r["confidence"] in ("high", "medium") and r["fits"]]
    assert len(ran) >= 100

    def fits(r):
        return predict(ModelSpec.from_dict(r["spec"]), Plan.from_dict(r["plan"]), load_profile(r["profile"])).fits

    flipped = [r["plan_id"] for r in ran if not fits(r)]
    assert not flipped, flipped
