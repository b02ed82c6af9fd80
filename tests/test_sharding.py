"""The model under JAX's own SPMD: a batch sharded over a 2-device CPU mesh gives the unsharded result."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.llama import Llama

    assert len(jax.devices()) == 2, jax.devices()
    cfg = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=8)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))

    def forward(params, tokens, lengths):
        model = nnx.merge(graphdef, params)
        cache = model.new_cache(tokens.shape[0], 32).replace(lengths=lengths)
        pos = lengths[:, None] + jnp.arange(tokens.shape[1])[None]
        return model(tokens, pos, cache)[0].logits

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (4, 6)), jnp.int32)
    lengths = jnp.zeros((4,), jnp.int32)
    expected = jax.jit(forward)(params, tokens, lengths)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    params_r = jax.device_put(params, replicated)
    got = jax.jit(forward)(params_r, jax.device_put(tokens, rows), jax.device_put(lengths, rows))
    assert got.sharding.spec[0] == "data", got.sharding
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)
    print("OK")
""")


def test_batch_sharded_over_two_cpu_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
