"""One model instance: validate requests, schedule, run the step on the TP group, sample, emit.

    add_request ─▶ scheduler (waiting ▶ running) ─▶ executor (all shards) ─▶ sampler (driver)
        ─▶ scheduler.update_from_output ─▶ output processor (text, stop strings) ─▶ RequestOutput

``step()`` never blocks on anything but the forward pass. Bad requests raise
InvalidRequestError from ``add_request`` before touching the KV cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.config import MIN_STALL_CHUNK_TOKENS, EngineConfig, EngineRole
from common.errors import InvalidRequestError, OverloadedError
from common.kv_events import KVCacheEvent, PrefixCacheStats
from common.kv_layout import KVCacheLayout
from common.kv_messages import ConnectorStep
from common.outputs import RequestOutput, TokenLogprob
from common.sampling_params import SamplingParams
from engine.distributed.parallel import pick_device
from engine.executor import Executor, WorkerLauncher
from engine.handoff import BlockFate, HandoffActions, SentKV, make_handoff
from engine.kv_cache.manager import KVCacheManager
from engine.kv_connector import model_fingerprint
from engine.model_loader import resolve_model_dir
from engine.output_processor import OutputProcessor
from engine.prompt_logprobs import score_prompts
from engine.request import Request, RequestStatus
from engine.sampler import PendingSample, Sampler, SamplingRequestState, make_generator
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step_input import build_step_input, carried_tokens
from engine.structured_output import GrammarCompilerPool, StructuredOutputManager
from engine.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _LaunchedStep:
    """A step whose kernels are queued on the device, its sampled ids not yet read."""

    scheduled: SchedulerOutput
    sampled_ids: list[str]  # the request of each sampled row, row order
    pending: PendingSample | None  # None: the step samples nothing
    started: float  # when it was queued (time.monotonic)
    done: torch.cuda.Event | None  # recorded after it on CUDA when no read waits for it


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_reserved: int
    num_handoff: int
    num_preemptions: int
    kv: PrefixCacheStats


_GRAMMAR_WAIT_S = 0.01  # a step with only compiling requests waits this long for one
_MIN_PREFILL_TOKENS_TIMED = 32  # a step with fewer prefill tokens times its overhead, not prefill
_NEWEST_STEP_WEIGHT = 0.2  # of the newest step in the moving average


def _moving_average(old: float, new: float) -> float:
    return new if not old else (1 - _NEWEST_STEP_WEIGHT) * old + _NEWEST_STEP_WEIGHT * new


def _generator(seed: int | None, device: torch.device):
    """A seeded request's generator, on the device its logits are sampled on (a CPU generator
    cannot draw into CUDA logits: torch raised, and the engine's thread ended with every request
    of the replica)."""
    return make_generator(seed, device) if seed is not None else None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, launcher: WorkerLauncher | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_dir = resolve_model_dir(config.model.model, config.model.cache_dir, config.model.revision)
        self.tokenizer = load_tokenizer(self.model_dir, config.model.chat_template)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.model_id = model_fingerprint((self.model_dir / "config.json").read_bytes())  # what KV tickets name
        self.executor = Executor(config, self.model_dir, launcher)
        runner = self.executor.driver
        self._device = runner.device
        self.layout: KVCacheLayout = runner.layout
        self.vocab_size = runner.shape.vocab_size
        self.kv = KVCacheManager(self.layout.num_blocks, self.layout.block_size, config.cache.enable_prefix_caching)
        # A lone request must always fit, or preemption could loop forever.
        self.max_model_len = min(runner.max_model_len, self.kv.capacity_tokens)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.sampler = Sampler()
        self.outputs = OutputProcessor(self.tokenizer)
        compilers = GrammarCompilerPool(self.tokenizer, self.vocab_size, config.scheduler.grammar_cache_size)
        self.grammars = StructuredOutputManager(compilers)
        self.num_preemptions = 0
        self._outputs_outside_step: list[RequestOutput] = []
        overlap = config.scheduler.overlap_outputs
        self.overlap_outputs = self._device.type == "cuda" if overlap is None else overlap
        # Requests that got a token last step, their outputs not yet made (overlap_outputs).
        self._deferred: list[Request] = []
        self.async_scheduling = self._resolve_async_scheduling(config)
        self._in_flight: _LaunchedStep | None = None  # scheduled ahead, queued on the device
        self._device_free_at = 0.0  # when the last step read back ended (time.monotonic)
        self.num_steps = 0  # forward passes launched
        self.num_steps_ahead = 0  # of those, scheduled and queued before the one before them was read
        every_chunk = config.kv_connector.push_every_chunk
        if every_chunk is None:
            every_chunk = pick_device(config.model.device).type == "cuda"
        # This role's side of the KV hand-off (engine.handoff): its hooks say what to do, the
        # engine does it.
        self.handoff = make_handoff(
            config.scheduler.role,
            self.executor.has_connector,
            config.parallel.tensor_parallel_size,
            config.cache.block_size if every_chunk else None,
        )
        self.prefill_tokens_per_s = 0.0  # measured, see _record_prefill_steps; 0 until a prefill ran
        self.decode_step_s = 0.0  # a step with no prompt tokens (moving average); 0 until one ran
        self.num_steps_out_of_memory = 0  # steps whose requests ended for want of device memory

    def _resolve_async_scheduling(self, config: EngineConfig) -> bool:
        """On where it applies: one shard (a step ahead takes its input ids from the driver's
        device, which other shards do not share) and not a prefill replica (each of its requests
        ends at its first token: nothing to decode ahead). None: on CUDA only."""
        wanted = config.scheduler.async_scheduling
        if wanted is None:
            wanted = self._device.type == "cuda"
        applies = self.executor.world_size == 1 and config.scheduler.role is not EngineRole.PREFILL
        if wanted and not applies and config.scheduler.async_scheduling:
            logger.info("async scheduling is off: it needs one shard and a colocated or decode role")
        return wanted and applies

    @property
    def kv_caches(self):
        """The driver shard's per-layer KV tensors (layout: common.kv_layout)."""
        return self.executor.driver.kv_caches

    # --- intake ----------------------------------------------------------------------------
    def _new_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None, cache_salt: str | None
    ) -> tuple[Request, str | None]:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", param="sampling_params")
        if params.n != 1:  # LLM.generate and the router run each choice as a request (for_choice)
            raise InvalidRequestError(f"the engine runs one sequence per request, got n={params.n}", param="n")
        if params.priority and self.config.scheduler.policy != "priority":
            raise InvalidRequestError(
                "priority needs the priority scheduling policy (scheduling_policy: priority)", param="priority"
            )
        # A push still ending (its request preempted mid-prompt) keeps its id: the shards key it so.
        held = self.handoff.holds_id(request_id)
        if request_id in self.outputs.states or request_id in self.scheduler.requests or held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            text, token_ids = None, list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be ints in [0, {self.vocab_size})", param="prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
        if any(token_id >= self.vocab_size for token_id, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids below {self.vocab_size}", param="logit_bias")
        if len(token_ids) >= self.max_model_len:
            limit = "context" if self.max_model_len < self.kv.capacity_tokens else "KV cache (kv_cache_memory)"
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but this instance's {limit} holds {self.max_model_len} "
                "tokens (the prompt plus at least one generated token must fit); shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
        )
        return request, text

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        kv_ticket: dict | None = None,
    ) -> None:
        """Queue a request. Prefill role with a connector: ``kv_ticket`` (a kv_transfer ticket as a
        dict) says where to push its KV, layer by layer, as its prompt is computed."""
        if kv_ticket is not None:
            self.handoff.check_ticket(request_id, kv_ticket)
        request, text = self._new_request(request_id, prompt, params, cache_salt)
        if not self.can_accept():
            raise OverloadedError(
                f"{len(self.scheduler.waiting)} requests are already waiting "
                f"(max_num_waiting={self.config.scheduler.max_num_waiting}); retry later"
            )
        self.outputs.add(request, text, _generator(request.sampling_params.seed, self.executor.driver.device))
        self.grammars.add(request)  # compiling from now; the request waits for it, not the batch
        self.scheduler.add_request(request)
        if kv_ticket is not None:
            self.handoff.accept_ticket(request_id, kv_ticket)

    def cached_prefix_tokens(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading prompt tokens this engine's prefix cache holds now (a lookup; nothing is held)."""
        return self.kv.cached_prefix_tokens(prompt_token_ids, cache_salt)

    # --- the decode role's hand-off --------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> list[int] | None:
        """Decode role: hold blocks for a prompt whose KV will be pushed in. None when they do not fit now."""
        request, _ = self._new_request(request_id, prompt_token_ids, params, cache_salt)
        block_ids = self.scheduler.reserve(request)
        if block_ids is not None:
            self.outputs.add(request, None, _generator(request.sampling_params.seed, self.executor.driver.device))
            self.grammars.add(request)  # compiles while the prompt's KV is computed and pushed
        return block_ids

    @property
    def kv_endpoints(self) -> list[str]:
        """Decode role with a receiving connector: each shard's KV endpoint, rank order (for tickets)."""
        return self.executor.connector_endpoints

    def expect_kv(self, request_id: str, kv_ticket: dict) -> None:
        """Decode role: KV for a reserved request will arrive through the connector under this ticket;
        the request starts decoding by itself when every shard has it, or ends with the error."""
        assert request_id in self.scheduler.reserved, f"{request_id} has no reservation"
        # Registered on every shard now, before the caller hands the ticket to prefill.
        self._round(self.handoff.expect(request_id, kv_ticket))

    def kv_ready(self, request_id: str, first_token_id: int, first_logprob: TokenLogprob | None = None) -> None:
        """Decode role: the prompt's KV is in the reserved blocks and prefill sampled ``first_token_id``.

        The first token goes out now, with this step's outputs, not after the request's first decode
        step: the client's time to first token ends when the KV lands."""
        self.outputs.record_logprob(request_id, first_logprob)
        request = self.scheduler.kv_ready(request_id, first_token_id)
        if request is not None:  # None: aborted meanwhile
            self._outputs_outside_step.append(self._emit_new_tokens(request))

    def release(self, request_id: str) -> None:
        """Prefill role: the KV hand-off is over (acknowledged or abandoned); free the source blocks."""
        self.scheduler.release(request_id)

    def abort_request(self, request_id: str, error: str | None = None) -> None:
        status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
        deferred = next((r for r in self._deferred if r.request_id == request_id), None)
        if deferred is not None:  # its last token's output goes out before the ending one
            self._deferred.remove(deferred)
            self._emit_if_live(deferred)
        plan = self.handoff.on_abort(request_id)
        if plan.blocks is BlockFate.ON_THE_WIRE:
            return  # its prompt is done and pushed: the blocks are released when the transfer ends
        if plan.blocks is BlockFate.HOLD:  # held before the shards hear of the cancel
            request = self.scheduler.hold_for_handoff(request_id, status, error)
            if plan.orders is not None:
                self._round(plan.orders)
        else:  # freed once the shards stopped writing into them
            if plan.orders is not None:
                self._round(plan.orders)
            request = self.scheduler.finish_request(request_id, status, error)
        self._emit_ended(request)

    def poll_handoffs(self) -> None:
        """Take the shards' transfer reports without computing anything, so a hand-off acknowledged
        since the last step is released (and its caller told) now."""
        orders = self.handoff.poll()
        if orders is not None:
            self._round(orders)

    # --- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.grammars:
            return self._step()
        for request_id, error in self.grammars.take_failed():
            logger.warning("request %s ends: %s", request_id, error)
            self.abort_request(request_id, error=error)
        results = self._step()
        for output in results:
            if output.finished:
                self.grammars.remove(output.request_id)
        return results

    def _step(self) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        self._carry_out(self.handoff.before_schedule(time.monotonic()))
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            compiling = self.grammars.pending_ids() if self.grammars else ()
            scheduled = self.scheduler.schedule(self.prompt_token_cap(), skip=compiling)
            self.num_preemptions += len(scheduled.preempted_request_ids)
            ended, plan = self.handoff.after_schedule(scheduled)
            self._carry_out(ended)
            if scheduled.is_empty:
                self._emit_deferred()
                if plan is not None and (plan.pushes or plan.forget or self.handoff.busy):
                    self._round(plan)
                elif compiling:  # only requests waiting for their grammar: wait for one, don't spin
                    self.grammars.wait_for_compiles(_GRAMMAR_WAIT_S)
                return self._take_outputs_outside_step()
            try:
                launched = self._launch(scheduled, plan)
            except torch.OutOfMemoryError as exc:
                return self._step_out_of_memory(scheduled, exc)
        ahead_failed: tuple[SchedulerOutput, torch.OutOfMemoryError] | None = None
        try:
            # The device runs this step's kernels (queued, not yet read): the host makes the last
            # step's outputs meanwhile, and schedules and queues the next step where it may. A stop
            # string found there ends its request now; the token this step computes for it is
            # dropped (update_from_output skips ended requests).
            self._emit_deferred()
            if self._may_look_ahead(launched):
                self._in_flight, ahead_failed = self._look_ahead(launched)
            result = launched.pending.read() if launched.pending is not None else None
        except torch.OutOfMemoryError as exc:
            self.scheduler.drop_placeholders(launched.scheduled)
            return self._step_out_of_memory(launched.scheduled, exc)
        sampled: dict[str, int] = {}
        if result is not None:
            picks = zip(launched.sampled_ids, result.sampled_token_ids, result.logprobs, strict=True)
            for request_id, token_id, logprob in picks:
                sampled[request_id] = token_id
                self.outputs.record_logprob(request_id, logprob)
        # A step queued behind another starts on the device when that one ends.
        started = max(launched.started, self._device_free_at)
        self._device_free_at = ended = self._step_ended(launched)
        self._record_prefill_steps(launched.scheduled, started, ended)
        # With a connector, every step's end gathers each shard's report (engine.executor).
        reports = self.executor.finish_step(sampled) if self.executor.has_connector else None
        # With the next step already queued, outputs are made now, while it runs.
        defer = self.overlap_outputs and self._in_flight is None
        for request in self.scheduler.update_from_output(launched.scheduled, sampled):
            if request.status is RequestStatus.RUNNING and request.request_id in self.grammars:
                self._advance_constraint(request)
            if defer and request.status is RequestStatus.RUNNING:
                self._deferred.append(request)  # made while the next step runs
                continue
            output = self._emit_new_tokens(request)
            if request.status is RequestStatus.FINISHED_PREFILLED:
                output.kv_block_ids = self.kv.block_ids(request.request_id)
            results.append(output)
        if reports is not None:
            self._carry_out(self.handoff.after_step(reports))
        # Outputs made outside a step (aborts, first tokens of KV arrivals) leave once a step succeeded.
        results = self._take_outputs_outside_step() + results
        if ahead_failed is not None:  # its requests end after the tokens this step gave them
            results += self._step_out_of_memory(*ahead_failed)
        return results

    def _launch(
        self, scheduled: SchedulerOutput, plan: ConnectorStep | None, previous: _LaunchedStep | None = None
    ) -> _LaunchedStep:
        """Queue a step's forward pass and sampling on the device; nothing is read back.
        ``previous``: the step still on the device whose sampled ids this one's placeholders take."""
        started = time.monotonic()
        self.outputs.mark_scheduled([c.request_id for c in scheduled.chunks], started)
        step_input, sampled_ids, scored_rows = build_step_input(scheduled, self.layout.block_size)
        carried = None
        if previous is not None and previous.pending is not None and previous.pending.sampled is not None:
            carried = carried_tokens(step_input, sampled_ids, previous.sampled_ids, previous.pending.sampled)
        logits = self.executor.execute(step_input, plan, carried)
        self.num_steps += 1
        if scored_rows:  # the prompt-logprob rows follow the sampled ones
            assert logits is not None
            num_sampled = len(sampled_ids)
            scores = score_prompts(logits[num_sampled:], scored_rows, self._prompt_scoring)
            self.outputs.record_prompt_logprobs(scores)
            logits = logits[:num_sampled]
        pending = None
        if sampled_ids:
            assert logits is not None
            mask = None
            if self.grammars:  # filled on the host while the device computes the logits
                requests = [self.outputs.states[request_id].request for request_id in sampled_ids]
                mask = self.grammars.fill_bitmask(requests, self.vocab_size)
            pending = self.sampler.launch(logits, self._sampling_rows(sampled_ids), mask)
        done = None
        if pending is None and self._device.type == "cuda":
            # Nothing read back will wait for this step: an event marks its end (see _step_ended).
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self._device))
        return _LaunchedStep(scheduled, sampled_ids, pending, started, done)

    def _may_look_ahead(self, launched: _LaunchedStep) -> bool:
        """Whether the next step can be scheduled before this one's sampled ids are read: not
        right after a step scheduled ahead ran out of blocks (the next one preempts), and not when
        a sampled request's next logits need its tokens' values (penalties read them on the host)."""
        if not self.async_scheduling:
            return False
        if launched.scheduled.blocked:
            return False
        rows = launched.pending.rows if launched.pending is not None else ()
        # A constrained request's next mask needs its matcher to have taken this step's token.
        return not any(row.params.needs_penalties or row.params.structured_output is not None for row in rows)

    def _look_ahead(
        self, launched: _LaunchedStep
    ) -> tuple[_LaunchedStep | None, tuple[SchedulerOutput, torch.OutOfMemoryError] | None]:
        """Async scheduling: count ``launched``'s tokens as placeholders, schedule the next step
        without preempting (a preempted request would lose its unread token) and queue it behind
        ``launched``, its decodes' input ids taken from ``launched``'s samples on the device.
        Returns the step queued (None: nothing to run) or the step that ran out of memory."""
        ending = self.scheduler.advance(launched.scheduled)
        if self.grammars:
            ending |= self.grammars.pending_ids()
        scheduled = self.scheduler.schedule(self.prompt_token_cap(), may_preempt=False, skip=ending)
        if scheduled.is_empty:
            return None, None
        ended, plan = self.handoff.after_schedule(scheduled)
        assert not ended.end and (plan is None or not plan.pushes), "a prefill replica schedules no step ahead"
        try:
            ahead = self._launch(scheduled, plan, previous=launched)
        except torch.OutOfMemoryError as exc:
            return None, (scheduled, exc)
        self.num_steps_ahead += 1
        return ahead, None

    def _emit_deferred(self) -> None:
        """The outputs of the requests whose tokens the last step left unmade (overlap_outputs), in
        the order of outputs made outside a step: ahead of anything else the next step returns."""
        deferred, self._deferred = self._deferred, []
        for request in deferred:
            self._emit_if_live(request)

    def _emit_if_live(self, request: Request) -> None:
        if request.request_id in self.outputs.states and not request.is_finished:
            self._outputs_outside_step.append(self._emit_new_tokens(request))

    def _advance_constraint(self, request: Request) -> None:
        """The matcher takes the request's new token; a token it refuses (every token was masked:
        a dead end) is dropped and the request ends, as one whose grammar completed while it may not
        end by EOS does: finish_reason "stop", the reason logged."""
        end = self.grammars.advance(request)
        if end is None:
            return
        logger.info("request %s stops: %s", request.request_id, end.reason)
        if end.token_refused:
            request.drop_last_output_token()
            self.outputs.drop_last_logprob(request.request_id)
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _prompt_scoring(self, request_id: str) -> tuple[list[int], int]:
        request = self.scheduler.requests[request_id]  # just scheduled: the scheduler holds it
        return request.prompt_token_ids, request.sampling_params.prompt_logprobs or 0

    def _sampling_rows(self, sampled_ids: list[str]) -> list[SamplingRequestState]:
        rows = []
        for request_id in sampled_ids:
            state = self.outputs.states[request_id]
            request = state.request
            rows.append(
                SamplingRequestState(
                    request.sampling_params,
                    request.prompt_token_ids,
                    request.output_token_ids,
                    state.generator,
                    request.eos_token_ids,
                )
            )
        return rows

    def _step_out_of_memory(self, scheduled: SchedulerOutput, exc: torch.OutOfMemoryError) -> list[RequestOutput]:
        """A step that ran out of device memory ends its own requests with the error, nothing else:
        the engine (one shard: no peer is left inside a collective) frees the allocator's cache and
        serves on. Pushes the step had under way are cut off before the step ends, so no "done"
        follows layers it may have pushed (all of them, if it failed after the last layer)."""
        if self.executor.world_size > 1:
            # The other shards may be inside this step's collectives, or waiting for its end (the
            # sampler runs outside the executor's guard): the instance is done.
            self.executor.mark_broken()
            raise exc
        self.num_steps_out_of_memory += 1
        num_tokens = scheduled.num_batched_tokens
        logger.warning("a step of %d tokens ran out of memory: its requests end: %s", num_tokens, exc)
        request_ids = list(dict.fromkeys(chunk.request_id for chunk in scheduled.chunks))
        error = (
            f"out of memory computing a step of {num_tokens} tokens on {self._device}; retry, or send a shorter prompt"
        )
        orders, actions = self.handoff.after_failed_step(request_ids, error)
        if self.executor.has_connector:  # the failed step ends on every shard's connector too
            if orders is not None:  # cancels reach the shards first: the step's end then finishes nothing
                self.executor.connector_step(orders)
            self._carry_out(self.handoff.after_step(self.executor.finish_step(None)))
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._carry_out(actions)
        return self._take_outputs_outside_step()

    def prompt_token_cap(self) -> int | None:
        """How many prompt tokens a step beside decodes may compute (SchedulerConfig.max_decode_stall_s)."""
        stall_s = self.config.scheduler.max_decode_stall_s
        if stall_s is None:
            return None
        return max(MIN_STALL_CHUNK_TOKENS, int(self.prefill_tokens_per_s * stall_s))

    def _step_ended(self, launched: _LaunchedStep) -> float:
        """When the step's device work ended. On CUDA the forward pass returns once its kernels are
        queued: unless sampling read the sampled ids back (which waits for them), the step's end is
        an event recorded after it and waited for (that event alone, not the whole device, which
        may run the next step already), or a prompt-only step would time its launches and the
        prefill rate that routing, conditional disaggregation and the planner read would be far
        too high."""
        if launched.done is not None:
            launched.done.synchronize()
        return time.monotonic()

    def _record_prefill_steps(self, scheduled: SchedulerOutput, started: float, ended: float) -> None:
        """Each prompt chunk's step on its request's timeline (its trace spans), and two moving
        averages: the prompt tokens computed per second (what a router needs to tell how fast a
        replica's queued prompts drain between its reports; a step that also decodes counts its time
        less a decode step's) and the time of a step with no prompt tokens."""
        num_prefill = 0
        for chunk in scheduled.chunks:
            if chunk.in_prompt:
                num_prefill += len(chunk.token_ids)
                state = self.outputs.states.get(chunk.request_id)
                if state is not None:
                    state.metrics.prefill_chunks.append((started, ended, len(chunk.token_ids)))
        seconds = ended - started
        if seconds <= 0:
            return
        if not num_prefill:
            self.decode_step_s = _moving_average(self.decode_step_s, seconds)
            return
        if num_prefill < _MIN_PREFILL_TOKENS_TIMED:
            return
        if len(scheduled.chunks) > 1 and any(not chunk.in_prompt for chunk in scheduled.chunks):
            seconds = max(seconds - self.decode_step_s, seconds / 2)  # the decodes' share of a mixed step
        self.prefill_tokens_per_s = _moving_average(self.prefill_tokens_per_s, num_prefill / seconds)

    def _emit_new_tokens(self, request: Request) -> RequestOutput:
        """The output of a request's tokens not yet emitted; a stop string among them ends it."""
        new_ids, new_text, stop_hit = self.outputs.append_tokens(request.request_id)
        if stop_hit is not None:
            request.stop_reason = stop_hit
            if request.is_finished:  # the same token also hit max_tokens or EOS: the stop string wins
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        return self.outputs.build(request.request_id, new_ids, new_text)

    def _take_outputs_outside_step(self) -> list[RequestOutput]:
        outputs, self._outputs_outside_step = self._outputs_outside_step, []
        return outputs

    def _round(self, orders: ConnectorStep) -> None:
        """The shards take orders without a forward pass and report back."""
        self.executor.connector_step(orders)
        self._carry_out(self.handoff.after_step(self.executor.finish_step(None)))

    def _carry_out(self, actions: HandoffActions) -> None:
        """What a hand-off hook returned, in its fields' order."""
        for ending in actions.end:
            rid, status, error = ending.request_id, ending.status, ending.error
            if ending.hold_blocks:
                self._emit_ended(self.scheduler.hold_for_handoff(rid, status, error))
            else:
                self._emit_ended(self.scheduler.finish_request(rid, status, error))
        for request_id in actions.release:
            self.scheduler.release(request_id)
        for request_id, first_token in actions.landed:
            self.kv_ready(request_id, first_token)
        if actions.forget_now:
            self.executor.connector_step(ConnectorStep(forget=actions.forget_now))
            self.executor.finish_step(None)
        for request_id, error in actions.abort:
            self.abort_request(request_id, error=error)

    def _emit_ended(self, request: Request | None) -> None:
        """A request ended outside a step: its last output goes out with the next step's."""
        if request is not None and request.request_id in self.outputs.states:
            self._outputs_outside_step.append(self.outputs.build(request.request_id))

    # --- introspection ---------------------------------------------------------------------
    def can_accept(self) -> bool:
        """Whether add_request would find room in the bounded waiting queue."""
        return len(self.scheduler.waiting) < self.config.scheduler.max_num_waiting

    def check_shards(self) -> None:
        """Raise if a tensor-parallel shard of this instance died (found between steps too)."""
        self.executor.check_shards()

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or KV hand-offs not yet terminal (keep stepping)."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._outputs_outside_step)
            or bool(self._deferred)
            or self._in_flight is not None
            or self.handoff.busy
        )

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv.pool.take_events()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_reserved=len(s.reserved),
            num_handoff=len(s.handoff),
            num_preemptions=self.num_preemptions,
            kv=self.kv.pool.stats(),
        )

    @property
    def num_free_kv_blocks(self) -> int:
        """Blocks an allocation can take now (prefix-cached ones included: they are evictable)."""
        return self.kv.pool.num_free_blocks

    def num_blocks_held(self) -> int:
        """Blocks referenced by requests (prefix-cached free blocks not counted); 0 when idle."""
        return self.kv.num_held_blocks()

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    # The hand-off's figures (engine.handoff), under the names a replica's load report gives them.
    @property
    def transfers_sent(self) -> dict[str, SentKV]:
        """Prefill role: hand-offs ended on every shard, until their caller takes them."""
        return self.handoff.ended

    @property
    def transfer_failures(self) -> dict[str, str]:
        """Prefill role: of those, why each failed one's KV did not arrive."""
        return {rid: sent.failure for rid, sent in self.handoff.ended.items() if sent.failure is not None}

    @property
    def num_kv_transfer_failures(self) -> int:
        return self.handoff.counts.num_kv_transfer_failures

    @property
    def num_kv_lease_expirations(self) -> int:
        return self.handoff.counts.num_kv_lease_expirations

    @property
    def num_prefills_expired(self) -> int:
        return self.handoff.counts.num_prefills_expired

    @property
    def num_kv_pushes_cancelled(self) -> int:
        return self.handoff.counts.num_kv_pushes_cancelled

    @property
    def role(self) -> EngineRole:
        return self.config.scheduler.role

    def shutdown(self) -> None:
        self.executor.shutdown()
