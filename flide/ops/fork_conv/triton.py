"""The forked causal depthwise conv as one Triton kernel: no [T, W, D] window tensor.

Each program owns a tile of BLOCK_T tokens x BLOCK_D channels. For each of the W taps it computes, per token, the
stream row that tap reads (the rule of `reference.predecessor_index`: the stream inside the token's own segment,
its state's last rows before a question's first token, nothing before the state's start), loads that row's
channels (masked to zero where the logical sequence has no input) and accumulates weight * x in fp32. The W loads
of a tile overlap in all but W - 1 rows, so they come from L1/L2: the kernel reads x about once and writes the
output once, which is its whole cost (memory-bound; at T=32768, D=6144 in bf16 the window tensor of the reference
would have been 1.6 GB).

The launch grid is (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)): shapes only, no host sync, so a CUDA graph captured once
replays with any round composition of the same shape. Tile sizes are fixed (no autotuning), so the sums run in the
same order whatever else is in the round.

Runs on CPU tensors under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported), which is how the
CPU tests check it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..tables import check_token_tables

# Triton's interpreter has no libdevice: there the gates' exp / log1p fall back to tl.exp / tl.log(1 + x) (equal
# to float32 rounding away from x << 0); compiled, they are libdevice's, as Inductor's and eager CUDA's are
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"

# Default tiles (no spills on sm_90: benchmarks/ops/kernel_resources.py; bench_fork_conv.py --sweep times others)
BLOCK_T = 16  # tokens per tile (H200, session 28 `--sweep`: 5-11 % under 32 for both launches)
BLOCK_D = 128  # channels per tile: 256 contiguous bytes of a bf16 row per token
NUM_WARPS = 4
# The grid's first axis walks channel tiles, so the programs resident at once read whole rows of the projection output
# (and write whole q / k / v rows) instead of one head's 256 bytes of every row; the same programs and sums: the same
# bits. H100, session 40 (`benchmarks/results/h100_conv_layouts_session40.log`, the laid-out launch alone, 0.8B):
# 101.5 vs 105.2 us at 8,192 tokens, 30.9 vs 31.3 at 2,304, 8.0 vs 8.0 at 512; QuALITY's replay 1.87 vs 1.91 ms.
# (Tried beside it and dropped: each tap's weights loaded in the x tile's layout, meant to spare the shared-memory
# conversion of a tap's [BLOCK_D] weight load; from the model's [D, W] weights Triton 3.6 made that 2x slower, from
# a tap-major copy 8-11 % slower.)
CHANNELS_FASTEST = True
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis (token tiles there when CHANNELS_FASTEST)
EPS = 1e-6  # of the q / k L2 norm in `fork_conv_qkv` (gated_delta/l2norm.py's, fla's)


@triton.jit
def _gdn_gates(a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, t, t_ok, stride_at, stride_bt, HV,
               BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr):
    """A GDN layer's gates for tokens t, as transformers computes them: g = -exp(A_log) * softplus(a + dt_bias) in
    fp32 (softplus: x above 20 as it is, else log1p(exp(x))), beta = sigmoid(b) rounded to b's dtype; a / b are
    column slices of the layer's input projection ([T, HV], any row stride), g [T, HV] fp32 and beta [T, HV] out."""
    h = tl.arange(0, BLOCK_H)
    h_ok = h < HV
    m = t_ok[:, None] & h_ok[None, :]
    a = tl.load(a_ptr + t[:, None] * stride_at + h[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t[:, None] * stride_bt + h[None, :], mask=m, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    x = a + dt[None, :]
    if LIBDEVICE:
        decay, soft = libdevice.exp(a_log), libdevice.log1p(libdevice.exp(x))
    else:
        decay, soft = tl.exp(a_log), tl.log(1.0 + tl.exp(x))
    g = -decay[None, :] * tl.where(x > 20.0, x, soft)
    tl.store(g_ptr + t[:, None] * HV + h[None, :], g, mask=m)
    # sigmoid as eager CUDA computes it, 1 / (1 + expf(-b)) with an IEEE division: tl.sigmoid's fast exp and
    # approximate division left an fp32 model's beta an ulp off eager's on ~40 % of elements (H200, session 22)
    if LIBDEVICE:
        beta = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-b))
    else:
        beta = 1.0 / (1.0 + tl.exp(-b))
    tl.store(beta_ptr + t[:, None] * HV + h[None, :], beta.to(beta_ptr.dtype.element_ty), mask=m)


