"""router.health: /health from the reports the router has; where they are missing or old, one pool
call shared by every caller and kept a few seconds, so a flood of probes costs the pools nothing."""

from __future__ import annotations

import asyncio

from router.health import HealthCheck


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Pool:
    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail


async def ask(pool: Pool) -> None:
    pool.calls += 1
    await asyncio.sleep(0.05)
    if pool.fail:
        raise TimeoutError("the pool did not answer")


def make(reports: dict[str, bool | None], **pools: Pool) -> tuple[HealthCheck, Clock]:
    clock = Clock()
    return HealthCheck(pools, lambda role, max_age: reports.get(role), ask, probe_ttl_s=2.0, clock=clock), clock


def test_fresh_reports_answer_without_a_pool_call():
    reports = {"prefill": True, "decode": True}
    check, _ = make(reports, prefill=Pool(), decode=Pool())
    assert asyncio.run(check.verdict()) == (200, {"status": "ok"})
    reports["prefill"] = False
    assert asyncio.run(check.verdict()) == (
        200,
        {"status": "degraded", "pools_degraded": ["prefill: no working replica"]},
    )
    reports["decode"] = False
    code, body = asyncio.run(check.verdict())
    assert code == 503 and body["pools_down"] == ["decode: no working replica"]
    assert check.num_pool_calls == 0


def test_without_recent_reports_a_flood_of_probes_makes_one_call_per_pool_and_keeps_it():
    decode, prefill = Pool(), Pool(fail=True)
    check, clock = make({}, prefill=prefill, decode=decode)

    async def flood() -> list:
        return await asyncio.gather(*(check.verdict() for _ in range(200)))

    verdicts = asyncio.run(flood())
    assert all(v == (200, {"status": "degraded", "pools_degraded": ["prefill: TimeoutError"]}) for v in verdicts)
    assert (decode.calls, prefill.calls) == (1, 1)
    clock.now += 1.0
    asyncio.run(flood())
    assert (decode.calls, prefill.calls) == (1, 1)  # within the probe's 2 s
    clock.now += 1.5
    decode.fail = True
    code, body = asyncio.run(check.verdict())
    assert code == 503 and body["pools_down"] == ["decode: TimeoutError"]
    assert (decode.calls, prefill.calls) == (2, 2)


def test_a_colocated_pool_is_named_decode():
    check, _ = make({"colocated": False}, colocated=Pool())
    assert asyncio.run(check.verdict())[1]["pools_down"] == ["decode: no working replica"]
