"""The gated delta rule on the GPU through fla-core's chunked kernels, fed fixed-capacity chunk lists.

Contract beyond the reference's: the call's non-empty segments are contiguous and in stream order, and unused rows
(length 0) come last. The round layout guarantees it (all states, then all questions), so cu_seqlens is a cumsum of
the lengths, built on the GPU; fla's static chunk list (`prepare_chunk_indices_static`: T/64 + N rows, sentinel rows
past the real chunks) gives every kernel a grid that depends on the capacities alone. Rows outside the call's span
are zeroed: fla leaves them unwritten, and a NaN there would leak through 0-probability attention products.
"""

from __future__ import annotations

import functools
import os

import torch

from ...config import GDN_CHUNK


@functools.lru_cache(maxsize=1)
def _fla():
    # fla caches derived index tensors (chunk offsets) by tensor identity: reused or static buffers then get stale
    # offsets and its kernels read out of bounds (seen on the H200: an illegal memory access once transformers had
    # imported fla first). fla reads the switch from `fla.utils` at every call, so set it there, whoever imported
    # fla first; the environment variable only counts at fla's import.
    os.environ.setdefault("FLA_DISABLE_TENSOR_CACHE", "1")
    import fla.utils
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils.index import prepare_chunk_indices_static

    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    return chunk_gated_delta_rule, prepare_chunk_indices_static


def available() -> str | None:
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU"
    try:
        _fla()
    except ImportError as error:
        return f"fla-core is not importable ({error}); pip install fla-core==0.6.0"
    return None


def gated_delta(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale: float,
                use_qk_l2norm: bool):
    """Same arguments and results as `reference.gated_delta`, on CUDA tensors (see the module docstring)."""
    chunk_rule, static_chunks = _fla()
    T = q.shape[0]
    N = seg_start.shape[0]
    # One spare zero row: a zero-length sequence at the very end of the stream starts at row T, and fla's kernels
    # form pointers at a sequence's first row even when it has none (an illegal access without the spare row)
    q, k, v, g, beta = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (q, k, v, g, beta))
    cu_seqlens = torch.cat([seg_start[:1], seg_start[:1] + seg_len.cumsum(0)])
    chunk_indices, _ = static_chunks(cu_seqlens, GDN_CHUNK, (T + 1) // GDN_CHUNK + N + 1)
    if initial_state.shape[0] == 0:
        h0 = q.new_zeros(N, v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32)
    else:
        h0 = initial_state[initial_index.clamp(min=0)].float()
        h0 = torch.where((initial_index >= 0)[:, None, None, None], h0, torch.zeros_like(h0))
    o, final = chunk_rule(q[None], k[None], v[None], g[None].float(), beta[None].to(q.dtype), scale=scale,
                          initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                          cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    t = torch.arange(T, device=q.device)
    inside = (t >= cu_seqlens[0]) & (t < cu_seqlens[-1])
    o = torch.where(inside[:, None, None], o[0, :T], torch.zeros((), dtype=o.dtype, device=o.device))
    return o.to(q.dtype), final
