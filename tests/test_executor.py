"""Executor: real multi-process runs with gloo (slow) and full-scale traces (tier 1) against the cost model."""

import dataclasses
import warnings

import pytest

torch = pytest.importorskip("torch")

from parsim.costmodel import predict  # noqa: E402
from parsim.executor.launch import run_plan  # noqa: E402
from parsim.executor.reference import reference_losses  # noqa: E402
from parsim.executor.tracepool import Tracer  # noqa: E402
from parsim.hardware import load_profile  # noqa: E402
from parsim.plan import Plan  # noqa: E402
from parsim.spec import PRESETS  # noqa: E402

H100 = load_profile("h100-sxm-spec")
_TRACER = Tracer()  # one trace server for the module's traces (~1 s a small plan instead of 3-4 s in a fresh process)


def trace_plan(spec, plan, rank=0):
    return _TRACER.trace(spec, plan, rank)

LLAMA8_CUT = dataclasses.replace(PRESETS["llama3-8b"], n_layers=8)  # full widths, fewer of the same layers
G, S, STEPS = 8, 64, 4  # global batch, sequence, steps (2 warm-up + 2 timed)

# Each option appears at least once; options are combined where one run can check them together (every run costs
# 10-20 s of CI): plain FSDP 4 is in the AC cases, plain FSDP x TP and PP x FSDP in their device-order cases. Cases
# marked LONG repeat a kind CI already runs (pytest -m long runs them).


def LONG(model: str, kw: dict) -> tuple:  # noqa: N802 - reads as a tag in the table below
    return (model, kw, "long")


PARITY = [
    ("tiny", dict(pp=2, tp=2, local_batch_size=8, micro_batch_size=2)),
    LONG("tiny-moe", dict(dp_shard=4, ep=2, local_batch_size=2)),  # EP from dp_shard: in the reversed-mesh case too
    ("tiny", dict(dp_shard=4, local_batch_size=2, ac="full")),
    ("tiny", dict(dp_shard=2, local_batch_size=4, compile=True)),
    # compile under TP: the TP embedding's async output waited before the first compiled block; MoE dispatch eager
    # (its per-expert counts are Python ints) with EP borrowed from tp; selective-op AC inside compile
    ("tiny-moe", dict(tp=2, ep=2, local_batch_size=8, compile=True, ac="selective-op")),
    LONG("tiny", dict(dp_shard=2, tp=2, local_batch_size=4, compile=True, sequence_parallel=False)),
    LONG("tiny", dict(tp=2, local_batch_size=8, compile=True, ac="full",
                      wrapper_order=("pp", "tp", "compile", "ac", "fsdp"))),
    # device orders other than the default (issue 12): TP outer of FSDP, PP innermost, EP inside a reversed mesh
    # (TP outer of FSDP: a 4-rank run CI left to -m long at stop 41 to stay within its time; the MoE case below keeps
    # a reversed 4-rank mesh in CI)
    LONG("tiny", dict(dp_shard=2, tp=2, local_batch_size=4,
                      mesh_order=("pp", "dp_replicate", "cp", "tp", "dp_shard"))),
    LONG("tiny", dict(pp=2, dp_shard=2, local_batch_size=4, micro_batch_size=2,
                  mesh_order=("dp_replicate", "cp", "tp", "dp_shard", "pp"))),
    ("tiny-moe", dict(dp_replicate=2, dp_shard=2, ep=2, local_batch_size=2,
                      mesh_order=("tp", "cp", "dp_shard", "dp_replicate", "pp"))),
    # EP with TP (issue 12): EP borrowed from tp (ep2) and from dp_shard x tp (ep4), with PP, experts TP-sharded
    LONG("tiny-moe", dict(dp_shard=2, tp=2, ep=2, local_batch_size=4)),
    LONG("tiny-moe", dict(dp_shard=2, tp=2, ep=4, local_batch_size=4)),
    ("tiny-moe", dict(pp=2, tp=2, ep=2, local_batch_size=8, micro_batch_size=2)),
    LONG("tiny-moe", dict(dp_shard=2, tp=2, local_batch_size=4, sequence_parallel=False)),
    # the fused cross-entropy (issue 11), with selective-op AC, and as a pipeline's loss
    ("tiny", dict(dp_shard=4, local_batch_size=2, ac="selective-op", fused_loss=True)),
    LONG("tiny", dict(pp=2, dp_shard=2, local_batch_size=4, micro_batch_size=2, fused_loss=True)),
    # context parallel (issue 21): torch's ring attention on CPU (parsim.executor.cp), with FSDP over dp_shard x cp
    # and selective-op AC; with TP, as a pipeline's, and with EP borrowed from cp
    ("tiny", dict(cp=2, dp_shard=2, local_batch_size=4, ac="selective-op")),
    # core-attn AC (Megatron's selective recompute: the attention call alone checkpointed), under TP and compiled
    ("tiny", dict(dp_shard=2, tp=2, local_batch_size=4, ac="core-attn")),
    LONG("tiny", dict(dp_shard=2, local_batch_size=4, ac="core-attn", compile=True)),
    LONG("tiny", dict(cp=2, tp=2, local_batch_size=8)),
    LONG("tiny", dict(pp=2, cp=2, local_batch_size=8, micro_batch_size=2)),
    LONG("tiny-moe", dict(cp=2, ep=2, local_batch_size=8)),
]


def test_a_crashed_worker_says_why():
    """torchrun's summary names only the signal; the launcher puts the lines that say why in front of the tail."""
    from parsim.executor.launch import _cause

    log = ("step 1\nterminate called after throwing an instance of 'gloo::IoException'\n  what():  [gloo] "
           "Connection closed by peer\n...\ntraceback : Signal 6 (SIGABRT) received by PID 1\n")
    assert _cause(log) == ("[terminate called after throwing an instance of 'gloo::IoException'] "
                           "[what():  [gloo] Connection closed by peer] ")
    assert _cause("no cause here\n") == ""


def test_compiled_plans_compile_on_the_first_step_no_mode_of_parsims_watches():
    """Step 0 counts collectives and, on CPU, step 1 tracks memory, each under a TorchDispatchMode where dynamo
    does not trace; the compile (worker.compile_after_modes) comes before the first step under neither."""
    from parsim.executor.worker import first_plain

    assert first_plain(count=True, track=1) == 2  # CPU
    assert first_plain(count=True, track=None) == 1  # CUDA
    assert first_plain(count=False, track=1) == 0  # PARSIM_NO_COUNT
    assert first_plain(count=False, track=0) == 1  # one step in all, tracked


def test_compile_under_tp_is_refused_only_over_full_ac():
    """torch 2.13 compiles TP blocks (the embedding's async output waited first) without AC, under selective-op
    AC and inside AC (order compile, ac); a compiled full or layer checkpoint of a TP block fails in AOTAutograd."""
    from parsim.codec import executor_refusal

    def why(**kw):
        return executor_refusal(Plan(seq_len=S, tp=2, local_batch_size=8, compile=True, **kw), PRESETS["tiny"])

    assert why() == why(ac="selective-op") == ""
    assert why(ac="full", wrapper_order=("pp", "tp", "compile", "ac", "fsdp")) == ""
    assert "compile over full AC under TP" in why(ac="full")
    assert "compile over full AC under TP" in why(ac="layer:2")


