"""Typed, frozen engine configuration, loaded from YAML and validated on load.

Every section is a frozen dataclass; an unknown key anywhere is an error that lists the valid keys, so a typo in a
YAML file never silently falls back to a default. Kernel variants are names checked against the op registry when a
model is patched (`flide.patch`), not here, so this module stays free of torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GDN_CHUNK = 64  # the chunk length of the chunked gated delta rule (and of fla's kernels)


@dataclass(frozen=True)
class KernelConfig:
    """Which registered variant runs each op (see `flide.ops.registry`). `auto`: the fastest variant that runs on the
    model's device (`flide.ops.registry.AUTO`), the pure-torch references on the CPU."""

    fork_attention: str = "auto"
    gated_delta: str = "auto"
    fork_conv: str = "auto"
    # the gated RMS norm that ends a GDN layer, with the fork's row select: torch (the model's own norm module, fused
    # by Inductor) or triton (one kernel that reads each row from the call that wrote it)
    gated_norm: str = "auto"
    # selective: the last layer's MLP and the head run only at readout rows and only the label logits are computed.
    # full: the last layer and the whole vocabulary run at every token, then the rows are read (the ablation).
    # invariant: selective with every score summed in a fixed order. auto: selective, or invariant when
    # batch_invariant is on.
    readout: str = "auto"
    # the decoder's linear layers: auto keeps the model's own nn.Linear (`torch`) unless batch_invariant is on
    linear: str = "auto"
    # a gated MLP's silu(gate(x)) * up(x): torch (the model's modules: one GEMM over the stacked gate / up weight, then
    # a pointwise kernel) or triton (SiLU and the product in the GEMM's epilogue: the [T, 2I] intermediate never
    # reaches memory; CUDA). auto: torch (`flide.ops.registry.AUTO`)
    gated_mlp: str = "auto"
    # batch-invariant mode: every answer has the same bits whatever else shares its round (`auto` picks only
    # batch-invariant variants, `flide.ops.registry.AUTO_INVARIANT`; a variant named that is not one is an error)
    batch_invariant: bool = False
    # a GDN layer's conv also lays out q / k (normalised) / v and computes the layer's gates for the gated delta
    # kernels, in its own launch, where its variant and the gated delta variant's state call allow it (Triton conv,
    # fla / fla_cuda; `flide.ops.fork_conv.QKV_KERNELS`); false: the separate launches (the A/B)
    fuse_conv_layout: bool = True
    # a Qwen3.5 attention layer's q / k head norms and partial rotary embedding in one Triton launch
    # (`flide.ops.qk_prep`) instead of the small kernels Inductor makes of the model's modules: `auto` where the model
    # is on CUDA with Triton (H200, session 22: 30 launches fewer a 0.8B replay, RACE GPU -1.4 %, QuALITY -0.6 %),
    # `on` requires it (an error elsewhere), `off` keeps the modules (YAML true / false read as on / off)
    fuse_attention_prep: str = "auto"
    # a GDN layer's question call: every question from its state's recurrent state by the recurrent kernel
    # (`recurrent`), or in chunked form from the state call's chunk-local steps (`chunked`: 64-token chunk steps, the
    # kkt + solve over the questions' chunks too; a nested fork's leaves and the sub-trunks they continue stay
    # recurrent). Needs the fused conv layout with `gated_delta: fla` (CUDA); `auto`: chunked there where
    # `flide.ops.gated_delta.fla.CHUNKED_QUESTIONS` says (on; its comment has the measurements: H200, RACE 2.77 vs
    # 2.99 ms of GPU time, QuALITY 27.5 vs 28.5) and not in batch-invariant mode, else recurrent
    gated_delta_questions: str = "auto"


