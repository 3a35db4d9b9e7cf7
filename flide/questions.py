"""Parsing a request's questions: transformers' `Question.from_request`, faster where that is provably the same.

`parse_question` takes the common shape (string texts, criteria of the type's own form) through `_parse_simple`, a
mirror of from_request without huggingface_hub's strict-dataclass validation; everything else goes to transformers,
which parses it or names what is wrong. `QuestionCache` keeps what transformers parsed by its JSON text for the
routers, judges and guards that ask the same questions of every state.
"""

from __future__ import annotations

import functools
import json
import logging
import string
import threading

from transformers.decision import Question

log = logging.getLogger("flide.questions")


# transformers' question parsing (Question.from_request and its three strict schemas) as `_parse_simple` mirrors it,
# by hash of their source: another transformers version that changed them makes every parse go through it
_PARSE_SOURCE_SHA256 = "8cca05a4598901fd762c359e23a92bdd9f548f8dddb865e9b030e6ac4c688733"
_QUESTION_KEYS = frozenset(("type", "instructions", "criteria"))


@functools.lru_cache(maxsize=1)
def _parse_port_ok() -> bool:
    import hashlib
    import inspect

    import transformers.decision.template_utils as template_utils

    source = inspect.getsource(Question.from_request) + "".join(
        inspect.getsource(getattr(template_utils, name)) for name in ("NoulQuestion", "ChoiceQuestion", "ScoreQuestion"))
    if hashlib.sha256(source.encode()).hexdigest() != _PARSE_SOURCE_SHA256:
        log.info("flide: transformers' question parsing differs from the one Flide's fast parse mirrors; using it")
        return False
    return True


def _parse_simple(name: str, question: dict, config) -> Question | None:
    """`Question.from_request` for the common shape (string instructions and descriptions, criteria of the type's
    own form), or None for anything else, which transformers then parses (and rejects, naming the problem).

    Why: from_request validates the request through huggingface_hub's strict dataclasses, ~0.05 ms a question, a
    quarter of a RACE request's host time. This checks the same types for the shapes it accepts and builds the
    Question as from_request does (tested equal on random and hand-made questions); used only while transformers'
    parsing has the source it was written from (`_PARSE_SOURCE_SHA256`)."""
    if not _parse_port_ok() or not question.keys() <= _QUESTION_KEYS:
        return None
    kind, instructions, criteria = question.get("type"), question.get("instructions"), question.get("criteria")
    if instructions is not None and type(instructions) is not str:
        return None
    if kind == "noul":
        if criteria is None:
            criteria = {}
        elif type(criteria) is not dict or not all(key in ("true", "false") and (value is None or type(value) is str)
                                                   for key, value in criteria.items()):
            return None
        criteria = {option: criteria.get(option) for option in config.noul_options}
    elif kind == "choice":
        if type(criteria) is not dict or not criteria or not all(
                type(key) is str and (value is None or type(value) is str) for key, value in criteria.items()):
            return None
    elif kind == "score":
        if type(criteria) is not list or not criteria or not all(type(level) is str for level in criteria):
            return None
        criteria = {str(index): level for index, level in enumerate(criteria)}
    else:
        return None
    labels = config.labels.get(kind) or (["Yes", "No"] if kind == "noul" else list(string.ascii_uppercase))
    if len(labels) < len(criteria):
        return None
    options = list(criteria)
    return Question(name, kind, instructions, options, labels[:len(options)], list(criteria.values()))


def parse_question(name: str, question: dict, config) -> Question:
    """transformers' `Question.from_request`, through `_parse_simple` where that mirrors it."""
    return _parse_simple(name, question, config) or Question.from_request(name, question, config)


class QuestionCache:
    """Parsed questions by their JSON text (key order kept: a choice's options are ordered), LRU, thread-safe.

    Routers, judges and agent guards ask the same questions with every state; `Question.from_request` validates
    each field through huggingface_hub's strict dataclasses, ~0.15 ms a question, which is most of parsing. Parsing
    is a pure function of (name, question, decision config), and Flide never mutates a parsed Question, so a
    request may share the object with earlier ones. Questions that are not JSON (in-process callers may pass any
    object) are parsed every time.

    Only what transformers parses is kept: the common shape that `_parse_simple` takes costs ~3 us a question,
    less than the cache's own key (`json.dumps`), lock and LRU upkeep cost (a MultiRC request of ~35 questions
    prepared 0.1-0.2 ms slower with the cache than without it on this CPU, session 22)."""

    def __init__(self, entries: int = 4096):
        from collections import OrderedDict

        self.entries = entries
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def parse(self, name: str, question: dict, decision_config) -> Question:
        simple = _parse_simple(name, question, decision_config)
        if simple is not None:
            return simple
        try:
            key = (name, json.dumps(question, ensure_ascii=False))
        except (TypeError, ValueError):  # not JSON: parsed every time (`_parse_simple` declined it above)
            return Question.from_request(name, question, decision_config)
        with self._lock:
            parsed = self._items.get(key)
            if parsed is not None:
                self._items.move_to_end(key)
                return parsed
        parsed = Question.from_request(name, question, decision_config)  # raises for bad questions: not cached
        with self._lock:
            self._items[key] = parsed
            if len(self._items) > self.entries:
                self._items.popitem(last=False)
        return parsed
