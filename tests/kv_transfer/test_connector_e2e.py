"""The engine pushing KV layer by layer during its forward pass, through the connector, into a
decode engine on another TP degree: decoded tokens equal transformers' greedy output."""

from __future__ import annotations

import time

import pytest

from bench.cuda_check import expect_hand_off as _hand_out
from common.config import (
    CacheConfig,
    EngineConfig,
    EngineRole,
    KVConnectorConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from common.errors import InvalidRequestError
from engine import SamplingParams
from engine.async_engine import load_report
from engine.llm_engine import LLMEngine
from kv_transfer import TransferState, make_ticket
from tests.conftest import PROMPTS
from tests.kv_transfer.harness import engine_pair, reserve_with_ticket, wait_until

pytestmark = pytest.mark.slow

CONNECTOR = "kv_transfer.connector:TransferConnector"


def engine(
    model_dir,
    role,
    tp,
    backend,
    receive=False,
    shared_memory=False,
    every_chunk=True,
    kv_memory=32 * 2**20,
    async_scheduling=None,
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir)),
            cache=CacheConfig(kv_cache_memory=kv_memory, shared_memory=shared_memory),
            # several chunks per prompt
            scheduler=SchedulerConfig(role=role, max_prefill_chunk=24, async_scheduling=async_scheduling),
            parallel=ParallelConfig(tensor_parallel_size=tp),
            kv_connector=KVConnectorConfig(
                CONNECTOR, {"backend": backend, "receive": receive}, push_every_chunk=every_chunk
            ),
        )
    )


def run_pair(prefill: LLMEngine, decode: LLMEngine, backend: str, prompts: list[list[int]], lease_s=60.0):
    params = SamplingParams(temperature=0, max_tokens=8)
    for i, ids in enumerate(prompts):
        ticket = _hand_out(decode, f"req-{i}", ids, params, backend, lease_s)
        prefill.add_request(f"req-{i}", ids, params, kv_ticket=ticket)
    return drive(prefill, decode)


