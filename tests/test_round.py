"""`flide.round`: the packed layout (`layout`, `packed_size`, `RoundTensors.from_flat`), `build_round` into a reused
buffer, and the metadata equal, field by field, to the original per-read implementation kept below as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flide.config import GDN_CHUNK
from flide.requests import Branch, PreparedRequest, SubTrunk
from flide.round import INT32_FIELDS, RoundTensors, Shape, build_round, layout, packed_size
from flide.ops.gated_delta import sub_slots
from flide.testing import layout_sub_slots, synthetic_request

FIELDS = [f for f in RoundTensors.__dataclass_fields__]
TOKEN_FIELDS = ["input_ids", "positions", "seg_lo", "trunk_lo", "trunk_hi", "sub_lo", "sub_hi"]  # int32


def field_dtype(name: str) -> torch.dtype:
    return torch.int32 if name in TOKEN_FIELDS else torch.int64


def reference_build_round(requests: list[PreparedRequest], shape: Shape, pad_id: int):
    """The original `build_round` (a Python loop over segments and reads), verbatim but for returning numpy arrays
    and (request, question, options, tail) tuples: the oracle of the vectorised one."""
    seg_tokens, seg_is_state, seg_state, seg_pos0, seg_sub = [], [], [], [], []
    read_request, read_prompt_pos, read_seg, read_questions, read_options, read_tails = [], [], [], [], [], []
    first_state = []
    for req in requests:
        first_state.append(len(seg_tokens))
        for t, trunk in enumerate(req.trunks):
            if t in req.lone_branches:  # merged lone question: one state segment
                trunk = np.concatenate([trunk, req.branches[req.lone_branches[t]].tokens])
            seg_state.append(len(seg_tokens)), seg_tokens.append(trunk), seg_is_state.append(True), seg_pos0.append(0)
            seg_sub.append(-1)
    n_states = len(seg_tokens)
    for r, req in enumerate(requests):
        for t, b in req.lone_branches.items():  # their reads first, in trunk order, rows of the state segment
            branch = req.branches[b]
            for pos, question, options in zip(branch.reads, branch.questions, branch.options):
                read_request.append(r), read_questions.append(question), read_options.append(options)
                read_tails.append(branch.tail), read_seg.append(first_state[r] + t), read_prompt_pos.append(int(pos))
        by_trunk: dict[int, list] = {}
        for branch in req.branches:
            if branch.trunk not in req.lone_branches:
                by_trunk.setdefault(branch.trunk, []).append(branch)
        for t, trunk in enumerate(req.trunks):
            state_index = trunk_seg = first_state[r] + t
            sub_seg = {}  # the request's sub-trunk index -> its segment: each trunk's sub-trunks before its branches
            for k, sub in enumerate(req.subs):
                if sub.trunk == t:
                    sub_seg[k] = len(seg_tokens)
                    seg_tokens.append(sub.tokens), seg_is_state.append(False), seg_state.append(state_index)
                    seg_pos0.append(len(trunk)), seg_sub.append(-1)
            for branch in by_trunk.get(t, []):
                seg = len(seg_tokens)
                seg_tokens.append(branch.tokens), seg_is_state.append(False), seg_state.append(state_index)
                seg_pos0.append(len(trunk) + (len(req.subs[branch.sub].tokens) if branch.sub >= 0 else 0))
                seg_sub.append(sub_seg[branch.sub] if branch.sub >= 0 else -1)
                for pos, question, options in zip(branch.reads, branch.questions, branch.options):
                    in_trunk = pos < len(trunk)
                    read_request.append(r), read_questions.append(question), read_options.append(options)
                    read_tails.append(branch.tail)
                    read_seg.append(trunk_seg if in_trunk else seg)
                    read_prompt_pos.append(int(pos))

    lens = np.fromiter((len(s) for s in seg_tokens), dtype=np.int64, count=len(seg_tokens))
    n = int(lens.sum())
    n_branches = len(seg_tokens) - n_states
    if n > shape.tokens or n_states > shape.states or n_branches > shape.branches or len(read_seg) > shape.readout_rows:
        raise ValueError("over capacity")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    is_state = np.asarray(seg_is_state, dtype=bool)
    state_of = np.asarray(seg_state, dtype=np.int64)
    pos0 = np.asarray(seg_pos0, dtype=np.int64)
    state_seg = np.flatnonzero(is_state)
    state_lo, state_len = starts[state_seg], lens[state_seg]

    T = shape.tokens
    input_ids = np.full(T, pad_id, dtype=np.int64)
    if n:
        input_ids[:n] = np.concatenate(seg_tokens)
    token_seg = np.repeat(np.arange(len(lens)), lens)
    arange = np.arange(T, dtype=np.int64)
    positions = np.zeros(T, dtype=np.int64)
    positions[:n] = arange[:n] - starts[token_seg] + pos0[token_seg]
    seg_lo = arange.copy()
    seg_lo[:n] = starts[token_seg]
    seg_trunk_lo = np.where(is_state, 0, state_lo[state_of]) if len(lens) else np.zeros(0, dtype=np.int64)
    seg_trunk_hi = (np.where(is_state, 0, state_lo[state_of] + state_len[state_of]) if len(lens)
                    else np.zeros(0, dtype=np.int64))
    trunk_lo, trunk_hi = np.zeros(T, dtype=np.int64), np.zeros(T, dtype=np.int64)
    trunk_lo[:n], trunk_hi[:n] = seg_trunk_lo[token_seg], seg_trunk_hi[token_seg]
    sub_of = np.asarray(seg_sub, dtype=np.int64)
    sub_lo, sub_hi = np.zeros(T, dtype=np.int64), np.zeros(T, dtype=np.int64)
    if len(lens):
        has = sub_of >= 0
        sub_lo[:n] = np.where(has, starts[sub_of], 0)[token_seg]
        sub_hi[:n] = np.where(has, starts[sub_of] + lens[sub_of], 0)[token_seg]

    def padded(values, size, fill=0):
        out = np.full(size, fill, dtype=np.int64)
        out[: len(values)] = values
        return out

    branch_seg = np.flatnonzero(~is_state)
    read_seg_a = np.asarray(read_seg, dtype=np.int64)
    read_pos = np.asarray(read_prompt_pos, dtype=np.int64)
    rows = starts[read_seg_a] + read_pos - pos0[read_seg_a] if len(read_seg_a) else read_pos
    option_index = np.zeros((shape.readout_rows, shape.options), dtype=np.int64)
    reads = []
    for i, (r, question, opts, tail) in enumerate(zip(read_request, read_questions, read_options, read_tails)):
        option_index[i, : len(opts)] = opts
        reads.append((r, question, len(opts), tail))

    def chunk_table(lens, capacity, empty_segment):
        chunks = -(-lens // GDN_CHUNK)
        segment = np.repeat(np.arange(len(lens)), chunks)
        first = np.repeat(np.cumsum(chunks) - chunks, chunks)
        table = np.empty((capacity, 2), dtype=np.int64)
        table[:, 0], table[:, 1] = empty_segment, 0
        table[: len(segment), 0] = segment
        table[: len(segment), 1] = np.arange(len(segment)) - first
        return table

    tensors = {
        "input_ids": input_ids, "positions": positions, "seg_lo": seg_lo, "trunk_lo": trunk_lo, "trunk_hi": trunk_hi,
        "sub_lo": sub_lo, "sub_hi": sub_hi,
        "state_start": padded(state_lo, shape.states), "state_len": padded(state_len, shape.states),
        "branch_start": padded(starts[branch_seg], shape.branches),
        "branch_len": padded(lens[branch_seg], shape.branches),
        "branch_state": padded(state_of[branch_seg], shape.branches),
        "state_chunks": chunk_table(state_len, shape.state_chunks, shape.states),
        "branch_chunks": chunk_table(lens[branch_seg], shape.branch_chunks, shape.branches),
        "readout_rows": padded(rows, shape.readout_rows), "option_index": option_index}
    return {k: torch.from_numpy(v) for k, v in tensors.items()}, reads, n


def random_request(rng: np.random.Generator, max_state: int = 150, max_branch: int = 90) -> PreparedRequest:
    """Up to three trunks (some empty), branches in any trunk order (one sometimes naming no trunk), 1-3 reads per
    branch, some inside the trunk, 1-4 options per read, sometimes fewer options than reads (zip drops the rest); some
    branches are leaves of a sub-trunk of their trunk (nested forks), reading only in their own tokens."""
    n_trunks = int(rng.choice([1, 1, 1, 2, 3]))
    trunks = [rng.integers(5, 1000, size=int(rng.choice([0, 1, int(rng.integers(0, max_state + 1))])))
              for _ in range(n_trunks)]
    branches = []
    subs = [SubTrunk(int(rng.integers(0, n_trunks)), rng.integers(5, 1000, size=int(rng.integers(1, 30))))
            for _ in range(int(rng.choice([0, 0, 1, 2])))]
    for _ in range(int(rng.integers(1, 7))):
        t = int(rng.integers(0, n_trunks + (1 if rng.random() < 0.1 else 0)))  # t == n_trunks: no such trunk
        tokens = rng.integers(5, 1000, size=int(rng.integers(1, max_branch + 1)))
        trunk_len = len(trunks[t]) if t < n_trunks else 0
        mine = [k for k, sub in enumerate(subs) if sub.trunk == t]
        sub = int(rng.choice(mine)) if mine and rng.random() < 0.7 else -1
        own = trunk_len + (len(subs[sub].tokens) if sub >= 0 else 0)  # where its own tokens start in its prompt
        k = int(rng.integers(1, 4))
        low = own if sub >= 0 or rng.random() >= 0.2 else 0
        reads = np.sort(rng.integers(low, own + len(tokens), size=k))
        options = [[int(x) for x in rng.integers(1, 500, size=int(rng.integers(1, 5)))] for _ in range(k)]
        if rng.random() < 0.1:
            options = options[:-1]
        branches.append(Branch(t, tokens, reads, [object() for _ in range(k)], rng.integers(0, 9, size=2), options,
                               sub))
    # a trunk with one prompt continues into it as one state segment (the engine's default)
    return PreparedRequest(trunks, branches, subs=subs, merge_lone=bool(rng.random() < 0.5))


def exact_fit(requests, spare: int = 0, options: int = 4) -> Shape:
    tokens = sum(r.stream_tokens for r in requests)
    states = sum(len(r.trunks) for r in requests)
    branches = sum(len(r.branches) + len(r.subs) - len(r.lone_branches) for r in requests)
    reads = sum(len(b.reads) for r in requests for b in r.branches)
    return Shape(tokens + spare, states + spare, branches + spare, reads + spare, options)


def assert_equal_round(built, want, want_reads, want_n):
    """`built` holds the oracle's int64 values (`want`), each field in its own dtype, a view of the packed buffer."""
    storage = built.flat.untyped_storage().data_ptr()
    for name in FIELDS:
        got = getattr(built.tensors, name)
        assert got.dtype == field_dtype(name) and got.shape == want[name].shape, name
        assert torch.equal(got.long(), want[name]), name
        assert got.untyped_storage().data_ptr() == storage, name
    assert built.used_tokens == want_n
    assert [(r.request, r.question, r.options, r.tail) for r in built.reads] == want_reads


