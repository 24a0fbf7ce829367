"""A request's output constraint, from whichever field the client used to ask for it.

    response_format {"type": "json_object"}                     OpenAI
    response_format {"type": "json_schema", "json_schema": {...}} OpenAI (``strict`` honoured: the
                                                                  output always matches the schema)
    structured_outputs {json | regex | choice | grammar | json_object | structural_tag}   vLLM
    guided_json | guided_regex | guided_choice | guided_grammar  vLLM before 0.11

At most one may be set. Each is checked here, before any replica sees it: its size and nesting
against the router's limits, and xgrammar's parse of it (a schema xgrammar cannot convert, a regex
that does not compile, an EBNF with an undefined rule): a 400 naming the field, nothing allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from common.structured_outputs import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_BYTES,
    ConstraintKind,
    StructuredOutput,
    schema_depth,
)

_STRUCTURED_OUTPUTS_KINDS = {
    "json": ConstraintKind.JSON,
    "regex": ConstraintKind.REGEX,
    "choice": ConstraintKind.CHOICE,
    "grammar": ConstraintKind.GRAMMAR,
    "json_object": ConstraintKind.JSON_OBJECT,
    "structural_tag": ConstraintKind.STRUCTURAL_TAG,
}
_GUIDED_FIELDS = {
    "guided_json": ConstraintKind.JSON,
    "guided_regex": ConstraintKind.REGEX,
    "guided_choice": ConstraintKind.CHOICE,
    "guided_grammar": ConstraintKind.GRAMMAR,
}
# Options of structured_outputs that change nothing here (xgrammar is the one backend).
_HARMLESS_OPTIONS = frozenset({"backend", "disable_fallback", "disable_additional_properties", "whitespace_pattern"})
_BACKENDS = frozenset({"auto", "xgrammar", None})


@dataclass(frozen=True)
class ConstraintLimits:
    """What the router accepts (router.max_constraint_bytes, router.max_schema_depth)."""

    max_bytes: int = MAX_SPEC_BYTES
    max_depth: int = MAX_SCHEMA_DEPTH


def parse_constraint(body: dict[str, Any], limits: ConstraintLimits = ConstraintLimits()) -> StructuredOutput | None:
    """The request's constraint (None: the output is free), checked. InvalidRequestError names the
    bad field (the caller's 400)."""
    found = [(name, body[name]) for name in _SOURCES if body.get(name) is not None]
    found = [(name, value) for name, value in found if not (name == "response_format" and _is_text(value))]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(f"give one output constraint, not several ({names})", param=found[1][0])
    name, value = found[0]
    if name.startswith("guided_") and body.get("guided_decoding_backend") not in _BACKENDS:
        message = (
            f"guided_decoding_backend {body['guided_decoding_backend']!r} is not served; this server uses xgrammar"
        )
        raise InvalidRequestError(message, param="guided_decoding_backend")
    constraint = _SOURCES[name](value, limits)
    try:
        constraint.grammar()  # the same parse a replica's compile starts with
    except InvalidRequestError as exc:  # named by the field the client sent
        raise InvalidRequestError(exc.message, param=_field_sent(name, value)) from None
    return constraint


def check_tool_constraint(constraint: StructuredOutput, limits: ConstraintLimits) -> None:
    """The constraint a request's tools make (router/tool_calling.py), held to the same limits and
    parse as a client's own; a refusal names ``tools``."""
    try:
        _check_size(constraint.spec, "tools", limits)
        if schema_depth(json.loads(constraint.spec), limits.max_depth + 8) > limits.max_depth + 8:
            # The tools' wrapping (a list of calls, a tag) adds a few levels to their schemas'.
            raise InvalidRequestError(f"a tool's parameters are nested deeper than {limits.max_depth}", param="tools")
        constraint.grammar()
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param="tools") from None


def _field_sent(name: str, value: Any) -> str:
    if name == "response_format":
        return "response_format.json_schema" if value.get("type") == "json_schema" else name
    if name == "structured_outputs":
        kind = next(key for key in _STRUCTURED_OUTPUTS_KINDS if value.get(key) not in (None, False))
        return f"{name}.{kind}"
    return name


def _is_text(response_format: object) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "text"