@dataclass(frozen=True)
class CapacityConfig:
    """Fixed capacities of a round's metadata. A round takes the smallest token bucket that holds it."""

    # ~1.12x apart from 1,536 tokens (26 buckets; the family before session 32 was ~1.25x apart, 16 buckets, now
    # configs/h200/buckets_coarse.yaml): padding rows cost full GEMM and pointwise work (H200, 2026-12-01: 16 RACE
    # requests, 7,392 tokens, 31.7 ms of device time in the 8,192 bucket, 34.7 in 9,216, 42.3 in 12,288: ~2.4 ms per
    # 1,000 padding rows). Same-call replay A/B on an H100 (session 32,
    # `h100_profile_0_8b_session32_buckets_{fine,coarse}.json`): GPU ms sweep 1 (2,185 tokens: 2,304 vs 2,560) 8.42 vs
    # 8.79, sweep 8 (3,123: 3,584 vs 4,096) 13.77 vs 14.70, RACE 3.06 vs 3.06; reserved after start 3.242 vs 3.240 GiB
    # (the graphs share one pool, recorded largest bucket first: the extra graphs hold almost nothing; the 4.3 vs 2.7
    # GiB of 2026-12-01 was before that); capture 32.9 vs 11.5 s with a compile cache of the old family (each bucket
    # compiles and records its own graph). Under load (`flide serve`, H200, 2026-12-01, `h200_serve_ab_buckets.md`) this
    # family gave 374 vs 392 req/s at 8 clients and 475 vs 457 at 32: within the run-to-run spread. Below 1,536 a round
    # is latency-bound: six more buckets under 2,048 (384, 448, 640, 896, 1,152, 1,792; H200, 2026-12-01,
    # `h200_profile_0_8b_buckets_small.json`) gave RACE (437 tokens) 3.52 ms in 448 vs 3.50 in 512, MultiRC (1,028) 5.96
    # in 1,152 vs 6.19 in 1,280. Up to 16,384: every single request of the benchmarks fits (QuALITY whole: ~8k tokens),
    # larger rounds split into several replays (with 32,768 as well, peak memory of 0.8B was 4.1 GiB on the H200, over
    # issue 8's 3.4 GiB).
    buckets: tuple[int, ...] = (256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 2816, 3072, 3584, 4096, 4608,
                                5120, 5632, 6144, 7168, 8192, 9216, 10240, 11264, 12288, 14336, 16384)
    requests: int = 64
    states: int = 192
    branches: int = 1024
    readout_rows: int = 1024

    def chunks(self, tokens: int) -> int:
        """GDN chunk capacity of a bucket: whole chunks of the stream plus one partial chunk per segment."""
        return tokens // GDN_CHUNK + self.states + self.branches


