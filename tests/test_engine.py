"""The serving engine on the tiny random model: continuous batching must not change what a request gets.

Greedy and seeded requests streamed through the engine (mixed methods, draft budgets and sampling settings in
one batch, more requests than slots, rows joining and leaving between chunks, requests prefilled together) must
equal offline `jaxspec.generate` token for token; stops, token budgets, cancellation, a full queue, validation
and shutdown are checked at the request level. Offline references decode plainly: greedy and seeded speculative output
equals plain output (tests/test_speculative.py).

Every engine here uses one configuration (4 slots, buckets 1, 2 and 4, K = 4), so the compiled programs are
shared.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.engine import Engine, EngineConfig, EngineStopped, InvalidRequest, Output, QueueFull, Request
from jaxspec.policy import DraftPolicy

TIMEOUT_S = 300  # the first request of the module waits for the compiles
K = 4
CONFIG = EngineConfig(max_slots=4, cache_len=128, chunk_steps=4, slot_buckets=(1, 2, 4),
                      spec=SpecConfig(method="sam", num_speculative_tokens=K, min_match=2))
N = 32  # offline reference length; shorter requests compare against its prefix

# Short repeated patterns (<= 16 tokens: one prefill bucket), so the lookup proposers find matches.
PROMPTS = [[5, 6, 7, 8] * 3, [10, 11, 12] * 4, [3, 1, 4, 1, 5, 9] * 2, [20, 21] * 7, [30, 31, 32, 33, 34] * 3,
           [40, 41, 42] * 5, [2, 7, 1, 8, 2, 8] * 2, [50, 60] * 6, [9, 9, 8, 8] * 4, [70, 71, 72, 73] * 2]


class Collector:
    """An Output callback: gathers a request's events and checks the stream's shape as it arrives."""

    def __init__(self, block_at: int | None = None):
        self.outputs: list[Output] = []
        self.done = threading.Event()
        self.errors: list[str] = []
        self._event = threading.Event()
        # block_at=i: the engine thread waits in the i-th event's callback until `release()` (or 60 s).
        self._block_at = block_at
        self._released = threading.Event()

    def __call__(self, out: Output) -> None:
        if self.done.is_set():
            self.errors.append(f"event after the final one: {out}")
        elif out.finish_reason is None and not out.token_ids:
            self.errors.append("an empty non-final event")
        self.outputs.append(out)
        self._event.set()
        if out.finish_reason is not None:
            self.done.set()
        elif self._block_at is not None and len(self.outputs) == self._block_at + 1:
            self._released.wait(60)

    def wait_events(self, n: int, timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while len(self.outputs) < n and not self.done.is_set():
            self._event.wait(max(0.0, deadline - time.monotonic()))
            self._event.clear()
            assert time.monotonic() < deadline, f"no event {n} within {timeout} s"

    def release(self) -> None:
        self._released.set()

    def wait(self, timeout: float = TIMEOUT_S) -> "Collector":
        assert self.done.wait(timeout), f"the request did not finish within {timeout} s"
        assert not self.errors, self.errors
        return self

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def final(self) -> Output:
        assert self.done.is_set()
        return self.outputs[-1]


def run_all(engine: Engine, requests: list[Request]) -> list[Collector]:
    """Submit every request at once, then wait for all of them."""
    collectors = [Collector() for _ in requests]
    for req, c in zip(requests, collectors):
        engine.submit(req, c)
    return [c.wait() for c in collectors]


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


_offline_cache: dict = {}


def offline(lm, prompt: list[int], sampling: SamplingParams = SamplingParams(), n: int = N) -> list[int]:
    """`jaxspec.generate` of one prompt alone (cached)."""
    key = (tuple(prompt), sampling, n)
    if key not in _offline_cache:
        _offline_cache[key] = jaxspec.generate(lm, [prompt], max_new_tokens=n, sampling=sampling).token_ids[0]
    return _offline_cache[key]


def device_rows_done(engine: Engine) -> bool:
    """Whether every row of the device batch is finished (read while the engine idles: no chunk donates it)."""
    return bool(np.asarray(jax.device_get(engine.runner.state.done)).all())


def _shutdown(engine: Engine) -> None:
    engine.shutdown(drain=False, timeout=60)
    assert not engine.is_alive(), "the engine thread did not stop"
    assert engine.failed is None, f"the engine loop failed: {engine.failed!r}"


@pytest.fixture(scope="module")
def chunk_log():
    return []


@pytest.fixture(scope="module")
def fixed_engine(tiny_lm, chunk_log):
    def observe(kind, info):
        if kind == "chunk":
            chunk_log.append(info)

    engine = Engine(tiny_lm, CONFIG, policy=DraftPolicy("fixed"), observers=[observe]).start(warmup=False)
    yield engine
    _shutdown(engine)


@pytest.fixture(scope="module")
def off_engine(tiny_lm):
    engine = Engine(tiny_lm, CONFIG, policy=DraftPolicy("off")).start(warmup=False)
    yield engine
    _shutdown(engine)


@pytest.fixture(scope="module")
def adaptive_engine(tiny_lm):
    engine = Engine(tiny_lm, CONFIG, policy=DraftPolicy()).start(warmup=False)
    yield engine
    _shutdown(engine)


@pytest.fixture(scope="module")
def idle_engine(tiny_lm):
    """Never started: validation needs no thread."""
    engine = Engine(tiny_lm, CONFIG)
    yield engine
    _shutdown(engine)


@pytest.fixture
def fresh_engine(tiny_lm):
    """A new engine of the shared configuration, not started (tests start it when they need to)."""
    engines = []

    def make(config: EngineConfig = CONFIG, policy=None, observers=()) -> Engine:
        engines.append(Engine(tiny_lm, config, policy=policy or DraftPolicy("fixed"), observers=observers))
        return engines[-1]

    yield make
    for engine in engines:
        _shutdown(engine)


def _mixed_requests(prompts, max_tokens=N):
    """Methods none/ngram/sam and budgets 0..4 (None: the engine's K) in one batch."""
    methods = ["none", "ngram", "sam"]
    budgets = [0, 1, 2, 3, 4, None]
    return [Request(p, max_tokens, method=methods[i % 3], num_speculative_tokens=budgets[i % 6])
            for i, p in enumerate(prompts)]


# ---------------------------------------------------------------------- exactness


@pytest.mark.parametrize("engine_name", ["fixed_engine", "off_engine", "adaptive_engine"])
def test_greedy_mixed_methods_and_budgets_equal_offline(tiny_lm, request, engine_name):
    engine: Engine = request.getfixturevalue(engine_name)
    prompts = PROMPTS[:6]
    requests = _mixed_requests(prompts)
    drafted0, accepted0 = engine.metrics.drafted, engine.metrics.accepted
    results = run_all(engine, requests)
    for i, (req, c) in enumerate(zip(requests, results)):
        assert c.tokens == offline(tiny_lm, req.prompt_ids), \
            f"request {i} ({req.method}, K={req.num_speculative_tokens})"
        assert c.final.finish_reason == "length"
        stats = c.final.stats
        # A row never drafts more than its own budget per step, and a plain row drafts nothing.
        budget = 0 if req.method == "none" else (
            K if req.num_speculative_tokens is None else req.num_speculative_tokens)
        assert 0 <= stats.accepted <= stats.drafted <= budget * stats.steps
        assert stats.steps <= N - 1  # the first token comes from the prefill
    drafted, accepted = engine.metrics.drafted - drafted0, engine.metrics.accepted - accepted0
    if engine_name == "fixed_engine":
        assert drafted > 0 and accepted > 0
        assert sum(c.final.stats.drafted for c in results) == drafted
    if engine_name == "off_engine":
        assert drafted == 0
        assert not engine.metrics.speculating
        assert engine.runner.widths == (1,)  # no row ever drafts: one target forward per chunk program
    else:
        assert engine.runner.widths == CONFIG.verify_widths
    # The gauges are updated on the engine thread right after the final callbacks.
    assert wait_until(lambda: engine.num_active == 0 and engine.metrics.requests_running == 0
                      and engine.metrics.requests_waiting == 0)


@pytest.mark.parametrize("source", ["static", "both"])
def test_sam_drafts_from_a_static_corpus_in_the_engine(tiny_lm, fresh_engine, source):
    """The engine passes a static suffix automaton to its sam rows: the corpus holds the prompts' own greedy
    texts, so with the static source alone every draft comes from it, and outputs still equal offline."""
    prompts = PROMPTS[4:7]
    corpus = jaxspec.StaticSuffixAutomaton.build([p + offline(tiny_lm, p) for p in prompts], separator=0)
    spec = dataclasses.replace(CONFIG.spec, sam_source=source, static_sam=corpus)
    engine = fresh_engine(dataclasses.replace(CONFIG, spec=spec)).start(warmup=False)
    results = run_all(engine, [Request(p, N, method="sam") for p in prompts])
    for i, (p, c) in enumerate(zip(prompts, results)):
        assert c.tokens == offline(tiny_lm, p), f"request {i}"
        assert c.final.stats.drafted > 0 and c.final.stats.accepted > 0, (i, c.final.stats)
    if source == "static":  # the whole text is in the corpus: every drafted token is accepted
        assert all(c.final.stats.accepted == c.final.stats.drafted for c in results)


def test_seeded_sampling_equals_offline(tiny_lm, fixed_engine):
    samplings = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=0.8, top_k=5, seed=12),
                 SamplingParams(temperature=0.8, top_p=0.9, seed=13), SamplingParams(),
                 SamplingParams(temperature=0.8, top_k=20, top_p=0.8, min_p=0.02, seed=14),
                 SamplingParams(temperature=0.8, seed=11)]  # the same seed as the first, another prompt
    prompts = PROMPTS[:5] + [PROMPTS[7]]
    methods = ["sam", "ngram", "none", "sam", "sam", "ngram"]
    requests = [Request(p, N, sampling=s, method=m) for p, s, m in zip(prompts, samplings, methods)]
    results = run_all(fixed_engine, requests)
    for i, (req, c) in enumerate(zip(requests, results)):
        assert c.tokens == offline(tiny_lm, req.prompt_ids, req.sampling), f"request {i} ({req.sampling})"
    # The seed, not the batch, decides: the same request again gives the same tokens.
    again = run_all(fixed_engine, requests[:1])[0]
    assert again.tokens == results[0].tokens


