"""Checks shared by the ops that read a stream's per-token tables (seg_lo, trunk_lo, trunk_hi and their companions)."""

from __future__ import annotations

import torch

# A round's tables are int32 (flide/round.py); extended streams (ops/resume.py) and tests hand in int64
TOKEN_TABLE_DTYPES = (torch.int32, torch.int64)


def check_token_tables(T: int, **tables: torch.Tensor) -> None:
    """ValueError naming the first table that is not [T] int32 or int64."""
    for name, m in tables.items():
        if m.shape != (T,) or m.dtype not in TOKEN_TABLE_DTYPES:
            raise ValueError(f"{name} must be int32 or int64 [{T}], got {m.dtype} {tuple(m.shape)}")
