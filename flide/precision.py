"""How cuBLAS sums the half-precision GEMMs of Flide's forward passes (`runtime.gemm_reductions`).

cuBLAS may split a GEMM's reduction over K across thread blocks (split-K) for shapes with few output tiles, and by
default torch lets it add those partial sums in reduced precision (`torch.backends.cuda.matmul.
allow_bf16_reduced_precision_reduction`). Both depend on the number of rows M: the same row gets other bits in a
round of another size (another CUDA-graph bucket), which is what moves bf16 answers between a request alone and the
same request under load. `fp32` keeps split-K but adds its partials in fp32; `single_pass` turns split-K off (torch
>= 2.10: the second element of the setting), so each output is summed over K in one pass by one thread block.

The setting is process-wide state that cuBLAS reads at each call (and a CUDA graph records at capture), so Flide
sets it only around its own passes and captures (`gemm_reductions`) and restores it after: other models in the
process keep theirs. It is read only on CUDA; elsewhere this is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MODES = ("torch", "fp32", "single_pass")


def _get(getter) -> tuple[bool, bool]:
    value = getter()
    return (value, True) if isinstance(value, bool) else (bool(value[0]), bool(value[1]))


def _set(setter, value: tuple[bool, bool]) -> None:
    try:
        setter(*value)
    except TypeError:  # a torch without the split-K switch takes one bool
        if not value[1]:
            raise ValueError("`runtime.gemm_reductions: single_pass` needs torch >= 2.10 (cuBLAS's split-K switch); "
                             f"this torch is {torch.__version__}.") from None
        setter(value[0])


@contextlib.contextmanager
def gemm_reductions(mode: str, device: torch.device | str) -> Iterator[None]:
    """Inside: cuBLAS's bf16 and fp16 GEMMs reduce as `mode` says (see the module docstring); restored after."""
    if mode not in MODES:
        raise ValueError(f"`runtime.gemm_reductions` must be one of {', '.join(MODES)}, got {mode!r}.")
    if mode == "torch" or torch.device(device).type != "cuda":
        yield
        return
    pairs = [(torch._C._get_cublas_allow_bf16_reduced_precision_reduction,
              torch._C._set_cublas_allow_bf16_reduced_precision_reduction),
             (torch._C._get_cublas_allow_fp16_reduced_precision_reduction,
              torch._C._set_cublas_allow_fp16_reduced_precision_reduction)]
    saved = [_get(getter) for getter, _ in pairs]
    # cuBLAS proper has no split-K switch: torch refuses `allow_splitk=False` at the GEMM unless cuBLASLt runs it
    # (the H200's first `single_pass` run failed there), so that mode also prefers cuBLASLt, restored after
    library = torch.backends.cuda.preferred_blas_library() if mode == "single_pass" else None
    if library is not None:
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        except RuntimeError as error:  # a build without cuBLASLt
            if torch.cuda.is_available():
                raise ValueError("`runtime.gemm_reductions: single_pass` needs cuBLASLt, which this torch build "
                                 f"lacks ({error}).") from None
            library = None  # a CPU build: no GEMM here will read the flags
    try:
        for _, setter in pairs:
            _set(setter, (False, mode != "single_pass"))
        yield
    finally:
        for (_, setter), value in zip(pairs, saved):
            _set(setter, value)
        if library is not None:
            torch.backends.cuda.preferred_blas_library(library)
