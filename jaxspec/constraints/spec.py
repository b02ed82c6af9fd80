"""What a constrained row must write: a regex, a JSON schema or one of a few strings.

Each spec is a frozen, hashable dataclass (the compile cache's key), checked when it is made, and compiles to
one regex (`.regex()`) in the dialect of outlines-core, which is Rust's `regex` crate: `\\d` and `\\w` are
Unicode classes (`\\d{4}` has 203 DFA states against 11 for `[0-9]{4}`), look-around and `\\b` are not
supported, and the whole output must match (the pattern is anchored at both ends).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import outlines_core
from outlines_core.json_schema import build_regex_from_schema

# Whitespace a JSON schema's regex allows between tokens. outlines' "any whitespace" pattern (`[\n\t ]*`) lets a
# small model emit spaces and newlines forever inside an object and never close it. None at all (minified JSON,
# the default) forces every key and separator, so they are drafted for free (`jaxspec.constraints.jump`): on the
# default model a 4-field object took 10 verify steps instead of 17 with one optional space (SPACED_WHITESPACE,
# which keeps a model's habitual `{"a": 1}` spacing legal).
COMPACT_WHITESPACE = ""
SPACED_WHITESPACE = r"[ ]?"

# Characters with a meaning in a Rust regex (regex_syntax::is_meta_character): escaped in Choice options.
_RUST_META = frozenset("\\.+*?()|[]{}^$#&-~")

# A vocabulary of the 256 single bytes: an Index over it builds the regex's DFA (so any syntax or unsupported
# feature error appears) and can never miss a byte, so it checks a pattern without a tokenizer.
_BYTES = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


@functools.lru_cache(maxsize=1024)
def _check_regex(pattern: str, what: str) -> None:
    """ValueError naming `pattern` if outlines-core cannot build an automaton for it."""
    try:
        outlines_core.Index(pattern, _BYTES)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid {what} {pattern!r}: {e}") from None


@functools.lru_cache(maxsize=1024)
def _schema_regex(schema: str, whitespace: str) -> str:
    """The regex outlines-core builds for a JSON schema (canonical text), or ValueError naming the schema."""
    try:
        return build_regex_from_schema(schema, whitespace)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid JSON schema {schema}: {e}") from None


def _escape(text: str) -> str:
    """`text` as a Rust regex matching exactly it."""
    return "".join("\\" + c if c in _RUST_META else c for c in text)


@dataclasses.dataclass(frozen=True)
class Regex:
    """The output must match `pattern` (a Rust regex, anchored at both ends)."""

    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ValueError(f"Regex pattern must be a str, got {self.pattern!r}")
        _check_regex(self.pattern, "regex")

    def regex(self) -> str:
        return self.pattern


@dataclasses.dataclass(frozen=True)
class JsonSchema:
    """The output must be JSON valid under `schema` (a dict, or its JSON text), in the form outlines-core's
    `build_regex_from_schema` writes: properties in the schema's order, `whitespace` (a regex) between tokens.

    `schema` is kept as canonical JSON text (compact separators, key order preserved: property order is part of
    the constraint), so equal schemas written differently are one cache entry.
    """

    schema: str | Mapping[str, Any]
    whitespace: str = COMPACT_WHITESPACE

    def __post_init__(self) -> None:
        value = self.schema
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid JSON schema {self.schema!r}: not JSON ({e})") from None
        if not isinstance(value, Mapping) and not isinstance(value, bool):
            raise ValueError(f"invalid JSON schema {self.schema!r}: must be a JSON object")
        try:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid JSON schema {self.schema!r}: {e}") from None
        object.__setattr__(self, "schema", text)
        if not isinstance(self.whitespace, str):
            raise ValueError(f"JsonSchema whitespace must be a regex str, got {self.whitespace!r}")
        _check_regex(self.whitespace, "whitespace pattern")
        _schema_regex(text, self.whitespace)

    def regex(self) -> str:
        return _schema_regex(self.schema, self.whitespace)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The output must be exactly one of `options` (strings, matched literally)."""

    options: tuple[str, ...]

    def __init__(self, options: Sequence[str]) -> None:
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence):
            raise ValueError(f"Choice options must be a sequence of strings, got {options!r}")
        options = tuple(options)
        if not options:
            raise ValueError("Choice options must not be empty: got an empty sequence")
        bad = [o for o in options if not isinstance(o, str)]
        if bad:
            raise ValueError(f"Choice options must be strings, got {bad[0]!r}")
        object.__setattr__(self, "options", options)

    def regex(self) -> str:
        return "(" + "|".join(_escape(o) for o in self.options) + ")"


Constraint = Regex | JsonSchema | Choice
