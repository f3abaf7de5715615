"""Request bodies of the OpenAI Responses endpoint, ``/v1/responses`` (validated strictly;
unknown fields ignored)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag

from hearth.serving.openai_requests import JSONSchemaFormat

# OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512 (stored and echoed whole).
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(
    max_length=512)]], Field(max_length=16)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Body):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: str


class MediaPart(_Body):
    """An image, file or audio input: this server takes text only, so it becomes a placeholder."""

    type: Literal["input_image", "input_file", "input_audio"]


def _part_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "part-refusal" if kind == "refusal" else "part-media" if kind in MEDIA_PARTS else "part-text"


MEDIA_PARTS = ("input_image", "input_file", "input_audio")
Part = Annotated[
    Annotated[TextPart, Tag("part-text")] | Annotated[RefusalPart, Tag("part-refusal")]
    | Annotated[MediaPart, Tag("part-media")],
    Discriminator(_part_type),  # tags with '-' stay out of error field names
]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return f"item-{kind}"  # a tag with '-' is left out of error field names (see errors.field_name)


InputItem = Annotated[
    Annotated[MessageItem, Tag("item-message")] | Annotated[FunctionCallItem, Tag("item-function_call")]
    | Annotated[FunctionCallOutputItem, Tag("item-function_call_output")]
    | Annotated[ReasoningItem, Tag("item-reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_json_schema(self) -> JSONSchemaFormat:
        return JSONSchemaFormat(name=self.name, schema=self.schema_, strict=self.strict)


class TextOptions(_Body):
    format: TextFormat | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None  # function and namespace tools are read; see responses_api
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: bool = False
    store: bool = True
    metadata: Metadata | None = None
    user: str | None = Field(default=None, max_length=512)
