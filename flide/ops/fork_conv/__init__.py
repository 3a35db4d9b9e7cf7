"""flide::fork_conv_* custom ops. Variants: `reference` (pure torch, any device), `triton` (one Triton kernel over
token x channel tiles; CUDA)."""

from __future__ import annotations

import torch

from ..registry import needs_cuda_triton, register, register_resumable
from . import reference


@torch.library.custom_op("flide::fork_conv_reference", mutates_args=())
def fork_conv_reference(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                        trunk_hi: torch.Tensor, silu: bool) -> torch.Tensor:
    return reference.fork_conv(x, weight, seg_lo, trunk_lo, trunk_hi, silu)


def _fake(x, weight, seg_lo, trunk_lo, trunk_hi, silu):
    """Every variant's output: [T, D] like x, contiguous."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


fork_conv_reference.register_fake(_fake)
# every output row is its own window's sum, in the window's order: batch-invariant
register("fork_conv", "reference", batch_invariant=True)(fork_conv_reference)


@torch.library.custom_op("flide::fork_conv_window_reference", mutates_args=())
def fork_conv_window_reference(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                               trunk_hi: torch.Tensor, window: torch.Tensor, win_index: torch.Tensor,
                               silu: bool) -> torch.Tensor:
    return reference.fork_conv_window(x, weight, seg_lo, trunk_lo, trunk_hi, window, win_index, silu)


@fork_conv_window_reference.register_fake
def _fake_window(x, weight, seg_lo, trunk_lo, trunk_hi, window, win_index, silu):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# The checkpointing companion of the reference variant (flide/checkpoints): conv windows of resumed states
register_resumable("fork_conv", "reference")(fork_conv_window_reference)


@torch.library.custom_op("flide::fork_conv_triton", mutates_args=(), device_types="cuda")
def fork_conv_triton(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                     trunk_hi: torch.Tensor, silu: bool) -> torch.Tensor:
    from . import triton as kernel  # imported on first use: `import flide` must not need triton

    return kernel.fork_conv(x, weight, seg_lo, trunk_lo, trunk_hi, silu)


fork_conv_triton.register_fake(_fake)
register("fork_conv", "triton", available=needs_cuda_triton, batch_invariant=True)(fork_conv_triton)


@torch.library.custom_op("flide::fork_conv_qkv_triton", mutates_args=(), device_types="cuda")
def fork_conv_qkv_triton(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                         trunk_hi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                         dt_bias: torch.Tensor, key_heads: int, head_dim: int, normalize: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # the GDN layer's conv with q / k / v laid out (and q / k normalised) for the gated delta kernels, and the
    # layer's gates g / beta, in one launch (flide.models.layers: with the fla state call that takes them so,
    # `LAID_OUT_STATE_KERNELS`)
    from . import triton as kernel

    return kernel.fork_conv_qkv(x, weight, seg_lo, trunk_lo, trunk_hi, key_heads, head_dim, normalize,
                                (a, b, a_log, dt_bias))


@fork_conv_qkv_triton.register_fake
def _fake_qkv(x, weight, seg_lo, trunk_lo, trunk_hi, a, b, a_log, dt_bias, key_heads, head_dim, normalize):
    T, D = x.shape
    key_cols = key_heads * head_dim
    return (x.new_empty(T, key_heads, head_dim), x.new_empty(T, key_heads, head_dim),
            x.new_empty(T, (D - 2 * key_cols) // head_dim, head_dim), a.new_empty(a.shape, dtype=torch.float32),
            b.new_empty(b.shape))


# conv variants with a fused q / k / v layout form (looked up at patch time by the GDN layer)
QKV_KERNELS = {fork_conv_triton: fork_conv_qkv_triton}


@torch.library.custom_op("flide::fork_conv_window_triton", mutates_args=(), device_types="cuda")
def fork_conv_window_triton(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                            trunk_hi: torch.Tensor, window: torch.Tensor, win_index: torch.Tensor,
                            silu: bool) -> torch.Tensor:
    # the Triton kernel reads the checkpoint windows itself: no extended stream, no host sync; a resumed state's
    # inputs are the values a fresh stream holds there, so its outputs keep a fresh state's bits
    from . import triton as kernel

    return kernel.fork_conv(x, weight, seg_lo, trunk_lo, trunk_hi, silu, window=(window, win_index))


fork_conv_window_triton.register_fake(_fake_window)
register_resumable("fork_conv", "triton")(fork_conv_window_triton)
