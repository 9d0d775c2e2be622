"""Search speed: plans evaluated per second and wall time of a complete search.

    python bench/search_speed.py [--only NAME]

Global batches follow public runs where there is one: Llama 3 405B used 16M-token batches (2048 x 8192) on 16,384
H100s (Llama 3 paper, arXiv:2407.21783); DeepSeek-V3 15,360 x 4,096 on 2,048 GPUs (arXiv:2412.19437).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parsim.hardware import load_profile  # noqa: E402
from parsim.search import SearchSpace, search  # noqa: E402
from parsim.spec import PRESETS  # noqa: E402

CASES = [
    ("llama3-8b", 64, 256, 8192),
    ("llama3-70b", 1024, 1024, 8192),
    ("llama3-405b", 16384, 2048, 8192),
    ("deepseek-v3", 2048, 15360, 4096),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    hw = load_profile("h100-sxm-spec")
    print(f"{'model':<12} {'GPUs':>6} {'considered':>12} {'evaluated':>12} {'fit':>11} {'wall s':>8} "
          f"{'plans/s':>10}  best")
    for name, gpus, gbs, seq in CASES:
        if args.only and args.only != name:
            continue
        t0 = time.perf_counter()
        res = search(PRESETS[name], hw, gpus, SearchSpace(global_batch_size=gbs, seq_len=seq, max_plans=0))
        wall = time.perf_counter() - t0
        best = res.top[0] if res.top else None
        desc = (f"{best[0].describe()} AC {best[0].ac} {best[3]:,.0f} tok/s/GPU MFU {best[4] * 100:.1f}%"
                if best else "nothing fits")
        print(f"{name:<12} {gpus:>6} {res.considered:>12,} {res.evaluated:>12,} {res.fitting:>11,} {wall:>8.1f} "
              f"{res.evaluated / wall:>10,.0f}  {desc}", flush=True)


if __name__ == "__main__":
    main()
