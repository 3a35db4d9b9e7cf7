"""The batch-invariant Triton linear layer against cuBLAS (`F.linear`) in bf16, on the projection shapes of Qwen3.5-0.8B
and Qwen3.5-4B.

    python benchmarks/ops/bench_linear.py --out benchmarks/results/ops_linear.json
    python benchmarks/ops/bench_linear.py --out ... --sweep          # also the triton kernel's other tiles
    python benchmarks/ops/bench_linear.py --out ... --rows 4096      # fewer batch sizes

Shapes: every linear layer of a decoder layer, read from the model configs in shared/models/qwen3_5/configs (this
checkout's shared/, else ../shared; see ../shared/notes/DATA.md), or from the built-in table below (the same values,
copied from those configs) where neither is present: attention q_proj (query and output gate: 2 x heads x 256),
k_proj, v_proj, o_proj; Gated DeltaNet in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; MLP gate_proj,
up_proj, down_proj. The lm head is left out (selective readout runs it on a few rows only). Rows M (tokens of a
round): 256, 1,024, 4,096, 16,384, 32,768.

Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph: the engine replays graphs too, so launch
overheads count as they do there). Per row: both times, `ratio` = triton / cuBLAS time (batch-invariant mode's target:
<= 1.11, i.e. >= 90% of cuBLAS throughput), TFLOP/s of both, and the largest difference between the two outputs.
Per model and M, a `total` row weighs each projection by the number of layers that have it: the time one forward
spends in linear layers. With --sweep, rows `triton[M..N..K..w..s..]` time other tiles (another BLOCK_K gives other
bits, but still batch-invariant ones).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flide.ops.linear import triton as lt

ROWS = [256, 1024, 4096, 16384, 32768]
MODELS = {"qwen3.5-0.8b": "qwen3.5-0.8b.json", "qwen3.5-4b": "qwen3.5-4b.json"}
# Used only where no config file is found: the fields below, as in shared/models/qwen3_5/configs
BUILTIN = {
    "qwen3.5-0.8b": {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
                     "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                     "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
                     "linear_key_head_dim": 128, "linear_value_head_dim": 128},
    "qwen3.5-4b": {"hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
                   "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                   "linear_key_head_dim": 128, "linear_value_head_dim": 128},
}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried by --sweep; the default is lt.default_config(bf16)
SWEEP = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
         (128, 64, 64, 4, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 128, 32, 8, 4)]
# the persistent TMA form (lt.Config.tma): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, warp_specialize), also
# with --sweep
TMA_SWEEP = [(128, 128, 64, 8, 3, False), (128, 128, 64, 8, 4, False), (128, 256, 64, 8, 3, False),
             (128, 128, 64, 4, 3, True), (128, 128, 64, 8, 3, True), (128, 256, 64, 8, 3, True)]


def model_config(name: str) -> tuple[dict, str]:
    """The model's config and where it came from (a config file, or the built-in table)."""
    for base in (ROOT / "shared", ROOT.parent / "shared"):
        path = base / "models" / "qwen3_5" / "configs" / MODELS[name]
        if path.exists():
            return json.loads(path.read_text()), str(path)
    return BUILTIN[name], "built-in table"


def projections(c: dict, fused: bool = True) -> list[tuple[str, int, int, int]]:
    """(name, K, N, layers that have it) for every linear layer of the decoder stack. fused: the GEMMs as the
    engine runs them (projections of one input stacked into one weight, flide/models/fused.py: q/k/v, the GDN's
    four input projections, gate/up); else one per nn.Linear."""
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    interval = c.get("full_attention_interval", 4)
    attention = sum(1 for i in range(layers) if (i + 1) % interval == 0)
    gdn = layers - attention
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    inter = c["intermediate_size"]
    if fused:
        return [
            ("attn.qkv_proj", hidden, 2 * heads * d + 2 * kv * d, attention),  # query + output gate, key, value
            ("attn.o_proj", heads * d, hidden, attention),
            ("gdn.in_proj", hidden, 2 * hk * dk + 2 * hv * dv + 2 * hv, gdn),  # qkv, z, b, a
            ("gdn.out_proj", hv * dv, hidden, gdn),
            ("mlp.gate_up_proj", hidden, 2 * inter, layers),
            ("mlp.down_proj", inter, hidden, layers),
        ]
    return [
        ("attn.q_proj", hidden, 2 * heads * d, attention),  # query and output gate
        ("attn.k_proj", hidden, kv * d, attention),
        ("attn.v_proj", hidden, kv * d, attention),
        ("attn.o_proj", heads * d, hidden, attention),
        ("gdn.in_proj_qkv", hidden, 2 * hk * dk + hv * dv, gdn),
        ("gdn.in_proj_z", hidden, hv * dv, gdn),
        ("gdn.in_proj_b", hidden, hv, gdn),
        ("gdn.in_proj_a", hidden, hv, gdn),
        ("gdn.out_proj", hv * dv, hidden, gdn),
        ("mlp.gate_proj", hidden, inter, layers),
        ("mlp.up_proj", hidden, inter, layers),
        ("mlp.down_proj", inter, hidden, layers),
    ]


