"""The gated delta rule over the segments of a flat stream, in pure torch (chunked, float32).

The recurrence, per value head, with S a [K, V] state:
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,      o_t = S_t^T (scale * q_t)
Forking runs it twice (see `fork`): over all states from zero, keeping each state's final S (float32); then over
all questions, each starting from the final S of its state, gathered by index.

`gated_delta_snapshot` also returns each segment's state at a chosen chunk boundary: the checkpoint a later request
resumes from (flide/checkpoints), taken inside the pass that answers the request, so saving costs no extra pass.

Nested forks (`gated_delta(..., sub_lo=, sub_hi=)`, the question call only): a leaf question runs its sub-trunk's
rows (a shared question line, laid out once as its own question segment) before its own, from its state's final S.
"""

from __future__ import annotations

import torch

from ...config import GDN_CHUNK


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gather_segments(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [T, ...] -> [N, L, ...] at rows [N, L], where row T is a zero row (padding)."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded[rows]


def _initial(initial_state: torch.Tensor, initial_index: torch.Tensor, shape) -> torch.Tensor:
    if initial_state.shape[0] == 0:
        return torch.zeros(shape, dtype=torch.float32, device=initial_index.device)
    gathered = initial_state[initial_index.clamp(min=0)].float()
    return torch.where((initial_index >= 0)[:, None, None, None], gathered, torch.zeros_like(gathered))


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                initial_index: torch.Tensor, scale: float, use_qk_l2norm: bool, sub_lo: torch.Tensor | None = None,
                sub_hi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `_chunked` for the arguments. Returns: (o [T, Hv, V] in q's dtype, final_state [N, Hv, K, V] float32).

    `sub_lo`, `sub_hi` (both or neither; the nested fork's question call): [T] int32 per token, the stream range
    [a, b) of the token's sub-trunk segment for a leaf question's tokens, empty (b <= a) for every other token. A
    segment whose first token has a non-empty range runs rows a..b-1 first, from its initial state, without writing
    their outputs (they are the sub-trunk segment's own rows), then its own rows; its final state is the one after
    its own rows. None: the plain call, the same bits as without the arguments."""
    if (sub_lo is None) != (sub_hi is None):
        raise ValueError("`sub_lo` and `sub_hi` go together (a nested fork's sub-trunk ranges), or neither")
    sub = None if sub_lo is None else (sub_lo, sub_hi)
    out, final, _ = _chunked(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, None, scale,
                             use_qk_l2norm, sub)
    return out, final


def gated_delta_snapshot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                         initial_index: torch.Tensor, snapshot_chunk: torch.Tensor, scale: float,
                         use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_delta` that also keeps, per segment, the float32 state after its first `snapshot_chunk[n]` chunks
    (i.e. at token 64 * c of the segment; -1: none, the row is then zeros): chunk-aligned, so the state is one the
    chunked recurrence holds anyway. Returns (o, final_state, snapshot [N, Hv, K, V] float32)."""
    return _chunked(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, snapshot_chunk, scale,
                    use_qk_l2norm)


def _chunked(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, snapshot_chunk, scale: float,
             use_qk_l2norm: bool, sub: tuple[torch.Tensor, torch.Tensor] | None = None):
    """
    Args:
        q, k: [T, Hk, K]; v: [T, Hv, V] with Hv a multiple of Hk (value head h reads key head h // (Hv // Hk)).
        g: [T, Hv] log decay (<= 0); beta: [T, Hv].
        seg_start, seg_len: [N] int64: the segments to run (length 0: skipped). Rows outside them are left at 0.
        initial_state: [M, Hv, K, V] float32; initial_index: [N] int64 row of initial_state each segment starts
            from, -1 for a zero state.
        snapshot_chunk: [N] int64 or None: the chunk boundary whose state to keep per segment (-1: none).
        scale: query scale; use_qk_l2norm: L2-normalise q and k first (Qwen3.5 does, in float32).
        sub: (sub_lo, sub_hi) [T] int32 or None: each leaf segment's sub-trunk rows, run first (`gated_delta`).
    Returns: (o [T, Hv, V] in q's dtype, final_state [N, Hv, K, V] float32, snapshot [N, Hv, K, V] float32 or None).
    """
    T, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    # Only the segments that hold tokens are computed (the reference may sync with the host: it is never captured
    # in a graph); an empty segment's final state is its initial state.
    final = _initial(initial_state, initial_index, (seg_start.shape[0], Hv, K, V))
    snapshot = None if snapshot_chunk is None else torch.zeros_like(final)
    active = torch.nonzero(seg_len > 0).flatten()
    if active.numel() == 0:
        if snapshot is not None:  # an empty segment's state at chunk 0 is its initial state
            snapshot = torch.where((snapshot_chunk == 0)[:, None, None, None], final, snapshot)
        return q.new_zeros(T, Hv, V), final, snapshot
    seg_start, seg_len, initial_index = seg_start[active], seg_len[active], initial_index[active]
    N = seg_start.shape[0]
    dev = q.device
    rows, out_rows = _segment_rows(sub, seg_start, seg_len, T)
    L = rows.shape[1]

    qs, ks = _gather_segments(q.float(), rows), _gather_segments(k.float(), rows)  # [N, L, Hk, K]
    vs = _gather_segments(v.float(), rows)  # [N, L, Hv, V]
    gs, bs = _gather_segments(g.float(), rows), _gather_segments(beta.float(), rows)  # [N, L, Hv]
    if Hv != Hk:
        qs, ks = (x.repeat_interleave(Hv // Hk, dim=2) for x in (qs, ks))
    if use_qk_l2norm:
        qs, ks = l2norm(qs), l2norm(ks)
    qs = qs * scale
    # [N, H, C, chunk, ...]
    C = L // GDN_CHUNK
    qs, ks, vs = (x.permute(0, 2, 1, 3).reshape(N, Hv, C, GDN_CHUNK, -1) for x in (qs, ks, vs))
    gs, bs = (x.permute(0, 2, 1).reshape(N, Hv, C, GDN_CHUNK) for x in (gs, bs))

    k_beta, v_beta = ks * bs[..., None], vs * bs[..., None]
    cum = gs.cumsum(-1)  # log decay from the chunk start to each position
    upper = torch.ones(GDN_CHUNK, GDN_CHUNK, dtype=torch.bool, device=dev).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # decay j -> i, i >= j
    # The WY form of the delta rule inside a chunk: a unit lower-triangular system turns the updates into matmuls.
    system = (k_beta @ ks.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (qs @ ks.transpose(-1, -2)) * pair
    q_dec = qs * cum.exp()[..., None]
    k_dec = ks * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = _initial(initial_state, initial_index, (N, Hv, K, V))
    out = torch.empty_like(new_v)
    snap_chunk = None if snapshot is None else snapshot_chunk[active][:, None, None, None]
    snap = None if snapshot is None else torch.zeros_like(state)
    for c in range(C):
        if snap is not None:  # the state before chunk c is the state at token 64 * c
            snap = torch.where(snap_chunk == c, state, snap)
        v_new = new_v[:, :, c] - k_cum[:, :, c] @ state
        out[:, :, c] = q_dec[:, :, c] @ state + intra[:, :, c] @ v_new
        state = state * chunk_decay[:, :, c] + k_dec[:, :, c].transpose(-1, -2) @ v_new

    out = out.reshape(N, Hv, L, V).permute(0, 2, 1, 3)  # [N, L, Hv, V]
    full = torch.zeros(T + 1, Hv, V, dtype=torch.float32, device=dev)
    full[out_rows.reshape(-1)] = out.reshape(-1, Hv, V)  # padding (and sub-trunk rows) land on the spare row T
    final[active] = state
    if snap is not None:
        snapshot[active] = torch.where(snap_chunk == C, state, snap)
    return full[:T].to(q.dtype), final, snapshot


def _segment_rows(sub: tuple[torch.Tensor, torch.Tensor] | None, seg_start: torch.Tensor, seg_len: torch.Tensor,
                  T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, out_rows) [N, L] of the stream rows each segment (of length > 0) runs over, L a whole number of chunks,
    and where its outputs go (T, the spare row, for padding). With `sub` (the nested question call) a leaf gathers its
    sub-trunk's rows, then its own, and only its own rows' outputs go back to the stream; chunks start at its first
    gathered row, as they would for the sequence sub-trunk + leaf. Without, rows and out_rows are the same."""
    if sub is None:
        pre = torch.zeros_like(seg_len)
    else:
        sub_lo, sub_hi = sub
        lo, hi = sub_lo[seg_start].long(), sub_hi[seg_start].long()  # a segment's range: its first token's
        pre = (hi - lo).clamp(min=0)
    longest = int((pre + seg_len).max())
    L = max(GDN_CHUNK, -(-longest // GDN_CHUNK) * GDN_CHUNK)
    pos = torch.arange(L, device=seg_start.device)[None, :]
    own = pos - pre[:, None]  # position within the segment's own rows (negative: a sub-trunk row)
    mine = (own >= 0) & (own < seg_len[:, None])
    out_rows = torch.where(mine, seg_start[:, None] + own, torch.full_like(own, T))
    if sub is None:
        return out_rows, out_rows
    return torch.where(own < 0, lo[:, None] + pos, out_rows), out_rows


def gated_delta_naive(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale: float,
                      use_qk_l2norm: bool):
    """The test oracle: one segment and one token at a time, in float64."""
    T, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    out = torch.zeros(T, Hv, V, dtype=torch.float64)
    finals = []
    for n in range(seg_start.shape[0]):
        i = int(initial_index[n])
        S = initial_state[i].double().clone() if i >= 0 else torch.zeros(Hv, K, V, dtype=torch.float64)
        for t in range(int(seg_start[n]), int(seg_start[n] + seg_len[n])):
            for h in range(Hv):
                qt, kt = q[t, h // (Hv // Hk)].double(), k[t, h // (Hv // Hk)].double()
                if use_qk_l2norm:
                    qt, kt = qt / (qt.norm() ** 2 + 1e-6).sqrt(), kt / (kt.norm() ** 2 + 1e-6).sqrt()
                S[h] = S[h] * torch.exp(g[t, h].double())
                delta = (v[t, h].double() - S[h].T @ kt) * beta[t, h].double()
                S[h] = S[h] + torch.outer(kt, delta)
                out[t, h] = S[h].T @ (qt * scale)
        finals.append(S)
    finals = torch.stack(finals).float() if finals else torch.zeros(0, Hv, K, V)
    return out.to(q.dtype), finals
