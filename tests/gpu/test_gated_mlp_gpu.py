"""The gated MLP's fused gate/up GEMM + SiLU-mul (flide/ops/gated_mlp/triton.py) on the GPU: bf16 and fp32 against
float64 at Qwen3.5's MLP shapes (0.8B: H 1,024, I 3,584; 4B: H 2,560, I 9,216) and odd ones, the epilogue's
roundings bit for bit against eager PyTorch's over the same GEMM's gate / up (the linear kernel's, whose sums it
shares), bitwise batch invariance over M, CUDA-graph replay, and a whole tiny model against the pipeline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

gt = pytest.importorskip("flide.ops.gated_mlp.triton", reason="needs the triton package")  # CUDA torch ships it

from flide.ops.gated_mlp import reference  # noqa: E402
from flide.ops.linear import triton as lt  # noqa: E402
from flide.testing import assert_mostly_same_bits, engine_against_pipeline  # noqa: E402

TOLERANCE = {torch.bfloat16: {"atol": 2e-3, "rtol": 2 ** -7}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}
CASES = [(1, 3584, 1024), (7, 3584, 1024), (1000, 3584, 1024), (8192, 3584, 1024), (300, 9216, 2560), (129, 100, 70)]


def operands(m: int, inter: int, k: int, dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(2 * inter, k, device="cuda", generator=g) * 2 * k ** -0.5).to(dtype)
    return x, weight


def want64(x, weight):
    gate, up = (x.double() @ weight.double().T).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,inter,k", CASES, ids=[f"M{m}-I{i}-K{k}" for m, i, k in CASES])
def test_matches_float64_and_the_reference(m, inter, k, dtype):
    x, weight = operands(m, inter, k, dtype, seed=m + inter + k)
    out = gt.gated_mlp(x, weight)
    assert out.shape == (m, inter) and out.dtype == dtype and out.is_contiguous()
    want = want64(x, weight)
    # no further from float64 than the reference (cuBLAS + eager's act and product) by more than an output rounding
    ref = reference.gated_mlp(x, weight)
    err, err_ref = (out.double() - want).abs().max().item(), (ref.double() - want).abs().max().item()
    # (fp32: cuBLAS may split K at small M, which sums more accurately than one K walk: H100, 3e-5 vs 5e-6 at K 1,024)
    assert err <= 2 * err_ref + (1e-4 if dtype == torch.float32 else 2 ** -7), (err, err_ref)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("m,inter,k", [(1000, 3584, 1024), (300, 9216, 2560)], ids=["0.8B", "4B"])
def test_epilogue_rounds_as_eager_over_the_same_gemm(m, inter, k):
    """silu(gate) * up with eager's roundings, over gate / up from the linear kernel (the same K order and BLOCK_K):
    the bits of eager's F.silu(gate) * up nearly everywhere (a GEMM element may differ where the two kernels' MMA
    tiles order a k-step's products differently). Skipping a rounding of the act would change ~1/3 of them."""
    x, weight = operands(m, inter, k, torch.bfloat16, seed=5)
    gate, up = lt.linear(x, weight, None).chunk(2, dim=-1)
    eager = F.silu(gate) * up
    assert_mostly_same_bits(gt.gated_mlp(x, weight, exact_silu=True), eager, atol=2e-3, rtol=2 ** -7,
                            min_equal=0.999)
    # Inductor's formula, x * sigmoid(x): one rounding of the act off eager's in places, as the torch variant's
    assert_mostly_same_bits(gt.gated_mlp(x, weight, exact_silu=False), eager, atol=2e-3, rtol=2 ** -7,
                            min_equal=0.98)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rows_keep_their_bits_whatever_the_batch(dtype):
    x, weight = operands(8192, 3584, 1024, dtype, seed=3)
    whole = gt.gated_mlp(x, weight)
    for lo, hi in [(0, 1), (5, 12), (1000, 2255), (8191, 8192)]:
        assert torch.equal(gt.gated_mlp(x[lo:hi].clone(), weight), whole[lo:hi]), (lo, hi)


def test_replays_in_a_cuda_graph():
    x, weight = operands(512, 3584, 1024, torch.bfloat16, seed=4)
    static_x = x.clone()
    gt.gated_mlp(static_x, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gt.gated_mlp(static_x, weight)
    x2, _ = operands(512, 3584, 1024, torch.bfloat16, seed=6)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gt.gated_mlp(x2, weight))


def test_triton_gated_mlp_in_a_whole_model_equals_pipeline_and_the_torch_variant():
    vs_pipeline, vs_torch = engine_against_pipeline({"gated_mlp": "triton"}, {"gated_mlp": "torch"}, seed=12)
    assert vs_pipeline < 2e-3 and vs_torch < 1e-4
