"""Re-predict the measurements of one `parsim validate` folder (its newest executor version) with other profiles,
without running anything:

    python bench/probes/repredict.py DIR PROFILE...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parsim import validate as V
from parsim.hardware import load_profile

KEYS = ("n_ok", "tps_mape", "tps_max_ape", "step_time_mape", "spearman", "interval_coverage",
        "interval_median_rel_halfwidth", "top1_regret")


def main(out_dir: str, profiles: list[str]) -> None:
    lines = V.load_measurements(Path(out_dir) / "measurements.jsonl")
    version = lines[-1]["version"]
    lines = [ln for ln in lines if ln["version"] == version]
    for name in profiles:
        s = V.summarize(V.measured_rows(lines, load_profile(name)))
        rule = s.get("constant_mfu_rule") or {}
        print(name, len(lines), json.dumps({k: round(s[k], 4) if isinstance(s.get(k), float) else s.get(k)
                                            for k in KEYS}),
              "constant-MFU rule:", json.dumps({k: round(rule[k], 4) for k in ("tps_mape", "tps_max_ape")
                                               if isinstance(rule.get(k), float)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
