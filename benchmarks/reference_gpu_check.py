"""The reference path (pure-torch ops) on a GPU in bf16: answers against transformers' pipeline, and rough timings.

    python benchmarks/reference_gpu_check.py --config-json <qwen3.5-0.8b.json> --tokenizer <folder> --out results.json

Builds a random-weight model from the config (real shapes, the real tokenizer), answers RACE, MultiRC and QuALITY
requests (../shared/data, or $FLIDE_DATA) with
  - pipeline("decision") in float32 (the reference), and in bf16 (what users run today),
  - Flide's reference path in bf16 and in float32,
and reports the largest probability difference and the mean total-variation distance of each against the float32
pipeline, plus the median latency of one request alone (no speed goal: these are the reference ops).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flide  # noqa: E402
from flide import workloads  # noqa: E402
from flide.loading import load_tokenizer, random_model  # noqa: E402
from flide.testing import max_difference, probabilities  # noqa: E402


def total_variation(a: dict, b: dict) -> float:
    """Mean over questions of the total-variation distance between two answer sets (noul: two options)."""
    tvs = []
    for name in a:
        pa, pb = probabilities(a[name]), probabilities(b[name])
        if a[name]["type"] == "noul":
            pa, pb = [pa[0], 1 - pa[0]], [pb[0], 1 - pb[0]]
        tvs.append(0.5 * sum(abs(x - y) for x, y in zip(pa, pb)))
    return statistics.mean(tvs)


def timed(fn, repeat: int, sync) -> float:
    """Median wall time (ms) of fn() with the device synchronised."""
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--limit", type=int, default=6, help="RACE requests (MultiRC and QuALITY scale with it)")
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    tok = load_tokenizer(args.tokenizer)
    sets = {
        "race": workloads.race(limit=args.limit),
        "multirc": workloads.multirc(limit=max(1, args.limit // 3), max_questions=32),
        "quality": workloads.quality(limit=max(1, args.limit // 6), cut_tokens=3600, tokenizer=tok),
    }
    bf16 = random_model(args.config_json, dtype=torch.bfloat16, device=args.device)
    fp32 = copy.deepcopy(bf16).float()
    rows = []
    answers = {}
    for label, model in (("fp32", fp32), ("bf16", bf16)):
        from transformers import pipeline

        decide = pipeline("decision", model=model, tokenizer=tok)
        for name, requests in sets.items():
            answers[("pipeline", label, name)] = [decide(r) for r in requests]
        engine = flide.patch(model, tok)
        for name, requests in sets.items():
            answers[("flide", label, name)] = engine.decide(requests)
            prepared = [engine.prepare(r) for r in requests]
            rows.append({"engine": f"flide-{label}", "workload": name, "metric": "stream_tokens",
                         "value": sum(p.stream_tokens for p in prepared) / len(prepared)})
            rows.append({"engine": f"pipeline-{label}", "workload": name, "metric": "stream_tokens",
                         "value": sum(p.prompt_tokens for p in prepared) / len(prepared)})
            if label == "bf16":
                one = requests[0]
                rows.append({"engine": "flide-bf16", "workload": name, "metric": "latency_ms",
                             "value": timed(lambda: engine.decide(one), 5, sync)})
                # the pipeline on the same (patched) model runs transformers' own modules: patching keeps them
                rows.append({"engine": "pipeline-bf16", "workload": name, "metric": "latency_ms",
                             "value": timed(lambda: decide(one), 3, sync)})
    for name in sets:
        ref = answers[("pipeline", "fp32", name)]
        for engine_name, label in (("flide", "fp32"), ("flide", "bf16"), ("pipeline", "bf16")):
            got = answers[(engine_name, label, name)]
            rows.append({"engine": f"{engine_name}-{label}", "workload": name, "metric": "max_abs_diff_vs_fp32_pipeline",
                         "value": max(max_difference(a, b) for a, b in zip(ref, got))})
            rows.append({"engine": f"{engine_name}-{label}", "workload": name, "metric": "mean_tv_vs_fp32_pipeline",
                         "value": statistics.mean(total_variation(a, b) for a, b in zip(ref, got))})
    hardware = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for row in rows:
        row.update(model=Path(args.config_json).stem, hardware=hardware)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{'engine':16} {'workload':9} {'metric':32} value")
    for row in rows:
        print(f"{row['engine']:16} {row['workload']:9} {row['metric']:32} {row['value']:.6g}")
    if args.device == "cuda":
        print("peak GPU memory GiB", torch.cuda.max_memory_allocated() / 2**30)


if __name__ == "__main__":
    main()
