"""`kernels.gated_norm: triton` on the GPU: the kernel against its reference (the fork's select + transformers'
gated RMS norm, eager CUDA) in fp32 and bf16, rows no call wrote never read, a row's bits the same in any stream,
and a whole tiny Qwen3.5 with graphs against transformers' pipeline and against the `torch` variant."""

from __future__ import annotations

import pytest
import torch

from flide.ops.gated_norm import reference
from flide.ops.gated_norm import triton as kernel
from flide.testing import assert_mostly_same_bits, engine_against_pipeline


def inputs(T, H, V, dtype, spans, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    states_end, branches_start, branches_end = spans
    x_states = torch.full((T, H, V), float("nan"), dtype=dtype, device="cuda")
    x_branches = torch.full((T, H, V), float("nan"), dtype=dtype, device="cuda")
    x_states[:states_end] = torch.randn(states_end, H, V, generator=gen, device="cuda").to(dtype)
    x_branches[branches_start:branches_end] = torch.randn(branches_end - branches_start, H, V, generator=gen,
                                                          device="cuda").to(dtype)
    # the gate as the GDN layer holds it: a column slice of the fused input projection's output
    wide = torch.randn(T, 3 * H * V + 32, generator=gen, device="cuda").to(dtype)
    gate = wide[:, 2 * H * V:3 * H * V].view(T, H, V)
    weight = (1 + 0.3 * torch.randn(V, generator=gen, device="cuda")).to(dtype)
    ends = [torch.tensor([n], dtype=torch.int32, device="cuda") for n in spans]
    return x_states, x_branches, gate, weight, ends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,H,V,spans", [(448, 16, 128, (300, 300, 437)), (8192, 16, 128, (6113, 6113, 8045)),
                                         (1000, 32, 128, (500, 520, 990)), (37, 4, 16, (10, 10, 37))],
                         ids=["race-0.8b", "quality-0.8b", "9b-gap", "tiny"])
def test_gated_norm_matches_reference(T, H, V, spans, dtype):
    x_states, x_branches, gate, weight, ends = inputs(T, H, V, dtype, spans)
    got = kernel.gated_norm(x_states, x_branches, gate, weight, *ends, 1e-6)
    want = reference.gated_norm(x_states, x_branches, gate, weight, *ends, 1e-6)
    assert not got.isnan().any()
    covered = torch.zeros(T, dtype=torch.bool, device="cuda")
    covered[:spans[0]] = True
    covered[spans[1]:spans[2]] = True
    assert not got[~covered].any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # rsqrt / exp may differ from eager CUDA's by a float32 ulp, which rounds to the other bf16 value rarely
        assert_mostly_same_bits(got, want, atol=1e-2, rtol=1e-2)


def test_gated_norm_rows_keep_their_bits_in_any_stream():
    x_states, x_branches, gate, weight, ends = inputs(300, 16, 128, torch.bfloat16, (200, 200, 290))
    alone = kernel.gated_norm(x_states, x_branches, gate, weight, *ends, 1e-6)
    pad = 77
    grown = [torch.cat([torch.randn(pad, 16, 128, device="cuda").to(torch.bfloat16), x,
                        torch.randn(500, 16, 128, device="cuda").to(torch.bfloat16)]) for x in (x_states, x_branches)]
    wide_gate = torch.cat([torch.randn(pad, 16, 128, device="cuda").to(torch.bfloat16), gate,
                           torch.randn(500, 16, 128, device="cuda").to(torch.bfloat16)])
    grown_ends = [torch.tensor([n], dtype=torch.int64, device="cuda") for n in (pad + 200, pad + 200, pad + 290)]
    inside = kernel.gated_norm(*grown, wide_gate, weight, *grown_ends, 1e-6)
    assert torch.equal(inside[pad:pad + 300], alone)


def test_triton_gated_norm_in_a_whole_model_equals_pipeline_and_the_torch_variant():
    vs_pipeline, vs_torch = engine_against_pipeline({"gated_norm": "triton"}, {"gated_norm": "torch"}, seed=11)
    assert vs_pipeline < 2e-3 and vs_torch < 1e-5
