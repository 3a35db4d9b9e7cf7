"""The forked gated delta rule on the GPU: Flide's two-call fork against its floor and against the same kernel
without forking.

    python benchmarks/ops/bench_gated_delta.py --out benchmarks/results/ops_gated_delta.json

Shapes: the Gated DeltaNet layers of Qwen3.5-0.8B (16 key heads, 16 value heads, dims 128) and 9B (16 / 32 / 128)
on two streams: a 2,000-token state with 64 questions of 40 tokens, and 64 RACE-sized requests (a 300-token state
and 4 questions of 45 tokens each). Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph).

- `fork` (the `gated_delta` variant through `flide.ops.gated_delta.fork`): states from zero, then every question
  from its state's final fp32 state (the metadata-driven chunk lists, no host sync);
- `questions:chunk` / `questions:recurrent`: the question call alone (`branches.py`, the fork's second call) in
  its two forms, from the states' final states (with --sweep also `questions:<form>[BV..,w..]`: other tiles);
- `fork:tables`: `fork` as the model runs it, the state call from the round's tables (`fork_tables`);
- `questions:cuda`: the CUDA C question kernel (`questions_cuda.py`; --sweep: `questions:cuda[L..,w..]`, lanes
  along K and warps, and `questions:cuda-lazy[...]` with the lazy decay) on normalised q / k, and
  `questions:recurrent-normed` (--sweep: its tiles), the Triton kernel on the same inputs, as the fork runs it;
- `fork:wy`: the `fla_wy` variant's fork from the same tables: the questions' WY form from the state call's
  chunk-local steps, then the chunked question call; `questions:wy`: that question call alone (`questions_wy.py`;
  --sweep: other tiles);
- `unforked`: the same fla kernel once over the whole stream as one varlen call of the same segments, each from
  zero (what the stream costs without the fork: no state gather, one call; it answers nothing correctly);
- `floor`: the larger of FLOPs over the measured bf16 matmul rate and bytes over the measured copy bandwidth. FLOPs
  of the chunked form (chunk C = 64), per token and value head: 2*K*V (decay + delta update of the state, k^T u),
  2*K*V (q . h), 2*C*(K + V) (intra-chunk q k^T and its product with u), 2*C*K (k k^T for the WY form): an
  estimate of the useful work, not of fla's exact instruction count. Bytes: q, k, v, o in bf16, g and beta once, and
  the fp32 final states written and gathered once per state.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flide.ops.gated_delta import (BRANCH_KERNELS, STATE_KERNELS, branches, fork, fork_tables, questions_cuda,
                                   questions_wy)
from flide.ops.gated_delta.l2norm import l2norm
from flide.ops.registry import resolve
from flide.round import Shape, build_round
from flide.testing import synthetic_request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fork_attention import measure_ceilings

MODELS = {"0.8B": (16, 16, 128, 128), "9B": (16, 32, 128, 128)}  # key heads, value heads, K, V
STREAMS = {"2000+64x40": (1, 2000, 64, 40), "64xRACE": (64, 300, 4, 45),
           # 16xRACE@bucket's requests without the bucket's 960 spare branch rows: what the spare rows cost
           "16xRACE": (16, 300, 4, 45)}
# One RACE-sized request in the tables of the smallest default bucket that holds it, spare rows included: a captured
# round pays for its bucket's capacities, not its own (the first H200 profile found 30 ms there, 2026-11-30)
BUCKETED = {"RACE@bucket": (1, 300, 4, 45),
            # the sweep workload's shapes: a 2,000-token state with 1 or 8 QuALITY-sized questions (~120 tokens),
            # where a question's token chain, not the number of programs, sets the question call's time
            "sweep1@bucket": (1, 2000, 1, 120), "sweep8@bucket": (1, 2000, 8, 120),
            # the round of `flide serve` at 32 clients: ~16 RACE requests in the 8,192 bucket
            "16xRACE@bucket": (16, 300, 4, 45)}
CHUNK = 64
# --sweep: (value columns per program, warps[, chunk]) of the question kernel's two forms (branches.py's defaults:
# 16 / 1 recurrent, 64 / 4 / 16 chunk). 32-token chunks: half as many dependent chunk steps and twice the rows per
# tensor-core product, for the longer (~120-token) questions of QuALITY and the sweep
# The recurrent form's third element: row programs (branches.ROW_PROGRAMS; 0 = a program per row)
SWEEP = {"recurrent": [(8, 1), (32, 1), (32, 2), (64, 2), (64, 4), (16, 1, 16), (16, 1, 32), (16, 1, 64),
                       (16, 1, 128), (32, 1, 64)],
         "chunk": [(32, 4), (64, 8), (128, 4), (128, 8), (64, 4, 32), (64, 8, 32), (128, 8, 32)]}


def tile_label(tiles: tuple[int, ...] | None, third: str = "C") -> str:
    """`[BV16,w1]` / `[BV64,w4,C32]` (chunk) / `[BV16,w1,P64]` (row programs) for swept tiles; empty for the form's
    defaults."""
    if not tiles:
        return ""
    return f"[BV{tiles[0]},w{tiles[1]}" + (f",{third}{tiles[2]}" if len(tiles) > 2 else "") + "]"


def stream(requests: int, state: int, questions: int, question: int, bucketed: bool = False):
    preps = [synthetic_request(np.ones(state), [np.ones(question)] * questions) for _ in range(requests)]
    tokens = requests * (state + questions * question)
    if bucketed:
        from flide.config import CapacityConfig
        from flide.graphs.buckets import bucket_for, bucket_shape

        caps = CapacityConfig()
        return build_round(preps, bucket_shape(bucket_for(tokens, caps), caps, 2), 0).tensors
    tokens = -(-tokens // CHUNK) * CHUNK
    return build_round(preps, Shape(tokens, requests, requests * questions, requests * questions, 2), 0).tensors


def floor_ms(tokens: int, states: int, hv: int, k: int, v: int, hk: int, flops_rate: float, bandwidth: float) -> float:
    flops = tokens * hv * (4 * k * v + 2 * CHUNK * (k + v) + 2 * CHUNK * k)
    moved = tokens * (2 * hk * k * 2 + 2 * hv * v * 2 + hv * (4 + 2)) + 2 * states * hv * k * v * 4
    return max(flops / flops_rate, moved / bandwidth) * 1e3


def main() -> None:
    from triton.testing import do_bench_cudagraph

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="fla")
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--streams", nargs="+", default=[*STREAMS, *BUCKETED], choices=[*STREAMS, *BUCKETED])
    parser.add_argument("--no-ceilings", action="store_true",
                        help="skip measuring the matmul rate and copy bandwidth (floors then use 759 TFLOP/s, 4.22 TB/s,"
                             " the H200's measured 2026-11-30)")
    parser.add_argument("--only", default=None, help="a regular expression: time only the impls it matches")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the question kernel's other tiles (value columns, warps) in both forms")
    args = parser.parse_args()
    kernel = resolve("gated_delta", args.variant)
    flops_rate, bandwidth = (759e12, 4.22e12) if args.no_ceilings else measure_ceilings()
    rows = []
    for model in args.models:
        hk, hv, k, v = MODELS[model]
        for name in args.streams:
            spec = {**STREAMS, **BUCKETED}[name]
            r = stream(*spec, bucketed=name in BUCKETED).to("cuda")
            T = r.seg_lo.shape[0]
            g = torch.Generator(device="cuda").manual_seed(0)
            q, kk = (torch.randn(T, hk, k, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
            vv = torch.randn(T, hv, v, device="cuda", generator=g, dtype=torch.bfloat16)
            decay = -torch.nn.functional.softplus(torch.randn(T, hv, device="cuda", generator=g)) * 0.5
            beta = torch.sigmoid(torch.randn(T, hv, device="cuda", generator=g)).to(torch.bfloat16)
            # every segment of the stream from zero, in one call: the unforked cost of the same tokens
            seg_start = torch.cat([r.state_start, r.branch_start])
            seg_len = torch.cat([r.state_len, r.branch_len])
            order = torch.argsort(torch.where(seg_len > 0, seg_start, seg_start.new_full((), 1 << 40)))
            seg_start, seg_len = seg_start[order], seg_len[order]
            none = torch.full_like(seg_start, -1)
            empty = q.new_zeros(0, hv, k, v, dtype=torch.float32)
            scale = k ** -0.5
            fns = {  # partials: each binds this iteration's tensors
                "fork": partial(fork, kernel, q, kk, vv, decay, beta, r.state_start, r.state_len, r.branch_start,
                                r.branch_len, r.branch_state, scale, True,
                                branch_kernel=BRANCH_KERNELS.get(kernel)),
                "unforked": partial(kernel, q, kk, vv, decay, beta, seg_start, seg_len, empty, none, scale, True),
            }
            # the model's path: the state call from the round's tables (fork_tables, once per forward), and the
            # `fla_wy` variant's fork (the questions' WY form from the state call, its chunked question call)
            tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                                 r.branch_chunks, branch_state=r.branch_state)
            meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state, scale, True)
            if STATE_KERNELS.get(kernel) is not None:
                fns["fork:tables"] = partial(fork, kernel, q, kk, vv, decay, beta, *meta,
                                             branch_kernel=BRANCH_KERNELS.get(kernel),
                                             state_kernel=STATE_KERNELS[kernel], tables=tables)
            wy = resolve("gated_delta", "fla_wy")
            fns["fork:wy"] = partial(fork, wy, q, kk, vv, decay, beta, *meta, branch_kernel=BRANCH_KERNELS[wy],
                                     state_kernel=STATE_KERNELS[wy], tables=tables, wy=True)
            _, wy_finals, qn, kn, w, u, gamma = STATE_KERNELS[wy](
                q, kk, vv, decay, beta, tables.all_cu_seqlens, tables.all_chunks, tables.state_cu_seqlens,
                tables.state_chunks, tables.state_chunk_offsets, scale, True)
            for tiles in (None, *(((16, 4), (32, 8), (64, 8), (16, 8)) if args.sweep else ())):
                fns[f"questions:wy{tile_label(tiles)}"] = partial(
                    questions_wy.questions_wy, qn, kn, w, u, gamma, r.branch_start, r.branch_len, wy_finals,
                    r.branch_state, scale, tiles=tiles)
            if BRANCH_KERNELS.get(kernel) is not None:
                # the question call alone, in both forms of branches.py, from the states' real final states
                _, finals = fns["fork"]()
                for form in branches.FORMS:
                    for tiles in (None, *(SWEEP[form] if args.sweep else ())):  # None: the form's default tiles
                        label = f"questions:{form}{tile_label(tiles, 'C' if form == 'chunk' else 'P')}"
                        fns[label] = partial(branches.branches, q, kk, vv, decay, beta, r.branch_start, r.branch_len,
                                             finals, r.branch_state, scale, True, form=form, tiles=tiles)
                # the CUDA C kernel (questions_cuda.py) takes q / k normalised, as the fork's state call returns them;
                # `questions:recurrent-normed` is the Triton kernel on the same inputs, for a like-for-like pair
                qn, kn = l2norm(q), l2norm(kk)
                for tiles in (None, *(SWEEP["recurrent"] if args.sweep else ())):
                    fns[f"questions:recurrent-normed{tile_label(tiles, 'P')}"] = partial(
                        branches.branches, qn, kn, vv, decay, beta, r.branch_start, r.branch_len, finals,
                        r.branch_state, scale, False, tiles=tiles)
                sweep = [(*t, lazy) for lazy in (False, True) for t in questions_cuda.TILES if t[0] <= 2 or lazy]
                for tiles in (None, *(sweep if args.sweep else ())):
                    label = ("questions:cuda" + ("-lazy" if tiles and tiles[2] else "")
                             + (f"[L{tiles[0]},w{tiles[1]}]" if tiles else ""))
                    fns[label] = partial(questions_cuda.branches_cuda, qn, kn, vv, decay, beta, r.branch_start,
                                         r.branch_len, finals, r.branch_state, scale, tiles=tiles)
            states = int((r.state_len > 0).sum())
            floor = floor_ms(T, states, hv, k, v, hk, flops_rate, bandwidth)
            for engine, fn in fns.items():
                if args.only and not re.search(args.only, engine):
                    continue
                fn()
                torch.cuda.synchronize()
                ms = do_bench_cudagraph(fn, return_mode="median")
                rows.append({"op": "gated_delta", "variant": args.variant, "impl": engine, "model": model,
                             "stream": name, "tokens": T, "ms": round(ms, 4), "floor_ms": round(floor, 4),
                             "x_floor": round(ms / floor, 2)})
                print(json.dumps(rows[-1]), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "bf16_tflops": round(flops_rate / 1e12, 1), "copy_tb_s": round(bandwidth / 1e12, 2), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        lines = ["| model | stream | impl | ms | floor ms | x floor |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {x['model']} | {x['stream']} | {x['impl']} | {x['ms']} | {x['floor_ms']} | {x['x_floor']} |"
                  for x in rows]
        Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
