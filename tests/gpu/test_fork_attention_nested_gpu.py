"""Nested forks in the batch-invariant Triton fork attention on the GPU (`triton_invariant.fork_attention(...,
sub=)`, the op `flide::fork_attention_nested_triton_invariant`): a leaf question also sees its sub-trunk's keys
[sub_lo, sub_hi), a question line shared by several questions and laid out once as its own segment.

- against the fp32 reference (`reference.fork_attention(..., sub_lo, sub_hi)`), fp32 and bf16, at Qwen3.5-0.8B's
  attention heads (8 query heads, 2 KV heads, head dim 256) and at 16/4 heads, on streams of MultiRC-shaped requests
  (states of 0-2,000 tokens, question lines of 8-40 tokens each continued by 2-6 leaves of 1-20 tokens, plain
  questions), leaves after their sub-trunk (the nested layout) or in a random order, every element written;
- bitwise invariance over random rounds: a random request alone gives torch.equal rows to the same request inside a
  round of up to 24 others (other offsets, other query-block neighbours);
- rows without a sub range have the bits of the kernel without `sub` (compiled without the sub-trunk phase);
- a leaf whose state and sub-trunk are whole key tiles has the bits of its tokens laid out as one causal segment;
- opcheck of the custom op on CUDA.

The same checks at small shapes run on the CPU in Triton's interpreter (tests/test_fork_attention_nested.py), which
checks the tile logic, not the GPU's arithmetic (tensor-core dots, bf16).
"""

from __future__ import annotations

import random

import pytest
import torch

from flide.ops.fork_attention import fork_attention_nested_triton_invariant
from flide.ops.fork_attention import reference as attn_ref
from flide.testing import NestedRequest, lay_out_nested

from .test_fork_attention_gpu import TOL, rel_err

HEADS = [(8, 2, 256), (16, 4, 256)]
HEAD_IDS = [f"Hq{h[0]}-Hkv{h[1]}-D{h[2]}" for h in HEADS]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def kernel():
    from flide.ops.fork_attention import triton_invariant

    return triton_invariant


# ---------------------------------------------------------------------------------------------------------------------
# Nested streams: a request is (state length, [(sub-trunk length, [leaf lengths])], [plain question lengths])
# ---------------------------------------------------------------------------------------------------------------------

def lay_out(requests: list, pad: int = 0, rng: random.Random | None = None):
    """`flide.testing.lay_out_nested` of (state, subs, plain) tuples: the stream's tables (seg_lo, trunk_lo, trunk_hi,
    sub_lo, sub_hi: int32 on the GPU, as a round's), each request's rows and its spans by name."""
    stream = lay_out_nested([NestedRequest(state, tuple((n, tuple(leaves)) for n, leaves in subs), tuple(plain))
                             for state, subs, plain in requests], pad, rng)
    return list(stream.tables(torch.int32, "cuda")), [rows.cuda() for rows in stream.rows], stream.spans


def random_request(rng: random.Random, long_states: bool = True):
    """MultiRC's shape: a state, 1-4 question lines of 8-40 tokens each continued by 2-6 candidate leaves of 1-20
    tokens, 0-3 plain questions of 1-60 tokens; one request in four without question lines."""
    lengths = [0, rng.randint(1, 64), rng.randint(64, 600)]
    state = rng.choice(lengths + [rng.randint(600, 2000)] if long_states else lengths)
    subs = [(rng.randint(8, 40), [rng.randint(1, 20) for _ in range(rng.randint(2, 6))])
            for _ in range(0 if rng.random() < 0.25 else rng.randint(1, 4))]
    return state, subs, [rng.randint(1, 60) for _ in range(rng.randint(0 if subs else 1, 3))]


def randn(tokens: int, heads: int, d: int, dtype, generator) -> torch.Tensor:
    return torch.randn(tokens, heads, d, device="cuda", generator=generator).to(dtype)


def nested(q, k, v, tables, scale, **kwargs) -> torch.Tensor:
    seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi = tables
    return kernel().fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale, sub=(sub_lo, sub_hi), **kwargs)


def reference(q, k, v, tables, scale) -> torch.Tensor:
    seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi = tables
    return attn_ref.fork_attention(q.float(), k.float(), v.float(), seg_lo, trunk_lo, trunk_hi, scale, sub_lo, sub_hi)


# ---------------------------------------------------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shuffled", [False, True], ids=["level", "shuffled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_nested_matches_reference(heads, dtype, shuffled):
    hq, hkv, d = heads
    rng = random.Random(hq + d + shuffled)
    tables, _, _ = lay_out([random_request(rng) for _ in range(8)], pad=37, rng=rng if shuffled else None)
    T = tables[0].shape[0]
    g = torch.Generator(device="cuda").manual_seed(hq)
    q, k, v = (randn(T, h, d, dtype, g) for h in (hq, hkv, hkv))
    out = nested(q, k, v, tables, d ** -0.5, out=torch.full((T, hq, d), float("nan"), dtype=dtype, device="cuda"))
    ref = reference(q, k, v, tables, d ** -0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    row_err = (out.float() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))  # a few wrong rows hide in the RMS
    assert row_err.max().item() < 10 * TOL[dtype]
    leaves = tables[4] > tables[3]
    assert leaves.sum() > 50 and row_err[leaves].max().item() < 10 * TOL[dtype]


