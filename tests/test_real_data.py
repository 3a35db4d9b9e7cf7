"""Real requests (RACE, MultiRC, QuALITY from ../shared/data): Flide's answers equal pipeline("decision")'s on a tiny
random Qwen3.5, and its split tokenization equals transformers' prepare_inputs token for token with the real
Qwen3.5 tokenizer. Skipped when the shared data folder is absent."""

from __future__ import annotations

import gzip
import shutil

import numpy as np
import pytest

from flide import workloads

if not workloads.data_available():
    pytest.skip(f"shared data folder {workloads.data_dir()} is absent", allow_module_level=True)

import flide  # noqa: E402
from flide.models.tiny import tiny_model, tiny_tokenizer  # noqa: E402

# Capacities sized to the workloads below (RACE: 8 passages, 33 questions, ~7k tiny tokens; MultiRC: 3 requests,
# 36 questions, ~5k), so that each decide() call runs as one round.
CONFIG = {"capacities": {"buckets": [8192], "requests": 8, "states": 8, "branches": 48, "readout_rows": 48}}


@pytest.fixture(scope="module")
def tiny():
    """(engine, reference pipeline): a patched tiny Qwen3.5 and an unpatched copy of the same weights."""
    from transformers import pipeline

    tok = tiny_tokenizer()
    engine = flide.patch(tiny_model("qwen3_5_text", seed=1), tok, config=CONFIG)
    return engine, pipeline("decision", model=tiny_model("qwen3_5_text", seed=1), tokenizer=tok)


def assert_same_answers(requests, got, pipe):
    assert len(got) == len(requests)
    firsts = set()  # the first option's probability of every question: they must differ (a model that reads)
    for request, answers in zip(requests, got):
        expected = pipe(request)
        assert list(answers) == list(request["questions"]) == list(expected)
        for name, ref in expected.items():
            ans = answers[name]
            assert ans["type"] == ref["type"]
            firsts.add(round(ans["noul"] if ans["type"] == "noul" else next(iter(ans["probabilities"].values())), 6))
            if ref["type"] == "noul":
                assert abs(ans["noul"] - ref["noul"]) <= 1e-5, name
            else:
                assert list(ans["probabilities"]) == list(ref["probabilities"])
                diff = max(abs(ans["probabilities"][k] - p) for k, p in ref["probabilities"].items())
                assert diff <= 1e-5, (name, diff)
    assert len(firsts) > len(requests)


def decide_in_one_round(engine, requests):
    """engine.decide(requests), after checking they share one round (one flat pass, not one per request)."""
    from flide.graphs.buckets import plan_rounds
    from flide.round import footprint

    needs = [footprint(engine.prepare(r)) for r in requests]
    rounds = plan_rounds(needs, engine.config.capacities, engine.max_options)
    assert len(rounds) == 1 and not rounds[0].oversized, rounds
    return engine.decide(requests)


def test_race_matches_pipeline(tiny):
    engine, pipe = tiny
    requests = workloads.race(limit=8)
    assert all(len(r["questions"]) >= 1 for r in requests)
    assert_same_answers(requests, decide_in_one_round(engine, requests), pipe)


def test_multirc_matches_pipeline(tiny):
    engine, pipe = tiny
    requests = workloads.multirc(limit=3, max_questions=16)
    assert all(0 < len(r["questions"]) <= 16 for r in requests)
    assert_same_answers(requests, decide_in_one_round(engine, requests), pipe)