def bench_shape(model: str, proj: str, m: int, k: int, n: int, layers: int, sweep: bool) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
    fns = {"cublas": lambda: F.linear(x, weight), "triton": lambda: lt.linear(x, weight, None)}
    if sweep:
        for bm, bn, bk, warps, stages in SWEEP:
            cfg = lt.Config(bm, bn, bk, 8, warps, stages)
            fns[f"triton[M{bm}N{bn}K{bk}w{warps}s{stages}]"] = lambda cfg=cfg: lt.linear(x, weight, None, config=cfg)
        if lt._tma_eligible(x, weight, n):
            for bm, bn, bk, warps, stages, ws in TMA_SWEEP:
                cfg = lt.Config(bm, bn, bk, 8, warps, stages, tma=True, warp_specialize=ws)
                label = f"triton_tma[M{bm}N{bn}K{bk}w{warps}s{stages}{'ws' if ws else ''}]"
                fns[label] = lambda cfg=cfg: lt.linear(x, weight, None, config=cfg)
    want = F.linear(x, weight).float()
    flops = 2 * m * n * k
    rows, cublas_ms = [], None
    for engine, fn in fns.items():
        try:
            out = fn()
            torch.cuda.synchronize()
            ms = do_bench_cudagraph(fn, return_mode="median")
        except Exception as error:  # a swept config that does not compile here loses its row, not the run
            if engine in ("cublas", "triton"):
                raise
            print(f"{model:13} {proj:16} M={m:6} {engine:28} FAILED: {type(error).__name__}: {error}"[:400],
                  flush=True)
            continue
        cublas_ms = ms if engine == "cublas" else cublas_ms
        row = {"workload": f"{proj}", "model": model, "engine": engine, "metric": "linear_ms", "value": ms,
               "unit": "ms", "hardware": torch.cuda.get_device_name(), "rows": m, "k": k, "n": n, "layers": layers,
               "tflops": flops / (ms * 1e-3) / 1e12, "ratio": ms / cublas_ms,
               "max_abs_diff_vs_cublas": (out.float() - want).abs().max().item()}
        rows.append(row)
        print(f"{model:13} {proj:16} M={m:6} K={k:5} N={n:5} {engine:28} {ms:8.4f} ms {row['tflops']:6.1f} TFLOP/s "
              f"x{row['ratio']:.3f}", flush=True)
    return rows


def totals(rows: list[dict]) -> list[dict]:
    """Per (model, M, engine): the layer-weighted sum of the projection times, and its ratio to cuBLAS's."""
    sums: dict[tuple, list] = {}
    for r in rows:
        key = (r["model"], r["rows"], r["engine"])
        acc = sums.setdefault(key, [0.0, 0.0, r["hardware"]])
        acc[0] += r["value"] * r["layers"]
        acc[1] += 2 * r["rows"] * r["n"] * r["k"] * r["layers"]
    out = []
    for (model, m, engine), (ms, flops, hw) in sums.items():
        cublas = sums[(model, m, "cublas")][0]
        out.append({"workload": "total", "model": model, "engine": engine, "metric": "linear_ms_per_forward",
                    "value": ms, "unit": "ms", "hardware": hw, "rows": m, "tflops": flops / (ms * 1e-3) / 1e12,
                    "ratio": ms / cublas})
    return out


def markdown(rows: list[dict]) -> str:
    """Per projection the default Triton kernel against cuBLAS; for the totals every timed kernel (the swept tiles
    and the TMA form too)."""
    header = ("| model | projection | M | K | N | kernel | cuBLAS ms | kernel ms | kernel / cuBLAS | cuBLAS TFLOP/s "
              "| kernel TFLOP/s |")
    lines = [header, "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    by_key = {(r["model"], r["workload"], r["rows"], r["engine"]): r for r in rows}
    for r in rows:
        if r["engine"] == "cublas" or (r["engine"] != "triton" and r["workload"] != "total"):
            continue
        c = by_key[(r["model"], r["workload"], r["rows"], "cublas")]
        shape = f"| {r.get('k', '')} | {r.get('n', '')} " if r["workload"] != "total" else "| | "
        lines.append(f"| {r['model']} | {r['workload']} | {r['rows']} {shape}| {r['engine']} | {c['value']:.4f} | "
                     f"{r['value']:.4f} | {r['ratio']:.3f} | {c['tflops']:.0f} | {r['tflops']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="batch sizes M")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sweep", action="store_true", help="also time the triton kernel's other tiles")
    parser.add_argument("--unfused", action="store_true",
                        help="one GEMM per nn.Linear (before session 9's fused projections) instead of the fused ones")
    args = parser.parse_args()
    print(f"triton default bf16 tiles: {lt.default_config(torch.bfloat16)}")
    rows = []
    for model in args.models:
        config, source = model_config(model)
        print(f"{model}: shapes from {source}")
        for proj, k, n, layers in projections(config, fused=not args.unfused):
            for m in args.rows:
                rows += bench_shape(model, proj, m, k, n, layers, args.sweep)
    rows += totals(rows)
    table = markdown(rows)
    print(table)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
