"""The cluster's configuration: one home, loaded from YAML (``cluster.yaml``) plus ``--set key=value`` overrides.

Every validation message starts with the key it is about (``tensor_parallel_size=0 must be >= 1``); the loader
prefixes the section, so a user reads ``prefill.tensor_parallel_size=0 must be >= 1``. Unknown keys and wrong
types are refused by the loader with the full key path, the expected type and, for typos, the closest known key.
"""

from __future__ import annotations

import difflib
import importlib.util
import types
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path

import yaml

from common.config import (
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    EngineRole,
    KVConnectorConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    check_gpu_memory_utilization,
)
from common.errors import ConfigError
from common.model_source import is_hub_id, load_chat_template
from common.serving import KV_LOAD_FAILURE_POLICIES
from common.tracing import check_tracing
from router.planner import PlannerConfig

MODES = ("auto", "disagg", "colocated")
# kv_transfer backends that cross process boundaries ("inproc" does not); auto: shm between
# replicas on one host, tcp between hosts, chosen per hand-off (kv_transfer/backends/auto.py).
TRANSPORTS = ("auto", "shm", "grpc", "torch", "tcp")
KV_INTEGRITY = ("none", "crc32", "mac")  # kv_transfer.protocol.INTEGRITY_MODES (not imported: that pulls in torch)
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
KV_CONNECTOR = "kv_transfer.connector:TransferConnector"
KV_SHARE_OF_HOST = 0.2
DEFAULT_KV_FRACTION = 0.2


def _positive(amount: object) -> bool:
    return type(amount) in (int, float) and amount > 0  # type: ignore[operator]


@dataclass(frozen=True)
class PoolConfig:
    """One pool of identical replicas; each replica is ``tensor_parallel_size`` shards."""

    replicas: int = 1
    tensor_parallel_size: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    max_num_waiting: int = 256
    cpus_per_shard: float = 1.0  # Ray CPUs per TP shard (one placement-group bundle each)
    # CPU: the cores each replica owns, split between its shards and pinned (none shared with
    # another replica while the host has them). None: a local cluster gives each pool its share of
    # the host (cluster.app.with_resolved_cores); a remote or CUDA cluster leaves threads unpinned.
    cores: int | None = None
    max_ongoing_requests: int = 256  # Serve's per-replica cap; beyond it callers queue (back-pressure)
    # A step that also decodes computes at most about this long of prompt tokens (the engine's
    # SchedulerConfig.max_decode_stall_s): chunked prefill sized by time, not by a token budget.
    # Colocated and decode pools; None: a colocated step takes up to max_num_batched_tokens of
    # prompts, a decode pool takes router.local_prefill_max_stall_s.
    max_decode_stall_s: float | None = None
    # Make a step's outputs while the device runs the next step (SchedulerConfig.overlap_outputs).
    # None: on CUDA, off on CPU.
    overlap_outputs: bool | None = None
    # Schedule the next step before this one's ids are read (SchedulerConfig.async_scheduling).
    # None: on CUDA with one shard, off on CPU.
    async_scheduling: bool | None = None
    # Ray custom resources each shard's placement-group bundle asks for besides its CPUs, e.g.
    # {"prefill_node": 1} to keep the pool on the nodes started with that resource (`ray start
    # --resources`): how pools are spread over the nodes of a multi-node cluster.
    ray_resources: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas={self.replicas} must be >= 1 (a pool starts with at least one replica)")
        if not self.cpus_per_shard > 0:
            raise ConfigError(f"cpus_per_shard={self.cpus_per_shard} must be > 0 (e.g. 1.0)")
        if self.max_ongoing_requests < 1:
            raise ConfigError(f"max_ongoing_requests={self.max_ongoing_requests} must be >= 1")
        ParallelConfig(tensor_parallel_size=self.tensor_parallel_size)
        _check_ray_resources(self.ray_resources, "CPU and GPU come from cpus_per_shard and the device")
        if self.cores is not None and self.cores < self.tensor_parallel_size:
            raise ConfigError(
                f"cores={self.cores} is fewer than tensor_parallel_size={self.tensor_parallel_size}: "
                "each shard needs a core of its own"
            )
        self.scheduler_config(EngineRole.COLOCATED)

    def scheduler_config(self, role: EngineRole) -> SchedulerConfig:
        return SchedulerConfig(
            role=role,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_prefill_chunk=self.max_prefill_chunk,
            max_num_waiting=self.max_num_waiting,
            max_decode_stall_s=self.max_decode_stall_s,
            overlap_outputs=self.overlap_outputs,
            async_scheduling=self.async_scheduling,
        )


