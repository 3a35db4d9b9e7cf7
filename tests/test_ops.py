"""Every registered op of `flide.ops` against its naive oracle, and every custom op through `torch.library.opcheck`.

CPU, float32. The oracles are deliberately dumb: per-token / per-head loops in float64 (`*_naive` in each
reference), or the *standalone* computation a question would get on its own: its state followed by its own tokens,
run through plain causal attention, `conv1d`, or the token-by-token recurrence from a zero state. The flat stream
must give exactly that at the question's rows.

Random rounds are laid out by `flide.round.build_round` from fake requests, and the helper below recomputes the
metadata it expects independently (`test_random_round_metadata`), so the op tests don't just trust the builder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flide.ops
from flide.config import KernelConfig
from flide.ops import OP_FAMILIES, resolve, variants
from flide.ops.fork_attention import reference as attn_ref
from flide.ops.gated_delta import fork as gated_delta_fork
from flide.ops.gated_delta import reference as gdn_ref
from flide.requests import Branch, PreparedRequest
from flide.round import RoundTensors, Shape, build_round

DTYPE = torch.float32


# ---------------------------------------------------------------------------------------------------------------------
# Random rounds
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class Segment:
    """One state (trunk) of the stream and the question branches forked from it (stream row ranges)."""

    request: int
    state: range
    branches: list[range]


@dataclass
class FakeRound:
    tensors: RoundTensors
    tokens: int  # T, pad included
    used: int  # real tokens; rows used..T-1 are tail padding
    segments: list[Segment]  # in stream order

    @property
    def t(self) -> RoundTensors:
        return self.tensors

    def request_rows(self, request: int) -> list[int]:
        rows = []
        for s in self.segments:
            if s.request == request:
                rows += list(s.state) + [i for b in s.branches for i in b]
        return rows


def random_structure(rng: np.random.Generator, n_requests: int = 4, max_state: int = 12, max_branch: int = 6,
                     forced_state_lens: tuple[int, ...] = (0, 1, 2)) -> list[list[tuple[int, list[int]]]]:
    """[request][state] -> (state length, [branch lengths]). States of length `forced_state_lens` always appear (in
    random places); a request has one state, sometimes two (templates that print the question type first)."""
    n_states = [1 if rng.random() < 0.7 else 2 for _ in range(n_requests)]
    total = sum(n_states)
    lens = list(forced_state_lens)[:total]
    lens += [int(x) for x in rng.integers(0, max_state + 1, size=total - len(lens))]
    lens = [lens[i] for i in rng.permutation(total)]
    structure, it = [], iter(lens)
    for n in n_states:
        structure.append([(next(it), [int(x) for x in rng.integers(1, max_branch + 1, size=rng.integers(1, 7))])
                          for _ in range(n)])
    return structure


def make_round(structure: list[list[tuple[int, list[int]]]], pad: int = 3, spare_states: int = 2,
               spare_branches: int = 3, seed: int = 0) -> FakeRound:
    """Lays out `structure` through `build_round` (fake requests: random token ids, one read at each branch's last
    token, options [[1, 2]]), with `pad` tail tokens and unused zero-length rows in the segment tables. Also records
    where each state and branch lies, computed here, independently of `build_round`."""
    rng = np.random.default_rng(seed)
    requests, segments, reads = [], [], 0
    # Level-major layout: every state (request by request), then every question (request by request, grouped by
    # state), then the tail padding
    cursor = 0
    branch_cursor = sum(state_len for states in structure for state_len, _ in states)
    for r, states in enumerate(structure):
        trunks, branches = [], []
        for t, (state_len, branch_lens) in enumerate(states):
            trunks.append(rng.integers(10, 1000, size=state_len).astype(np.int64))
            state = range(cursor, cursor + state_len)
            cursor += state_len
            ranges = []
            for n in branch_lens:
                branches.append(Branch(trunk=t, tokens=rng.integers(10, 1000, size=n).astype(np.int64),
                                       reads=np.asarray([state_len + n - 1], dtype=np.int64), questions=[None],
                                       tail=np.zeros(0, dtype=np.int64), options=[[1, 2]]))
                ranges.append(range(branch_cursor, branch_cursor + n))
                branch_cursor += n
                reads += 1
            segments.append(Segment(r, state, ranges))
        # build_round groups a request's branches by trunk, each trunk's in request order: hand them over with the
        # trunks interleaved at random (each trunk's own order kept), so the recorded ranges stay valid
        labels = [branch.trunk for branch in branches]
        queues = {tr: [b for b in branches if b.trunk == tr] for tr in set(labels)}
        requests.append(PreparedRequest(trunks, [queues[tr].pop(0) for tr in rng.permutation(labels)]))
    cursor = branch_cursor
    n_states = sum(len(s) for s in structure)
    n_branches = sum(len(b) for s in structure for _, b in s)
    shape = Shape(tokens=cursor + pad, states=n_states + spare_states, branches=n_branches + spare_branches,
                  readout_rows=reads + 1, options=2)
    built = build_round(requests, shape, pad_id=0)
    assert built.used_tokens == cursor
    return FakeRound(built.tensors, cursor + pad, cursor, segments)


def expected_metadata(fr: FakeRound) -> dict[str, torch.Tensor]:
    """seg_lo / trunk_lo / trunk_hi and the segment tables, from the recorded layout alone."""
    T = fr.tokens
    seg_lo, trunk_lo, trunk_hi = torch.arange(T), torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long)
    ss, sl, bs, bl, bst, reads = [], [], [], [], [], []
    for k, s in enumerate(fr.segments):
        seg_lo[s.state.start:s.state.stop] = s.state.start
        ss.append(s.state.start), sl.append(len(s.state))
        for b in s.branches:
            seg_lo[b.start:b.stop] = b.start
            trunk_lo[b.start:b.stop], trunk_hi[b.start:b.stop] = s.state.start, s.state.stop
            bs.append(b.start), bl.append(len(b)), bst.append(k)
            reads.append(b.stop - 1)

    def padded(values, n):
        out = torch.zeros(n, dtype=torch.long)
        out[:len(values)] = torch.tensor(values, dtype=torch.long)
        return out

    t = fr.tensors
    return dict(seg_lo=seg_lo, trunk_lo=trunk_lo, trunk_hi=trunk_hi,
                state_start=padded(ss, len(t.state_start)), state_len=padded(sl, len(t.state_len)),
                branch_start=padded(bs, len(t.branch_start)), branch_len=padded(bl, len(t.branch_len)),
                branch_state=padded(bst, len(t.branch_state)), readout_rows=padded(reads, len(t.readout_rows)))


ROUND_SEEDS = [0, 1, 2]


@pytest.fixture(scope="module", params=ROUND_SEEDS, ids=[f"round{s}" for s in ROUND_SEEDS])
def rnd(request) -> FakeRound:
    seed = request.param
    return make_round(random_structure(np.random.default_rng(seed)), pad=int(seed) * 2 + 1, seed=seed)


def test_random_round_metadata(rnd):
    """The helper's rounds are what the ops expect: build_round's metadata matches the layout computed here (the
    per-token tables int32, the rest int64)."""
    for name, want in expected_metadata(rnd).items():
        got = getattr(rnd.t, name)
        dtype = torch.int32 if name in ("seg_lo", "trunk_lo", "trunk_hi") else torch.int64
        assert got.dtype == dtype and torch.equal(got.long(), want), name
    lens = [len(s.state) for s in rnd.segments]
    assert 0 in lens and 1 in lens
    assert rnd.tokens > rnd.used  # tail padding


def standalone_rows(segment: Segment, branch: range) -> list[int]:
    """Stream rows of the standalone prompt of `branch`: its state, then its own tokens."""
    return list(segment.state) + list(branch)


def impl(op: str, variant: str):
    """The registered implementation, or a skip (with the registry's reason) for a variant that can't run here, or
    whose custom op has CUDA kernels only (these tests pass CPU tensors; such variants have their own tests under
    tests/gpu, and the Triton ones run on the CPU in tests/test_triton_kernels.py)."""
    try:
        fn = resolve(op, variant)
    except ValueError as error:
        if "cannot run here" in str(error):
            pytest.skip(str(error))
        raise
    backends = getattr(fn, "_backend_fns", {None: fn})  # a torch.library custom op's kernels by device type
    if None not in backends and "cpu" not in backends:
        pytest.skip(f"{op}/{variant} has CUDA kernels only")
    return fn


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE) * scale


# ---------------------------------------------------------------------------------------------------------------------
# fork_attention
# ---------------------------------------------------------------------------------------------------------------------

HEADS = [pytest.param(4, 2, id="gqa-hq4-hkv2"), pytest.param(2, 2, id="mha-hq2-hkv2")]
HEAD_DIMS = [pytest.param(16, id="d16"), pytest.param(32, id="d32")]


def attn_inputs(T: int, hq: int, hkv: int, d: int, seed: int):
    return randn(T, hq, d, seed=seed), randn(T, hkv, d, seed=seed + 1), randn(T, hkv, d, seed=seed + 2)


def causal_attention(q, k, v, scale):
    """Plain causal attention of one standalone sequence, [L, H, D] (GQA by repeating key heads)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.transpose(0, 1).double(),
                                         v.transpose(0, 1).double(), is_causal=True, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


@pytest.mark.parametrize("variant", variants("fork_attention"))
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("block", [pytest.param(None, id="block-default"), pytest.param(7, id="block7")])
def test_fork_attention_vs_naive(rnd, variant, hq, hkv, d, block, monkeypatch):
    if block is not None:  # small query blocks: the per-block key window must still hold every visible key
        monkeypatch.setattr(attn_ref, "QUERY_BLOCK", block)
    op = impl("fork_attention", variant)
    t = rnd.t
    q, k, v = attn_inputs(rnd.tokens, hq, hkv, d, seed=d + hq)
    scale = d ** -0.5
    got = op(q, k, v, t.seg_lo, t.trunk_lo, t.trunk_hi, scale)
    want = attn_ref.fork_attention_naive(q, k, v, t.seg_lo, t.trunk_lo, t.trunk_hi, scale)
    assert got.shape == (rnd.tokens, hq, d) and got.dtype == DTYPE
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", variants("fork_attention"))
@pytest.mark.parametrize("hq,hkv", HEADS)
def test_fork_attention_matches_standalone(rnd, variant, hq, hkv):
    """Every question of a random round sees exactly its state and its own earlier tokens; states see themselves."""
    op = impl("fork_attention", variant)
    t, d = rnd.t, 16
    q, k, v = attn_inputs(rnd.tokens, hq, hkv, d, seed=7)
    got = op(q, k, v, t.seg_lo, t.trunk_lo, t.trunk_hi, d ** -0.5)
    for s in rnd.segments:
        for b in s.branches:
            rows = standalone_rows(s, b)
            want = causal_attention(q[rows], k[rows], v[rows], d ** -0.5)
            torch.testing.assert_close(got[list(b)], want[len(s.state):], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[list(s.state)], want[:len(s.state)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", variants("fork_attention"))
@pytest.mark.parametrize("state_len", [0, 1, 9])
def test_fork_attention_one_state_two_questions(variant, state_len):
    """[state][q1][q2]: q1's rows are causal attention over [state][q1], q2's over [state][q2]."""
    op = impl("fork_attention", variant)
    fr = make_round([[(state_len, [5, 4])]], pad=2)
    t, (seg,) = fr.t, fr.segments
    q1, q2 = seg.branches
    q, k, v = attn_inputs(fr.tokens, 4, 2, 16, seed=3)
    got = op(q, k, v, t.seg_lo, t.trunk_lo, t.trunk_hi, 0.25)
    for b in (q1, q2):
        rows = standalone_rows(seg, b)
        want = causal_attention(q[rows], k[rows], v[rows], 0.25)
        torch.testing.assert_close(got[list(b)], want[state_len:], atol=1e-5, rtol=1e-5)
    # a pad token attends to itself only
    torch.testing.assert_close(got[fr.used:], v[fr.used:].repeat_interleave(2, dim=1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", variants("fork_attention"))
@pytest.mark.parametrize("block", [pytest.param(None, id="block-default"), pytest.param(5, id="block5")])
def test_fork_attention_requests_independent(variant, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr(attn_ref, "QUERY_BLOCK", block)
    op = impl("fork_attention", variant)
    rng = np.random.default_rng(11)
    structure = random_structure(rng, n_requests=3)
    fr = make_round(structure, pad=4)
    t = fr.t
    q, k, v = attn_inputs(fr.tokens, 4, 2, 16, seed=5)
    base = op(q, k, v, t.seg_lo, t.trunk_lo, t.trunk_hi, 0.25)
    # 1. other requests' values change (same layout): request 0's and request 2's rows are bit-identical
    other = fr.request_rows(1)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[other] = randn(len(other), *x.shape[1:], seed=99, scale=30.0)
    changed = op(q2, k2, v2, t.seg_lo, t.trunk_lo, t.trunk_hi, 0.25)
    for r in (0, 2):
        rows = fr.request_rows(r)
        assert torch.equal(changed[rows], base[rows])
    assert not torch.equal(changed[other], base[other])
    # 2. another request is inserted in front (every segment moves): each request's rows, moved, agree to 1e-6
    extra = [(6, [3, 2])]
    fr2 = make_round([extra] + structure, pad=4)
    t2 = fr2.t

    def moved(x, seed):
        out = randn(fr2.tokens, *x.shape[1:], seed=seed)
        for r in range(3):
            out[fr2.request_rows(r + 1)] = x[fr.request_rows(r)]
        return out

    out2 = op(moved(q, 123), moved(k, 124), moved(v, 125), t2.seg_lo, t2.trunk_lo, t2.trunk_hi, 0.25)
    for r in range(3):
        torch.testing.assert_close(out2[fr2.request_rows(r + 1)], base[fr.request_rows(r)], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("op_name,variant", [(op, v) for op in ("fork_attention", "fork_conv") for v in variants(op)])
def test_int32_and_int64_tables_give_the_same_bits(rnd, op_name, variant):
    """A round's per-token tables are int32; eager callers and the extended streams of ops/resume.py pass int64:
    every variant takes both, with the same bits."""
    op = impl(op_name, variant)
    t = rnd.t
    assert t.seg_lo.dtype == t.trunk_lo.dtype == t.trunk_hi.dtype == torch.int32
    wide = [x.long() for x in (t.seg_lo, t.trunk_lo, t.trunk_hi)]
    if op_name == "fork_attention":
        q, k, v = attn_inputs(rnd.tokens, 4, 2, 16, seed=13)
        got, want = op(q, k, v, t.seg_lo, t.trunk_lo, t.trunk_hi, 0.25), op(q, k, v, *wide, 0.25)
    else:
        x, weight = randn(rnd.tokens, 24, seed=1), randn(24, 4, seed=2)
        got, want = op(x, weight, t.seg_lo, t.trunk_lo, t.trunk_hi, True), op(x, weight, *wide, True)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------------------
# fork_conv
# ---------------------------------------------------------------------------------------------------------------------

def causal_conv(x: torch.Tensor, weight: torch.Tensor, silu: bool, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Transformers' causal depthwise conv of each standalone sequence (stream rows of x [T, D]; weight [D, W]):
    `conv1d` with padding W-1 and groups=D, the first L outputs kept, then SiLU. The sequences go in one batch,
    right-padded with zeros (which a causal conv never reads); one call, as depthwise conv1d is slow on CPU."""
    D, W = weight.shape
    longest = max(len(rows) for rows in sequences)
    batch = torch.zeros(len(sequences), D, longest, dtype=x.dtype)
    for i, rows in enumerate(sequences):
        batch[i, :, :len(rows)] = x[rows].T
    out = F.conv1d(batch, weight[:, None, :], padding=W - 1, groups=D)[:, :, :longest]
    out = F.silu(out) if silu else out
    return [out[i, :, :len(rows)].T for i, rows in enumerate(sequences)]


@pytest.mark.parametrize("variant", variants("fork_conv"))
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "nosilu"])
@pytest.mark.parametrize("width", [4, 2])
def test_fork_conv_matches_standalone(rnd, variant, silu, width):
    """Each question continues its own state's conv window (zeros before the state, also for states of 0-2 tokens);
    each state starts from zeros."""
    op = impl("fork_conv", variant)
    t, D = rnd.t, 24
    x, weight = randn(rnd.tokens, D, seed=1), randn(D, width, seed=2)
    got = op(x, weight, t.seg_lo, t.trunk_lo, t.trunk_hi, silu)
    assert got.shape == x.shape and got.dtype == DTYPE
    short = sum(len(s.state) < width - 1 for s in rnd.segments)
    pairs = [(s, b) for s in rnd.segments for b in [range(0)] + s.branches]  # range(0): the state alone
    wants = causal_conv(x, weight, silu, [standalone_rows(s, b) for s, b in pairs])
    for (s, b), want in zip(pairs, wants):
        torch.testing.assert_close(got[list(s.state) + list(b)], want, atol=1e-5, rtol=1e-5)
    assert width == 2 or short > 0


@pytest.mark.parametrize("variant", variants("fork_conv"))
@pytest.mark.parametrize("state_len", [0, 1, 2, 3, 8])
def test_fork_conv_short_states(variant, state_len):
    """[state][q1][q2] with W=4: a question's first tokens read the state's last tokens, never its sibling's."""
    op = impl("fork_conv", variant)
    fr = make_round([[(state_len, [1, 5])], [(2, [3])]], pad=2)
    t, D = fr.t, 8
    x, weight = randn(fr.tokens, D, seed=4), randn(D, 4, seed=5)
    got = op(x, weight, t.seg_lo, t.trunk_lo, t.trunk_hi, True)
    pairs = [(s, b) for s in fr.segments for b in s.branches]
    wants = causal_conv(x, weight, True, [standalone_rows(s, b) for s, b in pairs])
    for (s, b), want in zip(pairs, wants):
        torch.testing.assert_close(got[list(b)], want[len(s.state):], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# gated_delta
# ---------------------------------------------------------------------------------------------------------------------

HK, HV, KD, VD = 2, 4, 16, 16


def gdn_inputs(T: int, seed: int, l2norm: bool):
    q = randn(T, HK, KD, seed=seed)
    # Without the kernel's L2 norm, keep |k| <= ~1 so the delta rule stays contractive (as normalised keys are).
    k = randn(T, HK, KD, seed=seed + 1) if l2norm else F.normalize(randn(T, HK, KD, seed=seed + 1), dim=-1) * 0.9
    v = randn(T, HV, VD, seed=seed + 2)
    g = -F.softplus(randn(T, HV, seed=seed + 3))
    beta = torch.sigmoid(randn(T, HV, seed=seed + 4))
    return q, k, v, g, beta


SEG_LENS = [1, 63, 64, 65, 130, 0]


@pytest.mark.parametrize("variant", variants("gated_delta"))
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
@pytest.mark.parametrize("initial", [True, False], ids=["initial-states", "zero-states"])
def test_gated_delta_vs_naive(variant, l2norm, initial):
    """Segments of 1, 63, 64, 65, 130 (and 0) tokens, with gaps between them that must stay 0."""
    op = impl("gated_delta", variant)
    gap = 2
    starts, cursor = [], gap
    for n in SEG_LENS:
        starts.append(cursor)
        cursor += n + gap
    T = cursor
    seg_start, seg_len = torch.tensor(starts), torch.tensor(SEG_LENS)
    q, k, v, g, beta = gdn_inputs(T, seed=10, l2norm=l2norm)
    if initial:
        initial_state = randn(3, HV, KD, VD, seed=20, scale=0.5)
        initial_index = torch.tensor([0, -1, 2, 1, 0, 2])
    else:
        initial_state = torch.zeros(0, HV, KD, VD)
        initial_index = torch.full((len(SEG_LENS),), -1)
    scale = KD ** -0.5
    out, final = op(q, k, v, g, beta, seg_start, seg_len, initial_state, initial_index, scale, l2norm)
    want_out, want_final = gdn_ref.gated_delta_naive(q, k, v, g, beta, seg_start, seg_len, initial_state,
                                                     initial_index, scale, l2norm)
    assert out.shape == (T, HV, VD) and out.dtype == DTYPE
    assert final.shape == (len(SEG_LENS), HV, KD, VD) and final.dtype == torch.float32
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, want_final, atol=1e-4, rtol=1e-4)
    inside = torch.zeros(T, dtype=torch.bool)
    for s, n in zip(starts, SEG_LENS):
        inside[s:s + n] = True
    assert torch.count_nonzero(out[~inside]) == 0
    # a zero-length segment hands its initial state through unchanged
    want_empty = initial_state[2] if initial else torch.zeros(HV, KD, VD)
    assert torch.equal(final[-1], want_empty)


@pytest.mark.parametrize("variant", variants("gated_delta"))
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_gated_delta_fork_matches_standalone(variant, l2norm):
    """The two-call fork equals, at every question's rows, the standalone [state][question] recurrence from zero;
    the states' rows and final states equal each state run alone."""
    op = impl("gated_delta", variant)
    structure = [[(0, [3, 1])], [(1, [2, 4, 1])], [(70, [5, 66])], [(2, [1]), (9, [3, 2])]]
    fr = make_round(structure, pad=3, seed=4)
    t = fr.t
    q, k, v, g, beta = gdn_inputs(fr.tokens, seed=30, l2norm=l2norm)
    scale = KD ** -0.5
    out, finals = gated_delta_fork(op, q, k, v, g, beta, t.state_start, t.state_len, t.branch_start, t.branch_len,
                                   t.branch_state, scale, l2norm)
    assert finals.shape == (len(t.state_start), HV, KD, VD)
    zero_state, none = torch.zeros(0, HV, KD, VD), torch.tensor([-1])

    def standalone(rows):
        args = [x[rows] for x in (q, k, v, g, beta)]
        return gdn_ref.gated_delta_naive(*args, torch.tensor([0]), torch.tensor([len(rows)]), zero_state, none,
                                         scale, l2norm)

    for i, s in enumerate(fr.segments):
        state_out, state_final = standalone(list(s.state))
        torch.testing.assert_close(out[list(s.state)], state_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(finals[i], state_final[0], atol=1e-4, rtol=1e-4)
        for b in s.branches:
            want, _ = standalone(standalone_rows(s, b))
            torch.testing.assert_close(out[list(b)], want[len(s.state):], atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(out[fr.used:]) == 0
    assert torch.count_nonzero(finals[len(fr.segments):]) == 0  # unused state rows


# ---------------------------------------------------------------------------------------------------------------------
# readout
# ---------------------------------------------------------------------------------------------------------------------

def readout_inputs(bias: bool, seed: int = 0):
    N, H, vocab, R, L = 13, 24, 50, 6, 3
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = randn(N, H, seed=seed), randn(vocab, H, seed=seed + 1)
    b = randn(vocab, seed=seed + 2) if bias else None
    rows = torch.randint(0, N, (R,), generator=gen)
    option_index = torch.randint(0, vocab, (R, L), generator=gen)
    return hidden, rows, weight, b, option_index


@pytest.mark.parametrize("variant", variants("readout"))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_readout(variant, bias):
    op = impl("readout", variant)
    hidden, rows, weight, b, option_index = readout_inputs(bias)
    got = op(hidden, rows, weight, b, option_index)
    logits = hidden[rows].double() @ weight.double().T
    if b is not None:
        logits = logits + b.double()
    want = logits.gather(1, option_index).float()
    assert got.shape == option_index.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["selective", "invariant"])
def test_readout_of_a_bf16_head_is_not_rounded_to_bf16(variant):
    """A bf16 model's option scores: the bf16 hidden rows and head rows multiplied and summed in fp32, returned in
    fp32 (within fp32 rounding of float64), not rounded to bf16 as the head's own logits are (that rounding moves
    a logit of 8-16 by up to 0.03)."""
    op = impl("readout", variant)
    hidden, rows, weight, b, option_index = readout_inputs(True, seed=3)
    hidden, weight, b = (hidden * 4).bfloat16(), weight.bfloat16(), b.bfloat16()
    got = op(hidden, rows, weight, b, option_index)
    logits = (hidden[rows].double() @ weight.double().T + b.double()).gather(1, option_index)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), logits, atol=1e-5, rtol=1e-6)
    rounded = logits.to(torch.bfloat16).double()
    assert (rounded - logits).abs().max() > 1e-3  # what a bf16 readout would have lost


# ---------------------------------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------------------------------

def _small_round() -> FakeRound:
    return make_round([[(3, [2, 1])], [(0, [2])], [(1, [3, 1])]], pad=2, seed=5)


def opcheck_args(op: str):
    fr = _small_round()
    t, T = fr.t, fr.tokens
    if op == "fork_attention":
        q, k, v = attn_inputs(T, 4, 2, 8, seed=1)
        return (q, k, v, t.seg_lo, t.trunk_lo, t.trunk_hi, 8 ** -0.5)
    if op == "fork_conv":
        return (randn(T, 6, seed=2), randn(6, 4, seed=3), t.seg_lo, t.trunk_lo, t.trunk_hi, True)
    if op == "gated_delta":
        q, k, v, g, beta = gdn_inputs(T, seed=4, l2norm=True)
        initial_state = randn(len(t.state_start), HV, KD, VD, seed=5, scale=0.5)
        return (q, k, v, g, beta, t.branch_start, t.branch_len, initial_state, t.branch_state, KD ** -0.5, True)
    if op == "linear":
        return (randn(T, 6, seed=6), randn(5, 6, seed=7), randn(5, seed=8))
    if op == "gated_mlp":  # x [T, H], the stacked gate / up weight [2I, H]
        return (randn(T, 6, seed=13), randn(8, 6, seed=14))
    if op == "gated_norm":
        states_end = int(t.state_len.sum())
        branches_end = states_end + int(t.branch_len.sum())
        ends = (torch.tensor([states_end]), t.branch_start[:1].clone(), torch.tensor([branches_end]))
        return (randn(T, HV, VD, seed=9), randn(T, HV, VD, seed=10), randn(T, HV, VD, seed=11),
                randn(VD, seed=12), *ends, 1e-6)
    raise AssertionError(op)


# Every registered (op, variant), so a new variant is opchecked as soon as it is registered.
REGISTERED = [(op, variant) for op in OP_FAMILIES for variant in variants(op)]


@pytest.mark.parametrize("op,variant", REGISTERED, ids=[f"{op}-{variant}" for op, variant in REGISTERED])
def test_opcheck(op, variant):
    fn = impl(op, variant)
    assert isinstance(fn, torch._library.custom_ops.CustomOpDef), f"{op}/{variant} is not a torch.library custom op"
    if op == "readout":
        cases = [readout_inputs(bias=True), readout_inputs(bias=False, seed=3)]
    elif op == "linear":
        x, w, b = opcheck_args(op)
        cases = [(x, w, b), (x[:1], w, None)]
    else:
        cases = [opcheck_args(op)]
    for args in cases:
        # Inference inputs (nothing requires grad): all four default sub-tests apply and run (test_schema,
        # test_autograd_registration, test_faketensor, test_aot_dispatch_dynamic).
        torch.library.opcheck(fn, args)
        # Float inputs requiring grad: the ops are inference-only, with no autograd formula, so
        # test_aot_dispatch_dynamic (which runs backward) cannot pass by design and is left out; the other three
        # apply. test_autograd_registration checks the op has an autograd kernel (torch.library's, which raises
        # on backward) rather than silently falling through and returning outputs detached from the graph.
        grad_args = tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                          else a for a in args)
        torch.library.opcheck(fn, grad_args, test_utils=("test_schema", "test_autograd_registration",
                                                         "test_faketensor"))
        out = fn(*grad_args)
        out = out[0] if isinstance(out, tuple) else out
        assert out.requires_grad
        with pytest.raises(RuntimeError, match="no autograd formula"):
            out.sum().backward()


# ---------------------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------------------

def test_registry_unknown_variant_lists_valid_ones():
    with pytest.raises(ValueError, match="nope") as error:
        resolve("fork_attention", "nope")
    for name in variants("fork_attention"):
        assert name in str(error.value)
    assert "reference" in str(error.value)
    with pytest.raises(ValueError, match="fork_attention"):
        resolve("no_such_op", "reference")
    with pytest.raises(ValueError):
        variants("no_such_op")


def test_registry_variants():
    for op in ("fork_attention", "fork_conv", "gated_delta"):
        assert "reference" in variants(op), op
    assert {"selective", "full"} <= set(variants("readout"))
    assert set(OP_FAMILIES) == {"fork_attention", "fork_conv", "gated_delta", "gated_norm", "readout", "linear",
                                "gated_mlp"}
    assert {"torch", "triton"} <= set(variants("gated_mlp"))
    assert {"torch", "triton"} <= set(variants("gated_norm"))
    assert {"torch", "blocked", "triton"} <= set(variants("linear"))
    ops = flide.ops.resolve_all(KernelConfig())
    assert set(ops) == set(OP_FAMILIES)
    assert resolve("readout", "selective").gathers_rows_first and not resolve("readout", "full").gathers_rows_first


def test_gated_delta_combine_selects_each_row_from_its_call():
    """`fork` combines its two calls by span: a variant may leave rows outside its call's span unwritten (fla does),
    so NaN there must never reach the result, and the tail padding is zero."""
    from flide.ops.gated_delta import combine

    T, H, V = 20, 2, 3
    state_start, state_len = torch.tensor([0, 4, 9]), torch.tensor([4, 5, 0])
    branch_start, branch_len = torch.tensor([9, 12, 0, 0]), torch.tensor([3, 4, 0, 0])
    o_states = torch.full((T, H, V), float("nan"))
    o_states[:9] = 1.0
    o_branches = torch.full((T, H, V), float("nan"))
    o_branches[9:16] = 2.0
    out = combine(o_states, o_branches, state_start, state_len, branch_start, branch_len)
    assert torch.isfinite(out).all()
    assert (out[:9] == 1).all() and (out[9:16] == 2).all() and (out[16:] == 0).all()
    # no questions at all (an empty branch table): the state rows, then zeros
    none = torch.zeros(4, dtype=torch.int64)
    out = combine(o_states, o_branches, state_start, state_len, none, none)
    assert (out[:9] == 1).all() and (out[9:] == 0).all()


def test_the_fla_fork_runs_our_question_kernel_and_the_reference_its_own():
    """The question call: `fla` forks through our recurrent Triton kernel (looked up when the layer is built), the
    reference through itself; its opcheck'd fake gives the op's output shape."""
    import flide
    from flide.models.layers import FlideGatedDeltaNet
    from flide.models.tiny import tiny_model, tiny_tokenizer
    from flide.ops import gated_delta

    assert gated_delta.BRANCH_KERNELS[gated_delta.gated_delta_fla] is gated_delta.gated_delta_branches_triton
    assert gated_delta.BRANCH_KERNELS[gated_delta.gated_delta_fla_resumable] is gated_delta.gated_delta_branches_triton
    engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer())
    layers = [m for m in engine.flat.modules() if isinstance(m, FlideGatedDeltaNet)]
    assert layers and all(layer.branch_op is None for layer in layers)  # the reference on the CPU
    q = torch.empty(5, 2, 16, device="meta")
    v = torch.empty(5, 4, 8, device="meta")
    meta = torch.empty(3, dtype=torch.int64, device="meta")
    out = gated_delta._fake_branches(q, q, v, v[..., 0], v[..., 0], meta, meta, torch.empty(0, 4, 16, 8), meta, 0.5,
                                     True)
    assert out.shape == (5, 4, 8)


def test_fla_config_pins_prune_16_bit_launches_to_one_config(monkeypatch, caplog):
    """fla._pin_configs (the sm_90 pins): a kernel whose autotune list holds the pinned config prunes to it for
    16-bit keys (or none, the gate cumsum) and each value-head count measured (its own pin), and keeps every config
    for fp32 keys or other heads; a pin missing from a kernel's list (an fla upgrade) leaves those heads autotuned
    and the log says so; a pin flagged "added" is appended to the list and used only where pinned. Fake kernels:
    fla is GPU-only."""
    import sys
    import types

    triton = pytest.importorskip("triton")
    from flide.ops.gated_delta import fla

    def kernel(configs):  # heuristics wrapping an autotuner, as fla declares its kernels
        return types.SimpleNamespace(fn=types.SimpleNamespace(configs=list(configs), early_config_prune=None, fn=None,
                                                              cache={("an earlier", "pick"): configs[-1]}))

    listed = [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (32, 64) for w in (2, 4) for s in (2, 3)]
    module = types.ModuleType("fake_fla_kernels")
    module.has, module.lacks = kernel(listed), kernel(listed[:4])  # lacks BV 64
    monkeypatch.setitem(sys.modules, "fake_fla_kernels", module)
    with caplog.at_level("WARNING", logger="flide"):
        fla._pin_configs({16: {("fake_fla_kernels", "has"): ({"BV": 32}, 4, 3),
                               ("fake_fla_kernels", "lacks"): ({"BV": 32}, 4, 3)},
                          32: {("fake_fla_kernels", "has"): ({"BV": 64}, 2, 2),
                               ("fake_fla_kernels", "lacks"): ({"BV": 64}, 2, 2)}})
    tuner = fla.autotuner(module.has)
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    (kept,) = tuner.early_config_prune(listed, {}, k=bf16, H=16, HV=16)
    assert (kept.kwargs, kept.num_warps, kept.num_stages) == ({"BV": 32}, 4, 3) and tuner.flide_pinned[16] is kept
    (kept32,) = tuner.early_config_prune(listed, {}, k=bf16, H=16, HV=32)  # each head count its own pin
    assert (kept32.kwargs, kept32.num_warps, kept32.num_stages) == ({"BV": 64}, 2, 2)
    assert tuner.cache == {}  # an earlier autotune pick would have bypassed the pruning
    assert tuner.early_config_prune(listed, {"s": torch.zeros(2)}, H=16) == [kept]  # the gate cumsum
    assert tuner.early_config_prune(listed, {}, k=torch.zeros(2), H=16, HV=16) == listed  # fp32
    assert tuner.early_config_prune(listed, {}, k=bf16, H=16, HV=24) == listed  # heads not measured
    module.grows = kernel(listed)  # a pin outside the kernel's list, flagged "added": appended for its heads only
    fla._pin_configs({16: {("fake_fla_kernels", "grows"): ({"BV": 128}, 4, 3, "added")}})
    grows = fla.autotuner(module.grows)
    assert len(grows.configs) == len(listed) + 1 and grows.configs[:-1] == listed
    (ours,) = grows.early_config_prune(grows.configs, {}, k=bf16, H=16, HV=16)
    assert (ours.kwargs, ours.num_warps, ours.num_stages) == ({"BV": 128}, 4, 3) and ours is grows.configs[-1]
    assert grows.early_config_prune(grows.configs, {}, k=bf16, H=16, HV=32) == listed  # not where unpinned
    assert grows.early_config_prune(grows.configs, {}, k=torch.zeros(2), H=16, HV=16) == listed  # fp32
    lacks = fla.autotuner(module.lacks)  # holds the 16-head pin only
    assert lacks.early_config_prune(listed[:4], {}, k=bf16, H=16, HV=16) == [listed[3]]
    assert lacks.early_config_prune(listed[:4], {}, k=bf16, H=16, HV=32) == listed[:4]
    assert "lacks has no config {'BV': 64}, 2 warps, 2 stages: autotuned at 32 value heads" in caplog.text
