"""Constraint compilation is bounded, abandonable and stall-free.

Every `ConstraintLimits` field refuses what exceeds it with a `ConstraintTooLarge` naming the field and the
offending part (a keyword path, a regex fragment), in milliseconds and with a short message; the hostile
specs of the field (a minLength of 10**9, a schema of self-referring properties, `[a-z]{5000}`, a maxLength
whose compile runs for minutes) are refused quickly or within the compile's budget. The compile runs in a
worker process: one killed by its time or memory budget, or cancelled, leaves this process alive and the next
compile works. Specs construct in milliseconds whatever their size. Over HTTP (a small random model carrying
the real SmolLM2 tokenizer, as tests/test_server_fuzz.py builds it) every refusal is a 400 naming
`response_format`, too many waiting compiles a 429, and a client that leaves cancels its compile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxspec
import test_constraints
from jaxspec.constraints import (
    Choice,
    CompileCancelled,
    CompilerBusy,
    ConstraintLimits,
    ConstraintTooLarge,
    JsonSchema,
    Regex,
    clear_cache,
    compile_constraint,
)
from jaxspec.constraints import compile as compile_module
from jaxspec.constraints.compile import AutomatonCache, worker_job
from jaxspec.constraints.compiler import Compiler, Worker, wall_seconds

tok_and_vocab = test_constraints.tok_and_vocab  # the fixture: (SmolLM2's tokenizer, the model's vocab_size)
LIMITS = ConstraintLimits()
RECURSIVE = {"type": "object", "properties": {f"p{i}": {"$ref": "#"} for i in range(20)}}  # 798 bytes
SLOW = JsonSchema({"type": "string", "maxLength": 20})  # minutes and gigabytes in outlines-core
HUNGRY = Regex("[a-z]{150}")  # 1.7M edges: its transitions alone take over 300 MB in the worker


def rss_mib() -> float:
    """This process's resident memory (VmRSS), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def warm_worker(tok, vocab):
    """The process of the one idle compile worker, after a compile that needs one (nothing cached)."""
    clear_cache()
    compile_constraint(Regex("[0-9]"), tok, vocab)
    (worker,) = compile_module.compiler._idle
    return worker.process


# ------------------------------------------------------------------------------------ limits from the text


@pytest.mark.parametrize("spec, limit, names", [
    (JsonSchema({"type": "string", "minLength": 1_000_000_000}), "max_repeat", "minLength: 1000000000"),
    (JsonSchema({"type": "object", "properties": {"name": {"type": "string", "maxLength": 1000}}}), "max_repeat",
     "properties.name.maxLength"),
    (JsonSchema({"type": "array", "items": {"type": "integer"}, "minItems": 300}), "max_repeat", "minItems"),
    (JsonSchema({"type": "object", "maxProperties": 10**6}), "max_repeat", "maxProperties"),
    (JsonSchema(RECURSIVE), "max_schema_nodes", "JSON schema at"),
    (JsonSchema(nested(70)), "max_schema_depth", "properties.a.properties.a"),
    (JsonSchema({"type": "string", "description": "x" * 70_000}), "max_schema_bytes", "JSON schema"),
    (JsonSchema({"properties": {"c": {"enum": list(range(10_001))}}}), "max_options", "properties.c.enum"),
    (JsonSchema({"type": "string", "pattern": "[a-z]{999}"}), "max_repeat", "pattern regex fragment"),
    (JsonSchema({"type": "string"}, whitespace="[ ]{1000}"), "max_repeat", "whitespace pattern"),
    (Regex("[a-z]{5000}"), "max_repeat", "[a-z]{5000}"),
    (Regex(".{1000000}"), "max_repeat", ".{1000000}"),
    (Regex("x(a{20}b){20}"), "max_repeat", "a repetition of 400"),
    (Regex("[0-9]{2,300}"), "max_repeat", "{2,300}"),
    (Regex("a" * 300_000), "max_regex_bytes", "300000 bytes"),
    (Choice([str(i) for i in range(10_001)]), "max_options", "10001 options"),
    (Choice(["x" * 200_000]), "max_option_bytes", "200000 bytes"),
])
def test_each_limit_is_refused_from_the_text_naming_it(spec, limit, names):
    start = time.perf_counter()
    with pytest.raises(ConstraintTooLarge, match=f"{limit}=") as info:
        worker_job(spec, LIMITS)
    assert time.perf_counter() - start < 0.5
    assert info.value.limit == limit and info.value.maximum == getattr(LIMITS, limit)
    assert names in str(info.value)
    assert len(str(info.value)) < 1000  # never the whole spec


