"""The flat-graph runner's bucketed path on the CPU (no CUDA graphs here: the same buckets, static buffers and
packed metadata, run eagerly): answers equal the exact-size eager rounds, whatever bucket and mix a request lands
in, and rounds reuse their bucket's buffers without leaking an earlier round's metadata."""

from __future__ import annotations

import random

import pytest

import flide
from flide.config import load_config
from flide.graphs.buckets import bucket_shape, plan_rounds
from flide.graphs.runner import GraphRunner
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.round import footprint
from flide.testing import max_difference, random_request

BUCKETS = [256, 512, 1024, 2048]


@pytest.fixture(scope="module")
def engines():
    tok = tiny_tokenizer()
    model = tiny_model("qwen3_5_text")
    exact = flide.patch(model, tok)
    bucketed = flide.patch(model, tok, config={"capacities": {"buckets": BUCKETS, "requests": 8}})
    runner = GraphRunner(bucketed.flat, bucketed.config.capacities, bucketed.max_options, bucketed.device,
                         bucketed.pad_id, compile=False, progress=False)
    runner.capture()
    bucketed.runner = runner
    rng = random.Random(4)
    requests = [random_request(rng, max_questions=8, max_words=60) for _ in range(16)]
    yield exact, bucketed, requests
    runner.close()


def test_buckets_allocated_with_their_shapes(engines):
    _, bucketed, _ = engines
    caps = bucketed.config.capacities
    assert sorted(bucketed.runner.buckets) == BUCKETS
    for tokens, bucket in bucketed.runner.buckets.items():
        assert bucket.shape == bucket_shape(tokens, caps, bucketed.max_options)
        assert bucket.shape.states <= tokens and bucket.shape.branches <= tokens


def test_capture_takes_the_largest_bucket_first(engines, monkeypatch):
    # the graphs share one memory pool: recorded largest first, the smaller ones reuse its segments (on the H200,
    # 0.8B, 16 buckets: 3.29 GiB reserved after start where smallest first held 4.89); the buckets stay listed
    # smallest first
    _, bucketed, _ = engines
    order = []
    allocate = GraphRunner._allocate

    def recording(self, shape):
        order.append(shape.tokens)
        return allocate(self, shape)

    monkeypatch.setattr(GraphRunner, "_allocate", recording)
    runner = GraphRunner(bucketed.flat, bucketed.config.capacities, bucketed.max_options, bucketed.device,
                         bucketed.pad_id, compile=False, progress=False)
    runner.capture()
    try:
        assert order == sorted(BUCKETS, reverse=True)
        assert list(runner.buckets) == BUCKETS
    finally:
        runner.close()


def test_bucketed_rounds_equal_exact_rounds(engines):
    exact, bucketed, requests = engines
    expected = exact.decide(requests)
    rng = random.Random(9)
    prepared = [bucketed.prepare(r) for r in requests]
    for _ in range(6):  # random mixes: each request at other offsets, in other buckets, in reused buffers
        picks = rng.sample(range(len(requests)), rng.randint(1, 8))
        for i, answer in zip(picks, bucketed.run([prepared[i] for i in picks])):
            assert max_difference(expected[i], answer) < 1e-6


def test_rounds_take_the_smallest_bucket_and_oversized_requests_run_alone():
    caps = load_config({"capacities": {"buckets": BUCKETS}}).capacities
    tok = tiny_tokenizer()
    engine = flide.patch(tiny_model("qwen3_5_text"), tok)
    small = engine.prepare({"state": "a short state", "questions": {"q": {"type": "noul", "instructions": "Is it short?"}}})
    planned = plan_rounds([footprint(small)], caps, engine.max_options)
    assert [p.shape.tokens for p in planned] == [256] and not planned[0].oversized
    big = engine.prepare({"state": "word " * 2500, "questions": {"q": {"type": "noul", "instructions": "Is it long?"}}})
    planned = plan_rounds([footprint(small), footprint(big), footprint(small)], caps, engine.max_options)
    assert [p.requests for p in planned] == [[0], [1], [2]]
    assert [p.oversized for p in planned] == [False, True, False]


