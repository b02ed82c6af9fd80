"""The heads shipped for the default model (models/weights/), on the real SmolLM2-135M and held-out HumanEval
prompts: loadable by name, lossless (greedy and seeded sampling equal plain decoding token for token), and
trained (their acceptance is far above what an untrained head gets, which is about 1.0)."""

from __future__ import annotations

import pytest

import jaxspec
from jaxspec import SamplingParams, SpecConfig
from jaxspec.models.heads import named_head_path

pytestmark = pytest.mark.real_model

NEW_TOKENS = 48
# method settings -> the least mean acceptance length the shipped head must reach on these prompts (greedy);
# bench_heads.py measures the real figures on more prompts and tokens.
CONFIGS = {
    "medusa": (dict(method="medusa"), 1.4),
    "eagle": (dict(method="eagle"), 1.4),
    "eagle-static": (dict(method="eagle", num_speculative_tokens=15, tree_depth=5, tree_top_k=3), 1.5),
    "eagle2": (dict(method="eagle2"), 1.6),
    "eagle3": (dict(method="eagle3"), 1.6),
}


@pytest.fixture(scope="module")
def held_out(smollm2):
    from jaxspec.train.data import humaneval_split

    _, prompts = humaneval_split()
    return [smollm2.tokenizer.encode(p) for p in prompts[:2]]


@pytest.fixture(scope="module")
def plain(smollm2, held_out):
    return jaxspec.generate(smollm2, held_out, max_new_tokens=NEW_TOKENS)


def test_shipped_heads_are_found_by_name(smollm2):
    for kind in ("medusa", "eagle", "eagle3"):
        path = named_head_path(smollm2.name, kind)
        assert path.exists() and path.with_suffix(".json").exists()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shipped_head_greedy_equals_plain(smollm2, held_out, plain, name):
    kwargs, least = CONFIGS[name]
    out = jaxspec.generate(smollm2, held_out, max_new_tokens=NEW_TOKENS, spec=SpecConfig(**kwargs))
    assert out.token_ids == plain.token_ids
    assert out.stats.mean_acceptance_length >= least, out.stats.mean_acceptance_length


def test_shipped_tree_heads_follow_plain_sampling(smollm2, held_out):
    """Trees of top-k candidates verified by the point-mass rule replay plain sampling exactly."""
    sampling = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.8, top_p=0.9, seed=8)]
    ref = jaxspec.generate(smollm2, held_out, max_new_tokens=32, sampling=sampling)
    for kwargs in (dict(method="eagle2"), dict(method="medusa"), dict(method="eagle3")):
        out = jaxspec.generate(smollm2, held_out, max_new_tokens=32, sampling=sampling, spec=SpecConfig(**kwargs))
        assert out.token_ids == ref.token_ids, kwargs


def test_shipped_eagle3_head_on_a_chat_prompt(smollm2):
    """The EAGLE-3 head was trained on chat answers too: on a held-out task asked in a chat (the model's chat
    template) it stays lossless and its drafts are accepted."""
    from jaxspec.train.prompts import CHAT_REQUESTS, humaneval_split

    _, prompts = humaneval_split()
    ask = CHAT_REQUESTS[0].format(code=prompts[3])  # the benchmark's chat wording, about a held-out task
    chat = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
    plain = jaxspec.generate(smollm2, [chat], max_new_tokens=NEW_TOKENS)
    out = jaxspec.generate(smollm2, [chat], max_new_tokens=NEW_TOKENS, spec=SpecConfig(method="eagle3"))
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0 and out.stats.mean_acceptance_length >= 1.5, out.stats.mean_acceptance_length
