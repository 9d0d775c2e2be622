"""The trace reader (parsim.traceread): synthetic traces whose attribution is known by hand, the public GPU traces
in tests/data/traces, the partition as a property, and `parsim read-trace` / `calibrate --trace` as commands."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from parsim.cli.main import app
from parsim.errors import ParsimError
from parsim.plan import Plan
from parsim.traceread import _partition, read_trace, read_traces

runner = CliRunner()
DATA = "tests/data/traces"


def op(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def cpu_trace(tmp_path, name="rank0.json"):
    """One CPU step of 100 us: forward GEMM 10 us, forward elementwise 5, backward GEMM 20, a recomputed GEMM 8
    (aten::linear inside a backward node), the optimizer 7; a gloo all-gather 40..60 us (10 us of it under the
    backward GEMM at 45..65, 10 exposed, launched under FSDP) and a reduce-scatter that gloo runs as an all-reduce
    at 80..90 (main thread idle there: exposed)."""
    ev = [op("ProfilerStep#0", 0, 100, cat="user_annotation"),
          op("aten::linear", 5, 12), op("aten::mm", 6, 10),
          op("aten::add", 20, 5),
          op("FSDP::all_gather (layers.0)", 30, 5), op("c10d::_allgather_base_", 31, 2),
          op("autograd::engine::evaluate_function: MmBackward0", 44, 22), op("aten::mm", 45, 20),
          op("autograd::engine::evaluate_function: MmBackward0", 66, 10), op("aten::linear", 67, 9),
          op("aten::mm", 67, 8),
          op("FSDP::post_backward_reduce (layers.0)", 77, 3), op("c10d::_reduce_scatter_base_", 78, 1),
          op("Optimizer.step#AdamW.step", 92, 8), op("aten::add_", 92, 7),
          op("gloo:all_gather", 40, 20, tid=2, cat="user_annotation", **{"Input Dims": [[1000]],
                                                                         "Input type": ["c10::BFloat16"]}),
          op("gloo:all_reduce", 80, 10, tid=3, cat="user_annotation", **{"Input Dims": [[4000]],
                                                                         "Input type": ["float"]})]
    doc = {"traceEvents": ev, "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 2}}
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def test_cpu_step_is_attributed_as_counted_by_hand(tmp_path):
    r = read_trace(str(cpu_trace(tmp_path)))
    (s,) = r.steps
    us = {k: round(v * 1e6, 6) for k, v in s.components_s.items()}
    # forward: mm 10 + linear's self 2 + add 5; backward: mm 20; recompute: mm 8 + linear self 1; optimizer 7
    assert us["compute_forward"] == 17 and us["compute_backward"] == 20 and us["recompute"] == 9
    assert us["optimizer"] == 7
    assert us["comm_fsdp"] == 5 + 10  # all-gather 40..45 exposed, reduce-scatter 80..90 exposed (FSDP launched)
    assert sum(s.components_s.values()) == pytest.approx(s.step_s) and s.step_s == pytest.approx(100e-6)
    kinds = {k: round(v * 1e6, 6) for k, v in s.kinds_s.items()}
    # (aten::linear's own 2 us outside its mm are not GEMM time)
    assert kinds["compute_forward.gemm"] == 10 and kinds["compute_forward.memory"] == 7
    ag, rs = sorted(s.collectives, key=lambda c: c.start_s)
    assert (ag.op, ag.input_bytes, round(ag.exposed_s * 1e6, 6)) == ("all_gather", 2000.0, 5)
    assert s.hidden_comm_s["comm_fsdp"] == pytest.approx(15e-6)  # 45..60 under the backward mm
    assert (rs.op, rs.input_bytes) == ("reduce_scatter", 16000.0)  # gloo's all-reduce, launched as reduce-scatter


def test_a_plan_names_the_fsdp_axis(tmp_path):
    plan = Plan(dp_shard=2, local_batch_size=1, seq_len=128)
    (s,) = read_trace(str(cpu_trace(tmp_path)), plan).steps
    assert "comm_dp_shard" in s.components_s and "comm_fsdp" not in s.components_s


def test_public_nccl_trace_collectives_and_sum():
    """HTA's 2-rank NCCL trace: every collective with op, group size, bytes from its metadata; the components sum
    to the step; the all-reduces' bytes are element counts x 4 (float)."""
    r = read_trace(f"{DATA}/hta-nccl-allreduce-rank0.json.gz")
    assert r.device == "cuda" and r.world_size == 2
    (s,) = r.steps
    assert sum(s.components_s.values()) == pytest.approx(s.step_s, rel=1e-9)
    ars = [c for c in s.collectives if c.op == "all_reduce"]
    assert len(ars) == 5 and all(c.group_size == 2 and c.dtype == "Float" and c.input_bytes % 4 == 0 for c in ars)
    assert all(0 <= c.exposed_s <= c.duration_s for c in s.collectives)
    assert {c.axis for c in s.collectives} == {"default_pg"}
    assert s.components_s["compute_backward"] > s.components_s["compute_forward"] > 0