def test_escaped_braces_and_classes_are_no_repetition():
    for pattern in (r"\p{Greek}{3}", r"[{]{2}", r"\{9999\}", r"[a-z&&[^x]]{4}", r"\x{41}{5}", "a{,5}"):
        worker_job(Regex(pattern), LIMITS)
    worker_job(JsonSchema({"type": "object", "properties": {"t": {"$ref": "#/$defs/T"}},
                           "$defs": {"T": {"type": "array", "items": {"$ref": "#/$defs/T"}}}}), LIMITS)


def test_specs_construct_in_milliseconds_whatever_their_size():
    start = time.perf_counter()
    Regex(".{1000000}")
    Regex("(" * 100_000)
    JsonSchema({"type": "string", "minLength": 1_000_000_000})
    JsonSchema(RECURSIVE)
    JsonSchema({"properties": {f"k{i}": {"type": "string", "maxLength": 20} for i in range(2000)}})
    Choice([str(i) for i in range(100_000)])
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ValueError, match="nested too deeply"):
        JsonSchema("[" * 100_000)


def test_limits_check_their_own_fields():
    with pytest.raises(ValueError, match="max_repeat=0"):
        ConstraintLimits(max_repeat=0)
    with pytest.raises(ValueError, match="max_states=1.5"):
        ConstraintLimits(max_states=1.5)
    with pytest.raises(ValueError, match="limits must be a ConstraintLimits"):
        compile_constraint(Regex("a"), None, 1, limits={"max_repeat": 3})


def test_cache_is_bounded_by_bytes_least_recently_used_out():
    class Fake:
        def __init__(self, nbytes):
            self.nbytes = nbytes

    cache = AutomatonCache(max_bytes=1000)
    for key in "abc":
        cache.put(key, Fake(200))  # 400 bytes each: device arrays and host twin
    assert cache.get("a") is None and cache.get("b") is not None and cache.bytes == 800
    cache.put("d", Fake(200))  # "c" is now the least recently used
    assert cache.get("c") is None and cache.get("b") is not None and len(cache) == 2


# ------------------------------------------------------------------------------- the worker and its budget


def test_hostile_specs_are_refused_quickly_and_the_parent_stays_small(tok_and_vocab):
    tok, vocab = tok_and_vocab
    compile_constraint(Regex("[0-9]"), tok, vocab)  # the vocabulary and a worker, before measuring
    before = rss_mib()
    for spec in (JsonSchema({"type": "string", "minLength": 1_000_000_000}), JsonSchema(RECURSIVE),
                 Regex("[a-z]{5000}"), Regex(".{1000000}")):
        start = time.perf_counter()
        with pytest.raises(ConstraintTooLarge):
            compile_constraint(spec, tok, vocab)
        assert time.perf_counter() - start < 1.0
    assert rss_mib() - before < 50


def test_automaton_size_limits_name_the_spec(tok_and_vocab):
    tok, vocab = tok_and_vocab
    with pytest.raises(ConstraintTooLarge, match="max_states=5") as info:
        compile_constraint(Regex("[0-9]{8}"), tok, vocab, ConstraintLimits(max_states=5))
    assert "9 states" in str(info.value) and "[0-9]{8}" in str(info.value)
    with pytest.raises(ConstraintTooLarge, match="max_edges=10"):
        compile_constraint(Regex("[a-z]{3}"), tok, vocab, ConstraintLimits(max_edges=10))
    compile_constraint(Regex("[0-9]{8}"), tok, vocab)  # within the default limits
    with pytest.raises(ConstraintTooLarge, match="max_states=5"):  # a cached automaton is checked too
        compile_constraint(Regex("[0-9]{8}"), tok, vocab, ConstraintLimits(max_states=5))


def test_time_budget_kills_the_worker_and_the_next_compile_works(tok_and_vocab):
    tok, vocab = tok_and_vocab
    clear_cache()
    before = rss_mib()
    start = time.perf_counter()
    with pytest.raises(ConstraintTooLarge, match="more than 2 s") as info:
        compile_constraint(SLOW, tok, vocab, ConstraintLimits(time_s=2))
    assert info.value.limit == "time_s" and time.perf_counter() - start < wall_seconds(ConstraintLimits(time_s=2)) + 2
    start = time.perf_counter()
    with pytest.raises(ConstraintTooLarge, match="time_s=2"):  # remembered: refused at once
        compile_constraint(SLOW, tok, vocab, ConstraintLimits(time_s=2))
    assert time.perf_counter() - start < 0.1
    assert compile_constraint(Regex("(yes|no)"), tok, vocab).num_states >= 2
    assert rss_mib() - before < 50


