"""An answer's body from its token deltas: one JSON response, or server-sent events (OpenAI's
chunks, the usage chunk when asked for, ``[DONE]``). An error before the first byte is the
caller's to answer with a status; one after it travels as an error event, and the stream still
ends. Closing the deltas (a client gone mid-stream lands there) cancels the request on the pools.

An answer has one choice per prompt and sample (router.choices): each delta names its choice by
``index``, and the answer is done when every choice has finished. An echoed prompt comes first in
its choices' text, and, with ``logprobs``, its tokens' logprobs first in theirs (the prompt's first
token has none); ``prompt_logprobs`` travel in vLLM's field, on the choice (completions) or the
response (chat).
"""

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response

from common.outputs import TokenLogprob
from common.serving import StreamDelta
from router import openai_bodies as bodies
from router.http_edge import error_response, failed
from router.intake import Intake
from router.tool_calling import ToolCalling, finish_reason_with_calls
from router.tool_parsers.base import StreamPiece, ToolCallDelta, ToolStreamer

logger = logging.getLogger("pdserve.router")


def _tool_piece(tools: ToolStreamer, text: str, finished: bool) -> StreamPiece:
    piece = tools.feed(text) if text else StreamPiece()
    if not finished:
        return piece
    end = tools.finish()
    return StreamPiece(piece.content + end.content, piece.tool_calls + end.tool_calls)


