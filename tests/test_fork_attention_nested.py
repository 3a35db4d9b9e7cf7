"""Fork attention with nested forks (sub-trunks): a leaf question also sees its sub-trunk's keys [sub_lo, sub_hi), a
question line shared by several questions and computed once in the stream as its own segment.

(a) the reference (`reference.fork_attention(..., sub_lo, sub_hi)`): a leaf's rows are plain causal attention over
    [its state's tokens, its sub-trunk's tokens, its own tokens] laid out as one sequence; a sub-trunk's rows are
    [state, sub-trunk]; rows without a sub range keep the bits of the call without sub ranges;
(b) the segments variant (batch-invariant CPU path): equal to the reference, and a request's rows have the same bits
    alone and among other requests at other offsets, with leaves after or before their sub-trunk;
(c) the batch-invariant Triton kernel's sub-trunk phase (`triton_invariant.fork_attention(..., sub=)`), in Triton's
    interpreter: equal to the reference, bitwise invariant as in (b), rows without a sub range with the bits of the
    kernel without `sub` (which is compiled without the phase), a leaf whose state and sub-trunk are whole key tiles
    with the bits of the same tokens as one causal segment, and a block of leaves scanning their sub-trunk once;
(d) opcheck of the new custom ops (CPU ones; the CUDA op in tests/gpu/test_fork_attention_nested_gpu.py).

Streams are laid out by hand (`lay_out`): every state, then the other segments level by level (sub-trunks and plain
questions, then leaves: the nested round layout) or in a random order (leaves before their sub-trunk too).

The kernel checks run in a child pytest with TRITON_INTERPRET=1, as in tests/test_fork_attention_invariant.py (which
explains why, and why `tl.dot` is replaced by a k-sequential dot there for the bitwise checks).
`TRITON_INTERPRET=1 python -m pytest tests/test_fork_attention_nested.py -k kernel` runs them directly.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from flide.config import KernelConfig
from flide.ops import registry
from flide.ops.fork_attention import (fork_attention_nested_reference, fork_attention_nested_segments,
                                      fork_attention_nested_triton_invariant)
from flide.ops.fork_attention import reference as attn_ref
from flide.testing import NestedRequest, NestedStream, interpreter_dot_by_k, lay_out_nested

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------------------------------
# NestedRequest streams
# ---------------------------------------------------------------------------------------------------------------------

def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def qkv(tokens: int, heads: tuple[int, int, int], seed: int, dv: int | None = None) -> list[torch.Tensor]:
    hq, hkv, d = heads
    return [randn(tokens, hq, d, seed=seed), randn(tokens, hkv, d, seed=seed + 1),
            randn(tokens, hkv, dv or d, seed=seed + 2)]


def nested_attention(q, k, v, s: NestedStream, scale: float, op=attn_ref.fork_attention, dtype=torch.int64):
    """`op` (a pure-torch fork attention: the reference, segments) on stream `s` with its sub ranges."""
    seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi = s.tables(dtype)
    return op(q, k, v, seg_lo, trunk_lo, trunk_hi, scale, sub_lo, sub_hi)


def causal(q, k, v, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention (float64) over the stream rows `rows` taken as one sequence, GQA as the ops."""
    group = q.shape[1] // k.shape[1]
    qq = q[rows].double()
    kk, vv = (x[rows].double().repeat_interleave(group, 1) for x in (k, v))
    scores = torch.einsum("rhd,shd->hrs", qq, kk) * scale
    future = torch.ones(len(rows), len(rows), dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hrs,shd->rhd", probs, vv).float()


def sequence(spans: dict[str, range], name: str, trunk: str | None, sub: str | None) -> torch.Tensor:
    """The stream rows of segment `name`'s prompt as one sequence: its state's, its sub-trunk's, then its own."""
    return torch.tensor([t for part in (trunk, sub, name) if part is not None for t in spans[part]], dtype=torch.long)


def random_nested(rng: random.Random, max_state: int = 30) -> NestedRequest:
    """A state of 0..max_state tokens, 1-2 sub-trunks of 1-12 tokens with 1-4 leaves of 1-6, 0-2 plain questions."""
    subs = tuple((rng.randint(1, 12), tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4))))
                 for _ in range(rng.randint(1, 2)))
    return NestedRequest(rng.randint(0, max_state), subs, tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 2))))


def plain_request(rng: random.Random) -> NestedRequest:
    """A request without nested forks (a state and plain questions)."""
    return NestedRequest(rng.randint(0, 20), (), tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3))))


