"""A round: many requests laid out as ONE flat token stream, with its tree in fixed-capacity metadata tensors.

Layout, level-major with no padding between segments (padding only at the tail, up to the bucket):

    [state A1][state B1]...[question A1a][question A1b][question B1a]...[pad ... pad]

All states come first so that the two calls of the forked Gated DeltaNet each cover one contiguous region (the
states, then the questions): a varlen kernel then runs over exactly the tokens of its call.

Metadata (capacities T tokens, NS states, NB branches, O readout rows, L options per row); the seven per-token
fields are int32, the rest int64:
    input_ids [T], positions [T]          a question's positions continue from the end of its state (and sub-trunk)
    seg_lo [T]                            start of each token's own segment (a pad token: itself)
    trunk_lo [T], trunk_hi [T]            the state a question token forks from (empty for state tokens and pads)
    sub_lo [T], sub_hi [T]                nested forks: the sub-trunk a leaf question's token forks from after its
                                          state (lines several questions share, laid out once as a question segment
                                          of its own; `PreparedRequest.subs`); empty for every other token
    state_start [NS], state_len [NS]      the state segments (unused rows: length 0)
    branch_start [NB], branch_len [NB]    the question segments, and `branch_state` [NB], the state each forks from
    state_chunks [Cs, 2], branch_chunks [Cb, 2]
                                          (segment, chunk) of every 64-token GDN chunk; unused rows name an extra
                                          empty segment (NS or NB), so a kernel with a fixed grid returns early there
    readout_rows [O], option_index [O, L] the stream row read for each question, and the head rows of its options

Packed: the fields, in declaration order, are slices of ONE 1-D int64 buffer of `packed_size(shape)` elements
(`layout(shape)`), each starting 16-byte aligned (zero padding before a field that would not), so a round moves to
the GPU in one copy (`RoundTensors.from_flat` gives the views, on any device). An int32 field is a view of the
buffer's bytes as int32 (T of them take ceil(T / 2) int64 elements, plus padding): the per-token fields are ~5 T of
a round's elements, and int32 halves what a round writes on the host and copies to the device (a stream is far
below 2**31 tokens; token ids are checked to fit). Their consumers (ops, the model) take int32 or int64 tables.
`build_round(..., out=buffer)` writes every byte of a reused (e.g. pinned) buffer, padding included.

Building: each request's part of a round, relative to its own start, is computed once (`RequestLayout`, cached on the
request as `PreparedRequest.round_layout`): token ids and positions (int32), segment lengths, branch -> state, GDN
chunk rows, readout rows and option rows, as bytes. A round joins them field by field (`bytes.join`: no per-array
numpy overhead; input_ids and positions, with their padding, are then ONE byte copy into the buffer), adds each
request's offsets with a few vectorised passes and fills the piecewise-constant token fields with `np.repeat`; no
Python loop visits a segment or a read. The `Read` records are made on first access to `Round.reads` (the engine reads
them after the forward).
"""

from __future__ import annotations

import weakref
from array import array
from dataclasses import dataclass, fields
from functools import lru_cache, partial
from itertools import accumulate, chain
from typing import NamedTuple

import numpy as np
import torch

from .config import GDN_CHUNK, CapacityConfig
from .requests import PreparedRequest, SubTrunk


@dataclass
class RoundTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    seg_lo: torch.Tensor
    trunk_lo: torch.Tensor
    trunk_hi: torch.Tensor
    sub_lo: torch.Tensor
    sub_hi: torch.Tensor
    state_start: torch.Tensor
    state_len: torch.Tensor
    branch_start: torch.Tensor
    branch_len: torch.Tensor
    branch_state: torch.Tensor
    state_chunks: torch.Tensor
    branch_chunks: torch.Tensor
    readout_rows: torch.Tensor
    option_index: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "RoundTensors":
        return RoundTensors(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                               for f in fields(self)})

    def items(self):
        return ((f.name, getattr(self, f.name)) for f in fields(self))

    @classmethod
    def from_flat(cls, flat: torch.Tensor, shape: "Shape") -> "RoundTensors":
        """The fields as views into `flat`, a 1-D int64 tensor of `packed_size(shape)` elements (any device), laid
        out as `layout(shape)` (the per-token fields int32 views of its bytes): writing a field writes `flat` and the
        reverse."""
        if flat.dim() != 1 or flat.dtype != torch.int64 or flat.numel() != packed_size(shape) or not flat.is_contiguous():
            raise ValueError(f"a packed round of {shape} is a contiguous 1-D int64 tensor of {packed_size(shape)} "
                             f"elements; got {tuple(flat.shape)} {flat.dtype}")
        return cls(*_views(flat, _packing(shape)))


