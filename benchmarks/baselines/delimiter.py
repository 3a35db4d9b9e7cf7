"""Multi-item scoring with a delimiter (as SGLang's `multi_item_scoring_delimiter`), in plain causal attention.

Per request and per state (trunk): one sequence `state, DELIM, question 1, DELIM, question 2, ...` (each question's
own tokens after the state), one forward pass, every question read at its read position (the last token of its
prompt for the default decision prompt). Positions simply continue along the sequence.

Cheap (each state once, one pass for all questions, nothing copied), but not exact: with a plain causal mask a
question sees every question before it and their delimiters, and later questions sit at shifted positions, so its
answers differ from `pipeline("decision")` (tests/test_bench.py checks that they do). SGLang pairs the delimiter with
an attention mask that hides the other items; this baseline shows what the inputs alone cost without one.
"""

from __future__ import annotations

import numpy as np
import torch

from flide.requests import PreparedRequest

try:
    from .common import PlainBaseline, as_ids
except ImportError:  # run as a script
    from common import PlainBaseline, as_ids


class DelimiterBaseline(PlainBaseline):
    """`decide(requests)`: each request alone, its state and all its questions in one causal sequence."""

    name = "delimiter"

    def __init__(self, model, tokenizer, decision_config=None, max_questions: int = 64, delimiter: str | None = None):
        """delimiter: the token put before each question (default: the pad token, else the end-of-sequence token)."""
        super().__init__(model, tokenizer, decision_config, max_questions)
        tok = self.prompts.tokenizer
        token = delimiter or tok.pad_token or tok.eos_token
        if token is None:
            raise ValueError("DelimiterBaseline needs a delimiter token: the tokenizer has no pad or eos token.")
        self.delimiter_id = tok.convert_tokens_to_ids(token)
        if self.delimiter_id is None or self.delimiter_id == tok.unk_token_id:
            raise ValueError(f"The delimiter {token!r} is not a single token of this tokenizer.")

    def tokens(self, request) -> int:
        prepared = self.prepare(request)
        return prepared.stream_tokens + len(prepared.branches)  # one delimiter per question prompt

    def sequence(self, prepared: PreparedRequest, index: int) -> tuple[np.ndarray, dict[str, int]]:
        """The token sequence of trunk `index` with its questions, and where each question is read in it."""
        trunk = prepared.trunks[index]
        n, parts, reads = len(trunk), [trunk], {}
        offset = n
        for branch in prepared.branches:
            if branch.trunk != index:
                continue
            parts.append(np.asarray([self.delimiter_id], dtype=np.int64))
            offset += 1
            for question, read in zip(branch.questions, branch.reads):
                reads[question.name] = int(read) if read < n else offset + int(read) - n
            parts.append(branch.tokens)
            offset += len(branch.tokens)
        return np.concatenate(parts), reads

    def _scores(self, prepared: PreparedRequest) -> dict[str, torch.Tensor]:
        device = self.device
        logits: dict[str, torch.Tensor] = {}
        for index in range(len(prepared.trunks)):
            ids, reads = self.sequence(prepared, index)
            names = list(reads)
            rows = torch.tensor([reads[name] for name in names], device=device)
            out = self.model(input_ids=as_ids(ids, device), use_cache=False, logits_to_keep=rows).logits[0]
            logits.update({name: out[i] for i, name in enumerate(names)})
        return logits
