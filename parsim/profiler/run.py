"""`parsim profile`: measure collectives (torchrun) and compute (this process), fit them, write a profile.

Files: ``profiles/<name>.json`` (the HardwareProfile, source "measured", with provenance) and
``profiles/<name>.samples.csv`` (every raw sample). Work in progress is checkpointed in
``profiles/.<name>.partial/`` after every point; ``--resume`` continues from there instead of starting over.
Everything is written atomically.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..errors import ParsimError
from ..hardware import COLLECTIVE_OPS, EfficiencyCurve, HardwareProfile, Topology, profile_write_dir
from ..jsonio import atomic_write_json, atomic_write_text, check_output_path, read_json
from ..machine import this_machine
from ..procs import check_timeout, run_tree
from .fit import fit_collective, fit_optimizer_step, fit_throughput


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def profile(name: str, nproc_per_node: int, *, resume: bool = False, min_bytes: int = 0, max_bytes: int = 0,
            factor: int = 4, ops: str = ",".join(COLLECTIVE_OPS), model: str | None = "tiny", seq_len: int = 512,
            out_dir: Path | None = None, timeout_s: float = 1800.0, device: str | None = None, quick=False,
            restart: bool = False, log=print, nodes: NodeSpec | None = None,
            interconnect_from: str | None = None) -> HardwareProfile | None:
    """Measure and write a profile. With ``nodes`` (several nodes, one ``parsim profile`` per node, e.g. under
    ``srun``) the collectives run over every node's ranks, so groups that cross nodes are measured and fitted by
    their ranks per node; node 0 then measures compute and writes the profile, the other nodes return None.
    ``interconnect_from`` (a profile's name or path; one rank only): the collectives no single GPU can measure are
    taken from that profile (``with_interconnect``)."""
    from ..hardware import load_profile
    from ..spec import load_model

    spec = load_model(model) if model else None  # refuse a bad model before measuring anything (or importing torch)
    links = None
    if interconnect_from is not None:
        if nproc_per_node != 1 or nodes is not None:
            raise ParsimError("--interconnect-from is for a profile of one rank (one GPU measures no collective); "
                              f"got {nproc_per_node} ranks per node" + (" on several nodes" if nodes else ""))
        links = load_profile(interconnect_from)
    check_profile_args(nproc_per_node, factor=factor, ops=ops, seq_len=seq_len, timeout_s=timeout_s,
                       min_bytes=min_bytes, max_bytes=max_bytes)
    if nodes is not None and nodes.node_rank > 0:
        _profile_other_node(nproc_per_node, nodes, ops, factor, min_bytes, max_bytes, device, timeout_s, log)
        return None
    out_path = resolve_profile_out(name, out_dir)
    name, out_dir = out_path.stem, out_path.parent
    # what earlier samples depend on (more ops or sizes on --resume only add samples; these would mix machines/shapes)
    partial = _partial_dir(out_path, {"nproc_per_node": nproc_per_node, "model": model, "seq_len": seq_len,
                                      "device": device, "nodes": nodes.n_nodes if nodes else 1}, resume, restart)
    import torch

    t0 = time.perf_counter()
    # 1. collectives under torchrun
    coll_f = partial / "collectives.json"
    t_coll = time.perf_counter()
    _run_collectives(coll_f, nproc_per_node, nodes, ops, factor, min_bytes, max_bytes, device, timeout_s, resume)
    coll = read_json(coll_f, "bad collective samples")
    t_coll = time.perf_counter() - t_coll
    # 2. compute in this process
    dev = torch.device("cuda") if torch.cuda.is_available() and device != "cpu" else torch.device("cpu")
    comp = _measured_compute(partial / "compute.json", dev, spec, seq_len, nproc_per_node, nodes, resume, quick,
                             log)
    # 3. framework overhead (FSDP2 / DTensor TP / EP beside their collectives), once per machine: on CPU on the
    # profile's ranks, sharing the cores as its plans' ranks do; on GPUs on 2
    fw_f = partial / "frameworks.json"
    if nproc_per_node >= 2 and nodes is None and not (resume and fw_f.exists()):
        fw_ranks = framework_probe_ranks(dev.type, nproc_per_node)
        log(f"measuring framework overhead (FSDP2, DTensor TP, EP) on {fw_ranks} ranks ...")
        run_framework_probe(fw_f, device, timeout_s, quick=quick, nproc=fw_ranks)
    fw = read_json(fw_f, "bad framework samples") if fw_f.exists() else None
    # 4. fit and write
    hw, fit_rows = build_profile(name, coll, comp, dev, nproc_per_node, cmdline=" ".join(sys.argv),
                                 wall_s=time.perf_counter() - t0, coll_wall_s=t_coll)
    if fw is not None:
        hw = with_framework_samples(hw, fw)
    if links is not None:
        hw = with_interconnect(hw, links)
    hw.save(out_path)
    atomic_write_text(out_dir / f"{name}.samples.csv", samples_csv(coll["samples"], comp["samples"]))
    shutil.rmtree(partial)
    return hw


def _partial_dir(out_path: Path, args: dict, resume: bool, restart: bool) -> Path:
    """The folder an interrupted profile's samples are kept in (``.NAME.partial`` beside the profile), checked:
    the outputs writable, an interrupted one continued only with ``--resume`` and the same ``args`` (discarded
    with ``--restart``)."""
    name, out_dir = out_path.stem, out_path.parent
    check_output_path(out_path)
    check_output_path(out_dir / f"{name}.samples.csv")
    partial = out_dir / f".{name}.partial"
    if restart and partial.exists():
        shutil.rmtree(partial)
    if partial.exists() and not resume:
        raise ParsimError(f"an interrupted profile {name!r} exists in {partial}: pass --resume to continue it, "
                          "or --restart to discard it and start over")
    _check_resume_args(partial / "args.json", args, resume)
    return partial


def _measured_compute(comp_f: Path, dev, spec, seq_len: int, nproc_per_node: int, nodes: NodeSpec | None,
                      resume: bool, quick: bool, log) -> dict:
    """The compute samples (``compute.run_compute``; on a CPU profile of several ranks on one node, the core
    sharing too), measured in this process and checkpointed to ``comp_f`` (read back on ``--resume``)."""
    import torch

    from .compute import core_sharing_sample, run_compute

    if resume and comp_f.exists():
        return read_json(comp_f, "bad compute samples")
    log("measuring compute (GEMM, attention, elementwise, AdamW, one block) ...")
    comp = {"samples": run_compute(dev, spec, seq_len, threads=1 if dev.type == "cpu" else None, quick=quick),
            "threads": torch.get_num_threads()}
    if dev.type == "cpu" and nproc_per_node > 1 and nodes is None:
        log(f"measuring core sharing ({nproc_per_node} single-threaded processes at once) ...")
        comp["samples"].append(core_sharing_sample(nproc_per_node, cycles=3 if quick else 8))
    atomic_write_json(comp_f, comp)
    return comp


@dataclass(frozen=True)
class NodeSpec:
    """One node of a multi-node profile: torchrun's static rendezvous (node 0 hosts global rank 0, which writes
    the samples)."""

    n_nodes: int
    node_rank: int
    master_addr: str
    master_port: int = 29500

    def __post_init__(self):
        if not 2 <= self.n_nodes <= 4096 or not 0 <= self.node_rank < self.n_nodes:
            raise ParsimError(f"--nnodes must be in 2..4096 and --node-rank in 0..nnodes-1, got {self.n_nodes} and "
                              f"{self.node_rank}")
        if not self.master_addr or not 1 <= self.master_port <= 65535:
            raise ParsimError(f"--master-addr HOST and --master-port in 1..65535 needed, got {self.master_addr!r} "
                              f"and {self.master_port}")

    def torchrun_args(self) -> list[str]:
        return [f"--nnodes={self.n_nodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]


def _run_collectives(out: Path, nproc_per_node: int, nodes: NodeSpec | None, ops: str, factor: int, min_bytes: int,
                     max_bytes: int, device: str | None, timeout_s: float, resume: bool = False,
                     echo=sys.stderr.write) -> None:
    """The collective benchmark under torchrun (this node's ranks; every node's with ``nodes``)."""
    args = ["--out", str(out), "--ops", ops, "--factor", str(factor)]
    if min_bytes:
        args += ["--min-bytes", str(min_bytes)]
    if max_bytes:
        args += ["--max-bytes", str(max_bytes)]
    if resume:
        args.append("--resume")
    _torchrun_module("parsim.profiler.collectives", args, nproc_per_node, nodes, device, timeout_s,
                     "collective benchmark failed ({why}); --resume continues: ", echo=echo)


def collective_sweep(out: Path, nproc_per_node: int, timeout_s: float, device: str | None = None) -> dict:
    """The profile's collective sweep once more (every op, the default sizes, this node's ranks), silently: the
    samples document (``samples``, ``wall_s``). ``validate --measure-blocks`` runs it in every round
    (``loop_jobs.measure_collective_round``)."""
    _run_collectives(out, nproc_per_node, None, ",".join(COLLECTIVE_OPS), 4, 0, 0, device, timeout_s, echo=None)
    return read_json(out, "bad collective samples")


def collective_fits(samples: list[dict]) -> list:
    """The fitted curves of collective samples, one set per (op, group size, ranks per node): contiguous and
    strided groups of one size and ranks per node cost the same in the model, so they are fitted together."""
    groups: dict = {}
    for s in samples:
        groups.setdefault((s["op"], s["group_size"], s["ranks_per_node"]), []).append(s)
    fits = []
    for (op, n, rpn), ss in sorted(groups.items()):
        fits += fit_collective(op, n, rpn, [s["buffer_bytes"] for s in ss], [s["time_s"] for s in ss])
    return fits


def _torchrun_module(module: str, args: list[str], nproc_per_node: int, nodes: NodeSpec | None,
                     device: str | None, timeout_s: float, failed: str, echo=None) -> None:
    """``python -m module args`` on ``nproc_per_node`` ranks of this node (every node's with ``nodes``), one
    thread each; a failure raises ``failed`` (with ``{why}``) followed by the tail of the output."""
    where = nodes.torchrun_args() if nodes else ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc_per_node}",
           "-m", module, *args]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if device == "cpu":
        env["PARSIM_DEVICE"] = "cpu"
    code, output = run_tree(cmd, env, timeout_s, echo=echo)  # echo: e.g. the nccl-tests table as it comes
    if code != 0:
        tail = "\n".join(ln for ln in output.splitlines() if not ln.startswith("W1"))[-1500:]
        why = f"timed out after {timeout_s:.0f} s" if code is None else f"exit {code}"
        raise ParsimError(failed.format(why=why) + tail)


def framework_probe_ranks(device_type: str, nproc_per_node: int) -> int:
    """Ranks the framework probe runs on: on CPU the profile's own (its plans' ranks share the cores, and what the
    framework spends beside its collectives then is measured under that sharing: on a 2-core AVX2 EPYC, 4 ranks
    read 59 ms per TP block where 2 ranks x the core-sharing factor gave 50, 9.8 ms per FSDP unit against 5.9,
    and re-scoring stored 4-rank validate runs with the 4-rank probe moved tiny 10.5% / 22.1% -> 9.5% / 17.6%,
    tiny-moe 8.7% / 24.6% -> 7.3% / 20.5%: one probe, bench/reports/local-tier-first-avx2/2026-11-29); on GPUs 2
    (no sharing) [measured]."""
    return max(2, nproc_per_node) if device_type == "cpu" else 2


def run_framework_probe(out: Path, device: str | None, timeout_s: float, quick: bool = False,
                        nproc: int = 2) -> None:
    """``profiler.frameworks`` under torchrun on ``nproc`` ranks of this node: samples to ``out``."""
    _torchrun_module("parsim.profiler.frameworks", ["--out", str(out)] + (["--quick"] if quick else []), nproc,
                     None, device, timeout_s, "framework-overhead probe failed ({why}): ")


def probe_compute_scale(hw: HardwareProfile, probe_ranks: int) -> float:
    """The core-sharing factor the framework probe's ranks ran under: the profile's ``compute_scale`` where the
    probe ran on the profile's ranks, 1 where it ran on no more ranks than cores (2 ranks on 2 cores read
    1.00-1.08), else ranks / cores [derived]."""
    if hw.provenance.get("device", "cpu") != "cpu":
        return 1.0
    if probe_ranks == int(hw.provenance.get("ranks_per_node") or 0):
        return float(hw.corrections.get("compute_scale", 1.0))
    return _ranks_over_cores(probe_ranks)


def with_framework_samples(hw: HardwareProfile, fw: dict) -> HardwareProfile:
    """The profile with the probe's raw samples (``samples.frameworks``) and the quantities fitted from them
    (``corrections``: fsdp_call_*, fsdp_moe_call_*, tp_block_*, ep_block_*, pp_action_*; see
    ``fit.fit_framework_overheads``; the per-reduction ``fsdp_unit_*`` of older profiles are dropped), and
    ``framework_probe_compute_scale``: the core sharing they were measured under (``probe_compute_scale``), which
    the cost model divides out before it applies a plan's own."""
    import dataclasses

    from .fit import fit_framework_overheads

    samples = dict(hw.samples) if isinstance(hw.samples, dict) else {}
    samples["frameworks"] = {"samples": fw["samples"], "torch": fw.get("torch"), "backend": fw.get("backend")}
    ranks = max([int(s.get("world") or 2) for s in fw["samples"]] or [2])
    kept = {k: v for k, v in hw.corrections.items() if not k.startswith("fsdp_unit_")}
    return dataclasses.replace(hw, samples=samples, corrections={
        **kept, **fit_framework_overheads(fw["samples"]),
        "framework_probe_compute_scale": probe_compute_scale(hw, ranks)})


