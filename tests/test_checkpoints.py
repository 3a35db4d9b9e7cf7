"""Growing states: checkpoints saved inside the forward pass and later requests resuming from them.

Ops: each resumable companion against the plain op over the whole sequence (the checkpoint made from the same
stream); opcheck. Engine: a conversation growing step by step (an agent's trajectory), several questions each step,
answered with checkpoints equal a fresh engine without them (1e-5; seen ~1e-7) and transformers' pipeline on a sample;
hits from the second step on; computed tokens ~ the tail; a constant hash never resumes from other tokens; LRU
eviction; config errors; SWE-agent trajectories from ../shared (skipped without them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import flide
from flide.checkpoints import Checkpoint, CheckpointCache, Segments, prefix_hashes
from flide.config import KernelConfig, load_config
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.ops.fork_attention import fork_attention_prefix_reference, fork_attention_reference
from flide.ops.fork_attention.reference import fork_attention_naive
from flide.ops.fork_conv import fork_conv_reference, fork_conv_window_reference
from flide.ops.gated_delta import gated_delta_reference, gated_delta_snapshot_reference
from flide.ops.registry import resumable, variants
from flide.testing import growing_conversation, max_difference

ATOL = 1e-5
SWE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "swe_agent_trajs"


def seg(*bounds):
    return torch.tensor(bounds, dtype=torch.long)


# ---- ops ----

def test_gated_delta_snapshot_is_the_resumed_state():
    """The snapshot at chunk c of a segment, used as the initial state of the segment's rest, gives the same outputs
    and final state as the whole segment; unsnapshotted rows are zeros."""
    g = torch.Generator().manual_seed(0)
    T, Hk, Hv, K, V = 300, 2, 4, 16, 8
    q, k = torch.randn(T, Hk, K, generator=g), torch.randn(T, Hk, K, generator=g)
    v = torch.randn(T, Hv, V, generator=g)
    decay = -torch.rand(T, Hv, generator=g)
    beta = torch.rand(T, Hv, generator=g)
    none = torch.zeros(0, Hv, K, V)
    args = (q, k, v, decay, beta)
    # two segments: [0, 200) snapshotted at chunk 2 (token 128), [200, 300) not
    out, final, snap = gated_delta_snapshot_reference(*args, seg(0, 200), seg(200, 100), none, seg(-1, -1),
                                                      seg(2, -1), 0.25, True)
    ref_out, ref_final = gated_delta_reference(*args, seg(0, 200), seg(200, 100), none, seg(-1, -1), 0.25, True)
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)
    assert torch.equal(snap[1], torch.zeros_like(snap[1]))
    # resume [128, 200) from the snapshot
    out2, final2 = gated_delta_reference(*args, seg(128), seg(72), snap[:1], seg(0), 0.25, True)
    torch.testing.assert_close(out2[128:200], ref_out[128:200], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final2[0], ref_final[0], atol=1e-5, rtol=1e-5)
    # a snapshot at the segment's end (chunk = its chunk count) is its final state; chunk 0 its initial state
    _, final3, snap3 = gated_delta_snapshot_reference(*args, seg(0, 0), seg(128, 50), snap[:1], seg(-1, 0),
                                                      seg(2, 0), 0.25, True)
    torch.testing.assert_close(snap3[0], final3[0])
    torch.testing.assert_close(snap3[1], snap[0])


def _fork_stream(rng: torch.Generator, m: int, n: int, questions: list[int]):
    """A state of n tokens then its questions, as one stream (seg_lo, trunk_lo, trunk_hi), and the same with the
    state's first m tokens cut out (the resumed layout)."""
    def layout(start: int):
        state = n - start
        seg_lo, trunk_lo, trunk_hi = list(range(0, 0)), [], []
        seg_lo += [0] * state
        trunk_lo += [0] * state
        trunk_hi += [0] * state
        cursor = state
        for length in questions:
            seg_lo += [cursor] * length
            trunk_lo += [0] * length
            trunk_hi += [state] * length
            cursor += length
        return tuple(torch.tensor(x, dtype=torch.long) for x in (seg_lo, trunk_lo, trunk_hi))
    return layout(0), layout(m)


