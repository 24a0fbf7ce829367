"""router.report_ages: a replica whose report count stops moving is marked failed after the bound,
on the router's clock; one that answers again is back; a busy replica that answers is never marked."""

from __future__ import annotations

from common.serving import ReplicaReport
from router.placement import NoReplicaAvailable
from router.pool_placement import PoolPlacement
from router.report_ages import ReportAges


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(replica_id: str, seq: int, **fields) -> ReplicaReport:
    return ReplicaReport(replica_id=replica_id, role="decode", report_seq=seq, num_kv_blocks_free=10, **fields)


def test_a_replica_silent_past_the_bound_is_marked_and_comes_back_when_it_answers():
    clock = Clock()
    ages = ReportAges(stale_after_s=10.0, clock=clock)
    assert [r.engine_error for r in ages.mark_silent([report("a", 1), report("b", 1)], True)] == ["", ""]
    for second in range(1, 12):
        clock.now = 100.0 + second
        marked = ages.mark_silent([report("a", 1 + second), report("b", 1)], True)  # b hangs at its first
    busy, hung = marked
    assert busy.engine_error == "" and "no report for 11 s" in hung.engine_error
    clock.now += 1
    assert ages.mark_silent([report("a", 20), report("b", 2)])[1].engine_error == ""  # b answered again
    # The report's own errors are kept as they are.
    stopped = report("c", 1, engine_error="the engine thread stopped")
    assert ages.mark_silent([stopped])[0].engine_error == "the engine thread stopped"


def test_a_replica_not_among_the_candidates_keeps_its_age_and_one_gone_from_the_pool_is_forgotten():
    clock = Clock()
    ages = ReportAges(stale_after_s=10.0, clock=clock)
    ages.mark_silent([report("a", 1), report("b", 1)], every_replica=True)
    clock.now += 5
    ages.mark_silent([report("a", 2)])  # b was not a candidate (its queue full): its age goes on
    clock.now += 6
    assert ages.mark_silent([report("b", 1)])[0].engine_error
    ages.mark_silent([report("a", 3)], every_replica=True)  # b left the pool
    clock.now += 30
    assert ages.mark_silent([report("b", 1)])[0].engine_error == ""  # a new replica under that id


def test_placement_sends_nothing_to_a_silent_replica():
    clock = Clock()
    ages = ReportAges(stale_after_s=10.0, clock=clock)
    placement = PoolPlacement("least_loaded", "decode", 16)
    ages.mark_silent([report("a", 1), report("b", 1)], True)
    clock.now += 11
    reports = ages.mark_silent([report("a", 2), report("b", 1)], True)
    placement.observe(reports, True)
    assert placement.place(None, reports, {"a": 50, "b": 0}).ranking[0] == "a"  # b idle, but silent
    clock.now += 11
    reports = ages.mark_silent([report("a", 2), report("b", 1)], True)
    placement.observe(reports, True)
    try:
        placement.place(None, reports, {"a": 0, "b": 0})
    except NoReplicaAvailable:
        pass  # both silent: Serve queues the request (serve_routing's fallback)
    else:
        raise AssertionError("a pool whose replicas are all silent still placed a request")
