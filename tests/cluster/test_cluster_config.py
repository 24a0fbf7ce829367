from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.cluster_config import (
    KV_INTEGRITY,
    ClusterConfig,
    PoolConfig,
    RouterConfig,
    load_cluster_config,
    parse_override,
)
from common.config import EngineRole
from common.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "cluster.example.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_defaults():
    config = load_cluster_config()
    assert config == ClusterConfig()
    assert config.mode == "auto"  # decided at deploy (cluster.app.with_resolved_mode); disaggregated till then
    assert config.disaggregated and config.pools() == ["prefill", "decode"]
    assert config.transport == "auto"  # shm on one host, tcp across hosts, per hand-off
    assert config.port == 8000
    assert config.kv_cache_memory is None  # resolved from the host's free memory at deploy (cluster.app)
    assert config.prefill == PoolConfig(replicas=1, tensor_parallel_size=1, max_num_waiting=256)
    assert config.router == RouterConfig(placement_policy="cache_aware", kv_lease_s=30.0, max_retries=1)
    assert config.served_name == "SmolLM2-135M-Instruct"


def test_example_file_loads_and_names_every_key():
    config = load_cluster_config(EXAMPLE)
    assert config == ClusterConfig()
    text = EXAMPLE.read_text()
    for key in config.to_dict():
        assert f"\n{key}:" in text, key
    for key in PoolConfig.__dataclass_fields__:
        # Once per pool (router.ray_resources shares its name with the pools' key).
        assert text.count(f"  {key}:") == 3 + (key in RouterConfig.__dataclass_fields__), key
    for key in RouterConfig.__dataclass_fields__:
        assert f"  {key}:" in text, key


def test_file_and_overrides(tmp_path):
    path = write(tmp_path, "mode: disagg\nport: 9000\nprefill:\n  replicas: 3\n  cpus_per_shard: 2\n")
    config = load_cluster_config(path, {"prefill.tensor_parallel_size": 2, "router.max_retries": 0, "port": 0})
    assert config.port == 0
    assert config.prefill.replicas == 3
    assert config.prefill.tensor_parallel_size == 2
    assert config.prefill.cpus_per_shard == 2.0 and isinstance(config.prefill.cpus_per_shard, float)
    assert config.decode == PoolConfig()
    assert config.router.max_retries == 0


def test_mapping_override_merges_into_section(tmp_path):
    path = write(tmp_path, "decode:\n  replicas: 2\n")
    config = load_cluster_config(path, {"decode": {"max_num_seqs": 8}, "mode": "colocated"})
    assert (config.decode.replicas, config.decode.max_num_seqs) == (2, 8)
    assert config.mode == "colocated"
    assert config.pools() == ["colocated"]


def test_empty_file_and_empty_section(tmp_path):
    assert load_cluster_config(write(tmp_path, "")) == ClusterConfig()
    assert load_cluster_config(write(tmp_path, "router:\n")) == ClusterConfig()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prefill.replicas=2", ("prefill.replicas", 2)),
        ("kv_integrity=mac", ("kv_integrity", "mac")),
        ("model=/models/Qwen3-0.6B-Q8_0.gguf", ("model", "/models/Qwen3-0.6B-Q8_0.gguf")),
        ("max_model_len=null", ("max_model_len", None)),
        ("router.kv_lease_s=2.5", ("router.kv_lease_s", 2.5)),
        ("host=a=b", ("host", "a=b")),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["replicas", "=2", ""])
def test_parse_override_refuses_no_key(text):
    with pytest.raises(ConfigError, match="key=value"):
        parse_override(text)


