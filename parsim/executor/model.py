"""The transformer the executor runs: Llama-style dense blocks and MoE blocks built from a ModelSpec.

Module names follow torchtitan (tok_embeddings, layers.<i>.attention.{wq,wk,wv,wo}, attention_norm, ffn_norm,
feed_forward.{w1,w2,w3}, moe.{router,experts,shared_experts}, norm, output), so that the TP plan, the FSDP
wrapping and the PP split address the same modules. ``layers`` is a ModuleDict so that a pipeline stage keeps
only its layers and the rest are deleted. Multi-head latent attention (DeepSeek-V2/V3) is ``LatentAttention``,
with torchtitan's module names (attention.{wq | wq_a, q_norm, wq_b}, wkv_a, kv_norm, wkv_b, wo).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import ModelSpec


def rope_cache(head_dim: int, seq_len: int, theta: float = 500000.0) -> torch.Tensor:
    """(seq, hd/2) complex64 cos + i sin, as torchtitan's ``freqs_cis``. Complex on purpose: FSDP2 casts a unit's
    floating-point forward inputs to param_dtype (``cast_forward_inputs``) and skips complex ones; a real-valued
    table got a param_dtype copy per block, which non-reentrant AC then kept for its recompute (a T x head_dim
    bf16 table per checkpointed layer that torchtitan does not have) [trace]."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)[: head_dim // 2] / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32)
    ang = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(ang), ang)


# RoPE and RMSNorm run as custom ops (``parsim::rope``, ``parsim::rms_norm``, ``parsim::rms_norm_backward``): on
# a CPU they compute with torch's composite ops; under FakeTensorMode (traces) each is one op whose only
# allocations are its outputs, as the fused GPU kernels they stand for (the composite's full-size fp32
# temporaries live in a fused kernel's registers). A trace then holds what a GPU holds, at one op per call.
def _rotate(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


@torch.library.custom_op("parsim::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(x, cos, sin).to(x.dtype)


@_rope_op.register_fake
def _rope_fake(x, cos, sin):
    return torch.empty_like(x)


class _Rope(torch.autograd.Function):
    """Rotary embedding as one autograd node that saves nothing per token: the rotation is linear, so its
    backward is the rotation by the opposite angle (what a fused RoPE kernel keeps, not the CPU composite's
    intermediates)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_op(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rope_op(g.contiguous(), cos, -sin), None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (b, s, h, hd) -> rotated pairs; one (s, hd/2, 2) cos / sin table in their dtype serves both (the
    rotations save views of it)."""
    c = torch.view_as_real(cache[: q.shape[1]]).to(q.dtype)
    cos, sin = c[..., 0][None, :, None, :], c[..., 1][None, :, None, :]
    return _Rope.apply(q, cos, sin), _Rope.apply(k, cos, sin)


def _is_dtensor(t) -> bool:
    """``isinstance(t, DTensor)``, the test dynamo traces: a duck-typed ``hasattr(t, "to_local")`` reads False
    on a DTensor while dynamo traces, so a compiled TP block handed DTensors to the local custom ops (no sharding
    strategy: graph break, then a failed eager call)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t):
    return t.to_local() if _is_dtensor(t) else t


def _like(local, ref):
    """``local`` as a DTensor laid out like ``ref`` when ``ref`` is one."""
    if _is_dtensor(ref):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False)
    return local


@torch.library.custom_op("parsim::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) * w in x's dtype, fp32 1/rms per row (..., 1)); the math in fp32."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((xf * r).to(x.dtype) * w).to(x.dtype), r


@_rms_norm_op.register_fake
def _rms_norm_fake(x, w, eps):
    return torch.empty_like(x), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@torch.library.custom_op("parsim::rms_norm_backward", mutates_args=())
def _rms_norm_bwd_op(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                     rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input gradient in x's dtype, fp32 weight gradient summed over the rows)."""
    d = x.shape[-1]
    xhat = x.float().reshape(-1, d) * rstd.reshape(-1, 1)
    gf = g.float().reshape(-1, d)
    gw = gf * w.float()
    gx = rstd.reshape(-1, 1) * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype).reshape(x.shape), (gf * xhat).sum(0)


@_rms_norm_bwd_op.register_fake
def _rms_norm_bwd_fake(g, x, w, rstd):
    return torch.empty_like(x), x.new_empty(x.shape[-1], dtype=torch.float32)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm saving its input and the fp32 1/rms per token, like the fused CUDA kernel (the CPU composite
    keeps fp32 copies of the input and of the normalized input, 4x more), so traces on CPU show GPU memory.
    Works on local tensors: a sequence-parallel DTensor input keeps its layout, and the replicated weight's
    gradient is a partial sum over the mesh dimensions the input is sharded on."""

    @staticmethod
    def forward(ctx, x, w, eps):
        xl, wl = _local(x), _local(w)
        out, rstd = _rms_norm_op(xl, wl, eps)
        ctx.save_for_backward(x, w, rstd)
        return _like(out, x)

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        xl, wl = _local(x), _local(w)
        gx, dw = _rms_norm_bwd_op(_local(g).contiguous(), xl, wl, rstd)
        dw = dw.to(wl.dtype)
        if _is_dtensor(w):
            from torch.distributed.tensor import DTensor, Partial, Replicate

            xp = getattr(x, "placements", ())
            place = [Partial() if i < len(xp) and xp[i].is_shard() else Replicate() for i in range(w.device_mesh.ndim)]
            dw = DTensor.from_local(dw, w.device_mesh, place, run_check=False)
        return _like(gx, x), dw, None


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, self.eps)


class HeadNorm(RMSNorm):
    """Qwen3's RMSNorm of q and k per head (over head_dim). Under TP the weight is a DTensor replicated over tp
    (``parallelize.apply_tp``) while each rank normalizes only its heads: its gradient is a partial sum, declared
    as such (``grad_placements=Partial``) and all-reduced over tp with the FSDP / optimizer machinery."""

    def forward(self, x):
        w = self.weight
        if _is_dtensor(w):
            from torch.distributed.tensor import Partial

            w = w.to_local(grad_placements=[Partial()])
        return _RMSNormFn.apply(x, w, self.eps)


def attend(core, checkpointed: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention call ``core(q, k, v)``, checkpointed alone under core-attn AC (``parallelize.apply_ac``:
    Megatron's selective recompute of the core attention)."""
    if not checkpointed:
        return core(q, k, v)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(core, q, k, v, use_reentrant=False, preserve_rng_state=False)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        d = spec.d_model
        self.wq = nn.Linear(d, spec.n_heads * spec.head_dim, bias=spec.has_bias("wq"))
        self.wk = nn.Linear(d, spec.n_kv_heads * spec.head_dim, bias=spec.has_bias("wk"))
        self.wv = nn.Linear(d, spec.n_kv_heads * spec.head_dim, bias=spec.has_bias("wv"))
        self.wo = nn.Linear(spec.n_heads * spec.head_dim, d, bias=spec.has_bias("wo"))
        self.q_norm = HeadNorm(spec.head_dim) if spec.qk_norm else None
        self.k_norm = HeadNorm(spec.head_dim) if spec.qk_norm else None
        # core-attn AC (``parallelize.apply_ac``): the attention call alone checkpointed, Megatron's selective
        # recompute of the core attention
        self.checkpoint_core = False

    @staticmethod
    def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                              enable_gqa=q.shape[2] != k.shape[2])

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 for heads: under TP each rank holds n_heads / tp heads
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, rope)
        o = attend(self._core, self.checkpoint_core, q, k, v)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


