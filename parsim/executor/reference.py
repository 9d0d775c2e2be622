"""The single-process run that parallel runs are checked against: same model, init, data, loss, clipping and
optimizer as the worker, on the whole global batch, no parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import ModelSpec
from .model import Transformer
from .worker import CLIP, batch_for_step, make_optimizer


def reference_losses(spec: ModelSpec, global_batch: int, seq_len: int, steps: int,
                     optimizer: str = "adamw") -> list[float]:
    torch.manual_seed(0)
    model = Transformer(spec, seq_len)
    model.init_weights(seed=0)
    params = list(model.parameters())
    opt = make_optimizer(params, optimizer)
    out = []
    for i in range(steps):
        data = batch_for_step(i, global_batch, seq_len, spec.vocab_size)
        x, y = data[:, :-1], data[:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum") / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out
