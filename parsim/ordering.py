"""Wrapper-order rules: which orders of applying PP, TP, AC, compile and FSDP are legal, why, and what they cost.

Written rules, from the torchtitan discussion (seed 000) and the torch.compile + FSDP status (seed 001):

* ``tp`` before ``fsdp`` — fundamental: FSDP2's all-gather must see DTensor (TP) parameters; the training
  iteration semantics run the other way.
* ``compile`` before ``fsdp`` — fundamental for FSDP2: compile graph-breaks on FSDP2-wrapped modules.
* ``pp`` first — recommended: the other wrappers then act on clean SPMD stages (maybe not fundamental).
* ``ac`` before ``compile`` (compile wraps AC) — recommended: the min-cut partitioner sees the AC regions; AC
  wrapping a compiled region may recompute twice.
* ``tp`` before ``ac`` — version-dependent: the reverse gave "mixed torch.Tensor and DTensor" after backward in
  torchtitan.

Observed rules: `parsim orders` executes every order of the enabled wrappers on the installed torch and stores the
matrix in ``profiles/orders.json`` under the torch version. Where that data exists for the installed torch, it
decides (``effective_rules``): a written rule whose reverse order ran with the default order's losses in every
case is no longer fundamental (kind ``observed-legal``); one whose reverse always failed is ``observed-fundamental``;
a pair the written rules do not mention whose one order always failed and the other always ran becomes an
``observed-fundamental`` rule. ``searched_orders`` derives from the effective rules, and the recompute factor of AC
wrapping compile that the cost model charges comes from the same data (``ac_wraps_compile_recompute_factor``).
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from itertools import combinations, permutations
from pathlib import Path

from .plan import DEFAULT_ORDER, WRAPPERS

ORDERS_FILE = Path(str(importlib.resources.files("parsim.profiles"))) / "orders.json"
# [assumed] AC wrapping a compiled block recomputes its forward twice, where no measurement exists
ASSUMED_AC_WRAPS_COMPILE_FACTOR = 2.0
FAILING = ("failed", "differs")


@dataclass(frozen=True)
class OrderRule:
    first: str
    then: str
    kind: str  # fundamental | recommended | version-dependent | observed-legal | observed-fundamental
    reason: str

    @property
    def forbids(self) -> bool:
        """Breaking it makes the order illegal."""
        return self.kind in ("fundamental", "observed-fundamental")


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


def violations(order: tuple[str, ...], rules: tuple[OrderRule, ...] = RULES) -> list[OrderRule]:
    pos = {w: i for i, w in enumerate(order)}
    return [r for r in rules if pos[r.first] > pos[r.then]]


def is_legal(order: tuple[str, ...], rules: tuple[OrderRule, ...] | None = None) -> bool:
    """No forbidding rule broken (the effective rules: written, revised by the observed matrix)."""
    return not any(r.forbids for r in violations(order, effective_rules() if rules is None else rules))


def active_wrappers(plan) -> frozenset[str]:
    """The wrappers that change ``plan``'s model (as the executor's ``apply_*`` skip the others): pp and tp above
    1, AC other than none, compile, FSDP wherever a data-parallel or CP axis is above 1."""
    on = {"pp": plan.pp > 1, "tp": plan.tp > 1, "ac": plan.ac != "none", "compile": bool(plan.compile),
          "fsdp": plan.fsdp_applied}
    return frozenset(w for w, yes in on.items() if yes)


def order_refusal(plan, rules: tuple[OrderRule, ...] | None = None) -> str:
    """Why ``plan``'s wrapper order cannot run correctly ("" when it can): the first forbidding rule (effective:
    written, revised by the observed matrix) it breaks between two wrappers the plan applies. Where a wrapper is
    off its position changes nothing, so its rules do not bind. ``parsim run`` refuses such a plan; ``parsim
    orders`` runs them on purpose (through the executor directly) to observe what they do."""
    on = active_wrappers(plan)
    for r in violations(plan.wrapper_order, effective_rules() if rules is None else rules):
        if r.forbids and r.first in on and r.then in on:
            return (f"wrapper order {','.join(plan.wrapper_order)} puts {r.then} before {r.first}, which does not "
                    f"run correctly ({r.kind}): {r.reason}")
    return ""


def searched_orders(ac_on: bool, compile_on: bool, rules: tuple[OrderRule, ...] | None = None
                    ) -> list[tuple[str, ...]]:
    """Orders the search evaluates, derived from the rules: legal orders breaking no version-dependent rule, one
    per class of equivalent orders, the one breaking the fewest recommended rules and then closest to the default
    order (the default order first).
    Orders that differ only in where a disabled wrapper sits are the same plan, and of the enabled wrappers only
    the relative order of AC and compile changes the cost model's figures (``ac_wraps_compile``): one class when
    either is off, two when both are on."""
    rules = effective_rules() if rules is None else rules

    def ok(o):
        return not any(r.forbids or r.kind == "version-dependent" for r in violations(o, rules))

    def rank(o):  # the default first, then fewest recommended rules broken, then closest to the default
        inversions = sum(DEFAULT_ORDER.index(x) > DEFAULT_ORDER.index(y) for x, y in combinations(o, 2))
        return (o != DEFAULT_ORDER, sum(r.kind == "recommended" for r in violations(o, rules)), inversions, o)

    classes: dict[bool, tuple[str, ...]] = {}
    for o in sorted((o for o in permutations(WRAPPERS) if ok(o)), key=rank):
        key = ac_on and compile_on and o.index("ac") > o.index("compile")
        classes.setdefault(key, o)
    return [classes[k] for k in sorted(classes)]


def all_legal_orders() -> list[tuple[str, ...]]:
    return [o for o in permutations(WRAPPERS) if is_legal(o)]


# ---- the observed matrix -------------------------------------------------------------------------------------------
def installed_torch() -> str | None:
    """The installed torch's version, read from package metadata (torch is not imported)."""
    try:
        return metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def load_observed(path: Path | str = ORDERS_FILE, torch_version: str | None = None) -> dict | None:
    """The stored `parsim orders` data for ``torch_version`` (default: the installed torch), None if absent."""
    p = Path(path)
    if not p.exists():
        return None
    store = json.loads(p.read_text())
    return store.get("by_torch_version", {}).get(torch_version or installed_torch() or "")


