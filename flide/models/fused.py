"""Projections of one input run as one GEMM: a layer's q/k/v, a Gated DeltaNet's four input projections, an MLP's
gate and up.

A replay of the flat graph launches a few hundred kernels; at the stream lengths of one request (hundreds of tokens)
each GEMM is a few microseconds and Qwen3.5's `in_proj_b` / `in_proj_a` (16 outputs each) are almost pure launch
latency. Fusing them removes ~90 GEMMs a replay on Qwen3.5-0.8B (3 per Gated DeltaNet layer, 2 per attention
layer, 1 per MLP), the way serving engines merge QKV and gate/up projections.

Memory is not doubled: the fused weight is the storage, and each original `nn.Linear`'s weight (and bias) becomes a
view of its rows, so the model's parameters, state_dict keys and values, and its plain transformers forward are
unchanged. The fused tensor is a non-persistent buffer of the Flide module that holds it (absent from state_dict):
`model.to(...)` converts it with the parameters (they stop being views then, and both hold the same values).
With the model's own linear layers (`kernels.linear: torch`) the fused GEMM is `F.linear`; in batch-invariant mode
(the projections are `FlideLinear`s of one invariant op) it is that op over the stacked weight, whose sums do not
depend on N: every projection keeps the bits it has alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fuse(owner: nn.Module, linears: list[nn.Linear], name: str) -> list[int] | None:
    """Gives `owner` a buffer `<name>_weight` (and `<name>_bias`) holding the weights of `linears` stacked by rows,
    the linears' parameters re-pointed to views of it; returns the output sizes, or None (nothing changed) when the
    layers cannot share one GEMM (not all plain nn.Linear, other inputs, dtypes or devices, bias on some only)."""
    from .layers import FlideLinear  # (layers.py imports this module)

    if len(linears) < 2:
        return None
    # all the model's own layers, or all run through one op (batch-invariant mode's FlideLinear: its kernels sum
    # each output element over K in an order that depends on neither M nor N, so one GEMM over the stacked weight
    # gives every projection the bits it gets alone)
    if not (all(type(layer) is nn.Linear for layer in linears)
            or all(type(layer) is FlideLinear and layer.op is linears[0].op for layer in linears)):
        return None
    first = linears[0].weight
    if any(layer.in_features != linears[0].in_features or layer.weight.dtype != first.dtype
           or layer.weight.device != first.device for layer in linears):
        return None
    with_bias = [layer.bias is not None for layer in linears]
    if any(with_bias) and not all(with_bias):
        return None
    sizes = [layer.out_features for layer in linears]
    with torch.no_grad():
        weight = torch.cat([layer.weight.detach() for layer in linears])
        for layer, part in zip(linears, weight.split(sizes)):
            layer.weight.data = part
        owner.register_buffer(f"{name}_weight", weight, persistent=False)
        bias = None
        if all(with_bias):
            bias = torch.cat([layer.bias.detach() for layer in linears])
            for layer, part in zip(linears, bias.split(sizes)):
                layer.bias.data = part
        owner.register_buffer(f"{name}_bias", bias, persistent=False)
    return sizes


def separate(module: nn.Module) -> None:
    """Gives every `nn.Linear` under `module` whose weight or bias is a view (of the fused buffer of an engine that
    patched the model before) a storage of its own, before batch-invariant mode swaps in its `FlideLinear`s: a compile
    region's inputs must not alias one another, and torch.compile refused such views when a layer ran by itself (seen
    on the H200 when `flide:batch-invariant` was built after `flide` on one model, before this mode fused its
    projections too). The earlier engine keeps its buffer."""
    with torch.no_grad():
        for layer in module.modules():
            if type(layer) is nn.Linear:
                for tensor in (layer.weight, layer.bias):
                    # a view of a larger buffer (`.data` re-pointed by `fuse`: no autograd view to ask `_base`)
                    if tensor is None:
                        continue
                    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
                        tensor.data = tensor.detach().clone()


def project(owner: nn.Module, name: str, sizes: list[int] | None, linears: list[nn.Module],
            x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of `linears` for `x`: one GEMM through the fused buffer when `sizes` (from `fuse`), else each
    layer's own call."""
    if sizes is None:
        return [layer(x) for layer in linears]
    weight, bias = getattr(owner, f"{name}_weight"), getattr(owner, f"{name}_bias")
    if type(linears[0]) is nn.Linear:
        out = F.linear(x, weight, bias)
    else:  # FlideLinear (batch-invariant mode): its op over the stacked weight
        out = linears[0].op(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return list(out.split(sizes, dim=-1))
