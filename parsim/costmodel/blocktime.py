"""The composed time of one block at a local shape (``parsim.blockshape.BlockShape``): what the cost model's curves
say one layer and one microbatch of that shape costs, forward and backward, on a profile, with any measured block
of the profile left out. ``parsim.remeasure`` sets it beside a measurement of the same shape (the stand-in ratio).

The block is costed as the one-layer model of its local widths (``BlockShape.local_spec``) under a plan of one
rank with the shape's micro batch, sequence, dtype and compile: exactly what the profiler builds and times."""

from __future__ import annotations

import dataclasses

from ..blockshape import BlockShape
from ..codec import encode
from ..hardware import HardwareProfile
from ..plan import Plan
from .compute import block_overheads, layer_costs
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