def _rows(data: dict):
    for case_name, case in data.get("cases", {}).items():
        for row in case["rows"]:
            yield case_name, tuple(case["permuted"]), tuple(row["order"]), row


def _strict(r: OrderRule) -> bool:
    return r.forbids or r.kind == "version-dependent"


def _clean(order, perm, rules, but=None) -> bool:
    """The order breaks none of ``rules``' strict rules among the permuted wrappers, ``but`` aside: a row that
    tests one rule alone."""
    return not any(_strict(r) and r is not but and r.first in perm and r.then in perm
                   for r in violations(order, rules))


def observed_rules(data: dict | None) -> tuple[OrderRule, ...]:
    """The written rules revised by the observed matrix, plus pairs the matrix shows on its own (module doc).
    A rule is judged on the rows that break it and no other strict written rule (so that a failure is not
    blamed on the wrong pair); new pairs on the rows that break no strict revised rule."""
    if not data:
        return RULES
    version = data.get("torch", "?")
    out = []
    for r in RULES:
        seen = [row["outcome"] for _, perm, order, row in _rows(data)
                if r.first in perm and r.then in perm and order.index(r.first) > order.index(r.then)
                and _clean(order, perm, RULES, but=r)]
        if seen and all(o == "ran" for o in seen) and _strict(r):
            out.append(OrderRule(r.first, r.then, "observed-legal",
                                 f"{r.reason}; yet the reverse ran with the default order's losses in all "
                                 f"{len(seen)} orders that test it alone on torch {version}"))
        elif seen and all(o in FAILING for o in seen):
            out.append(OrderRule(r.first, r.then, "observed-fundamental",
                                 f"{r.reason}; the reverse failed or changed the losses in all {len(seen)} "
                                 f"orders that test it alone on torch {version}"))
        else:
            out.append(r)
    revised = tuple(out)
    written = {frozenset((r.first, r.then)) for r in RULES}
    for a, b in combinations(WRAPPERS, 2):
        if frozenset((a, b)) in written:
            continue
        rows = [(o, row["outcome"]) for _, perm, o, row in _rows(data)
                if a in perm and b in perm and _clean(o, perm, revised)]
        ab = [out_ for o, out_ in rows if o.index(a) < o.index(b)]
        ba = [out_ for o, out_ in rows if o.index(b) < o.index(a)]
        for first, then, good, bad in ((a, b, ab, ba), (b, a, ba, ab)):
            if good and bad and all(o == "ran" for o in good) and all(o in FAILING for o in bad):
                out.append(OrderRule(first, then, "observed-fundamental",
                                     f"every order with {then} before {first} failed ({len(bad)}), every other "
                                     f"ran ({len(good)}) on torch {version}"))
    return tuple(out)


