"""The cost model's memory of torch's ring attention backward (``costmodel/ring.py``) against the ring attention
itself: torch's ``_templated_ring_attention_backward`` with the CPU kernel the executor's CP uses, run under
FakeTensorMode on a fake process group (CP rank 0 of c), every op output's storage counted while it lives."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parsim.costmodel.ring import ring_backward_extra_bytes  # noqa: E402


def _measured_ring_backward(heads: int, kv_heads: int, seq: int, head_dim: int, dtype, cp: int) -> tuple[int, int]:
    """(peak bytes allocated during the ring backward, bytes of its outputs) on CP rank 0."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from parsim.executor.cp import _cpu_backward, _cpu_forward
    from parsim.executor.trace import WAIT_TENSOR

    class Live(TorchDispatchMode):
        def __init__(self, known):
            super().__init__()
            self.cur = self.peak = 0
            self.seen = set(known)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is WAIT_TENSOR:  # as the executor's trace: a wait returns its input
                return args[0]
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                if st._cdata in self.seen or st.nbytes() == 0:
                    continue
                self.seen.add(st._cdata)
                self.cur += st.nbytes()
                self.peak = max(self.peak, self.cur)
                weakref.finalize(st, self._free, st.nbytes(), st._cdata)
            return out

        def _free(self, n, key):
            self.cur -= n
            self.seen.discard(key)

    dist.init_process_group("fake", rank=0, world_size=cp, store=FakeStore())
    balance = ring._cp_options.enable_load_balance
    ring._cp_options.enable_load_balance = True
    try:
        with FakeTensorMode():
            def make(h):  # (batch, heads, seq, head_dim) as a transpose, as the model's q, k, v reach SDPA
                return torch.randn(1, seq, h, head_dim, dtype=dtype).transpose(1, 2)

            q, k, v = make(heads), make(kv_heads), make(kv_heads)
            out, lse = ring._templated_ring_attention(dist.group.WORLD, 2, _cpu_forward, q, k, v, is_causal=True)
            g = torch.randn_like(out)
            mode = Live(t.untyped_storage()._cdata for t in (q, k, v, out, lse, g))
            with mode:
                res = ring._templated_ring_attention_backward(dist.group.WORLD, 2, _cpu_backward, g, "grad_out", q, k,
                                                              v, out, lse, True)
            outputs = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in res[:3]}
            return mode.peak, sum(outputs.values())
    finally:
        ring._cp_options.enable_load_balance = balance
        dist.destroy_process_group()


SEQ, HEAD_DIM = 64, 16  # the rank's local sequence
CASES = [(cp, h, kv, dt) for cp in (2, 3, 4, 8)
         for h, kv, dt in ((4, 4, "float32"), (4, 4, "bfloat16"), (8, 2, "bfloat16"), (8, 2, "float32"))]


@pytest.fixture(scope="module")
def measured():
    """Every case measured in one fresh interpreter (a process group of its own: another test's may be live)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600, check=True)
    return {tuple(c): tuple(v) for c, v in json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("cp,heads,kv_heads,dtype", CASES)
def test_ring_backward_peak_matches_torchs_ring_attention(measured, cp, heads, kv_heads, dtype):
    seq, head_dim = SEQ, HEAD_DIM
    peak, outputs = measured[(cp, heads, kv_heads, dtype)]
    b = 4 if dtype == "float32" else 2
    q, kv = seq * heads * head_dim, seq * kv_heads * head_dim
    assert outputs == b * (q + 2 * kv)  # what layers.backward_steps already counts
    extra = ring_backward_extra_bytes(q, kv, kv, seq * heads * 4.0, b, cp)
    assert float(extra) + outputs == peak


def test_no_ring_without_context_parallel():
    assert float(ring_backward_extra_bytes(4096, 1024, 1024, 1024, 2, 1)) == 0.0
    many = ring_backward_extra_bytes(np.full(3, 4096.0), 1024, 1024, 1024, 2, np.array([1, 2, 4]))
    assert many[0] == 0 and 0 < many[1] < many[2]


if __name__ == "__main__":
    import json

    print(json.dumps([[list(c), list(_measured_ring_backward(c[1], c[2], SEQ, HEAD_DIM, getattr(torch, c[3]), c[0]))]
                      for c in CASES]))
