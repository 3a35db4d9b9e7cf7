"""ASCII text through a byte-level BPE tokenizer, in Python (`AsciiByteLevelBPE`): the ids `encode(text,
add_special_tokens=False)` gives, without tokenizers' per-pre-token overhead. `PromptTokenizer` (requests.py) uses it
for the short texts of a request (tails, pieces of a state) where that is sooner than the tokenizer's parallel batch.
"""

from __future__ import annotations

import json
import logging
import re
from itertools import chain

log = logging.getLogger("flide.requests")


# the Unicode classes of a split regex, as their ASCII members: letters, digits, and no marks
_ASCII_CLASSES = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9", r"\p{M}": ""}
# escapes kept as they are: under re.ASCII, \s is [ \t\n\r\f\v], Unicode's White_Space (oniguruma's \s) on ASCII
_KEPT_ESCAPES = frozenset((r"\s", r"\S", r"\r", r"\n", r"\t"))
# other characters kept: ASCII letters, digits, spaces and the regex syntax of the split regexes (Qwen's, Llama 3's);
# anything else is not translated (., \b, \w, anchors, capturing groups, lookbehinds, inline flags other than (?i:))
_KEPT_SYNTAX = frozenset("'|?*+{},-)] ")


def ascii_split_pattern(pattern: str) -> str | None:
    r"""A Split pre-tokenizer's regex as a Python regex (compiled with re.ASCII) that finds the same pieces in ASCII
    text: \p{L}, \p{N} and \p{M} become their ASCII members; None where the regex uses something not translated
    (`AsciiByteLevelBPE.of` also checks the result against the tokenizer on probes)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            token = pattern[i:i + 5] if pattern.startswith("\\p{", i) else pattern[i:i + 2]
            if token in _ASCII_CLASSES:
                members = _ASCII_CLASSES[token]
                out.append(members if in_class else f"[{members}]" if members else "(?!)")  # (?!): never matches
            elif token in _KEPT_ESCAPES:
                out.append(token)
            else:
                return None
            i += len(token)
        elif c == "(":
            group = next((g for g in ("(?i:", "(?:", "(?!") if pattern.startswith(g, i)), None)
            if group is None or in_class:
                return None
            out.append(group)
            i += len(group)
        elif c == "[":
            if in_class:
                return None
            in_class = True
            group = "[^" if pattern.startswith("[^", i) else "["
            out.append(group)
            i += len(group)
        elif c.isascii() and (c.isalnum() or c in _KEPT_SYNTAX):
            in_class = in_class and c != "]"
            out.append(c)
            i += 1
        else:
            return None
    return "".join(out)


def _byte_level_images() -> dict[int, str]:
    """GPT-2's byte -> character map, as tokenizers' ByteLevel pre-tokenizer applies it: printable bytes stand for
    themselves, the others for chr(256 + n) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    images = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in images:
            images[b] = chr(256 + len(images) - len(printable))
    return images


# ASCII texts on which `AsciiByteLevelBPE.of` checks the Python path against the tokenizer itself: every ASCII
# character, contractions in both cases, runs of every kind of whitespace, digits, punctuation and added tokens
ASCII_PROBES = (
    "".join(map(chr, range(128))),
    "".join(map(chr, reversed(range(128)))),
    "I'm you're he's they've we'll I'd don't I'M YOU'RE HE'S THEY'VE WE'LL I'D DON'T 's 'S 'st x'y ' '' 'll'd",
    "a  b   c\t\td \n\n  \n e \r\n f\x0b\x0c g \x1c\x1d\x1e\x1f h   \n   \t\n\n\r\r\n \x7f end  ",
    "Numbers 123456 3.14 1,000,000 x1y2 -42 +7% 2024-01-02 0x1F 007\n10000000000",
    "!!! ... ?!? \"quoted\" 'single' (paren) [1] {a: b} a<b>c ~`@#$%^&*_=+\\|/ --- \t; :\n\n.\n,",
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<|im_start|><|im_end|><<|mark|>>"
     "<|split|><|im_start<|im_end|>|> <|endoftext|> x<|mark|>y"),
    "Line one.\n\nLine two.\n", "  leading and trailing  ", "\n", " ", "\n\n", "a\n\nb", "A. see its color\n",
    "When something reflects light, we can   _  .\nAnswer with the letter of the option that fits best (A to D) only.",
)


