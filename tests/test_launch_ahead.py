"""`serve.launch_ahead`: the scheduler takes and launches the next round about a launch's host time before the device
finishes the running one, so the device does not idle while a replay is enqueued. The device is simulated here (a
launch costs host time, a round costs device time, rounds queue on the device in order) so that the idle gaps can be
measured on the CPU; the requests and their rounds are the tiny model's own."""

from __future__ import annotations

import dataclasses
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import flide
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.serve.scheduler import Scheduler
from flide.testing import random_request

LAUNCH_S = 0.008  # host side of a launch (the H200: ~1-2.5 ms for the compiled call of a 0.8B bucket)
DEVICE_S = 0.030  # one round on the device


class SimulatedPending:
    """A launched round on the simulated device: done at `end` (perf_counter)."""

    def __init__(self, end: float, answers: list[dict], bucket: int):
        self.end, self.answers, self.bucket_tokens = end, answers, bucket

    def device_done(self) -> bool:
        return time.perf_counter() >= self.end

    def wait(self) -> None:
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def result(self) -> list[dict]:
        self.wait()
        return self.answers


class SimulatedEngine:
    """The tiny engine for preparing and planning; `start` runs on a simulated device and logs (launched, began,
    ended) of every round."""

    def __init__(self, engine):
        self._engine = engine
        self.busy_until = 0.0
        self.log: list[tuple[float, float, float]] = []
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def start(self, prepared):
        time.sleep(LAUNCH_S)  # the host side of the launch: a device with nothing queued idles meanwhile
        with self.lock:
            launched = time.perf_counter()
            began = max(launched, self.busy_until)
            self.busy_until = began + DEVICE_S
            self.log.append((launched, began, self.busy_until))
        answers = [{q.name: {"n": float(len(prepared))} for q in p.questions} for p in prepared]
        return SimulatedPending(self.busy_until, answers, bucket=512)


@pytest.fixture(scope="module")
def tiny_engine():
    tok, model = tiny_tokenizer(), tiny_model("qwen3_5_text")
    return flide.patch(model, tok, config={"capacities": {"requests": 4}})


def idle_gaps(launch_ahead: bool, engine) -> tuple[list[float], int]:
    """Device idle time between consecutive rounds (ms) under 12 closed-loop submitters, and the answers seen."""
    simulated = SimulatedEngine(engine)
    settings = dataclasses.replace(engine.config.serve, overlap_rounds=True, launch_ahead=launch_ahead,
                                   prepare_threads=1)
    scheduler = Scheduler(simulated, settings)
    rng = random.Random(5)
    prepared = [engine.prepare(random_request(rng, max_questions=3, max_words=20)) for _ in range(12)]
    scheduler.start()
    answered = 0
    try:
        def client(i: int) -> int:
            n = 0
            end = time.perf_counter() + 1.2
            while time.perf_counter() < end:
                ticket = scheduler.admit(f"c{i}")
                answers = scheduler.submit(ticket, prepared[i]).result(timeout=30)
                assert list(answers) == [q.name for q in prepared[i].questions]
                n += 1
            return n

        with ThreadPoolExecutor(12) as pool:
            answered = sum(pool.map(client, range(12)))
    finally:
        scheduler.stop()
    log = simulated.log
    gaps = [(log[k][1] - log[k - 1][2]) * 1e3 for k in range(6, len(log))]  # after the first rounds: timing learnt
    return gaps, answered


def test_launch_ahead_keeps_the_device_busy(tiny_engine):
    plain, answered_plain = idle_gaps(False, tiny_engine)
    ahead, answered_ahead = idle_gaps(True, tiny_engine)
    assert len(plain) >= 10 and len(ahead) >= 10, (plain, ahead)
    # without: the device idles for each launch's host time; with: the next replay is queued before it runs dry
    assert statistics.median(plain) > 0.7 * LAUNCH_S * 1e3, plain
    assert statistics.median(ahead) < 0.25 * LAUNCH_S * 1e3, ahead
    assert answered_ahead > answered_plain  # the same device time serves more requests
