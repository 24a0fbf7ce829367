"""A stream resumed on another decode replica: whether it can be, and the text it owes the client."""

from __future__ import annotations

from collections.abc import Callable

from common.sampling_params import SamplingParams
from common.serving import StreamDelta


def why_not_resumable(params: SamplingParams) -> str | None:
    """Why continuing elsewhere from prompt + sent tokens would not give the same output, if it would not."""
    if params.stop:
        return "stop strings cannot be resumed (text held back for matching died with the replica)"
    if params.structured_output is not None:
        return "a constrained output cannot be resumed (its matcher's state died with the replica)"
    if params.presence_penalty or params.frequency_penalty:
        return "presence/frequency penalties count output tokens only, which a resumed request would not"
    if params.seed is not None and params.temperature > 0:
        # The new replica's generator would start from the seed again and repeat the first draws:
        # a continuation, but not the one the seed promises.
        return "a seeded sample cannot be resumed exactly (the new replica's generator starts from the seed)"
    return None


class ResumedText:
    """Text of a resumed request, recomputed from all its output tokens.

    The dead replica may have held back text (an incomplete UTF-8 character spans tokens it sent);
    the new replica sees those tokens as prompt and would never emit it. So after a resume the
    router decodes the whole output (with the prompt's tail as context, like the engine) and sends
    what the client has not seen yet.
    """

    _CONTEXT = 5

    def __init__(self, detokenize: Callable[[list[int], bool], str] | None, prompt: list[int], skip: bool) -> None:
        self.detokenize = detokenize
        self.context = prompt[-self._CONTEXT :]
        self.skip = skip
        self.text = ""

    def sent(self, new_text: str) -> str:
        self.text += new_text
        return new_text

    def after(self, output_ids: list[int], delta: StreamDelta) -> str:
        if self.detokenize is None:
            return self.sent(delta.new_text)
        base = self.detokenize(self.context, self.skip)
        full = self.detokenize(self.context + output_ids, self.skip)[len(base) :]
        if delta.finish_reason is None and full.endswith("\ufffd"):
            return ""  # a character still incomplete: wait for its last byte
        return self.sent(full[len(self.text) :])
