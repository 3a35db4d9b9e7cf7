"""The fork's questions in chunked form (`fork_parts(chunked=True)`: `gated_delta_fla_states_chunked` +
`gated_delta_questions_chunked`, what the GDN layer runs with fla.CHUNKED_QUESTIONS) on the GPU: the states' rows
and final states with the bits of the laid-out fork whose questions run token by token (the state call's extra chunk
rows change no state chunk), the questions' rows matching the reference fork and the recurrent question kernel
within rounding, nested forks (a leaf runs its sub-trunk's chunks first) against the reference's nested fork, and the
ops' schemas / fake tensors. The kernel's fp32 sums against the reference on the CPU: tests/test_triton_kernels.py
(`test_gated_delta_questions_chunked_*`)."""

from __future__ import annotations

import pytest
import torch

from flide.config import GDN_CHUNK
from flide.ops.gated_delta import (BRANCH_KERNELS, CHUNKED_QUESTION_KERNELS, LAID_OUT_STATE_KERNELS, fork_parts,
                                   fork_tables)
from flide.ops.gated_delta.l2norm import prepare_qkv
from flide.ops.gated_norm.reference import select_rows
from flide.ops.registry import _NESTED, resolve

from .test_gated_delta_gpu import TOL, inputs, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCALE = 128 ** -0.5


# The reference's answers of the last case: the tile parameters come innermost (`narrow` off, then on), and the
# reference (a token-by-token loop, most of a case's time at 8,192 tokens) does not depend on them
_last_reference: list = [None, None]


def reference_once(key: tuple, compute):
    """`compute()` of the case `key`, computed once for consecutive cases with the same inputs."""
    if _last_reference[0] != key:
        _last_reference[:] = [key, None]  # drop the old answers before computing the new
        _last_reference[1] = compute()
    return _last_reference[1]


def laid_out(tokens: int, dtype, seed: int, hv: int, longest: int):
    """A random round on the GPU (`test_gated_delta_gpu.inputs`, 4 key heads) and its inputs laid out as the fused
    conv writes them (q / k normalised): (laid out, raw, round)."""
    raw, r = inputs(tokens, dtype, seed, hk=4, hv=hv, longest=longest)
    q, k, v, decay, beta = raw
    qn, kn, vn = prepare_qkv(q, k, v, True)
    return (qn, kn, vn, decay, beta), raw, r


def use_narrow_tiles(monkeypatch) -> None:
    """The chunked question launch with the 16-bit tiles before session 44 (`questions_chunked.NARROW_TILES`, kept for
    the A/B) as its own."""
    from flide.ops.gated_delta import questions_chunked

    for name, value in zip(("BLOCK_V", "NUM_WARPS", "NUM_STAGES"), questions_chunked.NARROW_TILES):
        monkeypatch.setattr(questions_chunked, name, value)


def layer_fork(x, meta, tables, chunked: bool, **kwargs):
    """The laid-out `fla` fork as the GDN layer runs it, questions chunked or token by token."""
    fla = resolve("gated_delta", "fla")
    parts = fork_parts(fla, *x, *meta, SCALE, False, branch_kernel=BRANCH_KERNELS[fla],
                       state_kernel=LAID_OUT_STATE_KERNELS[fla], tables=tables, laid_out=True, chunked=chunked,
                       **kwargs)
    return select_rows(*parts[:5]), parts.finals


@pytest.mark.parametrize("narrow", [False, True], ids=["default-tiles", "narrow-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,longest", [(500, 70), (3600, 200), (8192, 300)],
                         ids=["fused-chain", "split-call", "bucket8192"])
@pytest.mark.parametrize("hv", [16, 32], ids=["Hv16", "Hv32"])
def test_chunked_questions_match_the_reference_and_keep_the_states_bits(tokens, longest, hv, dtype, narrow,
                                                                        monkeypatch):
    if narrow:
        use_narrow_tiles(monkeypatch)
    x, raw, r = laid_out(tokens, dtype, seed=tokens + hv, hv=hv, longest=longest)
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, r.branch_chunks,
                         branch_state=r.branch_state)
    o, finals = layer_fork(x, meta, tables, chunked=True)
    o_rec, finals_rec = layer_fork(x, meta, tables, chunked=False)
    used = r.state_len > 0  # empty states' final rows: unwritten by the state call from the tables
    assert torch.equal(finals[used], finals_rec[used])
    states = torch.arange(tokens, device="cuda") < int(r.state_start[0] + r.state_len.sum())
    assert torch.equal(o[states], o_rec[states])
    end = int(r.branch_start[0] + r.branch_len.sum())
    questions = ~states & (torch.arange(tokens, device="cuda") < end)
    assert questions.any() and torch.isfinite(o).all() and (o[end:] == 0).all()
    ref_o, _ = reference_once(("match", tokens, longest, hv, dtype), lambda: fork_parts_reference(raw, meta))
    assert rel_err(o[questions], ref_o[questions]) < TOL[dtype]
    assert rel_err(o[questions], o_rec[questions]) < TOL[dtype]
    # the same round again: the same bits (no atomics, no autotuning between calls)
    o2, _ = layer_fork(x, meta, tables, chunked=True)
    assert torch.equal(o, o2)


