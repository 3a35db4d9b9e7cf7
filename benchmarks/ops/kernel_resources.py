"""Registers, spills and shared memory of Flide's Triton kernels on sm_90 (H100/H200), without a GPU: the conv, the
fast fork attention and the batch-invariant one (the CUDA default).

    python benchmarks/ops/kernel_resources.py                      # the default tiles of every shape the tests use
    python benchmarks/ops/kernel_resources.py --attention 128,32,8,3  # one bf16 dim-256 attention tile config
    python benchmarks/ops/kernel_resources.py --conv-maxnreg 128 96   # the bf16 conv under register caps
    python benchmarks/ops/kernel_resources.py --questions 200         # the question kernel: own cap, none, 200
    python benchmarks/ops/kernel_resources.py --state-chain           # the state call's fused h + o kernel, per tile
    python benchmarks/ops/kernel_resources.py --chunked-questions     # the chunked question kernel and the w / u step

Compiles each kernel ahead of time for a CUDA target (triton.compile on an ASTSource, the pointers and strides
marked 16-divisible as the JIT would mark them: without that hint loads are not vectorised nor pipelined and the
counts mean nothing), then runs the ptxas bundled with triton with -v on the PTX. A tile config that spills a few
hundred bytes a thread is worth timing; one that spills kilobytes is not. Timing still needs the device
(bench_fork_attention.py --sweep).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGET_ARCH = 90


def _compile(fn, signature: dict[str, str], constants: dict[str, object], num_warps: int, num_stages: int,
             maxnreg: int | None = None, div16_ints: tuple[str, ...] = ()):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    div16 = [n for n, t in signature.items()
             if t.startswith("*") or (t == "i32" and (n.startswith("stride") or n in div16_ints))]
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16})
    return triton.compile(src, target=GPUTarget("cuda", TARGET_ARCH, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def resources(kernel) -> str:
    """'regs R, spills S/L bytes, smem M KB' from ptxas -v on the kernel's PTX."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())  # the newer PTX ISA
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        log = subprocess.run([str(ptxas), f"-arch=sm_{TARGET_ARCH}a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", log).group(1)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (f"regs {regs:>3}, spills {spills.group(1)}/{spills.group(2)} bytes, "
            f"smem {kernel.metadata.shared // 1024} KB")


def attention(dtype: str, head_dim: int, group: int, config) -> str:
    import triton

    from flide.ops.fork_attention import triton as fa

    ptr = f"*{dtype}"
    # a round's tables are int32 (flide/round.py); without stats the launcher passes seg_lo as the stats pointer
    sig = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "o_ptr": ptr, "seg_lo_ptr": "*i32", "trunk_lo_ptr": "*i32",
           "trunk_hi_ptr": "*i32", "stats_ptr": "*i32", "T": "i32", "qk_scale": "fp32"}
    sig.update({f"stride_{n}": "i32" for n in ("qt", "qh", "kt", "kh", "vt", "vh", "ot", "oh")})
    block_d = max(16, triton.next_power_of_2(head_dim))
    consts = {"GROUP": group, "HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim, "BLOCK_M": config.block_m,
              "BLOCK_N": config.block_n, "BLOCK_D": block_d, "BLOCK_DV": block_d,
              "PRECISION": "ieee" if dtype == "fp32" else "tf32", "STATS": False}
    sig.update({n: "constexpr" for n in consts})
    return resources(_compile(fa._fork_attention_kernel, sig, consts, config.num_warps, config.num_stages))


