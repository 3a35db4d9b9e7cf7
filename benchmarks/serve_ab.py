"""A/B of `flide serve` settings on one machine: one server per variant (started together, the same model and
requests), then closed-loop HTTP clients against each in turn, the variants interleaved over `--rounds` so that a
drift of the machine hits them alike. Cheaper than one `flide bench` http run per variant: no in-process twin, no
answer check, the servers' start-ups overlap.

    python benchmarks/serve_ab.py --model shared/models/qwen3_5/configs/qwen3.5-0.8b.json \\
        --tokenizer shared/models/qwen3_5 --data shared/data --clients 1 32 \\
        --variant base= --variant no-launch-ahead=serve.launch_ahead=false --out /tmp/ab

A variant is NAME=[KEY=VALUE,...] over the base config (`--base` YAML, else bf16 on cuda with the piece and question
caches off, as the benchmarks run); values are YAML scalars. Output: a markdown table of requests/s, p50 and p99 per
variant and client count (medians over the rounds; the ratio to the first variant), each server's request-log phases
at one client (benchmarks/http_phases.py), and the rounds launched ahead (its /metrics). The servers' logs stay in
--out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.http_phases import phases  # noqa: E402
from flide.bench.config import merge_overrides  # noqa: E402
from flide.bench.loadgen import closed_loop  # noqa: E402
from flide.bench.server import free_port, prometheus_samples, serve_command, wait_healthy  # noqa: E402


def split_top_level(text: str) -> list[str]:
    """Splits at the commas outside brackets: 'a=[1, 2],b=x' -> ['a=[1, 2]', 'b=x']."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def parse_variant(text: str) -> tuple[str, dict]:
    """'name=a.b=1,c.d=[1, 2]' -> ('name', {'a': {'b': 1}, 'c': {'d': [1, 2]}}) (values are YAML)."""
    name, _, assignments = text.partition("=")
    if not name:
        raise ValueError(f"--variant {text!r}: give it a name, NAME=[KEY=VALUE,...]")
    overrides: dict = {}
    for item in filter(None, split_top_level(assignments)):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        *parents, leaf = key.split(".")
        node = overrides
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return name, overrides


def log_lines(path: Path) -> list[str]:
    with open(path, errors="replace") as log:
        return [line for line in log if line.startswith("{")]


def start_server(name: str, config: dict, args, folder: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    config_path, log_path = folder / f"{name}.yaml", folder / f"{name}.log"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    # the benchmark's own launcher: the server goes when this script goes, even on kill -9
    command = serve_command(config_path, port, args.model, args.tokenizer)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}", log_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a model config JSON (random weights) or checkpoint")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--data", default="shared/data")
    parser.add_argument("--workload", default="race", help="a flide.workloads name (its requests)")
    parser.add_argument("--limit", type=int, default=64, help="requests of the workload, cycled by the clients")
    parser.add_argument("--variant", action="append", required=True, help="NAME=[KEY=VALUE,...]; the first is the "
                                                                          "baseline of the ratios")
    parser.add_argument("--base", help="a Flide YAML config under every variant")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every variant and level")
    parser.add_argument("--startup-timeout", type=float, default=400.0)
    parser.add_argument("--out", required=True, help="a folder: the table (serve_ab.md), JSON and server logs")
    args = parser.parse_args()

    from flide import workloads

    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(Path(args.base).read_text()) if args.base else {
        "runtime": {"dtype": "bfloat16", "device": "cuda", "piece_cache_chars": 0, "question_cache_entries": 0}}
    variants = [parse_variant(v) for v in args.variant]
    requests = getattr(workloads, args.workload)(limit=args.limit, folder=args.data)
    bodies = [json.dumps(r) for r in requests]
    servers = {}
    try:
        for name, overrides in variants:
            servers[name] = start_server(name, merge_overrides(base, overrides), args, folder)
        started = time.time()
        for name, (process, url, log_path) in servers.items():
            wait_healthy(process, url, log_path, args.startup_timeout - (time.time() - started), "--startup-timeout")
        print(f"{len(servers)} servers healthy after {time.time() - started:.0f} s", flush=True)
        rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        one_client: dict[str, list[str]] = {}  # each server's request-log lines of its one-client runs
        for r in range(args.rounds):
            for clients in args.clients:
                for name, (process, url, log_path) in servers.items():
                    before = log_lines(log_path)
                    result = closed_loop(url, bodies, clients, args.seconds)
                    if clients == 1:
                        time.sleep(0.2)  # the last request's log line
                        one_client.setdefault(name, []).extend(log_lines(log_path)[len(before):])
                    rows.setdefault((name, clients), []).append(
                        (result.requests_per_s, result.percentile(0.5), result.percentile(0.99)))
                    print(f"round {r} {name:16s} {clients:3d} clients: {result.requests_per_s:7.1f} req/s, "
                          f"p50 {result.percentile(0.5):.2f} ms, errors {result.describe_errors()}", flush=True)
        launched = {name: prometheus_samples(url).get(("flide_rounds_launched_ahead_total", ""))
                    for name, (_, url, _) in servers.items()}
    finally:
        for process, _, _ in servers.values():
            process.terminate()
        for process, _, _ in servers.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    first = variants[0][0]
    lines = [f"# serve A/B ({args.workload}, {len(requests)} requests, {args.seconds:g} s a level, "
             f"{args.rounds} rounds, medians)", "", "| variant | clients | requests/s | ratio | p50 ms | p99 ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    table = {}
    for (name, clients), values in rows.items():
        rps, p50, p99 = (statistics.median(v[k] for v in values) for k in range(3))
        table[(name, clients)] = rps
        ratio = rps / table[(first, clients)] if (first, clients) in table else float("nan")
        lines.append(f"| {name} | {clients} | {rps:.1f} | {ratio:.3f} | {p50:.2f} | {p99:.2f} |")
    lines += ["", "Request-log phases at one client (medians, ms), rounds launched ahead (whole run):", ""]
    for name in servers:
        lines.append(f"- {name}: {phases(one_client.get(name, []))}; launched ahead {launched.get(name)}")
    text = "\n".join(lines) + "\n"
    (folder / "serve_ab.md").write_text(text)
    (folder / "serve_ab.json").write_text(json.dumps({f"{n}@{c}": v for (n, c), v in rows.items()}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
