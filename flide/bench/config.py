"""The benchmark suite's configuration: one YAML file -> a frozen `BenchConfig`, validated on load.

    name: h200_qwen3_5_0_8b
    models: [../shared/models/qwen3_5/configs/qwen3.5-0.8b.json]   # or "tiny:qwen3_5_text"
    tokenizer: [../shared/models/qwen3_5, shared/models/qwen3_5]     # the first that exists
    dtype: bfloat16
    device: cuda
    workloads: [race1, race, quality1, quality, multirc, sweep]
    engines: [flide, pipeline, prefix-cache]
    concurrency: [1, 8, 32, 64]

An unknown key (top level, `limits`, `workload_options.<workload>`, `ablations`, `http`, `fidelity`) is an error listing
the valid ones; `flide:`, each ablation and `http.flide` are checked as Flide configs.

`mode: speed` (the default) measures latency and throughput (runner.py); `mode: fidelity` measures answers against a
float32 reference (fidelity.py). `final_norm_scale: S` multiplies the final norm's gain by S (every logit by S), so a
random-weight model answers with peaked probabilities instead of almost uniform ones (`--top-probability` reports
the mean top probability for candidate scales); `final_norm_scale: auto` (fidelity mode) picks S per model at the
start of the run (fidelity.pick_final_norm_scale) and records it. The `http` engine (speed mode) serves the model with `flide serve`
and drives it with closed-loop HTTP clients; `http:` holds its options. Relative paths are taken from the repository root; a path
may be a list of candidates, the first that exists wins (so one file works here, where the data is in ../shared, and
on a machine where it was copied into the repository). No environment variable changes anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import read_yaml

REPO = Path(__file__).resolve().parents[2]

WORKLOADS = ("race1", "race", "quality1", "quality", "multirc", "sweep")
ENGINES = ("flide", "pipeline", "prefix-cache", "delimiter", "http")
MODES = ("speed", "fidelity")
DTYPES = ("float32", "bfloat16", "float16")
TINY_PREFIX = "tiny:"

# Options each workload builder takes (`workload_options.<name>`), with their defaults
WORKLOAD_OPTIONS: dict[str, dict[str, Any]] = {
    "race1": {},
    "race": {},
    "quality1": {"cut_tokens": 3600},
    "quality": {"cut_tokens": None},  # None: the whole article (a number cuts it, for small machines)
    "multirc": {"max_questions": 64},
    "sweep": {"state_tokens": 2000, "counts": [1, 8, 16, 32, 64]},
}
# Requests built per workload unless `limits` says otherwise (sweep: articles, each asked every count)
DEFAULT_LIMITS = {"race1": 32, "race": 32, "quality1": 8, "quality": 8, "multirc": 16, "sweep": 1}


# The server is another process: in half precision its kernels' autotuned configs (fla's, Inductor's) may differ from
# the in-process twin's, which changes the bf16 rounding of every layer. On the H200 (2026-11-30, Qwen3.5-0.8B random
# weights, 4 RACE requests each alone on both sides) the answers differed by 0.007, within the ~1 point that bf16 moves
# them from float32 (the fidelity run's TV). The check is there to catch wiring errors (a request's answers swapped
# with another's, a different tokenizer or config): those move answers by far more. Batch-invariant mode with pinned
# kernel configs is where bits should match across processes.
HALF_CHECK_ATOL = 0.02


@dataclass(frozen=True)
class HttpOptions:
    """The `http` engine: `flide serve` in a subprocess, closed-loop HTTP clients (`http:` in the YAML)."""

    workloads: tuple[str, ...] | None = None  # the workloads it runs (None: every workload of the grid)
    concurrency: tuple[int, ...] | None = None  # closed-loop clients per level (None: the grid's `concurrency`)
    seconds: float | None = None  # each level's clients start requests for this long (None: `throughput_seconds`)
    requests: int | None = None  # ... or until this many were started at a level (None: time only)
    client_processes: int | None = None  # processes the clients are spread over (None: one per 16 clients)
    check_requests: int = 4  # the first N requests answered over HTTP and in process must agree...
    check_atol: float | None = None  # ... within this (None: 1e-5 in float32, HALF_CHECK_ATOL in bfloat16/float16)
    startup_timeout_s: float = 600.0  # until /health answers
    client_timeout_s: float = 300.0  # one request, on the client side (the server's own is serve.request_timeout_s)
    flide: dict[str, Any] = field(default_factory=dict)  # Flide config overrides of the server only

    def atol(self, dtype: str) -> float:
        return self.check_atol if self.check_atol is not None else (1e-5 if dtype == "float32" else HALF_CHECK_ATOL)


@dataclass(frozen=True)
class FidelityOptions:
    """`mode: fidelity`: the stability pass and the report (`fidelity:` in the YAML)."""

    stability_threads: int = 64  # in-process submitter threads of the stability pass
    stability_max_group: int = 16  # Flide: each submission is a round of 1..this many requests (random)
    stability_copies: int = 1  # the workload is submitted this many times (each a new random composition)
    top_probability_range: tuple[float, float] = (0.5, 0.9)  # the report flags a reference mean top prob. outside


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark grid: models x workloads x engines (+ Flide ablations) x concurrency levels."""

    name: str
    models: tuple[str, ...]  # resolved config-json paths, or "tiny:<model_type>"
    tokenizer: str | None = None  # resolved tokenizer folder; None: the tiny in-code tokenizer (tiny models only)
    dtype: str = "float32"
    device: str = "auto"  # auto: cuda when available, else cpu
    workloads: tuple[str, ...] = WORKLOADS
    engines: tuple[str, ...] = ("flide", "pipeline", "prefix-cache")
    concurrency: tuple[int, ...] = (1,)  # in-process submitter threads of each throughput measurement
    warmup: int = 1  # untimed runs of a workload's first request before its timings
    repeats: int = 3  # timed runs of each request for the latency of one request alone
    latency_requests: int = 8  # the first N requests of a workload are timed alone
    throughput_seconds: float = 10.0  # each submitter starts requests until this much time has passed
    # A throughput run waits for every request in flight: N submitters take at least ~N x the latency alone when the
    # device serializes them. Runs whose estimate (N x median latency alone) exceeds this are skipped (row noted).
    max_throughput_seconds: float = 120.0
    # Latency alone stops taking samples of a workload once they took this long (after at least `repeats` samples):
    # the pipeline spends ~7 s on one QuALITY request, 8 x 3 of them would be minutes of device time per cell.
    max_latency_seconds: float = 120.0
    limits: dict[str, int] = field(default_factory=dict)  # workload -> requests built (sweep: articles)
    workload_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    flide: dict[str, Any] = field(default_factory=dict)  # Flide config overrides for every flide engine
    ablations: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> more overrides: engine flide:<name>
    data_dir: str | None = None  # resolved; None: flide.workloads' default (../shared/data)
    results_dir: str = str(REPO / "benchmarks" / "results")
    torch_threads: int | None = None  # torch.set_num_threads for the run (None: leave torch's default)
    seed: int = 0  # random weights
    notes: str = ""  # printed at the top of the markdown table (what the numbers mean, or don't)
    mode: str = "speed"  # speed: latency and throughput; fidelity: answers against a float32 reference
    # the final norm's gain x this (peaked answers from random weights); "auto": picked per model (fidelity mode)
    final_norm_scale: float | str | None = None
    http: HttpOptions = field(default_factory=HttpOptions)
    fidelity: FidelityOptions = field(default_factory=FidelityOptions)

    def limit(self, workload: str) -> int:
        return self.limits.get(workload, DEFAULT_LIMITS[workload])

    def options(self, workload: str) -> dict[str, Any]:
        return {**WORKLOAD_OPTIONS[workload], **self.workload_options.get(workload, {})}

    def flide_config(self, ablation: str | None = None) -> dict[str, Any]:
        """The Flide config dict of the `flide` engine, or of the engine `flide:<ablation>`."""
        return merge_overrides(self.flide, self.ablations[ablation]) if ablation else dict(self.flide)

    def engine_names(self) -> list[str]:
        """Every engine the grid runs: the configured ones, then one `flide:<name>` per ablation."""
        return list(self.engines) + [f"flide:{name}" for name in self.ablations]

    def runs(self, engine: str, workload: str) -> bool:
        """Whether the grid measures `engine` on `workload` (the http engine only on `http.workloads`)."""
        if engine == "http" and self.http.workloads is not None:
            return workload.split("/")[0] in self.http.workloads
        return True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def merge_overrides(base: dict, extra: dict) -> dict:
    """Section-wise merge of two Flide config dicts (`{"kernels": {...}, ...}`)."""
    merged = {section: dict(values or {}) for section, values in base.items()}
    for section, values in extra.items():
        merged[section] = {**merged.get(section, {}), **(values or {})}
    return merged


