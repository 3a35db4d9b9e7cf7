"""flide::qk_prep_triton: a Qwen3.5 attention layer's q / k head norms and partial rotary embedding in one Triton
launch (`kernels.fuse_attention_prep`, auto: on CUDA), instead of the small kernels Inductor makes of the model's own
modules. `reference.py` is its oracle (the modules' math, op for op)."""

from __future__ import annotations

import torch

from . import reference  # noqa: F401 (the oracle, for tests and readers)


@torch.library.custom_op("flide::qk_prep_triton", mutates_args=(), device_types="cuda")
def qk_prep_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from . import triton as kernel  # imported on first use: `import flide` must not need triton

    return kernel.qk_prep(q, k, cos, sin, q_weight, k_weight, eps)


@qk_prep_triton.register_fake
def _fake(q, k, cos, sin, q_weight, k_weight, eps):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def supports(attention) -> bool:
    """Whether an attention module's q / k preparation is the one `qk_prep` computes: Qwen3.5's zero-centred head
    norms (`Qwen3_5RMSNorm`) and its partial rotary (`apply_rotary_pos_emb` of the qwen3_5 module)."""
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return (type(q_norm).__name__ == type(k_norm).__name__ == "Qwen3_5RMSNorm"
            and getattr(q_norm, "eps", None) == getattr(k_norm, "eps", None)
            and type(attention).__module__.endswith("qwen3_5.modeling_qwen3_5"))
