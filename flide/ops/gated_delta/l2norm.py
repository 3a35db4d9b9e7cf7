"""Row-wise L2 normalisation of q and k before fla's chunked kernels, with one fixed launch configuration.

fla normalises q and k itself (`use_qk_l2norm_in_kernel`) with an autotuned kernel whose key includes
NB = cdiv(rows, 65536): on Qwen3.5-0.8B (16 key heads) streams past 4,096 tokens tune a config of their own, and a
row's sum of squares is then reduced by another tree (other rows per program, other warps), so a token's normalised
key could change bits with the round's bucket, and between processes (autotuning times the configs). Here every
row is summed by the same code whatever the stream: rows per program and warps are constants, no autotuning.

Same formula as fla's `l2norm_fwd`: y = x * (1 / sqrt(sum(x^2) + 1e-6)), sums in fp32, y rounded to x's dtype.
Runs on CPU tensors under TRITON_INTERPRET=1 (read when this module is imported), as the CPU tests run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # rows per program
NUM_WARPS = 4
EPS = 1e-6


@triton.jit
def _l2norm_kernel(x_ptr, y_ptr, R, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr, EPS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, 1) + EPS)
    tl.store(y_ptr + offsets, (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x / ||x|| over the last dim (eps 1e-6 inside the root), in x's dtype; a new contiguous tensor."""
    x = x.contiguous()
    D = x.shape[-1]
    R = x.numel() // D if D else 0
    y = torch.empty_like(x)
    if R:
        _l2norm_kernel[(triton.cdiv(R, ROWS),)](x, y, R, D=D, BD=triton.next_power_of_2(D), ROWS=ROWS, EPS=EPS,
                                                num_warps=NUM_WARPS)
    return y
