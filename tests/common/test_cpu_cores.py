"""Cores as the unit a replica owns: file locks per core, process-wide affinity, the default split."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from common.cpu_cores import claim_cores, format_core_list, host_cores, pin_process, split_cores


def _claim_in_child(lock_dir, count, candidates, conn) -> None:
    claim = claim_cores(count, lock_dir, candidates)
    conn.send((claim.cores, claim.borrowed))
    conn.recv()  # hold the claim until the parent is done looking


def test_two_processes_get_disjoint_cores_and_a_dead_owner_frees_them(tmp_path):
    candidates = [0, 1, 2, 3]  # lock files only: no core has to exist to be claimed
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_claim_in_child, args=(tmp_path, 2, candidates, child))
    process.start()
    try:
        theirs, borrowed = parent.recv()
        assert theirs == [0, 1] and borrowed == []
        mine = claim_cores(2, tmp_path, candidates)
        assert mine.cores == [2, 3] and mine.borrowed == []
        mine.release()
    finally:
        process.kill()  # dies holding its locks: the kernel drops them
        process.join()
    again = claim_cores(4, tmp_path, candidates)
    assert again.cores == [0, 1, 2, 3] and again.borrowed == []
    again.release()


def test_more_cores_than_free_are_borrowed_and_marked_shared(tmp_path):
    first = claim_cores(2, tmp_path, [0, 1])
    second = claim_cores(1, tmp_path, [0, 1])  # the same process may not lock twice either
    try:
        assert first.cores == [0, 1] and second.borrowed == second.cores and len(second.cores) == 1
        assert second.owned == []
    finally:
        first.release()
        second.release()
    alone = claim_cores(4, tmp_path / "other", [0, 1])  # a host smaller than asked: nothing to share
    assert alone.cores == [0, 1] and alone.borrowed == []
    alone.release()
    with pytest.raises(ValueError):
        claim_cores(0, tmp_path, [0])


def test_pinning_moves_every_thread_of_the_process():
    core = host_cores()[-1]
    started = threading.Event()
    stop = threading.Event()

    def idle() -> None:
        started.set()
        stop.wait(10)

    thread = threading.Thread(target=idle, daemon=True)
    thread.start()
    started.wait()
    before = host_cores()
    try:
        pin_process([core])
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        assert all(os.sched_getaffinity(tid) == {core} for tid in tids)
    finally:
        pin_process(before)
        stop.set()


def test_split_and_format():
    assert [split_cores(r, 2, [4, 5, 6, 7]) for r in range(2)] == [[4, 5], [6, 7]]
    assert [split_cores(r, 3, [0, 1]) for r in range(3)] == [[0], [1], [0]]  # fewer cores than shards
    assert format_core_list([0, 1, 2, 3, 8]) == "0-3,8" and format_core_list([5]) == "5"


def test_a_link_planted_in_a_lock_s_place_is_not_followed_and_its_target_is_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("do not truncate me\n")
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "core-0.lock").symlink_to(target)
    claim = claim_cores(1, locks, candidates=[0, 1])
    try:
        assert claim.cores == [1] and claim.borrowed == []  # core 0's lock is a link: passed over
        assert target.read_text() == "do not truncate me\n"
    finally:
        claim.release()


def test_the_lock_directory_is_made_for_every_user_of_the_host(tmp_path):
    locks = tmp_path / "shared" / "locks"
    claim_cores(1, locks, candidates=[0]).release()
    assert locks.stat().st_mode & 0o7777 == 0o1777  # world-writable and sticky, as /tmp
