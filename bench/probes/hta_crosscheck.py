"""Cross-check parsim's trace reader against HolisticTraceAnalysis on the same trace files: per rank, the kernel
time HTA assigns to each iteration (``ProfilerStep``), its kernel breakdown by type, and parsim's steps: the
collective and compute kernel seconds it read, beside the raw sums of the file's kernel durations.

    pip install --no-deps holistictraceanalysis && pip install networkx pydot psutil
    python bench/probes/hta_crosscheck.py TRACE_DIR
"""

from __future__ import annotations

import json
import sys


def main(trace_dir: str) -> None:
    from hta.trace_analysis import TraceAnalysis

    from parsim.traceread import load_json, read_traces, trace_files

    ta = TraceAnalysis(trace_dir=trace_dir)
    by_type, _ = ta.get_gpu_kernel_breakdown(visualize=False)
    out = {"hta_kernel_breakdown_us": {str(r["kernel_type"]): float(r["sum"]) for _, r in by_type.iterrows()}}
    for path, r in zip(trace_files([trace_dir]), read_traces([trace_dir]), strict=True):
        df = ta.t.get_trace(r.rank)
        k = df[df["stream"] > 0]
        ev = [e for e in load_json(path)["traceEvents"] if e.get("ph") == "X"]
        kern = [e for e in ev if e.get("cat") == "kernel"]
        out[f"rank{r.rank}"] = {
            "hta_kernel_us_by_iteration": {int(i): float(v) for i, v in k.groupby("iteration")["dur"].sum().items()},
            "parsim_steps": [s.name for s in r.steps],
            "parsim_collective_us": sum(c.duration_s for s in r.steps for c in s.collectives) * 1e6,
            "file_nccl_kernel_us": sum(e["dur"] for e in kern if "nccl" in e["name"].lower()),
            "file_other_kernel_memcpy_memset_us": sum(e["dur"] for e in ev if e.get("cat") in
                                                      ("gpu_memcpy", "gpu_memset"))
            + sum(e["dur"] for e in kern if "nccl" not in e["name"].lower()),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
