"""`parsim trace`: the executor's model and plan code for any world size, in one CPU process, under a fake
process group and FakeTensorMode: per-rank peak memory with a breakdown and collective bytes per (op, axis) of one
training step (tier 1 of DESIGN.md: exact, full scale, no GPU).

The model is built and parallelized on the meta device *outside* FakeTensorMode (building inside fails: sub-mesh
coordinates use ``nonzero``), then materialized with ``to_empty`` inside it. Step 1 runs under the collective
counter and creates the optimizer states; step 2 runs under parsim's PeakTracker (live local storages; what was
alive at the peak by category), which the fake-tensor mode shows every tensor it makes: a Python dispatch mode is
popped while DTensor handles an op, so without it the buffers of DTensor's own handlers (context parallel's ring
attention, loss parallel's cross-entropy, implicit redistributions) were missing from traced peaks.

Pipeline parallel: the schedule's point-to-point exchange needs real peers, so the trace replays the traced rank's
part of the schedule itself, action by action in the order torch's schedule runs them (``torch_schedule_order``),
with torch 2.13's FSDP protocol: every backward without gradient sync or reshard, each stage's gradients reduced
once after its last backward by torch's own ``perform_reduce_grad``, and for runtime schedules (interleaved) the
stage-wide UNSHARD / RESHARD actions of torch's lowering. A real run's first step also reshards after its
metadata inference (one more all-gather per unit, that step only); the trace shows the steady state. PP sends are
recorded from the sizes of the tensors the stage would send. MoE routing is static and balanced in traces (fake
tensors cannot follow data-dependent token counts). compile, float8 and async TP are not applied in traces
(``NOT_TRACED``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import types

import torch
import torch.distributed as dist

from ..codec import validate_plan
from ..plan import Plan
from ..results import Measurement
from ..spec import ModelSpec
from ..vocab import MemoryPhase
from .loss import loss_sum

# what a trace cannot apply, traced without: compile (inductor's fusion would change activation memory only, which
# the trace then overstates), float8 (torchao's float8 linears need CUDA's scaled matmul; they keep their
# high-precision inputs for the backward), async TP (symmetric memory on CUDA): none changes a parameter or a
# collective's bytes
NOT_TRACED = {"compile": False, "float8": False, "float8_recipe": "tensorwise", "async_tp": False}
# a functional collective's wait returns its input on a device (the collective wrote into it); under FakeTensorMode
# its fake kernel returns a new tensor, which would double the collective's output until the original is freed
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


class _CountingFake:
    """Built on first use: a FakeTensorMode that shows every collective on a local fake tensor to ``counter``."""

    cls = None

    @classmethod
    def make(cls):
        if cls.cls is None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            from .measure import OPS

            class CountingFakeTensorMode(FakeTensorMode):
                """FakeTensorMode is an infrastructure mode: it stays active inside a tensor subclass's dispatch, where
                DTensor issues the collectives of implicit redistributions and of its custom op handlers (loss
                parallel's all-reduces, context parallel's ring), which a Python dispatch mode above DTensor never
                sees. Counting here sees every collective the rank runs, wherever it is issued; a ``tracker`` set
                here sees every tensor it makes alike."""

                counter = None
                tracker = None  # a PeakTracker shown every tensor made here (``measure.track_step``'s ``below``)
                propagating = 0  # inside DTensor's sharding propagation (``_not_tracked_in_sharding_propagation``)

                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    if self.counter is not None and func in OPS:
                        self.counter.record(func, args, kwargs or {})
                    if func is WAIT_TENSOR:  # waits in place on a device; the fake kernel would make a new tensor
                        return args[0]
                    out = super().__torch_dispatch__(func, types, args, kwargs)
                    if self.tracker is not None and not self.propagating:
                        self.tracker.observe(func, out)
                    return out

            cls.cls = CountingFakeTensorMode
        return cls.cls


@contextlib.contextmanager
def _not_tracked_in_sharding_propagation(fake):
    """DTensor's sharding propagation runs each new op once on fake tensors of the *global* shapes, under the
    fake mode it detects (the trace's own) to learn the output's metadata: those tensors are never allocated on
    a device, so the fake mode shows them to no tracker while propagation runs."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, *args, **kwargs):
        fake.propagating += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            fake.propagating -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig


def trace_plan(spec: ModelSpec, plan: Plan, rank: int = 0) -> Measurement:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .measure import track_step
    from .model import GroupedExperts
    from .worker import clip_and_step, loss_context, make_optimizer

    validate_plan(plan, spec)
    t0 = time.perf_counter()
    traced = dataclasses.replace(plan, **NOT_TRACED)
    dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=FakeStore())
    prov = {"rank": rank, "world_size": plan.world_size, "torch": torch.__version__, "model": spec.name,
            "plan": plan.to_dict(), "notes": [f"{k} not applied in the trace" for k, v in NOT_TRACED.items()
                                              if getattr(plan, k) != v and k != "float8_recipe"]}
    try:
        meshes, parts, stage_ids = _meta_parts(spec, traced)
        fake = _CountingFake.make()(allow_non_fake_inputs=True)
        with fake:
            for m in parts:
                m.to_empty(device="cpu")
            params = [p for m in parts for p in m.parameters()]
            opt = make_optimizer(params, "adamw")
            expert_ids = {id(p) for m in parts for mod in m.modules() if isinstance(mod, GroupedExperts)
                          for p in mod.parameters()}
            pp_g = meshes.pp.get_group() if meshes.pp is not None else None
            ep_g = meshes.expert_norm_group()
            sends = {"bytes": 0}
            recv: dict = {}  # the pipeline stages' receive buffers (``_fake_pipeline_pass``), kept across steps
            phase = {"now": PHASE_FORWARD}
            _mark_backward_phases(parts, phase)

            def step():
                with loss_context(traced):
                    _fake_step(spec, traced, parts, stage_ids, sends, phase, meshes, recv)
                phase["now"] = PHASE_OPTIMIZER
                clip_and_step(params, opt, pp_g, ep_g, expert_ids)

            comm, counter = _counted_step(fake, meshes, step, sends)
            events: list = []
            with _not_tracked_in_sharding_propagation(fake):
                _, peak, breakdown, peak_op = track_step(step, parts, opt, phase, events, below=fake,
                                                         pipelined=plan.pp > 1, pipeline_buffers=recv.values())
        prov.update(memory_source=f"parsim PeakTracker under FakeTensorMode (tensor-level, rank {rank})",
                    peak_op=peak_op, peak_phase=phase.get("at_peak", ""), pp_stage=stage_ids[0] % plan.pp,
                    comm_counts=dict(counter.counts), wall_s=time.perf_counter() - t0, **_reserved(events))
        return Measurement(plan_id=plan.plan_id, kind="trace", status="ok", peak_memory_bytes=peak,
                           memory_breakdown_bytes=breakdown, comm_bytes=comm, provenance=prov,
                           reserved_peak_memory_bytes=prov["reserved_peak_bytes_expandable"])
    except Exception as e:  # noqa: BLE001 - a plan the code cannot trace is recorded, not raised
        import traceback

        prov.update(wall_s=time.perf_counter() - t0, traceback=traceback.format_exc()[-4000:])
        return Measurement(plan_id=plan.plan_id, kind="trace", status="error", error=f"{type(e).__name__}: {e}"[:2000],
                           provenance=prov)
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _meta_parts(spec: ModelSpec, traced: Plan) -> tuple:
    """(meshes, the rank's parallelized parts, their stage ids) of a model built on the meta device, its routers'
    static routing on (every expert gets its share of the tokens, as the cost model assumes)."""
    from .model import Transformer
    from .parallelize import Meshes, apply_plan

    with torch.device("meta"):
        model = Transformer(spec, traced.seq_len)
    for mod in model.modules():
        if hasattr(mod, "static_routing"):
            mod.static_routing = True
    meshes = Meshes(traced, "cpu")
    parts, stage_ids = apply_plan(model, traced, meshes)
    return meshes, parts, stage_ids


