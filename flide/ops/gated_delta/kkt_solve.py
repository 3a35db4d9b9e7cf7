"""The chunk-local solve of the gated delta rule's WY form, (I + A)^-1 per 64-token chunk, with fla's arithmetic but
the four diagonal blocks' forward substitutions run side by side.

A = strictly-lower(beta_i (k_i . k_j) e^(g_i - g_j)) over a chunk's tokens; its inverse feeds the w / u step
(`wy_form.py`) and the chunked question call (`questions_chunked.py`). fla-core's fused kkt + solve kernel computes
it in 16 x 16 blocks: the ten lower blocks of k k^T (bf16 MMAs, fp32 sums over 64-column slices of the keys), the
gates and betas, the four diagonal blocks inverted by forward substitution (row i from rows < i, fp32), then the
lower blocks merged from them by tf32 products. Its four substitutions run one after the other: 4 x 14 dependent
steps, each a cross-lane sum and a layout change of a 16-element row. On a round of short requests the launch is
latency-bound (one program per chunk and value head: RACE's 512-token bucket, ~160 programs on 132 SMs), ~20 us a
layer on the H200 (0.35 of RACE's 2.77 ms replay). Here the four substitutions are one loop of 14 steps whose body
advances every block: independent chains the scheduler interleaves. Every operation is fla's, on the same shapes
in the same order (a block's rows past the sequence end are zero rows, which the extra steps keep zero), so the
stored rows keep fla's bits (tests/gpu/test_gated_delta_gpu.py::test_own_kkt_solve_keeps_fla_s_bits).

Layout as fla's kernel writes it: A [1, T, Hv, 64], token t of a chunk holds row t of the chunk's inverse; each
chunk's lower blocks (the diagonal ones with their zero upper triangles) are stored, the upper blocks are not
(`fla._solve` fills them with zeros where fla's own w / u step reads A). Spare rows of the chunk table return at
once. Runs on CPU tensors under TRITON_INTERPRET=1 (fp32 products there: what the CPU tests check against the
float64 solve of `questions_wy.wy_reference`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# fla's block merges run tf32 products (its SOLVE_TRIL_DOT_PRECISION where the card has tf32); the interpreter fp32
_MERGE_PRECISION = "ieee" if os.environ.get("TRITON_INTERPRET") == "1" else "tf32"
BLOCK = 16  # rows of a diagonal block (fla's BC)
BLOCK_K = 64  # key columns a product step (fla's BK as pinned on sm_90: the same fp32 sums over the keys)
# warps a program: 1 keeps the substitution steps' sums inside one warp (shuffles, no barriers); fla's own launch
# pins 2 on short streams, 1 on long ones (`fla.KKT_ONE_WARP_TOKENS`)
NUM_WARPS = 1
NUM_STAGES = 3


@triton.jit
def _keys(k_ptr, t0, n, c0, o_i, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """The keys [16, BK] of the 16-token block from token t0, columns from c0 (rows past the sequence zero)."""
    ok = (t0 + o_i) < n
    o_k = c0 + tl.arange(0, BK)
    return tl.load(k_ptr + (t0 + o_i)[:, None] * (H * K) + o_k[None, :], mask=ok[:, None] & (o_k[None, :] < K),
                   other=0.0)


@triton.jit
def _gated(b_a, g_i, g_j, ok_i, ok_j, b_i, o_i, DIAGONAL: tl.constexpr):
    """The block's k_i . k_j times e^(g_i - g_j) (log2 units) and beta_i: zero where a row or column is past the
    sequence (their gates load as 0, and 0 * inf would be NaN) and, in a diagonal block, on and above the diagonal."""
    keep = ok_i[:, None] & ok_j[None, :]
    if DIAGONAL:
        keep = keep & (o_i[:, None] > o_i[None, :])
    b_a *= tl.where(keep, tl.math.exp2(g_i[:, None] - g_j[None, :]), 0.0)
    return b_a * b_i[:, None]


@triton.jit
def _substitute(b_ai, b_a, i, o_i):
    """Forward substitution's step i on a diagonal block: row i of (I + A)^-1 - I (b_ai starts as -A) from its rows
    above, as fla's solve forms it."""
    row = tl.sum(tl.where((o_i == i)[:, None], -b_a, 0.0), 0)
    row = tl.where(o_i < i, row, 0.0)
    row = row + tl.sum(row[:, None] * b_ai, 0)
    return tl.where((o_i == i)[:, None], row, b_ai)


@triton.jit
def _store(a_ptr, b_ai, t0, n, col0, o_i, HV: tl.constexpr, BT: tl.constexpr):
    ok = (t0 + o_i) < n
    tl.store(a_ptr + (t0 + o_i)[:, None] * (HV * BT) + (col0 + o_i)[None, :], b_ai.to(a_ptr.dtype.element_ty),
             mask=ok[:, None])