async def chain(first: StreamDelta, rest: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
    yield first
    async for delta in rest:
        yield delta


@dataclass(slots=True)
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_scores: list[TokenLogprob] | None = None
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    started: bool = False  # streaming: its first chunk (role, echoed prompt) is out
    offset: int = 0  # streaming completions: where its next token's text starts
    tools: ToolStreamer | None = None  # streaming chat with tools: reads its calls out of its text
    num_calls: int = 0  # streaming: tool calls sent


def _scores_missing(intake: Intake, choices: dict[int, _Choice], leaders) -> bool:
    """Whether a prompt's scores (prompt_logprobs asked for) are missing from its first choice."""
    return intake.parsed.sampling.prompt_logprobs is not None and any(
        choices[leader].prompt_scores is None for leader in leaders
    )


class ResponseWriter:
    def __init__(
        self, served_model: str, decode: Callable[[list[int]], str], tool_calling: ToolCalling | None = None
    ) -> None:
        """``decode``: token ids to text (the tokenizer's, special tokens kept); ``tool_calling``:
        how an answer's tool calls are read (router/tool_calling.py)."""
        self.served_model = served_model
        self.decode = decode
        self.tool_calling = tool_calling or ToolCalling(None)

    def _chat_choice(self, intake: Intake, index: int, choice: _Choice) -> dict[str, Any]:
        text, logprobs = "".join(choice.text), self._logprobs(intake, choice.logprobs, 0)
        use = intake.parsed.tools
        reader = self.tool_calling.reader(use) if use is not None else None
        if reader is None or choice.finish_reason is None:
            return bodies.chat_choice(index, text, choice.finish_reason, logprobs)
        assert use is not None
        parsed = reader.parse(text, use.names)
        finish = finish_reason_with_calls(use, len(parsed.tool_calls), choice.finish_reason)
        return bodies.chat_choice(index, parsed.content, finish, logprobs, parsed.tool_calls)

    def _token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def _logprobs(self, intake: Intake, logprobs: list[TokenLogprob], text_offset: int) -> dict | None:
        if intake.parsed.logprobs is None or not logprobs:
            return None
        if intake.parsed.kind == "chat":
            return bodies.chat_logprobs(logprobs, self._token_text)
        return bodies.completion_logprobs(logprobs, self._token_text, text_offset)

    def _echo(self, intake: Intake, index: int) -> str:
        prompt = intake.prompt_of(index)
        return (prompt.text or self.decode(prompt.ids)) if intake.parsed.echo else ""

    def _echoed_logprobs(self, intake: Intake, index: int, scores: list[TokenLogprob] | None) -> dict | None:
        """The echoed prompt's logprobs, where the request asked for logprobs with echo."""
        if not intake.parsed.echo or intake.parsed.logprobs is None or scores is None:
            return None
        prompt = intake.prompt_of(index)
        return bodies.echoed_prompt_logprobs(prompt.ids, scores, self._token_text)

    def _prompt_logprobs(self, intake: Intake, index: int, scores: list[TokenLogprob] | None) -> list | None:
        """vLLM's ``prompt_logprobs`` field, where the request set it."""
        if not intake.parsed.asks_prompt_logprobs or scores is None:
            return None
        prompt = intake.prompt_of(index)
        return bodies.prompt_logprobs_entries(prompt.ids, scores, self._token_text)

    def _usage(self, intake: Intake, choices: dict[int, _Choice], breakdown) -> dict[str, Any]:
        # A prompt counts once however many choices sample it (OpenAI's and vLLM's usage).
        cached = sum(c.num_cached_tokens for index, c in choices.items() if intake.first_choice_of(index) == index)
        completion_tokens = sum(choice.num_tokens for choice in choices.values())
        return bodies.usage(intake.num_prompt_tokens, completion_tokens, cached, breakdown)

    async def collect(self, intake: Intake, response_id: str, first: StreamDelta, deltas, headers) -> Response:
        choices = {index: _Choice() for index in range(intake.num_choices)}
        breakdown = None
        async for delta in chain(first, deltas):
            if delta.error is not None:
                logger.warning("request %s failed: %s", response_id, delta.error)
                return error_response(failed())
            choice = choices[delta.index]
            choice.text.append(delta.new_text)
            choice.logprobs.extend(delta.logprobs or [])
            choice.num_tokens += len(delta.new_token_ids)
            choice.num_cached_tokens = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:
                choice.prompt_scores = delta.prompt_logprobs
            if delta.finish_reason is not None:
                choice.finish_reason = bodies.openai_finish_reason(delta.finish_reason)
                breakdown = delta.ttft_breakdown or breakdown
        if _scores_missing(intake, choices, {intake.first_choice_of(i) for i in choices}):
            # A prefill replica's reply lost after its KV landed: an answer without them would score empty.
            logger.warning("request %s: the prompt's logprobs never came", response_id)
            return error_response(failed())
        model, created = self.served_model, int(time.time())
        usage = self._usage(intake, choices, breakdown)
        if intake.parsed.kind == "chat":
            body = bodies.chat_body(
                response_id,
                model,
                created,
                [self._chat_choice(intake, i, c) for i, c in choices.items()],
                usage,
                self._prompt_logprobs(intake, 0, choices[0].prompt_scores),
            )
            return JSONResponse(body, headers=headers)
        answer = []
        for i, c in choices.items():
            prefix = self._echo(intake, i)
            scores = choices[intake.first_choice_of(i)].prompt_scores  # it scored the prompt for all its choices
            logprobs = bodies.joined_logprobs(
                self._echoed_logprobs(intake, i, scores), self._logprobs(intake, c.logprobs, len(prefix))
            )
            prompt_logprobs = self._prompt_logprobs(intake, i, scores)
            answer.append(
                bodies.completion_choice(i, prefix + "".join(c.text), c.finish_reason, logprobs, prompt_logprobs)
            )
        return JSONResponse(bodies.completions_body(response_id, model, created, answer, usage), headers=headers)

    async def sse(self, intake: Intake, response_id: str, first: StreamDelta, deltas) -> AsyncIterator[bytes]:
        """Server-sent events; an error after the first byte travels as an error event, then [DONE]."""
        parsed = intake.parsed
        model, created, chat = self.served_model, int(time.time()), parsed.kind == "chat"
        choices = {index: _Choice() for index in range(intake.num_choices)}
        breakdown = None
        try:
            async for delta in chain(first, deltas):
                if delta.error is not None:
                    logger.warning("request %s failed mid-stream: %s", response_id, delta.error)
                    yield bodies.sse_error(failed())
                    break
                index, choice = delta.index, choices[delta.index]
                choice.num_tokens += len(delta.new_token_ids)
                choice.num_cached_tokens = delta.num_cached_tokens
                breakdown = delta.ttft_breakdown or breakdown  # set on a choice's last delta only
                if delta.prompt_logprobs is not None:
                    choice.prompt_scores = delta.prompt_logprobs
                if not choice.started:
                    if _scores_missing(intake, choices, (intake.first_choice_of(index),)):
                        logger.warning("request %s: the prompt's logprobs never came", response_id)
                        yield bodies.sse_error(failed())
                        break
                    choice.started = True
                    # A prompt's first choice scored it for all of them, and its first delta came first.
                    scores = choices[intake.first_choice_of(index)].prompt_scores
                    opening = self._opening(intake, response_id, model, created, index, scores, choice)
                    if opening is not None:
                        yield bodies.sse(opening)
                finish = bodies.openai_finish_reason(delta.finish_reason)
                if not delta.new_text and finish is None and not delta.logprobs:
                    continue
                logprobs = self._logprobs(intake, delta.logprobs or [], choice.offset)
                choice.offset += len(delta.new_text)
                if chat:
                    content, calls = delta.new_text, tuple[ToolCallDelta, ...]()
                    if choice.tools is not None:
                        piece = _tool_piece(choice.tools, delta.new_text, finish is not None)
                        content, calls = piece.content, piece.tool_calls
                        choice.num_calls += sum(1 for call in calls if call.id is not None)
                        if finish is not None:
                            assert parsed.tools is not None
                            finish = finish_reason_with_calls(parsed.tools, choice.num_calls, finish)
                        if not content and not calls and finish is None and not logprobs:
                            continue  # held back: it may be a call's start
                    chunk = bodies.chat_chunk(
                        response_id,
                        model,
                        created,
                        content=content if content or not calls else None,
                        finish_reason=finish,
                        logprobs=logprobs,
                        index=index,
                        tool_calls=calls,
                    )
                else:
                    chunk = bodies.completion_chunk(
                        response_id, model, created, delta.new_text, finish, logprobs, index=index
                    )
                yield bodies.sse(chunk)
            else:
                if parsed.include_usage:
                    usage = self._usage(intake, choices, breakdown)
                    yield bodies.sse(bodies.usage_chunk(response_id, model, created, usage, parsed.kind))
            yield bodies.SSE_DONE
        except Exception:  # headers are out: the error travels as an event, and the stream still ends
            logger.exception("request %s: stream failed", response_id)
            yield bodies.sse_error(failed())
            yield bodies.SSE_DONE
        finally:
            await deltas.aclose()  # a client gone mid-stream lands here: cancel on both pools

    def _opening(
        self,
        intake: Intake,
        response_id: str,
        model: str,
        created: int,
        index: int,
        scores: list[TokenLogprob] | None,
        choice: _Choice,
    ) -> dict[str, Any] | None:
        """A choice's first chunk, before its first token's: chat's role; completions' echoed prompt
        (with its logprobs, and prompt_logprobs: ``scores``)."""
        if intake.parsed.kind == "chat":
            use = intake.parsed.tools
            reader = self.tool_calling.reader(use) if use is not None else None
            if reader is not None:
                assert use is not None
                choice.tools = reader.streamer(use.names)
            chunk = bodies.chat_chunk(response_id, model, created, role="assistant", content="", index=index)
            prompt_logprobs = self._prompt_logprobs(intake, index, scores)
            if prompt_logprobs is not None:
                chunk["prompt_logprobs"] = prompt_logprobs
            return chunk
        prefix = self._echo(intake, index)
        prompt_logprobs = self._prompt_logprobs(intake, index, scores)
        if not prefix and prompt_logprobs is None:
            return None
        choice.offset = len(prefix)  # the answer's text_offsets count the echoed prompt
        logprobs = self._echoed_logprobs(intake, index, scores)
        return bodies.completion_chunk(
            response_id, model, created, prefix, None, logprobs, index=index, prompt_logprobs=prompt_logprobs
        )