def test_fork_attention_prefix_equals_whole_stream():
    g = torch.Generator().manual_seed(1)
    m, n, questions = 128, 200, [5, 9, 1]
    (full, cut) = _fork_stream(g, m, n, questions)
    T = len(full[0])
    q, k, v = torch.randn(T, 4, 8, generator=g), torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g)
    ref = fork_attention_reference(q, k, v, *full, 0.3)
    # resumed: stream rows m.. only, the first m keys as prefix rows [0, m) seen by every token
    Tc = T - m
    pre_lo, pre_hi = torch.zeros(Tc, dtype=torch.long), torch.full((Tc,), m, dtype=torch.long)
    out = fork_attention_prefix_reference(q[m:], k[m:], v[m:], *cut, k[:m], v[:m], pre_lo, pre_hi, 0.3)
    torch.testing.assert_close(out, ref[m:], atol=1e-6, rtol=1e-5)
    naive = fork_attention_naive(q[m:], k[m:], v[m:], *cut, 0.3, k[:m], v[:m], pre_lo, pre_hi)
    torch.testing.assert_close(out, naive, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [200, 130])
def test_fork_conv_window_equals_whole_stream(n):
    """n = 130: the resumed segment holds 2 tokens, so a question's window reaches through it into the checkpoint."""
    g = torch.Generator().manual_seed(2)
    m, questions, W = 128, [5, 1, 3], 4
    full, cut = _fork_stream(g, m, n, questions)
    T, D = len(full[0]), 6
    x, weight = torch.randn(T, D, generator=g), torch.randn(D, W, generator=g)
    ref = fork_conv_reference(x, weight, *full, True)
    window = x[m - (W - 1): m][None]
    win_index = torch.zeros(T - m, dtype=torch.long)
    out = fork_conv_window_reference(x[m:], weight, *cut, window, win_index, True)
    torch.testing.assert_close(out, ref[m:], atol=1e-6, rtol=1e-5)
    # no window (-1): as fork_conv
    none = torch.full((T - m,), -1, dtype=torch.long)
    torch.testing.assert_close(fork_conv_window_reference(x[m:], weight, *cut, window, none, True),
                               fork_conv_reference(x[m:], weight, *cut, True))


def test_opcheck_resumable_ops():
    g = torch.Generator().manual_seed(3)
    T = 70
    q, k, v = torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g)
    lo = torch.zeros(T, dtype=torch.long)
    torch.library.opcheck(fork_attention_prefix_reference,
                          (q, k, v, lo, lo, lo, torch.randn(5, 2, 8), torch.randn(5, 2, 8), lo, lo + 5, 0.5))
    x = torch.randn(T, 6, generator=g)
    torch.library.opcheck(fork_conv_window_reference,
                          (x, torch.randn(6, 4), lo, lo, lo, torch.randn(1, 3, 6), lo, True))
    torch.library.opcheck(gated_delta_snapshot_reference,
                          (q, k, v, -torch.rand(T, 2), torch.rand(T, 2), seg(0), seg(T), torch.zeros(0, 2, 8, 8),
                           seg(-1), seg(1), 0.3, True))


def test_every_mixer_variant_resumes():
    assert set(resumable(KernelConfig())) == {"fork_attention", "gated_delta", "fork_conv"}
    fast = resumable(KernelConfig(fork_attention="triton", gated_delta="fla", fork_conv="triton"), "cuda")
    assert set(fast) == {"fork_attention", "gated_delta", "fork_conv"}
    for op in ("fork_attention", "gated_delta", "fork_conv"):
        for variant in variants(op):
            assert resumable(KernelConfig(**{op: variant}), "cuda")[op] is not None, (op, variant)


# ---- cache ----

def _checkpoint(tokens, nbytes_rows=1000):
    return Checkpoint(np.asarray(tokens, dtype=np.int64), [(torch.zeros(nbytes_rows, 4), torch.zeros(nbytes_rows, 4))])


