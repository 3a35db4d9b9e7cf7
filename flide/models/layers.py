"""The token mixers Flide swaps into Hugging Face decoder layers: attention and Gated DeltaNet over a flat stream.

Each swapped module adopts the submodules and parameters of the layer it replaces (same objects, so weights and
`state_dict` keys are unchanged) and runs the registered ops resolved at patch time. Called without a Flide round
(`flide=None`) it runs the original transformers module, so a patched model still works as a plain HF model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..config import QUESTION_FORMS
from .fused import fuse, project
from ..ops.fork_conv import QKV_KERNELS
from ..ops.fork_conv.reference import gdn_gates
from ..ops.gated_delta import (BRANCH_KERNELS, CHUNKED_QUESTION_KERNELS, LAID_OUT_STATE_KERNELS, STATE_KERNELS,
                               WY_KERNELS)
from ..ops.gated_delta import fla as gated_delta_fla
from ..ops.gated_delta import fork_parts as gated_delta_fork_parts
from ..ops.gated_delta import fork_resumable as gated_delta_fork_resumable
from ..ops.gated_delta import new_sub_flags, split_question_lens, sub_slots
from ..ops.gated_norm.reference import select_rows
from ..round import RoundTensors


@dataclass
class FlatContext:
    """What every mixer of one forward pass reads: the round's metadata and the rotary tables of its positions."""

    round: RoundTensors
    cos: torch.Tensor  # [T, rotary_dim]
    sin: torch.Tensor
    # this layer's part of the round's checkpoint work (flide.checkpoints.LayerCheckpoint): what it resumes from and
    # saves; None without checkpoints (and always inside a captured graph)
    checkpoint: object = None
    # what every GDN layer's fork derives from the round alone (flide.ops.gated_delta.ForkTables), derived once per
    # forward; None: each layer derives its own
    tables: object = None
    # nested forks: (lo, hi) [T], the range each token's first conv window continues (its state's; a leaf's
    # sub-trunk's), derived once per forward; None: each GDN layer derives it from the round
    conv_range: tuple | None = None
    # nested forks: [NB] int32, each branch row's slot for its sub-trunk's stored state (`sub_state_slots`), derived
    # once per forward; None: each GDN layer derives it from the round
    sub_slot: torch.Tensor | None = None
    # nested forks with chunked questions split off their nested rows (`question_lens`): (plain_len, nested_len[,
    # group_len]) [NB], derived once per forward; None: each GDN layer derives them from the round
    question_lens: tuple | None = None


def conv_range(r: RoundTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the stream range its first conv window continues: its state's, or for a leaf question (nested
    forks) its sub-trunk's, whose last width - 1 tokens precede it in its prompt (`prepare` keeps sub-trunks that
    long)."""
    leaf = r.sub_hi > r.sub_lo
    return torch.where(leaf, r.sub_lo, r.trunk_lo), torch.where(leaf, r.sub_hi, r.trunk_hi)


def sub_state_slots(r: RoundTensors) -> torch.Tensor:
    """[NB] int32, each branch row's slot for its sub-trunk's state (nested forks, `gated_delta.sub_slots`): the GDN
    question kernel's leaves start from their sub-trunk's stored state instead of re-running its tokens."""
    return sub_slots(r.branch_start, r.branch_len, r.branch_state, r.sub_lo, r.sub_hi)


def question_lens(r: RoundTensors) -> tuple[torch.Tensor, ...]:
    """(plain_len, nested_len[, group_len]) [NB] of the round's question rows (`gated_delta.split_question_lens`)."""
    return split_question_lens(r.branch_start, r.branch_len, r.sub_lo, r.sub_hi)


