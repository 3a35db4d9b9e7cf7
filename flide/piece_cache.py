"""Token ids of prompt pieces, kept across requests.

Split tokenization encodes a prompt as pieces cut at safe boundaries (flide/requests.py): a long state in pieces of
~2k characters, a question's tail line by line. The same pieces come back again and again: the template's closing
lines in every tail, and above all the history of an agent or a conversation, which every later step sends again
in full. Encoding is the host's largest cost on long states (~1.3 us a character with Qwen3.5's tokenizer, so ~5 ms
per 1,000 tokens of history per step), while looking a piece up costs a hash of its text. A piece's tokens depend
only on its text and on whether it starts the prompt (a tail piece is encoded after a dropped newline), which is
the key; no answer can change by caching. A question's tail is also kept whole (its lines' ids joined), so a tail
seen before is one look-up.

One cache serves all the prepare threads of an engine (their PromptTokenizer copies share it), LRU by characters.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class PieceCache:
    """LRU map (piece text, is_tail) -> token ids (int64 array), bounded by the characters of its keys."""

    def __init__(self, max_chars: int):
        self.max_chars = int(max_chars)
        self._entries: OrderedDict[tuple[str, bool], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.chars = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str, tail: bool, count_miss: bool = True) -> np.ndarray | None:
        """The piece's ids, or None; `count_miss=False` for a look-up whose miss is not an encode (a whole tail,
        whose lines are then looked up and counted one by one)."""
        with self._lock:
            ids = self._entries.get((text, tail))
            if ids is None:
                self.misses += count_miss
                return None
            self._entries.move_to_end((text, tail))
            self.hits += 1
            return ids

    def count_misses(self, pieces: int) -> None:
        """Counts pieces encoded without asking (a cache of 0 characters, which keeps nothing, is not asked)."""
        with self._lock:
            self.misses += pieces

    def put(self, text: str, tail: bool, ids: np.ndarray) -> None:
        if len(text) > self.max_chars:
            return
        with self._lock:
            key = (text, tail)
            if key in self._entries:
                return
            ids.flags.writeable = False  # shared by every request that holds the piece
            self._entries[key] = ids
            self.chars += len(text)
            while self.chars > self.max_chars:
                (old, _), _ = self._entries.popitem(last=False)
                self.chars -= len(old)
