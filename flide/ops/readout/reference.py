"""Readout: the scores of each question's options, read from the head's rows at the readout rows only.

A causal LM scores option j of a question by the logit of its label token; a decision head (Jev) by row
`offset[type] + j` of its projection. Both are a gather of head rows: `option_index[r, j]` names the row.

The selective and invariant readouts return float32 scores whatever the model's dtype: a bf16 model's hidden state
and head rows are bf16, their products are exact in fp32 and summed in fp32, and the scores are never rounded back
to bf16. Rounding a logit of magnitude 8-16 to bf16 moves it by up to 0.03 (half an ulp of 0.0625): ~3 % of an
option's probability, on the order of everything else that bf16 changes in the answer (transformers' pipeline does
round its logits so). It costs nothing: R x L dot products.
"""

from __future__ import annotations

import torch


def _gathered(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, option_index: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [R, H], w [R, L, H]) in fp32: the read rows of hidden, taken in the weight's dtype as the head would take
    them, and each row's option rows of the head (both exact in fp32)."""
    return hidden[rows].to(weight.dtype).float(), weight[option_index].float()


def _plus_bias(scores: torch.Tensor, bias: torch.Tensor | None, option_index: torch.Tensor) -> torch.Tensor:
    return scores + bias[option_index].float() if bias is not None else scores


def readout_selective(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      option_index: torch.Tensor) -> torch.Tensor:
    """Only the needed logits: R x L dot products instead of R x vocab.

    Args:
        hidden: [N, H] final hidden states; rows: [R] int64 rows of hidden to read.
        weight: [Vocab, H] head weight; bias: [Vocab] or None; option_index: [R, L] int64 head rows per readout row.
    Returns: [R, L] float32 scores (the hidden state taken in the weight's dtype, as the head would; see the module
    docstring).
    """
    h, w = _gathered(hidden, rows, weight, option_index)
    return _plus_bias(torch.bmm(w, h[:, :, None])[..., 0], bias, option_index)


def readout_full(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 option_index: torch.Tensor) -> torch.Tensor:
    """The whole head over every row of `hidden`, then the options read out (the ablation of selective readout):
    the model's own head, logits in its dtype (rounded to bf16 in a bf16 model, as transformers' are), as float32."""
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias)  # [N, Vocab]
    return logits[rows].gather(1, option_index).float()


def readout_invariant(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      option_index: torch.Tensor) -> torch.Tensor:
    """`readout_selective` with each score's bits independent of the round (batch-invariant mode): products in fp32,
    then every score summed over the hidden size in one fixed order. A batched matrix product (selective's `bmm`)
    would pick its kernel by the number of rows and options, which change with the round.

    On CUDA the sums are the fixed-tile Triton GEMM against a column of ones (`flide.ops.linear.triton`); on the CPU
    a last-dim `sum` (vectorised in an order fixed by the hidden size; never split across threads at these sizes)."""
    h, w = _gathered(hidden, rows, weight, option_index)  # as selective reads them
    products = w * h[:, None, :]  # [R, L, H]
    R, L, H = products.shape
    if products.is_cuda:
        from ..linear import triton as gemm

        ones = torch.ones(1, H, dtype=products.dtype, device=products.device)
        scores = gemm.linear(products.view(R * L, H), ones, None).view(R, L)
    else:
        scores = products.sum(-1)
    return _plus_bias(scores, bias, option_index)  # float32, as selective's
