"""The engines the benchmark compares, behind one small interface:

    engine.name                       # "flide", "flide:<ablation>", "pipeline", "prefix-cache", "delimiter"
    engine.decide(requests)           # -> [answers of each request], in order
    engine.tokens(request)            # tokens the model computes for the request
    engine.for_thread(tokenizer)      # the same model with this tokenizer copy, for another submitting thread
    engine.close()                    # (optional) releases what the engine holds: the http engine's server

| engine | what runs |
| --- | --- |
| flide | `flide.patch(model, tokenizer, config)`: `decide([r])` is one flat round (several requests: packed rounds) |
| pipeline | transformers' `pipeline("decision")`: one forward pass per question prompt, one request at a time |
| prefix-cache | `benchmarks/baselines/prefix_cache.py`: the state once with a KV/GDN cache, copied for each question |
| delimiter | `benchmarks/baselines/delimiter.py`: all questions after the state in one causal sequence (not exact) |
| http | `flide serve` in a subprocess (server.py), POST /v1/systemone; closed-loop clients (loadgen.py) for throughput |

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

from .config import REPO, BenchConfig, merge_overrides


class BenchEngine(Protocol):
    name: str

    def decide(self, requests: list) -> list[dict]: ...

    def tokens(self, request: Any) -> int: ...

    def for_thread(self, tokenizer) -> BenchEngine: ...


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
    """Flide: `decide(requests)` prepares each request and runs them in as few flat rounds as the capacities allow.
    The per-thread clones that the throughput runs use (`for_thread`) submit through `Engine.submit` instead, so
    concurrent in-process submitters are packed into shared rounds, as `flide serve` packs concurrent clients."""

    packs_rounds = True  # decide(several requests) shares rounds (the fidelity stability pass uses it)

    def __init__(self, model, tokenizer, config: dict | None = None, name: str = "flide"):
        import flide

        self.name = name
        self.engine = flide.patch(model, tokenizer, config=config)
        self.prompts = self.engine.prompts
        self.lock = threading.Lock()
        self.batched = False

    def decide(self, requests: list) -> list[dict]:
        if self.batched:
            futures = [self.engine.submit(r, self.prompts) for r in requests]
            return [f.result() for f in futures]
        with self.lock:
            prepared = [self.engine.prepare(r, self.prompts) for r in requests]
        return self.engine.run(prepared)

    def tokens(self, request: Any) -> int:
        with self.lock:
            return self.engine.prepare(request, self.prompts).stream_tokens

    def prepare_alone(self, request: Any) -> None:
        """What `decide([request])` spends before its round: validating, rendering, tokenizing (`prepare_p50_ms`)."""
        with self.lock:
            self.engine.prepare(request, self.prompts)

    def for_thread(self, tokenizer) -> FlideEngine:
        # the scheduler behind `submit` starts here, before any timed run: it copies the tokenizer for each of its
        # prepare threads at start (~1.6 s a copy for Qwen's vocabulary), which landed in the first throughput run
        # otherwise (H200: race1 at 1 submitter, 0.19 req/s)
        self.engine.scheduler()
        clone = object.__new__(FlideEngine)
        clone.name, clone.engine, clone.lock, clone.batched = self.name, self.engine, threading.Lock(), True
        # the engine's settings, caches included (the speed grids turn the question cache off for every thread)
        clone.prompts = self.prompts.with_tokenizer(tokenizer)
        return clone


class PipelineEngine:
    """transformers' `pipeline("decision")`, one request per call (a forward pass per question prompt)."""

    name = "pipeline"

    def __init__(self, model, tokenizer):
        from transformers import pipeline

        from ..requests import PromptTokenizer

        self.pipe = pipeline("decision", model=model, tokenizer=tokenizer)
        self.counter = PromptTokenizer(tokenizer, self.pipe.decision_config)  # prompt tokens per request
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

    def for_thread(self, tokenizer) -> PipelineEngine:
        return PipelineEngine(self.pipe.model, tokenizer)


