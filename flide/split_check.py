r"""Whether a tokenizer may tokenize prompts in two parts (`runtime.tokenization: split`) without changing a token.

Split tokenization encodes a prompt's trunk and its tail separately, cut at a *safe boundary* (right after a
newline whose following whitespace holds no other line break; `requests.safe_cut`). That is exact when no token can
cross such a cut, which holds by construction for byte-level BPE with the Qwen / Llama 3 split regex: every regex
alternative that covers a newline ends at it or continues only through more line breaks (GPT-2's own regex does not:
`\s+(?!\S)` keeps "\n\n" whole at a text's end). SentencePiece-style tokenizers (one word per text, "▁" for spaces)
hold it when no piece of their vocabulary continues past a newline (as in Llama 2 and Mistral 7B, where a newline is
its byte token <0x0A>; their real files are not available offline, `tiny_tokenizer("llama2")` stands in), and not
otherwise (vocabularies with pieces like "\nThe").

So `runtime.tokenization: auto` (the default) splits only where both hold:
- structure: a fast tokenizer, either byte-level (its normalizer at most a Unicode normal form: a newline is a
  starter character, no normal form composes across it) or SentencePiece style (BPE or Unigram, no pre-tokenizer
  but Metaspace, normalizers Prepend / Replace of spaces / normal forms) with no piece continuing past a newline;
- probes: on texts rich in line breaks, indentation, tabs, CR-LF, non-ASCII text, control tokens of the template
  written by the user, and on rendered decision prompts, `encode(text) == encode(text[:c]) + encode_tail(text[c:])`
  at every safe cut c.
Otherwise it tokenizes every prompt whole (exact, slower: each state once per question group) and logs why.
`runtime.tokenization: split` runs the probes too and refuses the tokenizer (ValueError naming the field) if a
probe changes a token; a tokenizer that passes the probes without the structure gets a warning.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("flide.requests")

_NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}

# Texts with many safe cuts of different kinds; each is also probed after the template's opening and as a state
PROBE_TEXTS = [
    "Plain words. Second sentence.\nNext line\n\nNew paragraph  \n  indented line\n\t\ttabbed\n\n\n   \nend",
    "def f(x):\n    return x  # comment\n\n\nclass A:\n\tpass\n    \n        deeper\n}\n",
    "Ünïcödé 東京 café\n— dash\n\r\nwindows line\r\nx\n\u00a0non-breaking space\n\u3000ideographic space\n",
    "Numbers 123456\n42 is\n3.14\n\n- item\n* star\n1. one\n#heading\n>quote\n  \n \n",
    '{"ticket": "text",\n "meta": {"priority": 3}}\n[1, 2]\n\n"quoted"\n\'single\'\n(paren)\n',
    "user text with <|im_start|>system\nignore<|im_end|> inside\nand after\n\n<|endoftext|>\nend",
    "\n\nstarts with newlines\nand ends with spaces   ",
]
PROBE_QUESTIONS = {
    "choice": {"type": "choice", "instructions": "Which one?\n Pick a line.", "criteria": {"first": None,
                                                                                          "second": "the other"}},
    "noul": {"type": "noul", "instructions": "Is it\n\nso?"},
}


def _structure_problem(tokenizer) -> str | None:
    """Why the tokenizer's structure does not prove split tokenization exact, or None when it does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer, so its pre-tokenizer is unknown"
    # the components' own JSON (the whole tokenizer's, or the model's, would serialise the vocabulary: ~0.6-1 s for
    # Qwen's); the model is named by its class
    spec = {name: json.loads(getattr(backend, name).__getstate__()) if getattr(backend, name) is not None else None
            for name in ("pre_tokenizer", "normalizer")}

    def nodes(node) -> list[dict]:
        if not node:
            return []
        if node.get("type") == "Sequence":
            inner = node.get("pretokenizers") or node.get("normalizers") or []
            return [n for child in inner for n in nodes(child)]
        return [node]

    pre = [n.get("type", "?") for n in nodes(spec["pre_tokenizer"])]
    normalizers = nodes(spec["normalizer"])
    if "ByteLevel" in pre:  # byte-level BPE: the split regex decides (the probes check it)
        other = sorted({n.get("type", "?") for n in normalizers} - _NORMAL_FORMS)
        return f"its normalizer {'+'.join(other)} may act across a line break" if other else None
    # SentencePiece style: the text is one word ("\u2581" for spaces, prepended once at the start). A cut right
    # after a newline is exact when no piece holds a newline followed by anything but newlines: no merge (BPE) and
    # no piece on the best path (Unigram) can then cross the cut, and a tail is encoded after a newline that is
    # dropped again (transformers' `_encode_chat_piece`), so the prepended "\u2581" falls on that newline
    model = type(backend.model).__name__
    if model not in ("BPE", "Unigram") or any(t not in ("Metaspace",) for t in pre):
        return f"its pre-tokenizer is {'+'.join(pre) or 'none'} with a {model} model, not byte-level BPE"
    for n in normalizers:
        kind = n.get("type")
        pattern = (n.get("pattern") or {}).get("String")
        if kind not in ("Prepend", "Replace", *_NORMAL_FORMS) or (kind == "Replace" and (pattern is None
                                                                                         or "\n" in pattern)):
            return f"its normalizer {kind} may act across a line break"
    crossing = next((t for t in tokenizer.get_vocab() if "\n" in t.rstrip("\n")), None)
    if crossing is not None:
        return f"its vocabulary has pieces that continue past a newline ({crossing!r})"
    return None


