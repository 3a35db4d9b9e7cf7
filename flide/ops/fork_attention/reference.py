"""Fork attention in pure torch: the oracle of every fast variant, and the CPU path.

The stream holds states (trunks) and questions (branches) side by side. Token t sees key s when
    seg_lo[t] <= s <= t                      (causal inside its own segment), or
    trunk_lo[t] <= s < trunk_hi[t]           (the whole state its question forks from; empty for state tokens),
so a question sees its state and its own earlier tokens, and nothing of its siblings or of other requests.

Nested forks (`runtime.nested_forks`) add a third range per token: a leaf question continues a *sub-trunk* (a question
line that several questions share, computed once in the stream as its own segment) and also sees
    sub_lo[t] <= s < sub_hi[t]               (the whole sub-trunk segment; empty, sub_hi <= sub_lo, for other tokens),
which lies outside the token's state and its own segment (before or after it in the stream). `sub_lo=None`: no
token has one.

`fork_attention_prefix` adds the keys of checkpoints (flide/checkpoints): a state resumed at m holds only its tokens
from m on in the stream; its first m keys and values come from the checkpoint, in extra rows `pk`/`pv`, and every
token of that state and of its questions also sees the prefix rows `[pre_lo[t], pre_hi[t])`.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 512  # query rows per block: bounds the score matrix at QUERY_BLOCK x T per head


def visible(seg_lo: torch.Tensor, trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, rows: torch.Tensor,
            keys: torch.Tensor, sub_lo: torch.Tensor | None = None, sub_hi: torch.Tensor | None = None) -> torch.Tensor:
    """[len(rows), len(keys)] bool: which keys each query row sees (rows and keys are stream indices)."""
    r, s = rows[:, None], keys[None, :]
    own = (s >= seg_lo[rows][:, None]) & (s <= r)
    trunk = (s >= trunk_lo[rows][:, None]) & (s < trunk_hi[rows][:, None])
    if sub_lo is None:
        return own | trunk
    sub = (s >= sub_lo[rows][:, None]) & (s < sub_hi[rows][:, None])
    return own | trunk | sub


def fork_attention_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                          trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                          pre_lo: torch.Tensor, pre_hi: torch.Tensor, scale: float) -> torch.Tensor:
    """`fork_attention` with cached prefix keys: pk [P, Hkv, D], pv [P, Hkv, Dv] (the checkpoints a round resumes
    from, concatenated), and per token the prefix rows it sees, `[pre_lo[t], pre_hi[t])` (empty: none). The prefix
    rows precede the stream's in every query's key list, as they precede them in the sequence."""
    T = q.shape[0]
    keys, values = torch.cat([k, pk.to(k.dtype)]), torch.cat([v, pv.to(v.dtype)])
    return _attend(q, keys, values, seg_lo, trunk_lo, trunk_hi, pre_lo + T, pre_hi + T, scale)


def fork_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                   trunk_hi: torch.Tensor, scale: float, sub_lo: torch.Tensor | None = None,
                   sub_hi: torch.Tensor | None = None) -> torch.Tensor:
    """
    Args:
        q: [T, Hq, D] queries; k: [T, Hkv, D] keys; v: [T, Hkv, Dv] values, Hq a multiple of Hkv (GQA: query head h
            reads key head h // (Hq // Hkv)).
        seg_lo, trunk_lo, trunk_hi: [T] int32 (a round's) or int64 stream indices (see the module docstring).
        scale: the softmax scale.
        sub_lo, sub_hi: [T] (both or neither): each leaf token's sub-trunk range (nested forks); None: none.
    Returns: [T, Hq, Dv] in q's dtype. Scores, softmax and sums run in float32.
    """
    return _attend(q, k, v, seg_lo, trunk_lo, trunk_hi, None, None, scale, sub_lo, sub_hi)


def _attend(q, k, v, seg_lo, trunk_lo, trunk_hi, pre_lo, pre_hi, scale: float, sub_lo=None,
            sub_hi=None) -> torch.Tensor:
    """Fork attention over key rows k/v (the stream's T rows, then any extra rows a query reaches through
    [pre_lo, pre_hi), or None); sub_lo / sub_hi: the stream rows a leaf's sub-trunk adds, or None."""
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    group = Hq // Hkv
    out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    qf = q.float().view(T, Hkv, group, D)
    kf, vf = k.float(), v.float()
    for start in range(0, T, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        rows = torch.arange(start, stop, device=q.device)
        keys = _block_keys(seg_lo[start:stop], trunk_lo[start:stop], trunk_hi[start:stop], stop)
        # a sub-trunk may lie outside the block's keys (after its rows, say). Then the block's other rows are scored
        # over the longer list too: the same values, but their sums may round differently than without sub ranges
        if sub_lo is not None:
            keys = torch.cat([keys, _spans(sub_lo[start:stop], sub_hi[start:stop], q.device)]).unique()
        mask = visible(seg_lo, trunk_lo, trunk_hi, rows, keys, sub_lo, sub_hi)  # [R, S]
        if pre_lo is not None:
            extra = _spans(pre_lo[start:stop], pre_hi[start:stop], seg_lo.device)
            if extra.numel():
                keys = torch.cat([extra, keys])
                lo, hi = pre_lo[rows][:, None], pre_hi[rows][:, None]
                mask = torch.cat([(extra[None, :] >= lo) & (extra[None, :] < hi), mask], dim=1)
        scores = torch.einsum("rhgd,shd->hgrs", qf[start:stop], kf[keys]) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:stop] = torch.einsum("hgrs,shd->rhgd", probs, vf[keys]).reshape(stop - start, Hq, Dv).to(q.dtype)
    return out


def fork_attention_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor,
                            trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, scale: float,
                            sub_lo: torch.Tensor | None = None, sub_hi: torch.Tensor | None = None) -> torch.Tensor:
    """`fork_attention`, batch-invariant: each segment (a state, a question) is computed on its own, over exactly
    its keys (its trunk's, then its sub-trunk's for a leaf of a nested fork, then its own), with the same shapes as
    when its request is laid out alone, so its rows have the same bits whatever else is in the stream.
    (`fork_attention`'s query blocks of 512 mix segments and size their key lists from the block, so a row's softmax
    and sums run over other spans there.) Pure torch, with host syncs: the CPU path of batch-invariant mode.

    Segments are read from the metadata: a segment starts where `seg_lo[t] == t`, and its trunk and sub-trunk ranges
    are its first token's. A one-token segment that forks from nothing (a pad, a one-token state) sees only itself:
    its output is its value row, as the softmax of one score is exactly 1."""
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    group = Hq // Hkv
    rows = torch.arange(T, device=q.device)
    starts = (seg_lo == rows).nonzero().flatten().tolist()
    ends = starts[1:] + [T]
    out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    single = (torch.tensor(ends, device=q.device) - torch.tensor(starts, device=q.device) == 1)
    lone = torch.tensor(starts, device=q.device, dtype=torch.long)[single]
    lone = lone[trunk_hi[lone] <= trunk_lo[lone]]
    if sub_lo is not None:
        lone = lone[sub_hi[lone] <= sub_lo[lone]]
    out[lone] = v[lone].repeat_interleave(group, dim=1).to(q.dtype)
    done = set(lone.tolist())
    bounds = torch.stack([trunk_lo[starts], trunk_hi[starts]], 1).tolist() if starts else []
    subs = (torch.stack([sub_lo[starts], sub_hi[starts]], 1).tolist() if sub_lo is not None and starts
            else [(0, 0)] * len(starts))
    for start, end, trunk, sub in zip(starts, ends, bounds, subs):
        if start in done:
            continue
        keys = torch.cat([_range(*trunk, q.device), _range(*sub, q.device), torch.arange(start, end, device=q.device)])
        n, m = end - start, keys.numel() - (end - start)  # m: the keys every row sees (trunk + sub-trunk)
        qf = q[start:end].float().view(n, Hkv, group, D)
        scores = torch.einsum("rhgd,shd->hgrs", qf, k[keys].float()) * scale  # [Hkv, group, n, m + n]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        mask = torch.cat([causal.new_ones(n, m), causal], dim=1)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hgrs,shd->rhgd", probs, v[keys].float()).reshape(n, Hq, Dv).to(q.dtype)
    return out


def _range(lo: int, hi: int, device) -> torch.Tensor:
    """The stream rows [lo, hi) (none where hi <= lo)."""
    return torch.arange(lo, max(lo, hi), device=device)


def _block_keys(seg_lo: torch.Tensor, trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, stop: int) -> torch.Tensor:
    """The keys some row of a query block may see: the states its questions fork from, and the stream from its
    earliest own segment start to its end. Only these are scored (the reference may sync with the host)."""
    spans = {(int(lo), int(hi)) for lo, hi in torch.stack([trunk_lo, trunk_hi], 1).unique(dim=0).tolist() if hi > lo}
    own_lo = int(seg_lo.min())
    parts = [torch.arange(lo, min(hi, own_lo), device=seg_lo.device) for lo, hi in sorted(spans) if lo < own_lo]
    parts.append(torch.arange(own_lo, stop, device=seg_lo.device))
    return torch.cat(parts).unique()


def _spans(lo: torch.Tensor, hi: torch.Tensor, device) -> torch.Tensor:
    """The rows of the union of the non-empty ranges [lo, hi) (host sync: reference only)."""
    spans = {(int(a), int(b)) for a, b in torch.stack([lo, hi], 1).unique(dim=0).tolist() if b > a}
    parts = [torch.arange(a, b, device=device) for a, b in sorted(spans)]
    return torch.cat(parts).unique() if parts else torch.zeros(0, dtype=torch.long, device=device)


def fork_attention_naive(q, k, v, seg_lo, trunk_lo, trunk_hi, scale: float, pk=None, pv=None, pre_lo=None,
                         pre_hi=None, sub_lo=None, sub_hi=None) -> torch.Tensor:
    """The test oracle of the oracle: one query at a time, its keys listed explicitly, plain float64 softmax (with
    `pk`...`pre_hi`: the prefix rows first, as `fork_attention_prefix`; with `sub_lo` / `sub_hi`: a leaf's
    sub-trunk rows between its trunk's and its own)."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(T, Hq, v.shape[2], dtype=torch.float64)
    if pk is not None:
        k, v = torch.cat([k, pk]), torch.cat([v, pv])
    for t in range(T):
        keys = [] if pk is None else list(range(T + int(pre_lo[t]), T + int(pre_hi[t])))
        keys += list(range(int(trunk_lo[t]), int(trunk_hi[t])))
        keys += [] if sub_lo is None else list(range(int(sub_lo[t]), int(sub_hi[t])))
        keys += list(range(int(seg_lo[t]), t + 1))
        kk, vv = k[keys].double(), v[keys].double()
        for h in range(Hq):
            w = torch.softmax((kk[:, h // group] @ q[t, h].double()) * scale, dim=0)
            out[t, h] = w @ vv[:, h // group]
    return out.to(q.dtype)
