"""The forked causal depthwise conv of Gated DeltaNet layers, in pure torch.

Each output is a weighted sum of the last W inputs of its token's *logical* sequence: inside its own segment the
stream's previous rows; before a question's first token, the last inputs of its state (its conv window), read
straight from the stream where the state lies; zeros before the start of the state, as in the standalone prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def predecessor_index(seg_lo: torch.Tensor, trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width] stream rows of the inputs each token's conv reads, oldest first; T (an extra zero row) where the
    logical sequence has no such input."""
    T = seg_lo.shape[0]
    t = torch.arange(T, device=seg_lo.device)[:, None]
    back = torch.arange(width - 1, -1, -1, device=seg_lo.device)[None, :]  # distances width-1 .. 0
    src = t - back
    before = seg_lo[:, None] - src  # > 0: how far before the segment start this input lies
    in_trunk = trunk_hi[:, None] - before
    from_trunk = (before > 0) & (in_trunk >= trunk_lo[:, None]) & (trunk_hi[:, None] > trunk_lo[:, None])
    return torch.where(before <= 0, src, torch.where(from_trunk, in_trunk, torch.full_like(src, T)))


def fork_conv(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
              trunk_hi: torch.Tensor, silu: bool) -> torch.Tensor:
    """
    Args:
        x: [T, D] conv inputs (the qkv projections); weight: [D, W] depthwise kernel (no bias).
        seg_lo, trunk_lo, trunk_hi: [T] int64 stream indices, as for fork attention.
        silu: apply SiLU to the output (Qwen3.5 does).
    Returns: [T, D] in x's dtype; the products and sums run in the weight's dtype, as transformers' conv does.
    """
    T, D = x.shape
    W = weight.shape[1]
    rows = predecessor_index(seg_lo, trunk_lo, trunk_hi, W)  # [T, W]
    padded = torch.cat([x.to(weight.dtype), x.new_zeros(1, D, dtype=weight.dtype)])
    windows = padded[rows]  # [T, W, D]
    out = torch.einsum("twd,dw->td", windows, weight)
    if silu:
        out = F.silu(out)
    return out.to(x.dtype).contiguous()  # einsum hands back [T, D] transposed in memory; the fake impl says contiguous
