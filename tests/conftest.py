import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# What a measured CPU profile of the current profiler holds beside its curves (``machine.missing_quantities``):
# figures of a fresh 4-rank profile of a 2-core AVX2 EPYC (2026-11-29), for tests that need a profile "measured
# here, today" without measuring one.
CURRENT_CPU_CORRECTIONS = {
    "compute_scale": 1.0, "optimizer_fixed_s": 3.7e-4, "optimizer_s_per_param": 4.6e-9,
    "optimizer_s_per_tensor": 4.5e-5, "fsdp_call_fixed_s": 1.3e-3, "fsdp_call_s_per_byte": 8.9e-10,
    "tp_block_fixed_s": 2.2e-2, "tp_block_s_per_byte": 1.4e-8}


def as_measured_here(prof: dict) -> dict:
    """A measured CPU profile (as a dict) made to describe this machine as the current profiler would: this
    machine in its provenance, the quantities it measures beside the curves in its corrections (kept where it has
    them)."""
    from parsim.machine import this_machine

    prof["provenance"]["machine"] = this_machine()
    prof["corrections"] = {**CURRENT_CPU_CORRECTIONS, **prof.get("corrections", {})}
    return prof
