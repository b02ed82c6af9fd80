"""How large a constraint may be, checked before anything expensive: `ConstraintLimits` and its checks.

A constraint's cost is not its size: outlines-core builds a byte-level DFA, then a token-level index over the
whole vocabulary, and both can grow exponentially in a small spec: `{"type":"string","maxLength":20}` and
`[a-z]{5000}` compile for minutes in gigabytes, a 798-byte schema of self-referring properties becomes a regex
of a hundred megabytes, and a `minLength` of 10**9 aborts the Rust allocator. So every count that multiplies
the automaton (repetition bounds, `$ref` expansion, enum options) is bounded here, from the spec's text, in
time linear in it; the rest is bounded by the compile's time and memory budget (`jaxspec.constraints.compiler`)
and by the automaton's size once built.

This module imports the standard library alone: the compile worker, which never imports jaxspec (nor jax),
loads it by path.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

MAX_SHOWN = 200  # characters of an offending fragment quoted in an error message

# JSON-schema keywords whose value is a count that outlines-core writes as a regex repetition.
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")

_VALUES = frozenset({"enum", "const", "default", "examples"})  # keywords holding JSON values, not schemas
_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")  # {n}, {n,}, {n,m}


class ConstraintTooLarge(ValueError):
    """A constraint beyond one of its `ConstraintLimits` (or its compile budget): `limit` names the field,
    `maximum` its value, `value` what the constraint needed (None when unknown, as when a budget ran out)."""

    def __init__(self, message: str, limit: str, maximum: Any, value: Any = None):
        super().__init__(message)
        self.limit, self.maximum, self.value = limit, maximum, value


def shown(text: str, most: int = MAX_SHOWN) -> str:
    """`text` for an error message: whole if short, else its first `most` characters and its length."""
    text = str(text)
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


@dataclasses.dataclass(frozen=True)
class ConstraintLimits:
    """The most a constraint may need. Defaults serve ordinary schemas (a 10-field object of strings has 172
    states and 513k edges over SmolLM2's 49152 tokens) and refuse, in milliseconds, the specs whose compile
    would run for minutes or exhaust memory."""

    max_schema_bytes: int = 64 * 1024  # a JSON schema's canonical text
    max_schema_depth: int = 64  # nesting of objects and arrays, $refs followed
    max_schema_nodes: int = 10_000  # schema objects once every local $ref is expanded
    max_ref_depth: int = 3  # times a recursive $ref unrolls (outlines-core's max_recursion_depth)
    max_repeat: int = 256  # a regex {n,m} bound (nested ones multiplied) or a JSON-schema count keyword
    max_options: int = 10_000  # Choice options, or one enum's values
    max_option_bytes: int = 128 * 1024  # the options' (or one enum's values') total UTF-8 bytes
    max_regex_bytes: int = 256 * 1024  # the regex handed to outlines-core (a schema's as outlines-core writes it)
    max_states: int = 16_384  # token-automaton states
    max_edges: int = 1 << 23  # token-automaton (state, token) pairs
    time_s: float = 30.0  # the compile's CPU seconds, in the worker (RLIMIT_CPU)
    memory_bytes: int = 2 << 30  # the compile worker's address space

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
                    or (field.type == "int" and not isinstance(value, int)):
                raise ValueError(f"ConstraintLimits.{field.name}={value!r} must be a positive {field.type}")

    def refuse(self, limit: str, value: Any, where: str) -> ConstraintTooLarge:
        """The error for `value` beyond field `limit`, found at `where` (a keyword path or a fragment)."""
        maximum = getattr(self, limit)
        return ConstraintTooLarge(f"{shown(where)}: {value} exceeds {limit}={maximum}", limit, maximum, value)


# ----------------------------------------------------------------------------------------------------- regexes


def check_regex(pattern: str, limits: ConstraintLimits, what: str = "regex") -> None:
    """ConstraintTooLarge when `pattern` is longer than max_regex_bytes or repeats anything more than max_repeat
    times (a bound counts multiplied by the bounds of the groups around it: `(a{20}){20}` repeats 400 times)."""
    size = len(pattern.encode("utf-8", "surrogatepass"))
    if size > limits.max_regex_bytes:
        raise limits.refuse("max_regex_bytes", f"{size} bytes", f"{what} {pattern!r}")
    count, at = _largest_repeat(pattern)
    if count > limits.max_repeat:
        fragment = pattern[max(0, at - 60): at + 40]
        raise limits.refuse("max_repeat", f"a repetition of {count}", f"{what} fragment {fragment!r}")


def _largest_repeat(pattern: str) -> tuple[int, int]:
    """(the largest repetition count in a Rust regex, nested bounds multiplied; the position of its `{`)."""
    inner = [1]  # per open group: the largest count inside it
    last_group = 1  # the count inside the atom just read, when it is a group (else 1)
    best, best_at = 1, 0
    i, n, in_class = 0, len(pattern), 0
    while i < n:
        c = pattern[i]
        if c == "\\":  # an escape: \p{Greek}, \x{41}, \u{...} carry braces that are no repetition
            if i + 2 < n and pattern[i + 1] in "pPxu" and pattern[i + 2] == "{":
                close = pattern.find("}", i + 2)
                i = n if close < 0 else close + 1
            else:
                i += 2
            last_group = 1
            continue
        if in_class:  # Rust classes nest ([a-z&&[^aeiou]]); a leading ] is literal
            if c == "[":
                in_class += 1
            elif c == "]" and pattern[i - 1] not in "[^":
                in_class -= 1
            i += 1
            last_group = 1
            continue
        if c == "[":
            in_class = 1
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            continue
        if c == "(":
            inner.append(1)
        elif c == ")" and len(inner) > 1:
            last_group = inner.pop()
            i += 1
            continue
        elif c == "{":
            m = _REPEAT.match(pattern, i)
            if m:
                bound = int(m.group(3)) if m.group(3) else int(m.group(1))
                count = max(bound, int(m.group(1))) * last_group
                inner[-1] = max(inner[-1], count)
                if count > best:
                    best, best_at = count, i
                i = m.end()
                last_group = 1
                continue
        last_group = 1
        i += 1
    return best, best_at


# ------------------------------------------------------------------------------------------------ JSON schemas


def check_schema(text: str, schema: Any, limits: ConstraintLimits) -> None:
    """ConstraintTooLarge when a JSON schema (`text`, its canonical JSON, parsed as `schema`) is too long, too
    deep, expands to too many nodes following its local `$ref`s (a recursive one unrolled max_ref_depth times,
    as outlines-core does), asks for a count beyond max_repeat, or has too large an enum or pattern. Errors name
    the keyword's path in the schema (`properties.name.maxLength`). Costs at most max_schema_nodes steps."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_schema_bytes:
        raise limits.refuse("max_schema_bytes", f"{size} bytes", f"JSON schema {text!r}")
    nodes = 0
    todo = [(schema, "", 0, ())]  # (value, its path, its depth, the $refs being expanded around it)
    while todo:
        value, path, depth, refs = todo.pop()
        if depth > limits.max_schema_depth:
            raise limits.refuse("max_schema_depth", f"depth {depth}", f"JSON schema at {path or '(root)'}")
        if isinstance(value, list):
            todo.extend((v, _join(path, str(i)), depth + 1, refs) for i, v in enumerate(value))
            continue
        if not isinstance(value, dict):
            continue
        nodes += 1
        if nodes > limits.max_schema_nodes:
            raise limits.refuse("max_schema_nodes", "the expansion of its $refs (more than "
                                f"{limits.max_schema_nodes} schema nodes)", f"JSON schema at {path or '(root)'}")
        _check_keywords(value, path, limits)
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = _resolve(schema, ref)
            if target is not None and refs.count(ref) < limits.max_ref_depth + 1:
                todo.append((target, ref[2:].replace("/", "."), depth + 1, refs + (ref,)))
        for key, v in value.items():
            if key in _VALUES:
                continue
            if isinstance(v, (dict, list)):
                todo.append((v, _join(path, key), depth + 1, refs))


def _check_keywords(node: dict, path: str, limits: ConstraintLimits) -> None:
    for key in COUNT_KEYWORDS:
        count = node.get(key)
        if isinstance(count, (int, float)) and not isinstance(count, bool) and count > limits.max_repeat:
            raise limits.refuse("max_repeat", count, _join(path, key))
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, limits, f"{_join(path, 'pattern')} regex")
    enum = node.get("enum")
    if isinstance(enum, list):
        check_options([_json_text(v) for v in enum], limits, _join(path, "enum"))


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _resolve(schema: Any, ref: str) -> Any:
    """The value a local `$ref` ("#", "#/$defs/name", JSON-pointer escapes ~0 ~1) points to, or None."""
    value = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


# ------------------------------------------------------------------------------------------ options, automata


def check_options(options: list[str], limits: ConstraintLimits, where: str = "Choice") -> None:
    """ConstraintTooLarge for more than max_options options or more than max_option_bytes of them."""
    if len(options) > limits.max_options:
        raise limits.refuse("max_options", f"{len(options)} options", where)
    size = sum(len(o.encode("utf-8", "surrogatepass")) for o in options)
    if size > limits.max_option_bytes:
        raise limits.refuse("max_option_bytes", f"{size} bytes of options", where)


def check_automaton(num_states: int, num_edges: int, limits: ConstraintLimits, what: str) -> None:
    """ConstraintTooLarge for a token automaton of more than max_states states or max_edges edges."""
    if num_states > limits.max_states:
        raise limits.refuse("max_states", f"{num_states} states", f"the token automaton of {what}")
    if num_edges > limits.max_edges:
        raise limits.refuse("max_edges", f"{num_edges} edges", f"the token automaton of {what}")


__all__ = ["COUNT_KEYWORDS", "ConstraintLimits", "ConstraintTooLarge", "check_automaton", "check_options",
           "check_regex", "check_schema", "shown"]