def mixed_round(rng: random.Random, target: NestedRequest, others: int) -> tuple[list[NestedRequest], int]:
    """`target` at a random place among `others` random requests (nested or not): (requests, target's index)."""
    rest = [random_nested(rng) if rng.random() < 0.6 else plain_request(rng) for _ in range(others)]
    i = rng.randint(0, others)
    return rest[:i] + [target] + rest[i:], i


# Two requests with states, a sub-trunk with 3 leaves and one with 2, plain questions; tail pads
TWO_REQUESTS = [NestedRequest(9, ((5, (3, 1, 4)),), (2,)), NestedRequest(6, ((4, (2, 5)), (3, (1,))), (3, 1))]


# ---------------------------------------------------------------------------------------------------------------------
# (a) the reference
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shuffled", [False, True], ids=["level", "shuffled"])
def test_reference_leaf_rows_are_causal_attention_over_state_sub_trunk_and_leaf(shuffled):
    s = lay_out_nested(TWO_REQUESTS, pad=5, rng=random.Random(1) if shuffled else None)
    q, k, v = qkv(s.tokens, (4, 2, 16), seed=1)
    out = nested_attention(q, k, v, s, 0.25)
    leaves = 0
    for p, spans in zip(TWO_REQUESTS, s.spans):
        for name, _, trunk, sub in p.segments():
            rows = sequence(spans, name, trunk, sub)
            n = len(spans[name])
            torch.testing.assert_close(out[rows[-n:]], causal(q, k, v, rows, 0.25)[-n:], atol=1e-5, rtol=1e-5)
            leaves += sub is not None
    assert leaves == 6
    if shuffled:  # some leaf lies before its sub-trunk in the stream
        assert any(spans[name].start < spans[sub].start for spans, p in zip(s.spans, TWO_REQUESTS)
                   for name, _, _, sub in p.segments() if sub is not None)
    # every row, pads included, against the per-query oracle
    want = attn_ref.fork_attention_naive(q, k, v, *s.tables()[:3], 0.25, sub_lo=s.sub_lo, sub_hi=s.sub_hi)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_reference_rows_without_sub_keep_their_bits(dtype):
    """One query block (the reference's key list is the block's: a sub-trunk outside it would lengthen the other rows'
    softmax by masked keys, changing a sum's order, not its value). Empty sub ranges everywhere: every row's bits."""
    s = lay_out_nested(TWO_REQUESTS + [NestedRequest(12, ((6, (2, 2)),))], pad=3, rng=random.Random(2))
    seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi = s.tables(dtype)
    q, k, v = qkv(s.tokens, (4, 2, 16), seed=2, dv=8)
    plain = attn_ref.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, 0.25)
    out = attn_ref.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, 0.25, sub_lo, sub_hi)
    no_sub = sub_hi <= sub_lo
    assert 0 < int(no_sub.sum()) < s.tokens
    assert torch.equal(out[no_sub], plain[no_sub])
    assert not torch.allclose(out[~no_sub], plain[~no_sub])
    empty = torch.zeros_like(sub_lo)
    assert torch.equal(attn_ref.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, 0.25, empty, empty), plain)
    segments = attn_ref.fork_attention_segments(q, k, v, seg_lo, trunk_lo, trunk_hi, 0.25)
    nested = attn_ref.fork_attention_segments(q, k, v, seg_lo, trunk_lo, trunk_hi, 0.25, sub_lo, sub_hi)
    assert torch.equal(nested[no_sub], segments[no_sub])


