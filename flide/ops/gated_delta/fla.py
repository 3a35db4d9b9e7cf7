"""The gated delta rule on the GPU through fla-core's chunked kernels, fed fixed-capacity chunk lists.

Contract beyond the reference's: the call's non-empty segments are contiguous and in stream order, and unused rows
(length 0) come last. The round layout guarantees it (all states, then all questions), so cu_seqlens is a cumsum of
the lengths, built on the GPU. The chunk list has a fixed capacity (T/64 + N + 1 rows), so every kernel's grid
depends on the capacities alone. Its rows past the real chunks must name a real, empty sequence: fla's gated delta
kernels read `cu_seqlens[i_n]` without checking fla's own sentinel (i_n = -1, which only its KDA kernels test), so a
sentinel row would read one element before cu_seqlens and launch on garbage bounds (the illegal memory accesses
seen on the H200). We append one zero-length sequence at the end of the call and point the spare rows at it; every
kernel returns at once there (`i_t * BT >= T`). Rows outside the call's span are left unwritten (they may hold
anything, NaN included): unlike the reference, this op's output is defined only inside its segments, and
`gated_delta.fork` selects each row from the call that covers it and zeroes the padding (a NaN in a pad row would
leak through 0-probability attention products).
"""

from __future__ import annotations

import functools
import os

import torch

from ...config import GDN_CHUNK
from ..resume import PerRound


@functools.lru_cache(maxsize=1)
def _fla():
    # fla caches derived index tensors (chunk offsets) by tensor identity: reused or static buffers then get stale
    # offsets and its kernels read out of bounds (seen on the H200: an illegal memory access once transformers had
    # imported fla first). fla reads the switch from `fla.utils` at every call, so set it there, whoever imported
    # fla first; the environment variable only counts at fla's import.
    os.environ.setdefault("FLA_DISABLE_TENSOR_CACHE", "1")
    import fla.utils
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    return chunk_gated_delta_rule


@functools.lru_cache(maxsize=1)
def _fla_steps():
    """The four forward steps of fla's chunk_gated_delta_rule (fla-core 0.6.0's `chunk_gated_delta_rule_fwd`, less
    its context-parallel and in-kernel-gate branches), called one by one so that the h step takes the chunk offsets
    of the round (`fork_tables`) instead of deriving them in every layer (7 small launches each)."""
    _fla()  # its tensor-cache switch first
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    fwd_h = _fwd_h_unfilled if EMPTY_FINAL_STATE else chunk_gated_delta_rule_fwd_h
    if PIN_CONFIGS and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        _pin_configs(SM90_CONFIGS)
    return chunk_local_cumsum, chunk_gated_delta_rule_fwd_intra, fwd_h, chunk_fwd_o, RCP_LN2


# fla autotunes each of its kernels once per head shape, on whichever stream reaches it first (an engine's first
# warm-up round), and the pick varied between processes: two engines of one commit on the H200 (session 23 calls
# 1 and 2) took the kkt + solve kernel at 2 and at 1 warp, the h kernel at a config 9 % slower on QuALITY's
# 8,192 bucket, the gate cumsum at 8 warps in the second (QuALITY's state call 0.4 ms apart). Where the op bench
# measured (sm_90, bf16, per value-head count: `bench_fla_configs.py [--value-heads 32]`,
# benchmarks/results/ops_fla_configs{,_hv32}_h200.md) each kernel runs one config instead (one of its own, or one
# the bench timed outside fla's list with `--extra`): the best or tied-best on every stream measured, the same on
# every bucket (at 16 value heads the kkt + solve kernel at 1 warp on long streams: `_solve`). The pin is a pruning
# of fla's autotuners for the process, so fla's other callers get it too; fp32 inputs keep the autotuner (their
# tiles need more shared memory: the h kernel's pinned config does not fit in fp32), and so do head counts the bench
# has not measured.
# PIN_CONFIGS False: fla's autotuners as shipped (the op bench).
PIN_CONFIGS = True
_CUMSUM = ("fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel")
_KKT = ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel")
_W_U = ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel")
_H = ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64")
_O = ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o")
# value heads (of 128 key / value dims) -> (module, kernel) -> (the config's kwargs, num_warps, num_stages[, "added":
# a config outside fla's list, appended to it and used only where pinned])
SM90_CONFIGS = {
    # Qwen3.5-0.8B (session 23, ops_fla_configs_h200.md): kkt + solve at 2 warps is best only on RACE's 512 bucket
    # o at 128 value columns is not among fla's configs (`added`: appended to its list for these heads only):
    # session 28, `bench_fla_configs.py --extra`, 12-25 % under fla's best (BK64, BV64) on RACE's, sweep 1's and
    # QuALITY's buckets (6.8 / 30.1 / 113.6 vs 9.1 / 35.6 / 129.1 us)
    16: {_CUMSUM: ({}, 2, 3), _KKT: ({"BK": 64}, 2, 3), _W_U: ({}, 4, 3), _H: ({"BV": 32}, 4, 3),
         _O: ({"BK": 64, "BV": 128}, 4, 3, "added")},
    # Qwen3.5-4B / 9B (session 24, ops_fla_configs_hv32_h200.md): kkt + solve at 1 warp best on every stream (RACE's
    # bucket too: 28.0 vs 29.2 us), w / u at 2 stages (2-4 % under 3 on every stream), h at BV 64 (QuALITY-sized
    # 222 vs 320 us at BV 32); the cumsum's 1 and 2 warps tie. o at 128 columns (session 28, added): 17-24 % under
    # BK64 / BV64 (RACE 11.3 vs 14.9, sweep 1 53.2 vs 67.0, QuALITY 214 vs 258 us)
    32: {_CUMSUM: ({}, 2, 3), _KKT: ({"BK": 64}, 1, 3), _W_U: ({}, 4, 2), _H: ({"BV": 64}, 4, 3),
         _O: ({"BK": 64, "BV": 128}, 4, 3, "added")},
}


