"""Per-layer quantities at a plan's local shapes: GEMMs, attention work, saved activations, parameters per rank.

Shapes per rank and microbatch: ``T = micro_batch * seq_len / cp`` tokens; TP divides head and FFN widths by
``tp`` (Megatron-LM column/row parallel linears, Shoeybi et al. 2019, arXiv:1909.08053); with sequence parallel
(Korthikanti et al. 2022, arXiv:2205.05198) the norms and residual stream are split over ``tp`` along the sequence,
and the input of the column-parallel linears is all-gathered.

Saved activations are itemized per tensor that autograd keeps (bf16 unless noted) for the PyTorch modules the
executor builds (Llama-style block: RMSNorm -> wq/wk/wv -> RoPE -> SDPA (flash, saves output + fp32 logsumexp)
-> wo -> residual -> RMSNorm -> SwiGLU). Under DTensor TP+SP the column-parallel linear saves its *all-gathered*
input (full T x d), unlike Megatron's SP which saves the shard: this is what the torch code does.

AC modes (torchtitan): ``full`` keeps the block input and recomputes the block; ``selective-op`` keeps the outputs
of every other ``aten.mm`` (odd ones in forward order; a biased linear runs ``aten.addmm``, which the policy
neither saves nor counts), SDPA outputs and reduce-scatter outputs and recomputes the
rest; ``layer:N`` fully checkpoints every N-th layer; ``core-attn`` (Megatron's selective recompute) checkpoints
the attention call alone, which drops its logsumexp and reruns it at the attention's backward. MLA is costed as
torchtitan's DeepSeek-V3 runs it: the latent down-projections and their norms, H heads of width qk_nope + qk_rope
for q and k (each key the head's no-rope part and the shared rotary key, concatenated) and v_head_dim for v
(``_latent_saved``, ``_BackwardSteps.latent_attention``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ..plan import AC_MODES, PP_SCHEDULES
from ..spec import ModelSpec
from .ring import ring_backward_extra_bytes
from .rows import unique_rows

if TYPE_CHECKING:
    from ..codec import PlanBatch

FIRST, LAST = 0, 1  # the two ranks the model evaluates: pipeline stage 0 and the last stage


def stage_bounds(n_layers: int, n_stages: int) -> list[int]:
    """Layer index where each stage starts (and the end): even stages, the first ones one layer longer when the
    layers do not divide."""
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


@lru_cache(maxsize=4096)
def _rank_layers(spec: ModelSpec, pp: int, v: int) -> tuple:
    """(n_dense, n_moe) for the first and the last pipeline rank. Stages are filled evenly, the first stages
    taking one extra layer when the layers do not divide; stage s runs on rank s % pp (loop placement)."""
    n_stages = pp * v
    bounds = stage_bounds(spec.n_layers, n_stages)
    out = []
    for rank in (0, pp - 1):
        dense = moe = 0
        for s in range(rank, n_stages, pp):
            for i in range(bounds[s], bounds[s + 1]):
                if spec.is_moe_layer(i):
                    moe += 1
                else:
                    dense += 1
        out.append((dense, moe))
    return tuple(out)


@lru_cache(maxsize=8192)
def _rank_ckpt(spec: ModelSpec, pp: int, v: int, every: int, before_pp: bool) -> tuple:
    """(dense, MoE) blocks ``layer:every`` checkpoints on the first and the last pipeline rank. torchtitan counts
    blocks from 1 in the order one process applies AC: its stages' blocks in stage order, or, when AC is applied
    before the PP split, the whole model's (then a block's global index decides) [derived from torchtitan's
    _apply_layer_sac; executor: parallelize.apply_ac]."""
    n_stages = pp * v
    bounds = stage_bounds(spec.n_layers, n_stages)
    out = []
    for rank in (0, pp - 1):
        blocks = [i for s in range(rank, n_stages, pp) for i in range(bounds[s], bounds[s + 1])]
        picked = [i for j, i in enumerate(blocks) if ((i if before_pp else j) + 1) % every == 0]
        moe = sum(spec.is_moe_layer(i) for i in picked)
        out.append((len(picked) - moe, moe))
    return tuple(out)


def rank_ckpt(spec: ModelSpec, b) -> dict:
    """Arrays of blocks checkpointed under ``layer:N`` (0 for the other AC modes' plans), per kind and rank."""
    before = np.array([o.index("ac") < o.index("pp") for o in b.wrapper_orders] or [False])[b.wrapper_idx]
    every = np.maximum(b.ac_every, 1)
    keys = np.stack([b.pp, b.pp_stages_per_rank, every, before.astype(np.int64)], axis=1)
    uniq, inv = unique_rows(keys)
    table = np.array([_rank_ckpt(spec, int(p), int(v), int(e), bool(bp)) for p, v, e, bp in uniq], dtype=np.int64)
    t = table[np.ravel(inv)]
    return {False: (t[:, 0, 0], t[:, 1, 0]), True: (t[:, 0, 1], t[:, 1, 1])}


def rank_layers(spec: ModelSpec, pp: np.ndarray, v: np.ndarray) -> dict:
    """Arrays n_dense[r], n_moe[r] for r in (FIRST, LAST)."""
    keys = pp * 1_000_003 + v
    uniq, inv = np.unique(keys, return_inverse=True)
    table = np.array([_rank_layers(spec, int(k // 1_000_003), int(k % 1_000_003)) for k in uniq], dtype=np.int64)
    t = table[inv]  # (N, 2 ranks, 2 kinds)
    return {"dense": (t[:, 0, 0], t[:, 1, 0]), "moe": (t[:, 0, 1], t[:, 1, 1])}


class Shapes:
    """Local shapes of one plan batch: tokens per microbatch on a rank and the divisors that apply."""

    def __init__(self, spec: ModelSpec, b):
        self.spec = spec
        self.T = (b.micro_batch_size * b.seq_len / b.cp).astype(float)
        self.t = b.tp.astype(float)
        self.sp_div = np.where(b.sequence_parallel, self.t, 1.0)
        # without data parallelism FSDP applies no mixed precision: autocast keeps the residual stream (block
        # inputs, norm inputs) in fp32 while matmuls produce bf16
        self.res_b = np.where(~b.fsdp_applied & (b.param_bytes < 4), 4.0,
                              b.param_bytes.astype(float))
        # [derived] bytes of an activation element: FSDP2's MixedPrecisionPolicy casts the parameters to
        # param_dtype, so linears, attention and the elementwise ops between them produce param_dtype tensors
        # (bf16: 2 B; an fp32 plan, the fast dtype of CPUs without bf16 instructions: 4 B)
        self.act_b = b.param_bytes.astype(float)
        # Transformer Engine layers (Megatron-Core): a float8 linear keeps its input in float8 (1 B) for the weight
        # gradient, else in param_dtype [derived: TE's Linear / LayerNormLinear save the quantized input]
        self.te = b.te_layers
        # torch's ring attention (CP, torch layers) merges its partial outputs in fp32 and returns a contiguous
        # (batch, heads, seq, head_dim) output: the (batch, seq, heads x head_dim) input of wo is then a copy
        # (flash SDPA's own output is laid out so that this reshape is a view) [derived; trace]
        self.cp_copy = (b.cp > 1) & ~b.te_layers
        # ... unless a rank holds one head: the (batch, 1, seq, head_dim) output transposed is still contiguous (a
        # dimension of size 1 has no stride to respect), and the reshape is a view [derived: torch's view rules;
        # trace: cp2 x tp2, 2 heads, one (12, 32, 1, 64) bf16 copy fewer than the model's, +0.64% before]
        self.wo_input_copy = self.cp_copy & (spec.n_heads / self.t > 1)
        self.f8b = np.where(b.float8, 1.0, self.act_b)
        self.seq = b.seq_len.astype(float)
        self.seq_local = (b.seq_len / b.cp).astype(float)  # a microbatch's sequence positions on a rank
        self.etp = b.etp_eff.astype(float)
        self.ep = b.ep.astype(float)
        # routed tokens split over tp when experts are whole under TP (etp = 1: each TP rank routes a contiguous
        # 1/tp of the gathered tokens, with or without SP, executor: MoE._tp_forward); all of them when experts
        # are TP-sharded (etp = tp, or ep = 1 under TP)
        self.routed_split = (b.etp_eff == 1) & (b.tp > 1)
        m = spec.moe
        if m is not None:
            t_moe = np.where(self.routed_split, self.T / self.t, self.T)
            self.Tr = t_moe * m.top_k * m.capacity_factor  # routed (token, expert) pairs computed on this rank


def gemms(spec: ModelSpec, sh: Shapes, moe: bool) -> list[tuple]:
    """Forward GEMMs of one layer in execution order: (name, flops, FLOPs of one kernel (for its efficiency),
    elements read (input + weight, for float8 casts), kind). kind: mm (aten.mm, alternately saved by selective
    AC), addmm (a biased linear: never saved by selective AC), gmm (grouped expert GEMM)."""
    T, t = sh.T, sh.t
    out = []

    def add(name, tokens, k, n, div, kind="mm", n_kernels=1.0):
        f = 2.0 * tokens * k * n / div
        out.append((name, f, f / n_kernels, tokens * k + k * n * n_kernels / div, kind))

    for name, (k, n) in spec.attention_matrices().items():
        # MLA down-projections are not TP-sharded
        add(name, T, k, n, 1.0 if name in ("wq_a", "wkv_a") else t, linear_kind(spec, name))
    if not moe:
        for name, (k, n) in spec.mlp_matrices(spec.d_ff).items():
            add(name, T, k, n, t, linear_kind(spec, name))
        return out
    m = spec.moe
    assert m is not None  # moe layers exist only with a MoESpec
    add("router", sh.Tr / (m.top_k * m.capacity_factor), spec.d_model, m.n_experts, 1.0)
    for name, (k, n) in spec.routed_expert_matrices(m.d_ff_expert).items():
        add(f"experts.{name}", sh.Tr, k, n, sh.etp, "gmm", n_kernels=m.n_experts / sh.ep)
    if m.n_shared_experts:
        for name, (k, n) in spec.mlp_matrices(m.d_ff_expert * m.n_shared_experts).items():
            add(f"shared.{name}", T, k, n, t, linear_kind(spec, f"shared.{name}"))
    return out


def linear_kind(spec: ModelSpec, name: str) -> str:
    """The aten op a dense linear runs: ``addmm`` where it has a bias, else ``mm``. ``F.linear`` with a bias
    on a contiguous 2-D or 3-D input dispatches ``aten.addmm`` (ATen ``linear`` / ``_flatten_nd_linear``), without
    one ``aten.mm`` (through ``matmul``). torchtitan's selective-op policy saves and counts ``aten.mm`` only, so a
    biased linear's output is recomputed and does not advance the every-other-mm count [derived: the policy;
    differential trace, a 4-layer model with biases on every linear under selective-op: the model kept every
    odd mm's output and was +35% over the trace before]."""
    return "addmm" if spec.has_bias(name) else "mm"


def attention_flops(spec: ModelSpec, sh: Shapes) -> np.ndarray:
    """Forward FLOPs of the attention core (QK^T and AV) per rank and microbatch, causal: each of the T local
    queries attends on average to half of the seq keys (CP load-balanced): 2 * T * seq/2 * H/tp * (d_qk + d_v)."""
    return sh.T * sh.seq * (spec.n_heads / sh.t) * (spec.d_qk_head + spec.d_v_head)


def _qkv_saved(spec: ModelSpec, sh: Shapes) -> list[tuple[str, np.ndarray, str]]:
    """What the q / k / v projections keep (MLA's low-rank projections and norms; Qwen3's q / k norms)."""
    T, t = sh.T, sh.t
    b2, b4 = sh.act_b, 4.0
    out: list[tuple[str, np.ndarray, str]] = []
    mats = spec.attention_matrices()
    if spec.mla:
        return _latent_saved(spec, sh)
    for name in ("wq", "wk", "wv"):
        if name in mats:
            out.append((f"{name}.out", T * mats[name][1] / t * b2, linear_kind(spec, name)))
    if spec.qk_norm:
        # Qwen3: q and k are RMS-normalized per head before RoPE: the norms keep their input (the mm outputs above)
        # and a fp32 1/rms per head and token; the rotated q and k (new tensors) are what attention keeps
        hq, hk, hd = spec.n_heads / t, spec.n_kv_heads / t, spec.head_dim
        out += [("q_norm.rstd", T * hq * b4, "other"), ("k_norm.rstd", T * hk * b4, "other"),
                ("q.rotated", T * hq * hd * b2, "other"), ("k.rotated", T * hk * hd * b2, "other")]
    return out


def _latent_saved(spec: ModelSpec, sh: Shapes) -> list[tuple[str, np.ndarray, str]]:
    """What MLA's projections keep, in forward (mm) order, as torchtitan's DeepSeek-V3 attention runs them
    (``executor.model.LatentAttention``): the q latent (``wq_a``'s output, the q norm's input) with its norm's fp32
    1/rms and output (``wq_b``'s input), the query (the size of ``wq_b``'s output: the attention keeps its
    concatenation of no-rope and rotated parts), the kv latent with the rotary key (``wkv_a``'s output: the kv
    norm keeps a view of it), its norm's 1/rms and output (``wkv_b``'s input), ``wkv_b``'s output (the values the
    attention keeps are a view of it) and the concatenated keys, a new (T, heads, qk width) tensor [derived;
    trace: 2 layers of d 1024, 8 heads of qk 96 / v 64, q LoRA 384, kv LoRA 128: the keys and the two 1/rms per
    layer, -1.4% before]."""
    m = spec.mla
    assert m is not None
    T, t, b2, b4 = sh.T, sh.t, sh.act_b, 4.0
    out: list[tuple[str, np.ndarray, str]] = []
    wq = "wq_b" if m.q_lora_rank else "wq"
    if m.q_lora_rank:
        out += [("wq_a.out", T * m.q_lora_rank * b2, linear_kind(spec, "wq_a")), ("q_norm.rstd", T * b4, "other"),
                ("q_norm.out", T * m.q_lora_rank * b2, "other")]
    out += [(f"{wq}.out", T * spec.q_dim / t * b2, linear_kind(spec, wq)),
            ("wkv_a.out", T * (m.kv_lora_rank + m.qk_rope_head_dim) * b2, linear_kind(spec, "wkv_a")),
            ("kv_norm.rstd", T * b4, "other"), ("kv_norm.out", T * m.kv_lora_rank * b2, "other"),
            ("wkv_b.out", T * spec.n_heads * (m.qk_nope_head_dim + m.v_head_dim) / t * b2, linear_kind(spec, "wkv_b")),
            ("k.concatenated", T * spec.kv_dim / t * b2, "other")]
    return out


def saved_tensors(spec: ModelSpec, sh: Shapes, moe: bool) -> list[tuple[str, np.ndarray, str]]:
    """Tensors autograd keeps for one layer, in bytes: (name, bytes, kind). kind: input (the block input),
    mm (output of an aten.mm), addmm (of a biased linear), gmm (grouped GEMM output), sdpa (attention output /
    logsumexp), rs (reduce-scatter output), a2a (EP all-to-all output), other (elementwise / norm inputs). rs and
    a2a are not saved by autograd, only cached by selective AC."""
    T, t, sd = sh.T, sh.t, sh.sp_div
    d = spec.d_model
    b2, b4 = sh.act_b, 4.0  # activations in param_dtype; norm rstd, logsumexp, router scores in fp32 [derived]
    rb = sh.res_b
    te = sh.te
    # the norm output a column-parallel linear keeps: gathered over tp (torch SP: the all-gather's output is what
    # the matmul saves), or, under TE layers, the local sequence shard in float8 / param_dtype, all-gathered again
    # in the backward (TE LayerNormLinear with sequence_parallel) [derived]
    norm_out = np.where(te, T * d / sd * sh.f8b, T * d * b2)
    # under autocast (no FSDP, bf16: the residual stream and the norms' outputs fp32) each linear reading a norm's
    # output casts it to bf16 itself (autocast caches weights, not activations) and its matmul keeps that copy:
    # one per input projection (q, k, v) and per MLP input linear (w1, and w3 for SwiGLU), each released by its
    # own linear's backward [derived from torch.autocast; trace of a 1-layer TP 2 model: six (T, d) bf16 casts
    # at the end of the forward: q, k, v, w1, w3 and the output projection]
    cast_each = (rb > b2) & ~te
    mats = spec.attention_matrices()
    out = [
        ("attention_norm.input", T * d / sd * rb, "input"),
        ("attention_norm.rstd", T / sd * b4, "other"),
        ("attention_norm.output(gathered)", norm_out, "other"),
    ]
    out += [(f"attention_norm.output(cast {w})", np.where(cast_each & (not spec.mla) & (w in mats), norm_out, 0.0),
             "other") for w in ("wk", "wv")]
    # (MLA: wq_a / wq and wkv_a read the norm's output, each through its own cast)
    out.append(("attention_norm.output(cast wkv_a)", np.where(cast_each & (spec.mla is not None), norm_out, 0.0),
                "other"))
    out += _qkv_saved(spec, sh)
    rope_dim = spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim
    out += [
        # the cos and sin (hd/2 each) the rotation keeps: one (positions, hd/2, 2) table in q's dtype per layer and
        # microbatch, a copy of the fp32 cache where q is bf16 and a view of it (no bytes) where q is fp32; TE's
        # fused RoPE recomputes them [derived: executor.model.apply_rope; trace: fp32, micro batch 4, tp 6, one
        # (1536, 32) table per layer fewer than the model's per-token count, +0.7% before]
        ("rope.cos_sin", np.where(te | (b2 >= 4.0), 0.0, sh.seq_local * rope_dim * b2), "other"),
        ("sdpa.out", T * spec.attn_out_dim / t * b2, "sdpa"),
        # under TE with float8 the output projection keeps its own float8 copy of the attention output
        ("wo.input(float8)", np.where(te & (sh.f8b < b2), T * spec.attn_out_dim / t * sh.f8b, 0.0), "other"),
        ("wo.input(CP copy)", np.where(sh.wo_input_copy, T * spec.attn_out_dim / t * b2, 0.0), "other"),
        ("sdpa.logsumexp", T * spec.n_heads / t * b4, "sdpa"),
        ("wo.out", T * d * b2, linear_kind(spec, "wo")),
    ]
    out += [("wo.reduce_scatter.out", np.where(sd > 1, T * d / sd * b2, 0.0), "rs"),
            ("ffn_norm.input", T * d / sd * rb, "other"), ("ffn_norm.rstd", T / sd * b4, "other"),
            ("ffn_norm.output(gathered)", norm_out, "other"),
            ("ffn_norm.output(cast w3)", np.where(cast_each & (not moe) & (spec.mlp == "swiglu"), norm_out, 0.0),
             "other")]
    if not moe:
        out += _mlp_saved(spec, T, spec.d_ff / t, "mlp", T * d * b2, b2, te=te, f8b=sh.f8b)
    else:
        out += _moe_saved(spec, sh)
    out.append(("mlp.reduce_scatter.out", np.where(sd > 1, T * d / sd * b2, 0.0), "rs"))
    return out


def _moe_saved(spec: ModelSpec, sh: Shapes) -> list[tuple[str, np.ndarray, str]]:
    """``saved_tensors`` of a MoE layer's FFN part: the router's, the routed tokens' and experts', the shared
    experts'."""
    T, t, d, b2, b4, rb = sh.T, sh.t, spec.d_model, sh.act_b, 4.0, sh.res_b
    mo = spec.moe
    assert mo is not None
    t_router = sh.Tr / (mo.top_k * mo.capacity_factor)
    out = [("router.logits", t_router * mo.n_experts * b4, "mm"),
           ("router.probs", t_router * mo.n_experts * b4, "other"),
           # (the norm's output gathered by token: fp32 under autocast, where only linears cast their input)
           # EP: the dispatch all-to-all's output (the received tokens, before their regrouped copy) and the
           # combine's (the experts' output sent back): autograd saves neither, selective AC caches both (the
           # policy saves all-to-all outputs, as torchtitan's does for its MoE models) [derived:
           # executor.parallelize._sac_policy; trace: 7 MoE layers, ep 2 x cp 2, selective AC: two (192, 576)
           # bf16 all-to-all outputs per layer alive at the output projection's backward, -2.1% before]
           ("experts.dispatch(all-to-all)", np.where(sh.ep > 1, sh.Tr * d * rb, 0.0), "a2a"),
           ("experts.input(permuted)", sh.Tr * d * rb, "other")]
    # (routed experts: SwiGLU whatever the model's MLP, ``spec.routed_expert_matrices``)
    experts = _mlp_saved(spec, sh.Tr, mo.d_ff_expert / sh.etp, "experts", sh.Tr * d * b2, b2, kind="gmm",
                         mlp="swiglu")
    # (the combine's all-to-all runs before the routing weights' product, which saves the experts' output: with
    # EP the tokens that all-to-all returned, a tensor the recompute takes back from the cache)
    out += experts[:-1] + [("experts.combine(all-to-all)", np.where(sh.ep > 1, sh.Tr * d * b2, 0.0), "a2a"),
                           experts[-1]]
    if mo.n_shared_experts:
        out += _mlp_saved(spec, T, mo.d_ff_expert * mo.n_shared_experts / t, "shared", T * d * b2, b2)
    return out


def _mlp_saved(spec, T, ff_local, prefix, out_bytes, b2, kind="mm", te=False, f8b=None, mlp=None):
    """The MLP's saved tensors. Under TE layers (Megatron-Core) the fused bias-SwiGLU / GeLU keeps only its
    input (the fc1 output) and recomputes the activation in its backward, and fc2 keeps its input in float8 when
    float8 is on [derived: megatron.core.fusions.fused_bias_swiglu saves its input; TE Linear the quantized
    input]."""
    f8b = b2 if f8b is None else f8b
    act = np.where(te, 0.0, T * ff_local * b2)  # the activation's own output, kept apart only without TE
    w2_in = np.where(te, T * ff_local * f8b, T * ff_local * b2)
    def k(w):  # dense and shared-expert linears: mm, or addmm with a bias; routed experts: gmm
        return linear_kind(spec, f"shared.{w}" if prefix == "shared" else w) if kind == "mm" else kind

    if (mlp or spec.mlp) == "swiglu":
        return [(f"{prefix}.w1.out", T * ff_local * b2, k("w1")), (f"{prefix}.silu.out", act, "other"),
                (f"{prefix}.w3.out", T * ff_local * b2, k("w3")), (f"{prefix}.w2.input", w2_in, "other"),
                (f"{prefix}.w2.out", out_bytes, k("w2"))]
    # GeLU: its output is fc2's input (float8 under TE with float8)
    return [(f"{prefix}.w1.out", T * ff_local * b2, k("w1")), (f"{prefix}.gelu.out", w2_in, "other"),
            (f"{prefix}.w2.out", out_bytes, k("w2"))]


def kept_by_ac_mode(items: list[tuple], e_local=None) -> list[dict]:
    """For each saved tensor of ``saved_tensors``: is it kept under ``none``, ``full``, ``sac`` (selective-op),
    ``attn`` (core-attn)?

    ``attn`` checkpoints the attention call alone (``F.scaled_dot_product_attention`` on the rotated q, k, v; TE's
    core attention under Megatron): what it saves inside is dropped and recomputed at its backward, which is the
    logsumexp only — its inputs are held by the checkpoint for the recompute, and its output is the saved input of
    wo (one tensor, kept as without AC) [derived: torch.utils.checkpoint's non-reentrant frame keeps the
    function's inputs; the recompute runs when the attention's backward unpacks its first saved tensor,
    ``layers._BackwardSteps.attention``].

    The saved output of wo / w2 is counted only when it is not immediately consumed by a residual add (it is
    the input of nothing that saves it) — so under no AC it is dropped; selective AC stores it when its mm is
    odd-numbered, as the policy does. The routed experts' output is the exception: it is multiplied by the
    routing weights, which keeps it for the router's gradient (executor trace of mixtral-8x7b: one T x top_k x d
    tensor per MoE layer and microbatch; torchtitan's MoE multiplies its routed output by the scores too).
    A grouped expert GEMM (``gmm``) runs one aten.mm per local expert (``executor.model._GroupedMM``), which the
    policy counts like any other: it keeps the odd-numbered ones' outputs, so with ``e_local`` (local experts per
    plan) the ``sac`` entry of a gmm is the fraction kept — a half with an even count, (e +- 1) / 2e with an odd
    one — and the parity of every later mm follows (without ``e_local``: kept whole) [derived from the policy
    counting aten.mm; trace: 4 local experts of d_ff 2048 under selective AC, +3.1% before]."""
    out = []
    odd = 0  # parity of the aten.mm's counted so far (a biased linear's addmm is neither saved nor counted)
    for name, _nbytes, kind in items:
        residual_out = name.endswith("wo.out") or (name.endswith("w2.out") and not name.startswith("experts."))
        sac = kind in ("input", "sdpa", "rs", "a2a") or (kind == "gmm" and e_local is None)
        if kind == "mm":
            odd = 1 - odd
            sac = odd == 1
        elif kind == "gmm" and e_local is not None:
            sac, odd = grouped_mm_kept(e_local, odd)
        none = not residual_out and kind not in ("rs", "a2a")
        out.append({"none": none, "full": kind == "input", "sac": sac, "attn": none and name != "sdpa.logsumexp"})
    return out


def grad_elem_bytes(b) -> np.ndarray:
    """Bytes of an unsharded weight-gradient element: param_dtype under FSDP (its mixed precision), the fp32
    parameters' own without."""
    return np.where(b.fsdp_applied, b.param_bytes, 4.0).astype(float)


def local_experts(spec: ModelSpec, sh: Shapes) -> np.ndarray:
    """Routed experts on a rank (n_experts / ep: whole experts under EP, all of them TP-sharded without)."""
    assert spec.moe is not None
    return spec.moe.n_experts / sh.ep


def grouped_mm_kept(e_local, odd):
    """(the fraction of a grouped GEMM's per-expert mm outputs selective AC keeps, the mm parity after it):
    ``e_local`` mm's follow ``odd`` (parity of those before); the odd-numbered ones are kept."""
    e = np.maximum(np.asarray(e_local, dtype=float), 1.0)
    e_odd = np.mod(e, 2.0)
    kept = (e + np.where(np.asarray(odd) == 0, e_odd, -e_odd)) / 2.0
    return kept / e, np.mod(np.asarray(odd) + e, 2.0).astype(int)


def moe_forward_working_bytes(spec: ModelSpec, sh: Shapes, b) -> np.ndarray:
    """Bytes a MoE block's forward holds above its input at its largest moment when it saves nothing for backward
    (a checkpointed block: its forward runs without keeping tensors, so each intermediate lives only while the
    code holds it) [derived from ``executor.model.MoE``, the torchtitan layout it follows; trace: dp_shard8 x cp4 x
    tp8, full AC, top-2 over 8 experts, 512 tokens of d 2304: at the combine's sum the routed tokens, the experts'
    output, the weighted copy and the scatter target, (1024, 2304) each, the sum (512, 2304), the gathered input,
    the attention residual and the FFN norm's output alive]. With n the block's tokens on the rank after TP's
    gather, n_r those it routes (n / tp with EP under TP), nk = n_r x top_k routed pairs, ff the expert width
    after etp, always present: the attention residual and the FFN norm's output (sequence shards under SP) and,
    under TP, the gathered input (n x d); then the largest of
      * the combine's sum: routed tokens, experts' output, weighted copy, scatter target (4 nk x d) and the
        sum (n_r x d);
      * the experts' SwiGLU product: routed tokens (with EP also the received tokens and their regrouped copy,
        2 nk x d more), silu output, w3 output and their product (3 nk x ff);
      * with EP, the combine's all-to-all back: routed tokens, received tokens, experts' output, its regrouped
        copy, the returned tokens (5 nk x d);
      * the shared experts (after the routed ones): the routed output (n x d) and their MLP's largest moment
        (3 hidden tensors for SwiGLU, 2 for GeLU, n x ff_shared / tp).
    Router scores and indices (n x experts in fp32 and less) are left out."""
    m = spec.moe
    if m is None:
        return np.zeros_like(sh.T)
    d, b2 = float(spec.d_model), sh.act_b
    n, n_loc = sh.T, sh.T / sh.sp_div
    nk = sh.Tr
    n_r = nk / (m.top_k * m.capacity_factor)
    ff = m.d_ff_expert / sh.etp
    ep_on = np.where(b.ep > 1, 1.0, 0.0)
    base = n_loc * d * (sh.res_b + b2) + np.where(sh.t > 1, n * d * b2, 0.0)
    combine = (4.0 * nk + n_r) * d * b2
    experts = (nk * (1.0 + 2.0 * ep_on) * d + 3.0 * nk * ff) * b2
    ep_back = 5.0 * nk * d * b2 * ep_on
    shared = 0.0
    if m.n_shared_experts:
        hidden = 3.0 if spec.mlp == "swiglu" else 2.0
        shared = (n * d + hidden * n * m.d_ff_expert * m.n_shared_experts / sh.t) * b2
    return base + np.maximum(np.maximum(combine, experts), np.maximum(ep_back, shared))


def recompute_experts_extra_bytes(spec: ModelSpec, sh: Shapes, b, sac: bool) -> np.ndarray:
    """Bytes above a recomputed MoE block's saved tensors at the recompute's last expert GEMM (w2's, the last op
    before the combine, every saved tensor of the experts made). Full AC: with EP the routed tokens and the tokens
    the dispatch all-to-all received (nk x d each in the stream's dtype, held by the code; the GEMMs read their
    regrouped copy, which is saved), and the grouped GEMM's per-expert outputs (``executor.model._GroupedMM``:
    each expert's matmul output is made before the previous one is dropped, so two are alive with 2+ local
    experts; with one, the output and the whole result). Selective AC (``sac``): the same tokens (the received
    ones are the cached all-to-all output, still held) and the combine's cached all-to-all output, not yet taken
    back, and one per-expert output (every other one comes from the cache); w2's cached outputs, also not yet
    taken back, are the caller's (their share depends on the matmul count). [derived; traces: 1 MoE layer, 8
    experts top-2, dp_shard 2 x ep 2 x tp 2 SP, 256 routed tokens of d 256 fp32: full AC, the (512, 256) routed
    and received tokens and two (128, 256) matmul outputs alive at w2's GEMM in the recompute, -7.5% before with
    the gradient and input of ``memory.Block.recompute_held``; selective AC, -7.7% before]"""
    m = spec.moe
    if m is None:
        return np.zeros_like(sh.T)
    e = np.maximum(local_experts(spec, sh), 1.0)
    pairs = sh.Tr * float(spec.d_model)
    tokens = 2.0 * pairs * sh.res_b + (pairs * sh.act_b if sac else 0.0)
    temps = (np.minimum(e, 1.0) if sac else np.minimum(e, 2.0)) / e * pairs * sh.act_b
    return np.where(b.ep > 1, tokens, 0.0) + temps


def activation_bytes(spec: ModelSpec, sh: Shapes, moe: bool) -> dict[str, np.ndarray]:
    """Bytes kept per layer and microbatch: ``none`` (no AC), ``full`` (block input only), ``sac`` (selective-op),
    ``attn`` (core-attn)."""
    split = activation_bytes_split(spec, sh, moe)
    return {mode: split[mode][0] + split[mode][1] for mode in split}


def activation_bytes_split(spec: ModelSpec, sh: Shapes, moe: bool) -> dict[str, tuple]:
    """``activation_bytes`` split into (attention part, FFN / MoE part): the backward frees the FFN part first
    (the memory timeline's moments inside a MoE block, whose experts reduce between the two)."""
    items = saved_tensors(spec, sh, moe)
    keep = kept_by_ac_mode(items, local_experts(spec, sh) if moe else None)
    ffn_start = next(i for i, (name, _, _) in enumerate(items) if name == "ffn_norm.input")
    out = {}
    for mode in ("none", "full", "sac", "attn"):
        parts = [np.zeros_like(sh.T), np.zeros_like(sh.T)]
        for i, ((_, nbytes, _), k) in enumerate(zip(items, keep, strict=True)):
            parts[int(i >= ffn_start)] = parts[int(i >= ffn_start)] + nbytes * np.asarray(k[mode], dtype=float)
        out[mode] = (parts[0], parts[1])
    return out


def layer_tensors(spec: ModelSpec, b, moe: bool) -> list[tuple[str, np.ndarray, np.ndarray, bool]]:
    """One layer's parameter tensors on a rank, as the executor (torchtitan's modules and TP plan) holds them:
    (name, rows, elements per row, routed expert?). ``rows`` is the dimension FSDP2 shards (dim 0 after TP / EP;
    dim 1 for routed experts whose expert-FSDP group outnumbers the local experts, torchtitan's rule, when it
    divides), so that a rank's FSDP shard of a tensor is ``ceil(rows / shards) x per_row`` elements: FSDP2 chunks
    dim 0 like ``torch.chunk`` and pads every shard to the first one (the rank-0 shard, the largest) [derived from
    torch.distributed.fsdp._fully_shard._fsdp_param; trace]. nn.Linear(k, n).weight is (n, k): column-parallel
    weights (q, k, v, w1, w3, MLA's up-projections) shard rows over tp, row-parallel ones (wo, w2) columns;
    biases follow their weight's output dimension; norms, q/k norms, the router and MLA's down-projections are
    replicated."""
    t = b.tp.astype(float)
    one = np.ones_like(t)
    out: list[tuple[str, np.ndarray, np.ndarray, bool]] = []

    def linear(name, k, n, col: bool):
        if col:
            out.append((name, n / t, k * one, False))
            if spec.has_bias(name):
                out.append((f"{name}.bias", n / t, one, False))
        else:
            out.append((name, n * one, k / t, False))
            if spec.has_bias(name):
                out.append((f"{name}.bias", n * one, one, False))

    for name, (k, n) in spec.attention_matrices().items():
        if name in ("wq_a", "wkv_a"):  # MLA down-projections: replicated over tp
            out.append((name, n * one, k * one, False))
            if spec.has_bias(name):
                out.append((f"{name}.bias", n * one, one, False))
        else:
            linear(name, k, n, name != "wo")
    norm = 2 if spec.norm == "layernorm" else 1
    out += [("norm", spec.d_model * one, one, False)] * (2 * norm)
    if spec.qk_norm:
        out += [("qk_norm", spec.head_dim * one, one, False)] * 2
    if spec.mla:
        out.append(("kv_norm", spec.mla.kv_lora_rank * one, one, False))
        if spec.mla.q_lora_rank:
            out.append(("q_norm", spec.mla.q_lora_rank * one, one, False))
    if not moe:
        for name, (k, n) in spec.mlp_matrices(spec.d_ff).items():
            linear(name, k, n, name != "w2")
        return out
    m = spec.moe
    assert m is not None
    out.append(("router", m.n_experts * one, spec.d_model * one, False))
    if m.n_shared_experts:
        for name, (k, n) in spec.mlp_matrices(m.d_ff_expert * m.n_shared_experts).items():
            linear(f"shared.{name}", k, n, name != "w2")
    e_local = m.n_experts / b.ep.astype(float)
    for name, (dim1, dim2), on_dim1 in _stacked_experts(spec, b):
        out.append((name, np.where(on_dim1, dim1, e_local), np.where(on_dim1, e_local * dim2, dim1 * dim2), True))
    return out


def _stacked_experts(spec: ModelSpec, b) -> list[tuple[str, tuple, np.ndarray]]:
    """The routed experts' stacked weights on a rank: (name, (dim 1, dim 2) of one expert's, where FSDP shards dim
    1). (experts, d, ff) for w1 / w3 and (experts, ff, d) for w2; FSDP shards dim 1 when the expert-FSDP mesh
    (dp_replicate x efsdp) outnumbers the local experts (torchtitan: efsdp x ep > experts) and efsdp divides it,
    else dim 0 (executor: parallelize.apply_fsdp)."""
    m = spec.moe
    assert m is not None
    e_local = m.n_experts / b.ep.astype(float)
    ff = m.d_ff_expert / b.etp_eff.astype(float)
    d = float(spec.d_model)
    by_dim1 = (b.ep > 1) & (b.dp_replicate * b.efsdp > e_local)
    return [(name, (dim1, dim2), by_dim1 & (np.mod(dim1, np.maximum(b.efsdp, 1)) == 0))
            for name, dim1, dim2 in (("experts.w1", d, ff), ("experts.w3", d, ff), ("experts.w2", ff, d))]


def experts_off_dim0(spec: ModelSpec, b) -> tuple[np.ndarray, np.ndarray]:
    """(elements of the rank's routed-expert weights FSDP shards on dim 1, whether the last registered one, w2, is
    among them). FSDP2 all-gathers on dim 0: such a weight's copy-out goes through a temporary of its unsharded
    size (``foreach_all_gather_copy_out``: ``empty_like`` per weight, then ``chunk_cat`` into the parameter), and
    its gradient is copied into dim-0 order before the reduce (``foreach_reduce``: ``torch.cat(chunks)`` replaces
    the list entry while the loop variable still holds the original) [derived from torch 2.13
    torch.distributed.fsdp._fully_shard._fsdp_collectives; trace: mixtral 4 layers, ep 4 over 64 ranks, three
    224 MiB ``empty_like`` temporaries at the copy-out moment]."""
    zero = np.zeros(len(b.tp))
    if spec.moe is None:
        return zero, zero.astype(bool)
    m = spec.moe
    e_local = m.n_experts / b.ep.astype(float)
    total, last = zero, zero.astype(bool)
    for _name, (dim1, dim2), on_dim1 in _stacked_experts(spec, b):
        total = total + np.where(on_dim1, e_local * dim1 * dim2, 0.0)
        last = on_dim1
    return total, last


def last_param_elems(spec: ModelSpec, b, moe: bool) -> tuple[np.ndarray, np.ndarray]:
    """Elements on a rank of the last parameter (in module registration order) of a block's FSDP unit and of its
    routed experts' own unit (EP; zeros otherwise). FSDP2's ``foreach_reduce`` walks the unit's unsharded gradients
    in a ``for`` loop whose variable keeps the last one alive until the function returns, after the reduce-scatter
    output (and its fp32 copy) exist [derived from torch.distributed.fsdp._fully_shard._fsdp_collectives,
    torch 2.13; trace]. Registration order (executor.model): attention, norms, then the MLP's w1, w2, w3 (their
    biases after each weight); a MoE layer's router, stacked experts (w1, w3, w2), shared experts."""
    by_name = {name: rows * per_row for name, rows, per_row, _ in layer_tensors(spec, b, moe)}

    def mlp_last(prefix: str) -> str:
        w = "w3" if spec.mlp == "swiglu" else "w2"
        return f"{prefix}{w}.bias" if spec.has_bias(w) else f"{prefix}{w}"

    zero = np.zeros(len(b.tp))
    if not moe:
        return by_name[mlp_last("")] * np.ones(len(b.tp)), zero
    m = spec.moe
    assert m is not None
    ep1 = b.ep == 1
    experts_last = by_name["experts.w2"] * np.ones(len(b.tp))
    if m.n_shared_experts:
        blk = by_name[mlp_last("shared.")] * np.ones(len(b.tp))
    else:
        blk = np.where(ep1, experts_last, by_name["router"])
    return blk, np.where(ep1, 0.0, experts_last)


def fsdp_shard(rows: np.ndarray | float, per_row: np.ndarray | float, shards) -> np.ndarray:
    """Elements of a rank's FSDP2 shard of a tensor: rank 0's chunk, ``ceil(rows / shards)`` rows (every shard is
    padded to it)."""
    return np.ceil(rows / np.maximum(shards, 1)) * per_row


def param_tensor_counts(spec: ModelSpec, moe: bool) -> tuple[int, int]:
    """(tensors outside the routed experts, routed-expert tensors) of one layer as the executor builds it
    (torchtitan's modules): attention q, k, v, o (and their biases), q/k norms, two norms (LayerNorm: weight and
    bias), the MLP's linears (and biases), or the router, the shared experts' linears and the routed experts' three
    stacked weights. Gradient clipping takes one norm per tensor (``comm._grad_norm_records``)."""
    def linears(mats) -> int:  # weights and their biases
        return sum(2 if spec.has_bias(name) else 1 for name in mats)

    norm = 2 if spec.norm == "layernorm" else 1
    n = linears(spec.attention_matrices()) + 2 * norm + (2 if spec.qk_norm else 0)
    if spec.mla:
        n += 1 + (1 if spec.mla.q_lora_rank else 0)  # the latent norms (kv, and q with a q LoRA)
    if not moe:
        return n + linears(spec.mlp_matrices(spec.d_ff)), 0
    m = spec.moe
    assert m is not None
    shared = linears(spec.mlp_matrices(m.d_ff_expert)) if m.n_shared_experts else 0
    return n + 1 + shared, 3


def ac_counts(b, n_layers: np.ndarray, n_layer_ckpt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(layers fully checkpointed, layers under selective AC, layers without AC) among ``n_layers``;
    ``n_layer_ckpt``: how many of them ``layer:N`` checkpoints (``rank_ckpt``). Layers whose attention core alone
    is checkpointed (``core-attn``) are in none of the three: ``core_attn_counts``."""
    n = n_layers.astype(float)
    full = np.where(b.ac == AC_MODES["full"], n, np.where(b.ac == AC_MODES["layer"], n_layer_ckpt.astype(float), 0.0))
    sac = np.where(b.ac == AC_MODES["selective-op"], n, 0.0)
    return full, sac, n - full - sac - core_attn_counts(b, n_layers)


def attn_recomputed_bytes(spec: ModelSpec, sh: Shapes) -> np.ndarray:
    """What core-attn's recompute makes at the attention's backward: its output (param dtype) and fp32
    logsumexp."""
    return sh.T * (spec.attn_out_dim * sh.act_b + spec.n_heads * 4.0) / sh.t


def core_attn_counts(b, n_layers: np.ndarray) -> np.ndarray:
    """Layers among ``n_layers`` whose attention core alone is checkpointed (``core-attn``)."""
    return np.where(b.ac == AC_MODES["core-attn"], n_layers.astype(float), 0.0)


def inflight(b: PlanBatch, rank: int) -> np.ndarray:
    """Microbatches whose activations are alive at the peak, in units of one microbatch through all of the rank's
    layers. 1F1B: pp - r (warm-up forwards + 1); GPipe: all; interleaved (torch ScheduleInterleaved1F1B):
    ``min(n_micro * v, (v - 1) * pp + 2 * (pp - 1 - r)) + 1`` chunk-microbatches of 1/v of the rank's layers."""
    pp, v, m = b.pp, b.pp_stages_per_rank, b.n_micro
    r = np.zeros_like(pp) if rank == FIRST else pp - 1
    one_f_one_b = np.minimum(m, pp - r)
    inter = np.minimum(np.minimum(m * v, (v - 1) * pp + 2 * (pp - 1 - r)) + 1, m * v) / v
    out = np.where(b.pp_schedule == PP_SCHEDULES["GPipe"], m,
                   np.where(b.pp_schedule == PP_SCHEDULES["Interleaved1F1B"], inter, one_f_one_b))
    return np.where(pp == 1, 1.0, out).astype(float)


class _BackwardSteps:
    """The step list ``backward_steps`` builds, with the sizes every step uses (see there)."""

    def __init__(self, spec: ModelSpec, b, sh: Shapes, moe: bool):
        self.spec, self.b, self.sh = spec, b, sh
        self.T, self.t, self.sd, self.b2, self.rb = sh.T, sh.t, sh.sp_div, sh.act_b, sh.res_b
        self.d = float(spec.d_model)
        self.sp = self.sd > 1
        self.z = np.zeros_like(self.T)
        # the output gradient a branch's last linear (wo, w2) reads: under SP the all-gather of the residual
        # gradient (the reduce-scatter's backward); under autocast without SP its bf16 copy (the residual add's
        # backward casts the fp32 gradient to the branch output's dtype); else the residual gradient itself, no
        # new bytes [derived: aten add's backward for mixed dtypes; trace: 1 layer, tp 8, bf16 without FSDP,
        # full AC: a (1024, 512) bf16 copy of the fp32 gradient alive through the recompute]
        cast = (self.rb > self.b2) & ~sh.te
        self.g_full = np.where(self.sp | cast, self.T * self.d * self.b2, 0.0)
        self.elems = {name: rows * per_row for name, rows, per_row, _e in layer_tensors(spec, b, moe)}
        n_norm = 2.0 if spec.norm == "layernorm" else 1.0
        self.norm_pg = (n_norm * self.d * np.ones_like(self.T), self.z)
        self.steps: list[dict] = []

    def pg(self, *names, expert=False):
        z = self.z
        tot = sum((self.elems.get(n, z) + self.elems.get(f"{n}.bias", z) for n in names), z)
        return (z, tot) if expert else (tot, z)

    def step(self, alloc=0.0, free=0.0, saved=(), pgrad=(0.0, 0.0), cast=True):
        # cast: the step's non-expert weight gradients are linears' (autocast caches their cast weights)
        self.steps.append({"alloc": alloc + self.z, "free": free + self.z, "saved": tuple(saved), "pgrad": pgrad,
                           "cast": cast})

    def accumulate(self, nbytes, in_place=False):
        """Autograd sums the two gradients of a tensor two ops read (``nbytes`` each) into one: in place where it
        may steal a buffer (plain tensors: ``InputBuffer::accumulate`` adds into a gradient nothing else holds),
        out of place under TP, whose activation gradients are DTensors (their local tensors are also held by the
        wrapper): the sum is a new tensor beside both [trace: tp 2 SP, GeLU MLP, d 2304: the peak at the
        aten.add of wk's and wv's input gradients, (768, 2304) each, three alive; -2.6% before]. ``in_place``:
        plain tensors whatever the plan (routed experts' token gradients)."""
        if in_place:  # (no step of its own: the previous one frees the added gradient)
            self.steps[-1]["free"] = self.steps[-1]["free"] + nbytes
            return
        extra = np.where(self.t > 1, nbytes, 0.0)
        self.step(extra, extra + nbytes)

    def _gmm_temp(self, w_elems, x_elems, out_elems, x_is_stream):
        """One local expert's matmul output in a grouped GEMM's backward, the larger of its rows of the input
        gradient and its weight gradient (the weight's dtype: param_dtype under FSDP, fp32 without), made one after
        the other into the whole gradients allocated first [derived from
        ``_GroupedMM.backward``: ``gw[e] = x_e.t() @ g_e``, ``gx[rows_e] = g_e @ w[e].t()``; trace: 2 local experts,
        a (1024, 768) fp32 matmul output beside the whole weight gradient at the experts' backward].

        Under autocast (fp32 weights, bf16 compute: no FSDP) more is alive at either matmul: the expert's output
        gradient converted to the weight's fp32 (``g_e.to(w.dtype)``, out x 4 B per row) and autocast's bf16 cast
        of it (out x 2), and per matmul its other operand cast to bf16 and its bf16 output: ``w[e]`` (in x out x 2)
        and the input-gradient rows (in x 2), or the input rows (in x 2; from bf16 rows through an fp32 copy
        first, in x 4 more: w2's hidden input) and the weight gradient (in x out x 2): the same bytes at both
        moments [derived: ``_GroupedMM.backward`` under torch.autocast, which casts but does not cache non-leaf
        tensors; trace: 1 MoE layer, tp 4, bf16 without FSDP: (128, 256) fp32 + bf16 copies of the output
        gradient, the (256, 256) weight's cast and the (128, 256) output at the peak, -1.6% before]. ``x_is_stream``:
        the input is the permuted residual-stream tokens (w1, w3: the stream's dtype), else the hidden (w2)."""
        e = np.maximum(local_experts(self.spec, self.sh), 1.0)
        x_bytes = x_elems * (self.rb if x_is_stream else self.b2)
        plain = np.maximum(w_elems * grad_elem_bytes(self.b), x_bytes) / e  # (one after the other: the larger)
        cast = (6.0 * out_elems + (2.0 if x_is_stream else 6.0) * x_elems + 2.0 * w_elems) / e
        return np.where(self.rb > self.b2, cast, plain)  # (res_b > act_b: autocast, ``Shapes.res_b``)

    def mlp(self, prefix, tokens, ff, names, expert=False, last_saved=(), free_in=0.0, w3_saved=(), kind=None):
        """SwiGLU: w2 (its input's gradient), mul (two), silu, w3 and w1 (the normed input's gradient, summed);
        GeLU: w2, gelu, w1. ``free_in``: the output's gradient, freed by w2's backward where the MLP owns it (the
        routed experts' weighted pairs; a dense MLP's is the residual stream's, freed by the block).
        ``last_saved`` / ``w3_saved``: what w1's / w3's backward releases of the block's saved tensors. The routed
        experts' grouped GEMM backward (``executor.model._GroupedMM``) fills its input and weight gradients expert
        by expert through one matmul output each, alive while it is copied in: at its moment one expert's share
        of one of them more (``_gmm_temp``)."""
        step, pg = self.step, self.pg
        hid = tokens * ff * self.b2
        # the routed experts' input gradient is ``empty_like`` of their permuted input, the stream's dtype (fp32
        # under autocast); a linear's is its cast input's [trace: mixtral 1 layer, tp8, bf16 without FSDP: the w3 /
        # w1 input gradients (1536, 4096) fp32]
        tin = tokens * self.d * (self.rb if expert else self.b2)

        def temp(w, x_elems, out_elems, x_is_stream):
            return self._gmm_temp(pg(names + w, expert=True)[1], x_elems, out_elems, x_is_stream) if expert else 0.0

        if (kind or self.spec.mlp) == "swiglu":
            t2 = temp("w2", tokens * ff, tokens * self.d, False)
            t3, t1 = (temp(w, tokens * self.d, tokens * ff, True) for w in ("w3", "w1"))
            step(hid + t2, free_in + t2, [f"{prefix}.w2.input"], pg(names + "w2", expert=expert))
            step(2 * hid, hid, [f"{prefix}.silu.out", f"{prefix}.w3.out"])
            step(hid, hid, [f"{prefix}.w1.out"])
            step(tin + t3, hid + t3, w3_saved, pg(names + "w3", expert=expert))
            step(tin + t1, hid + t1, last_saved, pg(names + "w1", expert=expert))
            self.accumulate(tin, in_place=expert)
        else:
            step(hid, free_in, [f"{prefix}.gelu.out"], pg(names + "w2", expert=expert))
            step(hid, hid, [f"{prefix}.w1.out"])
            step(tin, hid, last_saved, pg(names + "w1", expert=expert))

    def moe_ffn(self):
        """The MoE FFN: the shared experts (their nodes are the newest: autograd runs them first), then the
        combine (whose sum's backward is the last use of the incoming gradient: gathered under SP, freed there), EP
        all-to-alls, the routed experts' MLP, the token gather, the router [trace: tp4 SP, the shared experts'
        backward before the pairs' gradient, the gathered (T, d) gradient freed right after it]."""
        step, sh, d, b2, T = self.step, self.sh, self.d, self.b2, self.T
        m = self.spec.moe
        assert m is not None
        tr, t_router = sh.Tr, sh.Tr / (m.top_k * m.capacity_factor)
        ep_on = np.where(self.b.ep > 1, 1.0, 0.0)
        if m.n_shared_experts:
            self.mlp("shared", T, m.d_ff_expert * m.n_shared_experts / self.t, "shared.")
        step(tr * d * b2, self.g_full)  # the combine's sum backward: the routed pairs' gradient
        step(tr * d * b2, tr * d * b2)  # the scatter's backward: the weighted pairs' gradient, the pairs' freed
        # the weighting's backward: the experts' output gradient and, for the routing weights' gradient, the product
        # of the incoming gradient and the saved output (summed over d, then freed) [trace: three (T k, d) tensors
        # at the mul's backward, tiny-moe d 384 top-4]
        step(2.0 * tr * d * b2, 2.0 * tr * d * b2, ["experts.w2.out"])
        step(ep_on * tr * d * b2, ep_on * tr * d * b2)  # EP: the combine's all-to-all back
        # (the weighted pairs' gradient is consumed by the experts' w2: freed there [trace: a MoE block's backward
        # left top_k x (T, d) behind in the model, 0.56 MiB per block of a d384 top-2 model])
        self.mlp("experts", tr, m.d_ff_expert / sh.etp, "experts.", expert=True,
                 last_saved=["experts.input(permuted)"], free_in=tr * d * b2, kind="swiglu")
        # (the experts' input gradient is in the permuted tokens' dtype, the stream's: fp32 under autocast, where
        # the model had freed it as bf16 and each MoE block's backward left tr x d x 2 B behind [trace: pp4 x tp2
        # first stage, autocast, 384 routed pairs of d 1000: 768000 B more after every microbatch's backward,
        # +0.58% at a later microbatch's peak before])
        step(ep_on * tr * d * self.rb, ep_on * tr * d * self.rb)  # EP: the dispatch's all-to-all back
        step(t_router * d * b2, tr * d * self.rb)  # the token gather's backward (into the tokens' gradient)
        step(t_router * m.n_experts * 4.0, 0.0, ["router.probs"])
        step(t_router * d * b2, t_router * m.n_experts * 4.0 + t_router * d * b2, ["router.logits"],
             self.pg("router"))
        # whole experts under TP (etp 1): the rank routed a contiguous 1/tp of the gathered tokens, a slice, whose
        # backward makes a zero (T, d) gradient with the share's copied in and frees the share's [derived:
        # executor.model.MoE._tp_forward, aten's slice_backward; trace: tiny-moe tp4 x ep8, SP, 64 tokens: 24 KiB
        # per MoE block freed and never made before, the model's activations negative at the end of the backward]
        split = sh.routed_split
        step(np.where(split, T * d * b2, 0.0), np.where(split, t_router * d * b2, 0.0))
        step(0.0, T * d * b2 * np.where(m.n_shared_experts > 0, 1.0, 0.0), ["ffn_norm.output(gathered)"])

    def norm(self, name: str):
        """A norm: its output's gradient reduce-scattered (SP), its backward, summed into the residual gradient."""
        step, T, d, sd, b2, sp = self.step, self.T, self.d, self.sd, self.b2, self.sp
        step(np.where(sp, T * d / sd * b2, 0.0), np.where(sp, T * d * b2, 0.0))
        step(T * d / sd * self.rb, T * d / sd * b2, [f"{name}.input", f"{name}.rstd"], self.norm_pg, cast=False)
        step(0.0, T * d / sd * self.rb)

    def attention(self):
        """wo, SDPA (q, k, v gradients), RoPE, q/k norms, wv / wk / wq (summed); MLA: ``latent_attention``."""
        if self.spec.mla:
            self.latent_attention()
            return
        step, pg, spec, T, d, b2, t = self.step, self.pg, self.spec, self.T, self.d, self.b2, self.t
        ao, q_, kv_ = spec.attn_out_dim / t, spec.q_dim / t, spec.kv_dim / t
        step(self.g_full)
        step(T * ao * b2, self.g_full, ["wo.input(CP copy)"], pg("wo"))
        qk_saved = ["q.rotated", "k.rotated"] if spec.qk_norm else ["wq.out", "wk.out"]
        # context parallel: torch's ring attention backward holds more than its outputs at its peak (ring.py)
        ring = np.where(self.sh.cp_copy, ring_backward_extra_bytes(T * q_, T * kv_, T * kv_, T * spec.n_heads / t * 4.0,
                                                                    b2, self.b.cp), 0.0)
        # core-attn: the attention's backward unpacks its saved tensors, which reruns the checkpointed attention:
        # its output and logsumexp made again. The output replaces, byte for byte, the one wo held (wo's backward
        # released it just before), which this step frees as "sdpa.out"; the logsumexp is new, freed with it
        lse = np.where(self.b.ac == AC_MODES["core-attn"], T * spec.n_heads / t * 4.0, 0.0)
        step(T * (q_ + 2 * kv_) * b2 + ring + lse, T * ao * b2 + ring + lse,
             ["sdpa.out", "sdpa.logsumexp", "wv.out", *qk_saved])
        step(T * (q_ + kv_) * b2, T * (q_ + kv_) * b2, ["rope.cos_sin"])
        if spec.qk_norm:
            step(T * (q_ + kv_) * b2, T * (q_ + kv_) * b2, ["wq.out", "wk.out", "q_norm.rstd", "k_norm.rstd"],
                 pg("qk_norm"), cast=False)
        step(T * d * b2, T * kv_ * b2, ["attention_norm.output(cast wv)"], pg("wv"))
        step(T * d * b2, T * kv_ * b2, ["attention_norm.output(cast wk)"], pg("wk"))
        self.accumulate(T * d * b2)
        step(T * d * b2, T * q_ * b2, ["attention_norm.output(gathered)"], pg("wq"))
        self.accumulate(T * d * b2)

    def latent_attention(self):
        """MLA's backward in autograd's order (the newest node first: the kv path before the q path): wo; the
        attention (dq, dk, dv made; the output's gradient, the saved q, k, v view and output freed: ``wkv_b``'s
        output goes with v); the keys' concatenation and the rotary key's sum over heads; the rotary query's
        backward (a contiguous copy of its strided gradient, then the rotated one); the split of k and v (one
        gradient of ``wkv_b``'s output from the two views: dk and dv freed), ``wkv_b``, the kv norm, the split of the
        latent and the rotary key, ``wkv_a`` (the first input gradient); the split of the query, ``wq_b``, the q norm,
        ``wq_a`` (or ``wq``: the second, summed) [derived from ``executor.model.LatentAttention``'s graph]."""
        step, pg, spec, T, b2, t = self.step, self.pg, self.spec, self.T, self.b2, self.t
        m = spec.mla
        assert m is not None
        ao, q_ = spec.attn_out_dim / t, spec.q_dim / t
        rq, rk = T * spec.n_heads / t * m.qk_rope_head_dim * b2, T * m.qk_rope_head_dim * b2
        kvb = T * spec.n_heads / t * (m.qk_nope_head_dim + m.v_head_dim) * b2
        lq, lkv, dx = T * m.q_lora_rank * b2, T * m.kv_lora_rank * b2, T * self.d * b2
        wq = "wq_b" if m.q_lora_rank else "wq"
        step(self.g_full)
        step(T * ao * b2, self.g_full, ["wo.input(CP copy)"], pg("wo"))
        lse = np.where(self.b.ac == AC_MODES["core-attn"], T * spec.n_heads / t * 4.0, 0.0)
        step(T * (2 * q_ + ao) * b2 + lse, T * ao * b2 + lse,
             ["sdpa.out", "sdpa.logsumexp", f"{wq}.out", "k.concatenated", "wkv_b.out"])
        step(rk)  # the rotary key's gradient summed over the heads
        step(rk, rk)  # its rotation back
        step(2 * rq, rq, ["rope.cos_sin"])  # the rotary query's: a contiguous copy, then the rotation back
        step(kvb, T * (q_ + ao) * b2)  # dk and dv into one gradient of wkv_b's output
        step(lkv, kvb, ["kv_norm.out"], pg("wkv_b"))
        step(lkv, lkv, ["wkv_a.out", "kv_norm.rstd"], pg("kv_norm"), cast=False)
        step(T * (m.kv_lora_rank + m.qk_rope_head_dim) * b2, lkv + rk)  # latent and rotary key gradients joined
        step(dx, T * (m.kv_lora_rank + m.qk_rope_head_dim) * b2, ["attention_norm.output(cast wkv_a)"], pg("wkv_a"))
        step(T * q_ * b2, T * q_ * b2 + rq)  # the query's no-rope and rotated gradients joined
        if m.q_lora_rank:
            step(lq, T * q_ * b2, ["q_norm.out"], pg("wq_b"))
            step(lq, lq, ["wq_a.out", "q_norm.rstd"], pg("q_norm"), cast=False)
            step(dx, lq, ["attention_norm.output(gathered)"], pg("wq_a"))
        else:
            step(dx, T * q_ * b2, ["attention_norm.output(gathered)"], pg("wq"))
        self.accumulate(dx)


def ffn_input_held_bytes(spec: ModelSpec, sh: Shapes) -> np.ndarray:
    """Bytes a dense block's MLP input keeps alive while the MLP runs beyond what its linears save: the block
    passes the FFN norm's output to the MLP and holds it until the MLP returns, and under SP the MLP's input hook
    all-gathers it into a new tensor that the MLP holds as its argument. w1's matmul saves the tensor it reads, so
    the held one is extra where w1 reads another: under SP the sharded norm output (T d / sp x res_b), under
    autocast (fp32 stream, bf16 linears) the fp32 tensor w1 casts from (T d x res_b, gathered under SP). A
    recompute stops right after packing w2's input (autograd packs an op's inputs before running it, and the
    non-reentrant checkpoint stops once every saved tensor is back), inside the MLP: these bytes are alive at its
    end, beside every recomputed tensor. TE layers fuse the norm into the first linear (nothing held).
    [derived: executor.model Block.forward / torch's PrepareModuleInput; trace: 1 layer of d 512, tp 8, bf16
    without FSDP, full AC: the (1, 1024, 512) fp32 norm output alive at the recompute's GeLU, -3.8% before; with
    SP the (8, 128, 512) fp32 gathered input and the (1, 128, 512) shard]"""
    sp = sh.sp_div > 1
    cast = (sh.res_b > sh.act_b) & ~sh.te
    x = sh.T * spec.d_model * sh.res_b  # the norm's output, whole (gathered) sequence
    held = np.where(sp, x / sh.sp_div, 0.0) + np.where(cast, x, 0.0)
    return np.where(sh.te, 0.0, held)


def backward_steps(spec: ModelSpec, b, sh: Shapes, moe: bool) -> list[dict]:
    """One block's backward at op level, as the executor's modules run it (each op, in reverse forward order,
    allocates its input gradients and its weight gradients, then frees the gradient it consumed and the tensors
    it saved): a list of steps ``{"alloc", "free", "saved", "pgrad"}`` — bytes of activation gradients made and
    freed (``alloc`` before the step's moment, ``free`` after), names of ``saved_tensors`` released after it,
    weight-gradient elements made (``pgrad``: (non-expert, routed expert)). The peak inside a block's backward is at
    one of these moments: e.g. inside the MLP, with its gradients of the hidden activation, its first weight
    gradients and every attention tensor still saved [derived from the block's autograd graph; trace]."""
    bs = _BackwardSteps(spec, b, sh, moe)
    bs.step(bs.g_full)
    if not moe:
        # (SP: w2's backward is the gathered gradient's last use, its input and weight gradients made: freed there
        # [trace: tp 2 SP, full AC, 2 layers of d 384 / d_ff 1000: gone at the SwiGLU backward, +1.7% before])
        bs.mlp("mlp", bs.T, spec.d_ff / bs.t, "", last_saved=["ffn_norm.output(gathered)"],
               w3_saved=["ffn_norm.output(cast w3)"], free_in=bs.g_full)
    else:
        bs.moe_ffn()
    bs.norm("ffn_norm")
    # (the block's first sum into the residual gradient: a new tensor of its size where the gradient it adds to is
    # held elsewhere, ``memory.Block.summing_out_of_place``)
    bs.steps[-1]["residual_sum"] = bs.T * bs.d / bs.sd * bs.rb
    bs.attention()
    bs.norm("attention_norm")
    return bs.steps
