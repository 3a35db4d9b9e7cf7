"""Nested forks in the gated delta rule: a leaf question's prompt is state + sub-trunk + leaf, its sub-trunk a shared
question line laid out once as a question segment of its own. The question call (`fork_parts(sub=...)` through the
variant's nested companion) runs each leaf's sub-trunk rows from its state's final state before its own rows.

Checked on a hand-built stream (2 states, two sub-trunks, 4 leaves, one placed before its sub-trunk, plain
questions, a spare branch row, tail padding): the reference's leaves equal the reference over the explicit sequence
state + sub-trunk + leaf; every other row has the bits of the fork without sub-trunks; and the Triton question kernel
compiled with NESTED (through Triton's interpreter, as tests/test_triton_kernels.py runs it: a normal run starts a
child pytest on this file with TRITON_INTERPRET=1 for the `test_triton_` checks) equals the reference, and without
sub-trunks has the bits of its plain call; with the sub-trunks' stored states (`sub_slots`: leaves wait on their
sub-trunk's flag in the same launch) it has the bits of the call that re-runs each leaf's sub-trunk. `TRITON_INTERPRET=1 python -m pytest tests/test_gated_delta_nested.py`
runs them all directly. The `fla` fork with sub-trunks on the GPU: tests/gpu/test_gated_delta_nested_gpu.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from flide.ops import registry
from flide.ops.gated_delta import (SUB_STATE_SLOTS, fork, fork_parts, gated_delta_branches_nested_triton,
                                   gated_delta_nested_reference, gated_delta_reference, new_sub_flags, sub_slots)
from flide.ops.gated_delta import reference as delta_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SCALE = 0.3


@dataclass
class NestedStream:
    """A level-major stream with sub-trunks, its tables as a round holds them."""

    T: int
    state_start: torch.Tensor
    state_len: torch.Tensor
    branch_start: torch.Tensor
    branch_len: torch.Tensor
    branch_state: torch.Tensor
    sub_lo: torch.Tensor  # [T] int32
    sub_hi: torch.Tensor
    leaves: list[tuple[int, int]]  # (branch row, its sub-trunk's branch row)
    plain: list[int]  # branch rows that are no leaf (sub-trunks and plain questions)

    def slots(self, cap: int = SUB_STATE_SLOTS) -> torch.Tensor:
        """[NB] int32: each branch row's sub-trunk state slot (`sub_slots`)."""
        return sub_slots(self.branch_start, self.branch_len, self.branch_state, self.sub_lo, self.sub_hi, cap)

    def sub(self, cap: int = SUB_STATE_SLOTS) -> tuple[torch.Tensor, ...]:
        """`fork_parts(sub=)`: the per-token ranges, the rows' slots and the flags a kernel's leaves would wait on
        (none here: the reference ignores them)."""
        return self.sub_lo, self.sub_hi, self.slots(cap), torch.zeros(0, dtype=torch.int32)


def nested_stream(sub_len: int) -> NestedStream:
    """States of 23 and 41 tokens; then questions: a leaf of P before P itself, P (a sub-trunk of `sub_len` tokens
    from state 1), two more leaves of P (4 tokens, 1 token) around a plain question of state 0, a plain question of
    state 1, a second sub-trunk P2 (state 0) and its leaf; a spare branch row (length 0); 5 rows of padding."""
    # (length, state, sub-trunk: index into this list or None)
    questions = [(3, 1, 1), (sub_len, 1, None), (4, 1, 1), (5, 0, None), (1, 1, 1), (7, 1, None), (4, 0, None),
                 (2, 0, 6)]
    return stream_of([23, 41], questions)


def ordered_stream() -> NestedStream:
    """Sub-trunks before their leaves, as a round lays a request's out (`round.RequestLayout`): three sub-trunks of
    6-9 tokens with two leaves each (3-5 tokens), from states of 23 and 41 tokens; a spare row, 5 rows of padding."""
    questions = [(9, 0, None), (3, 0, 0), (5, 0, 0), (6, 1, None), (4, 1, 3), (3, 1, 3), (8, 1, None), (5, 1, 6),
                 (4, 1, 6)]
    return stream_of([23, 41], questions)


