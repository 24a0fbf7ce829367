"""What a tool-call parser gives the router: the shared types and the parser contract.

A chat model answers a request that offered ``tools`` in its own text format (Hermes'
``<tool_call>`` blocks, Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``); a parser turns that text
into OpenAI's ``message.tool_calls`` (whole answers) or ``delta.tool_calls`` (streams), and builds
the xgrammar structural tag that keeps a model's calls in its format and schema. The parsers read
decoded text: the router must decode with special tokens kept where a format's marker is one
(``[TOOL_CALLS]``, ``<|python_tag|>``).
"""

from __future__ import annotations

import random
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

_ALPHANUMERICS = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str  # "call_" + 24 random alphanumerics (OpenAI's shape); mistral: 9 alphanumerics as vLLM does
    name: str
    arguments: str  # the arguments as JSON text (json.dumps of the parsed object, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # the text that is not a tool call (None when empty/whitespace only)
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed piece, OpenAI's ``delta.tool_calls[i]``."""

    index: int  # the call's position among this answer's calls
    id: str | None  # set on the call's first delta only
    name: str | None  # set on the call's first delta only
    arguments: str  # a fragment of the arguments' JSON text ("" allowed)


@dataclass(frozen=True, slots=True)
class StreamPiece:
    content: str = ""  # visible text to stream now
    tool_calls: tuple[ToolCallDelta, ...] = ()


def openai_call_id() -> str:
    # Ids only tell calls apart within a conversation: a fast PRNG is enough, no secrets needed.
    return "call_" + "".join(random.choices(_ALPHANUMERICS, k=24))


def mistral_call_id() -> str:
    # Mistral's chat templates reject any other shape when the id is sent back in a later turn.
    return "".join(random.choices(_ALPHANUMERICS, k=9))


def tool_functions(tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, parameters schema)`` of each OpenAI function tool; a missing schema is any object."""
    functions = []
    for tool in tools:
        if tool.get("type", "function") != "function":
            continue
        function = tool.get("function") or {}
        name = function.get("name")
        assert isinstance(name, str) and name, f"a function tool needs a name: {tool!r}"
        parameters = function.get("parameters")
        functions.append((name, parameters if isinstance(parameters, dict) else {"type": "object"}))
    return functions


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}


class ToolStreamer(ABC):
    """An incremental parser for one answer, fed the answer's text as it is decoded.

    Called by the one task that streams the answer, never concurrently; never blocks. The pieces
    it returns, concatenated, equal its parser's ``parse`` of the whole text: the content pieces
    join to ``parse(whole).content or ""`` and the calls assembled from the deltas (arguments
    fragments joined per index) equal ``parse(whole).tool_calls``, up to their ids (a call's id is
    on its first delta). Text that may still turn out to be a tool-call marker is held back until
    it is known not to be one, so a piece may be empty.
    """

    @abstractmethod
    def feed(self, delta_text: str) -> StreamPiece:
        """The next decoded text; returns what may be shown now."""

    @abstractmethod
    def finish(self) -> StreamPiece:
        """The answer ended: flushes what was held back (an unterminated call is parsed if whole)."""


class ToolParser(ABC):
    """One model family's tool-call format (vLLM's ``--tool-call-parser`` names).

    Stateless and shared between requests. Model output never makes a parser raise: a call whose
    name is not among the request's tools, or whose JSON does not parse, is not a call and its text
    stays content.
    """

    name: str

    @abstractmethod
    def parse(self, text: str, tool_names: frozenset[str]) -> ParsedOutput:
        """The whole answer at once, for a non-streamed response."""

    @abstractmethod
    def streamer(self, tool_names: frozenset[str]) -> ToolStreamer:
        """A fresh incremental parser for one streamed answer (see ``ToolStreamer``)."""

    @abstractmethod
    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """An xgrammar structural tag (``{"type": "structural_tag", "format": ...}``) for the
        request's OpenAI ``tools``: free text, but a call once started follows this format with
        the function's ``parameters`` schema as its arguments; one call at most unless
        ``parallel``. None when there is no function to call (nothing to constrain)."""
