"""What machine this is, as far as step-time predictions care (torch-free): CPU model, cores, the instruction-set
flags that change GEMM speed by an order of magnitude (AVX-512 BF16 and AMX: a bf16 GEMM runs at ~2 GFLOP/s on a
CPU without them and at hundreds with them), the GPU model. `parsim profile` records it in the profile's
provenance; the commands that predict or run on this machine with a measured profile warn when it differs."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# the CPU flags that move GEMM throughput (fp32: AVX2/AVX-512 FMA; bf16: AVX-512 BF16, AMX)
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# what identifies a machine for step-time predictions (compared by ``mismatch``, hashed by ``machine_tag``)
MACHINE_KEYS = ("cpu_model", "cpu_cores", "cpu_flags")


def this_machine(gpu_name: str | None = None) -> dict:
    """{"cpu_model", "cpu_cores", "cpu_flags" (the SPEED_FLAGS present), "arch", "gpu" (or None)}."""
    model, flags = platform.processor() or "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model.strip():
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model.strip() or platform.machine(), "cpu_cores": os.cpu_count() or 1,
            "cpu_flags": [f for f in SPEED_FLAGS if f in flags], "arch": platform.machine(), "gpu": gpu_name}


def machine_tag(here: dict | None = None) -> str:
    """A short name for this machine (8 hex digits of its CPU model, cores and speed flags): the suffix of the
    profile parsim measures for it when the one asked for was measured elsewhere."""
    import hashlib
    import json

    here = here or this_machine()
    key = json.dumps([here.get(k) for k in MACHINE_KEYS], sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def mismatch(provenance: dict, here: dict | None = None) -> str | None:
    """Why a measured profile may not describe this machine (None when it does, as far as recorded)."""
    rec = provenance.get("machine")
    if not isinstance(rec, dict):
        return "it does not record the machine it was measured on"
    here = here or this_machine()
    diffs = [f"{k} {rec.get(k)!r} there, {here.get(k)!r} here" for k in MACHINE_KEYS
             if rec.get(k) != here.get(k)]
    return "; ".join(diffs) or None


# [derived] what every measured CPU profile of the current profiler holds (``profiler.run``): the core-sharing
# factor, the optimizer step and, with 2+ ranks, the framework overhead of FSDP2 and DTensor TP. A profile
# without them predates those measurements: it composes curves and misses what the step spends beside them.
CURRENT_CPU_QUANTITIES = ("compute_scale", "optimizer_fixed_s")
CURRENT_MULTI_RANK_QUANTITIES = ("fsdp_call_fixed_s", "tp_block_fixed_s")


def missing_quantities(hw) -> list[str]:
    """The quantities the current profiler measures that a measured CPU profile lacks (none for spec sheets and
    GPU profiles: they are not re-measured here)."""
    if not _cpu_measurement(hw):
        return []
    want = CURRENT_CPU_QUANTITIES
    if int(hw.provenance.get("device_count") or 1) >= 2:
        want = want + CURRENT_MULTI_RANK_QUANTITIES
    return [k for k in want if k not in hw.corrections]


def _cpu_measurement(hw) -> bool:
    """A profile measured on a CPU (spec sheets and GPU profiles describe hardware elsewhere)."""
    return hw.source == "measured" and hw.provenance.get("device", "cpu") == "cpu"


def warning(hw) -> str | None:
    """One line for stderr when a measured CPU profile was not measured on this machine (spec sheets and GPU
    profiles describe hardware elsewhere: no warning)."""
    if not _cpu_measurement(hw):
        return None
    why = mismatch(hw.provenance)
    if why is None:
        return None
    return (f"warning: profile {hw.name} may not describe this machine ({why}); its timings can be off by an order "
            f"of magnitude here. Re-measure: parsim profile --nproc-per-node N --out NAME")


def mfu_value(mfu: float, hw) -> float | None:
    """MFU for the JSON output: the fraction of the device's bf16 peak, or None where ``mfu_text`` says n/a."""
    return None if _cpu_measurement(hw) or not 0 <= mfu <= 1 else float(mfu)


def mfu_text(mfu: float, hw) -> str:
    """MFU for people: a percentage of the device's bf16 peak on GPU profiles; ``n/a`` on a measured CPU profile,
    whose "peak" is the GEMM rate its profiler measured (a plan in float32 there is reported against bf16's rate:
    4,967% for tiny on cpu-gloo-2), and ``n/a`` above 100% (a peak that is not the device's)."""
    value = mfu_value(mfu, hw)
    return "n/a" if value is None else f"{100 * value:.1f}%"


def profile_rows() -> list[dict]:
    """One row per installed profile (``parsim profiles``): name, what it is (spec sheet, measured, calibrated from
    another), device, ranks it was measured with, date, whether it describes this machine (measured CPU profiles
    only: a spec sheet or GPU profile describes hardware elsewhere) and what the current profiler measures that it
    lacks (stale), the file."""
    from .errors import ParsimError
    from .hardware import list_profiles, load_profile, profile_path

    rows = []
    for name in list_profiles():
        path = str(profile_path(name))
        try:
            hw = load_profile(name)
        except ParsimError as e:
            rows.append({"name": name, "kind": "unreadable", "device": "", "ranks": None, "date": "",
                         "this_machine": "", "this_machine_why": "", "stale": str(e), "path": path})
            continue
        prov = hw.provenance
        kind = "spec" if hw.source == "spec-sheet" else f"measured {prov.get('device', 'cpu')}"
        if prov.get("calibrated_from"):
            kind += ", calibrated"
        why = mismatch(prov) if _cpu_measurement(hw) else None
        differ = [k for k in MACHINE_KEYS if why and k in why]
        rows.append({"name": name, "kind": kind, "device": hw.device_name,
                     "ranks": prov.get("device_count"), "date": str(prov.get("date", ""))[:10],
                     "this_machine": ("" if not _cpu_measurement(hw) else f"no: {', '.join(differ)}" if why
                                      else "yes"), "this_machine_why": why or "",
                     "stale": ", ".join(missing_quantities(hw)), "path": path})
    return rows
