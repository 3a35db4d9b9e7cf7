"""What a request's path costs on the host, the model's forward pass taken out: `decide`, `Engine.submit` (the
scheduler's threads) and `flide serve` over HTTP, one request at a time.

    python benchmarks/serve_overhead.py                                   # tiny model, tiny tokenizer, RACE if found
    python benchmarks/serve_overhead.py --tokenizer shared/models/qwen3_5 --data shared/data --requests 200

The forward pass is a stub that returns zero scores of the round's shape at once (`Engine.forward`, the eager path:
this runs anywhere, and on a GPU machine times the host work without the device), so what is left is rendering and
tokenizing, the round's layout and build, answers, the scheduler's thread hand-offs and, over HTTP, the server
(uvicorn, JSON, body checks, the event loop's hand-offs) and the client. Issue 4 asks one client within 1.5 ms of
the in-process latency: `http - decide` here is that gap's host part (the H200 host measured 1.9-2.4 ms with the
model). The server runs in a subprocess of this script (`--serve PORT`: the same stub engine), the client is the
benchmark's own keep-alive client (flide/bench/loadgen.py). Medians over `--requests` requests, cycling through the
workload, after `--warmup` of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flide  # noqa: E402
from flide import workloads  # noqa: E402


def stub_engine(tokenizer_path: str | None, overlap: bool = True, device_ms: float = 0.0) -> flide.Engine:
    """An engine on the tiny Qwen3.5 whose forward pass returns zero scores of the round's shape at once, or after
    `device_ms` of sleep per round (the GIL released, as while a GPU runs the round)."""
    from flide.loading import load_tokenizer
    from flide.models.tiny import tiny_model, tiny_tokenizer

    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else tiny_tokenizer()
    model = tiny_model("qwen3_5_text", vocab_size=max(len(tokenizer), 1024)) if tokenizer_path else \
        tiny_model("qwen3_5_text")
    engine = flide.Engine(model, tokenizer, {"runtime": {"graphs": "off", "piece_cache_chars": 0,
                                                         "question_cache_entries": 0},
                                             "serve": {"overlap_rounds": overlap}})
    def forward(round_, checkpoints=None):
        if device_ms:
            time.sleep(device_ms / 1e3)
        return torch.zeros(round_.tensors.option_index.shape)

    engine.forward = forward
    return engine


def requests_of(data: str | None, count: int) -> list[dict]:
    if workloads.data_available(data):
        return workloads.race(limit=count, folder=data)
    from flide.testing import random_request

    import random

    rng = random.Random(0)
    return [random_request(rng, max_questions=4, max_words=200) for _ in range(count)]


def median_ms(fn, items: list, repeats: int, warmup: int) -> float:
    times = []
    for n in range(warmup + repeats):
        item = items[n % len(items)]
        start = time.perf_counter()
        fn(item)
        if n >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def serve(port: int, tokenizer_path: str | None, device_ms: float, switch_interval_ms: float | None) -> None:
    from flide.serve.app import create_app, run_server

    from flide.serve.logs import setup_logging

    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1e3)
    setup_logging("json")  # the request log on stderr (a file): the endpoint's own ms per request
    run_server(create_app(stub_engine(tokenizer_path, device_ms=device_ms)), port=port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the tiny tokenizer)")
    parser.add_argument("--data", default=None, help="the data folder holding race/ (default: ../shared/data)")
    parser.add_argument("--requests", type=int, default=200, help="timed requests per path")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="the stub's time per round, GIL released (stands in for the GPU; 0: none)")
    parser.add_argument("--clients", type=int, nargs="*", default=[],
                        help="also closed-loop HTTP throughput with this many clients (req/s, p50, p99)")
    parser.add_argument("--seconds", type=float, default=8.0, help="per --clients level")
    parser.add_argument("--switch-interval-ms", type=float, nargs="*", default=[None],
                        help="the server's sys.setswitchinterval (default: Python's 5 ms); several: one server each")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server subprocess
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.tokenizer, args.device_ms, args.switch_interval_ms[0])
        return
    from flide.bench.loadgen import Connection, closed_loop, post
    from flide.bench.server import free_port

    pool = requests_of(args.data, 32)
    bodies = [json.dumps(r).encode() for r in pool]
    results, throughput = {}, {}
    engine = stub_engine(args.tokenizer, device_ms=args.device_ms)
    results["decide"] = median_ms(engine.decide, pool, args.requests, args.warmup)
    results["prepare"] = median_ms(engine.prepare, pool, args.requests, args.warmup)
    for overlap in (False, True):
        engine = stub_engine(args.tokenizer, overlap, args.device_ms)
        results[f"submit (overlap_rounds {str(overlap).lower()})"] = median_ms(
            lambda r: engine.submit(r).result(), pool, args.requests, args.warmup)
        engine.scheduler().stop()
    for interval in args.switch_interval_ms:
        label = "" if interval is None else f", switch interval {interval:g} ms"
        port = free_port()
        command = [sys.executable, __file__, "--serve", str(port), "--device-ms", str(args.device_ms)] + \
            (["--tokenizer", args.tokenizer] if args.tokenizer else []) + \
            (["--switch-interval-ms", str(interval)] if interval is not None else [])
        log = tempfile.TemporaryFile()
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.time() + 120
            while True:
                try:
                    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                            f"http://127.0.0.1:{port}/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    if server.poll() is not None or time.time() > deadline:
                        log.seek(0)
                        raise SystemExit(f"the server did not start: {log.read().decode()[-2000:]}")
                    time.sleep(0.2)
            connection = Connection("127.0.0.1", port, timeout=30)

            def over_http(body: bytes) -> None:
                status, _ = post(connection, body)
                if status != 200:
                    raise SystemExit(f"HTTP {status}")

            results[f"http{label}"] = median_ms(over_http, bodies, args.requests, args.warmup)
            connection.close()
            log.seek(0)
            inside = [json.loads(line)["ms"] for line in log.read().decode().splitlines()
                      if line.startswith("{") and '"msg": "request"' in line]
            results[f"  of which inside the endpoint{label}"] = statistics.median(inside[args.warmup:])
            for clients in args.clients:
                run = closed_loop(f"http://127.0.0.1:{port}", bodies, clients, args.seconds)
                lat = sorted(run.latencies_ms)
                throughput[f"{clients} clients{label}"] = (
                    run.answered / run.seconds, lat[len(lat) // 2] if lat else float("nan"),
                    lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan"), run.error_count)
        finally:
            server.terminate()
            server.wait(30)
            log.close()
    kind = "RACE" if workloads.data_available(args.data) else "random"
    print(f"host path of one request at a time, model forward stubbed ({len(pool)} {kind} requests, "
          f"{args.device_ms:g} ms of device time per round; median ms):")
    for name, value in results.items():
        print(f"  {name:44s} {value:7.3f}")
    for name, value in results.items():
        if name.startswith("http") and "inside" not in name:
            print(f"  {name + ' - decide':44s} {value - results['decide']:7.3f}")
    if throughput:
        print("closed-loop HTTP clients: req/s, p50 ms, p99 ms, errors")
        for name, (rate, p50, p99, errors) in throughput.items():
            print(f"  {name:44s} {rate:8.1f} {p50:8.2f} {p99:8.2f} {errors}")

if __name__ == "__main__":
    main()
