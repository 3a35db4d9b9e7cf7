"""The state call's chunk-to-chunk steps as ONE Triton kernel: fla's h step (the state at every chunk) and o step
(the outputs from those states) fused, the states kept in registers instead of written to and read back from memory.

Why: fla's h kernel walks a sequence's chunks one after another (one program per (sequence, value head, value
tile): 64 programs for one long state on Qwen3.5-0.8B, half the H200's SMs), stores the state before every chunk
([chunks, Hv, K, V] in bf16: 38 MB a layer for QuALITY's 4.6k-token state) and the chunk's new values, and the o
kernel then reads both back in a second launch. Here the program that moves the state also computes the chunk's
outputs from it, off the chain (they feed nothing that comes after): no h tensor, no v_new tensor, one launch less.

Per chunk of BT tokens (the same equations and roundings as fla-core 0.6.0's two kernels, `chunk_delta_h.py` and
`chunk_o.py`, for 16-bit inputs), with S the fp32 state slice [K, BV] before the chunk and Sb = S in the inputs'
dtype (as fla stores h):
    U  = u - w Sb                                 (fp32; Ub = U in the inputs' dtype: fla's stored v_new)
    o  = scale (e^g (q Sb)) + scale ((q k^T) * e^(g_i - g_j), j <= i) Ub
    S <- e^g_last S + k^T (U * e^(g_last - g))    (the gated U rounded to the inputs' dtype first)
g: the chunk-local cumulated log2 decays (fla's cumsum step), w / u: the WY form (fla's intra step). Where fla
chains two K = 64 products through one accumulator this takes one K = 128 product: the same K steps in the same
order on the H200's tensor cores, and the outputs and final states had fla's bits on every stream of the op bench
(session 29, `benchmarks/results/ops_state_chain_h200.md`; `tests/gpu/test_gated_delta_gpu.py` asserts it on sm_90),
so a request's bits do not depend on whether its bucket runs this (`fla.FUSED_MAX_TOKENS`). Each program's sums
depend on its own sequence only: batch-invariant.

On a long sequence the fused step is slower than fla's two (a chain step also waits on its outputs' products:
QuALITY's state 0.343 vs 0.283 ms a layer), on short ones faster (16 RACE states 0.124 vs 0.217). A call that may
hold both (`fla.FUSED_SPLIT`, buckets over FUSED_MAX_TOKENS) splits by sequence (`state_chain_split`): the short ones
in the fused binary (SHORT), the long ones in a chain-only binary (LONG) that stores what fla's h step stores, where
an o step (`chunk_outputs`: fla's, with the fused chain's products) then reads it. A sequence's part depends on its
own length only.

Runs on CPU tensors under TRITON_INTERPRET=1 (fp32 there: the products in fp32, what the CPU tests check).
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

# value columns per program, warps, pipeline stages (benchmarks/ops/bench_state_chain.py, H200: the fastest on RACE's
# bucket, 0.0154 vs 0.0185-0.0414 ms for the others swept)
BLOCK_V = 32
NUM_WARPS = 4
NUM_STAGES = 2
# Programs per (value tile, value head) that take a launch's sequences in turns, in the fork's calls (no final state
# stored for empty sequences) of the EVERY and SHORT parts; 0: a program per (sequence, value head, value tile). A
# bucket's state list is mostly spare rows (the 8,192 bucket: 128 rows for one QuALITY state, whose SHORT launch then
# has nothing to run), and a program of ~108 KB of shared memory per spare row, two at a time an SM, costs its launch:
# the chunked question kernel measured ~20x slower so (session 36; questions_chunked.ROW_PROGRAMS). A sequence's sums
# do not depend on which program runs it: the same bits (H100, session 37: `test_gated_delta_gpu.py`'s fused / split
# chain tests against fla's steps passed with it on). Replay GPU ms on vs 0, same H100, 0.8B
# (`h100_profile_0_8b_session37_{rows,rows0}.json`): QuALITY 29.45 vs 29.66 (state chain 2.23 vs 2.44), 3,600-token
# QuALITY 13.33 vs 13.42, 2,000-token state with 8 / 64 questions 13.08 / 15.46 vs 13.19 / 15.57; RACE 3.046 vs 3.036
# (its 512 bucket's 8 state rows: 0.195 vs 0.186 ms, hence a program per sequence where there are no more sequences
# than programs)
ROW_PROGRAMS = 16


# What a launch of `_state_chain_kernel` does (its PART, a compile-time constant: each a binary of its own, so the
# chain of one part never carries the other's registers or code; a launch of one part alone was measured faster than
# one binary holding both, session 29's 6b12ff6)
# (tl.constexpr: compiled Triton reads module globals only as such; plain ints work in the interpreter alone)
EVERY = tl.constexpr(0)  # every sequence, outputs included (the fused chain)
SHORT = tl.constexpr(1)  # the sequences of at most `split` tokens, outputs included; the others return at once
LONG = tl.constexpr(2)  # the longer ones: the state before each chunk and the chunk's new values stored, as fla's h
#                         step stores them


@triton.jit
def _chunk_output(b_q, b_s, b_kt, b_v, b_g, t_ok, causal, scale):
    """One chunk's outputs [BT, BV] float32 from the state before it (b_s [K, BV], in the inputs' dtype) and its new
    values (b_v [BT, BV], rounded to the inputs' dtype here, as fla stores them): fla's o step's products, shared by
    the fused chain and the split call's outputs kernel so that both keep fla's bits."""
    b_o = tl.dot(b_q, b_s) * tl.exp2(b_g)[:, None]
    b_a = tl.dot(b_q, b_kt) * tl.exp2(b_g[:, None] - b_g[None, :])
    b_a = tl.where(causal & t_ok[:, None] & t_ok[None, :], b_a, 0.0)
    return b_o * scale + tl.dot(b_a.to(b_q.dtype), b_v.to(b_q.dtype)) * scale


@triton.jit
def _chain_sequence(q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, h_ptr, vn_ptr, rows_ptr,
                    h0_row_ptr, final_row_ptr, scale, split, i_v, i_n, i_h, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                    PART: tl.constexpr, EMPTY_FINALS: tl.constexpr, INDEXED: tl.constexpr):
    """Sequence i_n's chain for value head i_h and value tile i_v (see `_state_chain_kernel`)."""
    i_nh = i_n * HV + i_h
    i_hk = i_h // (HV // H)  # grouped value heads: value head h reads key head h // (HV // H)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    n = tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos
    # whether this part runs the sequence: an empty sequence's final state (zero) is not stored without EMPTY_FINALS
    # (see `state_chain(empty_finals=)`); SHORT takes the sequences of at most `split` tokens, LONG the others
    run = (n > 0) | EMPTY_FINALS
    if PART == SHORT:
        run = run & (n <= split)
    if PART == LONG:
        run = run & (n > split)
    if run:
        row0 = 0
        if PART == LONG:
            row0 = tl.load(rows_ptr + i_n).to(tl.int64)  # the sequence's first chunk row of h (`split_tables`)
        o_k = tl.arange(0, K)
        o_v = i_v * BV + tl.arange(0, BV)
        o_t = tl.arange(0, BT)
        v_ok = o_v < V
        state_at = i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        S = tl.zeros([K, BV], dtype=tl.float32)
        final_row = i_n
        if INDEXED:
            # a segment of a long sequence (segment_scan.py): its initial state at row h0_row of h0 (-1: zero, a
            # sequence's first segment), its final state at row final_row of ht (-1: not stored, an inner segment)
            h0_row = tl.load(h0_row_ptr + i_n).to(tl.int64)
            if h0_row >= 0:
                S += tl.load(h0_ptr + (h0_row * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                             mask=v_ok[None, :], other=0.0)
            final_row = tl.load(final_row_ptr + i_n).to(tl.int64)
            state_at = (final_row * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        elif USE_H0:
            S += tl.load(h0_ptr + state_at, mask=v_ok[None, :], other=0.0)
        causal = o_t[:, None] >= o_t[None, :]
        for c0 in range(0, n, BT):
            t = bos + c0 + o_t
            t_ok = (c0 + o_t) < n
            b_kt = tl.load(k_ptr + (t[None, :] * H + i_hk) * K + o_k[:, None], mask=t_ok[None, :], other=0.0)
            b_w = tl.load(w_ptr + (t[:, None] * HV + i_h) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)
            p_uo = (t[:, None] * HV + i_h) * V + o_v[None, :]
            m_uo = t_ok[:, None] & v_ok[None, :]
            b_u = tl.load(u_ptr + p_uo, mask=m_uo, other=0.0)
            b_g = tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
            g_last = tl.load(g_ptr + (bos + tl.minimum(c0 + BT, n) - 1) * HV + i_h).to(tl.float32)
            b_s = S.to(b_w.dtype)
            # the chain: the chunk's new values from the state
            b_v = b_u - tl.dot(b_w, b_s)
            if PART == LONG:
                # the state before the chunk and its new values, where fla's h step puts them (h row: the chunk's row
                # of the call's long-sequence chunk table), for fla's o step to compute the outputs from
                h_at = ((row0 + c0 // BT) * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
                tl.store(h_ptr + h_at, b_s, mask=v_ok[None, :])
                tl.store(vn_ptr + p_uo, b_v.to(vn_ptr.dtype.element_ty), mask=m_uo)
            else:
                # the chunk's outputs (off the chain)
                b_q = tl.load(q_ptr + (t[:, None] * H + i_hk) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)
                b_o = _chunk_output(b_q, b_s, b_kt, b_v, b_g, t_ok, causal, scale)
                tl.store(o_ptr + p_uo, b_o.to(o_ptr.dtype.element_ty), mask=m_uo)
            # the state after the chunk
            b_v = b_v * tl.where(t_ok, tl.exp2(g_last - b_g), 0.0)[:, None]
            S = S * tl.exp2(g_last)
            S = tl.dot(b_kt, b_v.to(b_kt.dtype), S)
        if final_row >= 0:
            tl.store(ht_ptr + state_at, S, mask=v_ok[None, :])


@triton.jit(do_not_specialize=["T", "split", "P"])
def _state_chain_kernel(q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, h_ptr, vn_ptr, rows_ptr,
                        h0_row_ptr, final_row_ptr, scale, T, split, N, P, H: tl.constexpr, HV: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                        PART: tl.constexpr, EMPTY_FINALS: tl.constexpr, INDEXED: tl.constexpr,
                        ROWS: tl.constexpr):
    i_v = tl.program_id(0)
    if ROWS:
        # programs (value tile, value head, p) run sequences p, p + P, ... up to the last one this part runs (the
        # spare rows at the end of a bucket's state list cost one vector load, not a program each: ROW_PROGRAMS)
        i_h = tl.program_id(1).to(tl.int64)
        i_p = tl.program_id(2)
        last = 0
        for r0 in range(0, N, 128):
            o_r = r0 + tl.arange(0, 128)
            lo = tl.load(cu_ptr + o_r, mask=o_r < N, other=0)
            lens = tl.load(cu_ptr + o_r + 1, mask=o_r < N, other=0) - lo
            wanted = lens > 0
            if PART == SHORT:
                wanted = wanted & (lens <= split)
            last = tl.maximum(last, tl.max(tl.where(wanted, o_r + 1, 0)))
        for i_n in range(i_p, last, P):
            # (i_h * 0 + i_n: the row index in int64, the loop's own being int32, a Python int in the interpreter)
            _chain_sequence(q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, h_ptr, vn_ptr, rows_ptr,
                            h0_row_ptr, final_row_ptr, scale, split, i_v, i_h * 0 + i_n, i_h, H, HV, K, V, BT, BV,
                            USE_H0, PART, EMPTY_FINALS, INDEXED)
    else:
        i_nh = tl.program_id(1).to(tl.int64)
        _chain_sequence(q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, h_ptr, vn_ptr, rows_ptr,
                        h0_row_ptr, final_row_ptr, scale, split, i_v, i_nh // HV, i_nh % HV, H, HV, K, V, BT, BV,
                        USE_H0, PART, EMPTY_FINALS, INDEXED)


# the outputs kernel's (value columns, warps, stages), and the LONG chain's (bench_state_chain.py, session 31: on the
# H200 the LONG chain at 3 stages 0.093 vs 0.114 ms a layer on a 2,000-token state, 0.343 vs 0.421 on QuALITY's; on an
# H100 the split call with outputs at BV 128 / 8 warps 0.0846 vs 0.0864-0.0912 ms for the other tiles on the
# 2,000-token state, 0.306 vs 0.315-0.347 on QuALITY's, against fla's h + o 0.081 / 0.302; the same bits)
OUTPUT_TILES = (128, 8, 2)
LONG_TILES = (32, 4, 3)


@triton.jit
def _chunk_outputs_kernel(q_ptr, k_ptr, vn_ptr, h_ptr, g_ptr, o_ptr, cu_ptr, chunks_ptr, scale, H: tl.constexpr,
                          HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """fla's o step for the chunk rows of a split call's long sequences: one program per (value tile, chunk row,
    value head), the state before the chunk read from h's row, the products those of the fused chain (so the bits of
    fla's o kernel). Unlike fla's kernel, a spare row (naming the trailing empty sequence: most of a bucket's rows
    when its states are short) returns at once instead of computing a masked chunk."""
    i_v = tl.program_id(0)
    i_r = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    i_hk = i_h // (HV // H)
    i_n = tl.load(chunks_ptr + i_r * 2).to(tl.int64)
    c0 = tl.load(chunks_ptr + i_r * 2 + 1).to(tl.int64) * BT
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    n = tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos
    if c0 >= n:
        return
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    v_ok = o_v < V
    t = bos + c0 + o_t
    t_ok = (c0 + o_t) < n
    b_q = tl.load(q_ptr + (t[:, None] * H + i_hk) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)
    b_kt = tl.load(k_ptr + (t[None, :] * H + i_hk) * K + o_k[:, None], mask=t_ok[None, :], other=0.0)
    b_s = tl.load(h_ptr + (i_r * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :], mask=v_ok[None, :], other=0.0)
    p_vo = (t[:, None] * HV + i_h) * V + o_v[None, :]
    m_vo = t_ok[:, None] & v_ok[None, :]
    b_v = tl.load(vn_ptr + p_vo, mask=m_vo, other=0.0)
    b_g = tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
    b_o = _chunk_output(b_q, b_s, b_kt, b_v, b_g, t_ok, o_t[:, None] >= o_t[None, :], scale)
    tl.store(o_ptr + p_vo, b_o.to(o_ptr.dtype.element_ty), mask=m_vo)


def _check(q, k, w, u, g) -> None:
    T, HK, K = k.shape
    HV = u.shape[1]
    if K & (K - 1) or K < 16:
        raise ValueError(f"the key head dim must be a power of two >= 16, not {K}")
    if w.shape != (T, HV, K) or g.shape != (T, HV) or q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / w {tuple(w.shape)} / g {tuple(g.shape)} do not "
                         f"match [T={T}, Hk={HK} / Hv={HV}, K={K}]")


def _launch(q, k, w, u, g, cu_seqlens, scale, o, final, initial_state, chunk, tiles, part=EVERY, split=0,
            h=None, v_new=None, rows=None, empty_finals=True, indexed=None, row_programs=None) -> None:
    """One launch of `_state_chain_kernel` over the sequences of `cu_seqlens`. `indexed` (h0 [R, Hv, K, V] float32,
    h0_row [N], final_row [N]; segment_scan.py): each sequence's initial state from row h0_row of h0 (-1: zero) and
    its final state to row final_row of `final` (-1: none), instead of row n of both."""
    T, HK, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    N = cu_seqlens.shape[0] - 1
    if N == 0:
        return
    BV, warps, stages = tiles or (BLOCK_V, NUM_WARPS, NUM_STAGES)
    if not empty_finals and initial_state is not None:
        raise ValueError("empty_finals=False is for calls from zero states (an empty sequence's final state is then "
                         "zero); from initial states it is the initial state, which must be stored")
    if stages < 2:  # one stage hit an illegal memory access on the H200's Triton 3.6 (session 29): not run
        raise ValueError(f"state_chain needs at least 2 pipeline stages, not {stages}")
    BV = min(BV, triton.next_power_of_2(V))
    h0 = final if initial_state is None else initial_state.float().contiguous()  # unread without USE_H0
    h0_row = final_row = cu_seqlens  # read with `indexed` only
    if indexed is not None:
        h0, h0_row, final_row = indexed
    q, k, w, u, g = (x.contiguous() for x in (q, k, w, u, g.float()))  # as the kernel indexes them (no-ops here)
    cu_seqlens = cu_seqlens.contiguous()
    # programs taking the sequences in turns (ROW_PROGRAMS): where every sequence a program skips is one whose final
    # state is not stored (EMPTY_FINALS off), and not for LONG, whose one long sequence runs beside the spare rows
    P = ROW_PROGRAMS if row_programs is None else row_programs
    # (more sequences than programs: with fewer, a program per sequence is as many programs without the scan for the
    # last one; H100, session 37: RACE's 8-row launches took 0.195 vs 0.186 ms in turns)
    rows_mode = P > 0 and N > P and not empty_finals and part != LONG and indexed is None
    grid = (triton.cdiv(V, BV), HV, min(P, N)) if rows_mode else (triton.cdiv(V, BV), N * HV)
    # h / v_new / rows: read and written by the LONG part only (any valid pointer otherwise)
    _state_chain_kernel[grid](
        q, k, w, u, g, o, h0, final, cu_seqlens, o if h is None else h, o if v_new is None else v_new,
        cu_seqlens if rows is None else rows.contiguous(), h0_row, final_row, float(scale), T, int(split), N,
        max(1, min(P, N)), H=HK, HV=HV, K=K, V=V, BT=chunk, BV=BV, USE_H0=initial_state is not None,
        PART=part.value, EMPTY_FINALS=empty_finals, INDEXED=indexed is not None, ROWS=rows_mode, num_warps=warps,
        num_stages=stages)


def state_chain(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                cu_seqlens: torch.Tensor, scale: float, initial_state: torch.Tensor | None = None,
                chunk: int = 64, tiles: tuple[int, int, int] | None = None,
                empty_finals: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, Hv, V] in q's dtype, final [N, Hv, K, V] float32) of every sequence of `cu_seqlens` [N + 1], from
    `initial_state` [N, Hv, K, V] (None: zero). q, k: [T, Hk, K] contiguous (normalised as the kernels read them);
    w [T, Hv, K], u [T, Hv, V]: fla's intra step's WY form (chunks of `chunk` tokens from each sequence's start); g
    [T, Hv] float32: the chunk-local cumulated log2 decays (fla's cumsum step). Rows outside the sequences are left
    unwritten. `tiles`: (value columns a program, warps, stages).

    `empty_finals=False` (from zero states only): the final-state rows of empty sequences are left unwritten instead
    of zeroed. A bucket's state list is mostly spare rows (length 0: 127 of the 8,192 bucket's 128 for one QuALITY
    request), each a 1 MiB float32 state on Qwen3.5-0.8B: storing their zeros took ~47 us a layer there (H200,
    session 33). The fork's question call never reads them: it starts a question of an empty state from zero
    (`ForkTables.branch_from`)."""
    _check(q, k, w, u, g)
    T, HV, V, K = k.shape[0], u.shape[1], u.shape[2], k.shape[2]
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    final = torch.empty(cu_seqlens.shape[0] - 1, HV, K, V, dtype=torch.float32, device=q.device)
    _launch(q, k, w, u, g, cu_seqlens, scale, o, final, initial_state, chunk, tiles, empty_finals=empty_finals)
    return o, final


def chunk_outputs(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, g: torch.Tensor,
                  cu_seqlens: torch.Tensor, chunks: torch.Tensor, scale: float, o: torch.Tensor, chunk: int = 64,
                  tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Writes into `o` [T, Hv, V] the outputs of the chunk rows `chunks` [R, 2] ((sequence of `cu_seqlens`, chunk);
    rows past a sequence's end, such as spare rows naming an empty sequence, write nothing) from h [R, Hv, K, V] (the
    state before each row's chunk, q's dtype) and v_new [T, Hv, V] (the chunks' new values): fla's o step (see
    `_chunk_outputs_kernel`). q, k [T, Hk, K]; g [T, Hv] float32 log2 cumsums. Returns o."""
    T, HK, K = k.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    R = chunks.shape[0]
    if R == 0:
        return o
    BV, warps, stages = tiles or OUTPUT_TILES
    BV = min(BV, triton.next_power_of_2(V))
    _chunk_outputs_kernel[(triton.cdiv(V, BV), R, HV)](
        q.contiguous(), k.contiguous(), v_new.contiguous(), h.contiguous(), g.float().contiguous(), o,
        cu_seqlens.contiguous(), chunks.contiguous(), float(scale), H=HK, HV=HV, K=K, V=V, BT=chunk, BV=BV,
        num_warps=warps, num_stages=stages)
    return o


def state_chain_split(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                      cu_seqlens: torch.Tensor, scale: float, split: int, long_chunks: torch.Tensor,
                      long_rows: torch.Tensor,
                      outputs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                      chunk: int = 64, tiles: tuple[int, int, int] | None = None,
                      long_tiles: tuple[int, int, int] | None = None,
                      output_tiles: tuple[int, int, int] | None = None,
                      empty_finals: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`state_chain` (from zero states) of the N sequences of `cu_seqlens` [N + 2] (the last one empty: the one that
    spare chunk rows name), with those of more than `split` tokens run as fla runs them: the chain stores the state
    before each chunk (h [R, Hv, K, V] in q's dtype, row `long_rows[n] + c` for chunk c of sequence n) and each
    chunk's new values (v_new [T, Hv, V]), then their outputs are computed from those, chunk by chunk in parallel,
    over `long_chunks` [R, 2] (`fla.split_tables`; its offsets are `long_rows` [N + 2]): `chunk_outputs`, or
    `outputs(h, v_new)` returning o [T, Hv, V] where given (a test's oracle); then the other sequences' fused chain
    writes their rows of that o. Same results as `state_chain` (the same products in the same order: the same bits
    on the H200), but a long sequence's chain step no longer waits on its outputs' products, and the short ones keep
    the fused launch (no h round trip). Final states: [N, Hv, K, V]. `long_tiles`, `output_tiles`: the LONG chain's
    and the outputs kernel's (value columns, warps, stages). `empty_finals`: as `state_chain`'s."""
    _check(q, k, w, u, g)
    T, HV, V, K = k.shape[0], u.shape[1], u.shape[2], k.shape[2]
    sequences = cu_seqlens[:-1]  # the chains' sequences, without the trailing empty one
    final = torch.empty(sequences.shape[0] - 1, HV, K, V, dtype=torch.float32, device=q.device)
    h = torch.empty(long_chunks.shape[0], HV, K, V, dtype=q.dtype, device=q.device)
    v_new = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    _launch(q, k, w, u, g, sequences, scale, v_new, final, None, chunk, long_tiles or LONG_TILES, part=LONG,
            split=split, h=h, v_new=v_new, rows=long_rows)
    if outputs is None:
        o = chunk_outputs(q, k, v_new, h, g, cu_seqlens, long_chunks, scale, torch.empty_like(v_new), chunk,
                          output_tiles)
    else:
        o = outputs(h, v_new)
    _launch(q, k, w, u, g, sequences, scale, o, final, None, chunk, tiles, part=SHORT, split=split,
            empty_finals=empty_finals)
    return o, final
