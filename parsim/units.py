"""Units and formatters. SI inside the library; GiB/ms only at the edges (CLI, report).

GB = 1e9 bytes (nccl-tests, spec sheets); GiB = 2**30 bytes (allocator statistics, `nvidia-smi`).
"""

KB = 1e3
MB = 1e6
GB = 1e9
KiB = 2**10
MiB = 2**20
GiB = 2**30
TFLOP = 1e12
US = 1e-6
MS = 1e-3

# bytes per element of the dtypes a plan can name
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


def fmt_bytes(n_bytes: float) -> str:
    """Human-readable bytes in binary units (GiB for large values)."""
    a = abs(n_bytes)
    if a >= GiB:
        return f"{n_bytes / GiB:.2f} GiB"
    if a >= MiB:
        return f"{n_bytes / MiB:.1f} MiB"
    if a >= KiB:
        return f"{n_bytes / KiB:.1f} KiB"
    return f"{n_bytes:.0f} B"


def fmt_time(t_s: float) -> str:
    a = abs(t_s)
    if a >= 1.0:
        return f"{t_s:.3f} s"
    if a >= MS:
        return f"{t_s / MS:.2f} ms"
    return f"{t_s / US:.1f} us"


def fmt_count(n: float) -> str:
    for unit, v in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= v:
            return f"{n / v:.2f}{unit}"
    return f"{n:.0f}"
