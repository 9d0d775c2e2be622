"""The redistribution planner: layouts parse and print in torch's notation; every path it returns, executed on
simulated ranks (numpy), turns the source's blocks into the target's (shard order included); its paths are optimal
against an independent search; torch's planner's path is costed on the same graph; the CLI gives both."""

import itertools
import json
import math

import numpy as np
import pytest

from parsim.errors import ParsimError
from parsim.hardware import load_profile
from parsim.redistribute import (
    Costs,
    Layout,
    _dims,
    all_layouts,
    neighbours,
    parse_layout,
    plan_path,
    recommend,
)

GLOO = load_profile("cpu-gloo-4")
H100 = load_profile("h100-sxm-spec-cal")


# ---- simulated ranks ---------------------------------------------------------------------------------------------
def _coords(mesh):
    return list(itertools.product(*[range(n) for n in mesh]))


def _index(c, axes, mesh):
    """Flattened index of coordinates c over ``axes``, the first outermost."""
    i = 0
    for a in axes:
        i = i * mesh[a] + c[a]
    return i


def _block(full, layout: Layout, c):
    out = full
    for d, order in enumerate(layout.shard_order):
        if order:
            k = math.prod(layout.mesh_shape[a] for a in order)
            out = np.split(out, k, axis=d)[_index(c, order, layout.mesh_shape)]
    return out


def _group(c, axes, mesh):
    """The coordinates of c's group over ``axes``, ordered by their flattened index."""
    out = []
    for vals in itertools.product(*[range(mesh[a]) for a in axes]):
        g = list(c)
        for a, v in zip(axes, vals, strict=True):
            g[a] = v
        out.append(tuple(g))
    return out


def _apply(state: dict, step, mesh) -> dict:
    lost, gained = _dims(step.src, step.dst)
    new = {}
    for c in state:
        group = _group(c, step.axes, mesh)
        me = _index(c, step.axes, mesh)
        if step.op == "all_gather":
            new[c] = np.concatenate([state[g] for g in group], axis=lost)
        elif step.op == "all_to_all":
            whole = np.concatenate([state[g] for g in group], axis=lost)
            new[c] = np.split(whole, len(group), axis=gained)[me]
        elif step.op == "all_reduce":
            new[c] = sum(state[g] for g in group)
        elif step.op == "reduce_scatter":
            new[c] = np.split(sum(state[g] for g in group), len(group), axis=gained)[me]
        elif step.op == "chunk":
            new[c] = np.split(state[c], len(group), axis=gained)[me]
        elif step.op == "partition":
            new[c] = state[c] / len(group)
        else:
            raise AssertionError(step.op)
    return new


def _reduced(state: dict, layout: Layout) -> dict:
    """Sum the partial axes away: what a partial layout stands for."""
    if not layout.partial:
        return state
    return {c: sum(state[g] for g in _group(c, layout.partial, layout.mesh_shape)) for c in state}


def _simulate(full, path) -> dict:
    mesh = path.src.mesh_shape
    state = {c: _block(full, Layout(mesh, path.src.shard_order), c) / (
        math.prod(mesh[a] for a in path.src.partial)) for c in _coords(mesh)}
    for step in path.steps:
        state = _apply(state, step, mesh)
    return state


def _check_path(full, path):
    got = _reduced(_simulate(full, path), path.dst)
    dst = Layout(path.dst.mesh_shape, path.dst.shard_order)
    for c, v in got.items():
        np.testing.assert_allclose(v, _block(full, dst, c), rtol=1e-12, atol=1e-12,
                                   err_msg=f"{path.src.text()} -> {path.dst.text()} at rank {c}")


# ---- tests -------------------------------------------------------------------------------------------------------
def test_layouts_parse_and_print_in_torch_notation():
    x = parse_layout("S(0)[1]S(0)[0]", (2, 2), 2)
    assert x.shard_order == ((1, 0), ()) and x.text() == "S(0)[1]S(0)[0]"
    assert parse_layout("S(0)S(0)", (2, 2), 2, "0:1,0") == x
    assert parse_layout("S(0)S(0)", (2, 2), 2).text() == "S(0)[0]S(0)[1]"
    y = parse_layout("PS(1)R", (2, 2, 2), 2)
    assert y.partial == (0,) and y.shard_order == ((), (1,)) and y.text() == "PS(1)R"
    assert len(all_layouts((2, 2), 2)) == 18  # 16 placements + a second order for S(0)S(0) and S(1)S(1)
    for bad in ("S(0)", "S(2)R", "X(0)R", "S(0)[0]S(0)[0]"):
        with pytest.raises(ParsimError):
            parse_layout(bad, (2, 2), 2)
    with pytest.raises(ParsimError):
        parse_layout("S(0)S(1)", (2, 2), 2, "0:0,1")  # dim 0 is sharded over axis 0 only


