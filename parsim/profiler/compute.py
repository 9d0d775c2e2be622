"""Compute benchmarks in one process: GEMMs, attention (SDPA forward + backward), memory-bound elementwise
kernels, the AdamW step, and one real transformer block of a ModelSpec forward + backward.

On CPU each torchrun rank runs with OMP_NUM_THREADS=1, so the benchmarks run with ``threads`` (default 1) to
measure what one rank gets. Times are medians of ``reps`` after warm-up (CUDA: synchronized).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def _time(fn, reps: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def gemm_samples(device, dtype, shapes, reps=5) -> list[dict]:
    cuda = device.type == "cuda"
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = _time(lambda: a @ b, reps, cuda)
        out.append({"kind": "gemm", "m": m, "n": n, "k": k, "dtype": str(dtype).replace("torch.", ""),
                    "flops": 2.0 * m * n * k, "time_s": t})
    return out


def float8_gemm_samples(device, shapes, reps=5) -> list[dict]:
    """float8 (e4m3) GEMMs with tensorwise scales and bf16 output, as torchao's float8 training runs them
    (``torch._scaled_mm``; the second operand column-major), on GPUs that have them (compute capability 8.9+).
    None elsewhere: a CPU's float8 path is an emulation, not what a float8 plan would run on."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return []
    f8 = torch.float8_e4m3fn
    one = torch.ones((), device=device, dtype=torch.float32)
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device).to(f8)
        b = torch.randn(n, k, device=device).to(f8).t()
        t = _time(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps, True)
        out.append({"kind": "gemm", "m": m, "n": n, "k": k, "dtype": "float8_e4m3fn", "flops": 2.0 * m * n * k,
                    "time_s": t})
    return out


def attention_samples(device, dtype, shapes, reps=3) -> list[dict]:
    """SDPA causal forward and backward; flops counted as the cost model does (causal half)."""
    cuda = device.type == "cuda"
    out = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        t_f = _time(fwd, reps, cuda)

        def fb():
            o = fwd()
            o.backward(torch.ones_like(o))

        t_fb = _time(fb, reps, cuda)
        flops = 2.0 * b * h * s * s * d  # QK^T and AV, causal half: 2 * (2 * b*h*s*s*d) / 2
        out.append({"kind": "attention", "b": b, "h": h, "s": s, "d": d, "dtype": str(dtype).replace("torch.", ""),
                    "flops": flops, "time_fwd_s": t_f, "time_bwd_s": max(t_fb - t_f, 1e-9)})
    return out


def memory_samples(device, sizes_elems, reps=5) -> list[dict]:
    cuda = device.type == "cuda"
    out = []
    for n in sizes_elems:
        x = torch.randn(n, device=device)
        y = torch.empty_like(x)
        t = _time(lambda: torch.mul(x, 2.0, out=y), reps, cuda)
        out.append({"kind": "elementwise", "elements": n, "bytes": 2.0 * n * 4, "time_s": t})
    return out


