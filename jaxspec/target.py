"""The target model contract: what the decode loop needs from the model whose drafts it verifies.

jaxspec ships a Llama-family decoder (`jaxspec.models.llama.Llama`), but the loop does not depend on it: any
Flax NNX module with the attributes and the forward described here can be wrapped with
`jaxspec.LanguageModel.from_module` and decoded plainly or speculatively. The contract has tiers:

- `TargetModel`, the core every method needs (`none`, `ngram`, `sam`, `draft_model`, `custom` need only
  this): `cfg.vocab_size`, `cfg.max_position_embeddings`, `new_cache`, and the forward
  `model(tokens, positions, cache, *, logits_at, compute_logits, attention_impl, cached_slots)` that writes the
  new tokens' K/V at each row's cache length without advancing it;
- tree drafts (`medusa`, `eagle`, `eagle2`, `eagle3`, custom proposers that draft trees): the forward also takes
  `tree_mask`;
- `SelfDraftTarget` (`self_draft`): a dataclass config with `num_layers`, the blocks as `layers`, and a
  class that builds itself from a config, so the first N layers become a draft sharing the target's arrays;
- `HeadTarget` (`medusa`, `eagle`, `eagle2`, `eagle3`): the final hidden state as `output.hidden`, `cfg.hidden_size`,
  and the token embedding and LM head as the parameters `embed` [V, D] and `lm_head` [D, V] (`Readout.of`);
  EAGLE's head is one Llama decoder layer sized from the target's config, so `eagle`/`eagle2`/`eagle3` also need the
  fields in `EAGLE_CONFIG_FIELDS`;
- layer features (`eagle3`): the forward also takes `return_layers` (a static tuple of decoder layer indices)
  and returns those layers' outputs [B, T, D] as `output.layer_hidden`, and `cfg.num_layers` says how many
  layers there are to choose from.

`check_target(model, method)` checks a model against the tiers a method needs and raises a ValueError naming
what is missing and the method that needs it. `LanguageModel.from_module` runs it for the core contract;
`self_draft_model` and the head loaders (`jaxspec.models.heads`) run their tier's part. The prose version is
docs/concepts/model-contract.md; examples/custom_model.py is a GPT-2-style model that follows it.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import types
from typing import Any, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from .cache import KVCache
from .methods import get
from .models.config import RopeConfig

# Config fields every target needs, and why (the reason goes into the error message).
CORE_CONFIG_FIELDS: Mapping[str, str] = types.MappingProxyType({
    "vocab_size": "the width V of the logits; prompts, drafts and stop ids are checked against [0, V)",
    "max_position_embeddings": "the context length; generate and the engine keep every row's tokens within it",
})
# Keyword arguments the loop passes to the forward (prefill, verification, a draft model's drafting).
CORE_FORWARD_KEYWORDS: Mapping[str, str] = types.MappingProxyType({
    "logits_at": "prefill and a draft model ask for logits at one position per row (i32[B, L])",
    "compute_logits": "a draft model's prefill asks for no logits at all",
    "attention_impl": "verification passes 'xla' or 'pallas' (a hint: a model may always use its own attention)",
    "cached_slots": "prefill passes 0 (an empty cache: attend to the new tokens only); None elsewhere",
})
TREE_KEYWORD = "tree_mask"  # bool[B, T, T]: which new tokens each new token sees (a draft tree's ancestors)
LAYERS_KEYWORD = "return_layers"  # tuple[int, ...]: decoder layers whose outputs come back as output.layer_hidden
# Config fields the EAGLE head reads: it is one Llama decoder layer (`jaxspec.models.llama.DecoderLayer`) built
# from the target's config, with `dataclasses.replace(cfg, dtype="float32")`.
EAGLE_CONFIG_FIELDS: tuple[str, ...] = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                                        "rms_norm_eps", "rope", "attention_bias", "dtype", "jnp_dtype", "q_per_kv")

class TargetConfig(Protocol):
    """The static config a target carries as `cfg`: hashable (a frozen dataclass), because the model's graph
    definition is a static jit argument and the config is part of every compiled program's identity."""

    vocab_size: int  # V: logits are f32[..., V]; token ids are in [0, V)
    max_position_embeddings: int  # the context length in tokens


