"""The block tables of the FlexAttention variant (built from round metadata, without host syncs) classify every
128 x 128 block exactly as the dense visibility mask does: skipped, partial (masked) or full (unmasked). The stream
length classes bound its compiles, and the whole variant (compiled through Inductor's CPU flex template) equals the
reference on a stream it pads."""

from __future__ import annotations

import random

import pytest
import torch

from flide.ops.fork_attention import flex
from flide.ops.fork_attention.flex import BLOCK, block_tables, size_class
from flide.ops.fork_attention.reference import fork_attention, visible
from flide.testing import random_round_tensors


@pytest.mark.parametrize("tokens", [128, 512, 1024, 2048])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_tables_match_the_dense_mask(tokens, seed):
    r = random_round_tensors(random.Random(seed * 100 + tokens), tokens, max_requests=8, max_questions=10,
                             max_state=300, max_question=70)
    partial_count, partial_idx, full_count, full_idx = block_tables(r.seg_lo, r.trunk_lo, r.trunk_hi)
    nb = tokens // BLOCK
    rows = torch.arange(tokens)
    dense = visible(r.seg_lo, r.trunk_lo, r.trunk_hi, rows, rows).view(nb, BLOCK, nb, BLOCK)
    seen_any, seen_all = dense.any(3).any(1), dense.all(3).all(1)
    for qb in range(nb):
        full = set(full_idx[0, 0, qb, : full_count[0, 0, qb]].tolist())
        partial = set(partial_idx[0, 0, qb, : partial_count[0, 0, qb]].tolist())
        assert full == set(torch.nonzero(seen_all[qb]).flatten().tolist())
        assert partial == set(torch.nonzero(seen_any[qb] & ~seen_all[qb]).flatten().tolist())
        assert not full & partial


def test_size_classes_bound_the_compiles():
    lengths = range(1, 70_000)
    classes = {size_class(t) for t in lengths}
    assert len(classes) <= 36  # four per octave: one compile each, whatever lengths eager rounds bring
    for t in lengths:
        c = size_class(t)
        assert c >= t and c % BLOCK == 0 and c - t < max(BLOCK, c / 4)
    assert all(size_class(b) == b for b in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768))  # the buckets


def test_flex_equals_the_reference_on_a_padded_stream():
    """~30 s: one Inductor compile of FlexAttention on the CPU (the variant is registered for CUDA, where its GPU tests
    run; here it runs the same function)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    r = random_round_tensors(random.Random(7), 300, max_requests=3, max_questions=4, max_state=120, max_question=30)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(300, h, 32, generator=gen) for h in (4, 2, 2))
    assert size_class(300) == 384  # 84 pad rows
    got = flex.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 32 ** -0.5)
    want = fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 32 ** -0.5)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
