"""The validation loop: statistics, calibration, grouped folds, intervals, resumable runs, the HTML report."""

import json
import math
import shutil
import subprocess

import numpy as np
import pytest

from parsim import calibrate as C
from parsim import validate as V
from parsim.costmodel import predict
from parsim.errors import ParsimError
from parsim.hardware import load_profile
from parsim.plan import Plan, interval_group
from parsim.results import Measurement
from parsim.spec import PRESETS


def _row(meas, pred, **kw):
    r = dict.fromkeys(V.ROW_KEYS)
    r.update(tier="measured", source="here", model="m", plan_id=str(meas), family=str(meas), n_gpus=2, status="ok",
             reason="", confidence="high", measured_step_s=meas, predicted_step_s=pred,
             plan={"global_batch_size": 8, "seq_len": 256}, model_work_s=0.5 * meas)
    r.update(kw)
    return r


def test_statistics_on_hand_made_pairs():
    rows = [_row(1.0, 1.1, interval_s=[0.9, 1.2]), _row(2.0, 1.5, interval_s=[1.0, 1.8]),
            _row(4.0, 4.0, interval_s=[3.0, 5.0]), _row(8.0, 10.0, interval_s=[7.0, 11.0]),
            _row(3.0, None, status="error", reason="boom")]
    s = V.summarize(rows)
    assert s["n_rows"] == 5 and s["n_ok"] == 4
    assert s["step_time_mape"] == pytest.approx((0.1 + 0.25 + 0.0 + 0.25) / 4)
    assert s["step_time_max_ape"] == pytest.approx(0.25)
    assert s["spearman"] == pytest.approx(1.0)
    assert s["interval_coverage"] == pytest.approx(0.75)  # 2.0 is outside [1.0, 1.8]
    # top-1: the model picks the plan it predicts fastest (1.1 -> measured 1.0), which is the fastest measured
    assert s["top1_regret"] == pytest.approx(0.0)
    # the constant-MFU rule: every row has MFU 0.5 here, so leave-one-out predicts each exactly
    assert s["constant_mfu_rule"]["step_time_mape"] == pytest.approx(0.0)


def test_top1_regret_and_low_confidence_rows():
    rows = [_row(2.0, 1.0), _row(1.0, 1.5), _row(1.5, 3.0), _row(9.0, 1.0, confidence="low")]
    s = V.summarize(rows)
    assert s["n_ok"] == 3 and s["n_low_confidence"] == 1
    assert s["top1_regret"] == pytest.approx(1.0)  # picked 2.0 s, best measured 1.0 s


def test_repeatability_is_each_round_against_the_plans_median():
    """Two plans measured in 2 and 3 rounds: the figure a prediction equal to one round would score."""
    rows = [_row(1.0, 1.0, measured_rounds_s=[0.9, 1.1]), _row(2.0, 2.0, measured_rounds_s=[2.0, 1.6, 3.0]),
            _row(4.0, 4.0, measured_rounds_s=[4.0])]  # one round: nothing to compare
    rep = V.summarize(rows)["repeatability"]
    assert rep["n"] == 2 and rep["rounds_max"] == 3
    assert rep["round_ape_mean"] == pytest.approx((0.1 + (0.0 + 0.2 + 0.5) / 3) / 2)
    assert rep["round_ape_max"] == pytest.approx(0.5)
    assert "repeatability" not in V.summarize([_row(1.0, 1.0), _row(2.0, 2.5)])


def test_conformal_halfwidth():
    r = np.arange(1, 20) / 100.0  # 19 residuals: k = ceil(20 * 0.9) = 18 -> the 18th smallest
    assert C.conformal_halfwidth(r) == pytest.approx(0.18)
    assert math.isinf(C.conformal_halfwidth(r[:5]))  # too few rows for a 90% interval: say so


def test_folds_keep_a_group_together():
    rows = [_row(float(i), 1.0, family=f"fam{i % 7}") for i in range(40)]
    folds = C.folds_of(rows, 5)
    for fam in {r["family"] for r in rows}:
        assert len({int(f) for r, f in zip(rows, folds, strict=True) if r["family"] == fam}) == 1
    assert len(set(folds.tolist())) == 5


