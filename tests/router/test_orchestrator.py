"""The orchestrator's retry, resume and cancellation rules, against scripted pool handles (no Ray).

The real pools and Serve handles are exercised end to end in tests/cluster/test_serving.py; here
each failure is staged exactly, which a live cluster cannot do deterministically.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from ray import exceptions as ray_exceptions

from common.errors import InvalidRequestError, OverloadedError
from common.sampling_params import SamplingParams
from common.serving import KV_LOAD_FAILED, PrefillResult, ServeRequest, StreamDelta, TicketIssued
from router.orchestrator import Orchestrator

TOKENS = list(range(100, 140))  # what a greedy decode of any prompt yields, in this fake world


def _actor_died() -> Exception:
    return ray_exceptions.ActorDiedError()


class FakeStream:
    """One decode attempt: a ticket, then one delta per token; may die after ``die_after`` tokens.
    ``timings`` (queue, prefill seconds): what a replica that ran the prompt puts on its finished delta."""

    # (prompt, token) -> the text the engine emits with the token (default "<token>")
    text_of: staticmethod = staticmethod(lambda prompt, token: f"<{token}>")

    def __init__(
        self,
        request: ServeRequest,
        colocated: bool,
        die_after: int | None,
        error: str | None,
        timings: tuple[float, float] | None = None,
    ) -> None:
        self.request = request
        self.colocated = colocated
        self.die_after = die_after
        self.error = error
        self.timings = timings
        self.cancelled = False
        self._items = self._generate()

    async def _generate(self):
        if self.error is not None:
            yield StreamDelta(self.request.request_id, [], "", finish_reason="error", error=self.error)
            return
        if not self.colocated and not self.request.prefill_here:
            yield TicketIssued(self.request.request_id, {"request_id": self.request.request_id}, "d0")
        # Greedy continuation: the prompt's last token decides where the sequence goes on.
        start = len(self.request.prompt_token_ids) - 3  # prompts are 3 tokens long
        max_tokens = self.request.sampling["max_tokens"]
        for i, token in enumerate(TOKENS[start : start + max_tokens]):
            if self.die_after is not None and i == self.die_after:
                raise _actor_died()
            last = i == max_tokens - 1
            text = self.text_of(self.request.prompt_token_ids, token)
            queue_time_s, prefill_time_s = self.timings if last and self.timings else (None, None)
            yield StreamDelta(
                self.request.request_id,
                [token],
                text,
                finish_reason="length" if last else None,
                queue_time_s=queue_time_s,
                prefill_time_s=prefill_time_s,
            )
            await asyncio.sleep(0)

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._items.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeDecode:
    def __init__(self, script: list[dict], colocated: bool = False) -> None:
        self.script = script  # one dict of FakeStream options per attempt
        self.colocated = colocated
        self.streams: list[FakeStream] = []
        self.generate = self

    def options(self, stream: bool = False):
        return self

    def remote(self, request: ServeRequest) -> FakeStream:
        options = self.script[len(self.streams)] if len(self.streams) < len(self.script) else {}
        stream = FakeStream(
            request, self.colocated, options.get("die_after"), options.get("error"), options.get("timings")
        )
        self.streams.append(stream)
        return stream


class FakeResponse:
    def __init__(self, outcome) -> None:
        self.outcome = outcome
        self.cancelled = False

    def __await__(self):
        async def resolve():
            await asyncio.sleep(0)
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return self.outcome

        return resolve().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class FakePrefill:
    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes
        self.requests: list[ServeRequest] = []
        self.prefill = self

    def remote(self, request: ServeRequest) -> FakeResponse:
        self.requests.append(request)
        outcome = self.outcomes[len(self.requests) - 1] if len(self.requests) <= len(self.outcomes) else None
        return FakeResponse(outcome or PrefillResult(request.request_id, 1, 0))


def run(orchestrator: Orchestrator, params: SamplingParams, **kwargs) -> list[StreamDelta]:
    async def collect():
        return [d async for d in orchestrator.run("req", [1, 2, 3], params, **kwargs)]

    return asyncio.run(collect())


def tokens(deltas: list[StreamDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_disaggregated_request_streams_every_token_once():
    decode, prefill = FakeDecode([{}]), FakePrefill([])
    deltas = run(Orchestrator(decode, prefill), GREEDY)
    assert tokens(deltas) == TOKENS[:8] and deltas[-1].finish_reason == "length"
    assert prefill.requests[0].kv_ticket == {"request_id": "req.0"}
    assert all(d.request_id == "req" and d.num_prompt_tokens == 3 for d in deltas)


def test_colocated_request_needs_no_prefill_pool():
    deltas = run(Orchestrator(FakeDecode([{}], colocated=True), None), GREEDY)
    assert tokens(deltas) == TOKENS[:8]


def test_a_lost_prefill_replica_is_retried_once_on_the_decode_replica_and_the_first_reservation_cancelled():
    decode, prefill = FakeDecode([{}, {}]), FakePrefill([_actor_died(), None])
    orchestrator = Orchestrator(decode, prefill, max_retries=1)
    deltas = run(orchestrator, GREEDY)
    assert tokens(deltas) == TOKENS[:8]
    assert [r.request_id for r in prefill.requests] == ["req.0"]  # the retry did not go back to the pool
    assert [s.request.prefill_here for s in decode.streams] == [False, True]
    assert decode.streams[0].cancelled and orchestrator.num_retries == 1


def test_a_failed_hand_off_ends_the_attempt_at_once_and_retries():
    decode = FakeDecode([{}, {}])
    prefill = FakePrefill([PrefillResult("req.0", None, 0, "receiver gone"), None])
    deltas = run(Orchestrator(decode, prefill), GREEDY)
    assert tokens(deltas) == TOKENS[:8] and decode.streams[0].cancelled
    assert decode.streams[1].request.prefill_here


def test_while_the_prefill_pool_is_down_prompts_go_straight_to_decode(finished_spans):
    decode, prefill = FakeDecode([{}]), FakePrefill([])
    assert tokens(run(Orchestrator(decode, prefill, prefill_pool_down=lambda: True), GREEDY)) == TOKENS[:8]
    assert decode.streams[0].request.prefill_here and not prefill.requests
    (attempt,) = [s for s in finished_spans() if s.name == "pdserve.attempt"]
    assert attempt.attributes["pdserve.prefill_failover"] is True


def test_the_prefill_pool_is_down_when_every_replica_it_reported_failed_or_drains(monkeypatch):
    from router import routing_state

    monkeypatch.setattr(routing_state, "_LATEST", {})
    assert routing_state.takes_requests("nowhere") is None  # nothing seen: nothing known against it
    routing_state.record("test-pool", {"a": {"engine_error": "shard died"}, "b": {"draining": True}})
    assert routing_state.takes_requests("test-pool") is False
    routing_state.record("test-pool", {"a": {"engine_error": "shard died"}, "c": {"engine_error": ""}})
    assert routing_state.takes_requests("test-pool") is True
    routing_state.record("test-pool", {})  # Serve removed the last one
    assert routing_state.takes_requests("test-pool") is False


def test_a_prefill_replica_whose_engine_stopped_fails_over_to_decode_but_a_full_pool_is_a_503():
    from ray.serve.exceptions import BackPressureError

    stopped = RuntimeError("the engine stopped: a tensor-parallel shard died")  # what its method raises
    decode, prefill = FakeDecode([{}, {}]), FakePrefill([stopped])
    orchestrator = Orchestrator(decode, prefill, max_retries=1)
    assert tokens(run(orchestrator, GREEDY)) == TOKENS[:8]
    assert [s.request.prefill_here for s in decode.streams] == [False, True] and len(prefill.requests) == 1
    full = BackPressureError(num_queued_requests=8, max_queued_requests=8)
    decode, prefill = FakeDecode([{}, {}]), FakePrefill([full])
    with pytest.raises(OverloadedError):
        run(Orchestrator(decode, prefill, max_retries=1), GREEDY)
    assert len(decode.streams) == 1 and decode.streams[0].cancelled


def test_a_decode_replica_lost_mid_stream_resumes_with_prompt_plus_sent_tokens():
    decode, prefill = FakeDecode([{"die_after": 3}, {}]), FakePrefill([])
    orchestrator = Orchestrator(decode, prefill)
    deltas = run(orchestrator, GREEDY)
    assert tokens(deltas) == TOKENS[:8]  # nothing lost, nothing repeated
    resumed = decode.streams[1].request
    assert resumed.prompt_token_ids == [1, 2, 3, *TOKENS[:3]] and resumed.sampling["max_tokens"] == 5
    assert orchestrator.num_resumes == 1


def test_stop_strings_cannot_resume_and_end_with_an_error_delta():
    decode = FakeDecode([{"die_after": 3}, {}])
    deltas = run(Orchestrator(decode, FakePrefill([])), SamplingParams(temperature=0, max_tokens=8, stop=["x"]))
    assert tokens(deltas) == TOKENS[:3]
    assert deltas[-1].finish_reason == "error" and "stop strings" in deltas[-1].error
    assert len(decode.streams) == 1


STOPPED = "unavailable: the engine stopped: a tensor-parallel shard died"  # a decode replica's refusal


def test_a_replica_whose_engine_stopped_is_asked_again_uncounted_until_another_serves():
    # The stream's replica fails mid-stream; the next two calls meet a replica that refuses (its
    # engine stopped, the router's view not caught up yet); the third resumes. One resume counted.
    decode = FakeDecode([{"die_after": 3}, {"error": STOPPED}, {"error": STOPPED}, {}])
    orchestrator = Orchestrator(decode, FakePrefill([]), max_retries=1)
    deltas = run(orchestrator, GREEDY)
    assert tokens(deltas) == TOKENS[:8] and deltas[-1].finish_reason == "length"
    assert [s.request.request_id for s in decode.streams] == ["req.0", "req.1", "req.2", "req.3"]
    assert decode.streams[3].request.prompt_token_ids == [1, 2, 3, *TOKENS[:3]]
    assert (orchestrator.num_resumes, orchestrator.num_retries) == (1, 0)


def test_with_no_working_decode_replica_a_new_request_is_a_503_at_once():
    decode = FakeDecode([{"error": STOPPED}, {}])
    with pytest.raises(OverloadedError, match="no working replica"):
        run(Orchestrator(decode, FakePrefill([]), decode_pool_down=lambda: True), GREEDY)
    assert not decode.streams  # not even asked: Serve would hold the call until a replica is back
    # Known down only after a replica refused: the next call is not made either.
    down = iter([False, True])
    decode = FakeDecode([{"error": STOPPED}, {}])
    with pytest.raises(OverloadedError, match="no working replica"):
        run(Orchestrator(decode, FakePrefill([]), decode_pool_down=lambda: next(down)), GREEDY)
    assert len(decode.streams) == 1


def test_retries_are_bounded():
    decode = FakeDecode([{"die_after": 0}, {"die_after": 0}, {}])
    deltas = run(Orchestrator(decode, FakePrefill([]), max_retries=1), GREEDY)
    assert deltas[-1].finish_reason == "error" and len(decode.streams) == 2


def test_pool_refusals_raise_so_the_router_can_answer_with_a_status():
    with pytest.raises(OverloadedError):
        run(Orchestrator(FakeDecode([{"error": "overloaded: no free KV blocks"}]), FakePrefill([])), GREEDY)
    with pytest.raises(InvalidRequestError):
        run(Orchestrator(FakeDecode([{"error": "invalid_request: bad"}]), FakePrefill([])), GREEDY)


def test_closing_the_stream_early_cancels_the_decode_request():
    decode = FakeDecode([{}])
    orchestrator = Orchestrator(decode, FakePrefill([]))

    async def read_two_then_leave():
        deltas = orchestrator.run("req", [1, 2, 3], GREEDY)
        got = [await deltas.__anext__(), await deltas.__anext__()]
        await deltas.aclose()
        return got

    assert len(asyncio.run(read_two_then_leave())) == 2
    assert decode.streams[0].cancelled


def test_each_request_and_each_attempt_is_a_trace_span(finished_spans):
    run(Orchestrator(FakeDecode([{"die_after": 2}, {}]), FakePrefill([])), GREEDY)
    spans = {s.name: s for s in finished_spans()}
    attempts = [s for s in finished_spans() if s.name == "pdserve.attempt"]
    request = spans["pdserve.request"]
    assert request.attributes["attempts"] == 2 and len(attempts) == 2
    assert all(a.parent.span_id == request.context.span_id for a in attempts)
    assert [e.name for e in attempts[1].events] == ["kv_ticket", "prefill_done", "first_token"]


def test_a_client_s_traceparent_parents_the_request_and_the_pools_get_their_attempt_s(finished_spans):
    from common.tracing import extract

    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"Traceparent": f"00-{client_trace}-{client_span}-01"}
    decode, prefill = FakeDecode([{}]), FakePrefill([])

    async def collect():
        deltas = Orchestrator(decode, prefill).run(
            "req",
            [1, 2, 3],
            GREEDY,
            trace_context=extract(headers),
            span_name="text_completion smol",
            attributes={"gen_ai.operation.name": "text_completion", "gen_ai.request.model": "smol"},
        )
        return [d async for d in deltas]

    deltas = asyncio.run(collect())
    spans = {s.name: s for s in finished_spans()}
    request, attempt = spans["text_completion smol"], spans["pdserve.attempt"]
    assert f"{request.context.trace_id:032x}" == client_trace and f"{request.parent.span_id:016x}" == client_span
    assert request.kind.name == "SERVER" and attempt.parent.span_id == request.context.span_id
    assert request.attributes["gen_ai.request.model"] == "smol"
    assert request.attributes["gen_ai.usage.input_tokens"] == 3
    assert request.attributes["gen_ai.usage.output_tokens"] == len(tokens(deltas)) == 8
    assert request.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # Both pools' calls carry the attempt's span as their parent, in W3C form.
    parent = f"00-{client_trace}-{attempt.context.span_id:016x}-01"
    assert decode.streams[0].request.trace_context == {"traceparent": parent}
    assert prefill.requests[0].trace_context == {"traceparent": parent}


def test_resumed_text_is_recomputed_so_a_held_back_character_is_not_lost(monkeypatch):
    # Tokens 102 and 103 are the two halves of "é": the engine emits nothing with 102 (held back)
    # and "é" with 103 — unless 102 is in its prompt, as after a resume: then nothing at all. The
    # replica dies after sending 102; the resumed stream must still emit "é".
    def engine_text(prompt: list[int], token: int) -> str:
        if token == 102:
            return ""
        if token == 103:
            return "" if 102 in prompt else "é"
        return f"<{token}>"

    monkeypatch.setattr(FakeStream, "text_of", staticmethod(engine_text))

    def detokenize(ids: list[int], skip_special_tokens: bool) -> str:
        text = "".join("" if t == 103 else f"<{t}>" for t in ids)
        return text.replace("<102>", "é" if 103 in ids else "\ufffd")

    decode = FakeDecode([{"die_after": 3}, {}])
    deltas = run(Orchestrator(decode, FakePrefill([]), detokenize=detokenize), GREEDY)
    assert tokens(deltas) == TOKENS[:8]
    assert "".join(d.new_text for d in deltas) == "<100><101>é<104><105><106><107>"


def test_penalties_on_output_tokens_cannot_resume():
    decode = FakeDecode([{"die_after": 3}, {}])
    params = SamplingParams(temperature=0, max_tokens=8, frequency_penalty=0.5)
    deltas = run(Orchestrator(decode, FakePrefill([])), params)
    assert deltas[-1].finish_reason == "error" and "penalties" in deltas[-1].error


def test_the_first_tokens_logprob_and_cache_hits_come_from_prefill():
    from common.outputs import TokenLogprob

    first = TokenLogprob(TOKENS[0], -0.5)
    prefill = FakePrefill([PrefillResult("req.0", TOKENS[0], 16, first_logprob=first)])
    deltas = run(Orchestrator(FakeDecode([{}]), prefill), SamplingParams(temperature=0, max_tokens=3, logprobs=0))
    assert deltas[0].logprobs[0] == first
    assert all(d.num_cached_tokens == 16 for d in deltas)


class HeldResponse(FakeResponse):
    """A prefill reply that arrives only when the test releases it."""

    def __init__(self, outcome, release: asyncio.Event) -> None:
        super().__init__(outcome)
        self.release = release

    def __await__(self):
        async def resolve():
            await self.release.wait()
            return self.outcome

        return resolve().__await__()


def test_decode_deltas_stream_before_prefills_reply_whose_facts_reach_the_last_delta():
    async def scenario():
        release = asyncio.Event()
        prefill = FakePrefill([])
        prefill.remote = lambda request: (
            prefill.requests.append(request)
            or HeldResponse(
                PrefillResult(request.request_id, TOKENS[0], 16, queue_time_s=0.01, kv_exposed_s=0.002), release
            )
        )
        orchestrator = Orchestrator(FakeDecode([{}]), prefill)
        deltas = orchestrator.run("req", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
        got = [await deltas.__anext__() for _ in range(3)]  # prefill has not answered yet
        release.set()
        got += [d async for d in deltas]
        return got

    deltas = asyncio.run(scenario())
    assert tokens(deltas) == TOKENS[:4]
    assert [d.num_cached_tokens for d in deltas[:3]] == [0, 0, 0] and deltas[-1].num_cached_tokens == 16
    breakdown = deltas[-1].ttft_breakdown  # the reply came after the first token, before the last
    assert (breakdown.queue_s, breakdown.kv_transfer_exposed_s) == (0.01, 0.002)


def test_a_request_asking_for_logprobs_holds_its_first_delta_for_prefills_reply():
    from common.outputs import TokenLogprob

    first = TokenLogprob(TOKENS[0], -0.5)

    async def scenario():
        release = asyncio.Event()
        prefill = FakePrefill([])
        prefill.remote = lambda request: HeldResponse(
            PrefillResult(request.request_id, TOKENS[0], 0, first_logprob=first), release
        )
        deltas = Orchestrator(FakeDecode([{}]), prefill).run(
            "req", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, logprobs=0)
        )
        pending = asyncio.ensure_future(deltas.__anext__())
        await asyncio.sleep(0.05)
        held = not pending.done()
        release.set()
        return held, [await pending] + [d async for d in deltas]

    held, deltas = asyncio.run(scenario())
    assert held and deltas[0].logprobs[0] == first


def test_decode_failing_before_its_first_token_takes_prefills_verdict():
    class TicketThenError(FakeDecode):
        def remote(self, request):
            stream = super().remote(request)

            async def items():
                yield TicketIssued(request.request_id, {"request_id": request.request_id}, "d0")
                yield StreamDelta(request.request_id, [], "", finish_reason="error", error="KV transfer failed: lease")

            stream._items = items()
            return stream

    class SlowResponse(FakeResponse):  # prefill answers after decode already failed
        def __await__(self):
            async def resolve():
                await asyncio.sleep(0.05)
                return self.outcome

            return resolve().__await__()

    prefill = FakePrefill([])
    prefill.remote = lambda request: SlowResponse(
        PrefillResult(request.request_id, None, 0, "overloaded: 256 requests are already waiting")
    )
    with pytest.raises(OverloadedError, match="already waiting"):  # a 503, not a failed hand-off
        run(Orchestrator(TicketThenError([{}]), prefill, max_retries=0), GREEDY)


class FirstTicketThenError(FakeDecode):
    """Its first call issues a ticket, then fails with ``error`` before any token; later calls serve."""

    def __init__(self, error: str) -> None:
        super().__init__([{}, {}])
        self.error = error

    def remote(self, request):
        stream = super().remote(request)
        if len(self.streams) == 1:

            async def items():
                yield TicketIssued(request.request_id, {"request_id": request.request_id}, "d0")
                yield StreamDelta(request.request_id, [], "", finish_reason="error", error=self.error)

            stream._items = items()
        return stream


def test_a_hand_off_that_failed_with_its_decode_side_keeps_the_retry_on_the_prefill_pool():
    release = asyncio.Event()  # prefill's reply (its hand-off failed) comes after decode's error
    decode = FirstTicketThenError("engine stopped")
    prefill = FakePrefill([])
    replies = iter([PrefillResult("req.0", None, 0, "the receiver went away"), None])

    def reply(request):
        prefill.requests.append(request)
        outcome = next(replies) or PrefillResult(request.request_id, 1, 0)
        if outcome.error is not None:
            asyncio.get_running_loop().call_later(0.05, release.set)
            return HeldResponse(outcome, release)
        return FakeResponse(outcome)

    prefill.remote = reply
    assert tokens(run(Orchestrator(decode, prefill, max_retries=1), GREEDY)) == TOKENS[:8]
    assert not decode.streams[1].request.prefill_here and len(prefill.requests) == 2


class LateResponse(FakeResponse):
    """A prefill reply that comes a moment after decode's first items."""

    def __await__(self):
        async def resolve():
            await asyncio.sleep(0.05)
            return self.outcome

        return resolve().__await__()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("first", ["prefill's verdict", "decode's error"])
