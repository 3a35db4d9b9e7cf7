"""The named workloads of the benchmark suite, built from `flide.workloads` (the datasets of ../shared/data).

    build("race", tokenizer, limit=32)    # -> {"race": [request, ...]}
    build("sweep", tokenizer, limit=1)    # -> {"sweep/q1": [...], "sweep/q8": [...], ..., "sweep/q64": [...]}

| name | requests |
| --- | --- |
| race1 | a RACE passage with its first question |
| race | a RACE passage with every question |
| quality1 | a QuALITY article cut to 3,600 tokens, its first question |
| quality | a whole QuALITY article, every question (`cut_tokens` cuts it, for small machines) |
| multirc | a MultiRC paragraph, every answer candidate a `noul` question, at most 64 per request |
| sweep | a QuALITY article cut to ~2,000 tokens asked 1, 8, 16, 32 and 64 questions (one row workload per count) |

Token counts use the benchmark's tokenizer (the real Qwen3.5 one on the GPU configs; the tiny one on CPU smoke runs,
where the same text makes more tokens).
"""

from __future__ import annotations

import math
from typing import Any

from .config import DEFAULT_LIMITS, WORKLOAD_OPTIONS, WORKLOADS


def build(name: str, tokenizer, limit: int | None = None, options: dict[str, Any] | None = None,
          data_dir: str | None = None) -> dict[str, list[dict]]:
    """The requests of a named workload: {row workload name: requests}. One entry, except `sweep` (one per count).

    limit: requests built (sweep: articles, each asked every count); options: see `WORKLOAD_OPTIONS`."""
    from .. import workloads

    if name not in WORKLOADS:
        raise ValueError(f"Unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}.")
    opts = {**WORKLOAD_OPTIONS[name], **(options or {})}
    unknown = sorted(set(opts) - set(WORKLOAD_OPTIONS[name]))
    if unknown:
        raise ValueError(f"Unknown option(s) {', '.join(unknown)} of workload {name!r}; valid: "
                         f"{', '.join(WORKLOAD_OPTIONS[name]) or '(none)'}.")
    limit = DEFAULT_LIMITS[name] if limit is None else limit
    if name == "race1":
        return {name: workloads.race(limit=limit, one_question=True, folder=data_dir)}
    if name == "race":
        return {name: workloads.race(limit=limit, folder=data_dir)}
    if name == "quality1":
        return {name: workloads.quality(limit=limit, cut_tokens=opts["cut_tokens"], tokenizer=tokenizer,
                                        one_question=True, folder=data_dir)}
    if name == "quality":
        cut = opts["cut_tokens"]
        return {name: workloads.quality(limit=limit, cut_tokens=cut, tokenizer=tokenizer if cut else None,
                                        folder=data_dir)}
    if name == "multirc":
        return {name: workloads.multirc(limit=limit, max_questions=opts["max_questions"], folder=data_dir)}
    return sweep(tokenizer, limit, opts["state_tokens"], opts["counts"], data_dir)


def sweep(tokenizer, articles: int = 1, state_tokens: int = 2000, counts=(1, 8, 16, 32, 64),
          data_dir: str | None = None) -> dict[str, list[dict]]:
    """The question-count sweep: QuALITY articles cut to `state_tokens` tokens, each asked exactly n questions for n
    in `counts` ({"sweep/q<n>": one request per article}).

    The article's own questions come first; past them they repeat with their options in another order each round
    (the round-th permutation), so the prompts differ and each stays a well-formed question about the same state."""
    from .. import workloads

    out: dict[str, list[dict]] = {f"sweep/q{n}": [] for n in counts}
    for article in workloads.quality(limit=articles, cut_tokens=state_tokens, tokenizer=tokenizer, folder=data_dir):
        own = list(article["questions"].values())
        for n in counts:
            questions = {}
            for i in range(n):
                base = own[i % len(own)]
                order = _permutation(list(base["criteria"]), i // len(own))
                questions[f"q{i}"] = {**base, "criteria": {option: base["criteria"][option] for option in order}}
            out[f"sweep/q{n}"].append({"state": article["state"], "questions": questions})
    return out


def _permutation(items: list, index: int) -> list:
    """The index-th permutation of items in lexicographic order of positions (cycling past the last one)."""
    items, out = list(items), []
    index %= math.factorial(len(items))
    while items:
        block = math.factorial(len(items) - 1)
        out.append(items.pop(index // block))
        index %= block
    return out
