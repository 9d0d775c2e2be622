import json

import numpy as np
import pytest

from parsim.errors import ParsimError
from parsim.hardware import CollectiveFit, HardwareProfile, atomic_write_json, busbw_factor, list_profiles, load_profile


def test_spec_profiles_load_and_say_so():
    for name in ("h100-sxm-spec", "h200-spec", "a100-sxm-80gb-spec", "b200-spec"):
        hw = load_profile(name)
        assert hw.source == "spec-sheet" and hw.gpus_per_node == 8 and hw.assumptions
        assert "not a measurement" in hw.provenance["how"]
    assert set(list_profiles()) >= {"h100-sxm-spec", "h200-spec"}


def test_busbw_factors_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert busbw_factor("reduce_scatter", 2) == pytest.approx(1 / 2)
    assert busbw_factor("send", 2) == 1.0


def test_profile_roundtrip_and_measured_fit_is_used(tmp_path):
    hw = load_profile("h100-sxm-spec")
    d = hw.to_dict()
    d["source"] = "measured"
    d["collectives"] = [{"op": "all_reduce", "group_size": 8, "ranks_per_node": 8, "latency_s": 1e-5,
                         "busbw_bytes_per_s": 100e9}]
    p = HardwareProfile.from_dict(d).save(tmp_path / "m.json")
    hw2 = load_profile(str(p))
    assert hw2.collectives[0].busbw_bytes_per_s == 100e9
    # t = latency + S * 2(n-1)/n / busbw
    assert hw2.collective_time_s("all_reduce", 1e9, 8, 8) == pytest.approx(1e-5 + 1e9 * 1.75 / 100e9)
    # all_gather's buffer is the gathered size: input x n
    t_ag = hw.collective_time_s("all_gather", 1e8, 8, 8)
    topo = hw.topology
    assert t_ag == pytest.approx(topo.intra_latency_s + topo.latency_per_log2_rank_s * 3
                                 + 8e8 * (7 / 8) / topo.intra_node_busbw_bytes_per_s["all_gather"])
    assert np.all(hw.collective_time_s("all_reduce", np.array([1e6, 1e6]), 1, 1) == 0)


def test_cross_node_groups_are_slower():
    hw = load_profile("h100-sxm-spec")
    inside = hw.collective_time_s("all_reduce", 1e9, 8, 8)
    spread = hw.collective_time_s("all_reduce", 1e9, 8, 1)
    assert spread > 5 * inside


def test_corrupt_profile_is_a_clean_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ParsimError, match="corrupt profile"):
        load_profile(str(p))
    p.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ParsimError, match="missing keys"):
        load_profile(str(p))
    with pytest.raises(ParsimError, match="unknown profile"):
        load_profile("no-such-profile")
    with pytest.raises(ParsimError):
        CollectiveFit("all_reduce", 8, 8, 1e-5, -1.0)


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    p = tmp_path / "f.json"
    atomic_write_json(p, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(p, {"a": object()})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [x.name for x in tmp_path.iterdir()] == ["f.json"]


@pytest.mark.parametrize("value", ["\n", "2\r\n", ["a\nb"]])
def test_a_value_with_line_breaks_still_gives_one_line(value):
    """ParsimError is one line whatever a file holds: a schema_version of "\\n" (found by the profile-file fuzz
    under hypothesis 6.170) is shown escaped, in this message and in any other that interpolates a value."""
    d = load_profile("cpu-gloo-2").to_dict()
    d["schema_version"] = value
    with pytest.raises(ParsimError) as e:
        HardwareProfile.from_dict(d)
    assert "\n" not in str(e.value) and "\r" not in str(e.value) and "schema_version" in str(e.value)
    assert "\n" not in str(ParsimError("a\nb")) and str(ParsimError("a\nb")) == "a\\nb"