def autotuner(kernel):
    """The triton Autotuner inside an fla kernel's decorators (heuristics wrap it)."""
    while not hasattr(kernel, "configs"):
        kernel = kernel.fn
    return kernel


def _pin_configs(pins: dict) -> None:
    """`pins` ({value heads: {(module, kernel): (kwargs, warps, stages)}}): prunes each named kernel's autotune configs
    to the one pinned for the call's value heads where its inputs are 16-bit (a config no longer among the kernel's,
    after an fla upgrade, leaves those heads autotuned, logged; one flagged "added" is appended to the kernel's list
    instead, for the calls it is pinned to only); marks the tuner `flide_pinned` ({heads: config})."""
    import importlib
    import logging

    import triton

    per_kernel: dict[tuple[str, str], dict[int, tuple]] = {}
    for heads, kernels in pins.items():
        for kernel, config in kernels.items():
            per_kernel.setdefault(kernel, {})[heads] = config
    for (module, name), by_heads in per_kernel.items():
        tuner = autotuner(getattr(importlib.import_module(module), name))
        if getattr(tuner, "flide_pinned", None) is not None:
            continue
        pinned, added = {}, []
        for heads, (kwargs, warps, stages, *flags) in by_heads.items():
            found = [c for c in tuner.configs
                     if c.kwargs == kwargs and c.num_warps == warps and c.num_stages == stages]
            if not found and "added" in flags:  # ours: appended, and pruned away wherever it is not the pin
                found = [triton.Config(dict(kwargs), num_warps=warps, num_stages=stages)]
                added.append(found[0])
            if found:
                pinned[heads] = found[0]
            else:
                logging.getLogger("flide").warning("flide: fla's %s has no config %s, %d warps, %d stages: "
                                                   "autotuned at %d value heads", name, kwargs, warps, stages, heads)
        if pinned:
            tuner.configs = [*tuner.configs, *added]
            tuner.early_config_prune = _pinned_prune(pinned, tuner.early_config_prune, added)
            tuner.flide_pinned = pinned
            tuner.cache.clear()  # picks made before (fla run first by another caller) would bypass the pruning


def _pinned_prune(pinned: dict, previous, added: list = ()):
    """An autotuner's early_config_prune that keeps only `pinned[value heads]` for 16-bit keys `k` (or none: the gate
    cumsum); value heads: the call's `HV` (the cumsum's `H`). fla calls its kernels by keyword: all in `kwargs`.
    Calls without a pin autotune over fla's own configs (`added` ones removed)."""

    def prune(configs, named_args, **kwargs):
        configs = previous(configs, named_args, **kwargs) if previous is not None else configs
        named = {**named_args, **kwargs}
        config = _pinned_for(pinned, named.get("k"), named.get("HV", named.get("H")))
        return ([c for c in configs if c is config]
                or [c for c in configs if not any(c is a for a in added)] or configs)

    return prune


def _pinned_for(pinned: dict | None, k: torch.Tensor | None, value_heads: int | None):
    """The config pinned for a call (None: autotuned): where the sm_90 pins were measured, 16-bit keys `k` (or a
    kernel without keys: the gate cumsum) and a value-head count the bench measured."""
    if not pinned or (k is not None and k.element_size() != 2):
        return None
    return pinned.get(value_heads)


# fla's h step allocates the final states with `new_zeros`: [N, Hv, K, V] fp32 for every sequence of the call, i.e.
# the bucket's state capacity (1 MiB a row on Qwen3.5-0.8B; a zero fill of 0.09 ms per RACE replay, 0.8 ms at the
# 8,192 bucket on the H200), though its kernel stores every row, empty sequences included (their initial state).
# `_fwd_h_unfilled` launches the same kernel with `torch.empty` instead: the same bits as fla's own step, every row
# written (tests/gpu/test_gated_delta_gpu.py::test_unfilled_final_state_equals_fla, passed on the H200 2026-11-30).
# A pin of fla-core 0.6.0's kernel signature: set False to fall back to fla's own function after an fla upgrade.
EMPTY_FINAL_STATE = True


def _fwd_h_unfilled(k, w, u, g=None, initial_state=None, output_final_state=True, chunk_size=GDN_CHUNK,
                    cu_seqlens=None, chunk_indices=None, chunk_offsets=None):
    """fla-core 0.6.0's `chunk_gated_delta_rule_fwd_h` for our calls (varlen, keys first, final states kept), with
    the final states left unfilled (see EMPTY_FINAL_STATE)."""
    import triton
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as kernel

    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[-1]
    N, NT = cu_seqlens.shape[0] - 1, chunk_indices.shape[0]
    h = k.new_empty(B, NT, HV, K, V)
    final = k.new_empty(N, HV, K, V, dtype=torch.float32)
    v_new = torch.empty_like(u)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]) * N * HV,)

    kernel[grid](k=k, v=u, w=w, v_new=v_new, g=g, gk=None, h=h, h0=initial_state, ht=final, cu_seqlens=cu_seqlens,
                 chunk_offsets=chunk_offsets, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size, STATE_V_FIRST=False)
    return h, v_new, final


