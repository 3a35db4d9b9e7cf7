"""Compiles Flide's Triton kernels for the H200's architecture (sm_90) on a machine without a GPU: a cheap check of
new kernel code before spending device time on it.

    python benchmarks/ops/compile_sm90.py            # every kernel below, bf16 and fp32 where they differ

Triton compiles to PTX and cubin without a device (`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))`), so IR verification, layout and lowering errors show up here. What does not: the device's own Triton version
(3.6 on the H200 box, maybe older than the one here), register spills (a cubin's register count is read when it is
loaded), anything numerical, and the code a real launch gets: a launch specialises integer arguments equal to 1 and
pointers / integers divisible by 16, which decides vectorisation and software pipelining (compiled here without
those hints, the invariant GEMM shows one stage of shared memory; with them, as launched, three). So this is a
check for compile errors, not for performance. Signatures are built from the kernels' argument names: `*_ptr` pointers (the dtype
below), `T` / strides / sizes i32, UPPER-CASE names constexprs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def signature(fn, pointers: dict[str, str], default_pointer: str, scalars: dict[str, str], constexprs: dict):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr") or name.endswith("_desc"):
            sig[name] = pointers.get(name, default_pointer)
        else:
            sig[name] = scalars.get(name, "i32")
    return sig


def compile_one(label: str, fn, pointers, default_pointer, scalars, constexprs, options) -> bool:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    src = ASTSource(fn, signature(fn, pointers, default_pointer, scalars, constexprs),
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    start = time.perf_counter()
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as error:  # noqa: BLE001 (report every kernel, then fail)
        print(f"FAILED  {label}: {type(error).__name__}: {str(error)[:600]}")
        return False
    shared = compiled.metadata.shared if hasattr(compiled.metadata, "shared") else "?"
    print(f"ok      {label}  ({time.perf_counter() - start:.1f} s, shared memory {shared} bytes)")
    return True


def main() -> int:
    import torch

    from flide.ops.fork_attention import triton_invariant as attn
    from flide.ops.fork_conv import triton as conv
    from flide.ops.gated_delta import branches, questions_wy
    from flide.ops.linear import triton as linear

    ok = True
    # the stream tables (seg_lo, trunk_lo, ...) as a round hands them in: int32 (flide/round.py)
    for dtype, triton_dtype in (("bf16", "*bf16"), ("fp32", "*fp32")):
        cfg = attn.default_config(256, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
        for prefix in (False, True):
            ok &= compile_one(
                f"fork_attention invariant {dtype} D256 GQA4 prefix={prefix}", attn._fork_attention_invariant_kernel,
                {"q_ptr": triton_dtype, "k_ptr": triton_dtype, "v_ptr": triton_dtype, "o_ptr": triton_dtype,
                 "pk_ptr": triton_dtype, "pv_ptr": triton_dtype, "stats_ptr": "*i32"}, "*i32", {"qk_scale": "fp32"},
                dict(GROUP=4, HEAD_DIM=256, HEAD_DIM_V=256, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=256,
                     BLOCK_DV=256, PRECISION="ieee" if dtype == "fp32" else "tf32", STATS=False, HAS_PREFIX=prefix),
                {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        for window in (False, True):
            ok &= compile_one(
                f"fork_conv {dtype} window={window}", conv._fork_conv_kernel,
                {"x_ptr": triton_dtype, "w_ptr": triton_dtype, "out_ptr": triton_dtype, "win_ptr": triton_dtype},
                "*i32", {}, dict(W=4, SILU=True, BLOCK_T=conv.BLOCK_T, BLOCK_D=conv.BLOCK_D, HAS_WINDOW=window),
                {"num_warps": conv.NUM_WARPS})
        for final, snapshot in ((False, False), (True, False), (True, True)):
            ok &= compile_one(
                f"gated_delta branches {dtype} final={final} snapshot={snapshot}", branches._branch_kernel,
                {n: triton_dtype for n in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "o_ptr")} |
                {"h0_ptr": "*fp32", "ht_ptr": "*fp32", "hs_ptr": "*fp32"}, "*i64", {"scale": "fp32"},
                dict(HK=16, HV=16, K=128, V=128, BK=128, BV=branches.BLOCK_V, L2NORM=True, STORE_FINAL=final,
                     SNAPSHOT=snapshot), {"num_warps": branches.NUM_WARPS, "num_stages": branches.NUM_STAGES})
        for hv in (16, 32):  # 0.8B / 2B, and 4B / 9B (two value heads per key head)
            ok &= compile_one(
                f"gated_delta questions (WY chain) {dtype} Hv{hv}", questions_wy._chain_kernel,
                {n: triton_dtype for n in ("q_ptr", "k_ptr", "w_ptr", "u_ptr", "o_ptr")} |
                {"g_ptr": "*fp32", "h0_ptr": "*fp32"}, "*i64", {"scale": "fp32"},
                dict(HK=16, HV=hv, K=128, V=128, BK=128, BV=questions_wy.BLOCK_V, BT=64, PRECISION="tf32"),
                {"num_warps": questions_wy.NUM_WARPS, "num_stages": questions_wy.NUM_STAGES})
    cfg = linear.default_config(torch.bfloat16)
    ok &= compile_one("linear (invariant GEMM) bf16", linear._linear_kernel,
                      {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16"}, "*bf16", {},
                      dict(HAS_BIAS=False, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PRECISION="tf32"),
                      {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    print("all compiled" if ok else "some kernels did not compile")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
