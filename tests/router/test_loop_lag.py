"""The router's event-loop lag probe: a loop held by blocking work is seen, in the probe and in the
router's /metrics and /pdserve/status."""

from __future__ import annotations

import asyncio
import time
import urllib.request

from router.loop_lag import LoopLagProbe
from tests.router.test_request_limits import serve  # noqa: F401  (fixture)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return response.read().decode()


def test_a_loop_held_by_blocking_work_is_seen_late_by_as_long_as_it_was_held():
    lags: list[float] = []
    probe = LoopLagProbe(lags.append, interval_s=0.02)

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(probe.run())
        await asyncio.sleep(0.1)
        time.sleep(0.4)  # work that holds the loop
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    assert probe.num_wakes == len(lags) >= 3
    assert max(lags) >= 0.35
    assert probe.worst_recent_s() == max(lags)


def test_the_worst_recent_lag_forgets_what_is_older_than_its_window():
    probe = LoopLagProbe(lambda _: None, window_s=60.0)
    probe.record(2.0)
    assert probe.worst_recent_s() == 2.0
    probe._recent[0] = (time.monotonic() - 61.0, 2.0)
    probe.record(0.0)
    assert probe.worst_recent_s() == 0.0 and not probe._recent


def test_the_router_exports_its_loop_lag(serve):  # noqa: F811
    async def scenario(server, request):
        await asyncio.sleep(0.2)
        time.sleep(0.3)  # the router's own loop, held
        await asyncio.sleep(0.1)
        status, _, body = await request("/pdserve/status")
        assert status == 200 and body["event_loop_lag_max_s"] >= 0.25
        metrics = await asyncio.to_thread(scrape, server.listener.port)
        over = [
            line
            for line in metrics.splitlines()
            if line.startswith("pdserve:router_event_loop_lag_seconds_bucket") and 'le="0.25"' in line
        ]
        assert over, metrics[:2000]
        count = next(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("pdserve:router_event_loop_lag_seconds_count")
        )
        assert float(over[0].rsplit(" ", 1)[1]) < count  # the held wake is above 0.25 s

    serve(scenario)
