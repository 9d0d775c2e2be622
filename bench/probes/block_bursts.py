"""Per validate round of each folder: the block bursts' seconds (every shape timed in every round, summed) and the
plans' median step, each over the folder's median; then their correlation and spreads over all rounds.

    python bench/probes/block_bursts.py FOLDER ...
"""

import json
import statistics as st
import sys
from collections import defaultdict

import numpy as np


def folder_rounds(f: str) -> list[tuple[int, float, float]] | None:
    try:
        blocks = [json.loads(line) for line in open(f + "/blocks.jsonl")]
        meas = [json.loads(line) for line in open(f + "/measurements.jsonl")]
    except (FileNotFoundError, NotADirectoryError):
        return None
    by: dict = defaultdict(dict)
    for b in blocks:
        if not b["key"].startswith("core"):
            m = b["measurement"]
            by[b["round"]][b["key"]] = sum(v for k, v in m.items() if k in ("fwd_s", "bwd_s", "out_fwd_s", "out_bwd_s"))
    rounds = sorted(by)
    common = set.intersection(*(set(by[r]) for r in rounds))
    bsum = {r: sum(by[r][k] for k in common) for r in rounds}
    bmed = st.median(bsum.values())
    steps: dict = defaultdict(dict)
    for m in meas:
        if (m.get("measurement") or {}).get("median_step_time_s"):
            steps[json.dumps(m["plan"], sort_keys=True)][m["round"]] = m["measurement"]["median_step_time_s"]
    out = []
    for r in rounds:
        ratios = [v[r] / st.median(v.values()) for v in steps.values() if r in v and len(v) == len(rounds)]
        out.append((r, bsum[r] / bmed, st.median(ratios) if ratios else float("nan")))
    return out


pairs = []
for f in sys.argv[1:]:
    got = folder_rounds(f)
    if got:
        print(f"{f[-28:]:28s} " + "  ".join(f"r{r}: blocks {b:.2f} steps {s:.2f}" for r, b, s in got))
        pairs += [(b, s) for _r, b, s in got]
a = np.array(pairs)
print("n", len(a), "corr", np.corrcoef(a[:, 0], a[:, 1])[0, 1].round(2), "sd blocks", a[:, 0].std().round(3),
      "sd steps", a[:, 1].std().round(3))
