"""Rendering of `parsim search` (rich tables, progress, CSV, emitted files). GiB and ms appear only here."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parsim.units import MS, GiB


def _order_str(plan) -> str:
    axes = [a for a in plan.mesh_order if getattr(plan, a) > 1]
    return ">".join(axes) or "-"


SHORT_AXES = {"pp": "pp", "dp_replicate": "dpr", "dp_shard": "fsdp", "cp": "cp", "tp": "tp"}
SHORT_AC = {"none": "-", "full": "full", "selective-op": "sel"}
SHORT_DOMINANT = {"compute_backward": "bwd", "compute_forward": "fwd", "recompute": "recomp", "pp_bubble": "bubble",
                  "optimizer": "optim", "comm_interference": "interf"}
WRAPPER_LETTERS = {"pp": "P", "tp": "T", "ac": "A", "compile": "C", "fsdp": "F"}


def short_degrees(plan) -> str:
    """Degrees in device order (outermost first; axes of degree 1 left out, as they place no rank), short names:
    ``pp4 dpr2 fsdp8 tp4 ep8`` (``ep8d``: EP borrowed from dp_replicate)."""
    parts = [f"{SHORT_AXES[a]}{getattr(plan, a)}" for a in plan.mesh_order if getattr(plan, a) > 1]
    if plan.ep > 1:
        parts.append(f"ep{plan.ep}" + (f"/{plan.etp}" if plan.etp > 1 else "")
                     + ("d" if plan.ep_from == "dp_replicate" else ""))
    return " ".join(parts) or "1 GPU"


def short_options(plan) -> str:
    """compile (C), float8 (F8, rowwise r / gw_hp g), reshard never/always (R-/R+), async TP (aTP), distributed
    optimizer (ZeRO1), TE layers (TE), fused loss (FL), a wrapper order other than PP>TP>AC>compile>FSDP (its
    letters)."""
    from parsim.plan import DEFAULT_ORDER

    out = []
    if plan.compile:
        out.append("C")
    if plan.float8:
        out.append("F8" + {"tensorwise": "", "rowwise": "r", "rowwise_with_gw_hp": "g"}[plan.float8_recipe])
    if plan.fsdp_reshard_after_forward != "default":
        out.append("R-" if plan.fsdp_reshard_after_forward == "never" else "R+")
    if plan.async_tp:
        out.append("aTP")
    if plan.distributed_optimizer:
        out.append("ZeRO1")
    if plan.te_layers:
        out.append("TE")
    if plan.fused_loss:
        out.append("FL")
    if tuple(plan.wrapper_order) != DEFAULT_ORDER:
        out.append("".join(WRAPPER_LETTERS[w] for w in plan.wrapper_order))
    return " ".join(out) or "-"


def short_batch(plan) -> str:
    """local/micro batch, and the gradient-accumulation steps when more than one (``4/1 ga2``)."""
    ga = plan.grad_accum_steps
    return f"{plan.local_batch_size}/{plan.micro_batch_size}" + (f" ga{ga}" if ga > 1 else "")


def short_ac(ac: str) -> str:
    return SHORT_AC.get(ac, ac.replace("layer:", "L"))


def _sched_str(plan) -> str:
    if plan.pp == 1:
        return "-"
    name = "I1F1B" if plan.pp_schedule == "Interleaved1F1B" else plan.pp_schedule
    return name + (f"/v{plan.pp_stages_per_rank}" if plan.pp_stages_per_rank > 1 else "")


CPU_MEASURE_BUDGET_FLOPS = 2e10  # assumed: about 1 s forward on one CPU core, ~10 s per shape with repetitions


class CsvSink:
    """Streams every evaluated plan to CSV, written to a temporary file and renamed at the end (atomic)."""

    COLS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp", "ep_from", "mesh_order", "local_batch_size",
            "micro_batch_size", "global_batch_size", "pp_schedule", "pp_stages_per_rank", "ac", "compile", "float8",
            "fsdp_reshard_after_forward", "wrapper_order", "step_time_s", "peak_memory_bytes",
            "reserved_memory_bytes", "fits",
            "tokens_per_s_per_gpu", "mfu")
    FIELD = {"pp_stages_per_rank": "v"}

    def __init__(self, path: str):
        from parsim.jsonio import AtomicFile

        self.out = AtomicFile(path)
        self.f = self.out.f
        self.f.write(",".join(self.COLS) + "\n")

    def columns(self, b, r, fits) -> list:
        """The COLS of one evaluated chunk: names as users write them (mesh and wrapper orders as a,b,c text)."""
        from parsim.codec import names

        named = names(b)
        cols = []
        for c in self.COLS:
            if c in named:
                cols.append(named[c])
            elif c in r:
                cols.append(r[c])
            elif c == "fits":
                cols.append(fits)
            else:
                cols.append(getattr(b, self.FIELD.get(c, c)))
        return cols

    def __call__(self, b, r, fits):
        cols = [np.char.add(np.char.add('"', v), '"') if v.dtype.kind == "U" and "," in "".join(v[:1]) else
                (v.astype(int) if v.dtype == bool else v) for v in map(np.asarray, self.columns(b, r, fits))]
        np.savetxt(self.f, np.column_stack([x.astype(str) for x in cols]), fmt="%s", delimiter=",")

    def close(self, ok: bool):
        if ok:
            self.out.commit()
        else:
            self.out.discard()


class ParquetSink(CsvSink):
    """The same columns as CsvSink, streamed to Parquet (one row group per evaluated chunk) through pyarrow,
    written beside the target and renamed over it at the end."""

    def __init__(self, path: str):
        from parsim.errors import ParsimError

        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ParsimError("a .parquet output needs pyarrow: pip install pyarrow (or 'parsim[parquet]')") from None
        from parsim.jsonio import AtomicFile

        self.pa = pa
        self.out = AtomicFile(path)
        self.out.f.close()
        self.writer: Any = None
        self.pq = pq

    def __call__(self, b, r, fits):
        table = self.pa.table({c: np.asarray(v) for c, v in zip(self.COLS, self.columns(b, r, fits), strict=True)})
        if self.writer is None:
            self.writer = self.pq.ParquetWriter(self.out.tmp, table.schema)
        self.writer.write_table(table)

    def close(self, ok: bool):
        if self.writer is not None:
            self.writer.close()
        if ok and self.writer is not None:
            self.out.commit()
        else:
            self.out.discard()


def run_search_cli(spec, hw, gpus, space, *, top, explain, emit_plan, emit_torchtitan, csv_path, as_json,
                   execute=0, model_arg=None, execute_out=None, wide=False, torchtitan_format="python",
                   emit_megatron=None, measure=0, measure_budget_flops=None):
    """`parsim search`: search (progress bar; every plan to --csv), measure and re-rank (--measure), write the
    best plan out (--emit-*), run the top (--execute), then print (tables or one JSON document)."""
    from rich.console import Console

    from parsim.errors import ParsimError
    from parsim.jsonio import atomic_write_json
    from parsim.search import result_to_dict

    err, con = Console(stderr=True), Console()
    res = _search_with_progress(spec, hw, gpus, space, top, csv_path, err)
    if explain is not None and not 1 <= explain <= len(res.top):
        raise ParsimError(f"--explain {explain}: only {len(res.top)} plans ranked")
    best = res.top[0].plan if res.top else None
    measured = _measure(spec, hw, res, measure, measure_budget_flops) if measure and res.top else None
    if measured and measured["rows"][0]["measured_rank"]:  # the re-ranked best is the plan written out
        from parsim.plan import Plan

        best = Plan.from_dict(measured["rows"][0]["plan"])
    if best:
        _write_best(spec, hw, res, best, measured, err, emit_plan=emit_plan, emit_torchtitan=emit_torchtitan,
                    emit_megatron=emit_megatron, torchtitan_format=torchtitan_format, model_arg=model_arg)
    executed = _execute(spec, hw, res, execute, model_arg or spec.name, err) if execute else []
    if execute_out and executed:
        atomic_write_json(execute_out, executed)
    if as_json:
        from parsim.cli.common import emit_json

        d = result_to_dict(res, spec, hw, gpus, space, top)
        if explain:
            d["explain"] = _explain_dict(spec, hw, res, explain, top)
        if executed:
            d["executed"] = executed
        if measured:
            d["measured"] = {k: v for k, v in measured.items() if k != "profile"}
        emit_json(d)
        return
    if not _print_search(con, spec, hw, gpus, space, res, top, wide):
        return
    if measured:
        _print_reranked(con, measured)
    if explain:
        _print_explain(con, spec, hw, res, explain, top)
    if executed:
        _print_executed(con, executed)
    if emit_plan and best:
        con.print(f"wrote plan #1 ({best.plan_id}) to {emit_plan}")
    if emit_megatron:
        con.print(f"wrote the Megatron-LM arguments of plan #1 to {emit_megatron}")
    if emit_torchtitan:
        con.print(f"wrote the torchtitan {'0.3.0 Python' if torchtitan_format == 'python' else 'v0.2 TOML'} config "
                  f"of plan #1 to {emit_torchtitan}")


def _search_with_progress(spec, hw, gpus, space, top, csv_path, err):
    """The search with a progress bar on stderr (a terminal only); every evaluated plan to ``csv_path`` (closed
    atomically: an interrupted search leaves no half file)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from parsim.search import search

    sink = (ParquetSink if str(csv_path).endswith(".parquet") else CsvSink)(csv_path) if csv_path else None
    ok = False
    try:
        with Progress(TextColumn("searching"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                      console=err, transient=True, disable=not err.is_terminal) as prog:
            task = prog.add_task("search", total=None)

            def progress(done, total):
                prog.update(task, completed=done, total=total)

            res = search(spec, hw, gpus, space, top_k=top, progress=progress, csv_writer=sink)
        ok = True
    finally:
        if sink:
            sink.close(ok)
    return res


def _said_of(spec, hw, res, best, measured) -> str:
    """What parsim predicted for the plan it writes out (the re-ranked prediction after --measure)."""
    top = res.top[0]
    step, mem, tps, mfu = top.step_time_s, top.reserved_memory_bytes, top.tokens_per_s_per_gpu, top.mfu
    if measured:
        from parsim.costmodel import predict

        p = predict(spec, best, measured["profile"])
        step, mem, tps, mfu = p.step_time_s, p.reserved_memory_bytes, p.tokens_per_s_per_gpu, p.mfu
    q = _interval_factor(hw, best)
    return (f"step {step:.3f} s (90% interval {step / q:.3f}-{step * q:.3f} s), {tps:,.0f} tokens/s/GPU, "
            f"MFU {100 * mfu:.1f}%, {mem / GiB:.1f} GiB reserved per GPU on {hw.name}")


def _write_best(spec, hw, res, best, measured, err, *, emit_plan, emit_torchtitan, emit_megatron,
                torchtitan_format, model_arg) -> None:
    """--emit-plan / --emit-torchtitan / --emit-megatron: the best plan written out (atomically), with what parsim
    predicted for it; what a framework cannot express is said on stderr (and at the top of the file)."""
    from parsim.emit import megatron_gaps, to_megatron_args, to_torchtitan_python, to_torchtitan_toml, torchtitan_gaps
    from parsim.jsonio import atomic_write_json, atomic_write_text

    if emit_plan:
        # the plan with the model it was searched for (`predict --plan F` then needs no --model)
        atomic_write_json(emit_plan, {"model": model_arg or spec.name, "plan_id": best.plan_id,
                                      "plan": best.to_dict()})
    said = _said_of(spec, hw, res, best, measured)
    if emit_torchtitan:
        emit = to_torchtitan_python if torchtitan_format == "python" else to_torchtitan_toml
        said_tt = said
        if torchtitan_format == "python" and best.float8 and best.float8_recipe == "tensorwise":
            import dataclasses

            from parsim.costmodel import predict

            rw = predict(spec, dataclasses.replace(best, float8_recipe="rowwise"), hw)  # what 0.3.0 will run
            said_tt += (f"; as emitted (float8 rowwise): step {rw.step_time_s:.3f} s, "
                        f"{rw.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {100 * rw.mfu:.1f}%")
        atomic_write_text(emit_torchtitan, emit(best, spec, said_tt))
        version = "0.3.0" if torchtitan_format == "python" else "0.2"
        for gap in torchtitan_gaps(best, spec, version):  # also at the top of the file
            err.print(f"parsim: torchtitan {version} cannot express: {gap}", markup=False, highlight=False,
                      soft_wrap=True)
    if emit_megatron:
        atomic_write_text(emit_megatron, to_megatron_args(best, spec, said))
        for gap in megatron_gaps(best, spec):
            err.print(f"parsim: Megatron-LM cannot express: {gap}", markup=False, highlight=False, soft_wrap=True)


def _print_search(con, spec, hw, gpus, space, res, top, wide) -> bool:
    """The search's text output: what was considered, pruned and evaluated, the top table and the Pareto front;
    when nothing fits, the plan closest to fitting. False when no plan is ranked."""
    from rich import box
    from rich.table import Table

    con.print(f"[bold]{spec.name}[/bold] on {gpus} x {hw.device_name} ({hw.name}), global batch "
              f"{space.global_batch_size} x seq {space.seq_len}: {res.considered:,} plans considered, "
              f"{res.fitting:,} fit, {res.pruned_memory:,} do not fit (usable {res.usable_memory_bytes / GiB:.1f} "
              f"GiB), {res.pruned_dominated:,} dominated, {res.pruned_bound:,} fit but lose on a time bound; "
              f"{res.evaluated:,} evaluated in full (+{res.screened:,} memory screens) in {res.wall_s:.2f} s")
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
        pt.add_row(f"{step / MS:.1f}", f"{mem / GiB:.1f}", short_degrees(plan), _sched_str(plan),
                   short_batch(plan), short_ac(plan.ac), short_options(plan))
    con.print(pt)
    return True


def _interval_factor(hw, plan) -> float:
    """The 90% interval factor of ``plan``'s step time (x/÷), as ``predict`` sizes it: its plan family's."""
    from parsim.plan import interval_group

    return math.exp(hw.interval_log_halfwidth_for(interval_group(plan)))


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
                  caption=f"Per GPU; GiB: memory the caching allocator reserves. {_interval_caption(hw)}. degrees "
                          "in device order, outermost "
                          "first. batch: local/micro (ga: gradient accumulation). options: C compile, F8 float8, "
                          "R- / R+ reshard never / always, aTP async TP, ZeRO1 distributed optimizer, TE Transformer "
                          "Engine layers, FL fused loss, letters: a "
                          "wrapper order other than PTACF. --wide: every field")
        cols = (("#", "right"), ("degrees", "left"), ("sched", "left"), ("batch", "left"), ("AC", "left"),
                ("options", "left"), ("step ms", "right"), ("tok/s", "right"), ("MFU", "right"),
                ("GiB", "right"), ("bound", "left"))
        if width < 90:  # what the step time is bound by goes first on a narrow terminal
            cols = cols[:-1]
    for col, just in cols:
        t.add_column(col, justify=just, no_wrap=not wide)
    for i, (plan, step, mem, tps, mfu, dom) in enumerate(res.top[:top], 1):
        if wide:
            q = _interval_factor(hw, plan)
            t.add_row(str(i), plan.describe(), _order_str(plan), _sched_str(plan),
                      f"{plan.local_batch_size}/{plan.micro_batch_size}", str(plan.grad_accum_steps), plan.ac,
                      "y" if plan.compile else "n", "y" if plan.float8 else "n", plan.fsdp_reshard_after_forward,
                      ">".join(plan.wrapper_order), f"{step / MS:.1f}", f"{step / q / MS:.0f}-{step * q / MS:.0f}",
                      f"{tps:,.0f}", f"{mfu * 100:.1f}%", f"{mem / GiB:.1f}", dom)
        else:
            row = [str(i), short_degrees(plan), _sched_str(plan), short_batch(plan), short_ac(plan.ac),
                   short_options(plan), f"{step / MS:.1f}", f"{tps:,.0f}", f"{mfu * 100:.1f}%",
                   f"{mem / GiB:.1f}", SHORT_DOMINANT.get(dom, dom.replace("comm_", ""))]
            t.add_row(*row[:len(cols)])
    return t


