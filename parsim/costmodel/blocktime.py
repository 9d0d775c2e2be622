"""The composed time of one block at a local shape (``parsim.blockshape.BlockShape``): what the cost model's curves
say one layer and one microbatch of that shape costs, forward and backward, on a profile, with any measured block
of the profile left out; and of the model's ends (``HeadShape``). ``parsim.remeasure`` sets it beside a measurement
of the same shape (the stand-in ratio).

The block is costed as the one-layer model of its local widths (``BlockShape.local_spec``) under a plan of one
rank with the shape's micro batch, sequence, dtype and compile: exactly what the profiler builds and times."""

from __future__ import annotations

import dataclasses

from ..blockshape import BlockShape, HeadShape
from ..codec import encode
from ..hardware import HardwareProfile
from ..plan import Plan
from ..units import DTYPE_BYTES
from .compute import block_overheads, curve_output_times, dtype_peak_flops, layer_costs
from .layers import Shapes


def composed_block_times(shape: BlockShape, hw: HardwareProfile) -> tuple[float, float]:
    """(forward s, backward s) of one block of ``shape`` from the profile's curves and per-layer overheads, with
    ``compute_scale`` 1 (as the profiler measures: one process, nothing beside it)."""
    spec = shape.local_spec()
    plan = Plan(seq_len=shape.seq_len, local_batch_size=shape.micro_batch, micro_batch_size=shape.micro_batch,
                param_dtype=shape.dtype, compile=shape.compile, float8=shape.float8)
    curves_only = dataclasses.replace(hw, measured_blocks={})
    b = encode([plan], curves_only.gpus_per_node)
    cost = layer_costs(spec, b, Shapes(spec, b), curves_only, shape.moe, overheads=block_overheads(curves_only),
                        compute_scale=1.0)
    return float(cost.fwd[0]), float(cost.bwd[0])


def composed_head_times(shape: HeadShape, hw: HardwareProfile) -> dict[str, float]:
    """Forward / backward seconds of the ends at ``shape``: the final norm + output projection + loss as the cost
    model's curves give them (``compute.curve_output_times``, the norm left out as there), and the token
    embedding, which the curves leave out of a step, as memory-bound traffic at the elementwise bandwidth
    [derived]: the forward gathers T rows of d (read and write, T x d x b bytes each), the backward zeroes the
    V x d gradient and scatter-adds T rows into it (V x d x b + 3 T x d x b). For the stand-in ratio only: what
    scales with the shape, not a prediction of the embedding."""
    act_b = float(DTYPE_BYTES[shape.dtype])
    tokens = float(shape.micro_batch * shape.seq_len)
    peak = float(dtype_peak_flops(hw, act_b))
    out_f, out_b = curve_output_times(hw, tokens * shape.vocab, shape.d_model, act_b, shape.fused_loss, peak)
    hbm = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency
    rows = tokens * shape.d_model * act_b
    return {"emb_fwd": 2.0 * rows / hbm, "emb_bwd": (shape.vocab * shape.d_model * act_b + 3.0 * rows) / hbm,
            "out_fwd": float(out_f), "out_bwd": float(out_b)}
