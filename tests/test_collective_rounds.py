"""The collectives swept in every validate round and the profile's curves refitted to each point's median
(``parsim.collective_rounds``)."""

import dataclasses
import json

import pytest

from parsim import validate as V
from parsim.collective_rounds import (
    measure_collective_round,
    median_samples,
    profile_sweep_samples,
    read_collective_rounds,
    with_round_collectives,
)
from parsim.hardware import load_profile
from parsim.results import Measurement
from parsim.spec import PRESETS


def _scaled(samples: list[dict], x: float) -> list[dict]:
    return [{**s, "time_s": s["time_s"] * x} for s in samples]


def test_median_samples_takes_each_points_median_over_the_sweeps():
    a = [{"op": "all_gather", "group_size": 2, "group_kind": "contiguous", "ranks_per_node": 2,
          "buffer_bytes": b, "time_s": 1e-3 + b * 1e-9} for b in (1024, 4096)]
    med = median_samples([a, _scaled(a, 3.0), _scaled(a, 1.5)])
    assert [m["time_s"] for m in med] == pytest.approx([1.5 * s["time_s"] for s in a])
    assert {m["sweeps"] for m in med} == {3}


def test_one_slow_sweep_does_not_move_the_refitted_curves(tmp_path, monkeypatch):
    """The committed 2-rank profile's own sweep (its samples CSV) and two rounds, one of them 3x slower: the median
    is the profile's sweep, so the refit gives the profile's own curves; with two more rounds at 1.2x the curves
    sit at 1.2x. Fits no sweep measured are kept."""
    monkeypatch.setenv("PARSIM_PROFILES_DIR", str(tmp_path / "profiles"))
    hw = load_profile("cpu-gloo-2")
    own = profile_sweep_samples(hw)
    assert own and {s["group_size"] for s in own} == {2}
    out = tmp_path / "v"
    assert with_round_collectives(hw, out, 2) is hw  # no round swept: the profile as it is
    V.append_line(out / "collectives.jsonl", {"round": 0, "nproc": 2, "wall_s": 1.0, "samples": _scaled(own, 1.0)})
    V.append_line(out / "collectives.jsonl", {"round": 1, "nproc": 2, "wall_s": 1.0, "samples": _scaled(own, 3.0)})
    V.append_line(out / "collectives.jsonl", {"round": 0, "nproc": 4, "wall_s": 1.0, "samples": []})
    assert len(read_collective_rounds(out, 2)) == 2
    ref = with_round_collectives(hw, out, 2)
    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for b in (4e3, 1e6, 8e6):
            assert ref.collective_time_s(op, b, 2, 2) == pytest.approx(hw.collective_time_s(op, b, 2, 2), rel=1e-6)
    assert "2 validate rounds" in ref.provenance["collectives_from"]
    for r in (2, 3):  # x1, x1, x3, x1.2, x1.2: the median is x1.2
        V.append_line(out / "collectives.jsonl", {"round": r, "nproc": 2, "wall_s": 1.0, "samples": _scaled(own, 1.2)})
    slower = with_round_collectives(hw, out, 2)
    for b in (4e3, 1e6, 8e6):
        assert slower.collective_time_s("all_gather", b, 2, 2) == pytest.approx(
            1.2 * hw.collective_time_s("all_gather", b, 2, 2), rel=1e-6)
    # groups of 4 are not in the 2-rank sweeps: their fits are the 4-rank profile's own sweep's, however many
    # 2-rank rounds ran (refitted from that sweep alone, as without rounds)
    far = load_profile("cpu-gloo-4")
    mixed, own_only = with_round_collectives(far, out, 2), with_round_collectives(far, out, 2, rounds=False)
    four = sorted((c for c in own_only.collectives if c.group_size == 4), key=lambda c: (c.op, c.ranks_per_node))
    assert four and four == sorted((c for c in mixed.collectives if c.group_size == 4),
                                   key=lambda c: (c.op, c.ranks_per_node))


