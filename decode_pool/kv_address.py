"""Where a decode replica's KV endpoints listen and what its tickets name, when the cluster config
says "node" (kv_host or kv_advertise_host): this replica's own Ray node address. A multi-node
cluster's decode replicas each sit on a node of their own, so one config cannot name one address
for all of them; each resolves "node" where it starts, before its engine opens its endpoints."""

from __future__ import annotations

from collections.abc import Callable

NODE_ADDRESS = "node"  # the value of kv_host / kv_advertise_host in the cluster config
_KEYS = ("host", "advertise_host")  # the KV connector options that name an address


def ray_node_address() -> str:
    """The address Ray knows this process's node by (``ray start --node-ip-address``, else the
    host's outward interface): the one the other nodes of the cluster reach it at."""
    import ray

    return ray.util.get_node_ip_address()


def resolve_node_address(engine_config: dict, node_address: Callable[[], str] = ray_node_address) -> dict:
    """``engine_config`` (EngineConfig.to_dict()) with "node" in its KV connector's address options
    replaced by ``node_address()``; unchanged when neither says "node"."""
    connector = engine_config.get("kv_connector") or {}
    options = connector.get("options") or {}
    if NODE_ADDRESS not in (options.get(key) for key in _KEYS):
        return engine_config
    address = node_address()
    resolved = {key: address if options.get(key) == NODE_ADDRESS else options.get(key) for key in _KEYS}
    return {**engine_config, "kv_connector": {**connector, "options": {**options, **resolved}}}
