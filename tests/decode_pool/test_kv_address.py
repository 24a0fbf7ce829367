"""kv_host / kv_advertise_host "node": each decode replica's own Ray node address."""

from __future__ import annotations

import ray

from cluster.cluster_config import load_cluster_config
from decode_pool.kv_address import ray_node_address, resolve_node_address


def _decode_engine_config(**overrides) -> dict:
    return load_cluster_config(overrides={"mode": "disagg", **overrides}).engine_config("decode").to_dict()


def test_node_is_replaced_by_this_replica_s_node_address_and_nothing_else_changes():
    config = _decode_engine_config(kv_host="node")
    resolved = resolve_node_address(config, lambda: "10.0.0.7")
    assert resolved["kv_connector"]["options"]["host"] == "10.0.0.7"
    assert resolved["kv_connector"]["options"]["advertise_host"] is None  # tickets name kv_host, now resolved
    assert {**resolved, "kv_connector": None} == {**config, "kv_connector": None}
    assert config["kv_connector"]["options"]["host"] == "node"  # the caller's dict is untouched
    behind_nat = resolve_node_address(_decode_engine_config(kv_host="0.0.0.0", kv_advertise_host="node"), lambda: "h")
    options = behind_nat["kv_connector"]["options"]
    assert (options["host"], options["advertise_host"]) == ("0.0.0.0", "h")


def test_a_config_without_node_is_returned_as_it_is_and_never_asks_ray():
    def never() -> str:
        raise AssertionError("asked for the node address")

    for config in (_decode_engine_config(), _decode_engine_config(kv_host="10.0.0.1"), {"kv_connector": None}):
        assert resolve_node_address(config, never) is config


def test_ray_s_node_address_is_the_one_its_nodes_are_known_by():
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        assert ray_node_address() == ray.nodes()[0]["NodeManagerAddress"]
    finally:
        ray.shutdown()
