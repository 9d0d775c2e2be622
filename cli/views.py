"""Rendering of `parsim search` (rich tables, progress, CSV, emitted files). GiB and ms appear only here."""

from __future__ import annotations

import math

from parsim.machine import mfu_text
from parsim.plan_text import (
    SHORT_DOMINANT,
    legend,
    order_str,
    sched_str,
    short_ac,
    short_batch,
    short_degrees,
    short_options,
)
from parsim.units import MS, GiB


def run_search_cli(spec, hw, gpus, space, *, top, explain, outputs, as_json, execute=0, model_arg=None, wide=False,
                   measure=0, measure_budget_flops=None, framework=None):
    """`parsim search`: the search job (``parsim.search_job``) with progress bars and its lines on stderr, then
    its result printed (tables or one JSON document)."""
    from parsim.cli.common import Bars
    from parsim.console import console as folding_console
    from parsim.search import result_to_dict
    from parsim.search_job import run_search_job

    err, con = folding_console(stderr=True), folding_console()
    with Bars(err, transient=True) as bars:
        job = run_search_job(spec, hw, gpus, space, top=top, outputs=outputs, measure=measure,
                             measure_budget_flops=measure_budget_flops, execute=execute, explain=explain,
                             model_arg=model_arg, progress=bars, framework=framework,
                             log=lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True))
    res = job.res
    if as_json:
        from parsim.cli.common import emit_json

        d = result_to_dict(res, spec, hw, gpus, space, top)
        if job.explained:
            d["explain"] = job.explained
        if job.executed:
            d["executed"] = job.executed
        if job.measured:
            d["measured"] = {k: v for k, v in job.measured.items() if k != "profile"}
        emit_json(d)
        return
    if not _print_search(con, spec, hw, gpus, space, res, top, wide):
        return
    if job.measured:
        _print_reranked(con, job.measured)
    if job.explained:
        _print_explain(con, res, explain, job.explained)
    if job.executed:
        _print_executed(con, job.executed)
    _print_written(con, job, outputs)


def _print_written(con, job, outputs) -> None:
    if outputs.emit_plan and job.best:
        con.print(f"wrote plan #1 ({job.best.plan_id}) to {outputs.emit_plan}")
    if outputs.emit_megatron:
        con.print(f"wrote the Megatron-LM arguments of plan #1 to {outputs.emit_megatron}")
    if outputs.emit_torchtitan:
        kind = "0.3.0 Python" if outputs.torchtitan_format == "python" else "v0.2 TOML"
        con.print(f"wrote the torchtitan {kind} config of plan #1 to {outputs.emit_torchtitan}")


def _print_search(con, spec, hw, gpus, space, res, top, wide) -> bool:
    """The search's text output: what was considered, pruned and evaluated, the top table and the Pareto front;
    when nothing fits, the plan closest to fitting. False when no plan is ranked."""
    from rich import box
    from rich.table import Table

    batches = res.work.get("memory_replay_batches", 0)
    con.print(f"[bold]{spec.name}[/bold] on {gpus} x {hw.device_name} ({hw.name}), global batch "
              f"{space.global_batch_size} x seq {space.seq_len}: {res.considered:,} plans considered: "
              f"{res.pruned_dominated:,} dominated, {res.pruned_memory:,} do not fit (usable "
              f"{res.usable_memory_bytes / GiB:.1f} GiB), {res.pruned_bound:,} lose on a time bound, "
              f"{res.evaluated:,} evaluated in full; memory replayed for {res.screened:,} (row, AC/reshard) pairs "
              f"in {batches} batches; {res.wall_s:.2f} s")
    if res.stopped_at is not None:
        con.print(f"[yellow]stopped by --max-seconds after {100 * res.stopped_at:.0f}% of the space[/yellow]: the "
                  "plans below are the best of the part searched, not of the whole space")
    if res.pruned_structural:
        con.print("structurally invalid (degree combinations / batch splits): "
                  + "; ".join(f"{k}: {v}" for k, v in sorted(res.pruned_structural.items())))
    if not res.top:
        if res.closest:
            plan, mem = res.closest
            short = mem - res.usable_memory_bytes
            con.print(f"[red]nothing fits[/red]: the plan closest to fitting ({plan.describe()}, AC {plan.ac}, "
                      f"local batch {plan.local_batch_size}) needs {mem / GiB:.2f} GiB per GPU, "
                      f"{short / GiB:.2f} GiB more than the {res.usable_memory_bytes / GiB:.2f} GiB usable. "
                      "Add GPUs, shorten the sequence or lower the batch.")
        else:
            con.print("[red]no valid plan[/red]: every degree combination was structurally invalid (see above)")
        return False
    con.print(_top_table(res, top, hw, wide, con.width))
    pt = Table(title=f"Pareto front: step time vs reserved memory ({len(res.pareto)} plans)", box=box.SIMPLE_HEAD,
               padding=(0, 0), show_edge=False)
    for col, just in (("step ms", "right"), ("GiB", "right"), ("degrees", "left"), ("sched", "left"),
                      ("batch", "left"), ("AC", "left"), ("options", "left")):
        pt.add_column(col, justify=just, no_wrap=True)
    for plan, step, mem in res.pareto:
        pt.add_row(f"{step / MS:.1f}", f"{mem / GiB:.1f}", short_degrees(plan), sched_str(plan),
                   short_batch(plan), short_ac(plan.ac), short_options(plan))
    con.print(pt)
    tie = tie_note(res, hw)
    if tie:
        con.print(tie)
    con.print(f"[dim]{legend()}[/dim]")
    return True


