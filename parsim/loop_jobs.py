"""The validate / calibrate loop and this machine's profile as library calls: measure plans here and score the
predictions (``validate_measured``), score published runs (``validate_published``), measure blocks at plans' local
shapes into a profile (``measure_plan_shapes``, ``measure_blocks_into``), fit and cross-validate the calibration
and write the calibrated profiles (``calibrate_dirs``), and the profile that describes this machine
(``profile_measured_here``). The command line parses, calls these and renders what they return.

Torch-free at import (measuring imports the profiler and the executor when asked for). Progress goes to a
``progress(task, done, total[, label])`` callback, lines for the user to ``log``.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ParsimError
from .progress import Log, Progress, log_to_stderr


def profile_for_this_machine(name: str, log: Log = log_to_stderr):
    """Load a profile; a measured CPU profile from another machine, or one that lacks what the current profiler
    measures (stale), gets one warning line."""
    from .hardware import load_profile
    from .machine import missing_quantities, warning

    hw = load_profile(name)
    w = warning(hw)
    if w:
        log(w)
    elif missing_quantities(hw):
        log(f"warning: profile {hw.name} is stale: the profiler now also measures {', '.join(missing_quantities(hw))}"
            " (what a step spends beside the curves); re-measure: parsim profile --nproc-per-node N --out NAME")
    return hw


def profile_measured_here(name: str, nproc: int | None = None, log: Log = log_to_stderr):
    """The profile to predict runs on this machine with: ``name`` when it describes this machine as the current
    profiler would (or is not a measured CPU profile: spec sheets and GPU profiles describe hardware elsewhere);
    otherwise this machine's own, ``<name>-<machine tag>``, loaded when an earlier call measured it, else measured
    now with ``parsim profile`` defaults (2-3 minutes on 2 cores) and kept beside the others. A profile is
    re-measured when it was measured on another machine, or on this one by an earlier profiler that did not
    measure what the step spends beside the curves (``machine.missing_quantities``: framework overhead, the
    optimizer step, core sharing). ``validate --model`` and ``search --execute`` use it: a prediction set beside a
    measurement must describe the machine that measured, with what the profiler measures today."""
    from .hardware import load_profile
    from .machine import machine_tag, missing_quantities, warning

    def why_not(p) -> str | None:
        w = warning(p)
        if w:
            return f"it was measured on another machine ({w})"
        missing = missing_quantities(p)
        return f"it was measured before the profiler measured {', '.join(missing)}" if missing else None

    hw = load_profile(name)
    why = why_not(hw)
    if why is None:
        return hw
    own = f"{hw.name}-{machine_tag()}"
    try:
        mine = load_profile(own)
        if why_not(mine) is None:
            log(f"profile {hw.name}: {why}; using this machine's {own}")
            return mine
    except ParsimError:
        pass
    n = nproc or int(hw.provenance.get("device_count") or 2)
    log(f"profile {hw.name}: {why}; measuring this machine first: parsim profile --nproc-per-node {n} --out {own}")
    from .profiler.run import profile as _profile

    return _profile(own, n, log=log)


def validate_measured(model: str, nproc: int, out_dir: str, *, profile: str | None, rounds: int, steps: int,
                      max_plans: int, timeout_s: float, measure_blocks: bool = False,
                      progress: Progress | None = None, log: Log = log_to_stderr) -> dict:
    """``parsim validate --model``: the model's measured plan set run here (``rounds`` x ``steps``), each
    prediction beside its measurement, the folder's rows and summary written (every measurement in it)."""
    from . import validate as V
    from .spec import load_model

    if nproc < 1 or nproc > 64:
        raise ParsimError(f"--nproc-per-node must be in 1..64, got {nproc}")
    if rounds < 1 or steps < 1:
        raise ParsimError("--rounds and --steps must be >= 1")
    spec = load_model(model)
    plans = V.measured_plans(spec, nproc)
    if max_plans:
        plans = plans[:max_plans]
    hw = profile_measured_here(profile or f"cpu-gloo-{nproc}", nproc, log)  # this machine's, before anything runs
    out = Path(out_dir)
    task = f"{model} on {nproc} ranks"
    before_round = None
    if measure_blocks:  # the blocks and the collectives timed at the start of every round, beside the steps
        from .collective_rounds import measure_collective_round

        shapes = _measured_shapes([(spec, p) for p in plans])

        def before_round(r: int) -> None:
            measure_collective_round(out, r, nproc, timeout_s, progress)
            measure_block_round(out, r, shapes, progress, sharing_ranks=nproc)
    V.run_measured(model, nproc, out, rounds=rounds, steps=steps, timeout_s=timeout_s, plans=plans,
                   progress=(lambda done, total, what: progress(task, done, total, what)) if progress else None,
                   before_round=before_round)
    return measured_summary(out, profile, hw, measure_blocks, progress, log)


