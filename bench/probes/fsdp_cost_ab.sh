#!/bin/bash
# What FSDP costs tiny dp_shard 2 in its step: A = the plan on 2 ranks (executor's worker, 6 steps after 2 warm-up);
# B = two single-rank runs at once of the same per-rank work (dp_shard 1, global batch 4: the same 4 accumulation
# micro-steps of 1 x 256 tokens), no FSDP and no collectives, both cores busy as in A. Three interleaved pairs.
# A - B is the FSDP's collectives plus its framework overhead as the step pays them.
# usage: bash fsdp_cost_ab.sh PLAN_SHARD2.json PLAN_SINGLE.json OUTDIR
set -e
a=$1; b=$2; out=$3; mkdir -p "$out"
run() { python -m torch.distributed.run --nproc-per-node="$1" --standalone -m parsim.executor.worker --model tiny \
          --plan "$2" --out "$3" --steps 6 --warmup 2 --optimizer adamw > "$3.log" 2>&1; }
for i in 1 2 3; do
  run 2 "$a" "$out/A$i.json"
  OMP_NUM_THREADS=1 run 1 "$b" "$out/B${i}a.json" &
  OMP_NUM_THREADS=1 run 1 "$b" "$out/B${i}b.json"
  wait
  python -c "
import json, statistics as st
f = lambda n: st.median(json.load(open(n))['ranks'][0]['step_times_s'])
print('A', round(f('$out/A$i.json'), 3), 'B', round(f('$out/B${i}a.json'), 3), round(f('$out/B${i}b.json'), 3))"
done
