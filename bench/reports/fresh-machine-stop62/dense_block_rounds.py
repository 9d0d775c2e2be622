import json, sys
key_start = "d_model=256|n_heads=8|n_kv_heads=4|head_dim=32|d_ff=768|n_experts=0"
for f in sys.argv[1:]:
    try: blocks = [json.loads(l) for l in open(f + "/blocks.jsonl")]
    except (FileNotFoundError, NotADirectoryError): continue
    vals = [(b["round"], round(b["measurement"]["fwd_s"]*1e3,1), round(b["measurement"]["bwd_s"]*1e3,1), round(b["measurement"]["fwd_bwd_spread_s"]*1e3,1), b["measurement"].get("measured_at","")[11:16]) for b in blocks if b["key"].startswith(key_start) and "compile=0" in b["key"] and "micro_batch=1|seq_len=256" in b["key"]]
    print(f"{f[-26:]:26s}", vals)
