"""Answer fidelity (flide/bench/fidelity.py, `mode: fidelity`): the metric functions on hand-made answers, the float32
reference's kernel swap, the peaked-model scale, and configs/bench/cpu_fidelity.yaml end to end (tiny models, fp32:
Flide ~0 from the reference, the delimiter baseline not)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import yaml

from flide import workloads as datasets
from flide.bench.config import REPO, config_from_dict, load_bench_config
from flide.bench.fidelity import (
    QuestionDiff,
    compare,
    compare_question,
    concurrent_answers,
    decisions,
    distribution,
    exact_float32,
    stability,
    summarize,
    top,
    transformers_torch_path,
)


def noul(p: float) -> dict:
    return {"type": "noul", "noul": p}


def choice(**probabilities: float) -> dict:
    return {"type": "choice", "choice": max(probabilities, key=probabilities.get), "confidence": 0.0,
            "probabilities": probabilities}


def score(*probabilities: float) -> dict:
    return {"type": "score", "score": 0.0, "legend": {}, "confidence": 0.0,
            "probabilities": {str(i): p for i, p in enumerate(probabilities)}}


# ---- one question ----
def test_distribution_top_and_decisions():
    assert distribution(noul(0.3)) == pytest.approx([0.3, 0.7])
    assert top(noul(0.51)) == "true" and top(noul(0.5)) == "false" and top(noul(0.2)) == "false"
    assert top(choice(a=0.2, b=0.5, c=0.3)) == "b"
    assert top(choice(a=0.4, b=0.4, c=0.2)) == "a"  # a tie: the first option
    assert top(score(0.1, 0.2, 0.7)) == "2"
    assert decisions(noul(0.7)) == [True]
    assert decisions(choice(a=0.6, b=0.3, c=0.1)) == [True, False, False]
    assert decisions(score(0.3, 0.3, 0.4)) == [False, False, False]


def test_compare_question_noul():
    diff = compare_question(noul(0.45), noul(0.55))  # reference 0.45, answer 0.55: crosses 0.5
    assert diff.tv == pytest.approx(0.10) and diff.max_abs == pytest.approx(0.10)
    assert not diff.same_top and diff.flips == 1 and diff.decisions == 1
    same = compare_question(noul(0.2), noul(0.25))
    assert same.tv == pytest.approx(0.05) and same.same_top and same.flips == 0


def test_compare_question_choice():
    reference = choice(a=0.6, b=0.3, c=0.1)
    answer = choice(a=0.4, b=0.5, c=0.1)
    diff = compare_question(reference, answer)
    assert diff.tv == pytest.approx(0.5 * (0.2 + 0.2 + 0.0))
    assert diff.max_abs == pytest.approx(0.2)
    assert not diff.same_top
    assert diff.flips == 1 and diff.decisions == 3  # a: 0.6 -> 0.4 flips; b: 0.3 -> 0.5 is not > 0.5
    # every option under 0.5 in both: the top answer changes, no 0.5 decision does
    diff = compare_question(choice(a=0.4, b=0.35, c=0.25), choice(a=0.3, b=0.45, c=0.25))
    assert not diff.same_top and diff.flips == 0


def test_compare_question_refuses_other_options():
    with pytest.raises(ValueError, match=r"question 'requests\[0\]\.q': the answer .* does not match the reference"):
        compare_question(choice(a=0.5, b=0.5), choice(a=0.5, c=0.5), "requests[0].q")
    with pytest.raises(ValueError, match="does not match"):
        compare_question(noul(0.5), score(0.5, 0.5))


def test_summarize_by_hand():
    reference = [{"u": noul(0.45), "t": choice(a=0.6, b=0.3, c=0.1)}, {"s": score(0.2, 0.3, 0.5)}]
    answers = [{"u": noul(0.55), "t": choice(a=0.6, b=0.3, c=0.1)}, {"s": score(0.2, 0.4, 0.4)}]
    diffs = compare(reference, answers)
    assert [d.tv for d in diffs] == pytest.approx([0.10, 0.0, 0.10])
    got = summarize(diffs)
    assert got["questions"] == 3 and got["decisions"] == 1 + 3 + 3
    assert got["agreement_pct"] == pytest.approx(100 / 3)  # u flips to yes, s's top moves from 2 to 1 (0.4 tie: first)
    assert got["tv_points"] == pytest.approx(20 / 3)
    assert got["flip_pct"] == pytest.approx(100 / 7)  # only u's decision changes (no score option crosses 0.5)
    assert got["max_abs_points"] == pytest.approx(10)
    # P99 over the per-question largest changes [0.1, 0, 0.1] (linear between ranks) is 10 points
    assert got["p99_points"] == pytest.approx(10)
    assert got["tv_points_q0"] == pytest.approx(0) and got["tv_points_q100"] == pytest.approx(10)
    assert got["tv_points_q50"] == pytest.approx(10)


def test_p99_is_a_percentile_over_questions():
    diffs = [QuestionDiff(tv=0.0, max_abs=i / 1000, same_top=True, flips=0, decisions=1) for i in range(101)]
    got = summarize(diffs)  # largest changes 0.000 .. 0.100: the 99th percentile is 0.099
    assert got["p99_points"] == pytest.approx(9.9)
    assert got["agreement_pct"] == 100 and got["flip_pct"] == 0 and got["tv_points"] == 0


def test_compare_checks_requests_and_questions():
    with pytest.raises(ValueError, match="2 answer sets for 1 reference"):
        compare([{"u": noul(0.5)}], [{"u": noul(0.5)}, {"u": noul(0.5)}])
    with pytest.raises(ValueError, match="request 0: questions"):
        compare([{"u": noul(0.5)}], [{"v": noul(0.5)}])
    with pytest.raises(ValueError, match="no questions"):
        summarize([])


def test_stability():
    alone = [{"u": noul(0.6), "t": choice(a=0.5, b=0.3, c=0.2)}, {"s": score(0.1, 0.9)}]
    same = [{"u": noul(0.58), "t": choice(a=0.45, b=0.35, c=0.2)}, {"s": score(0.2, 0.8)}]
    moved = [{"u": noul(0.49), "t": choice(a=0.5, b=0.3, c=0.2)}, {"s": score(0.2, 0.8)}]
    assert stability(alone, [same]) == 100
    assert stability(alone, [moved]) == pytest.approx(100 * 2 / 3)
    assert stability(alone, [same, moved]) == pytest.approx(100 * 5 / 6)
    with pytest.raises(ValueError, match="answered 1 requests, alone 2"):
        stability(alone, [same[:1]])


# ---- the reference and the engines' concurrent pass ----
def test_exact_float32_restores_flags():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.get_float32_matmul_precision())
    torch.set_float32_matmul_precision("high")
    try:
        with exact_float32():
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before[2])


def test_transformers_torch_path_swaps_and_restores():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    wrapped = qwen.torch_chunk_gated_delta_rule
    conv = qwen.causal_conv1d_fn
    assert getattr(wrapped, "__wrapped__", None) is not None  # transformers' hub wrapper (fla when installed)
    with transformers_torch_path() as replaced:
        inner = qwen.torch_chunk_gated_delta_rule
        assert inner is not wrapped and qwen.causal_conv1d_fn is not conv
        # the torch function itself, called with the wrapper's keyword filtering
        assert getattr(inner, "__wrapped__", inner).__code__ is wrapped.__wrapped__.__code__
        from transformers.utils.import_utils import is_flash_linear_attention_available

        if not is_flash_linear_attention_available():
            assert not any("gated_delta" in name for name in replaced)
    assert qwen.torch_chunk_gated_delta_rule is wrapped and qwen.causal_conv1d_fn is conv


class _Recorder:
    """A fake engine: records each decide() call's requests; answers one noul question per request."""

    def __init__(self, packs: bool):
        self.packs_rounds = packs
        self.calls: list[list[int]] = []

    def decide(self, requests):
        self.calls.append([r["id"] for r in requests])
        return [{"q": noul(0.25 + r["id"] / 100)} for r in requests]

    def for_thread(self, tokenizer):
        return self