@lru_cache(maxsize=1)
def observed() -> dict | None:
    """The stored matrix for the installed torch (read once)."""
    return load_observed()


@lru_cache(maxsize=1)
def effective_rules() -> tuple[OrderRule, ...]:
    return observed_rules(observed())


def disagreements(data: dict | None, rules: tuple[OrderRule, ...] = RULES) -> list[dict]:
    """Rows of the matrix where the written rules predict otherwise: an order they forbid that ran, an order they
    allow that failed or changed the losses."""
    out = []
    for case_name, perm, order, row in _rows(data or {}):
        broken = [r for r in violations(order, rules) if r.first in perm and r.then in perm]
        forbidden = any(r.forbids for r in broken)
        if forbidden and row["outcome"] == "ran":
            why = "; ".join(f"{r.first} before {r.then} ({r.kind})" for r in broken if r.forbids)
            out.append({"case": case_name, "order": list(order), "observed": "ran", "rules": f"forbidden: {why}"})
        elif not forbidden and row["outcome"] in FAILING:
            out.append({"case": case_name, "order": list(order), "observed": row["outcome"],
                        "error": row.get("error", ""), "rules": "allowed"})
    return out


def ac_wraps_compile_recompute_factor() -> float:
    """Recompute multiplier when AC wraps a compiled block: measured by `parsim orders` on the installed torch
    (R_out / R_in, see parsim/executor/orders.py), else ASSUMED_AC_WRAPS_COMPILE_FACTOR. Floored at 1."""
    factor = ((observed() or {}).get("ac_wraps_compile") or {}).get("recompute_factor")
    return max(1.0, float(factor)) if factor is not None else ASSUMED_AC_WRAPS_COMPILE_FACTOR


def orders_document(data: dict | None) -> dict:
    """`parsim orders --json`: the observed matrix with what the written rules predict for each row, the
    disagreements, the effective rules, the orders search derives from them and the measured AC cost."""
    if not data:
        return {"torch": installed_torch(), "cases": {}, "disagreements": [], "rules": [], "searched_orders": []}
    cases = {}
    for case_name, case in data.get("cases", {}).items():
        perm = tuple(case["permuted"])
        rows = []
        for row in case["rows"]:
            broken = [r for r in violations(tuple(row["order"])) if r.first in perm and r.then in perm]
            rows.append({**row, "written_rules_broken": [f"{r.first} before {r.then} ({r.kind})" for r in broken],
                         "written_rules_predict": "fails" if any(r.forbids for r in broken) else "runs"})
        cases[case_name] = {**case, "rows": rows}
    rules = observed_rules(data)
    return {"torch": data.get("torch"), "device": data.get("device"), "backend": data.get("backend"),
            "cases": cases, "disagreements": disagreements(data),
            "rules": [{"first": r.first, "then": r.then, "kind": r.kind, "reason": r.reason} for r in rules],
            "searched_orders": {"ac and compile on": [list(o) for o in searched_orders(True, True, rules)],
                                "otherwise": [list(o) for o in searched_orders(False, False, rules)]},
            "ac_wraps_compile": data.get("ac_wraps_compile")}
