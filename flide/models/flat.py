"""The flat forward: one pass of a Hugging Face decoder stack over a round's whole stream.

It runs the model's own modules (embedding, norms, MLPs, rotary tables) in the pre-norm residual order every
supported family shares, with the token mixers swapped for Flide's (`layers.py`). With selective readout the last
layer's MLP, the final norm and the head run only at the readout rows: every token still gives its keys, values
and recurrent updates to the last layer's mixer, and nothing else of it is needed. With `residual_fp32` (`runtime.
residual: float32`) the residual stream stays fp32 from the embedding to the final norm; what the mixers, MLPs and
head read (the norms' outputs) is rounded to the model's dtype as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..ops.gated_delta import ForkTables, fork_tables
from ..ops.resume import per_round_tables
from ..round import RoundTensors
from .fused import fuse, project
from .layers import FlatContext, conv_range, question_lens, sub_state_slots

ROUND_FIELDS = len(RoundTensors.__dataclass_fields__)  # a block's trailing inputs: the round's fields, then extras

# transformers MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)): their gate and up can share a GEMM
GATED_MLPS = frozenset(("Qwen3_5MLP", "Qwen3MLP", "Qwen2MLP", "LlamaMLP", "MistralMLP"))


def residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h + x, with the bits of `h + x` (a half-precision add runs in fp32 and rounds once, as this does), written so
    that Inductor keeps it a pointwise op: `h + mm(...)` (the o_proj / down_proj output) would become cuBLAS addmm,
    whose beta = 1 form first copies h into its output (a [T, hidden] memcpy per residual: 0.08 ms of a RACE replay,
    0.4 ms at 8,192 tokens on the H200), where the add fuses for free into the next norm's kernel."""
    return (h.float() + x.float()).to(h.dtype)


