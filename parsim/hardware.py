"""HardwareProfile: what parsim knows about a machine: compute curves, collective curves, topology, memory.

Collective time follows the nccl-tests conventions (NVIDIA/nccl-tests doc/PERFORMANCE.md): for a buffer of S bytes
(all_gather / reduce_scatter: the whole gathered buffer, per-rank count x n), ``algbw = S / t`` and
``busbw = algbw * factor(op, n)`` with factor all_reduce 2(n-1)/n, all_gather / reduce_scatter / all_to_all (n-1)/n,
broadcast and send 1. A collective is therefore modelled as ``t = latency + S * factor / busbw``.

parsim's ``comm_bytes`` convention is the bytes of the input tensors that one rank hands to the collective. Hence
S = input * n for all_gather (its input is one shard), S = input otherwise.

When no measured curve covers a (op, group size, ranks per node) the ``Topology`` fallback gives busbw:
the group's intra-node bandwidth when the group fits in one node, else ``min(intra, ranks_per_node * nic)``: a
ring that crosses nodes runs one channel per NIC, and every GPU has its own NIC (rail-optimized fabric); the
busiest link is then the NIC unless enough of the group's ranks share a node to use all NICs in parallel.
all_to_all across nodes sends (n - rpn)/n of its buffer over the NIC and (rpn-1)/n over NVLink, in parallel.
"""

from __future__ import annotations

import importlib.resources
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import numpy as np

from .errors import ParsimError, check_number
from .jsonio import atomic_write_json, exists, read_json, short_path  # noqa: F401 (atomic_write_json re-exported)
from .vocab import Op

SCHEMA_VERSION = 1
COLLECTIVE_OPS = tuple(o.value for o in Op)  # (plain words: profiles and the profiler's CLI carry them)
# the profiles shipped with parsim: package data of parsim.profiles (the repository's profiles/ folder)
PACKAGED_PROFILES_DIR = Path(str(importlib.resources.files("parsim.profiles")))
# Interval half-widths (log of the ratio) of profiles no calibration has sized, 90% split-conformal quantiles of
# |log(predicted / measured)| of the uncalibrated model:
UNCALIBRATED_LOG_HALFWIDTH = {
    # [measured] 104 scored rows of bench/published/dev.csv with the spec-sheet profiles (q = 0.561, x/÷ 1.75),
    # `parsim validate --published bench/published/dev.csv`, 2026-11-22; rounded up
    "spec-sheet": 0.6,
    # [measured] 39 plans of the CPU tier before calibration (q = 0.273, x/÷ 1.31; tiny / tiny-moe on 2 and 4 gloo
    # ranks, 3 interleaved rounds, bench/reports/validate-cpu/2026-11-28), 2026-11-22; rounded up
    "measured": 0.3,
}


def busbw_factor(op: str, n):
    """nccl-tests bus-bandwidth factor (doc/PERFORMANCE.md). Works on scalars and numpy arrays."""
    n = np.asarray(n, dtype=float)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "send", "reduce"):
        return np.ones_like(n)
    raise ParsimError(f"unknown collective {op!r}")


def buffer_bytes(op: str, input_bytes, n):
    """nccl-tests buffer size S from the per-rank input bytes (parsim's comm_bytes convention)."""
    return input_bytes * n if op == "all_gather" else input_bytes


def _check_rates(where: str, d, required: tuple = ()) -> None:
    """A dict of name -> finite rate of at least 1 per second (peak FLOP/s, bandwidths)."""
    if not isinstance(d, dict):
        raise ParsimError(f"{where} must be an object of name: value, got {d!r}")
    for k, v in d.items():
        check_number(f"{where}.{k}", v, 1.0)
    missing = [k for k in required if k not in d]
    if missing:
        raise ParsimError(f"{where} lacks {missing}")


@dataclass(frozen=True)
class EfficiencyCurve:
    """Achieved fraction of peak as a saturating function of work: ``eff(x) = eff_max * x / (x + x_half)``.

    x is FLOPs for GEMM/attention. The form is the standard "latency + throughput" roofline: a kernel of x FLOPs
    takes ``x / (eff_max * peak) + x_half / (eff_max * peak)`` seconds, i.e. a fixed overhead plus a rate."""

    eff_max: float
    x_half: float

    def __post_init__(self):
        check_number("efficiency curve eff_max", self.eff_max, 0.0, 1.0, low_open=True)
        check_number("efficiency curve x_half", self.x_half, 0.0)

    def __call__(self, x):
        x = np.asarray(x, dtype=float)
        return self.eff_max * x / (x + self.x_half + 1e-300)

    def time_s(self, x, peak_flops):
        """Time of work x at this efficiency: x / (eff(x) * peak) = (x + x_half) / (eff_max * peak)."""
        return (np.asarray(x, dtype=float) + self.x_half) / (self.eff_max * peak_flops) * (np.asarray(x) > 0)


