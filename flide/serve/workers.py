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

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ..requests import PreparedRequest, PromptTokenizer, tokenize_request

_worker: tuple[PromptTokenizer, int] | None = None  # this worker process's prompt tokenizer and question limit


def _start(tokenizer, decision_config, mode: str, max_questions: int) -> None:
    global _worker
    _worker = (PromptTokenizer(tokenizer, decision_config, mode, resolved=True), max_questions)


def _tokenize(request: Any) -> PreparedRequest:
    prompts, max_questions = _worker
    return tokenize_request(request, prompts, max_questions)


class ProcessPreparer:
    """A pool of worker processes that render and tokenize requests for an engine."""

    def __init__(self, engine, processes: int):
        self.engine, self.processes = engine, processes
        prompts = engine.prompts
        self.pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_start,
                                        initargs=(prompts.tokenizer, prompts.config, prompts.mode,
                                                  engine.config.limits.max_questions))
        # start every worker now (spawning imports transformers: seconds), not on the first requests
        list(self.pool.map(_ping, range(processes)))

    def prepare(self, request: Any) -> PreparedRequest:
        """`engine.prepare(request)`, rendered and tokenized in a worker (call from a thread: it waits)."""
        return self.engine.finish_prepare(self.pool.submit(_tokenize, request).result())

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _ping(_: int) -> bool:
    return _worker is not None
