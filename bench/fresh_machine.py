"""Issue 23's must-show: accuracy on a fresh machine, without fitting, with and without what the profiler measured at
the plans' own shapes. Re-scores the measurements ``parsim validate --model M --nproc-per-node N --measure-blocks``
left in its folders (``DIR/measurements.jsonl``) against the profile of this machine that validate used, under four
variants of that profile, so that each measured quantity's share of the accuracy shows:

* ``measured``: blocks and the model's ends (embedding, output + loss) measured at the plans' shapes, the optimizer
  step measured (``optimizer_*``), framework overhead measured (``fsdp_call_*``, ``tp_block_*``): the profile with
  the folder's rounds applied (the blocks' means and the core-sharing median; collective curves refitted to the
  median over the profile's sweep and the rounds', ``parsim.collective_rounds``), as validate predicted;
* ``measured, the profile's collective sweep``: the same with the collective curves of the profile's one sweep
  (where the rounds swept the collectives);
* ``blocks only``: the measured blocks, without the ends and without the measured optimizer step;
* ``curves + measured optimizer``: no measured block or end;
* ``curves``: none of the three (framework overhead kept in all four: it is measured once per machine).

Nothing is fitted to the measured steps (uncalibrated profiles), so these figures are out of sample. The last column
is validate's ``repeatability``: how far one round's median falls from the plan's median, on average (the floor the
machine's drift puts under the step error).

    PARSIM_PROFILES_DIR=/tmp/fresh parsim validate --model tiny --nproc-per-node 2 --out /tmp/v-tiny-2 --rounds 1 \\
        --measure-blocks
    PARSIM_PROFILES_DIR=/tmp/fresh python bench/fresh_machine.py /tmp/v-tiny-2 /tmp/v-tiny-4 --json out.json

(``--profile-prefix fresh-`` where validate ran with ``--profile fresh-N``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from parsim import validate as V
from parsim.hardware import HardwareProfile

OPT_KEYS = ("optimizer_fixed_s", "optimizer_s_per_param", "optimizer_s_per_tensor")


def variants(hw: HardwareProfile, own_sweep: HardwareProfile) -> dict[str, HardwareProfile]:
    """``hw``: the profile with the folder's rounds applied (blocks, core sharing, collectives); ``own_sweep``: the
    same with the collective curves of the profile's own sweep alone."""
    blocks = {k: v for k, v in hw.measured_blocks.items() if not k.startswith("head|")}
    no_opt = {k: v for k, v in hw.corrections.items() if k not in OPT_KEYS}
    out = {"measured": hw}
    if own_sweep.collectives != hw.collectives:
        out["measured, the profile's collective sweep"] = own_sweep
    return {**out, "blocks only": dataclasses.replace(hw, measured_blocks=blocks, corrections=no_opt),
            "curves + measured optimizer": dataclasses.replace(hw, measured_blocks={}),
            "curves": dataclasses.replace(hw, measured_blocks={}, corrections=no_opt)}


def with_rounds(hw: HardwareProfile, folder: Path, nproc: int) -> tuple[HardwareProfile, HardwareProfile]:
    """The profile as validate predicted the folder's rows with: its rounds' block means and core-sharing median and its
    rounds' collective sweeps (the profile on disk keeps the last validate's); and the same with the profile's own
    collective sweep."""
    from parsim.collective_rounds import with_round_collectives
    from parsim.loop_jobs import read_block_rounds, with_round_blocks

    hw = with_round_blocks(hw, read_block_rounds(folder), nproc)
    return with_round_collectives(hw, folder, nproc), with_round_collectives(hw, folder, nproc, rounds=False)


def rescore(folder: Path, prefix: str) -> list[dict]:
    from parsim.loop_jobs import profile_measured_here

    lines = V.load_measurements(folder / "measurements.jsonl")
    out = []
    for nproc in sorted({ln["nproc"] for ln in lines}):
        sel = [ln for ln in lines if ln["nproc"] == nproc]
        hw = profile_measured_here(f"{prefix}{nproc}", nproc)
        for name, prof in variants(*with_rounds(hw, folder, nproc)).items():
            s = V.summarize(V.measured_rows(sel, prof))
            rule = s.get("constant_mfu_rule") or {}
            out.append({"folder": str(folder), "model": sel[0]["model"], "ranks": nproc, "variant": name,
                        "profile": hw.name, "plans": s.get("n"), "step_mean": s.get("step_time_mape"),
                        "step_max": s.get("step_time_max_ape"), "spearman": s.get("spearman"),
                        "top1_regret": s.get("top1_regret"), "rule_step_mean": rule.get("step_time_mape"),
                        "rule_step_max": rule.get("step_time_max_ape"), "rule_spearman": rule.get("spearman"),
                        "round_ape_mean": (s.get("repeatability") or {}).get("round_ape_mean")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--profile-prefix", default="cpu-gloo-",
                    help="the profile of N ranks is <prefix>N (validate's --profile; default: validate's own)")
    a = ap.parse_args(argv)
    rows = [r for f in a.folders for r in rescore(f, a.profile_prefix)]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    print("| model | ranks | plans | variant | step mean / max | Spearman | top-1 regret | rule mean / max / rho "
          "| rounds from median |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['ranks']} | {r['plans']} | {r['variant']} | {pct(r['step_mean'])} / "
              f"{pct(r['step_max'])} | {r['spearman']:.2f} | {pct(r['top1_regret'])} | {pct(r['rule_step_mean'])} / "
              f"{pct(r['rule_step_max'])} / {r['rule_spearman']:.2f} | {pct(r['round_ape_mean'])} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