class _Swapped(nn.Module):
    def __init__(self, original: nn.Module, names: tuple[str, ...]):
        super().__init__()
        for name in names:  # the same module / parameter objects: weights and state_dict keys are kept
            value = getattr(original, name)
            if value is None or isinstance(value, nn.Parameter):  # None: an absent optional parameter (a bias)
                self.register_parameter(name, value)
            else:
                self.add_module(name, value)
        # Not a registered child: its parameters are ours already, and state_dict must not list them twice
        self.__dict__["original"] = original

    # kernel handles (registered custom ops) are shared, never copied: they cannot be deep-copied, and a copy of a
    # patched model runs the same kernels
    SHARED = ()

    def __deepcopy__(self, memo):
        import copy

        shared = {name: self.__dict__.pop(name) for name in self.SHARED}
        try:
            cls = type(self)
            clone = cls.__new__(cls)
            memo[id(self)] = clone
            for key, value in self.__dict__.items():
                clone.__dict__[key] = copy.deepcopy(value, memo)
        finally:
            self.__dict__.update(shared)
        clone.__dict__.update(shared)
        return clone

    def forward(self, *args, flide: FlatContext | None = None, **kwargs):
        if flide is None:
            return self.original(*args, **kwargs)
        return self.flat_forward(args[0] if args else kwargs["hidden_states"], flide)


