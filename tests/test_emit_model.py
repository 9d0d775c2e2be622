"""Emitted configs build the model the checkpoint has: every architecture field parsim knows is carried by a
Megatron flag or named as a gap, over every preset and every Hugging Face model type parsim reads."""

from __future__ import annotations

import dataclasses

import pytest

from parsim.emit import MEGATRON_FIELDS, megatron_gaps, to_megatron_args
from parsim.plan import Plan
from parsim.spec import PRESETS, ModelSpec, from_hf_config

# config.json excerpts with the position and norm fields as their model cards publish them
HF_CONFIGS = {
    "llama3.1": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
                 "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192,
                                                         "rope_type": "llama3"}},
    "qwen2.5": {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
                "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064, "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-06},
    "mistral": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "rope_theta": 10000.0,
                "rms_norm_eps": 1e-05},
    "qwen3": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "rope_theta": 1000000, "rms_norm_eps": 1e-06},
    "deepseek_v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                    "vocab_size": 129280, "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3,
                    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "rope_theta": 10000, "rms_norm_eps": 1e-06,
                    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                     "type": "yarn"}},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "vocab_size": 50432, "rotary_emb_base": 10000, "layer_norm_eps": 1e-05},
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
             "n_positions": 1024, "layer_norm_epsilon": 1e-05},
}
SPECS = {**{f"preset {k}": v for k, v in PRESETS.items()},
         **{f"hf {k}": from_hf_config(dict(v, _name_or_path=k)) for k, v in HF_CONFIGS.items()}}


def test_every_model_field_has_a_megatron_flag_or_a_gap():
    assert set(MEGATRON_FIELDS) == {f.name for f in dataclasses.fields(ModelSpec)}


@pytest.mark.parametrize("name", list(SPECS))
def test_the_emitted_megatron_model_is_the_checkpoints(name):
    spec = SPECS[name]
    text = to_megatron_args(Plan(dp_replicate=8), spec)
    gaps = megatron_gaps(Plan(dp_replicate=8), spec)
    if spec.max_position_embeddings:
        assert "--position-embedding-type learned_absolute" in text
    else:
        assert f"--rotary-base {spec.rope_theta:.0f}" in text and spec.rope_theta > 0
    assert f"--norm-epsilon {spec.norm_eps:g}" in text and spec.norm_eps > 0
    kind = dict(spec.rope_scaling).get("rope_type", dict(spec.rope_scaling).get("type"))
    if kind == "llama3":
        assert "--use-rope-scaling" in text and "--rope-scaling-factor 8" in text
    if kind == "yarn":
        assert "--rope-type yarn" in text and "--rotary-scaling-factor 40" in text and "--mscale-all-dim 1" in text
    assert not [g for g in gaps if g.startswith(("RoPE base", "norm epsilon", "rope_scaling"))], gaps
    assert "--train-iters" in text and "--lr " in text and "torchrun --nproc_per_node 8" in text


def test_what_is_not_known_or_not_expressible_is_said():
    bare = dataclasses.replace(PRESETS["llama3-8b"], rope_theta=0.0, norm_eps=0.0)
    gaps = megatron_gaps(Plan(dp_replicate=8), bare)
    assert any(g.startswith("RoPE base: not known") for g in gaps)
    assert any(g.startswith("norm epsilon: not known") for g in gaps)
    odd = dataclasses.replace(PRESETS["llama3-8b"], rope_scaling=(("factor", 4.0), ("rope_type", "dynamic")))
    assert any(g.startswith("rope_scaling dynamic") for g in megatron_gaps(Plan(dp_replicate=8), odd))
    wide = dataclasses.replace(PRESETS["llama3-8b"], rope_scaling=(
        ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 4096), ("rope_type", "llama3")))
    assert any("Megatron fixes" in g for g in megatron_gaps(Plan(dp_replicate=8), wide))


def test_a_spec_round_trips_with_its_position_fields():
    import json

    spec = PRESETS["deepseek-v3"]
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
