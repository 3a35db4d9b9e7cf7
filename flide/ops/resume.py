"""Checkpoint companions for any plain op variant (flide/checkpoints): resume and snapshot through the plain kernel.

A round that resumes a state from a checkpoint holds only the state's tokens from m on; the checkpoint supplies
what came before: attention keys and values of tokens [0, m), the last W-1 conv inputs before m, and the fp32
recurrent state at m. The reference variants take these as extra inputs (`fork_attention_prefix_reference`, ...), and
so do the CUDA defaults' own kernels since session 10 (the invariant attention's prefix phase, the Triton conv's
windows: their companions are registered beside them, no extended stream). The other fast variants (flex, the plain
Triton attention, fla) do not, and need not: rounds with checkpoint work run eagerly, so a companion here may look
at the metadata on the host and hand the plain kernel an *extended stream* in which the missing rows are present
again.

- Attention: each resumed state's prefix keys/values are inserted into the stream right before its segment, and the
  segment (and its questions' trunk) is widened to start there. A state token then sees [prefix, own causal rows],
  a question [prefix + state, own rows]: exactly the keys the reference companion scores, in the same order. The
  inserted rows' own queries see only themselves (zeros, cheap) and their outputs are dropped.
- Conv: the same with the checkpoint's W-1 window rows: the state's first tokens then read them as the inputs
  before their segment, as the reference companion does.
- Gated delta: initial states are the plain op's own `initial_state`/`initial_index`. A snapshot at chunk c of a
  state is the final state of the state's first 64 c tokens: call 1 runs every state as two sequences (the part
  before its snapshot, then the rest, which restarts from zero there and is dropped), call 2 runs the rests again,
  gathered into a short stream, from call 1's snapshots. The rests are a margin of ~64-128 tokens per state, so the
  extra work is small, and every state is read in fp32 from `output_final_state` (fla's per-chunk states `h` are
  kept in the input dtype, too coarse for a checkpoint).

Every companion has the signature of the reference one it replaces (`registry.register_resumable`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch

from ..config import GDN_CHUNK

PAD_TO = 256  # extended streams are padded to a multiple of this: fewer distinct shapes for per-shape kernels (flex)


_SCOPE = threading.local()  # .entries: {(memo, tables, extra) ids: entry} of the forward pass running in this thread


@contextmanager
def per_round_tables():
    """Scope of one forward pass over one round: inside it companions derive their round tables once (`PerRound`);
    outside it (a companion called on its own) they derive them on every call. Entered by `FlatModel.forward` for
    rounds with checkpoint work."""
    outer = getattr(_SCOPE, "entries", None)
    _SCOPE.entries = {}
    try:
        yield
    finally:
        _SCOPE.entries = outer


class PerRound:
    """What a companion derives from its round's tables (layouts, indices, host syncs), kept for the next layer.

    Every layer of one forward passes the same table tensors (the round's, bound once), so inside
    `per_round_tables` the derivation runs once per round instead of once per layer. On the H200 a resumed agent
    step of 0.8B took ~150 ms more than its GPU work, on the host; its cProfile (benchmarks/profile_agent_steps.py)
    showed these per-layer derivations among the costs, with a host sync or more each.
    Keyed by the tables' identity (the entry holds them, so their ids cannot be reused while it lives; a companion
    with two calls a layer, as the gated delta snapshot, keeps an entry for each) and, where tensors track one, by
    their version counters (inference tensors do not: the scope, one forward pass in which
    nothing writes the tables, is what makes the entry valid)."""

    def get(self, tables: tuple[torch.Tensor, ...], extra, derive: Callable):
        entries = getattr(_SCOPE, "entries", None)
        if entries is None:
            return derive()
        key = (id(self), tuple(id(t) for t in tables), extra)
        versions = tuple(0 if t.is_inference() else t._version for t in tables)
        entry = entries.get(key)
        if entry is not None and entry[1] == versions:
            return entry[2]
        value = derive()
        entries[key] = (tables, versions, value)  # holding the tables keeps their ids from being reused
        return value


def _extend(seg_lo: torch.Tensor, trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, starts: list[int],
            lengths: list[int]):
    """The metadata of the stream with `lengths[j]` rows inserted right before stream row `starts[j]` (sorted, one
    per resumed state: its segment start), each state's segment and its questions' trunks widened over its inserted
    rows. Returns (rows [T] new row of each old row, inserted [sum(lengths)] new row of each inserted row, in
    order, seg_lo', trunk_lo', trunk_hi' of the padded extended stream, its length)."""
    device = seg_lo.device
    T = seg_lo.shape[0]
    S = torch.tensor(starts, dtype=torch.long, device=device)
    L = torch.tensor(lengths, dtype=torch.long, device=device)
    after = L.cumsum(0)  # rows inserted up to and including block j
    t = torch.arange(T, device=device)

    def shift(x):  # rows inserted before old row x (blocks starting at or before x)
        j = torch.searchsorted(S, x, right=True) - 1
        return torch.where(j >= 0, after[j.clamp(min=0)], torch.zeros_like(x))

    def widened(lo):  # lo is a block's start: the block's first inserted row; else lo mapped
        j = torch.searchsorted(S, lo, right=True) - 1
        hit = (j >= 0) & (S[j.clamp(min=0)] == lo)
        return lo + shift(lo) - torch.where(hit, L[j.clamp(min=0)], torch.zeros_like(lo))

    rows = t + shift(t)
    total = T + int(after[-1]) if lengths else T
    padded = -(-total // PAD_TO) * PAD_TO
    new_seg = torch.arange(padded, device=device)  # inserted rows and pads see only themselves
    new_lo = torch.zeros(padded, dtype=torch.long, device=device)
    new_hi = torch.zeros(padded, dtype=torch.long, device=device)
    has_trunk = trunk_hi > trunk_lo
    new_seg[rows] = widened(seg_lo)
    new_lo[rows] = torch.where(has_trunk, widened(trunk_lo), torch.zeros_like(trunk_lo))
    # the trunk's end: one past its last row (mapping trunk_hi itself would count a block inserted right after it)
    new_hi[rows] = torch.where(has_trunk, (trunk_hi - 1) + shift(trunk_hi - 1) + 1, torch.zeros_like(trunk_hi))
    block_first = S + after - L  # new row of each block's first inserted row
    inserted = torch.cat([torch.arange(int(f), int(f) + int(n), device=device)
                          for f, n in zip(block_first.tolist(), lengths)]) if lengths else S
    return rows, inserted, new_seg, new_lo, new_hi, padded


def _resumed_starts(seg_lo: torch.Tensor, trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, resumed: torch.Tensor):
    """The segment starts of the resumed states (`resumed`: a [T] bool of tokens of resumed states and their
    questions), in order, and one state token of each (host sync)."""
    state_token = resumed & ~(trunk_hi > trunk_lo)
    starts, first = torch.unique(seg_lo[state_token], return_inverse=True)
    tokens = torch.nonzero(state_token).flatten()
    # int64 like `tokens` (scatter_ takes its source's dtype), whatever seg_lo's dtype (a round's is int32)
    one = tokens.new_empty(starts.shape).scatter_(0, first, tokens)
    return starts.tolist(), one


def attention_with_prefix(op: Callable) -> Callable:
    """The `fork_attention_prefix` companion built on a plain fork attention variant `op`."""

    memo = PerRound()

    def derive(seg_lo, trunk_lo, trunk_hi, pre_lo, pre_hi):
        resumed = pre_hi > pre_lo
        if not bool(resumed.any()):
            return None
        starts, token = _resumed_starts(seg_lo, trunk_lo, trunk_hi, resumed)
        spans = torch.stack([pre_lo[token], pre_hi[token]], 1).tolist()
        extended = _extend(seg_lo, trunk_lo, trunk_hi, starts, [hi - lo for lo, hi in spans])
        prefix = torch.cat([torch.arange(lo, hi, device=seg_lo.device) for lo, hi in spans])
        return extended, prefix

    def fork_attention_prefix(q, k, v, seg_lo, trunk_lo, trunk_hi, pk, pv, pre_lo, pre_hi, scale):
        tables = (seg_lo, trunk_lo, trunk_hi, pre_lo, pre_hi)
        derived = memo.get(tables, None, lambda: derive(*tables))
        if derived is None:
            return op(q, k, v, seg_lo, trunk_lo, trunk_hi, scale)
        (rows, inserted, new_seg, new_lo, new_hi, n), prefix = derived
        q2 = q.new_zeros(n, *q.shape[1:])
        k2, v2 = k.new_zeros(n, *k.shape[1:]), v.new_zeros(n, *v.shape[1:])
        q2[rows], k2[rows], v2[rows] = q, k, v
        k2[inserted], v2[inserted] = pk[prefix].to(k.dtype), pv[prefix].to(v.dtype)
        return op(q2, k2, v2, new_seg, new_lo, new_hi, scale)[rows]

    return fork_attention_prefix


def conv_with_window(op: Callable) -> Callable:
    """The `fork_conv_window` companion built on a plain fork conv variant `op`."""

    memo = PerRound()

    def derive(seg_lo, trunk_lo, trunk_hi, win_index, width):
        resumed = win_index >= 0
        if not bool(resumed.any()):
            return None
        starts, token = _resumed_starts(seg_lo, trunk_lo, trunk_hi, resumed)
        return _extend(seg_lo, trunk_lo, trunk_hi, starts, [width] * len(starts)), token

    def fork_conv_window(x, weight, seg_lo, trunk_lo, trunk_hi, window, win_index, silu):
        tables, width = (seg_lo, trunk_lo, trunk_hi, win_index), window.shape[1]  # W - 1
        derived = memo.get(tables, width, lambda: derive(*tables, width))
        if derived is None:
            return op(x, weight, seg_lo, trunk_lo, trunk_hi, silu)
        (rows, inserted, new_seg, new_lo, new_hi, n), token = derived
        x2 = x.new_zeros(n, x.shape[1])
        x2[rows] = x
        x2[inserted] = window[win_index[token]].reshape(-1, x.shape[1]).to(x.dtype)
        return op(x2, weight, new_seg, new_lo, new_hi, silu)[rows]

    return fork_conv_window


def gated_delta_with_snapshot(op: Callable, rest: Callable | None = None, short: Callable | None = None,
                              short_tokens: int = 0) -> Callable:
    """The `gated_delta_snapshot` companion built on a plain gated delta variant `op` (the level-major contract:
    the segments of a call contiguous and in stream order, unused rows last). `rest`: what re-runs the states' rests
    from their snapshots (same signature and results as `op`; default `op`): short segments, where one launch of a
    recurrent kernel beats a chunked call's several.

    `short` (with `short_tokens` > 0): what runs whole every state that has at most `short_tokens` tokens before its
    snapshot, snapshot included (`branches.segments_with_snapshot`'s signature: the segments, their initial states
    and the tokens before each snapshot -> (o, final, snapshot)); `op` is then called only when some state of the
    round is longer. Why: a resumed agent step computes a few hundred new tokens per state; in its eager round fla's
    chunked call and the rests' re-run cost ~1-2 ms of host time per GDN layer (Python wrappers, autotuner
    look-ups, a host sync, gathers) for ~50 us of GPU work, while the recurrent kernel takes one launch and ~1 us a
    token. The choice is made per state from its own length, so a state's bits do not depend on what else is in its
    round (in `op`'s call such a state's rows are computed from zero as a dropped part, and overwritten)."""
    rerun = rest or op
    short_tokens = short_tokens if short is not None else 0
    memo = PerRound()

    def derive(seg_start, seg_len, initial_index, snapshot_chunk):
        snap = snapshot_chunk >= 0
        before = torch.where(snap, torch.minimum(snapshot_chunk * GDN_CHUNK, seg_len), seg_len)
        rest = seg_len - before
        is_short = before <= short_tokens if short_tokens > 0 else torch.zeros_like(snap)
        call1 = short_call = call2 = None
        if is_short.numel() == 0 or not bool(is_short.all()):  # (no segment at all: the op's own empty call)
            # call 1: each segment as [before its snapshot][the rest, from zero: dropped]; a short state's whole
            # segment is the dropped part (its rows come from the short call)
            lead = torch.where(is_short, torch.zeros_like(before), before)
            call1 = (torch.stack([seg_start, seg_start + lead], 1).flatten(),
                     torch.stack([lead, seg_len - lead], 1).flatten(),
                     torch.stack([initial_index, torch.full_like(initial_index, -1)], 1).flatten())
        if bool(is_short.any()):
            which = torch.nonzero(is_short).flatten()
            spans = torch.stack([seg_start[which], seg_len[which]], 1).tolist()
            rows = torch.cat([torch.arange(a, a + n, device=seg_start.device) for a, n in spans])
            short_call = (which, seg_start[which], seg_len[which], initial_index[which], before[which], rows)
        tails = torch.nonzero((rest > 0) & ~is_short).flatten()
        if tails.numel():
            # call 2: the long states' rests again, gathered into a short stream, from their snapshots
            spans = torch.stack([seg_start[tails] + before[tails], rest[tails]], 1).tolist()
            rows = torch.cat([torch.arange(a, a + n, device=seg_start.device) for a, n in spans])
            tail_len = rest[tails]
            call2 = (tails, rows, tail_len.cumsum(0) - tail_len, tail_len,
                     torch.arange(tails.numel(), device=seg_start.device))
        return snap, call1, short_call, call2

    def gated_delta_snapshot(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, snapshot_chunk,
                             scale, use_qk_l2norm):
        tables = (seg_start, seg_len, initial_index, snapshot_chunk)
        snap, call1, short_call, call2 = memo.get(tables, None, lambda: derive(*tables))
        o = at_snapshot = final = None
        if call1 is not None:
            starts1, lens1, index1 = call1
            o, final1 = op(q, k, v, g, beta, starts1, lens1, initial_state, index1, scale, use_qk_l2norm)
            at_snapshot = final1[0::2]  # the state after `before` tokens: the snapshot, or the final state
            final = at_snapshot.clone()  # the long states' rests update it (call 2)
        if short_call is not None:
            which, starts, lens, index, before, rows = short_call
            o_short, final_short, snap_short = short(q, k, v, g, beta, starts, lens, initial_state, index, before,
                                                     scale, use_qk_l2norm)
            if o is None:  # every state short: `which` is every segment, in order
                o, at_snapshot, final = o_short, snap_short, final_short
            else:
                o = o.clone()
                o[rows] = o_short[rows]
                at_snapshot = at_snapshot.clone()
                at_snapshot[which], final[which] = snap_short, final_short
        snapshot = torch.where(snap[:, None, None, None], at_snapshot, torch.zeros_like(at_snapshot))
        if call2 is not None:
            tails, rows, tail_start, tail_len, index2 = call2
            o2, final2 = rerun(q[rows], k[rows], v[rows], g[rows], beta[rows], tail_start, tail_len,
                               at_snapshot[tails], index2, scale, use_qk_l2norm)
            o = o.clone()
            o[rows] = o2
            final[tails] = final2
        return o, final, snapshot

    return gated_delta_snapshot


__all__ = ["attention_with_prefix", "conv_with_window", "gated_delta_with_snapshot", "per_round_tables"]
