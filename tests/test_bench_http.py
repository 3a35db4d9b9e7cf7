"""The http engine of the benchmark (flide/bench/{loadgen,server}.py, engine `http`): the closed-loop load generator
against a small standard-library server (keep-alive, errors, request caps), and `flide serve` driven through the
runner on the tiny model (rows, answers equal to the in-process engine's, the server stopped afterwards, also when
the run is interrupted or the server cannot start)."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from flide import workloads as datasets
from flide.bench.config import config_from_dict
from flide.bench.loadgen import closed_loop, percentile
from flide.bench.server import FlideServer, free_port


# ---- the load generator ----
def test_client_connection_reads_every_kind_of_response_body():
    """loadgen's socket client: Content-Length, chunked (with extensions and trailers) and close-delimited bodies,
    keep-alive across requests, a reopen after the server closed, and a clear error for a broken status line."""
    import http.client
    import socket

    from flide.bench.loadgen import Connection, post

    answers = [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}",
               b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n4;x=y\r\n{\"b\"\r\n3\r\n:2}\r\n0\r\n"
               b"T: 1\r\n\r\n",
               b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-close",
               b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
               b"garbage\r\n\r\n"]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    accepted, bodies = [], []

    def serve():
        pending = list(answers)
        while pending:
            conn, _ = listener.accept()
            accepted.append(conn)
            with conn, conn.makefile("rb") as reader:
                while pending:
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        byte = reader.read(1)
                        if not byte:
                            break
                        head += byte
                    if not head:
                        break
                    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                    bodies.append(reader.read(length))
                    answer = pending.pop(0)
                    conn.sendall(answer)
                    if b"Connection: close" in answer:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    connection = Connection("127.0.0.1", listener.getsockname()[1], timeout=10)
    try:
        assert post(connection, b'{"q":1}') == (200, b'{"a":1}')
        assert post(connection, b"{}") == (503, b'{"b":2}')
        assert post(connection, b"[]") == (200, b"until-close")
        assert connection.sock is None  # the server said close
        assert post(connection, b"{}") == (200, b"ok")  # reopened
        with pytest.raises(http.client.BadStatusLine):
            post(connection, b"{}")
        assert connection.sock is None
    finally:
        connection.close()
        thread.join(10)
        listener.close()
    assert len(accepted) == 2 and bodies == [b'{"q":1}', b"{}", b"[]", b"{}", b"{}"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


@pytest.fixture
def stub():
    """A stdlib HTTP/1.1 server: answers 200 (every `fail_every`-th request 503), records connections and bodies."""
    seen = {"connections": set(), "bodies": [], "count": 0, "failed": 0, "fail_every": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                seen["count"] += 1
                seen["connections"].add(self.client_address)
                seen["bodies"].append(body.decode())
                fail = seen["fail_every"] and seen["count"] % seen["fail_every"] == 0
                seen["failed"] += bool(fail)
            payload = b'{"detail": "busy"}' if fail else b'{"answers": {}}'
            self.send_response(503 if fail else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_closed_loop_keeps_one_connection_per_client(stub):
    url, seen = stub
    bodies = [json.dumps({"n": i}) for i in range(5)]
    result = closed_loop(url, bodies, clients=3, seconds=0.6, processes=2)
    assert result.error_count == 0 and result.answered == seen["count"] > 3
    assert len(seen["connections"]) == 3  # keep-alive: every request of a client on its one connection
    assert {json.loads(b)["n"] for b in seen["bodies"]} == set(range(5))  # clients post different requests
    assert result.requests_per_s == pytest.approx(result.answered / result.seconds)
    assert 0.5 < result.seconds < 5 and result.client_cpu_share > 0
    assert result.percentile(0.5) <= result.percentile(0.99) <= max(result.latencies_ms)


def test_closed_loop_counts_errors_and_caps_requests(stub):
    url, seen = stub
    seen["fail_every"] = 4
    result = closed_loop(url, ['{"a": 1}'], clients=4, seconds=60, max_requests=20)
    assert result.answered + result.error_count == 20 == seen["count"]  # 5 per client, then they stop (not 60 s)
    assert result.errors == {"503": seen["failed"]} and seen["failed"] == 5
    assert result.answered == 15 and result.seconds < 30


def test_closed_loop_refused_connection():
    result = closed_loop(f"http://127.0.0.1:{free_port()}", ['{}'], clients=2, seconds=0.2)
    assert result.answered == 0 and result.errors == {"ConnectionRefusedError": 2}
    assert result.requests_per_s == 0 and result.percentile(0.5) != result.percentile(0.5)  # nan
    assert result.describe_errors() == "ConnectionRefusedError: 2"


def test_closed_loop_argument_errors():
    with pytest.raises(ValueError, match="plain http://host:port"):
        closed_loop("https://example.org", ["{}"], 1, 1.0)
    with pytest.raises(ValueError, match="clients >= 1"):
        closed_loop("http://127.0.0.1:1", ["{}"], 0, 1.0)


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([], 0.5) != percentile([], 0.5)


# ---- config ----
@pytest.mark.parametrize("values, message", [
    ({"http": {"seconds": 0}}, "`http.seconds`: must be a number > 0"),
    ({"http": {"clients": [1]}}, "http.clients; valid keys of `http`:"),
    ({"http": {"concurrency": [0]}}, "`http.concurrency`: must be a non-empty list of positive integers"),
    ({"workloads": ["race1"], "http": {"workloads": ["race"]}}, "`http.workloads`: race not among the grid's"),
    ({"http": {"flide": {"runtime": {"device": "cpu"}}}}, "`http.flide`: sets runtime.device"),
    ({"http": {"flide": {"serve": {"max_queue": -1}}}}, "http.flide"),
    ({"engines": ["http"], "seed": 1}, "http: `flide serve --random-weights` draws its weights with seed 0"),
    ({"engines": ["http"], "final_norm_scale": 4}, "http: `flide serve` does not scale the final norm"),
    ({"engines": ["http"], "models": ["tiny:llama"]}, "http: `flide serve` embeds only tiny:qwen3_5_text"),
])
def test_http_config_errors(values, message):
    with pytest.raises(ValueError) as error:
        config_from_dict({"name": "t", "models": ["tiny:qwen3_5_text"], **values})
    assert message in str(error.value)


def test_http_runs_only_its_workloads():
    config = config_from_dict({"name": "t", "models": ["tiny:qwen3_5_text"], "engines": ["flide", "http"],
                               "http": {"workloads": ["race"]}})
    assert config.runs("http", "race") and not config.runs("http", "quality")
    assert config.runs("flide", "quality") and config.runs("http", "race")
    assert config_from_dict({"name": "t", "models": ["tiny:qwen3_5_text"]}).runs("http", "sweep/q8")


# ---- flide serve through the runner ----
def _config(tmp_path, **extra) -> dict:
    values = {"name": "web", "models": ["tiny:qwen3_5_text"], "device": "cpu", "torch_threads": 1,
              "engines": ["http"], "workloads": ["race"], "limits": {"race": 3}, "concurrency": [1, 3],
              "warmup": 1, "repeats": 1, "latency_requests": 2, "throughput_seconds": 1.0,
              "http": {"check_requests": 2, "flide": {"capacities": {"requests": 4}}}, **extra}
    if not datasets.data_available():
        folder = tmp_path / "data" / "race"
        folder.mkdir(parents=True)
        passage = {"article": "The school opened in May. " * 5, "questions": ["When?", "What?"],
                   "options": [["May", "June", "July", "never"], ["school", "shop", "park", "home"]], "answers": "AB"}
        for part in ("middle", "high"):
            (folder / f"race_dev_{part}.jsonl").write_text((json.dumps(passage) + "\n") * 3)
        values["data_dir"] = str(tmp_path / "data")
    return values


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) counts as gone
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture
def started(monkeypatch):
    """The pids of the servers FlideServer starts during a test."""
    pids = []
    original = FlideServer.start

    def start(self):
        try:
            return original(self)
        finally:
            if self.process is not None:
                pids.append(self.process.pid)
    monkeypatch.setattr(FlideServer, "start", start)
    return pids


def test_http_engine_through_the_runner(tmp_path, started):
    """flide serve on the tiny model, 1 and 3 closed-loop clients: rows in the results format, answers over HTTP equal
    to the in-process engine's, no failures, the server stopped afterwards; the markdown's HTTP table."""
    from flide.bench import main

    path = tmp_path / "web.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path)))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "web.json").read_text())
    got = {(r["workload"], r["engine"], r["metric"]): r for r in rows}
    value = {key: row["value"] for key, row in got.items()}
    assert value[("race", "http", "http_max_abs_diff")] <= 1e-6
    assert value[("race", "http", "tokens_per_request")] > 0 and value[("race", "http", "latency_p50_ms")] > 0
    # the paired one-client comparison: the in-process twin's latency, and HTTP's extra time over it (a loopback
    # round trip and the server's parsing: a median of pairs, within the HTTP latency itself whatever the CPU's
    # jitter on the tiny model)
    local, gap = value[("race", "http", "latency_inprocess_p50_ms")], value[("race", "http", "latency_http_gap_p50_ms")]
    assert local > 0 and -local < gap < value[("race", "http", "latency_p50_ms")]
    for n in (1, 3):
        assert value[("race", "http", f"requests_per_s@{n}")] > 0
        assert value[("race", "http", f"answered@{n}")] >= 1 and value[("race", "http", f"errors@{n}")] == 0
        assert got[("race", "http", f"errors@{n}")]["unit"] == "requests (none)"
        assert 0 < value[("race", "http", f"latency_p50_ms@{n}")] <= value[("race", "http", f"latency_p99_ms@{n}")]
        assert 1 <= value[("race", "http", f"mean_round_requests@{n}")] <= n
        # the server's slow tails from its histograms' 0.25 s bucket: present, counts, and (tiny requests) most
        # prepares fast, which a misread bucket (every prepare counted) would break
        answered = value[("race", "http", f"answered@{n}")]
        assert all(value[("race", "http", f"slow_{w}@{n}")] >= 0 for w in ("rounds", "prepares", "queue_waits"))
        assert value[("race", "http", f"slow_prepares@{n}")] < answered / 2
    assert value[("race", "http", "mean_round_requests@1")] == 1
    assert len(started) == 1 and not _alive(started[0])
    report = (tmp_path / "out" / "web.md").read_text()
    assert "### HTTP server" in report and "| race | 3 |" in report
    assert "HTTP minus in-process latency" in report


class _Abort(BaseException):
    """Not an Exception: the runner records no error row for it, it leaves the run."""


def test_http_server_stops_when_the_run_is_interrupted(tmp_path, started, monkeypatch):
    from flide.bench import runner

    def interrupted(engine, *args, **kwargs):
        assert engine.server.running
        raise _Abort

    monkeypatch.setattr(runner, "measure_http", interrupted)
    with pytest.raises(_Abort):
        runner.run(config_from_dict(_config(tmp_path)), log=lambda _: None)
    assert len(started) == 1 and not _alive(started[0])


def test_server_that_cannot_start_fails_with_its_log(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "no_such_model_type"}')
    config = config_from_dict({"name": "t", "models": [str(bad)], "tokenizer": str(tmp_path), "device": "cpu"})
    server = FlideServer(str(bad), config, "cpu", log_dir=tmp_path / "logs")
    with pytest.raises(RuntimeError, match="flide serve exited with code") as error:
        server.start()
    assert "no_such_model_type" in str(error.value)  # the log's tail names the cause
    assert not server.running and (tmp_path / "logs").is_dir()
