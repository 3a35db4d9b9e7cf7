"""The block tables of the FlexAttention variant (built from round metadata, without host syncs) classify every
128 x 128 block exactly as the dense visibility mask does: skipped, partial (masked) or full (unmasked)."""

from __future__ import annotations

import random

import pytest
import torch

from flide.ops.fork_attention.flex import BLOCK, block_tables
from flide.ops.fork_attention.reference import visible
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
