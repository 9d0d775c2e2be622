"""PlanBatch: many plans as a struct of numpy arrays, so that the cost model evaluates a million plans at once.

``predict`` for one plan is the same code on arrays of length 1; there is no second, scalar implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..plan import AC_MODES, AXES, PP_SCHEDULES, Plan, parse_ac, ranks_per_node
from ..units import DTYPE_BYTES


@dataclass
class PlanBatch:
    pp: np.ndarray
    dp_replicate: np.ndarray
    dp_shard: np.ndarray
    cp: np.ndarray
    tp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    ep_ddp: np.ndarray  # bool: EP borrowed from dp_replicate (Megatron DDP+EP) instead of dp_shard*cp*tp
    seq_len: np.ndarray
    local_batch_size: np.ndarray
    micro_batch_size: np.ndarray
    global_batch_size: np.ndarray
    sched: np.ndarray  # PP_SCHEDULES code
    v: np.ndarray  # stages per rank
    sp: np.ndarray  # bool
    raf: np.ndarray  # bool, resolved reshard_after_forward
    raf_always: np.ndarray  # bool, also for the output layer
    ac: np.ndarray  # AC_MODES code
    ac_every: np.ndarray
    compile: np.ndarray  # bool
    float8: np.ndarray  # bool
    ac_wraps_compile: np.ndarray  # bool: AC applied after compile (AC(compile(block))): recompute counted twice
    param_bytes: np.ndarray
    reduce_bytes: np.ndarray
    rpn: dict  # group name -> ranks of that group per node

    def __len__(self) -> int:
        return len(self.pp)

    def take(self, idx) -> "PlanBatch":
        kw = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name != "rpn"}
        return PlanBatch(rpn={k: v[idx] for k, v in self.rpn.items()}, **kw)

    # derived (cheap, recomputed when needed)
    @property
    def dp(self):
        return self.dp_replicate * self.dp_shard

    @property
    def n_micro(self):
        return self.local_batch_size // self.micro_batch_size

    @property
    def grad_accum(self):
        return self.global_batch_size // (self.local_batch_size * self.dp)

    @property
    def fsdp(self):
        """Degree of the FSDP group of non-expert parameters (torchtitan shards over dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def etp_eff(self):
        """Expert tensor-parallel degree in effect: without EP, torchtitan TP-shards the experts like any MLP."""
        return np.where(self.ep == 1, self.tp, self.etp)

    @property
    def efsdp(self):
        """FSDP degree of the routed experts: with their block when ep == 1, else what dp2ep leaves."""
        tt = self.dp_shard * self.cp * self.tp // (self.ep * self.etp)
        return np.where((self.ep == 1) | self.ep_ddp, self.dp_shard * self.cp, tt)

    @property
    def world(self):
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @staticmethod
    def from_plans(plans: list[Plan], gpus_per_node: int) -> "PlanBatch":
        def arr(f, dtype=np.int64):
            return np.array([f(p) for p in plans], dtype=dtype)

        b = PlanBatch(
            pp=arr(lambda p: p.pp), dp_replicate=arr(lambda p: p.dp_replicate), dp_shard=arr(lambda p: p.dp_shard),
            cp=arr(lambda p: p.cp), tp=arr(lambda p: p.tp), ep=arr(lambda p: p.ep), etp=arr(lambda p: p.etp),
            ep_ddp=arr(lambda p: p.ep_from == "dp_replicate", bool), seq_len=arr(lambda p: p.seq_len),
            local_batch_size=arr(lambda p: p.local_batch_size), micro_batch_size=arr(lambda p: p.micro_batch_size),
            global_batch_size=arr(lambda p: p.global_batch_size), sched=arr(lambda p: PP_SCHEDULES[p.pp_schedule]),
            v=arr(lambda p: p.pp_stages_per_rank), sp=arr(lambda p: bool(p.sequence_parallel), bool),
            raf=arr(lambda p: p.reshard_after_forward, bool),
            raf_always=arr(lambda p: p.fsdp_reshard_after_forward == "always", bool),
            ac=arr(lambda p: AC_MODES[parse_ac(p.ac)[0]]), ac_every=arr(lambda p: parse_ac(p.ac)[1]),
            compile=arr(lambda p: p.compile, bool), float8=arr(lambda p: p.float8, bool),
            ac_wraps_compile=arr(lambda p: p.wrapper_order.index("ac") > p.wrapper_order.index("compile"), bool),
            param_bytes=arr(lambda p: DTYPE_BYTES[p.param_dtype]),
            reduce_bytes=arr(lambda p: DTYPE_BYTES[p.reduce_dtype]),
            rpn={},
        )
        # device order differs per plan: compute ranks-per-node per distinct order
        orders = [p.mesh_order for p in plans]
        rpn = {k: np.ones(len(plans), dtype=np.int64) for k in GROUPS}
        for order in set(orders):
            idx = np.array([i for i, o in enumerate(orders) if o == order])
            sub = b.take(idx)
            for k, v in group_rpn(sub, order, gpus_per_node).items():
                rpn[k][idx] = v
        b.rpn = rpn
        return b


GROUPS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "fsdp", "ep", "efsdp", "edp")


def group_rpn(b: PlanBatch, order: tuple[str, ...], gpus_per_node: int) -> dict:
    """Ranks per node of every communication group, for plans that share one device order.

    EP groups (torchtitan dp2ep) take the innermost ``ep`` ranks of the flattened dp_shard x cp (x tp when etp = 1)
    block, and the expert-FSDP group the rest; DDP-style EP takes the innermost ranks of dp_replicate."""
    deg = {a: getattr(b, a) for a in AXES}
    out = {a: ranks_per_node(deg, order, gpus_per_node, (a,)) for a in AXES}
    out["fsdp"] = ranks_per_node(deg, order, gpus_per_node, ("dp_shard", "cp"))
    block = np.where(b.etp == 1, ranks_per_node(deg, order, gpus_per_node, ("dp_shard", "cp", "tp")), out["fsdp"])
    ep_tt = np.minimum(b.ep, block)
    efsdp_tt = np.maximum(1, block // np.maximum(b.ep, 1))
    out["ep"] = np.where(b.ep_ddp, np.minimum(b.ep, out["dp_replicate"]), ep_tt)
    out["efsdp"] = np.where(b.ep_ddp, out["fsdp"], efsdp_tt)
    out["edp"] = np.maximum(1, out["dp_replicate"] // np.maximum(b.ep, 1))
    return out


__all__ = ["PlanBatch", "group_rpn", "GROUPS", "AC_MODES"]
