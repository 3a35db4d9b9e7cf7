"""The checkpoint cache: saved states of long prompts, found again by token prefix.

Keys are (m, hash of tokens[:m]) with m a multiple of 64: hashes are chained block by block (`prefix_hashes`), so
every block-aligned prefix of a new state is hashed in one pass over its tokens, however many lengths are saved.
A hash only narrows the search: an entry is used only when its stored tokens equal the prefix (a collision then
misses, it never resumes from the wrong tokens). Least recently used entries go first when the byte budget is
exceeded; an entry larger than the whole budget is not kept. Bytes count each tensor once however many entries
share it (`Segments`): evicting an entry frees only what no other entry holds. All methods take one lock (prepare
threads and the model thread may share the cache).
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import GDN_CHUNK


def prefix_hashes(tokens: np.ndarray) -> list[bytes]:
    """h[j] identifies tokens[: 64 * (j + 1)]: blake2b of h[j - 1] and block j's int64 bytes (chained, so one pass
    hashes every block-aligned prefix)."""
    t = np.ascontiguousarray(tokens, dtype=np.int64)
    out, h = [], b""
    for j in range(len(t) // GDN_CHUNK):
        h = hashlib.blake2b(h + t[j * GDN_CHUNK:(j + 1) * GDN_CHUNK].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


class Segments(tuple):
    """A tensor kept as row segments: the attention keys (or values) of a checkpoint that extends an earlier one hold
    the earlier one's segments (the same tensors) plus their own new rows, so an agent's chain of checkpoints stores
    its history's keys once, not once per step."""


@dataclass
class Checkpoint:
    """The state of a prompt prefix of `length` tokens: per decoder layer, attention (keys [m, Hkv, D], values
    [m, Hkv, Dv] as `Segments`) in the model's dtype, or Gated DeltaNet (recurrent state [Hv, K, V] float32, conv
    window: the last W-1 conv inputs before m, [W-1, D])."""

    tokens: np.ndarray  # [m] int64, verified on every lookup
    layers: list[tuple[torch.Tensor | Segments, torch.Tensor | Segments]]
    nbytes: int = field(init=False)  # every tensor it holds, shared or not

    def __post_init__(self):
        self.nbytes = int(self.tokens.nbytes) + sum(_nbytes(t) for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds, once each (segments flattened)."""
        out, seen = [], set()
        for pair in self.layers:
            for part in pair:
                for t in (part if isinstance(part, Segments) else (part,)):
                    if id(t) not in seen:
                        seen.add(id(t))
                        out.append(t)
        return out

    @property
    def length(self) -> int:
        return len(self.tokens)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CheckpointCache:
    """LRU cache of `Checkpoint`s under a byte budget, with counters for the metrics."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[tuple[int, bytes], Checkpoint] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # saved lengths: a lookup tries these, longest first
        self._held: dict[int, list] = {}  # id(tensor) -> [entries holding it, its bytes] (ids: the entries keep it alive)
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.stores = self.evictions = self.rejected = self.collisions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "budget_bytes": self.budget_bytes,
                    "hits": self.hits, "misses": self.misses, "stores": self.stores, "evictions": self.evictions,
                    "rejected": self.rejected, "collisions": self.collisions}

    def lookup(self, tokens: np.ndarray, hashes: list[bytes], max_length: int) -> Checkpoint | None:
        """The longest saved prefix of `tokens` no longer than `max_length` (`hashes` = `prefix_hashes(tokens)`),
        marked as recently used; None when there is none. Counts a hit or a miss."""
        with self._lock:
            for m in sorted((m for m in self._lengths if m <= max_length), reverse=True):
                entry = self._entries.get((m, hashes[m // GDN_CHUNK - 1]))
                if entry is None:
                    continue
                if not np.array_equal(entry.tokens, tokens[:m]):
                    self.collisions += 1  # same hash, other tokens: never resume from it
                    continue
                self._entries.move_to_end((m, hashes[m // GDN_CHUNK - 1]))
                self.hits += 1
                return entry
            self.misses += 1
            return None

    def peek(self, tokens: np.ndarray, hashes: list[bytes], max_length: int) -> int:
        """The length of the longest saved (verified) prefix of `tokens` no longer than `max_length`, 0 when none,
        without counting or touching the LRU order: what planning a round expects `lookup` to resume."""
        with self._lock:
            for m in sorted((m for m in self._lengths if m <= max_length), reverse=True):
                entry = self._entries.get((m, hashes[m // GDN_CHUNK - 1]))
                if entry is not None and np.array_equal(entry.tokens, tokens[:m]):
                    return m
            return 0

    def contains(self, tokens: np.ndarray, hashes: list[bytes], m: int) -> bool:
        """Whether tokens[:m] is saved (verified), without counting or touching the LRU order."""
        with self._lock:
            entry = self._entries.get((m, hashes[m // GDN_CHUNK - 1]))
            return entry is not None and np.array_equal(entry.tokens, tokens[:m])

    def put(self, checkpoint: Checkpoint, key_hash: bytes) -> bool:
        """Stores a checkpoint (replacing one under the same key: the newest wins), evicting the least recently used
        until it fits; False when it alone exceeds the budget."""
        with self._lock:
            if checkpoint.nbytes > self.budget_bytes:
                self.rejected += 1
                return False
            key = (checkpoint.length, key_hash)
            old = self._entries.pop(key, None)
            if old is not None:
                self._forget(key, old)
            while self._entries and self.bytes + self._new_bytes(checkpoint) > self.budget_bytes:
                oldest_key, oldest = self._entries.popitem(last=False)
                self._forget(oldest_key, oldest)
                self.evictions += 1
            self._entries[key] = checkpoint
            self._lengths[key[0]] += 1
            self.bytes += int(checkpoint.tokens.nbytes)
            for t in checkpoint.tensors():
                held = self._held.setdefault(id(t), [0, _nbytes(t)])
                if not held[0]:
                    self.bytes += held[1]
                held[0] += 1
            self.stores += 1
            return True

    def _new_bytes(self, checkpoint: Checkpoint) -> int:
        """What storing `checkpoint` adds: its tokens and the tensors no stored entry holds yet."""
        return int(checkpoint.tokens.nbytes) + sum(_nbytes(t) for t in checkpoint.tensors() if id(t) not in self._held)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self._held.clear()
            self.bytes = 0

    def _forget(self, key: tuple[int, bytes], entry: Checkpoint) -> None:
        self.bytes -= int(entry.tokens.nbytes)
        for t in entry.tensors():
            held = self._held[id(t)]
            held[0] -= 1
            if not held[0]:
                self.bytes -= held[1]
                del self._held[id(t)]
        self._lengths[key[0]] -= 1
        if not self._lengths[key[0]]:
            del self._lengths[key[0]]
