"""Reserved memory: what PyTorch's CUDA caching allocator holds for a rank's allocations at their peak, the number
torchtitan reports ("max_reserved") and the one that must fit on the device.

``parsim.allocator`` replays an allocation stream through a model of the allocator; replays of the executor's
full-scale traces (``parsim trace``: every allocation and free, each on the stream FSDP2's own code made current)
show where reserved exceeds allocated with expandable segments (torchtitan's launch setting), and this module
predicts those terms from the plan without a trace [derived from the allocator's rules and FSDP2's stream use;
checked against replays in tests/test_allocator.py and bench/differential.py]:

* **All-gather stream pool** (``all_gather_stream``). FSDP2 allocates each unit's flat all-gather buffer on its
  all-gather copy-in stream. The allocator reuses a freed block only for requests on the stream that allocated it,
  so that stream keeps its own pool, whose size is the most buffers alive at once: a unit's buffer and the next
  one's (forward frees the previous unit's buffer after the next unit's copy-out; backward prefetches one unit
  ahead) -- the embedding or the [norm, output] unit beside a block, or two blocks.
* **Reduce-scatter stream pool** (``reduce_scatter_stream``). Each unit's reduce-scatter output, which becomes its
  sharded gradient (fp32 here), is allocated on the reduce-scatter stream; the gradients live from their unit's
  reduce to the optimizer's ``zero_grad`` and their blocks stay cached in that pool for the next step's forward,
  so the pool holds every sharded gradient all step. Where the output is converted (reduce dtype below fp32) or
  added into an existing gradient (gradient accumulation without PP), one unit's output more is transient there.
* **Default-stream holes** (``default_stream_holes``). torch's fp32 cross-entropy (not fused) frees the bf16
  logits right before its backward allocates tensors twice their size (tp = 1: the nll and log-softmax gradients;
  tp > 1, loss parallel: ``zeros_like``, ``exp`` and their sum over the local vocabulary shard, fp32): the freed
  block cannot serve them and stays reserved while the segment grows past it. Counted where the loss's moment is
  the peak ("end of forward"); later, smaller requests may reuse the hole (loss parallel's hole was seen once the
  trace counted what its handlers allocate: llama3-vocabulary 2-layer model, FSDP 2 x TP 2, 0.55 GB).
* the rest (``default_stream_allocated``) is the allocated peak less what the other streams hold at that moment.
  Megatron-style plans (distributed optimizer, TE layers) have no FSDP2 streams: their gradients sit in one
  contiguous buffer allocated once, and everything is the default stream's.
* every pool is mapped in whole pages: 20 MiB, or 2 MiB where all its requests are at most 1 MiB (small pool).

Not predicted (seen in replays): smaller holes left by one block's transients in the default stream, 0.5-0.6 GiB
on llama3-8b-shaped plans at 8k tokens (under 1% of their reserved memory; about 20 MiB on the tiny preset, 20% of
its reserved memory there), the all-gather pool's own holes (0.1-0.2 GiB: the embedding's freed buffer too small
for the [norm, output] unit's) and the classic (non-expandable) allocator's segment rounding. CPU profiles (gloo)
have no caching allocator: there reserved is the allocated peak.
"""

from __future__ import annotations

import numpy as np

from ..allocator import LARGE_BUFFER_BYTES, SMALL_BUFFER_BYTES, SMALL_SIZE_BYTES
from ..codec import PlanBatch
from . import comm as C
from .memory import PHASES

FWD, OPT = PHASES[0], PHASES[-1]
RESERVED_KEYS = ("default_stream_allocated", "default_stream_holes", "all_gather_stream", "reduce_scatter_stream")


def _pages(x, largest_request=np.inf) -> np.ndarray:
    """An expandable segment's mapped size for ``x`` bytes: whole 20 MiB pages in the large pool, 2 MiB pages where
    every request is at most 1 MiB (the small pool)."""
    page = np.where(np.asarray(largest_request) <= SMALL_SIZE_BYTES, SMALL_BUFFER_BYTES, LARGE_BUFFER_BYTES)
    return np.ceil(np.asarray(x, dtype=float) / page) * page


