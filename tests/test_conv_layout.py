"""`kernels.fuse_conv_layout`: which GDN layers take the fused conv layout (the conv also writing q / k normalised,
v and the gates for fla's state call, `flide.ops.fork_conv.QKV_KERNELS` + `flide.ops.gated_delta.
LAID_OUT_STATE_KERNELS`), decided once when a layer is swapped in. The kernels themselves: tests/test_triton_kernels.py
(interpreter, also a whole tiny model on the laid-out path) and tests/gpu (test_fork_conv_gpu.py, test_gated_delta_
gpu.py, every engine test)."""

from __future__ import annotations

import pytest

import flide
from flide.models.layers import FlideGatedDeltaNet
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.ops import fork_conv, gated_delta


def gdn_original():
    model = tiny_model("qwen3_5_text")
    return next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))


@pytest.mark.parametrize("conv,delta,fuse,fused", [
    ("fork_conv_triton", "gated_delta_fla", True, True),
    ("fork_conv_triton", "gated_delta_fla_cuda", True, True),
    ("fork_conv_triton", "gated_delta_fla", False, False),  # kernels.fuse_conv_layout: false
    ("fork_conv_triton", "gated_delta_fla_wy", True, False),  # the WY fork lays out its own inputs
    ("fork_conv_reference", "gated_delta_fla", True, False),  # no fused form of the reference conv
    ("fork_conv_triton", "gated_delta_reference", True, False),  # no laid-out state call
])
def test_which_layers_take_the_fused_layout(conv, delta, fuse, fused):
    conv_op, delta_op = getattr(fork_conv, conv), getattr(gated_delta, delta)
    layer = FlideGatedDeltaNet(gdn_original(), conv_op, delta_op, fuse_conv_layout=fuse)
    if fused:
        assert layer.conv_qkv_op is fork_conv.fork_conv_qkv_triton
        assert layer.laid_out_state_op is gated_delta.gated_delta_fla_states_laid_out
    else:
        assert layer.conv_qkv_op is None or layer.laid_out_state_op is None


def test_heads_of_unequal_or_odd_widths_keep_the_separate_launches():
    original = gdn_original()
    original.head_v_dim = original.head_k_dim * 2  # one conv channel tile can no longer be one head of each
    layer = FlideGatedDeltaNet(original, fork_conv.fork_conv_triton, gated_delta.gated_delta_fla)
    assert layer.conv_qkv_op is None


def test_the_switch_is_validated_and_changes_no_cpu_answer():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="fuse_conv_layout"):
        flide.patch(tiny_model("qwen3_5_text"), tok, config={"kernels": {"fuse_conv_layout": "yes"}})
    request = {"state": "The cat sat on the mat.", "questions": {"q": {"type": "noul", "instructions": "A cat?"}}}
    on = flide.patch(tiny_model("qwen3_5_text"), tok).decide(request)
    off = flide.patch(tiny_model("qwen3_5_text"), tok, config={"kernels": {"fuse_conv_layout": False}}).decide(request)
    assert on == off  # the CPU's variants (reference conv and gated delta) have no fused form either way


@pytest.mark.parametrize("form,chunked", [("recurrent", False), ("chunked", True), ("auto", None)])
def test_the_question_form_is_decided_when_a_layer_is_swapped_in(form, chunked):
    """`kernels.gated_delta_questions`: chunked question calls only where the layer has the fused layout and a variant
    with a chunked question call (fla); auto follows fla.CHUNKED_QUESTIONS."""
    from flide.ops.gated_delta import fla

    layer = FlideGatedDeltaNet(gdn_original(), fork_conv.fork_conv_triton, gated_delta.gated_delta_fla,
                               question_form=form)
    assert layer.chunked_questions is (fla.CHUNKED_QUESTIONS if chunked is None else chunked)


def test_batch_invariant_layers_keep_fixed_question_tiles():
    """A nested fork's question launch widens its tiles in long streams (`questions_chunked.NESTED_BLOCK_V_MIN_TOKENS`),
    which changes those rows' bits with the bucket: batch-invariant mode's layers ask for fixed tiles."""
    layer = FlideGatedDeltaNet(gdn_original(), fork_conv.fork_conv_triton, gated_delta.gated_delta_fla,
                               question_form="chunked", batch_invariant=True)
    assert layer.chunked_questions and layer.fixed_tiles
    assert not FlideGatedDeltaNet(gdn_original(), fork_conv.fork_conv_triton, gated_delta.gated_delta_fla,
                                  question_form="chunked").fixed_tiles
    tok = tiny_tokenizer()
    for invariant in (True, False):
        engine = flide.patch(tiny_model("qwen3_5_text"), tok, config={"kernels": {"batch_invariant": invariant}})
        mixers = [block.mixer for block in engine.flat.blocks if hasattr(block.mixer, "conv_op")]
        assert mixers and all(mixer.fixed_tiles is invariant for mixer in mixers)


@pytest.mark.parametrize("conv,delta,fuse", [
    ("fork_conv_triton", "gated_delta_fla", False),  # no fused layout
    ("fork_conv_triton", "gated_delta_fla_cuda", True),  # no chunked question call
    ("fork_conv_reference", "gated_delta_reference", True),  # the CPU's variants
])
def test_chunked_questions_where_a_layer_cannot_is_an_error_naming_the_field(conv, delta, fuse):
    conv_op, delta_op = getattr(fork_conv, conv), getattr(gated_delta, delta)
    with pytest.raises(ValueError, match="gated_delta_questions"):
        FlideGatedDeltaNet(gdn_original(), conv_op, delta_op, fuse_conv_layout=fuse, question_form="chunked")
    with pytest.raises(ValueError, match="gated_delta_questions"):
        FlideGatedDeltaNet(gdn_original(), conv_op, delta_op, fuse_conv_layout=fuse, question_form="wy")
    assert not FlideGatedDeltaNet(gdn_original(), conv_op, delta_op, fuse_conv_layout=fuse,
                                  question_form="auto").chunked_questions


def test_the_question_form_is_validated_and_recurrent_changes_no_cpu_answer():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="gated_delta_questions"):
        flide.patch(tiny_model("qwen3_5_text"), tok, config={"kernels": {"gated_delta_questions": "wy"}})
    with pytest.raises(ValueError, match="gated_delta_questions"):  # the CPU's reference variant has no chunked call
        flide.patch(tiny_model("qwen3_5_text"), tok, config={"kernels": {"gated_delta_questions": "chunked"}})
    request = {"state": "The cat sat on the mat.", "questions": {"q": {"type": "noul", "instructions": "A cat?"}}}
    auto = flide.patch(tiny_model("qwen3_5_text"), tok).decide(request)
    recurrent = flide.patch(tiny_model("qwen3_5_text"), tok,
                            config={"kernels": {"gated_delta_questions": "recurrent"}}).decide(request)
    assert auto == recurrent
