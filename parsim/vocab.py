"""The words a collective is described by: its operation, the mesh axis its group spans, when in the step it runs,
what hides it, and the FSDP unit it is of. String enums: each member is its word (``Op.ALL_GATHER ==
"all_gather"``, hashing and formatting as the word), so records, ``comm_bytes`` keys (``"<op>/<axis>"``) and
profiles read the same as plain strings, while a misspelt name fails where it is written, not silently in a
group-by that names the right word."""

from __future__ import annotations

from enum import StrEnum


class Op(StrEnum):
    """A collective operation (the profiler measures each; ``HardwareProfile.collective_time_s`` times it)."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"


class Axis(StrEnum):
    """The mesh axis (or axes) a collective's group spans: the plan's degrees, FSDP's shard group over dp_shard and
    cp (``DP_SHARD_CP``; ``FSDP`` where a record is split between the two by plan), the routed experts' FSDP
    group (``EFSDP``) and their data-parallel replicas (``EDP``)."""

    TP = "tp"
    CP = "cp"
    PP = "pp"
    EP = "ep"
    DP_SHARD = "dp_shard"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD_CP = "dp_shard+cp"
    FSDP = "fsdp"
    EFSDP = "efsdp"
    EDP = "edp"


class Phase(StrEnum):
    """When in the step a collective runs."""

    FORWARD = "forward"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward+backward"
    STEP = "step"


class Overlap(StrEnum):
    """What hides a collective: nothing (``EXPOSED``), the pipeline schedule (``PP``), FSDP's prefetch of the next
    unit's parameters (``FSDP_GATHER``) or the next unit's backward (``FSDP_REDUCE``; ``overlap.fsdp_exposed``)."""

    EXPOSED = "exposed"
    PP = "pp"
    FSDP_GATHER = "fsdp_gather"
    FSDP_REDUCE = "fsdp_reduce"


class FsdpUnit(StrEnum):
    """An FSDP unit as torchtitan wraps a model: one per block (a MoE block's routed experts are a unit of their
    own where ep > 1, over efsdp; inside the block's where ep = 1), the embedding, the [final norm, output]."""

    DENSE_BLOCK = "dense block"
    MOE_BLOCK = "MoE block"
    EXPERTS = "MoE block's routed experts"
    EMBEDDING = "embedding unit"
    OUTPUT = "[final norm, output] unit"


class MemoryPhase(StrEnum):
    """The moments of a step a rank's memory peak is attributed to, in step order (``costmodel.memory``'s timeline
    and ``executor.trace``'s traced peaks use the same words): the forwards, with the loss's and the output
    projection's backward; the blocks' backward of a pass's first microbatch on the rank; under PP those of its
    other microbatches; the embedding's backward and the reduce after the last (PP); clipping and the optimizer."""

    END_OF_FORWARD = "end of forward"
    FIRST_BACKWARD = "backward of the last layer"
    LATER_BACKWARD = "backward of a later microbatch"
    END_OF_BACKWARD = "end of backward"
    OPTIMIZER_STEP = "optimizer step"
