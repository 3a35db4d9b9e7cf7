"""Flat graphs on the GPU: one captured CUDA graph per bucket, replayed for rounds of any composition with no
recompile and no re-recording, answers equal to eager rounds and to transformers' pipeline; a request larger than
every bucket runs eagerly with the same answers."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import pipeline

import flide
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.testing import max_difference, random_request

BUCKETS = [256, 512, 1024, 2048, 4096]
GRAPHS = {"runtime": {"device": "cuda", "graphs": "on"}, "capacities": {"buckets": BUCKETS, "requests": 16}}
EAGER = {"runtime": {"device": "cuda", "graphs": "off"}}


@pytest.fixture(scope="module", params=["check", "skip_modules", "none"])
def setup(request):
    """The captured engine, with dynamo's guards as default (check), without guards on the model's modules
    (`runtime.guards: skip_modules`, its own compile), and with no compiled call after the capture (`none`: each
    round launches its bucket's recorded graph): every test holds for all three."""
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    # copies for the other engines, made before patching: patching swaps the mixers of a model in place (and a
    # compiled model cannot be deep-copied), and the captured engine must keep its own
    spare = [copy.deepcopy(model) for _ in range(3)]
    rng = random.Random(11)
    requests = [random_request(rng, max_questions=12, max_words=60) for _ in range(40)]
    engine = flide.patch(model, tok, config={**GRAPHS, "runtime": {**GRAPHS["runtime"], "guards": request.param}})
    return spare, tok, requests, engine


def recordings(monkeypatch) -> list:
    """Counts the CUDA graphs cudagraph trees record from now on."""
    from torch._inductor import cudagraph_trees

    recorded = []
    original = cudagraph_trees.CUDAGraphTreeManager.record_function

    def record(self, *args, **kwargs):
        recorded.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", record)
    return recorded


def test_graphs_equal_eager_and_pipeline(setup):
    spare, tok, requests, engine = setup
    assert engine.runner is not None and sorted(engine.runner.buckets) == BUCKETS
    graphs = engine.decide(requests)
    eager = flide.patch(spare[0], tok, config=EAGER)
    answers = eager.decide(requests)
    # the pipeline on the patched copy runs transformers' own modules (the swapped mixers fall back to them)
    expected = [pipeline("decision", model=spare[0], tokenizer=tok)(r) for r in requests[:12]]
    assert max(max_difference(a, b) for a, b in zip(graphs, answers)) < 1e-4
    # fla's and flex's Triton dots run in tf32 on fp32 inputs: a few 1e-4 on a tiny random model
    assert max(max_difference(a, b) for a, b in zip(expected, graphs)) < 2e-3


def test_thousand_random_rounds_replay_without_recompiles(setup, monkeypatch):
    from torch._dynamo.utils import counters

    _, _, requests, engine = setup
    prepared = [engine.prepare(r) for r in requests]
    alone = [engine.run([p])[0] for p in prepared]  # every bucket a single request reaches is warm now
    recorded = recordings(monkeypatch)
    graphs_before = counters["stats"]["unique_graphs"]
    skips_before = counters["inductor"]["cudagraph_skips"]
    rng = random.Random(5)
    used = set()
    worst = 0.0
    for _ in range(1000):
        picks = rng.sample(range(len(prepared)), rng.randint(1, 12))
        answers = engine.run([prepared[i] for i in picks])
        for i, answer in zip(picks, answers):
            worst = max(worst, max_difference(alone[i], answer))
    for bucket in engine.runner.buckets.values():
        if bucket.replays > 4:  # capture runs 3; every bucket some round took replayed
            used.add(bucket.shape.tokens)
    assert counters["stats"]["unique_graphs"] == graphs_before, "a round recompiled"
    assert counters["inductor"]["cudagraph_skips"] == skips_before, "cudagraphs were skipped"
    assert not recorded, f"{len(recorded)} CUDA graphs were recorded after capture"
    assert len(used) >= 2, f"the random rounds used only buckets {used}"
    # the same request in another round, at another offset, in another bucket: equal within tf32 rounding
    assert worst < 1e-4


def test_guards_none_launches_the_recorded_graphs_with_the_same_bits(setup):
    """`runtime.guards: none` keeps every bucket's recorded CUDA graph and launches it without the compiled call
    (the other modes keep none): rounds with the compiled forward made unusable give the answers of the same rounds
    through the compiled call (cudagraph trees' own replays), bit for bit."""
    _, _, requests, engine = setup
    runner = engine.runner
    direct = engine.config.runtime.guards == "none"
    assert all((b.graph is not None) == direct for b in runner.buckets.values())
    if not direct:
        return
    prepared = [engine.prepare(r) for r in requests[:24]]
    rounds = [prepared[i:i + n] for i, n in ((0, 1), (1, 3), (4, 8), (12, 12))]
    graphs = {tokens: b.graph for tokens, b in runner.buckets.items()}
    compiled = runner._forward
    try:
        for b in runner.buckets.values():  # the compiled call, as in the other modes
            b.graph = None
        through_trees = [engine.run(r) for r in rounds]
    finally:
        for tokens, b in runner.buckets.items():
            b.graph = graphs[tokens]

    def unusable(*args):
        raise AssertionError("the compiled forward ran after the capture with runtime.guards: none")

    runner._forward = unusable
    try:
        launched = [engine.run(r) for r in rounds]
    finally:
        runner._forward = compiled
    for a, b in zip(through_trees, launched):
        assert max(max_difference(x, y) for x, y in zip(a, b)) == 0.0


def test_rounds_from_many_threads_answer_as_alone(setup, monkeypatch):
    """In-process `run` from 8 threads at once, more rounds of one bucket in flight than its two turns (launches
    return before the device is done): a launch waits for a turn instead of raising, and every answer equals its
    request's alone. With `runtime.guards: none` the calling threads enqueue their rounds themselves: no launch is
    handed to the graph thread."""
    from concurrent.futures import ThreadPoolExecutor

    _, _, requests, engine = setup
    runner = engine.runner
    prepared = [engine.prepare(r) for r in requests]
    alone = [engine.run([p])[0] for p in prepared]
    handed = []
    call = runner._thread.call
    monkeypatch.setattr(runner._thread, "call", lambda fn, *args: handed.append(fn) or call(fn, *args))

    def worker(seed: int) -> float:
        rng = random.Random(seed)
        worst = 0.0
        for _ in range(25):
            picks = rng.sample(range(len(prepared)), rng.randint(1, 4))  # small rounds: mostly one bucket
            got = engine.run([prepared[i] for i in picks])
            worst = max([worst] + [max_difference(alone[i], answer) for i, answer in zip(picks, got)])
        return worst

    with ThreadPoolExecutor(8) as pool:
        worst = max(pool.map(worker, range(8)))
    assert worst < 1e-4
    assert all(b.busy == [False, False] for b in runner.buckets.values())
    assert (not handed) == (engine.config.runtime.guards == "none")


def test_overlapped_rounds_equal_rounds_alone(setup):
    """`Engine.start` enqueues a replay and returns; the serve scheduler's overlap starts the next round before it
    reads the last one (the next round's build and copy then race the device unless each bucket alternates its
    buffers). 200 pairs of rounds in flight at once, same or other buckets: every answer as when its round ran alone.
    """
    _, _, requests, engine = setup
    prepared = [engine.prepare(r) for r in requests]
    alone = [engine.run([p])[0] for p in prepared]
    rng = random.Random(8)
    worst = 0.0
    previous = None
    for _ in range(200):
        picks = rng.sample(range(len(prepared)), rng.randint(1, 12))
        started = (picks, engine.start([prepared[i] for i in picks]))
        if previous is not None:
            for i, answer in zip(previous[0], previous[1].result()):
                worst = max(worst, max_difference(alone[i], answer))
        previous = started
    for i, answer in zip(previous[0], previous[1].result()):
        worst = max(worst, max_difference(alone[i], answer))
    assert all(b.busy == [False, False] for b in engine.runner.buckets.values())
    assert worst < 1e-4


def test_oversized_request_runs_eagerly_with_the_same_answers(setup):
    spare, tok, _, engine = setup
    rng = random.Random(2)
    big = random_request(rng, max_words=300)
    small_buckets = flide.patch(spare[1], tok, config={**GRAPHS, "capacities": {"buckets": [256], "requests": 16}})
    prepared = small_buckets.prepare(big)
    assert prepared.stream_tokens > 256
    oversized = small_buckets.decide(big)
    in_graph = engine.decide(big)
    assert max_difference(oversized, in_graph) < 1e-4


def test_cudagraphs_compiler_equals_eager(setup):
    spare, tok, requests, engine = setup
    config = {**GRAPHS, "runtime": {**GRAPHS["runtime"], "compiler": "cudagraphs"}}
    fast_start = flide.patch(spare[2], tok, config=config)
    assert fast_start.runner is not None
    answers = fast_start.decide(requests[:16])
    expected = engine.decide(requests[:16])
    assert max(max_difference(a, b) for a, b in zip(answers, expected)) < 1e-4


def test_combo_kernels_equal_the_default_and_replay_without_recompiles(monkeypatch):
    """`runtime.combo_kernels: true` (Inductor launches independent kernels as one): the same answers as the default
    graphs (fp32: within 1e-5; the per-element code is Inductor's own either way) and, after the capture, rounds of
    any composition replay without a recompile or a new recording."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text").cuda()
    spare = copy.deepcopy(model)
    rng = random.Random(12)
    requests = [random_request(rng, max_questions=12, max_words=60) for _ in range(24)]
    default = flide.patch(model, tok, config=GRAPHS)
    combo = flide.patch(spare, tok, config={**GRAPHS, "runtime": {**GRAPHS["runtime"], "combo_kernels": True}})
    assert combo.runner is not None and combo.runner.combo_kernels
    counters.clear()
    recorded = recordings(monkeypatch)
    got = combo.decide(requests)
    for _ in range(20):
        combo.decide(rng.sample(requests, rng.randint(1, 12)))
    assert max(max_difference(a, b) for a, b in zip(got, default.decide(requests))) < 1e-5
    assert recorded == [] and counters["stats"].get("unique_graphs", 0) == 0, dict(counters["stats"])