def tie_note(res, hw) -> str:
    """A line when ranked plans lie within the best plan's 90% interval (and it in theirs): the model cannot tell
    them apart, a measurement can."""
    from parsim.plan import interval_factor

    best, step1 = res.top[0].plan, res.top[0].step_time_s
    hi1 = step1 * interval_factor(hw, best)
    tied = [i for i, r in enumerate(res.top, 1) if i > 1 and r.step_time_s / interval_factor(hw, r.plan) <= hi1]
    if not tied:
        return ""
    last = res.top[tied[-1] - 1].step_time_s
    return (f"plans #1-#{tied[-1]} are a tie: their predicted steps ({step1 / MS:,.1f}-{last / MS:,.1f} ms, "
            f"{100 * (last / step1 - 1):.1f}% apart) lie within each other's 90% intervals; measure them to choose "
            "(--measure K re-ranks the top K by measuring their blocks here, --execute K runs them)")


def _interval_caption(hw) -> str:
    by_group = hw.calibration.get("interval_log_halfwidth_by_group") or {}
    if not by_group:
        return f"90% interval of every step time: x/÷ {math.exp(hw.interval_log_halfwidth):.2f}"
    qs = [math.exp(q) for q in by_group.values()] + [math.exp(hw.interval_log_halfwidth)]
    return f"90% interval of a step time: x/÷ {min(qs):.2f}-{max(qs):.2f} by plan family (--wide, --json: each plan's)"


def _top_table(res, top: int, hw, wide: bool, width: int = 100):
    """The ranked plans: short by default (fits 100 columns: degrees in device order, options as letters, the
    90% interval in the caption: one factor, or the range over the profile's plan families), every field spelled
    out with ``--wide``."""
    from rich import box
    from rich.table import Table

    from parsim.plan import interval_factor

    n = min(top, len(res.top))
    if wide:
        t = Table(title=f"top {n} plans (per GPU)")
        cols = (("#", "right"), ("degrees", "left"), ("device order", "left"), ("pp sched", "left"),
                ("lbs/mbs", "right"), ("grad accum", "right"), ("AC", "left"), ("compile", "left"),
                ("fp8", "left"), ("reshard", "left"), ("wrapper order", "left"), ("step ms", "right"),
                ("90% interval", "right"), ("tok/s/GPU", "right"), ("MFU", "right"), ("reserved GiB", "right"),
                ("dominant", "left"))
    else:
        t = Table(title=f"top {n} plans", box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False,
                  caption=f"Per GPU; GiB: memory the caching allocator reserves. {_interval_caption(hw)}. "
                          "The abbreviations are spelled out below; --wide: every field")
        cols = (("#", "right"), ("degrees", "left"), ("sched", "left"), ("batch", "left"), ("AC", "left"),
                ("options", "left"), ("step ms", "right"), ("tok/s", "right"), ("MFU", "right"),
                ("GiB", "right"), ("bound", "left"))
        if width < 90:  # what the step time is bound by goes first on a narrow terminal
            cols = cols[:-1]
    for col, just in cols:
        t.add_column(col, justify=just, no_wrap=not wide)
    for i, (plan, step, mem, tps, mfu, dom) in enumerate(res.top[:top], 1):
        if wide:
            q = interval_factor(hw, plan)
            t.add_row(str(i), plan.describe(), order_str(plan), sched_str(plan),
                      f"{plan.local_batch_size}/{plan.micro_batch_size}", str(plan.grad_accum_steps), plan.ac,
                      "y" if plan.compile else "n", "y" if plan.float8 else "n", plan.fsdp_reshard_after_forward,
                      ">".join(plan.wrapper_order), f"{step / MS:.1f}", f"{step / q / MS:.0f}-{step * q / MS:.0f}",
                      f"{tps:,.0f}", mfu_text(mfu, hw), f"{mem / GiB:.1f}", dom)
        else:
            row = [str(i), short_degrees(plan), sched_str(plan), short_batch(plan), short_ac(plan.ac),
                   short_options(plan), f"{step / MS:.1f}", f"{tps:,.0f}", mfu_text(mfu, hw),
                   f"{mem / GiB:.1f}", SHORT_DOMINANT.get(dom, dom.replace("comm_", ""))]
            t.add_row(*row[:len(cols)])
    return t


