"""Whole models against transformers' own `pipeline("decision")`, question by question (fp32, CPU, tiny random
models built in code): every probability within 1e-5, and a request answered alone equals it answered inside any
round within 1e-6."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from transformers import pipeline
from transformers.decision import DecisionConfig
from transformers.models.jev.configuration_jev import JEV_TEMPLATE

import flide
from flide.models.tiny import tiny_jev, tiny_model, tiny_qwen3_5_multimodal, tiny_tokenizer
from flide.testing import max_difference, random_request

PIPELINE_ATOL = 1e-5
ROUND_ATOL = 1e-6


def jev_decision_config() -> DecisionConfig:
    """Jev's own prompt: the question type printed before the state, read at a `<|mark|>`; temperatures per type."""
    return DecisionConfig(chat_template=JEV_TEMPLATE, noul_options=["false", "true"],
                          temperature={"noul": 0.7, "choice": 1.3, "score": 2.0})


CASES = {
    # name: (model factory, decision config or None (the pipeline's default pick), number of random requests)
    "qwen3_5": (lambda: tiny_model("qwen3_5_text"), None, 50),
    "llama": (lambda: tiny_model("llama"), None, 50),
    "jev_qwen3_5": (lambda: tiny_jev(), None, 50),
    "jev_qwen3_5_template": (lambda: tiny_jev(), jev_decision_config(), 50),
    "qwen3_5_multimodal": (lambda: tiny_qwen3_5_multimodal(), None, 12),
    "qwen3": (lambda: tiny_model("qwen3"), None, 12),
    "qwen2": (lambda: tiny_model("qwen2"), None, 12),
    "mistral": (lambda: tiny_model("mistral"), None, 12),
}


def random_rounds(rng: random.Random, n: int) -> list[list[int]]:
    """A random partition of range(n) into rounds of random sizes, each in a random order."""
    order = list(range(n))
    rng.shuffle(order)
    rounds = []
    while order:
        size = rng.choice([1, 2, 3, 5, 8, 13, 21])
        rounds.append(order[:size])
        order = order[size:]
    return rounds


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    factory, decision_config, n = CASES[request.param]
    model, tok = factory(), tiny_tokenizer()
    rng = random.Random(zlib.crc32(request.param.encode()))  # str hash() differs per process
    requests = [random_request(rng) for _ in range(n)]
    decide = pipeline("decision", model=model, tokenizer=tok, decision_config=decision_config)
    expected = [decide(r) for r in requests]  # before patching: the untouched transformers model
    engine = flide.patch(model, tok, decision_config=decision_config)
    return request.param, engine, requests, expected, rng


def test_random_rounds_equal_pipeline(case):
    name, engine, requests, expected, rng = case
    assert sum(len(r["questions"]) for r in requests) >= len(requests)
    got = [None] * len(requests)
    for round_ in random_rounds(rng, len(requests)):
        for index, answer in zip(round_, engine.decide([requests[i] for i in round_])):
            got[index] = answer
    worst = max(max_difference(e, g) for e, g in zip(expected, got))
    assert worst <= PIPELINE_ATOL, f"{name}: largest probability difference {worst:.3g} from the pipeline"


def test_alone_equals_inside_any_round(case):
    name, engine, requests, expected, rng = case
    subset = rng.sample(range(len(requests)), min(12, len(requests)))
    alone = {i: engine.decide(requests[i]) for i in subset}
    for _ in range(2):
        others = rng.sample(range(len(requests)), min(10, len(requests)))
        mixed = list(dict.fromkeys(others + subset))
        rng.shuffle(mixed)
        answers = dict(zip(mixed, engine.decide([requests[i] for i in mixed])))
        for i in subset:
            worst = max_difference(alone[i], answers[i])
            assert worst <= ROUND_ATOL, f"{name}: request {i} alone vs in a round differs by {worst:.3g}"


