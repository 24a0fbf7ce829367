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
        scheduling_policy: str = "fcfs",
        cache_dir: str | None = None,
        compile: bool = True,
        enforce_eager: bool = False,
        attention_backend: str = "auto",
        revision: str | None = None,
        chat_template: str | None = None,
        gpu_memory_utilization: float | None = None,
    ) -> None:
        """``model``: a Hugging Face directory, a .gguf file, a Hub id (``org/name``, at
        ``revision``) or None (the default model). ``chat_template``: a file or an inline template
        replacing the model's. ``gpu_memory_utilization``: CUDA, vLLM's meaning (replaces
        ``kv_cache_memory``)."""
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
                revision=revision,
                chat_template=chat_template,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_prefill_chunk=max_prefill_chunk,
                max_num_waiting=max_num_waiting,
                max_decode_stall_s=max_decode_stall_s,
                overlap_outputs=overlap_outputs,
                async_scheduling=async_scheduling,
                policy=scheduling_policy,
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
        for params in params_list:  # a constraint that does not compile is refused before anything runs
            if params.structured_output is not None:
                params.structured_output.grammar()
        # n > 1: each choice is a request of its own (its prompt's blocks come from the prefix cache).
        work = [
            (f"offline-{next(self._ids)}", prompt, params.for_choice(i, score_prompt=i == 0))
            for prompt, params in zip(batch, params_list, strict=True)
            for i in range(params.n)
        ]
        # A prompt's other choices start once its first choice has its first token: its prompt's
        # blocks are in the prefix cache by then, and the others take them from there.
        leaders: dict[str, str] = {}
        start = 0
        for params in params_list:
            for request_id, _, _ in work[start + 1 : start + params.n]:
                leaders[request_id] = work[start][0]
            start += params.n
        outputs = self._run(work, cache_salt, use_tqdm if use_tqdm is not None else len(work) >= 8, leaders)
        return _merge_choices(outputs, [params.n for params in params_list])

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (``chat_template``'s text, else the instance's) to one
        conversation (or a list of them), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            list(
                self.tokenizer.apply_chat_template(
                    list(conv),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                    chat_template=chat_template,
                )
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self,
        work: list[tuple[str, Prompt, SamplingParams]],
        cache_salt: str | None,
        use_tqdm: bool,
        leaders: dict[str, str] | None = None,
    ):
        """Feed requests as the engine's bounded queue has room; on any error abort what is in flight.
        ``leaders``: a request waits until its leader has produced a token (or ended)."""
        leaders = leaders or {}
        pending = deque(work)
        held: list[tuple[str, Prompt, SamplingParams]] = []
        produced: set[str] = set()
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(work), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while pending or held or self.engine.has_unfinished_requests():
                pending.extendleft(reversed([item for item in held if leaders[item[0]] in produced]))
                held = [item for item in held if leaders[item[0]] not in produced]
                while pending and self.engine.can_accept():
                    request_id, prompt, params = pending.popleft()
                    if request_id in leaders and leaders[request_id] not in produced:
                        held.append((request_id, prompt, params))
                        continue
                    self.engine.add_request(request_id, prompt, params, cache_salt)
                for output in self.engine.step():
                    if output.outputs[0].new_token_ids or output.finished:
                        produced.add(output.request_id)
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


def _merge_choices(outputs: list[RequestOutput], counts: list[int]) -> list[RequestOutput]:
    """One output per prompt, its ``n`` choices as its completions (index 0..n-1), as vLLM's."""
    merged = []
    start = 0
    for count in counts:
        first, *rest = outputs[start : start + count]
        for index, other in enumerate(rest, start=1):
            completion = other.outputs[0]
            completion.index = index
            first.outputs.append(completion)
        merged.append(first)
        start += count
    return merged
