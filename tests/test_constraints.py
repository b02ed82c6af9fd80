"""jaxspec.constraints: specs, compilation over SmolLM2's vocabulary, and the device automaton's functions.

The reference is outlines-core itself: an Index built here over a vocabulary built here (each token's bytes),
walked beside the device automaton. Walks that end at EOS must decode, with jaxspec's tokenizer, to text the
regex matches (JSON the schema validates). Every device function runs jitted.
"""

from __future__ import annotations

import json
import re
import time

import gguf
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import outlines_core
import pytest

import jaxspec
from jaxspec.constraints import (
    DEAD,
    FREE,
    INITIAL,
    Choice,
    JsonSchema,
    Regex,
    advance,
    advance_many,
    allowed_mask,
    compile_constraint,
    forced_token,
    is_final,
    mask_logits,
    stack,
    states_along,
)
from jaxspec.constraints.automaton import check_key_range
from jaxspec.constraints.jump import first_piece
from jaxspec.models.loading import gguf_config, named_model_path
from jaxspec.models.tokenizer import Tokenizer

DATE = Regex(r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")
EMAIL = Regex(r"[a-z0-9._]{1,12}@[a-z]{2,10}\.(com|org|net)")
CHOICE = Choice(["yes", "no", "maybe so", "a.b+c", "(x|y)"])  # meta characters are escaped
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "ok"],
}
ONE_KEY = JsonSchema({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                     whitespace="")

mask_j = jax.jit(allowed_mask)
advance_j = jax.jit(advance)
forced_j = jax.jit(forced_token)
final_j = jax.jit(is_final)


@pytest.fixture(scope="module")
def tok_and_vocab(default_model_installed):
    """SmolLM2's tokenizer and the model's vocab_size, read from the GGUF without loading the weights."""
    reader = gguf.GGUFReader(str(named_model_path(jaxspec.DEFAULT_MODEL)))
    return Tokenizer.from_gguf(reader), gguf_config(reader).vocab_size


@pytest.fixture(scope="module")
def tok(tok_and_vocab):
    return tok_and_vocab[0]


@pytest.fixture(scope="module")
def vocab(tok_and_vocab):
    return tok_and_vocab[1]


@pytest.fixture(scope="module")
def reference_vocabulary(tok):
    """outlines-core's vocabulary of the tokenizer, built independently of jaxspec.constraints.compile."""
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    tokens: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i not in special:
            tokens.setdefault(tok.token_bytes(i), []).append(i)
    return outlines_core.Vocabulary(tok.eos_token_id, tokens)


def _s(x) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def _host(aut):
    """(src, token, next, final) of the automaton's pairs, as numpy."""
    keys = np.asarray(aut.keys).astype(np.int64)
    real = keys < aut.num_states * aut.vocab_size
    keys = keys[real]
    return keys // aut.vocab_size, keys % aut.vocab_size, np.asarray(aut.next)[real], np.asarray(aut.final)


def _finishing_walk(aut, rng, explore: int, eos: tuple[int, ...]) -> list[int]:
    """A random path through legal tokens from INITIAL: `explore` uniformly random non-EOS steps, then steps
    that bring a final state strictly closer, then an EOS. Checked against the device mask on the way."""
    src, token, nxt, final = _host(aut)
    dist = np.where(final, 0, 1 << 30)
    for _ in range(len(final)):  # distance (in tokens) to a final state
        new = dist.copy()
        np.minimum.at(new, src, dist[nxt] + 1)
        if np.array_equal(new, dist):
            break
        dist = new
    state, path = INITIAL, []
    for step in range(200):
        here = (src == state) & ~np.isin(token, eos)
        if step >= explore:
            if final[state] and (rng.random() < 0.5 or not (here & (dist[nxt] < dist[state])).any()):
                break
            here &= dist[nxt] < dist[state]
        if not here.any():
            break
        pick = int(rng.choice(np.flatnonzero(here)))
        assert bool(mask_j(aut, _s(state))[token[pick]])
        path.append(int(token[pick]))
        state = int(advance_j(aut, _s(state), _s(token[pick])))
        assert state == nxt[pick]
    assert final[state] and bool(final_j(aut, _s(state)))
    end = int(rng.choice(eos))
    assert bool(mask_j(aut, _s(state))[end]) and int(advance_j(aut, _s(state), _s(end))) == state
    return path + [end]


def _text(tok, path: list[int]) -> str:
    """The text of a walk (its EOS dropped): the tokens' bytes, which must be UTF-8, equal to tok.decode."""
    ids = path[:-1]
    data = b"".join(tok.token_bytes(i) for i in ids)
    text = data.decode("utf-8")  # strict: a complete match is whole characters
    assert tok.decode(ids) == text
    return text


# ------------------------------------------------------------------------------------------------------ specs


def test_specs_are_canonical_hashable_and_give_their_regex():
    a = JsonSchema(SCHEMA)
    b = JsonSchema(json.dumps(SCHEMA, indent=2))
    assert a == b and hash(a) == hash(b) and isinstance(a.schema, str) and " " not in a.schema
    assert JsonSchema(SCHEMA, whitespace="") == a  # minified JSON is the default
    spaced = JsonSchema(SCHEMA, whitespace=r"[ ]?")
    assert spaced != a
    assert Regex("a+").regex() == "a+"
    assert Choice(["a.b", "c"]).regex() == r"(a\.b|c)" and Choice(("x",)) == Choice(["x"])
    assert '"name"' in a.regex() and "[ ]?" in spaced.regex() and "[ ]?" not in a.regex()


@pytest.mark.parametrize("make, named", [
    (lambda: Regex(3), "3"),
    (lambda: JsonSchema("{not json"), "{not json"),
    (lambda: JsonSchema([1, 2]), "[1, 2]"),
    (lambda: JsonSchema({"type": "string"}, whitespace=3), "3"),
    (lambda: Choice([]), "empty"),
    (lambda: Choice("yes"), "yes"),
    (lambda: Choice(["ok", 7]), "7"),
])
def test_invalid_specs_raise_value_errors_naming_them(make, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        make()


@pytest.mark.parametrize("spec, named", [
    (Regex("(ab"), "(ab"),
    (Regex(r"\bword"), r"\bword"),
    (JsonSchema({"type": "nonsense"}), "nonsense"),
    (JsonSchema({"type": "string"}, whitespace="(["), "(["),
])
def test_specs_outlines_core_refuses_raise_value_errors_naming_them_when_compiled(tok, vocab, spec, named):
    """Whether outlines-core takes a regex or schema is learnt when it compiles (a spec is made in
    milliseconds), in the worker, and the error names the spec."""
    with pytest.raises(ValueError, match=re.escape(named)):
        compile_constraint(spec, tok, vocab)


def test_compile_errors(tok, vocab):
    with pytest.raises(ValueError, match="spec must be"):
        compile_constraint("a+", tok, vocab)
    with pytest.raises(ValueError, match="vocab_size=100"):
        compile_constraint(Regex("a+"), tok, 100)
    with pytest.raises(ValueError, match="overflow int32"):
        check_key_range(2**31 // vocab + 1, vocab)
    check_key_range(2**31 // vocab - 1, vocab)


# -------------------------------------------------------------------------------------- against outlines-core


@pytest.mark.parametrize("spec", [EMAIL, CHOICE, JsonSchema(SCHEMA)], ids=["regex", "choice", "schema"])
def test_mask_and_advance_equal_outlines_core_on_random_walks(tok, vocab, reference_vocabulary, spec):
    aut = compile_constraint(spec, tok, vocab)
    index = outlines_core.Index(spec.regex(), reference_vocabulary)
    aliases = set(tok.eos_token_ids)  # every end id is legal where outlines-core's EOS is
    rng = np.random.default_rng(0)
    for _ in range(6):
        ref, state = index.get_initial_state(), INITIAL
        for _ in range(24):
            ours = np.asarray(mask_j(aut, _s(state)))
            assert ours.shape == (vocab,)
            final = index.is_final_state(ref)
            expect = set(index.get_allowed_tokens(ref)) | (aliases if final else set())
            assert set(np.flatnonzero(ours).tolist()) == expect
            assert bool(final_j(aut, _s(state))) == final
            only = set(index.get_allowed_tokens(ref))
            assert int(forced_j(aut, _s(state))) == (only.pop() if len(only) == 1 else -1)
            illegal = int(rng.choice(np.flatnonzero(~ours)))
            assert int(advance_j(aut, _s(state), _s(illegal))) == DEAD
            choices = sorted(expect - aliases)
            if not choices:
                break
            token = int(rng.choice(choices))
            ref, state = index.get_next_state(ref, token), int(advance_j(aut, _s(state), _s(token)))
            assert ref is not None and state >= 0


@pytest.mark.parametrize("spec", [DATE, EMAIL, CHOICE], ids=["date", "email", "choice"])
def test_walks_to_eos_decode_to_matches_of_the_regex(tok, vocab, spec):
    aut = compile_constraint(spec, tok, vocab)
    rng = np.random.default_rng(1)
    seen = set()
    for n in range(25):
        text = _text(tok, _finishing_walk(aut, rng, explore=n % 6, eos=tok.eos_token_ids))
        assert re.fullmatch(spec.regex(), text), text
        seen.add(text)
    if spec is CHOICE:
        assert seen <= set(CHOICE.options) and len(seen) >= 3


@pytest.mark.parametrize("whitespace", [r"[ ]?", ""])
def test_schema_walks_decode_to_valid_json(tok, vocab, whitespace):
    spec = JsonSchema(SCHEMA, whitespace=whitespace)
    aut = compile_constraint(spec, tok, vocab)
    rng = np.random.default_rng(2)
    for n in range(20):
        text = _text(tok, _finishing_walk(aut, rng, explore=n % 12, eos=tok.eos_token_ids))
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == ["name", "age", "color", "ok"] and re.fullmatch(spec.regex(), text)
        if not whitespace:
            assert " " not in text.replace(value["name"], "")


def test_forced_tokens_of_a_one_key_schema(tok, vocab):
    aut = compile_constraint(ONE_KEY, tok, vocab)

    def after(text: str) -> int:
        state = INITIAL
        for i in tok.encode(text):
            state = int(advance_j(aut, _s(state), _s(i)))
        assert state >= 0, text
        return state

    def forced(text: str) -> str | None:
        f = int(forced_j(aut, _s(after(text))))
        return None if f < 0 else tok.decode([f])

    assert forced("") is None  # `{` or `{"`
    assert forced("{") == '"'  # no token starts with `"n`: the key's quote is forced
    assert forced('{"') is None  # `n`, `na`, `name`, ...: several tokenizations of the key
    assert tok.encode('{"nam') == [tok.token_to_id('{"'), tok.token_to_id("nam")] and forced('{"nam') == "e"
    assert forced('{"name":"hi"') == "}"
    end = after('{"name":"hi"}')
    assert int(forced_j(aut, _s(end))) == tok.eos_token_id and bool(final_j(aut, _s(end)))
    assert not bool(final_j(aut, _s(after('{"name":"hi"'))))

    # Forced *text*: after `{"` the key is not one forced token, but `name":"` is the only text that may follow,
    # and its first token as the tokenizer writes it is drafted (jump-forward).
    def jump(text: str) -> str | None:
        j = int(jaxspec.constraints.jump_token(aut, _s(after(text))))
        return None if j < 0 else tok.decode([j])

    assert jump('{"') == tok.decode(tok.encode('name":"')[:1])
    assert jump('{"name":"hi') is None  # inside a free string nothing is forced
    # The key's end is drafted as `":` (the token spaced JSON has there), not the tokenizer's own `":"`, and the
    # string's opening quote after it, which no single token forces (`"h`, `"hi`, ... are all legal), is drafted.
    assert tok.encode('":"') == [tok.token_to_id('":"')] and jump('{"name') == '":'
    assert forced('{"name":') is None and jump('{"name":') == '"'


def test_forced_text_is_drafted_in_pieces_that_end_at_separators():
    assert first_piece(b'":"') == b'":'
    assert first_piece(b'","age":') == b'",'
    assert first_piece(b'name') == b'name'
    assert first_piece(b'') == b''


# ------------------------------------------------------------------------------------------- device semantics


def test_free_and_dead(tok, vocab):
    aut = compile_constraint(CHOICE, tok, vocab)
    yes = tok.encode("yes")[0]
    assert np.asarray(mask_j(aut, _s([FREE, DEAD, aut.num_states]))).all()
    assert not np.asarray(mask_j(aut, _s(INITIAL))).all()
    logits = jnp.zeros((3, vocab))
    masked = jax.jit(mask_logits)(aut, _s([INITIAL, FREE, DEAD]), logits)
    assert np.isfinite(np.asarray(masked)).sum(-1).tolist() == [int(mask_j(aut, _s(INITIAL)).sum()), vocab, vocab]
    tokens = _s([yes, -1, vocab, vocab + 5, tok.encode("zzz")[0]])
    assert np.asarray(advance_j(aut, _s(FREE), tokens)).tolist() == [FREE] * 5
    assert np.asarray(advance_j(aut, _s(DEAD), tokens)).tolist() == [DEAD] * 5
    assert np.asarray(advance_j(aut, _s(INITIAL), tokens)).tolist()[1:] == [DEAD] * 4
    assert int(advance_j(aut, _s(INITIAL), _s(yes))) >= 0
    assert int(advance_j(aut, _s(aut.num_states + 3), _s(yes))) == DEAD
    assert np.asarray(forced_j(aut, _s([FREE, DEAD]))).tolist() == [-1, -1]
    assert np.asarray(final_j(aut, _s([FREE, DEAD, INITIAL]))).tolist() == [True, False, False]


def test_ids_beyond_the_tokenizer_are_never_legal(tok, vocab):
    wide = vocab + 40  # a model vocabulary padded past the tokenizer's ids
    aut = compile_constraint(Regex("[a-z ]+"), tok, wide)
    masks = np.asarray(mask_j(aut, _s([INITIAL, FREE])))
    assert masks.shape == (2, wide) and not masks[0, vocab:].any() and masks[1].all()
    assert int(advance_j(aut, _s(INITIAL), _s(wide - 1))) == DEAD
    with pytest.raises(ValueError, match="one vocab_size"):
        stack([aut, compile_constraint(Regex("[a-z ]+"), tok, vocab)])


def test_stack_rows_equal_each_automaton_alone(tok, vocab):
    a, b = compile_constraint(DATE, tok, vocab), compile_constraint(JsonSchema(SCHEMA), tok, vocab)
    both, initial = stack([a, None, b, a])
    assert initial[1] == FREE and initial[0] == initial[3] and initial[0] != initial[2]
    assert both.num_states & (both.num_states - 1) == 0 and both.num_edges & (both.num_edges - 1) == 0
    assert stack([a, a, None], pad=False)[0].num_states == a.num_states
    assert stack([a, b], pad=False)[0].num_states == a.num_states + b.num_states
    rng = np.random.default_rng(3)
    eos = tok.eos_token_ids
    walks = [_finishing_walk(a, rng, 3, eos), None, _finishing_walk(b, rng, 8, eos), _finishing_walk(a, rng, 1, eos)]
    alone = [a, None, b, a]
    state = initial
    own = [INITIAL, FREE, INITIAL, INITIAL]
    for t in range(max(len(w) for w in walks if w)):
        masks = np.asarray(mask_j(both, state))
        for r, aut in enumerate(alone):
            expect = np.ones(vocab, bool) if aut is None else np.asarray(mask_j(aut, _s(own[r])))
            assert np.array_equal(masks[r], expect), (r, t)
            if aut is not None:
                assert int(forced_j(both, state[r])) == int(forced_j(aut, _s(own[r])))
                assert bool(final_j(both, state[r])) == bool(final_j(aut, _s(own[r])))
        step = [w[t] if w and t < len(w) else 7 for w in walks]  # 7: past a walk's end, an illegal token
        state = advance_j(both, state, _s(step))
        own = [FREE if aut is None else int(advance_j(aut, _s(own[r]), _s(step[r]))) for r, aut in enumerate(alone)]
        assert [int(s) < 0 for s in state] == [s < 0 for s in own]
    # A stacked automaton stacked again (its padding pairs dropped, not shifted): its entry starts at its state 0.
    again, start = stack([both, a], pad=False)
    assert start.tolist() == [0, both.num_states] and again.num_states == both.num_states + a.num_states
    pair = _s([initial[0], INITIAL])
    for token in walks[0]:
        assert np.array_equal(np.asarray(mask_j(again, start)), np.asarray(mask_j(both, pair)))
        start, pair = advance_j(again, start, _s(token)), advance_j(both, pair, _s(token))
        assert np.asarray(start - pair).tolist() == [0, both.num_states - initial[0]]


def test_stack_of_nothing_is_free(vocab):
    aut, initial = stack([None, None], vocab_size=vocab)
    assert initial.tolist() == [FREE, FREE]
    assert np.asarray(mask_j(aut, initial)).all()
    assert np.asarray(advance_j(aut, initial, _s([3, 5]))).tolist() == [FREE, FREE]
    with pytest.raises(ValueError, match="vocab_size"):
        stack([None])


def test_advance_many_and_states_along(tok, vocab):
    a = compile_constraint(EMAIL, tok, vocab)
    both, initial = stack([a, None, a, a, a])
    rng = np.random.default_rng(4)
    walk = _finishing_walk(a, rng, 5, tok.eos_token_ids)[:6]
    walk += [walk[-1]] * (6 - len(walk))
    tokens = np.array([walk, walk, walk[:3] + [-1, 5, 6], walk, walk], np.int32)  # row 2 goes DEAD at 3
    num = _s([6, 4, 6, 0, 2])
    out = jax.jit(advance_many)(both, initial, _s(tokens), num)
    path = jax.jit(states_along)(both, initial, _s(tokens))
    assert path.shape == (5, 7)
    for r in range(5):
        state = initial[r]
        for t in range(7):
            assert int(path[r, t]) == int(state)
            if t < 6:
                state = advance_j(both, state, _s(tokens[r, t]))
        assert int(out[r]) == int(path[r, int(num[r])])
    assert int(out[1]) == FREE and int(out[2]) == DEAD and int(out[3]) == int(initial[3])
    # A tree: node 1 under the root, nodes 2 and 3 under node 1 (siblings), node 4 under node 3.
    first, second = walk[0], walk[1]
    tree = jax.jit(states_along)(both, initial[:1], _s([[first, second, 7, second]]), _s([[0, 1, 1, 3]]))
    chain = path[0]
    assert tree[0, :3].tolist() == chain[:3].tolist()
    assert int(tree[0, 3]) == DEAD and int(tree[0, 4]) == DEAD  # 7 is illegal; its child stays DEAD


def test_jit_equals_eager(tok, vocab):
    a, b = compile_constraint(EMAIL, tok, vocab), compile_constraint(CHOICE, tok, vocab)
    both, initial = stack([a, b, None])
    state = jnp.concatenate([initial, _s([DEAD])])
    tokens = _s([[tok.encode("bob")[0], tok.encode("yes")[0], 9, 9], [10, 11, 12, 13], [1, 2, 3, 4], [5, 6, 7, 8]])
    num = _s([1, 1, 3, 2])
    for f, args in [(allowed_mask, (both, state)), (advance, (both, state, tokens[:, 0])),
                    (advance_many, (both, state, tokens, num)), (forced_token, (both, state)),
                    (is_final, (both, state)), (states_along, (both, state, tokens))]:
        assert np.array_equal(np.asarray(f(*args)), np.asarray(jax.jit(f)(*args))), f.__name__


def test_compile_is_cached(tok, vocab):
    spec = Regex(r"[0-9]{3}-[a-z]{2}")
    first = compile_constraint(spec, tok, vocab)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        again = compile_constraint(Regex(r"[0-9]{3}-[a-z]{2}"), tok, vocab)
        times.append(time.perf_counter() - start)
        assert again is first
    assert min(times) < 1e-3
    assert compile_constraint(spec, tok, vocab + 32) is not first
