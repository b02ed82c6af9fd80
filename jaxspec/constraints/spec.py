"""What a constrained row must write: a regex, a JSON schema or one of a few strings.

Each spec is a frozen, hashable dataclass (the compile cache's key) and stands for one regex (`.regex()`) in
the dialect of outlines-core, which is Rust's `regex` crate: `\\d` and `\\w` are Unicode classes (`\\d{4}` has
203 DFA states against 11 for `[0-9]{4}`), look-around and `\\b` are not supported, and the whole output must
match (the pattern is anchored at both ends).

Making a spec checks its types and parses a schema's JSON, in time linear in its text, whatever its size:
whether outlines-core accepts the regex or schema, and at what cost, is learnt when it compiles
(`compile_constraint`, bounded by `ConstraintLimits`), since even building the regex of a small schema or the
byte-level automaton of a short pattern (`.{1000000}`) can take minutes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

from .limits import shown

# Whitespace a JSON schema's regex allows between tokens. outlines' "any whitespace" pattern (`[\n\t ]*`) lets a
# small model emit spaces and newlines forever inside an object and never close it. None at all (minified JSON,
# the default) forces every key and separator, so they are drafted for free (`jaxspec.constraints.jump`): on the
# default model a 4-field object took 10 verify steps instead of 17 with one optional space (SPACED_WHITESPACE,
# which keeps a model's habitual `{"a": 1}` spacing legal).
COMPACT_WHITESPACE = ""
SPACED_WHITESPACE = r"[ ]?"

# Characters with a meaning in a Rust regex (regex_syntax::is_meta_character): escaped in Choice options.
_RUST_META = frozenset("\\.+*?()|[]{}^$#&-~")


@functools.lru_cache(maxsize=1024)
def _schema_regex(schema: str, whitespace: str) -> str:
    """The regex outlines-core builds for a JSON schema (canonical text), or ValueError naming the schema. Built
    here, unbounded: `compile_constraint` builds it in its worker, within the compile's budget."""
    try:
        return build_regex_from_schema(schema, whitespace)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid JSON schema {shown(schema)}: {shown(str(e))}") from None


def _escape(text: str) -> str:
    """`text` as a Rust regex matching exactly it."""
    return "".join("\\" + c if c in _RUST_META else c for c in text)


@dataclasses.dataclass(frozen=True)
class Regex:
    """The output must match `pattern` (a Rust regex, anchored at both ends)."""

    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ValueError(f"Regex pattern must be a str, got {shown(repr(self.pattern))}")

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
                raise ValueError(f"invalid JSON schema {shown(repr(self.schema))}: not JSON ({e})") from None
            except RecursionError:
                raise ValueError(f"invalid JSON schema {shown(repr(self.schema))}: nested too deeply") from None
        if not isinstance(value, Mapping) and not isinstance(value, bool):
            raise ValueError(f"invalid JSON schema {shown(repr(self.schema))}: must be a JSON object")
        try:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"invalid JSON schema {shown(repr(self.schema))}: {shown(str(e) or repr(e))}") from None
        object.__setattr__(self, "schema", text)
        if not isinstance(self.whitespace, str):
            raise ValueError(f"JsonSchema whitespace must be a regex str, got {shown(repr(self.whitespace))}")

    def regex(self) -> str:
        return _schema_regex(self.schema, self.whitespace)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The output must be exactly one of `options` (strings, matched literally)."""

    options: tuple[str, ...]

    def __init__(self, options: Sequence[str]) -> None:
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence):
            raise ValueError(f"Choice options must be a sequence of strings, got {shown(repr(options))}")
        options = tuple(options)
        if not options:
            raise ValueError("Choice options must not be empty: got an empty sequence")
        bad = [o for o in options if not isinstance(o, str)]
        if bad:
            raise ValueError(f"Choice options must be strings, got {shown(repr(bad[0]))}")
        object.__setattr__(self, "options", options)

    def regex(self) -> str:
        return "(" + "|".join(_escape(o) for o in self.options) + ")"


Constraint = Regex | JsonSchema | Choice