@pytest.fixture(scope="module")
def references():
    return {m: reference_losses(PRESETS[m], G, S, STEPS, "sgd") for m in ("tiny", "tiny-moe")}


@pytest.mark.slow
@pytest.mark.parametrize("model,kw", [
    pytest.param(c[0], c[1], marks=[pytest.mark.long] if len(c) > 2 else [],
                 id=f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}") for c in PARITY])
def test_loss_parity_with_single_process(model, kw, references):
    """Same model, init, data, loss, clipping and SGD as one process on the whole batch. fp32 throughout; the
    only differences are summation orders (sharded reductions, TP partial sums), ~1e-7 relative per step. SGD
    (not Adam, whose normalization hides a wrongly scaled gradient) makes a wrong reduction show at once:
    the gloo AVG bug left some gradients 4x too small and moved the step-1 loss by 6e-3. Tolerance 2e-5 absolute
    on losses near 7.7 is 20x the largest difference seen (9.5e-7) and 300x below that bug."""
    plan = Plan(seq_len=S, param_dtype="float32", **kw)
    assert plan.global_batch_size == G
    def run():
        return run_plan(model, plan, plan.world_size, steps=STEPS - 2, warmup=2, timeout_s=400, device="cpu",
                        optimizer="sgd")

    m = run()
    if m.status == "error" and "Signal 6 (SIGABRT)" in m.error:
        # once in a CI run (4 gloo ranks on 2 loaded cores, stop 40) a rank aborted in C++ without a Python error
        # and did not on 10 reruns; one retry, said as a warning with the cause the launcher found. A wrong loss
        # or a Python error is never retried.
        warnings.warn(f"a rank aborted, retried once: {m.error[:400]}", stacklevel=1)
        m = run()
    assert m.status == "ok", m.error
    assert len(m.losses) == STEPS
    assert m.losses == pytest.approx(references[model], abs=2e-5)
    assert m.median_step_time_s > 0 and m.peak_memory_bytes > 0 and m.comm_bytes
    # a compiled plan's timed steps ran compiled code: the counting step's dispatch mode made dynamo skip the
    # blocks for the rest of the process before (worker.compile_after_modes)
    assert (m.provenance["compiled_graphs"] >= 1) == plan.compile


@pytest.mark.slow
@pytest.mark.parametrize("kw,ranks", [(dict(dp_shard=2, local_batch_size=4), (0, 1)),
                                      (dict(pp=2, local_batch_size=8, micro_batch_size=1), (0, 1)),
                                      (dict(dp_shard=2, local_batch_size=4, ac="core-attn"), (0, 1))])
def test_real_run_memory_matches_the_trace(kw, ranks):
    """The executor's real run (torch's own schedule for PP) holds what ``parsim trace`` replays, rank by rank (the
    tensor-level tracker on both sides): the logits go before the backward without PP, as torchtitan's train step
    frees them (+5.2% before), and the last pipeline stage keeps no microbatch's output for the caller
    (return_outputs=False: +20% before) but each in-flight microbatch's logits until its backward returns, as
    torch's stage does (the trace missed those: -2.5%). Both sides count torch's per-microbatch receive buffers
    (the first stage's real run was 2.1% over the trace before the trace kept them) and the input gradient 1F1B's
    send ops hold until the next backward (the last stage +0.35% -> +0.06%). Left: the first stage's real run holds
    the whole local batch's token ids and labels and one (T, d) tensor more (+0.33%)."""
    from parsim.executor.trace import trace_in_subprocess

    plan = Plan(seq_len=128, param_dtype="float32", reduce_dtype="float32", **kw)
    m = run_plan("tiny", plan, plan.world_size, steps=1, warmup=1, device="cpu")
    assert m.status == "ok", m.error
    for r in ranks:
        t = trace_in_subprocess(PRESETS["tiny"], plan, r)
        assert m.provenance["peak_memory_bytes_per_rank"][r] == pytest.approx(t.peak_memory_bytes, rel=0.005), r


@pytest.mark.slow
def test_bad_wrapper_order_is_recorded_not_raised(tmp_path):
    # FSDP before TP breaks a fundamental rule: TP cannot redistribute FSDP's DTensor parameters
    plan = Plan(dp_shard=2, tp=2, seq_len=S, local_batch_size=2, param_dtype="float32",
                wrapper_order=("pp", "fsdp", "tp", "ac", "compile"))
    out = tmp_path / "m.json"
    m = run_plan("tiny", plan, 4, steps=1, warmup=1, timeout_s=300, device="cpu", out=str(out))
    assert m.status == "error" and "mesh" in m.error
    assert out.exists() and '"status": "error"' in out.read_text()


@pytest.mark.slow
def test_one_step_profiled_by_kernel_beside_the_timed_steps(tmp_path, monkeypatch):
    """PARSIM_TORCH_PROFILE runs one more step under torch.profiler and writes each rank's ops with their self
    times (how the first H100's step breakdown was read); the timed steps stay as many as asked."""
    import csv

    monkeypatch.setenv("PARSIM_TORCH_PROFILE", str(tmp_path / "prof"))
    plan = Plan(dp_shard=2, seq_len=64, local_batch_size=1, micro_batch_size=1)
    m = run_plan("tiny", plan, 2, steps=2, warmup=1, device="cpu")
    assert m.status == "ok" and len(m.step_times_s) == 2
    for r in (0, 1):
        rows = list(csv.DictReader(open(tmp_path / f"prof.rank{r}.csv")))
        mm = [x for x in rows if x["name"] == "aten::mm"]
        assert mm and int(mm[0]["calls"]) > 0 and float(mm[0]["self_cpu_us"]) > 0


@pytest.mark.slow
def test_hung_run_is_killed_and_recorded(monkeypatch):
    """A run past its timeout is ended with every worker torchrun started (they live in sessions of their own) and
    recorded. The wall-time bound is liveness, not speed: it only fails if the tree is not ended (before the fix
    the call never returned)."""
    import time
    import uuid

    from parsim.procs import tagged_pids

    mark = uuid.uuid4().hex  # inherited by torchrun and its workers: finds them even after re-parenting
    monkeypatch.setenv("PARSIM_TEST_MARK", mark)
    t0 = time.monotonic()
    m = run_plan("tiny", Plan(dp_shard=2, seq_len=S, local_batch_size=4), 2, steps=100_000, warmup=1, timeout_s=5,
                 device="cpu")
    assert m.status == "timeout" and "killed after" in m.error
    assert time.monotonic() - t0 < 5 + 60
    assert tagged_pids(mark, "PARSIM_TEST_MARK") == set()


def test_the_shared_trace_server_traces_as_a_fresh_process():
    """The module's traces run one after another in one server (``Tracer``): a plan traced there after others gives
    what a fresh interpreter gives, to the byte."""
    from parsim.executor.trace import trace_in_subprocess

    assert trace_plan(PRESETS["tiny-moe"], Plan(dp_shard=4, ep=2, seq_len=64)).status == "ok"  # another world first
    spec, plan = PRESETS["tiny"], Plan(dp_shard=2, tp=2, seq_len=64, ac="selective-op")
    shared, fresh = trace_plan(spec, plan), trace_in_subprocess(spec, plan)
    assert shared.status == fresh.status == "ok"
    assert shared.peak_memory_bytes == fresh.peak_memory_bytes
    assert shared.memory_breakdown_bytes == fresh.memory_breakdown_bytes
    assert shared.comm_bytes == fresh.comm_bytes
    assert shared.reserved_peak_memory_bytes == fresh.reserved_peak_memory_bytes


def _assert_trace_matches_prediction(spec, plan, mem_tol):
    t, p = _assert_trace_comm_matches(spec, plan)
    assert p.peak_memory_bytes == pytest.approx(t.peak_memory_bytes, rel=mem_tol)
    return t


def _assert_trace_comm_matches(spec, plan):
    t = trace_plan(spec, plan)
    assert t.status == "ok", t.error
    p = predict(spec, plan, H100)
    # collective bytes are exact; the 4-byte gradient-norm all-reduce of DTensor.full_tensor is not seen by
    # the counter under FakeTensorMode, so all_reduce entries of 4 bytes are left out on both sides
    pc = {k: v for k, v in p.comm_bytes.items() if v > 4}
    tc = {k: v for k, v in t.comm_bytes.items() if v > 4}
    assert pc.keys() == tc.keys()
    for k in pc:
        assert abs(pc[k] - tc[k]) <= 4, (k, pc[k], tc[k])
    return t, p


def test_trace_64_rank_fsdp_tp_matches_the_model():
    # llama3-8b (8 of its 32 layers: each is traced alike, and CI time is short), FSDP 8 x TP 8 on 64 fake ranks,
    # in this one process
    _assert_trace_matches_prediction(LLAMA8_CUT, Plan(dp_shard=8, tp=8, seq_len=2048), 0.01)


def test_trace_selective_ac_without_sequence_parallel_matches_the_model():
    # TP without SP all-reduces the row-parallel outputs; selective-op AC recomputes the attention's (the MLP's is
    # consumed by the residual add alone, and the recompute stops before it): one more all-reduce per layer
    _assert_trace_matches_prediction(PRESETS["tiny"], Plan(dp_shard=2, tp=2, seq_len=256, ac="selective-op",
                                                           sequence_parallel=False), 0.01)


_TINY1, _TINY2 = (dataclasses.replace(PRESETS["tiny"], n_layers=n) for n in (1, 2))
PLAIN_CASES = {
    # RoPE's cos / sin table: one per layer and microbatch, sized by the positions (not the tokens), and a view of
    # the fp32 cache (no bytes) when q is fp32 (+0.39% before)
    "rope-table-per-sequence": (_TINY2, dict(tp=2, seq_len=256, local_batch_size=4, param_dtype="float32",
                                             reduce_dtype="float32")),
    # loss parallel's per-token index tensors in its backward, and (CP) the step's token ids and labels (-0.25%)
    "loss-parallel-index-tensors": (_TINY2, dict(dp_shard=2, cp=2, tp=2, seq_len=512, local_batch_size=2,
                                                 ac="full")),
    # the step's token ids and labels, 16 B per token of the local batch (-0.31%)
    "step-inputs": (_TINY1, dict(dp_shard=2, cp=2, tp=2, seq_len=2048, local_batch_size=1, ac="full")),
    # TP without FSDP (autocast): the final norm's input fp32, and the output projection's input gradient cast back
    # to fp32 and reduced, its saved input released (-0.46% with SP, -1.6% without before)
    "autocast-tp-output-gradient-reduction": (_TINY2, dict(tp=4, seq_len=256, local_batch_size=4)),
    "autocast-tp-output-gradient-all-reduce": (_TINY2, dict(tp=4, seq_len=256, local_batch_size=4,
                                                            sequence_parallel=False)),
    # a few wide layers: the peak at w2's reduce-scatter in the forward, the block still unsharded (-2.1%)
    "tp-output-reduction-in-forward": (dataclasses.replace(_TINY1, d_model=1000, n_heads=24, n_kv_heads=8,
                                                           head_dim=48, d_ff=1408, vocab_size=1001),
                                       dict(dp_replicate=2, dp_shard=2, tp=4, seq_len=256, local_batch_size=1,
                                            param_dtype="float32", reduce_dtype="float32")),
    # TP-sharded routed experts under autocast, a later accumulation step's backward: the three experts' new
    # gradients held until the experts' backward ends (their to_local nodes run last), the permuted input and its
    # gradient fp32, and the grouped GEMM's per-expert casts (-10.5% before; -8.6% without the hold, -1.3% with the
    # permuted input bf16, -0.34% without the casts)
    "autocast-tp-experts-held-gradients": (
        dataclasses.replace(PRESETS["tiny-moe"], name="wide-experts", n_layers=1, vocab_size=1000,
                            moe=dataclasses.replace(PRESETS["tiny-moe"].moe, d_ff_expert=1024, n_shared_experts=0,
                                                    first_k_dense=0)),
        dict(tp=4, seq_len=256, local_batch_size=2, global_batch_size=4)),
    # whole experts under TP with EP: each TP rank routes a slice of the gathered tokens, whose backward makes a
    # zero (T, d) gradient with the share copied in (-0.41% before: the model freed 24 KiB per MoE block it had
    # never made, its activations negative at the end of the backward)
    "tp-ep-routed-share-slice-backward": (dataclasses.replace(PRESETS["tiny-moe"], n_layers=2),
                                          dict(dp_shard=4, tp=4, ep=8, seq_len=64)),
    # ring attention (CP) with one head on the rank: its (batch, 1, seq, head_dim) output transposed is contiguous
    # and wo's input a view, not the copy it is with more heads (+0.64% before, bench/differential.py --no-dp
    # --seed 13: +2.6% on a pp3 x cp4 x tp2 GPipe stage)
    "cp-one-head-wo-input-view": (dataclasses.replace(_TINY1, d_model=128, n_heads=2, n_kv_heads=2, head_dim=64,
                                                      d_ff=1000, vocab_size=1001),
                                  dict(cp=2, tp=2, seq_len=64, local_batch_size=12)),
    # routed experts with EP (their own FSDP unit) gathered again by their pre-forward in the recompute (full AC):
    # a forward's gather, whose flat buffer FSDP2 keeps until the next unshard, through the block's recompute
    # (-0.91% before; a fresh draw, seed 23, shrunk)
    "moe-ep-recompute-keeps-experts-flat-buffer": (dataclasses.replace(PRESETS["mixtral-8x7b"], n_layers=1),
                                                   dict(dp_shard=6, ep=2, seq_len=96, local_batch_size=2, ac="full",
                                                        param_dtype="float32", reduce_dtype="float32")),
    # a recompute under autocast (bf16 without FSDP) ends inside the MLP with the MLP's fp32 input held beside the
    # bf16 copy w1 saves, and the bf16 copy of the residual gradient w2's backward reads made before it (-3.8%
    # before; bench/differential.py --seed 22: -4.0% on a pp4 x tp8 last stage, shrunk; SwiGLU and SP alike)
    "autocast-recompute-holds-mlp-input": (dataclasses.replace(_TINY1, d_model=512, n_heads=32, n_kv_heads=8,
                                                               head_dim=64, d_ff=2816, mlp="gelu", vocab_size=4099),
                                           dict(tp=8, seq_len=1024, ac="full", sequence_parallel=False)),
    # a recomputed MoE block under TP x EP (full AC): through the recompute the gradient made before it (the routed
    # pairs', or with shared experts the gathered output gradient) and the FFN norm's sequence shard, and at w2's
    # grouped GEMM the routed and received tokens and two per-expert matmul outputs, the shared experts not yet
    # recomputed (-7.5% / -3.7% before; 3000 draws: -3.4% on dp_replicate 3 x dp_shard 6 x tp 2 x ep 4, shrunk)
    **{f"moe-tp-ep-recompute-{k}-shared": (
        dataclasses.replace(PRESETS["tiny-moe"], n_layers=1,
                            moe=dataclasses.replace(PRESETS["tiny-moe"].moe, first_k_dense=0, n_shared_experts=k)),
        dict(dp_shard=2, ep=2, tp=2, seq_len=512, ac="full", fsdp_reshard_after_forward="always",
             param_dtype="float32", reduce_dtype="float32")) for k in (0, 1)},
    # selective AC caches both EP all-to-all outputs of every MoE layer (autograd saves neither: -3.9% at the end of
    # the forward before; seed 21 -2.1%, 3000 draws -1.45% on a pp3 x tp4 x ep8 stage), and its recompute under TP
    # x EP holds the routed tokens, the cached received ones and the combine's cached output at w2's GEMM (-7.7%)
    "moe-ep-sac-caches-all-to-alls": (
        dataclasses.replace(PRESETS["tiny-moe"], n_layers=4, vocab_size=16384,
                            moe=dataclasses.replace(PRESETS["tiny-moe"].moe, first_k_dense=0, n_shared_experts=0)),
        dict(dp_shard=2, ep=2, seq_len=512, ac="selective-op", param_dtype="float32", reduce_dtype="float32")),
    "moe-tp-ep-sac-recompute": (
        dataclasses.replace(PRESETS["tiny-moe"], n_layers=1,
                            moe=dataclasses.replace(PRESETS["tiny-moe"].moe, first_k_dense=0, n_shared_experts=0)),
        dict(dp_shard=2, ep=2, tp=2, seq_len=512, ac="selective-op", fsdp_reshard_after_forward="always",
             param_dtype="float32", reduce_dtype="float32")),
}


@pytest.mark.parametrize("case", sorted(PLAIN_CASES))
def test_trace_memory_classes_without_pp(case):
    spec, kw = PLAIN_CASES[case]
    _assert_trace_matches_prediction(spec, Plan(**kw), 0.002)


@pytest.mark.parametrize("schedule", [pytest.param("GPipe", marks=pytest.mark.long), "1F1B"])
def test_trace_pp_fsdp_tp_experts_hold_their_new_gradients(schedule):
    # TP-sharded routed experts on a pipeline stage with FSDP (no gradient sync before the last microbatch, bf16
    # params and reduce): a later microbatch's backward holds the experts' three new gradients beside the
    # accumulated ones until the experts' backward ends, as without FSDP (-3.1..-6.0% before, both stages)
    from parsim.costmodel.layers import FIRST, LAST
    from parsim.costmodel.step import rank_details

    spec = dataclasses.replace(PLAIN_CASES["autocast-tp-experts-held-gradients"][0], n_layers=2)
    plan = Plan(pp=2, dp_shard=2, tp=4, seq_len=256, local_batch_size=4, micro_batch_size=1, pp_schedule=schedule,
                param_dtype="bfloat16", reduce_dtype="bfloat16")
    det = rank_details(spec, plan, H100)
    for which, rank in ((FIRST, 0), (LAST, 8)):
        t = trace_plan(spec, plan, rank=rank)
        assert t.status == "ok", t.error
        assert det[which]["peak_memory_bytes"] == pytest.approx(t.peak_memory_bytes, rel=0.002), (schedule, rank)


def test_trace_pp_autocast_moe_backward_leaves_nothing_behind():
    # under autocast (bf16 without FSDP) the routed experts' input gradient is fp32, the permuted tokens' dtype: the
    # model freed it as bf16 at the token gather's backward, and every microbatch's backward left routed pairs x d
    # x 2 B behind, seen at a later microbatch's peak of a pipeline's first stage (+0.60% before; seed 21 +0.58%)
    from parsim.costmodel.layers import FIRST
    from parsim.costmodel.step import rank_details

    spec = dataclasses.replace(PRESETS["tiny-moe"], n_layers=4,
                               moe=dataclasses.replace(PRESETS["tiny-moe"].moe, n_shared_experts=0))
    plan = Plan(pp=2, tp=2, seq_len=256, local_batch_size=4, micro_batch_size=1, global_batch_size=4)
    t = trace_plan(spec, plan, rank=0)
    assert t.status == "ok", t.error
    assert rank_details(spec, plan, H100)[FIRST]["peak_memory_bytes"] == pytest.approx(t.peak_memory_bytes,
                                                                                       rel=0.002)


def test_trace_selective_ac_with_biased_linears_matches_the_model():
    # a linear with a bias runs aten.addmm, which torchtitan's selective-op policy neither saves nor counts: with
    # biases on every linear no GEMM output is kept (the model kept every odd one: +35% before, found by
    # bench/differential.py)
    spec = dataclasses.replace(PRESETS["tiny"], name="biased", n_layers=2, bias=True, d_ff=1536)
    plan = Plan(dp_shard=2, seq_len=512, ac="selective-op", param_dtype="float32")
    _assert_trace_matches_prediction(spec, plan, 0.005)
    unbiased = predict(dataclasses.replace(spec, bias=False), plan, H100)
    assert predict(spec, plan, H100).peak_memory_bytes < unbiased.peak_memory_bytes


@pytest.mark.parametrize("plan_kw", [dict(dp_replicate=2), dict(dp_replicate=2, param_dtype="float32")])
def test_trace_replicate_only_hsdp_reduce_matches_the_model(plan_kw):
    # a shard group of one rank: FSDP2 copies the reduce input divided by the divide factor (one more gradient-
    # sized buffer at the reduce) and neither all-gathers nor prefetches (the parameters are filled when the unit
    # runs): the peak at the block's reduce was 6.5% under before (bench/differential.py's replicate-only gap)
    spec = dataclasses.replace(PRESETS["tiny"], name="wide-block", n_layers=1, d_model=384, n_heads=12,
                               n_kv_heads=4, head_dim=32, d_ff=1536, vocab_size=1000)
    t = _assert_trace_matches_prediction(spec, Plan(seq_len=64, local_batch_size=1, **plan_kw), 0.005)
    assert t.provenance["peak_phase"] == "backward of the last layer"


def _stage_trace_matches(spec, plan, which, mem_tol):
    """The model's view of pipeline stage ``which`` (FIRST / LAST) against a trace of that stage's rank."""
    from parsim.costmodel.step import rank_details, stage_rank

    t = trace_plan(spec, plan, stage_rank(plan, which))
    assert t.status == "ok", t.error
    d = rank_details(spec, plan, H100)[which]
    assert d["peak_memory_bytes"] == pytest.approx(t.peak_memory_bytes, rel=mem_tol)
    return t


_TINY = PRESETS["tiny"]
_MOE = PRESETS["tiny-moe"]
_PP_EMB_SPEC = dataclasses.replace(_TINY, n_layers=5, d_model=512, n_heads=24, n_kv_heads=8, head_dim=128, d_ff=2048,
                                   vocab_size=32003, mlp="gelu")
_SAC_SPEC = dataclasses.replace(_TINY, n_layers=4, d_model=384, n_heads=12, n_kv_heads=6, head_dim=32, d_ff=1000,
                                vocab_size=2048)
STAGE_CASES = {
    # reshard-after-forward "always" under PP: pipelining's backwards leave every unit unsharded, so a later
    # forward gathers nothing and reshards each unit after it (the model gathered again: +44%)
    "pp-always": (dataclasses.replace(_TINY, n_layers=2, d_model=96, n_heads=3, n_kv_heads=1, head_dim=32,
                                      d_ff=1344, vocab_size=8192, mlp="gelu"),
                  dict(pp=2, dp_shard=2, seq_len=32, local_batch_size=4, micro_batch_size=1, param_dtype="float32",
                       ac="full", fsdp_reshard_after_forward="always"), "last", 0.005),
    # PP without an upcast: the accumulation stays on the unsharded parameters' .grad, a later microbatch's new
    # gradients are added in place as autograd makes them (the model held a unit's worth: +6.7%)
    "pp-no-upcast": (dataclasses.replace(_TINY, d_model=1000, n_heads=8, n_kv_heads=4, head_dim=128, d_ff=2730,
                                         vocab_size=1001, mlp="gelu"),
                     dict(pp=2, dp_shard=3, seq_len=64, local_batch_size=4, micro_batch_size=1,
                          reduce_dtype="bfloat16"), "last", 0.005),
    # autocast (no FSDP, bf16): each linear casts the fp32 norm output itself and keeps its copy (-4.3% before;
    # what is left, -0.7%, is in the last layer's backward)
    "autocast-casts": (dataclasses.replace(_TINY, n_layers=1, d_model=288, n_heads=6, n_kv_heads=2, head_dim=48,
                                           d_ff=1024, vocab_size=1001),
                       dict(tp=2, seq_len=384), "first", 0.01),
    # MoE with ep 1: the experts belong to the block's unit; their (empty) gather released the block's flat
    # all-gather buffer early in the model (-14% with large experts)
    "moe-ep1-flat": (dataclasses.replace(_MOE, n_layers=2, d_ff=256, moe=dataclasses.replace(
        _MOE.moe, first_k_dense=0, d_ff_expert=1024)),
                     dict(dp_shard=4, seq_len=64, local_batch_size=2, param_dtype="float32",
                          fsdp_reshard_after_forward="never"), "first", 0.005),
    # interleaved schedules: the model replays torch's own action list (UNSHARD / F / B / REDUCE_GRAD / RESHARD per
    # stage) instead of the coarse moments (+10.7% and +13.2% before)
    "interleaved-replay": (dataclasses.replace(_TINY, n_layers=4),
                           dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, dp_shard=2, seq_len=128,
                                local_batch_size=4, micro_batch_size=1), "first", 0.005),
    "interleaved-always-full-ac": (dataclasses.replace(_TINY, n_layers=4),
                                   dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, dp_shard=2,
                                        seq_len=128, local_batch_size=4, micro_batch_size=1, ac="full",
                                        fsdp_reshard_after_forward="always"), "last", 0.005),
    # a pipeline stage's reduce over a shard group of one (replicate-only HSDP): the embedding's accumulator is
    # gone after the copy-in, no loop variable keeps it (+15% before)
    "pp-replicate-embedding": (dataclasses.replace(_TINY, n_layers=2, d_model=512, n_heads=8, n_kv_heads=4,
                                                   head_dim=64, d_ff=1024, vocab_size=50257),
                               dict(pp=2, dp_replicate=4, seq_len=96, local_batch_size=4, micro_batch_size=2,
                                    param_dtype="float32"), "first", 0.005),
    # routed experts FSDP shards on dim 1 (4 shards, 2 local experts): each weight's copy-out goes through a
    # temporary of its size, made during the recompute's forward under AC (-13% before; -1.0% left)
    "moe-dim1-copy-out": (dataclasses.replace(_MOE, n_layers=2, moe=dataclasses.replace(
        _MOE.moe, n_experts=4, d_ff_expert=2048, first_k_dense=0, n_shared_experts=0)),
                          dict(dp_shard=8, ep=2, seq_len=64, local_batch_size=1, param_dtype="float32",
                               fsdp_reshard_after_forward="always", ac="full"), "first", 0.015),
    # the optimizer's foreach temporaries are per param group, one group per mesh: routed experts (EP) and the
    # rest never hold theirs together (+4.0% before)
    "moe-optimizer-groups": (dataclasses.replace(_MOE, n_layers=6, vocab_size=32768, moe=dataclasses.replace(
        _MOE.moe, n_experts=16, d_ff_expert=1024, first_k_dense=0, n_shared_experts=0)),
                             dict(dp_shard=4, ep=2, seq_len=32, local_batch_size=1), "first", 0.005),
    # a checkpointed MoE block's forward holds its routed working set (tokens, received tokens, experts' output,
    # weighted copy, scatter target ...), the peak here; and a GeLU model's routed experts are SwiGLU, as the
    # executor and torchtitan build them (-3.7% before)
    "moe-forward-working-set": (dataclasses.replace(
        _MOE, n_layers=8, d_model=144, n_heads=3, n_kv_heads=1, head_dim=48, d_ff=1024, vocab_size=32003, mlp="gelu",
        moe=dataclasses.replace(_MOE.moe, n_experts=12, top_k=2, d_ff_expert=256, first_k_dense=0)),
                                dict(dp_shard=3, ep=3, ac="layer:3", seq_len=192, local_batch_size=2,
                                     micro_batch_size=2, fused_loss=True, param_dtype="float32",
                                     reduce_dtype="bfloat16", wrapper_order=("compile", "tp", "pp", "ac", "fsdp")),
                                "first", 0.005),
    # a recomputed MoE block's backward: the combine's sum backward makes the routed pairs' gradient before the
    # recompute runs, whose combine holds the weighted copy and the scatter target beside it (-8.1% before; the
    # 1.0% left is not placed)
    "moe-recompute-combine": (dataclasses.replace(_MOE, n_layers=2, d_model=512, n_heads=8, n_kv_heads=4, head_dim=64,
                                                  vocab_size=1024, moe=dataclasses.replace(
                                                      _MOE.moe, first_k_dense=0, n_shared_experts=0, d_ff_expert=128,
                                                      top_k=4)),
                              dict(tp=2, dp_shard=2, seq_len=1024, local_batch_size=1, param_dtype="float32", ac="full",
                                   fsdp_reshard_after_forward="never"), "first", 0.015),
    # selective AC counts a grouped expert GEMM's per-expert aten.mm's like any other and keeps the odd ones:
    # half of each routed GEMM's output with an even number of local experts (+4.3% before: kept whole)
    "moe-sac-grouped-mm": (dataclasses.replace(_MOE, n_layers=2, moe=dataclasses.replace(
        _MOE.moe, first_k_dense=0, n_shared_experts=0, d_ff_expert=2048, n_experts=4)),
                           dict(tp=2, dp_shard=2, seq_len=512, local_batch_size=1, param_dtype="float32",
                                ac="selective-op"), "first", 0.005),
    # with EP the recompute's combine all-to-all holds the routed and received tokens, the experts' output and its
    # regrouped copy beside the pairs' gradient (-13.4% before)
    "moe-ep-recompute-all-to-all": (dataclasses.replace(_MOE, n_layers=2, d_model=512, n_heads=8, n_kv_heads=4,
                                                        head_dim=64, moe=dataclasses.replace(
                                                            _MOE.moe, first_k_dense=0, n_shared_experts=0,
                                                            d_ff_expert=512, n_experts=2, top_k=2)),
                                    dict(dp_shard=2, ep=2, seq_len=2048, local_batch_size=1, param_dtype="float32",
                                         ac="full"), "first", 0.005),
    # a grouped expert GEMM's backward fills its weight and input gradients expert by expert through one matmul
    # output each: with one local expert (ep 8 of 8) that output is a whole expert weight's gradient (-5.7% before)
    "moe-grouped-mm-backward": (dataclasses.replace(PRESETS["mixtral-8x7b"], n_layers=2),
                                dict(pp=2, dp_shard=16, cp=2, ep=8, ac="layer:1", seq_len=512, local_batch_size=4,
                                     micro_batch_size=2, param_dtype="float32",
                                     mesh_order=("tp", "dp_replicate", "dp_shard", "pp", "cp"),
                                     wrapper_order=("tp", "pp", "ac", "compile", "fsdp")), "first", 0.005),
    # selective AC: the recompute stops before w2's mm, so the outputs the selective-AC cache holds from there on
    # (w2's, its mm being odd-numbered) stay alive through the layer's backward (-0.75% before)
    "sac-uncollected": (_SAC_SPEC, dict(dp_shard=8, ac="selective-op", seq_len=192, local_batch_size=2), "first",
                        0.002),
    # ... and with TP + SP the MLP's reduce-scatter output too (-0.5% before, -1.5% with the next fix alone)
    "sac-uncollected-sp": (_SAC_SPEC, dict(dp_shard=4, tp=2, ac="selective-op", seq_len=192, local_batch_size=2),
                           "first", 0.002),
    # SP: w2's backward is the last use of the all-gathered output gradient, freed there, not at the block's end
    # (+1.7% before, full AC, at the SwiGLU backward)
    "sp-gathered-gradient-freed": (dataclasses.replace(_SAC_SPEC, n_layers=2),
                                   dict(dp_shard=4, tp=2, ac="full", seq_len=192, local_batch_size=2), "first", 0.002),
    # under TP the activation gradients are DTensors, so autograd sums two gradients of one tensor out of place:
    # wk's and wv's input gradients and their sum alive at once (GeLU MLP, whose backward is lighter: -2.6% before)
    "tp-gradient-sum-out-of-place": (dataclasses.replace(_SAC_SPEC, n_layers=2, d_model=2304, mlp="gelu"),
                                     dict(dp_shard=8, tp=2, seq_len=384, local_batch_size=2), "first", 0.002),
    # a stage before the last holds its output and the gradient it received until the microbatch's backward
    # returns, and under SP the embedding's backward reads the all-gathered output gradient: at the first stage's
    # embedding backward (-3.6% without SP, -2.3% with it before)
    "pp-stage-output-and-received-gradient": (_PP_EMB_SPEC, dict(pp=2, tp=8, ac="full", seq_len=2048,
                                                                 local_batch_size=3, micro_batch_size=1,
                                                                 sequence_parallel=False), "first", 0.002),
    # the output projection's backward makes its input gradient (T x d) beside its weight gradient and the logits'
    # gradient, the final norm's saved input and output still alive: a last stage with few tokens and a large
    # vocabulary peaks there (-0.96% before)
    "pp-output-projection-input-gradient": (dataclasses.replace(PRESETS["llama3-70b"], n_layers=2),
                                            dict(pp=2, dp_shard=8, tp=4, ac="layer:3", seq_len=384,
                                                 local_batch_size=6, micro_batch_size=2, param_dtype="float32",
                                                 reduce_dtype="bfloat16"), "last", 0.002),
    "pp-embedding-gathered-gradient": (_PP_EMB_SPEC, dict(pp=2, tp=8, ac="full", seq_len=2048, local_batch_size=3,
                                                          micro_batch_size=1), "first", 0.002),
    # the first stage's output and received gradient live until its backward call returns, after the root unit's
    # post-backward (fp32 gradient accumulators under gradient accumulation): -0.7% before
    "pp-held-through-root-post-backward": (dataclasses.replace(_MOE, n_layers=2),
                                           dict(pp=2, dp_shard=2, seq_len=64, local_batch_size=4,
                                                micro_batch_size=2), "first", 0.002),
    # the stage's first block sums its FFN norm's gradient into a new residual gradient beside the received one,
    # which the schedule holds: both alive through the rest of the stage's backward (-0.6% before)
    "pp-first-sum-beside-received-gradient": (dataclasses.replace(_PP_EMB_SPEC, n_layers=4, d_model=1536, n_heads=12,
                                                                  n_kv_heads=6, d_ff=1000, vocab_size=1001),
                                              dict(pp=2, dp_shard=2, tp=2, seq_len=256, local_batch_size=2,
                                                   micro_batch_size=1), "first", 0.002),
}


