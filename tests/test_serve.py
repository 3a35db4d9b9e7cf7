"""`flide serve`: the System One HTTP server over the tiny random Qwen3.5 (CPU).

Answers equal `engine.decide`; 64 concurrent clients on a real uvicorn server; rounds really batch; a hypothesis fuzz
of malformed bodies never gets a 5xx; queue-full 503, timeout 504, a failing request or an out-of-memory round
inside a round; Prometheus text; the command line.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import flide
from flide.config import ServeConfig
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.serve import create_app
from flide.testing import max_difference
from flide.serve.body import TOP_LEVEL_KEYS, ApiError, check_value, needs_check
from flide.testing import SUPPORT_TICKET as GOOD

REPO = Path(__file__).resolve().parent.parent
NAME = "tiny"
# Rounds of at most 8 requests: the CPU reference attention costs more per request in larger rounds (NOTES.md)
CONFIG = {"capacities": {"buckets": [256, 1024, 4096, 16384], "requests": 8, "states": 128, "branches": 512,
                         "readout_rows": 512},
          "serve": {"prepare_threads": 2}}

NOUL = {"type": "noul", "instructions": "Is it urgent?"}
REQUESTS = [
    GOOD,
    {"model": NAME, "state": "Order 66 arrived late. <|im_end|> The customer is annoyed.",
     "questions": {"late": NOUL, "a.b": {"type": "choice", "instructions": "Which?",
                                         "criteria": {f"option {i}": None for i in range(26)}}}},
    {"state": ["the student read the passage", {"time": 3}], "questions": {
        f"q{i}": {"type": "score", "instructions": f"Level {i}?", "criteria": ["low", "mid", "high"]} for i in range(7)}},
    {"state": "Water between the world and the people. " * 12, "questions": {"z": NOUL, "y": {
        "type": "noul", "instructions": "<|mark|> true?", "criteria": {"true": "yes it is", "false": None}}}},
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch on one thread (see tests/test_requests.py): these models are tiny and the CPU is small and shared."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine():
    return flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer(), config=CONFIG)


@pytest.fixture(scope="module")
def serial(engine):
    """Each request of REQUESTS answered alone by the engine (before any server runs the model)."""
    return [engine.decide(copy.deepcopy(r)) for r in REQUESTS]


@pytest.fixture(scope="module")
def client(engine, serial):
    with TestClient(create_app(engine, NAME)) as test_client:
        yield test_client


@contextlib.contextmanager
def serving(app):
    """A real uvicorn server for `app` on 127.0.0.1 at a free port, in a thread; stopped on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 60)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive()


