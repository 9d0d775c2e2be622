"""`parsim report`: predicted vs measured as a pandas table and a self-contained plotly HTML page.

The page inlines plotly.js once (about 4.7 MB with plotly 6-7; no network needed to view it) and holds: the
statistics beside the constant-MFU rule; predicted vs measured step time on log axes with y = x and the interval as
error bars, hover showing the plan and its predicted breakdown; per-plan stacked bars of the predicted components
beside the measured total; the histogram of signed errors; interval coverage; and the table sorted by error.
"""

from __future__ import annotations

import html as _html
import math
from pathlib import Path

from .jsonio import atomic_write_text, read_json
from .units import MS

COMPONENT_ORDER = ("compute_forward", "compute_backward", "recompute", "pp_bubble", "optimizer")


def _calibration(dirs: list[str]) -> dict:
    out = {}
    for d in dirs:
        p = Path(d) / "calibration.json"
        if p.is_file():
            out[d] = read_json(p, "cannot read")
    return out


def build_table(rows: list[dict], dirs: list[str]):
    """(DataFrame of every row, statistics per view). Views: as predicted (uncalibrated profile) and, where a
    calibration.json exists beside the rows, out of fold (each row predicted by a fit that did not see it)."""
    import pandas as pd

    from .validate import summarize

    cal = _calibration(dirs)
    recs = []
    for r in rows:
        c = cal.get(r.get("dir"), {}).get("rows", {}).get(f"{r['plan_id']}/{r['model']}", {})
        meas, pred = r.get("measured_step_s"), r.get("predicted_step_s")
        oof = c.get("out_of_fold_step_s")
        q = c.get("fold_log_halfwidth")
        iv = r.get("interval_s") or [None, None]
        oof_iv = [oof * math.exp(-q), oof * math.exp(q)] if oof and q is not None and math.isfinite(q) else [None] * 2
        best = oof if oof else pred
        best_iv = oof_iv if oof else iv
        recs.append({
            "tier": r["tier"], "source": r.get("source"), "model": r["model"], "plan_id": r["plan_id"],
            "describe": r["describe"], "family": r.get("family"), "n_gpus": r.get("n_gpus"), "status": r["status"],
            "reason": r.get("reason") or "", "confidence": r.get("confidence"),
            "measured_ms": meas / MS if meas else None, "predicted_ms": pred / MS if pred else None,
            "oof_ms": oof / MS if oof else None, "shown_ms": best / MS if best else None,
            "low_ms": best_iv[0] / MS if best_iv[0] else None, "high_ms": best_iv[1] / MS if best_iv[1] else None,
            "err_pct": 100 * (best - meas) / meas if best and meas else None,
            "measured_mem_gib": (r.get("measured_peak_bytes") or 0) / 2**30 or None,
            "predicted_mem_gib": (r.get("predicted_peak_bytes") or 0) / 2**30 or None,
            "breakdown_ms": {k: v / MS for k, v in (r.get("time_breakdown_s") or {}).items()},
        })
    table = pd.DataFrame.from_records(recs)
    table["abs_err"] = table["err_pct"].abs()
    stats = {"as predicted": summarize(rows)}
    if cal:
        oof_rows = []
        for r, rec in zip(rows, recs, strict=True):
            if rec["oof_ms"] is not None:
                oof_rows.append(dict(r, predicted_step_s=rec["oof_ms"] * MS,
                                     interval_s=[rec["low_ms"] * MS, rec["high_ms"] * MS] if rec["low_ms"] else None))
        stats["out of fold (calibrated)"] = summarize(oof_rows)
    return table, stats


