"""Torch's side of `parsim redistribute`: the path torch's own planner picks, and running a path step by step.

``torch_path`` asks ``DTensorRedistributePlanner`` (torch >= 2.10; graph-based, the planner DTensor uses for shard
orders other than the default) for its transform list, merged the way ``redistribute_local_tensor`` merges it
(``_optimize_transform_infos``: consecutive same-kind collectives over one flattened mesh where one exists), and
returns the layouts it passes through. It runs on a fake process group (no other process is needed): the planner
only needs a mesh that contains this rank.

Layouts cross the boundary as plain data — placement strings ('R', 'P', 'S(d)') and {tensor dim: mesh axes outer
first} — so this module imports nothing of parsim's core.
"""

from __future__ import annotations

import itertools
import math
import re

import torch
import torch.distributed as dist

_S = re.compile(r"S\((\d+)\)")


def placement_objects(placements: list[str]):
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for p in placements:
        m = _S.fullmatch(p)
        out.append(Shard(int(m.group(1))) if m else Partial() if p == "P" else Replicate())
    return tuple(out)


def spec_of(mesh, placements: list[str], shard_order: dict, shape: tuple[int, ...], dtype=torch.float32):
    """A DTensorSpec with an explicit shard order."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

    t = torch.empty(shape, dtype=dtype, device="meta")
    order = tuple(ShardOrderEntry(tensor_dim=int(d), mesh_dims=tuple(axes))
                  for d, axes in sorted(shard_order.items(), key=lambda kv: int(kv[0])) if axes)
    return DTensorSpec(mesh, placement_objects(placements), TensorMeta(t.shape, t.stride(), dtype),
                       shard_order=order, use_strided_shard_as_shard_order=False)


def fake_mesh(mesh_shape: tuple[int, ...]):
    """A device mesh on a fake process group of prod(mesh_shape) ranks (this process is rank 0), with every
    flattened sub-mesh of ascending axes, so that torch can merge collectives as it would on a real job."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = math.prod(mesh_shape)
    if dist.is_initialized() and dist.get_world_size() != world:
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    names = tuple(f"m{i}" for i in range(len(mesh_shape)))
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    add_flattened(mesh)
    return mesh


def add_flattened(mesh) -> None:
    names = mesh.mesh_dim_names
    for k in range(2, len(names) + 1):
        for combo in itertools.combinations(names, k):
            mesh[combo]._flatten("_".join(combo))


def torch_path(mesh, shape: tuple[int, ...], src: dict, dst: dict) -> list[dict]:
    """Torch's planner's path from ``src`` to ``dst`` (each {'placements', 'shard_order'}): a list of steps
    {'op', 'mesh_axes', 'dst'} after the source, one per collective or local op torch would run (a merged,
    flattened collective is one step over several axes)."""
    import logging

    from torch.distributed.tensor._redistribute import (
        DTensorRedistributePlanner,
        _FlattenedTransformInfo,
        _gen_transform_infos_non_cached,
        _optimize_transform_infos,
        _update_shard_order_and_placements,
    )

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # its "suboptimal" notes
    a = spec_of(mesh, src["placements"], src["shard_order"], shape)
    b = spec_of(mesh, dst["placements"], dst["shard_order"], shape)
    infos = _gen_transform_infos_non_cached(a, b, use_graph_based_transform=True)
    infos = _optimize_transform_infos(infos, mesh, a.placements, b.placements)
    cur = list(a.placements)
    order = DTensorRedistributePlanner._ShardOrder_to_dict(a.shard_order)
    steps = []
    for info in infos:
        axes = list(info.original_mesh_dims) if isinstance(info, _FlattenedTransformInfo) else [info.mesh_dim]
        kind = info._comm_type_key()
        if kind is None:
            kind = "partition" if info.src_dst_placements[1].is_partial() else "chunk"
        _update_shard_order_and_placements(info, cur, order)
        steps.append({"op": kind, "mesh_axes": axes, "dst": _state(cur, order)})
    return steps


def _dst(placements: list[str], order: dict) -> dict:
    """A layout as plain data: placement strings and {tensor dim: mesh axes outer first}."""
    return {"placements": list(placements), "shard_order": {str(d): list(v) for d, v in order.items() if v}}


def _state(placements, order: dict) -> dict:
    from torch.distributed.tensor import Partial, Shard

    return _dst([f"S({p.dim})" if isinstance(p, Shard) else "P" if isinstance(p, Partial) else "R"
                 for p in placements], order)