def windows_of(num_tokens: int, chunk: int, block_size: int) -> int:
    """The windows a prompt's push leaves in: one per chunk before the last that completes a
    block, and the last chunk's."""
    ends = range(chunk, num_tokens, chunk)  # where each chunk before the last one ends
    return len({end // block_size for end in ends if end >= block_size}) + 1


def drive(prefill: LLMEngine, decode: LLMEngine, max_steps: int = 2000) -> dict:
    """Step both engines until neither has work left; the decode side's finished outputs by id."""
    finished = {}
    for _ in range(max_steps):
        if not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
            break
        prefill.step()
        finished.update({o.request_id: o for o in decode.step() if o.finished})
    return finished


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "backend"),
    # "shm-pull": the prefill engine's cache lives in shared memory, and decode reads it in place.
    [(1, 1, "inproc"), (1, 1, "shm"), (3, 1, "shm-pull"), (1, 3, "shm-pull")],
)
def test_layerwise_push_from_engine_decodes_exactly(prefill_tp, decode_tp, backend, smol_dir, hf_smol, hf_reference):
    pull = backend.endswith("-pull")
    backend = backend.removesuffix("-pull")
    prefill = engine(smol_dir, EngineRole.PREFILL, prefill_tp, backend, shared_memory=pull)
    decode = engine(smol_dir, EngineRole.DECODE, decode_tp, backend, receive=True)
    try:
        prompts = [prefill.tokenizer.encode(p) for p in PROMPTS[:3]]
        prompts.append(prefill.tokenizer.encode(" ".join(PROMPTS) * 3))  # ~100 tokens: 5 chunks, 7 blocks
        finished = run_pair(prefill, decode, backend, prompts)
        for i, ids in enumerate(prompts):
            output = finished[f"req-{i}"]
            assert output.error is None, output.error
            assert output.outputs[0].token_ids == hf_reference(hf_smol, ids, 8)
        assert not prefill.transfer_failures
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        # The hand-off's figures the prefill replica reports to the router's metrics: every shard's
        # bytes together (K and V of every layer and head for the prompt's blocks), the slowest
        # shard's seconds.
        layout = prefill.layout
        for i, ids in enumerate(prompts):
            sent = prefill.transfers_sent[f"req-{i}"]
            num_blocks = -(-len(ids) // layout.block_size)
            per_block = layout.bytes_per_block_per_layer // layout.num_kv_heads * layout.total_kv_heads  # K and V
            assert sent.failure is None and sent.num_bytes == layout.num_layers * num_blocks * per_block
            assert sent.seconds is not None and sent.seconds > 0
        # Each of the long prompt's chunks pushed the blocks it completed, the last one the rest.
        assert [prefill.transfers_sent[f"req-{i}"].num_windows for i in range(4)] == [
            *[1, 1, 1],
            windows_of(len(prompts[3]), chunk=24, block_size=layout.block_size),
        ]
        assert windows_of(len(prompts[3]), 24, 16) >= 4
        assert prefill.num_kv_transfer_failures == decode.num_kv_transfer_failures == 0
        if backend == "shm" and prefill_tp == 1:  # the driver's own sender: which path did it take?
            channels = prefill.executor.driver.connector.sender._channels.values()
            assert channels and all((ch.staging_region is None) == pull for ch in channels)
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_decode_replica_scheduling_ahead_decodes_exactly_while_kv_lands(smol_dir, hf_smol, hf_reference):
    """Async scheduling on the decode side (as on CUDA): prompts are handed over a few steps apart,
    so KV lands and requests join while steps are queued ahead of their reads."""
    prefill = engine(smol_dir, EngineRole.PREFILL, 1, "inproc", async_scheduling=True)
    decode = engine(smol_dir, EngineRole.DECODE, 1, "inproc", receive=True, async_scheduling=True)
    try:
        assert decode.async_scheduling and not prefill.async_scheduling  # a prefill replica never runs ahead
        prompts = [prefill.tokenizer.encode(p) for p in PROMPTS[:4]]
        params = SamplingParams(temperature=0, max_tokens=12)
        waiting, finished = list(enumerate(prompts)), {}
        for step in range(2000):
            if waiting and step % 3 == 0:
                i, ids = waiting.pop(0)
                prefill.add_request(f"req-{i}", ids, params, kv_ticket=_hand_out(decode, f"req-{i}", ids, params))
            if not waiting and not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
                break
            prefill.step()
            finished.update({o.request_id: o for o in decode.step() if o.finished})
        for i, ids in enumerate(prompts):
            output = finished[f"req-{i}"]
            assert output.error is None, output.error
            assert output.outputs[0].token_ids == hf_reference(hf_smol, ids, 12)
        assert decode.num_steps_ahead > 10
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        decode.check_integrity()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_the_first_token_leaves_decode_when_the_kv_lands_before_any_decode_step(smol_dir, hf_smol, hf_reference):
    with engine_pair(engine, smol_dir, "inproc") as (prefill, decode):
        forward_passes: list[int] = []
        execute = decode.executor.execute
        decode.executor.execute = lambda *args, **kwargs: forward_passes.append(1) or execute(*args, **kwargs)
        ids = prefill.tokenizer.encode(PROMPTS[1])
        expected = hf_reference(hf_smol, ids, 4)
        params = SamplingParams(temperature=0, max_tokens=4)
        ticket = reserve_with_ticket(decode, "r", ids, params, lease_s=60)
        decode.expect_kv("r", ticket)
        prefill.add_request("r", ids, params, kv_ticket=ticket)
        first = []
        for _ in range(500):
            prefill.step()
            first = [o for o in decode.step() if o.request_id == "r"]
            if first:
                break
        # Emitted by the step that saw the KV land, with no decode forward pass of its own.
        assert [o.outputs[0].new_token_ids for o in first] == [expected[:1]]
        assert forward_passes == [] and not first[0].finished
        finished = drive(prefill, decode)
        assert finished["r"].outputs[0].token_ids == expected
        assert len(forward_passes) == 3  # tokens 2..4
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0


def test_expired_lease_fails_the_decode_request_and_frees_both_sides(smol_dir):
    with engine_pair(engine, smol_dir, "inproc") as (prefill, decode):
        ids = prefill.tokenizer.encode(PROMPTS[0])
        params = SamplingParams(temperature=0, max_tokens=4)
        ticket = reserve_with_ticket(decode, "late", ids, params, lease_s=0.0)  # already expired
        decode.expect_kv("late", ticket)
        # Prefill sees time left (a slow hop between the two: see the next test for a lease it sees
        # run out), so it computes the prompt and the receiver, whose lease it is, refuses the KV.
        prefill.add_request("late", ids, params, kv_ticket={**ticket, "lease_s": 60.0})
        finished = drive(prefill, decode, max_steps=500)
        assert finished["late"].outputs[0].finish_reason == "error" and "lease" in finished["late"].error
        assert "lease" in prefill.transfer_failures["late"]
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        # Counted where the lease is held (pdserve:kv_lease_expirations); a failure on both sides.
        assert (prefill.num_kv_lease_expirations, decode.num_kv_lease_expirations) == (0, 1)
        assert prefill.num_kv_transfer_failures == decode.num_kv_transfer_failures == 1
        assert prefill.transfers_sent["late"].failure is not None


def test_a_malformed_ticket_fails_its_request_only(smol_dir):
    from common.errors import InvalidRequestError

    with engine_pair(engine, smol_dir, "inproc") as (prefill, decode):
        ids = prefill.tokenizer.encode(PROMPTS[0])
        params = SamplingParams(temperature=0, max_tokens=4)
        good = reserve_with_ticket(decode, "r", ids, params, lease_s=30)
        with pytest.raises(InvalidRequestError, match="not a ticket for request 'other'"):
            prefill.add_request("other", ids, params, kv_ticket=good)
        broken = dict(good, receiver_endpoints=good["receiver_endpoints"] * 2)  # 2 endpoints for TP 1
        decode.expect_kv("r", broken)  # refused by the receiver: the decode request fails, blocks freed
        outputs = {o.request_id: o for o in decode.step()}
        assert outputs["r"].outputs[0].finish_reason == "error" and "bad ticket" in outputs["r"].error
        prefill.add_request("r", ids, params, kv_ticket=broken)
        while prefill.has_unfinished_requests():
            prefill.step()
        assert "bad ticket" in prefill.transfer_failures["r"]
        # Both engines keep serving.
        prefill.add_request("next", ids, SamplingParams(max_tokens=2))
        while prefill.has_unfinished_requests():
            prefill.step()
        prefill.release("next")  # no ticket: the caller hands its KV off and releases it itself
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0


def test_a_busy_prefill_replica_sees_a_hand_off_end_before_its_next_long_step(smol_dir):
    """The acknowledgement of a finished prompt's KV is taken right after its step, not after the
    next one's forward pass (on a loaded prefill replica, seconds the router would wait out)."""
    import asyncio
    import time

    from engine.async_engine import AsyncEngine

    prefill = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(smol_dir)),
            cache=CacheConfig(kv_cache_memory=32 * 2**20),
            scheduler=SchedulerConfig(role=EngineRole.PREFILL, max_num_seqs=1),  # one prompt a step
            kv_connector=KVConnectorConfig(CONNECTOR, {"backend": "inproc"}),
        )
    )
    decode = engine(smol_dir, EngineRole.DECODE, 1, "inproc", receive=True)
    steps: list[float] = []
    execute = prefill.executor.execute

    def slow_execute(*args, **kwargs):  # every forward pass takes long, as a loaded replica's does
        steps.append(time.monotonic())
        result = execute(*args, **kwargs)
        time.sleep(0.3 if len(steps) == 1 else 1.0)
        return result

    prefill.executor.execute = slow_execute
    params = SamplingParams(temperature=0, max_tokens=4)
    tickets = {}
    for request_id, text in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        ids = prefill.tokenizer.encode(text)
        block_ids = decode.reserve(request_id, ids, params)
        tickets[request_id] = (
            ids,
            make_ticket(
                request_id, "inproc", decode.kv_endpoints, decode.layout, decode.model_id, block_ids, len(ids), 60
            ).to_dict(),
        )
        decode.expect_kv(request_id, tickets[request_id][1])
    host = AsyncEngine(prefill)

    async def first_hand_off():
        loop = asyncio.get_running_loop()

        def add(e: LLMEngine):
            ended = {rid: host.watch_handoff(e, rid, loop) for rid in tickets}
            for rid, (ids, ticket) in tickets.items():
                e.add_request(rid, ids, params, kv_ticket=ticket)
            return ended

        ended = await host.call(add)
        return await asyncio.wait_for(ended["a"], 30), await asyncio.wait_for(ended["b"], 30)

    try:
        a, b = asyncio.run(first_hand_off())
        assert a.failure is None and b.failure is None and len(steps) >= 2
        # a's hand-off ended during b's step's second of compute at the latest without the wait;
        # with it, before that step began.
        assert a.ended_at < steps[1], (a.ended_at - steps[0], steps[1] - steps[0])
    finally:
        host.shutdown()
        decode.shutdown()


