"""The analytical model: per-rank memory, communication and step time of plans (torch-free, vectorized)."""

from ..codec import PlanBatch
from .step import evaluate, predict

__all__ = ["PlanBatch", "evaluate", "predict"]