def invariant_attention(dtype: str, head_dim: int, group: int, config, sub: bool = False, v_parts: int = 1,
                        lean: bool | None = None) -> str:
    """The batch-invariant fork attention (the CUDA default; fresh rounds: no checkpoint prefix; `sub`: with the
    nested forks' sub-trunk phase; `v_parts`: programs sharing a head's value columns, `triton_invariant.V_PARTS`;
    `lean`: the lean tiles, default `triton_invariant.LEAN_TILES`)."""
    import triton

    from flide.ops.fork_attention import triton_invariant as fi

    lean = fi.LEAN_TILES if lean is None else lean
    ptr = f"*{dtype}"
    # a round's tables are int32 (flide/round.py); without a prefix the launcher passes seg_lo as pre_lo / pre_hi
    sig = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "o_ptr": ptr, "seg_lo_ptr": "*i32", "trunk_lo_ptr": "*i32",
           "trunk_hi_ptr": "*i32", "stats_ptr": "*i32", "pk_ptr": ptr, "pv_ptr": ptr, "pre_lo_ptr": "*i32",
           "pre_hi_ptr": "*i32", "sub_lo_ptr": "*i32", "sub_hi_ptr": "*i32", "T": "i32", "qk_scale": "fp32"}
    sig.update({f"stride_{n}": "i32" for n in ("qt", "qh", "kt", "kh", "vt", "vh", "ot", "oh", "pkt", "pkh", "pvt",
                                               "pvh")})
    block_d = max(16, triton.next_power_of_2(head_dim))
    consts = {"GROUP": group, "HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim, "BLOCK_M": config.block_m,
              "BLOCK_N": config.block_n, "BLOCK_D": block_d, "BLOCK_DV": block_d // v_parts,
              "PRECISION": "ieee" if dtype == "fp32" else "tf32", "STATS": False, "HAS_PREFIX": False,
              "HAS_SUB": sub, "V_PARTS": v_parts, "LEAN": lean}
    sig.update({n: "constexpr" for n in consts})
    return resources(_compile(fi._fork_attention_invariant_kernel, sig, consts, config.num_warps, config.num_stages))


def conv(dtype: str, split: bool = False, heads_v: int = 16, maxnreg: int | None = None) -> str:
    """The fork conv as `fork_conv` launches it (split False) or as `fork_conv_qkv` does for the replay's laid-out
    GDN layers (q / k normalised, v, and the gates from the same launch; 128-channel heads, `heads_v` value heads)."""
    import triton

    from flide.ops.fork_conv import triton as fc

    ptr = f"*{dtype}"
    # a round's tables are int32 (flide/round.py); without windows the launcher passes seg_lo as win_index
    sig = {"x_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "seg_lo_ptr": "*i32", "trunk_lo_ptr": "*i32",
           "trunk_hi_ptr": "*i32", "win_ptr": ptr, "win_index_ptr": "*i32", "T": "i32", "D": "i32",
           "stride_xt": "i32", "stride_xd": "i32", "stride_wd": "i32", "stride_ww": "i32", "stride_ot": "i32",
           "stride_od": "i32", "stride_win_r": "i32", "stride_win_d": "i32", "k_ptr": ptr, "v_ptr": ptr,
           "KEY_COLS": "i32", "a_ptr": ptr, "b_ptr": ptr, "alog_ptr": ptr, "dt_ptr": ptr, "g_ptr": "*fp32",
           "beta_ptr": ptr, "stride_at": "i32", "stride_bt": "i32", "HV": "i32"}
    # unit strides are specialised to constants by the JIT; the checkpoint-window path (HAS_WINDOW) is compiled out,
    # as in fresh rounds
    consts = {"stride_xd": 1, "stride_ww": 1, "stride_win_d": 1, "W": 4, "SILU": True, "BLOCK_T": fc.BLOCK_T,
              "HAS_WINDOW": False, "EPS": fc.EPS, "LIBDEVICE": True, "CHANNELS_FASTEST": fc.CHANNELS_FASTEST}
    if split:
        consts |= {"BLOCK_D": 128, "SPLIT": True, "NORM": True, "GATES": True,
                   "BLOCK_H": triton.next_power_of_2(heads_v)}
    else:
        consts |= {"stride_od": 1, "BLOCK_D": fc.BLOCK_D, "SPLIT": False, "NORM": False, "GATES": False,
                   "BLOCK_H": 1}
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fc._fork_conv_kernel.arg_names}  # the kernel's argument order (`_compile` indexes it)
    # a replay's T (a bucket), D, KEY_COLS and HV are multiples of 16, which the JIT marks as it marks the strides:
    # without that hint the masks along the channels (d < D) are not known constant over 8 lanes and the loads and
    # stores are not vectorised (96 registers and 2-byte loads instead of 70 and 16-byte ones, Triton 3.9)
    return resources(_compile(fc._fork_conv_kernel, sig, consts, fc.NUM_WARPS, 1, maxnreg,
                              div16_ints=("T", "D", "KEY_COLS", "HV")))


