"""`parsim run` before and after the launch: the dtype a CPU run defaults to, the refusal of a run predicted past
--timeout, a line per step on stderr, and a non-zero exit for a run that did not measure."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from cli.main import app
from parsim import run_prep as R
from parsim.errors import ParsimError
from parsim.hardware import load_profile
from parsim.results import Measurement

RUN = ["run", "--model", "tiny", "--gpus", "2", "--dp-shard", "2", "--nproc-per-node", "2", "--seq-len", "64"]


def _with_peaks(bf16: float, fp32: float):
    hw = load_profile("cpu-gloo-2")
    return dataclasses.replace(hw, peak_flops={**hw.peak_flops, "bfloat16": bf16, "float32": fp32})


def test_cpu_dtype_follows_the_measured_peaks_then_the_cpu_flags():
    assert R.cpu_dtype(_with_peaks(2.2e9, 98e9), [])[0] == "float32"  # the packaged profile's machine
    assert "--param-dtype bfloat16" in R.cpu_dtype(_with_peaks(2.2e9, 98e9), [])[1]
    assert R.cpu_dtype(_with_peaks(427e9, 161e9), [])[0] == "bfloat16"
    assert R.cpu_dtype(_with_peaks(427e9, 161e9), ["avx2"])[0] == "bfloat16"  # the measurement wins over flags
    assert R.cpu_dtype(None, ["avx2", "fma"])[0] == "float32"
    assert R.cpu_dtype(None, ["avx2", "avx512_bf16"])[0] == "bfloat16"
    assert R.cpu_dtype(None, ["amx_bf16"])[0] == "bfloat16"


def test_a_run_predicted_past_its_timeout_is_refused():
    R.check_fits_timeout(None, 5, 2, 1.0)  # no prediction: nothing to refuse on
    R.check_fits_timeout(10.0, 5, 2, 70.0)
    with pytest.raises(ParsimError, match=r"predicted 100.0 s a step: 2 warmup \+ 5 timed steps take ~700 s"):
        R.check_fits_timeout(100.0, 5, 2, 600.0, ", or --param-dtype float32")


def test_only_a_measured_cpu_profile_of_this_machine_predicts_a_cpu_run(monkeypatch):
    import parsim.machine as M

    hw = load_profile("cpu-gloo-2")
    monkeypatch.setattr(M, "this_machine", lambda gpu_name=None: dict(hw.provenance["machine"]))
    got, why = R.cpu_run_profile(None, 2)
    assert got is not None and got.name.startswith("cpu-gloo-2") and why == ""
    got, why = R.cpu_run_profile("h100-sxm-spec", 2)
    assert got is None and "not a measured CPU profile" in why and "parsim profile --nproc-per-node 2" in why
    monkeypatch.setattr(M, "this_machine", lambda gpu_name=None: dict(hw.provenance["machine"], cpu_cores=999))
    got, why = R.cpu_run_profile(None, 2)
    assert got is None and "another machine" in why


def _fake_launch(monkeypatch, status: str, launched: list):
    pytest.importorskip("torch")
    import parsim.executor.launch as launch

    def record(model, plan, nproc, **kw):
        launched.append(plan)
        kw["progress"]("1/1 timed 12.0 ms loss 7.0000")
        ok = status == "ok"
        return Measurement(plan_id=plan.plan_id, kind="run", status=status, error="" if ok else "killed after 5 s",
                           step_times_s=(0.012,) if ok else (), median_step_time_s=0.012 if ok else None,
                           tokens_per_s_per_gpu=1000.0 if ok else None, losses=(7.0,) if ok else ())

    monkeypatch.setattr(launch, "run_plan", record)
    monkeypatch.setattr("cli.main._has_cuda", lambda: False)


@pytest.mark.parametrize("status,code", [("ok", 0), ("timeout", 1), ("error", 1), ("oom", 1)])
def test_run_exits_non_zero_unless_it_measured(monkeypatch, status, code):
    launched: list = []
    _fake_launch(monkeypatch, status, launched)
    r = CliRunner().invoke(app, RUN)
    assert r.exit_code == code and len(launched) == 1, r.output
    assert "step 1/1 timed 12.0 ms" in r.output  # the worker's line per step, on stderr
    if code:
        assert f"the run ended with status {status}" in r.output and "Traceback" not in r.output


def test_a_cpu_run_without_bf16_instructions_defaults_to_float32(monkeypatch):
    import parsim.machine as M

    launched: list = []
    _fake_launch(monkeypatch, "ok", launched)
    monkeypatch.setattr(M, "this_machine", lambda gpu_name=None: {"cpu_model": "x", "cpu_cores": 3,
                                                                  "cpu_flags": ["avx2", "fma"]})
    r = CliRunner().invoke(app, RUN)
    assert r.exit_code == 0 and launched[-1].param_dtype == "float32", r.output
    assert "param dtype float32: this CPU has neither AVX-512 BF16 nor AMX" in r.output
    r = CliRunner().invoke(app, RUN + ["--param-dtype", "bfloat16"])  # given: kept, and nothing said about it
    assert r.exit_code == 0 and launched[-1].param_dtype == "bfloat16" and "param dtype" not in r.output
    monkeypatch.setattr(M, "this_machine", lambda gpu_name=None: {"cpu_model": "x", "cpu_cores": 3,
                                                                  "cpu_flags": ["avx512_bf16"]})
    r = CliRunner().invoke(app, RUN)
    assert r.exit_code == 0 and launched[-1].param_dtype == "bfloat16", r.output


def test_a_run_the_profile_of_this_machine_says_is_too_long_is_refused_before_launch(monkeypatch):
    import parsim.machine as M

    hw = load_profile("cpu-gloo-2")  # the machine it was measured on: bf16 GEMMs 44x slower than float32
    monkeypatch.setattr(M, "this_machine", lambda gpu_name=None: dict(hw.provenance["machine"]))
    launched: list = []
    _fake_launch(monkeypatch, "ok", launched)
    r = CliRunner().invoke(app, ["run", "--model", "llama3-8b", "--gpus", "2", "--dp-shard", "2",
                                 "--nproc-per-node", "2", "--param-dtype", "bfloat16", "--timeout", "600"])
    assert r.exit_code == 2 and not launched, r.output
    assert "more than --timeout 600 s" in r.output and "--param-dtype float32 (bf16 GEMMs are slow here)" in r.output
    r = CliRunner().invoke(app, RUN + ["--steps", "3"])
    assert r.exit_code == 0 and launched and "predicted" in r.output and "ms a step on profile cpu-gloo-2" in r.output


def test_the_step_lines_are_handed_on_whole_however_the_output_is_split():
    from parsim.executor.launch import PROGRESS_PREFIX, _StepLines

    got: list = []
    feed = _StepLines(got.append)
    text = f"W1 noise\n{PROGRESS_PREFIX}1/3 warmup 5.0 ms loss 1.0\nother\n{PROGRESS_PREFIX}2/3 timed 6.0 ms loss 0.9\n"
    for i in range(0, len(text), 7):
        feed(text[i:i + 7])
    assert got == ["1/3 warmup 5.0 ms loss 1.0", "2/3 timed 6.0 ms loss 0.9"]


def test_the_search_command_keeps_the_measured_headroom_by_default():
    import inspect

    from cli.main import search
    from parsim.search import CLI_HEADROOM

    assert inspect.signature(search).parameters["headroom"].default.default == CLI_HEADROOM
