"""Prediction and Measurement: what the cost model says and what a run or a trace saw (JSON keys in DESIGN.md)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .errors import ParsimError

STATUSES = ("ok", "oom", "timeout", "error")


@dataclass(frozen=True)
class Prediction:
    plan_id: str
    model: str
    profile: str
    n_gpus: int
    fits: bool
    peak_memory_bytes: float
    memory_capacity_bytes: float
    peak_rank: str
    peak_phase: str  # end of forward | backward of the last layer | end of backward | optimizer step
    memory_breakdown_bytes: dict
    step_time_s: float
    time_breakdown_s: dict
    comm_bytes: dict  # "<op>/<axis>" -> bytes rank 0 hands to that collective per step
    tokens_per_s_per_gpu: float
    mfu: float
    plan: dict = field(default_factory=dict)
    interval_s: tuple | None = None  # [low, high] of step_time_s (90%: the profile's interval_log_halfwidth)
    interval_tokens_per_s_per_gpu: tuple | None = None
    # seconds per "<op>/<axis>" on the rank whose step time is reported (the keys of comm_bytes): raw (the calls'
    # time, as if nothing overlapped) and exposed (what the step waits for: the comm_<axis> entries of
    # time_breakdown_s are their sums per axis)
    comm_time_s: dict = field(default_factory=dict)
    exposed_comm_time_s: dict = field(default_factory=dict)
    # what CUDA's caching allocator reserves at the peak (expandable segments; costmodel/reserved.py), itemized by
    # stream; ``fits`` compares it with the usable memory. CPU (gloo) profiles: the allocated peak
    reserved_memory_bytes: float | None = None
    reserved_breakdown_bytes: dict = field(default_factory=dict)
    # with PP: "<op>/<axis>" -> bytes the last pipeline stage's rank hands per step (``comm_bytes`` are the first
    # stage's: the ranks differ by the embedding, the output projection and the layers each holds); empty without
    comm_bytes_last_stage: dict = field(default_factory=dict)

    def __post_init__(self):
        numbers = {"peak_memory_bytes": self.peak_memory_bytes, "step_time_s": self.step_time_s,
                   "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                   **{f"memory_breakdown_bytes.{k}": v for k, v in self.memory_breakdown_bytes.items()},
                   **{f"time_breakdown_s.{k}": v for k, v in self.time_breakdown_s.items()},
                   **{f"comm_bytes.{k}": v for k, v in self.comm_bytes.items()},
                   **{f"comm_bytes_last_stage.{k}": v for k, v in self.comm_bytes_last_stage.items()},
                   **{f"comm_time_s.{k}": v for k, v in self.comm_time_s.items()},
                   **{f"exposed_comm_time_s.{k}": v for k, v in self.exposed_comm_time_s.items()}}
        bad = {k: v for k, v in numbers.items() if not math.isfinite(v)}
        if bad:  # only reachable through sizes or profiles that slipped past their checks: say so, never emit NaN
            raise ParsimError(f"the prediction is not finite ({', '.join(f'{k}={v}' for k, v in bad.items())}): "
                              "check the model, plan and profile sizes")
        sums = [("memory", self.peak_memory_bytes, self.memory_breakdown_bytes),
                ("time", self.step_time_s, self.time_breakdown_s)]
        if self.reserved_memory_bytes is not None:
            sums.append(("reserved memory", self.reserved_memory_bytes, self.reserved_breakdown_bytes))
        for name, total, parts in sums:
            s = sum(parts.values())
            if not math.isclose(s, total, rel_tol=1e-9, abs_tol=1e-12):
                raise ParsimError(f"{name} breakdown sums to {s}, not the total {total}")

    @property
    def dominant_cost(self) -> str:
        return max(self.time_breakdown_s, key=lambda k: self.time_breakdown_s[k])

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("interval_s", "interval_tokens_per_s_per_gpu"):
            if d[k] is None:
                d.pop(k)
            else:
                d[k] = list(d[k])
        return d


def _finite_or_none(x):
    return x if x is None or math.isfinite(x) else None


@dataclass(frozen=True)
class Measurement:
    plan_id: str
    kind: str  # run | trace
    status: str  # ok | oom | timeout | error
    error: str = ""
    step_times_s: tuple = ()
    median_step_time_s: float | None = None
    peak_memory_bytes: float | None = None
    memory_breakdown_bytes: dict = field(default_factory=dict)
    comm_bytes: dict = field(default_factory=dict)
    losses: tuple = ()
    tokens_per_s_per_gpu: float | None = None
    provenance: dict = field(default_factory=dict)
    # runs on a GPU: torch.cuda.max_memory_reserved; traces: the traced allocations replayed through
    # parsim.allocator's model of the caching allocator with expandable segments (provenance has the classic one)
    reserved_peak_memory_bytes: float | None = None

    def __post_init__(self):
        if self.kind not in ("run", "trace"):
            raise ParsimError(f"measurement kind must be run or trace, got {self.kind!r}")
        if self.status not in STATUSES:
            raise ParsimError(f"measurement status must be one of {STATUSES}, got {self.status!r}")
        object.__setattr__(self, "step_times_s", tuple(self.step_times_s))
        object.__setattr__(self, "losses", tuple(self.losses))

    def to_dict(self) -> dict:
        """JSON-ready; a non-finite loss or time (a diverged run) becomes null: JSON has no NaN."""
        d = asdict(self)
        d["step_times_s"] = [_finite_or_none(x) for x in self.step_times_s]
        d["losses"] = [_finite_or_none(x) for x in self.losses]
        for k in ("median_step_time_s", "peak_memory_bytes", "tokens_per_s_per_gpu", "reserved_peak_memory_bytes"):
            d[k] = _finite_or_none(d[k])
        return d

    @staticmethod
    def from_dict(d: dict) -> "Measurement":
        try:
            return Measurement(**d)
        except TypeError as e:
            raise ParsimError(f"bad measurement: {e}") from None
