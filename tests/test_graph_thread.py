"""flide/graphs/thread.py: the one thread every compiled call runs on. Work from other threads runs there in order;
a call made on it runs at once (the scheduler's rounds launch from it without deadlocking on themselves); errors reach
the caller; `close` lets posted work finish, then ends the thread."""

from __future__ import annotations

import threading
import time

import pytest

from flide.graphs.thread import GraphThread


def test_graph_thread_runs_work_in_order_and_nested_calls_at_once():
    graphs = GraphThread(name="flide-graphs-test")
    order = []

    def job(i):
        order.append((i, threading.get_ident()))
        return i * 2

    futures = [graphs.submit(job, i) for i in range(5)]
    assert [f.result(timeout=10) for f in futures] == [0, 2, 4, 6, 8]
    assert [i for i, _ in order] == list(range(5)) and {t for _, t in order} == {graphs._thread.ident}
    # a call from the graph thread itself runs inline (handed over, it would wait for itself forever)
    assert graphs.call(lambda: graphs.call(lambda: graphs.on_thread())) is True
    assert not graphs.on_thread()
    with pytest.raises(ZeroDivisionError):
        graphs.call(lambda: 1 / 0)
    assert graphs.call(lambda: "alive") == "alive"  # an error does not end the thread
    assert not graphs.waiting()
    slow = graphs.submit(time.sleep, 0.2)
    graphs.close()
    assert slow.done() and not graphs._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        graphs.submit(job, 9)
