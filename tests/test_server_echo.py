"""`echo` and `prompt_logprobs` on `/v1/completions`, over real HTTP with the official `openai` client.

One server process (`python scripts/serve.py`, real SmolLM2 weights, tests/test_server.py's settings so the
compiled programs are shared) serves the module. An echoed choice's text is its prompt then the completion the
same request gives without echo; the prompt's log-probabilities equal `jaxspec.score` over the prompt's ids at
temperature 1.0, the first token's null; the generated part's equal the request's without echo. `max_tokens`
0 with echo returns the prompt alone; `prompt_logprobs` has vLLM's shape; a stream opens with the prompt; bad
values are 400s naming the field, and the server keeps serving after them. The scorer itself (on the tiny
random model) compiles once per power-of-two prompt width, and its padded values equal unpadded scores.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import jax
import numpy as np
import openai
import pytest

import jaxspec
import test_server as served
from contracts import programs_compiled
from jaxspec.serving.echo import PromptScorer

pytestmark = pytest.mark.real_model

MODEL = served.MODEL
server = served.server  # the fixtures: tests/test_server.py's server (its settings), here for this module alone
client = served.client

PROMPT = "def add(a, b):"
OTHER = "import numpy as"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def scored(smollm2) -> dict:
    """prompt -> (ids, its row of `jaxspec.score` on the host): PROMPT and OTHER scored together, unpadded past
    the longer one (a shape of their own, not the server's power-of-two width), at temperature 1.0 with the 5
    most likely tokens per position."""
    rows = [smollm2.tokenizer.encode(p) for p in (PROMPT, OTHER)]
    width = max(map(len, rows))
    res = jax.device_get(jaxspec.score(smollm2, [r + [0] * (width - len(r)) for r in rows],
                                       lengths=[len(r) for r in rows], temperature=1.0, top_logprobs=5))
    return {p: (ids, jax.tree.map(lambda a, i=i: a[i], res)) for i, (p, ids) in enumerate(zip((PROMPT, OTHER),
                                                                                             rows))}


def token_text(smollm2, token_id: int) -> str:
    return smollm2.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def check_prompt_logprobs(lp, n: int, ids, ref, smollm2, num_top: int) -> None:
    """The first n positions of the legacy `logprobs` `lp` are the prompt's: the first null, then the scored
    value, and the `num_top` most likely tokens plus the prompt's own."""
    assert lp.tokens[:n] == [token_text(smollm2, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    np.testing.assert_allclose(lp.token_logprobs[1:n], ref.logprobs[1:n], atol=1e-4)
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]
    for t in range(1, n):
        top = lp.top_logprobs[t]
        want = {token_text(smollm2, int(i)): float(v) for i, v in zip(ref.top_ids[t, :num_top],
                                                                      ref.top_logprobs[t, :num_top])}
        assert set(top) == set(want) | {lp.tokens[t]}
        for token, value in want.items():
            assert top[token] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_is_the_prompt_then_the_completion_with_scored_logprobs(client, smollm2, scored, stream):
    ids, ref = scored[PROMPT]
    n = len(ids)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3)
    plain = client.completions.create(**kwargs)
    if stream:
        chunks = [c for c in client.completions.create(stream=True, echo=True, **kwargs) if c.choices]
        first = chunks[0].choices[0]
        assert first.text == PROMPT and first.finish_reason is None  # the stream opens with the prompt
        assert first.logprobs.tokens == [token_text(smollm2, t) for t in ids]
        text = "".join(c.choices[0].text for c in chunks)
        parts = [c.choices[0].logprobs for c in chunks]
        lp = SimpleNamespace(**{k: [x for p in parts for x in getattr(p, k)]
                                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")})
    else:
        r = client.completions.create(echo=True, **kwargs)
        text, lp = r.choices[0].text, r.choices[0].logprobs
        assert r.usage == plain.usage and r.choices[0].finish_reason == plain.choices[0].finish_reason
    assert text == PROMPT + plain.choices[0].text
    check_prompt_logprobs(lp, n, ids, ref, smollm2, 3)
    # The generated part is the request's without echo, its text offsets after the prompt's text.
    gen = plain.choices[0].logprobs
    assert lp.tokens[n:] == gen.tokens
    np.testing.assert_allclose(lp.token_logprobs[n:], gen.token_logprobs, atol=1e-4)
    assert lp.text_offset[n:] == [len(PROMPT) + o for o in gen.text_offset]
    assert [set(t) for t in lp.top_logprobs[n:]] == [set(t) for t in gen.top_logprobs]


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_returns_the_prompt_alone(client, smollm2, scored, stream):
    ids, ref = scored[PROMPT]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        lp, finish = chunks[0].choices[0].logprobs, chunks[-1].choices[0].finish_reason
        assert all(c.choices[0].logprobs.tokens == [] for c in chunks[1:])
    else:
        r = client.completions.create(**kwargs)
        text, lp, finish = r.choices[0].text, r.choices[0].logprobs, r.choices[0].finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    assert text == PROMPT and finish == "length"
    assert len(lp.tokens) == len(ids)
    check_prompt_logprobs(lp, len(ids), ids, ref, smollm2, 2)


def test_prompt_logprobs_have_vllm_shape(client, smollm2, scored):
    ids, ref = scored[OTHER]
    r = client.completions.create(model=MODEL, prompt=OTHER, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    choice = r.choices[0]
    assert choice.text and choice.logprobs is None  # no echo: the text is the completion alone
    got = choice.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
        entry, actual = got[t], str(ids[t])
        assert actual in entry and len(entry) in (2, 3)
        own = entry[actual]
        assert own["logprob"] == pytest.approx(float(ref.logprobs[t]), abs=1e-4)
        assert own["rank"] == int(ref.ranks[t]) >= 1 and own["decoded_token"] == token_text(smollm2, ids[t])
        for rank, (i, v) in enumerate(zip(ref.top_ids[t, :2].tolist(), ref.top_logprobs[t, :2].tolist()), 1):
            assert entry[str(i)]["logprob"] == pytest.approx(v, abs=1e-4)
            assert entry[str(i)]["rank"] == (own["rank"] if str(i) == actual else rank)
        assert (own["rank"] <= 2) == (actual in map(str, ref.top_ids[t, :2].tolist()))
    zero = client.completions.create(model=MODEL, prompt=OTHER, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert [None if e is None else list(e) for e in zero.choices[0].prompt_logprobs] == \
        [None] + [[str(i)] for i in ids[1:]]


def test_each_choice_echoes_its_own_prompt(client, smollm2):
    ids = smollm2.tokenizer.encode(OTHER)
    r = client.completions.create(model=MODEL, prompt=[PROMPT, OTHER], n=2, max_tokens=3, temperature=0.8, seed=3,
                                  echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(p) for c, p in zip(r.choices, [PROMPT, PROMPT, OTHER, OTHER])] == [True] * 4
    as_ids = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True)
    assert as_ids.choices[0].text == smollm2.tokenizer.decode(ids, skip_special_tokens=True)


BAD = [
    ({"echo": "yes"}, "echo"),
    ({"echo": 1}, "echo"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
]


def test_bad_values_get_400_naming_the_field_and_the_server_keeps_serving(server, client):
    for change, param in BAD:
        r = httpx.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                                 **change}, timeout=60)
        assert r.status_code == 400, (change, r.text)
        assert r.json()["error"]["param"] == param, change
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"prompt_logprobs": 1})
    assert e.value.param == "prompt_logprobs"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and r.usage.completion_tokens == 2


@pytest.mark.contract
def test_prompt_scoring_compiles_once_per_width_and_padding_changes_nothing(tiny_lm, caplog):
    engine = SimpleNamespace(lm=tiny_lm, config=SimpleNamespace(max_logprobs=20), max_context=256)  # what it reads
    scorer = PromptScorer(engine, token_text=None)
    ids = np.random.default_rng(0).integers(0, tiny_lm.config.vocab_size, size=40).tolist()
    for n, new_programs in ((3, None), (9, 0), (16, 0), (17, 1), (32, 0)):
        scored = []
        compiled = programs_compiled(caplog, lambda n=n, out=scored: out.append(scorer.score(ids[:n], with_top=True)))
        got = scored[0]
        if new_programs is not None:
            assert compiled.get("score_arrays", 0) == new_programs, n
        want = jax.device_get(jaxspec.score(tiny_lm, [ids[:n]], top_logprobs=scorer.top_width))  # unpadded
        np.testing.assert_allclose(got.logprobs, want.logprobs[0, 1:], atol=1e-5)
        np.testing.assert_allclose(got.top_logprobs, want.top_logprobs[0, 1:], atol=1e-5)
        assert got.ranks.tolist() == want.ranks[0, 1:].tolist()
