"""One rank of `parsim run`: build, parallelize, train on synthetic data, measure. Run under torchrun:

    torchrun --nproc-per-node 4 -m parsim.executor.worker --model tiny --plan plan.json --out result.json

Data: for step i a generator seeded with 1000 + i draws the global batch of token ids (global x seq+1); data-
parallel rank r takes rows [r * local * accum, (r+1) * local * accum) and pass k of them rows [k*local, (k+1)*local).
The loss of a rank is the summed token cross-entropy divided by the *global* token count, so gradients reduced
with SUM are the global-mean gradients (on gloo the AVG path is wrong, pytorch#162338), and the logged loss is
the all-reduced sum (divided by tp: TP ranks compute the same logits). Gradients are clipped to norm 1.0 and
AdamW(lr=1e-3, weight_decay=0.1) steps — (or SGD for parity checks) the same as `reference.py`, the single-process
run the losses are
compared with.

Environment: PARSIM_DEVICE=cpu forces gloo on a GPU machine; debugging aids: PARSIM_NO_COUNT=1 skips the
collective counter, PARSIM_HANG_DUMP_S=N dumps every thread's stack after N seconds (found the PP hang),
PARSIM_DEBUG=1 makes the memory tracker print what is alive at the peak (by op; 2: by op, shape and dtype; 3: every
tensor apart, in bytes, with its allocation's index and the phase it was made in; 4: a line per allocation and free,
the running total beside each, to read a moment's neighbourhood); PARSIM_TORCH_PROFILE=PREFIX runs
one more step under torch.profiler and writes PREFIX.rank<r>.csv (ops and kernels with their self times);
PARSIM_CUDA_MEMORY_SNAPSHOT=PREFIX (CUDA) records every allocation and writes PREFIX.rank<r>.json, what was live at
the allocated peak grouped by the line that allocated it (``measure.peak_holders``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from ..codec import validate_plan
from ..plan import Plan
from ..procs import die_with_parent
from ..spec import load_model
from .launch import PROGRESS_PREFIX
from .loss import loss_sum

SEED_DATA = 1000
LR, WD, CLIP = 1e-3, 0.1, 1.0
SGD_LR = 0.5


def make_optimizer(params, name: str):
    """AdamW for real runs; SGD for parity checks (its update is proportional to the gradient, so a gradient
    scaled wrongly — e.g. gloo's AVG path — shows in the losses, which Adam's normalization would hide)."""
    # one param group per mesh (plain tensors apart): a foreach kernel over a list mixing DTensors and plain
    # tensors fails ("got mixed torch.Tensor and DTensor"), as with TP and no FSDP, where norms stay plain
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    groups = [{"params": ps} for ps in by_mesh.values()]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=SGD_LR)
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WD, foreach=True)


def batch_for_step(step: int, global_batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED_DATA + step)
    return torch.randint(0, vocab, (global_batch, seq + 1), generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss under loss_parallel is a replicated DTensor: its local value is the loss."""
    return t.to_local() if hasattr(t, "to_local") else t


def loss_context(plan: Plan, device_type: str = "cpu"):
    """The step's contexts: loss_parallel() under TP (vocab-sharded logits), and, when no FSDP applies mixed
    precision (no data parallelism), torch.autocast to the plan's param dtype as torchtitan does."""
    import contextlib

    stack = contextlib.ExitStack()
    if plan.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        stack.enter_context(loss_parallel())
    if not plan.fsdp_applied and plan.param_dtype != "float32":
        stack.enter_context(torch.autocast(device_type, dtype=getattr(torch, plan.param_dtype)))
    return stack


