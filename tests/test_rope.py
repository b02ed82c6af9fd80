"""Rotary scaling rules against values recorded from transformers' `ROPE_INIT_FUNCTIONS` (5.23.0).

Recorded with hidden_size 512, 8 heads (head_dim 64), rope_theta 10000; the numpy oracle in
reference_numpy.py covers linear and llama3 end to end, these pin yarn's frequencies and attention scale.
"""

import numpy as np
import pytest

from jaxspec.models.config import ModelConfig
from jaxspec.models.rope import inverse_frequencies

PICK = [0, 5, 10, 15, 20, 25, 31]
YARN_CASES = [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
     [1.0, 0.23713736, 0.04974558, 0.00794984, 0.00097301, 0.00018747, 3.334e-05], 1.138629436111989),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
      "beta_slow": 2.0},
     [1.0, 0.23713736, 0.05623413, 0.00944578, 0.00070273, 9.374e-05, 1.667e-05], 1.2079441541679836),
]


def _config(scaling):
    return ModelConfig.from_hf(dict(vocab_size=100, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=8, num_key_value_heads=8, rope_theta=10000.0,
                                    rope_scaling=scaling, max_position_embeddings=16384))


@pytest.mark.parametrize("scaling,expected,attention_scale", YARN_CASES)
def test_yarn_matches_transformers(scaling, expected, attention_scale):
    inv_freq, scale = inverse_frequencies(_config(scaling).rope, 64)
    np.testing.assert_allclose(inv_freq[PICK], expected, rtol=1e-5, atol=1e-8)  # recorded to 8 decimals
    assert scale == pytest.approx(attention_scale)


def test_unknown_rope_type_is_named():
    with pytest.raises(ValueError, match="rope_type='dynamo'"):
        _config({"rope_type": "dynamo", "factor": 2.0})
