"""The System One HTTP server: a FastAPI app over an `Engine` and its round `Scheduler`.

    POST /v1/systemone   a System One request -> {"model", "answers", "usage"}   (answers as `engine.decide` gives)
    GET  /health         200 while the model thread runs, else 503
    GET  /v1/models      the served model
    GET  /metrics        Prometheus text
    GET  /openapi.json   the schema (/docs renders it)

Errors are `{"detail": [{"loc": [...], "msg": ..., "type": ...}]}`: 422 malformed (the field named), 400 a request
this model cannot answer, 404 another model, 413 too large, 415 not JSON, 503 overloaded (Retry-After), 504 past
`serve.request_timeout_s`. The endpoint reads its body itself: validation is Flide's (`body.py`, `Engine.prepare`),
so no request reaches pydantic and the messages are the engine's.

POST /v1/systemone is answered by a plain ASGI middleware in front of FastAPI's router (`_SystemOneRoute`): FastAPI's
routing, request object and dependency solving cost ~130 us a request on this repository's CPU, which the one-client
latency over HTTP pays on top of the in-process one (issue 4: within 1.5 ms). The FastAPI route stays, for the
OpenAPI schema (and answers the same way should a request reach it). The request log line and the metrics are
written after the answer is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from ..config import ServeConfig
from ..requests import RequestError
from . import schema
from .body import ApiError, from_request_error, parse_body
from .metrics import Metrics
from .scheduler import Overloaded, Scheduler

logger = logging.getLogger("flide.serve")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ERRORS = {status: {"model": schema.ErrorResponse} for status in (400, 404, 413, 415, 422, 500, 503, 504)}


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 2)


def model_name_of(engine, name_or_path: str | None = None) -> str:
    """The name the server answers as: the --model argument, else the model's own name, else its type."""
    model = engine.model
    return name_or_path or getattr(model, "name_or_path", "") or f"{model.config.model_type}"


