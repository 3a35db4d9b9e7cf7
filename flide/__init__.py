"""Flide: flat-graph inference for decision models.

    import flide
    engine = flide.patch(model, tokenizer)       # a transformers model -> flide.Engine
    engine.decide({"state": "...", "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}})

Imports are lazy: `import flide` loads neither torch nor transformers, and never initialises CUDA.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Engine", "FlideConfig", "RequestError", "load_config", "patch", "__version__"]


def patch(model, tokenizer, config=None, decision_config=None):
    """Swaps the attention and Gated DeltaNet layers of a transformers model for Flide's ops (in place; weights and
    state_dict keys unchanged) and returns the `flide.Engine` that answers decision requests with it.

    Args:
        model: a transformers PreTrainedModel: a causal LM (Qwen3.5, Llama, Qwen3, ...) or a decision model
            (JevForDecision). Anything else raises ValueError listing the supported model types.
        tokenizer: its tokenizer (or processor).
        config: a FlideConfig, a dict, a YAML path, or None for the defaults (configs/default.yaml).
        decision_config: overrides the decision config the pipeline would pick (the model's, or its repo's).
    """
    from .engine import Engine

    return Engine(model, tokenizer, config, decision_config=decision_config)


def __getattr__(name):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name in ("FlideConfig", "load_config"):
        from . import config

        return getattr(config, name)
    if name == "RequestError":
        from .requests import RequestError

        return RequestError
    raise AttributeError(f"module 'flide' has no attribute {name!r}")
