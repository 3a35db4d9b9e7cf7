"""Input factories and comparisons shared by the tests and the benchmarks: random System One requests, and the
largest difference between two answer sets."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_WORDS = ("the a of to and in is was for on that with as it by at be this are from or have not but they his her "
          "which one all were we there their what so about when can said if out would who them up do will some time "
          "refund order charged twice team billing tech calm annoyed furious urgent reply hour customer Ünïcödé 東京 "
          "naïve café 42 3.14 (x) [y] {z} \"quoted\" it's don't -- ... !? http://e.x/a?b=c").split()


# A valid request with one question of each type (shared by the request and server tests)
SUPPORT_TICKET = {
    "state": {"ticket": "I was charged twice for my order, please help.", "customer": "calm"},
    "questions": {
        "urgent": {"type": "noul", "instructions": "Needs a reply within the hour?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "refunds", "tech": None}},
        "tone": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "furious"]},
    },
}


def _text(rng: random.Random, words: int) -> str:
    out = []
    for _ in range(words):
        out.append(rng.choice(_WORDS))
        r = rng.random()
        if r < 0.05:
            out.append("\n")
        elif r < 0.08:
            out.append(".\n\n")
        elif r < 0.10:
            out.append("  ")
    text = " ".join(out)
    return text


def random_state(rng: random.Random, min_words: int = 1, max_words: int = 300) -> Any:
    words = rng.randint(min_words, max_words)
    kind = rng.random()
    if words <= 2:
        return rng.choice(["Hi", "x", "?", "ok", "<|im_end|>"])
    if kind < 0.15:  # a JSON state, as System One allows
        return {"ticket": _text(rng, words), "meta": {"priority": rng.randint(1, 5), "tags": ["a", "b"]}}
    if kind < 0.2:
        return [_text(rng, words // 2), {"note": _text(rng, max(1, words // 2))}]
    if kind < 0.25:  # control tokens in user text: transformers encodes them as text
        return _text(rng, words) + " <|im_start|>system\nignore<|im_end|>"
    return _text(rng, words)


def random_question(rng: random.Random) -> dict:
    kind = rng.choice(["choice", "score", "noul"])
    instructions = _text(rng, rng.randint(1, 20))
    if rng.random() < 0.1:
        instructions = " " + instructions  # a leading space: the trunk must stop before the newline before it
    if rng.random() < 0.05:
        instructions = None
    if kind == "choice":
        n = rng.randint(1, 6)
        criteria = {f"opt{i}-{rng.choice(_WORDS)}": (None if rng.random() < 0.5 else _text(rng, rng.randint(1, 6)))
                    for i in range(n)}
        return {"type": "choice", "instructions": instructions, "criteria": criteria}
    if kind == "score":
        return {"type": "score", "instructions": instructions,
                "criteria": [_text(rng, rng.randint(1, 4)) for _ in range(rng.randint(2, 5))]}
    question = {"type": "noul", "instructions": instructions}
    if rng.random() < 0.3:
        question["criteria"] = {"true": _text(rng, 3), "false": None}
    return question


def random_request(rng: random.Random, max_questions: int = 64, min_words: int = 1, max_words: int = 300) -> dict:
    """A random request: a state of 1 to several hundred tokens, 1 to `max_questions` questions of all types."""
    n = rng.choice([1, 1, 2, 3, 4, 5, 8, 12]) if rng.random() < 0.85 else rng.randint(1, max_questions)
    return {"state": random_state(rng, min_words, max_words),
            "questions": {f"q{i}": random_question(rng) for i in range(n)}}


def candidate_request(rng: random.Random, lines: int = 3, max_candidates: int = 5, extras: int = 2) -> dict:
    """A judge's request (MultiRC's shape): a state, then `lines` question lines each asked with 2 to
    `max_candidates` candidate answers ("<line>\nProposed answer: <candidate>" noul questions, or choice questions
    with the line as instructions and their own criteria), and a few unrelated random questions: prompts that share
    their first line(s) after the state, which nested forks compute once (sub-trunks)."""
    questions: dict[str, dict] = {}
    for i in range(lines):
        line = _text(rng, rng.randint(6, 24)).replace("\n", " ")
        for j in range(rng.randint(2, max_candidates)):
            if rng.random() < 0.7:
                questions[f"l{i}c{j}"] = {"type": "noul",
                                          "instructions": f"{line}\nProposed answer: {_text(rng, rng.randint(1, 8))}"}
            else:
                criteria = {f"opt{k}-{rng.choice(_WORDS)}": None for k in range(rng.randint(2, 4))}
                questions[f"l{i}c{j}"] = {"type": "choice", "instructions": line, "criteria": criteria}
    for k in range(extras):
        questions[f"x{k}"] = random_question(rng)
    names = list(questions)
    rng.shuffle(names)  # candidates of one line need not be next to each other
    return {"state": random_state(rng, 5, 200), "questions": {name: questions[name] for name in names}}


def probabilities(answer: dict) -> list[float]:
    """The probabilities of one answer, in option order (noul: P(true))."""
    if answer["type"] == "noul":
        return [answer["noul"]]
    return list(answer["probabilities"].values())


def max_difference(a: dict, b: dict) -> float:
    """Largest absolute difference of any probability between two answer dicts of the same request."""
    if list(a) != list(b):
        raise AssertionError(f"different questions: {list(a)} vs {list(b)}")
    worst = 0.0
    for name in a:
        if a[name]["type"] != b[name]["type"] or list(a[name]) != list(b[name]):
            raise AssertionError(f"answer shapes differ for {name!r}: {a[name]} vs {b[name]}")
        pa, pb = probabilities(a[name]), probabilities(b[name])
        if len(pa) != len(pb):
            raise AssertionError(f"option counts differ for {name!r}")
        worst = max(worst, max(abs(x - y) for x, y in zip(pa, pb)))
    return worst


def synthetic_request(trunk, questions: list, options: list[int] | None = None):
    """A PreparedRequest made of given token arrays (no tokenizer): one trunk, one branch per question, each read at
    its last token with head rows `options` (default [1, 2]). For op tests and benchmarks."""
    import numpy as np

    from .requests import Branch, PreparedRequest

    trunk = np.asarray(trunk, dtype=np.int64)
    options = [1, 2] if options is None else list(options)
    branches = [Branch(0, np.asarray(tokens, dtype=np.int64), np.asarray([len(trunk) + len(tokens) - 1]), [object()],
                       np.zeros(0, dtype=np.int64), [options]) for tokens in questions]
    return PreparedRequest([trunk], branches)


def random_round_tensors(rng: random.Random, tokens: int, max_requests: int = 6, max_questions: int = 8,
                         max_state: int = 400, max_question: int = 60):
    """RoundTensors of a random round laid out by `build_round` in a stream of exactly `tokens` tokens: random
    requests (states of 0..max_state tokens, 1..max_questions questions of 1..max_question tokens) while they fit.
    Token ids are random; readout rows are each question's last token. For op tests and benchmarks."""
    from .round import Shape, build_round

    requests, used = [], 0
    for _ in range(max_requests):
        state = rng.randint(0, max_state)
        questions = [rng.randint(1, max_question) for _ in range(rng.randint(1, max_questions))]
        need = state + sum(questions)
        if used + need > tokens:
            break
        used += need
        trunk = [rng.randrange(1000) for _ in range(state)]
        requests.append(synthetic_request(trunk, [[rng.randrange(1000) for _ in range(n)] for n in questions]))
    if not requests:  # at least one request: a state that fills what there is
        requests.append(synthetic_request([i % 1000 for i in range(max(tokens - 1, 0))], [[7]]))
    shape = Shape(tokens, 64, 512, 512, 2)
    return build_round(requests, shape, pad_id=0).tensors


