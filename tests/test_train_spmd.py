"""Data-parallel head training (`train(..., mesh=...)`, `--data-parallel N`).

On 8 forced CPU devices in a subprocess (XLA_FLAGS must be set before jax starts): the losses and parameters of
single-device training on meshes (8, 1) and (2, 4) (data parallel over "data" only, the head replicated over
"model"), the batch really split and the state replicated, one all-reduce in the compiled step, checkpoints that
resume across runs with and without a mesh, and the batch-size checks of `train` and the command line. In this
process (one device): the same checks on an abstract mesh, and the command line's error for too few devices.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from jax.sharding import AbstractMesh

from jaxspec.train import TrainConfig, train
from jaxspec.train.cli import data_parallel_mesh
from jaxspec.train.eagle import EagleTask
from jaxspec.train.loop import check_data_parallel

SCRIPT = textwrap.dedent("""
    import contextlib, io, sys, tempfile
    from pathlib import Path
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    sys.path.insert(0, TESTS)
    from conftest import TINY
    import jaxspec
    from jaxspec.models.heads import Readout
    from jaxspec.models.llama import Llama
    from jaxspec.sharding import make_mesh, replicate
    from jaxspec.train import Batches, GenerationSettings, TrainConfig, WindowSpec, ensure_dataset, train
    from jaxspec.train.eagle import EagleTask, main as eagle_main
    from jaxspec.train.loop import TrainState, make_optimizer, make_train_step, place_batch
    from jaxspec.train.medusa import MedusaTask

    assert len(jax.devices()) == 8
    lm = jaxspec.LanguageModel.from_module(Llama(TINY, rngs=nnx.Rngs(0)), name="tiny")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, size=k).tolist() for k in rng.integers(4, 30, size=12)]  # as tests/test_train.py
    root = Path(tempfile.mkdtemp())
    data = ensure_dataset(lm, prompts, root / "data", sources={"random": 12},
                          settings=GenerationSettings(gen_tokens=24, gen_batch=4), progress=False)
    readout = Readout.of(lm.params)
    B = 8  # windows per step: 1 per device on (8, 1), 4 per "data" row on (2, 4)

    def same_losses(run, losses, what):
        np.testing.assert_allclose([h["loss"] for h in run.history], losses, rtol=1e-5, err_msg=what)

    def same_params(a, b, what):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5,
                                                             err_msg=what), a, b)

    def check_placement(batch, mesh):
        # Every leaf split by rows over "data" (B / data rows per device), whole over "model".
        data = mesh.shape["data"]
        for name, x in vars(place_batch(batch, mesh)).items():
            if x is None:  # layer_features: only EAGLE-3's data holds them
                continue
            assert x.sharding.is_equivalent_to(jax.NamedSharding(mesh, jax.P("data")), x.ndim), (name, x.sharding)
            assert {s.data.shape[0] for s in x.addressable_shards} == {B // data}, name
            assert len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated, name

    def check_compiled_step(task, config, batch, mesh):
        # The program itself takes the batch split and the state whole, and adds the gradients over devices.
        graphdef, params = nnx.split(task.new_head(lm.config, config.seed))
        tx = make_optimizer(config)
        state = TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))
        state, placed_readout = replicate((state, readout), mesh)
        step = make_train_step(graphdef, task, tx, config.seed, mesh)
        compiled = step.lower(state, placed_readout, place_batch(batch, mesh)).compile()
        (in_state, _, in_batch), _ = compiled.input_shardings
        assert all(s.spec == jax.P("data") for s in jax.tree.leaves(in_batch)), in_batch
        assert all(s.is_fully_replicated for s in jax.tree.leaves((in_state, compiled.output_shardings)))
        assert "all-reduce" in compiled.as_text()

    tasks = (("eagle", EagleTask(context=4, noise=0.05), 3e-3), ("medusa", MedusaTask(num_heads=3), 2e-2))
    for kind, task, lr in tasks:
        batches = Batches(data, WindowSpec(seq_len=16, context=task.context, lookahead=task.lookahead), B, seed=0)
        config = TrainConfig(steps=6, batch_size=B, seq_len=16, lr=lr, warmup_steps=2, save_every=3)
        single = train(task, lm.config, readout, batches, config, root / f"{kind}-single", progress=False)
        losses = [h["loss"] for h in single.history]
        for shape in ((8, 1), (2, 4)):
            mesh = make_mesh(*shape)
            check_placement(batches.batch(0), mesh)
            if kind == "eagle" and shape == (2, 4):
                check_compiled_step(task, config, batches.batch(0), mesh)
            run = train(task, lm.config, readout, batches, config, root / f"{kind}-{shape}", progress=False,
                        mesh=mesh)
            same_losses(run, losses, f"{kind} losses on {shape}")
            same_params(run.params, single.params, f"{kind} params on {shape}")
            for leaf in jax.tree.leaves(run.params):  # every device of the mesh holds the whole head
                assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8, leaf.sharding
        # Checkpoints carry over: 4 steps (checkpoint at 3) on a mesh, resumed on one device, and back.
        four = make_mesh(data=4)
        for first, then, name in ((four, None, "mesh-then-one"), (None, four, "one-then-mesh")):
            out = root / f"{kind}-{name}"
            train(task, lm.config, readout, batches, config, out, stop_after=4, progress=False, mesh=first)
            resumed = train(task, lm.config, readout, batches, config, out, progress=False, mesh=then)
            assert resumed.resumed_from == 3 and resumed.step == 6
            same_losses(resumed, losses[3:], f"{kind} {name}")
            same_params(resumed.params, single.params, f"{kind} {name}")
        print(kind, "OK", flush=True)

    try:  # a data axis that does not divide the batch, with real devices
        train(task, lm.config, readout, batches, TrainConfig(steps=2, batch_size=6, seq_len=16, warmup_steps=0),
              root / "bad", progress=False, mesh=make_mesh(data=4))
    except ValueError as e:
        assert "'data' of size 4 does not divide batch_size=6" in str(e), e
    else:
        raise AssertionError("no ValueError")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:  # the command line refuses it before loading anything
            eagle_main(["--data-parallel", "4", "--batch-size", "6"])
        except SystemExit as e:
            assert e.code == 2, e.code
        else:
            raise AssertionError("no SystemExit")
    assert "'data' of size 4 does not divide batch_size=6" in stderr.getvalue(), stderr.getvalue()
    print("errors OK")
