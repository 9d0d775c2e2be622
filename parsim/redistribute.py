"""Redistribution planner: the cheapest sequence of collectives that turns one DTensor layout into another.

A *layout* of a tensor on a device mesh says, for every mesh axis, whether the tensor is replicated (R), a partial
sum (P) or sharded along a tensor dimension (S(d)); and, for every tensor dimension sharded over several axes, the
*shard order* (seed 003): the axes outer to inner. ``S(0)S(0)`` with order (0, 1) gives rank (i, j) chunk
``i * n1 + j`` of dim 0; with order (1, 0) chunk ``j * n0 + i``. The notation is torch's
(``DTensorSpec.format_shard_order_str``): ``S(0)[1]S(0)[0]`` is the second one (axis 1 shards first).

The graph (the same moves as torch's ``DTensorRedistributePlanner``, derived from what each collective does to
the local block of a rank; ``x`` a mesh axis, orders written outer->inner):

* all-gather: S(d)[..., x] -> R on x. Only the innermost axis of a dimension's order can be gathered: the chunks of
  the group along x are adjacent in the tensor only when x is the innermost.
* all-to-all: S(a)[..., x] -> S(b)[..., x]: the innermost axis of ``a`` moves to the inner end of ``b``.
* all-reduce: P on x -> R.   reduce-scatter: P on x -> S(d)[..., x].
* chunk (local): R on x -> S(d)[..., x].   partition (local): R on x -> P (only when the target has a P).
* **one collective over a flattened group** (seed 003's review): gathering the innermost k axes of an order at once,
  reduce-scattering over k partial axes into the inner end of an order, all-reducing k partial axes. A flattened
  group of axes (x, y) numbers rank (i, j) as ``i * ny + j``, so gathering/scattering over it moves the suffix
  (x, y) of an order exactly when x is outer of y in the order. DTensor can run it only over a flattened mesh of
  axes in ascending mesh order (``DeviceMesh._flatten``), so parsim offers exactly those (``flatten=True``).

Edge costs are the profile's collective times for the group the step runs on: its size, the ranks of it inside
one node (the mesh is laid out row-major over the ranks, the last axis fastest, as ``init_device_mesh`` does), and
the bytes each rank puts in (the local block: the full tensor over the product of the sharding axes). DTensor on a
CPU (gloo) mesh runs an all-to-all as an all-gather of the local block and a chunk (``shard_dim_alltoall``), so on
a gloo profile the all-to-all edge costs that. Local steps cost a read and a write of the bytes they produce at the
profile's memory bandwidth. Every step also pays DTensor's fixed cost per redistribute step (spec checks, the
transform lookup, the launch of the op and its output allocation): ``corrections.redistribute_step_overhead_s`` of
the profile where it was measured (``bench/redistribute_bench.py --measure-overhead``), else
``DEFAULT_STEP_OVERHEAD_S``; local copies (chunks, concatenation along a dim other than 0, the re-chunking of an
all-to-all) at ``corrections.redistribute_copy_bytes_per_s`` where measured. Without these two terms the planner
traded one all-gather for a "free" chunk plus a flattened all-gather, and its paths were slower than torch's by
more than 5% on 65 of the 159 pairs where they differed on the 2x2 gloo benchmark; with them, 41 of 143 (measured
with bench/redistribute_bench.py, 1024x1024 float32). The rest is noise the model cannot resolve, hence
``recommend``: parsim's path only where it is predicted faster by more than the profile's fit error.

The planner is Dijkstra over layouts; every path it returns is a sequence of the moves above.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ParsimError
from .hardware import HardwareProfile

# [assumed] host cost of one DTensor redistribute step on a GPU (Python dispatch and a kernel launch, typically
# 10-50 us in eager PyTorch); profiles measured with bench/redistribute_bench.py --measure-overhead carry their own
DEFAULT_STEP_OVERHEAD_S = 20e-6
_TOKEN = re.compile(r"\s*(R|P|S\((\d+)\)(?:\[(\d+)\])?)")


# ---- layouts -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Placement of a tensor of ``n_dims`` dimensions on a mesh of ``mesh_shape``: ``shard_order[d]`` the mesh
    axes sharding tensor dim d, outer first; ``partial`` the axes holding partial sums; the rest replicate."""

    mesh_shape: tuple[int, ...]
    shard_order: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...] = ()

    def __post_init__(self):
        axes = [a for order in self.shard_order for a in order] + list(self.partial)
        if len(set(axes)) != len(axes):
            raise ParsimError(f"layout {self.shard_order} / P{self.partial}: a mesh axis is used twice")
        if any(not 0 <= a < len(self.mesh_shape) for a in axes):
            raise ParsimError(f"layout uses a mesh axis outside the {len(self.mesh_shape)}-D mesh")
        if tuple(sorted(self.partial)) != tuple(self.partial):
            raise ParsimError("layout partial axes must be sorted")
        if not self.shard_order or any(n < 1 for n in self.mesh_shape):
            raise ParsimError("a layout needs at least one tensor dim and mesh axes of size >= 1")

    @property
    def n_dims(self) -> int:
        return len(self.shard_order)

    def placement(self, axis: int) -> str:
        if axis in self.partial:
            return "P"
        for d, order in enumerate(self.shard_order):
            if axis in order:
                return f"S({d})"
        return "R"

    def text(self) -> str:
        """torch's notation: ``S(d)[k]`` where dim d is sharded over several axes (k = position in the order)."""
        out = []
        for axis in range(len(self.mesh_shape)):
            p = self.placement(axis)
            if p.startswith("S"):
                order = self.shard_order[int(p[2:-1])]
                p += f"[{order.index(axis)}]" if len(order) > 1 else ""
            out.append(p)
        return "".join(out)

    def shard_count(self) -> int:
        return math.prod(self.mesh_shape[a] for order in self.shard_order for a in order)

    def replicated_axes(self) -> list[int]:
        return [a for a in range(len(self.mesh_shape)) if self.placement(a) == "R"]

    def with_order(self, d: int, order: tuple[int, ...]) -> "Layout":
        so = list(self.shard_order)
        so[d] = tuple(order)
        return Layout(self.mesh_shape, tuple(so), self.partial)

    def to_dict(self) -> dict:
        return {"text": self.text(), "placements": [self.placement(a) for a in range(len(self.mesh_shape))],
                "shard_order": {str(d): list(o) for d, o in enumerate(self.shard_order) if o}}