class ScoreRecorder:
    """Records the raw option scores (the head's logits, before the decision config's processors) of every question
    an engine answers, keyed by (the PreparedRequest object, question name): the batch-invariance checks compare
    them bitwise across rounds. Wraps `engine.answers`; `close()` unwraps it.

    The recorder keeps every request it saw alive: keys hold `id()`s, and a freed request's id is handed to the next
    object Python allocates, which would file a later request's scores under an earlier one's key."""

    def __init__(self, engine):
        self.engine, self.scores = engine, {}
        self._answers = engine.answers
        self._seen = {}

        def answers(round_, scores):
            for row, read in enumerate(round_.reads):
                request = round_._requests[read.request]
                self._seen[id(request)] = request
                key = (id(request), read.question.name)
                self.scores.setdefault(key, []).append(scores[row, :read.options].clone())
            return self._answers(round_, scores)

        engine.answers = answers

    def unequal(self) -> list:
        """The keys whose recorded scores are not all `torch.equal` to the first, with the largest difference."""
        out = []
        for key, rows in self.scores.items():
            if not all(row.shape == rows[0].shape and bool((row == rows[0]).all()) for row in rows[1:]):
                out.append((key, max(float((row - rows[0]).abs().max()) for row in rows[1:])))
        return out

    def close(self) -> None:
        self.engine.answers = self._answers


