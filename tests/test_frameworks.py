"""Framework overhead (FSDP2, DTensor TP beside their collectives): the fit of the probe's samples, the cost model's
use of the quantities, and the probe itself on 2 gloo ranks."""

import dataclasses
import json
import subprocess
import sys

import pytest

from parsim.costmodel import predict
from parsim.hardware import load_profile
from parsim.plan import Plan
from parsim.profiler.fit import fit_framework_overheads
from parsim.spec import PRESETS

TINY = PRESETS["tiny"]


def test_fit_recovers_fixed_and_per_byte_overheads():
    # FSDP probes with reshard after forward (3 collective calls per unit) and without (2): per call the same
    samples = [{"kind": "fsdp", "unit_bytes": b, "fsdp_calls_per_unit": n,
                "overhead_per_block_s": n * (2e-3 + 1e-9 * b)} for b in (8e5, 3e6, 1.2e7) for n in (3, 2)]
    samples += [{"kind": "tp", "unit_bytes": b, "overhead_per_block_s": 6e-3 + 1.5e-8 * b} for b in (1e5, 3e5, 5e5)]
    q = fit_framework_overheads(samples)
    assert q["fsdp_call_fixed_s"] == pytest.approx(2e-3, rel=1e-6)
    assert q["fsdp_call_s_per_byte"] == pytest.approx(1e-9, rel=1e-6)
    assert q["tp_block_fixed_s"] == pytest.approx(6e-3, rel=1e-6)
    assert q["tp_block_s_per_byte"] == pytest.approx(1.5e-8, rel=1e-6)
    assert fit_framework_overheads([s for s in samples if s["kind"] == "tp"]).keys() == {"tp_block_fixed_s",
                                                                                         "tp_block_s_per_byte"}
    ep = [{"kind": "ep", "unit_bytes": b, "overhead_per_block_s": 4e-3 + 2e-8 * b} for b in (6e4, 1.3e5, 2.6e5)]
    tp_moe = [{"kind": "tp_moe", "unit_bytes": b, "overhead_per_block_s": 9e-3 + 2.5e-8 * b} for b in (1e5, 3e5, 5e5)]
    q = fit_framework_overheads(samples + ep + tp_moe)
    assert q["ep_block_fixed_s"] == pytest.approx(4e-3, rel=1e-6)
    assert q["ep_block_s_per_byte"] == pytest.approx(2e-8, rel=1e-6)
    assert q["tp_moe_block_fixed_s"] == pytest.approx(9e-3, rel=1e-6)
    assert q["tp_moe_block_s_per_byte"] == pytest.approx(2.5e-8, rel=1e-6)
    assert q["tp_block_fixed_s"] == pytest.approx(6e-3, rel=1e-6)  # the dense block's fit is its own
    # pipelining: a sample per block and step over its stage actions (2 x 8 microbatches per block)
    pp = [{"kind": "pp", "unit_bytes": b, "pp_actions_per_block": 16, "overhead_per_block_s": 16 * (5e-4 + 3e-9 * b)}
          for b in (3.2e4, 6.5e4, 1.3e5)]
    q = fit_framework_overheads(samples + pp)
    assert q["pp_action_fixed_s"] == pytest.approx(5e-4, rel=1e-6)
    assert q["pp_action_s_per_byte"] == pytest.approx(3e-9, rel=1e-6)
    assert q["fsdp_call_fixed_s"] == pytest.approx(2e-3, rel=1e-6)
    moe = [{"kind": "fsdp_moe", "unit_bytes": b, "fsdp_calls_per_unit": n,
            "overhead_per_block_s": n * (1e-3 + 6e-10 * b)} for b in (2e6, 8e6) for n in (3, 2)]
    q = fit_framework_overheads(samples + moe)
    assert q["fsdp_moe_call_fixed_s"] == pytest.approx(1e-3, rel=1e-6)
    assert q["fsdp_moe_call_s_per_byte"] == pytest.approx(6e-10, rel=1e-6)
    assert q["fsdp_call_s_per_byte"] == pytest.approx(1e-9, rel=1e-6)  # the dense units' fit is their own


