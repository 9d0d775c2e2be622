"""A cost function evaluated once per distinct plan it can tell apart, not once per plan.

Most of a plan's per-microbatch cost (its layers' FLOPs, kernels and saved tensors) depends on a few of its columns
(local batch shape, TP / CP / EP degrees, dtypes, compile, float8), while a search batch differs in many more
(data-parallel split, local batch, device order). ``on_distinct_rows(fn, b, ...)`` runs ``fn`` on one plan per
distinct combination of the columns ``fn`` reads and gives every plan its combination's result.

Which columns ``fn`` reads is recorded, not declared: the batch ``fn`` sees records every column it touches
(derived columns record the columns they are computed from). Starting from the columns recorded on earlier calls,
the rows are deduplicated on a key; if ``fn`` read a column outside the key, the key grows by it and ``fn`` runs
again, until it reads nothing outside its key. Then every plan of a group agrees with its representative on every
column ``fn`` read, so ``fn``'s per-plan result is the same for both [derived: ``fn`` is a function of the batch's
columns, computed row by row]. What ``fn`` returns is expanded by row: arrays whose first dimension is the
number of representatives, inside tuples, lists, dicts and dataclasses; anything else as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np

from ..codec import COLUMN_NAMES, PlanBatch
from .rows import row_ids
from .work import tally

_COLUMNS = frozenset(COLUMN_NAMES) | {"rpn"}
# derived columns (``PlanBatch``'s cached properties): recorded as themselves, so that plans that differ only in
# what a derived column folds away (``fsdp_applied`` is one bit of three degrees) share a representative
_DERIVED = frozenset(k for k, v in vars(PlanBatch).items() if isinstance(v, cached_property))
# per function, the columns it was seen to read (the next call's first key)
_KEYS: dict[Callable, frozenset] = {}


class _Reading(PlanBatch):
    """A ``PlanBatch`` that records the columns read from it (a derived column as itself: the columns it is
    computed from are not recorded while it is)."""

    def __getattribute__(self, name: str) -> Any:
        get = object.__getattribute__
        if name in _DERIVED and not get(self, "_quiet"):
            get(self, "_read").add(name)
            object.__setattr__(self, "_quiet", True)
            try:
                return get(self, name)
            finally:
                object.__setattr__(self, "_quiet", False)
        if name in _COLUMNS and not get(self, "_quiet"):
            get(self, "_read").add(name)
        return get(self, name)

    def __len__(self) -> int:
        return len(object.__getattribute__(self, "pp"))


def _get(b: PlanBatch, name: str):
    """A column of ``b`` without recording it (the columns read here are the key's, recorded as such)."""
    return object.__getattribute__(b, name)


def _reading(b: PlanBatch, idx: np.ndarray) -> _Reading:
    kw = {c: _get(b, c)[idx] for c in COLUMN_NAMES}
    rpn = None if _get(b, "rpn") is None else {k: v[idx] for k, v in _get(b, "rpn").items()}
    out = _Reading(mesh_orders=_get(b, "mesh_orders"), wrapper_orders=_get(b, "wrapper_orders"), rpn=rpn, **kw)
    object.__setattr__(out, "_read", set())
    object.__setattr__(out, "_quiet", False)
    return out


def _derived(b: PlanBatch, name: str):
    """A derived column of ``b`` without recording it or the columns it is computed from."""
    if not isinstance(b, _Reading):
        return getattr(b, name)
    quiet = _get(b, "_quiet")
    object.__setattr__(b, "_quiet", True)
    try:
        return getattr(b, name)
    finally:
        object.__setattr__(b, "_quiet", quiet)


def _key(b: PlanBatch, names: frozenset) -> np.ndarray:
    """One integer per plan, equal where the plans agree on every column of ``names``: the columns' offsets from
    their minimum in mixed radix (``rows.row_ids`` where that could overflow, or a column is not an integer)."""
    cols = []
    for name in sorted(names):
        rpn = _get(b, "rpn")
        if name == "rpn":
            cols += [] if rpn is None else [np.asarray(rpn[k]) for k in sorted(rpn)]
        elif name in _DERIVED:
            cols.append(np.asarray(_derived(b, name)))
        else:
            cols.append(np.asarray(_get(b, name)))
    code, size = np.zeros(len(b), np.int64), 1
    for col in cols:
        if col.dtype.kind not in "biu":
            return row_ids(np.stack([np.asarray(c, dtype=float) for c in cols], axis=1))
        lo, hi = (int(col.min()), int(col.max())) if len(col) else (0, 0)
        if hi == lo:
            continue
        if size * (hi - lo + 1) >= 2**62:
            return row_ids(np.stack([np.asarray(c, dtype=np.int64) for c in cols], axis=1))
        code, size = code * (hi - lo + 1) + (col.astype(np.int64) - lo), size * (hi - lo + 1)
    return code


def _expand(x, inv: np.ndarray, n_rep: int):
    if isinstance(x, np.ndarray):
        return x[inv] if x.ndim and x.shape[0] == n_rep else x
    if isinstance(x, dict):
        return {k: _expand(v, inv, n_rep) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_expand(v, inv, n_rep) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _expand(getattr(x, f.name), inv, n_rep)
                                         for f in dataclasses.fields(x) if f.init})
    return x


def on_distinct_rows(fn: Callable, b: PlanBatch, *args, **kwargs):
    """``fn(b, *args, **kwargs)``, computed on one plan per distinct combination of the columns ``fn`` reads and
    expanded to every plan of ``b`` (see the module docstring)."""
    key = _KEYS.get(fn, frozenset())
    n = len(_get(b, "pp"))
    while True:
        _, first, inv = np.unique(_key(b, key), return_index=True, return_inverse=True)
        sub = _reading(b, first)
        out = fn(sub, *args, **kwargs)
        read = frozenset(object.__getattribute__(sub, "_read"))
        if read <= key:
            break
        key = key | read
    _KEYS[fn] = key
    if isinstance(b, _Reading):  # (called from a function being recorded: it read what this key holds)
        object.__getattribute__(b, "_read").update(key)
    tally(distinct_calls=1, distinct_plans=n, distinct_rows=len(first))
    return _expand(out, np.ravel(inv), len(first))
