import json
import subprocess
import sys

from typer.testing import CliRunner

from parsim.cli.main import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, list(args))


def test_predict_json_keys():
    r = _run("predict", "--model", "llama3-8b", "--gpus", "16", "--seq-len", "4096", "--ac", "selective-op", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for k in ("plan_id", "fits", "peak_memory_bytes", "memory_breakdown_bytes", "step_time_s", "time_breakdown_s",
              "comm_bytes", "tokens_per_s_per_gpu", "mfu"):
        assert k in d
    assert d["fits"] is True


def test_predict_table_output():
    r = _run("predict", "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--local-batch-size", "4", "--ac", "full")
    assert r.exit_code == 0, r.output
    assert "fits" in r.stdout and "tokens/s/GPU" in r.stdout


def test_plan_file_roundtrip(tmp_path):
    from parsim.plan import Plan

    p = tmp_path / "plan.json"
    p.write_text(json.dumps(Plan(dp_shard=8, tp=2, seq_len=4096).to_dict()))
    r = _run("predict", "--plan", str(p), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n_gpus"] == 16


def _one_line_exit_2(r, fragment):
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], r.stderr
    assert "Traceback" not in r.output


def test_bad_inputs_one_line_exit_2(tmp_path):
    _one_line_exit_2(_run("predict", "--model", "gpt-17", "--gpus", "8"), "unknown model")
    _one_line_exit_2(_run("predict", "--gpus", "16", "--dp-shard", "4", "--tp", "2"), "not the 16 GPUs")
    _one_line_exit_2(_run("predict", "--gpus", "24", "--tp", "3", "--seq-len", "3072"),
                     "n_heads 32 is not divisible by tp 3")
    _one_line_exit_2(_run("predict", "--gpus", "8", "--ac", "often"), "bad AC mode")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    _one_line_exit_2(_run("predict", "--gpus", "8", "--profile", str(bad)), "corrupt profile")
    _one_line_exit_2(_run("predict", "--plan", str(bad)), "cannot read plan")
    _one_line_exit_2(_run("predict", "--gpus", "8", "--profile", "a100-sxm-80gb-spec", "--float8"), "float8")


def test_core_imports_no_torch():
    code = ("import sys; import parsim.costmodel, parsim.search, parsim.spec, parsim.plan, parsim.hardware, "
            "parsim.report, parsim.traceread, parsim.trace_compare, parsim.trace_calibrate, parsim.trace_html, "
            "parsim.cli.main; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_emitted_plan_carries_its_model(tmp_path):
    """`search --emit-plan` records the model; `predict --plan` uses it, and refuses a --model that contradicts it."""
    import json

    from typer.testing import CliRunner

    from parsim.cli.main import app

    runner = CliRunner()
    f = tmp_path / "best.json"
    r = runner.invoke(app, ["search", "--model", "tiny", "--gpus", "4", "--seq-len", "256", "--profile", "cpu-gloo-4",
                            "--emit-plan", str(f), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(f.read_text())["model"] == "tiny"
    r = runner.invoke(app, ["predict", "--plan", str(f), "--profile", "cpu-gloo-4", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["model"] == "tiny", r.output
    r = runner.invoke(app, ["predict", "--plan", str(f), "--model", "llama3-8b"])
    assert r.exit_code == 2 and "made for model tiny" in r.stderr


def test_measured_profile_from_another_machine_warns(tmp_path):
    from parsim.machine import this_machine

    d = json.loads(open("profiles/cpu-gloo-2.json").read())
    here = this_machine()
    d["provenance"]["machine"] = here  # as if measured on this machine (CI may run on another than the committed one)
    p = tmp_path / "here.json"
    p.write_text(json.dumps(d))
    r = _run("predict", "--model", "tiny", "--gpus", "2", "--seq-len", "256", "--profile", str(p), "--json")
    assert r.exit_code == 0 and "may not describe this machine" not in r.stderr, r.stderr
    assert "is stale" in r.stderr  # (the committed profile predates the optimizer and overhead measurements)
    d["corrections"]["optimizer_fixed_s"] = 0.01
    d["provenance"]["device_count"] = 1  # (a one-rank profile: no FSDP or TP overhead to measure)
    p.write_text(json.dumps(d))
    r = _run("predict", "--model", "tiny", "--gpus", "2", "--seq-len", "256", "--profile", str(p), "--json")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.stderr
    d["provenance"]["machine"] = dict(here, cpu_flags=here["cpu_flags"] + ["amx_bf16"], cpu_cores=64)
    p = tmp_path / "other.json"
    p.write_text(json.dumps(d))
    r = _run("predict", "--model", "tiny", "--gpus", "2", "--seq-len", "256", "--profile", str(p), "--json")
    assert r.exit_code == 0
    assert "may not describe this machine" in r.stderr and "amx_bf16" in r.stderr
    json.loads(r.stdout)  # the JSON document stays pure


def test_hf_model_folders_names_and_unmodelled_features(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "Mistral-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096,
        "max_position_embeddings": 32768}))
    # a real process: the warning goes to stderr as one line, the JSON document on stdout stays pure
    r = subprocess.run([sys.executable, "-m", "parsim", "predict", "--model", str(folder), "--gpus", "8", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "Mistral-7B"
    assert r.stderr.startswith("warning: ") and "sliding_window 4096 is ignored" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                               "num_hidden_layers": 32, "num_attention_heads": 30, "vocab_size": 32000}))
    r = _run("predict", "--model", str(bad), "--gpus", "8")
    assert r.exit_code == 2 and "hidden_size 4096 is not divisible by num_attention_heads 30" in r.output
    nomt = tmp_path / "nomt.json"
    nomt.write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 2}))
    r = _run("predict", "--model", str(nomt), "--gpus", "8")
    assert r.exit_code == 2 and "no model_type" in r.output
    r = _run("predict", "--model", str(tmp_path), "--gpus", "8")
    assert r.exit_code == 2 and "has no config.json" in r.output


