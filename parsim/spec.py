"""Model specifications: decoder-only transformers (Llama-style, GPT-style, MoE, MLA), presets and HF config loading.

Parameter counts are exact for the architectures as implemented by Hugging Face transformers / torchtitan:

* attention (GQA):   q: d*H*hd, k and v: d*KV*hd each, o: H*hd*d (+ biases when ``bias``), optional q/k RMSNorm
  of width hd (Qwen3).
* attention (MLA, DeepSeek-V2/V3, arXiv:2405.04434 sec. 2.1): wq_a d*q_lora, q_a_norm q_lora,
  wq_b q_lora*H*(nope+rope) (or wq d*H*(nope+rope) when q_lora = 0), wkv_a d*(kv_lora+rope), kv_a_norm kv_lora,
  wkv_b kv_lora*H*(nope+v), wo H*v*d.
* MLP: SwiGLU 3*d*ff (Shazeer 2020, arXiv:2002.05202); GeLU 2*d*ff (+ ff + d biases).
* MoE layer: router d*E, E routed experts and S shared experts, each a SwiGLU of width ff_expert.
* norms: RMSNorm d, LayerNorm 2d; two per layer plus a final one.
* embeddings V*d, output V*d unless tied, learned positions P*d (GPT-2/Megatron GPT).

FLOPs per token follow the PaLM / torchtitan MFU convention (Chowdhery et al. 2022, arXiv:2204.02311, App. B;
torchtitan ``get_num_flop_per_token``): ``6 * (N_active - N_embedding) + 6 * L * s * H * (d_qk + d_v)``. The
second term is the attention score and value matmuls (2*s*H*(d_qk+d_v) FLOPs per token forward, x3 for training),
counted without the causal half-saving, which is the convention MFU numbers use; ``causal=True`` halves it,
which is the work a causal flash-attention kernel actually does and is what the time model uses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ParsimError
from .jsonio import exists, read_json, short_path

# sizes beyond any model trained so far, refused (a 10**6-layer config would take minutes to search)
MAX_LAYERS = 2**14
MAX_WIDTH = 2**20  # d_model, d_ff, head widths, LoRA ranks
MAX_VOCAB = 2**24
MAX_HEADS = 2**14  # heads and experts


def _positive(obj, *names, high: int = MAX_WIDTH):
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= high:
            raise ParsimError(f"{type(obj).__name__}.{n} must be a positive integer <= {high}, got {v!r}")


def _typed(obj, kind: type, *names):
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, kind):
            raise ParsimError(f"{type(obj).__name__}.{n} must be a {kind.__name__}, got {v!r}")


@dataclass(frozen=True)
class MoESpec:
    """Routed mixture of experts. ``moe_every`` = HF ``decoder_sparse_step``; ``capacity_factor`` models routing
    imbalance: the busiest expert rank receives ``capacity_factor`` times the mean token count."""

    n_experts: int
    top_k: int
    d_ff_expert: int
    n_shared_experts: int = 0
    first_k_dense: int = 0
    moe_every: int = 1
    capacity_factor: float = 1.0
    dense_layers: tuple[int, ...] = ()  # HF mlp_only_layers

    def __post_init__(self):
        _positive(self, "n_experts", "top_k", high=MAX_HEADS)
        _positive(self, "d_ff_expert", "moe_every")
        for n in ("n_shared_experts", "first_k_dense"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LAYERS:
                raise ParsimError(f"MoESpec.{n} must be an integer in [0, {MAX_LAYERS}], got {v!r}")
        cf = self.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 1.0 <= cf <= 64.0:
            raise ParsimError(f"MoESpec.capacity_factor must be a number in [1, 64], got {cf!r}")
        if not isinstance(self.dense_layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS for i in self.dense_layers):
            raise ParsimError(f"MoESpec.dense_layers must be a list of layer indices, got {self.dense_layers!r}")
        if self.top_k > self.n_experts:
            raise ParsimError(f"moe top_k={self.top_k} > n_experts={self.n_experts}")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self):
        _positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not isinstance(self.q_lora_rank, int) or isinstance(self.q_lora_rank, bool) or \
                not 0 <= self.q_lora_rank <= MAX_WIDTH:
            raise ParsimError("mla q_lora_rank must be >= 0 (0 = no query compression)")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    head_dim: int = 0  # 0 -> d_model // n_heads
    tie_embeddings: bool = False
    mlp: str = "swiglu"  # swiglu | gelu
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    bias: bool = False  # biases on every attention and MLP linear (GPT-2, GPT-NeoX, Megatron GPT)
    # biases on these linears only (names of attention_matrices / mlp_matrices): Qwen2's q, k, v projections
    # ("wq", "wk", "wv"); HF attention_bias (q, k, v, o) and mlp_bias (w1, w2, w3)
    linear_biases: tuple[str, ...] = ()
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    max_position_embeddings: int = 0  # > 0: learned absolute position embeddings (GPT-2)
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    # what a framework needs to build the same model (no cost: FLOPs and bytes do not depend on them); 0 / (): not
    # known (a spec written by hand), and the emitters say so rather than let a framework's default stand in
    rope_theta: float = 0.0  # RoPE base (HF rope_theta): Llama 3 5e5, Qwen 1e6, Megatron's default 1e4
    norm_eps: float = 0.0  # the RMSNorm / LayerNorm epsilon (HF rms_norm_eps, layer_norm_eps)
    rope_scaling: tuple = ()  # (key, value) pairs of HF's rope_scaling (rope_type llama3 / yarn and its numbers)

    def __post_init__(self):
        _positive(self, "n_layers", high=MAX_LAYERS)
        _positive(self, "n_heads", "n_kv_heads", high=MAX_HEADS)
        _positive(self, "d_model", "d_ff")
        _positive(self, "vocab_size", high=MAX_VOCAB)
        _typed(self, str, "name", "mlp", "norm")
        _typed(self, bool, "tie_embeddings", "bias", "qk_norm")
        for n, high in (("head_dim", MAX_WIDTH), ("max_position_embeddings", MAX_VOCAB)):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= high:
                raise ParsimError(f"ModelSpec.{n} must be an integer in [0, {high}], got {v!r}")
        if self.moe is not None and not isinstance(self.moe, MoESpec) or \
                self.mla is not None and not isinstance(self.mla, MLASpec):
            raise ParsimError("ModelSpec.moe / mla must be objects of their fields")
        for n in ("rope_theta", "norm_eps"):
            v = getattr(self, n)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e12 or v != v:
                raise ParsimError(f"ModelSpec.{n} must be a number >= 0 (0: not known), got {v!r}")
        if not isinstance(self.rope_scaling, tuple) or not all(
                isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str)
                and isinstance(kv[1], (str, int, float)) for kv in self.rope_scaling):
            raise ParsimError(f"ModelSpec.rope_scaling must be (name, value) pairs, got {self.rope_scaling!r}")
        biasable = {"wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "w2", "w3"}
        if not isinstance(self.linear_biases, tuple) or not set(self.linear_biases) <= biasable:
            raise ParsimError(f"ModelSpec.linear_biases must be a tuple of {sorted(biasable)}, got "
                              f"{self.linear_biases!r}")
        if self.mlp not in ("swiglu", "gelu"):
            raise ParsimError(f"mlp must be swiglu or gelu, got {self.mlp!r}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ParsimError(f"norm must be rmsnorm or layernorm, got {self.norm!r}")
        if self.head_dim == 0:
            if self.d_model % self.n_heads:
                raise ParsimError(
                    f"d_model {self.d_model} is not divisible by n_heads {self.n_heads} "
                    f"({self.d_model} % {self.n_heads} = {self.d_model % self.n_heads}); give head_dim"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ParsimError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads} "
                f"({self.n_heads} % {self.n_kv_heads} = {self.n_heads % self.n_kv_heads})"
            )
        if self.moe is not None and self.moe.first_k_dense > self.n_layers:
            raise ParsimError(f"moe first_k_dense {self.moe.first_k_dense} > n_layers {self.n_layers}")

    # ---- structure -------------------------------------------------------------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        m = self.moe
        if m is None or i < m.first_k_dense or i in m.dense_layers:
            return False
        return (i + 1) % m.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (= attention output width before wo)."""
        if self.mla:
            return self.n_heads * (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim)
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key heads together (keys and values each have this width for GQA)."""
        if self.mla:
            return self.n_heads * (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim)
        return self.n_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        if self.mla:
            return self.n_heads * self.mla.v_head_dim
        return self.n_kv_heads * self.head_dim

    @property
    def attn_out_dim(self) -> int:
        if self.mla:
            return self.n_heads * self.mla.v_head_dim
        return self.n_heads * self.head_dim

    @property
    def d_qk_head(self) -> int:
        return (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) if self.mla else self.head_dim

    @property
    def d_v_head(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    # ---- parameter counts -------------------------------------------------------------------------------------
    def _norm_params(self, width: int) -> int:
        return width * (2 if self.norm == "layernorm" else 1)

    def attention_matrices(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each attention weight matrix; the GEMMs of the attention block."""
        d, H = self.d_model, self.n_heads
        if self.mla:
            m = self.mla
            mats = {}
            if m.q_lora_rank:
                mats["wq_a"] = (d, m.q_lora_rank)
                mats["wq_b"] = (m.q_lora_rank, self.q_dim)
            else:
                mats["wq"] = (d, self.q_dim)
            mats["wkv_a"] = (d, m.kv_lora_rank + m.qk_rope_head_dim)
            mats["wkv_b"] = (m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim))
            mats["wo"] = (self.attn_out_dim, d)
            return mats
        return {
            "wq": (d, self.q_dim),
            "wk": (d, self.kv_dim),
            "wv": (d, self.v_dim),
            "wo": (self.attn_out_dim, d),
        }

    def has_bias(self, linear: str) -> bool:
        """Whether the linear named ``linear`` (an attention or MLP matrix, "shared." prefix allowed) has a bias."""
        return self.bias or linear.removeprefix("shared.") in self.linear_biases

    def attention_params(self) -> int:
        n = sum(i * o for i, o in self.attention_matrices().values())
        if self.mla:
            n += self.mla.kv_lora_rank + self.mla.q_lora_rank  # the two latent RMSNorms
        n += sum(o for name, (_, o) in self.attention_matrices().items() if self.has_bias(name))
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def mlp_matrices(self, d_ff: int) -> dict[str, tuple[int, int]]:
        d = self.d_model
        if self.mlp == "swiglu":
            return {"w1": (d, d_ff), "w3": (d, d_ff), "w2": (d_ff, d)}
        return {"w1": (d, d_ff), "w2": (d_ff, d)}

    def mlp_params(self, d_ff: int) -> int:
        mats = self.mlp_matrices(d_ff)
        return sum(i * o for i, o in mats.values()) + sum(o for name, (_, o) in mats.items() if self.has_bias(name))

    def expert_params(self) -> int:
        """Parameters of one shared expert (an MLP of the model's kind, ``mlp``, with its biases)."""
        assert self.moe is not None
        return self.mlp_params(self.moe.d_ff_expert)

    def routed_expert_matrices(self, d_ff: int) -> dict[str, tuple[int, int]]:
        """One routed expert's weights: SwiGLU (w1, w3, w2) without biases whatever ``mlp`` says — the stacked
        grouped experts torchtitan builds (``GroupedExperts``) and the executor runs; Mixtral, Qwen3-MoE and
        DeepSeek's experts are SwiGLU too. A GeLU model's routed experts are therefore SwiGLU here [derived]."""
        d = self.d_model
        return {"w1": (d, d_ff), "w3": (d, d_ff), "w2": (d_ff, d)}

    def routed_expert_params(self) -> int:
        """Parameters of one routed expert (``routed_expert_matrices``)."""
        assert self.moe is not None
        return sum(i * o for i, o in self.routed_expert_matrices(self.moe.d_ff_expert).values())

    def layer_params(self, i: int) -> dict[str, int]:
        """Parameters of layer ``i`` split into what is replicated per expert rank and what is not."""
        out = {"attention": self.attention_params(), "norms": 2 * self._norm_params(self.d_model)}
        if self.is_moe_layer(i):
            m = self.moe
            assert m is not None  # is_moe_layer is False without one
            out["router"] = self.d_model * m.n_experts
            out["shared_experts"] = m.n_shared_experts * self.expert_params()
            out["routed_experts"] = m.n_experts * self.routed_expert_params()
        else:
            out["mlp"] = self.mlp_params(self.d_ff)
        return out

    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model + self.max_position_embeddings * self.d_model

    def output_params(self) -> int:
        """Final norm plus the output projection (zero extra weights when tied)."""
        return self._norm_params(self.d_model) + (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    def param_counts(self) -> dict[str, int]:
        """Exact totals by kind; sums to ``n_params``."""
        return dict(_param_counts(self))

    def _param_counts(self) -> dict[str, int]:
        counts = {"embedding": self.embedding_params(), "output": self.output_params()}
        for i in range(self.n_layers):
            for k, v in self.layer_params(i).items():
                counts[k] = counts.get(k, 0) + v
        return counts

    @property
    def n_params(self) -> int:
        return sum(self.param_counts().values())

    @property
    def n_active_params(self) -> int:
        """Parameters touched by one token: routed experts count top_k of n_experts."""
        n = self.n_params
        if self.moe:
            n -= self.n_moe_layers * (self.moe.n_experts - self.moe.top_k) * self.routed_expert_params()
        return n

    def flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Training FLOPs per token (forward + backward), see the module docstring for the derivation."""
        dense = 6.0 * (self.n_active_params - self.embedding_params())
        attn = 6.0 * self.n_layers * seq_len * self.n_heads * (self.d_qk_head + self.d_v_head)
        return dense + (0.5 if causal else 1.0) * attn

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "ModelSpec":
        if not isinstance(d, dict):
            raise ParsimError("a model spec must be a JSON object")
        d = dict(d)
        known = {f.name for f in fields(ModelSpec)}
        unknown = set(d) - known
        if unknown:
            raise ParsimError(f"unknown ModelSpec keys: {sorted(unknown)}")
        try:
            if d.get("moe") is not None:
                d["moe"] = MoESpec(**d["moe"])
            if d.get("mla") is not None:
                d["mla"] = MLASpec(**d["mla"])
            if isinstance(d.get("linear_biases"), list):
                d["linear_biases"] = tuple(d["linear_biases"])
            if isinstance(d.get("rope_scaling"), list):
                d["rope_scaling"] = tuple(tuple(kv) if isinstance(kv, list) else kv for kv in d["rope_scaling"])
            return ModelSpec(**d)
        except TypeError as e:
            raise ParsimError(f"bad model spec: {e}") from None


# ---- presets (Hugging Face config.json values, see docs/hardware-facts.md) ----------------------------------------
# Llama 3 (Meta-Llama-3-8B/70B config.json: rope_theta 500000, rms_norm_eps 1e-5, no rope_scaling; Llama 3.1 adds
# rope_scaling llama3 factor 8: give its config.json); Mixtral-8x7B-v0.1 1e6 / 1e-5; Qwen3-30B-A3B 1e6 / 1e-6;
# DeepSeek-V3 1e4 / 1e-6 with YaRN (factor 40 from 4096 positions); the tiny models (parsim's executor) 5e5 / 1e-5
_LLAMA3: dict[str, Any] = dict(rope_theta=5e5, norm_eps=1e-5)
PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, **_LLAMA3),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256, **_LLAMA3),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 53248, 128256, **_LLAMA3),
    "mixtral-8x7b": ModelSpec(
        "mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, moe=MoESpec(n_experts=8, top_k=2, d_ff_expert=14336),
        rope_theta=1e6, norm_eps=1e-5,
    ),
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, head_dim=128, qk_norm=True,
        moe=MoESpec(n_experts=128, top_k=8, d_ff_expert=768), rope_theta=1e6, norm_eps=1e-6,
    ),
    "deepseek-v3": ModelSpec(
        "deepseek-v3", 61, 7168, 128, 128, 18432, 129280,
        moe=MoESpec(n_experts=256, top_k=8, d_ff_expert=2048, n_shared_experts=1, first_k_dense=3),
        mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        rope_theta=1e4, norm_eps=1e-6,
        rope_scaling=(("beta_fast", 32), ("beta_slow", 1), ("factor", 40), ("mscale", 1.0), ("mscale_all_dim", 1.0),
                      ("original_max_position_embeddings", 4096), ("rope_type", "yarn")),
    ),
    # GPT-3 175B as trained with Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473, Table 1): tied embeddings,
    # learned positions (2048), LayerNorm, biases, GeLU MLP of 4*d.
    "gpt3-175b": ModelSpec(
        "gpt3-175b", 96, 12288, 96, 96, 4 * 12288, 51200, tie_embeddings=True, mlp="gelu", norm="layernorm",
        bias=True, max_position_embeddings=2048, norm_eps=1e-5,
    ),
    # CPU-sized models for real multi-process runs on this machine
    "tiny": ModelSpec("tiny", 4, 256, 8, 4, 768, 2048, rope_theta=5e5, norm_eps=1e-5),
    "tiny-moe": ModelSpec(
        "tiny-moe", 4, 256, 8, 4, 768, 2048,
        moe=MoESpec(n_experts=8, top_k=2, d_ff_expert=256, n_shared_experts=1, first_k_dense=1),
        rope_theta=5e5, norm_eps=1e-5,
    ),
}


def _hf_get(cfg: dict, key: str, default=None, required=True):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if required and default is None:
        raise ParsimError(f"config.json ({cfg.get('model_type')}) lacks required field {key!r}")
    return default


def _hf_linear_biases(cfg: dict) -> tuple[str, ...]:
    """Linears that carry a bias in transformers' modelling code: Qwen2 always on q/k/v (o has none);
    ``attention_bias`` on q/k/v/o (Llama, Mistral, Qwen3; DeepSeek-V3's MLA: the down-projections and o);
    ``mlp_bias`` on gate/up/down (Llama)."""
    out: list[str] = []
    if cfg.get("model_type") == "qwen2":
        out += ["wq", "wk", "wv"]
    if cfg.get("attention_bias"):
        out += ["wq_a", "wkv_a", "wo"] if cfg.get("model_type") == "deepseek_v3" else ["wq", "wk", "wv", "wo"]
    if cfg.get("mlp_bias"):
        out += ["w1", "w2", "w3"]
    return tuple(dict.fromkeys(out))


def _hf_positions(cfg: dict, eps_key: str, theta_key: str = "rope_theta") -> dict:
    """rope_theta, norm_eps and rope_scaling as transformers reads them: rope_theta defaults to 10000 (every
    RoPE model class of transformers), the epsilon to 1e-6 (Llama, Qwen) or 1e-5 (GPT-NeoX LayerNorm)."""
    raw = cfg.get("rope_scaling")
    scaling: dict = raw if isinstance(raw, dict) else {}
    pairs = tuple(sorted((str(k), v) for k, v in scaling.items() if isinstance(v, (str, int, float))
                         and not isinstance(v, bool)))
    default_eps = 1e-5 if eps_key == "layer_norm_eps" else 1e-6
    return {"rope_theta": float(cfg.get(theta_key) or 10000.0), "norm_eps": float(cfg.get(eps_key) or default_eps),
            "rope_scaling": pairs}


def from_hf_config(cfg: dict, name: str = "") -> ModelSpec:
    """Build a ModelSpec from a Hugging Face ``config.json`` dict (model_type llama, mistral, mixtral, qwen2,
    qwen3, qwen3_moe, deepseek_v3, gpt_neox, gpt2)."""
    mt = cfg.get("model_type")
    name = name or cfg.get("_name_or_path") or str(mt)
    g = lambda k, d=None, req=True: _hf_get(cfg, k, d, req)  # noqa: E731
    if mt in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"):
        d = g("hidden_size")
        heads = g("num_attention_heads")
        common = dict(
            name=name, n_layers=g("num_hidden_layers"), d_model=d, n_heads=heads,
            n_kv_heads=g("num_key_value_heads", heads), vocab_size=g("vocab_size"),
            tie_embeddings=bool(g("tie_word_embeddings", False)),
            head_dim=int(g("head_dim", 0, req=False) or 0),
            linear_biases=_hf_linear_biases(cfg), **_hf_positions(cfg, "rms_norm_eps"),
        )
        if mt == "mixtral":
            moe = MoESpec(n_experts=g("num_local_experts"), top_k=g("num_experts_per_tok"),
                          d_ff_expert=g("intermediate_size"))
            return ModelSpec(d_ff=g("intermediate_size"), moe=moe, **common)
        if mt == "qwen3_moe":
            moe = MoESpec(n_experts=g("num_experts"), top_k=g("num_experts_per_tok"),
                          d_ff_expert=g("moe_intermediate_size"), moe_every=g("decoder_sparse_step", 1),
                          dense_layers=tuple(g("mlp_only_layers", [], req=False)))
            return ModelSpec(d_ff=g("intermediate_size"), moe=moe, qk_norm=True, **common)
        if mt == "qwen3":
            return ModelSpec(d_ff=g("intermediate_size"), qk_norm=True, **common)
        if mt == "deepseek_v3":
            moe = MoESpec(n_experts=g("n_routed_experts"), top_k=g("num_experts_per_tok"),
                          d_ff_expert=g("moe_intermediate_size"), n_shared_experts=g("n_shared_experts", 0),
                          first_k_dense=g("first_k_dense_replace", 0), moe_every=g("moe_layer_freq", 1))
            mla = MLASpec(q_lora_rank=int(g("q_lora_rank", 0, req=False) or 0), kv_lora_rank=g("kv_lora_rank"),
                          qk_nope_head_dim=g("qk_nope_head_dim"), qk_rope_head_dim=g("qk_rope_head_dim"),
                          v_head_dim=g("v_head_dim"))
            common["head_dim"] = mla.qk_nope_head_dim + mla.qk_rope_head_dim
            return ModelSpec(d_ff=g("intermediate_size"), moe=moe, mla=mla, **common)
        return ModelSpec(d_ff=g("intermediate_size"), **common)
    if mt == "gpt_neox":
        heads = g("num_attention_heads")
        return ModelSpec(name=name, n_layers=g("num_hidden_layers"), d_model=g("hidden_size"), n_heads=heads,
                         n_kv_heads=heads, d_ff=g("intermediate_size"), vocab_size=g("vocab_size"),
                         tie_embeddings=bool(g("tie_word_embeddings", False)), mlp="gelu", norm="layernorm",
                         bias=bool(g("use_bias", True) if "use_bias" in cfg else True),
                         **_hf_positions(cfg, "layer_norm_eps", theta_key="rotary_emb_base"))
    if mt == "gpt2":
        d = g("n_embd")
        heads = g("n_head")
        return ModelSpec(name=name, n_layers=g("n_layer"), d_model=d, n_heads=heads, n_kv_heads=heads,
                         d_ff=int(g("n_inner", 4 * d, req=False) or 4 * d), vocab_size=g("vocab_size"),
                         tie_embeddings=True, mlp="gelu", norm="layernorm", bias=True,
                         max_position_embeddings=g("n_positions", 1024),
                         norm_eps=float(g("layer_norm_epsilon", 1e-5, req=False)))
    raise ParsimError(
        f"unsupported model_type {mt!r} in config.json "
        "(supported: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, gpt_neox, gpt2)"
    )


# ModelSpec field -> the Hugging Face config.json name users know (for errors about an HF config)
HF_NAMES = {"n_layers": "num_hidden_layers", "d_model": "hidden_size", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size", "head_dim": "head_dim",
            "vocab_size": "vocab_size", "n_experts": "num_experts / num_local_experts / n_routed_experts",
            "top_k": "num_experts_per_tok", "d_ff_expert": "moe_intermediate_size"}
HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "n_embd", "architectures")


def hf_unmodelled(cfg: dict) -> list[str]:
    """What a Hugging Face config sets that changes cost and that parsim does not model (one line each)."""
    out = []
    window, max_pos = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    if cfg.get("use_sliding_window", window is not None) and window and (not max_pos or window < max_pos):
        out.append(f"sliding_window {window} is ignored: attention is costed as full causal attention over the "
                   "whole sequence (an over-estimate of attention time at sequences longer than the window)")
    if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
        out.append("layer_types with non-full attention layers are ignored: every layer is costed as full attention")
    return out


def _hf_error(e: ParsimError, p: Path) -> ParsimError:
    """A ModelSpec refusal in the config's own field names (whole words only: a message may name them already)."""
    import re

    msg = str(e)
    for ours, theirs in HF_NAMES.items():
        msg = re.sub(rf"(?<![\w.])(?:ModelSpec\.)?{re.escape(ours)}\b", theirs, msg)
    return ParsimError(f"{p}: {msg}")


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name, a Hugging Face model folder (its ``config.json``) or ``config.json`` path, or a parsim
    ModelSpec JSON path. HF settings that change cost but are not modelled are reported as ParsimWarning."""
    import warnings

    from .errors import ParsimWarning

    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    p = Path(name_or_path)
    if not exists(p):
        raise ParsimError(f"unknown model {short_path(p)!r}: not a preset ({', '.join(PRESETS)}) and no such file")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ParsimError(f"model folder {p} has no config.json (a Hugging Face model folder holds one)")
        p = p / "config.json"
    cfg = read_json(p, "cannot read model config")
    if not isinstance(cfg, dict):
        raise ParsimError(f"model config {p} is not a JSON object")
    if "model_type" not in cfg and any(k in cfg for k in HF_KEYS):
        raise ParsimError(f"{p} looks like a Hugging Face config but has no model_type (parsim reads llama, "
                          "mistral, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, gpt_neox, gpt2)")
    try:
        if "model_type" in cfg:
            for w in hf_unmodelled(cfg):
                warnings.warn(f"{p}: {w}", ParsimWarning, stacklevel=2)
            try:
                return from_hf_config(cfg, name=p.parent.name if p.name == "config.json" else p.stem)
            except ParsimError as e:
                raise _hf_error(e, p) from None
        return ModelSpec.from_dict(cfg)
    except ParsimError:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        raise ParsimError(f"bad model config {p}: {e}") from None


@lru_cache(maxsize=1024)
def _param_counts(spec: ModelSpec) -> dict[str, int]:
    """``ModelSpec.param_counts``, cached per (frozen, hashable) spec: the cost model asks for it per batch."""
    return spec._param_counts()
