"""flide::linear_* custom ops: the decoder's linear layers, swapped in only when a variant other than `torch` is
picked (batch-invariant mode picks `blocked` on the CPU, `triton` on CUDA). Variants: `torch` (F.linear: BLAS /
cuBLAS, kernel chosen per row count), `blocked` (pure torch, rows in fixed blocks: batch-invariant), `triton` (our
fixed-tile Triton GEMM, no split-K: batch-invariant; CUDA; 16-bit layers in its persistent TMA form with 128 x 256
tiles, about cuBLAS's speed on the H200), `triton_pointer` (the same GEMM's pointer kernel with 128 x 128 tiles, the
default before the TMA form: an ablation, ~1.3x cuBLAS), `triton_tma_ws` (the default tiles with warp
specialisation). Each is batch-invariant with its own bits; layers the TMA cannot address take the pointer kernel
with the variant's tiles."""

from __future__ import annotations

import torch

from ..registry import needs_cuda_triton, register
from . import reference


def _fake(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("flide::linear_torch", mutates_args=())
def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return reference.linear(x, weight, bias)


@torch.library.custom_op("flide::linear_blocked", mutates_args=())
def linear_blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return reference.linear_blocked(x, weight, bias)


@torch.library.custom_op("flide::linear_triton", mutates_args=(), device_types="cuda")
def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from . import triton as kernel  # imported on first use: `import flide` does not need triton

    return kernel.linear(x, weight, bias)


@torch.library.custom_op("flide::linear_triton_pointer", mutates_args=(), device_types="cuda")
def linear_triton_pointer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from . import triton as kernel

    return kernel.linear(x, weight, bias, config=kernel.pointer_config(x.dtype))


@torch.library.custom_op("flide::linear_triton_tma_ws", mutates_args=(), device_types="cuda")
def linear_triton_tma_ws(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from . import triton as kernel

    return kernel.linear(x, weight, bias, config=kernel.tma_config(x.dtype, warp_specialize=True))


for _op in (linear_torch, linear_blocked, linear_triton, linear_triton_pointer, linear_triton_tma_ws):
    _op.register_fake(_fake)

register("linear", "torch")(linear_torch)
register("linear", "blocked", batch_invariant=True)(linear_blocked)
register("linear", "triton", available=needs_cuda_triton, batch_invariant=True)(linear_triton)
register("linear", "triton_pointer", available=needs_cuda_triton, batch_invariant=True)(linear_triton_pointer)
register("linear", "triton_tma_ws", available=needs_cuda_triton, batch_invariant=True)(linear_triton_tma_ws)
