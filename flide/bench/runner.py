"""Runs a benchmark grid and writes its results: `python -m flide.bench CONFIG.yaml [--out DIR] [--workloads ...]`.

For every model of the config (random weights in the model's real shapes, or a tiny in-code model), every workload
and every engine (+ one `flide:<name>` per ablation), it measures:

- `latency_p50_ms`, `latency_p90_ms` (ms): one request alone (`decide([r])`): the first `latency_requests` requests,
  each `repeats` times, after `warmup` untimed runs;
- `tokens_per_request` (tokens): what the model computes per request (mean): Flide and prefix-cache count each
  state once, the pipeline one whole prompt per question, the delimiter baseline adds one token per question;
- `requests_per_s@N` (requests/s): N in-process submitter threads, each calling `decide([r])` on the next request
  (cycling through the workload) until `throughput_seconds` have passed; completed requests / time until the last
  one finished. Skipped (value null, the reason in `unit`) when N x the median latency alone exceeds
  `max_throughput_seconds`: the run waits for every request in flight, and a device runs them mostly one by one;
- `latency_p50_ms@N` (ms): the median request latency inside that run;
- `peak_memory_gib` (GiB): `torch.cuda.max_memory_allocated` over the engine's runs of the workload, weights included
  (CUDA only);

plus, per workload (engine `-`): requests, questions_per_request, state_tokens_per_request. Sweep workloads
(`sweep/q<n>`) are measured alone only (their point is latency against the question count). A cell that fails (an
exception, out of memory) becomes a row with metric `error`, value null and the error in `unit`, and the grid goes on.

Concurrency is in-process: no batching of concurrently submitted requests, for any engine (Flide included: each
thread's `decide([r])` is its own round; `flide serve` is what packs concurrent requests into shared rounds). Threads
share the model; each tokenizes with its own tokenizer copy (at most `TOKENIZER_COPIES`, then shared under a lock).

Writes `<results_dir>/<name>.json` (a list of rows {workload, model, engine, metric, value, unit, hardware, commit}),
`<name>.md` (tables) and `<name>.png` (when matplotlib is installed: `pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import logging
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .config import REPO, TINY_PREFIX, BenchConfig, load_bench_config

logger = logging.getLogger("flide.bench")

ROW_KEYS = ("workload", "model", "engine", "metric", "value", "unit", "hardware", "commit")
TOKENIZER_COPIES = 8  # tokenizer copies for submitter threads (each copy of the real Qwen3.5 one takes seconds)


# ---- setup ----
def git_commit() -> str:
    """`git rev-parse --short HEAD` of the repository ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def hardware_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os

    return f"cpu {platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def load_model(spec: str, config: BenchConfig):
    """(model, tokenizer, row name) of a model spec: "tiny:<model_type>" or a config json (random weights)."""
    import torch

    from ..loading import load_tokenizer, pick_device, random_model

    dtype = getattr(torch, config.dtype)
    device = pick_device(config.device)
    if spec.startswith(TINY_PREFIX):
        from ..models.tiny import tiny_model, tiny_tokenizer

        model_type = spec[len(TINY_PREFIX):]
        model = tiny_model(model_type, seed=config.seed).to(device=device, dtype=dtype).eval()
        return model, tiny_tokenizer(), f"tiny-{model_type}"
    model = random_model(spec, dtype=dtype, device=str(device), seed=config.seed)
    return model, load_tokenizer(config.tokenizer), Path(spec).stem


class TokenizerPool:
    """Copies of a tokenizer for submitter threads, made on first need and shared by every engine of a model."""

    def __init__(self, tokenizer, size: int = TOKENIZER_COPIES):
        self.tokenizer, self.size, self.copies = tokenizer, size, []

    def get(self, n: int) -> list:
        n = min(n, self.size)
        while len(self.copies) < n:
            self.copies.append(copy.deepcopy(self.tokenizer))
        return self.copies[:n]