# ---- token exactness with the real Qwen3.5 tokenizer (no model) ----
@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    source = workloads.data_dir().parent / "models" / "qwen3_5"
    files = [source / name for name in ("tokenizer.json.gz", "tokenizer_config.json", "chat_template.jinja")]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        pytest.skip(f"Qwen3.5 tokenizer files absent: {', '.join(missing)}")
    folder = tmp_path_factory.mktemp("qwen3_5_tokenizer")
    with gzip.open(files[0], "rb") as packed, open(folder / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(packed, out)
    for f in files[1:]:
        shutil.copy(f, folder / f.name)
    tok = AutoTokenizer.from_pretrained(folder)
    from transformers.decision import DecisionConfig

    from flide.requests import PromptTokenizer

    PromptTokenizer(tok, DecisionConfig())  # adds the decision sentinels, as prepare_inputs would
    # prepare_inputs asks for the whole vocabulary (248k entries, ~1 s) once per request to see whether the sentinels
    # are there; they are, and the vocabulary no longer changes: answer from a copy
    vocab = tok.get_vocab()
    tok.get_vocab = lambda: vocab
    return tok


def check_tokens(requests, tok, min_trunk_share: float = 0.0):
    from transformers.decision import DecisionConfig, prepare_inputs

    from flide.requests import PromptTokenizer, parse_request

    config = DecisionConfig()
    prompts = PromptTokenizer(tok, config)
    for request in requests:
        state, questions = parse_request(request, config, 64)
        prepared = prompts.prepare(state, questions)
        expected = prepare_inputs(config, request, tok)
        assert len(prepared.trunks) == 1  # the state is tokenized once for the whole request
        assert len(prepared.branches) == len(expected) == len(request["questions"])
        for branch, (inputs, group) in zip(prepared.branches, expected):
            assert [q.name for q in branch.questions] == [q.name for q in group]
            ids = inputs["input_ids"][0].numpy()
            got = np.concatenate([prepared.trunks[branch.trunk], branch.tokens])
            assert np.array_equal(got, ids), (branch.questions[0].name, len(got), len(ids))
            assert np.array_equal(branch.reads, inputs["marks"].numpy() - 1)
            assert len(prepared.trunks[0]) > min_trunk_share * len(ids)


def test_race_tokens_exact(qwen_tokenizer):
    check_tokens(workloads.race(limit=20), qwen_tokenizer)


def test_multirc_tokens_exact(qwen_tokenizer):
    check_tokens(workloads.multirc(limit=5), qwen_tokenizer)


def test_quality_tokens_exact(qwen_tokenizer):
    requests = workloads.quality(limit=3)
    assert all(len(r["questions"]) > 1 for r in requests)
    check_tokens(requests, qwen_tokenizer, min_trunk_share=0.5)


def test_quality_cut(qwen_tokenizer):
    requests = workloads.quality(limit=3, cut_tokens=512, tokenizer=qwen_tokenizer, one_question=True)
    whole = workloads.quality(limit=3)
    for cut, full in zip(requests, whole):
        assert list(cut["questions"]) == ["q0"] and cut["questions"]["q0"] == full["questions"]["q0"]
        assert full["state"].startswith(cut["state"][:1000])
        assert abs(len(qwen_tokenizer(cut["state"], add_special_tokens=False)["input_ids"]) - 512) <= 2
    check_tokens(requests, qwen_tokenizer)


def test_swe_agent_trajectories_grow():
    trajectories = workloads.swe_agent(limit=4, steps=5, chars=300)
    assert trajectories and all(1 <= len(states) <= 5 for states in trajectories)
    for states in trajectories:  # each step's state extends the one before (a growing history)
        assert all(later.startswith(earlier) and len(later) > len(earlier) for earlier, later in zip(states, states[1:]))


def test_ascii_text_encoded_in_python_equals_the_qwen_tokenizer(qwen_tokenizer):
    """Qwen3.5's tokenizer gets the Python path for ASCII text (flide.ascii_bpe.AsciiByteLevelBPE), and it gives the
    tokenizer's ids on the datasets' texts (whole, and line by line as tails are encoded) and on random ASCII."""
    import random

    from flide.ascii_bpe import AsciiByteLevelBPE

    encoder = AsciiByteLevelBPE.of(qwen_tokenizer)
    assert encoder is not None
    backend = qwen_tokenizer._tokenizer
    texts = [r["state"] for r in workloads.race(limit=40) + workloads.multirc(limit=10) + workloads.quality(limit=2)]
    texts += ["\n" + line for text in texts[:20] for line in text.split("\n")]
    rng = random.Random(4)
    alphabet = [chr(c) for c in range(128)] + ["'s", "'LL", "  ", "\r\n", "<|im_end|>", "<|mark|>", "<think>", "123"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(2000)]
    checked = 0
    for text in texts:
        got = encoder.encode(text)
        if got is None:
            assert not text.isascii()
            continue
        assert got == backend.encode(text, add_special_tokens=False).ids, repr(text[:80])
        checked += 1
    assert checked > 2000
