"""Is a GPU block's framework overhead added to its kernels, or hidden under them? One block of a model, eager and
compiled, at several token counts on one GPU, each timed two ways:

* ``wall``: synchronize, run, synchronize: what the block takes end to end (``profiler.blocks.measure_block``'s
  number; the profile's block sample is this at 2048 tokens);
* ``host``: synchronize, run, read the clock *before* synchronizing: the time the host spends issuing the block's
  kernels (Python, dispatch, autograd, the launches). While the GPU is busier than the host, the host runs ahead
  and this is the issue time alone; once the host is the slower side, ``wall`` ~= ``host``.

* ``steady``: ``--chain`` calls back to back, one synchronize, divided by the calls: a block as a step runs it,
  layer after layer with the host ahead (``profiler.blocks.STEADY_CHAIN``).

If the overhead were additive, ``wall`` = kernels + host at every size; if the host overlaps the kernels, ``wall`` =
max(kernels, host) (+ the last kernel's tail). The token sweep shows which: ``host`` stays about constant with
tokens (the same kernels are issued) while the kernels grow with them.

    python bench/gpu_dispatch.py --out DIR [--model llama3-8b] [--tokens 256,512,...] [--compile-tokens ...] [--chain 8]

Writes DIR/dispatch.json after every point (a call cut short keeps what it measured). Runs on CPU too (there the
host *is* the device and ``host`` ~= ``wall``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _timed(fn, reps: int, cuda: bool, chain: int) -> dict:
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    wall, host = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
    steady = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(chain):
            fn()
        sync()
        steady.append((time.perf_counter() - t0) / chain)
    return {"wall_s": statistics.median(wall), "host_s": statistics.median(host),
            "steady_s": statistics.median(steady), "wall_spread_s": max(wall) - min(wall),
            "host_spread_s": max(host) - min(host), "steady_spread_s": max(steady) - min(steady), "reps": reps,
            "chain": chain}


def point(spec, tokens: int, seq_cap: int, compiled: bool, reps: int, device, chain: int) -> dict:
    import torch

    from parsim.executor.model import Block, rope_cache

    cuda = device.type == "cuda"
    seq = min(tokens, seq_cap)
    blk = Block(spec, 0).to(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    run = torch.compile(blk, dynamic=False) if compiled else blk
    rope = rope_cache(spec.head_dim, seq).to(device)
    x = torch.randn(max(1, tokens // seq), seq, spec.d_model, device=device,
                    dtype=torch.bfloat16 if cuda else torch.float32, requires_grad=True)

    def fwd():
        run(x, rope)

    def fwd_bwd():
        run(x, rope).sum().backward()

    t0 = time.perf_counter()
    for _ in range(3):
        fwd_bwd()
        fwd()
    warm_s = time.perf_counter() - t0
    f, fb = _timed(fwd, reps, cuda, chain), _timed(fwd_bwd, reps, cuda, chain)
    return {"tokens": tokens, "seq_len": seq, "compiled": compiled, "warmup_s": warm_s,
            **{f"fwd_{k}": v for k, v in f.items()}, **{f"fwd_bwd_{k}": v for k, v in fb.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--tokens", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--compile-tokens", default="512,2048,8192")
    ap.add_argument("--seq-cap", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--chain", type=int, default=8)
    a = ap.parse_args(argv)
    import torch

    from parsim.spec import load_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    spec = load_model(a.model)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "model": spec.name, "points": [], "errors": []}
    t0 = time.perf_counter()
    todo = [(int(t), False) for t in a.tokens.split(",") if t] + [(int(t), True) for t in a.compile_tokens.split(",")
                                                                   if t]
    for tokens, compiled in todo:
        if time.perf_counter() - t0 > a.budget_s:
            doc["errors"].append(f"budget: {tokens} compiled={compiled} not measured")
            continue
        try:
            p = point(spec, tokens, a.seq_cap, compiled, a.reps, device, a.chain)
        except Exception as e:  # noqa: BLE001 - one point's failure is recorded; the others still run
            doc["errors"].append(f"{tokens} compiled={compiled}: {type(e).__name__}: {e}"[:400])
            continue
        doc["points"].append(p)
        print(f"{tokens:6d} {'compiled' if compiled else 'eager   '} fwd wall {p['fwd_wall_s'] * 1e3:7.3f} host "
              f"{p['fwd_host_s'] * 1e3:7.3f} steady {p['fwd_steady_s'] * 1e3:7.3f} ms | fwd+bwd wall "
              f"{p['fwd_bwd_wall_s'] * 1e3:7.3f} host {p['fwd_bwd_host_s'] * 1e3:7.3f} steady "
              f"{p['fwd_bwd_steady_s'] * 1e3:7.3f} ms", flush=True)
        (out / "dispatch.json").write_text(json.dumps(doc, indent=1))
    (out / "dispatch.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
