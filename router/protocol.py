"""OpenAI-compatible requests: parsing, validation and refusals (the answers' shapes are
``router/openai_bodies.py``'s).

Plain functions over dicts, no HTTP framework: the HTTP layer decodes the JSON body and calls
``parse_request``. Every refusal is an ``ApiError`` carrying OpenAI's ``{"error": {...}}`` object.

Every field a vLLM or OpenAI client defines is honoured, harmless, or refused by name at any
value but its no-op (``router/request_fields.py``); none is dropped silently. A field no such
client defines is ignored, as vLLM ignores one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from common.errors import InvalidRequestError, OverloadedError
from common.sampling_params import SamplingParams
from router.request_fields import KNOWN_FIELDS, SAMPLING_FIELDS, RequestKind, refused_field
from router.structured_request import ConstraintLimits, parse_constraint
from router.tool_request import ToolUse, parse_tools

__all__ = [  # KNOWN_FIELDS and RequestKind are request_fields', handed on
    "CHAT_ROLES",
    "DEFAULT_MAX_TOKENS_CHAT",
    "DEFAULT_MAX_TOKENS_COMPLETION",
    "KNOWN_FIELDS",
    "MAX_CACHE_SALT_CHARS",
    "ApiError",
    "ChatTemplateOptions",
    "ParsedRequest",
    "RequestKind",
    "api_error_from_exception",
    "chat_template_options",
    "decode_body",
    "model_not_found",
    "optional_bool",
    "parse_chat_request",
    "parse_completion_request",
    "parse_messages",
    "parse_request",
    "raise_if_refused",
]

DEFAULT_MAX_TOKENS_COMPLETION = 16  # OpenAI's default for /v1/completions
# OpenAI's and vLLM's chat default: until the context is full. The intake clips it to the room the
# prompt leaves (and router.max_tokens_limit, where set, to that limit).
DEFAULT_MAX_TOKENS_CHAT = 2**31 - 1
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class ApiError(Exception):
    """A request-level failure as the client sees it: HTTP status plus OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error_from_exception(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        # context_length_exceeded included: OpenAI answers it with 400, and clients check for that.
        return ApiError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, OverloadedError):
        message = str(exc) or "the server is overloaded; retry later"
        return ApiError(503, message, type="service_unavailable", headers={"Retry-After": "1"})
    # No traceback or str(exc): internal details stay in the server log.
    return ApiError(500, f"internal server error ({type(exc).__name__})", type="server_error")


# apply_chat_template's own parameters: chat_template_kwargs may not set them (vLLM's rule too).
_TEMPLATE_PARAMETERS = frozenset(
    {
        *("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt"),
        *("continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors"),
        *("return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"),
    }
)


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a chat's messages are rendered into its prompt (vLLM's fields of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message stays open: the model continues it
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs: the template's variables


@dataclass(frozen=True)
class ParsedRequest:
    """A validated /v1/completions or /v1/chat/completions request. Its answer has
    ``num_prompts * sampling.n`` choices: choice ``i`` samples prompt ``i // n``."""

    kind: RequestKind
    model: str
    prompt: str | list[int] | None  # completions only: the first prompt of a batch
    messages: list[dict[str, Any]] | None  # chat only: parse_messages' form
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token; None = no logprobs
    echo: bool = False
    user: str | None = None
    cache_salt: str | None = None  # vLLM's field: prompts share cached KV only under one salt
    max_tokens_field: str | None = None  # where the client named max_tokens; None: the default applies
    chat_template: ChatTemplateOptions | None = None  # chat only
    batch: tuple[str | list[int], ...] = ()  # completions: every prompt, when more than one
    # The client set prompt_logprobs (vLLM's field in the answer); echo with logprobs scores the
    # prompt too, for the echoed tokens' logprobs, without it.
    asks_prompt_logprobs: bool = False
    tools: ToolUse | None = None  # chat only

    @property
    def num_prompts(self) -> int:
        return len(self.batch) or 1

    def one_per_prompt(self) -> list[ParsedRequest]:
        """The request once per prompt of its batch (itself, when it has one prompt)."""
        if not self.batch:
            return [self]
        return [dataclasses.replace(self, prompt=prompt, batch=()) for prompt in self.batch]


MAX_CACHE_SALT_CHARS = 1024
_LIMITS = ConstraintLimits()
_NONE: Mapping[str, Any] = MappingProxyType({})
# A list of prompts on /v1/completions is a batch of this many at most: each is a request on the pools.
MAX_BATCH_PROMPTS = 256


