"""The question call of the forked gated delta rule as one Triton kernel: each branch starts from its state's final
recurrent state, read in place by index, and runs the delta rule token by token.

Why not fla's chunked kernels for this call: they take one dense initial state per sequence, so the call had to
gather [N, Hv, K, V] float32 states for every branch row of the bucket's capacity (1 MiB per branch on
Qwen3.5-0.8B: 512 MiB per layer for the 512-token bucket) and write as many final states that nobody reads. On the
H200 (2026-11-30, Qwen3.5-0.8B, RACE, one request) those fills, gathers and copies took ~30 of the replay's ~49 ms
of GPU time. Questions are short (tens of tokens), which is what the recurrent form is good at: one program per
(branch, value head, V tile) keeps its [K, BV] state slice in registers, reads the state's slice once, and writes
only its branch's outputs. Capacity rows without a branch (length 0) return at once.

Each program's sums run in one fixed order that depends on nothing but its own branch's tokens, so the output of a
question has the same bits whatever else is in the round (batch-invariant), and asked alone it runs the same code.

Two forms of the same rule, both exact to fp32 rounding (`branches(..., form=)`):
- `recurrent` (the default): one token at a time, as above.
- `chunk`: 16 tokens at a time: the tokens of a chunk see the state through one product (K S) and each other
  through the inverse of a nilpotent 16 x 16 matrix (by doubling products, 4 tensor-core dots, computed before the
  chain), and the state moves once per chunk (S' = decay S + K^T U): a question costs len/16 dependent steps of two
  dots instead of len token steps. Its first version (forward substitution: 15 dependent cross-warp reductions a
  chunk, fp32 `ieee` dots) was ~10x SLOWER than the recurrent form on the H200 (2026-11-30,
  `benchmarks/ops/bench_gated_delta.py`, the question call alone on Qwen3.5-0.8B: RACE in its bucket 0.39 vs
  0.042 ms, 2,000 + 64 x 40 tokens 4.87 vs 0.31 ms). This version (tf32 dots for half-precision inputs, ieee for
  fp32) measured no faster (H200, 2026-12-01, `ops_gated_delta_wy_h200.md`: RACE in its bucket 0.041 vs 0.037 ms,
  64 x RACE 0.88-1.26 vs 0.92 with its best tiles): the recurrent form stays the default.

Runs on CPU tensors under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported), which is how the
CPU tests check it against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# how many sub-trunk states a nested question call stores (`branches(sub_slot=)`) and the flags its leaves wait on;
# defined with `sub_slots`, which derives the slots in the model's forward (`import flide` must not need triton)
from . import SUB_STATE_SLOTS, new_sub_flags

# Tiles measured on the H200 (2026-11-30, `benchmarks/ops/bench_gated_delta.py --sweep`, the question call alone on
# Qwen3.5-0.8B): 16 value columns per program and one warp took 0.216 ms on 2,000 + 64 x 40 tokens and 0.037 ms on
# RACE in its bucket, against 0.302 / 0.039 with fla's recurrent tiles (8 columns, one warp) and 0.31-0.75 / 0.05-0.08
# with 2-4 warps. One warp keeps the two sums over K of every token inside a warp (shuffles, no shared memory or
# barrier: the per-token latency is what a question's length multiplies); [K=128, 16] fp32 is 64 registers a thread,
# and the programs still fill the GPU for one request's few questions (RACE: 5 x 16 heads x 8 tiles = 640).
# Re-measured 2026-12-01 (`benchmarks/results/ops_gated_delta_block_loads_h200.md`): 32 columns, one warp, is faster
# on RACE rounds (RACE@bucket 0.034 vs 0.037 ms, 16 RACE requests 0.244 vs 0.289, 64 x RACE 0.848 vs 0.923) and
# slower on one long question (sweep 1: 0.086 vs 0.068): kept at 16. Loading 2-16 tokens' q/k/v per block instead of
# one token ahead was slower everywhere (RACE@bucket 0.046-0.10 ms, 16 RACE 0.45-0.92) and changed bits (other
# reduction layouts): dropped.
# Loads issued 2 or 4 tokens ahead (blocks of tokens, the next block's loads before this block's steps; the same bits)
# gained nothing (2026-12-01, `ops_gated_delta_ahead_h200.md`: RACE@bucket 0.0366 ms all three, 16 RACE 0.305 / 0.340
# vs 0.287, sweep 1 0.066 / 0.069 vs 0.067): a step waits on its own chain (decay, two sums over K, the rank-1
# update), not on its loads. Dropped.
# Parallel sums (each output from the decayed state, o = h^T q + (k . q) u, so the two sums over K sit side by side and
# the token chain holds one) gained nothing either (`ops_gated_delta_parallel_sums_h200.md`: RACE@bucket 0.0371 vs
# 0.0373 ms, 16 RACE 0.294 vs 0.288, sweep 1 0.0676 vs 0.0674): a program is one warp issuing ~16 x 128 x 6 fp32
# operations a token, and the few warps an SM holds for a question call cannot hide their latencies. Dropped: what
# would move this kernel is tensor cores (the chunked form), which the Triton chunk form above did not get out of.
# A Gluon version with explicit register layouts (edabb82, reverted): q, k and the output lived in the state slice's
# own slice layouts, so a token step had no shared-memory layout conversions (the sm_90 SASS of this kernel's step
# has 9 STS, 33 LDS and 3 BAR among ~490 instructions; the Gluon step none among ~490). It was NOT faster
# (2026-12-01, `ops_gated_delta_gluon_h200.md`, 16 columns / 8 lanes along K: RACE@bucket 0.046 vs 0.037 ms, sweep 1
# 0.094 vs 0.067, 64 x RACE 1.12 vs 0.92; other tiles 0.037-0.20 / 0.074-0.20 / 0.94-2.5; end to end RACE 4.16 vs
# 4.27 ms, sweep 1 12.9 vs 12.8, `h200_profile_0_8b_gluon.json`): the conversions are off the step's critical path.
# A lazy decay (branch wip/questions-lazy-decay, 5eb7727: the state kept as c * H with c the running product of the
# decays, folded into H below 2^-40, so a step has no [K, BV] decay multiply: ~445 sm_90 instructions on its common
# path vs 485) was SLOWER (H200, 2026-12-01, `ops_gated_delta_lazy_h200.md`: RACE@bucket 0.043 vs 0.037 ms, sweep 1
# 0.090 vs 0.067, 64 x RACE 0.97 vs 0.92; 9B shapes 0.054 vs 0.049, 1.95 vs 1.82): the fold's branch and the division
# by c in every step cost more than the multiplies they saved. Its CPU and GPU exactness tests passed; not merged.
# Re-measured on normalised q / k as the fork passes them (2026-12-01, session 19,
# `benchmarks/results/ops_gated_delta_tiles_normed_h200.md`): at 4B / 9B's heads (16 key, 32 value) 32 columns beat
# 16 on every stream but one (one 120-token question 0.069 vs 0.100 ms, 8 of them 0.178 vs 0.231, 16 RACE requests
# 0.435 vs 0.531, 64 x RACE 1.45 vs 1.59; RACE alone in its bucket 0.047 vs 0.043): with 32 value heads, 16-column
# programs are twice as many one-warp programs per question, two to a scheduler on the SMs they share. At 0.8B's 16
# value heads 16 columns stay (sweep 1 0.052 vs 0.068, sweep 8 0.104 vs 0.121). So a question gets ~128 programs:
# BLOCK_V columns per program up to 16 value heads, BLOCK_V_MANY_HEADS from 32. Whole 4B replays (H200, buckets
# [512, 2560, 8192, 10240], `h200_profile_4b_bv32.json` against the 16-column run of `h200_profile_4b_questions_cuda.json`,
# an earlier call of the same session): question kernel RACE 1.57 vs 1.73 ms, QuALITY 8.3 vs 10.4, sweep 8 / 64 5.6 /
# 24.8 vs 7.6 / 28.9, 16 RACE 15.6 vs 18.6, sweep 1 3.4 vs 3.0; latency alone QuALITY 129 vs 133 ms, sweep 64 160 vs
# 170, 16 RACE 123 vs 128.
BLOCK_V = 16
BLOCK_V_MANY_HEADS = 32
NUM_WARPS = 1
NUM_STAGES = 3  # the next tokens' q/k/v loads in flight while this one's update runs
# Row programs: 0 launches a program per (row, value head, V tile), and a bucket's spare rows (length 0) each cost a
# program that returns at once: the 8,192 bucket has 1,024 branch rows, 131k programs for ~64 questions at 32 clients.
# P > 0 launches P programs per (value head, V tile), each looping over rows i, i + P, ...: the same per-row code (the
# same bits), no waves of empty programs. H200, 2026-12-01 (`ops_gated_delta_rows_h200.md`, question call alone,
# 0.8B): P = 128 took 16 RACE requests in the 8,192 bucket from 0.287 to 0.253 ms (without spare rows: 0.243), but
# 64 x RACE 0.969 vs 0.922 and one long question (sweep 1) 0.079 vs 0.067: no default gain, kept at 0.
ROW_PROGRAMS = 0
# Tried (1c7ea47, reverted): programs for 64 rows only, each also looping over rows i + 64, ... below the round's
# rows_used (one past its last row with tokens, derived once per forward), so a bucket's spare rows launch nothing.
# H200, 0.8B replay (2026-12-02, `h200_profile_0_8b_rows_used.json` vs `..._lone_merged.json`): the kernel with no
# question at all (sweep 1 merged into its state, 2,560 bucket) 0.906 -> 0.113 ms, quality1 1.44 -> 0.11, but with
# questions SLOWER: RACE 0.75 -> 0.85 ms, MultiRC 1.40 -> 1.48, sweep 64 9.69 -> 10.75 (the row loop around the token
# loop costs the straight path ~10 %). Instead buckets below the largest hold tokens / 16 branch rows
# (graphs/buckets.py TOKENS_PER_BRANCH), a quarter of the spare programs.
# Stored sub-trunk states (`branches(sub_slot=)`): a leaf polls its sub-trunk's flag at most this many times (~0.5-1 us
# each, an L2 atomic) before it re-runs the sub-trunk itself. Programs are dispatched in grid order, so the sub-trunk's
# program (an earlier row) is running or done and the flag comes within its tokens' steps (~0.5 us each); the bound
# only keeps an order no GPU has shown from hanging the launch (then each leaf loses ~10 ms, its answer unchanged).
MAX_SPINS = 1 << 14
# Registers a thread of the recurrent form may use, per value-tile width (None: ptxas's choice), as `maxnreg`. At 16
# columns the state is 64 registers a thread; compiled as launched (16-aligned pointers, Triton 3.9, sm_90, cuobjdump)
# ptxas took 143 (plain) / 152 (nested) / 156 (stored sub-states): 12 one-warp programs an SM; capped at 168 it took
# 136-140 without spills: 14. H200 replay A/B (session 27, same call, stored sub-states with / without the cap): the
# question kernel 3-12 % faster (QuALITY 3.24 -> 3.00 ms, MultiRC 1.20 -> 1.16, RACE 0.75 -> 0.72). At 32 columns
# (4B / 9B) ptxas takes 228-240; 168 would spill there, 200 compiles without spills but is not measured yet. On the
# H200's Triton 3.6 (`benchmarks/ops/kernel_resources.py --questions 200`, session 28): 16 columns 137-142 capped
# (128 / 128 / 166 uncapped), 32 columns 238-255 without spills, and 200 spills 12-52 bytes there.
MAX_REGISTERS = {16: 168}
# Rows a sub-trunk's program reads per step when it counts its leaves (`_leaves_of`)
LEAF_SCAN = tl.constexpr(256)

# The chunked form (not the default: see the module docstring): 16 tokens a chunk (the smallest tl.dot tile;
# questions are tens of tokens, so a larger chunk would mostly compute masked rows). 64 value columns a program and 4
# warps were its fastest measured tiles (H200, 2026-11-30: 0.320 ms on 2,000 + 64 x 40, 0.041 on RACE; 32 columns
# took 0.52-0.91). CHUNK must be a power of two (the inverse's doubling).
CHUNK = 16
CHUNK_BLOCK_V = 64
CHUNK_NUM_WARPS = 4
FORMS = ("chunk", "recurrent")


@triton.jit
def rows_used(len_ptr, N):
    """One past the last of the N rows whose length is > 0 (0 if none): one vector load of the lengths per 128 rows
    (a bucket's capacity is mostly spare rows at the end)."""
    last = 0
    for r0 in range(0, N, 128):
        o_r = r0 + tl.arange(0, 128)
        lens = tl.load(len_ptr + o_r, mask=o_r < N, other=0)
        last = tl.maximum(last, tl.max(tl.where(lens > 0, o_r + 1, 0)))
    return last


@triton.jit
def _initial_state(h0_ptr, index_ptr, i_n, i_h, o_k, o_v, k_ok, v_ok, HV: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Branch i_n's starting state, its [BK, BV] slice of value head i_h in fp32: `h0[index[i_n]]`, or zero for
    index -1 (both forms read the states so)."""
    idx = tl.load(index_ptr + i_n).to(tl.int64)
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if idx >= 0:
        p_h0 = h0_ptr + (idx * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        h += tl.load(p_h0, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    return h


@triton.jit
def _branch_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, start_ptr, len_ptr, index_ptr, scale,
                   ht_ptr, snap_at_ptr, hs_ptr, sub_lo_ptr, sub_hi_ptr, sub_slot_ptr, subs_ptr, flags_ptr, max_spins,
                   reruns_ptr, N, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, STORE_FINAL: tl.constexpr,
                   SNAPSHOT: tl.constexpr, ROW_PROGRAMS: tl.constexpr, NESTED: tl.constexpr,
                   SUB_STATES: tl.constexpr, COUNT_RERUNS: tl.constexpr):
    i_v = tl.program_id(0)
    if ROW_PROGRAMS == 0:  # a program per (row, value head, V tile): a row of length 0 returns at once
        _branch_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, start_ptr, len_ptr, index_ptr, scale, ht_ptr,
                    snap_at_ptr, hs_ptr, sub_lo_ptr, sub_hi_ptr, sub_slot_ptr, subs_ptr, flags_ptr, max_spins,
                    reruns_ptr, N, tl.program_id(1) // HV, tl.program_id(1) % HV, i_v, HK, HV, K, V, BK, BV, L2NORM,
                    STORE_FINAL, SNAPSHOT, NESTED, SUB_STATES, COUNT_RERUNS)
    else:  # ROW_PROGRAMS programs per (value head, V tile), each over its own block of consecutive rows
        last = N
        if not STORE_FINAL and not SNAPSHOT:
            # up to the last row with tokens (trailing rows of length 0 write nothing then), so a launch whose rows
            # are all empty (a split nested call's table in a round without nested forks) ends at once instead of
            # loading every spare row's length in turn
            last = rows_used(len_ptr, N)
        # Blocks of consecutive rows, not rows in turns (i, i + P, ...): a leaf waits for its sub-trunk's flag, and
        # its sub-trunk is an earlier row, so with blocks it lies in the leaf's own program or in one earlier in the
        # grid, which the GPU dispatched first: no wait is on a program not yet running. In turns, a program's
        # later row could wait on a row of a program that was not yet dispatched because the resident ones were
        # all waiting: each such leaf then spun out MAX_SPINS polls and re-ran its sub-trunk (H100, session 42,
        # 6 MultiRC requests in one round: this launch 247.5 ms vs 9.4 with a program a row).
        per = tl.cdiv(last, ROW_PROGRAMS)
        first = tl.program_id(2) * per
        for i_n in range(first, tl.minimum(first + per, last)):
            _branch_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, start_ptr, len_ptr, index_ptr, scale,
                        ht_ptr, snap_at_ptr, hs_ptr, sub_lo_ptr, sub_hi_ptr, sub_slot_ptr, subs_ptr, flags_ptr,
                        max_spins, reruns_ptr, N, i_n, tl.program_id(1), i_v, HK, HV, K, V, BK, BV, L2NORM,
                        STORE_FINAL, SNAPSHOT, NESTED, SUB_STATES, COUNT_RERUNS)


@triton.jit
def _branch_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, start_ptr, len_ptr, index_ptr, scale, ht_ptr,
                snap_at_ptr, hs_ptr, sub_lo_ptr, sub_hi_ptr, sub_slot_ptr, subs_ptr, flags_ptr, max_spins, reruns_ptr,
                N, i_n, i_h, i_v, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, STORE_FINAL: tl.constexpr,
                SNAPSHOT: tl.constexpr, NESTED: tl.constexpr, SUB_STATES: tl.constexpr, COUNT_RERUNS: tl.constexpr):
    """Row i_n's question (or segment) for value head i_h, V tile i_v: the recurrent form's work for one row.
    NESTED (a nested fork's question call): a leaf first runs its sub-trunk's rows, [sub_lo, sub_hi) at its first
    token, from its initial state, storing no outputs (`_sub_trunk`); without it that code is not compiled in.
    SUB_STATES (with NESTED; `branches(sub_slot=)`): a sub-trunk with a slot (`sub_slot[i_n] >= 0`) stores its state
    after its tokens to `subs[slot]` and then adds its number of waiting leaves to its flag (release); a leaf with a
    slot waits until that flag is positive (acquire) and starts from `subs[slot]` instead of re-running the
    sub-trunk, then takes one off the flag, so every flag is back at zero when the launch ends. A leaf that waited
    `max_spins` polls in vain re-runs its sub-trunk (the same bits), so no order of the programs can hang the
    launch; in practice the GPU dispatches programs in grid order and a sub-trunk's row comes before its leaves'.
    COUNT_RERUNS: each leaf that gave up adds 1 to `reruns` (`branches(reruns=)`)."""
    i_hk = i_h // (HV // HK)  # grouped value heads: value head h reads key head h // (HV // HK)
    n = tl.load(len_ptr + i_n)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    k_ok = o_k < K
    v_ok = o_v < V
    # this program's [BK, BV] slice of segment i_n's state in the [N, HV, K, V] final / snapshot outputs
    state_at = (i_n * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    if SNAPSHOT:  # the state after the segment's first snap_at tokens (0: its initial state) goes to hs
        snap_at = tl.load(snap_at_ptr + i_n)
    else:
        snap_at = -1
    if STORE_FINAL or SNAPSHOT:
        if (n == 0) | (snap_at == 0):  # a state stored before any token: the initial state
            h = _initial_state(h0_ptr, index_ptr, i_n, i_h, o_k, o_v, k_ok, v_ok, HV, K, V, BK, BV)
            if STORE_FINAL:
                if n == 0:  # an empty segment's final state is its initial state
                    tl.store(ht_ptr + state_at, h, mask=state_ok)
            if SNAPSHOT:
                if snap_at == 0:
                    tl.store(hs_ptr + state_at, h, mask=state_ok)
    if n > 0:
        bos = tl.load(start_ptr + i_n).to(tl.int64)
        if SUB_STATES:
            slot = tl.load(sub_slot_ptr + i_n)
            stored = tl.full([], 0, tl.int32)
            if _stored_leaf(start_ptr, sub_lo_ptr, sub_hi_ptr, i_n, n, slot):
                flag = _sub_flag(flags_ptr, slot, i_h, i_v, HV, V)
                stored = _wait_for_flag(flag, max_spins)
                tl.atomic_add(flag, -1, sem="relaxed")  # the state in `subs` stays until the launch ends
                if COUNT_RERUNS:  # tests: a leaf that gave up waited on a program that had not run
                    if stored == 0:
                        tl.atomic_add(reruns_ptr, 1, sem="relaxed")
            if stored > 0:  # L2 only (.cg): the sub-trunk's program wrote it from another SM
                h = tl.load(_sub_state(subs_ptr, slot, i_h, o_k, o_v, HV, K, V), mask=state_ok, other=0.0,
                            cache_modifier=".cg")
            else:
                h = _initial_state(h0_ptr, index_ptr, i_n, i_h, o_k, o_v, k_ok, v_ok, HV, K, V, BK, BV)
                h = _sub_trunk(h, k_ptr, v_ptr, g_ptr, beta_ptr, sub_lo_ptr, sub_hi_ptr, bos, i_h, i_hk, o_k, o_v,
                               k_ok, v_ok, HK, HV, K, V, L2NORM)
        else:
            h = _initial_state(h0_ptr, index_ptr, i_n, i_h, o_k, o_v, k_ok, v_ok, HV, K, V, BK, BV)
            if NESTED:
                h = _sub_trunk(h, k_ptr, v_ptr, g_ptr, beta_ptr, sub_lo_ptr, sub_hi_ptr, bos, i_h, i_hk, o_k, o_v,
                               k_ok, v_ok, HK, HV, K, V, L2NORM)
        # Each step's loads are issued one step ahead (software prefetch): the chain from one token's state to the
        # next is only the decay, one sum over K and the rank-1 update, and the H200 showed ~2 us a step when each
        # step also waited for its own q/k/v loads. Same arithmetic, same bits.
        nq = tl.load(q_ptr + (bos * HK + i_hk) * K + o_k, mask=k_ok, other=0.0)
        nk = tl.load(k_ptr + (bos * HK + i_hk) * K + o_k, mask=k_ok, other=0.0)
        nv = tl.load(v_ptr + (bos * HV + i_h) * V + o_v, mask=v_ok, other=0.0)
        ng = tl.load(g_ptr + bos * HV + i_h)
        nbeta = tl.load(beta_ptr + bos * HV + i_h)
        for t in range(bos, bos + n):
            b_q, b_k, b_v = nq.to(tl.float32), nk.to(tl.float32), nv.to(tl.float32)
            b_g, b_beta = ng.to(tl.float32), nbeta.to(tl.float32)
            ahead = tl.minimum(t + 1, bos + n - 1)  # the last step reloads its own token: in bounds, unused
            nq = tl.load(q_ptr + (ahead * HK + i_hk) * K + o_k, mask=k_ok, other=0.0)
            nk = tl.load(k_ptr + (ahead * HK + i_hk) * K + o_k, mask=k_ok, other=0.0)
            nv = tl.load(v_ptr + (ahead * HV + i_h) * V + o_v, mask=v_ok, other=0.0)
            ng = tl.load(g_ptr + ahead * HV + i_h)
            nbeta = tl.load(beta_ptr + ahead * HV + i_h)
            if L2NORM:
                # the state call's formula (l2norm.py, as fla's): x * (1 / sqrt(sum(x^2) + 1e-6)) in fp32, rounded
                # to the input dtype (a no-op for fp32), so states and questions see keys normalised alike
                b_q = (b_q * (1 / tl.sqrt(tl.sum(b_q * b_q) + 1e-6))).to(q_ptr.dtype.element_ty).to(tl.float32)
                b_k = (b_k * (1 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6))).to(k_ptr.dtype.element_ty).to(tl.float32)
            h *= tl.exp(b_g)
            b_v = (b_v - tl.sum(h * b_k[:, None], 0)) * b_beta
            h += b_k[:, None] * b_v[None, :]
            b_o = tl.sum(h * (b_q * scale)[:, None], 0)
            tl.store(o_ptr + (t * HV + i_h) * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=v_ok)
            if SNAPSHOT:
                if t == bos + snap_at - 1:  # a checkpoint inside the segment: the same h the next token starts from
                    tl.store(hs_ptr + state_at, h, mask=state_ok)
        if STORE_FINAL:  # the state after the segment's last token (checkpoint rounds: a state's rest, ops/resume.py)
            tl.store(ht_ptr + state_at, h, mask=state_ok)
        if SUB_STATES:
            # (the slot read again here, volatile, so that nothing of the store's addresses is built before the
            # token loop and held through it)
            slot = tl.load(sub_slot_ptr + i_n, volatile=True)
            if (slot >= 0) & (_stored_leaf(start_ptr, sub_lo_ptr, sub_hi_ptr, i_n, n, slot) == 0):
                # a sub-trunk some leaf starts from: its state, then (after every thread's store) its leaves' count
                # on its flag
                tl.store(_sub_state(subs_ptr, slot, i_h, o_k, o_v, HV, K, V), h, mask=state_ok)
                waiting = _leaves_of(start_ptr, len_ptr, sub_lo_ptr, sub_hi_ptr, sub_slot_ptr, slot, N)
                tl.debug_barrier()
                tl.atomic_add(_sub_flag(flags_ptr, slot, i_h, i_v, HV, V), waiting, sem="release")

@triton.jit
def _sub_flag(flags_ptr, slot, i_h, i_v, HV: tl.constexpr, V: tl.constexpr):
    """The flag of slot `slot`'s value head i_h, V tile i_v: one per (slot, head, tile), so a leaf's program waits
    only for its own slice of the state (`new_sub_flags` holds one per value column, enough for any tile)."""
    return flags_ptr + (slot.to(tl.int64) * HV + i_h) * V + i_v


@triton.jit
def _sub_state(subs_ptr, slot, i_h, o_k, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """The [BK, BV] addresses of slot `slot`'s stored state, value head i_h, in `subs` [slots, HV, K, V] fp32 (the
    base first, then the tile's offsets: built as one expression, an unspecialised sm_90 compile kept the 64 addresses
    a thread live through the token loop)."""
    return subs_ptr + slot.to(tl.int64) * HV * K * V + i_h * K * V + o_k[:, None] * V + o_v[None, :]


@triton.jit
def _stored_leaf(start_ptr, sub_lo_ptr, sub_hi_ptr, i_n, n, slot):
    """Whether row i_n (length n, slot `slot`) is a leaf whose sub-trunk has a slot: a row with a slot and tokens
    whose first token has a non-empty sub-trunk range (a sub-trunk's own range is empty). The start and the range are
    read only then: an empty row's start may lie anywhere, a row past N has none. Scalars or vectors of rows."""
    leaf = (n > 0) & (slot >= 0)
    bos = tl.load(start_ptr + i_n, mask=leaf, other=0)
    a = tl.load(sub_lo_ptr + bos, mask=leaf, other=0)
    b = tl.load(sub_hi_ptr + bos, mask=leaf, other=0)
    return leaf & (b > a)


@triton.jit
def _leaves_of(start_ptr, len_ptr, sub_lo_ptr, sub_hi_ptr, sub_slot_ptr, slot, N):
    """How many of the N rows are leaves with slot `slot` (`_stored_leaf`, the predicate each leaf's program takes
    one off the flag by): what the sub-trunk adds, so that the flag ends the launch at zero."""
    count = tl.full([], 0, tl.int32)
    for first in range(0, N, LEAF_SCAN):
        rows = first + tl.arange(0, LEAF_SCAN)
        ok = rows < N
        slots = tl.load(sub_slot_ptr + rows, mask=ok, other=-1)
        n = tl.load(len_ptr + rows, mask=ok, other=0)
        count += tl.sum((_stored_leaf(start_ptr, sub_lo_ptr, sub_hi_ptr, rows, n, slots) & (slots == slot))
                        .to(tl.int32))
    return count


@triton.jit
def _wait_for_flag(flag, max_spins):
    """1 once the flag is positive (its sub-trunk's state stored: acquire), 0 after max_spins polls without."""
    seen = tl.atomic_add(flag, 0, sem="acquire")
    spins = 0
    while (seen <= 0) & (spins < max_spins):
        seen = tl.atomic_add(flag, 0, sem="acquire")
        spins += 1
    return (seen > 0).to(tl.int32)


@triton.jit
def _sub_trunk(h, k_ptr, v_ptr, g_ptr, beta_ptr, sub_lo_ptr, sub_hi_ptr, bos, i_h, i_hk, o_k, o_v, k_ok, v_ok,
               HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L2NORM: tl.constexpr):
    """The state h after a leaf's sub-trunk rows [a, b) (the int32 range at the leaf's first token, bos; b <= a:
    none, h as it came): the token steps of `_branch_row`'s loop on the same operands in the same order (in the
    interpreter, the bits of the plain call over sub-trunk + leaf as one segment), without q or the output (the
    sub-trunk's rows are its own segment's to write). A loop of its own with its own one-step-ahead loads, so the
    question loop after it, prefetch included, is the plain kernel's."""
    a = tl.load(sub_lo_ptr + bos).to(tl.int64)
    b = tl.load(sub_hi_ptr + bos).to(tl.int64)
    if b > a:  # only then are rows a.. in the stream (an empty range may hold anything)
        nk = tl.load(k_ptr + (a * HK + i_hk) * K + o_k, mask=k_ok, other=0.0)
        nv = tl.load(v_ptr + (a * HV + i_h) * V + o_v, mask=v_ok, other=0.0)
        ng = tl.load(g_ptr + a * HV + i_h)
        nbeta = tl.load(beta_ptr + a * HV + i_h)
        for t in range(a, b):
            b_k, b_v = nk.to(tl.float32), nv.to(tl.float32)
            b_g, b_beta = ng.to(tl.float32), nbeta.to(tl.float32)
            ahead = tl.minimum(t + 1, b - 1)  # the last step reloads its own row: in bounds, unused
            nk = tl.load(k_ptr + (ahead * HK + i_hk) * K + o_k, mask=k_ok, other=0.0)
            nv = tl.load(v_ptr + (ahead * HV + i_h) * V + o_v, mask=v_ok, other=0.0)
            ng = tl.load(g_ptr + ahead * HV + i_h)
            nbeta = tl.load(beta_ptr + ahead * HV + i_h)
            if L2NORM:  # as `_branch_row` normalises k
                b_k = (b_k * (1 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6))).to(k_ptr.dtype.element_ty).to(tl.float32)
            h *= tl.exp(b_g)
            b_v = (b_v - tl.sum(h * b_k[:, None], 0)) * b_beta
            h += b_k[:, None] * b_v[None, :]
    return h


@triton.jit
def _branch_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, start_ptr, len_ptr, index_ptr, scale,
                         HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, BC: tl.constexpr, LOG2_BC: tl.constexpr, L2NORM: tl.constexpr,
                         PRECISION: tl.constexpr):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_hk = i_h // (HV // HK)
    n = tl.load(len_ptr + i_n)
    if n > 0:
        bos = tl.load(start_ptr + i_n).to(tl.int64)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        o_c = tl.arange(0, BC)
        k_ok = o_k < K
        v_ok = o_v < V
        causal = o_c[:, None] >= o_c[None, :]  # token i sees tokens j <= i of its chunk
        eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
        # S: the state's [K, BV] slice
        h = _initial_state(h0_ptr, index_ptr, i_n, i_h, o_k, o_v, k_ok, v_ok, HV, K, V, BK, BV)
        for c0 in range(0, n, BC):
            t = bos + c0 + o_c
            t_ok = (c0 + o_c) < n  # rows past the question: zero q, k, v, g, beta change nothing
            p_qk = (t[:, None] * HK + i_hk) * K + o_k[None, :]
            m_qk = t_ok[:, None] & k_ok[None, :]
            b_q = tl.load(q_ptr + p_qk, mask=m_qk, other=0.0).to(tl.float32)
            b_k = tl.load(k_ptr + p_qk, mask=m_qk, other=0.0).to(tl.float32)
            m_v = t_ok[:, None] & v_ok[None, :]
            b_v = tl.load(v_ptr + (t[:, None] * HV + i_h) * V + o_v[None, :], mask=m_v, other=0.0).to(tl.float32)
            b_g = tl.load(g_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
            b_beta = tl.load(beta_ptr + t * HV + i_h, mask=t_ok, other=0.0).to(tl.float32)
            if L2NORM:  # the recurrent form's formula, row by row (see _branch_kernel)
                b_q = (b_q * (1 / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6))[:, None]).to(q_ptr.dtype.element_ty)
                b_q = b_q.to(tl.float32)
                b_k = (b_k * (1 / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6))[:, None]).to(k_ptr.dtype.element_ty)
                b_k = b_k.to(tl.float32)
            # gamma_i: the chunk's log decay up to and including token i; decay_ij = exp(gamma_i - gamma_j), j <= i
            gamma = tl.cumsum(b_g, 0)
            gamma_last = tl.sum(tl.where(o_c == BC - 1, gamma, 0.0), 0)
            decay = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
            # Everything that does not need the state first (off the chunk-to-chunk chain). Token i's update is
            # u_i = beta_i (v_i - S_{i-1}^T k_i), S_{i-1} = the decayed S plus the chunk's earlier updates, so
            # (I + A) U = beta V - beta e^gamma K S with A_ij = beta_i decay_ij (k_i . k_j), j < i (nilpotent).
            # Its inverse is the finite series sum_m (-A)^m = (I - A)(I + A^2)(I + A^4)...: LOG2_BC products of
            # [BC, BC] tiles on tensor cores, where forward substitution would be BC dependent steps.
            # The series' terms grow before they cancel (keys alike and beta near 1: entries of A^m up to
            # C(BC - 2, m - 1)), so its products stay in full fp32 whatever PRECISION (BC^3 multiply-adds: cheap).
            nil = -tl.where(o_c[:, None] > o_c[None, :], tl.dot(b_k, tl.trans(b_k), input_precision="ieee")
                            * decay, 0.0) * b_beta[:, None]
            inv = eye + nil
            power = nil
            for _ in tl.static_range(LOG2_BC - 1):
                power = tl.dot(power, power, input_precision="ieee")
                inv = tl.dot(inv, eye + power, input_precision="ieee")
            # one Newton step, X <- X + X (I - (I + A) X), squares the series' rounding error away (its residual
            # was ~1e-4 with 16 alike keys; fp32 forward substitution keeps ~1e-7)
            residual = eye - tl.dot(eye - nil, inv, input_precision="ieee")
            inv += tl.dot(inv, residual, input_precision="ieee")
            eg = tl.exp(gamma)
            w = tl.dot(inv, b_k * (b_beta * eg)[:, None], input_precision=PRECISION)  # U = U0 - W S
            u0 = tl.dot(inv, b_v * b_beta[:, None], input_precision=PRECISION)
            qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * decay
            k_decayed = b_k * tl.exp(gamma_last - gamma)[:, None]
            # the chain: U from S, the outputs o_i = e^gamma_i S^T q_i + sum_{j <= i} decay_ij (q_i . k_j) u_j, and
            # the state after the chunk, S' = e^gamma_last S + sum_j e^(gamma_last - gamma_j) k_j u_j^T
            u = u0 - tl.dot(w, h, input_precision=PRECISION)
            b_o = eg[:, None] * tl.dot(b_q, h, input_precision=PRECISION) + tl.dot(qk, u, input_precision=PRECISION)
            p_o = o_ptr + (t[:, None] * HV + i_h) * V + o_v[None, :]
            tl.store(p_o, (b_o * scale).to(o_ptr.dtype.element_ty), mask=m_v)
            h = h * tl.exp(gamma_last) + tl.dot(tl.trans(k_decayed), u, input_precision=PRECISION)