def wait_until(condition, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def post(url: str, request, **headers) -> httpx2.Response:
    with httpx2.Client(base_url=url, timeout=120) as http:
        return http.post("/v1/systemone", json=request, headers=headers)


def close(got: dict, expected: dict, tol: float = 1e-5) -> bool:
    """Answers equal up to `tol` on every float (same keys, same order, same types otherwise)."""
    if isinstance(expected, dict):
        return isinstance(got, dict) and list(got) == list(expected) and all(close(got[k], v, tol)
                                                                            for k, v in expected.items())
    if isinstance(expected, float):
        return isinstance(got, float) and abs(got - expected) <= tol
    return got == expected


def metric_samples(text: str) -> dict:
    """Prometheus text -> {(sample name, frozenset(labels)): value}."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---- answers ----
def test_answers_equal_engine_decide(client, engine, serial):
    for request, expected in zip(REQUESTS, serial):
        response = client.post("/v1/systemone", json=request, headers={"X-Request-Id": "req-42"})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["answers"] == expected  # the same request alone in a round: the same floats
        assert list(body["answers"]) == list(request["questions"])
        assert body["model"] == NAME
        assert body["usage"] == {"input_tokens": engine.usage(engine.prepare(copy.deepcopy(request))).input_tokens,
                                 "output_tokens": 0}
        assert response.headers["x-request-id"] == "req-42"
    assert client.post("/v1/systemone", json=GOOD).headers["x-request-id"]  # one is made up when none is given


def test_fastapi_route_answers_as_the_fast_path(engine, serial):
    """POST /v1/systemone is answered by a plain ASGI layer before FastAPI's router; a request that reaches the
    FastAPI route instead (here: the app mounted under a prefix, which that layer does not match) gets the same
    answers, headers and errors."""
    from fastapi import FastAPI

    outer, inner = FastAPI(), create_app(engine, NAME)
    outer.mount("/api", inner)
    inner.state.scheduler.start()  # a mounted app's lifespan does not run
    with TestClient(outer) as mounted:
        for request, expected in zip(REQUESTS[:2], serial):
            response = mounted.post("/api/v1/systemone", json=request, headers={"X-Request-Id": "via-route"})
            assert response.status_code == 200, response.text
            assert response.json()["answers"] == expected
            assert response.headers["x-request-id"] == "via-route"
            assert response.headers["content-type"] == "application/json"
        bad = mounted.post("/api/v1/systemone", json={"state": "x"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "questions"]
    inner.state.scheduler.stop()


# (id, body, content type, status, loc, words)
BAD = [
    ("missing-state", {"questions": {"q": NOUL}}, "application/json", 422, ["body", "state"], ["missing"]),
    ("missing-questions", {"state": "x"}, "application/json", 422, ["body", "questions"], ["missing"]),
    ("empty-questions", {"state": "x", "questions": {}}, "application/json", 422, ["body", "questions"],
     ["at least one"]),
    ("unknown-type", {"state": "x", "questions": {"a.b": {"type": "yesno"}}}, None, 422,
     ["body", "questions", "a.b", "type"], ["yesno", "choice"]),
    ("choice-no-criteria", {"state": "x", "questions": {"q": {"type": "choice"}}}, None, 422,
     ["body", "questions", "q", "criteria"], ["criteria"]),
    ("too-many-options", {"state": "x", "questions": {"q": {"type": "choice", "criteria": {str(i): None
                                                                                           for i in range(27)}}}},
     None, (400, 422), ["body", "questions", "q", "criteria"], ["26", "27"]),
    ("too-many-questions", {"state": "x", "questions": {f"q{i}": NOUL for i in range(65)}}, None, 422,
     ["body", "questions"], ["65", "64"]),
    ("assets", {**GOOD, "assets": {"img-1": {"type": "image", "format": "png", "data_base64": "AAAA"}}}, None, 400,
     ["body", "assets"], ["text model"]),
    ("list", [GOOD], None, 422, ["body"], ["object", "list"]),
    ("unknown-field", {**GOOD, "question": {}}, None, 422, ["body", "question"], ["not a field"]),
    ("other-model", {**GOOD, "model": "gpt-5"}, None, 404, ["body", "model"], ["gpt-5", NAME]),
    ("model-not-string", {**GOOD, "model": 3}, None, 422, ["body", "model"], ["string"]),
    ("invalid-json", b'{"state": "x", "questions": {', None, 422, ["body"], ["not valid JSON"]),
    ("empty-body", b"", "application/json", 422, ["body"], ["not valid JSON"]),
    ("not-utf8", b'{"state": "\xff\xfe"}', None, 422, ["body"], ["UTF-8"]),
    ("nan", b'{"state": NaN, "questions": {"q": {"type": "noul"}}}', None, 422, ["body"], ["NaN"]),
    ("huge-int", b'{"state": ' + b"9" * 5000 + b', "questions": {"q": {"type": "noul"}}}', None, 422, ["body"],
     ["not valid JSON"]),
    ("deep-nesting", b"[" * 100_000 + b"]" * 100_000, None, 422, ["body"], ["deep"]),
    ("deep-state", {"state": json.loads("[" * 70 + "]" * 70), "questions": {"q": NOUL}}, None, 422,
     ["body", "state"] + [0] * 63, ["64 levels"]),
    ("surrogate", b'{"state": "ok", "questions": {"\\ud800": {"type": "noul"}}}', None, 422,
     ["body", "questions", "\\ud800"], ["surrogate"]),
    ("text-plain", json.dumps(GOOD).encode(), "text/plain", 415, ["header", "content-type"], ["application/json"]),
    ("form", b"state=x", "application/x-www-form-urlencoded", 415, ["header", "content-type"], ["JSON"]),
]


@pytest.mark.parametrize("body, content_type, status, loc, words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_requests_name_the_field(client, body, content_type, status, loc, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post("/v1/systemone", content=content, headers=headers)
    assert response.status_code in (status if isinstance(status, tuple) else (status,)), response.text
    [item] = response.json()["detail"]
    assert item["loc"] == loc and isinstance(item["type"], str)
    for word in words:
        assert word.lower() in item["msg"].lower(), (word, item["msg"])


def test_errors_are_the_engines_words(client, engine):
    """The HTTP error of a request the engine refuses carries the engine's RequestError: status, field, message."""
    for _, body, *_ in BAD[:8]:
        with pytest.raises(flide.RequestError) as info:
            engine.prepare(copy.deepcopy(body))
        [item] = client.post("/v1/systemone", json=body).json()["detail"]
        assert item["msg"] == info.value.message
        assert client.post("/v1/systemone", json=body).status_code == info.value.status


def test_body_size_limit(engine):
    app = create_app(engine, NAME, ServeConfig(max_body_bytes=1000, prepare_threads=1))
    with TestClient(app) as small:
        big = json.dumps({"state": "x" * 2000, "questions": {"q": NOUL}}).encode()
        response = small.post("/v1/systemone", content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["detail"][0]["loc"] == ["body"]
        # Without Content-Length (chunked): refused while reading
        response = small.post("/v1/systemone", content=iter([big[:600], big[600:]]))
        assert response.status_code == 413 and "1000" in response.json()["detail"][0]["msg"]
        assert small.post("/v1/systemone", json={"state": "x", "questions": {"q": NOUL}}).status_code == 200


def test_prompt_over_the_token_limit_is_413(engine):
    limited = flide.patch(engine.model, engine.tokenizer, config={**CONFIG, "limits": {"max_prompt_tokens": 50}})
    with TestClient(create_app(limited, NAME)) as test_client:
        response = test_client.post("/v1/systemone", json={"state": "charged twice " * 40, "questions": {"q": NOUL}})
        assert response.status_code == 413
        assert response.json()["detail"][0]["loc"] == ["body", "state"]


def test_health_models_openapi(client):
    assert client.get("/health").json() == {"status": "ok", "model": NAME, "queue_depth": 0}
    [card] = client.get("/v1/models").json()["data"]
    assert card["id"] == NAME and card["model_type"] == "qwen3_5_text" and card["max_questions"] == 64
    spec = client.get("/openapi.json").json()
    assert {"/v1/systemone", "/health", "/v1/models", "/metrics"} <= set(spec["paths"])
    post_ = spec["paths"]["/v1/systemone"]["post"]
    ref = post_["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schemas = spec["components"]["schemas"]
    assert ref.rsplit("/", 1)[-1] in schemas and "questions" in schemas["SystemOneRequest"]["properties"]
    assert {"200", "400", "413", "422", "503", "504"} <= set(post_["responses"])
    assert client.get("/docs").status_code == 200


# ---- continuous rounds under load ----
def test_64_concurrent_clients_on_a_real_server(engine, serial):
    app = create_app(engine, NAME)
    n_clients, per_client = 64, 1
    barrier = threading.Barrier(n_clients)

    def client_(index: int) -> list[tuple[int, int, dict]]:
        out = []
        with httpx2.Client(base_url=url, timeout=120) as http:
            barrier.wait()
            for k in range(per_client):
                which = (index + k) % len(REQUESTS)
                response = http.post("/v1/systemone", json=REQUESTS[which])
                out.append((which, response.status_code, response.json()))
        return out

    with serving(app) as url:
        start = time.perf_counter()
        with ThreadPoolExecutor(n_clients) as pool:
            results = [r for rs in pool.map(client_, range(n_clients)) for r in rs]
        elapsed = time.perf_counter() - start
        metrics = httpx2.get(f"{url}/metrics").text
    assert len(results) == n_clients * per_client
    for which, status, body in results:
        assert status == 200, body
        assert close(body["answers"], serial[which]), which  # in any round, as alone (up to float rounding)
    samples = metric_samples(metrics)
    rounds = samples[("flide_round_requests_count", frozenset())]
    single = samples[("flide_round_requests_bucket", frozenset({("le", "1.0")}))]
    assert samples[("flide_round_requests_sum", frozenset())] == n_clients * per_client
    assert single < rounds, "no round held more than one request"
    assert samples[("flide_requests_total", frozenset({("status", "200")}))] == n_clients * per_client
    print(f"\n{n_clients * per_client} requests from {n_clients} clients in {elapsed:.2f} s, {rounds:.0f} rounds")


# ---- fuzz ----
CONTROL = ["<|im_start|>", "<|im_end|>", "<|mark|>", "<|split|>", "<|endoftext|>", "{{ state }}", "{% if %}",
           "\n\n", "\u2460", "", " ", "\x00", "\ufeff", "é🙂文字", "\\ud800"]
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False,
                 allow_infinity=False), st.text(max_size=30), st.sampled_from(CONTROL))
keys = st.one_of(st.text(max_size=10), st.sampled_from(CONTROL + ["true", "false", "type", "a.b"]))
value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner,
                                                                                                max_size=4)),
                     max_leaves=10)
