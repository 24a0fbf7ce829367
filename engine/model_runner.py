"""One shard of a model instance: its weights, its KV cache, and the forward pass of a step."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from common.config import CacheConfig, EngineConfig
from common.errors import ConfigError
from common.kv_layout import KVCacheLayout, bytes_per_block
from common.kv_messages import ConnectorStep, ShardReport
from engine.attention import StepTensors, get_backend
from engine.attention.triton_paged import MAX_SPLITS
from engine.attention.triton_selfcheck import triton_unusable
from engine.cpu_kernels import kernels_for
from engine.cpu_kernels.prefill_probe import use_tiled_prefill
from engine.cuda_graphs import CaptureReport, DecodeBatch, DecodeGraphs, memory_reserve
from engine.distributed.parallel import TensorParallel
from engine.dtype_probe import advise_on_bfloat16, resolve_auto_dtype
from engine.heap import keep_freed_memory
from engine.kv_cache_memory import (
    DeviceMemory,
    activation_reserve,
    allocate_kv_caches,
    gpu_kv_budget,
    release_kv_caches,
)
from engine.kv_connector import KVConnector, load_connector, model_fingerprint
from engine.layers.linear import cpu_packing_available, pack_linear_weights
from engine.models import check_tp_degree, resolve_architecture
from engine.models.llama import LlamaForCausalLM, LlamaShape
from engine.pinned_upload import PinnedUpload
from engine.step_input import CarriedTokens, StepInput
from engine.weights import iter_safetensors, read_config

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        requested = resolve_auto_dtype(device)
    if requested == "float16" and device.type == "cpu":
        raise ConfigError("dtype=float16 is not supported on CPU; use float32 or bfloat16")
    if requested == "bfloat16":
        advise_on_bfloat16(device)
    return _DTYPES[requested]


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# The largest decode batch captured as a CUDA graph (larger ones run eagerly: launches matter less).
MAX_GRAPH_BATCH = 256


def resolve_attention_backend(requested: str, device: torch.device) -> str:
    """auto: the Triton kernels on CUDA where Triton imports (torch's CUDA wheels ship it), else torch."""
    if requested != "auto":
        if requested == "triton" and device.type != "cuda" and not _triton_interpreted():
            raise ConfigError("attention_backend=triton needs a CUDA device (or TRITON_INTERPRET=1, for tests)")
        return requested
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("Triton is not installed: attention runs on the torch backend (gathers, no CUDA graphs)")
        return "torch"
    return "triton"


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _store_weights_column_major(model: torch.nn.Module) -> None:
    """Keep each [out, in] weight's memory as [in, out] so ``F.linear`` runs as ``x @ W_t`` on a
    contiguous matrix. Measured on CPU (bench/roofline, MKL): batch-1 decode 45 ms instead of
    62 ms per step for SmolLM2 fp32, and equal at batch 8-32. Logical shapes do not change.
    float32 only: torch's own bfloat16 product (where oneDNN does not run it: AVX2-only CPUs)
    is 14-16x slower on column-major weights (576 x 1536 at 64 rows: 47 ms against 2.9)."""
    for param in model.parameters():
        if param.dim() == 2:
            param.data = param.data.t().contiguous().t()


def _layer_stack(model: LlamaForCausalLM, config: EngineConfig, device: torch.device) -> str:
    """Which forward path the instance runs, and why (logged once at start-up)."""
    if model.model.kernels is not None:
        return "the compiled CPU kernels (compile: true)"
    if not config.model.compile:
        return "plain torch ops, eager (compile: false)"
    if device.type != "cpu":
        return f"plain torch ops on {device.type} (the compiled kernels are CPU-only)"
    return "plain torch ops (the CPU kernels are unavailable here: see the warning above)"


def _budget_key(cache: CacheConfig) -> str:
    if cache.gpu_memory_utilization is not None:
        return f"gpu_memory_utilization={cache.gpu_memory_utilization}"
    return f"kv_cache_memory={cache.kv_cache_memory}"


def check_model(config: EngineConfig, model_dir: Path) -> LlamaShape:
    """Refuse an unsupported architecture or TP degree before any shard starts."""
    hf_config = read_config(model_dir)
    name = config.model.model or model_dir.name
    resolve_architecture(hf_config, name)
    shape = LlamaShape.from_config(hf_config)
    tp = config.parallel.tensor_parallel_size
    check_tp_degree(name, shape.num_heads, shape.num_kv_heads, tp)
    if shape.intermediate_size % tp:
        raise ConfigError(f"intermediate_size {shape.intermediate_size} of {name!r} does not split over {tp} shards")
    return shape


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, tp: TensorParallel) -> None:
        self.config = config
        self.tp = tp
        self.device = tp.device
        self.shape = shape = check_model(config, model_dir)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.max_model_len = min(
            config.model.max_model_len or shape.max_position_embeddings, shape.max_position_embeddings
        )
        compiled = config.model.compile
        self.attention_backend = resolve_attention_backend(config.model.attention_backend, self.device)
        if self.attention_backend == "triton" and config.model.attention_backend == "auto":
            heads, kv_heads = shape.num_heads // tp.size, max(1, shape.num_kv_heads // tp.size)
            block_size = config.cache.block_size
            unusable = triton_unusable(self.device, self.dtype, heads, kv_heads, shape.head_dim, block_size)
            if unusable is not None:
                logger.warning("the Triton kernels fail on %s (%s): attention runs on torch", self.device, unusable)
                self.attention_backend = "torch"
        if self.attention_backend == "triton":
            compiled = False  # the CPU kernels are the torch backend's
            self.backend = get_backend("triton", num_kv_heads=max(1, shape.num_kv_heads // tp.size))
        else:
            self.backend = get_backend("torch", cpu_kernels=compiled, tiled_prefill=self._tiled_prefill(compiled))
        with torch.device(self.device):
            self.model = LlamaForCausalLM(shape, tp, self.backend, self.dtype, self.max_model_len, compiled)
        if self.attention_backend == "triton":
            self.model.use_triton_ops()
        if tp.rank == 0:
            logger.info("layer stack: %s", _layer_stack(self.model, config, self.device))
        self.model.load_weights(iter_safetensors(model_dir))
        if cpu_packing_available(self.device, self.dtype):
            logger.info("%d linear weights packed for oneDNN", pack_linear_weights(self.model))
        elif self.device.type == "cpu" and self.dtype == torch.float32:
            _store_weights_column_major(self.model)
        self.model.eval()
        self.uses_graphs = (
            self.attention_backend == "triton" and self.device.type == "cuda" and not config.model.enforce_eager
        )
        self.layout = self._plan_kv_cache()
        self.kv_caches, self._kv_region = allocate_kv_caches(
            self.layout.layer_shape, shape.num_layers, self.dtype, self.device, shared=config.cache.shared_memory
        )
        self.connector: KVConnector | None = None
        if config.kv_connector.factory:
            fingerprint = model_fingerprint((model_dir / "config.json").read_bytes())
            self.connector = load_connector(
                config.kv_connector.factory, config.kv_connector.options, self.layout, self.kv_caches, fingerprint
            )
            self.model.model.layer_hook = self.connector.after_layer
        self._upload = PinnedUpload(self.device, torch.long)
        # Its own buffers: a third upload a step into _upload's two would wait for the step before.
        self._upload_carried = PinnedUpload(self.device, torch.long)
        self.graphs: DecodeGraphs | None = None
        self.graph_capture: CaptureReport | None = None
        self.num_graph_replays = 0  # decode steps replayed (the GPU check asserts the graphs ran)
        if self.uses_graphs:
            self.graphs = self.decode_graphs()
            try:
                self.graph_capture = self.graphs.capture()
            except RuntimeError as exc:  # e.g. a TP all-reduce this NCCL cannot capture
                logger.warning("CUDA graph capture failed (%s): decode steps run eagerly", exc)
                torch.cuda.synchronize(self.device)
                self.graphs = None
        if self.device.type == "cpu":
            keep_freed_memory()  # after start-up's one-off allocations: only the steps' reuse matters

    def decode_graphs(self) -> DecodeGraphs:
        """The decode buckets' graphs over this shard's model and KV cache (not yet captured)."""
        return DecodeGraphs(
            lambda input_ids, positions, meta: self.model(input_ids, positions, self.kv_caches, meta),
            max_batch=min(self.config.scheduler.max_num_seqs, MAX_GRAPH_BATCH),
            max_model_len=self.max_model_len,
            block_size=self.layout.block_size,
            num_kv_heads=self.layout.num_kv_heads,
            device=self.device,
        )

    def connector_report(self, sampled: dict[str, int] | None) -> ShardReport:
        """This shard's connector report for the step (an empty one without a connector)."""
        return self.connector.end_step(sampled) if self.connector is not None else ShardReport()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
        release_kv_caches(self._kv_region)
        self._kv_region = None

    def _tiled_prefill(self, compiled: bool) -> bool:
        """Whether this shard's prefill chunks take the tiled kernel (else SDPA): the faster here."""
        kernels = kernels_for(self.device) if compiled else None
        if kernels is None or not kernels.supports(self.dtype):
            return False
        shape, tp = self.shape, self.tp.size
        heads, kv_heads = shape.num_heads // tp, max(1, shape.num_kv_heads // tp)
        return use_tiled_prefill(kernels, self.dtype, heads, kv_heads, shape.head_dim)

    def _plan_kv_cache(self) -> KVCacheLayout:
        cache = self.config.cache
        num_kv_heads = max(1, self.shape.num_kv_heads // self.tp.size)
        dtype_name = str(self.dtype).removeprefix("torch.")
        per_block = bytes_per_block(
            self.shape.num_layers, num_kv_heads, self.shape.head_dim, cache.block_size, dtype_name
        )
        budget = cache.kv_cache_memory
        if cache.gpu_memory_utilization is not None:
            budget = self._utilization_budget(cache.gpu_memory_utilization)
        elif isinstance(budget, float):
            shards_here = self.tp.size if self.device.type == "cpu" else 1
            available = available_memory_bytes(self.device) - self._graph_memory_reserve()
            budget = int(available * budget / shards_here)
        num_blocks = self.tp.all_reduce_min_cpu(budget // per_block)
        if num_blocks < 1:
            raise ConfigError(f"{_budget_key(cache)} leaves no room for one KV block ({per_block} bytes); raise it")
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB per shard)",
            num_blocks,
            cache.block_size,
            num_blocks * per_block / 2**20,
        )
        return KVCacheLayout(
            num_layers=self.shape.num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=self.shape.head_dim,
            block_size=cache.block_size,
            num_blocks=num_blocks,
            dtype=dtype_name,
            total_kv_heads=self.shape.num_kv_heads,
            tp_size=self.tp.size,
            tp_rank=self.tp.rank,
        )

    def _utilization_budget(self, utilization: float) -> int:
        """vLLM's gpu_memory_utilization on this shard's device (CUDA only: on CPU the host's
        memory is every process's, and kv_cache_memory sizes the cache)."""
        if self.device.type != "cuda":
            raise ConfigError(
                f"gpu_memory_utilization={utilization} (--gpu-memory-utilization) sizes a GPU's memory; "
                f"this shard runs on {self.device.type}: size its KV cache with kv_cache_memory "
                "(--kv-cache-memory, a fraction of the free host memory or bytes) instead"
            )
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = self._graph_memory_reserve() + self._activation_reserve()
        return gpu_kv_budget(utilization, DeviceMemory(total=total, free=free), reserved)

    def _activation_reserve(self) -> int:
        shape, tp, scheduler = self.shape, self.tp.size, self.config.scheduler
        return activation_reserve(
            scheduler.max_num_batched_tokens,
            scheduler.max_num_seqs,
            shape.hidden_size,
            shape.num_heads // tp * shape.head_dim,
            max(1, shape.num_kv_heads // tp) * shape.head_dim,
            shape.intermediate_size // tp,
            shape.vocab_size,
            torch.empty((), dtype=self.dtype).element_size(),
        )

    def _graph_memory_reserve(self) -> int:
        """What the decode graphs' pool may take, kept out of a fractional KV budget (0 without graphs)."""
        if not self.uses_graphs:
            return 0
        shape, tp = self.shape, self.tp.size
        q_width = shape.num_heads // tp * shape.head_dim
        kv_width = max(1, shape.num_kv_heads // tp) * shape.head_dim
        max_batch = min(self.config.scheduler.max_num_seqs, MAX_GRAPH_BATCH)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return memory_reserve(
            max_batch, shape.hidden_size, q_width, kv_width, shape.intermediate_size // tp, itemsize, MAX_SPLITS
        )

    def _tensors(self, step: StepInput) -> StepTensors:
        # One host-to-device copy (pinned, non-blocking on CUDA) for the step's four int vectors.
        vectors = [step.input_ids, step.positions, step.slot_mapping, step.logits_indices]
        flat = self._upload(torch.tensor([x for v in vectors for x in v], dtype=torch.long))
        input_ids, positions, slot_mapping, logits_indices = torch.split(flat, [len(v) for v in vectors])
        return StepTensors(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            num_decodes=step.num_decodes,
            query_lens=step.query_lens,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables,
            logits_indices=logits_indices,
        )

    def _replays(self, step: StepInput, connector_step: ConnectorStep | None) -> bool:
        """Whether the step replays a decode graph: decodes only, a bucket holds them, and no KV
        push needs the layers' hook (Python the graph would not replay)."""
        if self.graphs is None or step.num_decodes != len(step.query_lens):
            return False
        if connector_step is not None and connector_step.pushes:
            return False
        return self.graphs.fits(_decode_batch(step))

    def _carried(self, carried: CarriedTokens | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input positions, token ids) on the device for the ids the host has not read."""
        if carried is None:
            return None
        n = len(carried.input_index)
        both = self._upload_carried(torch.tensor(carried.input_index + carried.sampled_rows, dtype=torch.long))
        return both[:n], carried.sampled.index_select(0, both[n:])

    @torch.inference_mode()
    def execute(
        self, step: StepInput, connector_step: ConnectorStep | None = None, carried: CarriedTokens | None = None
    ) -> torch.Tensor | None:
        """Run one step on this shard; every shard must call it with the same input. ``carried``:
        input ids still on the device (async scheduling, one shard only).

        Returns the logits [rows, vocab] in float32 on the driver, None elsewhere: the sampled
        rows (``logits_indices``), then the prompt-logprob rows (``prompt_logprob_indices``).
        """
        if self.connector is not None:
            self.connector.start_step(connector_step or ConnectorStep())
        device_ids = self._carried(carried)
        if self._replays(step, connector_step):
            assert self.graphs is not None
            hidden = self.graphs.run(_decode_batch(step), device_ids)
            self.num_graph_replays += 1
            indices = step.logits_indices
            if not indices:
                return None
            if indices == list(range(len(indices))):  # every decode samples: no index copy
                rows = hidden[: len(indices)]
            else:
                rows = hidden[self._upload(torch.tensor(indices, dtype=torch.long))]
            logits = self.model.compute_logits(rows)
            return logits.float() if logits is not None else None
        tensors = self._tensors(step)
        if device_ids is not None:
            tensors.input_ids.index_copy_(0, *device_ids)
        meta = self.backend.build_metadata(tensors, self.layout.block_size)
        hidden = self.model(tensors.input_ids, tensors.positions, self.kv_caches, meta)
        if not step.logits_indices and not step.prompt_logprob_indices:
            return None
        rows = tensors.logits_indices
        if step.prompt_logprob_indices:  # rare (prompt_logprobs): a plain copy, not the pinned buffers'
            scored = torch.tensor(step.prompt_logprob_indices, dtype=torch.long).to(self.device)
            rows = torch.cat([rows, scored])
        logits = self.model.compute_logits(hidden[rows])
        return logits.float() if logits is not None else None


def _decode_batch(step: StepInput) -> DecodeBatch:
    return DecodeBatch(step.input_ids, step.positions, step.slot_mapping, step.seq_lens, step.block_tables)
