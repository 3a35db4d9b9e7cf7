"""HTTP bodies -> System One requests, and every error as `{"detail": [{"loc", "msg", "type"}]}`.

What `Engine.prepare` checks (the request's fields, the questions, the model's labels, prompt length) it reports
itself as a `RequestError`; this module adds only what a server must check on top of it: bytes that are not UTF-8
JSON, NaN and Infinity, nesting deeper than `serve.max_json_depth`, unpaired surrogates (which JSON escapes can
carry but UTF-8 cannot), top-level keys the API does not have, and the model name.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..requests import RequestError

TOP_LEVEL_KEYS = ("model", "state", "questions", "assets")
_TYPES = {422: "value_error", 400: "unanswerable", 404: "model_not_found", 413: "too_large",
          415: "unsupported_media_type", 503: "overloaded", 504: "timeout", 500: "internal_error"}


class ApiError(Exception):
    """An error answer: HTTP status, where (`loc`, pydantic style: ["body", "questions", "team"]) and why."""

    def __init__(self, status: int, loc: list, msg: str, type_: str | None = None, headers: dict | None = None):
        super().__init__(msg)
        self.status, self.loc, self.msg = status, loc, msg
        self.type = type_ or _TYPES.get(status, "error")
        self.headers = headers or {}

    def detail(self) -> dict:
        return {"detail": [{"loc": self.loc, "msg": self.msg, "type": self.type}]}


def field_loc(field: str, request: Any = None) -> list:
    """A RequestError's dotted field -> a loc list. Question names may hold dots: the request's own names are
    matched first, longest first, so `questions.a.b.type` with a question "a.b" gives [.., "a.b", "type"]."""
    if field == "body":
        return ["body"]
    questions = request.get("questions") if isinstance(request, dict) else None
    if field.startswith("questions.") and isinstance(questions, dict):
        rest = field[len("questions."):]
        for name in sorted((q for q in questions if isinstance(q, str)), key=len, reverse=True):
            if rest == name or rest.startswith(name + "."):
                tail = rest[len(name) + 1:]
                return ["body", "questions", name, *(tail.split(".") if tail else [])]
    return ["body", *field.split(".")]


def from_request_error(error: RequestError, request: Any = None) -> ApiError:
    type_ = "missing" if "is missing" in error.message else None
    return ApiError(error.status, field_loc(error.field, request), error.message, type_)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(body: bytes) -> Any:
    """UTF-8 JSON -> a Python value; anything else is a 422 naming the body."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(422, ["body"], f"the request is not UTF-8 (byte {error.start}): send UTF-8 JSON.",
                       "json_invalid") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as error:
        raise ApiError(422, ["body"], f"the request is not valid JSON ({error.msg} at line {error.lineno} column "
                                      f"{error.colno}).", "json_invalid") from None
    except RecursionError:
        raise ApiError(422, ["body"], "the request nests arrays or objects too deeply.", "json_invalid") from None
    except ValueError as error:  # NaN / Infinity, integers of more than 4300 digits
        raise ApiError(422, ["body"], f"the request is not valid JSON ({str(error)[:120]}).", "json_invalid") from None


def check_value(value: Any, max_depth: int) -> None:
    """Walks a parsed request without recursion: nesting at most `max_depth` deep, no unpaired surrogates in strings
    or keys (they cannot be written back as UTF-8). Raises ApiError(422) with the loc of the first offender."""
    stack: list[tuple[Any, list]] = [(value, ["body"])]
    while stack:
        item, loc = stack.pop()
        if isinstance(item, str):
            _check_text(item, loc)
        elif isinstance(item, (dict, list)):
            if len(loc) > max_depth:
                raise ApiError(422, loc[:max_depth + 1], f"nests arrays or objects more than {max_depth} levels deep "
                                                         f"(`serve.max_json_depth`).")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, loc + [key])
                    if isinstance(child, (str, dict, list)):
                        stack.append((child, loc + [key]))
            else:
                stack.extend((child, loc + [i]) for i, child in enumerate(item) if isinstance(child, (str, dict, list)))


def _check_text(text: str, loc: list) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = [part if isinstance(part, int) else part.encode("utf-8", "backslashreplace").decode() for part in loc]
        raise ApiError(422, where, f"holds an unpaired surrogate (\\u{ord(text[error.start]):04x} at character "
                                   f"{error.start}), which is not text.", "string_unicode") from None


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way a surrogate reaches a parsed string, since the
# body is decoded from UTF-8 first, which refuses encoded surrogates
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def needs_check(body: bytes, max_depth: int) -> bool:
    """Whether `check_value` could find anything in the parsed body: a surrogate escape in its bytes, or more
    opening brackets than `max_depth` (counting those inside strings too: an upper bound of the nesting). Most
    requests have neither, and the walk over every string of a long request cost ~0.2 ms of a server's request."""
    return body.count(b"{") + body.count(b"[") > max_depth or _SURROGATE_ESCAPE.search(body) is not None


def parse_body(body: bytes, model_names: tuple[str, ...], max_depth: int) -> dict:
    """Bytes -> a request dict that `Engine.prepare` can take (which then validates its fields)."""
    request = parse_json(body)
    if needs_check(body, max_depth):
        check_value(request, max_depth)
    if not isinstance(request, dict):  # the engine's own words for it
        raise from_request_error(RequestError("body", f'a request is an object {{"state": ..., "questions": {{...}}}}, '
                                                      f"got {type(request).__name__}."))
    unknown = [key for key in request if key not in TOP_LEVEL_KEYS]
    if unknown:
        raise ApiError(422, ["body", unknown[0]], f"is not a field of a System One request (fields: "
                                                  f"{', '.join(TOP_LEVEL_KEYS)}).", "extra_forbidden")
    model = request.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise ApiError(422, ["body", "model"], f"must be a string, got {type(model).__name__}.", "string_type")
        if model not in model_names:
            raise ApiError(404, ["body", "model"], f"the model {model[:200]!r} is not served here; this server "
                                                   f"serves {', '.join(map(repr, model_names))} (GET /v1/models).")
    return request