def parse_layout(text: str, mesh_shape: tuple[int, ...], n_dims: int, order: str | None = None) -> Layout:
    """``"S(0)S(1)"``, ``"RP"``, ``"S(0)[1]S(0)[0]"`` (torch's notation); ``order`` (``"0:1,0;1:2"``: tensor dim :
    mesh axes outer first) overrides the order of the dims it names. Default order: ascending mesh axes."""
    tokens, pos = [], 0
    while pos < len(text.strip()):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ParsimError(f"layout {text!r}: expected R, P or S(d)[k] at {text[pos:]!r}")
        tokens.append(m)
        pos = m.end()
    if len(tokens) != len(mesh_shape):
        raise ParsimError(f"layout {text!r} has {len(tokens)} placements for a {len(mesh_shape)}-D mesh")
    shards: dict[int, list[tuple[int | None, int]]] = {}
    partial = []
    for axis, m in enumerate(tokens):
        if m.group(1) == "P":
            partial.append(axis)
        elif m.group(2) is not None:
            d = int(m.group(2))
            if d >= n_dims:
                raise ParsimError(f"layout {text!r}: S({d}) on a {n_dims}-D tensor")
            shards.setdefault(d, []).append((None if m.group(3) is None else int(m.group(3)), axis))
    so: list[tuple[int, ...]] = [()] * n_dims
    for d, entries in shards.items():
        ranks = [k for k, _ in entries]
        if all(k is None for k in ranks):
            so[d] = tuple(a for _, a in entries)
        elif sorted(k for k in ranks if k is not None) == list(range(len(entries))) and None not in ranks:
            so[d] = tuple(a for _, a in sorted(entries))
        else:
            raise ParsimError(f"layout {text!r}: the [k] order indices of S({d}) must be 0..{len(entries) - 1}")
    layout = Layout(tuple(mesh_shape), tuple(so), tuple(partial))
    return _apply_order(layout, order) if order else layout