@pytest.mark.parametrize("case", sorted(STAGE_CASES))
def test_trace_memory_classes_found_by_the_differential(case):
    from parsim.costmodel.step import FIRST, LAST

    spec, kw, which, tol = STAGE_CASES[case]
    _stage_trace_matches(spec, Plan(**kw), FIRST if which == "first" else LAST, tol)


def test_a_new_gradient_is_grad_only_after_its_own_moment():
    """A pipeline's last stage under FSDP without sync (GPipe, fp32): the first microbatch's backward keeps each
    weight gradient as made as the parameter's .grad, but at the moment the matmul makes it (here the stage's peak)
    it is not .grad yet: AccumulateGrad runs after. The model had it among the gradients at that moment (one MLP
    weight's shard over, 0.49 MiB; peak equal): found by bench/differential.py (3 cases of 3000, one of 104
    without data parallelism)."""
    from parsim.costmodel.step import LAST, rank_details

    spec = dataclasses.replace(_TINY, n_layers=2, d_model=576, n_heads=18, n_kv_heads=6, head_dim=32, d_ff=1344,
                               vocab_size=1000, norm="layernorm")
    plan = Plan(pp=2, cp=2, tp=6, seq_len=384, local_batch_size=4, global_batch_size=4, micro_batch_size=2,
                pp_schedule="GPipe", ac="layer:3", param_dtype="float32", reduce_dtype="float32")
    t = _stage_trace_matches(spec, plan, LAST, 0.002)
    grads = rank_details(spec, plan, H100)[LAST]["memory_breakdown_bytes"]["gradients"]
    assert grads == pytest.approx(t.memory_breakdown_bytes["gradients"], rel=0.001)


