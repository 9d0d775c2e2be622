"""The search's memory bound against the replay on sampled search pairs and on drawn plans: every (row, memory
class) representative of 600 sampled rows of the benchmark spaces (``bench/search_speed.py``'s, on
h100-sxm-spec-cal) and up to 300 plans per (preset, profile) drawn as ``bench/equivalence.py`` draws them, each
checked for ``memory_lower_bound`` <= the replayed reserved memory, the bound of every reshard choice <= the
plan's own, and ``phases._optimizer_moment_upper`` >= the replayed optimizer moment; prints how tight the bound
is (replayed reserved / bound, quantiles) and the violations (exit 1 if any).

    python bench/probes/memory_bound_drawn.py [--draws 40000] [--seed 5]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import equivalence as E  # noqa: E402
from search_speed import cases  # noqa: E402

from parsim.codec import encode, validate_plan  # noqa: E402
from parsim.costmodel import evaluate  # noqa: E402
from parsim.costmodel import phases as P  # noqa: E402
from parsim.costmodel import step as ST  # noqa: E402
from parsim.costmodel.memory import MEMORY_KEYS, PHASES  # noqa: E402
from parsim.errors import ParsimError  # noqa: E402
from parsim.hardware import load_profile  # noqa: E402
from parsim.plan import Plan  # noqa: E402
from parsim.search import SearchSpace, _base_rows, _batch_at, _memory_classes, _options  # noqa: E402
from parsim.spec import PRESETS  # noqa: E402


def _optimizer_violations(spec, b, hw) -> int:
    sh, kinds = ST.Shapes(spec, b), ST.block_kinds(spec)
    costs = ST.kind_costs(spec, b, hw, kinds, ST.block_overheads(hw), times=False)
    bad = 0
    for rank, rv in zip((ST.FIRST, ST.LAST), ST.rank_views(spec, b, kinds), strict=True):
        c = ST.rank_compute(spec, b, sh, hw, rv, costs)
        phases, _ = P.rank_memory(spec, b, sh, rank, rv, c)
        at_opt, _ = P._rank_moment_bounds(spec, b, sh, rank, rv, c)
        opt = sum(phases[PHASES[-1]][k] for k in MEMORY_KEYS)
        bad += int((opt > P._optimizer_moment_upper(spec, b, rv, at_opt) * (1 + 1e-9)).sum())
    return bad


def check(tag: str, spec, b, hw) -> int:
    exact = evaluate(spec, b, hw, memory_only=True)["reserved_memory_bytes"]
    own, every = ST.memory_lower_bound(spec, b, hw), ST.memory_lower_bound(spec, b, hw, any_reshard=True)
    bad = int(((own > exact) | (every > own)).sum()) + _optimizer_violations(spec, b, hw)
    q = np.quantile(exact / np.maximum(own, 1.0), [0.1, 0.5, 0.9])
    print(f"{tag:36s} plans {len(b):6d}  violations {bad}  replayed / bound q10 {q[0]:.3f} median {q[1]:.3f} "
          f"q90 {q[2]:.3f}", flush=True)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=40000)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    bad = 0
    hw = load_profile("h100-sxm-spec-cal")
    for name, gpus, gbs, seq in cases():
        spec, sp = PRESETS[name], SearchSpace(global_batch_size=gbs, seq_len=seq)
        base = _base_rows(spec, gpus, sp, hw.gpus_per_node, {})
        opts, base["orders"] = _options(sp, hw)
        rows = np.random.default_rng(0).choice(len(base["row_start"]), size=min(600, len(base["row_start"])),
                                               replace=False)
        gid = ((base["row_start"][rows] * len(opts))[:, None] + _memory_classes(opts)[1][None, :]).ravel()
        bad += check(f"{name} / {gpus} GPUs", spec, _batch_at(base, opts, gid, sp, None), hw)
    rng, profiles = random.Random(args.seed), {p: load_profile(p) for p in E.PROFILES}
    drawn: dict = {}
    for _ in range(args.draws):
        model = rng.choice(sorted(PRESETS))
        d, prof = E._draw(rng, PRESETS[model]), rng.choice(sorted(profiles))
        try:
            plan = Plan.from_dict(d)
            validate_plan(plan, PRESETS[model])
        except ParsimError:
            continue
        drawn.setdefault((model, prof), []).append(plan)
    for (model, prof), plans in sorted(drawn.items()):
        bad += check(f"drawn {model} on {prof}", PRESETS[model], encode(plans[:300], None), profiles[prof])
    print(f"violations: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