def test_a_prompt_whose_lease_ran_out_is_dropped_before_more_of_it_is_computed(smol_dir, hf_smol, hf_reference):
    with engine_pair(engine, smol_dir, "inproc") as (prefill, decode):
        params = SamplingParams(temperature=0, max_tokens=4)
        long_ids = prefill.tokenizer.encode(" ".join(PROMPTS) * 3)  # ~100 tokens: chunks of 24

        # "waiting": its lease ran out while it queued (as if the prefill queue took a minute).
        late = {**_hand_out(decode, "waiting", long_ids, params), "lease_s": 0.0}
        prefill.add_request("waiting", long_ids, params, kv_ticket=late)
        prefill.add_request("mid", long_ids[:90], params, kv_ticket=_hand_out(decode, "mid", long_ids[:90], params))
        prefill.add_request("ok", long_ids[:40], params, kv_ticket=_hand_out(decode, "ok", long_ids[:40], params))
        dropped = {o.request_id: o for o in prefill.step() if o.error}
        assert set(dropped) == {"waiting"} and "lease expired" in dropped["waiting"].error
        assert dropped["waiting"].metrics.prefill_chunks == []  # not one token of it computed
        # "mid": its lease runs out after its first chunk (whose block it pushed); the next step drops it.
        prefill.handoff.push_leases["mid"] = time.monotonic() - 1
        dropped = {o.request_id: o for o in prefill.step() if o.error}
        assert set(dropped) == {"mid"} and len(dropped["mid"].metrics.prefill_chunks) == 1
        assert prefill.num_prefills_expired == 2 and load_report(prefill)["num_prefills_expired"] == 2
        assert load_report(prefill)["num_kv_pushes_cancelled"] == 1  # "mid"'s
        for request_id in ("waiting", "mid"):  # the decode replica frees them when its own lease ends
            decode.abort_request(request_id, error="lease expired before the KV arrived")
        finished = drive(prefill, decode)
        assert finished["ok"].outputs[0].token_ids == hf_reference(hf_smol, long_ids[:40], 4)
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        prefill.check_integrity()


