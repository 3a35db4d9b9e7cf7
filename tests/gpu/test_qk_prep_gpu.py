"""`kernels.fuse_attention_prep` on the GPU: the q / k preparation kernel against its reference (transformers'
Qwen3_5RMSNorm + apply_rotary_pos_emb, eager CUDA) in fp32 and bf16 at Qwen3.5's attention shapes, and a whole tiny
Qwen3.5 with graphs against transformers' pipeline and against the model's own modules."""

from __future__ import annotations

import pytest
import torch

from flide.ops.qk_prep import qk_prep_triton, reference
from flide.testing import assert_mostly_same_bits, engine_against_pipeline


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,H,HKV,D,R", [(448, 8, 2, 256, 64), (8192, 8, 2, 256, 64), (1000, 16, 4, 256, 64),
                                         (37, 4, 2, 32, 8)], ids=["race-0.8b", "quality-0.8b", "9b", "tiny"])
def test_qk_prep_matches_reference(T, H, HKV, D, R, dtype):
    gen = torch.Generator(device="cuda").manual_seed(T + H)
    # as the layer holds them: q interleaved with the output gate per head, k a column slice of the projection
    projection = torch.randn(T, H * 2 * D + 2 * HKV * D, device="cuda", generator=gen).to(dtype)
    q = projection[:, :H * 2 * D].view(T, H, 2 * D)[..., :D]
    k = projection[:, H * 2 * D:H * 2 * D + HKV * D].view(T, HKV, D)
    freqs = torch.randn(T, R // 2, device="cuda", generator=gen) * 3
    cos, sin = (f(torch.cat([freqs, freqs], -1)).to(dtype) for f in (torch.cos, torch.sin))
    wq = (torch.randn(D, device="cuda", generator=gen) * 0.3).to(dtype)
    wk = (torch.randn(D, device="cuda", generator=gen) * 0.3).to(dtype)
    got = qk_prep_triton(q, k, cos, sin, wq, wk, 1e-6)
    want = reference.qk_prep(q, k, cos, sin, wq, wk, 1e-6)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.is_contiguous() and g.shape == w.shape
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        else:  # the norm's sum runs in another order than eager's: a rounding may land on the next bf16 value
            assert_mostly_same_bits(g, w, atol=3e-2, rtol=2e-2)


def test_qk_prep_opcheck():
    q, k = torch.randn(40, 4, 32, device="cuda"), torch.randn(40, 2, 32, device="cuda")
    cos, sin = torch.randn(40, 8, device="cuda"), torch.randn(40, 8, device="cuda")
    w = torch.randn(32, device="cuda")
    torch.library.opcheck(qk_prep_triton, (q, k, cos, sin, w, w, 1e-6))


def test_fused_attention_prep_in_a_whole_model_equals_pipeline_and_the_modules():
    vs_pipeline, vs_modules = engine_against_pipeline({"fuse_attention_prep": True}, {"fuse_attention_prep": False},
                                                      seed=13)
    assert vs_pipeline < 2e-3 and vs_modules < 1e-5
