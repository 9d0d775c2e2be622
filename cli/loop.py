"""Plain functions behind `parsim validate`, `report` and `calibrate` (rendering: rich on stderr/stdout)."""

from __future__ import annotations

from pathlib import Path

from parsim.errors import ParsimError


def _progress():
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    err = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=err, disable=not err.is_terminal)


def validate_measured(model: str, nproc: int, out_dir: str, *, profile: str | None, rounds: int, steps: int,
                      max_plans: int, timeout_s: float, measure_blocks: bool = False) -> dict:
    from parsim import validate as V
    from parsim.spec import load_model

    if nproc < 1 or nproc > 64:
        raise ParsimError(f"--nproc-per-node must be in 1..64, got {nproc}")
    if rounds < 1 or steps < 1:
        raise ParsimError("--rounds and --steps must be >= 1")
    spec = load_model(model)
    plans = V.measured_plans(spec, nproc)
    if max_plans:
        plans = plans[:max_plans]
    from parsim.cli.common import profile_measured_here

    hw = profile_measured_here(profile or f"cpu-gloo-{nproc}", nproc)  # this machine's, before anything runs
    out = Path(out_dir)
    with _progress() as prog:
        task = prog.add_task(f"{model} on {nproc} ranks", total=len(plans) * rounds)

        def tick(done, total, what):
            prog.update(task, completed=done, description=what[:60])

        V.run_measured(model, nproc, out, rounds=rounds, steps=steps, timeout_s=timeout_s, plans=plans,
                       progress=tick)
    return _measured_summary(out, profile, hw, measure_blocks)


def _measured_summary(out: Path, profile: str | None, hw, measure_blocks: bool = False) -> dict:
    """Rows and summary over every measurement in the folder (earlier models and rank counts included). With
    ``measure_blocks`` the plans' blocks are measured at their local shapes first (kept in the profile) and the
    summary without them is written beside, with the wall time of the measurement."""
    import dataclasses

    from parsim import validate as V
    from parsim.cli.common import profile_measured_here

    lines = V.load_measurements(out / "measurements.jsonl")
    rows, rows_curves, walls, n_shapes = [], [], {}, 0
    for nproc in sorted({ln["nproc"] for ln in lines}):
        prof = hw if profile else profile_measured_here(f"cpu-gloo-{nproc}", nproc)
        sel = [ln for ln in lines if ln["nproc"] == nproc]
        if measure_blocks:  # the curves alone: without any block the profile already holds
            rows_curves += V.measured_rows(sel, dataclasses.replace(prof, measured_blocks={}))
            prof, w, n = _with_measured_blocks(prof, sel)
            walls.update(w)
            n_shapes += n
        rows += V.measured_rows(sel, prof)
    summary = V.summarize(rows)
    meta: dict = {"tier": "measured", "profile": profile or "cpu-gloo-<ranks>"}
    if measure_blocks:
        meta["measured_blocks"] = {"shapes": n_shapes, "measured_now": len(walls),
                                   "measurement_wall_s": sum(walls.values())}
        meta["without_measured_blocks"] = V.summarize(rows_curves)
        meta["components"] = _components(out, V.component_differences(rows_curves, rows))
    V.write_results(out, rows, summary, meta)
    return {**summary, **{k: v for k, v in meta.items() if k != "tier"}}


def _components(out: Path, diffs: list[dict]) -> dict:
    """Write ``components.csv`` (every plan's components, curves beside measured blocks) and return, per
    component, the median over plans of each side as a share of the measured step."""
    import pandas as pd

    from parsim.jsonio import atomic_write_text

    df = pd.DataFrame(diffs)
    if df.empty:
        return {}
    atomic_write_text(out / "components.csv", df.to_csv(index=False))
    df = df[df["measured_step_s"].notna()]
    share = df.assign(curves=df["curves_s"] / df["measured_step_s"], blocks=df["blocks_s"] / df["measured_step_s"])
    med = share.groupby("component")[["curves", "blocks"]].median()
    return {k: {"curves_share_of_measured": float(v["curves"]), "blocks_share_of_measured": float(v["blocks"])}
            for k, v in med.iterrows()}