_SMALL = dataclasses.replace(_TINY, n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=256,
                             vocab_size=1001)
COMM_CASES = {
    # TP without SP and without data parallelism (autocast: an fp32 residual stream): the row-parallel outputs are
    # all-reduced in bf16, the column-parallel input gradients and the edges in fp32 (the model had all in bf16)
    "tp-no-sp-autocast": (_SMALL, dict(tp=2, sequence_parallel=False, ac="full", seq_len=64, local_batch_size=1,
                                       global_batch_size=2)),
    # MoE under TP: the routed outputs are combined in the block input's dtype (fp32 under autocast), so their
    # all-reduce (no SP), reduce-scatter and its backward all-gather (SP) move fp32; EP's dispatch moves the fp32
    # input, its combine the bf16 expert outputs
    "moe-tp-no-sp": (dataclasses.replace(_MOE, n_layers=2), dict(tp=2, sequence_parallel=False, seq_len=64,
                                                                  local_batch_size=1, ac="selective-op")),
    "moe-tp-ep-sp": (dataclasses.replace(_MOE, n_layers=2), dict(tp=2, ep=2, seq_len=64, local_batch_size=1)),
}


@pytest.mark.parametrize("case", sorted(COMM_CASES))
def test_trace_collective_dtypes_found_by_the_differential(case):
    spec, kw = COMM_CASES[case]
    _assert_trace_comm_matches(spec, Plan(**kw))  # every collective's bytes per (op, axis), exact