def _apply_order(layout: Layout, order: str) -> Layout:
    for part in filter(None, (p.strip() for p in order.split(";"))):
        try:
            d_text, axes_text = part.split(":")
            d, axes = int(d_text), tuple(int(a) for a in axes_text.split(","))
        except ValueError:
            raise ParsimError(f"shard order {order!r}: write tensor_dim:axis,axis;... (e.g. 0:1,0)") from None
        if not 0 <= d < layout.n_dims or sorted(axes) != sorted(layout.shard_order[d]):
            raise ParsimError(f"shard order {part!r}: tensor dim {d} is sharded over mesh axes "
                              f"{sorted(layout.shard_order[d]) if 0 <= d < layout.n_dims else '(none)'}")
        layout = layout.with_order(d, axes)
    return layout


def layout_from_torch(mesh_shape, n_dims: int, x: dict) -> Layout:
    """From {'placements': ['R', 'P', 'S(d)'...], 'shard_order': {tensor dim: mesh axes outer first}}, the plain
    form ``executor.redistribute_torch`` reports torch's layouts in (and ``Layout.to_dict`` writes)."""
    so: list[tuple[int, ...]] = [()] * n_dims
    for d, axes in x["shard_order"].items():
        so[int(d)] = tuple(axes)
    return Layout(tuple(mesh_shape), tuple(so), tuple(a for a, p in enumerate(x["placements"]) if p == "P"))


def all_layouts(mesh_shape: tuple[int, ...], n_dims: int, with_partial: bool = True) -> list[Layout]:
    """Every layout (with every shard order) of an n_dims tensor on the mesh."""
    choices = ["R"] + (["P"] if with_partial else []) + list(range(n_dims))
    out = []
    for assign in itertools.product(choices, repeat=len(mesh_shape)):
        per_dim = [[a for a, c in enumerate(assign) if c == d] for d in range(n_dims)]
        partial = tuple(a for a, c in enumerate(assign) if c == "P")
        for orders in itertools.product(*[list(itertools.permutations(axes)) for axes in per_dim]):
            out.append(Layout(tuple(mesh_shape), tuple(tuple(o) for o in orders), partial))
    return out


