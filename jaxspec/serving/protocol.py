"""The OpenAI request bodies the server accepts, validated by pydantic, and OpenAI-style error bodies.

Fields follow OpenAI's completions and chat completions APIs; `top_k`, `min_p`, `ignore_eos`,
`stop_token_ids` and `speculative` are jaxspec's additions (send them with the openai client's `extra_body`).
Types are strict (a string is not a number) and every range is checked here, so the handler only sees valid
values; unknown fields are ignored, as OpenAI's own server does. The raw body is checked first: JSON only
(no NaN or Infinity), and no string holding a lone UTF-16 surrogate, which no tokenizer can encode.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ..methods import names

SpecMethodName = Literal[names(served=True)]  # the methods an engine can serve; the engine says which it does


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class SpeculativeOptions(_Body):
    """The `speculative` request field: a method the server was started with, and a draft budget."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: SpecMethodName | None = None  # None: the server's default method
    num_speculative_tokens: int | None = Field(None, ge=0)  # None: the server's K; at most the server's K


class StreamOptions(_Body):
    """The `stream_options` request field."""

    include_usage: bool = False  # end the stream with a chunk holding the token counts


class TextPart(_Body):
    """One text part of a chat message's content list (the only part type served)."""

    type: Literal["text"]  # always "text"
    text: str  # the part's text


class Prediction(_Body):
    """The `prediction` request field (OpenAI's Predicted Outputs): text the output is expected to mostly repeat."""

    type: Literal["content"]  # always "content"
    content: Union[str, list[TextPart]]  # the predicted text, or text parts joined

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Body):
    """The `response_format` request field: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    # {"name": ..., "schema": {...}, "strict": ..., "description": ...} with type "json_schema"
    json_schema: dict[str, Any] | None = None


class _Generation(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # 0 or -1 disables (vLLM's convention); above the vocabulary: no limit
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI's range
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # vLLM's extension (extra_body)
    speculative: SpeculativeOptions | Literal["off"] | None = None
    prediction: Prediction | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Generation):
    """The body of `POST /v1/completions` (the common fields are listed in the serving how-to)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's range for completions
    echo: bool = False  # refused: not supported

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Most likely tokens to return per position, or None for no logprobs."""
        return self.logprobs

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported by this server")
        return v


class ChatMessage(_Body):
    """One message of a chat request."""

    role: Literal["system", "developer", "user", "assistant"]  # who speaks
    content: str | list[TextPart]  # a string, or text parts joined in order
    name: str | None = None  # accepted and ignored

    def text(self) -> str:
        """The content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    """The body of `POST /v1/chat/completions` (the common fields are listed in the serving how-to)."""

    messages: list[ChatMessage] = Field(min_length=1)  # rendered with the model's chat template
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False  # return each generated token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's range for chat

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):  # (`logprobs` is declared, so validated, first)
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Most likely tokens to return per position, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class RequestError(Exception):
    """A client error: HTTP `status` with an OpenAI-style body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        """The JSON error body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_MAX_SHOWN = 200  # characters of an offending value quoted back in an error message


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else f"{text[:_MAX_SHOWN]}... ({len(text)} characters)"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate, or None.

    Iterative: a body may nest as deep as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            for key, value in item.items():
                child = f"{path}.{key}" if path else str(key)
                stack.append((child, key))
                stack.append((child, value))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(item))
    return None


def parse_json(body: bytes) -> Any:
    """The JSON value of a request body, or a RequestError: not JSON, NaN/Infinity, nested too deep, or a
    string with a lone surrogate (named by its path)."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise RequestError(f"the request body is not valid JSON: {e}", param=None) from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply", param=None) from None
    path = _lone_surrogate_path(data)
    if path is not None:
        raise RequestError(f"{path}: the text holds a lone UTF-16 surrogate, which is not valid Unicode",
                           param=path)
    return data


_TYPE_LABELS = {"str", "int", "float", "bool"}
_GENERIC_LABELS = ("list[", "dict[", "literal[", "function-")


def validation_error(err: ValidationError) -> RequestError:
    """The first pydantic error as a RequestError naming the field by its dotted path (`messages.0.role`)."""
    first = err.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"]]
    # Union members add their type's label to the path (`speculative.SpeculativeOptions.method`, `prompt.str`,
    # `prompt.list[int].0`): drop the labels, never a field (`stream`, `stream_options`).
    loc = [p for p in loc if not (p[:1].isupper() or p in _TYPE_LABELS or p.startswith(_GENERIC_LABELS))]
    param = ".".join(loc) or None
    what = f"{param}: " if param else ""
    return RequestError(f"{what}{first['msg']} (got {_shown(first.get('input'))})", param=param)


def parse(model: type[BaseModel], data: Any) -> Any:
    """A validated `model` from a decoded JSON body; RequestError (HTTP 400, naming the field) otherwise."""
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}", param=None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply", param=None) from None