@dataclass
class Head:
    """What turns a final hidden state into the scores of a question's options.

    weight [rows, H] / bias: the head's matrix (lm_head for a causal LM: a row per vocabulary token; a decision head:
    a row per verbalizer). option_rows(question) -> the rows of its options, in option order. softcap: tanh cap.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    option_rows: Callable
    softcap: float | None = None


class FlatBlock(nn.Module):
    """One decoder layer over the flat stream: pre-norm mixer and MLP, each with its residual.

    Its forward is a nested compile region: torch.compile traces and compiles it once per layer kind (Gated
    DeltaNet, attention) and stamps the compiled code out for every layer of that kind, instead of unrolling and
    compiling all of them (the flat graph of Qwen3.5-0.8B took minutes to compile whole). Eagerly it is a plain call.
    """

    def __init__(self, layer: nn.Module, mixer: nn.Module, io_dtype: torch.dtype | None = None):
        super().__init__()
        self.io_dtype = io_dtype  # what the norms' outputs are rounded to (an fp32 residual stream); None: as they are
        self.input_layernorm, self.mixer = layer.input_layernorm, mixer
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp
        self.mlp_sizes: list[int] | None = None  # gate/up as one GEMM (fuse_projections)
        self.mlp_op = None  # silu(gate) * up as one op over the stacked weight (`kernels.gated_mlp`), or None

    def fuse_projections(self, mlp_op=None) -> None:
        """The mixer's input projections and the MLP's gate/up, each as one GEMM (flide/models/fused.py), for MLPs
        whose forward is known to be down(act(gate(x)) * up(x)); others keep their own call. `mlp_op`: the
        `kernels.gated_mlp` variant; one that does not keep the module runs silu(gate) * up from the stacked weight
        (ValueError where this MLP is not one it computes: not SiLU, a bias, gate and up of other sizes)."""
        self.mixer.fuse_projections()
        mlp = self.mlp
        if type(mlp).__name__ in GATED_MLPS and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj",
                                                                               "act_fn")):
            # the buffer goes on this engine's own mixer, not on the model's MLP module, which every engine patching
            # the model shares: a later patch re-registering it there freed this engine's buffer while its CUDA graphs
            # still read it (H200, session 25: an engine's answers 0.065 off the pipeline once a second engine was
            # built on its model). The mixer is this engine's (swap_mixers makes one per patch) and in the model's
            # tree until the next patch, so `model.to` still converts it
            self.mlp_sizes = fuse(self.mixer, [mlp.gate_proj, mlp.up_proj], "gate_up")
        if mlp_op is not None and not getattr(mlp_op, "keeps_module", True):
            act = getattr(mlp, "act_fn", None)
            silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
            sizes = self.mlp_sizes
            if not silu or sizes is None or sizes[0] != sizes[1] or getattr(self.mixer, "gate_up_bias") is not None:
                raise ValueError(f"`kernels.gated_mlp` computes silu(gate(x)) * up(x) from bias-free gate / up "
                                 f"projections of one size; this MLP ({type(mlp).__name__}, act "
                                 f"{type(act).__name__}, sizes {sizes}) is not one: use `kernels.gated_mlp: torch`.")
            self.mlp_op = mlp_op

    def normed(self, norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """norm(h) as the mixer or MLP reads it. transformers' RMSNorms return their input's dtype: from an fp32
        stream, an fp32 output, rounded here to the model's dtype (once, where a half-precision stream rounds it)."""
        x = norm(h)
        return x if self.io_dtype is None else x.to(self.io_dtype)

    def run_mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp_sizes is None:
            return self.mlp(x)
        mlp = self.mlp
        if self.mlp_op is not None:
            act_up = self.mlp_op(x.reshape(-1, x.shape[-1]), self.mixer.gate_up_weight)
            return mlp.down_proj(act_up.view(*x.shape[:-1], act_up.shape[-1]))
        gate, up = project(self.mixer, "gate_up", self.mlp_sizes, [mlp.gate_proj, mlp.up_proj], x)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    @torch.compiler.nested_compile_region
    def forward(self, h: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor, chunk_offsets: torch.Tensor, states_end: torch.Tensor,
                branches_end: torch.Tensor, all_cu_seqlens: torch.Tensor, all_chunks: torch.Tensor,
                long_chunks: torch.Tensor, long_chunk_offsets: torch.Tensor, branch_from: torch.Tensor,
                *fields: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the round's fields, then (nested forks) what is derived once per forward: the conv ranges
        # (`layers.conv_range`) and the branch rows' sub-trunk state slots (`layers.sub_state_slots`)
        r = RoundTensors(*fields[:ROUND_FIELDS])
        tables = ForkTables(cu_seqlens, r.state_chunks, chunk_offsets, states_end, branches_end, all_cu_seqlens,
                            all_chunks, long_chunks, long_chunk_offsets, branch_from)
        nested = fields[ROUND_FIELDS:]
        conv, slots = (tuple(nested[:2]), nested[2]) if nested else (None, None)
        return self.run_deferred(h, pending, FlatContext(r, cos, sin, tables=tables, conv_range=conv,
                                                         sub_slot=slots, question_lens=tuple(nested[3:]) or None))

    def run_deferred(self, h: torch.Tensor, pending: torch.Tensor,
                     ctx: FlatContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with the residual add that ends the layer before it still to do (`pending`, that layer's MLP
        output): done here, the add fuses into this layer's input-norm kernel, inside one compile region, where as
        the last op of the region before it was a kernel of its own (one launch and one pass over the stream fewer
        a layer). Returns (h, this layer's MLP output, not yet added)."""
        h = residual(h, pending)
        h = residual(h, self.mixer(self.normed(self.input_layernorm, h), flide=ctx))
        return h, self.run_mlp(self.normed(self.post_attention_layernorm, h))

    def run(self, h: torch.Tensor, ctx: FlatContext) -> torch.Tensor:
        """The whole layer with a context of its own, eagerly, for rounds with checkpoints (never compiled)."""
        h = residual(h, self.mixer(self.normed(self.input_layernorm, h), flide=ctx))
        return residual(h, self.run_mlp(self.normed(self.post_attention_layernorm, h)))


class FlatModel(nn.Module):
    """A patched decoder stack and its head, run over RoundTensors -> option scores [readout_rows, options]."""

    def __init__(self, text_model: nn.Module, head: Head, readout_op: Callable, selective: bool,
                 residual_fp32: bool = False):
        super().__init__()
        self.text_model = text_model
        self.head = head
        self.readout_op = readout_op
        self.selective = selective
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(text_model, name):
                raise ValueError(f"{type(text_model).__name__} has no `{name}`: not a decoder stack Flide can run.")
        # the model's dtype, what the mixers, MLPs and head read; with `residual_fp32` the stream between them is fp32
        self.dtype = text_model.embed_tokens.weight.dtype
        self.residual_fp32 = residual_fp32
        io_dtype = self.dtype if residual_fp32 else None
        # Not registered children: the layers' modules belong to the model (and its state_dict) already
        self.__dict__["blocks"] = [FlatBlock(layer, self.mixer(layer), io_dtype) for layer in text_model.layers]
        # a layer runs its questions' gated delta in chunked form (`kernels.gated_delta: fla_wy`, or `fla` with
        # fla.CHUNKED_QUESTIONS): the round tables then include the states' and questions' combined chunk tables
        # (derived only then: they cost kernels per replay)
        self.question_chunks = any(getattr(block.mixer, "wy", False) or getattr(block.mixer, "chunked_questions", False)
                                   for block in self.blocks)
        # a GDN layer runs nested forks (`runtime.nested_forks`): the conv's ranges are derived once per forward
        self.nested = any(getattr(block.mixer, "nested_op", None) is not None and hasattr(block.mixer, "conv_op")
                          for block in self.blocks)
        # and its chunked question calls leave the leaves and their sub-trunks to the recurrent kernel: their rows
        # are split off once per forward (`layers.question_lens`) and their chunks left out of the combined tables
        self.split_nested = self.nested and any(getattr(block.mixer, "split_nested", False) for block in self.blocks)

    def mixer(self, layer: nn.Module) -> nn.Module:
        return layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn

    def forward(self, r: RoundTensors, checkpoints=None) -> torch.Tensor:
        """`checkpoints`: the round's `flide.checkpoints.RoundCheckpoints` (bound), or None. With it every layer
        runs eagerly with its own part of the checkpoint work in its context, and the resume companions derive
        their extended streams from the round's tables once for all layers (`per_round_tables`)."""
        if checkpoints is None:
            return self._forward(r)
        with per_round_tables():
            return self._forward(r, checkpoints)

    def _forward(self, r: RoundTensors, checkpoints=None) -> torch.Tensor:
        m = self.text_model
        h = m.embed_tokens(r.input_ids)  # [T, H]; a round's ids are int32, which an embedding (a row gather) takes
        # positions as the int64 (LongTensor) the model's own rotary module is written for, not the round's int32:
        # its code is transformers', per family, so it gets the dtype it was tested with; one small device op
        cos, sin = m.rotary_emb(h[None], r.positions.long()[None])
        if self.residual_fp32:  # after the rotary tables, which take the dtype of the tensor they are given
            if h.dtype != self.dtype:
                raise ValueError(f"The model's dtype changed after it was patched ({self.dtype} -> {h.dtype}): "
                                 "patch it again after casting it.")
            h = h.float()
        last = self.blocks[-1]
        if checkpoints is not None:
            for index, block in enumerate(self.blocks[:-1]):
                h = block.run(h, FlatContext(r, cos[0], sin[0], checkpoints.layer(index)))
            ctx = FlatContext(r, cos[0], sin[0], checkpoints.layer(len(self.blocks) - 1))
        else:
            # under torch.compile, separate tensors: the fields are views of one packed buffer and a compile region's
            # inputs must not alias; eagerly the regions are plain calls and the views serve as they are
            fields = tuple(value.clone() if torch.compiler.is_compiling() else value for _, value in r.items())
            r = RoundTensors(*fields)
            # the GDN forks' round tables, once for all layers (not derived again in each)
            lens = question_lens(r) if self.split_nested else ()
            tables = fork_tables(r.state_start, r.state_len, r.branch_start, r.branch_len, r.state_chunks,
                                 r.branch_chunks if self.question_chunks else None, branch_state=r.branch_state,
                                 skip_branches=lens[1] > 0 if lens else None)
            # nested forks: the conv's ranges and the sub-trunk state slots once for all GDN layers (two pointwise
            # kernels a layer otherwise, and a dozen small ops), and the split question rows
            nested = (*conv_range(r), sub_state_slots(r), *lens) if self.nested else ()
            ctx = FlatContext(r, cos[0], sin[0], tables=tables, conv_range=tuple(nested[:2]) or None,
                              sub_slot=nested[2] if nested else None, question_lens=tuple(nested[3:]) or None)
            # each block returns its MLP output un-added, for the next block's input-norm kernel to add
            # (`run_deferred`); the first adds zeros (h + 0 has h's bits), so every block has one signature and
            # compiles as one region per layer kind
            pending = torch.zeros_like(h)
            for block in self.blocks[:-1]:
                h, pending = block(h, pending, ctx.cos, ctx.sin, tables.state_cu_seqlens, tables.state_chunk_offsets,
                                   tables.states_end, tables.branches_end, tables.all_cu_seqlens, tables.all_chunks,
                                   tables.long_chunks, tables.long_chunk_offsets, tables.branch_from, *fields,
                                   *nested)
            h = residual(h, pending)
        h = residual(h, last.mixer(last.normed(last.input_layernorm, h), flide=ctx))
        if self.selective:
            h = h[r.readout_rows]  # only the read rows go on through the last MLP, the norm and the head
        h = residual(h, last.run_mlp(last.normed(last.post_attention_layernorm, h)))
        h = last.normed(m.norm, h)
        rows = torch.arange(h.shape[0], device=h.device) if self.selective else r.readout_rows
        head = self.head
        scores = self.readout_op(h, rows, head.weight, head.bias, r.option_index)
        if head.softcap is not None:
            scores = head.softcap * torch.tanh(scores / head.softcap)
        return scores
