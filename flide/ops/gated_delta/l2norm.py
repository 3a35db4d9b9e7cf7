"""Row-wise L2 normalisation of q and k before fla's chunked kernels, with one fixed launch configuration.

fla normalises q and k itself (`use_qk_l2norm_in_kernel`) with an autotuned kernel whose key includes
NB = cdiv(rows, 65536): on Qwen3.5-0.8B (16 key heads) streams past 4,096 tokens tune a config of their own, and a
row's sum of squares is then reduced by another tree (other rows per program, other warps), so a token's normalised
key could change bits with the round's bucket, and between processes (autotuning times the configs). Here every
row is summed by the same code whatever the stream: rows per program and warps are constants, no autotuning.

Same formula as fla's `l2norm_fwd`: y = x * (1 / sqrt(sum(x^2) + 1e-6)), sums in fp32, y rounded to x's dtype.
Runs on CPU tensors under TRITON_INTERPRET=1 (read when this module is imported), as the CPU tests run it.

`prepare_qkv` lays out q, k (normalised) and v for fla in one launch, reading them where they lie: in a GDN layer they
are column slices of the conv's [T, 2 K Hk + V Hv] output, which before needed a contiguous copy each (three Inductor
kernels a layer, v stored twice: once for each gated delta call) and then a launch each for q and k here. A q / k row
is summed by the same code as `l2norm` (the same ROWS x BD tile, the same warps), so its bits are the same.
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
def _qkv_kernel(q_ptr, k_ptr, v_ptr, yq_ptr, yk_ptr, yv_ptr, R, RV, H, HV, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_vt, stride_vh, DK: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr,
                EPS: tl.constexpr, NORM: tl.constexpr):
    # rows 0..R-1 are q's (token, head) rows, R..2R-1 k's, 2R..2R+RV-1 v's; a program may hold rows of each
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    is_k = (rows >= R) & (rows < 2 * R)
    is_v = rows >= 2 * R
    r = tl.where(is_v, rows - 2 * R, tl.where(is_k, rows - R, rows))
    heads = tl.where(is_v, HV, H)
    t, h = r // heads, r % heads
    live = rows < 2 * R + RV
    in_q = (live & ~is_k & ~is_v)[:, None] & (cols < DK)[None, :]
    in_k = (live & is_k)[:, None] & (cols < DK)[None, :]
    in_v = (live & is_v)[:, None] & (cols < DV)[None, :]
    xq = tl.load(q_ptr + (t * stride_qt + h * stride_qh)[:, None] + cols[None, :], mask=in_q, other=0.0)
    xk = tl.load(k_ptr + (t * stride_kt + h * stride_kh)[:, None] + cols[None, :], mask=in_k, other=0.0)
    xv = tl.load(v_ptr + (t * stride_vt + h * stride_vh)[:, None] + cols[None, :], mask=in_v, other=0.0)
    x = tl.where(is_k[:, None], xk, xq)
    if NORM:
        xf = x.to(tl.float32)
        rstd = 1 / tl.sqrt(tl.sum(xf * xf, 1) + EPS)
        x = (xf * rstd[:, None]).to(yq_ptr.dtype.element_ty)
    # every output contiguous [T, heads, D]; v's rows copied as they are
    tl.store(yq_ptr + r[:, None] * DK + cols[None, :], x, mask=in_q)
    tl.store(yk_ptr + r[:, None] * DK + cols[None, :], x, mask=in_k)
    tl.store(yv_ptr + r[:, None] * DV + cols[None, :], xv, mask=in_v)


def prepare_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) as fla's kernels read them, in one launch: q and k ([T, H, DK] of one shape and dtype) L2-normalised
    with `normalize` (the bits of `l2norm` of each, when DV <= the power of two above DK: the same row tile) or else
    copied, v ([T, HV, DV]) copied. Each input is read in place when its last dim is contiguous (any token and head
    strides: slices of a wider row, as in a GDN layer); three new contiguous tensors (a custom op's outputs must not
    alias its inputs)."""
    if q.shape != k.shape or q.dim() != 3 or q.dtype != k.dtype:
        raise ValueError(f"prepare_qkv needs q and k of one [T, H, D] shape and dtype, got {q.dtype} "
                         f"{tuple(q.shape)} and {k.dtype} {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0] or v.dtype != q.dtype:
        raise ValueError(f"prepare_qkv needs v [T, HV, DV] of q's dtype and tokens, got {v.dtype} {tuple(v.shape)} "
                         f"with q {q.dtype} {tuple(q.shape)}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    (T, H, DK), (HV, DV) = q.shape, v.shape[1:]
    yq, yk, yv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    R, RV = T * H, T * HV
    if 2 * R + RV and max(DK, DV):
        _qkv_kernel[(triton.cdiv(2 * R + RV, ROWS),)](
            q, k, v, yq, yk, yv, R, RV, H, HV, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), DK=DK, DV=DV, BD=triton.next_power_of_2(max(DK, DV)), ROWS=ROWS, EPS=EPS,
            NORM=bool(normalize), num_warps=NUM_WARPS)
    return yq, yk, yv


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
