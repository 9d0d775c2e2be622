"""Wrapper-order rules: which orders of applying PP, TP, AC, compile and FSDP are legal, why, and what they cost.

From the torchtitan discussion (seed 000) and the torch.compile + FSDP status (seed 001):

* ``tp`` before ``fsdp`` — fundamental: FSDP2's all-gather must see DTensor (TP) parameters; the training
  iteration semantics run the other way.
* ``compile`` before ``fsdp`` — fundamental for FSDP2: compile graph-breaks on FSDP2-wrapped modules.
* ``pp`` first — recommended: the other wrappers then act on clean SPMD stages (maybe not fundamental).
* ``ac`` before ``compile`` (compile wraps AC) — recommended: the min-cut partitioner sees the AC regions; AC
  wrapping a compiled region may recompute twice. The cost model charges double recompute for the reverse.
* ``tp`` before ``ac`` — version-dependent: the reverse gave "mixed torch.Tensor and DTensor" after backward in
  torchtitan. Not searched by default; the executor can try it and record what the installed torch does.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from .plan import DEFAULT_ORDER, WRAPPERS


@dataclass(frozen=True)
class OrderRule:
    first: str
    then: str
    kind: str  # fundamental | recommended | version-dependent
    reason: str


RULES = (
    OrderRule("tp", "fsdp", "fundamental", "FSDP2 all-gather must see DTensor (TP) parameters"),
    OrderRule("compile", "fsdp", "fundamental", "torch.compile graph-breaks on FSDP2-wrapped modules"),
    OrderRule("pp", "tp", "recommended", "PP splits first so that the rest acts on clean SPMD stages"),
    OrderRule("pp", "ac", "recommended", "PP splits first so that the rest acts on clean SPMD stages"),
    OrderRule("pp", "compile", "recommended", "PP splits first so that the rest acts on clean SPMD stages"),
    OrderRule("pp", "fsdp", "recommended", "PP splits first so that the rest acts on clean SPMD stages"),
    OrderRule("ac", "compile", "recommended", "AC wrapping a compiled region can recompute twice"),
    OrderRule("tp", "ac", "version-dependent", "AC before TP failed with mixed Tensor/DTensor in torchtitan"),
)


def violations(order: tuple[str, ...]) -> list[OrderRule]:
    pos = {w: i for i, w in enumerate(order)}
    return [r for r in RULES if pos[r.first] > pos[r.then]]


def is_legal(order: tuple[str, ...]) -> bool:
    """No fundamental rule broken."""
    return not any(r.kind == "fundamental" for r in violations(order))


def searched_orders(ac_on: bool, compile_on: bool) -> list[tuple[str, ...]]:
    """Orders the search evaluates: legal, breaking no version-dependent rule either, and one per class of
    equivalent orders (orders that differ only in where a disabled wrapper sits are the same plan). Only the
    relative order of AC and compile changes the cost, and only when both are on."""
    if not (ac_on and compile_on):
        return [DEFAULT_ORDER]
    out: list[tuple[str, ...]] = [DEFAULT_ORDER]
    swapped = ("pp", "tp", "compile", "ac", "fsdp")
    assert is_legal(swapped)
    out.append(swapped)
    return out


def all_legal_orders() -> list[tuple[str, ...]]:
    return [o for o in permutations(WRAPPERS) if is_legal(o)]
