"""fla-core's state-call kernels under each of their autotune configs, on the streams Flide's rounds give them.

    python benchmarks/ops/bench_fla_configs.py --out benchmarks/results/ops_fla_configs_h200.json

fla autotunes its kernels once per head-size key (`H`, `HV`, `K`, `V`, `BT`, ...), not per stream: whichever
round first reaches a kernel decides its config for every bucket after it (Flide warms up on a typical mix, see
graphs/runner.py). A RACE replay is latency-bound (one trunk of ~4 chunks: 64 programs for 16 heads) and a QuALITY
replay throughput-bound (126 chunks), so the best config may differ by bucket. This bench times each of the state
call's steps (`fla.run`: gate cumsum, intra = zero fill + fused kkt/solve + w/u, h, o) with one kernel pinned to each
of its configs in turn (the others as the autotuner picked them), and with the autotuner re-run on the stream itself
(`auto@stream`, its pick named). Times: medians of CUDA-graph replays (triton.testing.do_bench_cudagraph), in the
Qwen3.5-0.8B shapes (16 key / 16 value heads of 128; `--value-heads 32`: 4B / 9B's, e.g. `--out
benchmarks/results/ops_fla_configs_hv32_h200.json`) on the laid-out inputs the GDN layer's fused conv writes.

Flide pins each kernel to one config on sm_90 per value-head count measured (`fla.SM90_CONFIGS`, from this bench's
H200 runs) and, at 16 value heads, launches the kkt + solve kernel at 1 warp on long streams
(`fla.KKT_ONE_WARP_TOKENS`); here `fla.PIN_CONFIGS` is off.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gated_delta import BUCKETED, stream  # noqa: E402

from flide.config import GDN_CHUNK  # noqa: E402
from flide.ops.gated_delta import fla, fork_tables  # noqa: E402
from flide.ops.gated_delta.l2norm import prepare_qkv  # noqa: E402

# the trunk-heavy shapes Flide's buckets give the state call (requests, state tokens, questions, question tokens)
STREAMS = {**BUCKETED, "quality@bucket": (1, 7900, 16, 120)}
KERNELS = {  # name -> (fla module, kernel attribute, the state-call step that launches it)
    "cumsum": ("fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel", "cumsum"),
    "kkt_solve": ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel", "intra"),
    "w_u": ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel", "intra"),
    "h": ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "h"),
    "o": ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o", "o"),
}


def label(config) -> str:
    parts = [f"{k}{v}" for k, v in sorted(config.kwargs.items())]
    return ",".join([*parts, f"w{config.num_warps}", f"s{config.num_stages}"])


def parse_extra(spec: str):
    """`h:BV16,w4,s3` -> ("h", triton.Config({"BV": 16}, num_warps=4, num_stages=3)): a config outside fla's list."""
    import re

    import triton

    name, _, body = spec.partition(":")
    parts = [re.fullmatch(r"([A-Za-z_]+?)(\d+)", part) for part in body.split(",")]
    if name not in KERNELS or not body or not all(parts):
        raise SystemExit(f"--extra {spec!r}: want KERNEL:KEYvalue,...,wN,sN with KERNEL one of {list(KERNELS)}")
    kwargs, warps, stages = {}, 4, 3
    for key, value in (part.groups() for part in parts):
        if key == "w":
            warps = int(value)
        elif key == "s":
            stages = int(value)
        else:
            kwargs[key] = int(value)
    return name, triton.Config(kwargs, num_warps=warps, num_stages=stages)


