"""Preparing requests in worker processes.

Rendering a prompt (jinja, in transformers' sandbox) and most of tokenizing run Python code under the GIL, so the
prepare *threads* of one process share one core: on this CPU a RACE request costs ~5 ms to prepare, which caps one
process near 200 requests/s whatever the GPU does. With `serve.prepare_processes: N` (`flide serve
--prepare-processes N`) the threads hand each request to one of N worker processes that render and tokenize it
(`flide.requests.tokenize_request`) and send the PreparedRequest back (a few kB, pickled); the thread then adds what
needs the model (`Engine.finish_prepare`: head rows, limits, round layout). Workers are spawned, never forked: the
parent may hold CUDA, and they need no torch (only the tokenizer and the decision config). Spawning re-imports the
parent's main module in each worker, so a script that starts them (`Engine.submit` with this setting) needs the usual
`if __name__ == "__main__":` guard; `flide serve` has it.

Measured on this 2-core CPU (RACE, real Qwen3.5 tokenizer, 128 requests): 2 threads 153-216 req/s, 2 processes
160-163 req/s: no gain with two cores, where the fast tokenizer's Rust part already runs outside the GIL and the
pickling and the parent's finishing take their share. The setting exists for hosts with many cores (the H200
machine has 16); its gain there is unmeasured, so it is off by default.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import zlib
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ..piece_cache import PieceCache
from ..requests import PreparedRequest, PromptTokenizer, tokenize_request

_worker: tuple[PromptTokenizer, int] | None = None  # this worker process's prompt tokenizer and question limit


def _start(tokenizer, decision_config, mode: str, max_questions: int, piece_cache_chars: int,
           question_cache_entries: int, nested: bool = False) -> None:
    global _worker
    _worker = (PromptTokenizer(tokenizer, decision_config, mode, resolved=True,
                               piece_cache=PieceCache(piece_cache_chars),
                               question_cache_entries=question_cache_entries, nested=nested), max_questions)


def _tokenize(request: Any) -> PreparedRequest:
    prompts, max_questions = _worker
    return tokenize_request(request, prompts, max_questions)


class ProcessPreparer:
    """Worker processes that render and tokenize requests for an engine, one queue each.

    A request goes to the worker its state's opening characters pick (a stable hash), unless that worker has more
    requests pending than the least busy one plus one: the steps of one agent or conversation, which send the same
    history again and again, then meet the same worker's piece cache (flide/piece_cache.py), where that history is
    already tokenized; unrelated requests still spread over all workers."""

    AFFINITY_CHARS = 512  # how much of a state's opening picks its worker

    def __init__(self, engine, processes: int):
        self.engine, self.processes = engine, processes
        prompts = engine.prompts
        context = multiprocessing.get_context("spawn")
        args = (prompts.tokenizer, prompts.config, prompts.mode, engine.config.limits.max_questions,
                prompts.piece_cache.max_chars, engine.config.runtime.question_cache_entries, prompts.nested)
        self.pools = [ProcessPoolExecutor(1, mp_context=context, initializer=_start, initargs=args)
                      for _ in range(processes)]
        self.pending = [0] * processes
        self._lock = threading.Lock()
        # start every worker now (spawning imports transformers: seconds), not on the first requests
        for future in [pool.submit(_ping, 0) for pool in self.pools]:
            future.result()

    def pick(self, request: Any) -> int:
        """The worker for `request` (see the class docstring); counts it as pending there."""
        state = request.get("state") if isinstance(request, dict) else None
        opening = state if isinstance(state, str) else json.dumps(state, sort_keys=True, default=str)
        preferred = zlib.crc32(opening[:self.AFFINITY_CHARS].encode("utf-8", "surrogatepass")) % self.processes
        with self._lock:
            least = min(range(self.processes), key=self.pending.__getitem__)
            worker = preferred if self.pending[preferred] <= self.pending[least] + 1 else least
            self.pending[worker] += 1
        return worker

    def prepare(self, request: Any) -> PreparedRequest:
        """`engine.prepare(request)`, rendered and tokenized in a worker (call from a thread: it waits)."""
        worker = self.pick(request)
        try:
            prepared = self.pools[worker].submit(_tokenize, request).result()
        finally:
            with self._lock:
                self.pending[worker] -= 1
        return self.engine.finish_prepare(prepared)

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)


def _ping(_: int) -> bool:
    return _worker is not None
