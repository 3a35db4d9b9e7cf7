"""The recurrent question kernel of `branches.py` written in Gluon (Triton's layout-explicit dialect): the same
token-by-token delta rule, one program per (branch, value head, V tile) from its state's final recurrent state read
in place by index, with the register layout of the state slice chosen here instead of by Triton's layout passes.

Why: a question's latency is its length times one token step, and a step is one dependent chain (decay, a sum over
K, the rank-1 update, a second sum over K) run by one warp. In the Triton kernel the [K, BV] state took the layout
of its first load (4 value columns of 16 bytes a thread, rows strided over 8 lanes), while the token's q and k came
in a coalesced 1-D layout (4 contiguous keys a thread): every step converted q, k and the output between the two
through shared memory (sm_90 SASS of the step: 9 STS, 33 LDS, 3 BAR, about 480 instructions). Here the vectors
live in the state's own slice layouts, so a step has no shared memory at all:
- the state slice is [K, BV] fp32 in `BlockedLayout([K / TPW_K, BV / (32 / TPW_K)], [TPW_K, 32 / TPW_K])` with
  keys fastest (order [0, 1]): a thread holds K / TPW_K consecutive keys of BV / (32 / TPW_K) value columns;
- q and k of a token are loaded straight into the key slice of that layout (each thread its consecutive keys: one
  vectorised load), v and the output live in the value slice;
- a sum over K is K / TPW_K adds in a thread then log2(TPW_K) butterfly shuffles, and every lane ends with the sum
  it needs for the update (no broadcast).

Each program's sums depend only on its own branch's tokens and the fixed tiles: batch-invariant, and a question
asked alone runs the same code. The bits differ from the Triton kernel's (another order of the sums over K): both
are checked against the reference (tests/gpu/test_gated_delta_gpu.py).

Gluon kernels do not run in Triton's CPU interpreter: the CPU tests compile this one for sm_90
(tests/test_triton_kernels.py), the GPU tests run it. Not every Triton has Gluon: `available()` says whether this
one does, and `branches` falls back to the Triton kernel where it does not.
"""

from __future__ import annotations

import torch

try:  # Gluon is experimental: absent from older Tritons, its API may move
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover (every Triton Flide supports has it today)
    gluon = gl = None

# Default tiles: value columns per program and lanes along K (one warp). To be measured on the H200
# (benchmarks/ops/bench_gated_delta.py --sweep, rows `questions:gluon[...]`).
BLOCK_V = 16
LANES_K = 8


def available() -> bool:
    return gluon is not None


