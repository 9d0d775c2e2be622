"""At tiny's block shape (d 256, 4 layers): FSDP2 (the executor's apply_fsdp), its twin (the framework probe's:
the same collectives, blocking, on buffers made once) and the plain stack (no collectives), interleaved; medians
(ms) of one forward + backward on 2 gloo ranks:

    torchrun --standalone --nproc-per-node 2 bench/probes/fsdp_three_forms.py SEQ REPS
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

from parsim.executor.model import rope_cache
from parsim.profiler import frameworks as F


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    seq = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    layers, d = 4, 256
    fsdp, twin, nbytes, calls = F._fsdp_pair(d, layers, seq, torch.float32, torch.device("cpu"), "default")
    spec = F._spec(d, layers)
    plain = F._Stack(spec)
    rope = rope_cache(spec.head_dim, seq)
    x = torch.randn(1, seq, d, requires_grad=True)

    def bare():
        plain(x, rope).sum().backward()

    def once(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    forms = {"fsdp": fsdp, "twin": twin, "plain": bare}
    for _ in range(2):
        for fn in forms.values():
            once(fn)
    t: dict = {k: [] for k in forms}
    for _ in range(reps):
        for k, fn in forms.items():
            t[k].append(once(fn))
    m = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    if dist.get_rank() == 0:
        print(f"seq {seq} unit {nbytes / 1e6:.2f} MB calls/unit {calls}: "
              + " ".join(f"{k} {v:.1f}" for k, v in m.items()),
              f"| fsdp-plain {m['fsdp'] - m['plain']:.1f} twin-plain {m['twin'] - m['plain']:.1f} "
              f"fsdp-twin {m['fsdp'] - m['twin']:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
