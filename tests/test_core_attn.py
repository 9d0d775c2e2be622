"""core-attn AC: Megatron's selective recompute, the attention core alone checkpointed (``--recompute-granularity
selective``, default ``--recompute-modules core_attn``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parsim.codec import encode, executor_refusal
from parsim.costmodel import predict
from parsim.costmodel.layers import Shapes, activation_bytes
from parsim.emit import to_megatron_args, torchtitan_plan_gaps
from parsim.frameworks import restrict_space
from parsim.hardware import load_profile
from parsim.plan import Plan, parse_ac
from parsim.search import SearchSpace
from parsim.spec import PRESETS, ModelSpec
from parsim.validate import framework_ac

GPT = ModelSpec(name="gpt-test", n_layers=8, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=8192, vocab_size=51200,
                mlp="gelu", norm="layernorm", bias=True, max_position_embeddings=2048)


def test_core_attn_keeps_everything_but_the_attentions_logsumexp():
    spec = PRESETS["llama3-8b"]
    for tp in (1, 4):
        b = encode([Plan(dp_shard=8 // tp, tp=tp, seq_len=4096, local_batch_size=2, ac="core-attn")], 8)
        sh = Shapes(spec, b)
        act = activation_bytes(spec, sh, False)
        lse = 2 * 4096 * spec.n_heads / tp * 4.0  # fp32, one per head and token
        assert act["none"][0] - act["attn"][0] == pytest.approx(lse)
        assert act["sac"][0] < act["attn"][0]


def test_core_attn_recomputes_the_attention_alone():
    """Its recompute does not depend on the MLP's width (selective-op's does), and on a GPT with biased linears,
    where torchtitan's per-op policy saves no addmm and recomputes nearly a whole forward, it is a small part of
    the step."""
    hw = load_profile("h100-sxm-spec-cal")
    plan = Plan(dp_shard=8, seq_len=2048, local_batch_size=2)
    rec = {}
    for d_ff in (4096, 8192):
        spec = dataclasses.replace(GPT, d_ff=d_ff)
        for ac in ("core-attn", "selective-op", "full"):
            rec[d_ff, ac] = predict(spec, dataclasses.replace(plan, ac=ac), hw).time_breakdown_s["recompute"]
    assert rec[4096, "core-attn"] == pytest.approx(rec[8192, "core-attn"], rel=1e-9)
    assert rec[8192, "selective-op"] > 1.2 * rec[4096, "selective-op"]
    assert rec[8192, "core-attn"] < 0.2 * rec[8192, "selective-op"]
    assert rec[8192, "selective-op"] > 0.8 * rec[8192, "full"]


def test_megatron_runs_core_attn_and_torchtitan_says_it_cannot():
    spec = PRESETS["llama3-8b"]
    plan = Plan(dp_replicate=8, seq_len=4096, local_batch_size=1, ac="core-attn")
    args = to_megatron_args(plan, spec)
    assert "--recompute-granularity selective" in args and "--recompute-modules core_attn" in args
    for version in ("0.2", "0.3.0"):
        assert any(g.startswith("core-attn AC") for g in torchtitan_plan_gaps(plan, spec, version))
    assert parse_ac("core-attn") == ("core-attn", 1)


def test_a_megatron_rows_selective_recompute_is_core_attn():
    mb = {"source": "megatron-bridge", "table": "Megatron-Bridge performance summary"}
    assert framework_ac(mb, "selective") == framework_ac(mb, "selective-op") == "core-attn"
    tt = {"source": "torchtitan", "table": "llama3_h100_202412 Table 1"}
    assert framework_ac(tt, "selective") == framework_ac(tt, "selective-op") == "selective-op"
    assert framework_ac(mb, "full") == "full"


def test_the_megatron_search_space_reads_selective_as_core_attn():
    sp = restrict_space(SearchSpace(global_batch_size=64, seq_len=4096), "megatron")
    assert "core-attn" in sp.ac and "selective-op" not in sp.ac
    assert "core-attn" not in restrict_space(SearchSpace(global_batch_size=64, seq_len=4096), "torchtitan").ac


def test_the_executor_runs_core_attn_but_not_under_cp():
    spec = PRESETS["tiny"]
    assert executor_refusal(Plan(dp_shard=2, seq_len=64, local_batch_size=2, ac="core-attn"), spec) == ""
    why = executor_refusal(Plan(cp=2, seq_len=64, local_batch_size=2, ac="core-attn"), spec)
    assert "ring attention" in why
    assert np.isfinite(predict(spec, Plan(cp=2, seq_len=64, local_batch_size=2, ac="core-attn"),
                               load_profile("cpu-gloo-2")).step_time_s)
