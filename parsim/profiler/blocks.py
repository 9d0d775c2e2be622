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

from ..blockshape import BlockShape, HeadShape

# [assumed] calls per timed repetition on a GPU: a step issues layer after layer while the device is still busy,
# so a block there is timed in that steady state: ``STEADY_CHAIN`` calls back to back, one synchronize, seconds
# divided by the calls. One call timed alone pays the host's issue time wherever the device waits for it (an
# H100, llama3-8b block on 4096 tokens: 13.0 ms alone against the ~10 ms its kernels take in a 6-layer step;
# bench/reports/gpu-acceptance/2026-11-28, bench/gpu_dispatch.py). On CPU the host runs the kernels itself: one call.
STEADY_CHAIN = 8
FLOAT8_RECIPE = "tensorwise"  # what a float8 block's linears run (``executor.float8``), recorded with its times


def steady_times(fn, reps: int, cuda: bool) -> list[float]:
    """Seconds per call of ``fn``, ``reps`` times: on a GPU ``STEADY_CHAIN`` calls per synchronize, divided."""
    chain = STEADY_CHAIN if cuda else 1
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(chain):
            fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / chain)
    return out


class _TokenShareBlock(torch.nn.Module):
    """A MoE block as one rank of EP with whole experts under TP runs it (``blockshape.BlockShape.moe_token_div``,
    ``executor.model.MoE._tp_forward``): attention, the norm before the experts and the shared experts over all
    T tokens (the norm runs over T / tp under sequence parallel: as for every block, measured without SP), the
    router, the routed experts and the residual over the rank's contiguous T / div. Collectives are not in it
    (the cost model's)."""

    def __init__(self, blk, div: int):
        super().__init__()
        self.blk, self.div = blk, div

    def forward(self, x, rope):
        blk = self.blk
        h = x + blk.attention(blk.attention_norm(x), rope)
        d = h.shape[-1]
        n = h.shape[0] * h.shape[1] // self.div
        hn = blk.ffn_norm(h)
        y = h.reshape(-1, d)[:n] + blk.moe._routed(hn.reshape(-1, d)[:n], blk.moe.router.weight)
        if blk.moe.shared_experts is not None:
            y = y + blk.moe.shared_experts(hn).reshape(-1, d)[:n]
        return y


def measure_block(shape: BlockShape, device: torch.device | None = None, reps: int = 5, warmup: int = 2,
                  threads: int | None = 1) -> dict:
    """Forward and backward seconds of one block of ``shape`` (medians of ``reps``, after ``warmup``)."""
    from ..executor.float8 import convert_to_float8
    from ..executor.model import Block, rope_cache

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if shape.float8 and not cuda:
        raise ValueError("float8 blocks need a GPU with float8 GEMMs")
    if not cuda and threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, shape.dtype)
    spec = shape.local_spec()
    blk = Block(spec, 0)
    if shape.moe and shape.d_ff_shared:  # the shared experts at their exact width on the rank (local_spec)
        from ..executor.model import FeedForward

        blk.moe.shared_experts = FeedForward(spec, shape.d_ff_shared)
    blk = blk.to(device=device, dtype=dtype)
    if shape.float8:  # torchao's tensorwise float8 linears (a float8 block was timed in bf16 before)
        convert_to_float8(blk)
    if shape.compile:
        # a fresh compile per shape: every block shares Block.forward's code object, and past dynamo's recompile
        # limit (8) a further shape silently runs eager (seen measuring 14 compiled shapes in one process)
        torch._dynamo.reset()
    if shape.moe_token_div > 1:
        blk = _TokenShareBlock(blk, shape.moe_token_div)
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
    f = steady_times(fwd, reps, cuda)
    fb = steady_times(fwd_bwd, reps, cuda)
    t_f, t_fb = statistics.median(f), statistics.median(fb)
    return {"fwd_s": t_f, "bwd_s": max(t_fb - t_f, 1e-9), "fwd_spread_s": max(f) - min(f),
            "fwd_bwd_spread_s": max(fb) - min(fb), "reps": reps, "chain": STEADY_CHAIN if cuda else 1,
            "device": torch.cuda.get_device_name(device)
            if cuda else platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "wall_s": time.perf_counter() - t_start, **({"float8_recipe": FLOAT8_RECIPE} if shape.float8 else {})}


