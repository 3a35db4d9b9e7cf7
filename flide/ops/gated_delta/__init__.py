"""flide::gated_delta_* custom ops and the two-call fork built on them. Variants: `reference` (pure torch, any
device), `fla` (fla-core's chunked Triton kernels with fixed-capacity chunk lists built on the GPU for the states,
and our recurrent Triton kernel, `branches.py`, for the questions; CUDA), `fla_wy` (the same state call, whose
chunk-local steps also prepare the questions' WY form, and our chunked question kernel, `questions_wy.py`; CUDA),
`fla_cuda` (fla's state call, and our recurrent question kernel in CUDA C, `questions_cuda.py`, compiled by NVRTC).
`fla` with `kernels.gated_delta_questions: chunked` (auto: `fla.CHUNKED_QUESTIONS`): the laid-out fork's questions in
chunked form on the tensor cores (`questions_chunked.py`), nested forks included (CHUNKED_QUESTION_KERNELS).

Nested forks (`runtime.nested_forks`): a leaf question's prompt is state + sub-trunk + leaf, its sub-trunk a shared
question line laid out once as a question segment of its own. Only the question call changes: each leaf continues
its sub-trunk's state before its own rows (`fork_parts(sub=...)`), through its variant's nested companion
(`registry.register_nested`): `reference` and `fla` have one; `fla_wy` and `fla_cuda` do not. The reference re-runs
the sub-trunk's rows for every leaf; `fla`'s kernel starts a leaf from the state its sub-trunk's own program stored
in the same launch (`sub_slots`, up to SUB_STATE_SLOTS sub-trunks a round; the leaves wait on flags the layer keeps,
`new_sub_flags`; the leaves of the other sub-trunks re-run their rows)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...config import GDN_CHUNK
from ..registry import register, register_nested, register_resumable
from ..resume import gated_delta_with_snapshot
from . import fla, reference
from ..gated_norm.reference import select_rows


@torch.library.custom_op("flide::gated_delta_reference", mutates_args=())
def gated_delta_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                          initial_index: torch.Tensor, scale: float,
                          use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.gated_delta(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale,
                                 use_qk_l2norm)


@gated_delta_reference.register_fake
def _fake(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, use_qk_l2norm):
    T, Hv, V = v.shape
    out = q.new_empty(T, Hv, V)
    final = q.new_empty(seg_start.shape[0], Hv, k.shape[2], V, dtype=torch.float32)
    return out, final


# batch-invariant: chunks start at each segment's start, and a segment's chunk products have the same shapes
# whatever else is in the call (checked bitwise in tests/test_batch_invariant.py)
register("gated_delta", "reference", capturable=False, batch_invariant=True)(gated_delta_reference)


@torch.library.custom_op("flide::gated_delta_snapshot_reference", mutates_args=())
def gated_delta_snapshot_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                                   initial_state: torch.Tensor, initial_index: torch.Tensor,
                                   snapshot_chunk: torch.Tensor, scale: float,
                                   use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.gated_delta_snapshot(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index,
                                          snapshot_chunk, scale, use_qk_l2norm)


@gated_delta_snapshot_reference.register_fake
def _fake_snapshot(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, snapshot_chunk, scale,
                   use_qk_l2norm):
    out, final = _fake(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, use_qk_l2norm)
    return out, final, torch.empty_like(final)


# The checkpointing companion of the reference variant: resumes from initial states and snapshots (flide/checkpoints)
register_resumable("gated_delta", "reference")(gated_delta_snapshot_reference)


@torch.library.custom_op("flide::gated_delta_nested_reference", mutates_args=())
def gated_delta_nested_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                                 initial_state: torch.Tensor, initial_index: torch.Tensor, sub_lo: torch.Tensor,
                                 sub_hi: torch.Tensor, sub_slot: torch.Tensor, sub_flags: torch.Tensor, scale: float,
                                 use_qk_l2norm: bool) -> torch.Tensor:
    """The nested fork's question call (`reference.gated_delta` with sub_lo / sub_hi): only the outputs, as every
    nested companion returns them (the questions' final states are never read). `sub_slot` and `sub_flags`
    (`sub_slots`, `new_sub_flags`: where a kernel keeps a sub-trunk's state for its leaves, and what they wait on)
    are ignored: every leaf runs its sub-trunk's rows, the same answer."""
    return reference.gated_delta(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale,
                                 use_qk_l2norm, sub_lo, sub_hi)[0]


@gated_delta_nested_reference.register_fake
def _fake_nested(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, sub_lo, sub_hi, sub_slot,
                 sub_flags, scale, use_qk_l2norm):
    return q.new_empty(v.shape)


# The nested-fork companion of the reference variant: the question call `fork_parts(sub=...)` runs
register_nested("gated_delta", "reference")(gated_delta_nested_reference)


@torch.library.custom_op("flide::gated_delta_fla", mutates_args=(), device_types="cuda")
def gated_delta_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                    initial_index: torch.Tensor, scale: float, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return fla.gated_delta(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, use_qk_l2norm)


gated_delta_fla.register_fake(_fake)  # the same shapes as the reference
# batch-invariant as far as fla's varlen kernels go: a sequence's chunks start at its own start and each program
# owns one sequence and head (to be confirmed bitwise on the GPU: tests/gpu/test_batch_invariant_gpu.py)
register("gated_delta", "fla", available=fla.available, batch_invariant=True)(gated_delta_fla)


def _rests_triton(*args):
    from . import branches  # imported on first use: `import flide` must not need triton

    return branches.segments_with_final(*args)


def _short_states_triton(*args):
    from . import branches

    return branches.segments_with_snapshot(*args)


# Checkpoint rounds (eager and host-bound): states with a short part before the snapshot (a resumed agent step's
# new tokens) run whole, snapshot included, in one launch of our recurrent kernel for all of them; longer ones (a
# fresh history) through fla's chunked call, whose snapshots are the final states of a split call, their rests
# after the snapshots re-run by the recurrent kernel (ops/resume.py). 512 tokens: ~0.5 ms of recurrent GPU time at
# ~1 us a token, against ~1-2 ms of host time per fla call in an eager round (H200 profile of a resumed 0.8B step,
# session 10).
RESUME_SHORT_TOKENS = 512
gated_delta_fla_resumable = register_resumable("gated_delta", "fla")(
    gated_delta_with_snapshot(gated_delta_fla, rest=_rests_triton, short=_short_states_triton,
                              short_tokens=RESUME_SHORT_TOKENS))


@torch.library.custom_op("flide::gated_delta_fla_states", mutates_args=(), device_types="cuda")
def gated_delta_fla_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, chunk_offsets: torch.Tensor,
                           long_chunks: torch.Tensor, long_chunk_offsets: torch.Tensor, scale: float,
                           use_qk_l2norm: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return fla.gated_delta_states(q, k, v, g, beta, cu_seqlens, chunk_indices, chunk_offsets, scale, use_qk_l2norm,
                                  split=(long_chunks, long_chunk_offsets))


@gated_delta_fla_states.register_fake
def _fake_states(q, k, v, g, beta, cu_seqlens, chunk_indices, chunk_offsets, long_chunks, long_chunk_offsets, scale,
                 use_qk_l2norm):
    # (o, final) as the laid-out form's, then q, k and v, which come back contiguous whatever the inputs' strides
    return (*_fake_states_laid_out(q, k, v, g, beta, cu_seqlens, chunk_indices, chunk_offsets, long_chunks,
                                   long_chunk_offsets, scale),
            q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


@torch.library.custom_op("flide::gated_delta_fla_states_laid_out", mutates_args=(), device_types="cuda")
def gated_delta_fla_states_laid_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor,
                                    chunk_offsets: torch.Tensor, long_chunks: torch.Tensor,
                                    long_chunk_offsets: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return fla.gated_delta_states_laid_out(q, k, v, g, beta, cu_seqlens, chunk_indices, chunk_offsets, scale,
                                           split=(long_chunks, long_chunk_offsets))


@gated_delta_fla_states_laid_out.register_fake
def _fake_states_laid_out(q, k, v, g, beta, cu_seqlens, chunk_indices, chunk_offsets, long_chunks, long_chunk_offsets,
                          scale):
    T, Hv, V = v.shape
    return q.new_empty(T, Hv, V), q.new_empty(cu_seqlens.shape[0] - 2, Hv, k.shape[2], V, dtype=torch.float32)


@torch.library.custom_op("flide::gated_delta_fla_states_chunked", mutates_args=(), device_types="cuda")
def gated_delta_fla_states_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, all_cu_seqlens: torch.Tensor, all_chunks: torch.Tensor,
                                   cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, chunk_offsets: torch.Tensor,
                                   long_chunks: torch.Tensor, long_chunk_offsets: torch.Tensor, scale: float
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The laid-out state call whose gate cumsum and kkt + solve also cover the questions' chunks: (o, final) as
    `gated_delta_fla_states_laid_out`'s, then the gate cumsums and solved rows the chunked question call reads."""
    return fla.gated_delta_states_chunked(q, k, v, g, beta, all_cu_seqlens, all_chunks, cu_seqlens, chunk_indices,
                                          chunk_offsets, scale, split=(long_chunks, long_chunk_offsets))


@gated_delta_fla_states_chunked.register_fake
def _fake_states_chunked(q, k, v, g, beta, all_cu_seqlens, all_chunks, cu_seqlens, chunk_indices, chunk_offsets,
                         long_chunks, long_chunk_offsets, scale):
    T, Hv, _ = v.shape
    o, final = _fake_states_laid_out(q, k, v, g, beta, cu_seqlens, chunk_indices, chunk_offsets, long_chunks,
                                     long_chunk_offsets, scale)
    return o, final, q.new_empty(T, Hv, dtype=torch.float32), k.new_empty(T, Hv, GDN_CHUNK)


@torch.library.custom_op("flide::gated_delta_questions_chunked", mutates_args=(), device_types="cuda")
def gated_delta_questions_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                                  g: torch.Tensor, A: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                                  initial_state: torch.Tensor, initial_index: torch.Tensor, sub_lo: torch.Tensor,
                                  sub_hi: torch.Tensor, sub_slot: torch.Tensor, scale: float,
                                  nested: bool) -> torch.Tensor:
    """The question call in chunked form (`questions_chunked.py`) from the chunked state call's g and A; `nested`: a
    leaf first runs its sub-trunk's chunks (`sub_lo` / `sub_hi`, read only then), or with
    `questions_chunked.STORED_SUB_STATES` starts from its sub-trunk's stored state (`sub_slot`, `sub_slots`)."""
    from . import questions_chunked  # imported on first use: `import flide` must not need triton

    return questions_chunked.questions_chunked(q, k, v, beta, g, A, seg_start, seg_len, initial_state, initial_index,
                                               scale, sub=(sub_lo, sub_hi) if nested else None,
                                               sub_slot=sub_slot if nested else None)


@gated_delta_questions_chunked.register_fake
def _fake_questions_chunked(q, k, v, beta, g, A, seg_start, seg_len, initial_state, initial_index, sub_lo, sub_hi,
                            sub_slot, scale, nested):
    return q.new_empty(v.shape)


@torch.library.custom_op("flide::gated_delta_questions_split_nested", mutates_args=(), device_types="cuda")
def gated_delta_questions_split_nested(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor,
                                       beta: torch.Tensor, g: torch.Tensor, A: torch.Tensor, seg_start: torch.Tensor,
                                       plain_len: torch.Tensor, nested_len: torch.Tensor,
                                       initial_state: torch.Tensor, initial_index: torch.Tensor,
                                       sub_lo: torch.Tensor, sub_hi: torch.Tensor, sub_slot: torch.Tensor,
                                       sub_flags: torch.Tensor, scale: float, fixed_tiles: bool = False,
                                       group_len: torch.Tensor | None = None) -> torch.Tensor:
    """A nested fork's question call with its plain rows in chunked form and its leaves and their sub-trunks by the
    recurrent nested kernel (`questions_chunked.questions_split_nested`; `sub_flags` are zero before and after the
    call, as in `gated_delta_branches_nested_triton`, so declared unmutated; `fixed_tiles`: the nested launch's
    width does not follow the stream's length, batch-invariant mode; `group_len`: the long leaves' groups, chunked
    in the nested form, `split_question_lens`)."""
    from . import questions_chunked

    return questions_chunked.questions_split_nested(q, k, v, g_raw, beta, g, A, seg_start, plain_len, nested_len,
                                                    initial_state, initial_index, sub_lo, sub_hi, sub_slot,
                                                    sub_flags, scale, fixed_tiles=fixed_tiles, group_len=group_len)


@gated_delta_questions_split_nested.register_fake
def _fake_questions_split_nested(q, k, v, g_raw, beta, g, A, seg_start, plain_len, nested_len, initial_state,
                                 initial_index, sub_lo, sub_hi, sub_slot, sub_flags, scale, fixed_tiles=False,
                                 group_len=None):
    return q.new_empty(v.shape)


@torch.library.custom_op("flide::gated_delta_branches_triton", mutates_args=(), device_types="cuda")
def gated_delta_branches_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                                initial_state: torch.Tensor, initial_index: torch.Tensor, scale: float,
                                use_qk_l2norm: bool) -> torch.Tensor:
    from . import branches  # imported on first use: `import flide` must not need triton

    return branches.branches(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale,
                             use_qk_l2norm)


@gated_delta_branches_triton.register_fake
def _fake_branches(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, use_qk_l2norm):
    return q.new_empty(v.shape)


@torch.library.custom_op("flide::gated_delta_branches_nested_triton", mutates_args=(), device_types="cuda")
def gated_delta_branches_nested_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                       beta: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                                       initial_state: torch.Tensor, initial_index: torch.Tensor, sub_lo: torch.Tensor,
                                       sub_hi: torch.Tensor, sub_slot: torch.Tensor, sub_flags: torch.Tensor,
                                       scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """The `fla` variant's nested question call: our recurrent kernel compiled with NESTED, in one launch: a
    sub-trunk with a slot (`sub_slot`, `sub_slots`) stores its state after its tokens and raises its flag
    (`sub_flags`, `new_sub_flags`: zero before and after the call, so declared unmutated), and its leaves wait for it
    and start from that state. A leaf without a slot runs its sub-trunk's rows before its own."""
    from . import branches

    return branches.branches(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale,
                             use_qk_l2norm, sub=(sub_lo, sub_hi), sub_slot=sub_slot, sub_flags=sub_flags)


gated_delta_branches_nested_triton.register_fake(_fake_nested)
# `fla`'s nested-fork companion, in place of its question kernel (BRANCH_KERNELS) when the round has sub-trunks.
# `fla_wy` (its questions' chunked WY form comes from the state call, per question segment) and `fla_cuda` (the
# CUDA C question kernel) have none: nested forks stay off with them.
register_nested("gated_delta", "fla")(gated_delta_branches_nested_triton)


@torch.library.custom_op("flide::gated_delta_fla_wy", mutates_args=(), device_types="cuda")
def gated_delta_fla_wy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                       initial_index: torch.Tensor, scale: float,
                       use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The `fla` variant's op under the `fla_wy` name: the same calls outside a fork; the fork differs (WY_KERNELS)."""
    return fla.gated_delta(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, use_qk_l2norm)


gated_delta_fla_wy.register_fake(_fake)
register("gated_delta", "fla_wy", available=fla.available, batch_invariant=True)(gated_delta_fla_wy)
gated_delta_fla_wy_resumable = register_resumable("gated_delta", "fla_wy")(
    gated_delta_with_snapshot(gated_delta_fla_wy, rest=_rests_triton, short=_short_states_triton,
                              short_tokens=RESUME_SHORT_TOKENS))


@torch.library.custom_op("flide::gated_delta_fla_states_wy", mutates_args=(), device_types="cuda")
def gated_delta_fla_states_wy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, all_cu_seqlens: torch.Tensor, all_chunks: torch.Tensor,
                              cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, chunk_offsets: torch.Tensor,
                              scale: float, use_qk_l2norm: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor, torch.Tensor]:
    return fla.gated_delta_states_wy(q, k, v, g, beta, all_cu_seqlens, all_chunks, cu_seqlens, chunk_indices,
                                     chunk_offsets, scale, use_qk_l2norm)