def test_state_is_shared(case):
    """The state is computed once per request: the stream is much shorter than one sequence per question."""
    name, engine, requests, expected, rng = case
    prepared = [engine.prepare(r) for r in requests]
    many = [p for p in prepared if len(p.questions) >= 4 and p.prompt_tokens > 0]
    assert many, "the random requests should include some with several questions"
    for p in many:
        # Jev's template prints the question type before the state: one trunk per type. A question whose prompt
        # continues the state's last line break differently (no instructions: "\n\n\n") tokenizes the state's end
        # differently, so it gets a trunk of its own; the rest share one: at most two trunks per request.
        if "template" not in name:
            assert len(p.trunks) <= 2 < len(p.branches), [b.trunk for b in p.branches]
    assert sum(p.stream_tokens for p in many) < 0.7 * sum(p.prompt_tokens for p in many)


def test_split_rounds_and_oversized_requests_give_the_same_answers():
    """Tiny capacities force many rounds, and requests larger than the largest bucket run alone: same answers."""
    model, tok = tiny_model("qwen3_5_text", seed=3), tiny_tokenizer()
    rng = random.Random(7)
    requests = [random_request(rng, max_words=120) for _ in range(10)]
    roomy = flide.patch(model, tok)
    expected = roomy.decide(requests)
    tight = flide.patch(model, tok, config={"capacities": {"buckets": [128, 256], "requests": 3, "states": 4,
                                                           "branches": 8, "readout_rows": 8}})
    prepared = [tight.prepare(r) for r in requests]
    assert any(p.stream_tokens > 256 for p in prepared), "some request must exceed the largest bucket"
    got = tight.decide(requests)
    for e, g in zip(expected, got):
        assert max_difference(e, g) <= ROUND_ATOL


def test_no_state_forks_ablation_equals_the_pipeline():
    """`runtime.tokenization: full` gives every question its whole prompt (no shared state): same answers."""
    model, tok = tiny_model("qwen3_5_text", seed=5), tiny_tokenizer()
    rng = random.Random(11)
    requests = [random_request(rng, max_words=80) for _ in range(6)]
    forked = flide.patch(model, tok).decide(requests)
    whole = flide.patch(model, tok, config={"runtime": {"tokenization": "full"}}).decide(requests)
    for a, b in zip(forked, whole):
        assert max_difference(a, b) <= PIPELINE_ATOL


def test_full_readout_equals_selective():
    model, tok = tiny_model("qwen3_5_text", seed=9), tiny_tokenizer()
    rng = random.Random(13)
    requests = [random_request(rng, max_words=60) for _ in range(5)]
    selective = flide.patch(model, tok).decide(requests)
    full = flide.patch(model, tok, config={"kernels": {"readout": "full"}}).decide(requests)
    for a, b in zip(selective, full):
        assert max_difference(a, b) <= ROUND_ATOL


