"""parsim command line: one thin typer wrapper per command over a plain parsim function.

Heavy modules (numpy, the cost model, torch in run/profile/trace) are imported inside the commands, so that
``parsim --help`` starts fast. Bad input raises ParsimError: one line on stderr, exit code 2.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="parsim: how to parallelize a PyTorch training job, what it will cost, and how sure we are.")


@app.callback()
def _root():
    """parsim: how to parallelize a PyTorch training job, what it will cost, and how sure we are."""


# ---- shared plan flags (CLI contract of shared/DESIGN.md; names follow torchtitan) -------------------------------------
PLAN_FLAGS = [
    ("model", str, typer.Option("llama3-8b", "--model", help="preset name or a config.json path")),
    ("gpus", Optional[int], typer.Option(None, "--gpus", help="number of GPUs (default: product of the degrees)")),
    ("dp_replicate", int, typer.Option(1, "--dp-replicate")),
    ("dp_shard", int, typer.Option(-1, "--dp-shard", help="-1 = the GPUs the other degrees leave")),
    ("tp", int, typer.Option(1, "--tp")),
    ("pp", int, typer.Option(1, "--pp")),
    ("cp", int, typer.Option(1, "--cp")),
    ("ep", int, typer.Option(1, "--ep")),
    ("etp", int, typer.Option(1, "--etp")),
    ("local_batch_size", int, typer.Option(1, "--local-batch-size")),
    ("micro_batch_size", int, typer.Option(0, "--micro-batch-size", help="0 = local batch (no microbatching)")),
    ("global_batch_size", int, typer.Option(0, "--global-batch-size", help="0 = local batch x dp")),
    ("seq_len", int, typer.Option(4096, "--seq-len")),
    ("pp_schedule", str, typer.Option("1F1B", "--pp-schedule", help="GPipe | 1F1B | Interleaved1F1B")),
    ("pp_stages_per_rank", int, typer.Option(0, "--pp-stages-per-rank", help="0 = 1, or 2 for Interleaved1F1B")),
    ("ac", str, typer.Option("none", "--ac", help="none | full | selective-op | layer:N")),
    ("compile", bool, typer.Option(False, "--compile/--no-compile")),
    ("float8", bool, typer.Option(False, "--float8/--no-float8")),
    ("sequence_parallel", Optional[bool], typer.Option(None, "--sequence-parallel/--no-sequence-parallel",
                                                        help="default: on when tp > 1")),
    ("fsdp_reshard_after_forward", str, typer.Option("default", "--fsdp-reshard-after-forward",
                                                     help="default | always | never")),
    ("mesh_order", str, typer.Option("pp,dp_replicate,dp_shard,cp,tp", "--mesh-order",
                                     help="device order, outermost first")),
    ("order", str, typer.Option("pp,tp,ac,compile,fsdp", "--order", help="wrapper order")),
    ("plan_file", Optional[str], typer.Option(None, "--plan", help="plan JSON (overrides the plan flags)")),
    ("profile", str, typer.Option("h100-sxm-spec", "--profile", help="profile name or path")),
]


def plan_options(fn):
    """Add the shared plan flags to a command; they arrive as one dict ``flags``."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "flags"]
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
             for n, ann, opt in PLAN_FLAGS]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        flags = {n: kwargs.pop(n) for n, _, _ in PLAN_FLAGS}
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
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)

    return wrapper


def build_plan(flags: dict):
    """(ModelSpec, Plan, HardwareProfile) from the shared flags."""
    from parsim.errors import ParsimError
    from parsim.hardware import load_profile
    from parsim.plan import Plan, plan_from_flags
    from parsim.spec import load_model

    spec = load_model(flags["model"])
    hw = load_profile(flags["profile"])
    if flags.get("plan_file"):
        from parsim.jsonio import read_json

        data = read_json(flags["plan_file"], "cannot read plan")
        data = data.get("plan", data) if isinstance(data, dict) else data
        plan = Plan.from_dict(data)
        if flags.get("gpus") is not None and plan.world_size != flags["gpus"]:
            plan.validate_for(spec, flags["gpus"])
    else:
        gpus = flags.get("gpus")
        if gpus is None:
            if flags["dp_shard"] == -1:
                raise ParsimError("give --gpus, or --dp-shard explicitly")
            gpus = flags["dp_replicate"] * flags["dp_shard"] * flags["tp"] * flags["pp"] * flags["cp"]
        if gpus < 1:
            raise ParsimError(f"--gpus must be >= 1, got {gpus}")
        sched = flags["pp_schedule"]
        spr = flags["pp_stages_per_rank"] or (2 if sched == "Interleaved1F1B" and flags["pp"] > 1 else 1)
        plan = plan_from_flags(
            gpus, dp_replicate=flags["dp_replicate"], dp_shard=flags["dp_shard"], tp=flags["tp"], pp=flags["pp"],
            cp=flags["cp"], ep=flags["ep"], etp=flags["etp"], local_batch_size=flags["local_batch_size"],
            micro_batch_size=flags["micro_batch_size"], global_batch_size=flags["global_batch_size"],
            seq_len=flags["seq_len"], pp_schedule=sched, pp_stages_per_rank=spr, ac=flags["ac"],
            compile=flags["compile"], float8=flags["float8"], sequence_parallel=flags["sequence_parallel"],
            fsdp_reshard_after_forward=flags["fsdp_reshard_after_forward"],
            mesh_order=tuple(s.strip() for s in flags["mesh_order"].split(",")),
            wrapper_order=tuple(s.strip() for s in flags["order"].split(",")),
        )
    plan.validate_for(spec)
    if plan.float8 and "float8" not in hw.peak_flops:
        raise ParsimError(f"--float8 needs a GPU with float8 tensor cores; profile {hw.name} has none")
    return spec, plan, hw


