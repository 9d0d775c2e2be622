import json, sys, glob, statistics as st
from collections import defaultdict
folders = sys.argv[1:]
pairs = []
for f in folders:
    try:
        blocks = [json.loads(l) for l in open(f + "/blocks.jsonl")]
        meas = [json.loads(l) for l in open(f + "/measurements.jsonl")]
    except (FileNotFoundError, NotADirectoryError):
        continue
    # per round: block seconds summed over shapes present in every round
    by = defaultdict(dict)
    for b in blocks:
        m = b["measurement"]
        if b["key"].startswith("core"):
            continue
        t = sum(v for k, v in m.items() if k in ("fwd_s", "bwd_s", "out_fwd_s", "out_bwd_s"))
        by[b["round"]][b["key"]] = t
    rounds = sorted(by)
    common = set.intersection(*(set(by[r]) for r in rounds))
    bsum = {r: sum(by[r][k] for k in common) for r in rounds}
    bmed = st.median(bsum.values())
    steps = defaultdict(dict)
    for m in meas:
        if m.get("measurement") and m["measurement"].get("median_step_time_s"):
            steps[json.dumps(m["plan"], sort_keys=True)][m["round"]] = m["measurement"]["median_step_time_s"]
    rs = {}
    for r in rounds:
        ratios = [v[r] / st.median(v.values()) for v in steps.values() if r in v and len(v) == len(rounds)]
        rs[r] = st.median(ratios) if ratios else float("nan")
    line = "  ".join(f"r{r}: blocks {bsum[r]/bmed:.2f} steps {rs[r]:.2f}" for r in rounds)
    print(f"{f[-28:]:28s} {line}")
    pairs += [(bsum[r] / bmed, rs[r]) for r in rounds]
import numpy as np
a = np.array(pairs); print("n", len(a), "corr", np.corrcoef(a[:, 0], a[:, 1])[0, 1].round(2), "sd blocks", a[:, 0].std().round(3), "sd steps", a[:, 1].std().round(3))
