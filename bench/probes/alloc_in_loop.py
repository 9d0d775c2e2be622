"""The collective benchmark's old timed call (buffers made in the loop: ``torch.full`` of the input, ``torch.empty``
of the output, as ``_run_op`` did before stop 63) against the same collective on buffers made once (nccl-tests'
way, ``profiler.collectives._op_buffers`` now), interleaved, twice each, 2 gloo ranks:

    torchrun --standalone --nproc-per-node 2 bench/probes/alloc_in_loop.py
"""

import statistics
import time

import torch
import torch.distributed as dist


def in_loop(op, count, me, n, grp):
    """The old timed call: the buffers made on every call."""
    if op == "all_gather":
        x, y = torch.full((count // n,), float(me)), torch.empty(count)
        dist.all_gather_into_tensor(y, x, group=grp)
    elif op == "reduce_scatter":
        x, y = torch.full((count,), float(me + 1)), torch.empty(count // n)
        dist.reduce_scatter_tensor(y, x, group=grp)
    else:
        x = torch.full((count,), float(me + 1))
        dist.all_reduce(x, group=grp)


def made_once(op, count, me, n, grp):
    """The call on buffers made here once."""
    if op == "all_gather":
        x, y = torch.full((count // n,), float(me)), torch.empty(count)
        return lambda: dist.all_gather_into_tensor(y, x, group=grp)
    if op == "reduce_scatter":
        x, y = torch.full((count,), 1.0), torch.empty(count // n)
        return lambda: dist.reduce_scatter_tensor(y, x, group=grp)
    x = torch.zeros(count)
    return lambda: dist.all_reduce(x, group=grp)


def per_call_ms(fn, iters):
    """The benchmark's timing: median over 3 trials of the slowest rank's seconds per call."""
    out = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        d = torch.tensor([(time.perf_counter() - t0) / iters])
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        out.append(float(d))
    return statistics.median(out) * 1e3


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    me, n = dist.get_rank(), dist.get_world_size()
    grp = dist.new_group(list(range(n)))
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        for b in (1 << 18, 1 << 20, 1 << 22, 1 << 24):
            count, iters = b // 4 // n * n, max(2, min(50, int(2e7 // b)))
            once = made_once(op, count, me, n, grp)
            once()

            def loop(op=op, count=count):
                in_loop(op, count, me, n, grp)

            t = [per_call_ms(loop, iters), per_call_ms(once, iters), per_call_ms(loop, iters),
                 per_call_ms(once, iters)]
            if me == 0:
                print(f"{op:15s} {b / 1e6:6.2f} MB  in the loop {t[0]:7.2f} {t[2]:7.2f}  made once {t[1]:7.2f} "
                      f"{t[3]:7.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