@gated_delta_fla_states_wy.register_fake
def _fake_states_wy(q, k, v, g, beta, all_cu_seqlens, all_chunks, cu_seqlens, chunk_indices, chunk_offsets, scale,
                    use_qk_l2norm):
    T, Hv, V = v.shape
    o, final, qn, kn, _ = _fake_states(q, k, v, g, beta, cu_seqlens, chunk_indices, chunk_offsets, None, None, scale,
                                       use_qk_l2norm)
    return (o, final, qn, kn, k.new_empty(T, Hv, k.shape[2]), v.new_empty(T, Hv, V),
            q.new_empty(T, Hv, dtype=torch.float32))


@torch.library.custom_op("flide::gated_delta_questions_wy", mutates_args=(), device_types="cuda")
def gated_delta_questions_wy(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                             gamma: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                             initial_state: torch.Tensor, initial_index: torch.Tensor, scale: float) -> torch.Tensor:
    from . import questions_wy  # imported on first use: `import flide` must not need triton
    return questions_wy.questions_wy(q, k, w, u, gamma, seg_start, seg_len, initial_state, initial_index, scale)


@gated_delta_questions_wy.register_fake
def _fake_questions_wy(q, k, w, u, gamma, seg_start, seg_len, initial_state, initial_index, scale):
    return q.new_empty(u.shape)


