"""Rendering a one-message chat as prefix + content + suffix, where the chat template provably does just that.

Every question of a request is wrapped in the tokenizer's chat template (`apply_chat_template` of one user message
holding its DECISION_PROMPT text): ~70 us a question on a 2-core CPU, most of the host time of a request with many
questions (MultiRC: ~34). For the templates that only *print* a message's content, the output is
`prefix + content + suffix` for every string content, so the two affixes are rendered once and each question is a
string concatenation.

When a template qualifies (`ChatAffixes.find`), decided once per tokenizer, template and arguments:
- its jinja AST uses the content (`m['content']` / `m.content`) only as an operand of what an `{{ }}` prints
  (string concatenation), or as the subject of a type test (`is string`, `is defined`, ...) whose answer is the
  same for every string, in a condition whose branch is then fixed; no other node may name `content` (no filters,
  methods, comparisons, truthiness, `.get('content')`, assignments of it);
- one render with a sentinel content (a quote, a backslash, a newline, `<`, `&` and private-use characters, which
  escaping or any filter would change) holds the sentinel exactly once: that splits prefix and suffix;
- renders of probe contents (newlines, braces, jinja syntax, control-token look-alikes, non-ASCII, empty) equal
  prefix + probe + suffix.
Anything else renders through `apply_chat_template`, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

SENTINEL = '\ue000"\\\n<&{{x}}\ue001'
PROBES = ("", "a", "Line one.\n\nLine two.\n", "{{ 1 + 1 }} {% raw %}x{% endraw %}", "<|im_start|>user\nhi",
          "Ünïcödé 東京 \t tab", "  leading and trailing spaces  ", '"quoted" \\ backslash')
# jinja tests whose answer for any str is known: a condition on them picks the same branch for every content
TYPE_TESTS = {"string": True, "defined": True, "undefined": False, "none": False, "mapping": False,
              "number": False, "integer": False, "float": False, "boolean": False, "sequence": True,
              "iterable": True, "callable": False}


@dataclass(frozen=True)
class ChatAffixes:
    """What a one-user-message render puts around the message's content."""

    prefix: str
    suffix: str

    def render(self, content: str) -> str:
        return self.prefix + content + self.suffix

    @staticmethod
    def find(template: str, render) -> ChatAffixes | None:
        """The affixes of `template` (jinja source) if it only prints a message's content (see the module
        docstring); `render(content) -> str` renders the one-message chat exactly as it will be used. None if not."""
        if not prints_content_only(template):
            return None
        try:
            sentinel_render = render(SENTINEL)
        except Exception:  # noqa: BLE001 (a template that cannot render the sentinel: not for this fast path)
            return None
        if sentinel_render.count(SENTINEL) != 1:
            return None
        prefix, suffix = sentinel_render.split(SENTINEL)
        affixes = ChatAffixes(prefix, suffix)
        if any(render(probe) != affixes.render(probe) for probe in PROBES):
            return None
        return affixes


def _is_content_ref(node) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"


def _type_test_value(test) -> bool | None:
    """The value of a condition that is a known type test (or its negation) of a content reference, for any str;
    None when the condition is something else."""
    from jinja2 import nodes

    if isinstance(test, nodes.Not):
        inner = _type_test_value(test.node)
        return None if inner is None else not inner
    if isinstance(test, nodes.Test) and _is_content_ref(test.node) and not test.args and not test.kwargs:
        return TYPE_TESTS.get(test.name)
    return None


def _mentions_content(node) -> bool:
    from jinja2 import nodes

    if _is_content_ref(node):
        return True
    if isinstance(node, nodes.Const) and isinstance(node.value, str) and "content" in node.value:
        return True
    if isinstance(node, (nodes.Name, nodes.Getattr)) and "content" in getattr(node, "name", getattr(node, "attr", "")):
        return True
    return any(_mentions_content(child) for child in node.iter_child_nodes())


def prints_content_only(template: str) -> bool:
    """Whether the jinja `template` uses a message's content only by printing it (see the module docstring)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return False

    # statements whose body's output is transformed or reused (a filter block, a macro's or a set block's text):
    # they may not touch the content at all
    opaque = (nodes.FilterBlock, nodes.Macro, nodes.CallBlock, nodes.AssignBlock)

    def ok(node, printed: bool) -> bool:
        if _is_content_ref(node):
            return printed
        if isinstance(node, nodes.Output):
            return all(ok(child, True) for child in node.nodes)
        if isinstance(node, (nodes.Add, nodes.Concat)):  # string concatenation keeps the content as it is
            return all(ok(child, printed) for child in node.iter_child_nodes())
        if isinstance(node, nodes.CondExpr):
            value = _type_test_value(node.test)
            if value is not None:  # the branch every string content takes; the other never runs
                chosen = node.expr1 if value else node.expr2
                return chosen is None or ok(chosen, printed)
            return ok(node.test, False) and all(ok(x, printed) for x in (node.expr1, node.expr2) if x is not None)
        if isinstance(node, nodes.If):
            value = _type_test_value(node.test)
            if value is True:
                return all(ok(child, False) for child in node.body)
            rest = [*node.elif_, *(node.else_ or [])]
            if value is False:
                return all(ok(child, False) for child in rest)
            return ok(node.test, False) and all(ok(child, False) for child in [*node.body, *rest])
        if isinstance(node, opaque) or isinstance(node, nodes.Expr):
            # an expression other than a concatenation (filters, calls, comparisons, tests, subscripts), or a block
            # whose text is transformed: it may not use the content in any way
            return not _mentions_content(node)
        return all(ok(child, False) for child in node.iter_child_nodes())  # other statements: their parts

    return all(ok(child, False) for child in tree.body)