class TargetOutput(Protocol):
    """What the forward returns beside the cache (`jaxspec.models.llama.ModelOutput` is one)."""

    logits: jax.Array | None  # f32[B, L, V]  L = T, or logits_at.shape[1]; None only when compute_logits=False
    # [B, T, D] the final hidden state at every new token, logits_at or not (heads: logits == hidden @ lm_head)
    hidden: jax.Array
    # ([B, T, D], ...) the outputs of the decoder layers the forward's `return_layers` names, in layer order
    # (eagle3 only; a model serving no eagle3 head may leave it out)


class TargetModel(Protocol):
    """The core contract: what prefill, verification, logprobs and a draft model's drafting call on a model.

    The model is an `nnx.Module`; jitted code takes it as `nnx.merge(graphdef, params)`, so it must keep every
    array in NNX state and everything else static.
    """

    cfg: TargetConfig

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for `batch` rows of `max_len` slots: `lengths` i32[batch] zeros and one k and one v
        buffer per layer, each [batch, H, max_len, hd] (any H, hd and dtype; the slot axis is axis 2, where a
        tree's accepted path is moved to contiguous slots)."""
        ...

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]  new tokens (in [0, V): the loop replaces out-of-vocabulary drafts)
        positions: jax.Array,  # i32[B, T]  their positions: lengths + t for a chain, lengths + depth for a tree
        cache: KVCache,  # slots below cache.lengths[b] hold row b's committed K/V
        *,
        tree_mask: jax.Array | None = None,  # bool[B, T, T]  who sees whom among the new tokens; None: causal
        logits_at: jax.Array | None = None,  # i32[B, L]  new-token indices to compute logits at; None: all T
        compute_logits: bool = True,  # False: logits may be None (a draft model's prefill)
        attention_impl: str = "xla",  # "xla" or "pallas": a hint; any correct attention will do
        cached_slots: int | None = None,  # static bound on cache.lengths (0: empty cache); None: unknown
    ) -> tuple[TargetOutput, KVCache]:
        """Run T new tokens per row and return (output, cache with their K/V written).

        New token t of row b attends to the committed slots `< cache.lengths[b]` and to the new tokens before
        it (or those `tree_mask[b, t]` marks); its K/V go to slot `cache.lengths[b] + t`, whatever its position,
        and are dropped where that slot lies past the cache's end (`jaxspec.cache.write_new`: never clamped back).
        The returned cache has the same structure, shapes and dtypes, and the *same* `lengths`: the caller
        commits by advancing them, so a rejected draft's K/V is simply overwritten later. Slots past a row's
        length hold stale values that must get exactly zero attention. Padding and finished rows feed tokens
        at positions up to the cache size, possibly past `max_position_embeddings`: the model must return
        finite values there too (clip a learned position table's index), since a NaN K/V would reach later
        steps through masked attention (0 * NaN).
        """
        ...


class SelfDraftConfig(TargetConfig, Protocol):
    """A config `self_draft` can shrink: a dataclass with an integer field `num_layers`."""

    num_layers: int  # decoder layers; self_draft keeps the first self_draft_layers of them


class SelfDraftTarget(TargetModel, Protocol):
    """`self_draft`: the target's first N layers plus everything that is not a layer (embeddings, final norm,
    LM head) form the draft, sharing the target's arrays.

    The draft is `type(model)(dataclasses.replace(cfg, num_layers=N), rngs=...)` (built abstractly, never
    initialised) filled with the target's parameters: `params["layers"][0..N-1]` and every other top-level
    entry. So the class builds itself from a config alone, `num_layers` changes nothing but the layer count,
    and the forward runs the layers in order between the shared input and output ends.
    """

    cfg: SelfDraftConfig
    layers: Sequence[Any]  # an nnx.List of cfg.num_layers blocks applied in order (or one stacked block: a scan)


class HeadConfig(TargetConfig, Protocol):
    """A config the trained heads can be sized from."""

    hidden_size: int  # D: the width of `TargetOutput.hidden`, of the heads' features and of `embed`/`lm_head`