def test_logprobs_stream_with_their_tokens(tiny_lm, fixed_engine):
    """Rows that ask for log-probabilities get one per streamed token, equal to offline `generate`'s; rows
    beside them that do not ask get none."""
    prompts = PROMPTS[:4]
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams(), SamplingParams()]
    tops = [2, 0, None, 3]
    requests = [Request(p, N, sampling=s, method=m, logprobs=t)
                for p, s, m, t in zip(prompts, samplings, ["sam", "ngram", "sam", "none"], tops)]
    results = run_all(fixed_engine, requests)
    for req, c in zip(requests, results):
        ref = jaxspec.generate(tiny_lm, [req.prompt_ids], max_new_tokens=N, sampling=req.sampling, logprobs=3)
        assert c.tokens == ref.token_ids[0]
        if req.logprobs is None:
            assert all(o.logprobs is None for o in c.outputs)
            continue
        assert all(len(o.logprobs) == len(o.token_ids) for o in c.outputs)
        got = [e for o in c.outputs for e in o.logprobs]
        assert [e.token_id for e in got] == c.tokens
        np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in ref.logprobs[0]], atol=2e-5)
        assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top[:req.logprobs]] for e in ref.logprobs[0]]


HEAD_SPECS = [dict(method="medusa", num_speculative_tokens=7),
              dict(method="eagle2", num_speculative_tokens=9, tree_depth=4, tree_top_k=3),
              dict(method="eagle", num_speculative_tokens=K),
              dict(method="eagle3", num_speculative_tokens=9, tree_depth=4, tree_top_k=3),
              dict(method="dflash", num_speculative_tokens=7)]


