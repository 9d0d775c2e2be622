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


class CommCounter(TorchDispatchMode):
    def __init__(self, axis_of_group: dict[str, tuple[str, ...]]):
        super().__init__()
        self.axis_of_group = axis_of_group
        self.bytes: dict[str, int] = {}
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = OPS.get(func)
        if hit is not None:
            op, idx = hit
            name = _group_name(list(args) + list(kwargs.values()))
            axes = self.axis_of_group.get(name, (f"group:{name}",))
            if op == "all_to_all" and "ep" in axes:
                axis = "ep"
            else:
                axis = next((a for a in axes if a != "ep"), axes[0])
            key = f"{op}/{axis}"
            self.bytes[key] = self.bytes.get(key, 0) + _nbytes(args[idx])
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **kwargs)


class PeakTracker(TorchDispatchMode):
    """Tensor-level peak of live storages during a step, with what was alive at the peak by category.

    Storages that exist when the step starts are given by category (``baseline``: parameters, optimizer
    states, gradients); every op output's storage is added as ``step`` (activations, FSDP unsharded parameters
    and gradients, communication buffers, temporaries) and removed when it is freed (weakref on the storage,
    the mechanism of torch's MemTracker). DTensors count their local shard. Used instead of torch's
    FSDPMemTracker / MemTracker because those refuse a module running several times per step (pipeline
    microbatches, gradient accumulation) and FSDPMemTracker counted loss-parallel DTensors at more than their
    local size (seen here: 4.4 GB where the local storages held 1.6 GB)."""

    def __init__(self, baseline: dict | None = None, resizable=()):
        super().__init__()
        import weakref

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
        if self.debug:
            self.origin[key] = f"{self._op} {tuple(t.shape)} {t.dtype}"
        self.current[cat] = self.current.get(cat, 0) + nbytes
        self.total += nbytes
        self._check_peak()
        self.refs[key] = self._weakref.ref(st, lambda _r, key=key: self._free(key))

    def _check_peak(self):
        unsharded = sum(st.nbytes() for st in self.watched)
        if self.total + unsharded > self.peak:
            self.peak = self.total + unsharded
            self.at_peak = dict(self.current)
            self.peak_op = self._op
            if self.debug:
                agg = {}
                for k, (n, c) in self.live.items():
                    origin = self.origin.get(k, "")  # PARSIM_DEBUG=2: by op, shape and dtype; else by op
                    o = (origin if self.debug == "2" else origin.split(" ")[0]) + " " + c
                    agg[o] = agg.get(o, 0) + n
                self.peak_live = sorted(((n, "", o) for o, n in agg.items()), reverse=True)[:30]
            if self.watched:
                self.at_peak["fsdp_unsharded_params"] = unsharded

    def _free(self, key):
        nbytes, cat = self.live.pop(key, (0, None))
        self.refs.pop(key, None)
        if cat is not None:
            self.current[cat] -= nbytes
            self.total -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        self._op = str(func)
        for t in tree_flatten(out)[0]:
            self._add(t, "step")
        if self.watched:
            self._check_peak()
        return out

    def breakdown(self) -> dict[str, float]:
        names = {"step": "allocated_during_step"}
        return {names.get(k, k): float(v) for k, v in self.at_peak.items()}


def track_step(step, parts, opt):
    """Run ``step()`` under a PeakTracker seeded with this rank's parameters, gradients and optimizer state.
    Returns (step's result, peak bytes, breakdown at the peak, the op that set the peak)."""
    params = [p for m in parts for p in m.parameters()]
    base = {"parameters": params,
            "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer_states": [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
            "buffers": [b for m in parts for b in m.buffers()]}
    unsharded = []
    for m in parts:
        for mod in m.modules():
            state = mod._get_fsdp_state() if hasattr(mod, "_get_fsdp_state") else None
            for group in (getattr(state, "_fsdp_param_groups", None) or []):
                unsharded += [fp._unsharded_param for fp in group.fsdp_params if hasattr(fp, "_unsharded_param")]
    tracker = PeakTracker(base, resizable=unsharded)
    with tracker:
        out = step()
    if tracker.debug:
        for n, c, o in tracker.peak_live:
            print(f"PEAK-LIVE {n / 2**20:9.1f} MiB {c:20s} {o}")
    # the op whose output set the peak (where in the step it is) goes with the tracker for provenance
    return out, float(tracker.peak), tracker.breakdown(), tracker.peak_op
