"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, on the router's own tokenizer.

    POST /tokenize    {"prompt": "…"} or {"messages": […]}  ─▶ {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": […]}                        ─▶ {"prompt": "…"}

Any key the completions take is enough. The work runs on the tokenizer's thread, tenants in turns
(router.fair_queue), never on the event loop. Of vLLM's fields, those this router does not honour
are refused by name at any value but their no-op, as on the chat route.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router import protocol
from router.auth import KeyRing, Tenant, Unauthorized
from router.http_edge import error_response, read_body, unauthorized
from router.intake import PromptIntake, render_chat
from router.prompt_bounds import check_token_ids
from router.protocol import ApiError


class TokenizerRoutes:
    def __init__(
        self,
        keyring: KeyRing,
        intake: PromptIntake,
        served_model: str,
        context_length: Callable[[], Awaitable[int]],
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.keyring = keyring
        self.intake = intake
        self.tokenizer = intake.tokenizer
        self.served_model = served_model
        self.context_length = context_length
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def tokenize(self, request: Request) -> Response:
        try:
            tenant = self._caller(request)
            body = await self._body(request)
            work, argument = self._tokenize_work(body)
            ids, strs = await self._on_tokenizer(tenant, work, argument)
            max_model_len = await self.context_length()
        except Unauthorized as exc:
            return error_response(unauthorized(exc))
        except Exception as exc:
            return error_response(protocol.api_error_from_exception(exc))
        answer = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}
        return JSONResponse(answer)

    async def detokenize(self, request: Request) -> Response:
        try:
            tenant = self._caller(request)
            body = await self._body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
                raise ApiError(400, "tokens must be a list of token ids", param="tokens")
            if tokens:
                try:
                    check_token_ids(tokens, self.intake.vocab_size)
                except Exception as exc:
                    raise ApiError(400, str(exc), param="tokens") from exc
            text = await self._on_tokenizer(tenant, self.tokenizer.decode, tokens)
        except Unauthorized as exc:
            return error_response(unauthorized(exc))
        except Exception as exc:
            return error_response(protocol.api_error_from_exception(exc))
        return JSONResponse({"prompt": text})

    def _caller(self, request: Request) -> Tenant | None:
        """The caller's tenant, for its turn at the tokenizer (None: no keys, or an admin's key)."""
        authorization = request.headers.get("authorization")
        self.keyring.check_any(authorization)
        try:
            return self.keyring.tenant(authorization)
        except Unauthorized:
            return None  # an admin key: any key the router takes will do here

    async def _body(self, request: Request) -> dict[str, Any]:
        body = protocol.decode_body(await read_body(request, self.max_body_bytes, self.body_timeout_s))
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.served_model:
            raise protocol.model_not_found(model, self.served_model)
        return body

    def _tokenize_work(self, body: dict[str, Any]) -> tuple[Callable[[Any], tuple[list[int], list[str] | None]], Any]:
        """What the tokenizer's thread runs for this body, and on what."""
        with_strs = protocol.optional_bool(body, "return_token_strs")
        if ("prompt" in body) == ("messages" in body):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string", param="prompt")
            special = protocol.optional_bool(body, "add_special_tokens", default=True)

            def encode(text: str) -> tuple[list[int], list[str] | None]:
                return self._with_strs(self.tokenizer.encode(text, add_special_tokens=special), with_strs)

            return encode, prompt
        # Rendered as a chat request's messages are: what the chat route refuses is refused here.
        protocol.raise_if_refused(body, "chat")
        messages = protocol.parse_messages(body["messages"])
        options = protocol.chat_template_options(body)

        def render(chat: list[dict[str, str]]) -> tuple[list[int], list[str] | None]:
            return self._with_strs(render_chat(self.tokenizer, chat, options), with_strs)

        return render, messages

    def _with_strs(self, ids: list[int], with_strs: bool) -> tuple[list[int], list[str] | None]:
        return ids, (self.tokenizer.convert_ids_to_tokens(ids) if with_strs else None)

    async def _on_tokenizer(self, tenant: Tenant | None, work: Callable[[Any], Any], argument: Any) -> Any:
        job = self.intake.tokenizer_queue.submit(tenant.name if tenant is not None else "", work, argument)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            job.cancel()  # the client left: a job still waiting never runs
            raise
