"""The `fla` variant of the gated delta rule (flide::gated_delta_fla) against the reference, through the two-call
fork over level-major rounds (odd segment lengths, many segments, fp32 and bf16), and replayed inside a CUDA graph
with other rounds."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from flide.ops.gated_delta import BRANCH_KERNELS
from flide.ops.gated_delta import fork as plain_fork
from flide.ops.registry import resolve
from flide.testing import random_round_tensors

# fla's Triton dots run in tf32 for fp32 inputs; bf16 inputs keep bf16 intermediates
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def inputs(tokens: int, dtype, seed: int, hk: int = 4, hv: int = 8, d: int = 128, longest: int = 70):
    rng = random.Random(seed)
    r = random_round_tensors(rng, tokens, max_requests=8, max_questions=12, max_state=700, max_question=longest)
    r = r.to("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(tokens, hk, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    v = torch.randn(tokens, hv, d, device="cuda", generator=g).to(dtype)
    decay = -F.softplus(torch.randn(tokens, hv, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(tokens, hv, device="cuda", generator=g)).to(dtype)
    return (q, k, v, decay, beta), r


def kernel(variant):
    return resolve("gated_delta", variant)


def fork(delta, *args):
    """The fork as the model layers run it: with the variant's question kernel where it has one (fla: ours)."""
    return plain_fork(delta, *args, branch_kernel=BRANCH_KERNELS.get(delta))


def run_fork(variant, x, r):
    return fork(kernel(variant), *x, r.state_start, r.state_len, r.branch_start, r.branch_len,
                r.branch_state, 128 ** -0.5, True)


def fork_from_tables(x, r):
    """((o, finals), tables): the `fla` fork's state call from the round's tables (`fork_tables`), as the model's GDN
    layers run it, with fla's module switches as the caller set them."""
    from flide.ops.gated_delta import STATE_KERNELS, fork_tables

    delta = kernel("fla")
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                         branch_state=r.branch_state)
    return plain_fork(delta, *x, r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state,
                      128 ** -0.5, True, branch_kernel=BRANCH_KERNELS[delta], state_kernel=STATE_KERNELS[delta],
                      tables=tables), tables