def test_public_trace_without_collective_metadata():
    """Rank 0 of a 128-GPU job: send/recv kernels without metadata are collectives of unknown size and group."""
    r = read_trace(f"{DATA}/hta-sampled-128gpu-rank0.json.gz")
    assert r.world_size == 128 and len(r.steps) == 2
    for s in r.steps:
        assert sum(s.components_s.values()) == pytest.approx(s.step_s, rel=1e-9)
        assert s.collectives and all(c.op == "send_recv" and c.input_bytes is None for c in s.collectives)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 50)), max_size=12),
       st.lists(st.tuples(st.floats(0, 100), st.floats(0, 50)), max_size=6))
def test_partition_sums_to_the_window(compute, comm):
    c = [(s, s + d, ("compute_forward", "gemm")) for s, d in compute]
    m = [(s, s + d, j) for j, (s, d) in enumerate(comm)]
    by_label, exposed, hidden, idle = _partition(10.0, 90.0, c, m)
    assert sum(by_label.values()) + sum(exposed.values()) + idle == pytest.approx(80.0, abs=1e-9)
    for j, (s, e, _) in enumerate(m):
        inside = max(0.0, min(e, 90.0) - max(s, 10.0))
        assert exposed.get(j, 0.0) + hidden.get(j, 0.0) <= inside + 1e-9


def test_unreadable_traces_say_what_is_missing(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "nostep.json").write_text(json.dumps({"traceEvents": [op("aten::mm", 0, 1)]}))
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    for name, says in (("bad.json", "not a Chrome/Kineto trace"), ("nostep.json", "no profiled steps"),
                       ("empty.json", "no traceEvents")):
        with pytest.raises(ParsimError, match=says):
            read_traces([str(tmp_path / name)])
        r = runner.invoke(app, ["read-trace", str(tmp_path / name)])
        assert r.exit_code == 2 and says in r.stderr and "Traceback" not in r.output