@dataclass(frozen=True)
class CollectiveFit:
    """A fitted curve ``t = latency_s + S * factor / busbw`` for one (op, group size, ranks per node), valid for
    buffers of at least ``min_bytes`` (a profile may hold a small-message and a large-message segment)."""

    op: str
    group_size: int
    ranks_per_node: int
    latency_s: float
    busbw_bytes_per_s: float
    min_bytes: float = 0.0
    rel_residual: float = 0.0  # median |t_fit - t_measured| / t_measured over the fitted samples
    n_samples: int = 0

    def __post_init__(self):
        if self.op not in COLLECTIVE_OPS:
            raise ParsimError(f"collective fit: unknown op {self.op!r}")
        w = f"collective fit {self.op}"
        check_number(f"{w} group_size", self.group_size, 1, 2**20, integer=True)
        check_number(f"{w} ranks_per_node", self.ranks_per_node, 1, 2**20, integer=True)
        check_number(f"{w} latency_s", self.latency_s, 0.0, 3600.0)
        check_number(f"{w} busbw_bytes_per_s", self.busbw_bytes_per_s, 1.0)
        check_number(f"{w} min_bytes", self.min_bytes, 0.0)
        check_number(f"{w} rel_residual", self.rel_residual, 0.0)
        check_number(f"{w} n_samples", self.n_samples, 0, integer=True)


