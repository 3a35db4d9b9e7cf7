"""The linear layers of a decoder (projections, MLPs) as a registered op, for batch-invariant mode.

`linear` is the oracle: torch's own `F.linear`, whose BLAS picks kernels, tiles and split-K by the number of rows M
(on this CPU a 1-3 row product already differs in its last bits from the same rows inside a larger one), so a row's
bits depend on how many rows share the call. `linear_blocked` is the pure-torch batch-invariant form: the rows are
cut into blocks of a fixed size and multiplied as one batched product of identical [BLOCK, K] x [K, N] problems, so
every row goes through the same kernel and tile whatever M is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_ROWS = 64  # rows per block: every block's product has the same shape, so the same kernel, whatever M


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N]: `torch.nn.functional.linear`."""
    return F.linear(x, weight, bias)


def linear_blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` with every row's bits independent of M: rows padded to whole blocks of BLOCK_ROWS and multiplied
    as a batch of equal products (`torch.bmm` runs one kernel per block shape; measured invariant on the CPU for
    M = 1..400 and odd row offsets, where `F.linear` was not). The bias is added per element."""
    M, K = x.shape
    if weight.shape[0] == 1:  # a one-column product goes to a GEMV whose order changes with the batch: use two
        return linear_blocked(x, weight.expand(2, K), None if bias is None else bias.expand(2))[:, :1]
    blocks = -(-M // BLOCK_ROWS)
    padded = x.new_zeros(blocks * BLOCK_ROWS, K)
    padded[:M] = x
    out = torch.bmm(padded.view(blocks, BLOCK_ROWS, K), weight.t().expand(blocks, K, weight.shape[0]))
    out = out.view(blocks * BLOCK_ROWS, -1)[:M]
    return out + bias if bias is not None else out
