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
of every other ``aten.mm`` (odd ones in forward order), SDPA outputs and reduce-scatter outputs and recomputes the
rest; ``layer:N`` fully checkpoints every N-th layer. MLA is approximated as attention with H heads of width
qk_nope+qk_rope for q and k and v_head_dim for v, plus the two latent projections and their norms.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..plan import AC_MODES
from ..spec import ModelSpec

FIRST, LAST = 0, 1  # the two ranks the model evaluates: pipeline stage 0 and the last stage


@lru_cache(maxsize=4096)
def _rank_layers(spec: ModelSpec, pp: int, v: int) -> tuple:
    """(n_dense, n_moe) for the first and the last pipeline rank. Stages are filled evenly, the first stages
    taking one extra layer when the layers do not divide; stage s runs on rank s % pp (loop placement)."""
    n_stages = pp * v
    base, extra = divmod(spec.n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
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
        self.sp_div = np.where(b.sp, self.t, 1.0)
        # without data parallelism FSDP applies no mixed precision: autocast keeps the residual stream (block
        # inputs, norm inputs) in fp32 while matmuls produce bf16
        self.res_b = np.where((b.dp_replicate * b.dp_shard * b.cp == 1) & (b.param_bytes < 4), 4.0,
                              b.param_bytes.astype(float))
        # [derived] bytes of an activation element: FSDP2's MixedPrecisionPolicy casts the parameters to
        # param_dtype, so linears, attention and the elementwise ops between them produce param_dtype tensors
        # (bf16: 2 B; an fp32 plan, the fast dtype of CPUs without bf16 instructions: 4 B)
        self.act_b = b.param_bytes.astype(float)
        # Transformer Engine layers (Megatron-Core): a float8 linear keeps its input in float8 (1 B) for the weight
        # gradient, else in param_dtype [derived: TE's Linear / LayerNormLinear save the quantized input]
        self.te = b.te
        self.f8b = np.where(b.float8, 1.0, self.act_b)
        self.seq = b.seq_len.astype(float)
        self.etp = b.etp_eff.astype(float)
        self.ep = b.ep.astype(float)
        m = spec.moe
        if m is not None:
            # routed tokens on this rank: split over tp when experts are whole (etp = 1: each TP rank routes a
            # contiguous 1/tp of the gathered tokens, with or without SP, executor: MoE._tp_forward), all of them
            # when experts are TP-sharded (etp = tp, or ep = 1 under TP)
            t_moe = np.where(b.etp_eff == 1, self.T / self.t, self.T)
            self.Tr = t_moe * m.top_k * m.capacity_factor  # routed (token, expert) pairs computed on this rank


def gemms(spec: ModelSpec, sh: Shapes, moe: bool) -> list[tuple]:
    """Forward GEMMs of one layer in execution order: (name, flops, FLOPs of one kernel (for its efficiency),
    elements read (input + weight, for float8 casts), kind). kind: mm (aten.mm, alternately saved by selective
    AC), gmm (grouped expert GEMM)."""
    T, t = sh.T, sh.t
    out = []

    def add(name, tokens, k, n, div, kind="mm", n_kernels=1.0):
        f = 2.0 * tokens * k * n / div
        out.append((name, f, f / n_kernels, tokens * k + k * n * n_kernels / div, kind))

    for name, (k, n) in spec.attention_matrices().items():
        add(name, T, k, n, 1.0 if name in ("wq_a", "wkv_a") else t)  # MLA down-projections are not TP-sharded
    if not moe:
        for name, (k, n) in spec.mlp_matrices(spec.d_ff).items():
            add(name, T, k, n, t)
        return out
    m = spec.moe
    assert m is not None  # moe layers exist only with a MoESpec
    add("router", sh.Tr / (m.top_k * m.capacity_factor), spec.d_model, m.n_experts, 1.0)
    for name, (k, n) in spec.mlp_matrices(m.d_ff_expert).items():
        add(f"experts.{name}", sh.Tr, k, n, sh.etp, "gmm", n_kernels=m.n_experts / sh.ep)
    if m.n_shared_experts:
        for name, (k, n) in spec.mlp_matrices(m.d_ff_expert * m.n_shared_experts).items():
            add(f"shared.{name}", T, k, n, t)
    return out


def attention_flops(spec: ModelSpec, sh: Shapes) -> np.ndarray:
    """Forward FLOPs of the attention core (QK^T and AV) per rank and microbatch, causal: each of the T local
    queries attends on average to half of the seq keys (CP load-balanced): 2 * T * seq/2 * H/tp * (d_qk + d_v)."""
    return sh.T * sh.seq * (spec.n_heads / sh.t) * (spec.d_qk_head + spec.d_v_head)


def saved_tensors(spec: ModelSpec, sh: Shapes, moe: bool) -> list[tuple[str, np.ndarray, str]]:
    """Tensors autograd keeps for one layer, in bytes: (name, bytes, kind). kind: input (the block input),
    mm (output of an aten.mm), gmm (grouped GEMM output), sdpa (attention output / logsumexp), rs (reduce-scatter
    output), other (elementwise / norm inputs)."""
    T, t, sd = sh.T, sh.t, sh.sp_div
    d = spec.d_model
    b2, b4 = sh.act_b, 4.0  # activations in param_dtype; norm rstd, logsumexp, router scores in fp32 [derived]
    rb = sh.res_b
    te = sh.te
    # the norm output a column-parallel linear keeps: gathered over tp (torch SP: the all-gather's output is what
    # the matmul saves), or, under TE layers, the local sequence shard in float8 / param_dtype, all-gathered again
    # in the backward (TE LayerNormLinear with sequence_parallel) [derived]
    norm_out = np.where(te, T * d / sd * sh.f8b, T * d * b2)
    out = [
        ("attention_norm.input", T * d / sd * rb, "input"),
        ("attention_norm.rstd", T / sd * b4, "other"),
        ("attention_norm.output(gathered)", norm_out, "other"),
    ]
    mats = spec.attention_matrices()
    if spec.mla:
        m = spec.mla
        if m.q_lora_rank:
            out += [("wq_a.out", T * m.q_lora_rank * b2, "mm"), ("q_norm.out", T * m.q_lora_rank * b2, "other")]
        out += [("wkv_a.out", T * (m.kv_lora_rank + m.qk_rope_head_dim) * b2, "mm"),
                ("kv_norm.out", T * m.kv_lora_rank * b2, "other")]
    for name in ("wq", "wk", "wv"):
        if name in mats:
            out.append((f"{name}.out", T * mats[name][1] / t * b2, "mm"))
    if spec.mla:
        out += [("wq_b.out" if spec.mla.q_lora_rank else "wq.out", T * spec.q_dim / t * b2, "mm"),
                ("wkv_b.out", T * spec.n_heads * (spec.mla.qk_nope_head_dim + spec.mla.v_head_dim) / t * b2, "mm")]
    if spec.qk_norm:
        # Qwen3: q and k are RMS-normalized per head before RoPE: the norms keep their input (the mm outputs above)
        # and a fp32 1/rms per head and token; the rotated q and k (new tensors) are what attention keeps
        hq, hk, hd = spec.n_heads / t, spec.n_kv_heads / t, spec.head_dim
        out += [("q_norm.rstd", T * hq * b4, "other"), ("k_norm.rstd", T * hk * b4, "other"),
                ("q.rotated", T * hq * hd * b2, "other"), ("k.rotated", T * hk * hd * b2, "other")]
    rope_dim = spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim
    out += [
        # the bf16 cos and sin (hd/2 each) the rotation keeps; TE's fused RoPE recomputes them
        ("rope.cos_sin", np.where(te, 0.0, T * rope_dim * b2), "other"),
        ("sdpa.out", T * spec.attn_out_dim / t * b2, "sdpa"),
        # under TE with float8 the output projection keeps its own float8 copy of the attention output
        ("wo.input(float8)", np.where(te & (sh.f8b < b2), T * spec.attn_out_dim / t * sh.f8b, 0.0), "other"),
        ("sdpa.logsumexp", T * spec.n_heads / t * b4, "sdpa"),
        ("wo.out", T * d * b2, "mm"),
    ]
    out += [("wo.reduce_scatter.out", np.where(sd > 1, T * d / sd * b2, 0.0), "rs"),
            ("ffn_norm.input", T * d / sd * rb, "other"), ("ffn_norm.rstd", T / sd * b4, "other"),
            ("ffn_norm.output(gathered)", norm_out, "other")]
    if not moe:
        out += _mlp_saved(spec, T, spec.d_ff / t, "mlp", T * d * b2, b2, te=te, f8b=sh.f8b)
    else:
        mo = spec.moe
        assert mo is not None
        t_router = sh.Tr / (mo.top_k * mo.capacity_factor)
        out += [("router.logits", t_router * mo.n_experts * b4, "mm"),
                ("router.probs", t_router * mo.n_experts * b4, "other"),
                ("experts.input(permuted)", sh.Tr * d * b2, "other")]
        out += _mlp_saved(spec, sh.Tr, mo.d_ff_expert / sh.etp, "experts", sh.Tr * d * b2, b2, kind="gmm")
        if mo.n_shared_experts:
            out += _mlp_saved(spec, T, mo.d_ff_expert * mo.n_shared_experts / t, "shared", T * d * b2, b2)
    out.append(("mlp.reduce_scatter.out", np.where(sd > 1, T * d / sd * b2, 0.0), "rs"))
    return out


def _mlp_saved(spec, T, ff_local, prefix, out_bytes, b2, kind="mm", te=False, f8b=None):
    """The MLP's saved tensors. Under TE layers (Megatron-Core) the fused bias-SwiGLU / GeLU keeps only its
    input (the fc1 output) and recomputes the activation in its backward, and fc2 keeps its input in float8 when
    float8 is on [derived: megatron.core.fusions.fused_bias_swiglu saves its input; TE Linear the quantized
    input]."""
    f8b = b2 if f8b is None else f8b
    act = np.where(te, 0.0, T * ff_local * b2)  # the activation's own output, kept apart only without TE
    w2_in = np.where(te, T * ff_local * f8b, T * ff_local * b2)
    if spec.mlp == "swiglu":
        return [(f"{prefix}.w1.out", T * ff_local * b2, kind), (f"{prefix}.silu.out", act, "other"),
                (f"{prefix}.w3.out", T * ff_local * b2, kind), (f"{prefix}.w2.input", w2_in, "other"),
                (f"{prefix}.w2.out", out_bytes, kind)]
    # GeLU: its output is fc2's input (float8 under TE with float8)
    return [(f"{prefix}.w1.out", T * ff_local * b2, kind), (f"{prefix}.gelu.out", w2_in, "other"),
            (f"{prefix}.w2.out", out_bytes, kind)]


def kept_by_ac_mode(items: list[tuple]) -> list[dict[str, bool]]:
    """For each saved tensor of ``saved_tensors``: is it kept under ``none``, ``full``, ``sac`` (selective-op)?

    The saved output of wo / w2 is counted only when it is not immediately consumed by a residual add (it is
    the input of nothing that saves it) — so under no AC it is dropped; selective AC stores it when its mm is
    odd-numbered, as the policy does. The routed experts' output is the exception: it is multiplied by the
    routing weights, which keeps it for the router's gradient (executor trace of mixtral-8x7b: one T x top_k x d
    tensor per MoE layer and microbatch; torchtitan's MoE multiplies its routed output by the scores too)."""
    out = []
    mm_count = 0
    for name, _nbytes, kind in items:
        residual_out = name.endswith("wo.out") or (name.endswith("w2.out") and not name.startswith("experts."))
        if kind == "mm":
            mm_count += 1
        out.append({"none": not residual_out and kind != "rs", "full": kind == "input",
                    "sac": kind in ("input", "gmm", "sdpa", "rs") or (kind == "mm" and mm_count % 2 == 1)})
    return out


def activation_bytes(spec: ModelSpec, sh: Shapes, moe: bool) -> dict[str, np.ndarray]:
    """Bytes kept per layer and microbatch: ``none`` (no AC), ``full`` (block input only), ``sac`` (selective-op)."""
    items = saved_tensors(spec, sh, moe)
    keep = kept_by_ac_mode(items)
    return {mode: sum((nbytes for (_, nbytes, _), k in zip(items, keep, strict=True) if k[mode]),
                      np.zeros_like(sh.T)) for mode in ("none", "full", "sac")}


def layer_params_local(spec: ModelSpec, b, moe: bool) -> tuple[np.ndarray, np.ndarray]:
    """Parameters of one layer held by a rank before FSDP sharding: non-expert weights split by tp (norms and
    MLA down-projections replicated), routed experts split by ep x etp."""
    t = b.tp.astype(float)
    i = next(j for j in range(spec.n_layers) if spec.is_moe_layer(j) == moe)
    p = spec.layer_params(i)
    replicated = p["norms"] + (2 * spec.head_dim if spec.qk_norm else 0)  # q/k norms are not TP-sharded
    if spec.mla:
        replicated += sum(k * n for name, (k, n) in spec.attention_matrices().items() if name in ("wq_a", "wkv_a"))
        replicated += spec.mla.kv_lora_rank + spec.mla.q_lora_rank
    routed = float(p.pop("routed_experts", 0))
    router = float(p.pop("router", 0))
    dense = float(sum(p.values())) - replicated
    non_expert = dense / t + replicated + router
    experts = routed / (b.ep * b.etp_eff)
    return non_expert, experts


def ac_counts(b, n_layers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(layers fully checkpointed, layers under selective AC, layers without AC) among ``n_layers``."""
    n = n_layers.astype(float)
    every = np.ceil(n / np.maximum(b.ac_every, 1))  # torchtitan: layer ids divisible by N are checkpointed
    full = np.where(b.ac == AC_MODES["full"], n, np.where(b.ac == AC_MODES["layer"], np.minimum(every, n), 0.0))
    sac = np.where(b.ac == AC_MODES["selective-op"], n, 0.0)
    return full, sac, n - full - sac