# fla's fused kkt + solve kernel (the intra step's first launch) takes one autotune pick for every stream of a head
# shape: on the H200 at 16 value heads 2 warps a program (BK 64), the best on RACE's 512-token bucket (23.5 vs
# 25.1 us a layer with 1 warp) but 17-25 % slower than 1 warp on every stream of 2,048 tokens and more, where many
# chunks fill the card (sweep 1 bucket 45 vs 60 us, 16 RACE 110 vs 126, QuALITY-sized 149 vs 180;
# `bench_fla_configs.py`, benchmarks/results/ops_fla_configs_h200.md, session 23). Streams of at least this many
# tokens launch it with 1 warp (`_solve`, where a pin above holds more warps; at 32 value heads 1 warp is the pin
# itself); both launches use the same MMA shapes and the same order of sums (bits checked equal:
# tests/gpu/test_gated_delta_gpu.py::test_kkt_warps_keep_the_bits). None: the pinned 2 warps everywhere. A pin of
# fla-core 0.6.0's kernel signature, like EMPTY_FINAL_STATE.
KKT_ONE_WARP_TOKENS: int | None = 2048


# The state call's h and o steps as one launch of our own kernel (state_chain.py: each chunk's outputs computed by the
# program that holds its state, no per-chunk states written and read back) for 16-bit inputs on CUDA, in calls of at
# most FUSED_MAX_TOKENS tokens (a bucket's stream length: static per CUDA graph). H200, Qwen3.5-0.8B (session 29,
# `ops_state_chain_h200.md`, same bits as fla's steps on every stream): faster where the states are short (RACE in its
# 512 bucket 0.0154 vs 0.0167 ms a layer; 16 RACE states 0.124 vs 0.217, 8 MultiRC requests 0.125 vs 0.249) but
# slower on a long state (2,000 tokens 0.093 vs 0.078, 7,900 tokens 0.343 vs 0.283): a chain step also waits on its
# outputs' products. Replay A/B (fused in every call): RACE GPU 3.09 -> 2.98 ms, MultiRC 4.25 -> 3.99, but QuALITY
# 29.72 -> 30.36, sweep 1 8.28 -> 8.64 (`h200_profile_0_8b_session29_{fused_chain,fla_h_o}.json`). A bucket can hold
# a state as long as itself, so only small buckets run it. Tried (6b12ff6, reverted): long states in the same kernel
# storing their states (as fla's h) and a second launch for their outputs, one binary with both paths: both paths
# slowed (RACE 1.11x fla, 2,000 tokens 1.51x; `ops_state_chain_split_h200.md`).
# Calls with initial states (a checkpoint round's resumed states) too (FUSED_INITIAL_STATES): on the H200 (session 30)
# tests/gpu/test_checkpoints_gpu.py passed with it (9) and the fused call from initial states gave fla's steps' bits
# (test_gated_delta_gpu.py::test_fused_state_chain_from_initial_states_matches_fla_steps); its speed in checkpoint
# rounds (eager) is not measured apart. False: fla's steps for them (the fused path from zero states only).
# FUSED_STATE_CHAIN False: fla's steps everywhere (the A/B).
FUSED_STATE_CHAIN = True
FUSED_MAX_TOKENS = 1024
FUSED_INITIAL_STATES = True
# Larger buckets (a round of many short states, e.g. 16 RACE requests in the 8,192 bucket, or short states beside a
# long one) split the call by sequence instead (`state_chain.state_chain_split`): sequences of at most
# FUSED_MAX_TOKENS tokens take the fused chain, the longer ones a chain that stores h and the new values as fla's h
# step does, then an o step over their chunks (`split_tables`: the round's long-sequence chunk rows, derived once per
# forward in `fork_tables`; `state_chain.chunk_outputs`: fla's o step, but a spare row returns at once). Each part is
# a binary of its own. False: fla's h and o steps in those buckets.
# Session 31 (H200, replay GPU ms split vs not, with fla's own o step for the long rows): race@16 26.88 vs 26.87,
# race@32 52.82 vs 52.50, MultiRC@8 44.65 vs 44.49, QuALITY 31.49 vs 29.53, sweep 1 8.95 vs 8.25: fla's o kernel
# computed every spare row of the bucket's chunk table as a masked chunk (1.29 of its 1.53 ms on race@16, where no
# state is long), and the LONG chain at 2 stages was 1.8x fla's h on QuALITY (`h200_profile_0_8b_session31_*`).
# With `chunk_outputs` (spare rows skipped) and the LONG chain at 3 stages, on an H100 (same-call A/B, split vs not,
# `h100_profile_0_8b_session31_{split_own_o_bv128,nosplit_2}.json`): race@16 26.78 vs 28.02, MultiRC@8 44.45 vs
# 46.24, sweep 64 15.95 vs 16.07, but QuALITY 31.08 vs 30.76 and sweep 1 8.71 vs 8.43: the outputs kernel beats
# fla's o (sweep 1 0.50 vs 0.69 ms over 18 layers), the LONG chain is still ~1.4x fla's h (1.15 vs 0.83). On
# because rounds of many short states gain more than single long states lose; the LONG chain's speed is open.
FUSED_SPLIT = True
# The split call's long sequences in two levels instead (`segment_scan.state_chain_segments`: segments of
# segment_scan.SEGMENT_TOKENS in parallel, a combine scan over them, then every segment's fused chain, outputs
# included; the short sequences one segment each in the same launch). The round's split tables are then
# `segment_scan.segment_tables`' (`split_call_tables`). False: the LONG chain + outputs kernel above.
SEGMENT_SCAN = False

