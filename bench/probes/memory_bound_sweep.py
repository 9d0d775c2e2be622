"""The search's memory bounds against the replayed memory on whole rows of seven spaces: every option of sampled
rows (interleaved rows first, then rows of every kind), the bound of the plan's own reshard choice and the bound of
every choice (``step.memory_lower_bound(any_reshard=True)``) each below the replayed reserved memory, and how
tight they are (replayed / bound, by pipeline kind).

    python bench/probes/memory_bound_sweep.py [--rows N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from parsim.costmodel import evaluate  # noqa: E402
from parsim.costmodel.step import memory_lower_bound  # noqa: E402
from parsim.hardware import load_profile  # noqa: E402
from parsim.search import SearchSpace, _base_rows, _batch_at, _options  # noqa: E402
from parsim.spec import PRESETS  # noqa: E402

CASES = [("deepseek-v3", 256, 1024, 4096), ("qwen3-30b-a3b", 64, 256, 4096), ("mixtral-8x7b", 64, 256, 8192),
         ("llama3-70b", 256, 512, 8192), ("tiny-moe", 8, 64, 256), ("llama3-8b", 32, 256, 8192),
         ("gpt3-175b", 64, 256, 2048)]


def sweep(name: str, gpus: int, gbs: int, seq: int, n_rows: int) -> dict:
    spec = PRESETS[name]
    hw = load_profile("cpu-gloo-4" if name.startswith("tiny") else "h100-sxm-spec-cal")
    sp = SearchSpace(global_batch_size=gbs, seq_len=seq, max_plans=0)
    base = _base_rows(spec, gpus, sp, hw.gpus_per_node, {})
    opts, base["orders"] = _options(sp, hw)
    rng = np.random.default_rng(1)
    inter = np.flatnonzero(base["v"] > 1)
    rows = np.concatenate([rng.choice(inter, size=min(2 * n_rows, len(inter)), replace=False),
                           rng.choice(len(base["v"]), size=min(n_rows, len(base["v"])), replace=False)])
    gid = ((base["row_start"][rows] * len(opts))[:, None] + np.arange(len(opts))).ravel()
    out = {"plans": len(gid), "least_ratio": np.inf, "below": True, "ratio_by_kind": {}}
    by_kind: dict = {}
    for lo in range(0, len(gid), 50_000):
        b = _batch_at(base, opts, gid[lo:lo + 50_000], sp, None)
        exact = evaluate(spec, b, hw, memory_only=True)["reserved_memory_bytes"]
        own, every = memory_lower_bound(spec, b, hw), memory_lower_bound(spec, b, hw, any_reshard=True)
        out["below"] &= bool(np.all(every <= own) and np.all(own <= exact))
        out["least_ratio"] = min(out["least_ratio"], float((exact / every).min()))
        kind = np.where(b.pp == 1, "no PP", np.where(b.pp_stages_per_rank > 1, "interleaved", "1F1B / GPipe"))
        for k in np.unique(kind):
            by_kind.setdefault(str(k), []).append(exact[kind == k] / own[kind == k])
    out["ratio_by_kind"] = {k: round(float(np.median(np.concatenate(v))), 3) for k, v in by_kind.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    args = ap.parse_args()
    ok = True
    for case in CASES:
        r = sweep(*case, args.rows)
        ok &= r["below"]
        print(f"{case[0]:14s} {case[1]:5d} GPUs  plans {r['plans']:8,d}  bounds below: {r['below']}  least "
              f"replayed/bound {r['least_ratio']:.4f}  median by kind {r['ratio_by_kind']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
