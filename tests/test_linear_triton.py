"""The batch-invariant Triton linear layer (flide/ops/linear/triton.py) on the CPU, through Triton's interpreter:
against `F.linear` in float64 (with and without bias; M of 0, 1, 3 and around the tile; N and K that are not
multiples of the tiles; strided x), and bitwise batch invariance (a slice of rows gives the same bits alone as
inside the whole batch).

As in tests/test_triton_kernels.py: `triton.jit` reads TRITON_INTERPRET when the kernel's module is imported, so in
a normal run this file starts a child pytest on itself with TRITON_INTERPRET=1, where the `test_linear_*` checks
run. `TRITON_INTERPRET=1 python -m pytest tests/test_linear_triton.py` runs them directly.

What the interpreter cannot say: bf16 (its bf16 dots are wrong in this triton), the tensor-core path and its bits,
speed. Those are tests/gpu/test_linear_gpu.py and benchmarks/ops/bench_linear.py.

The interpreter computes `tl.dot` with numpy's matmul, i.e. OpenBLAS sgemm, which is itself not row-invariant (the
same [32, 32] x [32, 64] product with the rows shifted by one differs by ~2e-6 in some rows). The invariance tests
therefore swap in a dot that adds the K products one by one, elementwise (`row_invariant_dot`): what they check is
the program structure (fixed tiles, K walked in order, masks, the modulo rows), not the hardware dot,
whose invariance only the GPU tests can see.
"""

from __future__ import annotations

from dataclasses import replace

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:
    from flide.testing import run_in_triton_interpreter

    def test_in_the_triton_interpreter():
        """Runs this file's `test_linear_*` checks in a child process with TRITON_INTERPRET=1."""
        run_in_triton_interpreter(__file__, "test_linear_", 20)

    def test_compiled_kernel_is_fixed():
        """Outside the interpreter the kernel is a plain JITFunction: no autotuner or heuristics in front of it
        (they would pick tiles per shape), and M is not specialised (one compiled kernel for every M)."""
        pytest.importorskip("triton")
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.jit import JITFunction

        from flide.ops.linear import triton as lt

        for kernel in (lt._linear_kernel, lt._linear_tma_kernel):
            assert isinstance(kernel, JITFunction) and not isinstance(kernel, (Autotuner, Heuristics))
            assert [p.name for p in kernel.params if p.do_not_specialize] == ["M"]

    def test_cpu_tensors_outside_the_interpreter_are_refused():
        pytest.importorskip("triton")
        from flide.ops.linear import triton as lt

        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            lt.linear(torch.randn(3, 4), torch.randn(5, 4), None)