def measured_summary(out: Path, profile: str | None, hw, measure_blocks: bool = False,
                     progress: Progress | None = None, log: Log = log_to_stderr) -> dict:
    """Rows and summary over every measurement in the folder (earlier models and rank counts included). With
    ``measure_blocks`` the plans' blocks are measured at their local shapes first (kept in the profile) and the
    summary without them is written beside, with the wall time of the measurement. Where validate's rounds timed
    the collectives, both predict with curves refitted to the sweeps' medians (``collective_rounds``)."""
    import dataclasses

    from . import validate as V
    from .collective_rounds import read_collective_rounds, with_round_collectives

    lines = V.load_measurements(out / "measurements.jsonl")
    block_rounds = read_block_rounds(out)
    coll_rounds = read_collective_rounds(out)
    rows, rows_curves, walls, n_shapes = [], [], {}, 0
    for nproc in sorted({ln["nproc"] for ln in lines}):
        prof = hw if profile else profile_measured_here(f"cpu-gloo-{nproc}", nproc, log)
        prof = with_round_collectives(prof, out, nproc)
        sel = [ln for ln in lines if ln["nproc"] == nproc]
        if measure_blocks:  # the curves alone: without any block the profile already holds
            rows_curves += V.measured_rows(sel, dataclasses.replace(prof, measured_blocks={}))
            prof, w, n = _with_measured_blocks(prof, sel, progress, block_rounds)
            walls.update(w)
            n_shapes += n
        rows += V.measured_rows(sel, prof)
    summary = V.summarize(rows)
    meta: dict = {"tier": "measured", "profile": profile or "cpu-gloo-<ranks>"}
    if measure_blocks:
        meta["measured_blocks"] = {"shapes": n_shapes, "measured_now": len(walls),
                                   "measurement_wall_s": sum(walls.values()) + sum(
                                       float(b["measurement"].get("wall_s") or 0.0) for b in block_rounds),
                                   "rounds": len({b["round"] for b in block_rounds})}
        meta["collective_rounds"] = {"sweeps": len(coll_rounds), "measurement_wall_s": sum(
            float(c.get("wall_s") or 0.0) for c in coll_rounds)}
        meta["without_measured_blocks"] = V.summarize(rows_curves)
        meta["components"] = _components(out, V.component_differences(rows_curves, rows))
    V.write_results(out, rows, summary, meta)
    return {**summary, **{k: v for k, v in meta.items() if k != "tier"}}


def _components(out: Path, diffs: list[dict]) -> dict:
    """Write ``components.csv`` (every plan's components, curves beside measured blocks) and return, per
    component, the median over plans of each side as a share of the measured step."""
    import pandas as pd

    from .jsonio import atomic_write_text

    df = pd.DataFrame(diffs)
    if df.empty:
        return {}
    atomic_write_text(out / "components.csv", df.to_csv(index=False))
    df = df[df["measured_step_s"].notna()]
    share = df.assign(curves=df["curves_s"] / df["measured_step_s"], blocks=df["blocks_s"] / df["measured_step_s"])
    med = share.groupby("component")[["curves", "blocks"]].median()
    return {k: {"curves_share_of_measured": float(v["curves"]), "blocks_share_of_measured": float(v["blocks"])}
            for k, v in med.iterrows()}