def test_typo_suggests_closest_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'prefil' in .*cluster\.yaml; did you mean 'prefill'\?"):
        load_cluster_config(write(tmp_path, "prefil:\n  replicas: 2\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'router\.kv_lease' .*did you mean 'router\.kv_lease_s'\?"):
        load_cluster_config(write(tmp_path, "router:\n  kv_lease: 3\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'trasnport' in override 'trasnport'; did you mean 'transport'"):
        load_cluster_config(overrides={"trasnport": "grpc"})


def test_a_renamed_key_names_its_new_name(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'kv_checksums' in .*: it is now kv_integrity \(none \| crc32"):
        load_cluster_config(write(tmp_path, "kv_checksums: true\n"))


def test_nested_unknown_key_lists_allowed_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'prefill\.tp' .*allowed keys under 'prefill': replicas, "):
        load_cluster_config(write(tmp_path, "prefill:\n  tp: 2\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'decode\.tp' in override 'decode\.tp'"):
        load_cluster_config(overrides={"decode.tp": 2})
    with pytest.raises(ConfigError, match=r"'mode' is a value, not a section"):
        load_cluster_config(overrides={"mode.name": "x"})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("prefill:\n  replicas: two\n", r"prefill\.replicas: expected int, got 'two' \(str\)"),
        ("prefill:\n  replicas: true\n", r"prefill\.replicas: expected int, got True \(bool\)"),
        ("prefill: [1, 2]\n", r"'prefill' of .* must be a mapping of keys, got \[1, 2\] \(list\)"),
        ("port: '8000'\n", r"port: expected int, got '8000' \(str\)"),
        ("model: 7\n", r"model: expected str or null, got 7 \(int\)"),
        ("kv_integrity: 1\n", r"kv_integrity: expected str, got 1 \(int\)"),
        ("router:\n  kv_lease_s: soon\n", r"router\.kv_lease_s: expected float, got 'soon'"),
        ("- mode\n", r"must hold a mapping of keys at the top level, got list"),
    ],
)
def test_wrong_types_name_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_cluster_config(write(tmp_path, text))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"mode": "split"}, r"mode='split' is not supported; use one of auto, disagg, colocated"),
        ({"transport": "inproc"}, r"transport='inproc' cannot cross processes"),
        ({"transport": "rdma"}, r"transport='rdma' is not supported; use one of auto, shm, grpc, torch, tcp"),
        ({"kv_integrity": "sha1"}, r"kv_integrity='sha1' is not supported; use one of none, crc32, mac"),
        ({"dtype": "float64"}, r"dtype='float64' is not supported"),
        ({"device": "tpu"}, r"device='tpu' is not supported"),
        ({"block_size": 12}, r"block_size=12 must be a power of two"),
        ({"kv_cache_memory": 1.5}, r"kv_cache_memory=1.5"),
        ({"port": 70000}, r"port=70000 must be in 0\.\.65535"),
        ({"stream_interval": 0}, r"stream_interval=0 must be an integer >= 1"),
        ({"health_check_period_s": 0}, r"health_check_period_s=0\.0 must be > 0 seconds"),
        ({"tracing": "jaeger"}, r"tracing='jaeger' is not supported; use none, console, file:PATH or otlp"),
        ({"prefill.tensor_parallel_size": 0}, r"^prefill\.tensor_parallel_size=0 must be >= 1"),
        ({"decode.replicas": 0}, r"^decode\.replicas=0 must be >= 1"),
        ({"colocated.max_num_seqs": 0}, r"^colocated\.max_num_seqs=0 must be >= 1"),
        ({"decode.cpus_per_shard": 0}, r"^decode\.cpus_per_shard=0\.0 must be > 0"),
        ({"router.kv_lease_s": 0}, r"^router\.kv_lease_s=0\.0 must be > 0"),
        ({"router.max_retries": -1}, r"^router\.max_retries=-1 must be >= 0"),
        ({"router.max_body_bytes": 100}, r"^router\.max_body_bytes=100 must be an integer of at least 1024 bytes"),
        ({"router.conditional_disaggregation": "yes"}, r"conditional_disaggregation"),
        ({"router.local_prefill_max_stall_s": -0.1}, r"local_prefill_max_stall_s=-0\.1 must be >= 0"),
    ],
)
def test_bad_values_name_the_key_path(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_cluster_config(overrides=overrides)


def test_missing_file_and_bad_yaml(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"{re.escape(str(missing))} does not exist"):
        load_cluster_config(missing)
    with pytest.raises(ConfigError, match=r"is not valid YAML at line 3, column 8: mapping values are not allowed"):
        load_cluster_config(write(tmp_path, "mode: disagg\nport: 8000\nhost: a: b\n"))


def test_engine_config_disagg():
    config = load_cluster_config(
        overrides={
            "mode": "disagg",
            "model": "/models/tiny",
            "dtype": "float32",
            "device": "cpu",
            "max_model_len": 512,
            "block_size": 32,
            "kv_cache_memory": 0.5,
            "enable_prefix_caching": False,
            "transport": "grpc",
            "kv_integrity": "crc32",
            "prefill.tensor_parallel_size": 2,
            "prefill.max_prefill_chunk": 128,
            "decode.max_num_seqs": 16,
        }
    )
    prefill = config.engine_config("prefill")
    assert prefill.scheduler.role is EngineRole.PREFILL
    assert prefill.parallel.tensor_parallel_size == 2
    assert prefill.scheduler.max_prefill_chunk == 128
    assert prefill.scheduler.max_num_waiting == 256
    assert (prefill.model.model, prefill.model.dtype, prefill.model.device) == ("/models/tiny", "float32", "cpu")
    assert prefill.model.max_model_len == 512
    assert (prefill.cache.block_size, prefill.cache.kv_cache_memory) == (32, 0.5)
    assert prefill.cache.enable_prefix_caching is False
    assert prefill.kv_connector.factory == "kv_transfer.connector:TransferConnector"
    hosts = {"host": "127.0.0.1", "advertise_host": None}
    assert prefill.kv_connector.options == {"backend": "grpc", "receive": False, "integrity": "crc32", **hosts}
    assert prefill.kv_connector.push_every_chunk is None  # auto: the engine decides by its device
    assert (
        load_cluster_config(overrides={"mode": "disagg", "kv_push_every_chunk": False})
        .engine_config("prefill")
        .kv_connector.push_every_chunk
        is False
    )

    decode = config.engine_config("decode")
    assert decode.scheduler.role is EngineRole.DECODE
    assert decode.parallel.tensor_parallel_size == 1
    assert decode.scheduler.max_num_seqs == 16
    assert decode.kv_connector.options == {"backend": "grpc", "receive": True, "integrity": "crc32", **hosts}
    # Conditional disaggregation (on by default) chunks the prompts decode computes itself.
    assert decode.scheduler.max_decode_stall_s == config.router.local_prefill_max_stall_s == 0.05
    assert prefill.scheduler.max_decode_stall_s is None

    with pytest.raises(ConfigError, match=r"pool 'colocated' is not part of mode='disagg'"):
        config.engine_config("colocated")


@pytest.mark.parametrize(
    ("mode", "transport", "shared_pools"),
    [
        ("disagg", "shm", {"prefill"}),
        ("disagg", "auto", {"prefill"}),
        ("disagg", "grpc", set()),
        ("colocated", "shm", set()),
    ],
)
def test_only_a_prefill_pool_sending_over_shm_shares_its_cache(mode, transport, shared_pools):
    # Decode replicas read such a cache in place; nothing else needs its cache in shared memory.
    config = load_cluster_config(overrides={"mode": mode, "transport": transport})
    shared = {pool for pool in config.pools() if config.engine_config(pool).cache.shared_memory}
    assert shared == shared_pools


def test_engine_config_colocated():
    config = load_cluster_config(overrides={"mode": "colocated", "colocated.tensor_parallel_size": 4})
    engine = config.engine_config("colocated")
    assert engine.scheduler.role is EngineRole.COLOCATED
    assert engine.parallel.tensor_parallel_size == 4
    assert engine.kv_connector.factory is None
    assert engine.kv_connector.options == {}
    with pytest.raises(ConfigError, match=r"pool 'prefill' is not part of mode='colocated'"):
        config.engine_config("prefill")


def test_connector_options_match_transfer_connector():
    import inspect

    from kv_transfer.connector import TransferConnector

    accepted = inspect.signature(TransferConnector.__init__).parameters
    options = ClusterConfig().engine_config("decode").kv_connector.options
    assert set(options) <= set(accepted)


@pytest.mark.parametrize(
    ("model", "served_model_name", "expected"),
    [
        (None, None, "SmolLM2-135M-Instruct"),
        ("/models/Qwen3-0.6B/", None, "Qwen3-0.6B"),
        ("/models/qwen3-0.6b-q8_0.gguf", None, "qwen3-0.6b-q8_0"),
        ("/models/Qwen3-0.6B", "qwen", "qwen"),
    ],
)
def test_served_name(model, served_model_name, expected):
    assert ClusterConfig(model=model, served_model_name=served_model_name).served_name == expected


def test_round_trip_through_plain_dict():
    config = load_cluster_config(
        overrides={
            "mode": "colocated",
            "model": "/m.gguf",
            "kv_cache_memory": 0.25,
            "colocated.replicas": 3,
            "colocated.max_prefill_chunk": 64,
            "router.placement_policy": "round_robin",
        }
    )
    data = config.to_dict()
    assert data["colocated"]["replicas"] == 3
    assert data["router"]["placement_policy"] == "round_robin"
    assert type(data["prefill"]) is dict
    assert ClusterConfig.from_dict(data) == config
    assert ClusterConfig.from_dict(ClusterConfig().to_dict()) == ClusterConfig()
    with pytest.raises(ConfigError, match=r"unknown key 'router\.policy'"):
        ClusterConfig.from_dict({"router": {"policy": "x"}})


@pytest.mark.parametrize(
    ("overrides", "host", "expected"),
    [
        ({}, 2, {"prefill": 1, "decode": 1}),
        ({}, 16, {"prefill": 8, "decode": 8}),
        ({}, 7, {"prefill": 3, "decode": 4}),  # decode gets the odd core
        ({"decode.replicas": 2}, 8, {"prefill": 4, "decode": 2}),
        ({"prefill.cores": 2}, 8, {"prefill": 2, "decode": 6}),  # decode takes what prefill leaves
        ({"decode.tensor_parallel_size": 2}, 2, {"prefill": 1, "decode": 2}),  # a shard needs a core
        ({"mode": "colocated"}, 2, {"colocated": 2}),
        ({"mode": "colocated", "colocated.replicas": 2}, 6, {"colocated": 3}),
    ],
)
def test_a_local_cpu_cluster_splits_the_hosts_cores_between_pools(overrides, host, expected):
    from cluster.app import with_resolved_cores

    config = with_resolved_cores(load_cluster_config(overrides={"device": "cpu", **overrides}), host)
    assert {pool: config.pool(pool).cores for pool in config.pools()} == expected


def test_oversubscribed_cores_are_logged_and_remote_clusters_left_alone(caplog):
    from cluster.app import with_resolved_cores

    config = load_cluster_config(overrides={"device": "cpu", "prefill.replicas": 2, "decode.replicas": 2})
    with caplog.at_level("WARNING", logger="cluster.app"):
        resolved = with_resolved_cores(config, 2)
    assert resolved.prefill.cores == 1 and resolved.decode.cores == 1
    assert "ask for 4 cores" in caplog.text and "host with 2" in caplog.text
    remote = load_cluster_config(overrides={"device": "cpu", "ray_address": "ray://head:10001"})
    assert with_resolved_cores(remote, 8) is remote
    with pytest.raises(ConfigError, match=r"^decode\.cores=1 is fewer than tensor_parallel_size=2"):
        load_cluster_config(overrides={"decode.cores": 1, "decode.tensor_parallel_size": 2})


def test_the_default_kv_budget_is_a_share_of_free_memory_split_between_shards(monkeypatch):
    from cluster import app

    monkeypatch.setattr(app, "available_bytes", lambda: 10 * 2**30)
    config = app.with_resolved_kv_budget(load_cluster_config(overrides={"device": "cpu", "decode.replicas": 3}))
    assert config.kv_cache_memory == int(0.2 * 10 * 2**30 / 4)  # 1 prefill + 3 decode shards
    explicit = load_cluster_config(overrides={"device": "cpu", "kv_cache_memory": 0.5})
    assert app.with_resolved_kv_budget(explicit) is explicit
    assert load_cluster_config().engine_config("decode").cache.kv_cache_memory == 0.2  # unresolved: per instance


@pytest.mark.parametrize(
    ("flag", "expected"),
    [([], True), (["--conditional-disaggregation"], True), (["--no-conditional-disaggregation"], False)],
)
def test_the_conditional_disaggregation_flag_sets_the_router_key(flag, expected):
    import argparse

    from cluster.serve_cli import add_serve_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(flag))
    assert config.router.conditional_disaggregation is expected


