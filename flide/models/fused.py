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
Used only with the model's own linear layers (`kernels.linear: torch`); batch-invariant mode runs each projection
through its invariant op instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fuse(owner: nn.Module, linears: list[nn.Linear], name: str) -> list[int] | None:
    """Gives `owner` a buffer `<name>_weight` (and `<name>_bias`) holding the weights of `linears` stacked by rows,
    the linears' parameters re-pointed to views of it; returns the output sizes, or None (nothing changed) when the
    layers cannot share one GEMM (not all plain nn.Linear, other inputs, dtypes or devices, bias on some only)."""
    if len(linears) < 2 or not all(type(layer) is nn.Linear for layer in linears):
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
    patched the model before) a storage of its own. For the modes that run each projection by itself (batch-invariant
    mode): a compile region's inputs must not alias one another, and torch.compile refuses the views otherwise (seen on
    the H200 when `flide:batch-invariant` was built after `flide` on one model). The earlier engine keeps its buffer."""
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
    out = F.linear(x, getattr(owner, f"{name}_weight"), getattr(owner, f"{name}_bias"))
    return list(out.split(sizes, dim=-1))