def measure_plan_shapes(plan_file: str, out: str, out_dir: str | None, model: str | None,
                        progress: Progress | None = None) -> dict:
    """``parsim profile --measure-shapes-of PLANFILE --out PROFILE``: the blocks and ends (embedding, output and
    loss) of the plans in the file, measured at their local shapes on this device and kept in the profile
    (resumable: shapes it has are not re-measured)."""
    from .blockshape import plan_measured_shapes
    from .hardware import HardwareProfile
    from .jsonio import read_json
    from .plan import Plan
    from .profiler.run import resolve_profile_out
    from .spec import load_model

    doc = read_json(Path(plan_file), "cannot read the plan file")
    entries = doc if isinstance(doc, list) else [doc]
    shapes, skipped = [], 0
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("plan"), dict) or not (model or e.get("model")):
            raise ParsimError(f"{plan_file}: each entry needs 'model' and 'plan' (as search --emit-plan writes)")
        got = plan_measured_shapes(load_model(model or e["model"]), Plan.from_dict(e["plan"]))
        shapes += [s for s in got if s is not None]
        skipped += sum(s is None for s in got)
    path = resolve_profile_out(out, out_dir)
    if not path.exists():
        raise ParsimError(f"profile {path} does not exist: measure one first (parsim profile --nproc-per-node N)")
    hw = HardwareProfile.from_dict(read_json(path, "corrupt profile"), origin=str(path))
    shapes = list(dict.fromkeys(shapes))
    hw, walls = measure_blocks_into(hw, shapes, path, progress)
    return {"profile": str(path), "shapes": len(shapes), "not_measurable": skipped, "measured_now": len(walls),
            "measurement_wall_s": sum(walls.values())}


def _measured_shapes(pairs) -> list:
    """The distinct measurable shapes (blocks and ends) of (spec, plan) pairs, in order."""
    from .blockshape import plan_measured_shapes

    shapes = [s for spec, plan in pairs for s in plan_measured_shapes(spec, plan) if s]
    return list(dict.fromkeys(shapes))


def _with_measured_blocks(hw, lines: list[dict], progress: Progress | None = None,
                          block_rounds: list[dict] | None = None):
    """The profile with a block and the ends measured at every local shape of the plans in ``lines``: the mean
    over validate's rounds where ``block_rounds`` has them (``round_means``), else measured now; written to the
    profile folder under the profile's name. (profile, {key: wall s of those measured now}, number of shapes)."""
    from .hardware import atomic_write_json, profile_write_dir
    from .plan import Plan
    from .spec import load_model

    shapes = _measured_shapes([(load_model(ln["model"]), Plan.from_dict(ln["plan"])) for ln in lines])
    path = profile_write_dir() / f"{hw.name}.json"
    if lines and block_rounds:
        hw = with_round_blocks(hw, block_rounds, int(lines[0]["nproc"]), {s.key for s in shapes})
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, hw.to_dict())
    hw, walls = measure_blocks_into(hw, shapes, path, progress)
    return hw, walls, len(shapes)


def with_round_blocks(hw, block_rounds: list[dict], nproc: int, keys: set | None = None):
    """``hw`` with the means over validate's rounds of every block shape they timed (those in ``keys`` where
    given) and the median of the core-sharing factor of ``nproc`` processes (``compute_scale``)."""
    import dataclasses

    means = {k: v for k, v in round_means(block_rounds).items() if keys is None or k in keys}
    sharing = round_core_sharing(block_rounds, nproc)
    if not means and sharing is None:
        return hw
    return dataclasses.replace(hw, measured_blocks={**hw.measured_blocks, **means}, corrections={
        **hw.corrections, **({"compute_scale": sharing} if sharing is not None else {})})


BLOCK_ROUNDS = "blocks.jsonl"
ROUND_MEAN_KEYS = ("fwd_s", "bwd_s", "emb_fwd_s", "emb_bwd_s", "out_fwd_s", "out_bwd_s")


CORE_SHARING = "core_sharing|"  # the key prefix of the core-sharing lines of blocks.jsonl


def read_block_rounds(out: Path) -> list[dict]:
    """The block measurements validate made at the start of its rounds (``DIR/blocks.jsonl``: round, key,
    measurement), [] without."""
    from .validate import load_measurements

    return load_measurements(out / BLOCK_ROUNDS)


def _core_sharing_key(ranks: int) -> str:
    return f"{CORE_SHARING}ranks={ranks}"