# Attention whose values are narrower than its queries and keys (MLA: qk 192, v 128 wide) runs as one op pair
# (``parsim::attention``, ``parsim::attention_backward``): torch's CPU SDPA has no fused kernel for unequal widths
# and falls back to the math composite, which keeps the (s, s) probabilities per head; a GPU runs it fused
# (memory-efficient attention or cuDNN: the output and the fp32 logsumexp saved, the probabilities recomputed in
# the backward). On a CPU the pair computes with the composite inside; under FakeTensorMode each is one op whose
# only allocations are its outputs, as the fused kernel's. Layout (batch, seq, heads, width) in and out.
def _scores(q, k):
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    n = q.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~causal, float("-inf"))


@torch.library.custom_op("parsim::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal softmax(q k^T / sqrt(d_qk)) v in q's dtype, (b, s, h, d_v); fp32 logsumexp (b, h, s))."""
    s = _scores(q, k)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v.float())
    return out.to(q.dtype).contiguous(), lse


@_attention_op.register_fake
def _attention_fake(q, k, v):
    b, n, h, _ = q.shape
    return q.new_empty(b, n, h, v.shape[-1]), q.new_empty(b, h, n, dtype=torch.float32)


@torch.library.custom_op("parsim::attention_backward", mutates_args=())
def _attention_bwd_op(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the probabilities recomputed from q, k and the logsumexp."""
    p = torch.exp(_scores(q, k) - lse[..., None])
    gf = g.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, gf)
    dp = torch.einsum("bqhd,bkhd->bhqk", gf, v.float())
    ds = p * (dp - (gf * out.float()).sum(-1).transpose(1, 2)[..., None]) * q.shape[-1] ** -0.5
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.float())
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_attention_bwd_op.register_fake
def _attention_bwd_fake(g, q, k, v, out, lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _Attention(torch.autograd.Function):
    """Causal attention saving q, k, v, its output and the logsumexp, as a fused kernel does."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = _attention_op(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        return _attention_bwd_op(g.contiguous(), *ctx.saved_tensors)


def latent_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """MLA's attention call: (b, s, h, d_qk) q and k, (b, s, h, d_v) v -> (b, s, h, d_v)."""
    return _Attention.apply(q, k, v)


class LatentAttention(nn.Module):
    """Multi-head latent attention as torchtitan's DeepSeek-V3 runs it: the query through a low-rank projection
    and its RMSNorm (``wq_a``, ``q_norm``, ``wq_b``; one ``wq`` without a q LoRA), the keys and values through a
    shared latent (``wkv_a`` to kv_lora_rank plus one rotary key of qk_rope_head_dim shared by every head,
    ``kv_norm``, ``wkv_b`` to every head's no-rope key and value), RoPE on the rope parts only, each head's key
    the concatenation of its no-rope key and the shared rotary key, SDPA with qk and v head widths apart, ``wo``.
    What autograd keeps per layer: the latents' norm inputs (views of ``wq_a`` / ``wkv_a`` outputs) and rstd, the
    norm outputs (the up-projections' inputs), the concatenated q and k and the ``wkv_b`` output (v is a view of
    it) that the attention saves, its output and logsumexp (``latent_core``)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        m = spec.mla
        assert m is not None
        self.m = m
        self.qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        mats = spec.attention_matrices()  # (in, out) per linear; a bias where the spec has one (DeepSeek: none)

        def linear(name: str) -> nn.Linear:
            return nn.Linear(*mats[name], bias=spec.has_bias(name))

        if m.q_lora_rank:
            self.wq_a, self.q_norm, self.wq_b = linear("wq_a"), RMSNorm(m.q_lora_rank), linear("wq_b")
        else:
            self.wq = linear("wq")
        self.wkv_a, self.kv_norm, self.wkv_b = linear("wkv_a"), RMSNorm(m.kv_lora_rank), linear("wkv_b")
        self.wo = linear("wo")
        self.checkpoint_core = False  # core-attn AC, as ``Attention``

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        m = self.m
        q = self.wq_b(self.q_norm(self.wq_a(x))) if m.q_lora_rank else self.wq(x)
        q_nope, q_pe = torch.split(q.view(b, s, -1, self.qk_head_dim), [m.qk_nope_head_dim, m.qk_rope_head_dim],
                                   dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, -1, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = torch.split(kv, [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q_pe, k_pe = apply_rope(q_pe, k_pe.unsqueeze(2), rope)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return self.wo(attend(latent_core, self.checkpoint_core, q, k, v).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, d_ff: int):
        super().__init__()
        self.gated = spec.mlp == "swiglu"
        self.w1 = nn.Linear(spec.d_model, d_ff, bias=spec.has_bias("w1"))
        self.w2 = nn.Linear(d_ff, spec.d_model, bias=spec.has_bias("w2"))
        if self.gated:
            self.w3 = nn.Linear(spec.d_model, d_ff, bias=spec.has_bias("w3"))

    def forward(self, x):
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class _GroupedMM(torch.autograd.Function):
    """y[rows of expert e] = x[rows of e] @ w[e], with one output tensor and, in backward, one gradient tensor
    per operand, as a grouped GEMM kernel (torch._grouped_mm on CUDA) writes them. (A Python loop over ``w[e]``
    would make autograd materialize a zero-filled full-size weight gradient per expert and add them up; over
    ``w.unbind(0)`` it keeps every expert's gradient beside their stacked copy: transients of E x, then 2 x the
    weights that a grouped kernel does not have.)"""

    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        y, start = None, 0
        for e, n in enumerate(counts):
            r = x[start:start + n] @ w[e]  # the dtype autocast picks, if any
            if y is None:
                y = r.new_empty(x.shape[0], w.shape[2])
            y[start:start + n] = r
            start += n
        return y if y is not None else x.new_empty(0, w.shape[2])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx, gw = torch.empty_like(x), torch.empty_like(w)
        start = 0
        for e, n in enumerate(ctx.counts):
            ge = g[start:start + n].to(w.dtype)
            gx[start:start + n] = ge @ w[e].t()
            gw[e] = x[start:start + n].to(w.dtype).t() @ ge
            start += n
        return gx, gw, None


class GroupedExperts(nn.Module):
    """``n_local`` experts as stacked weights (E, d, ff): grouped compute, one matmul per local expert."""

    def __init__(self, d: int, d_ff: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d, d_ff))
        self.w3 = nn.Parameter(torch.empty(n_experts, d, d_ff))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_ff, d))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: tokens sorted by local expert; counts: tokens per local expert."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        if not counts:
            return x[:0]
        h = F.silu(_GroupedMM.apply(x, w1, counts)) * _GroupedMM.apply(x, w3, counts)
        return _GroupedMM.apply(h, w2, counts)


class MoE(nn.Module):
    """Token-choice top-k routing; routed experts optionally sharded over an EP process group (dp2ep):
    tokens are dispatched to the rank holding their expert with all_to_all_single and combined back."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        m = spec.moe
        self.n_experts, self.top_k = m.n_experts, m.top_k
        self.router = nn.Linear(spec.d_model, m.n_experts, bias=False)
        self.experts = GroupedExperts(spec.d_model, m.d_ff_expert, m.n_experts)
        self.shared_experts = FeedForward(spec, m.d_ff_expert * m.n_shared_experts) if m.n_shared_experts else None
        self.ep_group = None  # set by apply_ep
        self.ep_size = 1
        self.tp_mesh = None  # set by apply_tp (parallelize._tp_moe)
        self.tp_split = False  # routed tokens split over the TP ranks (EP with TP, etp = 1)
        # traces (fake tensors) cannot follow data-dependent routing: route a balanced, static share instead
        # (tokens x top_k / n_experts per expert, the capacity-factor-1 case the cost model assumes)
        self.static_routing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is not None:
            return self._tp_forward(x)
        b, s, d = x.shape
        y = self._routed(x.reshape(-1, d), self.router.weight).view(b, s, d)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def _routed(self, h: torch.Tensor, w_router: torch.Tensor) -> torch.Tensor:
        """Routed experts on tokens h (n, d): top-k routing, dispatch (over EP), experts, weighted combine."""
        scores = F.softmax(F.linear(h, w_router).float(), dim=-1)
        top_w, top_i = scores.topk(self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(-1, keepdim=True)).to(h.dtype)
        return self._dispatch(h, top_w, top_i)

    @torch.compiler.disable
    def _dispatch(self, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Sort the (token, slot) pairs by expert, run the experts (over EP), combine. Eager under torch.compile:
        the per-expert token counts are Python ints read from the routing (``tolist``), and a compiled region
        specialized on them recompiled at every new routing, up to dynamo's recompile limit (tiny-moe, ep 2 on
        2 CPU ranks: 26 graphs and a 20.5 s step against ~1 s eager; with tp 2 x ep 2 dynamo crashed in its
        symbolic sums). The router before it stays compiled."""
        n_routed = h.shape[0] * self.top_k
        if self.static_routing:
            order = torch.arange(n_routed, device=h.device)
            per, rem = divmod(n_routed, self.n_experts)
            counts = [per + (1 if e < rem else 0) for e in range(self.n_experts)]
        else:
            flat = top_i.reshape(-1)
            order = flat.argsort(stable=True)
            counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        tokens = h[order // self.top_k]
        if self.ep_size > 1:
            out = self._ep_forward(tokens, counts)
        else:
            out = self.experts(tokens, counts)
        # combine: weight, put every (token, slot) pair back in place, sum the top_k slots of each token. (An
        # index_add_ into zeros would keep the weighted outputs for its backward, one more routed-size tensor.)
        weighted = out * top_w.reshape(-1)[order].unsqueeze(-1)
        pairs = torch.empty_like(weighted).index_put_((order,), weighted)
        return pairs.view(h.shape[0], self.top_k, h.shape[1]).sum(1)

    def _tp_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE under TP, with torchtitan's communication (``apply_moe_ep_tp``, etp = 1): the block input
        (sequence-sharded under SP) is all-gathered over tp; with EP each TP rank takes a contiguous 1/tp of the
        tokens (torchtitan's ReordererSequenceParallel), so the EP all-to-alls carry T x top_k / tp tokens per
        rank and are not duplicated across TP ranks; the routed output, zero outside the rank's share, is a partial
        sum over tp, as is the shared experts' row-parallel output; their sum is reduce-scattered back to the
        sequence shard (all-reduced without SP). Backward mirrors it: the gradient of the gathered input is a partial
        sum on every TP rank (``grad_placements=Partial``) and is reduce-scattered; the router weight's gradient,
        partial too, is all-reduced over tp (as an SP norm weight's). Without EP the experts are TP-sharded on their
        hidden dimension and every TP rank routes all tokens through its slice (etp = tp).
        One difference from torchtitan, which computes the router replicated on all tokens: here it runs on the
        rank's share only (1/tp of the router FLOPs and of its saved scores), what the cost model assumes."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = self.tp_mesh
        xd = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        layout = xd.placements
        hd = xd.redistribute(mesh, [Replicate()])
        h = hd.to_local(grad_placements=[Partial()])
        b, s, d = h.shape
        flat = h.reshape(-1, d)
        w = self.router.weight
        w = w.to_local(grad_placements=[Partial()]) if isinstance(w, DTensor) else w
        if self.tp_split:
            t, r = mesh.size(), mesh.get_local_rank()
            base, extra = divmod(flat.shape[0], t)
            lo, n = r * base + min(r, extra), base + (1 if r < extra else 0)
            y = F.pad(self._routed(flat[lo:lo + n], w), (0, 0, lo, flat.shape[0] - lo - n))
        else:
            y = self._routed(flat, w)
        y = y.view(b, s, d)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hd)
        return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, layout).to_local()

    def _ep_forward(self, tokens, counts: list[int]):
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, g = self.ep_size, self.ep_group
        n_local = self.n_experts // ep
        # how many tokens each EP rank receives from us, and how many we receive from each EP rank, per expert
        sc = [counts[r * n_local:(r + 1) * n_local] for r in range(ep)]
        if self.static_routing:  # every rank sends the same balanced counts
            rc = [list(row) for row in sc]
        else:
            send_t = torch.tensor(sc, device=tokens.device)
            recv_t = torch.empty_like(send_t)
            dist.all_to_all_single(recv_t, send_t, group=g)
            rc = recv_t.tolist()
        in_splits = [sum(row) for row in sc]
        out_splits = [sum(row) for row in rc]
        recv = all_to_all_single_autograd(tokens, out_splits, in_splits, g)
        # received chunks are ordered by source rank, then local expert: regroup by local expert
        pieces = torch.split(recv, [c for row in rc for c in row])
        by_expert = [pieces[r * n_local + e] for e in range(n_local) for r in range(ep)]
        per_expert = [sum(rc[r][e] for r in range(ep)) for e in range(n_local)]
        out = self.experts(torch.cat(by_expert) if by_expert else recv, per_expert)
        # undo the regrouping, then send results back
        out_pieces = torch.split(out, [rc[r][e] for e in range(n_local) for r in range(ep)])
        back = [out_pieces[e * ep + r] for r in range(ep) for e in range(n_local)]
        back = torch.cat(back) if back else out
        return all_to_all_single_autograd(back, in_splits, out_splits, g)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        norm = RMSNorm if spec.norm == "rmsnorm" else nn.LayerNorm
        self.attention_norm = norm(spec.d_model)
        self.attention = LatentAttention(spec) if spec.mla else Attention(spec)
        self.ffn_norm = norm(spec.d_model)
        self.is_moe = spec.is_moe_layer(layer_id)
        if self.is_moe:
            self.moe = MoE(spec)
        else:
            d_ff = spec.d_ff
            self.feed_forward = FeedForward(spec, d_ff)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        f = self.moe if self.is_moe else self.feed_forward
        return h + f(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec, max_seq_len: int):
        super().__init__()
        self.spec = spec
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.d_model)
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.n_layers)})
        norm = RMSNorm if spec.norm == "rmsnorm" else nn.LayerNorm
        self.norm = norm(spec.d_model)
        self.output = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        self.register_buffer("rope", rope_cache(_rope_dim(spec), max_seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Deterministic init independent of sharding: every parameter is drawn from a generator seeded by its
        name, on the full shape, so a sharded model and a single-process model start identical."""
        for name, p in self.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + (hash_name(name) % 1_000_000_007))
            if name.endswith("norm.weight") or name.endswith("_norm.weight"):
                full = torch.ones(p.shape)
            elif name.endswith(".bias"):
                full = torch.zeros(p.shape)
            else:
                full = torch.randn(p.shape, generator=g) * 0.02
            _copy_full(p, full)
        self.rope = rope_cache(_rope_dim(self.spec), self.rope.shape[0])


def _rope_dim(spec: ModelSpec) -> int:
    """The width RoPE rotates: the head width, or MLA's rotary part of it."""
    return spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim


def hash_name(name: str) -> int:
    h = 0
    for ch in name:
        h = (h * 131 + ord(ch)) % (2**61 - 1)
    return h


def _copy_full(p: torch.Tensor, full: torch.Tensor):
    """Copy a full-shape tensor into a parameter that may be a DTensor (take this rank's shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        p.copy_(distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements))
    else:
        p.copy_(full.to(p.dtype))
