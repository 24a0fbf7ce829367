"""Shared fixtures: the default model (converted once), a tiny random Llama, and the transformers oracle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.oracle import hf_greedy, load_hf
from bench.random_model import build_tiny_llama

# Keep each process to the cores it has; TP tests run several shards on this 2-core machine.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dtype=auto may pick bfloat16 on a CPU with AMX; the oracle tests compare in float32 everywhere.
os.environ.setdefault("PDSERVE_CPU_AUTO_DTYPE", "float32")
# The CPU layer loop's prefill attention: the tiled kernel on every machine (a start-up probe would
# pick SDPA where it is faster, e.g. bfloat16 with AMX, and leave the kernel out of the oracle tests).
os.environ.setdefault("PDSERVE_PREFILL_ATTENTION", "tiled")
# The suite's replicas claim cores among themselves, not against a cluster running beside it.
os.environ.setdefault("PDSERVE_CORE_LOCK_DIR", f"/tmp/pdserve-test-cores-{os.getpid()}")


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from engine.model_loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def hf_smol(smol_dir):
    return load_hf(smol_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smol_dir) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", smol_dir)


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir):
    return load_hf(tiny_dir)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
]

_PASSAGE = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home. Later, towers "
    "of stone carried lanterns, and in the nineteenth century Fresnel lenses sent beams twenty miles out "
    "to sea. Keepers trimmed wicks, wound clockwork, and logged the weather through long winter nights. "
    "Today most lights are automated, yet sailors still read their rhythm of flashes to know where they are. "
)


def long_text(num_sections: int) -> str:
    return "".join(f"Chapter {i + 1}. {_PASSAGE}" for i in range(num_sections))


@pytest.fixture(scope="session")
def hf_reference():
    """Memoized transformers greedy outputs: (model, prompt ids, n) -> token ids."""
    cache: dict = {}

    def get(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (id(model), tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(model, prompt_ids, max_new_tokens)
        return cache[key]

    return get


_SPAN_EXPORTER = None


@pytest.fixture
def finished_spans():
    """Spans this process records, in memory: OpenTelemetry allows one tracer provider per process,
    so the first use installs it for the session and each test starts from an empty list."""
    global _SPAN_EXPORTER
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if _SPAN_EXPORTER is None:
        _SPAN_EXPORTER = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_SPAN_EXPORTER))
        trace.set_tracer_provider(provider)
    _SPAN_EXPORTER.clear()
    yield _SPAN_EXPORTER.get_finished_spans
    _SPAN_EXPORTER.clear()