def test_validate_sweeps_the_collectives_once_per_round_and_predicts_with_their_median(tmp_path, monkeypatch):
    """``validate --measure-blocks``'s rounds sweep the collectives (faked: the profile's own sweep x1, x3, x2 by
    round), once per round even when resumed; the summary predicts with the median (x2 beside the profile's x1:
    the median of 1, 1, 3, 2 is 1.5) and the profile written keeps those curves."""
    import parsim.executor.launch as launch
    import parsim.profiler.blocks as blocks
    import parsim.profiler.run as prun
    from parsim.loop_jobs import _measured_shapes, measure_block_round, measured_summary

    monkeypatch.setenv("PARSIM_PROFILES_DIR", str(tmp_path / "profiles"))

    def fake_run(model, plan, nproc, **kw):
        t = 0.1 + int(plan.plan_id[:4], 16) % 100 / 1000
        return Measurement(plan_id=plan.plan_id, kind="run", status="ok", step_times_s=(t,), median_step_time_s=t,
                           peak_memory_bytes=1e6)

    monkeypatch.setattr(launch, "run_plan", fake_run)
    monkeypatch.setattr(blocks, "measure_block", lambda shape, device=None, reps=5: {
        "fwd_s": 1e-3, "bwd_s": 2e-3, "wall_s": 0.01, "device": "fake"})
    monkeypatch.setattr(blocks, "measure_head", lambda shape, device=None, reps=5: {
        "emb_fwd_s": 1e-4, "emb_bwd_s": 1e-4, "out_fwd_s": 1e-4, "out_bwd_s": 2e-4, "wall_s": 0.01, "device": "fake"})
    hw = load_profile("cpu-gloo-2")
    own = profile_sweep_samples(hw)
    drift = {"x": 1.0}
    swept = []

    def fake_sweep(path, nproc, timeout_s, device=None):
        swept.append(nproc)
        return {"samples": _scaled(own, drift["x"]), "wall_s": 5.0}

    monkeypatch.setattr(prun, "collective_sweep", fake_sweep)
    plans = [p for p in V.measured_plans(PRESETS["tiny"], 2) if p.cp == 1 and p.dp_shard == 2][:3]
    shapes = _measured_shapes([(PRESETS["tiny"], p) for p in plans])
    out = tmp_path / "v"

    def before(r):
        drift["x"] = (1.0, 3.0, 2.0)[r]
        measure_collective_round(out, r, 2)
        measure_block_round(out, r, shapes)

    V.run_measured("tiny", 2, out, rounds=3, plans=plans, before_round=before)
    V.run_measured("tiny", 2, out, rounds=3, plans=plans, before_round=before)
    assert swept == [2, 2, 2]  # resumed: no round swept twice
    s = measured_summary(out, "cpu-gloo-2", hw, measure_blocks=True)
    assert s["collective_rounds"] == {"sweeps": 3, "measurement_wall_s": 15.0}
    kept = load_profile(str(tmp_path / "profiles" / "cpu-gloo-2.json"))
    for b in (4e3, 1e6):
        assert kept.collective_time_s("reduce_scatter", b, 2, 2) == pytest.approx(
            1.5 * hw.collective_time_s("reduce_scatter", b, 2, 2), rel=1e-6)
    written = json.loads((out / "rows.json").read_text())  # the summary's rows: predicted with those curves
    again = V.measured_rows(V.load_measurements(out / "measurements.jsonl"), kept)
    assert [r["predicted_step_s"] for r in written] == pytest.approx([r["predicted_step_s"] for r in again])
    plain = V.measured_rows(V.load_measurements(out / "measurements.jsonl"),
                            dataclasses.replace(kept, collectives=hw.collectives))
    # FSDP plans: their collectives 1.5x the profile's
    assert all(a["predicted_step_s"] > b["predicted_step_s"] for a, b in zip(again, plain, strict=True))
