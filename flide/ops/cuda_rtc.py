"""CUDA C kernels compiled at run time with NVRTC, the runtime compiler that ships with PyTorch's CUDA builds.

Why not `torch.utils.cpp_extension`: it needs nvcc, a host compiler and the CUDA headers on the serving machine,
and a minute of compile per kernel. NVRTC compiles a header-free kernel in well under a second from torch's own
libnvrtc, with no toolkit installed. Our kernels include no headers (bf16 / fp16 conversions are one PTX `cvt`
each), so torch's own `torch.cuda._compile_kernel`, which adds the toolkit's include directory and so needs
CUDA_HOME, is more than we need: we call NVRTC ourselves and load the cubin through torch's driver helpers.

Kernels are compiled on first use (a model's first forward, before any CUDA graph capture); their callers keep
them per device.
`compile_cubin(..., nvrtc=PATH)` also runs without a GPU (a CPU machine with the libnvrtc wheel), which is how
`benchmarks/ops/compile_sm90.py` checks registers and spills here.
"""

from __future__ import annotations

import ctypes


def available() -> str | None:
    """None where run-time compiled kernels can launch (a CUDA GPU of compute capability >= 8.0 and torch's NVRTC
    helpers), else why not."""
    import torch

    if not torch.cuda.is_available():
        return "it needs a CUDA GPU"
    if torch.version.hip:
        return "it needs NVIDIA CUDA (NVRTC), not ROCm"
    try:
        from torch.cuda._utils import _cuda_load_module, _get_gpu_rtc_library  # noqa: F401
    except ImportError:
        return "this torch lacks the NVRTC helpers (torch.cuda._utils)"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return "it needs compute capability 8.0 or newer (bf16 conversions)"
    return None


def _nvrtc_library(path: str | None):
    if path is not None:
        return ctypes.CDLL(path)
    from torch.cuda._utils import _get_gpu_rtc_library

    return _get_gpu_rtc_library()


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = (), nvrtc: str | None = None) -> bytes:
    """The cubin of `source` for `arch` (e.g. "sm_90"), kernel `name` declared `extern "C"`. Raises RuntimeError
    with NVRTC's log when the source does not compile."""
    lib = _nvrtc_library(nvrtc)

    def check(status: int, what: str) -> None:
        if status != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(status).decode()}")

    prog = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", *(o.encode() for o in options)]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def load(source: str, name: str, arch: str, options: tuple[str, ...] = ()):
    """The compiled kernel, loaded into the current device's context, launchable as `kernel(grid=, block=,
    args=[tensors, ints, floats], shared_mem=)` on the current stream (so a CUDA graph being captured records it).
    Ints go as C `int`, floats as C `double`. Not cached here: the caller keeps a kernel per device (a module lives
    in one device's context) and must load it outside graph capture (the first, eager forward does it)."""
    from torch.cuda._utils import _cuda_load_module

    return _cuda_load_module(compile_cubin(source, name, arch, options), [name])[name]
