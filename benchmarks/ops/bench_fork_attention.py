"""Fork attention on the GPU: each variant against its floor and against attention without forking.

    python benchmarks/ops/bench_fork_attention.py --out benchmarks/results/ops_fork_attention.json
    python benchmarks/ops/bench_fork_attention.py --out ... --sweep   # also the `triton` kernel's other tile configs

Shapes: Qwen3.5-0.8B (8 query heads, 2 KV heads, dim 256) and 9B (16 / 4 / 256) on two streams: a 2,000-token
state with 64 questions of 40 tokens, and 64 RACE-sized requests (a 300-token state and 4 questions of 45 tokens
each). Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph). The floor is the larger of
FLOPs (4 * visible query-key pairs * dim * query heads) over the measured bf16 matmul rate and bytes (q, k, v read
once, o written once) over the measured copy bandwidth. "sdpa-causal" is plain causal attention over the whole
stream (what an engine without forks would run on the same stream, answering nothing correctly). `triton` is
Flide's own kernel (flide/ops/fork_attention/triton.py); its rows also carry its relative RMS error against flex
(`rel_err_vs_flex`, so a fast wrong kernel shows) and its tile config; with --sweep, rows `triton[M..,N..,w..,s..]`
time the alternative tiles (the first row of each is the default).
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

from flide.ops.registry import resolve
from flide.round import Shape, build_round
from flide.testing import synthetic_request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tables import write_beside  # noqa: E402 (after the path line, as the flide imports)


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


# Tiles tried by --sweep for bf16 at dim 256 (BLOCK_M, BLOCK_N, num_warps, num_stages); all fit in the H200's
# shared memory, none spills more than ~300 bytes a thread (ptxas, sm_90a)
SWEEP = [(128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 3),
         (64, 64, 8, 2)]


# FlexAttention kernel options to time against its defaults (--flex-sweep): tiles must divide the block mask's 128
FLEX_SWEEP = [{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
              {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
              {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
              {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_shape(sname: str, mname: str, r, heads: tuple[int, int, int], ceilings: tuple[float, float],
                sweep: bool, flex_sweep: bool = False) -> list[dict]:
    """Every engine on one stream and one attention shape: one JSON row each."""
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench, do_bench_cudagraph

    from flide.ops.fork_attention import triton as triton_kernel

    flops_rate, bandwidth = ceilings
    hq, hkv, d = heads
    T = r.seg_lo.shape[0]
    q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    floor_s = max(4 * visible_pairs(r) * d * hq / flops_rate, (2 * q.numel() + 2 * k.numel()) * 2 / bandwidth)
    meta = (r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5)
    configs = {"triton": triton_kernel.default_config(d, q.dtype)}
    if sweep:
        for c in SWEEP:
            configs.setdefault(f"triton[M{c[0]},N{c[1]},w{c[2]},s{c[3]}]", triton_kernel.Config(*c))
    flex = resolve("fork_attention", "flex")
    from flide.ops.fork_attention import flex as flex_module

    def flex_with(options):
        def run():
            flex_module.KERNEL_OPTIONS = options
            try:
                return flex(q, k, v, *meta)
            finally:
                flex_module.KERNEL_OPTIONS = None
        return run

    fns = {"flex": lambda: flex(q, k, v, *meta)}
    if flex_sweep:
        for options in FLEX_SWEEP:
            name = "flex[" + ",".join(f"{k_}={v_}" for k_, v_ in options.items()) + "]"
            fns[name] = flex_with(options)
    for name, cfg in configs.items():
        fns[name] = lambda cfg=cfg: triton_kernel.fork_attention(q, k, v, *meta, config=cfg)
    fns["sdpa-causal"] = lambda: F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    if T <= 8192:
        fns["reference"] = lambda: resolve("fork_attention", "reference")(q, k, v, *meta)
    flex_out = flex(q, k, v, *meta)
    rows = []
    for engine, fn in fns.items():
        try:
            out = fn()
            torch.cuda.synchronize()
        except (OutOfResources, RuntimeError) as error:  # a sweep tile beyond the shared memory or registers there are
            # (flex's lowering raises its own errors for options it cannot use)
            print(f"{sname:18} {mname:13} {engine:12} skipped: {error}"[:300])
            continue
        if engine == "reference":  # host syncs: not capturable, timed eagerly
            ms = do_bench(fn, return_mode="median")
        else:
            ms = do_bench_cudagraph(fn, return_mode="median")
        row = {"workload": sname, "model": mname, "engine": engine, "metric": "fork_attention_ms", "value": ms,
               "unit": "ms", "hardware": torch.cuda.get_device_name(), "tokens": T,
               "floor_ms": floor_s * 1e3, "x_floor": ms / (floor_s * 1e3)}
        extra = ""
        if engine in configs:
            cfg = configs[engine]
            row["config"] = {"block_m": cfg.block_m, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
                             "num_stages": cfg.num_stages}
            row["rel_err_vs_flex"] = rel_err(out, flex_out)
            extra = f"  rel err vs flex {row['rel_err_vs_flex']:.1e}"
        rows.append(row)
        print(f"{sname:18} {mname:13} {engine:12} T={T:6} {ms:8.3f} ms  floor {floor_s * 1e3:7.3f} ms "
              f"x{row['x_floor']:.1f}{extra}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="also time the triton kernel's other tile configs")
    parser.add_argument("--flex-sweep", action="store_true", help="also time flex with other kernel options")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings[0] / 1e12:.0f} TFLOP/s bf16, {ceilings[1] / 1e12:.2f} TB/s copy")
    rows = []
    streams = {"state2000_q64x40": stream(1, 2000, 64, 40), "race64": stream(64, 300, 4, 45)}
    shapes = {"qwen3.5-0.8b": (8, 2, 256), "qwen3.5-9b": (16, 4, 256)}
    for sname, r in streams.items():
        r = r.to("cuda")
        for mname, heads in shapes.items():
            rows += bench_shape(sname, mname, r, heads, ceilings, args.sweep, args.flex_sweep)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    write_beside(args.out, rows)  # the markdown table beside the JSON


if __name__ == "__main__":
    main()