def _explain_dict(spec, hw, res, n, top):
    """Plan ``n`` against up to three other plans the table shows (the next ones, or the ones before the last),
    and every factor its prediction applied (``costmodel.explain``'s factors, as ``predict --explain`` shows)."""
    from parsim.costmodel import predict
    from parsim.costmodel.explain import predict_and_explain

    shown = min(top, len(res.top))
    ranks = list(range(n + 1, min(n + 3, shown) + 1)) or list(range(max(1, n - 3), n))
    base, why = predict_and_explain(spec, res.top[n - 1].plan, hw)
    preds = [predict(spec, res.top[r - 1].plan, hw) for r in ranks]
    return {"plan": base.to_dict(), "factors": why["factors"], "versus": [
        {"rank": r, "plan_id": p.plan_id, "describe": res.top[r - 1].plan.describe(),
         "step_time_delta_s": p.step_time_s - base.step_time_s,
         "time_delta_s": {k: p.time_breakdown_s.get(k, 0.0) - base.time_breakdown_s.get(k, 0.0)
                          for k in sorted(set(p.time_breakdown_s) | set(base.time_breakdown_s))},
         "memory_delta_bytes": {k: p.memory_breakdown_bytes[k] - base.memory_breakdown_bytes[k]
                                for k in base.memory_breakdown_bytes}} for r, p in zip(ranks, preds, strict=True)]}


