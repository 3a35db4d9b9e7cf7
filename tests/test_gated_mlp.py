"""`kernels.gated_mlp`: a gated MLP's silu(gate(x)) * up(x) as one op over the stacked gate / up weight.

On the CPU: the plumbing (the flat model's MLPs calling the `torch` variant's custom op answer as the model's own
modules), the config errors, the check of the MLP it replaces; and, in a child process under TRITON_INTERPRET=1,
the Triton kernel (flide/ops/gated_mlp/triton.py) against the reference in float32 (pointer and TMA forms, partial
tiles, K tails, M of 0 / 1, strided x) and bitwise batch invariance. What the interpreter cannot say (bf16, the
tensor-core path, speed): tests/gpu/test_gated_mlp_gpu.py and benchmarks/ops/bench_gated_mlp.py.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch import nn

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def operands(m: int, inter: int, k: int, seed: int, dtype=torch.float32):
    x = randn(m, k, seed=seed, dtype=dtype)
    weight = randn(2 * inter, k, seed=seed + 1, dtype=dtype, scale=max(k, 1) ** -0.5 * 2)  # gates of order +-2
    return x, weight


if not INTERPRETED:
    import flide
    from flide.models.flat import FlatBlock
    from flide.models.tiny import tiny_model, tiny_tokenizer
    from flide.ops.gated_mlp import gated_mlp_torch, gated_mlp_triton, reference
    from flide.testing import max_difference, random_request, run_in_triton_interpreter

    def test_in_the_triton_interpreter():
        """Runs this file's `test_gated_mlp_*` checks in a child process with TRITON_INTERPRET=1."""
        run_in_triton_interpreter(__file__, "test_gated_mlp_", 10)

    def test_reference_is_the_modules_math():
        """The oracle is transformers' MLP first half, act_fn(gate_proj(x)) * up_proj(x), in fp32 and bf16: the
        same roundings, the GEMM's sums aside (one GEMM over the stacked weight, as the flat model runs them, where
        the modules run two: BLAS blocks them differently)."""
        from transformers.activations import ACT2FN

        for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
            x, weight = operands(9, 12, 16, seed=1, dtype=dtype)
            gate, up = nn.Linear(16, 12, bias=False).to(dtype), nn.Linear(16, 12, bias=False).to(dtype)
            gate.weight.data, up.weight.data = weight[:12].clone(), weight[12:].clone()
            with torch.no_grad():
                want = ACT2FN["silu"](gate(x)) * up(x)
                torch.testing.assert_close(reference.gated_mlp(x, weight), want, atol=tolerance, rtol=tolerance)
                fused_gate, fused_up = nn.functional.linear(x, weight).chunk(2, dim=-1)  # the roundings, op for op
                assert torch.equal(reference.gated_mlp(x, weight), ACT2FN["silu"](fused_gate) * fused_up)
        with pytest.raises(ValueError, match="gate and up"):
            reference.gated_mlp(x, weight[1:])

    def _blocks(engine) -> list[FlatBlock]:
        return list(engine.flat.blocks)

    def test_the_op_in_the_model_answers_as_the_modules():
        """Every MLP calling the `torch` variant's custom op over the stacked weight (the op's path, as `triton` runs
        it) answers as the default path (the model's modules) to float32 rounding."""
        tok, model = tiny_tokenizer_and_model()
        engine = flide.patch(model, tok)
        rng = random.Random(4)
        requests = [random_request(rng, max_questions=5, max_words=60) for _ in range(6)]
        want = engine.decide(requests)
        blocks = _blocks(engine)
        assert blocks and all(block.mlp_op is None for block in blocks)  # `torch`: the modules' path
        for block in blocks:
            block.mlp_op = gated_mlp_torch
        got = engine.decide(requests)
        assert max(max_difference(a, b) for a, b in zip(want, got)) < 1e-6

    def tiny_tokenizer_and_model():
        return tiny_tokenizer(), tiny_model("qwen3_5_text")

    def test_unknown_variant_names_the_field():
        tok, model = tiny_tokenizer_and_model()
        with pytest.raises(ValueError, match="gated_mlp"):
            flide.patch(model, tok, config={"kernels": {"gated_mlp": "nope"}})

    def test_triton_variant_needs_a_gpu_here():
        """`kernels.gated_mlp: triton` on a machine without CUDA: an error naming why, not a crash at the first round."""
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        tok, model = tiny_tokenizer_and_model()
        with pytest.raises(ValueError, match="triton"):
            flide.patch(model, tok, config={"kernels": {"gated_mlp": "triton"}})

    def test_an_mlp_that_is_not_silu_gated_is_refused():
        """The op computes SiLU only: an MLP with another act (or gate / up it cannot stack) is refused with the
        field's name; the `torch` variant keeps any MLP's own modules."""
        tok, model = tiny_tokenizer_and_model()
        engine = flide.patch(model, tok)
        block = _blocks(engine)[0]
        block.fuse_projections(gated_mlp_torch)
        assert block.mlp_op is None
        block.fuse_projections(gated_mlp_triton)  # a SiLU MLP: taken (running it needs CUDA)
        assert block.mlp_op is gated_mlp_triton
        block.mlp_op = None
        block.mlp.act_fn = nn.GELU()
        with pytest.raises(ValueError, match="kernels.gated_mlp"):
            block.fuse_projections(gated_mlp_triton)
        assert block.mlp_op is None