def measure_plan_shapes(plan_file: str, out: str, out_dir: str | None, model: str | None) -> dict:
    """``parsim profile --measure-shapes-of PLANFILE --out PROFILE``: the blocks and ends (embedding, output and
    loss) of the plans in the file, measured at their local shapes on this device and kept in the profile
    (resumable: shapes it has are not re-measured)."""
    from parsim.blockshape import plan_measured_shapes
    from parsim.hardware import HardwareProfile
    from parsim.jsonio import read_json
    from parsim.plan import Plan
    from parsim.profiler.run import resolve_profile_out
    from parsim.spec import load_model

    doc = read_json(Path(plan_file), "cannot read the plan file")
    entries = doc if isinstance(doc, list) else [doc]
    shapes, skipped = [], 0
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("plan"), dict) or not (model or e.get("model")):
            raise ParsimError(f"{plan_file}: each entry needs 'model' and 'plan' (as search --emit-plan writes)")
        got = plan_measured_shapes(load_model(model or e["model"]), Plan.from_dict(e["plan"]))
        shapes += [s for s in got if s is not None]
        skipped += sum(s is None for s in got)
    path = resolve_profile_out(out, out_dir)
    if not path.exists():
        raise ParsimError(f"profile {path} does not exist: measure one first (parsim profile --nproc-per-node N)")
    hw = HardwareProfile.from_dict(read_json(path, "corrupt profile"), origin=str(path))
    shapes = list(dict.fromkeys(shapes))
    hw, walls = measure_blocks_into(hw, shapes, path)
    return {"profile": str(path), "shapes": len(shapes), "not_measurable": skipped, "measured_now": len(walls),
            "measurement_wall_s": sum(walls.values())}


def _with_measured_blocks(hw, lines: list[dict]):
    """The profile with a block and the ends measured at every local shape of the plans in ``lines`` (measured
    here, written to the profile folder under the profile's name); (profile, {key: wall s}, number of shapes)."""
    from parsim.blockshape import plan_measured_shapes
    from parsim.hardware import profile_write_dir
    from parsim.plan import Plan
    from parsim.spec import load_model

    shapes = []
    for ln in lines:
        shapes += [s for s in plan_measured_shapes(load_model(ln["model"]), Plan.from_dict(ln["plan"])) if s]
    shapes = list(dict.fromkeys(shapes))
    hw, walls = measure_blocks_into(hw, shapes, profile_write_dir() / f"{hw.name}.json")
    return hw, walls, len(shapes)


def measure_blocks_into(hw, shapes, path: Path):
    """The blocks of ``shapes`` the profile lacks, timed on this device with a progress bar (ETA) and written
    with the profile to ``path`` after each (``profiler.blocks.add_measured_blocks``): (profile, {key: wall s})."""
    from parsim.profiler.blocks import add_measured_blocks

    path.parent.mkdir(parents=True, exist_ok=True)  # the user's profile folder, on first use
    with _progress() as prog:
        task = prog.add_task(f"measuring {len(shapes)} block shapes", total=len(shapes))
        return add_measured_blocks(hw, shapes, path, progress=lambda d, t, k: prog.update(task, completed=d))


def validate_published(csv: str, out_dir: str, profile: str | None, calibrated: bool = True) -> dict:
    from parsim import validate as V
    from parsim.hardware import load_profile

    profiles = {}
    if profile:
        hw = load_profile(profile)
        base = hw.provenance.get("calibrated_from", hw.name)
        profiles[base] = hw
    rows = V.published_rows(csv, profiles, calibrated=calibrated)
    summary = V.summarize(rows)
    V.write_results(Path(out_dir), rows, summary, {"tier": "published", "csv": csv, "profile": profile or (
        "spec-cal" if calibrated else "spec")})
    return summary


