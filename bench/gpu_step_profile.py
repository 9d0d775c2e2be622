"""Where a GPU step's time goes: executor runs of one plan family on this machine's GPU with one step profiled
(``PARSIM_TORCH_PROFILE``: per-kernel device time), at two depths (the per-layer slope and the fixed ends), and
the optimizer step at sizes where memory bandwidth, not launches, sets its time.

    python bench/gpu_step_profile.py --out DIR [--layers 2,6]          # on the GPU machine
    python bench/gpu_step_profile.py --summarize DIR/prof-*.csv          # anywhere: device ms by kernel class
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# profiler rows that are not kernels: ops (their kernels are counted), annotations and the launch queue's stalls
NOT_KERNELS = (r"^(aten::|Optimizer|ProfilerStep|cuda|Memcpy|Memset|autograd|torch|c10d|nccl:|record_param"
               r"|Command Buffer)")
KERNEL_CLASSES = (("gemm", r"nvjet|gemm|cutlass|sm90_xmma|cublas"), ("attention", r"flash|fmha|attention|sdpa"),
                  ("optimizer and clipping (foreach)", r"multi_tensor_apply"),
                  ("loss (log-softmax, nll)", r"SoftMax|softmax|nll_loss"), ("reductions", r"reduce_kernel"),
                  ("copies and casts", r"copy|cast"), ("embedding", r"embedding|indexing_backward|sort|gather|scatter"),
                  ("other elementwise", r"elementwise|vectorized|unrolled"))


def kernel_class(name: str) -> str:
    """The class of ``KERNEL_CLASSES`` a kernel's name falls in ("other" if none)."""
    import re

    return next((c for c, pat in KERNEL_CLASSES if re.search(pat, name, re.I)), "other")


def summarize(paths: list[str]):
    """Device milliseconds per kernel class of each ``PARSIM_TORCH_PROFILE`` CSV (one column per file)."""
    import pandas as pd

    cols = {}
    for path in paths:
        d = pd.read_csv(path)
        k = d[~d["name"].str.match(NOT_KERNELS) & (d["self_device_us"] > 0)]
        by = (k.groupby(k["name"].map(kernel_class))["self_device_us"].sum() / 1e3)
        by["total (kernels)"] = k["self_device_us"].sum() / 1e3
        cols[Path(path).name.split(".")[0]] = by
    return pd.DataFrame(cols).fillna(0.0)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        print(summarize(sys.argv[2:]).round(2).to_string())
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", default="2,6")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--ac", default="none,full")
    a = ap.parse_args()
    import torch

    from parsim.executor.launch import run_plan
    from parsim.plan import Plan
    from parsim.profiler.compute import optimizer_samples
    from parsim.spec import load_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    opt = optimizer_samples(dev, [1 << 22, 1 << 24, 1 << 26, 1 << 28], tensor_counts=(1, 16, 64))
    (out / "optimizer.json").write_text(json.dumps(opt, indent=1))
    print("optimizer", [(o["params"], o["tensors"], round(o["time_s"] * 1e3, 3)) for o in opt], flush=True)
    spec = load_model(a.model)
    runs = []
    for n in (int(x) for x in a.layers.split(",")):
        path = Path("/tmp") / f"{a.model}-{n}l.json"  # not under --out: a lent GPU returns 8 files
        path.write_text(json.dumps(replace(spec, name=f"{spec.name}-{n}l", n_layers=n).to_dict()))
        for ac in a.ac.split(","):
            plan = Plan(dp_shard=1, seq_len=a.seq_len, local_batch_size=1, micro_batch_size=1,
                        param_dtype="bfloat16", ac=ac)
            os.environ["PARSIM_TORCH_PROFILE"] = str(out / f"prof-{n}l-{ac}")
            m = run_plan(str(path), plan, 1, steps=5, warmup=2, timeout_s=300)
            runs.append({"layers": n, "ac": ac, "status": m.status, "error": m.error[:500],
                         "step_times_s": list(m.step_times_s), "peak_bytes": m.peak_memory_bytes,
                         "reserved_bytes": m.reserved_peak_memory_bytes})
            print(runs[-1], flush=True)
            (out / "runs.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