@pytest.mark.parametrize("profile", [GLOO, H100], ids=["cpu-gloo-4", "h100"])
def test_every_path_on_a_2x2_mesh_moves_the_right_blocks(profile):
    """All 306 pairs of 2-D layouts (both shard orders): the path, run on 4 simulated ranks, leaves every rank
    with the target's block (partial layouts: after summing their partial axes)."""
    costs = Costs(profile, (2, 2), 4)
    full = np.arange(64.0).reshape(8, 8)
    for a, b in itertools.permutations(all_layouts((2, 2), 2), 2):
        _check_path(full, plan_path(a, b, full.nbytes, costs))


def test_paths_on_a_2x2x2_mesh_respect_the_shard_order():
    costs = Costs(H100, (2, 2, 2), 4)
    full = np.arange(256.0).reshape(16, 16)
    layouts = all_layouts((2, 2, 2), 2, with_partial=False)
    rng = np.random.default_rng(0)
    for i in rng.choice(len(layouts) ** 2, 200, replace=False):
        a, b = layouts[i // len(layouts)], layouts[i % len(layouts)]
        _check_path(full, plan_path(a, b, full.nbytes, costs))
    # the same placements in another order are a different layout, and reaching it takes collectives
    a = parse_layout("S(0)S(0)S(0)", (2, 2, 2), 2)
    b = parse_layout("S(0)S(0)S(0)", (2, 2, 2), 2, "0:2,0,1")
    p = plan_path(a, b, full.nbytes, costs)
    assert any(s.op in ("all_gather", "all_to_all") for s in p.steps)
    _check_path(full, p)


def _bellman_ford(src, costs, full_bytes, allow_partial):
    """Cheapest time to every layout reachable from src, by relaxing every edge until nothing changes."""
    best = {src: 0.0}
    changed = True
    while changed:
        changed = False
        for x, t in list(best.items()):
            for s in neighbours(x, costs, full_bytes, allow_partial):
                if t + s.time_s < best.get(s.dst, math.inf) - 1e-15:
                    best[s.dst] = t + s.time_s
                    changed = True
    return best


@pytest.mark.parametrize("profile", [GLOO, H100], ids=["cpu-gloo-4", "h100"])
def test_paths_are_optimal_against_an_exhaustive_search(profile):
    costs = Costs(profile, (2, 2), 2)  # 2 ranks per node: axis-0 groups cross nodes
    full_bytes = 2.0 * 4096 * 4096
    layouts = all_layouts((2, 2), 2)
    for a in layouts:
        for allow_partial in (False, True):
            best = _bellman_ford(a, costs, full_bytes, allow_partial)
            for b in layouts:
                if b == a or bool(b.partial) != allow_partial:
                    continue
                p = plan_path(a, b, full_bytes, costs)
                assert p.time_s == pytest.approx(best[b], rel=1e-9), (a.text(), b.text())
                assert sum(s.time_s for s in p.steps) == pytest.approx(p.time_s)


def test_flattened_collectives_only_where_dtensor_can_run_them():
    costs = Costs(GLOO, (2, 2), 4)
    full = np.zeros((4096, 4096), dtype=np.float32)  # large enough for the group-of-4 bandwidth to pay off here
    ascending = plan_path(parse_layout("S(0)S(0)", (2, 2), 2), parse_layout("RR", (2, 2), 2), full.nbytes, costs)
    assert [(s.op, s.axes) for s in ascending.steps] == [("all_gather", (0, 1))]
    # order (1, 0): one all-gather over the flattened (0, 1) group would concatenate the chunks in the wrong order
    x = parse_layout("S(0)[1]S(0)[0]", (2, 2), 2)
    assert not any(s.op == "all_gather" and len(s.axes) > 1 for s in neighbours(x, costs, full.nbytes, False))
    flat_off = Costs(GLOO, (2, 2), 4, flatten=False)
    p = plan_path(parse_layout("S(0)S(0)", (2, 2), 2), parse_layout("RR", (2, 2), 2), full.nbytes, flat_off)
    assert [(s.op, s.axes) for s in p.steps] == [("all_gather", (1,)), ("all_gather", (0,))]


def test_costs_follow_the_profile_group_and_bytes():
    costs = Costs(H100, (4, 8), 8)
    assert costs.group((1,)) == (8, 8) and costs.group((0,)) == (4, 1) and costs.group((0, 1)) == (32, 8)
    inner = costs.time_s("all_gather", (1,), 1e8, (0, 0))
    outer = costs.time_s("all_gather", (0,), 1e8, (0, 0))
    assert outer > inner  # the outer axis crosses nodes
    assert costs.time_s("all_gather", (1,), 2e8, (0, 0)) > inner
    assert costs.time_s("all_gather", (1,), 1e8, (1, 1)) > inner  # concatenation along dim 1 copies
    assert Costs(GLOO, (2, 2), 4).a2a_as_all_gather and not costs.a2a_as_all_gather


def test_recommendation_needs_a_predicted_gain_beyond_the_margin():
    from dataclasses import replace

    from parsim.redistribute import Path, step_between

    costs = Costs(GLOO, (2, 2), 4)
    a, b = parse_layout("S(0)R", (2, 2), 2), parse_layout("RR", (2, 2), 2)
    ours = plan_path(a, b, 4.0 * 2**20, costs)
    assert recommend(ours, ours, costs)[1] == "same path"
    alt = Path(a, b, (step_between(a, b, costs, 4.0 * 2**20),))  # one all-gather
    if alt.layouts == ours.layouts:
        mid = parse_layout("S(0)S(0)", (2, 2), 2)
        alt = Path(a, b, (step_between(a, mid, costs, 4.0 * 2**20), step_between(mid, b, costs, 4.0 * 2**20)))
    assert alt.layouts != ours.layouts

    def scaled(path, total_s):
        f = total_s / path.time_s
        return replace(path, steps=tuple(replace(s, time_s=s.time_s * f) for s in path.steps))

    assert recommend(ours, scaled(alt, 1.1 * ours.time_s), costs)[0].layouts == alt.layouts  # inside the 25% margin
    assert recommend(ours, scaled(alt, 2.0 * ours.time_s), costs)[0] is ours


def test_torch_planner_paths_are_costed_on_the_same_graph():
    """torch's planner (torch 2.13, fake process group) gives a path for every pair; each of its steps is a move of
    parsim's graph, so parsim can cost it; parsim's path is never predicted slower than it."""
    pytest.importorskip("torch")
    from parsim.executor.redistribute_torch import fake_mesh, torch_path
    from parsim.redistribute import path_of_steps

    mesh = fake_mesh((2, 2))
    costs = Costs(GLOO, (2, 2), 4)
    full = np.arange(64.0 * 64).reshape(64, 64)
    for a, b in itertools.permutations(all_layouts((2, 2), 2), 2):
        theirs = path_of_steps(a, torch_path(mesh, (64, 64), a.to_dict(), b.to_dict()), costs, full.nbytes)
        assert theirs.dst == b
        _check_path(full, theirs)  # torch's path moves the right blocks in the simulation too
        assert plan_path(a, b, full.nbytes, costs).time_s <= theirs.time_s * (1 + 1e-9)


def test_cli_redistribute_json():
    from typer.testing import CliRunner

    from parsim.cli.main import app

    r = CliRunner().invoke(app, ["redistribute", "--mesh", "2x2", "--shape", "4096x4096", "--src", "S(0)S(1)",
                                 "--dst", "S(1)S(1)", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["parsim"]["steps"] and doc["parsim"]["time_s"] > 0
    assert doc["torch"]["time_s"] >= doc["parsim"]["time_s"] and doc["torch"]["steps"]
    assert doc["dst"]["text"] == "S(1)[0]S(1)[1]" and doc["recommended"]["path"] in ("parsim", "torch")
    r = CliRunner().invoke(app, ["redistribute", "--mesh", "2x2", "--shape", "4096x4096", "--src", "S(0)S(1)",
                                 "--dst", "S(1)", "--no-torch"])
    assert r.exit_code == 2 and r.stderr.startswith("error:") and "2-D mesh" in r.stderr