def test_read_trace_json_and_plan_beside(tmp_path):
    gz = tmp_path / "t" / "rank0.json.gz"
    gz.parent.mkdir()
    with gzip.open(gz, "wt") as f:
        f.write(cpu_trace(tmp_path).read_text())
    r = runner.invoke(app, ["read-trace", str(gz.parent), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ranks_read"] == 1 and doc["collectives"][0]["axis"] == "fsdp"
    r = runner.invoke(app, ["read-trace", str(gz.parent), "--json", "--model", "tiny", "--gpus", "2",
                            "--dp-shard", "2", "--local-batch-size", "1", "--seq-len", "128",
                            "--profile", "cpu-gloo-2"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {x["component"]: x for x in doc["rows"]}
    assert {"compute_forward", "compute_backward", "comm_dp_shard"} <= set(rows)
    assert sum(x["traced_s"] for x in doc["rows"]) == pytest.approx(doc["step_traced_s"])
    assert sum(x["predicted_s"] for x in doc["rows"]) == pytest.approx(doc["step_predicted_s"], rel=1e-6)


def test_predicted_kinds_add_up_to_the_compute_phases():
    from parsim.costmodel import predict
    from parsim.hardware import load_profile
    from parsim.spec import load_model
    from parsim.trace_compare import predicted_kinds

    spec, hw = load_model("llama3-8b"), load_profile("h100-sxm-spec")
    plan = Plan(dp_shard=8, local_batch_size=2, seq_len=4096, ac="full")
    tb = predict(spec, plan, hw).time_breakdown_s
    kinds = predicted_kinds(spec, plan, hw)
    for phase in ("compute_forward", "compute_backward", "recompute"):
        assert sum(v for k, v in kinds.items() if k.startswith(phase + ".")) == pytest.approx(float(tb[phase]),
                                                                                             rel=1e-6)
    assert kinds["compute_forward.gemm"] > kinds["compute_forward.attention"] > 0


@pytest.mark.slow
def test_run_trace_read_calibrate_on_two_gloo_ranks(tmp_path):
    """The loop here: `run --profile-trace` on 2 gloo ranks writes one trace per rank and what ran; `read-trace`
    attributes them (all-gather bytes equal to what the run's counter measured); `calibrate --trace` writes a
    profile whose prediction of the traced plan moves toward the traced step."""
    pytest.importorskip("torch")
    tr = tmp_path / "tr"
    flags = ["--model", "tiny", "--gpus", "2", "--dp-shard", "2", "--local-batch-size", "2", "--seq-len", "128"]
    out = subprocess.run(["parsim", "run", *flags, "--nproc-per-node", "2", "--steps", "2", "--param-dtype",
                          "float32", "--profile-trace", str(tr), "--json"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout)
    assert sorted(p.name for p in tr.iterdir()) == ["parsim-plan.json", "rank0.trace.json.gz", "rank1.trace.json.gz"]
    ran = json.loads((tr / "parsim-plan.json").read_text())
    # the measurement is of unprofiled steps; as many more ran under the profiler, timed apart
    assert ran["unprofiled_median_step_s"] == m["median_step_time_s"] and ran["profiled_median_step_s"] > 0
    assert len(m["step_times_s"]) == 2 and len(m["provenance"]["profiled_step_times_s"]) == 2
    r = runner.invoke(app, ["read-trace", str(tr), "--json", "--profile", "cpu-gloo-2"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ranks_read"] == 2 and doc["plan"] == "dp_shard2"
    for rank in doc["ranks"]:
        assert rank["steps"] == 2
        assert sum(rank["components_s"].values()) == pytest.approx(rank["step_s"])
    ag = next(c for c in doc["collectives"] if c["op"] == "all_gather")
    assert ag["axis"] == "dp_shard" and ag["input_bytes"] == pytest.approx(m["comm_bytes"]["all_gather/dp_shard"])
    r = runner.invoke(app, ["calibrate", "--trace", str(tr), "--profile", "cpu-gloo-2", "--out-dir", str(tmp_path),
                            "--json"])
    assert r.exit_code == 0, r.output
    cal = json.loads(r.stdout)
    (p,) = cal["plans"]
    traced = p["traced_step_s"]
    assert abs(p["predicted_after_s"] - traced) < abs(p["predicted_before_s"] - traced)
    assert (tmp_path / "cpu-gloo-2-trace-cal.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt-get install chromium)")
def test_trace_page_renders_in_a_real_browser(tmp_path):
    page = tmp_path / "t.html"
    r = runner.invoke(app, ["read-trace", f"{DATA}/hta-nccl-allreduce-rank0.json.gz", "--html", str(page)])
    assert r.exit_code == 0, r.output
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          "--dump-dom", f"file://{page}"], capture_output=True, text=True, timeout=120).stdout
    assert dom.count('class="main-svg"') >= 2 and "collectives of rank 0" in dom
