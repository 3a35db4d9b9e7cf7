"""The fork's row select and the gated RMS norm as one Triton kernel (contract: `reference.gated_norm`).

Inductor fused the reference's select and norm into one kernel too, but it loads every row from both calls' outputs
(the select's two branches), and inside a 0.8B replay on the H200 that kernel took 81 us a layer on QuALITY's
8,192-token bucket (1.46 ms of the replay). Here each row is loaded only from the call that wrote it (masked loads
fetch nothing), so the kernel reads one x row, one gate row and writes one row: the whole of its cost. H200
(session 21, `benchmarks/results/ops_gated_norm_h200.md`, `h200_profile_0_8b_gated_norm_ab_*.json`): 28 us a layer
on QuALITY (1.2x the copy floor; Inductor's fusion alone 35 us, in the replay 81 us), replay GPU time QuALITY
32.70 -> 31.72 ms, sweep 64 40.12 -> 38.91, RACE 3.42 -> 3.37.

Each program owns BLOCK_T tokens of one head: rows of V values, normalised along V in fp32 with one fixed tile and
warp count (no autotuning), so a row's bits never depend on the stream's length or on other rows: batch-invariant.
Roundings where transformers' `RMSNormGated` rounds: x / rms(x) to x's dtype, times the weight (rounded to x's dtype
when that is the product's dtype), times SiLU(gate) in fp32, rounded to x's dtype.

Runs on CPU tensors under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported), as the CPU tests
run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the fastest tile of the H200 sweep (`bench_gated_norm.py --sweep`) or tied with it on every stream: RACE 2.9 us,
# QuALITY 27.7 (0.8B) / 52.1 (9B), sweep 64 33.2; (16, 4) was 3.2 / 29.2 / 55.2 / 35.1
BLOCK_T = 8  # tokens per program (of one head)
NUM_WARPS = 2


@triton.jit
def _gated_norm_kernel(xs_ptr, xb_ptr, gate_ptr, w_ptr, out_ptr, states_end_ptr, branches_start_ptr,
                       branches_end_ptr, T, stride_xs_t, stride_xs_h, stride_xb_t, stride_xb_h, stride_g_t, stride_g_h,
                       stride_o_t, stride_o_h, eps, V: tl.constexpr, BV: tl.constexpr, BLOCK_T: tl.constexpr,
                       ROUND_PRODUCT: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    v = tl.arange(0, BV)
    v_ok = v < V
    t_ok = t < T
    states_end = tl.load(states_end_ptr).to(tl.int64)
    branches_start = tl.load(branches_start_ptr).to(tl.int64)
    branches_end = tl.load(branches_end_ptr).to(tl.int64)
    from_states = t_ok & (t < states_end)
    from_branches = t_ok & ~from_states & (t >= branches_start) & (t < branches_end)
    xs = tl.load(xs_ptr + (t * stride_xs_t + h * stride_xs_h)[:, None] + v[None, :],
                 mask=from_states[:, None] & v_ok[None, :], other=0.0)
    xb = tl.load(xb_ptr + (t * stride_xb_t + h * stride_xb_h)[:, None] + v[None, :],
                 mask=from_branches[:, None] & v_ok[None, :], other=0.0)
    # a select (not xs + xb): rows of neither call are zero, and a masked load never reads what a call left unwritten
    x = tl.where(from_states[:, None], xs, xb).to(tl.float32)
    variance = tl.sum(x * x, 1) / V
    y = (x * tl.math.rsqrt(variance + eps)[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + v, mask=v_ok, other=0.0).to(tl.float32)
    y = w[None, :] * y
    if ROUND_PRODUCT:  # weight * x in x's dtype, as torch computes it when that is the product's dtype
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    g = tl.load(gate_ptr + (t * stride_g_t + h * stride_g_h)[:, None] + v[None, :],
                mask=t_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    y = y * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + (t * stride_o_t + h * stride_o_h)[:, None] + v[None, :], y.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & v_ok[None, :])


def gated_norm(x_states: torch.Tensor, x_branches: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
               states_end: torch.Tensor, branches_start: torch.Tensor, branches_end: torch.Tensor, eps: float, *,
               block_t: int = BLOCK_T, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Same contract as `reference.gated_norm`; the last dim of x_states, x_branches and gate must be contiguous (a
    head's V values side by side, as every GDN layer lays them out). CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1."""
    T, H, V = x_states.shape
    for name, tensor in (("x_branches", x_branches), ("gate", gate)):
        if tensor.shape != x_states.shape:
            raise ValueError(f"{name} is {tuple(tensor.shape)}, expected {tuple(x_states.shape)} like x_states")
    if x_branches.dtype != x_states.dtype:
        raise ValueError(f"x_branches is {x_branches.dtype}, x_states {x_states.dtype}: one dtype expected")
    if weight.shape != (V,):
        raise ValueError(f"weight is {tuple(weight.shape)}, expected [{V}]")
    for name, tensor in (("x_states", x_states), ("x_branches", x_branches), ("gate", gate)):
        if V > 1 and tensor.stride(2) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride {tensor.stride(2)})")
    out = torch.empty((T, H, V), dtype=x_states.dtype, device=x_states.device)
    if T == 0 or H == 0 or V == 0:
        return out
    round_product = torch.promote_types(weight.dtype, x_states.dtype) == x_states.dtype
    grid = (triton.cdiv(T, block_t), H)
    _gated_norm_kernel[grid](x_states, x_branches, gate, weight, out, states_end, branches_start, branches_end, T,
                             x_states.stride(0), x_states.stride(1), x_branches.stride(0), x_branches.stride(1),
                             gate.stride(0), gate.stride(1), out.stride(0), out.stride(1), float(eps), V=V,
                             BV=triton.next_power_of_2(V), BLOCK_T=block_t, ROUND_PRODUCT=bool(round_product),
                             num_warps=num_warps)
    return out