def _from_response_format(value: object, limits: ConstraintLimits) -> StructuredOutput:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError('response_format must be an object with a "type"', param="response_format")
    kind = value["type"]
    if kind == "json_object":
        return StructuredOutput(ConstraintKind.JSON_OBJECT)
    if kind != "json_schema":
        message = f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}'
        raise InvalidRequestError(message, param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object", param="response_format.json_schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean", param="response_format")
    # OpenAI's schema field is "schema"; vLLM also reads "json_schema" (some clients send it).
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        schema = {}  # OpenAI's default: any JSON
    return _json_constraint(schema, "response_format.json_schema.schema", limits)


def _json_constraint(
    schema: object, field: str, limits: ConstraintLimits, whitespace: bool = False
) -> StructuredOutput:
    if isinstance(schema, str):  # vLLM takes a schema given as JSON text
        try:
            schema = json.loads(schema)
        except ValueError:
            raise InvalidRequestError(f"{field} is not valid JSON", param=field) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{field} must be a JSON schema (an object)", param=field)
    if schema_depth(schema, limits.max_depth) > limits.max_depth:
        message = f"{field} is nested deeper than this server's limit of {limits.max_depth} (router.max_schema_depth)"
        raise InvalidRequestError(message, param=field)
    spec = json.dumps(schema, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    _check_size(spec, field, limits)
    return StructuredOutput(ConstraintKind.JSON, spec, whitespace)


def _check_size(spec: str, field: str, limits: ConstraintLimits) -> None:
    size = len(spec.encode())
    if size > limits.max_bytes:
        message = (
            f"{field} is {size} bytes, over this server's limit of {limits.max_bytes} (router.max_constraint_bytes)"
        )
        raise InvalidRequestError(message, param=field)


def _text_constraint(kind: ConstraintKind, value: object, field: str, limits: ConstraintLimits) -> StructuredOutput:
    if kind is ConstraintKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(f"{field} must be a non-empty list of non-empty strings", param=field)
        if len(value) > MAX_CHOICES:
            raise InvalidRequestError(f"{field} has {len(value)} choices, more than {MAX_CHOICES}", param=field)
        spec = json.dumps(value, ensure_ascii=False)
    elif kind is ConstraintKind.STRUCTURAL_TAG:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequestError(f"{field} is not valid JSON", param=field) from None
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{field} must be an object", param=field)
        if schema_depth(value, limits.max_depth) > limits.max_depth:
            raise InvalidRequestError(f"{field} is nested deeper than {limits.max_depth}", param=field)
        spec = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{field} must be a non-empty string", param=field)
        spec = value
    _check_size(spec, field, limits)
    return StructuredOutput(kind, spec)


def _from_structured_outputs(value: object, limits: ConstraintLimits) -> StructuredOutput:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KINDS) - _HARMLESS_OPTIONS - {"disable_any_whitespace"})
    if unknown:
        message = f"structured_outputs.{unknown[0]} is not supported by this server"
        raise InvalidRequestError(message, param=f"structured_outputs.{unknown[0]}")
    if value.get("backend") not in _BACKENDS:
        message = f"structured_outputs.backend {value['backend']!r} is not served here; this server uses xgrammar"
        raise InvalidRequestError(message, param="structured_outputs.backend")
    if value.get("whitespace_pattern") is not None:
        message = "structured_outputs.whitespace_pattern is not supported; use disable_any_whitespace"
        raise InvalidRequestError(message, param="structured_outputs.whitespace_pattern")
    no_whitespace = value.get("disable_any_whitespace")
    if no_whitespace is not None and not isinstance(no_whitespace, bool):
        raise InvalidRequestError(
            "structured_outputs.disable_any_whitespace must be a boolean", param="structured_outputs"
        )
    kinds = [(name, kind) for name, kind in _STRUCTURED_OUTPUTS_KINDS.items() if value.get(name) not in (None, False)]
    if len(kinds) != 1:
        names = ", ".join(_STRUCTURED_OUTPUTS_KINDS)
        raise InvalidRequestError(f"structured_outputs must set exactly one of {names}", param="structured_outputs")
    name, kind = kinds[0]
    field = f"structured_outputs.{name}"
    whitespace = no_whitespace is False  # asked for vLLM's default: any whitespace between JSON tokens
    if kind is ConstraintKind.JSON:
        return _json_constraint(value[name], field, limits, whitespace)
    if kind is ConstraintKind.JSON_OBJECT:
        return StructuredOutput(ConstraintKind.JSON_OBJECT, "", whitespace)
    return _text_constraint(kind, value[name], field, limits)


def _guided(name: str):
    kind = _GUIDED_FIELDS[name]

    def parse(value: object, limits: ConstraintLimits) -> StructuredOutput:
        if kind is ConstraintKind.JSON:
            return _json_constraint(value, name, limits)
        return _text_constraint(kind, value, name, limits)

    return parse


_SOURCES = {
    "response_format": _from_response_format,
    "structured_outputs": _from_structured_outputs,
    **{name: _guided(name) for name in _GUIDED_FIELDS},
}
