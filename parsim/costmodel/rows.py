"""Grouping a batch's plans by equal rows of a few columns, fast (the search evaluates tens of thousands of plans
per batch and groups them several times)."""

from __future__ import annotations

import numpy as np


def row_ids(a: np.ndarray) -> np.ndarray:
    """One integer per row of ``a`` (n x k), equal exactly where the rows are equal: the columns' codes combined
    in mixed radix (re-ranked before the code could overflow). A column of integers in a range not much wider than
    the rows is coded as its offset from its minimum, any other by its rank among its distinct values (a sort).
    ``np.unique(a, axis=0)`` says the same but sorts the rows as byte strings, ten times slower on the search's
    batches."""
    code, size = np.zeros(len(a), np.int64), 1
    for j in range(a.shape[1]):
        col = a[:, j]
        if not len(col):
            continue
        lo, hi = col.min(), col.max()
        if lo == hi:
            continue
        span = float(hi) - float(lo) + 1.0
        if col.dtype.kind in "biu" and span <= 4.0 * len(col) + 1024.0:
            rank, width = (col - lo).astype(np.int64), int(span)
        elif col.dtype.kind == "f" and span <= 4.0 * len(col) + 1024.0 and bool(np.all(col == np.round(col))):
            rank, width = (col - lo).astype(np.int64), int(span)
        else:
            u, inv = np.unique(col, return_inverse=True)
            rank, width = np.ravel(inv), len(u)
        if size * width >= 2**62:
            _, code = np.unique(code, return_inverse=True)
            code = np.ravel(code)
            size = int(code.max()) + 1
        code, size = code * width + rank, size * width
    return code


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows of ``a``, each row's index among them): ``np.unique(a, axis=0, return_inverse=True)``
    up to the order of the distinct rows."""
    _, first, inv = np.unique(row_ids(a), return_index=True, return_inverse=True)
    return a[first], np.ravel(inv)
