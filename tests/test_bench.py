"""The benchmark suite (flide/bench, benchmarks/baselines): config validation, the named workloads, the baselines'
exactness (prefix-cache equals pipeline("decision"); the delimiter baseline does not), and a small run of the runner
that writes its JSON, markdown and plot. Tiny random models in fp32 on the CPU."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess

import pytest
import yaml

import flide
from flide import workloads as datasets
from flide.bench.config import REPO, config_from_dict, load_bench_config
from flide.bench.engines import make_engine
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.testing import max_difference, random_request

PIPELINE_ATOL = 1e-5
needs_data = pytest.mark.skipif(not datasets.data_available(), reason=f"{datasets.data_dir()} is absent")
TINY = {"name": "t", "models": ["tiny:qwen3_5_text"]}


# ---- config ----
@pytest.mark.parametrize("values, message", [
    ({**TINY, "threads": 2}, "valid keys: name, models"),
    ({**TINY, "limits": {"rase": 2}}, "limits.rase; valid keys of `limits`: race1, race"),
    ({**TINY, "workload_options": {"sweep": {"count": [1]}}}, ("workload_options.sweep.count; valid keys of "
                                                                "`workload_options.sweep`: state_tokens, counts")),
    ({**TINY, "workloads": ["race", "squad"]}, "unknown 'squad'; valid: race1, race, quality1"),
    ({**TINY, "engines": ["vllm"]}, "unknown 'vllm'; valid: flide, pipeline, prefix-cache, delimiter, http"),
    ({**TINY, "concurrency": [1, 0]}, "non-empty list of positive integers"),
    ({**TINY, "workload_options": {"sweep": {"counts": [1, 65]}}}, "at most 64 questions"),
    ({**TINY, "dtype": "fp8"}, "must be one of float32, bfloat16, float16"),
    ({**TINY, "flide": {"kernels": {"attention": "flex"}}}, "kernels.attention"),
    ({**TINY, "flide": {"runtime": {"dtype": "bfloat16"}}}, "one model is shared by every engine"),
    ({**TINY, "ablations": {"x": {"readout": "full"}}}, "Unknown config section(s) readout"),
    ({"name": "t", "models": ["tiny:gpt9"]}, "unknown tiny model 'tiny:gpt9'"),
    ({"name": "t", "models": ["no/such/config.json"]}, "none of these exists"),
    ({"models": ["tiny:qwen3_5_text"]}, "`name`: is required"),
    ({"name": "a/b", "models": ["tiny:qwen3_5_text"]}, "file-name-safe"),
    # a tokenizer folder that exists on every machine (the repo's configs/), so the tiny-model rule is what fails
    ({**TINY, "tokenizer": "configs"}, "tiny models use the tiny in-code tokenizer"),
])
def test_config_errors(values, message):
    with pytest.raises(ValueError) as error:
        config_from_dict(values)
    assert message in str(error.value)


def test_config_paths_and_defaults(tmp_path):
    (tmp_path / "model.json").write_text("{}")
    config = config_from_dict({"name": "t", "models": [[str(tmp_path / "missing.json"), str(tmp_path / "model.json")]],
                               "tokenizer": str(tmp_path), "data_dir": ["no/such/folder", str(tmp_path)],
                               "flide": {"kernels": {"readout": "full"}},
                               "ablations": {"selective": {"kernels": {"readout": "selective"}}}})
    assert config.models == (str((tmp_path / "model.json").resolve()),)  # the first candidate that exists
    assert config.data_dir == str(tmp_path.resolve())
    assert config.engine_names() == ["flide", "pipeline", "prefix-cache", "flide:selective"]
    assert config.flide_config("selective") == {"kernels": {"readout": "selective"}}
    assert config.limit("race") == 32 and config.options("sweep")["counts"] == [1, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="`tokenizer`: is required"):
        config_from_dict({"name": "t", "models": [str(tmp_path / "model.json")]})


def test_shipped_configs_load():
    smoke = load_bench_config(REPO / "configs/bench/cpu_smoke.yaml")
    assert smoke.models == ("tiny:qwen3_5_text",) and smoke.concurrency == (1, 4)
    assert set(smoke.engines) == {"flide", "pipeline", "prefix-cache", "http"} and len(smoke.workloads) == 6
    assert smoke.http.workloads == ("race",) and smoke.runs("http", "race") and not smoke.runs("http", "quality")
    for name in ("h200_qwen3_5_0_8b", "h200_qwen3_5_4b"):
        values = yaml.safe_load((REPO / f"configs/bench/{name}.yaml").read_text())
        assert values["name"] == name and values["dtype"] == "bfloat16" and values["device"] == "cuda"
        assert values["concurrency"] == [1, 8, 32, 64] and len(values["workloads"]) == 6
        if name == "h200_qwen3_5_0_8b":  # issue 4: flide serve with 1/8/32/64 closed-loop clients on race
            assert "http" in values["engines"] and values["http"]["workloads"] == ["race"]
            assert values["http"]["concurrency"] == [1, 8, 32, 64]
        if (REPO.parent / "shared" / "models").is_dir() and datasets.data_available():
            assert load_bench_config(REPO / f"configs/bench/{name}.yaml").dtype == "bfloat16"


def test_bad_yaml_names_the_file(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("name: b\nmodels: [tiny:qwen3_5_text]\nrepeat: 3\n")
    with pytest.raises(ValueError, match=r"b\.yaml: Unknown benchmark config key\(s\) repeat; valid keys"):
        load_bench_config(path)


# ---- workloads ----
@pytest.fixture(scope="module")
def tiny_engine():
    return flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer())


@needs_data
@pytest.mark.parametrize("name", ["race1", "race", "quality1", "quality", "multirc", "sweep"])
def test_workloads_give_valid_requests(name, tiny_engine):
    from flide.bench.workloads import build

    tok = tiny_engine.tokenizer
    built = build(name, tok, limit=2, options={"cut_tokens": 800} if name == "quality" else None)
    if name == "sweep":
        assert list(built) == ["sweep/q1", "sweep/q8", "sweep/q16", "sweep/q32", "sweep/q64"]
    else:
        assert list(built) == [name]
    for workload, requests in built.items():
        assert len(requests) == 2
        for request in requests:
            prepared = tiny_engine.prepare(request)
            count = len(prepared.questions)
            if name in ("race1", "quality1"):
                assert count == 1
            elif name == "multirc":
                assert 1 <= count <= 64
            elif name == "sweep":
                assert count == int(workload.split("q")[1])
                assert len(prepared.trunks) == 1  # one state, every question forked from it
                state_tokens = len(tok(request["state"], add_special_tokens=False)["input_ids"])
                assert 1990 <= state_tokens <= 2010
    if name == "sweep":  # the repeats are varied: no two questions of a request are the same
        for request in built["sweep/q64"]:
            prompts = [json.dumps(q, sort_keys=False) for q in request["questions"].values()]
            assert len(set(prompts)) == 64
    if name == "quality1":
        assert all(len(tok(r["state"], add_special_tokens=False)["input_ids"]) <= 3610 for r in built[name])


# ---- baselines ----
def _requests(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [random_request(rng, max_questions=12, max_words=150) for _ in range(n)]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "llama"])
def test_prefix_cache_equals_pipeline(model_type):
    """Same tokens, same model: the prefix-cache baseline answers as pipeline("decision") does (GDN cache included)."""
    from transformers import pipeline

    tok = tiny_tokenizer()
    requests = _requests(1, 8)
    requests.append({"state": "x", "questions": {"a": {"type": "noul", "instructions": "Yes?"}}})  # a tiny state
    model = tiny_model(model_type, seed=2)
    decide = pipeline("decision", model=model, tokenizer=tok)
    expected = [decide(r) for r in requests]
    baseline = make_engine("prefix-cache", model, tok)
    got = baseline.decide(requests)
    worst = max(max_difference(e, g) for e, g in zip(expected, got))
    assert worst <= PIPELINE_ATOL, worst
    assert sum(baseline.tokens(r) for r in requests) < sum(make_engine("pipeline", model, tok).tokens(r)
                                                           for r in requests)
    # the runner patches the same model for Flide first: the swapped layers fall back to transformers' own modules
    flide.patch(model, tok)
    again = make_engine("prefix-cache", model, tok).for_thread(tok).decide(requests[:3])
    assert max(max_difference(e, g) for e, g in zip(expected, again)) <= PIPELINE_ATOL


def test_delimiter_runs_and_differs_from_pipeline():
    """All questions in one causal sequence: later questions see earlier ones, so the answers change."""
    from transformers import pipeline

    tok = tiny_tokenizer()
    requests = _requests(3, 6)
    model = tiny_model("qwen3_5_text", seed=4)
    decide = pipeline("decision", model=model, tokenizer=tok)
    baseline = make_engine("delimiter", model, tok)
    got = baseline.decide(requests)
    differences = [max_difference(decide(r), g) for r, g in zip(requests, got)]
    assert all(d > 1e-6 for d in differences), differences
    assert max(differences) > 1e-3
    for request, answers in zip(requests, got):  # still well-formed answers, in request order
        assert list(answers) == list(request["questions"])
    prepared = baseline.prepare(requests[0])
    ids, reads = baseline.sequence(prepared, 0)
    assert len(ids) == prepared.stream_tokens + len(prepared.branches) == baseline.tokens(requests[0])
    assert (ids == baseline.delimiter_id).sum() >= len(prepared.branches)
    assert sorted(reads.values()) == sorted(set(reads.values())) and max(reads.values()) == len(ids) - 1


# ---- runner ----
def test_runner_writes_results(tmp_path):
    """A small grid through the command line: rows in the schema, markdown with its warning, a plot."""
    from flide.bench import main
    from flide.bench.runner import ROW_KEYS, git_commit, merge_rows

    config = {"name": "mini", "models": ["tiny:qwen3_5_text"], "device": "cpu", "torch_threads": 1,
              "engines": ["flide", "prefix-cache", "delimiter"], "concurrency": [1, 2], "warmup": 1, "repeats": 1,
              "latency_requests": 1, "throughput_seconds": 0.2, "ablations": {"full-readout": {"kernels": {"readout":
                                                                                                         "full"}}}}
    if datasets.data_available():
        config.update(workloads=["race", "sweep"], limits={"race": 2, "sweep": 1},
                      workload_options={"sweep": {"state_tokens": 60, "counts": [1, 8]}})
    else:  # no shared data: the runner still runs on a data folder of our own
        folder = tmp_path / "data" / "race"
        folder.mkdir(parents=True)
        passage = {"article": "The school opened in May. " * 5, "questions": ["When?", "What?"],
                   "options": [["May", "June", "July", "never"], ["school", "shop", "park", "home"]], "answers": "AB"}
        for part in ("middle", "high"):
            (folder / f"race_dev_{part}.jsonl").write_text(json.dumps(passage) + "\n")
        config.update(workloads=["race"], limits={"race": 2}, data_dir=str(tmp_path / "data"))
    path = tmp_path / "mini.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 0

    rows = json.loads((tmp_path / "out" / "mini.json").read_text())
    assert rows and all(tuple(r) == ROW_KEYS for r in rows)
    assert {r["commit"] for r in rows} == {git_commit()} and {r["model"] for r in rows} == {"tiny-qwen3_5_text"}
    assert "error" not in {r["metric"] for r in rows}
    engines = {"flide", "prefix-cache", "delimiter", "flide:full-readout"}
    values = {(r["workload"], r["engine"], r["metric"]): r["value"] for r in rows}
    for engine in engines:
        for metric in ("tokens_per_request", "latency_p50_ms", "latency_p90_ms", "requests_per_s@1",
                       "requests_per_s@2", "latency_p50_ms@2"):
            assert values[("race", engine, metric)] > 0, (engine, metric)
    for engine in ("flide", "flide:full-readout"):  # alone through Engine.submit too; the baselines have no scheduler
        assert values[("race", engine, "latency_submit_p50_ms")] > 0, engine
        # the host's share of latency alone: Engine.prepare of the same requests
        assert 0 < values[("race", engine, "prepare_p50_ms")] < values[("race", engine, "latency_p50_ms")], engine
    assert not any(m in ("latency_submit_p50_ms", "prepare_p50_ms") for w, e, m in values
                   if e in ("prefix-cache", "delimiter"))
    assert values[("race", "-", "requests")] == 2
    assert values[("race", "flide", "tokens_per_request")] == values[("race", "prefix-cache", "tokens_per_request")]
    assert values[("race", "delimiter", "tokens_per_request")] > values[("race", "flide", "tokens_per_request")]
    units = {r["metric"]: r["unit"] for r in rows}
    assert units["latency_p50_ms"] == "ms" and units["requests_per_s@2"] == "requests/s"
    if datasets.data_available():  # sweep rows: latency alone only
        assert values[("sweep/q8", "-", "questions_per_request")] == 8
        assert ("sweep/q8", "flide", "latency_p50_ms") in values
        assert not any(w.startswith("sweep/") and m.startswith("requests_per_s") for w, _, m in values)

    report = (tmp_path / "out" / "mini.md").read_text()
    assert "Tiny random model on a CPU" in report and "| race |" in report and "flide:full-readout" in report
    assert "through Engine.submit" in report
    if importlib.util.find_spec("matplotlib") is None:
        assert not (tmp_path / "out" / "mini.png").exists()
    else:
        assert (tmp_path / "out" / "mini.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a partial re-run merges: only its cells are replaced
    old = [dict(zip(ROW_KEYS, ("race", "m", "flide", "x", 1, "u", "h", "c"))),
           dict(zip(ROW_KEYS, ("race", "m", "pipeline", "x", 2, "u", "h", "c")))]
    new = [dict(zip(ROW_KEYS, ("race", "m", "flide", "x", 3, "u", "h", "c")))]
    assert [r["value"] for r in merge_rows(old, new)] == [2, 3]
    # a run of fewer submitter counts keeps the cell's other levels, and replaces the rest of the cell
    old = [dict(zip(ROW_KEYS, ("race", "m", "flide", metric, value, "u", "h", "c")))
           for metric, value in (("latency_p50_ms", 1), ("requests_per_s@1", 2), ("requests_per_s@8", 3),
                                 ("latency_p50_ms@8", 4), ("error", None))]
    new = [dict(zip(ROW_KEYS, ("race", "m", "flide", metric, value, "u", "h", "d")))
           for metric, value in (("latency_p50_ms", 5), ("requests_per_s@1", 6))]
    assert [(r["metric"], r["value"]) for r in merge_rows(old, new)] == [
        ("requests_per_s@8", 3), ("latency_p50_ms@8", 4), ("latency_p50_ms", 5), ("requests_per_s@1", 6)]


def test_module_entry_point_dry_run():
    out = subprocess.run(["python", "-m", "flide.bench", "configs/bench/cpu_smoke.yaml", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "engines flide, pipeline, prefix-cache, http" in out.stderr
    bad = subprocess.run(["python", "-m", "flide.bench", "configs/bench/cpu_smoke.yaml", "--engines", "vllm"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "vllm not in the config" in bad.stderr
    # --concurrency: a subset of the config's levels (cpu_smoke has 1 and 4)
    one = subprocess.run(["python", "-m", "flide.bench", "configs/bench/cpu_smoke.yaml", "--concurrency", "1",
                          "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert one.returncode == 0 and "concurrency 1;" in one.stderr, one.stderr
    bad = subprocess.run(["python", "-m", "flide.bench", "configs/bench/cpu_smoke.yaml", "--concurrency", "8"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "--concurrency: 8 not in the config; it has: 1, 4." in bad.stderr


def test_latency_alone_stops_taking_samples_past_its_time_budget():
    """`max_latency_seconds`: past it (and after `repeats` samples) latency alone stops and says over how many."""
    from flide.bench.config import BenchConfig
    from flide.bench.runner import latency_alone

    class Slow:
        calls = 0

        def decide(self, requests):
            Slow.calls += 1

    def timer(fn):  # each sample "takes" 40 ms
        fn()
        return 40.0

    config = BenchConfig(name="t", models=("tiny:qwen3_5_text",), warmup=1, repeats=3, latency_requests=8,
                         max_latency_seconds=0.1)
    alone, rows = latency_alone(Slow(), [{"r": i} for i in range(8)], config, timer)
    assert alone == 40.0 and Slow.calls == 1 + 3  # warm-up, then 3 samples (120 ms > 0.1 s)
    assert rows[0] == ("latency_p50_ms", 40.0, "ms (n=3)")
    config = BenchConfig(name="t", models=("tiny:qwen3_5_text",), warmup=0, repeats=2, latency_requests=2,
                         max_latency_seconds=100)
    _, rows = latency_alone(Slow(), [{"r": 0}, {"r": 1}], config, timer)
    assert rows[0][2] == "ms"


def test_op_benchmark_markdown_beside_its_json(tmp_path):
    """benchmarks/ops/tables.py: one table line per JSON row, in order, with the hardware named."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "ops"))
    from tables import write_beside

    rows = [{"workload": "race64", "model": "m", "engine": e, "tokens": 128, "value": v, "floor_ms": 0.5,
             "x_floor": v / 0.5, "hardware": "NVIDIA H200"} for e, v in (("triton", 1.0), ("flex", 2.5))]
    path = tmp_path / "ops.json"
    path.write_text(json.dumps(rows))
    text = write_beside(path, rows).read_text()
    lines = [line for line in text.splitlines() if line.startswith("| race64")]
    assert "NVIDIA H200" in text and len(lines) == 2
    assert lines[0].split("|")[3].strip() == "triton" and lines[1].endswith("| 5.0 |")


