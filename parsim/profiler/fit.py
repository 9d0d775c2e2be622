"""Fits of measured samples (scipy): collective latency/bandwidth per (op, group size, ranks per node), and
throughput curves for GEMM, attention and memory-bound kernels. Torch-free: it only sees numbers.

Collectives follow nccl-tests: ``t = latency + S * factor(op, n) / busbw``, linear in (1, S * factor), fitted by
non-negative least squares on *relative* errors (each row divided by the measured time) so that small messages
count as much as large ones. When one line leaves a median relative residual above 15% and there are enough
points, the sweep is split at the breakpoint that minimizes the summed residuals: a small-message and a
large-message segment (e.g. a protocol switch).

Compute curves: ``t = (x + x_half) / rate``, i.e. linear in x with intercept, again NNLS on relative errors;
the fitted ``rate`` is the sustained throughput of large kernels (stored as the profile's peak) and
``x_half`` the work at which half of it is reached: EfficiencyCurve(eff_max=1, x_half).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from ..hardware import CollectiveFit, busbw_factor


def _nnls_rel(cols: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Solve t ~ cols @ x, x >= 0, minimizing relative errors; returns (x, relative residuals)."""
    a = cols / t[:, None]
    x, _ = nnls(a, np.ones_like(t))
    pred = cols @ x
    return x, np.abs(pred - t) / t


def fit_line(s_bytes, t, op: str, n: int) -> tuple[float, float, float]:
    """(latency_s, busbw_bytes_per_s, median relative residual) for one segment."""
    s_bytes, t = np.asarray(s_bytes, float), np.asarray(t, float)
    f = float(busbw_factor(op, n))
    x, res = _nnls_rel(np.stack([np.ones_like(s_bytes), s_bytes * f], axis=1), t)
    lat, inv_bw = float(x[0]), float(x[1])
    bw = 1.0 / inv_bw if inv_bw > 0 else 1e15  # no measurable bandwidth term: latency-bound everywhere
    return lat, bw, float(np.median(res))


def fit_collective(op: str, n: int, rpn: int, s_bytes, t, split_above: float = 0.15,
                   min_points: int = 3) -> list[CollectiveFit]:
    s_bytes, t = np.asarray(s_bytes, float), np.asarray(t, float)
    order = np.argsort(s_bytes)
    s_bytes, t = s_bytes[order], t[order]
    lat, bw, res = fit_line(s_bytes, t, op, n)
    one = [CollectiveFit(op, n, rpn, lat, bw, 0.0, res, len(t))]
    if res <= split_above or len(t) < 2 * min_points:
        return one
    best = None
    for k in range(min_points, len(t) - min_points + 1):
        l1, b1, r1 = fit_line(s_bytes[:k], t[:k], op, n)
        l2, b2, r2 = fit_line(s_bytes[k:], t[k:], op, n)
        score = r1 * k + r2 * (len(t) - k)
        if best is None or score < best[0]:
            best = (score, k, (l1, b1, r1), (l2, b2, r2))
    _, k, (l1, b1, r1), (l2, b2, r2) = best
    if (r1 * k + r2 * (len(t) - k)) / len(t) >= res:
        return one
    return [CollectiveFit(op, n, rpn, l1, b1, 0.0, r1, k),
            CollectiveFit(op, n, rpn, l2, b2, float(s_bytes[k]), r2, len(t) - k)]


def fit_throughput(work, t) -> tuple[float, float, float]:
    """(rate per second, x_half, median relative residual) of ``t = (work + x_half) / rate``."""
    work, t = np.asarray(work, float), np.asarray(t, float)
    x, res = _nnls_rel(np.stack([work, np.ones_like(work)], axis=1), t)
    a, c = float(x[0]), float(x[1])
    if a <= 0:
        a = float(np.min(t / work))
    return 1.0 / a, c / a, float(np.median(res))


def framework_events(sample: dict) -> tuple[float, str]:
    """(events per block and step, their name) of a framework-probe sample: what ``overhead_per_block_s`` is divided
    by to give its per-event overhead (FSDP: collective calls per unit; pipelining: stage actions; TP, EP: 1 block
    and microbatch). Older samples have no ``pp_actions_per_block``."""
    kind = sample.get("kind")
    if kind in ("fsdp", "fsdp_moe"):
        return float(sample["fsdp_calls_per_unit"]), "call"
    if kind == "pp":
        return float(sample["pp_actions_per_block"]), "action"
    return 1.0, "block"


