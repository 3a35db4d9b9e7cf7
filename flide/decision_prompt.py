"""transformers' DECISION_PROMPT, rendered faster: outside jinja's sandbox, and in plain Python where that is exact.

The prompt each question of a request gets (inside the tokenizer's chat template) when the model has no decision
template of its own. `render_decision_prompt` uses the Python port (`_decision_prompt_text`) while transformers'
template has the text it was written from and the port matches jinja on probes; else the unsandboxed jinja template.
"""

from __future__ import annotations

import functools
import logging
import string
from typing import Any

from transformers.decision import DECISION_PROMPT, Question
from transformers.utils.chat_template_utils import _compile_jinja_template

log = logging.getLogger("flide.decision_prompt")


@functools.lru_cache(maxsize=1)
def _decision_prompt():
    """transformers' DECISION_PROMPT compiled as `prepare_inputs` compiles it (same jinja options, filters and
    globals), but outside jinja's sandbox: it is transformers' own template, not a model's, and the sandbox's check
    of every attribute access was half its render time (0.22 -> 0.10 ms a question). The text is the same (tested
    against the sandboxed render in tests/test_requests.py)."""
    import jinja2
    import jinja2.ext

    sandboxed = _compile_jinja_template(DECISION_PROMPT).environment
    env = jinja2.Environment(trim_blocks=sandboxed.trim_blocks, lstrip_blocks=sandboxed.lstrip_blocks,
                             extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = sandboxed.filters["tojson"]
    env.globals.update({name: sandboxed.globals[name] for name in ("raise_exception", "strftime_now", "dict",
                                                                  "namespace")})
    return env.from_string(DECISION_PROMPT)


# The DECISION_PROMPT that `_decision_prompt_text` reproduces, by hash: any other text (a transformers release that
# changed it) makes every render go through jinja
_DECISION_PROMPT_SHA256 = "63bb2c962ff391c47a21f1c6958bdb4f5676f850efd4a50c49632c85a797a89c"


def _decision_prompt_text(state: Any, question: Question) -> str | None:
    """DECISION_PROMPT's text for (state, question) in plain Python, or None where only jinja renders it exactly
    (a state, instructions or description that is not a string or None: the template's `tojson` escapes HTML).

    Why: the jinja render is ~85 us a question (its namespace, loops and filters), most of a RACE request's
    rendering. Used only while DECISION_PROMPT is the text this was written from (`_DECISION_PROMPT_SHA256`) and
    after `_decision_prompt_port_ok` found it equal to jinja's render on probe questions of every type."""
    texts = [state, question.instructions, *question.descriptions]
    if not all(x is None or isinstance(x, str) for x in texts):
        return None
    labels, options, kind = question.labels, question.options, question.type
    lines = [question.instructions or ""]
    for i, option in enumerate(options):
        label, answer = str(labels[i]), question.descriptions[i] or ""
        if kind == "noul":
            answer = answer or (str(option) if labels != ["Yes", "No"] else "")
            if answer:
                lines.append(f"{label}: {answer}")
        else:
            if kind == "choice":
                answer = f"{option}: {answer}" if answer else str(option)
            lines.append(f"{label}. {answer}")
    head = (state or "") + "\n\n" + "\n".join(line for line in lines if line) + "\n"
    if kind == "noul":
        return f"{head}Answer {labels[0]} or {labels[1]} only."
    noun = "letter" if labels == list(string.ascii_uppercase[:len(labels)]) else "label"
    return (f"{head}Answer with the {noun} of the {'option' if kind == 'choice' else 'level'} that fits best "
            f"({labels[0]} to {labels[-1]}) only.")


@functools.lru_cache(maxsize=1)
def _decision_prompt_port_ok() -> bool:
    """Whether `_decision_prompt_text` may stand in for the template: the same template text, and the same output
    as jinja on probe questions of every type (labels, descriptions, letters, empty instructions)."""
    import hashlib

    if hashlib.sha256(DECISION_PROMPT.encode()).hexdigest() != _DECISION_PROMPT_SHA256:
        log.info("flide: transformers' DECISION_PROMPT differs from the one Flide's fast render reproduces; "
                 "rendering it with jinja")
        return False
    from transformers.decision import DecisionConfig

    configs = [DecisionConfig(), DecisionConfig(labels={"noul": ["True", "False"], "choice": ["1", "2", "3"],
                                                        "score": ["lo", "mid", "hi"]})]
    probes = [
        {"type": "noul", "instructions": "Is it spam?"},
        {"type": "noul", "instructions": "Spam?", "criteria": {"true": "Ads", "false": None}},
        {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Money", "tech": None, "other": ""}},
        {"type": "score", "instructions": "", "criteria": ["low", "mid", "high"]},
        {"type": "score", "instructions": "How urgent?", "criteria": [{"1": "calm"}, "2", "3"]},
    ]
    for i, (probe, config) in enumerate((p, c) for p in probes for c in configs):
        try:
            question = Question.from_request(f"q{i}", probe, config)
        except ValueError:
            continue
        for state in ("A state.\nWith lines.", "", None):
            fast = _decision_prompt_text(state, question)
            if fast is not None and fast != _decision_prompt().render(state=state, question=question):
                log.warning("flide: the fast DECISION_PROMPT render differs from jinja's on a probe; using jinja")
                return False
    return True


def decision_prompt_after_state(question: Question) -> str | None:
    """What DECISION_PROMPT prints after a string state for `question` (the port's text with an empty state, which
    starts with the newlines that end the state), or None where the port does not render it: then render the whole
    prompt (`render_decision_prompt`). For a string state s, `render_decision_prompt(s, question)` is s followed by
    this: a request's prompts share its (long) state without it being copied into each question's render."""
    if not _decision_prompt_port_ok():
        return None
    text = _decision_prompt_text("", question)
    return text if text is not None and text.startswith("\n") else None


def render_decision_prompt(state: Any, question: Question) -> str:
    """DECISION_PROMPT rendered for one question: the Python port where it is exact, else jinja (unsandboxed)."""
    if _decision_prompt_port_ok():
        text = _decision_prompt_text(state, question)
        if text is not None:
            return text
    return _decision_prompt().render(state=state, question=question)
