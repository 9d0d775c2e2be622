"""A model of PyTorch's CUDA caching allocator: replays a stream of allocations and frees and says how much device
memory it would have *reserved* (what ``torch.cuda.memory_reserved`` and torchtitan's "max_reserved" report, and
what must fit on the device) beside what was *allocated* (the tensors' own bytes, which the cost model predicts).

Derived from ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x) and the CUDA-semantics notes of the PyTorch docs;
every constant below is the allocator's own [spec: allocator source]. Nothing is fitted.

* **Rounding.** Every request is rounded up to a multiple of 512 B (``kMinBlockSize``). Requests of at most 1 MiB
  (``kSmallSize``) go to the small pool, larger ones to the large pool.
* **Pools per stream.** A free block carries the stream it was allocated on and is reused only by requests on that
  stream: memory cached by FSDP2's all-gather copy-in stream or its reduce-scatter stream (where the sharded
  gradients are allocated) cannot serve the default stream's activations, and stays reserved while free.
* **Best fit.** A request takes the smallest free block of its (stream, pool) that is large enough (lowest address
  among equals) and splits it when the remainder is worth keeping: 512 B or more in the small pool and with
  expandable segments, more than 1 MiB in the large pool otherwise. Freed blocks merge with free neighbours.
* **Classic segments** (the default): when no cached block fits, a new segment is ``cudaMalloc``-ed: 2 MiB for small
  requests, 20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB. Segments are never returned
  during training (only ``empty_cache`` or an out-of-memory retry does that; neither is modelled).
* **Expandable segments** (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, set by torchtitan's launch script):
  one growing segment per (stream, pool); when no free block fits, the segment's trailing free block is extended
  by mapping more physical memory at its end, in 20 MiB pages (large pool) or 2 MiB pages (small pool). Freed
  memory stays mapped. A hole in the middle of a segment smaller than a later request therefore stays reserved
  while the segment grows past it.

Not modelled: cuBLAS / cuDNN workspaces and NCCL's own buffers (a few tens of MiB, some outside the allocator),
``max_split_size_mb``, ``roundup_power2_divisions``, CUDA-graph private pools, and the cross-stream delays of
``record_stream`` (FSDP2 avoids them by holding references, which the traced stream of frees already shows).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512  # [spec: allocator source, kMinBlockSize]
SMALL_SIZE_BYTES = 1 << 20  # [spec: allocator source, kSmallSize] largest request served by the small pool
SMALL_BUFFER_BYTES = 2 << 20  # [spec: allocator source, kSmallBuffer] small pool segment / page
LARGE_BUFFER_BYTES = 20 << 20  # [spec: allocator source, kLargeBuffer] segment for 1-10 MiB requests / page
MIN_LARGE_ALLOC_BYTES = 10 << 20  # [spec: allocator source, kMinLargeAlloc]
ROUND_LARGE_BYTES = 2 << 20  # [spec: allocator source, kRoundLarge]


def round_request(nbytes: int) -> int:
    """A request's size as the allocator serves it: a multiple of 512 B, at least 512 B."""
    return max(MIN_BLOCK_BYTES, -(-int(nbytes) // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_bytes(size: int) -> int:
    """The size of the classic segment ``cudaMalloc``-ed for a (rounded) request no cached block could serve."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


@dataclass
class _Block:
    addr: int
    size: int
    free: bool
    segment: int


@dataclass
class _Pool:
    """The blocks of one (stream, small / large) pool: every block by address, the free ones by (size, address)."""

    small: bool
    addrs: list = field(default_factory=list)  # every block's address, sorted
    free: list = field(default_factory=list)  # sorted (size, addr) of free blocks
    by_addr: dict = field(default_factory=dict)
    mapped_bytes: int = 0  # expandable: the mapped length of the pool's one segment
    next_addr: int = 0  # classic: where the next segment starts (segments never touch: a gap after each)

    def insert(self, b: _Block) -> None:
        bisect.insort(self.addrs, b.addr)
        self.by_addr[b.addr] = b
        if b.free:
            bisect.insort(self.free, (b.size, b.addr))

    def remove(self, b: _Block) -> None:
        del self.addrs[bisect.bisect_left(self.addrs, b.addr)]
        del self.by_addr[b.addr]
        if b.free:
            self.free.remove((b.size, b.addr))

    def neighbours(self, b: _Block) -> tuple[_Block | None, _Block | None]:
        i = bisect.bisect_left(self.addrs, b.addr)
        prev = self.by_addr[self.addrs[i - 1]] if i > 0 else None
        nxt = self.by_addr[self.addrs[i + 1]] if i + 1 < len(self.addrs) else None
        return (prev if prev is not None and prev.segment == b.segment else None,
                nxt if nxt is not None and nxt.segment == b.segment else None)

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.free, (size, -1))
        return self.by_addr[self.free[i][1]] if i < len(self.free) else None

    def last_block(self) -> _Block | None:
        return self.by_addr[self.addrs[-1]] if self.addrs else None


@dataclass(frozen=True)
class AllocatorReplay:
    """What a replayed stream of allocations did to the modelled allocator. ``reserved_peak_bytes``: the most device
    memory held at once (mapped or ``cudaMalloc``-ed segments); ``allocated_peak_bytes``: the most handed out to
    tensors at once (rounded blocks, what ``max_memory_allocated`` reports); ``reserved_by_stream_bytes``: each
    stream's share of the reserved memory at the end; ``requested_peak_bytes``: the most the tensors themselves
    asked for at once (unrounded)."""

    expandable_segments: bool
    reserved_peak_bytes: float
    allocated_peak_bytes: float
    requested_peak_bytes: float
    reserved_by_stream_bytes: dict

    def __post_init__(self):
        if self.reserved_peak_bytes < self.allocated_peak_bytes - 0.5:
            raise ValueError("reserved memory below allocated memory: the replay is inconsistent")


class CachingAllocator:
    """The caching allocator of one device (see the module docstring). ``malloc(key, nbytes, stream)`` and
    ``free(key)`` replay one event each; a key freed that was never allocated (a tensor older than the replay) is
    ignored."""

    def __init__(self, expandable_segments: bool = True):
        self.expandable = expandable_segments
        self.pools: dict[tuple[int, bool], _Pool] = {}
        self.live: dict[int, tuple[tuple[int, bool], _Block, int]] = {}
        self.reserved = self.allocated = self.requested = 0
        self.reserved_peak = self.allocated_peak = self.requested_peak = 0
        self._segments = 0

    def _pool(self, stream: int, small: bool) -> _Pool:
        key = (stream, small)
        if key not in self.pools:
            self.pools[key] = _Pool(small)
        return self.pools[key]

    def _new_block(self, pool: _Pool, size: int) -> _Block:
        """No cached block fits: grow the pool (a new classic segment, or the expandable segment's mapped end)."""
        if not self.expandable:
            seg = segment_bytes(size)
            self._segments += 1
            b = _Block(pool.next_addr, seg, True, self._segments)
            pool.next_addr += seg + MIN_BLOCK_BYTES  # a gap: blocks of different segments never merge
            pool.insert(b)
            self.reserved += seg
            return b
        page = SMALL_BUFFER_BYTES if pool.small else LARGE_BUFFER_BYTES
        last = pool.last_block()
        tail = last if last is not None and last.free else None
        need = size - (tail.size if tail is not None else 0)
        grow = -(-need // page) * page
        pool.mapped_bytes += grow
        self.reserved += grow
        if tail is not None:
            pool.remove(tail)
            tail.size += grow
            pool.insert(tail)
            return tail
        b = _Block(pool.mapped_bytes - grow, grow, True, 0)
        pool.insert(b)
        return b

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> None:
        size = round_request(nbytes)
        small = size <= SMALL_SIZE_BYTES
        pool = self._pool(stream, small)
        b = pool.best_fit(size) or self._new_block(pool, size)
        pool.remove(b)
        rest = b.size - size
        if rest >= MIN_BLOCK_BYTES and (small or self.expandable or rest > SMALL_SIZE_BYTES):
            pool.insert(_Block(b.addr + size, rest, True, b.segment))
            b.size = size
        b.free = False
        pool.insert(b)
        self.live[key] = ((stream, small), b, int(nbytes))
        self.allocated += b.size
        self.requested += int(nbytes)
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.requested_peak = max(self.requested_peak, self.requested)

    def free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is None:
            return
        pool_key, b, nbytes = entry
        pool = self.pools[pool_key]
        self.allocated -= b.size
        self.requested -= nbytes
        pool.remove(b)
        b.free = True
        pool.insert(b)
        prev, nxt = pool.neighbours(b)
        for other in (nxt, prev):
            if other is not None and other.free:
                pool.remove(b)
                pool.remove(other)
                b = _Block(min(b.addr, other.addr), b.size + other.size, True, b.segment)
                pool.insert(b)

    def result(self) -> AllocatorReplay:
        by_stream: dict[str, float] = {}
        for (stream, _small), pool in self.pools.items():
            held = pool.mapped_bytes if self.expandable else sum(b.size for b in pool.by_addr.values())
            by_stream[str(stream)] = by_stream.get(str(stream), 0.0) + float(held)
        return AllocatorReplay(self.expandable, float(self.reserved_peak), float(self.allocated_peak),
                               float(self.requested_peak), by_stream)


def replay(events, expandable_segments: bool = True) -> AllocatorReplay:
    """Replay ``events``: ``(+1, key, nbytes, stream)`` allocates, ``(-1, key, 0, 0)`` frees."""
    alloc = CachingAllocator(expandable_segments)
    for kind, key, nbytes, stream in events:
        if kind > 0:
            alloc.malloc(key, nbytes, stream)
        else:
            alloc.free(key)
    return alloc.result()