def _print_explain(con, spec, hw, res, n, top):
    from rich.table import Table

    d = _explain_dict(spec, hw, res, n, top)
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


def _measure(spec, hw, res, k: int, budget_flops: float | None) -> dict:
    """``--measure K``: the blocks of the top-K and Pareto plans timed on this device (kept in this machine's
    profile folder under the profile's name, so a second run measures nothing again), the plans re-ranked
    (``parsim.remeasure``)."""
    import dataclasses

    import torch

    from parsim.cli.loop import measure_blocks_into
    from parsim.hardware import HardwareProfile, profile_write_dir
    from parsim.jsonio import read_json
    from parsim.remeasure import measure_and_rerank

    cuda = torch.cuda.is_available()
    budget = budget_flops if budget_flops is not None else (math.inf if cuda else CPU_MEASURE_BUDGET_FLOPS)
    path = profile_write_dir() / f"{hw.name}.json"
    if path.exists():  # blocks measured here by an earlier run (a cache: kept beside the given profile's own)
        cached = HardwareProfile.from_dict(read_json(path, "corrupt profile"), origin=str(path))
        hw = dataclasses.replace(hw, measured_blocks={**cached.measured_blocks, **hw.measured_blocks})
    out = measure_and_rerank(spec, hw, res, k, budget, lambda hw_, shapes: measure_blocks_into(hw_, shapes, path))
    return {**out, "budget_flops": budget, "profile_path": str(path), "device": "cuda" if cuda else "cpu"}


