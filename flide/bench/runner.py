"""Runs a benchmark grid and writes its results: `python -m flide.bench CONFIG.yaml [--out DIR] [--workloads ...]`.

For every model of the config (random weights in the model's real shapes, or a tiny in-code model), every workload
and every engine (+ one `flide:<name>` per ablation), it measures:

- `latency_p50_ms`, `latency_p90_ms` (ms): one request alone (`decide([r])`): the first `latency_requests` requests,
  each `repeats` times, after `warmup` untimed runs; once the samples took `max_latency_seconds` (and at least
  `repeats` were taken) the rest are skipped, and the unit says over how many samples (`ms (n=5)`);
- `prepare_p50_ms` (ms, Flide engines, in process): `Engine.prepare` alone on the same requests (validating,
  rendering, tokenizing): the host's part of latency alone before the round;
- `latency_submit_p50_ms` (ms, Flide engines, in process): the same requests alone through `Engine.submit` (the
  scheduler's path, which `flide serve` takes), so that the HTTP engine's latency alone splits into server and
  scheduler;
- `tokens_per_request` (tokens): what the model computes per request (mean): Flide and prefix-cache count each
  state once, the pipeline one whole prompt per question, the delimiter baseline adds one token per question;
- `requests_per_s@N` (requests/s): N in-process submitter threads, each calling `decide([r])` on the next request
  (cycling through the workload) until `throughput_seconds` have passed; completed requests / time until the last
  one finished. Skipped (value null, the reason in `unit`) when N x the median latency alone exceeds
  `max_throughput_seconds`: the run waits for every request in flight, and a device runs them mostly one by one;
- `latency_p50_ms@N` (ms): the median request latency inside that run;
- `peak_memory_gib` (GiB): `torch.cuda.max_memory_allocated` over the engine's runs of the workload, weights included
  (CUDA only); `peak_reserved_gib`: `torch.cuda.max_memory_reserved` over them: what the process holds from the GPU,
  the captured graphs' memory pools included (issue 8's memory goal is about this one);

plus, per workload (engine `-`): requests, questions_per_request, state_tokens_per_request. Sweep workloads
(`sweep/q<n>`) are measured alone only (their point is latency against the question count). A cell that fails (an
exception, out of memory) becomes a row with metric `error`, value null and the error in `unit`, and the grid goes on.

Concurrency is in-process. Flide's submitter threads go through `Engine.submit`, whose scheduler packs the requests
that wait into shared rounds (what `flide serve` does with concurrent clients); the baselines have no such batching:
each thread's call is its own forward. Threads share the model; each tokenizes with its own tokenizer copy (at most
`TOKENIZER_COPIES`, then shared under a lock).

The `http` engine is the exception: it starts `flide serve` (server.py) with the same model and measures, on the
workloads of `http.workloads`:
- `http_max_abs_diff`: the first `http.check_requests` requests answered over HTTP and by an in-process Flide engine
  (each alone): the largest probability difference (the cell fails above `http.check_atol`);
- `tokens_per_request`, `latency_p50_ms`, `latency_p90_ms`: as above, each request posted alone by one client;
- `latency_inprocess_p50_ms`, `latency_http_gap_p50_ms`: the same requests alone through the in-process twin engine
  (`decide`) and over HTTP, each pair timed back to back: the twin's median and the median of the pairs' differences
  (the one-client cost of the server; drift on the machine cancels);
- per level N of `http.concurrency` (default `concurrency`): N closed-loop HTTP clients (loadgen.py: keep-alive
  connection each, spread over processes) for `http.seconds` (default `throughput_seconds`): `requests_per_s@N`,
  `latency_p50_ms@N`, `latency_p99_ms@N` (of answered requests), `errors@N` (non-200 answers and failed connections,
  by kind in `unit`), `answered@N`, `mean_round_requests@N` (the server's rounds meanwhile, from /metrics),
  `launched_ahead_share@N` (of those rounds, the share whose replay was enqueued before the device finished the one
  before: serve.launch_ahead) and `client_cpu_share@N` (near 1: the client side may have capped the rate). The
  skip rule above applies too.
The server always stops (SIGINT, then SIGKILL) when the engine is done, also after a failure.

`mode: fidelity` configs run `fidelity.run` instead (answers against a float32 reference; see fidelity.py).

Writes `<results_dir>/<name>.json` (a list of rows {workload, model, engine, metric, value, unit, hardware, commit}),
`<name>.md` (tables) and `<name>.png` (when matplotlib is installed: `pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .config import REPO, TINY_PREFIX, BenchConfig, load_bench_config
from .loadgen import percentile

logger = logging.getLogger("flide.bench")

ROW_KEYS = ("workload", "model", "engine", "metric", "value", "unit", "hardware", "commit")
TOKENIZER_COPIES = 8  # tokenizer copies for submitter threads (each copy of the real Qwen3.5 one takes seconds)


# ---- setup ----
def git_commit() -> str:
    """`git rev-parse --short HEAD` of the repository ("unknown" outside a git checkout), or $FLIDE_COMMIT when set:
    a copied working tree (the device machine's) can carry a stale .git whose HEAD is not the tree that runs."""
    if os.environ.get("FLIDE_COMMIT"):
        return os.environ["FLIDE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10, check=False)
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
    """(model, tokenizer, row name) of a model spec: "tiny:<model_type>" or a config json (random weights), with the
    final norm's gain scaled by `final_norm_scale` when the config sets it."""
    import torch

    from ..loading import load_tokenizer, pick_device, random_model

    dtype = getattr(torch, config.dtype)
    device = pick_device(config.device)
    if spec.startswith(TINY_PREFIX):
        from ..models.tiny import tiny_model, tiny_tokenizer

        model_type = spec[len(TINY_PREFIX):]
        model = tiny_model(model_type, seed=config.seed).to(device=device, dtype=dtype).eval()
        tokenizer, name = tiny_tokenizer(), f"tiny-{model_type}"
    else:
        model = random_model(spec, dtype=dtype, device=str(device), seed=config.seed)
        tokenizer, name = load_tokenizer(config.tokenizer), Path(spec).stem
    if config.final_norm_scale not in (None, 1.0, "auto"):  # auto: fidelity.run picks it once the model is built
        FinalNormScale(model).set(config.final_norm_scale)
    return model, tokenizer, name


class FinalNormScale:
    """Scales the gain of a model's final norm (the norm right before the head) by a factor, so every logit is
    multiplied by it: random weights answer almost uniformly; a larger gain makes them answer like a trained model
    does, with one option clearly on top. Works for both RMSNorm forms (`x * w`, and Qwen3.5's `x * (1 + w)`): the
    form is found by probing the norm, and `set` checks that the output scaled as asked."""

    def __init__(self, model):
        import torch

        from ..models.causal_lm import text_model_of

        self.norm = getattr(text_model_of(model), "norm", None)
        weight = getattr(self.norm, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            raise TypeError(f"final_norm_scale: {type(model).__name__} has no final norm with a weight "
                             f"(text model `.norm.weight`).")
        self.weight = weight
        self.original = weight.detach().clone()
        probe = torch.randn(2, weight.shape[-1], dtype=torch.float32, device=weight.device).to(weight.dtype)
        with torch.no_grad():
            self.reference = self.norm(probe).float()
            weight.zero_()
            self.offset = bool(self.norm(probe).float().abs().max() > 0)  # x * (1 + w): zero weights keep the input
            weight.copy_(self.original)
        self.probe = probe

    def set(self, scale: float) -> None:
        """The gain becomes `scale` x the original one (scale 1 restores the original weights)."""
        import torch

        with torch.no_grad():
            original = self.original.float()
            gain = scale * ((1 + original) if self.offset else original)
            self.weight.copy_((gain - 1) if self.offset else gain)
            got = self.norm(self.probe).float()
        tol = 1e-4 if self.weight.dtype == torch.float32 else 2e-2
        if not torch.allclose(got, scale * self.reference, rtol=tol, atol=tol * float(self.reference.abs().max())):
            raise RuntimeError(f"final_norm_scale {scale:g}: the final norm's output did not scale by it "
                               f"({type(self.norm).__name__}, offset form {self.offset}).")


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
            except BaseException as error:  # noqa: BLE001 (re-raised in the caller)
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


def latency_alone(engine, requests: list[dict], config: BenchConfig, timer: Timer):
    """One request at a time after `warmup` untimed runs: (median ms, its latency rows)."""
    for _ in range(config.warmup):
        engine.decide([requests[0]])
    planned = [r for r in requests[: config.latency_requests] for _ in range(config.repeats)]
    samples: list[float] = []
    for request in planned:
        if len(samples) >= config.repeats and sum(samples) / 1e3 > config.max_latency_seconds:
            break
        samples.append(timer(lambda r=request: engine.decide([r])))
    alone = statistics.median(samples)
    unit = "ms" if len(samples) == len(planned) else f"ms (n={len(samples)})"
    return alone, [("latency_p50_ms", alone, unit), ("latency_p90_ms", percentile(samples, 0.9), unit)]


def prepare_alone(engine, requests: list[dict], config: BenchConfig) -> float:
    """Median ms of preparing each latency request alone (`engine.prepare_alone`: validating, rendering,
    tokenizing), as often as latency alone runs it: host work only, no device synchronisation around it."""
    samples = []
    for request in [r for r in requests[: config.latency_requests] for _ in range(config.repeats)]:
        start = time.perf_counter()
        engine.prepare_alone(request)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def paired_latency(engine, local, requests: list[dict], config: BenchConfig, timer: Timer) -> tuple[float, float]:
    """The same requests alone through `engine` (the server, over HTTP) and `local` (its in-process twin), each timed
    request right after the other, so that drift on the machine cancels: (median ms of `local`, median of the paired
    differences engine - local). Issue 4 asks one HTTP client within 1.5 ms of the in-process latency."""
    local.decide([requests[0]])
    pairs = []
    for request in [r for r in requests[: config.latency_requests] for _ in range(config.repeats)]:
        over_http = timer(lambda r=request: engine.decide([r]))
        in_process = timer(lambda r=request: local.decide([r]))
        pairs.append((in_process, over_http - in_process))
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def measure(engine, requests: list[dict], config: BenchConfig, timer: Timer, pool: TokenizerPool | None,
            alone_only: bool, device) -> list[tuple[str, float | None, str]]:
    """(metric, value, unit) of one engine on one workload."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    out = [("tokens_per_request", statistics.mean(engine.tokens(r) for r in requests), "tokens")]
    alone, rows = latency_alone(engine, requests, config, timer)
    out += rows
    if hasattr(engine, "prepare_alone"):  # Flide in process: the host's share of latency alone
        out.append(("prepare_p50_ms", prepare_alone(engine, requests, config), "ms"))
    if not alone_only and getattr(engine, "packs_rounds", False) and pool is not None:
        submitted, _ = latency_alone(engine.for_thread(pool.get(1)[0]), requests, config, timer)
        out.append(("latency_submit_p50_ms", submitted, "ms"))
    if not alone_only:
        for n in config.concurrency:
            estimate = n * alone / 1e3
            if estimate > config.max_throughput_seconds:
                out.append((f"requests_per_s@{n}", None, (f"skipped: {n} x {alone:.0f} ms alone = {estimate:.0f} s "
                                                          f"> max_throughput_seconds {config.max_throughput_seconds:g}")))
                continue
            clones = [engine.for_thread(tok) for tok in pool.get(n)] if pool is not None else [engine]
            rps, p50 = throughput(clones, requests, n, config.throughput_seconds, timer)
            out += [(f"requests_per_s@{n}", rps, "requests/s"), (f"latency_p50_ms@{n}", p50, "ms")]
            del clones
    if cuda:
        out.append(("peak_memory_gib", torch.cuda.max_memory_allocated(device) / 2**30, "GiB"))
        out.append(("peak_reserved_gib", torch.cuda.max_memory_reserved(device) / 2**30, "GiB"))
    return out


def describe(requests: list[dict], tokenizer) -> list[tuple[str, float, str]]:
    """Engine-independent facts of a workload: requests, questions and state tokens per request."""
    from transformers.decision import DecisionConfig

    from ..requests import PromptTokenizer, parse_request

    config = DecisionConfig()
    prompts = PromptTokenizer(tokenizer, config)
    states, questions = [], []
    for request in requests:
        state, parsed = parse_request(request, config, 64)
        prepared = prompts.prepare(state, parsed)
        states.append(statistics.mean(len(t) for t in prepared.trunks))
        questions.append(len(parsed))
    return [("requests", len(requests), "requests"), ("questions_per_request", statistics.mean(questions), "questions"),
            ("state_tokens_per_request", statistics.mean(states), "tokens")]


def measure_http(engine, requests: list[dict], config: BenchConfig, timer: Timer, alone_only: bool,
                 log: Callable[[str], None]) -> list[tuple[str, float | None, str]]:
    """(metric, value, unit) of the http engine on one workload (see the module docstring)."""
    options = config.http
    out: list[tuple[str, float | None, str]] = [("tokens_per_request", statistics.mean(engine.tokens(r)
                                                                                      for r in requests), "tokens")]
    sample = requests[:options.check_requests]
    if sample:
        difference, atol = engine.check(sample), options.atol(config.dtype)
        if difference > atol:
            raise AssertionError(f"answers over HTTP differ from the in-process engine's by {difference:.3g} > "
                                 f"http.check_atol {atol:g} ({len(sample)} requests)")
        out.append(("http_max_abs_diff", difference, "probability"))
    alone, rows = latency_alone(engine, requests, config, timer)
    out += rows
    local, gap = paired_latency(engine, engine.local, requests, config, timer)
    out += [("latency_inprocess_p50_ms", local, "ms"), ("latency_http_gap_p50_ms", gap, "ms")]
    if alone_only:
        return out
    for n in options.concurrency or config.concurrency:
        estimate = n * alone / 1e3
        if estimate > config.max_throughput_seconds:
            out.append((f"requests_per_s@{n}", None, (f"skipped: {n} x {alone:.0f} ms alone = {estimate:.0f} s > "
                                                      f"max_throughput_seconds {config.max_throughput_seconds:g}")))
            continue
        result, round_size, slow, ahead = engine.closed_loop(requests, n, options.seconds or config.throughput_seconds)
        out += [(f"requests_per_s@{n}", result.requests_per_s, "requests/s"),
                (f"latency_p50_ms@{n}", result.percentile(0.5), "ms"),
                (f"latency_p99_ms@{n}", result.percentile(0.99), "ms"),
                (f"errors@{n}", result.error_count, f"requests ({result.describe_errors()})"),
                (f"answered@{n}", result.answered, "requests"),
                (f"mean_round_requests@{n}", round_size, "requests"),
                (f"launched_ahead_share@{n}", ahead, "rounds enqueued before the device finished "
                                                                           "the one before (serve.launch_ahead)"),
                (f"client_cpu_share@{n}", result.client_cpu_share, "CPU s / s of the busiest client process")]
        out += [(f"slow_{what}@{n}", count, f"over {engine.SLOW_S:g} s on the server") for what, count in slow.items()]
        if result.error_count:
            log(f"  http @{n}: {result.error_count} failed request(s): {result.describe_errors()}")
        if result.client_cpu_share > 0.8:
            log(f"  http @{n}: a client process was busy {result.client_cpu_share:.0%} of the time: the client side "
                f"may cap the rate; raise http.client_processes")
    return out


def prepare_model(spec: str, config: BenchConfig, workload_names: list[str]):
    """Loads a model of the grid and builds its workloads -> (model, tokenizer, name, {workload: requests},
    [(workload, metric, value, unit)] facts of the workloads)."""
    from transformers.decision import DecisionConfig

    from ..requests import PromptTokenizer
    from . import workloads as named

    model, tokenizer, model_name = load_model(spec, config)
    PromptTokenizer(tokenizer, DecisionConfig())  # adds the decision sentinels before any copy is made
    built: dict[str, list[dict]] = {}
    for name in workload_names:
        built.update(named.build(name, tokenizer, config.limit(name), config.options(name), config.data_dir))
    facts = [(workload, metric, value, unit) for workload, requests in built.items()
             for metric, value, unit in describe(requests, tokenizer)]
    return model, tokenizer, model_name, built, facts


def _finite(value):
    """NaN (nothing answered) is written as null: JSON has no NaN."""
    return None if isinstance(value, float) and math.isnan(value) else value


def build_engine(engine_name: str, model, tokenizer, config: BenchConfig, spec: str, model_name: str, workloads,
                 add: Callable, log: Callable[[str], None]):
    """The engine, or None after an error row for each of `workloads` (one failing engine must not lose the grid)."""
    from .engines import make_engine

    log(f"[{model_name}] building engine {engine_name}")
    try:
        return make_engine(engine_name, model, tokenizer, config, spec=spec)
    except Exception as error:
        logger.exception("%s / %s: building the engine failed", model_name, engine_name)
        for workload in workloads:
            add(workload, engine_name, "error", None, f"{type(error).__name__}: {error}"[:500])
        log(f"[{model_name}] {engine_name:14} FAILED to build: {type(error).__name__}: {error}")
        return None


@contextmanager
def torch_threads(count: int | None):
    """torch's intra-op threads set to `count` (None: left as they are) for the block, then restored."""
    import torch

    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def selection(config: BenchConfig, workloads: list[str] | None, engines: list[str] | None) -> tuple[list, list]:
    """The grid's workloads and engines (ablations included) that `--workloads` / `--engines` keep, in grid order."""
    return ([w for w in config.workloads if workloads is None or w in workloads],
            [e for e in config.engine_names() if engines is None or e in engines])


def run(config: BenchConfig, workloads: list[str] | None = None, engines: list[str] | None = None,
        commit: str | None = None, log: Callable[[str], None] | None = None,
        on_cell: Callable[[list[dict]], None] | None = None, reference_dir: str | Path | None = None) -> list[dict]:
    """Runs the grid (optionally only some workloads / engines) and returns its rows. `on_cell(rows)` is called
    after each cell with the rows so far (main writes them: a run cut short, e.g. by a device command's time limit,
    keeps the cells it finished). `reference_dir`: fidelity mode's reference cache (fidelity.ReferenceCache)."""
    import torch

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    if config.mode == "fidelity":
        from .fidelity import run as run_fidelity

        return run_fidelity(config, workloads, engines, commit=commit, log=log, on_cell=on_cell,
                            reference_dir=reference_dir)
    with torch_threads(config.torch_threads):
        commit = commit or git_commit()
        workload_names, engine_names = selection(config, workloads, engines)
        rows: list[dict] = []
        for spec in config.models:
            model, tokenizer, model_name, built, facts = prepare_model(spec, config, workload_names)
            device = next(model.parameters()).device
            hardware = hardware_name(device)
            timer = Timer(device)

            def add(workload, engine, metric, value, unit, model_name=model_name, hardware=hardware):
                rows.append(dict(zip(ROW_KEYS, (workload, model_name, engine, metric, _finite(value), unit, hardware,
                                                commit))))

            for workload, metric, value, unit in facts:
                add(workload, "-", metric, value, unit)
            pool = TokenizerPool(tokenizer) if any(n > 1 for n in config.concurrency) else None
            for engine_name in engine_names:
                cells = {w: r for w, r in built.items() if config.runs(engine_name, w)}
                if not cells:
                    continue
                engine = build_engine(engine_name, model, tokenizer, config, spec, model_name, cells, add, log)
                if engine is None:
                    continue
                try:
                    for workload, requests in cells.items():
                        start = time.perf_counter()
                        alone_only = workload.startswith("sweep/")
                        try:
                            if engine_name == "http":
                                results = measure_http(engine, requests, config, timer, alone_only, log)
                            else:
                                results = measure(engine, requests, config, timer, pool, alone_only, device)
                        except Exception as error:  # one failing cell must not lose the grid
                            logger.exception("%s / %s / %s failed", model_name, engine_name, workload)
                            add(workload, engine_name, "error", None, f"{type(error).__name__}: {error}"[:500])
                            log(f"[{model_name}] {engine_name:14} {workload:10} FAILED: {type(error).__name__}: "
                                f"{error}")
                            if device.type == "cuda":
                                torch.cuda.empty_cache()
                            if on_cell is not None:
                                on_cell(rows)
                            continue
                        for metric, value, unit in results:
                            add(workload, engine_name, metric, value, unit)
                        if on_cell is not None:
                            on_cell(rows)
                        summary = ", ".join(f"{m} {v:.4g}" for m, v, _ in results
                                            if v is not None and m.startswith(("latency_p50_ms", "requests_per_s")))
                        log(f"[{model_name}] {engine_name:14} {workload:10} {time.perf_counter() - start:6.1f}s  "
                            f"{summary}")
                finally:
                    close = getattr(engine, "close", None)
                    if close is not None:
                        close()
                del engine
                gc.collect()
            del model, pool
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return rows


# ---- results ----
def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """The old rows with every (workload, model, engine) cell measured anew replaced by the new rows, except its
    rows of submitter counts the new run did not measure (`metric@N`: a `--concurrency 1` run keeps the cell's older
    figures at 8 / 32 / 64 submitters; each row keeps the commit it was measured at)."""
    def cell(r: dict) -> tuple:
        return r["workload"], r["model"], r["engine"]

    def level(metric: str) -> str | None:
        return metric.rpartition("@")[2] if "@" in metric else None

    levels: dict[tuple, set] = {}
    for r in new:
        levels.setdefault(cell(r), set()).add(level(r["metric"]))
    kept = [r for r in old if cell(r) not in levels
            or (level(r["metric"]) is not None and level(r["metric"]) not in levels[cell(r)])]
    return kept + new


def write_results(rows: list[dict], config: BenchConfig, out_dir: str | Path | None = None,
                  merge: bool = False, draw: bool = True) -> dict[str, Path]:
    """Writes <name>.json, <name>.md and (matplotlib installed, `draw`) <name>.png; returns their paths."""
    from .report import fidelity_markdown, fidelity_plot, markdown, plot

    if config.mode == "fidelity":
        markdown, plot = fidelity_markdown, fidelity_plot
    folder = Path(out_dir or config.results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / f"{config.name}.json", "md": folder / f"{config.name}.md"}
    if merge and paths["json"].exists():
        rows = merge_rows(json.loads(paths["json"].read_text(encoding="utf-8")), rows)
    paths["json"].write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    paths["md"].write_text(markdown(rows, config), encoding="utf-8")
    png = folder / f"{config.name}.png"
    if draw and plot(rows, config, png):
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
    parser.add_argument("--concurrency", nargs="+", type=int, metavar="N",
                        help="run only these submitter counts of the config (e.g. 1: latency alone and one "
                             "submitter, every workload of a grid in a few minutes)")
    parser.add_argument("--merge", action="store_true",
                        help="merge into existing results (default when --workloads, --engines or --concurrency "
                             "is given)")
    parser.add_argument("--commit", help="the commit recorded in each row (default: git rev-parse --short HEAD)")
    parser.add_argument("--reference-dir", help="fidelity mode: where the float32 reference answers are kept between "
                        "runs, <name>.reference.json (default: the results folder); runs in parts reuse them")
    parser.add_argument("--dry-run", action="store_true", help="print the grid and exit")
    parser.add_argument("--report", action="store_true",
                        help="rewrite <name>.md and <name>.png from the existing <name>.json (no run): e.g. the plot "
                             "of a GPU run made where matplotlib is installed")
    parser.add_argument("--top-probability", nargs="+", type=float, metavar="SCALE",
                        help="print the mean top probability of Flide's answers with each final-norm scale (to pick "
                             "the config's final_norm_scale) and exit")
    parser.add_argument("--top-probability-requests", type=int, default=4, metavar="N",
                        help="requests per workload for --top-probability (default 4)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_bench_config(args.config)
        for flag, given, valid in (("--workloads", args.workloads, config.workloads),
                                   ("--engines", args.engines, config.engine_names()),
                                   ("--concurrency", args.concurrency, config.concurrency)):
            unknown = [str(v) for v in given or [] if v not in valid]
            if unknown:
                raise ValueError(f"{flag}: {', '.join(unknown)} not in the config; it has: "
                                 f"{', '.join(map(str, valid))}.")
        if args.concurrency:
            config = dataclasses.replace(config, concurrency=tuple(args.concurrency))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    workloads = args.workloads or list(config.workloads)
    engines = args.engines or config.engine_names()
    print(f"{config.name} ({config.mode}): models {', '.join(config.models)}\n  workloads {', '.join(workloads)}\n"
          f"  engines {', '.join(engines)}\n  concurrency {', '.join(map(str, config.concurrency))}; {config.dtype} on "
          f"{config.device}" + (f"; final_norm_scale {config.final_norm_scale}" if config.final_norm_scale else ""),
          file=sys.stderr)
    if args.dry_run:
        return 0
    if args.report:
        folder = Path(args.out or config.results_dir)
        source = folder / f"{config.name}.json"
        if not source.exists():
            print(f"error: --report: {source} does not exist.", file=sys.stderr)
            return 2
        paths = write_results(json.loads(source.read_text(encoding="utf-8")), config, folder)
        print(f"rewrote {', '.join(str(p) for k, p in paths.items() if k != 'json')}", file=sys.stderr)
        return 0
    if args.top_probability:
        from .fidelity import format_top_probability, top_probability_table

        if any(scale <= 0 for scale in args.top_probability):
            print("error: --top-probability: scales must be > 0.", file=sys.stderr)
            return 2
        only = dataclasses.replace(config, workloads=tuple(workloads))
        print(format_top_probability(top_probability_table(only, args.top_probability,
                                                           args.top_probability_requests)))
        return 0
    start = time.perf_counter()
    merge = args.merge or bool(args.workloads or args.engines or args.concurrency)

    def checkpoint(rows: list[dict]) -> None:  # the results so far (JSON and markdown), after every cell
        try:
            write_results(rows, config, args.out, merge=merge, draw=False)
        except Exception:  # a report that cannot be drawn yet must not stop the run; the final write says why
            logger.exception("writing the results so far failed")

    rows = run(config, args.workloads, args.engines, commit=args.commit, on_cell=checkpoint,
               reference_dir=args.reference_dir or args.out or config.results_dir)
    paths = write_results(rows, config, args.out, merge=merge)
    print(f"done in {time.perf_counter() - start:.0f} s ({datetime.datetime.now():%Y-%m-%d %H:%M}): "
          f"{', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    errors = [r for r in rows if r["metric"] == "error"]
    if errors:
        print(f"{len(errors)} cell(s) failed: see the rows with metric `error`.", file=sys.stderr)
    return 1 if errors else 0