# The fork's questions in chunked form (`questions_chunked.py`), decided when a model is patched
# (`kernels.gated_delta_questions: auto` reads this; outside batch-invariant mode): the state call's gate cumsum and
# kkt + solve launches also cover the questions' chunks (`gated_delta_states_chunked`), and one launch runs every
# question's chunks from its state's final state, w / u formed in the kernel; a nested fork's leaves and their
# sub-trunks stay recurrent (SPLIT_NESTED_QUESTIONS). False: the recurrent question kernel (`branches.py`).
# Session 38, H200, this default (with OWN_W_U and SPLIT_NESTED_QUESTIONS) vs the recurrent kernel, same machine,
# replay GPU ms (`h200_profile_0_8b_session38_{chunked,recurrent}.json`): RACE 2.77 vs 2.99 (question call 0.37 + 0.06
# vs 0.72), MultiRC 4.03 vs 3.98 (its nested rows by the same recurrent kernel: 1.07 vs 1.07), QuALITY 27.54 vs 28.51,
# 2,000-token state with 8 questions 11.59 vs 12.74, with 64 (nested) 15.04 vs 15.00, 16 RACE 23.71 vs 25.29.
# GPU-checked there: the engine against the pipeline with nested rows recurrent and chunked, the split op and its
# opcheck; the nested-fork test's seeds 0 and 2 fp32 (seed 1 and 2 bf16 failed on test faults since mended: no plain
# row in seed 1, the spare state's unwritten final row compared). Session 37 (H100, every question row chunked):
# MultiRC 4.63 vs 4.01 and 64 questions 18.61 vs 15.46 (a 2-token leaf paid a 64-token chunk step), hence the split.
# Session 36, H100, the first form (a program per capacity question row): QuALITY 30.29 vs 29.74 (32k programs of
# 117 KB of shared memory, nearly all returning at once), hence the rows in turns.
CHUNKED_QUESTIONS = True
# With CHUNKED_QUESTIONS, a nested fork's leaves and the sub-trunks they continue run by the recurrent nested kernel
# and only its other question rows in chunked form (`questions_chunked.questions_split_nested`): a leaf is a few
# tokens, and a chunk step costs ~20 tokens of recurrent steps. H100, session 37 (all of a round's rows chunked,
# leaves re-running or reloading their sub-trunks): the 64-question sweep's question call 6.11 / 4.39 ms vs the
# recurrent kernel's 3.27, MultiRC's 1.57 / 1.49 vs 1.07; split (H200, session 38): 0.08 + 3.25 and 0.06 + 1.07.
# False: the chunked call runs the nested rows too.
SPLIT_NESTED_QUESTIONS = True

# Whether the fork's state call (`gated_delta_states`, from the round's tables) stores the final states of empty
# sequences where our chain runs. They are zero rows that nobody reads (the fork starts an empty state's questions
# from zero: `ForkTables.branch_from`), and most of a bucket's state rows are empty (127 of the 8,192 bucket's 128
# for one QuALITY request: 127 MiB of stores a layer on Qwen3.5-0.8B). True: store them (the old way, for A/B).
EMPTY_STATE_FINALS = False


def _fused_chain(k: torch.Tensor, tokens: int, h0: torch.Tensor | None) -> bool:
    return (FUSED_STATE_CHAIN and (h0 is None or FUSED_INITIAL_STATES) and k.is_cuda and k.element_size() == 2
            and tokens <= FUSED_MAX_TOKENS)


def split_call(tokens: int, on_cuda: bool) -> bool:
    """Whether the state call of a `tokens`-token bucket splits its sequences (FUSED_SPLIT): where the fused chain
    does not take the whole call."""
    return FUSED_STATE_CHAIN and FUSED_SPLIT and on_cuda and tokens > FUSED_MAX_TOKENS


