"""Does a row of a cuBLAS bf16 GEMM keep its bits when the batch around it changes, under each
`runtime.gemm_reductions` mode (flide/precision.py)? For Qwen3.5-0.8B's projection shapes, rows o..o+M of a
32,768-row batch multiplied alone against the same rows inside the whole batch: the share of rows bitwise equal and
the largest difference, per mode. This is what decides how far `single_pass` gets toward batch invariance without
our own GEMM (and what it costs: `bench_linear.py` times cuBLAS, and the benchmark grids' `single-pass-gemm`
ablations time whole rounds). GPU only.

    python benchmarks/ops/cublas_row_invariance.py [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flide.precision import MODES, gemm_reductions  # noqa: E402

SHAPES = [(1024, 6144), (1024, 3584), (3584, 1024), (2048, 1024)]  # (K, N): in_proj_qkv, gate/up, down, out_proj
ROWS = [1, 7, 64, 256, 437, 1000, 4096]
OFFSETS = [0, 3, 1001]
T = 32768


def compare(x: torch.Tensor, w: torch.Tensor, mode: str) -> tuple[int, int, float]:
    """(rows bitwise equal, rows compared, largest difference) of the ROWS x OFFSETS slices alone vs in the batch."""
    with gemm_reductions(mode, "cuda"):
        full = F.linear(x, w)
        equal = total = 0
        worst = 0.0
        for m in ROWS:
            for o in OFFSETS:
                part = F.linear(x[o:o + m], w)
                equal += int((part == full[o:o + m]).all(dim=1).sum())
                total += m
                worst = max(worst, (part.float() - full[o:o + m].float()).abs().max().item())
    return equal, total, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for k, n in SHAPES:
        x = torch.randn(T, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
        for mode in MODES:
            try:
                equal, total, worst = compare(x, w, mode)
            except (RuntimeError, ValueError) as error:  # a mode this machine cannot run loses its row only
                rows.append({"k": k, "n": n, "mode": mode, "error": str(error)[:300]})
            else:
                rows.append({"k": k, "n": n, "mode": mode, "rows_bitwise_equal_pct": round(100 * equal / total, 3),
                             "max_abs_diff": worst, "device": torch.cuda.get_device_name()})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
