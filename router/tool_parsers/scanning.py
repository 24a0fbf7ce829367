"""The machinery the three formats share: a scanner per format, one streamer over all of them.

A format's ``Scanner`` cuts the answer, as it arrives, into events in text order: content
strings (text that is settled as not being a call) and ``FoundCall``s. It decides a call once its
text is complete, so its events are the same however the text is chunked. ``ScannedStreamer``
turns events into ``StreamPiece``s, and ``ScannedParser.parse`` is the same streamer fed the whole
text at once: one code path, so streamed and whole answers cannot disagree.

Whitespace: the content is the text outside calls, joined and stripped at both ends (the
newlines around a call are its layout, not something to show). The streamer therefore holds
trailing whitespace back until non-whitespace content follows, and drops it at the end::

    "Let me check.\\n<tool_call>…</tool_call>\\n"  ->  content "Let me check.", one call
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.tool_parsers.base import (
    ParsedOutput,
    StreamPiece,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    openai_call_id,
)


@dataclass(frozen=True, slots=True)
class FoundCall:
    name: str
    arguments: str  # JSON text of an object


Event = str | FoundCall


class Scanner(ABC):
    """Cuts one answer into content and calls; a fresh one per answer, made with the request's
    tool names (a call naming another is content)."""

    @abstractmethod
    def __init__(self, tool_names: frozenset[str]) -> None: ...

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The next text; returns the events it settles (possibly none)."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The answer ended: settles everything still held."""


class StepScanner(Scanner):
    """A scanner that settles its buffer step by step: ``feed`` appends the text, then steps until
    a step changes nothing."""

    _buffer: str

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    @abstractmethod
    def _step(self, events: list[Event]) -> bool:
        """Settles what it can into ``events``; True when another step may settle more."""


class ScannedStreamer(ToolStreamer):
    def __init__(self, scanner: Scanner, new_id: Callable[[], str]) -> None:
        self._scanner = scanner
        self._new_id = new_id
        self._held = ""  # trailing whitespace not shown yet: dropped unless content follows
        self._shown = False  # some content was shown: leading whitespace is stripped until then
        self._num_calls = 0

    def feed(self, delta_text: str) -> StreamPiece:
        return self._piece(self._scanner.feed(delta_text))

    def finish(self) -> StreamPiece:
        return self._piece(self._scanner.finish())

    def _piece(self, events: list[Event]) -> StreamPiece:
        shown: list[str] = []
        calls: list[ToolCallDelta] = []
        for event in events:
            if isinstance(event, FoundCall):
                # The whole call in one delta: it is only known to be a call once complete.
                calls.append(ToolCallDelta(self._num_calls, self._new_id(), event.name, event.arguments))
                self._num_calls += 1
                continue
            text = self._held + event
            body = text.rstrip()
            if not body:
                self._held = text
                continue
            shown.append(body if self._shown else body.lstrip())
            self._held, self._shown = text[len(body) :], True
        return StreamPiece("".join(shown), tuple(calls))


class ScannedParser(ToolParser):
    """A parser whose format is a ``Scanner``; parse and stream share it."""

    scanner_class: type[Scanner]  # one per answer, given the request's tool names
    new_call_id: Callable[[], str] = staticmethod(openai_call_id)

    def streamer(self, tool_names: frozenset[str]) -> ToolStreamer:
        return ScannedStreamer(self.scanner_class(tool_names), self.new_call_id)

    def parse(self, text: str, tool_names: frozenset[str]) -> ParsedOutput:
        streamer = self.streamer(tool_names)
        pieces = (streamer.feed(text), streamer.finish())
        content = "".join(piece.content for piece in pieces)
        calls = tuple(
            ToolCall(delta.id or "", delta.name or "", delta.arguments)
            for piece in pieces
            for delta in piece.tool_calls
        )
        return ParsedOutput(content or None, calls)


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker`` (text to hold back)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class JsonSpan:
    """Where a JSON object or array that opens at ``start`` closes, found as its text arrives.

    Counts brackets outside strings; whether the span is valid JSON is for ``json.loads`` to say.
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str) -> int | None:
        """The index just past the closing bracket in ``text`` (which only grows), or None yet."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for pos in range(self._pos, len(text)):
            char = text[pos]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return pos + 1
        self._pos, self._depth, self._in_string, self._escaped = len(text), depth, in_string, escaped
        return None


_INVALID = object()


def loads(text: str) -> Any:
    """``json.loads``, or ``_INVALID``: model output is never trusted to parse."""
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


def call_from_object(
    value: Any, tool_names: frozenset[str], argument_keys: tuple[str, ...] = ("arguments",)
) -> FoundCall | None:
    """``{"name": ..., "arguments": {...}}`` as a call, or None when it is not a valid one.

    Arguments may come as an object or as JSON text of one (some models quote them); a function
    without parameters may leave them out.
    """
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in tool_names:
        return None
    arguments: Any = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return FoundCall(name, json.dumps(arguments, ensure_ascii=False))
