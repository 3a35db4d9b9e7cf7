"""The state call's chunk-to-chunk part: fla's h step + o step (two launches, the per-chunk states written and read
back) against our fused kernel (`gated_delta/state_chain.py`: one launch, states in registers), per tile.

    python benchmarks/ops/bench_state_chain.py [--value-heads 16] [--out benchmarks/results/ops_state_chain_h200.json]
        [--split-tokens 1024 512] [--long-tiles 32,4,3 64,4,2] [--tiles 32,4,2]

Inputs as the state call gives them (the laid-out, normalised q / k / v of bench_fla_configs.py; the gate cumsum
and WY form from fla's own steps, computed once); times: medians of CUDA-graph replays. Each fused row also gives
its largest difference from fla's outputs (over the states' rows) and final states, relative to their largest
magnitude: the two compute the same equations with the same roundings of their inputs, in other accumulation
splits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fla_configs import STREAMS, state_call_inputs  # noqa: E402

from flide.config import GDN_CHUNK  # noqa: E402
from flide.ops.gated_delta import fla, state_chain  # noqa: E402

# one stage (no software pipelining of the next chunk's loads) hit an illegal memory access on the H200's Triton
# 3.6 (session 29, in this bench's first run) and is not swept (state_chain refuses it)
TILES = [(32, 4, 2), (32, 4, 3), (16, 4, 2), (64, 4, 2)]
# more state lengths between RACE's and the sweep's (requests, state tokens, questions, question tokens)
EXTRA_STREAMS = {"state1000@bucket": (1, 1000, 4, 45), "8xMultiRC@bucket": (8, 330, 40, 25)}


def main() -> None:
    from triton.testing import do_bench_cudagraph

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    streams = {**STREAMS, **EXTRA_STREAMS}
    parser.add_argument("--streams", nargs="+", default=list(streams), choices=list(streams))
    parser.add_argument("--value-heads", type=int, default=16)
    parser.add_argument("--tiles", nargs="*", default=None, metavar="BV,WARPS,STAGES",
                        help="the fused chain's tiles to time (default: TILES)")
    parser.add_argument("--split-tokens", type=int, nargs="*", default=[],
                        help="also time the split call (`state_chain_split`: sequences over N tokens through the "
                             "LONG chain + the outputs kernel, the rest fused), for each N; with --fla-outputs also with "
                             "fla's o step in place of the outputs kernel")
    parser.add_argument("--long-tiles", nargs="*", default=[], metavar="BV,WARPS,STAGES",
                        help="the LONG part's tiles for the split rows (default: state_chain.LONG_TILES)")
    parser.add_argument("--output-tiles", nargs="*", default=[], metavar="BV,WARPS,STAGES",
                        help="the outputs kernel's tiles (default: state_chain.OUTPUT_TILES)")
    parser.add_argument("--fla-outputs", action="store_true", help="also the split call with fla's o step")
    parser.add_argument("--segments", type=int, nargs="*", default=[], metavar="TOKENS",
                        help="also time the two-level chain (`segment_scan.state_chain_segments`, sequences over "
                             "fla.FUSED_MAX_TOKENS in segments of TOKENS), for each TOKENS; its tables built once "
                             "outside the timing, as the engine builds them once per forward")
    parser.add_argument("--reference", action="store_true",
                        help="also each variant's error against the fp32 token-by-token reference (slow: a Python "
                             "loop over the stream)")
    args = parser.parse_args()
    tiles_swept = [tuple(int(x) for x in t.split(",")) for t in args.tiles] if args.tiles is not None else TILES
    long_tiles = [None, *(tuple(int(x) for x in t.split(",")) for t in args.long_tiles)]
    output_tiles = [None, *(tuple(int(x) for x in t.split(",")) for t in args.output_tiles)]
    # (LONG tiles, outputs tiles, fla's o step): each variant with the other's default
    variants = [(lt, None, False) for lt in long_tiles] + [(None, ot, False) for ot in output_tiles[1:]]
    variants += [(None, None, True)] if args.fla_outputs else []
    device = "cuda"
    hk, hv, dim = 16, args.value_heads, 128
    cumsum, _, fwd_h, fwd_o, rcp_ln2 = fla._fla_steps()  # with Flide's sm_90 pins
    rows = []
    for name in args.streams:
        r, (q, k, v, g, beta), tables = state_call_inputs(streams[name], hk, hv, dim, device)
        T = r.seg_lo.shape[0]
        cu, chunks, offsets = tables.state_cu_seqlens, tables.state_chunks, tables.state_chunk_offsets
        gc = cumsum(g[None].float(), chunk_size=GDN_CHUNK, scale=rcp_ln2, cu_seqlens=cu, chunk_indices=chunks)
        w, u, _ = fla._intra(k[None], v[None], gc, beta[None], cu, chunks)
        scale = dim ** -0.5

        def fla_h_o():
            h, v_new, final = fwd_h(k=k[None], w=w, u=u, g=gc, initial_state=None, output_final_state=True,
                                    chunk_size=GDN_CHUNK, cu_seqlens=cu, chunk_indices=chunks, chunk_offsets=offsets)
            o = fwd_o(q=q[None], k=k[None], v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu, chunk_size=GDN_CHUNK,
                      chunk_indices=chunks)
            return o[0], final

        want_o, want_final = fla_h_o()
        torch.cuda.synchronize()
        base = do_bench_cudagraph(fla_h_o, return_mode="median")
        state_rows = torch.zeros(T, dtype=torch.bool, device=device)
        state_rows[: int(r.state_len.sum()) + int(r.state_start[0])] = True
        state_rows[: int(r.state_start[0])] = False
        base_row = {"stream": name, "tokens": T, "value_heads": hv, "kernel": "fla h + o", "tiles": "", "ms": base}
        truth = None
        if args.reference:
            from flide.ops.gated_delta import reference

            start, lens = r.state_start, r.state_len
            truth, _ = reference.gated_delta(q.float(), k.float(), v.float(), g.float(), beta.float(), start, lens,
                                             torch.zeros(0, hv, dim, dim, device=device),
                                             torch.full_like(start, -1), scale, False)

            def err(o):
                return ((o[state_rows].float() - truth[state_rows]).abs().max()
                        / truth[state_rows].abs().max()).item()

            base_row["rel_err_o_vs_fp32"] = err(want_o)
        rows.append(base_row)
        print(json.dumps(base_row), flush=True)
        for split in args.split_tokens:
            long_chunks, long_offsets = fla.split_tables(cu, chunks.shape[0], split)
            for lt, ot, fla_o in variants:
                def outputs(h, v_new, long_chunks=long_chunks):
                    return fwd_o(q=q[None], k=k[None], v=v_new[None], h=h[None], g=gc, scale=scale, cu_seqlens=cu,
                                 chunk_size=GDN_CHUNK, chunk_indices=long_chunks)[0]

                def split_call(split=split, lt=lt, ot=ot, fla_o=fla_o, long_chunks=long_chunks,
                               long_offsets=long_offsets, outputs=outputs):
                    return state_chain.state_chain_split(q, k, w[0], u[0], gc[0], cu, scale, split, long_chunks,
                                                         long_offsets, outputs if fla_o else None, long_tiles=lt,
                                                         output_tiles=ot)

                o, final = split_call()
                torch.cuda.synchronize()
                ms = do_bench_cudagraph(split_call, return_mode="median")
                n = final.shape[0]  # the split call's sequences: without the trailing empty one, as in the engine
                tiles_name = ("fla o" if fla_o else "long " + ("BV{},w{},s{}".format(*lt) if lt else "default")
                              + (", out BV{},w{},s{}".format(*ot) if ot else ""))
                rows.append({"stream": name, "tokens": T, "value_heads": hv, "kernel": f"split@{split}",
                             "tiles": tiles_name, "ms": ms, "vs_fla": ms / base,
                             "rel_diff_o": ((o[state_rows].float() - want_o[state_rows].float()).abs().max()
                                            / want_o[state_rows].float().abs().max()).item(),
                             "rel_diff_final": ((final - want_final[:n]).abs().max()
                                                / want_final[:n].abs().max()).item()})
                if truth is not None:
                    rows[-1]["rel_err_o_vs_fp32"] = err(o)
                print(json.dumps(rows[-1]), flush=True)
        for seg_tokens in args.segments:
            from flide.ops.gated_delta import segment_scan

            seg_tables = segment_scan.segment_tables(cu, fla.FUSED_MAX_TOKENS, T, seg_tokens)

            def segments(seg_tables=seg_tables, seg_tokens=seg_tokens):
                return segment_scan.state_chain_segments(q, k, w[0], u[0], gc[0], seg_tables, cu.shape[0] - 2,
                                                         scale, seg_tokens, empty_finals=False)

            o, final = segments()
            torch.cuda.synchronize()
            ms = do_bench_cudagraph(segments, return_mode="median")
            n = final.shape[0]
            used = (cu[1:n + 1] - cu[:n]) > 0
            rows.append({"stream": name, "tokens": T, "value_heads": hv, "kernel": f"segments@{seg_tokens}",
                         "tiles": "", "ms": ms, "vs_fla": ms / base,
                         "rel_diff_o": ((o[state_rows].float() - want_o[state_rows].float()).abs().max()
                                        / want_o[state_rows].float().abs().max()).item(),
                         "rel_diff_final": ((final[used] - want_final[:n][used]).abs().max()
                                            / want_final[:n][used].abs().max()).item()})
            if truth is not None:
                rows[-1]["rel_err_o_vs_fp32"] = err(o)
            print(json.dumps(rows[-1]), flush=True)
        for tiles in tiles_swept:
            def ours(tiles=tiles):
                return state_chain.state_chain(q, k, w[0], u[0], gc[0], cu, scale, tiles=tiles)

            try:
                o, final = ours()
                torch.cuda.synchronize()
                ms = do_bench_cudagraph(ours, return_mode="median")
            except Exception as error:  # a tile that does not compile (shared memory) is reported, not fatal
                rows.append({"stream": name, "kernel": "fused", "tiles": str(tiles), "error": repr(error)[:300]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            diff_o = ((o[state_rows].float() - want_o[state_rows].float()).abs().max()
                      / want_o[state_rows].float().abs().max()).item()
            n = want_final.shape[0]
            diff_final = ((final[:n] - want_final).abs().max() / want_final.abs().max()).item()
            rows.append({"stream": name, "tokens": T, "value_heads": hv, "kernel": "fused",
                         "tiles": "BV{},w{},s{}".format(*tiles), "ms": ms, "vs_fla": ms / base, "rel_diff_o": diff_o,
                         "rel_diff_final": diff_final})
            print(json.dumps(rows[-1]), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        md = ["| stream | kernel | tiles | ms | x fla | rel diff o | rel diff final |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        md += [f"| {r['stream']} | {r['kernel']} | {r.get('tiles', '')} | "
               + (f"{r['ms']:.4f} | {r.get('vs_fla', 1.0):.2f} | {r.get('rel_diff_o', 0):.1e} | "
                  f"{r.get('rel_diff_final', 0):.1e} |" if "ms" in r else f"error | | | {r['error'][:80]} |")
               for r in rows]
        Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
