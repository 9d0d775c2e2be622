"""Predictions before and after a change that should not change them (a refactor): dump every output of many drawn
plans and of a few searches with one checkout, dump again with the other, compare.

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before python bench/equivalence.py dump /tmp/before.json
    python bench/equivalence.py dump /tmp/after.json
    python bench/equivalence.py compare /tmp/before.json /tmp/after.json

Plans are drawn with a seeded RNG over every preset model, every plan option and four profiles (two H100, B200,
the 2-rank CPU profile), kept when the structural rules accept them; each is predicted (every Prediction field,
its plan id and the executor's refusal). Six searches (dense, MoE, pinned options) keep their top 10, Pareto front
and counters; the counters of the search's own work (plans evaluated, replayed, pruned by which bound) are printed
beside the comparison, not compared. ``compare`` prints the first differences and exits 1 when any.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
PROFILES = ("h100-sxm-spec-cal", "h100-sxm-spec", "cpu-gloo-2-cal", "b200-spec-cal")
SEARCHES = [("llama3-8b", {"gpus": 8}), ("llama3-70b", {"gpus": 64, "ac": "full"}), ("mixtral-8x7b", {"gpus": 16}),
            ("llama3-8b", {"gpus": 16, "async_tp": True, "float8_recipe": "rowwise"}),
            ("qwen3-30b-a3b", {"gpus": 16, "distributed_optimizer": True}),
            ("llama3-8b", {"gpus": 8, "te_layers": True, "fused_loss": True, "tp": 2})]


def _draw(rng: random.Random, spec) -> dict:
    d = {a: rng.choice([1, 1, 2, 4, 8]) for a in AXES}
    if spec.moe is not None:
        d |= {"ep": rng.choice([1, 2, 4, 8]), "etp": rng.choice([1, d["tp"]]),
              "ep_from": rng.choice(["dp_shard", "dp_replicate"])}
    lbs = rng.choice([1, 2, 4, 8])
    d |= {"mesh_order": rng.sample(AXES, 5), "seq_len": rng.choice([1024, 2048, 4096, 8192]), "local_batch_size": lbs,
          "micro_batch_size": rng.choice([m for m in (1, 2, 4, 8) if lbs % m == 0]) if d["pp"] > 1 else 0,
          "global_batch_size": rng.choice([0, 0, 2 * lbs * d["dp_replicate"] * d["dp_shard"]]),
          "pp_schedule": rng.choice(["GPipe", "1F1B", "Interleaved1F1B"])}
    d |= {"pp_stages_per_rank": 2 if d["pp_schedule"] == "Interleaved1F1B" else 1,
          "sequence_parallel": rng.choice([None, True, False]),
          "fsdp_reshard_after_forward": rng.choice(["default", "always", "never"]),
          "ac": rng.choice(["none", "full", "selective-op", "layer:2", "layer:3"])}
    for k in ("compile", "float8", "async_tp", "distributed_optimizer", "te_layers", "fused_loss"):
        d[k] = rng.random() < 0.3
    d |= {"float8_recipe": rng.choice(["tensorwise", "rowwise", "rowwise_with_gw_hp"]),
          "param_dtype": rng.choice(["bfloat16", "bfloat16", "float32", "float16"]),
          "reduce_dtype": rng.choice(["float32", "bfloat16"]),
          "wrapper_order": rng.choice([("pp", "tp", "ac", "compile", "fsdp"), ("pp", "tp", "compile", "ac", "fsdp")])}
    return d


def dump_plans(n: int, seed: int) -> list[dict]:
    from parsim.codec import executor_refusal, validate_plan
    from parsim.costmodel.step import predict
    from parsim.errors import ParsimError
    from parsim.hardware import load_profile
    from parsim.plan import Plan
    from parsim.spec import PRESETS

    rng = random.Random(seed)
    profiles = {p: load_profile(p) for p in PROFILES}
    out: list[dict] = []
    for _ in range(200 * n):
        if len(out) == n:
            break
        model = rng.choice(sorted(PRESETS))
        d, prof = _draw(rng, PRESETS[model]), rng.choice(sorted(profiles))
        try:
            plan = Plan.from_dict(d)
            validate_plan(plan, PRESETS[model])
        except ParsimError:
            continue
        row = {"model": model, "profile": prof, "id": plan.plan_id, "exec": executor_refusal(plan, PRESETS[model])}
        try:
            row["pred"] = dataclasses.asdict(predict(PRESETS[model], plan, profiles[prof]))
        except ParsimError as e:
            row["error"] = str(e)
        out.append(row)
    return out


def dump_searches() -> list[dict]:
    from parsim.flags import search_space
    from parsim.hardware import load_profile
    from parsim.search import search
    from parsim.spec import load_model

    out = []
    for model, given in SEARCHES:
        gpus, space = search_space(dict(given))
        r = search(load_model(model), load_profile("h100-sxm-spec-cal"), gpus, space, top_k=10)
        out.append({"model": model, "given": given,
                    "top": [(row[0].plan_id, row[0].to_dict(), row[1], row[2]) for row in r.top],
                    "front": [(row[0].plan_id, row[1], row[2]) for row in r.pareto],
                    "counts": [r.considered, r.pruned_dominated], "pruned": r.pruned_structural,
                    # how much the pruned search evaluated and replayed (a faster search changes these, not its
                    # results): reported beside the comparison, not compared
                    "work": [r.evaluated, r.fitting, r.pruned_memory, r.pruned_bound]})
    return out


def compare(a: dict, b: dict) -> int:
    bad = 0
    for part in ("plans", "searches"):
        if len(a[part]) != len(b[part]):
            print(f"{part}: {len(a[part])} vs {len(b[part])} entries")
            bad += 1
        for i, (x, y) in enumerate(zip(a[part], b[part], strict=False)):
            wa, wb = x.pop("work", None), y.pop("work", None)
            if wa != wb:
                print(f"{part}[{i}] ({x.get('model')}): work (evaluated, known to fit, pruned by memory, pruned by "
                      f"bound) {wa} -> {wb}")
            if x != y:
                bad += 1
                if bad <= 5:
                    keys = [k for k in x if x[k] != y.get(k)]
                    print(f"{part}[{i}] ({x.get('model')}): differs in {keys}")
    print(f"{len(a['plans'])} plans, {len(a['searches'])} searches: {bad} differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--n", type=int, default=1500)
    d.add_argument("--seed", type=int, default=1)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "compare":
        return compare(json.load(open(args.a)), json.load(open(args.b)))
    doc = {"plans": dump_plans(args.n, args.seed), "searches": dump_searches()}
    with open(args.out, "w") as f:
        json.dump(doc, f, sort_keys=True, default=str)
    print(f"{len(doc['plans'])} plans, {len(doc['searches'])} searches -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