def split_tables(cu_seqlens: torch.Tensor, rows: int, split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk rows [rows, 2], offsets [N + 2]) of the sequences of `cu_seqlens` [N + 2] longer than `split` tokens
    (default FUSED_MAX_TOKENS; the others count as empty): what fla's o step runs over in a split state call
    (`chunk_table`'s form, spare rows naming the trailing empty sequence), and each sequence's first row in it, where
    the LONG chain stores its states. Device ops only."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    long_lens = torch.where(lens > (FUSED_MAX_TOKENS if split is None else split), lens, torch.zeros_like(lens))
    return _chunk_rows(long_lens, rows).to(cu_seqlens.dtype), _offsets(long_lens).to(cu_seqlens.dtype)


def split_call_tables(cu_seqlens: torch.Tensor, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tables a split state call of `tokens` tokens reads (`ForkTables.long_chunks` / `long_chunk_offsets`):
    `split_tables` (`rows` chunk rows), or with SEGMENT_SCAN `segment_scan.segment_tables`. Device ops only."""
    if SEGMENT_SCAN:
        from .segment_scan import segment_tables

        return segment_tables(cu_seqlens, FUSED_MAX_TOKENS, tokens)
    return split_tables(cu_seqlens, rows)


def _kkt_kernel():
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel

    return chunk_gated_delta_rule_fwd_kkt_solve_kernel


# The w / u step by our kernel (`wy_form.w_u`: fla's products and roundings, but a spare chunk row returns at once)
# instead of fla's `recompute_w_u_fwd`, which computes every spare row of a bucket's chunk table as a masked chunk
# (161 of the 8,192 bucket's 257 rows for one QuALITY state; the step took 1.01 ms of QuALITY's 29.7 ms replay on the
# H100). Measured (H100, session 37, with CHUNKED_QUESTIONS on, where the step covers the states' rows as without it:
# `h100_profile_0_8b_session37_{on,rows}.json`), the step's ms ours vs fla's: QuALITY 0.74 vs 1.00, 3,600-token
# QuALITY 0.42 vs 0.56, 2,000-token state 0.25 vs 0.33, 16 RACE 0.42 vs 0.93, RACE 0.097 vs 0.099; H200, session 38:
# QuALITY 0.61 vs 0.99, 16 RACE 0.38 vs 0.94. Its GPU bits test (tests/gpu/test_gated_delta_gpu.py::
# test_own_w_u_keeps_fla_s_bits: fla's w / u bits on every used chunk row) passed on the H200 in session 38 (12 of
# 12). False: fla's step.
OWN_W_U = True


def _w_u(k, v, beta, A, g, cu_seqlens, chunk_indices):
    if OWN_W_U and k.is_cuda:
        from .wy_form import w_u

        return w_u(k, v, beta, A, g, cu_seqlens, chunk_indices)
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    return recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


def _intra(k, v, g, beta, cu_seqlens, chunk_indices):
    """fla-core 0.6.0's `chunk_gated_delta_rule_fwd_intra` for our calls (varlen, 64-token chunks, gates given) ->
    (w, u, A): its fused kkt + solve step as `_solve` launches it, then the w / u step (`_w_u`: fla's, or ours with
    OWN_W_U). fla's own function launches the same two kernels with the same arguments (the solve at its autotuned,
    i.e. pinned, config), so where `_solve` keeps that config the bits are fla's."""
    A = _solve(k, g, beta, cu_seqlens, chunk_indices)
    return (*_w_u(k, v, beta, A, g, cu_seqlens, chunk_indices), A)


# The kkt + solve step by our kernel (`kkt_solve.py`: fla's arithmetic with the four diagonal blocks' forward
# substitutions in one loop, independent chains side by side, instead of four loops one after the other; 1 warp a
# program, KKT_WARPS) instead of fla's. Same bits as fla's kernel at the same warps
# (tests/gpu/test_gated_delta_gpu.py::test_own_kkt_solve_keeps_fla_s_bits, passed on an H100 in session 40; fla's
# kernel keeps its bits at 1 and 2 warps too: `test_kkt_warps_keep_the_bits`). Faster on every stream: the launch's
# ms a replay, fla's vs ours (H100, 0.8B, session 40, `benchmarks/results/h100_profile_0_8b_session40_{main,all_flags}
# .json`): RACE 0.344 vs 0.283, MultiRC 0.333 vs 0.249, QuALITY 1.423 vs 1.082, sweep 8 0.852 vs 0.627, sweep 64
# 0.744 vs 0.591, 16 RACE 1.399 vs 1.113; replay GPU ms with it (and the conv's CHANNELS_FASTEST) vs without, same
# machine (`..._session40_{main2,kkt_channels}.json`): RACE 2.825 vs 2.760, QuALITY 28.68 vs 28.30, 16 RACE 24.73 vs
# 24.47, sweep 8 12.03 vs 11.79.
OWN_KKT = True
KKT_WARPS = 1


def _solve(k, g, beta, cu_seqlens, chunk_indices, filled: bool | None = None):
    """A [1, T, Hv, GDN_CHUNK]: fla's fused kkt + solve step over the chunk rows `chunk_indices` (spare rows return
    at once), at 1 warp a program on long streams (KKT_ONE_WARP_TOKENS), else as fla's intra step launches it (its
    autotuner, i.e. the pin). The kernel stores each chunk's lower blocks only. `filled` (default: unless our kernels
    read A, i.e. OWN_W_U on CUDA): rows outside the chunks and every upper block zero, as fla's w / u step reads them;
    else unwritten: ours (`wy_form`, `questions_chunked`) load the lower triangle of a chunk's rows only, and the zero
    fill was a launch a layer (16 MiB at the 8,192 bucket on Qwen3.5-0.8B: 0.10 ms of QuALITY's replay, H200)."""
    B, T, H, K = k.shape
    HV = beta.shape[2]
    if filled is None:
        filled = not (OWN_W_U and k.is_cuda)
    A = (torch.zeros if filled else torch.empty)(B, T, HV, GDN_CHUNK, device=k.device, dtype=k.dtype)
    if OWN_KKT and k.is_cuda:
        from .kkt_solve import kkt_solve

        return kkt_solve(k, g, beta, cu_seqlens, chunk_indices, A, num_warps=KKT_WARPS)
    kernel = _kkt_kernel()
    tuner = autotuner(kernel)
    # only where the sm_90 pins (PIN_CONFIGS) apply with more warps: where this was measured
    pinned = _pinned_for(getattr(tuner, "flide_pinned", None), k, HV)
    args = dict(k=k, g=g, beta=beta, A=A, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K,
                BT=GDN_CHUNK, BC=16)
    grid = (chunk_indices.shape[0], B * HV)
    if pinned is None or pinned.num_warps == 1 or KKT_ONE_WARP_TOKENS is None or T < KKT_ONE_WARP_TOKENS:
        kernel[grid](**args)  # fla's heuristics and autotuner (the pin), as fla's intra step launches it
    else:
        tuner.fn[grid](**args, BK=64, USE_G=True, IS_VARLEN=True, num_warps=1, num_stages=3)
    return A


def span_end(seg_start: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """[1]: where a call's contiguous segments end (see the module docstring's contract). Device ops only."""
    return seg_start[:1] + seg_len.sum(0, keepdim=True)


def bounds(seg_start: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """cu_seqlens [N + 2] of a call: its N segments, then the empty sequence that spare chunk rows name."""
    return torch.cat([seg_start[:1], seg_start[:1] + seg_len.cumsum(0), span_end(seg_start, seg_len)])


def chunk_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N + 1]: the first 64-token chunk of each sequence of `cu_seqlens` in fla's per-chunk state buffer (what fla's
    `prepare_chunk_offsets` computes). Device ops only."""
    return _offsets(cu_seqlens[1:] - cu_seqlens[:-1])


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    """[N + 1]: where each of N sequences of `lens` tokens starts in a table of their 64-token chunks."""
    return torch.cat([lens.new_zeros(1), ((lens + GDN_CHUNK - 1) // GDN_CHUNK).cumsum(0)])


def available() -> str | None:
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU"
    try:
        _fla()
    except ImportError as error:
        return f"fla-core is not importable ({error}); pip install fla-core==0.6.0"
    return None


def chunk_table(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 2] (sequence, chunk) of every 64-token chunk of the sequences of `cu_seqlens`, in order; the rows past
    the real chunks name the last sequence's chunk 0. The last sequence must be empty (see the module docstring).
    Device ops only: no host sync, recorded by CUDA graphs."""
    return _chunk_rows(cu_seqlens[1:] - cu_seqlens[:-1], rows).to(cu_seqlens.dtype)


def _chunk_rows(lens: torch.Tensor, rows: int) -> torch.Tensor:
    """`chunk_table` of sequences of `lens` tokens (the last one empty)."""
    chunk_offsets = _offsets(lens)
    slots = torch.arange(rows, device=lens.device, dtype=chunk_offsets.dtype)
    seq = torch.searchsorted(chunk_offsets, slots, right=True) - 1
    valid = slots < chunk_offsets[-1]
    empty = lens.shape[0] - 1
    chunk = torch.where(valid, slots - chunk_offsets[seq.clamp(max=empty)], torch.zeros_like(slots))
    seq = torch.where(valid, seq, torch.full_like(seq, empty))
    return torch.stack([seq, chunk], 1)


def combined_tables(state_cu_seqlens: torch.Tensor, state_chunks: torch.Tensor, branch_len: torch.Tensor,
                    branch_chunks: torch.Tensor, skip_branches: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens [NS + NB + 2], chunk rows [Cs + Cb, 2]) of the states and then the questions as one varlen call,
    for the chunk-local steps that run over both (`gated_delta_states_wy`). Sequences 0..NS-1 are the states (their
    rows of `state_cu_seqlens`, [NS + 2]), NS..NS+NB-1 the questions (contiguous from the states' end: the round
    layout), NS+NB the empty one that spare rows name: the states' spare rows (naming NS, the state list's empty
    sequence) are moved there, and the questions' rows (their spare rows name NB) shift by NS. The rows need no
    order: each chunk is computed on its own. `skip_branches` ([NB] bool): the chunk rows of these questions become
    spare rows too (their sequences keep their bounds: the questions' rows lie in order). Device ops only."""
    ns = state_cu_seqlens.shape[0] - 2
    nb = branch_len.shape[0]
    states_end = state_cu_seqlens[ns:ns + 1]
    questions_end = states_end + branch_len.sum(0, keepdim=True)  # also the trailing empty sequence's bounds
    cu = torch.cat([state_cu_seqlens[:ns + 1], states_end + branch_len.cumsum(0), questions_end])
    seq = state_chunks[:, :1]
    state_rows = torch.cat([torch.where(seq == ns, torch.full_like(seq, ns + nb), seq), state_chunks[:, 1:]], 1)
    branch_seq = branch_chunks[:, :1]
    if skip_branches is not None:  # to the trailing empty sequence, which a spare question row names already (nb)
        skipped = skip_branches[branch_seq.clamp(max=nb - 1).long()] & (branch_seq < nb)
        branch_seq = torch.where(skipped, torch.full_like(branch_seq, nb), branch_seq)
    branch_rows = torch.cat([branch_seq + ns, branch_chunks[:, 1:]], 1)
    return cu.to(state_cu_seqlens.dtype), torch.cat([state_rows, branch_rows]).to(state_chunks.dtype)


# a call's tables from its segments: in a checkpoint round's forward (`per_round_tables`) derived once for the
# round's GDN layers, whose calls all pass the same segment tensors (the resume companion's, memoised too)
_CALL_TABLES = PerRound()


def _call_tables(seg_start: torch.Tensor, seg_len: torch.Tensor, T: int):
    cu_seqlens = bounds(seg_start, seg_len)
    return cu_seqlens, chunk_table(cu_seqlens, T // GDN_CHUNK + seg_start.shape[0] + 1), chunk_offsets(cu_seqlens)


def gated_delta(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale: float,
                use_qk_l2norm: bool):
    """Same arguments and results as `reference.gated_delta`, on CUDA tensors (see the module docstring)."""
    T = q.shape[0]
    cu_seqlens, chunk_indices, offsets = _CALL_TABLES.get((seg_start, seg_len), T,
                                                          lambda: _call_tables(seg_start, seg_len, T))
    h0 = None  # no initial states (the fork's state call): fla starts every sequence from zero, nothing to fill
    if initial_state.shape[0] > 0:
        # one gather from the states plus a zero row (index -1 and the trailing empty sequence read it)
        source = torch.cat([initial_state.float(), initial_state.new_zeros((1, *initial_state.shape[1:]),
                                                                           dtype=torch.float32)])
        zero_row = torch.full_like(initial_index[:1], initial_state.shape[0])
        rows = torch.cat([torch.where(initial_index >= 0, initial_index, zero_row), zero_row])
        h0 = source[rows]
    return run(q, k, v, g, beta, cu_seqlens, chunk_indices, h0, scale, use_qk_l2norm, offsets)[:2]


def gated_delta_states(q, k, v, g, beta, cu_seqlens, chunk_indices, offsets, scale: float, use_qk_l2norm: bool,
                       split: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The fork's state call from tables derived once per round (`gated_delta.fork_tables`): every sequence of
    `cu_seqlens` [N + 2] (the states, then the empty sequence that spare chunk rows name) from zero; `chunk_indices`:
    the round's `state_chunks`; `offsets`: `chunk_offsets(cu_seqlens)`. Returns (o [T, Hv, V], final [N, Hv, K, V]
    float32, q, k, v): q, k and v as the kernels read them (contiguous; q and k L2-normalised over the whole stream
    with `use_qk_l2norm`), so the question call reads them as they are instead of normalising every token again in
    its recurrence or laying v out again. `split`: the round's `split_tables` (see `run`). The final-state rows of
    empty sequences may be left unwritten (EMPTY_STATE_FINALS): the fork never reads them."""
    return run(q, k, v, g, beta, cu_seqlens, chunk_indices, None, scale, use_qk_l2norm, offsets, split=split,
               empty_finals=EMPTY_STATE_FINALS)


def gated_delta_states_wy(q, k, v, g, beta, all_cu_seqlens, all_chunks, cu_seqlens, chunk_indices, offsets,
                          scale: float, use_qk_l2norm: bool):
    """`gated_delta_states`, whose chunk-local steps (gate cumsums, the WY form) also cover the questions: they run
    over the sequences of `all_cu_seqlens` / `all_chunks` (the states, then the questions, `fork_tables`) in the
    same launches, the state-to-state steps over the states only. Returns (o, final, q, k as the state call's) +
    (w [T, Hv, K], u [T, Hv, V], gamma [T, Hv] float32 in log2 units) for the questions' chunked call
    (`questions_wy.py`)."""
    out = run(q, k, v, g, beta, cu_seqlens, chunk_indices, None, scale, use_qk_l2norm, offsets,
              prep=(all_cu_seqlens, all_chunks))
    return out[:4] + out[5:]  # the questions' WY form replaces v


def _check_laid_out(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous [T, H, D] (laid out as fla's kernels read it)")


def gated_delta_states_laid_out(q, k, v, g, beta, cu_seqlens, chunk_indices, offsets, scale: float,
                                split: tuple[torch.Tensor, torch.Tensor] | None = None):
    """`gated_delta_states` on q, k and v already laid out as fla's kernels read them (contiguous [T, H, D]; q and k
    normalised: the GDN layer's fused conv, `fork_conv_qkv`, writes them so), which the question call then reads
    too. Returns (o [T, Hv, V], final [N, Hv, K, V] float32; rows of empty sequences as `gated_delta_states`')."""
    _check_laid_out(q, k, v)
    return run(q, k, v, g, beta, cu_seqlens, chunk_indices, None, scale, False, offsets, laid_out=True,
               split=split, empty_finals=EMPTY_STATE_FINALS)[:2]


def gated_delta_states_chunked(q, k, v, g, beta, all_cu_seqlens, all_chunks, cu_seqlens, chunk_indices, offsets,
                               scale: float, split: tuple[torch.Tensor, torch.Tensor] | None = None):
    """`gated_delta_states_laid_out` whose gate cumsum and kkt + solve launches also cover the questions' chunks (the
    sequences of `all_cu_seqlens` / `all_chunks`: the states, then the questions, `fork_tables`), for the chunked
    question call. Returns (o [T, Hv, V], final [N, Hv, K, V] float32, g [T, Hv] float32 chunk-local log2 cumsums,
    A [T, Hv, GDN_CHUNK] the solved rows). The states' rows, final states included, have the bits of
    `gated_delta_states_laid_out` (each chunk's cumsum and solve are its own; w / u over the states as there)."""
    _check_laid_out(q, k, v)
    out = run(q, k, v, g, beta, cu_seqlens, chunk_indices, None, scale, False, offsets,
              prep=(all_cu_seqlens, all_chunks), laid_out=True, split=split, empty_finals=EMPTY_STATE_FINALS,
              solve_prep=True)
    return out[0], out[1], out[5], out[6]


def run(q, k, v, g, beta, cu_seqlens, chunk_indices, h0, scale: float, use_qk_l2norm: bool,
        offsets: torch.Tensor | None = None, prep: tuple[torch.Tensor, torch.Tensor] | None = None,
        laid_out: bool = False, split: tuple[torch.Tensor, torch.Tensor] | None = None, empty_finals: bool = True,
        solve_prep: bool = False):
    """fla's forward over the sequences of `cu_seqlens` -> (o [T, Hv, V], final [N, Hv, K, V] float32, q, k, v as the
    kernels read them: new contiguous tensors, q and k normalised with `use_qk_l2norm`). With `prep` (cu_seqlens,
    chunk rows of a superset of the sequences, each chunk computed on its own) the chunk-local steps run over those
    sequences and their w, u and gate cumsums ([T, Hv, K], [T, Hv, V], [T, Hv] float32, log2 units) come back too.
    `laid_out`: q, k and v are already as the kernels read them (and returned as they are). `split`: the call's
    `split_tables` (empty tensors: none), with which a call from zero states in a bucket over FUSED_MAX_TOKENS splits
    its sequences between the fused chain and fla's o step (FUSED_SPLIT). `empty_finals=False` (h0 None): where our
    chain runs, the final-state rows of empty sequences are left unwritten (`state_chain.state_chain`; fla's h step
    writes every row). `solve_prep` (with `prep`): only the kkt + solve step runs over `prep`'s chunks, w / u over the
    call's own, and what comes back after q, k, v is (gate cumsums [T, Hv] float32 log2 units, A [T, Hv, GDN_CHUNK]:
    the solved rows) for the chunked question call (`questions_chunked.py`)."""
    cumsum, _, fwd_h, fwd_o, rcp_ln2 = _fla_steps()
    # q, k and v as fla's kernels index them (contiguous [T, H, D]), q / k normalised by ours, not fla's: one launch
    # configuration for every stream (see l2norm.py); they may be column slices of the conv's output (the model
    # passes them so): read in place, written as new tensors, which the question call reads too
    if not laid_out:
        from .l2norm import prepare_qkv

        q, k, v = prepare_qkv(q, k, v, use_qk_l2norm)
    qn, kn, vn = q, k, v
    q, k, v, beta = q[None], k[None], v[None], beta[None].to(q.dtype)
    # as chunk_gated_delta_rule_fwd: gates cumulated per chunk in log2 units, the WY form within chunks, the states
    # chunk to chunk (and each sequence's final state), then the outputs
    prep_cu, prep_chunks = prep if prep is not None else (cu_seqlens, chunk_indices)
    g = cumsum(g[None].float(), chunk_size=GDN_CHUNK, scale=rcp_ln2, cu_seqlens=prep_cu, chunk_indices=prep_chunks)
    if solve_prep:  # A over every chunk of `prep`, w / u over the call's own (the questions form theirs themselves)
        A = _solve(k, g, beta, prep_cu, prep_chunks)
        w, u = _w_u(k, v, beta, A, g, cu_seqlens, chunk_indices)
    else:
        w, u, A = _intra(k, v, g, beta, prep_cu, prep_chunks)
    if _fused_chain(k, qn.shape[0], h0):
        # the chunk-to-chunk steps in one launch, outputs included (state_chain.py): the sequences without the
        # trailing empty one, whose only use is to give fla's chunk rows a name
        from .state_chain import state_chain

        o, final = state_chain(qn, kn, w[0], u[0], g[0], cu_seqlens[:-1], scale,
                               initial_state=None if h0 is None else h0[:cu_seqlens.shape[0] - 2],
                               empty_finals=empty_finals)
    elif h0 is None and split is not None and split[0].numel() > 0 and split_call(qn.shape[0], k.is_cuda):
        if SEGMENT_SCAN:  # `split`: segment_scan.segment_tables' (split_call_tables)
            from .segment_scan import state_chain_segments

            o, final = state_chain_segments(qn, kn, w[0], u[0], g[0], split, cu_seqlens.shape[0] - 2, scale,
                                            empty_finals=empty_finals)
        else:
            from .state_chain import state_chain_split

            long_chunks, long_offsets = split
            o, final = state_chain_split(qn, kn, w[0], u[0], g[0], cu_seqlens, scale, FUSED_MAX_TOKENS,
                                         long_chunks, long_offsets, empty_finals=empty_finals)
    else:
        if offsets is None:
            offsets = chunk_offsets(cu_seqlens)
        h, v_new, final = fwd_h(k=k, w=w, u=u, g=g, initial_state=h0, output_final_state=True,
                                chunk_size=GDN_CHUNK, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                chunk_offsets=offsets)
        # Tried (fe56b87, reverted): the question call, which needs only `final`, on a side stream here, overlapping
        # the output step (parallel branches in the CUDA graph). On the H200 the replays were within 1 % (0.8B: RACE
        # 3.86 vs 3.88 ms, QuALITY 33.5 vs 33.8; `benchmarks/results/h200_profile_0_8b_overlap_questions.json`): the
        # output step slowed by as much as the overlap saved (RACE: 0.30 vs 0.18 ms over 18 layers).
        o = fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu_seqlens, chunk_size=GDN_CHUNK,
                  chunk_indices=chunk_indices)[0]
    # rows outside the call's span are left as fla leaves them (unwritten): `fork` selects each row from the call
    # that covers it (`combine`), which costs one pass instead of zeroing here and summing there
    out = (o.to(q.dtype), final[:cu_seqlens.shape[0] - 2], qn, kn, vn)
    if prep is None:
        return out
    return (*out, g[0], A[0]) if solve_prep else (*out, w[0], u[0], g[0])
