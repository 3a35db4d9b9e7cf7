"""The `triton` variant of fork_conv (flide::fork_conv_triton) against the reference on the GPU: odd stream lengths,
many segments, Qwen3.5's conv width (6144 channels on 9B), fp32 and bf16, every output element written, opcheck of
the custom op with CUDA tensors, and replay inside a CUDA graph with other round compositions."""

from __future__ import annotations

import random

import pytest
import torch

from flide.ops.fork_conv import reference
from flide.ops.registry import resolve
from flide.testing import random_round_tensors


def inputs(tokens: int, channels: int, dtype, seed: int, width: int = 4):
    rng = random.Random(seed)
    # many segments: up to 40 requests of states up to 300 tokens and up to 12 questions each
    r = random_round_tensors(rng, tokens, max_requests=40, max_questions=12, max_state=300, max_question=60).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, channels, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(channels, width, device="cuda", generator=g) * 0.5).to(dtype)
    return x, weight, r


def triton_op():
    return resolve("fork_conv", "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels", [64, 6144])
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 500, 3600])
def test_triton_matches_reference(tokens, channels, dtype):
    x, weight, r = inputs(tokens, channels, dtype, seed=tokens + channels)
    # the reference in fp32 (the kernel sums in fp32 whatever the dtype): equal up to one rounding of the output
    want = reference.fork_conv(x.float(), weight.float(), r.seg_lo, r.trunk_lo, r.trunk_hi, True)
    out = triton_op()(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        # two roundings (the sum before the SiLU, as transformers rounds it, then the output): within ~2 half-ulps
        torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=2 ** -6)
        # and the same bits as the reference in bf16, which rounds at the same two points (H200, 2026-11-30: equal on
        # all 16.8M elements of a 2,048 x 8,192 stream, benchmarks/ops/conv_rounding_check.py)
        assert torch.equal(out, reference.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True))
    # no SiLU, fp32 weights with bf16 inputs
    want = reference.fork_conv(x.float(), weight.float(), r.seg_lo, r.trunk_lo, r.trunk_hi, False)
    out = triton_op()(x, weight.float(), r.seg_lo, r.trunk_lo, r.trunk_hi, False)
    torch.testing.assert_close(out.float(), want, atol=1e-5 if dtype == torch.float32 else 1e-3,
                               rtol=1e-5 if dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("tokens", [1, 65, 3600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_output_element_is_written(tokens, dtype):
    from flide.ops.fork_conv import triton as kernel

    x, weight, r = inputs(tokens, 6144, dtype, seed=5)
    out = torch.full_like(x, float("nan"))
    kernel.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True, out=out)
    assert torch.isfinite(out).all()
    assert torch.equal(out, triton_op()(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True))


def test_opcheck_on_cuda():
    from flide.ops.fork_conv import fork_conv_qkv_triton

    x, weight, r = inputs(200, 96, torch.bfloat16, seed=3)
    torch.library.opcheck(triton_op(), (x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True))
    a, b = x[:, :3].clone(), x[:, 3:6]  # the gates' inputs: a contiguous, b a column slice
    gates = (a, b, torch.randn(3, device="cuda"), torch.randn(3, device="cuda").to(torch.bfloat16))
    torch.library.opcheck(fork_conv_qkv_triton, (x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, *gates, 1, 32, True))


def test_replays_in_a_cuda_graph_with_other_rounds():
    tokens, channels = 2048, 6144
    op = triton_op()
    x, weight, r = inputs(tokens, channels, torch.bfloat16, seed=1)
    static = [x.clone(), r.seg_lo.clone(), r.trunk_lo.clone(), r.trunk_hi.clone()]
    for _ in range(2):  # warm up: compile outside the capture
        op(static[0], weight, *static[1:], True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(static[0], weight, *static[1:], True)
    for seed in (2, 3, 4):  # other compositions, written into the same buffers
        x2, _, r2 = inputs(tokens, channels, torch.bfloat16, seed=seed)
        for buffer, value in zip(static, (x2, r2.seg_lo, r2.trunk_lo, r2.trunk_hi)):
            buffer.copy_(value)
        graph.replay()
        eager = op(x2, weight, r2.seg_lo, r2.trunk_lo, r2.trunk_hi, True)
        assert torch.equal(out, eager)
        want = reference.fork_conv(x2.float(), weight.float(), r2.seg_lo, r2.trunk_lo, r2.trunk_hi, True)
        torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_window_rows_equal_the_fresh_stream(dtype):
    """Checkpoint windows: states resumed at m (their first m rows cut out, the W-1 inputs before m as windows)
    among states without: equal to the reference's `fork_conv_window`, and every kept row torch.equal to the fresh
    stream's."""
    from flide.testing import resume_states

    x, weight, r = inputs(3000, 6144, dtype, seed=12)
    starts, lens = r.state_start.cpu(), r.state_len.cpu()
    cuts = [(int(starts[s]), 64) for s in range(len(lens)) if int(lens[s]) > 100][:5]
    assert len(cuts) >= 3
    fresh = triton_op()(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True)
    kept, seg_lo, trunk_lo, trunk_hi, checkpoint = resume_states(r.seg_lo.cpu(), r.trunk_lo.cpu(), r.trunk_hi.cpu(),
                                                                 cuts)
    windows = torch.stack([x[a + m - 3: a + m] for a, m in cuts])
    kept, meta = kept.cuda(), [t.cuda() for t in (seg_lo, trunk_lo, trunk_hi, checkpoint)]
    from flide.ops.fork_conv import fork_conv_window_triton  # the triton variant's resumable companion

    got = fork_conv_window_triton(x[kept], weight, *meta[:3], windows, meta[3], True)
    want = reference.fork_conv_window(x[kept].float(), weight.float(), *meta[:3], windows.float(), meta[3], True)
    torch.testing.assert_close(got.float(), want, atol=1e-5 if dtype == torch.float32 else 2e-2,
                               rtol=1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(got, fresh[kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("key_heads,value_heads,dim", [(16, 16, 128), (16, 32, 128), (2, 4, 16)],
                         ids=["0.8b", "9b", "tiny"])
@pytest.mark.parametrize("tokens", [1, 65, 3600])
def test_conv_qkv_matches_reference_and_lays_out_what_prepare_qkv_did(tokens, key_heads, value_heads, dim, dtype):
    """The fused layout (`fork_conv_qkv_triton`, what the GDN layer runs with fla): v has the plain Triton conv's
    bits, q / k unnormalised too; normalised q / k equal the reference's within one rounding and, in bf16, the bits
    of the path it replaces (plain conv, then the state call's `prepare_qkv`) on nearly every element."""
    from flide.ops.fork_conv import fork_conv_qkv_triton
    from flide.ops.gated_delta.l2norm import prepare_qkv

    D = (2 * key_heads + value_heads) * dim
    x, weight, r = inputs(tokens, D + 32 + 2 * value_heads, dtype, seed=tokens + D)
    # column slices, as the layer's fused projection holds them: the conv's input, then a and b
    x, weight, proj = x[:, 16:16 + D], weight[:D], x[:, 16 + D:] * 4
    a, b = proj[:, :value_heads], proj[:, value_heads:2 * value_heads]
    gen = torch.Generator(device="cuda").manual_seed(5)
    a_log = torch.randn(value_heads, device="cuda", generator=gen).to(dtype)
    dt_bias = (torch.randn(value_heads, device="cuda", generator=gen) * 3).to(dtype)
    meta = (r.seg_lo, r.trunk_lo, r.trunk_hi)
    q, k, v, g, beta = fork_conv_qkv_triton(x, weight, *meta, a, b, a_log, dt_bias, key_heads, dim, True)
    want = reference.fork_conv_qkv(x.float(), weight.float(), *meta, key_heads, dim, True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got, ref in zip((q, k, v), want):
        assert got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got.float(), ref, **tol)
    # the gates as the layer computed them in torch before (what Inductor fused): eager CUDA's exp / log1p are
    # libdevice's too, so the bits agree on nearly every element
    want_g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    want_beta = b.sigmoid()
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, want_g, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(beta.float(), want_beta.float(), atol=1e-2, rtol=1e-2)
    assert (g == want_g).float().mean() > 0.99 and (beta == want_beta).float().mean() > 0.99
    plain = triton_op()(x, weight, *meta, True)
    kc = key_heads * dim
    assert torch.equal(v.reshape(tokens, -1), plain[:, 2 * kc:])
    q0, k0 = fork_conv_qkv_triton(x, weight, *meta, a, b, a_log, dt_bias, key_heads, dim, False)[:2]
    assert torch.equal(torch.cat([q0, k0], 1).reshape(tokens, -1), plain[:, :2 * kc])
    before = prepare_qkv(plain[:, :kc].view(tokens, key_heads, dim), plain[:, kc:2 * kc].view(tokens, key_heads, dim),
                         plain[:, 2 * kc:].view(tokens, value_heads, dim), True)
    if dtype == torch.float32 and dim < 128:
        # a head narrower than the conv's 128-channel tile is summed in another order than prepare_qkv's [16, D]
        # tile sums it, and fp32 output shows every last-bit difference (82-84 % equal bits on the H200): within
        # rounding there; Qwen3.5's 128-wide heads (and bf16 output) get the bits check
        torch.testing.assert_close(torch.cat([q, k]), torch.cat(before[:2]), atol=1e-6, rtol=1e-6)
        return
    equal = (torch.cat([q, k]) == torch.cat(before[:2])).float().mean().item()
    assert equal > 0.99, f"only {equal:.4f} of q / k's elements have prepare_qkv's bits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [65, 3600])
def test_grid_orders_keep_the_bits(monkeypatch, tokens, dtype):
    """`CHANNELS_FASTEST` (flide/ops/fork_conv/triton.py) reorders programs only: the plain and the laid-out launch
    (0.8B's heads, with the gates) have the same bits with channel tiles or token tiles first."""
    from flide.ops.fork_conv import fork_conv_qkv_triton
    from flide.ops.fork_conv import triton as kernel

    key_heads, value_heads, dim = 16, 16, 128
    D = (2 * key_heads + value_heads) * dim
    x, weight, r = inputs(tokens, D + 2 * value_heads, dtype, seed=tokens + 7)
    x, weight, proj = x[:, :D], weight[:D], x[:, D:] * 4
    a, b = proj[:, :value_heads], proj[:, value_heads:]
    a_log, dt_bias = weight[:value_heads, 0].contiguous(), weight[value_heads:2 * value_heads, 1].contiguous() * 3
    meta = (r.seg_lo, r.trunk_lo, r.trunk_hi)

    def both():
        return (triton_op()(x, weight, *meta, True),
                *fork_conv_qkv_triton(x, weight, *meta, a, b, a_log, dt_bias, key_heads, dim, True))

    outputs = []
    for channels_fastest in (False, True):
        monkeypatch.setattr(kernel, "CHANNELS_FASTEST", channels_fastest)
        outputs.append(both())
    assert all(torch.equal(got, want) for got, want in zip(*outputs))
