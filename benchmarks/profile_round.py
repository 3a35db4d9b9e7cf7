"""Where the time of one round goes: latency of one request alone (graphs vs eager rounds) and a kernel profile of
one graph replay, per workload, on a random-weight model in real shapes.

    python benchmarks/profile_round.py --config-json <qwen3.5-0.8b.json> --tokenizer <folder> \\
        [--data <folder>] [--workloads race multirc quality sweep1 sweep8 sweep64 multirc@6 race@16] \\
        [--out results.json]

For each workload it prepares the first request, runs it alone `--repeats` times and reports the median wall time
of `engine.run` (host build + copy + replay + scores back; tokenization excluded, it runs before and off the GPU's
thread in `flide serve`; `prepare_ms` is that part, for the request as if never seen; `request_ms` both, timed
together) and the stream tokens; then profiles `--profile-runs` replays with torch.profiler and
groups GPU kernel time into families (GEMMs, attention, gated delta, conv, norms and pointwise, copies). GPU only.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import operator
import statistics
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flide
from flide import workloads
from flide.bench import workloads as bench_workloads
from flide.graphs.buckets import plan_rounds
from flide.loading import load_tokenizer, random_model

FAMILIES = [  # first match wins: (family, substrings of the kernel name)
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "mm_", "gated_mlp", "_linear_")),
    ("attention", ("flex", "attention", "attn")),
    ("gated delta", ("chunk_", "_branch_", "gated_delta", "gdn_questions", "l2norm", "solve_tril", "recompute_w_u",
                     "kkt", "fwd_h", "fwd_o", "cumsum", "questions_chunked", "_w_u_", "_state_chain")),
    ("conv", ("fork_conv", "conv")),
    ("copies", ("memcpy", "memset", "copy", "fill")),
]


def family(name: str) -> str:
    low = name.lower()
    if low.startswith(("triton_poi_", "triton_per_", "triton_red_")):
        # Inductor's fused kernels: their names list the ops fused (`_to_copy`, `gated_delta_...` of a custom op's
        # neighbours), which the substrings below would misfile as copies or gated delta
        return "pointwise/norm/other"
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "pointwise/norm/other"


def sweep(tokenizer, questions: int, folder) -> dict:
    """The bench's `sweep/q<n>` request (a QuALITY article cut to 2,000 tokens, asked n questions; past its own, they
    repeat with their options reordered, so every prompt differs). Before session 40 this took the article's questions
    again unchanged, which nested forks shared: sweep 64 was a 3,893-token stream here against the bench's 7,550."""
    return bench_workloads.sweep(tokenizer, counts=(questions,), data_dir=folder)[f"sweep/q{questions}"][0]


