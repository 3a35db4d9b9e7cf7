"""Host-side cost of a round, tracked with pytest-benchmark (runs anywhere, no GPU):

    python -m pytest benchmarks/test_host_side.py --benchmark-json benchmarks/results/host_side.json

- packing and laying out 64 RACE-sized requests (a 300-token state and 4 questions of 45 tokens each) into their
  rounds: planning, metadata, readout rows (issue 8's goal for this: under 0.3 ms, excluding tokenization);
- rendering + tokenizing one request with the tiny in-code tokenizer (split into trunk and branches).
"""

from __future__ import annotations

import numpy as np
import pytest

from flide.config import CapacityConfig
from flide.graphs.buckets import plan_rounds
from flide.round import build_round, footprint
from flide.testing import synthetic_request


def race_sized(n: int = 64, state: int = 300, questions: int = 4, question: int = 45) -> list:
    rng = np.random.default_rng(0)
    return [synthetic_request(rng.integers(10, 1000, size=state),
                              [rng.integers(10, 1000, size=question) for _ in range(questions)], [11, 12, 13, 14])
            for _ in range(n)]


@pytest.mark.benchmark(group="host-side round")
def test_plan_and_build_64_race_requests(benchmark):
    requests = race_sized()
    caps = CapacityConfig()
    needs = [footprint(r) for r in requests]

    def build():
        return [build_round([requests[i] for i in planned.requests], planned.shape, 0)
                for planned in plan_rounds(needs, caps, 26)]

    rounds = benchmark(build)
    assert len(rounds) == 1 and rounds[0].used_tokens == 64 * (300 + 4 * 45)


@pytest.mark.benchmark(group="host-side tokenization")
def test_tokenize_one_request_tiny_tokenizer(benchmark):
    from transformers.decision import DecisionConfig

    from flide.models.tiny import tiny_tokenizer
    from flide.requests import PromptTokenizer, parse_request

    config = DecisionConfig()
    prompts = PromptTokenizer(tiny_tokenizer(), config)
    request = {"state": "The customer was charged twice for one order and asks for a refund. " * 20,
               "questions": {f"q{i}": {"type": "choice", "instructions": f"Question {i}?",
                                       "criteria": {"yes": None, "no": None, "maybe": "unclear"}} for i in range(4)}}
    state, questions = parse_request(request, config, 64)
    prepared = benchmark(prompts.prepare, state, questions)
    assert len(prepared.trunks) == 1 and len(prepared.branches) == 4
