"""Run in a venv holding torchtitan 0.2.2 (the last TOML release): load a parsim-emitted TOML the way
``torchtitan.train`` does (``ConfigManager`` with ``--job.config_file``) and run the checks its Trainer makes before
it touches a GPU, then print what torchtitan ended up with as one JSON line per config.

    python torchtitan_022_check.py EMITTED.toml WORLD_SIZE [EMITTED.toml WORLD_SIZE ...]

Checks in the Trainer's order (torchtitan/train.py, 0.2.2): the TOML through tyro into ``JobConfig``,
``ParallelDims`` (degrees x world size, ETP = TP or 1) and its mesh on a fake process group, the model built on
the meta device from the train spec's flavour, the model converters (float8: the SM89 check answered "yes", the
recipe / all-gather assertion), the loss, the batch assertions, and for PP the stage-count checks of
``pipeline_llm`` and the stage split.
"""

from unittest import mock


def main(path: str, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    import torchtitan.components.quantization.float8 as f8
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    jc = ConfigManager().parse_args(["--job.config_file", path])
    p = jc.parallelism
    dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world_size)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        with mock.patch("torchtitan.distributed.parallel_dims.device_type", "cpu", create=True):
            dims.build_mesh()
        spec = get_train_spec(jc.model.name)
        model_args = spec.model_args[jc.model.flavor]
        model_args.update_from_config(jc)
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        with mock.patch.object(f8, "has_cuda_capability", return_value=True):
            build_model_converters(jc, dims).convert(model)
        spec.build_loss_fn(jc, parallel_dims=dims)
    finally:
        dist.destroy_process_group()
    batch_degree = dims.dp_replicate * dims.dp_shard
    gbs = jc.training.global_batch_size
    gbs = jc.training.local_batch_size * batch_degree if gbs < 0 else gbs
    assert gbs % (jc.training.local_batch_size * batch_degree) == 0, "global batch not a multiple of local x dp"
    f8cfg = jc.quantize.linear.float8
    out = {"degrees": [dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.ep, dims.etp],
           "training": [jc.training.local_batch_size, gbs, jc.training.seq_len,
                        jc.training.mixed_precision_param, jc.training.mixed_precision_reduce],
           "compile": [jc.compile.enable, p.enable_async_tensor_parallel],
           "ac": [jc.activation_checkpoint.mode, jc.activation_checkpoint.selective_ac_option],
           "reshard": p.fsdp_reshard_after_forward, "schedule": p.pipeline_parallel_schedule,
           "microbatch": p.pipeline_parallel_microbatch_size, "model": [jc.model.name, jc.model.flavor],
           "float8": [f8cfg.recipe_name, f8cfg.enable_fsdp_float8_all_gather],
           "n_params": sum(q.numel() for q in model.parameters()),
           "float8_linears": sorted({n.split(".")[-1] for n, m in model.named_modules()
                                     if type(m).__name__ == "Float8Linear"})}
    if dims.pp > 1:
        parts = p.module_fqns_per_model_part
        assert parts is not None and len(parts) % dims.pp == 0, f"{parts and len(parts)} stages on {dims.pp} ranks"
        names = {n for n, _ in model.named_children()} | {f"layers.{n}" for n, _ in model.layers.named_children()}
        assert sorted(m for part in parts for m in part) == sorted(names - {"layers"}), "split does not cover once"
        out["stage_layers"] = [sum(m.startswith("layers.") for m in part) for part in parts]
    return out


if __name__ == "__main__":
    from _runner import run_all

    run_all(main)