def _print_explain(con, res, n, d):
    from rich.table import Table

    base = d["plan"]
    plan_n = res.top[n - 1].plan
    t = Table(title=f"plan #{n} ({plan_n.describe()}, AC {plan_n.ac}) against the other shown plans: "
                    "time components, ms (others minus #{n})".replace("#{n}", f"#{n}"))
    t.add_column("component")
    t.add_column(f"#{n}", justify="right")
    for v in d["versus"]:
        t.add_column(f"#{v['rank']} {v['describe']}", justify="right")
    keys = sorted(set(base["time_breakdown_s"]).union(*[set(v["time_delta_s"]) for v in d["versus"]]))
    for k in keys:
        row = [k, f"{base['time_breakdown_s'].get(k, 0.0) / MS:.1f}"]
        row += [f"{v['time_delta_s'].get(k, 0.0) / MS:+.1f}" for v in d["versus"]]
        t.add_row(*row)
    t.add_row("[bold]step[/bold]", f"{base['step_time_s'] / MS:.1f}",
              *[f"{v['step_time_delta_s'] / MS:+.1f}" for v in d["versus"]])
    t.add_row("[bold]peak memory GiB[/bold]", f"{base['peak_memory_bytes'] / GiB:.1f}",
              *[f"{sum(v['memory_delta_bytes'].values()) / GiB:+.1f}" for v in d["versus"]])
    con.print(t)
    diffs = []
    for v in d["versus"]:
        most = max(v["time_delta_s"], key=lambda k: abs(v["time_delta_s"][k]))
        diffs.append(f"#{v['rank']} differs most on {most} ({v['time_delta_s'][most] / MS:+.1f} ms)")
    con.print("; ".join(diffs))
    from parsim.report import print_factors

    print_factors(con, d["factors"])


def _print_reranked(con, measured: dict) -> None:
    from rich import box
    from rich.table import Table

    from parsim.plan import Plan

    t = Table(title=f"re-ranked with blocks measured on this {measured['device']} ({measured['shapes']} shapes, "
                    f"{measured['stand_ins']} by stand-ins, {measured['measured_now']} measured now in "
                    f"{measured['measurement_wall_s']:.0f} s)", box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False,
              caption="was: rank on the curves. blocks, ends (embedding; norm, output, loss): measured at the plan's "
                      "shape, a stand-in (w/h/v/s: widths, heads, vocabulary rows, sequence divided by) or curves (a "
                      "shape a measurement cannot stand for: CP, MLA, ...; not re-ranked against measured plans: "
                      "listed last)")
    for col in ("#", "was", "curves s", "meas s", "diff", "degrees", "sched", "batch", "AC", "opt", "blocks", "ends"):
        t.add_column(col, justify="right" if col in ("#", "was", "curves s", "meas s", "diff") else "left",
                     no_wrap=True)
    for r in measured["rows"]:
        plan = Plan.from_dict(r["plan"])
        moved = r["curves_rank"] - r["measured_rank"] if r["measured_rank"] else 0
        was = f"{r['curves_rank']}" + (f" ({'+' if moved > 0 else ''}{moved})" if moved else "")
        t.add_row(str(r["measured_rank"] or "-"), was, f"{r['curves_step_s']:.4g}", f"{r['measured_step_s']:.4g}",
                  f"{100 * (r['measured_step_s'] / r['curves_step_s'] - 1):+.0f}%", short_degrees(plan),
                  sched_str(plan), short_batch(plan), short_ac(plan.ac), short_options(plan), r["blocks"], r["ends"])
    con.print(t)


