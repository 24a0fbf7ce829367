"""NCCL groups read their error handling from the environment as they are made: the KV transport's
pair groups turn it off while the engine's TP group keeps torch's default, and neither may be made
while the other's value is set."""

from __future__ import annotations

import os
import threading

from common.nccl_env import ASYNC_ERROR_HANDLING, group_construction


def test_an_override_holds_inside_only_and_the_old_value_comes_back(monkeypatch):
    monkeypatch.delenv(ASYNC_ERROR_HANDLING, raising=False)
    with group_construction(**{ASYNC_ERROR_HANDLING: "0"}):
        assert os.environ[ASYNC_ERROR_HANDLING] == "0"
    assert ASYNC_ERROR_HANDLING not in os.environ
    monkeypatch.setenv(ASYNC_ERROR_HANDLING, "3")
    with group_construction(**{ASYNC_ERROR_HANDLING: "0"}):
        assert os.environ[ASYNC_ERROR_HANDLING] == "0"
    assert os.environ[ASYNC_ERROR_HANDLING] == "3"


def test_a_group_made_meanwhile_waits_and_never_sees_anothers_value(monkeypatch):
    monkeypatch.delenv(ASYNC_ERROR_HANDLING, raising=False)
    inside, release, seen = threading.Event(), threading.Event(), []

    def kv_pair_group() -> None:
        with group_construction(**{ASYNC_ERROR_HANDLING: "0"}):
            inside.set()
            release.wait(5)

    def tp_group() -> None:
        with group_construction():
            seen.append(os.environ.get(ASYNC_ERROR_HANDLING))

    first = threading.Thread(target=kv_pair_group)
    first.start()
    assert inside.wait(5)
    second = threading.Thread(target=tp_group)
    second.start()
    second.join(0.2)
    assert second.is_alive() and seen == []  # waits for the KV group's construction to end
    release.set()
    first.join(5)
    second.join(5)
    assert seen == [None]  # torch's default, not the KV group's "0"