def optimizer_samples(device, sizes_params, tensor_counts=(1, 16, 64), reps=3) -> list[dict]:
    """The executor's optimizer step (``executor.worker.clip_and_step``: the gradient norm, the clipping multiply
    and foreach AdamW with its weight decay) over ``k`` tensors of ``n / k`` parameters each, one process, no
    process group, for every ``n`` in ``sizes_params`` and ``k`` in ``tensor_counts``: a step costs a fixed part,
    a part per parameter (memory traffic) and a part per tensor (foreach kernels loop over tensors on a CPU; on a
    GPU they launch per chunk), which ``fit.fit_optimizer_step`` separates."""
    from ..executor.worker import clip_and_step, make_optimizer

    cuda = device.type == "cuda"
    out = []
    for n in sizes_params:
        for k in tensor_counts:
            ps = [torch.nn.Parameter(torch.randn(max(1, n // k), device=device)) for _ in range(k)]
            grads = [torch.randn_like(p) for p in ps]
            opt = make_optimizer(ps, "adamw")

            def step(ps=ps, grads=grads, opt=opt):
                for p, g in zip(ps, grads, strict=True):
                    p.grad = g  # what backward leaves; clip_and_step sets them to None after the step
                clip_and_step(ps, opt)

            t = _time(step, reps, cuda)
            out.append({"kind": "adamw", "params": sum(p.numel() for p in ps), "tensors": k, "time_s": t})
    return out


HOST_SAMPLE_TOKENS = 256  # [assumed] few enough that an H100 runs a block's kernels faster than a host issues them


def _host_issue_s(fn, reps: int) -> float:
    """The host's issue seconds per call of ``fn`` on CUDA, at a size where the device is the faster side: the
    median of ``profiler.blocks.steady_times`` (calls back to back, one synchronize, divided by the calls). The
    device then waits on the host, so each call's share is the host's time to issue it (Python, dispatch,
    autograd, launches). One call timed without synchronizing reads the same thing noisier (an H100 VM: 2.9 ms
    forward alone against 1.6 ms per call in a chain, bench/gpu_dispatch.py)."""
    from .blocks import steady_times

    return statistics.median(steady_times(fn, reps, cuda=True))


def block_sample(spec, tokens: int, seq_len: int, device, dtype, reps: int | None = None) -> dict:
    """Forward + backward of one real block of ``spec`` on ``tokens`` tokens (batch = tokens / seq_len). On a GPU
    an eager block is launch-bound at these sizes and its times scatter (one H100: forward 2.6-3.7 ms over 9
    samples, and once 9.8 ms in a profile's run, above its own forward + backward), so 15 reps there, 3 on CPU.

    On a GPU (asynchronous: the host issues kernels ahead of the device) it also records the host's *issue* time
    of the same block (``host_fwd_s``, ``host_fwd_bwd_s``, ``_host_issue_s``) on ``HOST_SAMPLE_TOKENS`` tokens,
    where the device is the faster side (``costmodel.compute.host_issue_times`` combines it with the kernels by
    max, not sum)."""
    from ..executor.model import Block, rope_cache

    cuda = device.type == "cuda"
    reps = reps if reps is not None else (15 if cuda else 3)
    blk = Block(spec, 0).to(device=device, dtype=dtype)

    def runs(n_tokens: int, seq: int):
        rope = rope_cache(spec.head_dim, seq).to(device)
        x = torch.randn(max(1, n_tokens // seq), seq, spec.d_model, device=device, dtype=dtype, requires_grad=True)
        return (lambda: blk(x, rope)), (lambda: blk(x, rope).sum().backward())

    fwd, fb = runs(tokens, seq_len)
    out = {"kind": "block", "model": spec.name, "tokens": tokens, "seq_len": seq_len,
           "dtype": str(dtype).replace("torch.", ""), "time_fwd_s": _time(fwd, reps, cuda),
           "time_fwd_bwd_s": _time(fb, reps, cuda)}
    if cuda:
        small = min(HOST_SAMPLE_TOKENS, seq_len)
        fwd, fb = runs(small, small)
        fb()  # warm-up at this shape
        out.update(host_tokens=small, host_fwd_s=_host_issue_s(fwd, reps), host_fwd_bwd_s=_host_issue_s(fb, reps))
    return out


def run_compute(device, spec=None, seq_len=512, threads: int | None = 1, quick=False) -> list[dict]:
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    cpu = device.type == "cpu"
    dtype = torch.bfloat16 if not cpu else torch.float32
    sq = [128, 256, 512, 1024] if cpu else [256, 512, 1024, 2048, 4096, 8192]
    shapes = [(s, s, s) for s in sq]
    if spec is not None:
        t = seq_len
        shapes += [(t, spec.q_dim, spec.d_model), (t, spec.d_ff, spec.d_model), (t, spec.d_model, spec.d_ff)]
    if quick:
        shapes = shapes[:3]
    out = gemm_samples(device, dtype, shapes)
    out += gemm_samples(device, torch.bfloat16, shapes[:3]) if cpu else gemm_samples(device, torch.float32, shapes[:3])
    out += float8_gemm_samples(device, [s for s in shapes if all(d % 16 == 0 for d in s)])
    att = [(1, 4, 256, 64), (1, 8, 512, 64), (1, 8, 1024, 64)] if cpu else \
        [(1, 32, 1024, 128), (1, 32, 4096, 128), (2, 32, 8192, 128)]
    out += attention_samples(device, dtype, att[:2] if quick else att)
    out += memory_samples(device, [1 << 18, 1 << 20, 1 << 22] + ([] if quick else [1 << 24]))
    # a GPU's step is launch-bound below ~10M parameters: its per-parameter (bandwidth) term needs sizes of a real
    # model's shard (measured on one H100, clip + foreach AdamW: 2^22 params 0.83 ms, 2^26 2.75 ms, 2^28 9.6 ms)
    opt_sizes = [1 << 18, 1 << 20] + ([] if quick else [1 << 22]) if cpu else \
        [1 << 20, 1 << 24] + ([] if quick else [1 << 26, 1 << 28])
    out += optimizer_samples(device, opt_sizes)
    if spec is not None:
        out.append(block_sample(spec, seq_len, seq_len, device, dtype))
    return out


def _sharing_worker(i: int, seq_len: int, reps: int, cycles: int, barrier, queue) -> None:
    """One process of ``core_sharing_sample``: the probe block's forward + backward on one thread. Each cycle has
    two phases, each between two barriers: alone (process 0 times ``reps`` runs while the others wait at the
    barrier, idle) and together (every process times ``reps`` runs); puts (cycle, phase, process, median)."""
    torch.set_num_threads(1)
    from ..executor.model import Block, rope_cache
    from ..spec import PRESETS

    spec = PRESETS["tiny"]
    blk = Block(spec, 0)
    rope = rope_cache(spec.head_dim, seq_len)
    x = torch.randn(2, seq_len, spec.d_model, requires_grad=True)
    for _ in range(2):
        blk(x, rope).sum().backward()
    for c in range(cycles):
        for phase in ("alone", "together"):
            barrier.wait()
            if phase == "together" or i == 0:
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    blk(x, rope).sum().backward()
                    ts.append(time.perf_counter() - t0)
                queue.put((c, phase, i, statistics.median(ts)))
            barrier.wait()


def core_sharing_sample(ranks: int, seq_len: int = 256, reps: int = 8, cycles: int = 8) -> dict:
    """What ``ranks`` single-threaded processes running at once do to each one's compute on this CPU: a block's
    forward + backward timed alone and together, paired and interleaved: ``ranks`` processes started once, then
    ``cycles`` times process 0 alone (the others idle) and right after all of them at once (``_sharing_worker``).
    A cycle's ratio is the together median over the processes (each its median of ``reps``) over the alone median
    of the same cycle; ``factor`` is the median of the cycles' ratios. With more ranks than cores this is about
    ranks / cores, plus what time slicing and the shared caches and memory bus add; the profile's
    ``compute_scale``.

    Why paired [measured, 2-core AVX2 EPYC, 4 processes]: the probe before timed alone and together in
    separately spawned process sets, one pair per round; its alone time moved 42-82 ms between rounds on this shared
    machine while together moved 96-137, and single rounds read 1.39 to 2.73 (16 rounds over five sessions; a
    2.48 / 2.41 pair made one session's 4-rank predictions 16% high, where 2.0 fit the steps). Interleaved in one
    session, four runs each: the old probe read 2.07 / 2.45 / 2.02 / 2.12, the paired one (4 repetitions a phase)
    2.03 / 2.15 / 1.90 / 2.05; with 8 (the default, about 23 s) three runs read 2.09 / 2.20 / 2.15
    (``bench/reports/core-sharing/2026-11-29/core-sharing-probe.txt``). A cycle's two phases are a second apart
    on the same processes: the machine's drift and a process's own luck (its allocations, its placement) cancel
    in the ratio."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, bar = ctx.Queue(), ctx.Barrier(ranks)
    ps = [ctx.Process(target=_sharing_worker, args=(i, seq_len, reps, cycles, bar, q)) for i in range(ranks)]
    for p in ps:
        p.start()
    got = [q.get(timeout=600) for _ in range(cycles * (1 + ranks))]
    for p in ps:
        p.join()
    alone = {c: t for c, phase, _i, t in got if phase == "alone"}
    together: dict[int, list[float]] = {}
    for c, phase, _i, t in got:
        if phase == "together":
            together.setdefault(c, []).append(t)
    ratios = [statistics.median(together[c]) / alone[c] for c in range(cycles)]
    return {"kind": "core_sharing", "ranks": ranks, "alone_s": statistics.median(alone.values()),
            "concurrent_s": statistics.median(statistics.median(v) for v in together.values()),
            "factor": statistics.median(ratios), "cycle_factors": ratios, "cycles": cycles, "reps": reps}