def decode_body(raw: bytes) -> object:
    """The request body's JSON, or a 400 that says what is wrong with it: not UTF-8 or not JSON, an
    integer with more digits than Python converts, nesting past the parser's recursion limit, or a
    string holding a lone surrogate (``"\\ud800"`` is valid JSON, but no tokenizer takes it)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and the integer digit limit alike
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise ApiError(
            400, f"the request body has a string that is not valid Unicode (a lone surrogate {bad})"
        ) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    return body


def parse_completion_request(body: object, served_model: str, defaults: Mapping[str, Any] = _NONE) -> ParsedRequest:
    return _parse(body, served_model, "completion", defaults)


def parse_chat_request(body: object, served_model: str, defaults: Mapping[str, Any] = _NONE) -> ParsedRequest:
    return _parse(body, served_model, "chat", defaults)


def parse_request(
    body: object,
    served_model: str,
    kind: RequestKind,
    defaults: Mapping[str, Any] = _NONE,
    constraint_limits: ConstraintLimits = _LIMITS,
) -> ParsedRequest:
    """The parse for ``kind``'s route: /v1/chat/completions ("chat") or /v1/completions.
    ``defaults``: sampling fields' values where the request leaves them out or null (the model's
    generation_config.json: common.generation_config). ``constraint_limits``: the router's bounds
    on an output constraint's size and nesting."""
    return _parse(body, served_model, kind, defaults, constraint_limits)


