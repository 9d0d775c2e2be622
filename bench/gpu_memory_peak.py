"""What holds a GPU run's memory peak: the acceptance script's single-GPU plans run with every allocation recorded
(``PARSIM_CUDA_MEMORY_SNAPSHOT``; ``executor.measure.peak_holders`` groups the blocks live at the peak by the
parsim line that allocated them), beside the model's breakdown at its own peak.

    python bench/gpu_memory_peak.py --out DIR [--layers 2] [--ac none,full]
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ac", default="none,full")
    a = ap.parse_args()
    from parsim.executor.launch import run_plan
    from parsim.plan import Plan
    from parsim.spec import load_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = load_model("llama3-8b")
    path = Path("/tmp") / f"llama3-8b-{a.layers}l.json"
    path.write_text(json.dumps(replace(spec, name=f"llama3-8b-{a.layers}l", n_layers=a.layers).to_dict()))
    for ac in a.ac.split(","):
        plan = Plan(dp_shard=1, seq_len=4096, local_batch_size=1, micro_batch_size=1, param_dtype="bfloat16", ac=ac)
        os.environ["PARSIM_CUDA_MEMORY_SNAPSHOT"] = str(out / f"peak-{ac}")
        m = run_plan(str(path), plan, 1, steps=1, warmup=1, timeout_s=150)
        print(ac, m.status, m.error[:300], m.peak_memory_bytes, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
