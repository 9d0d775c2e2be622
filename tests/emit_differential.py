"""The emitters against the frameworks' own checks, over drawn plans (not a fixed matrix).

Draws structurally valid plans of the torchtitan-registry presets on 8..512 GPUs (degrees, batch split and schedule
from the search's own candidate rows, options drawn on top: AC mode, compile, float8 and its recipe, reshard,
sequence parallel, async TP, the distributed optimizer, EP source), writes each as torchtitan 0.3.0 Python,
torchtitan 0.2 TOML and Megatron-LM arguments, and runs the framework checks of ``tests/frameworks`` on them
(torchtitan's ConfigManager + ParallelDims + model build; Megatron-LM's parse_args + validate_args). Two sources of
truth: what parsim emits, what the framework accepts and settles on. A plan is a failure when the framework
refuses the emitted file, or settles on degrees other than the plan's (where parsim says no gap about them).

    python bench/emit_differential.py --n 200 --seed 0 --out DIR [--megatron PATH] [--venvs DIR]

Writes DIR/cases.csv (one row per plan and framework) and prints the failures grouped by the framework's message.
Needs the package registry once (the torchtitan venvs) and, for Megatron, a Megatron-LM checkout (the folder
holding megatron/, as ``PARSIM_MEGATRON_LM`` for the tests)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import venv
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from parsim.codec import decode, invalid_reasons, validate_plan
from parsim.emit import TORCHTITAN_MODELS, to_megatron_args, to_torchtitan_python, to_torchtitan_toml
from parsim.errors import ParsimError
from parsim.search import SearchSpace, candidates
from parsim.spec import PRESETS

CHECKS = Path(__file__).resolve().parent.parent / "tests" / "frameworks"
GPUS = (8, 16, 32, 64, 128, 256, 512)
FRAMEWORKS = {  # name: (emit, suffix, check script, venv packages)
    "torchtitan-0.3.0": (to_torchtitan_python, ".py", "torchtitan_030_check.py", ["torchtitan==0.3.0", "triton",
                                                                                 "torchao"]),
    "torchtitan-0.2.2": (to_torchtitan_toml, ".toml", "torchtitan_022_check.py", ["torchtitan==0.2.2", "torchao"]),
    "megatron": (to_megatron_args, ".sh", "megatron_check.py", ["torchtitan==0.3.0", "triton", "torchao"]),
}


def _options(rng: np.random.Generator, plan):
    """The plan with options drawn on top of its degrees (a draw the rules refuse is redrawn by the caller)."""
    ac = rng.choice(["none", "full", "selective-op", f"layer:{int(rng.integers(2, 4))}"])
    f8 = bool(rng.random() < 0.3)
    kw = dict(ac=str(ac), compile=bool(rng.random() < 0.5), float8=f8,
              float8_recipe=str(rng.choice(["tensorwise", "rowwise", "rowwise_with_gw_hp"])) if f8 else "tensorwise",
              fsdp_reshard_after_forward=str(rng.choice(["default", "always", "never"])),
              sequence_parallel=bool(rng.random() < 0.8), async_tp=bool(plan.tp > 1 and rng.random() < 0.3),
              distributed_optimizer=bool(plan.dp_replicate > 1 and plan.dp_shard == 1 and rng.random() < 0.5))
    return dataclasses.replace(plan, **kw)


def draw_plans(n: int, seed: int) -> list[tuple[str, object]]:
    """``n`` (model name, plan) pairs: a preset and a GPU count, then one valid candidate row of the search's space
    for them (every EP source), then options."""
    rng = np.random.default_rng(seed)
    out: list[tuple[str, object]] = []
    cache: dict = {}
    while len(out) < n:
        name = str(rng.choice(sorted(TORCHTITAN_MODELS)))
        gpus = int(rng.choice(GPUS))
        spec = PRESETS[name]
        key = (name, gpus)
        if key not in cache:
            gbs = gpus * int(rng.choice([1, 2, 4]))
            sp = SearchSpace(global_batch_size=gbs, seq_len=int(rng.choice([4096, 8192])),
                             pp_schedules=("GPipe", "1F1B", "Interleaved1F1B"))
            _, _, b = candidates(spec, gpus, sp)
            cache[key] = (b, np.nonzero(invalid_reasons(b, spec) == "")[0])
        b, ok = cache[key]
        if not len(ok):
            continue
        plan = decode(b, int(rng.choice(ok)))
        for _ in range(20):
            try:
                cand = _options(rng, plan)
                validate_plan(cand, spec, cand.world_size)
            except ParsimError:
                continue
            out.append((name, cand))
            break
    return out


def framework_venv(base: Path, pkgs: list[str]) -> Path:
    """A venv seeing this interpreter's packages (the pinned torch) with ``pkgs`` on top; made once. Raises
    RuntimeError with pip's message when the registry cannot give them (the venv is then not kept as made)."""
    import torch

    py = base / "bin" / "python"
    if not py.exists():
        venv.create(base, system_site_packages=True, with_pip=True)
        pin = base / "torch-pin.txt"
        pin.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(pin), *pkgs], capture_output=True,
                           text=True, timeout=1800)
        if r.returncode:
            py.unlink()
            raise RuntimeError(f"cannot install {pkgs} from the package registry: {r.stderr.strip()[-300:]}")
    return py


