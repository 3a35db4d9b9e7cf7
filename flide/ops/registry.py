"""The kernel registry: (op, variant) -> implementation, resolved once when a model is patched, never per call.

Each op family (`flide/ops/<op>/`) registers its variants when its package is imported; `resolve` imports them all
first, so the registry is complete whichever module asked. An unknown op or variant is an error that lists the
valid names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

OP_FAMILIES = ("fork_attention", "gated_delta", "fork_conv", "gated_norm", "readout", "linear", "gated_mlp")

_REGISTRY: dict[tuple[str, str], Callable] = {}
_AVAILABLE: dict[tuple[str, str], Callable[[], str | None]] = {}
_NOT_CAPTURABLE: set[tuple[str, str]] = set()
# variants whose every output row has the same bits whatever else shares the call (batch-invariant mode)
_BATCH_INVARIANT: set[tuple[str, str]] = set()
# (op, variant) -> its checkpointing companion (flide/checkpoints): the same op with resume inputs (prefix keys,
# conv windows, initial recurrent states) and, for gated_delta, the snapshot output
_RESUMABLE: dict[tuple[str, str], Callable] = {}
# ops whose work checkpoints change (readout runs after the mixers and needs nothing)
RESUMABLE_OPS = ("fork_attention", "gated_delta", "fork_conv")
# (op, variant) -> its nested-fork companion (`runtime.nested_forks`): fork_attention's takes each token's sub-trunk
# key range too, (q, k, v, seg_lo, trunk_lo, trunk_hi, sub_lo, sub_hi, scale); gated_delta's is the question call
# that first runs each question's sub-trunk rows from its state's final state (`gated_delta.fork_parts(sub=...)`)
_NESTED: dict[tuple[str, str], Callable] = {}
# ops whose work a sub-trunk changes (the conv reads a leaf's window from its sub-trunk through its trunk range)
NESTED_OPS = ("fork_attention", "gated_delta")


def needs_cuda() -> str | None:
    """An `available` check: None on a machine with a CUDA GPU, else why not."""
    import torch

    return None if torch.cuda.is_available() else "it needs a CUDA GPU"


def needs_cuda_triton() -> str | None:
    """An `available` check for our Triton kernels: a CUDA GPU and the triton package."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "it needs the triton package"
    return needs_cuda()


def register(op: str, variant: str, available: Callable[[], str | None] | None = None, capturable: bool = True,
             batch_invariant: bool = False):
    """Decorator: registers `fn` as `variant` of `op`. `available()` returns None, or why the variant can't run here.
    `capturable=False`: the variant syncs with the host or sizes its launches from the data, so it cannot run inside
    a CUDA graph (the flat-graph runner refuses it). `batch_invariant=True`: every output row's bits depend only on
    its own request's rows (its segment, its trunk), never on the stream's length or on where the request sits in
    it; batch-invariant mode (`kernels.batch_invariant`) accepts only such variants."""
    if op not in OP_FAMILIES:
        raise ValueError(f"Unknown op {op!r}; ops: {', '.join(OP_FAMILIES)}.")

    def wrap(fn: Callable) -> Callable:
        key = (op, variant)
        if key in _REGISTRY and _REGISTRY[key] is not fn:
            raise ValueError(f"Variant {variant!r} of op {op!r} is already registered.")
        _REGISTRY[key] = fn
        if available is not None:
            _AVAILABLE[key] = available
        if not capturable:
            _NOT_CAPTURABLE.add(key)
        if batch_invariant:
            _BATCH_INVARIANT.add(key)
        return fn

    return wrap


def _load_all() -> None:
    for op in OP_FAMILIES:
        importlib.import_module(f"flide.ops.{op}")


def variants(op: str) -> list[str]:
    """The registered variants of `op`, sorted."""
    _load_all()
    if op not in OP_FAMILIES:
        raise ValueError(f"Unknown op {op!r}; ops: {', '.join(OP_FAMILIES)}.")
    return sorted(variant for (name, variant) in _REGISTRY if name == op)


def resolve(op: str, variant: str) -> Callable:
    """The implementation of `variant` of `op`; raises ValueError listing the valid variants."""
    names = variants(op)
    key = (op, variant)
    if key not in _REGISTRY:
        raise ValueError(f"Unknown variant {variant!r} for op {op!r} (config `kernels.{op}`); "
                         f"valid variants: {', '.join(names)}.")
    reason = _AVAILABLE.get(key, lambda: None)()
    if reason is not None:
        raise ValueError(f"Variant {variant!r} of op {op!r} cannot run here: {reason}.")
    return _REGISTRY[key]