def test_cache_lru_eviction_and_longest_prefix():
    tokens = np.arange(1000, dtype=np.int64)
    hashes = prefix_hashes(tokens)
    cache = CheckpointCache(budget_bytes=2 * _checkpoint(tokens[:192]).nbytes + 100)  # two fit, not three
    assert cache.put(_checkpoint(tokens[:64]), hashes[0])
    assert cache.put(_checkpoint(tokens[:128]), hashes[1])
    assert cache.lookup(tokens, hashes, 999).length == 128  # longest first
    assert cache.lookup(tokens, hashes, 100).length == 64  # no longer than asked
    cache.lookup(tokens, hashes, 127)  # 64 is now the most recent: 128 goes first
    assert cache.put(_checkpoint(tokens[:192]), hashes[2])
    assert cache.stats()["evictions"] == 1 and not cache.contains(tokens, hashes, 128)
    assert cache.contains(tokens, hashes, 64) and cache.contains(tokens, hashes, 192)
    assert cache.bytes <= cache.budget_bytes
    assert not cache.put(_checkpoint(tokens[:64], nbytes_rows=100_000), hashes[0])  # alone over the budget
    assert cache.stats()["rejected"] == 1
    other = tokens + 1
    assert cache.lookup(other, prefix_hashes(other), 999) is None
    assert cache.stats()["hits"] == 3 and cache.stats()["misses"] == 1


def test_cache_counts_shared_segments_once():
    """A checkpoint that extends another holds the other's key segments (the same tensors): the cache counts them
    once, and evicting either entry frees only what the other does not hold."""
    tokens = np.arange(256, dtype=np.int64)
    hashes = prefix_hashes(tokens)
    a, a2 = torch.zeros(64, 4), torch.zeros(64, 4)
    first = Checkpoint(tokens[:64].copy(), [(Segments((a,)), Segments((a,)))])
    longer = Checkpoint(tokens[:128].copy(), [(Segments((a, a2)), Segments((a, a2)))])
    cache = CheckpointCache(budget_bytes=10**6)
    cache.put(first, hashes[0])
    cache.put(longer, hashes[1])
    tensor_bytes = 64 * 4 * 4
    assert cache.bytes == first.tokens.nbytes + longer.tokens.nbytes + 2 * tensor_bytes
    assert cache.bytes < first.nbytes + longer.nbytes
    # room for an unrelated entry once `first`, the least recently used, is gone: evicting it frees only its tokens
    # (its segment lives on in `longer`), which is just enough
    other = Checkpoint(tokens[:64] + 1000, [(Segments((torch.zeros(64, 4),)), Segments((torch.zeros(64, 4),)))])
    cache.budget_bytes = cache.bytes - first.tokens.nbytes + other.nbytes
    assert cache.put(other, prefix_hashes(other.tokens)[0])
    assert cache.stats()["evictions"] == 1 and not cache.contains(tokens, hashes, 64)
    assert cache.contains(tokens, hashes, 128)
    assert cache.bytes == longer.tokens.nbytes + 2 * tensor_bytes + other.nbytes == cache.budget_bytes
    cache.clear()
    assert cache.bytes == 0


# ---- engine ----

def _engine(model, tok, checkpoints: bool = True, **options):
    cfg = {"runtime": {"graphs": "off"}}
    if checkpoints:
        cfg["checkpoints"] = {"enabled": True, **options}
    return flide.Engine(model, tok, cfg)


conversation = growing_conversation


@pytest.fixture(scope="module", params=["qwen3_5_text", "llama"])
def models(request):
    return request.param, tiny_model(request.param), tiny_tokenizer()


def test_growing_state_resumes_exactly(models):
    kind, model, tok = models
    fresh, engine = _engine(model, tok, False), _engine(model, tok)
    steps = conversation(7, 5)
    hits = 0
    for step, request in enumerate(steps):
        want = fresh.decide(request)
        prepared = engine.prepare(request)
        got = engine.run([prepared])[0]
        assert max_difference(want, got) <= ATOL, (kind, step)
        usage = engine.usage(prepared)
        stats = engine.checkpoints.stats()
        # a hit per state (a request may hold a second trunk: a question that tokenizes the state's end differently)
        assert (stats["hits"] > hits) == (step > 0)
        hits = stats["hits"]
        assert usage.input_tokens == usage.stream_tokens == usage.cached_tokens + usage.computed_tokens
        if step:
            assert usage.cached_tokens > 0
            # computed per state ~ the new turn (~140 words), the margin and the chunk rounding: not the history
            grown = prepared.trunks[0].size - engine.prepare(steps[step - 1]).trunks[0].size
            state_computed = usage.computed_tokens - sum(len(b.tokens) for b in prepared.branches)
            assert state_computed <= len(prepared.trunks) * (grown + 64 + 63)
    assert stats["stores"] >= len(steps)


