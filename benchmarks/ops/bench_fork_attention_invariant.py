"""The batch-invariant fork attention kernel (flide/ops/fork_attention/triton_invariant.py) against Flide's fast Triton
kernel (triton.py) and flex, on the streams of bench_fork_attention.py plus two that show its extra costs:

    python benchmarks/ops/bench_fork_attention_invariant.py --out benchmarks/results/ops_fork_attention_invariant.json
    python benchmarks/ops/bench_fork_attention_invariant.py --out ... --sweep   # also other tiles of the invariant kernel

Streams: a 2,000-token state with 64 questions of 40 tokens; 64 RACE-sized requests (300-token state, 4 questions of
45); a 2,000-token state with 256 questions of 8 tokens (four questions a query block: the invariant kernel walks
each question's own tiles separately); 40 RACE-sized requests padded to a 30,720-token bucket (a third pads: the
invariant kernel copies a pad's value row, triton.py scores one or two tiles). Shapes: Qwen3.5-0.8B (8/2/256) and
9B (16/4/256), bf16. Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph); the floor is
bench_fork_attention.py's. Rows carry the key tiles the Triton kernels visited, summed over programs
(`key_tiles`: masked + unmasked for triton.py), the relative RMS error against flex, and for the invariant kernel
its time and tiles over triton.py's (`x_triton`, `tiles_x_triton`). With --sweep, rows `triton-invariant[M..,N..,w..,s..]`
time other tiles (each tile config gives other bits: choosing one changes batch-invariant mode's answers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fork_attention import measure_ceilings, rel_err, stream, visible_pairs

from flide.ops.registry import resolve
from flide.round import Shape, build_round
from flide.testing import synthetic_request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tables import write_beside  # noqa: E402 (after the path line, as the flide imports)


def padded_stream(requests: int, state: int, questions: int, question: int, tokens: int):
    preps = [synthetic_request(np.ones(state), [np.ones(question)] * questions) for _ in range(requests)]
    return build_round(preps, Shape(tokens, requests, requests * questions, requests * questions, 2), 0).tensors


# bf16 dim-256 tiles tried by --sweep (BLOCK_M, BLOCK_N, num_warps, num_stages): ptxas (sm_90a, triton 3.6) counts
# 64 bytes of spills a thread for the default (128, 64, 8, 2), none for (128, 32, 8, 2 or 3)
SWEEP = [(128, 32, 8, 3), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)]


def bench_shape(sname: str, mname: str, r, heads: tuple[int, int, int], ceilings: tuple[float, float],
                sweep: bool = False) -> list[dict]:
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench_cudagraph

    from flide.ops.fork_attention import triton as fast
    from flide.ops.fork_attention import triton_invariant as inv

    flops_rate, bandwidth = ceilings
    hq, hkv, d = heads
    T = r.seg_lo.shape[0]
    dtype = torch.bfloat16
    q = torch.randn(T, hq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(T, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
    floor_s = max(4 * visible_pairs(r) * d * hq / flops_rate, (2 * q.numel() + 2 * k.numel()) * 2 / bandwidth)
    meta = (r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5)
    flex = resolve("fork_attention", "flex")
    fns = {"flex": lambda: flex(q, k, v, *meta),
           "triton": lambda: fast.fork_attention(q, k, v, *meta),
           "triton-invariant": lambda: inv.fork_attention(q, k, v, *meta)}
    # the value columns in two programs (`triton_invariant.V_SPLIT_DIM`): no spills at dim 256 (session 33, offline)
    fns["triton-invariant[2 value parts]"] = lambda: inv.fork_attention(q, k, v, *meta, v_parts=2)
    # the one-path tile (`triton_invariant.LEAN_TILES` False, session 34's baseline) against the default
    other = "one-path" if inv.LEAN_TILES else "lean"
    fns[f"triton-invariant[{other} tiles]"] = lambda: inv.fork_attention(q, k, v, *meta, lean=not inv.LEAN_TILES)
    if sweep:
        for c in SWEEP:
            fns[f"triton-invariant[M{c[0]},N{c[1]},w{c[2]},s{c[3]}]"] = (
                lambda c=c: inv.fork_attention(q, k, v, *meta, config=inv.Config(*c)))
    fast_stats = torch.zeros(hkv * fast.query_blocks(T, hq, hkv, d, dtype), 2, dtype=torch.int32, device="cuda")
    fast.fork_attention(q, k, v, *meta, stats=fast_stats)
    inv_stats = torch.zeros(hkv * inv.query_blocks(T, hq, hkv, d, dtype), dtype=torch.int32, device="cuda")
    inv.fork_attention(q, k, v, *meta, stats=inv_stats)
    tiles = {"triton": int(fast_stats.sum()), "triton-invariant": int(inv_stats.sum())}
    flex_out = flex(q, k, v, *meta)
    rows = []
    for engine, fn in fns.items():
        try:
            out = fn()
            torch.cuda.synchronize()
        except OutOfResources as error:  # a sweep tile that needs more shared memory or registers than there are
            print(f"{sname:22} {mname:13} {engine:17} skipped: {error}"[:300])
            continue
        ms = do_bench_cudagraph(fn, return_mode="median")
        row = {"workload": sname, "model": mname, "engine": engine, "metric": "fork_attention_ms", "value": ms,
               "unit": "ms", "hardware": torch.cuda.get_device_name(), "tokens": T,
               "floor_ms": floor_s * 1e3, "x_floor": ms / (floor_s * 1e3)}
        extra = ""
        if engine != "flex":
            row["rel_err_vs_flex"] = rel_err(out, flex_out)
            extra = f"  rel err vs flex {row['rel_err_vs_flex']:.1e}"
        if engine in tiles:
            row["key_tiles"] = tiles[engine]
            extra += f"  tiles {tiles[engine]:7}"
        if engine.startswith("triton-invariant"):
            fast_ms = next(x["value"] for x in rows if x["engine"] == "triton")
            row["x_triton"] = ms / fast_ms
            extra += f"  x{row['x_triton']:.2f} triton's time"
            if engine in tiles:
                row["tiles_x_triton"] = tiles[engine] / tiles["triton"]
                extra += f", x{row['tiles_x_triton']:.2f} its tiles"
        rows.append(row)
        print(f"{sname:22} {mname:13} {engine:17} T={T:6} {ms:8.3f} ms  floor {floor_s * 1e3:7.3f} ms "
              f"x{row['x_floor']:.1f}{extra}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="also time the invariant kernel's other tile configs")
    parser.add_argument("--streams", nargs="+", help="only these streams (default: all)")
    parser.add_argument("--models", nargs="+", help="only these head shapes, e.g. qwen3.5-0.8b (default: all)")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings[0] / 1e12:.0f} TFLOP/s bf16, {ceilings[1] / 1e12:.2f} TB/s copy")
    streams = {"state2000_q64x40": stream(1, 2000, 64, 40), "race64": stream(64, 300, 4, 45),
               "quality_like": stream(1, 4600, 16, 190),  # QuALITY: a 4.6k-token article, 16 questions
               "state2000_q256x8": stream(1, 2000, 256, 8), "race40_in_30720": padded_stream(40, 300, 4, 45, 30720)}
    shapes = {"qwen3.5-0.8b": (8, 2, 256), "qwen3.5-9b": (16, 4, 256)}
    streams = {n: r for n, r in streams.items() if not args.streams or n in args.streams}
    shapes = {n: h for n, h in shapes.items() if not args.models or n in args.models}
    rows = []
    for sname, r in streams.items():
        r = r.to("cuda")
        for mname, heads in shapes.items():
            rows += bench_shape(sname, mname, r, heads, ceilings, args.sweep)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    write_beside(args.out, rows)  # the markdown table beside the JSON


if __name__ == "__main__":
    main()