def test_a_kv_load_failure_recomputes_on_decode_or_ends_the_request_by_policy(policy, first):
    """Whichever side reports it first (prefill's failed push, or decode's kv_load_failed error
    with prefill's failed verdict behind it), a hand-off whose KV never loaded is retried with the
    prompt computed on decode (recompute), or ends the request at once (fail)."""
    refused = "chunk (0, 0) refused: payload checksum mismatch"
    if first == "decode's error":
        decode = FirstTicketThenError(f"{KV_LOAD_FAILED}: {refused}")
        prefill = FakePrefill([])
        prefill.remote = lambda request: (
            prefill.requests.append(request) or LateResponse(PrefillResult(request.request_id, None, 0, refused))
        )
    else:
        decode = FakeDecode([{}, {}])
        prefill = FakePrefill([PrefillResult("req.0", None, 0, refused)])
    deltas = run(Orchestrator(decode, prefill, max_retries=3, kv_load_failure_policy=policy), GREEDY)
    assert len(prefill.requests) == 1  # never a second transfer
    if policy == "recompute":
        assert tokens(deltas) == TOKENS[:8]
        assert [s.request.prefill_here for s in decode.streams] == [False, True]
    else:
        assert tokens(deltas) == [] and len(decode.streams) == 1
        assert deltas[-1].finish_reason == "error" and "kv_load_failure_policy: fail" in deltas[-1].error
        assert refused in deltas[-1].error