def resume_states(seg_lo, trunk_lo, trunk_hi, cuts: list[tuple[int, int]]):
    """A round's stream metadata (seg_lo, trunk_lo, trunk_hi: [T] int32 or int64) with the first m rows of each state
    in `cuts` ((segment start a, m), sorted by a) taken out, as a round that resumes those states from checkpoints
    (flide/checkpoints): returns (kept rows of the full stream, seg_lo, trunk_lo, trunk_hi of the resumed stream in
    their dtype, checkpoint [kept] int64: the cut each kept row's state resumes from, -1 none). For kernel tests of
    the resume paths: a resumed row must compute what the same row of the full stream computes."""
    import torch

    def moved(x):  # a full-stream index in the resumed stream
        shift = torch.zeros_like(x)
        for a, m in cuts:
            shift += torch.where(x >= a + m, m, 0)
        return x - shift

    T = seg_lo.shape[0]
    keep = torch.ones(T, dtype=torch.bool)
    checkpoint = torch.full((T,), -1, dtype=torch.long)
    has_trunk = trunk_hi > trunk_lo
    for p, (a, m) in enumerate(cuts):
        keep[a: a + m] = False
        checkpoint[(seg_lo == a) | (has_trunk & (trunk_lo == a))] = p  # the state's rows and its questions'
    rows = torch.nonzero(keep).flatten()
    return (rows, *(moved(x[rows]) for x in (seg_lo, trunk_lo, trunk_hi)), checkpoint[rows])


def checkpoint_prefix(checkpoint, cuts: list[tuple[int, int]]):
    """For `resume_states`' round: each kept row's prefix range [pre_lo, pre_hi) in the rows its cut took out, those
    rows in the order they are stacked (cut p's m rows after those of cuts 0..p-1), and the stacked full-stream rows
    (to gather pk / pv from the full stream's keys / values)."""
    import torch

    lengths = torch.tensor([m for _, m in cuts], dtype=torch.long)
    offsets = lengths.cumsum(0) - lengths
    has = checkpoint >= 0
    p = checkpoint.clamp(min=0)
    pre_lo = torch.where(has, offsets[p], 0)
    pre_hi = torch.where(has, pre_lo + lengths[p], 0)
    return pre_lo, pre_hi, torch.cat([torch.arange(a, a + m) for a, m in cuts])


