"""Text <-> token ids for jaxspec models, built from a GGUF file or a Hugging Face tokenizer folder.

The heavy lifting is done by the ``tokenizers`` library; this module only rebuilds, from GGUF
metadata, the byte-level BPE that the model was trained with, and renders chat templates the way
Hugging Face ``transformers`` does.  Nothing is downloaded.

GGUF support covers ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with the pre-tokenizer types
in ``_PRE_TOKENIZERS``; anything else raises a ValueError naming the unsupported value, rather than
silently tokenizing differently from the model's reference tokenizer.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from .files import FileError, describe, json_object, read_json

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special (never split, dropped by
# skip_special_tokens); USER_DEFINED tokens are also matched atomically in text but are ordinary text.
_CONTROL, _USER_DEFINED = 3, 4

# Special tokens that end a turn or a document in common chat models.  eos_token_ids is the model's
# eos id plus every one of these that the vocabulary has *as a special token*: a model trained on
# ChatML stops at <|im_end|> even when its metadata names <|endoftext|> as eos, and vice versa.
END_TOKENS = (
    "<|im_end|>",  # ChatML (SmolLM, Qwen)
    "<|endoftext|>",  # GPT-2 family, SmolLM, Qwen
    "<|eot_id|>",  # Llama 3 end of turn
    "<|eom_id|>",  # Llama 3.1 end of message (tool call)
    "<|end_of_text|>",  # Llama 3 end of document
    "<|end|>",  # Phi-3
    "<end_of_turn>",  # Gemma
)

# Regexes of the Hugging Face tokenizer.json files (llama.cpp uses the same ones under these pre types).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(split: str | None = None) -> pre_tokenizers.PreTokenizer:
    """Byte-level mapping, after either the GPT-2 regex (split=None) or a custom split regex."""
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is written as -> that byte.  Printable
    bytes stand for themselves; the rest are shifted to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


_UNICODE_TO_BYTE = _byte_level_alphabet()


def _gpt2() -> dict[str, Any]:
    return {"pre_tokenizer": _byte_level()}


def _smollm() -> dict[str, Any]:
    # SmolLM / StarCoder: every digit is its own pre-token (llama.cpp's "\p{N}" split, HF's
    # Digits(individual_digits=True)), then the GPT-2 regex.  This also detaches the space before a
    # number, so "  1" is ["  ", "1"], not [" ", " 1"] as with the plain GPT-2 regex.
    return {
        "pre_tokenizer": pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _byte_level()]
        )
    }


def _llama3() -> dict[str, Any]:
    # Llama 3 looks a whole pre-token up in the vocab before merging (llama.cpp and HF both do).
    return {"pre_tokenizer": _byte_level(_LLAMA3_SPLIT), "ignore_merges": True}


def _qwen2() -> dict[str, Any]:
    # Qwen2's tokenizer.json NFC-normalizes first; llama.cpp skips that, but the model was trained on it.
    return {"pre_tokenizer": _byte_level(_QWEN2_SPLIT), "normalizer": normalizers.NFC()}


# tokenizer.ggml.pre -> how to build the pipeline.  A missing pre field means the plain GPT-2 regex
# (what files converted before llama.cpp recorded pre types used for GPT-2 vocabularies).
_PRE_TOKENIZERS = {
    None: _gpt2,
    "gpt-2": _gpt2,
    "smollm": _smollm,
    "starcoder": _smollm,
    "llama-bpe": _llama3,
    "llama3": _llama3,
    "llama-v3": _llama3,
    "qwen2": _qwen2,
}


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&'; chat templates expect plain JSON, as in HF.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    """A model's tokenizer: ``encode``/``decode``, special ids and chat template rendering.

    ``backend`` is the underlying ``tokenizers.Tokenizer`` (save it with ``backend.save(path)``).
    ``eos_token_ids`` is ``eos_token_id`` followed, in id order, by every special token of the vocabulary
    named in ``END_TOKENS``: generation should stop at any of them.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        ends = [self.token_to_id(t) for t in END_TOKENS]
        ends = sorted(i for i in ends if i is not None and i in special and i != eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(([eos_token_id] if eos_token_id is not None else []) + ends)
        self._template = None  # compiled lazily: most users never render a chat

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> Tokenizer:
        """Build from a GGUF file's metadata; accepts an open ``gguf.GGUFReader`` or a path."""
        if isinstance(reader_or_path, (str, os.PathLike)):
            import gguf  # only needed here; the reader path lets the model loader share its reader

            reader = gguf.GGUFReader(reader_or_path)
        else:
            reader = reader_or_path
        kind = _gguf_value(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported tokenizer.ggml.model {kind!r}: only 'gpt2' (byte-level BPE) is supported"
            )
        pre = _gguf_value(reader, "tokenizer.ggml.pre")
        if pre not in _PRE_TOKENIZERS:
            known = ", ".join(sorted(repr(k) for k in _PRE_TOKENIZERS if k is not None))
            raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}: supported pre types are {known}")
        parts = _PRE_TOKENIZERS[pre]()

        tokens: list[str] = _gguf_value(reader, "tokenizer.ggml.tokens")
        if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
            raise ValueError(f"tokenizer.ggml.tokens must be a non-empty list of strings; got {describe(tokens)}")
        types: list[int] = _gguf_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
        if not (isinstance(types, list) and len(types) == len(tokens)):
            raise ValueError(f"tokenizer.ggml.token_type must be a list of {len(tokens)} integers, one per token; "
                             f"got {describe(types)}")
        merges = _gguf_value(reader, "tokenizer.ggml.merges", [])
        if not (isinstance(merges, list) and all(isinstance(m, str) and " " in m for m in merges)):
            raise ValueError(f"tokenizer.ggml.merges must be a list of 'left right' strings; got {describe(merges)}")
        merges = [tuple(m.split(" ", 1)) for m in merges]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("tokenizer.ggml.tokens has duplicate entries; ids would not round-trip")

        backend = _Backend(
            models.BPE(vocab=vocab, merges=merges, ignore_merges=parts.get("ignore_merges", False))
        )
        if "normalizer" in parts:
            backend.normalizer = parts["normalizer"]
        backend.pre_tokenizer = parts["pre_tokenizer"]
        backend.decoder = decoders.ByteLevel()
        # Registered as added tokens so text like "<|im_start|>" maps to its one id and is never split.
        # normalized=False: matched on the raw text, as llama.cpp and HF do for these tokens.
        added = [
            AddedToken(tok, special=(t == _CONTROL), normalized=False)
            for tok, t in zip(tokens, types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
        backend.add_special_tokens([a for a in added if a.special])
        backend.add_tokens([a for a in added if not a.special])

        def token_id(key: str) -> int | None:
            value = _gguf_value(reader, key)
            if value is not None and not (isinstance(value, int) and 0 <= value < len(tokens)):
                raise ValueError(f"{key} must be a token id in [0, {len(tokens)}); got {describe(value)}")
            return value

        return cls(
            backend,
            bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
            pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
            # A gpt2-type vocabulary adds no BOS unless the file says so (llama.cpp's default too).
            add_bos=bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from a Hugging Face tokenizer folder (``tokenizer.json`` + optional config files)."""
        tokenizer_path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tokenizer_path):
            raise FileError(f"tokenizer file {tokenizer_path!r} does not exist")
        try:
            backend = _Backend.from_file(tokenizer_path)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception for a bad file
            raise FileError(f"tokenizer file {tokenizer_path!r} cannot be read: {e}") from None
        config: dict[str, Any] = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            config = json_object(read_json(config_path, "tokenizer config"), f"tokenizer config {config_path!r}")

        # Newer transformers write the template to its own file; those take precedence, as there.
        template = config.get("chat_template")
        jinja_path = os.path.join(path, "chat_template.jinja")
        json_path = os.path.join(path, "chat_template.json")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        elif os.path.exists(json_path):
            template = json_object(read_json(json_path, "chat template file"),
                                   f"chat template file {json_path!r}").get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise FileError(f"{path!r}: the chat template must be a string or a list "
                            f"of named templates; got {describe(template)}")

        def token_id(key: str) -> int | None:
            content = _token_content(config.get(key))
            return None if content is None else backend.token_to_id(content)

        bos = token_id("bos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: BOS is added iff the tokenizer.json post-processor adds it (e.g. Llama 3).
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=token_id("eos_token"),
            pad_token_id=token_id("pad_token"),
            add_bos=bool(add_bos),
            chat_template=template,
        )

    # ------------------------------------------------------------------ ids <-> text

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.  Special tokens written in the text (``<|im_start|>``) become their ids.

        ``add_special_tokens`` prepends BOS only when the model's metadata asks for it (``add_bos``);
        the tokenizers post-processor is bypassed so no EOS or other template is ever appended.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """Text of a 1-D sequence of ids (list, numpy or jax array)."""
        arr = np.asarray(ids)
        if arr.size == 0:
            return ""
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"decode expects a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.vocab_size})")
        return self.backend.decode(arr.tolist(), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The vocabulary entry for id ``i``, in byte-level form (a leading space is 'Ġ')."""
        token = self.backend.id_to_token(int(i)) if 0 <= int(i) < self.vocab_size else None
        if token is None:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return token

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for (a byte-level token may hold part of a UTF-8 character; OpenAI's
        ``logprobs`` report them as ``bytes``).  Added tokens (``<|im_end|>``) are their text in UTF-8."""
        token = self.id_to_token(i)
        added = self.backend.get_added_tokens_decoder().get(int(i))
        if added is not None:
            return added.content.encode("utf-8")
        return bytes(_UNICODE_TO_BYTE[c] for c in token)

    def token_to_id(self, s: str) -> int | None:
        """The id of vocabulary entry ``s`` (byte-level form), or None."""
        return self.backend.token_to_id(s)

    def first_difference(self, other: "Tokenizer") -> int | None:
        """The first id that `other` maps to another vocabulary entry than this tokenizer (None when both hold
        the same entries under the same ids): a draft model's token ids mean the target's only then."""
        return _first_difference(self, other)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template, as transformers does.

        Extra keyword arguments (``tools``, ``bos_token`` overrides, ...) are passed to the template.
        A ``raise_exception(msg)`` call in the template raises ValueError.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if not isinstance(messages, list):
            raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for n, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"message {n} needs a string 'role' and a string 'content', got {m!r}")
        if self._template is None:
            # trim_blocks/lstrip_blocks: templates are written for HF's settings and emit stray
            # newlines without them.  The sandbox stops a template from touching Python internals.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)
        special = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
        }
        context = {**special, **extra, "messages": messages, "add_generation_prompt": add_generation_prompt}
        return self._template.render(**context)

    def _token_text(self, i: int | None) -> str:
        return "" if i is None else self.decode([i])

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id}, "
            f"eos_token_ids={self.eos_token_ids}, add_bos={self.add_bos}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )


@functools.lru_cache(maxsize=8)  # tokenizers hash by identity; a pair is compared once, not per generate call
def _first_difference(a: Tokenizer, b: Tokenizer) -> int | None:
    if a is b:
        return None
    mine, theirs = a.backend.get_vocab(with_added_tokens=True), b.backend.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in mine.items()}
    other_by_id = {i: t for t, i in theirs.items()}
    differing = [i for i in set(by_id) | set(other_by_id) if by_id.get(i) != other_by_id.get(i)]
    return min(differing) if differing else None