# what a machine's collectives are, as opposed to its compute: taken whole from another profile by
# ``with_interconnect`` (corrections named here are comm-side: the interference of collectives with compute)
INTERCONNECT_CORRECTIONS = ("comm_interference",)


# packaged spec-sheet profiles by the words of torch.cuda.get_device_name() that identify them
SPEC_PROFILE_OF_DEVICE = ((("H100", "HBM3"), "h100-sxm-spec"), (("H200",), "h200-spec"), (("B200",), "b200-spec"),
                          (("A100", "80GB"), "a100-sxm-80gb-spec"))


def spec_profile_of(device_name: str) -> str | None:
    """The packaged spec-sheet profile of a GPU named ``device_name`` (its interconnect: NVLink in 8-GPU nodes,
    InfiniBand across), or None where none matches (an H100 PCIe, say)."""
    return next((prof for words, prof in SPEC_PROFILE_OF_DEVICE if all(w in device_name for w in words)), None)


def with_interconnect(hw: HardwareProfile, other: HardwareProfile) -> HardwareProfile:
    """``hw`` (measured on one GPU, where no collective can run) with ``other``'s interconnect: GPUs per node,
    topology, collective fits and comm-side corrections; compute, memory and measured blocks stay ``hw``'s. The
    assumptions say so: a search over many GPUs then composes measured compute with ``other``'s links (e.g. a
    spec-sheet NVLink/InfiniBand profile of the same GPU) instead of the 1 GB/s placeholder of a profile that
    measured no collective."""
    import dataclasses

    if hw.collectives and hw.gpus_per_node > 1:
        raise ParsimError(f"profile {hw.name!r} measured its own collectives over {hw.gpus_per_node} GPUs: "
                          "keep them rather than borrowing another profile's interconnect")
    comm = {k: v for k, v in other.corrections.items() if k in INTERCONNECT_CORRECTIONS}
    note = (f"interconnect (gpus_per_node {other.gpus_per_node}, topology, {len(other.collectives)} collective "
            f"fits, {', '.join(comm) or 'no'} comm corrections) taken from profile {other.name!r} "
            f"(source {other.source}): one GPU measured no collective")
    return dataclasses.replace(hw, gpus_per_node=other.gpus_per_node, n_nodes=other.n_nodes,
                               topology=other.topology, collectives=other.collectives,
                               comm_overlap=other.comm_overlap, corrections={**hw.corrections, **comm},
                               assumptions=(*hw.assumptions, note),
                               provenance={**hw.provenance, "interconnect_from": other.name})


