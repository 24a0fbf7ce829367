"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

from common.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from common.outputs import RequestOutput
from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

Prompt = str | Sequence[int]


class LLM:
    """One model instance for batch inference. Use as a context manager, or call ``shutdown()``."""

    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        *,
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_memory: float | int = 0.1,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_prefill_chunk: int | None = None,
        max_num_waiting: int = 4096,
        max_decode_stall_s: float | None = None,
        overlap_outputs: bool | None = None,
        async_scheduling: bool | None = None,
        cache_dir: str | None = None,
        compile: bool = True,
        enforce_eager: bool = False,
        attention_backend: str = "auto",
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,
                device=device,
                max_model_len=max_model_len,
                cache_dir=cache_dir,
                compile=compile,
                enforce_eager=enforce_eager,
                attention_backend=attention_backend,
            ),
            cache=CacheConfig(
                block_size=block_size, kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_prefill_chunk=max_prefill_chunk,
                max_num_waiting=max_num_waiting,
                max_decode_stall_s=max_decode_stall_s,
                overlap_outputs=overlap_outputs,
                async_scheduling=async_scheduling,
            ),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the prompts' order. Prompts are strings or token-id lists."""
        batch: list[Prompt] = (
            [prompts]  # type: ignore[list-item]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else list(prompts)  # type: ignore[arg-type]
        )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise ValueError(f"{len(params_list)} sampling params for {len(batch)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in batch]
        return self._run(
            list(zip(ids, batch, params_list, strict=True)),
            cache_salt,
            use_tqdm if use_tqdm is not None else len(batch) >= 8,
        )

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            list(
                self.tokenizer.apply_chat_template(
                    list(conv), add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, work: list[tuple[str, Prompt, SamplingParams]], cache_salt: str | None, use_tqdm: bool):
        """Feed requests as the engine's bounded queue has room; on any error abort what is in flight."""
        pending = deque(work)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(work), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while pending or self.engine.has_unfinished_requests():
                while pending and self.engine.can_accept():
                    request_id, prompt, params = pending.popleft()
                    self.engine.add_request(request_id, prompt, params, cache_salt)
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id, _, _ in work:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            self.engine.step()  # emits the aborted requests' final outputs, freeing their state
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[request_id] for request_id, _, _ in work]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
