"""Response bodies of the OpenAI-compatible routes: whole completions and chat completions,
their server-sent-event chunks, the model list, and `CompletionFormat` / `ChatFormat`, which
build every body of one response."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_serializer


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


FinishReason = Literal["stop", "length"] | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class Completion(BaseModel):
    """A whole completion, or (object the same, as OpenAI does) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _set_fields_only(self) -> dict[str, str]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str = Field(description="The base model id.")
    parent: str | None = Field(None, description="The base model, for an adapter.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---------------------------------------------------------------- bodies of one response


class _Format:
    """The bodies of one response: id, creation time and model are fixed per response."""

    def __init__(self, id: str, created: int, model: str) -> None:
        self.id, self.created, self.model = id, created, model

    def head(self) -> list[BaseModel]:
        """Events that open a stream."""
        return []

    def usage(self, usage: Usage) -> BaseModel:
        """The last event of a stream with `include_usage`: no choices, only usage."""
        return self._chunk([], usage)

    def _chunk(self, choices: list, usage: Usage | None = None) -> BaseModel:
        raise NotImplementedError


class CompletionFormat(_Format):
    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        ids = {"id": self.id, "created": self.created, "model": self.model}
        return Completion(**ids, choices=choices, usage=usage)

    def piece(self, text: str) -> BaseModel:
        return self._chunk([CompletionChoice(text=text, finish_reason=None)])

    def finish(self, reason: str) -> BaseModel:
        return self._chunk([CompletionChoice(text="", finish_reason=reason)])

    def whole(self, text: str, reason: str, usage: Usage) -> BaseModel:
        return self._chunk([CompletionChoice(text=text, finish_reason=reason)], usage)


class ChatFormat(_Format):
    """Streams open with the assistant's role; text comes as `delta.content`; the finish
    reason comes in an event with an empty delta."""

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        ids = {"id": self.id, "created": self.created, "model": self.model}
        return ChatCompletionChunk(**ids, choices=choices, usage=usage)

    def head(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(delta=Delta(role="assistant", content=""))])]

    def piece(self, text: str) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=Delta(content=text))])

    def finish(self, reason: str) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=Delta(), finish_reason=reason)])

    def whole(self, text: str, reason: str, usage: Usage) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)
        ids = {"id": self.id, "created": self.created, "model": self.model}
        return ChatCompletion(**ids, choices=[choice], usage=usage)


ResponseFormat = CompletionFormat | ChatFormat