@pytest.mark.parametrize("variant", ["fla", "fla_cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [64, 130, 500, 3600])
@pytest.mark.parametrize("seed", [0, 1])
def test_fla_fork_matches_reference(tokens, dtype, seed, variant):
    x, r = inputs(tokens, dtype, seed * 7 + tokens)
    ref_o, ref_final = run_fork("reference", tuple(t.float() for t in x), r)
    o, final = run_fork(variant, x, r)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_err(o, ref_o) < TOL[dtype]
    used = r.state_len > 0
    assert rel_err(final[used], ref_final[used]) < TOL[dtype]
    pad = torch.arange(tokens, device="cuda") >= int((r.branch_start + r.branch_len).max())
    assert (o[pad] == 0).all()


@pytest.mark.parametrize("tokens", [500, 3600])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
def test_fla_fork_at_pinned_heads_matches_reference(tokens, heads):
    """bf16 at Qwen3.5's head counts, where fla's kernels run the configs pinned on sm_90 (`fla.SM90_CONFIGS`, one
    table per value-head count; the kkt + solve kernel's 1-warp launch on the 3,600-token stream at 16 heads)."""
    from flide.ops.gated_delta import fla as fla_module

    x, r = inputs(tokens, torch.bfloat16, seed=tokens + heads[1], hk=heads[0], hv=heads[1])
    ref_o, ref_final = run_fork("reference", tuple(t.float() for t in x), r)
    o, final = run_fork("fla", x, r)
    if torch.cuda.get_device_capability() == (9, 0):
        assert fla_module.autotuner(fla_module._kkt_kernel()).flide_pinned[heads[1]] is not None
    assert rel_err(o, ref_o) < TOL[torch.bfloat16]
    used = r.state_len > 0
    assert rel_err(final[used], ref_final[used]) < TOL[torch.bfloat16]


def test_fla_fork_replays_in_a_cuda_graph_with_other_rounds():
    tokens = 2048
    x, r = inputs(tokens, torch.bfloat16, seed=11)
    meta = [r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state]
    static = [t.clone() for t in (*x, *meta)]
    fla = kernel("fla")

    def step():
        return fork(fla, *static, 128 ** -0.5, True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, final = step()
    for seed in (12, 13, 14):
        x2, r2 = inputs(tokens, torch.bfloat16, seed=seed)
        for buffer, value in zip(static, (*x2, r2.state_start, r2.state_len, r2.branch_start, r2.branch_len,
                                          r2.branch_state)):
            buffer.copy_(value)
        graph.replay()
        eager_o, eager_final = fork(fla, *x2, r2.state_start, r2.state_len, r2.branch_start, r2.branch_len,
                                    r2.branch_state, 128 ** -0.5, True)
        assert torch.equal(o, eager_o)
        assert torch.equal(final, eager_final)


def segments_round(state_lens, branch_lens, branch_state, capacity_states, capacity_branches):
    """Level-major metadata by hand: the states, then the branches, the stream filled to its last row."""
    starts, at = [], 0
    for n in list(state_lens) + list(branch_lens):
        starts.append(at)
        at += n
    ns = len(state_lens)

    def table(values, capacity, fill):
        return torch.tensor(list(values) + [fill] * (capacity - len(values)), device="cuda")

    return at, {"state_start": table(starts[:ns], capacity_states, at),
                "state_len": table(state_lens, capacity_states, 0),
                "branch_start": table(starts[ns:], capacity_branches, at),
                "branch_len": table(branch_lens, capacity_branches, 0),
                "branch_state": table(branch_state, capacity_branches, 0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_fork_odd_lengths_stream_full_to_the_end(dtype):
    # states of 1, 63, 64, 65, 500 and 3,600 tokens, questions of 1, 63, 64, 65 tokens; no padding row after the
    # last segment, and one unused row in each table
    tokens, meta = segments_round([1, 63, 64, 65, 500, 3600], [1, 63, 64, 65, 40, 1, 7], [0, 1, 2, 3, 4, 5, 5], 7, 8)
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k = (torch.randn(tokens, 4, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    v = torch.randn(tokens, 8, 128, device="cuda", generator=g).to(dtype)
    decay = -F.softplus(torch.randn(tokens, 8, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(tokens, 8, device="cuda", generator=g)).to(dtype)
    args = (meta["state_start"], meta["state_len"], meta["branch_start"], meta["branch_len"], meta["branch_state"])
    ref_o, ref_final = fork(kernel("reference"), q.float(), k.float(), v.float(), decay, beta.float(), *args,
                            128 ** -0.5, True)
    o, final = fork(kernel("fla"), q, k, v, decay, beta, *args, 128 ** -0.5, True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_err(o, ref_o) < TOL[dtype]
    assert rel_err(final[:6], ref_final[:6]) < TOL[dtype]
    for start, n in [(0, 1), (1, 63), (64, 64), (128, 65)]:  # every state on its own too, short ones included
        assert rel_err(o[start:start + n], ref_o[start:start + n]) < TOL[dtype]


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
def test_branch_kernel_matches_reference_at_qwen_shapes(dtype, heads, form):
    """The question call (flide/ops/gated_delta/branches.py) alone at Qwen3.5's head shapes (0.8B: 16/16; 9B: 16/32;
    K = V = 128): each branch from its state's final state by index, spare capacity rows of length 0, every question
    row written (NaN-poisoned output), in both forms. fp32 has no tf32 in either (the chunked form's dots are
    `ieee`): within 1e-5."""
    from flide.ops.gated_delta import branches

    hk, hv = heads
    tokens, meta = segments_round([1, 63, 64, 65, 500], [1, 63, 64, 65, 40, 1, 7, 130], [0, 1, 2, 3, 4, 4, 0, 2],
                                  6, 12)
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k = (torch.randn(tokens, hk, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    v = torch.randn(tokens, hv, 128, device="cuda", generator=g).to(dtype)
    decay = -F.softplus(torch.randn(tokens, hv, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(tokens, hv, device="cuda", generator=g)).to(dtype)
    finals = torch.randn(6, hv, 128, 128, device="cuda", generator=g) * 0.1
    args = (meta["branch_start"], meta["branch_len"], finals, meta["branch_state"], 128 ** -0.5, True)
    ref_o, _ = kernel("reference")(q.float(), k.float(), v.float(), decay, beta.float(), *args)
    out = torch.full((tokens, hv, 128), float("nan"), dtype=dtype, device="cuda")
    o = branches.branches(q, k, v, decay, beta, *args, out=out, form=form)
    first = int(meta["branch_start"][0])
    assert torch.isfinite(o[first:]).all() and o[:first].isnan().all()  # question rows written, state rows not
    assert rel_err(o[first:], ref_o[first:]) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("row_programs", [1, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_branch_kernel_row_programs_keep_the_bits(dtype, row_programs):
    """The recurrent question kernel with P programs per (value head, V tile) looping over the rows gives the
    program-per-row kernel's outputs bit for bit at Qwen3.5-0.8B's shapes, spare rows of length 0 included."""
    from flide.ops.gated_delta import branches

    tokens, meta = segments_round([1, 63, 64, 65, 500], [1, 63, 64, 65, 40, 1, 7, 130], [0, 1, 2, 3, 4, 4, 0, 2],
                                  6, 12)
    g = torch.Generator(device="cuda").manual_seed(23)
    q, k = (torch.randn(tokens, 16, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    v = torch.randn(tokens, 16, 128, device="cuda", generator=g).to(dtype)
    decay = -F.softplus(torch.randn(tokens, 16, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(tokens, 16, device="cuda", generator=g)).to(dtype)
    finals = torch.randn(6, 16, 128, 128, device="cuda", generator=g) * 0.1
    args = (q, k, v, decay, beta, meta["branch_start"], meta["branch_len"], finals, meta["branch_state"],
            128 ** -0.5, True)
    first = int(meta["branch_start"][0])
    one = branches.branches(*args, tiles=(16, 1, 0))[first:]
    looped = branches.branches(*args, tiles=(16, 1, row_programs))[first:]
    assert torch.isfinite(one).all() and torch.equal(looped, one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2norm_matches_torch_and_keeps_row_bits_in_any_stream(dtype):
    """The q/k normalisation before fla's state call (flide/ops/gated_delta/l2norm.py): within rounding of torch,
    and a token's rows have the same bits in a stream of 100 or of 9,000 tokens (fla's own, autotuned per stream
    size class, need not)."""
    from flide.ops.gated_delta.l2norm import l2norm

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(9000, 16, 128, device="cuda", generator=g).to(dtype)
    y = l2norm(x)
    want = (x.float() / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)).to(dtype)
    assert rel_err(y, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(l2norm(x[4000:4100]), y[4000:4100])


def test_branch_op_opcheck_on_cuda():
    """The question call's custom op (flide::gated_delta_branches_triton): its fake impl, schema and no aliasing,
    as torch.compile relies on them. Not the AOT-dispatch checks: they compare whole outputs of two runs, and the
    op leaves rows outside its segments unwritten by contract (`combine` selects the rows each call owns)."""
    from flide.ops.gated_delta import gated_delta_branches_triton

    x, r = inputs(130, torch.bfloat16, seed=4)
    q, k, v, decay, beta = x
    finals = torch.randn(r.state_start.shape[0], v.shape[1], 128, 128, device="cuda") * 0.1
    torch.library.opcheck(gated_delta_branches_triton, (q, k, v, decay, beta, r.branch_start, r.branch_len, finals,
                                                         r.branch_state, 128 ** -0.5, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fork_from_round_tables_equals_fork_without(dtype):
    """The model's path (flide/models/flat.py): the state call from the round's tables (`fork_tables`, derived once
    per forward: cu_seqlens, the round's state_chunks, fla's chunk offsets, the spans' ends), whose normalised q/k
    the question call then reads as they are: the states' rows and final states with the bits of the call that
    derives its tables itself, the questions' rows within rounding of it (normalised by l2norm.py instead of inside
    the question kernel), and both matching the reference."""
    from flide.ops.gated_delta import STATE_KERNELS, fork_tables

    fla = kernel("fla")
    x, r = inputs(3072, dtype, seed=17)
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, r.branch_chunks,
                         branch_state=r.branch_state)
    o, finals = fork(fla, *x, *meta, 128 ** -0.5, True)
    o_t, finals_t = plain_fork(fla, *x, *meta, 128 ** -0.5, True, branch_kernel=BRANCH_KERNELS.get(fla),
                               state_kernel=STATE_KERNELS[fla], tables=tables)
    used = r.state_len > 0  # the state call from the tables leaves empty states' final rows unwritten (never read)
    assert torch.equal(finals_t[used], finals[used])
    states = torch.arange(o.shape[0], device="cuda") < int(r.state_start[0] + r.state_len.sum())
    assert torch.equal(o_t[states], o[states])
    assert rel_err(o_t[~states], o[~states]) < (1e-6 if dtype == torch.float32 else 1e-2)
    ref_o, _ = plain_fork(kernel("reference"), *(t.float() if t.is_floating_point() else t for t in x), *meta,
                          128 ** -0.5, True)
    assert rel_err(o_t, ref_o) < TOL[dtype]


@pytest.mark.parametrize("tokens", [512, 3072], ids=["fused-chain", "split-call"])
def test_fork_from_round_tables_starts_questions_of_empty_states_from_zero(tokens):
    """Requests laid out without a trunk (an empty state, as the `full` prompt mode lays them out) among others: the
    state call from the tables leaves empty states' final rows unwritten (`state_chain(empty_finals=False)`: in both
    the fused chain and the split call), and their questions start from zero (`ForkTables.branch_from`), so every
    question row still matches the reference fork, and the questions of empty states are the same whatever else is
    in the round."""
    from flide.ops.gated_delta import STATE_KERNELS, fork_tables
    from flide.round import Shape, build_round
    from flide.testing import synthetic_request

    rng = random.Random(tokens)
    words = lambda n: [rng.randrange(1000) for _ in range(n)]  # noqa: E731
    long = 1500 if tokens > 1024 else 200
    requests = [synthetic_request([], [words(40)]), synthetic_request(words(long), [words(30), words(50)]),
                synthetic_request([], [words(20), words(60)]), synthetic_request(words(90), [words(10)])]
    r = build_round(requests, Shape(tokens, tokens // 64, tokens // 16, tokens // 16, 2), pad_id=0).tensors.to("cuda")
    g = torch.Generator(device="cuda").manual_seed(tokens)
    q, k = (torch.randn(tokens, 4, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    v = torch.randn(tokens, 8, 128, device="cuda", generator=g).bfloat16()
    decay = -F.softplus(torch.randn(tokens, 8, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(tokens, 8, device="cuda", generator=g)).bfloat16()
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    fla = kernel("fla")
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                         branch_state=r.branch_state)
    assert (tables.branch_from[:5] == torch.tensor([-1, 1, 1, -1, -1], device="cuda")).all()
    o, _ = plain_fork(fla, q, k, v, decay, beta, *meta, 128 ** -0.5, True, branch_kernel=BRANCH_KERNELS[fla],
                      state_kernel=STATE_KERNELS[fla], tables=tables)
    ref_o, _ = plain_fork(kernel("reference"), q.float(), k.float(), v.float(), decay, beta.float(), *meta,
                          128 ** -0.5, True)
    end = int(r.branch_start[0] + r.branch_len.sum())
    assert rel_err(o[:end], ref_o[:end]) < TOL[torch.bfloat16]
    # the first request's question alone in a round: the same bits (an empty state's question reads no final row)
    alone = build_round(requests[:1], Shape(tokens, tokens // 64, tokens // 16, tokens // 16, 2),
                        pad_id=0).tensors.to("cuda")
    n = int(alone.branch_len[0])
    lo = int(r.branch_start[0])
    rows = lambda x: torch.cat([x[lo:lo + n], x[n:]])  # noqa: E731  the question's rows first, the rest after
    xa = [rows(x) if x.shape[0] == tokens else x for x in (q, k, v, decay, beta)]
    alone_tables = fork_tables(alone.state_start, alone.state_len, alone.branch_start, alone.branch_len,
                               alone.state_chunks, branch_state=alone.branch_state)
    o_alone, _ = plain_fork(fla, *xa, alone.state_start, alone.state_len, alone.branch_start, alone.branch_len,
                            alone.branch_state, 128 ** -0.5, True, branch_kernel=BRANCH_KERNELS[fla],
                            state_kernel=STATE_KERNELS[fla], tables=alone_tables)
    assert int(alone.branch_start[0]) == 0 and torch.equal(o_alone[:n], o[lo:lo + n])


@pytest.mark.parametrize("variant", ["fla", "fla_wy", "fla_cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fork_reads_qkv_slices_with_the_bits_of_contiguous_copies(dtype, variant):
    """The model passes q, k and v as column slices of the conv's [T, 2 K Hk + V Hv] output (flide/models/layers.py):
    the state call lays them out in one launch that normalises q and k (`prepare_qkv`), with the bits that contiguous
    copies get, and so every row and final state of the fork; the question call reads the state call's q, k, v."""
    from flide.ops.gated_delta import STATE_KERNELS, WY_KERNELS, fork_tables

    delta = kernel(variant)
    (q, k, v, decay, beta), r = inputs(2048, dtype, seed=21)
    T, hk, d = q.shape
    wide = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], 1)
    q_slice, k_slice = wide[:, :hk * d].view(T, hk, d), wide[:, hk * d:2 * hk * d].view(T, hk, d)
    v_slice = wide[:, 2 * hk * d:].view(T, -1, d)
    assert not q_slice.is_contiguous() and not v_slice.is_contiguous()
    assert torch.equal(q_slice, q) and torch.equal(k_slice, k) and torch.equal(v_slice, v)
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    wy = delta in WY_KERNELS
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                         r.branch_chunks if wy else None, branch_state=r.branch_state)
    kwargs = dict(branch_kernel=BRANCH_KERNELS.get(delta), state_kernel=STATE_KERNELS[delta], tables=tables, wy=wy)
    o, finals = plain_fork(delta, q, k, v, decay, beta, *meta, 128 ** -0.5, True, **kwargs)
    o_s, finals_s = plain_fork(delta, q_slice, k_slice, v_slice, decay, beta, *meta, 128 ** -0.5, True, **kwargs)
    used = r.state_len > 0  # empty states' final rows: unwritten by the state call from the tables
    assert torch.equal(finals_s[used], finals[used]) and torch.equal(o_s, o)


@pytest.mark.parametrize("variant", ["fla", "fla_cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_laid_out_fork_equals_the_fork_that_lays_out_itself(dtype, variant):
    """The fork on q, k (normalised) and v already laid out (`fork_parts(laid_out=True)` with the variant's
    `LAID_OUT_STATE_KERNELS` op: what the GDN layer runs after the fused conv) has the bits of the fork that lays them
    out itself (the state call's `prepare_qkv`) given the same laid-out values, every row and final state; the laid-
    out state op passes opcheck."""
    from flide.ops.gated_delta import LAID_OUT_STATE_KERNELS, STATE_KERNELS, fork_parts, fork_tables
    from flide.ops.gated_delta.l2norm import prepare_qkv
    from flide.ops.gated_norm.reference import select_rows

    delta = kernel(variant)
    (q, k, v, decay, beta), r = inputs(2048, dtype, seed=27)
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                         branch_state=r.branch_state)
    o, finals = plain_fork(delta, q, k, v, decay, beta, *meta, 128 ** -0.5, True,
                           branch_kernel=BRANCH_KERNELS.get(delta), state_kernel=STATE_KERNELS[delta], tables=tables)
    qn, kn, vn = prepare_qkv(q, k, v, True)
    parts = fork_parts(delta, qn, kn, vn, decay, beta, *meta, 128 ** -0.5, False,
                       branch_kernel=BRANCH_KERNELS.get(delta), state_kernel=LAID_OUT_STATE_KERNELS[delta],
                       tables=tables, laid_out=True)
    used = r.state_len > 0  # empty states' final rows: unwritten by the state call from the tables
    assert torch.equal(parts.finals[used], finals[used])
    assert torch.equal(select_rows(*parts[:5]), o)
    torch.library.opcheck(LAID_OUT_STATE_KERNELS[delta], (qn, kn, vn, decay, beta, tables.state_cu_seqlens,
                                                          tables.state_chunks, tables.state_chunk_offsets,
                                                          tables.long_chunks, tables.long_chunk_offsets, 128 ** -0.5),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unfilled_final_state_equals_fla(dtype, monkeypatch):
    """fla.EMPTY_FINAL_STATE's own launch of fla's h kernel (final states `torch.empty`, not zero-filled) gives the
    bits of fla's own h step, every final-state row written (empty sequences and spare rows included)."""
    from flide.ops.gated_delta import fla as fla_module

    x, r = inputs(3072, dtype, seed=23)
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    monkeypatch.setattr(fla_module, "FUSED_STATE_CHAIN", False)  # fla's h step, which this is about
    monkeypatch.setattr(fla_module, "EMPTY_FINAL_STATE", False)
    fla_module._fla_steps.cache_clear()
    want_o, want_finals = fork(kernel("fla"), *x, *meta, 128 ** -0.5, True)
    monkeypatch.setattr(fla_module, "EMPTY_FINAL_STATE", True)
    fla_module._fla_steps.cache_clear()
    try:
        torch.cuda.empty_cache()
        poison = torch.full((64 << 20,), float("nan"), device="cuda")  # freed memory the next allocations may reuse
        del poison
        o, finals = fork(kernel("fla"), *x, *meta, 128 ** -0.5, True)
    finally:
        fla_module._fla_steps.cache_clear()
    assert torch.equal(finals, want_finals) and torch.equal(o, want_o)


@pytest.mark.parametrize("tokens", [500, 3600])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
def test_fused_state_chain_matches_fla_steps(tokens, heads, monkeypatch):
    """fla.FUSED_STATE_CHAIN (state_chain.py, 16-bit inputs, calls up to FUSED_MAX_TOKENS; here every call): the fork
    with the state call's h and o steps in our one launch against fla's two steps, bf16 at Qwen3.5's head counts.
    They compute the same equations with the same bf16 roundings of S, U and A: close (equal on the H200 op bench)."""
    from flide.ops.gated_delta import fla as fla_module
    from flide.ops.gated_delta import state_chain

    monkeypatch.setattr(fla_module, "FUSED_MAX_TOKENS", 1 << 30)
    x, r = inputs(tokens, torch.bfloat16, seed=tokens + heads[1] + 5, hk=heads[0], hv=heads[1])
    calls = []
    launch = state_chain.state_chain
    monkeypatch.setattr(state_chain, "state_chain", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    o, final = run_fork("fla", x, r)
    assert calls  # the fused launch ran
    monkeypatch.setattr(fla_module, "FUSED_STATE_CHAIN", False)
    want_o, want_final = run_fork("fla", x, r)
    used = r.state_len > 0
    assert rel_err(o, want_o) < 5e-3 and rel_err(final[used], want_final[used]) < 5e-3
    if torch.cuda.get_device_capability() == (9, 0):
        # the same bits on the H200: the products' K steps accumulate in fla's order (one K = 128 dot where fla
        # chains two of 64), so a request's bits do not depend on whether its bucket runs the fused call
        assert torch.equal(o, want_o) and torch.equal(final[used], want_final[used])
    pad = torch.arange(tokens, device="cuda") >= int((r.branch_start + r.branch_len).max())
    assert (o[pad] == 0).all()


@pytest.mark.parametrize("tokens", [3600, 8192])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
def test_split_state_chain_matches_fla_steps(tokens, heads, monkeypatch):
    """fla.FUSED_SPLIT: in a bucket over FUSED_MAX_TOKENS (here 300, so that a random round holds states on both
    sides) the state call from the round's tables runs its short states through the fused chain and its long ones
    through the LONG chain + the outputs kernel over their chunk rows (`split_tables`): the fork's outputs and final states
    against fla's h and o steps for every state, bf16 at Qwen3.5's head counts; the same bits on sm_90."""
    from flide.ops.gated_delta import fla as fla_module
    from flide.ops.gated_delta import state_chain

    monkeypatch.setattr(fla_module, "FUSED_MAX_TOKENS", 300)
    x, r = inputs(tokens, torch.bfloat16, seed=tokens + heads[1] + 11, hk=heads[0], hv=heads[1])
    lens = r.state_len
    assert (lens > 300).any() and ((lens > 0) & (lens <= 300)).any()
    calls = []
    launch = state_chain.state_chain_split
    monkeypatch.setattr(state_chain, "state_chain_split", lambda *a, **kw: calls.append(1) or launch(*a, **kw))

    (o, final), tables = fork_from_tables(x, r)
    assert calls and tables.long_chunks.numel() > 0
    monkeypatch.setattr(fla_module, "FUSED_SPLIT", False)
    (want_o, want_final), plain = fork_from_tables(x, r)
    assert len(calls) == 1 and plain.long_chunks.numel() == 0
    used = lens > 0
    assert rel_err(o, want_o) < 5e-3 and rel_err(final[used], want_final[used]) < 5e-3
    if torch.cuda.get_device_capability() == (9, 0):
        assert torch.equal(o, want_o) and torch.equal(final[used], want_final[used])


@pytest.mark.parametrize("tokens", [3600, 8192])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
def test_segment_scan_state_call_matches_fla_steps(tokens, heads, monkeypatch):
    """fla.SEGMENT_SCAN: in a bucket over FUSED_MAX_TOKENS (here 300) the state call from the round's tables runs its
    long states in 128-token segments (`segment_scan`: transitions, combine, each segment's fused chain) and its short
    ones whole in the same launch: the fork's outputs and final states close to fla's h and o steps (bf16, Qwen3.5's
    head counts; the later segments start from states summed in another order), a long state's first segment and
    every short state with fla's bits on sm_90, and the same results when the round is laid out again."""
    from flide.ops.gated_delta import fla as fla_module
    from flide.ops.gated_delta import segment_scan

    monkeypatch.setattr(fla_module, "FUSED_MAX_TOKENS", 300)
    monkeypatch.setattr(fla_module, "SEGMENT_SCAN", True)
    monkeypatch.setattr(segment_scan, "SEGMENT_TOKENS", 128)
    x, r = inputs(tokens, torch.bfloat16, seed=tokens + heads[1] + 11, hk=heads[0], hv=heads[1])
    lens = r.state_len
    assert (lens > 2 * 128).any() and ((lens > 0) & (lens <= 300)).any()
    calls = []
    launch = segment_scan.state_chain_segments
    monkeypatch.setattr(segment_scan, "state_chain_segments", lambda *a, **kw: calls.append(1) or launch(*a, **kw))

    o, final = fork_from_tables(x, r)[0]
    again, again_final = fork_from_tables(x, r)[0]
    assert len(calls) == 2
    used = lens > 0
    assert torch.equal(again, o) and torch.equal(again_final[used], final[used])
    monkeypatch.setattr(fla_module, "FUSED_SPLIT", False)
    want_o, want_final = fork_from_tables(x, r)[0]
    assert len(calls) == 2
    assert rel_err(o, want_o) < 5e-3 and rel_err(final[used], want_final[used]) < 5e-3
    if torch.cuda.get_device_capability() == (9, 0):
        exact = torch.zeros(o.shape[0], dtype=torch.bool, device=o.device)
        for start, n in zip(r.state_start.tolist(), lens.tolist()):
            exact[start:start + (n if n <= 300 else 128)] = True
        assert torch.equal(o[exact], want_o[exact])


@pytest.mark.parametrize("tokens", [300, 1000])
def test_fused_state_chain_from_initial_states_matches_fla_steps(tokens, monkeypatch):
    """fla.FUSED_INITIAL_STATES: a call with initial states (a checkpoint round's resumed states, `gated_delta` with
    `initial_index`; -1: from zero) through the fused launch against fla's h and o steps from the same states."""
    from flide.ops.gated_delta import fla as fla_module
    from flide.ops.gated_delta import state_chain

    g = torch.Generator(device="cuda").manual_seed(tokens)
    hk = hv = 16
    q, k = (torch.randn(tokens, hk, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(tokens, hv, 128, device="cuda", generator=g).to(torch.bfloat16)
    decay = -F.softplus(torch.randn(tokens, hv, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(tokens, hv, device="cuda", generator=g)).to(torch.bfloat16)
    lens = [tokens // 3, 1, tokens // 2 - 70, 64]  # the rest of the stream in no sequence
    seg_len = torch.tensor(lens, device="cuda", dtype=torch.int32)
    seg_start = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()], device="cuda", dtype=torch.int32)
    states = torch.randn(3, hv, 128, 128, device="cuda", generator=g) * 0.05
    index = torch.tensor([2, -1, 0, 1], device="cuda", dtype=torch.int32)
    args = (q, k, v, decay, beta, seg_start, seg_len, states, index, 128 ** -0.5, True)
    calls = []
    launch = state_chain.state_chain
    monkeypatch.setattr(state_chain, "state_chain", lambda *a, **kw: calls.append(kw) or launch(*a, **kw))
    monkeypatch.setattr(fla_module, "FUSED_INITIAL_STATES", True)
    o, final = fla_module.gated_delta(*args)
    assert calls and calls[0]["initial_state"] is not None
    monkeypatch.setattr(fla_module, "FUSED_STATE_CHAIN", False)
    want_o, want_final = fla_module.gated_delta(*args)
    rows = int(seg_len.sum())
    assert final.shape == want_final.shape == (4, hv, 128, 128)
    assert rel_err(o[:rows], want_o[:rows]) < 5e-3 and rel_err(final, want_final) < 5e-3
    if torch.cuda.get_device_capability() == (9, 0):
        assert torch.equal(o[:rows], want_o[:rows]) and torch.equal(final, want_final)


def test_fused_state_chain_keeps_a_state_s_bits_wherever_it_lies():
    """Each program of the fused kernel reads only its own sequence: a state's outputs and final state have the same
    bits alone and behind other states in a longer call (batch invariance of the state call)."""
    from flide.ops.gated_delta import state_chain

    g = torch.Generator(device="cuda").manual_seed(3)
    T, hk, hv, d = 1000, 16, 16, 128
    q, k, w = (torch.randn(T, h, d, device="cuda", generator=g).to(torch.bfloat16) * 0.1 for h in (hk, hk, hv))
    u = torch.randn(T, hv, d, device="cuda", generator=g).to(torch.bfloat16)
    gamma = -torch.rand(T, hv, device="cuda", generator=g) * 4  # any log2 decays: the kernel only reads them
    alone_cu = torch.tensor([0, 333], device="cuda", dtype=torch.int32)
    shifted = torch.cat([torch.arange(333, 1000), torch.arange(0, 333)]).cuda()  # rows 0..332 moved to 667..999
    o1, f1 = state_chain.state_chain(q, k, w, u, gamma, alone_cu, 0.1)
    many_cu = torch.tensor([0, 200, 667, 1000], device="cuda", dtype=torch.int32)
    o2, f2 = state_chain.state_chain(*(x[shifted] for x in (q, k, w, u, gamma)), many_cu, 0.1)
    assert torch.equal(o1[:333], o2[667:]) and torch.equal(f1[0], f2[2])


@pytest.mark.parametrize("tokens", [500, 3072])
def test_kkt_warps_keep_the_bits(tokens, monkeypatch):
    """fla.KKT_ONE_WARP_TOKENS: the fused kkt + solve kernel launched at 1 warp a program (our launch, on sm_90 with
    16-bit inputs) gives the bits of its launch at the pinned 2 warps (as fla's own intra step launches it), so a
    request's answers do not depend on its round's bucket."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the configs are pinned (and the 1-warp launch runs) on sm_90 only")
    import fla.ops.gated_delta_rule.wy_fast as wy_fast

    from flide.ops.gated_delta import fla as fla_module

    x, r = inputs(tokens, torch.bfloat16, seed=29, hk=16, hv=16)  # pinned at 2 warps
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    monkeypatch.setattr(fla_module, "OWN_W_U", False)  # fla's intra step and w / u (ours: test_own_w_u_...)
    monkeypatch.setattr(fla_module, "KKT_ONE_WARP_TOKENS", None)
    want_o, want_finals = fork(kernel("fla"), *x, *meta, 128 ** -0.5, True)
    assert fla_module.autotuner(fla_module._kkt_kernel()).flide_pinned[16].num_warps == 2
    ours = []  # w / u's step, called from its module after the kkt + solve launch
    step = wy_fast.recompute_w_u_fwd
    monkeypatch.setattr(wy_fast, "recompute_w_u_fwd", lambda *a, **kw: ours.append(1) or step(*a, **kw))
    monkeypatch.setattr(fla_module, "KKT_ONE_WARP_TOKENS", 0)
    o, finals = fork(kernel("fla"), *x, *meta, 128 ** -0.5, True)
    assert ours and torch.equal(finals, want_finals) and torch.equal(o, want_o)


@pytest.mark.parametrize("warps", [1, 2])
@pytest.mark.parametrize("tokens", [500, 3072])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
def test_own_kkt_solve_keeps_fla_s_bits(tokens, heads, warps, monkeypatch):
    """fla.OWN_KKT: our kkt + solve kernel (the diagonal blocks' substitutions side by side) writes fla's kernel's
    bits, launched at the same warps, on every chunk's lower blocks; and the fork with it (state rows, final states,
    questions) has the bits of the fork with fla's."""
    from flide.config import GDN_CHUNK
    from flide.ops.gated_delta import fla as fla_module
    from flide.ops.gated_delta.kkt_solve import kkt_solve

    x, r = inputs(tokens, torch.bfloat16, seed=tokens + heads[1] + warps, hk=heads[0], hv=heads[1])
    q, k, v, decay, beta = x
    cu = fla_module.bounds(r.state_start, r.state_len)
    chunks = fla_module.chunk_table(cu, tokens // GDN_CHUNK + r.state_start.shape[0] + 1)
    kn = F.normalize(k.float(), dim=-1).to(torch.bfloat16)[None].contiguous()
    g = fla_module._fla_steps()[0](decay[None].float(), chunk_size=GDN_CHUNK, scale=fla_module._fla_steps()[4],
                                   cu_seqlens=cu, chunk_indices=chunks)
    b = beta[None].to(torch.bfloat16).contiguous()
    want = torch.full((1, tokens, heads[1], GDN_CHUNK), float("nan"), device="cuda", dtype=torch.bfloat16)
    fla_module.autotuner(fla_module._kkt_kernel()).fn[(chunks.shape[0], heads[1])](
        k=kn, g=g, beta=b, A=want, cu_seqlens=cu, chunk_indices=chunks, T=tokens, H=heads[0], HV=heads[1],
        K=128, BT=GDN_CHUNK, BC=16, BK=64, USE_G=True, IS_VARLEN=True, num_warps=warps, num_stages=3)
    got = kkt_solve(kn, g, b, cu, chunks, torch.full_like(want, float("nan")), num_warps=warps)
    assert (~want.isnan()).any()
    assert torch.equal(got.isnan(), want.isnan())  # the same elements written
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    monkeypatch.setattr(fla_module, "KKT_ONE_WARP_TOKENS", 0)  # fla's at 1 warp wherever pinned at more
    monkeypatch.setattr(fla_module, "KKT_WARPS", 1)
    monkeypatch.setattr(fla_module, "OWN_KKT", True)
    o, finals = fork(kernel("fla"), *x, *meta, 128 ** -0.5, True)
    monkeypatch.setattr(fla_module, "OWN_KKT", False)
    o_fla, finals_fla = fork(kernel("fla"), *x, *meta, 128 ** -0.5, True)
    assert torch.equal(finals, finals_fla) and torch.equal(o, o_fla)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [500, 3072, 8192])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
def test_own_w_u_keeps_fla_s_bits(tokens, heads, dtype, monkeypatch):
    """fla.OWN_W_U: our w / u kernel (spare chunk rows return at once) gives fla's `recompute_w_u_fwd` bits on every
    chunk's tokens from the same A, and the fork (state rows, final states, questions) the bits of fla's step."""
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    from flide.config import GDN_CHUNK
    from flide.ops.gated_delta import fla as fla_module
    from flide.ops.gated_delta.wy_form import w_u

    x, r = inputs(tokens, dtype, seed=tokens + heads[1], hk=heads[0], hv=heads[1])
    q, k, v, decay, beta = x
    cu = fla_module.bounds(r.state_start, r.state_len)
    chunks = fla_module.chunk_table(cu, tokens // GDN_CHUNK + r.state_start.shape[0] + 1)
    kn = F.normalize(k.float(), dim=-1).to(dtype)[None].contiguous()
    g = fla_module._fla_steps()[0](decay[None].float(), chunk_size=GDN_CHUNK, scale=fla_module._fla_steps()[4],
                                   cu_seqlens=cu, chunk_indices=chunks)
    b = beta[None].to(dtype).contiguous()
    A = fla_module._solve(kn, g, b, cu, chunks, filled=True)  # fla's step reads the zero upper blocks
    w_fla, u_fla = recompute_w_u_fwd(k=kn, v=v[None].contiguous(), beta=b, A=A, g=g, cu_seqlens=cu,
                                     chunk_indices=chunks)
    # ours from A as `_solve` leaves it for us (no zero fill): the same lower triangles as the filled A, and with NaN
    # wherever the launch writes nothing, fla's bits
    t = torch.arange(tokens, device="cuda")
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(max=cu.shape[0] - 2)
    upper = torch.arange(GDN_CHUNK, device="cuda")[None, :] > ((t - cu[seq]) % GDN_CHUNK)[:, None]
    lower = (~upper & (t < int(cu[-1]))[:, None])[None, :, None, :].expand_as(A)
    written = fla_module._solve(kn, g, b, cu, chunks, filled=False)
    assert torch.equal(written[lower], A[lower])
    unfilled = torch.where(lower, A, torch.full_like(A, float("nan")))
    w, u = w_u(kn, v[None].contiguous(), b, unfilled, g, cu, chunks)
    rows = torch.arange(tokens, device="cuda") < int(cu[-1])
    assert torch.equal(w[0][rows], w_fla[0][rows]) and torch.equal(u[0][rows], u_fla[0][rows])
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    monkeypatch.setattr(fla_module, "OWN_W_U", True)
    o, finals = fork(kernel("fla"), *x, *meta, 128 ** -0.5, True)
    monkeypatch.setattr(fla_module, "OWN_W_U", False)
    o_fla, finals_fla = fork(kernel("fla"), *x, *meta, 128 ** -0.5, True)
    assert torch.equal(finals, finals_fla) and torch.equal(o, o_fla)


def wy_fork(x, r):
    """The `fla_wy` fork as the model layers run it: round tables, the state call that also prepares the questions'
    WY form, the chunked question call."""
    from flide.ops.gated_delta import STATE_KERNELS, fork_tables

    wy = kernel("fla_wy")
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, r.branch_chunks,
                         branch_state=r.branch_state)
    return plain_fork(wy, *x, r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state, 128 ** -0.5,
                      True, branch_kernel=BRANCH_KERNELS[wy], state_kernel=STATE_KERNELS[wy], tables=tables, wy=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,longest", [(64, 70), (500, 70), (3600, 200)])
@pytest.mark.parametrize("hv", [8, 16], ids=["Hv8", "Hv16"])
def test_fla_wy_fork_matches_reference(tokens, longest, hv, dtype):
    """`fla_wy`: the states' rows and final states with the bits of the `fla` fork from the same tables (the
    chunk-local steps over states and questions together compute each state chunk as before), the questions' rows
    (chunked, from those final states) matching the reference and the recurrent question kernel within rounding."""
    from flide.ops.gated_delta import STATE_KERNELS, fork_tables

    rng = random.Random(tokens + hv)
    r = random_round_tensors(rng, tokens, max_requests=8, max_questions=12, max_state=700,
                             max_question=longest).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(tokens)
    q, k = (torch.randn(tokens, 4, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    v = torch.randn(tokens, hv, 128, device="cuda", generator=g).to(dtype)
    decay = -F.softplus(torch.randn(tokens, hv, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(tokens, hv, device="cuda", generator=g)).to(dtype)
    x = (q, k, v, decay, beta)
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    o, finals = wy_fork(x, r)
    fla = kernel("fla")
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, r.branch_chunks,
                         branch_state=r.branch_state)
    o_fla, finals_fla = plain_fork(fla, *x, *meta, 128 ** -0.5, True, branch_kernel=BRANCH_KERNELS[fla],
                                   state_kernel=STATE_KERNELS[fla], tables=tables)
    used = r.state_len > 0  # empty states' final rows: unwritten by `fla`'s state call from the tables
    assert torch.equal(finals[used], finals_fla[used])
    states = torch.arange(tokens, device="cuda") < int(r.state_start[0] + r.state_len.sum())
    assert torch.equal(o[states], o_fla[states])
    questions = ~states & (torch.arange(tokens, device="cuda") < int(r.branch_start[0] + r.branch_len.sum()))
    assert questions.any() and torch.isfinite(o).all()
    ref_o, _ = plain_fork(kernel("reference"), *(t.float() if t.is_floating_point() else t for t in x), *meta,
                          128 ** -0.5, True)
    assert rel_err(o[questions], ref_o[questions]) < TOL[dtype]
    assert rel_err(o[questions], o_fla[questions]) < TOL[dtype]
    pad = torch.arange(tokens, device="cuda") >= int(r.branch_start[0] + r.branch_len.sum())
    assert (o[pad] == 0).all()


def test_fla_wy_replays_the_same_bits():
    """Two runs of the same round give the same bits (no atomics or autotuning between them)."""
    x, r = inputs(3072, torch.bfloat16, seed=29)
    o, finals = wy_fork(x, r)
    o2, finals2 = wy_fork(x, r)
    assert torch.equal(o, o2) and torch.equal(finals, finals2)


def test_fla_wy_ops_opcheck_on_cuda():
    """The two custom ops of `fla_wy`: schemas, fake tensors (as torch.compile traces them)."""
    from flide.ops.gated_delta import fork_tables, gated_delta_fla_states_wy, gated_delta_questions_wy

    (q, k, v, decay, beta), r = inputs(500, torch.bfloat16, seed=31)
    t = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, r.branch_chunks,
                         branch_state=r.branch_state)
    args = (q, k, v, decay, beta, t.all_cu_seqlens, t.all_chunks, t.state_cu_seqlens, t.state_chunks,
            t.state_chunk_offsets, 128 ** -0.5, True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(gated_delta_fla_states_wy, args, test_utils=checks)
    _, finals, qn, kn, w, u, gamma = gated_delta_fla_states_wy(*args)
    torch.library.opcheck(gated_delta_questions_wy, (qn, kn, w, u, gamma, r.branch_start, r.branch_len, finals,
                                                     r.branch_state, 128 ** -0.5), test_utils=checks)


def cuda_question_inputs(dtype, hk: int, hv: int, seed: int, index_dtype=torch.int64, decay_scale: float = 0.5):
    """The question call's inputs at Qwen3.5's head shapes (K = V = 128): q and k already normalised (the fork
    normalises them in the state call), branches of 1-130 tokens from 6 states' final states, spare capacity rows."""
    tokens, meta = segments_round([1, 63, 64, 65, 500], [1, 63, 64, 65, 40, 1, 7, 130], [0, 1, 2, 3, 4, 4, 0, 2],
                                  6, 12)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (F.normalize(torch.randn(tokens, hk, 128, device="cuda", generator=g), dim=-1).to(dtype)
            for _ in range(2))
    v = torch.randn(tokens, hv, 128, device="cuda", generator=g).to(dtype)
    decay = -F.softplus(torch.randn(tokens, hv, device="cuda", generator=g)) * decay_scale
    beta = torch.sigmoid(torch.randn(tokens, hv, device="cuda", generator=g)).to(dtype)
    finals = torch.randn(6, hv, 128, 128, device="cuda", generator=g) * 0.1
    tables = tuple(meta[name].to(index_dtype) for name in ("branch_start", "branch_len"))
    return tokens, (q, k, v, decay, beta, *tables, finals, meta["branch_state"].to(index_dtype), 128 ** -0.5)


@pytest.mark.parametrize("tiles", [(2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (1, 4), (2, 1, True), (4, 2, True),
                                   (1, 4, True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
def test_cuda_question_kernel_matches_reference(dtype, heads, tiles):
    """The CUDA question kernel (questions_cuda.py) against the reference at Qwen3.5's head shapes (0.8B: 16/16; 9B:
    16/32), every tile: each branch from its state's final state by index, spare rows of length 0, every question
    row written and no state row (NaN-poisoned output). fp32 within 1e-5."""
    from flide.ops.gated_delta import questions_cuda

    tokens, args = cuda_question_inputs(dtype, *heads, seed=31)
    q, k, v, decay, beta, *rest = args
    ref_o, _ = kernel("reference")(q.float(), k.float(), v.float(), decay, beta.float(), *rest, False)
    out = torch.full((tokens, heads[1], 128), float("nan"), dtype=dtype, device="cuda")
    o = questions_cuda.branches_cuda(*args, out=out, tiles=tiles)
    first = int(args[5][0])
    assert torch.isfinite(o[first:]).all() and o[:first].isnan().all()
    assert rel_err(o[first:], ref_o[first:]) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("decay_scale", [8.0, float("inf")], ids=["strong", "underflowing"])
def test_cuda_question_kernel_lazy_decay_folds_its_scale(decay_scale):
    """The lazy decay (the state kept as c * S): with strong decays c falls below 2^-32 every few tokens and is
    folded into S; with decays of exp(-inf) = 0 the state restarts from nothing. fp32 within 1e-5 of the reference
    either way."""
    from flide.ops.gated_delta import questions_cuda
    from flide.ops.gated_delta.reference import gated_delta_naive

    _, args = cuda_question_inputs(torch.float32, 16, 16, seed=41, decay_scale=decay_scale)
    # the float64 token-by-token oracle (the chunked reference subtracts cumulative log decays: -inf - -inf)
    ref_o, _ = gated_delta_naive(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args), False)
    ref_o = ref_o.cuda()
    o = questions_cuda.branches_cuda(*args, tiles=(2, 1, True))
    first = int(args[5][0])
    assert torch.isfinite(o[first:]).all()
    assert rel_err(o[first:], ref_o[first:]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_question_kernel_int32_tables_and_bits_alone(dtype):
    """int32 segment tables give the int64 tables' bits, and a branch run alone (its row the only one of the call,
    at another place in a shorter stream) has the same bits as in the full call: batch-invariant."""
    from flide.ops.gated_delta import questions_cuda

    _, args64 = cuda_question_inputs(dtype, 16, 16, seed=37)
    _, args32 = cuda_question_inputs(dtype, 16, 16, seed=37, index_dtype=torch.int32)
    q, k, v, decay, beta, start, length, finals, index, scale = args64
    first = int(start[0])  # rows before it are states', which the question call leaves unwritten
    full = questions_cuda.branches_cuda(*args64)
    assert torch.equal(questions_cuda.branches_cuda(*args32)[first:], full[first:])
    for row in (0, 4, 7):  # 1, 40 and 130 tokens
        s, n = int(start[row]), int(length[row])
        cut = slice(s - 3, s + n)  # 3 rows before it, which no branch covers now
        alone = questions_cuda.branches_cuda(q[cut], k[cut], v[cut], decay[cut], beta[cut],
                                             start[row:row + 1] - (s - 3), length[row:row + 1], finals,
                                             index[row:row + 1], scale)
        assert torch.equal(alone[3:], full[s:s + n]), row


def test_cuda_question_op_falls_back_and_opchecks():
    """flide::gated_delta_branches_cuda: with in-kernel normalisation asked for, the Triton kernel's outputs (the
    CUDA kernel takes normalised q / k); its fake impl, schema and no aliasing, as torch.compile relies on them."""
    from flide.ops.gated_delta import branches, gated_delta_branches_cuda

    x, r = inputs(130, torch.bfloat16, seed=4)
    q, k, v, decay, beta = x
    finals = torch.randn(r.state_start.shape[0], v.shape[1], 128, 128, device="cuda") * 0.1
    args = (q, k, v, decay, beta, r.branch_start, r.branch_len, finals, r.branch_state, 128 ** -0.5, True)
    t = torch.arange(q.shape[0], device="cuda")[:, None]
    rows = ((t >= r.branch_start) & (t < r.branch_start + r.branch_len)).any(1)  # the rows the call writes
    assert rows.sum() > 0
    assert torch.equal(gated_delta_branches_cuda(*args)[rows], branches.branches(*args)[rows])
    torch.library.opcheck(gated_delta_branches_cuda, args[:-1] + (False,),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
