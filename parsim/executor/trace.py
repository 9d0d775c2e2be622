"""`parsim trace`: the executor's model and plan code for any world size, in one CPU process, under a fake
process group and FakeTensorMode: per-rank peak memory with a breakdown and collective bytes per (op, axis) of one
training step (tier 1 of DESIGN.md: exact, full scale, no GPU).

The model is built and parallelized on the meta device *outside* FakeTensorMode (building inside fails: sub-mesh
coordinates use ``nonzero``), then materialized with ``to_empty`` inside it. Step 1 runs under the collective
counter and creates the optimizer states; step 2 runs under parsim's PeakTracker (live local storages; what was
alive at the peak by category).

Pipeline parallel: the schedule's point-to-point exchange needs real peers, so the trace replays the traced rank's
part of the schedule itself: forwards in schedule order with at most W chunk-microbatches in flight (W from the
schedule: 1F1B ``pp - rank``, GPipe all, Interleaved1F1B torch's warm-up + 1), backwards oldest first, gradient
sync only on the last backward (as torch.distributed.pipelining drives FSDP). PP sends are recorded from the
sizes of the tensors the stage would send. MoE routing is static and balanced in traces (fake tensors cannot
follow data-dependent token counts). torch.compile is not applied in traces (it changes no parameter or
collective; inductor's fusion would change activation memory, which the trace then overstates).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from ..plan import Plan
from ..results import Measurement
from ..spec import ModelSpec
from .loss import loss_sum


def trace_plan(spec: ModelSpec, plan: Plan, rank: int = 0) -> Measurement:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .measure import CommCounter, track_step
    from .model import GroupedExperts, Transformer
    from .parallelize import Meshes, apply_plan
    from .worker import clip_and_step, loss_context, make_optimizer

    plan.validate_for(spec)
    t0 = time.perf_counter()
    traced = dataclasses.replace(plan, compile=False)
    dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=FakeStore())
    prov = {"rank": rank, "world_size": plan.world_size, "torch": torch.__version__, "model": spec.name,
            "plan": plan.to_dict(), "notes": []}
    if plan.compile:
        prov["notes"].append("compile not applied in the trace")
    try:
        with torch.device("meta"):
            model = Transformer(spec, plan.seq_len)
        for mod in model.modules():
            if hasattr(mod, "static_routing"):
                mod.static_routing = True
        meshes = Meshes(traced, "cpu")
        parts, stage_ids = apply_plan(model, traced, meshes)
        with FakeTensorMode(allow_non_fake_inputs=True):
            for m in parts:
                m.to_empty(device="cpu")
            params = [p for m in parts for p in m.parameters()]
            opt = make_optimizer(params, "adamw")
            expert_ids = {id(p) for m in parts for mod in m.modules() if isinstance(mod, GroupedExperts)
                          for p in mod.parameters()}
            pp_g = meshes.pp.get_group() if meshes.pp is not None else None
            ep_g = meshes.expert_norm_group()
            sends = {"bytes": 0}

            def step():
                with loss_context(traced):
                    _fake_step(spec, traced, parts, stage_ids, sends)
                clip_and_step(params, opt, pp_g, ep_g, expert_ids)

            counter = CommCounter(meshes.axis_of_group())
            with counter:
                step()
            comm = dict(counter.bytes)
            if sends["bytes"]:
                comm["send/pp"] = comm.get("send/pp", 0) + sends["bytes"]
            sends["bytes"] = 0
            _, peak, breakdown, peak_op = track_step(step, parts, opt)
        prov.update(memory_source=f"parsim PeakTracker under FakeTensorMode (tensor-level, rank {rank})",
                    peak_op=peak_op,
                    comm_counts=dict(counter.counts), wall_s=time.perf_counter() - t0)
        return Measurement(plan_id=plan.plan_id, kind="trace", status="ok", peak_memory_bytes=peak,
                           memory_breakdown_bytes=breakdown, comm_bytes=comm, provenance=prov)
    except Exception as e:  # noqa: BLE001 - a plan the code cannot trace is recorded, not raised
        import traceback

        prov.update(wall_s=time.perf_counter() - t0, traceback=traceback.format_exc()[-4000:])
        return Measurement(plan_id=plan.plan_id, kind="trace", status="error", error=f"{type(e).__name__}: {e}"[:2000],
                           provenance=prov)
    finally:
        dist.destroy_process_group()


def _loss(logits, y, n_global, fused=False):
    return loss_sum(logits, y, fused) / n_global


def _fake_step(spec, plan: Plan, parts, stage_ids, sends):
    """Forward + backward of one step for the traced rank (see the module docstring for PP)."""
    mbs, seq = plan.micro_batch_size, plan.seq_len
    n_global = plan.global_batch_size * seq
    n_stages = plan.pp * plan.pp_stages_per_rank
    for _ in range(plan.grad_accum_steps):
        if plan.pp == 1:
            x = torch.randint(0, spec.vocab_size, (plan.local_batch_size, seq))
            _loss(parts[0](x), x, n_global, plan.fused_loss).backward()
            continue
        from torch.distributed.fsdp import FSDPModule

        seq_local = seq // plan.cp // (plan.tp if plan.sequence_parallel else 1)
        hidden_shape = (mbs, seq_local, spec.d_model)
        # a stage receives what the previous one sends: its output in param_dtype under FSDP mixed precision,
        # the fp32 residual stream under autocast (no data parallelism); its gradient goes back in that dtype
        autocast = plan.dp_replicate * plan.dp_shard * plan.cp == 1
        hidden_dtype = torch.float32 if autocast else getattr(torch, plan.param_dtype)
        # forward order and in-flight bound of this rank come from torch's own schedule (not the cost model's
        # formula: tests/test_executor.py checks the two agree). Backwards run oldest first: replaying torch's exact
        # backward order with this trace's explicit FSDP reshard over-counts one block's re-gather (a real 4-rank
        # interleaved run moved the model's bytes, not that)
        m, pp = plan.n_microbatches, plan.pp
        rank = stage_ids[0] % pp
        chunk_of = {sid: c for c, sid in enumerate(stage_ids)}
        actions = torch_schedule_order(plan.pp_schedule, pp, plan.pp_stages_per_rank, m, rank)
        order = [(chunk_of[sid], mb) for kind, sid, mb in actions if kind == "F"]
        width = max_inflight(actions)
        inflight = []
        n_back = [0] * len(parts)
        first_backward = [True]

        def backward_oldest():
            if first_backward[0]:  # torch's schedules re-gather once for the backward phase (as measured)
                first_backward[0] = False
                for part in parts:
                    for mod in part.modules():
                        if isinstance(mod, FSDPModule):
                            mod.reshard()
            c, out, inp = inflight.pop(0)
            last_mb = n_back[c] == m - 1
            mod = parts[c]
            if isinstance(mod, FSDPModule):
                mod.set_is_last_backward(last_mb)
                mod.set_reshard_after_backward(last_mb)
                mod.set_requires_gradient_sync(last_mb)
            if stage_ids[c] == n_stages - 1:
                out.backward()
            else:
                out.backward(torch.ones_like(out))
            if stage_ids[c] != 0:
                sends["bytes"] += inp.numel() * inp.element_size()  # gradient sent to the previous stage
            n_back[c] += 1

        for c, _i in order:
            sid = stage_ids[c]
            if sid == 0:
                inp = torch.randint(0, spec.vocab_size, (mbs, seq))
            else:
                inp = torch.randn(hidden_shape, dtype=hidden_dtype, requires_grad=True)
            out = parts[c](inp)
            if sid == n_stages - 1:
                out = _loss(out, torch.randint(0, spec.vocab_size, (mbs, seq)), n_global, plan.fused_loss)
            else:
                sends["bytes"] += out.numel() * out.element_size()
            inflight.append((c, out, inp))
            if len(inflight) >= width:
                backward_oldest()
        while inflight:
            backward_oldest()


def max_inflight(actions: list[tuple[str, int, int]]) -> int:
    """The most forwards whose backward has not run yet, along a rank's action sequence."""
    live = peak = 0
    for kind, _sid, _mb in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def torch_schedule_order(schedule: str, pp: int, v: int, n_micro: int, rank: int) -> list[tuple[str, int, int]]:
    """(F or B, stage index, microbatch) in the order torch.distributed.pipelining's schedule runs them on ``rank``,
    read from the schedule class itself (its pipeline-order IR) without building stages or process groups."""
    from torch.distributed.pipelining import schedules as S

    cls = {"GPipe": S.ScheduleGPipe, "1F1B": S.Schedule1F1B, "Interleaved1F1B": S.ScheduleInterleaved1F1B}[schedule]
    sched = object.__new__(cls)
    sched._n_microbatches = n_micro
    if schedule == "Interleaved1F1B":
        sched.pp_group_size, sched.n_local_stages = pp, v
        sched.number_of_rounds = max(1, n_micro // pp)
        sched.microbatches_per_round = n_micro // sched.number_of_rounds
        actions = sched._calculate_single_rank_operations(rank)
    else:
        sched._num_stages = pp
        actions = sched._get_pipeline_order()[rank]
    kinds = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in actions
            if a is not None and a.computation_type in kinds]


