"""Read torch.profiler traces (Chrome/Kineto JSON, ``.json`` or ``.json.gz``, one file per rank) and attribute each
profiled step to parsim's components: ``compute_forward``, ``compute_backward``, ``recompute``, ``optimizer``,
``comm_<axis>`` (exposed collective time) and ``idle`` (host overhead, waits with nothing in flight, pipeline
bubble), split further by kind (``gemm``, ``attention``, ``memory``: every other compute op or kernel).

The attribution is a partition of the step's time on one lane, so the components sum to the traced step exactly:

- on a GPU trace the lane is the device: every instant of the step's window is the highest-priority thing the GPU
  runs then, over all streams (a compute kernel, else a collective kernel: exposed, else nothing: idle). A collective
  kernel that runs while a compute kernel runs is hidden; its hidden seconds are reported beside, not added. The
  window is the step's ``ProfilerStep#N`` on the GPU timeline where the trace has one (``gpu_user_annotation``),
  else from the end of the previous step's last kernel (or this step's first kernel) to this step's last kernel, a
  kernel belonging to the step whose CPU span launched it (its ``correlation`` id).
- on a CPU trace (gloo) the lane is the thread that ran ``ProfilerStep#N``: each instant is the innermost op it is
  in (its self time). Collectives run on gloo's own threads (``gloo:<op>``); main-thread time outside any compute
  op while a collective is in flight is that collective's exposed time, and without one it is idle.

What a compute op is part of comes from its ancestors in the op tree (for a kernel, the ops around the CPU call
that launched it): inside ``autograd::engine::evaluate_function`` it is backward, unless a forward op is between
(``FORWARD_OPS``: activation checkpointing recomputes the forward inside the backward node that unpacks what it
saved); everything after the step's last backward op is the optimizer (gradient clipping, ``Optimizer.step``,
``zero_grad``); the rest is forward.

A collective's axis: the mesh dimension named by its process group (NCCL metadata ``Process Group Description``
``mesh_<dim>``, or its ranks matched to the plan's groups when a plan is given); on gloo, where an op carries no
group, the FSDP region it runs under (``FSDP::``: the plan's FSDP axis) or, with a plan, the one axis that runs
that kind of collective. Bytes: the NCCL metadata's input elements x element size, on gloo the op's first input.

Why not HolisticTraceAnalysis (the ``holistictraceanalysis`` package): it parses these traces and gives kernel-type
breakdowns (computation / communication / memory) and the communication-computation overlap, but not which phase
(forward, backward, recompute, optimizer) a kernel belongs to, nor the axis of a collective, nor CPU (gloo) traces
whose work is ops rather than kernels; and its runtime requirements include JupyterLab. The reader here is checked
against its kernel breakdown on the same public traces (``bench/probes/hta_crosscheck.py``).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
from collections import Counter, defaultdict

import numpy as np

from .errors import ParsimError

PLAN_FILE = "parsim-plan.json"  # in a `run --profile-trace` folder: the model, plan and measurement traced
PHASES = ("compute_forward", "compute_backward", "recompute", "optimizer")
KINDS = ("gemm", "attention", "memory", "framework")
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                      "aten::_scaled_mm", "aten::_scaled_grouped_mm", "aten::addmv", "aten::mv",
                      # convolutions: the same tensor-core class of kernel (a vision model's "GEMMs")
                      "aten::cudnn_convolution", "aten::convolution_backward", "aten::mkldnn_convolution",
                      "aten::miopen_convolution"})
ATTENTION_MARK = re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|cudnn_attention", re.I)
GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|cublas|sm\d\d_.*(?:tn|nt|nn|tt)|matmul|wgmma", re.I)
COMM_KERNEL = re.compile(r"nccl|rccl", re.I)
# ops whose presence inside a backward node means the forward is running again (activation checkpointing):
# backward formulas call mm / *_backward ops directly, never these
FORWARD_OPS = frozenset({"aten::linear", "aten::matmul", "aten::scaled_dot_product_attention", "aten::embedding",
                         "aten::layer_norm", "aten::rms_norm", "aten::silu", "aten::gelu", "aten::softmax",
                         "aten::_softmax", "aten::dropout", "aten::native_layer_norm", "aten::_fused_rms_norm"})
BACKWARD_MARK = "autograd::engine::evaluate_function"
# ops that only hand work to a collective (their self time on the main thread is host time, not compute)
HOST_OPS = re.compile(r"^(c10d::|_c10d_functional::|c10d_functional::|record_param_comms|FSDP::|fsdp::pre|"
                      r"ProfilerStep|Optimizer\.|autograd::engine::evaluate_function|Torch-Compiled Region)")
COMM_OPS = {"allgather": "all_gather", "all_gather": "all_gather", "_allgather_base": "all_gather",
            "all_gather_into_tensor": "all_gather", "reduce_scatter": "reduce_scatter",
            "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
            "allreduce": "all_reduce", "all_reduce": "all_reduce", "alltoall": "all_to_all",
            "all_to_all": "all_to_all", "alltoall_base": "all_to_all", "all_to_allv": "all_to_all",
            "sendrecv": "send_recv", "send": "send_recv", "recv": "send_recv", "broadcast": "broadcast",
            "barrier": "barrier", "reduce": "reduce", "gather": "gather", "scatter": "scatter"}
GLOO_RUNS_AS = {"all_reduce": ("all_reduce", "reduce_scatter")}
DTYPE_BYTES = {"float": 4, "float32": 4, "c10::bfloat16": 2, "bfloat16": 2, "c10::half": 2, "half": 2,
               "float16": 2, "double": 8, "float64": 8, "int": 4, "int32": 4, "long": 8, "int64": 8,
               "int8": 1, "uint8": 1, "byte": 1, "char": 1, "bool": 1, "c10::float8_e4m3fn": 1,
               "float8_e4m3fn": 1, "c10::float8_e5m2": 1, "float8_e5m2": 1}


@dataclasses.dataclass(frozen=True)
class TracedCollective:
    """One collective of a traced step: its op, axis (``None`` where the trace does not say and no plan decides),
    group size (0: unknown), input bytes (``None``: unknown), element type, start within the step, duration, and the
    part of it no compute overlapped (exposed)."""

    op: str
    axis: str | None
    group_size: int
    input_bytes: float | None
    dtype: str
    start_s: float
    duration_s: float
    exposed_s: float

    def __post_init__(self):
        if self.duration_s < 0 or self.exposed_s < -1e-12 or self.exposed_s > self.duration_s + 1e-9:
            raise ValueError(f"collective {self.op}: exposed {self.exposed_s} outside [0, {self.duration_s}]")


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """One profiled step on one rank: ``components_s`` partition ``step_s`` (compute phases, ``comm_<axis>``
    exposed, ``idle``); ``kinds_s`` split the compute phases by kind (``"<phase>.<kind>"``); ``hidden_comm_s``
    the collective seconds overlapped by compute, per axis."""

    rank: int
    name: str
    step_s: float
    components_s: dict
    kinds_s: dict
    hidden_comm_s: dict
    collectives: tuple

    def __post_init__(self):
        total = sum(self.components_s.values())
        if self.step_s <= 0 or abs(total - self.step_s) > 1e-9 + 1e-6 * self.step_s:
            raise ValueError(f"step {self.name}: components sum to {total} s, the step is {self.step_s} s")


@dataclasses.dataclass(frozen=True)
class RankTrace:
    """What one trace file holds: its rank, the job's world size, the device kind of its work (``cuda`` where it
    has kernels, else ``cpu``), the profiled steps and the largest kernels (or ops) by total time."""

    path: str
    rank: int
    world_size: int
    device: str
    steps: tuple
    top_kernels: tuple  # (name, seconds over the profiled steps, calls)

    def __post_init__(self):
        if not self.steps:
            raise ValueError(f"{self.path}: no steps")


# ---------------------------------------------------------------------------------------------------------- files
def trace_files(paths: list[str]) -> list[str]:
    """The trace files named: files as given, folders expanded to their ``*.json`` / ``*.json.gz`` (sorted)."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith((".json", ".json.gz"))
                           and f != PLAN_FILE)
            if not found:
                raise ParsimError(f"{p}: no .json or .json.gz trace in this folder")
            out += found
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise ParsimError(f"{p}: no such file or folder")
    return out