class FlideAttention(_Swapped):
    """Full attention (Llama, Qwen3, Qwen3.5) over the flat stream through `fork_attention`.

    Handles the family differences seen in transformers' modules: an output gate packed into q_proj (Qwen3.5),
    RMSNorms over the head dim before RoPE (Qwen3, Qwen3.5), partial rotary (Qwen3.5; in the family's own
    apply_rotary_pos_emb), GQA.
    """

    SHARED = ("op", "apply_rotary", "qk_prep", "nested_op")

    def __init__(self, original: nn.Module, attention_op: Callable, qk_prep: Callable | None = None,
                 nested_op: Callable | None = None):
        names = ("q_proj", "k_proj", "v_proj", "o_proj") + tuple(n for n in ("q_norm", "k_norm") if hasattr(original, n))
        super().__init__(original, names)
        self.op = attention_op
        # nested forks (`runtime.nested_forks`): the variant's companion that also takes each token's sub-trunk range
        self.nested_op = nested_op
        self.head_dim = original.head_dim
        self.scaling = float(original.scaling)
        self.num_kv_heads = original.k_proj.out_features // self.head_dim
        q_out = original.q_proj.out_features
        self.num_heads = original.o_proj.in_features // self.head_dim
        self.gated = q_out == 2 * self.num_heads * self.head_dim
        self.apply_rotary = sys.modules[type(original).__module__].apply_rotary_pos_emb
        # q / k's head norms and rotary in one launch (`kernels.fuse_attention_prep`), where they are Qwen3.5's
        from ..ops.qk_prep import supports

        self.qk_prep = qk_prep if qk_prep is not None and supports(original) else None
        self.qkv_sizes: list[int] | None = None  # q/k/v as one GEMM (fuse_projections)
        if getattr(original, "sliding_window", None):
            raise ValueError(f"{type(original).__name__} uses sliding-window attention, which Flide does not fork yet.")

    def fuse_projections(self) -> None:
        """q/k/v projections as one GEMM (flide/models/fused.py); the layer's weights become views of it."""
        self.qkv_sizes = fuse(self, [self.q_proj, self.k_proj, self.v_proj], "qkv")

    def flat_forward(self, x: torch.Tensor, ctx: FlatContext) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q_out, k, v = project(self, "qkv", self.qkv_sizes, [self.q_proj, self.k_proj, self.v_proj], x)
        if self.gated:
            q, gate = torch.chunk(q_out.view(T, -1, 2 * D), 2, dim=-1)
            gate = gate.reshape(T, -1)
        else:
            q, gate = q_out.view(T, -1, D), None
        k = k.view(T, -1, D)
        v = v.view(T, -1, D)
        if self.qk_prep is not None:  # norms + rotary in one launch, q / k read where they lie
            q, k = self.qk_prep(q, k, ctx.cos, ctx.sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        else:
            if hasattr(self, "q_norm"):
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.apply_rotary(q, k, ctx.cos, ctx.sin, unsqueeze_dim=1)  # [T, H, D] with cos [T, d]
        r, ck = ctx.round, ctx.checkpoint
        # v stays a column slice of the projection: every variant reads rows of any stride (one copy kernel a layer
        # fewer); q and k come out of the norm and rotary code as new tensors
        q, k = q.contiguous(), k.contiguous()
        if ck is not None and ck.resumes:  # resumed states: their checkpoint's keys precede the stream's
            pk, pv = ck.prefix()
            out = ck.work.ops["fork_attention"](q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, pk, pv, ck.work.pre_lo,
                                                ck.work.pre_hi, self.scaling)
        elif self.nested_op is not None:  # a leaf question's tokens also see its sub-trunk's keys
            out = self.nested_op(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, r.sub_lo, r.sub_hi, self.scaling)
        else:
            out = self.op(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, self.scaling)
        if ck is not None:
            ck.save_attention(k, v)
        out = out.reshape(T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class FlideGatedDeltaNet(_Swapped):
    """Qwen3.5's Gated DeltaNet over the flat stream: the conv forks through `fork_conv`, the recurrence through two
    calls of `gated_delta` (states first, then every question from its state's final recurrent state)."""

    NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj", "A_log", "dt_bias")
    SHARED = ("conv_op", "delta_op", "branch_op", "state_op", "norm_op", "conv_qkv_op", "laid_out_state_op",
              "nested_op")

    def __init__(self, original: nn.Module, conv_op: Callable, delta_op: Callable, norm_op: Callable | None = None,
                 fuse_conv_layout: bool = True, nested_op: Callable | None = None, question_form: str = "auto",
                 batch_invariant: bool = False):
        super().__init__(original, self.NAMES)
        if original.conv1d.bias is not None:
            raise ValueError("Gated DeltaNet with a conv bias is not supported.")
        if original.activation not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet with activation {original.activation!r} is not supported.")
        self.conv_op, self.delta_op = conv_op, delta_op
        # the gated norm as one op with the fork's row select (`kernels.gated_norm`), or None: the model's own norm
        # module after the select (the `torch` variant, which Inductor fuses)
        self.norm_op = None if norm_op is None or getattr(norm_op, "keeps_module", False) else norm_op
        if self.norm_op is not None:
            norm = original.norm
            if getattr(norm, "activation", None) not in ("silu", "swish") or not hasattr(norm, "variance_epsilon"):
                raise ValueError(f"`kernels.gated_norm` runs Qwen3.5's gated RMS norm (SiLU gate); this layer's norm "
                                 f"({type(norm).__name__}) is not one: use `kernels.gated_norm: torch`.")
        # the variant's faster question call, if it has one: looked up here, once, not in traced code
        self.branch_op = BRANCH_KERNELS.get(delta_op)
        self.state_op = STATE_KERNELS.get(delta_op)  # and its state call from the round's tables
        self.wy = delta_op in WY_KERNELS  # questions in chunked (WY) form from the state call's chunk-local steps
        self.in_sizes: list[int] | None = None  # the four input projections as one GEMM (fuse_projections)
        self.key_dim, self.value_dim = original.key_dim, original.value_dim
        self.head_k_dim, self.head_v_dim = original.head_k_dim, original.head_v_dim
        # the conv writes q, k (normalised) and v as the gated delta kernels read them, in its own launch, when the
        # conv variant has that form and the state call takes them so (`fork_parts(laid_out=True)`): the state
        # call's layout launch, which read the conv's output back and wrote it again, drops out. Heads of one
        # power-of-two width: one conv channel tile is one head
        dim = self.head_k_dim
        fusable = fuse_conv_layout and dim == self.head_v_dim and dim & (dim - 1) == 0 and dim <= 256 and not self.wy
        self.conv_qkv_op = QKV_KERNELS.get(conv_op) if fusable else None
        self.laid_out_state_op = LAID_OUT_STATE_KERNELS.get(delta_op) if fusable else None
        # the laid-out fork's questions in chunked form (`kernels.gated_delta_questions`; auto: fla.CHUNKED_QUESTIONS,
        # read here, at patch time): the round tables then carry the states' and questions' combined chunk rows
        # (`FlatModel.question_chunks`)
        if question_form not in QUESTION_FORMS:
            raise ValueError(f"`kernels.gated_delta_questions` must be one of {', '.join(QUESTION_FORMS)}, got "
                             f"{question_form!r}.")
        can_chunk = self.laid_out_state_op is not None and delta_op in CHUNKED_QUESTION_KERNELS
        if question_form == "chunked" and not can_chunk:
            raise ValueError("`kernels.gated_delta_questions: chunked` needs a gated delta variant with a chunked "
                             "question call (fla, CUDA) on the fused conv layout (`kernels.fuse_conv_layout: "
                             f"true`, Triton conv); this layer has {getattr(delta_op, '__name__', delta_op)} and "
                             f"{'the fused layout' if self.laid_out_state_op is not None else 'no fused layout'}: "
                             "use auto or recurrent.")
        self.chunked_questions = can_chunk and (question_form == "chunked" or
                                                (question_form == "auto" and gated_delta_fla.CHUNKED_QUESTIONS))
        # and, in nested forks, the leaves and their sub-trunks by the recurrent nested kernel (read here too)
        self.split_nested = self.chunked_questions and nested_op is not None and gated_delta_fla.SPLIT_NESTED_QUESTIONS
        # batch-invariant mode: no launch's tiles may follow the bucket (a row's bits would change with its round)
        self.fixed_tiles = batch_invariant
        # nested forks (`runtime.nested_forks`): the question call whose leaves continue their sub-trunk's state,
        # and the flags they wait on for it (zero between calls: kept here, not filled a call; not in state_dict)
        self.nested_op = nested_op
        if nested_op is not None:
            self.register_buffer("sub_flags", new_sub_flags(original.num_v_heads, original.head_v_dim,
                                                            original.A_log.device), persistent=False)

    def fuse_projections(self) -> None:
        """in_proj_qkv / z / b / a as one GEMM (flide/models/fused.py); the layer's weights become views of it."""
        self.in_sizes = fuse(self, self._in_projections(), "in_proj")

    def _in_projections(self) -> list[nn.Module]:
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]

    @staticmethod
    def _sub_slot(ctx: FlatContext) -> torch.Tensor:
        """The branch rows' sub-trunk state slots (nested forks): the forward's, else derived from the round."""
        return ctx.sub_slot if ctx.sub_slot is not None else sub_state_slots(ctx.round)

    def flat_forward(self, x: torch.Tensor, ctx: FlatContext) -> torch.Tensor:
        T, r, ck = x.shape[0], ctx.round, ctx.checkpoint
        conv_in, z, b, a = project(self, "in_proj", self.in_sizes, self._in_projections(), x)
        weight = self.conv1d.weight.squeeze(1)
        # the stream range each token's first conv window continues: its state's, or for a leaf question its
        # sub-trunk's (whose last width - 1 tokens precede it in its prompt: `prepare` keeps sub-trunks that long)
        trunk_lo, trunk_hi = r.trunk_lo, r.trunk_hi
        if self.nested_op is not None:
            trunk_lo, trunk_hi = ctx.conv_range if ctx.conv_range is not None else conv_range(r)
        # laid out: the fused conv writes q, k (normalised) and v as the gated delta kernels read them (not in
        # rounds with checkpoints, whose companions take the plain conv's output)
        laid_out = ck is None and self.conv_qkv_op is not None and self.laid_out_state_op is not None \
            and ctx.tables is not None
        if laid_out:  # and the gates g / beta, from the same launch
            q, k, v, g, beta = self.conv_qkv_op(conv_in, weight, r.seg_lo, trunk_lo, trunk_hi, a, b, self.A_log,
                                                self.dt_bias, self.key_dim // self.head_k_dim, self.head_k_dim, True)
        else:
            if ck is not None and ck.resumes:  # a resumed state's conv window continues the checkpoint's inputs
                qkv = ck.work.ops["fork_conv"](conv_in, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, ck.window(),
                                               ck.work.win_index, True)
            else:
                qkv = self.conv_op(conv_in, weight, r.seg_lo, trunk_lo, trunk_hi, True)
            q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            q, k = q.reshape(T, -1, self.head_k_dim), k.reshape(T, -1, self.head_k_dim)
            v = v.reshape(T, -1, self.head_v_dim)
            g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        gate = z.reshape(T, -1, self.head_v_dim)  # the gated norm's [T, Hv, V] (see the return)
        if ck is None:
            # laid out: q, k (normalised) and v as the kernels read them, from the fused conv. Else as they lie in
            # the conv's output (column slices): every variant makes them contiguous itself where it needs to; the
            # fla state call lays out all three in one launch that also normalises q and k, and hands them to the
            # question call (three Inductor copy kernels a layer fewer, v stored once)
            parts = gated_delta_fork_parts(self.delta_op, q, k, v, g, beta, r.state_start, r.state_len,
                                           r.branch_start, r.branch_len, r.branch_state, self.head_k_dim ** -0.5,
                                           not laid_out, branch_kernel=self.branch_op,
                                           state_kernel=self.laid_out_state_op if laid_out else self.state_op,
                                           tables=ctx.tables, wy=self.wy, laid_out=laid_out,
                                           chunked=laid_out and self.chunked_questions,
                                           **({} if self.nested_op is None else
                                              {"sub": (r.sub_lo, r.sub_hi, self._sub_slot(ctx), self.sub_flags),
                                               "nested_kernel": self.nested_op}),
                                           **({"question_lens": ctx.question_lens or question_lens(r),
                                               "fixed_tiles": self.fixed_tiles}
                                              if laid_out and self.split_nested else {}))
            if self.norm_op is not None:  # the select and the norm in one op
                normed = self.norm_op(parts.o_states, parts.o_branches, gate, self.norm.weight, parts.states_end,
                                      parts.branches_start, parts.branches_end, self.norm.variance_epsilon)
            else:
                normed = self.norm(select_rows(parts.o_states, parts.o_branches, parts.states_end,
                                               parts.branches_start, parts.branches_end), gate)
        else:  # states start from their checkpoints' recurrent states; the state call snapshots the saves' states
            initial = ck.initial_state((v.shape[1], self.head_k_dim, self.head_v_dim))
            out, _, snapshot = gated_delta_fork_resumable(
                ck.work.ops["gated_delta"], q.contiguous(), k.contiguous(), v.contiguous(), g, beta, r.state_start,
                r.state_len, r.branch_start, r.branch_len, r.branch_state, self.head_k_dim ** -0.5, True, initial,
                ck.work.initial_index, ck.work.snapshot_chunk)
            ck.save_gdn(conv_in, snapshot, weight.shape[1])
            normed = self.norm(out, gate)
        # the gated norm runs over [T, Hv, V] (per head row, as transformers' [T * Hv, V]): merging the last two dims
        # is then a view for Inductor, where [T * Hv, V] -> [T, Hv * V] with a symbolic T became a copy kernel before
        # out_proj in every GDN layer (session 20's H200 output code)
        return self.out_proj(normed.reshape(T, -1))


class FlideLinear(_Swapped):
    """An `nn.Linear` run through a registered `linear` op (batch-invariant mode: `blocked` on the CPU, `triton` on
    CUDA), holding the same weight and bias objects (state_dict keys unchanged). Any leading dims, as nn.Linear."""

    SHARED = ("op",)

    def __init__(self, original: nn.Linear, linear_op: Callable):
        super().__init__(original, ("weight", "bias"))
        self.in_features, self.out_features = original.in_features, original.out_features
        self.op = linear_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.op(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, op={self.op}"


def swap_linears(module: nn.Module, linear_op: Callable | None) -> None:
    """Runs every `nn.Linear` under `module` through `linear_op` (a `FlideLinear`), or with None puts the original
    layers back. Call after the mixers are swapped: the swapped mixers hold the projections as their own children."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FlideLinear):
                child = child.original
            elif type(child) is not nn.Linear:
                continue
            setattr(parent, name, child if linear_op is None else FlideLinear(child, linear_op))