def _check_model_and_fields(body: object, served_model: str, kind: RequestKind) -> str:
    """The body is an object naming the served model and no field this server would have to drop."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise ApiError(400, f"model must be a non-empty string; this server serves {served_model!r}", param="model")
    if model != served_model:
        raise model_not_found(model, served_model)
    raise_if_refused(body, kind)
    return model


def _parse(
    body: object,
    served_model: str,
    kind: RequestKind,
    defaults: Mapping[str, Any],
    constraint_limits: ConstraintLimits = _LIMITS,
) -> ParsedRequest:
    model = _check_model_and_fields(body, served_model, kind)
    assert isinstance(body, dict)
    stream = optional_bool(body, "stream")
    include_usage = _include_usage(body.get("stream_options"), stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {user!r}", param="user")
    cache_salt = _cache_salt(body.get("cache_salt"))

    kwargs = {name: value for name, value in defaults.items() if name in SAMPLING_FIELDS}
    kwargs.update({name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None})
    renames: dict[str, str] = {}  # SamplingParams field -> the wire field it came from, for error params
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: ToolUse | None = None
    batch: tuple[str | list[int], ...] = ()
    if kind == "completion":
        prompts = _parse_prompts(body.get("prompt"))
        prompt = prompts[0]
        batch = tuple(prompts) if len(prompts) > 1 else ()
        max_tokens_field, default_max_tokens = "max_tokens", DEFAULT_MAX_TOKENS_COMPLETION
        logprobs = body.get("logprobs")  # SamplingParams checks it is null or an int in [0, 20]
        echo = optional_bool(body, "echo")
        if echo and isinstance(logprobs, int) and _is_token_count(logprobs):
            # The echoed prompt's tokens come with their logprobs too (vLLM's answer; lm-eval's
            # loglikelihood tasks read them), with as many alternatives as the generated tokens.
            asked = kwargs.get("prompt_logprobs")
            kwargs["prompt_logprobs"] = (
                max(logprobs, asked) if isinstance(asked, int) and _is_token_count(asked) else logprobs
            )
    else:
        messages = parse_messages(body.get("messages"))
        tools = _checked(parse_tools, body)
        has_new_name = body.get("max_completion_tokens") is not None
        max_tokens_field = "max_completion_tokens" if has_new_name else "max_tokens"
        default_max_tokens = DEFAULT_MAX_TOKENS_CHAT
        logprobs = _chat_logprobs(body)
        renames["logprobs"] = "top_logprobs"
        echo = False  # a chat request's echo is refused (request_fields)
    max_tokens = body.get(max_tokens_field)
    default_max_tokens = defaults.get("max_tokens", default_max_tokens)
    kwargs["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    renames["max_tokens"] = max_tokens_field
    kwargs["logprobs"] = logprobs
    kwargs["structured_output"] = _checked(parse_constraint, body, constraint_limits)
    try:
        sampling = SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        raise ApiError(400, exc.message, param=renames.get(exc.param or "", exc.param), code=exc.code) from exc
    return ParsedRequest(
        kind,
        model,
        prompt,
        messages,
        sampling,
        stream,
        include_usage,
        logprobs,
        echo,
        user,
        cache_salt,
        max_tokens_field if max_tokens is not None else None,
        chat_template_options(body) if kind == "chat" else None,
        batch,
        body.get("prompt_logprobs") is not None,
        tools,
    )


def _checked(parse: Any, *args: Any) -> Any:
    try:
        return parse(*args)
    except InvalidRequestError as exc:
        raise ApiError(400, exc.message, param=exc.param, code=exc.code) from None


def chat_template_options(body: dict[str, Any]) -> ChatTemplateOptions:
    """add_generation_prompt, continue_final_message and chat_template_kwargs, checked as vLLM checks them."""
    generation_prompt = optional_bool(body, "add_generation_prompt", default=True)
    continue_final = optional_bool(body, "continue_final_message")
    if generation_prompt and continue_final:
        message = "continue_final_message cannot be used with add_generation_prompt (set it to false)"
        raise ApiError(400, message, param="continue_final_message")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(_TEMPLATE_PARAMETERS & set(kwargs))
    if reserved:
        message = f"chat_template_kwargs may not set {', '.join(reserved)}: give them as the request's own fields"
        raise ApiError(400, message, param="chat_template_kwargs")
    return ChatTemplateOptions(generation_prompt, continue_final, dict(kwargs))


def _cache_salt(salt: object) -> str | None:
    """A salt is mixed into the hash of the prompt's first block, so two requests share cached KV
    only when their salts are equal (vLLM's rule: a non-empty string)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, f"cache_salt must be a non-empty string, got {salt!r}", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt is over {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    return salt


def model_not_found(model: str, served_model: str) -> ApiError:
    """OpenAI's 404 for a model this server does not serve."""
    message = f"The model {model!r} does not exist; this server serves {served_model!r}"
    return ApiError(404, message, type="not_found_error", param="model", code="model_not_found")


def raise_if_refused(body: dict[str, Any], kind: RequestKind) -> None:
    """The 400 naming the first field ``body`` sets that this endpoint does not honour (request_fields)."""
    refused = refused_field(body, kind)
    if refused is not None:
        name, message = refused
        raise ApiError(400, message, param=name, code="unsupported_parameter")


def optional_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _include_usage(options: object, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError(
            400, f"stream_options.include_usage must be a boolean, got {include_usage!r}", param="stream_options"
        )
    return bool(include_usage)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    top_logprobs = body.get("top_logprobs")
    if not optional_bool(body, "logprobs"):
        if top_logprobs is not None:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return None
    return 0 if top_logprobs is None else top_logprobs  # SamplingParams checks the range


def _is_token_id(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_token_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _parse_prompts(prompt: object) -> list[str | list[int]]:
    """One prompt (a string, or a list of token ids) or a batch of them (a list of either)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise ApiError(400, f"a batch has at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}", param="prompt")
        for item in prompt:
            if isinstance(item, list) and not (item and all(_is_token_id(t) for t in item)):
                raise ApiError(
                    400, "each prompt of a batch must be a string or a non-empty list of token ids", param="prompt"
                )
        return list(prompt)
    message = "prompt must be a string, a non-empty list of token ids, or a list of either (a batch)"
    raise ApiError(400, message, param="prompt")


def parse_messages(messages: object) -> list[dict[str, Any]]:
    """The chat's messages as the template reads them: content flattened to a string; an assistant's
    ``tool_calls`` (its content may then be null) with their arguments as objects (templates render
    them with ``tojson``, as vLLM hands them over); a tool message's ``tool_call_id``."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of message objects", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            allowed = ", ".join(sorted(CHAT_ROLES))
            raise ApiError(400, f"messages[{i}].role must be one of {allowed}; got {role!r}", param="messages")
        tool_calls = message.get("tool_calls")
        content = message.get("content")
        if content is None and role == "assistant" and tool_calls:
            content = ""
        entry: dict[str, Any] = {"role": role, "content": _flatten_content(content, i)}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        if tool_calls is not None:
            if role != "assistant":
                raise ApiError(
                    400, f"messages[{i}].tool_calls: only an assistant message has tool calls", param="messages"
                )
            entry["tool_calls"] = _tool_calls(tool_calls, i)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ApiError(
                    400, f"messages[{i}].tool_call_id must be the id of the call it answers", param="messages"
                )
            entry["tool_call_id"] = call_id
        parsed.append(entry)
    return parsed


def _tool_calls(calls: object, index: int) -> list[dict[str, Any]]:
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", param="messages")
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            message = f'{where} entries must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
            raise ApiError(400, message, param="messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # not JSON: rendered as the text it is
                arguments = json.loads(arguments) if arguments.strip() else {}
        elif arguments is not None and not isinstance(arguments, dict):
            raise ApiError(400, f"{where}: arguments must be a JSON string", param="messages")
        call_id = call.get("id")
        parsed.append(
            {
                "id": call_id if isinstance(call_id, str) else "",
                "type": "function",
                "function": {"name": function["name"], "arguments": {} if arguments is None else arguments},
            }
        )
    return parsed


def _flatten_content(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                message = (
                    f'messages[{index}].content parts must be {{"type": "text", "text": ...}}; only text is supported'
                )
                raise ApiError(400, message, param="messages")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts for a string-content chat template
    raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts", param="messages")
