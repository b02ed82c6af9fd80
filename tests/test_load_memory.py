"""Loading a sharded Hugging Face checkpoint holds the model and about one tensor beside it, not a second copy.

The checkpoint is written here shard by shard (random float32 weights, a Llama layout without tied embeddings,
so the model holds exactly the checkpoint's bytes), and loaded in a fresh process, whose peak resident memory
above what it held before `load_model` must stay within 1.3x the parameter bytes. The writer and the measurement
are the load benchmark's (scripts/benchkit/load.py). The default run loads a quarter of a billion parameters,
onto one device and onto a mesh of 8 forced CPU devices that split every matrix (each tensor goes from the file to
its devices' shards, never whole to one device first, scanned or unrolled); `-m slow` runs the one-device load at
1.5 billion (Llama-3.2-1B's shapes with an untied head).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent / "scripts"))  # benchkit, as tests/test_benchkit.py

from benchkit.load import SHAPES, measure_load, write_checkpoint  # noqa: E402

LIMIT = 1.3  # peak resident bytes above the process's own, per parameter byte


@pytest.fixture(scope="module")
def quarter_billion(tmp_path_factory):
    """(path, parameter bytes) of a quarter of a billion float32 parameters in 3 files."""
    path = tmp_path_factory.mktemp("quarter_billion")
    size = write_checkpoint(path, **SHAPES["250m"], shards=3)
    assert size > 10**9
    return path, size


def test_a_sharded_checkpoint_loads_without_a_second_copy(quarter_billion):
    ratio = measure_load(*quarter_billion)["ratio"]
    assert ratio <= LIMIT, f"peak resident memory {ratio:.2f}x the parameter bytes"


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_a_sharded_checkpoint_loads_onto_a_mesh_without_a_second_copy(quarter_billion, layer_loop):
    """Loading whole onto one device and placing it then (`LanguageModel.on_mesh`) peaks near 2.6x unrolled and
    3.4x scanned: the whole model, its re-laid-out copy and the shards."""
    ratio = measure_load(*quarter_billion, way="mesh", layer_loop=layer_loop)["ratio"]
    assert ratio <= LIMIT, f"peak resident memory {ratio:.2f}x the parameter bytes ({layer_loop}, 1x8 mesh)"


@pytest.mark.slow
def test_a_billion_parameter_checkpoint_loads_within_its_bytes(tmp_path):
    size = write_checkpoint(tmp_path, **SHAPES["1b"], shards=3)
    assert size > 5 * 10**9  # 1.5 billion float32 parameters
    ratio = measure_load(tmp_path, size)["ratio"]
    assert ratio <= LIMIT, f"peak resident memory {ratio:.2f}x the parameter bytes"
