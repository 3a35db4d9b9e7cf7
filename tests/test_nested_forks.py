"""Nested forks (`runtime.nested_forks`): lines that several questions of a state share after it are computed once,
as a sub-trunk those questions fork from. Whole tiny models against transformers' `pipeline("decision")`, question by
question (fp32, CPU), on judge-shaped requests (`flide.testing.candidate_request`), with fewer tokens in the stream
than without nesting; and the settings that keep it off."""

from __future__ import annotations

import random

import numpy as np
import torch
import pytest
from transformers import pipeline

import flide
from transformers.decision import DecisionConfig
from transformers.models.jev.configuration_jev import JEV_TEMPLATE

from flide.models.tiny import tiny_jev, tiny_model, tiny_tokenizer
from flide.ops.gated_delta import SUB_STATE_SLOTS, sub_slots
from flide.round import Shape, build_round
from flide.sub_trunks import MIN_SUB_TOKENS
from flide.testing import candidate_request, layout_sub_slots, max_difference

PIPELINE_ATOL = 1e-5  # as tests/test_exactness.py
ROUND_ATOL = 1e-6


def jev_decision_config() -> DecisionConfig:
    """Jev's own prompt (the question type printed before the state, read at a `<|mark|>`), as test_exactness.py."""
    return DecisionConfig(chat_template=JEV_TEMPLATE, noul_options=["false", "true"],
                          temperature={"noul": 0.7, "choice": 1.3, "score": 2.0})

CASES = {
    "qwen3_5": (lambda: tiny_model("qwen3_5_text"), None),
    "llama": (lambda: tiny_model("llama"), None),
    # the type printed before the state, reads at marks: sub-trunks must keep every read in the leaves
    "jev_qwen3_5_template": (lambda: tiny_jev(), jev_decision_config()),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    factory, decision_config = CASES[request.param]
    model, tok = factory(), tiny_tokenizer()
    rng = random.Random(7)
    requests = [candidate_request(rng) for _ in range(10)]
    decide = pipeline("decision", model=model, tokenizer=tok, decision_config=decision_config)
    expected = [decide(r) for r in requests]  # before patching: the untouched transformers model
    nested = flide.patch(model, tok, {"runtime": {"nested_forks": "on"}}, decision_config=decision_config)
    flat = flide.patch(model, tok, {"runtime": {"nested_forks": "off"}}, decision_config=decision_config)
    return request.param, nested, flat, requests, expected


def test_sub_trunks_are_made_and_save_tokens(case):
    name, nested, flat, requests, _ = case
    with_subs = [nested.prepare(r) for r in requests]
    without = [flat.prepare(r) for r in requests]
    assert all(not p.subs for p in without)
    assert sum(len(p.subs) for p in with_subs) >= len(requests), name  # about one per question line
    saved = sum(a.stream_tokens - b.stream_tokens for a, b in zip(without, with_subs))
    assert saved > 0 and all(a.prompt_tokens == b.prompt_tokens for a, b in zip(without, with_subs))
    for a, b in zip(without, with_subs):  # every prompt holds the same tokens, cut once more
        for x, y in zip(a.branches, b.branches):
            whole = [b.trunks[y.trunk], *([b.subs[y.sub].tokens] if y.sub >= 0 else []), y.tokens]
            assert np.array_equal(np.concatenate([a.trunks[x.trunk], x.tokens]), np.concatenate(whole))
            assert np.array_equal(x.reads, y.reads)
            if y.sub >= 0:
                assert len(b.subs[y.sub].tokens) >= MIN_SUB_TOKENS


def test_nested_rounds_equal_pipeline(case):
    name, nested, flat, requests, expected = case
    together = nested.decide(requests)  # one round (or a few) with every request's sub-trunks
    worst = max(max_difference(e, g) for e, g in zip(expected, together))
    assert worst <= PIPELINE_ATOL, f"{name}: largest probability difference {worst:.3g} from the pipeline"
    for request, answer in zip(requests[:4], together):
        assert max_difference(nested.decide(request), answer) <= ROUND_ATOL  # alone as inside the round
    plain = flat.decide(requests)
    assert max(max_difference(a, b) for a, b in zip(plain, together)) <= ROUND_ATOL


def test_nested_forks_on_needs_split_tokenization():
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    with pytest.raises(ValueError, match="nested_forks: on.*tokenization is 'full'"):
        flide.patch(model, tok, {"runtime": {"nested_forks": "on", "tokenization": "full"}})
    engine = flide.patch(model, tok, {"runtime": {"tokenization": "full"}})  # auto: off, with the reason logged
    assert not engine.prompts.nested
    assert not engine.prepare(candidate_request(random.Random(1))).subs


def test_batch_invariant_mode_keeps_nested_forks_off():
    """A leaf asked alone has no sub-trunk, so its attention's sums would group differently than inside its request:
    batch-invariant mode (a question asked alone keeps its bits) runs without sub-trunks, and `on` says why not."""
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    with pytest.raises(ValueError, match="nested_forks: on.*batch-invariant"):
        flide.patch(model, tok, {"runtime": {"nested_forks": "on"}, "kernels": {"batch_invariant": True}})
    engine = flide.patch(model, tok, {"kernels": {"batch_invariant": True}})
    assert not engine.prompts.nested and not engine.prepare(candidate_request(random.Random(1))).subs


def test_nested_forks_value_is_checked():
    with pytest.raises(ValueError, match="runtime.nested_forks"):
        flide.patch(tiny_model("llama"), tiny_tokenizer(), {"runtime": {"nested_forks": "sometimes"}})


def test_conv_ranges_and_sub_slots_are_derived_once_per_forward(monkeypatch):
    """The GDN layers read the conv's ranges (a leaf's sub-trunk in place of its state) and the branch rows'
    sub-trunk state slots from the forward's context, derived once (`flat.conv_range`, `flat.sub_state_slots`), not
    each layer from the round (two pointwise kernels a layer on a GPU, and a dozen small ones)."""
    import flide.models.flat as flat
    import flide.models.layers as layers

    engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer(), {"runtime": {"nested_forks": "on"}})
    assert engine.flat.nested
    request = candidate_request(random.Random(5))
    want = engine.decide(request)
    calls = []
    for name in ("conv_range", "sub_state_slots"):
        derive = getattr(flat, name)
        monkeypatch.setattr(flat, name, lambda r, derive=derive, name=name: calls.append(name) or derive(r))
        monkeypatch.setattr(layers, name, lambda r, name=name: pytest.fail(f"a GDN layer derived `{name}` itself"))
    assert max_difference(engine.decide(request), want) == 0.0
    assert calls == ["conv_range", "sub_state_slots"]