def measure_block_round(out: Path, r: int, shapes, progress: Progress | None = None, sharing_ranks: int = 0) -> None:
    """Time every shape once more at the start of validate's round ``r`` (those this round has not timed yet) and
    append each to ``DIR/blocks.jsonl``. Measured once, a burst of a few seconds, the blocks take the machine's
    speed of that moment: on a shared 2-core machine blocks of one burst ran 10-40% slower than the same blocks
    a day later, and every prediction made with them moved alike. Timed in every round, interleaved with the
    steps, their median sees the drift the plans' medians see. Float8 shapes need a GPU (skipped off one). With
    ``sharing_ranks`` > 1 the core-sharing factor of that many single-threaded processes
    (``profiler.compute.core_sharing_sample``, the profile's ``compute_scale``, which multiplies every rank's
    compute) is timed in the round too: on 4 ranks here it read 2.05 and 2.20 in two profiles made 10 minutes
    apart, a 7% move of every 4-rank prediction."""
    import time

    from .profiler.blocks import measure_shape
    from .validate import append_line

    have = {(b["round"], b["key"]) for b in read_block_rounds(out)}
    if sharing_ranks > 1 and (r, _core_sharing_key(sharing_ranks)) not in have:
        from .profiler.compute import core_sharing_sample

        if progress:
            progress(f"round {r + 1}: core sharing of {sharing_ranks} processes", 0, 1)
        t0 = time.perf_counter()
        sample = core_sharing_sample(sharing_ranks)
        append_line(out / BLOCK_ROUNDS, {"round": r, "key": _core_sharing_key(sharing_ranks),
                                         "measurement": {**sample, "wall_s": time.perf_counter() - t0}})
    todo = [s for s in shapes if (r, s.key) not in have]
    task = f"round {r + 1}: timing {len(todo)} block shapes"
    for i, shape in enumerate(todo):
        if progress:
            progress(task, i, len(todo), shape.key[:40])
        try:
            m = measure_shape(shape)
        except ValueError:  # a float8 block off a GPU
            continue
        append_line(out / BLOCK_ROUNDS, {"round": r, "key": shape.key, "measurement": m})  # one line per shape
    if progress:
        progress(task, len(todo), len(todo), "")


def round_core_sharing(block_rounds: list[dict], ranks: int) -> float | None:
    """The median over validate's rounds of the core-sharing factor of ``ranks`` processes (at least 1), None where
    no round timed it."""
    import statistics

    f = [b["measurement"]["factor"] for b in block_rounds if b["key"] == _core_sharing_key(ranks)]
    return max(1.0, float(statistics.median(f))) if f else None


def round_means(block_rounds: list[dict]) -> dict:
    """Per shape key, its measurement with each time the mean over the rounds that timed it (``rounds``: how
    many, ``round_range_s``: each time's lowest and highest).

    The mean, not the median [derived from measurement]: one round's burst (a fresh block, 2 warm-ups, 5
    repetitions, about 0.35 s) reads one of two levels on this 2-core AVX2 EPYC (tiny's dense block 8.5-9.5 or
    11.5-12.6 ms forward, steady within a burst, on either CPU), and over 69 stored rounds the bursts moved 7.8%
    (sd) where the rounds' steps moved 2.7%, uncorrelated (0.01; ``bench/reports/pipeline-shared-cores/2026-11-29/
    block-bursts.txt``): the steps run through both levels, and the median of three rounds picks one of them.
    Re-scored, six stored 3-round folders went 10.3% -> 9.6% on average with the mean (five better; one tiny / 2
    ranks 14.1% -> 11.7%, one tiny-moe / 2 9.7% -> 10.1%); with two rounds mean and median agree."""
    import statistics

    by_key: dict[str, list[dict]] = {}
    for b in block_rounds:
        if not b["key"].startswith(CORE_SHARING):
            by_key.setdefault(b["key"], []).append(b["measurement"])
    out = {}
    for key, ms in by_key.items():
        entry = dict(ms[-1])
        fields = [f for f in ROUND_MEAN_KEYS if all(f in m for m in ms)]
        entry.update({f: statistics.fmean(m[f] for m in ms) for f in fields}, rounds=len(ms),
                     round_range_s={f: [min(m[f] for m in ms), max(m[f] for m in ms)] for f in fields})
        out[key] = entry
    return out


