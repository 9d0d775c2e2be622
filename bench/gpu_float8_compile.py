"""Why the one-GPU executor's compiled float8 step is no faster than its eager one (H200, 2026-11-28: 112 ms
against 114 ms) while a compiled float8 block measured alone is 2.6x faster than the eager one.

Two sides, each with the kernels that ran (``torch.profiler``: device time by kernel class, the top kernels, how
many launched) and what dynamo did (graphs, graph breaks, recompiles):

1. **One block** of ``--model`` at ``--seq-len`` tokens, fwd + bwd, timed in the ways that differ between the
   profiler's measured block and the executor's run: parameters in bf16 or in fp32 under autocast (the executor
   with no data parallelism, as torchtitan), compiled with ``torch.compile(block)`` (the profiler) or
   ``block.compile()`` (the executor), float8 or bf16 linears, eager or compiled.
2. **The executor's runs** (``executor.launch.run_plan``, the model cut to ``--layers`` layers): float8 compiled and
   eager, one step profiled (``PARSIM_TORCH_PROFILE``), dynamo's recompile and graph-break logs kept.

Writes ``OUT/float8-compile.json`` (everything) and the executor's logs and kernel CSVs beside it.

What it found (H200, torch 2.11; ``bench/reports/gpu-acceptance-h200/2026-11-28/compile-fix/``): the block compiles
the same every way (one graph, no break; fp32 under autocast 10.4 ms against 25.9 eager), but the executor's
compiled runs launched no Triton kernel at all, bf16 included: the executor's first step counts collectives under a
TorchDispatchMode, where dynamo does not trace and marks the code skipped for the rest of the process, so every
compiled plan had been timed eager (fixed in ``executor.worker.compile_after_modes``; float8 compiled 112.4 -> 83.4
ms a step, -6.4% against its prediction instead of -30.5%).

    python bench/gpu_float8_compile.py --out DIR            # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (name, parameter dtype, autocast, float8, how compiled: "" eager, "torch.compile", "module.compile")
BLOCK_CASES = (
    ("bf16 params, float8, torch.compile (the profiler)", "bfloat16", False, True, "torch.compile"),
    ("bf16 params, float8, block.compile()", "bfloat16", False, True, "module.compile"),
    ("fp32 params + autocast, float8, block.compile() (the executor)", "float32", True, True, "module.compile"),
    ("fp32 params + autocast, float8, eager", "float32", True, True, ""),
    ("bf16 params, float8, eager", "bfloat16", False, True, ""),
    ("fp32 params + autocast, bf16 linears, block.compile()", "float32", True, False, "module.compile"),
    ("fp32 params + autocast, bf16 linears, eager", "float32", True, False, ""),
)


def _kernels(prof) -> dict:
    """Device time of the profiled region by kernel class (``bench.gpu_step_profile``'s classes), the top ten
    kernels and how many kernels launched."""
    from bench.gpu_step_profile import NOT_KERNELS, kernel_class

    rows = [(e.key, e.count, float(e.self_device_time_total)) for e in prof.key_averages()
            if not re.match(NOT_KERNELS, e.key) and e.self_device_time_total > 0]
    by: dict[str, float] = {}
    for name, _, us in rows:
        by[kernel_class(name)] = by.get(kernel_class(name), 0.0) + us / 1e3
    top = sorted(rows, key=lambda r: -r[2])[:10]
    return {"ms_by_class": {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
            "kernel_ms": round(sum(r[2] for r in rows) / 1e3, 3), "launches": sum(r[1] for r in rows),
            "top": [{"name": n[:120], "calls": c, "ms": round(us / 1e3, 3)} for n, c, us in top]}


def block_case(spec, seq_len: int, case: tuple, reps: int = 10) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from parsim.executor.float8 import convert_to_float8
    from parsim.executor.model import Block, rope_cache

    name, pdtype, autocast, f8, how = case
    torch._dynamo.reset()
    counters.clear()
    dev = torch.device("cuda")
    blk = Block(spec, 0).to(device=dev, dtype=getattr(torch, pdtype))
    if f8:
        convert_to_float8(blk)
    run = blk
    if how == "torch.compile":
        run = torch.compile(blk)
    elif how == "module.compile":
        blk.compile()
    rope = rope_cache(spec.head_dim, seq_len).to(dev)
    x = torch.randn(1, seq_len, spec.d_model, device=dev, dtype=getattr(torch, pdtype), requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = run(x, rope)
        y.float().sum().backward()

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    dyn = {k: dict(counters[k]) for k in ("stats", "graph_break", "recompiles", "aot_autograd") if counters[k]}
    return {"case": name, "fwd_bwd_ms": round(statistics.median(times) * 1e3, 3),
            "spread_ms": round((max(times) - min(times)) * 1e3, 3), "warmup_s": round(warm_s, 1),
            "dynamo": dyn, **_kernels(prof)}


def executor_runs(model: str, layers: int, seq_len: int, out: Path) -> list[dict]:
    from parsim.executor.launch import run_plan
    from parsim.plan import Plan
    from parsim.spec import load_model

    spec = load_model(model)
    path = Path("/tmp") / f"{model}-{layers}l.json"
    path.write_text(json.dumps(replace(spec, name=f"{spec.name}-{layers}l", n_layers=layers).to_dict()))
    rows = []
    for name, opts in (("float8 compile", {"float8": True, "compile": True}), ("float8 eager", {"float8": True}),
                       ("bf16 compile", {"compile": True})):
        tag = name.replace(" ", "-")
        os.environ["PARSIM_TORCH_PROFILE"] = str(out / f"prof-{tag}")
        os.environ["TORCH_LOGS"] = "recompiles,graph_breaks"
        os.environ["TORCH_LOGS_OUT"] = str(out / f"dynamo-{tag}.log")
        plan = Plan(dp_shard=1, seq_len=seq_len, local_batch_size=1, micro_batch_size=1, param_dtype="bfloat16",
                    **opts)
        m = run_plan(str(path), plan, 1, steps=5, warmup=2, timeout_s=300)
        row = {"run": name, "status": m.status, "error": m.error[:500], "step_ms": [round(t * 1e3, 2)
                                                                                  for t in m.step_times_s]}
        csv = out / f"prof-{tag}.rank0.csv"
        if csv.exists():
            from bench.gpu_step_profile import summarize

            row["ms_by_class"] = summarize([str(csv)]).iloc[:, 0].round(3).to_dict()
        print(row, flush=True)
        rows.append(row)
    for k in ("PARSIM_TORCH_PROFILE", "TORCH_LOGS", "TORCH_LOGS_OUT"):
        os.environ.pop(k, None)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--skip-blocks", action="store_true")
    ap.add_argument("--skip-runs", action="store_true")
    a = ap.parse_args(argv)
    import torch

    from parsim.spec import load_model

    if not torch.cuda.is_available():
        print("error: no GPU here (float8 linears need CUDA's scaled matmul)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "blocks": [], "runs": []}

    def write():
        (out / "float8-compile.json").write_text(json.dumps(doc, indent=1))

    spec = load_model(a.model)
    for case in ([] if a.skip_blocks else BLOCK_CASES):
        try:
            r = block_case(spec, a.seq_len, case)
        except Exception as e:  # noqa: BLE001 - a diagnosis: the other cases still run
            r = {"case": case[0], "error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps({k: v for k, v in r.items() if k != "top"}), flush=True)
        doc["blocks"].append(r)
        write()
    if not a.skip_runs:
        doc["runs"] = executor_runs(a.model, a.layers, a.seq_len, out)
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