def _counted_step(fake, meshes, step, sends: dict) -> tuple:
    """One step under the fake mode's collective counter: (bytes per "<op>/<axis>", with the pipeline's sends
    under "send/pp", the counter)."""
    from .measure import CommRecorder

    counter = CommRecorder(meshes.axis_of_group())
    fake.counter = counter
    try:
        step()
    finally:
        fake.counter = None
    comm = dict(counter.bytes)
    if sends["bytes"]:
        comm["send/pp"] = comm.get("send/pp", 0) + sends["bytes"]
    sends["bytes"] = 0
    return comm, counter


def _reserved(events: list) -> dict:
    """The step's allocations and frees replayed through the model of CUDA's caching allocator
    (``parsim.allocator``), with and without expandable segments: what a GPU would have reserved for them."""
    import os

    from ..allocator import replay

    if os.environ.get("PARSIM_ALLOC_EVENTS"):  # debugging: the raw stream, for replaying by hand
        import pickle

        with open(os.environ["PARSIM_ALLOC_EVENTS"], "wb") as f:
            pickle.dump(events, f)
    out = {}
    for name, expandable in (("expandable", True), ("classic", False)):
        r = replay(events, expandable_segments=expandable)
        out[f"reserved_peak_bytes_{name}"] = r.reserved_peak_bytes
        out[f"reserved_by_stream_bytes_{name}"] = r.reserved_by_stream_bytes
    out["allocator_allocated_peak_bytes"] = r.allocated_peak_bytes
    out["allocator_events"] = len(events)
    return out