@pytest.mark.parametrize("seed", range(40))
def test_equals_reference(seed):
    rng = np.random.default_rng(seed)
    requests = [random_request(rng) for _ in range(int(rng.integers(1, 9)))]
    shape = exact_fit(requests, spare=int(rng.integers(0, 3)) * 7)
    pad = int(rng.integers(0, 5))
    want, want_reads, want_n = reference_build_round(requests, shape, pad)
    assert_equal_round(build_round(requests, shape, pad), want, want_reads, want_n)


@pytest.mark.parametrize("seed", range(30))
def test_sub_slots_equal_the_layouts(seed):
    """The branch rows' sub-trunk state slots (nested forks), derived on the device from the round's fields alone
    (`gated_delta.sub_slots`: the starts of the used branch rows increase, spare rows sort last), equal the host
    side's truth (each request's branch -> sub-trunk rows): with room for every sub-trunk and with fewer slots."""
    rng = np.random.default_rng(seed)
    requests = [random_request(rng) for _ in range(int(rng.integers(1, 9)))]
    built = build_round(requests, exact_fit(requests, spare=int(rng.integers(0, 3)) * 7), int(rng.integers(0, 5)))
    t = built.tensors
    for cap in (32, 2, 0):
        got = sub_slots(t.branch_start, t.branch_len, t.branch_state, t.sub_lo, t.sub_hi, cap)
        assert got.dtype == torch.int32 and got.tolist() == layout_sub_slots(built, cap), cap


