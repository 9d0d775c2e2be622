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
}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return 0


def _group_name(args) -> str | None:
    for a in args:
        if isinstance(a, str):
            return a
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except Exception:  # noqa: BLE001 - not a process group
                continue
    return None


class CommCounter(TorchDispatchMode):
    def __init__(self, axis_of_group: dict[str, str]):
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
            axis = self.axis_of_group.get(name, f"group:{name}")
            key = f"{op}/{axis}"
            self.bytes[key] = self.bytes.get(key, 0) + _nbytes(args[idx])
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **kwargs)


# FSDPMemTracker categories -> parsim memory breakdown keys
FSDP_CATEGORIES = {
    "Sharded Param": "parameters", "Unsharded Param": "fsdp_unsharded_params", "Buffer": "buffers",
    "Sharded Grad": "gradients", "Unsharded Grad": "fsdp_grad_buffers", "Activation": "activations",
    "Activation": "activations", "Act": "activations", "Temp": "temporaries",
    "All Gather": "fsdp_all_gather_buffers", "Reduce Scatter": "fsdp_grad_buffers", "Optstate": "optimizer_states", "OptState": "optimizer_states", "Other": "other",
    "Inputs": "inputs",
    # plain MemTracker categories
    "Parameter": "parameters", "Gradient": "gradients",
}


def breakdown_from_snapshot(snap: dict) -> tuple[float, dict]:
    """(peak bytes, breakdown) from a tracker's peak snapshot {device: {category: bytes, 'Total': bytes}}."""
    total = 0.0
    out: dict[str, float] = {}
    for dev, cats in snap.items():
        if str(dev) == "meta":
            continue
        for k, v in cats.items():
            if k == "Total":
                total += v
                continue
            label = str(getattr(k, "value", k))
            name = FSDP_CATEGORIES.get(label, label.lower().replace(" ", "_"))
            out[name] = out.get(name, 0.0) + float(v)
    rest = total - sum(out.values())
    if abs(rest) > 0:
        out["other"] = out.get("other", 0.0) + rest
    return total, out


class PeakTracker(TorchDispatchMode):
    """Tensor-level peak of live storages, for steps the module-level trackers refuse (several forwards of a
    module per step: pipeline microbatches, gradient accumulation). Storages alive at the start (``baseline``:
    parameters, gradients, optimizer state) are counted once; every op output's storage is added and removed
    when it is freed (weakref on the storage, the same mechanism as torch's MemTracker). No categories."""

    def __init__(self, baseline=()):
        super().__init__()
        import weakref

        self._weakref = weakref
        self.live: dict[int, int] = {}
        self.refs = {}
        self.current = 0
        self.peak = 0
        for t in baseline:
            self._add(t)

    def _add(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = st._cdata
        if key in self.live:
            return
        nbytes = st.nbytes()
        self.live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.refs[key] = self._weakref.ref(st, lambda _r, key=key: self._free(key))

    def _free(self, key):
        n = self.live.pop(key, 0)
        self.refs.pop(key, None)
        self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t)
        return out
