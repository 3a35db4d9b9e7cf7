"""Growing states: SWE-agent trajectories replayed step by step, a few questions of the whole history at every step.

    python benchmarks/agent_steps.py --model tiny:qwen3_5_text --trajectories 3 --steps 4 --chars 600    # CPU check
    python benchmarks/agent_steps.py --model shared/models/qwen3_5/configs/qwen3.5-0.8b.json \\
        --tokenizer shared/models/qwen3_5 --data shared/data --dtype bfloat16 --device cuda --out results.json

For each engine: the latency of every step against the length of its history (each trajectory replayed alone, in
order), the least-squares slope in ms per 1,000 history tokens, and steps/s with 1 and N agents (N threads, each
replaying trajectories closed-loop). Engines: `flide+checkpoints` (each step resumes from the checkpoint the previous
step saved: only the new tail and the questions are computed), `flide` (no checkpoints: the whole history each
step, each state once), `prefix-cache` (the history once per step with use_cache, the cache copied per question) and
`pipeline` (transformers' pipeline("decision"): the history once per question). Flide's agent threads submit
through `Engine.submit` (shared rounds). Both Flide engines run the default kernels (every variant has its resume
companion, flide/ops/resume.py); rounds that resume or save checkpoints run eagerly, the others replay graphs. The
checkpoint cache gets `--checkpoint-cache-gb` (an entry holds its prefix's attention keys/values, ~12 KB a token on
Qwen3.5-0.8B in bf16, plus the GDN states: 32 agents of 20k-token histories need ~8 GB to keep one entry each).
Rows use the results format of `flide bench` (workload `swe_agent`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flide import workloads
from flide.bench.engines import FlideEngine, make_engine
from flide.bench.runner import git_commit, hardware_name

ENGINES = ("flide+checkpoints", "flide", "prefix-cache", "pipeline")


def build(name: str, model, tokenizer, device: str, checkpoint_cache_gb: float = 1.0):
    base = {"runtime": {"device": device}}
    if name == "flide+checkpoints":
        return FlideEngine(model, tokenizer, {**base, "checkpoints": {"enabled": True,
                                                                      "cache_gb": checkpoint_cache_gb}}, name=name)
    if name == "flide":
        return FlideEngine(model, tokenizer, base, name=name)
    return make_engine(name, model, tokenizer)


def load(spec: str, tokenizer_path: str | None, dtype: str, device: str):
    """(model, tokenizer, model name) of `tiny:<model_type>` (the tiny tokenizer) or a config json (random weights,
    the tokenizer at `tokenizer_path`)."""
    if spec.startswith("tiny:"):
        from flide.models.tiny import tiny_model, tiny_tokenizer

        return tiny_model(spec[5:]).to(device), tiny_tokenizer(), spec
    from flide.loading import load_tokenizer, random_model

    return random_model(spec, dtype, device), load_tokenizer(tokenizer_path), Path(spec).stem


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def replay_alone(engine, tokenizer, trajectories: list[list[str]], device: str) -> list[tuple[int, float, int]]:
    """(history tokens, ms, step index) of every step, each trajectory in order, one step at a time. History
    tokens: the state's own tokens (the same count for every engine, whatever each computes)."""
    points = []
    for states in trajectories:
        for step, state in enumerate(states):
            request = {"state": state, "questions": workloads.AGENT_QUESTIONS}
            tokens = len(tokenizer(state, add_special_tokens=False).input_ids)
            sync(device)
            start = time.perf_counter()
            engine.decide([request])
            sync(device)
            points.append((tokens, (time.perf_counter() - start) * 1e3, step))
    return points


def steps_per_second(engine, tokenizer, trajectories: list[list[str]], agents: int, device: str,
                     seconds: float | None = None) -> float:
    """`agents` threads, agent i replaying trajectories i, i + agents, ... step by step (closed loop). With
    `seconds`, no agent starts a step after that long (slow baselines): the rate counts the steps finished."""
    clones = [engine.for_thread(tokenizer) for _ in range(agents)]
    done = [0]
    lock = threading.Lock()
    deadline = [float("inf")]

    def agent(i: int) -> None:
        for states in trajectories[i::agents] or [trajectories[i % len(trajectories)]]:
            for state in states:
                if time.perf_counter() > deadline[0]:
                    return
                clones[i].decide([{"state": state, "questions": workloads.AGENT_QUESTIONS}])
                with lock:
                    done[0] += 1

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
    sync(device)
    start = time.perf_counter()
    if seconds is not None:
        deadline[0] = start + seconds
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sync(device)
    return done[0] / (time.perf_counter() - start)


