"""DistServe-style simulation: a cost model (analytic or profiled), a discrete-event cluster simulator and the
placement search that picks pool sizes and tensor parallelism for a workload, SLO and GPU budget.

Pure Python over dataclasses (numpy only for fitting): no torch, no Ray, no wall clock.
"""

from __future__ import annotations

from bench.sim.hardware import HARDWARE, Hardware, get_hardware
from bench.sim.latency_model import AnalyticModel, LatencyModel, ProfiledModel
from bench.sim.models import MODELS, ModelShape, get_model
from bench.sim.placement import Candidate, PlacementResult, search_placement
from bench.sim.simulator import ClusterSpec, SimRequestLike, SimResult, simulate

__all__ = [
    "HARDWARE",
    "MODELS",
    "AnalyticModel",
    "Candidate",
    "ClusterSpec",
    "Hardware",
    "LatencyModel",
    "ModelShape",
    "PlacementResult",
    "ProfiledModel",
    "SimRequestLike",
    "SimResult",
    "get_hardware",
    "get_model",
    "search_placement",
    "simulate",
]
