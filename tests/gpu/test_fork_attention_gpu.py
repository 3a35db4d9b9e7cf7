"""GPU variants of fork attention against the reference: odd stream lengths, many segments, GQA, head dims 128 and
256, bf16 and fp32; and replay inside a CUDA graph with other round compositions."""

from __future__ import annotations

import random

import pytest
import torch

from flide.ops.registry import resolve
from flide.testing import random_round_tensors

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative RMS error bound against the fp32 reference


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def inputs(tokens: int, hq: int, hkv: int, d: int, dtype, seed: int):
    rng = random.Random(seed)
    r = random_round_tensors(rng, tokens, max_requests=8, max_questions=12).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(8, 2, 256), (16, 4, 256), (8, 8, 128), (14, 2, 128)],
                         ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}-D{h[2]}")
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 500, 3600])
def test_flex_matches_reference(tokens, heads, dtype):
    hq, hkv, d = heads
    q, k, v, r = inputs(tokens, hq, hkv, d, dtype, seed=tokens + hq)
    scale = d ** -0.5
    ref = resolve("fork_attention", "reference")(q.float(), k.float(), v.float(), r.seg_lo, r.trunk_lo, r.trunk_hi,
                                                 scale)
    out = resolve("fork_attention", "flex")(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


def graph_replays(op, dtype, tokens: int = 2048, hq: int = 8, hkv: int = 2, d: int = 256):
    """Captures `op` once in a CUDA graph on one round, then for three other round compositions written into the same
    buffers yields (q, k, v, round, the replay's output, the eager output)."""
    q, k, v, r = inputs(tokens, hq, hkv, d, dtype, seed=1)
    static = [x.clone() for x in (q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi)]
    for _ in range(2):  # warm up: compile and autotune outside the capture
        op(*static, d ** -0.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*static, d ** -0.5)
    for seed in (2, 3, 4):
        q2, k2, v2, r2 = inputs(tokens, hq, hkv, d, dtype, seed=seed)
        for buffer, value in zip(static, (q2, k2, v2, r2.seg_lo, r2.trunk_lo, r2.trunk_hi)):
            buffer.copy_(value)
        graph.replay()
        yield q2, k2, v2, r2, out, op(q2, k2, v2, r2.seg_lo, r2.trunk_lo, r2.trunk_hi, d ** -0.5)


def test_flex_replays_in_a_cuda_graph_with_other_rounds():
    for *_, out, eager in graph_replays(resolve("fork_attention", "flex"), torch.bfloat16):
        assert torch.equal(out, eager)