def test_a_profile_from_another_machine_is_measured_here_before_running(tmp_path, monkeypatch):
    """`validate --model` and `search --execute` predict runs on this machine: with a measured CPU profile from
    another machine, or from this one by an older profiler, they profile this one first (``parsim profile``
    defaults, under ``<name>-<machine tag>``)."""
    from conftest import as_measured_here

    import parsim.machine
    import parsim.profiler.run as profiler_run
    from parsim.hardware import load_profile
    from parsim.loop_jobs import profile_measured_here
    from parsim.machine import this_machine

    d = as_measured_here(json.loads(open("profiles/cpu-gloo-2.json").read()))
    here = this_machine()
    d["provenance"]["machine"] = dict(here, cpu_cores=here["cpu_cores"] + 64)
    other = tmp_path / "cpu-gloo-2.json"
    other.write_text(json.dumps(d))
    d["provenance"]["machine"] = here
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(d))
    # measured here, but by a profiler that did not yet measure what a step spends beside the curves
    d["corrections"] = {"compute_scale": 1.0}
    old = tmp_path / "old.json"
    old.write_text(json.dumps(d))
    calls = []

    def fake_profile(name, nproc, **kw):
        calls.append((name, nproc))
        return load_profile(str(mine))

    monkeypatch.setattr(profiler_run, "profile", fake_profile)
    # a tag no profile folder has (this machine's own profile may exist where a developer ran validate)
    monkeypatch.setattr(parsim.machine, "machine_tag", lambda: "t35t0000")
    hw = profile_measured_here(str(other))
    assert calls == [("cpu-gloo-2-t35t0000", 2)] and hw.provenance["machine"] == here
    calls.clear()
    assert profile_measured_here(str(mine)).provenance["machine"] == here and not calls  # this machine's: as it is
    assert profile_measured_here("h100-sxm-spec").name == "h100-sxm-spec" and not calls  # not a CPU measurement
    lines = []
    hw = profile_measured_here(str(old), log=lines.append)
    assert calls == [("cpu-gloo-2-t35t0000", 2)] and "optimizer_fixed_s" in hw.corrections
    assert "before the profiler measured optimizer_fixed_s, fsdp_call_fixed_s, tp_block_fixed_s" in lines[0]
