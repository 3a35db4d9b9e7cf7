"""Fork attention as a Triton kernel of our own (FlashAttention-2 style online softmax, fp32 accumulation).

Why not FlexAttention: flex visits key blocks from a block table and evaluates a generic mask_mod on every partial
block; on one long state with many short questions it ran 2.3x slower than plain causal SDPA although it computes
fewer pairs. Here the structure of a round is used directly:

- A program owns one query block and one KV head. GQA is packed into the rows: the BLOCK_M rows are
  BLOCK_M // GROUP tokens x the GROUP query heads that read this KV head, so every K/V tile loaded serves all of
  them (4x less K/V traffic at 8/2 or 16/4 heads).
- The keys a block may see come from its rows' metadata, computed in the kernel: the union of their states
  `[min trunk_lo, max trunk_hi)` ("range A") and the union of their own segments `[min seg_lo, last token]`
  ("range B"). With the level-major layout a block of question rows has one state range (two where it straddles
  two requests) and a short own range; a block of state rows has no state range and a causal own range. Range A is
  cut where range B starts, so no key is visited twice.
- Each range is split into a masked head, an unmasked middle and a masked tail. The middle is where every row of
  the block sees every key (for A: `[max trunk_lo, min trunk_hi)`; for B: `[max seg_lo, first token]`), so its
  blocks skip the mask entirely: for a question block that is the whole state but its last partial key block, for a
  state block everything left of the diagonal. Keys of other requests are never loaded.

Assumed of the metadata (true of every round `build_round` lays out): a token's state lies before its own segment
(`trunk_hi <= seg_lo` where the state is not empty), and `seg_lo <= t`.

The launch grid is (cdiv(T, BLOCK_M // GROUP), Hkv): shapes only, no host sync, so the op replays in a CUDA graph
with any round of the same shape. Tiles are fixed per (head dim, dtype) (no autotuning: no tuning inside a capture,
and the same summation order whatever the round's load). fp32 inputs use IEEE fp32 dots (tf32 would cost ~1e-3).

Runs on CPU tensors under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported), which is how the
CPU tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..tables import check_token_tables

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Config:
    block_m: int  # query rows per program (tokens x GROUP query heads)
    block_n: int  # keys per step
    num_warps: int
    num_stages: int


def default_config(head_dim: int, dtype: torch.dtype) -> Config:
    """Fixed tiles per (head dim, dtype), for Hopper (sm_90), checked with ptxas for register spills
    (`benchmarks/ops/kernel_resources.py`, no GPU needed).

    bf16/fp16: Q and the K/V stages live in shared memory; the fp32 accumulator (BLOCK_M x head dim) and the score
    tile live in registers. At dim 256 the accumulator alone is 128 registers a thread with 128 rows over 8 warps;
    BLOCK_N 64 leaves a few spilled bytes, 2 stages (192 KB of shared memory) is all that fits.
    `benchmarks/ops/bench_fork_attention.py --sweep` times the alternatives on the device.
    fp32 (IEEE dots on the FMA units: tf32 would miss the fp32 tolerance) only needs to be right: small tiles keep
    it free of spills (32 x 32 at dim 256 spilled 100 KB a thread)."""
    if dtype == torch.float32:
        if head_dim <= 64:
            return Config(32, 32, 4, 1)
        if head_dim <= 128:
            return Config(32, 16, 4, 1)
        return Config(16, 16, 4, 1)
    if head_dim <= 64:
        return Config(128, 64, 4, 3)
    if head_dim <= 128:
        return Config(128, 64, 8, 3)
    return Config(128, 64, 8, 2)


@triton.jit
def _visit(acc, l_i, m_i, n_blocks, q, k_base, v_base, stride_kt, stride_vt, offs_d, offs_dv, lo, hi,
           seg_lo, own_n, trunk_lo, trunk_n, qk_scale,
           MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
           EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over the keys [lo, hi) in steps of BLOCK_N. MASKED=False: the caller guarantees that every
    row sees every key and that hi - lo is a multiple of BLOCK_N (no bounds, no visibility mask). MASKED=True: the
    last step is clipped at hi and each (row, key) pair is checked against the row's two intervals, given as
    starts and lengths (uint32): `[seg_lo, seg_lo + own_n)` and `[trunk_lo, trunk_lo + trunk_n)`.

    Indices are int32 (a stream is far below 2**31 tokens): int64 [BLOCK_M, BLOCK_N] mask temporaries would take
    twice the registers, and at head dim 256 there are none to spare. Addresses are recomputed from the key indices
    every step (the launcher checks that T * stride fits in int32): cheaper than loop-carried pointer tensors or
    loop-invariant offset tiles, which hold registers through the whole loop."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        keys = start + offs_n
        k_ptrs = k_base + keys[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + keys[:, None] * stride_vt + offs_dv[None, :]
        if MASKED:
            in_range = keys < hi  # also keeps range A from scoring keys that range B visits
            k_mask = in_range[:, None]
            v_mask = in_range[:, None]
            if not EVEN_D:
                k_mask = k_mask & (offs_d[None, :] < HEAD_DIM)
                v_mask = v_mask & (offs_dv[None, :] < HEAD_DIM_V)
            k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units: exp2 below
        if MASKED:
            # lo <= s < lo + n as one unsigned compare: (s - lo) wraps past n when s < lo
            own = (keys[None, :] - seg_lo[:, None]).to(tl.uint32, bitcast=True) < own_n[:, None]
            state = (keys[None, :] - trunk_lo[:, None]).to(tl.uint32, bitcast=True) < trunk_n[:, None]
            qk = tl.where((own | state) & in_range[None, :], qk, float("-inf"))
        # m_i starts finite (-1e30), so a row that sees nothing yet gets p = exp2(-inf) = 0, not NaN
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
        n_blocks += 1
    return acc, l_i, m_i, n_blocks


@triton.jit
def _full_part(lo, hi, full_lo, full_hi, BLOCK_N: tl.constexpr):
    """The unmasked middle [f_lo, f_hi) of the range [lo, hi): the part of [full_lo, full_hi) inside it, cut to a
    whole number of key blocks from f_lo (the rest goes to the masked tail). Without a whole block it is empty at
    hi, so the masked head covers the range in one run of blocks instead of two partial ones."""
    f_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    f_hi = tl.minimum(tl.maximum(full_hi, f_lo), hi)
    f_hi = f_lo + (f_hi - f_lo) // BLOCK_N * BLOCK_N
    empty = f_hi == f_lo
    return tl.where(empty, hi, f_lo), tl.where(empty, hi, f_hi)


@triton.jit
def _fork_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seg_lo_ptr, trunk_lo_ptr, trunk_hi_ptr, stats_ptr, T, qk_scale,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, STATS: tl.constexpr):
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # tokens per query block; rows past TOKENS * GROUP idle
    EVEN_D: tl.constexpr = (BLOCK_D == HEAD_DIM) and (BLOCK_DV == HEAD_DIM_V)
    BIG: tl.constexpr = (1 << 31) - 1  # past any key index
    # Heaviest blocks first: the questions (end of the stream, each sees a whole state), then the states from their
    # ends (long causal rows) down to their starts, so the last wave holds short programs
    n_blocks = tl.num_programs(0)
    pid_m = n_blocks - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    first = pid_m * TOKENS  # the block's first token (always < T)
    tok = first + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    valid = (rows < TOKENS * GROUP) & (tok < T)
    # int32 from here on (see _visit); idle rows see nothing: an empty own segment (seg_lo past every key) and an
    # empty state
    seg_lo = tl.load(seg_lo_ptr + tok, mask=valid, other=BIG).to(tl.int32)
    trunk_lo = tl.load(trunk_lo_ptr + tok, mask=valid, other=0).to(tl.int32)
    trunk_hi = tl.load(trunk_hi_ptr + tok, mask=valid, other=0).to(tl.int32)
    has_trunk = valid & (trunk_hi > trunk_lo)

    # Range A: the union of the rows' states, cut where range B starts; unmasked where every row sees it
    own_lo = tl.min(seg_lo, 0)
    own_hi = tl.minimum(first + TOKENS, T)
    a_lo = tl.min(tl.where(has_trunk, trunk_lo, BIG), 0)
    a_hi = tl.minimum(tl.max(tl.where(has_trunk, trunk_hi, 0), 0), own_lo)
    # a row without a state makes the unmasked part empty (its lo is BIG); idle rows don't constrain it
    a_full_lo = tl.max(tl.where(valid, tl.where(has_trunk, trunk_lo, BIG), 0), 0)
    a_full_hi = tl.min(tl.where(valid, tl.where(has_trunk, trunk_hi, 0), BIG), 0)
    a_f_lo, a_f_hi = _full_part(a_lo, a_hi, a_full_lo, a_full_hi, BLOCK_N)
    # Range B: the union of the rows' own segments up to the block's last token; every row sees
    # [max seg_lo, first] (each row's own interval [seg_lo, tok] contains it)
    b_full_lo = tl.max(tl.where(valid, seg_lo, 0), 0)
    b_f_lo, b_f_hi = _full_part(own_lo, own_hi, b_full_lo, first + 1, BLOCK_N)

    # the masks' form of the two intervals (idle rows: whatever they see is never stored)
    own_n = (tok - seg_lo + 1).to(tl.uint32, bitcast=True)
    trunk_n = (trunk_hi - trunk_lo).to(tl.uint32, bitcast=True)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    if EVEN_D:
        q = tl.load(q_ptrs, mask=valid[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    n_masked = 0
    n_full = 0
    # A (earlier keys first), then B; each: masked head, unmasked middle, masked tail. Fixed order, so the sums of a
    # row run in the same order whenever its block holds the same rows.
    acc, l_i, m_i, n_masked = _visit(acc, l_i, m_i, n_masked, q, k_base, v_base, stride_kt, stride_vt, offs_d,
                                     offs_dv, a_lo, a_f_lo, seg_lo, own_n, trunk_lo, trunk_n, qk_scale, True,
                                     HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, PRECISION)
    acc, l_i, m_i, n_full = _visit(acc, l_i, m_i, n_full, q, k_base, v_base, stride_kt, stride_vt, offs_d, offs_dv,
                                   a_f_lo, a_f_hi, seg_lo, own_n, trunk_lo, trunk_n, qk_scale, False,
                                   HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, PRECISION)
    acc, l_i, m_i, n_masked = _visit(acc, l_i, m_i, n_masked, q, k_base, v_base, stride_kt, stride_vt, offs_d,
                                     offs_dv, a_f_hi, a_hi, seg_lo, own_n, trunk_lo, trunk_n, qk_scale, True,
                                     HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, PRECISION)
    acc, l_i, m_i, n_masked = _visit(acc, l_i, m_i, n_masked, q, k_base, v_base, stride_kt, stride_vt, offs_d,
                                     offs_dv, own_lo, b_f_lo, seg_lo, own_n, trunk_lo, trunk_n, qk_scale, True,
                                     HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, PRECISION)
    acc, l_i, m_i, n_full = _visit(acc, l_i, m_i, n_full, q, k_base, v_base, stride_kt, stride_vt, offs_d, offs_dv,
                                   b_f_lo, b_f_hi, seg_lo, own_n, trunk_lo, trunk_n, qk_scale, False,
                                   HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, PRECISION)
    acc, l_i, m_i, n_masked = _visit(acc, l_i, m_i, n_masked, q, k_base, v_base, stride_kt, stride_vt, offs_d,
                                     offs_dv, b_f_hi, own_hi, seg_lo, own_n, trunk_lo, trunk_n, qk_scale, True,
                                     HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, PRECISION)

    l_i = tl.where(l_i > 0, l_i, 1.0)  # idle rows only: every real row sees at least itself
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    if EVEN_D:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=valid[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    if STATS:
        program = kvh * n_blocks + pid_m  # by query block, not by launch order
        tl.store(stats_ptr + program * 2, n_masked)
        tl.store(stats_ptr + program * 2 + 1, n_full)


def _pow2_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot needs >= 16 along every dim; padded dims are masked


def fork_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                   trunk_hi: torch.Tensor, scale: float, *, config: Config | None = None,
                   out: torch.Tensor | None = None, stats: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.fork_attention` ([T, Hq, D] / [T, Hkv, D] / [T, Hkv, Dv] in, [T, Hq, Dv] out in
    q's dtype; scores, softmax and sums in fp32). CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.

    config: tiles (default: `default_config`). out: an output buffer to write into (the tests pass one filled with
    NaN: every element must be written). stats: int32 [Hkv * n_query_blocks, 2] (row kv_head * n_query_blocks
    + block) to receive the number of (masked, unmasked) key blocks each program visited (for tests and
    benchmarks; None compiles the counting out).
    """
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    if k.shape != (T, Hkv, D) or v.shape[:2] != (T, Hkv) or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected [T, Hq, D], "
                         f"[T, Hkv, D], [T, Hkv, Dv] with Hq a multiple of Hkv")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    # int32 (a round's own) or int64 tables: the kernel loads either and works in int32 (see _visit)
    check_token_tables(T, seg_lo=seg_lo, trunk_lo=trunk_lo, trunk_hi=trunk_hi)
    group = Hq // Hkv
    cfg = config or default_config(D, q.dtype)
    if cfg.block_m < group:
        cfg = Config(triton.next_power_of_2(group), cfg.block_n, cfg.num_warps, cfg.num_stages)
    if out is None:
        out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    elif out.shape != (T, Hq, Dv) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {(T, Hq, Dv)} on {q.device}")
    if T == 0:
        return out
    # the kernel addresses the head dim with stride 1 (contiguous rows: vectorised loads)
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    if out.stride(2) != 1:
        raise ValueError("out must have a contiguous last dim")
    if T * max(k.stride(0), v.stride(0)) >= 2 ** 31:  # key offsets are int32 in the kernel (see _visit)
        raise ValueError(f"a stream of {T} tokens with key rows of {max(k.stride(0), v.stride(0))} elements "
                         "overflows the kernel's int32 key offsets")
    seg_lo, trunk_lo, trunk_hi = seg_lo.contiguous(), trunk_lo.contiguous(), trunk_hi.contiguous()
    tokens_per_block = cfg.block_m // group
    grid = (triton.cdiv(T, tokens_per_block), Hkv)
    if stats is not None and (stats.shape != (grid[0] * grid[1], 2) or stats.dtype != torch.int32):
        raise ValueError(f"stats must be int32 [{grid[0] * grid[1]}, 2]")
    _fork_attention_kernel[grid](
        q, k, v, out, seg_lo, trunk_lo, trunk_hi, stats if stats is not None else seg_lo, T, float(scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_pow2_dim(D),
        BLOCK_DV=_pow2_dim(Dv), PRECISION="ieee" if q.dtype == torch.float32 else "tf32", STATS=stats is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def query_blocks(tokens: int, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype,
                 config: Config | None = None) -> int:
    """Programs per KV head for a stream of `tokens` (the first dim of `stats` is this times Hkv)."""
    group = heads_q // heads_kv
    cfg = config or default_config(head_dim, dtype)
    return triton.cdiv(tokens, max(cfg.block_m, triton.next_power_of_2(group)) // group)
