"""`kernels.fuse_attention_prep` (auto: on CUDA): which attention layers take the one-launch q / k preparation
(`flide.ops.qk_prep`: Qwen3.5's head norms + partial rotary) and the config's errors. The kernel itself:
tests/test_triton_kernels.py (interpreter, also inside a whole tiny model) and tests/gpu/test_qk_prep_gpu.py."""

from __future__ import annotations

import pytest

import flide
from flide.models.layers import FlideAttention
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.ops.qk_prep import qk_prep_triton, supports


def attention_of(family: str):
    model = tiny_model(family)
    return next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))


def test_only_qwen3_5_attention_takes_it():
    qwen = attention_of("qwen3_5_text")
    assert supports(qwen)
    assert FlideAttention(qwen, None, qk_prep_triton).qk_prep is qk_prep_triton
    llama = attention_of("llama")
    assert not supports(llama)  # no head norms: its modules stay
    assert FlideAttention(llama, None, qk_prep_triton).qk_prep is None
    assert FlideAttention(qwen, None).qk_prep is None  # off: the model's own modules


def test_on_a_cpu_model_auto_keeps_the_modules_and_on_is_refused_naming_the_field():
    engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer())  # auto: CPU, so the modules
    layers = [layer for layer in engine.model.modules() if isinstance(layer, FlideAttention)]
    assert layers and all(layer.qk_prep is None for layer in layers)
    # on (or YAML's true) needs CUDA; anything but auto / on / off is not a value of the field
    for value in ("on", True, 1, "yes"):
        with pytest.raises(ValueError, match="fuse_attention_prep"):
            flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer(),
                        config={"kernels": {"fuse_attention_prep": value}})