def _fail(key: str, message: str):
    raise ValueError(f"Benchmark config `{key}`: {message}")


def _check_keys(values: Any, valid, where: str) -> dict:
    if not isinstance(values, dict):
        _fail(where, f"must be a mapping, got {type(values).__name__}.")
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"Unknown benchmark config key(s) {', '.join(f'{where}.{k}' if where else k for k in unknown)}"
                         f"; valid keys{f' of `{where}`' if where else ''}: {', '.join(valid) or '(none)'}.")
    return values


def resolve_path(value: str | list[str], key: str, base: Path = REPO) -> str:
    """A path from the config: relative to the repository root; a list of candidates gives the first that exists."""
    candidates = [value] if isinstance(value, str) else value
    if not isinstance(candidates, list) or not candidates or not all(isinstance(c, str) and c for c in candidates):
        _fail(key, f"must be a path or a non-empty list of paths, got {value!r}.")
    paths = [Path(c) if Path(c).is_absolute() else base / c for c in candidates]
    for path in paths:
        if path.exists():
            return str(path.resolve())
    _fail(key, f"none of these exists: {', '.join(map(str, paths))}.")


def _positive_ints(value: Any, key: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                           for v in value):
        _fail(key, f"must be a non-empty list of positive integers, got {value!r}.")
    return tuple(dict.fromkeys(value))