# ---- costs -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """Edge costs on one mesh: the profile's collective times for the group each step runs on."""

    profile: HardwareProfile
    mesh_shape: tuple[int, ...]
    ranks_per_node: int
    flatten: bool = True  # offer one collective over a flattened group (ascending mesh axes, as DTensor can run)

    def __post_init__(self):
        if self.ranks_per_node < 1:
            raise ParsimError(f"ranks per node must be >= 1, got {self.ranks_per_node}")

    @property
    def a2a_as_all_gather(self) -> bool:
        """DTensor runs Shard->Shard on a CPU mesh as all-gather + chunk (gloo has no all-to-all there)."""
        return self.profile.provenance.get("backend") == "gloo" or self.profile.device_name.lower().startswith("cpu")

    def group(self, axes: tuple[int, ...]) -> tuple[int, int]:
        """(group size, ranks of the group inside one node) for the group over ``axes`` containing rank 0."""
        strides = [math.prod(self.mesh_shape[a + 1:]) for a in range(len(self.mesh_shape))]
        ranks = [sum(c * strides[a] for c, a in zip(coords, axes, strict=True))
                 for coords in itertools.product(*[range(self.mesh_shape[a]) for a in axes])]
        return len(ranks), max(1, sum(r < self.ranks_per_node for r in ranks))

    @property
    def step_overhead_s(self) -> float:
        return float(self.profile.corrections.get("redistribute_step_overhead_s", DEFAULT_STEP_OVERHEAD_S))

    @property
    def copy_bytes_per_s(self) -> float:
        """Bytes a rank writes per second in DTensor's local copies (chunk, concatenation): measured on the mesh
        where the profile has it, else the memory bandwidth at its efficiency, read + write."""
        hw = self.profile
        rate = hw.corrections.get("redistribute_copy_bytes_per_s")
        return float(rate) if rate else hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency / 2.0

    def time_s(self, op: str, axes: tuple[int, ...], input_bytes: float, dims: tuple[int, int] = (0, 0)) -> float:
        """Time of one step: the fixed cost of a redistribute step, the collective, and the local copies DTensor
        makes for it. ``dims`` = (tensor dim sharded before, after) where the op has one."""
        n, rpn = self.group(axes)
        if n == 1:
            return 0.0
        copy = 1.0 / self.copy_bytes_per_s
        t = self.step_overhead_s
        if op == "chunk":
            return t + input_bytes / n * copy
        if op == "partition":
            return t + input_bytes * copy
        coll = "all_gather" if op == "all_to_all" and self.a2a_as_all_gather else op
        t += float(self.profile.collective_time_s(coll, input_bytes, n, rpn))
        if op == "all_gather" and dims[0] != 0:  # gathered chunks are concatenated along a dim other than 0
            t += input_bytes * n * copy
        elif op == "reduce_scatter" and dims[1] != 0:  # chunks along that dim packed before the scatter
            t += input_bytes * copy
        elif op == "all_to_all":  # gathered (or exchanged) blocks re-chunked into a contiguous local block
            t += input_bytes * copy + (input_bytes * n * copy if self.a2a_as_all_gather and dims[0] != 0 else 0.0)
        return t


@dataclass(frozen=True)
class Step:
    op: str
    axes: tuple[int, ...]  # mesh axes of the group (a flattened group when more than one), outer first
    src: Layout
    dst: Layout
    input_bytes: float  # per rank
    time_s: float
    group_size: int
    ranks_per_node: int

    def to_dict(self) -> dict:
        return {"op": self.op, "mesh_axes": list(self.axes), "group_size": self.group_size,
                "ranks_per_node": self.ranks_per_node, "input_bytes": self.input_bytes, "time_s": self.time_s,
                "dst": self.dst.to_dict()}


@dataclass(frozen=True)
class Path:
    src: Layout
    dst: Layout
    steps: tuple[Step, ...] = field(default_factory=tuple)

    @property
    def time_s(self) -> float:
        return sum(s.time_s for s in self.steps)

    @property
    def layouts(self) -> list[Layout]:
        return [self.src] + [s.dst for s in self.steps]

    def to_dict(self) -> dict:
        return {"src": self.src.to_dict(), "time_s": self.time_s,
                "collectives": sum(s.op not in ("chunk", "partition") for s in self.steps),
                "steps": [s.to_dict() for s in self.steps]}


# ---- the graph ---------------------------------------------------------------------------------------------------
def _moves(x: Layout, allow_partial: bool, flatten: bool):
    """(op, axes, next layout) for every move out of ``x`` (see the module docstring)."""
    for d, order in enumerate(x.shard_order):
        for k in range(1, (len(order) if flatten else min(1, len(order))) + 1):
            suffix = order[len(order) - k:]
            if k > 1 and list(suffix) != sorted(suffix):
                continue
            yield "all_gather", suffix, x.with_order(d, order[:len(order) - k])
        if order:
            for b in range(x.n_dims):
                if b != d:
                    y = x.with_order(d, order[:-1])
                    yield "all_to_all", order[-1:], y.with_order(b, y.shard_order[b] + order[-1:])
    p = x.partial
    subsets = [c for k in range(1, len(p) + 1) for c in itertools.combinations(p, k)] if flatten else \
        [(a,) for a in p]
    for axes in subsets:
        y = Layout(x.mesh_shape, x.shard_order, tuple(a for a in p if a not in axes))
        yield "all_reduce", axes, y
        for d in range(x.n_dims):
            yield "reduce_scatter", axes, y.with_order(d, y.shard_order[d] + axes)
    for a in x.replicated_axes():
        for d in range(x.n_dims):
            yield "chunk", (a,), x.with_order(d, x.shard_order[d] + (a,))
        if allow_partial:
            yield "partition", (a,), Layout(x.mesh_shape, x.shard_order, tuple(sorted(p + (a,))))