criteria = st.one_of(
    value, st.lists(st.one_of(st.text(max_size=12), value), max_size=30),
    st.dictionaries(st.one_of(keys, st.sampled_from(["true", "false"])), st.one_of(st.none(), st.text(max_size=20),
                                                                                   value), max_size=30))
instructions = st.one_of(st.text(max_size=60), st.sampled_from(CONTROL), value)
good_question = st.one_of(
    st.builds(lambda i, c: {"type": "choice", "instructions": i, "criteria": c}, instructions,
              st.dictionaries(st.text(min_size=1, max_size=10), st.one_of(st.none(), st.text(max_size=20)),
                              min_size=1, max_size=26)),
    st.builds(lambda i, c: {"type": "score", "instructions": i, "criteria": c}, instructions,
              st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=10)),
    st.builds(lambda i: {"type": "noul", "instructions": i}, instructions))
states = st.one_of(st.text(max_size=200), st.sampled_from(CONTROL), value)
good_request = st.fixed_dictionaries({"state": states, "questions": st.dictionaries(keys, good_question, min_size=1,
                                                                                    max_size=4)})
question = st.one_of(
    value, good_question,
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["choice", "score", "noul"]), leaf)},
                          optional={"instructions": instructions, "criteria": criteria, "extra": leaf}))
