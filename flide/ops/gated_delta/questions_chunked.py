"""The fork's question call in chunked form on the tensor cores: each question moves its state once per 64-token chunk
instead of once per token.

Why: the recurrent question kernel (`branches.py`) issues ~16 x 128 x 6 fp32 operations a token on the CUDA cores and
a question's latency is its length: on the H100 (session 35 profiles, Qwen3.5-0.8B) 0.71 of RACE's 3.06 ms replay and
3.0 of QuALITY's 29.7 ms. The earlier chunked question call (`questions_wy.py`) lost end to end (session 30): its
w / u came from fla's recompute step over the states' AND the questions' chunk rows, which computes every spare row
of a bucket's capacity as a masked chunk (no early return: w / u 3.09 vs 0.99 ms on QuALITY), and its fp32 / tf32
chain ran ~50 us a chunk step. Here:
- the state call's fused kkt + solve launch (fla's, which returns at once on spare rows) also covers the questions'
  chunks and hands over A = (I + strictly-lower(beta k k^T decay))^-1 per chunk, with the chunk-local gate cumsums
  (`fla.gated_delta_states_chunked`); fla's w / u step stays over the states' rows only;
- this kernel forms a question chunk's w = A (beta e^g k) and u = A (beta v) itself, from A and the tokens, with the
  products and roundings of fla's w / u step, then runs the fused chain's step (`state_chain.py`: the chunk's new
  values from the state, its outputs, the state moved), bf16 products with fp32 accumulators as fla's kernels.
Programs per (value head, BV value columns) run the question rows in turn (ROW_PROGRAMS of them). A nested fork's
leaf (a question whose first token names a sub-trunk range [lo, hi), `round.py`: always a question row of the same
request) first runs its sub-trunk's chunks from the state, without outputs, then its own (a judge's question line
is one chunk step); or, with STORED_SUB_STATES, starts from its sub-trunk's state that a first launch stored.

A question's chunks start at its own first token and its sums depend on its own tokens and state only:
batch-invariant. Runs on CPU tensors under TRITON_INTERPRET=1 (fp32 there, what the CPU tests check against the
reference fork, with `questions_wy.wy_reference(..., with_solve=True)` standing in for fla's kkt + solve).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...config import GDN_CHUNK
from . import SUB_STATE_SLOTS
from .branches import rows_used
from .state_chain import _chunk_output

# Value columns a program, warps, stages for 16-bit inputs: 64 columns, 8 warps, 1 stage (since session 44). A
# program's w = A (beta e^g k) and q k^T do not depend on its value columns, so every value tile recomputes them: 64
# columns do that half as often as the fused state chain's 32 (NARROW_TILES, the default before). As compiled for
# sm_90 by the device's Triton 3.6 (`benchmarks/ops/kernel_resources.py --chunked-questions`, 0.8B's 16 value heads):
# 255 registers, 124 bytes of spills (nested 296), 48 KB of shared memory; NARROW_TILES 276 bytes (nested 480), 85 KB
# (Triton 3.9 here: 60 / 116 bytes). Replay GPU ms, 0.8B, these vs NARROW_TILES, H100, same call (8 repeats):
# session 43 (`benchmarks/results/h100_profile_0_8b_session43_{q64,main}.json`): the question launch RACE 0.290 vs
# 0.392 (replay 2.671 vs 2.775), QuALITY 1.326 vs 1.535 (27.65 vs 27.84), 8 questions of a 2,000-token state 0.791 vs
# 0.880 (11.52 vs 11.64), 6 MultiRC requests in a round 0.296 vs 0.507 (29.76 vs 29.89); MultiRC alone and 64
# questions (nested questions: the recurrent launch) equal; session 44 (`h100_profile_0_8b_session44_widen_{both,
# main}.json`, with NESTED_BLOCK_V 32 from 2,048 tokens): RACE 0.288 vs 0.398 (2.660 vs 2.783), QuALITY 1.322 vs 1.531
# (27.43 vs 27.63), 8 questions 0.797 vs 0.884 (11.51 vs 11.68), 3 MultiRC requests 0.255 vs 0.441. GPU-tested against
# the reference in bf16 and fp32 (`tests/gpu/test_questions_chunked_gpu.py`, both tile sets). Loading k a second time
# transposed instead of `tl.trans` took 117 KB at 32 columns (one program an SM) for 28 bytes less of spills.
BLOCK_V = 64
NUM_WARPS = 8
NUM_STAGES = 1
# the default before session 44 (the fused state chain's tiles), kept for the A/B and tested beside the default
NARROW_TILES = (32, 4, 2)
# fp32 inputs (the tests' precision): 32 / 4 / 1 stage (two stages need 255 KB, over sm_90's 227); 64 / 8 spills 884
# bytes there and takes 144 KB
FP32_TILES = (32, 4, 1)
# Programs per (value tile, value head) along the question rows, each running rows i, i + P, ... up to the last row
# with tokens. A program per capacity row lost on the H100 (session 36: QuALITY's question call 3.31 ms over 18
# layers for 16 questions, quality1's 0.81 ms with NO question row): a bucket's 512 question rows x 16 heads x 4
# tiles are 32k programs of 117 KB each, one at a time an SM, nearly all returning at once, and their launches alone
# took the time
ROW_PROGRAMS = 16
# A nested fork's leaves start from their sub-trunk's state stored by a first launch (rows with a slot:
# `gated_delta.sub_slots`, up to SUB_STATE_SLOTS sub-trunks a round), instead of each re-running its sub-trunk's
# chunks in one launch. A sub-trunk of 60-180 tokens (the profile's sweep 64: 16 of them, 64 leaves of 2 tokens) is
# 1-3 chunk steps a leaf; a judge's question line (MultiRC: 12-25 tokens) is one. Unmeasured (session 36): off.
STORED_SUB_STATES = False


@triton.jit
def _question_step(S, q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, a_ptr, o_ptr, bos, n, c0, i_h, i_hk, o_k, o_t, o_v, v_ok,
                   causal, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, OUTPUT: tl.constexpr):
    """One chunk (tokens bos + c0 .. of a segment of n tokens) from the state slice S [K, BV] before it: its w / u as
    fla's w / u step forms them, its outputs (OUTPUT) as the fused chain's, and the state after it."""
    t = bos + c0 + o_t
    t_ok = (c0 + o_t) < n
    b_k = tl.load(k_ptr + (t[:, None] * H + i_hk) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)  # [BT, K]
    b_kt = tl.trans(b_k)  # [K, BT]
    # beta in the inputs' dtype, as fla's steps read it (the conv may hand it over in float32)
    b_b = tl.load(beta_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(k_ptr.dtype.element_ty)
    b_g = tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
    g_last = tl.load(g_ptr + (bos + tl.minimum(c0 + BT, n) - 1) * HV + i_h).to(tl.float32)
    # A's rows of the chunk's tokens (fla's layout [T, Hv, BT]: row i holds (I + A)^-1's row i within the chunk), its
    # lower triangle: the kkt + solve launch leaves the upper blocks unwritten (no zero fill: `fla._solve`), rows past
    # the segment masked (selected after the load, which a mask along the row would take element by element)
    b_a = tl.load(a_ptr + (t[:, None] * HV + i_h) * BT + o_t[None, :], mask=t_ok[:, None], other=0.0)
    b_a = tl.where(causal, b_a, 0.0)
    p_v = (t[:, None] * HV + i_h) * V + o_v[None, :]
    m_v = t_ok[:, None] & v_ok[None, :]
    b_v = tl.load(v_ptr + p_v, mask=m_v, other=0.0)
    # fla's w / u step: u = A (beta v), w = A (beta e^g k), each product's operand and result in the inputs' dtype
    b_u = tl.dot(b_a, (b_v * b_b[:, None]).to(b_v.dtype)).to(b_v.dtype)
    b_kb = b_k * b_b[:, None]
    b_kb *= tl.exp2(b_g)[:, None]
    b_w = tl.dot(b_a, b_kb.to(b_k.dtype)).to(b_k.dtype)
    # the fused chain's step (state_chain._state_chain_kernel)
    b_s = S.to(b_w.dtype)
    b_vn = b_u - tl.dot(b_w, b_s)
    if OUTPUT:
        b_q = tl.load(q_ptr + (t[:, None] * H + i_hk) * K + o_k[None, :], mask=t_ok[:, None], other=0.0)
        b_o = _chunk_output(b_q, b_s, b_kt, b_vn, b_g, t_ok, causal, scale)
        tl.store(o_ptr + p_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    b_vn = b_vn * tl.where(t_ok, tl.exp2(g_last - b_g), 0.0)[:, None]
    S = S * tl.exp2(g_last)
    return tl.dot(b_kt, b_vn.to(b_kt.dtype), S)


@triton.jit
def _state_of(h0_ptr, from_ptr, i_n, i_h, o_k, o_v, v_ok, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BV: tl.constexpr):
    """Row i_n's start: its state's final state slice (-1: a zero state)."""
    S = tl.zeros([K, BV], dtype=tl.float32)
    row = tl.load(from_ptr + i_n).to(tl.int64)
    if row >= 0:
        S += tl.load(h0_ptr + (row * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :], mask=v_ok[None, :],
                     other=0.0)
    return S


@triton.jit(do_not_specialize=["N", "P"])
def _questions_chunked_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, a_ptr, o_ptr, h0_ptr, start_ptr, len_ptr,
                              from_ptr, sub_lo_ptr, sub_hi_ptr, slot_ptr, subs_ptr, scale, N, P, H: tl.constexpr,
                              HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                              BV: tl.constexpr, NESTED: tl.constexpr, PHASE: tl.constexpr):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2)
    i_hk = i_h // (HV // H)  # grouped value heads: value head h reads key head h // (HV // H)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    v_ok = o_v < V
    causal = o_t[:, None] >= o_t[None, :]
    # the rows up to the last one with tokens, in turns: no program per spare row
    for i_n in range(i_p, rows_used(len_ptr, N), P):
        n = tl.load(len_ptr + i_n).to(tl.int64)
        bos = tl.load(start_ptr + i_n).to(tl.int64)
        lo = bos
        m = n * 0  # a leaf's sub-trunk rows [lo, lo + m) (a question row of its own: chunks from its first token)
        if NESTED:
            lo = tl.load(sub_lo_ptr + bos, mask=n > 0, other=0).to(tl.int64)
            m = tl.load(sub_hi_ptr + bos, mask=n > 0, other=0).to(tl.int64) - lo
        # PHASE 0: every row, a leaf re-running its sub-trunk; with stored sub-trunk states, PHASE 1 the rows that
        # are no leaf (a sub-trunk with a slot stores its state after its tokens), PHASE 2 the leaves
        run = n > 0
        if PHASE == 1:
            run = run & (m <= 0)
        if PHASE == 2:
            run = run & (m > 0)
        if run:
            slot = i_n * 0 - 1
            if PHASE != 0:
                slot = tl.load(slot_ptr + i_n).to(tl.int64)
            slot_at = (slot * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
            from_slot = False
            if PHASE == 2:
                from_slot = slot >= 0
            if from_slot:  # a leaf whose sub-trunk's state the first launch stored
                S = tl.load(subs_ptr + slot_at, mask=v_ok[None, :], other=0.0)
            else:
                S = _state_of(h0_ptr, from_ptr, i_n, i_h, o_k, o_v, v_ok, HV, K, V, BV)
                # a leaf re-running its sub-trunk (PHASE 0, or PHASE 2 without a slot); m is 0 for the other rows
                for c0 in range(0, m, BT):
                    S = _question_step(S, q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, a_ptr, o_ptr, lo, m, c0, i_h, i_hk,
                                       o_k, o_t, o_v, v_ok, causal, scale, H, HV, K, V, BT, False)
            for c0 in range(0, n, BT):
                S = _question_step(S, q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, a_ptr, o_ptr, bos, n, c0, i_h, i_hk, o_k,
                                   o_t, o_v, v_ok, causal, scale, H, HV, K, V, BT, True)
            if PHASE == 1:
                if slot >= 0:
                    tl.store(subs_ptr + slot_at, S, mask=v_ok[None, :])


def questions_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                      A: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                      initial_index: torch.Tensor, scale: float,
                      sub: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
                      tiles: tuple[int, int, int] | None = None, row_programs: int | None = None,
                      sub_slot: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hv, V] (q's dtype) of every segment from `initial_state[initial_index[n]]` (-1: zero); rows outside the
    segments unwritten. q, k [T, Hk, K] and v [T, Hv, V] as the kernels read them (q / k normalised, contiguous);
    beta [T, Hv]; g [T, Hv] float32: the chunk-local cumulated log2 decays, A [T, Hv, GDN_CHUNK]: the solved
    (I + A)^-1 rows, both over chunks that start at each segment's first token (fla's cumsum and kkt + solve steps
    over the question rows, `fla.gated_delta_states_chunked`). `sub`: (sub_lo, sub_hi) [T] int32 of a nested fork:
    a segment whose first token has a non-empty range [lo, hi) (itself a segment, so its g / A are its own chunks')
    runs those rows first, without outputs (`reference.gated_delta`'s semantics). `tiles`: (value columns, warps,
    stages); one fixed choice keeps batch invariance (a row's sums do not depend on which program runs it).
    `row_programs`: programs along the rows (default ROW_PROGRAMS). `sub_slot` (with `sub`; [N] int32, the rows'
    `gated_delta.sub_slots`): with STORED_SUB_STATES, two launches instead of one, the first running every row that
    is no leaf and storing each slotted sub-trunk's state after its tokens, the second the leaves, a slotted leaf
    from its sub-trunk's stored state (the same steps in the same order as re-running them: the same bits)."""
    T, HK, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    if K & (K - 1) or K < 16:
        raise ValueError(f"the key head dim must be a power of two >= 16, not {K}")
    if q.shape != k.shape or g.shape != (T, HV) or beta.shape != (T, HV) or A.shape != (T, HV, GDN_CHUNK):
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} / beta {tuple(beta.shape)} / "
                         f"g {tuple(g.shape)} / A {tuple(A.shape)} do not match [T={T}, Hk={HK} / Hv={HV}, K={K}, "
                         f"chunk {GDN_CHUNK}]")
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device) if out is None else out
    N = seg_start.shape[0]
    if N == 0:
        return o
    if initial_state.shape[0] == 0:  # nothing to read: a dummy pointer that no program loads (every index is -1)
        initial_state = torch.zeros(1, HV, K, V, dtype=torch.float32, device=q.device)
    BV, warps, stages = tiles or ((BLOCK_V, NUM_WARPS, NUM_STAGES) if q.element_size() <= 2 else FP32_TILES)
    BV = min(BV, max(16, triton.next_power_of_2(V)))
    P = max(1, min(ROW_PROGRAMS if row_programs is None else row_programs, N))
    if sub is not None and any(t.shape != (T,) for t in sub):
        raise ValueError(f"sub_lo / sub_hi must be [T={T}], got {[tuple(t.shape) for t in sub]}")
    sub_lo, sub_hi = sub if sub is not None else (seg_start, seg_start)  # read with a nested fork only
    stored = sub is not None and sub_slot is not None and STORED_SUB_STATES
    # the slotted sub-trunks' states (fp32 [slots, Hv, K, V]: 32 MiB on Qwen3.5-0.8B, a transient of the call)
    subs = (torch.empty(SUB_STATE_SLOTS, HV, K, V, dtype=torch.float32, device=q.device) if stored
            else initial_state)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), g.float().contiguous(), A.contiguous(),
            o, initial_state.float().contiguous(), seg_start.contiguous(), seg_len.contiguous(),
            initial_index.contiguous(), sub_lo.contiguous(), sub_hi.contiguous(),
            (sub_slot if stored else seg_start).contiguous(), subs, float(scale), N, P)
    for phase in ((1, 2) if stored else (0,)):
        _questions_chunked_kernel[(triton.cdiv(V, BV), HV, P)](
            *args, H=HK, HV=HV, K=K, V=V, BT=GDN_CHUNK, BV=BV, NESTED=sub is not None, PHASE=phase, num_warps=warps,
            num_stages=stages)
    return o


