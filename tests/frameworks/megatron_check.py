"""Run with Megatron-LM's sources on PYTHONPATH: parse parsim-emitted Megatron arguments with Megatron-LM's own
parser (``megatron.training.arguments.parse_args``) and run its ``validate_args``, then print the settled arguments
as one JSON line per snippet.

    WORLD_SIZE is set per snippet: python megatron_check.py SNIPPET.sh WORLD_SIZE [SNIPPET.sh WORLD_SIZE ...]

Megatron-LM's training arguments are not in the ``megatron-core`` wheel; point PYTHONPATH at a Megatron-LM
checkout. Its newest sources use ``typing.override`` (Python 3.12); on 3.11 the typing_extensions one stands in.
"""

import os
import shlex
import sys
import typing
from unittest import mock

FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
          "data_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
          "virtual_pipeline_model_parallel_size", "micro_batch_size", "global_batch_size", "seq_length",
          "sequence_parallel", "tp_comm_overlap", "use_megatron_fsdp", "use_torch_fsdp2",
          "use_distributed_optimizer", "data_parallel_sharding_strategy", "num_distributed_optimizer_instances",
          "recompute_granularity", "recompute_method", "recompute_num_layers", "fp8", "fp8_recipe",
          "transformer_impl", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
          "num_query_groups", "kv_channels", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
          "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights", "multi_latent_attention",
          "rotary_base", "layernorm_epsilon", "use_rope_scaling", "rope_scaling_factor", "rope_type",
          "rotary_scaling_factor", "mscale", "mscale_all_dim", "optimizer", "lr", "train_iters", "lr_decay_style")


def emitted_args(path: str) -> list[str]:
    """The words of the MEGATRON_ARGS=( ... ) array of a snippet."""
    text = open(path).read()
    body = text[text.index("MEGATRON_ARGS=(") + len("MEGATRON_ARGS=("):text.rindex(")")]
    return shlex.split(body, comments=True)


def exported_env(path: str) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of a snippet (what a user sources before launching)."""
    out = {}
    for line in open(path).read().splitlines():
        if line.startswith("export "):
            name, _, value = shlex.split(line[len("export "):], comments=True)[0].partition("=")
            out[name] = value
    return out


def main(path: str, world_size: int) -> dict:
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    import megatron.training.arguments as margs
    from megatron.training.arguments import parse_args, validate_args

    words = emitted_args(path)
    # checked as on an H100 (SM 9.0): validate_args asks the GPU's architecture (FSDP, grouped GEMM)
    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *words]), \
            mock.patch.dict(os.environ, {**exported_env(path), "WORLD_SIZE": str(world_size), "RANK": "0"}), \
            mock.patch.object(margs, "get_device_arch_version", return_value=9, create=True), \
            mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        args = parse_args()
        validate_args(args)
    out = {k: getattr(args, k, None) for k in FIELDS}
    if getattr(args, "pipeline_model_parallel_layout", None):
        # what TransformerConfig checks later: the layout parses, has one E and one L and every layer once
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        lay = PipelineParallelLayerLayout.from_str(args.pipeline_model_parallel_layout,
                                                   args.pipeline_model_parallel_size)
        lay.validate_layer_layout(args.num_layers, getattr(args, "mtp_num_layers", None))
        pp = lay.pipeline_model_parallel_size
        n = pp * lay.virtual_pipeline_model_parallel_size
        out["layout_stage_layers"] = [lay.layout[s % pp][s // pp].count(LayerType.decoder) for s in range(n)]
    return out


if __name__ == "__main__":
    from _runner import run_all

    run_all(main)