def test_trace_sees_the_ring_attention_backward_buffers():
    # the ring attention backward's fp32 accumulators, K/V all-gather and permutes are allocated inside DTensor's
    # op handler, where a Python dispatch mode is popped: the trace's tracker now sees them through the fake
    # mode below DTensor (before, 19 CP plans of the differential looked up to 17% over-predicted)
    spec = dataclasses.replace(PRESETS["tiny"], name="long-context", n_layers=2, d_model=384, n_heads=12,
                               n_kv_heads=6, head_dim=32, d_ff=512, vocab_size=1001)
    t = _assert_trace_matches_prediction(spec, Plan(cp=2, dp_shard=2, seq_len=4096, local_batch_size=1,
                                                    ac="full"), 0.005)
    assert t.provenance["peak_phase"] == "backward of the last layer"


def test_trace_output_projection_backward_with_few_tokens_matches_the_model():
    # 192 tokens per rank (CP 2 of 384) and a 50k vocabulary: the output projection's weight gradient (vocab x d)
    # outgrows the loss's per-token tensors, so the peak is the projection's backward, with the logits' gradient
    # alive beside that weight gradient (the model left the logits' gradient out of that moment: -8.5%, found by
    # bench/differential.py)
    spec = dataclasses.replace(PRESETS["tiny"], name="few-tokens-big-vocab", d_model=512, n_heads=12, n_kv_heads=6,
                               head_dim=64, d_ff=512, n_layers=1, vocab_size=50257)
    _assert_trace_matches_prediction(spec, Plan(dp_shard=3, cp=2, seq_len=384, local_batch_size=1,
                                                param_dtype="float32", reduce_dtype="bfloat16", fused_loss=True,
                                                fsdp_reshard_after_forward="never"), 0.005)


