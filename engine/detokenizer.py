"""Token ids -> text, one step at a time, plus stop-string matching.

Decoding token by token is wrong for byte-level and SentencePiece vocabularies: one character can
span several tokens, and some tokenizers drop a word's leading space when it starts the decoded
text. So, like vLLM, each step decodes a short window of recent tokens and emits only what the
new tokens added to it::

    all_ids:  p p p p p | o o o | n n
                        ^       ^     ^
              prefix_offset  read_offset  end
    prefix_text = decode(all_ids[prefix_offset:read_offset])
    new_text    = decode(all_ids[prefix_offset:end]);  emit new_text[len(prefix_text):]

Text ending in U+FFFD (an incomplete UTF-8 sequence) is held back until later tokens complete it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
# Tokens of the prompt tail used as decoding context for the first output tokens.
_INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streams one request's output text; the concatenated deltas equal a full ``decode``.

    ``tokenizer`` is any Hugging Face tokenizer (only ``decode`` is used). Not thread-safe; one per
    request.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids)
        self._num_prompt_tokens = len(self._token_ids)
        self._prefix_offset = max(self._num_prompt_tokens - _INITIAL_CONTEXT_TOKENS, 0)
        self._read_offset = self._num_prompt_tokens
        self._text = ""

    @property
    def text(self) -> str:
        """All finalized output text so far."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_prompt_tokens :]

    def append(self, new_token_ids: Sequence[int]) -> str:
        """Add this step's tokens; return the text they finalized ("" while a character is incomplete)."""
        if not new_token_ids:
            return ""
        self._token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At request end: release held-back text (a truly invalid byte sequence decodes to U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self._text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        text: str = self._tokenizer.decode(self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens)
        return text


def find_stop_string(
    text: str, num_new_chars: int, stops: Sequence[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends inside the last ``num_new_chars`` chars of ``text``.

    Returns ``(stop, truncate_to)``: the output must become ``text[:truncate_to]`` (which keeps the
    stop string when ``include_stop_str_in_output``, and drops anything after it). Matches that lie
    wholly in older text were reported by an earlier call, so only the tail
    ``text[-(num_new_chars + len(stop) - 1):]`` is searched: O(new chars) per call. When several
    stops match, the one starting earliest wins (ties: the shorter one, which completed first).
    """
    if num_new_chars <= 0 or not stops:
        return None
    tail_start = len(text) - num_new_chars
    best: tuple[int, int, str] | None = None  # (start, length, stop)
    for stop in stops:
        start = text.find(stop, max(tail_start - len(stop) + 1, 0))
        if start == -1:
            continue
        candidate = (start, len(stop), stop)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    start, length, stop = best
    return stop, start + length if include_stop_str_in_output else start