# The split call's nested launch (the recurrent kernel over the leaves and their sub-trunks) with this many programs
# per (value head, value tile) taking the rows in turns, up to the last row with tokens, instead of a program a row
# (0). In a round without nested forks that launch is all empty rows: H200, session 38, 40.5 us a layer on QuALITY
# (0.73 ms of a 27.5 ms replay; 16 RACE 0.73, 8 questions 0.33) for the 8,192 bucket's 512 rows x 16 heads x 8 tiles
# of programs that return at once. Rows in turns cost the straight path ~10 % where there are nested rows (H200,
# 2026-12-02, 1c7ea47: a row loop around the token loop), i.e. MultiRC's 1.07 ms and 64 questions' 3.25. At 16
# (H100, session 40, the launch's ms a replay, 0 vs 16; `benchmarks/results/h100_profile_0_8b_session40_{main,
# all_flags}.json`): QuALITY 0.727 vs 0.072, 16 RACE 0.726 vs 0.071, 8 questions 0.328 vs 0.048, RACE 0.061 vs 0.041,
# but MultiRC 1.085 vs 1.214 and the bench's 64 questions (96 nested rows: 6 a program) 7.80 vs 9.63: 16 left off.
# At 128 (as many programs as a 64-question request has nested rows), the default (H100, session 41, same call, GPU ms
# 0 vs 128, `benchmarks/results/h100_profile_0_8b_session41_{main,rows128}.json`): the launch QuALITY 0.727 vs 0.227,
# 16 RACE 0.726 vs 0.227, 8 questions 0.328 vs 0.202, 64 questions 7.804 vs 7.793, MultiRC 1.071 vs 1.061, RACE
# 0.061 vs 0.066; the replay QuALITY 28.19 vs 27.80, 16 RACE 24.52 vs 24.06, 8 questions 11.76 vs 11.62, RACE 2.761
# vs 2.764, MultiRC 3.941 vs 3.929, 64 questions 28.62 vs 28.65.
# Taken in turns (i, i + P, ...) the rows of a round with more nested rows than programs hung on the leaves' waits
# (H100, session 42, 6 MultiRC requests in one round, ~250 nested rows: this launch 247.5 ms vs 9.4 a program a row;
# `h100_profile_0_8b_session42_turns.json`): a program's later leaf waited on a sub-trunk whose program was not yet
# dispatched, and spun out. Each program now takes a block of consecutive rows (`branches._branch_kernel`), same
# bits; same call, blocks vs a program a row (`..._session42_{blocks,rows0}.json`): that round 10.10 vs 9.45 ms
# (replay 29.88 vs 29.25), QuALITY 0.226 vs 0.727 (replay 27.81 vs 28.34), MultiRC 1.086 vs 1.071, 64 questions 7.96
# vs 7.76 (one row a program either way there: within the calls' spread, session 41 had 7.79 vs 7.80).
NESTED_ROW_PROGRAMS = 128
# Value columns a program of the nested launch in streams of at least NESTED_BLOCK_V_MIN_TOKENS tokens (a bucket's
# length: static per CUDA graph; since session 44); shorter streams, and None: the recurrent kernel's own (`branches.
# BLOCK_V`: 16 at 0.8B's 16 value heads). Why 32 pays: the nested launch is throughput-bound in long rounds (the
# bench's 64 questions: 96 rows x 16 heads x 8 tiles = 12,288 one-warp programs through ~1,850 slots, 7.9 ms a
# replay), and a program of 32 columns loads and gates each token once for twice the columns; with few rows (MultiRC
# alone: 24) half as many programs leave SMs idle. H100, same call, replay GPU ms, 8 repeats, 32 vs 16 columns:
# session 43, in every stream (`benchmarks/results/h100_profile_0_8b_session43_{bv32,main}.json`): the launch 64
# questions 7.227 vs 7.947 (replay 28.12 vs 28.82), 6 MultiRC requests in one round (~250 rows, 8,192 bucket) 9.52 vs
# 10.09 (29.32 vs 29.89), but MultiRC alone (768 bucket) 1.243 vs 1.093 (4.136 vs 3.971); rounds without nested rows
# gain a little (the all-empty launch: QuALITY 0.163 vs 0.227, 8 questions 0.116 vs 0.202). Session 44, from 2,048
# tokens (`h100_profile_0_8b_session44_widen_{both,main}.json`): 3 MultiRC requests in one round (3,598 tokens: the
# 4,096 bucket, ~72 nested rows) 4.201 vs 4.129 (32 loses), 64 questions (8,192 bucket) 7.172 vs 7.893 (replay 27.97
# vs 28.66). Session 45, the buckets between (`h100_profile_0_8b_session45_thr*.json`, replay 32 vs 16 columns at
# every length): 32 questions on a 2,000-token state (4,792 tokens: the 5,120 bucket) 18.12 vs 18.33 ms (the launch
# 4.080 vs 4.263), 4 MultiRC requests (5,972: 6,144) 22.12 vs 22.52 (7.043 vs 7.430), 5 (7,150: 7,168) 25.76 vs
# 26.52 (8.177 vs 8.958). Hence from 4,608 tokens, the bucket above the 4,096 where 32 lost. A width changes those
# rows' bits (the sums over K follow the program's layout), within the tests' bounds of the reference (GPU-tested
# with 32 columns in bf16 and fp32: `tests/gpu/test_questions_chunked_gpu.py -k nested_fork`), and so with the
# bucket: batch-invariant mode keeps the recurrent kernel's own (`fixed_tiles`).
NESTED_BLOCK_V: int | None = 32
NESTED_BLOCK_V_MIN_TOKENS = 4608


