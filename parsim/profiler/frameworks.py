"""Framework overhead, measured: what FSDP2, DTensor tensor parallelism and expert parallelism spend beside their
collectives and the blocks' own compute (hooks, copy-in / copy-out of the flat all-gather buffers, the gradient
chunk-cat, DTensor dispatch and redistribution bookkeeping; EP's routing bookkeeping: the counts read on the host,
the token permutations around the all-to-alls, their autograd). One process per rank under torchrun, on a CPU
profile's own ranks (sharing the cores as its plans' ranks do; ``run.framework_probe_ranks``), on 2 GPUs:

    torchrun --nproc-per-node 2 -m parsim.profiler.frameworks --out samples.json

For each probe width, a stack of ``layers`` blocks (the executor's modules, float32 on CPU, the profile's
dtype on CUDA) is timed forward + backward in two forms, interleaved repetition by repetition so that drift hits
both alike:

* the framework form, wrapped by the executor's own ``apply_fsdp`` (dp_shard = 2, reshard after forward
  ``default`` and ``never``) or ``apply_tp`` (tp = 2, sequence parallel); FSDP over dense blocks and, at the
  widths up to ``MOE_FSDP_MAX_WIDTH``, over MoE blocks (8 experts, top 2, one shared expert: units holding the
  routed experts, ``fsdp_moe``);
* for EP, MoE blocks under the executor's ``apply_ep`` (ep = 2, dp2ep) against the blocks holding only the
  rank's experts, issuing the all-to-alls of balanced routing explicitly (``_ep_pair``);
* for MoE under TP, MoE blocks (one shared expert) under ``apply_tp`` (tp = 2, sequence parallel, experts
  TP-sharded on their hidden dimension: etp = tp) against the same blocks at the local widths (``_tp_moe_pair``):
  the MoE's own DTensor steps (the gather into a replicated DTensor, the partial-sum output, the router's and the
  experts' DTensor weights, the shared expert's DTensor linears), which the dense probe does not run (four
  probes on 2 gloo ranks: +0.7 / +1.1 / +5.2 ms a block on average over the dense block's at 128 / 256 / 512
  wide, within the probes' run-to-run spread);
* its twin: the same blocks unwrapped (under TP at the local widths: half the heads and the FFN) issuing the
  same collectives explicitly, same ops, same bytes (FSDP: an all-gather of the unit per unshard and a
  reduce-scatter of its gradient; TP + SP: per block an all-gather and a reduce-scatter of the activations
  before and after attention and the MLP, and their mirrors in backward).

* for pipelining, one block per rank as the stages of a pipeline over the world, stepped by torch's own
  ``ScheduleGPipe`` over ``PipelineStage`` (as the executor's ``_schedule``) against its twin: the same blocks
  sending and receiving the activations and their gradients with plain blocking send / recv in GPipe's order
  (every forward, then every backward), so that the fill and drain are the same (``_pp_pair``): what the schedule
  spends per stage action (forward or backward of one microbatch) beside the compute and the transfers (the
  stage's input buffers and shape checks, the batched P2P ops, ``stage_backward``'s autograd calls).

The difference per block and step, with the unit's bytes and the number of FSDP collective calls (for pipelining:
the stage actions per block), is one sample. Nothing here knows the cost model: ``fit.fit_framework_overheads``
turns the samples into the profile's named quantities.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..jsonio import atomic_write_json
from ..procs import die_with_parent

WIDTHS = (128, 256, 512)  # d_model of the probe blocks: FSDP units of 0.8, 3.1 and 12.6 MB in float32
TP_SEQ = 256  # TP probes: gathered activations of 0.13, 0.26 and 0.52 MB in float32
EP_EXPERTS, EP_TOP_K = 8, 2  # EP probes: 8 experts, top 2, over the world; routed rows of 64 x 2 tokens
PP_MICROBATCHES = 8  # pipeline probes: microbatches per step, one block per stage (rank)
MOE_FSDP_MAX_WIDTH = 256  # FSDP over MoE blocks: units of 2.0 and 7.9 MB in float32 (512: 34 MB, minutes a probe)


def _cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("PARSIM_DEVICE") != "cpu"


def _spec(d_model: int, layers: int, tp: int = 1):
    from ..spec import ModelSpec

    return ModelSpec(name=f"probe{d_model}", n_layers=layers, d_model=d_model, n_heads=8 // tp,
                     n_kv_heads=4 // tp, d_ff=3 * d_model // tp, vocab_size=128, head_dim=d_model // 8)


class _Stack(torch.nn.Module):
    """Blocks only, under ``layers`` as the executor's Transformer keeps them (apply_fsdp / apply_tp walk it)."""

    def __init__(self, spec):
        from ..executor.model import Block

        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.n_layers)})

    def forward(self, x, rope):
        for blk in self.layers.values():
            x = blk(x, rope)
        return x