def _profile(**corr):
    hw = load_profile("cpu-gloo-2")
    return dataclasses.replace(hw, corrections={**{k: v for k, v in hw.corrections.items()
                                                   if not k.startswith(("fsdp_call_", "tp_block_", "tp_moe_block_",
                                                                        "ep_block_", "pp_action_",
                                                                        "fsdp_moe_call_"))},
                                                **corr})


@pytest.mark.parametrize("degrees, calls", [
    # 4 blocks + embedding + [norm, output]: one reduce-scatter each per step, and the unshards before it: the
    # forward's and the backward's (reshard after forward; torchtitan keeps the last unit gathered after forward)
    ({"dp_shard": 2}, 5 * 3 + 2),
    ({"dp_shard": 2, "fsdp_reshard_after_forward": "never"}, 6 * 2),  # one unshard per unit
    ({"dp_shard": 2, "fsdp_reshard_after_forward": "always"}, 6 * 3),
    ({"dp_replicate": 2}, 5 * 3 + 2),  # replicate only: the all-reduce of each whole unit, its (local) unshards
    ({"dp_replicate": 2, "dp_shard": 2}, 5 * 3 + 2),  # HSDP: the reduce-scatter's cycle; the all-reduce is not another
])
def test_fsdp_overhead_is_charged_per_unit_and_collective_call(degrees, calls):
    plan = Plan(seq_len=128, local_batch_size=1, param_dtype="float32", reduce_dtype="float32", **degrees)
    base = predict(TINY, plan, _profile())
    got = predict(TINY, plan, _profile(fsdp_call_fixed_s=1e-3, fsdp_call_s_per_byte=0.0))
    assert "framework_fsdp" not in base.time_breakdown_s
    scale = float(_profile().corrections.get("compute_scale", 1.0))
    assert got.time_breakdown_s["framework_fsdp"] == pytest.approx(calls * 1e-3 * scale)
    assert got.step_time_s == pytest.approx(base.step_time_s + calls * 1e-3 * scale)
    assert sum(got.time_breakdown_s.values()) == pytest.approx(got.step_time_s)


@pytest.mark.parametrize("raf, calls", [("default", 3), ("never", 2)])
def test_fsdp_overhead_of_units_holding_routed_experts_is_the_moe_probes(raf, calls):
    """tiny-moe on dp_shard 2: the MoE blocks' units (experts inside where ep = 1) are charged the MoE probe's
    quantities, the dense block, embedding and [norm, output] units the dense probe's; a profile without the MoE
    quantities charges every unit the dense ones."""
    moe = PRESETS["tiny-moe"]
    plan = Plan(dp_shard=2, seq_len=128, local_batch_size=1, fsdp_reshard_after_forward=raf, param_dtype="float32",
                reduce_dtype="float32")
    dense_q = {"fsdp_call_fixed_s": 1e-3, "fsdp_call_s_per_byte": 0.0}
    got = predict(moe, plan, _profile(**dense_q, fsdp_moe_call_fixed_s=3e-3, fsdp_moe_call_s_per_byte=0.0))
    scale = float(_profile().corrections.get("compute_scale", 1.0))
    dense_calls = (moe.n_dense_layers + 1) * calls + 2  # [norm, output] stays gathered after forward: 2 calls
    assert moe.n_moe_layers == 3 and moe.n_dense_layers == 1
    want = (dense_calls * 1e-3 + moe.n_moe_layers * calls * 3e-3) * scale
    assert got.time_breakdown_s["framework_fsdp"] == pytest.approx(want)
    assert sum(got.time_breakdown_s.values()) == pytest.approx(got.step_time_s)
    dense_only = predict(moe, plan, _profile(**dense_q))
    assert dense_only.time_breakdown_s["framework_fsdp"] == pytest.approx(
        (dense_calls + moe.n_moe_layers * calls) * 1e-3 * scale)


