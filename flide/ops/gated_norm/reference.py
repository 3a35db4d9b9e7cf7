"""The gated RMS norm that ends a Gated DeltaNet layer, fed by the two gated delta calls of a fork.

A fork computes the states' rows and the questions' rows in two calls (`flide.ops.gated_delta.fork`); each row of
the layer's output comes from the call that covers it, rows covered by neither (the tail padding) are zero, and
then Qwen3.5's `RMSNormGated` runs per (token, head) row: x / rms(x), rounded to the model's dtype, times the weight,
times SiLU(gate) in fp32, rounded again. The Triton variant does both in one kernel that reads each row from the one
call that wrote it; this module is its oracle, written op for op as transformers writes the norm.

Shapes: x_states, x_branches, gate [T, H, V] (any strides); weight [V]; states_end, branches_start, branches_end [1]
(int32 or int64): rows [0, states_end) come from x_states, rows [branches_start, branches_end) from x_branches.
Returns [T, H, V] contiguous in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_rows(x_states: torch.Tensor, x_branches: torch.Tensor, states_end: torch.Tensor,
                branches_start: torch.Tensor, branches_end: torch.Tensor) -> torch.Tensor:
    """Each row from the call that covers it, zero elsewhere. A select, not a sum: a call may leave the rows outside
    its span unwritten (fla does), and NaN there must not spread."""
    t = torch.arange(x_states.shape[0], device=x_states.device)[:, None, None]
    in_branches = (t >= branches_start) & (t < branches_end)
    zero = torch.zeros((), dtype=x_states.dtype, device=x_states.device)
    return torch.where(t < states_end, x_states, torch.where(in_branches, x_branches, zero))


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `Qwen3_5RMSNormGated.forward` (SiLU gate), op for op: the same roundings."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)


def gated_norm(x_states: torch.Tensor, x_branches: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
               states_end: torch.Tensor, branches_start: torch.Tensor, branches_end: torch.Tensor,
               eps: float) -> torch.Tensor:
    x = select_rows(x_states, x_branches, states_end, branches_start, branches_end)
    return rms_norm_gated(x, gate, weight, eps).contiguous()
