"""A request's output constraint (JSON schema, regex, choice, grammar, structural tag) as plain text.

It rides in ``SamplingParams`` from the router to every replica (prefill and decode alike), and
each replica compiles it for its own tokenizer (``engine/structured_output``). ``grammar()`` builds
xgrammar's tokenizer-free grammar: the router calls it to refuse a bad constraint with a 400
before any replica sees it, and the engine checks the same way before a request takes KV blocks.

xgrammar is imported on first use: its import takes ~1.7 s, which a server without constrained
requests never pays.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError

# What a client may send, whatever the server's limits (the router's config may lower them).
MAX_SPEC_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1024
# xgrammar turns a JSON schema's "pattern" into grammar rules in time that grows with the square of
# its repetition counts: "a{2000}" took 0.17 s, "a{50000}" 185 s, holding whoever asked (the
# router's loop, a replica's compile thread). A constraint's regexes may repeat this much in all,
# counted as pattern_repeats counts (a group's count multiplies what is inside it).
MAX_PATTERN_REPEATS = 2048


class ConstraintKind(enum.Enum):
    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # one of a list of strings, exactly
    GRAMMAR = "grammar"  # EBNF (GBNF-style, "::="), or Lark
    STRUCTURAL_TAG = "structural_tag"  # free text with constrained tagged sections (tool calls)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """``spec``: the schema or structural tag as compact JSON text, the regex, the choices as a JSON
    list, or the grammar's text; "" for json_object. ``any_whitespace``: JSON may put any whitespace
    between tokens (vLLM's default); off (the default here), JSON is written compactly, which a
    small model cannot pad with newlines until max_tokens cuts it off unparseable."""

    kind: ConstraintKind
    spec: str = ""
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.kind, str):
            try:
                object.__setattr__(self, "kind", ConstraintKind(self.kind))
            except ValueError:
                message = f"unknown constraint kind {self.kind!r}"
                raise InvalidRequestError(message, param="structured_outputs") from None
        if not isinstance(self.spec, str) or not isinstance(self.any_whitespace, bool):
            raise InvalidRequestError("a constraint's spec must be text", param="structured_outputs")

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return self.kind.value, self.spec, self.any_whitespace

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "spec": self.spec, "any_whitespace": self.any_whitespace}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutput:
        if not isinstance(data, dict) or set(data) - {"kind", "spec", "any_whitespace"}:
            message = "structured_output must be {kind, spec, any_whitespace}"
            raise InvalidRequestError(message, param="structured_outputs")
        return cls(**data)

    def grammar(self) -> Any:
        """xgrammar's Grammar for this constraint (no tokenizer needed: cheap, ~0.2 ms for a schema).
        Raises InvalidRequestError naming the field when the constraint does not compile."""
        import xgrammar as xgr

        kind, spec = self.kind, self.spec
        _check_repeats(self)
        try:
            if kind is ConstraintKind.JSON:
                return xgr.Grammar.from_json_schema(spec, any_whitespace=self.any_whitespace, strict_mode=True)
            if kind is ConstraintKind.JSON_OBJECT:
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace)
            if kind is ConstraintKind.REGEX:
                return xgr.Grammar.from_regex(spec)
            if kind is ConstraintKind.CHOICE:
                return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
            if kind is ConstraintKind.GRAMMAR:
                return xgr.Grammar.from_ebnf(spec) if "::=" in spec else xgr.Grammar.from_lark(spec)
            return xgr.Grammar.from_structural_tag(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors are RuntimeErrors
            raise InvalidRequestError(
                f"the {kind.value} constraint does not compile: {_first_line(exc)}", param=_FIELD_OF_KIND[kind]
            ) from None


# The request field a refusal names (structured_outputs is vLLM's; response_format OpenAI's).
_FIELD_OF_KIND = {
    ConstraintKind.JSON: "response_format.json_schema",
    ConstraintKind.JSON_OBJECT: "response_format",
    ConstraintKind.REGEX: "structured_outputs.regex",
    ConstraintKind.CHOICE: "structured_outputs.choice",
    ConstraintKind.GRAMMAR: "structured_outputs.grammar",
    ConstraintKind.STRUCTURAL_TAG: "structured_outputs.structural_tag",
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # xgrammar prefixes its messages with "[hh:mm:ss] /project/cpp/file.cc:NN: ": the reason follows.
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(": ", 1)[0] and ": " in text:
            text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__


def _check_repeats(constraint: StructuredOutput) -> None:
    if constraint.kind is ConstraintKind.REGEX:
        patterns = [constraint.spec]
    elif constraint.kind in (ConstraintKind.JSON, ConstraintKind.STRUCTURAL_TAG):
        try:
            patterns = list(_patterns(json.loads(constraint.spec)))
        except (ValueError, RecursionError):
            return  # xgrammar's parse refuses it by name
    else:
        return
    total = sum(pattern_repeats(pattern) for pattern in patterns)
    if total > MAX_PATTERN_REPEATS:
        raise InvalidRequestError(
            f"the {constraint.kind.value} constraint's regular expressions repeat {total} times in all "
            f"(counting a{{n}} as n, nested counts multiplied), over this server's limit of {MAX_PATTERN_REPEATS}",
            param=_FIELD_OF_KIND[constraint.kind],
        )


def _patterns(value: Any):
    """Every regex a JSON schema holds: "pattern" values and "patternProperties" keys, anywhere."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                yield node["pattern"]
            if isinstance(node.get("patternProperties"), dict):
                yield from (key for key in node["patternProperties"] if isinstance(key, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def pattern_repeats(pattern: str) -> int:
    """The repetitions a regex asks for: each counted quantifier ({n}, {n,}, {n,m}) adds its largest
    count, times the counts of the groups around it. Escapes and character classes are skipped;
    *, + and ? count once (a grammar rule each, whatever the text's length)."""
    group_count: dict[int, int] = {}  # a group's opening index -> the count of its quantifier
    opened: list[int] = []
    for i, char in _structure(pattern):
        if char == "(":
            opened.append(i)
        elif char == ")" and opened:
            quantifier = _QUANTIFIER.match(pattern, i + 1)
            group_count[opened.pop()] = _largest(quantifier) if quantifier else 1
    total, multipliers = 0, [1]
    for i, char in _structure(pattern):
        if char == "(":
            multipliers.append(multipliers[-1] * group_count.get(i, 1))
        elif char == ")" and len(multipliers) > 1:
            multipliers.pop()
        elif char == "{" and (quantifier := _QUANTIFIER.match(pattern, i)):
            total += _largest(quantifier) * multipliers[-1]
    return total


def _structure(pattern: str) -> Iterator[tuple[int, str]]:
    """Each character of a regex that is not escaped nor in a character class, with its index."""
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
        elif char == "[":
            i = _class_end(pattern, i)
        else:
            yield i, char
            i += 1


def _largest(quantifier: re.Match) -> int:
    low, high = quantifier.group(1), quantifier.group(2)
    return int(high) if high else int(low)


def _class_end(pattern: str, start: int) -> int:
    i = start + 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: each choice a literal, escaped as JSON escapes it (xgrammar's EBNF
    reads the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def schema_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted up to ``limit + 1`` (a deeper one is not walked)."""
    depth = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        depth = max(depth, level)
        if depth > limit:
            return depth
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, level + 1) for child in children)
    return depth
