"""The piece cache (flide/piece_cache.py): prompt pieces seen before are not encoded again, and a prompt's tokens are
the same with the cache as without it; an agent's growing history is encoded only where it is new."""

from __future__ import annotations

import random

import numpy as np
from transformers.decision import DecisionConfig

from flide.models.tiny import tiny_tokenizer
from flide.piece_cache import PieceCache
from flide.requests import PromptTokenizer, parse_request
from flide.testing import growing_conversation, random_request


def test_lru_by_characters():
    cache = PieceCache(max_chars=10)
    cache.put("abcd", True, np.arange(2))
    cache.put("efgh", False, np.arange(3))
    assert cache.get("abcd", True) is not None  # now the most recent
    assert cache.get("abcd", False) is None  # another key: the same text at a prompt's start
    cache.put("ijkl", True, np.arange(1))  # 12 characters: the least recent ("efgh") goes
    assert cache.get("efgh", False) is None and cache.get("ijkl", True) is not None
    assert cache.chars == 8 and len(cache) == 2
    cache.put("x" * 11, True, np.arange(1))  # larger than the whole cache: not kept
    assert len(cache) == 2
    ids = cache.get("abcd", True)
    assert not ids.flags.writeable  # shared by every request that holds the piece


def test_tokens_with_and_without_the_cache_are_equal():
    tok, config = tiny_tokenizer(), DecisionConfig()
    cached = PromptTokenizer(tok, config)
    rng = random.Random(12)
    for _ in range(40):
        state, questions = parse_request(random_request(rng, max_questions=6, max_words=200), config, 64)
        a = cached.prepare(state, questions)
        b = PromptTokenizer(tok, config, piece_cache=PieceCache(0)).prepare(state, questions)  # nothing kept
        assert [t.tolist() for t in a.trunks] == [t.tolist() for t in b.trunks]
        assert [x.tokens.tolist() for x in a.branches] == [x.tokens.tolist() for x in b.branches]
        assert [x.reads.tolist() for x in a.branches] == [x.reads.tolist() for x in b.branches]
        again = cached.prepare(state, questions)  # every tail now whole in the cache: one look-up each
        assert [x.tokens.tolist() for x in again.branches] == [x.tokens.tolist() for x in b.branches]
    assert cached.piece_cache.hits > 0


def test_a_tail_seen_before_is_one_look_up(monkeypatch):
    """A question asked again of another state: its tail (all its lines) comes from the cache whole, not line by
    line; the ids are the lines' joined."""
    import flide.requests

    tok, config = tiny_tokenizer(), DecisionConfig()
    prompts = PromptTokenizer(tok, config)
    questions = {"q": {"type": "choice", "instructions": "Which one?", "criteria": {"a": "first", "b": None}}}
    prompts.prepare(*parse_request({"state": "One state.", "questions": questions}, config, 64))
    splits = []
    real = flide.requests.safe_lines
    monkeypatch.setattr(flide.requests, "safe_lines", lambda text: splits.append(text) or real(text))
    hits = prompts.piece_cache.hits
    second = prompts.prepare(*parse_request({"state": "Another state.", "questions": questions}, config, 64))
    assert splits == [] and prompts.piece_cache.hits > hits  # the tail was not cut into lines again
    fresh = PromptTokenizer(tok, config, piece_cache=PieceCache(0)).prepare(
        *parse_request({"state": "Another state.", "questions": questions}, config, 64))
    assert len(splits) == 1  # without a cache, line by line
    assert second.branches[0].tokens.tolist() == fresh.branches[0].tokens.tolist()


def test_a_growing_history_is_encoded_only_where_it_is_new(monkeypatch):
    tok, config = tiny_tokenizer(), DecisionConfig()
    prompts = PromptTokenizer(tok, config)
    monkeypatch.setattr(prompts, "PIECE_CHARS", 256)
    encoded: list[int] = []
    real = prompts.tokenizer.__class__.__call__

    def counting(self, texts, *args, **kwargs):
        encoded.append(sum(len(t) for t in texts))
        return real(self, texts, *args, **kwargs)

    monkeypatch.setattr(prompts.tokenizer.__class__, "__call__", counting)
    steps = growing_conversation(6, 8, questions=2)
    history = [len(str(step["state"])) for step in steps]
    for i, step in enumerate(steps):
        encoded.clear()
        prompts.prepare(*parse_request(step, config, 64))
        if i:  # the earlier history came from the cache: what was encoded is about the new part
            assert sum(encoded) < (history[i] - history[i - 1]) + 2 * 256 + 2000, (i, sum(encoded), history[i])
    assert history[-1] > 4 * (history[1] - history[0])


def test_the_engine_takes_its_bound_from_the_config():
    import pytest

    import flide
    from flide.config import load_config
    from flide.models.tiny import tiny_model

    model, tok = tiny_model("llama"), tiny_tokenizer()
    off = flide.patch(model, tok, config={"runtime": {"piece_cache_chars": 0}})
    off.decide({"state": "Some state.\nMore.", "questions": {"q": {"type": "noul", "instructions": "Yes?"}}})
    assert off.prompts.piece_cache.max_chars == 0 and len(off.prompts.piece_cache) == 0
    assert flide.patch(model, tok).prompts.piece_cache.max_chars == 1 << 23
    with pytest.raises(ValueError, match="runtime.piece_cache_chars"):
        load_config({"runtime": {"piece_cache_chars": -1}})


def test_a_cache_of_no_characters_counts_what_it_misses():
    """A cache of 0 characters is not asked piece by piece, but still counts each piece encoded as a miss (the
    flide_piece_cache_misses metric), as many as a cache that keeps them misses on the same first request."""
    tok, config = tiny_tokenizer(), DecisionConfig()
    rng = random.Random(3)
    for _ in range(10):
        state, questions = parse_request(random_request(rng, max_questions=6, max_words=200), config, 64)
        off, on = PieceCache(0), PieceCache(1 << 20)
        PromptTokenizer(tok, config, piece_cache=off).prepare(state, questions)
        PromptTokenizer(tok, config, piece_cache=on).prepare(state, questions)
        assert off.misses == on.misses > 0 and off.hits == on.hits == 0 and len(off) == 0