""")


def test_data_parallel_training_equals_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    tests = str(Path(__file__).resolve().parent)
    result = subprocess.run([sys.executable, "-c", f"TESTS = {tests!r}\n" + SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.split() == ["eagle", "OK", "medusa", "OK", "errors", "OK"], result.stdout


def test_a_data_axis_that_does_not_divide_the_batch_is_a_value_error(tmp_path):
    # An abstract mesh has the axes and sizes of a real one without the devices this process lacks.
    mesh = AbstractMesh((4, 1), ("data", "model"))
    message = "mesh axis 'data' of size 4 does not divide batch_size=6"
    with pytest.raises(ValueError, match=message):
        check_data_parallel(mesh, 6)
    check_data_parallel(mesh, 8)
    config = TrainConfig(steps=2, batch_size=6, seq_len=16, warmup_steps=0)
    with pytest.raises(ValueError, match=message):  # before any model, data or checkpoint is touched
        train(EagleTask(context=4), None, None, None, config, tmp_path / "run", progress=False, mesh=mesh)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="no 'data' axis"):
        check_data_parallel(AbstractMesh((4,), ("batch",)), 8)


def test_cli_names_the_devices_it_lacks_and_how_to_make_them_on_cpu():
    assert data_parallel_mesh(1, 6) is None  # the default: no mesh, the single-device program
    n = len(jax.devices()) + 1
    with pytest.raises(ValueError, match=f"--data-parallel {n} needs {n} devices; there are {n - 1}") as info:
        data_parallel_mesh(n, 8 * n)
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count={n}" in str(info.value)