# `auto`: the first of these variants that is registered and can run, by device type (else `reference`)
AUTO = {
    # our Triton kernel before flex: on the H200 (2026-11-30, random Qwen3.5-0.8B, bf16, graphs, one request alone)
    # its attention took 2.98 ms of a QuALITY replay (8k tokens) where flex took 5.70, and the same or less on RACE,
    # MultiRC and the sweep; flex also compiles once per stream size class (the 16,384 bucket stalled capture for
    # > 3 min), where the Triton kernel compiled once captured all 8 default buckets in 49 s.
    # Its batch-invariant form first (key tiles start at each row's trunk and fork, not at absolute stream positions):
    # on the H200 (2026-11-30, 0.8B, bf16, final norm x12) it took the default mode's Stab. from 95.7 / 98.4 / 100 %
    # to 100 / 100 / 100 % (RACE / MultiRC / QuALITY; TV 3.10 -> 3.00 points on RACE) for 1-2 % of RACE's speed
    # (504.6 -> 498.7 req/s at 64 submitters, latency alone 7.07 -> 7.21 ms): where a request sits in the stream no
    # longer changes its bits (results/h200_fidelity_0_8b.md, h200_qwen3_5_0_8b.md)
    "fork_attention": {"cuda": ("triton_invariant", "triton", "flex", "reference")},
    "gated_delta": {"cuda": ("fla", "reference")},
    # the Triton conv: one launch for the whole stream (the reference gathers windows in several ops); its GPU
    # tests (tests/gpu/test_fork_conv_gpu.py, 32 cases vs the reference) pass on the H200 (2026-11-30)
    "fork_conv": {"cuda": ("triton", "reference")},
    # the Triton kernel: it reads each row once from the gated delta call that wrote it, where Inductor's fusion of
    # the select and the model's norm module loads both calls' rows: on the H200 (2026-12-01, 0.8B, bf16, one call)
    # 28 vs 81 us a layer on QuALITY, replay GPU time 31.7 vs 32.7 ms, sweep 64 38.9 vs 40.1, RACE 3.37 vs 3.42
    # (results/h200_profile_0_8b_gated_norm_ab_*.json; every GPU test file passed with it as the default)
    "gated_norm": {"cuda": ("triton", "torch")},
    "readout": {},
    "linear": {},  # `torch`: the model's own nn.Linear modules stay (no swap)
    # `torch` (the model's modules: cuBLAS gate/up GEMM + Inductor's fused SiLU-mul): `triton` (the SiLU-mul in the
    # GEMM's epilogue) took 1.04-1.06x its time at 2,304-8,192 rows of 0.8B, 1.17x on 4B (H100, session 41; replay
    # A/B: `configs/h200/gated_mlp_triton.yaml`)
    "gated_mlp": {},
}

# `auto` in batch-invariant mode: the first batch-invariant variant that can run, by device type (see `AUTO`)
AUTO_INVARIANT = {
    "fork_attention": {"cuda": ("triton_invariant",), "cpu": ("segments",)},
    "gated_delta": {"cuda": ("fla",), "cpu": ("reference",)},
    # the reference conv sums its W taps with an einsum, i.e. a batched GEMM whose cuBLAS kernel is picked by the
    # stream's length: the likely cause of the fp32 bit changes seen on the H200 in this mode (2026-11-30; bf16
    # rounded them away). The Triton conv sums the taps in one fixed order per token, whatever the length; so does
    # the reference now (elementwise, tap by tap), the fallback where Triton cannot run.
    "fork_conv": {"cuda": ("triton", "reference"), "cpu": ("reference",)},
    "gated_norm": {"cuda": ("triton", "torch"), "cpu": ("torch",)},
    "readout": {"cuda": ("invariant",), "cpu": ("invariant",)},
    "linear": {"cuda": ("triton",), "cpu": ("blocked",)},
    "gated_mlp": {"cuda": ("torch",), "cpu": ("torch",)},  # the invariant linear layers' modules
}
# what `auto` falls back to when no device-specific pick can run: the references (readout: selective; linear: the
# model's own layers)
FALLBACK = {"fork_attention": "reference", "gated_delta": "reference", "fork_conv": "reference",
            "gated_norm": "torch", "readout": "selective", "linear": "torch", "gated_mlp": "torch"}


def _runs_here(key: tuple[str, str]) -> bool:
    return key in _REGISTRY and _AVAILABLE.get(key, lambda: None)() is None