def add_framework_overheads(path: Path, device: str | None = None, timeout_s: float = 1800.0,
                            quick: bool = False) -> HardwareProfile:
    """Measure the framework overhead here and write it into the existing profile at ``path``."""
    import tempfile

    hw = HardwareProfile.from_dict(read_json(path, "corrupt profile"), origin=str(path))
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "frameworks.json"
        ranks = framework_probe_ranks(str(hw.provenance.get("device", "cpu")).split(":")[0],
                                      int(hw.provenance.get("ranks_per_node") or 2))
        run_framework_probe(f, device, timeout_s, quick=quick, nproc=ranks)
        hw = with_framework_samples(hw, read_json(f, "bad framework samples"))
    hw.save(path)
    return hw


def _profile_other_node(nproc_per_node: int, nodes: NodeSpec, ops: str, factor: int, min_bytes: int,
                        max_bytes: int, device: str | None, timeout_s: float, log) -> None:
    """A node other than 0: its ranks take part in the collectives; node 0 writes the samples and the profile."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _run_collectives(Path(tmp) / "collectives.json", nproc_per_node, nodes, ops, factor, min_bytes, max_bytes,
                         device, timeout_s)
    log(f"node {nodes.node_rank} of {nodes.n_nodes}: collectives done; node 0 writes the profile")


def _check_resume_args(path: Path, args: dict, resume: bool) -> None:
    """A resumed profile keeps the ranks, device, model and sequence its samples were measured with (other
    arguments may change: more ops or sizes add samples); record them on a fresh start."""
    if resume and path.exists():
        old = read_json(path, "corrupt partial profile")
        diff = {k: (old.get(k), v) for k, v in args.items() if old.get(k) != v}
        if diff:
            raise ParsimError("--resume with other arguments than the interrupted profile: "
                              + ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in diff.items())
                              + " (use --restart to start over)")
        return
    path.parent.mkdir(exist_ok=True)
    atomic_write_json(path, args)


def check_profile_args(nproc_per_node: int, *, factor: int, ops: str, seq_len: int, timeout_s: float,
                       min_bytes: int = 0, max_bytes: int = 0) -> None:
    """Refuse bad arguments before anything is measured."""
    if not 1 <= nproc_per_node <= 1024:
        raise ParsimError(f"--nproc-per-node must be in [1, 1024], got {nproc_per_node}")
    if not 2 <= factor <= 1024:
        raise ParsimError(f"--factor must be in [2, 1024], got {factor}")
    unknown = sorted(set(o.strip() for o in ops.split(",")) - set(COLLECTIVE_OPS))
    if unknown or not ops.strip():
        raise ParsimError(f"--ops: unknown collectives {unknown} (known: {', '.join(COLLECTIVE_OPS)})")
    if not (0 <= min_bytes <= 2**36 and 0 <= max_bytes <= 2**36) or (min_bytes and max_bytes and min_bytes > max_bytes):
        raise ParsimError(f"--min-bytes/--max-bytes must be in [0, 2**36] with min <= max, got {min_bytes}, "
                          f"{max_bytes}")
    if not 1 <= seq_len <= 2**20:
        raise ParsimError(f"--seq-len must be in [1, 2**20], got {seq_len}")
    check_timeout(timeout_s)


def resolve_profile_out(out: str, out_dir: str | Path | None) -> Path:
    """``--out NAME`` -> NAME.json in OUT_DIR or the profile write folder (``hardware.profile_write_dir``); a path
    (with a / or ending in .json) is used as it is, anywhere."""
    p = Path(out)
    if "/" in out or out.endswith(".json"):
        if out_dir is not None:
            raise ParsimError("--out is a path: leave out --out-dir")
        p = p if p.suffix == ".json" else p.with_name(p.name + ".json")
    else:
        p = Path(out_dir) / f"{out}.json" if out_dir else profile_write_dir() / f"{out}.json"
        if not out_dir:
            p.parent.mkdir(parents=True, exist_ok=True)  # the user's profile folder, on first use
    if not p.stem or p.stem.startswith("."):
        raise ParsimError(f"bad profile name {p.stem!r}")
    return p


def samples_csv(coll: list[dict], comp: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["kind", "op", "group_size", "group_kind", "ranks_per_node", "bytes", "dtype", "time_s",
                "time_min_s", "time_max_s", "detail"])
    for s in coll:
        w.writerow(["collective", s["op"], s["group_size"], s["group_kind"], s["ranks_per_node"], s["buffer_bytes"],
                    s["dtype"], s["time_s"], s["time_min_s"], s["time_max_s"], f"wrong={s['wrong']}"])
    for s in comp:
        t = s.get("time_s", s.get("time_fwd_s"))
        detail = json.dumps({k: v for k, v in s.items() if k not in ("kind", "time_s")}, separators=(",", ":"))
        w.writerow([s["kind"], "", "", "", "", s.get("bytes", ""), s.get("dtype", ""), t, "", "", detail])
    return buf.getvalue()


def build_profile(name, coll: dict, comp: dict, dev, nproc_per_node: int, cmdline: str = "", wall_s: float = 0.0,
                  coll_wall_s: float = 0.0) -> tuple[HardwareProfile, list]:
    import torch

    samples = coll["samples"]
    if any(s["wrong"] for s in samples):
        bad = sorted({(s["op"], s["group_size"]) for s in samples if s["wrong"]})
        raise ParsimError(f"collectives returned wrong results for {bad}: the profile would lie, not writing it")
    fits = collective_fits(samples)
    cs = comp["samples"]
    main_dtype = "float32" if dev.type == "cpu" else "bfloat16"
    k = _compute_fits(cs, main_dtype)
    world = coll["world_size"]
    n_nodes = max(1, world // max(1, int(coll.get("local_world_size", world))))
    topology, nic_measured = _measured_topology(fits)
    mem_total = _ram_bytes() if dev.type == "cpu" else float(torch.cuda.get_device_properties(0).total_memory)
    per_rank_mem = mem_total / (nproc_per_node if dev.type == "cpu" else 1)
    rows = [(f.op, f.group_size, f.ranks_per_node, f.min_bytes, f.latency_s, f.busbw_bytes_per_s, f.rel_residual,
             f.n_samples) for f in fits]
    f8 = "float8" in k["peak"]
    hw = HardwareProfile(
        name=name, device_name=_cpu_name() if dev.type == "cpu" else torch.cuda.get_device_name(0),
        gpus_per_node=nproc_per_node if dev.type == "cpu" else torch.cuda.device_count(), n_nodes=n_nodes,
        memory_bytes=per_rank_mem, memory_reserved_bytes=min(0.05 * per_rank_mem, 2**30), peak_flops=k["peak"],
        memory_bandwidth_bytes_per_s=k["bw"], gemm_efficiency=EfficiencyCurve(1.0, k["gemm_half"]),
        attention_efficiency=EfficiencyCurve(1.0, k["attention_half"]), memory_efficiency=1.0, **k["a_bwd"],
        float8_gemm_efficiency=EfficiencyCurve(1.0, k["f8_half"]) if f8 else None, topology=topology,
        collectives=tuple(fits), source="measured", comm_overlap=dev.type != "cpu",
        # ranks that share cores get that share of the single-thread compute measured (measured: os.cpu_count())
        corrections={**({"compute_scale": _compute_scale(cs, nproc_per_node)} if dev.type == "cpu" else {}),
                     **fit_optimizer_step(cs)},
        assumptions=_assumptions(dev.type, n_nodes, nic_measured, f8),
        # the raw block sample stays a measurement: the cost model derives the per-layer overhead from it
        samples={"file": f"{name}.samples.csv", "fit_residuals": k["residuals"], **_block_sample(cs)},
        provenance={
            "how": "measured by parsim profile", "command": cmdline, "host": socket.gethostname(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(dev),
            "device_count": world, "ranks_per_node": nproc_per_node, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": coll.get("nccl"), "backend": coll.get("backend"),
            "gloo": "bundled with torch " + torch.__version__ if coll.get("backend") == "gloo" else None,
            "compute_threads": comp.get("threads"), "wall_s": wall_s, "collectives_wall_s": coll_wall_s,
            "python": platform.python_version(),
            "machine": this_machine(torch.cuda.get_device_name(0) if dev.type == "cuda" else None)},
    )
    return hw, rows


def _compute_fits(cs: list[dict], main_dtype: str) -> dict:
    """The compute samples' fits (``fit_throughput``): peak FLOP/s per dtype (the main one, the other of fp32 /
    bf16, float8 where measured), the GEMM, attention and float8 curves' half points, the memory bandwidth, the
    attention backward's ratio to its forward, the fits' residuals."""
    g = [s for s in cs if s["kind"] == "gemm" and s["dtype"] == main_dtype]
    rate, x_half, g_res = fit_throughput([s["flops"] for s in g], [s["time_s"] for s in g])
    other = [s for s in cs if s["kind"] == "gemm" and s["dtype"] in ("float32", "bfloat16")
             and s["dtype"] != main_dtype]
    other_rate = fit_throughput([s["flops"] for s in other], [s["time_s"] for s in other])[0] if other else rate
    f8 = [s for s in cs if s["kind"] == "gemm" and s["dtype"] == "float8_e4m3fn"]  # GPUs with float8 GEMMs only
    f8_rate, f8_half, _ = fit_throughput([s["flops"] for s in f8], [s["time_s"] for s in f8]) if f8 else (0, 0, 0)
    att = [s for s in cs if s["kind"] == "attention"]
    a_rate, a_half, a_res = fit_throughput([s["flops"] for s in att], [s["time_fwd_s"] for s in att])
    # the curve is fitted on forward times: the backward's own ratio, measured (HardwareProfile.attention_bwd_per_fwd;
    # its default where nothing was measured)
    a_bwd = {"attention_bwd_per_fwd": float(statistics.median(s["time_bwd_s"] / s["time_fwd_s"] for s in att))
             } if att else {}
    mem = [s for s in cs if s["kind"] == "elementwise"]
    bw, _, m_res = fit_throughput([s["bytes"] for s in mem], [s["time_s"] for s in mem])
    peak = {main_dtype: rate, ("bfloat16" if main_dtype == "float32" else "float32"): other_rate}
    if f8:
        peak["float8"] = f8_rate
    return {"peak": peak, "gemm_half": x_half, "attention_half": a_half, "f8_half": f8_half, "bw": bw,
            "a_bwd": a_bwd, "residuals": {"gemm": g_res, "attention": a_res, "elementwise": m_res}}


def _measured_topology(fits: list) -> tuple[Topology, bool]:
    """The topology fallback from the collective fits, and whether groups across nodes were measured: the
    intra-node bandwidth of each op from its largest group inside one node; with several nodes the NIC rate per GPU
    from the cross-node fits (busbw = rpn x NIC across nodes, Topology) [measured], else the slowest intra-node
    op's."""
    intra = {}
    for op in COLLECTIVE_OPS:
        cand = [f for f in fits if f.op == op and f.ranks_per_node >= f.group_size]
        if cand:
            best = max(cand, key=lambda f: (f.group_size, f.min_bytes))
            intra[op] = best.busbw_bytes_per_s
    for op in COLLECTIVE_OPS:
        intra.setdefault(op, min(intra.values()) if intra else 1e9)
    lat = [f.latency_s for f in fits if f.min_bytes == 0]
    cross = {}
    for f in fits:
        if f.ranks_per_node < f.group_size and f.busbw_bytes_per_s > 0:
            k = (f.op, f.group_size, f.ranks_per_node)
            if k not in cross or f.min_bytes > cross[k].min_bytes:  # the largest messages' segment
                cross[k] = f
    nic = sorted(f.busbw_bytes_per_s / f.ranks_per_node for f in cross.values())
    nic_rate = nic[len(nic) // 2] if nic else min(intra.values())
    return Topology(intra_node_busbw_bytes_per_s=intra, inter_node_bytes_per_s_per_gpu=nic_rate,
                    intra_latency_s=float(sorted(lat)[len(lat) // 2]) if lat else 1e-4,
                    inter_latency_s=float(max(lat)) if lat else 1e-4, latency_per_log2_rank_s=0.0), bool(nic)


def _assumptions(device_type: str, n_nodes: int, nic_measured: bool, f8: bool) -> tuple[str, ...]:
    cpu = device_type == "cpu"
    return (
        "peak_flops are the sustained throughput fitted on the measured GEMMs (eff_max = 1), not a spec sheet",
        ("inter-node bandwidth measured across %d nodes: the topology fallback's NIC rate is the median of the "
         "cross-node fits' busbw / ranks per node" % n_nodes) if nic_measured else
        "inter-node bandwidth is not measured (one node): the topology fallback uses the slowest intra-node op",
        "compile_memory_bound_factor is not measured" + ("" if f8 else "; float8 GEMMs are not measured (no "
                                                          "GPU with compute capability 8.9+)"),
        "gloo on CPU: collectives block the rank (comm_overlap false); ranks share the cores: "
        "corrections.compute_scale is the measured slowdown of a block run by that many processes at once "
        "(ranks / cores where not measured)",
        ("CPU: compute measured with 1 thread, as each torchrun rank runs (OMP_NUM_THREADS=1); " if cpu else "")
        + "memory_bytes is the device memory per rank" + (" (RAM / ranks)" if cpu else ""),
    )


def _compute_scale(compute_samples: list[dict], nproc_per_node: int) -> float:
    """Ranks sharing this CPU's cores: the measured core-sharing factor (``compute.core_sharing_sample``) where the
    profile has one, else ranks / cores [derived]; at least 1."""
    shared = [s for s in compute_samples if s.get("kind") == "core_sharing"]
    if shared:
        return max(1.0, float(shared[-1]["factor"]))
    return _ranks_over_cores(nproc_per_node)


def _ranks_over_cores(ranks: int) -> float:
    """Single-threaded ranks over this CPU's cores, at least 1: the core sharing where none was measured [derived]."""
    return max(1.0, ranks / (os.cpu_count() or 1))


def _block_sample(compute_samples: list[dict]) -> dict:
    blocks = [{k: v for k, v in x.items() if k != "kind"} for x in compute_samples if x["kind"] == "block"]
    return {"block": blocks[0]} if blocks else {}


def _ram_bytes() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8.0 * 2**30