class HeadTarget(TargetModel, Protocol):
    """`medusa`, `eagle`, `eagle2`, `eagle3`: heads read the target's final hidden state (`TargetOutput.hidden`,
    [B, T, D]; eagle3 chosen layers' outputs, `TargetOutput.layer_hidden`) and turn predicted features into
    logits with the target's own LM head (`jaxspec.models.heads.Readout.of` takes `params["embed"]` and
    `params["lm_head"]`), so `logits == hidden @ lm_head` must hold: no bias, no scaling, no soft-capping after
    the LM head. EAGLE also builds its head from the target's config, which
    then needs every field in `EAGLE_CONFIG_FIELDS` (in practice a `jaxspec.models.config.ModelConfig`)."""

    cfg: HeadConfig
    embed: nnx.Param  # [V, D]  the token embedding table (EAGLE embeds draft tokens with it)
    lm_head: nnx.Param  # [D, V]  the output projection: logits = hidden @ lm_head


_MISSING = object()


def _label(method: str | None) -> str:
    return "the decode loop" if method is None else f"method={method!r}"


def _is_positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def _config_problems(cfg, method: str | None) -> str | None:
    """The first thing `cfg` lacks for `method` (None: the core contract only), as a sentence, or None."""
    if cfg is _MISSING:
        return f"{_label(method)} needs the attribute cfg: the model's static config (a frozen dataclass)"
    try:
        hash(cfg)
    except TypeError as e:
        return (f"{_label(method)} needs a hashable cfg (a frozen dataclass), the compiled program's identity; "
                f"{type(cfg).__name__} is not: {e}")
    for name, why in CORE_CONFIG_FIELDS.items():
        if not _is_positive_int(getattr(cfg, name, None)):
            got = getattr(cfg, name, _MISSING)
            have = "it is missing" if got is _MISSING else f"it is {got!r}"
            return f"{_label(method)} needs cfg.{name}, a positive int ({have}): {why}"
    needs = _needs(method)
    if "layers" in needs:
        fields = {f.name for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else set()
        if "num_layers" not in fields or not _is_positive_int(cfg.num_layers):
            return (f"{_label(method)} needs cfg.num_layers, a positive int field of a dataclass config: the draft "
                    f"is type(model)(dataclasses.replace(cfg, num_layers=self_draft_layers))")
    if "layer_features" in needs and not _is_positive_int(getattr(cfg, "num_layers", None)):
        return (f"{_label(method)} needs cfg.num_layers, a positive int: the head fuses the outputs of chosen "
                f"decoder layers (low, middle and high)")
    if "features" in needs and not _is_positive_int(getattr(cfg, "hidden_size", None)):
        return (f"{_label(method)} needs cfg.hidden_size, a positive int: the width D of the hidden states the "
                f"heads read and of the embedding and LM head they share")
    if "eagle_head" in needs:
        for name in EAGLE_CONFIG_FIELDS:
            if getattr(cfg, name, _MISSING) is _MISSING:
                return (f"{_label(method)} needs cfg.{name}: the EAGLE head is one Llama decoder layer sized from "
                        f"the target's config (it needs {', '.join(EAGLE_CONFIG_FIELDS)}; a "
                        f"jaxspec.models.config.ModelConfig has them)")
        if not dataclasses.is_dataclass(cfg):
            return f"{_label(method)} needs a dataclass cfg: the EAGLE head copies it with dtype='float32'"
        if not isinstance(cfg.rope, RopeConfig):
            return (f"{_label(method)} needs cfg.rope, a jaxspec.models.config.RopeConfig: the EAGLE head's layer "
                    f"uses rotary positions; got {type(cfg.rope).__name__}")
    return None


def check_config(cfg, method: str | None = None) -> None:
    """Raise ValueError naming the first field `cfg` lacks for `method` (None: only the core contract).

    For callers that hold a config but no model, such as the head loaders.
    """
    _check_method(method)
    problem = _config_problems(cfg, method)
    if problem is not None:
        raise ValueError(f"config {type(cfg).__name__}: {problem}")


def _readout_problems(params, method: str | None, cfg=None) -> str | None:
    """What `params` lacks for `Readout.of`: `embed` [V, D] and `lm_head` [D, V] (with cfg: V and D from it)."""
    who = _label(method) if method is not None else "a trained head (medusa, eagle, eagle2, eagle3, dflash)"
    shapes = {}
    for name in ("embed", "lm_head"):
        try:
            value = params[name]
        except (KeyError, TypeError, AttributeError):
            return (f"{who} needs the parameter {name!r} (the target's "
                    f"{'token embedding [V, D]' if name == 'embed' else 'LM head [D, V]'}): trained heads share "
                    f"the target's embedding and LM head (jaxspec.models.heads.Readout.of)")
        shapes[name] = tuple(getattr(value, "shape", ()))
    embed, head = shapes["embed"], shapes["lm_head"]
    if len(embed) != 2:
        return f"{who} needs params['embed'] [V, D] (the token embedding); got shape {embed}"
    vocab, width = embed if cfg is None else (cfg.vocab_size, cfg.hidden_size)
    if embed != (vocab, width) or head != (width, vocab):
        return (f"{who} needs params['embed'] [V, D] = {[vocab, width]} and params['lm_head'] [D, V] = "
                f"{[width, vocab]} (logits = hidden @ lm_head); got {list(embed)} and {list(head)}")
    return None


def check_readout(params, method: str | None = None) -> None:
    """Raise ValueError unless a target's params hold `embed` [V, D] and `lm_head` [D, V], the two arrays
    trained heads share with it (`jaxspec.models.heads.Readout.of`)."""
    problem = _readout_problems(params, method)
    if problem is not None:
        raise ValueError(problem)


def _needs(method: str | None) -> tuple[str, ...]:
    """What `method` needs beyond the core contract (`jaxspec.methods.Method.needs`)."""
    if method is None:
        return ()
    return get(method).needs


def _check_method(method: str | None) -> None:
    _needs(method)  # ValueError naming an unknown method


def _accepts(fn, names: Sequence[str]) -> str | None:
    """The first of `names` the callable cannot take as a keyword, or None."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to check before calling it
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    keywords = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return next((n for n in names if n not in keywords), None)


def _unwrap(target, name: str | None) -> tuple[nnx.Module, Any, str]:
    """(module, params state, label for messages) from a LanguageModel (or anything with graphdef and params)
    or an NNX module."""
    if hasattr(target, "graphdef") and hasattr(target, "params"):
        module = nnx.merge(target.graphdef, target.params)
        name = getattr(target, "name", "?") if name is None else name
        return module, target.params, f"model {name!r} ({type(module).__name__})"
    if isinstance(target, nnx.Module):
        label = type(target).__name__ if name is None else f"{name!r} ({type(target).__name__})"
        return target, nnx.state(target), f"model {label}"
    raise ValueError(f"target={target!r} must be a jaxspec.LanguageModel or an nnx.Module")


def _structural_problems(module, params, method: str | None) -> str | None:
    """The first attribute or config field `module` lacks for `method`, without tracing anything."""
    label = _label(method)
    if not isinstance(module, nnx.Module):
        return f"{label} needs an nnx.Module (its arrays in NNX state); got {type(module).__name__}"
    cfg = getattr(module, "cfg", _MISSING)
    problem = _config_problems(cfg, method)
    if problem is not None:
        return problem
    if not callable(getattr(module, "new_cache", None)):
        return f"{label} needs the method new_cache(batch, max_len) -> jaxspec.KVCache: prefill allocates the cache"
    keywords = list(CORE_FORWARD_KEYWORDS)
    needs = _needs(method)
    if "tree" in needs:
        keywords.append(TREE_KEYWORD)
    if "layer_features" in needs:
        keywords.append(LAYERS_KEYWORD)
    missing = _accepts(module.__call__, keywords)
    if missing is not None:
        why = CORE_FORWARD_KEYWORDS.get(missing, "tree verification passes the drafts' ancestor mask bool[B, T, T]"
                                        if missing == TREE_KEYWORD else
                                        "the head reads chosen decoder layers' outputs (output.layer_hidden)")
        return f"{label} needs the forward to take the keyword {missing}: {why}"
    if "layers" in needs:
        layers = getattr(module, "layers", _MISSING)
        stacked = isinstance(layers, nnx.Module) and not hasattr(layers, "__len__") and all(
            x.shape[:1] == (cfg.num_layers,) for x in jax.tree.leaves(nnx.state(layers)))  # a scanned stack
        if layers is _MISSING or not (hasattr(layers, "__len__") or stacked):
            return (f"{label} needs the attribute layers: the decoder blocks (an nnx.List, or one block whose "
                    "parameters are stacked [num_layers, ...]), the draft keeps the first N")
        if not stacked and len(layers) != cfg.num_layers:
            return f"{label} needs len(layers) == cfg.num_layers; got {len(layers)} and {cfg.num_layers}"
        if "layers" not in params:
            return f"{label} needs the parameters of the blocks under params['layers'] (the attribute `layers`)"
        try:
            inspect.signature(type(module).__init__).bind(None, cfg, rngs=None)
        except TypeError as e:
            return (f"{label} needs {type(module).__name__}(cfg, *, rngs) to build the model (the draft is the same "
                    f"class with fewer layers): {e}")
    if "features" in needs:
        return _readout_problems(params, method, cfg)
    return None


_BATCH, _NEW, _SLOTS = 2, 3, 8  # the abstract shapes the forward is traced at


def _cache_problem(cache, label: str) -> str | None:
    if not isinstance(cache, KVCache):
        return f"{label} needs new_cache to return a jaxspec.KVCache; got {type(cache).__name__}"
    if cache.lengths.shape != (_BATCH,) or cache.lengths.dtype != jnp.int32:
        return f"{label} needs new_cache's lengths i32[batch]; got {cache.lengths.dtype}{list(cache.lengths.shape)}"
    for name, buffers in (("k", cache.k), ("v", cache.v)):
        if not isinstance(buffers, tuple):  # one stacked buffer [batch, L, H, max_len, hd]
            if len(buffers.shape) != 5 or buffers.shape[0] != _BATCH or buffers.shape[3] != _SLOTS:
                return (f"{label} needs new_cache(batch={_BATCH}, max_len={_SLOTS}) stacked buffers [batch, L, H, "
                        f"max_len, hd]; cache.{name} has shape {tuple(buffers.shape)}")
            continue
        for i, b in enumerate(buffers):
            if len(b.shape) != 4 or b.shape[0] != _BATCH or b.shape[2] != _SLOTS:
                return (f"{label} needs new_cache(batch={_BATCH}, max_len={_SLOTS}) buffers [batch, H, max_len, hd]; "
                        f"cache.{name}[{i}] has shape {tuple(b.shape)}")
    return None


def _trace_problems(module, method: str | None, name: str) -> str | None:
    """Trace `new_cache` and the forward as the loop calls them (`jax.eval_shape`: nothing runs) and return the
    first output of the wrong kind or shape, or None. A call that raises becomes a ValueError naming the call
    (`name` labels the model), chained to the model's own exception."""
    label = _label(method)
    graphdef, state = nnx.split(module)
    try:
        hash(graphdef)
    except TypeError as e:
        return (f"{label} needs every attribute that is not an array to be hashable: the model's graph definition "
                f"is a static jit argument ({e})")
    cfg = module.cfg
    vocab = cfg.vocab_size
    needs = _needs(method)
    # A model (its graph and its parameters' shapes) that passed for these needs passes again: callers that
    # check each time they build a proposer pay for the trace once.
    key = (graphdef, needs, tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(state)))
    if key in _PASSED:
        return None
    try:
        cache = jax.eval_shape(lambda s: nnx.merge(graphdef, s).new_cache(_BATCH, _SLOTS), state)
    except Exception as e:  # a user's model may fail in any way; the message says where
        raise ValueError(f"{name}: {label} calls new_cache({_BATCH}, {_SLOTS}), which failed: "
                         f"{type(e).__name__}: {e}") from e
    problem = _cache_problem(cache, label)
    if problem is not None:
        return problem
    tokens = jnp.zeros((_BATCH, _NEW), jnp.int32)  # i32[B, T]
    positions = jnp.broadcast_to(jnp.arange(_NEW, dtype=jnp.int32), (_BATCH, _NEW))  # i32[B, T]
    calls = [  # (what, keyword arguments, logits rows L)
        ("prefill", dict(logits_at=jnp.full((_BATCH, 1), _NEW - 1, jnp.int32), attention_impl="xla", cached_slots=0),
         1),
        ("verification", dict(attention_impl="xla"), _NEW),
    ]
    if "tree" in needs:
        tree = jnp.broadcast_to(jnp.tril(jnp.ones((_NEW, _NEW), bool)), (_BATCH, _NEW, _NEW))  # bool[B, T, T]
        calls.append(("tree verification", dict(tree_mask=tree, attention_impl="xla"), _NEW))
    for what, kwargs, rows in calls:
        def forward(s, c, kwargs=kwargs):
            result = nnx.merge(graphdef, s)(tokens, positions, c, **kwargs)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise _BadReturn(type(result).__name__)
            out, new_cache = result
            return getattr(out, "logits", _Missing()), getattr(out, "hidden", _Missing()), new_cache
        try:
            logits, hidden, new_cache = jax.eval_shape(forward, state, cache)
        except _BadReturn as e:
            return f"{label} needs the forward to return (output, cache); it returned a {e}"
        except Exception as e:  # a user's model may fail in any way; the message says which call
            raise ValueError(f"{name}: {label} calls the forward for {what} (tokens i32[{_BATCH}, {_NEW}], "
                             f"{', '.join(kwargs)}), which failed: {type(e).__name__}: {e}") from e
        want = (_BATCH, rows, vocab)
        if isinstance(logits, _Missing) or getattr(logits, "shape", None) != want \
                or not jnp.issubdtype(logits.dtype, jnp.floating):
            got = ("nothing" if isinstance(logits, _Missing) else "None" if logits is None
                   else f"{logits.dtype}{list(logits.shape)}")
            return f"{label} needs output.logits, floats [B, L, V] = {list(want)}, from {what}; got {got}"
        if jax.tree.structure(new_cache) != jax.tree.structure(cache) or any(
                (a.shape, a.dtype) != (b.shape, b.dtype)
                for a, b in zip(jax.tree.leaves(new_cache), jax.tree.leaves(cache))):
            return (f"{label} needs the forward to return the cache with the structure, shapes and dtypes it was "
                    f"given (it is a loop carry); {what} changed it")
        if "features" in needs:
            want = (_BATCH, _NEW, cfg.hidden_size)
            if isinstance(hidden, _Missing) or getattr(hidden, "shape", None) != want:
                got = "nothing" if isinstance(hidden, _Missing) else str(list(getattr(hidden, "shape", ())))
                return (f"{label} needs output.hidden [B, T, D] = {list(want)} from {what}, the final hidden "
                        f"state the heads read; got {got}")
    _PASSED.add(key)
    return None


