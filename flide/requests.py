"""System One request -> questions -> trunk tokens + branch tokens.

Parsing, validation and prompt rendering are transformers' own (`transformers.decision`): each question's prompt is
the one `prepare_inputs` renders for the state with that question alone. What Flide adds is the split of those
prompts into a shared trunk and a branch per question, tokenized so that the state is tokenized once:

- The trunk of a prompt is its question-independent prefix, found by rendering the same prompt with two probe
  instructions and cutting where they differ, then moving the cut back to a *safe boundary*: right after a newline
  whose following whitespace holds no other line break. Byte-level BPE pre-tokenizers (Qwen, Llama 3, GPT) never
  let a pre-token cross such a point, so `tokens(text) == tokens(text[:cut]) + tokens(text[cut:])` there.
- Prompts whose trunks are the same text share one trunk (usually one per request; templates that print the
  question type before the state give one per type). Each distinct trunk is tokenized once, each tail once.

`runtime.tokenization: full` tokenizes every prompt whole instead; the tests check the two agree token for token
with `prepare_inputs` on random and real requests. `auto` (the default) splits only for tokenizers where the cut is
proven and probed exact (flide/split_check.py), and tokenizes whole otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cached_property
from itertools import chain, pairwise
from typing import Any

import numpy as np
from transformers.decision import DECISION_PROMPT, Question
from transformers.decision.template_utils import MARK, SPLIT
from transformers.tokenization_utils_base import AddedToken
from transformers.utils.chat_template_utils import (
    _CONTROL_TOKEN_END,
    _CONTROL_TOKEN_START,
    _encode_chat_piece,
    _get_control_token_patterns,
    _get_template_variables,
    encode_marked_chat,
    mark_control_tokens,
)

from .ascii_bpe import AsciiByteLevelBPE
from .chat_template import ChatAffixes
from .config import RuntimeConfig
from .decision_prompt import decision_prompt_after_state, render_decision_prompt
from .piece_cache import PieceCache
from .questions import QuestionCache, parse_question

log = logging.getLogger("flide.requests")


class RequestError(ValueError):
    """A request the engine cannot answer. `field` names the offending field (dotted path) and `status` is the HTTP
    status a server answers with: 422 malformed, 400 unanswerable by this model, 413 too large."""

    def __init__(self, field: str, message: str, status: int = 422):
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.status = field, message, status

    def __reduce__(self):  # rebuilt from its fields: it crosses process boundaries (prepare workers)
        return (type(self), (self.field, self.message, self.status))


@dataclass
class Branch:
    """One prompt's tokens after its trunk (and its sub-trunk, if any), and where its questions are read."""

    trunk: int  # index into PreparedRequest.trunks
    tokens: np.ndarray  # [n] int64
    reads: np.ndarray  # [len(questions)] int64 read rows, counted from the start of the prompt (trunk included)
    questions: list[Question]
    tail: np.ndarray  # the prompt's tokens after its last mark (what transformers' logits processors receive)
    options: list[list[int]] = field(default_factory=list)  # head rows of each question's options (set by the engine)
    sub: int = -1  # index into PreparedRequest.subs: the shared lines between its trunk and `tokens` (-1: none)


@dataclass
class SubTrunk:
    """Lines that several prompts of one trunk continue with before they differ (nested forks: a judge's question
    line before each candidate answer; flide/sub_trunks.py finds them): computed once in the stream, forked from its
    trunk like a question, and forked from by each of its branches (`Branch.sub`)."""

    trunk: int
    tokens: np.ndarray  # [n] int64, no sentinels


@dataclass
class PreparedRequest:
    """A validated, tokenized request: its trunks (states) and branches (one per prompt)."""

    trunks: list[np.ndarray]
    branches: list[Branch]
    questions: list[Question] = field(default_factory=list)  # in request order
    prompt_tokens: int = 0  # sum over prompts of their whole length: what one sequence per question would compute
    cached_tokens: int = 0  # state tokens its last round resumed from checkpoints instead of computing
    subs: list[SubTrunk] = field(default_factory=list)  # nested forks: lines several branches share after a trunk
    # a trunk with one prompt continues into it as ONE state segment (`lone_branches`; the engine sets it from
    # `runtime.merge_lone_questions` before the request's `round_layout` is made, which it then fixes)
    merge_lone: bool = False

    @property
    def stream_tokens(self) -> int:
        return (sum(len(t) for t in self.trunks) + sum(len(b.tokens) for b in self.branches)
                + sum(len(s.tokens) for s in self.subs))

    def prefix_length(self, branch: Branch) -> int:
        """Tokens of `branch`'s prompt before its own tokens: its trunk's, and its sub-trunk's if it has one."""
        return len(self.trunks[branch.trunk]) + (len(self.subs[branch.sub].tokens) if branch.sub >= 0 else 0)

    @property
    def input_tokens(self) -> int:
        """Tokens of the request counting each state (and each sub-trunk) once (System One `usage.input_tokens`)."""
        return self.stream_tokens

    @cached_property
    def trunk_hashes(self) -> list[list[bytes]]:
        """Per trunk, the chained hashes of its 64-token-aligned prefixes (`flide.checkpoints.prefix_hashes`): the
        checkpoint cache's keys, computed once whether planning or building a round asks first."""
        from .checkpoints.cache import prefix_hashes

        return [prefix_hashes(tokens) for tokens in self.trunks]

    @cached_property
    def lone_branches(self) -> dict[int, int]:
        """trunk -> its one branch, for the trunks that have a single prompt (no sub-trunk, no other branch), where
        `merge_lone` is set: a round lays such a trunk and its branch out as one state segment (nothing to share
        with, so no fork: the question runs in the states' chunked gated delta call instead of token by token in the
        question call). Empty without `merge_lone`."""
        if not self.merge_lone:
            return {}
        prompts = Counter(branch.trunk for branch in self.branches)
        with_subs = {sub.trunk for sub in self.subs}
        return dict(sorted((b.trunk, k) for k, b in enumerate(self.branches)
                           if prompts[b.trunk] == 1 and b.trunk not in with_subs and 0 <= b.trunk < len(self.trunks)))

    def set_merge_lone(self, merge: bool) -> None:
        """Sets `merge_lone`, dropping what was derived from it (`lone_branches`, `round_layout`) if it changes."""
        if merge != self.merge_lone:
            self.merge_lone = merge
            self.__dict__.pop("lone_branches", None)
            self.__dict__.pop("round_layout", None)

    @cached_property
    def round_layout(self):
        """This request's part of a round, relative to its own start (`flide.round.RequestLayout`): made once, by
        `Engine.prepare` after it has set each branch's `options` (or else on the request's first round), and reused
        by every round the request joins, so its trunks and branches must not change after that."""
        from .round import RequestLayout

        return RequestLayout(self)


