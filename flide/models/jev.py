"""JevForDecision: linear scores of single-token verbalizers, read at the token before each `<|mark|>`, soft-capped."""

from __future__ import annotations

from torch import nn
from transformers.decision import Question

from .causal_lm import text_model_of
from .flat import Head


def jev_parts(model: nn.Module, tokenizer) -> tuple[nn.Module, Head]:
    config = model.config
    offsets = dict(config.offsets)
    rows = model.proj.out_features

    def option_rows(question: Question) -> list[int]:
        start = offsets[question.type]
        if start + len(question.options) > rows:
            raise ValueError(f"Question {question.name!r}: this decision head scores at most {rows - start} options "
                             f"for a {question.type} question, got {len(question.options)}.")
        return list(range(start, start + len(question.options)))

    return text_model_of(model), Head(model.proj.weight, model.proj.bias, option_rows, config.softcap)
