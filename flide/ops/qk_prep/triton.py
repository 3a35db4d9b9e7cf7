"""q / k of a Qwen3.5 attention layer prepared in one Triton launch (contract: `reference.qk_prep`): each head's
zero-centred RMS norm and the partial rotary embedding, where Inductor ran several small kernels a layer (norms,
rotary halves, concatenations: ~6 launches per attention layer on the H200's output code).

A program owns ROWS (token, head) rows of q or k (q's rows first, then k's) and all D dims of each. The rotary pairs
dim i with dim i +- R/2 of the same row; the partner is loaded again (it is in L1) and normalised with the row's own
rms, so it has the bits of the normalised row's element. Roundings where eager bf16 rounds: the norm's output, each
rotary product and their sum. Compiled without FP fusion: with it, LLVM turned the bf16-rounded product plus the
other product into one bf16 fma (the first product unrounded), which left ~6 % of a bf16 layer's q / k elements
off eager's bits (H200, session 22); without it the products and sum are bf16 mul / add, exactly eager's roundings.
One fixed tile and warp count: a row's bits never depend on the stream.

Runs on CPU tensors under TRITON_INTERPRET=1 (read when this module is imported), as the CPU tests run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 8  # (token, head) rows per program
NUM_WARPS = 4


@triton.jit
def _qk_prep_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, oq_ptr, ok_ptr, T, H, HKV, stride_qt, stride_qh,
                    stride_kt, stride_kh, stride_ct, stride_st, eps, D: tl.constexpr, BD: tl.constexpr,
                    R: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    is_k = rows >= T * H
    r = tl.where(is_k, rows - T * H, rows)
    heads = tl.where(is_k, HKV, H)
    t, h = r // heads, r % heads
    live = rows < T * (H + HKV)
    col_ok = cols < D
    # the rotary partner of each dim: i + R/2 for the first half of the rotated dims, i - R/2 for the second
    half = R // 2  # a constexpr (R is)
    partner = tl.where(cols < half, cols + half, tl.where(cols < R, cols - half, cols))
    in_q = (live & ~is_k)[:, None] & col_ok[None, :]
    in_k = (live & is_k)[:, None] & col_ok[None, :]
    q_row = (t * stride_qt + h * stride_qh)[:, None]
    k_row = (t * stride_kt + h * stride_kh)[:, None]
    x = tl.where(is_k[:, None], tl.load(k_ptr + k_row + cols[None, :], mask=in_k, other=0.0),
                 tl.load(q_ptr + q_row + cols[None, :], mask=in_q, other=0.0))
    xp = tl.where(is_k[:, None], tl.load(k_ptr + k_row + partner[None, :], mask=in_k, other=0.0),
                  tl.load(q_ptr + q_row + partner[None, :], mask=in_q, other=0.0))
    w = tl.where(is_k[:, None], tl.load(wk_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :],
                 tl.load(wq_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :])
    wp = tl.where(is_k[:, None], tl.load(wk_ptr + partner, mask=col_ok, other=0.0).to(tl.float32)[None, :],
                  tl.load(wq_ptr + partner, mask=col_ok, other=0.0).to(tl.float32)[None, :])
    dtype = oq_ptr.dtype.element_ty
    xf, xpf = x.to(tl.float32), xp.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]
    n = ((xf * rstd) * (1.0 + w)).to(dtype).to(tl.float32)
    n_partner = ((xpf * rstd) * (1.0 + wp)).to(dtype).to(tl.float32)
    in_rot = (cols < R)[None, :] & live[:, None]
    c = tl.load(cos_ptr + t[:, None] * stride_ct + cols[None, :], mask=in_rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t[:, None] * stride_st + cols[None, :], mask=in_rot, other=0.0).to(tl.float32)
    rotated = tl.where((cols < half)[None, :], -n_partner, n_partner)
    e = ((n * c).to(dtype).to(tl.float32) + (rotated * s).to(dtype).to(tl.float32)).to(dtype)
    out = tl.where((cols < R)[None, :], e, n.to(dtype))
    tl.store(oq_ptr + (t * H + h)[:, None] * D + cols[None, :], out, mask=in_q)
    tl.store(ok_ptr + (t * HKV + h)[:, None] * D + cols[None, :], out, mask=in_k)


def qk_prep(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
            k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.qk_prep`; q / k / cos / sin with their last dim contiguous. CUDA tensors, or CPU
    tensors under TRITON_INTERPRET=1."""
    T, H, D = q.shape
    HKV = k.shape[1]
    R = cos.shape[-1]
    if k.shape[0] != T or k.shape[2] != D or k.dtype != q.dtype:
        raise ValueError(f"k is {k.dtype} {tuple(k.shape)}, expected [{T}, Hkv, {D}] of q's dtype {q.dtype}")
    if cos.shape != (T, R) or sin.shape != (T, R) or R % 2 or R > D:
        raise ValueError(f"cos / sin are {tuple(cos.shape)} / {tuple(sin.shape)}, expected [{T}, R] with R even and "
                         f"<= {D}")
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"q_weight / k_weight are {tuple(q_weight.shape)} / {tuple(k_weight.shape)}, expected [{D}]")
    for name, x in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")
    oq = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    ok = torch.empty((T, HKV, D), dtype=q.dtype, device=q.device)
    rows = T * (H + HKV)
    if rows and D:
        _qk_prep_kernel[(triton.cdiv(rows, ROWS),)](
            q, k, cos, sin, q_weight, k_weight, oq, ok, T, H, HKV, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), sin.stride(0), float(eps), D=D, BD=triton.next_power_of_2(D), R=R, ROWS=ROWS,
            num_warps=NUM_WARPS, enable_fp_fusion=False)
    return oq, ok