def test_leaving_sources_out_makes_one_fold_per_source():
    rows = [_row(float(i), 1.0, family=f"fam{i % 7}", source=f"src{i % 3}") for i in range(30)]
    folds = C.folds_of(rows, 5, by="source")
    assert len(set(folds.tolist())) == 3
    for src in ("src0", "src1", "src2"):
        assert len({int(f) for r, f in zip(rows, folds, strict=True) if r["source"] == src}) == 1
    assert C.default_fold_kind(rows) == "source" and C.default_fold_kind(rows[:2]) == "family"
    with pytest.raises(ParsimError, match="at least 3 sources"):
        C.folds_of(rows[:2], 5, by="source")


def test_a_source_left_out_is_predicted_by_a_fit_that_never_saw_it():
    """Three sources; the GEMMs of one ran at 0.6 of the others' ceiling. Leaving sources out, that source's rows
    are predicted by the fit of the other two (their factor, ~0.9) and its interval is sized by their residuals:
    its error and its miss show what a new source meets."""
    hw = load_profile("cpu-gloo-2")
    rows = []
    for (model, n), src, gemm in ((("tiny", 2), "a", 0.6), (("tiny-moe", 2), "b", 0.9), (("tiny", 4), "c", 0.9)):
        truth = C.apply(hw, {"gemm_eff_max": gemm})
        for p in V.measured_plans(PRESETS[model], n):
            r = V._predicted(PRESETS[model], p, hw, tier="measured", source=src, table=f"t{len(rows) % 4}",
                             confidence="high")
            r["measured_step_s"] = predict(PRESETS[model], p, truth).step_time_s
            rows.append(r)
    loso = C.calibrate(rows, {hw.name: hw}, ("gemm_eff_max",), by="source")
    a = np.array([r["source"] == "a" for r in loso["rows"]])
    left_out = loso["fold_factors"][int(loso["folds"][a][0])]
    assert left_out["gemm_eff_max"] == pytest.approx(0.9, rel=0.03)
    # the fit on every row saw a's rows: pulled below the others' 0.9
    assert loso["factors"]["gemm_eff_max"] < left_out["gemm_eff_max"] - 0.03
    meas = np.array([r["measured_step_s"] for r in loso["rows"]])
    err = np.abs(np.log(loso["out_of_fold"] / meas))
    assert err[a].mean() > 0.1 > err[~a].mean()
    # a's interval comes from b's and c's residuals, which its own errors dwarf
    assert np.mean(err[a] <= loso["interval_fold_halfwidth"][a]) < 0.5


def test_a_small_groups_halfwidth_is_shrunk_toward_the_pooled_one():
    r = np.concatenate([np.linspace(0.01, 0.02, 12), np.linspace(0.1, 0.4, 40)])
    g = np.array(["float8"] * 12 + ["dense"] * 40)
    by_group, pooled = C.group_halfwidths(r, g)
    own = C.conformal_halfwidth(r[:12])
    assert own < by_group["float8"] < pooled
    assert by_group["float8"] == pytest.approx((12 * own + C.SHRINK_ROWS * pooled) / (12 + C.SHRINK_ROWS))


def test_the_measured_space_holds_only_plans_the_executor_runs():
    """DDP-style EP is a cost-model option: the measured tier left it in and got an error row per run."""
    from parsim.codec import executor_refusal

    for model, n in (("tiny", 2), ("tiny-moe", 2), ("tiny-moe", 4)):
        plans = V.measured_plans(PRESETS[model], n)
        assert plans and all(executor_refusal(p, PRESETS[model]) == "" for p in plans)
    assert any(p.ep > 1 for p in V.measured_plans(PRESETS["tiny-moe"], 2))  # dp2ep stays


def _synthetic_rows(hw, planted):
    rows = []
    truth = C.apply(hw, planted)
    for model, n in (("tiny", 2), ("tiny-moe", 2), ("tiny", 4)):
        spec = PRESETS[model]
        for p in V.measured_plans(spec, n):
            r = V._predicted(spec, p, hw, tier="measured", source="synthetic", table="t", confidence="high")
            r["measured_step_s"] = predict(spec, p, truth).step_time_s
            rows.append(r)
    return rows