def create_app(engine, model_name: str | None = None, settings: ServeConfig | None = None,
               scheduler: Scheduler | None = None) -> FastAPI:
    """The app serving `engine`. The scheduler's threads start and stop with the app's lifespan (uvicorn, or
    `with TestClient(app)`)."""
    from .. import __version__

    settings = settings or engine.config.serve
    name = model_name or model_name_of(engine)
    metrics = Metrics()
    scheduler = scheduler or Scheduler(engine, settings, metrics)
    metrics = scheduler.metrics
    if getattr(engine, "checkpoints", None) is not None:
        metrics.watch_checkpoints(engine.checkpoints)
    metrics.watch_piece_cache(engine.prompts.piece_cache)  # shared by the prepare threads (not worker processes)
    created = int(time.time())
    in_flight = 0  # System One requests being handled (touched by the event loop's thread only)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        if settings.inline_prepare_bytes > 0:
            scheduler.adopt_thread()  # this thread (the event loop's) prepares lone requests
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="Flide", version=__version__, lifespan=lifespan,
                  description="System One decisions, every round of requests as one flat forward pass.")
    app.state.engine, app.state.scheduler, app.state.metrics, app.state.model_name = engine, scheduler, metrics, name

    def prepare_and_submit(body: bytes, request_id: str, ticket):
        """In a pool thread: bytes -> checked dict -> PreparedRequest, queued for the next round from this thread
        (the model thread may start the round while the event loop is still waking up to this result)."""
        request, prepared = prepare(body, request_id)
        return request, prepared, scheduler.submit(ticket, prepared)

    def prepare(body: bytes, request_id: str):
        """In a pool thread: bytes -> checked dict -> PreparedRequest."""
        start = time.perf_counter()
        request = parse_body(body, (name,), settings.max_json_depth)
        try:
            prepared = scheduler.prepare(request)
        except RequestError as error:
            raise from_request_error(error, request) from None
        except Exception as error:  # a bug, not a bad request: say so, and log where
            logger.exception("request %s: preparing it failed", request_id)
            raise ApiError(500, [], f"internal error while preparing the request ({type(error).__name__}); request "
                                    f"id {request_id}.") from None
        metrics.prepare.observe(time.perf_counter() - start)
        return request, prepared

    async def answer(header, read_body, request_id: str, fields: dict) -> dict:
        """The answer payload of one request (`header(name)`: a request header or None; `read_body(limit)`: its body),
        or an ApiError."""
        content_type = header("content-type")
        if content_type is not None and not _is_json(content_type):
            raise ApiError(415, ["header", "content-type"], f"is {content_type[:100]!r}: send the request as JSON "
                                                            f"(Content-Type: application/json).")
        length = header("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            raise ApiError(413, ["body"], f"has {int(length)} bytes; the limit is {settings.max_body_bytes} "
                                          f"(`serve.max_body_bytes`).")
        ticket = scheduler.admit(request_id)
        if ticket is None:
            raise ApiError(503, [], f"the server is busy: {scheduler.waiting} requests wait for a round "
                                    f"(`serve.max_queue` {settings.max_queue}); retry after "
                                    f"{settings.retry_after_s} s.", headers={"Retry-After": str(settings.retry_after_s)})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.request_timeout_s
        request_json = None
        try:
            # the request log's phases (ms): body read; prepare (validate, render, tokenize, submit: inline, or the
            # pool's round trip); wait (queue + round + answers, until the event loop resumes this request)
            phase = time.perf_counter()
            body = await asyncio.wait_for(read_body(settings.max_body_bytes), deadline - loop.time())
            fields["read_ms"], phase = _ms_since(phase), time.perf_counter()
            if in_flight == 1 and len(body) <= settings.inline_prepare_bytes:
                # alone: no other request waits on the loop meanwhile, and the pool's round trip would cost two
                # thread wake-ups (`serve.inline_prepare_bytes`)
                fields["inline"] = True
                request_json, prepared, future = prepare_and_submit(body, request_id, ticket)
            else:
                request_json, prepared, future = await asyncio.wait_for(
                    loop.run_in_executor(scheduler.pool, prepare_and_submit, body, request_id, ticket),
                    deadline - loop.time())
            fields["prepare_ms"], phase = _ms_since(phase), time.perf_counter()
            fields["questions"] = len(prepared.questions)
            usage = engine.usage(prepared)
            fields["input_tokens"] = usage.input_tokens
            answers = await asyncio.wait_for(asyncio.wrap_future(future), deadline - loop.time())
            fields["wait_ms"] = _ms_since(phase)
        except ClientDisconnect:
            raise ApiError(499, ["body"], "the client closed the connection before sending the whole body.",
                           "client_closed") from None
        except asyncio.TimeoutError:
            ticket.future.cancel()  # a request still being prepared is then skipped when its round is taken
            raise ApiError(504, [], f"no answer within {settings.request_timeout_s:g} s "
                                    f"(`serve.request_timeout_s`).") from None
        except Overloaded as error:
            raise ApiError(503, [], str(error), headers={"Retry-After": str(settings.retry_after_s)}) from None
        except RequestError as error:
            raise from_request_error(error, request_json) from None
        except ApiError:
            raise
        except Exception as error:  # the model failed on this request alone (its round's others were answered)
            raise ApiError(500, [], f"the model failed on this request ({type(error).__name__}: "
                                    f"{str(error)[:300]}); request id {request_id}.") from None
        finally:
            scheduler.release(ticket)
        return {"model": name, "answers": answers, "usage": {"input_tokens": usage.input_tokens, "output_tokens": 0}}

    async def systemone_answer(header, read_body):
        """One POST /v1/systemone -> (status, JSON body bytes, headers, after): `after()` logs the request and counts
        it in the metrics, called once the answer is sent."""
        start = time.perf_counter()
        given = header("x-request-id") or ""
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        fields: dict = {"request_id": request_id}
        headers = {"X-Request-Id": request_id}
        nonlocal in_flight
        in_flight += 1
        try:
            payload, status = await answer(header, read_body, request_id, fields), 200
        except ApiError as error:
            status, payload = error.status, error.detail()
            headers.update(error.headers)
            fields["error"] = f"{'.'.join(map(str, error.loc))}: {error.msg}"[:300]
        except Exception:
            logger.exception("request %s: internal error", request_id)
            status, payload = 500, ApiError(500, [], f"internal error; request id {request_id}.").detail()
        finally:
            in_flight -= 1
        try:
            body = _json_bytes(payload)
        except ValueError:  # a NaN or infinity among the answers: a model fault, not the client's
            logger.error("request %s: answers that JSON cannot carry (NaN or infinity)", request_id)
            status, body = 500, _json_bytes(ApiError(500, [], f"the model produced a non-finite probability; "
                                                               f"request id {request_id}.").detail())
        seconds = time.perf_counter() - start
        fields["status"], fields["ms"] = status, round(seconds * 1e3, 2)

        def after() -> None:
            if status == 200:
                metrics.latency.observe(seconds)
            metrics.requests.labels(str(status)).inc()
            logger.info("request", extra={"fields": fields})

        return status, body, headers, after

    @app.post("/v1/systemone", response_model=schema.SystemOneResponse, responses=_ERRORS,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": schema.request_schemas()[0]}}}},
              summary="Answer a System One request")
    async def systemone(request: Request):
        """Every question of the request answered with a probability for each option; the request joins the next
        round of the model thread. (Served by `_SystemOneRoute` before FastAPI's router; the same answer here.)"""
        status, body, headers, after = await systemone_answer(
            request.headers.get, lambda limit: _read_body(request.stream(), limit))
        return Response(body, status_code=status, headers=headers, media_type="application/json",
                        background=BackgroundTask(after))

    app.add_middleware(_SystemOneRoute, answer=systemone_answer)

    @app.get("/health", response_model=schema.Health, responses={503: {"model": schema.Health}})
    async def health():
        """200 while the model thread runs; 503 once it has stopped."""
        ok = scheduler.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": name,
                             "queue_depth": scheduler.waiting}, status_code=200 if ok else 503)

    @app.get("/v1/models", response_model=schema.ModelList)
    async def models():
        """The served model (its name is what `model` of a request may say)."""
        limits = engine.config.limits
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "flide",
            "model_type": engine.model.config.model_type, "max_questions": limits.max_questions,
            "max_prompt_tokens": limits.max_prompt_tokens}]}

    @app.get("/metrics", response_class=Response)
    async def prometheus():
        """Prometheus metrics: requests by status, latencies, round sizes, queue depth, tokens computed."""
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(schema.request_schemas()[1])
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
    return app


