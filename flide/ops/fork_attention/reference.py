"""Fork attention in pure torch: the oracle of every fast variant, and the CPU path.

The stream holds states (trunks) and questions (branches) side by side. Token t sees key s when
    seg_lo[t] <= s <= t                      (causal inside its own segment), or
    trunk_lo[t] <= s < trunk_hi[t]           (the whole state its question forks from; empty for state tokens),
so a question sees its state and its own earlier tokens, and nothing of its siblings or of other requests.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 512  # query rows per block: bounds the score matrix at QUERY_BLOCK x T per head


def visible(seg_lo: torch.Tensor, trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, rows: torch.Tensor,
            keys: torch.Tensor) -> torch.Tensor:
    """[len(rows), len(keys)] bool: which keys each query row sees (rows and keys are stream indices)."""
    r, s = rows[:, None], keys[None, :]
    own = (s >= seg_lo[rows][:, None]) & (s <= r)
    trunk = (s >= trunk_lo[rows][:, None]) & (s < trunk_hi[rows][:, None])
    return own | trunk


def fork_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                   trunk_hi: torch.Tensor, scale: float) -> torch.Tensor:
    """
    Args:
        q: [T, Hq, D] queries; k: [T, Hkv, D] keys; v: [T, Hkv, Dv] values, Hq a multiple of Hkv (GQA: query head h
            reads key head h // (Hq // Hkv)).
        seg_lo, trunk_lo, trunk_hi: [T] int64 stream indices (see the module docstring).
        scale: the softmax scale.
    Returns: [T, Hq, Dv] in q's dtype. Scores, softmax and sums run in float32.
    """
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    group = Hq // Hkv
    out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    qf = q.float().view(T, Hkv, group, D)
    kf, vf = k.float(), v.float()
    key_lo = torch.minimum(seg_lo, torch.where(trunk_hi > trunk_lo, trunk_lo, seg_lo))
    for start in range(0, T, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        rows = torch.arange(start, stop, device=q.device)
        # Keys a block can see start at its earliest state or segment start: skip the rest of the stream.
        lo = int(key_lo[start:stop].min())
        keys = torch.arange(lo, stop, device=q.device)
        mask = visible(seg_lo, trunk_lo, trunk_hi, rows, keys)  # [R, S]
        scores = torch.einsum("rhgd,shd->hgrs", qf[start:stop], kf[lo:stop]) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:stop] = torch.einsum("hgrs,shd->rhgd", probs, vf[lo:stop]).reshape(stop - start, Hq, Dv).to(q.dtype)
    return out


def fork_attention_naive(q, k, v, seg_lo, trunk_lo, trunk_hi, scale: float) -> torch.Tensor:
    """The test oracle of the oracle: one query at a time, its keys listed explicitly, plain float64 softmax."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(T, Hq, v.shape[2], dtype=torch.float64)
    for t in range(T):
        keys = list(range(int(trunk_lo[t]), int(trunk_hi[t]))) + list(range(int(seg_lo[t]), t + 1))
        kk, vv = k[keys].double(), v[keys].double()
        for h in range(Hq):
            w = torch.softmax((kk[:, h // group] @ q[t, h].double()) * scale, dim=0)
            out[t, h] = w @ vv[:, h // group]
    return out.to(q.dtype)