def test_decode_failing_on_its_own_is_no_kv_load_failure_even_under_fail():
    decode = FirstTicketThenError("unexpected: the engine raised")
    prefill = FakePrefill([])
    replies = iter([PrefillResult("req.0", None, 0, "the receiver went away"), None])

    def reply(request):  # the failed verdict comes after decode's own error
        prefill.requests.append(request)
        outcome = next(replies)
        return LateResponse(outcome) if outcome else FakeResponse(PrefillResult(request.request_id, 1, 0))

    prefill.remote = reply
    deltas = run(Orchestrator(decode, prefill, max_retries=1, kv_load_failure_policy="fail"), GREEDY)
    assert tokens(deltas) == TOKENS[:8] and len(prefill.requests) == 2


def test_once_decode_failed_a_prefill_that_never_answers_is_waited_for_a_moment_only(monkeypatch):
    from router import attempt as module

    monkeypatch.setattr(module, "_PREFILL_FACTS_WAIT_S", 0.2)  # 5 s in production
    never = asyncio.Event()  # the first prefill reply never comes
    prefill = FakePrefill([])
    prefill.remote = lambda request: prefill.requests.append(request) or HeldResponse(None, never)
    started = time.monotonic()
    decode = FirstTicketThenError("KV transfer failed: lease expired")
    deltas = run(Orchestrator(decode, prefill, request_timeout_s=60), GREEDY)
    assert tokens(deltas) == TOKENS[:8]  # retried on decode, not held until the request's 60 s deadline
    assert time.monotonic() - started < 5
    # A prefill replica silent past decode's lease is not asked again: decode computes the prompt.
    assert decode.streams[1].request.prefill_here and len(prefill.requests) == 1


