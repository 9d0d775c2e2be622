"""Run in a venv holding torchtitan 0.3.0: load a parsim-emitted config module the way ``torchtitan.train`` does
(``ConfigManager`` with ``--module/--config``) and run the checks torchtitan's Trainer makes before it touches a
GPU, then print what torchtitan ended up with as one JSON line.

    python torchtitan_030_check.py EMITTED.py WORLD_SIZE [EMITTED.py WORLD_SIZE ...]

One JSON line per config: the fields torchtitan ended up with, or {"error": "..."} with torchtitan's message.

Checks, in the Trainer's order (torchtitan/trainer.py, 0.3.0): ``Trainer.Config.__post_init__`` (run by tyro,
CUDA-graph and microbatch checks), ``ParallelDims`` from the config (degrees x world size) and its device mesh built
on a fake process group (EP / efsdp unflattening), the sequence-length divisor, the model built on the meta device
with the float8 converter (the SM89 capability check answered "yes"), the module protocol, the loss built from the
config, the batch and gradient-accumulation assertions, and for PP the stage metadata and the stage split.
"""

import sys
from pathlib import Path
from unittest import mock


def main(path: str, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(Path(path).parent))
    import torchtitan.components.quantization.float8 as f8
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed import ParallelDims

    # a float8 plan is checked as on an H100: torchtitan's converter refuses to build below SM89
    with mock.patch.object(f8, "has_cuda_capability", return_value=True):
        cfg = ConfigManager().parse_args(["--module", Path(path).stem, "--config", "parsim_plan"])
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
        try:
            with mock.patch("torchtitan.distributed.parallel_dims.device_type", "cpu", create=True):
                dims.build_mesh()
        finally:
            dist.destroy_process_group()
        divisor = (dims.tp if cfg.parallelism.enable_sequence_parallel else 1) * (2 * dims.cp if dims.cp > 1 else 1)
        assert cfg.training.seq_len % divisor == 0, f"seq_len {cfg.training.seq_len} not divisible by {divisor}"
        model_config = cfg.model_spec.model
        model_config.update_from_config(config=cfg)
        with torch.device("meta"):
            model = model_config.build()
        model.verify_module_protocol()
    cfg.loss.build(compile_config=cfg.compile)
    batch_degree = dims.dp_replicate * dims.dp_shard
    gbs = cfg.training.global_batch_size
    gbs = cfg.training.local_batch_size * batch_degree if gbs < 0 else gbs
    assert gbs % (cfg.training.local_batch_size * batch_degree) == 0, "global batch not a multiple of local x dp"
    out = {"degrees": [dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.ep],
           "training": [cfg.training.local_batch_size, gbs, cfg.training.seq_len,
                        cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce],
           "grad_accum": gbs // (cfg.training.local_batch_size * batch_degree),
           "compile": [cfg.compile.enable, cfg.compile.enable_async_tensor_parallel],
           "ac": None if cfg.activation_checkpoint is None else type(cfg.activation_checkpoint).__qualname__,
           "reshard": cfg.parallelism.fsdp_reshard_after_forward,
           "sequence_parallel": cfg.parallelism.enable_sequence_parallel,
           "schedule": cfg.parallelism.pipeline_parallel_schedule,
           "microbatch": cfg.parallelism.pipeline_parallel_microbatch_size,
           "loss": type(cfg.loss).__qualname__, "dataloader": type(cfg.dataloader).__qualname__,
           "model": [cfg.model_spec.name, cfg.model_spec.flavor],
           "n_params": sum(p.numel() for p in model.parameters()),
           "float8_linears": sorted({n.split(".")[-1] for n, m in model.named_modules()
                                     if type(m).__name__ == "Float8Linear"}),
           "attention": sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})}
    if dims.pp > 1:
        from torchtitan.distributed.pipeline_parallel import _get_pipeline_metadata, get_schedule_class

        get_schedule_class(cfg.parallelism.pipeline_parallel_schedule)
        _get_pipeline_metadata(dims, cfg.parallelism, model_config)
        parts = cfg.parallelism.module_fqns_per_model_part
        names = {n for n, _ in model.named_children()} | {f"layers.{n}" for n, _ in model.layers.named_children()}
        flat = [m for part in parts for m in part]
        assert sorted(flat) == sorted(names - {"layers"}), "stage split does not cover the model once"
        assert len(parts) % dims.pp == 0, f"{len(parts)} stages on {dims.pp} ranks"
        out["stage_layers"] = [sum(m.startswith("layers.") for m in part) for part in parts]
        out["microbatches"] = cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size
    return out


if __name__ == "__main__":
    from _runner import run_all

    run_all(main)
