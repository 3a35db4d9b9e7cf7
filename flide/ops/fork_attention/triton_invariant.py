"""Fork attention as a batch-invariant Triton kernel: every output row has the same bits whatever else the round holds.

Why: batch-invariant mode (`kernels.batch_invariant`) promises that a request's answers do not depend on the other
requests of its round, nor on where in the stream its rows land. The fast kernel (triton.py) does not keep that
promise: its key blocks are cut at absolute stream positions (`[min trunk_lo, ...)` and `[min seg_lo, ...)` of the
whole query block, so a key's column in its tile, and which keys share a tile, depend on the block's other rows),
and whether a key block takes the unmasked or the masked code path depends on which rows share the query block. Both
change the order of a row's floating-point sums.

The order of a row's sums here (online softmax, FlashAttention-2 style, fp32 accumulation):

- a question row: FIRST its state's keys in tiles of BLOCK_N that start at its `trunk_lo` (`trunk_lo`,
  `trunk_lo + BLOCK_N`, ...; the last tile masked at `trunk_hi`), THEN, for a leaf of a nested fork
  (`fork_attention(..., sub=)`), its sub-trunk's keys in tiles that start at its `sub_lo` (the last masked at
  `sub_hi`), THEN its own segment's keys in tiles that start at its `seg_lo` (causal mask: keys <= the row's token);
  a sub-trunk's own rows are question rows (state, then own);
- a state row: only its own segment's tiles from `seg_lo`;
- a row of a state resumed from a checkpoint (and its questions' rows), before all of the above: the checkpoint's
  keys, rows [pre_lo, pre_hi) of pk / pv, in tiles from `pre_lo` (`fork_attention(..., prefix=)`); with m a multiple
  of BLOCK_N these are the tiles a fresh state's first m keys fall in;
- a row that sees only itself (a pad, a state's first token, a one-token state: `seg_lo == t`, no state nor
  sub-trunk): one key,
  scored in whichever column of a tile it falls; with a single unmasked score per row the column changes nothing
  (m = s, p = exp2(0), l = p, acc = p * v_t: each a single rounding, zeros added exactly), so its output
  p * v_t / p is the same wherever it lies (v_t itself where exp2(0) is exactly 1).

So for every row that sees more than itself, the sequence of key tiles it takes part in, and each key's column inside
its tile, depend only on the row's own segment, state and sub-trunk, never on absolute positions nor on the other
rows of its query block.

How a program shares tiles anyway: a program owns an absolute block of query rows (BLOCK_M // GROUP tokens x the
GROUP query heads of one KV head: GQA packed into rows, as in triton.py) and walks *ranges*: first each distinct
checkpoint prefix (`pre_lo`), then each distinct state (`trunk_lo`) among its rows, in increasing order, then each
distinct sub-trunk (`sub_lo`, leaf rows only), then each distinct own segment (`seg_lo`), in increasing order, then
one range holding all its rows that see only themselves (from the first of them). The next range is the
smallest start above the current one among the block's rows (a reduction of metadata, never of data), so rows of one
state need not be contiguous (Jev's template interleaves questions of two states). Each range is visited in tiles
from its start; the rows of the range are *active*, every other row is masked out of every tile. All rows of the
block that fork from one state share its tiles: a block of many short questions of one state scans the state once,
and a block of leaves of one sub-trunk scans the sub-trunk once.

A row masked out of a tile keeps its accumulators bit for bit, without relying on exp2(0) == 1: its rescale factor
is *selected* to be 1.0 (rows active in the range whose keys in the tile are all in the future, or rows of other
ranges); its probabilities are exp2(-inf - m) = +0 (m starts at -1e30, finite: no NaN), so acc * 1 + 0 * v = acc
and l * 1 + 0 = l exactly, whatever finite values the tile's other keys hold. The extra (no-op) tiles a row goes
through depend on its block; the tiles where it sees a key do not. Which CODE a tile runs may depend on the block
(LEAN_TILES, the default: a tile whole for every active row of the block runs an unmasked path, `_lean_tile`'s FULL),
so the two paths are written to give a row that sees the whole tile the same bits: its scores pass no select on one
and an all-true select on the other, and every later value comes from the same operations (the exponent's FMA
written out, so no contraction the compiler may apply on one path only). The GPU tests check it bitwise over random
layouts. With LEAN_TILES off there is one tile path (`_tile`) and one call site for all phases' tiles.

Per-row independence: each row's scores come from `tl.dot` (a row of the product depends only on that row of q and on
the tile of keys), and every reduction (`tl.max`, `tl.sum`) runs along the key axis of one row. Nothing is reduced
across rows but metadata.

What is fixed: the tiles (BLOCK_M, BLOCK_N, warps, stages) per (head dim, dtype), `default_config` below, never
autotuned; fp32 inputs use IEEE fp32 dots (`input_precision="ieee"`), 16-bit inputs tensor-core dots with fp32
accumulation; `T` is not specialised by the JIT (`do_not_specialize`), so a stream of 16k tokens and one of 17 run
the same binary. The launch grid is (cdiv(T, BLOCK_M // GROUP), Hkv): shapes only, no host sync, replayable in a
CUDA graph with any round of the same shape.

Assumed of the metadata (true of every round `build_round` lays out): `seg_lo[t] <= t` and the tokens with one
`seg_lo` are one segment (a segment is named by its start); a state is named by its `trunk_lo` and lies outside the
own segment (`trunk_hi <= seg_lo` where non-empty: its keys are not counted twice); `trunk_hi <= trunk_lo` means no
state. With `sub=`: a leaf's sub-trunk `[sub_lo, sub_hi)` is another segment of the stream (before or after the
leaf's own), disjoint from its state and its own segment, and named by its `sub_lo`; `sub_hi <= sub_lo` means none.
Without `sub=` (HAS_SUB false) the sub-trunk phase is compiled out: the kernel is the one without nested forks.
The k / v rows a tile loads for other rows (other states of the block, later tokens of the same segment) must
be finite (0 * inf would be NaN): true of a model's keys and values.

The invariance covers: the same request (its q / k / v rows identical) laid out at any offset, with any other requests
before / after / between its segments, alone in a short stream or in a long one, with the same tile config, dtype and
head shape and strides, on the same device and Triton build (q / k / v of one alignment class, as torch's own
allocations are: the JIT specialises pointers on 16-byte alignment, which changes how tiles are loaded, not how they
are summed). A -0.0 may come out as +0.0 (masked keys contribute 0 * v, whose sign depends on v); `torch.equal`
treats them as equal.

Expected cost vs triton.py (same tiles; NOT timed: written without a GPU). Key tiles visited, counted in Triton's
interpreter with the bf16 tiles (128 rows = 32 tokens x GQA 4, 64 keys) on bench_fork_attention_invariant.py's
streams, per KV head (invariant / triton.py): 2,000-token state + 64 x 40 questions 3,747 / 3,665 (1.02x); 64
RACE-sized requests 4,752 / 4,496 (1.06x); 2,000-token state + 256 x 8 questions 3,363 / 3,137 (1.07x); 40 RACE-sized
requests padded to 30,720 tokens 3,330 / 3,170 (1.05x).
- state rows: the same causal scan from the segment's start, but every tile is masked (triton.py skips the mask left
  of the diagonal: ~90% of its tiles on the long-state stream): a few more ALU operations per tile element.
- question rows: each state's tiles are shared by the block's rows of that state, as in triton.py; the own part costs
  one run of tiles per distinct segment in the block (triton.py: one run for all): a block of S short questions pays
  ~S own tiles instead of 1-2, small next to the state's tiles. A block holding questions of several requests scans
  each of their states once (triton.py scans the union range, other requests' states between them included).
- per range: a few block-wide metadata reductions (cross-warp) and the inner loop's pipeline prologue: noticeable only
  for blocks of many very short segments.
- registers (ptxas -v, sm_90a, triton 3.6): bf16 dim 256 at 128 x 64 x 8 warps x 2 stages spills 64 bytes a thread
  (triton.py: none); 128 x 32 x 8 x 3 spills none (bench_fork_attention_invariant.py --sweep times both). Dim 128 and
  fp32 tiles: none or a few bytes.
So expect ~1.0x-1.3x triton.py's time.
Measured (H200, 2026-12-01, `benchmarks/results/ops_fork_attention_invariant_h200.md`): 1.5x triton.py's time on a
2,000-token state (0.8B: 0.255 vs 0.169 ms), 1.0x on 64 RACE requests. Tried and reverted (388e74e,
`h200_profile_attention_experiments.json`): a FULL path for tiles whole for every row of the block (no visibility
mask, no load bounds; the score select kept so the bits stay the masked path's: the GPU invariance tests passed
bitwise) took QuALITY's attention from 4.71 to 4.44 ms (0.8B) and 12.4 to 11.2 (4B), but RACE's from 0.150 to
0.169 and 64 RACE from 0.307 to 0.338: the mask is not what costs 1.5x on long states (the 140-byte spills of the
default tile may be). Other tiles (--sweep): [M64, N32, w4, s2] is faster on the op streams (0.216 ms on the
2,000-token state) but slower on QuALITY's 8k-token state (5.62 vs 4.71 ms end to end): the default stays.
Session 34 (H100): neither were the spills (the value split, V_SPLIT_DIM, removes them and is slower); the loop's
length was: with LEAN_TILES (scale folded into the exponent's FMA, no score select on full tiles, a cheaper mask) the
invariant kernel takes 1.19x triton.py's time on a QuALITY-like stream (was 1.44x), 1.31x on the 2,000-token state
(was 1.54x), 1.08x on 64 RACE requests (was 1.00x) (`ops_fork_attention_lean_h100.json`, the three-loop first form;
QuALITY's replay attention 4.05 vs 4.75 ms with the final two-loop form; see LEAN_TILES).

Runs on CPU tensors under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported), which is how the CPU
tests check it (tests/test_fork_attention_invariant.py); the GPU checks are tests/gpu/
test_fork_attention_invariant_gpu.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tables import check_token_tables
from .triton import LOG2E, Config

__all__ = ["Config", "default_config", "fork_attention", "query_blocks"]


def default_config(head_dim: int, dtype: torch.dtype) -> Config:
    """Fixed tiles per (head dim, dtype): those of triton.py's `default_config` (checked there with ptxas for spills
    on sm_90), repeated here so that re-tuning the fast kernel never silently changes this one's sums. The bits of a
    row depend on BLOCK_N (where tiles are cut) and on the compiled code, so a change here changes every answer of
    batch-invariant mode (still invariant, but not equal to before)."""
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


# Value columns split across programs: at this head dim and above (16-bit inputs), each (query block, KV head) runs as
# V_PARTS programs, each with the same scores (the whole head dim's q . k, recomputed by each) and 1 / V_PARTS of the
# value columns. Why: at Qwen3.5's 256-dim heads a program's fp32 accumulator [128 rows, 256] is 128 registers a
# thread, next to q's 64 and the scores' 32, and the default tile spills (see the module docstring); a 128-column
# part holds 64 and does not, and a round has twice the programs (RACE's 437 tokens: 28 programs on 132 SMs). The cost:
# the q . k products once per part (1.5x the tile's products for 2 parts). A column's sums are those of the unsplit
# program (the same scores, the same keys in the same order along the same MMA k-steps), so the bits should not
# change (asserted on the GPU: tests/gpu/test_fork_attention_invariant_gpu.py, passed on an H100 in session 34). None:
# never split, the default: measured slower (H100, session 34, op bench `ops_fork_attention_vparts_h100.log`: QuALITY-
# like stream 0.903 vs 0.641 ms, 64 RACE requests 0.492 vs 0.310; replay A/B `h100_profile_0_8b_session34_{main,vsplit}
# .json`: QuALITY's attention 6.83 vs 4.72 ms, RACE's 0.123 vs 0.149): the spills were not what the tile paid for.
V_SPLIT_DIM: int | None = None
V_PARTS = 2

# The tiles in fewer instructions (`_lean_tile`): the scale folded into the exponent's FMA, a cheaper visibility mask,
# and tiles whole for every active row of the block (a long causal scan left of the block's rows, a state's tiles
# under a block of its questions) without mask or load bounds. Why: the one-path tile loop (`_tile`) is 770 SASS
# instructions an iteration (sm_90a, Triton 3.9 offline: benchmarks/ops/kernel_resources.py) to triton.py's 564 in its
# unmasked loop, and the kernel took 1.44x triton.py's time on a QuALITY-like stream with the same tiles and ~the same
# tile count (H100): with one 192 KB program an SM the loop is latency-bound, and its length is its time. The lean
# loops: 540 (full) and 724 (masked) instructions. Measured (H100, session 34, same machine, replay GPU ms lean vs
# one-path, `h100_profile_0_8b_session34_lean{,_baseline_onepath}.json`): QuALITY 29.68 vs 30.24 (attention 4.05 vs
# 4.75), sweep 1 7.93 vs 8.02 (0.540 vs 0.623), RACE 3.020 vs 3.023 (0.153 vs 0.149), MultiRC 3.992 vs 3.986 (0.191 vs
# 0.178). False: the one-path tile (the A/B baseline; other bits, also invariant).
LEAN_TILES = True


def value_parts(head_dim_v: int, dtype: torch.dtype) -> int:
    """How many programs share a (query block, KV head)'s value columns (V_SPLIT_DIM)."""
    split = V_SPLIT_DIM is not None and dtype != torch.float32 and head_dim_v >= V_SPLIT_DIM
    return V_PARTS if split and _pow2_dim(head_dim_v) // V_PARTS >= 16 else 1