def test_a_decode_stream_that_never_answers_ends_at_the_request_s_deadline():
    class Silent(FakeDecode):
        def remote(self, request):
            stream = super().remote(request)

            async def items():
                await asyncio.Event().wait()  # the replica hangs
                yield  # pragma: no cover

            stream._items = items()
            return stream

    decode = Silent([{}, {}])
    started = time.monotonic()
    deltas = run(Orchestrator(decode, FakePrefill([]), request_timeout_s=0.3, max_retries=1), GREEDY)
    assert deltas[-1].finish_reason == "error" and "timed out" in deltas[-1].error
    assert time.monotonic() - started < 3 and decode.streams[0].cancelled


def test_serve_back_pressure_is_a_503_and_other_pool_errors_are_retried():
    from ray.serve.exceptions import BackPressureError

    class Refusing(FakeDecode):
        def remote(self, request):
            stream = super().remote(request)
            if len(self.streams) == 1:
                stream._items = _raise(self.error)
            return stream

    async def _raise(exc):
        raise exc
        yield  # pragma: no cover

    decode = Refusing([{}, {}])
    decode.error = BackPressureError(num_queued_requests=8, max_queued_requests=8)
    with pytest.raises(OverloadedError):
        run(Orchestrator(decode, FakePrefill([])), GREEDY)
    decode = Refusing([{}, {}])
    decode.error = RuntimeError("engine call timed out")
    assert tokens(run(Orchestrator(decode, FakePrefill([])), GREEDY)) == TOKENS[:8]