def parse_request(request: Any, decision_config, max_questions: int,
                  cache: QuestionCache | None = None) -> tuple[Any, list[Question]]:
    """Validates a System One request (dict or JSON) and parses its questions with transformers' `Question`
    (through `cache` when given: one per PromptTokenizer, shared by its thread copies).

    Returns (state, questions in request order). Raises RequestError naming the offending field.
    """
    if isinstance(request, (bytes, bytearray)):
        request = request.decode("utf-8", errors="replace")
    if isinstance(request, str):
        try:
            request = json.loads(request)
        except json.JSONDecodeError as error:
            raise RequestError("body", f"the request is not valid JSON ({error.msg} at line {error.lineno} column "
                                       f"{error.colno}).") from None
    if not isinstance(request, dict):
        raise RequestError("body", f'a request is an object {{"state": ..., "questions": {{...}}}}, got '
                                   f"{type(request).__name__}.")
    if "state" not in request:
        raise RequestError("state", "is missing: a request needs the state its questions are about.")
    questions = request.get("questions")
    if "questions" not in request:
        raise RequestError("questions", "is missing: a request needs at least one question.")
    if not isinstance(questions, dict) or not questions:
        raise RequestError("questions", f"maps question names to questions, with at least one question; got "
                                        f"{json.dumps(questions)[:80] if _jsonable(questions) else type(questions).__name__}.")
    if len(questions) > max_questions:
        raise RequestError("questions", f"has {len(questions)} questions; at most {max_questions} per request.")
    assets = request.get("assets")
    if assets:
        raise RequestError("assets", "images need a model whose processor handles them; this is a text model.", 400)
    parsed = []
    for name, question in questions.items():
        where = f"questions.{name}"
        if not isinstance(question, dict):
            raise RequestError(where, f"must be an object with `type` and `instructions`, got {type(question).__name__}.")
        kind = question.get("type")
        if kind not in Question.questions_types:
            raise RequestError(f"{where}.type", f"must be one of {', '.join(Question.questions_types)}, got {kind!r}.")
        if kind != "noul" and not question.get("criteria"):
            raise RequestError(f"{where}.criteria", f"a {kind} question needs `criteria` with its options.")
        if kind == "score" and not isinstance(question.get("criteria"), list):
            raise RequestError(f"{where}.criteria", "a score question lists its levels, lowest first.")
        if kind == "choice" and not isinstance(question.get("criteria"), dict):
            raise RequestError(f"{where}.criteria", "a choice question maps each option to a description or null.")
        try:
            parsed.append(cache.parse(name, question, decision_config) if cache is not None
                          else parse_question(name, question, decision_config))
        except ValueError as error:
            field_name = f"{where}.criteria" if "options" in str(error) else where
            status = 400 if "labels" in str(error) else 422
            raise RequestError(field_name, str(error), status) from None
    return request["state"], parsed


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix: equal blocks skipped by C-level compares of 4k-character slices, then a
    binary search inside the first block that differs (a binary search over the whole strings copied ~17 slices of
    up to their full length: 0.35 ms for a 100k-character agent history, 4x what this costs). The search compares
    only the part not yet known equal, [lo, mid), so its slices halve as it goes (RACE's ~1.8k-character prompts:
    9 -> 6.5 us a pair)."""
    block, n = 4096, min(len(a), len(b))
    start = 0
    while start + block <= n and a[start:start + block] == b[start:start + block]:
        start += block
    lo, hi = start, min(start + block, n)  # a[:lo] == b[:lo], and they differ before hi (or hi == n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _newline_follows(text: str, start: int) -> bool:
    r"""Whether the run of whitespace starting at `start` holds a line break (then `\s*[\r\n]+` could span it)."""
    end = start
    while end < len(text) and text[end].isspace():
        if text[end] in "\r\n":
            return True
        end += 1
    return end == len(text)


def safe_cut(text: str, limit: int) -> int:
    """The largest c <= limit where tokenization can split (or 0): right after a newline whose following whitespace
    holds no other line break. Every alternative of the byte-level BPE split regex that covers a newline either ends
    at it or continues only through more line breaks, so no pre-token crosses such a c."""
    pos = min(limit, len(text))
    while pos > 0:
        newline = text.rfind("\n", 0, pos)
        if newline < 0:
            return 0
        cut = newline + 1
        if cut <= limit and not _newline_follows(text, cut):
            return cut
        pos = newline
    return 0


_EMPTY = np.zeros(0, dtype=np.int64)

# the CPUs this process may run on, which tokenizers' batch encode spreads its items over
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _drop_sentinels(ids: np.ndarray, mark_id: int, split_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids without the sentinels, for each mark the number of kept ids up to it), as transformers' read_marks
    drops them. Ids without sentinels (DECISION_PROMPT's prompts) come back as they are: no mask, cumsum or copy. A
    maximum below both sentinels proves there are none in one reduction instead of two masks and a test (~3 vs ~8 us
    on a question's tail); they are usually the tokenizer's last ids (added by PromptTokenizer), above any other."""
    if not len(ids) or ids.max() < min(mark_id, split_id):
        return ids, _EMPTY
    is_mark = ids == mark_id
    sentinels = is_mark | (ids == split_id)
    if not sentinels.any():
        return ids, _EMPTY
    keep = ~sentinels
    return ids[keep], np.cumsum(keep)[is_mark]


