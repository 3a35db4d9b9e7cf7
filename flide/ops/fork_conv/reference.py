"""The forked causal depthwise conv of Gated DeltaNet layers, in pure torch.

Each output is a weighted sum of the last W inputs of its token's *logical* sequence: inside its own segment the
stream's previous rows; before a question's first token, the last inputs of its state (its conv window), read
straight from the stream where the state lies; zeros before the start of the state, as in the standalone prompt.

`fork_conv_window` serves states resumed from a checkpoint (flide/checkpoints): such a state's segment starts at
token m of the state, and the W-1 inputs before m come from the checkpoint's conv window, extra rows the token's
`win_index` names, found where the logical sequence runs past the start of the state's segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gated_delta.reference import l2norm


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


def window_index(seg_lo: torch.Tensor, trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, win_index: torch.Tensor,
                 width: int) -> torch.Tensor:
    """`predecessor_index` where inputs before the start of a token's state come from conv windows: [T, width]
    rows into [x; a zero row; window rows], window p's row j at T + 1 + p * (width - 1) + j (win_index -1: none)."""
    T = seg_lo.shape[0]
    rows = predecessor_index(seg_lo, trunk_lo, trunk_hi, width)
    t = torch.arange(T, device=seg_lo.device)[:, None]
    back = torch.arange(width - 1, -1, -1, device=seg_lo.device)[None, :]
    before = seg_lo[:, None] - (t - back)  # > 0: how far before the token's own segment start
    before_state = before - (trunk_hi - trunk_lo)[:, None]  # how far before its state's (resumed) segment start
    use = (before_state > 0) & (before_state <= width - 1) & (win_index[:, None] >= 0)
    from_window = T + 1 + win_index[:, None] * (width - 1) + (width - 1) - before_state
    return torch.where(use, from_window, rows)


def fork_conv_window(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                     trunk_hi: torch.Tensor, window: torch.Tensor, win_index: torch.Tensor, silu: bool) -> torch.Tensor:
    """`fork_conv` with checkpoint windows: window [P, W-1, D] (the last W-1 conv inputs before each resumed
    checkpoint's position), win_index [T] the window each token's state resumed from (-1: none)."""
    T, D = x.shape
    W = weight.shape[1]
    rows = window_index(seg_lo, trunk_lo, trunk_hi, win_index, W)
    padded = torch.cat([x.to(weight.dtype), x.new_zeros(1, D, dtype=weight.dtype),
                        window.reshape(-1, D).to(weight.dtype)])
    return _conv(padded[rows], weight, silu, x.dtype)


def fork_conv(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
              trunk_hi: torch.Tensor, silu: bool) -> torch.Tensor:
    """
    Args:
        x: [T, D] conv inputs (the qkv projections); weight: [D, W] depthwise kernel (no bias).
        seg_lo, trunk_lo, trunk_hi: [T] int32 (a round's) or int64 stream indices, as for fork attention.
        silu: apply SiLU to the output (Qwen3.5 does).
    Returns: [T, D] in x's dtype; the products and sums run in the weight's dtype, as transformers' conv does.
    """
    T, D = x.shape
    W = weight.shape[1]
    rows = predecessor_index(seg_lo, trunk_lo, trunk_hi, W)  # [T, W]
    padded = torch.cat([x.to(weight.dtype), x.new_zeros(1, D, dtype=weight.dtype)])
    return _conv(padded[rows], weight, silu, x.dtype)


def _conv(windows: torch.Tensor, weight: torch.Tensor, silu: bool, dtype: torch.dtype) -> torch.Tensor:
    """windows [T, W, D] -> [T, D]: the depthwise dot products (float32 sums, tap by tap in order, rounded once to
    the weight's dtype, where transformers' conv rounds), then SiLU.

    Tap by tap, not an einsum: an einsum is a batched GEMM whose kernel BLAS picks by T, so a token's sum could
    change bits with the stream's length (seen as fp32 bit changes in batch-invariant mode on the H200); elementwise
    products and adds give each token the same bits in any stream."""
    acc = windows[:, 0].float() * weight[:, 0].float()
    for w in range(1, windows.shape[1]):
        acc = acc + windows[:, w].float() * weight[:, w].float()
    out = acc.to(weight.dtype)
    if silu:
        out = F.silu(out)
    return out.to(dtype).contiguous()


def fork_conv_qkv(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                  trunk_hi: torch.Tensor, key_heads: int, head_dim: int, normalize: bool,
                  gates: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, ...]:
    """`fork_conv` with SiLU, its q | k | v channels split into (q [T, key_heads, head_dim], k, v [T, value heads,
    head_dim]), q and k L2-normalised per head with `normalize` (x / sqrt(sum(x^2) + 1e-6) in fp32, rounded to x's
    dtype); with `gates` (a, b, A_log, dt_bias) also the GDN layer's g (fp32) and beta as transformers computes them:
    the oracle of the Triton conv's fused layout (`triton.fork_conv_qkv`)."""
    T, D = x.shape
    out = fork_conv(x, weight, seg_lo, trunk_lo, trunk_hi, True)
    key_cols = key_heads * head_dim
    q, k, v = out[:, :key_cols], out[:, key_cols:2 * key_cols], out[:, 2 * key_cols:]
    q, k, v = q.reshape(T, key_heads, head_dim), k.reshape(T, key_heads, head_dim), v.reshape(T, -1, head_dim)
    if normalize:  # in fp32, rounded once to x's dtype, as the kernel does
        q, k = (l2norm(y.float()).to(y.dtype) for y in (q, k))
    laid_out = (q.contiguous(), k.contiguous(), v.contiguous())
    if gates is None:
        return laid_out
    g, beta = gdn_gates(*gates)
    return (*laid_out, g.contiguous(), beta.contiguous())


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's gates as transformers computes them: g = -exp(A_log) * softplus(a + dt_bias) in
    float32 (in half precision exp(A_log) could overflow) and beta = sigmoid(b) in b's dtype. The GDN layer's
    unfused path computes them so, and the fused conv's gates are checked against it."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()
