"""Where an agent step's time goes with checkpoints: host profile (cProfile) and the split prepare / run per step.

    python benchmarks/profile_agent_steps.py --model shared/models/qwen3_5/configs/qwen3.5-0.8b.json \\
        --tokenizer shared/models/qwen3_5 --data shared/data --dtype bfloat16 --device cuda

Replays the first trajectory once to warm up (kernels compiled and autotuned, checkpoints of that trajectory saved),
then the next ones step by step as `agent_steps.py` does (each step resumes from the checkpoint its previous step
saved) and prints, per step, the history's tokens, the prepare time (rendering + tokenizing + layout), the run time
(round build + forward + answers, synchronised) and the checkpoint cache's counters; then the cProfile of those
steps, by cumulative and by own time. On the H200 (2026-11-30) a resumed step of 0.8B took ~150 ms over a slope of
1.5 ms per 1,000 history tokens, which the GPU work of a few hundred new tokens does not explain: this finds out what.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_steps import build, load, sync  # noqa: E402 (benchmarks/ is on the path when run as a script)

from flide import workloads  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="tiny:<model_type> or a config json (random weights)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trajectories", type=int, default=3, help="the first warms up, the others are profiled")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--chars", type=int, default=None)
    parser.add_argument("--engine", default="flide+checkpoints", choices=("flide+checkpoints", "flide"))
    parser.add_argument("--top", type=int, default=30, help="lines of each cProfile table")
    parser.add_argument("--torch-profile", action="store_true",
                        help="also trace the last step with torch.profiler: device time by kernel vs the step's wall")
    args = parser.parse_args()

    model, tokenizer, _ = load(args.model, args.tokenizer, args.dtype, args.device)
    trajectories = workloads.swe_agent(limit=args.trajectories, steps=args.steps, chars=args.chars,
                                       folder=args.data)
    if len(trajectories) < 2:
        raise SystemExit("--trajectories must give at least 2 trajectories (one to warm up, one to profile).")
    wrapper = build(args.engine, model, tokenizer, args.device,
                    16.0 if args.device.startswith("cuda") else 1.0)
    engine = wrapper.engine

    def step(state: str) -> tuple[float, float]:
        request = {"state": state, "questions": workloads.AGENT_QUESTIONS}
        sync(args.device)
        start = time.perf_counter()
        prepared = [engine.prepare(request)]
        mid = time.perf_counter()
        engine.run(prepared)
        sync(args.device)
        end = time.perf_counter()
        return (mid - start) * 1e3, (end - mid) * 1e3

    for state in trajectories[0]:
        step(state)
    profile = cProfile.Profile()
    print("tokens  prepare_ms  run_ms  checkpoint counters", flush=True)
    for states in trajectories[1:]:
        for state in states:
            tokens = len(tokenizer(state, add_special_tokens=False).input_ids)
            profile.enable()
            prepare_ms, run_ms = step(state)
            profile.disable()
            counters = engine.checkpoints.stats() if getattr(engine, "checkpoints", None) is not None else {}
            print(f"{tokens:6d}  {prepare_ms:10.2f}  {run_ms:6.2f}  {counters}", flush=True)
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile as trace

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        if getattr(engine, "checkpoints", None) is not None:
            engine.checkpoints.clear()
        for state in trajectories[-1][:-1]:  # the last trajectory again, so its last step resumes as it did
            step(state)
        with trace(activities=activities) as traced:
            prepare_ms, run_ms = step(trajectories[-1][-1])
        events = traced.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        print(f"--- torch.profiler, last step: prepare {prepare_ms:.2f} ms, run {run_ms:.2f} ms, device kernels "
              f"{device_us / 1e3:.2f} ms ---")
        print(events.table(sort_by="self_device_time_total" if args.device.startswith("cuda") else
                           "self_cpu_time_total", row_limit=25, max_name_column_width=60))
    for key in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(args.top)
        print(f"--- cProfile by {key} ---")
        print(text.getvalue()[-12000:] if key == "cumulative" else text.getvalue()[-8000:])


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