@dataclass(frozen=True)
class Topology:
    """Interconnect model used where no measured collective curve applies (see the module docstring)."""

    intra_node_busbw_bytes_per_s: dict  # op -> achieved busbw inside a node
    inter_node_bytes_per_s_per_gpu: float  # achieved per-direction NIC bandwidth per GPU
    intra_latency_s: float
    inter_latency_s: float
    latency_per_log2_rank_s: float

    def __post_init__(self):
        _check_rates("topology.intra_node_busbw_bytes_per_s", self.intra_node_busbw_bytes_per_s, COLLECTIVE_OPS)
        check_number("topology.inter_node_bytes_per_s_per_gpu", self.inter_node_bytes_per_s_per_gpu, 1.0)
        for n in ("intra_latency_s", "inter_latency_s", "latency_per_log2_rank_s"):
            check_number(f"topology.{n}", getattr(self, n), 0.0, 3600.0)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device_name: str
    gpus_per_node: int
    n_nodes: int  # nodes the profile was measured on (its collective fits cover groups within them)
    memory_bytes: float  # capacity per device
    memory_reserved_bytes: float  # not available to tensors: CUDA context, NCCL buffers, workspaces, fragmentation
    peak_flops: dict  # dtype -> dense FLOP/s
    memory_bandwidth_bytes_per_s: float
    gemm_efficiency: EfficiencyCurve
    attention_efficiency: EfficiencyCurve
    memory_efficiency: float  # achieved fraction of memory bandwidth for elementwise / norm kernels
    topology: Topology
    collectives: tuple = ()  # CollectiveFit, measured
    float8_gemm_efficiency: EfficiencyCurve | None = None
    # attention efficiency as a function of the keys each query attends to in one kernel (x = keys, not FLOPs):
    # FlashAttention's throughput grows with sequence length at any batch (public kernel benchmarks); when set it is
    # used instead of ``attention_efficiency`` (which stays the FLOP-indexed curve a profiler fits)
    attention_keys_efficiency: EfficiencyCurve | None = None
    # Transformer Engine's attention (Megatron-Core layers, ``te_layers``) over the FlashAttention-2 kernel the
    # attention curves describe, at the same shape: on Hopper TE runs cuDNN's fused attention (its backend
    # selection disables FlashAttention "to give FusedAttention preference on Hopper+ for performance reasons",
    # transformer_engine/pytorch/attention/dot_product_attention/utils.py), which the FlashAttention-3 paper
    # (arXiv 2407.08608, H100 SXM5, head dim 128) measures at 1.58-1.65x FA2 in the causal forward and 1.57-1.63x in
    # the backward from 1k to 16k keys. 1.0 where TE runs flash-attn too (before Hopper) or no figure is known.
    fused_attention_speedup: float = 1.0
    # attention backward time per forward time at the attention curves' efficiency. 2.5, FlashAttention-2's FLOP
    # ratio (5 matmuls to 2: Dao 2023, arXiv:2307.08691), where the curve is the kernel's forward + backward
    # throughput (the spec sheets' published FA2 figures); a profiler fits its curve on forward times and keeps the
    # median measured ratio here: torch's SDPA (flash), causal, bf16, 4096 / 8192 tokens: 2.96 / 2.98 on one H200,
    # 3.06 / 3.05 on one H100; the CPU profiles' math SDPA 2.78-2.92 [measured]
    attention_bwd_per_fwd: float = 2.5
    compile_memory_bound_factor: float = 0.5  # memory-bound time with torch.compile (fusion), fraction of eager
    comm_overlap: bool = True  # collectives run beside compute (NCCL streams); gloo on CPU blocks the rank
    samples: dict = field(default_factory=dict)  # raw measurements (or a path to them), kept for refits
    corrections: dict = field(default_factory=dict)  # multiplicative corrections fitted by calibrate
    # blocks measured at plans' local shapes (parsim.profiler.blocks): BlockShape.key -> {fwd_s, bwd_s, spreads,
    # reps, device, torch, measured_at}, and the model's ends: HeadShape.key ("head|...") -> {emb_fwd_s, emb_bwd_s,
    # out_fwd_s, out_bwd_s, ...}; the cost model uses one where a plan's shape has one (parsim.blockshape)
    measured_blocks: dict = field(default_factory=dict)
    # written by `parsim calibrate`: interval_log_halfwidth (the split-conformal q of its out-of-fold residuals),
    # the fitted factors, their cross-validated accuracy and the data used
    calibration: dict = field(default_factory=dict)
    source: str = "spec-sheet"  # spec-sheet | measured
    assumptions: tuple = ()
    provenance: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        if self.schema_version != SCHEMA_VERSION:
            raise ParsimError(f"profile {self.name}: schema_version {self.schema_version!r}, expected {SCHEMA_VERSION}")
        self._check_values()
        object.__setattr__(self, "collectives", tuple(self.collectives))
        object.__setattr__(self, "assumptions", tuple(self.assumptions))
        index = {}
        for c in self.collectives:
            index.setdefault((c.op, c.group_size, c.ranks_per_node), []).append(c)
        for v in index.values():
            v.sort(key=lambda c: c.min_bytes)
        object.__setattr__(self, "_index", index)

    def _check_values(self) -> None:
        """Types, finiteness and ranges of every field: a corrupt profile must not turn into silent nonsense
        (a negative bandwidth that removes communication, a NaN peak, 1.5 GPUs per node)."""
        for n in ("name", "device_name"):
            if not isinstance(getattr(self, n), str):
                raise ParsimError(f"profile {n} must be a string, got {getattr(self, n)!r}")
        if self.source not in ("spec-sheet", "measured"):
            raise ParsimError(f"source must be spec-sheet or measured, got {self.source!r}")
        check_number("gpus_per_node", self.gpus_per_node, 1, 1024, integer=True)
        check_number("n_nodes", self.n_nodes, 1, 2**20, integer=True)
        check_number("memory_bytes", self.memory_bytes, 0.0, 2.0**50, low_open=True)
        check_number("memory_reserved_bytes", self.memory_reserved_bytes, 0.0, 2.0**50)
        if self.memory_bytes <= self.memory_reserved_bytes:
            raise ParsimError("memory_bytes must exceed memory_reserved_bytes")
        _check_rates("peak_flops", self.peak_flops, ("bfloat16",))
        check_number("memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s, 1.0)
        check_number("memory_efficiency", self.memory_efficiency, 0.0, 1.0, low_open=True)
        check_number("compile_memory_bound_factor", self.compile_memory_bound_factor, 0.0, 1.0, low_open=True)
        check_number("fused_attention_speedup", self.fused_attention_speedup, 1.0, 10.0)
        check_number("attention_bwd_per_fwd", self.attention_bwd_per_fwd, 1.0, 20.0)
        if not isinstance(self.comm_overlap, bool):
            raise ParsimError(f"comm_overlap must be true or false, got {self.comm_overlap!r}")
        for n, kind in (("gemm_efficiency", EfficiencyCurve), ("attention_efficiency", EfficiencyCurve),
                        ("topology", Topology)):
            if not isinstance(getattr(self, n), kind):
                raise ParsimError(f"{n} must be an object of its fields")
        if not isinstance(self.corrections, dict):
            raise ParsimError(f"corrections must be an object, got {self.corrections!r}")
        for k, v in self.corrections.items():
            check_number(f"corrections.{k}", v, 0.0, 1e15 if k.endswith("_per_s") else 1e6,
                         low_open=k.endswith(("_scale", "_per_s")))
        if not isinstance(self.calibration, dict):
            raise ParsimError(f"calibration must be an object, got {self.calibration!r}")
        if not isinstance(self.measured_blocks, dict):
            raise ParsimError(f"measured_blocks must be an object, got {self.measured_blocks!r}")
        for k, v in self.measured_blocks.items():
            if not isinstance(v, dict):
                raise ParsimError(f"measured_blocks[{k!r}] must be an object")
            names = (("emb_fwd_s", "emb_bwd_s", "out_fwd_s", "out_bwd_s") if k.startswith("head|")
                     else ("fwd_s", "bwd_s"))
            for n in names:
                check_number(f"measured_blocks[...].{n}", v.get(n), 0.0, 1e6, low_open=True)
        if "interval_log_halfwidth" in self.calibration:
            check_number("calibration.interval_log_halfwidth", self.calibration["interval_log_halfwidth"], 0.0, 10.0)
        by_group = self.calibration.get("interval_log_halfwidth_by_group") or {}
        if not isinstance(by_group, dict):
            raise ParsimError("calibration.interval_log_halfwidth_by_group must be an object")
        for g, q in by_group.items():
            check_number(f"calibration.interval_log_halfwidth_by_group.{g}", q, 0.0, 10.0)
        for n in ("samples", "provenance"):
            if not isinstance(getattr(self, n), dict):
                raise ParsimError(f"{n} must be an object, got {getattr(self, n)!r}")
        if not isinstance(self.assumptions, (list, tuple)) or not all(isinstance(a, str) for a in self.assumptions):
            raise ParsimError("assumptions must be a list of strings")
        if not isinstance(self.collectives, (list, tuple)) or not all(isinstance(c, CollectiveFit)
                                                                       for c in self.collectives):
            raise ParsimError("collectives must be a list of collective fits")

    # ---- derived ------------------------------------------------------------------------------------------------
    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes - self.memory_reserved_bytes

    @property
    def interval_log_halfwidth(self) -> float:
        """Half-width q of step-time intervals [t e^-q, t e^q]: the calibration's out-of-fold conformal quantile,
        else the uncalibrated error of profiles of this kind (``UNCALIBRATED_LOG_HALFWIDTH``)."""
        q = self.calibration.get("interval_log_halfwidth")
        return float(q) if q is not None else UNCALIBRATED_LOG_HALFWIDTH[self.source]

    def interval_log_halfwidth_for(self, group: str) -> float:
        """The half-width for a plan of interval group ``group`` (``plan.interval_group``): the calibration's
        conformal quantile of that group's out-of-fold residuals where it had enough rows, else the pooled one."""
        q = (self.calibration.get("interval_log_halfwidth_by_group") or {}).get(group)
        return float(q) if q is not None else self.interval_log_halfwidth

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ParsimError(f"profile {self.name} has no peak for {dtype}")
        return float(self.peak_flops[dtype])

    # ---- collective time ----------------------------------------------------------------------------------------
    def _fit_for(self, op: str, n: int, rpn: int):
        """The measured fit segments for (op, n, rpn): exact match, else the nearest measured group size of the
        same class (inside one node vs crossing nodes) and the closest ranks per node."""
        segs = self._index.get((op, n, rpn))
        if segs:
            return segs
        same_class = [k for k in self._index if k[0] == op and (k[2] >= k[1]) == (rpn >= n)]
        if not same_class:
            return None
        key = min(same_class, key=lambda k: (abs(math.log2(k[1]) - math.log2(n)), abs(k[2] - rpn)))
        return self._index[key]

    def collective_time_s(self, op: str, input_bytes, n, rpn):
        """Time of one collective per rank. ``input_bytes``, ``n`` (group size) and ``rpn`` (ranks of the group per
        node) may be numpy arrays of one shape; groups of size 1 cost nothing. The topology model covers every
        group; measured fits, where the profile has one for (op, n, rpn) or a near one, replace it."""
        input_bytes = np.asarray(input_bytes, dtype=float)
        shape = np.broadcast_shapes(input_bytes.shape, np.shape(n), np.shape(rpn))
        input_bytes = np.broadcast_to(input_bytes, shape)
        n = np.broadcast_to(np.asarray(n, dtype=np.int64), shape)
        rpn = np.minimum(np.broadcast_to(np.asarray(rpn, dtype=np.int64), shape), n)
        active = (n > 1) & (input_bytes > 0)
        nf = np.maximum(n, 2).astype(float)
        s_bytes = buffer_bytes(op, input_bytes, n)
        factor = busbw_factor(op, nf)
        topo = self.topology
        intra = float(topo.intra_node_busbw_bytes_per_s[op])
        nic = topo.inter_node_bytes_per_s_per_gpu
        inside = rpn >= n
        lat = np.where(inside, topo.intra_latency_s, topo.inter_latency_s) + topo.latency_per_log2_rank_s * np.log2(nf)
        if op in ("send", "broadcast"):
            bw = np.where(inside, intra, nic)
        else:
            bw = np.where(inside, intra, np.minimum(intra, rpn * nic))
        t = lat + s_bytes * factor / bw
        if op == "all_to_all":
            cross = lat + np.maximum(s_bytes * (n - rpn) / nf / nic, s_bytes * (rpn - 1) / nf / intra)
            t = np.where(inside, t, cross)
        t = np.array(t, dtype=float)  # writable, also for scalar inputs
        if self.collectives and self.source == "measured":
            key = n * 1_000_003 + rpn
            for k in np.unique(key[active]):
                nn, rr = int(k // 1_000_003), int(k % 1_000_003)
                segs = self._fit_for(op, nn, rr)
                if not segs:
                    continue
                m = active & (key == k)
                sb = s_bytes[m]
                lat_f = np.full(sb.shape, segs[0].latency_s)
                bw_f = np.full(sb.shape, segs[0].busbw_bytes_per_s)
                for sgm in segs[1:]:
                    big = sb >= sgm.min_bytes
                    lat_f[big], bw_f[big] = sgm.latency_s, sgm.busbw_bytes_per_s
                t[m] = lat_f + sb * busbw_factor(op, nn) / bw_f
        return np.where(active, t, 0.0) * float(self.corrections.get("comm_scale", 1.0))

    # ---- serialization ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["gemm_efficiency"] = asdict(self.gemm_efficiency)
        d["attention_efficiency"] = asdict(self.attention_efficiency)
        d["float8_gemm_efficiency"] = asdict(self.float8_gemm_efficiency) if self.float8_gemm_efficiency else None
        d["attention_keys_efficiency"] = (asdict(self.attention_keys_efficiency) if self.attention_keys_efficiency
                                          else None)
        d["topology"] = asdict(self.topology)
        d["collectives"] = [asdict(c) for c in self.collectives]
        d["assumptions"] = list(self.assumptions)
        return d

    # (op, group size, ranks per node) -> fit segments; built per instance in __post_init__ (not a field)
    _index: ClassVar[dict]
    REQUIRED_KEYS = ("name", "device_name", "gpus_per_node", "n_nodes", "memory_bytes", "memory_reserved_bytes",
                     "peak_flops", "memory_bandwidth_bytes_per_s", "gemm_efficiency", "attention_efficiency",
                     "memory_efficiency", "topology", "collectives", "source", "schema_version")

    @staticmethod
    def from_dict(d: dict, origin: str = "profile") -> "HardwareProfile":
        """Schema-checked: unknown or missing keys, wrong types, non-finite or out-of-range values give one
        ParsimError line naming the file, the field and the value."""
        if not isinstance(d, dict):
            raise ParsimError(f"{origin}: a hardware profile must be a JSON object")
        known = {f.name for f in fields(HardwareProfile)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ParsimError(f"{origin}: unknown keys {unknown}")
        missing = [k for k in HardwareProfile.REQUIRED_KEYS if k not in d]
        if missing:
            raise ParsimError(f"{origin}: missing keys {missing}")
        try:
            d = dict(d)
            d["gemm_efficiency"] = _sub(EfficiencyCurve, d["gemm_efficiency"], "gemm_efficiency")
            d["attention_efficiency"] = _sub(EfficiencyCurve, d["attention_efficiency"], "attention_efficiency")
            for k in ("float8_gemm_efficiency", "attention_keys_efficiency"):
                if d.get(k) is not None:
                    d[k] = _sub(EfficiencyCurve, d[k], k)
            d["topology"] = _sub(Topology, d["topology"], "topology")
            if not isinstance(d["collectives"], list):
                raise ParsimError(f"collectives must be a list, got {d['collectives']!r}")
            d["collectives"] = tuple(_sub(CollectiveFit, c, "collectives[]") for c in d["collectives"])
            return HardwareProfile(**d)
        except ParsimError as e:
            raise ParsimError(f"{origin}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ParsimError(f"{origin}: corrupt hardware profile ({type(e).__name__}: {e})") from None

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_dict())


def _sub(cls, d, where: str):
    if not isinstance(d, dict):
        raise ParsimError(f"{where} must be an object, got {d!r}")
    try:
        return cls(**d)
    except TypeError as e:
        raise ParsimError(f"{where}: {e}") from None


# GPU architecture by the marketing names in ``device_name`` (NVIDIA's data-center parts): what a calibration
# factor of one architecture applies to (``ARCH_FACTORS``)
GPU_ARCHITECTURES = (("ampere", ("A100", "A800")), ("hopper", ("H100", "H200", "H800", "H20", "GH200")),
                     ("blackwell", ("B100", "B200", "GB200", "B300")))


def gpu_architecture(device_name: str) -> str | None:
    """The architecture of a profile's device (``GPU_ARCHITECTURES``), None for a CPU or an unknown part."""
    import re

    words = set(re.findall(r"[A-Z]+\d+", device_name.upper()))
    for arch, names in GPU_ARCHITECTURES:
        if words & set(names):
            return arch
    return None


# calibration parameter -> (the parameter it multiplies, the architecture whose profiles it applies to): a ratio to
# the factor every other GPU takes (``calibrate.apply``; shown by ``predict --explain``)
ARCH_FACTORS = {"gemm_eff_max_ampere": ("gemm_eff_max", "ampere")}


def arch_factor_names(base: str, device_name: str) -> list[str]:
    """The architecture factors (``ARCH_FACTORS``) that multiply ``base`` on a profile of ``device_name``."""
    arch = gpu_architecture(device_name)
    return [n for n, (b, on) in ARCH_FACTORS.items() if b == base and on == arch]


def profile_write_dir() -> Path:
    """Where ``profile --out NAME`` and ``calibrate`` write profiles by name: ``$PARSIM_PROFILES_DIR`` when set; in a
    source checkout (the packaged folder sits beside a pyproject.toml: an editable install) the repository's
    profiles/; otherwise the user's data folder (``$XDG_DATA_HOME/parsim/profiles``, ``~/.local/share/...``), never
    the installed package."""
    if os.environ.get("PARSIM_PROFILES_DIR"):
        return Path(os.environ["PARSIM_PROFILES_DIR"])
    if (PACKAGED_PROFILES_DIR.parent / "pyproject.toml").exists():
        return PACKAGED_PROFILES_DIR
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "parsim" / "profiles"


def profile_dirs() -> list[Path]:
    """Where profiles are looked up by name, first hit wins: the write folder, then the packaged profiles."""
    return list(dict.fromkeys([profile_write_dir(), PACKAGED_PROFILES_DIR]))


def list_profiles() -> list[str]:
    return sorted({p.stem for d in profile_dirs() for p in d.glob("*.json") if p.stem != "orders"})


def profile_path(name_or_path: str) -> Path:
    """The file of a profile given by name (the write folder, then the packaged profiles) or by path; the packaged
    folder's name when none exists."""
    p = Path(name_or_path)
    if not p.suffix and not exists(p):
        p = next((d / f"{name_or_path}.json" for d in profile_dirs() if exists(d / f"{name_or_path}.json")),
                 PACKAGED_PROFILES_DIR / f"{name_or_path}.json")
    return p


def load_profile(name_or_path: str) -> HardwareProfile:
    """A profile by name (the write folder, then the packaged profiles: e.g. ``h100-sxm-spec``) or a path to a
    profile JSON."""
    p = profile_path(name_or_path)
    if not exists(p):
        raise ParsimError(f"unknown profile {short_path(p)!r} (known: {', '.join(list_profiles())})")
    return HardwareProfile.from_dict(read_json(p, "corrupt profile"), origin=str(p))
