"""The recurrent question kernel in CUDA C (compiled at run time by NVRTC, `flide/ops/cuda_rtc.py`): the same
token-by-token delta rule as `branches.py`'s Triton kernel, each branch from its state's final recurrent state read
in place by index, with a register layout Triton would not pick.

Why: a question's latency is its length times one token step, and on the H200 the Triton kernel's step was a chain
of in-warp reductions: ~484 sm_90 instructions a step for its 64 state elements a thread (256 of them the state's
multiply-adds, the rest shuffles, their adds, shared-memory layout conversions of q, k and the output, index
arithmetic), 3.3 cycles an issued instruction with one warp a scheduler (Nsight Compute, session 18,
`benchmarks/results/ncu_question_kernel_h200/`). Triton sums a thread's part of a reduction in one dependent chain,
and spreads K over 4-16 lanes, so every sum ends in a chain of shuffles; layouts with few lanes along K were slower
there for that reason (the Gluon sweep, `ops_gated_delta_gluon_h200.md`).

Here a thread owns one value column of the state slice and K / L of its keys (L = 1, 2, 4 or 8 lanes along K):
- a sum over K is K / L multiply-adds into 8 independent accumulators (the multiply-add latency hidden inside one
  thread), a 3-level add tree, then log2(L) butterfly shuffles (none for L = 1);
- one pass over the state a token: token t's rank-1 update and the updated state's sum against q_t (its output),
  then token t + 1's decay and the decayed state's sum against k_{t+1} (its delta), so a step holds one reduction
  latency, not two in a chain;
- q and k of a token are staged once per block in shared memory as fp32 (q already times `scale`) in three
  buffers (a step reads tokens t and t + 1 and writes t + 2), one barrier a step; each thread reads them as float4
  broadcasts, the lanes of one column reading neighbouring float4s (no bank conflicts);
- a token's q, k, v columns, g and beta arrive by asynchronous copies (cp.async) into a shared-memory ring of DEPTH
  tokens, issued DEPTH - 2 steps before their use: a step is a few hundred cycles, less than a round trip to L2 or
  HBM, and no register waits on a load in flight (a register copy of a pending load waits for it);
- blocks are ordered (row, head, tile), tiles fastest, so a bucket's few active rows spread over the SMs.
A step is 4 fp32 operations per state element (3 with LAZY_DECAY) and 3 K / (4 L) shared-memory vector loads,
with no layout conversions: ~500 sm_90 instructions a step at L = 2 (~290 of them fp32), about what the Triton
kernel issues for the same 64 elements a thread.

Measured (H200, 2026-12-01, session 19; `benchmarks/results/ops_gated_delta_cuda_h200.md`, the question call alone on
normalised q / k against the Triton kernel on the same inputs, and `h200_profile_4b_questions_cuda.json`, whole 4B
replays): NOT the default. At Qwen3.5-0.8B's heads (16 / 16) it is 3-18 % slower than the Triton kernel on every
stream (best tile, lazy [L2, w2]: RACE in its bucket 0.036 vs 0.034 ms, one 120-token question 0.060 vs 0.052, 64
RACE requests 0.86 vs 0.79). At 4B / 9B's heads (16 / 32) the lazy [L2, w4] tile is faster where few long questions
leave the Triton kernel's one-warp programs two to a scheduler (one 120-token question 0.065 vs 0.100 ms, 8 such
questions 0.165 vs 0.231) and slower on many short ones (64 RACE requests 1.69 vs 1.58); in whole 4B replays its
question time was QuALITY 8.8 vs 10.4 ms, sweep 1 / 8 / 64 2.6 / 5.3 / 29.9 vs 3.0 / 7.6 / 28.9, RACE 1.86 vs 1.73,
16 RACE requests 18.5 vs 18.6: replays within +-2 %. That edge came from the Triton kernel's 16-column tile: with
32 columns a program from 32 value heads (its default since, `branches.BLOCK_V_MANY_HEADS`) Triton takes one long
question in 0.069 ms, 8 in 0.178, 16 / 64 RACE requests in 0.435 / 1.45 (this kernel 0.065, 0.165, 0.466, 1.69).
The path to more: fewer instructions per element than the
fp32 recurrence allows (tensor cores, i.e. a chunked form), or scheduling that keeps one warp per scheduler.

Each program's sums run in one fixed order that depends only on its own branch's tokens and the compile-time tile
(L, warps, lazy decay): batch-invariant, and a question asked alone runs the same code. The bits differ from the Triton
kernel's (other summation orders); both are checked against the reference (tests/gpu/test_gated_delta_gpu.py).

Inputs: q, k [T, Hk, K], v [T, Hv, V] (bf16, fp16 or fp32, one dtype), g [T, Hv] (log decay), beta [T, Hv]
(either float dtype each), segment tables int32 or int64. Not here (the Triton kernel does them): in-kernel q / k
normalisation, final states and snapshots (checkpoint rounds).
"""