@dataclass(frozen=True)
class LimitConfig:
    max_questions: int = 64
    max_prompt_tokens: int = 262144


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: the model's own dtype; or float32, bfloat16, float16
    # split: each state is tokenized once and each question's tail once; full: each prompt whole (slow, the oracle);
    # auto: split where the tokenizer's structure proves the cut exact (byte-level BPE with Qwen's regex,
    # SentencePiece without pieces across newlines) and probes confirm it, else full (flide/split_check.py)
    tokenization: str = "auto"
    # nested forks: lines that several questions of a state share after it (a judge's question line before each
    # candidate answer: MultiRC) are computed once as a sub-trunk that those questions fork from in turn. auto: on
    # where the tokenization splits and the kernel variants have nested companions (`flide.ops.registry.nested`) and
    # checkpoints and batch-invariant mode are off (`Engine._nested_ops`); on: the same or an error saying why not;
    # off: each question carries its whole tail
    nested_forks: str = "auto"
    # a state asked one question (its only prompt, no sub-trunk) runs as ONE sequence with it: nothing forks from it,
    # so the question's tokens join the states' chunked gated delta call instead of the token-by-token question call
    # (sweep 1 on the H200: that kernel took 2.25 of the replay's 11 ms of GPU for one ~180-token question). Off with
    # checkpoints (their saves and resumes are cut in the state's own tokens) and in batch-invariant mode (a question
    # asked alone keeps the bits it has forked among others)
    merge_lone_questions: bool = True
    # auto: one CUDA graph per bucket (torch.compile reduce-overhead) when on CUDA and every kernel variant can be
    # captured, else eager rounds of their own size; on: graphs or an error saying why not; off: eager (the ablation)
    graphs: str = "auto"
    # what compiles the graphs: inductor (torch.compile mode="reduce-overhead": fused kernels, minutes to compile) or
    # cudagraphs (torch.compile backend="cudagraphs": the eager kernels captured as they are, seconds to start)
    compiler: str = "inductor"
    # where Inductor's fused kernels round: eager: every intermediate to the model's dtype where eager PyTorch does
    # (Inductor's emulate_precision_casts), so the compiled model rounds where the Hugging Face module (and the
    # pipeline) rounds; fused: intermediates of a fused kernel stay fp32 (Inductor's default). Random 4B, MultiRC,
    # bf16 on the H200: TV to the float32 reference 4.36 points fused vs 1.27 with the eager kernels (fidelity bisection)
    rounding: str = "eager"
    # the dtype of the residual stream between layers: model: the model's dtype, rounded after every add as the Hugging
    # Face module (and the pipeline) rounds it; float32: kept in fp32 from the embedding to the final norm (each norm's
    # output, what the mixers and MLPs read, is still rounded to the model's dtype). Only half-precision models differ:
    # float32 drops two roundings of the whole hidden state a layer, the largest rounding steps of a bf16 forward (the
    # stream's magnitude grows with depth, its updates do not), so answers stay nearer the float32 model's
    residual: str = "model"
    # Inductor's combo kernels (horizontal fusion): independent kernels of a layer launched as one (then: a GDN
    # layer's g and beta kernels, which the fused conv now computes itself). Opt-in: on the H200 (session 21, 0.8B)
    # RACE 473 -> 426 launches, GPU 3.44 -> 3.41 ms, but QuALITY 32.7 -> 33.0 and sweep 64 40.2 -> 40.6 ms
    # (benchmarks/results/h200_profile_0_8b_combo_ab_*.json)
    combo_kernels: bool = False
    # what runs before each replay after the capture. none (the default): no compiled call at all: a round launches
    # the CUDA graph that cudagraph trees recorded for its bucket (flide/graphs/direct.py; a bucket whose graph cannot
    # be taken keeps the compiled call, logged). check: the compiled call with all of dynamo's guards; skip_modules:
    # compiled without guards on the model's modules and parameters (`torch.compiler.skip_guard_on_all_nn_modules_
    # unsafe`: the inputs' and global state's guards stay); skip: torch's `set_stance(skip_guard_eval_unsafe=True)`
    # around the compiled calls (only the guards that tell dynamo's cache entries apart run).
    # Why safe: every call passes a bucket's own static views, and the graphs replay the parameters' captured addresses
    # whatever the guards say, so a module changed after the capture is not served either way. What it saves is host
    # time before each replay, while the GPU waits. H200, Qwen3.5-0.8B, bf16 (2026-12-01, `benchmarks/profile_round.py
    # --config configs/h200/guards_none.yaml`, one call each): RACE alone 4.25 ms with none vs 4.78 with check (the
    # compiled call's host time 0.08 vs 0.51 ms), MultiRC 7.18 vs 7.40, QuALITY 34.1 vs 35.4, sweep 1 / 64 12.7 / 42.2
    # vs 13.2 / 42.7; the same answers bit for bit (tests/gpu/test_graphs_gpu.py). skip (session 15) took RACE's
    # compiled call from 0.86 to 0.41 ms. An engine with skip_modules compiles its own forward (another engine's
    # unguarded compile must not serve it, nor its theirs).
    guards: str = "none"
    # how cuBLAS may sum the bf16/fp16 GEMMs of Flide's forward passes (flide/precision.py): torch: as the process
    # has it (torch's default: split-K partials may be added in reduced precision); fp32: partials added in fp32;
    # single_pass: no split-K at all, every output summed in one pass over K (a row's bits then depend on the
    # kernel cuBLAS picks for the bucket, not on how K was split; slower for small buckets with large K)
    gemm_reductions: str = "torch"
    # the prompt piece cache (flide/piece_cache.py): tokens of state and template pieces seen before, so a history
    # sent again (agents, conversations) is not tokenized again; its bound in characters (~2 bytes of ids each), 0: off
    piece_cache_chars: int = 1 << 23
    # parsed questions kept by their JSON (flide.questions.QuestionCache): routers and guards send the same questions
    # with every state, and transformers' parse costs ~0.15 ms a question (the common shape, parsed in ~3 us by
    # Flide's mirror of it, is not kept); 0: off
    question_cache_entries: int = 4096


