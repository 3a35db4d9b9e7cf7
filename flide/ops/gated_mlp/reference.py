"""A gated MLP's first half, `act(gate(x)) * up(x)`, with SiLU: what transformers' Qwen3.5 / Qwen3 / Llama MLPs run
before their down projection. The oracle of the `gated_mlp` variants.

`weight` is the gate and up projections stacked by rows ([2I, H]: the fused buffer `flide/models/fused.py` makes of
the two layers, gate first), so one GEMM gives both. The roundings are eager PyTorch's, op for op: gate and up each
rounded to x's dtype by the GEMM, SiLU computed in fp32 and rounded to that dtype, the product rounded once more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_mlp(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, H], weight [2I, H] (gate rows, then up rows) -> silu(x @ gate.T) * (x @ up.T), [M, I] in x's dtype."""
    if weight.shape[0] % 2:
        raise ValueError(f"gated_mlp: weight {tuple(weight.shape)} must stack gate and up rows ([2I, H])")
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up
