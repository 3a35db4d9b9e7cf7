"""The engines the benchmark compares, behind one small interface:

    engine.name                       # "flide", "flide:<ablation>", "pipeline", "prefix-cache", "delimiter"
    engine.decide(requests)           # -> [answers of each request], in order
    engine.tokens(request)            # tokens the model computes for the request
    engine.for_thread(tokenizer)      # the same model with this tokenizer copy, for another submitting thread

| engine | what runs |
| --- | --- |
| flide | `flide.patch(model, tokenizer, config)`: `decide([r])` is one flat round (several requests: packed rounds) |
| pipeline | transformers' `pipeline("decision")`: one forward pass per question prompt, one request at a time |
| prefix-cache | `benchmarks/baselines/prefix_cache.py`: the state once with a KV/GDN cache, copied for each question |
| delimiter | `benchmarks/baselines/delimiter.py`: all questions after the state in one causal sequence (not exact) |

Every engine of a model shares the one model object: `flide.patch` swaps its layers in place, and the swapped
layers run transformers' own modules when called without a Flide round, so `pipeline` and the baselines still run
plain transformers. Patching again (an ablation with other kernels) re-swaps them: build an engine right before
measuring it (the runner does).

Threads: a fast tokenizer is not safe to share while it encodes, so each engine prepares requests under a lock of
its own; `for_thread` gives a submitter thread an engine with another tokenizer copy (and lock). The model's forward
passes run outside the lock, concurrently. The baselines (`PlainBaseline` subclasses) implement the interface
themselves.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Protocol

from .config import REPO, BenchConfig


class BenchEngine(Protocol):
    name: str

    def decide(self, requests: list) -> list[dict]: ...

    def tokens(self, request: Any) -> int: ...

    def for_thread(self, tokenizer) -> "BenchEngine": ...


def _baseline(module: str):
    """benchmarks/baselines/<module>.py (the repository root is put on sys.path when it is not there)."""
    name = f"benchmarks.baselines.{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name not in ("benchmarks", "benchmarks.baselines"):
            raise
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        return importlib.import_module(name)


class FlideEngine:
    """Flide: `decide(requests)` prepares each request and runs them in as few flat rounds as the capacities allow
    (the runner calls it with one request at a time: in-process submitters are not batched together)."""

    def __init__(self, model, tokenizer, config: dict | None = None, name: str = "flide"):
        import flide

        self.name = name
        self.engine = flide.patch(model, tokenizer, config=config)
        self.prompts = self.engine.prompts
        self.lock = threading.Lock()

    def decide(self, requests: list) -> list[dict]:
        with self.lock:
            prepared = [self.engine.prepare(r, self.prompts) for r in requests]
        return self.engine.run(prepared)

    def tokens(self, request: Any) -> int:
        with self.lock:
            return self.engine.prepare(request, self.prompts).stream_tokens

    def for_thread(self, tokenizer) -> "FlideEngine":
        from ..requests import PromptTokenizer

        clone = object.__new__(FlideEngine)
        clone.name, clone.engine, clone.lock = self.name, self.engine, threading.Lock()
        clone.prompts = PromptTokenizer(tokenizer, self.engine.decision_config, self.prompts.mode)
        return clone


class PipelineEngine:
    """transformers' `pipeline("decision")`, one request per call (a forward pass per question prompt)."""

    name = "pipeline"

    def __init__(self, model, tokenizer):
        from transformers import pipeline

        from ..requests import PromptTokenizer

        self.pipe = pipeline("decision", model=model, tokenizer=tokenizer)
        self.counter = PromptTokenizer(tokenizer, self.pipe.decision_config, "split")  # prompt tokens per request
        self.lock = threading.Lock()

    def decide(self, requests: list) -> list[dict]:
        out = []
        for request in requests:  # pipe(request), with the tokenization under this engine's lock
            with self.lock:
                inputs = self.pipe.preprocess(request)
            out.append(self.pipe.postprocess(self.pipe.forward(inputs)))
        return out

    def tokens(self, request: Any) -> int:
        from ..requests import parse_request

        with self.lock:
            state, questions = parse_request(request, self.pipe.decision_config, 64)
            return self.counter.prepare(state, questions).prompt_tokens

    def for_thread(self, tokenizer) -> "PipelineEngine":
        return PipelineEngine(self.pipe.model, tokenizer)


def make_engine(name: str, model, tokenizer, config: BenchConfig | None = None) -> BenchEngine:
    """The engine `name` on a loaded model: flide, flide:<ablation>, pipeline, prefix-cache or delimiter."""
    if name == "flide" or name.startswith("flide:"):
        ablation = name.partition(":")[2] or None
        if ablation and (config is None or ablation not in config.ablations):
            raise ValueError(f"Unknown ablation {ablation!r}; the config defines: "
                             f"{', '.join(config.ablations) if config else '(none)'}.")
        return FlideEngine(model, tokenizer, config.flide_config(ablation) if config else None, name=name)
    if name == "pipeline":
        return PipelineEngine(model, tokenizer)
    if name == "prefix-cache":
        return _baseline("prefix_cache").PrefixCacheBaseline(model, tokenizer)
    if name == "delimiter":
        return _baseline("delimiter").DelimiterBaseline(model, tokenizer)
    raise ValueError(f"Unknown engine {name!r}; valid engines: flide, flide:<ablation>, pipeline, prefix-cache, "
                     f"delimiter.")