def test_trace_context_parallel_matches_the_model():
    # llama3-8b (8 layers) FSDP 4 x CP 2 at 8k: torch's ring attention (all-gather rotation) traced on CPU; the K/V
    # all-gathers, the fp32 dK/dV ring permutes and the end-of-forward peak (with the wo input's copy of the merged
    # attention output) as the model says
    t = _assert_trace_matches_prediction(LLAMA8_CUT, Plan(dp_shard=4, cp=2, seq_len=8192), 0.005)
    kv = 8192 // 2 * (1024 + 1024)  # tokens per rank x (K + V) widths
    assert t.comm_bytes["all_gather/cp"] == 8 * 2 * kv * 2  # forward and backward, bf16
    assert t.comm_bytes["all_to_all/cp"] == 8 * 2 * kv * 4  # cp permutes per layer, fp32


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.long)])  # the fused: 2 min of chunks
def test_trace_of_the_loss_matches_the_model(fused):
    # llama3-8b (8 of its layers), FSDP 8 without TP: whole-vocabulary logits (4096 x 128256 per rank) set the
    # peak; torch's fp32 cross-entropy keeps 12 B/logit at its peak, the fused one 4 (the bf16 logits and their
    # gradient). With the
    # fused loss the trace's peak (an aten.empty in the loss's backward) is 0.63 GiB above the model's (1.8% at 32
    # layers), not itemized yet: hence 2.5% there
    t = _assert_trace_matches_prediction(LLAMA8_CUT, Plan(dp_shard=8, seq_len=2048, local_batch_size=2,
                                                          fused_loss=fused), 0.025 if fused else 0.01)
    p = predict(LLAMA8_CUT, Plan(dp_shard=8, seq_len=2048, local_batch_size=2, fused_loss=not fused), H100)
    logits = 2 * 2048 * 128256
    assert (p.peak_memory_bytes - t.peak_memory_bytes) * (1 if fused else -1) > 4 * logits