def fit_framework_overheads(samples: list[dict]) -> dict:
    """The profile's named framework quantities from ``profiler.frameworks`` samples (framework - twin, per block
    and step), each ``t = fixed + bytes x per_byte`` by NNLS on relative errors [measured, fitted here]:

    * ``fsdp_call_fixed_s`` / ``fsdp_call_s_per_byte``: per FSDP unit and collective call (each unshard, each
      gradient reduction: a sample's overhead over its ``fsdp_calls_per_unit``), against the unit's unsharded
      bytes: hooks and state changes (fixed), copy-in / copy-out of the flat all-gather buffer, the gradients'
      chunk-cat and the sharded accumulation (per byte). Probes with reshard after forward (3 calls) and without
      (2) are fitted together: their overheads differ by about the ratio of their calls
      (``overlap.framework_overheads``).
    * ``fsdp_moe_call_fixed_s`` / ``fsdp_moe_call_s_per_byte``: the same for units holding a MoE block's routed
      experts (probes over MoE blocks at their own unit sizes), which replace the dense block's quantities for
      those units instead of extrapolating the dense fit, whose per-byte term leans on the widest dense unit (12.6
      MB: 5.5-14 ms a call across three probe runs on 2 gloo ranks of a 2-core AVX2 EPYC, 15-25 on 4). A 7.9 MB
      MoE unit there: 0.67-1.05x the dense fit at its size over four probe sets [measured].
    * ``tp_block_fixed_s`` / ``tp_block_s_per_byte``: per tensor-parallel block and microbatch, forward +
      backward, against the bytes of one gathered activation: DTensor dispatch, sharding propagation and
      redistribution bookkeeping.
    * ``tp_moe_block_fixed_s`` / ``tp_moe_block_s_per_byte``: the same for a MoE block under TP (experts
      TP-sharded, one shared expert), which replaces the dense block's quantities for the MoE layers.
    * ``ep_block_fixed_s`` / ``ep_block_s_per_byte``: per MoE block and microbatch under expert parallelism,
      forward + backward, against the bytes of the rank's routed rows (tokens x top_k x d_model): the routing
      counts' exchange read on the host, the permutations around the all-to-alls, their autograd.
    * ``pp_action_fixed_s`` / ``pp_action_s_per_byte``: per pipeline stage action (one microbatch's forward or
      backward on one stage; a sample's overhead over its ``pp_actions_per_block``), against the bytes of the
      activation the stage sends: torch's schedule and ``PipelineStage`` beside the compute and the transfers.

    A negative difference (the twin slower: noise) counts as 0; no samples of a kind, no quantities."""
    out: dict = {}
    for kind, size_key, prefix in (("fsdp", "unit_bytes", "fsdp_call"), ("fsdp_moe", "unit_bytes", "fsdp_moe_call"),
                                   ("tp", "unit_bytes", "tp_block"),
                                   ("tp_moe", "unit_bytes", "tp_moe_block"), ("ep", "unit_bytes", "ep_block"),
                                   ("pp", "unit_bytes", "pp_action")):
        rows = [s for s in samples if s.get("kind") == kind]
        if not rows:
            continue
        x = np.array([float(s[size_key]) for s in rows])
        calls = np.array([framework_events(s)[0] for s in rows])
        t = np.array([max(float(s["overhead_per_block_s"]), 1e-7) for s in rows]) / calls
        coef, _ = _nnls_rel(np.stack([np.ones_like(x), x], axis=1), t)
        out[f"{prefix}_fixed_s"], out[f"{prefix}_s_per_byte"] = float(coef[0]), float(coef[1])
    return out


def fit_optimizer_step(samples: list[dict]) -> dict:
    """The profile's named optimizer quantities from ``compute.optimizer_samples`` (the executor's clip + AdamW
    step over k tensors holding n parameters): ``t = fixed + n x per_param + k x per_tensor`` by NNLS on relative
    errors [measured, fitted here]. ``optimizer_s_per_param`` is the memory traffic of the step (the cost model's
    bandwidth estimate divides 32 B by the elementwise bandwidth; AdamW's sqrt / div and the norm's reduction run
    slower than a copy), ``optimizer_s_per_tensor`` what each tensor adds to every foreach kernel (a loop over
    tensors on a CPU, chunked launches on a GPU), ``optimizer_fixed_s`` the rest (the norm's reduction to a
    scalar, Python). No samples with a tensor count (profiles written before), no quantities."""
    rows = [s for s in samples if s.get("kind") == "adamw" and s.get("tensors")]
    if len(rows) < 3:
        return {}
    n = np.array([float(s["params"]) for s in rows])
    k = np.array([float(s["tensors"]) for s in rows])
    t = np.array([float(s["time_s"]) for s in rows])
    coef, _ = _nnls_rel(np.stack([np.ones_like(n), n, k], axis=1), t)
    return {"optimizer_fixed_s": float(coef[0]), "optimizer_s_per_param": float(coef[1]),
            "optimizer_s_per_tensor": float(coef[2])}
