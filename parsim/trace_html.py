"""`parsim read-trace --html`: one self-contained plotly page of a traced job (and its prediction, when a plan is
given): the step's components traced beside predicted as stacked bars, each rank's profiled steps stacked by
component, the compute kinds traced beside predicted, and the largest kernels (or ops, on a CPU trace)."""

from __future__ import annotations

import html as _html

from .jsonio import atomic_write_text
from .units import MS

ORDER = ("compute_forward", "compute_backward", "recompute", "optimizer", "idle")


def _ordered(keys) -> list[str]:
    keys = set(keys)
    first = [k for k in ORDER if k in keys and k != "idle"]
    comm = sorted(k for k in keys if k.startswith("comm_"))
    rest = sorted(keys - set(first) - set(comm) - {"idle"})
    return first + comm + rest + (["idle"] if "idle" in keys else [])


def _figures(res: dict) -> list:
    import plotly.graph_objects as go

    figs = []
    if res.get("rows"):
        f = go.Figure()
        for row in sorted(res["rows"], key=lambda r: _ordered([x["component"] for x in res["rows"]])
                          .index(r["component"])):
            f.add_bar(name=row["component"], x=["traced", "predicted"],
                      y=[row["traced_s"] / MS, row["predicted_s"] / MS])
        f.update_layout(barmode="stack", title=f"step of rank {res['slowest_rank']}: traced "
                        f"{res['step_traced_s'] / MS:.1f} ms, predicted {res['step_predicted_s'] / MS:.1f} ms",
                        yaxis_title="ms per step", height=480)
        figs.append(f)
    f = go.Figure()
    comps = _ordered({k for r in res["ranks"] for k in r["components_s"]})
    labels = [f"rank {r['rank']}" for r in res["ranks"]]
    for c in comps:
        f.add_bar(name=c, x=labels, y=[r["components_s"].get(c, 0.0) / MS for r in res["ranks"]])
    f.update_layout(barmode="stack", title="each rank's mean profiled step, by component", yaxis_title="ms",
                    height=440)
    figs.append(f)
    if res.get("kind_rows"):
        kr = res["kind_rows"]
        f = go.Figure()
        f.add_bar(name="traced", y=[r["component"] for r in kr], x=[r["traced_s"] / MS for r in kr],
                  orientation="h")
        f.add_bar(name="predicted", y=[r["component"] for r in kr], x=[r["predicted_s"] / MS for r in kr],
                  orientation="h")
        f.update_layout(barmode="group", title="compute by phase and kind", xaxis_title="ms per step",
                        height=max(360, 28 * len(kr)), yaxis={"automargin": True})
        figs.append(f)
    else:  # no plan: the traced kinds alone
        slow = next(r for r in res["ranks"] if r["rank"] == res["slowest_rank"])
        kinds = sorted(slow["kinds_s"].items())
        f = go.Figure()
        f.add_bar(name="traced", y=[k for k, _ in kinds], x=[v / MS for _, v in kinds], orientation="h")
        f.update_layout(title=f"compute by phase and kind, rank {res['slowest_rank']}", xaxis_title="ms per step",
                        height=max(360, 28 * len(kinds)), yaxis={"automargin": True})
        figs.append(f)
    top = res.get("top_kernels") or []
    if top:
        f = go.Figure()
        names = [t["name"][:70] for t in top][::-1]
        f.add_bar(y=names, x=[t["seconds"] / MS for t in top][::-1], orientation="h",
                  hovertext=[f"{t['name']}: {t['calls']} calls" for t in top][::-1])
        f.update_layout(title=f"largest {'kernels' if res['device'] == 'cuda' else 'ops'} of rank "
                        f"{res['slowest_rank']} (ms over the profiled steps)", height=max(360, 30 * len(top)),
                        yaxis={"automargin": True})
        figs.append(f)
    return figs


def _collectives_html(res: dict) -> str:
    import pandas as pd

    rows = res.get("collectives") or []
    if not rows:
        return "<p>no collectives in the profiled steps</p>"
    df = pd.DataFrame(rows)
    df["input_MB"] = df["input_bytes"].map(lambda v: None if v is None else v / 1e6)
    df["time_ms"] = df["time_s"] / MS
    df["exposed_ms"] = df["exposed_s"] / MS
    df = df[["op", "axis", "calls", "group_size", "dtype", "input_MB", "time_ms", "exposed_ms"]]
    return df.to_html(index=False, float_format=lambda x: f"{x:,.2f}", na_rep="?", classes="rows", escape=True)


def _observer(res: dict) -> str:
    if res.get("unprofiled_step_s") is None:
        return ""
    return (f" The same plan without the profiler: {res['unprofiled_step_s'] / MS:,.1f} ms a step (the profiler's "
            f"own cost is in the traced steps).")


def write_html(path: str, res: dict) -> None:
    figs = _figures(res)
    parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0), default_width="100%")
             for i, f in enumerate(figs)]
    head = (f"{_html.escape(res['model'])} {_html.escape(res['plan'])} on profile {_html.escape(res['profile'])}"
            if res.get("plan") else "no plan given: the trace alone")
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>parsim read-trace</title>
<style>body{{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px}} table{{border-collapse:collapse;
font-size:13px}} td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}} td:first-child{{text-align:left}}
.scroll{{max-width:100%;overflow-x:auto}}</style>
</head><body>
<h1>parsim: a traced job</h1>
<p>{res['ranks_read']} of {res['world_size']} ranks read ({res['device']}); {head}. Components partition each
profiled step (they sum to it); comm_&lt;axis&gt; is collective time no compute overlapped.{_observer(res)}</p>
{''.join(parts)}
<h2>collectives of rank {res['slowest_rank']} (per step)</h2>
<div class="scroll">{_collectives_html(res)}</div>
</body></html>"""
    atomic_write_text(path, doc)