def clip_and_step(params, opt, pp_group=None, ep_group=None, expert_ids=frozenset()):
    """Clip to the global gradient norm and step. Gradients live on several meshes (FSDP x TP, the expert-FSDP
    mesh): each group's norm is reduced over its own mesh (DTensor), expert norms are summed over ``ep_group``
    (the EP group, each EP rank holding different experts; without EP the experts are dense weights here) and
    everything over the PP stages."""
    groups: dict = {}
    for p in params:
        if p.grad is None:
            continue
        # grouped by mesh *equality*, as torchtitan's one get_total_norm over the dense (or the expert) grads: the
        # FSDP param groups hold distinct but equal mesh objects, and one norm per object would reduce each
        # group's norm separately (one tiny all-reduce per group and mesh dimension)
        expert = ep_group is not None and id(p) in expert_ids
        key = ("expert" if expert else "dense", getattr(p.grad, "device_mesh", None))
        groups.setdefault(key, []).append(p.grad)
    total_sq = None
    for (kind, _), grads in groups.items():
        n = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if hasattr(n, "full_tensor"):
            n = n.full_tensor()
        sq = n.float() ** 2
        if kind == "expert" and ep_group is not None:
            dist.all_reduce(sq, group=ep_group)
        total_sq = sq if total_sq is None else total_sq + sq
    if total_sq is None:
        total_sq = torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    # torch.nn.utils.clip_grads_with_norm_'s coefficient, applied per mesh group (a foreach over mixed meshes
    # fails); kept a tensor so that the same code runs on fake tensors in `parsim trace`
    coef = torch.clamp(CLIP / (total_sq.sqrt() + 1e-6), max=1.0)
    for grads in groups.values():
        torch._foreach_mul_(grads, coef)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv=None) -> int:
    die_with_parent()  # torchrun gone (killed, crashed): this rank goes too
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    args = ap.parse_args(argv)
    if os.environ.get("PARSIM_HANG_DUMP_S"):  # debugging aid: dump every thread's stack after N seconds
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["PARSIM_HANG_DUMP_S"]), exit=True)

    cuda = torch.cuda.is_available() and os.environ.get("PARSIM_DEVICE", "") != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    result = {"rank": rank, "status": "ok", "error": ""}
    try:
        result.update(_run(args, device, rank, world))
    except Exception as e:  # noqa: BLE001 - recorded, not raised: a failing plan is data
        oom = isinstance(e, torch.cuda.OutOfMemoryError) if cuda else False
        result.update(status="oom" if oom else "error", error=f"{type(e).__name__}: {e}".strip()[:2000],
                      traceback=traceback.format_exc()[-4000:])
    gathered = [None] * world
    try:
        dist.all_gather_object(gathered, result)
    except Exception:  # noqa: BLE001 - ranks out of step after an error: write what this rank has
        gathered = [result]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": gathered, "device": str(device), "torch": torch.__version__,
                       "backend": dist.get_backend(), "world_size": world, "host": socket.gethostname()}, f)
    dist.destroy_process_group()
    return 0


def _run(args, device, rank, world) -> dict:
    job = _Job(args, device, world)
    losses, times, profiled, measured = _train(job, args, rank)
    return {"losses": losses, "step_times_s": times, "profiled_step_times_s": profiled,
            "median_step_time_s": statistics.median(times) if times else None, **measured,
            "compiled_graphs": compiled_graphs()}