from __future__ import annotations

import torch

# Default tile: lanes along K and warps per block (a block covers warps * 32 / lanes value columns), with the lazy
# decay: the tile of the whole-4B measurement above. Sweep (`bench_gated_delta.py --sweep`, rows
# `questions:cuda[-lazy][L..,w..]`): 4 or 8 lanes along K were 1.5-3x slower (their extra warps are issue-bound),
# L = 1 (128 state registers a thread) 0-50 % slower than L = 2.
LANES_K = 2
WARPS = 4
TILES = ((2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (1, 4))
ACCUMULATORS = 8
# Lazy decay: the state kept as c * S with c the running product of the decays (a scalar per block, folded into S
# below 2^-32), so a step is 3 fp32 operations per state element (the update and two sums) instead of 4, for one
# division per step. (The Triton kernel's lazy decay, wip/questions-lazy-decay, was slower: there the division and
# the fold's branch ran per [K, BV] tile; here they are scalar.)
LAZY_DECAY = True
DEPTH = 5  # tokens in flight in the shared-memory ring: a token's copies are issued DEPTH - 2 steps before its use

# (storage type, load to float, float to storage) per torch dtype; 16-bit types are raw `unsigned short` bits
_TYPES = {
    torch.float32: ("float", "({x})", "({x})"),
    torch.bfloat16: ("unsigned short", "bf16_to_f32({x})", "f32_to_bf16({x})"),
    torch.float16: ("unsigned short", "f16_to_f32({x})", "f32_to_f16({x})"),
}
_INDEX_TYPES = {torch.int32: "int", torch.int64: "long long"}

_SOURCE = r"""
// Generated by flide/ops/gated_delta/questions_cuda.py: see its docstring.
#define K {K}
#define V {V}
#define HK {HK}
#define HV {HV}
#define L {L}
#define W {W}
#define THREADS (W * 32)
#define KPL (K / L)            // keys a lane holds
#define GROUPS (KPL / 4)       // ... as float4 groups
#define CPW (32 / L)           // value columns a warp holds
#define BV (W * CPW)           // value columns a block holds
#define TILES (V / BV)
#define ACC {ACC}
#define DEPTH {DEPTH}          // tokens in the raw ring: a token's copies are issued DEPTH - 2 steps before its use
#define LAZY {LAZY}            // 1: the state kept as c * S, the decays multiplied into the scalar c (see LAZY_DECAY)
#define LAZY_FLOOR 2.3283064e-10f  // 2^-32: below it c is folded into S
typedef {IN_T} in_t;
typedef {G_T} g_t;
typedef {B_T} b_t;
typedef {IDX_T} idx_t;
#define IN_TO_F32(x) {IN_TO_F32}
#define F32_TO_IN(x) {F32_TO_IN}
#define G_TO_F32(x) {G_TO_F32}
#define B_TO_F32(x) {B_TO_F32}
#define IN_BYTES {IN_BYTES}
#define G_BYTES {G_BYTES}
#define B_BYTES {B_BYTES}
#define QK_CHUNKS (2 * K * IN_BYTES / 16)   // 16-byte copies of a token's q and k
#define V_BYTES (BV * IN_BYTES)             // the block's v columns of a token
#define V_COPY (V_BYTES < 16 ? V_BYTES : 16)
#define V_CHUNKS (V_BYTES / V_COPY)

__device__ __forceinline__ float bf16_to_f32(unsigned short x) {{ return __uint_as_float(((unsigned int)x) << 16); }}
__device__ __forceinline__ float f16_to_f32(unsigned short x) {{
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;
}}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {{
    unsigned short r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {{
    unsigned short r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}}

// Asynchronous global -> shared copies (sm_80+): no register holds data in flight, so nothing waits for a load
// before `cp.async.wait_group` (a register copy of a pending load waits for it: the H200 showed ~1 us a step so)
__device__ __forceinline__ unsigned int smem_address(const void* p) {{
    unsigned int r;
    asm("{{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }}" : "=r"(r) : "l"(p));
    return r;
}}
template <int BYTES> __device__ __forceinline__ void copy_async(void* dst, const void* src) {{
    const unsigned int to = smem_address(dst);
    if (BYTES == 16)  // .cg (through L2 only) takes 16-byte copies alone
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(to), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(to), "l"(src), "n"(BYTES) : "memory");
}}
__device__ __forceinline__ void copies_commit() {{ asm volatile("cp.async.commit_group;" ::: "memory"); }}
template <int PENDING> __device__ __forceinline__ void copies_wait() {{
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
}}

__device__ __forceinline__ void block_sync() {{
#if W == 1
    __syncwarp();
#else
    __syncthreads();
#endif
}}

__device__ __forceinline__ float tree_sum(const float* a) {{
#if ACC == 8
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
#elif ACC == 4
    return (a[0] + a[1]) + (a[2] + a[3]);
#else
    return a[0];
#endif
}}

__device__ __forceinline__ float lanes_sum(float x) {{
    #pragma unroll
    for (int m = 1; m < L; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);  // a + b == b + a: every lane alike
    return x;
}}

struct ring {{  // raw copies of DEPTH tokens: q and k, the block's v columns, the 4-byte words holding g and beta
    __align__(16) in_t qk[DEPTH][2 * K];
    __align__(16) in_t v[DEPTH][BV];
    unsigned int g[DEPTH];
    unsigned int b[DEPTH];
}};

// the 4-byte-aligned word holding element i of a 2- or 4-byte array (its base is aligned: torch allocates so)
template <typename T> __device__ __forceinline__ const void* word_of(const T* p, long long i) {{
    return (const void*)((unsigned long long)(p + i) & ~3ull);
}}
template <int BYTES> __device__ __forceinline__ unsigned int half_of(unsigned int word, long long i) {{
    return BYTES == 4 ? word : (word >> ((i & 1) * 16)) & 0xffffu;
}}
__device__ __forceinline__ float g_of(unsigned int word, long long i) {{
#if G_BYTES == 4
    return G_TO_F32(__uint_as_float(word));
#else
    return G_TO_F32((unsigned short)half_of<2>(word, i));
#endif
}}
__device__ __forceinline__ float b_of(unsigned int word, long long i) {{
#if B_BYTES == 4
    return B_TO_F32(__uint_as_float(word));
#else
    return B_TO_F32((unsigned short)half_of<2>(word, i));
#endif
}}

// issues token t's copies into ring slot `slot`, one commit group per token (every thread commits)
__device__ __forceinline__ void issue(ring& r, int slot, const in_t* __restrict__ q, const in_t* __restrict__ k,
                                      const in_t* __restrict__ v, const g_t* __restrict__ g,
                                      const b_t* __restrict__ beta, long long t, int hk, int h, int col0, int tid) {{
    const long long row = (t * HK + hk) * (long long)K;
    #pragma unroll
    for (int s = 0; s < (QK_CHUNKS + THREADS - 1) / THREADS; ++s) {{  // a fixed count: no loop left in the code
        const int c = tid + s * THREADS;
        const int e = c * (16 / IN_BYTES);
        if (c < QK_CHUNKS) copy_async<16>(&r.qk[slot][e], e < K ? q + row + e : k + row + (e - K));
    }}
    const int e = tid - (THREADS - V_CHUNKS - 2);  // the block's last threads: v's chunks, then g and beta
    if (e >= 0 && e < V_CHUNKS) copy_async<V_COPY>(&r.v[slot][e * (V_COPY / IN_BYTES)],
                                                   v + (t * HV + h) * V + col0 + e * (V_COPY / IN_BYTES));
    if (e == V_CHUNKS) copy_async<4>(&r.g[slot], word_of(g, t * HV + h));
    if (e == V_CHUNKS + 1) copy_async<4>(&r.b[slot], word_of(beta, t * HV + h));
    copies_commit();
}}

// a ring slot's q (times scale, as the reference: (q * scale) in fp32) and k into fp32 buffer b
__device__ __forceinline__ void convert(const ring& r, int slot, float (*qs)[K], float (*ks)[K], int b, int tid,
                                        float scale) {{
    #pragma unroll
    for (int s = 0; s < ((2 * K) / 8 + THREADS - 1) / THREADS; ++s) {{
        const int c = tid + s * THREADS;
        if (c >= (2 * K) / 8) break;
        const int e = c * 8;
        float x[8];
#if IN_BYTES == 2
        const uint4 w = *(const uint4*)&r.qk[slot][e];
        const unsigned int ws[4] = {{w.x, w.y, w.z, w.w}};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {{
            x[2 * i] = IN_TO_F32((unsigned short)(ws[i] & 0xffffu));
            x[2 * i + 1] = IN_TO_F32((unsigned short)(ws[i] >> 16));
        }}
#else
        const float4 a = *(const float4*)&r.qk[slot][e];
        const float4 c4 = *(const float4*)&r.qk[slot][e + 4];
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = c4.x; x[5] = c4.y; x[6] = c4.z; x[7] = c4.w;
#endif
        if (e < K) {{
            #pragma unroll
            for (int i = 0; i < 8; ++i) x[i] *= scale;
            *(float4*)&qs[b][e] = make_float4(x[0], x[1], x[2], x[3]);
            *(float4*)&qs[b][e + 4] = make_float4(x[4], x[5], x[6], x[7]);
        }} else {{
            *(float4*)&ks[b][e - K] = make_float4(x[0], x[1], x[2], x[3]);
            *(float4*)&ks[b][e - K + 4] = make_float4(x[4], x[5], x[6], x[7]);
        }}
    }}
}}

extern "C" __global__ void __launch_bounds__(THREADS)
{NAME}(const in_t* __restrict__ q, const in_t* __restrict__ k, const in_t* __restrict__ v,
       const g_t* __restrict__ g, const b_t* __restrict__ beta, in_t* __restrict__ o,
       const float* __restrict__ h0, const idx_t* __restrict__ start, const idx_t* __restrict__ len,
       const idx_t* __restrict__ index, double scale_arg) {{
    // blocks ordered (row, head, tile), tiles fastest: one question's blocks are neighbours in launch order, so
    // the few active rows of a bucket spread over the SMs instead of clustering between spare rows
    const int row = blockIdx.x / (HV * TILES);
    const int h = (blockIdx.x / TILES) % HV;
    const int tile = blockIdx.x % TILES;
    const long long n = (long long)len[row];
    if (n <= 0) return;  // a capacity row without a branch
    const int hk = h / (HV / HK);  // grouped value heads: value head h reads key head h / (HV / HK)
    const long long bos = (long long)start[row];
    const long long last = bos + n - 1;  // tokens past the question are clamped to its last (in bounds, unused)
    const long long idx = (long long)index[row];
    const float scale = (float)scale_arg;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int part = lane % L;  // which of the column's key groups this lane holds
    const int col0 = tile * BV;
    const int col = col0 + (tid >> 5) * CPW + lane / L;
    __shared__ ring r;
    // three fp32 buffers: step t reads tokens t and t + 1 and writes token t + 2
    __shared__ __align__(16) float qs[3][K];
    __shared__ __align__(16) float ks[3][K];

    #pragma unroll
    for (int x = 0; x < DEPTH; ++x) issue(r, x, q, k, v, g, beta, min(bos + x, last), hk, h, col0, tid);

    // state register j holds key ((j / 4) * L + part) * 4 + j % 4 of column col: the L lanes of a column read
    // neighbouring float4s of q and k, distinct banks
    float S[KPL];
    if (idx >= 0) {{
        const float* p = h0 + ((idx * HV + h) * (long long)K) * V + col;
        #pragma unroll
        for (int j = 0; j < KPL; ++j) S[j] = p[(long long)(((j / 4) * L + part) * 4 + j % 4) * V];
    }} else {{
        #pragma unroll
        for (int j = 0; j < KPL; ++j) S[j] = 0.f;
    }}

    copies_wait<DEPTH - 3>();  // tokens 0, 1 and 2
    block_sync();
    convert(r, 0, qs, ks, 0, tid, scale);
    convert(r, 1, qs, ks, 1, tid, scale);
    const long long t1 = min(bos + 1, last);
    float v_next = IN_TO_F32(r.v[1][col - col0]);  // token t + 1's v, g, beta (step t's)
    float g_next = g_of(r.g[1], t1 * HV + h);
    float b_next = b_of(r.b[1], t1 * HV + h);
    const float v0 = IN_TO_F32(r.v[0][col - col0]);
    const float decay0 = expf(g_of(r.g[0], bos * HV + h));
    const float b0 = b_of(r.b[0], bos * HV + h);
    block_sync();

    // prologue: token 0's decay and its sum against k
    float acc_k[ACC], acc_q[ACC];
#if LAZY
    float c_scale = decay0;  // the state is c_scale * S (lazy decay)
#endif
    #pragma unroll
    for (int a = 0; a < ACC; ++a) acc_k[a] = 0.f;
    #pragma unroll
    for (int j4 = 0; j4 < GROUPS; ++j4) {{
        const float4 kk = *(const float4*)&ks[0][(j4 * L + part) * 4];
        const float kx[4] = {{kk.x, kk.y, kk.z, kk.w}};
        #pragma unroll
        for (int c = 0; c < 4; ++c) {{
            const int j = j4 * 4 + c;
#if !LAZY
            S[j] *= decay0;
#endif
            acc_k[j % ACC] = fmaf(S[j], kx[c], acc_k[j % ACC]);
        }}
    }}
#if LAZY
    float delta = (v0 - c_scale * lanes_sum(tree_sum(acc_k))) * b0;
    if (c_scale < LAZY_FLOOR) {{  // uniform over the block: every thread computed the same c_scale
        #pragma unroll
        for (int j = 0; j < KPL; ++j) S[j] *= c_scale;
        c_scale = 1.f;
    }}
#else
    float delta = (v0 - lanes_sum(tree_sum(acc_k))) * b0;
#endif

    // Step t: first the staging of later tokens, off the chain (token t + 2's raw copies, visible since the last
    // barrier, into the fp32 buffer step t + 1 reads, and its v / g / beta into registers; token t + DEPTH's copies
    // issued into token t's ring slot, converted two steps ago). Then one pass over the state: token t's rank-1
    // update and the new state's sum against q (token t's output), then token t + 1's decay and the decayed state's
    // sum against k (token t + 1's delta): the two sums of a step side by side, one reduction latency a token. The
    // last step's token t + 1 is a clamped copy whose decay and delta nobody reads (no final state is stored).
    // One barrier a step: after it, token t + 2's fp32 buffer and token t + 3's raw copies are every thread's.
    int cur = 0, slot = 0;  // token t's fp32 buffer and ring slot
    for (long long i = 0; i < n; ++i) {{
        const int nxt = cur == 2 ? 0 : cur + 1;
        const int after = nxt == 2 ? 0 : nxt + 1;
        const long long t = bos + i;
        const int slot2 = slot + 2 >= DEPTH ? slot + 2 - DEPTH : slot + 2;
        const long long t2 = min(t + 2, last);
        convert(r, slot2, qs, ks, after, tid, scale);
        const float v_after = IN_TO_F32(r.v[slot2][col - col0]);
        const float g_after = g_of(r.g[slot2], t2 * HV + h);
        const float b_after = b_of(r.b[slot2], t2 * HV + h);
        issue(r, slot, q, k, v, g, beta, min(t + DEPTH, last), hk, h, col0, tid);

        const float decay = expf(g_next);
#if LAZY
        const float u = delta / c_scale;  // the update of S, whose state c_scale * S moves by k * delta
#endif
        #pragma unroll
        for (int a = 0; a < ACC; ++a) {{ acc_k[a] = 0.f; acc_q[a] = 0.f; }}
        #pragma unroll
        for (int j4 = 0; j4 < GROUPS; ++j4) {{
            const int at = (j4 * L + part) * 4;
            const float4 kk = *(const float4*)&ks[cur][at];
            const float4 qq = *(const float4*)&qs[cur][at];
            const float4 kn = *(const float4*)&ks[nxt][at];
            const float kx[4] = {{kk.x, kk.y, kk.z, kk.w}};
            const float qx[4] = {{qq.x, qq.y, qq.z, qq.w}};
            const float nx[4] = {{kn.x, kn.y, kn.z, kn.w}};
            #pragma unroll
            for (int c = 0; c < 4; ++c) {{
                const int j = j4 * 4 + c;
#if LAZY
                S[j] = fmaf(kx[c], u, S[j]);
                acc_q[j % ACC] = fmaf(S[j], qx[c], acc_q[j % ACC]);
#else
                S[j] = fmaf(kx[c], delta, S[j]);
                acc_q[j % ACC] = fmaf(S[j], qx[c], acc_q[j % ACC]);
                S[j] *= decay;
#endif
                acc_k[j % ACC] = fmaf(S[j], nx[c], acc_k[j % ACC]);
            }}
        }}
#if LAZY
        const float out = c_scale * lanes_sum(tree_sum(acc_q));
        c_scale *= decay;
        delta = (v_next - c_scale * lanes_sum(tree_sum(acc_k))) * b_next;
        if (c_scale < LAZY_FLOOR) {{  // fold the scale in before it underflows (uniform over the block)
            #pragma unroll
            for (int j = 0; j < KPL; ++j) S[j] *= c_scale;
            c_scale = 1.f;
        }}
#else
        const float out = lanes_sum(tree_sum(acc_q));
        delta = (v_next - lanes_sum(tree_sum(acc_k))) * b_next;
#endif
        if (part == 0) o[(t * HV + h) * V + col] = F32_TO_IN(out);
        v_next = v_after;
        g_next = g_after;
        b_next = b_after;
        slot = slot + 1 == DEPTH ? 0 : slot + 1;
        cur = nxt;
        copies_wait<DEPTH - 3>();  // token t + 3's copies (this thread's) have landed
        block_sync();
    }}
}}
"""

NAME = "flide_gdn_questions"


def source(K: int, V: int, HK: int, HV: int, dtype: torch.dtype, g_dtype: torch.dtype, beta_dtype: torch.dtype,
           index_dtype: torch.dtype, lanes: int = LANES_K, warps: int = WARPS, lazy: bool | None = None) -> str:
    """The kernel's CUDA C for one shape, dtype set and tile (checked: `tile_error`)."""
    error = tile_error(K, V, HK, HV, lanes, warps)
    if error:
        raise ValueError(error)
    for name, dt in (("q/k/v", dtype), ("g", g_dtype), ("beta", beta_dtype)):
        if dt not in _TYPES:
            raise ValueError(f"the CUDA question kernel takes {name} in {', '.join(map(str, _TYPES))}, got {dt}")
    if index_dtype not in _INDEX_TYPES:
        raise ValueError(f"the CUDA question kernel takes int32 or int64 segment tables, got {index_dtype}")
    in_t, in_load, in_store = _TYPES[dtype]
    lazy = LAZY_DECAY if lazy is None else lazy
    return _SOURCE.format(
        K=K, V=V, HK=HK, HV=HV, L=lanes, W=warps, ACC=ACCUMULATORS, DEPTH=DEPTH, LAZY=int(lazy), NAME=NAME, IN_T=in_t,
        G_T=_TYPES[g_dtype][0], B_T=_TYPES[beta_dtype][0], IDX_T=_INDEX_TYPES[index_dtype],
        IN_TO_F32=in_load.format(x="x"), F32_TO_IN=in_store.format(x="x"), G_TO_F32=_TYPES[g_dtype][1].format(x="x"),
        B_TO_F32=_TYPES[beta_dtype][1].format(x="x"), IN_BYTES=dtype.itemsize, G_BYTES=g_dtype.itemsize,
        B_BYTES=beta_dtype.itemsize)


def tile_error(K: int, V: int, HK: int, HV: int, lanes: int, warps: int) -> str | None:
    """Why (lanes along K, warps) cannot tile this shape, or None."""
    if lanes not in (1, 2, 4, 8):
        return f"lanes along K must be 1, 2, 4 or 8, got {lanes}"
    if warps not in (1, 2, 4, 8):
        return f"warps must be 1, 2, 4 or 8, got {warps}"
    if K % 8 or K % (4 * lanes):
        return f"K={K} must be a multiple of 8 and of 4 keys a lane ({lanes} lanes along K)"
    if V % (warps * 32 // lanes):
        return f"V={V} is not a multiple of the block's {warps * 32 // lanes} value columns"
    if HK <= 0 or HV % HK:
        return f"value heads ({HV}) must be a multiple of key heads ({HK})"
    return None


def pick_tile(K: int, V: int, HK: int, HV: int) -> tuple[int, int, bool] | None:
    """The default tile, with fewer warps where the block's columns would not divide V (tiny test models: V = 16);
    None where no tile fits (the Triton kernel runs those)."""
    for warps in (WARPS, 4, 2, 1):
        if warps <= WARPS and tile_error(K, V, HK, HV, LANES_K, warps) is None:
            return LANES_K, warps, LAZY_DECAY
    return None


def supports(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether this kernel takes these inputs with its default tile (else the Triton kernel runs them)."""
    _, HK, K = q.shape
    return (q.is_cuda and q.dtype == v.dtype and q.dtype in _TYPES and g.dtype in _TYPES and beta.dtype in _TYPES
            and index.dtype in _INDEX_TYPES and pick_tile(K, v.shape[2], HK, v.shape[1]) is not None)


# compiled kernels of this process by (K, V, HK, HV, dtypes, tile, device), the one cache of them: a module lives in
# one device's context; also what ran (the engine test reads it)
COMPILED: dict[tuple, object] = {}


def _aligned(x: torch.Tensor, to: int) -> torch.Tensor:
    """x contiguous, its data `to`-byte aligned (a view at an odd offset is copied): the asynchronous copies move
    16-byte chunks of q / k / v rows and 4-byte words of g / beta."""
    x = x.contiguous()
    return x if x.data_ptr() % to == 0 else x.clone()


def branches_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  seg_start: torch.Tensor, seg_len: torch.Tensor, initial_state: torch.Tensor,
                  initial_index: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  tiles: tuple[int, ...] | None = None) -> torch.Tensor:
    """o [T, Hv, V] (q's dtype) of every segment from `initial_state[initial_index[n]]` (-1: zero), as
    `branches.branches` without normalisation, final states or snapshots; rows outside the segments unwritten.
    q, k must already be normalised where the model normalises them. `tiles`: (lanes along K, warps[, lazy decay]);
    default `pick_tile`."""
    from .. import cuda_rtc

    T, HK, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    tile = (*tiles, LAZY_DECAY)[:3] if tiles is not None else pick_tile(K, V, HK, HV)
    if tile is None:
        raise ValueError(f"no tile of the CUDA question kernel fits K={K}, V={V}, Hk={HK}, Hv={HV}")
    lanes, warps, lazy = tile
    tables = (seg_start, seg_len, initial_index)
    if len({t.dtype for t in tables}) != 1:
        raise ValueError(f"segment tables of one dtype, got {[t.dtype for t in tables]}")
    q, k, v = (_aligned(x, 16) for x in (q, k, v))
    g, beta = _aligned(g, 4), _aligned(beta, 4)
    o = torch.empty(T, HV, V, dtype=q.dtype, device=q.device) if out is None else out
    if out is not None and (not out.is_contiguous() or out.shape != (T, HV, V) or out.dtype != q.dtype):
        raise ValueError(f"`out` must be a contiguous {q.dtype} [T, Hv, V] tensor, got {out.dtype} {tuple(out.shape)}")
    N = seg_start.shape[0]
    if N == 0 or T == 0:
        return o
    if initial_state.shape[0] == 0:  # no state to read: a dummy pointer that no program loads (every index is -1)
        initial_state = torch.zeros(1, HV, K, V, dtype=torch.float32, device=q.device)
    h0 = initial_state.float().contiguous()
    key = (K, V, HK, HV, q.dtype, g.dtype, beta.dtype, seg_start.dtype, lanes, warps, bool(lazy), q.device)
    with torch.cuda.device(q.device):  # the module is loaded into, and launched on, q's device
        kernel = COMPILED.get(key)
        if kernel is None:
            major, minor = torch.cuda.get_device_capability(q.device)
            kernel = COMPILED[key] = cuda_rtc.load(source(*key[:-1]), NAME, f"sm_{major}{minor}")
        kernel(grid=(N * HV * (V // (warps * 32 // lanes)), 1, 1), block=(warps * 32, 1, 1),
               args=[q, k, v, g, beta, o, h0, *(t.contiguous() for t in tables), float(scale)])
    return o