def test_a_chain_of_checkpoints_stores_its_history_once():
    """An agent's checkpoints, step after step, share the keys of the history they extend: the cache holds each
    token's keys once (plus each entry's token ids), not once per step."""
    model, tok = tiny_model("llama"), tiny_tokenizer()  # attention layers only: every tensor is a key segment
    engine = _engine(model, tok)
    for request in conversation(5, 4):
        engine.decide(request)
    entries = list(engine.checkpoints._entries.values())
    assert len(entries) >= 3
    longest = max(entries, key=lambda e: e.length)
    assert all(len(k) == len(entries) for k, _ in longest.layers)  # one segment per step of the chain
    config = model.config
    key_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
    assert engine.checkpoints.bytes == sum(e.tokens.nbytes for e in entries) + longest.length * key_bytes
    assert engine.checkpoints.bytes < sum(e.nbytes for e in entries) / 2


def test_resumed_answers_equal_the_pipeline(models):
    from transformers import pipeline

    kind, model, tok = models
    engine = _engine(model, tok)
    decide = pipeline("decision", model=model, tokenizer=tok)
    steps = conversation(11, 3, questions=2)
    for request in steps:
        got = engine.decide(request)
    assert engine.checkpoints.stats()["hits"] == 2  # the last answer resumed
    want = decide(steps[-1])  # the pipeline: one sequence per question (the patched model falls back to HF's)
    assert max_difference(want, got) <= ATOL


def test_next_round_resumes_from_the_previous_rounds_save():
    """Rounds of one `run`: the second round looks its checkpoints up when it is built, after the first saved."""
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    engine = flide.Engine(model, tok, {"runtime": {"graphs": "off"}, "capacities": {"requests": 1},
                                       "checkpoints": {"enabled": True}})
    steps = conversation(3, 2)
    got = engine.decide(steps)
    fresh = _engine(model, tok, False).decide(steps)
    assert engine.checkpoints.stats()["hits"] == 1
    assert all(max_difference(a, b) <= ATOL for a, b in zip(fresh, got))