def _safe_cuts(text: str) -> list[int]:
    from .requests import _newline_follows

    return [i + 1 for i, ch in enumerate(text) if ch == "\n" and not _newline_follows(text, i + 1)]


def _probe_problem(prompts) -> str | None:
    """The first probe where tokenizing in two parts changes a token, described, or None."""
    from transformers.decision import Question

    texts = list(PROBE_TEXTS)
    for state in PROBE_TEXTS[:3] + [{"ticket": PROBE_TEXTS[0], "tags": ["a\nb"]}]:
        for name, body in PROBE_QUESTIONS.items():
            question = Question.from_request(name, body, prompts.config)
            try:
                texts.append(prompts.render(state, [question]))
            except Exception as error:  # noqa: BLE001 (a template that cannot render a probe proves nothing)
                log.debug("flide: split probe not rendered (%s)", error)
    for text in texts:
        whole = prompts.encode(text)
        for cut in _safe_cuts(text):
            parts = prompts.encode(text[:cut]) + prompts.encode_tail(text[cut:])
            if parts != whole:
                return f"tokenizing {text[max(0, cut - 20):cut]!r} | {text[cut:cut + 20]!r} in two parts changes tokens"
    return None


def resolve_tokenization(prompts, mode: str) -> str:
    """`split` or `full` for `runtime.tokenization: mode` with this PromptTokenizer (see the module docstring)."""
    if mode == "full":
        return "full"
    structure = _structure_problem(prompts.tokenizer)
    if mode == "auto" and structure is not None:
        log.info("flide: tokenizing every prompt whole (runtime.tokenization: auto): %s; split tokenization is "
                 "proven for byte-level BPE only", structure)
        return "full"
    probe = _probe_problem(prompts)
    if probe is not None:
        if mode == "split":
            raise ValueError(f"`runtime.tokenization: split` is not exact with this tokenizer: {probe}. Use `auto` "
                             f"or `full`.")
        log.warning("flide: tokenizing every prompt whole (runtime.tokenization: auto): %s", probe)
        return "full"
    if structure is not None:
        log.warning("flide: `runtime.tokenization: split` with a tokenizer it is not proven for (%s); the probes "
                    "passed, answers may still differ from transformers' on other texts", structure)
    return "split"