request = st.fixed_dictionaries(
    {}, optional={"state": states,
                  "questions": st.one_of(st.dictionaries(keys, question, min_size=1, max_size=5), value),
                  "assets": st.one_of(st.just({}), value), "model": st.one_of(st.just(NAME), leaf),
                  "extra": leaf})
SPECIAL = [b"[" * 5000, b"{" * 5000, b'{"a":' * 3000, b'{"state": "x", "questions": {"q": {"type": "noul"}}} x',
           b'{"state": Infinity}', b'{1: 2}', b"\xef\xbb\xbf{}", b'{"state": "\\udfff", "questions": 1}', b"null",
           b'"\\ud83d\\ude00"', b'{"state": "x", "questions": {"q": {"type": "noul"}, "q": {"type": "score"}}}',
           b"\x00" * 10, "{\"state\": \"x\", \"questions\": {\"\u00e9\": {\"type\": \"noul\"}}}".encode("utf-16")]
bodies = st.one_of(
    good_request.map(lambda r: json.dumps(r).encode()),  # well-formed requests with odd contents
    request.map(lambda r: json.dumps(r).encode()),  # near-valid requests
    request.map(lambda r: json.dumps(r).encode()),
    value.map(lambda v: json.dumps(v).encode()),
    request.map(json.dumps).flatmap(lambda s: st.integers(0, len(s)).map(lambda i: s[:i].encode())),  # cut short
    st.binary(max_size=300),
    st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.sampled_from(SPECIAL))