def test_serve_ab_variants_take_yaml_values_with_commas():
    """benchmarks/serve_ab.py: a variant is NAME=[KEY=VALUE,...]; a bracketed YAML value keeps its commas (a bucket
    list), dotted keys nest, and a malformed item is refused naming it."""
    import sys
    from pathlib import Path

    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from serve_ab import parse_variant, split_top_level

    assert split_top_level("a=[1, 2],b={c: 3, d: 4},e=x") == ["a=[1, 2]", "b={c: 3, d: 4}", "e=x"]
    assert parse_variant("default=") == ("default", {})
    assert parse_variant("coarse=capacities.buckets=[256, 512],serve.launch_ahead=false") == (
        "coarse", {"capacities": {"buckets": [256, 512]}, "serve": {"launch_ahead": False}})
    with pytest.raises(ValueError, match="'oops' is not KEY=VALUE"):
        parse_variant("bad=serve.fill_buckets=true,oops")
    with pytest.raises(ValueError, match="give it a name"):
        parse_variant("=serve.fill_buckets=true")


def test_serve_command_runs_the_cli_behind_the_parent_death_launcher(tmp_path):
    """`flide.bench.server.serve_command`, which FlideServer and benchmarks/serve_ab.py both start: the CLI's serve
    behind the launcher that takes this process's pid (so a killed benchmark takes its servers along), the model
    flags only for a config-JSON model."""
    import os

    from flide.bench.server import _LAUNCHER, serve_command

    cmd = serve_command(tmp_path / "c.yaml", 8123)
    assert cmd[1:4] == ["-c", _LAUNCHER, str(os.getpid())]
    assert cmd[4:7] == ["-m", "flide.cli", "serve"] and "--model" not in cmd
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--config") + 1] == str(tmp_path / "c.yaml")
    cmd = serve_command(tmp_path / "c.yaml", 8123, "m.json", "tok")
    assert cmd[-5:] == ["--model", "m.json", "--random-weights", "--tokenizer", "tok"]
