"""A gated MLP's gate/up GEMM with SiLU-and-multiply in its epilogue: `silu(x @ gate.T) * (x @ up.T)` in one kernel.

Why: with the model's own modules the gate/up GEMM (cuBLAS) writes [M, 2I] and a separate pointwise kernel reads it
back to write silu(gate) * up [M, I]: on Qwen3.5-0.8B at 8,192 tokens that kernel moves ~176 MB a layer, 1.4 ms of
an H100 replay of QuALITY (session 40's profile, `pointwise` family), at the card's bandwidth. Here each program owns
a [BLOCK_M, BLOCK_N] tile of the OUTPUT and accumulates two products side by side over the same x tiles: the gate
columns [c, c + BLOCK_N) (weight rows c..) and the up columns (weight rows I + c..), then applies SiLU and the
product to the two fp32 accumulators and stores only [M, I]: the [M, 2I] intermediate never reaches memory.

The GEMM is flide/ops/linear/triton.py's, tiles and all (its persistent TMA form on Hopper: 128 rows x (2 x 128)
columns of accumulators, K steps of 64, 3 stages, 8 warps: the same shared memory and registers as that kernel's
128 x 256 tile): no split-K, K walked from 0 upward, so a row's bits depend on nothing but its own x row (batch-
invariant like that kernel), and the products' order is that of `linear_triton` over the stacked weight.

Roundings are eager PyTorch's (`reference.py`): gate and up rounded to x's dtype as the GEMM's outputs would be,
SiLU in fp32 rounded to x's dtype, then the product rounded once. The SiLU itself is Inductor's x * sigmoid(x) by
default (what the `torch` variant's fused kernel computes) or eager CUDA's x / (1 + exp(-x)) (`EXACT_SILU`); the
GEMM's sums differ from cuBLAS's by ordinary fp32-accumulation rounding (about one bf16 ulp of gate or up, rarely).

Measured (H100, session 41, `benchmarks/results/h100_ops_gated_mlp{,_sweep}_session41.json`, eager's SiLU form):
1.04-1.06x the `torch` variant's time at 2,304-8,192 rows of 0.8B, 1.17x on 4B, 1.3x at 512 rows; in the replay
QuALITY's GEMMs +2.2 ms against its pointwise work -1.4. So `auto` keeps `torch`; the Triton GEMM with two
accumulators is what loses, not the traffic it saves.

Runs on CPU tensors under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported; libdevice is then
replaced by tl.exp / plain division), which is how tests/test_gated_mlp.py checks it; the GPU checks are
tests/gpu/test_gated_mlp_gpu.py.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.jit import JITFunction

from ..linear.triton import Config, _capability, _grouped_tile, _programs, _tma_eligible
from ..linear.triton import default_config as linear_config

# Triton's interpreter has no libdevice (as in fork_conv/triton.py)
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"


def default_config(dtype: torch.dtype, capability: tuple[int, int] | None = None) -> Config:
    """The linear kernel's tiles for the dtype and architecture, with BLOCK_N counting OUTPUT columns: each program
    holds two [BLOCK_M, BLOCK_N] accumulators (gate, up), so the linear tile's 256 accumulator columns are 128 here.
    fp32 keeps the linear kernel's small tiles (IEEE dots; only needs to be right)."""
    cfg = linear_config(dtype, capability)
    return cfg if dtype == torch.float32 else replace(cfg, block_n=cfg.block_n // 2)


# The epilogue's SiLU: EXACT_SILU computes eager CUDA's x / (1 + exp(-x)) (libdevice's exp, IEEE division: ~50
# instructions an element), else x * sigmoid(x) as Inductor's fused kernel of the torch variant does (the hardware's
# exp2 and reciprocal: a few instructions; its bits may differ from eager's by one rounding of the act, as the torch
# variant's do). The epilogue runs between two tiles' main loops, not under them: at 8,192 rows of 0.8B it is 64
# elements a thread a tile, ~15 % of the tile's time in the exact form (estimate; bench_gated_mlp.py times both).
EXACT_SILU = False


@triton.jit
def _silu_times(gate, up, OUT_DTYPE: tl.constexpr, LIBDEVICE: tl.constexpr, EXACT: tl.constexpr):
    """silu(gate) * up from the fp32 accumulators, with eager's roundings: gate and up to OUT_DTYPE (the GEMM's
    outputs), silu in fp32 (EXACT: eager's formula, else Inductor's) rounded to OUT_DTYPE, then the product."""
    g = gate.to(OUT_DTYPE).to(tl.float32)
    u = up.to(OUT_DTYPE).to(tl.float32)
    if EXACT and LIBDEVICE:
        act = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    elif EXACT:
        act = g / (1.0 + tl.exp(-g))
    else:
        act = g * tl.sigmoid(g)
    return (act.to(OUT_DTYPE).to(tl.float32) * u).to(OUT_DTYPE)


@triton.jit(do_not_specialize=["M"])
def _gated_mlp_kernel(x_ptr, w_ptr, out_ptr, M, I, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
                      EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, PRECISION: tl.constexpr, LIBDEVICE: tl.constexpr,
                      EXACT: tl.constexpr):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # rows past M / columns past I re-read valid rows (modulo), never stored: no row or column masks on the loads
    rm_in = (rm % M).to(tl.int64)
    rn_in = (rn % I).to(tl.int64)
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + rk[None, :] * stride_xk
    g_ptrs = w_ptr + rn_in[None, :] * stride_wn + rk[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]: gate.T tile
    u_ptrs = g_ptrs + I * stride_wn  # the up rows: I rows further
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            bg = tl.load(g_ptrs, mask=rk[:, None] < k_left, other=0.0)
            bu = tl.load(u_ptrs, mask=rk[:, None] < k_left, other=0.0)
        gate = tl.dot(a, bg, gate, input_precision=PRECISION)
        up = tl.dot(a, bu, up, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    out = _silu_times(gate, up, out_ptr.dtype.element_ty, LIBDEVICE, EXACT)
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, out, mask=(rm[:, None] < M) & (rn[None, :] < I))


@triton.jit(do_not_specialize=["M"])
def _gated_mlp_tma_kernel(x_desc, w_desc, out_desc, M, I, K, NUM_PROGRAMS, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          WARP_SPECIALIZE: tl.constexpr, LIBDEVICE: tl.constexpr, EXACT: tl.constexpr):
    # Persistent, as linear/triton.py's TMA kernel: program p computes output tiles p, p + NUM_PROGRAMS, ... in the
    # grouped order. Rows past M and the K tail arrive as zeros; a gate tile that runs past I reads up rows (valid
    # memory) into columns the store clips away, an up tile past 2I reads zeros.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        row = pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            a = x_desc.load([row, k * BLOCK_K])
            bg = w_desc.load([col, k * BLOCK_K])
            bu = w_desc.load([I + col, k * BLOCK_K])
            gate = tl.dot(a, bg.T, gate)
            up = tl.dot(a, bu.T, up)
        out_desc.store([row, col], _silu_times(gate, up, out_desc.dtype, LIBDEVICE, EXACT))


def _launch_tma(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: Config, exact: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    inter = out.shape[1]
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(weight, [2 * inter, K], [weight.stride(0), 1], [cfg.block_n, cfg.block_k])
    out_desc = TensorDescriptor(out, [M, inter], [inter, 1], [cfg.block_m, cfg.block_n])
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(inter, cfg.block_n)
    programs = min(tiles, _programs(x.device))
    _gated_mlp_tma_kernel[(programs,)](
        x_desc, w_desc, out_desc, M, inter, K, programs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, WARP_SPECIALIZE=cfg.warp_specialize, LIBDEVICE=_LIBDEVICE,
        EXACT=exact, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gated_mlp(x: torch.Tensor, weight: torch.Tensor, *, config: Config | None = None,
              exact_silu: bool | None = None) -> torch.Tensor:
    """silu(x @ weight[:I].T) * (x @ weight[I:].T) -> [M, I] contiguous in x's dtype (`reference.gated_mlp`): x [M, H]
    (any strides, M may be 0), weight [2I, H] (gate rows, then up rows), one dtype (float32, bfloat16, float16).
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1. `config`: tiles (default `default_config`; BLOCK_N counts
    output columns); `exact_silu`: eager's SiLU formula or Inductor's (default `EXACT_SILU`)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.shape[0] % 2:
        raise ValueError(f"gated_mlp (triton): x {tuple(x.shape)}, weight {tuple(weight.shape)}: expected [M, H], "
                         f"[2I, H] (gate rows, then up rows)")
    if weight.dtype != x.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"gated_mlp (triton): x {x.dtype}, weight {weight.dtype}: expected one dtype of float32, "
                         f"bfloat16, float16")
    if weight.device != x.device:
        raise ValueError(f"gated_mlp (triton): devices differ: x {x.device}, weight {weight.device}")
    if x.device.type != "cuda" and isinstance(_gated_mlp_kernel, JITFunction):
        raise ValueError(f"gated_mlp (triton): x is on {x.device}: CUDA tensors, or CPU ones under TRITON_INTERPRET=1")
    M, K = x.shape
    inter = weight.shape[0] // 2
    cfg = config or default_config(x.dtype, _capability(x.device))
    out = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    if M == 0 or inter == 0:
        return out
    if K == 0:  # no products: gate = up = 0, silu(0) * 0 = 0
        return out.zero_()
    exact = EXACT_SILU if exact_silu is None else exact_silu
    if cfg.tma and _tma_eligible(x, weight, inter):
        _launch_tma(x, weight, out, cfg, exact)
        return out
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(inter, cfg.block_n),)
    _gated_mlp_kernel[grid](
        x, weight, out, M, inter, K, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        EVEN_K=K % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", LIBDEVICE=_LIBDEVICE,
        EXACT=exact, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