def branches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor, initial_index: torch.Tensor,
             scale: float, use_qk_l2norm: bool, out: torch.Tensor | None = None,
             form: str = "recurrent", tiles: tuple[int, ...] | None = None,
             final: torch.Tensor | None = None,
             snapshot: tuple[torch.Tensor, torch.Tensor] | None = None,
             sub: tuple[torch.Tensor, torch.Tensor] | None = None,
             sub_slot: torch.Tensor | None = None, sub_flags: torch.Tensor | None = None,
             max_spins: int | None = None, row_programs: int | None = None,
             reruns: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hv, V] (q's dtype) of every segment, each from `initial_state[initial_index[n]]` (-1: zero). Rows
    outside the segments are left unwritten, as fla's variant leaves them (`gated_delta.combine` selects).

    q, k: [T, Hk, K]; v: [T, Hv, V]; g, beta: [T, Hv]; seg_start/seg_len/initial_index: [N] int64;
    initial_state: [M, Hv, K, V] float32 (M may be 0 when every index is -1). `out`: where to write (tests poison
    it to see that every segment row is written). `form`: `chunk` or `recurrent` (see the module docstring).
    `tiles`: (value columns per program, warps) instead of the form's defaults (the op benchmark's sweep); the chunk
    form takes a third, its chunk size (a power of two >= 16; default CHUNK). A tile choice may change the bits (the
    sums over K follow the program's layout): batch invariance holds for one fixed choice, as the defaults are.
    `final`: a [N, Hv, K, V] float32 tensor that receives each segment's state after its last token (its initial
    state for an empty one); the recurrent form only.
    `snapshot`: (snap_at [N] int64, states [N, Hv, K, V] float32): each segment's state after its first snap_at[n]
    tokens (0: its initial state; at most its length) goes to states[n] (a checkpoint inside a segment, in the same
    pass); the recurrent form only.
    `sub`: (sub_lo, sub_hi) [T] int32, a nested fork's question call (`reference.gated_delta`'s semantics): a segment
    whose first token has a non-empty range [a, b) first runs rows a..b-1 from its initial state, writing none of
    their outputs, then its own rows (`final`: the state after its own rows); the recurrent form only, not with
    `snapshot` (checkpoint rounds have no nested forks).
    `sub_slot` (with `sub`): [N] int32, each row's slot in a buffer of SUB_STATE_SLOTS states (`sub_slots`: a
    sub-trunk that leaves start from, those leaves, -1 elsewhere). In the same launch, each sub-trunk with a slot
    stores its state after its tokens and each of its leaves starts from it instead of re-running its rows (the same
    steps in the same order: the same function; rows without a slot, leaves included, run as without `sub_slot`).
    `sub_flags`: the int32 flags the leaves wait on (`new_sub_flags`: zero, and zero again after every call, so a
    layer keeps one for all its calls); None: a zeroed one for this call. `max_spins`: how many times a leaf polls
    its flag before it re-runs its sub-trunk instead (default MAX_SPINS; tests make it small). `row_programs`: the
    recurrent form's programs along the rows where `tiles` does not give them (default ROW_PROGRAMS; 0: one a row).
    With row programs each program takes a block of consecutive rows: a leaf waits only on a sub-trunk row before it
    (a request's sub-trunks come before its leaves, `round.RequestLayout`), so in its own program (done already) or
    in one earlier in the grid, which the GPU dispatched before it (the order a program a row relies on too).
    `reruns` (with `sub_slot`): an int32 [1] tensor to which each leaf (and value tile) that gave up waiting adds 1:
    Triton's interpreter runs the programs one by one in grid order, so there a leaf that waited on a program after
    its own gives up every time (the tests' check of the row-to-program order); None: not counted (compiled out)."""
    if form not in FORMS:
        raise ValueError(f"`form` must be one of {FORMS}, got {form!r}")
    if sub is not None:
        if form != "recurrent" or snapshot is not None:
            raise ValueError(f"`sub` (a nested fork's sub-trunk ranges) needs the recurrent form and no `snapshot`, "
                             f"got {form} form{', a snapshot' if snapshot is not None else ''}")
        if any(t.dtype != torch.int32 or t.shape != q.shape[:1] for t in sub):
            raise ValueError(f"`sub` needs two int32 [T] tensors (T = {q.shape[0]}), got "
                             f"{[(t.dtype, tuple(t.shape)) for t in sub]}")
    if sub_slot is not None and (sub is None or sub_slot.dtype != torch.int32 or sub_slot.shape != seg_start.shape):
        raise ValueError(f"`sub_slot` needs `sub` and an int32 [N] tensor (N = {seg_start.shape[0]}), got "
                         f"{'no sub, ' if sub is None else ''}{sub_slot.dtype} {tuple(sub_slot.shape)}")
    if sub_flags is not None and (sub_flags.dtype != torch.int32 or not sub_flags.is_contiguous()
                                  or sub_flags.numel() < SUB_STATE_SLOTS * v.shape[1] * v.shape[2]):
        raise ValueError(f"`sub_flags` needs a contiguous int32 tensor of {SUB_STATE_SLOTS} x Hv x V elements "
                         f"(`new_sub_flags`), got {sub_flags.dtype} {tuple(sub_flags.shape)}")
    if reruns is not None and (sub_slot is None or reruns.dtype != torch.int32 or reruns.numel() != 1):
        raise ValueError(f"`reruns` needs `sub_slot` and an int32 tensor of one element, got "
                         f"{'no sub_slot, ' if sub_slot is None else ''}{reruns.dtype} {tuple(reruns.shape)}")
    max_spins = MAX_SPINS if max_spins is None else max_spins
    state_shape = (seg_start.shape[0], v.shape[1], k.shape[2], v.shape[2])

    def state_output_ok(t: torch.Tensor) -> bool:  # where `final` / `snapshot` states go
        return (form == "recurrent" and t.dtype == torch.float32 and t.is_contiguous()
                and tuple(t.shape) == state_shape)

    if final is not None and not state_output_ok(final):
        raise ValueError(f"`final` needs the recurrent form and a contiguous float32 [N, Hv, K, V] tensor, got "
                         f"{form} form, {final.dtype} {tuple(final.shape)}")
    if snapshot is not None:
        snap_at, states = snapshot
        if not state_output_ok(states) or snap_at.shape != seg_start.shape or snap_at.dtype != torch.int64:
            raise ValueError(f"`snapshot` needs the recurrent form, snap_at int64 [N] and a contiguous float32 "
                             f"[N, Hv, K, V] tensor, got {form} form, {snap_at.dtype} {tuple(snap_at.shape)}, "
                             f"{states.dtype} {tuple(states.shape)}")
    T, HK, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device) if out is None else out
    if initial_state.shape[0] == 0:  # no state to read: a dummy pointer that no program loads (every index is -1)
        initial_state = torch.zeros(1, HV, K, V, dtype=torch.float32, device=q.device)
    h0 = initial_state.float().contiguous()
    N = seg_start.shape[0]
    if N == 0:
        return o
    meta = (q, k, v, g, beta, o, h0, seg_start.contiguous(), seg_len.contiguous(), initial_index.contiguous(),
            float(scale))
    BK = max(16, triton.next_power_of_2(K))  # tl.dot needs 16 at least
    if tiles is not None and len(tiles) not in (2, 3):
        raise ValueError(f"`tiles` of the {form} form: (value columns, warps"
                         f"{'[, chunk]' if form == 'chunk' else '[, row programs]'}), got {tiles!r}")
    if form == "chunk":
        BV, warps, chunk = (*tiles, CHUNK)[:3] if tiles else (min(CHUNK_BLOCK_V, max(16, triton.next_power_of_2(V))),
                                                             CHUNK_NUM_WARPS, CHUNK)
        if chunk < 16 or chunk & (chunk - 1):
            raise ValueError(f"the chunk form's chunk must be a power of two >= 16 (tl.dot's smallest tile), got {chunk}")
        # fp32 models keep fp32 products (ieee: tf32 would cost them their 1e-5); half-precision ones take tf32
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        _branch_chunk_kernel[(triton.cdiv(V, BV), N * HV)](*meta, HK=HK, HV=HV, K=K, V=V, BK=BK, BV=BV, BC=chunk,
                                                            LOG2_BC=chunk.bit_length() - 1, L2NORM=use_qk_l2norm,
                                                            PRECISION=precision, num_warps=warps)
    else:
        block_v = BLOCK_V_MANY_HEADS if HV >= 32 else BLOCK_V
        default_rows = ROW_PROGRAMS if row_programs is None else row_programs
        BV, warps, row_programs = (*tiles, default_rows)[:3] if tiles else (min(block_v, triton.next_power_of_2(V)),
                                                                           NUM_WARPS, default_rows)
        if row_programs < 0:
            raise ValueError(f"the recurrent form's row programs must be >= 0 (0: one per row), got {row_programs}")
        row_programs = min(row_programs, N)
        grid = (triton.cdiv(V, BV), N * HV) if row_programs == 0 else (triton.cdiv(V, BV), HV, row_programs)
        snap_at, states = snapshot if snapshot is not None else (seg_start, h0)  # unread without SNAPSHOT
        sub_lo, sub_hi = sub if sub is not None else (seg_start, seg_start)  # unread without NESTED
        # the sub-trunks' stored states: a transient of this call, unread without slots. A sub-trunk takes a slot
        # only with a leaf, another row, so a call of N rows uses at most N // 2 slots (a small bucket's buffer is
        # small)
        subs = h0 if sub_slot is None else torch.empty(max(1, min(SUB_STATE_SLOTS, N // 2)), HV, K, V,
                                                      dtype=torch.float32, device=q.device)
        if sub_slot is not None and sub_flags is None:  # a caller without a kept buffer: a zeroed one for this call
            sub_flags = new_sub_flags(HV, V, q.device)
        _branch_kernel[grid](*meta, final if final is not None else h0, snap_at.contiguous(), states,
                             sub_lo.contiguous(), sub_hi.contiguous(),
                             (sub_slot if sub_slot is not None else sub_lo).contiguous(), subs,
                             sub_flags if sub_slot is not None else sub_lo, max_spins,
                             reruns if reruns is not None else sub_lo, N, HK=HK, HV=HV, K=K, V=V,
                             BK=BK, BV=BV, L2NORM=use_qk_l2norm, STORE_FINAL=final is not None,
                             SNAPSHOT=snapshot is not None, ROW_PROGRAMS=row_programs, NESTED=sub is not None,
                             SUB_STATES=sub_slot is not None, COUNT_RERUNS=reruns is not None, num_warps=warps,
                             num_stages=NUM_STAGES,
                             **({"maxnreg": MAX_REGISTERS[BV]} if MAX_REGISTERS.get(BV) else {}))
    return o


def segments_with_final(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                        initial_index: torch.Tensor, scale: float,
                        use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, Hv, V], final [N, Hv, K, V] float32) of short segments from their initial states, as the gated delta
    variants return them, in one launch of the recurrent kernel. For a checkpoint round's state rests (the ~64-128
    tokens after a snapshot, ops/resume.py): fla's chunked call costs ~8 launches and its Python wrappers for them,
    in an eager round where the host is the bottleneck."""
    final = _states_like(q, k, v, seg_start)
    return branches(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, use_qk_l2norm,
                    final=final), final


def segments_with_snapshot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                           initial_index: torch.Tensor, snap_at: torch.Tensor, scale: float,
                           use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [T, Hv, V], final [N, ...], snapshot [N, ...] float32) of segments from their initial states, each
    snapshotted after its first snap_at[n] tokens, in one launch of the recurrent kernel. For a checkpoint round's
    short states (a resumed agent step's new tokens, ops/resume.py): the part before the checkpoint and the rest after
    it in one pass, the same token steps as two launches would take (the state is kept in fp32 either way)."""
    final, states = _states_like(q, k, v, seg_start), _states_like(q, k, v, seg_start)
    o = branches(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, use_qk_l2norm,
                 final=final, snapshot=(snap_at, states))
    return o, final, states


def _states_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_start: torch.Tensor) -> torch.Tensor:
    """An uninitialised float32 [N, Hv, K, V] tensor: one recurrent state per segment (the kernel writes them all)."""
    return torch.empty(seg_start.shape[0], v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32, device=q.device)
