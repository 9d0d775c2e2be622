import json
import subprocess
import sys

import numpy as np
import pytest

from parsim.hardware import busbw_factor, load_profile
from parsim.profiler.fit import fit_collective, fit_throughput


def test_fit_recovers_known_latency_and_bandwidth():
    rng = np.random.default_rng(0)
    s = np.geomspace(1e3, 1e9, 13)
    lat, bw = 25e-6, 180e9
    t = lat + s * busbw_factor("all_reduce", 8) / bw
    t = t * (1 + rng.normal(0, 0.01, size=t.shape))  # 1% noise
    (f,) = fit_collective("all_reduce", 8, 8, s, t)
    assert f.latency_s == pytest.approx(lat, rel=0.05)
    assert f.busbw_bytes_per_s == pytest.approx(bw, rel=0.05)
    assert f.rel_residual < 0.02


def test_fit_splits_small_and_large_messages():
    s = np.geomspace(1e3, 1e9, 19)
    small = 5e-6 + s * (7 / 8) / 20e9
    large = 60e-6 + s * (7 / 8) / 300e9
    t = np.where(s < 1e6, small, large)
    fits = fit_collective("all_gather", 8, 8, s, t)
    assert len(fits) == 2
    lo, hi = fits
    assert hi.min_bytes == pytest.approx(s[s >= 1e6][0])
    assert lo.busbw_bytes_per_s == pytest.approx(20e9, rel=0.05)
    assert hi.busbw_bytes_per_s == pytest.approx(300e9, rel=0.05)


def test_fit_throughput_recovers_rate_and_half_point():
    x = np.geomspace(1e6, 1e12, 10)
    rate, half = 500e12, 3e9
    t = (x + half) / rate
    r, h, res = fit_throughput(x, t)
    assert r == pytest.approx(rate, rel=1e-3) and h == pytest.approx(half, rel=1e-2) and res < 1e-6


def test_committed_cpu_profiles_load_and_are_marked_measured():
    for name in ("cpu-gloo-2", "cpu-gloo-4"):
        hw = load_profile(name)
        assert hw.source == "measured" and hw.provenance["how"].startswith("measured")
        assert hw.collectives and all(c.busbw_bytes_per_s > 0 for c in hw.collectives)
        assert {c.group_size for c in hw.collectives} >= {2}


def test_collective_benchmark_times_the_collective_not_its_buffers(monkeypatch):
    """nccl-tests' way: each point's buffers are made once with known inputs; the timed calls reuse them (no
    torch.full / torch.empty inside the loop, which made gloo's 4 MB all-gather 1.6x slower), and one call on the
    known inputs gives the expected outputs."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from parsim.profiler import collectives as C

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        made = {op: C._op_buffers(op, 4096, 1, 0, None, [0], torch.device("cpu"), torch.float32)
                for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")}

        def no_alloc(*a, **k):
            raise AssertionError("a buffer made inside the timed loop")

        for name in ("full", "empty", "zeros", "arange"):
            monkeypatch.setattr(torch, name, no_alloc)
        for op, (call, check) in made.items():
            call()
            assert check() is None, op
            call()  # timed calls after the check reuse the same buffers
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_collective_benchmark_resumes_instead_of_starting_over(tmp_path):
    """Run a small sweep, then --resume with more ops: earlier samples are kept as they were (not re-measured)."""
    pytest.importorskip("torch")
    out = tmp_path / "c.json"
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
            "parsim.profiler.collectives", "--out", str(out), "--max-bytes", "4096", "--trials", "1"]
    subprocess.run(base + ["--ops", "all_reduce"], check=True, capture_output=True)
    first = json.loads(out.read_text())["samples"]
    assert first and all(s["op"] == "all_reduce" and s["wrong"] == 0 for s in first)
    subprocess.run(base + ["--ops", "all_reduce,all_gather", "--resume"], check=True, capture_output=True)
    second = json.loads(out.read_text())["samples"]
    assert second[: len(first)] == first
    assert {s["op"] for s in second} == {"all_reduce", "all_gather"}


@pytest.mark.slow
def test_two_nodes_profile_collectives_across_nodes(tmp_path):
    """Two `parsim profile` processes as two nodes of 2 ranks (static rendezvous on this host, as under srun):
    groups that cross nodes are measured and fitted by ranks per node; node 0 writes the profile, node 1 nothing."""
    import json
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "parsim", "profile", "--nproc-per-node", "2", "--nnodes", "2", "--master-addr",
            "127.0.0.1", "--master-port", str(port), "--ops", "all_reduce,all_gather", "--max-bytes", "65536",
            "--out", str(tmp_path / "two"), "--json"]
    other = subprocess.Popen(args + ["--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.run(args + ["--node-rank", "0"], capture_output=True, text=True, timeout=600)
    out1, err1 = other.communicate(timeout=120)
    assert first.returncode == 0 and other.returncode == 0, (first.stderr[-2000:], err1[-2000:])
    assert json.loads(out1) == {"node_rank": 1, "profile_written_by": "node 0"}
    d = json.loads((tmp_path / "two.json").read_text())
    assert d["n_nodes"] == 2 and d["gpus_per_node"] == 2
    shapes = {(c["op"], c["group_size"], c["ranks_per_node"]) for c in d["collectives"]}
    assert {("all_reduce", 2, 1), ("all_reduce", 4, 2), ("all_reduce", 2, 2)} <= shapes  # across, both, inside
    assert "measured across 2 nodes" in " ".join(d["assumptions"])


def test_core_sharing_is_measured_and_becomes_the_compute_scale():
    """Ranks sharing cores: the slowdown of a block run by that many single-threaded processes at once (not ranks /
    cores, which misses time slicing and the shared caches), floored at 1; ranks / cores where not measured."""
    import os

    from parsim.profiler.compute import core_sharing_sample
    from parsim.profiler.run import _compute_scale

    s = core_sharing_sample(2, seq_len=32, reps=2, cycles=3)
    assert s["kind"] == "core_sharing" and s["ranks"] == 2 and s["alone_s"] > 0 and s["factor"] > 0
    assert len(s["cycle_factors"]) == 3 and s["factor"] == sorted(s["cycle_factors"])[1]  # the cycles' median
    assert _compute_scale([{**s, "factor": 2.12}], 4) == 2.12
    assert _compute_scale([{**s, "factor": 0.97}], 2) == 1.0
    assert _compute_scale([], 4) == max(1.0, 4 / (os.cpu_count() or 1))