def _print_executed(con, executed):
    from rich.table import Table

    t = Table(title="executed: prediction beside measurement")
    for c in ("#", "plan", "status", "pred step ms", "meas step ms", "diff", "pred mem GiB", "meas mem GiB", "diff"):
        t.add_column(c, justify="left" if c in ("plan", "status") else "right")
    for e in executed:
        p, m = e["prediction"], e["measurement"]
        ms, mm = m.get("median_step_time_s"), m.get("peak_memory_bytes")
        status = m["status"] + (f" {m['error'][:40]}" if m["error"] else "")
        t.add_row(str(e["rank"]), e.get("plan", p["plan_id"]), status,
                  f"{p['step_time_s'] / MS:.1f}", f"{ms / MS:.1f}" if ms else "-",
                  f"{100 * (p['step_time_s'] - ms) / ms:+.0f}%" if ms else "-",
                  f"{p['peak_memory_bytes'] / GiB:.3f}", f"{mm / GiB:.3f}" if mm else "-",
                  f"{100 * (p['peak_memory_bytes'] - mm) / mm:+.1f}%" if mm else "-")
    con.print(t)


def print_redistribution(doc: dict) -> None:
    """`parsim redistribute`: each path as a table of steps with the predicted time of each."""
    from rich import box
    from rich.table import Table

    from parsim.console import console as folding_console

    con = folding_console()
    mesh = "x".join(map(str, doc["mesh"]))
    con.print(f"{doc['src']['text']} -> {doc['dst']['text']}   tensor {'x'.join(map(str, doc['shape']))} "
              f"{doc['dtype']} on mesh {mesh} ({doc['ranks_per_node']} ranks per node), profile {doc['profile']}")
    for name in ("parsim", "torch"):
        path = doc[name]
        if path is None:
            continue
        t = Table(title=f"{name}: {path['time_s'] / MS:.3f} ms predicted, {path['collectives']} collectives",
                  box=box.SIMPLE_HEAD, title_justify="left")
        for c in ("#", "op", "axes", "group", "MiB in", "ms", "layout after"):
            t.add_column(c, justify="right" if c in ("#", "group", "MiB in", "ms") else "left",
                         no_wrap=c in ("op", "layout after"))
        for i, s in enumerate(path["steps"], 1):
            t.add_row(str(i), s["op"], ",".join(map(str, s["mesh_axes"])),
                      f"{s['group_size']}{'' if s['ranks_per_node'] >= s['group_size'] else ' x-node'}",
                      f"{s['input_bytes'] / 2**20:.2f}", f"{s['time_s'] / MS:.3f}",
                      s["dst"]["text"])
        if not path["steps"]:
            t.add_row("", "(nothing to do)", "", "", "", "0", doc["dst"]["text"])
        con.print(t)
    rec = doc["recommended"]
    con.print(f"use: {rec['path']} ({rec['why']})")


def print_orders(doc: dict) -> None:
    """`parsim orders`: one table per case (order, outcome, loss / memory / time against the default order, what
    the written rules predict), then the disagreements, the effective rules and the measured AC cost."""
    from rich import box
    from rich.table import Table

    from parsim.console import console as folding_console

    con = folding_console()
    if not doc["cases"]:
        con.print(f"no stored matrix for torch {doc['torch']}: run `parsim orders`")
        return
    con.print(f"wrapper orders executed on torch {doc['torch']} ({doc['device']}, {doc['backend']})")
    for name, case in doc["cases"].items():
        t = Table(title=f"{name}: {case['model']}, permuting {', '.join(case['permuted'])}", box=box.SIMPLE_HEAD,
                  title_justify="left")
        for c in ("order", "observed", "max |dloss|", "memory", "time", "rules say", "error"):
            t.add_column(c, justify="right" if c in ("max |dloss|", "memory", "time") else "left",
                         no_wrap=c != "error")
        for r in case["rows"]:
            def ratio(k, r=r):
                return f"{r[k]:.2f}x" if r.get(k) is not None else ""
            t.add_row(",".join(r["order"]), r["outcome"], f"{r['max_loss_diff']:.1e}" if "max_loss_diff" in r else "",
                      ratio("memory_ratio"), ratio("step_time_ratio"), r["written_rules_predict"], r["error"][:60])
        con.print(t)
    con.print(f"disagreements with the written rules: {len(doc['disagreements'])}")
    for d in doc["disagreements"]:
        con.print(f"  {d['case']}: {','.join(d['order'])} {d['observed']} ({d['rules']})")
    con.print("effective rules:")
    for r in doc["rules"]:
        con.print(f"  {r['first']} before {r['then']}: {r['kind']} - {r['reason']}")
    for k, v in doc["searched_orders"].items():
        con.print(f"searched orders ({k}): " + "; ".join(",".join(o) for o in v))
    ac = doc.get("ac_wraps_compile")
    if ac:
        med = ac["median_step_time_s"]
        f = ac["recompute_factor"]
        con.print("AC wrapping compile: step " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items() if v)
                  + (f"; recompute factor {f:.2f} (used by the cost model)" if f is not None else
                     "; recompute inside compile within the baseline's spread: no factor (the cost model assumes "
                     "2x)"))