@pytest.mark.parametrize("spec_kwargs", HEAD_SPECS, ids=lambda d: d["method"])
def test_a_trained_head_is_served_beside_none(tiny_lm, head_files, fresh_engine, spec_kwargs):
    """A head (its tree, or its chain sampled from q) runs alone in the MixedProposer, beside plain rows and
    rows with smaller budgets; greedy rows and, for the deterministic trees, seeded rows equal offline."""
    kind = spec_kwargs["method"] if spec_kwargs["method"] in ("medusa", "eagle3", "dflash") else "eagle"
    spec = SpecConfig(head_path=str(head_files[kind]), **spec_kwargs)
    engine = fresh_engine(dataclasses.replace(CONFIG, spec=spec, methods=("none", spec.method))).start(warmup=False)
    seeded = SamplingParams(temperature=0.8, seed=21)
    requests = [Request(PROMPTS[0], N), Request(PROMPTS[1], N, method="none"),
                Request(PROMPTS[2], N, num_speculative_tokens=2), Request(PROMPTS[3], N, sampling=seeded),
                Request(PROMPTS[4], N, logprobs=1)]
    results = run_all(engine, requests)
    for i, (req, c) in enumerate(zip(requests, results)):
        if req.sampling == seeded and spec.method in ("eagle", "dflash"):
            assert len(c.tokens) == N  # drafts sampled from q: the same distribution, not the same tokens
            continue
        assert c.tokens == offline(tiny_lm, req.prompt_ids, req.sampling), f"request {i}"
    assert results[1].final.stats.drafted == 0
    assert results[0].final.stats.drafted > 0
    assert results[2].final.stats.drafted <= 2 * results[2].final.stats.steps
    assert len([e for o in results[4].outputs for e in o.logprobs]) == N


def test_a_head_is_not_mixed_with_other_proposers(tiny_lm):
    with pytest.raises(ValueError, match="served alone"):
        EngineConfig(spec=SpecConfig(method="medusa"), methods=("ngram", "medusa"))


def test_more_requests_than_slots(tiny_lm, fixed_engine, chunk_log):
    """10 requests on 4 slots, of different lengths: rows join and leave between chunks and the state grows
    and shrinks between the buckets, without changing any output."""
    chunk_log.clear()
    prompts = PROMPTS[:10]
    # The last request (plain: 4 tokens a chunk) outlives the others by chunks, so the state shrinks to 1 row.
    requests = [dataclasses.replace(r, max_tokens=6 + 2 * i if i < 9 else N)
                for i, r in enumerate(_mixed_requests(prompts))]
    assert requests[-1].method == "none"
    results = run_all(fixed_engine, requests)
    for i, (req, c) in enumerate(zip(requests, results)):
        assert c.tokens == offline(tiny_lm, req.prompt_ids)[: req.max_tokens], f"request {i}"
        assert c.final.finish_reason == "length"
    slots = {info["slots"] for info in chunk_log}
    assert {1, 4} <= slots, slots  # regrouped up to 4 rows, and back down to 1 for the last request
    assert max(info["active"] for info in chunk_log) == 4
    assert all(info["active"] <= info["slots"] for info in chunk_log)
    assert wait_until(lambda: len(fixed_engine.occupancy()) == 1)
    assert wait_until(lambda: fixed_engine.num_active == 0 and fixed_engine.metrics.requests_waiting == 0)


def test_regroup_moves_live_rows(tiny_lm, fresh_engine):
    """Deterministic regroups of several live rows: queued before the start and admitted one at a time
    (max_prefill_batch=1), three requests grow the state 1 -> 2 -> 4 rows (keeping 1, then 2 rows); when the
    short first one ends, the state shrinks to 2 rows keeping rows 1 and 2 (moved to 0 and 1) mid-generation.
    Outputs must not notice."""
    chunks = []
    engine = fresh_engine(dataclasses.replace(CONFIG, max_prefill_batch=1),
                          observers=[lambda kind, info: chunks.append(info) if kind == "chunk" else None])
    requests = [Request(PROMPTS[0], 6, method="none"), Request(PROMPTS[1], 40, method="sam"),
                Request(PROMPTS[3], 40, method="ngram", num_speculative_tokens=2)]
    collectors = [Collector() for _ in requests]
    for req, c in zip(requests, collectors):
        engine.submit(req, c)
    engine.start(warmup=False)
    for req, c in zip(requests, collectors):
        assert c.wait().tokens == offline(tiny_lm, req.prompt_ids, n=req.max_tokens)
    slots = [info["slots"] for info in chunks]
    assert slots[0] == 4 and 2 in slots, slots
    assert [info["active"] for info in chunks if info["slots"] == 4][0] == 3


def test_context_limit_request_equals_offline(tiny_lm, fixed_engine):
    """A request that fills the context exactly (prompt + max_tokens = max_context), beside drafting rows."""
    prompt = PROMPTS[1]
    n = CONFIG.max_context - len(prompt)
    fixed_engine.validate(Request(prompt, n))
    requests = [Request(prompt, n), Request(PROMPTS[0], N, method="sam"), Request(PROMPTS[3], N, method="ngram")]
    results = run_all(fixed_engine, requests)
    assert results[0].tokens == offline(tiny_lm, prompt, n=n)
    assert len(results[0].tokens) == n and results[0].final.finish_reason == "length"
    for req, c in zip(requests[1:], results[1:]):
        assert c.tokens == offline(tiny_lm, req.prompt_ids)


# ---------------------------------------------------------------------- batched prefill

# 40 tokens (the 64-token prompt bucket) and 27 (the 32-token one): prefilled beside PROMPTS, they pad them.
LONG_PROMPTS = [[13, 14, 15, 16, 17] * 8, PROMPTS[5] + PROMPTS[6]]


