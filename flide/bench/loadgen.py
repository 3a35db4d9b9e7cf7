"""A closed-loop HTTP load generator for System One servers (`flide serve`, or any server of POST /v1/systemone).

    result = closed_loop("http://127.0.0.1:8000", bodies, clients=64, seconds=10)
    result.requests_per_s, result.percentile(0.5), result.percentile(0.99), result.errors

    python -m flide.bench.loadgen --url http://127.0.0.1:8000 --requests requests.json --clients 1 8 32 64

Each client posts a request, waits for the whole answer, then posts the next (closed loop), on a keep-alive
connection of its own (`Connection`: HTTP/1.1 on a plain socket, standard library only, less client CPU per request
than `http.client` or httpx). Client i posts bodies i, i + N, i + 2N, ... (cycling), so concurrent clients post
different requests. The clients run as threads in `processes` worker processes (`python -m flide.bench.loadgen
--worker`, default one per 16 clients), so that one Python interpreter's lock does not cap the request rate; every
worker connects first, then all start at one instant (a CLOCK_MONOTONIC deadline shared by the processes of the
machine) and stop starting requests `seconds` later (or when `max_requests` are done). Requests/s = answered (200)
requests / (the last answer - the start). Each worker reports its CPU time: `client_cpu_share` near 1 means a worker
used its whole core and the client side may have capped the rate (give it more `processes`).

This module imports the standard library only (no torch), so worker processes start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CLIENTS_PER_PROCESS = 16
PATH = "/v1/systemone"


@dataclass
class LoadResult:
    """What a closed-loop run measured: latencies (ms) of answered requests, failures by kind, the rate."""

    clients: int
    seconds: float  # from the start to the last answer (or failure)
    latencies_ms: list[float] = field(default_factory=list)  # of 200 answers
    errors: dict[str, int] = field(default_factory=dict)  # "503", "504", "ConnectionResetError", ... -> count
    client_cpu_share: float = 0.0  # the busiest worker process: CPU seconds / wall seconds

    @property
    def answered(self) -> int:
        return len(self.latencies_ms)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def requests_per_s(self) -> float:
        if not self.answered:
            return 0.0
        return self.answered / self.seconds if self.seconds > 0 else float("nan")

    def percentile(self, q: float) -> float:
        """Latency percentile (ms), linear between ranks; nan when nothing was answered."""
        return percentile(self.latencies_ms, q)

    def describe_errors(self) -> str:
        return ", ".join(f"{kind}: {count}" for kind, count in sorted(self.errors.items())) or "none"


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of values, linear between ranks (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def split_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"The load generator speaks plain http://host:port, got {url!r}.")
    return parts.hostname, parts.port or 80


class Connection:
    """A keep-alive HTTP/1.1 client connection for POSTs of JSON, Nagle's algorithm off (a small request then waits
    for no ACK). Written on a socket rather than `http.client`, whose response parsing (headers through the email
    package) cost ~0.2 ms a request on this repository's CPU: the client's own time counts in every latency the
    benchmark reports over HTTP (issue 4's one-client gap), and in how many clients one process can drive.
    Responses with Content-Length, chunked bodies and bodies ended by the server closing are read; a connection the
    server closed is reopened by the next request (the failed one raises, as with http.client)."""

    def __init__(self, host: str, port: int, timeout: float | None = None):
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None
        self._file = None
        self._head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\nAccept: application/json\r\n"

    def connect(self) -> None:
        self.close()
        self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self.sock.makefile("rb")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """One POST -> (status, body). Raises OSError or http.client.HTTPException on a broken exchange (the
        connection is closed then)."""
        if self.sock is None:
            self.connect()
        try:
            self.sock.sendall(f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n".encode()
                              + body)
            return self._response()
        except BaseException:
            self.close()
            raise

    def _response(self) -> tuple[int, bytes]:
        line = self._file.readline(65537)
        if not line:
            raise http.client.RemoteDisconnected("the server closed the connection without a response")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise http.client.BadStatusLine(line[:100].decode("latin-1"))
        status, length, chunked, close = int(parts[1]), None, False, parts[0] == b"HTTP/1.0"
        while True:
            line = self._file.readline(65537)
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise http.client.IncompleteRead(b"")
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.lower() == b"chunked"
            elif name == b"connection":
                close = value.lower() == b"close"
        if chunked:
            payload = self._chunks()
        elif length is not None:
            payload = self._file.read(length)
            if len(payload) < length:
                raise http.client.IncompleteRead(payload, length - len(payload))
        else:  # no length: the body runs to the connection's end
            payload, close = self._file.read(), True
        if close:
            self.close()
        return status, payload

    def _chunks(self) -> bytes:
        out = []
        while True:
            size_line = self._file.readline(65537)
            if not size_line:
                raise http.client.IncompleteRead(b"".join(out))
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while self._file.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(out)
            chunk = self._file.read(size + 2)  # and its CRLF
            if len(chunk) < size + 2:
                raise http.client.IncompleteRead(chunk)
            out.append(chunk[:size])


def post(connection: Connection, body: bytes, path: str = PATH) -> tuple[int, bytes]:
    """One POST on a keep-alive connection (reopened when the server closed it) -> (status, body)."""
    return connection.post(path, body)


# ---- one worker process: some of the clients, as threads ----
def _client(host: str, port: int, path: str, bodies: list[bytes], index: int, stride: int, budget: int | None,
            timeout: float, connected: threading.Semaphore, start: threading.Event, times: dict, out: dict,
            lock: threading.Lock) -> None:
    connection = Connection(host, port, timeout=timeout)
    latencies, errors, last = [], {}, 0.0
    try:
        try:
            connection.connect()  # before the start: the timed loop reuses it
        except OSError as error:
            errors[type(error).__name__] = 1
            return
        finally:
            connected.release()
        start.wait()
        deadline, sent, j = times["deadline"], 0, 0
        while time.monotonic() < deadline and (budget is None or sent < budget):
            body = bodies[(index + j * stride) % len(bodies)]
            j += 1
            sent += 1
            t0 = time.monotonic()
            try:
                status, _ = post(connection, body, path)
            except (OSError, http.client.HTTPException) as error:
                kind = type(error).__name__
                errors[kind] = errors.get(kind, 0) + 1
                connection.close()  # the next request opens a new connection
                last = time.monotonic()
                continue
            last = time.monotonic()
            if status == 200:
                latencies.append((last - t0) * 1e3)
            else:
                errors[str(status)] = errors.get(str(status), 0) + 1
    finally:
        connection.close()
        with lock:
            out["latencies_ms"].extend(latencies)
            for kind, count in errors.items():
                out["errors"][kind] = out["errors"].get(kind, 0) + count
            out["last"] = max(out["last"], last)


def run_clients(spec: dict, ready=None, go=None) -> dict:
    """Runs the clients `spec["indices"]` of a closed loop in this process (one thread each) and returns their
    measurements. `ready()` is called once every client has connected; `go()` returns the CLOCK_MONOTONIC start."""
    cpu, wall = time.process_time(), time.monotonic()
    host, port = spec["host"], spec["port"]
    bodies = [b.encode("utf-8") if isinstance(b, str) else b for b in spec["bodies"]]
    start, lock, connected = threading.Event(), threading.Lock(), threading.Semaphore(0)
    times: dict = {}
    out: dict = {"latencies_ms": [], "errors": {}, "last": 0.0}
    threads = [threading.Thread(target=_client, daemon=True,
                                args=(host, port, spec.get("path", PATH), bodies, index, spec["stride"],
                                      spec.get("budget"), spec["timeout"], connected, start, times, out, lock))
               for index in spec["indices"]]
    for thread in threads:
        thread.start()
    for _ in threads:  # every client has connected (or failed to: it reports that as an error)
        connected.acquire()
    if ready is not None:
        ready()
    begin = go() if go is not None else time.monotonic()
    times["deadline"] = begin + spec["seconds"]
    while time.monotonic() < begin:
        time.sleep(min(0.01, max(0.0, begin - time.monotonic())))
    start.set()
    for thread in threads:
        thread.join()
    # CPU over wall time since this process began its part (connecting and the wait for the start cost ~nothing)
    out["cpu_share"] = (time.process_time() - cpu) / max(time.monotonic() - wall, 1e-3)
    return out


def _worker_main() -> int:
    """`python -m flide.bench.loadgen --worker`: a spec line on stdin -> 'ready' on stdout -> a 'go START' line on
    stdin -> one JSON result line on stdout."""
    spec = json.loads(sys.stdin.readline())

    def ready():
        print("ready", flush=True)

    def go() -> float:
        line = sys.stdin.readline().split()
        if len(line) != 2 or line[0] != "go":
            raise SystemExit(f"loadgen worker: expected 'go START', got {line!r}")
        return float(line[1])

    out = run_clients(spec, ready, go)
    print(json.dumps(out), flush=True)
    return 0


# ---- the parent: spread the clients over worker processes ----
def closed_loop(url: str, bodies: list[str | bytes], clients: int, seconds: float, processes: int | None = None,
                max_requests: int | None = None, timeout: float = 120.0, path: str = PATH) -> LoadResult:
    """`clients` closed-loop clients posting `bodies` (JSON texts) to url + path for `seconds` (each stops starting
    requests after it, or after its share of `max_requests`), in `processes` worker processes (default: one per
    16 clients). Returns every latency and failure; failures do not stop the run."""
    if clients < 1 or seconds <= 0 or not bodies:
        raise ValueError(f"closed_loop needs clients >= 1, seconds > 0 and bodies (got {clients}, {seconds}, "
                         f"{len(bodies)} bodies).")
    host, port = split_url(url)
    processes = max(1, min(clients, processes or math.ceil(clients / CLIENTS_PER_PROCESS)))
    budget = None if max_requests is None else max(1, math.ceil(max_requests / clients))
    texts = [b.decode("utf-8") if isinstance(b, bytes) else b for b in bodies]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    workers = []
    try:
        for w in range(processes):
            spec = {"host": host, "port": port, "path": path, "bodies": texts, "indices": list(range(w, clients,
                                                                                                      processes)),
                    "stride": clients, "budget": budget, "timeout": timeout, "seconds": seconds}
            worker = subprocess.Popen([sys.executable, "-m", "flide.bench.loadgen", "--worker"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            workers.append(worker)
            worker.stdin.write(json.dumps(spec) + "\n")
            worker.stdin.flush()
        for worker in workers:
            line = worker.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"load generator worker {worker.pid} did not start (said {line!r}, exit code "
                                   f"{worker.poll()}).")
        begin = time.monotonic() + 0.05
        for worker in workers:
            worker.stdin.write(f"go {begin!r}\n")
            worker.stdin.flush()
        results = []
        for worker in workers:
            line = worker.stdout.readline()
            worker.wait(timeout=60)
            if not line.strip():
                raise RuntimeError(f"load generator worker {worker.pid} gave no result (exit code {worker.returncode})")
            results.append(json.loads(line))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            for stream in (worker.stdin, worker.stdout):
                if stream is not None:
                    stream.close()
    merged = LoadResult(clients=clients, seconds=max([r["last"] for r in results] + [begin]) - begin)
    for result in results:
        merged.latencies_ms.extend(result["latencies_ms"])
        for kind, count in result["errors"].items():
            merged.errors[kind] = merged.errors.get(kind, 0) + count
    merged.client_cpu_share = max(r["cpu_share"] for r in results)
    return merged


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--worker"]:
        return _worker_main()
    parser = argparse.ArgumentParser(prog="python -m flide.bench.loadgen",
                                     description="Closed-loop HTTP clients against a System One server.")
    parser.add_argument("--url", required=True, help="the server, http://host:port")
    parser.add_argument("--requests", required=True, help="a JSON file: one request or a list of requests")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64], help="concurrency levels")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each level")
    parser.add_argument("--processes", type=int, help="worker processes (default: one per 16 clients)")
    args = parser.parse_args(argv)
    with open(args.requests, encoding="utf-8") as file:
        requests = json.load(file)
    bodies = [json.dumps(r) for r in (requests if isinstance(requests, list) else [requests])]
    print("| clients | requests/s | p50 ms | p99 ms | answered | errors | client CPU |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for clients in args.clients:
        result = closed_loop(args.url, bodies, clients, args.seconds, args.processes)
        print(f"| {clients} | {result.requests_per_s:.1f} | {result.percentile(0.5):.1f} | "
              f"{result.percentile(0.99):.1f} | {result.answered} | {result.describe_errors()} | "
              f"{result.client_cpu_share:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
