"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer itself is the call.

::

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

An answer is read as calls only when it (stripped) starts with ``{`` or ``<|python_tag|>``; any
other answer is content, even one that quotes a call further on. Calls follow one another, ``;``
between them; "arguments" is accepted for "parameters". The first object that is not a valid call
ends the calls: it and everything after it are content (all of the answer when it is the first).

The scanner's states, in the order an answer goes through them::

    START --"{" or tag+"{"--> OBJECT --valid call--> BETWEEN --";" ws "{"--> OBJECT ...
      |                         |                     |
      +--other text--> TEXT <---+--not a call         +--other text--> TEXT
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from router.tool_parsers.base import json_schema_format, tool_functions
from router.tool_parsers.scanning import (
    Event,
    JsonSpan,
    ScannedParser,
    StepScanner,
    call_from_object,
    loads,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "
_ARGUMENT_KEYS = ("parameters", "arguments")


class _State(Enum):
    START = "start"  # nothing but whitespace (and perhaps the python tag) seen yet
    OBJECT = "object"  # inside an object that may be a call
    BETWEEN = "between"  # after a call: a separator and another object, or the end
    TEXT = "text"  # the rest of the answer is content


class Llama3JsonScanner(StepScanner):
    def __init__(self, tool_names: frozenset[str]) -> None:
        self._tool_names = tool_names
        self._buffer = ""  # unsettled text; in OBJECT it is the text before the object, then the object
        self._state = _State.START
        self._span: JsonSpan | None = None

    def finish(self) -> list[Event]:
        events: list[Event] = []
        rest = self._buffer
        # A lone ";" after the last call is a dangling separator, not something to show.
        if not (self._state is _State.BETWEEN and rest.strip() == ";") and rest:
            events.append(rest)
        self._buffer, self._state = "", _State.TEXT
        return events

    def _step(self, events: list[Event]) -> bool:
        """Settles what it can; True when the state changed and another step may settle more."""
        buffer = self._buffer
        if self._state is _State.TEXT:
            if buffer:
                events.append(buffer)
                self._buffer = ""
            return False
        if self._state is _State.OBJECT:
            assert self._span is not None
            end = self._span.end(buffer)
            if end is None:
                return False
            call = call_from_object(loads(buffer[self._span.start : end]), self._tool_names, _ARGUMENT_KEYS)
            if call is None:
                self._state = _State.TEXT  # the separator or tag before the object is content too
                return True
            events.append(call)
            self._buffer, self._state = buffer[end:], _State.BETWEEN
            return True
        start = self._object_start(buffer)
        if start is None:
            return False
        if start < 0:
            self._state = _State.TEXT
        else:
            self._state, self._span = _State.OBJECT, JsonSpan(start)
        return True

    def _object_start(self, buffer: str) -> int | None:
        """Where the next object opens; -1 when none will (the rest is content); None: undecided."""
        stripped = buffer.lstrip()
        offset = len(buffer) - len(stripped)
        if self._state is _State.START:
            if stripped.startswith(PYTHON_TAG):
                offset += len(PYTHON_TAG)
                stripped = stripped[len(PYTHON_TAG) :]
                after_tag = stripped.lstrip()
                offset += len(stripped) - len(after_tag)
                stripped = after_tag
            elif PYTHON_TAG.startswith(stripped):
                return None
        elif stripped.startswith(";"):
            after = stripped[1:].lstrip()
            offset += len(stripped) - len(after)
            stripped = after
        elif not stripped:
            return None
        else:
            return -1
        if not stripped:
            return None
        return offset if stripped[0] == "{" else -1


class Llama3JsonParser(ScannedParser):
    name = "llama3_json"

    scanner_class = Llama3JsonScanner

    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """Either the answer is calls, or it is text that cannot be mistaken for one::

        or(
            sequence(optional("<|python_tag|>"),
                     tags_with_separator(separator "; ", at_least_one,
                         '{"name": "NAME", "parameters": ' SCHEMA '}')),   (one tag per tool)
            sequence(regex "[^{<\\s]|<[^|]", any_text),
        )

        Unlike xgrammar's "llama" builtin (which triggers on '{"name": ' anywhere) it matches what
        the parser reads: a call starts the answer, and the text branch cannot begin with "{".
        """
        functions = tool_functions(tools)
        if not functions:
            return None
        calls = {
            "type": "tags_with_separator",
            "tags": [
                {
                    "type": "tag",
                    "begin": f'{{"name": "{name}", "parameters": ',
                    "content": json_schema_format(schema),
                    "end": "}",
                }
                for name, schema in functions
            ],
            "separator": SEPARATOR,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        tagged_calls = {
            "type": "sequence",
            "elements": [{"type": "optional", "content": {"type": "const_string", "value": PYTHON_TAG}}, calls],
        }
        text = {
            "type": "sequence",
            "elements": [{"type": "regex", "pattern": r"[^{<\s]|<[^|]"}, {"type": "any_text"}],
        }
        return {"type": "structural_tag", "format": {"type": "or", "elements": [tagged_calls, text]}}
