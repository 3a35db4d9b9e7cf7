"""The CUDA C question kernel's host side (flide/ops/gated_delta/questions_cuda.py), which runs anywhere: its source
for every dtype set and tile, and the checks that send other inputs to the Triton kernel. The kernel itself runs in
tests/gpu/test_gated_delta_gpu.py (NVRTC and a GPU)."""

from __future__ import annotations

import re

import pytest
import torch

from flide.ops.gated_delta import questions_cuda

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("tiles", questions_cuda.TILES, ids=str)
def test_source_renders_every_dtype_and_tile(dtype, tiles):
    src = questions_cuda.source(128, 128, 16, 32, dtype, torch.float32, dtype, torch.int32, *tiles)
    assert re.search(r"\{[A-Z_]+\}", src) is None  # every placeholder filled
    assert f"#define L {tiles[0]}\n" in src and f"#define W {tiles[1]}\n" in src and "#define HV 32\n" in src
    assert ("typedef float in_t;" in src) == (dtype == torch.float32)
    assert "typedef int idx_t;" in src
    assert f'extern "C" __global__ void __launch_bounds__(THREADS)\n{questions_cuda.NAME}(' in src


def test_tiles_that_do_not_divide_the_shape_are_refused():
    assert questions_cuda.tile_error(128, 128, 16, 16, 2, 1) is None
    assert "multiple of the block's 64" in questions_cuda.tile_error(128, 96, 16, 16, 2, 4)
    assert "K=12" in questions_cuda.tile_error(12, 128, 16, 16, 1, 1)
    assert "lanes along K" in questions_cuda.tile_error(128, 128, 16, 16, 3, 1)
    assert "key heads" in questions_cuda.tile_error(128, 128, 3, 16, 2, 1)
    with pytest.raises(ValueError, match="multiple of the block"):
        questions_cuda.source(128, 96, 16, 16, torch.bfloat16, torch.float32, torch.bfloat16, torch.int64, 2, 4)
    with pytest.raises(ValueError, match="segment tables"):
        questions_cuda.source(128, 128, 16, 16, torch.bfloat16, torch.float32, torch.bfloat16, torch.int16)


def test_cpu_tensors_go_to_the_triton_kernel():
    q, v = torch.zeros(4, 2, 16), torch.zeros(4, 4, 16)
    g, index = torch.zeros(4, 4), torch.zeros(3, dtype=torch.int64)
    assert not questions_cuda.supports(q, v, g, g, index)


def test_the_default_tile_narrows_for_small_heads():
    lanes, warps, lazy = questions_cuda.LANES_K, questions_cuda.WARPS, questions_cuda.LAZY_DECAY
    assert questions_cuda.pick_tile(128, 128, 16, 32) == (lanes, warps, lazy)
    assert questions_cuda.pick_tile(16, 16, 2, 4) == (lanes, 1, lazy)  # 16 value columns: one warp of 16 columns
    assert questions_cuda.pick_tile(12, 16, 2, 4) is None  # K not a multiple of 8