def _print_reranked(con, measured: dict) -> None:
    from rich import box
    from rich.table import Table

    from parsim.plan import Plan

    t = Table(title=f"re-ranked with blocks measured on this {measured['device']} ({measured['shapes']} shapes, "
                    f"{measured['stand_ins']} by stand-ins, {measured['measured_now']} measured now in "
                    f"{measured['measurement_wall_s']:.0f} s)", box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False,
              caption="was: rank on the curves. blocks: measured at the plan's shape, a stand-in (w/h/s: widths, "
                      "heads, sequence divided by) or curves (a shape one block cannot stand for: CP, MLA, ...; not "
                      "re-ranked against measured plans: listed last)")
    for col in ("#", "was", "curves s", "meas s", "diff", "degrees", "sched", "batch", "AC", "opt", "blocks"):
        t.add_column(col, justify="right" if col in ("#", "was", "curves s", "meas s", "diff") else "left",
                     no_wrap=True)
    for r in measured["rows"]:
        plan = Plan.from_dict(r["plan"])
        moved = r["curves_rank"] - r["measured_rank"] if r["measured_rank"] else 0
        was = f"{r['curves_rank']}" + (f" ({'+' if moved > 0 else ''}{moved})" if moved else "")
        t.add_row(str(r["measured_rank"] or "-"), was, f"{r['curves_step_s']:.4g}", f"{r['measured_step_s']:.4g}",
                  f"{100 * (r['measured_step_s'] / r['curves_step_s'] - 1):+.0f}%", short_degrees(plan),
                  _sched_str(plan), short_batch(plan), short_ac(plan.ac), short_options(plan), r["blocks"])
    con.print(t)


