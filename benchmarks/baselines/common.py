"""What the plain-transformers baselines share: requests -> the pipeline's own prompt tokens (split into the state
part and one tail per question), the label logits -> System One answers exactly as `pipeline("decision")` makes them.

Prompts are tokenized with Flide's `PromptTokenizer` (its tests check it equals transformers' `prepare_inputs` token
for token): each state is tokenized once, so the baselines pay the same host-side cost as Flide and a comparison
measures the model work only.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from flide.requests import PreparedRequest, PromptTokenizer, parse_request


class PlainBaseline:
    """A causal LM answering decision requests with plain transformers forward passes. Subclasses write `_scores`."""

    name = "plain"

    def __init__(self, model, tokenizer, decision_config=None, max_questions: int = 64):
        from transformers.decision import DecisionConfig
        from transformers.decision.modeling_utils import DecisionMixin

        if isinstance(model, DecisionMixin):
            raise TypeError(f"{type(self).__name__} reads label logits of a causal LM; {type(model).__name__} is a "
                             f"decision model with its own head.")
        if decision_config is None:  # as pipeline("decision") picks it for a model without a decision head
            decision_config = DecisionConfig.from_pretrained(getattr(model, "name_or_path", "") or "")
        decision_config.validate_noul_options()
        self.model = model.eval()
        self.decision_config = decision_config
        self.max_questions = max_questions
        self.prompts = PromptTokenizer(tokenizer, decision_config)
        self.lock = threading.Lock()  # held while tokenizing: threads that share this baseline take turns there

    def for_thread(self, tokenizer=None) -> PlainBaseline:
        """The same baseline for another submitting thread: the same model, another tokenizer (a copy of this one's
        when none is given; fast tokenizers are not safe to share while they encode) and its own lock."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.__dict__.pop("_label_ids", None)
        clone.prompts = (self.prompts.copy_for_thread() if tokenizer is None
                         else PromptTokenizer(tokenizer, self.decision_config, self.prompts.mode, resolved=True))
        clone.lock = threading.Lock()
        return clone

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @functools.cached_property
    def _label_ids(self):
        from transformers.decision import label_token_ids

        return functools.cache(functools.partial(label_token_ids, self.prompts.tokenizer))

    def prepare(self, request: Any) -> PreparedRequest:
        """Validates and tokenizes a request (the pipeline's prompts, split into states and question tails)."""
        state, questions = parse_request(request, self.decision_config, self.max_questions)
        return self.prompts.prepare(state, questions)

    def tokens(self, request: Any) -> int:
        """Tokens one request makes the model compute."""
        return self.prepare(request).stream_tokens

    def decide(self, requests: list) -> list[dict]:
        """Answers each request (one at a time) -> a list of {question name: answer}."""
        out = []
        for request in requests:
            with self.lock:
                prepared = self.prepare(request)
            with torch.inference_mode():
                logits = self._scores(prepared)  # question name -> vocabulary logits at its read
            out.append(self._answers(prepared, logits))
        return out

    def _scores(self, prepared: PreparedRequest) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _answers(self, prepared: PreparedRequest, logits: dict[str, torch.Tensor]) -> dict:
        """The label logits through the decision config's logits processors, softmax, `Question.answer` (the
        pipeline's `process_scores` + `postprocess`)."""
        processors = self.decision_config.logits_processors
        answers = {}
        for branch in prepared.branches:
            tail = torch.from_numpy(branch.tail)
            for question in branch.questions:
                row = logits[question.name]
                scores = row[self._label_ids(tuple(question.labels))].float().cpu()
                scores = processors[question.type](tail, scores)
                answers[question.name] = question.answer(scores.softmax(-1).tolist())
        return {q.name: answers[q.name] for q in prepared.questions}


def as_ids(tokens, device) -> torch.Tensor:
    """[1, n] int64 input ids on the model's device."""
    return torch.as_tensor(tokens, dtype=torch.long, device=device)[None]
