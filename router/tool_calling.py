"""Tool calling on the server: which parser reads the model's calls, how a request's ``tool_choice``
constrains its answer, and how the answer's text becomes OpenAI's ``tool_calls``.

    tool_choice   constraint (sampling.structured_output)          answer read by
    none          none                                             (text)
    auto          the parser's structural tag (calls well-formed)  the parser (vLLM's --tool-call-parser)
    required      JSON list of {"name", "parameters"}, >= 1 item   RequiredCalls
    named         the function's parameters schema                 NamedCall

``finish_reason`` is "tool_calls" when an answer under auto or required called a tool (OpenAI's);
a named function's answer ends with "stop", as OpenAI's and vLLM's do.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from common.errors import InvalidRequestError
from common.structured_outputs import ConstraintKind, StructuredOutput
from router.tool_parsers import detect_parser, get_parser
from router.tool_parsers.base import (
    ParsedOutput,
    StreamPiece,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    openai_call_id,
)
from router.tool_request import ToolUse

# Each format's markers: where the tokenizer has one as a special token, answers are decoded with
# special tokens kept, or the parser would never see a call (vLLM does so for Mistral's).
_MARKERS = {"mistral": ("[TOOL_CALLS]", "[ARGS]"), "llama3_json": ("<|python_tag|>",), "hermes": ("<tool_call>",)}


def hermes_template() -> str:
    """A ChatML template that shows tools the Hermes way, for a model whose own template ignores them."""
    return resources.files("common.chat_templates").joinpath("hermes_tools.jinja").read_text()


@dataclass(frozen=True)
class ToolCalling:
    """The server's tool calling: ``parser`` None refuses tool_choice auto (vLLM's rule without
    --enable-auto-tool-choice); ``template`` renders requests with tools when the model's own
    template does not show them."""

    parser: ToolParser | None
    template: str | None = None
    keep_special_tokens: bool = False  # the parser's markers are special tokens of the tokenizer

    @classmethod
    def configure(
        cls,
        parser_name: str | None,
        enable_auto: bool,
        model_template: str | None,
        special_tokens: frozenset[str] = frozenset(),
    ) -> ToolCalling:
        """``parser_name`` "auto": the model's template says which (hermes where it says nothing);
        ``special_tokens``: the tokenizer's."""
        name = parser_name
        if name == "auto":
            name = detect_parser(model_template) or "hermes"
        parser = get_parser(name) if name and enable_auto else None
        shows_tools = model_template is not None and "tools" in model_template
        template = None if shows_tools or (parser is not None and parser.name != "hermes") else hermes_template()
        keep = parser is not None and any(marker in special_tokens for marker in _MARKERS.get(parser.name, ()))
        return cls(parser, template, keep)

    def constrain(self, use: ToolUse, structured: StructuredOutput | None) -> StructuredOutput | None:
        """The answer's constraint under ``use.choice``; refuses what cannot be served."""
        if use.choice == "none":
            return structured
        if structured is not None:
            message = f"tool_choice {use.choice!r} cannot be combined with an output constraint (response_format)"
            raise InvalidRequestError(message, param="tool_choice")
        if use.choice == "function":
            assert use.name is not None
            return _json(use.function(use.name).parameters)
        if use.choice == "required":
            return _json(_required_schema(use))
        if self.parser is None:
            message = '"auto" tool choice needs the server started with --enable-auto-tool-choice --tool-call-parser'
            raise InvalidRequestError(message, param="tool_choice")
        tag = self.parser.structural_tag(use.as_openai(), use.parallel)
        if tag is None:
            return None
        return StructuredOutput(ConstraintKind.STRUCTURAL_TAG, json.dumps(tag, separators=(",", ":")))

    def adjust_sampling(self, use: ToolUse, sampling: Any) -> Any:
        """The request's sampling for its answer to be read: the constraint, and special tokens kept
        where the parser's markers are special tokens."""
        constraint = self.constrain(use, sampling.structured_output)
        skip = sampling.skip_special_tokens and not (use.choice == "auto" and self.keep_special_tokens)
        return dataclasses.replace(sampling, structured_output=constraint, skip_special_tokens=skip)

    def reader(self, use: ToolUse) -> ToolParser | None:
        """What reads the answer's text into calls; None: it is text (tool_choice none)."""
        if use.choice == "none":
            return None
        if use.choice == "function":
            assert use.name is not None
            return NamedCall(use.name)
        if use.choice == "required":
            return RequiredCalls()
        return self.parser


def _json(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(ConstraintKind.JSON, json.dumps(schema, separators=(",", ":"), sort_keys=True))


def _required_schema(use: ToolUse) -> dict[str, Any]:
    """vLLM's form for tool_choice required: a list of calls, each a tool's name and parameters."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "parameters": f.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in use.functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not use.parallel:
        schema["maxItems"] = 1
    return schema


def finish_reason_with_calls(use: ToolUse, num_calls: int, finish_reason: str | None) -> str | None:
    """An answer that called a tool under auto or required ends with "tool_calls" (OpenAI's);
    under a named function, with its own reason (OpenAI's and vLLM's)."""
    if finish_reason is None or not num_calls or use.choice == "function":
        return finish_reason
    return "tool_calls"


class NamedCall(ToolParser):
    """tool_choice names a function: the whole answer is its arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, tool_names: frozenset[str]) -> ParsedOutput:
        return ParsedOutput(None, (ToolCall(openai_call_id(), self.function, text),))

    def streamer(self, tool_names: frozenset[str]) -> ToolStreamer:
        return _NamedStreamer(self.function)

    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        return None


class _NamedStreamer(ToolStreamer):
    """The call's id and name first, then the arguments as they are written (OpenAI's shape)."""

    def __init__(self, function: str) -> None:
        self.function = function
        self.started = False

    def feed(self, delta_text: str) -> StreamPiece:
        if not self.started:
            self.started = True
            return StreamPiece(tool_calls=(ToolCallDelta(0, openai_call_id(), self.function, delta_text),))
        return StreamPiece(tool_calls=(ToolCallDelta(0, None, None, delta_text),)) if delta_text else StreamPiece()

    def finish(self) -> StreamPiece:
        return self.feed("") if not self.started else StreamPiece()


class RequiredCalls(ToolParser):
    """tool_choice required: the answer is a JSON list of {"name", "parameters"}."""

    name = "required"

    def parse(self, text: str, tool_names: frozenset[str]) -> ParsedOutput:
        try:
            items = json.loads(text)
        except ValueError:  # cut off by max_tokens: what was written is the content
            return ParsedOutput(text or None, ())
        if not isinstance(items, list):
            return ParsedOutput(text or None, ())
        calls = tuple(
            ToolCall(openai_call_id(), item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
            for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str)
        )
        return ParsedOutput(None, calls)

    def streamer(self, tool_names: frozenset[str]) -> ToolStreamer:
        return _WholeAnswerStreamer(self, tool_names)

    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        return None


class _WholeAnswerStreamer(ToolStreamer):
    """Holds the answer and gives its calls when it ends (each call whole, in one delta)."""

    def __init__(self, parser: ToolParser, tool_names: frozenset[str]) -> None:
        self.parser, self.tool_names = parser, tool_names
        self.text: list[str] = []

    def feed(self, delta_text: str) -> StreamPiece:
        self.text.append(delta_text)
        return StreamPiece()

    def finish(self) -> StreamPiece:
        parsed = self.parser.parse("".join(self.text), self.tool_names)
        deltas = tuple(ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(parsed.tool_calls))
        return StreamPiece(parsed.content or "", deltas)