# ---- measurements ----
class Timer:
    def __init__(self, device):
        import torch

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Wall time of fn() in ms, the device synchronised before and after."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - start) * 1e3


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def throughput(engines: list, requests: list[dict], threads: int, seconds: float, timer: Timer) -> tuple[float, float]:
    """(requests/s, median latency ms) of `threads` submitters calling decide([r]) until `seconds` have passed.
    Thread i uses engines[i % len(engines)]."""
    lock = threading.Lock()
    state = {"next": 0, "latencies": [], "error": None}
    start_gate = threading.Barrier(threads + 1)
    deadline = [0.0]

    def submit(engine):
        start_gate.wait()
        while time.perf_counter() < deadline[0] and state["error"] is None:
            with lock:
                request = requests[state["next"] % len(requests)]
                state["next"] += 1
            try:
                t0 = time.perf_counter()
                engine.decide([request])
                elapsed = (time.perf_counter() - t0) * 1e3
            except BaseException as error:  # noqa: BLE001: re-raised in the caller
                state["error"] = error
                return
            with lock:
                state["latencies"].append(elapsed)

    workers = [threading.Thread(target=submit, args=(engines[i % len(engines)],), daemon=True)
               for i in range(threads)]
    for worker in workers:
        worker.start()
    timer.sync()
    begin = time.perf_counter()
    deadline[0] = begin + seconds
    start_gate.wait()
    for worker in workers:
        worker.join()
    timer.sync()
    total = time.perf_counter() - begin
    if state["error"] is not None:
        raise state["error"]
    done = state["latencies"]
    return len(done) / total, (statistics.median(done) if done else float("nan"))