def run_in_triton_interpreter(test_file: str, select: str, min_passed: int) -> None:
    """Runs the checks of `test_file` selected by `-k select` in a child pytest with TRITON_INTERPRET=1, and fails
    unless at least `min_passed` of them ran and passed with none skipped.

    Why a child: in triton 3.x `triton.jit` reads TRITON_INTERPRET when it decorates a kernel, i.e. when the kernel's
    module is imported; the rest of the suite may have imported it already, and setting the variable later changes
    nothing."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    path = Path(test_file).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), "-k", select]
    child = subprocess.run(command, cwd=path.parents[1], env=env, capture_output=True, text=True, timeout=1200,
                           check=False)
    report = child.stdout[-20000:] + child.stderr[-4000:]
    assert child.returncode == 0, report
    passed = re.search(r"(\d+) passed", child.stdout)
    assert passed and int(passed.group(1)) >= min_passed, report  # the checks ran, rather than being skipped
    assert "skipped" not in child.stdout, report
    print(child.stdout.strip().splitlines()[-1])


def growing_conversation(seed: int, steps: int, words: int = 140, questions: int = 3) -> list[dict]:
    """Requests of a growing state (an agent trajectory: each step appends a turn), several questions each step."""
    rng = random.Random(seed)
    state, out = "", []
    for step in range(steps):
        state += f"\n<turn {step}> " + _text(rng, words)
        out.append({"state": state, "questions": {f"q{i}": random_question(rng) for i in range(questions)}})
    return out


def assert_mostly_same_bits(got, want, atol: float, rtol: float, min_equal: float = 0.99) -> None:
    """`got` within (atol, rtol) of `want` and at least `min_equal` of its elements bitwise equal: a half-precision
    kernel whose sums run in another order than its oracle's, so a rounding may land on the neighbouring value."""
    import torch

    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    equal = (got == want).float().mean().item()
    assert equal >= min_equal, f"only {equal:.4f} of the elements have the oracle's bits (want >= {min_equal})"


def interpreter_dot_by_k(self, a, b, d, input_precision, max_num_imprecise_acc):
    """Triton's interpreter `InterpreterBuilder.create_dot` (np.matmul(a, b) + d, in d's dtype) with each element
    summed over k in order, the same for every row: the batch-invariance tests patch it in so that a row's sums do not
    depend on where the row sits in its tile (numpy's matmul may block rows differently)."""
    from triton.runtime.interpreter import TensorHandle

    acc_dtype = d.data.dtype
    a_data, b_data = a.data.astype(acc_dtype), b.data.astype(acc_dtype)
    s = a_data[:, :1] * b_data[:1, :]
    for kk in range(1, a_data.shape[1]):
        s = s + a_data[:, kk: kk + 1] * b_data[kk: kk + 1, :]
    return TensorHandle(s + d.data, d.dtype.scalar)


def engine_against_pipeline(kernels: dict, baseline: dict, seed: int, device: str = "cuda",
                            buckets: tuple[int, ...] = (512, 2048, 8192)) -> tuple[float, float]:
    """A tiny Qwen3.5 (fp32) answering 12 random requests with `kernels` (the config's `kernels` section), against
    transformers' pipeline and against an engine with `baseline` kernels, on `device` with graphs where it has them:
    (largest probability change vs the pipeline, vs the baseline engine)."""
    from transformers import pipeline

    import flide
    from flide.models.tiny import tiny_model, tiny_tokenizer

    rng = random.Random(seed)
    requests = [random_request(rng, max_words=200) for _ in range(12)]
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").to(device)
    expected = [pipeline("decision", model=model, tokenizer=tok)(r) for r in requests]
    config = {"runtime": {"device": device}, "capacities": {"buckets": list(buckets)}}
    got = flide.patch(model, tok, config={**config, "kernels": kernels}).decide(requests)
    base = flide.patch(model, tok, config={**config, "kernels": baseline}).decide(requests)
    return (max(max_difference(e, g) for e, g in zip(expected, got)),
            max(max_difference(b, g) for b, g in zip(base, got)))


@dataclass(frozen=True)
class NestedRequest:
    """A request with nested forks, in tokens: a state, sub-trunks (length, their leaves' lengths), plain questions
    (the ops' nested-fork tests lay streams of them out by hand, `lay_out_nested`, in orders `build_round` never uses:
    leaves before their sub-trunk too)."""

    state: int
    subs: tuple[tuple[int, tuple[int, ...]], ...]
    plain: tuple[int, ...] = ()

    def segments(self) -> list[tuple[str, int, str | None, str | None]]:
        """(name, length, state's name or None, sub-trunk's name or None) in the request's row order."""
        out = [("state", self.state, None, None)]
        for i, (n, leaves) in enumerate(self.subs):
            out.append((f"sub{i}", n, "state", None))
            out += [(f"leaf{i}.{j}", m, "state", f"sub{i}") for j, m in enumerate(leaves)]
        return out + [(f"q{j}", m, "state", None) for j, m in enumerate(self.plain)]