@torch.library.custom_op("flide::gated_delta_branches_cuda", mutates_args=(), device_types="cuda")
def gated_delta_branches_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                              initial_index: torch.Tensor, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """The question call by the CUDA kernel (questions_cuda.py); inputs it does not take (q / k to normalise in the
    kernel, a head shape its tile does not divide) go to the Triton kernel, which computes the same function."""
    from . import branches, questions_cuda  # imported on first use: `import flide` must not need triton

    if not use_qk_l2norm and questions_cuda.supports(q, v, g, beta, initial_index):
        return questions_cuda.branches_cuda(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale)
    return branches.branches(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale,
                             use_qk_l2norm)


gated_delta_branches_cuda.register_fake(_fake_branches)


def _fla_cuda_available() -> str | None:
    from ..cuda_rtc import available

    return fla.available() or available()


@torch.library.custom_op("flide::gated_delta_fla_cuda", mutates_args=(), device_types="cuda")
def gated_delta_fla_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                         initial_index: torch.Tensor, scale: float,
                         use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The `fla` variant's op under the `fla_cuda` name: the same calls outside a fork; in a fork its questions go
    to the CUDA question kernel (BRANCH_KERNELS)."""
    return fla.gated_delta(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, use_qk_l2norm)


gated_delta_fla_cuda.register_fake(_fake)
# batch-invariant: fla's state call as in `fla`; the CUDA question kernel's sums depend only on the branch's tokens
register("gated_delta", "fla_cuda", available=_fla_cuda_available, batch_invariant=True)(gated_delta_fla_cuda)
gated_delta_fla_cuda_resumable = register_resumable("gated_delta", "fla_cuda")(
    gated_delta_with_snapshot(gated_delta_fla_cuda, rest=_rests_triton, short=_short_states_triton,
                              short_tokens=RESUME_SHORT_TOKENS))


# The question call of a variant's fork, where a faster one than the variant itself exists: it returns only the
# outputs (the questions' final states are never read) and reads each branch's initial state in place by index.
BRANCH_KERNELS = {gated_delta_fla: gated_delta_branches_triton, gated_delta_fla_resumable: gated_delta_branches_triton,
                  gated_delta_fla_wy: gated_delta_questions_wy, gated_delta_fla_cuda: gated_delta_branches_cuda,
                  gated_delta_fla_cuda_resumable: gated_delta_branches_cuda,
                  gated_delta_fla_wy_resumable: gated_delta_branches_triton}
# variants whose state call can take the round's tables (`fork_tables`) instead of deriving them from the segment
# lists in every layer: on the H200 that derivation was ~26 small launches per GDN layer (cumsums, searchsorted,
# cats, fills; ~0.5 ms of a RACE replay's 5 ms over 18 layers), plus fla's own chunk offsets (7 more), the same in
# every layer of a round
STATE_KERNELS = {gated_delta_fla: gated_delta_fla_states, gated_delta_fla_wy: gated_delta_fla_states_wy,
                 gated_delta_fla_cuda: gated_delta_fla_states}
# variants whose state call can also take q, k and v already laid out (contiguous, q / k normalised): the GDN layer's
# fused conv writes them so (`fork_conv.QKV_KERNELS`), and the state call's layout launch (`prepare_qkv`, which reads
# the conv's output back and writes it again) drops out; `fork_parts(laid_out=True)`
LAID_OUT_STATE_KERNELS = {gated_delta_fla: gated_delta_fla_states_laid_out,
                          gated_delta_fla_cuda: gated_delta_fla_states_laid_out}
# variants whose laid-out fork can run the questions in chunked form (`fork_parts(chunked=True)`, `kernels.gated_delta_questions`,
# decided at patch time): (its state call that also solves the questions' chunks, the chunked question call, the
# nested fork's question call that runs the leaves and their sub-trunks by the recurrent nested kernel instead:
# `fork_parts(question_lens=)`). Without `question_lens` the chunked call runs nested forks too (a leaf runs its
# sub-trunk's chunks first)
CHUNKED_QUESTION_KERNELS = {gated_delta_fla: (gated_delta_fla_states_chunked, gated_delta_questions_chunked,
                                               gated_delta_questions_split_nested)}
# variants whose fork runs the questions in chunked (WY) form from the state call's chunk-local steps (`fork(wy=)`)
WY_KERNELS = (gated_delta_fla_wy,)


class ForkTables(NamedTuple):
    """What the fork of every GDN layer derives from the round alone, derived once per forward (`fork_tables`)."""

    state_cu_seqlens: torch.Tensor  # [NS + 2]: the states' bounds, then the empty sequence spare chunk rows name
    state_chunks: torch.Tensor  # [Cs, 2]: the round's (state, chunk) rows, spare rows naming state NS
    state_chunk_offsets: torch.Tensor  # [NS + 2]: each state's first chunk in fla's per-chunk state buffer
    states_end: torch.Tensor  # [1]: the end of the states' span (the questions' span starts there)
    branches_end: torch.Tensor  # [1]: the end of the questions' span
    all_cu_seqlens: torch.Tensor  # [NS + NB + 2]: the states, then the questions, as one varlen call (`fla_wy`)
    all_chunks: torch.Tensor  # [Cs + Cb, 2]: their chunk rows (fla.combined_tables); both empty without fla_wy
    long_chunks: torch.Tensor  # [Cs, 2]: the chunk rows of the states over fla.FUSED_MAX_TOKENS (fla.split_tables)
    long_chunk_offsets: torch.Tensor  # [NS + 2]: each state's first row in them; both empty where no call splits
    # (with fla.SEGMENT_SCAN the two tensors of segment_scan.segment_tables instead: `fla.split_call_tables`)
    # [NB]: the state each question starts from, as `branch_state`, but -1 (a zero state) where that state is empty:
    # the final state of an empty state is zero, so the answer is the same, and the state call need not store the
    # final states of empty sequences, most of a bucket's state rows (`state_chain(empty_finals=False)`)
    branch_from: torch.Tensor


def fork_tables(state_start: torch.Tensor, state_len: torch.Tensor, branch_start: torch.Tensor,
                branch_len: torch.Tensor, state_chunks: torch.Tensor,
                branch_chunks: torch.Tensor | None = None, *, branch_state: torch.Tensor,
                skip_branches: torch.Tensor | None = None) -> ForkTables:
    """Device ops only (no host sync): under torch.compile, a few fused kernels once per replay. `branch_chunks`
    (the round's): also the combined tables that only the chunked question calls read; without it they are empty
    tensors (separate ones: compile regions take them as inputs, which must not alias). `branch_state`: the round's.
    `skip_branches` ([NB] bool, with `branch_chunks`): question rows whose chunks the combined tables leave out
    (spare rows: the nested rows that the recurrent kernel runs, `nested_rows`)."""
    cu_seqlens = fla.bounds(state_start, state_len)
    if branch_chunks is not None:
        all_cu_seqlens, all_chunks = fla.combined_tables(cu_seqlens, state_chunks, branch_len, branch_chunks,
                                                         skip_branches)
    else:
        all_cu_seqlens, all_chunks = cu_seqlens.new_empty(0), state_chunks.new_empty(0, 2)
    # a bucket whose state call splits its sequences (fla.split_call; its stream length from the chunk rows'
    # capacity, Shape.state_chunks): the long states' chunk rows for fla's o step
    tokens = (state_chunks.shape[0] - state_start.shape[0]) * GDN_CHUNK
    if fla.split_call(tokens, state_chunks.is_cuda):
        long_chunks, long_offsets = fla.split_call_tables(cu_seqlens, state_chunks.shape[0], tokens)
    else:
        long_chunks, long_offsets = state_chunks.new_empty(0, 2), cu_seqlens.new_empty(0)
    branch_from = torch.where(state_len[branch_state] > 0, branch_state, torch.full_like(branch_state, -1))
    # the ends are tensors of their own, not views of cu_seqlens: compile regions take them as separate inputs,
    # which must not alias
    return ForkTables(cu_seqlens, state_chunks, fla.chunk_offsets(cu_seqlens), fla.span_end(state_start, state_len),
                      fla.span_end(branch_start, branch_len), all_cu_seqlens, all_chunks, long_chunks, long_offsets,
                      branch_from)


# Nested forks: at most this many sub-trunks of a round store their state after their tokens for their leaves to start
# from (`sub_slots`, `branches.branches(sub_slot=)`); the leaves of the others re-run their sub-trunk's tokens. Each
# slot is an fp32 [Hv, K, V] state (1 MiB on Qwen3.5-0.8B, 2 MiB with 4B / 9B's 32 value heads) in a buffer of the
# question call, a per-layer transient in the CUDA graph's memory pool, which is near its budget: 32 MiB at most on
# 0.8B (at most half the bucket's branch rows: `branches.branches`). A real MultiRC request holds ~8 sub-trunks (62 in
# the 8 of benchmarks/test_host_side.py): 32 cover a round of ~4.
SUB_STATE_SLOTS = 32
# Nested forks whose question call is split by rows (`split_question_lens`): a sub-trunk whose every leaf has more
# than this many tokens goes to the chunked launch with its leaves (each leaf re-running the sub-trunk's chunks), not
# to the recurrent one. None: every leaf and the sub-trunk it continues recurrent. Why: the recurrent kernel's time is
# a row's length, and leaves are not always a few tokens: the bench's 64-question request is 32 sub-trunks of 24-83
# tokens with 2 leaves of 38-105 each, all 96 rows recurrent, 7.8 of its 28.8 ms replay (H100, session 40), where
# MultiRC's leaves are 21-41 tokens (after a 12-25-token judge line) and chunked cost it 4.63 vs 4.01 ms (session 37).
# A property of each request alone (batch-invariant). H100, session 44 (`h100_profile_0_8b_session44_widen_stored.json`,
# 32 with questions_chunked.STORED_SUB_STATES, replay GPU ms vs off): 64 questions 26.62 vs 27.97, but every other
# round 0.06-0.39 ms slower (RACE 2.785 vs 2.660), as the plain rows then ran in the nested form's launches too.
# Since then the long leaves' groups take a launch of their own (`split_question_lens`' group_len) and the plain
# rows keep the plain form's. Session 45 (`..._session45_widen_{stored,main}.json`): 64 questions 26.85 vs 28.04,
# RACE 2.786 vs 2.667, QuALITY 27.78 vs 27.45: the groups' launches (two, stored) cost every round even empty. None.
NESTED_CHUNKED_LEAF_TOKENS: int | None = None


def new_sub_flags(heads_v: int, v_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Zeroed int32 flags for the nested question call's stored sub-trunk states (`branches.branches(sub_flags=)`):
    one per (slot, value head, value column), enough for any V tile. Every call leaves them zero again, so a layer
    keeps one buffer for all its calls (no fill launch a call); 256 KiB on Qwen3.5-0.8B's 16 x 128."""
    return torch.zeros(SUB_STATE_SLOTS * heads_v * v_dim, dtype=torch.int32, device=device)


def _leaf_ranges(branch_start: torch.Tensor, branch_len: torch.Tensor, sub_lo: torch.Tensor,
                 sub_hi: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(first, lo, hi, leaf) [NB]: each branch row's first token (in bounds whatever an empty row's start: its range
    is not used), the sub-trunk range [lo, hi) there (int64), and whether the row is a leaf (tokens and a non-empty
    range)."""
    first = branch_start.clamp(0, sub_lo.shape[0] - 1)
    lo, hi = sub_lo[first].long(), sub_hi[first].long()
    return first, lo, hi, (branch_len > 0) & (hi > lo)


def sub_slots(branch_start: torch.Tensor, branch_len: torch.Tensor, branch_state: torch.Tensor,
              sub_lo: torch.Tensor, sub_hi: torch.Tensor, slots: int = SUB_STATE_SLOTS) -> torch.Tensor:
    """[NB] int32, each branch row's slot for its sub-trunk's stored state (nested forks): a sub-trunk row some leaf
    starts from gets the next of `slots` slots in row order (-1 once they are taken), a leaf its sub-trunk's slot, any
    other row -1. Device ops only, static shapes (no host sync): derived once per forward, in the compiled graph.

    A leaf is a row with tokens whose first token has a non-empty sub-trunk range [lo, hi); its sub-trunk is the row
    starting at lo (found by a binary search over the rows' starts, which increase along the used rows; the unused
    rows at the end, length 0 at start 0, sort last). A leaf takes a slot only where that row is exactly its range
    (starts at lo, ends at hi), forks from the same state and is no leaf itself, so a stored state is always the one
    the leaf would compute; else it keeps -1 and re-runs its sub-trunk (the same answer)."""
    B = branch_start.shape[0]
    first, lo, hi, leaf = _leaf_ranges(branch_start, branch_len, sub_lo, sub_hi)
    key = torch.where((branch_len == 0) & (branch_start == 0), torch.iinfo(torch.int64).max, branch_start)
    # the last row starting at or before lo: the sub-trunk (rows of length 0 just before it share its start)
    row = (torch.searchsorted(key, lo, right=True) - 1).clamp(0, B - 1)
    found = (leaf & (branch_start[row] == lo) & (branch_start[row] + branch_len[row] == hi)
             & (branch_state[row] == branch_state) & ~leaf[row])
    # the sub-trunk rows some leaf found, marked by a scatter (the others' to the dummy row B), slots in row order
    marked = torch.zeros(B + 1, dtype=torch.int64, device=branch_start.device)
    marked = marked.scatter(0, torch.where(found, row, B), 1)[:B]
    rank = marked.cumsum(0) - 1
    own = torch.where((marked > 0) & (rank < slots), rank, -1)
    return torch.where(found, own[row], own).to(torch.int32)


def nested_rows(branch_start: torch.Tensor, branch_len: torch.Tensor, sub_lo: torch.Tensor,
                sub_hi: torch.Tensor, chunked_leaf_tokens: int | None = None) -> torch.Tensor:
    """[NB] bool, the question rows of a nested fork that are leaves (tokens, and a non-empty sub-trunk range at the
    first one) or the sub-trunk a leaf continues (a row with tokens that starts where some leaf's range starts: a
    sub-trunk is a question row of the leaf's own request, `round.py`). With `chunked_leaf_tokens` L, only the
    sub-trunks with a leaf of at most L tokens, and their leaves (`NESTED_CHUNKED_LEAF_TOKENS`). Device ops only,
    static shapes: derived once per forward. Which rows these are follows from each request alone (batch invariance
    of the split call, `questions_chunked.questions_split_nested`)."""
    T = sub_lo.shape[0]
    first, lo, _, leaf = _leaf_ranges(branch_start, branch_len, sub_lo, sub_hi)
    short = leaf if chunked_leaf_tokens is None else leaf & (branch_len <= chunked_leaf_tokens)
    starts = torch.zeros(T + 1, dtype=torch.int32, device=branch_start.device)
    starts = starts.scatter(0, torch.where(short, lo, T), 1)[:T]  # those leaves' sub-trunk starts (others: dummy T)
    # a leaf goes where its sub-trunk goes: with the recurrent kernel if any leaf of that sub-trunk is short
    return (leaf & (starts[lo.clamp(0, T - 1)] > 0)) | ((branch_len > 0) & (starts[first] > 0))


def split_question_lens(branch_start: torch.Tensor, branch_len: torch.Tensor, sub_lo: torch.Tensor,
                        sub_hi: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(plain_len, nested_len) [NB]: each question row's length in the first where it is no leaf and no sub-trunk a
    leaf continues (`nested_rows`; 0 in the second), else in the second: the chunked and the recurrent part of a
    nested fork's question call (`fork_parts(question_lens=)`). With NESTED_CHUNKED_LEAF_TOKENS a third, group_len:
    the groups of long leaves (`nested_rows` with it: a sub-trunk whose every leaf is longer, and those leaves), 0 in
    the other two; they run chunked in the nested form, in a launch of their own, so that the plain rows keep the
    plain form's leaner binary. Device ops only."""
    nested = nested_rows(branch_start, branch_len, sub_lo, sub_hi, NESTED_CHUNKED_LEAF_TOKENS)
    none = torch.zeros_like(branch_len)
    if NESTED_CHUNKED_LEAF_TOKENS is None:
        return torch.where(nested, none, branch_len), torch.where(nested, branch_len, none)
    grouped = nested_rows(branch_start, branch_len, sub_lo, sub_hi)  # every leaf and sub-trunk
    group = grouped & ~nested
    return (torch.where(grouped, none, branch_len), torch.where(nested, branch_len, none),
            torch.where(group, branch_len, none))


class ForkParts(NamedTuple):
    """The two calls of a fork before their rows are combined (`fork_parts`): each row of the layer's output comes
    from the call that covers it, rows [0, states_end) from `o_states`, rows [branches_start, branches_end) from
    `o_branches`, the rest (tail padding) zero. A GDN layer hands them to its gated norm (`flide.ops.gated_norm`),
    which selects while it normalises; `fork` combines them itself."""

    o_states: torch.Tensor  # [T, Hv, V]
    o_branches: torch.Tensor  # [T, Hv, V]
    states_end: torch.Tensor  # [1]
    branches_start: torch.Tensor  # [1]
    branches_end: torch.Tensor  # [1]
    finals: torch.Tensor  # [NS, Hv, K, V] float32: each state's final recurrent state


def fork(kernel, q, k, v, g, beta, state_start, state_len, branch_start, branch_len, branch_state, scale: float,
         use_qk_l2norm: bool, branch_kernel=None, state_kernel=None,
         tables: ForkTables | None = None, wy: bool = False,
         sub: tuple[torch.Tensor, ...] | None = None,
         nested_kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forked gated delta rule, in two calls of one varlen kernel (`fork_parts`), their rows combined.

    Returns: (o [T, Hv, V], state_final [NS, Hv, K, V] float32).
    """
    parts = fork_parts(kernel, q, k, v, g, beta, state_start, state_len, branch_start, branch_len, branch_state,
                       scale, use_qk_l2norm, branch_kernel, state_kernel, tables, wy, sub=sub,
                       nested_kernel=nested_kernel)
    o = select_rows(parts.o_states, parts.o_branches, parts.states_end, parts.branches_start, parts.branches_end)
    return o, parts.finals


def fork_parts(kernel, q, k, v, g, beta, state_start, state_len, branch_start, branch_len, branch_state,
               scale: float, use_qk_l2norm: bool, branch_kernel=None, state_kernel=None,
               tables: ForkTables | None = None, wy: bool = False, laid_out: bool = False,
               sub: tuple[torch.Tensor, ...] | None = None, nested_kernel=None, chunked: bool = False,
               question_lens: tuple[torch.Tensor, ...] | None = None, fixed_tiles: bool = False
               ) -> ForkParts:
    """Forked gated delta rule, in two calls of one varlen kernel.

    Call 1 runs every state from a zero state and keeps each one's final recurrent state (float32); call 2 runs every
    question from the final state of its state (`branch_state` indexes the states). The level-major layout puts all
    states in one span and all questions in the next, so each row's output is taken from the call that covers it
    (`ForkParts`), and rows covered by neither (the tail padding) are zero.

    `branch_kernel`: the question call's kernel when the variant has a faster one (`BRANCH_KERNELS[kernel]`; the
    model layers look it up at patch time, outside traced code): it returns only the outputs. `state_kernel`
    (`STATE_KERNELS[kernel]`) with `tables` (`fork_tables`, once per round): the state call from the round's tables,
    which may leave the final states of empty states unwritten; with `tables` the question call reads
    `tables.branch_from` (-1, a zero state, for the questions of an empty state) in place of `branch_state`.
    `wy` (the variant is in WY_KERNELS; decided at patch time): the state call also returns the questions' WY form
    and the question call takes it (`questions_wy.py`). `laid_out`: q, k and v come as the kernels read them
    (contiguous, q and k normalised: `fork_conv.QKV_KERNELS`), and `state_kernel` is the variant's
    `LAID_OUT_STATE_KERNELS` form, which takes them so; both calls read them as they are.

    `sub` (a nested fork: the round's per-token (sub_lo, sub_hi), int32 [T], the branch rows' `sub_slots`, int32
    [NB], derived once per forward, and the layer's `new_sub_flags`) with `nested_kernel` (the variant's nested-fork
    companion, `registry.nested(...)["gated_delta"]`, resolved at patch time): the question call is the companion,
    `nested_kernel(q, k, v, g, beta, branch_start, branch_len, finals, branch_state, sub_lo, sub_hi, sub_slot,
    sub_flags, scale, use_qk_l2norm) -> o`, in place of `branch_kernel` / `kernel`; each leaf question continues its
    sub-trunk's state (`reference.gated_delta`: re-running its rows). The state call never has sub-trunks.

    `chunked` (with `laid_out` and `tables` whose combined chunk rows cover the questions; the variant is in
    CHUNKED_QUESTION_KERNELS): the questions run in chunked form (`questions_chunked.py`) from the state call's gate
    cumsums and solved rows, nested forks too (only `sub`'s two ranges are read: a leaf runs its sub-trunk's chunks).
    `question_lens` (with `chunked` and `sub`; (plain_len, nested_len[, group_len]) [NB], the rows' lengths split by
    `split_question_lens`, derived once per forward, with the tables' combined chunk rows leaving the nested rows out:
    `fork_tables(skip_branches=)`): the plain rows in chunked form and the leaves and their sub-trunks by the
    recurrent nested kernel, in one call (`questions_chunked.questions_split_nested`; `fixed_tiles`, batch-invariant
    mode: that call's tiles do not follow the stream's length).
    """
    if sub is not None:
        if wy:
            raise ValueError("nested forks (`sub`) have no WY question call: the `fla_wy` fork prepares each "
                             "question's chunked form per question segment, without its sub-trunk (use `fla`)")
        if nested_kernel is None and not chunked:
            raise ValueError("a nested fork (`sub`) needs the variant's nested question call, `nested_kernel` "
                             "(registry.nested(...)['gated_delta'])")
    if tables is not None:  # the state call from the tables may leave empty states' finals unwritten: never read
        branch_state = tables.branch_from
    if wy and not laid_out and state_kernel is not None and branch_kernel is not None and tables is not None:
        o_states, finals, q, k, w, u, gamma = state_kernel(
            q, k, v, g, beta, tables.all_cu_seqlens, tables.all_chunks, tables.state_cu_seqlens, tables.state_chunks,
            tables.state_chunk_offsets, scale, use_qk_l2norm)
        o_branches = branch_kernel(q, k, w, u, gamma, branch_start, branch_len, finals, branch_state, scale)
        return ForkParts(o_states, o_branches, *spans(state_start, state_len, branch_start, branch_len, tables),
                         finals)
    if laid_out:  # the question call below reads q, k and v as they are (use_qk_l2norm False)
        if state_kernel is None or tables is None or use_qk_l2norm:
            raise ValueError("a laid-out fork needs the round's tables, the laid-out state kernel and q / k "
                             "normalised already (use_qk_l2norm False)")
        if chunked:
            if kernel not in CHUNKED_QUESTION_KERNELS or tables.all_chunks.shape[0] == 0:
                raise ValueError("chunked questions need a variant in CHUNKED_QUESTION_KERNELS and the round's "
                                 "combined chunk rows (`fork_tables(branch_chunks=...)`)")
            states_call, questions_call, split_call = CHUNKED_QUESTION_KERNELS[kernel]
            o_states, finals, gamma, solved = states_call(
                q, k, v, g, beta, tables.all_cu_seqlens, tables.all_chunks, tables.state_cu_seqlens,
                tables.state_chunks, tables.state_chunk_offsets, tables.long_chunks, tables.long_chunk_offsets, scale)
            if sub is not None and question_lens is not None:
                plain_len, nested_len, *group_len = question_lens
                o_branches = split_call(q, k, v, g, beta, gamma, solved, branch_start, plain_len, nested_len, finals,
                                        branch_state, *sub, scale, fixed_tiles, *group_len)
            else:
                # (sub_lo, sub_hi, the rows' sub-trunk state slots), unread without sub-trunks
                nest = sub[:3] if sub is not None else (branch_start, branch_start, branch_start)
                o_branches = questions_call(q, k, v, beta, gamma, solved, branch_start, branch_len, finals,
                                            branch_state, *nest, scale, sub is not None)
            return ForkParts(o_states, o_branches, *spans(state_start, state_len, branch_start, branch_len, tables),
                             finals)
        o_states, finals = state_kernel(q, k, v, g, beta, tables.state_cu_seqlens, tables.state_chunks,
                                        tables.state_chunk_offsets, tables.long_chunks, tables.long_chunk_offsets,
                                        scale)
    elif state_kernel is not None and tables is not None:
        # q and k come back normalised: the question call reads them so (one normalisation per token, not one in
        # every step of every (branch, head, value tile) program of the question kernel), and v laid out once
        o_states, finals, q, k, v = state_kernel(q, k, v, g, beta, tables.state_cu_seqlens, tables.state_chunks,
                                                 tables.state_chunk_offsets, tables.long_chunks,
                                                 tables.long_chunk_offsets, scale, use_qk_l2norm)
        use_qk_l2norm = False
    else:
        no_initial = q.new_zeros(0, v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32)
        none = torch.full_like(state_start, -1)
        o_states, finals = kernel(q, k, v, g, beta, state_start, state_len, no_initial, none, scale, use_qk_l2norm)
    if sub is not None:  # a leaf's sub-trunk rows (or its sub-trunk's stored state) are inputs of this call
        o_branches = nested_kernel(q, k, v, g, beta, branch_start, branch_len, finals, branch_state, *sub, scale,
                                   use_qk_l2norm)
    elif branch_kernel is not None:
        o_branches = branch_kernel(q, k, v, g, beta, branch_start, branch_len, finals, branch_state, scale,
                                   use_qk_l2norm)
    else:
        o_branches, _ = kernel(q, k, v, g, beta, branch_start, branch_len, finals, branch_state, scale,
                               use_qk_l2norm)
    return ForkParts(o_states, o_branches, *spans(state_start, state_len, branch_start, branch_len, tables), finals)


def spans(state_start: torch.Tensor, state_len: torch.Tensor, branch_start: torch.Tensor, branch_len: torch.Tensor,
          tables: ForkTables | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(states_end, branches_start, branches_end), each [1]: the rows each call of a fork covers (the states' span
    starts at row 0). From the round's tables when given (derived once per forward), else from the segments."""
    if tables is not None:
        return tables.states_end, branch_start[:1], tables.branches_end
    return fla.span_end(state_start, state_len), branch_start[:1], fla.span_end(branch_start, branch_len)


def combine(o_states: torch.Tensor, o_branches: torch.Tensor, state_start: torch.Tensor, state_len: torch.Tensor,
            branch_start: torch.Tensor, branch_len: torch.Tensor, tables: ForkTables | None = None) -> torch.Tensor:
    """The stream's output from the two calls: state rows from the first, question rows from the second, zero
    elsewhere (`select_rows`: a variant may leave the rows outside its call's span unwritten, fla does, and they can
    hold NaN, which a sum would spread and a select does not)."""
    return select_rows(o_states, o_branches, *spans(state_start, state_len, branch_start, branch_len, tables))


def fork_resumable(snapshot_kernel, q, k, v, g, beta, state_start, state_len, branch_start, branch_len, branch_state,
                   scale: float, use_qk_l2norm: bool, initial_state: torch.Tensor, initial_index: torch.Tensor,
                   snapshot_chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fork` for rounds with checkpoints: a state resumed from a checkpoint starts from its saved recurrent state
    (`initial_state[initial_index[s]]`, -1: from zero) instead of zero, and the state call also snapshots each state
    at chunk `snapshot_chunk[s]` (-1: none), the checkpoint a later request resumes from.

    Returns: (o [T, Hv, V], state_final [NS, Hv, K, V] float32, snapshot [NS, Hv, K, V] float32).
    """
    o_states, finals, snapshot = snapshot_kernel(q, k, v, g, beta, state_start, state_len, initial_state,
                                                 initial_index, snapshot_chunk, scale, use_qk_l2norm)
    branch_kernel = BRANCH_KERNELS.get(snapshot_kernel)
    if branch_kernel is not None:
        o_branches = branch_kernel(q, k, v, g, beta, branch_start, branch_len, finals, branch_state, scale,
                                   use_qk_l2norm)
    else:
        none = torch.full_like(branch_state, -1)
        o_branches, _, _ = snapshot_kernel(q, k, v, g, beta, branch_start, branch_len, finals, branch_state, none,
                                           scale, use_qk_l2norm)
    return combine(o_states, o_branches, state_start, state_len, branch_start, branch_len), finals, snapshot
