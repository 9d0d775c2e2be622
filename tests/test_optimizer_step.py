"""The optimizer step measured, not composed (issue 23): the profiler times the executor's clip + AdamW step, the fit
separates fixed / per-parameter / per-tensor parts, and the cost model charges them on the tensors and
parameters a rank holds (counted as the executor's modules hold them)."""

import dataclasses

import pytest
import torch

from parsim.codec import encode
from parsim.costmodel import predict
from parsim.costmodel import step as S
from parsim.costmodel.compute import ADAMW_BYTES_PER_PARAM
from parsim.costmodel.layers import rank_layers
from parsim.executor.model import Transformer
from parsim.hardware import load_profile
from parsim.plan import Plan
from parsim.profiler.compute import optimizer_samples
from parsim.profiler.fit import fit_optimizer_step
from parsim.spec import PRESETS, ModelSpec

OPT_KEYS = ("optimizer_fixed_s", "optimizer_s_per_param", "optimizer_s_per_tensor")


def test_fit_recovers_fixed_per_parameter_and_per_tensor_parts():
    samples = [{"kind": "adamw", "params": n, "tensors": k, "time_s": 3e-4 + 2e-9 * n + 5e-5 * k}
               for n in (1 << 18, 1 << 20, 1 << 22) for k in (1, 16, 64)]
    q = fit_optimizer_step(samples)
    assert q["optimizer_fixed_s"] == pytest.approx(3e-4, rel=1e-6)
    assert q["optimizer_s_per_param"] == pytest.approx(2e-9, rel=1e-6)
    assert q["optimizer_s_per_tensor"] == pytest.approx(5e-5, rel=1e-6)
    # samples of profiles written before (AdamW alone, no tensor count) give no quantities
    assert fit_optimizer_step([{"kind": "adamw", "params": 1 << 20, "time_s": 1e-3}] * 3) == {}


def test_the_probe_times_the_executors_step_over_tensor_lists():
    s = optimizer_samples(torch.device("cpu"), [1 << 12, 1 << 14], tensor_counts=(1, 4), reps=1)
    assert [(x["params"], x["tensors"]) for x in s] == [(1 << 12, 1), (1 << 12, 4), (1 << 14, 1), (1 << 14, 4)]
    assert all(x["kind"] == "adamw" and x["time_s"] > 0 for x in s)
    assert set(fit_optimizer_step(s)) == set(OPT_KEYS)


QK = dataclasses.replace(PRESETS["tiny"], name="tiny-qk", qk_norm=True)


@pytest.mark.parametrize("spec", [PRESETS["tiny"], PRESETS["tiny-moe"], QK], ids=lambda s: s.name)
@pytest.mark.parametrize("pp", [1, 2])
def test_a_ranks_tensor_count_is_the_executors(spec: ModelSpec, pp: int):
    """The rank's tensors (its optimizer's foreach lists) against the executor's parameters: the whole model
    without PP; with PP the two stages split them."""
    plan = Plan(seq_len=64, pp=pp, local_batch_size=8, micro_batch_size=2 if pp > 1 else 8)
    b = encode([plan], 8)
    kinds = [k for k in (False, True) if (spec.n_moe_layers if k else spec.n_dense_layers) > 0]
    plocal, pshard = S.layer_params(spec, b, kinds)
    layers = rank_layers(spec, b.pp, b.pp_stages_per_rank)
    first, last = (S._rank_view(spec, b, r, layers, kinds, plocal, pshard).n_tensors[0] for r in (S.FIRST, S.LAST))
    model = Transformer(spec, 64)
    n = len(list(model.parameters()))
    if pp == 1:
        assert first == last == n
    else:
        assert first + last == n


def _profile(**corr):
    hw = load_profile("cpu-gloo-2")
    keep = {k: v for k, v in hw.corrections.items() if k not in OPT_KEYS}
    return dataclasses.replace(hw, corrections={**keep, **corr})


def test_the_cost_model_charges_the_measured_step_on_the_ranks_parameters_and_tensors():
    spec = PRESETS["tiny"]
    plan = Plan(seq_len=64, local_batch_size=1, param_dtype="float32", reduce_dtype="float32")  # one rank
    model = Transformer(spec, 64)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    scale = float(_profile().corrections.get("compute_scale", 1.0))
    base = predict(spec, plan, _profile())
    per_param = predict(spec, plan, _profile(optimizer_fixed_s=0.0, optimizer_s_per_param=1e-9,
                                             optimizer_s_per_tensor=0.0))
    assert per_param.time_breakdown_s["optimizer"] == pytest.approx(n_params * 1e-9 * scale)
    fixed_tensor = predict(spec, plan, _profile(optimizer_fixed_s=2e-3, optimizer_s_per_param=0.0,
                                                optimizer_s_per_tensor=1e-4))
    assert fixed_tensor.time_breakdown_s["optimizer"] == pytest.approx((2e-3 + n_tensors * 1e-4) * scale)
    for p in (base, per_param, fixed_tensor):
        assert sum(p.time_breakdown_s.values()) == pytest.approx(p.step_time_s)
    # without the measured quantities (spec sheets, older profiles): AdamW's bytes at the elementwise bandwidth
    hw = _profile()
    assert base.time_breakdown_s["optimizer"] == pytest.approx(
        n_params * ADAMW_BYTES_PER_PARAM / (hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency))
