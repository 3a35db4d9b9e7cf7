"""The kernel registry: (op, variant) -> implementation, resolved once when a model is patched, never per call.

Each op family (`flide/ops/<op>/`) registers its variants when its package is imported; `resolve` imports them all
first, so the registry is complete whichever module asked. An unknown op or variant is an error that lists the
valid names.
"""

from __future__ import annotations

import importlib
from typing import Callable

OP_FAMILIES = ("fork_attention", "gated_delta", "fork_conv", "readout")

_REGISTRY: dict[tuple[str, str], Callable] = {}
_AVAILABLE: dict[tuple[str, str], Callable[[], str | None]] = {}


def register(op: str, variant: str, available: Callable[[], str | None] | None = None):
    """Decorator: registers `fn` as `variant` of `op`. `available()` returns None, or why the variant can't run here."""
    if op not in OP_FAMILIES:
        raise ValueError(f"Unknown op {op!r}; ops: {', '.join(OP_FAMILIES)}.")

    def wrap(fn: Callable) -> Callable:
        key = (op, variant)
        if key in _REGISTRY and _REGISTRY[key] is not fn:
            raise ValueError(f"Variant {variant!r} of op {op!r} is already registered.")
        _REGISTRY[key] = fn
        if available is not None:
            _AVAILABLE[key] = available
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


def resolve_all(kernels) -> dict[str, Callable]:
    """Resolves every op of a `KernelConfig` at once: {op: implementation}."""
    return {op: resolve(op, getattr(kernels, op)) for op in OP_FAMILIES}