def tiles_ok(K: int, V: int, BV: int, lanes_k: int) -> bool:
    """Whether (BV, lanes_k) tile a [K, V] state without masks: K a power of two that lanes_k divides, BV a power
    of two dividing V, and 32 / lanes_k lanes along V, each with a whole number of value columns."""
    def power_of_two(x: int) -> bool:
        return x > 0 and x & (x - 1) == 0

    return (power_of_two(K) and power_of_two(BV) and power_of_two(lanes_k) and lanes_k <= 32 and K % lanes_k == 0
            and V % BV == 0 and BV % (32 // lanes_k) == 0)


if gluon is not None:
    @gluon.jit
    def _branch_kernel_gluon(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, start_ptr, len_ptr, index_ptr,
                             scale, HK: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                             BV: gl.constexpr, LANES_K: gl.constexpr, L2NORM: gl.constexpr):
        LANES_V: gl.constexpr = 32 // LANES_K
        state: gl.constexpr = gl.BlockedLayout([K // LANES_K, BV // LANES_V], [LANES_K, LANES_V], [1, 1], [0, 1])
        along_k: gl.constexpr = gl.SliceLayout(1, state)  # a [K] vector as the state's rows see it
        along_v: gl.constexpr = gl.SliceLayout(0, state)  # a [BV] vector as the state's columns see it
        i_v = gl.program_id(0)
        i_nh = gl.program_id(1)
        i_n = i_nh // HV
        i_h = i_nh % HV
        i_hk = i_h // (HV // HK)  # grouped value heads: value head h reads key head h // (HV // HK)
        n = gl.load(len_ptr + i_n)
        if n > 0:  # capacity rows without a branch return at once
            bos = gl.load(start_ptr + i_n).to(gl.int64)
            o_k = gl.arange(0, K, layout=along_k)
            o_v = i_v * BV + gl.arange(0, BV, layout=along_v)
            idx = gl.load(index_ptr + i_n).to(gl.int64)
            h = gl.zeros([K, BV], gl.float32, state)
            if idx >= 0:  # index -1: from zero
                h += gl.load(h0_ptr + (idx * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :])
            # loads issued one step ahead, as the Triton kernel does: a step waits on its chain, not its loads
            nq = gl.load(q_ptr + (bos * HK + i_hk) * K + o_k)
            nk = gl.load(k_ptr + (bos * HK + i_hk) * K + o_k)
            nv = gl.load(v_ptr + (bos * HV + i_h) * V + o_v)
            ng = gl.load(g_ptr + bos * HV + i_h)
            nbeta = gl.load(beta_ptr + bos * HV + i_h)
            for t in range(bos, bos + n):
                b_q, b_k, b_v = nq.to(gl.float32), nk.to(gl.float32), nv.to(gl.float32)
                b_g, b_beta = ng.to(gl.float32), nbeta.to(gl.float32)
                ahead = gl.minimum(t + 1, bos + n - 1)  # the last step reloads its own token: in bounds, unused
                nq = gl.load(q_ptr + (ahead * HK + i_hk) * K + o_k)
                nk = gl.load(k_ptr + (ahead * HK + i_hk) * K + o_k)
                nv = gl.load(v_ptr + (ahead * HV + i_h) * V + o_v)
                ng = gl.load(g_ptr + ahead * HV + i_h)
                nbeta = gl.load(beta_ptr + ahead * HV + i_h)
                if L2NORM:  # the state call's formula (l2norm.py), rounded to the input dtype as there
                    b_q = (b_q * (1 / gl.sqrt(gl.sum(b_q * b_q, 0) + 1e-6))).to(q_ptr.dtype.element_ty)
                    b_k = (b_k * (1 / gl.sqrt(gl.sum(b_k * b_k, 0) + 1e-6))).to(k_ptr.dtype.element_ty)
                    b_q, b_k = b_q.to(gl.float32), b_k.to(gl.float32)
                h *= gl.exp(b_g)
                b_v = (b_v - gl.sum(h * b_k[:, None], 0)) * b_beta
                h += b_k[:, None] * b_v[None, :]
                b_o = gl.sum(h * (b_q * scale)[:, None], 0)
                gl.store(o_ptr + (t * HV + i_h) * V + o_v, b_o.to(o_ptr.dtype.element_ty))


def branches_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   o: torch.Tensor, h0: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                   initial_index: torch.Tensor, scale: float, use_qk_l2norm: bool,
                   tiles: tuple[int, ...] | None = None) -> torch.Tensor:
    """Writes every segment's outputs into `o` and returns it (the arguments as `branches.branches` prepares them,
    in its kernel's order: contiguous inputs, h0 [M >= 1, Hv, K, V] float32, N >= 1 segments). `tiles`: (value
    columns per program, lanes along K)."""
    if gluon is None:
        raise RuntimeError("the gluon form needs a Triton with Gluon (triton.experimental.gluon)")
    if tiles is not None and len(tiles) != 2:
        raise ValueError(f"`tiles` of the gluon form: (value columns, lanes along K), got {tiles!r}")
    T, HK, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    BV, lanes_k = tiles if tiles else (BLOCK_V, LANES_K)
    if not tiles_ok(K, V, BV, lanes_k):
        raise ValueError(f"the gluon form's tiles (value columns {BV}, lanes along K {lanes_k}) do not tile a "
                         f"[K={K}, V={V}] state")
    N = seg_start.shape[0]
    _branch_kernel_gluon[(V // BV, N * HV)](q, k, v, g, beta, o, h0, seg_start, seg_len, initial_index, float(scale),
                                            HK=HK, HV=HV, K=K, V=V, BV=BV, LANES_K=lanes_k, L2NORM=use_qk_l2norm,
                                            num_warps=1)
    return o
