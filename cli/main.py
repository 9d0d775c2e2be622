"""parsim command line: one thin typer wrapper per command over a plain parsim function.

Heavy modules (numpy, the cost model, torch in run/profile/trace) are imported inside the commands, so that
``parsim --help`` starts fast. Bad input raises ParsimError: one line on stderr, exit code 2.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
from typing import Optional

import typer

from parsim.cli.common import emit_json
from parsim.loop_jobs import profile_for_this_machine, profile_measured_here

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="parsim: how to parallelize a PyTorch training job, what it will cost, and how sure we are.")


@app.callback()
def _root():
    """parsim: how to parallelize a PyTorch training job, what it will cost, and how sure we are."""


def whole_number(value) -> int:
    """An integer flag as digits only (an optional minus sign): ``4_0``, ``+2``, ``2.0`` and ``0x10`` are refused, not
    read as 40, 2, 2 and 16."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if re.fullmatch(r"-?[0-9]{1,18}", text):
        return int(text)
    raise typer.BadParameter(f"{value!r} is not a whole number (digits only)")


WHOLE = whole_number


# ---- shared plan flags (CLI contract of docs/design.md; names follow torchtitan) ---------------------------------
# Every flag defaults to None ("not given"): predict/run/trace fill in parsim.flags.DEFAULTS, search pins what is given.
def _schema_flags() -> list:
    """One flag per plan field (``parsim.plan_schema``): its name, type, help and [default]."""
    from rich.markup import escape  # typer renders help as rich markup: "[no]" would be read as a style tag

    from parsim.plan_schema import PLAN_FIELDS

    out = []
    for f in PLAN_FIELDS:
        help_ = escape(" ".join(x for x in (f.help, f.shown_default) if x))
        if f.kind in ("bool", "optional_bool"):
            opt, ann = typer.Option(None, f"{f.cli_flag}/--no-{f.cli_flag[2:]}", help=help_), Optional[bool]
        else:
            opt = typer.Option(None, f.cli_flag, help=help_, parser=WHOLE if f.kind == "int" else None)
            ann = Optional[int] if f.kind == "int" else Optional[str]
        out.append(("order" if f.name == "wrapper_order" else f.name, ann, opt))
    return out


PLAN_FLAGS = [
    ("model", Optional[str], typer.Option(None, "--model", help="preset name or a config.json path \\[llama3-8b]")),
    ("gpus", Optional[int], typer.Option(None, "--gpus", help="number of GPUs (default: product of the degrees)",
                                         parser=WHOLE)),
    *_schema_flags(),
    ("plan_file", Optional[str], typer.Option(None, "--plan", help="plan JSON (instead of the plan flags)")),
    ("profile", Optional[str], typer.Option(None, "--profile", help="profile name or path \\[h100-sxm-spec-cal: the "
                                            "H100 spec sheet calibrated on published runs]")),
]


