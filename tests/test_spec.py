import dataclasses
import json

import pytest

from parsim.errors import ParsimError
from parsim.spec import PRESETS, ModelSpec, from_hf_config, load_model


@pytest.mark.parametrize("name,expected", [("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9), ("llama3-405b", 405.9e9)])
def test_llama_param_counts_match_published(name, expected):
    # published counts: Meta's Llama 3.1 model cards (8.03B / 70.6B / 405.9B)
    assert abs(PRESETS[name].n_params - expected) / expected < 0.005


def test_moe_counts_total_and_active():
    # Mixtral: 46.7B total, 12.9B active (Mistral AI); Qwen3-30B-A3B: 30.5B / 3.3B; DeepSeek-V3: 671B / 37B
    mix, qwen, ds = PRESETS["mixtral-8x7b"], PRESETS["qwen3-30b-a3b"], PRESETS["deepseek-v3"]
    assert abs(mix.n_params - 46.7e9) / 46.7e9 < 0.005 and abs(mix.n_active_params - 12.9e9) / 12.9e9 < 0.01
    assert abs(qwen.n_params - 30.5e9) / 30.5e9 < 0.01 and abs(qwen.n_active_params - 3.3e9) / 3.3e9 < 0.03
    assert abs(ds.n_params - 671e9) / 671e9 < 0.005 and abs(ds.n_active_params - 37e9) / 37e9 < 0.03


def test_param_counts_sum_and_by_hand_for_tiny():
    m = PRESETS["tiny"]
    counts = m.param_counts()
    assert sum(counts.values()) == m.n_params
    d, f, V, kv = 256, 768, 2048, 4 * 32
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    assert m.n_params == 2 * V * d + d + 4 * per_layer


def test_flops_per_token_formula():
    m = PRESETS["llama3-8b"]
    n = m.n_params - m.embedding_params()
    assert m.flops_per_token(4096) == pytest.approx(6 * n + 12 * 32 * 32 * 128 * 4096)
    assert m.flops_per_token(4096, causal=True) == pytest.approx(6 * n + 6 * 32 * 32 * 128 * 4096)


def test_hf_loaders(tmp_path):
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
    assert from_hf_config(llama).n_params == PRESETS["llama3-8b"].n_params
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    assert abs(from_hf_config(gpt2).n_params - 124.4e6) / 124.4e6 < 0.002  # GPT-2 small: 124,439,808
    neox = {"model_type": "gpt_neox", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32,
            "num_attention_heads": 32, "vocab_size": 50432}
    assert abs(from_hf_config(neox).n_params - 2.78e9) / 2.78e9 < 0.01  # Pythia-2.8B
    ds = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280, "n_routed_experts": 256,
          "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
          "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
          "v_head_dim": 128}
    assert from_hf_config(ds).n_params == PRESETS["deepseek-v3"].n_params
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                             "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}))
    assert load_model(str(p)).n_params == PRESETS["mixtral-8x7b"].n_params


def test_bad_models():
    with pytest.raises(ParsimError, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(ParsimError, match="n_kv_heads"):
        ModelSpec("x", 2, 256, 8, 3, 512, 100)
    with pytest.raises(ParsimError, match="unsupported model_type"):
        from_hf_config({"model_type": "bert"})


# config.json fields of the Hugging Face model cards (the fields parsim reads) and the parameter totals the hub
# reports from the safetensors headers
HF_PUBLISHED = {
    "Qwen/Qwen2.5-7B": ({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                         "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                         "vocab_size": 152064, "tie_word_embeddings": False}, 7_615_616_512),
    "mistralai/Mistral-7B-v0.1": ({"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                                   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                                   "vocab_size": 32000, "tie_word_embeddings": False}, 7_241_732_096),
    "mistralai/Mixtral-8x7B-v0.1": ({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                                     "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                                     "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                                     "tie_word_embeddings": False}, 46_702_792_704),
    "meta-llama/Meta-Llama-3-8B": ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                                    "vocab_size": 128256, "attention_bias": False, "mlp_bias": False,
                                    "tie_word_embeddings": False}, 8_030_261_248),
    "meta-llama/Meta-Llama-3-70B": ({"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                                     "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
                                     "vocab_size": 128256, "attention_bias": False, "mlp_bias": False,
                                     "tie_word_embeddings": False}, 70_553_706_496),
}


@pytest.mark.parametrize("name", list(HF_PUBLISHED))
def test_hf_configs_give_the_published_parameter_counts_exactly(name):
    cfg, published = HF_PUBLISHED[name]
    assert from_hf_config(cfg).n_params == published


def test_hf_bias_fields_add_their_parameters():
    cfg = dict(HF_PUBLISHED["meta-llama/Meta-Llama-3-8B"][0], num_hidden_layers=2)
    base = from_hf_config(cfg)
    d, kv, ff = 4096, 8 * 128, 14336
    assert from_hf_config(dict(cfg, attention_bias=True)).n_params - base.n_params == 2 * (2 * d + 2 * kv)
    assert from_hf_config(dict(cfg, mlp_bias=True)).n_params - base.n_params == 2 * (2 * ff + d)
    qwen = from_hf_config(dict(cfg, model_type="qwen2"))
    assert qwen.linear_biases == ("wq", "wk", "wv") and qwen.n_params - base.n_params == 2 * (d + 2 * kv)
    assert ModelSpec.from_dict(json.loads(json.dumps(qwen.to_dict()))) == qwen
    with pytest.raises(ParsimError, match="linear_biases"):
        dataclasses.replace(qwen, linear_biases=("wx",))


def test_the_executor_builds_the_biases_the_spec_counts():
    torch = pytest.importorskip("torch")
    from parsim.executor.model import Transformer

    cfg = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
           "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 101, "mlp_bias": True}
    spec = from_hf_config(cfg)
    with torch.device("meta"):
        model = Transformer(spec, 16)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    biases = {n.split(".")[-2] for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert biases == {"wq", "wk", "wv", "w1", "w2", "w3"}
