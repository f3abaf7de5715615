"""Request bodies of the Anthropic-compatible endpoints (validated strictly; unknown fields ignored)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MediaBlock(_Body):
    """An image or document: this server takes text only, so it becomes a placeholder."""

    type: Literal["image", "document"]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | MediaBlock] | None = None
    is_error: bool | None = None


class UnsupportedBlock(_Body):
    type: Literal["search_result", "server_tool_use", "web_search_tool_result"]


Block = (TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | MediaBlock
         | UnsupportedBlock)


class Message(_Body):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's mid-conversation notes
    content: str | list[Block]


class ToolDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class CountTokensRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