class HttpEngine:
    """`flide serve` in a subprocess serving the benchmark's model; `decide` posts each request over one keep-alive
    connection (answers as the server gives them), `closed_loop` runs N closed-loop clients (loadgen.py), `check`
    compares the server's answers with an in-process Flide engine's. `close()` stops the server (the runner always
    calls it; an atexit hook and PR_SET_PDEATHSIG cover a crash)."""

    def __init__(self, spec: str, model, tokenizer, config: BenchConfig, name: str = "http"):
        from .server import FlideServer

        self.name, self.config = name, config
        device = next(model.parameters()).device
        # the in-process twin: the same model and the server's Flide config, for token counts and the answer check
        self.local = FlideEngine(model, tokenizer, merge_overrides(config.flide, config.http.flide), name="flide")
        self.server = FlideServer(spec, config, str(device)).start()
        self._connection = None

    @property
    def url(self) -> str:
        return self.server.url

    def _post(self, request: Any) -> dict:
        import json

        from .loadgen import Connection, post, split_url

        if self._connection is None:
            host, port = split_url(self.url)
            self._connection = Connection(host, port, timeout=self.config.http.client_timeout_s)
        body = request if isinstance(request, (str, bytes)) else json.dumps(request)
        try:
            status, payload = post(self._connection, body.encode("utf-8") if isinstance(body, str) else body)
        except OSError:
            self._connection.close()
            raise
        if status != 200:
            raise RuntimeError(f"flide serve answered {status}: {payload[:500].decode('utf-8', 'replace')}")
        return json.loads(payload)

    def decide(self, requests: list) -> list[dict]:
        return [self._post(request)["answers"] for request in requests]

    def usage(self, request: Any) -> dict:
        return self._post(request)["usage"]

    def tokens(self, request: Any) -> int:
        return self.local.tokens(request)  # the server's usage.input_tokens (check() asserts they agree)

    def for_thread(self, tokenizer) -> HttpEngine:
        clone = object.__new__(HttpEngine)
        clone.__dict__.update(self.__dict__)
        clone._connection = None
        return clone

    def check(self, requests: list) -> float:
        """Largest probability difference between the server's answers and the in-process engine's (each request
        alone), over `requests`; raises when the server's token count differs from the in-process one."""
        from ..testing import max_difference

        worst = 0.0
        for request in requests:
            body = self._post(request)
            tokens = self.local.tokens(request)
            if body["usage"]["input_tokens"] != tokens:
                raise AssertionError(f"flide serve counted {body['usage']['input_tokens']} input tokens, the "
                                     f"in-process engine {tokens}: it does not serve the same tokenizer/config")
            worst = max(worst, max_difference(self.local.decide([request])[0], body["answers"]))
        return worst

    # the server's histograms whose slow tail the bench counts per level (`slow_<what>@N`: a latency tail of the
    # clients, e.g. session 9's p99 of 0.6 s at 32 clients, is then placed: the model thread's rounds, preparing,
    # or the wait for a round)
    SLOW = {"rounds": "flide_round_seconds", "prepares": "flide_prepare_seconds",
            "queue_waits": "flide_queue_wait_seconds"}
    SLOW_S = 0.25  # one of the histograms' bucket bounds (flide/serve/metrics.py)

    def closed_loop(self, requests: list, clients: int, seconds: float):
        """`clients` closed-loop HTTP clients for `seconds` -> (loadgen.LoadResult, mean requests per round of the
        server meanwhile, {what: how many of the server's rounds / prepares / queue waits meanwhile took over
        SLOW_S}, the share of its rounds launched ahead), from its /metrics."""
        import json

        from .loadgen import closed_loop

        options = self.config.http
        before = self.server.metrics()
        result = closed_loop(self.url, [json.dumps(r) for r in requests], clients, seconds,
                             processes=options.client_processes, max_requests=options.requests,
                             timeout=options.client_timeout_s)
        after = self.server.metrics()
        key_sum, key_count = ("flide_round_requests_sum", ""), ("flide_round_requests_count", "")
        rounds = after.get(key_count, 0.0) - before.get(key_count, 0.0)
        size = (after.get(key_sum, 0.0) - before.get(key_sum, 0.0)) / rounds if rounds else float("nan")

        def delta(key):
            return after.get(key, 0.0) - before.get(key, 0.0)

        slow = {what: delta((f"{name}_count", "")) - delta((f"{name}_bucket", f'le="{self.SLOW_S}"'))
                for what, name in self.SLOW.items()}
        # serve.launch_ahead's reach: the share of the rounds enqueued before the device finished the one before
        ahead = delta(("flide_rounds_launched_ahead_total", "")) / rounds if rounds else float("nan")
        return result, size, slow, ahead

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        self.server.stop()


def make_engine(name: str, model, tokenizer, config: BenchConfig | None = None, spec: str | None = None) -> BenchEngine:
    """The engine `name` on a loaded model: flide, flide:<ablation>, pipeline, prefix-cache, delimiter, or http
    (which needs the config and the model's `spec`, to start `flide serve` with the same model)."""
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
    if name == "http":
        if config is None or spec is None:
            raise ValueError("Engine http needs the benchmark config and the model spec (it starts flide serve).")
        return HttpEngine(spec, model, tokenizer, config)
    raise ValueError(f"Unknown engine {name!r}; valid engines: flide, flide:<ablation>, pipeline, prefix-cache, "
                     f"delimiter, http.")
