"""Checkpoints with the GPU kernel variants (issue 6): flex / Triton attention, the Triton conv and fla's gated delta
resume and snapshot through extended streams (flide/ops/resume.py). A growing conversation, several interleaved,
answered with checkpoints equals a fresh engine without them within the kernels' rounding, and resumes (hits, cached
tokens) from the second step on; rounds without checkpoint work still replay their CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import flide
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.testing import growing_conversation, max_difference

VARIANTS = {
    "auto": {},
    "triton": {"fork_attention": "triton", "fork_conv": "triton", "gated_delta": "fla"},
}


@pytest.mark.parametrize("kernels", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("words", [120, 500])
def test_growing_conversations_resume_on_the_gpu(kernels, dtype, words):
    """words: per step. 120 (~160 tokens): a resumed state's new part is short, so fla's variant runs it whole in
    the recurrent kernel (`RESUME_SHORT_TOKENS`); 500 (~650 tokens): over that, through fla's chunked call and the
    rests' re-run."""
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").to("cuda", getattr(torch, dtype))
    plain = tiny_model("qwen3_5_text").to("cuda", getattr(torch, dtype))
    config = {"kernels": VARIANTS[kernels], "runtime": {"graphs": "off"}}
    engine = flide.patch(model, tok, config={**config, "checkpoints": {"enabled": True, "min_state_tokens": 64}})
    fresh = flide.patch(plain, tok, config=config)
    assert engine.checkpoints is not None
    talks = [growing_conversation(seed, 4, words=words) for seed in (1, 2, 3)]
    worst = 0.0
    for step in range(4):
        requests = [talk[step] for talk in talks]
        prepared = [engine.prepare(r) for r in requests]
        got = engine.run(prepared)
        want = fresh.decide(requests)
        worst = max(worst, max(max_difference(a, b) for a, b in zip(want, got)))
        if step:
            assert all(engine.usage(p).cached_tokens > 0 for p in prepared), step
    assert engine.checkpoints.stats()["hits"] >= 9
    # fp32: fla's and flex's dots run in tf32 (a few 1e-4 on a tiny random model); bf16: a resumed state sums its
    # history in another order than a fresh one
    assert worst < (2e-3 if dtype == "float32" else 5e-2), worst


def test_graphs_replay_for_rounds_without_checkpoint_work():
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    engine = flide.patch(model, tok, config={"runtime": {"graphs": "on"},
                                             "capacities": {"buckets": [256, 512, 1024, 2048]},
                                             "checkpoints": {"enabled": True}})
    short = {"state": "A short state.", "questions": {"q": {"type": "noul", "instructions": "Short?"}}}
    before = sum(b.replays for b in engine.runner.buckets.values())
    engine.decide(short)  # under min_state_tokens: nothing to save or resume, so the round replays
    assert sum(b.replays for b in engine.runner.buckets.values()) == before + 1
    talk = growing_conversation(5, 2, words=200)
    first, second = engine.decide(talk[0]), engine.decide(talk[1])
    assert engine.checkpoints.stats()["hits"] >= 1 and first and second
