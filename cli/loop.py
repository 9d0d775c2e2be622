"""Rendering of `parsim validate`, `report` and `calibrate` (rich tables); the work is ``parsim.loop_jobs``'s."""

from __future__ import annotations


def print_summary(summary: dict) -> None:
    from rich import box
    from rich.table import Table

    from parsim.console import console as folding_console

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    con = folding_console()
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
    _print_summary_notes(con, summary, pct)


def _print_summary_notes(con, summary: dict, pct) -> None:
    """``print_summary``'s lines below its table: measured blocks, collective rounds, step components, regret,
    repeatability, peak memory, the fit check."""
    from rich.table import Table

    mb = summary.get("measured_blocks")
    if mb:
        rounds = f", timed at the start of each of {mb['rounds']} rounds (the median kept)" if mb.get("rounds") else ""
        con.print(f"measured blocks: {mb['shapes']} local shapes{rounds}, {mb['measured_now']} measured after the "
                  f"runs; {mb['measurement_wall_s']:.1f} s in all")
    cr = summary.get("collective_rounds")
    if cr and cr.get("sweeps"):
        con.print(f"collectives: swept at the start of {cr['sweeps']} rounds ({cr['measurement_wall_s']:.1f} s), "
                  "curves refitted to each point's median with the profile's own sweep")
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
    rep = summary.get("repeatability")
    if rep:
        con.print(f"repeatability: a round's median is {pct(rep['round_ape_mean'])} from the plan's median on "
                  f"average (max {pct(rep['round_ape_max'])}, {rep['n']} plans): the floor under the step error here")
    if summary.get("memory_mape") is not None:
        con.print(f"peak memory: mean |err| {pct(summary['memory_mape'])}, max {pct(summary['memory_max_ape'])} "
                  f"over {summary['memory_n']} rows")
    fc = summary.get("fit_check")
    if fc:
        con.print(f"fits: {fc['ran_predicted_to_fit']} of {fc['ran']} runs that ran predicted to fit; "
                  f"{fc['oom_predicted_not_to_fit']} of {fc['oom']} OOM runs predicted not to")


def print_calibration(out: dict) -> None:
    from rich.table import Table

    from parsim.console import console as folding_console

    con = folding_console()
    kind = "sources, each left out" if out.get("folds_by") == "source" else "folds grouped by family"
    t = Table(title=f"calibration: {out['n_rows']} rows, {out['folds']} {kind}")
    t.add_column("parameter")
    t.add_column("factor", justify="right")
    t.add_column("scales")
    t.add_column("leaving a fold out", justify="right")
    ranges, poor = out.get("fold_ranges") or {}, out.get("unidentified") or {}
    for n, f in out["factors"].items():
        lo, hi = ranges.get(n, (f, f))
        t.add_row(n, f"{f:.3f}", out["parameters"][n], f"{lo:.2f}-{hi:.2f}" + (" (poorly identified)" if n in poor
                                                                              else ""))
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
            ts = Table(title="out of fold, by source: tokens/s mean |error| and max, 90% interval coverage and "
                             "median half-width, the rule's error beside", box=box.SIMPLE_HEAD)
            for c in ("source", "n", "tok/s", "max", "cover", "±", "rule", "rule max"):
                ts.add_column(c, justify="left" if c == "source" else "right", no_wrap=True)
            for src, v in by.items():
                r = v.get("constant_mfu_rule") or {}
                ts.add_row(src, str(v.get("n")), pct(v.get("tps_mape")), pct(v.get("tps_max_ape")),
                           pct(v.get("interval_coverage")), pct(v.get("interval_median_rel_halfwidth")),
                           pct(r.get("tps_mape")), pct(r.get("tps_max_ape")))
            con.print(ts)
