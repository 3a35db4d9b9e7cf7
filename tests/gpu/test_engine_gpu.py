"""Whole models on the GPU with the default (`auto`) variants, graphs on, against the reference variants and
transformers' pipeline, on a tiny Qwen3.5 in fp32."""

from __future__ import annotations

import copy
import random

import pytest
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


def variant_equals_pipeline(variant: str, seed: int) -> None:
    """`kernels.gated_delta: <variant>` on the whole tiny model, graphs on: answers within the fast variants'
    tolerance of the pipeline, on random requests of which 4 have questions long enough for several 64-token chunks."""
    rng = random.Random(seed)
    requests = [random_request(rng, max_words=200) for _ in range(12)]
    for request in requests[:4]:
        for question in request["questions"].values():
            if isinstance(question.get("instructions"), str):
                question["instructions"] = " ".join([question["instructions"]] * 12)
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    expected = [pipeline("decision", model=model, tokenizer=tok)(r) for r in requests]
    engine = flide.patch(model, tok, config={**FAST, "kernels": {"gated_delta": variant}})
    assert engine.kernels.gated_delta == variant
    got = engine.decide(requests)
    assert max(max_difference(e, g) for e, g in zip(expected, got)) < 2e-3


def test_questions_wy_equal_pipeline_on_gpu():
    """`fla_wy`: the questions' gated delta in chunked form (questions_wy.py)."""
    variant_equals_pipeline("fla_wy", seed=5)


def test_cuda_questions_equal_pipeline_on_gpu():
    """`fla_cuda`: the questions' gated delta by the CUDA C kernel (questions_cuda.py)."""
    from flide.ops.gated_delta import questions_cuda

    variant_equals_pipeline("fla_cuda", seed=6)
    # the CUDA kernel ran (compiled for the tiny model's heads: K = V = 16, 2 key and 4 value heads), not the fallback
    assert any(key[:4] == (16, 16, 2, 4) for key in questions_cuda.COMPILED)


def test_nested_forks_equal_pipeline_on_gpu():
    """`runtime.nested_forks` with the default CUDA variants (the invariant Triton attention's sub-trunk phase, the
    Triton question kernel recomputing sub-trunks, the conv reading a leaf's window from its sub-trunk), graphs on:
    judge-shaped requests (candidates sharing their question line) against the pipeline, and against the same engine
    with nested forks off, alone and in one round."""
    from flide.testing import candidate_request

    rng = random.Random(11)
    requests = [candidate_request(rng) for _ in range(10)]
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    expected = [pipeline("decision", model=model, tokenizer=tok)(r) for r in requests]
    # each engine on a model of its own: a second `flide.patch` of one model swaps its mixers again, and on the GPU
    # the first engine's rounds then went wrong (session 25: 0.107 from the pipeline here; each engine alone equals
    # it within 1.1e-5, nested forks included)
    nested = flide.patch(copy.deepcopy(model), tok, config={**FAST, "runtime": {"device": "cuda",
                                                                              "nested_forks": "on"}})
    flat = flide.patch(copy.deepcopy(model), tok, config={**FAST, "runtime": {"device": "cuda",
                                                                            "nested_forks": "off"}})
    assert nested.runner is not None and sum(len(nested.prepare(r).subs) for r in requests) >= len(requests)
    together, plain = nested.decide(requests), flat.decide(requests)
    assert max(max_difference(e, g) for e, g in zip(expected, together)) < 2e-3
    assert max(max_difference(a, b) for a, b in zip(plain, together)) < 2e-3
    alone = [nested.decide(r) for r in requests[:4]]
    assert max(max_difference(a, b) for a, b in zip(alone, together)) < 2e-3


@pytest.mark.parametrize("split_nested,leaf_tokens,stored", [(True, None, False), (False, None, False),
                                                              (True, 0, False), (True, 0, True)],
                         ids=["nested-rows-recurrent", "nested-rows-chunked", "long-leaves-chunked",
                              "long-leaves-stored"])
def test_chunked_questions_equal_pipeline_on_gpu(split_nested, leaf_tokens, stored, monkeypatch):
    """fla.CHUNKED_QUESTIONS (read at patch time): the questions' gated delta in chunked form (questions_chunked.py)
    on random requests with long questions, and on judge-shaped ones with nested forks (the leaves and their
    sub-trunks by the recurrent kernel, fla.SPLIT_NESTED_QUESTIONS; or each leaf running its sub-trunk's chunks; or
    split, the sub-trunks whose leaves are all longer than NESTED_CHUNKED_LEAF_TOKENS chunked: 0, every one; their
    leaves from stored sub-trunk states with STORED_SUB_STATES), graphs on, against the pipeline."""
    from flide.ops import gated_delta
    from flide.ops.gated_delta import fla, questions_chunked
    from flide.testing import candidate_request

    monkeypatch.setattr(questions_chunked, "STORED_SUB_STATES", stored)

    monkeypatch.setattr(fla, "CHUNKED_QUESTIONS", True)
    monkeypatch.setattr(fla, "SPLIT_NESTED_QUESTIONS", split_nested)
    monkeypatch.setattr(gated_delta, "NESTED_CHUNKED_LEAF_TOKENS", leaf_tokens)
    variant_equals_pipeline("fla", seed=7)
    rng = random.Random(12)
    requests = [candidate_request(rng) for _ in range(8)]
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    expected = [pipeline("decision", model=model, tokenizer=tok)(r) for r in requests]
    engine = flide.patch(model, tok, config={**FAST, "runtime": {"device": "cuda", "nested_forks": "on"}})
    assert any(getattr(block.mixer, "chunked_questions", False) for block in engine.flat.blocks)
    assert engine.flat.split_nested == split_nested
    got = engine.decide(requests)
    assert max(max_difference(e, g) for e, g in zip(expected, got)) < 2e-3


def test_a_second_engine_on_one_model_leaves_the_first_exact_on_gpu():
    """Two engines patched on ONE model, graphs on: the first still answers as the pipeline after the second is built
    (session 25: 0.065 off before each engine kept its own fused MLP buffer; the second patch had freed the first's
    under its CUDA graphs), and so does the second after an eager third."""
    from flide.testing import candidate_request

    rng = random.Random(11)
    requests = [candidate_request(rng) for _ in range(4)] + [random_request(rng, max_words=200) for _ in range(4)]
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    expected = [pipeline("decision", model=model, tokenizer=tok)(r) for r in requests]

    def worst(engine) -> float:
        return max(max_difference(e, g) for e, g in zip(expected, engine.decide(requests)))

    first = flide.patch(model, tok, config=FAST)
    assert first.runner is not None and worst(first) < 2e-3
    second = flide.patch(model, tok, config={**FAST, "runtime": {"device": "cuda", "merge_lone_questions": False,
                                                                 "nested_forks": "off"}})
    assert worst(second) < 2e-3
    assert worst(first) < 2e-3
    flide.patch(model, tok, config={**FAST, "runtime": {"device": "cuda", "graphs": "off"}})
    assert worst(second) < 2e-3 and worst(first) < 2e-3
