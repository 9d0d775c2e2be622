"""Units. SI inside the library; GiB/ms only at the edges (CLI, report).

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