def test_reference_over_several_query_blocks(monkeypatch):
    """Query blocks of 16 rows: a block of leaves whose sub-trunk lies outside its key list gets its keys added."""
    monkeypatch.setattr(attn_ref, "QUERY_BLOCK", 16)
    rng = random.Random(3)
    s = lay_out_nested([random_nested(rng) for _ in range(5)], pad=4, rng=rng)
    q, k, v = qkv(s.tokens, (6, 2, 16), seed=3)
    want = attn_ref.fork_attention_naive(q, k, v, *s.tables()[:3], 0.3, sub_lo=s.sub_lo, sub_hi=s.sub_hi)
    torch.testing.assert_close(nested_attention(q, k, v, s, 0.3), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# (b) the segments variant
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segments_matches_reference(seed):
    rng = random.Random(seed)
    s = lay_out_nested([random_nested(rng) if i % 3 else plain_request(rng) for i in range(6)], pad=rng.randint(0, 6),
                rng=rng if seed else None)
    heads = [(4, 2, 16), (3, 1, 24), (2, 2, 16)][seed]
    q, k, v = qkv(s.tokens, heads, seed=seed + 10, dv=8 if seed == 2 else None)
    want = nested_attention(q, k, v, s, 0.25)
    got = nested_attention(q, k, v, s, 0.25, attn_ref.fork_attention_segments, torch.int32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_segments_is_batch_invariant(seed):
    """The target alone (level layout, no pads) and among 2-5 others at a random place (level or random order, pads):
    its rows have the same bits."""
    rng = random.Random(seed + 20)
    target = NestedRequest(rng.randint(3, 30), ((rng.randint(2, 10), (2, 1, 5)), (rng.randint(1, 8), (3,))), (2,))
    requests, i = mixed_round(rng, target, rng.randint(2, 5))
    inside = lay_out_nested(requests, pad=rng.randint(0, 7), rng=rng if seed % 2 else None)
    alone = lay_out_nested([target])
    q, k, v = qkv(inside.tokens, (4, 2, 16), seed=seed)
    rows_in, rows_al = inside.rows[i], alone.rows[0]
    assert not torch.equal(rows_in, rows_al)  # laid out at other rows
    x_al = [torch.zeros(alone.tokens, *x.shape[1:]) for x in (q, k, v)]
    for dst, src in zip(x_al, (q, k, v)):
        dst[rows_al] = src[rows_in]
    out_in = nested_attention(q, k, v, inside, 0.25, attn_ref.fork_attention_segments)
    out_al = nested_attention(*x_al, alone, 0.25, attn_ref.fork_attention_segments)
    assert torch.equal(out_in[rows_in], out_al[rows_al])
    torch.testing.assert_close(out_in, nested_attention(q, k, v, inside, 0.25), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# (d) the custom ops
# ---------------------------------------------------------------------------------------------------------------------

def opcheck_args() -> tuple:
    s = lay_out_nested(TWO_REQUESTS, pad=2)
    q, k, v = qkv(s.tokens, (4, 2, 8), seed=4)
    return (q, k, v, *s.tables(torch.int32), 8 ** -0.5)


@pytest.mark.parametrize("op", [fork_attention_nested_reference, fork_attention_nested_segments],
                         ids=["reference", "segments"])
def test_opcheck_nested_ops(op):
    args = opcheck_args()
    torch.library.opcheck(op, args)
    # inputs requiring grad: the ops are inference-only (no autograd formula), as in tests/test_ops.py
    grad_args = tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                      else a for a in args)
    torch.library.opcheck(op, grad_args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch.testing.assert_close(op(*args), attn_ref.fork_attention(*args[:6], args[8], *args[6:8]), atol=1e-5,
                               rtol=1e-5)


def test_nested_companions_are_registered():
    for variant, op in (("reference", fork_attention_nested_reference), ("segments", fork_attention_nested_segments),
                        ("triton_invariant", fork_attention_nested_triton_invariant)):
        assert registry._NESTED[("fork_attention", variant)] is op
    for variant in ("flex", "triton"):  # not supported yet: the engine keeps nested forks off with them
        assert ("fork_attention", variant) not in registry._NESTED
    ops, missing = registry.nested(KernelConfig(fork_attention="segments", gated_delta="reference"))
    assert "kernels.fork_attention: segments" not in missing
    if ops is not None:
        assert ops["fork_attention"] is fork_attention_nested_segments
    _, missing = registry.nested(KernelConfig(fork_attention="triton", gated_delta="reference"), "cuda")
    assert "kernels.fork_attention: triton" in missing
    # the Triton op has CUDA kernels only (opcheck'd in tests/gpu/test_fork_attention_nested_gpu.py): its fake
    q, k, v, *tables, scale = opcheck_args()
    out = fork_attention_nested_triton_invariant(*(x.to("meta") for x in (q, k, v, *tables)), scale)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == q.dtype


# ---------------------------------------------------------------------------------------------------------------------
# (c) the batch-invariant Triton kernel, interpreted
# ---------------------------------------------------------------------------------------------------------------------

if not INTERPRETED:
    from flide.testing import run_in_triton_interpreter

    def test_in_the_triton_interpreter():
        """Runs this file's `test_kernel_*` checks in a child process with TRITON_INTERPRET=1."""
        run_in_triton_interpreter(__file__, "test_kernel_", 10)

else:
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder

    from flide.ops.fork_attention import triton_invariant as kernel

    Config = kernel.Config
    SMALL = Config(16, 16, 4, 1)  # 16 rows: 8 tokens a query block at GQA 2, 16 keys a tile

    @pytest.fixture(autouse=True)
    def dots_by_k(monkeypatch):
        monkeypatch.setattr(InterpreterBuilder, "create_dot", interpreter_dot_by_k)

    def run(q, k, v, s: NestedStream, scale: float, config=SMALL, nested: bool = True, dtype=torch.int64, **kwargs):
        seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi = s.tables(dtype)
        out = torch.full((s.tokens, q.shape[1], v.shape[2]), float("nan"))  # every element must be written
        sub = (sub_lo, sub_hi) if nested else None
        return kernel.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, scale, config=config, out=out, sub=sub,
                                     **kwargs)

    def test_kernel_is_interpreted():
        assert isinstance(kernel._fork_attention_invariant_kernel, InterpretedFunction)

    CASES = [  # seed, requests, (Hq, Hkv, D), Dv, config, shuffled
        (0, 4, (4, 2, 16), None, SMALL, False),
        (1, 5, (4, 2, 16), None, SMALL, True),
        (2, 4, (3, 1, 24), None, Config(32, 16, 4, 1), True),  # group 3, dim 24 padded to 32
        (3, 4, (4, 2, 32), 16, None, False),  # the default fp32 tiles (32 x 32), Dv != D
    ]

    @pytest.mark.parametrize("seed,requests,heads,dv,config,shuffled", CASES,
                             ids=[f"seed{c[0]}-Hq{c[2][0]}-Hkv{c[2][1]}-D{c[2][2]}" for c in CASES])
    def test_kernel_matches_reference(seed, requests, heads, dv, config, shuffled):
        rng = random.Random(seed)
        s = lay_out_nested([random_nested(rng, 16) if i % 2 == 0 else plain_request(rng) for i in range(requests)],
                    pad=rng.randint(1, 5), rng=rng if shuffled else None)
        assert s.tokens <= 128, s.tokens  # small: the interpreter is slow
        q, k, v = qkv(s.tokens, heads, seed=seed, dv=dv)
        out = run(q, k, v, s, heads[2] ** -0.5, config)
        want = nested_attention(q, k, v, s, heads[2] ** -0.5)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # NaN anywhere (an unwritten element) fails

    def test_kernel_leaf_rows_are_causal_attention_over_state_sub_trunk_and_leaf():
        s = lay_out_nested(TWO_REQUESTS, pad=5, rng=random.Random(1))
        q, k, v = qkv(s.tokens, (4, 2, 16), seed=1)
        out = run(q, k, v, s, 0.25)
        for p, spans in zip(TWO_REQUESTS, s.spans):
            for name, _, trunk, sub in p.segments():
                rows = sequence(spans, name, trunk, sub)
                n = len(spans[name])
                torch.testing.assert_close(out[rows[-n:]], causal(q, k, v, rows, 0.25)[-n:], atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_kernel_is_batch_invariant(seed):
        """The target alone vs among others at a random place (level or random order, pads): the same bits. The
        target's leaves are short, so that several share a query block (and blocks hold rows of other requests)."""
        rng = random.Random(seed + 30)
        target = NestedRequest(rng.randint(5, 20), ((rng.randint(3, 9), (2, 1, 3)), (rng.randint(1, 5), (1, 2))), (2,))
        requests, i = mixed_round(rng, target, rng.randint(2, 4))
        inside = lay_out_nested(requests, pad=rng.randint(0, 5), rng=rng if seed != 1 else None)
        alone = lay_out_nested([target], pad=seed)
        assert inside.tokens <= 160, inside.tokens  # small: the interpreter is slow
        heads = [(4, 2, 16), (2, 2, 16), (3, 1, 16)][seed]
        q, k, v = qkv(inside.tokens, heads, seed=seed)
        rows_in, rows_al = inside.rows[i], alone.rows[0]
        x_al = [randn(alone.tokens, *x.shape[1:], seed=seed + 40) for x in (q, k, v)]
        for dst, src in zip(x_al, (q, k, v)):
            dst[rows_al] = src[rows_in]
        out_in, out_al = run(q, k, v, inside, 0.25), run(*x_al, alone, 0.25)
        torch.testing.assert_close(out_in, nested_attention(q, k, v, inside, 0.25), atol=1e-5,
                                   rtol=1e-5)
        assert torch.equal(out_in[rows_in], out_al[rows_al])

    def test_kernel_rows_without_sub_keep_the_plain_kernels_bits():
        """Rows without a sub range: the same bits with the sub-trunk phase (`sub=`) as without it (the kernel
        compiled without the phase); empty sub ranges everywhere: every row; `sub=None` is the call without it."""
        rng = random.Random(5)
        s = lay_out_nested([random_nested(rng, 20), plain_request(rng), random_nested(rng, 20)], pad=4, rng=rng)
        q, k, v = qkv(s.tokens, (4, 2, 16), seed=5)
        plain = run(q, k, v, s, 0.25, nested=False)
        assert torch.equal(plain, kernel.fork_attention(q, k, v, *s.tables()[:3], 0.25, config=SMALL))
        no_sub = s.sub_hi <= s.sub_lo
        assert 0 < int(no_sub.sum()) < s.tokens
        assert torch.equal(run(q, k, v, s, 0.25)[no_sub], plain[no_sub])
        empty = NestedStream(s.seg_lo, s.trunk_lo, s.trunk_hi, s.sub_lo * 0, s.sub_hi * 0, s.rows, s.spans)
        assert torch.equal(run(q, k, v, empty, 0.25), plain)

    def test_kernel_leaf_equals_one_causal_segment():
        """A state of 32 tokens and a sub-trunk of 16 (whole key tiles of 16): a leaf's rows (and the sub-trunk's)
        have the bits of its state + sub-trunk + leaf tokens laid out as one causal segment (the tiles fall at the
        same keys, and every phase runs the same tile code)."""
        target = NestedRequest(32, ((16, (5, 1, 9)),), (3,))
        s = lay_out_nested([NestedRequest(7, ((4, (2,)),))] + [target], pad=3)
        q, k, v = qkv(s.tokens, (4, 2, 16), seed=6)
        out = run(q, k, v, s, 0.25)
        spans = s.spans[1]
        for name in ("sub0", "leaf0.0", "leaf0.1", "leaf0.2"):
            rows = sequence(spans, name, "state", None if name == "sub0" else "sub0")
            joined = lay_out_nested([NestedRequest(len(rows), ())])  # one state: a causal segment from key 0
            x = [torch.zeros(len(rows), *t.shape[1:]) for t in (q, k, v)]
            for dst, src in zip(x, (q, k, v)):
                dst[:] = src[rows]
            n = len(spans[name])
            assert torch.equal(run(*x, joined, 0.25)[-n:], out[rows[-n:]]), name

    def test_kernel_visits_the_sub_trunk_once_per_block():
        """A state of 32 tokens, a sub-trunk of 20 [32, 52), 6 leaves of 2 tokens [52, 64); GQA 4/2 in 16 rows = 8
        tokens a block, 16 keys a tile. Tokens 56..63 (4 leaves): the state's 2 tiles, the sub-trunk's 2 (shared by
        the 4 leaves), 1 own tile per leaf = 8. Tokens 48..55 (the sub-trunk's last 4 rows, 2 leaves): the state's 2
        tiles (shared), the sub-trunk's 2 for the leaves, its own segment's run from 32 to 52 for its rows (2), 1 own
        tile per leaf = 8."""
        s = lay_out_nested([NestedRequest(32, ((20, (2,) * 6),))])
        q, k, v = qkv(s.tokens, (4, 2, 16), seed=7)
        blocks = kernel.query_blocks(s.tokens, 4, 2, 16, torch.float32, SMALL)
        stats = torch.full((2 * blocks,), -1, dtype=torch.int32)
        out = run(q, k, v, s, 0.25, stats=stats)
        torch.testing.assert_close(out, nested_attention(q, k, v, s, 0.25), atol=1e-5, rtol=1e-5)
        stats = stats.view(2, blocks)
        assert torch.equal(stats[0], stats[1])
        assert stats[0, 7].item() == 2 + 2 + 4 and stats[0, 6].item() == 2 + 2 + 2 + 2

    def test_kernel_takes_int32_and_int64_tables_and_rejects_bad_ones():
        s = lay_out_nested(TWO_REQUESTS, pad=2)
        q, k, v = qkv(s.tokens, (4, 2, 16), seed=8)
        assert torch.equal(run(q, k, v, s, 0.25, dtype=torch.int32), run(q, k, v, s, 0.25))
        seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi = s.tables()
        with pytest.raises(ValueError, match="sub_lo"):
            kernel.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, 0.25, sub=(sub_lo.short(), sub_hi))
        with pytest.raises(ValueError, match="sub_hi"):
            kernel.fork_attention(q, k, v, seg_lo, trunk_lo, trunk_hi, 0.25, sub=(sub_lo, sub_hi[:-1]))
