"""Human-readable output: rich tables of predictions (GiB and ms appear only here and in the CLI)."""

from __future__ import annotations

from .results import Measurement, Prediction
from .units import MS, GiB


def _console():
    from .console import console

    return console()


def option_labels(plan) -> list[str]:
    """The words of the plan's options that are on (``plan_schema``: the rows with a ``label``)."""
    from .plan_schema import options_on

    return options_on(plan, "label")


def print_prediction(pred: Prediction, spec, plan, hw) -> None:
    from rich.table import Table

    from .machine import mfu_text

    con = _console()
    con.print(f"[bold]{spec.name}[/bold] ({spec.n_params / 1e9:.2f}B params) on {pred.n_gpus} GPUs "
              f"({pred.profile})  plan {plan.describe()}  id {pred.plan_id}")
    extras = [f"float8 {plan.float8_recipe}" if plan.float8 else "", *option_labels(plan)]
    con.print(f"seq {plan.seq_len}, local batch {plan.local_batch_size}, micro batch {plan.micro_batch_size}, "
              f"global batch {plan.global_batch_size} (gradient accumulation {plan.grad_accum_steps}), "
              f"AC {plan.ac}, compile {plan.compile}, order {'>'.join(plan.wrapper_order)}"
              + "".join(f", {e}" for e in extras if e))
    mem = Table(title=f"memory per GPU, peak on {pred.peak_rank} at the {pred.peak_phase}", show_footer=True)
    mem.add_column("component", footer="peak")
    mem.add_column("GiB", justify="right", footer=f"{pred.peak_memory_bytes / GiB:.2f}")
    for k, v in pred.memory_breakdown_bytes.items():
        mem.add_row(k, f"{v / GiB:.2f}")
    rsv = None
    if pred.reserved_memory_bytes is not None and pred.reserved_breakdown_bytes.get("all_gather_stream", 0) + \
            pred.reserved_breakdown_bytes.get("reduce_scatter_stream", 0) + \
            pred.reserved_breakdown_bytes.get("default_stream_holes", 0) > 0:
        rsv = Table(title="reserved by the caching allocator (expandable segments)", show_footer=True)
        rsv.add_column("pool", footer="reserved")
        rsv.add_column("GiB", justify="right", footer=f"{pred.reserved_memory_bytes / GiB:.2f}")
        for k, v in pred.reserved_breakdown_bytes.items():
            rsv.add_row(k, f"{v / GiB:.2f}")
    tim = Table(title="step time", show_footer=True)
    tim.add_column("component", footer="step")
    tim.add_column("ms", justify="right", footer=f"{pred.step_time_s / MS:.1f}")
    for k, v in sorted(pred.time_breakdown_s.items(), key=lambda kv: -kv[1]):
        tim.add_row(k, f"{v / MS:.1f}")
    com = _comm_table(pred)
    con.print(*[t for t in (mem, rsv, tim, com) if t is not None])
    fit = "[green]fits[/green]" if pred.fits else "[red]does NOT fit[/red]"
    held = pred.reserved_memory_bytes if pred.reserved_memory_bytes is not None else pred.peak_memory_bytes
    con.print(f"{fit}: {held / GiB:.2f} GiB reserved (peak allocated {pred.peak_memory_bytes / GiB:.2f}) of "
              f"{pred.memory_capacity_bytes / GiB:.2f} GiB usable; "
              f"step {pred.step_time_s / MS:.1f} ms"
              + (f" (90% interval {pred.interval_s[0] / MS:.1f}-{pred.interval_s[1] / MS:.1f} ms)"
                 if pred.interval_s else "")
              + f", {pred.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
              f"MFU {mfu_text(pred.mfu, hw)}, dominant cost {pred.dominant_cost}")


