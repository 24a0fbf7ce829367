"""From a request's body to a prompt the pools can take, or the refusal that says why not.

    body ─▶ parsed: on the loop (small), on a thread (past 256 KiB), in the parse process (past
            2 MiB: router.parse_process, as json.loads holds the GIL throughout)
         ─▶ max_tokens within router.max_tokens_limit ─▶ the prompt's characters against the
            context (no tokenizer time spent on a prompt that cannot fit)
         ─▶ tokenized (+ chat template) on the tokenizer's one thread, tenants in turns
            (router.fair_queue); token ids only range-checked
         ─▶ its length against the context; max_tokens clipped to the room left, as OpenAI does

A client that leaves while its job waits for the tokenizer is dropped from the queue; one that
leaves mid-tokenizing leaves the job running, and it keeps its place in admission until it ends
(``num_orphaned``), so that clients who leave cannot pile up work past max_concurrent_requests.
"""

import asyncio
import dataclasses
import functools
import importlib
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from common.tokenizer_files import generic_fast_tokenizer
from router import protocol
from router.auth import Tenant
from router.fair_queue import FairQueue
from router.parse_process import ParseProcess
from router.prompt_bounds import PromptBounds, check_length, check_prompt_chars, check_token_ids
from router.protocol import ChatTemplateOptions, ParsedRequest, RequestKind
from router.structured_request import ConstraintLimits, check_tool_constraint
from router.tool_calling import ToolCalling

# A body or a list of prompt token ids past these is parsed and checked on a thread of its own: a
# 30 MiB list of ids held every stream for seconds when it was checked on the event loop.
PARSE_ON_LOOP_MAX_BYTES = 256 * 2**10
# Past this, the body is parsed in the parse process: json.loads holds the GIL ~12 ms per MiB.
PARSE_IN_PROCESS_MIN_BYTES = 2 * 2**20
CHECK_IDS_ON_LOOP_MAX = 4096


@dataclass(frozen=True)
class TokenizedPrompt:
    ids: list[int]
    text: str | None  # a text prompt as sent (echo), None for token ids and chats
    sampling: SamplingParams  # max_tokens clipped to the room this prompt leaves in the context


@dataclass(frozen=True)
class Intake:
    parsed: ParsedRequest  # max_tokens clipped to the first prompt's room
    prompts: list[TokenizedPrompt]  # one; a batch on /v1/completions: each in order

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0].ids

    @property
    def prompt_text(self) -> str | None:
        return self.prompts[0].text

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt.ids) for prompt in self.prompts)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.parsed.sampling.n

    def prompt_of(self, choice: int) -> TokenizedPrompt:
        """The prompt choice ``choice`` samples (router.choices: ``choice // n``)."""
        return self.prompts[choice // self.parsed.sampling.n]

    def first_choice_of(self, choice: int) -> int:
        """The first choice of ``choice``'s prompt: the one that scores it (prompt_logprobs)."""
        return choice - choice % self.parsed.sampling.n


def load_tokenizer(model_dir: str) -> Any:
    """The generic fast class where it loads the same tokenizer (common.tokenizer_files): ~1.8 s
    less at start than AutoTokenizer, which imports transformers' model configurations."""
    if generic_fast_tokenizer(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    options: ChatTemplateOptions,
    tools: list[dict[str, Any]] | None = None,
    template: str | None = None,
) -> list[int]:
    """The chat's prompt ids through the model's template (``template``: another one, for this
    request). A template that cannot render what the client sent (a final message it cannot
    continue, a variable it refuses) is the client's 400."""
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tokenize=True,
            return_dict=False,
            **options.kwargs,
        )
    except Exception as exc:  # jinja2's errors, and transformers' ValueError
        reason = f"{type(exc).__name__}: {exc}"[:300]
        raise InvalidRequestError(
            f"the chat template cannot render these messages: {reason}", param="messages"
        ) from exc
    return list(ids)


