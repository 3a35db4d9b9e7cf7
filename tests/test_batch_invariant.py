"""Batch-invariant mode (`kernels.batch_invariant: true`) on the CPU, fp32: every question's raw option scores
have the same bits alone and inside any round, a forked question has the bits of the same question asked alone (its
state plus that one question), answers still equal `pipeline("decision")`, and the mode's choices and errors in the
registry. The GPU half (1,000 random rounds under CUDA graphs) is tests/gpu/test_batch_invariant_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import pipeline

import flide
from flide.config import load_config
from flide.models.layers import FlideLinear
from flide.models.tiny import tiny_jev, tiny_model, tiny_tokenizer
from flide.ops import registry
from flide.testing import ScoreRecorder, max_difference, random_request

INVARIANT = {"kernels": {"batch_invariant": True}}
MODELS = {"qwen3_5": lambda: tiny_model("qwen3_5_text"), "llama": lambda: tiny_model("llama"), "jev": tiny_jev}


@pytest.fixture(autouse=True)
def two_threads():
    """Two threads, as on a CI machine: the mode must not depend on one thread (the suite's default)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_auto_picks_batch_invariant_variants_on_the_cpu():
    kernels = registry.concrete(load_config(INVARIANT).kernels, "cpu")
    assert (kernels.fork_attention, kernels.gated_delta, kernels.fork_conv, kernels.readout, kernels.linear) == (
        "segments", "reference", "reference", "invariant", "blocked")
    plain = registry.concrete(load_config(None).kernels, "cpu")
    assert (plain.fork_attention, plain.readout, plain.linear) == ("reference", "selective", "torch")


def test_auto_picks_batch_invariant_variants_on_cuda():
    kernels = registry.concrete(load_config({"kernels": {"batch_invariant": True, "fork_attention": "segments",
                                                         "gated_delta": "reference", "linear": "blocked"}}).kernels,
                                "cuda")
    # the Triton conv where it can run (a CUDA machine), else the reference (taps summed in order: invariant too)
    triton_conv = registry.variants("fork_conv") and registry._AVAILABLE[("fork_conv", "triton")]() is None
    assert kernels.fork_conv == ("triton" if triton_conv else "reference") and kernels.readout == "invariant"
    assert registry.AUTO_INVARIANT["linear"]["cuda"] == ("triton",)


@pytest.mark.parametrize("op,variant", [("fork_attention", "reference"), ("readout", "full"), ("linear", "torch"),
                                        ("readout", "selective")])
def test_a_variant_that_is_not_invariant_is_refused_by_name(op, variant):
    config = load_config({"kernels": {"batch_invariant": True, op: variant}})
    with pytest.raises(ValueError, match=rf"kernels\.{op}: {variant}` is not batch-invariant"):
        registry.concrete(config.kernels, "cpu")


def test_batch_invariant_must_be_a_boolean():
    with pytest.raises(ValueError, match="kernels.batch_invariant"):
        load_config({"kernels": {"batch_invariant": "yes"}})


def test_linear_layers_are_swapped_and_put_back():
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    keys = sorted(model.state_dict())  # the swapped mixers list their parameters in their own order
    flide.patch(model, tok, config=INVARIANT)
    swapped = [m for m in model.modules() if isinstance(m, FlideLinear)]
    assert swapped and all(m.op is registry.resolve("linear", "blocked") for m in swapped)
    assert sorted(model.state_dict()) == keys
    flide.patch(model, tok)  # the default mode: the model's own nn.Linear layers again
    assert not any(isinstance(m, FlideLinear) for m in model.modules())
    assert sorted(model.state_dict()) == keys


def test_projections_of_one_input_run_as_one_invariant_gemm(monkeypatch):
    """Batch-invariant mode fuses q/k/v, the Gated DeltaNet's input projections and gate/up as the default mode does,
    through the invariant op over the stacked weight (its sums do not depend on N); the plain transformers forward of
    the patched model is unchanged."""
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        before = model(ids).logits
    engine = flide.patch(model, tok, config=INVARIANT)
    blocks = engine.flat.blocks
    assert all(b.mlp_sizes is not None for b in blocks)
    assert all((getattr(b.mixer, "in_sizes", None) or getattr(b.mixer, "qkv_sizes", None)) for b in blocks)
    widths = []
    op = registry.resolve("linear", "blocked")
    # a data descriptor on the class is looked up before the instances' own `op`: every call is seen
    counted = property(lambda self: lambda x, w, b: widths.append(w.shape[0]) or op(x, w, b))
    monkeypatch.setattr(FlideLinear, "op", counted, raising=False)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-5)
    engine.decide(random_request(random.Random(3), max_questions=2, max_words=20))
    fused_widths = {sum(b.mlp_sizes) for b in blocks}
    assert fused_widths & set(widths)  # a fused GEMM ran through the op


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    model, tok = MODELS[request.param](), tiny_tokenizer()
    rng = random.Random(11)
    requests = [random_request(rng, max_questions=12, max_words=150) for _ in range(24)]
    decide = pipeline("decision", model=model, tokenizer=tok)
    expected = [decide(r) for r in requests]
    engine = flide.patch(model, tok, config=INVARIANT)
    return request.param, engine, requests, expected


