"""tiny's dense block (fp32, 256 tokens, tp 1, eager) per validate round of each folder: (round, forward ms,
backward ms, forward + backward spread ms, time of day).

    python bench/probes/dense_block_rounds.py FOLDER ...
"""

import json
import sys

KEY = "d_model=256|n_heads=8|n_kv_heads=4|head_dim=32|d_ff=768|n_experts=0"

for f in sys.argv[1:]:
    try:
        blocks = [json.loads(line) for line in open(f + "/blocks.jsonl")]
    except (FileNotFoundError, NotADirectoryError):
        continue
    vals = []
    for b in blocks:
        k, m = b["key"], b["measurement"]
        if k.startswith(KEY) and "compile=0" in k and "micro_batch=1|seq_len=256" in k:
            vals.append((b["round"], round(m["fwd_s"] * 1e3, 1), round(m["bwd_s"] * 1e3, 1),
                         round(m["fwd_bwd_spread_s"] * 1e3, 1), m.get("measured_at", "")[11:16]))
    print(f"{f[-26:]:26s}", vals)