def test_many_short_segments_take_a_larger_bucket_and_the_largest_keeps_the_configured_capacities():
    """Below the largest bucket the tables hold tokens/64 states, tokens/16 branches and tokens/16 readout rows (a
    state's fp32 recurrent state is written per state row, every branch row launches question-kernel programs); a
    round of many short questions takes the bucket whose tables hold it, and whatever fits the configured capacities
    fits the largest bucket."""
    from flide.graphs.buckets import shape_for
    from flide.round import Footprint

    caps = load_config({"capacities": {"buckets": BUCKETS, "states": 64, "branches": 600}}).capacities
    small = bucket_shape(256, caps, 2)
    assert (small.states, small.branches, small.readout_rows) == (4, 16, 16)
    largest = bucket_shape(2048, caps, 2)
    assert (largest.states, largest.branches, largest.readout_rows) == (64, 600, caps.readout_rows)
    # 100 one-token questions of 6 short states: 240 tokens, but the 256 bucket holds 16 branches and 4 states, the
    # 512 one 32: the largest holds them
    shape, oversized = shape_for(Footprint(240, 6, 100, 100, 6), caps, 2)
    assert not oversized and shape.tokens == 2048 and shape.branches >= 100 and shape.states >= 6
    shape, oversized = shape_for(Footprint(240, 6, 30, 30, 6), caps, 2)
    assert not oversized and shape.tokens == 512 and shape.branches >= 30
    shape, oversized = shape_for(Footprint(300, 64, 600, 600, 64), caps, 2)
    assert not oversized and shape.tokens == 2048


def test_graphs_on_without_cuda_is_a_clear_error():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="runtime.graphs: on"):
        flide.patch(tiny_model("qwen3_5_text"), tok, config={"runtime": {"graphs": "on"}})
    with pytest.raises(ValueError, match="runtime.compiler"):
        load_config({"runtime": {"compiler": "tvm"}})
    # auto on the CPU: eager rounds of their own size, no runner
    assert flide.patch(tiny_model("qwen3_5_text"), tok).runner is None


def test_started_rounds_answer_as_run_and_give_their_buffers_back(engines):
    """`Engine.start` launches a replay without waiting; a second round may start before the first is read (what
    the serve scheduler's overlap does), each bucket then uses its other host and score buffers, and a third round
    of a bucket with two unread ones is refused instead of overwriting their buffers."""
    exact, bucketed, requests = engines
    expected = exact.decide(requests[:2])
    first, second, third = ([bucketed.prepare(r) for r in requests[:2]] for _ in range(3))  # one bucket for all
    shape = plan_rounds([footprint(p) for p in first], bucketed.config.capacities, bucketed.max_options)[0].shape
    pending = [bucketed.start(first), bucketed.start(second)]
    assert all(p.launched is not None for p in pending), "graph rounds must be launched, not computed at start"
    bucket = bucketed.runner.buckets[shape.tokens]
    assert bucket.busy == [True, True]
    with pytest.raises(RuntimeError, match="in flight"):
        bucketed.runner.launch(third, shape)
    assert bucket.busy == [True, True]  # the refused launch took nothing
    for p in pending:
        assert [max_difference(a, b) < 1e-6 for a, b in zip(expected, p.result())] == [True, True]
    assert bucket.busy == [False, False]
    assert [max_difference(a, b) < 1e-6 for a, b in zip(expected, bucketed.start(third).result())] == [True, True]
    assert bucket.busy == [False, False]