def state_call_inputs(shape: tuple, hk: int, hv: int, dim: int, device: str):
    """A bucketed stream's round (`stream(*shape)`), random laid-out state-call inputs (q, k, v normalised as the
    GDN layer's fused conv writes them, log decays g, beta) and the round's fork tables."""
    r = stream(*shape, bucketed=True).to(device)
    T = r.seg_lo.shape[0]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(T, hk, dim, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(T, hv, dim, device=device, generator=gen, dtype=torch.bfloat16)
    q, k, v = prepare_qkv(q, k, v, True)
    g = -torch.nn.functional.softplus(torch.randn(T, hv, device=device, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(T, hv, device=device, generator=gen)).to(torch.bfloat16)
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                         branch_state=r.branch_state)
    return r, (q, k, v, g, beta), tables


def steps(q, k, v, g, beta, tables, scale):
    """The four steps of `fla.run` on laid-out inputs, each as a callable of no arguments (their inputs computed
    once here, as the previous step returns them)."""
    cumsum, intra, fwd_h, fwd_o, rcp_ln2 = fla._fla_steps()
    cu, chunks, offsets = tables.state_cu_seqlens, tables.state_chunks, tables.state_chunk_offsets
    q, k, v, beta = q[None], k[None], v[None], beta[None].to(q.dtype)

    def run_cumsum():
        return cumsum(g[None].float(), chunk_size=GDN_CHUNK, scale=rcp_ln2, cu_seqlens=cu, chunk_indices=chunks)

    gc = run_cumsum()

    def run_intra():
        return intra(k=k, v=v, g=gc, beta=beta, cu_seqlens=cu, chunk_size=GDN_CHUNK, chunk_indices=chunks)

    w, u, _ = run_intra()

    def run_h():
        return fwd_h(k=k, w=w, u=u, g=gc, initial_state=None, output_final_state=True, chunk_size=GDN_CHUNK,
                     cu_seqlens=cu, chunk_indices=chunks, chunk_offsets=offsets)

    h, v_new, _ = run_h()

    def run_o():
        return fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu, chunk_size=GDN_CHUNK,
                     chunk_indices=chunks)

    return {"cumsum": run_cumsum, "intra": run_intra, "h": run_h, "o": run_o}


def main() -> None:
    import importlib

    from triton.testing import do_bench_cudagraph

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--streams", nargs="+", default=list(STREAMS), choices=list(STREAMS))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--value-heads", type=int, default=16,
                        help="GDN value heads (16 key heads of 128): 16 is Qwen3.5-0.8B's, 32 4B / 9B's")
    parser.add_argument("--extra", nargs="+", default=[], metavar="KERNEL:CONFIG",
                        help="configs outside fla's lists, e.g. h:BV16,w4,s3 (timed as pinned; not in auto@stream)")
    args = parser.parse_args()
    extra = [parse_extra(spec) for spec in args.extra]
    device = "cuda"  # fla's kernels do not all run under Triton's interpreter
    fla.PIN_CONFIGS = False  # fla's own config lists and autotuner, as shipped (Flide pins one config on sm_90)
    hk, hv, dim = 16, args.value_heads, 128
    tuners = {name: fla.autotuner(getattr(importlib.import_module(module), attr))
              for name, (module, attr, _) in KERNELS.items()}
    every = {name: list(t.configs) for name, t in tuners.items()}
    rows = []
    for stream_name in args.streams:
        r, (q, k, v, g, beta), tables = state_call_inputs(STREAMS[stream_name], hk, hv, dim, device)
        T = r.seg_lo.shape[0]
        for name in args.kernels:
            tuner, step = tuners[name], KERNELS[name][2]
            candidates = [(label(c), [c]) for c in every[name]] + [("auto@stream", every[name])]
            candidates += [(label(c) + " (extra)", [c]) for n, c in extra if n == name]
            for tag, configs in candidates:
                tuner.configs = configs
                tuner.cache.clear()  # the pinned config, or the autotuner run again on this stream
                fn = steps(q, k, v, g, beta, tables, dim ** -0.5)[step]
                fn()
                torch.cuda.synchronize()
                ms = do_bench_cudagraph(fn, return_mode="median")
                picked = label(next(iter(tuner.cache.values()))) if tag == "auto@stream" and tuner.cache else ""
                rows.append({"stream": stream_name, "tokens": T, "value_heads": hv, "kernel": name, "step": step,
                             "config": tag, "picked": picked, "ms": round(ms, 4)})
                print(json.dumps(rows[-1]), flush=True)
            tuner.configs = every[name]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        md = ["| stream | kernel (step) | config | step ms | autotuner's pick |", "| --- | --- | --- | ---: | --- |"]
        md += [f"| {r['stream']} | {r['kernel']} ({r['step']}) | {r['config']} | {r['ms']:.4f} | {r['picked']} |"
               for r in rows]
        Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