@pytest.mark.parametrize(("flag", "expected"), [([], True), (["--compile"], True), (["--no-compile"], False)])
def test_the_compile_flag_reaches_every_pool_s_model_config(flag, expected, tmp_path):
    import argparse

    from cluster.serve_cli import add_serve_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(flag))
    assert config.compile is expected
    assert all(config.engine_config(pool).model.compile is expected for pool in config.pools())
    path = tmp_path / "cluster.yaml"
    path.write_text("compile: false\n")
    assert load_cluster_config(path).engine_config("decode").model.compile is False


def test_a_cluster_reachable_beyond_loopback_needs_api_keys(monkeypatch, tmp_path):
    from cluster.app import load_keyring
    from router.auth import ADMIN_KEY_ENV, API_KEYS_ENV

    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    assert not load_keyring(load_cluster_config(overrides={"host": "127.0.0.1"})).enabled
    assert not load_keyring(load_cluster_config(overrides={"host": "::1"})).enabled
    with pytest.raises(ConfigError, match="not a loopback address and no API key is configured"):
        load_keyring(load_cluster_config(overrides={"host": "0.0.0.0"}))
    monkeypatch.setenv(API_KEYS_ENV, "sk-env-00001")
    assert load_keyring(load_cluster_config(overrides={"host": "0.0.0.0"})).enabled
    monkeypatch.delenv(API_KEYS_ENV)
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants: [{name: a, keys: [sk-00000001]}]")
    monkeypatch.chdir(tmp_path)
    config = load_cluster_config(overrides={"host": "0.0.0.0", "api_keys_file": "keys.yaml"})
    assert config.api_keys_file == str(keys) and load_keyring(config).enabled  # made absolute