def test_calibration_recovers_planted_parameters():
    hw = load_profile("cpu-gloo-2")
    planted = {"gemm_eff_max": 0.7, "comm_scale_dp": 1.6, "comm_scale_tp": 1.3, "layer_overhead": 2.0}
    rows = _synthetic_rows(hw, planted)
    res = C.calibrate(rows, {hw.name: hw}, tuple(planted), k=4)
    for k, v in planted.items():
        assert res["factors"][k] == pytest.approx(v, rel=0.05), (k, res["factors"])
    meas = np.array([r["measured_step_s"] for r in res["rows"]])
    assert np.max(np.abs(res["out_of_fold"] / meas - 1)) < 0.05  # noise-free: out of fold is near exact too
    assert np.max(np.abs(res["uncalibrated"] / meas - 1)) > 0.2  # and the planted change was not small
    assert res["unidentified"] == {}  # planted and seen by every fold: each fold's fit finds them


def test_a_parameter_the_folds_fit_apart_is_shown_poorly_identified():
    """A factor whose fits leaving one fold out disagree by more than UNIDENTIFIED_SPREAD is decided by which rows
    a fit sees: the calibration lists it with its range (each parameter's range is kept)."""
    folds = [{"gemm_eff_max": 0.70, "compile_memory_factor": 0.45, "comm_interference": 1.0},
             {"gemm_eff_max": 0.74, "compile_memory_factor": 2.0, "comm_interference": 1.1},
             {"gemm_eff_max": 0.72, "compile_memory_factor": 1.7, "comm_interference": 0.0}]
    assert C.unidentified(folds) == {"compile_memory_factor": [0.45, 2.0], "comm_interference": [0.0, 1.1]}
    assert C.fold_ranges(folds)["gemm_eff_max"] == [0.70, 0.74]
    assert C.unidentified(folds[:1]) == {}
    hw = load_profile("cpu-gloo-2")
    rows = _synthetic_rows(hw, {"comm_scale_dp": 1.3})
    res = C.calibrate(rows, {hw.name: hw}, ("comm_scale_dp",), k=3)
    lo, hi = res["fold_ranges"]["comm_scale_dp"]
    assert lo <= res["factors"]["comm_scale_dp"] * 1.02 and hi >= res["factors"]["comm_scale_dp"] * 0.98
    assert res["unidentified"] == {}
    assert "compile_memory_factor" not in C.GPU_PARAMETERS and "comm_interference" not in C.GPU_PARAMETERS

def test_an_architectures_gemm_factor_applies_to_that_architecture_only():
    """``gemm_eff_max_ampere`` multiplies the GEMM factor on A100 profiles; Hopper, Blackwell and CPU profiles keep
    ``gemm_eff_max`` alone, and without Ampere rows the ratio has nothing to move it from 1 (the prior)."""
    from parsim.hardware import gpu_architecture

    factors = {"gemm_eff_max": 0.7, "gemm_eff_max_ampere": 1.1}
    for name, arch in (("a100-sxm-80gb-spec", "ampere"), ("h100-sxm-spec", "hopper"), ("h200-spec", "hopper"),
                       ("b200-spec", "blackwell"), ("cpu-gloo-2", None)):
        hw = load_profile(name)
        assert gpu_architecture(hw.device_name) == arch
        expect = min(1.0, hw.gemm_efficiency.eff_max * 0.7 * (1.1 if arch == "ampere" else 1.0))
        assert C.apply(hw, factors).gemm_efficiency.eff_max == pytest.approx(expect)
    hw = load_profile("cpu-gloo-2")
    rows = _synthetic_rows(hw, {"gemm_eff_max": 0.8})
    res = C.calibrate(rows, {hw.name: hw}, ("gemm_eff_max", "gemm_eff_max_ampere"), k=3)
    assert res["factors"]["gemm_eff_max"] == pytest.approx(0.8, rel=0.05)
    assert res["factors"]["gemm_eff_max_ampere"] == pytest.approx(1.0, abs=0.01)


def test_calibrated_profile_carries_its_interval_and_provenance(tmp_path):
    hw = load_profile("cpu-gloo-2")
    rows = _synthetic_rows(hw, {"comm_scale_dp": 1.3})
    res = C.calibrate(rows, {hw.name: hw}, ("comm_scale_dp",), k=3)
    new = C.calibrated_profile(hw, res, {"out_of_fold": {"step_time_mape": 0.0}}, ["synthetic"])
    p = new.save(tmp_path / "x.json")
    back = load_profile(str(p))
    assert back.calibration["factors"]["comm_scale_dp"] == pytest.approx(1.3, rel=0.02)
    assert back.provenance["calibrated_from"] == "cpu-gloo-2"
    plan = Plan(dp_shard=2, seq_len=256, local_batch_size=4)
    pred = predict(PRESETS["tiny"], plan, back)
    lo, hi = pred.interval_s
    q = back.interval_log_halfwidth_for(interval_group(plan))  # the plan's family's, where it had enough rows
    assert q == back.calibration["interval_log_halfwidth_by_group"].get("dense", back.interval_log_halfwidth)
    assert lo < pred.step_time_s < hi and hi / pred.step_time_s == pytest.approx(math.exp(q))


