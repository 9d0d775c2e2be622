"""grad_sync: data-parallel gradients reduced after every gradient-accumulation pass (torchtitan) or once per step
(Megatron-Core's DDP; FSDP2 with set_requires_gradient_sync(False) before the last pass)."""

from __future__ import annotations

import dataclasses

import pytest

from parsim.codec import executor_refusal, validate_plan
from parsim.costmodel import predict
from parsim.emit import megatron_gaps
from parsim.errors import ParsimError
from parsim.frameworks import restrict_space
from parsim.hardware import load_profile
from parsim.plan import Plan
from parsim.search import SearchSpace
from parsim.spec import PRESETS
from parsim.validate import framework_options, published_plan

HW = load_profile("h100-sxm-spec-cal")
SPEC = PRESETS["llama3-8b"]
GA = 4


def _pair(**kw):
    base = Plan(**kw, local_batch_size=1, global_batch_size=GA * kw.get("dp_shard", 1) * kw.get("dp_replicate", 1),
                seq_len=4096, ac="full")
    return (predict(SPEC, base, HW), predict(SPEC, dataclasses.replace(base, grad_sync="once"), HW))


@pytest.mark.parametrize("kw", [dict(dp_shard=8), dict(dp_replicate=8), dict(dp_replicate=2, dp_shard=4)])
def test_gradients_reduced_once_cut_the_reduces_by_the_passes_and_keep_the_gathers(kw):
    every, once = _pair(**kw)
    for key, nbytes in every.comm_bytes.items():
        op = key.split("/")[0]
        if op in ("reduce_scatter", "all_reduce") and nbytes > 1e6:  # the gradient reductions, not the norms'
            assert once.comm_bytes[key] == pytest.approx(nbytes / GA, rel=1e-9), key
        elif op == "all_gather":
            assert once.comm_bytes[key] == pytest.approx(nbytes, rel=1e-9), key
    assert once.step_time_s < every.step_time_s


def test_fsdp_holds_unsharded_accumulators_when_it_reduces_once():
    every, once = _pair(dp_shard=8)
    p = SPEC.n_params
    # the accumulators are the whole model's gradients in fp32 (every unit unsharded), the sharded ones 1/8 of them
    assert once.peak_memory_bytes - every.peak_memory_bytes > 0.8 * p * 4.0 * (1 - 1 / 8)
    assert sum(once.memory_breakdown_bytes.values()) == pytest.approx(once.peak_memory_bytes)


def test_hsdp_without_sharding_keeps_no_all_reduce_buffers_when_it_reduces_once():
    """With earlier passes' sharded gradients FSDP2 keeps every unit's all-reduce output until the end of backward
    (a second copy of the gradients); reduced once, the output becomes the gradient."""
    every, once = _pair(dp_replicate=8)
    assert once.peak_memory_bytes < every.peak_memory_bytes


def test_pipeline_passes_cannot_skip_the_reduce():
    with pytest.raises(ParsimError, match="pipeline schedules reduce after every pass"):
        validate_plan(Plan(pp=2, dp_shard=4, local_batch_size=4, micro_batch_size=1, global_batch_size=32,
                           grad_sync="once"), SPEC, 8)
    validate_plan(Plan(pp=2, dp_shard=4, local_batch_size=8, micro_batch_size=1, global_batch_size=32,
                       grad_sync="once"), SPEC, 8)


@pytest.mark.parametrize("kw", [dict(dp_shard=4), dict(dp_replicate=2, dp_shard=2), dict(dp_replicate=4),
                                dict(dp_shard=2, tp=2)])
def test_the_trace_of_a_step_that_reduces_once_is_the_model(kw):
    """A full-scale trace of the executor's step (FSDP2 with set_requires_gradient_sync(False) before the last
    pass): collective bytes exact, the peak within the differential tester's tolerance (param dtype bf16, fp32
    reductions; tests/differential.py KNOWN_GAPS names the cases that are not exact)."""
    pytest.importorskip("torch")
    from parsim.executor.tracepool import Tracer

    spec = PRESETS["tiny"]
    plan = Plan(**kw, local_batch_size=2, global_batch_size=32, seq_len=256, grad_sync="once")
    assert not executor_refusal(plan, spec) and plan.grad_accum_steps > 1
    m = Tracer().trace(spec, plan, 0)
    pred = predict(spec, plan, load_profile("h100-sxm-spec"))
    assert m.status == "ok"
    assert pred.peak_memory_bytes == pytest.approx(m.peak_memory_bytes, rel=0.005)
    assert {k: v for k, v in pred.comm_bytes.items() if v} == pytest.approx(
        {k: v for k, v in m.comm_bytes.items() if v}, rel=1e-9)


def test_the_frameworks_pin_their_own():
    sp = SearchSpace(global_batch_size=64, seq_len=4096)
    assert dict(restrict_space(sp, "megatron").pins)["grad_sync"] == "once"
    assert dict(restrict_space(sp, "torchtitan").pins)["grad_sync"] == "every-pass"
    with pytest.raises(ParsimError, match="torchtitan runs every-pass"):
        restrict_space(dataclasses.replace(sp, pins=(("grad_sync", "once"),)), "torchtitan")


def test_megatron_rows_reduce_once_and_the_emitter_says_when_a_plan_does_not():
    row = {"id": "r", "source": "nemo-24.07", "table": "NeMo", "model": "llama3-8b", "gpus": 8, "dp_replicate": 8,
           "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1, "ac": "none", "local_batch_size": 4, "micro_batch_size": 1,
           "global_batch_size": 32, "seq_len": 4096, "profile": "h100-sxm-spec"}
    _, plan = published_plan(row)
    assert plan.grad_sync == "once" and plan.grad_accum_steps == 4
    assert framework_options({"source": "torchtitan"}) == {}
    gap = "Megatron reduces once per step"
    assert any(gap in g for g in megatron_gaps(dataclasses.replace(plan, grad_sync="every-pass"), SPEC))
    assert not any(gap in g for g in megatron_gaps(plan, SPEC))


@pytest.mark.slow
def test_a_real_run_that_reduces_once_keeps_the_losses_and_counts_the_modelled_collectives():
    """Two gloo ranks: the same losses as reducing every pass (the same sums, reduced later), the collective bytes
    the model counts (one reduce-scatter per unit and step instead of per pass), the peak within 0.5%."""
    pytest.importorskip("torch")
    from parsim.executor.launch import run_plan

    base = Plan(dp_shard=2, local_batch_size=2, global_batch_size=8, seq_len=256, param_dtype="bfloat16")
    runs = {gs: run_plan("tiny", dataclasses.replace(base, grad_sync=gs), 2, steps=1, warmup=1, device="cpu")
            for gs in ("every-pass", "once")}
    assert all(m.status == "ok" for m in runs.values()), {k: m.error for k, m in runs.items()}
    assert runs["once"].losses == pytest.approx(runs["every-pass"].losses, abs=2e-5)
    for gs, m in runs.items():
        pred = predict(PRESETS["tiny"], dataclasses.replace(base, grad_sync=gs), load_profile("h100-sxm-spec"))
        assert {k: v for k, v in pred.comm_bytes.items() if v} == pytest.approx(m.comm_bytes, rel=1e-9), gs
        assert pred.peak_memory_bytes == pytest.approx(m.peak_memory_bytes, rel=0.005), gs
    assert runs["once"].comm_bytes["reduce_scatter/dp_shard"] * 2 == runs["every-pass"].comm_bytes[
        "reduce_scatter/dp_shard"]