@pytest.mark.parametrize(
    ("overrides", "host", "expected"),
    [
        ({}, 2, "colocated"),  # split 1 + 1, each pool would have half the compute a prompt needs
        ({}, 3, "colocated"),
        ({}, 4, "disagg"),
        ({}, 16, "disagg"),
        ({"decode.replicas": 2}, 2, "disagg"),  # a disaggregated pool configured: the user's choice
        ({"prefill.cores": 1}, 2, "disagg"),
        ({"router.conditional_disaggregation": False}, 2, "disagg"),
        ({"colocated.replicas": 2}, 16, "colocated"),
        ({"tensor_parallel_size": 2}, 2, "colocated"),  # vLLM's -tp configures no pool of its own
        ({"tensor_parallel_size": 2}, 16, "disagg"),
        ({"tensor_parallel_size": 2, "prefill.tensor_parallel_size": 1}, 2, "disagg"),
        ({"mode": "disagg"}, 2, "disagg"),  # explicit modes are kept
        ({"mode": "colocated"}, 16, "colocated"),
        ({"device": "cuda"}, 2, "disagg"),  # GPUs are not split by core
        ({"ray_address": "ray://head:10001"}, 2, "disagg"),  # this host says nothing of a remote one
    ],
)
def test_auto_mode_runs_colocated_only_on_a_small_local_cpu_host(overrides, host, expected, caplog):
    from cluster.app import with_resolved_mode

    config = load_cluster_config(overrides={"device": "cpu", **overrides})
    with caplog.at_level("INFO", logger="cluster.app"):
        resolved = with_resolved_mode(config, host)
    assert resolved.mode == expected
    if config.mode == "auto":
        assert f"mode: auto -> {expected}" in caplog.text


