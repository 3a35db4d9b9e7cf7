"""The state call's chunk chain in two levels: a long sequence's segments in parallel, then a short scan over them.

Why: the chain from chunk to chunk is sequential, ~1.4 us a 64-token chunk on an H100 whatever the card's width
(Qwen3.5-0.8B, QuALITY's 6,100-token state: 96 chunks, 64 programs a layer, ~135 us, plus ~80 us for the outputs
of its stored states). The chain is affine in the state it starts from: over a segment of chunks,

    S_end = M S_start + S0,

S0 the segment's chain from a zero state, M [K, K] the same chain from the identity with the new values' u left
out (each chunk maps S to e^g_last S + k~^T (u - w S), k~ = k * e^(g_last - g): the same equations, the same
roundings as the fused chain's, `state_chain.py`). So, with segments of SEGMENT_TOKENS tokens (whole chunks):
    1. `_transition_kernel`: every segment but a sequence's last, in parallel: [S0 | M] as ONE state of V + K
       columns (u padded with zeros for the M columns, the identity as M's start): its chain to its end;
    2. `_combine_kernel`: per long sequence, the segments' start states in order, S <- M S + S0 (fp32; tf32x3 dots
       on the GPU): a few steps instead of a chunk each;
    3. the fused chain (`state_chain._state_chain_kernel`, `INDEXED`) over every segment, each from its start
       state, outputs included: a long sequence's chain is a segment long.
The short sequences (at most `split` tokens) are one segment each: step 3 runs them as the fused chain would, the
same code from a zero state. A segment's first chunk starts a chunk of its sequence (SEGMENT_TOKENS is a multiple of
the chunk), so the chunk-local WY form (w, u, the gate cumsums) is the whole sequence's, computed once.

Exactness: a long sequence's first segment has the one-step chain's bits; the later ones start from a state summed
in another order (M S + S0 instead of chunk by chunk), so their outputs differ from fla's by rounding (bf16 states
in the products, as fla's). What a sequence gets depends on its own tokens and length only (segments start at its
own start): batch-invariant, and a request's answer does not depend on the round around it. fp32 on the CPU through
the interpreter (what the CPU tests check against the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...config import GDN_CHUNK
from .state_chain import EVERY, _check, _launch

# tokens a segment (a multiple of the 64-token chunk): shorter segments put more programs to work but lengthen the
# combine scan (one step a segment)
SEGMENT_TOKENS = 512
# (columns a program, warps, stages) of the transition chain (the state chain's own tiles) and of the combine
TRANSITION_TILES = (32, 4, 3)
COMBINE_TILES = (32, 4, 2)
# tf32x3: ~fp32 products on the tensor cores (the combine's M S are a few products a sequence; plain tf32 would
# add ~1e-3 relative error a step); the interpreter runs fp32 whatever is asked
COMBINE_PRECISION = "tf32x3"


def segment_tables(cu_seqlens: torch.Tensor, split: int, tokens: int, segment: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments of the sequences of `cu_seqlens` [N + 2] (the states, then the empty one spare rows name) in a
    call of `tokens` tokens (its capacity: the tables' sizes depend on it and N only, so a CUDA graph replays them
    with any round). A sequence of more than `split` tokens is cut into segments of `segment` tokens from its start,
    the others are one segment each. Returns two tensors (`unpack` names their parts), so that they travel as the
    split call's two tables (`ForkTables.long_chunks` / `long_chunk_offsets`):
      pairs [R + L, 2]:
        rows [R, 2]: (segment, first) of each transition row (every segment but a long sequence's last; first: 1
          for a sequence's first segment, whose M nobody reads), spare rows (-1, 0),
        chains [L, 2]: (first transition row, rows) of each long sequence in order, spare ones (0, 0);
      index [3 S + 1]:
        seg_cu [S + 1]: the segments' bounds (contiguous, in stream order; spare ones empty at the end),
        h0_row [S]: the row of the start states (`_combine_kernel`'s output) a segment starts from, -1: zero,
        final_row [S]: the sequence whose final state a segment's end is (its last segment), -1: none;
    with S = N + 1 + tokens // segment, R = tokens // segment, L = tokens // (split + 1); `segment` None:
    SEGMENT_TOKENS. Device ops only."""
    segment = SEGMENT_TOKENS if segment is None else segment
    if segment <= 0 or segment % GDN_CHUNK:
        raise ValueError(f"a segment is whole {GDN_CHUNK}-token chunks, not {segment} tokens")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [N + 1], the last empty
    n_seq = lens.shape[0]
    device = lens.device
    long = lens > split
    pieces = torch.where(long, (lens + segment - 1) // segment, torch.ones_like(lens))
    first_seg = torch.cat([lens.new_zeros(1), pieces.cumsum(0)])  # [N + 2]
    inner = torch.where(long, pieces - 1, torch.zeros_like(lens))  # transition rows a sequence
    first_row = torch.cat([lens.new_zeros(1), inner.cumsum(0)])[:-1]  # [N + 1]
    S, R, L = n_seq + tokens // segment, _rows(tokens, segment), max(tokens // (split + 1), 1)
    slots = torch.arange(S, device=device)
    seq = (torch.searchsorted(first_seg, slots, right=True) - 1).clamp(max=n_seq - 1)
    valid = slots < first_seg[-1]
    j = slots - first_seg[seq]
    seq_long = long[seq] & valid
    end = cu_seqlens[-1:].long()
    start = torch.where(valid, cu_seqlens[seq].long() + torch.where(seq_long, j * segment, 0), end)
    h0_row = torch.where(seq_long & (j >= 1), first_row[seq] + j - 1, -1)
    final_row = torch.where(valid & (j == pieces[seq] - 1) & (seq < n_seq - 1), seq, -1)
    t_row = torch.where(seq_long & (j < pieces[seq] - 1), first_row[seq] + j, R)  # R: no row (dropped below)
    rows = torch.full((R + 1, 2), -1, dtype=torch.long, device=device)
    rows[:, 1] = 0
    rows.index_put_((t_row,), torch.stack([slots, (j == 0).long()], 1))
    rank = torch.where(long, long.long().cumsum(0) - 1, L)
    chains = torch.zeros(L + 1, 2, dtype=torch.long, device=device)
    chains.index_put_((rank,), torch.stack([first_row, inner], 1))
    dtype = cu_seqlens.dtype
    return (torch.cat([rows[:R], chains[:L]]).to(dtype), torch.cat([start, end, h0_row, final_row]).to(dtype))


def _rows(tokens: int, segment: int) -> int:
    return max(tokens // segment, 1)


def unpack(pairs: torch.Tensor, index: torch.Tensor, tokens: int, segment: int | None = None
           ) -> tuple[torch.Tensor, ...]:
    """(seg_cu, h0_row, final_row, rows, chains): `segment_tables`' parts, views of its two tensors."""
    R = _rows(tokens, SEGMENT_TOKENS if segment is None else segment)
    S = (index.shape[0] - 1) // 3
    return index[:S + 1], index[S + 1:2 * S + 1], index[2 * S + 1:], pairs[:R], pairs[R:]


@triton.jit(do_not_specialize=["T"])
def _transition_kernel(k_ptr, w_ptr, u_ptr, g_ptr, x_ptr, cu_ptr, rows_ptr, T, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Program (column tile i_c of V + K, transition row i_r, value head i_h): the segment's chain over its chunks
    from [0 | I] (S0's columns, then M's), u read for S0's columns only; [S0 | M] stored at row i_r of x
    [R, Hv, K, V + K] float32. A first segment's M tiles return at once (a sequence starts from zero: its M is
    never read)."""
    i_c = tl.program_id(0)
    i_r = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    i_hk = i_h // (HV // H)
    seg = tl.load(rows_ptr + i_r * 2).to(tl.int64)
    first = tl.load(rows_ptr + i_r * 2 + 1)
    if seg < 0:
        return
    if (first != 0) & (i_c * BC >= V):
        return
    bos = tl.load(cu_ptr + seg).to(tl.int64)
    n = tl.load(cu_ptr + seg + 1).to(tl.int64) - bos
    o_k = tl.arange(0, K)
    o_c = i_c * BC + tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    c_ok = o_c < V + K
    u_col = o_c < V
    # S0's columns from zero, M's from the identity (column V + m is the unit vector m)
    X = tl.where(o_k[:, None] == (o_c - V)[None, :], 1.0, 0.0)
    for c0 in range(0, n, BT):
        t = bos + c0 + o_t
        t_ok = (c0 + o_t) < n
        b_kt = tl.load(k_ptr + (t[None, :] * H + i_hk) * K + o_k[:, None], mask=t_ok[None, :], other=0.0)  # [K, BT]
        b_w = tl.load(w_ptr + (t[:, None] * HV + i_h) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)
        b_u = tl.load(u_ptr + (t[:, None] * HV + i_h) * V + o_c[None, :], mask=t_ok[:, None] & u_col[None, :],
                      other=0.0)
        b_g = tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
        g_last = tl.load(g_ptr + (bos + tl.minimum(c0 + BT, n) - 1) * HV + i_h).to(tl.float32)
        # the fused chain's step (state_chain.py), on V + K columns: M's have u = 0
        b_v = b_u - tl.dot(b_w, X.to(b_w.dtype))
        b_v = b_v * tl.where(t_ok, tl.exp2(g_last - b_g), 0.0)[:, None]
        X = X * tl.exp2(g_last)
        X = tl.dot(b_kt, b_v.to(b_kt.dtype), X)
    tl.store(x_ptr + ((i_r * HV + i_h) * K + o_k[:, None]) * (V + K) + o_c[None, :], X, mask=c_ok[None, :])


@triton.jit
def _combine_kernel(x_ptr, h0_ptr, chains_ptr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BV: tl.constexpr, PRECISION: tl.constexpr):
    """Program (value tile i_v, long sequence i_l, value head i_h): the start state of each of its segments after
    the first, S <- M S + S0 over its transition rows in order, stored at those rows of h0 [R, Hv, K, V] float32
    (row r: the state after row r's segment, where the next one starts)."""
    i_v = tl.program_id(0)
    i_l = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    r0 = tl.load(chains_ptr + i_l * 2).to(tl.int64)
    count = tl.load(chains_ptr + i_l * 2 + 1)
    if count == 0:
        return
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    v_ok = o_v < V
    W = V + K
    at = ((r0 * HV + i_h) * K + o_k[:, None]) * W
    S = tl.load(x_ptr + at + o_v[None, :], mask=v_ok[None, :], other=0.0)  # the first segment: from zero, S = S0
    tl.store(h0_ptr + ((r0 * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], S, mask=v_ok[None, :])
    for i in range(1, count):
        r = r0 + i
        at = ((r * HV + i_h) * K + o_k[:, None]) * W
        M = tl.load(x_ptr + at + V + o_k[None, :])
        S0 = tl.load(x_ptr + at + o_v[None, :], mask=v_ok[None, :], other=0.0)
        S = tl.dot(M, S, S0, input_precision=PRECISION)
        tl.store(h0_ptr + ((r * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], S, mask=v_ok[None, :])


def state_chain_segments(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                         tables: tuple[torch.Tensor, torch.Tensor], n_sequences: int, scale: float,
                         segment: int | None = None, chunk: int = 64, tiles: tuple[int, int, int] | None = None,
                         transition_tiles: tuple[int, int, int] | None = None,
                         combine_tiles: tuple[int, int, int] | None = None,
                         empty_finals: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`state_chain` (from zero states) of `n_sequences` sequences, their long ones in segments (`tables`:
    `segment_tables` of this call, built with the same `segment`): (o [T, Hv, V] in q's dtype, final
    [n_sequences, Hv, K, V] float32). Rows outside the sequences are left unwritten, and with `empty_finals=False`
    the final rows of empty sequences too."""
    _check(q, k, w, u, g)
    T, HV, V, K = k.shape[0], u.shape[1], u.shape[2], k.shape[2]
    seg_cu, h0_row, final_row, rows, chains = unpack(*tables, T, segment)
    HK = k.shape[1]
    R, L = rows.shape[0], chains.shape[0]
    q, k, w, u, g = (x.contiguous() for x in (q, k, w, u, g.float()))
    x = torch.empty(R, HV, K, V + K, dtype=torch.float32, device=q.device)
    h0 = torch.empty(R, HV, K, V, dtype=torch.float32, device=q.device)
    BC, warps, stages = transition_tiles or TRANSITION_TILES
    _transition_kernel[(triton.cdiv(V + K, BC), R, HV)](k, w, u, g, x, seg_cu, rows, T, H=HK, HV=HV, K=K, V=V,
                                                         BT=chunk, BC=BC, num_warps=warps, num_stages=stages)
    BV, warps, stages = combine_tiles or COMBINE_TILES
    BV = min(BV, triton.next_power_of_2(V))
    _combine_kernel[(triton.cdiv(V, BV), L, HV)](x, h0, chains, HV=HV, K=K, V=V, BV=BV,
                                                 PRECISION=COMBINE_PRECISION, num_warps=warps, num_stages=stages)
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    final = torch.empty(n_sequences, HV, K, V, dtype=torch.float32, device=q.device)
    _launch(q, k, w, u, g, seg_cu, scale, o, final, None, chunk, tiles, part=EVERY, empty_finals=empty_finals,
            indexed=(h0, h0_row.contiguous(), final_row.contiguous()))
    return o, final