def load(name: str, tokenizer, folder) -> list[dict]:
    """A workload's requests for one round: its first request, or with `@N` (`race@16`) its first N requests, which
    then run as one round (the rounds `flide serve` runs under load: 8 clients make rounds of ~3 RACE requests, 32
    of ~15)."""
    name, _, count = name.partition("@")
    n = int(count) if count else 1
    if n < 1:
        raise SystemExit(f"workload {name}@{count}: the request count must be at least 1")
    if name == "race":
        requests = workloads.race(limit=n, folder=folder)
    elif name == "race1":
        requests = workloads.race(limit=n, one_question=True, folder=folder)
    elif name == "multirc":
        requests = workloads.multirc(limit=n, folder=folder)
    elif name == "quality":
        requests = workloads.quality(limit=n, folder=folder)
    elif name == "quality1":
        requests = workloads.quality(limit=n, cut_tokens=3600, tokenizer=tokenizer, one_question=True, folder=folder)
    elif name.startswith("sweep") and name[5:].isdigit():
        requests = [sweep(tokenizer, int(name[5:]), folder)] * n
    else:
        raise SystemExit(f"unknown workload {name!r}")
    if len(requests) < n:
        raise SystemExit(f"workload {name}@{n}: only {len(requests)} requests in the data")
    return requests


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def host_split(engine, prepared: list, repeats: int, cprofile: bool = False) -> dict:
    """Where `engine.run` of one request alone spends its wall time, stage by stage, medians in ms: `plan` (bucket
    choice), `handoff` (a no-op round trip to the graph thread: what `launch` pays to reach it, where the bucket has no
    recorded graph to launch from the calling thread), `build` (the round into the bucket's pinned buffer), `enqueue` (the host-to-device copy and the compiled call: dynamo's guards and
    cudagraph trees' checks before the replay is enqueued), `wait` (from the enqueue's end to the scores on the host),
    `answers` (softmax and answer dicts), and `gpu_span` (CUDA events around copy + replay + scores copy: the device's
    time for the round, kernels and the gaps between them); `answers_again` / `build_again`: the same two right after
    (not part of the round: what they cost warm)."""
    from flide.round import build_round

    runner = engine.runner
    stages: dict[str, list[float]] = defaultdict(list)
    # --cprofile-enqueue: where the compiled call's host time goes (it grew with the bucket in the first split,
    # 0.62 ms at 512 tokens to 2.1 ms at 8,192: the bucket's position among the recorded graphs?)
    profiler = None
    if cprofile:
        import cProfile

        profiler = cProfile.Profile()

    def one_round():
        t0 = time.perf_counter()
        planned = plan_rounds([engine.footprint(p) for p in prepared], engine.config.capacities,
                              engine.max_options)
        assert len(planned) == 1, "the workload's requests do not fit one round"
        planned = planned[0]
        bucket = runner.buckets[planned.shape.tokens]
        t1 = time.perf_counter()
        round_ = build_round(prepared, planned.shape, runner.pad_id, out=bucket.host)
        t2 = time.perf_counter()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        if profiler is not None:
            profiler.enable()
        bucket.device.copy_(bucket.host, non_blocking=True)
        scores = runner._replay(bucket)
        if profiler is not None:
            profiler.disable()
        t3 = time.perf_counter()
        host = scores.float().cpu()
        end.record()
        end.synchronize()
        t4 = time.perf_counter()
        engine.answers(round_, host)
        t5 = time.perf_counter()
        # the same host work again at once (warm caches, the core busy): the H200 host ran answers 2-5x slower than
        # a 2-core VM runs them (session 22), measured right after the wait; a much faster second run says the
        # first pays for waking from the wait, not for its own work
        engine.answers(round_, host)
        t6 = time.perf_counter()
        build_round(prepared, planned.shape, runner.pad_id, out=bucket.host)
        t7 = time.perf_counter()
        return {"plan": t1 - t0, "build": t2 - t1, "enqueue": t3 - t2, "wait": t4 - t3, "answers": t5 - t4,
                "answers_again": t6 - t5, "build_again": t7 - t6, "gpu_span": begin.elapsed_time(end) / 1e3}

    # a bucket with its recorded graph (runtime.guards: none) is launched by the calling thread (GraphRunner.launch):
    # timed here on this thread, no hand-off; others are handed to the graph thread (`handoff`: a no-op round trip)
    bucket_tokens = plan_rounds([engine.footprint(p) for p in prepared], engine.config.capacities,
                                engine.max_options)[0].shape.tokens
    direct = runner.buckets[bucket_tokens].graph is not None
    for _ in range(repeats):
        torch.cuda.synchronize()
        if direct:
            with torch.cuda.device(runner.device):
                split = one_round()
        else:
            t0 = time.perf_counter()
            runner._thread.submit(lambda: None).result()
            stages["handoff"].append(time.perf_counter() - t0)
            split = runner._thread.submit(one_round).result()
        for key, seconds in split.items():
            stages[key].append(seconds)
    out = {key: round(statistics.median(values) * 1e3, 4) for key, values in stages.items()}
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumtime").print_stats(25)
        out["enqueue_cprofile"] = text.getvalue()[-6000:]
    return out


