"""Float8 training linears as torchao's default ``tensorwise`` recipe runs them, in plain torch.

What a float8 block costs on a GPU is what its kernels cost: every converted linear casts its input and weight to
float8 e4m3 (one dynamic scale per tensor, ``FP8_MAX / amax``), multiplies them with ``torch._scaled_mm`` (bf16
out) and saves the bf16 input and weight; the backward casts the output gradient to e5m2 and the weight and input
to e4m3 again and runs two more scaled matmuls (input gradient with the weight, weight gradient with the input),
each operand laid out as the kernel needs (the first row-major, the second column-major: a transposed copy)
[derived: torchao ``float8/float8_linear.py``, matmul_with_hp_or_float8_args; the recipe's defaults: e4m3
forward, e5m2 gradients, tensorwise scales]. The profiler measures blocks built with it
(``profiler.blocks.measure_block``): before this module a ``float8`` block was timed as the plain bf16 block.

Which linears: those of the transformer blocks whose in and out features are multiples of 16 (``_scaled_mm``'s
constraint; torchao's converter skips the others), never the output projection (torchtitan's default
``filter_fqns``) nor a MoE router (a few columns; torchtitan's MoE recipes leave ``router.gate`` out); grouped
expert GEMMs stay bf16 (torchao converts them only on request).
"""

from __future__ import annotations

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SKIPPED = ("output", "router")  # module names never converted (see the module docstring)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in float8 ``dtype`` with one dynamic scale (largest magnitude onto the format's maximum), and the
    inverse scale ``_scaled_mm`` takes."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = fmax / amax
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (``_scaled_mm``'s second operand)."""
    return t.t().contiguous().t()


class _Float8MM(torch.autograd.Function):
    """y = x @ w.T with x (M, K) and w (N, K) cast to e4m3. As torchao's ``matmul_with_hp_or_float8_args``, the
    forward saves the high-precision x and w (a float8 linear holds what a bf16 one holds) and the backward casts
    again: the output gradient to e5m2 for each of its two products (dx = dy @ w, dw = dy.T @ x) and w and x to
    e4m3."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        x8, sx = _cast(x, E4M3)
        w8, sw = _cast(w, E4M3)
        return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        g8, sg = _cast(dy, E5M2)
        w8, sw = _cast(w, E4M3)
        dx = torch._scaled_mm(g8, _col_major(w8), scale_a=sg, scale_b=sw, out_dtype=x.dtype)
        g8, sg = _cast(dy, E5M2)  # torchao casts the gradient once per product
        x8, sx = _cast(x, E4M3)
        dw = torch._scaled_mm(g8.t().contiguous(), _col_major(x8), scale_a=sg, scale_b=sx, out_dtype=w.dtype)
        return dx, dw


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmul runs in float8 (``_Float8MM``); the bias is added in the input's dtype; under
    autocast the input is cast to autocast's dtype first (torchao's ``Float8Linear.forward``), so the output has
    the dtype a bf16 linear's would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if torch.is_autocast_enabled(x.device.type):  # as torchao: the input in autocast's dtype, the weight as is
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = _Float8MM.apply(x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def convertible(name: str, m: nn.Module) -> bool:
    """Whether the linear named ``name`` (its last component) is converted (module docstring)."""
    return (type(m) is nn.Linear and name not in SKIPPED and m.in_features % 16 == 0
            and m.out_features % 16 == 0)


def convert_to_float8(module: nn.Module) -> list[str]:
    """Swap the convertible ``nn.Linear``s under ``module`` for ``Float8Linear`` in place (parameters kept, as
    torchao's ``convert_to_float8_training``); the qualified names swapped."""
    swapped = []
    for qual, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if convertible(name, child):
                child.__class__ = Float8Linear  # same parameters and buffers, float8 forward
                swapped.append(f"{qual}.{name}" if qual else name)
    return swapped

