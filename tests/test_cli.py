"""The `flide decide` command line: the embedded default model, a request file, stdin, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REQUEST = {"state": "I was charged twice for my order. Please refund!",
           "questions": {"refund": {"type": "noul", "instructions": "Is a refund requested?"},
                         "team": {"type": "choice", "instructions": "Which team?",
                                  "criteria": {"billing": "refunds", "tech": None}}}}


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flide.cli", *args], input=stdin, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)


def test_decide_from_stdin_with_the_embedded_model():
    done = run_cli("decide", "-", stdin=json.dumps(REQUEST))
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    assert list(answers) == ["refund", "team"]
    assert 0.0 <= answers["refund"]["noul"] <= 1.0
    assert abs(sum(answers["team"]["probabilities"].values()) - 1.0) < 1e-5
    assert "RANDOM" in done.stderr  # it says its weights are random


def test_decide_a_list_from_a_file_equals_the_engine(tmp_path):
    import flide
    from flide.models.tiny import tiny_model, tiny_tokenizer

    path = tmp_path / "requests.json"
    path.write_text(json.dumps([REQUEST, REQUEST]))
    done = run_cli("decide", str(path), "--config", "configs/default.yaml")
    assert done.returncode == 0, done.stderr
    expected = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer()).decide([REQUEST, REQUEST])
    got = json.loads(done.stdout)
    assert [list(a) for a in got] == [list(a) for a in expected]
    assert abs(got[0]["refund"]["noul"] - expected[0]["refund"]["noul"]) < 1e-6


def test_bad_request_exits_2_naming_the_field():
    done = run_cli("decide", "-", stdin=json.dumps({"state": "x", "questions": {"q": {"type": "maybe"}}}))
    assert done.returncode == 2
    assert "questions.q.type" in done.stderr
    done = run_cli("decide", "-", stdin="{not json")
    assert done.returncode != 0 and "not valid JSON" in done.stderr


def test_unknown_config_key_is_reported():
    done = run_cli("decide", "-", "--config", "/nonexistent.yaml", stdin=json.dumps(REQUEST))
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_bench_subcommand_reaches_the_runner():
    done = run_cli("bench", "configs/bench/cpu_smoke.yaml", "--dry-run")
    assert done.returncode == 0, done.stderr
    printed = done.stdout + done.stderr
    assert "cpu_smoke" in printed and "engines" in printed


def test_decide_in_batch_invariant_mode_gives_the_same_answers():
    done = run_cli("decide", "-", "--batch-invariant", stdin=json.dumps(REQUEST))
    assert done.returncode == 0, done.stderr
    plain = json.loads(run_cli("decide", "-", stdin=json.dumps(REQUEST)).stdout)
    got = json.loads(done.stdout)
    assert abs(got["refund"]["noul"] - plain["refund"]["noul"]) < 1e-5