def test_fsdp_overhead_under_pp_counts_the_microbatches_unshards():
    """With PP and reshard after forward a unit gathers m + 1 times per pass (comm.fsdp_gathers_per_pass); without
    resharding (PP's default) once: the overhead follows."""
    q = {"fsdp_call_fixed_s": 1e-3, "fsdp_call_s_per_byte": 0.0}
    plan = Plan(pp=2, dp_shard=2, seq_len=128, local_batch_size=4, micro_batch_size=1, param_dtype="float32",
                reduce_dtype="float32")
    default = predict(TINY, plan, _profile(**q)).time_breakdown_s["framework_fsdp"]
    always = predict(TINY, dataclasses.replace(plan, fsdp_reshard_after_forward="always"),
                     _profile(**q)).time_breakdown_s["framework_fsdp"]
    assert always / default == pytest.approx((1 + 4 + 1) / (1 + 1))


def test_tp_overhead_per_block_and_microbatch_grows_with_the_gathered_activation():
    plan = Plan(tp=2, dp_shard=1, seq_len=128, local_batch_size=1, global_batch_size=2, param_dtype="float32",
                reduce_dtype="float32")  # gradient accumulation 2: two microbatches
    act = 1 * 128 * TINY.d_model * 4
    got = predict(TINY, plan, _profile(tp_block_fixed_s=1e-3, tp_block_s_per_byte=1e-9))
    scale = float(_profile().corrections.get("compute_scale", 1.0))
    assert got.time_breakdown_s["framework_tp"] == pytest.approx(TINY.n_layers * 2 * (1e-3 + 1e-9 * act) * scale)
    assert sum(got.time_breakdown_s.values()) == pytest.approx(got.step_time_s)
    no_tp = predict(TINY, dataclasses.replace(plan, tp=1, dp_shard=2), _profile(tp_block_fixed_s=1e-3,
                                                                               tp_block_s_per_byte=1e-9))
    assert no_tp.time_breakdown_s.get("framework_tp", 0.0) == 0.0  # zero components are left out


@pytest.mark.parametrize("ep", [1, 2])
def test_tp_overhead_of_moe_layers_is_the_moe_blocks(ep):
    """Under TP a MoE layer is charged the MoE block's quantities, a dense layer the dense block's; a profile
    measured before the MoE probe charges every layer the dense block's."""
    moe = PRESETS["tiny-moe"]
    plan = Plan(tp=2, dp_shard=ep, ep=ep, etp=1, seq_len=128, local_batch_size=1, global_batch_size=2 * ep,
                param_dtype="float32", reduce_dtype="float32")  # gradient accumulation 2: two microbatches
    act = 1 * 128 * moe.d_model * 4
    dense_q = {"tp_block_fixed_s": 1e-3, "tp_block_s_per_byte": 1e-9}
    both = predict(moe, plan, _profile(**dense_q, tp_moe_block_fixed_s=3e-3, tp_moe_block_s_per_byte=2e-9))
    scale = float(_profile().corrections.get("compute_scale", 1.0))
    want = 2 * (moe.n_dense_layers * (1e-3 + 1e-9 * act) + moe.n_moe_layers * (3e-3 + 2e-9 * act)) * scale
    assert moe.n_dense_layers > 0 and moe.n_moe_layers > 0
    assert both.time_breakdown_s["framework_tp"] == pytest.approx(want)
    assert sum(both.time_breakdown_s.values()) == pytest.approx(both.step_time_s)
    dense_only = predict(moe, plan, _profile(**dense_q))
    assert dense_only.time_breakdown_s["framework_tp"] == pytest.approx(2 * moe.n_layers * (1e-3 + 1e-9 * act)
                                                                         * scale)


