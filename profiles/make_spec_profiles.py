"""Regenerate the spec-sheet profiles in this folder: `python profiles/make_spec_profiles.py`.

Figures come from docs/hardware-facts.md (public sources named there). Every figure that is not a public
spec-sheet number is an assumption and is listed in the profile's `assumptions` until a measured profile replaces it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parsim.hardware import EfficiencyCurve, HardwareProfile, Topology  # noqa: E402
from parsim.units import GB, GiB  # noqa: E402

COMMON_ASSUMPTIONS = (
    "gemm_efficiency: eff_max = the maximum achievable matmul FLOPS (MAMF, stas00/ml-engineering) over the dense "
    "peak [public benchmark]; x_half 4 GFLOP on H100 from square bf16 matmuls (n=2048: 677, 4096: 789 TFLOP/s, "
    "zzc0721/torch-performance-test-data #79) [public benchmark, fitted by eye], scaled by peak on other GPUs "
    "(the same fixed cost per kernel) [derived]",
    "attention_keys_efficiency: FlashAttention-2 forward+backward, causal, head dim 128 (flash-attention repository "
    "benchmark figures) fitted as eff_max * keys / (keys + keys_half) [public benchmark]; attention_efficiency "
    "(FLOP-indexed) is kept for profiles without it and is assumed",
    "fused_attention_speedup (Transformer Engine's cuDNN attention over FlashAttention-2, Megatron-Core plans): 1.6 "
    "on Hopper from the FlashAttention-3 paper's cuDNN and FA2 figures (arXiv 2407.08608, H100, head dim 128) "
    "[public benchmark]; 1.0 on A100 (TE prefers cuDNN only on sm90+) and on B200 (no public figure here) "
    "[assumed]",
    "float8_gemm_efficiency: eff_max = fp8 MAMF over the fp8 peak [public benchmark]; x_half twice the bf16 one "
    "(same fixed cost, twice the rate) [derived]",
    "memory_efficiency (fraction of HBM bandwidth reached by elementwise/norm kernels) is assumed",
    "compile_memory_bound_factor (memory-bound time under torch.compile vs eager) is assumed",
    "memory_reserved_bytes (CUDA context, NCCL buffers, cuBLAS workspaces, allocator fragmentation) is assumed",
    "collective latencies (intra/inter/per-log2-rank) are assumed",
    "cross-node busbw = min(intra-node busbw, ranks_per_node x achieved NIC bandwidth) assumes one NIC per GPU "
    "on a rail-optimized fabric and no contention between concurrent groups",
    "corrections.comm_interference 0.189: compute overlapped with NCCL slows by 18.9% on average (arXiv 2507.03114, "
    "A100/H100) [public benchmark], applied per second of hidden collective time",
)
# [public benchmark] the 500 W H100 (96GB HBM2e, Meta Grand Teton) reaches 585 TFLOP/s bf16 and 1126 TFLOP/s fp8
# rowwise on 8192^3 (pytorch/FBGEMM PR #2546) against 794.5 and 1402.6 MAMF on a 700 W H100 SXM
H100_500W_BF16 = 585.0 / 794.5
H100_500W_FP8 = 1126.0 / 1402.6
# [public benchmark] Transformer Engine's attention on Hopper is cuDNN's fused kernel (TE's backend selection prefers
# it over flash-attn on sm90+); FlashAttention-3 paper (arXiv 2407.08608) Figs. 5-6, H100 SXM5, head dim 128, cuDNN
# over FlashAttention-2: causal forward 410/260, 484/298, 518/319, 529/333, 539/335 TFLOP/s at 1k..16k keys
# (1.58-1.63x), backward 408/260, 465/291, 499/310, 518/318, 516/322 (1.57-1.63x): 1.6x at every length
TE_ATTENTION_HOPPER = 1.6

SHEETS = {
    "h100-sxm-spec": dict(
        device_name="NVIDIA H100 SXM5 80GB",
        memory_bytes=80 * GiB,
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12},
        memory_bandwidth_bytes_per_s=3350 * GB,
        gemm=(794.5 / 989, 4e9), attn=(0.50, 4e9), keys=(0.34, 543.0), fp8=(1402.6 / 1979, 8e9),
        te_attn=TE_ATTENTION_HOPPER,
        intra={"all_reduce": 480 * GB, "all_gather": 370 * GB, "reduce_scatter": 370 * GB,
               "all_to_all": 370 * GB, "broadcast": 370 * GB, "send": 370 * GB},
        nic=46 * GB,
        extra=("intra-node busbw for ops other than all_reduce (370 GB/s) is the published RING figure, "
               "all_reduce 480 GB/s is with NVLS (nccl-tests#212, #290)",),
    ),
    "h100-hbm2e-500w-spec": dict(
        device_name="NVIDIA H100 96GB HBM2e, 500 W power limit (Meta Grand Teton)",
        memory_bytes=96 * GiB,
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12},
        memory_bandwidth_bytes_per_s=2400 * GB,
        gemm=(794.5 / 989 * H100_500W_BF16, 4e9), attn=(0.50 * H100_500W_BF16, 4e9),
        keys=(0.34 * H100_500W_BF16, 543.0), fp8=(1402.6 / 1979 * H100_500W_FP8, 8e9),
        te_attn=TE_ATTENTION_HOPPER,
        intra={"all_reduce": 480 * GB, "all_gather": 370 * GB, "reduce_scatter": 370 * GB,
               "all_to_all": 370 * GB, "broadcast": 370 * GB, "send": 370 * GB},
        nic=46 * GB,
        extra=("peak_flops are the H100 SXM spec figures (the reference torchtitan's MFU uses); the 500 W cap is in "
               "the efficiencies: GEMM eff_max x 585/794.5 and float8 x 1126/1402.6, the 8192^3 bf16 and fp8 "
               "rowwise GEMMs on this part (pytorch/FBGEMM PR #2546) over the 700 W SXM MAMF [public benchmark]",
               "attention efficiencies x 585/794.5 like GEMMs: a power-capped clock slows every tensor-core kernel "
               "alike [assumed]",
               "memory 96 GiB HBM2e at 2.4 TB/s (torchtitan's benchmark files) [spec sheet]; also used for the "
               "94/95 GB HBM2e lower-TDP parts",
               "NVLink4 and one 400 Gb/s NIC per GPU as H100 SXM [assumed]"),
    ),
    "h200-spec": dict(
        device_name="NVIDIA H200 SXM 141GB",
        memory_bytes=140 * GiB,
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 67e12},
        memory_bandwidth_bytes_per_s=4800 * GB,
        gemm=(794.5 / 989, 4e9), attn=(0.50, 4e9), keys=(0.34, 543.0), fp8=(1453.4 / 1979, 8e9),
        te_attn=TE_ATTENTION_HOPPER,
        intra={"all_reduce": 475 * GB, "all_gather": 370 * GB, "reduce_scatter": 370 * GB,
               "all_to_all": 370 * GB, "broadcast": 370 * GB, "send": 370 * GB},
        nic=46 * GB,
        extra=("memory_bytes 140 GiB: '141 GB' HBM3e taken as about 140 GiB usable by the allocator (assumption)",
               "attention_keys_efficiency: H100's FlashAttention-2 figures (same SMs and clocks) [assumed]",
               "intra-node busbw other than all_reduce assumed equal to H100 (same NVLink4)"),
    ),
    "a100-sxm-80gb-spec": dict(
        device_name="NVIDIA A100 SXM4 80GB",
        memory_bytes=80 * GiB,
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        memory_bandwidth_bytes_per_s=2039 * GB,
        gemm=(271.2 / 312, 4e9 * 312 / 989), attn=(0.55, 2e9), keys=(0.63, 505.0), fp8=None,
        intra={"all_reduce": 200 * GB, "all_gather": 200 * GB, "reduce_scatter": 200 * GB,
               "all_to_all": 200 * GB, "broadcast": 200 * GB, "send": 200 * GB},
        nic=24 * GB,
        extra=("intra-node busbw for ops other than all_reduce assumed equal to the published all_reduce "
               "200 GB/s (nccl-tests#149, #178)",
               "attention_keys_efficiency from FlashAttention-2 forward+backward on A100, causal, head dim 128 "
               "(99 TFLOP/s at 512 keys ... 189 at 16k) [public benchmark]"),
    ),
    "b200-spec": dict(
        device_name="NVIDIA B200 (HGX)",
        memory_bytes=180 * GB,
        peak_flops={"bfloat16": 2250e12, "float16": 2250e12, "float8": 4500e12, "float32": 80e12},
        memory_bandwidth_bytes_per_s=7700 * GB,
        gemm=(1745.0 / 2250, 4e9 * 2250 / 989), attn=(0.45, 8e9), keys=(0.34, 543.0),
        fp8=(3432.5 / 4500, 8e9 * 2250 / 989),
        intra={"all_reduce": 900 * GB, "all_gather": 720 * GB, "reduce_scatter": 720 * GB,
               "all_to_all": 720 * GB, "broadcast": 720 * GB, "send": 720 * GB},
        nic=46 * GB,
        extra=("memory 180 GB and bandwidth 7,700 GB/s are the low ends of the public ranges",
               "attention_keys_efficiency: no public FlashAttention figures for B200 here; H100's fractions of peak "
               "are assumed",
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
        float8_gemm_efficiency=fp8, attention_keys_efficiency=EfficiencyCurve(*s["keys"]),
        fused_attention_speedup=float(s.get("te_attn", 1.0)),
        memory_efficiency=0.7, compile_memory_bound_factor=0.5, corrections={"comm_interference": 0.189},
        topology=Topology(intra_node_busbw_bytes_per_s=s["intra"], inter_node_bytes_per_s_per_gpu=s["nic"],
                          intra_latency_s=10e-6, inter_latency_s=20e-6, latency_per_log2_rank_s=3e-6),
        source="spec-sheet", assumptions=COMMON_ASSUMPTIONS + s["extra"],
        provenance={"how": "spec sheet: public figures from docs/hardware-facts.md, not a measurement",
                    "generator": "profiles/make_spec_profiles.py"},
    )


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    for name, sheet in SHEETS.items():
        print(build(name, sheet).save(here / f"{name}.json"))
