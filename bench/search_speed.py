"""Search speed: wall time of a complete search, exhaustive (every plan evaluated) and pruned (the default:
dominated options skipped, memory screened first, device orders of a pair skipped when its step-time lower bound
loses), run one after the other on the same machine, with the best plans and whether the Pareto fronts agree.

    python bench/search_speed.py [--only NAME] [--no-exhaustive]

Global batches follow public runs where there is one: DeepSeek-V3 15,360 x 4,096 on 2,048 GPUs (arXiv:2412.19437).
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parsim.hardware import load_profile  # noqa: E402
from parsim.search import SearchSpace, search  # noqa: E402
from parsim.spec import PRESETS  # noqa: E402

CASES = [
    ("llama3-8b", 64, 256, 8192),
    ("llama3-70b", 256, 512, 8192),
    ("mixtral-8x7b", 64, 256, 8192),
    ("qwen3-30b-a3b", 64, 256, 4096),
    ("deepseek-v3", 2048, 15360, 4096),
]


def _timed(spec, hw, gpus, sp):
    t0 = time.perf_counter()
    res = search(spec, hw, gpus, sp)
    return res, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-exhaustive", action="store_true", help="only the pruned search")
    args = ap.parse_args()
    hw = load_profile("h100-sxm-spec-cal")
    print(f"{'model':<14} {'GPUs':>5} {'considered':>12} {'exhaustive s':>12} {'pruned s':>9} {'evaluated':>11} "
          f"{'screened':>10}  best (same in both?)")
    for name, gpus, gbs, seq in CASES:
        if args.only and args.only != name:
            continue
        sp = SearchSpace(global_batch_size=gbs, seq_len=seq, max_plans=0)
        fast, t_fast = _timed(PRESETS[name], hw, gpus, sp)
        full, t_full = (None, float("nan")) if args.no_exhaustive or name == "deepseek-v3" else \
            _timed(PRESETS[name], hw, gpus, dataclasses.replace(sp, prune=False))
        best = fast.top[0] if fast.top else None
        same = "-" if full is None else (
            ("same best" if full.top and best and full.top[0][0] == best[0] else "best DIFFERS")
            + (", same front" if [(p.plan_id, t, m) for p, t, m in full.pareto]
               == [(p.plan_id, t, m) for p, t, m in fast.pareto] else ", front DIFFERS"))
        desc = (f"{best[0].describe()} AC {best[0].ac} {best[1]:.3f} s MFU {best[4] * 100:.1f}%" if best
                else "nothing fits")
        print(f"{name:<14} {gpus:>5} {fast.considered:>12,} {t_full:>12.1f} {t_fast:>9.1f} {fast.evaluated:>11,} "
              f"{fast.screened:>10,}  {desc} ({same})", flush=True)


if __name__ == "__main__":
    main()