content_types = st.sampled_from(["application/json"] * 6 + [None, "application/json; charset=utf-8",
                                                             "application/vnd.api+json", "text/plain",
                                                             "multipart/form-data; boundary=x", "", "*/*"])


@settings(max_examples=300, deadline=None)
@given(value=st.recursive(st.text(max_size=8) | st.integers() | st.none(),
                          lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4),
                                                                                            children, max_size=3),
                          max_leaves=20),
       depth=st.integers(1, 6))
def test_the_body_walk_is_skipped_only_where_it_cannot_find_anything(value, depth):
    """`parse_body` walks the parsed body (nesting, unpaired surrogates) only when `needs_check` says its bytes could
    hold an offender: whatever the walk rejects, `needs_check` must flag, for any encoding of the value."""
    for ascii_only in (True, False):
        body = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
        try:
            check_value(json.loads(body.decode("utf-8", "surrogatepass")), depth)
        except ApiError:
            assert needs_check(body, depth), body


def test_needs_check_on_plain_and_offending_bodies():
    assert not needs_check(b'{"state": "a \\u00e9 [b]", "questions": {"q": {"type": "noul"}}}', 64)
    assert needs_check(b'{"state": "\\ud83d"}', 64) and needs_check(b'{"state": "\\uDFFF"}', 64)
    assert not needs_check(b'{"state": "\\ue000"}', 64)
    assert needs_check(b"[[[]]]", 2) and not needs_check(b"[[[]]]", 3)


def engine_verdict(engine, body: bytes):
    """(status, message) the engine gives a JSON object body the server hands to it, or None for other bodies."""
    try:
        request_ = json.loads(body.decode("utf-8"))
        check_value(request_, 64)
    except (ValueError, RecursionError, ApiError):
        return None
    if not isinstance(request_, dict) or set(request_) - set(TOP_LEVEL_KEYS) or request_.get("model") not in (None,
                                                                                                           NAME):
        return None
    try:
        engine.prepare(request_)
    except flide.RequestError as error:
        return error.status, error.message
    return 200, None


def test_fuzz_never_5xx_and_server_survives(client, engine, serial):
    seen: dict[int, int] = {}

    @settings(max_examples=2000, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies, content_type=content_types)
    def check(body, content_type):
        headers = {} if content_type is None else {"content-type": content_type}
        response = client.post("/v1/systemone", content=body, headers=headers)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (body[:300], response.text[:500])
        payload = response.json()
        if response.status_code != 200:
            [item] = payload["detail"]
            assert isinstance(item["loc"], list) and isinstance(item["msg"], str) and item["msg"]
            return
        assert payload["usage"]["input_tokens"] > 0
        if content_type is None or content_type.startswith("application/"):
            verdict = engine_verdict(engine, body)
            assert verdict is None or verdict[0] == 200, verdict
        assert list(payload["answers"]) == list(json.loads(body)["questions"])

    check()
    assert sum(seen.values()) >= 2000 and seen.get(200, 0) > 20 and seen.get(422, 0) > 200, seen
    print(f"\nfuzz statuses: {dict(sorted(seen.items()))}")
    # Still serving, and the same answers
    assert client.get("/health").status_code == 200
    assert client.post("/v1/systemone", json=GOOD).json()["answers"] == serial[0]
    samples = metric_samples(client.get("/metrics").text)
    assert not [k for k, v in samples.items() if k[0] == "flide_requests_total" and v and
                dict(k[1])["status"].startswith("5")]


def test_fuzzed_errors_match_the_engine(client, engine):
    """Near-valid requests: the server's status and message are the engine's."""
    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(request_=st.one_of(request, good_request))
    def check(request_):
        body = json.dumps(request_).encode()
        verdict = engine_verdict(engine, body)
        response = client.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
        if verdict is None:
            assert response.status_code in (404, 422), response.text
        elif verdict[0] == 200:
            assert response.status_code == 200, response.text
        else:
            assert (response.status_code, response.json()["detail"][0]["msg"]) == verdict

    check()