def test_mondrian_intervals_cover_each_plan_family_at_its_own_width():
    """Two families with residuals of different sizes: one pooled quantile under-covers the hard family and is
    too wide for the easy one; per-family quantiles cover each at >= 90% (split-conformal's guarantee per group),
    and a family with too few rows takes the pooled quantile."""
    rng = np.random.default_rng(0)
    easy, hard = np.abs(rng.normal(0, 0.02, 200)), np.abs(rng.normal(0, 0.3, 200))
    few = np.abs(rng.normal(0, 0.1, 5))
    r = np.concatenate([easy, hard, few])
    g = np.array(["dense"] * 200 + ["pp-deep"] * 200 + ["ep"] * 5)
    by_group, pooled = C.group_halfwidths(r, g)
    assert set(by_group) == {"dense", "pp-deep"}  # "ep": 5 rows, no finite 90% quantile: pooled
    assert np.mean(hard <= pooled) < 0.9 <= np.mean(hard <= by_group["pp-deep"])
    assert by_group["dense"] < pooled / 3 and np.mean(easy <= by_group["dense"]) >= 0.9


def test_interval_group_takes_the_first_feature_a_plan_has():
    """The Mondrian families in precedence order: EP before CP before deep PP before PP before torch.compile before
    float8; a plan with none of them is dense; every family is one of ``INTERVAL_GROUPS``."""
    from parsim.plan import INTERVAL_GROUPS

    cases = [(dict(dp_shard=4, ep=4, cp=2, compile=True), "ep"), (dict(dp_shard=2, cp=2, pp=4, compile=True), "cp"),
             (dict(dp_shard=2, pp=4, compile=True, float8=True), "pp-deep"),
             (dict(dp_shard=2, pp=2, compile=True), "pp"), (dict(dp_shard=8, compile=True, float8=True), "compile"),
             (dict(dp_shard=8, float8=True), "float8"), (dict(dp_shard=8), "dense")]
    for kw, group in cases:
        plan = Plan(seq_len=4096, local_batch_size=8, **kw)
        assert interval_group(plan) == group, kw
        assert group in INTERVAL_GROUPS


def test_uncalibrated_profiles_give_wide_intervals():
    pred = predict(PRESETS["llama3-8b"], Plan(dp_shard=8, seq_len=4096), load_profile("h100-sxm-spec"))
    lo, hi = pred.interval_s
    assert hi / pred.step_time_s >= 1.5 and pred.step_time_s / lo >= 1.5
    tlo, thi = pred.interval_tokens_per_s_per_gpu
    assert tlo < pred.tokens_per_s_per_gpu < thi


def test_measured_runs_resume_after_an_interrupt(tmp_path, monkeypatch):
    """An interrupted validation keeps every finished run; running it again runs only what is missing."""
    import parsim.executor.launch as launch

    calls = []

    def fake_run(model, plan, nproc, **kw):
        calls.append(plan.plan_id)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return Measurement(plan_id=plan.plan_id, kind="run", status="ok", step_times_s=(0.1, 0.2, 0.3),
                           median_step_time_s=0.2, peak_memory_bytes=1e6)

    monkeypatch.setattr(launch, "run_plan", fake_run)
    plans = V.measured_plans(PRESETS["tiny"], 2)[:3]
    with pytest.raises(KeyboardInterrupt):
        V.run_measured("tiny", 2, tmp_path, rounds=2, plans=plans)
    assert len(V.load_measurements(tmp_path / "measurements.jsonl")) == 3
    calls.clear()
    lines = V.run_measured("tiny", 2, tmp_path, rounds=2, plans=plans)
    assert len(calls) == 3 and len(lines) == 6  # the 3 missing runs of round 2, nothing twice
    calls.clear()
    V.run_measured("tiny", 2, tmp_path, rounds=2, plans=plans)
    assert calls == []
    rows = V.measured_rows(lines, load_profile("cpu-gloo-2"))
    assert len(rows) == 3 and all(r["status"] == "ok" and r["measured_step_s"] == 0.2 for r in rows)


