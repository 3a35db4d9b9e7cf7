"""flide::fork_attention_* custom ops. Variants: `reference` (pure torch, any device), `flex` (FlexAttention with
block tables built on the GPU; CUDA)."""

from __future__ import annotations

import torch

from ..registry import needs_cuda, needs_cuda_triton, register, register_resumable
from . import flex, reference


@torch.library.custom_op("flide::fork_attention_reference", mutates_args=())
def fork_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                             trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, scale: float) -> torch.Tensor:
    return reference.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale)


def _fake(q, k, v, seg_lo, trunk_lo, trunk_hi, scale):
    """Every variant's output: [T, Hq, Dv] in q's dtype."""
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


fork_attention_reference.register_fake(_fake)
register("fork_attention", "reference", capturable=False)(fork_attention_reference)


@torch.library.custom_op("flide::fork_attention_prefix_reference", mutates_args=())
def fork_attention_prefix_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                                    trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, pk: torch.Tensor,
                                    pv: torch.Tensor, pre_lo: torch.Tensor, pre_hi: torch.Tensor,
                                    scale: float) -> torch.Tensor:
    return reference.fork_attention_prefix(q, k, v, seg_lo, trunk_lo, trunk_hi, pk, pv, pre_lo, pre_hi, scale)


@fork_attention_prefix_reference.register_fake
def _fake_prefix(q, k, v, seg_lo, trunk_lo, trunk_hi, pk, pv, pre_lo, pre_hi, scale):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("flide::fork_attention_segments", mutates_args=())
def fork_attention_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                            trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, scale: float) -> torch.Tensor:
    return reference.fork_attention_segments(q, k, v, seg_lo, trunk_lo, trunk_hi, scale)


fork_attention_segments.register_fake(_fake)
# batch-invariant mode's CPU path: one segment at a time (host syncs: not capturable)
register("fork_attention", "segments", capturable=False, batch_invariant=True)(fork_attention_segments)


# The checkpointing companion of the reference variant (flide/checkpoints): cached prefix keys of resumed states
register_resumable("fork_attention", "reference")(fork_attention_prefix_reference)



@torch.library.custom_op("flide::fork_attention_flex", mutates_args=(), device_types="cuda")
def fork_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                        trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, scale: float) -> torch.Tensor:
    # An opaque op that runs its own statically compiled flex kernel (one per stream length). Traced into the flat
    # graph instead, whose sizes are dynamic, Inductor (torch 2.11) fails on the block tables' [T/128, 128, T/128]
    # view ("CantSplit: (s//128) not divisible by ...", seen on the H200).
    return flex.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale)


fork_attention_flex.register_fake(_fake)
register("fork_attention", "flex", available=needs_cuda)(fork_attention_flex)


@torch.library.custom_op("flide::fork_attention_triton", mutates_args=(), device_types="cuda")
def fork_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                          trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, scale: float) -> torch.Tensor:
    # Flide's own Triton kernel (triton.py): key ranges from the round's metadata, GQA packed into the query tile.
    # Imported on first use, so that `import flide` does not need triton.
    from . import triton as kernel

    return kernel.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale)


fork_attention_triton.register_fake(_fake)



register("fork_attention", "triton", available=needs_cuda_triton)(fork_attention_triton)