@triton.jit
def _kkt_solve_kernel(k_ptr, g_ptr, beta_ptr, a_ptr, cu_ptr, chunks_ptr, H: tl.constexpr, HV: tl.constexpr,
                      K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                      PRECISION: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_n = tl.load(chunks_ptr + i_r * 2).to(tl.int64)
    c = tl.load(chunks_ptr + i_r * 2 + 1).to(tl.int64)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    n = tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos  # the sequence's tokens
    t0 = c * BT  # the chunk's first token in its sequence; its blocks start at t0, t1, t2, t3
    if t0 >= n:  # a spare row (or a chunk past its sequence)
        return
    t1 = t0 + BC
    t2 = t0 + 2 * BC
    t3 = t0 + 3 * BC
    k_ptr += (bos * H + i_h // (HV // H)) * K  # grouped value heads: value head h reads key head h // (HV / H)
    a_ptr += (bos * HV + i_h) * BT
    o_i = tl.arange(0, BC)
    ok0, ok1, ok2, ok3 = (t0 + o_i) < n, (t1 + o_i) < n, (t2 + o_i) < n, (t3 + o_i) < n
    row = bos + o_i
    b0 = tl.load(beta_ptr + (row + t0) * HV + i_h, mask=ok0, other=0.0).to(tl.float32)
    b1 = tl.load(beta_ptr + (row + t1) * HV + i_h, mask=ok1, other=0.0).to(tl.float32)
    b2 = tl.load(beta_ptr + (row + t2) * HV + i_h, mask=ok2, other=0.0).to(tl.float32)
    b3 = tl.load(beta_ptr + (row + t3) * HV + i_h, mask=ok3, other=0.0).to(tl.float32)
    g0 = tl.load(g_ptr + (row + t0) * HV + i_h, mask=ok0, other=0.0).to(tl.float32)
    g1 = tl.load(g_ptr + (row + t1) * HV + i_h, mask=ok1, other=0.0).to(tl.float32)
    g2 = tl.load(g_ptr + (row + t2) * HV + i_h, mask=ok2, other=0.0).to(tl.float32)
    g3 = tl.load(g_ptr + (row + t3) * HV + i_h, mask=ok3, other=0.0).to(tl.float32)

    # the ten lower blocks of k k^n, fp32 sums over BK-column slices of the keys (a block past the end stays zero)
    a00 = tl.zeros([BC, BC], dtype=tl.float32)
    a10 = tl.zeros([BC, BC], dtype=tl.float32)
    a11 = tl.zeros([BC, BC], dtype=tl.float32)
    a20 = tl.zeros([BC, BC], dtype=tl.float32)
    a21 = tl.zeros([BC, BC], dtype=tl.float32)
    a22 = tl.zeros([BC, BC], dtype=tl.float32)
    a30 = tl.zeros([BC, BC], dtype=tl.float32)
    a31 = tl.zeros([BC, BC], dtype=tl.float32)
    a32 = tl.zeros([BC, BC], dtype=tl.float32)
    a33 = tl.zeros([BC, BC], dtype=tl.float32)
    for c0 in range(0, K, BK):
        k0 = _keys(k_ptr, t0, n, c0, o_i, H, K, BK)
        a00 = tl.dot(k0, tl.trans(k0), a00)
        if t1 < n:
            k1 = _keys(k_ptr, t1, n, c0, o_i, H, K, BK)
            a11 = tl.dot(k1, tl.trans(k1), a11)
            a10 = tl.dot(k1, tl.trans(k0), a10)
            if t2 < n:
                k2 = _keys(k_ptr, t2, n, c0, o_i, H, K, BK)
                a22 = tl.dot(k2, tl.trans(k2), a22)
                a20 = tl.dot(k2, tl.trans(k0), a20)
                a21 = tl.dot(k2, tl.trans(k1), a21)
                if t3 < n:
                    k3 = _keys(k_ptr, t3, n, c0, o_i, H, K, BK)
                    a33 = tl.dot(k3, tl.trans(k3), a33)
                    a30 = tl.dot(k3, tl.trans(k0), a30)
                    a31 = tl.dot(k3, tl.trans(k1), a31)
                    a32 = tl.dot(k3, tl.trans(k2), a32)
    a00 = _gated(a00, g0, g0, ok0, ok0, b0, o_i, True)
    a11 = _gated(a11, g1, g1, ok1, ok1, b1, o_i, True)
    a22 = _gated(a22, g2, g2, ok2, ok2, b2, o_i, True)
    a33 = _gated(a33, g3, g3, ok3, ok3, b3, o_i, True)
    a10 = _gated(a10, g1, g0, ok1, ok0, b1, o_i, False)
    a20 = _gated(a20, g2, g0, ok2, ok0, b2, o_i, False)
    a21 = _gated(a21, g2, g1, ok2, ok1, b2, o_i, False)
    a30 = _gated(a30, g3, g0, ok3, ok0, b3, o_i, False)
    a31 = _gated(a31, g3, g1, ok3, ok1, b3, o_i, False)
    a32 = _gated(a32, g3, g2, ok3, ok2, b3, o_i, False)

    # the diagonal blocks' inverses, the four substitutions side by side: rows 0 and 1 are final from the start
    # (-A's), and a block's rows past the sequence end are zero rows that its extra steps keep zero
    i00, i11, i22, i33 = -a00, -a11, -a22, -a33
    for i in range(2, tl.minimum(n - t0, BC)):
        i00 = _substitute(i00, a00, i, o_i)
        i11 = _substitute(i11, a11, i, o_i)
        i22 = _substitute(i22, a22, i, o_i)
        i33 = _substitute(i33, a33, i, o_i)
    eye = o_i[:, None] == o_i[None, :]
    i00 += eye
    i11 += eye
    i22 += eye
    i33 += eye

    # the lower blocks from the diagonal ones (fla's merge, its products and sums in its order)
    i10 = -tl.dot(tl.dot(i11, a10, input_precision=PRECISION), i00, input_precision=PRECISION)
    i21 = -tl.dot(tl.dot(i22, a21, input_precision=PRECISION), i11, input_precision=PRECISION)
    i32 = -tl.dot(tl.dot(i33, a32, input_precision=PRECISION), i22, input_precision=PRECISION)
    i20 = -tl.dot(i22, tl.dot(a20, i00, input_precision=PRECISION) + tl.dot(a21, i10, input_precision=PRECISION),
                  input_precision=PRECISION)
    i31 = -tl.dot(i33, tl.dot(a31, i11, input_precision=PRECISION) + tl.dot(a32, i21, input_precision=PRECISION),
                  input_precision=PRECISION)
    i30 = -tl.dot(i33, tl.dot(a30, i00, input_precision=PRECISION) + tl.dot(a31, i10, input_precision=PRECISION)
                  + tl.dot(a32, i20, input_precision=PRECISION), input_precision=PRECISION)

    _store(a_ptr, i00, t0, n, 0, o_i, HV, BT)
    _store(a_ptr, i10, t1, n, 0, o_i, HV, BT)
    _store(a_ptr, i11, t1, n, BC, o_i, HV, BT)
    _store(a_ptr, i20, t2, n, 0, o_i, HV, BT)
    _store(a_ptr, i21, t2, n, BC, o_i, HV, BT)
    _store(a_ptr, i22, t2, n, 2 * BC, o_i, HV, BT)
    _store(a_ptr, i30, t3, n, 0, o_i, HV, BT)
    _store(a_ptr, i31, t3, n, BC, o_i, HV, BT)
    _store(a_ptr, i32, t3, n, 2 * BC, o_i, HV, BT)
    _store(a_ptr, i33, t3, n, 3 * BC, o_i, HV, BT)


def kkt_solve(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
              chunk_indices: torch.Tensor, A: torch.Tensor, *, num_warps: int | None = None) -> torch.Tensor:
    """Writes A [1, T, Hv, BT] (BT = A.shape[-1], a multiple of 16 up to 64: 64 is fla's and ours) as fla's
    `chunk_gated_delta_rule_fwd_kkt_solve_kernel` does for (k [1, T, Hk, K] normalised, g [1, T, Hv] float32: the
    chunk-local gate cumsums in log2 units, beta [1, T, Hv], cu_seqlens [N + 1], chunk_indices [R, 2] (sequence,
    chunk) rows; varlen, batch 1) and returns it: each chunk's lower blocks, nothing else written."""
    B, T, H, K = k.shape
    HV, BT = beta.shape[2], A.shape[-1]
    if B != 1:
        raise ValueError(f"kkt_solve runs varlen calls (batch 1), got batch {B}")
    if BT != 4 * BLOCK:
        raise ValueError(f"A's chunk must be {4 * BLOCK} tokens, got {BT}")
    if A.shape != (1, T, HV, BT) or g.shape != (1, T, HV):
        raise ValueError(f"A {tuple(A.shape)} / g {tuple(g.shape)} do not match [1, T={T}, Hv={HV}, {BT}]")
    R = chunk_indices.shape[0]
    if R == 0:
        return A
    _kkt_solve_kernel[(R, HV)](k, g, beta, A, cu_seqlens, chunk_indices, H=H, HV=HV, K=K, BT=BT, BC=BLOCK,
                               BK=min(BLOCK_K, K), PRECISION=_MERGE_PRECISION,
                               num_warps=NUM_WARPS if num_warps is None else num_warps, num_stages=NUM_STAGES)
    return A