@pytest.mark.long
def test_trace_with_another_device_order_matches_the_model():
    # the example order at full scale: TP outer of FSDP (FSDP groups strided, TP groups contiguous)
    _assert_trace_matches_prediction(PRESETS["llama3-8b"], Plan(dp_shard=8, tp=8, seq_len=2048,
                                                                mesh_order=("pp", "dp_replicate", "cp", "tp",
                                                                            "dp_shard")), 0.01)


@pytest.mark.slow
def test_trace_pp_matches_the_model():
    # llama3-8b (8 layers: 2 per stage) PP 4 x FSDP 2 x TP 8, 1F1B with 8 microbatches (steady state reached) on 64
    # ranks
    _assert_trace_matches_prediction(LLAMA8_CUT, Plan(pp=4, dp_shard=2, tp=8, seq_len=2048,
                                                                local_batch_size=8, micro_batch_size=1), 0.01)


def test_trace_pp_autocast_last_stage_holds_its_input_through_the_deferred_casts():
    # pipeline without data parallelism (autocast, plain gradients), a later microbatch on the last stage: the cast
    # weights' gradients are converted last, inside the stage's backward call, with the received input and its
    # gradient still held by the schedule (-0.92% before, found by bench/differential.py --no-dp --seed 12)
    from parsim.costmodel.layers import LAST

    spec = dataclasses.replace(PRESETS["tiny"], n_layers=3)
    plan = Plan(pp=3, seq_len=128, local_batch_size=4, micro_batch_size=1, ac="layer:1", fused_loss=True)
    t = _stage_trace_matches(spec, plan, LAST, 0.002)
    assert t.provenance["peak_phase"] == "backward of a later microbatch"


def test_trace_pp_later_stage_holds_its_last_input_and_gradient_at_the_reduce():
    # 1F1B / GPipe reduce once after a stage's last backward; the last microbatch's received input and its gradient
    # (referenced by the schedule's send ops) are alive there (-0.75% before, bench/differential.py --seed 21)
    from parsim.costmodel.layers import LAST

    spec = dataclasses.replace(PRESETS["tiny"], n_layers=2)
    plan = Plan(pp=2, dp_shard=2, seq_len=64, local_batch_size=2, micro_batch_size=2, pp_schedule="GPipe")
    t = _stage_trace_matches(spec, plan, LAST, 0.002)
    assert t.provenance["peak_phase"] == "end of backward"


def test_trace_pp_last_stage_keeps_each_in_flight_microbatch_logits():
    # torch's pipeline stage keeps a microbatch's output until its backward returns: on the last stage its logits,
    # for each microbatch in flight (GPipe: all 8), beside what the loss saved (-8.4% before: 7 MiB of fp32 logits)
    from parsim.costmodel.layers import LAST

    plan = Plan(pp=2, seq_len=128, local_batch_size=8, micro_batch_size=1, pp_schedule="GPipe",
                param_dtype="float32", reduce_dtype="float32")
    _stage_trace_matches(PRESETS["tiny"], plan, LAST, 0.002)


