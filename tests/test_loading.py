"""Engine.from_pretrained on checkpoints saved with save_pretrained (a causal LM and a Jev decision model), and
random-weight models built from a config file."""

from __future__ import annotations

import json

import torch

import flide
from flide.loading import load_tokenizer, random_model
from flide.models.tiny import tiny_jev, tiny_model, tiny_tokenizer
from flide.testing import max_difference

REQUEST = {"state": "I was charged twice for my order.\nPlease refund!",
           "questions": {"refund": {"type": "noul", "instructions": "Is a refund requested?"},
                         "tone": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "angry"]}}}


def test_from_pretrained_causal_lm(tmp_path):
    model, tok = tiny_model("qwen3_5_text", seed=4), tiny_tokenizer()
    expected = flide.patch(model, tok).decide(REQUEST)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = flide.Engine.from_pretrained(str(tmp_path), config="configs/default.yaml")
    assert type(engine.model).__name__ == "Qwen3_5ForCausalLM"
    assert max_difference(expected, engine.decide(REQUEST)) <= 1e-6


def test_from_pretrained_jev(tmp_path):
    model, tok = tiny_jev(seed=6), tiny_tokenizer()
    expected = flide.patch(model, tok).decide(REQUEST)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = flide.Engine.from_pretrained(str(tmp_path), config={"runtime": {"dtype": "float32"}})
    assert type(engine.model).__name__ == "JevForDecision"
    assert max_difference(expected, engine.decide(REQUEST)) <= 1e-6


def test_random_model_from_a_config_file(tmp_path):
    config = tiny_model("llama").config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = random_model(tmp_path / "config.json", dtype="float32", device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    answers = flide.patch(model, tiny_tokenizer()).decide(REQUEST)
    assert list(answers) == ["refund", "tone"]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    try:
        flide.Engine.from_pretrained(str(tmp_path / "nothing"))
    except ValueError as error:
        assert "nothing" in str(error)
    else:
        raise AssertionError("expected a ValueError")
    try:
        load_tokenizer(tmp_path / "nothing")
    except ValueError as error:
        assert "tokenizer" in str(error)
    else:
        raise AssertionError("expected a ValueError")


def test_patched_model_deep_copies():
    """A patched model can be deep-copied (kernel handles are shared, weights copied): the copy answers the same and
    patching it leaves the first engine alone."""
    import copy

    from flide.models.tiny import tiny_model, tiny_tokenizer
    from flide.testing import max_difference

    tok = tiny_tokenizer()
    request = {"state": "The parcel arrived broken.", "questions": {"q": {"type": "noul", "instructions": "Broken?"}}}
    for kind in ("qwen3_5_text", "llama"):
        model = tiny_model(kind)
        engine = flide.patch(model, tok)
        before = engine.decide(request)
        clone = copy.deepcopy(model)
        assert next(clone.parameters()).data_ptr() != next(model.parameters()).data_ptr()
        assert clone.state_dict().keys() == model.state_dict().keys()
        assert max_difference(flide.patch(clone, tok).decide(request), before) == 0
        assert max_difference(engine.decide(request), before) == 0
