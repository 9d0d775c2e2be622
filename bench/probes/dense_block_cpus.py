"""tiny's dense block timed as the profiler times it (``measure_block``: a fresh block, 2 warm-ups, 5 repetitions),
``n`` times each pinned to CPU 0, pinned to CPU 1 and unpinned, interleaved: (forward ms, backward ms).

    python bench/probes/dense_block_cpus.py [n]
"""

import os
import statistics as st
import sys

import torch

from parsim.blockshape import BlockShape
from parsim.profiler.blocks import measure_block

torch.set_num_threads(1)
shape = BlockShape(d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768, n_experts=0, top_k=0, d_ff_expert=0,
                   d_ff_shared=0, micro_batch=1, seq_len=256, dtype="float32", compile=False, float8=False,
                   mlp="swiglu", norm="rmsnorm", qk_norm=False, bias=False)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
out: dict[str, list] = {"cpu0": [], "cpu1": [], "any": []}
for _ in range(n):
    for name, cpus in (("cpu0", {0}), ("cpu1", {1}), ("any", {0, 1})):
        os.sched_setaffinity(0, cpus)
        m = measure_block(shape)
        out[name].append((round(m["fwd_s"] * 1e3, 1), round(m["bwd_s"] * 1e3, 1)))
os.sched_setaffinity(0, {0, 1})
for k, v in out.items():
    print(k, v, "fwd median", st.median(a for a, _ in v), "bwd median", st.median(b for _, b in v))