def measure(engine, requests: list[dict], config: BenchConfig, timer: Timer, pool: TokenizerPool | None,
            alone_only: bool, device) -> list[tuple[str, float | None, str]]:
    """(metric, value, unit) of one engine on one workload."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    out = [("tokens_per_request", statistics.mean(engine.tokens(r) for r in requests), "tokens")]
    for _ in range(config.warmup):
        engine.decide([requests[0]])
    samples = [timer(lambda r=r: engine.decide([r])) for r in requests[: config.latency_requests]
               for _ in range(config.repeats)]
    alone = statistics.median(samples)
    out += [("latency_p50_ms", alone, "ms"), ("latency_p90_ms", percentile(samples, 0.9), "ms")]
    if not alone_only:
        for n in config.concurrency:
            estimate = n * alone / 1e3
            if estimate > config.max_throughput_seconds:
                out.append((f"requests_per_s@{n}", None, f"skipped: {n} x {alone:.0f} ms alone = {estimate:.0f} s "
                                                         f"> max_throughput_seconds {config.max_throughput_seconds:g}"))
                continue
            clones = [engine.for_thread(tok) for tok in pool.get(n)] if pool is not None else [engine]
            rps, p50 = throughput(clones, requests, n, config.throughput_seconds, timer)
            out += [(f"requests_per_s@{n}", rps, "requests/s"), (f"latency_p50_ms@{n}", p50, "ms")]
            del clones
    if cuda:
        out.append(("peak_memory_gib", torch.cuda.max_memory_allocated(device) / 2**30, "GiB"))
    return out


def describe(requests: list[dict], tokenizer) -> list[tuple[str, float, str]]:
    """Engine-independent facts of a workload: requests, questions and state tokens per request."""
    from transformers.decision import DecisionConfig

    from ..requests import PromptTokenizer, parse_request

    config = DecisionConfig()
    prompts = PromptTokenizer(tokenizer, config, "split")
    states, questions = [], []
    for request in requests:
        state, parsed = parse_request(request, config, 64)
        prepared = prompts.prepare(state, parsed)
        states.append(statistics.mean(len(t) for t in prepared.trunks))
        questions.append(len(parsed))
    return [("requests", len(requests), "requests"), ("questions_per_request", statistics.mean(questions), "questions"),
            ("state_tokens_per_request", statistics.mean(states), "tokens")]


def run(config: BenchConfig, workloads: list[str] | None = None, engines: list[str] | None = None,
        commit: str | None = None, log: Callable[[str], None] | None = None) -> list[dict]:
    """Runs the grid (optionally only some workloads / engines) and returns its rows."""
    import torch

    from . import workloads as named
    from .engines import make_engine

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    threads_before = torch.get_num_threads()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    try:
        commit = commit or git_commit()
        workload_names = [w for w in config.workloads if workloads is None or w in workloads]
        engine_names = [e for e in config.engine_names() if engines is None or e in engines]
        rows: list[dict] = []
        for spec in config.models:
            model, tokenizer, model_name = load_model(spec, config)
            device = next(model.parameters()).device
            hardware = hardware_name(device)
            timer = Timer(device)

            def add(workload, engine, metric, value, unit):
                rows.append(dict(zip(ROW_KEYS, (workload, model_name, engine, metric, value, unit, hardware, commit))))

            from transformers.decision import DecisionConfig

            from ..requests import PromptTokenizer

            PromptTokenizer(tokenizer, DecisionConfig())  # adds the decision sentinels before any copy is made
            built: dict[str, list[dict]] = {}
            for name in workload_names:
                built.update(named.build(name, tokenizer, config.limit(name), config.options(name), config.data_dir))
            for workload, requests in built.items():
                for metric, value, unit in describe(requests, tokenizer):
                    add(workload, "-", metric, value, unit)
            pool = TokenizerPool(tokenizer) if any(n > 1 for n in config.concurrency) else None
            for engine_name in engine_names:
                log(f"[{model_name}] building engine {engine_name}")
                engine = make_engine(engine_name, model, tokenizer, config)
                for workload, requests in built.items():
                    start = time.perf_counter()
                    try:
                        results = measure(engine, requests, config, timer, pool, workload.startswith("sweep/"),
                                          device)
                    except Exception as error:  # noqa: BLE001: one failing cell must not lose the grid
                        logger.exception("%s / %s / %s failed", model_name, engine_name, workload)
                        add(workload, engine_name, "error", None, f"{type(error).__name__}: {error}"[:500])
                        log(f"[{model_name}] {engine_name:14} {workload:10} FAILED: {type(error).__name__}: {error}")
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    for metric, value, unit in results:
                        add(workload, engine_name, metric, value, unit)
                    summary = ", ".join(f"{m} {v:.4g}" for m, v, _ in results
                                        if v is not None and m.startswith(("latency_p50_ms", "requests_per_s")))
                    log(f"[{model_name}] {engine_name:14} {workload:10} {time.perf_counter() - start:6.1f}s  {summary}")
                del engine
                gc.collect()
            del model, pool
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return rows
    finally:
        torch.set_num_threads(threads_before)


# ---- results ----
def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """The old rows with every (workload, model, engine) cell measured anew replaced by the new rows."""
    cells = {(r["workload"], r["model"], r["engine"]) for r in new}
    return [r for r in old if (r["workload"], r["model"], r["engine"]) not in cells] + new


def write_results(rows: list[dict], config: BenchConfig, out_dir: str | Path | None = None,
                  merge: bool = False) -> dict[str, Path]:
    """Writes <name>.json, <name>.md and (matplotlib installed) <name>.png; returns their paths."""
    from .report import markdown, plot

    folder = Path(out_dir or config.results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / f"{config.name}.json", "md": folder / f"{config.name}.md"}
    if merge and paths["json"].exists():
        rows = merge_rows(json.loads(paths["json"].read_text(encoding="utf-8")), rows)
    paths["json"].write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    paths["md"].write_text(markdown(rows, config), encoding="utf-8")
    png = folder / f"{config.name}.png"
    if plot(rows, config, png):
        paths["png"] = png
    return paths


def main(argv: list[str] | None = None) -> int:
    """`python -m flide.bench CONFIG.yaml` (and `flide bench CONFIG.yaml`)."""
    parser = argparse.ArgumentParser(prog="flide bench", description="Runs a YAML-configured benchmark grid "
                                     "(configs/bench/) and writes JSON, markdown and a plot of its results.")
    parser.add_argument("config", help="benchmark config YAML (configs/bench/*.yaml)")
    parser.add_argument("--out", help="results folder (default: the config's results_dir, benchmarks/results)")
    parser.add_argument("--workloads", nargs="+", help="run only these workloads of the config")
    parser.add_argument("--engines", nargs="+", help="run only these engines of the config (flide:<ablation> too)")
    parser.add_argument("--merge", action="store_true",
                        help="merge into existing results (default when --workloads or --engines is given)")
    parser.add_argument("--commit", help="the commit recorded in each row (default: git rev-parse --short HEAD)")
    parser.add_argument("--dry-run", action="store_true", help="print the grid and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_bench_config(args.config)
        for flag, given, valid in (("--workloads", args.workloads, config.workloads),
                                   ("--engines", args.engines, config.engine_names())):
            unknown = [v for v in given or [] if v not in valid]
            if unknown:
                raise ValueError(f"{flag}: {', '.join(unknown)} not in the config; it has: {', '.join(valid)}.")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    workloads = args.workloads or list(config.workloads)
    engines = args.engines or config.engine_names()
    print(f"{config.name}: models {', '.join(config.models)}\n  workloads {', '.join(workloads)}\n"
          f"  engines {', '.join(engines)}\n  concurrency {', '.join(map(str, config.concurrency))}; {config.dtype} on "
          f"{config.device}", file=sys.stderr)
    if args.dry_run:
        return 0
    start = time.perf_counter()
    rows = run(config, args.workloads, args.engines, commit=args.commit)
    paths = write_results(rows, config, args.out, merge=args.merge or bool(args.workloads or args.engines))
    print(f"done in {time.perf_counter() - start:.0f} s ({datetime.datetime.now():%Y-%m-%d %H:%M}): "
          f"{', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    errors = [r for r in rows if r["metric"] == "error"]
    if errors:
        print(f"{len(errors)} cell(s) failed: see the rows with metric `error`.", file=sys.stderr)
    return 1 if errors else 0
