"""`runtime.guards: none`: after the capture, a round launches its bucket's recorded CUDA graph itself.

torch.compile(mode="reduce-overhead") records one CUDA graph per bucket (cudagraph trees). Every later call of the
compiled forward still runs, before the graph's launch: dynamo's guards over the model's ~300 parameters and modules,
the transformed bytecode that gathers those parameters as the graph's inputs, AOT's runtime wrappers and the trees'
checks. On the H200 that was 0.6-0.9 ms of host time before a RACE round's 569 kernels could start (the GPU waits for
it: one request alone is latency), and more in larger buckets (2026-12-01, `benchmarks/profile_round.py
--cprofile-enqueue`). None of it changes what the graph does: every call passes the bucket's own static views, the
parameters are read at their captured addresses, and no input is copied into the graph (checked below, per bucket).

So, once every bucket is recorded, each bucket keeps the `torch.cuda.CUDAGraph` the trees recorded for it and the
device memory its scores come out in, and a round is `graph.replay()`: the same kernels on the same addresses, the same
bits. What it gives up is what the guards would catch: a model changed after the capture (moved, cast, parameters
replaced) is not noticed, as with `skip`, and as the graphs would not notice with guards either.

This reads cudagraph trees' internals (the tree manager's current node, its graph, output metadata and input copies):
`recorded_graph` checks each thing it relies on and raises LookupError naming what differs, and the runner then keeps
the compiled call for that bucket.
"""

from __future__ import annotations

import torch


class _DeviceMemory:
    """A CUDA array interface over device bytes the caller keeps alive (here: the graphs' private memory pool)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s device memory with storage of its own. cudagraph trees mark the storage of an earlier
    call's outputs unreadable when a later call starts (`_set_storage_access_error_msg`); an alias with its own
    storage keeps reading what each replay writes there. `t` must be contiguous."""
    if not t.is_contiguous():
        raise LookupError(f"the graph's output is not contiguous (stride {t.stride()})")
    nbytes = t.numel() * t.element_size()
    raw = torch.as_tensor(_DeviceMemory(t.data_ptr(), nbytes), device=t.device)
    if raw.data_ptr() != t.data_ptr():
        raise LookupError("torch.as_tensor copied the graph's output instead of sharing its memory")
    return raw.view(t.dtype).view(t.shape)


def recorded_graph(output: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(the CUDA graph cudagraph trees replayed in the call that just returned `output`, an alias of `output` that
    each replay of it rewrites). Call on the thread of that call (the trees are per thread), right after it."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(output.device.index, create_if_none_exists=False)
    node = getattr(manager, "current_node", None)
    graph = getattr(node, "graph", None)
    if not isinstance(graph, torch.cuda.CUDAGraph):
        raise LookupError(f"cudagraph trees' current node holds no recorded graph ({type(node).__name__})")
    written = {m.get("data_ptr") for m in getattr(node, "outputs_metadata", ()) if isinstance(m, dict)}
    if output.untyped_storage().data_ptr() not in written:
        raise LookupError("the call's output is not among the current node's recorded outputs")
    inputs = getattr(node, "reconstructed_inputs", None)
    copied = getattr(node, "non_static_input_idx", None)
    if inputs is None or copied is None:
        raise LookupError("cudagraph trees do not say which inputs they copy before a replay")
    copied = [i for i in copied if isinstance(inputs[i], torch.Tensor)]
    if copied:  # a replay of the graph alone would read stale copies of these
        raise LookupError(f"{len(copied)} tensor inputs are copied into the graph before each replay")
    return graph, alias(output)
