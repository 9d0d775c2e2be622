"""Collectives beside compute on ranks sharing cores: does a blocking collective cost more when the ranks compute
between calls than when they only communicate? One process per rank under torchrun (gloo, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/loaded_collectives.py

For compute chunks of three sizes (an m x m fp32 matmul) and two all-gather sizes, three loops of N calls are
timed, interleaved five times: the compute alone, the collective alone, and the two alternating. Rank 0 prints the
medians per call and ``extra`` = alternating - compute - collective: what a collective costs beyond its standalone
time (the profiler's curves) when it sits between compute, as every TP and EP collective of a step does. On 4
ranks sharing 2 cores a woken rank waits for a core that another rank computes on; on ranks with a core each it
should be ~0. A diagnostic, not a profile quantity (figures:
bench/reports/local-tier-first-avx2/2026-11-29)."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist


def _timed(fn, n: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / n


def point(m: int, nbytes: int, n: int, world: int) -> tuple[dict, dict]:
    """(median seconds per call, spread per call) of the three loops for an m x m matmul and an all-gather of
    ``nbytes``."""
    a, b = torch.randn(m, m), torch.randn(m, m)
    shard = torch.zeros(nbytes // 4 // world)
    full = torch.zeros(nbytes // 4 // world * world)
    forms = {"comp": lambda: torch.mm(a, b),
             "coll": lambda: dist.all_gather_into_tensor(full, shard),
             "both": lambda: (torch.mm(a, b), dist.all_gather_into_tensor(full, shard))}
    for fn in forms.values():
        _timed(fn, n)
    ts: dict[str, list[float]] = {k: [] for k in forms}
    for _ in range(5):  # interleaved: drift hits the three alike
        for k, fn in forms.items():
            ts[k].append(_timed(fn, n))
    return ({k: statistics.median(v) for k, v in ts.items()}, {k: max(v) - min(v) for k, v in ts.items()})


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(os.environ.get("N", 150))
    for m in (96, 192, 320):
        for nbytes in (16384, 262144):
            md, sp = point(m, nbytes, n, world)
            extra = md["both"] - md["comp"] - md["coll"]
            if rank == 0:
                print(f"w{world} m{m} bytes{nbytes}: comp {md['comp'] * 1e3:.3f} coll {md['coll'] * 1e3:.3f} "
                      f"both {md['both'] * 1e3:.3f} ms -> extra {extra * 1e3:+.3f} ms/call "
                      f"(spread comp {sp['comp'] * 1e3:.3f} both {sp['both'] * 1e3:.3f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
