"""The forked depthwise conv of Gated DeltaNet on the GPU: each variant against its floor and against the plain
causal conv without forking.

    python benchmarks/ops/bench_fork_conv.py --out benchmarks/results/ops_fork_conv.json
    python benchmarks/ops/bench_fork_conv.py --out ... --sweep   # also the triton kernel's other tiles

Streams: a 2,000-token state with 64 questions of 40 tokens (T=4,608), and 64 RACE-sized requests (300-token state,
4 questions of 45; T=30,720, about the largest bucket). Channels: 6,144 (Qwen3.5-0.8B's conv: 2 x 16 x 128 + 16 x
128), kernel width 4, SiLU, bf16 inputs and weights. Times are medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph). The floor is the bytes that must move (x read once, the output written once)
over the measured copy bandwidth. "conv1d-stream" is `F.conv1d` (depthwise, causal padding) over the whole stream
as one sequence plus SiLU: what an engine without forks would run (cuDNN; answering nothing correctly). `triton` rows
carry their largest difference from the fp32 reference (`max_abs_err_vs_reference`) where the reference fits;
with --sweep, rows `triton[T..,D..,w..]` time other (BLOCK_T, BLOCK_D, num_warps) tiles and `triton-qkv[T..,w..]`
the laid-out form's (BLOCK_T, num_warps). `triton+prepare_qkv` and
`triton-qkv` time the GDN layer's conv with the layout for the gated delta kernels (q / k L2-normalised) done after
it by the fla state call's launch, or by the conv itself (their floors: the conv's).
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

from flide.ops.fork_conv import reference
from flide.ops.registry import resolve
from flide.round import Shape, build_round
from flide.testing import synthetic_request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tables import write_beside  # noqa: E402 (after the path line, as the flide imports)


def stream(requests: int, state: int, questions: int, question: int):
    preps = [synthetic_request(np.ones(state), [np.ones(question)] * questions) for _ in range(requests)]
    tokens = -(-requests * (state + questions * question) // 128) * 128
    return build_round(preps, Shape(tokens, requests, requests * questions, requests * questions, 2), 0).tensors


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    x = torch.empty(2 ** 30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


# (BLOCK_T, BLOCK_D, num_warps) tried by --sweep; the default is flide.ops.fork_conv.triton's
SWEEP = [(16, 128, 4), (32, 128, 4), (64, 128, 8), (32, 256, 4), (64, 64, 4), (128, 64, 8)]
# (BLOCK_T, num_warps) of the laid-out form (`fork_conv_qkv`: a head's 128 channels a tile) tried by --sweep: as
# launched it takes 168 registers a thread at the default 32 x 4 warps (kernel_resources.py), 3 programs an SM
SWEEP_QKV = [(8, 1), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8)]


def bench_stream(sname: str, r, channels: int, width: int, bandwidth: float, sweep: bool) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    from flide.ops.fork_conv import triton as triton_kernel

    T = r.seg_lo.shape[0]
    key_heads = channels // 3 // 128  # Qwen3.5-0.8B / 4B's conv: q | k | v of 16 heads of 128 each at 6,144
    # the layer's gates (the fused form computes them too; before, two Inductor kernels), 16 value heads
    ab = torch.randn(T, 32, device="cuda", dtype=torch.bfloat16)
    gates = (ab[:, :16], ab[:, 16:], torch.randn(16, device="cuda"), torch.randn(16, device="cuda"))
    x = torch.randn(T, channels, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(channels, width, device="cuda") * 0.5).to(torch.bfloat16)
    floor_s = 2 * x.numel() * x.element_size() / bandwidth
    meta = (r.seg_lo, r.trunk_lo, r.trunk_hi, True)
    triton_op = resolve("fork_conv", "triton")
    fns = {
        "triton": lambda: triton_op(x, weight, *meta),
        "conv1d-stream": lambda: F.silu(F.conv1d(x.T[None], weight[:, None, :], padding=width - 1,
                                                 groups=channels)[0, :, :T]).T,
        "reference": lambda: resolve("fork_conv", "reference")(x, weight, *meta),
        # the GDN layer's two forms: the conv, then the fla state call's layout launch (q / k normalised); or the
        # conv laying them out itself (`fork_conv_qkv`, what the layer runs with fla since session 21)
        "triton+prepare_qkv": lambda: _then_prepare(triton_op(x, weight, *meta), key_heads, gates),
        "triton-qkv": lambda: triton_kernel.fork_conv_qkv(x, weight, *meta[:3], key_heads, 128, True, gates),
    }
    if sweep:
        for bt, bd, warps in SWEEP:
            fns[f"triton[T{bt},D{bd},w{warps}]"] = lambda bt=bt, bd=bd, warps=warps: triton_kernel.fork_conv(
                x, weight, *meta, block_t=bt, block_d=bd, num_warps=warps)
        for bt, warps in SWEEP_QKV:
            fns[f"triton-qkv[T{bt},w{warps}]"] = lambda bt=bt, warps=warps: triton_kernel.fork_conv_qkv(
                x, weight, *meta[:3], key_heads, 128, True, gates, block_t=bt, num_warps=warps)
    want = reference.fork_conv(x.float(), weight.float(), *meta) if T <= 8192 else None
    rows = []
    for engine, fn in fns.items():
        out = fn()
        torch.cuda.synchronize()
        ms = do_bench_cudagraph(fn, return_mode="median")
        row = {"workload": sname, "model": f"D{channels}-W{width}", "engine": engine, "metric": "fork_conv_ms",
               "value": ms, "unit": "ms", "hardware": torch.cuda.get_device_name(), "tokens": T,
               "floor_ms": floor_s * 1e3, "x_floor": ms / (floor_s * 1e3)}
        extra = ""
        if engine.startswith("triton") and want is not None and isinstance(out, torch.Tensor):
            row["max_abs_err_vs_reference"] = (out.float() - want).abs().max().item()
            extra = f"  max abs err vs fp32 reference {row['max_abs_err_vs_reference']:.1e}"
        rows.append(row)
        print(f"{sname:18} {engine:14} T={T:6} {ms:8.4f} ms  floor {floor_s * 1e3:7.4f} ms x{row['x_floor']:.1f}"
              f"{extra}", flush=True)
    return rows


def _then_prepare(out: torch.Tensor, key_heads: int, gates):
    """The unfused path's layout launch and its two gate kernels (eager torch here: the replay's Inductor kernels
    are one launch each too)."""
    from flide.ops.gated_delta.l2norm import prepare_qkv

    a, b, a_log, dt_bias = gates
    T, kc = out.shape[0], key_heads * 128
    laid_out = prepare_qkv(out[:, :kc].view(T, key_heads, 128), out[:, kc:2 * kc].view(T, key_heads, 128),
                           out[:, 2 * kc:].view(T, -1, 128), True)
    return laid_out, -a_log.exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--channels", type=int, default=6144)
    parser.add_argument("--sweep", action="store_true", help="also time the triton kernel's other tiles")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"ceiling: {bandwidth / 1e12:.2f} TB/s copy")
    rows = []
    streams = {"state2000_q64x40": stream(1, 2000, 64, 40), "race64": stream(64, 300, 4, 45)}
    for sname, r in streams.items():
        rows += bench_stream(sname, r.to("cuda"), args.channels, 4, bandwidth, args.sweep)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    write_beside(args.out, rows)  # the markdown table beside the JSON


if __name__ == "__main__":
    main()