def measure_head(shape: HeadShape, device: torch.device | None = None, reps: int = 5, warmup: int = 2,
                 threads: int | None = 1) -> dict:
    """The model's ends at ``shape``, with the executor's modules and loss, timed as ``measure_block`` times a
    block: the token embedding forward (``emb_fwd_s``) and backward into its dense gradient (``emb_bwd_s``), and
    the final norm, output projection and loss forward (``out_fwd_s``) and backward (``out_bwd_s``)."""
    from ..executor.loss import loss_sum
    from ..executor.model import RMSNorm

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if not cuda and threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, shape.dtype)
    emb = torch.nn.Embedding(shape.vocab, shape.d_model).to(device=device, dtype=dtype)
    norm = (RMSNorm if shape.norm == "rmsnorm" else torch.nn.LayerNorm)(shape.d_model).to(device=device, dtype=dtype)
    out = torch.nn.Linear(shape.d_model, shape.vocab, bias=False).to(device=device, dtype=dtype)
    tokens = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq_len), device=device)
    target = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq_len), device=device)
    h = torch.randn(shape.micro_batch, shape.seq_len, shape.d_model, device=device, dtype=dtype, requires_grad=True)
    g_emb = torch.randn(shape.micro_batch, shape.seq_len, shape.d_model, device=device, dtype=dtype)
    runs = {"emb_f": lambda: emb(tokens), "emb_fb": lambda: emb(tokens).backward(g_emb),
            "out_f": lambda: loss_sum(out(norm(h)), target, shape.fused_loss),
            "out_fb": lambda: loss_sum(out(norm(h)), target, shape.fused_loss).backward()}
    t_start = time.perf_counter()
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    t = {k: steady_times(fn, reps, cuda) for k, fn in runs.items()}
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"emb_fwd_s": med["emb_f"], "emb_bwd_s": max(med["emb_fb"] - med["emb_f"], 1e-9),
            "out_fwd_s": med["out_f"], "out_bwd_s": max(med["out_fb"] - med["out_f"], 1e-9),
            "out_fwd_spread_s": max(t["out_f"]) - min(t["out_f"]),
            "out_fwd_bwd_spread_s": max(t["out_fb"]) - min(t["out_fb"]), "reps": reps,
            "chain": STEADY_CHAIN if cuda else 1,
            "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": time.perf_counter() - t_start}


def measure_shape(shape, device=None, reps: int = 5) -> dict:
    """A block (``BlockShape``) or the model's ends (``HeadShape``), measured."""
    if isinstance(shape, HeadShape):
        return measure_head(shape, device, reps=reps)
    return measure_block(shape, device, reps=reps)


def is_current(entry: dict, shape) -> bool:
    """Whether a profile's measurement of ``shape`` was made as this profiler makes it: a float8 block measured
    before its linears were converted (no ``float8_recipe``) was a bf16 block under a float8 key, and is measured
    again."""
    return not getattr(shape, "float8", False) or entry.get("float8_recipe") == FLOAT8_RECIPE


def add_measured_blocks(hw, shapes, out_path, progress=None, device=None, reps: int = 5) -> tuple:
    """Measure the ``shapes`` (BlockShape, HeadShape) the profile ``hw`` has no current measurement of
    (``is_current``), on this device,
    and write the profile with them to ``out_path`` after each one (an interrupted run keeps what it measured: run
    it again and only the rest is measured). Float8 shapes off a GPU are skipped. Returns (profile, {key: wall
    seconds} of the ones measured now). ``progress(done, total, key)`` is called before each."""
    import dataclasses

    from ..hardware import atomic_write_json

    blocks = dict(hw.measured_blocks)
    cuda = (device or torch.device("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    todo = [s for s in dict.fromkeys(shapes)
            if (s.key not in blocks or not is_current(blocks[s.key], s)) and (cuda or not getattr(s, "float8", False))]
    walls = {}
    for i, shape in enumerate(todo):
        if progress:
            progress(i, len(todo), shape.key)
        blocks[shape.key] = measure_shape(shape, device, reps=reps)
        walls[shape.key] = blocks[shape.key]["wall_s"]
        hw = dataclasses.replace(hw, measured_blocks=dict(blocks))
        atomic_write_json(out_path, hw.to_dict())
    if progress:
        progress(len(todo), len(todo), "")
    return hw, walls
