"""The chat-template fast path (flide/chat_template.py): a one-message render is prefix + content + suffix only for
templates that provably just print the content; every other template renders per prompt, and prompts stay equal
to transformers' renders either way."""

from __future__ import annotations

import random

import pytest
from transformers.decision import DecisionConfig

from flide.chat_template import ChatAffixes, prints_content_only
from flide.models.tiny import tiny_tokenizer
from flide.requests import PromptTokenizer, parse_request
from flide.testing import random_request

PRINTS = {
    "plain": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "type test in a condition": ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
                                 "{{ m.content|tojson }}{% endif %}{% endfor %}"),
    "type test in an expression": ("{% for m in messages %}{{ '<' + (m['content'] if m['content'] is string else "
                                   "m['content']|map(attribute='text')|join) + '>' }}{% endfor %}"),
    "negated type test": "{% for m in messages %}{% if not m.content is string %}x{% endif %}{{ m.content }}{% endfor %}",
}
TRANSFORMS = {
    "a filter": "{% for m in messages %}{{ m.content | trim }}{% endfor %}",
    "a method": "{% for m in messages %}{% if m.content.startswith('x') %}X{% endif %}{{ m.content }}{% endfor %}",
    "truthiness": "{% for m in messages %}{% if m.content %}{{ m.content }}{% endif %}{% endfor %}",
    "a comparison": "{% for m in messages %}{% if m.content == 'x' %}X{% endif %}{{ m.content }}{% endfor %}",
    "get()": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "an assignment": "{% for m in messages %}{% set c = m.content %}{{ c }}{% endfor %}",
    "a macro": "{% macro r(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{{ r(m)|trim }}{% endfor %}",
    "a filter block": "{% for m in messages %}{% filter upper %}{{ m.content }}{% endfilter %}{% endfor %}",
    "a set block": "{% for m in messages %}{% set t %}{{ m.content }}{% endset %}{{ t|trim }}{% endfor %}",
    "a membership test": "{% for m in messages %}{% if '<tool>' in m.content %}T{% endif %}{{ m.content }}{% endfor %}",
}


@pytest.mark.parametrize("name", list(PRINTS))
def test_templates_that_only_print_the_content_qualify(name):
    assert prints_content_only(PRINTS[name])


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_templates_that_look_at_or_change_the_content_do_not(name):
    assert not prints_content_only(TRANSFORMS[name])


def test_affixes_split_the_render_and_refuse_what_probes_contradict():
    import jinja2

    def renderer(source):
        template = jinja2.Environment().from_string(source)
        return lambda content: template.render(messages=[{"role": "user", "content": content}])

    affixes = ChatAffixes.find(PRINTS["plain"], renderer(PRINTS["plain"]))
    assert affixes == ChatAffixes("user: ", "\n")
    # a render that changes some contents (the AST check passed, the probes catch it): refused
    tricky = PRINTS["plain"]
    assert ChatAffixes.find(tricky, lambda c: renderer(tricky)(c).replace("  ", " ")) is None
    # content printed twice: the sentinel appears twice, refused
    twice = "{% for m in messages %}{{ m.content }}|{{ m.content }}{% endfor %}"
    assert prints_content_only(twice) and ChatAffixes.find(twice, renderer(twice)) is None


def test_prompts_through_the_affixes_equal_transformers_renders():
    """The tiny tokenizer's template (Qwen3.5's form) takes the fast path; every prompt of random requests (control
    tokens in user text included) equals apply_chat_template's render of the same conversation."""
    from transformers.utils.chat_template_utils import mark_control_tokens

    from flide.decision_prompt import render_decision_prompt

    tok = tiny_tokenizer()
    prompts = PromptTokenizer(tok, DecisionConfig())
    assert prompts.chat_affixes() is not None
    rng = random.Random(12)
    for _ in range(100):
        state, questions = parse_request(random_request(rng, max_questions=6, max_words=40), DecisionConfig(), 64)
        for question in questions:
            conversation = mark_control_tokens([{"role": "user", "content": render_decision_prompt(state, question)}],
                                               prompts.control_re)
            want = tok.apply_chat_template(conversation, chat_template=prompts.chat_template, tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
            assert prompts.render(state, [question]) == want