def _burst() -> list[Request]:
    """Mixed prompt buckets, greedy and seeded rows, rows with and without log-probabilities, methods none,
    ngram and sam with their budgets; on 4 slots, the first four are admitted together, then requests 4 and 5
    together when the two 12-token ones end, then the others as slots free."""
    seeded = [SamplingParams(temperature=0.8, seed=31), SamplingParams(temperature=0.8, top_k=5, seed=32),
              SamplingParams(temperature=0.8, top_p=0.9, seed=33)]
    return [Request(PROMPTS[0], N, method="sam"),
            Request(LONG_PROMPTS[0], 12, sampling=seeded[0], method="ngram", logprobs=2),
            Request(PROMPTS[2], 12, method="none", logprobs=0),
            Request(PROMPTS[3], N, sampling=seeded[1], method="sam"),
            Request(PROMPTS[9], N, method="ngram", num_speculative_tokens=2),
            Request(LONG_PROMPTS[1], N, method="sam", logprobs=3),
            Request(PROMPTS[7], 16, sampling=seeded[2], method="none"),
            Request(PROMPTS[8], N, method="sam", num_speculative_tokens=1)]


def _run_queued(engine: Engine, requests: list[Request]) -> list[Collector]:
    """Queue every request before the loop starts (its first visit sees them all), then run them."""
    collectors = [Collector() for _ in requests]
    for req, c in zip(requests, collectors):
        engine.submit(req, c)
    engine.start(warmup=False)
    return [c.wait() for c in collectors]


def test_a_burst_prefilled_in_batches_equals_one_at_a_time_and_offline(tiny_lm, fresh_engine):
    """Requests arriving together are prefilled together (prompts padded to the longest one's bucket, the batch
    to a compiled size): every request gets the tokens, draft flags, counts and log-probabilities it gets when
    admitted one at a time (max_prefill_batch=1), and the tokens of `jaxspec.generate` alone."""
    requests = _burst()
    admits: dict[int, list[int]] = {1: [], 8: []}
    results = {}
    for most in (8, 1):
        def observe(kind, info, most=most):
            if kind == "admit":
                admits[most].append(info["prefill_batch"])

        engine = fresh_engine(dataclasses.replace(CONFIG, max_prefill_batch=most), observers=[observe])
        results[most] = _run_queued(engine, requests)
        # Each admission event names the size of its prefill: calls = events / size summed.
        assert engine.metrics.prefills == round(sum(1 / b for b in admits[most]))
        assert engine.metrics.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
        assert engine.metrics.generated_tokens == sum(r.max_tokens for r in requests)
    # The batched engine admitted the first four together (its slots), then two together.
    assert admits[8][:6] == [4] * 4 + [2] * 2, admits[8]
    assert round(sum(1 / b for b in admits[8])) < len(requests), "every request was prefilled alone"
    assert admits[1] == [1] * len(requests)
    for i, (req, batched, alone) in enumerate(zip(requests, results[8], results[1])):
        assert batched.tokens == alone.tokens == offline(tiny_lm, req.prompt_ids, req.sampling)[: req.max_tokens], i
        assert [o.token_ids for o in batched.outputs] == [o.token_ids for o in alone.outputs], i
        assert [f for o in batched.outputs for f in o.from_draft] == [f for o in alone.outputs for f in o.from_draft]
        a, b = batched.final.stats, alone.final.stats
        assert (a.steps, a.drafted, a.accepted, a.committed) == (b.steps, b.drafted, b.accepted, b.committed), i
        assert batched.final.finish_reason == "length"
        if req.method == "none":
            assert a.drafted == 0
        elif req.sampling.temperature == 0:  # the random model's greedy text repeats itself: lookups find it
            assert a.accepted > 0, f"request {i} ({req.method}): drafted {a.drafted}, accepted {a.accepted}"
        if req.logprobs is None:
            assert all(o.logprobs is None for o in batched.outputs)
            continue
        got, want = ([e for o in c.outputs for e in o.logprobs] for c in (batched, alone))
        ref = jaxspec.generate(tiny_lm, [req.prompt_ids], max_new_tokens=req.max_tokens, sampling=req.sampling,
                               logprobs=3).logprobs[0]
        assert [e.token_id for e in got] == [e.token_id for e in want] == batched.tokens
        assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top] for e in want]
        assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top[:req.logprobs]] for e in ref]
        np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=2e-5)
        np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in ref], atol=2e-5)


def test_max_prefill_batch_is_validated():
    with pytest.raises(ValueError, match="max_prefill_batch=0"):
        EngineConfig(max_prefill_batch=0)
    with pytest.raises(ValueError, match="max_prefill_batch=-2"):
        EngineConfig(max_prefill_batch=-2)
    # Powers of two below min(max_prefill_batch, max_slots), and that bound itself.
    assert EngineConfig(max_prefill_batch=8).prefill_batch_sizes == (1, 2, 4, 8)
    assert EngineConfig(max_prefill_batch=1).prefill_batch_sizes == (1,)
    assert EngineConfig().max_prefill_batch == 1  # on CPU batched prefill measured slower (docs/BENCHMARKS.md)
    assert EngineConfig(max_prefill_batch=6).prefill_batch_sizes == (1, 2, 4, 6)
    assert EngineConfig(max_slots=4, max_prefill_batch=16).prefill_batch_sizes == (1, 2, 4)


def _run_together(engine: Engine, requests: list[Request]) -> list[Collector]:
    """Submit `requests` while the engine thread waits in the final event of a one-token request (admitted
    alone), so that its next look at the queue finds them all; then wait for them."""
    held, gate = threading.Event(), threading.Event()

    def hold(out: Output) -> None:
        held.set()
        gate.wait(60)

    engine.submit(Request(PROMPTS[0], 1), hold)
    assert held.wait(TIMEOUT_S)
    collectors = [Collector() for _ in requests]
    for req, c in zip(requests, collectors):
        engine.submit(req, c)
    gate.set()
    return [c.wait() for c in collectors]


_PROGRAMS = re.compile(r"Compiling jit\((prefill|insert_rows|insert|decode_chunk)\)")


