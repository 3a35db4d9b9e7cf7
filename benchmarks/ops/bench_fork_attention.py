"""Fork attention on the GPU: each variant against its floor and against attention without forking.

    python benchmarks/ops/bench_fork_attention.py --out benchmarks/results/ops_fork_attention.json

Shapes: Qwen3.5-0.8B (8 query heads, 2 KV heads, dim 256) and 9B (16 / 4 / 256) on two streams: a 2,000-token
state with 64 questions of 40 tokens, and 64 RACE-sized requests (a 300-token state and 4 questions of 45 tokens
each). Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph). The floor is the larger of
FLOPs (4 * visible query-key pairs * dim * query heads) over the measured bf16 matmul rate and bytes (q, k, v read
once, o written once) over the measured copy bandwidth. "sdpa-causal" is plain causal attention over the whole
stream (what an engine without forks would run on the same stream, answering nothing correctly).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flide.ops.registry import resolve  # noqa: E402
from flide.testing import synthetic_request  # noqa: E402
from flide.round import Shape, build_round  # noqa: E402


def stream(requests: int, state: int, questions: int, question: int):
    preps = [synthetic_request(np.ones(state), [np.ones(question)] * questions) for _ in range(requests)]
    tokens = requests * (state + questions * question)
    tokens = -(-tokens // 128) * 128
    return build_round(preps, Shape(tokens, requests, requests * questions, requests * questions, 2), 0).tensors


def visible_pairs(r) -> int:
    t = torch.arange(r.seg_lo.shape[0], device=r.seg_lo.device)
    return int(((t - r.seg_lo + 1) + (r.trunk_hi - r.trunk_lo)).sum())


def measure_ceilings() -> tuple[float, float]:
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ a, return_mode="median")
    flops = 2 * 8192 ** 3 / (ms * 1e-3)
    x = torch.empty(2 ** 30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    return flops, 2 * x.numel() / (ms * 1e-3)


def main() -> None:
    from triton.testing import do_bench_cudagraph

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    flops_rate, bandwidth = measure_ceilings()
    print(f"ceilings: {flops_rate / 1e12:.0f} TFLOP/s bf16, {bandwidth / 1e12:.2f} TB/s copy")
    rows = []
    streams = {"state2000_q64x40": stream(1, 2000, 64, 40), "race64": stream(64, 300, 4, 45)}
    shapes = {"qwen3.5-0.8b": (8, 2, 256), "qwen3.5-9b": (16, 4, 256)}
    for sname, r in streams.items():
        r = r.to("cuda")
        T = r.seg_lo.shape[0]
        pairs = visible_pairs(r)
        for mname, (hq, hkv, d) in shapes.items():
            q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            floor_s = max(4 * pairs * d * hq / flops_rate, (2 * q.numel() + 2 * k.numel()) * 2 / bandwidth)
            fns = {
                "flex": lambda: resolve("fork_attention", "flex")(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5),
                "sdpa-causal": lambda: F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                    enable_gqa=True),
            }
            if T <= 8192:
                fns["reference"] = lambda: resolve("fork_attention", "reference")(q, k, v, r.seg_lo, r.trunk_lo,
                                                                                  r.trunk_hi, d ** -0.5)
            for engine, fn in fns.items():
                fn()
                torch.cuda.synchronize()
                if engine == "reference":  # host syncs: not capturable, timed eagerly
                    from triton.testing import do_bench
                    ms = do_bench(fn, return_mode="median")
                else:
                    ms = do_bench_cudagraph(fn, return_mode="median")
                row = {"workload": sname, "model": mname, "engine": engine, "metric": "fork_attention_ms", "value": ms,
                       "unit": "ms", "hardware": torch.cuda.get_device_name(), "tokens": T,
                       "floor_ms": floor_s * 1e3, "x_floor": ms / (floor_s * 1e3)}
                rows.append(row)
                print(f"{sname:18} {mname:13} {engine:12} T={T:6} {ms:8.3f} ms  floor {floor_s * 1e3:7.3f} ms "
                      f"x{row['x_floor']:.1f}")
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
