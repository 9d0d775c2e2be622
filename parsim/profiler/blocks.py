"""Measured blocks: one transformer block at a plan's local shape (``parsim.blockshape.BlockShape``), built with
the executor's modules and timed forward and forward + backward in this process, without a process group (CUDA
when present, else CPU with one thread: what one gloo rank gets). Warm-up first (and the compile, for compiled
shapes), then ``reps`` timed repetitions: the medians and the spread (max - min) are kept, with the machine, the
torch version and the time of measurement (``HardwareProfile.measured_blocks``)."""

from __future__ import annotations

import platform
import statistics
import time

import torch

from ..blockshape import BlockShape


def _times(fn, reps: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def measure_block(shape: BlockShape, device: torch.device | None = None, reps: int = 5, warmup: int = 2,
                  threads: int | None = 1) -> dict:
    """Forward and backward seconds of one block of ``shape`` (medians of ``reps``, after ``warmup``)."""
    from ..executor.model import Block, rope_cache

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if shape.float8 and not cuda:
        raise ValueError("float8 blocks need a GPU with float8 GEMMs")
    if not cuda and threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, shape.dtype)
    spec = shape.local_spec()
    blk = Block(spec, 0).to(device=device, dtype=dtype)
    run = torch.compile(blk) if shape.compile else blk
    rope = rope_cache(spec.head_dim, shape.seq_len).to(device)
    x = torch.randn(shape.micro_batch, shape.seq_len, spec.d_model, device=device, dtype=dtype, requires_grad=True)

    def fwd():  # with autograd recording, as in training (the graph is dropped)
        run(x, rope)

    def fwd_bwd():
        run(x, rope).sum().backward()

    t_start = time.perf_counter()
    for _ in range(warmup):
        fwd_bwd()
        fwd()
    f = _times(fwd, reps, cuda)
    fb = _times(fwd_bwd, reps, cuda)
    t_f, t_fb = statistics.median(f), statistics.median(fb)
    return {"fwd_s": t_f, "bwd_s": max(t_fb - t_f, 1e-9), "fwd_spread_s": max(f) - min(f),
            "fwd_bwd_spread_s": max(fb) - min(fb), "reps": reps, "device": torch.cuda.get_device_name(device)
            if cuda else platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "wall_s": time.perf_counter() - t_start}


def add_measured_blocks(hw, shapes, out_path, progress=None, device=None, reps: int = 5) -> tuple:
    """Measure the ``shapes`` (BlockShape) the profile ``hw`` has no block for, on this device, and write the
    profile with them to ``out_path`` after each one (an interrupted run keeps what it measured: run it again and
    only the rest is measured). Float8 shapes off a GPU are skipped. Returns (profile, {key: wall seconds} of the
    ones measured now). ``progress(done, total, key)`` is called before each."""
    import dataclasses

    from ..hardware import atomic_write_json

    blocks = dict(hw.measured_blocks)
    cuda = (device or torch.device("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    todo = [s for s in dict.fromkeys(shapes) if s.key not in blocks and (cuda or not s.float8)]
    walls = {}
    for i, shape in enumerate(todo):
        if progress:
            progress(i, len(todo), shape.key)
        blocks[shape.key] = measure_block(shape, device, reps=reps)
        walls[shape.key] = blocks[shape.key]["wall_s"]
        hw = dataclasses.replace(hw, measured_blocks=dict(blocks))
        atomic_write_json(out_path, hw.to_dict())
    if progress:
        progress(len(todo), len(todo), "")
    return hw, walls
