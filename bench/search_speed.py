"""Search speed and search work: every space of the table below searched in full (the default, pruned search), its
wall time, the work it did (``SearchResult.work``: plans evaluated in full, (row, memory class) pairs whose memory
timeline was replayed, replay batches, timelines and pipeline schedules replayed) and, where the space is small
enough, the exhaustive search beside it (every plan evaluated) with whether the best plan and the Pareto front
agree.

    python bench/search_speed.py [--only NAME] [--no-exhaustive] [--cli] [--json]

The spaces: five of public runs' sizes (DeepSeek-V3: 15,360 x 4,096 on 2,048 GPUs, arXiv:2412.19437) and every
preset at the README's command-1 defaults (64 GPUs, global batch 256, sequence 8,192). ``--cli`` also times
``parsim search`` as a user runs it (a fresh process: start-up and imports included). Wall times depend on the
machine; the work counts do not (``tests/test_search.py`` bounds them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parsim.hardware import load_profile  # noqa: E402
from parsim.search import SearchSpace, search  # noqa: E402
from parsim.spec import PRESETS  # noqa: E402

PUBLIC = [("llama3-8b", 64, 256, 8192), ("llama3-70b", 256, 512, 8192), ("mixtral-8x7b", 64, 256, 8192),
          ("qwen3-30b-a3b", 64, 256, 4096), ("deepseek-v3", 2048, 15360, 4096)]
README_DEFAULTS = [(name, 64, 256, 8192) for name in PRESETS]
EXHAUSTIVE_MAX_PLANS = 15_000_000  # larger spaces take too long evaluated plan by plan (~2 min per 10 M here)
PROFILE = "h100-sxm-spec-cal"


def cases() -> list[tuple]:
    return list(dict.fromkeys(PUBLIC + README_DEFAULTS))


def _same(a, b) -> dict:
    best = bool(a.top and b.top and a.top[0][0].plan_id == b.top[0][0].plan_id and a.top[0][1] == b.top[0][1])
    front = [(p.plan_id, t, m) for p, t, m in a.pareto] == [(p.plan_id, t, m) for p, t, m in b.pareto]
    return {"same_best": best or (not a.top and not b.top), "same_front": front}


def _cli_wall_s(name: str, gpus: int, gbs: int, seq: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "parsim", "search", "--model", name, "--gpus", str(gpus),
                    "--global-batch-size", str(gbs), "--seq-len", str(seq), "--json"], check=True,
                   capture_output=True)
    return time.perf_counter() - t0


def run_case(name: str, gpus: int, gbs: int, seq: int, exhaustive: bool, cli: bool) -> dict:
    hw = load_profile(PROFILE)
    sp = SearchSpace(global_batch_size=gbs, seq_len=seq, max_plans=0)
    t0 = time.perf_counter()
    fast = search(PRESETS[name], hw, gpus, sp)
    row: dict = {"model": name, "gpus": gpus, "global_batch_size": gbs, "seq_len": seq,
                 "considered": fast.considered, "wall_s": time.perf_counter() - t0, "work": fast.work,
                 "best": (f"{fast.top[0][0].describe()} AC {fast.top[0][0].ac} {fast.top[0][1]:.3f} s"
                          if fast.top else "nothing fits"), "pareto": len(fast.pareto)}
    if exhaustive and fast.considered <= EXHAUSTIVE_MAX_PLANS:
        t0 = time.perf_counter()
        full = search(PRESETS[name], hw, gpus, dataclasses.replace(sp, prune=False))
        row["exhaustive_wall_s"] = time.perf_counter() - t0
        row.update(_same(fast, full))
    if cli:
        row["cli_wall_s"] = _cli_wall_s(name, gpus, gbs, seq)
    return row


def _line(r: dict) -> str:
    w = r["work"]
    agree = "-" if "same_best" not in r else ("same best" if r["same_best"] else "best DIFFERS") + (
        ", same front" if r["same_front"] else ", front DIFFERS")
    ex = f"{r['exhaustive_wall_s']:8.1f}" if "exhaustive_wall_s" in r else f"{'-':>8}"
    cli = f"{r['cli_wall_s']:6.1f}" if "cli_wall_s" in r else f"{'-':>6}"
    shape = f"{r['global_batch_size']:>6}x{r['seq_len']:<5}"
    return (f"{r['model']:<14} {r['gpus']:>5} {shape} {r['considered']:>13,} {r['wall_s']:7.2f} {cli} {ex} "
            f"{w.get('plans_evaluated', 0):>9,} {w.get('memory_pairs_replayed', 0):>8,} "
            f"{w.get('memory_replay_batches', 0):>4} {w.get('timeline_replays', 0) + w.get('schedule_replays', 0):>6}"
            f"  {r['best']} ({agree})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="one model")
    ap.add_argument("--no-exhaustive", action="store_true", help="only the pruned search")
    ap.add_argument("--cli", action="store_true", help="also time `parsim search` in a fresh process")
    ap.add_argument("--json", action="store_true", help="one JSON document of every case")
    args = ap.parse_args()
    rows = []
    if not args.json:
        print(f"{'model':<14} {'GPUs':>5} {'batch x seq':>12} {'considered':>13} {'wall s':>7} {'cli s':>6} "
              f"{'exh. s':>8} {'evaluated':>9} {'replayed':>8} {'bat':>4} {'tl+sch':>6}  best (agrees with the "
              "exhaustive?)")
    for name, gpus, gbs, seq in cases():
        if args.only and args.only != name:
            continue
        r = run_case(name, gpus, gbs, seq, not args.no_exhaustive, args.cli)
        rows.append(r)
        if not args.json:
            print(_line(r), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
