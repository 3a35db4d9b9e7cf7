"""Continuous rounds: the model thread runs rounds back to back; requests that arrive while a round runs are packed
into the next one.

    admit (queue bound) -> prepare (thread pool: validate, render, tokenize) -> submit -> model thread: take the
    longest prefix of the waiting requests that fits one round (`plan_rounds`; with `serve.fill_buckets` the part of
    it that fills its bucket best, `fill_prefix`), `engine.start` it, answer each future

- The model thread is the process's graph thread (flide/graphs/thread.py), where every compiled call must run: the
  round loop is posted there when a request arrives and returns when no request waits and no round runs, so a
  launch is a direct call, not a hand-off to another thread and a wake-up back (~0.15 ms each on the H200's host).
  Between rounds the loop gives the thread back when other threads posted work there (an in-process `decide`).

- With `serve.overlap_rounds`, once the device has finished a round the model thread takes and launches the next one
  first and then reads the finished round's answers and sets its futures, so that host work runs under the next
  round's GPU work. The next round is taken only when the device is done (not at once), so it packs what arrived
  meanwhile, as without overlap.
- With `serve.launch_ahead` (on by default: +6 % requests/s at 32 HTTP clients on the H200) it takes the next round
  a launch's host time before the device is done (the time learnt per bucket from the rounds so far), so the device
  does not idle while the next replay is being enqueued; that replay then waits behind the running one.

- Only the model thread touches the model, so rounds never overlap and need no lock. Preparing runs in a pool whose
  threads each own a copy of the prompt tokenizer (`PromptTokenizer.copy_for_thread`): transformers' fast
  tokenizers flip a flag on the shared Rust object while encoding control tokens as text, so sharing one between
  threads can encode a request's text with another's setting.
- The queue bound counts requests admitted and not yet taken into a round (being prepared or waiting), so a burst is
  refused at the door (503 + Retry-After) instead of piling up behind the model.
- A request that timed out before its round is skipped (its future is cancelled); one that times out inside a round
  is computed anyway and its answer dropped.
- A round that raises is retried one request at a time, so only the request that fails alone is failed; an
  out-of-memory round answers its requests `Overloaded` (503) and the thread goes on with the next round.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..config import ServeConfig
from ..graphs.buckets import fill_prefix, plan_rounds
from ..graphs.thread import graph_thread
from ..requests import PreparedRequest
from ..round import Footprint
from .metrics import Metrics

logger = logging.getLogger("flide.serve")


# serve.launch_ahead: the next round's launch is meant to end this long before the device finishes the last one (a
# late estimate only leaves the device idle for the difference; an early one packs the next round a little sooner)
LAUNCH_MARGIN_S = 3e-4


def _average(old: float | None, new: float, weight: float = 0.2) -> float:
    """Exponential moving average (the first sample as is)."""
    return new if old is None else old + weight * (new - old)


class Overloaded(Exception):
    """The server cannot take or finish this request now (queue full, out of memory, shutting down): 503."""


# gc.freeze() is process-wide: frozen while any scheduler that froze runs, unfrozen when the last one stops and at
# exit (frozen objects are never collected, also not at shutdown, where extension objects still alive are then
# reported as leaks)
_FREEZE_LOCK = threading.Lock()
_FREEZERS = 0
atexit.register(gc.unfreeze)  # a no-op when nothing is frozen


def _freeze_heap() -> None:
    global _FREEZERS
    with _FREEZE_LOCK:
        gc.collect()  # garbage first: what is frozen is never collected
        gc.freeze()
        _FREEZERS += 1


def _thaw_heap() -> None:
    global _FREEZERS
    with _FREEZE_LOCK:
        _FREEZERS -= 1
        if _FREEZERS == 0:
            gc.unfreeze()


@dataclass(eq=False)
class Ticket:
    """One request on its way through the scheduler."""

    request_id: str
    counted: bool = True  # holds a place under `max_queue` until taken into a round (or given up)
    prepared: PreparedRequest | None = None
    need: Footprint | None = None
    ready_at: float = 0.0
    future: Future = field(default_factory=Future)  # -> the answers dict, in question order


@dataclass(eq=False)
class Started:
    """A round the model thread started (`Engine.start`) and has not answered yet."""

    batch: list[Ticket]
    pending: object  # flide.engine.PendingRound
    at: float  # perf_counter at its start
    launched_at: float = 0.0  # when `Engine.start` returned: the replay is enqueued
    bucket: int | None = None  # the bucket its replay runs in (None: an eager round, already run)
    # from when the device runs it: its launch, or the end of the round it was launched behind
    device_from: float | None = None
    device_done_at: float | None = None  # when the model thread saw the device finish it, if it was waiting then

    def wait(self) -> None:
        """Until the device is done with it (a launched graph replay), without reading its answers."""
        self.pending.wait()


class Scheduler:
    """Runs an `Engine`'s rounds on one model thread; see the module docstring."""

    def __init__(self, engine, settings: ServeConfig, metrics: Metrics | None = None):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._cond = threading.Condition()
        self._ready: deque[Ticket] = deque()
        self._waiting = 0
        self._stopping = False
        self._looping = False  # the round loop is posted to (or runs on) the graph thread
        self._started = False
        self._dead: BaseException | None = None  # what stopped the round loop for good (never an Exception)
        self._graphs = None  # the graph thread, where the round loop runs (start)
        self._local = threading.local()
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        self.pool: ThreadPoolExecutor | None = None
        self.workers = None  # a ProcessPreparer with serve.prepare_processes > 0
        self._froze = False  # whether start() froze the heap (serve.freeze_gc): stop() gives it back
        # serve.launch_ahead's timing, learnt from the rounds (model thread only): a replay's device seconds per
        # bucket, and the host seconds a launch takes (take, build, the compiled call), moving averages
        self._device_s: dict[int, float] = {}
        self._launch_s: float | None = None

    # ---- life ----
    def start(self) -> None:
        """Copies the prompt tokenizer for each prepare thread (here, once: a large vocabulary takes a while to
        copy), then starts the pool and the model thread; with `serve.freeze_gc` first collects and freezes the
        heap built so far (model, tokenizer, compiled graphs), which later full collections then skip."""
        if self.settings.freeze_gc and not self._froze:
            start = time.perf_counter()
            _freeze_heap()
            self._froze = True
            logger.info("scheduler: %d objects frozen out of the garbage collector's scans (%.0f ms)",
                        gc.get_freeze_count(), (time.perf_counter() - start) * 1e3)
        threads = self.settings.prepare_threads
        processes = self.settings.prepare_processes
        if processes:  # the threads only wait on the worker processes (one per process keeps them all busy) and
            from .workers import ProcessPreparer  # tokenize nothing themselves: no tokenizer copies

            self.workers = ProcessPreparer(self.engine, processes)
            threads = max(threads, processes)
        else:
            for _ in range(threads):
                self._copies.put(self.engine.prompts.copy_for_thread())
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="flide-prepare",
                                       initializer=None if processes else self._take_copy)
        self._stopping = False
        self._graphs = graph_thread()
        self._started = True
        logger.info("scheduler: rounds on the graph thread; %d prepare threads, %d prepare processes; queue bound %d; "
                    "timeout %.1f s", threads, processes, self.settings.max_queue, self.settings.request_timeout_s)

    def stop(self, timeout: float = 30.0) -> None:
        """Finishes the running round, answers what still waits `Overloaded`, and stops the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            on_loop = self._graphs is not None and self._graphs.on_thread()  # the loop cannot wait for itself
            if not on_loop and not self._cond.wait_for(lambda: not self._looping, timeout):
                logger.warning("scheduler: the round loop did not stop within %.0f s", timeout)
            while self._ready:
                ticket = self._ready.popleft()
                self._release_locked(ticket)
                if ticket.future.set_running_or_notify_cancel():
                    ticket.future.set_exception(Overloaded("the server is shutting down."))
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()
        if self._froze:
            self._froze = False
            _thaw_heap()

    @property
    def alive(self) -> bool:
        return self._started and not self._stopping and self._dead is None

    @property
    def waiting(self) -> int:
        """Requests admitted and not yet in a round."""
        return self._waiting

    @property
    def queued(self) -> int:
        """Requests prepared and waiting for the next round."""
        return len(self._ready)

    # ---- admission ----
    def admit(self, request_id: str) -> Ticket | None:
        """A ticket holding a place in the queue, or None when `max_queue` requests already wait."""
        with self._cond:
            if self._stopping or self._waiting >= self.settings.max_queue:
                return None
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)
        return Ticket(request_id)

    def release(self, ticket: Ticket) -> None:
        """Gives the ticket's place back (idempotent; done when it enters a round or the request ends)."""
        with self._cond:
            self._release_locked(ticket)

    def _release_locked(self, ticket: Ticket) -> None:
        if ticket.counted:
            ticket.counted = False
            self._waiting -= 1
            self.metrics.queue_depth.set(self._waiting)

    # ---- preparing (pool threads) ----
    def _take_copy(self) -> None:
        self._local.prompts = self._copies.get_nowait()

    def adopt_thread(self) -> None:
        """Gives the calling thread (the event loop's, which prepares lone requests: `serve.inline_prepare_bytes`)
        its own prompt tokenizer copy now, so that no request pays for the copy."""
        if self.workers is None and getattr(self._local, "prompts", None) is None:
            self._local.prompts = self.engine.prompts.copy_for_thread()

    def prepare(self, request) -> PreparedRequest:
        """`engine.prepare` with this thread's own prompt tokenizer (call it from a pool thread), or in a worker
        process when there are some."""
        if self.workers is not None:
            return self.workers.prepare(request)
        prompts = getattr(self._local, "prompts", None)
        if prompts is None:  # a thread outside the pool: give it a copy of its own too
            prompts = self._local.prompts = self.engine.prompts.copy_for_thread()
        return self.engine.prepare(request, prompts=prompts)

    # ---- rounds (the model thread) ----
    def submit(self, ticket: Ticket, prepared: PreparedRequest) -> Future:
        """Queues a prepared request for the next round; the future gets its answers."""
        ticket.prepared, ticket.need, ticket.ready_at = prepared, self.engine.footprint(prepared), time.perf_counter()
        with self._cond:
            if self._stopping or not self._started:
                raise Overloaded("the server is shutting down." if self._started else "the scheduler is not started.")
            if self._dead is not None:
                raise Overloaded(f"the model thread stopped ({type(self._dead).__name__}).")
            self._ready.append(ticket)
            post, self._looping = not self._looping, True
        if post:
            self._graphs.submit(self._loop)
        return ticket.future

    def _loop(self) -> None:
        """The round loop on the graph thread, until nothing waits and nothing runs (posted again by `submit`)."""
        try:
            self._rounds()
        except BaseException as error:  # not an Exception (those are answered per round): the loop is gone for good
            logger.critical("scheduler: the round loop stopped: %r", error)
            with self._cond:
                self._dead = error
                self._looping = False
                self._cond.notify_all()
            raise

    def _rounds(self) -> None:
        pending: Started | None = None  # with overlap_rounds: the round on the device, its answers not yet read
        overlap = self.settings.overlap_rounds
        while True:
            if self._graphs.waiting():  # other threads' work (an in-process decide): give the thread back
                if pending is not None:
                    self._settle(pending, behind=None)
                self._graphs.submit(self._loop)  # behind that work (still `_looping`)
                return
            with self._cond:
                if pending is None and (self._stopping or not self._ready):
                    self._looping = False  # `submit` posts the loop again
                    self._cond.notify_all()
                    return
            if pending is not None:
                # the next round is taken once the device is done with this one (with serve.launch_ahead: about a
                # launch's host time before): it packs what arrived meanwhile, as without overlap; launching it at
                # once would send half-filled rounds while clients still wait
                try:
                    self._wait_until_launch_time(pending)
                except Exception:  # noqa: BLE001 (a device error: its `result()` raises it again, answered there)
                    pass
            with self._cond:
                batch = self._take() if self._ready and not self._stopping else []
            started = None
            if batch:
                try:
                    started = self._start(batch)  # enqueued behind the round on the device, if any
                    if not overlap and started is not None:
                        self._finish(started)
                        started = None
                except BaseException as error:  # never leave a future unanswered, never let the thread die quietly
                    self._fail(batch, error)
                    if not isinstance(error, Exception):
                        if pending is not None:  # the thread stops: the round on the device is answered too
                            self._fail(pending.batch, error)
                        raise
            if pending is not None:
                self._settle(pending, behind=started)  # its answers while the device runs the next round
            elif started is not None:
                started.device_from = started.launched_at  # nothing ran on the device: it starts at its launch
            pending = started

    def _settle(self, pending: Started, behind: Started | None) -> None:
        """Waits for `pending` on the device (timing `behind`, launched after it) and answers its requests."""
        try:
            self._device_done(pending, behind=behind)
            self._finish(pending)
        except BaseException as error:
            self._fail(pending.batch, error)
            if not isinstance(error, Exception):
                raise

    def _fail(self, batch: list[Ticket], error: BaseException) -> None:
        logger.error("scheduler: round handling failed", exc_info=error)
        for ticket in batch:
            if not ticket.future.done():
                ticket.future.set_exception(error if isinstance(error, Exception) else Overloaded(
                    "the model thread stopped."))

    def _take(self) -> list[Ticket]:
        """The longest prefix of the waiting requests that fits one round, or with `serve.fill_buckets` the part of it
        that fills its bucket best (called holding the lock)."""
        caps = self.engine.config.capacities
        window: list[Ticket] = []
        while self._ready and len(window) < caps.requests:
            ticket = self._ready.popleft()
            if ticket.future.cancelled():  # timed out while waiting
                self._release_locked(ticket)
                continue
            window.append(ticket)
        if not window:
            return []
        needs = [t.need for t in window]
        first = plan_rounds(needs, caps, self.engine.max_options, exact=True)[0]
        n = len(first.requests)
        assert first.requests == list(range(n)), first.requests  # rounds are packed in order
        if self.settings.fill_buckets and n > 1:
            n = fill_prefix(needs[:n], caps, self.engine.max_options, self.settings.round_overhead_tokens)
        self._ready.extendleft(reversed(window[n:]))
        batch = []
        for ticket in window[:n]:
            self._release_locked(ticket)
            if ticket.future.set_running_or_notify_cancel():
                batch.append(ticket)
        return batch

    def _start(self, batch: list[Ticket]) -> Started | None:
        """Starts a round (`Engine.start`): a graph replay is only enqueued. None when it failed to start: then its
        requests are answered here (503 after an out-of-memory, else each alone)."""
        import torch

        start = time.perf_counter()
        for ticket in batch:
            self.metrics.queue_wait.observe(start - ticket.ready_at)
        self.metrics.running.inc(len(batch))  # counted until `_finish` (two rounds with overlap_rounds)
        try:
            pending = self.engine.start([t.prepared for t in batch])
            started = Started(batch, pending, start, launched_at=time.perf_counter(), bucket=pending.bucket_tokens)
            if started.bucket is not None:
                self._launch_s = _average(self._launch_s, started.launched_at - start)
            return started
        except torch.OutOfMemoryError:
            self._out_of_memory(batch)
        except Exception as error:
            self._failed_round(batch, error)
        self.metrics.running.dec(len(batch))
        return None

    def _wait_until_launch_time(self, pending: Started) -> None:
        """Returns when the device is done with `pending`, or with serve.launch_ahead when it has about a launch's
        host time of it left (learnt: its bucket's device time, the launch's host time, less a margin), so that the
        next round's replay is enqueued behind it before the device idles (without timing learnt yet: when done)."""
        device_s = self._device_s.get(pending.bucket) if pending.bucket is not None else None
        if (not self.settings.launch_ahead or device_s is None or self._launch_s is None
                or pending.device_from is None):
            pending.wait()
            pending.device_done_at = time.perf_counter()
            return
        launch_at = pending.device_from + device_s - self._launch_s - LAUNCH_MARGIN_S
        while not pending.pending.device_done():
            left = launch_at - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(left, 5e-4))  # and look again: the device may finish early
        pending.device_done_at = time.perf_counter()

    def _device_done(self, pending: Started, behind: Started | None) -> None:
        """Waits for the device to finish `pending`; learns its bucket's device time from when it could start (its
        launch, or the end of the round before it), and dates the start of `behind`, the round launched after it.

        When the device finished it: seen by the wait before `behind` was taken; else, if it is still running now,
        when this wait ends; else sometime during `behind`'s launch (the middle of it is taken: a late guess would
        keep the next launches late, so the estimate could never learn that the device idles during a launch)."""
        done = pending.device_done_at
        if done is None:
            try:
                if behind is not None and pending.pending.device_done():
                    done = (behind.at + behind.launched_at) / 2
                else:
                    pending.wait()
                    done = time.perf_counter()
            except Exception:  # noqa: BLE001 (a device error: `_finish` reads it from `result()`, answers it there)
                return
        if pending.bucket is not None and pending.device_from is not None:
            self._device_s[pending.bucket] = _average(self._device_s.get(pending.bucket), done - pending.device_from)
        if behind is not None:
            behind.device_from = max(behind.launched_at, done)
            if behind.bucket is not None and done > behind.launched_at:
                self.metrics.launched_ahead.inc()

    def _finish(self, started: Started) -> None:
        """A started round's answers to its futures (waits for the device if it still runs), and its metrics."""
        import torch

        batch = started.batch
        try:
            answers = started.pending.result()
        except torch.OutOfMemoryError:
            self._out_of_memory(batch)
        except Exception as error:
            self._failed_round(batch, error)
        else:
            self._observe([t.prepared for t in batch], started.at)
            for ticket, answer in zip(batch, answers):
                ticket.future.set_result(answer)
        finally:
            self.metrics.running.dec(len(batch))

    def _failed_round(self, batch: list[Ticket], error: Exception) -> None:
        self.metrics.round_failures.labels("error").inc()
        if len(batch) == 1:
            logger.error("scheduler: request %s failed in its round", batch[0].request_id, exc_info=error)
            batch[0].future.set_exception(error)
            return
        logger.warning("scheduler: a round of %d requests raised %s: %s; running them one at a time",
                       len(batch), type(error).__name__, error)
        for ticket in batch:
            self._run_alone(ticket)

    def _run_alone(self, ticket: Ticket) -> None:
        import torch

        try:
            ticket.future.set_result(self._forward([ticket.prepared])[0])
        except torch.OutOfMemoryError:
            self._out_of_memory([ticket])
        except Exception as error:
            self.metrics.round_failures.labels("error").inc()
            logger.exception("scheduler: request %s failed alone in its round", ticket.request_id)
            ticket.future.set_exception(error)

    def _out_of_memory(self, batch: list[Ticket]) -> None:
        import torch

        self.metrics.round_failures.labels("oom").inc()
        logger.error("scheduler: out of memory in a round of %d requests (%d tokens); answering them 503",
                     len(batch), sum(t.prepared.stream_tokens for t in batch))
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        for ticket in batch:
            ticket.future.set_exception(Overloaded("the model ran out of memory in this request's round; retry."))

    def _forward(self, prepared: list[PreparedRequest]) -> list[dict]:
        """One round (`prepared` fits one by construction) -> answers, and its metrics."""
        start = time.perf_counter()
        answers = self.engine.run(prepared)
        self._observe(prepared, start)
        return answers

    def _observe(self, prepared: list[PreparedRequest], start: float) -> None:
        tokens = sum(p.stream_tokens - p.cached_tokens for p in prepared)  # resumed checkpoints not recomputed
        m = self.metrics
        m.round_seconds.observe(time.perf_counter() - start)
        m.rounds.inc()
        m.round_requests.observe(len(prepared))
        m.round_tokens.observe(tokens)
        m.tokens_computed.inc(tokens)