def test_a_pools_decode_stall_reaches_its_engine():
    colocated = load_cluster_config(overrides={"mode": "colocated", "colocated.max_decode_stall_s": 0.2})
    assert colocated.engine_config("colocated").scheduler.max_decode_stall_s == 0.2
    assert (
        load_cluster_config(overrides={"mode": "colocated"}).engine_config("colocated").scheduler.max_decode_stall_s
        is None
    )
    # decode's own key wins over the router's default; without conditional disaggregation it is the key alone
    decode = load_cluster_config(overrides={"mode": "disagg", "decode.max_decode_stall_s": 0.3})
    assert decode.engine_config("decode").scheduler.max_decode_stall_s == 0.3
    pure = load_cluster_config(overrides={"mode": "disagg", "router.conditional_disaggregation": False})
    assert pure.engine_config("decode").scheduler.max_decode_stall_s is None
    with pytest.raises(ConfigError, match=r"max_decode_stall_s=-1(\.0)? must be >= 0"):
        load_cluster_config(overrides={"colocated.max_decode_stall_s": -1.0})


def test_the_kv_integrity_modes_are_the_protocol_s():
    from kv_transfer.protocol import INTEGRITY_MODES

    assert KV_INTEGRITY == INTEGRITY_MODES


def test_kv_payloads_are_checked_by_default_and_a_failed_hand_off_recomputes():
    config = load_cluster_config()
    assert config.kv_integrity == "mac" and config.router.kv_load_failure_policy == "recompute"
    assert (
        load_cluster_config(overrides={"router.kv_load_failure_policy": "fail"}).router.kv_load_failure_policy == "fail"
    )
    with pytest.raises(ConfigError, match=r"kv_load_failure_policy='retry': use one of recompute, fail"):
        load_cluster_config(overrides={"router.kv_load_failure_policy": "retry"})


def test_a_pool_s_ray_resources_go_into_every_shard_s_bundle_and_bad_ones_are_refused():
    from cluster.app import replica_placement

    config = load_cluster_config(
        overrides={"mode": "disagg", "decode.tensor_parallel_size": 2, "decode.ray_resources": {"decode_node": 1}}
    )
    assert config.decode.ray_resources == {"decode_node": 1} and config.prefill.ray_resources is None
    assert ClusterConfig.from_dict(config.to_dict()) == config
    assert replica_placement(config, "decode")["placement_group_bundles"] == [{"CPU": 1.0, "decode_node": 1}] * 2
    assert replica_placement(config, "prefill")["placement_group_bundles"] == [{"CPU": 1.0}]
    for bad in ({"CPU": 2}, {"node": 0}, {"node": "one"}, ["node"], {"": 1}, {"node": 1.5}, {"object_store_memory": 1}):
        with pytest.raises(ConfigError, match="ray_resources"):
            load_cluster_config(overrides={"prefill.ray_resources": bad})


