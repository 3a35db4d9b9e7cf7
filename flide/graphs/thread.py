"""The process's one graph thread: every compiled, captured call runs on it (cudagraph trees keep thread-local state
that only the thread which set it up finds; see runner.py's docstring).

Work handed over from another thread runs in order and the caller waits for it; a call made ON the graph thread runs
at once. That second case is what lets the serve scheduler run its rounds on this thread (`Scheduler` posts its
round loop here), so a round's launch costs no thread hand-off: on the H200's host each hand-off and wake-up back
cost ~0.15 ms, twice per round when a model thread of its own handed every launch to this one.

A long job posted here (the scheduler's loop) should look at `waiting()` between rounds and give the thread back,
so that work posted by other threads (an in-process `decide` beside a running server) is not starved.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class GraphThread:
    """One daemon thread running posted callables in order (a one-worker executor that also knows its own thread)."""

    def __init__(self, name: str = "flide-graphs"):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def on_thread(self) -> bool:
        """Whether the caller is the graph thread."""
        return threading.get_ident() == self._thread.ident

    def submit(self, fn: Callable, *args: Any) -> Future:
        """Queues fn(*args) to run on the graph thread; its Future gets the result or the exception."""
        if self._closed:
            raise RuntimeError("the graph thread is closed (the interpreter is exiting).")
        future: Future = Future()
        self._work.put((future, fn, args))
        return future

    def call(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) on the graph thread: at once when called from it, else handed over and waited for."""
        if self.on_thread():
            return fn(*args)
        return self.submit(fn, *args).result()

    def waiting(self) -> bool:
        """Whether posted work waits for the thread (checked by long jobs running on it)."""
        return not self._work.empty()

    def close(self, timeout: float = 30.0) -> None:
        """Lets the work already posted finish, then ends the thread (at exit: a daemon thread still running CUDA
        work while the interpreter finalises can crash it)."""
        if not self._closed:
            self._closed = True
            self._work.put(None)
        if not self.on_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as error:  # noqa: BLE001 (the caller re-raises it; the thread must live on)
                future.set_exception(error)
            else:
                future.set_result(result)


_GRAPH_THREAD: GraphThread | None = None
_GRAPH_THREAD_LOCK = threading.Lock()


def graph_thread() -> GraphThread:
    """The process's one graph thread (started on first use: importing flide starts no thread)."""
    global _GRAPH_THREAD
    with _GRAPH_THREAD_LOCK:
        if _GRAPH_THREAD is None:
            _GRAPH_THREAD = GraphThread()
            atexit.register(_GRAPH_THREAD.close)
        return _GRAPH_THREAD