@triton.jit
def _fork_conv_kernel(x_ptr, w_ptr, out_ptr, seg_lo_ptr, trunk_lo_ptr, trunk_hi_ptr, win_ptr, win_index_ptr, T, D,
                      stride_xt, stride_xd, stride_wd, stride_ww, stride_ot, stride_od, stride_win_r, stride_win_d,
                      k_ptr, v_ptr, KEY_COLS, a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, stride_at, stride_bt,
                      HV, W: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr,
                      GATES: tl.constexpr, BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr,
                      CHANNELS_FASTEST: tl.constexpr):
    if CHANNELS_FASTEST:
        pid_d = tl.program_id(0)
        pid_t = tl.program_id(1)
    else:
        pid_t = tl.program_id(0)
        pid_d = tl.program_id(1)
    # int64 token indices: row * stride can pass 2**31 in long streams of wide channels
    t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    if GATES:
        if pid_d == D // BLOCK_D:  # the grid's extra channel column: its tokens' gates, not conv channels
            _gdn_gates(a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, t, t < T, stride_at, stride_bt, HV, BLOCK_H,
                       LIBDEVICE)
            return
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < T
    d_ok = d < D
    # the tables as int64 whatever they are stored as (a round's are int32): the rows computed from them below
    # multiply strides
    seg_lo = tl.load(seg_lo_ptr + t, mask=t_ok, other=0).to(tl.int64)
    trunk_lo = tl.load(trunk_lo_ptr + t, mask=t_ok, other=0).to(tl.int64)
    trunk_hi = tl.load(trunk_hi_ptr + t, mask=t_ok, other=0).to(tl.int64)
    if HAS_WINDOW:  # the checkpoint window each token's (resumed) state continues, -1: none
        win_index = tl.load(win_index_ptr + t, mask=t_ok, other=-1).to(tl.int64)

    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for w in tl.static_range(W):
        # tap w reads the input W-1-w steps back in the token's logical sequence
        src = t - (W - 1 - w)
        before = seg_lo - src  # > 0: that many rows before the token's own segment starts
        in_trunk = trunk_hi - before  # the same distance back from the end of its state
        from_stream = before <= 0
        # in_trunk < trunk_hi always (before > 0), so an empty state (trunk_lo == trunk_hi) never matches
        from_trunk = (before > 0) & (in_trunk >= trunk_lo)
        row = tl.where(from_stream, src, in_trunk)
        ok = (from_stream | from_trunk) & t_ok  # neither: before the state's start, the input is zero
        xv = tl.load(x_ptr + row[:, None] * stride_xt + d[None, :] * stride_xd, mask=ok[:, None] & d_ok[None, :],
                     other=0.0).to(tl.float32)
        if HAS_WINDOW:
            # before the start of a resumed state's segment: the checkpoint's last W-1 inputs (window row j of
            # checkpoint p is row p * (W-1) + j, oldest first), the same values a fresh stream holds there
            before_state = before - (trunk_hi - trunk_lo)
            use = (before_state > 0) & (before_state <= W - 1) & (win_index >= 0) & t_ok
            win_row = win_index * (W - 1) + (W - 1) - before_state
            xw = tl.load(win_ptr + win_row[:, None] * stride_win_r + d[None, :] * stride_win_d,
                         mask=use[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            xv = tl.where(use[:, None], xw, xv)
        wv = tl.load(w_ptr + d * stride_wd + w * stride_ww, mask=d_ok, other=0.0).to(tl.float32)
        acc += xv * wv[None, :]
    if SILU:
        # rounded to the output dtype before the SiLU, where the reference (and transformers' conv) rounds: SiLU of
        # the unrounded fp32 sum gave Qwen3.5-9B's bf16 answers 2.5x the pipeline's distance from the float32
        # reference (2026-11-30, H200, RACE TV 15.2 vs 6.1 points; 3.98 with the reference conv)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = acc * tl.sigmoid(acc)
    y = acc.to(out_ptr.dtype.element_ty)
    if SPLIT:
        # q / k / v laid out for the gated delta kernels (`fork_conv_qkv`): out_ptr is q [T, KEY_COLS], k_ptr k, v_ptr
        # v [T, D - 2 KEY_COLS], all contiguous; BLOCK_D is one head's width, so a tile is one head of one of them,
        # and q / k rows are L2-normalised here over the head (the formula of gated_delta/l2norm.py) from the
        # rounded outputs they would otherwise be read back from
        c0 = pid_d * BLOCK_D
        if c0 < 2 * KEY_COLS:
            if NORM:
                yf = y.to(tl.float32)
                rstd = 1 / tl.sqrt(tl.sum(yf * yf, 1) + EPS)
                y = (yf * rstd[:, None]).to(out_ptr.dtype.element_ty)
            if c0 < KEY_COLS:
                tl.store(out_ptr + t[:, None] * KEY_COLS + d[None, :], y, mask=t_ok[:, None] & d_ok[None, :])
            else:
                tl.store(k_ptr + t[:, None] * KEY_COLS + (d - KEY_COLS)[None, :], y,
                         mask=t_ok[:, None] & d_ok[None, :])
        else:
            tl.store(v_ptr + t[:, None] * (D - 2 * KEY_COLS) + (d - 2 * KEY_COLS)[None, :], y,
                     mask=t_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptr + t[:, None] * stride_ot + d[None, :] * stride_od, y, mask=t_ok[:, None] & d_ok[None, :])


def fork_conv(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
              trunk_hi: torch.Tensor, silu: bool, *, block_t: int = BLOCK_T, block_d: int = BLOCK_D,
              num_warps: int = NUM_WARPS, out: torch.Tensor | None = None,
              window: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Same contract as `reference.fork_conv` (x [T, D], weight [D, W], int32 or int64 metadata [T]; [T, D] out in
    x's dtype), except that products and sums run in fp32 whatever the dtypes (the sum is rounded to x's dtype
    before the SiLU, as the reference rounds it to the weight's: the same for a model of one dtype). CUDA tensors,
    or CPU tensors under TRITON_INTERPRET=1. Every output element is written (`out`, if given: a [T, D] buffer of
    x's dtype; the tests hand in one filled with NaN to check that).

    window: (windows [P, W-1, D], win_index [T] int32 or int64) as in `reference.fork_conv_window`: the inputs
    before a resumed state's segment come from its checkpoint's window (read in place: no extended stream)."""
    T, D = x.shape
    W = weight.shape[1]
    if weight.shape[0] != D:
        raise ValueError(f"weight is {tuple(weight.shape)}, expected [{D}, W]")
    check_token_tables(T, seg_lo=seg_lo, trunk_lo=trunk_lo, trunk_hi=trunk_hi)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be {x.dtype} {tuple(x.shape)} on {x.device}")
    if T == 0 or D == 0:
        return out
    # contiguous() is free for the usual case and makes the 1-D metadata loads plain offsets
    seg_lo, trunk_lo, trunk_hi = seg_lo.contiguous(), trunk_lo.contiguous(), trunk_hi.contiguous()
    if window is not None:
        windows, win_index = window
        if windows.dim() != 3 or windows.shape[1:] != (W - 1, D):
            raise ValueError(f"window is {tuple(windows.shape)}, expected [P, {W - 1}, {D}]")
        check_token_tables(T, win_index=win_index)
        rows = windows.reshape(-1, D) if windows.shape[0] else x[:1]  # none: a valid pointer no tap loads
        win_index = win_index.contiguous()
    else:
        rows, win_index = x, seg_lo
    grid, channels_fastest = _grid(triton.cdiv(T, block_t), triton.cdiv(D, block_d))
    _fork_conv_kernel[grid](x, weight, out, seg_lo, trunk_lo, trunk_hi, rows, win_index, T, D,
                            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
                            rows.stride(0), rows.stride(1), out, out, 0, *([out] * 6), 0, 0, 0, W=W,
                            SILU=bool(silu), BLOCK_T=block_t, BLOCK_D=block_d, HAS_WINDOW=window is not None,
                            SPLIT=False, NORM=False, EPS=EPS, GATES=False, BLOCK_H=1, LIBDEVICE=_LIBDEVICE,
                            CHANNELS_FASTEST=channels_fastest, num_warps=num_warps)
    return out


def fork_conv_qkv(x: torch.Tensor, weight: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                  trunk_hi: torch.Tensor, key_heads: int, head_dim: int, normalize: bool,
                  gates: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
                  block_t: int = BLOCK_T, num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, ...]:
    """The GDN layer's conv (SiLU) with its output laid out as the gated delta kernels read it, in the same launch:
    (q [T, key_heads, head_dim], k likewise, v [T, value heads, head_dim]), new contiguous tensors, q and k
    L2-normalised per head with `normalize` (y = x / sqrt(sum(x^2) + 1e-6), sums in fp32, as l2norm.py). The conv's
    channels are q | k | v, heads of `head_dim` (a power of two: one channel tile is one head). What it saves: the
    [T, D] conv output written, read back and written again by the state call's layout kernel (`prepare_qkv`).
    `gates` (a [T, HV], b [T, HV], A_log [HV], dt_bias [HV]; a / b any row stride): the layer's g [T, HV] float32 and
    beta [T, HV] (b's dtype) too, from one more column of programs (two Inductor kernels a layer fewer), returned
    after v. Same contract as `fork_conv` otherwise; `reference.fork_conv_qkv` is its oracle."""
    T, D = x.shape
    W = weight.shape[1]
    key_cols = key_heads * head_dim
    if weight.shape[0] != D:
        raise ValueError(f"weight is {tuple(weight.shape)}, expected [{D}, W]")
    if head_dim < 1 or head_dim & (head_dim - 1) or head_dim > 256:
        raise ValueError(f"head_dim must be a power of two up to 256 (one channel tile a head), got {head_dim}")
    if 2 * key_cols > D or (D - 2 * key_cols) % head_dim:
        raise ValueError(f"{D} channels are not q | k ({key_heads} heads of {head_dim} each) | v (heads of "
                         f"{head_dim})")
    check_token_tables(T, seg_lo=seg_lo, trunk_lo=trunk_lo, trunk_hi=trunk_hi)
    new = dict(dtype=x.dtype, device=x.device)
    q = torch.empty(T, key_heads, head_dim, **new)
    k = torch.empty(T, key_heads, head_dim, **new)
    v = torch.empty(T, (D - 2 * key_cols) // head_dim, head_dim, **new)
    if gates is not None:
        a, b, a_log, dt_bias = gates
        HV = a_log.shape[0]
        for name, y in (("a", a), ("b", b)):
            if y.shape != (T, HV) or (HV > 1 and y.stride(1) != 1):
                raise ValueError(f"{name} must be [{T}, {HV}] with its last dim contiguous, got {tuple(y.shape)}")
        if dt_bias.shape != (HV,):
            raise ValueError(f"dt_bias is {tuple(dt_bias.shape)}, expected [{HV}] like A_log")
        g = torch.empty(T, HV, dtype=torch.float32, device=x.device)
        beta = torch.empty(T, HV, dtype=b.dtype, device=x.device)
        gate_args = (a, b, a_log.contiguous(), dt_bias.contiguous(), g, beta, a.stride(0), b.stride(0), HV)
    else:
        HV, gate_args = 0, (*([q] * 6), 0, 0, 0)
    out = (q, k, v) if gates is None else (q, k, v, g, beta)
    if T == 0 or D == 0:
        return out
    seg_lo, trunk_lo, trunk_hi = seg_lo.contiguous(), trunk_lo.contiguous(), trunk_hi.contiguous()
    grid, channels_fastest = _grid(triton.cdiv(T, block_t), D // head_dim + (gates is not None))
    _fork_conv_kernel[grid](x, weight, q, seg_lo, trunk_lo, trunk_hi, x, seg_lo, T, D,
                            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), 0, 0, x.stride(0),
                            x.stride(1), k, v, key_cols, *gate_args, W=W, SILU=True, BLOCK_T=block_t,
                            BLOCK_D=head_dim, HAS_WINDOW=False, SPLIT=True, NORM=bool(normalize), EPS=EPS,
                            GATES=gates is not None, BLOCK_H=triton.next_power_of_2(max(HV, 1)),
                            LIBDEVICE=_LIBDEVICE, CHANNELS_FASTEST=channels_fastest, num_warps=num_warps)
    return out


def _grid(token_tiles: int, channel_tiles: int) -> tuple[tuple[int, int], bool]:
    """The launch grid and whether its first axis is the channel tiles (`CHANNELS_FASTEST`, where the token tiles
    fit the grid's second axis)."""
    if CHANNELS_FASTEST and token_tiles <= _MAX_GRID_Y:
        return (channel_tiles, token_tiles), True
    return (token_tiles, channel_tiles), False