def measure_blocks_into(hw, shapes, path: Path, progress: Progress | None = None):
    """The blocks of ``shapes`` the profile lacks, timed on this device and written with the profile to ``path``
    after each (``profiler.blocks.add_measured_blocks``): (profile, {key: wall s})."""
    from .profiler.blocks import add_measured_blocks

    path.parent.mkdir(parents=True, exist_ok=True)  # the user's profile folder, on first use
    task = f"measuring {len(shapes)} block shapes"
    return add_measured_blocks(hw, shapes, path,
                               progress=(lambda d, t, k: progress(task, d, t)) if progress else None)


def validate_published(csv: str, out_dir: str, profile: str | None, calibrated: bool = True) -> dict:
    """``parsim validate --published CSV``: every published run predicted (spec-sheet profiles, calibrated or
    not), the folder's rows and summary written."""
    from . import validate as V
    from .hardware import load_profile

    profiles = {}
    if profile:
        hw = load_profile(profile)
        base = hw.provenance.get("calibrated_from", hw.name)
        profiles[base] = hw
    rows = V.published_rows(csv, profiles, calibrated=calibrated)
    summary = V.summarize(rows)
    V.write_results(Path(out_dir), rows, summary, {"tier": "published", "csv": csv, "profile": profile or (
        "spec-cal" if calibrated else "spec")})
    return summary


def load_rows(dirs: list[str]) -> list[dict]:
    """The rows of validate folders (their ``rows.json``, ``validate.check_rows``), each with the folder it came
    from."""
    from .jsonio import exists, read_json
    from .validate import check_rows

    rows = []
    for d in dirs:
        p = Path(d) / "rows.json"
        if not exists(p):
            raise ParsimError(f"{d}: no rows.json (run `parsim validate --out {d}` first)")
        data = check_rows(read_json(p, "cannot read"), str(p))
        for r in data:
            r.setdefault("dir", d)
        rows += data
    if not rows:
        raise ParsimError(f"no rows in {', '.join(dirs)} (rows.json holds an empty list)")
    return rows


def calibrate_dirs(dirs: list[str], params: str | None, folds: int, out_dir: str | None,
                   folds_by: str | None = None) -> dict:
    """Fit, cross-validate (``folds_by`` family or source; None: ``calibrate.default_fold_kind``), write the
    calibrated profile(s) and each folder's calibration.json."""
    import math
    import os

    from . import calibrate as C
    from .hardware import load_profile, profile_write_dir
    from .jsonio import atomic_write_json, check_output_path
    from .validate import summarize

    rows = load_rows(dirs)
    gpu = all(r.get("tier") == "published" for r in rows)
    names = tuple(p.strip() for p in params.split(",")) if params else (
        C.GPU_PARAMETERS if gpu else C.DEFAULT_PARAMETERS)
    profiles = {n: load_profile(n) for n in sorted({r["profile"] for r in rows if r.get("profile")})}
    target = Path(out_dir) if out_dir else profile_write_dir()
    for n in profiles:
        check_output_path(target / f"{n}-cal.json", make_parents=True)
    by = folds_by or C.default_fold_kind([r for r in rows if r.get("status") == "ok"])
    res = C.calibrate(rows, profiles, names, folds, by)
    scored = res["rows"]
    q = res["interval_log_halfwidth"]
    views = {}
    for key, pred, half in (("uncalibrated", res["uncalibrated"], None), ("in_sample", res["in_sample"], None),
                            ("out_of_fold", res["out_of_fold"], res["interval_fold_halfwidth"])):
        view = []
        for i, r in enumerate(scored):
            v = dict(r, predicted_step_s=float(pred[i]))
            v["interval_s"] = None if half is None or not math.isfinite(half[i]) else \
                [float(pred[i] * math.exp(-half[i])), float(pred[i] * math.exp(half[i]))]
            view.append(v)
        views[key] = summarize(view)
    stats = {"out_of_fold": views["out_of_fold"], "in_sample": views["in_sample"],
             "uncalibrated": views["uncalibrated"]}
    written = []
    for n, hw in profiles.items():
        new = C.calibrated_profile(hw, res, {k: _headline(v) for k, v in stats.items()}, list(dirs))
        written.append(os.path.relpath(new.save(target / f"{n}-cal.json")))
    for d in dirs:
        mine = [i for i, r in enumerate(scored) if r["dir"] == d]
        atomic_write_json(Path(d) / "calibration.json", {
            "factors": res["factors"], "fold_ranges": res["fold_ranges"], "unidentified": res["unidentified"],
            "interval_log_halfwidth": q, "folds_by": by,
            "profiles": written, "stats": stats,
            "rows": {scored[i]["plan_id"] + "/" + scored[i]["model"]: {
                "out_of_fold_step_s": float(res["out_of_fold"][i]), "in_sample_step_s": float(res["in_sample"][i]),
                "fold": int(res["folds"][i]), "fold_log_halfwidth": _finite(res["interval_fold_halfwidth"][i])}
                for i in mine}})
    return {"factors": res["factors"], "parameters": {n: C.PARAMETERS[n][0] for n in names},
            "fold_ranges": res["fold_ranges"], "unidentified": res["unidentified"],
            "interval_log_halfwidth": q, "n_rows": len(scored), "folds": int(max(res["folds"]) + 1), "folds_by": by,
            "profiles_written": written, **stats}