def _comm_table(pred: Prediction):
    """Input bytes per collective and axis per step: rank 0's, and with PP the last stage's beside them."""
    from rich.table import Table  # (rich on the printing path only: the core stays fast to import)

    last = pred.comm_bytes_last_stage
    cols = [("pp stage 0", pred.comm_bytes), (f"pp stage {int(pred.plan.get('pp', 1)) - 1}", last)] if last else [
        ("GiB", pred.comm_bytes)]
    com = Table(title="communication per step (input bytes, GiB)" if last else
                "communication per step (rank 0, input bytes)")
    com.add_column("collective/axis")
    for name, _ in cols:
        com.add_column(name, justify="right")
    for k in dict.fromkeys(k for _, c in cols for k in c):
        com.add_row(k, *(f"{c.get(k, 0.0) / GiB:.3f}" for _, c in cols))
    return com


def comparison_rows(pred: Prediction, meas: Measurement) -> list[tuple[str, float, float]]:
    """(quantity, predicted, measured) for peak memory and every collective either side has."""
    rows = [("peak_memory_bytes", pred.peak_memory_bytes, meas.peak_memory_bytes or 0.0)]
    if meas.reserved_peak_memory_bytes and pred.reserved_memory_bytes is not None:
        rows.append(("reserved_memory_bytes", pred.reserved_memory_bytes, meas.reserved_peak_memory_bytes))
    for k in sorted(set(pred.comm_bytes) | set(meas.comm_bytes)):
        rows.append((k, float(pred.comm_bytes.get(k, 0.0)), float(meas.comm_bytes.get(k, 0.0))))
    if meas.median_step_time_s:
        rows.append(("step_time_s", pred.step_time_s, meas.median_step_time_s))
    return rows


def print_comparison(pred: Prediction, meas: Measurement) -> None:
    from rich.table import Table

    t = Table(title=f"prediction vs {meas.kind} (plan {pred.plan_id})")
    for c in ("quantity", "predicted", "measured", "diff"):
        t.add_column(c, justify="left" if c == "quantity" else "right")
    for k, p, m in comparison_rows(pred, meas):
        diff = f"{100.0 * (p - m) / m:+.2f}%" if m else "-"
        t.add_row(k, f"{p:,.0f}" if p >= 1000 else f"{p:.4g}", f"{m:,.0f}" if m >= 1000 else f"{m:.4g}", diff)
    _console().print(t)


def print_profile(hw) -> None:
    from rich.table import Table

    con = _console()
    t = Table(title=f"{hw.name}: fitted collectives (t = latency + S x busbw factor / busbw)")
    for c in ("op", "group", "per node", "from bytes", "latency us", "busbw GB/s", "median rel. residual", "points"):
        t.add_column(c, justify="left" if c == "op" else "right")
    for f in hw.collectives:
        t.add_row(f.op, str(f.group_size), str(f.ranks_per_node), f"{f.min_bytes:,.0f}", f"{f.latency_s * 1e6:.1f}",
                  "latency-bound" if f.busbw_bytes_per_s > 1e14 else f"{f.busbw_bytes_per_s / 1e9:.3f}",
                  f"{f.rel_residual * 100:.1f}%", str(f.n_samples))
    con.print(t)
    res = hw.samples.get("fit_residuals", {})
    peaks = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in hw.peak_flops.items())
    con.print(f"compute: {peaks}; GEMM x_half {hw.gemm_efficiency.x_half:.3g} FLOP (residual "
              f"{res.get('gemm', 0) * 100:.1f}%), attention x_half {hw.attention_efficiency.x_half:.3g} (residual "
              f"{res.get('attention', 0) * 100:.1f}%), memory {hw.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s "
              f"(residual {res.get('elementwise', 0) * 100:.1f}%); took {hw.provenance.get('wall_s', 0):.0f} s")