def _names(value: Any, valid: tuple[str, ...], key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        _fail(key, f"must be a non-empty list of names ({', '.join(valid)}), got {value!r}.")
    unknown = [v for v in value if v not in valid]
    if unknown:
        _fail(key, f"unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}.")
    return tuple(dict.fromkeys(value))


def _number(value: Any, key: str, least: float = 0.0, strict: bool = True) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value > least if strict else
                                                                               value >= least):
        _fail(key, f"must be a number {'>' if strict else '>='} {least:g}, got {value!r}.")
    return float(value)


def _integer(value: Any, key: str, least: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        _fail(key, f"must be an integer >= {least}, got {value!r}.")
    return value


def _http_options(values: Any, workloads: tuple[str, ...]) -> HttpOptions:
    fields = {f.name for f in dataclasses.fields(HttpOptions)}
    values = _check_keys(values or {}, list(fields), "http")
    kw: dict[str, Any] = {}
    if values.get("workloads") is not None:
        kw["workloads"] = _names(values["workloads"], WORKLOADS, "http.workloads")
        missing = [w for w in kw["workloads"] if w not in workloads]
        if missing:
            _fail("http.workloads", f"{', '.join(missing)} not among the grid's workloads ({', '.join(workloads)}).")
    if values.get("concurrency") is not None:
        kw["concurrency"] = _positive_ints(values["concurrency"], "http.concurrency")
    for key in ("seconds", "startup_timeout_s", "client_timeout_s", "check_atol"):
        if values.get(key) is not None:
            kw[key] = _number(values[key], f"http.{key}")
    for key, least in (("requests", 1), ("client_processes", 1), ("check_requests", 0)):
        if values.get(key) is not None:
            kw[key] = _integer(values[key], f"http.{key}", least)
    if values.get("flide") is not None:
        kw["flide"] = _flide_overrides(values["flide"], "http.flide")
    return HttpOptions(**kw)


def _fidelity_options(values: Any) -> FidelityOptions:
    fields = [f.name for f in dataclasses.fields(FidelityOptions)]
    values = _check_keys(values or {}, fields, "fidelity")
    kw: dict[str, Any] = {}
    for key, least in (("stability_threads", 1), ("stability_max_group", 1), ("stability_copies", 1)):
        if key in values:
            kw[key] = _integer(values[key], f"fidelity.{key}", least)
    if "top_probability_range" in values:
        value = values["top_probability_range"]
        if (not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, (int, float))
                                                                       and not isinstance(v, bool) for v in value)
                or not 0 <= value[0] < value[1] <= 1):
            _fail("fidelity.top_probability_range", f"must be [low, high] with 0 <= low < high <= 1, got {value!r}.")
        kw["top_probability_range"] = (float(value[0]), float(value[1]))
    return FidelityOptions(**kw)