def _figures(table, stats):
    import plotly.graph_objects as go

    ok = table[(table.status == "ok") & table.measured_ms.notna() & table.shown_ms.notna()].copy()
    figs = []
    hover = [f"{r.describe} ({r.model})<br>measured {r.measured_ms:.1f} ms, shown {r.shown_ms:.1f} ms "
             f"({r.err_pct:+.0f}%)<br>" + "<br>".join(f"{k}: {v:.1f} ms" for k, v in r.breakdown_ms.items() if v > 0)
             for r in ok.itertuples()]
    scatter = go.Figure()
    ok["kind"] = ok.tier + ok.confidence.map(lambda c: " (low confidence)" if c == "low" else "")
    for tier, sub in ok.groupby("kind"):
        idx = [ok.index.get_loc(i) for i in sub.index]
        has_iv = sub.low_ms.notna()
        scatter.add_trace(go.Scatter(
            x=sub.measured_ms, y=sub.shown_ms, mode="markers", name=str(tier), text=[hover[i] for i in idx],
            hoverinfo="text",
            error_y=dict(type="data", symmetric=False, array=(sub.high_ms - sub.shown_ms).where(has_iv, 0),
                         arrayminus=(sub.shown_ms - sub.low_ms).where(has_iv, 0), thickness=1)))
    lo, hi = float(ok[["measured_ms", "shown_ms"]].min().min()) * 0.7, float(ok[["measured_ms", "shown_ms"]]
                                                                               .max().max()) * 1.4
    scatter.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x", line=dict(dash="dash")))
    scatter.update_layout(title="predicted vs measured step time (ms, log axes; bars: 90% interval)",
                          xaxis_type="log", yaxis_type="log", xaxis_title="measured ms", yaxis_title="predicted ms",
                          height=560)
    figs.append(scatter)
    figs.append(_component_bars(ok))
    scored = ok[ok.confidence != "low"]  # the rows the statistics score (low-confidence rows are drawn, not scored)
    hist = go.Figure(go.Histogram(x=scored.err_pct, nbinsx=30))
    hist.update_layout(title=f"signed step-time error (%) of the {len(scored)} scored rows",
                       xaxis_title="(shown - measured) / measured, %", height=380)
    figs.append(hist)
    iv = scored[scored.low_ms.notna()]
    if len(iv):
        covered = (iv.low_ms <= iv.measured_ms) & (iv.measured_ms <= iv.high_ms)
        cov = go.Figure(go.Bar(x=["inside the interval", "outside"], y=[int(covered.sum()), int((~covered).sum())]))
        cov.update_layout(title=f"interval coverage: {100 * covered.mean():.0f}% of {len(iv)} rows (target 90%)",
                          height=340)
        figs.append(cov)
    return figs


BAR_ROW_PX = 22  # [assumed] one horizontal bar with its label in a 12 px font, and the gap between bars
BAR_MARGIN_PX = 140  # title, legend and axis


def unique_labels(table) -> list[str]:
    """One label per row: the plan and model, with the source where two rows would read the same, and a number
    where even that repeats (plotly draws rows that share a category as one stacked bar)."""
    from collections import Counter

    base = [f"{r.describe} ({r.model})" for r in table.itertuples()]
    shared = Counter(base)
    seen: dict[str, int] = {}
    out = []
    for r, b in zip(table.itertuples(), base, strict=True):
        label = f"{b} [{r.source}]" if shared[b] > 1 and r.source else b
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def _component_bars(ok):
    """The predicted components of up to 60 rows (the longest measured steps) as horizontal stacked bars, one per
    row, the measured step beside each: a figure as tall as its rows, labels on the left where they fit."""
    import plotly.graph_objects as go

    top = ok.sort_values("measured_ms").tail(60)
    comps = sorted({k for b in top.breakdown_ms for k in b},
                   key=lambda k: (COMPONENT_ORDER.index(k) if k in COMPONENT_ORDER else 99, k))
    labels = unique_labels(top)
    bars = go.Figure()
    for k in comps:
        bars.add_trace(go.Bar(y=labels, x=[b.get(k, 0.0) for b in top.breakdown_ms], name=k, orientation="h"))
    bars.add_trace(go.Scatter(y=labels, x=top.measured_ms, mode="markers", name="measured",
                              marker=dict(symbol="diamond", size=9, color="black")))
    bars.update_layout(barmode="stack", title=f"predicted components (uncalibrated) beside the measured step: "
                                              f"the {len(top)} longest measured steps",
                       xaxis_title="ms", height=BAR_MARGIN_PX + BAR_ROW_PX * len(top),
                       yaxis=dict(automargin=True, tickfont=dict(size=11), type="category"))
    return bars