def test_sub_slots_compile_to_one_graph():
    """`sub_slots` as the flat forward's compiled graph runs it (torch.compile, dynamic shapes, no graph break): the
    same slots as eagerly on rounds of several sizes, one graph for all of them."""
    from torch._dynamo.utils import counters

    def derive(*args):  # a frame of this test's own: dynamo caches by code object
        return sub_slots(*args)

    graphs = counters["stats"]["unique_graphs"]
    compiled = torch.compile(derive, dynamic=True, fullgraph=True)
    sizes = set()
    for seed in range(6):
        rng = np.random.default_rng(100 + seed)
        requests = [random_request(rng) for _ in range(int(rng.integers(2, 9)))]
        built = build_round(requests, exact_fit(requests, spare=7), 0)
        t = built.tensors
        args = (t.branch_start.clone(), t.branch_len.clone(), t.branch_state.clone(), t.sub_lo.clone(),
                t.sub_hi.clone())
        assert compiled(*args, 2).tolist() == layout_sub_slots(built, 2)
        sizes.add((args[0].shape[0], args[3].shape[0]))
    assert len(sizes) > 3 and counters["stats"]["unique_graphs"] == graphs + 1, dict(counters["stats"])


def test_sub_slots_of_the_random_rounds_cover_every_case():
    """The random rounds above hold sub-trunks with leaves, sub-trunks without, and more named sub-trunks than 2."""
    named, unnamed = 0, 0
    for seed in range(30):
        rng = np.random.default_rng(seed)
        requests = [random_request(rng) for _ in range(int(rng.integers(1, 9)))]
        built = build_round(requests, exact_fit(requests), 0)
        slots = layout_sub_slots(built, 1000)
        named = max(named, max(slots) + 1)
        unnamed += sum(len(r.subs) for r in requests) - len({s for s in slots if s >= 0})
    assert named > 2 and unnamed > 0


