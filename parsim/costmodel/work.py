"""Counters of the work the cost model does (timeline replays, schedules replayed, plans evaluated once per
distinct row), so that a search can say what it did and a test can bound it on any machine: a change that makes
the same search do ten times the work fails that test, however fast the machine is."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

COUNTS: Counter = Counter()


def tally(**counts: int) -> None:
    """Add to the named counters."""
    COUNTS.update(counts)


@contextmanager
def counted() -> Iterator[Counter]:
    """The counters' increase over the ``with`` block (filled when it ends)."""
    start = COUNTS.copy()
    out: Counter = Counter()
    try:
        yield out
    finally:
        out.update({k: v - start.get(k, 0) for k, v in COUNTS.items() if v != start.get(k, 0)})
