"""Apply a Plan to the model with the real PyTorch stack, in the plan's wrapper order.

Meshes are built over the plan's axes in its device order (``init_device_mesh`` lays ranks out row-major, the
last axis fastest, the same convention the cost model uses). Each wrapper is a function of (model parts, plan,
meshes); an order other than the default is attempted as written, and a failure is raised to the caller, who
records it as the measurement's error.

TP plan = torchtitan's Llama plan (ColwiseParallel wq/wk/wv/w1/w3, RowwiseParallel wo/w2, SequenceParallel norms,
PrepareModuleInput gathering the sequence before attention and FFN), loss parallel on vocab-sharded logits.
EP (dp2ep): the routed experts of a MoE layer are split over the innermost ``ep`` ranks of dp_shard and wrapped
by their own FSDP over the remaining ``efsdp`` ranks (torchtitan's dp_shard_mod_ep); with TP, EP also takes all
of cp x tp (etp = 1) and the MoE runs as ``model.MoE._tp_forward`` describes.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from ..errors import ParsimError
from ..plan import AXES, Plan, parse_ac


def check_executable(plan: Plan, spec=None, device_type: str = "cpu") -> None:
    """Plans the executor cannot run (the codec's executor rules): one clear error before any process group is
    touched. On CUDA without TP float8 runs (``executor.float8``: torchao's tensorwise linears on CUDA's scaled
    matmul), which the rules refuse everywhere else."""
    from ..codec import executor_refusal

    if device_type == "cuda" and plan.tp == 1 and plan.float8 and plan.float8_recipe == "tensorwise":
        plan = dataclasses.replace(plan, float8=False)
    why = executor_refusal(plan, spec)
    if why:
        raise ParsimError(why.split(": ", 1)[1])


class Meshes:
    def __init__(self, plan: Plan, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        check_executable(plan, device_type=device_type)

        self.plan = plan
        # ranks laid out row-major in the plan's device order (the last axis fastest), then viewed in parsim's
        # canonical axis order: every sub-mesh below is sliced in ascending canonical order, whatever the device
        # order (DeviceMesh refuses non-ascending slices of a mesh built in device order)
        shape = tuple(getattr(plan, a) for a in plan.mesh_order)
        grid = torch.arange(plan.world_size).reshape(shape)
        canon = grid.permute(*[plan.mesh_order.index(a) for a in AXES])  # (pp, dpr, dps, cp, tp)
        self.world = DeviceMesh(device_type, canon.contiguous(), mesh_dim_names=AXES)
        w = self.world
        self.tp = w["tp"] if plan.tp > 1 else None
        self.pp = w["pp"] if plan.pp > 1 else None
        self.cp = w["cp"] if plan.cp > 1 else None
        # FSDP shards over dp_shard x cp flattened; HSDP adds dp_replicate
        shard = w[tuple(("dp_shard", "cp"))]._flatten("dp_shard_cp") if plan.cp > 1 else w["dp_shard"]
        self.fsdp_shard_name = "dp_shard+cp" if plan.cp > 1 else "dp_shard"
        if plan.dp_replicate > 1:
            names = ("dp_replicate", "dp_shard_cp") if plan.cp > 1 else ("dp_replicate", "dp_shard")
            self.fsdp = w[names]
        else:
            self.fsdp = shard
        self.use_fsdp = plan.fsdp_applied
        self.ep = self.efsdp = None
        if plan.ep > 1:
            if plan.ep_from != "dp_shard" or plan.etp != 1:
                raise ParsimError("the executor runs dp2ep with etp = 1 (EP borrowed from dp_shard x cp x tp); "
                                  "DDP-style EP and expert tensor parallel (etp = tp) are not implemented")
            # torchtitan's dp2ep: EP takes all of cp x tp and the innermost ep / (cp x tp) ranks of dp_shard
            # (dp_shard_in_ep), the routed experts' FSDP the rest of dp_shard (dp_shard_mod_ep = efsdp). In the
            # canonical grid (pp, dpr, dps, cp, tp) that is a reshape of the last three axes to (efsdp, ep).
            ep_grid = canon.reshape(plan.pp, plan.dp_replicate, plan.efsdp, plan.ep)
            ep_mesh = DeviceMesh(device_type, ep_grid, mesh_dim_names=("pp_e", "dp_replicate_e", "efsdp", "ep"))
            self.ep = ep_mesh["ep"]
            self.efsdp = ep_mesh[("dp_replicate_e", "efsdp")] if plan.dp_replicate > 1 else ep_mesh["efsdp"]

    def expert_norm_group(self):
        """The EP group, over which routed-expert gradients hold different experts (their norms add up); None
        without EP (TP-sharded experts are DTensors whose norm DTensor reduces like any TP weight's)."""
        return self.ep.get_group() if self.ep is not None else None

    def axis_of_group(self) -> dict[str, tuple[str, ...]]:
        """process-group name -> the parsim axes whose group on this rank has the same ranks, in
        ``codec.AXIS_PRIORITY`` order, for the collective counter (which names a collective by the first of them,
        all-to-alls ``ep`` when it is among them). Rank sets come from torch's groups: one rank set can be served by
        several groups (dp_shard = ep = 2: the dense FSDP group and the EP group) and the name must not depend on
        whether torch shares the group object (``codec.canonical_axes`` applies the same rule to the model)."""
        import torch.distributed as dist

        from ..codec import AXIS_PRIORITY

        groups: dict[str, object] = {}  # axis -> one ProcessGroup serving it
        for name in self.plan.mesh_order:
            groups[name] = self.world[name].get_group()
        if self.plan.cp > 1:
            groups["dp_shard+cp"] = self.world[("dp_shard", "cp")]._flatten("dp_shard_cp").get_group()
        if self.ep is not None:
            groups["ep"] = self.ep.get_group()
            groups["efsdp"] = self.efsdp.get_group(self.efsdp.ndim - 1)
            if self.efsdp.ndim > 1:
                extra = [self.efsdp.get_group(d) for d in range(self.efsdp.ndim - 1)]
            else:
                extra = []
        else:
            extra = []
        ranks = {a: frozenset(dist.get_process_group_ranks(g)) for a, g in groups.items()}
        out: dict[str, tuple[str, ...]] = {}
        for g in list(groups.values()) + extra:
            mine = frozenset(dist.get_process_group_ranks(g))
            axes = tuple(a for a in AXIS_PRIORITY if ranks.get(a) == mine)
            if not axes:  # the dp_replicate part of the expert-FSDP mesh: the dense dp_replicate group's ranks
                axes = ("dp_replicate",)
            out[g.group_name] = axes
        return out


# ---- wrappers ----------------------------------------------------------------------------------------------------
def apply_tp(parts: list[nn.Module], plan: Plan, meshes: Meshes):
    if plan.tp == 1:
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = plan.sequence_parallel
    seq = Shard(1) if sp else Replicate()
    for m in parts:
        top = {}
        if getattr(m, "tok_embeddings", None) is not None:
            top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        if getattr(m, "norm", None) is not None and sp:
            top["norm"] = SequenceParallel()
        if getattr(m, "output", None) is not None:
            # loss parallel (torchtitan's default): logits stay sharded over the vocabulary; the cross-entropy
            # runs on the shards under torch.distributed.tensor.parallel.loss_parallel()
            top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        if top:
            parallelize_module(m, meshes.tp, top)
        for block in m.layers.values():
            lp = {
                "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
            }
            if not block.is_moe:
                lp.update({
                    "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                    "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
                })
                if block.feed_forward.gated:
                    lp["feed_forward.w3"] = ColwiseParallel()
            elif block.moe.shared_experts is not None:
                # shared experts: Megatron TP on the gathered tokens, partial sums out (added to the routed part)
                lp.update({"moe.shared_experts.w1": ColwiseParallel(), "moe.shared_experts.w3": ColwiseParallel(),
                           "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial())})
            if sp:
                lp["attention_norm"] = SequenceParallel()
                lp["ffn_norm"] = SequenceParallel()
            parallelize_module(block, meshes.tp, lp)
            if block.attention.q_norm is not None:
                for norm in (block.attention.q_norm, block.attention.k_norm):
                    norm.weight = _replicated(norm.weight, meshes.tp)
            if block.is_moe:
                _tp_moe(block.moe, plan, meshes)


def _replicated(w: nn.Parameter, mesh) -> nn.Parameter:
    """A weight every TP rank holds whole but uses on its own share (heads, tokens): a DTensor replicated over tp,
    identical on every rank (same init), so from_local without a broadcast (works on meta tensors for traces)."""
    from torch.distributed.tensor import DTensor, Replicate

    return nn.Parameter(DTensor.from_local(w.detach(), mesh, [Replicate()], run_check=False))


def _tp_moe(moe, plan: Plan, meshes: Meshes) -> None:
    """The MoE under TP (see ``MoE._tp_forward``): the router weight becomes a DTensor replicated over tp (its
    gradient, a partial sum over the TP ranks' token shares, is all-reduced like an SP norm weight's); without EP
    the routed experts are TP-sharded on their hidden dimension (etp = tp), with EP (etp = 1) whole and the routed
    tokens split over the TP ranks."""
    tp_mesh = meshes.tp
    moe.router.weight = _replicated(moe.router.weight, tp_mesh)
    moe.tp_mesh = tp_mesh
    if plan.ep > 1:
        moe.tp_split = True
        return
    from torch.distributed.tensor import DTensor, Shard

    r, t = tp_mesh.get_local_rank(), plan.tp
    ex = moe.experts
    for name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):
        # TP-sharded on the hidden dimension, as a DTensor (torchtitan's experts under TP): a plain slice would be
        # the only non-DTensor parameter of a TP model without FSDP, and the optimizer's foreach ops refuse the mix
        full = getattr(ex, name).detach()
        n = full.shape[dim] // t
        local = full.narrow(dim, r * n, n).clone()
        setattr(ex, name, nn.Parameter(DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False)))


def _sac_policy():
    """torchtitan's op-level selective AC: save every other mm, SDPA outputs, reduce-scatter outputs, the
    all-to-all outputs of MoE token dispatch (torchtitan's save list for its MoE models) and max."""
    from torch.utils.checkpoint import CheckpointPolicy

    from . import model  # noqa: F401  (registers the parsim ops the list names)

    _sac_ignore_profiler_ops()
    save = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default, torch.ops.aten.max.default,
            torch.ops.parsim.attention.default}  # (MLA's fused attention: ``model.latent_core``)
    autograd_a2a = getattr(getattr(torch.ops, "_c10d_functional_autograd", None), "all_to_all_single", None)
    if autograd_a2a is not None:
        save.add(autograd_a2a.default)

    def make():
        count = {"fwd": 0, "rec": 0}

        def policy(ctx, func, *args, **kwargs):
            key = "rec" if ctx.is_recompute else "fwd"
            if func == torch.ops.aten.mm.default:
                count[key] += 1
            keep = func in save and not (func == torch.ops.aten.mm.default and count[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    return make


def _sac_ignore_profiler_ops() -> None:
    """Selective AC replays the ops of a checkpointed region by invocation count; a nested FSDP unit inside the
    region (MoE experts wrapped apart, as torchtitan wraps them) enters profiler ranges a different number of
    times in the recompute than in the forward, and the replay fails ("profiler._record_function_enter_new
    invocation index 3 encountered during backward but not found in storage": torchtitan#3427, fixed in torch by
    pytorch#185178, which makes SAC ignore these annotation ops). torch 2.13 lacks the fix: the same ops join
    SAC's ignore list here. They produce no model value."""
    from torch.utils import checkpoint as ckpt

    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        op = getattr(torch.ops.profiler, name, None)
        for overload in ("default", "_RecordFunction"):
            o = getattr(op, overload, None) if op is not None else None
            if o is not None:
                ckpt.SAC_IGNORED_OPS.add(o)


def apply_ac(parts, plan: Plan, meshes):
    """Checkpoint wrappers on the blocks. ``layer:N`` follows torchtitan: blocks are counted from 1 in the order
    this process applies AC (its pipeline stages' blocks in order, or the whole model's when AC comes before the PP
    split) and every N-th is checkpointed."""
    mode, every = parse_ac(plan.ac)
    if mode == "none":
        return
    if mode == "core-attn":
        for m in parts:
            for block in m.layers.values():
                block.attention.checkpoint_core = True
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    count = 0
    for m in parts:
        for key in list(m.layers.keys()):
            block = m.layers[key]
            count += 1
            if mode == "full" or (mode == "layer" and count % every == 0):
                wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
            elif mode == "selective-op":
                make = _sac_policy()
                wrapped = checkpoint_wrapper(block, preserve_rng_state=False,
                                             context_fn=lambda make=make: create_selective_checkpoint_contexts(make()))
            else:
                continue
            wrapped.is_moe = getattr(block, "is_moe", False)
            m.layers[key] = wrapped


def apply_compile(parts, plan: Plan, meshes):
    if not plan.compile:
        return
    for m in parts:
        if plan.tp > 1 and getattr(m, "tok_embeddings", None) is not None:
            m.tok_embeddings.register_forward_hook(_wait_async_output)
        for block in m.layers.values():
            block.compile()


class _WaitAsync(torch.autograd.Function):
    """Identity that waits an AsyncCollectiveTensor (the TP embedding's output: RowwiseParallel redistributes
    it with ``async_op=True``) into the plain tensor it holds, so the first compiled block gets a plain input.
    Handed the subclass itself, the compiled block's backward gave the embedding's eager Redistribute a plain
    gradient ("'Tensor' object has no attribute '_local_tensor'", torch 2.13 CPU, tp 2 with and without SP).
    Eager TP waits at the first op that reads the tensor, the norm that follows: the same point."""

    @staticmethod
    def forward(ctx, x):
        return x.wait().view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _wait_async_output(module, args, out):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return _WaitAsync.apply(out) if isinstance(out, AsyncCollectiveTensor) else None


def apply_ep(parts, plan: Plan, meshes: Meshes):
    """Keep this EP rank's experts (a slice of the full, identically initialized tensors)."""
    if plan.ep == 1:
        return
    r = meshes.ep.get_local_rank()
    for m in parts:
        for block in m.layers.values():
            moe = getattr(_inner(block), "moe", None) if getattr(block, "is_moe", False) else None
            if moe is None:
                continue
            n = moe.n_experts // plan.ep
            ex = moe.experts
            for name in ("w1", "w2", "w3"):
                full = getattr(ex, name)
                setattr(ex, name, nn.Parameter(full.detach()[r * n:(r + 1) * n].clone()))
            moe.ep_group, moe.ep_size = meshes.ep.get_group(), plan.ep


def _inner(block):
    return getattr(block, "_checkpoint_wrapped_module", block)


def apply_fsdp(parts, plan: Plan, meshes: Meshes):
    if not meshes.use_fsdp:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    mp = MixedPrecisionPolicy(param_dtype=dt[plan.param_dtype], reduce_dtype=dt[plan.reduce_dtype])
    raf = plan.reshard_after_forward
    for m in parts:
        for block in m.layers.values():
            inner = _inner(block)
            if getattr(block, "is_moe", False) and plan.ep > 1:
                # torchtitan: when efsdp x ep > n_experts, dim-0 sharding would pad the local experts (4 experts
                # over 8 ranks: half the shards empty, every gather twice the bytes): shard dim 1 instead
                # (dim 1 only where the shard group divides it: FSDP2 pads dim 0 but refuses uneven other dims)
                n_local = inner.moe.n_experts // plan.ep
                shards = plan.efsdp
                place = ((lambda p, s=shards: Shard(1) if p.shape[1] % s == 0 else Shard(0))
                         if meshes.efsdp.size() > n_local else None)
                fully_shard(inner.moe.experts, mesh=meshes.efsdp, mp_policy=mp, reshard_after_forward=raf,
                            shard_placement_fn=place)
            fully_shard(block, mesh=meshes.fsdp, mp_policy=mp, reshard_after_forward=raf)
        if getattr(m, "tok_embeddings", None) is not None:
            fully_shard(m.tok_embeddings, mesh=meshes.fsdp, mp_policy=mp, reshard_after_forward=raf)
        if getattr(m, "output", None) is not None:
            # torchtitan: [norm, output] one unit, kept unsharded after forward (the backward needs it at once)
            # unless reshard_after_forward is "always"
            fully_shard([m.norm, m.output], mesh=meshes.fsdp, mp_policy=mp,
                        reshard_after_forward=plan.fsdp_reshard_after_forward == "always")
        # the root holds no parameters of its own; reshard_after_forward left unset as torchtitan leaves it (FSDP2
        # then keeps a root's parameters after forward)
        fully_shard(m, mesh=meshes.fsdp, mp_policy=mp)
        # gloo's AVG reduction is silently wrong (pytorch#162338): FSDP2 on gloo divided the gradients of some
        # groups (last block, final norm, output) by the dp size and not others. The loss is normalized by the
        # global token count, so a plain SUM is right on every backend: SUM collectives (force_sum) *and* a divide
        # factor of 1 (force_sum alone still post-divides by the dp size).
        for mod in m.modules():
            if hasattr(mod, "set_force_sum_reduction_for_comms"):
                mod.set_force_sum_reduction_for_comms(True)
                mod.set_gradient_divide_factor(1.0)


def set_grad_sync(parts, plan: Plan, k: int) -> None:
    """Before gradient-accumulation pass ``k`` (no PP): with ``grad_sync`` once FSDP2 reduces only in the last pass
    (``set_requires_gradient_sync(False)`` before it: each unit then keeps its unsharded gradients, accumulated in
    the reduce dtype, and reduces them at the last pass's post-backward); every-pass leaves FSDP2's default."""
    if plan.grad_sync != "once" or plan.pp > 1:
        return
    from torch.distributed.fsdp import FSDPModule

    for m in parts:
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(k == plan.grad_accum_steps - 1, recurse=True)


def split_pipeline(model: nn.Module, plan: Plan, meshes: Meshes) -> tuple[list[nn.Module], list[int]]:
    """This rank's stage modules (loop placement: stage s on pp rank s % pp) and their stage indices. Layers are
    split evenly, the first stages taking the extra ones (as the cost model assumes)."""
    if plan.pp == 1:
        return [model], [0]
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    n_stages = plan.pp * plan.pp_stages_per_rank
    L = len(model.layers)
    base, extra = divmod(L, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    rank = meshes.pp.get_local_rank()
    parts, ids = [], []
    keys = list(model.layers.keys())
    # process groups and meshes held by modules (EP's group, applied before the split) are shared, not copied
    shared = {id(v): v for mod in model.modules() for v in vars(mod).values()
              if isinstance(v, (dist.ProcessGroup, DeviceMesh))}
    for s in range(rank, n_stages, plan.pp):
        stage = copy.deepcopy(model, memo=dict(shared))
        keep = set(keys[bounds[s]:bounds[s + 1]])
        for k in keys:
            if k not in keep:
                del stage.layers[k]
        if s != 0:
            stage.tok_embeddings = None
        if s != n_stages - 1:
            stage.norm = None
            stage.output = None
        parts.append(stage)
        ids.append(s)
    return parts, ids


WRAPPER_FNS = {"tp": apply_tp, "ac": apply_ac, "compile": apply_compile, "fsdp": apply_fsdp}


def apply_plan(model: nn.Module, plan: Plan, meshes: Meshes) -> tuple[list[nn.Module], list[int]]:
    """Apply the plan's wrappers in its order; 'pp' splits the (possibly already wrapped) model into stages.
    float8 converts the blocks' linears first, as torchtitan's model converters run before it parallelizes."""
    if plan.float8:
        from .float8 import convert_to_float8

        convert_to_float8(model)
    apply_ep([model], plan, meshes)
    parts, ids = [model], [0]
    for w in plan.wrapper_order:
        if w == "pp":
            if len(parts) != 1:
                raise ParsimError("pp can be applied once")
            parts, ids = split_pipeline(parts[0], plan, meshes)
        else:
            WRAPPER_FNS[w](parts, plan, meshes)
    return parts, ids