class _SystemOneRoute:
    """Plain ASGI: POST /v1/systemone answered by `answer` (see the module docstring), anything else passed on."""

    def __init__(self, app, answer):
        self.app, self.answer = app, answer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/systemone" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]

        def header(name: str) -> str | None:
            key = name.encode("latin-1")
            for k, v in headers:
                if k.lower() == key:
                    return v.decode("latin-1")
            return None

        async def chunks():  # the body's chunks as ASGI delivers them (Starlette's `Request.stream` without a Request)
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        status, body, extra, after = await self.answer(header, lambda limit: _read_body(chunks(), limit))
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        raw += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in extra.items()]
        try:
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": body})
        finally:
            after()


def _json_bytes(payload) -> bytes:
    """As Starlette's JSONResponse renders (UTF-8, no NaN, compact)."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _read_body(stream, limit: int) -> bytes:
    """The body from its chunks (an async iterator), refused (413) as soon as it passes `limit` bytes, whatever
    Content-Length said."""
    chunks, size = [], 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise ApiError(413, ["body"], f"is over {limit} bytes (`serve.max_body_bytes`).")
        chunks.append(chunk)
    return b"".join(chunks)


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serves `app` with uvicorn until interrupted (its own access log off: the app logs each request)."""
    import importlib.util

    import uvicorn

    fast = {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools")}
    if not all(fast.values()):  # both are dependencies; a stripped install still serves, ~0.8 ms slower a request
        logger.warning("serving without %s: install them for ~0.8 ms less per request",
                       " and ".join(name for name, ok in fast.items() if not ok))
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                                  loop="uvloop" if fast["uvloop"] else "asyncio",
                                  http="httptools" if fast["httptools"] else "h11",
                                  timeout_graceful_shutdown=10)).run()
