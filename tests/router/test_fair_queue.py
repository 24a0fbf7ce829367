"""The router's tokenizer queue: tenants take turns on its one thread, cancelled jobs never run,
and the router queues each request under its tenant's name."""

from __future__ import annotations

import asyncio
import threading

import pytest

from router.fair_queue import FairQueue
from router.server import RouterServer
from tests.router.test_auth import call
from tests.router.test_request_limits import SmallPool, hold_tokenizer

KEYS = """
tenants:
  - name: bulk
    keys: [sk-bulk-00001]
  - name: other
    keys: [sk-other-0001]
"""


def test_a_tenant_with_many_jobs_queued_holds_another_back_by_one_job_not_all_of_them():
    queue = FairQueue("test-fair")
    ran: list[str] = []
    gate, running = threading.Event(), threading.Event()
    try:
        first = queue.submit("bulk", lambda: running.set() or (gate.wait(30) and ran.append("bulk-0")))
        assert running.wait(30)
        bulk = [queue.submit("bulk", ran.append, f"bulk-{i}") for i in range(1, 6)]
        other = [queue.submit("other", ran.append, f"other-{i}") for i in range(2)]
        third = queue.submit("third", ran.append, "third-0")
        assert queue.queued("bulk") == 5 and queue.queued("other") == 2
        gate.set()
        for future in [first, *bulk, *other, third]:
            future.result(30)
        # First come, first served would run other-0 seventh; in turns it runs third.
        assert ran == ["bulk-0", "bulk-1", "other-0", "third-0", "bulk-2", "other-1", "bulk-3", "bulk-4", "bulk-5"]
    finally:
        queue.shutdown()


def test_a_cancelled_job_never_runs_and_errors_reach_the_caller():
    queue = FairQueue("test-fair")
    gate = threading.Event()
    ran: list[int] = []
    try:
        queue.submit("a", gate.wait, 30)
        cancelled = queue.submit("a", ran.append, 1)
        assert cancelled.cancel()
        failing = queue.submit("b", lambda: 1 / 0)
        kept = queue.submit("a", ran.append, 2)
        gate.set()
        with pytest.raises(ZeroDivisionError):
            failing.result(30)
        kept.result(30)
        assert ran == [2] and queue.num_run == 3
        second_gate, running = threading.Event(), threading.Event()
        blocker = queue.submit("a", lambda: running.set() or second_gate.wait(30))
        waiting = queue.submit("b", ran.append, 3)
        assert running.wait(30)
    finally:
        queue.shutdown()  # cancels what waits; the running job ends on its own
    second_gate.set()
    assert blocker.result(30) is True and waiting.cancelled() and ran == [2]
    with pytest.raises(RuntimeError, match="shut down"):
        queue.submit("a", ran.append, 3)


def test_the_router_queues_each_request_for_the_tokenizer_under_its_tenant(smol_dir, tmp_path):
    from router.auth import KeyRing

    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)

    async def scenario() -> None:
        ring = KeyRing.load(str(keys), {})
        server = RouterServer(SmallPool(), None, "smol", str(smol_dir), mode="colocated", port=0, keyring=ring)
        port = server.listener.port
        entered, release = hold_tokenizer(server)
        body = {"model": "smol", "prompt": "one two three", "max_tokens": 2}  # 3 tokens: the fake pool's length
        try:
            calls = [asyncio.create_task(asyncio.to_thread(call, port, "/v1/completions", "sk-bulk-00001", body))]
            assert await asyncio.to_thread(entered.wait, 30)
            calls += [
                asyncio.create_task(asyncio.to_thread(call, port, "/v1/completions", key, body))
                for key in ["sk-bulk-00001"] * 3 + ["sk-other-0001"]
            ]
            for _ in range(300):
                if (
                    server.intake.tokenizer_queue.queued("bulk") == 3
                    and server.intake.tokenizer_queue.queued("other") == 1
                ):
                    break
                await asyncio.sleep(0.02)
            assert (
                server.intake.tokenizer_queue.queued("bulk") == 3 and server.intake.tokenizer_queue.queued("other") == 1
            )
            release.set()
            assert [status for status, _, _ in await asyncio.gather(*calls)] == [200] * 5
        finally:
            release.set()
            await server.__del__()

    asyncio.run(scenario())