def fork_parts_reference(raw, meta):
    from flide.ops.gated_delta import fork

    return fork(resolve("gated_delta", "reference"), *(t.float() for t in raw), *meta, SCALE, True)


@pytest.mark.parametrize("narrow", [False, True], ids=["default-tiles", "narrow-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["Hk16-Hv16", "Hk16-Hv32"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_questions_nested_fork_matches_the_reference(seed, heads, dtype, narrow, monkeypatch):
    """Sub-trunks of 3-120 tokens (one or two chunks) with 2-4 leaves each, in a shuffled order: every row against
    the reference's nested fork (each leaf re-runs its sub-trunk's rows), the leaves alone too; states, sub-trunks
    and plain questions with the bits of the chunked fork without sub-trunks. `narrow`: with the chunked launch's
    16-bit tiles before session 44 (questions_chunked.NARROW_TILES) throughout."""
    from .test_gated_delta_nested_gpu import inputs, leaf_tokens, meta, nested_round, reference_fork, sub

    if narrow:
        use_narrow_tiles(monkeypatch)
    r = nested_round(seed)
    x_raw = inputs(r, dtype, seed + 100, heads)
    q, k, v, decay, beta = x_raw
    x = (*prepare_qkv(q, k, v, True), decay, beta)
    nb = r["branch_len"].shape[0]
    chunks = [(i, c) for i, n in enumerate(r["branch_len"].tolist()) for c in range(-(-n // GDN_CHUNK))]
    branch_chunks = torch.tensor(chunks + [(nb, 0)] * 3, device="cuda")
    tables = fork_tables(*meta(r)[:4], r["state_chunks"], branch_chunks, branch_state=r["branch_state"])
    o, finals = layer_fork(x, meta(r), tables, chunked=True, sub=sub(r))
    o_plain, finals_plain = layer_fork(x, meta(r), tables, chunked=True)
    ref_o, _ = reference_once(("nested", seed, heads, dtype), lambda: reference_fork(x_raw, r))
    leaves = leaf_tokens(r)
    # the spare (empty) state rows' finals are unwritten by the state call from the tables (fla.EMPTY_STATE_FINALS):
    # whatever the allocator handed out, so only the used rows are compared (H200, session 38: seed 2's differed)
    used = r["state_len"] > 0
    assert not used.all()
    assert torch.isfinite(o).all()
    assert rel_err(o, ref_o) < TOL[dtype]
    assert rel_err(o[leaves], ref_o[leaves]) < TOL[dtype]
    assert torch.equal(finals[used], finals_plain[used]) and torch.equal(o[~leaves], o_plain[~leaves])
    assert not torch.equal(o[leaves], o_plain[leaves])
    assert _NESTED[("gated_delta", "fla")] is not None  # the layer keeps its nested companion registered
    # stored sub-trunk states (two launches, questions_chunked.STORED_SUB_STATES): the bits of re-running them
    from flide.ops.gated_delta import questions_chunked

    monkeypatch.setattr(questions_chunked, "STORED_SUB_STATES", True)
    o_stored, finals_stored = layer_fork(x, meta(r), tables, chunked=True, sub=sub(r))
    assert torch.equal(o_stored, o) and torch.equal(finals_stored[used], finals[used])
    # split by rows (`question_lens`, the GDN layer's form with fla.SPLIT_NESTED_QUESTIONS): the leaves and their
    # sub-trunks by the recurrent nested kernel, the other questions chunked from tables without the nested rows'
    # chunks: the reference's answers, the states' bits, the plain questions' bits of the chunked call
    from flide.ops.gated_delta import split_question_lens

    lens = split_question_lens(r["branch_start"], r["branch_len"], r["sub_lo"], r["sub_hi"])
    assert lens[1].any()  # leaves and their sub-trunks; plain rows are drawn 0-2 a state (seed 1 has none)
    split_tables = fork_tables(*meta(r)[:4], r["state_chunks"], branch_chunks, branch_state=r["branch_state"],
                               skip_branches=lens[1] > 0)
    o_split, finals_split = layer_fork(x, meta(r), split_tables, chunked=True, sub=sub(r), question_lens=lens)
    assert rel_err(o_split, ref_o) < TOL[dtype] and rel_err(o_split[leaves], ref_o[leaves]) < TOL[dtype]
    assert torch.equal(finals_split[used], finals[used])
    starts, ends = r["branch_start"][lens[0] > 0].tolist(), (r["branch_start"] + lens[0])[lens[0] > 0].tolist()
    plain_rows = torch.zeros(o.shape[0], dtype=torch.bool, device="cuda")
    for a, b in zip(starts, ends):
        plain_rows[a:b] = True
    assert plain_rows.any() == bool(lens[0].any())
    assert torch.equal(o_split[plain_rows], o_plain[plain_rows])
    # the nested launch's programs taking blocks of rows (questions_chunked.NESTED_ROW_PROGRAMS): the same bits
    monkeypatch.setattr(questions_chunked, "NESTED_ROW_PROGRAMS", 16)
    o_turns, _ = layer_fork(x, meta(r), split_tables, chunked=True, sub=sub(r), question_lens=lens)
    assert torch.equal(o_turns, o_split)
    # its own value-column width (questions_chunked.NESTED_BLOCK_V, 32, in streams of NESTED_BLOCK_V_MIN_TOKENS or
    # more) and the recurrent kernel's (16) below: the reference's answers, the plain rows' bits
    monkeypatch.setattr(questions_chunked, "NESTED_BLOCK_V", 32)
    for min_tokens in (0, o.shape[0] + 1):
        monkeypatch.setattr(questions_chunked, "NESTED_BLOCK_V_MIN_TOKENS", min_tokens)
        o_wide, _ = layer_fork(x, meta(r), split_tables, chunked=True, sub=sub(r), question_lens=lens)
        assert rel_err(o_wide, ref_o) < TOL[dtype] and rel_err(o_wide[leaves], ref_o[leaves]) < TOL[dtype]
        assert torch.equal(o_wide[plain_rows], o_plain[plain_rows])


def test_chunked_question_ops_opcheck_on_cuda():
    """The three custom ops: schemas, fake tensors (as torch.compile traces them)."""
    x, _, r = laid_out(500, torch.bfloat16, seed=31, hv=16, longest=70)
    t = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, r.branch_chunks,
                    branch_state=r.branch_state)
    states_op, questions_op, split_op = CHUNKED_QUESTION_KERNELS[resolve("gated_delta", "fla")]
    args = (*x, t.all_cu_seqlens, t.all_chunks, t.state_cu_seqlens, t.state_chunks, t.state_chunk_offsets,
            t.long_chunks, t.long_chunk_offsets, SCALE)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(states_op, args, test_utils=checks)
    _, finals, gamma, solved = states_op(*args)
    q, k, v, _, beta = x
    torch.library.opcheck(questions_op, (q, k, v, beta, gamma, solved, r.branch_start, r.branch_len, finals,
                                         t.branch_from, r.branch_start, r.branch_start, r.branch_start, SCALE, False),
                          test_utils=checks)
    from flide.ops.gated_delta import new_sub_flags

    no_range = torch.zeros(q.shape[0], dtype=torch.int32, device="cuda")
    no_slot = torch.full_like(r.branch_start, -1, dtype=torch.int32)
    # with the defaults, and with fixed tiles and an (empty) table of long leaves' groups
    for extra in ((), (True, torch.zeros_like(r.branch_len))):
        torch.library.opcheck(split_op, (q, k, v, x[3], beta, gamma, solved, r.branch_start, r.branch_len,
                                         torch.zeros_like(r.branch_len), finals, t.branch_from, no_range, no_range,
                                         no_slot, new_sub_flags(v.shape[1], v.shape[2], "cuda"), SCALE, *extra),
                              test_utils=checks)
