"""Pydantic models of the System One API, for the OpenAPI schema (/openapi.json, /docs).

They document the wire format; they do not validate requests. Requests are validated by Flide's own code
(`flide.serve.body` and `Engine.prepare`, which raises `RequestError` naming the field), so the server's errors are
the engine's errors, word for word.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

Content = Union[str, dict[str, Any], list[Any]]


class ChoiceQuestion(BaseModel):
    """Pick one option: `criteria` maps each option to a description or null."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["choice"]
    instructions: Content | None = None
    criteria: dict[str, Content | None] = Field(min_length=1)


class ScoreQuestion(BaseModel):
    """A level on an ordered scale: `criteria` lists the levels, lowest first."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["score"]
    instructions: Content | None = None
    criteria: list[Content] = Field(min_length=1)


class NoulQuestion(BaseModel):
    """Yes or no (the answer is P(yes)); optional `criteria` describe what true and false mean."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["noul"]
    instructions: Content | None = None
    criteria: dict[Literal["true", "false"], Content | None] | None = None


Question = Annotated[Union[ChoiceQuestion, ScoreQuestion, NoulQuestion], Field(discriminator="type")]


class SystemOneRequest(BaseModel):
    """A System One request: a state and typed questions about it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="The served model's name (GET /v1/models); optional.")
    state: Any = Field(description="What the questions are about: a string, or any JSON object or array.")
    questions: dict[str, Question] = Field(min_length=1, max_length=64,
                                           description="Question name -> question; answered in this order.")
    assets: dict[str, dict[str, Any]] | None = Field(None, description="Images; this server's text models refuse "
                                                                         "them (400).")


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str
    probabilities: dict[str, float]
    confidence: float


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float
    legend: dict[str, Any]
    probabilities: dict[str, float]
    confidence: float


class NoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(description="P(yes)")


Answer = Annotated[Union[ChoiceAnswer, ScoreAnswer, NoulAnswer], Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int = Field(description="Tokens of the request, each state counted once.")
    output_tokens: int = 0


class SystemOneResponse(BaseModel):
    model: str
    answers: dict[str, Answer]
    usage: Usage


class ErrorItem(BaseModel):
    loc: list[str | int] = Field(description='Where: ["body", "questions", "team", "criteria"]')
    msg: str
    type: str


class ErrorResponse(BaseModel):
    """Every error of /v1/systemone: the offending field and why (422, 400, 404, 413, 415, 503, 504)."""

    detail: list[ErrorItem]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flide"
    model_type: str
    max_questions: int
    max_prompt_tokens: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    model: str
    queue_depth: int


def request_schemas() -> tuple[dict, dict]:
    """The request body's JSON schema as a `$ref` into components, and the component schemas it needs (for
    `openapi_extra`: the endpoint reads its body itself)."""
    _, schema = models_json_schema([(SystemOneRequest, "validation")], ref_template="#/components/schemas/{model}")
    return {"$ref": "#/components/schemas/SystemOneRequest"}, schema.get("$defs", {})
