"""Flat graphs: one CUDA graph per stream-length bucket, replayed for every round whatever its mix of requests.

At start the runner gives every bucket of `capacities.buckets` its own static metadata: a pinned host buffer and a
device buffer holding all RoundTensors fields of the bucket's Shape in one packed int64 tensor (the fields are
views of it, marked static for torch.compile). `torch.compile(mode="reduce-overhead")` compiles the flat forward
and its cudagraph trees record one CUDA graph per bucket (a warm-up run, a recording run, one replay). A round is
built straight into its bucket's pinned buffer, moved to the GPU in ONE copy, and the bucket's graph replays; no
shape, Python int or launch size depends on the round's contents, so nothing recompiles or re-records after capture.
`launch` enqueues all of that and the copy of the scores back without waiting, and `finish` waits: the serve
scheduler launches the next round before it reads the previous one's answers, so reading answers and building the
next round overlap the device's work (each bucket has two pinned buffers, used in turn, for that).

Checkpoints (flide/checkpoints) are not captured: a round that resumes from a checkpoint or saves one runs eagerly
(`Engine.run` decides before choosing the runner), since its prefix keys, conv windows and snapshots have
round-dependent sizes; rounds without checkpoint work still replay here.

The forward is compiled with dynamic sizes, once for every bucket: with `dynamic=False` Inductor compiled each
bucket anew, ~40 s apiece for Qwen3.5-0.8B on the H200 (over 5 minutes for the 8 default buckets), while every
bucket shares one kernel set whose sizes are arguments. The graphs stay one per bucket: a graph's sizes are fixed
when it is recorded.

cudagraph trees keep their graphs per thread (thread-local tree managers), so every compiled call, the capture
included, runs on ONE graph thread per process, shared by all runners; callers on any thread (the serve scheduler,
benchmark submitters) hand rounds to it and wait (flide/graphs/thread.py; the serve scheduler runs its round loop
on it, so its launches are direct calls). A bucket whose recorded graph is launched without the compiled call
(`runtime.guards: none`, graphs/direct.py) is a plain CUDA graph, which replays from any thread: its rounds are
enqueued by the calling thread itself (`launch`). Either way one round is enqueued at a time (the runner's
`_enqueue` lock): concurrent callers share the buffers. One thread, not one per runner: cudagraph trees set up
their thread-local state in the thread that first imports them, and any other thread but autograd's finds it missing
(an AssertionError in `cudagraph_trees.get_obj`, seen on the H200 when a second engine captured in the same
process).

With `compile=False` the same buckets and buffers run eagerly (the flat forward over bucket-shaped rounds): the
ablation "no CUDA graphs", and the path the CPU tests use to check the bucketed layout. On the CPU `compile=True`
runs the same compile (Inductor's CPU code, no graphs to record): the CPU tests use it to catch graph breaks,
recompiles between buckets and wrong fake kernels before a GPU sees them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from ..config import GUARD_MODES, CapacityConfig
from ..requests import PreparedRequest
from ..round import Round, RoundTensors, Shape, build_round, packed_size
from .buckets import bucket_shape
from .thread import graph_thread

log = logging.getLogger("flide.graphs")


@dataclass
class Bucket:
    shape: Shape
    # two [packed_size] int64 buffers, pinned on CUDA, used in turn: a round is built into one while the copy out of
    # the other (the round launched before it) may still wait in the stream (see `launch`)
    hosts: tuple[torch.Tensor, torch.Tensor]
    device: torch.Tensor  # [packed_size] on the model's device: what the graph reads
    tensors: RoundTensors  # views of `device`, in field order
    # the same views as the compiled forward's arguments (a tuple made once: RoundTensors.items() walks the dataclass
    # fields, ~6 us a call on this CPU, in the host time before every replay)
    views: tuple[torch.Tensor, ...] = ()
    scores: list = field(default_factory=lambda: [None, None])  # per turn: the pinned float32 copy of the scores
    # `runtime.guards: none` (graphs/direct.py): the bucket's recorded CUDA graph, launched by itself, and the device
    # memory its scores come out in; None: the compiled call runs
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None
    busy: list = field(default_factory=lambda: [False, False])  # per turn: launched and not yet finished
    owners: list = field(default_factory=lambda: [None, None])  # per busy turn: the thread that will finish it
    turn: int = 0
    replays: int = 0

    @property
    def host(self) -> torch.Tensor:
        return self.hosts[self.turn]


@dataclass
class Launched:
    """A round whose replay and score copy are enqueued on the device: `GraphRunner.finish` waits for them."""

    round: Round
    scores: torch.Tensor  # the bucket's pinned buffer of this turn: valid once `done` has passed
    done: torch.cuda.Event | None  # recorded after the copy (None off CUDA: everything already ran)
    bucket: Bucket
    turn: int


_OWN_CODES = itertools.count()


def _own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own (the same bytecode under another name), so dynamo's compile cache for it
    starts empty and no other function's compiles are looked up for it."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_OWN_CODES)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class GraphRunner:
    """Runs rounds of bucketed shapes through one compiled, captured forward per bucket."""

    def __init__(self, flat: torch.nn.Module, caps: CapacityConfig, options: int, device: torch.device, pad_id: int,
                 compile: bool = True, progress: bool = True, compiler: str = "inductor", rounding: str = "eager",
                 guards: str = "none",
                 batch_invariant: bool = False, combo_kernels: bool = False):
        self.flat, self.caps, self.options, self.pad_id = flat, caps, options, pad_id
        self.rounding = rounding
        self.combo_kernels = combo_kernels
        if guards not in GUARD_MODES:
            raise ValueError(f"guards must be one of {', '.join(GUARD_MODES)}, got {guards!r}.")
        self.guards = guards
        self._skip_guards = False  # set once the capture has run every bucket with its guards (`runtime.guards`)
        self.batch_invariant = batch_invariant
        self.device = torch.device(device)
        self.compile = compile
        self.compiler = compiler
        self.progress = progress
        if compile and compiler == "cudagraphs" and self.device.type != "cuda":
            raise ValueError(f"The cudagraphs compiler needs a CUDA device; the model is on {self.device}.")
        self._thread = graph_thread()
        self.buckets: dict[int, Bucket] = {}
        self._forward: Callable | None = None
        self._lock = threading.Lock()  # the buckets' busy turns: taken by launches, given back by finishes
        self._turn_freed = threading.Condition(self._lock)
        # one round enqueued at a time (from the graph thread, or from callers with recorded graphs: `launch`)
        self._enqueue = threading.Lock()
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    # ---- start-up ----
    def capture(self) -> None:
        """Allocates every bucket's buffers and (with compile) compiles and records its graph. Logs time and memory."""
        self._thread.call(self._capture)

    def _capture(self) -> None:
        from tqdm.auto import tqdm

        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            # cached free blocks (model building's temporaries) released first, so the delta below is the capture's
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
        if self.compile:
            self._forward = self._compiled_forward()
        # Largest bucket first: the graphs share one memory pool, and a smaller bucket's recording then carves its
        # buffers out of the segments the largest one reserved. Smallest first, each larger recording needed larger
        # blocks than the free ones left behind and reserved new segments: on the H200 (0.8B, 16 buckets to 16,384)
        # the pool held 2.95 GiB where buckets [256, 16384] alone held ~1.9 (session 26).
        shapes = [bucket_shape(tokens, self.caps, self.options) for tokens in sorted(self.caps.buckets, reverse=True)]
        bar = tqdm(shapes, desc="flide: capturing CUDA graphs" if self.compile else "flide: preparing buckets",
                   unit="bucket", disable=not self.progress)
        for shape in bar:
            bar.set_postfix(tokens=shape.tokens)
            bucket = self._allocate(shape)
            self.buckets[shape.tokens] = bucket
            if self.compile:
                build_round([], shape, self.pad_id, out=bucket.host)  # an empty round: every row padding
                bucket.device.copy_(bucket.host)
                # cudagraph trees: a warm-up run (compiles, autotunes), a recording run, then replays
                for _ in range(3):
                    self._replay(bucket)
        self._skip_guards = self.compile and self.guards == "skip"
        self.buckets = dict(sorted(self.buckets.items()))  # smallest first, as the config lists them
        if self.compile and cuda and self.guards == "none":
            self._keep_recorded_graphs()
        if cuda:
            torch.cuda.synchronize(self.device)
            # Free blocks that the warm-up runs (Inductor's first calls) left in the ordinary pool go back to the
            # device: no replay uses them. On the H200 there were next to none (0.8B, session 26: reserved after the
            # start equal to its peak); the graphs' private pools stay (their graphs hold them), and later eager
            # rounds allocate again as they need.
            torch.cuda.empty_cache()
            self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds = time.perf_counter() - start
        log.info("flide: %s %d buckets (%s tokens) in %.1f s; %.2f GiB reserved for graphs and buffers",
                 "captured" if self.compile else "prepared", len(shapes),
                 "/".join(str(s.tokens) for s in shapes), self.capture_seconds, self.graph_memory_bytes / 2**30)

    def _keep_recorded_graphs(self) -> None:
        """`runtime.guards: none`: one more compiled call per bucket, after every bucket is recorded, then the graph
        cudagraph trees replayed for it is kept (`direct.recorded_graph`) and later rounds launch it themselves. A
        bucket whose graph cannot be taken keeps the compiled call (logged with the reason)."""
        from .direct import recorded_graph

        for bucket in self.buckets.values():
            scores = self._replay(bucket)
            try:
                bucket.graph, bucket.output = recorded_graph(scores)
            except LookupError as e:
                log.warning("flide: the %d-token bucket keeps the compiled call (runtime.guards: none): %s",
                            bucket.shape.tokens, e)
        direct = sum(b.graph is not None for b in self.buckets.values())
        log.info("flide: %d of %d buckets launch their recorded graphs directly", direct, len(self.buckets))

    def _allocate(self, shape: Shape) -> Bucket:
        size = packed_size(shape)
        pin = self.device.type == "cuda"
        hosts = tuple(torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(2))
        device = torch.zeros(size, dtype=torch.int64, device=self.device)
        tensors = RoundTensors.from_flat(device, shape)
        if self.compile:
            for _, view in tensors.items():  # noqa: PERF102 (RoundTensors is a dataclass, not a dict)
                # the graph reads these addresses; unmarked inputs would be copied into graph-owned buffers per call
                torch._dynamo.mark_static_address(view)
        return Bucket(shape, hosts, device, tensors, tuple(view for _, view in tensors.items()))

    def _compiled_forward(self) -> Callable:
        flat = self.flat
        names = [f.name for f in fields(RoundTensors)]
        # dynamic sizes: one compile serves every bucket; were a size ever specialised, allow a recompile per bucket
        # rather than dynamo's silent fallback to eager past its default limit of 8
        need = len(self.caps.buckets) + 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, need)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               16 * need)
        # Python floats (norm eps, attention scale) as constants: with dynamic sizes dynamo would make them symbolic,
        # and a nested compile region (FlatBlock) refuses symbolic-float operands
        torch._dynamo.config.specialize_float = True
        # No duck sizing: it gives equal values the same symbol, and guards on that equality. The fields' storage
        # offsets in the packed buffer (int32 words for some, int64 elements for others) can coincide in one bucket
        # and not in the next: with buckets of tokens / 16 branch rows the first bucket's trunk_hi and option_index
        # offsets were both 1,024 and the next bucket recompiled. Sizes that must agree still get one symbol (the
        # ops that need them equal add that guard, true in every bucket)
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False
        # AOT's first-call check of custom ops' aliasing runs them under a TorchDispatchMode, inside which eager vmap
        # (FlexAttention's BlockMask building) fails; our custom ops return fresh tensors (opcheck'd in the tests)
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "check_custom_op_aliasing"):
            functorch_config.check_custom_op_aliasing = False
        # a graph per bucket is the design, not the "too many dynamic shapes" case this limit warns about
        import torch._inductor.config as inductor_config

        if getattr(inductor_config.triton, "cudagraph_dynamic_shape_warn_limit", None) is not None:
            inductor_config.triton.cudagraph_dynamic_shape_warn_limit = need
        if self.batch_invariant:
            # Batch-invariant mode: Inductor's own kernels (norms, pointwise, the GDN gates) must reduce each row in
            # one fixed layout for every bucket. One dynamic-size compile already gives every bucket the same kernels;
            # `deterministic` (where this torch has it) picks their configs by heuristics instead of by timing, so a
            # restart picks the same; `batch_invariant` (torch >= 2.13) keeps reduction configs off the row count.
            # Settings of the thread that sets them (torch's dynamo and Inductor configs are thread-local overrides):
            # here the graph thread, where every compile of the flat forward runs.
            for name in ("deterministic", "batch_invariant"):
                if hasattr(inductor_config, name):
                    setattr(inductor_config, name, True)

        def forward(*tensors: torch.Tensor) -> torch.Tensor:
            return flat(RoundTensors(**dict(zip(names, tensors))))

        # runtime.guards: skip_modules: no guards on the model's modules and parameters (the graphs replay their
        # captured addresses anyway). Dynamo keeps its compiles per code object, and another engine's forward in this
        # process (another model, dtype, kernel variant) would pass an unguarded entry and run the wrong code: so this
        # forward gets a code object of its own, and compiles of its own. (Dynamo's `install_free_tensors`, parameters
        # as graph attributes rather than inputs looked up before each call, fails to trace the nested compile
        # regions, FlatBlock, in torch 2.13: "Freevar has no source".)
        guard_filter = {}
        if self.guards == "skip_modules":
            guard_filter = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            forward = _own_code(forward)

        if self.compiler == "cudagraphs":
            # No Inductor: the eager kernels, captured by cudagraph trees. Static sizes, one dynamo trace per bucket
            # (cheap: nothing is compiled): with dynamic sizes the backend took the graph recorded for one bucket as
            # the match for the next and copied a 512-row input into a 256-row slot (seen on the H200)
            return torch.compile(forward, backend="cudagraphs", dynamic=False, fullgraph=True,
                                 options=guard_filter or None)
        # mode="reduce-overhead" spelled as its options, to add one: the rounding of fused kernels (`runtime.rounding`)
        from torch._inductor import list_mode_options

        options = {**list_mode_options("reduce-overhead"), "emulate_precision_casts": self.rounding == "eager",
                   **guard_filter}
        if self.combo_kernels:  # `runtime.combo_kernels`: Inductor's horizontal fusion of independent kernels
            options["combo_kernels"] = True
        return torch.compile(forward, dynamic=True, fullgraph=True, options=options)

    # ---- rounds ----
    def run(self, requests: list[PreparedRequest], shape: Shape) -> tuple[Round, torch.Tensor]:
        """Builds the round into its bucket and replays the bucket's graph: (round, option scores [O, L] float32 CPU).
        `shape` must be a bucket's shape (`plan_rounds(..., exact=False)` gives it for rounds that are not oversized)."""
        launched = self.launch(requests, shape)
        return launched.round, self.finish(launched)

    def launch(self, requests: list[PreparedRequest], shape: Shape) -> Launched:
        """Enqueues a round: its build into the bucket's host buffer of this turn, the copy to the device, the replay,
        and the copy of its scores into pinned memory, without waiting for the device. `finish` waits.

        A bucket has two host buffers and two score buffers: a launch takes a turn whose buffers no unfinished round
        of the bucket holds, so at most two rounds of one bucket may be in flight, and neither buffer is rewritten
        while the stream may still read or write it. A third launch waits for another thread to finish one (several
        threads calling `decide`), and raises where the thread asking holds both rounds itself or is the graph thread
        (`_take_turn`). The device buffer and the graph's output are
        rewritten only by later work in the same stream, after this round's.

        A bucket that launches its recorded graph itself (`runtime.guards: none`) is enqueued by the calling thread:
        a plain CUDA graph replays from any thread (only the compiled call's cudagraph trees are per thread), and an
        in-process `decide` then skips handing the launch to the graph thread and being woken back (0.06-0.11 ms a
        round on the H200's host, `profile_round.py`'s `handoff`). `_launch` is serialised either way: a bucket's one
        device buffer takes each round's copy just before its replay."""
        bucket = self.buckets.get(shape.tokens)
        if bucket is None or bucket.shape != shape:
            raise ValueError(f"No captured bucket has the shape {shape}; buckets: {sorted(self.buckets)}.")
        on_thread = self._thread.on_thread()
        # the turn is taken by the thread asking, which will finish the round: it may wait for another thread's
        # finish, the graph thread never does (the round it would wait for may be one only it finishes: the serve
        # scheduler's, whose loop runs on it)
        turn = self._take_turn(bucket, threading.get_ident(), may_wait=not on_thread)
        if bucket.graph is not None and not on_thread:
            with torch.cuda.device(self.device):  # the round's copies and event on the engine's device
                return self._launch(requests, bucket, turn)
        started = []

        def launch_on_thread() -> Launched:
            started.append(True)
            return self._launch(requests, bucket, turn)

        try:
            return self._thread.call(launch_on_thread)
        except BaseException:
            if not started:  # never reached the graph thread (closed at exit): `_launch` did not give it back
                self._give_back(bucket, turn)
            raise

    def _take_turn(self, bucket: Bucket, owner: int, may_wait: bool) -> int:
        """Reserves one of the bucket's two turns (host and score buffers) for a round `owner` will finish. With
        both in flight: waits for another thread's `finish` where `may_wait`, else, or when `owner` holds both
        itself (it would wait for itself), raises."""
        with self._lock:
            while True:
                free = [turn for turn in (bucket.turn ^ 1, bucket.turn) if not bucket.busy[turn]]
                if free:
                    break
                if not may_wait or all(held == owner for held in bucket.owners):
                    raise RuntimeError(f"GraphRunner.launch: two rounds of the {bucket.shape.tokens}-token bucket "
                                       "are in flight; finish one first.")
                self._turn_freed.wait()
            bucket.turn = turn = free[0]
            bucket.busy[turn], bucket.owners[turn] = True, owner
        return turn

    def _give_back(self, bucket: Bucket, turn: int) -> None:
        with self._lock:
            bucket.busy[turn], bucket.owners[turn] = False, None
            self._turn_freed.notify_all()

    def _launch(self, requests: list[PreparedRequest], bucket: Bucket, turn: int) -> Launched:
        """Enqueues a round into a reserved turn (given back if that fails), one round at a time."""
        shape = bucket.shape
        try:
            with self._enqueue:
                return self._enqueue_round(requests, shape, bucket, turn)
        except BaseException:
            self._give_back(bucket, turn)
            raise

    def _enqueue_round(self, requests: list[PreparedRequest], shape: Shape, bucket: Bucket, turn: int) -> Launched:
        try:
            host = bucket.hosts[turn]
            round_ = build_round(requests, shape, self.pad_id, out=host)
            bucket.device.copy_(host, non_blocking=True)
            scores = self._replay(bucket)
            out = bucket.scores[turn]
            if out is None or out.shape != scores.shape:
                out = torch.empty(scores.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
                bucket.scores[turn] = out
            # copied out before any later replay can overwrite the graph's output (same stream, in order)
            out.copy_(scores.float(), non_blocking=True)
            done = None
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
        except BaseException:
            if self.device.type == "cuda":
                try:  # nothing of this turn may still run when its buffers are reused (`_launch` gives it back)
                    torch.cuda.synchronize(self.device)
                except Exception:  # noqa: BLE001 (a device error: the original error is the one to raise)
                    pass
            raise
        return Launched(round_, out, done, bucket, turn)

    def finish(self, launched: Launched) -> torch.Tensor:
        """Waits for a launched round's device work: its option scores [O, L] float32 on the CPU (a copy of its own).
        Call it once per launch, also after an error elsewhere: it gives the round's buffers back."""
        try:
            if launched.done is not None:
                launched.done.synchronize()  # releases the GIL while it waits
            return launched.scores.clone()
        finally:
            self._give_back(launched.bucket, launched.turn)

    def _replay(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's graph (or the eager forward) on its device buffer: the scores on the device."""
        if bucket.graph is not None:  # runtime.guards: none (graphs/direct.py)
            bucket.graph.replay()
            bucket.replays += 1
            return bucket.output
        with torch.inference_mode():
            if self._forward is not None:
                torch.compiler.cudagraph_mark_step_begin()  # each round is a new step: the last one's outputs are dead
                if self._skip_guards:
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                        scores = self._forward(*bucket.views)
                else:
                    scores = self._forward(*bucket.views)
            else:
                scores = self.flat(bucket.tensors)
            bucket.replays += 1
            return scores

    def close(self) -> None:
        """Drops the buckets' buffers (the graphs stay with cudagraph trees until the process ends); the shared
        graph thread lives on for other runners."""
        self.buckets.clear()  # the recorded graphs kept by `runtime.guards: none` go with them
        self._forward = None
