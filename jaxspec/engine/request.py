"""What the engine takes and gives back: a `Request` in, `Output` events out through its callback, a `Handle`
to cancel it, and the checks that decide whether a request can be served (`validate`)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..constraints import Choice, JsonSchema, Regex, TokenAutomaton, compile_constraint
from ..constraints.stack import used_size
from ..limits import check_prompt, stop_ids
from ..logprobs import TokenLogprob
from ..sampling_params import InvalidSetting, SamplingParams
from ..state import mean_acceptance_length
from .config import EngineConfig

MAX_STOP_IDS = 8  # stop-id slots per row, the model's EOS ids included: one table shape for every batch


class InvalidRequest(ValueError):
    """A request the engine cannot serve; `field` names the `Request` field at fault (the server maps it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field  # "prompt_ids", "max_tokens", "sampling.top_p", ...


class QueueFull(RuntimeError):
    """The engine's waiting queue is at `max_waiting`."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests."""


@dataclasses.dataclass
class Request:
    """One generation request as the engine takes it: token ids in, settings beside them."""

    prompt_ids: list[int]  # the prompt, tokenized (chat template applied by the caller)
    max_tokens: int  # the most new tokens
    sampling: SamplingParams = SamplingParams()  # scalars
    stop_token_ids: tuple[int, ...] = ()  # beside the model's EOS
    ignore_eos: bool = False  # keep generating past the model's EOS (stop_token_ids still stop)
    method: str | None = None  # None: the engine's default method
    num_speculative_tokens: int | None = None  # None: the engine's K
    logprobs: int | None = None  # also return each token's log-probability and this many most likely tokens
    # predicted outputs: token ids the output is expected to mostly repeat (at most config.max_prediction_len)
    prediction_ids: list[int] | None = None
    # structured output: a jaxspec.Regex, JsonSchema or Choice (compiled over the model's tokenizer), or a
    # compiled TokenAutomaton
    constraint: object | None = None


@dataclasses.dataclass(frozen=True)
class RequestStats:
    """Counts and timings of one request, on its final `Output`."""

    steps: int  # decode steps the request's row was active in
    drafted: int  # draft tokens scored by the target
    accepted: int  # accepted drafts that were emitted
    queued_s: float  # from submission to admission
    prefill_s: float  # seconds of the request's prefill
    committed: int = 0  # tokens the decode steps committed (its first token, from prefill, not counted)
    # with a prediction: its tokens drafted and accepted, drafted and rejected (OpenAI's usage fields)
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per step (`jaxspec.state.mean_acceptance_length`)."""
        return mean_acceptance_length(self.committed, self.steps)


@dataclasses.dataclass(frozen=True)
class Output:
    """What a request's row committed since the last event; `finish_reason` is set on its final event."""

    token_ids: list[int]  # the tokens committed since the previous event
    # one per token of token_ids: True for an accepted draft, False for a token the target produced (each
    # verification step commits a run of accepted drafts, then one token of the target's own)
    from_draft: list[bool] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked
    stats: RequestStats | None = None  # on the final event
    error: str | None = None  # what went wrong, with finish_reason "error"


class Handle:
    """A submitted request: `cancel()` frees its row within one chunk (no further events after the final one)."""

    def __init__(self, request_id: int, cancel: Callable[[int], None]):
        self.request_id = request_id  # the engine's id of the request
        self._cancel = cancel

    def cancel(self) -> None:
        """Stop the request if it has not finished: its callback gets a final event, finish_reason "cancelled"."""
        self._cancel(self.request_id)


@dataclasses.dataclass
class LiveRequest:
    """The engine's host-side record of one request, from submission to its final event."""

    request_id: int  # the engine's id (`Handle.request_id`)
    request: Request  # as submitted
    callback: Callable[[Output], None]  # called on the engine thread
    method: str  # the request's method, or the engine's default
    stop_ids: tuple[int, ...]  # EOS ids (unless ignored), then the request's own: at most MAX_STOP_IDS
    submitted: float  # perf_counter() at submission
    admitted: float = 0.0  # perf_counter() when its prefill finished
    prefill_s: float = 0.0  # seconds of its prefill
    emitted: int = 0  # generated tokens handed to the callback
    counters: tuple[int, int, int] = (0, 0, 0)  # its row's steps, drafted, accepted at the last read
    prediction: tuple[int, int] | None = None  # its accepted and rejected prediction tokens at the last read

    @property
    def queued_s(self) -> float:
        """Seconds from submission to admission (the prefill not counted)."""
        return max(self.admitted - self.submitted - self.prefill_s, 0.0)

    def stats(self) -> RequestStats:
        """The request's counts and timings so far."""
        steps, drafted, accepted = self.counters
        predicted = (None, None) if self.request.prediction_ids is None else (self.prediction or (0, 0))
        return RequestStats(steps=steps, drafted=drafted, accepted=accepted, queued_s=self.queued_s,
                            prefill_s=self.prefill_s, committed=max(self.emitted - 1, 0),
                            accepted_prediction_tokens=predicted[0], rejected_prediction_tokens=predicted[1])


def check_prediction(ids, config: EngineConfig, vocab_size: int) -> None:
    """Raise InvalidRequest("prediction_ids", ...) unless the engine serves predictions this long."""
    if ids is None:
        return
    if not config.max_prediction_len:
        raise InvalidRequest("prediction_ids", "predictions are not served (the engine was built with "
                             "max_prediction_len=0)")
    try:
        ids = check_prompt(ids, vocab_size)
    except ValueError as e:
        raise InvalidRequest("prediction_ids", str(e).replace("prompt", "prediction")) from None
    if len(ids) > config.max_prediction_len:
        raise InvalidRequest("prediction_ids", f"the prediction has {len(ids)} tokens; at most "
                             f"{config.max_prediction_len} are served")


def check_method(method: str, config: EngineConfig) -> None:
    """Raise InvalidRequest unless an engine of `config` was built with `method`."""
    if method not in config.methods:
        raise InvalidRequest("method", f"method={method!r} is not served; choose one of {config.methods}")


def check_sampling(sampling: SamplingParams) -> None:
    """The settings must stack into a row of the batch's arrays: the engine thread stacks every row each chunk,
    so a value that failed there would fail the whole batch."""
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequest("sampling", f"sampling={sampling!r} must be a jaxspec.SamplingParams")
    try:
        SamplingParams.stack([sampling])
    except InvalidSetting as e:
        raise InvalidRequest(f"sampling.{e.field}", str(e)) from None
    except ValueError as e:
        raise InvalidRequest("sampling", str(e)) from None


def compiled_constraint(constraint, config: EngineConfig, tokenizer, vocab_size: int):
    """The request's constraint as a TokenAutomaton (compiled once per spec and tokenizer, within
    config.constraint_limits), or None; raises InvalidRequest("constraint", ...) for one the engine cannot serve:
    beyond its limits, or needing more than the batch's constraint capacity alone."""
    if constraint is None:
        return None
    if not config.constraints:
        raise InvalidRequest("constraint", "constraints are not served (the engine was built with constraints=False)")
    if isinstance(constraint, TokenAutomaton):
        if constraint.vocab_size != vocab_size:
            raise InvalidRequest("constraint", f"the automaton has {constraint.vocab_size} tokens; the model "
                                 f"{vocab_size}")
        return _within_capacity(constraint, config)
    if not isinstance(constraint, (Regex, JsonSchema, Choice)):
        raise InvalidRequest("constraint", f"constraint={constraint!r} must be a Regex, JsonSchema, Choice or "
                             "TokenAutomaton")
    if tokenizer is None:
        raise InvalidRequest("constraint", "the model has no tokenizer to compile the constraint over")
    try:
        automaton = compile_constraint(constraint, tokenizer, vocab_size, config.constraint_limits)
    except ValueError as e:
        raise InvalidRequest("constraint", str(e)) from None
    return _within_capacity(automaton, config)


def fits(automata, config: EngineConfig) -> bool:
    """Whether the distinct automata of `automata` (None entries free) fit the batch's constraint capacity."""
    states, edges = used_size(automata)
    return states <= config.constraint_states and edges <= config.constraint_edges


def _within_capacity(automaton, config: EngineConfig):
    if not fits([automaton], config):
        raise InvalidRequest("constraint", f"the constraint's automaton has {automaton.num_states} states and "
                             f"{automaton.num_edges} edges; the engine's batch holds at most constraint_states="
                             f"{config.constraint_states} and constraint_edges={config.constraint_edges}")
    return automaton


def validate(request: Request, config: EngineConfig, *, vocab_size: int, eos_ids: tuple[int, ...],
             tokenizer=None) -> tuple[int, ...]:
    """The request's stop ids (`LiveRequest.stop_ids`), or InvalidRequest (a ValueError) naming the bad value
    and its field, which the server answers with HTTP 400."""
    try:
        prompt = check_prompt(request.prompt_ids, vocab_size)
    except ValueError as e:
        raise InvalidRequest("prompt_ids", str(e)) from None
    n = len(prompt)
    limit = config.max_context
    if n >= limit:
        raise InvalidRequest("prompt_ids", f"prompt has {n} tokens; the context holds {limit} (prompt + max_tokens)")
    if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise InvalidRequest("max_tokens", f"max_tokens={request.max_tokens!r} must be an integer >= 1")
    if n + request.max_tokens > limit:
        raise InvalidRequest("max_tokens", f"max_tokens={request.max_tokens} with a {n}-token prompt needs "
                             f"{n + request.max_tokens} tokens of context; the context holds {limit}")
    check_method(request.method or config.spec.method, config)
    check_sampling(request.sampling)
    top = request.logprobs
    if top is not None:
        most = config.max_logprobs
        if most is None:
            raise InvalidRequest("logprobs", "logprobs are not served (the engine was built with max_logprobs=None)")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= most:
            raise InvalidRequest("logprobs", f"logprobs={top!r} must be an integer in [0, {most}]")
    check_prediction(request.prediction_ids, config, vocab_size)
    compiled_constraint(request.constraint, config, tokenizer, vocab_size)
    k, most = request.num_speculative_tokens, config.num_speculative_tokens
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= most):
        raise InvalidRequest("num_speculative_tokens",
                             f"num_speculative_tokens={k!r} must be an integer in [0, {most}]")
    eos = () if request.ignore_eos else eos_ids
    try:
        stops = stop_ids(request.stop_token_ids, eos, vocab_size)
    except ValueError as e:
        raise InvalidRequest("stop_token_ids", str(e)) from None
    if len(stops) > MAX_STOP_IDS:
        raise InvalidRequest("stop_token_ids", f"stop_token_ids has {len(stops) - len(eos)} ids; at most "
                             f"{MAX_STOP_IDS - len(eos)} are allowed")
    return tuple(stops)
