"""The batch-invariant Triton fork attention (flide/ops/fork_attention/triton_invariant.py) on the GPU:

- against the fp32 reference, bf16 and fp32, the shapes of test_fork_attention_triton_gpu.py (odd stream lengths,
  GQA 8/2, 16/4, 8/8, 14/2, head dims 128 and 256), every output element written;
- bitwise invariance over random layouts: rounds of 1-64 random requests (states of 0-3,000 tokens, some requests
  with two states whose questions interleave in query blocks, questions of 1-80 tokens) in streams of up to 8,192
  tokens; a random request of each round laid out alone (with or without tail padding) gives torch.equal rows (its
  q / k / v rows identical in both streams);
- a forked question has the bits of the same question laid out with its state alone, and (state a whole number of
  key tiles long) of state + question as one causal segment;
- replay inside a CUDA graph equals eager, for other round compositions written into the captured buffers, and a
  request replayed inside a bucket equals the request run alone eagerly.

Not checked on the CPU (tests/test_fork_attention_invariant.py runs the kernel's logic in Triton's interpreter): the
GPU's own arithmetic (tensor-core dots, exp2, FMA contraction) and bf16.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flide.ops.registry import resolve
from flide.requests import Branch, PreparedRequest
from flide.round import Shape, build_round
from flide.testing import synthetic_request

from .test_fork_attention_gpu import TOL, graph_replays, inputs, rel_err

HEADS = [(8, 2, 256), (16, 4, 256), (8, 8, 128), (14, 2, 128)]
HEAD_IDS = [f"Hq{h[0]}-Hkv{h[1]}-D{h[2]}" for h in HEADS]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def kernel():
    from flide.ops.fork_attention import triton_invariant

    return triton_invariant


def invariant(q, k, v, seg_lo, trunk_lo, trunk_hi, scale):
    return kernel().fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale)


def reference(q, k, v, r, scale):
    return resolve("fork_attention", "reference")(q.float(), k.float(), v.float(), r.seg_lo, r.trunk_lo, r.trunk_hi,
                                                  scale)


def randn(tokens: int, heads: int, d: int, dtype, generator) -> torch.Tensor:
    return torch.randn(tokens, heads, d, device="cuda", generator=generator).to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 500, 3600])
def test_invariant_matches_reference(tokens, heads, dtype):
    hq, hkv, d = heads
    q, k, v, r = inputs(tokens, hq, hkv, d, dtype, seed=tokens + hq)
    scale = d ** -0.5
    ref = reference(q, k, v, r, scale)
    out = invariant(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    row_err = (out.float() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))  # a few wrong rows hide in the RMS
    assert row_err.max().item() < 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_invariant_writes_every_output_element(heads, dtype):
    hq, hkv, d = heads
    tokens = 777
    q, k, v, r = inputs(tokens, hq, hkv, d, dtype, seed=11)
    out = torch.full((tokens, hq, d), float("nan"), dtype=dtype, device="cuda")
    kernel().fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5, out=out)
    assert torch.isfinite(out).all()
    assert torch.equal(out, invariant(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5))


@pytest.mark.parametrize("heads", HEADS[:2], ids=HEAD_IDS[:2])
@pytest.mark.parametrize("tokens", [437, 3600, 8192])
def test_invariant_value_parts_have_the_bits_of_one_program(tokens, heads):
    """bf16 with the value columns in two programs (`v_parts=2`, what `triton_invariant.V_SPLIT_DIM` turns on for
    Qwen3.5's 256-dim heads): every element has the bits of the one-program kernel (the same scores, each column
    summed over the same keys in the same MMA steps), so batch-invariant answers do not move with the switch."""
    hq, hkv, d = heads
    q, k, v, r = inputs(tokens, hq, hkv, d, torch.bfloat16, seed=tokens + 5)
    args = (q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5)
    one = kernel().fork_attention(*args, v_parts=1)
    two = kernel().fork_attention(*args, v_parts=2)
    assert torch.equal(two, one)
    assert rel_err(two, reference(q, k, v, r, d ** -0.5)) < TOL[torch.bfloat16]


# ---------------------------------------------------------------------------------------------------------------------
# Invariance
# ---------------------------------------------------------------------------------------------------------------------


def random_request(rng: random.Random, small: bool = False) -> PreparedRequest:
    """States: none, short, RACE-like or long; 1-16 questions of 1-80 tokens (a third of them 1-4 tokens, so that
    several share a query block); one request in six has two states with interleaved questions (Jev's template).
    small: states of at most 200 tokens and 1-4 questions (so that up to 64 requests fit in a round)."""
    def tokens(n):
        return np.array([rng.randrange(1000) for _ in range(n)], dtype=np.int64)

    def question_len():
        return rng.randint(1, 4) if rng.random() < 0.33 else rng.randint(5, 80)

    def state_len():
        if small:
            return rng.choice([0, rng.randint(1, 64), rng.randint(64, 200)])
        return rng.choice([0, rng.randint(1, 64), rng.randint(64, 600), rng.randint(600, 3000)])

    n_questions = rng.randint(1, 4 if small else 16)
    if rng.random() < 1 / 6:
        lens = (state_len(), state_len())
        branches = []
        for _ in range(n_questions):
            t, n = rng.randint(0, 1), question_len()
            branches.append(Branch(t, tokens(n), np.array([lens[t] + n - 1]), [object()], np.zeros(0, np.int64),
                                   [[1, 2]]))
        return PreparedRequest([tokens(n) for n in lens], branches)
    return synthetic_request(tokens(state_len()), [tokens(question_len()) for _ in range(n_questions)])


def random_requests(rng: random.Random, max_tokens: int) -> list[PreparedRequest]:
    """1-64 requests, as many as fit in max_tokens (at least one); in half the rounds small ones (many fit)."""
    out, used = [], 0
    small = rng.random() < 0.5
    for _ in range(rng.randint(1, 64)):
        p = random_request(rng, small)
        if used + p.stream_tokens > max_tokens:
            continue
        out.append(p)
        used += p.stream_tokens
    return out or [synthetic_request(np.arange(10), [np.arange(3)])]


def lay_out(requests: list[PreparedRequest], pad: int = 0):
    """The round of `requests` in a stream of their tokens + `pad`, on the GPU, and each request's stream rows (its
    states, then its questions, as build_round lays them out)."""
    tokens = sum(p.stream_tokens for p in requests) + pad
    states = max(sum(len(p.trunks) for p in requests), 1)
    branches = max(sum(len(p.branches) for p in requests), 1)
    r = build_round(requests, Shape(tokens, states, branches, branches, 2), 0).tensors
    rows, s0, b0 = [], 0, 0
    for p in requests:
        segs = [(int(r.state_start[s]), int(r.state_len[s])) for s in range(s0, s0 + len(p.trunks))]
        segs += [(int(r.branch_start[b]), int(r.branch_len[b])) for b in range(b0, b0 + len(p.branches))]
        rows.append(torch.cat([torch.arange(a, a + n) for a, n in segs]).cuda())
        s0, b0 = s0 + len(p.trunks), b0 + len(p.branches)
    return r.to("cuda"), rows


@pytest.mark.parametrize("dtype,heads,rounds", [
    (torch.bfloat16, (8, 2, 256), 200),
    (torch.float32, (8, 2, 256), 40),
    (torch.bfloat16, (16, 4, 256), 40),
    (torch.bfloat16, (14, 2, 128), 60),  # group 7: 18 tokens a query block, 2 rows idle
], ids=["bf16-Hq8-Hkv2-D256", "fp32-Hq8-Hkv2-D256", "bf16-Hq16-Hkv4-D256", "bf16-Hq14-Hkv2-D128"])
def test_invariant_alone_vs_inside_random_rounds(dtype, heads, rounds):
    hq, hkv, d = heads
    rng = random.Random(hq * 1000 + d + (dtype == torch.float32))
    g = torch.Generator(device="cuda").manual_seed(rounds)
    scale = d ** -0.5
    sizes = []
    for i in range(rounds):
        requests = random_requests(rng, rng.randint(64, 8192))
        target = rng.randrange(len(requests))
        r_in, rows = lay_out(requests, pad=rng.choice([0, rng.randint(1, 700)]))
        r_al, (rows_al,) = lay_out([requests[target]], pad=rng.choice([0, rng.randint(1, 130)]))
        t_in, t_al = r_in.seg_lo.shape[0], r_al.seg_lo.shape[0]
        qkv_in = [randn(t_in, h, d, dtype, g) for h in (hq, hkv, hkv)]
        qkv_al = [randn(t_al, h, d, dtype, g) for h in (hq, hkv, hkv)]
        for x_al, x_in in zip(qkv_al, qkv_in):
            x_al[rows_al] = x_in[rows[target]]
        out_in = invariant(*qkv_in, r_in.seg_lo, r_in.trunk_lo, r_in.trunk_hi, scale)
        out_al = invariant(*qkv_al, r_al.seg_lo, r_al.trunk_lo, r_al.trunk_hi, scale)
        a, b = out_in[rows[target]], out_al[rows_al]
        if not torch.equal(a, b):
            bad = (a != b).flatten(1).any(1).nonzero().flatten()
            pytest.fail(f"round {i}: {len(requests)} requests, T={t_in}, target {target} ({len(rows_al)} rows, "
                        f"{len(requests[target].trunks)} states): {len(bad)} rows differ, first at target row "
                        f"{int(bad[0])} (stream row {int(rows[target][bad[0]])} inside, {int(rows_al[bad[0]])} "
                        f"alone), max |diff| {(a.float() - b.float()).abs().max().item():.3g}")
        if i % 25 == 0:  # equal bits of two wrong answers would prove nothing
            assert rel_err(out_in, reference(*qkv_in, r_in, scale)) < TOL[dtype]
        sizes.append((len(requests), t_in))
    assert max(n for n, _ in sizes) >= 32 and max(t for _, t in sizes) >= 4096  # the draw covered big rounds


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_invariant_forked_question_equals_state_and_question_alone(dtype):
    """A state of 128 tokens (a whole number of key tiles: 64 for bf16, 16 for fp32 at dim 256) with 12 questions,
    among other requests: each question laid out with its state alone gives the same bits, and so does the state +
    question laid out as one causal segment (the tiles fall at the same keys and trunk and own tiles run the same
    code; a property of this kernel, not something batch-invariant mode needs)."""
    hq, hkv, d = 8, 2, 256
    rng = random.Random(5)
    state = [rng.randrange(1000) for _ in range(128)]
    questions = [[rng.randrange(1000) for _ in range(rng.choice([1, 2, 3, 17, 40, 70]))] for _ in range(12)]
    requests = [random_request(rng) for _ in range(3)]
    requests.insert(2, synthetic_request(state, questions))
    r_in, rows = lay_out(requests, pad=100)
    rows = rows[2]
    g = torch.Generator(device="cuda").manual_seed(0)
    t_in = r_in.seg_lo.shape[0]
    q, k, v = (randn(t_in, h, d, dtype, g) for h in (hq, hkv, hkv))
    out_in = invariant(q, k, v, r_in.seg_lo, r_in.trunk_lo, r_in.trunk_hi, d ** -0.5)
    assert rel_err(out_in, reference(q, k, v, r_in, d ** -0.5)) < TOL[dtype]
    cursor = 128
    for question in questions:
        mine = torch.cat([rows[:128], rows[cursor: cursor + len(question)]])
        cursor += len(question)
        forked, _ = lay_out([synthetic_request(state, [question])])
        joined, _ = lay_out([synthetic_request(state + question, [[0]])])
        for name, r in (("forked", forked), ("joined", joined)):
            n = r.seg_lo.shape[0]
            x = [torch.zeros(n, h, d, dtype=dtype, device="cuda") for h in (hq, hkv, hkv)]
            for xi, src in zip(x, (q, k, v)):
                xi[: len(mine)] = src[mine]
            out = invariant(*x, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5)
            assert torch.equal(out[: len(mine)], out_in[mine]), (name, len(question))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_invariant_prefix_rows_equal_the_fresh_stream(dtype):
    """Checkpoints (the prefix phase): two states of 256 + 40 and 256 + 300 tokens resumed at m = 256 (a whole number
    of key tiles), their first m keys given as pk / pv rows, among requests without checkpoints: within the
    reference's tolerance of `fork_attention_prefix`, and every kept row torch.equal to the same row of the fresh
    stream (the same key tiles in the same order, on the GPU's own arithmetic)."""
    from flide.ops.fork_attention import reference as attn_ref
    from flide.testing import checkpoint_prefix, resume_states

    hq, hkv, d, m = 8, 2, 256, 256
    rng = random.Random(9)
    targets = [synthetic_request([rng.randrange(1000) for _ in range(m + n)],
                                 [[rng.randrange(1000) for _ in range(rng.choice([1, 5, 30]))] for _ in range(4)])
               for n in (40, 300)]
    requests = [random_request(rng) for _ in range(2)] + [targets[0], random_request(rng), targets[1]]
    r, rows = lay_out(requests, pad=50)
    cuts = [(int(rows[2][0]), m), (int(rows[4][0]), m)]
    g = torch.Generator(device="cuda").manual_seed(3)
    T = r.seg_lo.shape[0]
    q, k, v = (randn(T, h, d, dtype, g) for h in (hq, hkv, hkv))
    fresh = invariant(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5)
    kept, seg_lo, trunk_lo, trunk_hi, checkpoint = resume_states(r.seg_lo.cpu(), r.trunk_lo.cpu(), r.trunk_hi.cpu(),
                                                                 cuts)
    pre_lo, pre_hi, cut = checkpoint_prefix(checkpoint, cuts)
    kept, cut, meta = kept.cuda(), cut.cuda(), [x.cuda() for x in (seg_lo, trunk_lo, trunk_hi, pre_lo, pre_hi)]
    got = kernel().fork_attention(q[kept], k[kept], v[kept], *meta[:3], d ** -0.5,
                                  prefix=(k[cut], v[cut], meta[3], meta[4]))
    want = attn_ref.fork_attention_prefix(q[kept].float(), k[kept].float(), v[kept].float(), *meta[:3],
                                          k[cut].float(), v[cut].float(), meta[3], meta[4], d ** -0.5)
    assert rel_err(got, want) < TOL[dtype]
    assert torch.equal(got, fresh[kept])


# ---------------------------------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_invariant_replays_in_a_cuda_graph_with_other_rounds(dtype):
    for q2, k2, v2, r2, out, eager in graph_replays(invariant, dtype):
        assert torch.equal(out, eager)
        assert rel_err(out, reference(q2, k2, v2, r2, 256 ** -0.5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_invariant_bucket_replay_equals_request_alone(dtype):
    """As the graph runner uses it: captured once on a 8,192-token bucket; rounds of random requests written into
    the bucket's buffers (padded to its size) and replayed; each round's target request run alone, eagerly, in a
    stream of its own size, has the same bits."""
    hq, hkv, d, bucket = 8, 2, 256, 8192
    rng = random.Random(9)
    g = torch.Generator(device="cuda").manual_seed(1)
    scale = d ** -0.5
    static = [randn(bucket, h, d, dtype, g) for h in (hq, hkv, hkv)]
    static += [torch.arange(bucket, device="cuda"), torch.zeros(bucket, dtype=torch.int64, device="cuda"),
               torch.zeros(bucket, dtype=torch.int64, device="cuda")]
    for _ in range(2):
        invariant(*static, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = invariant(*static, scale)
    for _ in range(8):
        requests = random_requests(rng, rng.randint(1000, bucket))
        target = rng.randrange(len(requests))
        r_in, rows = lay_out(requests, pad=bucket - sum(p.stream_tokens for p in requests))
        for buffer, value in zip(static, [randn(bucket, h, d, dtype, g) for h in (hq, hkv, hkv)]
                                 + [r_in.seg_lo, r_in.trunk_lo, r_in.trunk_hi]):
            buffer.copy_(value)
        graph.replay()
        r_al, (rows_al,) = lay_out([requests[target]])
        x = [torch.zeros(r_al.seg_lo.shape[0], h, d, dtype=dtype, device="cuda") for h in (hq, hkv, hkv)]
        for xi, src in zip(x, static[:3]):
            xi[rows_al] = src[rows[target]]
        alone = invariant(*x, r_al.seg_lo, r_al.trunk_lo, r_al.trunk_hi, scale)
        assert torch.equal(out[rows[target]], alone[rows_al])