@pytest.mark.parametrize("every_chunk", [True, False])
def test_a_long_prompt_s_blocks_leave_while_its_later_chunks_compute(every_chunk, smol_dir, hf_smol, hf_reference):
    with engine_pair(engine, smol_dir, "tcp", every_chunk=every_chunk) as (prefill, decode):
        receiver = decode.executor.driver.connector.receiver
        ids = prefill.tokenizer.encode(" ".join(PROMPTS) * 3)  # ~100 tokens: chunks of 24, 7 blocks
        params = SamplingParams(temperature=0, max_tokens=4)
        prefill.add_request("r", ids, params, kv_ticket=_hand_out(decode, "r", ids, params, "tcp"))
        prefill.step()  # the first chunk: 24 tokens, one full block
        # Pushed by the chunk that computed it, or held back to the prompt's end.
        landed = wait_until(lambda: receiver.poll("r").layers_complete == decode.layout.num_layers, 5.0)
        assert landed is every_chunk, receiver.poll("r")
        assert receiver.poll("r").state is (TransferState.TRANSFERRING if every_chunk else TransferState.PENDING)
        finished = drive(prefill, decode)
        assert finished["r"].outputs[0].token_ids == hf_reference(hf_smol, ids, 4)
        windows = windows_of(len(ids), chunk=24, block_size=16)
        assert windows >= 4 and prefill.transfers_sent["r"].num_windows == (windows if every_chunk else 1)
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0


def test_a_request_aborted_mid_push_holds_its_blocks_until_the_push_is_cancelled(smol_dir, hf_smol, hf_reference):
    with engine_pair(engine, smol_dir, "inproc") as (prefill, decode):
        receiver = decode.executor.driver.connector.receiver
        ids = prefill.tokenizer.encode(" ".join(PROMPTS) * 3)
        params = SamplingParams(temperature=0, max_tokens=4)
        prefill.add_request("gone", ids, params, kv_ticket=_hand_out(decode, "gone", ids, params))
        prefill.step()
        prefill.step()  # two chunks in: three blocks pushed
        held = prefill.num_blocks_held()
        assert "gone" in prefill.handoff.pushing and held > 0
        sender = prefill.executor.driver.connector.sender
        prefill.abort_request("gone")
        assert prefill.num_kv_pushes_cancelled == 1
        # Held while the push may still read them; freed once every shard reports it ended.
        assert wait_until(lambda: sender.poll("gone").state is TransferState.FAILED)
        drive(prefill, decode, max_steps=50)
        assert prefill.num_blocks_held() == 0 and prefill.num_kv_transfer_failures == 0  # cancelled, not failed
        assert receiver.poll("gone").state is TransferState.TRANSFERRING  # never counted as done
        decode.abort_request("gone", error="prefill failed")
        # Both keep serving: the same prompt again, under a fresh ticket.
        prefill.add_request("again", ids, params, kv_ticket=_hand_out(decode, "again", ids, params))
        finished = drive(prefill, decode)
        assert finished["again"].outputs[0].token_ids == hf_reference(hf_smol, ids, 4)
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        prefill.check_integrity()
        decode.check_integrity()


