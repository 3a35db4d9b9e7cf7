"""The batch-invariant Triton linear layer (flide/ops/linear/triton.py) on the GPU: bf16 and fp32 against F.linear in
float64, bitwise batch invariance over M from 1 to 32,768 rows at odd offsets in Qwen3.5's projection shapes
(0.8B: K = 1,024; 4B: K = 2,560, N = 9,728), rows whose pointers lose 16-byte alignment (another specialisation of
the kernel: still the same bits), an output past 2**31 elements (int64 offsets), and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

lt = pytest.importorskip("flide.ops.linear.triton", reason="needs the triton package")  # CUDA torch ships it

DTYPES = [torch.bfloat16, torch.float32]
DTYPE_IDS = ["bf16", "fp32"]
# against float64: bf16 is one rounding of the output (2**-8 relative covers it with the fp32 sums' error); fp32 sums
# of up to 2,560 products of order-one terms stay well inside 1e-4
TOLERANCE = {torch.bfloat16: {"atol": 1e-3, "rtol": 2 ** -8}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}

# (K, N): Qwen3.5-0.8B's projections (hidden 1,024: q_proj 2 x 8 x 256 = 4,096 is covered by 3,584 / 6,144 tiles;
# in_proj_qkv 6,144, o_proj / out_proj 1,024, in_proj_z 2,048, gate/up 3,584) and 4B's up projection
SHAPES = [(1024, 1024), (1024, 2048), (1024, 3584), (1024, 6144), (2560, 9728)]
ROWS = [1, 2, 7, 64, 255, 256, 1000, 4096, 32768]
T = 32768


def operands(m: int, n: int, k: int, dtype, seed: int, bias: bool = True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    return x, weight, b


def want64(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


CASES = [(1, 1024, 1024), (7, 3584, 1024), (255, 6144, 1024), (1000, 9728, 2560), (300, 100, 70), (129, 1000, 1001)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", CASES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in CASES])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_f_linear_in_float64(m, n, k, dtype, bias):
    x, weight, b = operands(m, n, k, dtype, seed=m + n + k, bias=bias)
    out = lt.linear(x, weight, b)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    want = want64(x, weight, b)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[dtype])
    # no worse than cuBLAS (F.linear in the same dtype; fp32 without tf32) by more than one output rounding
    cublas = F.linear(x, weight, b)
    err, err_cublas = (out.double() - want).abs().max().item(), (cublas.double() - want).abs().max().item()
    assert err <= 4 * err_cublas + (1e-5 if dtype == torch.float32 else 2 ** -8), (err, err_cublas)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_strided_x(dtype):
    """A column slice of a wider x (rows 1,100 elements apart: not 16-byte aligned, unvectorised loads) gives the
    bits of the contiguous x; a transposed view (x.stride() == (1, M)) gives right values (its bits are not
    promised: another operand layout may take another MMA operand path)."""
    x, weight, b = operands(500, 2048, 1024, dtype, seed=3)
    wide = torch.randn(500, 1100, device="cuda").to(dtype)
    wide[:, 40:1064] = x
    x_t = x.T.contiguous().T
    assert x_t.stride() == (1, 500) and torch.equal(x_t, x)
    want = lt.linear(x, weight, b)
    torch.testing.assert_close(want.double(), want64(x, weight, b), **TOLERANCE[dtype])
    assert torch.equal(lt.linear(wide[:, 40:1064], weight, b), want)
    torch.testing.assert_close(lt.linear(x_t, weight, b).double(), want64(x, weight, b), **TOLERANCE[dtype])


def offsets(m: int) -> list[int]:
    """Where the M rows start inside the T-row batch: at 0, at odd offsets (mid-tile), and at the end."""
    return sorted({o for o in (0, 1, 3, 131, 1001, T - m) if 0 <= o <= T - m})


@pytest.mark.parametrize("k,n", SHAPES, ids=[f"K{k}-N{n}" for k, n in SHAPES])
def test_bf16_rows_are_batch_invariant(k, n):
    """Every slice x[o:o + M] gives bitwise the rows the whole 32,768-row batch gives there."""
    x, weight, b = operands(T, n, k, torch.bfloat16, seed=k + n, bias=n % 2048 == 0)
    full = lt.linear(x, weight, b)
    for m in ROWS:
        for o in offsets(m):
            part = lt.linear(x[o:o + m], weight, b)
            assert torch.equal(part, full[o:o + m]), (m, o)
            if m <= 256:  # a copy of the rows in a fresh allocation
                assert torch.equal(lt.linear(x[o:o + m].clone(), weight, b), full[o:o + m]), (m, o)


def test_fp32_rows_are_batch_invariant():
    k, n = 1024, 2048
    x, weight, b = operands(8192, n, k, torch.float32, seed=5)
    full = lt.linear(x, weight, b)
    for m in (1, 2, 7, 64, 255, 256, 1000, 4096, 8192):
        for o in sorted({0, 3, 131, 8192 - m}):
            if o + m <= 8192:
                assert torch.equal(lt.linear(x[o:o + m], weight, b), full[o:o + m]), (m, o)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unaligned_rows_are_batch_invariant(dtype):
    """K = 1,001: a slice starting at row o is 16-byte aligned only for some o, and Triton compiles another
    specialisation (unvectorised loads) for the others. The bits must not change with it."""
    x, weight, b = operands(3000, 1000, 1001, dtype, seed=9)
    full = lt.linear(x, weight, b)
    torch.testing.assert_close(full.double(), want64(x, weight, b), **TOLERANCE[dtype])
    for m in (1, 2, 7, 255, 1000):
        for o in (1, 2, 3, 5, 8, 13, 3000 - m):
            assert torch.equal(lt.linear(x[o:o + m], weight, b), full[o:o + m]), (m, o)


def test_output_past_int32_offsets():
    """32,768 x 70,000 outputs (2.3e9 elements): the last rows lie past 2**31 elements and must be right."""
    m, n, k = 32768, 70000, 1024
    x, weight, b = operands(m, n, k, torch.bfloat16, seed=11)
    out = lt.linear(x, weight, b)
    assert out.numel() > 2 ** 31
    tail = out[-40:]
    torch.testing.assert_close(tail.double(), want64(x[-40:], weight, b), **TOLERANCE[torch.bfloat16])
    assert torch.equal(lt.linear(x[-40:], weight, b), tail)
    assert torch.equal(lt.linear(x[:3], weight, b), out[:3])


def test_replays_in_a_cuda_graph():
    """Captured once on a static 4,096-row input, replayed with other values: bitwise the eager result."""
    k, n = 1024, 3584
    x, weight, b = operands(4096, n, k, torch.bfloat16, seed=13)
    static = x.clone()
    for _ in range(2):  # warm up: compile outside the capture
        lt.linear(static, weight, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lt.linear(static, weight, b)
    for seed in (14, 15, 16):
        x2, _, _ = operands(4096, n, k, torch.bfloat16, seed=seed)
        static.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        eager = lt.linear(x2, weight, b)
        assert torch.equal(out, eager)
        torch.testing.assert_close(out.double(), want64(x2, weight, b), **TOLERANCE[torch.bfloat16])


# ---- the persistent TMA form (Config.tma; the 16-bit default), with and without warp specialisation, and its
# 128 x 128 tiles with 4 stages (the sweep's runner-up) ----
TMA_CONFIGS = [lt.tma_config(torch.bfloat16), lt.tma_config(torch.bfloat16, warp_specialize=True),
               lt.Config(128, 128, 64, 8, 8, 4, tma=True)]
TMA_IDS = ["tma", "tma-ws", "tma-128x128"]


@pytest.mark.parametrize("config", TMA_CONFIGS, ids=TMA_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 1024, 1024), (255, 6144, 1024), (1000, 9728, 2560), (300, 104, 72)],
                         ids=["M1", "M255", "M1000", "M300-N104-K72"])
def test_tma_form_matches_f_linear(config, m, n, k):
    x, weight, b = operands(m, n, k, torch.bfloat16, seed=m + n, bias=True)
    assert lt._tma_eligible(x, weight, n)
    out = lt.linear(x, weight, b, config=config)
    torch.testing.assert_close(out.double(), want64(x, weight, b), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("config", TMA_CONFIGS, ids=TMA_IDS)
@pytest.mark.parametrize("k,n", [(1024, 3584), (2560, 9728)], ids=["K1024-N3584", "K2560-N9728"])
def test_tma_form_rows_are_batch_invariant(config, k, n):
    x, weight, b = operands(T, n, k, torch.bfloat16, seed=k + n + 1)
    full = lt.linear(x, weight, b, config=config)
    for m in ROWS:
        for o in offsets(m):
            assert torch.equal(lt.linear(x[o:o + m], weight, b, config=config), full[o:o + m]), (m, o)


@pytest.mark.parametrize("config", TMA_CONFIGS, ids=TMA_IDS)
def test_tma_form_replays_in_a_cuda_graph(config):
    """The descriptors are kernel parameters built at launch: captured once, replayed with new values."""
    k, n = 1024, 3584
    x, weight, b = operands(4096, n, k, torch.bfloat16, seed=17)
    static = x.clone()
    for _ in range(2):
        lt.linear(static, weight, b, config=config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lt.linear(static, weight, b, config=config)
    x2, _, _ = operands(4096, n, k, torch.bfloat16, seed=18)
    static.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lt.linear(x2, weight, b, config=config))
