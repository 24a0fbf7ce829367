"""Accelerators as data: the roofline numbers a cost model needs, with the datasheet they come from.

``peak_flops`` is dense fp16/bf16 tensor-core throughput (no 2:4 sparsity). Bandwidths are bytes per second in
one direction. ``mfu`` and ``bandwidth_utilization`` are the shares of peak a well-tuned engine reaches: ~0.5 of
peak FLOPs on large prefill GEMMs and ~0.7 of HBM bandwidth on decode GEMVs are what DistServe and vLLM report.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense fp16/bf16 FLOP/s
    memory_bandwidth: float  # HBM bytes/s
    memory_bytes: float  # device memory
    interconnect_bandwidth: float  # bytes/s per direction between GPUs of one TP group (NVLink)
    network_bandwidth: float  # bytes/s per GPU between replicas (KV transfer across nodes)
    mfu: float = 0.5  # achieved share of peak_flops
    bandwidth_utilization: float = 0.7  # achieved share of memory_bandwidth
    memory_fraction: float = 0.9  # share of memory_bytes the engine may use (vLLM's gpu_memory_utilization)
    collective_latency_s: float = 10e-6  # fixed cost of one all-reduce (NCCL launch + sync)

    def __post_init__(self) -> None:
        for key in ("peak_flops", "memory_bandwidth", "memory_bytes", "interconnect_bandwidth", "network_bandwidth"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)} must be > 0 (hardware {self.name})")
        for key in ("mfu", "bandwidth_utilization", "memory_fraction"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"{key}={getattr(self, key)} must be in (0, 1] (hardware {self.name})")
        if self.collective_latency_s < 0:
            raise ValueError(f"collective_latency_s={self.collective_latency_s} must be >= 0")


HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOPS BF16/FP16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s total
    # (300 GB/s per direction). Network: one 200 Gb/s HDR InfiniBand NIC per GPU (DistServe's testbed class).
    "A100-80GB": Hardware(
        name="A100-80GB",
        peak_flops=312 * TB,
        memory_bandwidth=2039 * GB,
        memory_bytes=80 * GB,
        interconnect_bandwidth=300 * GB,
        network_bandwidth=25 * GB,
    ),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s total
    # (450 GB/s per direction). Network: one 400 Gb/s NDR InfiniBand NIC per GPU.
    "H100-SXM": Hardware(
        name="H100-SXM",
        peak_flops=989 * TB,
        memory_bandwidth=3350 * GB,
        memory_bytes=80 * GB,
        interconnect_bandwidth=450 * GB,
        network_bandwidth=50 * GB,
    ),
    # NVIDIA H200 SXM datasheet: same compute as H100 (989 TFLOPS BF16 dense), 4.8 TB/s HBM3e, 141 GB,
    # NVLink 900 GB/s total. Network: 400 Gb/s NDR per GPU.
    "H200": Hardware(
        name="H200",
        peak_flops=989 * TB,
        memory_bandwidth=4800 * GB,
        memory_bytes=141 * GB,
        interconnect_bandwidth=450 * GB,
        network_bandwidth=50 * GB,
    ),
    # A placeholder for a laptop/server CPU running pdserve's engine: order-of-magnitude numbers only (a few
    # hundred GFLOP/s of fp32 BLAS, ~50 GB/s DRAM, shared memory between "GPUs"). Replace it with a profile
    # (``ProfiledModel`` fitted by ``pdserve bench profile``) for predictions worth comparing with measurements.
    "cpu-local": Hardware(
        name="cpu-local",
        peak_flops=0.5 * TB,
        memory_bandwidth=50 * GB,
        memory_bytes=16 * GB,
        interconnect_bandwidth=10 * GB,
        network_bandwidth=10 * GB,
        mfu=0.3,
        bandwidth_utilization=0.5,
        memory_fraction=0.5,
        collective_latency_s=50e-6,
    ),
}


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None
