"""`parsim search` from start to end as one library call: search (every plan to a CSV / Parquet file when asked),
measure the top plans' blocks here and re-rank (``--measure``), write the best plan out (plan JSON, torchtitan,
Megatron-LM), run the top plans with the executor (``--execute``), and explain a plan against its neighbours. The
command line parses, calls ``run_search_job`` and renders what it returns.

Torch-free at import (measuring and executing import torch when asked for). Progress goes to a ``progress(task,
done, total[, label])`` callback, what the user should read on the way (gaps of an emitted config, skipped
executions) to ``log(line)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ParsimError
from .machine import mfu_text
from .plan_schema import PLAN_FIELDS
from .plan_text import short_degrees, short_options
from .progress import Log, Progress, log_to_stderr

CPU_MEASURE_BUDGET_FLOPS = 2e10  # assumed: about 1 s forward on one CPU core, ~10 s per shape with repetitions

@dataclass(frozen=True)
class SearchOutputs:
    """What a search writes: the best plan (JSON, torchtitan config in ``torchtitan_format`` python | toml,
    Megatron-LM arguments), every evaluated plan (``table_path``: .csv or .parquet), the executed plans' rows."""

    emit_plan: str | None = None
    emit_torchtitan: str | None = None
    torchtitan_format: str = "python"
    emit_megatron: str | None = None
    table_path: str | None = None
    execute_out: str | None = None


@dataclass
class SearchJob:
    """What a search job found and did."""

    res: object  # search.SearchResult
    best: object | None  # the plan written out (the measured best after --measure)
    measured: dict | None = None  # measure_top's result
    executed: list = field(default_factory=list)  # execute_top's rows
    gaps: list = field(default_factory=list)  # what the emitted configs cannot express, one line each
    explained: dict | None = None  # explain_dict of the plan asked for


def run_search_job(spec, hw, gpus: int, space, *, top: int, outputs: SearchOutputs = SearchOutputs(),
                   measure: int = 0, measure_budget_flops: float | None = None, execute: int = 0,
                   explain: int | None = None, model_arg: str | None = None, progress: Progress | None = None,
                   log: Log = log_to_stderr, framework: str | None = None) -> SearchJob:
    """Search, then measure and re-rank, write the best plan out, execute the top and explain plan ``explain``,
    as asked (a plan number beyond the ranked ones is refused before anything is written). With ``framework``
    (``parsim.frameworks``) the space was cut to what it runs, and a ranked plan it would run otherwise is dropped."""
    from .jsonio import atomic_write_json
    from .plan import Plan

    res = search_to_table(spec, hw, gpus, space, top, outputs.table_path, progress)
    if framework:  # (what the model lacks there is said once: by the emitted file's gaps when one is written)
        _keep_runnable(res, spec, framework, log, say_model=not outputs.emit_torchtitan)
    if explain is not None and not 1 <= explain <= len(res.top):
        raise ParsimError(f"--explain {explain}: only {len(res.top)} plans ranked")
    job = SearchJob(res=res, best=res.top[0].plan if res.top else None)
    if measure and res.top:
        job.measured = measure_top(spec, hw, res, measure, measure_budget_flops, progress)
        if job.measured["rows"][0]["measured_rank"]:  # the re-ranked best is the plan written out
            job.best = Plan.from_dict(job.measured["rows"][0]["plan"])
    if job.best is not None:
        job.gaps = write_best(spec, hw, res, job.best, job.measured, outputs, model_arg)
        for line in job.gaps:
            log(line)
    if execute:
        job.executed = execute_top(spec, hw, res, execute, model_arg or spec.name, log)
    if outputs.execute_out and job.executed:
        atomic_write_json(outputs.execute_out, job.executed)
    if explain:
        job.explained = explain_dict(spec, hw, res, explain, top)
    return job