def step_transforms(mesh, shape: tuple[int, ...], src: dict, op: str, axes: list[int], dst: dict) -> list:
    """The transforms of one step as torch's executor takes them: one per mesh axis, in the order its merge
    expects (all-gathers inner axis first, reduce-scatters outer first), each with the logical shape on its axis
    (the full shape divided by every other axis sharding it; shapes divisible by the mesh in the benchmark)."""
    from torch.distributed.tensor._redistribute import _TransformInfo

    placements = list(src["placements"])
    order = {int(d): list(v) for d, v in src["shard_order"].items()}
    infos = []
    for ax in (list(reversed(axes)) if op == "all_gather" else list(axes)):
        a, b = placements[ax], dst["placements"][ax]
        logical = list(shape)
        for d, mesh_axes in order.items():
            for m in mesh_axes:
                if m != ax:
                    logical[d] //= mesh.size(m)
        pa, pb = placement_objects([a, b])
        infos.append(_TransformInfo(mesh_dim=ax, src_dst_placements=(pa, pb), logical_shape=logical))
        if a.startswith("S"):
            order[int(a[2:-1])].remove(ax)
        if b.startswith("S"):
            order.setdefault(int(b[2:-1]), []).append(ax)
        placements[ax] = b
    if placements != list(dst["placements"]):
        raise ValueError(f"step {op} over {axes} does not lead from {src} to {dst}")
    return infos


def prepare_steps(mesh, shape: tuple[int, ...], src: dict, steps: list[dict], dtype=torch.float32) -> list:
    """(source spec, target spec, transforms) per step, built before anything is timed."""
    out, cur = [], src
    for step in steps:
        infos = step_transforms(mesh, shape, cur, step["op"], step["mesh_axes"], step["dst"])
        out.append((spec_of(mesh, cur["placements"], cur["shard_order"], shape, dtype),
                    spec_of(mesh, step["dst"]["placements"], step["dst"]["shard_order"], shape, dtype), infos))
        cur = step["dst"]
    return out


def run_prepared(local: torch.Tensor, prepared: list) -> torch.Tensor:
    """Execute a path step by step: one ``redistribute_local_tensor`` per step, told exactly which transforms to
    run (torch's planner would re-plan a step: it turns a flattened all-reduce into three ops); a step over
    several axes is merged by torch into one collective over their flattened mesh (``add_flattened``)."""
    import torch.distributed.tensor._redistribute as R

    saved = R._gen_transform_infos
    try:
        for a, b, infos in prepared:
            R._gen_transform_infos = lambda *args, infos=infos, **kw: infos
            local = R.redistribute_local_tensor(local, a, b)
    finally:
        R._gen_transform_infos = saved
    return local


def run_steps(local: torch.Tensor, mesh, shape: tuple[int, ...], src: dict, steps: list[dict]) -> torch.Tensor:
    return run_prepared(local, prepare_steps(mesh, shape, src, steps, local.dtype))


def merged_count(mesh, shape: tuple[int, ...], src: dict, step: dict) -> int:
    """How many ops torch runs for one step given its transforms (1 when a flattened step really merges)."""
    from torch.distributed.tensor._redistribute import _optimize_transform_infos

    ((a, b, infos),) = prepare_steps(mesh, shape, src, [step])
    return len(_optimize_transform_infos(infos, mesh, a.placements, b.placements))


# ---- the benchmark worker (under torchrun) -------------------------------------------------------------------------
def steps_from_replicated(x: dict) -> list[dict]:
    """Local steps from a replicated tensor to layout x: a partition per partial axis, then chunks in order."""
    n = len(x["placements"])
    cur, order, steps = ["R"] * n, {}, []
    for a, p in enumerate(x["placements"]):
        if p == "P":
            cur[a] = "P"
            steps.append({"op": "partition", "mesh_axes": [a], "dst": _dst(cur, order)})
    for d, axes in sorted(x["shard_order"].items(), key=lambda kv: int(kv[0])):
        for a in axes:
            cur[a] = f"S({d})"
            order.setdefault(int(d), []).append(a)
            steps.append({"op": "chunk", "mesh_axes": [a], "dst": _dst(cur, order)})
    return steps


def steps_to_replicated(x: dict) -> list[dict]:
    """Collectives from layout x back to a replicated tensor (all-reduces, then all-gathers inner axis first)."""
    cur, steps = list(x["placements"]), []
    order = {int(d): list(v) for d, v in x["shard_order"].items()}
    for a, p in enumerate(cur):
        if p == "P":
            cur[a] = "R"
            steps.append({"op": "all_reduce", "mesh_axes": [a], "dst": _dst(cur, order)})
    for d in sorted(order):
        while order[d]:
            a = order[d].pop()
            cur[a] = "R"
            steps.append({"op": "all_gather", "mesh_axes": [a], "dst": _dst(cur, order)})
    return steps


def _time_path(local, prepared) -> float:
    import time

    dist.barrier()
    t0 = time.perf_counter()
    run_prepared(local, prepared)
    return time.perf_counter() - t0