# ---- overload, timeouts, failures inside a round ----
class Hooked:
    """The engine, with `hook(prepared)` called on the model thread before each round; records each round's
    question names."""

    def __init__(self, engine, hook):
        self._engine, self.hook, self.rounds = engine, hook, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run(self, prepared):  # the scheduler's rounds retried one request at a time
        self.rounds.append([q.name for p in prepared for q in p.questions])
        self.hook(prepared)
        return self._engine.run(prepared)

    def start(self, prepared):  # the scheduler's rounds
        self.rounds.append([q.name for p in prepared for q in p.questions])
        self.hook(prepared)
        return self._engine.start(prepared)


def gate_hook(**raise_for):
    """A hook that blocks any round holding a question named "blocker" until `gate` is set, and raises
    raise_for[name] in any round holding a question of that name."""
    gate, started = threading.Event(), threading.Event()

    def hook(prepared):
        names = {q.name for p in prepared for q in p.questions}
        if "blocker" in names:
            started.set()
            assert gate.wait(60)
        for name, error in raise_for.items():
            if name in names:
                raise error

    return hook, gate, started


def named(name: str, state: str = "A short message.") -> dict:
    return {"state": state, "questions": {name: NOUL}}


def test_queue_full_answers_503_with_retry_after(engine):
    hook, gate, started = gate_hook()
    hooked = Hooked(engine, hook)
    app = create_app(hooked, NAME, ServeConfig(max_queue=2, prepare_threads=2, request_timeout_s=60))
    scheduler = app.state.scheduler
    with serving(app) as url, ThreadPoolExecutor(3) as pool:
        try:
            first = pool.submit(post, url, named("blocker"))
            assert started.wait(60)
            waiting = [pool.submit(post, url, named(name)) for name in ("w1", "w2")]
            wait_until(lambda: scheduler.queued == 2)
            refused = post(url, named("w3"))
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["detail"][0]["type"] == "overloaded"
            assert httpx2.get(f"{url}/health").json()["queue_depth"] == 2
        finally:
            gate.set()
        assert first.result().status_code == 200
        assert all(f.result().status_code == 200 for f in waiting)
        assert post(url, named("w4")).status_code == 200
        samples = metric_samples(httpx2.get(f"{url}/metrics").text)
    # the two that waited shared the next round (in either order: they were prepared concurrently)
    assert [sorted(names) for names in hooked.rounds] == [["blocker"], ["w1", "w2"], ["w4"]]
    assert samples[("flide_requests_total", frozenset({("status", "503")}))] == 1
    assert samples[("flide_queue_depth", frozenset())] == 0


def test_timeout_answers_504_and_skips_the_expired_request(engine, serial):
    hook, gate, started = gate_hook()
    hooked = Hooked(engine, hook)
    app = create_app(hooked, NAME, ServeConfig(request_timeout_s=2.0, prepare_threads=1))
    with serving(app) as url, ThreadPoolExecutor(2) as pool:
        try:
            in_round = pool.submit(post, url, named("blocker"))
            assert started.wait(60)
            waiting = pool.submit(post, url, named("expired"))
            for response in (in_round.result(), waiting.result()):
                assert response.status_code == 504, response.text
                assert response.json()["detail"][0]["type"] == "timeout" and "2 s" in response.json()["detail"][0][
                    "msg"]
        finally:
            gate.set()
        response = post(url, GOOD)
        assert response.status_code == 200 and response.json()["answers"] == serial[0]
    assert hooked.rounds == [["blocker"], list(GOOD["questions"])]  # the expired request never ran