def test_a_request_preempted_mid_push_ends_with_an_error_and_the_other_completes(smol_dir, hf_smol, hf_reference):
    # Eight blocks for two prompts of five each: the later one is preempted once both have grown.
    per_block = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2's layers, K and V, block of 16, 3 KV heads of 64, float32
    with engine_pair(engine, smol_dir, "inproc", kv_memory=8 * per_block) as (prefill, decode):
        assert prefill.layout.num_blocks == 8
        params = SamplingParams(temperature=0, max_tokens=4)
        first = prefill.tokenizer.encode(" ".join(PROMPTS) * 3)
        second = prefill.tokenizer.encode(" ".join(reversed(PROMPTS)) * 3)
        assert -(-len(first) // 16) == -(-len(second) // 16) == 5
        for request_id, ids in (("first", first), ("second", second)):
            prefill.add_request(request_id, ids, params, kv_ticket=_hand_out(decode, request_id, ids, params))
        errors = {}
        for _ in range(20):
            errors.update({o.request_id: o.error for o in prefill.step() if o.error})
            if errors:
                break
        assert set(errors) == {"second"} and "preempted" in errors["second"], errors
        assert prefill.num_preemptions >= 1 and prefill.num_kv_pushes_cancelled == 1
        decode.abort_request("second", error="prefill failed")
        finished = drive(prefill, decode)
        assert prefill.num_kv_transfer_failures == 0  # cancelled, not failed
        assert finished["first"].outputs[0].token_ids == hf_reference(hf_smol, first, 4)
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        prefill.check_integrity()
        decode.check_integrity()


def test_a_push_refused_mid_prompt_ends_its_request_and_frees_its_blocks(smol_dir, hf_smol, hf_reference):
    with engine_pair(engine, smol_dir, "inproc") as (prefill, decode):
        sender = prefill.executor.driver.connector.sender
        ids = prefill.tokenizer.encode(" ".join(PROMPTS) * 3)  # ~100 tokens: chunks of 24
        params = SamplingParams(temperature=0, max_tokens=4)
        prefill.add_request("r", ids, params, kv_ticket=_hand_out(decode, "r", ids, params))
        prefill.step()  # the first chunk's block is pushed
        decode.abort_request("r", error="the client went away")  # its ticket is released: later chunks are refused
        errors = {o.request_id: o.error for o in prefill.step() if o.error}  # the next chunk's push is refused
        assert wait_until(lambda: sender.poll("r").state is TransferState.FAILED)
        errors.update({o.request_id: o.error for o in prefill.step() if o.error})  # reported by now
        assert set(errors) == {"r"} and errors["r"].startswith("KV transfer failed") and "released" in errors["r"]
        assert prefill.num_kv_transfer_failures == 1 and prefill.num_kv_pushes_cancelled == 0
        assert "r" not in prefill.handoff.pushing
        # A push still ending after its request did (preempted mid-prompt) keeps the id taken.
        prefill.handoff.sending.add("ending")
        with pytest.raises(InvalidRequestError, match="already in use"):
            prefill.add_request("ending", ids, params)
        prefill.handoff.sending.discard("ending")
        drive(prefill, decode, max_steps=50)
        assert prefill.num_blocks_held() == 0 and prefill.num_kv_transfer_failures == 1  # counted once
        prefill.add_request("again", ids, params, kv_ticket=_hand_out(decode, "again", ids, params))
        finished = drive(prefill, decode)
        assert finished["again"].outputs[0].token_ids == hf_reference(hf_smol, ids, 4)
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        prefill.check_integrity()


def test_min_tokens_and_logit_bias_hold_across_the_hand_off(smol_dir, hf_smol):
    """The first token is prefill's and the rest decode's: both apply the request's adjustments."""
    from tests.engine.test_logit_adjustments import QUESTION, hf_generate

    with engine_pair(engine, smol_dir, "inproc") as (prefill, decode):
        chat = [{"role": "user", "content": QUESTION}]
        ids = list(
            prefill.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        banned = hf_generate(hf_smol, ids, 1)[0]  # the first token prefill would pick
        params = SamplingParams(temperature=0, max_tokens=16, min_tokens=14, logit_bias={banned: -100.0})
        prefill.add_request("r", ids, params, kv_ticket=_hand_out(decode, "r", ids, params))
        finished = drive(prefill, decode)
        expected = hf_generate(hf_smol, ids, 16, min_new_tokens=14, sequence_bias={(banned,): -100.0})
        assert finished["r"].outputs[0].token_ids == expected and len(expected) >= 14
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
