"""Fork attention through FlexAttention, with block tables built on the GPU from the round's metadata.

For a query block Q and a key block K (128 x 128), the number of keys of K each query of Q sees is the size of two
interval intersections (its state `[trunk_lo, trunk_hi)` and its own segment `[seg_lo, t]`), so the whole table is
a few vectorised ops over [T, T/128]: blocks every query sees fully are "full" (no mask evaluated), blocks some
query sees partly are "partial" (the mask is evaluated), the rest are skipped, which skips other requests' keys.
No host sync: the launch configuration depends on T alone, so the op replays inside a CUDA graph with any round.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 128
# FlexAttention's kernel options (tile sizes, warps, stages; None: its defaults for the head dim). A module setting
# read inside the compiled op, so changing it recompiles: `benchmarks/ops/bench_fork_attention.py --flex-sweep`
# times candidates at Qwen3.5's head dim 256, where flex ran 4-13x its floor with its defaults (H200, session 2).
KERNEL_OPTIONS: dict | None = None


def _overlap(lo: torch.Tensor, hi: torch.Tensor, block_lo: torch.Tensor, block_hi: torch.Tensor) -> torch.Tensor:
    """|[lo, hi) ∩ [block_lo, block_hi)| for every row of lo/hi [T, 1] and every block [1, NB]."""
    return (torch.minimum(hi, block_hi) - torch.maximum(lo, block_lo)).clamp(min=0)


def block_tables(seg_lo: torch.Tensor, trunk_lo: torch.Tensor, trunk_hi: torch.Tensor, block: int = BLOCK):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), each with leading dims [1, 1], for
    BlockMask.from_kv_blocks. T must be a multiple of `block`."""
    T = seg_lo.shape[0]
    nb = T // block
    t = torch.arange(T, device=seg_lo.device)
    block_lo = (torch.arange(nb, device=seg_lo.device) * block)[None, :]
    block_hi = block_lo + block
    seen = _overlap(trunk_lo[:, None], trunk_hi[:, None], block_lo, block_hi)
    seen = seen + _overlap(seg_lo[:, None], (t + 1)[:, None], block_lo, block_hi)  # [T, NB]
    seen = seen.view(nb, block, nb)
    any_seen = seen.amax(1) > 0
    full = seen.amin(1) == block
    partial = any_seen & ~full

    def table(flags: torch.Tensor):
        count = flags.sum(-1, dtype=torch.int32)
        # the flagged blocks first, in ascending order (a stable sort of 0 = flagged, 1 = not)
        order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[None, None], order[None, None]

    return (*table(partial), *table(full))


def _fork_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                    trunk_hi: torch.Tensor, scale: float) -> torch.Tensor:
    """The compiled part: block tables, BlockMask and the flex kernel, on a stream padded to its size class."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    T = q.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        own = (kv_idx >= seg_lo[q_idx]) & (kv_idx <= q_idx)
        state = (kv_idx >= trunk_lo[q_idx]) & (kv_idx < trunk_hi[q_idx])
        return own | state

    mask = BlockMask.from_kv_blocks(*block_tables(seg_lo, trunk_lo, trunk_hi), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(T, T))
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    if q.device.type == "cpu":  # Inductor's CPU flex template reads a 4-d layout, which these views lack
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                         kernel_options=KERNEL_OPTIONS)
    return out[0].transpose(0, 1)


def size_class(tokens: int) -> int:
    """The stream length the op runs at: `tokens` rounded up to a multiple of a quarter of its power of two (and of
    BLOCK). The op is compiled per length; eager rounds (checkpoint rounds, oversized requests, `runtime.graphs:
    off`) come in every length, and without classes each new one would compile anew (seconds each). Four classes per
    octave bound the compiles at ~4 per doubling of the stream; the pad rows see only themselves, so they cost a
    diagonal block each, and the block tables grow by at most 25% per side. Power-of-two buckets are classes already,
    so captured graphs pad nothing."""
    if tokens <= BLOCK:
        return BLOCK
    step = max(BLOCK, (1 << (tokens.bit_length() - 1)) // 4)
    return -(-tokens // step) * step


@functools.cache
def _compiled():
    # The whole op is compiled, block tables and BlockMask included: BlockMask.from_kv_blocks runs vmap, which fails
    # eagerly when this op is called from inside an Inductor graph ("Cannot access storage of BatchedTensorImpl",
    # seen on the H200), and compiled it also fuses the table building. One compiled kernel set per (stream length,
    # heads, dim, dtype): every bucket of every attention shape. Past dynamo's default limit of 8 it would silently
    # fall back to the slow eager flex, so allow enough of them.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
    return torch.compile(_fork_attention, dynamic=False, fullgraph=True)


def fork_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lo: torch.Tensor, trunk_lo: torch.Tensor,
                   trunk_hi: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as `reference.fork_attention` ([T, H, D] in, [T, Hq, Dv] out), on CUDA (or CPU) tensors."""
    T = q.shape[0]
    pad = size_class(T) - T
    if pad:
        # Padded eagerly, outside the compiled part: its inputs stay plain buffers (padding traced inside made the
        # mask's captured tensors computed buffers, which Inductor's CUDA flex lowering refused on the H200). Pad
        # rows see only themselves (seg_lo = t), so they never turn a block partial for real rows.
        # Each table keeps its dtype (int32 from a round, int64 from an extended stream: ops/resume.py).
        seg_lo = torch.cat([seg_lo, torch.arange(T, T + pad, device=q.device, dtype=seg_lo.dtype)])
        trunk_lo = torch.cat([trunk_lo, trunk_lo.new_zeros(pad)])
        trunk_hi = torch.cat([trunk_hi, trunk_hi.new_zeros(pad)])
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    out = _compiled()(q, k, v, seg_lo, trunk_lo, trunk_hi, scale)
    return out[:T].contiguous() if pad else out.contiguous()