def _one_case(case: dict, full, mesh, shape, repeats: int) -> dict:
    """Both paths of one pair: the result checked against the full tensor, then timed (interleaved, the order of
    the two alternating) unless the paths are the same steps."""
    src = case["src"]
    local = run_steps(full, mesh, shape, {"placements": ["R"] * mesh.ndim, "shard_order": {}},
                      steps_from_replicated(src))
    ok, prepared = {}, {}
    for name in ("parsim", "torch"):
        prepared[name] = prepare_steps(mesh, shape, src, case[name], local.dtype)
        out = run_prepared(local, prepared[name])
        back = run_steps(out, mesh, shape, case["dst"], steps_to_replicated(case["dst"]))
        ok[name] = bool(torch.allclose(back, full, rtol=1e-5, atol=1e-5))
    times = {"parsim": [], "torch": []}
    if case["parsim"] != case["torch"]:
        for name in ("parsim", "torch"):  # warm-up
            _time_path(local, prepared[name])
        for r in range(repeats):
            for name in (("parsim", "torch") if r % 2 == 0 else ("torch", "parsim")):
                times[name].append(_time_path(local, prepared[name]))
    return {"ok": ok, "times": times}


def _local_step_s(mesh, shape: tuple[int, ...], dim: int, repeats: int) -> float:
    """Median time of one local redistribute step R -> S(dim) on the last mesh axis of a tensor of ``shape``."""
    import statistics

    last = mesh.ndim - 1
    src = {"placements": ["R"] * mesh.ndim, "shard_order": {}}
    dst = {"placements": ["R"] * last + [f"S({dim})"], "shard_order": {str(dim): [last]}}
    prepared = prepare_steps(mesh, shape, src, [{"op": "chunk", "mesh_axes": [last], "dst": dst}])
    x = torch.randn(shape)
    return statistics.median(_time_path(x, prepared) for _ in range(repeats))


def step_costs(mesh) -> dict:
    """What DTensor costs per step beyond the collective, measured with every rank of the mesh busy:
    ``step_overhead_s`` = a local R -> S step of an 8x8 tensor (spec checks, transform lookup, launch, allocation);
    ``copy_bytes_per_s`` = bytes written per second by R -> S steps of a 2048x2048 float32 tensor (8 MiB out),
    along dim 0 and dim 1 (their mean), after the fixed cost."""
    overhead = _local_step_s(mesh, (8, 8), 0, 200)
    n = mesh.size(mesh.ndim - 1)
    big = (2048, 2048)
    out_bytes = 4 * big[0] * big[1] / n
    rates = [out_bytes / max(_local_step_s(mesh, big, d, 15) - overhead, 1e-9) for d in (0, 1)]
    return {"step_overhead_s": overhead, "copy_bytes_per_s": sum(rates) / len(rates)}


def main(argv=None) -> None:
    """``torchrun --nproc-per-node 4 -m parsim.executor.redistribute_torch --cases C --out O --repeats N``."""
    import argparse
    import json
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    from ..jsonio import atomic_write_json
    from ..procs import die_with_parent

    die_with_parent()
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", help="pairs to run (bench/redistribute_bench.py writes them)")
    ap.add_argument("--mesh", default="2x2", help="with --overhead-only: the mesh to measure on")
    ap.add_argument("--overhead-only", action="store_true", help="measure the per-step overhead only")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cases = {"mesh_shape": [int(v) for v in args.mesh.split("x")], "shape": [8, 8], "pairs": []}
    if not args.overhead_only:
        with open(args.cases) as f:
            cases = json.load(f)
    mesh_shape, shape = tuple(cases["mesh_shape"]), tuple(cases["shape"])
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"m{i}" for i in range(len(mesh_shape))))
    add_flattened(mesh)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    sc = step_costs(mesh)
    # the slowest rank's overhead and copy time
    costs = torch.tensor([sc["step_overhead_s"], 1.0 / sc["copy_bytes_per_s"]], dtype=torch.float64)
    results = [_one_case(c, full, mesh, shape, args.repeats) for c in cases["pairs"]]
    dist.all_reduce(costs, op=dist.ReduceOp.MAX)
    # a path lasts as long as its slowest rank; correct only if correct on every rank
    flat_t = torch.tensor([t for r in results for n in ("parsim", "torch") for t in r["times"][n]], dtype=torch.float64)
    flat_ok = torch.tensor([float(r["ok"][n]) for r in results for n in ("parsim", "torch")])
    dist.all_reduce(flat_t, op=dist.ReduceOp.MAX)
    dist.all_reduce(flat_ok, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        it_t, it_ok = iter(flat_t.tolist()), iter(flat_ok.tolist())
        for r in results:
            for n in ("parsim", "torch"):
                r["times"][n] = [next(it_t) for _ in r["times"][n]]
                r["ok"][n] = bool(next(it_ok))
        atomic_write_json(args.out, {"results": results, "torch": torch.__version__,
                                     "step_overhead_s": costs[0].item(), "copy_bytes_per_s": 1.0 / costs[1].item(),
                                     "world_size": dist.get_world_size(), "threads": torch.get_num_threads()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