def questions(dtype: str, heads_v: int, block_v: int, nested: bool, stored: bool, maxnreg: int | None = None) -> str:
    """The recurrent question kernel (`gated_delta.branches`) as a replay launches it: 128-channel heads, `heads_v`
    value heads, `block_v` value columns a program, one warp; `nested`: with the sub-trunk phase, as the split call's
    nested launch runs it (its row programs, `questions_chunked.NESTED_ROW_PROGRAMS`); `stored`: leaves from the
    stored sub-trunk states (`sub_slot`). `maxnreg` None: the kernel's own cap (`MAX_REGISTERS`); 0: none."""
    from flide.ops.gated_delta import branches as br
    from flide.ops.gated_delta import questions_chunked as qc

    ptr = f"*{dtype}"
    # the rows' tables are int64 (the round's flat tensors); sub_lo / sub_hi / sub_slot int32; without NESTED the
    # launcher passes seg_start as sub_lo / sub_hi, without SUB_STATES sub_lo as sub_slot and flags and h0 as subs
    rows = "*i32" if nested else "*i64"
    sig = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "g_ptr": "*fp32", "beta_ptr": ptr, "o_ptr": ptr,
           "h0_ptr": "*fp32", "start_ptr": "*i64", "len_ptr": "*i64", "index_ptr": "*i64", "scale": "fp32",
           "ht_ptr": "*fp32", "snap_at_ptr": "*i64", "hs_ptr": "*fp32", "sub_lo_ptr": rows, "sub_hi_ptr": rows,
           "sub_slot_ptr": rows, "subs_ptr": "*fp32", "flags_ptr": rows, "max_spins": "i32", "reruns_ptr": rows,
           "N": "i32"}
    # Qwen3.5's 16 key heads at every size
    consts = {"HK": 16, "HV": heads_v, "K": 128, "V": 128, "BK": 128, "BV": block_v, "L2NORM": True,
              "STORE_FINAL": False, "SNAPSHOT": False,
              "ROW_PROGRAMS": qc.NESTED_ROW_PROGRAMS if nested else br.ROW_PROGRAMS, "NESTED": nested,
              "SUB_STATES": stored, "COUNT_RERUNS": False}
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in br._branch_kernel.arg_names}
    cap = br.MAX_REGISTERS.get(block_v) if maxnreg is None else maxnreg or None
    # a bucket's N (tokens / 16) and MAX_SPINS are multiples of 16: the JIT marks them so
    return resources(_compile(br._branch_kernel, sig, consts, br.NUM_WARPS, br.NUM_STAGES, cap,
                              div16_ints=("N", "max_spins")))


def state_chain(heads_v: int, tiles: tuple[int, int, int], part: int = 0) -> str:
    """The state call's chain kernel (`gated_delta.state_chain`) on bf16 inputs: 16 key heads of 128, `heads_v` value
    heads, tiles (value columns, warps, stages), `part` EVERY (0: the fused h + o chain) or LONG (2: the chain that
    stores fla's h and v_new), from zero states, a program per sequence."""
    from flide.ops.gated_delta import state_chain as sc

    ptr = "*bf16"
    sig = {"q_ptr": ptr, "k_ptr": ptr, "w_ptr": ptr, "u_ptr": ptr, "g_ptr": "*fp32", "o_ptr": ptr, "h0_ptr": "*fp32",
           "ht_ptr": "*fp32", "cu_ptr": "*i64", "h_ptr": ptr, "vn_ptr": ptr, "rows_ptr": "*i64",
           "h0_row_ptr": "*i64", "final_row_ptr": "*i64", "scale": "fp32", "T": "i32", "split": "i32", "N": "i32",
           "P": "i32"}
    consts = {"H": 16, "HV": heads_v, "K": 128, "V": 128, "BT": 64, "BV": tiles[0], "USE_H0": False, "PART": part,
              "EMPTY_FINALS": False, "INDEXED": False, "ROWS": False}
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in sc._state_chain_kernel.arg_names}
    return resources(_compile(sc._state_chain_kernel, sig, consts, tiles[1], tiles[2]))


