"""`parsim validate`: prediction beside measurement, two sources of truth, one row format.

* measured here (tier 2): every plan of a small space is predicted with this machine's profile and run for real
  with the executor (torchrun + gloo on CPU); rounds are interleaved (round r runs every plan once, in a rotated
  order) so that slow drifts of a shared machine spread over all plans; each run keeps the median of its steps and
  the plan keeps the median over rounds and the spread of every step (``repeatability``: how far a round's median
  falls from the plan's, the floor under the step error that the machine's drift sets). Results are appended to
  ``measurements.jsonl`` keyed by plan_id + model + ranks + executor code version and reused when the command is
  run again (interrupt it, run it again: finished runs are not repeated). A failed plan is a recorded row.
* published (tier 3): every row of a CSV in the schema of ``bench/published/dev.csv`` is predicted with its
  spec-sheet profile and compared with the published tokens/s/GPU (as step time: tokens per GPU per step / rate)
  and memory. Rows the model cannot represent are rows with a reason.

Both write ``rows.json`` (one dict per plan or row, see ``ROW_KEYS``) and ``summary.json`` (``summarize``). The
statistics and the constant-MFU rule of thumb are torch-free; only the measured runner starts torch (in workers).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .codec import validate_plan
from .costmodel import predict
from .errors import ParsimError, ParsimWarning
from .hardware import HardwareProfile, load_profile
from .jsonio import atomic_write_json, input_file, loads, read_text
from .plan import Plan
from .spec import PRESETS, ModelSpec, MoESpec, load_model

ROW_KEYS = ("tier", "source", "table", "model", "spec", "plan_id", "describe", "family", "n_gpus", "status",
            "reason",
            "measured_step_s", "measured_spread_s", "predicted_step_s", "interval_s", "measured_peak_bytes",
            "predicted_peak_bytes", "predicted_reserved_bytes", "measured_memory_kind", "fits", "time_breakdown_s",
            "model_work_s", "confidence", "plan", "profile", "measured_rounds_s")
MEASURED_SEQ, MEASURED_GLOBAL_BATCH = 256, 8
# what ``check_rows`` holds a row read back to: the strings every row has, the numbers it may have (None where
# not measured or not predicted), the lists of numbers and the objects
_ROW_STRINGS = ("tier", "model", "plan_id", "status")
_ROW_NUMBERS = ("n_gpus", "measured_step_s", "predicted_step_s", "measured_peak_bytes", "predicted_peak_bytes",
                "predicted_reserved_bytes", "model_work_s")
_ROW_NUMBER_LISTS = ("measured_spread_s", "interval_s", "measured_rounds_s")
_ROW_OBJECTS = ("plan", "spec", "time_breakdown_s")


def check_rows(data, where: str) -> list[dict]:
    """``data`` (a ``rows.json`` read back) as rows: a list of objects, each with the strings of ``_ROW_STRINGS``
    (``tier`` measured or published), finite numbers or null where ``_ROW_NUMBERS`` and ``_ROW_NUMBER_LISTS`` name
    a field, objects or null where ``_ROW_OBJECTS`` do; else one ParsimError line naming the row and the field."""
    if not isinstance(data, list):
        raise ParsimError(f"{where}: expected a list of rows, got {type(data).__name__}")
    for i, r in enumerate(data):
        if not isinstance(r, dict):
            raise ParsimError(f"{where}: row {i} is {type(r).__name__}, not an object")
        for k in _ROW_STRINGS:
            if not isinstance(r.get(k), str):
                raise ParsimError(f"{where}: row {i} has no {k} (a string)")
        if r["tier"] not in ("measured", "published"):
            raise ParsimError(f"{where}: row {i} has tier {r['tier']!r} (measured or published)")
        for k in _ROW_NUMBERS + _ROW_NUMBER_LISTS:
            v = r.get(k)
            values = v if k in _ROW_NUMBER_LISTS and isinstance(v, list) else [v]
            if v is not None and not all(_finite_number(x) for x in values):
                raise ParsimError(f"{where}: row {i} {k}={str(v)[:40]} is not a finite number (or a list of them)")
        for k in _ROW_OBJECTS:
            if r.get(k) is not None and not isinstance(r[k], dict):
                raise ParsimError(f"{where}: row {i} {k} is {type(r[k]).__name__}, not an object")
        if isinstance(r.get("time_breakdown_s"), dict) and not all(
                _finite_number(x) for x in r["time_breakdown_s"].values()):
            raise ParsimError(f"{where}: row {i} time_breakdown_s holds a value that is not a finite number")
    return data


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- the small space of the measured tier ------------------------------------------------------------------------


def family_of(plan: Plan) -> str:
    """Plans that differ only in options (AC, compile, reshard, schedule, micro batch) share a family: the unit
    that cross-validation keeps in one fold."""
    return plan.describe() + (f"/ep_from={plan.ep_from}" if plan.ep > 1 else "")


def measured_plans(spec: ModelSpec, nproc: int, *, seq_len: int = MEASURED_SEQ,
                   global_batch_size: int = MEASURED_GLOBAL_BATCH, param_dtype: str = "float32") -> list[Plan]:
    """Every legal degree combination on ``nproc`` ranks that the executor runs (HSDP, TP, PP, EP with dp2ep; no CP:
    the executor runs it (loss parity in tests/test_executor.py) but its attention is not a measured block
    (``blockshape``) and the set is kept comparable with earlier figures; no DDP-style EP, a cost-model option:
    ``codec``'s executor rules)
    with default options, plus option variants of the FSDP plan (AC full / selective-op / layer:2, compile,
    reshard never) and of a PP plan (GPipe, Interleaved1F1B, more microbatches)."""
    from .search import SearchSpace, candidates

    sp = SearchSpace(global_batch_size=global_batch_size, seq_len=seq_len, cp=(1,), pp_schedules=("1F1B",))
    from .codec import executor_refusals, invalid_reasons, plan_kwargs

    _, _, b = candidates(spec, nproc, sp)
    ok = np.nonzero((invalid_reasons(b, spec) == "") & (executor_refusals(b, spec) == ""))[0]
    by_degrees: dict[tuple, Plan] = {}
    for i in ok:
        kw = plan_kwargs(b, int(i))
        p = Plan(**{**kw, "param_dtype": param_dtype})
        key = (p.pp, p.dp_replicate, p.dp_shard, p.tp, p.ep, p.etp, p.ep_from)
        # one batch split per degree combination: the fewest microbatches the schedule allows
        if key not in by_degrees or p.n_microbatches < by_degrees[key].n_microbatches:
            by_degrees[key] = p
    plans = list(by_degrees.values())
    fsdp = next((p for p in plans if p.dp_shard == nproc and p.ep == 1), None)
    if fsdp is not None:
        plans += [Plan(**{**fsdp.to_dict(), **v}) for v in (dict(ac="full"), dict(ac="selective-op"),
                                                              dict(ac="layer:2"), dict(compile=True),
                                                              dict(fsdp_reshard_after_forward="never"))]
    pp = next((p for p in plans if p.pp == 2 and p.tp == 1 and p.ep == 1), None)
    if pp is not None:
        lbs = pp.local_batch_size
        variants = [dict(pp_schedule="GPipe"), dict(micro_batch_size=1)]
        if spec.n_layers >= 4 and lbs >= 2:
            variants.append(dict(pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, micro_batch_size=1))
        for v in variants:
            try:
                variant = Plan(**{**pp.to_dict(), **v})
                validate_plan(variant, spec, nproc)
                plans.append(variant)
            except ParsimError:
                pass
    return list({p.plan_id: p for p in plans}.values())


# ---- the measured runner ------------------------------------------------------------------------------------------


def executor_version() -> str:
    """Hash of the code that runs and measures a plan (``parsim/executor/``): a result is reused only while it
    holds. What a plan or model means is in the key already (plan_id, model name)."""
    root = Path(__file__).resolve().parent
    files = sorted((root / "executor").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _key(model: str, plan: Plan, nproc: int, version: str) -> str:
    return f"{model}/{plan.plan_id}/{nproc}/{version}"


def load_measurements(path: Path) -> list[dict]:
    """Lines of a JSON-lines file (measurements.jsonl, blocks.jsonl); a torn last line (an interrupted write) is
    ignored."""
    out = []
    if path.exists():
        for line in read_text(path, "cannot read").splitlines():
            try:
                out.append(loads(line, str(path)))
            except ParsimError:
                continue
    return out


def append_line(path: Path, line: dict) -> None:
    """Append one JSON line to ``path``, flushed: an interrupt loses at most the line under way."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()


def run_measured(model: str, nproc: int, out_dir: Path, *, rounds: int = 2, steps: int = 5, warmup: int = 2,
                 timeout_s: float = 600.0, plans: list[Plan] | None = None,
                 progress: Callable[[int, int, str], None] | None = None,
                 before_round: Callable[[int], None] | None = None) -> list[dict]:
    """Run every plan ``rounds`` times, interleaved; append each run to measurements.jsonl; return all lines of
    this model and rank count (those of earlier invocations included). ``before_round(r)`` is called once before
    the first run of each round that has a run left to do (``--measure-blocks`` times the blocks and sweeps the
    collectives there, so that they see the machine's drift as the steps do)."""
    from .executor.launch import run_plan

    spec = load_model(model)
    plans = plans if plans is not None else measured_plans(spec, nproc)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "measurements.jsonl"
    version = executor_version()
    done = {(r["key"], r["round"]) for r in load_measurements(path)}
    todo = [(r, p) for r in range(rounds) for p in plans[r % len(plans):] + plans[:r % len(plans)]]
    started: set[int] = set()
    for n, (r, plan) in enumerate(todo):
        key = _key(model, plan, nproc, version)
        if progress:
            progress(n, len(todo), f"{model} {plan.describe()} round {r + 1}")
        if (key, r) in done:
            continue
        if before_round and r not in started:
            started.add(r)
            before_round(r)
        m = run_plan(model, plan, nproc, steps=steps, warmup=warmup, timeout_s=timeout_s, device="cpu")
        append_line(path, {"key": key, "round": r, "model": model, "nproc": nproc, "version": version,
                           "plan": plan.to_dict(), "measurement": m.to_dict()})  # one line per run
    if progress:
        progress(len(todo), len(todo), "done")
    keys = {_key(model, p, nproc, version) for p in plans}
    return [r for r in load_measurements(path) if r["key"] in keys]


def measured_rows(lines: list[dict], hw: HardwareProfile) -> list[dict]:
    """One row per (model, plan, ranks): median over rounds of each run's median step, spread of all steps."""
    groups: dict[tuple, list[dict]] = {}
    for ln in lines:  # runs of the same plan by earlier code versions count too (the key makes re-runs resume)
        groups.setdefault((ln["model"], Plan.from_dict(ln["plan"]).plan_id, ln["nproc"]), []).append(ln)
    rows = []
    for runs in groups.values():
        plan = Plan.from_dict(runs[0]["plan"])
        spec = load_model(runs[0]["model"])
        ms = [r["measurement"] for r in runs]
        good = [m for m in ms if m["status"] == "ok" and m.get("median_step_time_s")]
        row = _predicted(spec, plan, hw, tier="measured", source=f"cpu-gloo-{runs[0]['nproc']}", table="validate",
                         confidence="high")
        if good:
            steps = [s for m in good for s in m["step_times_s"] if s is not None]
            rounds_s = [float(m["median_step_time_s"]) for m in good]
            row.update(status="ok", measured_step_s=float(np.median(rounds_s)), measured_rounds_s=rounds_s,
                       measured_spread_s=[min(steps), max(steps)],
                       measured_peak_bytes=float(max(m["peak_memory_bytes"] for m in good)))
        else:
            row.update(status=ms[-1]["status"], reason=(ms[-1].get("error") or "")[:300])
        rows.append(row)
    return rows


def _predicted(spec: ModelSpec, plan: Plan, hw: HardwareProfile, **kw) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update(kw, model=spec.name, spec=spec.to_dict(), plan_id=plan.plan_id, describe=_describe(plan),
               family=family_of(plan), n_gpus=plan.world_size, plan=plan.to_dict(), profile=hw.name, status="ok",
               reason="")
    try:
        p = predict(spec, plan, hw)
    except ParsimError as e:
        row.update(status="unrepresentable", reason=str(e))
        return row
    row.update(predicted_step_s=p.step_time_s, predicted_peak_bytes=p.peak_memory_bytes,
               predicted_reserved_bytes=p.reserved_memory_bytes, fits=p.fits,
               time_breakdown_s=p.time_breakdown_s, interval_s=list(p.interval_s) if p.interval_s else None,
               model_work_s=p.mfu * p.step_time_s)
    return row


def _describe(plan: Plan) -> str:
    extra = [plan.ac if plan.ac != "none" else "", "compile" if plan.compile else "",
             "float8" if plan.float8 else "",
             f"raf={plan.fsdp_reshard_after_forward}" if plan.fsdp_reshard_after_forward != "default" else "",
             (plan.pp_schedule + (f"/v{plan.pp_stages_per_rank}" if plan.pp_stages_per_rank > 1 else "")
              + f"/mb{plan.micro_batch_size}") if plan.pp > 1 else ""]
    return " ".join([plan.describe()] + [e for e in extra if e])


# ---- the published tier ---------------------------------------------------------------------------------------------


def _num(v, default=None):
    if v is None or (isinstance(v, float) and math.isnan(v)) or v == "":
        return default
    return v


def _whole(r: dict, key: str, default=None) -> int:
    """Column ``key`` of a published row as a whole number (``default`` where empty); a value that is not one (text,
    a fraction, inf, beyond 2**53) raises ParsimError naming the column."""
    v = _num(r.get(key), default)
    if v is None:
        raise ParsimError(f"{key} is missing")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ParsimError(f"{key}={v!r} is not a number") from None
    if not math.isfinite(f) or f != math.floor(f) or abs(f) > 2**53:
        raise ParsimError(f"{key}={v!r} is not a whole number")
    return int(f)


def published_plan(r: dict) -> tuple[ModelSpec, Plan]:
    """The (model, plan) of one published row, batch words mapped: without PP a micro batch smaller than the
    per-rank batch is gradient accumulation (parsim: local batch = micro batch, the global batch keeps the rest);
    with PP the per-rank batch is split into microbatches in one step. EP is borrowed from dp_replicate when the
    source runs Megatron-style DDP (dp_shard 1; folded over dp_replicate x cp x tp where EP does not divide
    dp_replicate), else torchtitan's dp2ep. Raises ParsimError with the reason when
    the row cannot be represented."""
    spec = _published_spec(r)
    deg = {a: _whole(r, a, 1) for a in ("dp_replicate", "dp_shard", "tp", "pp", "cp")}
    ep = _whole(r, "ep", 1)
    ac = _num(r.get("ac"))
    if ac is None:
        raise ParsimError(f"AC not representable: {str(r.get('notes', ''))[:160]}")
    ac = framework_ac(r, str(ac))
    lbs, mbs, gbs = (_whole(r, k) for k in ("local_batch_size", "micro_batch_size", "global_batch_size"))
    sched = _num(r.get("pp_schedule"), "1F1B")
    v = _whole(r, "pp_stages_per_rank", 1)
    if deg["pp"] > 1 and sched == "Interleaved1F1B" and _num(r.get("pp_stages_per_rank")) is None:
        v, why = assumed_virtual_stages(r, spec.n_layers, deg["pp"])
        warnings.warn(ParsimWarning(f"{r.get('id', 'row')}: Interleaved1F1B without a virtual-stage count: "
                                    f"assumed {v} stages per rank ({why})"), stacklevel=2)
    if deg["pp"] == 1:
        lbs = mbs
        sched, v = "1F1B", 1
    # Megatron DDP: the expert mesh inside dp_replicate where EP divides it (the same ranks as folding when
    # tp = cp = 1), else folded over dp_replicate x cp x tp (EP larger than the data-parallel size)
    megatron = ep > 1 and deg["dp_shard"] == 1
    ep_from = ("dp_replicate" if deg["dp_replicate"] % ep == 0 else "folded") if megatron else "dp_shard"
    plan = Plan(**deg, ep=ep, ep_from=ep_from, **note_options(r, deg), seq_len=_whole(r, "seq_len"),
                local_batch_size=lbs, micro_batch_size=mbs, global_batch_size=gbs, pp_schedule=sched,
                pp_stages_per_rank=v, ac=ac, compile=bool(_whole(r, "compile", 0)), float8=bool(_whole(r, "float8", 0)),
                fsdp_reshard_after_forward=_num(r.get("fsdp_reshard_after_forward"), "default"))
    if plan.world_size != _whole(r, "gpus"):
        raise ParsimError(f"degrees multiply to {plan.world_size}, the row says {r['gpus']} GPUs")
    validate_plan(plan, spec, _whole(r, "gpus"))
    return spec, plan


def assumed_virtual_stages(r: dict, n_layers: int, pp: int) -> tuple[int, str]:
    """(stages per rank, why) for an interleaved row that does not state them: what the framework that ran it
    does when the count is left out, or, where it must be given, what its published configurations give.

    * torchtitan (and frameworks parsim does not know, which run torchtitan-like defaults): 2 stages per rank —
      ``stages_per_rank = 1 if is_single_stage_schedule else 2`` when ``pipeline_parallel_layers_per_stage`` is
      unset (torchtitan/distributed/pipeline_parallel.py, 0.2.2 and 0.3.0) [framework default];
    * Megatron-Core / NeMo: the virtual size has no default (interleaving is off without it); the interleaved
      Megatron-Bridge and NeMo performance configurations that state it use 2 layers per virtual stage for
      70B / 175B / 405B / DeepSeek-V3 (1 for two 40-layer models), so n_layers / (2 pp), at least 2 [assumed from
      those configurations]."""
    where = f"{_num(r.get('source'), '')} {_num(r.get('table'), '')}".lower()
    if any(w in where for w in ("megatron", "nemo")):
        return max(2, n_layers // (2 * pp)), "Megatron configurations: about 2 layers per virtual stage"
    return 2, "torchtitan's default for multi-stage schedules"


def note_options(r: dict, deg: dict) -> dict:
    """Plan options the published columns cannot hold, read from the row's notes where the dataset's README puts
    them (the same words for every row):

    * float8 recipe: "rowwise_with_gw_hp" / "rowwise" / otherwise tensorwise (torchao's default);
    * async TP: "asynctp" / "async TP", not negated ("async TP off", "no async TP"); on Megatron-family rows
      (TE layers) with TP > 1 also when the notes do not say: their performance recipes overlap TP communication
      with the GEMMs (``tp_comm_overlap`` with userbuffers: Megatron-Bridge's ``COMM_OVERLAP_CONFIG_MAP`` gives
      llama3 70B / 405B on H100 ``userbuffers_{bf16,fp8}_h100_h8192_tp4_mbs1_seqlen8192`` / ``..._h16384_tp8_cp2``,
      NeMo's recipes import the same userbuffers configs) [framework source; assumed for rows whose recipe was not
      read], unless the notes negate it ("TP comm overlap off");
    * distributed optimizer: Megatron-style DDP (dp_replicate > 1, dp_shard 1) whose notes speak of optimizer-state
      sharding — Megatron-Bridge rows say its distributed optimizer is used ("distributed-optimizer state
      sharding"); NeMo 24.07 rows say "optimizer-state sharding not stated", and NeMo's launcher configs for these
      models use ``distributed_fused_adam`` [assumed from those configs]."""
    n = str(_num(r.get("notes"), "")).lower()
    opts = framework_options(r)
    recipe = "rowwise_with_gw_hp" if "gw_hp" in n else "rowwise" if "rowwise" in n else "tensorwise"
    overlap = r"(async ?tp|tp comm(unication)? overlap)"
    said = re.search(r"\basync ?tp\b", n) is not None
    negated = re.search(rf"\bno {overlap}\b|\b{overlap}\s*off\b", n) is not None
    async_tp = deg["tp"] > 1 and not negated and (said or bool(opts.get("te_layers")))
    ddp = deg["dp_replicate"] > 1 and deg["dp_shard"] == 1
    dist = ddp and ("optimizer-state sharding" in n or "optimizer state sharding" in n)
    return {"float8_recipe": recipe, "async_tp": async_tp, "distributed_optimizer": dist, **opts,
            **torchtitan_compiled_loss(r)}


# torchtitan compiles the loss with the model when compile is on since bbb1b61 (2025-04-02, "refactor
# train_spec.loss_fn to build_loss_fn": ``if job_config.training.compile: loss_fn = torch.compile(loss_fn)`` in
# torchtitan/components/loss.py); before, the compile of the loss was commented out ("compiling loss function causes
# CUDA errors", train.py @9dec370) [framework source]
TORCHTITAN_COMPILED_LOSS_SINCE = (2025, 4)


def torchtitan_compiled_loss(r: dict) -> dict:
    """``fused_loss`` for a torchtitan row with compile whose table is dated (``YYYYMM`` / ``YYYY-MM`` in its name)
    on or after TORCHTITAN_COMPILED_LOSS_SINCE: inductor fuses the fp32 cross-entropy (no fp32 copy of the
    logits, no log-softmax output kept: the memory of parsim's fused loss). Undated rows keep torch's eager loss."""
    if "torchtitan" not in str(_num(r.get("source"), "")).lower() or not int(_num(r.get("compile"), 0)):
        return {}
    m = re.search(r"(20\d\d)[-_]?(0[1-9]|1[0-2])(?!\d)", str(_num(r.get("table"), "")))
    if m and (int(m.group(1)), int(m.group(2))) >= TORCHTITAN_COMPILED_LOSS_SINCE:
        return {"fused_loss": True}
    return {}


# what the framework that ran a row does by default and a plan must say (configuration, not a fitted factor):
# (words of which one must appear in the row's source or table, framework, plan options, where it is set)
FRAMEWORKS = (
    (("megatron", "nemo"), "Megatron-Core", {"te_layers": True, "grad_sync": "once"},
     "Megatron-Core's default layer spec is Transformer Engine's (transformer_impl='transformer_engine'), "
     "which NeMo and Megatron-Bridge use; its schedules run every microbatch but the last under the DDP "
     "wrapper's no_sync (forward_backward_no_pipelining / the pipelined schedules' no_sync_func), so gradients "
     "are reduced once per step"),
    (("llm-foundry", "llmfoundry", "mosaicml"), "llm-foundry", {"fused_loss": True, "attention_kernel": "triton"},
     "MPT's loss_fn defaults to 'fused_crossentropy' (flash-attn's xentropy CrossEntropyLoss) [assumed from "
     "llm-foundry's MPT code; the tables do not print it]; the benchmark tables were run by "
     "scripts/train/benchmarking/submit_benchmarks.py, whose --attn_impl defaults to 'triton' (the Triton "
     "FlashAttention kernel) at the commits that wrote them (b2a43a1, 2023-10, and 5e85bd6, 2024-01) "
     "[framework source]"),
)


def framework_ac(r: dict, ac: str) -> str:
    """A row's AC as its framework runs it: Megatron-family sources' "selective" (written selective or
    selective-op) is Megatron's ``--recompute-granularity selective``, whose default ``--recompute-modules
    core_attn`` recomputes the attention core alone (``core-attn``), not torchtitan's per-op policy [framework
    source: Megatron-LM arguments.py, "selective: submodules set in --recompute-modules are recomputed, default
    is core_attn"]."""
    if ac in ("selective", "selective-op") and framework_options(r).get("te_layers"):
        return "core-attn"
    return "selective-op" if ac == "selective" else ac


def framework_options(r: dict) -> dict:
    """The plan options of the framework a published row names in its ``source`` / ``table`` (FRAMEWORKS);
    none for a framework parsim does not know (torchtitan runs parsim's defaults)."""
    where = f"{_num(r.get('source'), '')} {_num(r.get('table'), '')}".lower()
    for words, _name, opts, _why in FRAMEWORKS:
        if any(w in where for w in words):
            return dict(opts)
    return {}


# hardware variants with a profile of their own, recognized in the published `hardware` column (public figures of
# the variant, not a factor fitted to a source): (words that must all appear, profile)
HARDWARE_VARIANTS = ((("h100", "hbm2e"), "h100-hbm2e-500w-spec"),)


def profile_of(r: dict) -> str:
    """The spec profile of a published row: its ``profile`` column, or the variant its ``hardware`` names."""
    hw = str(_num(r.get("hardware"), "")).lower()
    for words, name in HARDWARE_VARIANTS:
        if all(w in hw for w in words):
            return name
    return str(r["profile"])


def _spec_profile(name: str, calibrated: bool) -> HardwareProfile:
    from .hardware import list_profiles

    return load_profile(f"{name}-cal" if calibrated and f"{name}-cal" in list_profiles() else name)


def _published_spec(r: dict) -> ModelSpec:
    if r["model"] != "custom":
        return PRESETS[r["model"]] if r["model"] in PRESETS else load_model(str(r["model"]))
    fam = r["family"]
    moe = None
    if fam == "moe":
        moe = MoESpec(n_experts=_whole(r, "n_experts"), top_k=_whole(r, "top_k"), d_ff_expert=_whole(r, "d_ff_expert"),
                      n_shared_experts=_whole(r, "n_shared_experts", 0), first_k_dense=_whole(r, "first_k_dense", 0))
    d, h = _whole(r, "d_model"), _whole(r, "n_heads")
    gpt = fam == "gpt"
    return ModelSpec(name=str(r["id"]), n_layers=_whole(r, "n_layers"), d_model=d, n_heads=h,
                     n_kv_heads=_whole(r, "n_kv_heads", h), d_ff=_whole(r, "d_ff"),
                     vocab_size=_whole(r, "vocab_size"), head_dim=d // h if h else 0,
                     tie_embeddings=str(r.get("tie_embeddings")).lower() in ("true", "1"),
                     mlp="gelu" if gpt else "swiglu", norm="layernorm" if gpt else "rmsnorm", bias=gpt,
                     max_position_embeddings=_whole(r, "seq_len") if gpt else 0, moe=moe)


def published_rows(csv_path: str, profiles: dict | None = None, calibrated: bool = True) -> list[dict]:
    """Predict every row of a published CSV. ``profiles`` maps a profile name to the profile to use instead; else
    each row's spec-sheet profile, in its calibrated version (``<name>-cal``, written by `parsim calibrate` on the
    development rows) when ``calibrated`` and one is shipped."""
    import pandas as pd

    input_file(csv_path, "cannot read")
    try:
        df = pd.read_csv(csv_path, dtype={"measured_tps_per_gpu": str})
    except (OSError, ValueError) as e:
        raise ParsimError(f"cannot read {csv_path}: {e}") from None
    missing = [c for c in ("id", "model", "profile", "gpus", "seq_len", "global_batch_size", "local_batch_size",
                           "micro_batch_size", "measured_tps_per_gpu") if c not in df.columns]
    if missing:
        raise ParsimError(f"{csv_path}: missing columns {missing} (schema of bench/published/dev.csv)")
    profiles = dict(profiles or {})
    rows = []
    for r in df.to_dict("records"):
        name = profile_of(r)
        hw = profiles.get(name) or profiles.setdefault(name, _spec_profile(name, calibrated))
        base = dict(tier="published", source=r.get("source"), table=r.get("table"),
                    confidence=_num(r.get("confidence"), "low"))
        try:
            spec, plan = published_plan(r)
        except (ParsimError, KeyError, ValueError, TypeError, OverflowError) as e:
            row = dict.fromkeys(ROW_KEYS)
            try:
                gpus = _whole(r, "gpus")
            except ParsimError:
                gpus = 0
            row.update(base, model=str(r["model"]), plan_id=str(r["id"]), describe=str(r["id"]),
                       family=str(r.get("table")), n_gpus=gpus, status="unrepresentable",
                       reason=str(e), profile=hw.name)
            rows.append(row)
            continue
        row = _predicted(spec, plan, hw, **base)
        row["plan_id"] = str(r["id"])  # the published row's id is its identity here
        row["family"] = str(r.get("table"))  # CV folds: one source table per fold
        _add_published_measurement(row, r, plan)
        rows.append(row)
    return rows


def _add_published_measurement(row: dict, r: dict, plan: Plan) -> None:
    tps = str(_num(r.get("measured_tps_per_gpu"), "")).strip()
    mem = _num(r.get("measured_mem_gib"))
    try:
        row["measured_peak_bytes"] = float(mem) * 2**30 if mem is not None else None
        # the published memory rows are torchtitan's, whose Memory column is the caching allocator's reserved peak
        # (max_reserved, torchtitan/metrics.py); compared with the predicted reserved memory
        row["measured_memory_kind"] = "reserved" if mem is not None else None
    except ValueError:
        pass
    if tps.upper() == "OOM":
        row.update(status="oom", reason="published: out of memory")
        return
    if row["status"] != "ok":
        return
    try:
        rate = float(tps)
    except ValueError:
        row.update(status="no-measurement", reason=f"measured_tps_per_gpu {tps!r}")
        return
    tokens_per_gpu_step = plan.global_batch_size * plan.seq_len / plan.world_size
    row["measured_step_s"] = tokens_per_gpu_step / rate


# ---- statistics -----------------------------------------------------------------------------------------------------


def _spearman(a, b) -> float | None:
    from scipy.stats import spearmanr

    if len(a) < 3:
        return None
    return float(spearmanr(a, b).statistic)


def constant_mfu_rule(work_s: np.ndarray, measured_s: np.ndarray, kind: np.ndarray | None = None) -> np.ndarray:
    """The rule of thumb to beat, leave-one-out: every run achieves the median MFU of the other runs of its kind
    (bf16 or float8: one MFU each). ``work_s`` is the model FLOPs of a step over the bf16 peak (the step time at
    100% MFU), so the rule predicts ``work_i / median_{j != i, kind_j = kind_i}(work_j / measured_j)``."""
    mfu = work_s / measured_s
    kind = np.zeros(len(mfu), dtype=int) if kind is None else np.asarray(kind)
    out = np.empty(len(mfu))
    for i in range(len(mfu)):
        others = kind == kind[i]
        others[i] = False
        if not others.any():  # the only run of its kind: the median of all the others (or its own, alone)
            others = np.arange(len(mfu)) != i if len(mfu) > 1 else np.ones(1, bool)
        out[i] = work_s[i] / np.median(mfu[others])
    return out


def _top1_regret(rows: list[dict]) -> float | None:
    """Measured tier: within each comparable set (same model, ranks, global batch, seq), how much slower the
    model's pick ran than the fastest measured plan; the worst set is reported."""
    sets: dict[tuple, list[dict]] = {}
    for r in rows:
        p = r["plan"]
        sets.setdefault((r["model"], r["n_gpus"], p["global_batch_size"], p["seq_len"]), []).append(r)
    regrets = []
    for s in sets.values():
        if len(s) < 2:
            continue
        pick = min(s, key=lambda r: r["predicted_step_s"])
        regrets.append(pick["measured_step_s"] / min(r["measured_step_s"] for r in s) - 1.0)
    return max(regrets) if regrets else None


def summarize(rows: list[dict], predicted_key: str = "predicted_step_s") -> dict:
    """The statistics of a set of rows (ok rows with a measured and a predicted step time are scored; low-confidence
    published rows are kept apart), with the constant-MFU rule beside them."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("measured_step_s") and r.get(predicted_key)
          and r.get("confidence") != "low"]
    out: dict = {"n_rows": len(rows), "n_ok": len(ok),
                 "n_unrepresentable": sum(r["status"] == "unrepresentable" for r in rows),
                 "n_low_confidence": sum(r.get("confidence") == "low" for r in rows)}
    rule = _rule_of(ok)
    out.update(_step_stats(ok, predicted_key, rule))
    mem = [r for r in rows if r.get("measured_peak_bytes") and r.get("predicted_peak_bytes")
           and r["status"] == "ok" and r.get("confidence") != "low"]
    mape = [abs(predicted_memory(r) - r["measured_peak_bytes"]) / r["measured_peak_bytes"] for r in mem]
    out.update(memory_n=len(mem), memory_mape=float(np.mean(mape)) if mape else None,
               memory_max_ape=float(np.max(mape)) if mape else None,
               memory_kind=sorted({r.get("measured_memory_kind") or "allocated" for r in mem}))
    reserved = [r for r in mem if r.get("measured_memory_kind") == "reserved"]
    if reserved:  # the same rows against the allocated peak: what the allocator model adds
        alloc = [abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"] for r in reserved]
        out["memory_mape_if_allocated"] = float(np.mean(alloc))
    if any(r["tier"] == "measured" for r in ok):
        out["top1_regret"] = _top1_regret(ok)
        rep = repeatability(ok)
        if rep:
            out["repeatability"] = rep
    if any(r["tier"] == "published" for r in rows):
        out["fit_check"] = _fit_check(rows)
        out["by_source"] = {s: _step_stats([r for r in ok if r["source"] == s], predicted_key,
                                           None if rule is None else rule[[r["source"] == s for r in ok]])
                            for s in sorted({str(r["source"]) for r in ok})}
    return out


def repeatability(rows: list[dict]) -> dict | None:
    """How far the runs of one plan fall from the figure the plan is scored against (the median over its rounds), over
    the rows measured in 2+ rounds: ``round_ape_mean`` is the mean over plans of the mean |round / median - 1|, the
    error a prediction equal to one round's measurement would score — the floor under ``step_time_mape`` that the
    machine's own drift sets (a shared machine's neighbours, frequency, caches), not the model. ``round_ape_max`` the
    largest such deviation. None without repeated rows. [derived; nothing fitted]"""
    devs = []
    for r in rows:
        rs = [x for x in (r.get("measured_rounds_s") or []) if x]
        if len(rs) >= 2 and r.get("measured_step_s"):
            devs.append([abs(x / r["measured_step_s"] - 1.0) for x in rs])
    if not devs:
        return None
    return {"n": len(devs), "rounds_max": max(len(d) for d in devs),
            "round_ape_mean": float(np.mean([np.mean(d) for d in devs])),
            "round_ape_max": float(max(max(d) for d in devs))}


def predicted_memory(row: dict) -> float:
    """The prediction a row's measured memory is compared with: the reserved memory where the measurement is the
    allocator's reserved peak (published torchtitan rows, GPU runs), else the allocated peak."""
    if row.get("measured_memory_kind") == "reserved" and row.get("predicted_reserved_bytes"):
        return float(row["predicted_reserved_bytes"])
    return float(row["predicted_peak_bytes"])


def _fit_check(rows: list[dict]) -> dict:
    """Published rows: runs that ran and are predicted to fit, OOM runs predicted not to (high + medium rows),
    with the ids of the misses."""
    ran = [r for r in rows if r["status"] == "ok" and r.get("confidence") != "low"]
    oom = [r for r in rows if r["status"] == "oom" and r.get("confidence") != "low" and r.get("fits") is not None]
    return {"ran": len(ran), "ran_predicted_to_fit": sum(bool(r["fits"]) for r in ran),
            "oom": len(oom), "oom_predicted_not_to_fit": sum(not r["fits"] for r in oom),
            "ran_but_predicted_oom": [r["plan_id"] for r in ran if not r["fits"]],
            "oom_but_predicted_to_fit": [r["plan_id"] for r in oom if r["fits"]]}


def _rule_of(ok: list[dict]) -> np.ndarray | None:
    """The constant-MFU rule's step time for every scored row (leave-one-out over all of them, bf16 and float8
    apart), or None when a row lacks its model work."""
    work = np.array([r.get("model_work_s") or 0.0 for r in ok])
    if len(ok) < 3 or not (work > 0).all():
        return None
    meas = np.array([r["measured_step_s"] for r in ok])
    return constant_mfu_rule(work, meas, np.array([bool(r["plan"].get("float8")) for r in ok], dtype=int))


def _step_stats(ok: list[dict], key: str, rule: np.ndarray | None) -> dict:
    if not ok:
        return {"step_time_mape": None}
    meas = np.array([r["measured_step_s"] for r in ok])
    pred = np.array([r[key] for r in ok])
    ape = np.abs(pred - meas) / meas
    tps_ape = np.abs(meas / pred - 1.0)  # |predicted tokens/s - measured| / measured
    out = {"n": len(ok), "step_time_mape": float(ape.mean()), "step_time_max_ape": float(ape.max()),
           "step_time_median_ape": float(np.median(ape)), "spearman": _spearman(meas, pred),
           "tps_mape": float(tps_ape.mean()), "tps_max_ape": float(tps_ape.max())}
    iv = [r for r in ok if r.get("interval_s")]
    if iv:
        cov = [r["interval_s"][0] <= r["measured_step_s"] <= r["interval_s"][1] for r in iv]
        half = [(r["interval_s"][1] - r["interval_s"][0]) / 2 / r[key] for r in iv]
        out.update(interval_coverage=float(np.mean(cov)), interval_median_rel_halfwidth=float(np.median(half)))
    if rule is not None and len(ok) >= 1:
        rape = np.abs(rule - meas) / meas
        rtps = np.abs(meas / rule - 1.0)
        out["constant_mfu_rule"] = {"step_time_mape": float(rape.mean()), "step_time_max_ape": float(rape.max()),
                                    "spearman": _spearman(meas, rule), "tps_mape": float(rtps.mean()),
                                    "tps_max_ape": float(rtps.max())}
    return out


def component_differences(rows_curves: list[dict], rows_blocks: list[dict]) -> list[dict]:
    """Per plan and step-time component: the prediction composed from the curves beside the one with blocks
    measured at the plan's shapes (same profile otherwise), their difference, and per plan what neither
    explains (component "unexplained": measured step minus the measured-block prediction). Components are the
    predictions' ``time_breakdown_s`` keys (compute, the exposed collectives, framework overhead, ...); the
    curves and the blocks rows each sum to their predicted step, so a plan's differences sum to the difference of
    its two predictions."""
    curves = {(r["model"], r["plan_id"], r["source"]): r for r in rows_curves}
    out = []
    for b in rows_blocks:
        c = curves.get((b["model"], b["plan_id"], b["source"]))
        if c is None or b["status"] != "ok" or c["status"] != "ok" or not b.get("time_breakdown_s"):
            continue
        base = {"model": b["model"], "describe": b["describe"], "ranks": b["source"],
                "measured_step_s": b.get("measured_step_s")}
        tb_b, tb_c = b["time_breakdown_s"], c["time_breakdown_s"]
        for k in sorted(set(tb_b) | set(tb_c)):
            cs, bs = float(tb_c.get(k, 0.0)), float(tb_b.get(k, 0.0))
            if cs or bs:
                out.append({**base, "component": k, "curves_s": cs, "blocks_s": bs, "blocks_minus_curves_s": bs - cs})
        if b.get("measured_step_s") is not None:
            left = float(b["measured_step_s"]) - float(b["predicted_step_s"])
            out.append({**base, "component": "unexplained", "curves_s": float(b["measured_step_s"]) -
                        float(c["predicted_step_s"]), "blocks_s": left, "blocks_minus_curves_s": None})
    return out


def write_results(out_dir: Path, rows: list[dict], summary: dict, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "rows.json", rows)
    atomic_write_json(out_dir / "summary.json", {**meta, **summary})
