"""The question call of the forked gated delta rule as one Triton kernel: each branch starts from its state's final
recurrent state, read in place by index, and runs the delta rule token by token.

Why not fla's chunked kernels for this call: they take one dense initial state per sequence, so the call had to
gather [N, Hv, K, V] float32 states for every branch row of the bucket's capacity (1 MiB per branch on
Qwen3.5-0.8B: 512 MiB per layer for the 512-token bucket) and write as many final states that nobody reads. On the
H200 (2026-11-30, Qwen3.5-0.8B, RACE, one request) those fills, gathers and copies took ~30 of the replay's ~49 ms
of GPU time. Questions are short (tens of tokens), which is what the recurrent form is good at: one program per
(branch, value head, V tile) keeps its [K, BV] state slice in registers, reads the state's slice once, and writes
only its branch's outputs. Capacity rows without a branch (length 0) return at once.

Each program's sums run in one fixed order that depends on nothing but its own branch's tokens, so the output of a
question has the same bits whatever else is in the round (batch-invariant), and asked alone it runs the same code.

Runs on CPU tensors under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported), which is how the
CPU tests check it against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles as fla's own recurrent kernel uses them (fused_recurrent_gated_delta_rule): 8 value columns per program and
# one warp, so the two sums over K of every token stay inside a warp (shuffles, no shared memory or barrier: the
# per-token latency is what a question's length multiplies), [K=128, 8] fp32 is 32 registers a thread, and many
# small programs fill the GPU even for one request's few questions (RACE: 5 x 16 heads x 16 tiles = 1,280).
BLOCK_V = 8
NUM_WARPS = 1
NUM_STAGES = 3  # the next tokens' q/k/v loads in flight while this one's update runs


@triton.jit
def _branch_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, start_ptr, len_ptr, index_ptr, scale,
                   HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, L2NORM: tl.constexpr):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_hk = i_h // (HV // HK)  # grouped value heads: value head h reads key head h // (HV // HK)
    n = tl.load(len_ptr + i_n)
    if n > 0:
        bos = tl.load(start_ptr + i_n).to(tl.int64)
        idx = tl.load(index_ptr + i_n).to(tl.int64)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        k_ok = o_k < K
        v_ok = o_v < V
        h = tl.zeros([BK, BV], dtype=tl.float32)
        if idx >= 0:  # -1: from a zero state
            p_h0 = h0_ptr + (idx * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
            h += tl.load(p_h0, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        for t in range(bos, bos + n):
            b_q = tl.load(q_ptr + (t * HK + i_hk) * K + o_k, mask=k_ok, other=0.0).to(tl.float32)
            b_k = tl.load(k_ptr + (t * HK + i_hk) * K + o_k, mask=k_ok, other=0.0).to(tl.float32)
            b_v = tl.load(v_ptr + (t * HV + i_h) * V + o_v, mask=v_ok, other=0.0).to(tl.float32)
            b_g = tl.load(g_ptr + t * HV + i_h).to(tl.float32)
            b_beta = tl.load(beta_ptr + t * HV + i_h).to(tl.float32)
            if L2NORM:
                # the state call's formula (l2norm.py, as fla's): x * (1 / sqrt(sum(x^2) + 1e-6)) in fp32, rounded
                # to the input dtype (a no-op for fp32), so states and questions see keys normalised alike
                b_q = (b_q * (1 / tl.sqrt(tl.sum(b_q * b_q) + 1e-6))).to(q_ptr.dtype.element_ty).to(tl.float32)
                b_k = (b_k * (1 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6))).to(k_ptr.dtype.element_ty).to(tl.float32)
            h *= tl.exp(b_g)
            b_v = (b_v - tl.sum(h * b_k[:, None], 0)) * b_beta
            h += b_k[:, None] * b_v[None, :]
            b_o = tl.sum(h * (b_q * scale)[:, None], 0)
            tl.store(o_ptr + (t * HV + i_h) * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=v_ok)


def branches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor, initial_index: torch.Tensor,
             scale: float, use_qk_l2norm: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hv, V] (q's dtype) of every segment, each from `initial_state[initial_index[n]]` (-1: zero). Rows
    outside the segments are left unwritten, as fla's variant leaves them (`gated_delta.combine` selects).

    q, k: [T, Hk, K]; v: [T, Hv, V]; g, beta: [T, Hv]; seg_start/seg_len/initial_index: [N] int64;
    initial_state: [M, Hv, K, V] float32 (M may be 0 when every index is -1). `out`: where to write (tests poison
    it to see that every segment row is written)."""
    T, HK, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device) if out is None else out
    if initial_state.shape[0] == 0:  # no state to read: a dummy pointer that no program loads (every index is -1)
        initial_state = torch.zeros(1, HV, K, V, dtype=torch.float32, device=q.device)
    h0 = initial_state.float().contiguous()
    N = seg_start.shape[0]
    BV = min(BLOCK_V, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), N * HV)
    if N > 0:
        _branch_kernel[grid](q, k, v, g, beta, o, h0, seg_start.contiguous(), seg_len.contiguous(),
                             initial_index.contiguous(), float(scale), HK=HK, HV=HV, K=K, V=V,
                             BK=triton.next_power_of_2(K), BV=BV, L2NORM=use_qk_l2norm, num_warps=NUM_WARPS,
                             num_stages=NUM_STAGES)
    return o
