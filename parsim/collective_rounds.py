"""The collectives timed in every validate round, and the profile's curves refitted to their median.

A profile's collective curves come from one sweep (``parsim.profiler.collectives``): on 2 ranks of a shared 2-core
machine about 20 seconds, on 4 about 70. One slow minute there moves every plan's communication alike. On a 2-core
AMD EPYC a fresh 2-rank profile read all-gather, reduce-scatter and all-reduce 30-90% slower than a
profile of the same machine made the day before, while the collectives inside the plans' own steps
(``bench/step_collectives.py``) took 0.61-0.68x that profile's curves and 0.89-0.99x the day before's: the tiny /
2-rank fresh run missed by 13.1% mean, and by 7.2% re-scored with the earlier curves. Part of that gap was the
sweep itself as it was then: it made each call's buffers (``torch.full``, ``torch.empty``) inside the timed loop, which
on gloo made a 4 MB all-gather 1.6x what the same call takes on buffers made once (``profiler.collectives``).

So ``validate --measure-blocks`` runs the same sweep at the start of every round, beside the blocks
(``measure_collective_round``, one line per round in ``DIR/collectives.jsonl``), and predicts with curves refitted
(``profiler.run.collective_fits``, the profile's own fit) to each point's median over every sweep on record: the
profile's own (its ``.samples.csv`` beside it, where found) and the rounds'. With the profile's and two rounds' that
is a median of three, which one slow sweep does not move.

Torch-free at import; measuring imports the profiler.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
from pathlib import Path

from .progress import Progress

COLLECTIVE_ROUNDS = "collectives.jsonl"
_POINT = ("op", "group_size", "group_kind", "ranks_per_node", "buffer_bytes")


def read_collective_rounds(out: Path, nproc: int | None = None) -> list[dict]:
    """The sweeps validate ran at the start of its rounds (``DIR/collectives.jsonl``: round, nproc, wall_s,
    samples), those of ``nproc`` ranks where given; [] without."""
    from .validate import load_measurements

    lines = load_measurements(out / COLLECTIVE_ROUNDS)
    return [c for c in lines if nproc is None or c.get("nproc") == nproc]


def measure_collective_round(out: Path, r: int, nproc: int, timeout_s: float = 1800.0,
                             progress: Progress | None = None) -> None:
    """Run the profile's collective sweep on ``nproc`` ranks at the start of validate's round ``r`` (once: a
    resumed round that has one does not run it again) and append it to ``DIR/collectives.jsonl``."""
    import tempfile

    from .profiler.run import collective_sweep
    from .validate import append_line

    if nproc < 2 or any(c.get("round") == r for c in read_collective_rounds(out, nproc)):
        return
    task = f"round {r + 1}: collectives on {nproc} ranks"
    if progress:
        progress(task, 0, 1)
    with tempfile.TemporaryDirectory() as tmp:
        doc = collective_sweep(Path(tmp) / "collectives.json", nproc, timeout_s)
    append_line(out / COLLECTIVE_ROUNDS, {"round": r, "nproc": nproc, "wall_s": doc.get("wall_s"),
                                          "samples": doc["samples"]})
    if progress:
        progress(task, 1, 1)


def profile_sweep_samples(hw) -> list[dict]:
    """The collective samples of the profile's own sweep, from its ``.samples.csv`` (``samples.file``) in the first
    profile folder that holds the profile; [] where none is found (a spec sheet, a profile copied alone)."""
    from .hardware import profile_dirs

    name = (hw.samples or {}).get("file")
    if not name:
        return []
    for d in profile_dirs():
        if (d / f"{hw.name}.json").exists():
            path = d / name
            break
    else:
        return []
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("kind") == "collective"]
    return [{"op": r["op"], "group_size": int(r["group_size"]), "group_kind": r["group_kind"],
             "ranks_per_node": int(r["ranks_per_node"]), "buffer_bytes": int(float(r["bytes"])),
             "time_s": float(r["time_s"])} for r in rows]


def median_samples(sweeps: list[list[dict]]) -> list[dict]:
    """Per measured point (op, group size and kind, ranks per node, buffer bytes), the median time over the sweeps
    that measured it (``sweeps``: how many)."""
    by_point: dict[tuple, list[float]] = {}
    for sweep in sweeps:
        for s in sweep:
            by_point.setdefault(tuple(s[k] for k in _POINT), []).append(float(s["time_s"]))
    return [{**dict(zip(_POINT, point, strict=True)), "time_s": statistics.median(ts), "sweeps": len(ts)}
            for point, ts in sorted(by_point.items())]


def with_round_collectives(hw, out: Path, nproc: int, rounds: bool = True):
    """``hw`` with its collective curves refitted to each point's median over the profile's sweep and, with
    ``rounds``, every sweep validate ran in ``out`` on ``nproc`` ranks; ``hw`` itself where no round ran (or with
    ``rounds`` False and no samples file: the profile's fits are its sweep's). Fits of (op, group size, ranks per
    node) no sweep measured are kept."""
    from .profiler.run import collective_fits

    taken = [c["samples"] for c in read_collective_rounds(out, nproc)] if rounds else []
    if rounds and not taken:
        return hw
    own = profile_sweep_samples(hw)
    sweeps = ([own] if own else []) + taken
    if not sweeps:
        return hw
    fits = collective_fits(median_samples(sweeps))
    refit = {(f.op, f.group_size, f.ranks_per_node) for f in fits}
    kept = [c for c in hw.collectives if (c.op, c.group_size, c.ranks_per_node) not in refit]
    note = (f"collective curves: each point's median over {len(sweeps)} sweeps (the profile's"
            f"{' and ' + str(len(taken)) + ' validate rounds in ' + str(out) if taken else ''})")
    return dataclasses.replace(hw, collectives=tuple(kept + fits),
                               provenance={**hw.provenance, "collectives_from": note})