def test_callers_of_one_spec_share_one_compile(tok_and_vocab, monkeypatch):
    """Four threads asking for the same new spec at once get one automaton from one worker job: a second job
    would hold a worker as long again, and every other constraint behind it."""
    tok, vocab = tok_and_vocab
    clear_cache()
    jobs = []
    run = Worker.run

    def counted(self, job, *args):
        jobs.append(job["what"])
        time.sleep(0.5)  # the others arrive while it compiles
        return run(self, job, *args)

    monkeypatch.setattr(Worker, "run", counted)
    results = [None] * 4

    def ask(i):
        results[i] = compile_constraint(Regex("(alpha|beta|gamma)[0-9]{2}"), tok, vocab)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(jobs) == 1, jobs
    assert all(r is results[0] for r in results) and results[0].num_states > 3


def test_memory_budget_kills_the_worker_and_the_next_compile_works(tok_and_vocab):
    tok, vocab = tok_and_vocab
    before = rss_mib()
    with pytest.raises(ConstraintTooLarge, match="more than 200 MiB") as info:
        compile_constraint(HUNGRY, tok, vocab, ConstraintLimits(memory_bytes=200 << 20, time_s=60))
    assert info.value.limit == "memory_bytes"
    assert compile_constraint(Regex("[0-9]{3}"), tok, vocab).num_states == 4
    assert rss_mib() - before < 50


def test_cancel_kills_a_running_compile(tok_and_vocab):
    tok, vocab = tok_and_vocab
    warm = warm_worker(tok, vocab)  # the slow compile starts at once
    cancel = threading.Event()
    outcome = []

    def run():
        try:
            compile_constraint(SLOW, tok, vocab, cancel=cancel)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    assert warm.poll() is None  # compiling
    cancel.set()
    start = time.perf_counter()
    thread.join(10)
    assert not thread.is_alive() and time.perf_counter() - start < 2
    assert isinstance(outcome[0], CompileCancelled)
    assert warm.poll() is not None  # killed
    assert compile_constraint(Regex("[0-9]{2}"), tok, vocab).num_states == 3  # a fresh worker serves


def test_waiting_compiles_beyond_the_limit_are_refused():
    pool = Compiler(max_workers=1, max_waiting=0)
    with contextlib.ExitStack() as held:
        held.enter_context(pool.slot())
        with pytest.raises(CompilerBusy, match="retry later"):
            with pool.slot():
                pass
        cancel = threading.Event()
        cancel.set()
        pool.max_waiting = 1
        with pytest.raises(CompileCancelled):
            with pool.slot(cancel):
                pass
    pool.close()


def _containing(inner: st.SearchStrategy) -> st.SearchStrategy:
    """Objects, arrays and anyOfs of `inner` schemas, or `inner` itself."""
    objects = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1]})
    arrays = inner.map(lambda item: {"type": "array", "items": item, "maxItems": 3})
    choices = st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
    return st.one_of(inner, objects, arrays, choices)


SMALL_SCHEMAS = _containing(_containing(st.sampled_from([
    {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}, {"type": "null"},
    {"enum": ["a", "b", 3]}, {"type": "string", "maxLength": 4}, {"type": "string", "pattern": "[a-c]{1,3}"},
    {"const": "x"}])))
SMALL_REGEXES = st.lists(st.sampled_from(["a", "[0-9]", "(x|yz)", "[a-f]{1,3}", r"\.", "b?", "c*", "(", "[",
                                          "d{2}", "|", ")", "é"]), min_size=1, max_size=8).map("".join)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.one_of(SMALL_SCHEMAS.map(JsonSchema), SMALL_REGEXES.map(Regex)))
def test_fuzzed_specs_compile_or_raise_value_errors_within_the_budget(tok_and_vocab, spec):
    tok, vocab = tok_and_vocab
    limits = ConstraintLimits(time_s=20)
    before = rss_mib()
    start = time.perf_counter()
    try:
        aut = compile_constraint(spec, tok, vocab, limits)
        assert aut.num_states >= 1
    except ValueError as e:
        assert len(str(e)) < 1500
    assert time.perf_counter() - start < wall_seconds(limits) + 1
    assert rss_mib() - before < 100


# ------------------------------------------------------------------------------------------------ over HTTP


MODEL = "smollm2-tiny-random"
HTTP_LIMITS = ConstraintLimits(time_s=3)