def test_scores_have_the_same_bits_alone_and_inside_any_round(case):
    name, engine, requests, expected = case
    torch.set_num_threads(2)
    rng = random.Random(5)
    prepared = [engine.prepare(r) for r in requests]
    recorder = ScoreRecorder(engine)
    try:
        for p in prepared:
            engine.run([p])
        for _ in range(3):
            order = rng.sample(range(len(prepared)), len(prepared))
            while order:
                size = rng.choice([2, 3, 5, 8, 13, 24])
                engine.run([prepared[i] for i in order[:size]])
                order = order[size:]
    finally:
        recorder.close()
    questions = sum(len(p.questions) for p in prepared)
    assert len(recorder.scores) == questions and all(len(rows) == 4 for rows in recorder.scores.values())
    assert recorder.unequal() == [], f"{name}: scores that changed with the round"


def test_a_forked_question_has_the_bits_of_the_question_asked_alone(case):
    name, engine, requests, expected = case
    many = [r for r in requests if len(r["questions"]) >= 3][:4]
    assert many
    recorder = ScoreRecorder(engine)
    try:
        together = [engine.prepare(r) for r in many]
        engine.run(together)
        alone = {}
        for r, p in zip(many, together):
            for qname, question in r["questions"].items():
                single = engine.prepare({**r, "questions": {qname: question}})
                engine.run([single])
                alone[(id(p), qname)] = (id(single), qname)
    finally:
        recorder.close()
    for key, single in alone.items():
        a, b = recorder.scores[key][0], recorder.scores[single][0]
        assert torch.equal(a, b), f"{name}: question {key[1]} forked vs alone differs by {(a - b).abs().max():.3g}"


def test_answers_still_equal_the_pipeline(case):
    name, engine, requests, expected = case
    got = engine.decide(requests)
    worst = max(max_difference(e, g) for e, g in zip(expected, got))
    assert worst <= 1e-5, f"{name}: {worst:.3g} from pipeline('decision')"


@pytest.mark.parametrize("n", [1, 3, 64, 200])
def test_blocked_linear_rows_keep_their_bits_at_any_row_count(n):
    from flide.ops.linear.reference import linear_blocked

    g = torch.Generator().manual_seed(n)
    x, w, b = torch.randn(300, 48, generator=g), torch.randn(n, 48, generator=g), torch.randn(n, generator=g)
    full = linear_blocked(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert torch.allclose(full.double(), exact, atol=1e-4)
    for lo, hi in [(0, 1), (0, 3), (5, 12), (17, 81), (63, 130), (299, 300), (0, 300)]:
        assert torch.equal(linear_blocked(x[lo:hi], w, b), full[lo:hi]), (lo, hi)


def test_invariant_readout_keeps_each_score_whatever_the_other_rows():
    from flide.ops.readout.reference import readout_invariant, readout_selective

    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(40, 32, generator=g), torch.randn(100, 32, generator=g), torch.randn(100)
    rows, options = torch.randint(0, 40, (25,), generator=g), torch.randint(0, 100, (25, 6), generator=g)
    full = readout_invariant(hidden, rows, weight, bias, options)
    assert torch.allclose(full, readout_selective(hidden, rows, weight, bias, options), atol=1e-5)
    for lo, hi, width in [(0, 1, 6), (3, 9, 6), (10, 25, 6), (0, 25, 2)]:
        part = readout_invariant(hidden, rows[lo:hi], weight, bias, options[lo:hi, :width])
        assert torch.equal(part, full[lo:hi, :width]), (lo, hi, width)