def test_warmup_compiles_every_batched_prefill(tiny_lm, fresh_engine, caplog):
    """After `warmup`, bursts of 1 to 4 requests of every prompt bucket, into an empty batch or beside a
    running row, compile no prefill, row write or decode program."""
    prompts = [PROMPTS[0], LONG_PROMPTS[1], LONG_PROMPTS[0], [3, 4, 5] * 30]  # buckets 16, 32, 64 and 128
    bursts = [[Request(p, 6 + 4 * i, method=["sam", "none", "ngram"][i % 3], logprobs=[None, 2][i % 2])
               for i, p in enumerate(prompts[:count])] for count in (1, 2, 3, 4)]  # prefill sizes 1, 2, 4, 4
    late = [Request(p, 5) for p in prompts[1:]]
    first = Request(PROMPTS[1], N, method="none")  # running when the `late` ones join it
    want = {id(r): offline(tiny_lm, r.prompt_ids)[: r.max_tokens] for r in [first, *late, *sum(bursts, [])]}
    admits = []
    engine = fresh_engine(dataclasses.replace(CONFIG, slot_buckets=(1, 4), max_prefill_batch=4),
                          observers=[lambda kind, info: admits.append(info["prefill_batch"]) if kind == "admit" else 0])
    engine.start(warmup=True)
    assert engine.ready.wait(TIMEOUT_S) and engine.failed is None
    assert engine.wait_compiled(TIMEOUT_S)  # the speculative chunks and longer prefills, compiled on a thread
    assert engine.runner.speculating == (1, 4)
    with caplog.at_level(logging.DEBUG, logger="jax._src.interpreters.pxla"):
        for requests in bursts:
            for req, c in zip(requests, _run_together(engine, requests)):
                assert c.tokens == want[id(req)]
        running = Collector(block_at=1)  # the engine thread waits in its second event until the others queue
        engine.submit(first, running)
        running.wait_events(2)
        collectors = [Collector() for _ in late]
        for req, c in zip(late, collectors):
            engine.submit(req, c)
        running.release()
        for req, c in zip(late, collectors):
            assert c.wait().tokens == want[id(req)]
        assert running.wait().tokens == want[id(first)]
    assert admits == [1, 1] + [1, 2, 2] + [1, 3, 3, 3] + [1, 4, 4, 4, 4] + [1, 3, 3, 3]  # each burst behind a holder
    compiled = [r.getMessage()[:80] for r in caplog.records if _PROGRAMS.search(r.getMessage())]
    assert not compiled, compiled


def test_warmup_serves_plainly_while_speculation_compiles(tiny_lm, fresh_engine, monkeypatch):
    """By default warm-up compiles the smallest bucket's chunk at verify width 1 and serves at once; the larger
    buckets and the speculative chunks compile on a thread. Requests served before they are ready run one at a
    time (the batch never grows past the one bucket compiled) and decode plainly (nothing scored as a draft);
    served after, they share the larger bucket and speculate; all give the offline greedy tokens."""
    from jaxspec.engine.runner import Runner

    gate = threading.Event()
    compile_ahead = Runner._compile_ahead
    monkeypatch.setattr(Runner, "_compile_ahead", lambda self, work: gate.wait(TIMEOUT_S) and compile_ahead(
        self, work))
    buckets = []  # the slot bucket in use at each admission
    engine = fresh_engine(dataclasses.replace(CONFIG, slot_buckets=(1, 4)), observers=[
        lambda kind, info: buckets.append(len(engine.occupancy())) if kind == "admit" else None])
    engine.start(warmup=True)
    assert engine.ready.wait(TIMEOUT_S) and engine.failed is None
    assert engine.runner.speculating == () and not engine.wait_compiled(0.1)
    assert engine.runner.largest_bucket == 1
    requests = [Request(p, N, method="sam") for p in PROMPTS[:3]]
    before = run_all(engine, requests)
    for req, c in zip(requests, before):
        assert c.tokens == offline(tiny_lm, req.prompt_ids)[:N]
        assert c.final.stats.drafted == 0 and c.final.stats.steps > 0
    assert buckets == [1, 1, 1], buckets
    gate.set()
    assert engine.wait_compiled(TIMEOUT_S) and engine.runner.speculating == (1, 4)
    assert engine.runner.largest_bucket == 4
    buckets.clear()
    after = run_all(engine, requests)
    for b, a in zip(before, after):
        assert a.tokens == b.tokens
        assert a.final.stats.drafted > 0 and a.final.stats.accepted > 0
        assert a.final.stats.steps < b.final.stats.steps
    assert max(buckets) == 4, buckets  # three requests at once: the batch grew to the bucket compiled for it


def test_warmup_without_background_compiles_speculation_first(tiny_lm, fresh_engine):
    engine = fresh_engine(dataclasses.replace(CONFIG, slot_buckets=(1, 4), background_compile=False))
    engine.start(warmup=True)
    assert engine.ready.wait(TIMEOUT_S) and engine.failed is None
    assert engine.runner.speculating == (1, 4) and engine.wait_compiled(0)
    c = run_all(engine, [Request(PROMPTS[0], N, method="sam")])[0]
    assert c.tokens == offline(tiny_lm, PROMPTS[0])[:N]
    assert c.final.stats.drafted > 0 and c.final.stats.accepted > 0


# ---------------------------------------------------------------------- stops and budgets


@pytest.mark.parametrize("method", ["sam", "none"])
def test_finish_length_after_exactly_max_tokens(tiny_lm, fixed_engine, method):
    for max_tokens in (2, 7, 13):
        c = run_all(fixed_engine, [Request(PROMPTS[0], max_tokens, method=method)])[0]
        assert c.tokens == offline(tiny_lm, PROMPTS[0])[:max_tokens]
        assert c.final.finish_reason == "length"


@pytest.mark.parametrize("method", ["sam", "ngram", "none"])
def test_finish_stop_on_a_stop_token(tiny_lm, fixed_engine, method):
    for prompt in (PROMPTS[0], PROMPTS[2], PROMPTS[6]):
        ref = offline(tiny_lm, prompt)
        stop = ref[2]  # the 3rd token: it is produced
        unused = next(t for t in range(96, 0, -1) if t not in ref)  # a second stop id that never comes
        c = run_all(fixed_engine, [Request(prompt, N, method=method, stop_token_ids=(unused, stop))])[0]
        expected = ref[: ref.index(stop) + 1]
        assert c.tokens == expected
        assert c.final.finish_reason == "stop"
        assert c.tokens[-1] == stop and stop not in c.tokens[:-1]