class _Pool:
    def get(self, n):
        return [None] * n


def test_concurrent_answers_random_rounds():
    from flide.bench.config import FidelityOptions

    requests = [{"id": i} for i in range(20)]
    options = FidelityOptions(stability_threads=8, stability_max_group=5, stability_copies=3)
    packed = _Recorder(packs=True)
    passes = concurrent_answers(packed, requests, options, _Pool(), seed=1)
    assert len(passes) == 3 and all(len(p) == 20 for p in passes)
    assert all(p[i] == {"q": noul(0.25 + i / 100)} for p in passes for i in range(20))  # answers land in place
    assert sorted(i for call in packed.calls for i in call) == sorted(list(range(20)) * 3)
    assert max(len(call) for call in packed.calls) > 1 and all(1 <= len(c) <= 5 for c in packed.calls)
    single = _Recorder(packs=False)
    concurrent_answers(single, requests, options, _Pool(), seed=1)
    assert len(single.calls) == 60 and all(len(call) == 1 for call in single.calls)


# ---- config ----
@pytest.mark.parametrize("values, message", [
    ({"mode": "quality"}, "`mode`: must be one of speed, fidelity"),
    ({"mode": "fidelity", "engines": ["flide", "http"]}, "the http engine measures speed"),
    ({"final_norm_scale": 0}, "`final_norm_scale`: must be a number > 0"),
    ({"final_norm_scale": "auto"}, "`auto` picks a scale for answer fidelity: only with `mode: fidelity`"),
    ({"fidelity": {"threads": 4}}, "fidelity.threads; valid keys of `fidelity`: stability_threads"),
    ({"fidelity": {"stability_copies": 0}}, "`fidelity.stability_copies`: must be an integer >= 1"),
    ({"fidelity": {"top_probability_range": [0.5]}}, "`fidelity.top_probability_range`: must be [low, high]"),
])
def test_fidelity_config_errors(values, message):
    with pytest.raises(ValueError) as error:
        config_from_dict({"name": "t", "models": ["tiny:qwen3_5_text"], **values})
    assert message in str(error.value)


