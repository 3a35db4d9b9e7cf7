"""Model families Flide runs: `model_type` -> how to find the decoder stack and the head of a transformers model.

`adapt` swaps the token mixers of the stack for Flide's (in place, weights untouched) and returns the flat model.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..config import KernelConfig
from ..ops.registry import needs_cuda_triton, resolve_all
from .flat import FlatModel, Head
from .fused import separate
from .layers import FlideAttention, FlideGatedDeltaNet, swap_linears
from .jev import jev_parts
from .causal_lm import causal_lm_parts

# model_type -> parts(model, tokenizer) -> (text_model, Head)
FAMILIES: dict[str, Callable] = {
    "qwen3_5_text": causal_lm_parts,  # Qwen3.5: Gated DeltaNet + gated full attention
    "qwen3_5": causal_lm_parts,  # the multimodal Qwen3.5: its text model (text requests)
    "llama": causal_lm_parts,  # the plain full-attention families, through one generic patch
    "qwen3": causal_lm_parts,
    "qwen2": causal_lm_parts,
    "mistral": causal_lm_parts,
    "jev": jev_parts,  # JevForDecision: a decision head read at the marks, on a Qwen3.5 backbone
}


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def swap_mixers(text_model: nn.Module, ops: dict, fuse_conv_layout: bool = True,
                qk_prep: Callable | None = None, nested_ops: dict | None = None, question_form: str = "auto",
                batch_invariant: bool = False) -> None:
    """Replaces every decoder layer's attention / Gated DeltaNet module with Flide's (idempotent); `ops` is
    `resolve_all(kernels)`, `fuse_conv_layout` `kernels.fuse_conv_layout`, `qk_prep` the attention layers' fused q / k
    preparation (`kernels.fuse_attention_prep`), used where the layer's is the one it computes; `nested_ops` the
    variants' nested-fork companions (`flide.ops.registry.nested`) when rounds may hold sub-trunks, else None;
    `question_form` `kernels.gated_delta_questions`, `batch_invariant` `kernels.batch_invariant`."""
    nested_ops = nested_ops or {}
    for index, layer in enumerate(text_model.layers):
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, name):
                raise ValueError(f"Decoder layer {index} ({type(layer).__name__}) has no `{name}`: its residual "
                                 f"layout is not one Flide runs.")
        if hasattr(layer, "linear_attn"):
            original = getattr(layer.linear_attn, "original", layer.linear_attn)
            layer.linear_attn = FlideGatedDeltaNet(original, ops["fork_conv"], ops["gated_delta"],
                                                   ops["gated_norm"], fuse_conv_layout=fuse_conv_layout,
                                                   nested_op=nested_ops.get("gated_delta"),
                                                   question_form=question_form,
                                                   batch_invariant=batch_invariant)
        elif hasattr(layer, "self_attn"):
            original = getattr(layer.self_attn, "original", layer.self_attn)
            layer.self_attn = FlideAttention(original, ops["fork_attention"], qk_prep,
                                             nested_op=nested_ops.get("fork_attention"))
        else:
            raise ValueError(f"Decoder layer {index} ({type(layer).__name__}) has neither attention nor Gated "
                             "DeltaNet.")


def adapt(model: nn.Module, tokenizer, kernels: KernelConfig, residual: str = "model",
          nested_ops: dict | None = None) -> FlatModel:
    """The flat model of a transformers model; raises ValueError for a model type Flide does not know. `residual`:
    the residual stream's dtype (`runtime.residual`: model | float32); `nested_ops`: see `swap_mixers`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"Flide does not support model type {model_type!r} ({type(model).__name__}); supported "
                         f"model types: {', '.join(supported_model_types())}.")
    text_model, head = FAMILIES[model_type](model, tokenizer)
    device = next(model.parameters()).device
    ops = resolve_all(kernels, device)  # `auto` picks for the device the model is on
    qk_prep = None
    if kernels.fuse_attention_prep != "off":
        reason = needs_cuda_triton() if device.type == "cuda" else f"the model is on {device}, not on a CUDA GPU"
        if reason is not None and kernels.fuse_attention_prep == "on":
            raise ValueError(f"`kernels.fuse_attention_prep: on` runs a Triton kernel on CUDA: {reason}.")
        if reason is None:
            from ..ops.qk_prep import qk_prep_triton as qk_prep
    question_form = kernels.gated_delta_questions
    if question_form == "auto" and kernels.batch_invariant:
        # the chunked form's rows depend on no other row by construction, but its invariance tests have not run on a
        # GPU: batch-invariant mode keeps the recurrent question kernel unless `chunked` is asked for
        question_form = "recurrent"
    swap_mixers(text_model, ops, kernels.fuse_conv_layout, qk_prep, nested_ops, question_form, kernels.batch_invariant)
    # the decoder's own nn.Linear layers stay unless another `linear` variant is picked (batch-invariant mode)
    if kernels.linear != "torch":
        separate(text_model)
    swap_linears(text_model, None if kernels.linear == "torch" else ops["linear"])
    flat = FlatModel(text_model, head, ops["readout"], selective=ops["readout"].gathers_rows_first,
                     residual_fp32=residual == "float32")
    for block in flat.blocks:  # projections of one input as one GEMM each (fused.py), also through an invariant op
        block.fuse_projections(ops["gated_mlp"])
    return flat


__all__ = ["FAMILIES", "FlatModel", "Head", "adapt", "supported_model_types", "swap_mixers"]
