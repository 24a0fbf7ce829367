"""A chat request's tools, and what ``tool_choice`` asks of them, checked as OpenAI checks them.

    tools              [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
    tool_choice        "none" | "auto" (the default with tools) | "required"
                       | {"type": "function", "function": {"name"}}
    parallel_tool_calls   false: at most one call per answer

What each choice constrains (router/tool_calling.py builds it, with the server's parser):

    none       nothing; the answer is text (the tools are still shown to the model, as OpenAI does)
    auto       free text, but a call the model starts is held to its format and its function's schema
    required   a JSON list of {"name", "parameters"} (one or more calls), always parseable
    named      the named function's arguments, as JSON matching its parameters
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (dots as vLLM allows)


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema; {"type": "object"} when the client gave none

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's ``tools`` entry (what chat templates and parsers read)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    functions: tuple[ToolFunction, ...]
    choice: str  # "none", "auto", "required", or "function" (then ``name``)
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(function.name for function in self.functions)

    def function(self, name: str) -> ToolFunction:
        return next(function for function in self.functions if function.name == name)

    def as_openai(self) -> list[dict[str, Any]]:
        return [function.as_openai() for function in self.functions]


def parse_tools(body: dict[str, Any]) -> ToolUse | None:
    """The request's tools (None: it has none). InvalidRequestError names the bad field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):  # OpenAI's rule: nothing to choose from
            raise InvalidRequestError("tool_choice needs tools: the request gives none", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [function.name for function in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", param="tools")
    kind, name = _choice(choice, set(names))
    return ToolUse(functions, kind, name, True if parallel is None else parallel)


def _function(tool: object, index: int) -> ToolFunction:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        message = f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}"
        raise InvalidRequestError(message, param="tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string", param="tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object", param="tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.function.strict must be a boolean", param="tools")
    return ToolFunction(name, description, parameters)


def _choice(choice: object, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return str(choice), None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in names:
            known = ", ".join(sorted(names))
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not among the tools ({known})", param="tool_choice"
            )
        return "function", name
    message = 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    raise InvalidRequestError(message, param="tool_choice")