# --- the TTFT breakdown on the last delta --------------------------------------------------------------


def run_timed(orchestrator: Orchestrator, ago_s: float = 1.0) -> tuple[list[StreamDelta], float, float]:
    """The request's deltas, the router having got it ``ago_s`` before; and bounds on its TTFT."""
    arrival = time.monotonic() - ago_s
    earliest = time.monotonic() - arrival
    deltas = run(orchestrator, GREEDY, arrival_time=arrival)
    return deltas, earliest, time.monotonic() - arrival


def test_the_last_delta_breaks_the_ttft_down_from_prefills_reply_and_so_does_the_span(finished_spans):
    reply = PrefillResult("req.0", TOKENS[0], 0, queue_time_s=0.2, prefill_time_s=0.5, kv_exposed_s=0.1)
    deltas, earliest, latest = run_timed(Orchestrator(FakeDecode([{}]), FakePrefill([reply])))
    *before_last, last = deltas
    assert all(d.ttft_breakdown is None for d in before_last)  # nothing per token
    breakdown = last.ttft_breakdown
    assert (breakdown.queue_s, breakdown.prefill_s, breakdown.kv_transfer_exposed_s) == (0.2, 0.5, 0.1)
    assert earliest - 0.8 <= breakdown.other_s <= latest - 0.8  # TTFT counts from arrival_time
    (request,) = [s for s in finished_spans() if s.name == "pdserve.request"]
    assert request.attributes["pdserve.ttft.queue_s"] == 0.2
    assert request.attributes["pdserve.ttft.prefill_s"] == 0.5
    assert request.attributes["pdserve.ttft.kv_transfer_exposed_s"] == 0.1
    assert request.attributes["pdserve.ttft.other_s"] == breakdown.other_s