def _forget_meshes() -> None:
    """DTensor caches sharding decisions and redistribution plans keyed by specs whose meshes compare equal across
    process-group lifetimes: a later trace in the same interpreter would reuse a mesh of an earlier fake world and
    its destroyed groups ("Could not resolve the process group registered under the name 27"). Clear them."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    cached = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


# the moments of a step a traced peak is attributed to (the cost model's memory phases, same words)
PHASE_FORWARD = MemoryPhase.END_OF_FORWARD  # forward passes, and the loss and output layer's backward
PHASE_FIRST_BACKWARD = MemoryPhase.FIRST_BACKWARD  # the blocks' backward of a pass's first microbatch on the rank
PHASE_LATER_BACKWARD = MemoryPhase.LATER_BACKWARD  # PP: the blocks' backward of the pass's other microbatches
PHASE_EMBEDDING_BACKWARD = MemoryPhase.END_OF_BACKWARD  # the embedding's backward (first stage)
PHASE_OPTIMIZER = MemoryPhase.OPTIMIZER_STEP  # clipping and the optimizer


def _mark_backward_phases(parts, phase: dict) -> None:
    """Where the backward stands, from gradient hooks: the gradient reaching the final norm's output ends the loss
    and output layer's backward (``phase["bwd"]``, set by the step, takes over); the gradient reaching the
    embedding's output starts the embedding's backward."""

    def on_norm(_mod, _inp, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: phase.__setitem__("now", phase.get("bwd", PHASE_FIRST_BACKWARD)))

    def on_embedding(_mod, _inp, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: phase.__setitem__("now", PHASE_EMBEDDING_BACKWARD))

    for m in parts:
        if getattr(m, "norm", None) is not None:
            m.norm.register_forward_hook(on_norm)
        if getattr(m, "tok_embeddings", None) is not None:
            m.tok_embeddings.register_forward_hook(on_embedding)


def _loss(logits, y, n_global, fused=False):
    return loss_sum(logits, y, fused) / n_global


def _fake_step(spec, plan: Plan, parts, stage_ids, sends, phase: dict, meshes, recv: dict):
    """Forward + backward of one step for the traced rank (see the module docstring for PP), keeping
    ``phase["now"]`` current. Under CP each pass runs in torchtitan's context-parallel context (``cp.cp_context``:
    tokens, labels and RoPE tables sharded on the sequence, SDPA through torch's ring attention)."""
    from .cp import cp_context

    seq = plan.seq_len
    n_global = plan.global_batch_size * seq
    from .parallelize import set_grad_sync

    for k in range(plan.grad_accum_steps):
        if plan.pp == 1:
            set_grad_sync(parts, plan, k)
            x = torch.randint(0, spec.vocab_size, (plan.local_batch_size, seq))
            # (labels apart from the inputs, as torchtitan's dataloader and the worker hold them)
            y = torch.randint(0, spec.vocab_size, (plan.local_batch_size, seq))
            phase["now"], phase["bwd"] = PHASE_FORWARD, PHASE_FIRST_BACKWARD
            with cp_context(plan, meshes, parts, x, y):
                _loss(parts[0](x), y, n_global, plan.fused_loss).backward()
            continue
        with cp_context(plan, meshes, parts, None, None):  # the pipeline's tokens and labels are made local-size
            _fake_pipeline_pass(spec, plan, parts, stage_ids, sends, phase, recv)