def test_a_failing_request_does_not_fail_its_round(engine):
    hook, gate, started = gate_hook(poison=RuntimeError("poisoned request"))
    hooked = Hooked(engine, hook)
    app = create_app(hooked, NAME, ServeConfig(prepare_threads=2))
    scheduler = app.state.scheduler
    requests_ = [named("ok1", "First message."), named("poison"), named("ok2", "Second message.")]
    expected = [engine.decide(copy.deepcopy(r)) for r in (requests_[0], requests_[2])]
    with serving(app) as url, ThreadPoolExecutor(4) as pool:
        try:
            pool.submit(post, url, named("blocker"))
            assert started.wait(60)
            futures = []
            for r in requests_:  # in this order, so that they share the next round in this order
                futures.append(pool.submit(post, url, r))
                wait_until(lambda: scheduler.queued == len(futures))
        finally:
            gate.set()
        ok1, poison, ok2 = [f.result() for f in futures]
        samples = metric_samples(httpx2.get(f"{url}/metrics").text)
        assert post(url, named("after")).status_code == 200
    assert ok1.status_code == 200 and ok1.json()["answers"] == expected[0]
    assert ok2.status_code == 200 and ok2.json()["answers"] == expected[1]
    assert poison.status_code == 500 and "poisoned request" in poison.json()["detail"][0]["msg"]
    assert hooked.rounds[1:5] == [["ok1", "poison", "ok2"], ["ok1"], ["poison"], ["ok2"]]  # retried one by one
    assert samples[("flide_round_failures_total", frozenset({("kind", "error")}))] == 2


def test_out_of_memory_answers_503_and_keeps_serving(engine, serial):
    import torch

    hook, gate, started = gate_hook(oom=torch.cuda.OutOfMemoryError("CUDA out of memory (test)"))
    gate.set()
    hooked = Hooked(engine, hook)
    with TestClient(create_app(hooked, NAME, ServeConfig(prepare_threads=1))) as test_client:
        response = test_client.post("/v1/systemone", json=named("oom"))
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert "out of memory" in response.json()["detail"][0]["msg"]
        assert test_client.get("/health").status_code == 200
        assert test_client.post("/v1/systemone", json=GOOD).json()["answers"] == serial[0]
        samples = metric_samples(test_client.get("/metrics").text)
    assert samples[("flide_round_failures_total", frozenset({("kind", "oom")}))] == 1


# ---- metrics ----
def test_metrics_are_prometheus_text(client):
    assert client.post("/v1/systemone", json=GOOD).status_code == 200
    assert client.post("/v1/systemone", json={"state": "x"}).status_code == 422
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name, kind in [("flide_requests", "counter"), ("flide_request_latency_seconds", "histogram"),
                       ("flide_round_requests", "histogram"), ("flide_round_tokens", "histogram"),
                       ("flide_round_seconds", "histogram"), ("flide_queue_depth", "gauge"),
                       ("flide_tokens_computed", "counter"), ("flide_input_tokens", "counter"),
                       ("flide_rounds", "counter"), ("flide_prepare_seconds", "histogram"),
                       ("flide_piece_cache_hits", "counter"), ("flide_piece_cache_chars", "gauge")]:
        assert families[name].type == kind, name
    samples = metric_samples(response.text)
    assert samples[("flide_requests_total", frozenset({("status", "200")}))] >= 1
    assert samples[("flide_requests_total", frozenset({("status", "422")}))] >= 1
    assert samples[("flide_tokens_computed_total", frozenset())] >= samples[("flide_round_tokens_sum", frozenset())]
    assert samples[("flide_rounds_total", frozenset())] == samples[("flide_round_requests_count", frozenset())]
    assert samples[("flide_piece_cache_misses_total", frozenset())] > 0  # GOOD's pieces were encoded once


# ---- the command line ----
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_serve_with_the_embedded_model(engine):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "flide.cli", "serve", "--port", str(port), "--log-format",
                                "json", "--timeout", "30", "--batch-invariant"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert process.poll() is None, process.communicate()[1]
            try:
                return httpx2.get(f"{url}/health").status_code == 200
            except httpx2.TransportError:
                return False

        wait_until(up, 120)
        response = post(url, GOOD, **{"X-Request-Id": "cli-test-1"})
        assert response.status_code == 200, response.text
        body = response.json()
        assert list(body["answers"]) == list(GOOD["questions"]) and body["model"] == "flide-tiny-qwen3.5-random"
        assert body["answers"]["urgent"]["noul"] == pytest.approx(engine.decide(copy.deepcopy(GOOD))["urgent"]["noul"],
                                                                  abs=1e-5)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert "RANDOM" in stderr  # it says its weights are random
    assert "127.0.0.1" in stderr and "serving" in stderr
    assert "batch-invariant mode" in stderr and "linear blocked" in stderr  # --batch-invariant reached the engine
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    [logged] = [line for line in lines if line.get("request_id") == "cli-test-1"]
    assert logged["status"] == 200 and logged["questions"] == 3 and logged["input_tokens"] > 0


