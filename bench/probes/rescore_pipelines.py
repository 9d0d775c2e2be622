"""Re-score the pipeline plans of the stored fresh-machine folders two ways: the schedule simulated on the shared
cores (the cost model since stop 62) and ``shared_cores``' larger lower bound (before), each folder with its own
profiles and rounds (as ``bench/fresh_machine.py``). Run from the checkout's root:

    python bench/probes/rescore_pipelines.py [FOLDER ...]

(default: the stop 58-61 folders). Prints one line per pipeline plan and a summary by plan family."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = [f"bench/reports/{s}/{r}" for s, runs in (("fsdp-overhead/2026-11-29", "tm4 tm2 t2"),
                                                      ("core-sharing/2026-11-29", "tm4 t4 tm2")) for r in runs.split()]


def rows(folder: Path, bounds_only: bool) -> list[tuple[str, float, float]]:
    """(plan, measured s, predicted s) of the folder's pipeline plans, one round's medians pooled by validate."""
    from parsim import validate as V
    from parsim.costmodel import step
    from parsim.loop_jobs import profile_measured_here

    sys.path.insert(0, str(ROOT / "bench"))
    from fresh_machine import with_rounds

    lines = V.load_measurements(folder / "measurements.jsonl")
    nproc = lines[0]["nproc"]
    hw, _ = with_rounds(profile_measured_here(f"cpu-gloo-{nproc}", nproc, log=lambda *a: None), folder, nproc)
    orig = step.shared_cores
    if bounds_only:
        step.shared_cores = lambda *a: orig(*a[:7])  # without the ranks' work: the larger bound
    try:
        return [(r["describe"], r["measured_step_s"], r["predicted_step_s"]) for r in V.measured_rows(lines, hw)
                if r["describe"].startswith("pp")]
    finally:
        step.shared_cores = orig


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":  # child: one folder, its own PARSIM_PROFILES_DIR
        for bounds_only in (True, False):
            for name, meas, pred in rows(Path(sys.argv[2]), bounds_only):
                print(f"{int(bounds_only)}\t{name}\t{meas:.4f}\t{pred:.4f}")
        return 0
    folders = sys.argv[1:] or DEFAULT
    fam: dict[str, list[tuple[float, float]]] = {}
    for f in folders:
        d = ROOT / f
        env = {**os.environ, "PARSIM_PROFILES_DIR": str(d.parent / "profiles")}
        out = subprocess.run([sys.executable, __file__, "--one", str(d)], env=env, capture_output=True, text=True,
                             check=True).stdout.splitlines()
        got = [ln.split("\t") for ln in out]
        before = [(n, float(m), float(p)) for b, n, m, p in got if b == "1"]
        after = [float(p) for b, _n, _m, p in got if b == "0"]
        for (name, meas, p0), p1 in zip(before, after, strict=True):
            e0, e1 = 100 * (p0 / meas - 1), 100 * (p1 / meas - 1)
            print(f"{f.split('/')[-2][-6:]}/{f.split('/')[-1]:4s} {name:38s} measured {meas:.3f}  bounds {p0:.3f} "
                  f"({e0:+6.1f}%)  simulated {p1:.3f} ({e1:+6.1f}%)")
            key = ("pp 4" if name.startswith("pp4") else "pp 2 x tp 2" if "tp2" in name else
                   "pp 2 on 2 ranks" if name.startswith("pp2 ") else "pp 2 x dp 2")
            fam.setdefault(key, []).append((e0, e1))
    print("\nfamily            rows  mean |error| bounds -> simulated   mean error bounds -> simulated")
    every = [x for v in fam.values() for x in v]
    for key, v in [*fam.items(), ("every pipeline", every)]:
        a0 = sum(abs(e0) for e0, _ in v) / len(v)
        a1 = sum(abs(e1) for _, e1 in v) / len(v)
        b0 = sum(e0 for e0, _ in v) / len(v)
        b1 = sum(e1 for _, e1 in v) / len(v)
        print(f"{key:17s} {len(v):4d}  {a0:5.1f}% -> {a1:5.1f}%               {b0:+5.1f}% -> {b1:+5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
