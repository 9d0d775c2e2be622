"""Re-measure a GPU profile's blocks and block sample with the profiler as it is now (``profiler.blocks``: steady
state, ``STEADY_CHAIN`` calls per synchronize; ``profiler.compute.block_sample``: with the host's issue time), on
the GPU that profile describes, without re-profiling the rest. Shapes not compiled first, then the compiled ones,
while ``--budget-s`` lasts; the profile is written after each (what is not re-measured keeps its old entry, which
says how it was measured: no ``chain`` field = one call per synchronize).

    python bench/gpu_remeasure_blocks.py --profile profiles/h100-measured.json --out DIR/h100-measured.json
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


def _shape_of(key: str):
    from parsim.blockshape import BlockShape, HeadShape

    head = key.startswith("head|")
    fields = dict(kv.split("=", 1) for kv in key.removeprefix("head|").split("|"))
    cls = HeadShape if head else BlockShape
    kw = {}
    for f in dataclasses.fields(cls):
        v = fields[f.name]
        kw[f.name] = bool(int(v)) if f.type in ("bool", bool) else int(v) if f.type in ("int", int) else v
    shape = cls(**kw)
    assert shape.key == key, (shape.key, key)
    return shape


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=200.0)
    a = ap.parse_args(argv)
    import torch

    from parsim.hardware import HardwareProfile, atomic_write_json
    from parsim.jsonio import read_json
    from parsim.profiler.blocks import add_measured_blocks
    from parsim.profiler.compute import block_sample
    from parsim.spec import load_model

    if not torch.cuda.is_available():
        print("error: no GPU here", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    hw = HardwareProfile.from_dict(read_json(a.profile, "profile"))
    out = Path(a.out)
    old = dict(hw.measured_blocks)
    b = hw.samples["block"]
    new_sample = block_sample(load_model(b["model"]), b["tokens"], b["seq_len"], torch.device("cuda"),
                              getattr(torch, b["dtype"]))
    new_sample = {k: v for k, v in new_sample.items() if k != "kind"}
    print("block sample:", {k: v for k, v in new_sample.items()}, flush=True)
    samples = dict(hw.samples)
    samples["block"] = {**new_sample, "previous": {k: v for k, v in b.items() if k != "previous"},
                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    hw = dataclasses.replace(hw, samples=samples)
    atomic_write_json(out, hw.to_dict())
    keys = sorted(old, key=lambda k: ("compile=1" in k, "float8=1" in k, k))
    done = 0
    for k in keys:
        if time.perf_counter() - t0 > a.budget_s:
            break
        blocks = dict(hw.measured_blocks)
        prev = blocks.pop(k)
        hw = dataclasses.replace(hw, measured_blocks=blocks)
        hw, _ = add_measured_blocks(hw, [_shape_of(k)], out)
        m = hw.measured_blocks[k]
        pf, nf = prev.get("fwd_s", prev.get("out_fwd_s")), m.get("fwd_s", m.get("out_fwd_s"))
        pb, nb = prev.get("bwd_s", prev.get("out_bwd_s")), m.get("bwd_s", m.get("out_bwd_s"))
        print(f"{k[:90]}: fwd {pf * 1e3:.3f} -> {nf * 1e3:.3f} ms, bwd {pb * 1e3:.3f} -> {nb * 1e3:.3f} ms", flush=True)
        done += 1
    print(f"re-measured {done} of {len(keys)} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
