"""End to end: a prefill-role engine's KV shipped over each backend into a decode-role engine
decodes to exactly transformers' greedy tokens (float32, SmolLM2)."""

from __future__ import annotations

import pytest

from common.config import CacheConfig, EngineConfig, EngineRole, ModelConfig, SchedulerConfig
from engine import SamplingParams
from engine.llm_engine import LLMEngine
from kv_transfer import KVReceiver, KVSender, TransferState, make_ticket
from kv_transfer.transport import available_backends, get_transport
from tests.conftest import PROMPTS
from tests.kv_transfer.harness import wait_terminal

pytestmark = pytest.mark.slow


def make_engine(model_dir, role):
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir)),
            cache=CacheConfig(kv_cache_memory=48 * 2**20),
            scheduler=SchedulerConfig(role=role),
        )
    )


@pytest.fixture(scope="module")
def engines(smol_dir):
    prefill, decode = make_engine(smol_dir, EngineRole.PREFILL), make_engine(smol_dir, EngineRole.DECODE)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


@pytest.mark.parametrize("backend", available_backends())
def test_prefill_to_decode_over_backend(backend, engines, hf_smol, hf_reference):
    prefill, decode = engines
    transport = get_transport(backend)
    receiver = KVReceiver(decode.kv_caches, decode.layout, backend)
    endpoint = transport.serve(receiver)
    sender = KVSender(prefill.layout, "smollm2", transport)
    params = SamplingParams(temperature=0, max_tokens=10)
    try:
        for i, text in enumerate(PROMPTS[:2]):
            request_id = f"{backend}-{i}"
            ids = prefill.tokenizer.encode(text)
            block_ids = decode.reserve(request_id, ids, params)
            ticket = make_ticket(request_id, backend, [endpoint], decode.layout, "smollm2", block_ids, len(ids), 30)
            receiver.expect(ticket)
            prefill.add_request(request_id, ids, params)
            (out,) = [o for o in prefill.step() if o.request_id == request_id]
            assert out.outputs[0].finish_reason == "prefilled"
            sender.start(ticket, out.kv_block_ids)
            for layer, kv in enumerate(prefill.kv_caches):
                sender.send_layer(request_id, layer, kv)
            sender.finish(request_id, out.outputs[0].token_ids[0])
            rx, tx = wait_terminal([lambda r=request_id: receiver.poll(r), lambda r=request_id: sender.poll(r)])
            assert rx.state is TransferState.DONE and tx.state is TransferState.DONE, (rx, tx)
            prefill.release(request_id)  # the sender's source blocks go back once the receiver acknowledged
            sender.release(request_id)
            receiver.release(request_id)
            decode.kv_ready(request_id, rx.first_token_id)
            finished = {}
            while decode.has_unfinished_requests():
                finished.update({o.request_id: o for o in decode.step() if o.finished})
            assert finished[request_id].outputs[0].token_ids == hf_reference(hf_smol, ids, 10)
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        sender.close()
        transport.shutdown()
