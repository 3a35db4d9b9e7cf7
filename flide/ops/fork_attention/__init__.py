"""flide::fork_attention_* custom ops. Variants: `reference` (pure torch, any device: the oracle), `segments` (pure
torch, one segment at a time: batch-invariant, the CPU path of that mode), `flex` (FlexAttention with block tables
built on the GPU; CUDA), `triton` (our kernel; CUDA), `triton_invariant` (our batch-invariant kernel; CUDA).

Companions: `*_prefix_*` (checkpoints: cached prefix keys) and `*_nested_*` (nested forks: each leaf token's sub-trunk
key range too), for the variants that have them."""

from __future__ import annotations

import torch

from ..registry import needs_cuda, needs_cuda_triton, register, register_nested, register_resumable
from . import flex, reference
from ..resume import attention_with_prefix


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


@torch.library.custom_op("flide::fork_attention_triton_invariant", mutates_args=(), device_types="cuda")
def fork_attention_triton_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                                    trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, scale: float) -> torch.Tensor:
    # batch-invariant mode's CUDA kernel (triton_invariant.py): key tiles start at each row's trunk_lo and seg_lo,
    # never at absolute positions, so a row's sums run in one order whatever shares its query block
    from . import triton_invariant as kernel

    return kernel.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale)


fork_attention_triton_invariant.register_fake(_fake)
register("fork_attention", "triton_invariant", available=needs_cuda_triton,
         batch_invariant=True)(fork_attention_triton_invariant)


@torch.library.custom_op("flide::fork_attention_prefix_triton_invariant", mutates_args=(), device_types="cuda")
def fork_attention_prefix_triton_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                                           trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, pk: torch.Tensor,
                                           pv: torch.Tensor, pre_lo: torch.Tensor, pre_hi: torch.Tensor,
                                           scale: float) -> torch.Tensor:
    # The invariant kernel reads the checkpoint rows itself (its prefix phase): no extended stream to build, no host
    # sync, and a resumed state's key tiles fall where a fresh one's do (its m is a multiple of 64)
    from . import triton_invariant as kernel

    return kernel.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale,
                                 prefix=(pk.to(q.dtype), pv.to(q.dtype), pre_lo, pre_hi))


fork_attention_prefix_triton_invariant.register_fake(_fake_prefix)
register_resumable("fork_attention", "triton_invariant")(fork_attention_prefix_triton_invariant)

# Checkpoints with the other fast variants: the prefix keys go back into an extended stream that the plain kernel
# runs (flide/ops/resume.py; rounds with checkpoint work run eagerly, so the host may look at the metadata). flex's
# companion runs our Triton kernel: flex is compiled per stream length (size classes, seconds each on the H200), and
# checkpoint rounds, whose extended streams grow with every agent step, would keep compiling; the Triton kernel
# takes any length without a compile and computes the same attention (both are checked against the reference).
for _variant, _op in (("segments", fork_attention_segments), ("flex", fork_attention_triton),
                      ("triton", fork_attention_triton)):
    register_resumable("fork_attention", _variant)(attention_with_prefix(_op))


# Nested forks (`runtime.nested_forks`): a leaf question also sees its sub-trunk's keys [sub_lo, sub_hi) (between its
# state's and its own). Companions of reference, segments and triton_invariant only: flex and triton have none yet,
# so with them the engine keeps nested forks off.
@torch.library.custom_op("flide::fork_attention_nested_reference", mutates_args=())
def fork_attention_nested_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                                    trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, sub_lo: torch.Tensor,
                                    sub_hi: torch.Tensor, scale: float) -> torch.Tensor:
    return reference.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale, sub_lo, sub_hi)


def _fake_nested(q, k, v, seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi, scale):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


fork_attention_nested_reference.register_fake(_fake_nested)
register_nested("fork_attention", "reference")(fork_attention_nested_reference)


@torch.library.custom_op("flide::fork_attention_nested_segments", mutates_args=())
def fork_attention_nested_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                                   trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, sub_lo: torch.Tensor,
                                   sub_hi: torch.Tensor, scale: float) -> torch.Tensor:
    return reference.fork_attention_segments(q, k, v, seg_lo, trunk_lo, trunk_hi, scale, sub_lo, sub_hi)


fork_attention_nested_segments.register_fake(_fake_nested)
register_nested("fork_attention", "segments")(fork_attention_nested_segments)


@torch.library.custom_op("flide::fork_attention_nested_triton_invariant", mutates_args=(), device_types="cuda")
def fork_attention_nested_triton_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                                           trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, sub_lo: torch.Tensor,
                                           sub_hi: torch.Tensor, scale: float) -> torch.Tensor:
    # the invariant kernel's sub-trunk phase: a leaf's sub-trunk tiles start at its sub_lo, so its bits stay
    # independent of the rest of the round
    from . import triton_invariant as kernel

    return kernel.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale, sub=(sub_lo, sub_hi))


fork_attention_nested_triton_invariant.register_fake(_fake_nested)
register_nested("fork_attention", "triton_invariant")(fork_attention_nested_triton_invariant)
