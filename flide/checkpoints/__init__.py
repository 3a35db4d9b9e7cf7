"""Growing states: checkpoints saved inside the forward pass that answers a request, and later requests (the next
step of an agent's trajectory, the same conversation with a turn appended) that resume from them.

`cache.py`: the LRU byte-budgeted cache, keyed by token-prefix hashes, verified by tokens. `plan.py`: one round's
work (what resumes, what saves, the metadata the mixers read). Configured by `checkpoints.*` (`CheckpointConfig`);
the engine owns one cache (`Engine.checkpoints`).
"""

from .cache import Checkpoint, CheckpointCache, Segments, prefix_hashes
from .plan import LayerCheckpoint, RoundCheckpoints, resumable_tokens

__all__ = ["Checkpoint", "CheckpointCache", "LayerCheckpoint", "RoundCheckpoints", "Segments", "prefix_hashes",
           "resumable_tokens"]
