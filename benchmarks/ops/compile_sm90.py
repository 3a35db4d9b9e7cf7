"""Compiles Flide's Triton kernels for the H200's architecture (sm_90) on a machine without a GPU: a cheap check of
new kernel code before spending device time on it.

    python benchmarks/ops/compile_sm90.py            # every kernel below, bf16 and fp32 where they differ
    python benchmarks/ops/compile_sm90.py --nvrtc /tmp/nvrtc/site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12
                                                     # also the CUDA C question kernel, registers and stack per tile

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


def compile_cuda_questions(nvrtc: str) -> bool:
    """The CUDA C question kernel (questions_cuda.py) through NVRTC for sm_90, with its registers and spills from
    triton's cuobjdump: every tile of its sweep, bf16 and fp32, with and without the lazy decay."""
    import os
    import subprocess
    import tempfile

    import torch
    import triton

    from flide.ops import cuda_rtc
    from flide.ops.gated_delta import questions_cuda as qc

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        for lanes, warps in qc.TILES:
            for lazy in (False, True):
                label = f"gated_delta questions (CUDA C) {dtype} [L{lanes}, w{warps}{', lazy' if lazy else ''}]"
                try:
                    src = qc.source(128, 128, 16, 32, dtype, torch.float32, dtype, torch.int32, lanes, warps, lazy)
                    cubin = cuda_rtc.compile_cubin(src, qc.NAME, "sm_90", nvrtc=nvrtc)
                except (RuntimeError, ValueError) as error:
                    print(f"FAIL {label}: {error}")
                    ok = False
                    continue
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(cubin)
                    f.flush()
                    usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                                           text=True).stdout
                line = next((x.strip() for x in usage.splitlines() if "REG:" in x), "no resource line")
                print(f"ok   {label}: {line.split(' TEXTURE')[0]}")
    return ok


