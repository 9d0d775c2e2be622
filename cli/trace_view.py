"""Rendering of `parsim read-trace` (rich tables); the work is ``parsim.traceread`` and ``parsim.trace_compare``'s."""

from __future__ import annotations

from parsim.units import MS


def _ms(x) -> str:
    return "-" if x is None else f"{x / MS:,.1f}"


def _dtype(text: str) -> str:
    short = {"c10::bfloat16": "bf16", "bfloat16": "bf16", "float": "fp32", "c10::half": "fp16", "half": "fp16",
             "c10::float8_e4m3fn": "fp8", "float8_e4m3fn": "fp8", "double": "fp64", "long": "int64", "int": "int32"}
    return ",".join(short.get(t.lower(), t) for t in text.split(",")) if text else "?"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _table(title: str, columns: tuple[str, ...], rows, last=None):
    """A table whose first column is a name (left) and the rest numbers (right); ``last`` a bold closing row."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    if last is not None:
        t.add_row(*last, style="bold")
    return t


def _by_size(d: dict) -> list:
    return sorted(d.items(), key=lambda kv: -kv[1])


def print_trace(res: dict) -> None:
    from parsim.console import console as folding_console

    con = folding_console()
    ranks = res["ranks"]
    con.print(f"{res['ranks_read']} of {res['world_size']} ranks read ({res['device']}), "
              f"{ranks[0]['steps']} profiled steps each; median step {_ms(res['median_step_s'])} ms; slowest rank "
              f"{res['slowest_rank']}")
    slow = next(r for r in ranks if r["rank"] == res["slowest_rank"])
    if res.get("unprofiled_step_s") is not None:
        con.print(f"the same plan without the profiler: {_ms(res['unprofiled_step_s'])} ms a step (the traced steps "
                  "hold the profiler's own cost)")
    if res.get("rows"):
        con.print(_table(f"rank {res['slowest_rank']}'s mean step: traced vs predicted ({res['model']} "
                         f"{res['plan']}, profile {res['profile']})",
                         ("component", "traced ms", "predicted ms", "traced - predicted"),
                         [(r["component"], _ms(r["traced_s"]), _ms(r["predicted_s"]), _ms(r["diff_s"]))
                          for r in res["rows"]],
                         ("step", _ms(res["step_traced_s"]), _ms(res["step_predicted_s"]),
                          _ms(res["step_traced_s"] - res["step_predicted_s"]))))
        con.print(_table("compute by phase and kind", ("phase.kind", "traced ms", "predicted ms"),
                         [(r["component"], _ms(r["traced_s"]), _ms(r["predicted_s"])) for r in res["kind_rows"]]))
        con.print(f"MFU traced {_pct(res['mfu_traced'])}, predicted {_pct(res['mfu_predicted'])}; prediction "
                  f"{_pct(res['step_error'])} against the traced step")
        con.print("most of the difference: " + "; ".join(
            f"{r['component']} {_ms(r['traced_s'])} traced vs {_ms(r['predicted_s'])} predicted"
            for r in res["explains"]))
    else:
        con.print(_table(f"rank {res['slowest_rank']}'s mean step", ("component", "ms"),
                         [(n, _ms(v)) for n, v in _by_size(slow["components_s"])], ("step", _ms(slow["step_s"]))))
        con.print(_table("compute by phase and kind", ("phase.kind", "ms"),
                         [(n, _ms(v)) for n, v in _by_size(slow["kinds_s"])]))
    _collectives(con, res)
    for n in res.get("notes") or []:
        con.print(f"note: {n}")
    if len(ranks) > 1:
        con.print("each rank's mean step (ms): " + ", ".join(f"{r['rank']}: {_ms(r['step_s'])}" for r in ranks))


def _collectives(con, res: dict) -> None:
    from rich import box
    from rich.table import Table

    rows = res.get("collectives") or []
    if not rows:
        con.print("no collectives in the profiled steps")
        return
    t = Table(title=f"collectives of rank {res['slowest_rank']}, per step", box=box.SIMPLE_HEAD)
    for c in ("op", "axis", "calls", "group", "dtype", "input MB", "time ms", "exposed ms"):
        t.add_column(c, justify="left" if c in ("op", "axis", "dtype") else "right", no_wrap=c in ("op", "axis"))
    for r in rows:
        t.add_row(r["op"], r["axis"], f"{r['calls']:g}", str(r["group_size"] or "?"), _dtype(r["dtype"]),
                  "?" if r["input_bytes"] is None else f"{r['input_bytes'] / 1e6:,.2f}", _ms(r["time_s"]),
                  _ms(r["exposed_s"]))
    con.print(t)


def print_trace_calibration(out: dict) -> None:
    import math

    from parsim.console import console as folding_console

    con = folding_console()
    con.print("factors: " + ", ".join(f"{k} x{v:.3g}" for k, v in out["factors"].items()))
    for p in out["plans"]:
        con.print(_table(f"{p['plan']}: step traced {_ms(p['traced_step_s'])} ms, predicted "
                         f"{_ms(p['predicted_before_s'])} -> {_ms(p['predicted_after_s'])} ms",
                         ("component", "traced ms", "before ms", "after ms"),
                         [(r["component"], _ms(r["traced_s"]), _ms(r["before_s"]), _ms(r["after_s"]))
                          for r in p["components"]]))
    near = ", ".join(f"{g} x/÷{math.exp(q):.2f}" for g, q in out["interval_log_halfwidth_by_group"].items())
    con.print(f"90% intervals: {near} (the traced families); other families x/÷"
              f"{math.exp(out['interval_log_halfwidth']):.2f}")
    con.print(f"wrote {out['written']}")
