"""Diagnostic (stop 60): re-score a fresh-machine folder with the profile's ``compute_scale`` replaced.

    PARSIM_PROFILES_DIR=<profiles> python bench/reports/fresh-machine-stop60/compute_scale_sensitivity.py DIR 2.0 2.1

Prints the rounds' value, then per value: step mean / max (%), Spearman, top-1 regret. Not a fit: it shows how much
of a run's error one measured quantity moves."""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
from fresh_machine import with_rounds  # noqa: E402

from parsim import validate as V  # noqa: E402
from parsim.loop_jobs import profile_measured_here  # noqa: E402

folder = Path(sys.argv[1])
lines = V.load_measurements(folder / "measurements.jsonl")
nproc = lines[0]["nproc"]
hw, _ = with_rounds(profile_measured_here(f"cpu-gloo-{nproc}", nproc, log=lambda *a: None), folder, nproc)
c = hw.corrections
print("compute_scale", c.get("compute_scale"), "probe", c.get("framework_probe_compute_scale"))
for cs in [float(x) for x in sys.argv[2:]]:
    h = dataclasses.replace(hw, corrections={**hw.corrections, "compute_scale": cs})
    s = V.summarize(V.measured_rows(lines, h))
    print(cs, round(100 * s["step_time_mape"], 1), round(100 * s["step_time_max_ape"], 1), round(s["spearman"], 2),
          s["top1_regret"])