def test_the_router_s_ray_resources_go_into_its_actor_options_and_bad_ones_are_refused(smol_dir):
    from cluster.app import build_app, resources_needed

    config = load_cluster_config(overrides={"mode": "disagg", "router.ray_resources": {"ingress": 0.01}})
    assert ClusterConfig.from_dict(config.to_dict()) == config
    router = build_app(config, model_dir=str(smol_dir))._bound_deployment
    assert router.name == "router"
    assert router.ray_actor_options == {"num_cpus": 0, "resources": {"ingress": 0.01}}
    assert resources_needed(config)["ingress"] == 0.01
    plain = build_app(load_cluster_config(overrides={"mode": "disagg"}), model_dir=str(smol_dir))._bound_deployment
    assert plain.ray_actor_options == {"num_cpus": 0}
    for bad in ({"CPU": 1}, {"ingress": 0}, {"ingress": 1.5}):
        with pytest.raises(ConfigError, match="ray_resources"):
            load_cluster_config(overrides={"router.ray_resources": bad})


def test_kv_host_node_is_accepted_for_every_transport_and_reaches_the_connector():
    for transport in ("auto", "tcp", "grpc", "torch"):
        config = load_cluster_config(overrides={"mode": "disagg", "transport": transport, "kv_host": "node"})
        assert config.engine_config("decode").kv_connector.options["host"] == "node"
    # torch binds what senders dial: "node" as the advertised address of a loopback bind is refused.
    with pytest.raises(ConfigError, match="transport=torch"):
        load_cluster_config(overrides={"transport": "torch", "kv_advertise_host": "node"})


def test_the_planner_s_budget_on_a_local_cpu_cluster_is_the_host_s_cores_and_each_replica_costs_its_own():
    from cluster.app import build_app, with_resolved_cores

    config = load_cluster_config(
        overrides={"mode": "disagg", "planner.enabled": True, "device": "cpu", "planner.max_replicas": {"prefill": 3}}
    )
    resolved = with_resolved_cores(config, num_host_cores=16)
    # Each pool's half of the host, cut for the most replicas it may run: the planner has room to grow.
    assert resolved.planner.budget == 16 and (resolved.prefill.cores, resolved.decode.cores) == (2, 2)
    assert resolved.prefill.replicas == resolved.decode.replicas == 1
    given = with_resolved_cores(load_cluster_config(overrides={"planner.enabled": True, "planner.budget": 4}), 6)
    assert given.planner.budget == 4  # a budget set is kept
    kwargs = build_app(resolved, model_dir="/nonexistent/model")._bound_deployment.init_kwargs
    assert kwargs["pool_shards"] == {"prefill": 2, "decode": 2} and kwargs["planner"]["budget"] == 16
    # At these defaults a burst gets its replicas: 2 + 2 cores used of 16.
    from router.planner import Observation, PlannerConfig, PlannerState, PoolState, plan

    burst = PoolState(1, 2, queued_prompt_tokens=50_000, prefill_tokens_per_s=4000.0)
    seen = Observation(0.0, None, None, {"prefill": burst, "decode": PoolState(1, 2)})
    assert plan(seen, PlannerConfig(**kwargs["planner"]), PlannerState())["prefill"].target == 3
    with pytest.raises(ConfigError, match=r"planner\.enabled"):
        load_cluster_config(overrides={"mode": "colocated", "planner.enabled": True})


# --- the vLLM launch line and the generated flags -----------------------------------------------


def _serve_args(*argv: str):
    from cluster.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def _config(*argv: str) -> ClusterConfig:
    from cluster.serve_cli import config_from_args

    return config_from_args(_serve_args(*argv))


