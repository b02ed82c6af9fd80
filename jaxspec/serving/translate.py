"""From an OpenAI request body to engine `Request`s: the model name checked, text tokenized, one engine request
per choice, each checked by the engine before anything is submitted.

Tokenizing much text, and rendering chat templates, runs in the app's own bounded thread pool (`executor`), so
it never stalls the streams the event loop is serving and never waits behind other work in asyncio's default
pool. A prediction's length is checked in characters before it is tokenized: text longer than the engine's
`max_prediction_len` tokens could hold (each token covers at most `max_token_chars` characters) is refused at
once. The sampling fields map one to one onto `SamplingParams` (a `top_k` of -1 means none, as 0 does); choice i of a
request with seed s samples with seed s + i, so n choices differ and a request repeats with its seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import secrets
import threading
from concurrent.futures import Executor

from ..constraints import JsonSchema, compile_constraint
from ..constraints.compiler import CompilerBusy
from ..constraints.limits import shown
from ..engine import Engine, InvalidRequest, Request
from ..sampling_params import InvalidSetting, SamplingParams
from .bodies import OFF_LOOP_BYTES
from .errors import invalid_request
from .protocol import ChatMessage, RequestError, ResponseFormat


class Translator:
    """Request bodies into token ids and engine requests, for one engine and the model name it is served as."""

    def __init__(self, engine: Engine, served_model_name: str, executor: Executor | None = None):
        self.engine = engine  # checks each request (`Engine.validate`)
        self.served_model_name = served_model_name  # the only `model` a body may name
        self.tokenizer = engine.lm.tokenizer  # the model's, chat template included
        self.executor = executor  # tokenization and chat templates off the event loop (None: asyncio's default)
        self._max_token_chars: int | None = None

    async def off_loop(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` in the executor."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def max_token_chars(self) -> int:
        """The most characters one token's text can hold: its vocabulary entry's length (a byte-level entry has a
        character per byte, and a byte is at most a character)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.tokenizer.backend.get_vocab()), default=1)
        return self._max_token_chars

    def check_model(self, name: str) -> None:
        """RequestError (400) unless `name` is the served model's."""
        if name != self.served_model_name:
            raise RequestError(f"model {name!r} does not exist; this server serves {self.served_model_name!r}",
                               param="model", code="model_not_found")

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except (ValueError, TypeError) as e:  # text the tokenizer cannot take is the client's error
            raise RequestError(f"{param}: {e}", param=param) from None

    async def encode_all(self, prompts: list, param: str) -> list[list[int]]:
        """Token ids of each prompt (text, or token ids as they are); much text is encoded in a worker thread."""
        def run() -> list[list[int]]:
            return [self._encode(p, param) if isinstance(p, str) else list(p) for p in prompts]

        chars = sum(len(p) for p in prompts if isinstance(p, str))
        return await self.off_loop(run) if chars > OFF_LOOP_BYTES // 4 else run()

    async def encode(self, text: str, param: str) -> list[int]:
        """Token ids of one text, at least one (RequestError naming `param` otherwise)."""
        ids = (await self.encode_all([text], param))[0]
        if not ids:
            raise RequestError(f"{param} is empty: at least one token is needed", param=param)
        return ids

    async def compile_response_format(self, body, request=None) -> None:
        """Compile the body's `response_format` constraint off the event loop, within the engine's
        `constraint_limits` (a new schema takes from milliseconds to its time budget; compiled ones are cached,
        so the engine's own check is then instant). The compile runs in its own thread, which waits on a worker
        process (`jaxspec.constraints.compiler`), so slow compiles never hold asyncio's thread pool. While it
        runs, `request` (the HTTP request) is watched: when its client goes away the compile is killed and
        CancelledError raised, so nothing is submitted. RequestError: 400 naming `response_format` for a
        constraint beyond the limits or invalid, 429 when too many compiles wait."""
        spec = response_constraint(body.response_format)
        if spec is None or not self.engine.config.constraints:
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        cancel = threading.Event()

        def settle(outcome: tuple) -> None:
            if not done.done():
                done.set_result(outcome)

        def run() -> None:
            try:
                compile_constraint(spec, self.tokenizer, self.engine.lm.config.vocab_size,
                                   self.engine.config.constraint_limits, cancel)
                outcome = (None,)
            except BaseException as e:  # noqa: BLE001 - handed to the event loop, which raises it
                outcome = (e,)
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(settle, outcome)

        threading.Thread(target=run, name="jaxspec-constraint", daemon=True).start()
        try:
            while not (await asyncio.wait({done}, timeout=_DISCONNECT_POLL_S))[0]:
                if request is not None and await request.is_disconnected():
                    raise asyncio.CancelledError("the client disconnected while its constraint compiled")
        except asyncio.CancelledError:
            cancel.set()
            raise
        error = done.result()[0]
        if isinstance(error, CompilerBusy):
            raise RequestError(f"response_format: {error}", param="response_format", status=429,
                               type="rate_limit_error", code="too_many_compiles")
        if isinstance(error, ValueError):
            param = "response_format.json_schema" if body.response_format.type == "json_schema" \
                else "response_format"
            raise RequestError(f"response_format: {shown(str(error), 500)}", param=param) from None
        if error is not None:
            raise error

    async def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of a chat rendered with the model's chat template, ready for the assistant's reply."""
        rendered = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in messages]
        try:
            text = await self.off_loop(self.tokenizer.apply_chat_template, rendered, add_generation_prompt=True)
        except ValueError as e:
            raise RequestError(f"messages: {e}", param="messages") from None
        return await self.encode(text, "messages")

    async def prediction_ids(self, body) -> list[int] | None:
        """The token ids of the body's `prediction` (None without one); text longer than the engine's
        `max_prediction_len` tokens can hold is refused (400) before any tokenizing."""
        if body.prediction is None:
            return None
        text = body.prediction.text()
        most = self.engine.config.max_prediction_len
        if most == 0:
            raise RequestError("prediction: predictions are not served by this server", param="prediction")
        if len(text) > most * (await self.off_loop(self.max_token_chars) if self._max_token_chars is None
                               else self._max_token_chars):
            raise RequestError(f"prediction: the text has {len(text)} characters, more than {most} tokens "
                               f"(this server's most) can hold", param="prediction")
        return (await self.encode_all([text], "prediction"))[0] or None

    async def engine_requests(self, body, prompt_ids: list[int], *, prompt_param: str, default_max: int | None,
                              logprobs_param: str) -> list[Request]:
        """The `body.n` engine requests for one prompt, checked by the engine (RequestError naming the body field
        otherwise). `default_max` is the endpoint's max_tokens when the body has none; None: up to the end of
        the context."""
        spec = body.speculative
        method = "none" if spec == "off" else (spec.method if spec else None)
        k = spec.num_speculative_tokens if spec not in (None, "off") else None
        seed = secrets.randbits(32) if body.seed is None else body.seed % (1 << 32)
        max_tokens = default_max if body.max_tokens is None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(self.engine.max_context - len(prompt_ids), 1)
        constraint = response_constraint(body.response_format)
        prediction = await self.prediction_ids(body)
        try:  # a setting float32 cannot hold (InvalidSetting) is the client's error too
            sampling = SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                                      min_p=body.min_p, seed=seed, presence_penalty=body.presence_penalty,
                                      frequency_penalty=body.frequency_penalty,
                                      repetition_penalty=body.repetition_penalty)
            first = Request(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling,
                            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                            method=method, num_speculative_tokens=k, logprobs=body.top_logprobs_wanted,
                            prediction_ids=prediction, constraint=constraint)
            self.engine.validate(first)  # the choices differ only in their seeds
        except InvalidSetting as e:
            raise RequestError(f"{e.field}: {e}", param=e.field) from None
        except InvalidRequest as e:
            raise invalid_request(e, prompt_param=prompt_param, logprobs_param=logprobs_param) from None
        return [first] + [dataclasses.replace(first, sampling=sampling.replace(seed=(seed + i) % (1 << 32)))
                          for i in range(1, body.n)]


_DISCONNECT_POLL_S = 0.5  # how often a compiling request's client is checked for

# `response_format: {"type": "json_object"}`: any JSON object (outlines-core's generic object; its automaton
# compiles once, in seconds, and is cached).
ANY_OBJECT = {"type": "object"}


def response_constraint(fmt: ResponseFormat | None) -> JsonSchema | None:
    """The constraint a `response_format` asks for (None: free text); RequestError naming the field."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JsonSchema(ANY_OBJECT)
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema")
    try:
        return JsonSchema(schema)
    except ValueError as e:  # the schema's JSON alone: its limits are checked when it compiles
        raise RequestError(f"response_format: {shown(str(e), 500)}", param="response_format.json_schema") from None
