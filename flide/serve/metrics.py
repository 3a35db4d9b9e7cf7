"""Prometheus metrics of `flide serve`, in a registry of their own (one per app, so tests can build many apps).

Names follow Prometheus conventions: `_total` counters, `_seconds` histograms, base units.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ROUND_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_ROUND_TOKENS = tuple(2**i for i in range(6, 19))  # 64 .. 262144


class Metrics:
    """Every metric the server exports. `render()` -> (body, content type) for GET /metrics."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("flide_requests", "System One requests answered, by HTTP status.", ["status"],
                                registry=r)
        self.latency = Histogram("flide_request_latency_seconds", "Arrival to answer of answered (200) requests.",
                                 buckets=_LATENCY, registry=r)
        self.prepare = Histogram("flide_prepare_seconds", "Validating, rendering and tokenizing one request.",
                                 buckets=_LATENCY, registry=r)
        self.queue_wait = Histogram("flide_queue_wait_seconds", "Prepared request waiting for its round.",
                                    buckets=_LATENCY, registry=r)
        self.round_seconds = Histogram("flide_round_seconds", "One round on the model thread (forward + answers).",
                                       buckets=_LATENCY, registry=r)
        self.round_requests = Histogram("flide_round_requests", "Requests per round.", buckets=_ROUND_REQUESTS,
                                        registry=r)
        self.round_tokens = Histogram("flide_round_tokens", "Tokens computed per round (every state once).",
                                      buckets=_ROUND_TOKENS, registry=r)
        self.rounds = Counter("flide_rounds", "Rounds run, retries of a failed round's requests one by one included.",
                              registry=r)
        self.launched_ahead = Counter("flide_rounds_launched_ahead", "Rounds whose replay was enqueued before the "
                                      "device finished the round before it (serve.launch_ahead).", registry=r)
        self.round_failures = Counter("flide_round_failures", "Rounds that raised, by kind (oom, error).", ["kind"],
                                      registry=r)
        self.tokens_computed = Counter("flide_tokens_computed", "Tokens computed by the model in rounds.", registry=r)
        self.input_tokens = Counter("flide_input_tokens", "usage.input_tokens of answered requests.", registry=r)
        self.prompt_tokens = Counter("flide_prompt_tokens", "Tokens one prompt per question would have computed for "
                                                            "the answered requests (the baseline's work).", registry=r)
        self.queue_depth = Gauge("flide_queue_depth", "Requests admitted and not yet in a round (being prepared or "
                                                      "waiting).", registry=r)
        self.running = Gauge("flide_running_requests", "Requests in rounds started and not yet answered.", registry=r)

    def watch_checkpoints(self, cache) -> None:
        """Exports a `flide.checkpoints.CheckpointCache`'s counters (read at each scrape); once per registry."""
        if getattr(self, "_checkpoints", None) is None:
            self._checkpoints = _CheckpointCollector(cache)
            self.registry.register(self._checkpoints)

    def watch_piece_cache(self, cache) -> None:
        """Exports a `flide.piece_cache.PieceCache`'s hits, misses and size (read at each scrape); once per registry."""
        if getattr(self, "_pieces", None) is None:
            self._pieces = _PieceCacheCollector(cache)
            self.registry.register(self._pieces)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _CheckpointCollector:
    """The checkpoint cache's own counters as Prometheus metrics: the cache counts under its lock, so the exported
    values are read from it rather than kept twice."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.cache.stats()
        for key, text in (("hits", "States resumed from a checkpoint."),
                          ("misses", "States over 64 tokens that found no checkpoint."),
                          ("stores", "Checkpoints saved."), ("evictions", "Checkpoints evicted (least recently used)."),
                          ("rejected", "Checkpoints larger than the whole budget, not kept.")):
            yield CounterMetricFamily(f"flide_checkpoint_{key}", text, value=stats[key])
        yield GaugeMetricFamily("flide_checkpoint_bytes", "Bytes held by the checkpoint cache.", value=stats["bytes"])
        yield GaugeMetricFamily("flide_checkpoint_entries", "Checkpoints in the cache.", value=stats["entries"])
        yield GaugeMetricFamily("flide_checkpoint_budget_bytes", "The checkpoint cache's budget.",
                                value=stats["budget_bytes"])


class _PieceCacheCollector:
    """The prompt piece cache's counters (flide/piece_cache.py), read from it at each scrape."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cache = self.cache
        yield CounterMetricFamily("flide_piece_cache_hits", "Prompt pieces whose tokens came from the piece cache.",
                                  value=cache.hits)
        yield CounterMetricFamily("flide_piece_cache_misses", "Prompt pieces encoded by the tokenizer.",
                                  value=cache.misses)
        yield GaugeMetricFamily("flide_piece_cache_chars", "Characters of the pieces the cache holds.",
                                value=cache.chars)