def test_a_vllm_launch_line_sets_what_it_sets_in_vllm(tmp_path, monkeypatch):
    from cluster.app import load_keyring

    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = _config(
        "org/some-model",
        "--served-model-name", "chat",
        "--max-model-len", "4096",
        "-tp", "2",
        "--api-key", "sk-vllm-key-01",
        "--chat-template", str(template),
        "--no-enable-prefix-caching",
        "--revision", "1.0",
        "--allowed-origins", '["https://app.example.com"]',
        "--ssl-keyfile", "key.pem",
        "--ssl-certfile", "cert.pem",
        "--access-log",
    )  # fmt: skip
    assert (config.model, config.served_name, config.max_model_len) == ("org/some-model", "chat", 4096)
    assert config.revision == "1.0" and isinstance(config.revision, str)  # not read as the number 1.0
    assert config.enable_prefix_caching is False
    assert config.chat_template == template.read_text()  # the file's text, read once
    assert [config.prefill, config.decode, config.colocated] == [PoolConfig(tensor_parallel_size=2)] * 3
    model = config.engine_config("decode").model
    assert (model.revision, model.chat_template) == ("1.0", template.read_text())
    assert config.router.allowed_origins == ["https://app.example.com"]
    assert config.router.ssl_keyfile == str(Path("key.pem").resolve()) and config.router.access_log is True
    keyring = load_keyring(config)
    assert keyring.tenant("Bearer sk-vllm-key-01").name == "default"
    assert "sk-vllm-key-01" not in repr(config) and "sk-vllm-key-01" not in repr(keyring)
    # Hub ids are served under their id, as vLLM does.
    assert _config("HuggingFaceTB/SmolLM2-135M-Instruct").served_name == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_tensor_parallel_size_is_every_pool_s_unless_a_pool_says_otherwise(tmp_path):
    config = _config("--tensor-parallel-size", "2", "--prefill-tp", "1")
    assert (config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size) == (1, 2)
    assert config.colocated.tensor_parallel_size == 2
    assert _config("--tp", "3").colocated.tensor_parallel_size == 3  # the old spelling
    path = write(tmp_path, "tensor_parallel_size: 2\ndecode:\n  tensor_parallel_size: 4\n")
    from_file = load_cluster_config(path)
    assert (from_file.prefill.tensor_parallel_size, from_file.decode.tensor_parallel_size) == (2, 4)
    # The record of a running cluster reads back to the same pools.
    assert ClusterConfig.from_dict(from_file.to_dict()) == from_file
    with pytest.raises(ConfigError, match="tensor_parallel_size=0"):
        load_cluster_config(overrides={"tensor_parallel_size": 0})


def test_the_model_positional_or_flag_but_not_two_different_ones():
    assert _config("some/model").model == _config("--model", "some/model").model == "some/model"
    assert _config().model is None
    with pytest.raises(ConfigError, match="two models given"):
        _config("a/model", "--model", "b/model")


def test_the_api_keys_reach_no_file_and_no_log(tmp_path, monkeypatch, caplog):
    import json

    from cluster import serve_cli

    monkeypatch.setenv("PDSERVE_STATE_FILE", str(tmp_path / "state.json"))
    config = _config("--api-key", "sk-secret-0001", "--api-key", "sk-secret-0002")
    assert config.api_keys == ["sk-secret-0001", "sk-secret-0002"]
    serve_cli._write_state(config, 8000)
    text = (tmp_path / "state.json").read_text()
    assert "sk-secret" not in text
    recorded = ClusterConfig.from_dict(json.loads(text)["config"])
    assert recorded.api_keys is None and recorded == ClusterConfig.from_dict({**config.to_dict(), "api_keys": None})
    with pytest.raises(ConfigError, match="api_keys"):
        load_cluster_config(overrides={"api_keys": [""]})


def test_gpu_memory_utilization_is_one_way_to_size_the_kv_cache_and_cuda_s_only():
    from cluster.app import check_memory_flags

    config = _config("--gpu-memory-utilization", "0.85", "--device", "cuda")
    assert config.engine_config("decode").cache.gpu_memory_utilization == 0.85
    check_memory_flags(config)  # a CUDA cluster keeps it
    with pytest.raises(ConfigError, match="both size the KV cache"):
        _config("--gpu-memory-utilization", "0.85", "--kv-cache-memory", "0.2")
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1\.5"):
        _config("--gpu-memory-utilization", "1.5")
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization 0.85 sizes a GPU.*--kv-cache-memory"):
        check_memory_flags(_config("--gpu-memory-utilization", "0.85", "--device", "cpu"))


def test_a_chat_template_is_a_file_or_inline_and_a_missing_file_is_named(tmp_path):
    assert _config("--chat-template", "{{ messages[0]['content'] }}").chat_template == "{{ messages[0]['content'] }}"
    with pytest.raises(ConfigError, match=r"chat_template='no-such\.jinja' is neither a readable file"):
        _config("--chat-template", "no-such.jinja")


def test_allowed_origins_take_vllm_s_json_list_or_commas():
    assert _config("--allowed-origins", "https://a.example, https://b.example").router.allowed_origins == [
        "https://a.example",
        "https://b.example",
    ]
    assert _config("--allowed-origins", '["*"]').router.allowed_origins == ["*"]
    assert load_cluster_config(overrides={"router.allowed_hosts": ["a.example"]}).router.allowed_hosts == ["a.example"]