class _Job:
    """A rank's model, parallelized as the plan says, its optimizer and its share of each step's data."""

    def __init__(self, args, device, world):
        from .model import GroupedExperts, Transformer
        from .parallelize import Meshes, apply_plan

        with open(args.plan) as f:
            plan = Plan.from_dict(json.load(f))
        self.plan, self.device, self.spec = plan, device, load_model(args.model)
        validate_plan(plan, self.spec, world)
        self.snapshot = os.environ.get("PARSIM_CUDA_MEMORY_SNAPSHOT") if device.type == "cuda" else None
        if self.snapshot:  # every allocation from here on, with its Python stack (what holds a GPU run's peak)
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        torch.manual_seed(0)
        model = Transformer(self.spec, plan.seq_len)
        model.init_weights(seed=0)
        model.to(device)
        self.meshes = Meshes(plan, device.type)
        self.parts, stage_ids = apply_plan(model, plan, self.meshes)
        self.params = [p for m in self.parts for p in m.parameters()]
        self.opt = make_optimizer(self.params, args.optimizer)
        self.expert_ids = {id(p) for m in self.parts for mod in m.modules() if isinstance(mod, GroupedExperts)
                           for p in mod.parameters()}
        coord = dict(zip(self.meshes.world.mesh_dim_names, self.meshes.world.get_coordinate(), strict=True))
        self.dp_rank = coord["dp_replicate"] * plan.dp_shard + coord["dp_shard"]
        self.n_global = plan.global_batch_size * plan.seq_len
        self.schedule, self.stages = (_schedule(plan, self.parts, stage_ids, self.meshes, device, self.n_global)
                                      if plan.pp > 1 else (None, []))
        self.first, self.last = 0 in stage_ids, (plan.pp * plan.pp_stages_per_rank - 1) in stage_ids

    def step(self, i: int) -> torch.Tensor:
        """One training step; returns this rank's share of the loss (reduced outside any counter). The optimizer
        runs outside the step's contexts, as in the trace: under autocast (no FSDP) the weights' cast copies stay
        cached until the region ends, and with the optimizer inside they were alive at its peak (measured on an
        H100: +0.98 GiB with full AC, +2.8 GiB without, over the trace's and the model's 27.70 GiB)."""
        with loss_context(self.plan, self.device.type):
            contrib = self._forward_backward(i)
        clip_and_step(self.params, self.opt, self.meshes.pp.get_group() if self.meshes.pp is not None else None,
                      self.meshes.expert_norm_group(), self.expert_ids)
        return contrib

    def fwd_bwd_only(self, i: int) -> None:
        """Step ``i``'s forward and backward with the gradients dropped: the parameters stay as they were."""
        with loss_context(self.plan, self.device.type):
            self._forward_backward(i)
        self.opt.zero_grad(set_to_none=True)

    def _forward_backward(self, i: int) -> torch.Tensor:
        plan, lbs, ga = self.plan, self.plan.local_batch_size, self.plan.grad_accum_steps
        data = batch_for_step(i, plan.global_batch_size, plan.seq_len, self.spec.vocab_size)
        mine = data[self.dp_rank * lbs * ga:(self.dp_rank + 1) * lbs * ga].to(self.device)
        contrib = torch.zeros((), device=self.device)
        for k in range(ga):
            # own tensors: context parallel shards its buffers in place
            x, y = mine[k * lbs:(k + 1) * lbs, :-1].clone(), mine[k * lbs:(k + 1) * lbs, 1:].clone()
            share = self._pass(k, x, y)
            if share is not None:
                contrib += share
        return contrib

    def _pass(self, k: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Gradient-accumulation pass ``k`` on the local batch ``x`` (targets ``y``): this rank's loss share (None
        on a pipeline rank without the last stage)."""
        from .cp import cp_context
        from .parallelize import set_grad_sync

        plan, parts = self.plan, self.parts
        if self.schedule is None:
            set_grad_sync(parts, plan, k)
            with cp_context(plan, self.meshes, parts, x, y):
                logits = parts[0](x)
                loss = loss_sum(logits, y, plan.fused_loss) / self.n_global
                # (the logits go before the backward, as torchtitan's train step does: what the loss needs of them
                # it saved; kept, they are a (tokens x vocab) tensor beside the loss's backward)
                del logits
                loss.backward()
            return _local(loss.detach())
        losses: list = []
        first, last = self.first, self.last
        with cp_context(plan, self.meshes, parts, x if first else None, y if last else None):
            # (return_outputs=False: torch's last stage otherwise keeps every microbatch's output, the logits,
            # until the step ends, to merge them for the caller [torch 2.13 PipelineStage.output_chunks; pytorch
            # issue 159251]: the loss is all a training step needs)
            self.schedule.step(x if first else None, target=y if last else None, losses=losses if last else None,
                               return_outputs=False)
        return torch.stack([_local(lo.detach()) for lo in losses]).sum() if last else None

    def logged(self, contrib: torch.Tensor) -> float:
        dist.all_reduce(contrib)  # logging only: not part of the counted step
        return float(contrib) / self.plan.tp  # CP ranks hold disjoint tokens' shares of the loss

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()


def _train(job: _Job, args, rank: int) -> tuple:
    """Warmup, timed and (with a tracer) profiled steps; the first step's collectives counted and, on CPU, the
    second's tensor-level memory tracked (neither timed). Returns (losses, timed step seconds, profiled step
    seconds, the memory and collective measurements)."""
    from .measure import CommCounter, recv_buffers, track_step

    losses, times, profiled = [], [], []
    m: dict = {"comm_bytes": {}, "comm_counts": {}, "peak_memory_bytes": None, "memory_breakdown_bytes": {},
               "memory_source": ""}
    device = job.device
    tracer = StepTracer(os.environ.get("PARSIM_PROFILE_TRACE"), rank, device.type)
    timed_end = args.warmup + args.steps  # with a tracer, as many steps again after these, profiled
    total, count = timed_end + (args.steps if tracer.out_dir else 0), not os.environ.get("PARSIM_NO_COUNT")
    track = min(1, total - 1) if device.type == "cpu" else None
    plain0 = first_plain(count, track)
    for i in range(total):
        if i == plain0:
            compile_after_modes(job.plan, lambda: job.fwd_bwd_only(total), job.sync)  # untimed
        job.sync()
        t0 = time.perf_counter()
        if i == 0 and count:  # collective bytes of one step (not timed)
            counter = CommCounter(job.meshes.axis_of_group())
            with counter:
                contrib = job.step(i)
            losses.append(job.logged(contrib))
            m.update(comm_bytes=counter.bytes, comm_counts=counter.counts)
        elif i == track:  # tensor-level memory of one step (not timed)
            lo, peak, breakdown, peak_op = track_step(lambda i=i: job.step(i), job.parts, job.opt,
                                                      pipeline_buffers=recv_buffers(job.stages))
            note = f"parsim PeakTracker: tensor-level peak of live storages during one step (CPU), at {peak_op}"
            if job.plan.compile:  # dynamo runs the blocks eager under a dispatch mode: this step was not compiled
                note += "; an eager step (a compiled plan's CPU peak is not tracked)"
            m.update(peak_memory_bytes=peak, memory_breakdown_bytes=breakdown, memory_source=note)
            losses.append(job.logged(lo))
        else:
            if device.type == "cuda" and i == args.warmup:
                torch.cuda.reset_peak_memory_stats()
            tracer.begin(i >= timed_end)
            losses.append(job.logged(job.step(i)))
        job.sync()
        (profiled if i >= timed_end else times if i >= args.warmup else []).append(time.perf_counter() - t0)
        tracer.step_ended()
        if rank == 0:
            _progress(i, total, args.warmup, time.perf_counter() - t0, losses[-1])
    tracer.finish()
    _after_steps(job, m, rank, total)
    return losses, times, profiled, m


def _after_steps(job: _Job, m: dict, rank: int, total: int) -> None:
    """A GPU run's peak over the timed steps (into ``m``), its allocation snapshot and torch profile if asked."""
    if job.device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated())
        m.update(peak_memory_bytes=peak, memory_breakdown_bytes={
            "allocated_peak": peak, "reserved_peak": float(torch.cuda.max_memory_reserved())},
            memory_source="torch.cuda.max_memory_allocated over the timed steps (reserved_peak: max_memory_reserved)")
    if job.snapshot:
        from .measure import peak_holders

        with open(f"{job.snapshot}.rank{rank}.json", "w") as f:
            json.dump(peak_holders(torch.cuda.memory._snapshot()), f, indent=1)
        torch.cuda.memory._record_memory_history(enabled=None)
    if os.environ.get("PARSIM_TORCH_PROFILE"):  # one more step, untimed, under torch.profiler (where time goes)
        _profiled_step(lambda: job.logged(job.step(total)), os.environ["PARSIM_TORCH_PROFILE"], rank, job.sync)


