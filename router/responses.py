"""An answer's body from its token deltas: one JSON response, or server-sent events (OpenAI's
chunks, the usage chunk when asked for, ``[DONE]``). An error before the first byte is the
caller's to answer with a status; one after it travels as an error event, and the stream still
ends. Closing the deltas (a client gone mid-stream lands there) cancels the request on the pools."""

import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse, Response

from common.serving import StreamDelta
from router import openai_bodies as bodies
from router.http_edge import error_response, failed
from router.protocol import ParsedRequest

logger = logging.getLogger("pdserve.router")


async def chain(first: StreamDelta, rest: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
    yield first
    if first.finish_reason is not None:
        return
    async for delta in rest:
        yield delta


class ResponseWriter:
    def __init__(self, served_model: str, decode: Callable[[list[int]], str]) -> None:
        """``decode``: token ids to text (the tokenizer's, special tokens kept)."""
        self.served_model = served_model
        self.decode = decode

    def _token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def _logprobs(self, parsed: ParsedRequest, delta: StreamDelta, text_offset: int) -> dict | None:
        if parsed.logprobs is None or not delta.logprobs:
            return None
        if parsed.kind == "chat":
            return bodies.chat_logprobs(delta.logprobs, self._token_text)
        return bodies.completion_logprobs(delta.logprobs, self._token_text, text_offset)

    async def collect(self, parsed, response_id, prompt_ids, prompt_text, first, deltas, headers) -> Response:
        text: list[str] = []
        logprobs: list = []
        num_tokens = 0
        last = first
        async for delta in chain(first, deltas):
            text.append(delta.new_text)
            logprobs.extend(delta.logprobs or [])
            num_tokens += len(delta.new_token_ids)
            last = delta
        if last.error is not None:
            logger.warning("request %s failed: %s", response_id, last.error)
            return error_response(failed())
        model, created = self.served_model, int(time.time())
        usage = bodies.usage(len(prompt_ids), num_tokens, last.num_cached_tokens, last.ttft_breakdown)
        finish = bodies.openai_finish_reason(last.finish_reason)
        merged = StreamDelta(response_id, [], "", logprobs=logprobs or None)
        if parsed.kind == "chat":
            content = "".join(text)
            body = bodies.chat_response(
                response_id, model, created, content, finish, usage, self._logprobs(parsed, merged, 0)
            )
        else:
            prefix = (prompt_text or self.decode(prompt_ids)) if parsed.echo else ""
            lp = self._logprobs(parsed, merged, len(prefix))
            body = bodies.completion_response(response_id, model, created, prefix + "".join(text), finish, usage, lp)
        return JSONResponse(body, headers=headers)

    async def sse(self, parsed, response_id, prompt_ids, prompt_text, first, deltas) -> AsyncIterator[bytes]:
        """Server-sent events; an error after the first byte travels as an error event, then [DONE]."""
        model, created, chat = self.served_model, int(time.time()), parsed.kind == "chat"
        num_tokens, cached, offset = 0, 0, 0
        breakdown = None
        try:
            if chat:
                yield bodies.sse(bodies.chat_chunk(response_id, model, created, role="assistant", content=""))
            elif parsed.echo:
                prefix = prompt_text or self.decode(prompt_ids)
                offset = len(prefix)
                yield bodies.sse(bodies.completion_chunk(response_id, model, created, prefix))
            async for delta in chain(first, deltas):
                num_tokens += len(delta.new_token_ids)
                cached = delta.num_cached_tokens
                breakdown = delta.ttft_breakdown  # set on the last delta only
                if delta.error is not None:
                    logger.warning("request %s failed mid-stream: %s", response_id, delta.error)
                    yield bodies.sse_error(failed())
                    break
                finish = bodies.openai_finish_reason(delta.finish_reason)
                if not delta.new_text and finish is None and not delta.logprobs:
                    continue
                logprobs = self._logprobs(parsed, delta, offset)
                offset += len(delta.new_text)
                if chat:
                    chunk = bodies.chat_chunk(
                        response_id, model, created, content=delta.new_text, finish_reason=finish, logprobs=logprobs
                    )
                else:
                    chunk = bodies.completion_chunk(response_id, model, created, delta.new_text, finish, logprobs)
                yield bodies.sse(chunk)
            if parsed.include_usage:
                usage = bodies.usage(len(prompt_ids), num_tokens, cached, breakdown)
                yield bodies.sse(bodies.usage_chunk(response_id, model, created, usage, parsed.kind))
            yield bodies.SSE_DONE
        except Exception:  # headers are out: the error travels as an event, and the stream still ends
            logger.exception("request %s: stream failed", response_id)
            yield bodies.sse_error(failed())
            yield bodies.SSE_DONE
        finally:
            await deltas.aclose()  # a client gone mid-stream lands here: cancel on both pools