def test_patch_keeps_weights_and_hf_forward():
    """Patching swaps modules in place but keeps state_dict keys and tensors, and the HF forward still works."""
    model, tok = tiny_model("qwen3_5_text", seed=2), tiny_tokenizer()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    before_state = dict(model.state_dict())
    before = model(ids).logits
    flide.patch(model, tok)
    after_state = model.state_dict()
    assert sorted(after_state) == sorted(before_state)
    assert all(after_state[key] is before_state[key] or torch.equal(after_state[key], before_state[key])
               for key in before_state)
    assert torch.equal(model(ids).logits, before)
    assert type(model.model.layers[0].linear_attn).__name__ == "FlideGatedDeltaNet"
    assert type(model.model.layers[3].self_attn).__name__ == "FlideAttention"


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "llama", "qwen2"])
def test_fused_projections_share_the_weights_storage_and_follow_loaded_weights(model_type):
    """Projections of one input run as one GEMM (flide/models/fused.py): the layers' weights become views of the
    fused buffer (no second copy; the buffers stay out of state_dict), every mixer and MLP of the model is fused, a
    state_dict loaded after patching reaches the fused GEMMs, and batch-invariant mode fuses nothing."""
    from flide.models.flat import GATED_MLPS

    tok = tiny_tokenizer()
    model = tiny_model(model_type, seed=3)
    engine = flide.patch(model, tok)
    keys = sorted(model.state_dict())
    for block in engine.flat.blocks:
        mixer = block.mixer
        sizes, name, linears = ((mixer.in_sizes, "in_proj", mixer._in_projections()) if hasattr(mixer, "in_sizes")
                                else (mixer.qkv_sizes, "qkv", [mixer.q_proj, mixer.k_proj, mixer.v_proj]))
        assert sizes is not None and type(block.mlp).__name__ in GATED_MLPS and block.mlp_sizes is not None
        fused = getattr(mixer, f"{name}_weight")
        base, end = fused.data_ptr(), fused.data_ptr() + fused.numel() * fused.element_size()
        assert all(base <= layer.weight.data_ptr() < end for layer in linears)
    assert sorted(model.state_dict()) == keys  # the fused buffers are not persistent
    # weights loaded after patching (in place, into the views) are the weights the fused GEMMs use
    other = tiny_model(model_type, seed=4)
    model.load_state_dict(other.state_dict())
    request = {"state": "A calm note about billing.", "questions": {
        "t": {"type": "choice", "instructions": "Team?", "criteria": {"billing": None, "tech": None}},
        "u": {"type": "noul", "instructions": "Urgent?"}}}
    want = pipeline("decision", model=tiny_model(model_type, seed=4), tokenizer=tok)(request)
    assert max_difference(engine.decide(request), want) < 1e-5
    # batch-invariant mode fuses them too, through its invariant op (tests/test_batch_invariant.py)
    invariant = flide.patch(tiny_model(model_type, seed=3), tok, config={"kernels": {"batch_invariant": True}})
    assert all(block.mlp_sizes is not None and type(block.mlp.gate_proj).__name__ == "FlideLinear"
               for block in invariant.flat.blocks)


def test_a_second_patch_leaves_the_first_engine_its_own_weights():
    """Every fused buffer an engine reads (mixer projections, MLP gate/up) is its own: patching the same model again
    must not free or replace them (the first engine's CUDA graphs read them at their captured addresses; on the H200
    a second engine put the first's answers 0.065 off the pipeline when the MLP's buffer lived on the shared MLP
    module), and both engines still answer as the pipeline."""
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text", seed=3)
    request = {"state": "A calm note about billing.", "questions": {
        "t": {"type": "choice", "instructions": "Team?", "criteria": {"billing": None, "tech": None}},
        "u": {"type": "noul", "instructions": "Urgent?"}}}
    want = pipeline("decision", model=model, tokenizer=tok)(request)

    def buffers(engine):
        return [(t.data_ptr(), t) for block in engine.flat.blocks for name, t in block.mixer.named_buffers()
                if name.endswith("_weight")]

    first = flide.patch(model, tok)
    before = buffers(first)
    assert len(before) == 2 * len(first.flat.blocks)  # the mixer's and the MLP's
    second = flide.patch(model, tok, {"runtime": {"merge_lone_questions": False}})
    assert [p for p, _ in buffers(first)] == [p for p, _ in before]
    assert not {p for p, _ in before} & {p for p, _ in buffers(second)}
    for engine in (first, second):
        assert max_difference(engine.decide(request), want) < 1e-5


def test_custom_decision_config_on_a_causal_lm():
    """Labels, temperatures and the noul option order of a decision config are honoured as the pipeline does."""
    config = DecisionConfig(labels={"choice": list("abcdefgh"), "score": list("012345"), "noul": ["No", "Yes"]},
                            temperature={"choice": 0.5, "score": 1.7, "noul": 3.0}, noul_options=["false", "true"])
    model, tok = tiny_model("qwen3_5_text", seed=21), tiny_tokenizer()
    rng = random.Random(21)
    requests = [random_request(rng, max_words=80) for _ in range(10)]
    decide = pipeline("decision", model=model, tokenizer=tok, decision_config=config)
    expected = [decide(r) for r in requests]
    got = flide.patch(model, tok, decision_config=config).decide(requests)
    assert max(max_difference(e, g) for e, g in zip(expected, got)) <= PIPELINE_ATOL