def _progress(i: int, total: int, warmup: int, wall_s: float, loss: float) -> None:
    """``parsim-step 3/7 timed 612.3 ms loss 7.6879`` on stderr: which step, whether its time counts (warmup steps
    do not), its wall time from the barrier before it to the one after, the loss."""
    kind = "timed" if i >= warmup else "warmup"
    print(f"{PROGRESS_PREFIX}{i + 1}/{total} {kind} {wall_s * 1e3:.1f} ms loss {loss:.4f}", file=sys.stderr,
          flush=True)


def compiled_graphs() -> int:
    """Graphs dynamo captured in this process (0 when nothing was compiled: a compiled plan run eager)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def first_plain(count: bool, track: int | None) -> int:
    """The first step run under none of parsim's dispatch modes: step 0 counts collectives (unless
    PARSIM_NO_COUNT), step ``track`` tracks memory (CPU)."""
    i = 0
    while (i == 0 and count) or i == track:
        i += 1
    return i


def compile_after_modes(plan: Plan, run_step, sync) -> None:
    """Before the first step under none of parsim's modes (a compiled plan): forget what dynamo decided under the
    counting and tracking steps and compile in one more, untimed forward and backward (``run_step``; the parameters
    unchanged, so the losses follow the trajectory of a run without it). Those steps run under parsim's
    TorchDispatchModes (``measure.CommCounter``, ``PeakTracker``), where dynamo does not trace ("non-infra torch
    dispatch mode present") and marks the blocks' code to be skipped for the rest of the process: before this,
    every compiled plan was timed eager (found on an H200, 2026-11-28: no Triton kernel in the profiled step of a
    compile run; on CPU no frame traced). Their collective bytes and the CPU tensor-level memory stay those of the
    eager step. A compile that captures no graph (seen with TP blocks under AC) fails the run instead of
    timing it eager."""
    if not plan.compile:
        return
    torch._dynamo.reset()
    run_step()
    sync()
    if not compiled_graphs():  # a compiled plan timed eager is a wrong measurement, not a slow one
        raise RuntimeError("torch.compile captured no graph: the plan would run eager")


class StepTracer:
    """``PARSIM_PROFILE_TRACE=DIR`` (``parsim run --profile-trace DIR``): after the timed steps (the measurement), as
    many again run under torch.profiler (CPU, and CUDA where there is a GPU; shapes recorded, which the trace reader
    uses for a collective's bytes), one ``ProfilerStep#N`` per step, and each rank writes
    ``DIR/rank<r>.trace.json.gz`` (Chrome/Kineto format, what ``tensorboard_trace_handler`` writes). The profiled
    steps are timed apart (``profiled_step_times_s``): on a CPU the profiler's cost per recorded op is a large part
    of a step (measured here, 2 gloo ranks on 2 cores, tiny at global batch 8: 817-858 ms a step unprofiled,
    1,564-1,726 ms profiled with shapes, 1,147 ms without), which ``trace_calibrate`` takes out."""

    def __init__(self, out_dir: str | None, rank: int, device_type: str):
        self.out_dir, self.rank, self.device_type = out_dir, rank, device_type
        self.prof, self.mark, self.n = None, None, 0

    def begin(self, timed: bool) -> None:
        if not self.out_dir or not timed:
            return
        from torch.profiler import ProfilerActivity, profile, record_function

        if self.prof is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
            self.prof = profile(activities=acts, record_shapes=os.environ.get("PARSIM_TRACE_SHAPES", "1") == "1")
            self.prof.start()
        # the name torch.profiler's own schedule gives a step, which the trace reader looks for
        self.mark = record_function(f"ProfilerStep#{self.n}")
        self.mark.__enter__()
        self.n += 1

    def step_ended(self) -> None:
        if self.mark is not None:
            if self.device_type == "cuda":
                torch.cuda.synchronize()
            self.mark.__exit__(None, None, None)
            self.mark = None

    def finish(self) -> None:
        if self.prof is None:
            return
        self.prof.stop()
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{self.rank}.trace.json")
        self.prof.export_chrome_trace(path)
        import gzip
        import shutil

        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        self.prof = None


def _profiled_step(run_step, out_prefix: str, rank: int, sync) -> None:
    """Run one step under torch.profiler and write rank ``rank``'s kernels: ``<prefix>.rank<r>.csv`` (one row per
    op name: calls, self device and CPU time, summed over the step) -- the measured side of a step's breakdown.
    Set by ``PARSIM_TORCH_PROFILE=<prefix>``; the timed steps are not profiled."""
    import csv

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=acts) as prof:
        run_step()
        sync()
    rows = []
    for e in prof.key_averages():
        rows.append({"name": e.key, "calls": e.count, "self_device_us": float(e.self_device_time_total),
                     "self_cpu_us": float(e.self_cpu_time_total)})
    rows.sort(key=lambda r: -r["self_device_us"])
    with open(f"{out_prefix}.rank{rank}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["name"])
        w.writeheader()
        w.writerows(rows)


def _schedule(plan, parts, stage_ids, meshes, device, n_global):
    """(torch's schedule for the plan, the rank's ``PipelineStage`` objects)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    n_stages = plan.pp * plan.pp_stages_per_rank
    g = meshes.pp.get_group()
    stages = [PipelineStage(m, s, n_stages, device, group=g) for m, s in zip(parts, stage_ids, strict=True)]

    def loss_fn(logits, target):
        return loss_sum(logits, target, plan.fused_loss) / n_global

    n_micro = plan.n_microbatches
    if plan.pp_schedule == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn, scale_grads=False), stages
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[plan.pp_schedule]
    return cls(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False), stages


if __name__ == "__main__":
    sys.exit(main())