def test_stop_at_the_first_token(tiny_lm, fixed_engine):
    ref = offline(tiny_lm, PROMPTS[4])
    c = run_all(fixed_engine, [Request(PROMPTS[4], N, stop_token_ids=(ref[0],))])[0]
    assert c.tokens == ref[:1] and c.final.finish_reason == "stop"
    assert len(c.outputs) == 1  # finished at admission: one event
    assert wait_until(lambda: fixed_engine.num_active == 0)


def test_max_tokens_1_finishes_at_admission(tiny_lm, fixed_engine):
    results = run_all(fixed_engine, [Request(p, 1, method="sam") for p in PROMPTS[:3]])
    for p, c in zip(PROMPTS[:3], results):
        assert c.tokens == offline(tiny_lm, p)[:1]
        assert c.final.finish_reason == "length"
        assert len(c.outputs) == 1 and c.final.stats.steps == 0
    assert wait_until(lambda: fixed_engine.num_active == 0)


# ---------------------------------------------------------------------- cancellation


def test_cancellation_frees_the_row(tiny_lm, fixed_engine):
    """20 requests cancelled in flight, each after its 1st, 2nd or 3rd event: every one ends "cancelled"
    with a prefix of its offline output, no row leaks, and the engine still serves correctly."""
    for i in range(20):
        prompt = PROMPTS[i % len(PROMPTS)]
        # The engine thread waits inside the chosen event's callback until the cancel is in: deterministic.
        c = Collector(block_at=i % 3)
        handle = fixed_engine.submit(Request(prompt, 100, method=["sam", "ngram", "none"][i % 3]), c)
        c.wait_events(i % 3 + 1)
        handle.cancel()
        c.release()
        c.wait()
        assert c.final.finish_reason == "cancelled", i
        assert c.final.token_ids == []
        assert 1 <= len(c.tokens) < 100
        assert c.tokens == offline(tiny_lm, prompt, n=100)[: len(c.tokens)], i
        assert wait_until(lambda: fixed_engine.num_active == 0), f"a slot leaked after cancellation {i}"
        # The cancelled row stops on the device too (else it would keep decoding, and widening steps, unseen).
        assert wait_until(lambda: device_rows_done(fixed_engine)), f"row {i} still decodes after its cancellation"
        handle.cancel()  # cancelling a finished request is harmless
    assert wait_until(lambda: fixed_engine.metrics.requests_running == 0 and fixed_engine.metrics.requests_waiting == 0)
    c = run_all(fixed_engine, [Request(PROMPTS[1], N, method="sam")])[0]
    assert c.tokens == offline(tiny_lm, PROMPTS[1]) and c.final.finish_reason == "length"


def test_cancel_a_waiting_request(tiny_lm, fresh_engine):
    engine = fresh_engine()  # not started: requests wait
    cancelled, kept = Collector(), Collector()
    engine.submit(Request(PROMPTS[0], N), cancelled).cancel()
    engine.submit(Request(PROMPTS[2], N), kept)
    engine.start(warmup=False)
    cancelled.wait()
    assert cancelled.final.finish_reason == "cancelled" and cancelled.tokens == []
    assert kept.wait().tokens == offline(tiny_lm, PROMPTS[2])


def test_a_failing_callback_does_not_stop_the_others(tiny_lm):
    engine = Engine(tiny_lm, CONFIG, policy=DraftPolicy("fixed"))

    def failing(out: Output) -> None:
        raise RuntimeError("this client went away")

    good = Collector()
    engine.submit(Request(PROMPTS[0], N), good)
    engine.submit(Request(PROMPTS[1], N), failing)
    engine.start(warmup=False)
    try:
        good.wait()
        assert good.final.finish_reason == "length" and good.tokens == offline(tiny_lm, PROMPTS[0])
        assert engine.failed is None
    finally:
        engine.shutdown(drain=False, timeout=60)


# ---------------------------------------------------------------------- queue, validation, shutdown


