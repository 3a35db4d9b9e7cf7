"""flide::gated_mlp_* custom ops: a gated MLP's `silu(gate(x)) * up(x)` from the stacked gate/up weight (the first
half of Qwen3.5's, Qwen3's, Llama's MLP; its down projection stays the model's). Variants: `torch` (the layer keeps
the model's modules: one cuBLAS GEMM over the stacked weight, then the act and product, which Inductor fuses into one
pointwise kernel: what ran before this op existed), `triton` (one Triton GEMM with SiLU and the product in its
epilogue: the [M, 2I] intermediate never reaches memory; CUDA)."""

from __future__ import annotations

import torch

from ..registry import needs_cuda_triton, register
from . import reference


def _fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op("flide::gated_mlp_torch", mutates_args=())
def gated_mlp_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return reference.gated_mlp(x, weight)


gated_mlp_torch.register_fake(_fake)
# Read by the flat model (flide.models.flat): this variant is the model's own modules run as plain torch code (which
# Inductor fuses), not a call of the op; the op itself is the same math, for opcheck and for running it alone. With
# batch-invariant linear layers (FlideLinear) those modules are invariant, so is this.
gated_mlp_torch.keeps_module = True
register("gated_mlp", "torch", batch_invariant=True)(gated_mlp_torch)


@torch.library.custom_op("flide::gated_mlp_triton", mutates_args=(), device_types="cuda")
def gated_mlp_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from . import triton as kernel  # imported on first use: `import flide` must not need triton

    return kernel.gated_mlp(x, weight)


gated_mlp_triton.register_fake(_fake)
gated_mlp_triton.keeps_module = False
# a row's sums depend on nothing but its own x row (fixed tiles, no split-K): batch-invariant, with its own bits
register("gated_mlp", "triton", available=needs_cuda_triton, batch_invariant=True)(gated_mlp_triton)