# right after a newline whose following whitespace holds no line break and is followed by more text: a safe cut
# (`\s` and `\S` of a str pattern are `str.isspace`'s, as `_newline_follows` tests them)
_SAFE_LINE_CUT = re.compile(r"(?<=\n)(?=[^\S\r\n]*\S)")


def safe_lines(text: str) -> list[str]:
    """`text` cut at every safe cut (`piece_cuts(text, 1)`: a tail cut into its lines), by one regex split instead
    of a Python loop per newline and a slice per line."""
    return _SAFE_LINE_CUT.split(text)


class _Trunk:
    """A trunk's token ids while its request is prepared: without sentinels (`kept`), and where its marks fall."""

    def __init__(self, ids: np.ndarray, mark_id: int, split_id: int):
        self.ids = ids
        self.kept, self.marks = _drop_sentinels(ids, mark_id, split_id)  # marks: kept tokens up to each
        self.kept_count = len(self.kept)


class _ContinuedTrunk(_Trunk):
    """A trunk followed by a sub-trunk's tokens `shared`, which hold no sentinel (`sub_trunks.cuts` shares no run with
    a mark's or split's text): what a leaf's tail follows, so its reads count from its prompt's start without joining
    the sub-trunk to each leaf. Its marks are the trunk's; the kept ids are joined only if a leaf's read needs them
    (its last mark inside the trunk: a template that marks before the question)."""

    def __init__(self, trunk: _Trunk, shared: np.ndarray):  # no super().__init__: nothing to drop sentinels from
        self.ids, self._parts = None, (trunk.kept, shared)
        self.marks, self.kept_count = trunk.marks, trunk.kept_count + len(shared)

    @cached_property
    def kept(self) -> np.ndarray:
        return np.concatenate(self._parts)


def _join(parts: list[np.ndarray | list[int]]) -> np.ndarray:
    """The parts' ids (int64 arrays, or lists of ints) as one int64 array."""
    if len(parts) == 1:
        return np.asarray(parts[0], dtype=np.int64)
    if not parts:
        return _EMPTY
    if np.ndarray in map(type, parts):  # pieces from the cache among them
        return np.concatenate([np.asarray(part, dtype=np.int64) for part in parts])
    return np.array(list(chain.from_iterable(parts)), dtype=np.int64)  # one conversion, no array per part


def piece_cuts(text: str, every: int) -> list[int]:
    """Safe cuts (`safe_cut`) at least `every` characters apart, splitting `text` into pieces of about that size
    (none when it is shorter than two pieces). A stretch without a safe cut makes a longer piece."""
    cuts: list[int] = []
    last, n = 0, len(text)
    while n - last >= 2 * every:
        newline = text.find("\n", last + every - 1)
        while newline >= 0 and _newline_follows(text, newline + 1):
            newline = text.find("\n", newline + 1)
        if newline < 0 or n - (newline + 1) < every // 2:
            break
        cuts.append(newline + 1)
        last = newline + 1
    return cuts