@pytest.mark.parametrize("max_waiting", [0, 1])
def test_queue_full(tiny_lm, fresh_engine, max_waiting):
    engine = fresh_engine(dataclasses.replace(CONFIG, max_waiting=max_waiting))
    accepted = CONFIG.max_slots + max_waiting  # the free slots' requests, then the queue
    first = [Collector() for _ in range(accepted)]
    for i, c in enumerate(first):
        engine.submit(Request(PROMPTS[i], N), c)  # not started: they wait
    with pytest.raises(QueueFull, match=f"max_waiting={max_waiting}"):
        engine.submit(Request(PROMPTS[accepted], N), Collector())
    assert engine.metrics.requests_waiting == accepted
    engine.start(warmup=False)
    for i, c in enumerate(first):
        assert c.wait().tokens == offline(tiny_lm, PROMPTS[i])
    # Once the queue drained the engine takes requests again.
    assert run_all(engine, [Request(PROMPTS[accepted], N)])[0].tokens == offline(tiny_lm, PROMPTS[accepted])


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_ids=[]), "prompt is empty"),
    (dict(prompt_ids=[1, 97, 3]), "token id 97"),
    (dict(prompt_ids=[1, -1]), "token id -1"),
    (dict(prompt_ids=[1] * CONFIG.max_context), f"prompt has {CONFIG.max_context} tokens"),
    (dict(max_tokens=0), "max_tokens=0"),
    (dict(max_tokens=2.0), "max_tokens=2.0"),
    (dict(max_tokens=CONFIG.max_context - 9), f"max_tokens={CONFIG.max_context - 9}"),
    (dict(method="draft_model"), "method='draft_model'"),
    (dict(method="bogus"), "method='bogus'"),
    (dict(num_speculative_tokens=K + 1), f"num_speculative_tokens={K + 1}"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens=-1"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens=True"),
    (dict(stop_token_ids=(97,)), "id 97"),
    (dict(stop_token_ids=tuple(range(9))), "stop_token_ids has 9 ids"),
    (dict(logprobs=CONFIG.max_logprobs + 1), f"logprobs={CONFIG.max_logprobs + 1}"),
    (dict(logprobs=-1), "logprobs=-1"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_validate_names_the_bad_value(idle_engine, kwargs, match):
    engine = idle_engine
    req = Request(**{**dict(prompt_ids=[1] * 10, max_tokens=8), **kwargs})
    with pytest.raises(InvalidRequest, match=match) as error:
        engine.validate(req)
    assert error.value.field == next(iter(kwargs))  # the field at fault, for the server's 400
    with pytest.raises(ValueError, match=match):
        engine.submit(req, Collector())
    assert engine.metrics.requests_waiting == 0 and engine.num_waiting == 0
    # The limits themselves are allowed.
    engine.validate(Request([1] * 10, CONFIG.max_context - 10, num_speculative_tokens=K,
                            stop_token_ids=tuple(range(8))))
    engine.validate(Request([96], 1, num_speculative_tokens=0, method="none"))


def test_unserved_method_is_refused(tiny_lm):
    config = dataclasses.replace(CONFIG, methods=("none", "sam"))
    engine = Engine(tiny_lm, config)
    with pytest.raises(ValueError, match="method='ngram' is not served"):
        engine.validate(Request([1, 2, 3], 4, method="ngram"))
    engine.validate(Request([1, 2, 3], 4, method="none"))


def test_shutdown_without_drain_cancels_in_flight_and_waiting(tiny_lm, fresh_engine):
    engine = fresh_engine().start(warmup=False)
    running = Collector(block_at=0)
    engine.submit(Request(PROMPTS[0], 100), running)
    running.wait_events(1)  # admitted; the engine thread waits in the callback
    waiting = Collector()
    engine.submit(Request(PROMPTS[1], N), waiting)
    engine.shutdown(drain=False, timeout=0)
    running.release()
    engine.shutdown(drain=False, timeout=60)
    assert engine.started and not engine.is_alive()
    for c in (running.wait(1), waiting.wait(1)):
        assert c.final.finish_reason == "cancelled"
    assert 1 <= len(running.tokens) < 100
    assert running.tokens == offline(tiny_lm, PROMPTS[0], n=100)[: len(running.tokens)]
    assert waiting.tokens == []
    with pytest.raises(EngineStopped):
        engine.submit(Request(PROMPTS[0], 4), Collector())


@pytest.mark.parametrize("drain", [True, False])
def test_shutdown_of_a_never_started_engine_cancels_its_queue(fresh_engine, drain):
    engine = fresh_engine()
    waiting = [Collector() for _ in range(2)]
    for i, c in enumerate(waiting):
        engine.submit(Request(PROMPTS[i], N), c)
    engine.shutdown(drain=drain, timeout=1)  # nothing would ever decode them: their clients must hear so
    for c in waiting:
        assert c.wait(1).final.finish_reason == "cancelled" and c.tokens == []
    with pytest.raises(EngineStopped):
        engine.submit(Request(PROMPTS[0], 4), Collector())


def test_shutdown_with_drain_finishes_in_flight_requests(tiny_lm, fresh_engine):
    engine = fresh_engine()
    collectors = [Collector() for _ in range(6)]  # more than the slots: some still wait at shutdown
    for i, c in enumerate(collectors):
        engine.submit(Request(PROMPTS[i], 10), c)
    engine.start(warmup=False)
    engine.shutdown(drain=True, timeout=TIMEOUT_S)
    assert engine.started and not engine.is_alive()
    for i, c in enumerate(collectors):
        c.wait(1)
        assert c.final.finish_reason == "length" and c.tokens == offline(tiny_lm, PROMPTS[i])[:10]
    with pytest.raises(EngineStopped):
        engine.submit(Request(PROMPTS[0], 4), Collector())


# ---------------------------------------------------------------------- predicted outputs


def test_predicted_outputs_in_a_mixed_batch_equal_offline(tiny_lm, fresh_engine):
    """Rows with a prediction (exact, edited, unrelated) beside rows without one, mixed methods and a sampled
    row: every output equals offline decoding, and the prediction counts reach the final stats."""
    config = dataclasses.replace(CONFIG, cache_len=192, max_prediction_len=64)
    engine = fresh_engine(config).start(warmup=False)
    assert engine.runner.loop_k == 32 and 33 in config.verify_widths
    reference = [offline(tiny_lm, p) for p in PROMPTS[:5]]
    edited = list(reference[1])
    edited[12] = (edited[12] + 1) % 97
    sampled = SamplingParams(temperature=0.8, seed=21)
    requests = [Request(PROMPTS[0], N, prediction_ids=list(reference[0]), method="none"),
                Request(PROMPTS[1], N, prediction_ids=edited, method="sam"),
                Request(PROMPTS[2], N, prediction_ids=list(reference[4]), method="ngram"),  # unrelated
                Request(PROMPTS[3], N, method="sam"),
                Request(PROMPTS[4], N, sampling=sampled, prediction_ids=offline(tiny_lm, PROMPTS[4], sampled))]
    results = run_all(engine, requests)
    for req, c in zip(requests, results):
        assert c.tokens == offline(tiny_lm, req.prompt_ids, req.sampling)
    stats = [c.final.stats for c in results]
    assert stats[0].accepted_prediction_tokens == N - 1 - stats[0].steps and stats[0].rejected_prediction_tokens == 0
    assert stats[1].accepted_prediction_tokens > 0 and stats[1].rejected_prediction_tokens > 0
    assert stats[3].accepted_prediction_tokens is None
    assert stats[4].accepted_prediction_tokens > N // 2
    with pytest.raises(InvalidRequest, match="at most 64"):
        engine.submit(Request(PROMPTS[0], 4, prediction_ids=[1] * 65), Collector())
    with pytest.raises(InvalidRequest, match="max_prediction_len=0"):
        fresh_engine().submit(Request(PROMPTS[0], 4, prediction_ids=[1, 2]), Collector())


# ---------------------------------------------------------------------- constraints


def test_constrained_rows_beside_free_ones_equal_offline(tiny_lm, fresh_engine):
    """Rows under two different automata join a batch one after the other (the batch's automata are restacked
    and live rows' states moved), beside free rows: every output equals offline constrained decoding."""
    from test_constrained import parity_automaton

    parity = parity_automaton()
    odd_first = parity_automaton()  # another automaton object: the batch stacks both
    engine = fresh_engine(dataclasses.replace(CONFIG, chunk_steps=2)).start(warmup=False)
    first = [Collector() for _ in range(2)]
    engine.submit(Request(PROMPTS[0], N, constraint=parity, method="sam"), first[0])
    engine.submit(Request(PROMPTS[1], N, method="ngram"), first[1])
    first[0].wait_events(2)  # live and decoding before the next automaton arrives
    later = [Request(PROMPTS[2], N, constraint=odd_first, method="none"),
             Request(PROMPTS[3], N, constraint=parity, sampling=SamplingParams(temperature=0.8, seed=4))]
    results = [c.wait() for c in first] + run_all(engine, later)
    requests = [Request(PROMPTS[0], N, constraint=parity), Request(PROMPTS[1], N)] + later
    for req, c in zip(requests, results):
        want = jaxspec.generate(tiny_lm, [req.prompt_ids], max_new_tokens=N, sampling=req.sampling,
                                constraint=req.constraint, spec=SpecConfig(forced_tokens=0)).token_ids[0]
        assert c.tokens == want
    assert all(t % 2 == i % 2 for i, t in enumerate(results[0].tokens))
    with pytest.raises(InvalidRequest, match="constraint="):
        engine.submit(Request(PROMPTS[0], 4, constraint="json"), Collector())


def forcing_automaton(vocab: int = 97):
    """Tokens 5, then any even one, then 7, then any even one, ...: every other token is forced."""
    from jaxspec.constraints import TokenAutomaton

    words = -(-vocab // 32)
    allowed = np.zeros((4, words * 32), bool)
    allowed[0, 5] = allowed[2, 7] = True
    allowed[1, 0:vocab:2] = allowed[3, 0:vocab:2] = True
    packed = (allowed.reshape(4, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    edges = sorted((s * vocab + t, (s + 1) % 4) for s in range(4) for t in np.flatnonzero(allowed[s, :vocab]))
    return TokenAutomaton(allowed=jnp.asarray(packed.astype(np.uint32)),
                          keys=jnp.asarray([k for k, _ in edges], jnp.int32),
                          next=jnp.asarray([n for _, n in edges], jnp.int32), final=jnp.zeros((4,), bool),
                          forced=jnp.asarray([5, -1, 7, -1], jnp.int32), jump=jnp.full((4,), -1, jnp.int32),
                          vocab_size=vocab)


@pytest.mark.contract
def test_new_automata_keep_the_batch_shape_and_compile_nothing(fresh_engine, caplog):
    """The batch's stacked automata are padded to the engine's constraint capacity, free or not: automata of
    new sizes join the batch without compiling a prefill or decode program."""
    from contracts import programs_compiled
    from test_constrained import parity_automaton

    engine = fresh_engine(dataclasses.replace(CONFIG, constraint_states=8, constraint_edges=256)).start(warmup=False)
    run_all(engine, [Request(PROMPTS[0], 8)])  # compiles the programs once, over the free stack
    shape = engine.runner.state.constraint.automaton.value.allowed.shape
    for constraint in (parity_automaton(), forcing_automaton(), parity_automaton()):  # 2, 4, 2 states
        assert programs_compiled(caplog, lambda c=constraint: run_all(engine, [Request(PROMPTS[1], 8, constraint=c)]),
                                 {"prefill", "decode_chunk"}) == {}
        stacked = engine.runner.state.constraint.automaton.value
        assert (stacked.num_states, stacked.num_edges) == (8, 256) and stacked.allowed.shape == shape


def test_an_automaton_beyond_the_capacity_is_refused_naming_it(fresh_engine):
    from test_constrained import parity_automaton

    engine = fresh_engine(dataclasses.replace(CONFIG, constraint_states=1))
    with pytest.raises(InvalidRequest, match="constraint_states=1") as info:
        engine.submit(Request(PROMPTS[0], 4, constraint=parity_automaton()), Collector())
    assert info.value.field == "constraint"
    with pytest.raises(ValueError, match="constraint_edges=0"):
        dataclasses.replace(CONFIG, constraint_edges=0)


def test_a_constraint_that_does_not_fit_beside_live_rows_waits_and_others_pass(fresh_engine):
    """Capacity for 4 states: a 4-state automaton cannot join a live 2-state one, so it waits for that row to
    finish, while a free request sent after it is admitted at once."""
    from test_constrained import parity_automaton

    admitted = []
    engine = fresh_engine(dataclasses.replace(CONFIG, chunk_steps=2, constraint_states=4, constraint_edges=256),
                          observers=[lambda kind, info: admitted.append(info["prompt_tokens"])
                                     if kind == "admit" else None]).start(warmup=False)
    first, big, plain = Collector(), Collector(), Collector()
    engine.submit(Request(PROMPTS[0], 96, constraint=parity_automaton()), first)  # 12-token prompt
    first.wait_events(2)
    engine.submit(Request(PROMPTS[3], N, constraint=forcing_automaton()), big)  # 14
    engine.submit(Request(PROMPTS[4], N), plain)  # 15
    for c in (first, big, plain):
        c.wait()
    assert admitted == [12, 15, 14]
    assert set(big.tokens[0::4]) == {5} and set(big.tokens[2::4]) == {7}
    assert all(t % 2 == i % 2 for i, t in enumerate(first.tokens))


def test_served_constrained_rows_draft_forced_tokens(tiny_lm, fresh_engine):
    aut = forcing_automaton()
    engine = fresh_engine().start(warmup=False)
    got = run_all(engine, [Request(PROMPTS[0], N, constraint=aut, method="none"),
                           Request(PROMPTS[1], N, method="none")])
    want = jaxspec.generate(tiny_lm, [PROMPTS[0]], max_new_tokens=N, constraint=aut,
                            spec=SpecConfig(forced_tokens=0)).token_ids[0]
    assert got[0].tokens == want and set(want[0::4]) == {5} and set(want[2::4]) == {7}
    stats = got[0].final.stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted  # a forced token is always accepted
    assert got[1].final.stats.drafted == 0  # the free row beside it, method none: nothing drafted
