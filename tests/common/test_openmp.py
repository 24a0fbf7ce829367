"""A side thread that ran run_tensor_ops_serially never owns an OpenMP team (common.openmp)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from common.openmp import run_tensor_ops_serially


def _settled_thread_count() -> int:
    """Threads of this process once the last side thread's exit (and its team's) went through."""
    count = len(os.listdir("/proc/self/task"))
    for _ in range(50):
        time.sleep(0.02)
        now = len(os.listdir("/proc/self/task"))
        if now == count:
            return now
        count = now
    return count


def _threads_while_a_side_thread_lives(serial: bool) -> tuple[int, int, int]:
    """(threads before, threads while the side thread lives after a parallel add, its torch threads)."""
    before = _settled_thread_count()
    done, leave = threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def side() -> None:
        if serial:
            run_tensor_ops_serially()
        seen["threads"] = torch.get_num_threads()
        a = torch.ones(4_000_000)
        a.add_(a)  # large enough for torch to split it over its threads
        seen["during"] = len(os.listdir("/proc/self/task"))
        done.set()
        leave.wait(10)

    thread = threading.Thread(target=side, daemon=True)
    thread.start()
    assert done.wait(10)
    leave.set()
    thread.join(10)
    return before, seen["during"], seen["threads"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_serial_side_thread_spawns_no_openmp_team_and_the_caller_keeps_its_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before, during, threads = _threads_while_a_side_thread_lives(serial=True)
        assert threads == 1 and during == before + 1  # the side thread alone
        # The control: without the call, the side thread's parallel add brings a team of its own.
        before, during, threads = _threads_while_a_side_thread_lives(serial=False)
        assert threads == 2 and during >= before + 2
        assert torch.get_num_threads() == 2  # a per-thread setting: the caller's is untouched
    finally:
        torch.set_num_threads(old)