def chunked_questions(dtype: str, heads_v: int, tiles: tuple[int, int, int], nested: bool, phase: int = 0) -> str:
    """The chunked question kernel (`gated_delta.questions_chunked`): 16 key heads of 128, `heads_v` value heads,
    tiles (value columns, warps, stages), beta as the fused conv hands it over (the inputs' dtype)."""
    from flide.ops.gated_delta import questions_chunked as qc

    ptr = f"*{dtype}"
    sig = {n: ptr for n in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "o_ptr", "beta_ptr")}
    sig |= {"g_ptr": "*fp32", "h0_ptr": "*fp32", "start_ptr": "*i64", "len_ptr": "*i64", "from_ptr": "*i64",
            "sub_lo_ptr": "*i32", "sub_hi_ptr": "*i32", "slot_ptr": "*i32", "subs_ptr": "*fp32", "scale": "fp32",
            "N": "i32", "P": "i32"}
    consts = {"H": 16, "HV": heads_v, "K": 128, "V": 128, "BT": 64, "BV": tiles[0], "NESTED": nested,
              "PHASE": phase}
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in qc._questions_chunked_kernel.arg_names}
    return resources(_compile(qc._questions_chunked_kernel, sig, consts, tiles[1], tiles[2]))


def w_u(heads_v: int) -> str:
    """The w / u step with spare rows returning at once (`gated_delta.wy_form`), bf16, at its launch config."""
    from flide.ops.gated_delta import wy_form as wf

    sig = {n: "*bf16" for n in ("k_ptr", "v_ptr", "beta_ptr", "a_ptr", "w_ptr", "u_ptr")}
    sig |= {"g_ptr": "*fp32", "cu_ptr": "*i64", "chunks_ptr": "*i64", "T": "i32"}
    consts = {"H": 16, "HV": heads_v, "K": 128, "V": 128, "BT": 64, "BK": wf.BLOCK, "BV": wf.BLOCK}
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in wf._w_u_kernel.arg_names}
    return resources(_compile(wf._w_u_kernel, sig, consts, wf.NUM_WARPS, 3 if heads_v <= 16 else 2))