def _keep_runnable(res, spec, framework: str, log: Log, say_model: bool = True) -> None:
    """Drop from the ranked plans and the Pareto front what ``framework`` would run otherwise (said on the log)."""
    from .frameworks import model_gaps, runs_otherwise

    for line in model_gaps(spec, framework) if say_model else []:
        log(f"{framework}: {line}")
    top = [r for r in res.top if not runs_otherwise(r.plan, spec, framework)]
    pareto = [p for p in res.pareto if not runs_otherwise(p[0], spec, framework)]
    dropped = len(res.top) - len(top) + len(res.pareto) - len(pareto)
    if dropped:
        log(f"{framework}: {dropped} ranked or Pareto plans dropped (it would run them otherwise)")
    res.top, res.pareto = top, pareto


def search_to_table(spec, hw, gpus: int, space, top: int, table_path: str | None, progress: Progress | None):
    """The search; every evaluated plan to ``table_path`` (closed atomically: an interrupted search leaves no
    half file)."""
    from .search import search

    sink = (ParquetSink if str(table_path).endswith(".parquet") else CsvSink)(table_path) if table_path else None
    ok = False
    try:
        res = search(spec, hw, gpus, space, top_k=top, csv_writer=sink,
                     progress=(lambda done, total: progress("search", done, total)) if progress else None)
        ok = True
    finally:
        if sink:
            sink.close(ok)
    return res


def said_of(spec, hw, res, best, measured) -> str:
    """What parsim predicted for the plan it writes out (the re-ranked prediction after --measure)."""
    from .plan import interval_factor
    from .units import GiB

    top = res.top[0]
    step, mem, tps, mfu = top.step_time_s, top.reserved_memory_bytes, top.tokens_per_s_per_gpu, top.mfu
    if measured:
        from .costmodel import predict

        p = predict(spec, best, measured["profile"])
        step, mem, tps, mfu = p.step_time_s, p.reserved_memory_bytes, p.tokens_per_s_per_gpu, p.mfu
    q = interval_factor(hw, best)
    return (f"step {step:.3f} s (90% interval {step / q:.3f}-{step * q:.3f} s), {tps:,.0f} tokens/s/GPU, "
            f"MFU {mfu_text(mfu, hw)}, {mem / GiB:.1f} GiB reserved per GPU on {hw.name}")


def write_best(spec, hw, res, best, measured, outputs: SearchOutputs, model_arg: str | None) -> list[str]:
    """The best plan written out (atomically), with what parsim predicted for it; returns what a framework cannot
    express of it, one line each (also at the top of the emitted file)."""
    from .emit import megatron_gaps, to_megatron_args, to_torchtitan_python, to_torchtitan_toml, torchtitan_gaps
    from .jsonio import atomic_write_json, atomic_write_text

    if outputs.emit_plan:
        # the plan with the model it was searched for (`predict --plan F` then needs no --model)
        atomic_write_json(outputs.emit_plan, {"model": model_arg or spec.name, "plan_id": best.plan_id,
                                              "plan": best.to_dict()})
    said = said_of(spec, hw, res, best, measured)
    gaps = []
    if outputs.emit_torchtitan:
        python = outputs.torchtitan_format == "python"
        emit = to_torchtitan_python if python else to_torchtitan_toml
        atomic_write_text(outputs.emit_torchtitan, emit(best, spec, said + (_as_emitted(spec, hw, best) if python
                                                                             else "")))
        version = "0.3.0" if python else "0.2"
        gaps += [f"parsim: torchtitan {version} cannot express: {gap}" for gap in torchtitan_gaps(best, spec, version)]
    if outputs.emit_megatron:
        atomic_write_text(outputs.emit_megatron, to_megatron_args(best, spec, said))
        gaps += [f"parsim: Megatron-LM cannot express: {gap}" for gap in megatron_gaps(best, spec)]
    return gaps


