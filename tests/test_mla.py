"""Multi-head latent attention in the executor (``executor.model.LatentAttention``) and the cost model's account of
it: the fused attention op pair computes what SDPA computes, and a full-scale trace of MLA plans (FSDP, PP,
interleaved PP x EP with dense first layers, every AC mode) is the model: collective bytes exact on every pipeline
rank kind, the peak within the differential tester's tolerance."""

from __future__ import annotations

import dataclasses

import pytest

from parsim.codec import executor_refusal
from parsim.costmodel.layers import FIRST, LAST
from parsim.costmodel.step import rank_details, stage_rank
from parsim.hardware import load_profile
from parsim.plan import Plan
from parsim.spec import PRESETS, MLASpec

SPEC = dataclasses.replace(PRESETS["deepseek-v3"], name="mla-2L", n_layers=2, vocab_size=1024, d_model=1024,
                           n_heads=8, n_kv_heads=8, d_ff=2048, moe=None, head_dim=96,
                           mla=MLASpec(q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                       v_head_dim=64))
MOE = dataclasses.replace(PRESETS["deepseek-v3"], name="mla-moe-4L", n_layers=4, vocab_size=1024, d_model=512,
                          n_heads=8, n_kv_heads=8, d_ff=1024, head_dim=96,
                          moe=dataclasses.replace(PRESETS["deepseek-v3"].moe, n_experts=8, top_k=2, d_ff_expert=256,
                                                  first_k_dense=1),
                          mla=MLASpec(q_lora_rank=0, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                      v_head_dim=64))


def test_the_fused_attention_computes_what_sdpa_computes():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from parsim.executor.model import latent_core

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 16, 3, 12, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 16, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = latent_core(q, k, v)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_mla_runs_without_tp_and_cp_only():
    assert not executor_refusal(Plan(dp_shard=2, seq_len=512), SPEC)
    assert "multi-head latent attention" in executor_refusal(Plan(dp_shard=2, tp=2, seq_len=512), SPEC)
    assert "multi-head latent attention" in executor_refusal(Plan(dp_shard=2, cp=2, seq_len=512), SPEC)


CASES = [(SPEC, dict(dp_shard=2, seq_len=1024)), (SPEC, dict(dp_shard=1, seq_len=2048)),
         (SPEC, dict(dp_shard=1, seq_len=2048, ac="selective-op")), (SPEC, dict(dp_shard=2, seq_len=1024, ac="full")),
         (SPEC, dict(dp_shard=1, seq_len=2048, ac="core-attn")),
         (MOE, dict(pp=2, dp_shard=2, ep=2, seq_len=512, local_batch_size=4, micro_batch_size=1,
                    pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, ac="full"))]


@pytest.mark.parametrize("spec,kw", CASES, ids=[f"{s.name}-{'-'.join(f'{k}{v}' for k, v in kw.items())}"
                                                for s, kw in CASES])
def test_a_trace_of_mla_is_the_model_on_every_pipeline_rank(spec, kw):
    pytest.importorskip("torch")
    from parsim.executor.tracepool import Tracer

    plan = Plan(**kw)
    assert not executor_refusal(plan, spec)
    details = rank_details(spec, plan, load_profile("h100-sxm-spec"))
    tracer = Tracer()
    for which in ((FIRST, LAST) if plan.pp > 1 else (FIRST,)):
        m = tracer.trace(spec, plan, stage_rank(plan, which))
        assert m.status == "ok", m.error
        d = details[which]
        assert d["peak_memory_bytes"] == pytest.approx(m.peak_memory_bytes, rel=0.005)
        assert d["comm_bytes"] == pytest.approx({k: v for k, v in m.comm_bytes.items() if v}, rel=1e-9)


def test_predict_reports_the_collective_bytes_of_both_pipeline_rank_kinds():
    """With PP the first and the last stage's ranks hand different bytes to FSDP and EP (the embedding, the output
    projection, the dense first layers): ``predict`` reports both, as the trace of each rank counts them."""
    from parsim.costmodel import predict

    hw = load_profile("h100-sxm-spec")
    plan = Plan(**CASES[-1][1])
    pred = predict(MOE, plan, hw)
    details = rank_details(MOE, plan, hw)
    assert pred.comm_bytes == pytest.approx(details[FIRST]["comm_bytes"], rel=1e-12)
    assert pred.comm_bytes_last_stage == pytest.approx(details[LAST]["comm_bytes"], rel=1e-12)
    assert pred.comm_bytes_last_stage["all_to_all/ep"] != pred.comm_bytes["all_to_all/ep"]
    assert predict(MOE, Plan(dp_shard=2, ep=2, seq_len=512), hw).comm_bytes_last_stage == {}
