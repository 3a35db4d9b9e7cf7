"""Flide's ops. Each family lives in `flide/ops/<op>/`: a pure-torch `reference.py` (runs on the CPU; the test
oracle) beside its fast variants, every variant a `torch.library` custom op with a fake impl, registered in
`flide.ops.registry` under (op, variant).

Ops (shapes in each reference's docstring):
- fork_attention: attention over a flat stream where a question sees its state and its own earlier tokens only.
- fork_conv: the causal depthwise conv of Gated DeltaNet, each question continuing its state's conv window.
- gated_delta: the gated delta rule over segments, each starting from a recurrent state gathered by index.
- readout: the scores of the label rows of the head, at the readout rows only.
"""

from .registry import OP_FAMILIES, register, resolve, resolve_all, variants

__all__ = ["OP_FAMILIES", "register", "resolve", "resolve_all", "variants"]
