"""The engine: System One requests in, answers out, every round of requests as one flat forward pass.

    engine = flide.patch(model, tokenizer)            # any supported transformers model
    engine.decide({"state": ..., "questions": {...}})  # -> {"name": answer}
    engine.decide([r1, r2, ...])                       # packed into as few rounds as the capacities allow
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import FlideConfig, load_config
from .graphs.buckets import exact_shape, holds, plan_rounds
from .loading import DTYPES
from .piece_cache import PieceCache
from .precision import gemm_reductions
from .requests import PreparedRequest, PromptTokenizer, RequestError, tokenize_request
from .round import Footprint, Round, build_round, footprint

logger = logging.getLogger("flide.engine")

def _temperature() -> type:
    from transformers.generation.logits_process import TemperatureLogitsWarper

    return TemperatureLogitsWarper


# The decision config's default logits processor (temperature 1.0 for every type): it divides each row of scores on
# its own and never reads the prompt's tokens, so `Engine.answers` applies chains of it to a whole group at once
TEMPERATURE = _temperature()


@dataclass
class Usage:
    input_tokens: int  # each state (and each sub-trunk of nested forks) counted once
    stream_tokens: int  # the request's tokens in a round's stream without checkpoints (= input_tokens)
    prompt_tokens: int  # what one sequence per question would have computed
    cached_tokens: int = 0  # state tokens resumed from checkpoints in its last round (not computed)
    computed_tokens: int = 0  # tokens computed for it in its last round: stream_tokens - cached_tokens


class Engine:
    """Answers decision requests with a patched transformers model. Build it with `flide.patch` or
    `Engine.from_pretrained`."""

    def __init__(self, model, tokenizer, config: FlideConfig | dict | str | None = None, decision_config=None):
        from transformers.decision import DecisionConfig
        from transformers.decision.modeling_utils import DecisionMixin

        from .models import adapt

        self.config = load_config(config)
        runtime = self.config.runtime
        if runtime.dtype != "auto":
            model = model.to(DTYPES[runtime.dtype])
        if runtime.device != "auto":
            model = model.to(runtime.device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        if decision_config is None:  # as pipeline("decision") picks it
            if isinstance(model, DecisionMixin):
                decision_config = model.decision_config
            else:
                decision_config = DecisionConfig.from_pretrained(getattr(model, "name_or_path", "") or "")
        decision_config.validate_noul_options()
        self.decision_config = decision_config
        from .ops.registry import concrete

        # the variants `auto` picks on the model's device: what runs, and what the graph runner checks
        device = next(model.parameters()).device
        self.kernels = concrete(self.config.kernels, device)
        self.prompts = PromptTokenizer(tokenizer, decision_config, runtime.tokenization,
                                       piece_cache=PieceCache(runtime.piece_cache_chars),
                                       question_cache_entries=runtime.question_cache_entries)
        nested_ops = self._nested_ops(device)
        self.prompts.nested = nested_ops is not None
        self.flat = adapt(model, tokenizer, self.kernels, residual=runtime.residual, nested_ops=nested_ops)
        tok = self.prompts.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        # Options per readout row: the most labels any question type can use
        self.max_options = max([26, 2] + [len(labels) for labels in decision_config.labels.values()])
        # The head's label lookup encodes labels with the shared tokenizer on a cache miss; threads that prepare
        # requests at once (flide serve) take turns there (fast tokenizers are not safe to share while encoding)
        self._head_lock = threading.Lock()
        self._scheduler = None  # started by the first `submit`
        self._scheduler_lock = threading.Lock()
        self.runner = self._graph_runner() if self._use_graphs() else None
        # growing states: the checkpoint cache, and the kernels' companions that resume and snapshot
        self.checkpoints, self._resumable = self._checkpoint_cache()

    def _nested_ops(self, device) -> dict | None:
        """The kernels' nested-fork companions where `runtime.nested_forks` turns sub-trunks on, else None. On CUDA
        too since session 25: the whole engine with graphs equals the pipeline on the H200 within 1.1e-5 with them
        (tests/gpu/test_engine_gpu.py::test_nested_forks_equal_pipeline_on_gpu; MultiRC's replay 1,028 -> 761
        tokens, GPU 5.68 -> 4.47 ms, benchmarks/results/h200_profile_0_8b_nested_forks_*.json)."""
        from .ops.registry import nested

        mode = self.config.runtime.nested_forks
        if mode == "off":
            return None
        ops, missing = nested(self.kernels, device)
        reasons = [f"these kernel variants have no nested form: {', '.join(missing)}"] if missing else []
        if self.prompts.mode != "split":
            reasons.append(f"the tokenization is {self.prompts.mode!r} (a sub-trunk is cut where prompts are split)")
        if self.config.checkpoints.enabled:
            reasons.append("checkpoints are on (their rounds' kernels take no sub-trunks)")
        if self.kernels.batch_invariant:
            # a leaf asked alone has no sub-trunk: its own segment's attention tiles would start at the shared line
            # instead of after it, a different grouping of its sums (the invariant Triton kernel's tiles start at
            # each range), so it could not keep the bits it has inside its request
            reasons.append("batch-invariant mode is on (a question asked alone must keep the bits it has as a leaf)")
        if reasons and mode == "on":
            raise ValueError(f"`runtime.nested_forks: on` cannot run: {'; '.join(reasons)}.")
        if reasons:
            logger.info("nested forks are off: %s", "; ".join(reasons))
            return None
        return ops

    def _checkpoint_cache(self):
        from .checkpoints import CheckpointCache
        from .ops.registry import resumable

        cfg = self.config.checkpoints
        if not cfg.enabled:
            return None, None
        try:
            ops = resumable(self.kernels, self.device)
        except ValueError as error:
            logger.warning("checkpoints are off: %s", error)
            return None, None
        return CheckpointCache(int(cfg.cache_gb * 2**30)), ops

    def _use_graphs(self) -> bool:
        from .ops.registry import not_capturable

        mode = self.config.runtime.graphs
        if self.kernels.batch_invariant and self.device.type == "cuda":
            if self.config.runtime.compiler != "inductor":
                # the cudagraphs compiler captures ATen's eager norms, whose reduction layout follows the row count
                raise ValueError("`kernels.batch_invariant: true` needs `runtime.compiler: inductor` on CUDA (the "
                                 "`cudagraphs` compiler runs eager reductions whose layout depends on the stream "
                                 "length).")
            if mode == "off" or not_capturable(self.kernels):
                logger.warning("batch-invariant mode without CUDA graphs: eager CUDA rounds run ATen's norms, whose "
                               "reduction layout may follow the stream length; invariance is checked under graphs")
        if mode == "off":
            return False
        reasons = []
        if self.device.type != "cuda":
            reasons.append(f"the model is on {self.device.type}, not CUDA")
        blocked = not_capturable(self.kernels)
        if blocked:
            reasons.append(f"these kernel variants cannot be captured: {', '.join(blocked)}")
        if reasons and mode == "on":
            raise ValueError(f"`runtime.graphs: on` cannot hold: {'; '.join(reasons)}.")
        return not reasons

    def _graph_runner(self):
        from .graphs.runner import GraphRunner

        runner = GraphRunner(self.flat, self.config.capacities, self.max_options, self.device, self.pad_id,
                             compiler=self.config.runtime.compiler, rounding=self.config.runtime.rounding,
                             combo_kernels=self.config.runtime.combo_kernels,
                             guards=self.config.runtime.guards,
                             batch_invariant=self.kernels.batch_invariant)
        with gemm_reductions(self.config.runtime.gemm_reductions, self.device):  # the graphs record cuBLAS's picks
            self.tune_kernels()
            runner.capture()
        return runner

    def tune_kernels(self) -> None:
        """One eager round of a typical mix, run before the graphs are captured. Kernels that autotune at their first
        call pick their configs then, for the rest of the process: fla's chunked gated delta kernels key their
        configs by head sizes only, not by the stream, and the capture's first call is an empty round, on which
        every config returns at once and the pick would be noise (their grid, e.g. how many programs split a long
        state's scan, decides how fast a long state runs). The mix: one long state with 8 questions, and RACE-like
        requests (240-token states, 4 questions each), within the largest bucket and the request capacity."""
        import numpy as np

        from .testing import synthetic_request

        caps = self.config.capacities
        budget = max(caps.buckets)
        rng = np.random.default_rng(0)
        vocab = self.flat.text_model.embed_tokens.num_embeddings

        def ids(n: int) -> np.ndarray:
            return rng.integers(0, vocab, size=n)

        long_state, question = min(2048, budget // 4), min(48, budget // 16)
        requests = [synthetic_request(ids(long_state), [ids(question) for _ in range(8)])]
        used = long_state + 8 * question
        while len(requests) < min(caps.requests, 7) and used + 480 <= budget // 2:
            requests.append(synthetic_request(ids(240), [ids(60) for _ in range(4)]))
            used += 480
        planned = plan_rounds([footprint(r) for r in requests], caps, self.max_options, exact=True)[0]
        self.forward(build_round([requests[i] for i in planned.requests], planned.shape, self.pad_id))

    @property
    def device(self) -> torch.device:
        return self.flat.head.weight.device

    @classmethod
    def from_pretrained(cls, name_or_path: str, config: FlideConfig | dict | str | None = None, **kwargs) -> Engine:
        """Loads a model (causal LM or Jev decision model) and its tokenizer from a local folder or hub id."""
        from .loading import load_model

        cfg = load_config(config)
        model, tokenizer = load_model(name_or_path, cfg, **kwargs)
        return cls(model, tokenizer, cfg)

    # ---- requests ----
    def prepare(self, request: Any, prompts: PromptTokenizer | None = None) -> PreparedRequest:
        """Validates and tokenizes one request; raises RequestError (a ValueError) naming the offending field.

        `prompts`: the PromptTokenizer to use (a thread's own copy, `engine.prompts.copy_for_thread()`, when
        several threads prepare requests at once); default the engine's."""
        return self.finish_prepare(tokenize_request(request, prompts or self.prompts,
                                                    self.config.limits.max_questions))

    def finish_prepare(self, prepared: PreparedRequest) -> PreparedRequest:
        """What `prepare` adds to a tokenized request (`flide.requests.tokenize_request`, maybe from a worker
        process): the prompt length limit, each question's head rows, and its part of any round."""
        limit = self.config.limits.max_prompt_tokens
        # not with checkpoints (saves and resumes are cut in a state's own tokens), nor in batch-invariant mode (a
        # question asked alone must have the bits it has forked inside a request of several questions)
        prepared.set_merge_lone(self.config.runtime.merge_lone_questions and not self.config.checkpoints.enabled
                                and not self.kernels.batch_invariant)  # before its round layout is made below
        for branch in prepared.branches:
            n = prepared.prefix_length(branch) + len(branch.tokens)
            if n > limit:
                raise RequestError("state", f"the prompt of question {branch.questions[0].name!r} has {n} tokens; "
                                            f"the limit is {limit} (`limits.max_prompt_tokens`).", 413)
            branch.options = []
            for question in branch.questions:
                try:
                    with self._head_lock:
                        rows = self.flat.head.option_rows(question)
                    branch.options.append(rows)
                except ValueError as error:
                    raise RequestError(f"questions.{question.name}", str(error), 400) from None
        # its part of any round, made here (the caller's or a prepare thread), not per round
        if prepared.round_layout.max_id >= self.vocab_rows:
            raise self._outside_vocabulary(prepared)
        return prepared

    @functools.cached_property
    def vocab_rows(self) -> int:
        """Rows of the model's input embedding: a token id must be below it."""
        return self.flat.text_model.embed_tokens.weight.shape[0]

    def _outside_vocabulary(self, prepared: PreparedRequest) -> RequestError:
        """The error for a request whose tokens include an id the model has no embedding for (a tokenizer that does
        not match the model), naming the part that holds it."""
        parts = [("state", t) for t in prepared.trunks]
        parts += [(f"questions.{b.questions[0].name}", b.tokens) for b in prepared.branches]
        parts += [(f"questions.{b.questions[0].name}", prepared.subs[b.sub].tokens) for b in prepared.branches
                  if b.sub >= 0]
        field, top = next(((f, int(ids.max())) for f, ids in parts if len(ids) and int(ids.max()) >= self.vocab_rows),
                          ("request", prepared.round_layout.max_id))
        return RequestError(field, f"tokenizes to id {top}, outside the model's vocabulary of {self.vocab_rows} "
                                   "embedding rows: the tokenizer does not match the model.", 400)

    def decide(self, request: Any | list) -> dict | list[dict]:
        """Answers one request (dict or JSON string) -> {question name: answer}, or a list of requests -> a list of
        answer dicts, in order. A bad request raises RequestError (ValueError) naming its field; in a list, the
        error names the request's index too."""
        if isinstance(request, list):
            prepared = []
            for index, item in enumerate(request):
                try:
                    prepared.append(self.prepare(item))
                except RequestError as error:
                    raise RequestError(f"requests[{index}].{error.field}", error.message, error.status) from None
            return self.run(prepared)
        return self.run([self.prepare(request)])[0]

    def submit(self, request: Any, prompts: PromptTokenizer | None = None) -> Future:
        """Queues one request for the next round, packed with whatever other threads submit meanwhile (the
        continuous rounds of `flide serve`, in process): returns a `concurrent.futures.Future` of its answers.
        Prepares it on the calling thread (with `prompts`, a thread's own copy, when given); a bad request raises
        RequestError here. Raises `flide.serve.Overloaded` when `serve.max_queue` requests already wait."""
        from .serve.scheduler import Overloaded

        scheduler = self.scheduler()
        ticket = scheduler.admit(f"submit-{id(request)}")
        if ticket is None:
            raise Overloaded(f"{self.config.serve.max_queue} requests already wait (`serve.max_queue`).")
        try:
            prepared = self.prepare(request, prompts) if prompts is not None else scheduler.prepare(request)
            return scheduler.submit(ticket, prepared)
        except BaseException:
            scheduler.release(ticket)
            raise

    def scheduler(self):
        """The scheduler behind `submit` (`flide.serve.Scheduler`, the one `flide serve` runs: a model thread running
        rounds back to back, packing what waits), started on first use."""
        with self._scheduler_lock:
            if self._scheduler is None:
                from .serve.scheduler import Scheduler

                scheduler = Scheduler(self, self.config.serve)
                scheduler.start()
                self._scheduler = scheduler
            return self._scheduler

    def usage(self, prepared: PreparedRequest) -> Usage:
        cached = prepared.cached_tokens
        return Usage(prepared.input_tokens, prepared.stream_tokens, prepared.prompt_tokens, cached,
                     prepared.stream_tokens - cached)

    # ---- rounds ----
    def run(self, prepared: list[PreparedRequest]) -> list[dict]:
        """Answers prepared requests in as few flat rounds as the capacities allow."""
        with gemm_reductions(self.config.runtime.gemm_reductions, self.device):
            return self._run(prepared)

    def start(self, prepared: list[PreparedRequest]) -> PendingRound:
        """Starts answering prepared requests; `PendingRound.result()` gives their answers (as `run` does). A round
        that replays a captured graph is only enqueued on the device here and `result()` waits for it; anything else
        (eager rounds, checkpoint work, requests that need several rounds) runs here. The serve scheduler starts the
        next round before it reads the last one's answers, so that host work overlaps the device's; at most two
        started rounds of one bucket may wait for their `result()` at once (GraphRunner.launch)."""
        with gemm_reductions(self.config.runtime.gemm_reductions, self.device):
            graphs = self.runner is not None
            planned = plan_rounds([self.footprint(p) for p in prepared], self.config.capacities, self.max_options,
                                  exact=not graphs)
            if len(planned) != 1:
                return PendingRound.done(self._run(prepared, planned))
            return self._start_round(prepared, planned[0].requests, planned[0], graphs)

    def _run(self, prepared: list[PreparedRequest], plans: list | None = None) -> list[dict]:
        """`plans`: `plan_rounds` of `prepared` as `_run` makes it, when the caller has it already."""
        answers: list[dict] = [{} for _ in prepared]
        # Eager rounds take their own size; with graphs a round takes its bucket's shape and replays its graph, and
        # only a request larger than every bucket runs eagerly in a shape of its own (the same flat forward)
        graphs = self.runner is not None
        if plans is None:
            needs: list[Footprint] = [self.footprint(p) for p in prepared]
            plans = plan_rounds(needs, self.config.capacities, self.max_options, exact=not graphs)
        # With checkpoints the plan counts what the cache holds now (`footprint`); what a round resumes is looked up
        # again when it is built, so a request also resumes from what an earlier round of this call saved
        for planned in plans:
            requests = [prepared[i] for i in planned.requests]
            got = self._start_round(requests, range(len(requests)), planned, graphs).result()
            for index, answer in zip(planned.requests, got):
                answers[index] = answer
        return answers

    def _start_round(self, prepared: list[PreparedRequest], order, planned, graphs: bool) -> PendingRound:
        """One planned round of `prepared[i] for i in order`: launched (graph replay) or computed (eager)."""
        requests = [prepared[i] for i in order]
        work = self._checkpoint_work(requests)
        for request, cached in zip(requests, work.cached_tokens if work is not None else [0] * len(requests)):
            request.cached_tokens = cached
        pending = PendingRound(self, requests, list(order), len(prepared))
        # a checkpoint planned for but evicted before the build leaves the whole state to compute: the bucket may
        # then be too small, and the round runs eagerly in a shape of its own
        if graphs and not planned.oversized and work is None and (
                self.checkpoints is None or holds(planned.shape, sum(map(footprint, requests[1:]),
                                                                     footprint(requests[0])))):
            pending.launched = self.runner.launch(requests, planned.shape)
            return pending
        if work is not None:  # resumes or saves: eagerly (the captured graphs know no checkpoints)
            layouts = work.layouts(requests)
            counts = [lay.counts for lay in layouts]  # (state tokens, question tokens, states, branches, reads)
            need = Footprint(sum(c[0] + c[1] for c in counts), sum(c[2] for c in counts),
                             sum(c[3] for c in counts), sum(c[4] for c in counts), len(requests))
            pending.round = build_round(requests, exact_shape(need, self.max_options), self.pad_id, layouts=layouts)
            work.bind(pending.round, self.device)
            pending.scores = self.forward(pending.round, work)
            work.store()
        else:
            pending.round = build_round(requests, planned.shape, self.pad_id)
            pending.scores = self.forward(pending.round)
        return pending

    def footprint(self, request: PreparedRequest) -> Footprint:
        """What `request` needs of a round: with checkpoints, without the state tokens it would resume now (a long
        agent history whose last step saved a checkpoint needs a round's room for its new tail, not the whole)."""
        need = footprint(request)
        if self.checkpoints is None:
            return need
        from .checkpoints import resumable_tokens

        skipped = resumable_tokens(self.checkpoints, request)
        return dataclasses.replace(need, tokens=need.tokens - skipped) if skipped else need

    def _checkpoint_work(self, requests: list[PreparedRequest]):
        """The round's checkpoint work (`RoundCheckpoints`), or None without checkpoints or when there is none."""
        if self.checkpoints is None:
            return None
        from .checkpoints import RoundCheckpoints

        work = RoundCheckpoints(self.checkpoints, self.config.checkpoints, self._resumable, requests)
        return None if work.empty else work

    def forward(self, round_: Round, checkpoints=None) -> torch.Tensor:
        """One flat forward pass: the option scores [readout rows, options] of a round, on the CPU in float32.
        `checkpoints`: the round's bound `RoundCheckpoints` (resumes and saves), or None."""
        tensors = round_.tensors.to(self.device)
        with torch.inference_mode():
            scores = self.flat(tensors, checkpoints) if checkpoints is not None else self.flat(tensors)
        return scores.float().cpu()

    def answers(self, round_: Round, scores: torch.Tensor) -> dict[int, dict]:
        """Each read's scores through the decision config's logits processors, softmax, and `Question.answer`.

        Reads of one question type and option count go through their processors and softmax as one batch when
        every processor of that type is a temperature (`TEMPERATURE`: row by row, the prompt unread): calling a
        LogitsProcessorList per read cost ~0.1 ms each (it inspects its processors' signatures every call), so 64
        requests of 4 questions spent more time here than on the GPU. The batch runs in numpy: four torch ops a
        group cost ~75 us on this CPU and ~0.3 ms on the H200 host (a RACE request alone spent 0.47 ms here,
        2026-11-30); the same float32 division, and the softmax as torch's CPU kernel computes it (max, exp of the
        differences, their sum, a division), equal to it within an ulp or two of exp. Other processors see each read
        alone, with its prompt's tail tokens, as transformers' pipeline calls them."""
        from collections import defaultdict

        reads = round_.reads
        processors = self.decision_config.logits_processors
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        for row, read in enumerate(reads):
            groups[(read.question.type, read.options)].append(row)
        probabilities: list = [None] * len(reads)
        table = None  # the scores as a numpy array (a view), for chains of temperatures
        for (kind, options), rows in groups.items():
            chain = processors[kind]
            if all(type(p) is TEMPERATURE for p in chain):
                if table is None:
                    table = scores.numpy()
                block = table[rows, :options]
                for processor in chain:
                    block = block / np.float32(processor.temperature)
                block = np.exp(block - block.max(-1, keepdims=True))
                for row, values in zip(rows, (block / block.sum(-1, keepdims=True)).tolist()):
                    probabilities[row] = values
            else:
                for row in rows:
                    s = chain(torch.from_numpy(reads[row].tail)[None], scores[row, :options])
                    probabilities[row] = s.softmax(-1).tolist()
        out: dict[int, dict] = {}
        for read, values in zip(reads, probabilities):
            out.setdefault(read.request, {})[read.question.name] = read.question.answer(values)
        return out


class PendingRound:
    """A started round (`Engine.start`): `result()` -> the answers of the requests given, in their order. For a
    launched graph replay it waits for the device, once (it must be called: it gives the bucket's buffers back)."""

    def __init__(self, engine: Engine | None, requests: list[PreparedRequest], order: list[int], size: int):
        self.engine, self.requests, self.order, self.size = engine, requests, order, size
        self.launched = None  # GraphRunner.Launched, for a replay
        self.round: Round | None = None
        self.scores: torch.Tensor | None = None
        self._answers: list[dict] | None = None

    @classmethod
    def done(cls, answers: list[dict]) -> PendingRound:
        pending = cls(None, [], [], len(answers))
        pending._answers = answers
        return pending

    def wait(self) -> None:
        """Until the device is done with a launched replay (its answers are then read without waiting)."""
        if self.launched is not None and self.launched.done is not None:
            self.launched.done.synchronize()

    def device_done(self) -> bool:
        """Whether the device is done with it, without waiting (an eager or finished round: True)."""
        return self.launched is None or self.launched.done is None or self.launched.done.query()

    @property
    def bucket_tokens(self) -> int | None:
        """The captured bucket a launched replay runs in (None for an eager round, or once `result()` was read)."""
        return None if self.launched is None else self.launched.bucket.shape.tokens

    def result(self) -> list[dict]:
        if self._answers is None:
            if self.launched is not None:
                launched, self.launched = self.launched, None
                self.round, self.scores = launched.round, self.engine.runner.finish(launched)
            by_request = self.engine.answers(self.round, self.scores)
            answers: list[dict] = [{} for _ in range(self.size)]
            for local, (index, request) in enumerate(zip(self.order, self.requests)):
                if local in by_request:
                    answers[index] = {q.name: by_request[local][q.name] for q in request.questions}  # question order
            self._answers = answers
        return self._answers