def test_shipped_fidelity_configs():
    cpu = load_bench_config(REPO / "configs/bench/cpu_fidelity.yaml")
    assert cpu.mode == "fidelity" and cpu.dtype == "float32" and cpu.final_norm_scale
    assert {"flide", "delimiter"} <= set(cpu.engines)
    values = yaml.safe_load((REPO / "configs/bench/h200_fidelity_0_8b.yaml").read_text())
    assert values["mode"] == "fidelity" and values["dtype"] == "bfloat16" and values["device"] == "cuda"
    assert set(values["workloads"]) == {"race", "multirc", "quality"}
    assert set(values["engines"]) == {"flide", "pipeline", "prefix-cache", "delimiter"}
    assert values["final_norm_scale"] == "auto"
    config = config_from_dict({**values, "models": ["tiny:qwen3_5_text"], "tokenizer": None, "data_dir": None})
    assert config.fidelity.stability_threads == 64


# ---- the peaked model ----
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "llama"])  # x * (1 + w) and x * w
def test_final_norm_scale_scales_the_logits(model_type):
    from flide.bench.runner import FinalNormScale
    from flide.models.tiny import tiny_model

    model = tiny_model(model_type, seed=3)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        base = model(input_ids=ids).logits
        scale = FinalNormScale(model)
        assert scale.offset == (model_type == "qwen3_5_text")
        scale.set(6.0)
        assert torch.allclose(model(input_ids=ids).logits, 6.0 * base, rtol=1e-4, atol=1e-4)
        scale.set(1.0)
        assert torch.equal(model(input_ids=ids).logits, base)