class PromptTokenizer:
    """Renders and tokenizes decision prompts exactly as `transformers.decision.prepare_inputs` does, in two parts."""

    # a long trunk is encoded in pieces of about this size, in parallel (`encode_trunk`). H200 host, 16 CPUs (session
    # 29, `tokenization_pieces_session29_h200.json`, `host_prepare_profile_h200.json`): QuALITY's prepare 3.36 ms at
    # 2,048 characters, 2.80 at 512 or 1,024; the Rust batch alone on a 2,000-token state 0.93 ms at 2,048, 0.54 at
    # 512 (more pieces than CPUs: rayon balances them). On 2 CPUs the same (1.50 vs 1.60 ms).
    PIECE_CHARS = 512
    # batches of up to this many characters stay in Python (`_python_is_sooner`) whatever the CPUs
    PYTHON_BATCH_CHARS = 8192

    PROBE = "\u2460"  # an instruction unlike any real one from its first character on

    # tokenizers' pipeline spends ~2.5x what `ascii_bpe` does on a character on one thread (0.5 vs 0.2 us on RACE
    # passages, 2-core EPYC); it runs a batch's items on every CPU (`_python_is_sooner`)
    ASCII_SPEEDUP = 2.5
    # a batch split between Python and tokenizers runs both at once when each has at least this many characters
    # (a worker thread's hand-off costs ~30-60 us; ascii_bpe encodes ~5 characters a microsecond)
    CONCURRENT_CHARS = 1024
    # False: a batch goes to tokenizers whole unless Python is sooner for all of it (before session 30; the A/B)
    SPLIT_BATCHES = True

    def __init__(self, tokenizer, decision_config, mode: str = "auto", resolved: bool = False,
                 piece_cache: PieceCache | None = None,
                 question_cache_entries: int = RuntimeConfig.question_cache_entries, nested: bool = False):
        """`mode`: `runtime.tokenization` (auto, split or full); `auto` and `split` are checked against this tokenizer
        (flide/split_check.py) unless `resolved` says the mode comes from a PromptTokenizer that checked it.
        `nested`: in split mode, lines that several prompts of a trunk share after it become sub-trunks
        (`PreparedRequest.subs`; the engine's `runtime.nested_forks`).
        `piece_cache`: the tokens of prompt pieces seen before (flide/piece_cache.py), shared by a tokenizer's
        thread copies; by default a new one of `runtime.piece_cache_chars`' default bound."""
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        self.piece_cache = piece_cache if piece_cache is not None else PieceCache(RuntimeConfig.piece_cache_chars)
        self.config = decision_config
        self._affixes: ChatAffixes | bool | None = None  # chat_affixes(): None until looked for, False if none
        # shared by thread copies (copy_for_thread hands them this one); None: off
        self.question_cache = QuestionCache(question_cache_entries) if question_cache_entries > 0 else None
        self.nested = nested
        self.mode = "split" if mode == "auto" else mode  # until resolved below: the probes tokenize in two parts
        tok = self.tokenizer
        # as prepare_inputs does: sentinels are special, requests can't write them. (Looked up among the added tokens:
        # `get_vocab()` builds the whole vocabulary, ~0.5 s for Qwen's, for every thread's copy.)
        if MARK not in tok.added_tokens_encoder and MARK not in tok.get_vocab():
            tok.add_tokens([AddedToken(token, special=True, normalized=False) for token in (MARK, SPLIT)])
        self.mark_id, self.split_id = tok.convert_tokens_to_ids([MARK, SPLIT])
        self.template_variables = _get_template_variables(decision_config.chat_template or DECISION_PROMPT)
        self.groups_all = "questions" in self.template_variables
        chat_template = decision_config.chat_template
        self.chat_template = tok.get_chat_template(chat_template) if chat_template is None else chat_template
        self.sanitize = decision_config.sanitize_control_tokens
        if self.sanitize:
            # user text is marked with the template's control tokens; encoding splits at every added token's mark
            control_tokens = tok._get_control_tokens(self.chat_template)
            self.control_re = _get_control_token_patterns(control_tokens)[0]
            # the characters a control token can start with: text holding none of them (nor a marker) has nothing
            # to mark (`mark`)
            self.control_starts = frozenset(token[0] for token in control_tokens if token)
            # no control token holds a newline: marking text cut right before a newline marks each part apart
            self.marks_cut_at_newlines = not any("\n" in token for token in control_tokens)
            self.markers_re = _get_control_token_patterns(tuple(tok.added_tokens_encoder))[1]
        self.newline_ids = tok.encode("\n", add_special_tokens=False)
        # ASCII pieces encoded in Python where that provably gives the tokenizer's ids (~3x faster); None: all Rust
        self.ascii_bpe = AsciiByteLevelBPE.of(tok)
        self._worker = None  # `_ascii_worker`
        if not resolved:
            from .split_check import resolve_tokenization

            self.mode = resolve_tokenization(self, mode)

    def copy_for_thread(self) -> PromptTokenizer:
        """An independent copy (its own tokenizer) for a tokenizing thread: a fast tokenizer's Python wrapper is
        copied shallowly around a Rust tokenizer of its own, rebuilt from this one's JSON (serialised once): 1.6 s
        a copy for Qwen3.5's 248k vocabulary against 3.2 s for a deep copy, which serialises it every time."""
        import copy

        backend = getattr(self.tokenizer, "_tokenizer", None)
        if backend is None:  # a slow (pure Python) tokenizer
            tokenizer = copy.deepcopy(self.tokenizer)
        else:
            from tokenizers import Tokenizer

            if getattr(self, "_backend_json", None) is None:
                self._backend_json = backend.to_str()
            tokenizer = copy.copy(self.tokenizer)
            tokenizer._tokenizer = Tokenizer.from_str(self._backend_json)
        return self.with_tokenizer(tokenizer)

    def with_tokenizer(self, tokenizer) -> PromptTokenizer:
        """This one's settings around another tokenizer (a copy of the same one, for another thread), sharing its
        piece and question caches (or their absence) and its chat-template affixes."""
        copied = PromptTokenizer(tokenizer, self.config, self.mode, resolved=True, piece_cache=self.piece_cache,
                                 question_cache_entries=0)
        copied.question_cache = self.question_cache
        copied._affixes = self._affixes
        copied.nested = self.nested
        return copied

    # ---- rendering (transformers' prepare_inputs, text only) ----
    def render(self, state: Any, group: list[Question]) -> str:
        """The text `apply_chat_template` tokenizes for this prompt (control tokens of user text marked)."""
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "enable_thinking": False}
        if self.config.chat_template is None:
            text = render_decision_prompt(state, group[0])
            conversation = [{"role": "user", "content": text}]
            if self.sanitize:
                conversation = mark_control_tokens(conversation, self.control_re)
            affixes = self.chat_affixes()
            if affixes is not None:  # the template only prints the content: no render per question
                return affixes.render(conversation[0]["content"])
            return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template,
                                                      tokenize=False, **kwargs)
        # the model's own decision template: the request's data go in as template variables
        inputs = {"state": state, "question": asdict(group[0]), "questions": [asdict(q) for q in group]}
        kwargs |= {name: value for name, value in inputs.items() if name in self.template_variables}
        conversation = [{"role": "user", "content": ""}]
        if self.sanitize:
            conversation = mark_control_tokens(conversation, self.control_re)
            kwargs = mark_control_tokens(kwargs, self.control_re)
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                  **kwargs)

    def _render_sharing_state(self, state: Any, groups: list[list[Question]]) -> tuple[list[str], int]:
        """(`[self.render(state, group) for group in groups]`, how many leading characters all of them share by
        construction: the chat prefix and the marked state, 0 where not known), marking a string state's control
        tokens once for all its prompts (transformers marks each prompt whole: ~10 us a question for a RACE passage,
        more for longer states). With DECISION_PROMPT inside a chat template that only prints the content, a prompt
        is the state followed by a newline and the question's lines; no control token holds a newline, so no match
        crosses that point and the marked prompt is the marked state followed by the marked rest. The rest comes
        from `decision_prompt_after_state` where the port renders it, so the state is not copied into, compared
        with and cut out of each question's render (a 2,000-token state asked 64 questions: 64 x 3 passes over ~9k
        characters), and `_trunk_prefixes` compares only what follows the shared part."""
        affixes = self.chat_affixes() if self.config.chat_template is None else None
        if not (self.sanitize and affixes is not None and self.marks_cut_at_newlines and isinstance(state, str)
                and state):
            return [self.render(state, group) for group in groups], 0
        marked_state = self.mark(state)
        texts, shared = [], True
        for group in groups:
            rest = decision_prompt_after_state(group[0])
            if rest is None:
                text = render_decision_prompt(state, group[0])
                if text.startswith(state) and text.startswith("\n", len(state)):
                    rest = text[len(state):]
            if rest is not None:
                texts.append(affixes.render(marked_state + self.mark(rest)))
            else:
                texts.append(self.render(state, group))
                shared = False
        return texts, len(affixes.prefix) + len(marked_state) if shared else 0

    def mark(self, text: str) -> str:
        """`mark_control_tokens(text, self.control_re)`, without its three passes over text that cannot hold a
        control token or a marker (a question's lines seldom hold a control token's first character: for Qwen, "<");
        ~4 us a question's tail otherwise."""
        if (_CONTROL_TOKEN_START in text or _CONTROL_TOKEN_END in text
                or any(start in text for start in self.control_starts)):
            return mark_control_tokens(text, self.control_re)
        return text

    def chat_affixes(self) -> ChatAffixes | None:
        """The chat template's prefix and suffix around a user message's content, where it provably only prints
        the content (flide/chat_template.py); None where each prompt must be rendered. Found once."""
        if self._affixes is None:
            found = None
            if self.config.chat_template is None and isinstance(self.chat_template, str):
                found = ChatAffixes.find(self.chat_template, lambda content: self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": content}], chat_template=self.chat_template, tokenize=False,
                    add_generation_prompt=True, enable_thinking=False))
            self._affixes = found or False
        return self._affixes or None

    def encode(self, text: str) -> list[int]:
        """Token ids of a whole rendered prompt, as apply_chat_template(tokenize=True) gives them."""
        if self.sanitize:
            return encode_marked_chat(self.tokenizer, text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_tail(self, text: str) -> list[int]:
        """Token ids of the text after a safe cut, encoded as transformers encodes a piece inside a chat."""
        if not text:
            return []
        if not self.sanitize:
            return _encode_chat_piece(self.tokenizer, text, False, self.newline_ids)
        pieces = self.markers_re.split(text)
        ids = _encode_chat_piece(self.tokenizer, pieces[0], False, self.newline_ids) if pieces[0] else []
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += _encode_chat_piece(self.tokenizer, piece, i % 2 == 1, self.newline_ids)
        return ids

    def encode_trunk(self, text: str) -> np.ndarray:
        """`encode(text)` for a prompt's trunk (its state). A long one is cut at safe boundaries into pieces of about
        `PIECE_CHARS` (exact for the same reason as the trunk / tail split: each cut is a safe boundary of the whole
        text): pieces seen before come from the piece cache (an agent's history, step after step), the others are
        encoded in one batch call, which the Rust tokenizer runs in parallel without the GIL."""
        return self.encode_parts([text], [])[0][0]

    def encode_tails(self, texts: list[str]) -> list[np.ndarray]:
        """`[encode_tail(t) for t in texts]`, each tail cut at every safe boundary (its lines): lines seen before (the
        template's closing lines, shared options) come from the piece cache, the rest go in one batch call."""
        return self.encode_parts([], texts)[1]

    def encode_parts(self, trunks: list[str], tails: list[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(`[encode_trunk(t) for t in trunks]`, `encode_tails(tails)`) in ONE batch call to the tokenizer: a
        request's tails are then encoded on other cores while its state, the longest item, is (two calls ran them one
        after the other)."""
        items, spans = [], []
        for text in trunks:
            cuts = piece_cuts(text, self.PIECE_CHARS) if self.mode == "split" else []
            bounds = [0, *cuts, len(text)]
            spans.append((len(items), len(items) + len(bounds) - 1))
            items += [(text[a:b], i > 0) for i, (a, b) in enumerate(pairwise(bounds))]
        # A tail seen whole before (the same question asked of another state: routers, judges, guards; or the same
        # request again) comes back from the piece cache in one look-up instead of one per line plus their join
        # (~12 us of a MultiRC question's ~26 us here): its ids are its lines' joined, the same text -> ids map
        cache = self.piece_cache if self.mode == "split" and self.piece_cache.max_chars > 0 else None
        whole: dict[int, str] = {}  # span index -> the tail text to keep whole once encoded
        for text in tails:
            if cache is not None and (ids := cache.get(text, True, count_miss=False)) is not None:
                spans.append(ids)
                continue
            lines = safe_lines(text)  # [""] for an empty tail
            if cache is not None and len(lines) > 1:
                whole[len(spans)] = text
            spans.append((len(items), len(items) + len(lines)))
            items += [(line, True) for line in lines]
        parts = self._encode_many(items, arrays=False)
        encoded = [span if isinstance(span, np.ndarray) else _join(parts[span[0]:span[1]]) for span in spans]
        for index, text in whole.items():
            cache.put(text, True, encoded[index])
        return encoded[:len(trunks)], encoded[len(trunks):]

    def _encode_many(self, items: list[tuple[str, bool]], arrays: bool = True) -> list[np.ndarray | list[int]]:
        """Each (text, is_tail) as `encode_tail(text)` (is_tail) or `encode(text)`, as int64 arrays (`arrays=False`:
        the ones encoded here as lists, for `_join` to make one array of many: ~2 us an item less). In split mode
        pieces come from the piece cache when they can (and go into it). Texts holding a marked control token
        (sanitized user text) take the one-by-one path; the others go to the tokenizer in one batch, which runs them
        in parallel: a tail as transformers' `_encode_chat_piece` encodes it (after a newline that is then dropped,
        so SentencePiece adds no prefix space), falling back to a plain encode where the newline's tokens do not
        lead. Items that repeat within the call (a request's questions end in the same template lines) are encoded
        once."""
        cache = self.piece_cache if self.mode == "split" else None
        # a cache of 0 characters keeps nothing: not asked piece by piece, only told how many pieces it missed
        keeps = cache is not None and cache.max_chars > 0
        out: list[np.ndarray | None] = [None] * len(items)
        batch, where = [], []
        first: dict[tuple[str, bool], int] = {}  # item -> where it first stands; repeats are filled from there
        repeats: list[tuple[int, int]] = []
        misses = 0
        for i, (text, tail) in enumerate(items):
            if not text:
                out[i] = _EMPTY
            elif (seen := first.setdefault((text, tail), i)) != i:
                repeats.append((i, seen))
            elif keeps and (ids := cache.get(text, tail)) is not None:
                out[i] = ids
            else:
                misses += 1
                if self.sanitize and self._has_markers(text):
                    out[i] = np.asarray(self.encode_tail(text) if tail else self.encode(text), dtype=np.int64)
                    if keeps:
                        cache.put(text, tail, out[i])
                else:
                    batch.append("\n" + text if tail else text)
                    where.append(i)
        if cache is not None and not keeps:
            cache.count_misses(misses)
        if batch:
            encoded = self._encode_batch(batch)
            newline = self.newline_ids
            for i, ids in zip(where, encoded):
                text, tail = items[i]
                if tail:
                    ids = ids[len(newline):] if ids[:len(newline)] == newline else self.tokenizer.encode(
                        text, add_special_tokens=False)
                if arrays or keeps:
                    ids = np.asarray(ids, dtype=np.int64)
                    if keeps:
                        cache.put(text, tail, ids)
                out[i] = ids
        for i, seen in repeats:
            out[i] = out[seen]
        return out

    def _python_is_sooner(self, lengths: list[int]) -> bool:
        """Whether `ascii_bpe` would encode a batch of texts of these lengths sooner than tokenizers, which spreads a
        batch's items over the CPUs: its time is then its longest item's or an even share of the whole, whichever is
        longer. Batches of up to PYTHON_BATCH_CHARS characters stay in Python whatever the CPUs (a RACE request's,
        ~2k characters in ~30 items, took as long in tokenizers on 2 threads as on 1 here); a long state's pieces go
        to tokenizers where there are many CPUs."""
        total = sum(lengths)
        return (total <= self.PYTHON_BATCH_CHARS
                or total <= self.ASCII_SPEEDUP * max(max(lengths, default=0), total / _CPUS))

    def _python_share(self, texts: list[str]) -> list[int]:
        """The items of a batch that `ascii_bpe` encodes (the rest go to tokenizers): every ASCII item where Python
        is sooner for the whole batch (`_python_is_sooner`), else the shortest ASCII items, as many as Python
        encodes while tokenizers runs the others on every CPU (`_encode_batch` runs both at once): a long state's
        pieces go to tokenizers, its questions' short lines stay here, where tokenizers spent ~1 us an item more on
        converting its results (sweep 64 on the H200's 16-CPU host: 900 items, 1.5 ms in the batch call + 0.7 in
        reading its ids back)."""
        ascii_items = [i for i, text in enumerate(texts) if text.isascii()]
        if not ascii_items:
            return ascii_items
        lengths = list(map(len, texts))
        if self._python_is_sooner(lengths):
            return ascii_items
        if not self.SPLIT_BATCHES:
            return []
        longest, rest = max(lengths), sum(lengths)
        share, chars = [], 0
        for i in sorted(ascii_items, key=lengths.__getitem__):
            n = lengths[i]
            # tokenizers' time for the items left to it, in characters of Python's time
            if chars + n > self.ASCII_SPEEDUP * max(longest, (rest - n) / _CPUS):
                break
            share.append(i)
            chars += n
            rest -= n
        return share

    def _has_markers(self, text: str) -> bool:
        """`markers_re.search(text)`: every match of transformers' markers regex holds a marker character, and the
        C-level `in` checks for them cost a fraction of the regex's scan (which ran on every piece of every prompt)."""
        return (_CONTROL_TOKEN_START in text or _CONTROL_TOKEN_END in text) and self.markers_re.search(text) is not None

    def _ascii_ids(self, texts: list[str]) -> list[list[int] | None]:
        return [self.ascii_bpe.encode(text) for text in texts]

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`tokenizer(texts, add_special_tokens=False)["input_ids"]`. A fast tokenizer's Rust backend is called
        directly when transformers' call would change nothing around it (no truncation or padding set on the
        backend, its special-token splitting as the tokenizer's): transformers then only converts each encoding to
        Python dicts, ~5 us an item, and a request's tails are dozens of items. `encode_batch_fast` skips offsets.
        There, ASCII texts are encoded in Python (`ascii_bpe`, the same ids) where that is sooner than the backend's
        parallel batch (`_python_share`), and the backend encodes the rest. When both have at least
        CONCURRENT_CHARS characters to encode they run at once: Python's share on a worker thread while this thread
        waits in the backend's batch call, which releases the GIL (the other way round, the worker would wait for
        the GIL until this thread's Python work is done: CPython hands it over after `sys.getswitchinterval()`)."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if (backend is not None and backend.truncation is None and backend.padding is None
                and backend.encode_special_tokens == bool(getattr(self.tokenizer, "split_special_tokens", False))):
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            out: list[list[int] | None] = [None] * len(texts)
            python = self._python_share(texts) if self.ascii_bpe is not None and self.ascii_bpe.current() else []
            taken = set(python)
            rest = [i for i in range(len(texts)) if i not in taken]
            python_texts = [texts[i] for i in python]
            rest_texts = [texts[i] for i in rest]
            if rest and sum(map(len, python_texts)) >= self.CONCURRENT_CHARS and sum(
                    map(len, rest_texts)) >= self.CONCURRENT_CHARS:
                ascii_ids = self._ascii_worker().submit(self._ascii_ids, python_texts)
                encodings = encode(rest_texts, add_special_tokens=False)
                for i, encoding in zip(rest, encodings):
                    out[i] = encoding.ids
                rest = []
                python_ids = ascii_ids.result()
            else:
                python_ids = self._ascii_ids(python_texts)
            for i, ids in zip(python, python_ids):
                if ids is None:  # ASCII text the Python BPE leaves to the tokenizer (`AsciiByteLevelBPE.encode`)
                    rest.append(i)
                out[i] = ids
            if rest:
                for i, encoding in zip(rest, encode([texts[i] for i in rest], add_special_tokens=False)):
                    out[i] = encoding.ids
            return out
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def _ascii_worker(self):
        """This tokenizer's thread for Python's share of a batch (`_encode_batch`), started on first use."""
        if self._worker is None:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(1, thread_name_prefix="flide-ascii-bpe")
        return self._worker

    def _trunk_prefixes(self, state: Any, groups: list[list[Question]], texts: list[str], head: int = 0) -> list[str]:
        """Per prompt, a prefix it shares with every prompt of the same question type(s) in this request: their
        common prefix, or, for a type asked once, the common prefix with the same prompt rendered with a probe
        instruction. Per type, because templates print what depends on the type before the state (Jev), while the
        instructions and options come after it.

        A type asked once first tries the other prompts of the request: when its longest common prefix with one of
        them holds at least as many characters as the state, the template printed the state before anything that
        depends on the type (DECISION_PROMPT does), and that prefix serves without a probe. An agent guard asking
        three questions of three types of a long history then renders it three times, not six.

        Any common prefix cut at a safe boundary is exact (`prepare`); this one is at least as long as the
        question-independent part of the prompt, without rendering probes when a type is asked twice or more
        (rendering is most of the host's cost: one probe instead of two, or none, saves a third of RACE's).
        `head`: leading characters every text shares by construction (`_render_sharing_state`), not compared again."""
        kinds: dict[tuple[str, ...], list[int]] = {}
        for index, group in enumerate(groups):
            kinds.setdefault(tuple(q.type for q in group), []).append(index)
        prefixes = [""] * len(groups)
        state_chars = len(state) if isinstance(state, str) else len(json.dumps(state, ensure_ascii=False))
        for members in kinds.values():
            pool = [texts[i] for i in members]
            if len(pool) == 1 and len(texts) > 1:
                mine = pool[0][head:]
                length = head + max(common_prefix_length(mine, other[head:])
                                    for i, other in enumerate(texts) if i != members[0])
                if length >= state_chars:
                    prefixes[members[0]] = pool[0][:length]
                    continue
            known = head
            if len(pool) == 1:
                group = groups[members[0]]
                probed = [Question(q.name, q.type, self.PROBE, q.options, q.labels, q.descriptions)
                          for q in group]
                pool.append(self.render(state, probed))
                known = 0  # the probe is rendered whole: compare it all
            # the common prefix of a set of strings is that of its least and greatest: two C-level scans of the pool
            # and one common_prefix_length, not one per prompt (MultiRC: 34 prompts of ~2k characters)
            rests = [text[known:] for text in pool] if known else pool
            length = known + common_prefix_length(min(rests), max(rests))
            shared = pool[0][:length]  # one string for the type's prompts (`prepare` cuts their trunk once)
            for i in members:
                prefixes[i] = shared
        return prefixes

    # ---- the request ----
    def prepare(self, state: Any, questions: list[Question]) -> PreparedRequest:
        """Renders and tokenizes one request (and finds its sub-trunks, `nested`: flide/sub_trunks.py). Keeps no
        state between calls, but transformers' fast tokenizers flip a flag while encoding control tokens as text: give
        each thread its own tokenizer (see `copy_for_thread`)."""
        from . import sub_trunks  # it imports this module's cut helpers

        groups = [questions] if self.groups_all else [[q] for q in questions]
        texts, head = self._render_sharing_state(state, groups)
        prefixes = self._trunk_prefixes(state, groups, texts, head) if self.mode != "full" else [""] * len(groups)
        trunk_ids: dict[str, int] = {}
        trunks: list[_Trunk] = []
        branches: list[Branch] = []
        trunk_texts = self._trunk_texts(texts, prefixes) if self.mode != "full" else [""] * len(texts)
        # every trunk and tail of the request in one batch (the tokenizer runs a batch in parallel); full: whole
        # prompts
        distinct = list(dict.fromkeys(t for t in trunk_texts if t))
        tail_texts = [text[len(trunk):] for text, trunk in zip(texts, trunk_texts)]
        cuts = sub_trunks.cuts(trunk_texts, tail_texts) if self.nested and self.mode == "split" else None
        sub_of = [""] * len(texts)  # each prompt's sub-trunk text ("": none)
        if cuts is not None:  # leaves encode the text after their sub-trunk; each sub-trunk's lines are encoded once
            sub_of = [tail[:cut] for tail, cut in zip(tail_texts, cuts)]
            tail_texts = [tail[cut:] for tail, cut in zip(tail_texts, cuts)]
        sub_texts = list(dict.fromkeys(text for text in sub_of if text))
        tail_texts += sub_texts
        if self.mode == "full":
            encoded, tails = [], self._encode_many([(text, False) for text in texts])
        else:
            encoded, tails = self.encode_parts(distinct, tail_texts)
        by_text = dict(zip(distinct, encoded))
        sub_ids = dict(zip(sub_texts, tails[len(texts):]))
        subs: list[SubTrunk] = []
        sub_index: dict[tuple[int, str], int] = {}
        heads: dict[tuple[int, str], _Trunk] = {}  # per sub-trunk: its trunk continued by it, what its leaves follow
        for i, (group, trunk_text, tail) in enumerate(zip(groups, trunk_texts, tails)):
            if trunk_text not in trunk_ids:
                trunk_ids[trunk_text] = len(trunks)
                trunks.append(_Trunk(by_text.get(trunk_text, _EMPTY), self.mark_id, self.split_id))
            trunk_index = trunk_ids[trunk_text]
            sub_text = sub_of[i]
            if sub_text:  # the leaf's reads count from its prompt's start: trunk, then its sub-trunk
                key = (trunk_index, sub_text)
                if key not in sub_index:
                    sub_index[key] = len(subs)
                    subs.append(SubTrunk(trunk_index, sub_ids[sub_text]))
                    heads[key] = _ContinuedTrunk(trunks[trunk_index], sub_ids[sub_text])
                branch = self._branch(trunk_index, heads[key], tail, group)
                branch.sub = sub_index[key]
            else:
                branch = self._branch(trunk_index, trunks[trunk_index], tail, group)
            branches.append(branch)
        if subs:
            subs = sub_trunks.keep_useful(subs, branches, trunks)
        # trunks without their sentinels (each branch has counted its marks)
        prompt_tokens = sum(trunks[b.trunk].kept_count + len(b.tokens) for b in branches)
        prompt_tokens += sum(len(subs[b.sub].tokens) for b in branches if b.sub >= 0)
        trunks = [t.kept for t in trunks]
        return PreparedRequest(trunks, branches, list(questions), prompt_tokens, subs=subs)

    @staticmethod
    def _trunk_texts(texts: list[str], prefixes: list[str]) -> list[str]:
        """Each prompt cut at the last safe boundary within its trunk prefix. Prompts that share a prefix object
        (one type's, `_trunk_prefixes`) and cut at the same place share one trunk string: they agree up to the
        prefix's end, so the cuts are equal strings, and one object is sliced and hashed once instead of once per
        question (a 2,000-token state asked 64 questions: 64 copies and hashes of ~9k characters)."""
        made: dict[tuple[int, int], str] = {}
        out = []
        for text, prefix in zip(texts, prefixes):
            cut = safe_cut(text, len(prefix))
            key = (id(prefix), cut)
            trunk = made.get(key)
            if trunk is None:
                trunk = made[key] = text[:cut]
            out.append(trunk)
        return out

    def _branch(self, trunk_index: int, head: _Trunk, tail: np.ndarray, group: list[Question]) -> Branch:
        """Drops the sentinels (as transformers' read_marks does) and places the reads: the token before each mark,
        or the last token of a prompt without marks. Marks are counted over trunk + tail without joining them (the
        trunk's part is counted once per trunk: an agent's history is long, its questions' tails short)."""
        branch_tokens, tail_marks = _drop_sentinels(tail, self.mark_id, self.split_id)
        if not len(tail_marks) and not len(head.marks):
            # no marks (DECISION_PROMPT): one read, at the last token; what the general path below does then, without
            # its numpy calls (~8 us a question)
            n = head.kept_count + len(branch_tokens)
            _check_marks(1, len(group), n)
            return Branch(trunk_index, branch_tokens, np.array([n - 1], dtype=np.int64), list(group),
                          branch_tokens[len(branch_tokens):])
        if len(tail_marks):
            tail_marks = head.kept_count + tail_marks
        marks = np.concatenate([head.marks, tail_marks]) if len(head.marks) else tail_marks
        if len(marks) == 0:
            marks = np.asarray([head.kept_count + len(branch_tokens)])
        _check_marks(len(marks), len(group), int(marks.min()))
        last = int(marks[-1])
        after_last_mark = (branch_tokens[last - head.kept_count:] if last >= head.kept_count
                           else np.concatenate([head.kept[last:], branch_tokens]))
        return Branch(trunk_index, branch_tokens, (marks - 1).astype(np.int64), list(group), after_last_mark)


def _check_marks(count: int, questions: int, first: int) -> None:
    """The template placed `count` marks, the earliest at token `first` (its read at `first - 1`): there must be one
    per question and no read before the first token, else a RequestError naming the questions."""
    if count != questions:
        raise RequestError("questions", f"the decision template placed {count} marks for {questions} question(s).",
                           400)
    if first < 1:
        raise RequestError("questions", "the decision template reads before the first token.", 400)


def tokenize_request(request: Any, prompts: "PromptTokenizer", max_questions: int) -> PreparedRequest:
    """Validates, renders and tokenizes one request (the part of `Engine.prepare` that needs no model: it runs in
    prepare worker processes too); RequestError names the offending field."""
    state, questions = parse_request(request, prompts.config, max_questions, prompts.question_cache)
    try:
        return prompts.prepare(state, questions)
    except RequestError:
        raise
    except (ValueError, TypeError) as error:  # a template that cannot render this state
        raise RequestError("state", f"the decision template cannot render it: {error}") from None
