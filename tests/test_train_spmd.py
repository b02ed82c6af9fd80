"""Data-parallel head training (`train(..., mesh=...)`, `--data-parallel N`) on 8 forced CPU devices in a
subprocess: the losses and parameters of single-device training, the batch really split and the state
replicated, checkpoints that resume across runs with and without a mesh, and the batch-size check."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys, tempfile
    from pathlib import Path
    import jax, numpy as np
    from flax import nnx
    sys.path.insert(0, TESTS)
    from conftest import TINY
    import jaxspec
    from jaxspec.models.heads import Readout
    from jaxspec.models.llama import Llama
    from jaxspec.sharding import make_mesh
    from jaxspec.train import Batches, GenerationSettings, TrainConfig, WindowSpec, ensure_dataset, train
    from jaxspec.train.eagle import EagleTask
    from jaxspec.train.loop import place_batch
    from jaxspec.train.medusa import MedusaTask

    assert len(jax.devices()) == 8
    lm = jaxspec.LanguageModel.from_module(Llama(TINY, rngs=nnx.Rngs(0)), name="tiny")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, size=k).tolist() for k in rng.integers(4, 30, size=12)]
    root = Path(tempfile.mkdtemp())
    data = ensure_dataset(lm, prompts, root / "data", sources={"random": 12},
                          settings=GenerationSettings(gen_tokens=24, gen_batch=4), progress=False)
    readout = Readout.of(lm.params)

    def close(a, b, what):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6,
                                                             err_msg=what), a, b)

    tasks = (("eagle", EagleTask(context=4, noise=0.05), 3e-3), ("medusa", MedusaTask(num_heads=3), 2e-2))
    for kind, task, lr in tasks:
        batches = Batches(data, WindowSpec(seq_len=16, context=task.context, lookahead=task.lookahead), 8, seed=0)
        config = TrainConfig(steps=6, batch_size=8, seq_len=16, lr=lr, warmup_steps=2, save_every=3)
        single = train(task, lm.config, readout, batches, config, root / f"{kind}-single", progress=False)
        losses = [h["loss"] for h in single.history]
        for n in (8, 2):
            mesh = make_mesh(data=n)
            placed = place_batch(batches.batch(0), mesh)
            assert placed.tokens.addressable_shards[0].data.shape[0] == 8 // n
            assert len(placed.tokens.sharding.device_set) == n
            run = train(task, lm.config, readout, batches, config, root / f"{kind}-mesh{n}", progress=False, mesh=mesh)
            np.testing.assert_allclose([h["loss"] for h in run.history], losses, rtol=2e-5, err_msg=f"{kind} {n}")
            close(run.params, single.params, f"{kind} params on {n} devices")
            leaf = jax.tree.leaves(run.params)[0]
            assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == n, leaf.sharding
        # Checkpoints carry over: 4 steps on a mesh (checkpoint at 3), resumed on one device, and back.
        four = make_mesh(data=4)
        for first, then, name in ((four, None, "mesh-then-one"), (None, four, "one-then-mesh")):
            out = root / f"{kind}-{name}"
            train(task, lm.config, readout, batches, config, out, stop_after=4, progress=False, mesh=first)
            resumed = train(task, lm.config, readout, batches, config, out, progress=False, mesh=then)
            assert resumed.resumed_from == 3 and resumed.step == 6
            np.testing.assert_allclose([h["loss"] for h in resumed.history], losses[3:], rtol=2e-5, err_msg=name)
            close(resumed.params, single.params, f"{kind} {name}")
        print(kind, "OK", flush=True)

    try:
        train(task, lm.config, readout, batches, TrainConfig(steps=2, batch_size=6, seq_len=16, warmup_steps=0),
              root / "bad", progress=False, mesh=make_mesh(data=4))
    except ValueError as e:
        assert "'data' of size 4 does not divide batch_size=6" in str(e), e
    else:
        raise AssertionError("no ValueError")
    print("errors OK")
""")


def test_data_parallel_training_equals_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    tests = str(Path(__file__).resolve().parent)
    result = subprocess.run([sys.executable, "-c", f"TESTS = {tests!r}\n" + SCRIPT], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("OK") == 3, result.stdout