def concrete(kernels, device: str = "cpu"):
    """The `KernelConfig` with every `auto` replaced by the variant it picks on `device` (a device type or
    torch.device): the fastest registered variant that can run there, the reference ones on the CPU. With
    `kernels.batch_invariant` the picks come from `AUTO_INVARIANT`, and a variant named explicitly must be
    batch-invariant (ValueError naming the `kernels.<op>` field otherwise)."""
    import dataclasses

    _load_all()
    device_type = getattr(device, "type", str(device).split(":")[0])
    invariant = getattr(kernels, "batch_invariant", False)
    picked = {}
    for op in OP_FAMILIES:
        chosen = getattr(kernels, op)
        if chosen == "auto":
            table = AUTO_INVARIANT if invariant else AUTO
            candidates = table[op].get(device_type, ()) + (() if invariant else (FALLBACK[op],))
            found = next((v for v in candidates if _runs_here((op, v))), None)
            if found is None:
                raise ValueError(f"`kernels.batch_invariant: true` has no batch-invariant `{op}` variant for "
                                 f"{device_type} (candidates: {', '.join(candidates) or 'none'}); name one in "
                                 f"`kernels.{op}` or turn batch invariance off.")
            picked[op] = chosen = found
        if invariant and (op, chosen) in _REGISTRY and (op, chosen) not in _BATCH_INVARIANT:
            raise ValueError(f"`kernels.{op}: {chosen}` is not batch-invariant, and `kernels.batch_invariant` is "
                             f"true; batch-invariant variants of {op}: {', '.join(batch_invariant_variants(op))}.")
    return dataclasses.replace(kernels, **picked)


def batch_invariant_variants(op: str) -> list[str]:
    """The registered batch-invariant variants of `op`, sorted."""
    _load_all()
    return sorted(v for (name, v) in _BATCH_INVARIANT if name == op)


def resolve_all(kernels, device: str = "cpu") -> dict[str, Callable]:
    """Resolves every op of a `KernelConfig` at once (`auto` as `concrete` picks it on `device`): {op: implementation}."""
    kernels = concrete(kernels, device)
    return {op: resolve(op, getattr(kernels, op)) for op in OP_FAMILIES}


def not_capturable(kernels) -> list[str]:
    """The `kernels.<op>: <variant>` choices of a `KernelConfig` that cannot run inside a CUDA graph."""
    _load_all()
    kernels = concrete(kernels)
    return [f"kernels.{op}: {getattr(kernels, op)}" for op in OP_FAMILIES
            if (op, getattr(kernels, op)) in _NOT_CAPTURABLE]


def register_resumable(op: str, variant: str):
    """Decorator: registers `fn` as the checkpointing companion of `variant` of `op` (see `resumable`)."""
    def wrap(fn: Callable) -> Callable:
        _RESUMABLE[(op, variant)] = fn
        return fn

    return wrap


def resumable(kernels, device: str = "cpu") -> dict[str, Callable]:
    """{op: checkpointing companion} of the variants a `KernelConfig` picks on `device`; ValueError naming every
    `kernels.<op>: <variant>` that has none (every registered mixer variant has one today)."""
    ops, missing = _companions(_RESUMABLE, RESUMABLE_OPS, kernels, device)
    if missing:
        raise ValueError(f"checkpoints need kernel variants that can resume and snapshot; these cannot: "
                         f"{', '.join(missing)} (use `reference`).")
    return ops


def _companions(table: dict, ops: tuple[str, ...], kernels, device) -> tuple[dict[str, Callable] | None, list[str]]:
    """({op: its companion in `table`} for the variants a `KernelConfig` picks on `device`, or None, and the
    `kernels.<op>: <variant>` choices that have none)."""
    _load_all()
    kernels = concrete(kernels, device)
    missing = [f"kernels.{op}: {getattr(kernels, op)}" for op in ops if (op, getattr(kernels, op)) not in table]
    if missing:
        return None, missing
    return {op: table[(op, getattr(kernels, op))] for op in ops}, []


def register_nested(op: str, variant: str):
    """Decorator: registers `fn` as the nested-fork companion of `variant` of `op` (see `_NESTED`)."""
    if op not in NESTED_OPS:
        raise ValueError(f"Op {op!r} has no nested-fork companion; ops that do: {', '.join(NESTED_OPS)}.")

    def wrap(fn: Callable) -> Callable:
        _NESTED[(op, variant)] = fn
        return fn

    return wrap


def nested(kernels, device: str = "cpu") -> tuple[dict[str, Callable] | None, list[str]]:
    """({op: nested-fork companion} of the variants a `KernelConfig` picks on `device`, or None, and the
    `kernels.<op>: <variant>` choices that have none (why nested forks cannot run with these kernels))."""
    return _companions(_NESTED, NESTED_OPS, kernels, device)