def _check_ray_resources(resources: object, where_cpus_come_from: str) -> None:
    if resources is not None and not (
        isinstance(resources, dict)
        and all(
            isinstance(name, str)
            and name
            and name not in ("CPU", "GPU", "memory", "object_store_memory")
            and _positive(amount)
            and (amount <= 1 or float(amount).is_integer())  # type: ignore[operator]  # Ray's rule
            for name, amount in resources.items()
        )
    ):
        raise ConfigError(
            f"ray_resources={resources!r} must map custom resource names to amounts > 0, "
            f"whole numbers above 1 ({where_cpus_come_from})"
        )


@dataclass(frozen=True)
class RouterConfig:
    # cache_aware | least_loaded | random (router.placement; the router's registry checks the name)
    placement_policy: str = "cache_aware"
    request_timeout_s: float = 600.0
    kv_lease_s: float = 30.0  # how long a decode reservation waits for its KV before it is released
    # ...plus this much per prompt token: a long prompt's KV leaves only when its prefill ends
    # (about 12 ms per token on a 2-core CPU; far less on a GPU).
    kv_lease_per_token_s: float = 0.02
    max_concurrent_requests: int = 1024  # admission control: beyond it the router answers 503
    max_body_bytes: int = 32 * 2**20  # a larger request body is refused (413) before it is read whole
    # A connection whose request headers are not complete this long after it opened (or after its
    # last response) is closed: idle and trickling sockets do not hold the listener's slots.
    header_timeout_s: float = 10.0
    # A request body not whole this long after its headers is answered 408 and its admission slot
    # freed (32 MiB in 30 s: a client slower than ~1 MiB/s with the largest body is refused).
    body_timeout_s: float = 30.0
    # A stream whose decode replica sends no token for this long after its first one resumes on
    # another replica (as a killed replica's does): a hung replica (stopped, not dead) would hold
    # its streams until Serve's health checks replace it. None: no watchdog.
    inter_token_timeout_s: float | None = 30.0
    # Host names the router answers (any port): None = localhost, 127.0.0.1 and ::1 when it listens
    # on loopback (a DNS-rebinding page comes under its own name), any when it listens beyond.
    allowed_hosts: list[str] | None = None
    # Web origins whose pages may send requests (browsers send Origin on cross-origin POSTs); a
    # request without Origin (every API client) is not concerned. None = loopback pages only;
    # ["*"] = any.
    allowed_origins: list[str] | None = None
    # The most tokens a request may ask for (400 naming max_tokens beyond it), and what one that
    # names none gets. None: the context's rest, as vLLM.
    max_tokens_limit: int | None = None
    # The most choices one request may ask for (n): each is a request on the pools.
    max_n: int = 16
    # An output constraint (JSON schema, regex, grammar, structural tag) over this many bytes, or a
    # schema nested deeper, is refused (400) before any replica compiles it.
    max_constraint_bytes: int = 64 * 1024
    max_schema_depth: int = 32
    max_retries: int = 1  # prefill retries / decode resumes per request
    # A request whose KV hand-off failed (a chunk refused as corrupt or forged, a lease run out, a
    # transport error): "recompute" retries it with the prompt computed on its decode replica (no
    # second transfer), "fail" ends it with the error at once (vLLM's kv_load_failure_policy).
    kv_load_failure_policy: str = "recompute"
    # Disaggregated mode: a decode replica may compute a prompt itself when the router's estimate
    # of the prefill pool's path (queue, cache hit, rate, measured hand-off overhead) says that is
    # sooner (decode_pool/prefill_site.py). It computes it in chunks beside its decode batch, each
    # step spending at most local_prefill_max_stall_s on prompt tokens (at least 32 of them).
    # On by default (as Dynamo's disaggregated router does): on a small host it more than doubles
    # goodput (docs/benchmarks.md). False: every prompt goes to the prefill pool (DistServe's experiments).
    conditional_disaggregation: bool = True
    local_prefill_max_stall_s: float = 0.05
    # Ray custom resources the router replica asks for, e.g. {"ingress": 0.01}: keeps it on the node
    # that clients reach (it listens on that node's address; it takes no CPU of the pools').
    ray_resources: dict[str, float] | None = None
    # HTTPS on the router's port (uvicorn's, as vLLM's --ssl-keyfile/--ssl-certfile): both PEM
    # files, read by the router replica where it starts. None: plain HTTP.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    access_log: bool = False  # uvicorn's access log, a line per request, in the router's log (vLLM's default is on)

    def __post_init__(self) -> None:
        _check_ray_resources(self.ray_resources, "the router asks for no CPU")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError(
                f"ssl_keyfile={self.ssl_keyfile!r} and ssl_certfile={self.ssl_certfile!r}: HTTPS needs both, or neither"
            )
        for key in ("ssl_keyfile", "ssl_certfile"):  # the router's process has a working directory of its own
            if getattr(self, key) is not None:
                object.__setattr__(self, key, str(Path(getattr(self, key)).expanduser().resolve()))
        if type(self.access_log) is not bool:
            raise ConfigError(f"access_log={self.access_log!r} must be true or false")
        if not self.placement_policy:
            raise ConfigError("placement_policy='' is empty; name a policy such as 'cache_aware'")
        if self.kv_lease_per_token_s < 0:
            raise ConfigError(f"kv_lease_per_token_s={self.kv_lease_per_token_s} must be >= 0")
        if self.inter_token_timeout_s is not None and not self.inter_token_timeout_s > 0:
            raise ConfigError(f"inter_token_timeout_s={self.inter_token_timeout_s} must be > 0 seconds or null")
        for key in ("request_timeout_s", "kv_lease_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be > 0 seconds")
        for key in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, key)
            if value is not None and not (
                isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value)
            ):
                raise ConfigError(f'{key}={value!r} must be a non-empty list of names (or ["*"]), or null')
        for key in ("max_constraint_bytes", "max_schema_depth"):
            if type(getattr(self, key)) is not int or getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)!r} must be an integer >= 1")
        if type(self.max_n) is not int or self.max_n < 1:
            raise ConfigError(f"max_n={self.max_n!r} must be an integer >= 1")
        if self.max_tokens_limit is not None and not (
            type(self.max_tokens_limit) is int and self.max_tokens_limit >= 1
        ):
            raise ConfigError(f"max_tokens_limit={self.max_tokens_limit!r} must be an integer >= 1 or null")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            policies = ", ".join(KV_LOAD_FAILURE_POLICIES)
            raise ConfigError(f"kv_load_failure_policy={self.kv_load_failure_policy!r}: use one of {policies}")
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"max_concurrent_requests={self.max_concurrent_requests} must be >= 1")
        if type(self.max_body_bytes) is not int or self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes={self.max_body_bytes!r} must be an integer of at least 1024 bytes")
        if self.max_retries < 0:
            raise ConfigError(f"max_retries={self.max_retries} must be >= 0 (0 disables retries)")
        if type(self.conditional_disaggregation) is not bool:
            raise ConfigError(f"conditional_disaggregation={self.conditional_disaggregation!r} must be true or false")
        if not self.local_prefill_max_stall_s >= 0:
            raise ConfigError(f"local_prefill_max_stall_s={self.local_prefill_max_stall_s} must be >= 0 seconds")


