"""Causal LMs answer through the next-token logits of their option labels (transformers' DECISION_PROMPT)."""

from __future__ import annotations

import functools

from torch import nn
from transformers.decision import label_token_ids

from .flat import Head


def text_model_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM, a multimodal model (its language model), or a bare text model."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    if not hasattr(inner, "layers"):
        raise ValueError(f"{type(model).__name__} has no decoder stack Flide can find.")
    return inner


def causal_lm_parts(model: nn.Module, tokenizer) -> tuple[nn.Module, Head]:
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None:
        raise ValueError(f"{type(model).__name__} has no lm_head: load it with AutoModelForCausalLM (or as a "
                         f"decision model) so its answers can be read.")
    tok = getattr(tokenizer, "tokenizer", tokenizer)

    @functools.lru_cache(maxsize=4096)
    def rows_of_labels(labels: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(label_token_ids(tok, labels))

    def option_rows(question) -> list[int]:
        return list(rows_of_labels(tuple(question.labels)))

    return text_model_of(model), Head(lm_head.weight, getattr(lm_head, "bias", None), option_rows)
