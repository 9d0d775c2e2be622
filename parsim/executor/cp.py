"""Context parallel as torchtitan runs it, on CUDA and on CPU.

torchtitan wraps every forward and backward in ``torch.distributed.tensor.experimental.context_parallel(cp_mesh,
buffers=[inputs, labels, *freqs_cis], buffer_seq_dims=[1, 1, 0...], no_restore_buffers={inputs, labels})`` with
the K/V rotation ``"allgather"`` (its default ``context_parallel_rotate_method``). The context shards the buffers
along the sequence in place with torch's head-tail load balancer (rank r keeps chunks r and 2 cp - 1 - r of 2 cp),
patches ``F.scaled_dot_product_attention`` to wrap q, k, v into DTensors sharded on dim 2 over the CP mesh, and
routes the SDPA ops to torch's ring-attention handlers (``_templated_ring_attention`` forward: one all-gather of
[K, V] per call, each step's partial output merged in fp32; ``_templated_ring_attention_backward``: the same
all-gather, and the [dK, dV] partial sums passed round the ring by ``cp`` permutes (all-to-all) in fp32).

torch registers those handlers for the CUDA SDPA kernels only (flash, efficient, cuDNN). On CPU the same SDPA call
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no handler, so CP would not run.
``cpu_ring_attention()`` adds handlers for the CPU kernel and its backward that call the **same** torch ring
functions with the CPU kernel as the per-step op (its outputs are (out, logsumexp) with the same layouts as the
CUDA flash kernel's first two, which is all the ring code reads). The collectives, the merge, the load balancing
and the buffers' sharding are torch's own code; only the per-step attention kernel differs from a GPU's.
"""

from __future__ import annotations

import contextlib

import torch

aten = torch.ops.aten
SEQ_DIM = 2  # q, k, v are (batch, heads, seq, head_dim) when they reach SDPA
ROTATE_METHOD = "allgather"  # torchtitan's default context_parallel_rotate_method


def _cpu_forward(query, key, value, is_causal, dropout_p=0.0, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)


def _cpu_backward(grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp,
                                                                     dropout_p, is_causal, scale=scale)


def _cpu_ring_handler(op_call, args, kwargs):
    """DTensor custom-op handler for the CPU flash SDPA kernel and its backward under CP: local tensors through
    torch's ring attention over the CP group, the results sharded on the sequence as the inputs were."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    spec = next(a for a in args if isinstance(a, DTensor))._spec
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    la, lk = list(info.local_args), dict(info.local_kwargs)
    group = spec.mesh.get_group()
    if op_call == aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v = la[:3]
        dropout_p = la[3] if len(la) > 3 else lk.get("dropout_p", 0.0)
        causal = la[4] if len(la) > 4 else lk.get("is_causal", False)
        res = ring._templated_ring_attention(group, SEQ_DIM, _cpu_forward, q, k, v, is_causal=causal,
                                             dropout_p=dropout_p, scale=lk.get("scale"))
    else:
        g, q, k, v, out, lse, dropout_p, causal = la[:8]
        res = ring._templated_ring_attention_backward(group, SEQ_DIM, _cpu_backward, g, "grad_out", q, k, v, out, lse,
                                                      causal, dropout_p=dropout_p, scale=lk.get("scale"))
    return tuple(DTensor.from_local(t, spec.mesh, spec.placements, run_check=False) for t in res)


@contextlib.contextmanager
def cpu_ring_attention():
    """Route the CPU flash SDPA kernel (forward and backward) to torch's ring attention while active."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    ops = (aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    before = {op: handlers.get(op) for op in ops}
    for op in ops:
        handlers[op] = _cpu_ring_handler
    try:
        yield
    finally:
        for op, h in before.items():
            if h is None:
                handlers.pop(op, None)
            else:
                handlers[op] = h


def cp_context(plan, meshes, parts, tokens: torch.Tensor | None, labels: torch.Tensor | None):
    """The context a CP step runs in (forward and backward inside it), as torchtitan builds it; a no-op for cp 1.
    ``tokens`` / ``labels`` (None on pipeline stages without them) are sharded in place and not restored; each
    part's RoPE table is sharded for the step and restored after it."""
    if plan.cp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(ROTATE_METHOD)
    own = [t for t in (tokens, labels) if t is not None]
    buffers = own + [m.rope for m in parts]
    dims = [1] * len(own) + [0] * len(parts)
    stack = contextlib.ExitStack()
    if meshes.cp.device_type == "cpu":
        stack.enter_context(cpu_ring_attention())
    stack.enter_context(context_parallel(meshes.cp, buffers=buffers, buffer_seq_dims=dims,
                                         no_restore_buffers=set(own)))
    return stack