def test_colocated_parts_come_from_the_finished_delta_and_no_kv_moved(finished_spans):
    decode = FakeDecode([{"timings": (0.1, 0.3)}], colocated=True)
    deltas, earliest, latest = run_timed(Orchestrator(decode, None))
    breakdown = deltas[-1].ttft_breakdown
    assert (breakdown.queue_s, breakdown.prefill_s, breakdown.kv_transfer_exposed_s) == (0.1, 0.3, None)
    assert earliest - 0.4 <= breakdown.other_s <= latest - 0.4
    (request,) = [s for s in finished_spans() if s.name == "pdserve.request"]
    assert "pdserve.ttft.kv_transfer_exposed_s" not in request.attributes
    assert request.attributes["pdserve.ttft.queue_s"] == 0.1


def test_a_retried_request_takes_the_parts_of_the_attempt_that_produced_its_first_token():
    failed = PrefillResult("req.0", None, 0, "receiver gone", queue_time_s=0.7, prefill_time_s=0.2, kv_exposed_s=0.05)
    # The retry computes the prompt on its decode replica: its parts are that replica's, no KV moved.
    decode = FakeDecode([{}, {"timings": (0.02, 0.3)}])
    deltas, _, _ = run_timed(Orchestrator(decode, FakePrefill([failed])))
    breakdown = deltas[-1].ttft_breakdown
    assert (breakdown.queue_s, breakdown.prefill_s, breakdown.kv_transfer_exposed_s) == (0.02, 0.3, None)