def emit_json(obj) -> None:
    from parsim.jsonio import _json_default

    sys.stdout.write(json.dumps(obj, indent=1, default=_json_default) + "\n")


# ---- commands ----------------------------------------------------------------------------------------------------
@app.command()
@guarded
@plan_options
def predict(flags: dict, as_json: bool = typer.Option(False, "--json", help="print one JSON document")):
    """Predict per-rank memory, step time and communication of one plan."""
    from parsim.costmodel import predict as _predict

    spec, plan, hw = build_plan(flags)
    pred = _predict(spec, plan, hw)
    if as_json:
        emit_json(pred.to_dict())
        return
    from parsim.report import print_prediction

    print_prediction(pred, spec, plan)


def _pins(flags: dict, no_pp: bool, no_cp: bool) -> dict:
    """Degrees the user pinned: a flag differing from its default pins that axis."""
    pins = {}
    defaults = {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    for k, dflt in defaults.items():
        if flags[k] != dflt:
            pins[k] = (flags[k],)
    if no_pp:
        pins["pp"] = (1,)
    if no_cp:
        pins["cp"] = (1,)
    return pins


@app.command()
@guarded
@plan_options
def search(
    flags: dict,
    top: int = typer.Option(10, "--top", help="how many plans to show"),
    no_pp: bool = typer.Option(False, "--no-pp", help="pipeline parallelism off"),
    no_cp: bool = typer.Option(False, "--no-cp", help="context parallelism off"),
    max_tp: Optional[int] = typer.Option(None, "--max-tp"),
    max_pp: Optional[int] = typer.Option(None, "--max-pp"),
    ac_modes: Optional[str] = typer.Option(None, "--ac-modes", help="comma list of AC modes to search "
                                           "(default: none,selective-op,full,layer:2; --ac pins one)"),
    search_compile: Optional[bool] = typer.Option(None, "--search-compile/--no-search-compile",
                                                  help="search compile on and off (default), or pin with --compile"),
    fixed_order: bool = typer.Option(False, "--default-mesh-order", help="only the default device order"),
    headroom: float = typer.Option(0.0, "--headroom", help="fraction of usable GPU memory to keep free"),
    explain: Optional[int] = typer.Option(None, "--explain", help="why plan N (1-based) beats the next ones"),
    emit_plan: Optional[str] = typer.Option(None, "--emit-plan", help="write the best plan as parsim plan JSON"),
    emit_torchtitan: Optional[str] = typer.Option(None, "--emit-torchtitan", help="write the best plan as a "
                                                  "torchtitan TOML job config"),
    csv: Optional[str] = typer.Option(None, "--csv", help="write every evaluated plan to this CSV"),
    execute: int = typer.Option(0, "--execute", help="run the top K plans with the executor on this machine"),
    execute_out: Optional[str] = typer.Option(None, "--execute-out", help="write predictions and measurements "
                                              "of --execute to this JSON"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document"),
):
    """Search every plan for a model on N GPUs and rank them by predicted step time."""
    from parsim.errors import ParsimError
    from parsim.hardware import load_profile
    from parsim.spec import load_model
    from parsim.search import SearchSpace

    spec = load_model(flags["model"])
    hw = load_profile(flags["profile"])
    gpus = flags["gpus"] or 8
    gbs = flags["global_batch_size"] or gpus
    if execute < 0:
        raise ParsimError("--execute takes K >= 0")
    ac = tuple(a.strip() for a in ac_modes.split(",")) if ac_modes else \
        ((flags["ac"],) if flags["ac"] != "none" else None)
    kw = dict(global_batch_size=gbs, seq_len=flags["seq_len"], max_tp=max_tp, max_pp=max_pp,
              device_orders=not fixed_order, headroom=headroom, **_pins(flags, no_pp, no_cp))
    if ac:
        kw["ac"] = ac
    if flags["compile"]:
        kw["compile"] = (True,)
    elif search_compile is False:
        kw["compile"] = (False,)
    if flags["float8"]:
        kw["float8"] = (True,)
    if flags["local_batch_size"] != 1:
        kw["local_batch_size"] = (flags["local_batch_size"],)
    if flags["micro_batch_size"]:
        kw["micro_batch_size"] = (flags["micro_batch_size"],)
    space = SearchSpace(**kw)
    from cli.views import run_search_cli

    run_search_cli(spec, hw, gpus, space, top=top, explain=explain, emit_plan=emit_plan,
                   emit_torchtitan=emit_torchtitan, csv_path=csv, as_json=as_json, execute=execute,
                   model_arg=flags["model"], execute_out=execute_out)


def _measurement_summary(m, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from parsim.units import GiB, MS

    con = Console()
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
    nproc_per_node: int = typer.Option(..., "--nproc-per-node", help="processes (GPUs, or CPU ranks with gloo)"),
    steps: int = typer.Option(5, "--steps", help="timed steps"),
    warmup: int = typer.Option(2, "--warmup", help="untimed steps first (collectives and memory are measured here)"),
    timeout: float = typer.Option(600.0, "--timeout", help="seconds before a hung run is killed and recorded"),
    out: Optional[str] = typer.Option(None, "--out", help="write the Measurement JSON here"),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="passed to torchrun (multi-node)"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="passed to torchrun"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="passed to torchrun"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu to force gloo on a GPU machine"),
    param_dtype: Optional[str] = typer.Option(None, "--param-dtype", help="float32 | bfloat16 (default bfloat16)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Run a plan for real under torchrun (gloo on CPU, NCCL on GPUs) and measure it."""
    import dataclasses

    from parsim.errors import ParsimError

    spec, plan, _ = build_plan(flags)
    if param_dtype:
        plan = dataclasses.replace(plan, param_dtype=param_dtype)
    world = plan.world_size
    n_nodes = int(nnodes.split(":")[-1]) if nnodes else 1
    if nproc_per_node * n_nodes != world:
        raise ParsimError(f"the plan needs {world} ranks, --nproc-per-node x nodes = {nproc_per_node} x {n_nodes}")
    from parsim.executor.launch import run_plan

    extra = []
    if nnodes:
        extra.append(f"--nnodes={nnodes}")
    if rdzv_endpoint:
        extra += [f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-backend=c10d"]
    if node_rank is not None:
        extra.append(f"--node-rank={node_rank}")
    m = run_plan(flags["model"], plan, nproc_per_node, steps=steps, warmup=warmup, timeout_s=timeout, out=out,
                 torchrun_args=extra, device=device)
    if as_json:
        emit_json(m.to_dict())
    else:
        _measurement_summary(m, f"{spec.name} {plan.describe()}")


@app.command()
@guarded
@plan_options
def trace(
    flags: dict,
    rank: int = typer.Option(0, "--rank", help="which rank to trace"),
    out: Optional[str] = typer.Option(None, "--out", help="write the Measurement JSON here"),
    compare: bool = typer.Option(False, "--compare", help="print the prediction beside the trace"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Trace one training step of a plan at full scale in one CPU process (fake process group + FakeTensorMode)."""
    from parsim.errors import ParsimError
    from parsim.executor.trace import trace_plan
    from parsim.jsonio import atomic_write_json

    spec, plan, hw = build_plan(flags)
    if not 0 <= rank < plan.world_size:
        raise ParsimError(f"--rank {rank} is outside the world of {plan.world_size} ranks")
    m = trace_plan(spec, plan, rank=rank)
    if out:
        atomic_write_json(out, m.to_dict())
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


@app.command()
@guarded
def profile(
    nproc_per_node: int = typer.Option(..., "--nproc-per-node", help="ranks (GPUs, or CPU ranks with gloo)"),
    out: str = typer.Option(..., "--out", help="profile name: writes profiles/NAME.json and NAME.samples.csv"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted profile"),
    min_bytes: int = typer.Option(0, "--min-bytes", help="smallest message (default 1 KiB)"),
    max_bytes: int = typer.Option(0, "--max-bytes", help="largest message (default 16 MiB on CPU, 1 GiB on GPU)"),
    factor: int = typer.Option(4, "--factor", help="geometric step of the message sizes"),
    ops: str = typer.Option("all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send", "--ops"),
    model: str = typer.Option("tiny", "--model", help="model whose block is timed (and GEMM shapes taken)"),
    seq_len: int = typer.Option(512, "--seq-len"),
    out_dir: Optional[str] = typer.Option(None, "--out-dir", help="default: the profiles/ folder"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu to profile gloo on a GPU machine"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Measure collectives and compute on this machine, fit them, and write a hardware profile."""
    from parsim.profiler.run import profile as _profile

    if factor < 2:
        from parsim.errors import ParsimError

        raise ParsimError(f"--factor must be >= 2, got {factor}")
    hw = _profile(out, nproc_per_node, resume=resume, min_bytes=min_bytes, max_bytes=max_bytes, factor=factor,
                  ops=ops, model=model, seq_len=seq_len, out_dir=out_dir, device=device,
                  log=lambda m: typer.echo(m, err=True))
    if as_json:
        emit_json(hw.to_dict())
        return
    from parsim.report import print_profile

    print_profile(hw)


def main():
    app()


if __name__ == "__main__":
    main()