@dataclass(frozen=True)
class Shape:
    """The capacities of one round's metadata."""

    tokens: int
    states: int
    branches: int
    readout_rows: int
    options: int

    @property
    def state_chunks(self) -> int:
        return self.tokens // GDN_CHUNK + self.states

    @property
    def branch_chunks(self) -> int:
        return self.tokens // GDN_CHUNK + self.branches


@dataclass(frozen=True)
class Footprint:
    """What a set of requests needs of a round."""

    tokens: int
    states: int
    branches: int
    readout_rows: int
    requests: int

    def __add__(self, other: "Footprint") -> "Footprint":
        return Footprint(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self):
        return (self.tokens, self.states, self.branches, self.readout_rows, self.requests)

    def fits(self, caps: CapacityConfig, tokens: int) -> bool:
        return (self.tokens <= tokens and self.states <= caps.states and self.branches <= caps.branches
                and self.readout_rows <= caps.readout_rows and self.requests <= caps.requests)


def footprint(request: PreparedRequest) -> Footprint:
    return Footprint(request.stream_tokens, len(request.trunks),
                     len(request.branches) + len(request.subs) - len(request.lone_branches),
                     sum(len(b.reads) for b in request.branches), 1)


def layout(shape: Shape) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The RoundTensors fields in declaration order with their shapes and dtypes for `shape` (the per-token fields
    int32, the rest int64): the packed layout."""
    return [(name, dims, dtype) for name, _, _, dims, _, dtype in _packing(shape).fields]


def packed_size(shape: Shape) -> int:
    """Elements of the 1-D int64 buffer that holds every field of a round of `shape`."""
    return _packing(shape).size


class _Packing(NamedTuple):
    # (name, offset, count, dims, strides, dtype); offset in elements of the field's dtype from the buffer's start
    fields: tuple[tuple[str, int, int, tuple[int, ...], tuple[int, ...], torch.dtype], ...]
    size: int  # int64 elements
    gaps: tuple[tuple[int, int], ...]  # [start, end) in int32 words of the padding between fields (written as zeros)


# The per-token fields, int32: a stream is far below 2**31 tokens and token ids are checked to fit (RequestLayout).
# Every consumer takes int32 or int64 tables; where int64 is needed they convert there (ops/resume.py's scatter_, the
# positions handed to the model's own rotary module in models/flat.py).
INT32_FIELDS = frozenset(("input_ids", "positions", "seg_lo", "trunk_lo", "trunk_hi", "sub_lo", "sub_hi"))

# Fields start at a multiple of 16 bytes (4 int32 words): Inductor's compiled code copies an input tensor that is not
# 16-byte aligned into an aligned one before each call (`copy_misaligned_inputs`), and CUDA-graph replays then cannot
# launch the bucket's graph directly (runtime.guards: none). A 448-token bucket (7 states) put `state_len` at an odd
# int64 offset and did that on the H200 (2026-12-01). positions is aligned too: the padding after input_ids (none when
# T is a multiple of 4, as every bucket's is) is written by the same copy as both fields (`build_round`).
_ALIGN = 4


@lru_cache(maxsize=256)
def _packing(shape: Shape) -> _Packing:
    T = shape.tokens
    dims = {"input_ids": (T,), "positions": (T,), "seg_lo": (T,), "trunk_lo": (T,), "trunk_hi": (T,), "sub_lo": (T,),
            "sub_hi": (T,),
            "state_start": (shape.states,), "state_len": (shape.states,), "branch_start": (shape.branches,),
            "branch_len": (shape.branches,), "branch_state": (shape.branches,),
            "state_chunks": (shape.state_chunks, 2), "branch_chunks": (shape.branch_chunks, 2),
            "readout_rows": (shape.readout_rows,), "option_index": (shape.readout_rows, shape.options)}
    out, gaps, word = [], [], 0  # word: int32 words (4 bytes) from the buffer's start
    for f in fields(RoundTensors):
        if word % _ALIGN:
            gaps.append((word, word + _ALIGN - word % _ALIGN))
            word = gaps[-1][1]
        size = dims[f.name]
        count = size[0] * (size[1] if len(size) == 2 else 1)
        strides = (size[1], 1) if len(size) == 2 else (1,)
        if f.name in INT32_FIELDS:
            out.append((f.name, word, count, size, strides, torch.int32))
            word += count
        else:
            out.append((f.name, word // 2, count, size, strides, torch.int64))
            word += 2 * count
    if word % 2:  # a whole number of int64 elements
        gaps.append((word, word + 1))
        word += 1
    return _Packing(tuple(out), word // 2, tuple(gaps))


@dataclass
class Read:
    """Host-side record of one readout row: which request and question it answers."""

    request: int
    question: object  # transformers.decision.Question
    options: int
    tail: np.ndarray  # the prompt's tokens after its last mark, for the decision config's logits processors


class Round:
    """A laid-out round: its metadata `tensors` (views of the packed buffer `flat`), the `reads` (one per readout
    row, in row order; made on first access), its `shape` and the tokens it uses."""

    def __init__(self, tensors: RoundTensors, reads: list[Read] | None, shape: Shape, used_tokens: int,
                 flat: torch.Tensor | None = None, requests: list[PreparedRequest] | None = None):
        self.tensors, self.shape, self.used_tokens, self.flat = tensors, shape, used_tokens, flat
        self._reads, self._requests = reads, requests
        self.layouts: list[RequestLayout] | None = None  # each request's part, as build_round laid it out

    @property
    def reads(self) -> list[Read]:
        if self._reads is None:
            layouts = self.layouts or [request.round_layout for request in self._requests or ()]
            self._reads = [Read(r, question, options, tail) for r, lay in enumerate(layouts)
                           for question, options, tail in lay.reads]
        return self._reads

    @reads.setter
    def reads(self, value: list[Read]) -> None:
        self._reads = value

    def __repr__(self) -> str:
        return f"Round(shape={self.shape}, used_tokens={self.used_tokens}, reads={len(self.reads)})"


# A request's counts: state tokens, question tokens, states, branches, reads, state chunks, branch chunks, reads
# inside a trunk
_COUNTS = 8
# The parts of a request a round concatenates: _SMALL metadata parts (int64 bytes, the counts first), then tokens
# (int32 bytes)
_SMALL = 9
_TOKEN_PARTS = 4


class RequestLayout:
    """One request's part of a round, relative to its own start, computed once (`PreparedRequest.round_layout`).

    Within a round the request's states lie from some token S and state index s0, its questions from token Q and
    branch index b0; everything here is relative to those, so a round only adds offsets. The branch order is
    `build_round`'s: grouped by trunk, trunks in order, each trunk's branches in request order (branches naming no
    trunk are left out); a branch's reads pair with its questions and options (zip: the shortest wins).

    `parts[width]` is the tuple a round joins, field by field, across its requests (option rows `width` wide):
    counts, trunk lengths, branch lengths, branch -> trunk, branch -> its sub-trunk's branch row (-1: none), read
    rows (from S when the read is inside a trunk, else from Q), state chunk rows, branch chunk rows (segment, chunk),
    option rows; then state token ids, question token ids, state positions, question positions. `trunk_reads` flags
    the reads inside a trunk (rare: joined only when a round has one).
    """

    __slots__ = ("_options", "_small", "_tokens", "counts", "max_id", "parts", "reads", "trunk_reads")

    def __init__(self, request: PreparedRequest, skip: list[int] | None = None):
        """`skip[t]`: tokens of trunk t resumed from a checkpoint (flide/checkpoints): its segment then holds only
        the trunk's tokens from there on, with positions counting from `skip[t]`; its questions' positions and reads
        still count from the start of the whole prompt. A read inside a trunk must not fall in the skipped part."""
        full_lens = [len(t) for t in request.trunks]
        skip = skip or [0] * len(full_lens)
        trunks = [t[m:] if m else t for t, m in zip(request.trunks, skip)]
        # a trunk's lone branch continues it in one state segment (`PreparedRequest.lone_branches`): no branch row
        lone = request.lone_branches
        if lone and any(skip):
            raise ValueError("a request resuming from checkpoints cannot merge its lone questions into their trunks")
        for t, b in lone.items():
            trunks[t] = np.concatenate((trunks[t], request.branches[b].tokens))
        trunk_lens = [len(t) for t in trunks]
        # branch rows: per trunk, its sub-trunks (nested forks), then its branches in request order
        by_trunk: dict[int, list] = {}
        for sub in request.subs:
            by_trunk.setdefault(sub.trunk, []).append(sub)
        for branch in request.branches:
            if branch.trunk not in lone:
                by_trunk.setdefault(branch.trunk, []).append(branch)
        branches, branch_state = [], []
        for t in range(len(trunks)):
            for branch in by_trunk.get(t, ()):
                branches.append(branch), branch_state.append(t)
        sub_rows = {id(row): k for k, row in enumerate(branches) if isinstance(row, SubTrunk)}
        # each row's sub-trunk row (-1: none; a sub-trunk itself has none)
        branch_sub = [sub_rows[id(request.subs[row.sub])] if getattr(row, "sub", -1) >= 0 else -1 for row in branches]
        branch_lens = [len(b.tokens) for b in branches]
        state_start = [0, *accumulate(trunk_lens)]
        # where each row's own tokens start in its prompt: after its trunk, and its sub-trunk's tokens if any
        starts = [full_lens[t] + (branch_lens[k] if k >= 0 else 0) for t, k in zip(branch_state, branch_sub)]
        read_rel, read_flag, self.reads, self._options = [], [], [], []

        def positions(branch) -> list:  # its reads' prompt positions as Python ints (an array's tolist is one call)
            return branch.reads.tolist() if isinstance(branch.reads, np.ndarray) else branch.reads

        def add_read(row: int, in_trunk: int, question, options, tail) -> None:
            read_rel.append(row), read_flag.append(in_trunk)
            self._options.append([int(o) for o in options])
            self.reads.append((question, len(options), tail))

        for t, b in lone.items():  # reads of a merged lone branch: rows of its trunk's segment
            branch = request.branches[b]
            for pos, question, options in zip(positions(branch), branch.questions, branch.options):
                add_read(state_start[t] + int(pos), 1, question, options, branch.tail)
        q_cursor = 0
        for branch, t, n, pos0 in zip(branches, branch_state, branch_lens, starts):
            if isinstance(branch, SubTrunk):  # no reads: its tokens are read through its leaves
                q_cursor += n
                continue
            for pos, question, options in zip(positions(branch), branch.questions, branch.options):
                pos = int(pos)
                if pos < pos0 and branch.sub >= 0:  # `prepare` keeps no sub-trunk its leaves read inside
                    raise ValueError(f"a read at token {pos} falls before its leaf's first token {pos0}")
                if pos < pos0:  # a read inside the trunk (a template that marks before the question): the state row
                    if pos < skip[t]:
                        raise ValueError(f"a read at token {pos} falls in the {skip[t]} tokens resumed from a "
                                         f"checkpoint")
                    add_read(state_start[t] + pos - skip[t], 1, question, options, branch.tail)
                else:
                    add_read(q_cursor + pos - pos0, 0, question, options, branch.tail)
            q_cursor += n

        def chunk_rows(lens):  # (segment, chunk) of each GDN chunk, flattened
            return array("q", [v for k, n in enumerate(lens) for j in range(-(-n // GDN_CHUNK)) for v in (k, j)])

        s_chunks, b_chunks = chunk_rows(trunk_lens), chunk_rows(branch_lens)
        ns, nq = state_start[-1], q_cursor
        self.counts = (ns, nq, len(trunks), len(branches), len(read_rel), len(s_chunks) // 2, len(b_chunks) // 2,
                       sum(read_flag))
        self._small = tuple(array("q", part).tobytes() for part in (self.counts, trunk_lens, branch_lens, branch_state,
                                                                     branch_sub, read_rel, s_chunks, b_chunks))
        self.trunk_reads = array("q", read_flag).tobytes()
        # Token ids and positions as int32, the round's dtype for them (its one copy moves the bytes as they are):
        # every segment's positions count from its own start, a question's continuing from its state's length
        segments = [*trunks, *(b.tokens for b in branches)]
        lens = [*trunk_lens, *branch_lens]
        ids = np.concatenate(segments) if len(segments) > 1 else np.asarray(segments[0] if segments else [])
        # the largest id, which the engine checks against the model's embedding rows (an id past them would be a
        # device-side assert on CUDA, which takes the process's CUDA context down with it)
        self.max_id = int(ids.max()) if ids.size else -1
        if ids.dtype != np.int32:
            if ids.size and (self.max_id >= 2**31 or ids.min() < -2**31):
                raise ValueError("token ids must fit in int32")
            ids = ids.astype(np.int32)
        shift = [0, *accumulate(lens)][:-1]  # each segment's start, less its first position
        for k, m in enumerate(skip):
            shift[k] -= m
        for k, start in enumerate(starts):
            shift[len(trunks) + k] -= start
        positions = np.arange(ns + nq, dtype=np.int32)
        if len(lens) > 1 or any(skip):
            positions -= np.repeat(np.asarray(shift, dtype=np.int32), lens)
        ids, positions = ids.tobytes(), positions.tobytes()
        self._tokens = (ids[: 4 * ns], ids[4 * ns:], positions[: 4 * ns], positions[4 * ns:])
        self.parts = _Parts(self)

    def option_rows(self, width: int) -> bytes:
        """[reads, width] head rows of each read's options, zero-padded (int64 bytes)."""
        rows = array("q")
        for options in self._options:
            if len(options) > width:
                raise ValueError(f"a question has {len(options)} options; the round holds {width}")
            rows.extend(options)
            rows.extend(_ZEROS[: width - len(options)])
        return rows.tobytes()


