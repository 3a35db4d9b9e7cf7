"""`Engine.submit`: requests submitted from many threads are packed into shared rounds by the engine's scheduler and
answered exactly as `decide` answers them alone; a bad request raises at submit and leaves the queue usable."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

import flide
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.requests import RequestError
from flide.testing import max_difference, random_request


def test_concurrent_submissions_share_rounds_and_equal_decide():
    tok = tiny_tokenizer()
    engine = flide.patch(tiny_model("qwen3_5_text"), tok, config={"capacities": {"requests": 8}})
    rng = random.Random(7)
    requests = [random_request(rng, max_questions=4, max_words=40) for _ in range(24)]
    alone = [engine.decide(r) for r in requests]
    sizes = []
    start = engine.start  # the scheduler's rounds

    def counting_start(prepared):
        sizes.append(len(prepared))
        return start(prepared)

    engine.start = counting_start
    prompts = [engine.prompts.copy_for_thread() for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        futures = list(pool.map(lambda i: engine.submit(requests[i], prompts[i % 8]), range(len(requests))))
        answers = [f.result(timeout=120) for f in futures]
    assert max(max_difference(a, b) for a, b in zip(alone, answers)) < 1e-6
    assert sum(sizes) == len(requests) and max(sizes) > 1, f"rounds of {sizes}: nothing was packed"
    with pytest.raises(RequestError) as error:
        engine.submit({"state": "x", "questions": {}})
    assert error.value.field == "questions"
    assert max_difference(engine.submit(requests[0]).result(timeout=60), alone[0]) < 1e-6
    engine.scheduler().stop()


def test_serving_freezes_the_start_up_heap_out_of_the_garbage_collector():
    """`serve.freeze_gc` (default on): starting the scheduler collects and freezes the heap built so far, so full
    collections while serving skip it (a full collection over a tiny engine's ~400k objects took ~370 ms on the CI
    CPU); off, the collector is left alone."""
    import gc

    tok = tiny_tokenizer()
    request = {"state": "A calm note.", "questions": {"u": {"type": "noul", "instructions": "Urgent?"}}}
    gc.unfreeze()
    try:
        off = flide.patch(tiny_model("qwen3_5_text"), tok, config={"serve": {"freeze_gc": False}})
        off.submit(request).result(timeout=60)
        assert gc.get_freeze_count() == 0
        off.scheduler().stop()
        on = flide.patch(tiny_model("qwen3_5_text"), tok)
        assert on.config.serve.freeze_gc
        on.submit(request).result(timeout=60)
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the model, tokenizer and modules built before serving
        on.scheduler().stop()
    finally:
        gc.unfreeze()  # the rest of the suite with its collector as it was


def test_fill_buckets_takes_the_prefix_that_fills_its_bucket_best():
    """`serve.fill_buckets`: of three 200-token requests waiting, the round takes the two that fill the 512-token
    bucket (400 / (512 + 128)) rather than all three in the 1,024 one (600 / (1,024 + 128)); the third stays first
    in line. With a round's overhead priced at 1,024 tokens (or fill_buckets off) all three go together."""
    import dataclasses

    from flide.graphs.buckets import fill_prefix
    from flide.round import Footprint
    from flide.serve.scheduler import Scheduler, Ticket

    engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer(),
                         config={"capacities": {"buckets": [256, 512, 1024], "requests": 8}})
    need = Footprint(tokens=200, states=1, branches=2, readout_rows=2, requests=1)
    caps = engine.config.capacities
    assert fill_prefix([need] * 3, caps, engine.max_options, 128) == 2
    assert fill_prefix([need] * 3, caps, engine.max_options, 1024) == 3
    assert fill_prefix([need], caps, engine.max_options, 128) == 1
    for fill, overhead, taken in [(True, 128, 2), (True, 1024, 3), (False, 128, 3)]:
        settings = dataclasses.replace(engine.config.serve, fill_buckets=fill, round_overhead_tokens=overhead)
        scheduler = Scheduler(engine, settings)  # not started: _take is called here, as the model thread would
        tickets = [Ticket(f"r{i}", counted=False, need=need) for i in range(3)]
        with scheduler._cond:
            scheduler._ready.extend(tickets)
            batch = scheduler._take()
            assert batch == tickets[:taken], (fill, overhead)
            assert list(scheduler._ready) == tickets[taken:]


def test_fill_prefix_on_the_default_buckets():
    """RACE-sized requests (520 stream tokens) on the default buckets: 16 would take the 10,240 bucket, 15 fit the
    8,192 one; 2 take both of a light load's requests; an oversized single request is taken whole."""
    from flide.config import CapacityConfig
    from flide.graphs.buckets import fill_prefix
    from flide.round import Footprint

    caps = CapacityConfig()
    race = Footprint(tokens=520, states=1, branches=4, readout_rows=4, requests=1)
    assert fill_prefix([race] * 16, caps, 8, 1024) == 15
    assert fill_prefix([race] * 2, caps, 8, 1024) == 2
    huge = Footprint(tokens=caps.buckets[-1] + 1, states=1, branches=1, readout_rows=1, requests=1)
    assert fill_prefix([huge], caps, 8, 1024) == 1


def test_rounds_run_on_the_graph_thread_and_give_it_back_to_other_work():
    """The scheduler's rounds run on the process's graph thread (a launch is then a direct call, no hand-off), and
    between rounds the loop gives the thread back when another thread posted work there: that work is done while
    the submitters still keep the scheduler busy, not after they stop."""
    import threading
    import time

    from flide.graphs.thread import graph_thread

    tok = tiny_tokenizer()
    engine = flide.patch(tiny_model("qwen3_5_text"), tok, config={"capacities": {"requests": 2}})
    rng = random.Random(3)
    requests = [random_request(rng, max_questions=3, max_words=30) for _ in range(8)]
    alone = [engine.decide(r) for r in requests]
    graphs, started_on = graph_thread(), set()
    start = engine.start

    def recording_start(prepared):
        started_on.add(threading.get_ident())
        time.sleep(0.01)  # a round keeps the loop busy a while (the device's time on a GPU)
        return start(prepared)

    engine.start = recording_start
    stop_at = time.monotonic() + 3.0
    prompts = [engine.prompts.copy_for_thread() for _ in range(4)]

    def submitter(i: int) -> float:
        worst = 0.0
        while time.monotonic() < stop_at:
            k = (i + int(time.monotonic() * 1000)) % len(requests)
            worst = max(worst, max_difference(engine.submit(requests[k], prompts[i]).result(timeout=60), alone[k]))
        return worst

    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(submitter, i) for i in range(4)]
        time.sleep(0.5)
        done_at = []
        for _ in range(3):  # e.g. an in-process decide beside a running server
            assert graphs.call(threading.get_ident) == graphs._thread.ident
            done_at.append(time.monotonic())
        worst = max(f.result() for f in busy)
    assert worst < 1e-6
    assert started_on == {graphs._thread.ident}, "rounds ran off the graph thread"
    assert max(done_at) < stop_at, "work posted to the graph thread waited until the submitters stopped"
    engine.scheduler().stop()
    assert not engine.scheduler().alive
