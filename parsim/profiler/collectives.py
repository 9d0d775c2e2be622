"""Collective benchmark, one process per rank under torchrun (NCCL on CUDA, gloo on CPU).

    torchrun --nproc-per-node 4 -m parsim.profiler.collectives --out samples.json [--resume]

For every group shape a plan can produce — sub-groups of every size g dividing the world, both as contiguous
blocks of ranks (an inner mesh axis) and strided (an outer one) — and every op (all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, broadcast, send/recv between pairs), a
geometric sweep of message sizes is timed on buffers made once per point (``_op_buffers``): warm-up, then
``trials`` timed repetitions of ``iters`` back-to-back calls after a barrier; a sample is the median over trials
of the slowest rank's time per call. Results are checked as nccl-tests' ``-c`` does (known inputs, expected
sums). Sizes follow nccl-tests: S is the whole buffer (all_gather: the gathered output). Gloo has no native
reduce_scatter (torch emulates it) and its all_to_all is a loop of send/recv pairs: both are measured as torch
runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..hardware import COLLECTIVE_OPS as OPS
from ..hardware import busbw_factor
from ..procs import die_with_parent


def group_shapes(world: int, local_world: int) -> list[tuple[int, str, list[list[int]]]]:
    """(size, kind, list of rank lists) for contiguous and strided partitions of the world."""
    out = []
    for g in range(2, world + 1):
        if world % g:
            continue
        contiguous = [list(range(i * g, (i + 1) * g)) for i in range(world // g)]
        out.append((g, "contiguous", contiguous))
        stride = world // g
        if stride > 1:
            strided = [list(range(i, world, stride)) for i in range(stride)]
            out.append((g, "strided", strided))
    return out


def ranks_per_node(ranks: list[int], local_world: int) -> int:
    nodes = {}
    for r in ranks:
        nodes[r // local_world] = nodes.get(r // local_world, 0) + 1
    return max(nodes.values())


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def _op_buffers(op: str, buf_bytes: int, n: int, me: int, group, ranks, device, dtype):
    """``(call, check)`` for ``op`` with a nccl-tests buffer of ``buf_bytes``: the buffers are made here once, filled
    with known inputs; ``call()`` issues the collective on them, ``check()`` (after one call) returns an error
    string if the output is wrong, else None. Timed calls reuse the buffers, as nccl-tests does: a buffer made
    in the timed loop (``torch.full`` of the input, ``torch.empty`` of the output) is timed with the collective.
    On 2 gloo ranks of a 2-core AVX2 EPYC that made a 4 MB all-gather 6.3 ms against 3.8 with the buffers made
    once, a reduce-scatter 7.4 against 5.2, a 16 MB all-gather 23.5 against 14.7 (means of two runs each, stop
    63), and every FSDP unit's collectives were charged the difference while the framework probe
    (``profiler.frameworks``) charges FSDP's own buffers again [measured]."""
    el = torch.tensor([], dtype=dtype).element_size()
    count = max(n, (buf_bytes // el) // n * n)  # divisible by the group size
    if op == "all_reduce":
        x = torch.full((count,), float(me + 1), dtype=dtype, device=device)
        want = n * (n + 1) / 2

        def check():  # then zeros: the timed calls' sums stay 0 (no overflow to inf over many calls)
            err = None if bool((x == want).all()) else f"all_reduce got {x[0].item()} want {want}"
            x.zero_()
            return err

        return lambda: dist.all_reduce(x, group=group), check
    if op == "all_gather":
        x = torch.full((count // n,), float(me), dtype=dtype, device=device)
        y = torch.empty(count, dtype=dtype, device=device)
        want = torch.arange(n, dtype=dtype, device=device).repeat_interleave(count // n)
        return (lambda: dist.all_gather_into_tensor(y, x, group=group),
                lambda: None if torch.equal(y, want) else "all_gather mismatch")
    if op == "reduce_scatter":
        x = torch.full((count,), float(me + 1), dtype=dtype, device=device)
        y = torch.empty(count // n, dtype=dtype, device=device)
        want = n * (n + 1) / 2
        return (lambda: dist.reduce_scatter_tensor(y, x, group=group),
                lambda: None if bool((y == want).all()) else "reduce_scatter mismatch")
    if op == "all_to_all":
        x = torch.arange(n, dtype=dtype, device=device).repeat_interleave(count // n) + 100 * me
        y = torch.empty(count, dtype=dtype, device=device)
        want = torch.arange(n, dtype=dtype, device=device).repeat_interleave(count // n) * 100 + me
        return (lambda: dist.all_to_all_single(y, x, group=group),
                lambda: None if torch.equal(y, want) else "all_to_all mismatch")
    if op == "broadcast":
        x = torch.full((count,), float(me), dtype=dtype, device=device)
        return (lambda: dist.broadcast(x, src=ranks[0], group=group),
                lambda: None if bool((x == 0).all()) else "broadcast mismatch")
    if op == "send":  # pairs (0,1), (2,3), ... inside the group: first sends, second receives
        x = torch.full((count,), float(me), dtype=dtype, device=device)
        if me % 2 == 0 and me + 1 < n:
            return lambda: dist.send(x, dst=ranks[me + 1], group=group), lambda: None
        if me % 2 == 1:
            return (lambda: dist.recv(x, src=ranks[me - 1], group=group),
                    lambda: None if bool((x == me - 1).all()) else "send/recv mismatch")
        return lambda: None, lambda: None
    raise ValueError(op)


def _parse(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--min-bytes", type=int, default=0)
    ap.add_argument("--max-bytes", type=int, default=0)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--iters", type=int, default=0, help="calls per trial (0: by size)")
    ap.add_argument("--trials", type=int, default=3)
    return ap.parse_args(argv)


def _resumed(args) -> dict:
    """The samples of an earlier run of the same output (``--resume``), by (op, group size, kind, bytes)."""
    done = {}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            for s in json.load(f).get("samples", []):
                done[(s["op"], s["group_size"], s["group_kind"], s["bytes"])] = s
    return done


def main(argv=None) -> int:
    die_with_parent()  # torchrun gone (killed, crashed): this rank goes too
    args = _parse(argv)
    cuda = torch.cuda.is_available() and os.environ.get("PARSIM_DEVICE") != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    min_b = args.min_bytes or (1 << 10)
    max_b = args.max_bytes or ((1 << 30) if cuda else (16 << 20))
    done = _resumed(args)
    samples = list(done.values())
    shapes = group_shapes(world, local_world)
    ops = [o for o in args.ops.split(",") if o]
    todo = [(op, g, kind, parts, b) for op in ops for g, kind, parts in shapes
            for b in sizes(min_b, max_b, args.factor) if (op, g, kind, b) not in done]
    progress = task = None
    if rank == 0:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task("collectives", total=len(todo))
        print(f"# parsim collective benchmark: {world} ranks ({local_world} per node), backend "
              f"{dist.get_backend()}, {args.dtype}; busbw factors as nccl-tests; {len(todo)} points to measure")
    groups = {}
    for g, kind, parts in shapes:
        pgs = [dist.new_group(p) for p in parts]  # every rank creates every group, in the same order
        groups[(g, kind)] = (parts, pgs)
    header_printed: set = set()
    t_start = time.perf_counter()
    for op, g, kind, parts, b in todo:
        parts, pgs = groups[(g, kind)]
        idx = next(i for i, p in enumerate(parts) if rank in p)
        sample = _measure(args, op, g, kind, b, parts[idx], pgs[idx], rank, local_world, device, cuda)
        samples.append(sample)
        if progress is not None:
            _print_point(progress, sample, header_printed, args.dtype)
            progress.update(task, advance=1)
            _save(args.out, samples, world, local_world, device, t_start)  # checkpoint: --resume continues here
    if progress is not None:
        progress.stop()
        _save(args.out, samples, world, local_world, device, t_start)
    dist.destroy_process_group()
    return 0


def _measure(args, op: str, g: int, kind: str, b: int, ranks: list, pg, rank: int, local_world: int, device,
             cuda: bool) -> dict:
    """One point: ``op`` of ``b`` bytes over this rank's group of ``g`` (``ranks``, ``pg``), checked once, then
    timed in ``args.trials`` trials of ``iters`` calls (the slowest rank's time per call, median over trials)."""
    dtype = getattr(torch, args.dtype)
    me = ranks.index(rank)
    iters = args.iters or max(2, min(50, int(2e7 // max(b, 1))))
    call, check = _op_buffers(op, b, g, me, pg, ranks, device, dtype)
    call()  # warm-up + correctness
    if cuda:
        torch.cuda.synchronize()
    err = check()
    times = []
    for _ in range(args.trials):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        if cuda:
            torch.cuda.synchronize()
        dt = torch.tensor([(time.perf_counter() - t0) / iters])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time per call
        times.append(float(dt))
    bad = torch.tensor([0 if err is None else 1])
    dist.all_reduce(bad)
    el = torch.tensor([], dtype=dtype).element_size()
    count = max(g, (b // el) // g * g)
    return {"op": op, "group_size": g, "group_kind": kind, "ranks_per_node": ranks_per_node(ranks, local_world),
            "bytes": b, "buffer_bytes": count * el, "count": count, "dtype": args.dtype,
            "time_s": statistics.median(times), "time_min_s": min(times), "time_max_s": max(times), "iters": iters,
            "trials": args.trials, "wrong": int(bad)}


def _print_point(progress, sample: dict, header_printed: set, dtype: str) -> None:
    """A line per point in nccl-tests' columns, under a header per (op, group size, kind)."""
    op, g, kind = sample["op"], sample["group_size"], sample["group_kind"]
    if (op, g, kind) not in header_printed:
        header_printed.add((op, g, kind))
        progress.console.print(f"# {op} group {g} ({kind}, {sample['ranks_per_node']} per node)\n"
                               f"# {'size':>12} {'count':>10} {'type':>8} {'time us':>10} "
                               f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'#wrong':>6}")
    s_bytes, t = sample["buffer_bytes"], sample["time_s"]
    algbw = s_bytes / t / 1e9
    progress.console.print(f"  {s_bytes:>12} {sample['count']:>10} {dtype:>8} {t * 1e6:>10.1f} {algbw:>10.3f} "
                           f"{algbw * float(busbw_factor(op, g)):>10.3f} {sample['wrong']:>6}")


def _save(path, samples, world, local_world, device, t_start):
    from ..jsonio import atomic_write_json

    atomic_write_json(path, {"samples": samples, "world_size": world, "local_world_size": local_world,
                             "device": str(device), "backend": dist.get_backend(), "torch": torch.__version__,
                             "nccl": ".".join(map(str, torch.cuda.nccl.version()))
                             if torch.cuda.is_available() else None,
                             "wall_s": time.perf_counter() - t_start})


if __name__ == "__main__":
    raise SystemExit(main())