def markdown(rows: list[dict]) -> str:
    """The rows as one table: an engine per line, a metric per column (values as measured)."""
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    value = {(r["engine"], r["metric"]): r["value"] for r in rows}
    first = rows[0] if rows else {}
    out = [f"# Agent steps ({first.get('workload', 'swe_agent')}, {first.get('model', '-')})", "",
           f"- hardware: {first.get('hardware', '-')}; commit: {', '.join(dict.fromkeys(r['commit'] for r in rows))}",
           "- every step asks the agent questions of the whole history; slope: least squares of step latency on "
           "history tokens, each trajectory replayed alone; steps/s: N agent threads, closed loop", "",
           "| engine | " + " | ".join(metrics) + " |", "| --- |" + " --- |" * len(metrics)]
    for engine in engines:
        cells = [value.get((engine, m)) for m in metrics]
        out.append(f"| {engine} | " + " | ".join("-" if c is None else f"{c:g}" for c in cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="tiny:<model_type> or a config json (random weights)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--trajectories", type=int, default=6, help="trajectories the agents replay (steps/s)")
    parser.add_argument("--alone-trajectories", type=int, default=None,
                        help="of those, how many (the ones with the most steps, for the widest range of history "
                             "lengths) are replayed one step at a time for the latency against history (default: "
                             "all); with N agents, give at least N trajectories, else agents replay copies and "
                             "resume from each other's checkpoints")
    parser.add_argument("--seconds", type=float, default=None,
                        help="bound each steps/s run: agents start no step after this long (slow baselines)")
    parser.add_argument("--steps", type=int, default=None, help="at most this many steps per trajectory")
    parser.add_argument("--chars", type=int, default=None, help="cut every message to this many characters")
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--checkpoint-cache-gb", type=float, default=None,
                        help="flide+checkpoints' cache budget (default: 16 on CUDA, 1 on the CPU)")
    parser.add_argument("--out", default=None, help="rows as JSON; a markdown table is written beside it (.md)")
    parser.add_argument("--report", default=None, help="write the markdown of an existing JSON of rows and exit")
    args = parser.parse_args()
    if args.report:
        Path(args.report).with_suffix(".md").write_text(markdown(json.loads(Path(args.report).read_text())))
        return

    if not args.model:
        parser.error("--model is required (or --report)")
    model, tokenizer, model_name = load(args.model, args.tokenizer, args.dtype, args.device)
    trajectories = workloads.swe_agent(limit=args.trajectories, steps=args.steps, chars=args.chars,
                                       folder=args.data)
    hardware, commit = hardware_name(torch.device(args.device)), git_commit()
    alone = sorted(trajectories, key=len, reverse=True)[:args.alone_trajectories]
    print(f"{len(trajectories)} trajectories, {sum(map(len, trajectories))} steps; replayed alone: "
          f"{len(alone)}, {sum(map(len, alone))} steps", flush=True)
    rows = []

    def save() -> None:  # after every figure: a run cut short by a time limit keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
            Path(args.out).with_suffix(".md").write_text(markdown(rows))

    def row(engine: str, metric: str, value: float, unit: str) -> None:
        rows.append({"workload": "swe_agent", "model": model_name, "engine": engine, "metric": metric,
                     "value": round(value, 4), "unit": unit, "hardware": hardware, "commit": commit})
        print(json.dumps(rows[-1]), flush=True)

    for name in args.engines:
        cache_gb = args.checkpoint_cache_gb or (16.0 if args.device.startswith("cuda") else 1.0)
        engine = build(name, model, tokenizer, args.device, cache_gb)
        replay_alone(engine, tokenizer, trajectories[:1], args.device)  # warm-up (and checkpoints of the first trajectory)
        clear = engine.engine.checkpoints.clear if name == "flide+checkpoints" else (lambda: None)
        clear()
        points = replay_alone(engine, tokenizer, alone, args.device)
        tokens = np.array([p[0] for p in points], dtype=float)
        ms = np.array([p[1] for p in points])
        resumed = np.array([p[2] > 0 for p in points])  # a trajectory's first step has nothing to resume from
        slope, intercept = np.polyfit(tokens / 1000, ms, 1)
        row(name, "step_latency_p50_ms", statistics.median(ms), "ms")
        row(name, "slope_ms_per_1k_history_tokens", slope, "ms per 1,000 tokens")
        row(name, "intercept_ms", intercept, "ms")
        if resumed.sum() >= 2:
            row(name, "later_steps_p50_ms", statistics.median(ms[resumed]), "ms")
            row(name, "later_steps_slope_ms_per_1k", np.polyfit(tokens[resumed] / 1000, ms[resumed], 1)[0],
                "ms per 1,000 tokens")
        row(name, "first_steps_p50_ms", statistics.median(ms[~resumed]), "ms")
        row(name, "history_tokens_min", tokens.min(), "tokens")
        row(name, "history_tokens_max", tokens.max(), "tokens")
        save()
        for agents in args.agents:
            clear()  # every steps/s run starts cold: no checkpoints from the runs before it
            rate = steps_per_second(engine, tokenizer, trajectories, agents, args.device, args.seconds)
            row(name, f"steps_per_s@{agents}", rate, "steps/s")
            save()
        if name.startswith("flide") and engine.engine._scheduler is not None:
            engine.engine.scheduler().stop()


if __name__ == "__main__":
    main()
