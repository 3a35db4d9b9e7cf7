"""flide::fork_conv_* custom ops. Variants: `reference` (pure torch, any device)."""

from __future__ import annotations

import torch

from ..registry import register
from . import reference


@torch.library.custom_op("flide::fork_conv_reference", mutates_args=())
def fork_conv_reference(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                        trunk_hi: torch.Tensor, silu: bool) -> torch.Tensor:
    return reference.fork_conv(x, weight, seg_lo, trunk_lo, trunk_hi, silu)


@fork_conv_reference.register_fake
def _(x, weight, seg_lo, trunk_lo, trunk_hi, silu):
    return torch.empty_like(x)


register("fork_conv", "reference")(fork_conv_reference)
