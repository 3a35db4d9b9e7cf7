"""Nested forks in the `fla` variant of the gated delta rule: the fork with sub-trunks (`fork_parts(sub=...)`, the
question call by `fla`'s nested companion, our recurrent Triton kernel compiled with NESTED) against the reference's
nested fork, at Qwen3.5's head shapes (0.8B: 16 key / 16 value heads, 4B / 9B: 16 / 32; K = V = 128), fp32 and
bf16; rows outside the leaves with the bits of the fork without sub-trunks; the model layer's path (state call from
the round's tables); a CUDA graph replay. The CPU checks (reference, the kernel in Triton's interpreter):
tests/test_gated_delta_nested.py."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from flide.config import GDN_CHUNK
from flide.ops.gated_delta import (BRANCH_KERNELS, STATE_KERNELS, fork, fork_tables, gated_delta_nested_reference,
                                   new_sub_flags, sub_slots)
from flide.ops.registry import _NESTED, resolve

# fla's Triton dots run in tf32 for fp32 inputs; bf16 inputs keep bf16 intermediates (as tests/gpu/test_gated_delta_gpu)
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
SCALE = 128 ** -0.5
HEADS = [(16, 16), (16, 32)]
HEAD_IDS = ["Hk16-Hv16", "Hk16-Hv32"]


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def nested_round(seed: int, spare_states: int = 1, spare_branches: int = 3, pad: int = 13, states: int | None = None,
                 shuffle: bool = True) -> dict:
    """A level-major round with sub-trunks, tables on the GPU: 2-4 states (or `states`) of 1-700 tokens; per state
    1-2 sub-trunks (3-120 tokens) with 2-4 leaves each (1-40 tokens) and 0-2 plain questions (1-70), the questions in
    a shuffled order (a leaf may come before its sub-trunk; `shuffle=False`: each state's questions in turn, a
    sub-trunk before its leaves, as rounds lay a request's out); spare table rows of length 0, `pad` rows of tail
    padding."""
    rng = random.Random(seed)
    states = [rng.randint(1, 700) for _ in range(states or rng.randint(2, 4))]
    questions = []  # (length, state, sub-trunk's index in this list or None)
    for s in range(len(states)):
        for _ in range(rng.randint(1, 2)):
            parent = len(questions)
            questions.append((rng.randint(3, 120), s, None))
            questions += [(rng.randint(1, 40), s, parent) for _ in range(rng.randint(2, 4))]
        questions += [(rng.randint(1, 70), s, None) for _ in range(rng.randint(0, 2))]
    order = list(range(len(questions)))
    if shuffle:
        rng.shuffle(order)
    at, state_start = 0, []
    for n in states:
        state_start.append(at)
        at += n
    start = {}
    for i in order:
        start[i] = at
        at += questions[i][0]
    T = at + pad
    sub_lo, sub_hi = torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
    leaves = []
    for i, (n, _, parent) in enumerate(questions):
        if parent is not None:
            leaves.append(i)
            sub_lo[start[i]:start[i] + n] = start[parent]
            sub_hi[start[i]:start[i] + n] = start[parent] + questions[parent][0]
    ns = len(states) + spare_states
    chunks = [(s, c) for s, n in enumerate(states) for c in range(-(-n // GDN_CHUNK))] + [(ns, 0)] * 2

    def table(values, fill, capacity):
        return torch.tensor(list(values) + [fill] * (capacity - len(values)), device="cuda")

    nb = len(questions) + spare_branches
    return {"T": T, "state_start": table(state_start, at, ns), "state_len": table(states, 0, ns),
            "branch_start": table([start[i] for i in order], at, nb),
            "branch_len": table([questions[i][0] for i in order], 0, nb),
            "branch_state": table([questions[i][1] for i in order], 0, nb),
            "sub_lo": sub_lo.cuda(), "sub_hi": sub_hi.cuda(), "state_chunks": torch.tensor(chunks, device="cuda"),
            "leaf_rows": [order.index(i) for i in leaves]}


def meta(r: dict) -> tuple:
    return r["state_start"], r["state_len"], r["branch_start"], r["branch_len"], r["branch_state"]


def slots(r: dict, cap: int | None = None) -> torch.Tensor:
    """The branch rows' sub-trunk state slots (`sub_slots`, as the flat forward derives them)."""
    return sub_slots(r["branch_start"], r["branch_len"], r["branch_state"], r["sub_lo"], r["sub_hi"],
                     *(() if cap is None else (cap,)))


def flags() -> torch.Tensor:
    """Zeroed flags for the stored sub-trunk states, enough for every head count of HEADS."""
    return new_sub_flags(max(hv for _, hv in HEADS), 128, "cuda")


def sub(r: dict) -> tuple[torch.Tensor, ...]:
    """`fork_parts(sub=)` and the nested companions' (sub_lo, sub_hi, sub_slot, sub_flags)."""
    return r["sub_lo"], r["sub_hi"], slots(r), flags()


def leaf_tokens(r: dict) -> torch.Tensor:
    mask = torch.zeros(r["T"], dtype=torch.bool, device="cuda")
    for i in r["leaf_rows"]:
        start, n = int(r["branch_start"][i]), int(r["branch_len"][i])
        mask[start:start + n] = True
    return mask


def inputs(r: dict, dtype, seed: int, heads: tuple[int, int]):
    hk, hv = heads
    T = r["T"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(T, hk, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    v = torch.randn(T, hv, 128, device="cuda", generator=g).to(dtype)
    decay = -F.softplus(torch.randn(T, hv, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(T, hv, device="cuda", generator=g)).to(dtype)
    return q, k, v, decay, beta


def fla_fork(x, r, nested: bool = True, **kwargs):
    """The `fla` fork as the model layer runs it: our question kernel, or with sub-trunks fla's nested companion."""
    fla = resolve("gated_delta", "fla")
    nest = dict(sub=sub(r), nested_kernel=_NESTED[("gated_delta", "fla")]) if nested else {}
    return fork(fla, *x, *meta(r), SCALE, True, branch_kernel=BRANCH_KERNELS[fla], **nest, **kwargs)


def reference_fork(x, r):
    return fork(resolve("gated_delta", "reference"), *(t.float() for t in x), *meta(r), SCALE, True,
                sub=sub(r), nested_kernel=gated_delta_nested_reference)


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fla_nested_fork_matches_reference(seed, dtype, heads):
    r = nested_round(seed)
    x = inputs(r, dtype, seed + 100, heads)
    o, finals = fla_fork(x, r)
    ref_o, ref_finals = reference_fork(x, r)
    assert torch.isfinite(o).all() and torch.isfinite(finals).all()
    leaves = leaf_tokens(r)
    assert rel_err(o, ref_o) < TOL[dtype]
    assert rel_err(o[leaves], ref_o[leaves]) < TOL[dtype]  # the leaves alone, not drowned by the states' rows
    used = r["state_len"] > 0
    assert rel_err(finals[used], ref_finals[used]) < TOL[dtype]
    assert (o[int(r["branch_start"][0] + r["branch_len"].sum()):] == 0).all()  # tail padding


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_nested_fork_keeps_the_bits_outside_leaves(dtype, heads):
    """States, sub-trunks and plain questions: the bits of the `fla` fork without sub-trunks (the state call is the
    same; a non-leaf question's program runs the same steps, its sub-trunk range empty)."""
    r = nested_round(5)
    x = inputs(r, dtype, 7, heads)
    o, finals = fla_fork(x, r)
    o_plain, finals_plain = fla_fork(x, r, nested=False)
    leaves = leaf_tokens(r)
    assert torch.equal(finals, finals_plain)
    assert torch.equal(o[~leaves], o_plain[~leaves])
    assert not torch.equal(o[leaves], o_plain[leaves])


def question_call(r: dict, dtype, seed: int, heads: tuple[int, int]):
    """The question call's arguments with random states' final states (no fla: the kernel alone)."""
    x = inputs(r, dtype, seed, heads)
    finals = torch.randn(int(r["state_len"].shape[0]), heads[1], 128, 128, device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(seed)) * 0.1
    return (*x, r["branch_start"], r["branch_len"], finals, r["branch_state"], SCALE, True)


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nested_question_call_matches_reference_at_qwen_shapes(dtype, heads):
    """fla's nested companion (the recurrent kernel with NESTED, leaves from their sub-trunk's stored state)
    against the reference's nested question call: every question row written (NaN-poisoned), fp32 within 1e-5 (the
    recurrent kernel has no tf32)."""
    r = nested_round(6)
    args = question_call(r, dtype, 13, heads)
    nest = sub(r)
    assert (nest[2] >= 0).any()
    o = _NESTED[("gated_delta", "fla")](*args[:9], *nest, *args[9:])
    assert not nest[3].any()  # the flags back at zero
    want = gated_delta_nested_reference(*(t.float() for t in args[:5]), *args[5:9], *nest, *args[9:])
    first = int(r["branch_start"][0])
    end = first + int(r["branch_len"].sum())
    assert rel_err(o[first:end], want[first:end]) < (1e-5 if dtype == torch.float32 else 1e-2)
    leaves = leaf_tokens(r)
    assert rel_err(o[leaves], want[leaves]) < (1e-5 if dtype == torch.float32 else 1e-2)
    from flide.ops.gated_delta import branches

    for slot in (None, nest[2]):  # leaves re-running their sub-trunk, or from its stored state
        poisoned = torch.full_like(o, float("nan"))
        o = branches.branches(*args, out=poisoned, sub=nest[:2], sub_slot=slot, sub_flags=nest[3])
        assert torch.isfinite(o[first:end]).all() and o[:first].isnan().all() and o[end:].isnan().all()


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nested_question_call_keeps_the_bits_outside_leaves(dtype, heads):
    """The kernel compiled with NESTED: sub-trunks' and plain questions' rows with the bits of the plain kernel
    (NESTED off), and with every range empty all rows so."""
    from flide.ops.gated_delta import branches

    r = nested_round(7)
    args = question_call(r, dtype, 15, heads)
    first = int(r["branch_start"][0])
    end = first + int(r["branch_len"].sum())
    plain = branches.branches(*args)[first:end]
    nested = branches.branches(*args, sub=(r["sub_lo"], r["sub_hi"]))[first:end]
    others = ~leaf_tokens(r)[first:end]
    assert torch.equal(nested[others], plain[others])
    empty = torch.zeros_like(r["sub_lo"])
    assert torch.equal(branches.branches(*args, sub=(empty, empty))[first:end], plain)


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stored_sub_states_match_the_recomputed_ones(dtype, heads):
    """The nested question call with the sub-trunks' stored states (`sub_slot`: leaves wait on their sub-trunk's
    flag in the same launch) against the call that re-runs each leaf's sub-trunk: non-leaf rows bitwise (the same
    token steps; a sub-trunk only adds a store), leaves within 1e-6 in fp32 (the same operations in the same order:
    bitwise in Triton's interpreter, tests/test_gated_delta_nested.py; compiled, two loops may contract
    differently), every slot taken (cap 32), only some (cap 1), none (all -1), and flags that never come (every
    leaf gives up after its polls and re-runs its sub-trunk: bitwise the recomputed call). The flags end at zero
    (at -1000 where they started there), over 20 calls."""
    from flide.ops.gated_delta import branches

    r = nested_round(9)
    args = question_call(r, dtype, 17, heads)
    first = int(r["branch_start"][0])
    end = first + int(r["branch_len"].sum())
    recomputed = branches.branches(*args, sub=(r["sub_lo"], r["sub_hi"]))[first:end]
    leaves = leaf_tokens(r)[first:end]
    assert (slots(r) >= 0).sum() > (slots(r, 1) >= 0).sum() > 0
    kept = flags()
    for _ in range(20):
        for slot in (slots(r), slots(r, 1), torch.full_like(slots(r), -1)):
            stored = branches.branches(*args, sub=(r["sub_lo"], r["sub_hi"]), sub_slot=slot,
                                       sub_flags=kept)[first:end]
            assert torch.equal(stored[~leaves], recomputed[~leaves])
            assert rel_err(stored[leaves], recomputed[leaves]) < (1e-6 if dtype == torch.float32 else 1e-2)
            assert not kept.any()
    never = torch.full_like(kept, -1000)
    gave_up = branches.branches(*args, sub=(r["sub_lo"], r["sub_hi"]), sub_slot=slots(r), sub_flags=never,
                                max_spins=4)[first:end]
    assert torch.equal(gave_up, recomputed) and (never == -1000).all()


@pytest.mark.parametrize("programs", [16, 128])
def test_row_programs_never_leave_a_leaf_waiting_in_vain(programs):
    """Row programs (the nested launch's NESTED_ROW_PROGRAMS) over a round of many more rows than programs and far
    more programs than the GPU holds at once (24 states, 169 rows; 0.8B's heads: x 16 heads x 8 value tiles): no
    leaf gives up waiting for its sub-trunk (`reruns` 0: each program's rows are a block, so the sub-trunk is in its
    own program or an earlier one, dispatched first), the flags end at zero, and the bits are a program a row's.
    Taking rows in turns (session 41) a later row of an early program waited on programs not yet dispatched: 6
    MultiRC requests' launch 247.5 ms instead of 9.4 (H100)."""
    from flide.ops.gated_delta import branches

    r = nested_round(11, states=24, shuffle=False)
    assert len(r["leaf_rows"]) > 40 and int((r["branch_len"] > 0).sum()) > programs
    args = question_call(r, torch.bfloat16, 19, HEADS[0])
    first = int(r["branch_start"][0])
    end = first + int(r["branch_len"].sum())
    # a program a row (grid order: a sub-trunk's programs before its leaves') gives up on none either, so both take
    # every leaf from its stored state: the same code, the same bits
    reruns = torch.zeros(1, dtype=torch.int32, device="cuda")
    one_each = branches.branches(*args, sub=(r["sub_lo"], r["sub_hi"]), sub_slot=slots(r), sub_flags=flags(),
                                 row_programs=0, reruns=reruns)[first:end]
    assert int(reruns) == 0
    kept = flags()
    for _ in range(5):
        blocks = branches.branches(*args, sub=(r["sub_lo"], r["sub_hi"]), sub_slot=slots(r), sub_flags=kept,
                                   row_programs=programs, reruns=reruns)[first:end]
        assert int(reruns) == 0 and not kept.any()
        assert torch.equal(blocks, one_each)


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nested_kernel_leaf_equals_its_concatenated_question(dtype, heads):
    """The question kernel alone: a leaf's rows from the nested call against the plain call over its sub-trunk's
    rows and its own as one segment from the same state (the same token steps; fp32 within 1e-5)."""
    from flide.ops.gated_delta import branches

    r = nested_round(3)
    x = inputs(r, dtype, 9, heads)
    hv = heads[1]
    finals = torch.randn(int(r["state_len"].shape[0]), hv, 128, 128, device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(4)) * 0.1
    args = (r["branch_start"], r["branch_len"], finals, r["branch_state"], SCALE, True)
    nested = branches.branches(*x, *args, sub=(r["sub_lo"], r["sub_hi"]))
    for i in r["leaf_rows"][:4]:
        start, n = int(r["branch_start"][i]), int(r["branch_len"][i])
        lo, hi = int(r["sub_lo"][start]), int(r["sub_hi"][start])
        rows = torch.cat([torch.arange(lo, hi), torch.arange(start, start + n)]).cuda()
        alone = branches.branches(*(t[rows] for t in x), torch.tensor([0], device="cuda"),
                                  torch.tensor([len(rows)], device="cuda"), finals, r["branch_state"][i:i + 1],
                                  SCALE, True)
        assert rel_err(nested[start:start + n], alone[-n:]) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nested_fork_from_round_tables(dtype):
    """The model layer's path: the state call from the round's tables (its q / k come back normalised, and the
    nested question call reads them so, use_qk_l2norm False), against the fork that derives them itself."""
    fla = resolve("gated_delta", "fla")
    r = nested_round(8)
    x = inputs(r, dtype, 11, HEADS[0])
    tables = fork_tables(*meta(r)[:4], r["state_chunks"], branch_state=r["branch_state"])
    o_t, finals_t = fla_fork(x, r, state_kernel=STATE_KERNELS[fla], tables=tables)
    o, finals = fla_fork(x, r)
    used = r["state_len"] > 0  # empty states' final rows: unwritten by the state call from the tables
    assert torch.equal(finals_t[used], finals[used])
    assert rel_err(o_t, o) < (1e-6 if dtype == torch.float32 else 1e-2)
    ref_o, _ = reference_fork(x, r)
    assert rel_err(o_t, ref_o) < TOL[dtype]


def test_nested_fork_replays_in_a_cuda_graph():
    r = nested_round(12)
    static = [t.clone() for t in inputs(r, torch.bfloat16, 1, HEADS[0])]

    def step():
        return fla_fork(static, r)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, finals = step()
    for seed in (2, 3):
        for buffer, value in zip(static, inputs(r, torch.bfloat16, seed, HEADS[0])):
            buffer.copy_(value)
        graph.replay()
        eager_o, eager_finals = step()
        assert torch.equal(o, eager_o) and torch.equal(finals, eager_finals)


def test_nested_op_opcheck_on_cuda():
    """The nested question call's custom op: fake impl, schema, no aliasing (as test_gated_delta_gpu checks the
    plain one; not the AOT-dispatch checks: rows outside its segments stay unwritten by contract)."""
    op = _NESTED[("gated_delta", "fla")]
    r = nested_round(4)
    q, k, v, decay, beta = inputs(r, torch.bfloat16, 5, HEADS[0])
    finals = torch.randn(int(r["state_len"].shape[0]), 16, 128, 128, device="cuda") * 0.1
    torch.library.opcheck(op, (q, k, v, decay, beta, r["branch_start"], r["branch_len"], finals, r["branch_state"],
                               *sub(r), SCALE, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
