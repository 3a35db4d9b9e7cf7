"""A round: many requests laid out as ONE flat token stream, with its tree in fixed-capacity metadata tensors.

Layout, level-major with no padding between segments (padding only at the tail, up to the bucket):

    [state A1][state B1]...[question A1a][question A1b][question B1a]...[pad ... pad]

All states come first so that the two calls of the forked Gated DeltaNet each cover one contiguous region (the
states, then the questions): a varlen kernel then runs over exactly the tokens of its call.

Metadata (all int64; capacities T tokens, NS states, NB branches, O readout rows, L options per row):
    input_ids [T], positions [T]          a question's positions continue from the end of its state
    seg_lo [T]                            start of each token's own segment (a pad token: itself)
    trunk_lo [T], trunk_hi [T]            the state a question token forks from (empty for state tokens and pads)
    state_start [NS], state_len [NS]      the state segments (unused rows: length 0)
    branch_start [NB], branch_len [NB]    the question segments, and `branch_state` [NB], the state each forks from
    state_chunks [Cs, 2], branch_chunks [Cb, 2]
                                          (segment, chunk) of every 64-token GDN chunk; unused rows name an extra
                                          empty segment (NS or NB), so a kernel with a fixed grid returns early there
    readout_rows [O], option_index [O, L] the stream row read for each question, and the head rows of its options

Building is vectorised over tokens (numpy); only segments are visited in Python.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from .config import GDN_CHUNK, CapacityConfig
from .requests import PreparedRequest


@dataclass
class RoundTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    seg_lo: torch.Tensor
    trunk_lo: torch.Tensor
    trunk_hi: torch.Tensor
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
    return Footprint(request.stream_tokens, len(request.trunks), len(request.branches),
                     sum(len(b.reads) for b in request.branches), 1)


@dataclass
class Read:
    """Host-side record of one readout row: which request and question it answers."""

    request: int
    question: object  # transformers.decision.Question
    options: int
    tail: np.ndarray  # the prompt's tokens after its last mark, for the decision config's logits processors


@dataclass
class Round:
    tensors: RoundTensors
    reads: list[Read]
    shape: Shape
    used_tokens: int


def build_round(requests: list[PreparedRequest], shape: Shape, pad_id: int) -> Round:
    """Lays `requests` out as one stream of `shape.tokens` tokens (each branch's `options` must be set)."""
    seg_tokens, seg_is_state, seg_state, seg_pos0 = [], [], [], []
    read_request, read_prompt_pos, read_seg, read_questions, read_options, read_tails = [], [], [], [], [], []
    # Level-major: all states first (segment k is state k), then all questions
    first_state = []
    for req in requests:
        first_state.append(len(seg_tokens))
        for trunk in req.trunks:
            seg_state.append(len(seg_tokens)), seg_tokens.append(trunk), seg_is_state.append(True), seg_pos0.append(0)
    n_states = len(seg_tokens)
    for r, req in enumerate(requests):
        by_trunk: dict[int, list] = {}
        for branch in req.branches:
            by_trunk.setdefault(branch.trunk, []).append(branch)
        for t, trunk in enumerate(req.trunks):
            state_index = trunk_seg = first_state[r] + t
            for branch in by_trunk.get(t, []):
                seg = len(seg_tokens)
                seg_tokens.append(branch.tokens), seg_is_state.append(False), seg_state.append(state_index)
                seg_pos0.append(len(trunk))
                for pos, question, options in zip(branch.reads, branch.questions, branch.options):
                    # A read inside the trunk (a template that marks before the question) reads the state segment
                    in_trunk = pos < len(trunk)
                    read_request.append(r), read_questions.append(question), read_options.append(options)
                    read_tails.append(branch.tail)
                    read_seg.append(trunk_seg if in_trunk else seg)
                    read_prompt_pos.append(int(pos))

    lens = np.fromiter((len(s) for s in seg_tokens), dtype=np.int64, count=len(seg_tokens))
    n = int(lens.sum())
    n_branches = len(seg_tokens) - n_states
    if n > shape.tokens or n_states > shape.states or n_branches > shape.branches or len(read_seg) > shape.readout_rows:
        raise ValueError(f"round needs {n} tokens, {n_states} states, {n_branches} branches, {len(read_seg)} reads; "
                         f"capacity {shape}")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    is_state = np.asarray(seg_is_state, dtype=bool)
    state_of = np.asarray(seg_state, dtype=np.int64)
    pos0 = np.asarray(seg_pos0, dtype=np.int64)
    state_seg = np.flatnonzero(is_state)  # segment id of state k
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
    seg_trunk_lo = np.where(is_state, 0, state_lo[state_of])
    seg_trunk_hi = np.where(is_state, 0, state_lo[state_of] + state_len[state_of])
    trunk_lo, trunk_hi = np.zeros(T, dtype=np.int64), np.zeros(T, dtype=np.int64)
    trunk_lo[:n], trunk_hi[:n] = seg_trunk_lo[token_seg], seg_trunk_hi[token_seg]

    def padded(values, size, fill=0):
        out = np.full(size, fill, dtype=np.int64)
        out[: len(values)] = values
        return out

    branch_seg = np.flatnonzero(~is_state)
    state_start_t, state_len_t = padded(state_lo, shape.states), padded(state_len, shape.states)
    branch_start_t = padded(starts[branch_seg], shape.branches)
    branch_len_t = padded(lens[branch_seg], shape.branches)
    branch_state_t = padded(state_of[branch_seg], shape.branches)

    # Readout rows: the prompt position of a read, placed in the stream
    read_seg_a = np.asarray(read_seg, dtype=np.int64)
    read_pos = np.asarray(read_prompt_pos, dtype=np.int64)
    rows = starts[read_seg_a] + read_pos - pos0[read_seg_a] if len(read_seg_a) else read_pos
    option_index = np.zeros((shape.readout_rows, shape.options), dtype=np.int64)
    reads = []
    for i, (r, question, opts, tail) in enumerate(zip(read_request, read_questions, read_options, read_tails)):
        option_index[i, : len(opts)] = opts
        reads.append(Read(r, question, len(opts), tail))

    tensors = RoundTensors(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        seg_lo=torch.from_numpy(seg_lo),
        trunk_lo=torch.from_numpy(trunk_lo),
        trunk_hi=torch.from_numpy(trunk_hi),
        state_start=torch.from_numpy(state_start_t),
        state_len=torch.from_numpy(state_len_t),
        branch_start=torch.from_numpy(branch_start_t),
        branch_len=torch.from_numpy(branch_len_t),
        branch_state=torch.from_numpy(branch_state_t),
        state_chunks=torch.from_numpy(_chunk_table(state_len, shape.state_chunks, shape.states)),
        branch_chunks=torch.from_numpy(_chunk_table(lens[branch_seg], shape.branch_chunks, shape.branches)),
        readout_rows=torch.from_numpy(padded(rows, shape.readout_rows)),
        option_index=torch.from_numpy(option_index),
    )
    return Round(tensors, reads, shape, n)


def _chunk_table(lens: np.ndarray, capacity: int, empty_segment: int) -> np.ndarray:
    """[capacity, 2] (segment, chunk) rows for every 64-token chunk of each segment; unused rows point at segment
    `empty_segment` (one past the last real row), which kernels treat as empty."""
    chunks = -(-lens // GDN_CHUNK)
    segment = np.repeat(np.arange(len(lens)), chunks)
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)
    table = np.empty((capacity, 2), dtype=np.int64)
    table[:, 0], table[:, 1] = empty_segment, 0
    if len(segment) > capacity:
        raise ValueError(f"round needs {len(segment)} GDN chunks; capacity {capacity}")
    table[: len(segment), 0] = segment
    table[: len(segment), 1] = np.arange(len(segment)) - first
    return table