def test_opcheck_nested_op():
    rng = random.Random(1)
    tables, _, _ = lay_out([random_request(rng, long_states=False) for _ in range(3)], pad=5)
    T = tables[0].shape[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (randn(T, h, 64, torch.float32, g) for h in (4, 2, 2))
    torch.library.opcheck(fork_attention_nested_triton_invariant, (q, k, v, *tables, 0.125))


# ---------------------------------------------------------------------------------------------------------------------
# Invariance
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,rounds", [(torch.bfloat16, 60), (torch.float32, 20)], ids=DTYPE_IDS[::-1])
def test_nested_alone_vs_inside_random_rounds(dtype, rounds):
    hq, hkv, d = 8, 2, 256
    rng = random.Random(rounds)
    g = torch.Generator(device="cuda").manual_seed(rounds)
    scale = d ** -0.5
    for i in range(rounds):
        requests = [random_request(rng, long_states=rng.random() < 0.3) for _ in range(rng.randint(1, 25))]
        target = rng.randrange(len(requests))
        t_in, rows, _ = lay_out(requests, pad=rng.choice([0, rng.randint(1, 300)]),
                                rng=rng if rng.random() < 0.5 else None)
        t_al, (rows_al,), _ = lay_out([requests[target]], pad=rng.choice([0, rng.randint(1, 100)]))
        x_in = [randn(t_in[0].shape[0], h, d, dtype, g) for h in (hq, hkv, hkv)]
        x_al = [randn(t_al[0].shape[0], h, d, dtype, g) for h in (hq, hkv, hkv)]
        for a, b in zip(x_al, x_in):
            a[rows_al] = b[rows[target]]
        out_in, out_al = nested(*x_in, t_in, scale), nested(*x_al, t_al, scale)
        a, b = out_in[rows[target]], out_al[rows_al]
        if not torch.equal(a, b):
            bad = (a != b).flatten(1).any(1).nonzero().flatten()
            pytest.fail(f"round {i}: {len(requests)} requests, T={t_in[0].shape[0]}, target {target}: {len(bad)} "
                        f"rows differ, max |diff| {(a.float() - b.float()).abs().max().item():.3g}")
        if i % 10 == 0:  # equal bits of two wrong answers would prove nothing
            assert rel_err(out_in, reference(*x_in, t_in, scale)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_without_sub_keep_the_plain_kernels_bits(dtype):
    hq, hkv, d = 8, 2, 256
    rng = random.Random(3)
    tables, _, _ = lay_out([random_request(rng) for _ in range(8)], pad=20, rng=rng)
    T = tables[0].shape[0]
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (randn(T, h, d, dtype, g) for h in (hq, hkv, hkv))
    plain = kernel().fork_attention(q, k, v, *tables[:3], d ** -0.5)
    no_sub = tables[4] <= tables[3]
    assert torch.equal(nested(q, k, v, tables, d ** -0.5)[no_sub], plain[no_sub])
    empty = torch.zeros_like(tables[3])
    assert torch.equal(nested(q, k, v, [*tables[:3], empty, empty], d ** -0.5), plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_leaf_equals_one_causal_segment(dtype):
    """A state of 128 tokens and a question line of 64 (whole key tiles: 64 for bf16, 16 for fp32 at dim 256) with
    5 leaves, among other requests: each leaf's rows have the bits of state + line + leaf laid out as one segment."""
    hq, hkv, d = 8, 2, 256
    rng = random.Random(7)
    target = (128, [(64, [1, 3, 17, 40, 70])], [5])
    requests = [random_request(rng) for _ in range(3)]
    requests.insert(1, target)
    tables, _, spans = lay_out(requests, pad=30)
    T = tables[0].shape[0]
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (randn(T, h, d, dtype, g) for h in (hq, hkv, hkv))
    out = nested(q, k, v, tables, d ** -0.5)
    assert rel_err(out, reference(q, k, v, tables, d ** -0.5)) < TOL[dtype]
    spans = spans[1]
    for j in range(5):
        rows = torch.tensor([*spans["state"], *spans["sub0"], *spans[f"leaf0.{j}"]], device="cuda")
        joined, _, _ = lay_out([(len(rows), [], [])])
        x = [t[rows] for t in (q, k, v)]
        n = len(spans[f"leaf0.{j}"])
        assert torch.equal(nested(*x, joined, d ** -0.5)[-n:], out[rows[-n:]]), j
