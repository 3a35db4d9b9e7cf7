"""`runtime.residual: float32`: the residual stream of a half-precision model kept in fp32 between layers (the norms'
outputs, what the mixers, MLPs and head read, still rounded to the model's dtype). On CPU, tiny random models in
bf16 against the same weights in fp32 (the pipeline's function, equal to Flide's fp32 answers to 1e-5, tests/
test_exactness.py)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import flide
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.testing import growing_conversation, max_difference, random_request

FAMILIES = ["qwen3_5_text", "llama"]


def _requests(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [random_request(rng, max_questions=8, max_words=120) for _ in range(n)]


def _engine(model, tok, residual: str, **sections):
    return flide.patch(model, tok, config={"runtime": {"residual": residual}, **sections})


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_residual_keeps_bf16_answers_nearer_the_float32_model(family):
    """Seen on this CPU (30 requests, largest probability change of a request, mean): qwen3_5_text 5.3e-4 with the
    model's dtype vs 2.6e-4 with an fp32 stream, llama 3.7e-4 vs 2.2e-4."""
    tok, model = tiny_tokenizer(), tiny_model(family)
    requests = _requests(5, 30)
    want = _engine(copy.deepcopy(model), tok, "model").decide(requests)
    moved = {}
    for residual in ("model", "float32"):
        engine = _engine(copy.deepcopy(model).to(torch.bfloat16), tok, residual)
        moved[residual] = [max_difference(a, b) for a, b in zip(want, engine.decide(requests))]
    assert sum(moved["float32"]) < 0.75 * sum(moved["model"]), moved
    assert max(moved["float32"]) < 2e-3, moved


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_residual_changes_no_bit_of_a_float32_model(family):
    tok, model = tiny_tokenizer(), tiny_model(family)
    requests = _requests(8, 6)
    assert _engine(model, tok, "float32").decide(requests) == _engine(model, tok, "model").decide(requests)


def test_fp32_residual_stream_is_float32_and_mixers_read_the_models_dtype():
    """Where the dtypes go: every mixer reads bf16 (a forward pre-hook); the blocks take and return an fp32 stream."""
    tok, model = tiny_tokenizer(), tiny_model("qwen3_5_text").to(torch.bfloat16)
    engine = _engine(model, tok, "float32")
    mixer_inputs, streams = [], []
    hooks = [block.mixer.register_forward_pre_hook(lambda _, args: mixer_inputs.append(args[0].dtype))
             for block in engine.flat.blocks]
    for block in engine.flat.blocks[:-1]:  # the last block's parts run one by one (selective readout)

        def run_deferred(h, pending, ctx, original=block.run_deferred):
            out, mlp_out = original(h, pending, ctx)
            streams.append((h.dtype, pending.dtype, out.dtype))
            return out, mlp_out

        block.run_deferred = run_deferred  # FlatBlock.forward calls self.run_deferred
    try:
        engine.decide(_requests(2, 2))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(mixer_inputs) == len(engine.flat.blocks) and set(mixer_inputs) == {torch.bfloat16}
    assert len(streams) == len(engine.flat.blocks) - 1
    assert {(h, out) for h, _, out in streams} == {(torch.float32, torch.float32)}
    # the MLP output each block hands the next to add: the model's dtype (the first block adds fp32 zeros)
    assert [pending for _, pending, _ in streams] == [torch.float32] + [torch.bfloat16] * (len(streams) - 1)


def test_fp32_residual_resumes_from_checkpoints():
    """Checkpoint rounds run the layers eagerly (FlatBlock.run) with the same fp32 stream: a growing conversation's
    answers with checkpoints stay at those computed afresh, to bf16 rounding (the resumed rounds' GEMMs have other
    row counts, so not bitwise)."""
    tok, model = tiny_tokenizer(), tiny_model("qwen3_5_text").to(torch.bfloat16)
    off = {"graphs": "off"}
    fresh = flide.patch(model, tok, config={"runtime": {"residual": "float32", **off}})
    resumed = flide.patch(model, tok, config={"runtime": {"residual": "float32", **off},
                                              "checkpoints": {"enabled": True}})
    for request in growing_conversation(3, 4):
        assert max_difference(fresh.decide(request), resumed.decide(request)) < 5e-3
    assert resumed.checkpoints.stats()["hits"] > 0


def test_bad_residual_names_the_key():
    with pytest.raises(ValueError, match="runtime.residual"):
        flide.load_config({"runtime": {"residual": "bfloat16"}})
