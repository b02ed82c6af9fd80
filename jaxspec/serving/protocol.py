"""The OpenAI request bodies the server accepts, validated by pydantic, and OpenAI-style error bodies.

Fields follow OpenAI's completions and chat completions APIs; `top_k`, `min_p`, `ignore_eos`,
`stop_token_ids` and `speculative` are jaxspec's additions (send them with the openai client's `extra_body`).
Types are strict (a string is not a number) and every range is checked here, with an upper bound on every number
that float32 and the engine take, so the handler only sees valid values. Nothing is silently ignored: a field
this server does not know is refused (HTTP 400 naming it), as OpenAI's own server refuses unknown arguments,
and an OpenAI field it does not implement (`logit_bias`, `tools`, `suffix`, ...: `NOT_SUPPORTED`) is taken only
with a value that asks for nothing (null, or its no-op value such as `tool_choice: "none"`). `user` and
`metadata` are accepted as OpenAI defines them, labels for the caller that change no output. The raw body is
checked first: JSON only (no NaN or Infinity), and no string holding a lone UTF-16 surrogate, which no
tokenizer can encode.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..methods import names

SpecMethodName = Literal[names(served=True)]  # the methods an engine can serve; the engine says which it does


INT32_MAX = 2**31 - 1  # the bound of every count and token id: the engine keeps them as int32
MAX_STOP_STRINGS = 4  # OpenAI's limit
# The longest stop string, in characters. A stream holds back a tail that could still become a stop string (up to
# this many characters, delaying them) and scans that window per token; real stop strings are short markers
# ("\n\n", "```", "</answer>"), and 256 characters leaves room for any multi-line sentinel.
MAX_STOP_CHARS = 256
# repetition_penalty's upper end: a penalty of 100 already rules a repeated token out in practice, and multiplying
# any logit a model gives (far below 1e36 in size) by it stays finite in float32.
MAX_REPETITION_PENALTY = 100.0
# OpenAI fields this server does not implement, each with the values that ask for nothing beside null: a body
# may send them (clients fill in defaults, a chat turn is echoed back with `refusal: null`), anything else is
# refused with 400 naming the field rather than ignored. (Applied where the field sits: `_Body.NO_EFFECT`.)
NOT_SUPPORTED = {
    "logit_bias": ({},), "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "parallel_tool_calls": (), "audio": (), "modalities": (["text"],),
    "web_search_options": (), "reasoning_effort": (), "store": (False,), "service_tier": ("auto", "default"),
    "refusal": (), "tool_calls": ([],), "annotations": ([],),  # an assistant message's
}
_MESSAGE_FIELDS = frozenset({"refusal", "tool_calls", "function_call", "audio", "annotations"})


def _asks_nothing(name: str, value: Any) -> bool:
    """Whether `value` for the unimplemented field `name` is null or one of its no-op values (same type:
    0 is not false)."""
    return value is None or any(type(value) is type(v) and value == v for v in NOT_SUPPORTED[name])


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    NO_EFFECT: ClassVar[frozenset[str]] = frozenset()  # the `NOT_SUPPORTED` fields taken here when they ask nothing

    @model_validator(mode="before")
    @classmethod
    def _drop_no_effect(cls, data: Any) -> Any:
        """Drop the unimplemented fields that ask for nothing; any other value stays, to be refused by name."""
        if isinstance(data, dict) and any(k in cls.NO_EFFECT and _asks_nothing(k, v) for k, v in data.items()):
            return {k: v for k, v in data.items() if not (k in cls.NO_EFFECT and _asks_nothing(k, v))}
        return data


class SpeculativeOptions(_Body):
    """The `speculative` request field: a method the server was started with, and a draft budget."""

    method: SpecMethodName | None = None  # None: the server's default method
    num_speculative_tokens: int | None = Field(None, ge=0, le=INT32_MAX)  # None: the server's K; at most its K


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


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the engine checks it against the vocabulary


class _Generation(_Body):
    NO_EFFECT = frozenset(NOT_SUPPORTED) - {"refusal", "tool_calls", "annotations"}
    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # 0 or -1 disables (vLLM's convention); above the vocabulary: no limit
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI's range
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)  # vLLM's extension (extra_body)
    speculative: SpeculativeOptions | Literal["off"] | None = None
    prediction: Prediction | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # a label for the caller (OpenAI's); changes nothing
    metadata: dict[str, str] | None = Field(None, max_length=16)  # labels for the caller (OpenAI's); change nothing

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty stop strings of at most {MAX_STOP_CHARS} "
                             "characters each")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Generation):
    """The body of `POST /v1/completions` (the common fields are listed in the serving how-to)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]  # token ids: the engine checks the vocabulary
    # OpenAI's default for completions; 0 (the prompt alone, generating nothing) only with echo
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's range for completions
    echo: bool = False  # the choice's text (and logprobs) start with its prompt's
    # vLLM's extension: per prompt token its log-probability and rank, and the N most likely tokens there
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=16)  # taken only equal to n: each choice is its own best

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Most likely tokens to return per position, or None for no logprobs."""
        return self.logprobs

    @model_validator(mode="after")
    def _max_tokens_zero_needs_echo(self):
        """max_tokens 0 asks for the prompt alone, which only echo returns. Raised as a RequestError (which
        pydantic passes through) so the 400 names max_tokens: a check over two fields has no field of its own."""
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens: 0 generates nothing, which only echo=true asks for (it returns the "
                               "prompt alone); send max_tokens >= 1 (got 0)", param="max_tokens")
        return self

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info: ValidationInfo):
        if v is not None and v != info.data.get("n", 1):  # (`n` is declared, so validated, first)
            raise ValueError("best_of is supported only equal to n: this server does not rank candidates")
        return v


class ChatMessage(_Body):
    """One message of a chat request."""

    NO_EFFECT = _MESSAGE_FIELDS
    role: Literal["system", "developer", "user", "assistant"]  # who speaks
    content: str | list[TextPart]  # a string, or text parts joined in order
    name: str | None = None  # accepted and ignored

    def text(self) -> str:
        """The content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    """The body of `POST /v1/chat/completions` (the common fields are listed in the serving how-to)."""

    messages: list[ChatMessage] = Field(min_length=1)  # rendered with the model's chat template
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)  # OpenAI's newer name for max_tokens
    logprobs: bool = False  # return each generated token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's range for chat
    prompt_logprobs: int | None = None  # refused unless null: served on /v1/completions only

    @field_validator("prompt_logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, v):
        if v is not None:
            raise ValueError("prompt log-probabilities are served on /v1/completions only, not on chat")
        return v

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


MAX_MESSAGE_CHARS = 1000  # an error message's length at most: every error body stays small
MAX_PARAM_CHARS = 200  # a `param` path's (a client picks the names of unknown fields)


def clipped(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class RequestError(Exception):
    """A client error: HTTP `status` with an OpenAI-style body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        message = clipped(message, MAX_MESSAGE_CHARS)  # however much of the request a message quotes
        param = None if param is None else clipped(param, MAX_PARAM_CHARS)
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        """The JSON error body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_MAX_SHOWN = 200  # characters of an offending value quoted back in an error message


def _shown(value: Any) -> str:
    return clipped(repr(value), _MAX_SHOWN)


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
    unknown = first["type"] == "extra_forbidden"  # the last name is the client's own, whatever it looks like
    # Union members add their type's label to the path (`speculative.SpeculativeOptions.method`, `prompt.str`,
    # `prompt.list[int].0`): drop the labels, never a field (`stream`, `stream_options`).
    loc = [p for p in loc[:len(loc) - unknown] if not (p[:1].isupper() or p in _TYPE_LABELS
                                                         or p.startswith(_GENERIC_LABELS))] + loc[len(loc) - unknown:]
    param = ".".join(loc) or None
    what = f"{param}: " if param else ""
    if unknown:  # OpenAI refuses unknown arguments too
        why = ("is not supported by this server" if loc[-1] in NOT_SUPPORTED
               else "is not a field of this request (unrecognized request argument)")
        return RequestError(f"{what}{why} (got {_shown(first.get('input'))})", param=param)
    msg = first["msg"].removeprefix("Value error, ")  # a validator's own message says what is wrong
    return RequestError(f"{what}{msg} (got {_shown(first.get('input'))})", param=param)


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
