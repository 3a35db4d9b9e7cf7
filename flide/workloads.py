"""Benchmark and test workloads: the datasets of `../shared/data` as System One requests (plain dicts).

    from flide import workloads
    requests = workloads.race(limit=8)           # [{"state": article, "questions": {"q0": {"type": "choice", ...}}}]
    engine.decide(requests)

The data folder is `$FLIDE_DATA`, or `<repo>/../shared/data` (next to the repository); every loader also takes
`folder=` (the benchmark configs' `data_dir:`, which needs no environment). It is read, never copied into the
repository; `data_available()` tells tests whether to skip. Each loader takes `limit` (the most requests
returned; None: all) and builds requests in file order, so the same call always gives the same requests.

The workloads of the paper (section 4.1): RACE with one question per passage (`race(one_question=True)`) and with
every question of a passage in one request (`race()`); QuALITY articles cut to 3,600 tokens with one question
(`quality(cut_tokens=3600, tokenizer=tok, one_question=True)`) and whole with all questions (`quality()`); MultiRC
with every answer candidate of a paragraph as a yes/no question (`multirc()`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

__all__ = ["AGENT_QUESTIONS", "data_available", "data_dir", "jev_support", "multirc", "quality", "race", "swe_agent"]


def data_dir() -> Path:
    """The shared data folder: `$FLIDE_DATA`, else `<repo>/../shared/data`, else `<repo>/shared/data` where only that
    exists (benchmarks/h200_session.sh stages ../shared there on the GPU machine, which has no ../shared)."""
    if "FLIDE_DATA" in os.environ:
        return Path(os.environ["FLIDE_DATA"])
    beside, inside = REPO.parent / "shared" / "data", REPO / "shared" / "data"
    return inside if not beside.is_dir() and inside.is_dir() else beside


def data_available(folder: str | Path | None = None) -> bool:
    """Whether the shared data folder (or `folder`) exists (tests skip cleanly when it does not)."""
    return Path(folder or data_dir()).is_dir()


def _path(*parts: str, folder: str | Path | None = None) -> Path:
    folder = Path(folder) if folder is not None else data_dir()
    if not folder.is_dir():
        raise FileNotFoundError(f"The shared data folder {str(folder)!r} does not exist: set FLIDE_DATA (or pass "
                                f"folder=) to the folder holding race/, multirc/, quality/ and jev/ (see "
                                f"../shared/notes/DATA.md).")
    path = folder.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing from the shared data folder {str(folder)!r}.")
    return path


def _jsonl(*parts: str, folder: str | Path | None = None) -> Iterator[dict]:
    with _path(*parts, folder=folder).open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def _take(requests: Iterable[dict], limit: int | None) -> list[dict]:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}.")
    return list(islice(requests, limit))


def _unique_keys(options: Iterable[str]) -> dict[str, None]:
    """{option: None} in order; a repeated option text gets " (2)", " (3)", ... so that no option is lost."""
    criteria: dict[str, None] = {}
    for option in options:
        key, n = option, 1
        while key in criteria:
            n += 1
            key = f"{option} ({n})"
        criteria[key] = None
    return criteria


def _choice(instructions: str, options: Iterable[str]) -> dict[str, Any]:
    return {"type": "choice", "instructions": instructions, "criteria": _unique_keys(options)}


# ---- RACE ----
def race(limit: int | None = None, one_question: bool = False, folder: str | Path | None = None) -> list[dict]:
    """RACE dev (middle, then high): one request per passage, the article as the state and each question a `choice`
    question `q0`, `q1`, ... whose options are the four option texts (no descriptions). one_question: keep only the
    first question of each passage."""

    def requests() -> Iterator[dict]:
        for name in ("race_dev_middle.jsonl", "race_dev_high.jsonl"):
            for passage in _jsonl("race", name, folder=folder):
                pairs = list(zip(passage["questions"], passage["options"]))[: 1 if one_question else None]
                yield {"state": passage["article"],
                       "questions": {f"q{i}": _choice(q, options) for i, (q, options) in enumerate(pairs)}}

    return _take(requests(), limit)


# ---- MultiRC ----
def multirc(limit: int | None = None, max_questions: int = 64, folder: str | Path | None = None) -> list[dict]:
    """MultiRC validation: every answer candidate of a paragraph is a `noul` question `q{qi}_a{ai}` ("is this answer
    correct?"), at most `max_questions` per request: a paragraph with more is split into consecutive requests of the
    same state."""
    if max_questions < 1:
        raise ValueError(f"max_questions must be >= 1, got {max_questions}.")

    def requests() -> Iterator[dict]:
        for row in _jsonl("multirc", "val.jsonl", folder=folder):
            passage = row["passage"]
            questions = [(f"q{qi}_a{ai}", {"type": "noul",
                                           "instructions": f"{q['question']}\nProposed answer: {a['text']}"})
                         for qi, q in enumerate(passage["questions"]) for ai, a in enumerate(q["answers"])]
            for start in range(0, len(questions), max_questions):
                yield {"state": passage["text"], "questions": dict(questions[start: start + max_questions])}

    return _take(requests(), limit)


# ---- QuALITY ----
_OPTION = re.compile(r"\n\s*\(([A-Z])\)[ \t]*")


def parse_quality_question(text: str) -> dict[str, Any]:
    """LEval's "question\\n\\n (A) first\\n (B) second ..." -> a `choice` question {option text: None}."""
    parts = _OPTION.split(text)
    question, labels, options = parts[0].strip(), parts[1::2], [p.strip() for p in parts[2::2]]
    if not options or labels != [chr(ord("A") + i) for i in range(len(labels))]:
        raise ValueError(f"Not a QuALITY question with options (A), (B), ...: {text[:120]!r}")
    return _choice(question, options)


def quality(limit: int | None = None, cut_tokens: int | None = None, tokenizer=None,
            one_question: bool = False, folder: str | Path | None = None) -> list[dict]:
    """QuALITY (LEval's packaging): one request per article, the article as the state and each of its questions a
    `choice` question `q0`, `q1`, ... with the A-D option texts as options. one_question: only the first question of
    each article. cut_tokens (needs `tokenizer`): the article cut to its first `cut_tokens` tokens (the decode of
    them; the articles are tokenized in one batch)."""
    if cut_tokens is not None and tokenizer is None:
        raise ValueError("quality(cut_tokens=...) needs the tokenizer that counts the tokens.")
    rows = _take(_jsonl("quality", "leval_quality.jsonl", folder=folder), limit)
    articles = [row["input"] for row in rows]
    if cut_tokens is not None and articles:
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        ids = tok(articles, add_special_tokens=False)["input_ids"]
        cut = [i for i, row in enumerate(ids) if len(row) > cut_tokens]  # shorter articles stay byte-identical
        for i, text in zip(cut, tok.batch_decode([ids[i][:cut_tokens] for i in cut])):
            articles[i] = text
    return [{"state": article,
             "questions": {f"q{i}": parse_quality_question(text)
                           for i, text in enumerate(row["instructions"][: 1 if one_question else None])}}
            for article, row in zip(articles, rows)]


# ---- Open-Jev support ticket ----
def jev_support(limit: int | None = None, folder: str | Path | None = None) -> list[dict]:
    """The Open-Jev support ticket: one request (a state object and 28 typed questions), as stored."""
    request = json.loads(_path("jev", "open_jev_support_28.json", folder=folder).read_text(encoding="utf-8"))
    if not (isinstance(request, dict) and "state" in request and isinstance(request.get("questions"), dict)
            and request["questions"]):
        raise ValueError("jev/open_jev_support_28.json is not a System One request {\"state\": ..., \"questions\": "
                         "{...}}.")
    return _take([request], limit)


# ---- SWE-agent trajectories (growing states) ----
AGENT_QUESTIONS = {
    "done": {"type": "noul", "instructions": "Has the agent solved the task?"},
    "next": {"type": "choice", "instructions": "What should the agent do next?",
             "criteria": {"edit": "edit a file", "run": "run a command or the tests", "submit": None}},
    "progress": {"type": "score", "instructions": "How far along is the agent?",
                 "criteria": ["lost", "started", "close", "done"]},
}


def swe_agent(limit: int | None = None, steps: int | None = None, chars: int | None = None,
              folder: str | Path | None = None) -> list[list[str]]:
    """SWE-agent trajectories (`swe_agent_trajs/*.traj`, file order) as growing states: for each trajectory, the
    history as text after each assistant turn (each step's state extends the previous one). `steps`: at most that
    many steps per trajectory; `chars`: cut every message to that many characters (quick runs on tiny models). Ask
    `AGENT_QUESTIONS` (or your own) of each state to replay an agent guard step by step."""
    trajectories = []
    directory = _path("swe_agent_trajs", "MANIFEST.json", folder=folder).parent
    for path in sorted(directory.glob("*.traj")):
        history = json.loads(path.read_text(encoding="utf-8")).get("history") or []
        states, text = [], ""
        for message in history:
            content = message.get("content")
            if isinstance(content, list):
                content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
            content = str(content) if chars is None else str(content)[:chars]
            text += f"{message.get('role')}: {content}\n\n"
            if message.get("role") == "assistant":
                states.append(text)
                if steps is not None and len(states) == steps:
                    break
        if states:
            trajectories.append(states)
    return _take(trajectories, limit)