def test_a_stream_resumed_elsewhere_has_no_parts_its_first_attempt_took_them_along():
    # The resumed attempt's own prompt times (prompt + sent tokens, on another replica) are not the TTFT's.
    decode = FakeDecode([{"die_after": 3}, {"timings": (0.2, 0.1)}], colocated=True)
    deltas, earliest, latest = run_timed(Orchestrator(decode, None))
    assert tokens(deltas) == TOKENS[:8]
    breakdown = deltas[-1].ttft_breakdown
    assert (breakdown.queue_s, breakdown.prefill_s, breakdown.kv_transfer_exposed_s) == (None, None, None)
    assert earliest <= breakdown.other_s <= latest  # all of the TTFT


def test_a_request_that_failed_carries_no_breakdown():
    deltas = run(Orchestrator(FakeDecode([{"die_after": 0}, {"die_after": 0}]), FakePrefill([]), max_retries=1), GREEDY)
    assert deltas[-1].finish_reason == "error" and deltas[-1].ttft_breakdown is None


def test_a_seeded_sample_cannot_resume_but_a_seeded_greedy_request_does():
    decode = FakeDecode([{"die_after": 3}, {}])
    deltas = run(Orchestrator(decode, FakePrefill([])), SamplingParams(temperature=0.8, seed=7, max_tokens=8))
    assert tokens(deltas) == TOKENS[:3] and len(decode.streams) == 1
    assert deltas[-1].finish_reason == "error" and "seeded sample cannot be resumed" in deltas[-1].error
    decode = FakeDecode([{"die_after": 3}, {}])
    deltas = run(Orchestrator(decode, FakePrefill([])), SamplingParams(temperature=0, seed=7, max_tokens=8))
    assert tokens(deltas) == TOKENS[:8] and len(decode.streams) == 2  # greedy ignores the seed: resumed


