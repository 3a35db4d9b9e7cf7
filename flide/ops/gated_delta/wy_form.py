"""The WY form's w / u step of the chunked gated delta rule (what fla-core's `recompute_w_u_fwd` computes), whose
spare chunk rows return at once.

Why: the state call's chunk table has a fixed capacity per bucket (a CUDA graph's shapes are static): the 8,192-token
bucket lists 257 chunk rows, of which one QuALITY request's state uses 96. fla's w / u kernel has no early return:
every spare row computes a masked chunk (its products on zero tiles), and the step took 1.0 ms of QuALITY's replay
on the H100 (session 35 profile). fla's other chunk-local kernels (kkt + solve, h, o) already return at once there.

Per chunk row (sequence, chunk) and value head, with A the solved rows (I + strictly-lower(beta k k^T decay))^-1
of the kkt + solve step and g the chunk-local cumulated log2 decays:
    u = A (beta v),   w = A (beta e^g k)
the same products, tiles (64 value / key columns a dot), operand roundings and output dtype as fla-core 0.6.0's
kernel, so that the state call's bits do not change (tests/gpu/test_gated_delta_gpu.py asserts equal bits).

Runs on CPU tensors under TRITON_INTERPRET=1 (what the CPU tests check against `questions_wy.wy_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the key / value columns of one product (fla's BK / BV), warps and stages (fla's pinned configs, fla.SM90_CONFIGS:
# 4 warps; 3 stages at 16 value heads, 2 at 32)
BLOCK = 64
NUM_WARPS = 4


@triton.jit(do_not_specialize=["T"])
def _w_u_kernel(k_ptr, v_ptr, beta_ptr, a_ptr, g_ptr, w_ptr, u_ptr, cu_ptr, chunks_ptr, T, H: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_n = tl.load(chunks_ptr + i_r * 2).to(tl.int64)
    c0 = tl.load(chunks_ptr + i_r * 2 + 1).to(tl.int64) * BT
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    n = tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos
    if c0 >= n:  # a spare row (or a chunk past its sequence): nothing to compute
        return
    o_t = tl.arange(0, BT)
    t_ok = (c0 + o_t) < n
    t = bos + c0 + o_t
    b_b = tl.load(beta_ptr + t * HV + i_h, mask=t_ok, other=0.0)
    # A's rows within the chunk, lower triangle: the kkt + solve launch leaves the upper blocks unwritten (`fla._solve`
    # allocates A without a zero fill for this kernel). Selected after a load masked by rows only, which stays
    # vectorised (a mask that changes along a row would load element by element)
    b_a = tl.load(a_ptr + (t[:, None] * HV + i_h) * BT + o_t[None, :], mask=t_ok[:, None], other=0.0)
    b_a = tl.where(o_t[:, None] >= o_t[None, :], b_a, 0.0)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = t_ok[:, None] & (o_v[None, :] < V)
        p_v = (t[:, None] * HV + i_h) * V + o_v[None, :]
        b_v = tl.load(v_ptr + p_v, mask=m_v, other=0.0)
        b_vb = (b_v * b_b[:, None]).to(b_v.dtype)
        b_u = tl.dot(b_a, b_vb, input_precision="ieee")  # as fla's (allow_tf32=False: fp32 inputs in ieee)
        tl.store(u_ptr + p_v, b_u.to(u_ptr.dtype.element_ty), mask=m_v)
    b_e = tl.exp2(tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0))
    i_hk = i_h // (HV // H)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = t_ok[:, None] & (o_k[None, :] < K)
        b_k = tl.load(k_ptr + (t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_k, other=0.0)
        b_kb = b_k * b_b[:, None]
        b_kb *= b_e[:, None]
        b_w = tl.dot(b_a, b_kb.to(b_k.dtype))  # the default precision, as fla's
        tl.store(w_ptr + (t[:, None] * HV + i_h) * K + o_k[None, :], b_w.to(w_ptr.dtype.element_ty), mask=m_k)


def w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, g: torch.Tensor,
        cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [B, T, Hv, K], u [B, T, Hv, V]) as fla's `recompute_w_u_fwd(k, v, beta, A, g, cu_seqlens, chunk_indices)`
    (varlen, B = 1): k [1, T, Hk, K], v [1, T, Hv, V], beta [1, T, Hv] (v's dtype), A [1, T, Hv, BT], g [1, T, Hv]
    float32; chunk_indices [R, 2] (sequence, chunk) rows of cu_seqlens' sequences. Rows of no chunk are left
    unwritten (fla's leaves its spare rows' tokens unwritten too: they lie past every sequence)."""
    B, T, H, K = k.shape
    HV, V, BT = v.shape[2], v.shape[3], A.shape[-1]
    if B != 1:
        raise ValueError(f"w_u runs varlen calls (batch 1), got batch {B}")
    w = k.new_empty(B, T, HV, K)
    u = torch.empty_like(v)
    R = chunk_indices.shape[0]
    if R == 0:
        return w, u
    _w_u_kernel[(R, HV)](k, v, beta, A, g, w, u, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, V=V, BT=BT,
                         BK=BLOCK, BV=BLOCK, num_warps=NUM_WARPS, num_stages=3 if HV <= 16 else 2)
    return w, u