@dataclass(frozen=True)
class ServeConfig:
    """`flide serve` (flide/serve): admission, time limits and body limits of the HTTP server."""

    max_queue: int = 1024  # requests admitted but not yet in a round; one more is answered 503 with Retry-After
    request_timeout_s: float = 60.0  # from arrival to answer; past it the request is answered 504
    max_body_bytes: int = 16777216  # a larger body is answered 413 before it is read
    max_json_depth: int = 64  # deeper nesting of arrays and objects is answered 422
    prepare_threads: int = 4  # threads that render and tokenize requests, each with its own tokenizer copy
    # a request that arrives while no other is in flight, with a body of at most this many bytes, is prepared on the
    # event loop itself: two thread wake-ups fewer for a lone client; nothing else waits on the loop then. 0: always
    # the pool. H200 host, 0.8B RACE, one client (h200_serve_ab.md): the server's prepare 1.85 ms inline vs 2.09
    # through the pool, but its wait for the round 6.12 vs 5.79: 8.19 vs 8.09 ms a request, a wash
    inline_prepare_bytes: int = 65536
    # worker processes that render and tokenize instead (0: none, the threads do it; rendering holds the GIL, so
    # threads share one core: processes scale with cores, flide/serve/workers.py)
    prepare_processes: int = 0
    retry_after_s: int = 1  # the Retry-After header of 503 answers
    # the model thread starts the next round (a graph replay) before it reads the last round's answers, so answering
    # and building overlap the device's work (flide/serve/scheduler.py). H200, 0.8B, RACE over HTTP: 264 -> 329 req/s
    # at 8 clients, 350 -> 389 at 64 (benchmarks/results/h200_http_overlap.md)
    overlap_rounds: bool = True
    # when the scheduler starts (after the model's load, graph capture and warm-up): collect, then gc.freeze() the
    # heap, so that Python's full collections no longer walk the objects of start-up. A full collection over them
    # took 370 ms on this CPU (412k objects, tiny model; more after torch.compile): the likely ~0.6 s stalls behind
    # the p99 of 591 ms at 32 clients on the H200 (session 9). Process-wide: frozen objects are never collected
    freeze_gc: bool = True
    # bucket fill: of the waiting requests that fit one round, the model thread takes the prefix that fills its
    # stream-length bucket best (graphs/buckets.py `fill_prefix`; the rest lead the next round), pricing a round's
    # fixed cost at `round_overhead_tokens` (H200, 0.8B: ~3.5 ms for a 512-token RACE replay, ~4 us a token more, and
    # ~1.5 ms of host work: ~1,000 tokens). Why on: a padding row costs ~60 % of a real token (16 RACE requests,
    # 7,392 tokens: 31.7 ms in the 8,192 bucket, 36.9 in 10,240; H200 2026-12-01), and at 32 clients a round of ~15
    # RACE requests sits at the 8,192 edge. Serve A/B (`benchmarks/results/h200_serve_ab_fill_buckets.md`, 3
    # interleaved rounds): 472.7 vs 460.4 req/s at 32 clients, 376.4 vs 383.4 at 8 (within the spread), p99 at 32
    # 97 vs 106 ms
    fill_buckets: bool = True
    round_overhead_tokens: int = 1024
    # launch ahead: with overlap_rounds, the model thread takes and launches the next round when the device has about
    # as much work left as the launch's host side takes (its build and the compiled call, ~1-2.5 ms on the H200 host,
    # during which the device idles when the round is launched after the last one ended), learnt per bucket from
    # the rounds so far; it then waits behind the running round on the device. H200, 0.8B, RACE over HTTP
    # (benchmarks/serve_ab.py, 2 interleaved rounds, medians): 432.8 -> 460.3 req/s at 32 clients, 508.4 -> 521.7
    # at 64, one client 113.8 -> 115.5 (benchmarks/results/h200_serve_ab.md)
    launch_ahead: bool = True


@dataclass(frozen=True)
class CheckpointConfig:
    """Growing states (flide/checkpoints): the forward pass that answers a request saves each long state's GDN
    recurrent states, conv windows and attention keys/values at a chunk-aligned position m a little before its end,
    and a later request whose state starts with the same tokens resumes from there, computing only the tail.

    m is the largest multiple of 64 (GDN_CHUNK) <= state length - `margin_tokens`: the last tokens (the end of a
    turn, the template's closing text) are the ones the next agent step changes, so they stay after m. States
    shorter than `min_state_tokens` are not saved. `cache_gb`: the cache's budget (GiB), least recently used first
    out. Every kernel variant resumes (the fast ones through an extended stream, flide/ops/resume.py); rounds that
    resume or save run eagerly (not from a captured CUDA graph)."""

    enabled: bool = False
    cache_gb: float = 1.0
    min_state_tokens: int = 256
    margin_tokens: int = 64


@dataclass(frozen=True)
class FlideConfig:
    kernels: KernelConfig = field(default_factory=KernelConfig)
    capacities: CapacityConfig = field(default_factory=CapacityConfig)
    limits: LimitConfig = field(default_factory=LimitConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections: dict[str, Any]) -> "FlideConfig":
        """A copy with some keys of some sections changed: `config.replace(kernels={"readout": "full"})`."""
        merged = self.to_dict()
        for name, values in sections.items():
            if name not in merged:
                raise ValueError(f"Unknown config section {name!r}; valid sections: {', '.join(merged)}.")
            merged[name] = {**merged[name], **values}
        return config_from_dict(merged)