def test_a_failed_plan_is_a_row(tmp_path, monkeypatch):
    import parsim.executor.launch as launch

    monkeypatch.setattr(launch, "run_plan", lambda model, plan, nproc, **kw: Measurement(
        plan_id=plan.plan_id, kind="run", status="error", error="rank 0: it broke"))
    plans = V.measured_plans(PRESETS["tiny"], 2)[:2]
    rows = V.measured_rows(V.run_measured("tiny", 2, tmp_path, rounds=1, plans=plans), load_profile("cpu-gloo-2"))
    assert [r["status"] for r in rows] == ["error", "error"] and "it broke" in rows[0]["reason"]


def test_published_rows_are_all_predicted_or_explained():
    rows = V.published_rows("tests/data/published_sample.csv")
    assert len(rows) == 4
    by_id = {r["plan_id"]: r for r in rows}
    assert by_id["ok-fsdp"]["status"] == "ok" and by_id["ok-fsdp"]["measured_step_s"] == pytest.approx(
        8 * 4096 / 8 / 4000.0)
    # Megatron words: micro batch 1 of local 4 without PP = gradient accumulation over 4 passes
    ga = by_id["megatron-ga"]
    assert ga["status"] == "ok" and ga["plan"]["local_batch_size"] == 1 and ga["plan"]["global_batch_size"] == 32
    assert by_id["no-ac"]["status"] == "unrepresentable" and "AC" in by_id["no-ac"]["reason"]
    assert by_id["oom"]["status"] == "oom"


def test_validate_and_report_cli(tmp_path):
    from typer.testing import CliRunner

    from parsim.cli.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["validate", "--published", "tests/data/published_sample.csv", "--out",
                            str(tmp_path / "v"), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["n_rows"] == 4 and s["n_unrepresentable"] == 1
    html = tmp_path / "r.html"
    r = runner.invoke(app, ["report", str(tmp_path / "v"), "--html", str(html), "--json"])
    assert r.exit_code == 0, r.output
    assert html.stat().st_size < 6e6 and "plotly" in html.read_text()[:2_000_000]
    r = runner.invoke(app, ["report", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "no rows.json" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt-get install chromium)")
def test_html_report_renders_in_a_real_browser(tmp_path):
    """Chromium loads the page and plotly draws every figure (its SVG roots exist after the scripts ran)."""
    rows = V.published_rows("tests/data/published_sample.csv")
    V.write_results(tmp_path, rows, V.summarize(rows), {})
    from parsim.report_html import build_table, write_html

    table, stats = build_table(rows, [str(tmp_path)])
    write_html(str(tmp_path / "r.html"), table, stats, [str(tmp_path)])
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          "--dump-dom", f"file://{tmp_path / 'r.html'}"], capture_output=True, text=True,
                         timeout=120).stdout
    assert dom.count('class="main-svg"') >= 3 and "by |error|" in dom


