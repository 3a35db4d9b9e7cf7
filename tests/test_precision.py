"""`runtime.gemm_reductions` (flide/precision.py): cuBLAS's reduction settings set around Flide's own passes and
restored after, a no-op off CUDA and in `torch` mode, and validated by name. The settings are process-wide flags that
exist in CPU builds of torch too, so their handling is checked here; their effect on the bits is the GPU's to show
(benchmarks: the `single-pass-gemm` ablations)."""

from __future__ import annotations

import pytest
import torch

from flide.precision import gemm_reductions


def flags() -> tuple:
    return (torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
            torch._C._get_cublas_allow_fp16_reduced_precision_reduction())


def _pair(value) -> tuple[bool, bool]:
    return (value, True) if isinstance(value, bool) else tuple(value)


@pytest.mark.parametrize("mode,want", [("fp32", (False, True)), ("single_pass", (False, False))])
def test_modes_set_and_restore_the_flags(mode, want):
    before, library = flags(), torch.backends.cuda.preferred_blas_library()
    with gemm_reductions(mode, "cuda"):
        assert tuple(_pair(f) for f in flags()) == (want, want)
        if mode == "single_pass" and torch.cuda.is_available():  # torch refuses no-split-K outside cuBLASLt
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    assert flags() == before and torch.backends.cuda.preferred_blas_library() == library


def test_restored_after_an_error():
    before = flags()
    with pytest.raises(RuntimeError, match="inside"):
        with gemm_reductions("single_pass", torch.device("cuda", 0)):
            raise RuntimeError("inside")
    assert flags() == before


@pytest.mark.parametrize("mode,device", [("torch", "cuda"), ("single_pass", "cpu")])
def test_torch_mode_and_cpu_change_nothing(mode, device):
    before = flags()
    with gemm_reductions(mode, device):
        assert flags() == before


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="runtime.gemm_reductions"):
        with gemm_reductions("tf32", "cuda"):
            pass
    import flide

    with pytest.raises(ValueError, match="runtime.gemm_reductions"):
        flide.load_config({"runtime": {"gemm_reductions": "fast"}})
    assert flide.load_config({"runtime": {"gemm_reductions": "single_pass"}}).runtime.gemm_reductions == "single_pass"


def test_engine_answers_with_single_pass_on_the_cpu():
    """The option is accepted by an engine and changes nothing on the CPU (no cuBLAS): the answers of the default."""
    import flide
    from flide.models.tiny import tiny_model, tiny_tokenizer
    from flide.testing import max_difference, random_request

    model, tok = tiny_model("qwen3_5_text", seed=0).eval(), tiny_tokenizer()
    import random

    rng = random.Random(0)
    requests = [random_request(rng, max_questions=4, max_words=40) for _ in range(3)]
    default = flide.patch(model, tok).decide(requests)
    single = flide.patch(model, tok, config={"runtime": {"gemm_reductions": "single_pass"}}).decide(requests)
    assert max(max_difference(a, b) for a, b in zip(default, single)) == 0