def main() -> None:
    import torch

    from flide.ops.fork_attention import triton as fa

    parser = argparse.ArgumentParser()
    parser.add_argument("--attention", help="BLOCK_M,BLOCK_N,num_warps,num_stages: one bf16 dim-256 GQA-4 config")
    parser.add_argument("--conv-maxnreg", type=int, nargs="+",
                        help="the bf16 conv (both launches) under these register caps (ptxas's `maxnreg`)")
    parser.add_argument("--questions", type=int, nargs="*", metavar="MAXNREG",
                        help="only the bf16 question kernel (plain / nested / stored sub-states, 16 and 32 value "
                             "columns): at its own cap (MAX_REGISTERS), none, and these caps")
    parser.add_argument("--state-chain", action="store_true",
                        help="only the state call's fused h + o kernel, bf16, at 16 and 32 value heads, per tile")
    parser.add_argument("--chunked-questions", action="store_true",
                        help="only the chunked question kernel (bf16 per tile, plain and nested; fp32 at its one "
                             "stage) and the w / u step")
    args = parser.parse_args()
    if args.chunked_questions:
        from flide.ops.gated_delta import questions_chunked as qc

        default = (qc.BLOCK_V, qc.NUM_WARPS, qc.NUM_STAGES)
        for heads_v in (16, 32):
            for tiles in (default, qc.NARROW_TILES, (16, 4, 2), (32, 4, 1), (64, 8, 2)):
                for nested in (False, True):
                    print(f"chunked questions bf16 Hv{heads_v} BV{tiles[0]} w{tiles[1]} s{tiles[2]} "
                          f"{'nested' if nested else 'plain'}: {chunked_questions('bf16', heads_v, tiles, nested)}",
                          flush=True)
            for phase in (1, 2):  # the two launches of stored sub-trunk states
                print(f"chunked questions bf16 Hv{heads_v} default tiles nested, stored sub-trunk states, launch "
                      f"{phase}: {chunked_questions('bf16', heads_v, default, True, phase)}", flush=True)
            print(f"chunked questions fp32 Hv{heads_v} BV{qc.BLOCK_V} w{qc.NUM_WARPS} s1 nested: "
                  f"{chunked_questions('fp32', heads_v, (qc.BLOCK_V, qc.NUM_WARPS, 1), True)}", flush=True)
            print(f"w / u step bf16 Hv{heads_v}: {w_u(heads_v)}", flush=True)
        return
    if args.state_chain:
        from flide.ops.gated_delta import state_chain as sc

        for heads_v in (16, 32):
            for tiles in ((sc.BLOCK_V, sc.NUM_WARPS, sc.NUM_STAGES), (32, 4, 3), (16, 4, 2), (64, 4, 2)):
                print(f"state chain bf16 Hv{heads_v} BV{tiles[0]} w{tiles[1]} s{tiles[2]}: "
                      f"{state_chain(heads_v, tiles)}", flush=True)
            print(f"state chain bf16 Hv{heads_v} LONG part {sc.LONG_TILES}: "
                  f"{state_chain(heads_v, sc.LONG_TILES, part=2)}", flush=True)
        return
    if args.questions is not None:
        for heads_v, block_v in ((16, 16), (32, 32)):
            for cap in (None, 0, *args.questions):
                for nested, stored in ((False, False), (True, False), (True, True)):
                    form = "stored" if stored else "nested" if nested else "plain"
                    label = "own cap" if cap is None else "no cap" if cap == 0 else f"maxnreg {cap}"
                    print(f"questions bf16 Hv{heads_v} BV{block_v} {form:6s} {label:12s}: "
                          f"{questions('bf16', heads_v, block_v, nested, stored, cap)}",
                          flush=True)
        return
    if args.conv_maxnreg:
        for cap in args.conv_maxnreg:
            for split in (False, True):
                print(f"fork_conv{'_qkv' if split else ''} bf16 maxnreg {cap}: {conv('bf16', split, maxnreg=cap)}")
        return
    if args.attention:
        config = fa.Config(*map(int, args.attention.split(",")))
        print(f"attention bf16 D256 group 4 {config}: {attention('bf16', 256, 4, config)}")
        return
    from flide.ops.fork_conv import triton as fc

    for dtype in ("bf16", "fp32"):
        print(f"fork_conv {dtype} W4 {fc.BLOCK_T}x{fc.BLOCK_D} tiles: {conv(dtype)}", flush=True)
        print(f"fork_conv_qkv {dtype} W4 {fc.BLOCK_T}x128 tiles, 16 value heads: {conv(dtype, True)}", flush=True)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for dtype in ("bf16", "fp32"):
        for hq, hkv, d in [(8, 2, 256), (8, 8, 128), (14, 2, 128), (4, 2, 16)]:
            config = fa.default_config(d, torch_dtype[dtype])
            print(f"fork_attention {dtype} Hq{hq}/Hkv{hkv} D{d} {config}: {attention(dtype, d, hq // hkv, config)}",
                  flush=True)
    from flide.ops.fork_attention import triton_invariant as fi

    for dtype in ("bf16", "fp32"):
        for hq, hkv, d in [(8, 2, 256), (16, 4, 256)]:
            config = fi.default_config(d, torch_dtype[dtype])
            for sub in (False, True):
                print(f"fork_attention (invariant{', sub-trunks' if sub else ''}) {dtype} Hq{hq}/Hkv{hkv} D{d} "
                      f"{config}: {invariant_attention(dtype, d, hq // hkv, config, sub)}", flush=True)
            if dtype == "bf16":  # the value columns in two programs (`triton_invariant.V_SPLIT_DIM`)
                print(f"fork_attention (invariant, 2 value parts) {dtype} Hq{hq}/Hkv{hkv} D{d} {config}: "
                      f"{invariant_attention(dtype, d, hq // hkv, config, v_parts=2)}", flush=True)


if __name__ == "__main__":
    main()