@dataclass(frozen=True)
class ClusterConfig:
    # disagg: separate prefill and decode pools; colocated: one pool does both; auto: decided at
    # deploy from the host (cluster.app.with_resolved_mode), disaggregated until then.
    mode: str = "auto"
    # None: the default model; else a HF directory, a .gguf file, or a Hub id (org/name: downloaded
    # into the Hugging Face cache once, or read from it with HF_HUB_OFFLINE=1) at `revision`.
    model: str | None = None
    revision: str | None = None  # a Hub id's branch, tag or commit (None: main)
    served_model_name: str | None = None  # the `model` clients pass; None: derived (see served_name)
    # vLLM's --tensor-parallel-size: the TP degree of every pool whose own tensor_parallel_size is
    # not given (applied by the loader: the config file, flags, records). None: 1.
    tensor_parallel_size: int | None = None
    # The chat template the router applies instead of the model's own (vLLM's --chat-template): a
    # file's path or the template inline; held (and recorded) as the template's text.
    chat_template: str | None = None
    # vLLM's --scheduling-policy: "fcfs", or "priority" (a request's priority field orders every
    # pool's waiting requests, lower first; without it a priority other than 0 is refused).
    scheduling_policy: str = "fcfs"
    # vLLM's --tool-call-parser: how the router reads a model's tool calls under tool_choice "auto"
    # ("hermes", "llama3_json", "mistral"); "auto": the one the chat template's format shows, hermes
    # where it shows none (a template that ignores tools is then replaced, for requests with tools,
    # by a ChatML one that shows them the Hermes way). vLLM's --enable-auto-tool-choice: false
    # refuses tool_choice "auto" with a 400 (required and named functions are served either way).
    tool_call_parser: str = "auto"
    enable_auto_tool_choice: bool = True
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    compile: bool = True  # CPU: the compiled kernels (common.config.ModelConfig.compile); false: eager torch
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (common.config.ModelConfig)
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    block_size: int = 16
    # Per shard: bytes (an int > 1), or a fraction in (0, 1] of the memory free on its host when it
    # starts (split between its instance's shards). None: a local CPU cluster gives its KV caches
    # KV_SHARE_OF_HOST of the host's free memory, split evenly between all its shards
    # (cluster.app.with_resolved_kv_budget); elsewhere each instance takes DEFAULT_KV_FRACTION.
    kv_cache_memory: float | int | None = None
    # CUDA only, vLLM's --gpu-memory-utilization: the fraction of each GPU's total memory its shard
    # may hold (weights, activations, KV); its KV cache gets the rest (engine.kv_cache_memory).
    # Replaces kv_cache_memory; refused on CPU (size the cache with kv_cache_memory there).
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    transport: str = "auto"  # KV transport between pools
    # Where decode replicas' KV endpoints (tcp, grpc, torch) listen, and the address tickets name
    # for them (default: kv_host). Across hosts with tcp or grpc: kv_host 0.0.0.0 and
    # kv_advertise_host the address prefill replicas reach it at; torch binds the address senders
    # dial (its gloo/NCCL pairs use it too): kv_host the host's own address, nothing advertised.
    # "node" (either key): each decode replica's own Ray node address, for pools spread over the
    # nodes of a Ray cluster. shm ignores both (one host only); auto's tcp half uses them.
    kv_host: str = "127.0.0.1"
    kv_advertise_host: str | None = None
    # How each KV chunk's payload is checked (kv_transfer.protocol): mac (Poly1305 under a one-time
    # key from the ticket's secret: catches tampering and corruption; ~10-13 GB/s a CPU core, docs/security.md
    # "KV integrity"), crc32 (corruption only) or none (the chunk's header is signed either way).
    kv_integrity: str = "mac"
    # true: a prefill replica pushes each prompt chunk's completed KV blocks while its next chunk
    # computes, so only the last chunk's are left to travel once the prompt is done; false: the whole
    # prompt leaves during its last chunk; null: true on CUDA, false on CPU (docs/benchmarks.md "KV pushed chunk
    # by chunk": on CPU the last chunk's compute hides the transfer already).
    kv_push_every_chunk: bool | None = None
    # Tokens per streamed chunk after the first (vLLM's --stream-interval): fewer chunks cost less
    # CPU on every hop, at the price of burstier streams (decode_pool/stream_interval.py).
    stream_interval: int = 1
    # How often Serve asks each pool replica whether its engine runs; three failures in a row and
    # the replica is stopped and replaced (a tensor-parallel shard died, a step raised).
    health_check_period_s: float = 5.0
    # Where every process's trace spans go: none, console, file:PATH, otlp (common/tracing.py).
    tracing: str = "none"
    tracing_endpoint: str | None = None  # otlp: the collector's URL (default http://127.0.0.1:4318/v1/traces)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port
    # API keys, a tenant per key, and each tenant's limits (router/auth.py). With none configured
    # (neither this file nor PDSERVE_API_KEYS) the router asks for no key, which only a loopback
    # host may do: cluster.app refuses to deploy otherwise.
    api_keys_file: str | None = None
    # Keys clients must send as 'Authorization: Bearer KEY' (vLLM's --api-key), tenant "default"
    # as PDSERVE_API_KEYS' are. Never logged nor recorded (redacted_dict): the router holds digests.
    api_keys: list[str] | None = field(default=None, repr=False)
    ray_address: str | None = None  # None: start a local Ray
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    colocated: PoolConfig = field(default_factory=PoolConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    # The SLO planner (router/planner.py): sizes the prefill and decode pools together from the SLO
    # attainment the router sees and the replicas' queues; off by default.
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not supported; use one of {', '.join(MODES)}")
        if self.planner.enabled and self.mode == "colocated":
            raise ConfigError("planner.enabled sizes a prefill and a decode pool: use mode disagg (or auto)")
        if self.transport == "inproc":
            raise ConfigError(f"transport='inproc' cannot cross processes; use one of {', '.join(TRANSPORTS)}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport={self.transport!r} is not supported; use one of {', '.join(TRANSPORTS)}")
        if self.kv_integrity not in KV_INTEGRITY:
            raise ConfigError(
                f"kv_integrity={self.kv_integrity!r} is not supported; use one of {', '.join(KV_INTEGRITY)}"
            )
        if type(self.stream_interval) is not int or self.stream_interval < 1:
            raise ConfigError(f"stream_interval={self.stream_interval!r} must be an integer >= 1 (tokens per chunk)")
        if self.tool_call_parser != "auto":
            from router.tool_parsers import get_parser

            try:
                get_parser(self.tool_call_parser)
            except ValueError as exc:
                raise ConfigError(f"tool_call_parser={self.tool_call_parser!r}: {exc}") from None
        if type(self.enable_auto_tool_choice) is not bool:
            raise ConfigError(f"enable_auto_tool_choice={self.enable_auto_tool_choice!r} must be true or false")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            policies = ", ".join(SCHEDULING_POLICIES)
            raise ConfigError(f"scheduling_policy={self.scheduling_policy!r} is not supported; use one of {policies}")
        if not (isinstance(self.health_check_period_s, (int, float)) and self.health_check_period_s > 0):
            raise ConfigError(f"health_check_period_s={self.health_check_period_s!r} must be > 0 seconds")
        check_tracing(self.tracing)
        if self.tracing.startswith("file:"):  # every replica's process has a working directory of its own
            object.__setattr__(self, "tracing", "file:" + str(Path(self.tracing.removeprefix("file:")).resolve()))
        if self.tracing == "otlp" and importlib.util.find_spec("opentelemetry.exporter.otlp") is None:
            raise ConfigError(
                "tracing=otlp needs the OTLP exporter: pip install opentelemetry-exporter-otlp-proto-http"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in 0..65535 (0 picks a free port)")
        if not self.host:
            raise ConfigError("host='' is empty; use e.g. '127.0.0.1' or '0.0.0.0'")
        if not self.kv_host or self.kv_advertise_host == "":
            raise ConfigError("kv_host and kv_advertise_host must not be empty")
        if self.transport == "torch" and (
            self.kv_host in ("0.0.0.0", "::") or self.kv_advertise_host not in (None, self.kv_host)
        ):
            raise ConfigError(
                f"transport=torch binds the address senders dial (kv_host={self.kv_host!r}, "
                f"kv_advertise_host={self.kv_advertise_host!r}): set kv_host to this host's own address "
                "and leave kv_advertise_host unset"
            )
        if self.kv_host in ("0.0.0.0", "::") and self.kv_advertise_host is None:
            raise ConfigError(
                f"kv_host={self.kv_host!r} listens on every interface, which no peer can dial: "
                "set kv_advertise_host to the address prefill replicas reach this host at"
            )
        if self.api_keys_file is not None:  # every process of the cluster reads it from its own cwd
            object.__setattr__(self, "api_keys_file", str(Path(self.api_keys_file).resolve()))
        if self.served_model_name == "":
            raise ConfigError("served_model_name='' is empty; give a name or leave it unset to derive one")
        if self.tensor_parallel_size is not None:
            ParallelConfig(tensor_parallel_size=self.tensor_parallel_size)
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", load_chat_template(self.chat_template))
        if self.api_keys is not None and not (
            isinstance(self.api_keys, list)
            and self.api_keys
            and all(isinstance(k, str) and k.strip() for k in self.api_keys)
        ):
            raise ConfigError("api_keys must be a non-empty list of keys, or null")
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        if self.gpu_memory_utilization is not None and self.kv_cache_memory is not None:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} and kv_cache_memory={self.kv_cache_memory} "
                "both size the KV cache: give one"
            )
        for key, cls in (("prefill", PoolConfig), ("decode", PoolConfig), ("colocated", PoolConfig)):
            if not isinstance(getattr(self, key), cls):
                raise ConfigError(f"{key}={getattr(self, key)!r} must be a {cls.__name__}")
        if not isinstance(self.router, RouterConfig):
            raise ConfigError(f"router={self.router!r} must be a RouterConfig")
        if self.device.startswith("cuda:"):
            raise ConfigError(
                f"device={self.device!r}: a cluster's GPUs are Ray's to hand out, one to each shard "
                "(it sets CUDA_VISIBLE_DEVICES per actor); use device: cuda (cuda:N is for the offline engine)"
            )
        self._model_config()
        self._cache_config(self.pools()[0])  # validates the cache fields now

    def _model_config(self) -> ModelConfig:
        return ModelConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            compile=self.compile,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            revision=self.revision,
            chat_template=self.chat_template,
        )

    def _cache_config(self, pool: str) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=DEFAULT_KV_FRACTION if self.kv_cache_memory is None else self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            # Decode replicas on this host read a prefill replica's blocks in place over shm.
            shared_memory=self.disaggregated and pool == "prefill" and self.transport in ("shm", "auto"),
        )

    @property
    def gpus_per_shard(self) -> float:
        """Ray GPUs each shard asks for: one on CUDA (Ray then sets the shard's CUDA_VISIBLE_DEVICES
        to its own GPU, which it sees as cuda:0), none on CPU. ``device: auto`` is resolved on the
        host that deploys: against a remote Ray cluster from a host without GPUs, say ``cuda``."""
        if self.device == "auto":
            from engine.distributed.parallel import pick_device  # torch: only when asked

            return 1.0 if pick_device("auto").type == "cuda" else 0.0
        return 1.0 if self.device == "cuda" else 0.0

    @property
    def num_shards(self) -> int:
        return sum(self.pool(p).replicas * self.pool(p).tensor_parallel_size for p in self.pools())

    @property
    def disaggregated(self) -> bool:
        return self.mode != "colocated"

    def pools(self) -> list[str]:
        return ["prefill", "decode"] if self.disaggregated else ["colocated"]

    def pool(self, name: str) -> PoolConfig:
        if name not in self.pools():
            raise ConfigError(f"pool {name!r} is not part of mode={self.mode!r}; its pools are {self.pools()}")
        return getattr(self, name)

    def engine_config(self, pool: str) -> EngineConfig:
        """The engine configuration of one replica of ``pool`` (one of ``pools()``)."""
        spec = self.pool(pool)
        connector = KVConnectorConfig()
        if self.disaggregated:
            options = {
                "backend": self.transport,
                "receive": pool == "decode",
                "integrity": self.kv_integrity,
                "host": self.kv_host,
                "advertise_host": self.kv_advertise_host,
            }
            connector = KVConnectorConfig(KV_CONNECTOR, options, push_every_chunk=self.kv_push_every_chunk)
        scheduler = replace(spec.scheduler_config(EngineRole(pool)), policy=self.scheduling_policy)
        if pool == "decode" and self.router.conditional_disaggregation and spec.max_decode_stall_s is None:
            # The prompts it computes itself go in chunks beside its decode batch, each step's held to this.
            scheduler = replace(scheduler, max_decode_stall_s=self.router.local_prefill_max_stall_s)
        return EngineConfig(
            model=self._model_config(),
            cache=self._cache_config(pool),
            scheduler=scheduler,
            parallel=ParallelConfig(tensor_parallel_size=spec.tensor_parallel_size),
            kv_connector=connector,
        )

    @property
    def served_name(self) -> str:
        if self.served_model_name is not None:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_SERVED_NAME
        if is_hub_id(self.model):  # as vLLM: clients name the model by its id
            return self.model
        name = Path(self.model).name
        return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name

    def to_dict(self) -> dict:
        """Plain types only (YAML/JSON/msgpack-safe); ``from_dict`` reads it back."""
        return asdict(self)

    def redacted_dict(self) -> dict:
        """``to_dict`` without the API keys: what is written where others may read it (the run-state
        file, Ray's key-value store). A resize needs none: it reuses the running router's keyring."""
        return {**self.to_dict(), "api_keys": None}

    @classmethod
    def from_dict(cls, data: Mapping[str, object], source: str = "the cluster config") -> ClusterConfig:
        return _build(cls, data, "", source)


