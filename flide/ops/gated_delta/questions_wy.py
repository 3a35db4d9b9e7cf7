"""The question call of the forked gated delta rule in chunked (WY) form: only the chain from chunk to chunk is left.

The recurrent question kernel (`branches.py`) walks a question token by token: on the H200 ~0.6 us a step, so a
question's latency is its length (Qwen3.5-0.8B, one 185-token question, sweep 1: 118 us a GDN layer, 2.1 of 11.7 ms
of GPU time; 64 such questions: 9.7 of 40.5 ms). In the chunked form a 64-token chunk moves the state once. Its
chunk-local part does not depend on the state, and fla's intra-chunk kernels compute exactly that part for the
states anyway: the state call runs them over the states AND the questions in the same launches (each chunk is
independent, and a question's chunks start at its own first token), and returns, per token of the stream,
    w = T (beta e^gamma k),   u = T (beta v),   gamma (log2 units: the chunk's cumulated decay),
with T = (I + A)^-1, A_ij = beta_i e^(gamma_i - gamma_j) (k_i . k_j) for j < i within a chunk. What is left per
(question, value head, value tile) is this kernel: from its state's final recurrent state S (read in place by
index), per chunk
    U = u - w S,   o = scale (e^gamma (q S) + (q k^T * e^(gamma_i - gamma_j), j <= i) U),
    S <- e^gamma_last S + (k e^(gamma_last - gamma))^T U,
three products with S on the chain instead of one token at a time: a 185-token question is 3 dependent steps.
The same equations as fla's own h and o steps for a sequence that starts from S; here S is fp32 in registers and
the products run in tf32 on the GPU (fla casts S to bf16 for its own; ieee fp32 tiles would not fit in shared
memory) and in ieee fp32 in the CPU interpreter.

A question's chunks, its w / u / gamma and this kernel's sums depend on its own tokens only: batch-invariant.
Runs on CPU tensors under TRITON_INTERPRET=1 (the CPU tests feed it `wy_reference`'s chunk-local part).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...config import GDN_CHUNK
from .branches import _initial_state

# 4 warps: on the H200 (benchmarks/results/ops_gated_delta_wy_h200.md) BV 32 with 4 warps took 0.022 ms a layer
# for 0.8B's RACE bucket vs 0.036 with 8, 0.74 vs 1.20 ms for 64 RACE requests (9B: 0.040 vs 0.067, 1.46 vs 2.40 ms),
# although 8 warps were picked to hold the chain's [64, 128] fp32 tiles of q, k and w. One stage: a question has a few
# chunks, nothing to pipeline, and pipelined fp32 tiles needed 190-265 KB of shared memory (sm_90 has 227); as
# compiled for sm_90 with 8 warps: 64 KB (bf16 inputs), 152 KB (fp32)
BLOCK_V = 32
NUM_WARPS = 4
NUM_STAGES = 1
# Tried and reverted (a877640, 2026-12-01, H200, `ops_gated_delta_chunked_h200.md`, `h200_profile_0_8b_questions_
# chunked.json`): this chain over 16-token sub-chunks, their WY form from our own kernel (the fused chunk form's series
# inverse in fp32, in parallel over questions, heads and sub-chunks) instead of fla's: slower everywhere. End to end
# (gated delta + prep + chain vs the recurrent question kernel's fork, 0.8B): RACE 1.79 vs 1.61 ms, sweep 1 4.91 vs
# 4.65, sweep 64 20.8 vs 16.7; a 16-token chain step took ~6 us (three dependent products and their layout
# conversions) against the recurrent kernel's ~9 us for 16 token steps, and the prep ~25-60 us a layer.
# Half-precision operands in those products (branch wip/questions-chunked-bf16, 750f57a: q, k, w, u in bf16, S rounded
# to bf16 for its products, fp32 state and accumulation, as fla's chunk_h / chunk_o do) did not save it (H200,
# 2026-12-01, `ops_gated_delta_chunked_bf16_h200.md`, `h200_profile_0_8b_questions_chunked_bf16.json`, same call):
# GPU time per replay RACE 3.54 vs 3.50 ms, sweep 1 16.5 vs 15.5, sweep 64 41.5 vs 41.2, QuALITY 34.1 vs 32.9; op
# bench 0.074 vs 0.037 ms (RACE bucket), 2.45 vs 0.92 (64 x RACE). Its GPU tests passed; not merged.


@triton.jit
def _chain_kernel(q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, o_ptr, h0_ptr, start_ptr, len_ptr, index_ptr, scale,
                  HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_hk = i_h // (HV // HK)  # grouped value heads: value head h reads key head h // (HV // HK)
    n = tl.load(len_ptr + i_n)
    if n > 0:
        bos = tl.load(start_ptr + i_n).to(tl.int64)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        o_t = tl.arange(0, BT)
        k_ok = o_k < K
        v_ok = o_v < V
        # S: this program's [K, BV] slice of its state's final recurrent state (index -1: zero), as the recurrent
        # question kernel reads it
        h = _initial_state(h0_ptr, index_ptr, i_n, i_h, o_k, o_v, k_ok, v_ok, HV, K, V, BK, BV)
        causal = o_t[:, None] >= o_t[None, :]
        for c0 in range(0, n, BT):
            t = bos + c0 + o_t
            t_ok = (c0 + o_t) < n  # rows past the question: zero q, k, w, u change nothing, and are not stored
            m_k = t_ok[:, None] & k_ok[None, :]
            m_v = t_ok[:, None] & v_ok[None, :]
            b_q = tl.load(q_ptr + (t[:, None] * HK + i_hk) * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(k_ptr + (t[:, None] * HK + i_hk) * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
            b_w = tl.load(w_ptr + (t[:, None] * HV + i_h) * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
            b_u = tl.load(u_ptr + (t[:, None] * HV + i_h) * V + o_v[None, :], mask=m_v, other=0.0).to(tl.float32)
            b_g = tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
            last = tl.minimum(n - c0, BT) - 1
            g_last = tl.sum(tl.where(o_t == last, b_g, 0.0), 0)
            # the state-independent products first (off the chain): q k^T within the chunk, decayed and causal
            qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
            qk = tl.where(causal, qk * tl.exp2(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
            # the chain: U from S, the outputs, the state after the chunk
            b_v = b_u - tl.dot(b_w, h, input_precision=PRECISION)
            b_o = tl.dot(b_q * tl.exp2(b_g)[:, None], h, input_precision=PRECISION)
            b_o += tl.dot(qk, b_v, input_precision=PRECISION)
            p_o = o_ptr + (t[:, None] * HV + i_h) * V + o_v[None, :]
            tl.store(p_o, (b_o * scale).to(o_ptr.dtype.element_ty), mask=m_v)
            b_v = tl.where(t_ok[:, None], b_v * tl.exp2(g_last - b_g)[:, None], 0.0)
            h = h * tl.exp2(g_last) + tl.dot(tl.trans(b_k), b_v, input_precision=PRECISION)


def questions_wy(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gamma: torch.Tensor,
                 seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                 initial_index: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """o [T, Hv, V] (q's dtype) of every segment from `initial_state[initial_index[n]]` (-1: zero), rows outside
    the segments unwritten. q, k: [T, Hk, K] as the recurrence reads them (normalised already); w: [T, Hv, K], u:
    [T, Hv, V] and gamma [T, Hv] (float32, log2 units): each segment's chunk-local part, its chunks of GDN_CHUNK
    tokens starting at the segment's first token (`wy_reference`, or fla's intra-chunk kernels). `tiles`: (value
    columns per program, warps); a choice may change bits, one fixed choice keeps batch invariance."""
    T, HK, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    if w.shape != (T, HV, K) or gamma.shape != (T, HV):
        raise ValueError(f"w {tuple(w.shape)} / gamma {tuple(gamma.shape)} do not match [T={T}, Hv={HV}, K={K}]")
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device) if out is None else out
    N = seg_start.shape[0]
    if N == 0:
        return o
    if initial_state.shape[0] == 0:  # no state to read: a dummy pointer that no program loads (every index is -1)
        initial_state = torch.zeros(1, HV, K, V, dtype=torch.float32, device=q.device)
    BV, warps = tiles or (min(BLOCK_V, max(16, triton.next_power_of_2(V))), NUM_WARPS)
    BK = max(16, triton.next_power_of_2(K))
    # tf32 products on the GPU whatever the dtype, as fla's own kernels run fp32 inputs (ieee fp32 dots of these
    # tiles need ~260 KB of shared memory, over sm_90's 227 KB: benchmarks/ops/compile_sm90.py); ieee in the CPU
    # interpreter, where the tests check the fp32 sums against the reference
    precision = "tf32" if q.is_cuda else "ieee"
    _chain_kernel[(triton.cdiv(V, BV), N * HV)](
        q.contiguous(), k.contiguous(), w.contiguous(), u.contiguous(), gamma.float().contiguous(), o,
        initial_state.float().contiguous(), seg_start.contiguous(), seg_len.contiguous(), initial_index.contiguous(),
        float(scale), HK=HK, HV=HV, K=K, V=V, BK=BK, BV=BV, BT=GDN_CHUNK, PRECISION=precision, num_warps=warps,
        num_stages=NUM_STAGES)
    return o


def wy_reference(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seg_start: torch.Tensor,
                 seg_len: torch.Tensor, chunk: int = GDN_CHUNK, with_solve: bool = False) -> tuple[torch.Tensor, ...]:
    """The chunk-local part of the WY form in pure torch (float32; the triangular solve in float64): (w [T, Hv, K],
    u [T, Hv, V], gamma [T, Hv] in log2 units) for the tokens of the segments, zero elsewhere; chunks of `chunk`
    tokens from each segment's first token. k [T, Hk, K] as the recurrence reads it; g [T, Hv] the log decays.
    `with_solve`: also the solved rows A [T, Hv, chunk] laid out as fla's kkt + solve step writes them (token i of a
    chunk holds row i of (I + A)^-1 within it, zero past the chunk's tokens), which `questions_chunked` reads."""
    T, HK, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    w = torch.zeros(T, HV, K, dtype=torch.float32, device=k.device)
    u = torch.zeros(T, HV, V, dtype=torch.float32, device=k.device)
    gamma = torch.zeros(T, HV, dtype=torch.float32, device=k.device)
    solved = torch.zeros(T, HV, chunk, dtype=torch.float32, device=k.device)
    kv = k.float().repeat_interleave(HV // HK, dim=1)  # [T, Hv, K]
    for start, length in zip(seg_start.tolist(), seg_len.tolist()):
        for c0 in range(start, start + length, chunk):
            rows = slice(c0, min(c0 + chunk, start + length))
            kc, vc = kv[rows].transpose(0, 1), v[rows].float().transpose(0, 1)  # [Hv, L, K], [Hv, L, V]
            bc = beta[rows].float().transpose(0, 1)  # [Hv, L]
            gc = g[rows].float().cumsum(0).transpose(0, 1)  # [Hv, L], natural log
            decay = torch.exp(gc[:, :, None] - gc[:, None, :]).tril(-1)
            a = bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay
            eye = torch.eye(a.shape[1], dtype=torch.float64, device=k.device)
            t_inv = torch.linalg.solve_triangular(eye + a.double(), eye.expand_as(a), upper=False,
                                                  unitriangular=True).float()
            w[rows] = (t_inv @ (kc * (bc * gc.exp())[:, :, None])).transpose(0, 1)
            u[rows] = (t_inv @ (vc * bc[:, :, None])).transpose(0, 1)
            gamma[rows] = (gc / math.log(2)).transpose(0, 1)
            solved[rows, :, :t_inv.shape[-1]] = t_inv.transpose(0, 1)
    return (w, u, gamma, solved) if with_solve else (w, u, gamma)