def run_checks(py: Path, script: str, files: list[tuple[Path, int]], env=None) -> dict[str, dict]:
    args = [str(a) for path, world in files for a in (path, world)]
    r = subprocess.run([str(py), str(CHECKS / script), *args], capture_output=True, text=True, env=env,
                       timeout=3600)
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[Path(d.pop("path")).stem] = d
    missing = [p.stem for p, _ in files if p.stem not in out]
    for stem in missing:  # the checker died on that file (a crash outside the framework's refusals)
        out[stem] = {"error": "checker stopped: " + r.stderr.strip()[-300:]}
    return out


def settled_degrees(framework: str, d: dict) -> list[int] | None:
    """(dp_replicate x dp_shard, tp, pp, cp, ep) as the framework settled them."""
    if "error" in d:
        return None
    if framework == "megatron":
        return [d["data_parallel_size"], d["tensor_model_parallel_size"], d["pipeline_model_parallel_size"],
                d["context_parallel_size"], d["expert_model_parallel_size"]]
    dr, ds, tp, pp, cp, ep = d["degrees"][:6]
    return [dr * ds, tp, pp, cp, ep]


def compare(framework: str, plan, d: dict, text: str) -> str:
    """'' when the framework accepted the file with the plan's degrees (or the EP the emitter says it emits
    instead, in its gap lines), else a short failure kind."""
    if "error" in d:
        if "will not start" in text:  # a refusal the emitter predicted, with its reason, in the file's gap lines
            return ""
        return "refused: " + re.sub(r"\d+", "N", d["error"].splitlines()[0])[:140]
    got = settled_degrees(framework, d)
    want = [plan.dp_replicate * plan.dp_shard, plan.tp, plan.pp, plan.cp, plan.ep]
    if got == want:
        return ""
    said_ep1 = "expert_parallel_degree=1 is emitted" in text
    if said_ep1 and got[:4] == want[:4] and got[4] == 1:
        return ""
    names = ["dp", "tp", "pp", "cp", "ep"]
    return "degrees: " + ", ".join(f"{n} {w}->{g}" for n, w, g in zip(names, want, got, strict=True) if w != g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--megatron", default=os.environ.get("PARSIM_MEGATRON_LM"))
    ap.add_argument("--venvs", type=Path, default=Path.home() / ".cache" / "parsim-emit-venvs")
    ap.add_argument("--only", default=None, help="one framework of " + ", ".join(FRAMEWORKS))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plans = draw_plans(args.n, args.seed)
    rows = []
    for fw, (emit, suffix, script, pkgs) in FRAMEWORKS.items():
        if args.only and fw != args.only or fw == "megatron" and not args.megatron:
            continue
        folder = args.out / fw.replace(".", "_")
        folder.mkdir(exist_ok=True)
        files, texts = [], {}
        for i, (name, plan) in enumerate(plans):
            path = folder / f"parsim_plan_{i:04d}{suffix}"
            texts[path.stem] = emit(plan, PRESETS[name])
            path.write_text(texts[path.stem])
            files.append((path, plan.world_size))
        py = framework_venv(args.venvs / ("venv-" + ("torchtitan-0.2.2" if fw.endswith("0.2.2") else
                                                    "torchtitan-0.3.0")), pkgs)
        env = {**os.environ, "PYTHONPATH": args.megatron} if fw == "megatron" else None
        results = run_checks(py, script, files, env)
        for (path, _), (name, plan) in zip(files, plans, strict=True):
            d = results[path.stem]
            rows.append({"framework": fw, "file": path.name, "model": name, "describe": plan.describe(),
                         "plan": json.dumps(plan.to_dict(), sort_keys=True),
                         "failure": compare(fw, plan, d, texts[path.stem]), "error": d.get("error", "")[:400]})
        print(f"{fw}: {len(files)} plans checked", flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(args.out / "cases.csv", index=False)
    for fw, g in df.groupby("framework"):
        bad = g[g.failure != ""]
        print(f"\n{fw}: {len(g)} plans, {len(bad)} failures")
        for kind, k in Counter(bad.failure).most_common():
            example = bad.loc[bad.failure == kind, "describe"].iloc[0]
            print(f"  {k:4d}  {kind}   e.g. {example}")


if __name__ == "__main__":
    sys.exit(main())