def load_cluster_config(path: str | Path | None = None, overrides: Mapping[str, object] | None = None) -> ClusterConfig:
    """Read ``path`` (YAML; None: defaults only), apply dotted-key ``overrides`` and validate the result."""
    data: dict = {}
    source = "the cluster config"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"cluster config file {source} does not exist; check the path") from None
        except OSError as exc:
            raise ConfigError(f"cannot read cluster config file {source}: {exc}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or exc
            raise ConfigError(f"{source} is not valid YAML{where}: {problem}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{source} must hold a mapping of keys at the top level, got {type(loaded).__name__}")
        data = loaded or {}
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    return _build(ClusterConfig, data, "", source)


def parse_override(text: str) -> tuple[str, object]:
    """``"prefill.replicas=2"`` -> ``("prefill.replicas", 2)``; the value is read as YAML (numbers, bools, null)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r} must look like key=value (e.g. prefill.replicas=2)")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return key, value


def parse_value(text: str, hint: object, key: str, source: str) -> object:
    """``text`` (a command-line value) as the type ``hint`` wants: read as YAML (numbers, true/false,
    null, [lists], {mappings}), or the text as it is for a key that takes a string. ConfigError
    names ``key`` and the type it takes."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    try:
        return _check_type(value, hint, key, source)
    except ConfigError:
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if str in allowed:  # e.g. a revision "1.0", a name "123"
            return text
        raise


def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


# Keys that were renamed: a configuration written for the old name is told the new one.
_RENAMED = {"kv_checksums": "kv_integrity (none | crc32 | mac; kv_checksums: true was crc32)"}


def _unknown(key: object, known: list[str], section: str, source: str) -> ConfigError:
    path = f"{section}.{key}" if section else str(key)
    if path in _RENAMED:
        return ConfigError(f"unknown key '{path}' in {source}: it is now {_RENAMED[path]}")
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        suggestion = f"{section}.{close[0]}" if section else close[0]
        return ConfigError(f"unknown key '{path}' in {source}; did you mean '{suggestion}'?")
    under = f" under '{section}'" if section else ""
    return ConfigError(f"unknown key '{path}' in {source}; allowed keys{under}: {', '.join(known)}")


def _set_dotted(data: dict, key: str, value: object) -> None:
    parts = key.split(".")
    cls: type = ClusterConfig
    node = data
    for depth, part in enumerate(parts):
        section = ".".join(parts[:depth])
        hints = _hints(cls)
        if part not in hints:
            raise _unknown(part, list(hints), section, f"override '{key}'")
        if depth == len(parts) - 1:
            if isinstance(value, Mapping) and isinstance(node.get(part), dict):
                for sub_key, sub_value in value.items():
                    _set_dotted(data, f"{key}.{sub_key}", sub_value)
            else:
                node[part] = value
            return
        hint = hints[part]
        if not (isinstance(hint, type) and is_dataclass(hint)):
            raise ConfigError(f"override '{key}': '{_join(section, part)}' is a value, not a section")
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{_join(section, part)}: expected a mapping, got {child!r} ({type(child).__name__})")
        node, cls = child, hint


def _join(section: str, key: object) -> str:
    return f"{section}.{key}" if section else str(key)


def _check_type(value: object, hint: object, path: str, source: str) -> object:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if isinstance(value, bool):
            continue
        if kind is int and isinstance(value, int):
            return value
        if kind is float and isinstance(value, int | float):
            return value if int in allowed else float(value)
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is dict and isinstance(value, Mapping):
            return dict(value)  # its keys and values are checked by the dataclass that holds it
        if typing.get_origin(kind) is list and isinstance(value, list | tuple):
            return list(value)  # its items too
    expected = " or ".join("null" if kind is type(None) else getattr(kind, "__name__", str(kind)) for kind in allowed)
    raise ConfigError(f"{path}: expected {expected}, got {value!r} ({type(value).__name__}) in {source}")


POOL_KEYS = ("prefill", "decode", "colocated")


def _with_cluster_tp(data: Mapping) -> Mapping:
    """The top-level ``tensor_parallel_size`` given to each pool that does not give its own (here,
    where a key left out can be told from one set to the default)."""
    tp = data.get("tensor_parallel_size")
    if tp is None:
        return data
    pools = {key: data.get(key) or {} for key in POOL_KEYS}
    if not all(isinstance(pool, Mapping) for pool in pools.values()):
        return data  # _build names the section that is not a mapping
    return {**data, **{key: {"tensor_parallel_size": tp, **pool} for key, pool in pools.items()}}


def _build(cls: type, data: object, section: str, source: str):
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        where = f"'{section}'" if section else "the top level"
        raise ConfigError(f"{where} of {source} must be a mapping of keys, got {data!r} ({type(data).__name__})")
    hints = _hints(cls)
    if cls is ClusterConfig:
        data = _with_cluster_tp(data)
    kwargs: dict[str, object] = {}
    for key, value in data.items():
        if key not in hints:
            raise _unknown(key, list(hints), section, source)
        hint = hints[key]
        path = _join(section, key)
        if isinstance(hint, type) and is_dataclass(hint):
            kwargs[key] = _build(hint, value, path, source)
        else:
            kwargs[key] = _check_type(value, hint, path, source)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if not section:
            raise
        raise ConfigError(f"{section}.{exc}") from None