def _flide_overrides(value: Any, key: str) -> dict:
    """A Flide config dict, checked now by Flide's own loader (unknown sections, keys and bad values fail here)."""
    from ..config import config_from_dict

    if value is None:
        return {}
    try:
        config_from_dict(value)
    except ValueError as error:
        _fail(key, str(error))
    fixed = sorted(set(value.get("runtime") or {}) & {"dtype", "device"})
    if fixed:
        # Engine() would move the shared model, under the other engines' feet: the bench's dtype/device apply to all
        _fail(key, f"sets runtime.{', runtime.'.join(fixed)}; use the benchmark's own `dtype` / `device` (one model is "
                   f"shared by every engine).")
    return {section: dict(values or {}) for section, values in value.items()}


def config_from_dict(values: dict[str, Any]) -> BenchConfig:
    """Validates a benchmark config mapping (as read from YAML) and resolves its paths."""
    fields = {f.name: f for f in dataclasses.fields(BenchConfig)}
    _check_keys(values, fields, "")
    for required in ("name", "models"):
        if required not in values:
            _fail(required, "is required.")
    kw: dict[str, Any] = {}
    name = values["name"]
    if not isinstance(name, str) or not name or any(c in name for c in "/\\ ") or name.startswith("."):
        _fail("name", f"must be a file-name-safe string (it names the results files), got {name!r}.")
    kw["name"] = name

    models = values["models"]
    if not isinstance(models, list) or not models:
        _fail("models", f"must be a non-empty list, got {models!r}.")
    resolved = []
    for i, model in enumerate(models):
        if isinstance(model, str) and model.startswith(TINY_PREFIX):
            from ..models.tiny import TINY_CONFIGS

            if model[len(TINY_PREFIX):] not in TINY_CONFIGS:
                _fail(f"models[{i}]", f"unknown tiny model {model!r}; valid: "
                                      f"{', '.join(TINY_PREFIX + t for t in TINY_CONFIGS)}.")
            resolved.append(model)
        else:
            resolved.append(resolve_path(model, f"models[{i}]"))
    kw["models"] = tuple(resolved)

    tokenizer = values.get("tokenizer")
    if tokenizer is None or tokenizer == "tiny":
        real = [m for m in resolved if not m.startswith(TINY_PREFIX)]
        if real:
            _fail("tokenizer", f"is required for the model(s) {', '.join(real)} (a folder holding tokenizer.json or "
                               f"tokenizer.json.gz).")
        kw["tokenizer"] = None
    else:
        kw["tokenizer"] = resolve_path(tokenizer, "tokenizer")
        if any(m.startswith(TINY_PREFIX) for m in resolved):
            _fail("tokenizer", "tiny models use the tiny in-code tokenizer: leave `tokenizer` out (or `tiny`).")

    if "dtype" in values:
        if values["dtype"] not in DTYPES:
            _fail("dtype", f"must be one of {', '.join(DTYPES)}, got {values['dtype']!r}.")
        kw["dtype"] = values["dtype"]
    if "device" in values:
        device = values["device"]
        if not isinstance(device, str) or not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
            _fail("device", f"must be auto, cpu, cuda or cuda:N, got {device!r}.")
        kw["device"] = device
    if "workloads" in values:
        kw["workloads"] = _names(values["workloads"], WORKLOADS, "workloads")
    if "engines" in values:
        kw["engines"] = _names(values["engines"], ENGINES, "engines")
    if "concurrency" in values:
        kw["concurrency"] = _positive_ints(values["concurrency"], "concurrency")
    for key in ("warmup",):
        if key in values:
            if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 0:
                _fail(key, f"must be an integer >= 0, got {values[key]!r}.")
            kw[key] = values[key]
    for key in ("repeats", "latency_requests", "seed", "torch_threads"):
        if key in values and not (key == "torch_threads" and values[key] is None):
            value, least = values[key], 0 if key == "seed" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                _fail(key, f"must be an integer >= {least}, got {value!r}.")
            kw[key] = value
    for key in ("throughput_seconds", "max_throughput_seconds", "max_latency_seconds"):
        if key in values:
            value = values[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                _fail(key, f"must be a positive number, got {value!r}.")
            kw[key] = float(value)

    limits = _check_keys(values.get("limits") or {}, WORKLOADS, "limits")
    for workload, limit in limits.items():
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            _fail(f"limits.{workload}", f"must be a positive integer, got {limit!r}.")
    kw["limits"] = dict(limits)

    options = _check_keys(values.get("workload_options") or {}, WORKLOADS, "workload_options")
    kw["workload_options"] = {}
    for workload, opts in options.items():
        where = f"workload_options.{workload}"
        _check_keys(opts or {}, WORKLOAD_OPTIONS[workload], where)
        for key, value in (opts or {}).items():
            if key == "counts":
                value = list(_positive_ints(value, f"{where}.counts"))
                if max(value) > 64:
                    _fail(f"{where}.counts", "a request has at most 64 questions.")
            elif key == "cut_tokens" and value is None and workload == "quality":
                pass
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(f"{where}.{key}", f"must be a positive integer, got {value!r}.")
            kw["workload_options"].setdefault(workload, {})[key] = value

    kw["flide"] = _flide_overrides(values.get("flide"), "flide")
    ablations = values.get("ablations") or {}
    if not isinstance(ablations, dict):
        _fail("ablations", f"must map names to Flide config overrides, got {ablations!r}.")
    kw["ablations"] = {}
    for ablation, overrides in ablations.items():
        if not isinstance(ablation, str) or not ablation or any(c in ablation for c in ":/ "):
            _fail("ablations", f"names must be plain words, got {ablation!r}.")
        kw["ablations"][ablation] = _flide_overrides(overrides, f"ablations.{ablation}")
        _flide_overrides(merge_overrides(kw["flide"], kw["ablations"][ablation]), f"ablations.{ablation}")

    if values.get("data_dir") is not None:
        kw["data_dir"] = resolve_path(values["data_dir"], "data_dir")
    if values.get("results_dir") is not None:
        value = values["results_dir"]
        if not isinstance(value, str) or not value:
            _fail("results_dir", f"must be a path, got {value!r}.")
        kw["results_dir"] = str(Path(value) if Path(value).is_absolute() else REPO / value)
    if "notes" in values:
        if not isinstance(values["notes"], str):
            _fail("notes", f"must be a string, got {values['notes']!r}.")
        kw["notes"] = values["notes"].strip()

    mode = values.get("mode", "speed")
    if mode not in MODES:
        _fail("mode", f"must be one of {', '.join(MODES)}, got {mode!r}.")
    kw["mode"] = mode
    if values.get("final_norm_scale") == "auto":
        if mode != "fidelity":
            _fail("final_norm_scale", "`auto` picks a scale for answer fidelity: only with `mode: fidelity`.")
        kw["final_norm_scale"] = "auto"
    elif values.get("final_norm_scale") is not None:
        kw["final_norm_scale"] = _number(values["final_norm_scale"], "final_norm_scale")
    engines = kw.get("engines", BenchConfig.engines)
    kw["http"] = _http_options(values.get("http"), kw.get("workloads", WORKLOADS))
    kw["fidelity"] = _fidelity_options(values.get("fidelity"))
    if mode == "fidelity" and "http" in engines:
        _fail("engines", "the http engine measures speed (mode: speed); mode: fidelity compares answers in process.")
    if mode == "speed" and "http" in engines:
        from .server import servable

        for model in kw["models"]:
            reason = servable(model, BenchConfig(**{**kw, "engines": engines}))
            if reason:
                _fail("engines", f"http: {reason}.")
    return BenchConfig(**kw)


def load_bench_config(path: str | Path) -> BenchConfig:
    """A `BenchConfig` from a YAML file (errors name the file and the offending key)."""
    values = read_yaml(path, "Benchmark config")
    try:
        return config_from_dict(values if values is not None else {})
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