@triton.jit
def _tile(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, offs_dv, start, hi, active, row_lo,
          row_hi, qk_scale, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
          EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys [start, start + BLOCK_N), loaded where < hi. An active row sees the keys in its
    [row_lo, row_hi); inactive rows see none. A row that sees no key of the tile keeps acc, l and m exactly (alpha
    selected as 1.0, p = +0)."""
    keys = start + offs_n
    k_ptrs = k_base + keys[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = v_base + keys[:, None] * stride_vt + offs_dv[None, :]
    k = _tile_rows(k_ptrs, keys, hi, offs_d, HEAD_DIM, EVEN_D, False)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units: exp2 below
    # lo <= s < hi as one unsigned compare: (s - lo) wraps past hi - lo when s < lo
    seen = (keys[None, :] - row_lo[:, None]).to(tl.uint32, bitcast=True) < (row_hi - row_lo).to(tl.uint32,
                                                                                               bitcast=True)[:, None]
    qk = tl.where(active[:, None] & seen, qk, float("-inf"))
    touched = active & (start < row_hi) & (start + BLOCK_N > row_lo)  # the row sees a key of this tile
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # untouched rows: max(m, -inf) = m
    p = tl.math.exp2(qk - m_new[:, None])  # m_new finite: masked entries are exactly +0
    alpha = tl.where(touched, tl.math.exp2(m_i - m_new), 1.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _tile_rows(v_ptrs, keys, hi, offs_dv, HEAD_DIM_V, EVEN_D, False)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _tile_rows(ptrs, keys, hi, offs, DIM: tl.constexpr, EVEN_D: tl.constexpr, FULL: tl.constexpr):
    """A tile's key or value rows at `ptrs` ([BLOCK_N, columns `offs`]): zero past `hi` unless FULL (the caller checked
    that the tile lies in the stream), zero in columns past DIM unless EVEN_D."""
    if FULL:
        if EVEN_D:
            rows = tl.load(ptrs)
        else:
            rows = tl.load(ptrs, mask=offs[None, :] < DIM, other=0.0)
    else:
        mask = (keys < hi)[:, None]
        if not EVEN_D:
            mask = mask & (offs[None, :] < DIM)
        rows = tl.load(ptrs, mask=mask, other=0.0)
    return rows


@triton.jit
def _lean_tile(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, offs_dv, start, hi, active,
               row_lo, row_hi, qk_scale, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               EVEN_D: tl.constexpr, PRECISION: tl.constexpr, FULL: tl.constexpr):
    """`_tile` in fewer instructions (LEAN_TILES): the scale is applied once per row to the raw scores' max and
    folded into the exponent's FMA (p = exp2(fma(s, scale, -m))), the visibility mask compares the tile's columns
    with per-row bounds (inactive rows get an empty range: no per-element `active` term), and FULL tiles skip the
    mask and the loads' bounds altogether.

    FULL: the caller checked that every ACTIVE row of the block sees every key of the tile (inactive rows: any
    finite scores, dropped by their exponent offset of -inf, so the tile's keys must lie in the stream: true where
    they are inside some active row's range). A row that sees the whole tile gets the same bits on either path: its
    scores pass no select on the FULL path and an all-true select on the other, and every later value comes from the
    same operations on the same inputs (the FMA explicit, so no contraction the compiler may do on one path only).
    Which path a tile takes depends on the block's other rows; a row's bits do not (tests/gpu/
    test_fork_attention_invariant_gpu.py checks them bitwise over random layouts)."""
    keys = start + offs_n
    k_ptrs = k_base + keys[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = v_base + keys[:, None] * stride_vt + offs_dv[None, :]
    k = _tile_rows(k_ptrs, keys, hi, offs_d, HEAD_DIM, EVEN_D, FULL)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # raw scores; the scale comes in the max and the exponent
    if FULL:
        touched = active
    else:
        # the row's visible columns of this tile, [lo, hi_): two compares with the column index, none for inactive
        # rows (lo = BLOCK_N)
        lo = tl.where(active, row_lo - start, BLOCK_N)
        hi_ = row_hi - start
        s = tl.where((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi_[:, None]), s, float("-inf"))
        touched = active & (start < row_hi) & (start + BLOCK_N > row_lo)  # the row sees a key of this tile
    # max(s * scale) = max(s) * scale (scale > 0, rounding monotone): one multiply a row, not one a score
    m_new = tl.where(touched, tl.maximum(m_i, tl.max(s, 1) * qk_scale), m_i)
    neg_m = tl.where(touched, -m_new, float("-inf"))  # untouched rows: p = exp2(-inf) = +0 whatever s holds
    p = tl.math.exp2(tl.fma(s, qk_scale, neg_m[:, None]))
    alpha = tl.where(touched, tl.math.exp2(m_i - m_new), 1.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _tile_rows(v_ptrs, keys, hi, offs_dv, HEAD_DIM_V, EVEN_D, FULL)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["T"])
def _fork_attention_invariant_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seg_lo_ptr, trunk_lo_ptr, trunk_hi_ptr, stats_ptr,
                                     pk_ptr, pv_ptr, pre_lo_ptr, pre_hi_ptr, sub_lo_ptr, sub_hi_ptr,
                                     T, qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                     stride_ot, stride_oh, stride_pkt, stride_pkh, stride_pvt, stride_pvh,
                                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                                     HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
                                     STATS: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_SUB: tl.constexpr,
                                     V_PARTS: tl.constexpr, LEAN: tl.constexpr):
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # tokens per query block; rows past TOKENS * GROUP idle
    # BLOCK_DV: the value columns of one program, a 1 / V_PARTS part of the (padded) head (`value_parts`)
    EVEN_D: tl.constexpr = (BLOCK_D == HEAD_DIM) and (BLOCK_DV * V_PARTS == HEAD_DIM_V)
    BIG: tl.constexpr = (1 << 31) - 1  # past any stream index: "no range"
    # The phases in the order they are walked; the sub-trunk phase exists only with HAS_SUB, so that without it the
    # phases keep the numbers (and the kernel the code) it had before nested forks
    PRE: tl.constexpr = 0
    TRUNK: tl.constexpr = 1
    SUB: tl.constexpr = 2
    OWN: tl.constexpr = 3 if HAS_SUB else 2
    SELF: tl.constexpr = 4 if HAS_SUB else 3
    # Heaviest blocks first (the questions at the end of the stream see whole states), as in triton.py
    n_blocks = tl.num_programs(0)
    pid_m = n_blocks - 1 - tl.program_id(0)
    kvh = tl.program_id(1) // V_PARTS
    part = tl.program_id(1) % V_PARTS
    rows = tl.arange(0, BLOCK_M)
    tok = pid_m * TOKENS + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    valid = (rows < TOKENS * GROUP) & (tok < T)
    # int32 from here on (a stream is far below 2**31 tokens)
    seg_lo = tl.load(seg_lo_ptr + tok, mask=valid, other=0).to(tl.int32)
    trunk_lo = tl.load(trunk_lo_ptr + tok, mask=valid, other=0).to(tl.int32)
    trunk_hi = tl.load(trunk_hi_ptr + tok, mask=valid, other=0).to(tl.int32)
    has_trunk = trunk_hi > trunk_lo
    if HAS_PREFIX:  # checkpoint rows [pre_lo, pre_hi) of pk / pv precede everything else the row sees
        pre_lo = tl.load(pre_lo_ptr + tok, mask=valid, other=0).to(tl.int32)
        pre_hi = tl.load(pre_hi_ptr + tok, mask=valid, other=0).to(tl.int32)
    else:
        pre_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        pre_hi = pre_lo
    has_prefix = pre_hi > pre_lo
    single = valid & (seg_lo == tok) & (trunk_hi <= trunk_lo) & (pre_hi <= pre_lo)  # sees only itself (a pad...)
    walk = valid & ((seg_lo != tok) | has_trunk | has_prefix)  # every other real row
    if HAS_SUB:  # a leaf's sub-trunk [sub_lo, sub_hi): another segment of the stream, seen between state and own
        sub_lo = tl.load(sub_lo_ptr + tok, mask=valid, other=0).to(tl.int32)
        sub_hi = tl.load(sub_hi_ptr + tok, mask=valid, other=0).to(tl.int32)
        has_sub = sub_hi > sub_lo
        single = single & (sub_hi <= sub_lo)
        walk = walk | (valid & has_sub)
        id_s = tl.where(walk & has_sub, sub_lo, BIG)
        first_s = tl.min(id_s, 0)
    # Each row's range id in each phase (BIG: no part in that phase); a range's tiles start at its id.
    # PRE: the row's checkpoint prefix [pre_lo, pre_hi) in pk / pv (resumed states and their questions only);
    # TRUNK: the row's state [trunk_lo, trunk_hi); SUB (HAS_SUB only): its sub-trunk [sub_lo, sub_hi) (id_s above);
    # OWN: its own keys [seg_lo, t]; SELF: the rows that see only themselves, all in one range from the first of them
    # (one key a row: its column in the tile changes nothing, p * v_t / p whatever the column), so a block of pads
    # costs one tile, not one per pad
    id_p = tl.where(walk & has_prefix, pre_lo, BIG)
    id_a = tl.where(walk & has_trunk, trunk_lo, BIG)
    id_b = tl.where(walk, seg_lo, BIG)
    first_c = tl.min(tl.where(single, tok, BIG), 0)
    id_c = tl.where(single, first_c, BIG)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = part * BLOCK_DV + tl.arange(0, BLOCK_DV)
    q_ptrs = q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    if EVEN_D:
        q = tl.load(q_ptrs, mask=valid[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    pk_base = pk_ptr + kvh.to(tl.int64) * stride_pkh
    pv_base = pv_ptr + kvh.to(tl.int64) * stride_pvh

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    n_tiles = 0
    # One loop over the ranges of all phases, in order (so that every tile runs the same code); `cur` is the
    # current range's id, the next one the smallest id above it in the phase, else the next phase's first
    first_p = tl.min(id_p, 0)
    first_a = tl.min(id_a, 0)
    first_b = tl.min(id_b, 0)
    phase = tl.where(first_p < BIG, PRE, tl.where(first_a < BIG, TRUNK, tl.where(first_b < BIG, OWN, SELF)))
    cur = tl.where(first_p < BIG, first_p, tl.where(first_a < BIG, first_a, tl.where(first_b < BIG, first_b,
                                                                                      first_c)))
    if HAS_SUB:  # no prefix and no state in the block: its first range is a sub-trunk
        sub_first = (first_p == BIG) & (first_a == BIG) & (first_s < BIG)
        phase = tl.where(sub_first, SUB, phase)
        cur = tl.where(sub_first, first_s, cur)
    while cur < BIG:
        row_id = tl.where(phase == PRE, id_p, tl.where(phase == TRUNK, id_a, tl.where(phase == OWN, id_b, id_c)))
        if HAS_SUB:
            row_id = tl.where(phase == SUB, id_s, row_id)
        row_lo = tl.where(phase == SELF, tok, row_id)
        row_hi = tl.where(phase == PRE, pre_hi, tl.where(phase == TRUNK, trunk_hi, tok + 1))
        if HAS_SUB:
            row_hi = tl.where(phase == SUB, sub_hi, row_hi)
        active = row_id == cur
        hi = tl.max(tl.where(active, row_hi, 0), 0)
        if HAS_PREFIX:  # the prefix phase reads pk / pv; every phase runs the same tile calls below
            kb = tl.where(phase == PRE, pk_base, k_base)
            vb = tl.where(phase == PRE, pv_base, v_base)
            skt = tl.where(phase == PRE, stride_pkt, stride_kt)
            svt = tl.where(phase == PRE, stride_pvt, stride_vt)
        else:
            kb, vb, skt, svt = k_base, v_base, stride_kt, stride_vt
        if LEAN:
            # The range's first j_b tiles (starts cur + j * BLOCK_N) lie inside every active row's [row_lo,
            # row_hi): they take the FULL path, in a loop of their own before the masked loop of the rest (the
            # tiles' one order; neither loop has a branch inside, so each keeps Triton's software pipelining of its
            # loads). Every active row has row_lo >= cur and row_hi > cur; the phases other than SELF have row_lo ==
            # cur for all of them. A range without a full tile (short segments, SELF) skips the first loop by one
            # uniform branch. (A first form with three loops a range, masked / full / masked, each with its
            # pipeline's prologue, measured MultiRC's attention at 0.219 ms vs the one-path tile's 0.179, H100; this
            # one at 0.191 vs 0.178 on another H100 of the same session)
            n_t = (hi - cur + BLOCK_N - 1) // BLOCK_N
            lo_max = tl.max(tl.where(active, row_lo, cur), 0)
            hi_min = tl.min(tl.where(active, row_hi, BIG), 0)
            j_b = tl.where(lo_max == cur, tl.minimum((hi_min - cur) // BLOCK_N, n_t), 0)
            full_hi = cur + j_b * BLOCK_N
            if full_hi > cur:
                for start in range(cur, full_hi, BLOCK_N):
                    acc, l_i, m_i = _lean_tile(acc, l_i, m_i, q, kb, vb, skt, svt, offs_n, offs_d, offs_dv, start,
                                               hi, active, row_lo, row_hi, qk_scale, BLOCK_N, HEAD_DIM, HEAD_DIM_V,
                                               EVEN_D, PRECISION, True)
            for start in range(full_hi, hi, BLOCK_N):
                acc, l_i, m_i = _lean_tile(acc, l_i, m_i, q, kb, vb, skt, svt, offs_n, offs_d, offs_dv, start, hi,
                                           active, row_lo, row_hi, qk_scale, BLOCK_N, HEAD_DIM, HEAD_DIM_V, EVEN_D,
                                           PRECISION, False)
            if STATS:
                n_tiles += n_t
        else:
            for start in range(cur, hi, BLOCK_N):
                acc, l_i, m_i = _tile(acc, l_i, m_i, q, kb, vb, skt, svt, offs_n, offs_d, offs_dv,
                                      start, hi, active, row_lo, row_hi, qk_scale, BLOCK_N, HEAD_DIM, HEAD_DIM_V,
                                      EVEN_D, PRECISION)
                if STATS:
                    n_tiles += 1
        nxt = tl.min(tl.where(row_id > cur, row_id, BIG), 0)
        # the phase's last range done: on to the next phase that has one (SELF may have none: then cur = BIG)
        to_a = (nxt == BIG) & (phase == PRE) & (first_a < BIG)
        taken = to_a
        if HAS_SUB:
            to_s = (nxt == BIG) & (phase <= TRUNK) & (first_s < BIG) & (to_a == 0)
            taken = to_a | to_s
        to_b = (nxt == BIG) & (phase < OWN) & (first_b < BIG) & (taken == 0)
        to_c = (nxt == BIG) & (phase < SELF) & (taken == 0) & (to_b == 0)
        cur = tl.where(to_a, first_a, tl.where(to_b, first_b, tl.where(to_c, first_c, nxt)))
        phase = tl.where(to_a, TRUNK, tl.where(to_b, OWN, tl.where(to_c, SELF, phase)))
        if HAS_SUB:
            cur = tl.where(to_s, first_s, cur)
            phase = tl.where(to_s, SUB, phase)

    l_i = tl.where(l_i > 0, l_i, 1.0)  # idle rows only: every real row sees at least itself
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    if EVEN_D:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=valid[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    if STATS:
        if part == 0:  # the parts of a block visit the same tiles
            tl.store(stats_ptr + kvh * n_blocks + pid_m, n_tiles)


def _pow2_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot needs >= 16 along every dim; padded dims are masked


def _tiles(config: Config | None, head_dim: int, dtype: torch.dtype, group: int) -> Config:
    cfg = config or default_config(head_dim, dtype)
    if cfg.block_m < group:
        cfg = Config(triton.next_power_of_2(group), cfg.block_n, cfg.num_warps, cfg.num_stages)
    return cfg


def fork_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                   trunk_hi: torch.Tensor, scale: float, *, config: Config | None = None,
                   out: torch.Tensor | None = None, stats: torch.Tensor | None = None,
                   prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   sub: tuple[torch.Tensor, torch.Tensor] | None = None,
                   v_parts: int | None = None, lean: bool | None = None) -> torch.Tensor:
    """Same contract as `reference.fork_attention` ([T, Hq, D] / [T, Hkv, D] / [T, Hkv, Dv] in, [T, Hq, Dv] out in
    q's dtype; scores, softmax and sums in fp32), batch-invariant (module docstring). CUDA tensors, or CPU tensors
    under TRITON_INTERPRET=1.

    config: tiles (default: `default_config`; rows are invariant only among calls with the same tiles). out: an
    output buffer to write into (every element is written). stats: int32 [Hkv * query_blocks(...)] (index kv_head *
    n_query_blocks + block) to receive the number of key tiles each program visited (tests, benchmarks; None
    compiles the counting out).
    prefix: (pk [P, Hkv, D], pv [P, Hkv, Dv], pre_lo [T], pre_hi [T]): checkpoint keys a row sees before all else,
    rows [pre_lo[t], pre_hi[t]) of pk / pv (`reference.fork_attention_prefix`'s contract; pk / pv in q's dtype). They
    are walked in tiles from pre_lo: a state resumed at m (a multiple of 64, GDN chunks) then sees the tiles a fresh
    one sees, cut at the same places (BLOCK_N divides 64).
    sub: (sub_lo [T], sub_hi [T]): nested forks, each leaf token's sub-trunk rows [sub_lo[t], sub_hi[t]) of the
    stream (`reference.fork_attention(..., sub_lo=, sub_hi=)`'s contract), walked after the state, in tiles from
    sub_lo. None compiles the sub-trunk phase out (the kernel without nested forks).
    v_parts: programs per (query block, KV head), each with a part of the value columns (default: `value_parts`).
    lean: the lean tiles (default `LEAN_TILES`; rows are invariant only among calls with the same choice).
    """
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    if k.shape != (T, Hkv, D) or v.shape[:2] != (T, Hkv) or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected [T, Hq, D], "
                         f"[T, Hkv, D], [T, Hkv, Dv] with Hq a multiple of Hkv")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    # int32 (a round's own) or int64 tables: the kernel loads either and works in int32
    check_token_tables(T, seg_lo=seg_lo, trunk_lo=trunk_lo, trunk_hi=trunk_hi)
    group = Hq // Hkv
    cfg = _tiles(config, D, q.dtype, group)
    if out is None:
        out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    elif out.shape != (T, Hq, Dv) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {(T, Hq, Dv)} on {q.device}")
    if T == 0:
        return out
    # the kernel addresses the head dim with stride 1
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    if out.stride(2) != 1:
        raise ValueError("out must have a contiguous last dim")
    if T * max(k.stride(0), v.stride(0)) >= 2 ** 31:  # key offsets are int32 in the kernel
        raise ValueError(f"a stream of {T} tokens with key rows of {max(k.stride(0), v.stride(0))} elements "
                         "overflows the kernel's int32 key offsets")
    seg_lo, trunk_lo, trunk_hi = seg_lo.contiguous(), trunk_lo.contiguous(), trunk_hi.contiguous()
    if prefix is not None:
        pk, pv, pre_lo, pre_hi = prefix
        if pk.dim() != 3 or pk.shape[1:] != (Hkv, D) or pv.shape != (pk.shape[0], Hkv, Dv):
            raise ValueError(f"pk {tuple(pk.shape)}, pv {tuple(pv.shape)}: expected [P, {Hkv}, {D}], [P, {Hkv}, {Dv}]")
        if pk.dtype != q.dtype or pv.dtype != q.dtype:
            raise ValueError(f"pk, pv must be {q.dtype} (q's dtype), got {pk.dtype}, {pv.dtype}")
        check_token_tables(T, pre_lo=pre_lo, pre_hi=pre_hi)
        if pk.shape[0] * max(pk.stride(0), pv.stride(0), 1) >= 2 ** 31:
            raise ValueError(f"a prefix of {pk.shape[0]} rows overflows the kernel's int32 key offsets")
        pk, pv = (x if x.stride(2) == 1 else x.contiguous() for x in (pk, pv))
        if pk.shape[0] == 0:  # nothing to read: a valid pointer that no tile loads
            pk, pv = k[:1], v[:1]
        pre_lo, pre_hi = pre_lo.contiguous(), pre_hi.contiguous()
    else:
        pk, pv, pre_lo, pre_hi = k, v, seg_lo, seg_lo
    if sub is not None:
        sub_lo, sub_hi = sub
        check_token_tables(T, sub_lo=sub_lo, sub_hi=sub_hi)
        sub_lo, sub_hi = sub_lo.contiguous(), sub_hi.contiguous()
    else:
        sub_lo = sub_hi = seg_lo  # never read (HAS_SUB false)
    parts = value_parts(Dv, q.dtype) if v_parts is None else v_parts
    if parts < 1 or _pow2_dim(Dv) % parts or _pow2_dim(Dv) // parts < 16:
        raise ValueError(f"v_parts must split the {_pow2_dim(Dv)} padded value columns into parts of 16 or more, "
                         f"got {parts}")
    grid = (triton.cdiv(T, cfg.block_m // group), Hkv * parts)
    if stats is not None and (stats.shape != (grid[0] * Hkv,) or stats.dtype != torch.int32):
        raise ValueError(f"stats must be int32 [{grid[0] * Hkv}]")
    _fork_attention_invariant_kernel[grid](
        q, k, v, out, seg_lo, trunk_lo, trunk_hi, stats if stats is not None else seg_lo, pk, pv, pre_lo, pre_hi,
        sub_lo, sub_hi, T, float(scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        pk.stride(0), pk.stride(1), pv.stride(0), pv.stride(1),
        GROUP=group, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_pow2_dim(D),
        BLOCK_DV=_pow2_dim(Dv) // parts, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        STATS=stats is not None, HAS_PREFIX=prefix is not None, HAS_SUB=sub is not None, V_PARTS=parts,
        LEAN=LEAN_TILES if lean is None else bool(lean), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def query_blocks(tokens: int, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype,
                 config: Config | None = None) -> int:
    """Programs per KV head for a stream of `tokens` (`stats` holds this times Hkv)."""
    group = heads_q // heads_kv
    return triton.cdiv(tokens, _tiles(config, head_dim, dtype, group).block_m // group)
