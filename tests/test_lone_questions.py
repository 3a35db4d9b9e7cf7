"""`runtime.merge_lone_questions`: a state asked one question runs as one sequence with it (one state segment, no
branch row, its reads rows of that segment), where forking would share nothing. Whole tiny engines (hybrid Qwen3.5,
whose GDN layers then run the question in the states' call; Llama; Jev with its type-first template, where a type
asked once has a trunk of its own) against the pipeline, and against the same engine forking every question."""

from __future__ import annotations

import random

import numpy as np
import pytest
from transformers import pipeline

import flide
from flide.models.tiny import tiny_jev, tiny_model, tiny_tokenizer
from flide.round import Shape, build_round, footprint
from flide.testing import max_difference, random_question, random_request, synthetic_request
from test_nested_forks import jev_decision_config

PIPELINE_ATOL = 1e-5  # as tests/test_exactness.py
ROUND_ATOL = 1e-6

CASES = {
    "qwen3_5": (lambda: tiny_model("qwen3_5_text"), None),
    "llama": (lambda: tiny_model("llama"), None),
    "jev_qwen3_5_template": (lambda: tiny_jev(), jev_decision_config()),
}


def lone_requests(rng: random.Random, n: int) -> list[dict]:
    """One question each (every one lone), and a few with several questions (lone only where a prompt gets a trunk
    of its own: a type asked once under Jev's template)."""
    requests = [{"state": random_request(rng, 1)["state"], "questions": {"q": random_question(rng)}}
                for _ in range(n)]
    return requests + [random_request(rng, 6) for _ in range(4)]


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    factory, decision_config = CASES[request.param]
    model, tok = factory(), tiny_tokenizer()
    requests = lone_requests(random.Random(5), 10)
    decide = pipeline("decision", model=model, tokenizer=tok, decision_config=decision_config)
    expected = [decide(r) for r in requests]  # before patching: the untouched transformers model
    merged = flide.patch(model, tok, decision_config=decision_config)  # the default
    forked = flide.patch(model, tok, {"runtime": {"merge_lone_questions": False}}, decision_config=decision_config)
    return request.param, merged, forked, requests, expected


def test_lone_questions_continue_their_state(case):
    name, merged, forked, requests, _ = case
    for request in requests[:10]:
        a, b = merged.prepare(request), forked.prepare(request)
        assert len(a.lone_branches) == len(a.trunks) == 1 and not b.lone_branches, name
        assert footprint(a).branches == 0 and footprint(b).branches == 1
        assert a.stream_tokens == b.stream_tokens
        states, questions = a.round_layout.counts[:2]
        assert (states, questions) == (a.stream_tokens, 0)  # every token in the state segment
        assert a.round_layout.counts[3] == 0 and b.round_layout.counts[3] == 1  # no branch row


def test_lone_questions_equal_pipeline(case):
    name, merged, forked, requests, expected = case
    together = merged.decide(requests)
    worst = max(max_difference(e, g) for e, g in zip(expected, together))
    assert worst <= PIPELINE_ATOL, f"{name}: largest probability difference {worst:.3g} from the pipeline"
    for request, answer in zip(requests[8:], together[8:]):
        assert max_difference(merged.decide(request), answer) <= ROUND_ATOL  # alone as inside the round
    assert max(max_difference(a, b) for a, b in zip(forked.decide(requests), together)) <= ROUND_ATOL


def test_merged_layout_reads_the_question_in_the_state_segment():
    state, question = np.arange(10, 50), np.arange(60, 67)
    request = synthetic_request(state, [question])
    request.merge_lone = True
    two = synthetic_request(np.arange(5, 25), [np.arange(7), np.arange(3)])  # two questions: they fork
    two.merge_lone = True
    assert request.lone_branches == {0: 0} and two.lone_branches == {}
    built = build_round([two, request], Shape(128, 2, 2, 3, 2), 0)
    t = built.tensors
    assert t.state_start[:2].tolist() == [0, 20] and t.state_len[:2].tolist() == [20, 47]
    assert t.branch_start.tolist() == [67, 74] and t.branch_len.tolist() == [7, 3]  # after every state
    assert t.branch_state.tolist() == [0, 0]
    assert t.input_ids[20:67].tolist() == [*state.tolist(), *question.tolist()]
    assert t.positions[20:67].tolist() == list(range(47))  # the question's positions continue the state's
    assert not t.trunk_hi[20:67].any() and t.seg_lo[20:67].eq(20).all()  # state tokens: causal in their segment
    assert t.readout_rows.tolist() == [73, 76, 66]  # two's questions' last tokens, then the lone question's


def test_checkpoints_batch_invariance_and_the_flag_keep_lone_questions_forked():
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    request = {"state": "A short state.", "questions": {"q": {"type": "noul", "instructions": "Is it short?"}}}
    for config in ({"checkpoints": {"enabled": True}}, {"kernels": {"batch_invariant": True}},
                   {"runtime": {"merge_lone_questions": False}}):
        assert not flide.patch(model, tok, config).prepare(request).lone_branches, config
    assert flide.patch(model, tok).prepare(request).lone_branches