def plan_options(fn):
    """Add the shared plan flags to a command; they arrive as one dict ``flags``."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "flags"]
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
             for n, ann, opt in PLAN_FLAGS]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from parsim.flags import DEFAULTS

        flags = {n: kwargs.pop(n) for n, _, _ in PLAN_FLAGS}
        flags["model_given"] = flags["model"] is not None
        flags["profile_given"] = flags["profile"] is not None
        for name in ("model", "profile"):  # what to load, not a pin: the default applies to every command
            if flags[name] is None:
                flags[name] = DEFAULTS[name]
        return fn(*args, flags=flags, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params + extra)
    return wrapper


def guarded(fn):
    """Turn ParsimError (bad input) into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from parsim.errors import ParsimError

        try:
            return fn(*args, **kwargs)
        except ParsimError as e:
            typer.echo(f"error: {_one_line(str(e))}", err=True)
            raise typer.Exit(2) from None
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
            typer.echo(f"error: {_one_line(str(e))}", err=True)
            raise typer.Exit(2) from None
        except ModuleNotFoundError as e:  # a torch import no require_torch() foresaw: still one line
            if (e.name or "").split(".")[0] != "torch":
                raise
            typer.echo(f"error: {_needs_torch(fn.__name__)}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def require_torch(command: str) -> None:
    """Commands that run torch code say so up front, in one line with exit code 2, when torch is missing (not a
    traceback, and not a torchrun child that fails after the command reported success)."""
    import importlib.util

    from parsim.errors import ParsimError

    if importlib.util.find_spec("torch") is None:
        raise ParsimError(_needs_torch(command))


def _needs_torch(command: str) -> str:
    return (f"`parsim {command}` needs PyTorch, which is not installed (pip install torch; predict, search, report "
            "and explain run without it)")


def _one_line(msg: str) -> str:
    return " ".join(msg.split())


def build_plan(flags: dict):
    """(ModelSpec, Plan, HardwareProfile) from the shared flags: every given flag checked (parsim.flags), then
    either the plan file (``--plan``; other plan flags beside it are refused) or the flags with their defaults."""
    from parsim.codec import validate_plan
    from parsim.errors import ParsimError
    from parsim.flags import check_flags, given_plan_flags, plan_from_given
    from parsim.plan import Plan
    from parsim.spec import load_model

    check_flags(flags)
    spec = load_model(flags["model"])
    hw = profile_for_this_machine(flags["profile"])
    if flags.get("plan_file"):
        from parsim.jsonio import read_json

        extra = given_plan_flags(flags)
        if extra:
            raise ParsimError(f"--plan gives the whole plan: drop {', '.join(extra)} (or edit the plan file)")
        data = read_json(flags["plan_file"], "cannot read plan")
        recorded = data.get("model") if isinstance(data, dict) and isinstance(data.get("model"), str) else None
        data = data.get("plan", data) if isinstance(data, dict) else data
        if recorded and not flags.get("model_given"):
            spec = load_model(recorded)  # a plan written by `search --emit-plan` says which model it is for
            flags["model"] = recorded
        elif recorded and recorded != flags["model"]:
            raise ParsimError(f"--plan {flags['plan_file']} was made for model {recorded}, not {flags['model']}: "
                              "drop --model or use a plan of that model")
        plan = Plan.from_dict(data)
        validate_plan(plan, spec, flags.get("gpus"))
    else:
        plan = plan_from_given(flags)
    validate_plan(plan, spec)
    if plan.float8 and "float8" not in hw.peak_flops:
        raise ParsimError(f"--float8 needs a GPU with float8 tensor cores; profile {hw.name} has none")
    return spec, plan, hw


# ---- commands ----------------------------------------------------------------------------------------------------
@app.command()
@guarded
@plan_options
def predict(flags: dict, as_json: bool = typer.Option(False, "--json", help="print one JSON document"),
            explain: bool = typer.Option(False, "--explain", help="show the collective ledger, one layer's compute "
                                         "and the tensors it saves per AC mode"),
            framework: Optional[str] = typer.Option(None, "--framework", help="say what this framework would run "
                                                    "otherwise: torchtitan (0.3.0) | torchtitan-0.2 | megatron")):
    """Predict per-rank memory, step time and communication of one plan."""
    from parsim.costmodel import predict as _predict
    from parsim.costmodel.explain import predict_and_explain
    from parsim.frameworks import check_framework, runs_otherwise

    check_framework(framework)
    spec, plan, hw = build_plan(flags)
    for line in runs_otherwise(plan, spec, framework) if framework else []:
        typer.echo(f"warning: {framework} would run this plan otherwise: {line}", err=True)
    pred, why = predict_and_explain(spec, plan, hw) if explain else (_predict(spec, plan, hw), None)
    if as_json:
        from parsim.machine import mfu_value

        emit_json(dict(pred.to_dict(), mfu=mfu_value(pred.mfu, hw), **({"explain": why} if why else {})))
        return
    from parsim.report import print_explain, print_prediction

    print_prediction(pred, spec, plan, hw)
    if why:
        print_explain(why)


@app.command()
@guarded
@plan_options
def search(
    flags: dict,
    top: int = typer.Option(10, "--top", help="how many plans to show", parser=WHOLE),
    no_pp: bool = typer.Option(False, "--no-pp", help="pipeline parallelism off"),
    no_cp: bool = typer.Option(False, "--no-cp", help="context parallelism off"),
    max_tp: Optional[int] = typer.Option(None, "--max-tp", parser=WHOLE),
    max_pp: Optional[int] = typer.Option(None, "--max-pp", parser=WHOLE),
    ac_modes: Optional[str] = typer.Option(None, "--ac-modes", help="comma list of AC modes to search "
                                           "(default: none,selective-op,full,layer:2; --ac pins one)"),
    fixed_order: bool = typer.Option(False, "--default-mesh-order", help="only the default device order"),
    # the default is parsim.search.CLI_HEADROOM (its derivation there; a test ties the two)
    headroom: float = typer.Option(0.06, "--headroom", help="fraction of usable GPU memory to keep free (the "
                                   "allocator reserved up to 6% more than predicted on H100; 0 ranks by the "
                                   "prediction alone)"),
    max_plans: Optional[int] = typer.Option(None, "--max-plans", help="refuse spaces larger than this "
                                            "(default: none; 50,000,000 with --csv, which evaluates every plan; 0 = "
                                            "no limit)", parser=WHOLE),
    explain: Optional[int] = typer.Option(None, "--explain", help="plan N (1-based) against the other shown plans",
                                          parser=WHOLE),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", help="stop after this long with the best "
                                                "plans of the part searched (said in the output)"),
    emit_plan: Optional[str] = typer.Option(None, "--emit-plan", help="write the best plan as parsim plan JSON"),
    emit_torchtitan: Optional[str] = typer.Option(None, "--emit-torchtitan", help="write the best plan as a "
                                                  "torchtitan config (see --torchtitan-format)"),
    torchtitan_format: str = typer.Option("python", "--torchtitan-format", help="python: torchtitan 0.3.0 "
                                          "(Trainer.Config module) | toml: the v0.2.x job config"),
    emit_megatron: Optional[str] = typer.Option(None, "--emit-megatron", help="write the best plan as Megatron-LM "
                                                "arguments (a bash array; what Megatron cannot express is said)"),
    csv: Optional[str] = typer.Option(None, "--csv", help="write every evaluated plan to this CSV "
                                     "(to Parquet when the name ends in .parquet; needs pyarrow)"),
    execute: int = typer.Option(0, "--execute", help="run the top K plans with the executor on this machine",
                                parser=WHOLE),
    execute_out: Optional[str] = typer.Option(None, "--execute-out", help="write predictions and measurements "
                                              "of --execute to this JSON"),
    wide: bool = typer.Option(False, "--wide", help="the top table with every field spelled out (needs ~190 "
                              "columns)"),
    measure: int = typer.Option(0, "--measure", help="time the blocks of the top K and the Pareto plans on this "
                                "device and re-rank them (needs a profile of this device)", parser=WHOLE),
    measure_budget_flops: Optional[float] = typer.Option(None, "--measure-budget-flops", help="forward FLOPs above "
                                                         "which a smaller stand-in block is timed instead (default: "
                                                         "2e10 on CPU, none on a GPU)"),
    framework: Optional[str] = typer.Option(None, "--framework", help="rank only the plans this framework runs as "
                                            "planned: torchtitan (0.3.0) | torchtitan-0.2 | megatron"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document"),
):
    """Search every plan for a model on N GPUs and rank them by predicted step time. Every plan flag given pins
    its dimension (--tp 8, --ac full, --no-compile, --mesh-order tp,dp_shard ...)."""
    from parsim.flags import search_space
    from parsim.spec import load_model

    _check_search_options(top, execute, measure, measure_budget_flops, explain, torchtitan_format,
                          {"--emit-plan": emit_plan, "--emit-torchtitan": emit_torchtitan,
                           "--emit-megatron": emit_megatron, "--csv": csv, "--execute-out": execute_out},
                          _input_files(flags))
    _check_dependent_flags({"--execute-out": (execute_out is not None, "--execute", execute > 0),
                            "--torchtitan-format": (torchtitan_format != "python", "--emit-torchtitan",
                                                    emit_torchtitan is not None),
                            "--measure-budget-flops": (measure_budget_flops is not None, "--measure", measure > 0),
                            "--wide": (wide, "a table (not --json)", not as_json)})
    gpus, space = search_space(flags, no_pp=no_pp, no_cp=no_cp, max_tp=max_tp, max_pp=max_pp, ac_modes=ac_modes,
                               default_mesh_order=fixed_order, headroom=headroom, max_plans=max_plans,
                               max_seconds=max_seconds)
    from parsim.frameworks import restrict_space

    space = restrict_space(space, framework)
    spec = load_model(flags["model"])
    # plans run here are predicted with a profile of this machine (measured first when the given one is not)
    hw = profile_measured_here(flags["profile"]) if execute or measure else profile_for_this_machine(flags["profile"])
    if measure:
        _check_profile_is_this_device(hw)
    from parsim.cli.views import run_search_cli
    from parsim.search_job import SearchOutputs

    out = SearchOutputs(emit_plan, emit_torchtitan, torchtitan_format, emit_megatron, csv, execute_out)
    run_search_cli(spec, hw, gpus, space, top=top, explain=explain, as_json=as_json, execute=execute, outputs=out,
                   model_arg=flags["model"], wide=wide, measure=measure, measure_budget_flops=measure_budget_flops,
                   framework=framework)


def _check_search_options(top, execute, measure, measure_budget_flops, explain, torchtitan_format, outputs,
                          inputs) -> None:
    """search's options checked before anything runs; output paths too (fail now, not after the search)."""
    from parsim.errors import ParsimError
    from parsim.flags import check_int
    from parsim.jsonio import check_outputs

    check_int("--top", top, 1, 10_000)
    check_int("--execute", execute, 0, top)
    check_int("--measure", measure, 0, 1000)
    if execute or measure:
        require_torch("search --execute" if execute else "search --measure")
    if measure_budget_flops is not None and not (measure_budget_flops > 0):
        raise ParsimError(f"--measure-budget-flops must be > 0, got {measure_budget_flops}")
    if explain is not None:
        check_int("--explain", explain, 1, top)
    if torchtitan_format not in ("python", "toml"):
        raise ParsimError(f"--torchtitan-format takes python or toml, got {torchtitan_format!r}")
    check_outputs(outputs, inputs)


def _check_dependent_flags(given: dict) -> None:
    """Flags that mean something only beside another: ``given`` maps a flag to (it was given, what it needs, that
    is there); one ParsimError line for the first given without what it needs (a flag ignored in silence is a
    user's wrong belief)."""
    from parsim.errors import ParsimError

    for flag, (on, needs, present) in given.items():
        if on and not present:
            raise ParsimError(f"{flag} needs {needs}: without it, it would be ignored")


def _input_files(flags: dict) -> list:
    """The files a command's plan flags name as inputs (a model config, a plan, a profile path)."""
    return [flags.get(k) for k in ("model", "plan_file", "profile") if flags.get(k)]


def _check_profile_is_this_device(hw) -> None:
    """``--measure`` puts blocks timed here beside the profile's curves: the profile must describe this device."""
    import torch

    from parsim.errors import ParsimError

    here = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    theirs = "cpu" if hw.provenance.get("device", "") == "cpu" and hw.source == "measured" else hw.device_name
    models = re.findall(r"\b[A-Z]+\d{2,4}\b", theirs)  # H100, A100, B200, ...
    if (here == "cpu") != (theirs == "cpu") or (here != "cpu" and not any(m in here for m in models)):
        raise ParsimError(f"--measure times blocks on this machine ({here}), but profile {hw.name} describes "
                          f"{theirs}: pass a profile of this device (e.g. --profile cpu-gloo-2 here, or one "
                          "`parsim profile` measured on it)")


def _measurement_summary(m, title: str) -> None:
    from rich.table import Table

    from parsim.console import console as folding_console
    from parsim.units import MS, GiB

    con = folding_console()
    color = "green" if m.status == "ok" else "red"
    con.print(f"[bold]{title}[/bold] plan {m.plan_id}: [{color}]{m.status}[/{color}] {m.error}")
    if m.status != "ok":
        return
    if m.step_times_s:
        con.print(f"step time median {m.median_step_time_s / MS:.1f} ms over {len(m.step_times_s)} steps "
                  f"(p90 {m.provenance.get('step_time_p90_s', 0) / MS:.1f} ms), "
                  f"{m.tokens_per_s_per_gpu:,.0f} tokens/s/GPU; losses {', '.join(f'{x:.4f}' for x in m.losses)}")
    if m.peak_memory_bytes is not None:
        con.print(f"memory: {m.provenance.get('memory_source', '')}")
        t = Table(title=f"peak memory {m.peak_memory_bytes / GiB:.3f} GiB")
        t.add_column("component")
        t.add_column("GiB", justify="right")
        for k, v in m.memory_breakdown_bytes.items():
            t.add_row(k, f"{v / GiB:.3f}")
        con.print(t)
    c = Table(title="collectives per step (rank 0, input bytes)")
    c.add_column("collective/axis")
    c.add_column("bytes", justify="right")
    for k, v in sorted(m.comm_bytes.items()):
        c.add_row(k, f"{v:,.0f}")
    con.print(c)


@app.command()
@guarded
@plan_options
def run(
    flags: dict,
    nproc_per_node: int = typer.Option(..., "--nproc-per-node", help="processes (GPUs, or CPU ranks with gloo)",
                                       parser=WHOLE),
    steps: int = typer.Option(5, "--steps", help="timed steps", parser=WHOLE),
    warmup: int = typer.Option(2, "--warmup", help="untimed steps first (collectives and memory are measured here)",
                               parser=WHOLE),
    timeout: float = typer.Option(600.0, "--timeout", help="seconds before a hung run is killed and recorded"),
    out: Optional[str] = typer.Option(None, "--out", help="write the Measurement JSON here"),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="passed to torchrun (multi-node)"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="passed to torchrun"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="passed to torchrun", parser=WHOLE),
    device: Optional[str] = typer.Option(None, "--device", help="cpu to force gloo on a GPU machine"),
    profile_trace: Optional[str] = typer.Option(
        None, "--profile-trace", help="folder: each rank writes its torch.profiler trace of the timed steps there "
                                      "(rank<r>.trace.json.gz; read it with parsim read-trace)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Run a plan for real under torchrun (gloo on CPU, NCCL on GPUs) and measure it."""
    require_torch("run")

    from parsim.errors import ParsimError
    from parsim.flags import check_flags, check_int
    from parsim.jsonio import check_outputs
    from parsim.procs import check_timeout

    if device not in (None, "cpu"):
        raise ParsimError(f"--device takes only cpu (to force gloo on a GPU machine), got {device!r}")
    check_flags(flags)
    on_cpu, hw_here, notes = _run_profile(flags, device, nproc_per_node)
    spec, plan, hw = build_plan(flags)
    from parsim.ordering import order_refusal

    why = order_refusal(plan)
    if why:  # e.g. compile before TP trains with other losses (parsim orders, case tp-compile-fsdp)
        raise ParsimError(why)
    check_int("--nproc-per-node", nproc_per_node, 1, 1024)
    check_int("--steps", steps, 1, 1_000_000)
    check_int("--warmup", warmup, 0, 1_000_000)
    if node_rank is not None:
        check_int("--node-rank", node_rank, 0, 1_000_000)
    check_timeout(timeout)
    check_outputs({"--out": out}, _input_files(flags))
    world = plan.world_size
    n_nodes = _nnodes(nnodes) if nnodes else 1
    if nproc_per_node * n_nodes != world:
        raise ParsimError(f"the plan needs {world} ranks, --nproc-per-node x nodes = {nproc_per_node} x {n_nodes}")
    _check_run_time(spec, plan, hw_here if on_cpu else hw, notes, steps, warmup, timeout)
    from parsim.executor.launch import run_plan

    extra = []
    if nnodes:
        extra.append(f"--nnodes={nnodes}")
    if rdzv_endpoint:
        extra += [f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-backend=c10d"]
    if node_rank is not None:
        extra.append(f"--node-rank={node_rank}")
    m = run_plan(flags["model"], plan, nproc_per_node, steps=steps, warmup=warmup,
                 timeout_s=timeout, out=out,
                 torchrun_args=extra, device=device, progress=lambda ln: typer.echo(f"step {ln}", err=True),
                 profile_trace=profile_trace)
    if as_json:
        emit_json(m.to_dict())
    else:
        _measurement_summary(m, f"{spec.name} {plan.describe()}")
    if m.status != "ok":  # a run that did not measure is a failed command (exit 1; bad input is 2)
        typer.echo(f"error: the run ended with status {m.status}: {_one_line(m.error or '')[:300]}", err=True)
        raise typer.Exit(1)


def _run_profile(flags: dict, device: str | None, nproc: int):
    """(on a CPU, the profile of this machine or None, the notes: the dtype chosen, why there is no profile) for a
    run; on a CPU with no --param-dtype (and no --plan), the dtype is chosen from what this machine measured
    (``parsim.run_prep``). The notes go to stderr once the run is accepted (a refusal is one line)."""
    from parsim.run_prep import cpu_dtype, cpu_run_profile

    if device != "cpu" and _has_cuda():
        return False, None, []  # a GPU run predicts with --profile (its default: the H100 spec sheet, calibrated)
    from parsim.machine import this_machine

    hw, why = cpu_run_profile(flags["profile"] if flags.get("profile_given") else None, nproc)
    notes = [why] if why else []
    if flags.get("param_dtype") is None and not flags.get("plan_file"):
        flags["param_dtype"], reason = cpu_dtype(hw, this_machine()["cpu_flags"])
        notes.insert(0, f"param dtype {flags['param_dtype']}: {reason}")
    return True, hw, notes


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_run_time(spec, plan, hw, notes: list[str], steps: int, warmup: int, timeout: float) -> None:
    """Refuse a run predicted past --timeout; otherwise say the predicted time a step (or why there is none) and
    the other notes on stderr."""
    from parsim.costmodel import predict as _predict
    from parsim.errors import ParsimError
    from parsim.run_prep import bf16_slow, check_fits_timeout

    if hw is not None:
        try:
            step_s = _predict(spec, plan, hw).step_time_s
        except ParsimError as e:
            notes.append(f"no prediction ({_one_line(str(e))})")
        else:
            hint = ", or --param-dtype float32 (bf16 GEMMs are slow here)" if (
                plan.param_dtype == "bfloat16" and bf16_slow(hw)) else ""
            check_fits_timeout(step_s, steps, warmup, timeout, f" (profile {hw.name}){hint}")
            notes.append(f"predicted {step_s * 1e3:,.1f} ms a step on profile {hw.name}: {warmup} warmup + {steps} "
                         f"timed steps ~{step_s * (steps + warmup):,.1f} s, plus start-up")
    for note in notes:
        typer.echo(note, err=True)


@app.command()
@guarded
def profiles(as_json: bool = typer.Option(False, "--json", help="print one JSON document")):
    """List the installed hardware profiles: what each is, its device, date, whether it describes this machine
    and whether the current profiler measures more than it holds."""
    from rich import box
    from rich.table import Table

    from parsim.console import console as folding_console
    from parsim.machine import profile_rows

    rows = profile_rows()
    if as_json:
        emit_json({"profiles": rows})
        return
    t = Table(title=f"{len(rows)} profiles", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False)
    for col in ("name", "kind", "device", "date", "here", "stale"):
        t.add_column(col, overflow="fold", no_wrap=col in ("name", "date", "here", "stale"),
                     min_width={"kind": 12, "device": 14}.get(col))
    for r in rows:
        kind = r["kind"] + (f", {r['ranks']} ranks" if r["ranks"] and "cpu" in r["kind"] else "")
        t.add_row(r["name"], kind, r["device"], r["date"], r["this_machine"].split(":")[0], "yes" if r["stale"] else "")
    con = folding_console()
    con.print(t)
    for r in rows:
        if r["this_machine_why"]:
            con.print(f"{r['name']}: not this machine ({r['this_machine_why']})", markup=False)
        if r["stale"]:
            con.print(f"{r['name']}: stale, the profiler now also measures {r['stale']} (re-measure: parsim "
                      "profile --nproc-per-node N --out NAME)", markup=False)
    con.print("here: whether a measured CPU profile describes this machine (spec sheets and GPU profiles describe "
              "hardware elsewhere). Use one with --profile NAME; parsim profile --out NAME measures this machine")


def _nnodes(text: str) -> int:
    """torchrun's --nnodes: N or MIN:MAX (the plan needs MAX nodes)."""
    from parsim.errors import ParsimError

    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() and 1 <= int(p) <= 1_000_000 for p in parts):
        raise ParsimError(f"--nnodes takes N or MIN:MAX with positive integers, got {text!r}")
    if len(parts) == 2 and int(parts[0]) > int(parts[1]):
        raise ParsimError(f"--nnodes {text}: MIN > MAX")
    return int(parts[-1])


@app.command()
@guarded
@plan_options
def trace(
    flags: dict,
    rank: int = typer.Option(0, "--rank", help="which rank to trace", parser=WHOLE),
    out: Optional[str] = typer.Option(None, "--out", help="write the Measurement JSON here"),
    compare: bool = typer.Option(False, "--compare", help="print the prediction beside the trace"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Trace one training step of a plan at full scale in one CPU process (fake process group + FakeTensorMode)."""
    require_torch("trace")
    from parsim.errors import ParsimError
    from parsim.executor.trace import trace_plan
    from parsim.jsonio import atomic_write_json, check_outputs

    spec, plan, hw = build_plan(flags)
    if not 0 <= rank < plan.world_size:
        raise ParsimError(f"--rank {rank} is outside the world of {plan.world_size} ranks")
    check_outputs({"--out": out}, _input_files(flags))
    from parsim.codec import executor_refusal

    refusal = executor_refusal(plan, spec)
    if refusal:  # (a cost-model option the executor does not run: nothing to trace)
        raise ParsimError(f"cannot trace {plan.describe()}: {refusal}")
    m = trace_plan(spec, plan, rank=rank)
    if out:
        atomic_write_json(out, m.to_dict())
    if m.status != "ok":
        raise ParsimError(f"trace of {plan.describe()} rank {rank} failed ({m.status}): "
                          f"{(m.error or '').splitlines()[0] if m.error else 'no reason given'}")
    pred = None
    if compare:
        from parsim.costmodel import predict as _predict

        pred = _predict(spec, plan, hw)
    if as_json:
        d = m.to_dict()
        if pred is not None:
            d["prediction"] = pred.to_dict()
        emit_json(d)
        return
    _measurement_summary(m, f"trace {spec.name} {plan.describe()} rank {rank}")
    if pred is not None:
        from parsim.report import print_comparison

        print_comparison(pred, m)


def _check_profile_options(nproc_per_node, resume: bool, restart: bool, device) -> None:
    from parsim.errors import ParsimError

    if nproc_per_node is None:
        raise ParsimError("--nproc-per-node is required (unless --measure-shapes-of)")
    if resume and restart:
        raise ParsimError("give --resume or --restart, not both")
    if device not in (None, "cpu"):
        raise ParsimError(f"--device takes only cpu (to profile gloo on a GPU machine), got {device!r}")


def _profile_frameworks(out: str, out_dir, device, as_json: bool) -> None:
    """``profile --measure-frameworks``: FSDP2 / DTensor TP / EP overhead into an existing profile (on a CPU
    profile's ranks, on 2 GPUs)."""
    from parsim.errors import ParsimError
    from parsim.profiler.run import add_framework_overheads, resolve_profile_out

    path = resolve_profile_out(out, out_dir)
    if not path.exists():
        raise ParsimError(f"profile {path} does not exist: measure one first (parsim profile --nproc-per-node N)")
    hw = add_framework_overheads(path, device)
    keys = [k for k in hw.corrections if k.startswith(("fsdp_call_", "fsdp_moe_call_", "tp_block_", "tp_moe_block_",
                                                        "ep_block_", "pp_action_"))]
    res = {"profile": str(path), **{k: hw.corrections[k] for k in keys}}
    if as_json:
        emit_json(res)
    else:
        def line(prefix: str, what: str) -> str:
            return (f"{what} {res.get(prefix + '_fixed_s', 0) * 1e3:.2f} ms + "
                    f"{res.get(prefix + '_s_per_byte', 0) * 1e9:.2f} ms/MB")

        typer.echo(f"{line('fsdp_call', 'FSDP')} per unit and collective call ({line('fsdp_moe_call', 'MoE units')}); "
                   f"{line('tp_block', 'TP block')} per microbatch; {line('pp_action', 'pipeline')} per stage action "
                   f"-> {path}")


def _profile_shapes(measure_shapes_of: str, out: str, out_dir, model: str, as_json: bool) -> None:
    """``profile --measure-shapes-of``: blocks at given plans' local shapes into an existing profile."""
    from parsim.cli.common import Bars
    from parsim.loop_jobs import measure_plan_shapes

    with Bars() as bars:
        res = measure_plan_shapes(measure_shapes_of, out, out_dir, model if model != "tiny" else None, bars)
    if as_json:
        emit_json(res)
    else:
        typer.echo(f"{res['shapes']} local shapes ({res['not_measurable']} not measurable as one block), "
                   f"{res['measured_now']} measured now in {res['measurement_wall_s']:.1f} s -> {res['profile']}")


@app.command()
@guarded
def profile(
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="ranks (GPUs, or CPU ranks with "
                                                 "gloo); required unless --measure-shapes-of", parser=WHOLE),
    out: str = typer.Option(..., "--out", help="profile name (writes NAME.json and NAME.samples.csv in the profile "
                            "folder) "
                            "or a path anywhere (DIR/NAME.json)"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted profile"),
    restart: bool = typer.Option(False, "--restart", help="discard an interrupted profile and start over"),
    min_bytes: int = typer.Option(0, "--min-bytes", help="smallest message (default 1 KiB)", parser=WHOLE),
    max_bytes: int = typer.Option(0, "--max-bytes", help="largest message (default 16 MiB on CPU, 1 GiB on GPU)",
                                  parser=WHOLE),
    factor: int = typer.Option(4, "--factor", help="geometric step of the message sizes", parser=WHOLE),
    ops: str = typer.Option("all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send", "--ops"),
    model: str = typer.Option("tiny", "--model", help="model whose block is timed (and GEMM shapes taken)"),
    seq_len: int = typer.Option(512, "--seq-len", parser=WHOLE),
    out_dir: Optional[str] = typer.Option(None, "--out-dir", help="default: $PARSIM_PROFILES_DIR, else a checkout's "
                                            "profiles/, else ~/.local/share/parsim/profiles"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu to profile gloo on a GPU machine"),
    nnodes: int = typer.Option(1, "--nnodes", help="nodes profiled together (one parsim profile per node, e.g. "
                               "under srun): collectives across nodes are measured; node 0 writes the profile",
                                   parser=WHOLE),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="this node's rank (default $SLURM_NODEID)",
                                            parser=WHOLE),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="node 0's address (multi-node)"),
    master_port: int = typer.Option(29500, "--master-port", help="a free port on node 0 (multi-node)",
                                    parser=WHOLE),
    measure_shapes_of: Optional[str] = typer.Option(None, "--measure-shapes-of", help="a plan JSON (search "
                                                    "--emit-plan) or a list of them: measure their blocks at their "
                                                    "local shapes on this device into the profile --out (which "
                                                    "must exist), nothing else"),
    measure_frameworks: bool = typer.Option(False, "--measure-frameworks", help="measure FSDP2 / DTensor TP "
                                            "/ EP overhead (on a CPU profile's ranks, 2 GPUs) into the profile "
                                            "--out (which must exist), nothing else (a new profile of 2+ ranks "
                                            "measures it anyway)"),
    interconnect_from: Optional[str] = typer.Option(None, "--interconnect-from", help="one GPU measures no "
                                                    "collective: take GPUs per node, topology and collective fits "
                                                    "from this profile (e.g. h100-sxm-spec); --nproc-per-node 1"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Measure collectives and compute on this machine (or on several nodes), fit them, write a hardware
    profile; or, with --measure-shapes-of, add blocks measured at given plans' local shapes to a profile; or,
    with --measure-frameworks, the framework overhead."""
    require_torch("profile")
    from parsim.errors import ParsimError

    if measure_frameworks:
        return _profile_frameworks(out, out_dir, device, as_json)
    if measure_shapes_of:
        return _profile_shapes(measure_shapes_of, out, out_dir, model, as_json)
    _check_profile_options(nproc_per_node, resume, restart, device)
    from parsim.profiler.run import NodeSpec
    from parsim.profiler.run import profile as _profile

    nodes = None
    if nnodes != 1:
        rank = node_rank if node_rank is not None else os.environ.get("SLURM_NODEID")
        if rank is None or not str(rank).isdigit():
            raise ParsimError("--nnodes > 1 needs --node-rank (or $SLURM_NODEID)")
        nodes = NodeSpec(nnodes, int(rank), master_addr or "", master_port)
    hw = _profile(out, nproc_per_node, resume=resume, restart=restart, min_bytes=min_bytes, max_bytes=max_bytes,
                  factor=factor, ops=ops, model=model, seq_len=seq_len, out_dir=out_dir, device=device,
                  log=lambda m: typer.echo(m, err=True), nodes=nodes, interconnect_from=interconnect_from)
    _print_profile_result(hw, nodes, as_json)


def _print_profile_result(hw, nodes, as_json: bool) -> None:
    """The profile written (JSON or a summary); on a node other than 0 (node 0 writes the profile), which node."""
    if hw is None:
        if as_json:
            emit_json({"node_rank": nodes.node_rank if nodes else 0, "profile_written_by": "node 0"})
        return
    if as_json:
        emit_json(hw.to_dict())
        return
    from parsim.report import print_profile

    print_profile(hw)


@app.command()
@guarded
def redistribute(
    mesh: str = typer.Option(..., "--mesh", help="mesh sizes, outer axis first, e.g. 2x2 or 8x8x4"),
    shape: str = typer.Option(..., "--shape", help="global tensor shape, e.g. 4096x4096"),
    src: str = typer.Option(..., "--src", help='source placements, one per mesh axis: R, P, S(d) (torch notation, '
                            'S(d)[k] gives the shard order), e.g. "S(0)S(1)"'),
    dst: str = typer.Option(..., "--dst", help='target placements, e.g. "S(1)S(1)"'),
    src_order: Optional[str] = typer.Option(None, "--src-order", help="shard order of the source, tensor_dim:mesh "
                                            "axes outer first;... e.g. 1:1,0 [ascending mesh axes]"),
    dst_order: Optional[str] = typer.Option(None, "--dst-order", help="shard order of the target"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="float32 | bfloat16 | float16 | float8"),
    profile: str = typer.Option("h100-sxm-spec-cal", "--profile", help="profile whose collective times cost the "
                                "steps"),
    ranks_per_node: Optional[int] = typer.Option(None, "--ranks-per-node", help="[the profile's GPUs per node]",
                                                 parser=WHOLE),
    no_flatten: bool = typer.Option(False, "--no-flatten", help="one mesh axis per collective"),
    no_torch: bool = typer.Option(False, "--no-torch", help="skip torch's planner (no torch import)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document"),
):
    """Plan a DTensor redistribution: parsim's cheapest path (Dijkstra over layouts with shard orders, edge costs
    from the profile), beside torch's own planner's path costed the same way."""
    from parsim.cli.views import print_redistribution
    from parsim.redistribute import redistribution

    def torch_planner(mesh_shape, tensor_shape, a, b):  # torch imported only when its path is asked for
        from parsim.executor.redistribute_torch import fake_mesh, torch_path

        return torch_path(fake_mesh(mesh_shape), tensor_shape, a, b)

    doc = redistribution(mesh, shape, src, dst, src_order, dst_order, dtype, profile_for_this_machine(profile),
                         ranks_per_node, flatten=not no_flatten, torch_planner=None if no_torch else torch_planner)
    if as_json:
        emit_json(doc)
        return
    print_redistribution(doc)


@app.command()
@guarded
def orders(
    case: Optional[list[str]] = typer.Option(None, "--case", help="case to run (repeatable) [all]: "
                                             "tp-ac-fsdp, tp-compile-fsdp, ac-compile-fsdp, pp-ac-fsdp, pp-tp, "
                                             "moe-ep-tp-ac-fsdp"),
    stored: bool = typer.Option(False, "--stored", help="show the stored matrix of the installed torch, run nothing"),
    out: str = typer.Option("profiles/orders.json", "--out", help="data file the matrix is merged into"),
    steps: int = typer.Option(3, "--steps", help="timed steps per run (after 2 warm-up steps)", parser=WHOLE),
    cost_repeats: int = typer.Option(3, "--cost-repeats", help="interleaved rounds measuring AC wrapping compile "
                                     "(0: skip)", parser=WHOLE),
    timeout_s: float = typer.Option(600.0, "--timeout", help="seconds per run"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document"),
):
    """Execute every order of the enabled wrappers (PP, TP, AC, compile, FSDP) on tiny models over 2-4 gloo ranks
    with the installed torch: ran / failed / ran but differs, beside what parsim's written rules predict."""
    from pathlib import Path

    from parsim.errors import ParsimError
    from parsim.jsonio import check_output_path
    from parsim.ordering import load_observed, orders_document

    if stored:
        doc = orders_document(load_observed(out))
    else:
        require_torch("orders")
        from parsim.executor.orders import CASES, run_orders

        names = case or list(CASES)
        bad = [c for c in names if c not in CASES]
        if bad:
            raise ParsimError(f"unknown case {bad[0]!r} (known: {', '.join(CASES)})")
        check_output_path(Path(out))
        progress = None if as_json else _orders_progress()
        data = run_orders(names, out, steps=steps, timeout_s=timeout_s, cost_repeats=cost_repeats,
                          progress=progress)
        doc = orders_document(data)
    if as_json:
        emit_json(doc)
        return
    from parsim.cli.views import print_orders

    print_orders(doc)


def _orders_progress():
    from parsim.console import console as folding_console

    con = folding_console(stderr=True)

    def show(case_name, row):
        con.print(f"{case_name}: {','.join(row['order'])} -> {row['outcome']}"
                  + (f" ({row['error'][:80]})" if row.get("error") else ""))

    return show


@app.command()
@guarded
def validate(
    model: Optional[str] = typer.Option(None, "--model", help="measured tier: preset to run [tiny]"),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="measured tier: CPU ranks (gloo) "
                                                 "[2]", parser=WHOLE),
    out: str = typer.Option(..., "--out", help="results folder (measurements.jsonl, rows.json, summary.json)"),
    published: Optional[str] = typer.Option(None, "--published", help="a CSV in the schema of "
                                            "bench/published/dev.csv: predict its rows, run nothing"),
    profile: Optional[str] = typer.Option(None, "--profile", help="profile to predict with [cpu-gloo-<ranks>; "
                                          "published: each row's spec-sheet profile, calibrated]"),
    uncalibrated: bool = typer.Option(False, "--uncalibrated", help="published: the raw spec-sheet profiles, "
                                      "not their calibrated versions (what `parsim calibrate` fits)"),
    rounds: Optional[int] = typer.Option(None, "--rounds", help="measured tier: interleaved repetitions of every "
                                         "plan [2]", parser=WHOLE),
    steps: Optional[int] = typer.Option(None, "--steps", help="measured tier: timed steps per run (after 2 "
                                        "warm-up steps) [5]", parser=WHOLE),
    max_plans: Optional[int] = typer.Option(None, "--max-plans", help="measured tier: run only the first N plans "
                                            "of the space (0: all) [0]", parser=WHOLE),
    measure_blocks: bool = typer.Option(False, "--measure-blocks", help="measured tier: time every plan's blocks "
                                        "at its local shapes and sweep the collectives at the start of every "
                                        "round (DIR/blocks.jsonl, DIR/collectives.jsonl) and predict with each "
                                        "time's median over the rounds (kept in the profile); the summary without "
                                        "the blocks is written beside"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="measured tier: seconds per run [600]"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Put predictions beside measurements: run a small space here (resumable), or predict published runs."""
    from pathlib import Path

    from parsim.cli.common import Bars
    from parsim.cli.loop import print_summary
    from parsim.errors import ParsimError
    from parsim.jsonio import check_output_path
    from parsim.loop_jobs import validate_measured, validate_published
    from parsim.procs import check_timeout

    measured_only = {"--model": model, "--nproc-per-node": nproc_per_node, "--rounds": rounds, "--steps": steps,
                     "--max-plans": max_plans, "--measure-blocks": measure_blocks or None, "--timeout": timeout}
    _check_dependent_flags({**{f: (v is not None, "the measured tier (without --published)", not published)
                               for f, v in measured_only.items()},
                            "--uncalibrated": (uncalibrated, "--published", bool(published))})
    if Path(out).exists() and not Path(out).is_dir():
        raise ParsimError(f"--out {out} exists and is not a folder")
    if not published:
        require_torch("validate --model")
    check_output_path(out + "/summary.json", make_parents=True)
    if published:
        summary = validate_published(published, out, profile, calibrated=not uncalibrated)
    else:
        timeout = 600.0 if timeout is None else timeout
        check_timeout(timeout)
        with Bars() as bars:
            summary = validate_measured(model or "tiny", 2 if nproc_per_node is None else nproc_per_node, out,
                                        profile=profile, rounds=2 if rounds is None else rounds,
                                        steps=5 if steps is None else steps, max_plans=max_plans or 0,
                                        timeout_s=timeout, measure_blocks=measure_blocks, progress=bars)
    if as_json:
        emit_json(summary)
    else:
        print_summary(summary)


@app.command()
@guarded
def calibrate(
    dirs: Optional[list[str]] = typer.Argument(None, help="folders written by `parsim validate`"),
    trace: Optional[list[str]] = typer.Option(None, "--trace", help="a folder written by `parsim run "
                                              "--profile-trace` (repeat for more plans): fit to its traced steps' "
                                              "components instead of validation rows"),
    profile: Optional[str] = typer.Option(None, "--profile", help="with --trace: the profile to calibrate [this "
                                          "machine's, as run picks it]"),
    params: Optional[str] = typer.Option(None, "--params", help="comma-separated parameters to fit, of "
                                         "gemm_eff_max attention_eff_max float8_eff_max memory_efficiency "
                                         "compile_memory_factor comm_interference layer_overhead comm_scale_tp "
                                         "comm_scale_dp comm_scale_pp comm_scale_ep comm_scale_all_reduce "
                                         "[measured rows: the CPU set; published rows: the GPU set]"),
    folds: int = typer.Option(5, "--folds", help="cross-validation folds when grouped by family (plans that differ "
                              "only in options; a published row's source table)", parser=WHOLE),
    folds_by: Optional[str] = typer.Option(None, "--folds-by", help="family | source: source leaves each source out "
                                           "(each predicted, and its intervals sized, by a fit that never saw it) "
                                           "[source where the rows come from 3+ sources, else family]"),
    out_dir: Optional[str] = typer.Option(None, "--out-dir", help="where NAME-cal.json goes [the profile folder, as "
                                            "for profile --out-dir]"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Fit named profile parameters to validation results; report out-of-fold accuracy; size the intervals."""
    from parsim.cli.loop import print_calibration
    from parsim.errors import ParsimError
    from parsim.loop_jobs import calibrate_dirs

    if not 2 <= folds <= 100:
        raise ParsimError(f"--folds must be in 2..100, got {folds}")
    if folds_by is not None and folds_by not in ("family", "source"):
        raise ParsimError(f"--folds-by must be family or source, got {folds_by!r}")
    if trace:
        if dirs:
            raise ParsimError("give validation folders or --trace folders, not both (each is its own fit)")
        from parsim.loop_jobs import calibrate_traces

        out = calibrate_traces(list(trace), profile, out_dir)
        if as_json:
            emit_json(out)
        else:
            from parsim.cli.trace_view import print_trace_calibration

            print_trace_calibration(out)
        return
    if not dirs:
        raise ParsimError("give the folders `parsim validate` wrote, or --trace folders")
    out = calibrate_dirs(dirs, params, folds, out_dir, folds_by)
    if as_json:
        emit_json(out)
    else:
        print_calibration(out)


@app.command()
@guarded
def report(
    dirs: list[str] = typer.Argument(..., help="folders written by `parsim validate` (and `calibrate`)"),
    html: Optional[str] = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    csv: Optional[str] = typer.Option(None, "--csv", help="write the predicted-vs-measured table here"),
    plotly_js: str = typer.Option("inline", "--plotly-js", help="inline (self-contained, ~4.7 MB) | cdn (one "
                                  "script tag, small, needs the network to draw)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Predicted vs measured per plan or published row: table, statistics, and an HTML page with plots."""
    from parsim.errors import ParsimError
    from parsim.jsonio import check_outputs
    from parsim.loop_jobs import load_rows
    from parsim.report_html import build_table, write_html

    if plotly_js not in ("inline", "cdn"):
        raise ParsimError(f"--plotly-js takes inline or cdn, got {plotly_js!r}")
    _check_dependent_flags({"--plotly-js": (plotly_js != "inline", "--html", html is not None)})
    check_outputs({"--html": html, "--csv": csv},
                  [f"{d}/{name}" for d in dirs for name in ("rows.json", "summary.json", "calibration.json")])
    rows = load_rows(dirs)
    table, stats = build_table(rows, dirs)
    if csv:
        from parsim.jsonio import atomic_write_text

        atomic_write_text(csv, table.to_csv(index=False))
    if html:
        write_html(html, table, stats, dirs, plotly_js)
    if as_json:
        emit_json({"stats": stats, "rows": table.astype(object).where(table.notna(), None).to_dict("records")})
        return
    from parsim.cli.loop import print_summary_table
    from parsim.console import console as folding_console

    con = folding_console()
    print_summary_table(con, stats)
    from rich.table import Table

    t = Table(title="largest errors (step time)")
    for c in ("plan or row", "model", "measured ms", "shown ms", "error"):
        t.add_column(c, justify="left" if c in ("plan or row", "model") else "right")
    for r in table.sort_values("abs_err", ascending=False).head(10).itertuples():
        published = str(getattr(r, "tier", "")) == "published"  # a published row is named by its id
        t.add_row(str(r.plan_id) if published else r.describe, "" if published else r.model,
                  f"{r.measured_ms:.1f}", f"{r.shown_ms:.1f}", f"{r.err_pct:+.0f}%")
    con.print(t)
    if html:
        con.print(f"wrote {html}")


@app.command("read-trace")
@guarded
@plan_options
def read_trace(
    flags: dict,
    traces: list[str] = typer.Argument(..., help="trace files (.json, .json.gz: one per rank) or folders of them"),
    html: Optional[str] = typer.Option(None, "--html", help="write a plotly page here"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document"),
):
    """Read torch.profiler traces: where each profiled step went (compute by phase and kind, collectives by axis,
    exposed and hidden, idle); with the plan that ran (--plan or the plan flags, and --model), beside the prediction
    (a CPU trace on this machine's profile unless --profile names one)."""
    from parsim.flags import given_plan_flags
    from parsim.jsonio import check_outputs
    from parsim.trace_compare import compare, summary
    from parsim.traceread import plan_file_of, read_traces, recorded_plan

    check_outputs({"--html": html}, list(traces))
    planned = flags.get("model_given") or flags.get("plan_file") or given_plan_flags(flags)
    ran = recorded_plan(traces)  # a `run --profile-trace` folder says what ran
    if not planned and ran:
        flags["plan_file"] = planned = plan_file_of(traces)
    if planned:
        spec, plan, hw = build_plan(flags)
        read = read_traces(traces, plan)
        if not flags.get("profile_given") and all(r.device == "cpu" for r in read):
            from parsim.run_prep import cpu_run_profile

            here, why = cpu_run_profile(None, plan.world_size)  # a CPU trace: this machine's profile, as run picks
            hw = here
        if hw is None:
            typer.echo(f"warning: the trace alone: {why}; or give --profile", err=True)
            res = summary(read)
        else:
            res = compare(read, spec, plan, hw)
    else:
        res = summary(read_traces(traces))
    res["unprofiled_step_s"] = (ran or {}).get("unprofiled_median_step_s")
    if html:
        from parsim.trace_html import write_html

        write_html(html, res)
    if as_json:
        emit_json(res)
        return
    from parsim.cli.trace_view import print_trace

    print_trace(res)
    if html:
        typer.echo(f"wrote {html}")


def _click_exceptions() -> tuple[tuple, tuple]:
    """(usage-error classes, abort classes) of click and of the click that newer typer versions vendor."""
    usage, abort = [], []
    for mod in ("click.exceptions", "typer._click.exceptions"):
        try:
            m = __import__(mod, fromlist=["UsageError"])
        except ImportError:
            continue
        usage.append(m.UsageError)
        if hasattr(m, "Abort"):
            abort.append(m.Abort)
    abort += [typer.Abort] if hasattr(typer, "Abort") else []
    return tuple(usage), tuple(abort)


def main(argv: list[str] | None = None) -> int:
    """The ``parsim`` entry point. Usage errors (an unknown flag, a value of the wrong type) print one line and
    exit 2, like ParsimError; Ctrl-C exits 130 after the commands have ended what they started."""
    usage_errors, aborts = _click_exceptions()
    _warnings_as_lines()
    from parsim.procs import TermAsInterrupt

    try:
        with TermAsInterrupt():  # SIGTERM ends a command as Ctrl-C does: its temporary files and children go
            code = app(args=argv, standalone_mode=False, prog_name="parsim")
    except usage_errors as e:
        if not e.format_message().strip():  # no_args_is_help: the help was printed
            return _exit(0, argv)
        hint = f" (parsim {e.ctx.info_name} --help)" if e.ctx is not None and e.ctx.info_name != "parsim" else ""
        typer.echo(f"error: {_one_line(e.format_message())}{hint}", err=True)
        code = 2
    except (KeyboardInterrupt, *aborts):
        code = 130
    except BrokenPipeError:  # `parsim ... | head`
        code = 0
    from parsim.jsonio import discard_unfinished

    discard_unfinished()  # a temporary file whose command ended before its ``try`` could discard it
    if code == 130:  # Ctrl-C: raised here, or turned into 130 by the click that newer typer versions vendor
        typer.echo("interrupted: everything the command started has been ended", err=True)
    return _exit(code if isinstance(code, int) else 0, argv)


def _warnings_as_lines() -> None:
    """parsim's warnings (ParsimWarning) as one ``warning: ...`` line on stderr, never on stdout (--json stays
    pure)."""
    import warnings

    from parsim.errors import ParsimWarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ParsimWarning):
            print(f"warning: {message}", file=sys.stderr)
        else:
            _default_show(message, category, filename, lineno, file, line)

    _default_show = warnings.showwarning
    warnings.showwarning = show


def _exit(code: int, argv) -> int:
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