else:
    from triton.runtime.interpreter import InterpretedFunction

    from flide.ops.gated_mlp import reference
    from flide.ops.gated_mlp import triton as gt
    from flide.ops.linear.triton import Config

    SMALL = Config(16, 16, 16, 2, 4, 1)
    TMA = Config(16, 16, 16, 2, 4, 2, tma=True)

    def want64(x, weight):
        """silu(gate) * up in float64 (no intermediate rounding): float32's roundings are within 1e-5 of it."""
        gate, up = (x.double() @ weight.double().T).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def test_gated_mlp_kernel_is_interpreted():
        assert isinstance(gt._gated_mlp_kernel, InterpretedFunction)
        assert isinstance(gt._gated_mlp_tma_kernel, InterpretedFunction)

    def test_gated_mlp_default_tiles_are_the_linear_kernels():
        """16-bit: the linear kernel's TMA tiles with BLOCK_N counting output columns (two accumulators of 128); fp32:
        the linear kernel's own."""
        from flide.ops.linear import triton as lt

        assert gt.default_config(torch.bfloat16) == gt.default_config(torch.float16)
        cfg = gt.default_config(torch.bfloat16)
        assert cfg.tma and (cfg.block_m, cfg.block_n, cfg.block_k) == (128, 128, 64)
        assert gt.default_config(torch.float32) == lt.default_config(torch.float32)
        assert gt.default_config(torch.bfloat16, (8, 0)).tma is False

    CASES = [(1, 16, 16), (3, 20, 24), (37, 40, 48), (64, 33, 70), (70, 16, 17)]  # (M, I, K): tails of each

    @pytest.mark.parametrize("exact", [False, True], ids=["inductor-silu", "eager-silu"])
    @pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
    @pytest.mark.parametrize("m,inter,k", CASES, ids=[f"M{m}-I{i}-K{k}" for m, i, k in CASES])
    def test_gated_mlp_matches_the_reference_fp32(m, inter, k, config, exact):
        x, weight = operands(m, inter, k, seed=m + inter + k)
        out = gt.gated_mlp(x, weight, config=config, exact_silu=exact)
        assert out.shape == (m, inter) and out.dtype == torch.float32 and out.is_contiguous()
        torch.testing.assert_close(out, reference.gated_mlp(x, weight), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), want64(x, weight), atol=1e-5, rtol=1e-5)

    def test_gated_mlp_strided_x_and_empty_shapes():
        x, weight = operands(21, 24, 40, seed=3)
        wide = torch.zeros(21, 57)
        wide[:, 5:45] = x
        torch.testing.assert_close(gt.gated_mlp(wide[:, 5:45], weight, config=SMALL),
                                   gt.gated_mlp(x, weight, config=SMALL), atol=0, rtol=0)
        assert gt.gated_mlp(x[:0], weight).shape == (0, 24)
        assert not gt.gated_mlp(x[:, :0], weight[:, :0]).any()  # no products: silu(0) * 0
        with pytest.raises(ValueError, match="gate rows"):
            gt.gated_mlp(x, weight[1:])
        with pytest.raises(ValueError, match="dtype"):
            gt.gated_mlp(x.double(), weight.double())

    TMA_CASES = [(1, 16, 16), (5, 24, 48), (37, 40, 40), (70, 16, 72)]  # (M, I, K): I past the tile, K tails

    @pytest.mark.parametrize("m,inter,k", TMA_CASES, ids=[f"M{m}-I{i}-K{k}" for m, i, k in TMA_CASES])
    def test_gated_mlp_tma_form_matches_the_reference(m, inter, k, monkeypatch):
        """The persistent TMA form (fp16 here: the interpreter's bf16 descriptor loads are wrong), within fp16's
        roundings of float64: the gate tile that runs past I reads up rows into columns the store clips away."""
        x, weight = operands(m, inter, k, seed=m * k, dtype=torch.float16)
        assert gt._tma_eligible(x, weight, inter)
        launched = []
        monkeypatch.setattr(gt, "_launch_tma", lambda *a, _f=gt._launch_tma: launched.append(1) or _f(*a))
        out = gt.gated_mlp(x, weight, config=TMA)
        assert launched and out.dtype == torch.float16
        torch.testing.assert_close(out.double(), want64(x, weight), atol=2e-3, rtol=2 ** -9)
        # against the pointer form with the same tiles: the same sums, so at most the fp16 output roundings apart
        pointer = gt.gated_mlp(x, weight, config=SMALL)
        torch.testing.assert_close(out, pointer, atol=2e-3, rtol=2 ** -9)

    def test_gated_mlp_rows_keep_their_bits_in_any_batch(monkeypatch):
        """Batch invariance of the program structure: a slice of rows alone gives the bits it gets inside the whole
        batch (with a dot that sums each element over k in order, as the linear tests do: numpy's matmul may block
        rows differently)."""
        from triton.runtime.interpreter import InterpreterBuilder

        from flide.testing import interpreter_dot_by_k

        monkeypatch.setattr(InterpreterBuilder, "create_dot", interpreter_dot_by_k)
        x, weight = operands(45, 20, 24, seed=9)
        whole = gt.gated_mlp(x, weight, config=SMALL)
        for lo, hi in [(0, 1), (3, 20), (17, 45), (44, 45)]:
            assert torch.equal(gt.gated_mlp(x[lo:hi].clone(), weight, config=SMALL), whole[lo:hi]), (lo, hi)

    def test_gated_mlp_in_a_whole_tiny_model_answers_as_the_modules():
        """Every MLP of a tiny Qwen3.5 (fp32, eager rounds on the CPU) through the Triton kernel (interpreted) over
        the stacked weight answers as the model's own modules, to float32 rounding."""
        import flide
        from flide.models.tiny import tiny_model, tiny_tokenizer
        from flide.testing import max_difference, random_request

        engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer())
        rng = random.Random(5)
        requests = [random_request(rng, max_questions=5, max_words=60) for _ in range(4)]
        want = engine.decide(requests)
        blocks = list(engine.flat.blocks)
        assert blocks and all(block.mlp_sizes is not None for block in blocks)
        for block in blocks:
            block.mlp_op = gt.gated_mlp
        got = engine.decide(requests)
        assert max(max_difference(a, b) for a, b in zip(want, got)) < 1e-5