def main() -> int:
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvrtc", default=None, help="a libnvrtc.so (e.g. from the nvidia-cuda-nvrtc-cu12 wheel, "
                        "unzipped): also compile the CUDA C question kernel and print its registers and stack")
    nvrtc = parser.parse_args().nvrtc

    from flide.ops.fork_attention import triton_invariant as attn
    from flide.ops.fork_conv import triton as conv
    from flide.ops.gated_delta import branches, kkt_solve, questions_chunked, questions_wy, segment_scan, state_chain
    from flide.ops.gated_norm import triton as gated_norm
    from flide.ops.qk_prep import triton as qk_prep
    from flide.ops.linear import triton as linear

    ok = True
    # the stream tables (seg_lo, trunk_lo, ...) as a round hands them in: int32 (flide/round.py)
    for dtype, triton_dtype in (("bf16", "*bf16"), ("fp32", "*fp32")):
        cfg = attn.default_config(256, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
        # (and bf16 with the value columns in two programs, `triton_invariant.V_SPLIT_DIM`)
        for prefix, sub, parts in ((False, False, 1), (True, False, 1), (False, True, 1),
                                   *([(False, False, 2)] if dtype == "bf16" else [])):
            ok &= compile_one(
                f"fork_attention invariant {dtype} D256 GQA4 prefix={prefix} sub={sub} value parts={parts}",
                attn._fork_attention_invariant_kernel,
                {"q_ptr": triton_dtype, "k_ptr": triton_dtype, "v_ptr": triton_dtype, "o_ptr": triton_dtype,
                 "pk_ptr": triton_dtype, "pv_ptr": triton_dtype, "stats_ptr": "*i32"}, "*i32", {"qk_scale": "fp32"},
                dict(GROUP=4, HEAD_DIM=256, HEAD_DIM_V=256, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=256,
                     BLOCK_DV=256 // parts, PRECISION="ieee" if dtype == "fp32" else "tf32", STATS=False,
                     HAS_PREFIX=prefix, HAS_SUB=sub, V_PARTS=parts),
                {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        for window, split in ((False, False), (True, False), (False, True)):
            ok &= compile_one(
                f"fork_conv {dtype} window={window} split={split}", conv._fork_conv_kernel,
                {n: triton_dtype for n in ("x_ptr", "w_ptr", "out_ptr", "win_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr",
                                           "alog_ptr", "dt_ptr", "beta_ptr")} | {"g_ptr": "*fp32"}, "*i32", {},
                dict(W=4, SILU=True, BLOCK_T=conv.BLOCK_T, BLOCK_D=conv.BLOCK_D, HAS_WINDOW=window, SPLIT=split,
                     NORM=split, EPS=conv.EPS, GATES=split, BLOCK_H=16, LIBDEVICE=True,
                     CHANNELS_FASTEST=conv.CHANNELS_FASTEST), {"num_warps": conv.NUM_WARPS})
        for weight_dtype in dict.fromkeys((triton_dtype, "*fp32")):  # bf16 and fp32 weights; fp32 once
            ok &= compile_one(
                f"gated_norm {dtype} weight {weight_dtype[1:]}", gated_norm._gated_norm_kernel,
                {n: triton_dtype for n in ("xs_ptr", "xb_ptr", "gate_ptr", "out_ptr")} | {"w_ptr": weight_dtype},
                "*i32", {"eps": "fp32"}, dict(V=128, BV=128, BLOCK_T=gated_norm.BLOCK_T,
                                              ROUND_PRODUCT=weight_dtype == triton_dtype),
                {"num_warps": gated_norm.NUM_WARPS})
        ok &= compile_one(
            f"qk_prep {dtype} D256 R64", qk_prep._qk_prep_kernel,
            {n: triton_dtype for n in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "wq_ptr", "wk_ptr", "oq_ptr", "ok_ptr")},
            triton_dtype, {"eps": "fp32"}, dict(D=256, BD=256, R=64, ROWS=qk_prep.ROWS),
            {"num_warps": qk_prep.NUM_WARPS, "enable_fp_fusion": False})  # as qk_prep launches it
        # nested: False, True (each leaf re-runs its sub-trunk), or "stored" (leaves from their sub-trunk's stored
        # state, waiting on its flag)
        for final, snapshot, hv, nested in ((False, False, 16, False), (False, False, 32, False),
                                            (True, False, 16, False), (True, True, 16, False),
                                            (False, False, 16, True), (False, False, 32, True),
                                            (False, False, 16, "stored"), (False, False, 32, "stored")):
            block_v = branches.BLOCK_V_MANY_HEADS if hv >= 32 else branches.BLOCK_V
            ok &= compile_one(
                f"gated_delta branches {dtype} Hv{hv} final={final} snapshot={snapshot} nested={nested}",
                branches._branch_kernel,
                {n: triton_dtype for n in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "o_ptr")} |
                {"h0_ptr": "*fp32", "ht_ptr": "*fp32", "hs_ptr": "*fp32", "sub_lo_ptr": "*i32", "sub_hi_ptr": "*i32",
                 "sub_slot_ptr": "*i32", "subs_ptr": "*fp32", "flags_ptr": "*i32"},
                "*i64", {"scale": "fp32"},
                dict(HK=16, HV=hv, K=128, V=128, BK=128, BV=block_v, L2NORM=not (final or hv == 32),
                     STORE_FINAL=final, SNAPSHOT=snapshot, ROW_PROGRAMS=0, NESTED=bool(nested),
                     SUB_STATES=nested == "stored"),
                {"num_warps": branches.NUM_WARPS, "num_stages": branches.NUM_STAGES})
        for hv in (16, 32):  # 0.8B / 2B, and 4B / 9B (two value heads per key head)
            ok &= compile_one(
                f"gated_delta questions (WY chain) {dtype} Hv{hv}", questions_wy._chain_kernel,
                {n: triton_dtype for n in ("q_ptr", "k_ptr", "w_ptr", "u_ptr", "o_ptr")} |
                {"g_ptr": "*fp32", "h0_ptr": "*fp32"}, "*i64", {"scale": "fp32"},
                dict(HK=16, HV=hv, K=128, V=128, BK=128, BV=questions_wy.BLOCK_V, BT=64, PRECISION="tf32"),
                {"num_warps": questions_wy.NUM_WARPS, "num_stages": questions_wy.NUM_STAGES})
    # the state call's fused h + o steps (bf16 only), and the split call's parts (state_chain.SHORT / LONG)
    # (EMPTY_FINALS False: the fork's state call from the round's tables, `state_chain(empty_finals=False)`)
    # (ROWS: programs that take the sequences in turns, the fork's EVERY / SHORT launches: state_chain.ROW_PROGRAMS)
    for hv, h0, part, empty, rows in ((16, False, "EVERY", False, True), (32, False, "EVERY", True, False),
                                      (16, True, "EVERY", True, False), (16, False, "SHORT", False, True),
                                      (16, False, "LONG", True, False), (32, False, "LONG", True, False),
                                      (16, False, "EVERY", False, False)):
        # the tiles each part launches at (`state_chain_split`: the LONG part at LONG_TILES)
        bv, warps, stages = (state_chain.LONG_TILES if part == "LONG" else
                             (state_chain.BLOCK_V, state_chain.NUM_WARPS, state_chain.NUM_STAGES))
        ok &= compile_one(
            f"gated_delta state chain bf16 Hv{hv} initial states={h0} part {part} empty finals={empty} rows={rows}",
            state_chain._state_chain_kernel,
            {n: "*bf16" for n in ("q_ptr", "k_ptr", "w_ptr", "u_ptr", "o_ptr", "h_ptr", "vn_ptr")} |
            {"g_ptr": "*fp32", "h0_ptr": "*fp32", "ht_ptr": "*fp32"}, "*i64", {"scale": "fp32", "split": "i32"},
            dict(H=16, HV=hv, K=128, V=128, BT=64, BV=bv, USE_H0=h0, PART=getattr(state_chain, part).value,
                 EMPTY_FINALS=empty, INDEXED=False, ROWS=rows),
            {"num_warps": warps, "num_stages": stages})
    # the chunked question call (questions_chunked.py, bf16: the laid-out fork's), plain and nested; beta as the fused
    # conv hands it over (float32) and in bf16
    # (PHASE 0: one launch; 1 / 2: the two launches of stored sub-trunk states, questions_chunked.STORED_SUB_STATES)
    for hv, nested, beta, phase in ((16, False, "*fp32", 0), (16, True, "*fp32", 0), (32, True, "*bf16", 0),
                                    (16, True, "*bf16", 1), (16, True, "*bf16", 2)):
        ok &= compile_one(
            f"gated_delta chunked questions bf16 Hv{hv} nested={nested} beta {beta} phase {phase}",
            questions_chunked._questions_chunked_kernel,
            {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "o_ptr")} |
            {"g_ptr": "*fp32", "h0_ptr": "*fp32", "subs_ptr": "*fp32", "beta_ptr": beta}, "*i64", {"scale": "fp32"},
            dict(H=16, HV=hv, K=128, V=128, BT=64, BV=questions_chunked.BLOCK_V, NESTED=nested, PHASE=phase),
            {"num_warps": questions_chunked.NUM_WARPS, "num_stages": questions_chunked.NUM_STAGES})
    # our kkt + solve step (kkt_solve.py, `fla.OWN_KKT`), 1 and 2 warps
    for hv, warps in ((16, 1), (16, 2), (32, 1)):
        ok &= compile_one(
            f"gated_delta kkt + solve bf16 Hv{hv} {warps} warps", kkt_solve._kkt_solve_kernel,
            {"k_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16", "a_ptr": "*bf16"}, "*i32", {},
            dict(H=16, HV=hv, K=128, BT=64, BC=16, BK=64, PRECISION="tf32"),
            {"num_warps": warps, "num_stages": kkt_solve.NUM_STAGES})
    # the two-level chain (segment_scan.py): the segments' fused chain from start states by index, the transitions,
    # the combine
    for hv in (16, 32):
        ok &= compile_one(
            f"gated_delta segment chain bf16 Hv{hv}", state_chain._state_chain_kernel,
            {n: "*bf16" for n in ("q_ptr", "k_ptr", "w_ptr", "u_ptr", "o_ptr", "h_ptr", "vn_ptr")} |
            {"g_ptr": "*fp32", "h0_ptr": "*fp32", "ht_ptr": "*fp32"}, "*i32", {"scale": "fp32", "split": "i32"},
            dict(H=16, HV=hv, K=128, V=128, BT=64, BV=state_chain.BLOCK_V, USE_H0=False, PART=state_chain.EVERY.value,
                 EMPTY_FINALS=False, INDEXED=True, ROWS=False),
            {"num_warps": state_chain.NUM_WARPS, "num_stages": state_chain.NUM_STAGES})
        bc, warps, stages = segment_scan.TRANSITION_TILES
        ok &= compile_one(
            f"gated_delta segment transitions bf16 Hv{hv}", segment_scan._transition_kernel,
            {n: "*bf16" for n in ("k_ptr", "w_ptr", "u_ptr")} | {"g_ptr": "*fp32", "x_ptr": "*fp32"}, "*i32", {},
            dict(H=16, HV=hv, K=128, V=128, BT=64, BC=bc), {"num_warps": warps, "num_stages": stages})
        bv, warps, stages = segment_scan.COMBINE_TILES
        ok &= compile_one(
            f"gated_delta segment combine Hv{hv}", segment_scan._combine_kernel,
            {"x_ptr": "*fp32", "h0_ptr": "*fp32"}, "*i32", {},
            dict(HV=hv, K=128, V=128, BV=bv, PRECISION=segment_scan.COMBINE_PRECISION),
            {"num_warps": warps, "num_stages": stages})
    for hv in (16, 32):  # the split call's outputs kernel
        bv, warps, stages = state_chain.OUTPUT_TILES
        ok &= compile_one(
            f"gated_delta split call outputs bf16 Hv{hv}", state_chain._chunk_outputs_kernel,
            {n: "*bf16" for n in ("q_ptr", "k_ptr", "vn_ptr", "h_ptr", "o_ptr")} | {"g_ptr": "*fp32"}, "*i64",
            {"scale": "fp32"}, dict(H=16, HV=hv, K=128, V=128, BT=64, BV=bv),
            {"num_warps": warps, "num_stages": stages})
    cfg = linear.default_config(torch.bfloat16)
    ok &= compile_one("linear (invariant GEMM) bf16", linear._linear_kernel,
                      {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16"}, "*bf16", {},
                      dict(HAS_BIAS=False, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PRECISION="tf32"),
                      {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    if nvrtc:
        ok &= compile_cuda_questions(nvrtc)
    print("all compiled" if ok else "some kernels did not compile")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
