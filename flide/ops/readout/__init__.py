"""flide::readout_* custom ops. Variants: `selective` (only the label logits at the readout rows), `full` (the
whole head at every row; with it the model also runs its last layer at every token) and `invariant` (selective,
with each score summed in a fixed order: batch-invariant mode)."""

from __future__ import annotations

import torch

from ..registry import register
from . import reference


@torch.library.custom_op("flide::readout_selective", mutates_args=())
def readout_selective(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      option_index: torch.Tensor) -> torch.Tensor:
    return reference.readout_selective(hidden, rows, weight, bias, option_index)


@torch.library.custom_op("flide::readout_full", mutates_args=())
def readout_full(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 option_index: torch.Tensor) -> torch.Tensor:
    return reference.readout_full(hidden, rows, weight, bias, option_index)


@torch.library.custom_op("flide::readout_invariant", mutates_args=())
def readout_invariant(hidden: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      option_index: torch.Tensor) -> torch.Tensor:
    return reference.readout_invariant(hidden, rows, weight, bias, option_index)


@readout_selective.register_fake
def _(hidden, rows, weight, bias, option_index):
    return weight.new_empty(option_index.shape, dtype=torch.float32)


@readout_invariant.register_fake
def _(hidden, rows, weight, bias, option_index):
    return weight.new_empty(option_index.shape, dtype=torch.float32)


@readout_full.register_fake
def _(hidden, rows, weight, bias, option_index):
    return weight.new_empty(option_index.shape, dtype=torch.float32)


# Read by the model (flide.models.adapt): whether the last layer may run at the readout rows only.
readout_selective.gathers_rows_first = True
readout_full.gathers_rows_first = False
readout_invariant.gathers_rows_first = True
register("readout", "selective")(readout_selective)
register("readout", "full")(readout_full)
register("readout", "invariant", batch_invariant=True)(readout_invariant)