def _stats_html(stats: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    def rho(s):
        return "-" if s.get("spearman") is None else str(round(s["spearman"], 2))

    head = ("<tr><th>view</th><th>rows</th><th>tokens/s mean |err|</th><th>max</th><th>step mean |err|</th>"
            "<th>max</th><th>Spearman</th><th>top-1 regret</th><th>coverage</th><th>half-width</th>"
            "<th>memory mean |err|</th></tr>")
    body = []

    def rule_row(label, rule):
        body.append(f"<tr class='rule'><td>{label}</td><td></td><td>{pct(rule.get('tps_mape'))}</td>"
                    f"<td>{pct(rule.get('tps_max_ape'))}</td><td>{pct(rule['step_time_mape'])}</td>"
                    f"<td>{pct(rule['step_time_max_ape'])}</td><td>{rho(rule)}</td>"
                    "<td></td><td></td><td></td><td></td></tr>")

    for name, s in stats.items():
        body.append(f"<tr><td>{_html.escape(name)}</td><td>{s.get('n_ok')}</td><td>{pct(s.get('tps_mape'))}</td>"
                    f"<td>{pct(s.get('tps_max_ape'))}</td><td>{pct(s.get('step_time_mape'))}</td>"
                    f"<td>{pct(s.get('step_time_max_ape'))}</td><td>{rho(s)}</td>"
                    f"<td>{pct(s.get('top1_regret'))}</td><td>{pct(s.get('interval_coverage'))}</td>"
                    f"<td>{pct(s.get('interval_median_rel_halfwidth'))}</td><td>{pct(s.get('memory_mape'))}</td></tr>")
        if s.get("constant_mfu_rule"):
            rule_row("constant-MFU rule (leave-one-out, bf16 / float8), same rows", s["constant_mfu_rule"])
        for src, ss in (s.get("by_source") or {}).items():
            if ss.get("step_time_mape") is None:
                continue
            body.append(f"<tr class='src'><td>&nbsp;&nbsp;{_html.escape(src)}</td><td>{ss.get('n')}</td>"
                        f"<td>{pct(ss.get('tps_mape'))}</td><td>{pct(ss.get('tps_max_ape'))}</td>"
                        f"<td>{pct(ss['step_time_mape'])}</td><td>{pct(ss.get('step_time_max_ape'))}</td>"
                        f"<td>{rho(ss)}</td><td></td><td>{pct(ss.get('interval_coverage'))}</td><td></td><td></td></tr>")
            if ss.get("constant_mfu_rule"):
                rule_row("&nbsp;&nbsp;&nbsp;&nbsp;rule, same rows", ss["constant_mfu_rule"])
    return f"<table class='stats'>{head}{''.join(body)}</table>"


def write_html(path: str, table, stats: dict, dirs: list[str], plotly_js: str = "inline") -> None:
    """``plotly_js`` inline: plotly.js inside the page (~4.7 MB, opens offline); cdn: one <script> tag loading it
    from cdn.plot.ly (a page of ~100-300 kB that needs the network to draw)."""
    figs = _figures(table, stats)
    first = True if plotly_js == "inline" else "cdn"
    parts = [f.to_html(full_html=False, include_plotlyjs=(first if i == 0 else False), default_width="100%")
             for i, f in enumerate(figs)]
    cols = ["describe", "model", "tier", "source", "status", "measured_ms", "shown_ms", "low_ms", "high_ms",
            "err_pct", "measured_mem_gib", "predicted_mem_gib", "reason"]
    worst = table.sort_values("abs_err", ascending=False, na_position="last")[cols]
    rows_html = worst.to_html(index=False, float_format=lambda x: f"{x:.2f}", na_rep="", classes="rows",
                              escape=True)
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>parsim report</title>
<style>body{{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px}} table{{border-collapse:collapse;
font-size:13px}} td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}} td:first-child{{text-align:left}}
tr.rule td{{color:#555;font-style:italic}} tr.src td{{color:#333}} .rows td:nth-child(1){{text-align:left}}
.scroll{{max-width:100%;overflow-x:auto}} .rows td:last-child{{text-align:left;min-width:16em;max-width:32em;
white-space:normal}}</style>
</head><body>
<h1>parsim: predicted vs measured</h1>
<p>From {_html.escape(', '.join(dirs))}. "shown" is the out-of-fold calibrated prediction where a calibration
exists (each row predicted by a fit that did not see its group), else the prediction as made. Scored: rows with
status ok, a measurement and confidence other than low.</p>
<div class="scroll">{_stats_html(stats)}</div>
{''.join(parts)}
<h2>every row ({len(table)}), by |error|</h2>
<div class="scroll">{rows_html}</div>
</body></html>"""
    atomic_write_text(path, doc)