def _all_gather_pool(b: PlanBatch, rv: C.RankView, wrapped, pb) -> tuple:
    """(the most flat all-gather buffers alive at once on the copy-in stream: two adjacent units, the largest
    buffer), bytes."""
    n_lay = np.asarray(rv.n_layers, dtype=float)
    blocks = sum(rv.n_of[k] * (b.fsdp * rv.pshard[k][0] + b.efsdp * rv.pshard[k][1]) for k in rv.kinds)
    blk = np.where(n_lay > 0, blocks / np.maximum(n_lay, 1.0), 0.0) * pb
    emb = b.fsdp * rv.emb_shard * pb
    out = b.fsdp * (rv.norm_shard + rv.outw_shard) * pb
    pairs = np.maximum.reduce([np.where(rv.has_emb, emb + blk, 0.0), np.where(rv.has_out, out + blk, 0.0),
                               np.where(n_lay >= 2, 2.0 * blk, blk)])
    return np.where(wrapped, pairs, 0.0), np.maximum.reduce([np.where(rv.has_emb, emb, 0.0),
                                                             np.where(rv.has_out, out, 0.0), blk])


def reduce_scatter_pool(b: PlanBatch, rv: C.RankView, wrapped, p_shard, rb) -> tuple:
    """(the reduce-scatter stream's pool: every fp32 sharded gradient, plus one unit's output in reduce dtype where
    outputs are converted or accumulated into existing gradients; the largest unit's output), bytes."""
    unit_shards = [rv.emb_shard, rv.norm_shard + rv.outw_shard] + [rv.pshard[k][0] + rv.pshard[k][1]
                                                                   for k in rv.kinds]
    largest = np.maximum.reduce([np.broadcast_to(np.asarray(u, dtype=float), (len(b),)) for u in unit_shards])
    transient = ((rb < 4) | ((b.grad_accum > 1) & (b.pp == 1))) * largest * rb
    return np.where(wrapped, p_shard * 4.0 + transient, 0.0), largest * 4.0


def fsdp_streams(b: PlanBatch) -> np.ndarray:
    """Plans whose FSDP2 wrapping has its streams' pools: FSDP2 wraps the model, where Megatron-style plans
    (distributed optimizer, TE layers: cost-model-only Megatron semantics) keep their gradients in one contiguous
    buffer on the default stream instead."""
    return ((b.fsdp > 1) | (b.efsdp > 1) | (b.dp_replicate > 1)) & ~b.zero1 & ~b.te_layers


def reserved_breakdown(b: PlanBatch, rv: C.RankView, logits, act_b, p_shard, peak, mb: dict, phase_idx,
                       allocator: bool) -> dict:
    """One rank's reserved memory at its allocated peak, itemized by RESERVED_KEYS (arrays over the plans; they
    sum to the reserved total). ``logits``: the rank's logits per microbatch; ``mb``: the allocated peak's
    breakdown; ``phase_idx``: its phase (index into PHASES); ``allocator``: the device has CUDA's caching
    allocator (else reserved = allocated)."""
    n = len(b)
    z = np.zeros(n)
    if not allocator:
        return {"default_stream_allocated": np.asarray(peak, dtype=float) * np.ones(n),
                "default_stream_holes": z, "all_gather_stream": z, "reduce_scatter_stream": z}
    pb, rb = b.param_bytes.astype(float), b.reduce_bytes.astype(float)
    wrapped = fsdp_streams(b)
    ag, ag_largest = _all_gather_pool(b, rv, wrapped, pb)
    rs, rs_largest = reduce_scatter_pool(b, rv, wrapped, p_shard, rb)
    at_opt = phase_idx == PHASES.index(OPT)
    # gradients at the peak on the reduce-scatter stream: the sharded ones (without PP, or at the optimizer
    # step); under PP before the optimizer they are the unsharded accumulators, on the default stream
    rs_now = np.where(wrapped & ((b.pp == 1) | at_opt), np.minimum(mb.get("gradients", z), p_shard * 4.0), 0.0)
    ag_now = np.where(wrapped, np.minimum(mb.get("fsdp_gather_buffers", z), ag), 0.0)
    hole = np.where(rv.has_out & ~b.fused_loss & (act_b < 4) & (phase_idx == PHASES.index(FWD)),
                    logits * act_b, 0.0)
    default = peak - rs_now - ag_now
    return {"default_stream_allocated": default, "default_stream_holes": _pages(default + hole) - default,
            "all_gather_stream": _pages(ag, ag_largest), "reduce_scatter_stream": _pages(rs, rs_largest)}