def print_explain(d: dict) -> None:
    """``parsim predict --explain``: the ledger, one layer's compute and its saved tensors per AC mode, the factors."""
    from rich.markup import escape
    from rich.table import Table

    con = _console()
    t = Table(title=f"collective ledger ({d['rank']}; per step; raw = the calls' time, x scale = the correction "
                    "in it (factors below), exposed = what the step waits)")
    for c in ("collective", "op/axis", "calls", "bytes/call", "group", "per node", "x scale", "raw ms", "exposed ms"):
        t.add_column(c, justify="left" if c in ("collective", "op/axis") else "right")
    for r in d["ledger"]:
        t.add_row(escape(r["what"]), r["key"], f"{r['calls']:,.0f}", f"{r['bytes_per_call']:,.0f}",
                  str(r["group_size"]), str(r["ranks_per_node"]), f"{r['scale']:.3g}", f"{r['raw_s'] / MS:.3f}",
                  f"{r['exposed_s'] / MS:.3f}")
    con.print(t)
    for kind, lay in d["layers"].items():
        ct = Table(title=f"forward compute of one {kind} layer per microbatch ({lay['tokens_per_microbatch']:,.0f} "
                        f"tokens; x compute_scale {lay['compute_scale']:g})")
        for col in ("item", "kind", "FLOPs or bytes", "efficiency", "ms", "SAC recomputes"):
            ct.add_column(col, justify="left" if col in ("item", "kind") else "right")
        for it in lay["compute_forward"]:
            ct.add_row(it["name"], it["kind"], f"{it['work']:.3g}", f"{it['efficiency']:.3f}",
                      f"{it['seconds'] / MS:.4f}", _share(it["recomputed_by_selective_ac"]))
        s = Table(title=f"tensors one {kind} layer saves per microbatch, and which each AC mode keeps")
        for col in ("tensor", "kind", "MiB", "none", "selective-op", "full"):
            s.add_column(col, justify="left" if col in ("tensor", "kind") else "right")
        for it in lay["saved_tensors"]:
            s.add_row(it["name"], it["kind"], f"{it['bytes'] / 2**20:.2f}", *(_share(it[f"kept_{m}"])
                                                                              for m in ("none", "sac", "full")))
        totals = {m: sum(it["bytes"] * float(it[f"kept_{m}"]) for it in lay["saved_tensors"]) / 2**20
                  for m in ("none", "sac", "full")}
        s.add_row("[bold]kept[/bold]", "", "", *(f"{totals[m]:.1f}" for m in ("none", "sac", "full")))
        blk = lay.get("block", {})
        if blk.get("source") == "measured block":
            note = (f"[bold]used instead of the items above:[/bold] block measured at this shape, forward "
                    f"{blk['fwd_s'] / MS:.4f} ms, backward {blk['bwd_s'] / MS:.4f} ms ({blk.get('device')}, torch "
                    f"{blk.get('torch')}, {blk.get('measured_at')})")
        else:
            note = f"layer time from the curves above: {blk.get('why', '')}"
        con.print(ct, note, s)
    ends = d.get("ends", {})
    if ends.get("source") == "measured ends":
        con.print(f"model's ends measured at this shape (per microbatch): embedding forward "
                  f"{ends['emb_fwd_s'] / MS:.4f} ms, backward {ends['emb_bwd_s'] / MS:.4f} ms; norm + output + loss "
                  f"forward {ends['out_fwd_s'] / MS:.4f} ms, backward {ends['out_bwd_s'] / MS:.4f} ms "
                  f"({ends.get('device')}, torch {ends.get('torch')}, {ends.get('measured_at')})")
    elif ends:
        con.print(f"model's ends from the {ends['source']}: {ends['why']}")
    print_factors(con, d.get("factors", []))


def print_factors(con, rows: list) -> None:
    """The factors table of ``--explain``: every correction, curve and count the prediction applied."""
    from rich.markup import escape
    from rich.table import Table

    if not rows:
        return
    t = Table(title="factors applied to this prediction (value, what it multiplies or counts, where it comes from)")
    for col in ("factor", "value", "applies to", "source"):
        t.add_column(col, justify="right" if col == "value" else "left")
    for f in rows:
        v = f["value"]
        shown = ", ".join(f"{x:.4g}" for x in v) if isinstance(v, list) else (
            str(v) if isinstance(v, bool) else f"{v:.4g}")
        t.add_row(escape(f["name"]), shown, escape(f["applies_to"]), escape(f["source"]))
    con.print(t)


def _share(v) -> str:
    """A flag ("y" or blank) or a fraction (selective AC on a grouped expert GEMM: its share, as a percentage)."""
    if isinstance(v, bool) or float(v) in (0.0, 1.0):
        return "y" if v else ""
    return f"{float(v):.0%}"