def stream_of(states: list[int], questions: list[tuple[int, int, int | None]]) -> NestedStream:
    """The stream of these states (lengths) and questions ((length, state, the index of its sub-trunk in the list
    or None)), laid out one after the other, then a spare branch row and 5 rows of padding."""
    starts, at = [], 0
    for n in states + [n for n, _, _ in questions]:
        starts.append(at)
        at += n
    T = at + 5
    ns = len(states)
    # empty ranges of every other token hold anything (here: past the stream, reversed): only a leaf's are read
    sub_lo, sub_hi = torch.full((T,), T + 7, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
    leaves, plain = [], []
    for i, (n, _, parent) in enumerate(questions):
        start = starts[ns + i]
        if parent is None:
            plain.append(i)
            continue
        leaves.append((i, parent))
        sub_lo[start:start + n] = starts[ns + parent]
        sub_hi[start:start + n] = starts[ns + parent] + questions[parent][0]
    branch_start = torch.tensor(starts[ns:] + [0])
    branch_len = torch.tensor([n for n, _, _ in questions] + [0])
    branch_state = torch.tensor([s for _, s, _ in questions] + [0])
    return NestedStream(T, torch.tensor(starts[:ns]), torch.tensor(states), branch_start, branch_len, branch_state,
                        sub_lo, sub_hi, leaves, plain)


def inputs(T: int, heads: tuple[int, int, int, int], l2norm: bool, seed: int = 0):
    Hk, Hv, K, V = heads
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, K, generator=gen)
    k = torch.randn(T, Hk, K, generator=gen)
    if not l2norm:  # keep |k| <= ~1 so the delta rule stays contractive (as normalised keys are)
        k = F.normalize(k, dim=-1) * 0.9
    v = torch.randn(T, Hv, V, generator=gen)
    g = -F.softplus(torch.randn(T, Hv, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(T, Hv, generator=gen))
    return q, k, v, g, beta


def rows_of(s: NestedStream, i: int) -> list[int]:
    start, n = int(s.branch_start[i]), int(s.branch_len[i])
    return list(range(start, start + n))


def state_rows(s: NestedStream, i: int) -> list[int]:
    start, n = int(s.state_start[i]), int(s.state_len[i])
    return list(range(start, start + n))


def fork_args(s: NestedStream, x):
    return (*x, s.state_start, s.state_len, s.branch_start, s.branch_len, s.branch_state, SCALE)


def one_segment(x, rows: list[int], l2norm: bool):
    """The reference over x's `rows` as one segment from a zero state: (o [len, Hv, V], final [Hv, K, V])."""
    parts = [t[rows] for t in x]
    Hv, K, V = x[2].shape[1], x[1].shape[2], x[2].shape[2]
    o, final = delta_ref.gated_delta(*parts, torch.tensor([0]), torch.tensor([len(rows)]), torch.zeros(0, Hv, K, V),
                                     torch.tensor([-1]), SCALE, l2norm)
    return o, final[0]


HEADS = [(2, 4, 16, 16), (1, 3, 12, 20)]  # grouped value heads; K padded to 16 and V over partial tiles (Triton)
CASES = [(6, HEADS[0], True), (70, HEADS[0], True), (6, HEADS[1], False), (70, HEADS[1], True)]
IDS = [f"sub{n}-Hk{h[0]}-Hv{h[1]}-K{h[2]}-V{h[3]}-{'l2' if l2 else 'nol2'}" for n, h, l2 in CASES]


# ---------------------------------------------------------------------------------------------------------------------
# the reference (and fork_parts' plumbing)
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sub_len,heads,l2norm", CASES, ids=IDS)
def test_reference_leaves_equal_the_concatenated_sequence(sub_len, heads, l2norm):
    """(a) Each leaf's rows (and final state) equal the reference over state + sub-trunk + leaf as ONE segment from
    zero (its last rows); sub-trunks and plain questions equal state + question. A 70-token sub-trunk puts a leaf
    over two 64-token chunks of its own gathered rows."""
    s = nested_stream(sub_len)
    x = inputs(s.T, heads, l2norm, seed=sub_len)
    o, finals = fork(gated_delta_reference, *fork_args(s, x), l2norm, sub=s.sub(),
                     nested_kernel=gated_delta_nested_reference)
    _, question_finals = delta_ref.gated_delta(*x, s.branch_start, s.branch_len, finals, s.branch_state, SCALE,
                                               l2norm, s.sub_lo, s.sub_hi)
    for leaf, parent in s.leaves:
        prompt = state_rows(s, int(s.branch_state[leaf])) + rows_of(s, parent) + rows_of(s, leaf)
        want_o, want_final = one_segment(x, prompt, l2norm)
        n = int(s.branch_len[leaf])
        torch.testing.assert_close(o[rows_of(s, leaf)], want_o[-n:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(question_finals[leaf], want_final, atol=1e-5, rtol=1e-5)
    for i in s.plain:
        prompt = state_rows(s, int(s.branch_state[i])) + rows_of(s, i)
        want_o, want_final = one_segment(x, prompt, l2norm)
        torch.testing.assert_close(o[rows_of(s, i)], want_o[-int(s.branch_len[i]):], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(question_finals[i], want_final, atol=1e-5, rtol=1e-5)
    # the spare row (length 0) hands its initial state through; the padding stays zero
    assert torch.equal(question_finals[-1], finals[int(s.branch_state[-1])])
    assert torch.count_nonzero(o[int(s.branch_start[-2] + s.branch_len[-2]):]) == 0


@pytest.mark.parametrize("sub_len,heads,l2norm", CASES, ids=IDS)
def test_reference_rows_outside_leaves_keep_their_bits(sub_len, heads, l2norm):
    """(b) Every row of a state, a sub-trunk or a plain question, the states' final states and the questions' final
    states: the same bits as the fork without sub-trunks (and the plain call with sub_lo / sub_hi None as before)."""
    s = nested_stream(sub_len)
    x = inputs(s.T, heads, l2norm, seed=sub_len + 1)
    o, finals = fork(gated_delta_reference, *fork_args(s, x), l2norm, sub=s.sub(),
                     nested_kernel=gated_delta_nested_reference)
    o_plain, finals_plain = fork(gated_delta_reference, *fork_args(s, x), l2norm)
    assert torch.equal(finals, finals_plain)
    leaf_rows = [t for leaf, _ in s.leaves for t in rows_of(s, leaf)]
    others = torch.ones(s.T, dtype=torch.bool)
    others[leaf_rows] = False
    assert torch.equal(o[others], o_plain[others])
    assert not torch.equal(o[leaf_rows], o_plain[leaf_rows])  # the leaves did change
    # the questions' final states: a non-leaf's as without sub-trunks
    args = (*x, s.branch_start, s.branch_len, finals, s.branch_state, SCALE, l2norm)
    _, nested_finals = delta_ref.gated_delta(*args, s.sub_lo, s.sub_hi)
    _, plain_finals = delta_ref.gated_delta(*args)
    assert torch.equal(nested_finals[s.plain], plain_finals[s.plain])
    # all ranges empty: the plain call's bits exactly
    empty = torch.zeros_like(s.sub_lo)
    out_empty, finals_empty = delta_ref.gated_delta(*args, empty, empty)
    out_none, finals_none = delta_ref.gated_delta(*args)
    assert torch.equal(out_empty, out_none) and torch.equal(finals_empty, finals_none)


def test_fork_parts_refuses_sub_without_a_nested_call_or_with_wy():
    s = nested_stream(6)
    x = inputs(s.T, HEADS[0], True)
    with pytest.raises(ValueError, match="nested_kernel"):
        fork_parts(gated_delta_reference, *fork_args(s, x), True, sub=s.sub())
    with pytest.raises(ValueError, match="WY"):
        fork_parts(gated_delta_reference, *fork_args(s, x), True, wy=True, sub=s.sub(),
                   nested_kernel=gated_delta_nested_reference)
    with pytest.raises(ValueError, match="sub_lo"):
        delta_ref.gated_delta(*x, s.branch_start, s.branch_len, torch.zeros(0, 4, 16, 16), s.branch_state, SCALE,
                              True, s.sub_lo)


def test_fork_parts_refuses_chunked_questions_without_their_variant_or_tables():
    """`fork_parts(chunked=True)`: a variant outside CHUNKED_QUESTION_KERNELS, or round tables without the questions'
    chunk rows (`fork_tables` without `branch_chunks`), is a clear error, not a wrong call."""
    import random

    from flide.ops.gated_delta import fork_tables
    from flide.testing import random_round_tensors

    r = random_round_tensors(random.Random(2), 200, max_requests=3, max_questions=3, max_state=40, max_question=12)
    x = inputs(200, HEADS[0], True)
    meta = (r.state_start, r.state_len, r.branch_start, r.branch_len, r.branch_state)
    for branch_chunks in (r.branch_chunks, None):
        tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, branch_chunks,
                             branch_state=r.branch_state)
        with pytest.raises(ValueError, match="CHUNKED_QUESTION_KERNELS"):
            fork_parts(gated_delta_reference, *x, *meta, SCALE, False, state_kernel=gated_delta_reference,
                       tables=tables, laid_out=True, chunked=True)


def test_nested_rows_and_the_combined_tables_that_leave_them_out():
    """`nested_rows`: the leaves and the sub-trunks they continue (not the plain questions, the spare row or a
    sub-trunk no leaf names). `fla.combined_tables(skip_branches=)`: those rows' chunk rows name the trailing empty
    sequence (spare rows, which fla's steps skip), every other chunk row and every sequence bound as without it."""
    from flide.ops.gated_delta import fla, nested_rows

    s = nested_stream(70)
    nested = nested_rows(s.branch_start, s.branch_len, s.sub_lo, s.sub_hi)
    assert nested.tolist() == [True, True, True, False, True, False, True, True, False]
    state_cu = fla.bounds(s.state_start, s.state_len)
    state_chunks = fla.chunk_table(state_cu, 4)
    branch_chunks = fla.chunk_table(fla.bounds(s.branch_start, s.branch_len), 12)
    ns, nb = len(s.state_len), len(s.branch_len)
    cu, rows = fla.combined_tables(state_cu, state_chunks, s.branch_len, branch_chunks)
    cu_skip, rows_skip = fla.combined_tables(state_cu, state_chunks, s.branch_len, branch_chunks, nested)
    assert torch.equal(cu_skip, cu) and torch.equal(rows_skip[:4], rows[:4])
    for row, skipped, (seq, chunk) in zip(rows[4:].tolist(), rows_skip[4:].tolist(), branch_chunks.tolist()):
        if seq < nb and nested[seq]:
            assert skipped == [ns + nb, chunk] and cu[ns + nb] == cu[ns + nb + 1]
        else:
            assert skipped == row
    assert sum(seq < nb and bool(nested[seq]) for seq, _ in branch_chunks.tolist()) == 7  # P: two chunks


def test_fork_parts_passes_the_ranges_to_the_question_call_only():
    """The nested companion replaces the question call (`branch_kernel` too), with the round's ranges; the state
    call runs as without them."""
    s = nested_stream(6)
    x = inputs(s.T, HEADS[0], True)
    seen = []

    def nested(*args):
        seen.append(args)
        return gated_delta_nested_reference(*args)

    def never(*args):
        raise AssertionError("the plain question call ran in a nested fork")

    sub = s.sub()
    parts = fork_parts(gated_delta_reference, *fork_args(s, x), True, branch_kernel=never, sub=sub,
                       nested_kernel=nested)
    plain = fork_parts(gated_delta_reference, *fork_args(s, x), True)
    assert len(seen) == 1 and all(seen[0][9 + i] is t for i, t in enumerate(sub))
    assert torch.equal(parts.o_states, plain.o_states) and torch.equal(parts.finals, plain.finals)


def test_nested_companions_are_registered():
    assert registry._NESTED[("gated_delta", "reference")] is gated_delta_nested_reference
    assert registry._NESTED[("gated_delta", "fla")] is gated_delta_branches_nested_triton
    for variant in ("fla_wy", "fla_cuda"):  # nested forks stay off with these
        assert ("gated_delta", variant) not in registry._NESTED


def test_opcheck_nested_reference():
    s = nested_stream(6)
    q, k, v, g, beta = inputs(s.T, HEADS[0], True)
    initial = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3)) * 0.5
    args = (q, k, v, g, beta, s.branch_start, s.branch_len, initial, s.branch_state, *s.sub(), SCALE, True)
    torch.library.opcheck(gated_delta_nested_reference, args)
    out = gated_delta_nested_reference(*args)
    assert out.shape == v.shape and out.dtype == q.dtype
    # the slots change nothing in the reference (every leaf re-runs its sub-trunk's rows)
    no_slots = torch.full_like(s.slots(), -1)
    assert torch.equal(gated_delta_nested_reference(*args[:11], no_slots, *args[12:]), out)


# ---------------------------------------------------------------------------------------------------------------------
# the sub-trunk state slots (`sub_slots`, derived once per forward)
# ---------------------------------------------------------------------------------------------------------------------

def test_sub_slots_of_the_hand_built_stream():
    """Rows: leaf of P, P, leaf of P, plain, leaf of P, plain, P2, leaf of P2, spare: P and P2 take slots 0 and 1 in
    row order (a leaf before its sub-trunk too), their leaves the same, every other row -1; past the cap, -1 for the
    sub-trunk and its leaves alike (those leaves re-run their sub-trunk)."""
    s = nested_stream(6)
    assert s.slots().dtype == torch.int32
    assert s.slots().tolist() == [0, 0, 0, -1, 0, -1, 1, 1, -1]
    assert s.slots(1).tolist() == [0, 0, 0, -1, 0, -1, -1, -1, -1]
    assert s.slots(0).tolist() == [-1] * 9


def test_sub_slots_only_where_the_stored_state_is_the_leafs():
    """A leaf whose range is not exactly one row of its own state keeps -1 (it re-runs its range), and a sub-trunk
    only some of whose leaves name it exactly still takes its slot for them."""
    s = nested_stream(6)
    lo, hi = s.sub_lo.clone(), s.sub_hi.clone()
    first = int(s.branch_start[0])  # leaf 0 of P: a range one token short of P
    s.sub_hi[first:first + int(s.branch_len[0])] -= 1
    s.branch_state[7] = 1  # P2's leaf forking from state 1, P2 from state 0: another state's sub-trunk
    assert s.slots().tolist() == [-1, 0, 0, -1, 0, -1, -1, -1, -1]
    s.sub_lo, s.sub_hi, s.branch_state[7] = lo, hi, 0
    s.branch_start[-1] = s.T - 1  # a spare row's start anywhere in the stream (the GPU tests' rounds put it at the end)
    assert s.slots().tolist() == [0, 0, 0, -1, 0, -1, 1, 1, -1]


# ---------------------------------------------------------------------------------------------------------------------
# the Triton question kernel (the `fla` variant's nested companion), in Triton's interpreter
# ---------------------------------------------------------------------------------------------------------------------

if not INTERPRETED:
    def test_triton_in_the_interpreter():
        """Runs this file's `test_triton_*` checks in a child process with TRITON_INTERPRET=1."""
        from flide.testing import run_in_triton_interpreter

        run_in_triton_interpreter(__file__, "test_triton_", 20)

else:
    from triton.runtime.interpreter import InterpretedFunction

    from flide.ops.gated_delta import branches as delta_branches

    def poisoned(*shape) -> torch.Tensor:
        return torch.full(shape, float("nan"))

    def question_call(s: NestedStream, x, l2norm: bool):
        """The states' final states (reference state call) and the question call's arguments."""
        Hv, K, V = x[2].shape[1], x[1].shape[2], x[2].shape[2]
        none = torch.full_like(s.state_start, -1)
        _, finals = delta_ref.gated_delta(*x, s.state_start, s.state_len, torch.zeros(0, Hv, K, V), none, SCALE,
                                          l2norm)
        return finals, (*x, s.branch_start, s.branch_len, finals, s.branch_state, SCALE, l2norm)

    def question_rows(s: NestedStream) -> torch.Tensor:
        rows = torch.zeros(s.T, dtype=torch.bool)
        for i in range(len(s.branch_len)):
            rows[rows_of(s, i)] = True
        return rows

    def test_triton_kernel_is_interpreted():
        assert isinstance(delta_branches._branch_kernel, InterpretedFunction)

    @pytest.mark.parametrize("tiles", [None, (16, 1, 2)], ids=["program-per-row", "row-programs-2"])
    @pytest.mark.parametrize("sub_len,heads,l2norm", CASES, ids=IDS)
    def test_triton_nested_matches_the_reference(sub_len, heads, l2norm, tiles):
        """(c) The nested question call equals the reference's within 1e-5 on every question row (all written:
        NaN-poisoned), rows outside the questions unwritten; the final states too (`final=`)."""
        s = nested_stream(sub_len)
        x = inputs(s.T, heads, l2norm, seed=sub_len + 2)
        Hv, K, V = heads[1:]
        _, args = question_call(s, x, l2norm)
        want, want_final = delta_ref.gated_delta(*args, s.sub_lo, s.sub_hi)
        final = torch.empty(len(s.branch_len), Hv, K, V)
        out = delta_branches.branches(*args, out=poisoned(s.T, Hv, V), tiles=tiles, final=final,
                                      sub=(s.sub_lo, s.sub_hi))
        rows = question_rows(s)
        torch.testing.assert_close(out[rows], want[rows], atol=1e-5, rtol=1e-5)
        assert out[~rows].isnan().all()
        torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("sub_len,heads,l2norm", CASES, ids=IDS)
    def test_triton_plain_call_keeps_its_bits(sub_len, heads, l2norm):
        """(d) Without sub-trunks the kernel's bits are its plain call's: the nested call with every range empty,
        and the nested call's non-leaf rows, equal the call without `sub` bitwise. And a leaf has the bits of the
        plain call over its sub-trunk's rows and its own as one segment (the same steps in the same order)."""
        s = nested_stream(sub_len)
        x = inputs(s.T, heads, l2norm, seed=sub_len + 3)
        Hv, V = heads[1], heads[3]
        _, args = question_call(s, x, l2norm)
        plain = delta_branches.branches(*args, out=poisoned(s.T, Hv, V))
        empty = torch.zeros_like(s.sub_lo)
        assert torch.equal(delta_branches.branches(*args, out=poisoned(s.T, Hv, V), sub=(empty, empty)).nan_to_num(),
                           plain.nan_to_num())
        nested = delta_branches.branches(*args, out=poisoned(s.T, Hv, V), sub=(s.sub_lo, s.sub_hi))
        for i in s.plain:
            assert torch.equal(nested[rows_of(s, i)], plain[rows_of(s, i)])
        for leaf, parent in s.leaves:
            rows = rows_of(s, parent) + rows_of(s, leaf)
            alone = delta_branches.branches(*(t[rows] for t in x), torch.tensor([0]), torch.tensor([len(rows)]),
                                            args[7], s.branch_state[leaf:leaf + 1], SCALE, l2norm)
            assert torch.equal(nested[rows_of(s, leaf)], alone[-len(rows_of(s, leaf)):])

    @pytest.mark.parametrize("tiles", [None, (16, 1, 2)], ids=["program-per-row", "row-programs-2"])
    @pytest.mark.parametrize("sub_len,heads,l2norm", CASES, ids=IDS)
    def test_triton_stored_sub_states_keep_the_bits(sub_len, heads, l2norm, tiles):
        """(e) With the sub-trunks' stored states (`sub_slot`: leaves with a slot wait on their sub-trunk's flag and
        start from its state after its tokens) every output row and final state has the bits of the call that
        re-runs each leaf's sub-trunk: all sub-trunks with a slot, only the first (cap 1), none (every slot -1), and
        flags that never come (each leaf gives up after its polls and re-runs its sub-trunk). The interpreter runs
        the programs one by one in grid order, so P's first leaf (a row before P) always gives up too. The flags
        are zero again after every call (what lets a layer keep them); every question row and final state written
        (NaN-poisoned), nothing else; and within 1e-5 of the reference."""
        s = nested_stream(sub_len)
        x = inputs(s.T, heads, l2norm, seed=sub_len + 4)
        Hv, K, V = heads[1:]
        _, args = question_call(s, x, l2norm)

        def call(sub_slot, flags=None):
            final = poisoned(len(s.branch_len), Hv, K, V)
            out = delta_branches.branches(*args, out=poisoned(s.T, Hv, V), tiles=tiles, final=final,
                                          sub=(s.sub_lo, s.sub_hi), sub_slot=sub_slot, sub_flags=flags, max_spins=2)
            return out, final

        rows = question_rows(s)
        recomputed, recomputed_final = call(None)
        assert s.slots().max() == 1 and (s.slots(1) == 0).sum() == 4  # the cases below: both slots, one, none
        never = torch.full_like(new_sub_flags(Hv, V), -1000)  # a flag no sub-trunk's count lifts above zero
        for sub_slot, flags in ((s.slots(), new_sub_flags(Hv, V)), (s.slots(1), new_sub_flags(Hv, V)),
                                (torch.full_like(s.slots(), -1), new_sub_flags(Hv, V)), (s.slots(), never.clone())):
            before = flags.clone()
            out, final = call(sub_slot, flags)
            assert torch.equal(out[rows], recomputed[rows]) and out[~rows].isnan().all()
            assert torch.equal(final, recomputed_final)
            assert torch.equal(flags, before)
        want, want_final = delta_ref.gated_delta(*args, s.sub_lo, s.sub_hi)
        out, final = call(s.slots())
        torch.testing.assert_close(out[rows], want[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("programs", [2, 4])
    def test_triton_row_programs_never_wait_on_a_later_program(programs):
        """(g) Row programs fewer than the rows (`row_programs`, the nested launch's NESTED_ROW_PROGRAMS): each takes a
        block of consecutive rows, so a leaf's sub-trunk (an earlier row) is in its own program or an earlier one.
        The interpreter runs the programs one by one in grid order, so a leaf that waited on a later program would
        give up (`reruns`); none does, and the bits are a program a row's. On the GPU such a wait spun out MAX_SPINS
        polls whenever the later program was not yet dispatched: with rows in turns (i, i + P, ..., session 41),
        6 MultiRC requests' nested launch took 247.5 ms instead of 9.4 (H100). In turns, here a leaf at row 4 (P = 2:
        program 0) would wait on its sub-trunk at row 3 (program 1)."""
        s = ordered_stream()
        heads = HEADS[0]
        x = inputs(s.T, heads, True, seed=programs)
        Hv, K, V = heads[1:]
        _, args = question_call(s, x, True)
        slots = s.slots()
        assert (slots >= 0).sum() == 9 and len(s.branch_len) > 2 * programs
        rows = question_rows(s)
        one_each = delta_branches.branches(*args, out=poisoned(s.T, Hv, V), sub=(s.sub_lo, s.sub_hi), sub_slot=slots,
                                           sub_flags=new_sub_flags(Hv, V), max_spins=2, row_programs=0)
        flags, reruns = new_sub_flags(Hv, V), torch.zeros(1, dtype=torch.int32)
        blocks = delta_branches.branches(*args, out=poisoned(s.T, Hv, V), sub=(s.sub_lo, s.sub_hi), sub_slot=slots,
                                         sub_flags=flags, max_spins=2, row_programs=programs, reruns=reruns)
        assert int(reruns) == 0 and not flags.any()
        assert torch.equal(blocks[rows], one_each[rows]) and blocks[~rows].isnan().all()
        # the counter counts: flags no sub-trunk lifts make every leaf with a slot give up (6 leaves x V tiles)
        never, reruns = torch.full_like(new_sub_flags(Hv, V), -1000), torch.zeros(1, dtype=torch.int32)
        delta_branches.branches(*args, sub=(s.sub_lo, s.sub_hi), sub_slot=slots, sub_flags=never, max_spins=2,
                                row_programs=programs, reruns=reruns)
        assert int(reruns) == 6 * Hv * -(-V // delta_branches.BLOCK_V)

    def test_triton_leaves_with_a_slot_start_from_the_stored_state():
        """(f) A leaf with a slot runs from the state stored in that slot, not from its own range: P2's leaf handed
        P's slot (P's row comes before it) has the bits of the plain call over P's rows and its own as one segment
        from P's state (so it read the slot and skipped `_sub_trunk`), and the flags end at zero (P counted it)."""
        s = nested_stream(6)
        x = inputs(s.T, HEADS[0], True, seed=9)
        _, args = question_call(s, x, True)
        wrong = s.slots().clone()
        p, p2 = 1, 6  # P's and P2's branch rows
        moved = [leaf for leaf, parent in s.leaves if parent == p2]
        wrong[moved] = int(wrong[p])
        flags = new_sub_flags(*HEADS[0][1::2])
        out = delta_branches.branches(*args, sub=(s.sub_lo, s.sub_hi), sub_slot=wrong, sub_flags=flags, max_spins=2)
        assert moved and not flags.any()
        for leaf, parent in s.leaves:
            rows = rows_of(s, p if parent == p2 else parent) + rows_of(s, leaf)
            alone = delta_branches.branches(*(t[rows] for t in x), torch.tensor([0]), torch.tensor([len(rows)]),
                                            args[7], s.branch_state[p:p + 1] if parent == p2 else
                                            s.branch_state[leaf:leaf + 1], SCALE, True)
            assert torch.equal(out[rows_of(s, leaf)], alone[-len(rows_of(s, leaf)):])

    def test_triton_nested_refuses_the_chunk_form_and_snapshots():
        s = nested_stream(6)
        x = inputs(s.T, HEADS[0], True)
        _, args = question_call(s, x, True)
        sub = (s.sub_lo, s.sub_hi)
        with pytest.raises(ValueError, match="recurrent form"):
            delta_branches.branches(*args, form="chunk", sub=sub)
        with pytest.raises(ValueError, match="snapshot"):
            delta_branches.branches(*args, sub=sub, snapshot=(torch.zeros_like(s.branch_start),
                                                              torch.empty(len(s.branch_len), 4, 16, 16)))
        with pytest.raises(ValueError, match="int32"):
            delta_branches.branches(*args, sub=(s.sub_lo.long(), s.sub_hi.long()))
        with pytest.raises(ValueError, match="sub_slot"):
            delta_branches.branches(*args, sub=sub, sub_slot=s.slots().long())
        with pytest.raises(ValueError, match="sub_slot"):
            delta_branches.branches(*args, sub_slot=s.slots())
        with pytest.raises(ValueError, match="`reruns` needs"):
            delta_branches.branches(*args, sub=sub, sub_slot=s.slots(), reruns=torch.zeros(2, dtype=torch.int32))
        with pytest.raises(ValueError, match="sub_flags"):  # too few flags for the heads
            delta_branches.branches(*args, sub=sub, sub_slot=s.slots(), sub_flags=new_sub_flags(1, 1))