def _dims(src: Layout, dst: Layout) -> tuple[int, int]:
    """(tensor dim that lost mesh axes, tensor dim that gained them); 0 where none did."""
    lost = [d for d in range(src.n_dims) if len(dst.shard_order[d]) < len(src.shard_order[d])]
    gained = [d for d in range(src.n_dims) if len(dst.shard_order[d]) > len(src.shard_order[d])]
    return (lost[0] if lost else 0, gained[0] if gained else 0)


def _step(costs: Costs, op: str, axes: tuple[int, ...], src: Layout, dst: Layout, full_bytes: float) -> Step:
    local = full_bytes / src.shard_count()
    n, rpn = costs.group(axes)
    return Step(op, axes, src, dst, local, costs.time_s(op, axes, local, _dims(src, dst)), n, rpn)


def neighbours(x: Layout, costs: Costs, full_bytes: float, allow_partial: bool) -> list[Step]:
    return [_step(costs, op, axes, x, y, full_bytes) for op, axes, y in _moves(x, allow_partial, costs.flatten)]


def _check(src: Layout, dst: Layout, costs: Costs) -> None:
    if src.mesh_shape != dst.mesh_shape or src.mesh_shape != costs.mesh_shape or src.n_dims != dst.n_dims:
        raise ParsimError(f"source {src.text()} and target {dst.text()} are on different meshes or tensors")


def plan_path(src: Layout, dst: Layout, full_bytes: float, costs: Costs) -> Path:
    """Dijkstra from ``src`` to ``dst``; ties go to fewer steps."""
    _check(src, dst, costs)
    allow_partial = bool(dst.partial)
    heap = [(0.0, 0, 0, src)]
    best: dict[Layout, tuple[float, int]] = {src: (0.0, 0)}
    back: dict[Layout, Step] = {}
    counter = itertools.count(1)
    while heap:
        t, n_steps, _, x = heapq.heappop(heap)
        if (t, n_steps) > best.get(x, (math.inf, 0)):
            continue
        if x == dst:
            steps = []
            while x != src:
                steps.append(back[x])
                x = back[x].src
            return Path(src, dst, tuple(reversed(steps)))
        for s in neighbours(x, costs, full_bytes, allow_partial):
            key = (t + s.time_s, n_steps + 1)
            if key < best.get(s.dst, (math.inf, 0)):
                best[s.dst] = key
                back[s.dst] = s
                heapq.heappush(heap, (key[0], key[1], next(counter), s.dst))
    raise ParsimError(f"no redistribution path from {src.text()} to {dst.text()}")


def step_between(x: Layout, y: Layout, costs: Costs, full_bytes: float, op: str | None = None,
                 axes: tuple[int, ...] | None = None) -> Step:
    """The cheapest single move from x to y (of ``op`` over ``axes`` when given); a ParsimError if there is none."""
    options = [s for s in neighbours(x, costs, full_bytes, allow_partial=True)
               if s.dst == y and op in (None, s.op) and axes in (None, s.axes)]
    if not options:
        raise ParsimError(f"{x.text()} -> {y.text()} (orders {x.shard_order} -> {y.shard_order}"
                          f"{f', {op} over {axes}' if op else ''}) is not one step")
    return min(options, key=lambda s: s.time_s)


def path_of_steps(src: Layout, steps: list[dict], costs: Costs, full_bytes: float) -> Path:
    """Cost a path given as steps {'op', 'mesh_axes', 'dst'} (torch's path) with parsim's edge costs."""
    out, x = [], src
    for s in steps:
        y = layout_from_torch(src.mesh_shape, src.n_dims, s["dst"])
        out.append(step_between(x, y, costs, full_bytes, s["op"], tuple(s["mesh_axes"])))
        x = y
    return Path(src, x, tuple(out))


