"""Row-wise L2 normalisation of q and k before fla's chunked kernels, with one fixed launch configuration.

fla normalises q and k itself (`use_qk_l2norm_in_kernel`) with an autotuned kernel whose key includes
NB = cdiv(rows, 65536): on Qwen3.5-0.8B (16 key heads) streams past 4,096 tokens tune a config of their own, and a
row's sum of squares is then reduced by another tree (other rows per program, other warps), so a token's normalised
key could change bits with the round's bucket, and between processes (autotuning times the configs). Here every
row is summed by the same code whatever the stream: rows per program and warps are constants, no autotuning.

Same formula as fla's `l2norm_fwd`: y = x * (1 / sqrt(sum(x^2) + 1e-6)), sums in fp32, y rounded to x's dtype.
Runs on CPU tensors under TRITON_INTERPRET=1 (read when this module is imported), as the CPU tests run it.

`l2norm_pair` normalises q and k in one launch, reading them where they lie: in a GDN layer they are column slices
of the conv's [T, 2 K Hk + V Hv] output, which before needed a contiguous copy each (two Inductor kernels a layer)
and then a launch each here. A row is summed by the same code in both kernels (the same tile of ROWS x BD, the same
warps), so its bits are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # rows per program
NUM_WARPS = 4
EPS = 1e-6


@triton.jit
def _l2norm_kernel(x_ptr, y_ptr, R, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr, EPS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, 1) + EPS)
    tl.store(y_ptr + offsets, (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _l2norm_pair_kernel(q_ptr, k_ptr, yq_ptr, yk_ptr, R, H, stride_qt, stride_qh, stride_kt, stride_kh,
                        D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr, EPS: tl.constexpr):
    # rows 0..R-1 are q's (token, head) rows, R..2R-1 k's; a program may hold rows of both
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    is_k = rows >= R
    r = tl.where(is_k, rows - R, rows)
    t, h = r // H, r % H
    ok = (rows < 2 * R)[:, None] & (cols < D)[None, :]
    in_q, in_k = ok & ~is_k[:, None], ok & is_k[:, None]
    xq = tl.load(q_ptr + (t * stride_qt + h * stride_qh)[:, None] + cols[None, :], mask=in_q, other=0.0)
    xk = tl.load(k_ptr + (t * stride_kt + h * stride_kh)[:, None] + cols[None, :], mask=in_k, other=0.0)
    x = tl.where(is_k[:, None], xk, xq).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, 1) + EPS)
    y = x * rstd[:, None]
    out = r[:, None] * D + cols[None, :]  # both outputs contiguous [T, H, D]
    tl.store(yq_ptr + out, y.to(yq_ptr.dtype.element_ty), mask=in_q)
    tl.store(yk_ptr + out, y.to(yk_ptr.dtype.element_ty), mask=in_k)


def l2norm_pair(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(l2norm(q), l2norm(k)) of two [T, H, D] tensors of one shape and dtype, in one launch, each read in place
    when its last dim is contiguous (any token and head strides: slices of a wider row); two new contiguous
    tensors, the same bits as `l2norm` of each."""
    if q.shape != k.shape or q.dim() != 3 or q.dtype != k.dtype:
        raise ValueError(f"l2norm_pair needs q and k of one [T, H, D] shape and dtype, got {q.dtype} "
                         f"{tuple(q.shape)} and {k.dtype} {tuple(k.shape)}")
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    T, H, D = q.shape
    yq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    yk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    R = T * H
    if R and D:
        _l2norm_pair_kernel[(triton.cdiv(2 * R, ROWS),)](q, k, yq, yk, R, H, q.stride(0), q.stride(1), k.stride(0),
                                                          k.stride(1), D=D, BD=triton.next_power_of_2(D), ROWS=ROWS,
                                                          EPS=EPS, num_warps=NUM_WARPS)
    return yq, yk


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x / ||x|| over the last dim (eps 1e-6 inside the root), in x's dtype; a new contiguous tensor."""
    x = x.contiguous()
    D = x.shape[-1]
    R = x.numel() // D if D else 0
    y = torch.empty_like(x)
    if R:
        _l2norm_kernel[(triton.cdiv(R, ROWS),)](x, y, R, D=D, BD=triton.next_power_of_2(D), ROWS=ROWS, EPS=EPS,
                                                num_warps=NUM_WARPS)
    return y
