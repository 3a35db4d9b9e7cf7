"""Stream-length buckets: which round shape a set of requests takes, and how many requests go into each round.

A round takes the smallest bucket whose capacities hold it. Requests are packed in arrival order into rounds of the
largest bucket's capacities; a round that would overflow is closed and the next one started, so rounds split only
at request boundaries. A single request larger than the largest bucket runs alone, in a shape of its own size (the
same flat-stream code, eagerly: no captured graph has its shape). With `serve.fill_buckets` the serve scheduler
takes only the prefix of a round that fills its bucket best (`fill_prefix`) and leaves the rest to lead the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from ..config import GDN_CHUNK, CapacityConfig
from ..round import Footprint, Shape

_tokens, _states, _branches, _readout_rows, _requests = (
    attrgetter(name) for name in ("tokens", "states", "branches", "readout_rows", "requests"))


@dataclass(frozen=True)
class PlannedRound:
    requests: list[int]  # indices into the caller's list, in order
    shape: Shape
    oversized: bool  # True: larger than every bucket (runs eagerly, never from a captured graph)


def bucket_for(tokens: int, caps: CapacityConfig) -> int | None:
    """The smallest bucket holding `tokens`, or None when none does."""
    return next((b for b in caps.buckets if tokens <= b), None)


def exact_shape(need: Footprint, options: int) -> Shape:
    """A shape of the round's own size (eager runs: no captured graph needs fixed capacities)."""
    tokens = -(-max(need.tokens, 1) // GDN_CHUNK) * GDN_CHUNK
    return Shape(tokens, max(need.states, 1), max(need.branches, 1), max(need.readout_rows, 1), options)


# Rows of a bucket's tables per token, below the largest bucket: states average 64 tokens or more in a round
# (decision states are documents, conversations, trajectories: RACE's ~300, QuALITY's thousands), and a round's
# questions with their states average 16 tokens or more a question (a question is rendered inside its template: ~15
# tokens at least with Qwen's chat template; RACE rounds ~88, MultiRC ~43 with its sub-trunks); a round of shorter
# ones takes a larger bucket. Why cap them: fla's state call zero-fills and then writes every state row's float32
# final state (1 MiB a row per layer on Qwen3.5-0.8B: 0.8 ms of fills alone per replay at the 8,192 bucket with 192
# rows, H200 2026-11-30; states = tokens was the bulk of a replay), every branch row is 16 x 8 one-warp programs of
# the question kernel whether it holds a question or not (H200, 2026-12-02: 0.9 of the 9.4 ms replay of a 2,560
# bucket holding no question, at tokens / 4 rows), and readout rows also run the last MLP and the head's gather.
TOKENS_PER_STATE = 64
TOKENS_PER_BRANCH = 16
TOKENS_PER_READ = 16


def bucket_shape(tokens: int, caps: CapacityConfig, options: int) -> Shape:
    """The capacities of bucket `tokens`: the configured ones, capped by the bucket's size (every segment has a
    token and reads rarely outnumber tokens; states and branches take more tokens, see TOKENS_PER_STATE), so small
    buckets carry small tables, their kernels launch small grids and the last layer's MLP runs over few readout
    rows. The largest bucket keeps the configured capacities up to its size: whatever fits them fits a bucket."""
    largest = tokens >= caps.buckets[-1]
    states = tokens if largest else max(1, tokens // TOKENS_PER_STATE)
    branches = tokens if largest else max(1, tokens // TOKENS_PER_BRANCH)
    reads = tokens if largest else max(1, tokens // TOKENS_PER_READ)
    return Shape(tokens, min(caps.states, states), min(caps.branches, branches), min(caps.readout_rows, reads),
                 options)


def holds(shape: Shape, need: Footprint) -> bool:
    return (need.tokens <= shape.tokens and need.states <= shape.states and need.branches <= shape.branches
            and need.readout_rows <= shape.readout_rows)


def shape_for(need: Footprint, caps: CapacityConfig, options: int, exact: bool = False) -> tuple[Shape, bool]:
    """The bucketed shape of a round (or its exact shape when `exact`), and whether it exceeds every bucket."""
    if need.fits(caps, caps.buckets[-1]):
        for tokens in caps.buckets:
            if tokens < need.tokens:
                continue
            shape = bucket_shape(tokens, caps, options)
            if holds(shape, need):
                return (exact_shape(need, options) if exact else shape), False
    return exact_shape(need, options), True


def plan_rounds(needs: list[Footprint], caps: CapacityConfig, options: int, exact: bool = False) -> list[PlannedRound]:
    """Packs requests (their footprints, in order) into as few rounds as the capacities allow. With `exact`, each
    round gets a shape of its own size instead of its bucket's (for eager runs)."""
    largest = caps.buckets[-1]
    if 0 < len(needs) <= caps.requests:
        # Everything fits one round (footprints are never negative, so then every prefix fits too): one pass of sums
        total = Footprint(sum(map(_tokens, needs)), sum(map(_states, needs)), sum(map(_branches, needs)),
                          sum(map(_readout_rows, needs)), sum(map(_requests, needs)))
        if total.fits(caps, largest):
            shape, oversized = shape_for(total, caps, options, exact)
            return [PlannedRound(list(range(len(needs))), shape, oversized)]
    rounds: list[PlannedRound] = []
    current: list[int] = []
    total: Footprint | None = None

    def close():
        nonlocal current, total
        if current:
            shape, oversized = shape_for(total, caps, options, exact)
            rounds.append(PlannedRound(current, shape, oversized))
        current, total = [], None

    for index, need in enumerate(needs):
        if not need.fits(caps, largest):
            close()
            shape, _ = shape_for(need, caps, options, exact)
            rounds.append(PlannedRound([index], shape, True))
            continue
        combined = need if total is None else total + need
        if not combined.fits(caps, largest):
            close()
            combined = need
        current.append(index)
        total = combined
    close()
    return rounds


def fill_prefix(needs: list[Footprint], caps: CapacityConfig, options: int, overhead_tokens: int) -> int:
    """How many of a round's requests (footprints in order, all fitting one round) to run now so that the round
    wastes least on padding: the k maximising (stream tokens of the first k) / (their bucket's tokens +
    `overhead_tokens`), the largest such k on ties. `overhead_tokens` prices a round's fixed cost (launch, host work,
    kernels that do not scale with tokens) in tokens: with it a round of many requests beats several small ones, so
    under light load every waiting request is still taken. Why: a round costs about its bucket's size; 16 RACE
    requests (~8,300 tokens) run in the 10,240 bucket, 15 of them (~7,800) in the 8,192 one. A round over every
    bucket (one oversized request) is taken whole."""
    best, best_rate = len(needs), -1.0
    total: Footprint | None = None
    for k, need in enumerate(needs, start=1):
        total = need if total is None else total + need
        shape, oversized = shape_for(total, caps, options)
        if oversized:
            return len(needs)
        rate = total.tokens / (shape.tokens + overhead_tokens)
        if rate >= best_rate:
            best, best_rate = k, rate
    return best