_ZEROS = array("q", bytes(8 * 1024))


class _Parts(dict):
    """width -> a request's parts with option rows of that width, made on first use."""

    __slots__ = ("layout",)

    def __init__(self, layout: RequestLayout):
        super().__init__()
        self.layout = layout

    def __missing__(self, width: int) -> tuple[bytes, ...]:
        lay = self.layout
        parts = self[width] = lay._small + (lay.option_rows(width),) + lay._tokens
        return parts


_FILL32: dict[int, bytes] = {}


def _fill32(value: int, n: int) -> memoryview:
    """n int32 copies of `value` as bytes (cached, grown as needed)."""
    block = _FILL32.get(value)
    if block is None or len(block) < 4 * n:
        block = _FILL32[value] = np.full(max(n, 4096, 2 * len(block or b"") // 4), value, dtype=np.int32).tobytes()
    return memoryview(block)[: 4 * n]


def build_round(requests: list[PreparedRequest], shape: Shape, pad_id: int, out: torch.Tensor | None = None,
                layouts: list[RequestLayout] | None = None) -> Round:
    """Lays `requests` out as one stream of `shape.tokens` tokens (each branch's `options` must be set; a request's
    part is computed on its first round and cached, so its branches must not change after that).

    With `out` (a contiguous 1-D int64 CPU tensor of `packed_size(shape)` elements, e.g. pinned and reused round after
    round) every element of it is written and the round's tensors are views of it; otherwise a fresh buffer is used.
    `layouts`: each request's part when it is not `request.round_layout` (a request resuming from checkpoints).
    """
    out, words, view, tensors = _buffers(out, shape)
    packing = _packing(shape)
    for start, end in packing.gaps:  # alignment padding: zeros, so that every byte of the buffer is written
        words[start:end] = 0
    T, L = shape.tokens, shape.options
    R = len(requests)
    layouts = layouts if layouts is not None else [request.round_layout for request in requests]
    cols = list(zip(*[lay.parts[L] for lay in layouts])) or [()] * (_SMALL + _TOKEN_PARTS)
    small = np.frombuffer(b"".join(chain.from_iterable(cols[:_SMALL])), dtype=np.int64)
    counts = small[: R * _COUNTS].reshape(R, _COUNTS)
    ends = counts.cumsum(0)
    ns_tok, nq_tok, NS, NB, NR, NSC, NBC, n_trunk_reads = ends[-1].tolist() if R else (0,) * _COUNTS
    n = ns_tok + nq_tok
    if n > T or NS > shape.states or NB > shape.branches or NR > shape.readout_rows:
        raise ValueError(f"round needs {n} tokens, {NS} states, {NB} branches, {NR} reads; capacity {shape}")
    if NSC > shape.state_chunks or NBC > shape.branch_chunks:
        raise ValueError(f"round needs {NSC} + {NBC} GDN chunks; capacity {shape.state_chunks} + "
                         f"{shape.branch_chunks}")
    # Each request's first state token, question token (counted from 0 here), state, branch
    first = ends - counts
    i = R * _COUNTS
    seglens = small[i: i + NS + NB]
    i += NS + NB
    branch_state = small[i: i + NB]
    i += NB
    branch_sub = small[i: i + NB]
    i += NB
    read_rel = small[i: i + NR]
    i += NR
    state_chunks = small[i: i + 2 * NSC].reshape(NSC, 2)
    i += 2 * NSC
    branch_chunks = small[i: i + 2 * NBC].reshape(NBC, 2)
    i += 2 * NBC
    option_rows = small[i: i + NR * L].reshape(NR, L)

    # input_ids and positions (int32 bytes already), with their tail padding and the alignment padding between them,
    # in one byte copy
    p0 = packing.fields[1][1]  # positions' first word (input_ids' is 0)
    words[: p0 + T] = np.frombuffer(b"".join(chain(cols[_SMALL], cols[_SMALL + 1], (_fill32(pad_id, T - n),
                                                   _fill32(0, p0 - T)), cols[_SMALL + 2], cols[_SMALL + 3],
                                                   (_fill32(0, T - n),))), dtype=np.int32)

    # Segments: the states then the branches, contiguous from row 0
    seg_end = seglens.cumsum()
    seg_start = seg_end - seglens
    seg_start32, seg_end32 = seg_start.astype(np.int32), seg_end.astype(np.int32)
    branch_state = branch_state + np.repeat(first[:, 2], counts[:, 3])
    for name, values, used in (("state_start", seg_start[:NS], NS), ("state_len", seglens[:NS], NS),
                               ("branch_start", seg_start[NS:], NB), ("branch_len", seglens[NS:], NB),
                               ("branch_state", branch_state, NB)):
        v = view[name]
        v[:used] = values
        v[used:] = 0

    # Per token: piecewise constant over segments; the tail pads are their own segment and fork from nothing
    v = view["seg_lo"]
    v[:n] = np.repeat(seg_start32, seglens)
    v[n:] = _arange32(T)[n:]
    branch_lens = seglens[NS:]
    for name, bound in (("trunk_lo", seg_start32), ("trunk_hi", seg_end32)):
        v = view[name]
        v[:ns_tok] = 0
        v[ns_tok:n] = np.repeat(bound[branch_state], branch_lens)
        v[n:] = 0
    # nested forks: a leaf's tokens also see its sub-trunk's segment (a branch row of the same request)
    leaves = branch_sub >= 0
    for name, bound in (("sub_lo", seg_start32), ("sub_hi", seg_end32)):
        v = view[name]
        v[:] = 0
        if leaves.any():
            rows = branch_sub + np.repeat(first[:, 3], counts[:, 3])  # the sub-trunk's branch row in the round
            v[ns_tok:n] = np.repeat(np.where(leaves, bound[NS + rows * leaves], 0), branch_lens)

    # GDN chunk tables: unused rows name the empty segment one past the last row
    for name, rows, used, index, per_request, empty in (
            ("state_chunks", state_chunks, NSC, first[:, 2], counts[:, 5], shape.states),
            ("branch_chunks", branch_chunks, NBC, first[:, 3], counts[:, 6], shape.branches)):
        v = view[name]
        v[:used] = rows
        v[:used, 0] += np.repeat(index, per_request)
        v[used:, 0] = empty
        v[used:, 1] = 0

    # Readout rows: from the request's first question token, or its first state token for a read inside a trunk
    v = view["readout_rows"]
    per_read = counts[:, 4]
    np.add(np.repeat(first[:, 1] + ns_tok, per_read), read_rel, out=v[:NR])
    if n_trunk_reads:
        read_flag = np.frombuffer(b"".join([lay.trunk_reads for lay in layouts]), np.int64)
        v[:NR] -= read_flag * np.repeat(first[:, 1] + ns_tok - first[:, 0], per_read)
    v[NR:] = 0
    v = view["option_index"]
    v[:NR] = option_rows
    v[NR:] = 0

    round_ = Round(RoundTensors(*tensors), None, shape, n, out, requests)
    round_.layouts = layouts
    return round_


# id(out) -> (weakref to out, its data_ptr, {shape: (int32 numpy view of the whole buffer, numpy field views, torch
# field views)}); the entries hold views of the buffer, never the buffer's own object, and go when it goes
_BUFFERS: dict[int, tuple] = {}


def _buffers(out: torch.Tensor | None, shape: Shape) -> tuple[torch.Tensor, np.ndarray, dict, tuple]:
    """(buffer, int32 numpy view of all of it, numpy view of each field, torch view of each field): cached for a
    reused buffer."""
    packing = _packing(shape)
    if out is None:
        flat = np.empty(packing.size, dtype=np.int64)
        out = torch.from_numpy(flat)
        words = flat.view(np.int32)
        view = {name: (words if dtype is torch.int32 else flat)[offset: offset + count].reshape(dims)
                for name, offset, count, dims, _, dtype in packing.fields}
        return (out, words, view, _views(out, packing))
    key = id(out)
    entry = _BUFFERS.get(key)
    if entry is None or entry[0]() is not out or entry[1] != out.data_ptr():
        if (out.dim() != 1 or out.dtype != torch.int64 or out.numel() != packing.size or out.device.type != "cpu"
                or not out.is_contiguous()):
            raise ValueError(f"`out` must be a contiguous 1-D int64 CPU tensor of {packing.size} elements; got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
        entry = _BUFFERS[key] = (weakref.ref(out, partial(_forget, key)), out.data_ptr(), {})
    found = entry[2].get(shape)
    if found is None:
        if out.numel() != packing.size:
            raise ValueError(f"`out` must have {packing.size} elements for {shape}; got {out.numel()}")
        # tensors on the buffer's storage, not views of its tensor object (which they would keep alive)
        storage, base = out.untyped_storage(), out.storage_offset()

        def on_storage(offset, dims, strides, dtype):  # offset in elements of dtype from the buffer's start
            return torch.empty(0, dtype=dtype).set_(storage, base * (8 // dtype.itemsize) + offset, dims, strides)

        tensors = tuple(on_storage(offset, dims, strides, dtype)
                        for _, offset, _, dims, strides, dtype in packing.fields)
        found = entry[2][shape] = (on_storage(0, (2 * packing.size,), (1,), torch.int32).numpy(),
                                   {name: t.numpy() for (name, *_), t in zip(packing.fields, tensors)}, tensors)
    return (out, *found)


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _BUFFERS.get(key)
    if entry is not None and entry[0] is ref:
        del _BUFFERS[key]


def _views(flat: torch.Tensor, packing: _Packing) -> tuple[torch.Tensor, ...]:
    base = flat.storage_offset()
    words = flat.view(torch.int32)  # the same bytes as twice as many int32 (storage offsets in int32 elements)
    return tuple(flat.as_strided(dims, strides, base + offset) if dtype is torch.int64
                 else words.as_strided(dims, strides, 2 * base + offset)
                 for _, offset, _, dims, strides, dtype in packing.fields)


@lru_cache(maxsize=16)
def _arange32(n: int) -> np.ndarray:
    a = np.arange(n, dtype=np.int32)
    a.flags.writeable = False
    return a
