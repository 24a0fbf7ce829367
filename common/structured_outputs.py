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
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError

# What a client may send, whatever the server's limits (the router's config may lower them).
MAX_SPEC_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1024


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
