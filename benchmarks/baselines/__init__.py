"""Plain-transformers baselines of the benchmark suite (`flide.bench` imports them as engines):

- `prefix_cache.PrefixCacheBaseline`: the state run once with a KV (and Gated DeltaNet) cache, the cache copied for
  each question: exact, the strongest baseline transformers alone gives.
- `delimiter.DelimiterBaseline`: every question after the state in one causal sequence, a delimiter before each
  (SGLang-style multi-item scoring): cheap, but later questions see earlier ones, so the answers change.
"""
