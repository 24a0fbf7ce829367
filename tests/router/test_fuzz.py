"""Fuzzing the router's HTTP API (hypothesis; tests/fuzz_requests.py): /v1/completions,
/v1/chat/completions and /v1/models answer every body with no 5xx and no hang, in OpenAI's format,
and leave nothing in flight. The real RouterServer and tokenizer, on its own event loop in a thread;
the pool is scripted (no Ray), so thousands of cases take seconds. The same bodies run against a
real cluster in tests/cluster/test_serving.py, which also counts the KV blocks left."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings

from common.outputs import TokenLogprob
from common.serving import ServeRequest, StreamDelta
from router.server import RouterServer
from tests.fuzz_requests import models_requests, post_and_check, request_and_check, requests
from tests.router.test_orchestrator import FakeResponse, FakeStream

MODEL = "smol"
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "400"))


class EchoStream(FakeStream):
    """A colocated decode stream for any prompt: ``max_tokens`` tokens, then the end."""

    def __init__(self, request: ServeRequest) -> None:
        self.ended = False
        super().__init__(request, colocated=True, die_after=None, error=None)

    async def _generate(self):
        max_tokens = self.request.sampling["max_tokens"]
        # As an engine does: the prompt's scores, when asked for, with the first token.
        num_top = self.request.sampling.get("prompt_logprobs")
        prompt = self.request.prompt_token_ids
        scores = None if num_top is None else [TokenLogprob(t, -1.0, ((t, -1.0),) * num_top, 1) for t in prompt[1:]]
        for i in range(max_tokens):
            last = i == max_tokens - 1
            self.ended = last  # the reader stops at the finished delta
            yield StreamDelta(
                self.request.request_id,
                [100 + i],
                f" w{i}",
                finish_reason="length" if last else None,
                prompt_logprobs=scores if i == 0 else None,
            )
            await asyncio.sleep(0)


class EchoPool:
    def __init__(self) -> None:
        self.streams: list[EchoStream] = []
        self.generate = self.report = self

    def options(self, stream: bool = False, **_):
        return self

    def remote(self, request: ServeRequest | None = None):
        if request is None:  # report.remote()
            return FakeResponse({"max_model_len": 64})
        self.streams.append(EchoStream(request))
        return self.streams[-1]


@pytest.fixture(scope="module")
def server(smol_dir):
    pool = EchoPool()
    loop = asyncio.new_event_loop()
    started: concurrent.futures.Future = concurrent.futures.Future()

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def build() -> RouterServer:
            return RouterServer(pool, None, MODEL, str(smol_dir), mode="colocated", port=0)

        try:
            started.set_result(loop.run_until_complete(build()))
        except BaseException as exc:
            started.set_exception(exc)
            return
        loop.run_forever()

    thread = threading.Thread(target=serve, name="fuzzed-router", daemon=True)
    thread.start()
    router = started.result(timeout=120)
    yield router, pool
    asyncio.run_coroutine_threadsafe(router.__del__(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases in every CI run; PDSERVE_FUZZ_EXAMPLES=20000 to search further
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests(MODEL))
def test_no_body_gets_a_5xx_or_hangs(server, request: tuple[str, bytes]):
    router, _ = server
    path, body = request
    post_and_check(f"http://127.0.0.1:{router.listener.port}{path}", body, timeout_s=30)


@settings(
    max_examples=EXAMPLES // 4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=models_requests())
def test_no_method_query_or_header_on_the_models_list_gets_a_5xx(server, request):
    router, _ = server
    method, path, body, headers = request
    request_and_check(f"http://127.0.0.1:{router.listener.port}{path}", method, body, headers)


def test_after_the_fuzzing_nothing_is_left_in_flight_and_the_server_still_answers(server):
    router, pool = server
    # Runs after the fuzz test in file order; alone it still checks the endpoints below.
    url = f"http://127.0.0.1:{router.listener.port}"
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        assert response.status == 200
    valid = b'{"model": "smol", "prompt": "one two", "max_tokens": 3}'
    assert post_and_check(url + "/v1/completions", valid) == 200
    assert router.num_in_flight == 0 and router.num_admitting == 0
    assert all(stream.ended or stream.cancelled for stream in pool.streams)
