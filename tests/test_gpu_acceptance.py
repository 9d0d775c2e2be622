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
