"""Fork attention variants: `reference` (flide::fork_attention_reference, pure torch, any device), `flex`
(FlexAttention with block tables built on the GPU; CUDA)."""

from __future__ import annotations

import torch

from ..registry import register
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


def _cuda_only() -> str | None:
    return None if torch.cuda.is_available() else "it needs a CUDA GPU"


# Not an opaque custom op: FlexAttention is a higher-order op that torch.compile traces itself, so inside the flat
# graph Inductor fuses the block-table building with its neighbours and emits the flex kernel in the same graph;
# called eagerly, `flex.fork_attention` runs its own compiled flex kernel.
register("fork_attention", "flex", available=_cuda_only)(flex.fork_attention)
