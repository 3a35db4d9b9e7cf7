"""The state call's chunk-to-chunk steps in our own Triton kernels: fla's h step (the state before every chunk) and
o step (the outputs from those states) fused where the chain is short, the states kept in registers.

Why: fla's h kernel walks a sequence's chunks one after another (a program per (sequence, value head, value tile)),
stores the state before every chunk ([chunks, Hv, K, V] bf16) and the chunk's new values, and its o kernel reads
both back in a second launch. For short states (a RACE passage: ~5 chunks; 16 of them in one round) the chain is
short and that round trip and launch are a large share: `_state_chain_kernel` computes each chunk's outputs from
the state it holds, off the chain (nothing after depends on them). For long states the outputs' products on every
chain step cost more than they save (see LONG_TOKENS): such a sequence's program stores the states and new values
as fla's h step does, and `_chunk_out_kernel` computes its outputs chunk by chunk in parallel, as fla's o step does.

Per chunk of BT tokens (the equations and roundings of fla-core 0.6.0's `chunk_delta_h.py` / `chunk_o.py` for
16-bit inputs), with S the fp32 state slice [K, BV] before the chunk and Sb = S in the inputs' dtype (as fla
stores h):
    U  = u - w Sb                                 (fp32; Ub = U in the inputs' dtype: fla's stored v_new)
    o  = scale (e^g (q Sb)) + scale ((q k^T) * e^(g_i - g_j), j <= i) Ub
    S <- e^g_last S + k^T (U * e^(g_last - g))    (the gated U rounded to the inputs' dtype first)
g: the chunk-local cumulated log2 decays (fla's cumsum step), w / u: the WY form (fla's intra step). On the H200
(session 29, bf16, Qwen3.5-0.8B shapes, `benchmarks/ops/bench_state_chain.py`) the outputs and final states had
fla's bits on every stream measured; the contract is the usual one (checked against the reference). Each program
reads its own sequence only, and a sequence takes the same path and binary in every call (long or not by its own
length): batch-invariant.

Runs on CPU tensors under TRITON_INTERPRET=1 (fp32 there: the products in fp32, what the CPU tests check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# value columns per program, warps, pipeline stages: see benchmarks/ops/bench_state_chain.py
BLOCK_V = 32
NUM_WARPS = 4
NUM_STAGES = 2
# Sequences of at least this many tokens run the chain without the outputs (states and new values stored, as fla's h
# step does) and a second launch computes their outputs chunk by chunk in parallel (`_chunk_out_kernel`, as fla's o
# step). On the H200 (session 29, `ops_state_chain_h200.md`, Qwen3.5-0.8B) the fused step was slower than fla's h +
# o on one long state (2,000 tokens: 0.093 vs 0.078 ms a layer; 7,900: 0.343 vs 0.283): a chunk step of the chain
# waits on the outputs' products too. Faster on short states (RACE's 300 tokens: 0.0154 vs 0.0167 ms; 16 of them in
# the 8,192 bucket: 0.124 vs 0.217), where the chain is short and two launches and the states' round trip cost more.
# A call whose stream is shorter than this has no long sequence and launches the chain alone.
LONG_TOKENS = 1024
# the output launch's tile: value columns a program, warps, stages
OUT_TILES = (128, 4, 3)


@triton.jit(do_not_specialize=["T", "long_from"])
def _state_chain_kernel(q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, h_ptr, vn_ptr, offsets_ptr,
                        scale, T, long_from, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr):
    """A program per (sequence, value head, BV value columns). A sequence of at least `long_from` tokens stores the
    state before each chunk (h_ptr, at the chunk's row `offsets[sequence] + chunk`) and the chunk's new values (vn_ptr)
    for `_chunk_out_kernel` instead of its outputs; the others store their outputs. Both in one binary whatever the
    call, so a sequence's bits never depend on the call's size."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_hk = i_h // (HV // H)  # grouped value heads: value head h reads key head h // (HV // H)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    n = tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos
    is_long = n >= long_from
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    v_ok = o_v < V
    state_at = i_nh * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0_ptr + state_at, mask=v_ok[None, :], other=0.0)
    row = tl.load(offsets_ptr + i_n).to(tl.int64)  # read by long sequences only (offsets is cu_seqlens otherwise)
    for c0 in range(0, n, BT):
        t = bos + c0 + o_t
        t_ok = (c0 + o_t) < n
        b_kt = tl.load(k_ptr + (t[None, :] * H + i_hk) * K + o_k[:, None], mask=t_ok[None, :], other=0.0)  # [K, BT]
        b_w = tl.load(w_ptr + (t[:, None] * HV + i_h) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)
        p_uo = (t[:, None] * HV + i_h) * V + o_v[None, :]
        m_uo = t_ok[:, None] & v_ok[None, :]
        b_u = tl.load(u_ptr + p_uo, mask=m_uo, other=0.0)
        b_g = tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
        g_last = tl.load(g_ptr + (bos + tl.minimum(c0 + BT, n) - 1) * HV + i_h).to(tl.float32)
        b_s = S.to(b_w.dtype)
        # the chain: the chunk's new values from the state
        b_v = b_u - tl.dot(b_w, b_s)
        if is_long:  # the state and new values for the output launch (as fla's h step stores them)
            s_at = ((row + c0 // BT) * HV + i_h) * K * V
            tl.store(h_ptr + s_at + o_k[:, None] * V + o_v[None, :], b_s, mask=v_ok[None, :])
            tl.store(vn_ptr + p_uo, b_v.to(vn_ptr.dtype.element_ty), mask=m_uo)
        else:  # the chunk's outputs, off the chain
            b_q = tl.load(q_ptr + (t[:, None] * H + i_hk) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)
            b_o = tl.dot(b_q, b_s) * tl.exp2(b_g)[:, None]
            b_a = tl.dot(b_q, b_kt) * tl.exp2(b_g[:, None] - b_g[None, :])
            b_a = tl.where((o_t[:, None] >= o_t[None, :]) & t_ok[:, None] & t_ok[None, :], b_a, 0.0)
            b_o = b_o * scale + tl.dot(b_a.to(b_w.dtype), b_v.to(b_w.dtype)) * scale
            tl.store(o_ptr + p_uo, b_o.to(o_ptr.dtype.element_ty), mask=m_uo)
        # the state after the chunk
        b_v = b_v * tl.where(t_ok, tl.exp2(g_last - b_g), 0.0)[:, None]
        S = S * tl.exp2(g_last)
        S = tl.dot(b_kt, b_v.to(b_kt.dtype), S)
    tl.store(ht_ptr + state_at, S, mask=v_ok[None, :])


@triton.jit(do_not_specialize=["T", "long_from"])
def _chunk_out_kernel(q_ptr, k_ptr, g_ptr, o_ptr, cu_ptr, chunks_ptr, h_ptr, vn_ptr, offsets_ptr, scale, T, long_from,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BV: tl.constexpr):
    """A program per (chunk row, value head, BV value columns): the outputs of a long sequence's chunk from the state
    and new values its chain stored; rows of other sequences (and spare rows) return at once."""
    i_v = tl.program_id(0)
    i_r = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    i_n = tl.load(chunks_ptr + 2 * i_r).to(tl.int64)
    i_c = tl.load(chunks_ptr + 2 * i_r + 1).to(tl.int64)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    n = tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos
    if (n >= long_from) & (i_c * BT < n):
        i_hk = i_h // (HV // H)
        row = tl.load(offsets_ptr + i_n).to(tl.int64) + i_c
        o_k = tl.arange(0, K)
        o_v = i_v * BV + tl.arange(0, BV)
        o_t = tl.arange(0, BT)
        t = bos + i_c * BT + o_t
        t_ok = (i_c * BT + o_t) < n
        v_ok = o_v < V
        b_q = tl.load(q_ptr + (t[:, None] * H + i_hk) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)
        b_kt = tl.load(k_ptr + (t[None, :] * H + i_hk) * K + o_k[:, None], mask=t_ok[None, :], other=0.0)
        b_g = tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
        b_s = tl.load(h_ptr + (row * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :], mask=v_ok[None, :],
                      other=0.0)
        p_v = (t[:, None] * HV + i_h) * V + o_v[None, :]
        m_v = t_ok[:, None] & v_ok[None, :]
        b_v = tl.load(vn_ptr + p_v, mask=m_v, other=0.0)
        # the chain's own output code (`_state_chain_kernel`, short sequences), on the stored state and new values
        b_o = tl.dot(b_q, b_s) * tl.exp2(b_g)[:, None]
        b_a = tl.dot(b_q, b_kt) * tl.exp2(b_g[:, None] - b_g[None, :])
        b_a = tl.where((o_t[:, None] >= o_t[None, :]) & t_ok[:, None] & t_ok[None, :], b_a, 0.0)
        b_o = b_o * scale + tl.dot(b_a.to(b_v.dtype), b_v) * scale
        tl.store(o_ptr + p_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)


def state_chain(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                cu_seqlens: torch.Tensor, scale: float, initial_state: torch.Tensor | None = None,
                chunks: torch.Tensor | None = None, offsets: torch.Tensor | None = None, chunk: int = 64,
                tiles: tuple[int, int, int] | None = None,
                long_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, Hv, V] in q's dtype, final [N, Hv, K, V] float32) of every sequence of `cu_seqlens` [N + 1], from
    `initial_state` [N, Hv, K, V] (None: zero). q, k: [T, Hk, K] (normalised as the kernels read them); w [T, Hv, K],
    u [T, Hv, V]: fla's intra step's WY form (chunks of `chunk` tokens from each sequence's start); g [T, Hv] float32:
    the chunk-local cumulated log2 decays (fla's cumsum step). `chunks` [R, 2] (sequence, chunk) and `offsets` [N + 1]
    (each sequence's first chunk row: `fla.chunk_offsets`): the call's chunk rows, which the output launch for long
    sequences (LONG_TOKENS; `long_tokens` overrides it) runs over; without them no sequence is long. Rows outside the
    sequences are left unwritten. `tiles`: the chain's (value columns a program, warps, stages)."""
    T, HK, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    if K & (K - 1) or K < 16:
        raise ValueError(f"the key head dim must be a power of two >= 16, not {K}")
    if w.shape != (T, HV, K) or g.shape != (T, HV) or q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / w {tuple(w.shape)} / g {tuple(g.shape)} do not "
                         f"match [T={T}, Hk={HK} / Hv={HV}, K={K}]")
    N = cu_seqlens.shape[0] - 1
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    if N == 0:
        return o, final
    BV, warps, stages = tiles or (BLOCK_V, NUM_WARPS, NUM_STAGES)
    if stages < 2:  # one stage hit an illegal memory access on the H200's Triton 3.6 (session 29): not run
        raise ValueError(f"state_chain needs at least 2 pipeline stages, not {stages}")
    BV = min(BV, triton.next_power_of_2(V))
    long_from = LONG_TOKENS if long_tokens is None else long_tokens
    split = chunks is not None and offsets is not None and T >= long_from  # else no sequence can be long
    if split:
        h = torch.empty(chunks.shape[0], HV, K, V, dtype=q.dtype, device=q.device)
        v_new = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
        offsets = offsets.contiguous()
    else:
        long_from = T + 1  # the same binary, no sequence long; h / v_new / offsets never read
        h, v_new, offsets = o, o, cu_seqlens
    h0 = final if initial_state is None else initial_state.float().contiguous()  # unread without USE_H0
    q, k, w, u, g = (x.contiguous() for x in (q, k, w, u, g.float()))  # as the kernels index them (no-ops here)
    cu_seqlens = cu_seqlens.contiguous()
    _state_chain_kernel[(triton.cdiv(V, BV), N * HV)](
        q, k, w, u, g, o, h0, final, cu_seqlens, h, v_new, offsets, float(scale), T, long_from, H=HK, HV=HV, K=K,
        V=V, BT=chunk, BV=BV, USE_H0=initial_state is not None, num_warps=warps, num_stages=stages)
    if split:
        out_v, out_warps, out_stages = OUT_TILES
        out_v = min(out_v, triton.next_power_of_2(V))
        _chunk_out_kernel[(triton.cdiv(V, out_v), chunks.shape[0], HV)](
            q, k, g, o, cu_seqlens, chunks.contiguous(), h, v_new, offsets, float(scale), T, long_from, H=HK, HV=HV,
            K=K, V=V, BT=chunk, BV=out_v, num_warps=out_warps, num_stages=out_stages)
    return o, final