@pytest.fixture(scope="module")
def app_client(tok_and_vocab):
    """An app over a small random model with the real tokenizer, its engine not started: every answer here
    comes before a request is submitted. The compile budget is short, so a slow schema fails in seconds."""
    from fastapi.testclient import TestClient
    from flax import nnx

    from jaxspec.engine import Engine, EngineConfig
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.llama import Llama
    from jaxspec.serving import create_app

    tok = tok_and_vocab[0]
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=8, tie_word_embeddings=False, max_position_embeddings=512)
    lm = jaxspec.LanguageModel.from_module(Llama(cfg, rngs=nnx.Rngs(0)), tokenizer=tok, name=MODEL)
    config = EngineConfig(max_slots=2, slot_buckets=(1, 2), cache_len=256,
                          constraint_limits=HTTP_LIMITS)
    engine = Engine(lm, config)
    return TestClient(create_app(engine, served_model_name=MODEL), raise_server_exceptions=False), engine


def _post_schema(client, schema: dict):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    return client.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("schema, limit", [
    ({"type": "string", "minLength": 1_000_000_000}, "max_repeat"),
    (RECURSIVE, "max_schema_nodes"),
    ({"type": "string", "pattern": "[a-z]{5000}"}, "max_repeat"),
    ({"type": "object", "properties": {f"k{i}": {"type": "string", "description": "d" * 400} for i in range(200)}},
     "max_schema_bytes"),
    ({"type": "string", "maxLength": 20}, "time_s"),
])
def test_http_refusals_are_400s_naming_response_format(app_client, schema, limit):
    client, _ = app_client
    start = time.perf_counter()
    r = _post_schema(client, schema)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("response_format") and limit in error["message"]
    assert len(error["message"]) < 1000
    # Answered within the compiler's own bound on a worker (a starved worker is given up on then), plus the
    # request's own handling: a refusal never waits on the engine.
    assert time.perf_counter() - start < wall_seconds(HTTP_LIMITS) + 2


def test_http_too_many_waiting_compiles_is_a_429(app_client, monkeypatch):
    client, _ = app_client
    pool = Compiler(max_workers=1, max_waiting=0)
    monkeypatch.setattr(compile_module, "compiler", pool)
    with pool.slot():  # the only worker is busy and nobody may wait
        r = _post_schema(client, {"type": "object", "properties": {"busy": {"type": "integer"}}})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "too_many_compiles"


def test_a_client_that_leaves_cancels_its_compile(app_client, tok_and_vocab):
    from jaxspec.serving.protocol import ChatCompletionRequest
    from jaxspec.serving.translate import Translator

    tok, vocab = tok_and_vocab
    _, engine = app_client
    warm = warm_worker(tok, vocab)
    translator = Translator(engine, MODEL)
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": 19}}}})

    class Leaving:
        """An HTTP request whose client is gone after 0.3 s."""

        def __init__(self):
            self.t0 = time.perf_counter()

        async def is_disconnected(self) -> bool:
            return time.perf_counter() - self.t0 > 0.3

    start = time.perf_counter()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(translator.compile_response_format(body, Leaving()))
    assert time.perf_counter() - start < 3
    deadline = time.monotonic() + 5  # the compile thread sees the cancel within its poll and kills the worker
    while warm.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warm.poll() is not None
    assert compile_constraint(Regex("[0-9]{4}"), tok, vocab).num_states == 5


def test_worker_imports_no_jax(tok_and_vocab):
    tok, vocab = tok_and_vocab
    pid = warm_worker(tok, vocab).pid
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    assert "outlines_core" in maps and "jaxlib" not in maps
    assert os.getpriority(os.PRIO_PROCESS, pid) > os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.slow
def test_plain_requests_keep_flowing_while_a_slow_compile_runs(tiny_lm, tok_and_vocab):
    """The compile runs in a worker process at a lower priority: the engine thread serves on meanwhile."""
    from jaxspec.engine import Engine, EngineConfig, Request

    tok, vocab = tok_and_vocab
    engine = Engine(tiny_lm, EngineConfig(max_slots=2, slot_buckets=(1, 2), cache_len=128)).start(warmup=False)
    try:
        done = threading.Event()
        engine.submit(Request([5, 6, 7, 8] * 3, 8), lambda out: out.finish_reason and done.set())
        assert done.wait(600)  # the programs are compiled now
        clear_cache()
        compile_module._refused.clear()
        compiling = threading.Thread(target=lambda: pytest.raises(
            ConstraintTooLarge, compile_constraint, SLOW, tok, vocab, ConstraintLimits(time_s=20)))
        compiling.start()
        time.sleep(0.5)
        for _ in range(3):
            done.clear()
            start = time.perf_counter()
            engine.submit(Request([5, 6, 7, 8] * 3, 8), lambda out: out.finish_reason and done.set())
            assert done.wait(10) and time.perf_counter() - start < 5
        assert compiling.is_alive()
        compiling.join(60)
    finally:
        engine.shutdown(drain=False, timeout=30)