# ---- end to end ----
def _with_data(values: dict, tmp_path) -> dict:
    """The config with a small data folder of our own when ../shared/data is absent (race + multirc)."""
    if datasets.data_available():
        return values
    race, multirc = tmp_path / "data" / "race", tmp_path / "data" / "multirc"
    race.mkdir(parents=True)
    multirc.mkdir(parents=True)
    passage = {"article": "The school opened in May. The pupils walked there. " * 4, "questions": ["When?", "Who?"],
               "options": [["May", "June", "July", "never"], ["pupils", "cats", "kings", "nobody"]], "answers": "AA"}
    for part in ("middle", "high"):
        (race / f"race_dev_{part}.jsonl").write_text((json.dumps(passage) + "\n") * 3)
    return {**values, "data_dir": str(tmp_path / "data"), "workloads": ["race"]}


def test_cpu_fidelity_run(tmp_path, monkeypatch):
    """configs/bench/cpu_fidelity.yaml end to end: in float32 Flide and prefix-cache stay within rounding of the
    reference, the pipeline is the reference, the delimiter baseline moves the answers; Table-4 markdown and plot.
    A second part of the grid (--engines) takes the reference from the cache the first run left."""
    from flide.bench import main
    from flide.bench.runner import ROW_KEYS

    values = _with_data(yaml.safe_load((REPO / "configs/bench/cpu_fidelity.yaml").read_text()), tmp_path)
    path = tmp_path / "cpu_fidelity.yaml"
    path.write_text(yaml.safe_dump(values))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 0

    rows = json.loads((tmp_path / "out" / "cpu_fidelity.json").read_text())
    assert rows and all(tuple(r) == ROW_KEYS for r in rows) and "error" not in {r["metric"] for r in rows}
    got = {(r["model"], r["workload"], r["engine"], r["metric"]): r["value"] for r in rows}
    models = {"tiny-qwen3_5_text", "tiny-llama"}
    assert {m for m, *_ in got} == models
    for model in models:
        for workload in values["workloads"]:
            for engine in ("flide", "flide:batch-invariant", "prefix-cache"):
                assert got[(model, workload, engine, "tv_points")] < 1e-3  # 1e-5 in probability
                assert got[(model, workload, engine, "max_abs_points")] < 1e-3
                assert got[(model, workload, engine, "agreement_pct")] == 100
                assert got[(model, workload, engine, "flip_pct")] == 0
                assert got[(model, workload, engine, "stability_pct")] == 100
            assert got[(model, workload, "pipeline", "tv_points")] == 0  # the reference's own computation
            assert got[(model, workload, "delimiter", "tv_points")] > 1e-2
            assert got[(model, workload, "delimiter", "max_abs_points")] > got[(model, workload, "flide",
                                                                                "max_abs_points")] * 100
            questions = got[(model, workload, "-", "requests")] * got[(model, workload, "-", "questions_per_request")]
            assert got[(model, workload, "flide", "questions")] == pytest.approx(questions)
            assert 0 < got[(model, workload, "reference", "mean_top_probability")] <= 1
    report = (tmp_path / "out" / "cpu_fidelity.md").read_text()
    assert "| workload | engine | Agr. | TV | P99 | Flip | Stab. |" in report
    assert "| race | delimiter |" in report and "final_norm_scale: 8" in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "cpu_fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --report rewrites the markdown (and plot) from the JSON alone
    (tmp_path / "out" / "cpu_fidelity.md").unlink()
    assert main([str(path), "--out", str(tmp_path / "out"), "--report"]) == 0
    assert (tmp_path / "out" / "cpu_fidelity.md").read_text() == report

    from flide.bench import fidelity

    assert (tmp_path / "out" / "cpu_fidelity.reference.json").exists()

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference was computed again instead of read from the cache")

    monkeypatch.setattr(fidelity, "reference_answers", no_reference)
    assert main([str(path), "--out", str(tmp_path / "out"), "--engines", "flide"]) == 0
    again = json.loads((tmp_path / "out" / "cpu_fidelity.json").read_text())
    assert {(r["model"], r["workload"], r["engine"], r["metric"]): r["value"] for r in again
            if r["engine"] in ("flide", "reference")} == {k: v for k, v in got.items() if k[2] in ("flide", "reference")}


