"""The first GPU, in one command: measure it, measure a model's blocks on it, run plans on it, and put parsim's
predictions beside what it measured (``bash bench/gpu_acceptance.sh``; under 10 minutes on one H100 is the aim).

1. **Profile** (``parsim.profiler.run.profile``): bf16 and fp32 GEMM curves, float8 (e4m3, ``torch._scaled_mm``)
   GEMMs where the GPU has them (compute capability 8.9+), SDPA forward/backward (the flash kernel on H100),
   memory bandwidth, AdamW, one block of the model; NCCL collectives over every GPU (with 2+ GPUs; one GPU has
   none to measure) and, with 2+, the FSDP2 / DTensor TP framework overhead.
2. **Measured blocks** (``parsim search --measure 10``): the model's top-10 and Pareto plans on ``--gpus-searched``
   GPUs, their blocks timed at their local shapes on this GPU (full size: no stand-ins on a GPU), the plans
   re-ranked; both rankings in the report.
3. **Executor runs on this machine's GPUs** (``parsim.executor.launch.run_plan``, 5 timed steps after 2 warm-up;
   run before the search: they are what a call cut short most needs):
   the model cut to ``--layers`` layers, data parallel over every GPU (FSDP2 with 2+; on one GPU no FSDP wrapper, as
   torchtitan with dp_shard 1), no AC, full AC, selective-op AC, layer:2 AC, compile, float8 compiled and eager
   (``executor.float8``); each beside
   its prediction on the profile just measured (blocks and the model's ends measured at the run's shapes): step time,
   ``torch.cuda`` allocated and reserved peaks, each beside its prediction (reserved: ``costmodel/reserved.py``).
4. **Writes** ``OUT/<name>.json`` (the profile with its blocks), ``OUT/report.json`` and ``OUT/report.md``, and
   copies the profile to ``profiles/<name>.json`` (``--no-install`` keeps it out).

``--dry-run`` takes the same path on CPU at tiny scale (model ``tiny``, 128 tokens, one gloo rank, fp32, a quick
profile, no compile or float8 runs) and writes only under ``--out``: CI runs it (``tests/test_gpu_acceptance.py``).

    bash bench/gpu_acceptance.sh                      # on the GPU machine
    bash bench/gpu_acceptance.sh --dry-run --out /tmp/acc
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 2.0**30


@dataclass(frozen=True)
class Setup:
    """What one acceptance run measures: the GPU's, or the dry run's on CPU."""

    model: str
    layers: int
    seq_len: int
    gpus_searched: int
    nproc: int
    dtype: str
    variants: tuple[tuple[str, dict], ...]
    quick: bool


def setup(dry_run: bool, n_gpus: int, layers: int) -> Setup:
    base = (("no AC", {}), ("full AC", {"ac": "full"}))
    if dry_run:
        return Setup("tiny", 2, 128, 4, 1, "float32", base, quick=True)
    more = (("selective-op AC", {"ac": "selective-op"}), ("layer:2 AC", {"ac": "layer:2"}),
            ("compile", {"compile": True}), ("selective-op AC compile", {"ac": "selective-op", "compile": True}),
            ("full AC compile", {"ac": "full", "compile": True}),
            ("full AC wrapping compile", {"ac": "full", "compile": True,
                                          "wrapper_order": ("pp", "tp", "compile", "ac", "fsdp")}),
            ("float8 compile", {"float8": True, "compile": True}),
            ("float8 eager", {"float8": True}))  # float8: torchao's tensorwise linears (executor.float8), CUDA only
    return Setup("llama3-8b", layers, 4096, 8, max(1, n_gpus), "bfloat16", base + more, quick=False)


def _cut_spec(model: str, layers: int):
    """``model`` cut to ``layers`` layers."""
    from parsim.spec import load_model

    spec = load_model(model)
    return replace(spec, name=f"{spec.name}-{layers}l", n_layers=layers)


def _run_plan(nproc: int, seq_len: int, dtype: str, opts: dict):
    """The plan of one acceptance run: every local GPU one FSDP rank, micro batch 1, a variant's options."""
    from parsim.plan import Plan

    return Plan(dp_shard=nproc, seq_len=seq_len, local_batch_size=1, micro_batch_size=1, param_dtype=dtype, **opts)