def _fsdp_pair(d_model, layers, seq, dtype, dev, raf: str, moe: bool = False):
    """(framework step, twin step, unit bytes unsharded, FSDP collective calls per unit and step); ``moe``: MoE
    blocks (8 experts, top 2, one shared expert), each a unit with its routed experts."""
    from ..executor.model import rope_cache
    from ..executor.parallelize import Meshes, apply_fsdp
    from ..plan import Plan

    world = dist.get_world_size()
    plan = Plan(dp_shard=world, seq_len=seq, local_batch_size=1, fsdp_reshard_after_forward=raf,
                param_dtype=str(dtype).removeprefix("torch."), reduce_dtype=str(dtype).removeprefix("torch."))
    spec = _moe_spec(d_model, layers, EP_EXPERTS, n_shared=1) if moe else _spec(d_model, layers)
    wrapped = _Stack(spec).to(dev, dtype)
    apply_fsdp([wrapped], plan, Meshes(plan, dev.type))
    plain = _Stack(spec).to(dev, dtype)
    numel = sum(p.numel() for p in plain.layers["0"].parameters())
    shard = torch.zeros(-(-numel // world), device=dev, dtype=dtype)
    full = torch.zeros(shard.numel() * world, device=dev, dtype=dtype)
    rope = rope_cache(spec.head_dim, seq).to(dev)
    x = torch.randn(1, seq, d_model, device=dev, dtype=dtype, requires_grad=True)
    gathers = 2 if plan.reshard_after_forward else 1

    def framework():
        wrapped(x, rope).sum().backward()

    def twin():
        h = x
        for blk in plain.layers.values():
            dist.all_gather_into_tensor(full, shard)
            h = blk(h, rope)
        h.sum().backward()
        for _ in plain.layers:
            if gathers == 2:
                dist.all_gather_into_tensor(full, shard)
            dist.reduce_scatter_tensor(shard, full)

    return framework, twin, numel * dtype.itemsize, gathers + 1


def _tp_pair(d_model, layers, seq, dtype, dev):
    """(framework step, twin step, activation bytes per collective, 0): TP + SP over the world."""
    world = dist.get_world_size()
    return _tp_sp_pair(_spec(d_model, layers), _spec(d_model, layers, tp=world), seq, dtype, dev)


def _tp_sp_pair(spec, local_spec, seq, dtype, dev):
    """``spec``'s blocks under the executor's ``apply_tp`` (TP + SP over the world) and ``local_spec``'s (the same
    blocks at the local widths) as ``_sp_pair``'s framework step and twin."""
    from ..executor.parallelize import Meshes, apply_tp
    from ..plan import Plan

    name = str(dtype).removeprefix("torch.")
    plan = Plan(tp=dist.get_world_size(), dp_shard=1, seq_len=seq, local_batch_size=1, sequence_parallel=True,
                param_dtype=name, reduce_dtype=name)
    wrapped = _Stack(spec).to(dev, dtype)
    apply_tp([wrapped], plan, Meshes(plan, dev.type))
    plain = _Stack(local_spec).to(dev, dtype)
    return _sp_pair(wrapped, plain, spec.head_dim, spec.d_model, seq, dtype, dev)


def _sp_pair(wrapped, plain, head_dim, d_model, seq, dtype, dev):
    """The framework step of a TP + SP block stack and its twin: the local-width stack issuing, per block, an
    all-gather and a reduce-scatter of the activations before and after attention and the MLP (or MoE), and their
    mirrors in backward."""
    from torch.distributed.tensor import DTensor

    from ..executor.model import rope_cache

    world = dist.get_world_size()
    rope = rope_cache(head_dim, seq).to(dev)
    x_full = torch.randn(1, seq, d_model, device=dev, dtype=dtype)
    x_local = x_full.chunk(world, dim=1)[dist.get_rank()].detach().requires_grad_(True)
    shard = torch.zeros(seq // world * d_model, device=dev, dtype=dtype)
    full = torch.zeros(seq * d_model, device=dev, dtype=dtype)
    xp = x_full.clone().requires_grad_(True)

    def framework():
        out = wrapped(x_local, rope)  # the executor's blocks take and give the local sequence shard under SP
        (out.to_local() if isinstance(out, DTensor) else out).sum().backward()

    def twin():
        h = xp
        for blk in plain.layers.values():
            for _ in range(2):  # attention and MLP: gather the sequence in, reduce-scatter the output
                dist.all_gather_into_tensor(full, shard)
                dist.reduce_scatter_tensor(shard, full)
            h = blk(h, rope)
        h.sum().backward()
        for _ in plain.layers:  # the mirrors in backward
            for _ in range(2):
                dist.all_gather_into_tensor(full, shard)
                dist.reduce_scatter_tensor(shard, full)

    return framework, twin, full.numel() * dtype.itemsize, 0


def _moe_spec(d_model: int, layers: int, n_experts: int, tp: int = 1, n_shared: int = 0):
    """MoE probe blocks (every layer MoE); at ``tp`` > 1 the local widths of etp = tp (heads, experts' and shared
    expert's hidden dimension / tp)."""
    from ..spec import ModelSpec, MoESpec

    return ModelSpec(name=f"moeprobe{d_model}", n_layers=layers, d_model=d_model, n_heads=8 // tp,
                     n_kv_heads=4 // tp, d_ff=d_model, vocab_size=128, head_dim=d_model // 8,
                     moe=MoESpec(n_experts=n_experts, top_k=EP_TOP_K, d_ff_expert=d_model // tp,
                                 n_shared_experts=n_shared))


def _tp_moe_pair(d_model, layers, seq, dtype, dev):
    """(framework step, twin step, activation bytes per collective, 0): MoE blocks (8 experts, top 2, one shared
    expert) under TP + SP over the world, experts TP-sharded (etp = tp, ``MoE._tp_forward``), against the same
    blocks at the local widths, every token routed through the rank's slice of the experts, issuing the same
    collectives explicitly: per block an all-gather and a reduce-scatter of the activations around attention and
    around the MoE, and their mirrors in backward (what the executor's MoE under TP issues: the router's partial
    gradient is reduced with the step's gradients, not per microbatch)."""
    world = dist.get_world_size()
    return _tp_sp_pair(_moe_spec(d_model, layers, EP_EXPERTS, n_shared=1),
                       _moe_spec(d_model, layers, EP_EXPERTS, tp=world, n_shared=1), seq, dtype, dev)


def _ep_pair(d_model, layers, seq, dtype, dev):
    """(framework step, twin step, routed bytes per rank and block, 0): expert parallelism over the world
    (dp2ep, the executor's ``apply_ep`` and ``MoE._ep_forward``) against the same blocks holding the rank's local
    experts only, issuing the same all-to-alls explicitly at the balanced sizes (per block forward: the counts'
    exchange, the dispatch and the combine of tokens x top_k rows; backward: the two token all-to-alls again)."""
    from ..executor.model import rope_cache
    from ..executor.parallelize import Meshes, apply_ep
    from ..plan import Plan

    world = dist.get_world_size()
    plan = Plan(dp_shard=world, ep=world, seq_len=seq, local_batch_size=1,
                param_dtype=str(dtype).removeprefix("torch."), reduce_dtype=str(dtype).removeprefix("torch."))
    spec = _moe_spec(d_model, layers, EP_EXPERTS)
    wrapped = _Stack(spec).to(dev, dtype)
    apply_ep([wrapped], plan, Meshes(plan, dev.type))
    plain = _Stack(_moe_spec(d_model, layers, EP_EXPERTS // world)).to(dev, dtype)
    rope = rope_cache(spec.head_dim, seq).to(dev)
    x = torch.randn(1, seq, d_model, device=dev, dtype=dtype, requires_grad=True)
    rows = seq * EP_TOP_K
    send, recv = (torch.zeros(rows * d_model, device=dev, dtype=dtype) for _ in range(2))
    c_send = torch.zeros(world * (EP_EXPERTS // world), device=dev, dtype=torch.int64)
    c_recv = torch.empty_like(c_send)

    def framework():
        wrapped(x, rope).sum().backward()

    def twin():
        h = x
        for blk in plain.layers.values():
            dist.all_to_all_single(c_recv, c_send)
            c_recv.tolist()  # the executor reads the counts on the host
            for _ in range(2):  # dispatch, combine
                dist.all_to_all_single(recv, send)
            h = blk(h, rope)
        h.sum().backward()
        for _ in plain.layers:  # their mirrors in backward
            for _ in range(2):
                dist.all_to_all_single(recv, send)

    return framework, twin, rows * d_model * dtype.itemsize, 0


class _Stage(torch.nn.Module):
    """A stack of blocks with its rotary cache as a buffer: a pipeline stage's module takes the activation alone."""

    def __init__(self, spec, seq: int, dev, dtype):
        from ..executor.model import rope_cache

        super().__init__()
        self.stack = _Stack(spec).to(dev, dtype)
        self.register_buffer("rope", rope_cache(spec.head_dim, seq).to(dev), persistent=False)  # complex: kept

    def forward(self, x):
        return self.stack(x, self.rope)


def _pp_pair(d_model, seq, dtype, dev, m: int = PP_MICROBATCHES):
    """(framework step, twin step, activation bytes per stage action, stage actions per block and step): one block
    per rank as a pipeline over the world, torch's ``ScheduleGPipe`` against plain send / recv in GPipe's order."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = _spec(d_model, 1)
    staged, plain = _Stage(spec, seq, dev, dtype), _Stage(spec, seq, dev, dtype)
    first, last = rank == 0, rank == world - 1
    x = torch.randn(m, seq, d_model, device=dev, dtype=dtype)
    target = torch.randn(m, seq, d_model, device=dev, dtype=dtype)

    def loss_fn(out, t):
        return (out * t).mean()

    schedule = ScheduleGPipe(PipelineStage(staged, rank, world, dev), m, loss_fn=loss_fn, scale_grads=False)

    def framework():
        schedule.step(x if first else None, target=target if last else None, losses=[] if last else None,
                      return_outputs=False)
        staged.zero_grad(set_to_none=True)

    def twin():
        ins, outs = [], []
        for i in range(m):  # every forward
            h = x[i:i + 1]
            if not first:
                h = torch.empty(1, seq, d_model, device=dev, dtype=dtype)
                dist.recv(h, rank - 1)
                h.requires_grad_(True)
            o = plain(h)
            if not last:
                dist.send(o.detach(), rank + 1)
            ins.append(h)
            outs.append(loss_fn(o, target[i:i + 1]) if last else o)
        for h, o in zip(ins, outs, strict=True):  # every backward
            if last:
                o.backward()
            else:
                g = torch.empty_like(o)
                dist.recv(g, rank + 1)
                o.backward(g)
            if not first:
                dist.send(h.grad, rank - 1)
        plain.zero_grad(set_to_none=True)

    return framework, twin, seq * d_model * dtype.itemsize, 2 * m


def _time_pair(framework, twin, reps: int, warmup: int, sync) -> tuple[list[float], list[float]]:
    def once(fn):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        dist.barrier()
        return time.perf_counter() - t0

    for _ in range(warmup):
        once(framework)
        once(twin)
    tf, tt = [], []
    for _ in range(reps):  # interleaved: drift and neighbours hit both forms alike
        tf.append(once(framework))
        tt.append(once(twin))
    return tf, tt


KINDS = ("fsdp", "tp", "tp_moe", "ep", "pp", "fsdp_moe")


def measure(widths=WIDTHS, layers: int = 6, seq: int = 64, reps: int = 15, warmup: int = 2,
            kinds=KINDS) -> list[dict]:
    """Samples on this rank's process group (every rank calls it; rank 0's list is the one to keep); ``kinds``:
    which probes (all by default: a profile's)."""
    cuda = _cuda()
    dev = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = []
    for d in widths:
        probes = [("fsdp", "default"), ("fsdp", "never"), ("tp", ""), ("tp_moe", ""), ("ep", ""), ("pp", "")]
        if d <= MOE_FSDP_MAX_WIDTH:
            probes += [("fsdp_moe", "default"), ("fsdp_moe", "never")]
        for kind, raf in [pr for pr in probes if pr[0] in kinds]:
            if kind.startswith("fsdp"):
                fw, tw, nbytes, calls = _fsdp_pair(d, layers, seq, dtype, dev, raf, moe=kind == "fsdp_moe")
            elif kind == "tp":
                fw, tw, nbytes, calls = _tp_pair(d, layers, TP_SEQ, dtype, dev)
            elif kind == "tp_moe":
                fw, tw, nbytes, calls = _tp_moe_pair(d, layers, TP_SEQ, dtype, dev)
            elif kind == "ep":
                fw, tw, nbytes, calls = _ep_pair(d, layers, seq, dtype, dev)
            else:
                fw, tw, nbytes, calls = _pp_pair(d, seq, dtype, dev)
            blocks = 1 if kind == "pp" else layers
            tf, tt = _time_pair(fw, tw, reps, warmup, sync)
            mf, mt = statistics.median(tf), statistics.median(tt)
            out.append({"kind": kind, "reshard_after_forward": raf, "d_model": d, "layers": blocks,
                        "seq_len": TP_SEQ if kind.startswith("tp") else seq,
                        "world": dist.get_world_size(), "dtype": str(dtype).removeprefix("torch."),
                        "unit_bytes": nbytes, "fsdp_calls_per_unit": 0 if kind == "pp" else calls,
                        "pp_actions_per_block": calls if kind == "pp" else 0, "framework_s": mf, "twin_s": mt,
                        "framework_spread_s": max(tf) - min(tf), "twin_spread_s": max(tt) - min(tt),
                        "overhead_per_block_s": (mf - mt) / blocks, "reps": reps})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="two widths, fewer repetitions")
    ap.add_argument("--kinds", default=",".join(KINDS), help="probes to run, comma-separated (a diagnostic: "
                    "repeat some to see their spread; a profile runs all)")
    a = ap.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown probe kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    die_with_parent()
    cuda = _cuda()
    if not cuda:
        torch.set_num_threads(1)  # as each torchrun rank runs
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        samples = measure(WIDTHS[:2] if a.quick else WIDTHS, reps=5 if a.quick else a.reps, kinds=kinds)
        if dist.get_rank() == 0:
            from .fit import framework_events

            for x in samples:  # per call (FSDP), action (PP) or block and microbatch (TP, EP)
                per, event = framework_events(x)
                print(f"{x['kind']:8s} {x['reshard_after_forward']:7s} {x['d_model']:4d} wide, {x['world']} ranks: "
                      f"{x['unit_bytes'] / 1e6:7.3f} MB, framework {x['framework_s'] * 1e3:8.1f} ms, twin "
                      f"{x['twin_s'] * 1e3:8.1f} ms a step: {x['overhead_per_block_s'] / per * 1e3:+7.2f} ms a "
                      f"{event}", flush=True)
            atomic_write_json(a.out, {"samples": samples, "torch": torch.__version__,
                                      "backend": dist.get_backend()})
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
