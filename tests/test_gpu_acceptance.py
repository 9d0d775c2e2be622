"""``bench/gpu_acceptance.sh --dry-run``: the GPU acceptance path end to end on CPU at tiny scale (profile, search
--measure, executor runs beside predictions, report) — so the command a lent GPU runs has run before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_acceptance_dry_run_writes_profile_and_report(tmp_path):
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_acceptance.sh"), "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "report.json").read_text())
    assert [x["variant"] for x in doc["runs"]] == ["no AC", "full AC"]
    assert all(x["status"] == "ok" and x["meas_step_s"] > 0 and x["pred_step_s"] > 0 for x in doc["runs"])
    assert all(x["meas_allocated_bytes"] > 0 for x in doc["runs"])
    rows = doc["search_measured"]["rows"]
    assert rows and any(x["measured_rank"] == 1 for x in rows)
    prof = json.loads((tmp_path / "dry-run-cpu.json").read_text())
    assert prof["source"] == "measured" and prof["measured_blocks"]  # blocks of the searched and the run plans
    assert "Executor runs beside predictions" in (tmp_path / "report.md").read_text()
    assert not (ROOT / "profiles" / "dry-run-cpu.json").exists()  # a dry run installs nothing


def test_gpu_acceptance_without_a_gpu_says_so():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_acceptance.py"), "--out", "/nonexistent/x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no GPU here" in r.stderr and "Traceback" not in r.stderr


def test_one_gpu_profile_takes_its_interconnect_from_the_spec_profile():
    """One GPU measures no collective: the profile's placeholder links (1 GB/s, one GPU per node) are replaced by
    the spec profile's (NVLink in 8-GPU nodes, InfiniBand), compute and blocks stay measured, and it says so."""
    import dataclasses

    from parsim.hardware import load_profile
    from parsim.profiler.run import spec_profile_of, with_interconnect

    spec = load_profile("h100-sxm-spec")
    gpu = load_profile("h100-measured")  # the first H100's profile (bench/reports/gpu-acceptance/2026-11-28)
    assert gpu.source == "measured" and "H100" in gpu.device_name and gpu.measured_blocks
    assert gpu.provenance["interconnect_from"] == "h100-sxm-spec" == spec_profile_of(gpu.device_name)
    assert gpu.topology == spec.topology and gpu.gpus_per_node == 8
    one = dataclasses.replace(gpu, gpus_per_node=1, collectives=(), corrections={"optimizer_fixed_s": 1e-4})
    got = with_interconnect(one, spec)
    assert got.topology == spec.topology and got.gpus_per_node == spec.gpus_per_node
    assert got.peak_flops == one.peak_flops and got.measured_blocks == one.measured_blocks
    assert got.corrections == {"optimizer_fixed_s": 1e-4, "comm_interference": spec.corrections["comm_interference"]}
    assert "h100-sxm-spec" in got.assumptions[-1]
    assert spec_profile_of("NVIDIA H100 PCIe") is None  # no SXM links for a PCIe card


def test_interconnect_from_is_refused_with_several_ranks(tmp_path):
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from parsim.cli.main import app

    r = CliRunner().invoke(app, ["profile", "--nproc-per-node", "2", "--out", str(tmp_path / "p.json"),
                                 "--interconnect-from", "h100-sxm-spec"])
    assert r.exit_code == 2 and "one rank" in r.output and "Traceback" not in r.output
    assert not list(tmp_path.iterdir())


def test_runs_a_gpu_measured_are_predicted_again_on_the_profile_as_it_is():
    """``--repredict``: the committed GPU runs beside today's predictions, with measured blocks and on the curves
    alone (no torch, no measuring)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_acceptance.py"), "--repredict",
                        str(ROOT / "tests" / "data" / "gpu-acceptance-runs-2026-11-26.json")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [x[0] for x in rows] == ["no", "full", "selective-op", "layer:2", "compile"]
    assert all(float(x[-5]) > 0 and float(x[-4]) > 0 and float(x[-2]) > 0 for x in rows)


def test_the_dispatch_sweep_runs_on_cpu_and_writes_each_point(tmp_path):
    """``bench/gpu_dispatch.py`` on CPU (the host is the device there): every point timed alone, as issued and
    in a chain, written as it is measured."""
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_dispatch.py"), "--out", str(tmp_path), "--model",
                        "tiny", "--tokens", "64,128", "--compile-tokens", "", "--seq-cap", "64", "--reps", "2",
                        "--chain", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "dispatch.json").read_text())
    assert [p["tokens"] for p in doc["points"]] == [64, 128] and not doc["errors"]
    assert all(p[f"{k}_{m}_s"] > 0 for p in doc["points"] for k in ("fwd", "fwd_bwd")
               for m in ("wall", "host", "steady"))


def test_the_float8_compile_check_explains_both_ways_a_float8_block_runs():
    """The acceptance script's float8 compile check (run on a GPU before the executor runs) explains a converted
    block as a measured block runs it and as the one-GPU executor does (fp32 parameters under autocast): graphs and
    breaks per case; here on CPU (torch's CPU _scaled_mm), where neither breaks."""
    torch = pytest.importorskip("torch")
    import dataclasses
    import warnings

    sys.path.insert(0, str(ROOT))
    from bench.gpu_acceptance import float8_compile_check, setup

    s = setup(True, 0, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 as its dtype and says so
        cases = float8_compile_check(dataclasses.replace(s, dtype="bfloat16"), torch.device("cpu"))
    assert [c["case"] for c in cases] == ["block dtype", "fp32 under autocast"]
    assert all(c.get("graphs", 0) >= 1 and c["graph_breaks"] == 0 for c in cases), cases