# measures the drawn page in the browser: page width, and per figure its plot height, bars and distinct bar labels
PROBE = """<script>window.addEventListener('load', () => setTimeout(() => {
  const out = {width: document.documentElement.scrollWidth, figures: []};
  document.querySelectorAll('.js-plotly-plot').forEach(gd => {
    const bars = gd.data.filter(t => t.type === 'bar' && t.orientation === 'h');
    const labels = bars.length ? bars[0].y : [];
    out.figures.push({title: gd.layout.title.text, plot_px: gd._fullLayout._size.h, bars: labels.length,
                      distinct: new Set(labels).size});
  });
  document.body.setAttribute('data-probe', JSON.stringify(out));
}, 1000));</script>"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt-get install chromium)")
def test_the_published_rows_page_is_readable_at_1400_px(tmp_path):
    """The development rows' page in chromium at 1,400 px: nothing wider than the window (tables scroll in their
    box), one bar per row in the component chart (rows that share a plan get their source), at least 12 px of plot
    per bar (its label's height), every plot at least 150 px high, the counts the charts state those of the
    statistics."""
    import html as H
    import re

    rows = V.published_rows("bench/published/dev.csv")
    V.write_results(tmp_path, rows, V.summarize(rows), {})
    from parsim.report_html import build_table, write_html

    table, stats = build_table(rows, [str(tmp_path)])
    write_html(str(tmp_path / "r.html"), table, stats, [str(tmp_path)])
    page = tmp_path / "r.html"
    page.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
                          "--virtual-time-budget=20000", "--dump-dom", f"file://{page}"], capture_output=True,
                         text=True, timeout=180).stdout
    probe = json.loads(H.unescape(re.search(r'data-probe="([^"]*)"', dom).group(1)))
    assert probe["width"] <= 1400, probe
    bars = [f for f in probe["figures"] if f["bars"]]
    drawn = int(((table.status == "ok") & table.measured_ms.notna() & table.shown_ms.notna()).sum())
    assert len(bars) == 1 and bars[0]["bars"] == bars[0]["distinct"] == min(60, drawn), bars
    assert bars[0]["plot_px"] >= 12 * bars[0]["bars"], bars
    assert all(f["plot_px"] >= 150 for f in probe["figures"]), probe["figures"]  # a few ticks and their labels
    n = stats["as predicted"]["n"]
    titles = " ".join(f["title"] for f in probe["figures"])
    assert f"of the {n} scored rows" in titles and f"of {n} rows" in titles, titles


def test_loop_commands_refuse_bad_input_with_one_line(tmp_path):
    from typer.testing import CliRunner

    from parsim.cli.main import app

    runner = CliRunner()
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "rows.json").write_text("{not json")
    for args, fragment in ((["calibrate", str(tmp_path / "none")], "no rows.json"),
                           (["calibrate", str(tmp_path / "v")], "cannot read"),
                           (["calibrate", str(tmp_path / "v"), "--folds", "1"], "--folds"),
                           (["report", str(tmp_path / "v"), "--plotly-js", "remote"], "--plotly-js"),
                           (["validate", "--out", str(tmp_path / "o"), "--nproc-per-node", "0"], "--nproc-per-node"),
                           (["validate", "--out", str(tmp_path / "o"), "--published", str(tmp_path / "x.csv")],
                            "cannot read"),
                           (["validate", "--out", "/dev/null"], "is not a folder")):
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.output)


def test_validate_with_measured_blocks_scores_both_and_keeps_the_blocks(tmp_path, monkeypatch):
    """``validate --measure-blocks``: every plan's local shapes measured once into the profile, the summary with
    them and the one from the curves beside it (the measurement is faked here: a block's time is its tokens x
    1e-6 s forward, twice that backward)."""
    import parsim.executor.launch as launch
    import parsim.profiler.blocks as blocks
    from parsim.loop_jobs import measured_summary

    monkeypatch.setenv("PARSIM_PROFILES_DIR", str(tmp_path / "profiles"))
    def fake_run(model, plan, nproc, **kw):  # a step time per plan
        t = 0.1 + int(plan.plan_id[:4], 16) % 100 / 1000
        return Measurement(plan_id=plan.plan_id, kind="run", status="ok", step_times_s=(t, t, t),
                           median_step_time_s=t, peak_memory_bytes=1e6)

    monkeypatch.setattr(launch, "run_plan", fake_run)
    measured = []

    def fake_block(shape, device=None, reps=5):
        measured.append(shape.key)
        t = shape.micro_batch * shape.seq_len * 1e-6
        return {"fwd_s": t, "bwd_s": 2 * t, "wall_s": 0.01, "device": "fake"}

    def fake_head(shape, device=None, reps=5):  # the model's ends: embedding, norm + output + loss
        measured.append(shape.key)
        t = shape.micro_batch * shape.seq_len * 1e-7
        return {"emb_fwd_s": t, "emb_bwd_s": t, "out_fwd_s": t, "out_bwd_s": 2 * t, "wall_s": 0.01, "device": "fake"}

    monkeypatch.setattr(blocks, "measure_block", fake_block)
    monkeypatch.setattr(blocks, "measure_head", fake_head)
    plans = [p for p in V.measured_plans(PRESETS["tiny"], 2) if p.cp == 1][:4]
    V.run_measured("tiny", 2, tmp_path / "v", rounds=1, plans=plans)
    hw = load_profile("cpu-gloo-2")
    s = measured_summary(tmp_path / "v", "cpu-gloo-2", hw, measure_blocks=True)
    assert s["measured_blocks"]["measured_now"] == len(set(measured)) == s["measured_blocks"]["shapes"]
    assert s["without_measured_blocks"]["n_ok"] == s["n_ok"] == 4
    assert s["step_time_mape"] != s["without_measured_blocks"]["step_time_mape"]
    kept = load_profile(str(tmp_path / "profiles" / "cpu-gloo-2.json"))
    assert set(kept.measured_blocks) == set(measured)
    measured.clear()
    measured_summary(tmp_path / "v", "cpu-gloo-2", kept, measure_blocks=True)
    assert measured == []  # kept in the profile: nothing measured twice


def test_blocks_timed_in_every_round_give_their_mean(tmp_path, monkeypatch):
    """``validate --measure-blocks`` times the blocks and the core sharing at the start of every round
    (``before_round``), once per round even when resumed, and predicts with each time's mean and the factor's
    median over the rounds (the fake machine drifts: x1, x3, x1.5 by round)."""
    import parsim.executor.launch as launch
    import parsim.profiler.blocks as blocks
    import parsim.profiler.compute as pcompute
    from parsim.loop_jobs import _measured_shapes, measure_block_round, measured_summary

    monkeypatch.setenv("PARSIM_PROFILES_DIR", str(tmp_path / "profiles"))
    def fake_run(model, plan, nproc, **kw):  # a step time per plan
        t = 0.1 + int(plan.plan_id[:4], 16) % 100 / 1000
        return Measurement(plan_id=plan.plan_id, kind="run", status="ok", step_times_s=(t,), median_step_time_s=t,
                           peak_memory_bytes=1e6)

    monkeypatch.setattr(launch, "run_plan", fake_run)
    drift = {"x": 1.0}

    def fake_block(shape, device=None, reps=5):
        t = shape.micro_batch * shape.seq_len * 1e-6 * drift["x"]
        return {"fwd_s": t, "bwd_s": 2 * t, "wall_s": 0.01, "device": "fake"}

    def fake_head(shape, device=None, reps=5):
        t = shape.micro_batch * shape.seq_len * 1e-7 * drift["x"]
        return {"emb_fwd_s": t, "emb_bwd_s": t, "out_fwd_s": t, "out_bwd_s": 2 * t, "wall_s": 0.01, "device": "fake"}

    monkeypatch.setattr(blocks, "measure_block", fake_block)
    monkeypatch.setattr(blocks, "measure_head", fake_head)
    monkeypatch.setattr(pcompute, "core_sharing_sample", lambda ranks: {
        "kind": "core_sharing", "ranks": ranks, "factor": 0.9 + 0.1 * drift["x"], "wall_s": 0.01})
    plans = [p for p in V.measured_plans(PRESETS["tiny"], 2) if p.cp == 1][:3]
    shapes = _measured_shapes([(PRESETS["tiny"], p) for p in plans])
    out = tmp_path / "v"
    rounds_seen = []

    def before(r):
        rounds_seen.append(r)
        drift["x"] = (1.0, 3.0, 1.5)[r]
        measure_block_round(out, r, shapes, sharing_ranks=2)

    V.run_measured("tiny", 2, out, rounds=3, plans=plans, before_round=before)
    assert rounds_seen == [0, 1, 2]
    V.run_measured("tiny", 2, out, rounds=3, plans=plans, before_round=before)
    assert rounds_seen == [0, 1, 2]  # all done: no round started again
    s = measured_summary(out, "cpu-gloo-2", load_profile("cpu-gloo-2"), measure_blocks=True)
    assert s["measured_blocks"]["measured_now"] == 0 and s["measured_blocks"]["rounds"] == 3
    kept = load_profile(str(tmp_path / "profiles" / "cpu-gloo-2.json"))
    assert kept.corrections["compute_scale"] == pytest.approx(1.05)  # the median of 1.0, 1.2, 1.05
    for shape in shapes:
        entry = kept.measured_blocks[shape.key]
        assert entry["rounds"] == 3
        f = "fwd_s" if "fwd_s" in entry else "out_fwd_s"
        lo, hi = entry["round_range_s"][f]
        assert entry[f] == pytest.approx(5.5 / 3 * lo) and hi == pytest.approx(3 * lo)  # the mean of x1, x3, x1.5


def test_calibrate_refuses_an_unknown_fold_kind_in_one_line(tmp_path, capsys):
    from parsim.cli.main import main

    assert main(["calibrate", str(tmp_path), "--folds-by", "table"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --folds-by must be family or source, got 'table'"]