GUARD_MODES = ("check", "skip_modules", "skip", "none")  # `runtime.guards` (RuntimeConfig.guards says what each does)
QUESTION_FORMS = ("auto", "recurrent", "chunked")  # `kernels.gated_delta_questions` (KernelConfig says what each does)

_CHOICES = {
    ("runtime", "dtype"): ("auto", "float32", "bfloat16", "float16"),
    ("runtime", "tokenization"): ("auto", "split", "full"),
    ("runtime", "nested_forks"): ("auto", "on", "off"),
    ("runtime", "graphs"): ("auto", "on", "off"),
    ("kernels", "fuse_attention_prep"): ("auto", "on", "off"),
    ("kernels", "gated_delta_questions"): QUESTION_FORMS,
    ("runtime", "compiler"): ("inductor", "cudagraphs"),
    ("runtime", "rounding"): ("eager", "fused"),
    ("runtime", "residual"): ("model", "float32"),
    ("runtime", "guards"): GUARD_MODES,
    ("runtime", "gemm_reductions"): ("torch", "fp32", "single_pass"),
}


_MAY_BE_ZERO = {("serve", "prepare_processes"), ("serve", "inline_prepare_bytes"), ("runtime", "piece_cache_chars"),
                ("runtime", "question_cache_entries")}


def _build(cls, values: Any, where: str):
    if not isinstance(values, dict):
        raise ValueError(f"Config `{where}` must be a mapping, got {type(values).__name__}.")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"Unknown config key(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
                         f"valid keys of `{where}`: {', '.join(known)}.")
    kwargs = {}
    for name, value in values.items():
        default = getattr(cls(), name)
        key = f"{where}.{name}"
        if isinstance(default, tuple):
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, int) and v > 0 for v in value):
                raise ValueError(f"Config `{key}` must be a non-empty list of positive integers, got {value!r}.")
            value = tuple(sorted(set(value)))
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"Config `{key}` must be true or false, got {value!r}.")
        elif isinstance(default, float):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"Config `{key}` must be a positive number, got {value!r}.")
            value = float(value)
        elif isinstance(default, bool) or isinstance(default, int):
            if (where, name) in _MAY_BE_ZERO:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"Config `{key}` must be a whole number >= 0, got {value!r}.")
            elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config `{key}` must be a positive integer, got {value!r}.")
        elif isinstance(default, str):
            if isinstance(value, bool) and (where, name) in (("runtime", "graphs"), ("kernels", "fuse_attention_prep")):
                value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
            if not isinstance(value, str):
                raise ValueError(f"Config `{key}` must be a string, got {value!r}.")
            choices = _CHOICES.get((where, name))
            if choices and value not in choices:
                raise ValueError(f"Config `{key}` must be one of {', '.join(choices)}, got {value!r}.")
        kwargs[name] = value
    return cls(**kwargs)


def config_from_dict(values: dict[str, Any] | None) -> FlideConfig:
    values = {} if values is None else values
    sections = {f.name: f.type for f in dataclasses.fields(FlideConfig)}
    if not isinstance(values, dict):
        raise ValueError(f"A Flide config is a mapping of sections ({', '.join(sections)}), got {type(values).__name__}.")
    unknown = sorted(set(values) - set(sections))
    if unknown:
        raise ValueError(f"Unknown config section(s) {', '.join(unknown)}; valid sections: {', '.join(sections)}.")
    classes = {"kernels": KernelConfig, "capacities": CapacityConfig, "limits": LimitConfig, "runtime": RuntimeConfig,
               "serve": ServeConfig, "checkpoints": CheckpointConfig}
    return FlideConfig(**{name: _build(classes[name], section or {}, name) for name, section in values.items()})


def load_config(config: "FlideConfig | dict | str | Path | None" = None) -> FlideConfig:
    """A `FlideConfig` from a config, a dict, a YAML path, or None (the defaults, equal to configs/default.yaml)."""
    if config is None:
        return FlideConfig()
    if isinstance(config, FlideConfig):
        return config
    if isinstance(config, dict):
        return config_from_dict(config)
    return config_from_dict(read_yaml(config, "Config file"))


def read_yaml(path: str | Path, what: str) -> Any:
    """The contents of a YAML file; ValueError (starting with `what` and the path) if it is missing or invalid."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist.")
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"{what} {str(path)!r} is not valid YAML: {error}") from error