else:
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.interpreter import InterpretedFunction

    from flide.ops.linear import triton as lt

    Config = lt.Config
    SMALL = Config(16, 16, 16, 2, 4, 1)  # many tiles (and groups) on small shapes
    FP32 = lt.default_config(torch.float32)

    def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)

    def operands(m: int, n: int, k: int, seed: int, bias: bool = True, dtype=torch.float32):
        x = randn(m, k, seed=seed, dtype=dtype)
        weight = randn(n, k, seed=seed + 1, dtype=dtype, scale=max(k, 1) ** -0.5)  # outputs of order 1
        b = randn(n, seed=seed + 2, dtype=dtype) if bias else None
        return x, weight, b

    def _sequential_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        """`InterpreterBuilder.create_dot` as `matmul(a, b) + d` (the interpreter's own form: the tile's partial sum,
        then the accumulator), the partial sum adding the tile's K products in order, elementwise: every output
        element sees the same operations whatever its row, and a change of BLOCK_K (or a split of K) changes them."""
        from triton.runtime.interpreter import TensorHandle

        a_data, b_data = a.data.astype(d.data.dtype), b.data.astype(d.data.dtype)
        partial = a_data[..., :, :1] * b_data[..., :1, :]
        for kk in range(1, a_data.shape[-1]):
            partial += a_data[..., :, kk:kk + 1] * b_data[..., kk:kk + 1, :]
        return TensorHandle(partial + d.data, d.dtype.scalar)

    @pytest.fixture
    def row_invariant_dot(monkeypatch):
        from triton.runtime.interpreter import InterpreterBuilder

        monkeypatch.setattr(InterpreterBuilder, "create_dot", _sequential_dot)

    def want64(x, weight, bias):
        return F.linear(x.double(), weight.double(), None if bias is None else bias.double())

    # -----------------------------------------------------------------------------------------------------------------
    # the kernel object
    # -----------------------------------------------------------------------------------------------------------------

    def test_linear_kernel_is_interpreted_and_not_autotuned():
        kernel = lt._linear_kernel
        assert isinstance(kernel, InterpretedFunction)
        assert not isinstance(kernel, (Autotuner, Heuristics))

    def test_linear_16bit_default_is_the_tma_form(monkeypatch):
        """16-bit layers default to the persistent TMA form (the H200 sweep's winner on every projection shape); the
        `triton_pointer` ablation keeps the pointer kernel's 128 x 128 tiles; the K step (64) is the same in all.
        A default-config fp16 layer the TMA can address launches that form, one it cannot (rows of 140 bytes) the
        pointer kernel with the same tiles; both within one fp16 rounding of float64."""
        cfg = lt.default_config(torch.float16)
        assert cfg.tma and not cfg.warp_specialize and (cfg.block_m, cfg.block_n, cfg.block_k) == (128, 256, 64)
        assert lt.pointer_config(torch.bfloat16) == replace(cfg, block_n=128, tma=False)
        assert lt.tma_config(torch.bfloat16, warp_specialize=True) == replace(cfg, warp_specialize=True)
        assert lt.pointer_config(torch.float32) == lt.tma_config(torch.float32) == FP32
        # before Hopper (no TMA, less shared memory): the pointer kernel's tiles; Hopper and later: the TMA form
        assert lt.default_config(torch.bfloat16, (8, 0)) == lt.default_config(torch.float16, (8, 6)) \
            == lt.pointer_config(torch.bfloat16)
        assert lt.default_config(torch.bfloat16, (9, 0)) == lt.default_config(torch.bfloat16, (10, 0)) == cfg
        assert lt.default_config(torch.float32, (8, 0)) == FP32
        launched = []
        monkeypatch.setattr(lt, "_launch_tma", lambda *a, _f=lt._launch_tma: launched.append(1) or _f(*a))
        for n, k, tma in [(24, 48, True), (70, 48, False)]:
            launched.clear()
            x, weight, b = operands(5, n, k, seed=n, dtype=torch.float16)
            out = lt.linear(x, weight, b)
            assert bool(launched) == tma, (n, k)
            torch.testing.assert_close(out.double(), want64(x, weight, b), atol=1e-3, rtol=2 ** -10)

    def test_linear_default_configs_are_fixed():
        """One config per dtype, whatever else; no split-K parameter exists to choose."""
        assert lt.default_config(torch.float32) == FP32
        assert lt.default_config(torch.bfloat16) == lt.default_config(torch.float16)
        assert lt.default_config(torch.bfloat16).block_k == 64
        with pytest.raises(ValueError, match="dtype"):
            lt.default_config(torch.float64)

    # -----------------------------------------------------------------------------------------------------------------
    # against F.linear in float64
    # -----------------------------------------------------------------------------------------------------------------

    BM = FP32.block_m
    M_CASES = [1, 3, BM - 1, BM, BM + 1, BM * 5 // 2]

    @pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
    @pytest.mark.parametrize("m", M_CASES, ids=[f"M{m}" for m in M_CASES])
    def test_linear_matches_f_linear(m, bias):
        """Default fp32 tiles; N = 100 and K = 70 are not multiples of BLOCK_N / BLOCK_K (masked K tail)."""
        x, weight, b = operands(m, 100, 70, seed=m, bias=bias)
        out = lt.linear(x, weight, b)
        assert out.shape == (m, 100) and out.dtype == torch.float32 and out.is_contiguous()
        torch.testing.assert_close(out.double(), want64(x, weight, b), atol=1e-5, rtol=1e-5)

    SMALL_CASES = [(1, 1, 1), (5, 17, 33), (40, 24, 48), (47, 50, 16)]  # (M, N, K); K 48 and 16: no K tail

    @pytest.mark.parametrize("m,n,k", SMALL_CASES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SMALL_CASES])
    def test_linear_small_tiles(m, n, k):
        """16 x 16 x 16 tiles, groups of 2 tile rows: several groups, a last group shorter than GROUP_M."""
        x, weight, b = operands(m, n, k, seed=m + n + k)
        out = lt.linear(x, weight, b, config=SMALL)
        torch.testing.assert_close(out.double(), want64(x, weight, b), atol=1e-5, rtol=1e-5)

    def test_linear_empty_batch_and_empty_reduction():
        """M = 0: an empty [0, N] without a launch. K = 0: the bias alone (zeros without one), as F.linear."""
        x, weight, b = operands(0, 30, 20, seed=1)
        out = lt.linear(x, weight, b)
        assert out.shape == (0, 30) and out.dtype == torch.float32
        x, weight, b = operands(5, 30, 0, seed=2)
        torch.testing.assert_close(lt.linear(x, weight, b), F.linear(x, weight, b))
        assert torch.equal(lt.linear(x, weight, None), torch.zeros(5, 30))

    def test_linear_strided_inputs():
        """x a column slice of a wider tensor (rows not contiguous), x a transposed view (K-major), weight a
        transposed view, bias a strided view: same values as from contiguous copies, and bitwise the same."""
        m, n, k = 45, 37, 70
        wide = randn(m, k + 9, seed=3)
        x_slice = wide[:, 4:4 + k]
        x_t = randn(k, m, seed=4).T
        weight_t = randn(k, n, seed=5, scale=k ** -0.5).T
        b_strided = randn(2 * n, seed=6)[::2]
        assert not x_slice.is_contiguous() and not x_t.is_contiguous() and not weight_t.is_contiguous()
        for x in (x_slice, x_t):
            out = lt.linear(x, weight_t, b_strided)
            torch.testing.assert_close(out.double(), want64(x, weight_t, b_strided), atol=1e-5, rtol=1e-5)
            assert torch.equal(out, lt.linear(x.contiguous(), weight_t.contiguous(), b_strided.contiguous()))

    def test_linear_fp16():
        """fp16 in, fp16 out, fp32 sums: within one fp16 rounding of the float64 result of the fp16 inputs."""
        x, weight, b = operands(130, 70, 80, seed=7, dtype=torch.float16)
        out = lt.linear(x, weight, b)
        assert out.dtype == torch.float16 and out.shape == (130, 70)
        torch.testing.assert_close(out.double(), want64(x, weight, b), atol=1e-3, rtol=2 ** -10)

    # -----------------------------------------------------------------------------------------------------------------
    # batch invariance: a row's bits do not depend on M or on where the row sits
    # -----------------------------------------------------------------------------------------------------------------

    SLICES = [(0, 1), (5, 6), (79, 80), (0, 3), (3, 80), (1, 80), (31, 33), (17, 50), (33, 34), (0, 80)]

    @pytest.mark.parametrize("config", [None, SMALL], ids=["default", "tiles16"])
    @pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
    def test_linear_rows_are_batch_invariant(config, bias, row_invariant_dot):
        x, weight, b = operands(80, 100, 70, seed=11, bias=bias)
        full = lt.linear(x, weight, b, config=config)
        torch.testing.assert_close(full.double(), want64(x, weight, b), atol=1e-5, rtol=1e-5)  # the dot swapped in
        for lo, hi in SLICES:
            assert torch.equal(lt.linear(x[lo:hi], weight, b, config=config), full[lo:hi]), (lo, hi)

    def test_linear_strided_rows_are_batch_invariant(row_invariant_dot):
        """Slices of a column-sliced x (odd start offsets, row stride K + 9) against the whole batch."""
        wide = randn(80, 79, seed=12)
        x = wide[:, 5:75]
        _, weight, b = operands(1, 100, 70, seed=13)
        full = lt.linear(x, weight, b)
        for lo, hi in SLICES:
            assert torch.equal(lt.linear(x[lo:hi], weight, b), full[lo:hi]), (lo, hi)

    def test_linear_invariance_check_sees_another_order(row_invariant_dot):
        """The check above can fail: tiles chosen from M (BLOCK_K 16 for small batches, as an autotuner might) give
        a small batch other bits than the same rows in a large one."""
        x, weight, b = operands(80, 100, 70, seed=11)
        full = lt.linear(x, weight, b, config=Config(32, 64, 32, 8, 4, 2))
        small = lt.linear(x[3:10], weight, b, config=Config(32, 64, 16, 8, 4, 2))
        torch.testing.assert_close(small, full[3:10], atol=1e-5, rtol=1e-5)
        assert not torch.equal(small, full[3:10])

    # -----------------------------------------------------------------------------------------------------------------
    # the persistent TMA form (Config.tma): fp16 here (the interpreter's bf16 descriptor loads are wrong)
    # -----------------------------------------------------------------------------------------------------------------

    TMA = Config(16, 16, 16, 2, 4, 2, tma=True)

    TMA_CASES = [(1, 16, 16), (5, 40, 48), (37, 24, 40), (70, 56, 72)]  # (M, N, K): K tails, partial tiles

    @pytest.mark.parametrize("m,n,k", TMA_CASES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in TMA_CASES])
    def test_linear_tma_form_matches_f_linear(m, n, k, monkeypatch):
        """Partial row / column tiles and K tails come in as zeros from the descriptors; more tiles than programs
        (4 under the interpreter), so programs walk several; within one fp16 rounding of float64."""
        x, weight, b = operands(m, n, k, seed=m + n, dtype=torch.float16)
        assert lt._tma_eligible(x, weight, n)
        launched = []
        monkeypatch.setattr(lt, "_launch_tma", lambda *a, _f=lt._launch_tma: launched.append(1) or _f(*a))
        out = lt.linear(x, weight, b, config=TMA)
        assert launched and out.dtype == torch.float16 and out.shape == (m, n)
        torch.testing.assert_close(out.double(), want64(x, weight, b), atol=1e-3, rtol=2 ** -10)

    def test_linear_tma_form_rows_are_batch_invariant(row_invariant_dot):
        x, weight, b = operands(80, 48, 64, seed=21, dtype=torch.float16)
        full = lt.linear(x, weight, b, config=TMA)
        for lo, hi in SLICES:
            assert torch.equal(lt.linear(x[lo:hi], weight, b, config=TMA), full[lo:hi]), (lo, hi)

    def test_linear_tma_eligibility_does_not_depend_on_the_batch():
        """Row slices of an eligible x stay eligible (whole row strides); unaligned layouts never are (a column
        slice at an odd offset, rows of 70 fp16 elements: 140 bytes), fp32 never is: those take the pointer kernel,
        for every M alike."""
        x, weight, _ = operands(40, 32, 64, seed=3, dtype=torch.float16)
        assert all(lt._tma_eligible(x[lo:hi], weight, 32) for lo, hi in [(0, 1), (3, 40), (17, 18)])
        wide = randn(40, 80, seed=4, dtype=torch.float16)
        assert not lt._tma_eligible(wide[:, 3:67], weight, 32)
        assert not lt._tma_eligible(randn(40, 70, seed=5, dtype=torch.float16),
                                    randn(32, 70, seed=6, dtype=torch.float16), 32)
        assert not lt._tma_eligible(x.float(), weight.float(), 32)
        assert not lt._tma_eligible(x, weight, 36)  # output rows of 72 bytes
        # an ineligible layout still answers, through the pointer kernel
        out = lt.linear(wide[:, 3:67], weight, None, config=TMA)
        torch.testing.assert_close(out.double(), want64(wide[:, 3:67], weight, None), atol=1e-3, rtol=2 ** -10)

    # -----------------------------------------------------------------------------------------------------------------
    # errors
    # -----------------------------------------------------------------------------------------------------------------

    def test_linear_rejects_bad_inputs():
        x, weight, b = operands(4, 8, 16, seed=1)
        with pytest.raises(ValueError, match="expected"):
            lt.linear(x[None], weight, b)  # 3-D x
        with pytest.raises(ValueError, match="expected"):
            lt.linear(x, weight[:, :8], b)  # K mismatch
        with pytest.raises(ValueError, match="bias"):
            lt.linear(x, weight, b[:4])
        with pytest.raises(ValueError, match="dtypes"):
            lt.linear(x, weight.half(), None)
        with pytest.raises(ValueError, match="dtype"):
            lt.linear(x.double(), weight.double(), None)
