"""The shape of one transformer block as a rank of a plan runs it: the key under which a profile keeps a measured
block (``HardwareProfile.measured_blocks``), shared by the profiler that measures it and the cost model that uses
it (torch-free; neither imports the other).

A plan's per-rank compute is a handful of such shapes: one dense block and one MoE block at the plan's local widths
(heads, kv heads and d_ff after tp; routed experts after ep; the expert d_ff after etp), micro batch, local
sequence, dtype and compile. What a shape does not capture is named, and such plans keep the composed curves:

* context parallel (cp > 1): a rank's attention runs cp ring steps over seq/cp keys each; a block on seq/cp
  tokens would attend to seq/cp keys only (1/cp of the attention), so CP plans are not measured;
* sequence parallel: the block is measured without it (norms and residuals over seq tokens, not seq/tp): at most
  the memory-bound part of a block, over-counted by tp;
* a MoE block is measured with its local experts (n_experts / ep) and the full top-k, so each local expert gets
  the tokens it gets under EP (T * ep * k / E); the router is sized for the local experts (d x E/ep instead of
  d x E: a few per cent of the block's smallest GEMM); top-k above the local experts (ep > E / k) is not measured;
* EP with whole experts under TP (etp = 1): each TP rank routes a contiguous 1/tp of the tokens
  (``executor.model.MoE._tp_forward``, torchtitan's ReordererSequenceParallel), so the block is measured with its
  router and routed experts on T / tp tokens (``moe_token_div`` = tp) and its attention and shared experts on all
  T, as the rank runs them;
* float8 needs a GPU with float8 GEMMs (the profiler refuses it elsewhere); AC and the recompute it adds are the
  cost model's (recompute = forward for full AC, its selective share for per-op AC), from the measured forward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .spec import ModelSpec, MoESpec


@dataclass(frozen=True)
class BlockShape:
    d_model: int
    n_heads: int  # on the rank (after tp)
    n_kv_heads: int  # on the rank (after tp)
    head_dim: int
    d_ff: int  # dense MLP on the rank (after tp); 0 for a MoE block
    n_experts: int  # routed experts on the rank (after ep); 0 for a dense block
    top_k: int
    d_ff_expert: int  # routed expert's d_ff on the rank (after etp)
    d_ff_shared: int  # the shared experts' d_ff on the rank (after tp), a multiple of d_ff_expert
    micro_batch: int
    seq_len: int
    dtype: str  # float32 | bfloat16
    compile: bool
    float8: bool
    mlp: str
    norm: str
    qk_norm: bool
    bias: bool
    moe_token_div: int = 1  # the routed experts take 1/this of the tokens (EP with whole experts under TP)

    def __post_init__(self):
        if self.moe_token_div < 1 or (self.moe_token_div > 1 and not self.moe):
            raise ValueError(f"moe_token_div {self.moe_token_div} needs a MoE block and >= 1")

    @property
    def key(self) -> str:
        # (moe_token_div at 1 is left out: the keys of every block measured before it existed stay valid)
        d = asdict(self)
        if d["moe_token_div"] == 1:
            del d["moe_token_div"]
        return "|".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in d.items())

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def local_spec(self) -> ModelSpec:
        """A one-layer model with these widths: the block the profiler builds and times. Shared experts whose
        width on the rank is not a whole number of expert widths (one shared expert under TP) are one expert
        width more here (a ``MoESpec`` counts them in experts); the profiler builds them at ``d_ff_shared``
        exactly (``profiler.blocks.measure_block``), and only a stand-in's composed ratio reads this spec."""
        moe = (MoESpec(n_experts=self.n_experts, top_k=self.top_k, d_ff_expert=self.d_ff_expert,
                       n_shared_experts=-(-self.d_ff_shared // self.d_ff_expert)) if self.moe else None)
        return ModelSpec(name=f"block:{self.key}", n_layers=1, d_model=self.d_model, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, d_ff=max(self.d_ff, 1), vocab_size=2,
                         head_dim=self.head_dim, mlp=self.mlp, norm=self.norm, qk_norm=self.qk_norm, bias=self.bias,
                         moe=moe)


def block_shape(spec: ModelSpec, moe: bool, *, tp: int, ep: int, etp: int, micro_batch: int, seq_len: int, cp: int,
                dtype: str, compile: bool, float8: bool) -> BlockShape | None:
    """The shape of ``spec``'s dense (``moe`` False) or MoE block on one rank, or None where a measured block
    cannot stand for it (see the module docstring: CP, MLA, biases on some linears only, widths tp does not divide,
    top-k above the local experts)."""
    if cp > 1 or spec.mla is not None or spec.linear_biases or spec.max_position_embeddings:
        return None
    if spec.n_heads % tp or spec.n_kv_heads % tp:
        return None
    d_ff = d_ff_expert = d_ff_shared = n_experts = top_k = 0
    token_div = 1
    if moe:
        m = spec.moe
        if m is None or m.n_experts % ep or m.top_k > m.n_experts // ep or m.d_ff_expert % etp:
            return None
        # EP with whole experts under TP: each TP rank routes 1/tp of the tokens
        token_div = tp if tp > 1 and etp == 1 else 1
        if (micro_batch * seq_len) % token_div:
            return None
        n_experts, top_k, d_ff_expert = m.n_experts // ep, m.top_k, m.d_ff_expert // etp
        shared = m.n_shared_experts * m.d_ff_expert  # the executor's shared experts: one FFN this wide
        if shared % tp:
            return None
        d_ff_shared = shared // tp
    else:
        if spec.d_ff % tp:
            return None
        d_ff = spec.d_ff // tp
    return BlockShape(d_model=spec.d_model, n_heads=spec.n_heads // tp, n_kv_heads=spec.n_kv_heads // tp,
                      head_dim=spec.head_dim, d_ff=d_ff, n_experts=n_experts, top_k=top_k, d_ff_expert=d_ff_expert,
                      d_ff_shared=d_ff_shared, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype,
                      compile=compile, float8=float8, mlp=spec.mlp, norm=spec.norm, qk_norm=spec.qk_norm,
                      bias=spec.bias, moe_token_div=token_div)


def plan_block_shapes(spec: ModelSpec, plan) -> dict[str, BlockShape | None]:
    """{"dense": shape, "moe": shape} of the block kinds ``plan``'s model has (None where not measurable)."""
    kinds = []
    if spec.n_dense_layers:
        kinds.append("dense")
    if spec.moe is not None and spec.n_moe_layers:
        kinds.append("moe")
    etp = plan.etp if plan.ep > 1 else plan.tp  # experts are TP-sharded when EP is off (the cost model's etp_eff)
    return {k: block_shape(spec, k == "moe", tp=plan.tp, ep=plan.ep, etp=etp, micro_batch=plan.micro_batch_size,
                           seq_len=plan.seq_len, cp=plan.cp, dtype=plan.param_dtype, compile=plan.compile,
                           float8=plan.float8) for k in kinds}


@dataclass(frozen=True)
class HeadShape:
    """The model's ends on one rank: the token embedding (first stage) and the final norm, output projection and
    loss (last stage), at the vocabulary rows a rank holds (``ceil(V / tp)``, as ``torch.chunk`` shards it),
    micro batch, local sequence and dtype; never compiled (the executor compiles the blocks only). Under TP the
    executor's loss is ``loss_parallel`` over vocab-sharded logits: measured here as a plain loss over the local
    rows (its all-reduces are collectives, costed as such)."""

    d_model: int
    vocab: int  # rows on the rank (after tp)
    micro_batch: int
    seq_len: int
    dtype: str
    fused_loss: bool
    norm: str

    @property
    def key(self) -> str:
        return "head|" + "|".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in asdict(self).items())


def head_shape(spec: ModelSpec, *, tp: int, micro_batch: int, seq_len: int, cp: int, dtype: str,
               fused_loss: bool) -> HeadShape | None:
    """The ends of ``spec`` on a rank, or None where a measured head cannot stand for them: CP (the loss over
    seq / cp tokens is measurable, but CP plans keep the curves throughout) and learned positions (an embedding
    the executor adds beside the tokens')."""
    if cp > 1 or spec.max_position_embeddings:
        return None
    return HeadShape(d_model=spec.d_model, vocab=-(-spec.vocab_size // tp), micro_batch=micro_batch,
                     seq_len=seq_len, dtype=dtype, fused_loss=fused_loss, norm=spec.norm)


def plan_head_shape(spec: ModelSpec, plan) -> HeadShape | None:
    return head_shape(spec, tp=plan.tp, micro_batch=plan.micro_batch_size, seq_len=plan.seq_len, cp=plan.cp,
                      dtype=plan.param_dtype, fused_loss=plan.fused_loss)


def plan_measured_shapes(spec: ModelSpec, plan) -> list:
    """Every shape of ``plan`` a profile can hold a measurement of: its blocks (``plan_block_shapes``) and its
    ends (``plan_head_shape``); None for each that cannot be measured."""
    return [*plan_block_shapes(spec, plan).values(), plan_head_shape(spec, plan)]
