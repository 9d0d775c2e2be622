"""Regenerate the spec-sheet profiles in this folder: `python profiles/make_spec_profiles.py`.

Figures come from ../shared/HARDWARE_FACTS.md (public sources named there). Every figure that is not a public
spec-sheet number is an assumption and is listed in the profile's `assumptions` until a measured profile replaces it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parsim.hardware import EfficiencyCurve, HardwareProfile, Topology  # noqa: E402
from parsim.units import GB, GiB  # noqa: E402

COMMON_ASSUMPTIONS = (
    "gemm_efficiency, attention_efficiency and float8_gemm_efficiency are assumed saturating curves, not measured",
    "memory_efficiency (fraction of HBM bandwidth reached by elementwise/norm kernels) is assumed",
    "compile_memory_bound_factor (memory-bound time under torch.compile vs eager) is assumed",
    "memory_reserved_bytes (CUDA context, NCCL buffers, cuBLAS workspaces, allocator fragmentation) is assumed",
    "collective latencies (intra/inter/per-log2-rank) are assumed",
    "cross-node busbw = min(intra-node busbw, ranks_per_node x achieved NIC bandwidth) assumes one NIC per GPU "
    "on a rail-optimized fabric and no contention between concurrent groups",
)

SHEETS = {
    "h100-sxm-spec": dict(
        device_name="NVIDIA H100 SXM5 80GB",
        memory_bytes=80 * GiB,
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12},
        memory_bandwidth_bytes_per_s=3350 * GB,
        gemm=(0.75, 2e9), attn=(0.50, 4e9), fp8=(0.60, 4e9),
        intra={"all_reduce": 480 * GB, "all_gather": 370 * GB, "reduce_scatter": 370 * GB,
               "all_to_all": 370 * GB, "broadcast": 370 * GB, "send": 370 * GB},
        nic=46 * GB,
        extra=("intra-node busbw for ops other than all_reduce (370 GB/s) is the published RING figure, "
               "all_reduce 480 GB/s is with NVLS (nccl-tests#212, #290)",),
    ),
    "h200-spec": dict(
        device_name="NVIDIA H200 SXM 141GB",
        memory_bytes=140 * GiB,
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12},
        memory_bandwidth_bytes_per_s=4800 * GB,
        gemm=(0.75, 2e9), attn=(0.50, 4e9), fp8=(0.60, 4e9),
        intra={"all_reduce": 475 * GB, "all_gather": 370 * GB, "reduce_scatter": 370 * GB,
               "all_to_all": 370 * GB, "broadcast": 370 * GB, "send": 370 * GB},
        nic=46 * GB,
        extra=("memory_bytes 140 GiB: '141 GB' HBM3e taken as about 140 GiB usable by the allocator (assumption)",
               "intra-node busbw other than all_reduce assumed equal to H100 (same NVLink4)"),
    ),
    "a100-sxm-80gb-spec": dict(
        device_name="NVIDIA A100 SXM4 80GB",
        memory_bytes=80 * GiB,
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        memory_bandwidth_bytes_per_s=2039 * GB,
        gemm=(0.80, 1e9), attn=(0.55, 2e9), fp8=None,
        intra={"all_reduce": 200 * GB, "all_gather": 200 * GB, "reduce_scatter": 200 * GB,
               "all_to_all": 200 * GB, "broadcast": 200 * GB, "send": 200 * GB},
        nic=24 * GB,
        extra=("intra-node busbw for ops other than all_reduce assumed equal to the published all_reduce "
               "200 GB/s (nccl-tests#149, #178)",),
    ),
    "b200-spec": dict(
        device_name="NVIDIA B200 (HGX)",
        memory_bytes=180 * GB,
        peak_flops={"bfloat16": 2250e12, "float16": 2250e12, "float8": 4500e12, "float32": 80e12},
        memory_bandwidth_bytes_per_s=7700 * GB,
        gemm=(0.70, 4e9), attn=(0.45, 8e9), fp8=(0.55, 8e9),
        intra={"all_reduce": 900 * GB, "all_gather": 720 * GB, "reduce_scatter": 720 * GB,
               "all_to_all": 720 * GB, "broadcast": 720 * GB, "send": 720 * GB},
        nic=46 * GB,
        extra=("memory 180 GB and bandwidth 7,700 GB/s are the low ends of the public ranges",
               "intra-node busbw is assumed: twice the H100 figures (NVLink5 has twice NVLink4's bandwidth)",
               "float32 peak (80 TFLOP/s, non-tensor-core) is assumed"),
    ),
}


def build(name: str, s: dict) -> HardwareProfile:
    fp8 = EfficiencyCurve(*s["fp8"]) if s["fp8"] else None
    return HardwareProfile(
        name=name, device_name=s["device_name"], gpus_per_node=8, n_nodes=1,
        memory_bytes=float(s["memory_bytes"]), memory_reserved_bytes=float(3 * GiB),
        peak_flops=s["peak_flops"], memory_bandwidth_bytes_per_s=float(s["memory_bandwidth_bytes_per_s"]),
        gemm_efficiency=EfficiencyCurve(*s["gemm"]), attention_efficiency=EfficiencyCurve(*s["attn"]),
        float8_gemm_efficiency=fp8, memory_efficiency=0.7, compile_memory_bound_factor=0.5,
        topology=Topology(intra_node_busbw_bytes_per_s=s["intra"], inter_node_bytes_per_s_per_gpu=s["nic"],
                          intra_latency_s=10e-6, inter_latency_s=20e-6, latency_per_log2_rank_s=3e-6),
        source="spec-sheet", assumptions=COMMON_ASSUMPTIONS + s["extra"],
        provenance={"how": "spec sheet: public figures from shared/HARDWARE_FACTS.md, not a measurement",
                    "generator": "profiles/make_spec_profiles.py"},
    )


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    for name, sheet in SHEETS.items():
        print(build(name, sheet).save(here / f"{name}.json"))