_PASSED: set = set()  # (graphdef, needs, parameter shapes) of the models whose trace passed


class _BadReturn(Exception):
    """The forward returned something other than an (output, cache) pair."""


class _Missing:
    """An output attribute the forward's result does not have (a pytree with no leaves, so eval_shape keeps it)."""


jax.tree_util.register_pytree_node(_Missing, lambda m: ((), None), lambda aux, children: _Missing())


def check_target(target, method: str | None = None, *, trace: bool = True, name: str | None = None) -> None:
    """Raise ValueError unless `target` meets the contract `method` needs (None: the core contract).

    `target` is a `jaxspec.LanguageModel` or an NNX module. The message names the missing field, attribute
    or keyword and the method that needs it ("method='self_draft' needs cfg.num_layers, ..."). With `trace`
    (the default) `new_cache` and the forward are also traced as prefill and verification call them
    (`jax.eval_shape`: nothing runs; about a second for a 135M model on a CPU), checking the cache's type and
    shapes, the logits' and hidden states' shapes, and that the returned cache matches the one given. What
    no check can see, the values (K/V at slot `lengths + t`, lengths not advanced, stale slots masked), is
    for your tests: greedy speculative output equal to plain output catches most violations. `name` labels
    the model in messages (default: a LanguageModel's own name).
    """
    _check_method(method)
    module, params, name = _unwrap(target, name)
    problem = _structural_problems(module, params, method)
    if problem is None and trace:
        problem = _trace_problems(module, method, name)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")