def test_reference_cache_keys_on_weights_and_requests(tmp_path):
    """A cached reference is found only for the same weights and the same requests."""
    from flide.bench.fidelity import ReferenceCache, weights_fingerprint

    model = torch.nn.Linear(3, 2)
    fingerprint = weights_fingerprint(model)
    cache = ReferenceCache(tmp_path, "grid")
    key = cache.key(fingerprint, [{"state": "a"}])
    cache.put(key, [{"q": {"type": "noul", "probability": 0.25}}], ["gdn.chunk"])
    again = ReferenceCache(tmp_path, "grid")
    assert again.get(key) == ([{"q": {"type": "noul", "probability": 0.25}}], ["gdn.chunk"])
    assert again.get(again.key(fingerprint, [{"state": "b"}])) is None
    with torch.no_grad():
        model.weight[0, 0] += 1
    assert weights_fingerprint(model) != fingerprint
    (tmp_path / "grid.reference.json").write_text("{not json")
    assert ReferenceCache(tmp_path, "grid").get(key) is None  # unreadable: ignored (and rewritten on the next put)


def test_final_norm_scale_auto(tmp_path, monkeypatch):
    """`final_norm_scale: auto` picks the candidate whose typical top probability is nearest 0.7 (the tiny random
    model answers almost uniformly at scale 1), records it per workload, and the reference and engines run with
    it: their mean top probability moves up from the unscaled model's, Flide still equal to the reference."""
    from flide.bench import main
    from flide.bench.fidelity import AUTO_SCALES

    values = _with_data(yaml.safe_load((REPO / "configs/bench/cpu_fidelity.yaml").read_text()), tmp_path)
    values = {**values, "name": "auto_scale", "models": ["tiny:qwen3_5_text"], "workloads": ["race"],
              "engines": ["flide"], "ablations": {}, "final_norm_scale": "auto", "limits": {"race": 3}}
    path = tmp_path / "auto_scale.yaml"
    path.write_text(yaml.safe_dump(values))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "auto_scale.json").read_text())
    got = {(r["workload"], r["engine"], r["metric"]): r["value"] for r in rows}
    scale = got[("race", "-", "final_norm_scale")]
    assert scale in AUTO_SCALES and scale > 1
    assert got[("race", "reference", "mean_top_probability")] > 0.4  # 4 options: ~0.25 when unscaled
    assert got[("race", "flide", "tv_points")] < 1e-3
    report = (tmp_path / "out" / "auto_scale.md").read_text()
    assert f"final_norm_scale: auto: {scale:g}" in report

    # a later part of the grid takes the scale (and the reference) the first part left beside its results
    from flide.bench import fidelity

    def again_(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"the {what} was computed again instead of read from the first part")
        return fail

    monkeypatch.setattr(fidelity, "pick_final_norm_scale", again_("scale"))
    monkeypatch.setattr(fidelity, "reference_answers", again_("reference"))
    assert main([str(path), "--out", str(tmp_path / "out"), "--engines", "flide"]) == 0
    again = {(r["workload"], r["engine"], r["metric"]): r["value"]
             for r in json.loads((tmp_path / "out" / "auto_scale.json").read_text())}
    assert again[("race", "-", "final_norm_scale")] == scale
    assert again[("race", "flide", "tv_points")] == got[("race", "flide", "tv_points")]


def test_top_probability_helper(capsys, tmp_path):
    """`--top-probability`: a larger final-norm scale gives a larger mean top probability."""
    from flide.bench.fidelity import top_probability_table

    values = _with_data({"name": "t", "models": ["tiny:qwen3_5_text"], "device": "cpu", "workloads": ["race"],
                         "limits": {"race": 2}}, tmp_path)
    table = top_probability_table(config_from_dict(values), [1.0, 4.0, 16.0], requests=2, log=lambda _: None)
    means = [mean for _, _, workload, mean, _ in table if workload == "race"]
    assert len(means) == 3 and means[0] < means[1] < means[2] and means[0] < 0.4