def _execute(spec, hw, res, k, model_arg, err) -> list[dict]:
    """Run the top-k plans with the executor on this machine: CUDA when it has enough GPUs, else gloo on CPU."""
    from parsim.costmodel import predict
    from parsim.errors import ParsimError

    try:
        import torch
    except ImportError:
        raise ParsimError("--execute needs torch installed (pip install torch)") from None
    from parsim.executor.launch import run_plan

    out = []
    for i, (plan, *_rest) in enumerate(res.top[:k], 1):
        n = plan.world_size
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= n
        if not cuda and n > 8:
            err.print(f"plan #{i} needs {n} ranks; this machine runs at most 8 CPU ranks: skipped")
            continue
        err.print(f"executing plan #{i} ({plan.describe()}) on {n} {'GPUs' if cuda else 'CPU ranks (gloo)'} ...")
        m = run_plan(model_arg, plan, n, steps=5, warmup=2, timeout_s=900, device=None if cuda else "cpu")
        text = " ".join(x for x in (short_degrees(plan), f"AC {plan.ac}" if plan.ac != "none" else "",
                                     short_options(plan)) if x)
        out.append({"rank": i, "plan": text, "prediction": predict(spec, plan, hw).to_dict(),
                    "measurement": m.to_dict()})
    return out


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
    from rich.console import Console
    from rich.table import Table

    con = Console()
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
    from rich.console import Console
    from rich.table import Table

    con = Console()
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
                  + (f"; recompute factor {f:.2f} (used by the cost model)" if f is not None else "; no factor"))