@pytest.mark.parametrize("degrees, share", [({"dp_shard": 2, "ep": 2}, 1), ({"tp": 2, "ep": 2, "etp": 1}, 2)])
def test_ep_overhead_per_moe_block_and_microbatch_grows_with_the_routed_rows(degrees, share):
    """Per MoE layer on the rank and microbatch, against the rows the rank routes (tokens x top_k x d_model; with
    whole experts under TP the rank routes 1/tp of the tokens); dense layers and plans without EP add nothing."""
    moe = PRESETS["tiny-moe"]
    plan = Plan(seq_len=128, local_batch_size=1, global_batch_size=4 // share, param_dtype="float32",
                reduce_dtype="float32", **degrees)  # gradient accumulation 2: two microbatches
    got = predict(moe, plan, _profile(ep_block_fixed_s=1e-3, ep_block_s_per_byte=1e-9))
    scale = float(_profile().corrections.get("compute_scale", 1.0))
    rows_bytes = 128 / share * moe.moe.top_k * moe.d_model * 4
    assert got.time_breakdown_s["framework_ep"] == pytest.approx(moe.n_moe_layers * 2 * (1e-3 + 1e-9 * rows_bytes)
                                                                 * scale)
    assert sum(got.time_breakdown_s.values()) == pytest.approx(got.step_time_s)
    no_ep = predict(moe, Plan(seq_len=128, local_batch_size=1, global_batch_size=4, dp_shard=2,
                              param_dtype="float32", reduce_dtype="float32"),
                    _profile(ep_block_fixed_s=1e-3, ep_block_s_per_byte=1e-9))
    assert no_ep.time_breakdown_s.get("framework_ep", 0.0) == 0.0


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2)])
def test_pp_overhead_per_stage_action_grows_with_the_sent_activation(schedule, v):
    """Two actions (forward, backward) per microbatch and local stage, each against the activation the stage sends
    (micro batch x sequence x d_model x param bytes); plans without PP add nothing."""
    plan = Plan(pp=2, dp_shard=1, seq_len=128, local_batch_size=4, micro_batch_size=1, pp_schedule=schedule,
                pp_stages_per_rank=v, param_dtype="float32", reduce_dtype="float32")
    q = {"pp_action_fixed_s": 1e-3, "pp_action_s_per_byte": 1e-9}
    got = predict(TINY, plan, _profile(**q))
    scale = float(_profile().corrections.get("compute_scale", 1.0))
    sent = 1 * 128 * TINY.d_model * 4
    assert got.time_breakdown_s["framework_pp"] == pytest.approx(2 * 4 * v * (1e-3 + 1e-9 * sent) * scale)
    assert sum(got.time_breakdown_s.values()) == pytest.approx(got.step_time_s)
    base = predict(TINY, plan, _profile())
    assert "framework_pp" not in base.time_breakdown_s  # a profile without the quantities: nothing, as before
    no_pp = predict(TINY, Plan(dp_shard=2, seq_len=128, local_batch_size=4, param_dtype="float32",
                               reduce_dtype="float32"), _profile(**q))
    assert no_pp.time_breakdown_s.get("framework_pp", 0.0) == 0.0


