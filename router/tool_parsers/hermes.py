"""Hermes / Qwen 2.5 / Qwen 3 tool calls: JSON objects in ``<tool_call>`` blocks.

::

    I'll look both up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>

Content may come before, between and after the blocks. A block left open at the end of the answer
(the model stopped on ``</tool_call>`` or ran out of tokens) is still a call if its JSON is whole.
"""

from __future__ import annotations

from typing import Any

from router.tool_parsers.base import json_schema_format, tool_functions
from router.tool_parsers.scanning import Event, ScannedParser, Scanner, call_from_object, loads, partial_marker_len

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesScanner(Scanner):
    def __init__(self, tool_names: frozenset[str]) -> None:
        self._tool_names = tool_names
        self._buffer = ""  # outside a block: a possible start of OPEN; inside: the block's body so far
        self._in_block = False
        self._searched = 0  # inside a block: CLOSE does not start before this index

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._in_block:
                start = self._buffer.find(OPEN)
                if start < 0:
                    cut = len(self._buffer) - partial_marker_len(self._buffer, OPEN)
                    if cut:
                        events.append(self._buffer[:cut])
                        self._buffer = self._buffer[cut:]
                    return events
                if start:
                    events.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_block, self._searched = True, 0
                continue
            end = self._buffer.find(CLOSE, self._searched)
            if end < 0:
                self._searched = max(0, len(self._buffer) - len(CLOSE) + 1)
                return events
            events.append(self._block(self._buffer[:end], closed=True))
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._in_block = False

    def finish(self) -> list[Event]:
        rest, in_block = self._buffer, self._in_block
        self._buffer, self._in_block = "", False
        if in_block:
            return [self._block(rest, closed=False)]
        return [rest] if rest else []

    def _block(self, body: str, closed: bool) -> Event:
        call = call_from_object(loads(body.strip()), self._tool_names)
        if call is not None:
            return call
        return OPEN + body + (CLOSE if closed else "")


class HermesParser(ScannedParser):
    name = "hermes"

    scanner_class = HermesScanner

    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Qwen's own layout (xgrammar's "qwen_3" builtin without its reasoning part)::

        triggered_tags(trigger "<tool_call>"):
            '<tool_call>\\n{"name": "NAME", "arguments": ' SCHEMA '}\\n</tool_call>'   (one tag per tool)
        """
        functions = tool_functions(tools)
        if not functions:
            return None
        tags = [
            {
                "type": "tag",
                "begin": f'{OPEN}\n{{"name": "{name}", "arguments": ',
                "content": json_schema_format(schema),
                "end": f"}}\n{CLOSE}",
            }
            for name, schema in functions
        ]
        return {
            "type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [OPEN], "tags": tags, "stop_after_first": not parallel},
        }
