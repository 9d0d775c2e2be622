"""Before `parsim run` launches anything (torch-free): which profile describes the machine the run is on, the
parameter dtype a CPU run defaults to, and the predicted time of the whole run, so that a run the machine cannot
finish within ``--timeout`` is refused before it starts rather than killed when it ends.

A CPU rank runs a bf16 GEMM at the speed of the instructions it has: on a CPU without AVX-512 BF16 or AMX, torch
falls back to a conversion loop (the packaged ``cpu-gloo-2`` profile measured 2.2 GFLOP/s in bf16 against 98 in
float32 on such a machine, 44x), with them bf16 is the faster dtype (427 against 161 GFLOP/s measured on a
1024^3 matmul on a 2-core AVX-512 BF16 machine, 2026-12-02). So the default follows what was measured here: the
profile of this machine when there is one, else its CPU flags.
"""

from __future__ import annotations

from .errors import ParsimError

# [assumed] bf16 is the slow dtype when its measured GEMM peak is below half of float32's (the two measurements
# above differ by 44x and 0.38x: any threshold between them decides the same way)
SLOW_BF16_RATIO = 0.5
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the CPU flags that give bf16 GEMMs their own instructions


def cpu_run_profile(name: str | None, nproc: int):
    """(profile, '') for a measured CPU profile that describes this machine: ``name`` when given, else the first
    of ``cpu-gloo-N-cal``, ``cpu-gloo-N`` and this machine's own (``cpu-gloo-N-<tag>[-cal]``, as ``validate`` and
    ``search --execute`` measure it); (None, why) otherwise."""
    from .hardware import load_profile
    from .machine import machine_tag, warning

    base = f"cpu-gloo-{nproc}"
    names = [name] if name else [f"{base}-cal", base, f"{base}-{machine_tag()}-cal", f"{base}-{machine_tag()}"]
    reasons = []
    for n in names:
        try:
            hw = load_profile(n)
        except ParsimError:
            continue
        if hw.source != "measured" or hw.provenance.get("device", "cpu") != "cpu":
            reasons.append(f"{n} is not a measured CPU profile")
        elif warning(hw):  # (one from an older profiler still says roughly how long a step takes)
            reasons.append(f"{n} was measured on another machine")
        else:
            return hw, ""
    why = "; ".join(reasons) or f"no profile {' or '.join(names)}"
    return None, (f"{why}: no prediction (parsim profile --nproc-per-node {nproc} --out {base}-{machine_tag()} "
                  "measures this machine in 2-3 minutes)")


def bf16_slow(hw) -> bool:
    """Whether the profile measured bf16 GEMMs below ``SLOW_BF16_RATIO`` of float32's (False when it lacks either)."""
    peaks = hw.peak_flops
    return "bfloat16" in peaks and "float32" in peaks and peaks["bfloat16"] < SLOW_BF16_RATIO * peaks["float32"]


def cpu_dtype(hw, cpu_flags: list[str]) -> tuple[str, str]:
    """(param dtype, reason) for a CPU run given no ``--param-dtype``: float32 where bf16 GEMMs are slow here."""
    if hw is not None and "bfloat16" in hw.peak_flops and "float32" in hw.peak_flops:
        bf16, fp32 = hw.peak_flops["bfloat16"], hw.peak_flops["float32"]
        rates = f"profile {hw.name} measured bf16 GEMMs at {bf16 / 1e9:.1f} GFLOP/s, float32 at {fp32 / 1e9:.1f}"
        if bf16_slow(hw):
            return "float32", f"{rates}; pass --param-dtype bfloat16 to run in bf16 anyway"
        return "bfloat16", rates
    if any(f in cpu_flags for f in BF16_FLAGS):
        return "bfloat16", f"this CPU has {', '.join(f for f in BF16_FLAGS if f in cpu_flags)}"
    return "float32", ("this CPU has neither AVX-512 BF16 nor AMX (bf16 GEMMs run tens of times slower than "
                       "float32); pass --param-dtype bfloat16 to run in bf16 anyway")


def check_fits_timeout(step_s: float | None, steps: int, warmup: int, timeout_s: float, hint: str = "") -> None:
    """Refuse a run whose predicted steps alone take longer than ``timeout_s`` (start-up comes on top)."""
    if step_s is None:
        return
    total = step_s * (steps + warmup)
    if total > timeout_s:
        raise ParsimError(f"predicted {step_s:,.1f} s a step: {warmup} warmup + {steps} timed steps take ~{total:,.0f} "
                          f"s, more than --timeout {timeout_s:g} s; raise --timeout, run fewer steps or a smaller "
                          f"plan{hint}")