@pytest.mark.slow
def test_probe_measures_fsdp_and_tp_against_their_twins_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "fw.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "parsim.profiler.frameworks", "--out", str(out), "--quick"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                             "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    kinds = {(s["kind"], s["reshard_after_forward"], s["d_model"]) for s in doc["samples"]}
    assert kinds == {(k, raf, d) for k, raf in (("fsdp", "default"), ("fsdp", "never"), ("tp", ""), ("tp_moe", ""),
                                                ("ep", ""), ("pp", ""), ("fsdp_moe", "default"),
                                                ("fsdp_moe", "never")) for d in (128, 256)}
    for s in doc["samples"]:
        assert s["framework_s"] > 0 and s["twin_s"] > 0 and s["world"] == 2 and s["dtype"] == "float32"
    fsdp = {s["d_model"]: s["unit_bytes"] for s in doc["samples"] if s["kind"] == "fsdp"}
    assert fsdp[256] == 4 * sum(p for p in (256 * 256 * 2 + 2 * 256 * 128, 3 * 256 * 768, 2 * 256))
    q = fit_framework_overheads(doc["samples"])
    assert all(v >= 0 for v in q.values()) and len(q) == 12
    moe_unit = {s["d_model"]: s["unit_bytes"] for s in doc["samples"] if s["kind"] == "fsdp_moe"}
    assert moe_unit[256] == 4 * (256 * 256 * 2 + 2 * 256 * 128 + 256 * 8 + 3 * 256 * 256 * 9 + 2 * 256)
    pp = {s["d_model"]: s for s in doc["samples"] if s["kind"] == "pp"}
    assert pp[256]["unit_bytes"] == 64 * 256 * 4 and pp[256]["pp_actions_per_block"] == 16  # 8 microbatches
    assert pp[256]["layers"] == 1 and pp[256]["fsdp_calls_per_unit"] == 0
    ep = {s["d_model"]: s["unit_bytes"] for s in doc["samples"] if s["kind"] == "ep"}
    assert ep[256] == 64 * 2 * 256 * 4  # the rank's routed rows: seq x top_k x d_model, float32


def test_framework_overhead_divides_out_the_core_sharing_the_probe_ran_under():
    """A probe run on the profile's ranks (sharing the cores as its plans do) measured the sharing already: the
    plan's ``compute_scale`` over the probe's (``framework_probe_compute_scale``) stretches it, not the whole of it."""
    plan = Plan(tp=2, dp_shard=1, seq_len=128, local_batch_size=1, param_dtype="float32", reduce_dtype="float32")
    q = {"tp_block_fixed_s": 1e-3, "tp_block_s_per_byte": 0.0}
    two = predict(TINY, plan, _profile(**q, compute_scale=2.0))  # a probe on 2 ranks: the plan's sharing applies
    same = predict(TINY, plan, _profile(**q, compute_scale=2.0, framework_probe_compute_scale=2.0))
    drift = predict(TINY, plan, _profile(**q, compute_scale=2.2, framework_probe_compute_scale=2.0))
    assert two.time_breakdown_s["framework_tp"] == pytest.approx(TINY.n_layers * 1e-3 * 2.0)
    assert same.time_breakdown_s["framework_tp"] == pytest.approx(TINY.n_layers * 1e-3)
    assert drift.time_breakdown_s["framework_tp"] == pytest.approx(TINY.n_layers * 1e-3 * 1.1)


def test_framework_samples_record_the_sharing_of_the_ranks_they_ran_on():
    from parsim.profiler.run import framework_probe_ranks, with_framework_samples

    assert framework_probe_ranks("cpu", 4) == 4 and framework_probe_ranks("cpu", 1) == 2
    assert framework_probe_ranks("cuda", 8) == 2
    hw = _profile(compute_scale=2.2)
    hw = dataclasses.replace(hw, provenance={**hw.provenance, "device": "cpu", "ranks_per_node": 4})
    sample = {"kind": "tp", "unit_bytes": 1e5, "overhead_per_block_s": 1e-3}
    on4 = with_framework_samples(hw, {"samples": [dict(sample, world=4)]})
    on_cores = with_framework_samples(hw, {"samples": [dict(sample, world=2)]})
    assert on4.corrections["framework_probe_compute_scale"] == pytest.approx(2.2)
    assert on_cores.corrections["framework_probe_compute_scale"] == pytest.approx(
        max(1.0, 2 / (__import__("os").cpu_count() or 1)))
    assert on4.samples["frameworks"]["samples"][0]["world"] == 4 and "tp_block_fixed_s" in on4.corrections
