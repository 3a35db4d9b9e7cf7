"""Readout: the scores of each question's options, read from the head's rows at the readout rows only.

A causal LM scores option j of a question by the logit of its label token; a decision head (Jev) by row
`offset[type] + j` of its projection. Both are a gather of head rows: `option_index[r, j]` names the row.
"""

from __future__ import annotations

import torch


def readout_selective(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      option_index: torch.Tensor) -> torch.Tensor:
    """Only the needed logits: R x L dot products instead of R x vocab.

    Args:
        hidden: [N, H] final hidden states; rows: [R] int64 rows of hidden to read.
        weight: [Vocab, H] head weight; bias: [Vocab] or None; option_index: [R, L] int64 head rows per readout row.
    Returns: [R, L] scores in the weight's dtype.
    """
    h = hidden[rows].to(weight.dtype)  # [R, H]
    w = weight[option_index]  # [R, L, H]
    scores = torch.bmm(w, h[:, :, None])[..., 0]
    if bias is not None:
        scores = scores + bias[option_index]
    return scores


def readout_full(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 option_index: torch.Tensor) -> torch.Tensor:
    """The whole head over every row of `hidden`, then the options read out (the ablation of selective readout)."""
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias)  # [N, Vocab]
    return logits[rows].gather(1, option_index)


def readout_invariant(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      option_index: torch.Tensor) -> torch.Tensor:
    """`readout_selective` with each score's bits independent of the round (batch-invariant mode): products in fp32,
    then every score summed over the hidden size in one fixed order. A batched matrix product (selective's `bmm`)
    would pick its kernel by the number of rows and options, which change with the round.

    On CUDA the sums are the fixed-tile Triton GEMM against a column of ones (`flide.ops.linear.triton`); on the CPU
    a last-dim `sum` (vectorised in an order fixed by the hidden size; never split across threads at these sizes)."""
    h = hidden[rows].float()  # [R, H]
    products = weight[option_index].float() * h[:, None, :]  # [R, L, H]
    R, L, H = products.shape
    if products.is_cuda:
        from ..linear import triton as gemm

        ones = torch.ones(1, H, dtype=products.dtype, device=products.device)
        scores = gemm.linear(products.view(R * L, H), ones, None).view(R, L)
    else:
        scores = products.sum(-1)
    if bias is not None:
        scores = scores + bias[option_index].float()
    return scores.to(weight.dtype)
