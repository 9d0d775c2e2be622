"""The pipeline schedule's terms: schedule codes and the bubble."""

from __future__ import annotations

import numpy as np

from ..codec import PlanBatch
from ..hardware import HardwareProfile

SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED = 0, 1, 2


def bubble(b: PlanBatch, hw: HardwareProfile, M, ga, compute_mb, t_mb):
    """Pipeline bubble of one rank: ``ga (pp - 1) / v`` microbatch-times (Narayanan et al. 2021, sec. 2.2).

    Ranks sharing cores (``compute_scale`` s = ranks per core > 1, measured by the profiler): a rank idle in the
    bubble gives its core to the ranks that share it, so the work is limited by the cores, not stretched on the
    critical path. With W = M x compute per microbatch at full speed, the step's compute takes
    ``max(s W, W + bubble at full speed)`` [derived]: the bubble adds time only beyond what the shared cores need
    anyway. With s = 1 this is the plain bubble."""
    s = float(hw.corrections.get("compute_scale", 1.0))
    full_speed_mb = t_mb - compute_mb + compute_mb / s  # exposed comm per microbatch is not stretched by s
    bubble1 = ga * (b.pp - 1) / b.pp_stages_per_rank * full_speed_mb
    return np.maximum(0.0, M * compute_mb / s + bubble1 - M * compute_mb)