# ---- worker processes ----
def test_prepare_processes_give_the_same_answers_and_errors(engine, serial):
    """serve.prepare_processes: requests rendered and tokenized in spawned workers answer as in process, from many
    threads at once, and a bad request is still a 422 naming its field (RequestError crosses the process boundary)."""
    settings = dataclasses.replace(engine.config.serve, prepare_processes=2, prepare_threads=2)
    with TestClient(create_app(engine, NAME, settings)) as client:
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda r: client.post("/v1/systemone", json=r), REQUESTS * 3))
        for response, expected in zip(responses, serial * 3):
            assert response.status_code == 200, response.text
            assert max_difference(response.json()["answers"], expected) <= 1e-6  # rounds shared with others
        bad = client.post("/v1/systemone", json={"state": "x", "questions": {"q": {"type": "maybe"}}})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "questions", "q", "type"]
        scheduler = client.app.state.scheduler
        workers = scheduler.workers
        assert workers is not None and workers.processes == 2 and workers.pending == [0, 0]
        # the same state goes to the same worker (its piece cache holds that state's tokens) while load is even
        history = {"state": "A long history. " * 100, "questions": {}}
        first = workers.pick(history)
        for _ in range(5):
            workers.pending[first] = 0  # as if the last one was done
            assert workers.pick(history) == first
        # a busy preferred worker is passed over
        workers.pending[first] = 3
        assert workers.pick(history) != first


def test_a_lone_request_is_prepared_on_the_event_loop(engine, serial, caplog):
    """serve.inline_prepare_bytes: a request with no other in flight skips the prepare pool (two thread wake-ups of a
    lone client's latency); requests that overlap go through the pool; the answers are the same either way."""
    caplog.set_level(logging.INFO, logger="flide.serve")

    def inline_flags() -> list:
        flags = [r.fields.get("inline", False) for r in caplog.records if getattr(r, "fields", None)
                 and r.getMessage() == "request" and r.fields.get("status") == 200]
        caplog.clear()
        return flags

    for limit, lone in ((65536, True), (0, False)):
        settings = dataclasses.replace(engine.config.serve, inline_prepare_bytes=limit)
        with TestClient(create_app(engine, NAME, settings)) as client:
            caplog.clear()
            for request, expected in zip(REQUESTS, serial):
                response = client.post("/v1/systemone", json=request)
                assert response.status_code == 200, response.text
                assert response.json()["answers"] == expected
            assert inline_flags() == [lone] * len(REQUESTS)
            if lone:
                with ThreadPoolExecutor(8) as pool:
                    responses = list(pool.map(lambda r: client.post("/v1/systemone", json=r), REQUESTS * 4))
                for response, expected in zip(responses, serial * 4):
                    assert max_difference(response.json()["answers"], expected) <= 1e-6
                assert False in inline_flags()  # overlapping requests were prepared in the pool


def test_non_finite_answers_are_a_500_not_a_crash(engine, serial):
    """Answers JSON cannot carry (a NaN from a broken model) are answered 500 with the request id, in the API's error
    shape, and the server goes on answering."""

    class NaNEngine(Hooked):
        def start(self, prepared):
            pending = self._engine.start(prepared)
            result = pending.result

            def poisoned():
                answers = result()
                for request in answers:
                    for options in request.values():
                        for key in options:
                            options[key] = float("nan")
                return answers

            pending.result = poisoned
            return pending

    broken = NaNEngine(engine, lambda prepared: None)
    with TestClient(create_app(broken, NAME, ServeConfig(prepare_threads=1))) as test_client:
        response = test_client.post("/v1/systemone", json=GOOD, headers={"X-Request-Id": "nan-1"})
        assert response.status_code == 500, response.text
        [detail] = response.json()["detail"]
        assert "non-finite" in detail["msg"] and "nan-1" in detail["msg"]
        assert test_client.get("/health").status_code == 200
