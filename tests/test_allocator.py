"""The model of CUDA's caching allocator (parsim.allocator), the reserved memory the cost model predicts from it
(costmodel/reserved.py), and the two compared on a traced allocation stream."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parsim.allocator import (
    LARGE_BUFFER_BYTES,
    MIN_BLOCK_BYTES,
    SMALL_BUFFER_BYTES,
    CachingAllocator,
    replay,
    round_request,
    segment_bytes,
)

MiB = 2**20


def test_requests_round_to_512_bytes_and_classic_segments_follow_the_allocator_sizes():
    assert round_request(1) == MIN_BLOCK_BYTES and round_request(513) == 1024 and round_request(1024) == 1024
    assert segment_bytes(1 * MiB) == SMALL_BUFFER_BYTES  # small pool: 2 MiB segments
    assert segment_bytes(1 * MiB + 512) == LARGE_BUFFER_BYTES  # 1-10 MiB: 20 MiB segments
    assert segment_bytes(11 * MiB) == 12 * MiB  # larger: rounded up to 2 MiB


def test_a_freed_block_serves_a_later_request_of_its_stream_only():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(1, 100 * MiB, stream=0)
    a.free(1)
    a.malloc(2, 100 * MiB, stream=0)  # reused: nothing new mapped
    assert a.reserved == 100 * MiB
    a.malloc(3, 100 * MiB, stream=1)  # another stream's pool: mapped anew although 0's block is cached
    a.free(2)
    a.malloc(4, 100 * MiB, stream=1)  # stream 0's free block cannot serve it either
    r = a.result()
    assert r.reserved_by_stream_bytes == {"0": 100 * MiB, "1": 200 * MiB}
    assert r.reserved_peak_bytes == 300 * MiB and r.allocated_peak_bytes == 200 * MiB


def test_the_losss_freed_logits_leave_a_hole_its_backward_cannot_use():
    """torch's fp32 cross-entropy: bf16 logits L, fp32 copy 2L, log-softmax 2L; the copy and the logits are freed,
    then the backward allocates two 2L tensors: the first fits the 3L hole, the second does not, and what is left
    of the hole (L) stays reserved beside the 6L allocated."""
    L = 1000 * MiB
    events = [(1, 1, L, 0), (1, 2, 2 * L, 0), (1, 3, 2 * L, 0), (-1, 2, 0, 0), (-1, 1, 0, 0),
              (1, 4, 2 * L, 0), (1, 5, 2 * L, 0)]
    r = replay(events)
    assert r.allocated_peak_bytes == 6 * L and r.reserved_peak_bytes == 7 * L


def test_expandable_segments_grow_in_pages_and_extend_their_free_tail():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(1, 30 * MiB)
    assert a.reserved == 2 * LARGE_BUFFER_BYTES  # 40 MiB mapped for 30 MiB
    a.malloc(2, 15 * MiB)  # the 10 MiB tail is extended by one page
    assert a.reserved == 3 * LARGE_BUFFER_BYTES
    a.free(1)
    a.free(2)
    a.malloc(3, 60 * MiB)  # the merged free 60 MiB serve it
    assert a.reserved == 3 * LARGE_BUFFER_BYTES


def test_classic_segments_are_not_merged_across_segments():
    a = CachingAllocator(expandable_segments=False)
    a.malloc(1, 20 * MiB)
    a.malloc(2, 20 * MiB)
    a.free(1)
    a.free(2)
    a.malloc(3, 40 * MiB)  # two free 20 MiB segments side by side cannot serve 40 MiB: a new segment
    assert a.result().reserved_peak_bytes == 80 * MiB


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64 * MiB), st.integers(0, 2)), min_size=1, max_size=60),
       st.booleans())
def test_reserved_never_below_allocated_and_a_repeated_step_reuses_its_cache(ops, expandable):
    """Random steps of allocations and frees (everything freed at the end): reserved >= allocated >= requested
    at the peak, and replaying the same step again on the warm cache maps nothing more."""
    events, live, key = [], [], 0
    for is_free, nbytes, stream in ops:
        if is_free and live:
            events.append((-1, live.pop(nbytes % len(live)), 0, 0))
        else:
            key += 1
            live.append(key)
            events.append((1, key, nbytes, stream))
    events += [(-1, k, 0, 0) for k in live]
    a = CachingAllocator(expandable)
    for k, key_, n, s in events:
        a.malloc(key_, n, s) if k > 0 else a.free(key_)
    first = a.result()
    for k, key_, n, s in events:
        a.malloc(key_, n, s) if k > 0 else a.free(key_)
    second = a.result()
    assert first.reserved_peak_bytes >= first.allocated_peak_bytes >= first.requested_peak_bytes
    assert second.reserved_peak_bytes == first.reserved_peak_bytes
    assert a.allocated == 0


def test_predicted_reserved_memory_sums_and_fits_on_it():
    from parsim.costmodel import predict
    from parsim.hardware import load_profile
    from parsim.plan import Plan
    from parsim.spec import load_model

    spec = load_model("llama3-8b")
    plan = Plan(dp_shard=8, seq_len=8192, local_batch_size=2, ac="selective-op")
    p = predict(spec, plan, load_profile("h100-sxm-spec"))
    assert p.reserved_memory_bytes == pytest.approx(sum(p.reserved_breakdown_bytes.values()))
    assert p.reserved_memory_bytes > p.peak_memory_bytes
    # tp = 1, torch's loss: the bf16 logits' hole (2 x 8192 x 128256 x 2 B) is among the holes
    assert p.reserved_breakdown_bytes["default_stream_holes"] >= 2 * 8192 * 128256 * 2
    # every fp32 sharded gradient stays in the reduce-scatter stream's pool
    assert p.reserved_breakdown_bytes["reduce_scatter_stream"] >= 8.03e9 / 8 * 4
    assert p.fits == (p.reserved_memory_bytes <= load_profile("h100-sxm-spec").usable_memory_bytes)
    cpu = predict(spec, plan, load_profile("cpu-gloo-2"))  # no caching allocator on CPU
    assert cpu.reserved_memory_bytes == pytest.approx(cpu.peak_memory_bytes)


@pytest.mark.parametrize("plan_kw", [dict(dp_shard=4), dict(dp_shard=2, tp=2, sequence_parallel=True)])
def test_trace_replay_and_the_predicted_reserved_memory_agree(plan_kw):
    """Two sources: the executor's traced allocations (each on the stream FSDP2 made current) replayed through
    the allocator model, and the cost model's reserved terms, on a 2-layer model of llama3's vocabulary and a
    1024 width (the loss and the FSDP units matter as at full size). Seen: the prediction 1-3% under the replay
    (the holes of one block's transients and of the all-gather pool it leaves out); bound here at 5%."""
    import dataclasses

    from parsim.costmodel import predict
    from parsim.executor.trace import trace_in_subprocess
    from parsim.hardware import load_profile
    from parsim.plan import Plan
    from parsim.spec import load_model

    spec = dataclasses.replace(load_model("llama3-8b"), n_layers=2, d_model=1024, n_heads=8, n_kv_heads=2,
                               d_ff=3584, name="llama3-vocab-2x1024")
    plan = Plan(seq_len=4096, **plan_kw)
    m = trace_in_subprocess(spec, plan)
    assert m.status == "ok", m.error
    prov = m.provenance
    assert len(prov["reserved_by_stream_bytes_expandable"]) == 3  # default, all-gather copy-in, reduce-scatter
    assert m.reserved_peak_memory_bytes >= m.peak_memory_bytes
    p = predict(spec, plan, load_profile("h100-sxm-spec"))
    assert p.reserved_memory_bytes == pytest.approx(m.reserved_peak_memory_bytes, rel=0.05)
