"""Float8 blocks measured as float8 (``parsim.executor.float8``: torchao's tensorwise recipe in plain torch) on the
GPU a profile describes, beside the same blocks in bf16, eager and compiled: what float8 buys per block and what
its casts cost without compile's fusion. Every float8 block of ``--profile`` is measured again (one measured before
the profiler converted the linears was a bf16 block under a float8 key: ``profiler.blocks.is_current``), with its
float8 twin of the other compile setting; the bf16 twins where the profile lacks them; the profile is written to
``--out`` after each block, and a table is printed.

    python bench/gpu_float8_blocks.py --profile profiles/h200-measured.json --out DIR/h200-measured.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def twins(keys: list[str]) -> list:
    """Every float8 block shape of ``keys`` with its float8 / bf16 x eager / compiled twins, float8 first."""
    from bench.gpu_remeasure_blocks import _shape_of

    out = []
    for k in keys:
        if k.startswith("head|") or "float8=1" not in k:
            continue
        s = _shape_of(k)
        out += [dataclasses.replace(s, float8=f8, compile=c)
                for f8 in (True, False) for c in (s.compile, not s.compile)]
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=240.0)
    a = ap.parse_args(argv)
    import torch

    from parsim.hardware import HardwareProfile
    from parsim.jsonio import read_json
    from parsim.profiler.blocks import add_measured_blocks

    if not torch.cuda.is_available():
        print("error: no GPU here (float8 blocks need CUDA's scaled matmul)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    hw = HardwareProfile.from_dict(read_json(a.profile, "profile"))
    shapes = twins(sorted(hw.measured_blocks))
    print(f"{len(shapes)} shapes", flush=True)
    for s in shapes:
        if time.perf_counter() - t0 > a.budget_s:
            print("budget spent", flush=True)
            break
        if s.float8:  # always measured again: what this script is for
            hw = dataclasses.replace(hw, measured_blocks={k: v for k, v in hw.measured_blocks.items() if k != s.key})
        hw, walls = add_measured_blocks(hw, [s], Path(a.out))
        m = hw.measured_blocks[s.key]
        print(f"float8={int(s.float8)} compile={int(s.compile)} heads={s.n_heads} d_ff={s.d_ff} mb={s.micro_batch} "
              f"seq={s.seq_len}: fwd {m['fwd_s'] * 1e3:.3f} ms, bwd {m['bwd_s'] * 1e3:.3f} ms"
              f"{' (kept)' if not walls else ''}", flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
