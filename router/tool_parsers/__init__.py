"""Tool-call parsers by vLLM's ``--tool-call-parser`` names, loaded on first use.

``get_parser("hermes")`` gives a ``ToolParser``; ``detect_parser(chat_template)`` names the one a
chat template's own text asks for, when a deployment does not say.
"""

from __future__ import annotations

import importlib

from router.tool_parsers.base import (
    ParsedOutput,
    StreamPiece,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
)

# name -> "module:class", imported only when asked for.
PARSERS: dict[str, str] = {
    "hermes": "router.tool_parsers.hermes:HermesParser",
    "llama3_json": "router.tool_parsers.llama3_json:Llama3JsonParser",
    "mistral": "router.tool_parsers.mistral:MistralParser",
}

ALIASES: dict[str, str] = {
    "qwen": "hermes",
    "qwen2_5": "hermes",
    "qwen3": "hermes",
    "llama": "llama3_json",
    "llama3": "llama3_json",
    "llama4_json": "llama3_json",
}

__all__ = [
    "ALIASES",
    "PARSERS",
    "ParsedOutput",
    "StreamPiece",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamer",
    "detect_parser",
    "get_parser",
]


def get_parser(name: str) -> ToolParser:
    """The parser called ``name`` (or one of its aliases); ValueError names the known ones."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in PARSERS:
        known = ", ".join(sorted([*PARSERS, *ALIASES]))
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {known}")
    module_name, class_name = PARSERS[key].split(":")
    parser = getattr(importlib.import_module(module_name), class_name)()
    assert isinstance(parser, ToolParser), f"{PARSERS[key]} is not a ToolParser"
    return parser


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's text implies, or None when it shows no known tool format.

    Hermes and Mistral templates spell their markers out; Llama 3.1+ templates show the python tag,
    the "ipython" role of tool results, or ask for ``{"name": ..., "parameters": ...}`` objects.
    """
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    is_llama = "<|start_header_id|>" in chat_template
    if (
        "<|python_tag|>" in chat_template
        or "ipython" in chat_template
        or (is_llama and '"parameters"' in chat_template)
    ):
        return "llama3_json"
    return None
