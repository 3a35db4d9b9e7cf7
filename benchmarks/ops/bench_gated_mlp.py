"""The gated MLP's first half, silu(x @ gate.T) * (x @ up.T), two ways, in bf16 at Qwen3.5's MLP shapes:

- `torch`: what the flat model runs with `kernels.gated_mlp: torch`: cuBLAS over the stacked gate / up weight, then
  the SiLU-mul that Inductor fuses into one pointwise kernel (torch.compile of the same two lines);
- `triton_exact_silu` / `triton_fast_silu`: flide/ops/gated_mlp/triton.py, the SiLU-mul in the GEMM's epilogue with
  eager's SiLU formula or Inductor's x * sigmoid(x) (`EXACT_SILU` picks the variant's default).

    python benchmarks/ops/bench_gated_mlp.py [--rows 512 2304 8192] [--sweep] [--out FILE.json]

Times: medians of CUDA-graph replays (triton.testing.do_bench_cudagraph), each pair timed back to back on one card;
`ratio` = a variant's time / torch's. Per model, the sum over its layers of each row count (a forward's MLP first halves).
--sweep also times other tiles of the Triton kernel (BLOCK_N counts output columns; other BLOCK_K: other bits).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flide.ops.gated_mlp import triton as gt  # noqa: E402

# (hidden, intermediate, layers) of Qwen3.5-0.8B / -4B (shared/models/qwen3_5/configs)
MODELS = {"qwen3.5-0.8b": (1024, 3584, 24), "qwen3.5-4b": (2560, 9216, 32)}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, tma, warp_specialize) for --sweep
SWEEP = [(128, 128, 64, 8, 3, True, False), (128, 128, 64, 8, 4, True, False), (128, 64, 64, 4, 4, True, False),
         (128, 128, 64, 8, 3, True, True), (64, 128, 64, 4, 4, True, False), (128, 128, 64, 8, 3, False, False)]


def torch_form(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 2304, 8192])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from triton.testing import do_bench_cudagraph

    compiled = torch.compile(torch_form, dynamic=False)
    rows_out = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for model in args.models:
        hidden, inter, layers = MODELS[model]
        g = torch.Generator(device="cuda").manual_seed(0)
        weight = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden ** -0.5).to(torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, hidden, device="cuda", generator=g).to(torch.bfloat16)
            want = compiled(x, weight)
            # both SiLU forms by name (the module default, EXACT_SILU, is one of them: timed once)
            variants = {"torch": lambda: compiled(x, weight),
                        "triton_exact_silu": lambda: gt.gated_mlp(x, weight, exact_silu=True),
                        "triton_fast_silu": lambda: gt.gated_mlp(x, weight, exact_silu=False)}
            if args.sweep:
                for bm, bn, bk, w, s, tma, ws in SWEEP:
                    cfg = replace(gt.default_config(torch.bfloat16), block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                                  num_stages=s, tma=tma, warp_specialize=ws)
                    name = f"triton[M{bm}N{bn}K{bk}w{w}s{s}{'tma' if tma else 'ptr'}{'ws' if ws else ''}]"
                    variants[name] = lambda cfg=cfg: gt.gated_mlp(x, weight, config=cfg)
            times = {}
            for name, fn in variants.items():
                try:
                    diff = (fn().float() - want.float()).abs().max().item()
                    times[name] = (do_bench_cudagraph(fn, rep=200) * 1e3, diff)
                except Exception as error:  # a sweep tile that does not fit the card's shared memory
                    print(f"{model} M={m} {name}: {type(error).__name__}: {str(error)[:120]}")
            base = times["torch"][0]
            for name, (us, diff) in times.items():
                row = {"model": model, "rows": m, "variant": name, "us": round(us, 2), "ratio": round(us / base, 3),
                       "forward_ms": round(us * layers / 1e3, 3), "max_diff_vs_torch": diff}
                rows_out.append(row)
                print(f"{model:13s} M={m:6d} {name:40s} {us:9.2f} us  x{us / base:5.3f}  "
                      f"{us * layers / 1e3:7.3f} ms/forward  diff {diff:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
