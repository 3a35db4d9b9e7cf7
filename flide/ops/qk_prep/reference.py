"""q / k of a Qwen3.5 attention layer before attention: each head's RMS norm (Qwen3.5's zero-centred weight,
x / rms(x) * (1 + w) in fp32, rounded to the model's dtype), then the partial rotary embedding on the first R dims
(x * cos + rotate_half(x) * sin, each product and the sum rounded to the model's dtype, as eager bf16 computes
them), the other dims as they are. The oracle of `triton.qk_prep`, written op for op as transformers' modules
(`Qwen3_5RMSNorm`, `apply_rotary_pos_emb`) compute it.

Shapes: q [T, H, D] and k [T, Hkv, D] (any strides, e.g. views of the fused projection's output; q's heads may be
interleaved with the output gate's), cos / sin [T, R] (R even, <= D), q_weight / k_weight [D]. Returns new
contiguous q [T, H, D] and k [T, Hkv, D].
"""

from __future__ import annotations

import torch


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`Qwen3_5RMSNorm.forward`, op for op."""
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + weight.float())
    return out.type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb` for one tensor [T, H, D] with cos / sin [T, R]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat([(x_rot * cos) + (rotated * sin), x_pass], dim=-1)


def qk_prep(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
            k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    q = rotate(rms_norm_zero_centred(q, q_weight, eps), cos, sin)
    k = rotate(rms_norm_zero_centred(k, k_weight, eps), cos, sin)
    return q.contiguous(), k.contiguous()
