"""Whole models on the GPU with the default (`auto`) variants, graphs on, against the reference variants and
transformers' pipeline, on a tiny Qwen3.5 in fp32."""

from __future__ import annotations

import random

from transformers import pipeline

import flide
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.testing import max_difference, random_request

# three buckets: the default eight (to 32k tokens) spend minutes capturing (fla autotunes inside the warm-up of
# every new bucket) and this test's rounds stay under 8k tokens
BUCKETS = {"buckets": [512, 2048, 8192]}
FAST = {"runtime": {"device": "cuda"}, "capacities": BUCKETS}


def test_fast_variants_equal_pipeline_on_gpu():
    rng = random.Random(3)
    requests = [random_request(rng, max_words=200) for _ in range(12)]
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    expected = [pipeline("decision", model=model, tokenizer=tok)(r) for r in requests]
    fast = flide.patch(model, tok, config=FAST).decide(requests)
    reference = flide.patch(model, tok, config={"kernels": {"fork_attention": "reference", "gated_delta": "reference",
                                                            "fork_conv": "reference"},
                                                "runtime": {"device": "cuda"}}).decide(requests)
    # tf32 inside the Triton attention's and fla's dots: a few 1e-4 on probabilities of a tiny random model
    assert max(max_difference(e, g) for e, g in zip(expected, fast)) < 2e-3
    assert max(max_difference(e, g) for e, g in zip(expected, reference)) < 1e-4


def test_questions_wy_equal_pipeline_on_gpu():
    """`kernels.gated_delta: fla_wy` (the questions' gated delta in chunked form) on the whole model, graphs on:
    answers within the fast variants' tolerance of the pipeline, long questions (several 64-token chunks) included."""
    rng = random.Random(5)
    requests = [random_request(rng, max_words=200) for _ in range(12)]
    for request in requests[:4]:  # questions long enough for 2-3 chunks of the WY form
        for question in request["questions"].values():
            if isinstance(question.get("instructions"), str):
                question["instructions"] = " ".join([question["instructions"]] * 12)
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    expected = [pipeline("decision", model=model, tokenizer=tok)(r) for r in requests]
    engine = flide.patch(model, tok, config={**FAST, "kernels": {"gated_delta": "fla_wy"}})
    assert engine.kernels.gated_delta == "fla_wy"
    got = engine.decide(requests)
    assert max(max_difference(e, g) for e, g in zip(expected, got)) < 2e-3


def test_cuda_questions_equal_pipeline_on_gpu():
    """`kernels.gated_delta: fla_cuda` (the questions' gated delta by the CUDA C kernel, questions_cuda.py) on the
    whole model, graphs on: answers within the fast variants' tolerance of the pipeline, long questions included."""
    rng = random.Random(6)
    requests = [random_request(rng, max_words=200) for _ in range(12)]
    for request in requests[:4]:
        for question in request["questions"].values():
            if isinstance(question.get("instructions"), str):
                question["instructions"] = " ".join([question["instructions"]] * 12)
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    expected = [pipeline("decision", model=model, tokenizer=tok)(r) for r in requests]
    from flide.ops.gated_delta import questions_cuda

    engine = flide.patch(model, tok, config={**FAST, "kernels": {"gated_delta": "fla_cuda"}})
    assert engine.kernels.gated_delta == "fla_cuda"
    got = engine.decide(requests)
    assert max(max_difference(e, g) for e, g in zip(expected, got)) < 2e-3
    # the CUDA kernel ran (compiled for the tiny model's heads: K = V = 16, 2 key and 4 value heads), not the fallback
    assert any(key[:4] == (16, 16, 2, 4) for key in questions_cuda.COMPILED)