def plan_file_of(paths: list[str]) -> str | None:
    """The ``PLAN_FILE`` of the one folder among ``paths`` that has one, else None."""
    found = [os.path.join(p, PLAN_FILE) for p in paths if os.path.isfile(os.path.join(p, PLAN_FILE))]
    if len(found) > 1:
        raise ParsimError(f"{len(found)} folders record a plan ({', '.join(found)}): read one plan's traces at a "
                          "time")
    return found[0] if found else None


def recorded_plan(paths: list[str]) -> dict | None:
    """What ``plan_file_of(paths)`` holds ({model, plan, measurement, ...}), else None."""
    path = plan_file_of(paths)
    if path is None:
        return None
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ParsimError(f"{path}: not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("plan"), dict) or not isinstance(doc.get("model"), str):
        raise ParsimError(f"{path}: needs model and plan")
    return doc


def load_json(path: str) -> dict:
    """The trace document (gzip or plain JSON); one ParsimError line if it is neither or holds no events."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        opener = gzip.open if head == b"\x1f\x8b" else open
        with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, EOFError) as e:
        raise ParsimError(f"{path}: not a Chrome/Kineto trace (JSON or gzipped JSON): {e}") from None
    if isinstance(doc, list):  # the bare event-array form of the Chrome trace format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list) or not doc["traceEvents"]:
        raise ParsimError(f"{path}: no traceEvents: not a torch.profiler trace")
    return doc


def read_traces(paths: list[str], plan=None) -> list[RankTrace]:
    """Every rank's trace among ``paths`` (files or folders), attributed; ``plan`` names the axes of collectives
    the trace leaves unnamed."""
    return [read_trace(f, plan) for f in trace_files(paths)]


def read_trace(path: str, plan=None) -> RankTrace:
    doc = load_json(path)
    ev = [e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
          and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]
    info = doc.get("distributedInfo") or {}
    rank = int(info.get("rank", 0) or 0)
    world = int(info.get("world_size", 1) or 1)
    pg_desc = {str(g.get("pg_name")): str(g.get("pg_desc", "")) for g in info.get("pg_config") or []
               if isinstance(g, dict)}
    steps = [e for e in ev if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") in ("user_annotation", "cpu_op", None)]
    if not steps:
        raise ParsimError(f"{path}: no profiled steps (no ProfilerStep#N span: profile with a schedule and call "
                          "prof.step() each step, or parsim run --profile-trace)")
    kernels = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ctx = _Context(rank, plan, pg_desc)
    if kernels:
        out, top = _gpu_steps(path, ev, steps, kernels, ctx)
    else:
        out, top = _cpu_steps(path, ev, steps, ctx)
    return RankTrace(path=path, rank=rank, world_size=world, device="cuda" if kernels else "cpu", steps=tuple(out),
                     top_kernels=tuple(top))


# --------------------------------------------------------------------------------------------------------- op tree
class _Context:
    """What names a collective's axis: the rank, the plan (or None) and the trace's process-group descriptions."""

    def __init__(self, rank: int, plan, pg_desc: dict):
        self.rank, self.plan, self.pg_desc = rank, plan, pg_desc
        self.sets = None
        if plan is not None:
            from .codec import rank_sets_named

            self.sets = rank_sets_named(plan, rank)

    def axis(self, op: str, ranks: list[int] | None, desc: str, under_fsdp: bool) -> str | None:
        if desc.startswith("mesh_"):
            return desc[len("mesh_"):]
        if ranks and self.sets is not None:
            hit = self.sets.get(frozenset(ranks))
            if hit:
                return hit
        if self.plan is not None:
            return _plan_axis(self.plan, op, under_fsdp)
        return "fsdp" if under_fsdp else (desc or None)  # e.g. default_pg: the group, where no plan names it


def _plan_axis(plan, op: str, under_fsdp: bool) -> str | None:
    """The axis that runs ``op`` in ``plan`` where the trace names none (gloo): FSDP's collectives on its shard
    axis (all-reduce on dp_replicate under HSDP), sends on pp, all-to-all on ep, the rest on tp, else cp."""
    if under_fsdp:
        if op == "all_reduce" and plan.dp_replicate > 1:
            return "dp_replicate"
        return "dp_shard" if plan.cp == 1 else "dp_shard+cp"
    if op == "send_recv":
        return "pp" if plan.pp > 1 else ("cp" if plan.cp > 1 else None)
    if op == "all_to_all":
        return "ep" if plan.ep > 1 else ("cp" if plan.cp > 1 else None)
    for a in ("tp", "cp", "dp_replicate", "dp_shard"):
        if getattr(plan, a) > 1:
            return a
    return None


def _walk(ops: list[dict]):
    """Each op of one thread (sorted by start) with its ancestors' names, and its self segments (its span less its
    children's): yields (op, ancestors, [(start, end), ...])."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    stack: list[list] = []  # [op, end, self segments, cursor]

    def close(entry):
        op, end, segs, cur = entry
        if end > cur:
            segs.append((cur, end))
        return op, [s[0]["name"] for s in stack], segs

    out = []
    for e in ops:
        s, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        while stack and stack[-1][1] <= s:
            entry = stack.pop()
            out.append(close(entry))
        if stack:
            parent = stack[-1]
            if s > parent[3]:
                parent[2].append((parent[3], s))
            parent[3] = max(parent[3], min(end, parent[1]))
            end = min(end, parent[1])
        stack.append([e, end, [], s])
    while stack:
        entry = stack.pop()
        out.append(close(entry))
    return out


def _phase(ancestors: list[str], name: str, ts: float, last_bwd: float) -> str:
    chain = ancestors + [name]
    if any(a.startswith(BACKWARD_MARK) for a in chain):
        i = max(i for i, a in enumerate(chain) if a.startswith(BACKWARD_MARK))
        return "recompute" if any(a in FORWARD_OPS for a in chain[i + 1:]) else "compute_backward"
    if ts > last_bwd or any(a.startswith("Optimizer.") for a in chain):
        return "optimizer"
    return "compute_forward"


def _kind(names: list[str]) -> str:
    """gemm, attention, framework (what FSDP runs around the model: its copy-in / copy-out, chunk-cat, casts) or
    memory (every other op)."""
    if any(n in GEMM_OPS for n in names):
        return "gemm"
    if any(ATTENTION_MARK.search(n) for n in names):
        return "attention"
    if any(n.startswith(("FSDP::", "fsdp::")) for n in names):
        return "framework"
    return "memory"


def _comm_op(name: str) -> str | None:
    """The collective an op or kernel name stands for (``gloo:all_gather``, ``c10d::_allgather_base_``,
    ``ncclDevKernel_AllGather_RING_LL``, ``nccl:all_reduce``), or None."""
    low = name.lower()
    if low.startswith("gloo:") or low.startswith("nccl:"):
        key = low.split(":", 1)[1]
    elif COMM_KERNEL.search(name):
        m = re.search(r"kernel_([a-z]+)", low)
        key = m.group(1) if m else "unknown"
    else:
        return None
    key = key.replace("_coalesced", "").strip("_")
    return COMM_OPS.get(key, COMM_OPS.get(key.replace("_", ""), key))


def _largest(totals: dict[str, float], n: int) -> list[tuple[str, float]]:
    return sorted(totals.items(), key=lambda kv: -kv[1])[:n]


def _elements(dims) -> int:
    if isinstance(dims, list) and dims and all(isinstance(d, (int, float)) for d in dims):
        return int(np.prod(dims))
    if isinstance(dims, list):  # a tensor list: the sum of its tensors
        return sum(_elements(d) for d in dims)
    return 0


# ------------------------------------------------------------------------------------------------------ partition
def _partition(t0: float, t1: float, compute: list[tuple], comm: list[tuple]):
    """Split [t0, t1] (us) into segments: each is the first compute label active there (``compute``: (start, end,
    label), lower index wins where they overlap), else a collective active there (exposed, its index in ``comm``),
    else idle. Returns (seconds per compute label, exposed us per collective index, hidden us per collective, idle
    us)."""
    pts = {t0, t1}
    for s, e, *_ in compute + comm:
        if e > t0 and s < t1:
            pts.add(min(max(s, t0), t1))
            pts.add(min(max(e, t0), t1))
    grid = np.array(sorted(pts))
    if len(grid) < 2:
        return {}, {}, {}, t1 - t0
    seg = np.diff(grid)
    n = len(seg)
    owner = np.full(n, -1)  # index into compute, first one wins
    for i, (s, e, _lab) in enumerate(compute):
        a, b = np.searchsorted(grid, [max(s, t0), min(e, t1)])
        if b > a:
            sl = owner[a:b]
            sl[sl < 0] = i
    busy = owner >= 0
    comm_owner = np.full(n, -1)
    hidden: dict[int, float] = defaultdict(float)
    for j, (s, e, _idx) in enumerate(comm):
        a, b = np.searchsorted(grid, [max(s, t0), min(e, t1)])
        if b > a:
            hidden[j] += float(seg[a:b][busy[a:b]].sum())
            sl = comm_owner[a:b]
            sl[(sl < 0) & ~busy[a:b]] = j
    by_label: dict[tuple, float] = defaultdict(float)
    per_compute = np.bincount(owner[busy], weights=seg[busy], minlength=len(compute))
    for k in np.flatnonzero(np.bincount(owner[busy], minlength=len(compute))):
        by_label[compute[int(k)][2]] += float(per_compute[k])
    exposed: dict[int, float] = defaultdict(float)
    alone = comm_owner >= 0
    per_comm = np.bincount(comm_owner[alone], weights=seg[alone], minlength=len(comm))
    for k in np.flatnonzero(np.bincount(comm_owner[alone], minlength=len(comm))):
        exposed[int(k)] += float(per_comm[k])
    idle = float(seg[~busy & (comm_owner < 0)].sum())
    return by_label, exposed, hidden, idle


def _step_record(rank, name, t0, t1, by_label, comms, exposed, hidden) -> TracedStep:
    """Assemble one step from the partition (us in, s out)."""
    comp: dict = defaultdict(float)
    kinds: dict = defaultdict(float)
    for (phase, kind), us in by_label.items():
        comp[phase] += us * 1e-6
        kinds[f"{phase}.{kind}"] += us * 1e-6
    hid: dict = defaultdict(float)
    colls = []
    for j, c in enumerate(comms):
        key = "comm_" + (c["axis"] or "unknown")
        comp[key] += exposed.get(j, 0.0) * 1e-6
        hid[key] += hidden.get(j, 0.0) * 1e-6
        dur = (min(c["end"], t1) - max(c["start"], t0)) * 1e-6
        colls.append(TracedCollective(op=c["op"], axis=c["axis"], group_size=c["group_size"],
                                      input_bytes=c["bytes"], dtype=c["dtype"], start_s=(c["start"] - t0) * 1e-6,
                                      duration_s=max(dur, 0.0),
                                      exposed_s=min(exposed.get(j, 0.0) * 1e-6, max(dur, 0.0))))
    # idle is what the rest leaves of the window (the partition's idle up to float rounding)
    comp["idle"] = max((t1 - t0) * 1e-6 - sum(comp.values()), 0.0)
    return TracedStep(rank=rank, name=name, step_s=sum(comp.values()), components_s=dict(comp), kinds_s=dict(kinds),
                      hidden_comm_s={k: v for k, v in hid.items() if v > 0}, collectives=tuple(colls))


# ---------------------------------------------------------------------------------------------------------- CPU
def _cpu_steps(path: str, ev: list[dict], steps: list[dict], ctx: _Context):
    main_tid = steps[0].get("tid")
    main = [e for e in ev if e.get("tid") == main_tid and e.get("pid") == steps[0].get("pid")]
    walked = _walk(main)
    if not any(op.get("cat") == "cpu_op" for op, _a, _s in walked):
        raise ParsimError(f"{path}: no ops on the thread of the profiled steps: record with activities=[CPU]")
    bwd = [float(op["ts"]) + float(op["dur"]) for op, anc, _ in walked if op["name"].startswith(BACKWARD_MARK)]
    comm_raw = [e for e in ev if e.get("tid") != main_tid and _comm_op(str(e.get("name", ""))) is not None
                and str(e.get("name", "")).lower().startswith(("gloo:", "nccl:"))]
    launches = _fsdp_launches(walked)
    out: list[TracedStep] = []
    totals: dict[str, float] = defaultdict(float)
    calls: Counter = Counter()
    steps = sorted(steps, key=lambda e: e["ts"])
    mine = _by_step(steps, [w for w in walked if w[0].get("cat") == "cpu_op" and not HOST_OPS.match(w[0]["name"])])
    for st, ops in zip(steps, mine, strict=True):
        t0, t1 = float(st["ts"]), float(st["ts"]) + float(st["dur"])
        last_bwd = max([b for b in bwd if t0 <= b <= t1], default=t0)
        compute = []
        for op, anc, segs in ops:
            if any(HOST_OPS.match(a) and a.startswith(("c10d::", "_c10d")) for a in anc):
                continue
            label = (_phase(anc, op["name"], float(op["ts"]), last_bwd), _kind(anc + [op["name"]]))
            for s, e in segs:
                compute.append((s, e, label))
            if segs and not any(a in GEMM_OPS for a in anc):
                totals[op["name"]] += sum(e - s for s, e in segs) * 1e-6
                calls[op["name"]] += 1
        comms = [_gloo_collective(e, launches, ctx) for e in comm_raw if t0 <= e["ts"] < t1]
        comms = [c for c in comms if c["op"] != "barrier"]
        by_label, exposed, hidden, _idle = _partition(t0, t1, compute, [(c["start"], c["end"], j)
                                                                       for j, c in enumerate(comms)])
        out.append(_step_record(ctx.rank, st["name"], t0, t1, by_label, comms, exposed, hidden))
    top = [(n, s, calls[n]) for n, s in _largest(totals, 12)]
    return out, top


def _by_step(steps: list[dict], walked: list) -> list[list]:
    """The walked ops of each step (``steps`` sorted by start): those that start inside its span."""
    import bisect

    starts = [float(st["ts"]) for st in steps]
    out: list[list] = [[] for _ in steps]
    for w in walked:
        ts = float(w[0]["ts"])
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts < starts[i] + float(steps[i]["dur"]):
            out[i].append(w)
    return out


def _fsdp_launches(walked) -> list[tuple[float, str, bool]]:
    """(start, op, under FSDP) of every collective the main thread hands to gloo, in order."""
    out = []
    for op, anc, _ in walked:
        name = op["name"]
        if name.startswith(("c10d::", "_c10d_functional::")) and not any(a.startswith("c10d::") for a in anc):
            key = name.split("::", 1)[1].rstrip("_")
            kind = COMM_OPS.get(key) or COMM_OPS.get(key.replace("_", ""))
            if kind:
                out.append((float(op["ts"]), kind, any(a.startswith(("FSDP::", "fsdp::")) for a in anc)))
    return sorted(out)


def _gloo_collective(e: dict, launches, ctx: _Context) -> dict:
    op = _comm_op(e["name"]) or "unknown"
    args = e.get("args") or {}
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    n = _elements(dims[0]) if dims else 0
    dt = str(types[0]) if types else ""
    size = DTYPE_BYTES.get(dt.lower())
    # the launch just before it of a kind gloo runs this way says what it is and whether FSDP issued it (gloo runs
    # a reduce-scatter as an all-reduce of the whole input)
    ok = GLOO_RUNS_AS.get(op, (op,))
    prior = [(kind, under) for ts, kind, under in launches if kind in ok and ts <= e["ts"]]
    op, under = prior[-1] if prior else (op, False)
    return {"op": op, "axis": ctx.axis(op, None, "", under), "group_size": 0,
            "bytes": float(n * size) if size and n else None, "dtype": dt, "start": float(e["ts"]),
            "end": float(e["ts"]) + float(e["dur"])}


# ---------------------------------------------------------------------------------------------------------- GPU
def _gpu_steps(path: str, ev: list[dict], steps: list[dict], kernels: list[dict], ctx: _Context):
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver",
                                             "python_function", None)]
    by_thread: dict = defaultdict(list)
    for e in cpu:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    launch_of: dict = {}  # correlation id -> (ancestors + name, launch time)
    bwd_end = []
    for ops in by_thread.values():
        for op, anc, _ in _walk(ops):
            if op["name"].startswith(BACKWARD_MARK):
                bwd_end.append(float(op["ts"]) + float(op["dur"]))
            if op.get("cat") in ("cuda_runtime", "cuda_driver"):
                corr = (op.get("args") or {}).get("correlation")
                if corr is not None:
                    launch_of[corr] = (anc, float(op["ts"]))
    gpu_steps = sorted((e for e in ev if e.get("cat") == "gpu_user_annotation"
                        and str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    cpu_steps = sorted(steps, key=lambda e: e["ts"])
    windows = _gpu_windows(cpu_steps, gpu_steps, kernels, launch_of)
    out: list[TracedStep] = []
    totals: dict[str, float] = defaultdict(float)
    calls: Counter = Counter()
    for st, (t0, t1, lo, hi) in zip(cpu_steps, windows, strict=True):
        last_bwd = max([b for b in bwd_end if lo <= b <= hi], default=lo)
        compute, comms = [], []
        for k in kernels:
            ks, ke = float(k["ts"]), float(k["ts"]) + float(k["dur"])
            if ke <= t0 or ks >= t1:
                continue
            op = _comm_op(str(k["name"]))
            if op is not None:
                comms.append(_nccl_collective(k, op, ctx, ks, ke))
                continue
            anc, ts = launch_of.get((k.get("args") or {}).get("correlation"), ([], lo))
            kind = _kind(anc) if anc else ("gemm" if GEMM_KERNEL.search(k["name"]) else
                                           "attention" if ATTENTION_MARK.search(k["name"]) else "memory")
            if kind == "memory" and GEMM_KERNEL.search(k["name"]):
                kind = "gemm"
            compute.append((ks, ke, (_phase(anc, "", ts, last_bwd), kind)))
            totals[k["name"]] += (ke - ks) * 1e-6
            calls[k["name"]] += 1
        by_label, exposed, hidden, _idle = _partition(t0, t1, compute, [(c["start"], c["end"], j)
                                                                       for j, c in enumerate(comms)])
        out.append(_step_record(ctx.rank, st["name"], t0, t1, by_label, comms, exposed, hidden))
    for c in (c for s in out for c in s.collectives):
        totals[f"nccl {c.op}"] += c.duration_s
        calls[f"nccl {c.op}"] += 1
    return out, [(n, s, calls[n]) for n, s in _largest(totals, 12)]


def _gpu_windows(cpu_steps, gpu_steps, kernels, launch_of):
    """(GPU window start, end, CPU span start, end) per step, us."""
    by_name = {e["name"]: e for e in gpu_steps}
    out, prev_end = [], None
    for st in cpu_steps:
        lo, hi = float(st["ts"]), float(st["ts"]) + float(st["dur"])
        g = by_name.get(st["name"])
        if g is not None:
            out.append((float(g["ts"]), float(g["ts"]) + float(g["dur"]), lo, hi))
            continue
        mine = [k for k in kernels if lo <= launch_of.get((k.get("args") or {}).get("correlation"), ([], -1))[1] < hi]
        if not mine:
            raise ParsimError(f"step {st['name']}: no kernel launched in it (a CPU-only step in a GPU trace)")
        start = min(float(k["ts"]) for k in mine)
        end = max(float(k["ts"]) + float(k["dur"]) for k in mine)
        out.append((min(start, prev_end) if prev_end is not None and prev_end < end else start, end, lo, hi))
        prev_end = end
    return out


def _nccl_collective(k: dict, op: str, ctx: _Context, s: float, e: float) -> dict:
    a = k.get("args") or {}
    name = str(a.get("Collective name", "")) or op
    op = COMM_OPS.get(name.lower().replace("_", ""), COMM_OPS.get(name.lower(), op))
    n = a.get("In msg nelems")
    dt = str(a.get("dtype", ""))
    size = DTYPE_BYTES.get(dt.lower())
    ranks = a.get("Process Group Ranks")
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except json.JSONDecodeError:
            ranks = None
    desc = str(a.get("Process Group Description", "")) or ctx.pg_desc.get(str(a.get("Process Group Name", "")), "")
    return {"op": op, "axis": ctx.axis(op, ranks if isinstance(ranks, list) else None, desc, False),
            "group_size": int(a.get("Group size", 0) or 0),
            "bytes": float(n) * size if isinstance(n, (int, float)) and size else None, "dtype": dt,
            "start": s, "end": e}