def print_summary(summary: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    con = Console()
    t = Table(title=f"validation: {summary['n_ok']} of {summary['n_rows']} rows scored "
                    f"({summary['n_unrepresentable']} unrepresentable, {summary['n_low_confidence']} low confidence)",
              caption="tok/s, step: mean |error| of tokens/s and of step time; max: largest tok/s error; ρ: Spearman "
                      "(step time); cover, ±: 90% interval coverage and median half-width; rule: the constant-MFU "
                      "rule of thumb on the same rows (one MFU for bf16, one for float8, leave-one-out)",
              box=box.SIMPLE_HEAD)
    for c in ("", "n", "tok/s", "max", "step", "ρ", "cover", "±"):
        t.add_column(c, justify="right" if c else "left", no_wrap=True)

    def add(name, s):
        if not s or s.get("step_time_mape") is None:
            return
        t.add_row(name, str(s.get("n", "")), pct(s.get("tps_mape")), pct(s.get("tps_max_ape")),
                  pct(s["step_time_mape"]), "-" if s.get("spearman") is None else f"{s['spearman']:.2f}",
                  pct(s.get("interval_coverage")), pct(s.get("interval_median_rel_halfwidth")))
        rule = s.get("constant_mfu_rule")
        if rule:
            t.add_row("  rule", "", pct(rule.get("tps_mape")), pct(rule.get("tps_max_ape")),
                      pct(rule["step_time_mape"]), "-" if rule.get("spearman") is None else f"{rule['spearman']:.2f}",
                      "", "")

    add("parsim", summary)
    for src, s in (summary.get("by_source") or {}).items():
        add(src, s)
    add("parsim, curves only", summary.get("without_measured_blocks"))
    con.print(t)
    mb = summary.get("measured_blocks")
    if mb:
        con.print(f"measured blocks: {mb['shapes']} local shapes, {mb['measured_now']} measured now in "
                  f"{mb['measurement_wall_s']:.1f} s")
    comps = summary.get("components")
    if comps:  # what each component is on the curves and with measured blocks, as a share of the measured step
        ct = Table(title="step components, median share of the measured step (every plan: components.csv)")
        for c in ("component", "curves", "measured blocks"):
            ct.add_column(c, justify="left" if c == "component" else "right")
        for k, v in comps.items():
            ct.add_row(k, pct(v["curves_share_of_measured"]), pct(v["blocks_share_of_measured"]))
        con.print(ct)
    if summary.get("top1_regret") is not None:
        con.print(f"top-1 regret (worst comparable set): {pct(summary['top1_regret'])}")
    if summary.get("memory_mape") is not None:
        con.print(f"peak memory: mean |err| {pct(summary['memory_mape'])}, max {pct(summary['memory_max_ape'])} "
                  f"over {summary['memory_n']} rows")
    fc = summary.get("fit_check")
    if fc:
        con.print(f"fits: {fc['ran_predicted_to_fit']} of {fc['ran']} runs that ran predicted to fit; "
                  f"{fc['oom_predicted_not_to_fit']} of {fc['oom']} OOM runs predicted not to")


def load_rows(dirs: list[str]) -> list[dict]:
    import json

    rows = []
    for d in dirs:
        p = Path(d) / "rows.json"
        if not p.is_file():
            raise ParsimError(f"{d}: no rows.json (run `parsim validate --out {d}` first)")
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ParsimError(f"cannot read {p}: {e}") from None
        if not isinstance(data, list):
            raise ParsimError(f"{p}: expected a list of rows")
        for r in data:
            r.setdefault("dir", d)
        rows += data
    return rows


def calibrate_dirs(dirs: list[str], params: str | None, folds: int, out_dir: str | None) -> dict:
    """Fit, cross-validate, write the calibrated profile(s) and each folder's calibration.json."""
    import math
    import os

    from parsim import calibrate as C
    from parsim.hardware import load_profile, profile_write_dir
    from parsim.jsonio import atomic_write_json, check_output_path
    from parsim.validate import summarize

    rows = load_rows(dirs)
    gpu = all(r.get("tier") == "published" for r in rows)
    names = tuple(p.strip() for p in params.split(",")) if params else (
        C.GPU_PARAMETERS if gpu else C.DEFAULT_PARAMETERS)
    profiles = {n: load_profile(n) for n in sorted({r["profile"] for r in rows if r.get("profile")})}
    target = Path(out_dir) if out_dir else profile_write_dir()
    for n in profiles:
        check_output_path(target / f"{n}-cal.json", make_parents=True)
    res = C.calibrate(rows, profiles, names, folds)
    scored = res["rows"]
    q = res["interval_log_halfwidth"]
    views = {}
    for key, pred, half in (("uncalibrated", res["uncalibrated"], None), ("in_sample", res["in_sample"], None),
                            ("out_of_fold", res["out_of_fold"], res["interval_fold_halfwidth"])):
        view = []
        for i, r in enumerate(scored):
            v = dict(r, predicted_step_s=float(pred[i]))
            v["interval_s"] = None if half is None or not math.isfinite(half[i]) else \
                [float(pred[i] * math.exp(-half[i])), float(pred[i] * math.exp(half[i]))]
            view.append(v)
        views[key] = summarize(view)
    stats = {"out_of_fold": views["out_of_fold"], "in_sample": views["in_sample"],
             "uncalibrated": views["uncalibrated"]}
    written = []
    for n, hw in profiles.items():
        new = C.calibrated_profile(hw, res, {k: _headline(v) for k, v in stats.items()}, list(dirs))
        written.append(os.path.relpath(new.save(target / f"{n}-cal.json")))
    for d in dirs:
        mine = [i for i, r in enumerate(scored) if r["dir"] == d]
        atomic_write_json(Path(d) / "calibration.json", {
            "factors": res["factors"], "interval_log_halfwidth": q, "profiles": written, "stats": stats,
            "rows": {scored[i]["plan_id"] + "/" + scored[i]["model"]: {
                "out_of_fold_step_s": float(res["out_of_fold"][i]), "in_sample_step_s": float(res["in_sample"][i]),
                "fold": int(res["folds"][i]), "fold_log_halfwidth": _finite(res["interval_fold_halfwidth"][i])}
                for i in mine}})
    return {"factors": res["factors"], "parameters": {n: C.PARAMETERS[n][0] for n in names},
            "interval_log_halfwidth": q, "n_rows": len(scored), "folds": int(max(res["folds"]) + 1),
            "profiles_written": written, **stats}


def _finite(x):
    import math

    return float(x) if math.isfinite(x) else None


def _headline(s: dict) -> dict:
    keys = ("n", "step_time_mape", "step_time_max_ape", "spearman", "interval_coverage",
            "interval_median_rel_halfwidth", "top1_regret")
    return {k: s.get(k) for k in keys}


def print_calibration(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"calibration: {out['n_rows']} rows, {out['folds']} grouped folds")
    t.add_column("parameter")
    t.add_column("factor", justify="right")
    t.add_column("scales")
    for n, f in out["factors"].items():
        t.add_row(n, f"{f:.3f}", out["parameters"][n])
    con.print(t)
    print_summary_table(con, {k: out[k] for k in ("uncalibrated", "in_sample", "out_of_fold")})
    con.print(f"90% interval: x/÷ {__import__('math').exp(out['interval_log_halfwidth']):.3f}; wrote "
              + ", ".join(out["profiles_written"]))


def print_summary_table(con, views: dict) -> None:
    from rich import box
    from rich.table import Table

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    t = Table(title="accuracy", box=box.SIMPLE_HEAD,
              caption="step, tok/s: mean |error| of step time and of tokens/s (max: the largest); ρ: Spearman; "
                      "regret: top-1 regret; cover, ±: 90% interval coverage and median half-width; rule: the "
                      "constant-MFU rule of thumb (leave-one-out, bf16 and float8 apart)")
    for c in ("", "step", "max", "tok/s", "max", "ρ", "regret", "cover", "±"):
        t.add_column(c, justify="right" if c else "left", no_wrap=True)
    for name, s in views.items():
        t.add_row(name.replace("_", " ").split(" (")[0], pct(s.get("step_time_mape")), pct(s.get("step_time_max_ape")),
                  pct(s.get("tps_mape")), pct(s.get("tps_max_ape")),
                  "-" if s.get("spearman") is None else f"{s['spearman']:.2f}", pct(s.get("top1_regret")),
                  pct(s.get("interval_coverage")), pct(s.get("interval_median_rel_halfwidth")))
        rule = s.get("constant_mfu_rule")
        if rule and name == next(iter(views)):  # the rule does not depend on the view: shown once
            t.add_row("rule", pct(rule["step_time_mape"]), pct(rule["step_time_max_ape"]),
                      pct(rule.get("tps_mape")), pct(rule.get("tps_max_ape")),
                      "-" if rule.get("spearman") is None else f"{rule['spearman']:.2f}", "", "", "")
    con.print(t)
    for name, s in views.items():
        by = s.get("by_source")
        if by and name.replace("_", " ").startswith("out of fold"):
            ts = Table(title="out of fold, by source: tokens/s mean |error| and max, the rule's beside",
                       box=box.SIMPLE_HEAD)
            for c in ("source", "n", "tok/s", "max", "rule", "rule max"):
                ts.add_column(c, justify="left" if c == "source" else "right", no_wrap=True)
            for src, v in by.items():
                r = v.get("constant_mfu_rule") or {}
                ts.add_row(src, str(v.get("n")), pct(v.get("tps_mape")), pct(v.get("tps_max_ape")),
                           pct(r.get("tps_mape")), pct(r.get("tps_max_ape")))
            con.print(ts)
