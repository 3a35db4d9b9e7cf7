"""GPU regression tracking with pytest-benchmark: one round of Flide's default engine (captured CUDA graphs) on a
random-weight Qwen3.5-0.8B in bf16, per workload shape. Skipped without a GPU or without the model config.

    python -m pytest benchmarks/test_gpu_rounds.py --benchmark-json benchmarks/results/gpu_rounds.json

Shapes (text built to a token count with the tiny in-code tokenizer, whose ids all exist in Qwen3.5's vocabulary; the
engine's cost does not depend on which tokens): one RACE-sized request (~450 stream tokens, 4 four-option questions),
64 of them in one round, a ~2,000-token state with 1 and with 64 questions, and 8 judge requests in one round (6
question lines x 4 candidate answers each, `noul`: each line a sub-trunk of nested forks, 240 nested rows in the
round, more than the nested launch's row programs). Each benchmark round is `engine.run`
(host build + one copy + one graph replay + scores back + answers), after warm-up; tokenization is outside.
The model config is looked up in ../shared/models or the repository's shared/ (see benchmarks/h200_session.sh).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [REPO.parent / "shared/models/qwen3_5/configs/qwen3.5-0.8b.json",
           REPO / "shared/models/qwen3_5/configs/qwen3.5-0.8b.json"]
CONFIG = next((path for path in CONFIGS if path.is_file()), None)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(CONFIG is None, reason="the Qwen3.5-0.8B config json is absent"),
]


@pytest.fixture(scope="module")
def engine():
    import flide
    from flide.loading import random_model
    from flide.models.tiny import tiny_tokenizer

    model = random_model(CONFIG, torch.bfloat16, "cuda")
    # the tokenizer only matters for labels: synthetic requests carry their token ids and option rows
    return flide.patch(model, tiny_tokenizer())


def requests(engine, n: int, state_tokens: int, questions: int, candidates: int = 0) -> list:
    """`n` prepared requests of a ~`state_tokens`-token state (the tiny tokenizer gives ~4.7 tokens per `itemN`
    word) and `questions` four-option choice questions each; with `candidates`, `questions` judge lines instead, each
    asked of that many candidate answers as `noul` questions (MultiRC's form: the line, then the candidate)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        state = " ".join(f"item{i}" for i in rng.integers(0, 37, size=max(1, state_tokens * 10 // 47)))
        if candidates:
            asked = {f"q{j}_a{c}": {"type": "noul", "instructions": f"Which answer does the passage support at step "
                                                                    f"{j}?\nProposed answer: item{c * 7 + j}"}
                     for j in range(questions) for c in range(candidates)}
        else:
            asked = {f"q{j}": {"type": "choice", "instructions": f"Which option fits the passage best at step {j}?",
                               "criteria": {"A": "first", "B": "second", "C": "third", "D": "fourth"}}
                     for j in range(questions)}
        out.append(engine.prepare({"state": state, "questions": asked}))
    return out


# race: ~450 stream tokens a request, as real RACE requests in the Qwen3.5 tokenizer (64 of them: one 32k round)
SHAPES = {"race": (1, 130, 4), "race64": (64, 130, 4), "sweep1": (1, 2000, 1), "sweep64": (1, 2000, 64),
          "judges8": (8, 300, 6, 4)}


@pytest.mark.benchmark(group="gpu round")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_round(benchmark, engine, shape):
    prepared = requests(engine, *SHAPES[shape])
    for _ in range(3):
        engine.run(prepared)
    benchmark.pedantic(engine.run, args=(prepared,), rounds=50, iterations=1)
