"""The CPU matmul kernel (jaxspec.kernels.cpu): equal to XLA's product, inside the model, and the XLA fallback.

The kernel's tests need the library that `make install` builds (`python -m jaxspec.kernels.cpu.build`). Without a
C++ compiler they skip; with one but no usable library they fail, since then the build is what is broken.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.kernels import cpu as cpu_kernels
from jaxspec.kernels.cpu import build as cpu_build
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import Llama, set_matmul

# A random model that compiles in a second; tied embeddings, so the LM head goes through the kernel too.
TINY = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
                   head_dim=8, tie_word_embeddings=True, max_position_embeddings=256)


@pytest.fixture(scope="module")
def kernel():
    """The kernel, or a skip (no compiler) / failure (a compiler but no usable library)."""
    if not cpu_kernels.available():
        if cpu_build.find_compiler() is None:
            pytest.skip(f"no C++ compiler, so no CPU matmul kernel: {cpu_kernels.unavailable_reason()}")
        pytest.fail(f"a C++ compiler exists but the kernel is unavailable (run `make install`): "
                    f"{cpu_kernels.unavailable_reason()}")
    return cpu_kernels


def _variants():
    """(isa, form, threads) for every code path this CPU runs; the baseline path has the dot form only."""
    paths = {"avx512": ["avx512", "avx2", "generic"], "avx2": ["avx2", "generic"]}.get(cpu_kernels.isa(), ["generic"])
    out = []
    for isa in paths:
        for form in (("dot", "broadcast", "auto") if isa != "generic" else ("auto",)):
            out += [(isa, form, 0), (isa, form, 1)]
    return out


def _operands(rng, m, k, n):
    w, x = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    return jnp.asarray(w, jnp.float32), jnp.asarray(x, jnp.float32)


# Columns: the dot form (1-11); broadcasts (AVX-512: vectors of 16; AVX2: of 8) with a dot-form remainder
# (AVX2: 9, 12, 17, 20, 33; AVX-512: 17, 20, 33), with a masked last vector (AVX2: 13, 21; AVX-512: 21), whole
# vectors (AVX2: 16, 64; AVX-512: 64). Every form is forced on every shape too.
SHAPES = [(m, k, n) for n in (1, 2, 3, 7, 8, 9, 12, 13, 16, 17, 20, 21, 33, 64)
          for m, k in ((97, 576), (1003, 1536), (61, 100))]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_kernel_equals_xla_product(kernel, m, k, n):
    w, x = _operands(np.random.default_rng(m * 1000 + n), m, k, n)
    variants = _variants()
    outs = jax.jit(lambda w, x: [kernel.matmul(w, x, isa=i, form=f, threads=t) for i, f, t in variants])(w, x)
    ref = np.asarray(w, np.float64) @ np.asarray(x, np.float64)
    xla = np.asarray(jax.jit(jnp.matmul)(w, x))
    for (isa, form, threads), y in zip(variants, outs):
        assert y.shape == (m, n) and y.dtype == jnp.float32
        # float32 sums of k products of unit normals: errors of order 1e-6 * sqrt(k) * |y|.
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=2e-4, err_msg=f"{isa} {form} {threads}")
        np.testing.assert_allclose(np.asarray(y), xla, rtol=1e-4, atol=2e-4, err_msg=f"{isa} {form} {threads}")


@pytest.mark.parametrize("k,n", [(100, 9), (576, 9), (100, 17)])
def test_non_finite_inputs_propagate(kernel, k, n):
    m = 29
    w, x = (np.array(a) for a in _operands(np.random.default_rng(k), m, k, n))
    w[3, 5] = np.nan  # row 3 of y: NaN in every column
    x[k - 1, 2] = np.inf  # column 2: +-inf, from the last k (a masked tail lane when k % 16 != 0)
    x[0, 6] = -np.inf
    w[7, 0] = 0.0  # 0 * -inf: NaN at y[7, 6]
    x[1, n - 1] = np.nan  # the last column (with 17, the broadcast form's dot-form remainder): NaN everywhere
    with np.errstate(invalid="ignore"):  # 0 * inf in the reference, on purpose
        ref = w.astype(np.float64) @ x.astype(np.float64)
    variants = _variants()
    outs = jax.jit(lambda w, x: [kernel.matmul(w, x, isa=i, form=f, threads=t) for i, f, t in variants])(w, x)
    assert np.isnan(ref[3]).all() and np.isnan(ref[7, 6]) and np.isinf(ref[0, 2]) and np.isnan(ref[:, n - 1]).all()
    for (isa, form, threads), y in zip(variants, outs):
        # assert_allclose matches NaN to NaN and +-inf to the same infinity, element by element.
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=2e-4, err_msg=f"{isa} {form} {threads}")


def test_bad_operands_raise(kernel):
    ok = jnp.ones((5, 7), jnp.float32)
    with pytest.raises(ValueError, match=r"w \[m, k\] and x \[k, n\]"):
        kernel.matmul(ok, jnp.ones((8, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"w \[m, k\] and x \[k, n\]"):
        kernel.matmul(jnp.ones((5, 7, 1), jnp.float32), jnp.ones((7, 3), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        kernel.matmul(ok.astype(jnp.bfloat16), jnp.ones((7, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="isa="):
        kernel.matmul(ok, jnp.ones((7, 3), jnp.float32), isa="sse9")


def test_bad_shapes_reach_the_handler_as_an_error(kernel):
    # The custom call itself, bypassing matmul's checks: the handler answers with an FFI error, not a crash.
    call = jax.ffi.ffi_call("jaxspec_small_matmul", jax.ShapeDtypeStruct((5, 4), jnp.float32))
    attrs = dict(isa=np.int64(0), form=np.int64(0), threads=np.int64(0))
    with pytest.raises(Exception, match=r"expected w \[m, k\], x \[k, n\] -> y \[m, n\]; got w \[5, 7\], x \[7, 3\]"):
        jax.block_until_ready(call(jnp.ones((5, 7), jnp.float32), jnp.ones((7, 3), jnp.float32), **attrs))
    with pytest.raises(Exception, match="form 2 is not available for isa 3"):
        kernel.matmul(jnp.ones((5, 7), jnp.float32), jnp.ones((7, 4), jnp.float32), isa="generic",
                      form="broadcast").block_until_ready()


def test_project_inside_loops_switch_and_vmap(kernel):
    w, x = _operands(np.random.default_rng(0), 40, 24, 3)

    def steps(impl):
        def body(i, x):
            y = jax.lax.switch(i % 2, [lambda x: cpu_kernels.project(w, x, impl),
                                       lambda x: -cpu_kernels.project(w, x, impl)], x)
            return jnp.tanh(y[:24])
        return jax.jit(lambda x: jax.lax.fori_loop(0, 5, body, x))(x)

    np.testing.assert_allclose(np.asarray(steps("ffi")), np.asarray(steps("xla")), rtol=1e-4, atol=1e-5)
    xs = jnp.stack([x, 2 * x])
    batched = jax.vmap(lambda x: cpu_kernels.project(w, x, "ffi"))(xs)
    np.testing.assert_allclose(np.asarray(batched), np.asarray(jnp.einsum("ok,bkn->bon", w, xs)), rtol=1e-5, atol=1e-5)


def test_derivatives_come_from_xla(kernel):
    w, x = _operands(np.random.default_rng(1), 30, 20, 4)

    def loss(impl):
        return lambda w, x: jnp.sum(jnp.sin(cpu_kernels.project(w, x, impl)))

    got = jax.jit(jax.grad(loss("ffi"), argnums=(0, 1)))(w, x)
    want = jax.grad(loss("xla"), argnums=(0, 1))(w, x)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
    dw, dx = jnp.ones_like(w), jnp.zeros_like(x)
    _, tangent = jax.jvp(lambda w, x: cpu_kernels.project(w, x, "ffi"), (w, x), (dw, dx))
    np.testing.assert_allclose(np.asarray(tangent), np.asarray(dw @ x), rtol=1e-5, atol=1e-5)


def test_auto_takes_the_kernel_for_few_columns_only(kernel):
    w = jnp.ones((64, 32), jnp.float32)
    one, few = jnp.ones((32, 1), jnp.float32), jnp.ones((32, 8), jnp.float32)
    many = jnp.ones((32, 257), jnp.float32)
    assert kernel.uses_kernel("auto", w, few) == (kernel.isa() in ("avx512", "avx2"))
    assert not kernel.uses_kernel("auto", w, many) and not kernel.uses_kernel("auto", w, one)
    assert kernel.uses_kernel("ffi", w, many) and kernel.uses_kernel("ffi", w, one)
    assert not kernel.uses_kernel("ffi", w.astype(jnp.bfloat16), few.astype(jnp.bfloat16))
    assert not kernel.uses_kernel("xla", w, few)
    hlo = jax.jit(lambda w, x: cpu_kernels.project(w, x, "ffi")).lower(w, few).compile().as_text()
    assert "jaxspec_small_matmul" in hlo


def _tiny(impl: str):
    model = Llama(TINY, rngs=nnx.Rngs(3))
    set_matmul(model, impl)
    return jaxspec.LanguageModel.from_module(model, name=f"tiny-{impl}")


@functools.partial(jax.jit, static_argnames="graphdef")
def _prefill_logits(graphdef, params, tokens, positions):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, model.new_cache(tokens.shape[0], 32), cached_slots=0)[0].logits


def test_tiny_model_same_logits_and_tokens(kernel):
    xla, ffi = _tiny("xla"), _tiny("ffi")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    got, want = (np.asarray(_prefill_logits(lm.graphdef, lm.params, tokens, positions)) for lm in (ffi, xla))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    prompts = np.asarray(tokens)
    lengths = np.array([9, 5])
    for spec in (None, jaxspec.SpecConfig(method="ngram", num_speculative_tokens=4)):
        a = jaxspec.generate(xla, prompts, prompt_lengths=lengths, max_new_tokens=12, spec=spec)
        b = jaxspec.generate(ffi, prompts, prompt_lengths=lengths, max_new_tokens=12, spec=spec)
        np.testing.assert_array_equal(np.asarray(a.token_array), np.asarray(b.token_array))


@pytest.mark.real_model
def test_smollm2_same_greedy_tokens(kernel, smollm2):
    module = smollm2.module
    variants = {}
    for impl in ("xla", "ffi"):
        set_matmul(module, impl)
        variants[impl] = dataclasses.replace(smollm2, graphdef=nnx.split(module)[0])
    prompts = ["def fibonacci(n):", "import numpy as np\n\ndef moving_average(x, k):"]
    spec = jaxspec.SpecConfig(method="ngram", num_speculative_tokens=8)
    a = jaxspec.generate(variants["xla"], prompts, max_new_tokens=24)
    b = jaxspec.generate(variants["ffi"], prompts, max_new_tokens=24)
    c = jaxspec.generate(variants["ffi"], prompts, max_new_tokens=24, spec=spec)
    assert a.text == b.text == c.text


# ---- without the kernel ---------------------------------------------------------------------------------------

@pytest.fixture
def no_library(monkeypatch, tmp_path):
    """The kernel as on a machine where it was never built; the real library is back afterwards."""
    monkeypatch.setattr(cpu_kernels, "LIBRARY", tmp_path / "missing.so")
    cpu_kernels.reload()
    yield
    monkeypatch.undo()
    cpu_kernels.reload()


def test_without_the_library_auto_is_xla(no_library):
    assert not cpu_kernels.available() and cpu_kernels.isa() is None
    assert "is not built" in cpu_kernels.unavailable_reason()
    w, x = _operands(np.random.default_rng(2), 16, 8, 3)
    assert not cpu_kernels.uses_kernel("auto", w, x)
    hlo = jax.jit(lambda w, x: cpu_kernels.project(w, x, "auto")).lower(w, x).as_text()
    assert "custom_call" not in hlo
    np.testing.assert_array_equal(np.asarray(cpu_kernels.project(w, x)), np.asarray(w @ x))
    with pytest.raises(RuntimeError, match="unavailable: .*is not built"):
        cpu_kernels.project(w, x, "ffi")
    # The whole model runs on XLA: a tiny generate in the default mode.
    out = jaxspec.generate(_tiny("auto"), np.array([[1, 2, 3]]), max_new_tokens=4)
    assert out.token_array.shape[0] == 1


def test_a_library_from_other_sources_is_refused(kernel, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "source_hash", lambda: "0" * 16)
    cpu_kernels.reload()
    try:
        with pytest.warns(UserWarning, match="kernel is not used: .* built from other sources or for another jaxlib"):
            assert not cpu_kernels.available()
        assert "built from other sources" in cpu_kernels.unavailable_reason()
    finally:
        monkeypatch.undo()
        cpu_kernels.reload()
    assert cpu_kernels.available()


def test_default_impl_from_the_environment(monkeypatch):
    monkeypatch.delenv(cpu_kernels.ENV, raising=False)
    assert cpu_kernels.default_impl() == "auto"
    monkeypatch.setenv(cpu_kernels.ENV, "xla")
    assert cpu_kernels.default_impl() == "xla"
    assert Llama(TINY, rngs=nnx.Rngs(0)).layers[0].mlp.matmul == "xla"
    monkeypatch.setenv(cpu_kernels.ENV, "fast")
    with pytest.raises(ValueError, match="JAXSPEC_MATMUL='fast'"):
        cpu_kernels.default_impl()
    with pytest.raises(ValueError, match="impl='fast'"):
        set_matmul(Llama(TINY, rngs=nnx.Rngs(0), matmul="xla"), "fast")


def test_build_without_a_compiler_exits_cleanly(monkeypatch, capsys):
    before = cpu_kernels.LIBRARY.stat().st_mtime_ns if cpu_kernels.LIBRARY.exists() else None
    assert cpu_build.main(["--cxx", "/nonexistent/c++"]) == 0
    assert "does not exist" in capsys.readouterr().err
    assert (cpu_kernels.LIBRARY.stat().st_mtime_ns if cpu_kernels.LIBRARY.exists() else None) == before
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cpu_build.find_compiler() is None
    assert cpu_build.main([]) == 0
    assert "no C++ compiler found" in capsys.readouterr().err