def _as_emitted(spec, hw, best) -> str:
    """torchtitan 0.3.0 runs float8 rowwise where the plan says tensorwise: the prediction of what it will run."""
    if not (best.float8 and best.float8_recipe == "tensorwise"):
        return ""
    import dataclasses

    from .costmodel import predict

    rw = predict(spec, dataclasses.replace(best, float8_recipe="rowwise"), hw)
    return (f"; as emitted (float8 rowwise): step {rw.step_time_s:.3f} s, {rw.tokens_per_s_per_gpu:,.0f} "
            f"tokens/s/GPU, MFU {mfu_text(rw.mfu, hw)}")


def explain_dict(spec, hw, res, n: int, top: int) -> dict:
    """Plan ``n`` against up to three other plans the table shows (the next ones, or the ones before the last),
    and every factor its prediction applied (``costmodel.explain``'s factors, as ``predict --explain`` shows)."""
    from .costmodel import predict
    from .costmodel.explain import predict_and_explain

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


def measure_top(spec, hw, res, k: int, budget_flops: float | None, progress: Progress | None = None) -> dict:
    """``--measure K``: the blocks of the top-K and Pareto plans timed on this device (kept in this machine's
    profile folder under the profile's name, so a second run measures nothing again), the plans re-ranked
    (``parsim.remeasure``)."""
    import dataclasses

    import torch

    from .hardware import HardwareProfile, profile_write_dir
    from .jsonio import read_json
    from .loop_jobs import measure_blocks_into
    from .remeasure import measure_and_rerank

    cuda = torch.cuda.is_available()
    budget = budget_flops if budget_flops is not None else (math.inf if cuda else CPU_MEASURE_BUDGET_FLOPS)
    path = profile_write_dir() / f"{hw.name}.json"
    if path.exists():  # blocks measured here by an earlier run (a cache: kept beside the given profile's own)
        cached = HardwareProfile.from_dict(read_json(path, "corrupt profile"), origin=str(path))
        hw = dataclasses.replace(hw, measured_blocks={**cached.measured_blocks, **hw.measured_blocks})
    out = measure_and_rerank(spec, hw, res, k, budget,
                             lambda hw_, shapes: measure_blocks_into(hw_, shapes, path, progress))
    # no budget on a GPU (every block at its full shape): None in the record, as JSON has no infinity
    return {**out, "budget_flops": budget if math.isfinite(budget) else None, "profile_path": str(path),
            "device": "cuda" if cuda else "cpu"}


def execute_top(spec, hw, res, k: int, model_arg: str, log: Log = log_to_stderr) -> list[dict]:
    """Run the top-k plans with the executor on this machine: CUDA when it has enough GPUs, else gloo on CPU."""
    from .costmodel import predict

    try:
        import torch
    except ImportError:
        raise ParsimError("--execute needs torch installed (pip install torch)") from None
    from .executor.launch import run_plan

    out = []
    for i, (plan, *_rest) in enumerate(res.top[:k], 1):
        n = plan.world_size
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= n
        if not cuda and n > 8:
            log(f"plan #{i} needs {n} ranks; this machine runs at most 8 CPU ranks: skipped")
            continue
        log(f"executing plan #{i} ({plan.describe()}) on {n} {'GPUs' if cuda else 'CPU ranks (gloo)'} ...")
        m = run_plan(model_arg, plan, n, steps=5, warmup=2, timeout_s=900, device=None if cuda else "cpu")
        text = " ".join(x for x in (short_degrees(plan), f"AC {plan.ac}" if plan.ac != "none" else "",
                                     short_options(plan)) if x)
        out.append({"rank": i, "plan": text, "prediction": predict(spec, plan, hw).to_dict(),
                    "measurement": m.to_dict()})
    return out


class CsvSink:
    """Streams every evaluated plan to CSV, written to a temporary file and renamed at the end (atomic)."""

    # every plan field (plan_schema's order), then the prediction
    COLS = (*(f.name for f in PLAN_FIELDS), "step_time_s", "peak_memory_bytes", "reserved_memory_bytes", "fits",
            "tokens_per_s_per_gpu", "mfu")

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
                cols.append(getattr(b, c))
        return cols

    def __call__(self, b, r, fits):
        import numpy as np

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
        import numpy as np

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
