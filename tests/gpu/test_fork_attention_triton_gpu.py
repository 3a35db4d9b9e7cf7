"""The `triton` variant of fork attention (flide::fork_attention_triton) against the reference on the GPU: the same
cases as test_fork_attention_gpu.py (odd stream lengths, many segments, GQA 8/2, 16/4, 8/8, 14/2, head dims 128 and
256, bf16 and fp32), every output element written, the key-block plan on the benchmark's long-state stream, opcheck
with CUDA tensors, and replay inside a CUDA graph with other round compositions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flide.ops.registry import resolve
from flide.round import Shape, build_round
from flide.testing import synthetic_request

from .test_fork_attention_gpu import TOL, graph_replays, inputs, rel_err

HEADS = [(8, 2, 256), (16, 4, 256), (8, 8, 128), (14, 2, 128)]
HEAD_IDS = [f"Hq{h[0]}-Hkv{h[1]}-D{h[2]}" for h in HEADS]


def triton_op():
    return resolve("fork_attention", "triton")


def reference(q, k, v, r, scale):
    return resolve("fork_attention", "reference")(q.float(), k.float(), v.float(), r.seg_lo, r.trunk_lo, r.trunk_hi,
                                                  scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 500, 3600])
def test_triton_matches_reference(tokens, heads, dtype):
    hq, hkv, d = heads
    q, k, v, r = inputs(tokens, hq, hkv, d, dtype, seed=tokens + hq)
    scale = d ** -0.5
    ref = reference(q, k, v, r, scale)
    out = triton_op()(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    # row by row as well: a few wrong rows would hide in the relative RMS over thousands
    row_err = (out.float() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))
    assert row_err.max().item() < 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_every_output_element_is_written(heads, dtype):
    from flide.ops.fork_attention import triton as kernel

    hq, hkv, d = heads
    tokens = 777
    q, k, v, r = inputs(tokens, hq, hkv, d, dtype, seed=11)
    out = torch.full((tokens, hq, d), float("nan"), dtype=dtype, device="cuda")
    kernel.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5, out=out)
    assert torch.isfinite(out).all()
    assert torch.equal(out, triton_op()(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5))


def long_state_stream(state: int = 2000, questions: int = 64, question: int = 40):
    """The benchmark's first stream: one state, then its questions (padded to a multiple of 128)."""
    prep = synthetic_request(np.ones(state), [np.ones(question)] * questions)
    tokens = -(-(state + questions * question) // 128) * 128
    return build_round([prep], Shape(tokens=tokens, states=1, branches=questions, readout_rows=questions, options=2),
                       0).tensors.to("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_state_plan_and_values(dtype):
    """2,000-token state + 64 questions of 40 (8/2 heads, dim 256): equal to the reference, and the kernel visits
    mostly unmasked key blocks (each question block sees the whole state unmasked but its last block)."""
    from flide.ops.fork_attention import triton as kernel

    r = long_state_stream()
    tokens, hq, hkv, d = r.seg_lo.shape[0], 8, 2, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
    blocks = kernel.query_blocks(tokens, hq, hkv, d, dtype)
    stats = torch.zeros(hkv * blocks, 2, dtype=torch.int32, device="cuda")
    out = kernel.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5, stats=stats)
    assert rel_err(out, reference(q, k, v, r, d ** -0.5)) < TOL[dtype]
    masked, full = stats.sum(0).tolist()
    assert full / (masked + full) > 0.75, (masked, full)
    assert torch.equal(out, kernel.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5))


def test_opcheck_on_cuda():
    q, k, v, r = inputs(300, 8, 2, 128, torch.bfloat16, seed=3)
    torch.library.opcheck(triton_op(), (q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 128 ** -0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_replays_in_a_cuda_graph_with_other_rounds(dtype):
    for q2, k2, v2, r2, out, eager in graph_replays(triton_op(), dtype):
        assert torch.equal(out, eager)
        assert rel_err(out, reference(q2, k2, v2, r2, 256 ** -0.5)) < TOL[dtype]
