"""Memory of torch's ring attention backward (context parallel), for the op-level backward steps of ``layers``.

torch's ``_templated_ring_attention_backward`` (torch.distributed.tensor.experimental._context_parallel, all-gather
rotation of K and V, load-balanced causal attention, ``convert_to_f32``) allocates, on CP rank ``r = 0`` of ``c``
(the rank the model describes: every mesh coordinate 0), in this order [derived: the function's code, torch 2.13]:

1. fp32 zeros for dQ, dK, dV (``zeros_like``: dK, dV keep K's and V's strides, which are a transpose's);
2. K and V made contiguous; their concatenation [K, V]; its all-gather over the ring (``c`` x [K, V]);
3. step 0: the kernel's dQ, dK, dV (full local q, k, v) added into the accumulators; the strided dK, dV flattened
   (copies) and concatenated (fp32); the concatenation permuted to the next rank (a new buffer);
4. steps i = 1 .. c - 1 (rank 0 always takes the "i > rank" branch: the second half of q against whole k, v):
   a new [K, V] concatenation replaces the last (not on the last step); the logsumexp's second half made
   contiguous; step 0's contiguous K, V dropped; the kernel's outputs (dQ/2, dK, dV) replace the previous ones;
   the last fp32 concatenation and the buffer before last (step 1: the zero accumulators) dropped; dK, dV (views
   of the received buffer, updated in place) concatenated and permuted again; dQ's second half updated into a new
   fp32 tensor (``_partial_update`` concatenates);
5. dQ and the received dK, dV cast back to the activation dtype (copies unless it is fp32).

What is left at the end is the three gradients in the activation dtype, which ``layers.backward_steps`` already
counts; ``ring_backward_extra_bytes`` is the rest of the peak: the transient on top of them at the SDPA step.
Checked allocation by allocation against the executor's ring attention under FakeTensorMode with a fake process
group (c = 2, 3, 4, 8; fp32 and bf16; with and without GQA): equal to the byte, but for 384 B on a 2-head model.
Other ranks' peaks differ by the halves they compute (up to a few K / V sizes), and a real collective keeps its
input alive until it completes, which a fake process group does not. Whole-step traces see these buffers since
the trace's tracker counts what DTensor's handlers allocate (``executor.measure.PeakTracker.observe``); before,
a step's trace missed them and 19 CP plans of the differential looked up to 17% over-predicted.
"""

from __future__ import annotations

import numpy as np

ACCUM_BYTES = 4.0  # torch's ring attention accumulates in fp32 (_cp_options.convert_to_f32 = True) [derived]


def ring_backward_extra_bytes(q_elems, k_elems, v_elems, lse_bytes, act_bytes, cp) -> np.ndarray:
    """Peak of the ring attention backward on CP rank 0 above its outputs (bytes; 0 where cp == 1): element counts
    of the rank's local q, k, v and bytes of its fp32 logsumexp per microbatch; ``act_bytes``: q, k, v's dtype."""
    f, b = ACCUM_BYTES, np.asarray(act_bytes, dtype=float)
    c = np.asarray(cp, dtype=float)
    q, kv = np.asarray(q_elems, dtype=float), np.asarray(k_elems, dtype=float) + np.asarray(v_elems, dtype=float)
    lse = np.asarray(lse_bytes, dtype=float)
    state = {"cur": np.zeros(np.broadcast(q, kv, c).shape)}
    state["peak"] = state["cur"].copy()

    def add(x):
        state["cur"] = state["cur"] + x
        state["peak"] = np.maximum(state["peak"], state["cur"])

    def free(x):
        state["cur"] = state["cur"] - x

    add(f * (q + kv))  # 1. zero accumulators
    add(b * kv)  # 2. contiguous K, V
    add(b * kv)
    add(c * b * kv)  # [K, V] and its all-gather
    add(b * (q + kv))  # 3. step 0's gradients
    add(f * kv)  # flattened strided dK, dV
    add(f * kv)  # their concatenation
    free(f * kv)
    add(f * kv)  # permuted
    prev_out = b * (q + kv)
    # steps 3 .. c - 2 repeat step 2 exactly (their changes cancel and they start from the same totals): steps 1,
    # 2 and the last (c - 1) reach every moment [derived]
    for i in (np.ones_like(c), np.full_like(c, 2.0), np.where(c - 1 >= 3, c - 1, c)):
        on = np.where(i < c, 1.0, 0.0)
        mid = on * np.where(i != c - 1, 1.0, 0.0)
        add(mid * b * kv)  # 4. the next [K, V] concatenation replaces the last
        free(mid * b * kv)
        add(on * lse / 2)  # the logsumexp's second half, contiguous
        free(np.where(i >= 2, on * lse / 2, 0.0))
        free(np.where(i == 1, on * b * kv, 0.0))  # step 0's contiguous K, V
        out = b * (q / 2 + kv)
        add(on * out)  # this step's gradients replace the last
        free(on * prev_out)
        prev_out = np.where(on > 0, out, prev_out)
        free(on * f * kv)  # the last concatenation of dK, dV
        free(on * f * kv)  # the accumulators (step 1) / the buffer before last
        add(on * f * kv)  # concatenated and permuted again
        add(on * f * kv)
        add(on * f * q)  # dQ's second half updated into a new tensor
        free(on * f * q)
    cast = np.where(b != f, 1.0, 0.0)
    add(cast * b * q)  # 5. cast back
    add(cast * b * kv)
    extra = state["peak"] - b * (q + kv)
    return np.where(c > 1, extra, 0.0)
