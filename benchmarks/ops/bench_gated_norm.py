"""The end of a Gated DeltaNet layer on the GPU: the fork's row select + the gated RMS norm, as the Triton kernel
(`kernels.gated_norm: triton`) and as Inductor fuses the reference (what the `torch` variant runs inside a replay).

    python benchmarks/ops/bench_gated_norm.py --out benchmarks/results/ops_gated_norm_h200.json [--sweep]

Streams at Qwen3.5-0.8B's heads (16 value heads of 128): RACE in its 448-token bucket, a QuALITY article in the
8,192 bucket, the 2,000-token state with 64 questions in 10,240; at 9B's (32 heads) the QuALITY one. The inputs
lie as in the layer: x_states / x_branches [T, H, V] contiguous (the two gated delta calls' outputs), the gate a
column slice of the fused input projection's output. Times are medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph). The floor: one x row, one gate row read and the output written, over the
measured copy bandwidth. `inductor` is `torch.compile(reference.gated_norm, dynamic=False)`, the same fused kernel
a replay runs for the `torch` variant (one kernel: the select and the norm); `eager` the reference op by op.
Rows carry the share of the Triton kernel's elements equal to the eager reference's bits (bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flide.ops.gated_norm import reference  # noqa: E402
from flide.ops.gated_norm import triton as kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fork_conv import copy_bandwidth  # noqa: E402
from tables import write_beside  # noqa: E402

# name: (bucket T, value heads, states_end, branches_end)
STREAMS = {"race-0.8b": (448, 16, 300, 437), "quality-0.8b": (8192, 16, 6113, 8045),
           "state2000_q64-0.8b": (10240, 16, 2004, 9176), "quality-9b": (8192, 32, 6113, 8045)}
V = 128
# (BLOCK_T, num_warps) tried by --sweep; the default is flide.ops.gated_norm.triton's
SWEEP = [(8, 2), (16, 4), (32, 4), (32, 8), (64, 8)]  # (8, 2) the default since session 21's sweep


def bench(name: str, T: int, H: int, states_end: int, branches_end: int, bandwidth: float, sweep: bool) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    dtype = torch.bfloat16
    x_states = torch.randn(T, H, V, device="cuda").to(dtype)
    x_branches = torch.randn(T, H, V, device="cuda").to(dtype)
    # the layer's fused input projection: [q k v | z | b a]; z is a column slice of it
    key = 2 * 16 * 128  # q and k: 16 key heads of 128 at 0.8B and 9B
    wide = torch.randn(T, key + 2 * H * V + 2 * H, device="cuda").to(dtype)
    gate = wide[:, key + H * V:key + 2 * H * V].view(T, H, V)
    weight = (1 + 0.3 * torch.randn(V, device="cuda")).to(dtype)
    ends = [torch.tensor([n], dtype=torch.int32, device="cuda") for n in (states_end, states_end, branches_end)]
    args = (x_states, x_branches, gate, weight, *ends, 1e-6)
    floor_ms = 3 * T * H * V * 2 / bandwidth * 1e3
    compiled = torch.compile(reference.gated_norm, dynamic=False)
    fns = {"triton": lambda: kernel.gated_norm(*args), "inductor": lambda: compiled(*args),
           "eager": lambda: reference.gated_norm(*args)}
    if sweep:
        for bt, warps in SWEEP:
            fns[f"triton[T{bt},w{warps}]"] = lambda bt=bt, warps=warps: kernel.gated_norm(*args, block_t=bt,
                                                                                           num_warps=warps)
    want = reference.gated_norm(*args)
    rows = []
    for engine, fn in fns.items():
        out = fn()
        torch.cuda.synchronize()
        ms = do_bench_cudagraph(fn, return_mode="median")
        row = {"workload": name, "model": f"H{H}-V{V}", "engine": engine, "metric": "gated_norm_ms", "value": ms,
               "unit": "ms", "hardware": torch.cuda.get_device_name(), "tokens": T, "floor_ms": floor_ms,
               "x_floor": ms / floor_ms, "equal_bits_vs_eager": (out == want).float().mean().item(),
               "max_abs_err_vs_eager": (out.float() - want.float()).abs().max().item()}
        rows.append(row)
        print(f"{name:20} {engine:16} T={T:6} {ms:8.4f} ms  floor {floor_ms:7.4f} ms x{row['x_floor']:.1f}  "
              f"equal bits {row['equal_bits_vs_eager']:.4f}  max err {row['max_abs_err_vs_eager']:.1e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="also time the triton kernel's other tiles")
    args = parser.parse_args()
    torch._inductor.config.emulate_precision_casts = True  # as the engine compiles (`runtime.rounding: eager`)
    bandwidth = copy_bandwidth()
    print(f"ceiling: {bandwidth / 1e12:.2f} TB/s copy")
    rows = []
    for name, (T, H, states_end, branches_end) in STREAMS.items():
        rows += bench(name, T, H, states_end, branches_end, bandwidth, args.sweep)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    write_beside(args.out, rows)


if __name__ == "__main__":
    main()