def test_a_decode_replica_that_stalls_mid_stream_is_left_and_the_stream_resumes_elsewhere():
    """The replica sends 3 tokens and then nothing (stopped, not killed): within the inter-token
    timeout the stream resumes on another replica with prompt + sent tokens, nothing lost or
    repeated, the stalled stream cancelled. Before the first token the watchdog does not apply."""

    class StallsAfterThree(FakeDecode):
        def remote(self, request):
            stream = super().remote(request)
            if len(self.streams) == 1:
                real = stream._items

                async def items():
                    for _ in range(4):  # the ticket, then three tokens
                        yield await real.__anext__()
                    await asyncio.Event().wait()  # the replica hangs

                stream._items = items()
            return stream

    decode = StallsAfterThree([{}, {}])
    orchestrator = Orchestrator(decode, FakePrefill([]), inter_token_timeout_s=0.3)
    started = time.monotonic()
    deltas = run(orchestrator, GREEDY)
    assert tokens(deltas) == TOKENS[:8] and deltas[-1].finish_reason == "length"
    assert decode.streams[0].cancelled and orchestrator.num_resumes == 1
    assert decode.streams[1].request.prompt_token_ids == [1, 2, 3, *TOKENS[:3]]
    assert time.monotonic() - started < 5
    # The replica it stalled on ("d0", named by its ticket) is not placed on again: stopped, it
    # still looks alive to Serve for seconds.
    assert decode.streams[0].request.avoid_replicas == () and decode.streams[1].request.avoid_replicas == ("d0",)


def test_the_watchdog_waits_no_longer_than_the_request_s_deadline():
    class Silent(FakeDecode):
        def remote(self, request):
            stream = super().remote(request)

            async def items():
                await asyncio.Event().wait()
                yield  # pragma: no cover

            stream._items = items()
            return stream

    decode = Silent([{}, {}])
    deltas = run(Orchestrator(decode, FakePrefill([]), request_timeout_s=0.3, inter_token_timeout_s=60), GREEDY)
    assert deltas[-1].finish_reason == "error" and "timed out" in deltas[-1].error


def test_a_constrained_stream_fails_over_before_its_first_token_but_is_not_resumed_after_it():
    # A matcher that restarted from the prompt on another replica would constrain the rest wrongly.
    from common.structured_outputs import ConstraintKind, StructuredOutput

    constrained = SamplingParams(
        temperature=0, max_tokens=8, structured_output=StructuredOutput(ConstraintKind.REGEX, "[a-z]+")
    )
    decode = FakeDecode([{"die_after": 3}, {}])
    deltas = run(Orchestrator(decode, FakePrefill([])), constrained)
    assert tokens(deltas) == TOKENS[:3] and len(decode.streams) == 1
    assert deltas[-1].finish_reason == "error" and "constrained output cannot be resumed" in deltas[-1].error
    decode = FakeDecode([{"die_after": 0}, {}])
    deltas = run(Orchestrator(decode, FakePrefill([])), constrained)
    assert tokens(deltas) == TOKENS[:8] and len(decode.streams) == 2  # nothing sent yet: tried again whole