@pytest.mark.parametrize("spare", [0, 5])
def test_sub_slots_of_real_requests_equal_their_layouts(case, spare):
    """The sub-trunk state slots derived on the device from a round's fields (`gated_delta.sub_slots`) equal the
    host side's truth (each request's branch -> sub-trunk rows) on prepared judge-shaped requests, in a round of
    their exact size and with spare rows, with room for every sub-trunk and with fewer slots than they hold."""
    name, nested, _, requests, _ = case
    prepared = [nested.prepare(r) for r in requests]
    subs = sum(len(p.subs) for p in prepared)
    assert subs > 4, name
    tokens = sum(p.stream_tokens for p in prepared)
    states = sum(len(p.trunks) for p in prepared)
    branches = sum(len(p.branches) + len(p.subs) - len(p.lone_branches) for p in prepared)
    reads = sum(len(b.reads) for p in prepared for b in p.branches)
    built = build_round(prepared, Shape(tokens + spare, states + spare, branches + spare, reads + spare,
                                        nested.max_options), nested.pad_id)
    t = built.tensors
    for cap in (SUB_STATE_SLOTS, subs // 2):
        got = sub_slots(t.branch_start, t.branch_len, t.branch_state, t.sub_lo, t.sub_hi, cap)
        assert got.tolist() == layout_sub_slots(built, cap), (name, cap)
    assert max(layout_sub_slots(built, SUB_STATE_SLOTS)) == min(subs, SUB_STATE_SLOTS) - 1  # every sub-trunk named


def test_gated_delta_layers_keep_zeroed_sub_flags_only_with_nested_forks():
    """Each GDN layer of a nested-fork engine keeps the int32 flags its question kernel's leaves wait on
    (`new_sub_flags`: one per slot, value head and value column, zero between calls), as a buffer that moves with the
    model and stays out of its state_dict; an engine without nested forks has none."""
    from flide.models.layers import FlideGatedDeltaNet

    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    keys = set(model.state_dict())
    for nested in ("on", "off"):
        engine = flide.patch(model, tok, {"runtime": {"nested_forks": nested}})
        layers = [m for m in engine.flat.modules() if isinstance(m, FlideGatedDeltaNet)]
        assert layers
        for layer in layers:
            if nested == "off":
                assert not hasattr(layer, "sub_flags")
                continue
            flags = layer.sub_flags
            assert flags.dtype == torch.int32 and not flags.any()
            assert flags.numel() == SUB_STATE_SLOTS * layer.original.num_v_heads * layer.head_v_dim
            assert any(b is flags for b in layer.buffers())
        assert set(model.state_dict()) == keys
