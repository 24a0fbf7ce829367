"""Mistral tool calls, after the ``[TOOL_CALLS]`` control token, in either of its two layouts.

::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   tokenizers < v11
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}            tokenizers v11+

Content may come before ``[TOOL_CALLS]`` (and, read leniently, between and after). A list is all
or nothing: one element that is not a valid call leaves the whole block as content. The scanner,
after each ``[TOOL_CALLS]``::

    MARKER --"[" or "{"--> LIST --list closes--> calls, or the block as content --> TEXT
       |
       +--name chars--> NAME --"[ARGS]" ws "{"--> ARGS --object closes--> a call or content --> TEXT
                          +--anything else--> "[TOOL_CALLS]" is content --> TEXT
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

from router.tool_parsers.base import json_schema_format, mistral_call_id, tool_functions
from router.tool_parsers.scanning import (
    Event,
    JsonSpan,
    ScannedParser,
    StepScanner,
    call_from_object,
    loads,
    partial_marker_len,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"\s*[\w.\-]*")  # what a function name (with the spaces before it) may be, as it arrives


class _State(Enum):
    TEXT = "text"  # content, watching for TOOL_CALLS
    MARKER = "marker"  # just after TOOL_CALLS
    LIST = "list"  # inside the JSON list (or lone object) of the old layout
    NAME = "name"  # reading a function name up to ARGS
    ARGS = "args"  # inside the arguments object of the new layout


class MistralScanner(StepScanner):
    def __init__(self, tool_names: frozenset[str]) -> None:
        self._tool_names = tool_names
        self._buffer = ""  # unsettled text; after TOOL_CALLS it is the text since the marker
        self._state = _State.TEXT
        self._span: JsonSpan | None = None
        self._name = ""

    def finish(self) -> list[Event]:
        # Whatever is still open was not a whole call: it stays content as written.
        rest = self._buffer if self._state is _State.TEXT else TOOL_CALLS + self._buffer
        self._buffer, self._state = "", _State.TEXT
        return [rest] if rest else []

    def _step(self, events: list[Event]) -> bool:
        """Settles what it can; True when the state changed and another step may settle more."""
        buffer = self._buffer
        if self._state is _State.TEXT:
            start = buffer.find(TOOL_CALLS)
            cut = len(buffer) - partial_marker_len(buffer, TOOL_CALLS) if start < 0 else start
            if cut:
                events.append(buffer[:cut])
            if start < 0:
                self._buffer = buffer[cut:]
                return False
            self._buffer, self._state = buffer[start + len(TOOL_CALLS) :], _State.MARKER
            return True
        if self._state is _State.MARKER:
            stripped = buffer.lstrip()
            if not stripped:
                return False
            if stripped[0] in "[{":
                self._state, self._span = _State.LIST, JsonSpan(len(buffer) - len(stripped))
            else:
                self._state = _State.NAME
            return True
        if self._state is _State.NAME:
            return self._step_name(events)
        assert self._span is not None
        end = self._span.end(buffer)
        if end is None:
            return False
        value = loads(buffer[self._span.start : end])
        if self._state is _State.LIST:
            calls = [
                call_from_object(item, self._tool_names) for item in (value if isinstance(value, list) else [value])
            ]
        else:
            calls = [call_from_object({"name": self._name, "arguments": value}, self._tool_names)]
        if calls and all(call is not None for call in calls):
            events.extend(call for call in calls if call is not None)
        else:
            events.append(TOOL_CALLS + buffer[:end])
        self._buffer, self._state = buffer[end:], _State.TEXT
        return True

    def _step_name(self, events: list[Event]) -> bool:
        buffer = self._buffer
        args = buffer.find(ARGS)
        if args < 0:
            settled = buffer[: len(buffer) - partial_marker_len(buffer, ARGS)]
            if _NAME.fullmatch(settled):
                return False
            return self._not_a_call(events)
        if not _NAME.fullmatch(buffer[:args]):
            return self._not_a_call(events)
        after = buffer[args + len(ARGS) :]
        stripped = after.lstrip()
        if not stripped:
            return False
        if stripped[0] != "{":
            return self._not_a_call(events)
        self._name = buffer[:args].strip()
        self._state, self._span = _State.ARGS, JsonSpan(len(buffer) - len(stripped))
        return True

    def _not_a_call(self, events: list[Event]) -> bool:
        # Only the marker is settled as content: the text after it may hold the next marker.
        events.append(TOOL_CALLS)
        self._state = _State.TEXT
        return True


class MistralParser(ScannedParser):
    name = "mistral"

    scanner_class = MistralScanner
    new_call_id = staticmethod(mistral_call_id)

    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Both layouts, so one tag serves every Mistral tokenizer version::

        triggered_tags(trigger "[TOOL_CALLS]"):
            "[TOOL_CALLS]NAME[ARGS]" SCHEMA                                   (one tag per tool, v11+)
            "[TOOL_CALLS][" tags_with_separator(separator ", ", at_least_one,
                '{"name": "NAME", "arguments": ' SCHEMA '}') "]"               (one list tag, < v11)
        """
        functions = tool_functions(tools)
        if not functions:
            return None
        args_tags = [
            {"type": "tag", "begin": f"{TOOL_CALLS}{name}{ARGS}", "content": json_schema_format(schema), "end": ""}
            for name, schema in functions
        ]
        list_items = {
            "type": "tags_with_separator",
            "tags": [
                {
                    "type": "tag",
                    "begin": f'{{"name": "{name}", "arguments": ',
                    "content": json_schema_format(schema),
                    "end": "}",
                }
                for name, schema in functions
            ],
            "separator": ", ",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        list_tag = {"type": "tag", "begin": f"{TOOL_CALLS}[", "content": list_items, "end": "]"}
        return {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": [TOOL_CALLS],
                "tags": [*args_tags, list_tag],
                "stop_after_first": not parallel,
            },
        }
