"""Request bodies of the OpenAI-compatible routes: `POST /v1/completions` and
`POST /v1/chat/completions`.

Requests accept what loraplex honours and refuse the rest with a message that says so: one
choice (n=1), one prompt per request, no logprobs, no echo, no penalties, no tools. `top_k`,
`ignore_eos` and `stop_token_ids` are extensions (as in vLLM). A JSON `null` means "the
default", as in OpenAI's API. Sampling fields are checked as the engine uses them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from loraplex.replica.protocol import SAMPLING_CHECKS

MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 1024

# A token id: an int (not a bool, a float or a string), below 2^31 — above any vocabulary,
# and within what the router's prefix keys pack (`array("q")`); the model's own vocabulary
# is checked by the engine's sampling checks at the ingress (400).
TokenId = Annotated[int, Field(strict=True, ge=0, lt=1 << 31)]
# The largest context window an engine accepts (EngineConfig.max_model_len's bound): no
# token-id prompt is longer. Checked before any id is, so a 4 MiB list of ids costs the
# event loop its length, not a pass over its items; the deployment's own window follows
# (context_length_exceeded).
MAX_PROMPT_TOKEN_IDS = 1 << 20


# OpenAI fields this server does not implement: accepted only when absent, null, or one of
# these values (which mean "off").
_UNSUPPORTED = ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs")
_UNSUPPORTED_COMPLETION = ("echo", "best_of", "suffix")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(
        False, description="Send a last chunk, with empty `choices`, that carries `usage`."
    )


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    # strict: `true` is not a seed or a temperature, "5" not a max_tokens (lax validation
    # read them as 1, 1.0 and 5)
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(
        min_length=1, max_length=256, description="The base model id, or one of your adapters."
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 samples greedily.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(
        -1, ge=-1, description="Extension: keep the k likeliest tokens; -1 or 0: all."
    )
    seed: int | None = Field(
        None, ge=-(2**63), le=2**64 - 1, description="Makes sampling reproducible."
    )
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} strings that end the output (not included)."
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=256, description="Extension: token ids that end the output."
    )
    ignore_eos: bool = Field(False, description="Extension: keep going past end-of-sequence.")
    n: int = Field(1, description="Number of choices; must be 1.", json_schema_extra={"const": 1})
    stream: bool = Field(False, description="Stream the output as server-sent events.")
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(
        0.0, description="Unsupported; only 0 is accepted.", json_schema_extra={"const": 0}
    )
    frequency_penalty: float = Field(
        0.0, description="Unsupported; only 0 is accepted.", json_schema_extra={"const": 0}
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Unsupported; only empty.", json_schema_extra={"maxProperties": 0}
    )
    user: str | None = Field(None, max_length=256, description="Accepted and ignored.")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator(*SAMPLING_CHECKS)
    @classmethod
    def _as_the_engine_uses_it(cls, value: Any, info: ValidationInfo) -> Any:
        return SAMPLING_CHECKS[info.field_name](value)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(
                f"n must be 1 (got {n}): this server returns one choice per request; "
                "send n requests with different seeds instead"
            )
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        longest = max((len(s.encode()) for s in strings), default=0)
        if longest > MAX_STOP_BYTES:
            raise ValueError(
                f"a stop string is {longest} bytes; at most {MAX_STOP_BYTES} (one of 245 kB held "
                "back every byte of the output until the end)"
            )
        return stop

    def stop_bytes(self) -> int:
        """The stop strings' bytes, counted in limits.max_prompt_bytes with the prompt."""
        strings = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return sum(len(s.encode()) for s in strings)

    _off_values: ClassVar[dict[str, tuple]] = {
        "presence_penalty": (0,),
        "frequency_penalty": (0,),
        "logit_bias": ({},),
    }

    @field_validator(*_UNSUPPORTED, *_UNSUPPORTED_COMPLETION, check_fields=False)
    @classmethod
    def _off(cls, value: Any, info: ValidationInfo) -> Any:
        accepted = cls._off_values[info.field_name]
        if value not in accepted:
            only = f" (only {json.dumps(accepted[0])})" if accepted else ""
            raise ValueError(f"{info.field_name} is not supported by this server{only}")
        return value

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_fields(self, max_tokens: int) -> dict:
        """SamplingParams fields (the `params` of a GenerateRequest)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(_GenerationRequest):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"model": "sql-helper", "prompt": "SELECT", "max_tokens": 32}]
        },
    )

    prompt: str | Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)] = Field(
        description="Text, or a list of token ids."
    )
    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    logprobs: int | None = Field(
        None, description="Unsupported (only null).", json_schema_extra={"const": None}
    )
    echo: bool = Field(
        False, description="Unsupported (only false).", json_schema_extra={"const": False}
    )
    best_of: int | None = Field(
        None, description="Unsupported (only 1).", json_schema_extra={"enum": [1, None]}
    )
    suffix: str | None = Field(
        None, description="Unsupported (only empty).", json_schema_extra={"enum": ["", None]}
    )

    _off_values: ClassVar[dict[str, tuple]] = _GenerationRequest._off_values | {
        "logprobs": (),
        "echo": (False,),
        "best_of": (1,),
        "suffix": ("",),
    }

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt(cls, prompt: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(prompt, str):
            return handler(prompt)
        if not isinstance(prompt, list):
            raise ValueError("prompt must be a string or a list of token ids")
        if not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt[0], str | list):
            raise ValueError(
                "batched prompts are not supported: send one prompt (a string or a list of "
                "token ids) per request"
            )
        if len(prompt) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(
                f"the prompt has {len(prompt)} token ids; no model here has a context window "
                f"of more than {MAX_PROMPT_TOKEN_IDS}"
            )
        try:
            return handler(prompt)
        except ValidationError as e:  # the first id refused (the text branch's error aside)
            index = next(err["loc"][-1] for err in e.errors() if err["loc"][:1] != ("str",))
            raise ValueError(
                f"prompt token ids must be integers in [0, 2^31): item {index} is "
                f"{repr(prompt[index])[:40]}"
            ) from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, description="Accepted and ignored.")

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            raise ValueError(
                'only text content parts ({"type": "text", "text": ...}) are supported'
            )
        return content

    def for_template(self) -> dict[str, str]:
        """{role, content} as chat templates expect; `developer` is OpenAI's newer `system`."""
        text = (
            self.content
            if isinstance(self.content, str)
            else "\n".join(p.text for p in self.content)
        )
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "model": "sql-helper",
                    "messages": [{"role": "user", "content": "List the tables."}],
                    "max_completion_tokens": 64,
                }
            ]
        },
    )

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate; default: the rest of the context."
    )
    max_tokens: int | None = Field(None, ge=1, description="Older name of max_completion_tokens.")
    logprobs: bool = Field(
        False, description="Unsupported (only false).", json_schema_extra={"const": False}
    )
    top_logprobs: int | None = Field(
        None, description="Unsupported (only null).", json_schema_extra={"const": None}
    )

    _off_values: ClassVar[dict[str, tuple]] = _GenerationRequest._off_values | {
        "logprobs": (False,),
        "top_logprobs": (),
    }

    @model_validator(mode="after")
    def _one_limit(self):
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