@pytest.mark.parametrize("schedule,v", [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_trace_and_model_keep_torchs_pipeline_receive_buffers(schedule, v):
    # torch's stages receive every microbatch's input (stages after the first) and output gradient (stages before
    # the last) into buffers made once and kept across steps: both sides count all of them, whichever microbatches
    # are in flight (interleaved rank 0: stage 0's 8 gradient buffers, stage 2's 8 input and 8 gradient buffers).
    # The interleaved (runtime) schedule also keeps every send's work, holding what it sent, to the step's end:
    # 8 microbatches on pp2 x v2 leave one whole period out of the model's replay, whose sends count all the same
    # (-1.5% before)
    from parsim.costmodel.layers import FIRST, LAST
    from parsim.costmodel.step import rank_details

    plan = Plan(pp=2, pp_stages_per_rank=v, seq_len=128, local_batch_size=8, micro_batch_size=1,
                pp_schedule=schedule, param_dtype="float32", reduce_dtype="float32")
    one = 128 * _TINY.d_model * 4.0
    for which in (FIRST, LAST):
        t = _stage_trace_matches(_TINY, plan, which, 0.001)
        assert t.memory_breakdown_bytes["pipeline_buffers"] == 8 * (2 * v - 1) * one
        assert rank_details(_TINY, plan, H100)[which]["memory_breakdown_bytes"]["pipeline_buffers"] == \
            8 * (2 * v - 1) * one


def test_trace_moe_ep_matches_the_model():
    # a few-million-parameter model: fixed costs the model does not itemize weigh more, hence 8%
    _assert_trace_matches_prediction(PRESETS["tiny-moe"], Plan(dp_shard=8, ep=4, seq_len=256,
                                                               local_batch_size=2), 0.08)


@pytest.mark.slow
def test_trace_mixtral_pp_tp_fsdp_ep_matches_the_model():
    """Issue 12's plan: mixtral-8x7b PP 4 x TP 2 x FSDP 8 x EP 2 on 64 ranks (EP borrowed from tp, experts FSDP
    over 8 sharded on dim 1). Peak in the backward of a later microbatch, beside the accumulated gradients."""
    _assert_trace_matches_prediction(PRESETS["mixtral-8x7b"], Plan(pp=4, dp_shard=8, tp=2, ep=2, seq_len=4096,
                                                                   local_batch_size=4, micro_batch_size=1), 0.01)


@pytest.mark.slow
def test_trace_qwen3_moe_tp_ep_matches_the_model():
    # qwen3-30b-a3b FSDP 32 x TP 2 with EP 32 (from dp_shard x tp) on 64 ranks: q/k norms, 128 experts top-8
    # (8 of its 48 layers: the per-layer arithmetic is what is checked, and 48 layers trace in ~45 s)
    qwen = dataclasses.replace(PRESETS["qwen3-30b-a3b"], n_layers=8)
    _assert_trace_matches_prediction(qwen, Plan(dp_shard=32, tp=2, ep=32, seq_len=2048, local_batch_size=2), 0.01)


def test_trace_interleaved_full_ac_matches_the_model():
    """Interleaved1F1B (2 stages per rank) with full AC: rank 0 sends gradients back from its second stage, and
    full AC's recompute stops before the block's last reduce-scatter (non-reentrant checkpoint's early stop)."""
    _assert_trace_matches_prediction(LLAMA8_CUT, Plan(pp=2, dp_shard=2, tp=4, seq_len=1024,
                                                                local_batch_size=4, micro_batch_size=1,
                                                                pp_schedule="Interleaved1F1B", pp_stages_per_rank=2,
                                                                ac="full"), 0.01)


def test_torch_schedules_keep_as_many_microbatches_in_flight_as_the_model_says():
    """The cost model's in-flight formula against torch.distributed.pipelining's own pipeline order (the trace takes
    its order from torch, so this is what keeps the two independent and in agreement)."""
    from parsim.codec import encode
    from parsim.costmodel.layers import FIRST, LAST
    from parsim.costmodel.layers import inflight as _inflight
    from parsim.executor.trace import max_inflight, torch_schedule_order

    checked = 0
    for sched, vs in (("GPipe", (1,)), ("1F1B", (1,)), ("Interleaved1F1B", (2, 3))):
        for pp in (2, 4):
            for v in vs:
                for m in (pp, 2 * pp, 4 * pp):
                    plan = Plan(pp=pp, local_batch_size=m, micro_batch_size=1, pp_schedule=sched,
                                pp_stages_per_rank=v, seq_len=256)
                    b = encode([plan], 8)
                    for rank, which in ((0, FIRST), (pp - 1, LAST)):
                        torch_peak = max_inflight(torch_schedule_order(sched, pp, v, m, rank)) / v
                        assert float(_inflight(b, which)[0]) == pytest.approx(torch_peak), (sched, pp, v, m, rank)
                        checked += 1
    assert checked == 2 * (2 * 3 + 2 * 3 + 2 * 2 * 3)


def test_interleaved_action_list_is_torchs_own():
    # the cost model's torch-free port of ScheduleInterleaved1F1B's actions with FSDP (pipeline.interleaved_actions)
    # against the schedule class itself, every rank of every (pp, v, m) torch accepts up to pp 6, v 4, m 16
    from parsim.costmodel.pipeline import interleaved_actions
    from parsim.executor.trace import torch_schedule_order

    checked = 0
    for pp in range(2, 7):
        for v in range(2, 5):
            for m in range(1, 17):
                if m % max(1, m // pp):
                    continue
                for rank in range(pp):
                    assert interleaved_actions(pp, v, m, rank) == torch_schedule_order(
                        "Interleaved1F1B", pp, v, m, rank, with_fsdp=True), (pp, v, m, rank)
                    checked += 1
    assert checked > 500


def test_schedule_order_is_torchs_own():
    # the simulated schedule's order of forwards and backwards (pipeline.schedule_order) against torch's classes
    from parsim.costmodel.pipeline import schedule_order
    from parsim.executor.trace import torch_schedule_order
    from parsim.plan import PP_SCHEDULES

    for name in ("GPipe", "1F1B", "Interleaved1F1B"):
        for pp in (2, 3, 4):
            for m in (pp, 2 * pp, 3 * pp):
                for v in ((2, 3) if name == "Interleaved1F1B" else (1,)):
                    for rank in range(pp):
                        assert schedule_order(PP_SCHEDULES[name], pp, v, m, rank) == torch_schedule_order(
                            name, pp, v, m, rank), (name, pp, v, m, rank)


def test_compressed_interleaved_actions_count_every_backward():
    # the memory replay leaves whole steady periods out (``compress``); what a backward leaves alive to the step's
    # end is not periodic, so each stage's left-out backwards are counted (LEFT_OUT_B) before the second period,
    # and with the kept ones they are every microbatch's: m per stage
    from parsim.costmodel.pipeline import interleaved_actions

    for pp, v, m in ((2, 2, 8), (2, 2, 32), (4, 2, 16), (8, 3, 64)):
        for rank in range(pp):
            full, short = interleaved_actions(pp, v, m, rank), interleaved_actions(pp, v, m, rank, compress=True)
            count: dict = {}
            for kind, stage, n in short:
                if kind in ("B", "LEFT_OUT_B"):
                    count[stage] = count.get(stage, 0) + (1 if kind == "B" else n)
            assert count == {c * pp + rank: m for c in range(v)}, (pp, v, m, rank)
            assert len(short) < len(full) or not any(k == "LEFT_OUT_B" for k, _s, _n in short)
