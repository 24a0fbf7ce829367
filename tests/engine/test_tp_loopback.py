"""A replica's tensor-parallel shards talk over loopback only: gloo binds the address the host name
resolves to unless told otherwise, which put a listener of every TP group on the network. (On the
development machines the host name resolves to 127.0.0.1, so what is tested is the setting gloo
reads as each group is made.)"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from engine.distributed import parallel
from engine.distributed.parallel import gloo_on_loopback


def test_gloo_groups_are_made_on_the_loopback_interface_and_an_operators_choice_is_kept(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with gloo_on_loopback():
        assert os.environ["GLOO_SOCKET_IFNAME"].startswith("lo")
        store = dist.HashStore()
        group = dist.ProcessGroupGloo(store, 0, 1)  # a gloo group made here binds that interface
        assert group.size() == 1
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    with gloo_on_loopback():
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_the_tp_group_is_made_inside_it(monkeypatch):
    """TensorParallel.init makes its gloo group with the setting in place (a CPU replica's group)."""
    seen: list[str | None] = []

    def init_process_group(**kwargs) -> None:
        seen.append(os.environ.get("GLOO_SOCKET_IFNAME"))

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(parallel.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(parallel.dist, "group", SimpleNamespace(WORLD=object()))
    parallel.TensorParallel.init(0, 2, dist.HashStore(), torch.device("cpu"), 5.0)
    assert len(seen) == 1 and seen[0] is not None and seen[0].startswith("lo"), seen