def _cut_model(s: Setup, out: Path) -> str:
    """The model with ``s.layers`` layers, as a parsim ModelSpec JSON (what the executor and predict both read)."""
    path = out / f"{s.model}-{s.layers}l.json"
    path.write_text(json.dumps(_cut_spec(s.model, s.layers).to_dict()))
    return str(path)


def _parsim(args: list[str], env: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "parsim", *args, "--json"], capture_output=True, text=True, env=env,
                       cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"parsim {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def _runs(s: Setup, model_path: str, profile_path: Path, cuda: bool, deadline: float, rows: list[dict],
          on_row) -> None:
    """Each variant run for real and predicted on the profile (blocks and the model's ends at the run's shapes
    measured first), appended to ``rows`` as it ends (then ``on_row()``); a variant not started by ``deadline``
    (perf_counter) is recorded as skipped and one that raises as failed, so a broken variant costs only itself."""
    from parsim.spec import load_model

    spec = load_model(model_path)
    for name, opts in s.variants:
        if time.perf_counter() > deadline:
            rows.append({"variant": name, "status": "skipped", "error": "deadline"})
            continue
        try:
            rows.append(_one_run(s, spec, model_path, profile_path, cuda, name, opts))
        except Exception as e:  # noqa: BLE001 - the report says what broke; the other variants still run
            rows.append({"variant": name, "status": "failed", "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"  {name}: failed: {type(e).__name__}: {e}", flush=True)
        on_row()


def _one_run(s: Setup, spec, model_path: str, profile_path: Path, cuda: bool, name: str, opts: dict) -> dict:
    from parsim.blockshape import plan_measured_shapes
    from parsim.costmodel import predict
    from parsim.executor.launch import run_plan
    from parsim.hardware import HardwareProfile
    from parsim.jsonio import read_json
    from parsim.profiler.blocks import add_measured_blocks

    plan = _run_plan(s.nproc, s.seq_len, s.dtype, opts)
    hw = HardwareProfile.from_dict(read_json(profile_path, "profile"))
    shapes = [x for x in plan_measured_shapes(spec, plan) if x is not None]
    hw, _ = add_measured_blocks(hw, shapes, profile_path)
    p = predict(spec, plan, hw)
    t0 = time.perf_counter()
    m = run_plan(model_path, plan, s.nproc, steps=5, warmup=2, timeout_s=600, device=None if cuda else "cpu")
    print(f"  {name}: {m.status} step {m.median_step_time_s} s (predicted {p.step_time_s:.4g} s)", flush=True)
    return {"variant": name, "plan_id": plan.plan_id, "status": m.status, "error": m.error[:300],
            "pred_step_s": p.step_time_s, "meas_step_s": m.median_step_time_s,
            "pred_allocated_bytes": p.peak_memory_bytes, "meas_allocated_bytes": m.peak_memory_bytes,
            "pred_reserved_bytes": p.reserved_memory_bytes,
            "meas_reserved_bytes": m.reserved_peak_memory_bytes, "meas_step_times_s": list(m.step_times_s),
            "pred_time_breakdown_s": p.time_breakdown_s, "pred_memory_breakdown_bytes": p.memory_breakdown_bytes,
            "meas_memory_breakdown_bytes": m.memory_breakdown_bytes, "losses": list(m.losses),
            "wall_s": time.perf_counter() - t0}


def float8_compile_check(s: Setup, device) -> list[dict]:
    """How torch.compile captures a float8 block (``executor.float8``): ``torch._dynamo.explain`` of the model's
    block, converted, as a measured block runs it (parameters in the run's dtype) and as the one-GPU executor run
    does (fp32 parameters under autocast) — graphs, graph breaks and their first reasons. The compiled float8 step
    measured on the H200 (2026-11-28) was no faster than the eager one while the compiled block alone was 2.6x
    faster; a graph break inside the float8 linear under autocast would explain it."""
    import torch

    from parsim.executor.float8 import convert_to_float8
    from parsim.executor.model import Block, rope_cache

    spec = _cut_spec(s.model, 1)
    dtype = getattr(torch, s.dtype)
    out = []
    for name, param_dtype, autocast in (("block dtype", dtype, False), ("fp32 under autocast", torch.float32, True)):
        torch._dynamo.reset()
        blk = Block(spec, 0).to(device=device, dtype=param_dtype)
        convert_to_float8(blk)
        x = torch.randn(1, s.seq_len, spec.d_model, device=device, dtype=param_dtype, requires_grad=True)
        rope = rope_cache(spec.head_dim, s.seq_len).to(device)
        try:
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                ex = torch._dynamo.explain(blk)(x, rope)
            out.append({"case": name, "graphs": ex.graph_count, "graph_breaks": ex.graph_break_count,
                        "reasons": [str(r.reason)[:300] for r in ex.break_reasons[:5]]})
        except Exception as e:  # noqa: BLE001 - recorded: the check is a diagnosis, not a gate
            out.append({"case": name, "error": f"{type(e).__name__}: {e}"[:300]})
    return out


def _markdown(doc: dict) -> str:
    import pandas as pd

    lines = [f"# GPU acceptance: {doc['device']}", "", f"profile `{doc['profile']}`, {doc['wall_s']:.0f} s in all "
             f"(profile {doc['profile_wall_s']:.0f} s).", "", "## Executor runs beside predictions", ""]
    num = ["pred_step_s", "meas_step_s", "pred_allocated_bytes", "meas_allocated_bytes", "pred_reserved_bytes",
           "meas_reserved_bytes"]
    runs = pd.DataFrame(doc["runs"]).reindex(columns=["variant", "status", "error", *num])
    if not runs.empty:
        runs[num] = runs[num].apply(pd.to_numeric, errors="coerce")  # a failed or skipped run has none
        runs["step err %"] = 100 * (runs["pred_step_s"] / runs["meas_step_s"] - 1)
        runs["alloc err %"] = 100 * (runs["pred_allocated_bytes"] / runs["meas_allocated_bytes"] - 1)
        meas_res = pd.to_numeric(runs["meas_reserved_bytes"], errors="coerce")  # None on CPU (no caching allocator)
        runs["reserved err %"] = 100 * (pd.to_numeric(runs["pred_reserved_bytes"], errors="coerce") / meas_res - 1)
        for c in ("pred_allocated_bytes", "meas_allocated_bytes", "pred_reserved_bytes", "meas_reserved_bytes"):
            runs[c.replace("_bytes", "_GiB")] = pd.to_numeric(runs[c], errors="coerce") / GiB
        cols = ["variant", "status", "pred_step_s", "meas_step_s", "step err %", "pred_allocated_GiB",
                "meas_allocated_GiB", "alloc err %", "pred_reserved_GiB", "meas_reserved_GiB", "reserved err %"]
        lines.append("```\n" + runs[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}") + "\n```")
        lines += [f"- {r.variant}: {r.status}: {r.error}" for r in runs.itertuples() if r.status != "ok"]
    lines += [f"- stage {k} failed: {v[-500:]}" for k, v in (doc.get("errors") or {}).items()]
    if doc.get("float8_compile"):
        lines += ["", "## torch.compile of a float8 block (`torch._dynamo.explain`)", ""]
        lines += [f"- {c['case']}: " + (c["error"] if "error" in c else
                                       f"{c['graphs']} graph(s), {c['graph_breaks']} break(s)"
                                       + "".join(f"; {r}" for r in c["reasons"])) for c in doc["float8_compile"]]
    lines += ["", "## Re-ranked with measured blocks (`parsim search --measure 10`)", ""]
    ranked = pd.DataFrame((doc.get("search_measured") or {}).get("rows") or [])
    if not ranked.empty:
        cols = ["measured_rank", "curves_rank", "curves_step_s", "measured_step_s", "describe", "ac", "blocks"]
        lines.append("```\n" + ranked[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}") + "\n```")
    return "\n".join(lines) + "\n"


def rerank_from_profile(profile: str, search_json: str) -> dict:
    """The re-ranking of the plans a GPU's ``parsim search --measure --json`` ranked (``search_json``), recomputed
    on any machine from the blocks ``profile`` holds (that GPU measured them): each plan on the curves (no measured
    block) and with its measured blocks, by today's model (``--rerank-only``)."""
    from parsim.hardware import load_profile
    from parsim.jsonio import read_json
    from parsim.plan import Plan
    from parsim.remeasure import rerank, stand_ins_of
    from parsim.spec import load_model

    doc = read_json(Path(search_json), "search output")
    spec, hw = load_model(doc["model"]), load_profile(profile)
    plans = [(Plan.from_dict(r["plan"]), r["curves_step_s"]) for r in doc["measured"]["rows"]]
    sins = stand_ins_of(spec, [p for p, _ in plans], float("inf"))
    rows = rerank(spec, hw, plans, sins)
    return {"from": Path(search_json).name, "profile": profile, "gpus": plans[0][0].world_size,
            "seq_len": plans[0][0].seq_len, "rows": rows}


def _rerank_markdown(r: dict) -> str:
    import pandas as pd

    rows = pd.DataFrame(r["rows"])
    cols = ["measured_rank", "curves_rank", "curves_step_s", "measured_step_s", "describe", "ac", "blocks"]
    return (f"### llama3-8b on {r['gpus']} GPUs, seq {r['seq_len']} (plans of {r['from']})\n\n```\n"
            + rows[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}") + "\n```\n")


def _stage(doc: dict, key: str, fn) -> None:
    """Run one stage; what it raises goes into ``doc['errors']`` and the next stage still runs (a first GPU run
    should bring back everything that worked, not only the first failure)."""
    try:
        fn()
    except (Exception, SystemExit) as e:  # noqa: BLE001
        doc.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"[-3000:]
        print(f"  {key} failed: {type(e).__name__}: {e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same path on CPU at tiny scale")
    ap.add_argument("--out", default=str(ROOT / "bench" / "reports" / "gpu-acceptance"))
    ap.add_argument("--layers", type=int, default=2, help="layers of the model the executor runs")
    ap.add_argument("--no-install", action="store_true", help="do not copy the profile into profiles/")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="no executor run or search starts after this many seconds (a lent GPU's call is capped)")
    ap.add_argument("--rerank-only", metavar="PROFILE", help="no measuring: the plans of --searches re-ranked "
                    "from the blocks PROFILE holds (its GPU measured them), written to OUT/rerank.{json,md}")
    ap.add_argument("--searches", default="", help="comma-separated `search --measure --json` outputs of a GPU")
    ap.add_argument("--reuse-profile", metavar="PROFILE", help="no profiling: a copy of PROFILE (a profile this GPU "
                    "measured, e.g. profiles/h100-measured.json) is the one predictions use and blocks are added to")
    ap.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--no-search", action="store_true", help="skip the search --measure stage")
    ap.add_argument("--repredict", metavar="REPORT_JSON", help="no measuring: the runs of a report.json predicted "
                    "again on --reuse-profile (default h100-measured), with its measured blocks and with the curves "
                    "alone, beside the step times that GPU measured")
    a = ap.parse_args(argv)
    if a.rerank_only:
        return _rerank_only(a.rerank_only, a.searches, Path(a.out))
    if a.repredict:
        return _repredict(a.repredict, a.reuse_profile or "h100-measured")
    import torch

    from parsim.profiler.run import profile, spec_profile_of

    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("error: no GPU here: run it on the GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    s = setup(a.dry_run, torch.cuda.device_count() if cuda else 0, a.layers)
    if a.variants:
        wanted = [v.strip() for v in a.variants.split(",") if v.strip()]
        unknown = sorted(set(wanted) - {n for n, _ in s.variants})
        if unknown:
            print(f"error: unknown variants {unknown}; known: {[n for n, _ in s.variants]}", file=sys.stderr)
            return 2
        s = replace(s, variants=tuple(v for v in s.variants if v[0] in wanted))
    device = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    name = (re.sub(r"[^a-z0-9]+", "-", device.lower().split()[1]) + "-measured") if cuda else "dry-run-cpu"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = t0 + a.budget_s
    prof_path = out / f"{name}.json"
    doc: dict = {"device": device, "torch": torch.__version__, "profile": str(prof_path), "setup": s.__dict__,
                 "wall_s": 0.0, "profile_wall_s": 0.0, "search_measured": {"rows": []}, "runs": []}

    def write() -> None:  # after every stage and run: a call cut short still leaves what it measured
        doc["wall_s"] = time.perf_counter() - t0
        (out / "report.json").write_text(json.dumps(doc, indent=1, default=str))
        (out / "report.md").write_text(_markdown(doc))

    if a.reuse_profile:
        print(f"1/3 reusing the profile {a.reuse_profile} ...", flush=True)
        shutil.copy(a.reuse_profile, prof_path)
        doc["reused_profile"] = a.reuse_profile
    else:
        print(f"1/3 profiling {device} ({s.nproc} rank(s)) ...", flush=True)
        links = spec_profile_of(device) if cuda and s.nproc == 1 else None  # one GPU measures no collective
        doc["interconnect_from"] = links
        _stage(doc, "profile", lambda: profile(
            name, s.nproc, out_dir=out, model=s.model, seq_len=min(s.seq_len, 2048), quick=s.quick, restart=True,
            device=None if cuda else "cpu", log=lambda m: print("  " + m, flush=True), interconnect_from=links))
    doc["profile_wall_s"] = time.perf_counter() - t0
    write()
    if not prof_path.exists():
        print(f"no profile was written: {doc.get('errors')}", file=sys.stderr)
        return 1
    if cuda:  # seconds: how compile captures a float8 block (float8_compile_check)
        _stage(doc, "float8_compile", lambda: doc.__setitem__(
            "float8_compile", float8_compile_check(s, torch.device("cuda"))))
        write()
    print(f"2/3 executor runs ({len(s.variants)}) ...", flush=True)
    _stage(doc, "runs", lambda: _runs(s, _cut_model(s, out), prof_path, cuda, deadline, doc["runs"], write))
    write()
    print(f"3/3 {s.model} on {s.gpus_searched} GPUs: search --measure 10 ...", flush=True)
    env = dict(os.environ, PARSIM_PROFILES_DIR=str(out))  # search --measure keeps its blocks in this profile

    def search() -> None:
        if a.no_search:
            return
        if time.perf_counter() > deadline:
            raise TimeoutError("budget spent before the search started")
        doc["search_measured"] = _parsim(
            ["search", "--model", s.model, "--gpus", str(s.gpus_searched), "--seq-len", str(s.seq_len), "--profile",
             str(prof_path), "--top", "10", "--measure", "10"], env)["measured"]

    _stage(doc, "search", search)
    write()
    if cuda and not a.no_install and not a.reuse_profile:
        shutil.copy(prof_path, ROOT / "profiles" / prof_path.name)
    print(_markdown(doc))
    print(f"wrote {out / 'report.md'}, {out / 'report.json'} and {prof_path} in {doc['wall_s']:.0f} s")
    return 1 if doc.get("errors") else 0


def _repredict(report_json: str, profile: str) -> int:
    """The runs of a GPU's report.json predicted on ``profile`` now: with its measured blocks, and on the curves
    alone (the blocks removed), beside the step times measured."""
    from parsim.costmodel import predict
    from parsim.hardware import load_profile

    doc = json.loads(Path(report_json).read_text())
    st = doc["setup"]
    spec = _cut_spec(st["model"], st["layers"])
    hw = load_profile(profile)
    curves = replace(hw, measured_blocks={})
    variants = dict(setup(False, 1, st["layers"]).variants)
    print(f"{'variant':16s} {'measured ms':>11s} {'blocks ms':>10s} {'err %':>6s} {'curves ms':>10s} {'err %':>6s}")
    for r in doc["runs"]:
        if r.get("status") != "ok":
            continue
        plan = _run_plan(st["nproc"], st["seq_len"], st["dtype"], variants[r["variant"]])
        m, pb, pc = r["meas_step_s"], predict(spec, plan, hw).step_time_s, predict(spec, plan, curves).step_time_s
        print(f"{r['variant']:16s} {m * 1e3:11.1f} {pb * 1e3:10.1f} {100 * (pb / m - 1):+6.1f} {pc * 1e3:10.1f} "
              f"{100 * (pc / m - 1):+6.1f}")
    return 0


def _rerank_only(profile: str, searches: str, out: Path) -> int:
    done = [rerank_from_profile(profile, f) for f in searches.split(",") if f]
    out.mkdir(parents=True, exist_ok=True)
    (out / "rerank.json").write_text(json.dumps(done, indent=1, default=str))
    text = "".join(_rerank_markdown(r) + "\n" for r in done)
    (out / "rerank.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
