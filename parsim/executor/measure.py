"""Counting collectives and tracking memory during a real step or a trace.

The counter is a TorchDispatchMode of its own (CommDebugMode nested with the memory tracker failed in its module
hook, DESIGN.md): it sees the c10d ops FSDP2 and pipelining issue (``c10d._allgather_base_``, ...) and the
functional collectives of DTensor (``_c10d_functional.all_gather_into_tensor``, ...), and records the bytes of the
input tensors this rank hands to each, keyed "<op>/<axis>" with the axis resolved from the process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_c10d = torch.ops.c10d
_fc = torch.ops._c10d_functional

# op -> (parsim op name, index of the input tensor(s) argument)
OPS = {
    _c10d._allgather_base_.default: ("all_gather", 1),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    _c10d.allreduce_.default: ("all_reduce", 0),
    _c10d.alltoall_base_.default: ("all_to_all", 1),
    _c10d.broadcast_.default: ("broadcast", 0),
    _c10d.send.default: ("send", 0),
    _fc.all_gather_into_tensor.default: ("all_gather", 0),
    _fc.reduce_scatter_tensor.default: ("reduce_scatter", 0),
    _fc.all_reduce.default: ("all_reduce", 0),
    _fc.all_to_all_single.default: ("all_to_all", 0),
    _fc.all_reduce_.default: ("all_reduce", 0),
    _fc.all_gather_into_tensor_out.default: ("all_gather", 0),
    _fc.reduce_scatter_tensor_out.default: ("reduce_scatter", 0),
    _fc.all_reduce_coalesced.default: ("all_reduce", 0),
    _fc.all_gather_into_tensor_coalesced.default: ("all_gather", 0),
    _fc.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", 0),
    _fc.broadcast.default: ("broadcast", 0),
    _fc.broadcast_.default: ("broadcast", 0),
}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return 0


def _group_name(args) -> str | None:
    """The process group of a collective: a ProcessGroup object (c10d ops) or the group name, which functional
    collectives pass as their last string argument (after e.g. the reduce op "sum")."""
    for a in reversed(args):
        if isinstance(a, str):
            return a
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except Exception:  # noqa: BLE001 - not a process group
                continue
    return None


class CommRecorder:
    """Bytes and calls per "<op>/<axis>" of the collectives it is shown (``record``)."""

    def __init__(self, axis_of_group: dict[str, tuple[str, ...]]):
        self.axis_of_group = axis_of_group
        self.bytes: dict[str, int] = {}
        self.counts: dict[str, int] = {}

    def record(self, func, args, kwargs) -> None:
        op, idx = OPS[func]
        name = _group_name(list(args) + list((kwargs or {}).values()))
        axes = self.axis_of_group.get(name, (f"group:{name}",))
        # the first axis in priority order whose group has these ranks; an all-to-all is EP's when EP is among them
        axis = "ep" if op == "all_to_all" and "ep" in axes else axes[0]
        key = f"{op}/{axis}"
        self.bytes[key] = self.bytes.get(key, 0) + _nbytes(args[idx])
        self.counts[key] = self.counts.get(key, 0) + 1
        if _LOG:  # debugging aid (PARSIM_COMM_LOG=1): every call with its shape and where it was issued
            import traceback

            where = [f"{f.name}:{f.lineno}" for f in traceback.extract_stack(limit=40)
                     if "torch/" in f.filename or "parsim" in f.filename][-16:]
            shape = [tuple(t.shape) for t in (args[idx] if isinstance(args[idx], (list, tuple)) else [args[idx]])]
            print(f"COMM {key} {_nbytes(args[idx])} {shape} {' < '.join(reversed(where))}")


_LOG = bool(__import__("os").environ.get("PARSIM_COMM_LOG"))


class _Tap(TorchDispatchMode):
    """Shows the collectives of one call to a recorder (pushed where the counter's own mode is not on the stack)."""

    def __init__(self, recorder: CommRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in OPS:
            self.recorder.record(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class CommCounter(CommRecorder, TorchDispatchMode):
    """Counts the collectives of a real run (a dispatch mode). A Python dispatch mode is popped while a tensor
    subclass handles an op, so the collectives DTensor issues *inside* its dispatch (an implicit redistribution,
    e.g. a Partial norm stacked with others in gradient clipping) would be invisible: while counting,
    ``torch.distributed.tensor._dispatch.redistribute_local_tensor`` runs under a tap when the counter is not on
    the mode stack; so do torch's ring-attention functions that context parallel's SDPA handlers call (the K/V
    all-gathers and dK/dV permutes). Loss parallel's handlers, which call collectives themselves, stay invisible
    here; traces count below DTensor, in their fake-tensor mode (``trace.CountingFakeTensorMode``), which sees every
    collective on a local tensor wherever it is issued."""

    def __init__(self, axis_of_group: dict[str, tuple[str, ...]]):
        CommRecorder.__init__(self, axis_of_group)
        TorchDispatchMode.__init__(self)
        self._restore = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in OPS:
            self.record(func, args, kwargs)
        return func(*args, **kwargs)

    def __enter__(self):
        from torch.distributed.tensor import _dispatch
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        def tap(orig):
            def tapped(*a, **k):
                if self in _get_current_dispatch_mode_stack():
                    return orig(*a, **k)
                with _Tap(self):
                    return orig(*a, **k)

            return tapped

        targets = ((_dispatch, "redistribute_local_tensor"), (ring, "_templated_ring_attention"),
                   (ring, "_templated_ring_attention_backward"))
        self._restore = [(mod, name, getattr(mod, name)) for mod, name in targets]
        for mod, name, orig in self._restore:
            setattr(mod, name, tap(orig))
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for mod, name, orig in self._restore or ():
            setattr(mod, name, orig)
        self._restore = None
        return out


class PeakTracker(TorchDispatchMode):
    """Tensor-level peak of live storages during a step, with what was alive at the peak by category.

    Storages that exist when the step starts are given by category (``baseline``: parameters, optimizer
    states, gradients); every op output's storage is added as ``step`` (activations, FSDP unsharded parameters
    and gradients, communication buffers, temporaries) and removed when it is freed (weakref on the storage,
    the mechanism of torch's MemTracker). DTensors count their local shard. Used instead of torch's
    FSDPMemTracker / MemTracker because those refuse a module running several times per step (pipeline
    microbatches, gradient accumulation) and FSDPMemTracker counted loss-parallel DTensors at more than their
    local size (seen here: 4.4 GB where the local storages held 1.6 GB)."""

    def __init__(self, baseline: dict | None = None, resizable=(), phase: dict | None = None, grads_fn=None,
                 record_events: bool = False):
        super().__init__()
        import weakref

        # with ``record_events``: every allocation and free in order, ``(+1, key, bytes, stream)`` / ``(-1, key, 0,
        # 0)``, the stream numbered in order of first use (0: the default stream; FSDP2's all-gather copy-in and
        # reduce-scatter streams are torch.cpu streams here, made current by FSDP2's own code), for replaying
        # through a model of the device's caching allocator (parsim.allocator)
        self.events: list | None = [] if record_events else None
        self._streams: dict[int, int] = {id(torch.cpu.current_stream()): 0}

        # the step's phase (``phase["now"]``, set by the traced step) and the gradient tensors alive (``grads_fn``):
        # at each new peak the phase is noted and the step's storages that are gradients are counted apart
        self.phase = phase if phase is not None else {}
        self.phase_at_peak = ""
        self.grads_fn = grads_fn

        self._weakref = weakref
        # FSDP2 frees unsharded parameters with storage.resize_(0) (no op the dispatcher sees): those storages
        # are watched and their current size read after every op instead
        self.watched = []
        seen = set()
        for t in resizable:
            st = (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                self.watched.append(st)
        self.watched_keys = seen
        self._watched_bytes = [st.nbytes() for st in self.watched]
        if self.events is not None:  # unsharded parameters already gathered when the step starts
            self.events += [(1, -1 - i, n, 0) for i, n in enumerate(self._watched_bytes) if n]
        self.live: dict[int, tuple[int, str]] = {}
        self.refs = {}
        self.current: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.peak_op = ""
        self._op = "start"
        import os

        self.debug = os.environ.get("PARSIM_DEBUG", "")
        self.n_allocated = 0
        self.origin: dict[int, str] = {}
        self.peak_live = []
        for cat, tensors in (baseline or {}).items():
            for t in tensors:
                self._add(t, cat)

    def _add(self, t, cat: str):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = st._cdata
        if key in self.live or key in self.watched_keys:
            return
        nbytes = st.nbytes()
        self.live[key] = (nbytes, cat)
        if self.events is not None:
            self.events.append((1, key, nbytes, self._stream()))
        if self.debug:
            self.n_allocated += 1  # (PARSIM_DEBUG=3: each tensor apart, with its allocation's index and phase)
            at = f" #{self.n_allocated} {self.phase.get('now', '')}" if self.debug == "3" else ""
            self.origin[key] = f"{self._op} {tuple(t.shape)} {t.dtype}{at}"
        self.current[cat] = self.current.get(cat, 0) + nbytes
        self.total += nbytes
        self._check_peak()
        if self.debug == "4":  # every allocation with the running total (unsharded parameters included)
            live = self.total + sum(x.nbytes() for x in self.watched)
            print(f"TL +{nbytes} {self._op} {tuple(t.shape)} {self.phase.get('now', '')} total={live}", flush=True)
        self.refs[key] = self._weakref.ref(st, lambda _r, key=key: self._free(key))

    def _stream(self) -> int:
        return self._streams.setdefault(id(torch.cpu.current_stream()), len(self._streams))

    def _record_resizes(self) -> None:
        """FSDP2's unsharded parameters are allocated and freed by resizing their storages (on the default stream,
        in its copy-out and reshard): each change of size is one free and / or one allocation."""
        for i, st in enumerate(self.watched):
            now, before = st.nbytes(), self._watched_bytes[i]
            if now != before:
                if before:
                    self.events.append((-1, -1 - i, 0, 0))
                if now:
                    self.events.append((1, -1 - i, now, 0))
                self._watched_bytes[i] = now

    def _check_peak(self):
        if self.events is not None and self.watched:
            self._record_resizes()
        unsharded = sum(st.nbytes() for st in self.watched)
        if self.total + unsharded > self.peak:
            self.peak = self.total + unsharded
            self.at_peak = dict(self.current)
            self.peak_op = self._op
            self.phase_at_peak = self.phase.get("now", "")
            if self.grads_fn is not None:
                self._split_gradients()
            if self.debug:
                agg = {}
                for k, (n, c) in self.live.items():
                    origin = self.origin.get(k, "")  # PARSIM_DEBUG=2 / 3: by op, shape and dtype; else by op
                    o = (origin if self.debug in ("2", "3") else origin.split(" ")[0]) + " " + c
                    agg[o] = agg.get(o, 0) + n
                top = None if self.debug == "3" else 30
                self.peak_live = sorted(((n, "", o) for o, n in agg.items()), reverse=True)[:top]
            if self.watched:
                self.at_peak["fsdp_unsharded_params"] = unsharded

    def _split_gradients(self) -> None:
        """Move the gradients among the storages made during the step from ``step`` to ``gradients``: the
        ``.grad`` of every parameter and FSDP2's unsharded accumulated gradients (microbatches without sync)."""
        seen, nbytes = set(), 0
        for g in self.grads_fn():
            st = (g._local_tensor if hasattr(g, "_local_tensor") else g).untyped_storage()
            key = st._cdata
            if key in seen:
                continue
            seen.add(key)
            size, cat = self.live.get(key, (0, None))
            if cat == "step":
                nbytes += size
        if nbytes:
            self.at_peak["step"] = self.at_peak.get("step", 0) - nbytes
            self.at_peak["gradients"] = self.at_peak.get("gradients", 0) + nbytes

    def _free(self, key):
        nbytes, cat = self.live.pop(key, (0, None))
        self.refs.pop(key, None)
        if self.events is not None and cat is not None:
            self.events.append((-1, key, 0, 0))
        if cat is not None:
            self.current[cat] -= nbytes
            self.total -= nbytes
            if self.debug == "4":  # (and every free, with the op running when it happened)
                print(f"TL -{nbytes} {self._op}", flush=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.events is not None and self.watched:
            self._record_resizes()
        out = func(*args, **(kwargs or {}))
        self.observe(func, out)
        return out

    def observe(self, func, out) -> None:
        """Count the storages of ``out``, the result of ``func``. Called by this mode for the ops it sees and, in a
        trace, by the fake-tensor mode below every tensor subclass for every op on local tensors: a Python
        dispatch mode is popped while DTensor handles an op, so what DTensor allocates inside its dispatch (context
        parallel's ring attention buffers, implicit redistributions, loss parallel's temporaries) reaches this
        mode only through the fake mode (a storage already counted is not counted twice)."""
        from torch.utils._pytree import tree_flatten

        self._op = str(func)
        for t in tree_flatten(out)[0]:
            self._add(t, "step")
        if self.watched:
            self._check_peak()

    def breakdown(self) -> dict[str, float]:
        names = {"step": "allocated_during_step"}
        return {names.get(k, k): float(v) for k, v in self.at_peak.items()}


def grad_tensors(parts, pipelined: bool = False) -> list:
    """The gradients a rank keeps: the sharded gradients of FSDP2's parameters, FSDP2's unsharded accumulated
    gradients (microbatches without sync) and ``.grad`` of the parameters FSDP does not manage. (The unsharded
    gradient an FSDP unit's backward produces is a buffer on its way to the reduce-scatter: FSDP2 swaps the module
    parameters to the unsharded ones while gathered, so ``module.parameters()`` alone would count it too.)

    Without sync (a group's ``reduce_grads`` False: pipelining's backwards before a stage's last, gradient
    accumulation) FSDP2 keeps the accumulation on the unsharded parameter's ``.grad`` when its dtype is already the
    reduce dtype (``FSDPParam.to_accumulated_grad_if_needed`` moves it to ``unsharded_accumulated_grad`` only to
    upcast): those are kept gradients too, not a buffer on its way to a reduce. With an upcast the ``.grad`` is a
    microbatch's new gradient waiting for the post-backward's add: not counted."""
    out, managed = [], set()
    for m in parts:
        for mod in m.modules():
            state = mod._get_fsdp_state() if hasattr(mod, "_get_fsdp_state") else None
            for group in (getattr(state, "_fsdp_param_groups", None) or []):
                # the accumulation phase: a backward without sync, or (``pipelined``) pipelining's reduce after
                # the last one (the group's own backward over: its gradients wait there for the reduce)
                no_sync = not getattr(group, "reduce_grads", True) or pipelined and str(
                    getattr(group, "_training_state", "")).endswith(("POST_BACKWARD", "IDLE"))
                for fp in group.fsdp_params:
                    sharded = getattr(fp, "sharded_param", None)
                    if sharded is not None:
                        managed.add(id(sharded))
                        if sharded.grad is not None:
                            out.append(sharded.grad)
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None:
                        managed.add(id(unsharded))
                        if no_sync and getattr(fp, "reduce_dtype", None) is None and unsharded.grad is not None:
                            out.append(unsharded.grad)  # (with an upcast it is a new one on its way to the add)
                    acc = getattr(fp, "unsharded_accumulated_grad", None)
                    if acc is not None:
                        out.append(acc)
        for p in m.parameters():
            if id(p) not in managed and p.grad is not None:
                out.append(p.grad)
    return out


def track_step(step, parts, opt, phase: dict | None = None, events: list | None = None, below=None,
               pipelined: bool = False, pipeline_buffers=()):
    """Run ``step()`` under a PeakTracker seeded with this rank's parameters, gradients and optimizer state.
    Returns (step's result, peak bytes, breakdown at the peak, the op that set the peak); with ``phase`` (a dict
    whose "now" the step keeps current) the phase at the peak is left in ``phase["at_peak"]``; with ``events`` (a
    list) the step's allocations and frees are appended to it (``PeakTracker``'s ``record_events``), after the
    allocations of the state the step starts with. ``below``: a mode under every tensor subclass (the trace's
    fake-tensor mode) that shows the tracker what it makes (``PeakTracker.observe``). ``pipelined``: the step runs
    a pipeline schedule (its gradients are accumulated until a reduce after the last backward, ``grad_tensors``);
    ``pipeline_buffers``: its stages' receive buffers, which exist when the step starts (``recv_buffers``)."""
    params = [p for m in parts for p in m.parameters()]
    base = {"parameters": params,
            "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer_states": [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
            "buffers": [b for m in parts for b in m.buffers()], "pipeline_buffers": list(pipeline_buffers)}
    unsharded = []
    for m in parts:
        for mod in m.modules():
            state = mod._get_fsdp_state() if hasattr(mod, "_get_fsdp_state") else None
            for group in (getattr(state, "_fsdp_param_groups", None) or []):
                unsharded += [fp._unsharded_param for fp in group.fsdp_params if hasattr(fp, "_unsharded_param")]
    tracker = PeakTracker(base, resizable=unsharded, phase=phase, grads_fn=lambda: grad_tensors(parts, pipelined),
                          record_events=events is not None)
    if below is not None:
        below.tracker = tracker
    try:
        with tracker:
            out = step()
    finally:
        if below is not None:
            below.tracker = None
    if events is not None:
        events.extend(tracker.events or ())
    if phase is not None:
        phase["at_peak"] = tracker.phase_at_peak
    if tracker.debug:
        for n, c, o in tracker.peak_live:
            print(f"PEAK-LIVE {n:12d} B {c:20s} {o}")
    # the op whose output set the peak (where in the step it is) goes with the tracker for provenance
    return out, float(tracker.peak), tracker.breakdown(), tracker.peak_op


def recv_buffers(stages) -> list:
    """The receive buffers torch's pipeline stages keep across steps: per microbatch one for each activation a
    stage after the first receives (``_create_act_recv_info``) and one for each output gradient a stage before the
    last receives (``_create_grad_recv_info``), allocated when the schedule first runs and reused by every step
    (torch 2.13 pipelining/stage.py). The received tensor a stage computes with is the buffer itself."""
    out = []
    for st in stages:
        for infos in [*st.args_recv_info.values(), *st.grad_recv_info.values()]:
            out += [i.buffer for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor)]
    return out


def _where(frames: list[dict], depth: int = 4) -> str:
    """The innermost ``depth`` frames of an allocation's Python stack in parsim's code (torch's where none is;
    "?" for the autograd engine's allocations, which have no Python stack)."""
    keep = [f for f in frames if "parsim/" in f.get("filename", "")] or \
        [f for f in frames if "torch/" in f.get("filename", "")]
    return " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in keep[:depth]) or "?"


def peak_holders(snapshot: dict, top: int = 30) -> dict:
    """What holds the peak of allocated memory in a ``torch.cuda.memory._snapshot()`` taken with history recording
    on: the allocation events replayed (an alloc adds its size, a free request removes it, as the allocator's
    allocated statistic counts), the moment of the largest total, and the blocks live then grouped by where they
    were allocated (``_where``), largest first. Blocks allocated before recording began are not in the events."""
    events = [e for t in snapshot.get("device_traces", []) for e in t]
    cur = peak = 0
    peak_i, live = -1, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, peak_i = cur, i
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    live = {}
    for e in events[:peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    groups: dict = {}
    for e in live.values():
        g = groups.setdefault(_where(e.get("frames", [])), {"bytes": 0, "blocks": 0})
        g["bytes"] += e["size"]
        g["blocks"] += 1
    rows = sorted(({"where": k, **v} for k, v in groups.items()), key=lambda r: -r["bytes"])
    at = events[peak_i] if peak_i >= 0 else {}
    return {"peak_recorded_bytes": peak, "events": len(events), "peak_event": peak_i,
            "peak_alloc_where": _where(at.get("frames", []), 8), "holders": rows[:top],
            "other_bytes": sum(r["bytes"] for r in rows[top:])}