def test_hash_collision_never_resumes_other_tokens(monkeypatch):
    import flide.checkpoints.cache as cache_module

    monkeypatch.setattr(cache_module, "prefix_hashes", lambda tokens: [b"same"] * (len(tokens) // 64))
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    engine, fresh = _engine(model, tok), _engine(model, tok, False)
    a, b = conversation(1, 3), conversation(2, 3)
    for ra, rb in zip(a, b):
        for request in (ra, rb):
            assert max_difference(fresh.decide(request), engine.decide(request)) <= ATOL
    stats = engine.checkpoints.stats()
    assert stats["collisions"] > 0  # same hash, other tokens: looked at and refused
    assert stats["hits"] >= 1  # the matching conversation still resumes where its tokens agree


def test_tiny_budget_evicts_and_stays_exact():
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    engine, fresh = _engine(model, tok, cache_gb=3e-4), _engine(model, tok, False)  # ~315 kB: one or two checkpoints
    for request in conversation(5, 4) + conversation(6, 2):
        assert max_difference(fresh.decide(request), engine.decide(request)) <= ATOL
    stats = engine.checkpoints.stats()
    assert stats["evictions"] + stats["rejected"] > 0 and stats["bytes"] <= stats["budget_bytes"]


def test_short_states_are_not_saved():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = _engine(model, tok, min_state_tokens=100_000)
    engine.decide(conversation(4, 1)[0])
    assert engine.checkpoints.stats()["stores"] == 0


@pytest.mark.parametrize("key, value, message", [
    ("enabled", "yes", "checkpoints.enabled"), ("cache_gb", 0, "checkpoints.cache_gb"),
    ("cache_gb", "big", "checkpoints.cache_gb"), ("min_state_tokens", -1, "checkpoints.min_state_tokens"),
    ("margin_tokens", 1.5, "checkpoints.margin_tokens"), ("budget", 1, "checkpoints.budget"),
])
def test_bad_config_names_the_key(key, value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config({"checkpoints": {key: value}})


def test_checkpoints_off_by_default():
    assert load_config(None).checkpoints.enabled is False
    engine = flide.Engine(tiny_model("llama"), tiny_tokenizer(), {"runtime": {"graphs": "off"}})
    assert engine.checkpoints is None


# ---- SWE-agent trajectories (../shared/data) ----

def swe_steps(path: Path, steps: int, chars: int = 600) -> list[str]:
    """The history of a trajectory replayed step by step: the state after each assistant turn (messages cut to
    `chars` characters to keep the tiny model's reference ops quick)."""
    history = json.loads(path.read_text())["history"]
    states, text = [], ""
    for message in history:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
        text += f"{message.get('role')}: {str(content)[:chars]}\n\n"
        if message.get("role") == "assistant":
            states.append(text)
            if len(states) == steps:
                break
    return states


@pytest.mark.skipif(not SWE_DIR.is_dir(), reason="../shared/data/swe_agent_trajs is absent")
def test_swe_agent_trajectories_replayed():
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    engine, fresh = _engine(model, tok), _engine(model, tok, False)
    questions = {"done": {"type": "noul", "instructions": "Has the agent solved the task?"},
                 "next": {"type": "choice", "instructions": "What should the agent do next?",
                          "criteria": {"edit": "edit a file", "run": "run a command", "submit": None}},
                 "progress": {"type": "score", "instructions": "How far along is it?",
                              "criteria": ["lost", "started", "close", "done"]}}
    paths = sorted(SWE_DIR.glob("*.traj"))[:2]
    replayed = 0
    for path in paths:
        for state in swe_steps(path, 3):
            request = {"state": state, "questions": questions}
            assert max_difference(fresh.decide(request), engine.decide(request)) <= ATOL
            replayed += 1
    stats = engine.checkpoints.stats()
    assert replayed >= 4 and stats["hits"] >= replayed - 2 * len(paths)


def test_jev_template_trunks_per_type_resume_exactly():
    """Jev's template prints the question type before the state: a trunk per type, each saved and resumed."""
    from transformers.decision import DecisionConfig
    from transformers.models.jev.configuration_jev import JEV_TEMPLATE

    from flide.models.tiny import tiny_jev

    dc = DecisionConfig(chat_template=JEV_TEMPLATE, noul_options=["false", "true"],
                        temperature={"noul": 0.7, "choice": 1.3, "score": 2.0})
    model, tok = tiny_jev(), tiny_tokenizer()
    cfg = {"runtime": {"graphs": "off"}}
    engine = flide.Engine(model, tok, {**cfg, "checkpoints": {"enabled": True}}, decision_config=dc)
    fresh = flide.Engine(model, tok, cfg, decision_config=dc)
    for request in conversation(9, 3):
        assert max_difference(fresh.decide(request), engine.decide(request)) <= ATOL
    assert engine.checkpoints.stats()["hits"] >= 2


def test_serve_exports_checkpoint_metrics():
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from flide.serve import create_app

    engine = _engine(tiny_model("qwen3_5_text"), tiny_tokenizer())
    with TestClient(create_app(engine, "tiny")) as client:
        for request in conversation(8, 2, questions=1):
            assert client.post("/v1/systemone", json=request).status_code == 200
        text = client.get("/metrics").text
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert values["flide_checkpoint_hits_total"] == 1 and values["flide_checkpoint_stores_total"] >= 2
    assert values["flide_checkpoint_bytes"] > 0


def test_cli_serve_has_the_checkpoint_flag(capsys):
    from flide.cli import main

    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0 and "--checkpoint-cache-gb" in capsys.readouterr().out


# ---- companions built on the plain variants (flide/ops/resume.py: what flex, Triton and fla resume with) ----

def _resumed_attention(companion, seed: int, n: int, questions: list[int], dim: int, scale: float,
                       dtype: torch.dtype = torch.long):
    """(companion's output, the reference companion's) for a state of n tokens resumed at m = 128, its questions
    (stream tables of `dtype`: a round's are int32)."""
    g = torch.Generator().manual_seed(seed)
    m = 128
    full, cut = _fork_stream(g, m, n, questions)
    cut = tuple(x.to(dtype) for x in cut)
    T = len(full[0])
    q, k, v = (torch.randn(T, h, dim, generator=g) for h in (4, 2, 2))
    pre = (torch.zeros(T - m, dtype=torch.long), torch.full((T - m,), m, dtype=torch.long))
    args = (q[m:], k[m:], v[m:], *cut, k[:m], v[:m], *pre, scale)
    return companion(*args), fork_attention_prefix_reference(*args)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_extended_stream_companions_equal_the_reference_ones(dtype):
    from flide.ops.resume import attention_with_prefix, conv_with_window, gated_delta_with_snapshot

    got, want = _resumed_attention(attention_with_prefix(fork_attention_reference), 5, 130, [5, 1, 3], 8, 0.3,
                                   dtype)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    g = torch.Generator().manual_seed(5)
    m, n, questions, W = 128, 130, [5, 1, 3], 4
    full, cut = _fork_stream(g, m, n, questions)
    cut = tuple(x.to(dtype) for x in cut)
    T, Tc = len(full[0]), len(full[0]) - m
    x, weight = torch.randn(T, 6, generator=g), torch.randn(6, W, generator=g)
    window, win_index = x[m - (W - 1): m][None], torch.zeros(Tc, dtype=torch.long)
    want = fork_conv_window_reference(x[m:], weight, *cut, window, win_index, True)
    got = conv_with_window(fork_conv_reference)(x[m:], weight, *cut, window, win_index, True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    Hv, K = 4, 8
    qg, kg = torch.randn(300, 2, K, generator=g), torch.randn(300, 2, K, generator=g)
    vg, decay, beta = torch.randn(300, Hv, 8, generator=g), -torch.rand(300, Hv, generator=g), torch.rand(300, Hv)
    init = torch.randn(1, Hv, K, 8, generator=g)
    for chunks, index in [(seg(2, -1, 0), seg(-1, 0, -1)), (seg(4, 1, -1), seg(0, -1, -1))]:
        args = (qg, kg, vg, decay, beta, seg(0, 200, 260), seg(200, 60, 40), init, index, chunks, 0.25, True)
        want = gated_delta_snapshot_reference(*args)
        got = gated_delta_with_snapshot(gated_delta_reference)(*args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_flex_attention_resumes_through_its_extended_stream():
    """The flex variant's resume companion (flex's own function, compiled by Inductor's CPU flex template: ~30 s)."""
    from flide.ops.fork_attention import flex
    from flide.ops.resume import attention_with_prefix

    got, want = _resumed_attention(attention_with_prefix(flex.fork_attention), 6, 150, [7, 2, 40], 16, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_engine_resumes_exactly_through_the_extended_stream_companions(monkeypatch):
    """The engine with the plain-variant companions (as flex/Triton/fla get them) around the reference ops: several
    growing conversations interleaved in shared rounds, some states resumed and some not, equal a fresh engine."""
    from flide.ops import registry
    from flide.ops.resume import attention_with_prefix, conv_with_window, gated_delta_with_snapshot

    monkeypatch.setitem(registry._RESUMABLE, ("fork_attention", "reference"),
                        attention_with_prefix(fork_attention_reference))
    monkeypatch.setitem(registry._RESUMABLE, ("fork_conv", "reference"), conv_with_window(fork_conv_reference))
    monkeypatch.setitem(registry._RESUMABLE, ("gated_delta", "reference"),
                        gated_delta_with_snapshot(gated_delta_reference))
    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    fresh, engine = _engine(model, tok, False), _engine(model, tok, min_state_tokens=64)
    talks = [conversation(seed, 4, words=90) for seed in (21, 22, 23)]
    for step in range(4):
        requests = [talk[step] for talk in talks] + [conversation(99 + step, 1, words=30)[0]]
        prepared = [engine.prepare(r) for r in requests]
        got = engine.run(prepared)
        for request, answer in zip(requests, got):
            assert max_difference(fresh.decide(request), answer) <= ATOL, step
        if step:
            assert sum(engine.usage(p).cached_tokens > 0 for p in prepared) >= 3
    assert engine.checkpoints.stats()["hits"] >= 9


def test_companions_derive_their_round_tables_once(monkeypatch):
    """The layers of one forward pass the same table tensors: inside `per_round_tables` (one forward) a companion
    derives the extended stream once (its host syncs and small ops), again once a table is written in place, and
    outside it on every call."""
    from flide.ops import resume

    calls = []
    extend = resume._extend
    monkeypatch.setattr(resume, "_extend", lambda *a: calls.append(1) or extend(*a))
    g = torch.Generator().manual_seed(7)
    m, n, questions = 128, 130, [5, 1, 3]
    full, cut = _fork_stream(g, m, n, questions)
    T = len(full[0])
    pre = (torch.zeros(T - m, dtype=torch.long), torch.full((T - m,), m, dtype=torch.long))
    companion = resume.attention_with_prefix(fork_attention_reference)
    outputs = []
    with resume.per_round_tables():
        for layer in range(3):  # three layers: their own q/k/v and prefix rows, the round's tables
            q, k, v = (torch.randn(T, h, 8, generator=g) for h in (4, 2, 2))
            args = (q[m:], k[m:], v[m:], *cut, k[:m], v[:m], *pre, 0.3)
            outputs.append((companion(*args), fork_attention_prefix_reference(*args)))
        assert len(calls) == 1
        pre[1].add_(0)  # an in-place write: the tables may have changed
        companion(*args)
        assert len(calls) == 2
    for got, want in outputs:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    companion(*args)
    companion(*args)
    assert len(calls) == 4


def test_fla_call_tables_once_per_round(monkeypatch):
    """fla's gated delta derives its call tables (cu_seqlens, chunk list, chunk offsets) from the segment tensors:
    inside `per_round_tables` once per (segments, length), for each of a layer's two calls, as every call derived
    them before; `run` gets exactly those (the kernels need CUDA: checked here through `run`'s arguments)."""
    from flide.ops import resume
    from flide.ops.gated_delta import fla

    seen = []
    monkeypatch.setattr(fla, "run", lambda *args: seen.append(args) or (args[0], None))
    T, Hv, K = 256, 2, 8
    q, k, v = torch.randn(T, 1, K), torch.randn(T, 1, K), torch.randn(T, Hv, K)
    g, beta = -torch.rand(T, Hv), torch.rand(T, Hv)
    none = torch.zeros(0, Hv, K, K)
    calls = [(seg(0, 100, 230), seg(100, 130, 20)), (seg(0, 70), seg(70, 90))]

    def layer():
        for start, length in calls:
            fla.gated_delta(q, k, v, g, beta, start, length, none, torch.full_like(start, -1), 0.3, True)

    with resume.per_round_tables():
        for _ in range(3):
            layer()
    layer()  # outside: derived anew
    assert len(seen) == 8
    for n, args in enumerate(seen):
        start, length = calls[n % 2]
        cu_seqlens, chunk_indices, offsets = args[5], args[6], args[10]
        want = fla.bounds(start, length)
        assert torch.equal(cu_seqlens, want)
        assert torch.equal(chunk_indices, fla.chunk_table(want, T // 64 + start.shape[0] + 1))
        assert torch.equal(offsets, fla.chunk_offsets(want))
    assert seen[0][5] is seen[2][5] is seen[4][5] and seen[1][5] is seen[3][5] is seen[5][5]
    assert seen[6][5] is not seen[0][5]


def test_resumed_steps_share_rounds_their_whole_histories_would_not_fit():
    """Planning counts what a request will compute: agents' steps whose histories are over the largest bucket (each
    alone in a round of its own when counted whole) share rounds once they resume, and stay exact."""
    from flide.round import footprint

    model, tok = tiny_model("qwen3_5_text"), tiny_tokenizer()
    engine = flide.Engine(model, tok, {"runtime": {"graphs": "off"}, "capacities": {"buckets": [256, 512, 1024]},
                                       "checkpoints": {"enabled": True, "min_state_tokens": 64}})
    fresh = _engine(model, tok, False)
    talks = [conversation(seed, 6, words=60) for seed in (1, 2, 3, 4)]
    forwards = []
    forward = engine.forward
    engine.forward = lambda *args, **kwargs: forwards.append(1) or forward(*args, **kwargs)
    for step in range(6):
        prepared = [engine.prepare(talk[step]) for talk in talks]
        before = len(forwards)
        got = engine.run(prepared)
    assert all(footprint(p).tokens > 1024 for p in prepared)  # whole: each larger than every bucket
    assert all(engine.footprint(p).tokens < footprint(p).tokens for p in prepared)
    assert len(forwards) - before < len(prepared)  # resumed: some share a round
    for talk, answer in zip(talks, got):
        assert max_difference(fresh.decide(talk[-1]), answer) <= ATOL
