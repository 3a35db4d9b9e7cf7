"""Round shapes and (later) the CUDA graphs captured per stream-length bucket."""

from .buckets import PlannedRound, bucket_for, plan_rounds, shape_for

__all__ = ["PlannedRound", "bucket_for", "plan_rounds", "shape_for"]