def _fake_pipeline_pass(spec, plan: Plan, parts, stage_ids, sends, phase: dict, recv: dict):
    """One pass of the pipeline schedule's actions on the traced rank (one gradient-accumulation step).

    As torch's stages, each keeps one receive buffer per microbatch for its input (a stage after the first) and one
    for its output's gradient (a stage before the last), made by the first pass and reused by every later one
    (``recv``, kept by the caller across steps: ``measure.recv_buffers`` reads the real stages' own): the received
    tensor a stage computes with is the buffer itself. The input's gradient is taken off the buffer after the
    microbatch's backward (``stage_backward``: ``val.grad = None``) and sent; what holds it after that is the
    schedule's: 1F1B's ``bwd_sends`` (its send ops, replaced after the next backward), GPipe's un-waited works
    (to the last backward; its ``ops`` then holds the last one through the reduce) and the runtime schedule's
    (interleaved: every send's work, its stage outputs' too, until the pass ends) [torch 2.13
    pipelining/schedules.py; bench/real_vs_trace.py: tiny pp2 x v2, the real run's rank 0 held 16 (T, d) stage
    outputs and input gradients more than the trace at its peak, +4.2%, before; pp2 1F1B's last stage +0.35% ->
    +0.06%]."""
    mbs, seq = plan.micro_batch_size, plan.seq_len
    n_global = plan.global_batch_size * seq
    n_stages = plan.pp * plan.pp_stages_per_rank
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.stage import _PipelineStageBase

    seq_local = seq // plan.cp // (plan.tp if plan.sequence_parallel else 1)
    hidden_shape = (mbs, seq_local, spec.d_model)
    # a stage receives what the previous one sends: its output in param_dtype under FSDP mixed precision,
    # the fp32 residual stream under autocast (no data parallelism); its gradient goes back in that dtype
    autocast = not plan.fsdp_applied
    hidden_dtype = torch.float32 if autocast else getattr(torch, plan.param_dtype)
    # this rank's actions in the order torch's schedule runs them (``torch_schedule_order``), with torch's FSDP
    # protocol: every backward without gradient sync or reshard, the gradients reduced by the stage's
    # REDUCE_GRAD (torch's own ``perform_reduce_grad``); runtime schedules (interleaved) also unshard and
    # reshard whole stages (UNSHARD / RESHARD)
    m = plan.n_microbatches
    rank = stage_ids[0] % plan.pp
    chunk_of = {sid: c for c, sid in enumerate(stage_ids)}
    inflight: dict = {}
    backwards = [0]
    for c, sid in enumerate(stage_ids):
        for mb in range(m):
            if sid != 0 and (c, mb, "in") not in recv:
                recv[c, mb, "in"] = torch.empty(hidden_shape, dtype=hidden_dtype)
            if sid != n_stages - 1 and (c, mb, "grad") not in recv:
                recv[c, mb, "grad"] = torch.ones(hidden_shape, dtype=hidden_dtype)
    sent = None  # the gradient of a microbatch's input, on its way to the previous stage
    # a send's work holds the tensor it sends until it is waited for: torch's runtime schedule (interleaved) waits
    # for every send after its last action (``send_ops``), GPipe for its backward sends after the last backward
    # (``bwd_sends_to_wait``); 1F1B waits at once
    works: list = []
    keep_outputs = plan.pp_schedule == "Interleaved1F1B"
    keep_grads = plan.pp_schedule in ("Interleaved1F1B", "GPipe")
    for kind, sid, mb in torch_schedule_order(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank, m, rank,
                                              with_fsdp=True):
        c = chunk_of[sid]
        if kind in ("F", "B") and plan.pp_schedule != "1F1B":  # (1F1B: ``bwd_sends`` holds it until the next one)
            sent = None
        if kind == "F":
            phase["now"] = PHASE_FORWARD
            if sid == 0:
                inp = torch.randint(0, spec.vocab_size, (mbs, seq // plan.cp))
            else:
                inp = recv[c, mb, "in"].requires_grad_(True)
            out = parts[c](inp)
            stage_out = out  # (torch's stage keeps its output in fwd_cache until the microbatch's backward returns:
            # on the last stage the logits, beside the loss computed from them)
            if sid == n_stages - 1:
                out = _loss(out, torch.randint(0, spec.vocab_size, (mbs, seq // plan.cp)), n_global,
                        plan.fused_loss)
            else:
                sends["bytes"] += out.numel() * out.element_size()
                if keep_outputs:
                    works.append(out)
            inflight[c, mb] = (out, inp, stage_out)
            del stage_out
        elif kind == "B":
            out, inp, stage_out = inflight.pop((c, mb))
            phase["bwd"] = PHASE_FIRST_BACKWARD if backwards[0] == 0 else PHASE_LATER_BACKWARD
            backwards[0] += 1
            # the last stage starts with the loss and output layer (the norm hook moves on to phase["bwd"])
            phase["now"] = PHASE_FORWARD if sid == n_stages - 1 else phase["bwd"]
            if isinstance(parts[c], FSDPModule):  # as _PipelineStageBase.backward_maybe_with_nosync
                parts[c].set_is_last_backward(False)
                parts[c].set_reshard_after_backward(False)
                parts[c].set_requires_gradient_sync(False)
            if sid == n_stages - 1:
                out.backward()
            else:
                out.backward(recv[c, mb, "grad"])
            del stage_out  # (backward_one_chunk returns)
            if sid != 0:
                sends["bytes"] += inp.numel() * inp.element_size()  # gradient sent to the previous stage
                sent, inp.grad = inp.grad, None
                if keep_grads:
                    works.append(sent)
        elif kind == "REDUCE_GRAD":
            if plan.pp_schedule == "GPipe":
                works.clear()  # (waited for before the reduce)
            phase["now"] = PHASE_EMBEDDING_BACKWARD
            _PipelineStageBase.perform_reduce_grad(types.SimpleNamespace(submod=parts[c]), 1)
        else:  # UNSHARD / RESHARD of every FSDP module of the stage
            for mod in parts[c].modules():
                if isinstance(mod, FSDPModule):
                    mod.unshard() if kind == "UNSHARD" else mod.reshard()


def max_inflight(actions: list[tuple[str, int, int]]) -> int:
    """The most forwards whose backward has not run yet, along a rank's action sequence."""
    live = peak = 0
    for kind, _sid, _mb in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def torch_schedule_order(schedule: str, pp: int, v: int, n_micro: int, rank: int, with_fsdp: bool = False
                         ) -> list[tuple[str, int, int]]:
    """(F or B, stage index, microbatch) in the order torch.distributed.pipelining's schedule runs them on ``rank``,
    read from the schedule class itself (its pipeline-order IR) without building stages or process groups. With
    ``with_fsdp`` also its FSDP actions: (REDUCE_GRAD, stage, -1) after a stage's last backward (single-stage
    schedules run it at the end of the step), and for runtime schedules (interleaved) the (UNSHARD | RESHARD,
    stage, -1) actions torch's lowering adds (``_add_unshard_reshard``)."""
    from torch.distributed.pipelining import schedules as S

    cls = {"GPipe": S.ScheduleGPipe, "1F1B": S.Schedule1F1B, "Interleaved1F1B": S.ScheduleInterleaved1F1B}[schedule]
    sched = object.__new__(cls)
    sched._n_microbatches = n_micro
    if schedule == "Interleaved1F1B":
        sched.pp_group_size, sched.n_local_stages = pp, v
        sched.number_of_rounds = max(1, n_micro // pp)
        sched.microbatches_per_round = n_micro // sched.number_of_rounds
        actions = sched._calculate_single_rank_operations(rank)
        if with_fsdp:
            actions = S._add_reduce_grad(S._add_unshard_reshard(actions), n_micro)
    elif schedule == "1F1B":  # as Schedule1F1B._step_microbatches runs (its pipeline-order IR shifts the
        # microbatches of late stages): min(m, pp - rank) warm-up forwards, then a backward and a forward while
        # forwards remain, then the backwards
        w = min(n_micro, pp - rank)
        seq = [("F", i) for i in range(w)]
        for i in range(n_micro):
            seq.append(("B", i))
            if w + i < n_micro:
                seq.append(("F", w + i))
        comp = {"F": S._ComputationType.FORWARD, "B": S._ComputationType.FULL_BACKWARD}
        actions = [S._Action(rank, comp[k], i) for k, i in seq]
    else:
        sched._num_stages = pp
        actions = [a for a in sched._get_pipeline_order()[rank] if a is not None]
    if with_fsdp and schedule != "Interleaved1F1B":  # (PipelineScheduleSingle: perform_reduce_grad at the end)
        actions = [a for a in actions if a.computation_type != S.REDUCE_GRAD] + [S._Action(rank, S.REDUCE_GRAD, None)]
    kinds = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B"}
    if with_fsdp:
        kinds.update({S.UNSHARD: "UNSHARD", S.RESHARD: "RESHARD", S.REDUCE_GRAD: "REDUCE_GRAD"})
    return [(kinds[a.computation_type], a.stage_index, -1 if a.microbatch_index is None else a.microbatch_index)
            for a in actions if a is not None and a.computation_type in kinds]


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


def serve() -> None:
    """Trace jobs read as JSON lines from stdin ({"spec", "plan", "rank"}), one Measurement JSON line each on
    stdout, in one interpreter (torch, its fake process group and DTensor's sharding caches are set up once:
    about 1 s a small plan instead of 3-4 s in a fresh process). Anything torch prints goes to stderr."""
    import json
    import os
    import sys

    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            m = trace_plan(ModelSpec.from_dict(job["spec"]), Plan.from_dict(job["plan"]), rank=job.get("rank", 0))
            doc = m.to_dict()
        except Exception as e:  # noqa: BLE001 - a job that cannot even start is an error line, the server goes on
            doc = {"plan_id": "", "kind": "trace", "status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps(doc) + "\n")
        out.flush()


if __name__ == "__main__":
    import sys

    from ..jsonio import atomic_write_json, read_json

    if sys.argv[1:] == ["--serve"]:
        serve()
        sys.exit(0)
    job = read_json(sys.argv[1], "bad trace input")
    result = trace_plan(ModelSpec.from_dict(job["spec"]), Plan.from_dict(job["plan"]), rank=job["rank"])
    atomic_write_json(sys.argv[2], result.to_dict())
