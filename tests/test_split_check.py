"""Split tokenization only where it is exact (flide/split_check.py): `runtime.tokenization: auto` splits prompts for
byte-level BPE with Qwen's split regex and for SentencePiece vocabularies whose newline is a byte token (Llama 2),
and tokenizes them whole where a safe cut can change tokens (GPT-2's regex, SentencePiece pieces across newlines);
answers equal `pipeline("decision")` either way; `split` refuses a tokenizer whose probes change a token."""

from __future__ import annotations

import random

import numpy as np
import pytest
from transformers import pipeline
from transformers.decision import DecisionConfig

import flide
from flide.config import load_config
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.requests import PromptTokenizer, parse_request, safe_cut
from flide.split_check import PROBE_TEXTS, resolve_tokenization
from flide.testing import max_difference, random_request


@pytest.mark.parametrize("kind,mode", [("byte_level", "split"), ("gpt2", "full"), ("sentencepiece", "full"),
                                       ("llama2", "split")])
def test_auto_splits_only_where_the_cut_is_exact(kind, mode):
    assert PromptTokenizer(tiny_tokenizer(kind), DecisionConfig()).mode == mode


@pytest.mark.parametrize("kind", ["gpt2", "sentencepiece"])
def test_the_probes_find_a_cut_that_changes_tokens(kind):
    """What auto protects against is real: these tokenizers tokenize some probe differently in two parts."""
    prompts = PromptTokenizer(tiny_tokenizer(kind), DecisionConfig(), "full")
    changed = 0
    for text in PROBE_TEXTS:
        for cut in {safe_cut(text, limit) for limit in range(len(text) + 1)} - {0}:
            changed += prompts.encode(text) != prompts.encode(text[:cut]) + prompts.encode_tail(text[cut:])
    assert changed
    with pytest.raises(ValueError, match="runtime.tokenization: split` is not exact"):
        resolve_tokenization(prompts, "split")


def test_a_byte_level_tokenizer_without_the_proof_is_refused_by_the_probes(caplog):
    """GPT-2's regex passes the structural check (ByteLevel) but not the probes: auto warns and tokenizes whole."""
    with caplog.at_level("WARNING", logger="flide.requests"):
        assert PromptTokenizer(tiny_tokenizer("gpt2"), DecisionConfig()).mode == "full"
    assert "changes tokens" in caplog.text


def test_full_is_never_probed():
    assert PromptTokenizer(tiny_tokenizer("sentencepiece"), DecisionConfig(), "full").mode == "full"


def test_tokenization_accepts_auto_and_rejects_others():
    assert load_config(None).runtime.tokenization == "auto"
    with pytest.raises(ValueError, match="runtime.tokenization"):
        load_config({"runtime": {"tokenization": "maybe"}})


@pytest.mark.parametrize("kind,mode", [("gpt2", "full"), ("sentencepiece", "full"), ("llama2", "split")])
def test_answers_equal_the_pipeline_with_every_kind_of_tokenizer(kind, mode):
    tok = tiny_tokenizer(kind)
    model = tiny_model("llama", vocab_size=len(tok))
    rng = random.Random(17)
    requests = [random_request(rng, max_questions=6, max_words=80) for _ in range(8)]
    # states with the line breaks and indentation where these tokenizers merge across a safe cut
    requests += [{"state": text, "questions": {"q": {"type": "noul", "instructions": "Is it so?"}}}
                 for text in PROBE_TEXTS[:3]]
    decide = pipeline("decision", model=model, tokenizer=tok)
    expected = [decide(r) for r in requests]
    engine = flide.patch(model, tok)
    assert engine.prompts.mode == mode
    for want, got in zip(expected, engine.decide(requests)):
        assert max_difference(want, got) < 1e-5


def test_split_llama2_tokens_equal_whole_prompts():
    """The SentencePiece case split tokenization keeps: every request's prompts, split into trunk + tails, carry the
    tokens of the prompts tokenized whole, and the state is shared."""
    tok = tiny_tokenizer("llama2")
    split, full = PromptTokenizer(tok, DecisionConfig()), PromptTokenizer(tok, DecisionConfig(), "full")
    assert split.mode == "split"
    rng = random.Random(23)
    shared = 0
    for _ in range(30):
        request = random_request(rng, max_questions=6, max_words=120)
        state, questions = parse_request(request, DecisionConfig(), 64)
        a, b = split.prepare(state, questions), full.prepare(state, questions)
        for ba, bb in zip(a.branches, b.branches):
            assert np.concatenate([a.trunks[ba.trunk], ba.tokens]).tolist() == bb.tokens.tolist()
            assert ba.reads.tolist() == bb.reads.tolist()
        shared += len(a.trunks) < len(a.branches)
    assert shared >= 5