def trace_in_subprocess(spec: ModelSpec, plan: Plan, rank: int = 0, timeout_s: float = 1800.0) -> Measurement:
    """``trace_plan`` in a fresh interpreter. torch keeps state of a fake world after destroy_process_group
    (a second trace in one process failed: "Could not resolve the process group registered under the name
    201"), so callers that trace several plans (tests, benchmarks) isolate each one."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from ..jsonio import read_json

    with tempfile.TemporaryDirectory(prefix="parsim-trace-") as tmp:
        inp, out = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(inp, "w") as f:
            json.dump({"spec": spec.to_dict(), "plan": plan.to_dict(), "rank": rank}, f)
        proc = subprocess.run([sys.executable, "-m", "parsim.executor.trace", inp, out], capture_output=True,
                              text=True, timeout=timeout_s)
        if not os.path.exists(out):
            return Measurement(plan_id=plan.plan_id, kind="trace", status="error",
                               error=f"trace process exited {proc.returncode}: {proc.stderr[-1500:]}")
        return Measurement.from_dict(read_json(out, "bad trace output"))


if __name__ == "__main__":
    import sys

    from ..jsonio import atomic_write_json, read_json

    job = read_json(sys.argv[1], "bad trace input")
    result = trace_plan(ModelSpec.from_dict(job["spec"]), Plan.from_dict(job["plan"]), rank=job["rank"])
    atomic_write_json(sys.argv[2], result.to_dict())