def _finite(x):
    import math

    return float(x) if math.isfinite(x) else None


def _headline(s: dict) -> dict:
    keys = ("n", "step_time_mape", "step_time_max_ape", "spearman", "interval_coverage",
            "interval_median_rel_halfwidth", "top1_regret")
    return {k: s.get(k) for k in keys}


def calibrate_traces(dirs: list[str], profile: str | None, out_dir: str | None) -> dict:
    """`parsim calibrate --trace`: each folder (``run --profile-trace``) is one traced plan; fit the profile's
    factors to their components (``trace_calibrate``), write ``<profile>-trace-cal.json``."""
    import os

    from . import trace_calibrate as T
    from .hardware import load_profile, profile_write_dir
    from .jsonio import check_output_path
    from .plan import Plan
    from .spec import load_model
    from .traceread import PLAN_FILE, read_traces, recorded_plan

    plans = []
    for d in dirs:
        doc = recorded_plan([d])
        if doc is None:
            raise ParsimError(f"{d}: no {PLAN_FILE} (what ran): trace with `parsim run --profile-trace {d}`")
        plan = Plan.from_dict(doc["plan"])
        plans.append(T.TracedPlan(spec=load_model(doc["model"]), plan=plan, traces=tuple(read_traces([d], plan)),
                                  unprofiled_step_s=doc.get("unprofiled_median_step_s")))
    if profile:
        hw = load_profile(profile)
    else:
        from .run_prep import cpu_run_profile

        hw, why = cpu_run_profile(None, plans[0].plan.world_size)
        if hw is None:
            raise ParsimError(f"give --profile: {why}")
    target = (Path(out_dir) if out_dir else profile_write_dir()) / f"{hw.name}-trace-cal.json"
    check_output_path(target, make_parents=True)
    fit = T.fit_traced(plans, hw)
    new = T.trace_calibrated_profile(hw, plans, fit, list(dirs))
    written = os.path.relpath(new.save(target))
    rows = []
    for tp, t, b, a, steps in zip(plans, fit["traced"], fit["before"], fit["after"], fit["steps"], strict=True):
        comps = sorted({k for k in list(t) + list(a) if k in T.SHOWN_COMPONENTS or (k.startswith("comm_")
                                                                       and k != "comm_interference")})
        rows.append({"plan": f"{tp.spec.name} {tp.plan.describe()}", "traced_step_s": sum(steps) / len(steps),
                     "predicted_before_s": b["step"], "predicted_after_s": a["step"],
                     "components": [{"component": k, "traced_s": t.get(k, 0.0), "before_s": b.get(k, 0.0),
                                     "after_s": a.get(k, 0.0)} for k in comps]})
    return {"profile": hw.name, "written": written, "factors": fit["factors"],
            "parameters": {n: T.PARAMETERS[n][0] for n in fit["factors"]},
            "interval_log_halfwidth_by_group": new.calibration["interval_log_halfwidth_by_group"],
            "interval_log_halfwidth": new.calibration["interval_log_halfwidth"], "plans": rows}
