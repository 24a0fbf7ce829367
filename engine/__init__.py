"""One model instance on one tensor-parallel group: model, paged KV cache, scheduler, sampler.

``from engine import LLM, SamplingParams`` is the offline API.
"""

from common.outputs import CompletionOutput, RequestOutput
from common.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so importing a light submodule (e.g. engine.scheduler) does not load torch or transformers.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