def test_https_needs_both_files():
    with pytest.raises(ConfigError, match="HTTPS needs both"):
        _config("--ssl-keyfile", "key.pem")


def test_every_config_key_has_a_flag():
    """Each field of ClusterConfig and its sections (PoolConfig, RouterConfig, PlannerConfig) is a
    flag of `pdserve serve`: generated from the dataclasses, or the hand-written flag of that key."""
    import dataclasses

    from cluster.cli import build_parser
    from cluster.config_flags import config_flags
    from router.planner import PlannerConfig

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    options = serve._option_string_actions
    expected = {f.name for f in dataclasses.fields(ClusterConfig)} - {
        "prefill",
        "decode",
        "colocated",
        "router",
        "planner",
    }
    expected |= {
        f"{pool}.{f.name}" for pool in ("prefill", "decode", "colocated") for f in dataclasses.fields(PoolConfig)
    }
    expected |= {f"router.{f.name}" for f in dataclasses.fields(RouterConfig)}
    expected |= {f"planner.{f.name}" for f in dataclasses.fields(PlannerConfig)}
    specs = {spec.key: spec for spec in config_flags()}
    assert set(specs) == expected
    for key, spec in specs.items():
        assert spec.flag in options, key
        if spec.is_switch and "." in key:
            assert "--no-" + spec.flag[2:] in options, key


@pytest.mark.parametrize(
    ("argv", "key", "expected"),
    [
        (["--router.request-timeout-s", "60"], "router.request_timeout_s", 60.0),
        (["--prefill.max-num-seqs", "8"], "prefill.max_num_seqs", 8),
        (["--router.inter-token-timeout-s", "null"], "router.inter_token_timeout_s", None),
        (["--no-router.conditional-disaggregation"], "router.conditional_disaggregation", False),
        (["--planner.enabled", "--mode", "disagg"], "planner.enabled", True),
        (["--planner.max-replicas", "{decode: 2}"], "planner.max_replicas", {"prefill": 4, "decode": 2}),
        (["--router.allowed-hosts", "[api.example.com]"], "router.allowed_hosts", ["api.example.com"]),
        (["--block-size", "32"], "block_size", 32),
        (["--decode.overlap-outputs", "true"], "decode.overlap_outputs", True),
        (["--kv-integrity", "crc32"], "kv_integrity", "crc32"),
        (
            ["--tracing-endpoint", "http://127.0.0.1:4318/v1/traces"],
            "tracing_endpoint",
            "http://127.0.0.1:4318/v1/traces",
        ),
    ],
)
def test_a_generated_flag_sets_its_key(argv, key, expected):
    config = _config(*argv)
    value: object = config
    for part in key.split("."):
        value = getattr(value, part)
    assert value == expected and type(value) is type(expected)


def test_a_generated_flag_refuses_a_value_of_the_wrong_type_naming_the_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _serve_args("--prefill.max-num-seqs", "many")
    assert exit_info.value.code == 2
    assert "prefill.max_num_seqs: expected int" in capsys.readouterr().err
    # --set still wins over a flag.
    assert _config("--router.max-retries", "3", "--set", "router.max_retries=0").router.max_retries == 0


def test_serve_help_stays_short_and_help_config_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        _serve_args("--help")
    help_text = capsys.readouterr().out
    assert "--tensor-parallel-size N, -tp N, --tp N" in help_text and "--help-config" in help_text
    assert "--router.request-timeout-s" in help_text  # once, as the example
    assert "--prefill.max-num-waiting" not in help_text and len(help_text.splitlines()) < 160
    with pytest.raises(SystemExit):
        _serve_args("--help-config")
    listing = capsys.readouterr().out
    assert "--prefill.max-num-waiting INT" in listing and "--router.access-log/--no-router.access-log" in listing


def test_the_scheduling_policy_reaches_every_pool_s_engine_and_max_n_the_router():
    config = load_cluster_config(None, {"scheduling_policy": "priority", "router.max_n": 4, "mode": "disagg"})
    assert [config.engine_config(pool).scheduler.policy for pool in config.pools()] == ["priority", "priority"]
    assert config.router.max_n == 4
    assert load_cluster_config().engine_config("decode").scheduler.policy == "fcfs"
    for bad in ({"scheduling_policy": "lottery"}, {"router.max_n": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad)).split(".")[-1]):
            load_cluster_config(None, bad)