def test_layout_and_from_flat_round_trip():
    shape = Shape(322, 5, 9, 11, 3)
    fields = layout(shape)
    assert [name for name, _, _ in fields] == FIELDS
    assert set(INT32_FIELDS) == set(TOKEN_FIELDS)
    dims_of = {name: dims for name, dims, _ in fields}
    assert dims_of["input_ids"] == (322,) and dims_of["option_index"] == (11, 3)
    assert dims_of["state_chunks"] == (shape.state_chunks, 2)
    # fields in order, each at the next 16-byte boundary (322 int32 tokens end mid-way through one; 5 states: state_len
    # would start at an odd int64 element), each a view of its bytes of `flat` in its own dtype
    flat = torch.arange(packed_size(shape), dtype=torch.int64)
    tensors = RoundTensors.from_flat(flat, shape)
    byte = 0
    for name, dims, dtype in fields:
        t = getattr(tensors, name)
        assert dtype == field_dtype(name) == t.dtype, name
        nbytes = int(np.prod(dims)) * dtype.itemsize
        byte += -byte % 16
        assert tuple(t.shape) == dims and t.is_contiguous(), name
        assert t.data_ptr() - flat.data_ptr() == byte, name
        assert torch.equal(t.reshape(-1), flat.view(torch.uint8)[byte: byte + nbytes].view(dtype)), name
        byte += nbytes
    assert 8 * packed_size(shape) == byte + byte % 8
    assert packed_size(shape) < sum(int(np.prod(dims)) for _, dims, _ in fields)  # int32 fields take half the room
    tensors.seg_lo[3] = -7  # views: a write shows in the flat buffer
    words = flat.view(torch.int32)
    assert int(words[(tensors.seg_lo.data_ptr() - flat.data_ptr()) // 4 + 3]) == -7
    # a view into a larger buffer keeps its offset; the wrong size or dtype is refused
    big = torch.zeros(packed_size(shape) + 10, dtype=torch.int64)
    assert RoundTensors.from_flat(big[10:], shape).input_ids.data_ptr() == big[10:].data_ptr()
    with pytest.raises(ValueError):
        RoundTensors.from_flat(flat[1:], shape)
    with pytest.raises(ValueError):
        RoundTensors.from_flat(flat.to(torch.int32), shape)
    # built rounds are views of their packed buffer
    built = build_round([synthetic_request(np.arange(70), [np.arange(5), np.arange(3)])], Shape(128, 2, 3, 3, 2), 0)
    again = RoundTensors.from_flat(built.flat, built.shape)
    for name in FIELDS:
        assert torch.equal(getattr(again, name), getattr(built.tensors, name))
        assert getattr(again, name).data_ptr() == getattr(built.tensors, name).data_ptr()


def test_token_fields_are_int32_views_holding_the_int64_values():
    """The per-token fields are int32 views of the packed buffer holding the values the all-int64 layout held
    (written out here token by token); a reused `out=` buffer full of garbage and a fresh buffer end up with the same
    bytes, the padding after the odd-sized int32 fields included."""
    a = synthetic_request([11, 12, 13, 14, 15], [[21, 22, 23], [24, 25]])
    b = synthetic_request([31, 32, 33, 34], [[41]])
    shape = Shape(19, 3, 4, 4, 2)  # 15 tokens used, 4 pads; 19 int32 leave half of an int64 element as padding
    # the states (a's, b's), then the questions (a's two, b's one), then the pads
    want = {"input_ids": [11, 12, 13, 14, 15, 31, 32, 33, 34, 21, 22, 23, 24, 25, 41, 9, 9, 9, 9],
            "positions": [0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 6, 7, 5, 6, 4, 0, 0, 0, 0],
            "seg_lo": [0] * 5 + [5] * 4 + [9] * 3 + [12] * 2 + [14] + [15, 16, 17, 18],
            "trunk_lo": [0] * 9 + [0] * 5 + [5] + [0] * 4,
            "trunk_hi": [0] * 9 + [5] * 5 + [9] + [0] * 4,
            "sub_lo": [0] * 19, "sub_hi": [0] * 19}  # no sub-trunks
    built = build_round([a, b], shape, pad_id=9)
    words = built.flat.view(torch.int32)
    for name in TOKEN_FIELDS:
        got = getattr(built.tensors, name)
        assert got.dtype == torch.int32 and got.shape == (19,), name
        assert torch.equal(got.long(), torch.tensor(want[name], dtype=torch.int64)), name
        start = (got.data_ptr() - built.flat.data_ptr()) // 4
        assert start % 4 == 0 and torch.equal(words[start: start + 19], got), name  # 16-byte aligned, in the buffer
        assert got.untyped_storage().data_ptr() == built.flat.untyped_storage().data_ptr(), name
    out = torch.full((packed_size(shape),), -(2**62) - 12345, dtype=torch.int64)
    reused = build_round([a, b], shape, pad_id=9, out=out)
    assert reused.flat is out and torch.equal(out, built.flat)  # every byte written, padding included
    for name in FIELDS:
        assert torch.equal(getattr(reused.tensors, name), getattr(built.tensors, name)), name
        assert getattr(reused.tensors, name).dtype == field_dtype(name), name


def test_reused_buffer_equals_fresh_builds():
    """The same buffer, built into again and again with different mixes (garbage written in between), holds what
    fresh builds hold: every element of every field is rewritten."""
    rng = np.random.default_rng(7)
    mixes = [[random_request(rng) for _ in range(int(rng.integers(1, 7)))] for _ in range(6)]
    shape = Shape(*(max(getattr(exact_fit(m, spare=3), f) for m in mixes)
                    for f in ("tokens", "states", "branches", "readout_rows", "options")))
    buffer = torch.full((packed_size(shape),), -123456789, dtype=torch.int64)
    for i, mix in enumerate(mixes + mixes[::-1]):
        pad = i % 3
        built = build_round(mix, shape, pad, out=buffer)
        assert built.flat is buffer
        fresh = build_round(mix, shape, pad)
        want, want_reads, want_n = reference_build_round(mix, shape, pad)
        assert_equal_round(built, want, want_reads, want_n)
        for name in FIELDS:
            got = getattr(built.tensors, name)
            assert torch.equal(got, getattr(fresh.tensors, name)), name
            assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(buffer, fresh.flat)
        buffer.random_(-10**9, 10**9)  # stale values must never survive the next build


def test_pinned_buffer():
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    requests = [synthetic_request(np.arange(100), [np.arange(9)] * 3)]
    shape = Shape(256, 2, 4, 4, 2)
    buffer = torch.empty(packed_size(shape), dtype=torch.int64).pin_memory()
    built = build_round(requests, shape, 0, out=buffer)
    assert torch.equal(buffer, build_round(requests, shape, 0).flat)
    device = RoundTensors.from_flat(buffer.cuda(), shape)
    assert torch.equal(device.positions.cpu(), built.tensors.positions)


def test_bad_out_and_over_capacity():
    requests = [synthetic_request(np.arange(100), [np.arange(9)] * 3, [1, 2, 3])]
    shape = exact_fit(requests, options=3)
    with pytest.raises(ValueError):
        build_round(requests, shape, 0, out=torch.zeros(packed_size(shape) - 1, dtype=torch.int64))
    with pytest.raises(ValueError):
        build_round(requests, shape, 0, out=torch.zeros(packed_size(shape), dtype=torch.int32))
    for smaller in (Shape(shape.tokens - 1, 1, 3, 3, 3), Shape(shape.tokens, 0, 3, 3, 3), Shape(shape.tokens, 1, 2, 3, 3),
                    Shape(shape.tokens, 1, 3, 2, 3), Shape(shape.tokens, 1, 3, 3, 2)):
        with pytest.raises(ValueError):
            build_round(requests, smaller, 0)


def test_invariants():
    """The layout's invariants on random rounds: level-major, contiguous, every token inside its segment, question
    tokens' trunks are their states, positions continue from the state (and a leaf's from its sub-trunk, whose segment
    its tokens' sub range names), chunk tables cover each segment once."""
    rng = np.random.default_rng(3)
    leaves = 0
    for _ in range(20):
        requests = [random_request(rng) for _ in range(int(rng.integers(1, 6)))]
        shape = exact_fit(requests, spare=5)
        built = build_round(requests, shape, pad_id=1)
        t = {name: getattr(built.tensors, name).numpy() for name in FIELDS}
        n, T = built.used_tokens, shape.tokens
        NS = sum(len(r.trunks) for r in requests)
        NB = sum(sum(1 for b in r.branches if b.trunk < len(r.trunks)) + len(r.subs) - len(r.lone_branches)
                 for r in requests)
        ss, sl, bs, bl = t["state_start"][:NS], t["state_len"][:NS], t["branch_start"][:NB], t["branch_len"][:NB]
        # contiguous: states from 0, then branches, then the tail
        bounds = np.concatenate([ss, bs, [n]])
        assert bounds[0] == 0 and np.array_equal(np.concatenate([ss + sl, bs + bl]), bounds[1:])
        assert not t["state_len"][NS:].any() and not t["branch_len"][NB:].any()
        assert np.all(t["input_ids"][n:] == 1) and not t["positions"][n:].any()
        assert np.array_equal(t["seg_lo"][n:], np.arange(n, T))
        assert not t["trunk_lo"][n:].any() and not t["trunk_hi"][n:].any()
        assert not t["sub_lo"][:int(ss[-1] + sl[-1]) if NS else 0].any() and not t["sub_hi"][n:].any()
        for k in range(NS):
            rows = slice(ss[k], ss[k] + sl[k])
            assert np.all(t["seg_lo"][rows] == ss[k]) and np.array_equal(t["positions"][rows], np.arange(sl[k]))
            assert not t["trunk_lo"][rows].any() and not t["trunk_hi"][rows].any()
        for j in range(NB):
            k, rows = t["branch_state"][j], slice(bs[j], bs[j] + bl[j])
            assert np.all(t["seg_lo"][rows] == bs[j])
            assert np.all(t["trunk_lo"][rows] == ss[k]) and np.all(t["trunk_hi"][rows] == ss[k] + sl[k])
            lo, hi = t["sub_lo"][bs[j]] if bl[j] else 0, t["sub_hi"][bs[j]] if bl[j] else 0
            assert np.all(t["sub_lo"][rows] == lo) and np.all(t["sub_hi"][rows] == hi)
            if hi > lo:  # a leaf: its sub-trunk is a whole branch segment of the same state, before its own tokens
                leaves += 1
                sub = int(np.flatnonzero(bs[:NB] == lo)[0])
                assert bs[sub] + bl[sub] == hi and t["branch_state"][sub] == k and t["sub_hi"][lo] == 0
            assert np.array_equal(t["positions"][rows], sl[k] + (hi - lo) + np.arange(bl[j]))
        for name, lens, empty in (("state_chunks", sl, shape.states), ("branch_chunks", bl, shape.branches)):
            table = t[name]
            used = int((-(-lens // GDN_CHUNK)).sum())
            assert np.all(table[used:, 0] == empty) and not table[used:, 1].any()
            for seg, n_seg in enumerate(lens):
                chunks = table[:used][table[:used, 0] == seg, 1]
                assert np.array_equal(chunks, np.arange(-(-n_seg // GDN_CHUNK)))
        # each read's row holds the token its prompt position names
        reads = built.reads
        assert len(reads) <= shape.readout_rows and not t["readout_rows"][len(reads):].any()
        assert not t["option_index"][len(reads):].any()
        assert np.all(t["readout_rows"][: len(reads)] < n)
    assert leaves  # the random rounds held nested forks


def test_layout_is_cached_per_request():
    request = synthetic_request(np.arange(50), [np.arange(7)] * 2)
    shape = Shape(128, 1, 2, 2, 2)
    first = build_round([request], shape, 0)
    assert request.__dict__["round_layout"] is request.round_layout
    second = build_round([request, request], Shape(256, 2, 4, 4, 2), 0)
    assert [r.request for r in second.reads] == [0, 0, 1, 1]
    ids = second.tensors.input_ids
    assert torch.equal(ids[:50], first.tensors.input_ids[:50]) and torch.equal(ids[50:100], ids[:50])
    assert torch.equal(ids[100:114], first.tensors.input_ids[50:64]) and torch.equal(ids[114:128], ids[100:114])


def test_empty_round():
    shape = Shape(64, 1, 1, 1, 2)
    built = build_round([], shape, pad_id=5)
    want, want_reads, want_n = reference_build_round([], shape, 5)
    assert_equal_round(built, want, want_reads, want_n)


def test_reused_buffer_cache_lets_the_buffer_go():
    """The views cached for a reused buffer neither keep it alive nor outlive it."""
    import gc
    import weakref

    from flide import round as round_module

    requests = [synthetic_request(np.arange(70), [np.arange(5)])]
    shape = Shape(128, 1, 1, 1, 2)
    buffer = torch.zeros(packed_size(shape), dtype=torch.int64)
    built = build_round(requests, shape, 0, out=buffer)
    assert id(buffer) in round_module._BUFFERS
    alive = weakref.ref(buffer)
    del buffer, built
    gc.collect()
    assert alive() is None and not any(entry[0]() is None for entry in round_module._BUFFERS.values())


def test_plan_rounds_packs_greedily():
    """plan_rounds (with its one-round fast path) equals the greedy packing written out here."""
    from flide.config import CapacityConfig
    from flide.graphs.buckets import plan_rounds, shape_for
    from flide.round import Footprint

    caps = CapacityConfig(buckets=(256, 512, 1024), requests=6, states=8, branches=20, readout_rows=24)
    rng = np.random.default_rng(5)
    for _ in range(200):
        needs = [Footprint(int(rng.integers(1, 700)) if rng.random() < 0.2 else int(rng.integers(1, 120)),
                           int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 7)), 1)
                 for _ in range(int(rng.integers(1, 9)))]
        for exact in (False, True):
            want, current, total = [], [], None
            for i, need in enumerate(needs):
                if not need.fits(caps, 1024):
                    if current:
                        want.append((current, *shape_for(total, caps, 5, exact)))
                    current, total = [], None
                    want.append(([i], shape_for(need, caps, 5, exact)[0], True))
                    continue
                combined = need if total is None else total + need
                if not combined.fits(caps, 1024):
                    want.append((current, *shape_for(total, caps, 5, exact)))
                    combined, current = need, []
                current, total = current + [i], combined
            if current:
                want.append((current, *shape_for(total, caps, 5, exact)))
            got = [(p.requests, p.shape, p.oversized) for p in plan_rounds(needs, caps, 5, exact)]
            assert got == want


@pytest.mark.parametrize("seed", range(6))
def test_fork_tables_equal_what_each_layer_derived(seed):
    """The GDN forks' round tables, derived once per forward (`gated_delta.fork_tables`), are what the fla state call
    derives from the segment lists in every layer: the same cu_seqlens, and the round's `state_chunks` equal to the
    chunk list it built (the rows past the round's capacity being spare rows that name the empty sequence)."""
    import random

    from flide.ops.gated_delta import fork_tables
    from flide.ops.gated_delta.fla import chunk_table
    from flide.testing import random_round_tensors

    tokens = [64, 256, 512, 1024, 2048, 640][seed]
    r = random_round_tensors(random.Random(seed), tokens, max_state=300 if seed % 2 else 40)
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, r.branch_chunks,
                         branch_state=r.branch_state)
    NS = r.state_start.shape[0]
    end = r.state_start[:1] + r.state_len.sum(0, keepdim=True)
    derived = torch.cat([r.state_start[:1], r.state_start[:1] + r.state_len.cumsum(0), end])
    assert torch.equal(tables.state_cu_seqlens, derived)
    built = chunk_table(derived, tokens // GDN_CHUNK + NS + 1)
    rows = r.state_chunks.shape[0]
    assert (r.state_len > 0).any()
    assert torch.equal(r.state_chunks, built[:rows])
    assert torch.equal(built[rows:], torch.tensor([[NS, 0]] * (built.shape[0] - rows)))
    lens = derived[1:] - derived[:-1]  # fla's prepare_chunk_offsets: F.pad(cdiv(lens, 64), (1, 0)).cumsum(-1)
    want_offsets = torch.cat([torch.zeros(1, dtype=lens.dtype), ((lens + GDN_CHUNK - 1) // GDN_CHUNK).cumsum(0)])
    assert torch.equal(tables.state_chunk_offsets, want_offsets)
    # a sequence's chunk rows in the chunk list start at its offset
    for s in range(NS):
        if r.state_len[s] > 0:
            assert torch.equal(r.state_chunks[want_offsets[s]], torch.tensor([s, 0]))
    assert torch.equal(tables.states_end, end)
    assert torch.equal(tables.branches_end, r.branch_start[:1] + r.branch_len.sum(0, keepdim=True))


def test_fork_tables_start_the_questions_of_empty_states_from_zero():
    """`ForkTables.branch_from`: each question's state as `branch_state`, but -1 (a zero state, which is an empty
    state's final state) where its state has no tokens (a request laid out without a trunk): the state call may then
    leave empty sequences' final rows unwritten. Spare question rows (no tokens: their state is never read) take
    state 0's (empty here)."""
    from flide.ops.gated_delta import fork_tables
    from flide.round import Shape, build_round
    from flide.testing import synthetic_request

    requests = [synthetic_request([], [[5, 6, 7]]), synthetic_request(list(range(100)), [[1, 2], [3]]),
                synthetic_request([], [[8], [9, 10]])]
    r = build_round(requests, Shape(256, 8, 16, 16, 2), pad_id=0).tensors
    assert r.state_len[:3].tolist() == [0, 100, 0] and r.branch_state[:5].tolist() == [0, 1, 1, 2, 2]
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                         branch_state=r.branch_state)
    assert tables.branch_from[:5].tolist() == [-1, 1, 1, -1, -1]
    assert (r.branch_len[5:] == 0).all() and (tables.branch_from[5:] == -1).all()


@pytest.mark.parametrize("seed", range(4))
def test_split_tables_list_the_long_states_chunks(seed):
    """A split state call (fla.FUSED_SPLIT, buckets over FUSED_MAX_TOKENS): `split_tables` lists every chunk of the
    states longer than the split once, in stream order, spare rows naming the trailing empty sequence, and each long
    state's offset is its first row there (where the LONG chain stores its states and fla's o step reads them). On
    the CPU `fork_tables` derives none (no call splits there)."""
    import random

    from flide.ops.gated_delta import fork_tables
    from flide.ops.gated_delta.fla import bounds, split_tables
    from flide.testing import random_round_tensors

    tokens, split = [2048, 1024, 4096, 640][seed], [100, 64, 250, 150][seed]
    r = random_round_tensors(random.Random(seed), tokens, max_state=300)
    NS = r.state_start.shape[0]
    cu = bounds(r.state_start, r.state_len)
    chunks, offsets = split_tables(cu, r.state_chunks.shape[0], split)
    assert chunks.shape == r.state_chunks.shape and offsets.shape == (NS + 2,)
    long = [s for s in range(NS) if r.state_len[s] > split]
    assert long and len(long) < int((r.state_len > 0).sum())  # some states on each side
    want = [(s, c) for s in long for c in range((int(r.state_len[s]) + GDN_CHUNK - 1) // GDN_CHUNK)]
    rows = [tuple(row) for row in chunks.tolist()]
    assert rows[:len(want)] == want and all(row == (NS, 0) for row in rows[len(want):])
    for s in long:
        assert rows[int(offsets[s])] == (s, 0)
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                         branch_state=r.branch_state)
    assert tables.long_chunks.numel() == 0 and tables.long_chunk_offsets.numel() == 0


@pytest.mark.parametrize("seed", range(6))
def test_combined_tables_cover_states_then_questions(seed):
    """`fla_wy`'s chunk-local call runs over the states and the questions at once: its cu_seqlens holds every state's
    and every question's bounds in that order (the questions contiguous after the states), and its chunk rows name
    each chunk of each of them once, spare rows naming the trailing empty sequence."""
    import random

    from flide.ops.gated_delta import fork_tables
    from flide.testing import random_round_tensors

    tokens = [64, 256, 512, 1024, 2048, 640][seed]
    r = random_round_tensors(random.Random(seed), tokens, max_state=300 if seed % 2 else 40)
    tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks, r.branch_chunks,
                         branch_state=r.branch_state)
    NS, NB = r.state_start.shape[0], r.branch_start.shape[0]
    cu = tables.all_cu_seqlens
    assert cu.shape == (NS + NB + 2,) and torch.equal(cu[:NS + 1], tables.state_cu_seqlens[:NS + 1])
    segments = [(int(s), int(n)) for s, n in zip(torch.cat([r.state_start, r.branch_start]).tolist(),
                                                 torch.cat([r.state_len, r.branch_len]).tolist())]
    for i, (start, length) in enumerate(segments):
        assert int(cu[i + 1] - cu[i]) == length
        if length:
            assert int(cu[i]) == start
    assert cu[-1] == cu[-2]  # the trailing empty sequence
    want = sorted((i, c) for i, (_, n) in enumerate(segments) for c in range((n + GDN_CHUNK - 1) // GDN_CHUNK))
    rows = [tuple(row) for row in tables.all_chunks.tolist()]
    real = sorted(row for row in rows if row[0] != NS + NB)
    assert real == want
    assert all(row == (NS + NB, 0) for row in rows if row[0] == NS + NB)


@pytest.mark.parametrize("tokens", [256, 448, 512, 640, 16384, 32768])
def test_every_field_of_a_bucket_is_16_byte_aligned(tokens):
    """Inductor copies a misaligned input before every call, which keeps a bucket from launching its CUDA graph
    directly: every field of a bucket's packed buffer starts at a multiple of 16 bytes (the 448-token bucket, with 7
    states, once put `state_len` at an odd element)."""
    from flide.config import CapacityConfig
    from flide.graphs.buckets import bucket_shape

    caps = CapacityConfig(buckets=tuple(sorted({*CapacityConfig().buckets, tokens})))
    shape = bucket_shape(tokens, caps, 2)
    flat = torch.empty(packed_size(shape), dtype=torch.int64)
    for name, t in RoundTensors.from_flat(flat, shape).items():
        assert t.dtype == field_dtype(name), name
        assert (t.data_ptr() - flat.data_ptr()) % 16 == 0, name


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 6, 321, 447])
def test_every_field_is_16_byte_aligned_at_any_token_count(tokens):
    """Eager rounds and tests take shapes of any size: an int32 per-token field of T % 4 != 0 elements ends inside a
    16-byte unit, and the next field still starts at the next one."""
    shape = Shape(tokens, 3, 5, 7, 3)
    flat = torch.empty(packed_size(shape), dtype=torch.int64)
    for name, t in RoundTensors.from_flat(flat, shape).items():
        assert (t.data_ptr() - flat.data_ptr()) % 16 == 0, name
    requests = [synthetic_request(np.arange(1, tokens), [[7]])]
    built = build_round(requests, shape, 0, out=flat)
    assert [(t.data_ptr() - flat.data_ptr()) for _, t in built.tensors.items()] == \
        [(t.data_ptr() - flat.data_ptr()) for _, t in RoundTensors.from_flat(flat, shape).items()]