def enqueue_by_bucket(engine, prepared: list, repeats: int) -> dict:
    """The compiled call's host time (dynamo's guards, the AOT and cudagraph-tree wrappers, the graph launch) per
    bucket, every bucket that holds the round replaying it, medians in ms, plus how many graphs dynamo compiled and
    how many cache entries the compiled forward has. `gpu_ms`: the device's time for the same round in each bucket
    (CUDA events around the replay, median): what the padding rows of a larger bucket cost (H200, 2026-12-01: ~2.4
    ms per 1,000 padding rows on 0.8B). Sessions 12-13 saw the host time grow with the bucket (0.62 ms at 512
    tokens, 2.1 ms at 8,192); on 2026-12-01 it was 0.38-0.73 ms up to 8,192 and 1.2-1.6 above, one cache entry, one
    graph, `CUDAGraph.replay` alone 0.02-0.30 ms."""
    from torch._dynamo.utils import counters

    from flide.graphs.buckets import holds
    from flide.round import build_round

    runner = engine.runner
    need = functools.reduce(operator.add, (engine.footprint(p) for p in prepared))

    def measure(bucket) -> tuple[float, float, float]:
        """(median ms of the compiled call, mean ms of `CUDAGraph.replay` inside it from cProfile, median device ms
        of the replay)."""
        import cProfile
        import pstats

        build_round(prepared, bucket.shape, runner.pad_id, out=bucket.host)
        bucket.device.copy_(bucket.host, non_blocking=True)
        times, gpu = [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            begin.record()
            runner._replay(bucket)
            times.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            gpu.append(begin.elapsed_time(end))
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        for _ in range(repeats):
            torch.cuda.synchronize()
            profiler.enable()
            runner._replay(bucket)
            profiler.disable()
        torch.cuda.synchronize()
        # torch.cuda.CUDAGraph.replay (torch/cuda/graphs.py, around the C launch; the C method itself where it is
        # called directly): (cumulative seconds, calls)
        stats = pstats.Stats(profiler).stats.items()
        replay = [(stat[3], stat[1]) for key, stat in stats
                  if key[2] == "replay" and key[0].replace("\\", "/").endswith("torch/cuda/graphs.py")] or \
                 [(stat[3], stat[1]) for key, stat in stats
                  if key[2] == "<method 'replay' of 'torch._C._CUDAGraph' objects>"]
        replay_ms = sum(t for t, _ in replay) / max(1, sum(n for _, n in replay)) * 1e3 if replay else float("nan")
        return statistics.median(times) * 1e3, replay_ms, statistics.median(gpu)

    out: dict = {"ms": {}, "replay_ms": {}, "gpu_ms": {}}
    for tokens, bucket in sorted(runner.buckets.items()):
        if holds(bucket.shape, need):
            call_ms, replay_ms, gpu_ms = runner._thread.submit(measure, bucket).result()
            out["ms"][str(tokens)] = round(call_ms, 4)
            out["replay_ms"][str(tokens)] = round(replay_ms, 4)
            out["gpu_ms"][str(tokens)] = round(gpu_ms, 4)
    out["unique_graphs"] = counters["stats"]["unique_graphs"]
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        original = getattr(runner._forward, "_torchdynamo_orig_callable", None)
        if original is not None:
            out["cache_entries"] = len(_debug_get_cache_entry_list(original.__code__))
    except Exception as error:  # noqa: BLE001 (a private helper: the table above is the point)
        out["cache_entries"] = f"unknown ({type(error).__name__})"
    return out


def profile(fn, runs: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    by_family: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    launches: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us <= 0 or event.key.startswith("ProfilerStep"):
            continue
        by_family[family(event.key)] += us / runs
        top[event.key] += us / runs
        launches[event.key] += event.count / runs
    heaviest = sorted(top.items(), key=lambda kv: -kv[1])[:30]
    kernels = sum(event.count for event in prof.key_averages()
                  if (getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)) > 0)
    return {"gpu_ms_by_family": {k: round(v / 1e3, 4) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            "gpu_ms_total": round(sum(by_family.values()) / 1e3, 4),
            "kernels_per_run": round(kernels / runs, 1),
            "top_kernels_ms": [(k[:90], round(v / 1e3, 4)) for k, v in heaviest],
            # every kernel: (name, launches a run, ms a run), by launches: where a replay's ~600 launches come from
            "kernel_launches": [(k[:90], round(launches[k], 1), round(top[k] / 1e3, 4))
                                for k in sorted(top, key=lambda k: (-launches[k], -top[k]))]}


def set_constant(assignment: str) -> None:
    """`package.module.NAME=VALUE`: sets an existing module constant to a Python literal (ValueError otherwise)."""
    import ast
    import importlib

    target, _, value = assignment.partition("=")
    module_name, _, name = target.rpartition(".")
    if not value or not module_name:
        raise ValueError(f"--set {assignment!r}: want package.module.NAME=VALUE")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"--set {assignment!r}: {module_name} has no {name}")
    setattr(module, name, ast.literal_eval(value))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--data", default=None)
    # multirc@6: a round of several requests with nested forks (~250 nested rows, more than the nested launch's row
    # programs), the shape under load that session 41's rows in turns hung on and no single request has
    parser.add_argument("--workloads", nargs="+", default=["race", "multirc", "quality", "sweep1", "sweep8",
                                                           "sweep64", "multirc@6"])
    parser.add_argument("--config", default=None, help="a Flide YAML config (default: configs/default.yaml's)")
    parser.add_argument("--eager", action="store_true", help="also time eager rounds (runtime.graphs: off)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile-runs", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--cprofile-enqueue", action="store_true",
                        help="cProfile the compiled call's host side (host_split_ms.enqueue_cprofile, top 25 by cumtime)")
    parser.add_argument("--skip-guard-eval", action="store_true",
                        help="after the capture, replays run as with `runtime.guards: skip` (torch.compiler.set_stance("
                             "skip_guard_eval_unsafe=True) around each): dynamo then checks only the guards that tell "
                             "its cache entries apart (one entry: none); how much of the enqueue is guard evaluation. "
                             "With --enqueue-by-bucket: the first workload measured with guards, then again without, "
                             "from one capture")
    parser.add_argument("--enqueue-by-bucket", action="store_true",
                        help="the compiled call's host time in every bucket holding the first workload's request, "
                             "and dynamo's graph and cache-entry counts (report key enqueue_by_bucket)")
    parser.add_argument("--stall-dump", type=float, default=0,
                        help="every S seconds, print every thread's Python stack (finds where a capture stalls)")
    parser.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=VALUE",
                        help="set a module constant before the engine starts, e.g. "
                             "flide.ops.gated_delta.fla.FUSED_STATE_CHAIN=False (a Python literal): a same-call A/B "
                             "of a switch that is not in the YAML config (report key `set`)")
    args = parser.parse_args()
    for assignment in args.set:
        set_constant(assignment)
    if args.stall_dump:
        import faulthandler

        faulthandler.dump_traceback_later(args.stall_dump, repeat=True)

    tokenizer = load_tokenizer(args.tokenizer)
    model = random_model(args.config_json, torch.bfloat16, "cuda")
    # a copy for the eager engine, made before patching: patching swaps the model's mixers in place (and a patched
    # model holds custom-op handles that cannot be deep-copied)
    spare = copy.deepcopy(model) if args.eager else None
    start = time.perf_counter()
    engine = flide.patch(model, tokenizer, config=args.config)
    from flide.bench.runner import git_commit

    commit = git_commit()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
              "kernels": str(engine.kernels), "set": args.set,
              "start_s": round(time.perf_counter() - start, 1), "rows": []}
    if engine.runner is not None:
        report["capture_s"] = round(engine.runner.capture_seconds, 1)
        report["graph_memory_gib"] = round(engine.runner.graph_memory_bytes / 2**30, 3)
    eager = flide.patch(spare, tokenizer, config={"runtime": {"graphs": "off"}}) if args.eager else None
    # device memory: the start-up's peaks (capture included), what the process holds once started, then (at the end)
    # the peaks of the rounds alone, which the bench reports as peak_memory_gib / peak_reserved_gib
    report["start_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    report["start_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    report["reserved_after_start_gib"] = round(torch.cuda.memory_reserved() / 2**30, 3)
    report["allocated_after_start_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    torch.cuda.reset_peak_memory_stats()
    if args.skip_guard_eval and not args.enqueue_by_bucket and engine.runner is not None:
        engine.runner._skip_guards = True  # as `runtime.guards: skip` sets it after the capture
        report["skip_guard_eval"] = True
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)
    from flide.piece_cache import PieceCache
    from flide.requests import PromptTokenizer

    # the host's part before a round, as for a request never seen (no piece or question cache)
    # (nested as the engine's own: without it a cold request had no sub-trunks, and request_ms timed a longer stream)
    cold = PromptTokenizer(engine.prompts.tokenizer, engine.prompts.config, engine.prompts.mode, resolved=True,
                           piece_cache=PieceCache(0), question_cache_entries=0, nested=engine.prompts.nested)
    for name in args.workloads:
        requests = load(name, tokenizer, args.data)
        prepared = [engine.prepare(request) for request in requests]
        rounds = len(plan_rounds([engine.footprint(p) for p in prepared], engine.config.capacities,
                                 engine.max_options))
        if rounds > 1:  # the profile times one round (host split, one replay's kernels)
            fewer = f"{name.partition('@')[0]}@{max(1, len(requests) // rounds)}"
            raise SystemExit(f"workload {name}: its {len(requests)} requests need {rounds} rounds at these "
                             f"capacities; ask for fewer (e.g. {fewer})")
        prepare_ms = median_ms(lambda: [engine.prepare(request, cold) for request in requests], 5)
        engine.run(prepared)  # warm
        row = {"workload": name, "requests": len(requests),
               "questions": sum(len(request["questions"]) for request in requests),
               "stream_tokens": sum(p.stream_tokens for p in prepared),
               "latency_ms": round(median_ms(partial(engine.run, prepared), args.repeats), 3),
               "prepare_ms": round(prepare_ms, 3),
               # the requests from their JSON to their answers, as if never seen (what a client of the engine waits)
               "request_ms": round(median_ms(lambda: engine.run([engine.prepare(r, cold) for r in requests]),
                                             max(5, args.repeats // 2)), 3)}
        if eager is not None:
            p2 = [eager.prepare(request) for request in requests]
            eager.run(p2)
            row["eager_latency_ms"] = round(median_ms(partial(eager.run, p2), max(3, args.repeats // 4)), 3)
        if engine.runner is not None and engine.runner._forward is not None:
            row["host_split_ms"] = host_split(engine, prepared, args.repeats, args.cprofile_enqueue)
            if args.enqueue_by_bucket and name == args.workloads[0]:
                report["enqueue_by_bucket"] = enqueue_by_bucket(engine, prepared, args.repeats)
                print(json.dumps({"enqueue_by_bucket": report["enqueue_by_bucket"]}), flush=True)
                if args.skip_guard_eval:  # the same, guards skipped from here on (one capture serves both)
                    engine.runner._skip_guards = True  # as `runtime.guards: skip` sets it after the capture
                    report["skip_guard_eval"] = True
                    report["enqueue_by_bucket_skip_guards"] = enqueue_by_bucket(engine, prepared, args.repeats)
                    print(json.dumps({"enqueue_by_bucket_skip_guards": report["enqueue_by_bucket_skip_guards"]}),
                          flush=True)
                    row["host_split_ms_skip_guards"] = host_split(engine, prepared, args.repeats, False)
        row["profile"] = profile(partial(engine.run, prepared), args.profile_runs)
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    # reserved: what the process holds from the GPU, the graphs' memory pools included (issue 8's memory goal)
    report["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    print(json.dumps({k: v for k, v in report.items() if k.endswith("_gib")}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