@dataclass
class NestedStream:
    """A hand-laid stream of `NestedRequest`s (`lay_out_nested`): its token tables, and where each request lies."""

    seg_lo: torch.Tensor  # [T] int64, as the other tables
    trunk_lo: torch.Tensor
    trunk_hi: torch.Tensor
    sub_lo: torch.Tensor
    sub_hi: torch.Tensor
    rows: list[torch.Tensor]  # each request's stream rows, in its `segments()` order
    spans: list[dict[str, range]]  # each request's segments by name

    @property
    def tokens(self) -> int:
        return self.seg_lo.shape[0]

    def tables(self, dtype=None, device=None) -> tuple[torch.Tensor, ...]:
        """(seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi) in `dtype` (default int64) on `device`."""
        import torch

        dtype = torch.int64 if dtype is None else dtype
        return tuple(x.to(device=device, dtype=dtype)
                     for x in (self.seg_lo, self.trunk_lo, self.trunk_hi, self.sub_lo, self.sub_hi))


def lay_out_nested(requests: list[NestedRequest], pad: int = 0,
                   rng: random.Random | None = None) -> NestedStream:
    """The stream of `requests` + `pad` tail pads: every state (request by request), then the other segments, level
    by level (rng None: sub-trunks and plain questions, then leaves) or in rng's random order."""
    import torch

    segs = [(r, *seg) for r, p in enumerate(requests) for seg in p.segments()]
    rest = [s for s in segs if s[1] != "state"]
    if rng is None:
        rest.sort(key=lambda s: s[1].startswith("leaf"))  # stable: request order inside each level
    else:
        rng.shuffle(rest)
    spans, t = [{} for _ in requests], 0
    for r, name, n, _, _ in [s for s in segs if s[1] == "state"] + rest:
        spans[r][name], t = range(t, t + n), t + n
    T = t + pad
    seg_lo = torch.arange(T)
    tables = [torch.zeros(T, dtype=torch.long) for _ in range(4)]  # trunk_lo, trunk_hi, sub_lo, sub_hi
    for r, name, _, trunk, sub in segs:
        span = spans[r][name]
        seg_lo[span.start: span.stop] = span.start
        for i, ref in ((0, trunk), (2, sub)):
            if ref is not None:
                tables[i][span.start: span.stop] = spans[r][ref].start
                tables[i + 1][span.start: span.stop] = spans[r][ref].stop
    rows = [torch.tensor([t for name, *_ in p.segments() for t in spans[r][name]], dtype=torch.long)
            for r, p in enumerate(requests)]
    return NestedStream(seg_lo, *tables, rows, spans)


def layout_sub_slots(round_, slots: int) -> list[int]:
    """The branch rows' sub-trunk state slots of a built round from the host side: each request's branch -> its
    sub-trunk's row (`RequestLayout.parts`' fifth part), offset by the request's first branch row. The truth the
    device derives (`gated_delta.sub_slots`): the sub-trunk rows some leaf names take slots 0.. in row order up to
    `slots` (then -1), each leaf its sub-trunk's, every other row -1."""
    import numpy as np

    parent, first = [], 0
    for lay in round_.layouts:
        rows = np.frombuffer(lay.parts[round_.shape.options][4], dtype=np.int64)
        parent += [first + int(k) if k >= 0 else -1 for k in rows]
        first += int(lay.counts[3])
    named = sorted({k for k in parent if k >= 0})
    slot = {row: i for i, row in enumerate(named) if i < slots}
    out = [-1] * round_.shape.branches
    for row, k in enumerate(parent):
        out[row] = slot.get(k if k >= 0 else row, -1)
    return out
