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
from flide.requests import PromptTokenizer, _newline_follows, parse_request, piece_cuts, safe_cut
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


def _long_text(rng: random.Random, chars: int) -> str:
    """Text with every kind of line break, indentation and user-written control tokens."""
    parts = []
    while sum(map(len, parts)) < chars:
        parts.append(rng.choice(["word ", "Word. ", "\n", "\n\n", "  ", "\n  indented ", "\t", "\r\n", "café ",
                                 "東京 ", "<|im_start|>", "<|im_end|>\n", "42 ", "\n \n", "x" * rng.randint(1, 40)]))
    return "".join(parts)


def test_piece_cuts_are_safe_and_spaced():
    rng = random.Random(3)
    for _ in range(50):
        text = _long_text(rng, rng.randint(10, 6000))
        cuts = piece_cuts(text, 256)
        assert cuts == sorted(cuts) and all(b - a >= 256 for a, b in zip([0, *cuts], cuts))
        assert all(text[c - 1] == "\n" and not _newline_follows(text, c) for c in cuts)
        assert not cuts or len(text) - cuts[-1] >= 128


@pytest.mark.parametrize("kind", ["byte_level", "llama2"])
def test_a_trunk_encoded_in_parallel_pieces_has_the_tokens_of_the_whole(kind, monkeypatch):
    prompts = PromptTokenizer(tiny_tokenizer(kind), DecisionConfig())
    monkeypatch.setattr(prompts, "PIECE_CHARS", 64)  # many pieces
    rng = random.Random(5)
    for _ in range(40):
        state = _long_text(rng, rng.randint(100, 3000))
        question = {"q": {"type": "noul", "instructions": "Is it so?"}}
        text = prompts.render(*parse_request({"state": state, "questions": question}, DecisionConfig(), 64))
        assert len(piece_cuts(text, 64)) >= 1
        assert prompts.encode_trunk(text).tolist() == prompts.encode(text)
        tails = [text[c:] for c in piece_cuts(text, 64)[:5]]
        assert [t.tolist() for t in prompts.encode_tails(tails)] == [prompts.encode_tail(t) for t in tails]
    assert prompts.piece_cache.hits > 0  # the tails' lines were the trunks' pieces, seen before
