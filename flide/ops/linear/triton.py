"""A batch-invariant linear layer (`x @ weight.T + bias`) as a Triton GEMM of our own, for batch-invariant mode.

Why: cuBLAS picks its kernel, tiles and split-K from the problem size, so the bits of one row of `F.linear(x, w)`
change with the number of rows M of x (and with where the row sits). In batch-invariant mode a request must get the
same bits alone or in any round, so every linear layer runs here instead, where the order of the sums of an output
element depends on nothing but K and the tile config:

- Tiles are fixed per dtype and GPU architecture (`default_config`; no `triton.autotune`, nothing chosen from M
  or from the device's load). M is not even specialised (`do_not_specialize`), so every M runs the same compiled
  kernel (also: no recompile when a CUDA-graph bucket of a new size is captured).
- No split-K and no stream-K: one program owns a BLOCK_M x BLOCK_N output tile and walks K from 0 upward in BLOCK_K
  steps, `acc = dot(x_tile, w_tile, acc)` in fp32, then adds the bias in fp32 and rounds once to x's dtype. A row's
  result does not depend on the other rows of its tile: rows past M re-read a valid row (index modulo M, so the
  loads need no row mask) and are never stored; columns past N likewise; the K tail is masked to zeros (only when
  K is not a multiple of BLOCK_K, a property of the layer, not of the batch).
- fp32 inputs use IEEE fp32 dots (`input_precision="ieee"`, FMA units; tf32 would be ~1e-3 off). bf16/fp16 inputs
  use the tensor cores (wgmma on Hopper) with fp32 accumulation.

What is fixed: the bits of a row for a given (x row, weight, bias, dtype, Config), on a given GPU architecture and
Triton version. What is not: equality with cuBLAS (F.linear) bits, which differ by ordinary fp32-accumulation
rounding (bf16: about one output ulp); bits across GPU architectures or Triton versions (another compiler may order
the products inside a BLOCK_K step differently); bits across Configs.

Program order is grouped ("swizzled", GROUP_M rows of tiles at a time) so the programs running together share x
and weight tiles in L2; this changes only which program runs when, never a sum. Pointer offsets of rows (x, weight,
out) are int64: T = 32,768 rows of an output 248,320 wide (a vocabulary) is past 2**31 elements.

Runs on CPU tensors under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported), which is how the
CPU tests (tests/test_linear_triton.py) check it; the GPU tests are tests/gpu/test_linear_gpu.py, the timing against
cuBLAS benchmarks/ops/bench_linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class Config:
    block_m: int  # output rows per program
    block_n: int  # output columns per program
    block_k: int  # reduction step: with the dtype, the only tile size the bits of a result depend on
    group_m: int  # tile rows per group of the swizzled program order (L2 reuse; no effect on the bits)
    num_warps: int
    num_stages: int
    # The persistent form (`_linear_tma_kernel`): one program per SM walks output tiles, x / weight tiles come in by
    # the tensor-memory accelerator (Hopper's TMA: bulk copies into shared memory, no per-thread address math), with
    # warp specialisation optionally (loads and products in separate warps). The same sums in the same order as the
    # pointer kernel's form of the tile (K from 0 upward in BLOCK_K steps, fp32 accumulator); only which program
    # computes which tile, and when, differs. 16-bit inputs whose rows the TMA can address only (`_tma_eligible`,
    # which depends on the layer's layout, never on M); others take the pointer kernel.
    tma: bool = False
    warp_specialize: bool = False


def default_config(dtype: torch.dtype, capability: tuple[int, int] | None = None) -> Config:
    """Fixed tiles per dtype and GPU architecture (`capability`, CUDA compute capability; None: Hopper's, as under
    the CPU interpreter); never chosen from M.

    bf16/fp16: the persistent TMA form with 128 x 256 output tiles over 8 warps (two warpgroups, each a 64 x 256
    wgmma accumulator), K steps of 64, 3 stages of x and weight tiles in shared memory (144 KB). Chosen by
    `benchmarks/ops/bench_linear.py --sweep` on the H200 (session 11, 16,384 rows, the fused projections of
    Qwen3.5-0.8B and -4B): 0.99x cuBLAS's time per forward on both models (0.95-1.04x per projection), against
    1.30x for the pointer kernel's best tiles (`pointer_config`) and 1.09x for 128 x 128 TMA tiles with 4 stages.
    It wins on every projection shape of both models, so there is no per-shape table. Layers whose layout the TMA
    cannot address (`_tma_eligible`, a property of the layer) run the pointer kernel with the same tiles.
    Before Hopper (no TMA, and 99-164 KB of shared memory a block: 144 KB of stages would not fit everywhere) the
    pointer kernel's 128 x 128 tiles (96 KB), untimed there. Bits differ across architectures anyway.
    fp32 (IEEE dots on the FMA units) only needs to be right, not fast: small tiles keep it free of register spills.
    """
    if dtype == torch.float32:
        return _FP32
    if dtype in (torch.bfloat16, torch.float16):
        return _POINTER_16BIT if capability is not None and capability < (9, 0) else _TMA_16BIT
    raise ValueError(f"linear (triton): unsupported dtype {dtype}; expected float32, bfloat16 or float16")


_FP32 = Config(32, 64, 32, 8, 4, 2)
_TMA_16BIT = Config(128, 256, 64, 8, 8, 3, tma=True)  # Hopper and later
_POINTER_16BIT = Config(128, 128, 64, 8, 8, 3)  # the pointer kernel's best tiles: before Hopper, and `pointer_config`


def pointer_config(dtype: torch.dtype) -> Config:
    """The pointer kernel's own best tiles (the default before session 11's sweep: 128 x 128, 8 warps, 3 stages),
    for the `triton_pointer` ablation; fp32 as `default_config`."""
    if dtype in (torch.bfloat16, torch.float16):
        return _POINTER_16BIT
    return default_config(dtype)  # fp32's tiles, or the unsupported dtype's error


def tma_config(dtype: torch.dtype, warp_specialize: bool = False) -> Config:
    """The default tiles in the persistent TMA form, optionally warp-specialised (16-bit dtypes; fp32 keeps the
    pointer kernel: the TMA path takes 16-bit inputs only). Fixed per dtype, like `default_config`."""
    cfg = default_config(dtype)
    return cfg if dtype == torch.float32 else replace(cfg, tma=True, warp_specialize=warp_specialize)


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of output tile number `tile` in the grouped order: GROUP_M tile rows at a time,
    column by column inside the group (L2 reuse; no effect on the bits). Both forms of the kernel walk tiles so."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_in_group = tile % num_pid_in_group
    return first_pid_m + pid_in_group % group_size_m, pid_in_group // group_size_m


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_b, stride_om, stride_on,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows past M (columns past N) read row rm % M (column rn % N): valid memory, so the loads of x and weight
    # need no row/column mask; those results are never stored and no other row's sums see them.
    rm_in = (rm % M).to(tl.int64)
    rn_in = (rn % N).to(tl.int64)
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + rk[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + rn_in[None, :] * stride_wn + rk[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]: weight.T tile

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K from 0 upward, one BLOCK_K step at a time, in one program: the same order for every M
    for k in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        bias = tl.load(b_ptr + rn * stride_b, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(x_desc, w_desc, out_desc, b_ptr, M, N, K, stride_b, NUM_PROGRAMS,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    # Persistent: program p computes tiles p, p + NUM_PROGRAMS, ... in the pointer kernel's grouped order. Every
    # tile's sums are those of the pointer kernel's program for it: K from 0 upward, one BLOCK_K step at a time.
    # Out-of-range rows, columns and the K tail arrive as zeros from the descriptors (no masks), and the store
    # clips to [M, N]: a row's result depends on nothing but its own inputs.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        row = pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            a = x_desc.load([row, k * BLOCK_K])
            b = w_desc.load([col, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            rn = col + tl.arange(0, BLOCK_N)
            acc = acc + tl.load(b_ptr + rn * stride_b, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([row, col], acc.to(out_desc.dtype))


def _tma_eligible(x: torch.Tensor, weight: torch.Tensor, n: int) -> bool:
    """Whether the TMA can address x, weight and a contiguous [M, n] output: 16-bit elements, rows contiguous, row
    strides and base addresses 16-byte aligned. None of it depends on M or on which rows of a larger tensor x is
    (a row offset moves the base by whole row strides), so a layer takes one form whatever the batch."""
    size = x.element_size()
    return (x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1 and weight.stride(1) == 1
            and (x.stride(0) * size) % 16 == 0 and (weight.stride(0) * size) % 16 == 0 and (n * size) % 16 == 0
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


_PROGRAMS: dict[int, int] = {}
_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability (None off CUDA: the interpreter takes Hopper's tiles)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def _programs(device: torch.device) -> int:
    """Programs of the persistent form: one per SM (4 under the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROGRAMS:
        _PROGRAMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _PROGRAMS[index]


def _launch_tma(x, weight, bias, out, cfg: Config) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = weight.shape[0]
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [cfg.block_n, cfg.block_k])
    out_desc = TensorDescriptor(out, [M, N], [N, 1], [cfg.block_m, cfg.block_n])
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    programs = min(tiles, _programs(x.device))
    _linear_tma_kernel[(programs,)](
        x_desc, w_desc, out_desc, bias if bias is not None else x, M, N, K,
        bias.stride(0) if bias is not None else 0, programs,
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
           config: Config | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear` with batch-invariant bits: x [M, K] (any strides, M may be 0), weight [N, K],
    bias [N] or None, all of one dtype (float32, bfloat16 or float16) -> [M, N] contiguous in that dtype; products
    summed in fp32, bias added in fp32, one rounding at the end. CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1.

    config: tiles (default: `default_config(x.dtype, <x's GPU architecture>)`, fixed per dtype and architecture);
    another config gives other (equally valid) bits.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear (triton): x {tuple(x.shape)}, weight {tuple(weight.shape)}: expected [M, K], [N, K]")
    M, K = x.shape
    N = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"linear (triton): bias {tuple(bias.shape)}: expected [{N}]")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear (triton): dtypes differ: x {x.dtype}, weight {weight.dtype}, "
                         f"bias {None if bias is None else bias.dtype}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"linear (triton): devices differ: x {x.device}, weight {weight.device}, "
                         f"bias {None if bias is None else bias.device}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"linear (triton): unsupported dtype {x.dtype}; expected float32, bfloat16 or float16")
    if x.device.type != "cuda" and isinstance(_linear_kernel, JITFunction):
        raise ValueError(f"linear (triton): x is on {x.device}: CUDA tensors, or CPU ones under TRITON_INTERPRET=1")
    cfg = config or default_config(x.dtype, _capability(x.device))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if cfg.tma and K > 0 and _tma_eligible(x, weight, N):
        _launch_tma(x, weight, bias, out, cfg)
        return out
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, out, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
        out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