def prediction_margin(profile: HardwareProfile) -> float:
    """Relative error a predicted difference must exceed to be believed: twice the largest median relative residual
    of the profile's fits of the collectives a redistribution uses [derived from the profile], or 10% [assumed]
    for a profile without fits."""
    ops = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")
    res = [c.rel_residual for c in profile.collectives if c.op in ops and c.rel_residual > 0]
    return 2.0 * max(res) if res else 0.10


def recommend(ours: Path, theirs: Path | None, costs: Costs) -> tuple[Path, str]:
    """parsim's path where it is predicted faster than the alternative (torch's) by more than the prediction
    margin; otherwise the alternative: a difference the model cannot resolve is no reason to leave the default."""
    if theirs is None or theirs.layouts == ours.layouts:
        return ours, "same path" if theirs is not None else "parsim"
    margin = prediction_margin(costs.profile)
    if ours.time_s * (1.0 + margin) < theirs.time_s:
        return ours, f"parsim: predicted {theirs.time_s / ours.time_s:.2f}x faster (margin {margin:.0%})"
    return theirs, f"torch: parsim's path is not predicted faster by more than the margin {margin:.0%}"


def redistribution(mesh: str, shape: str, src: str, dst: str, src_order: str | None, dst_order: str | None,
                   dtype: str, profile: HardwareProfile, ranks_per_node: int | None, flatten: bool = True,
                   torch_planner: Callable[..., list[dict]] | None = None) -> dict:
    """What `parsim redistribute` shows: parsim's path, torch's planner's path (costed by parsim) and the one to
    use. ``torch_planner(mesh_shape, tensor_shape, src, dst)`` gives torch's steps as plain data (the CLI passes
    ``executor.redistribute_torch``'s; this module never imports torch)."""
    from .units import DTYPE_BYTES

    mesh_shape, tensor_shape = mesh_shape_of(mesh), mesh_shape_of(shape)
    if dtype not in DTYPE_BYTES:
        raise ParsimError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    a = parse_layout(src, mesh_shape, len(tensor_shape), src_order)
    b = parse_layout(dst, mesh_shape, len(tensor_shape), dst_order)
    for x in (a, b):
        for d, order in enumerate(x.shard_order):
            ways = math.prod(mesh_shape[m] for m in order)
            if tensor_shape[d] % ways:
                raise ParsimError(f"{x.text()}: dim {d} of size {tensor_shape[d]} does not split evenly over "
                                  f"{ways} ranks")
    costs = Costs(profile, mesh_shape, ranks_per_node or profile.gpus_per_node, flatten=flatten)
    full_bytes = float(math.prod(tensor_shape) * DTYPE_BYTES[dtype])
    ours = plan_path(a, b, full_bytes, costs)
    doc = {"mesh": list(mesh_shape), "shape": list(tensor_shape), "dtype": dtype, "profile": profile.name,
           "ranks_per_node": costs.ranks_per_node, "step_overhead_s": costs.step_overhead_s,
           "src": a.to_dict(), "dst": b.to_dict(), "parsim": ours.to_dict(), "torch": None}
    theirs = None
    if torch_planner is not None:
        theirs = path_of_steps(a, torch_planner(mesh_shape, tensor_shape, a.to_dict(), b.to_dict()), costs,
                               full_bytes)
        doc["torch"] = theirs.to_dict()
    chosen, why = recommend(ours, theirs, costs)
    doc["recommended"] = {"path": "parsim" if chosen is ours else "torch", "why": why,
                          "margin": prediction_margin(profile)}
    return doc


def mesh_shape_of(text: str) -> tuple[int, ...]:
    """``"2x2"`` -> (2, 2)."""
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ParsimError(f"expected sizes like 2x2 or 4096x4096, got {text!r}") from None
    if not shape or any(v < 1 for v in shape):
        raise ParsimError(f"sizes must be positive integers, got {text!r}")
    return shape
