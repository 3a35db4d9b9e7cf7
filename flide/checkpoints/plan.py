"""One round's checkpoint work: which states resume from a saved checkpoint, which save one, and the metadata and
per-layer hand-off the mixers read during the forward pass (`FlatContext.checkpoint`).

Decided when the round is built (not when its requests were prepared), so a request sent right after the one that
saved already resumes. A resumed state's segment holds only its tokens from m on (positions from m); every token of
it and of its questions also sees the checkpoint's keys (attention), starts its conv window from the checkpoint's
last inputs, and the state's recurrence starts from the checkpoint's float32 state (Gated DeltaNet). A state saves
at m = the largest multiple of 64 <= its length - margin: the attention layers copy their keys and values before m,
the Gated DeltaNet layers their state at chunk m (a snapshot of the state call) and the conv inputs before m. The
saves go into the cache after the forward pass, so nothing of this round's own saves is read by this round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import GDN_CHUNK, CheckpointConfig
from ..requests import PreparedRequest
from ..round import RequestLayout, Round
from .cache import Checkpoint, CheckpointCache, Segments


@dataclass
class _Trunk:
    request: int
    trunk: int
    tokens: np.ndarray
    hashes: list[bytes]
    resume: Checkpoint | None = None  # resumed at resume.length tokens
    save_at: int = 0  # 0: no save
    row: int = -1  # its state row in the round

    @property
    def skip(self) -> int:
        return self.resume.length if self.resume is not None else 0


class RoundCheckpoints:
    """The checkpoint work of one round of `requests` (see the module docstring). `ops`: the resumable companions
    of the configured kernels (`flide.ops.registry.resumable`). After `bind(round_, device)`, `layer(i)` is what
    decoder layer i reads and writes; `store()` puts the saves into the cache after the forward pass."""

    def __init__(self, cache: CheckpointCache, config: CheckpointConfig, ops: dict, requests: list[PreparedRequest]):
        self.cache, self.ops = cache, ops
        self.trunks: list[_Trunk] = []
        self.resumed: list[Checkpoint] = []  # each once, in the order of their prefix rows
        self.skips: list[list[int]] = []
        saving: set[tuple[int, bytes]] = set()
        for r, request in enumerate(requests):
            skips = []
            limits = _read_limits(request)
            for t, tokens in enumerate(request.trunks):
                n = len(tokens)
                work = _Trunk(r, t, tokens, request.trunk_hashes[t] if n > GDN_CHUNK else [])
                if n > GDN_CHUNK:  # the shortest checkpoint is 64 tokens, and a resumed segment keeps one at least
                    work.resume = cache.lookup(tokens, work.hashes, min(n - 1, limits.get(t, n)))
                m = (n - config.margin_tokens) // GDN_CHUNK * GDN_CHUNK
                if n >= config.min_state_tokens and m >= GDN_CHUNK and m > work.skip:
                    key = (m, work.hashes[m // GDN_CHUNK - 1])
                    if key not in saving and not cache.contains(tokens, work.hashes, m):
                        saving.add(key)
                        work.save_at = m
                if work.resume is not None and all(work.resume is not e for e in self.resumed):
                    self.resumed.append(work.resume)
                skips.append(work.skip)
                self.trunks.append(work)
            self.skips.append(skips)
        self.saves = [w for w in self.trunks if w.save_at]
        self.cached_tokens = [sum(s) for s in self.skips]  # per request: state tokens not computed
        self._saved: dict[int, list] = {}

    @property
    def empty(self) -> bool:
        """Nothing to resume or save: the round runs as without checkpoints (a captured graph may run it)."""
        return not self.resumed and not self.saves

    def layouts(self, requests: list[PreparedRequest]) -> list[RequestLayout]:
        """Each request's part of the round, with its resumed tokens skipped."""
        return [RequestLayout(p, skips) if any(skips) else p.round_layout for p, skips in zip(requests, self.skips)]

    def bind(self, round_: Round, device: torch.device) -> None:
        """The round's checkpoint metadata, from its layout: per token the prefix rows it sees and the conv window it
        continues; per state the checkpoint it starts from and the chunk at which it snapshots."""
        r = round_.tensors
        state_len, branch_len = r.state_len.numpy(), r.branch_len.numpy()
        branch_state = r.branch_state.numpy()
        NS, T = len(state_len), len(r.seg_lo)
        rows = np.cumsum([0] + [len(s) for s in self.skips])
        for w in self.trunks:
            w.row = int(rows[w.request]) + w.trunk
        index = {id(e): p for p, e in enumerate(self.resumed)}
        lengths = [e.length for e in self.resumed]
        offsets = np.cumsum([0] + lengths)
        state_p = np.full(NS + 1, -1, dtype=np.int64)  # row NS: tokens of no state (pads)
        snapshot = np.full(NS, -1, dtype=np.int64)
        for w in self.trunks:
            if w.resume is not None:
                state_p[w.row] = index[id(w.resume)]
            if w.save_at:
                snapshot[w.row] = (w.save_at - w.skip) // GDN_CHUNK
        ns_tok, nq_tok = int(state_len.sum()), int(branch_len.sum())
        token_state = np.full(T, NS, dtype=np.int64)
        token_state[:ns_tok] = np.repeat(np.arange(NS), state_len)
        token_state[ns_tok: ns_tok + nq_tok] = np.repeat(branch_state, branch_len)
        p = state_p[token_state]
        has = p >= 0
        pre_lo = np.where(has, offsets[np.maximum(p, 0)], 0)
        pre_hi = np.where(has, pre_lo + np.asarray(lengths + [0])[np.maximum(p, 0)], 0)
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
        self.pre_lo, self.pre_hi, self.win_index = as_tensor(pre_lo), as_tensor(pre_hi), as_tensor(p)
        self.initial_index, self.snapshot_chunk = as_tensor(state_p[:NS]), as_tensor(snapshot)
        self.state_start = r.state_start.numpy().copy()
        self.device = device
        self._saved = {k: [] for k in range(len(self.saves))}

    def layer(self, index: int) -> "LayerCheckpoint":
        return LayerCheckpoint(self, index)

    def store(self) -> None:
        """The round's saves into the cache (after its forward pass, every layer having written its part)."""
        for k, w in enumerate(self.saves):
            layers = self._saved.get(k)
            if layers is None:
                continue
            m = w.save_at
            self.cache.put(Checkpoint(np.array(w.tokens[:m], dtype=np.int64), layers), w.hashes[m // GDN_CHUNK - 1])


class LayerCheckpoint:
    """What decoder layer `index` reads from the round's resumed checkpoints and writes for its saves."""

    def __init__(self, work: RoundCheckpoints, index: int):
        self.work, self.index = work, index

    @property
    def resumes(self) -> bool:
        return bool(self.work.resumed)

    # attention
    def prefix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [P, Hkv, D], values [P, Hkv, Dv]) of every resumed checkpoint, in prefix-row order."""
        pairs = [e.layers[self.index] for e in self.work.resumed]
        return (torch.cat([part for k, _ in pairs for part in k]), torch.cat([part for _, v in pairs for part in v]))

    def save_attention(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [T, Hkv, D] of the stream -> each save's keys before its m: a resumed state's checkpoint
        segments (shared, not copied), then its own new rows."""
        work = self.work
        for n, w in enumerate(work.saves):
            start, length = int(work.state_start[w.row]), w.save_at - w.skip
            ks, vs = (k[start: start + length].clone(),), (v[start: start + length].clone(),)
            if w.resume is not None:
                ck, cv = w.resume.layers[self.index]
                ks, vs = tuple(ck) + ks, tuple(cv) + vs
            work._saved[n].append((Segments(ks), Segments(vs)))

    # Gated DeltaNet
    def window(self) -> torch.Tensor:
        """[P, W-1, D] conv windows of the resumed checkpoints."""
        return torch.stack([e.layers[self.index][1] for e in self.work.resumed])

    def initial_state(self, shape: tuple[int, ...]) -> torch.Tensor:
        """[P, Hv, K, V] float32 recurrent states of the resumed checkpoints ([0, ...] when none)."""
        if not self.work.resumed:
            return torch.zeros((0, *shape), dtype=torch.float32, device=self.work.device)
        return torch.stack([e.layers[self.index][0] for e in self.work.resumed])

    def save_gdn(self, conv_in: torch.Tensor, snapshot: torch.Tensor, width: int) -> None:
        """Conv inputs [T, D] and the state call's snapshots [NS, Hv, K, V] -> each save's state and conv window."""
        work = self.work
        for n, w in enumerate(work.saves):
            end = int(work.state_start[w.row]) + w.save_at - w.skip  # >= 64 tokens into the segment: all in stream
            work._saved[n].append((snapshot[w.row].clone(), conv_in[end - (width - 1): end].clone()))


def resumable_tokens(cache: CheckpointCache, request: PreparedRequest) -> int:
    """State tokens of `request` that a round built now would resume from `cache` instead of computing (what
    `RoundCheckpoints` would skip): planning packs rounds by what they will compute, so agents' steps whose long
    histories resume share a round instead of each running alone as larger than every bucket."""
    limits, skipped = _read_limits(request), 0
    for t, tokens in enumerate(request.trunks):
        n = len(tokens)
        if n > GDN_CHUNK:
            skipped += cache.peek(tokens, request.trunk_hashes[t], min(n - 1, limits.get(t, n)))
    return skipped


def _read_limits(request: PreparedRequest) -> dict[int, int]:
    """trunk -> its earliest read inside the trunk (a checkpoint must not skip a read): templates that mark before
    the question."""
    limits: dict[int, int] = {}
    for branch in request.branches:
        n = len(request.trunks[branch.trunk])
        for pos in np.asarray(branch.reads).tolist():
            if pos < n:
                limits[branch.trunk] = min(limits.get(branch.trunk, n), int(pos))
    return limits