def test_a_third_round_waits_for_another_threads_finish(engines):
    """Both turns of a bucket in flight: a launch from another thread (several threads calling `decide`) waits for
    a turn until a round is finished instead of being refused; one on the graph thread (may_wait False) is still
    refused, as is a thread that holds both turns itself. And end to end: 6 threads running rounds of one bucket at
    once each get their requests' own answers."""
    import threading
    import time

    _, bucketed, requests = engines
    runner = bucketed.runner
    rounds = [[bucketed.prepare(r) for r in requests[:2]] for _ in range(4)]
    shape = plan_rounds([footprint(p) for p in rounds[0]], bucketed.config.capacities, bucketed.max_options)[0].shape
    bucket = runner.buckets[shape.tokens]
    held = [bucketed.start(rounds[0]), bucketed.start(rounds[1])]
    me = threading.get_ident()
    assert bucket.owners == [me, me]
    with pytest.raises(RuntimeError, match="in flight"):  # it would wait for itself
        runner._take_turn(bucket, me, may_wait=True)
    with pytest.raises(RuntimeError, match="in flight"):  # the graph thread never waits
        runner._take_turn(bucket, -1, may_wait=False)
    got = []
    waiter = threading.Thread(target=lambda: got.append(runner._take_turn(bucket, -1, may_wait=True)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not got
    held[0].result()  # gives its turn back: the waiter takes it
    waiter.join(10)
    assert got and bucket.owners[got[0]] == -1 and bucket.busy == [True, True]
    runner._give_back(bucket, got[0])
    held[1].result()
    assert bucket.busy == [False, False] and bucket.owners == [None, None]

    from concurrent.futures import ThreadPoolExecutor

    expected = bucketed.decide(requests[:2])
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda r: bucketed.run(r), rounds * 3))
    assert all(max_difference(a, b) < 1e-6 for got in answers for a, b in zip(expected, got))
    assert bucket.busy == [False, False]


@pytest.mark.parametrize("launch_ahead", [False, True])
def test_scheduler_overlapping_rounds_answers_equal_decide(engines, launch_ahead):
    """`serve.overlap_rounds`: the model thread starts the next round before reading the last one's answers; under
    32 concurrent submitters every answer still equals the request's own (also with `serve.launch_ahead`, whose
    timing is learnt from these replays: tests/test_launch_ahead.py checks that timing on a simulated device)."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from flide.serve.scheduler import Scheduler

    exact, bucketed, requests = engines
    expected = exact.decide(requests)
    settings = dataclasses.replace(bucketed.config.serve, overlap_rounds=True, prepare_threads=2,
                                   launch_ahead=launch_ahead)
    scheduler = Scheduler(bucketed, settings)
    scheduler.start()
    started = []
    start = bucketed.start

    def counting_start(prepared):
        started.append(len(prepared))
        return start(prepared)

    bucketed.start = counting_start
    try:
        def one(i):
            ticket = scheduler.admit(f"r{i}")
            return scheduler.submit(ticket, bucketed.prepare(requests[i % len(requests)])).result(timeout=120)

        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(one, range(64)))
    finally:
        del bucketed.start
        scheduler.stop()
    for i, answer in enumerate(answers):
        assert max_difference(expected[i % len(requests)], answer) < 1e-6
    assert sum(started) == 64 and max(started) > 1, f"rounds of {started}: nothing was packed"
    assert all(b.busy == [False, False] for b in bucketed.runner.buckets.values())


@pytest.mark.parametrize("buckets,requests", [([256, 512, 1024, 2048], 8), ([256], 1), ([16384], 64)])
def test_tune_kernels_runs_a_typical_round_within_the_capacities(buckets, requests):
    """`Engine.tune_kernels` (run before a CUDA capture, so that autotuned kernels pick their configs on real work):
    one eager round that fits any capacities, from a single small bucket to the largest."""
    engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer(),
                         config={"capacities": {"buckets": buckets, "requests": requests}})
    seen = []
    forward = engine.forward
    engine.forward = lambda round_: seen.append(round_) or forward(round_)
    engine.tune_kernels()
    assert len(seen) == 1 and 0 < seen[0].used_tokens <= max(buckets)
    assert len(seen[0]._requests) <= requests
