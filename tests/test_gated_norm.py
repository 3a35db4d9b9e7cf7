"""`kernels.gated_norm`: the end of a Gated DeltaNet layer as one op (the fork's row select + Qwen3.5's gated RMS
norm). On the CPU: the plumbing (the fork's two calls and their spans reach the op, which equals the model's own
norm module after the select) through the `torch` variant's custom op, the config errors, and the layer's check of
the norm it replaces. The Triton kernel: tests/test_triton_kernels.py (interpreter, also inside a whole tiny model)
and tests/gpu/test_gated_norm_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

import flide
from flide.models.layers import FlideGatedDeltaNet
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.ops.gated_norm import gated_norm_torch, reference
from flide.testing import assert_mostly_same_bits, engine_against_pipeline, max_difference, random_request


def _requests(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [random_request(rng, max_questions=6, max_words=80) for _ in range(n)]


def gdn_layers(model) -> list[FlideGatedDeltaNet]:
    return [m for m in model.modules() if isinstance(m, FlideGatedDeltaNet)]


def test_the_op_in_the_layer_answers_as_the_models_own_norm():
    """Every GDN layer calling the `torch` variant's custom op (the op's path: fork parts + spans in, one call)
    answers as the default path (the select, then the model's own norm module) to float32 rounding."""
    tok, model = tiny_tokenizer(), tiny_model("qwen3_5_text")
    engine = flide.patch(model, tok)
    requests = _requests(3, 8)
    want = engine.decide(requests)
    layers = gdn_layers(engine.model)
    assert layers and all(layer.norm_op is None for layer in layers)  # `torch`: the module path
    for layer in layers:
        layer.norm_op = gated_norm_torch
    got = engine.decide(requests)
    assert max(max_difference(a, b) for a, b in zip(want, got)) < 1e-6


def test_select_rows_takes_each_row_from_its_call_and_zero_elsewhere():
    T = 12
    x_states, x_branches = torch.full((T, 2, 3), float("nan")), torch.full((T, 2, 3), float("nan"))
    x_states[:4], x_branches[6:10] = 1.0, 2.0
    ends = (torch.tensor([4]), torch.tensor([6]), torch.tensor([10]))
    out = reference.select_rows(x_states, x_branches, *ends)
    assert torch.equal(out[:4], x_states[:4]) and torch.equal(out[6:10], x_branches[6:10])
    assert not out[4:6].any() and not out[10:].any()


def test_unknown_variant_names_the_field():
    with pytest.raises(ValueError, match="gated_norm"):
        flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer(), config={"kernels": {"gated_norm": "nope"}})


def test_a_norm_that_is_not_the_gated_rms_norm_is_refused():
    model = tiny_model("qwen3_5_text")
    original = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    original.norm.activation = "gelu"
    with pytest.raises(ValueError, match="kernels.gated_norm"):
        FlideGatedDeltaNet(original, None, None, norm_op=lambda *args: None)
    # the `torch` variant keeps the module, whatever it computes
    assert FlideGatedDeltaNet(original, None, None, norm_op=gated_norm_torch).norm_op is None


def test_the_gpu_tests_helpers_on_the_cpu():
    """`engine_against_pipeline` and `assert_mostly_same_bits` (tests/gpu's whole-model and bits checks) do what
    they say: here the `torch` gated norm against the pipeline and against itself, fp32 on the CPU."""
    vs_pipeline, vs_baseline = engine_against_pipeline({"gated_norm": "torch"}, {}, seed=2, device="cpu")
    assert vs_pipeline < 1e-5 and vs_baseline == 0.0
    x = torch.arange(200, dtype=torch.bfloat16)
    assert_mostly_same_bits(x, x.clone(), atol=0, rtol=0)
    nudged = x.clone()
    nudged[:3] += 1  # 3 of 200 elements one step off (near zero: within atol)
    assert_mostly_same_bits(nudged, x, atol=1.5, rtol=0, min_equal=0.98)
    with pytest.raises(AssertionError, match="oracle's bits"):
        assert_mostly_same_bits(nudged, x, atol=1.5, rtol=0, min_equal=0.99)