def decode_and_parse(
    raw: bytes,
    kind: RequestKind,
    served_model: str,
    defaults: Mapping[str, Any] = MappingProxyType({}),
    limits: ConstraintLimits = ConstraintLimits(),
) -> ParsedRequest:
    return protocol.parse_request(protocol.decode_body(raw), served_model, kind, defaults, limits)


class PromptIntake:
    def __init__(
        self,
        tokenizer: Any,
        served_model: str,
        context_length: Callable[[], Awaitable[int]],
        max_tokens_limit: int | None = None,
        parse_timeout_s: float = 30.0,
        max_choices: int = 16,
        sampling_defaults: Mapping[str, Any] = MappingProxyType({}),
        priority_scheduling: bool = False,
        tool_calling: ToolCalling | None = None,
        constraint_limits: ConstraintLimits = ConstraintLimits(),
    ) -> None:
        self.tokenizer = tokenizer
        self.served_model = served_model
        self.context_length = context_length
        self.max_tokens_limit = max_tokens_limit
        self.max_choices = max_choices  # n's limit (router.max_n): each choice is a request on the pools
        self.sampling_defaults = sampling_defaults  # the model's generation_config.json, under the request's
        self.priority_scheduling = priority_scheduling  # the pools' scheduling_policy is "priority"
        self.tool_calling = tool_calling or ToolCalling(None)
        self.constraint_limits = constraint_limits  # router.max_constraint_bytes, router.max_schema_depth
        self.vocab_size = len(tokenizer)
        # No token is longer than this many characters (a vocabulary entry's raw form is at least as
        # long as the text it decodes to), so a prompt of more than max_model_len times it cannot fit.
        self.max_token_chars = max(len(token) for token in tokenizer.get_vocab())
        # One thread: tokenizing (long for a long prompt) stays off the event loop, and no two
        # encodes run at once in one fast tokenizer (each borrows its Rust state mutably). Tenants
        # take turns on it: one tenant's queue of long prompts holds no other.
        self.tokenizer_queue = FairQueue("pdserve-tokenize")
        # Large bodies' JSON and long token-id lists: off the loop, and not queued behind prompts.
        self.parse_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-parse")
        self.parse_process = ParseProcess(timeout_s=parse_timeout_s)
        # xgrammar checks every output constraint; its import (~1.7 s) happens here, off the
        # loop, not in the first constrained request's parse.
        self.parse_thread.submit(importlib.import_module, "xgrammar")
        self.num_orphaned = 0  # tokenizing jobs whose client left, still running

    async def take(self, raw: bytes, kind: RequestKind, tenant: Tenant | None) -> Intake:
        parsed = self.within_max_tokens_limit(await self.parse(raw, kind))
        if parsed.tools is not None:  # the answer's constraint and decoding follow tool_choice
            sampling = self.tool_calling.adjust_sampling(parsed.tools, parsed.sampling)
            constraint = sampling.structured_output
            if constraint is not None and constraint is not parsed.sampling.structured_output:
                check_tool_constraint(constraint, self.constraint_limits)
            parsed = dataclasses.replace(parsed, sampling=sampling)
        if parsed.sampling.priority and not self.priority_scheduling:
            message = "priority is not supported by this server; it schedules first come, first served"
            raise protocol.ApiError(
                400, message + " (scheduling_policy: priority)", param="priority", code="unsupported_parameter"
            )
        if parsed.sampling.n > self.max_choices:
            message = f"n={parsed.sampling.n} is more than this server's limit of {self.max_choices} (router.max_n)"
            raise protocol.ApiError(400, message, param="n")
        max_model_len = await self.context_length()
        singles = parsed.one_per_prompt()
        for one in singles:
            check_prompt_chars(one, max_model_len, self.max_token_chars)
        prompts = []
        for one in singles:
            prompt_ids, prompt_text = await self.tokenize_off_loop(one, tenant)
            check_length(prompt_ids, max_model_len)
            # As OpenAI does: no more tokens than the context has room for after the prompt (chat's
            # default, "until the context is full", is all of it).
            max_tokens = min(parsed.sampling.max_tokens, max_model_len - len(prompt_ids))
            sampling = dataclasses.replace(parsed.sampling, max_tokens=max_tokens)
            prompts.append(TokenizedPrompt(prompt_ids, prompt_text, sampling))
        parsed = dataclasses.replace(parsed, sampling=prompts[0].sampling)
        return Intake(parsed, prompts)

    async def parse(self, raw: bytes, kind: RequestKind) -> ParsedRequest:
        if len(raw) > PARSE_IN_PROCESS_MIN_BYTES:
            # Parsing it here would hold the GIL, so the loop, for as long.
            bounds = PromptBounds(await self.context_length(), self.max_token_chars, self.vocab_size)
            raw = await self.parse_process.reduce(raw, kind, self.served_model, bounds)
        if len(raw) > PARSE_ON_LOOP_MAX_BYTES:
            work = functools.partial(
                decode_and_parse, raw, kind, self.served_model, self.sampling_defaults, self.constraint_limits
            )
            return await asyncio.get_running_loop().run_in_executor(self.parse_thread, work)
        return decode_and_parse(raw, kind, self.served_model, self.sampling_defaults, self.constraint_limits)

    def within_max_tokens_limit(self, parsed: ParsedRequest) -> ParsedRequest:
        """router.max_tokens_limit: more asked is refused, naming the field; a default is cut to it."""
        limit = self.max_tokens_limit
        if limit is None or parsed.sampling.max_tokens <= limit:
            return parsed
        if parsed.max_tokens_field is not None:
            raise protocol.ApiError(
                400,
                f"{parsed.max_tokens_field}={parsed.sampling.max_tokens} is more than this server's limit of "
                f"{limit} tokens (router.max_tokens_limit)",
                param=parsed.max_tokens_field,
            )
        return dataclasses.replace(parsed, sampling=dataclasses.replace(parsed.sampling, max_tokens=limit))

    def tokenize(self, parsed: ParsedRequest) -> tuple[list[int], str | None]:
        if parsed.kind == "chat":
            assert parsed.messages is not None
            options = parsed.chat_template or ChatTemplateOptions()
            if parsed.tools is None:
                return render_chat(self.tokenizer, parsed.messages, options), None
            tools, template = parsed.tools.as_openai(), self.tool_calling.template
            return render_chat(self.tokenizer, parsed.messages, options, tools, template), None
        if isinstance(parsed.prompt, str):
            if not parsed.prompt:
                raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
            return self.tokenizer.encode(parsed.prompt), parsed.prompt
        ids = list(parsed.prompt or [])
        check_token_ids(ids, self.vocab_size)
        return ids, None

    async def tokenize_off_loop(self, parsed: ParsedRequest, tenant: Tenant | None) -> tuple[list[int], str | None]:
        if parsed.kind == "completion" and not isinstance(parsed.prompt, str):
            if len(parsed.prompt or []) <= CHECK_IDS_ON_LOOP_MAX:
                return self.tokenize(parsed)  # token ids: only their range is checked
            return await asyncio.get_running_loop().run_in_executor(self.parse_thread, self.tokenize, parsed)
        # No keys (tenant None): one queue for every client.
        job = self.tokenizer_queue.submit(tenant.name if tenant is not None else "", self.tokenize, parsed)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancel():  # the client left while its job waited for the tokenizer: it never runs
                raise
            if not job.done():  # the client left mid-tokenizing: the work goes on, and keeps its place
                self.num_orphaned += 1
                loop = asyncio.get_running_loop()
                job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._orphan_done))
            raise

    def _orphan_done(self) -> None:
        self.num_orphaned -= 1

    def start(self) -> None:
        """Start the parse process ahead of the first large body."""
        self._parse_process_start = asyncio.get_running_loop().create_task(self.parse_process.start())

    async def close(self) -> None:
        await self.parse_process.close()
        self.tokenizer_queue.shutdown()
        self.parse_thread.shutdown(wait=False, cancel_futures=True)