def questions_split_nested(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor, beta: torch.Tensor,
                           g: torch.Tensor, A: torch.Tensor, seg_start: torch.Tensor, plain_len: torch.Tensor,
                           nested_len: torch.Tensor, initial_state: torch.Tensor, initial_index: torch.Tensor,
                           sub_lo: torch.Tensor, sub_hi: torch.Tensor, sub_slot: torch.Tensor,
                           sub_flags: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           fixed_tiles: bool = False, group_len: torch.Tensor | None = None) -> torch.Tensor:
    """A nested fork's question call in two launches into one output: the rows of `plain_len` (no leaf, no sub-trunk
    a leaf continues) in chunked form (`questions_chunked`, from the state call's g / A over those rows' chunks), the
    rows of `nested_len` (the leaves and their sub-trunks: `gated_delta.nested_rows`) by the recurrent nested kernel
    (`branches.branches(sub=...)`, raw gates `g_raw`; its sub-trunks store their states for their leaves). Each row
    has its length in one of the two tables and 0 in the other, so each kernel's rows of the other are empty rows it
    skips, and the two write disjoint rows of `out` (default: a new tensor; rows outside the segments unwritten).

    Why: a leaf is short (a judge's answer candidate, a few tokens: the profile's 64-question sweep has leaves of 2
    tokens after sub-trunks of 62-179), and a chunk step costs ~20 tokens of the recurrent kernel's steps, so in
    chunked form a leaf paid a full 64-token step for its 2 tokens and re-ran (or reloaded) its sub-trunk's chunks:
    H100, session 37, question call 6.11 ms (4.39 with stored sub-trunk states) vs the recurrent kernel's 3.27, MultiRC
    1.57 (1.49) vs 1.07. A row's form follows from its request alone (whether it is a leaf or a sub-trunk a leaf of
    its own request continues), so every question is computed the same way whatever round it is in. The nested
    launch's width follows the stream's length (`NESTED_BLOCK_V_MIN_TOKENS`), which changes those rows' bits with the
    bucket: `fixed_tiles` (batch-invariant mode) keeps the recurrent kernel's own width in every bucket."""
    from . import branches

    o = torch.empty(v.shape, dtype=q.dtype, device=q.device) if out is None else out
    wide = NESTED_BLOCK_V is not None and q.shape[0] >= NESTED_BLOCK_V_MIN_TOKENS and not fixed_tiles
    branches.branches(q, k, v, g_raw, beta, seg_start, nested_len, initial_state, initial_index, scale, False, out=o,
                      sub=(sub_lo, sub_hi), sub_slot=sub_slot, sub_flags=sub_flags,
                      row_programs=NESTED_ROW_PROGRAMS or None,
                      tiles=(min(NESTED_BLOCK_V, triton.next_power_of_2(v.shape[2])), branches.NUM_WARPS)
                      if wide else None)  # (no wider than the head: a tiny model's V of 16 keeps its 16)
    # the groups of long leaves (`NESTED_CHUNKED_LEAF_TOKENS`: `group_len`) chunked in the nested form, each leaf
    # re-running its sub-trunk's chunks or, with STORED_SUB_STATES, starting from the state its sub-trunk stored in a
    # slot (slots are per sub-trunk row: no two launches share one), in a launch of their own: the nested binary
    # spills more and, stored, is two launches, which every round's plain rows paid when they shared it (H100,
    # session 44, `h100_profile_0_8b_session44_widen_stored.json`: RACE's launch 0.407 vs 0.288 ms)
    if group_len is not None:
        questions_chunked(q, k, v, beta, g, A, seg_start, group_len, initial_state, initial_index, scale,
                          sub=(sub_lo, sub_hi), out=o, sub_slot=sub_slot)
    return questions_chunked(q, k, v, beta, g, A, seg_start, plain_len, initial_state, initial_index, scale, out=o)
