"""flide::gated_norm_* custom ops: the end of a Gated DeltaNet layer, each row taken from the fork's call that wrote
it, then Qwen3.5's gated RMS norm (`reference.py`). Variants: `torch` (the layer keeps the model's own norm module
after the fork's select; Inductor fuses the two: what ran before this op existed), `triton` (one kernel reading
each row once; CUDA)."""

from __future__ import annotations

import torch

from ..registry import needs_cuda_triton, register
from . import reference


@torch.library.custom_op("flide::gated_norm_torch", mutates_args=())
def gated_norm_torch(x_states: torch.Tensor, x_branches: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                     states_end: torch.Tensor, branches_start: torch.Tensor, branches_end: torch.Tensor,
                     eps: float) -> torch.Tensor:
    return reference.gated_norm(x_states, x_branches, gate, weight, states_end, branches_start, branches_end, eps)


def _fake(x_states, x_branches, gate, weight, states_end, branches_start, branches_end, eps):
    return torch.empty(x_states.shape, dtype=x_states.dtype, device=x_states.device)


gated_norm_torch.register_fake(_fake)
# Read by the GDN layer (flide.models.layers): this variant is the model's own norm module run as plain torch code
# (which Inductor fuses with the select), not a call of the op; the op itself is the same math, for opcheck and
# for running it alone
gated_norm_torch.keeps_module = True
register("gated_norm", "torch", batch_invariant=True)(gated_norm_torch)


@torch.library.custom_op("flide::gated_norm_triton", mutates_args=(), device_types="cuda")
def gated_norm_triton(x_states: torch.Tensor, x_branches: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                      states_end: torch.Tensor, branches_start: torch.Tensor, branches_end: torch.Tensor,
                      eps: float) -> torch.Tensor:
    from . import triton as kernel  # imported on first use: `import flide` must not need triton

    return kernel.gated_norm(x_states, x_branches, gate, weight, states_end, branches_start, branches_end, eps)


gated_norm_triton.register_fake(_fake)
gated_norm_triton.keeps_module = False
register("gated_norm", "triton", available=needs_cuda_triton, batch_invariant=True)(gated_norm_triton)