class AsciiByteLevelBPE:
    """What a byte-level BPE tokenizer's `encode(text, add_special_tokens=False)` gives for ASCII text, computed in
    Python: added tokens split out (leftmost, longest first, as tokenizers' added vocabulary matches them), the
    pre-tokenizer's split regex run by Python's `re` (`ascii_split_pattern`), and each piece's ids from the
    tokenizer's own BPE model (`model.tokenize` of its byte-level image), kept by piece.

    Why: tokenizers spends ~1.5-2 us per pre-token around the BPE itself (a NormalizedString with alignment vectors
    per piece, token strings and offsets per token): ~0.5 us a character of English text on a 2-core CPU, ~70 % of
    a RACE request's prepare. Here it is the regex (~0.1 us a character) and a dictionary look-up per piece.

    Built (`of`) only for the structure it reproduces: no normalizer but a Unicode normal form (ASCII text is left
    as it is), a Sequence of an isolating Split regex that `ascii_split_pattern` translates and a ByteLevel without
    prefix space or regex of its own, a BPE model without dropout or affixes, added tokens matched as written (not
    normalized, no stripping, not single-word); and only when it equals the tokenizer on `ASCII_PROBES`. `encode`
    answers None for text that is not ASCII, which the tokenizer then encodes."""

    CACHE_PIECES = 1 << 16  # pieces kept (~10 MB at most); cleared when full (only speed depends on them)

    def __init__(self, backend, split_re: re.Pattern, added: dict[str, int]):
        self.backend, self.split_re, self.added = backend, split_re, added
        self.model = backend.model
        self.images = str.maketrans({chr(b): image for b, image in _byte_level_images().items() if b < 128})
        longest_first = sorted(added, key=len, reverse=True)
        self.added_re = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if added else None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)  # tokens added later: back to the tokenizer
        self.pieces: dict[str, tuple[int, ...]] = {}  # piece (as written) -> its ids

    @classmethod
    def of(cls, tokenizer) -> AsciiByteLevelBPE | None:
        """The Python path for this (fast) tokenizer, or None where it does not have the structure reproduced."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or type(backend.model).__name__ != "BPE" or backend.pre_tokenizer is None:
            return None
        model = backend.model
        if model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix:
            return None
        normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
        if normalizer is not None and normalizer.get("type") not in ("NFC", "NFD", "NFKC", "NFKD"):
            return None
        pre = json.loads(backend.pre_tokenizer.__getstate__())
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if not steps or len(steps) != 2:
            return None
        split, byte_level = steps
        if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
                or "Regex" not in split.get("pattern", {}) or byte_level.get("type") != "ByteLevel"
                or byte_level.get("add_prefix_space") or byte_level.get("use_regex")):
            return None
        pattern = ascii_split_pattern(split["pattern"]["Regex"])
        try:
            split_re = re.compile(pattern, re.ASCII) if pattern is not None else None
        except re.error:
            return None
        if split_re is None or split_re.groups:  # (findall would return groups, not pieces)
            return None
        added = {}
        for token_id, token in backend.get_added_tokens_decoder().items():
            if token.normalized or token.lstrip or token.rstrip or token.single_word:
                return None
            added[token.content] = token_id
        encoder = cls(backend, split_re, added)
        for probe in ASCII_PROBES:
            if encoder.encode(probe) != backend.encode(probe, add_special_tokens=False).ids:
                log.info("flide: the Python byte-level BPE differs from the tokenizer on a probe; not used")
                return None
        encoder.pieces.clear()  # what the probes put there
        return encoder

    def current(self) -> bool:
        """Whether the tokenizer still splits out the added tokens this was built with (asked once per batch): none
        added since, and special tokens not set to be encoded as text (transformers sets that for a moment while it
        encodes control tokens of user text)."""
        return (not self.backend.encode_special_tokens
                and self.backend.get_vocab_size(with_added_tokens=True) == self.vocab_size)

    def encode(self, text: str) -> list[int] | None:
        """The tokenizer's ids of `text` (no special tokens added), or None where the tokenizer must encode it."""
        if not text.isascii():
            return None
        parts = self.added_re.split(text) if self.added_re is not None else (text,)
        ids: list[int] = []
        for index, part in enumerate(parts):
            if index % 2:  # an added token (split's captured group)
                ids.append(self.added[part])
            elif part:
                found = self.split_re.findall(part)
                if len("".join(found)) != len(part):  # text between matches, which the tokenizer makes a piece
                    return None
                hits = list(map(self.pieces.get, found))
                if None in hits:
                    hits = [self._piece(piece) if got is None else got for piece, got in zip(found, hits)]
                ids.extend(chain.from_iterable(hits))
        return ids

    def _piece(self, piece: str) -> tuple[int, ...]:
        """A piece's ids from the BPE model, kept."""
        ids = tuple(token.id for token in self.model.tokenize(piece.translate(self.images)))
        if len(self.pieces) >= self.CACHE_PIECES:
            self.pieces.clear()
        self.pieces[piece] = ids
        return ids
